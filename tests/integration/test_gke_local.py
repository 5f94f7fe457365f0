"""Each GKE manifest's container command, run here as its pods would run it: the manifest's
command and environment (``$(VAR)`` expanded as Kubernetes does; the JobSet label gives
JOBSET_NAME), the image's /opt/maxdiffusion_svg being this checkout, the bucket a local folder,
and the tiny checkpoint with its sizes as overrides. Each runs in 1 process holding the whole
slice's devices and in 2 processes (hosts) joined by MaxDiffusion's jax.distributed.initialize().

Then the bad jobs: each fails in every process, with the plugin's message, before weights load."""

import math
import os
import pathlib
import re

import numpy as np
import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.parallel.multiprocess import ProcessesFailed, run_processes

ROOT = pathlib.Path(__file__).parent.parent.parent
GKE = ROOT / "scripts" / "gke"
TINY = ["height=128", "width=128", "num_frames=33", "num_inference_steps=3",
        "max_sequence_length=16", "weights_dtype=float32", "activations_dtype=float32",
        "svg_block_q=128", "svg_block_kv=128", "svg_min_seq_length=0",
        "svg_profile_queries=16"]
IMAGE_PLUGIN = "/opt/maxdiffusion_svg"  # where scripts/gke/Dockerfile puts the stage


def container_of(manifest: str):
  """(command, env, devices of the slice) of a JobSet manifest's container."""
  jobset = yaml.safe_load((GKE / manifest).read_text())
  (job,) = jobset["spec"]["replicatedJobs"]
  spec = job["template"]["spec"]
  (container,) = spec["template"]["spec"]["containers"]
  env = {}
  for var in container.get("env", []):
    if "value" in var:
      env[var["name"]] = var["value"]
    elif var["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['jobset.sigs.k8s.io/jobset-name']"):
      env[var["name"]] = jobset["metadata"]["name"]  # what the JobSet controller labels
  words = [*container["command"], *container.get("args", [])]
  words = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), w) for w in words]
  devices = spec["parallelism"] * container["resources"]["limits"]["google.com/tpu"]
  return words, env, devices


def localize(words, outputs):
  """The image's plugin folder -> this checkout; the bucket -> a local folder."""
  return [re.sub(r"gs://BUCKET/\S*", str(outputs), w.replace(IMAGE_PLUGIN, str(ROOT)))
          for w in words]


@pytest.fixture(scope="module")
def checkpoint(wan21_checkpoint):
  return wan21_checkpoint  # each process copies it (multihost_workers)


def run_container(manifest, processes, workdir, checkpoint, extra=(), env=None, **kwargs):
  words, manifest_env, devices = container_of(manifest)
  command = localize(words, workdir / "outputs")
  here = str(pathlib.Path(__file__).parent)
  child_env = {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
               "HF_HUB_OFFLINE": "1"}
  return run_processes("multihost_workers:container", processes,
                       devices_per_process=devices // processes,
                       args={"workdir": str(workdir), "command": command,
                             "env": {**manifest_env, **(env or {})},
                             "checkpoint": checkpoint, "argv": [*TINY, *extra]},
                       env=child_env, initialize=False, **kwargs), devices


def decoded_psnr(mp4, reference):
  """PSNR (dB) of one MP4's decoded frames against another's."""
  import imageio.v3 as iio  # pylint: disable=import-outside-toplevel
  video, ref = (iio.imread(path).astype(np.float64) for path in (mp4, reference))
  mse = float(np.mean((video - ref) ** 2))
  return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


# Where 1 and 2 processes differ, and why these runs decode on every device: the denoising loop
# (the svg kernel, its routing, the Ulysses exchange) is bit-exact across process counts, but
# MaxDiffusion's spatially sharded VAE decode is not (this machine: 1 vs 2 processes 40.4 dB
# with the video split 8 ways, 34.2 dB with 2 ways; identical with vae_spatial=1). So the VAE
# runs unsplit (vae_spatial=1) and the videos must be identical, byte for byte, where each
# process holds whole context groups (the v6e-16 and v6e-32 jobs: 2 data groups, one a process).
# Where the context axis spans both processes (the v6e-8 job: one 8-device group, 4 and 4), the
# latents are still identical but the unsplit decode rounds about 11 of 1.6 M values the other
# way, by one level, and a dense kernel's run does the same (12; test_multihost_e2e.py checks
# both): the MP4s then match to 65 dB, not byte for byte (docs/gke.md).
@pytest.mark.parametrize("manifest,exact", [
    # the multi-host JobSet: 4 pods of 4 chips (its two processes alone: below)
    pytest.param("jobset_v6e16.yaml", True, marks=pytest.mark.full),
    # 8 pods of 4 chips; its config's ulysses_shards 8 leaves a ring of 2 over the context axis
    pytest.param("jobset_v6e32.yaml", True, marks=pytest.mark.full),
    pytest.param("jobset_v6e8.yaml", False, marks=pytest.mark.full),  # one 8-chip host
])
def test_manifest_command_runs_in_one_and_two_processes(manifest, exact, checkpoint, tmp_path):
  one, devices = run_container(manifest, 1, tmp_path / "one", checkpoint, ["vae_spatial=1"],
                               timeout=1200)
  two, _ = run_container(manifest, 2, tmp_path / "two", checkpoint, ["vae_spatial=1"],
                         timeout=1200)
  (mp4,) = one[0]["videos"]
  reference = pathlib.Path(mp4).read_bytes()
  assert one[0]["num_devices"] == [devices]
  (first,) = two[0]["videos"]
  for info in two:
    assert info["num_devices"] == [devices]  # both processes joined one job of the slice's size
    (video,) = info["videos"]  # generate_wan exports the video in every process
    assert pathlib.Path(video).name == pathlib.Path(mp4).name
    assert pathlib.Path(video).read_bytes() == pathlib.Path(first).read_bytes()
    if exact:
      assert pathlib.Path(video).read_bytes() == reference
    else:
      assert decoded_psnr(video, mp4) > 55


# CI's time: make test-maxdiffusion runs it. make test-maxdiffusion-ci keeps the jobs failing in
# both processes of this command (below: joined by jax.distributed.initialize, stopped before
# weights load) and tests/parallel/test_multiprocess.py (two processes equal one, sharded).
@pytest.mark.full
def test_the_multi_host_jobset_runs_in_two_processes(checkpoint, tmp_path):
  """The v6e-16 JobSet's command in 2 processes (hosts): both join one job of the slice and
  export the same video (against 1 process holding every device: the full tier, above)."""
  two, devices = run_container("jobset_v6e16.yaml", 2, tmp_path, checkpoint, ["vae_spatial=1"],
                               timeout=1200)
  videos = []
  for info in two:
    assert info["num_devices"] == [devices]
    (video,) = info["videos"]
    videos.append(pathlib.Path(video).read_bytes())
  assert len(videos) == 2 and videos[0] == videos[1] and videos[0]


def failures(manifest, checkpoint, workdir, extra=(), env=None):
  """Logs of a job expected to fail in every process (none is killed for another's failure)."""
  with pytest.raises(ProcessesFailed) as failed:
    run_container(manifest, 2, workdir, checkpoint, extra, env, timeout=600,
                  kill_on_failure=False)
  results = failed.value.results
  assert [r.returncode for r in results] == [1, 1], [r.returncode for r in results]
  return [r.log for r in results]


# CI time: the two below are the full tier's (their messages: tests/plugin/test_preflight.py); the
# CI tier keeps the mechanism (every process fails, none killed) in the two after them.
@pytest.mark.full
def test_context_shards_that_do_not_divide_the_heads_fail_everywhere(checkpoint, tmp_path):
  # 16 devices all on the context axis: the tiny model's 8 heads do not divide.
  for log in failures("jobset_v6e16.yaml", checkpoint, tmp_path, ["ici_data_parallelism=1"]):
    assert "context axis has 16 shards, which do not divide the model's 8 attention heads" in log
    assert "load_time" not in log  # before the pipeline loads


@pytest.mark.full
def test_splash_on_a_ring_fails_everywhere(checkpoint, tmp_path):
  # The v6e-32 job's ulysses_shards 8 leaves a ring of 2 over its 16 context shards.
  for log in failures("jobset_v6e32.yaml", checkpoint, tmp_path, ["svg_backend=splash"]):
    assert ("svg_backend is splash, which cannot run a ring shard's rows: ulysses_shards 8 "
            "leaves a ring of 2 sequence shards on this mesh") in log
    assert "load_time" not in log


def test_a_job_short_of_the_slice_fails_everywhere(checkpoint, tmp_path):
  # The launcher declares 4 hosts; only 2 processes start.
  for log in failures("jobset_v6e8.yaml", checkpoint, tmp_path,
                      env={"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"}):
    assert "TPU_WORKER_HOSTNAMES declares 4 processes, but jax.distributed joined 2" in log
    assert "load_time" not in log


def test_a_bucket_without_a_run_name_fails_everywhere(checkpoint, tmp_path):
  for log in failures("jobset_v6e8.yaml", checkpoint, tmp_path,
                      ["output_dir=gs://bucket/out", "run_name="], env={"JOBSET_NAME": ""}):
    assert "run_name is not set and JOBSET_NAME is not in the environment" in log
