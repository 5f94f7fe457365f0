"""Checks that a job can run as configured, made after ``jax.distributed`` starts and before any
weights load.

Every process of a multi-host job runs the same checks on the same inputs, so a bad job
fails in every process at once with the same message, and no process is left waiting in a
collective for a peer that already exited. Nothing here imports MaxDiffusion: the hook that
calls :func:`check_job` (``hooks_entry.preflight_run``) reads the values from MaxDiffusion's config.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping


# TPU types whose number counts TensorCores (two per chip, one JAX device per chip: megacore).
_CORE_COUNTED = ("v2", "v3", "v4", "v5p")
# TPU7x counts TensorCores too, and each is its own JAX device (libtpu: two per chip).


@dataclasses.dataclass(frozen=True)
class Job:
  """What the processes of a job see of it."""

  process_count: int
  device_count: int
  local_device_count: int
  context_shards: int  # the mesh's context axis (where the head exchange runs)
  heads: int  # the transformer's attention heads
  output_dir: str = ""
  run_name: str = ""
  ulysses_shards: Any = -1  # MaxDiffusion's key: devices exchanging heads (-1: all of context)
  backend: str = "auto"  # svg_backend
  layouts: tuple[str, ...] = ()  # svg_layouts
  dense_frames: int = 0  # svg_dense_frames
  # the per-layer and per-head keys set for the run's experts (ring_plan.budget_keys)
  budgets: tuple[str, ...] = ()
  per_device_batch_size: float = 1.0


class Refusal(ValueError):
  """A job the run's checks stop before weights load: the launcher prints it in one line and
  exits 2, in every process."""


def declared_hosts(env: Mapping[str, str]) -> tuple[int, str] | None:
  """How many processes the launcher started, and the variable that says so (GKE's TPU webhook
  sets ``TPU_WORKER_HOSTNAMES``; Open MPI-style launchers ``OMPI_COMM_WORLD_SIZE``)."""
  hostnames = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  if len(hostnames) > 1:
    return len(hostnames), "TPU_WORKER_HOSTNAMES"
  for name in ("JAX_NUM_PROCESSES", "OMPI_COMM_WORLD_SIZE"):
    if env.get(name, "").strip().isdigit():
      return int(env[name]), name
  return None


def slice_devices(accelerator_type: str) -> int | None:
  """JAX devices of a TPU slice type (``v6e-16`` -> 16, ``v5p-8`` -> 4: v4 and v5p count
  TensorCores; ``tpu7x-8`` -> 8: one device per TensorCore); None for a name that is not
  ``<generation>-<count>``."""
  match = re.fullmatch(r"(v\d+[a-z]*?|tpu7x|v7x)(?:litepod)?-(\d+)", accelerator_type.strip())
  if match is None:
    return None
  count = int(match.group(2))
  return count // 2 if match.group(1) in _CORE_COUNTED else count


# A slice type's name prefix -> the TPU generation (target.GENERATIONS' names).
_SLICE_GENERATIONS = {"v4": "v4", "v5litepod": "v5e", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e",
                      "tpu7x": "tpu7x", "v7x": "tpu7x"}


def slice_generation(accelerator_type: str) -> str | None:
  """The TPU generation of a slice type (``v6e-16`` -> ``v6e``, ``v5litepod-8`` -> ``v5e``);
  None for a name :func:`slice_devices` does not read."""
  if slice_devices(accelerator_type) is None:
    return None
  return _SLICE_GENERATIONS.get(accelerator_type.strip().rsplit("-", 1)[0])


# The most JAX devices one host of a generation holds (v4 and v5p count TensorCores): slice
# types up to these are single-host.
_HOST_DEVICES = {"v4": 4, "v5e": 8, "v5p": 4, "v6e": 8, "tpu7x": 8}


# MaxDiffusion's mesh axes, in the order of its ici_*/dcn_* parallelism keys.
MESH_AXES = ("data", "fsdp", "context", "tensor")


def mesh_shape(config: Mapping[str, Any], devices: int) -> dict[str, int]:
  """The mesh MaxDiffusion's ``max_utils.create_device_mesh`` builds on one slice of
  ``devices``: ``ici_{data,fsdp,context,tensor}_parallelism`` (the context axis only where the
  config has both ``ici_`` and ``dcn_context_parallelism``), one of them -1 for the devices the
  others leave (``fill_unspecified_mesh_axes``), named by ``mesh_axes``. The ``dcn_*`` keys
  split slices, and one slice has none to split."""
  context = "ici_context_parallelism" in config and "dcn_context_parallelism" in config
  keys = [f"ici_{axis}_parallelism" for axis in MESH_AXES if axis != "context" or context]
  for key in keys:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
      raise ValueError(f"{key} must be a positive integer or -1 (the devices the other axes "
                       f"leave), got {value!r}")
  values = [config[key] for key in keys]
  auto = [key for key, value in zip(keys, values) if value == -1]
  if len(auto) > 1:
    raise ValueError(f"{' and '.join(auto)} are all -1: MaxDiffusion fills at most one "
                     f"ici_*_parallelism axis with the devices left; give the others sizes")
  given = math.prod(value for value in values if value != -1)
  if auto and devices % given:
    raise ValueError(f"{auto[0]} is -1, but the other ici_*_parallelism sizes multiply to "
                     f"{given}, which does not divide the slice's {devices} devices")
  if auto:
    values[values.index(-1)] = devices // given
  if math.prod(values) != devices:
    sizes = " x ".join(f"{key} {value}" for key, value in zip(keys, values))
    raise ValueError(f"{sizes} do not make the slice's {devices} devices: give sizes whose "
                     f"product is {devices}, or -1 on one axis for the devices left")
  names = list(config.get("mesh_axes") or MESH_AXES)
  if len(names) != len(values):
    raise ValueError(f"mesh_axes names {len(names)} axes ({', '.join(names)}), but the config "
                     f"sizes {len(values)} ({', '.join(keys)})")
  return dict(zip(names, values))


def check_batch(per_device_batch_size: float, devices: int) -> None:
  """MaxDiffusion generates ``int(devices x per_device_batch_size)`` videos; none is a batch its
  tokenizer fails on, far into the run."""
  if int(devices * per_device_batch_size) < 1:
    least = math.ceil(1000 / devices) / 1000
    raise ValueError(f"per_device_batch_size {per_device_batch_size:g} on {devices} devices makes "
                     f"a batch of 0 videos (MaxDiffusion's int(devices x per_device_batch_size)): "
                     f"give per_device_batch_size={least:g} or more (one video on {devices} "
                     f"devices), or run on the slice the config was written for")


def check_processes(job: Job, env: Mapping[str, str]) -> None:
  """The processes that joined are the ones started, and they hold the whole slice.

  MaxDiffusion logs a warning and goes on alone when ``jax.distributed.initialize()`` fails,
  which would run every host as a separate one-host job writing the same video."""
  declared = declared_hosts(env)
  if declared is not None and declared[0] != job.process_count:
    count, name = declared
    raise ValueError(
        f"{name} declares {count} processes, but jax.distributed joined {job.process_count} "
        f"(with {job.device_count} devices): distributed initialisation failed or timed out "
        f"(MaxDiffusion logs a warning and continues alone). Check the coordinator address "
        f"and that every host of the slice started; set skip_jax_distributed_system=False.")
  accelerator = env.get("TPU_ACCELERATOR_TYPE", "")
  expected = slice_devices(accelerator) if accelerator else None
  if (expected is not None and job.process_count == 1 and job.device_count < expected
      and expected <= _HOST_DEVICES.get(slice_generation(accelerator) or "", 0)):
    # One host holds the whole slice: a process shown part of its chips (TPU_VISIBLE_CHIPS,
    # as on a shared or borrowed VM) runs on those; no host is missing.
    return
  if expected is not None and expected != job.device_count:
    hosts = max(1, expected // max(1, job.local_device_count))
    raise ValueError(
        f"TPU_ACCELERATOR_TYPE {accelerator} has {expected} devices, but this job holds "
        f"{job.device_count} ({job.process_count} processes x {job.local_device_count}): start "
        f"one process per host of the slice ({hosts} hosts of {job.local_device_count} "
        f"devices: JobSet parallelism and completions = {hosts}).")


def check_heads(job: Job) -> tuple[int, int]:
  """The head exchange gives each device of a Ulysses group ``heads / ulysses_shards`` heads;
  unset, the group is the whole context axis. Returns ``(ulysses, ring)``
  (:func:`maxdiffusion_svg.parallel.ring_plan.check_ulysses_shards`, as the kernel splits the
  axis)."""
  # Imported here: ring_plan brings JAX, which the launcher's --help must not load.
  from maxdiffusion_svg.parallel.ring_plan import (asks_for_ring, check_ulysses_shards,  # pylint: disable=import-outside-toplevel
                                          working_ulysses_shards)
  context, heads = job.context_shards, job.heads
  if heads % context and not asks_for_ring(job.ulysses_shards, context):
    allowed = [n for n in range(1, heads + 1) if heads % n == 0]
    groups = working_ulysses_shards(context, heads)
    raise ValueError(
        f"the mesh's context axis has {context} shards, which do not divide the model's "
        f"{heads} attention heads, and ulysses_shards ({job.ulysses_shards}) exchanges heads "
        f"over the whole axis. Set ulysses_shards to one of {', '.join(map(str, groups))} (heads "
        f"exchanged inside groups of that many devices, the sequence split over the rest as a "
        f"ring), or give the context axis a divisor of {heads} "
        f"({', '.join(map(str, allowed))}): move the remaining devices to another axis, e.g. "
        f"ici_data_parallelism or ici_fsdp_parallelism (ici_context_parallelism: -1 takes the "
        f"rest).")
  return check_ulysses_shards(job.ulysses_shards, context, heads)


def check_backend_on_ring(backend: str, ulysses: int, ring: int) -> None:
  """Splash runs whole sequences: a ring shard's rows of the plan need our kernel or XLA."""
  if ring > 1 and backend == "splash":
    raise ValueError(
        f"svg_backend is splash, which cannot run a ring shard's rows: ulysses_shards "
        f"{ulysses} leaves a ring of {ring} sequence shards on this mesh. Set svg_backend to "
        f"pallas (our kernel, the TPU default), xla or auto.")


def check_dense_frames_on_ring(dense_frames: int, ulysses: int, ring: int) -> None:
  """The run's refusal of ``svg_dense_frames`` on a ring, before weights load."""
  from maxdiffusion_svg.parallel.ring_plan import check_dense_frames_on_ring as check  # pylint: disable=import-outside-toplevel
  check(dense_frames, ulysses, ring)


def check_ring(job: Job, ulysses: int, ring: int) -> str:
  """What the run's ring accepts of the job's settings, by the run's own check
  (:func:`maxdiffusion_svg.parallel.ring_plan.check_on_ring`) and the backend: the note the run
  logs of the layouts (a ring leaves semantic out), or ""."""
  from maxdiffusion_svg.parallel.ring_plan import check_on_ring  # pylint: disable=import-outside-toplevel
  check_backend_on_ring(job.backend, ulysses, ring)
  return check_on_ring(ulysses, ring, dense_frames=job.dense_frames, budgets=job.budgets,
                       layouts=job.layouts)


def check_run_name(output_dir: str, run_name: str) -> None:
  """A ``gs://`` output needs a run name: MaxDiffusion uploads each video to
  ``output_dir/run_name`` only after the whole generation, and an unset name fails there."""
  if output_dir.startswith("gs://") and not run_name:
    raise ValueError(f"run_name is not set and JOBSET_NAME is not in the environment, but "
                     f"output_dir {output_dir!r} is a bucket: MaxDiffusion uploads each video "
                     f"to output_dir/run_name after generating it. Give run_name=NAME.")


def check_job(job: Job, env: Mapping[str, str]) -> None:
  """Every check, cheapest first."""
  check_run_name(job.output_dir, job.run_name)
  check_processes(job, env)
  check_batch(job.per_device_batch_size, job.device_count)
  ulysses, ring = check_heads(job)
  check_ring(job, ulysses, ring)
