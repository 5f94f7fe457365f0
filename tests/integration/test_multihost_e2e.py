"""The tiny Wan through the launcher in 2 JAX processes of 4 CPU devices, as 2 hosts of a slice:
MaxDiffusion initializes jax.distributed itself, the plugin's sharded SVG spans both, and the
denoising loop's output (the latents the VAE decodes) equals one process of 8 devices bit for
bit. The decoded video equals it to the last rounding: in this layout (2 data x 4 context, the
context shards over both processes) MaxDiffusion's VAE decode, unsplit (vae_spatial=1), rounds a
handful of pixels the other way, by one level (8 of 1.6 M here), and a dense kernel's run does
the same (its latents also identical): the difference is the decode's, not the attention's
(docs/gke.md). The MP4 encoder turns those into a 58 dB difference, so MP4s are compared
between runs of one process count only.

In the full tier: the CI tier's multi-process run is test_gke_local.py's v6e-16 JobSet."""

import os
import pathlib

import numpy as np
import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.parallel.multiprocess import run_processes

ROOT = pathlib.Path(__file__).parent.parent.parent
TINY = ["height=128", "width=128", "num_frames=33", "num_inference_steps=3",
        "max_sequence_length=16", "weights_dtype=float32", "activations_dtype=float32",
        "skip_jax_distributed_system=False", "run_name=multihost", "svg_block_q=128",
        "svg_block_kv=128", "svg_min_seq_length=0", "vae_spatial=1"]
pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def job(tmp_path_factory, wan21_checkpoint):
  base = tmp_path_factory.mktemp("multihost")
  config = base / "tiny_svg.yml"
  config.write_text(yaml.safe_dump({
      "base_config": str(ROOT / "configs" / "wan_svg_1_3b.yml"), "svg_density": 0.3,
      "svg_active_steps": [1, -1], "svg_active_layers": [1, -1], "svg_profile_queries": 16}))
  checkpoint = wan21_checkpoint  # each process copies it (multihost_workers)
  here = str(pathlib.Path(__file__).parent)
  env = {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
         "HF_HUB_OFFLINE": "1"}
  return base, {"argv": [str(config), *TINY], "checkpoint": checkpoint}, env


def run(job, processes, kernel="svg"):
  """Each process's info, exported frames and denoised latents."""
  base, args, env = job
  workdir = base / f"{processes}proc{'' if kernel == 'svg' else '_' + kernel}"
  argv = args["argv"] + ([] if kernel == "svg" else [f"attention={kernel}"])
  infos = run_processes("multihost_workers:launch", processes, devices_per_process=8 // processes,
                        args={**args, "argv": argv, "workdir": str(workdir)}, env=env,
                        timeout=900, initialize=False)
  load = lambda name: [np.load(workdir / f"process{i}" / name) for i in range(processes)]
  return infos, load("frames.npy"), load("latents.npy")


@pytest.fixture(scope="module")
def one_process(job):
  return run(job, 1)


@pytest.fixture(scope="module")
def two_processes(job):
  return run(job, 2)


def within_a_level(video, reference):
  differ = np.abs(video.astype(int) - reference.astype(int))
  assert differ.max() <= 1 and (differ > 0).mean() < 1e-4, (differ.max(), (differ > 0).mean())


def test_two_hosts_write_the_video_of_one(one_process, two_processes):
  one_info, (one,), (one_latents,) = one_process
  infos, frames, latents = two_processes
  assert one_info[0]["process_count"] == 1 and one_info[0]["devices"] == 8
  assert one_info[0]["sparse_calls"] > 0  # SVG ran (the call log works in one process)
  for info, video, denoised in zip(infos, frames, latents):
    # Every process joined one 8-device job (MaxDiffusion's own jax.distributed.initialize)...
    assert (info["process_count"], info["devices"], info["local_devices"]) == (2, 8, 4)
    # ...and exported the video: generate_wan writes the MP4 in every process's working
    # directory (only its TensorBoard writer is process 0's).
    assert info["videos"] == one_info[0]["videos"] and len(info["videos"]) == 1
    # The denoising loop (the svg kernel, its routing, the head exchange over both processes)
    # gives the 1-process latents bit for bit; the decode rounds a few pixels the other way.
    np.testing.assert_array_equal(denoised, one_latents)
    within_a_level(video, one)
  np.testing.assert_array_equal(frames[0], frames[1])  # the two processes' videos are one


def test_a_dense_kernels_job_holds_to_the_same_bounds(job):
  """MaxDiffusion's own dot_product kernel in the same job: identical latents and the decode's
  one-level rounding, as with svg (measured on the v6e-8 layout, docs/gke.md: 12 values of
  1.6 M with dot_product, 11 with svg)."""
  (_,), (one,), (one_latents,) = run(job, 1, "dot_product")
  _, frames, latents = run(job, 2, "dot_product")
  for video, denoised in zip(frames, latents):
    np.testing.assert_array_equal(denoised, one_latents)
    within_a_level(video, one)


def test_patched_generate_on_two_hosts_writes_the_launchers_video(job, two_processes,
                                                                  patched_maxdiffusion):
  """The upstreamable entry point: plugins load after MaxDiffusion's distributed init, and its
  2-process MP4 is the 2-process launcher's, byte for byte."""
  base, args, env = job
  env = {**env, "PYTHONPATH": os.pathsep.join([str(patched_maxdiffusion / "src"),
                                               env["PYTHONPATH"]])}
  workdir = base / "patched"
  infos = run_processes("multihost_workers:patched_generate", 2, devices_per_process=4,
                        args={**args, "workdir": str(workdir)}, env=env, timeout=900,
                        initialize=False)
  del two_processes  # run first: its MP4 is the reference
  reference = next((base / "2proc" / "process0").glob("wan_output_*.mp4")).read_bytes()
  for info in infos:
    assert (info["process_count"], info["devices"]) == (2, 8)
    (mp4,) = info["videos"]
    assert pathlib.Path(mp4).read_bytes() == reference
