"""The job checks every process makes before weights load (maxdiffusion_svg.plugin.preflight)."""

import dataclasses
import re

import pytest

from maxdiffusion_svg.plugin import preflight

# One process of a v6e-16 job as it should be: 4 hosts x 4 chips, 2-way data x 8-way context.
GOOD = preflight.Job(process_count=4, device_count=16, local_device_count=4, context_shards=8,
                     heads=40, output_dir="gs://bucket/out", run_name="wan-svg")
GKE = {"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3", "TPU_WORKER_ID": "2",
       "TPU_ACCELERATOR_TYPE": "v6e-16"}


def test_a_good_job_passes():
  preflight.check_job(GOOD, GKE)
  preflight.check_job(dataclasses.replace(GOOD, process_count=1, device_count=8,
                                          local_device_count=8, output_dir="/tmp/out",
                                          run_name=""), {})


@pytest.mark.parametrize("name, devices", [("v6e-16", 16), ("v6e-8", 8), ("v5litepod-16", 16),
                                           ("v5p-8", 4), ("v4-32", 16), ("v6e", None),
                                           ("tpu", None), ("tpu7x-8", 8), ("tpu7x-128", 128)])
def test_slice_devices(name, devices):
  assert preflight.slice_devices(name) == devices


def test_declared_hosts():
  assert preflight.declared_hosts(GKE) == (4, "TPU_WORKER_HOSTNAMES")
  assert preflight.declared_hosts({"TPU_WORKER_HOSTNAMES": "localhost"}) is None  # one host
  assert preflight.declared_hosts({"OMPI_COMM_WORLD_SIZE": "2"}) == (2, "OMPI_COMM_WORLD_SIZE")
  assert preflight.declared_hosts({}) is None


def test_a_host_left_alone_is_refused():
  """MaxDiffusion goes on alone when jax.distributed.initialize() fails: one process, 4 devices."""
  alone = dataclasses.replace(GOOD, process_count=1, device_count=4)
  with pytest.raises(ValueError, match=r"TPU_WORKER_HOSTNAMES declares 4 processes, but "
                     r"jax.distributed joined 1 \(with 4 devices\)"):
    preflight.check_job(alone, GKE)


def test_fewer_hosts_than_the_slice_is_refused():
  """A JobSet whose parallelism (2) is short of the v6e-16's 4 hosts."""
  short = dataclasses.replace(GOOD, process_count=2, device_count=8)
  env = {**GKE, "TPU_WORKER_HOSTNAMES": "h0,h1"}
  with pytest.raises(ValueError, match=r"TPU_ACCELERATOR_TYPE v6e-16 has 16 devices, but this "
                     r"job holds 8 \(2 processes x 4\).*4 hosts of 4 devices: JobSet "
                     r"parallelism and completions = 4"):
    preflight.check_job(short, env)


def test_part_of_a_one_host_slice_is_not_a_missing_host():
  """A process shown one chip of a v5litepod-4 host (a borrowed or shared VM) runs on it; the
  same on one host of a multi-host slice is still refused."""
  one_chip = dataclasses.replace(GOOD, process_count=1, device_count=1, local_device_count=1,
                                 context_shards=1)
  for accelerator in ("v5litepod-4", "v5litepod-8", "v6e-8", "v5p-8"):
    preflight.check_processes(one_chip, {"TPU_ACCELERATOR_TYPE": accelerator})
  with pytest.raises(ValueError, match=r"TPU_ACCELERATOR_TYPE v5litepod-16 has 16 devices, but "
                     r"this job holds 1"):
    preflight.check_processes(one_chip, {"TPU_ACCELERATOR_TYPE": "v5litepod-16"})
  with pytest.raises(ValueError, match=r"v6e-8 has 8 devices, but this job holds 16"):
    preflight.check_processes(dataclasses.replace(one_chip, device_count=16),
                              {"TPU_ACCELERATOR_TYPE": "v6e-8"})


def test_context_shards_must_divide_the_heads():
  """Unset (or the whole axis), ulysses_shards exchanges heads over all 16: the message names
  both ways out, the ulysses_shards that work and the divisors of the heads."""
  for unset in (-1, 0, None, 16):
    with pytest.raises(ValueError, match=r"context axis has 16 shards, which do not divide the "
                       r"model's 40 attention heads.*Set ulysses_shards to one of 1, 2, 4, 8 .*"
                       r"\(1, 2, 4, 5, 8, 10, 20, 40\).*ici_data_parallelism"):
      preflight.check_job(dataclasses.replace(GOOD, context_shards=16, ulysses_shards=unset),
                          GKE)


# One process of a v6e-32 job: 8 hosts x 4 chips, 2-way data x 16-way context.
V6E32 = dataclasses.replace(GOOD, process_count=8, device_count=32, context_shards=16)
V6E32_ENV = {"TPU_WORKER_HOSTNAMES": ",".join(f"h{i}" for i in range(8)),
             "TPU_ACCELERATOR_TYPE": "v6e-32"}


@pytest.mark.parametrize("context, ulysses, ring", [(16, 8, 2), (16, 4, 4), (16, 2, 8),
                                                    (32, 8, 4), (8, 4, 2), (8, -1, 1), (8, 8, 1)])
def test_ulysses_shards_split_the_context_axis_into_a_ring(context, ulysses, ring):
  """The (Ulysses, ring) split is the kernel's own (ring_plan.check_ulysses_shards)."""
  job = dataclasses.replace(V6E32, context_shards=context, ulysses_shards=ulysses)
  assert preflight.check_heads(job) == (ulysses if ulysses > 0 else context, ring)
  preflight.check_job(dataclasses.replace(job, device_count=2 * context), {})


@pytest.mark.parametrize("context, ulysses, needle", [
    (16, 3, r"ulysses_shards \(3\) must divide the mesh's context axis \(16 devices\)"),
    (32, 16, r"ulysses_shards \(16\) must divide the (model's )?40 (attention )?heads"),
    (16, 32, r"ulysses_shards \(32\) must divide the mesh's context axis \(16 devices\)"),
    (16, "8", r"ulysses_shards must be an integer, got '8'"),
    (16, True, r"ulysses_shards must be an integer, got True"),
])
def test_bad_ulysses_shards_are_refused_naming_the_key(context, ulysses, needle):
  job = dataclasses.replace(V6E32, ulysses_shards=ulysses, context_shards=context)
  with pytest.raises(ValueError, match=needle) as refused:
    preflight.check_job(job, {})
  assert "\n" not in str(refused.value)
  if not isinstance(ulysses, (str, bool)):
    assert "values that work on this mesh: 1, 2, 4, 8" in str(refused.value)


@pytest.mark.parametrize("key", ["svg_layer_densities", "svg_layer_compensation",
                                 "svg_high_noise_head_densities"])
def test_per_layer_and_per_head_budgets_are_refused_where_the_mesh_leaves_a_ring(key):
  """The run's own refusal (ring_plan.check_on_ring), here before weights load."""
  ring = dataclasses.replace(V6E32, ulysses_shards=8, budgets=(key,))
  with pytest.raises(ValueError) as refused:
    preflight.check_job(ring, V6E32_ENV)
  assert str(refused.value) == (
      f"{key} does not run on a ring yet (ulysses_shards 8 leaves the sequence split over 2 "
      f"devices): set ulysses_shards to the context axis's size, or leave {key} unset")
  # Without a ring the budgets run: the v6e-16's whole context axis exchanges heads.
  preflight.check_job(dataclasses.replace(GOOD, ulysses_shards=8, budgets=(key,)), GKE)
  preflight.check_job(dataclasses.replace(ring, budgets=()), V6E32_ENV)


@pytest.mark.parametrize("backend", ["auto", "pallas", "xla", "splash"])
def test_splash_is_refused_where_the_mesh_leaves_a_ring(backend):
  ring = dataclasses.replace(V6E32, ulysses_shards=8, backend=backend)
  if backend != "splash":
    preflight.check_job(ring, V6E32_ENV)
    return
  with pytest.raises(ValueError) as refused:
    preflight.check_job(ring, V6E32_ENV)
  assert str(refused.value) == (
      "svg_backend is splash, which cannot run a ring shard's rows: ulysses_shards 8 leaves a "
      "ring of 2 sequence shards on this mesh. Set svg_backend to pallas (our kernel, the TPU "
      "default), xla or auto.")
  # Without a ring splash runs: the v6e-16's whole context axis exchanges heads.
  preflight.check_job(dataclasses.replace(GOOD, backend="splash", ulysses_shards=8), GKE)


def test_a_bucket_needs_a_run_name():
  with pytest.raises(ValueError, match="run_name is not set.*gs://bucket/out"):
    preflight.check_job(dataclasses.replace(GOOD, run_name=""), GKE)


@pytest.mark.parametrize("name, generation", [("v6e-8", "v6e"), ("v6e-16", "v6e"),
                                              ("v5litepod-16", "v5e"), ("v5e-4", "v5e"),
                                              ("v5p-8", "v5p"), ("v4-32", "v4"),
                                              ("tpu7x-8", "tpu7x"), ("v7x-8", "tpu7x"),
                                              ("v6e", None), ("v9z-8", None)])
def test_slice_generation(name, generation):
  assert preflight.slice_generation(name) == generation


WAN_MESH = {"ici_data_parallelism": 1, "ici_fsdp_parallelism": 1, "ici_context_parallelism": -1,
            "ici_tensor_parallelism": 1, "dcn_context_parallelism": -1,
            "mesh_axes": ["data", "fsdp", "context", "tensor"]}


@pytest.mark.parametrize("keys, devices, want", [
    ({}, 8, {"data": 1, "fsdp": 1, "context": 8, "tensor": 1}),  # MaxDiffusion's Wan default
    ({"ici_data_parallelism": 2}, 16, {"data": 2, "fsdp": 1, "context": 8, "tensor": 1}),
    ({"ici_context_parallelism": 4, "ici_fsdp_parallelism": -1}, 8,
     {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}),
    ({"ici_context_parallelism": 2, "ici_data_parallelism": 4}, 8,
     {"data": 4, "fsdp": 1, "context": 2, "tensor": 1}),
])
def test_the_mesh_fills_the_one_unsized_axis(keys, devices, want):
  assert preflight.mesh_shape({**WAN_MESH, **keys}, devices) == want


def test_without_a_dcn_context_key_there_is_no_context_axis():
  """MaxDiffusion sizes the context axis only where both ici_ and dcn_context_parallelism are
  keys of the config."""
  keys = {k: v for k, v in WAN_MESH.items() if k not in ("dcn_context_parallelism",)}
  keys.update(ici_data_parallelism=-1, mesh_axes=["data", "fsdp", "tensor"])
  assert preflight.mesh_shape(keys, 8) == {"data": 8, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize("keys, devices, needle", [
    ({"ici_context_parallelism": 3}, 8, "ici_context_parallelism 3 x ici_tensor_parallelism 1 do "
                                        "not make the slice's 8 devices"),
    ({"ici_data_parallelism": -1}, 8, "ici_data_parallelism and ici_context_parallelism are all "
                                      "-1"),
    ({"ici_data_parallelism": 3}, 8, "ici_context_parallelism is -1, but the other "
                                     "ici_*_parallelism sizes multiply to 3"),
    ({"ici_tensor_parallelism": 0}, 8, "ici_tensor_parallelism must be a positive integer or -1"),
    ({"ici_fsdp_parallelism": None}, 8, "ici_fsdp_parallelism must be a positive integer"),
])
def test_a_mesh_that_cannot_be_built_is_refused_naming_the_keys(keys, devices, needle):
  with pytest.raises(ValueError, match=re.escape(needle)):
    preflight.mesh_shape({**WAN_MESH, **keys}, devices)


@pytest.mark.parametrize("per_device, devices, batch", [
    (0.125, 8, 1), (0.125, 16, 2), (0.125, 4, 0), (0.3, 3, 0), (0.334, 3, 1), (1, 1, 1)])
def test_a_batch_of_no_videos_is_refused(per_device, devices, batch):
  """MaxDiffusion's global batch is int(devices x per_device_batch_size); the advice given
  makes one video."""
  if batch:
    preflight.check_batch(per_device, devices)
    return
  with pytest.raises(ValueError, match="makes a batch of 0 videos") as refused:
    preflight.check_batch(per_device, devices)
  advice = float(re.search(r"per_device_batch_size=([\d.]+)", str(refused.value)).group(1))
  assert int(devices * advice) == 1
