"""What each JAX process runs in the multi-host tests (maxdiffusion_svg.parallel.multiprocess).

Each process gets its own copy of the checkpoint, as each host of a slice has its own disk:
MaxDiffusion's ``load_config`` rewrites a component's ``config.json`` in place on every load, so
processes sharing one folder race on it."""

import contextlib
import glob
import os
import re
import shutil
import subprocess
import sys


def _workdir(index, args):
  workdir = os.path.join(args["workdir"], f"process{index}")
  os.makedirs(workdir, exist_ok=True)
  checkpoint = os.path.join(workdir, "checkpoint")
  if not os.path.isdir(checkpoint):
    shutil.copytree(args["checkpoint"], checkpoint)
  return workdir, [*args["argv"], f"pretrained_model_name_or_path={checkpoint}"]


@contextlib.contextmanager
def denoised_latents():
  """The latents the Wan pipeline hands its VAE decode (the denoising loop's output, gathered
  from every process), captured as ``captured["latents"]``."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from maxdiffusion.pipelines.wan import wan_pipeline  # pylint: disable=import-outside-toplevel
  captured = {}
  decode = wan_pipeline.WanPipeline._decode_latents_to_video  # pylint: disable=protected-access

  def capture(self, latents, *args, **kwargs):
    captured["latents"] = np.asarray(multihost_utils.process_allgather(latents, tiled=True))
    return decode(self, latents, *args, **kwargs)

  wan_pipeline.WanPipeline._decode_latents_to_video = capture  # pylint: disable=protected-access
  try:
    yield captured
  finally:
    wan_pipeline.WanPipeline._decode_latents_to_video = decode  # pylint: disable=protected-access


def launch(index, args):
  """The launcher in this process, in its own working directory; MaxDiffusion initializes
  jax.distributed itself (from the job's environment) in pyconfig. Saves the exported frames
  and the denoised latents the VAE decoded."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench import wan_e2e  # pylint: disable=import-outside-toplevel
  workdir, argv = _workdir(index, args)
  with denoised_latents() as captured:
    out = wan_e2e.generate(argv, workdir)
  np.save(os.path.join(workdir, "frames.npy"), out["frames"])
  np.save(os.path.join(workdir, "latents.npy"), captured["latents"])
  return {"process_count": jax.process_count(), "devices": jax.device_count(),
          "local_devices": jax.local_device_count(),
          "videos": sorted(os.path.basename(p) for p in glob.glob(f"{workdir}/*.mp4")),
          "sparse_calls": sum(call["sparse"] for call in out["log"])}


def patched_generate(index, args):
  """``python -m maxdiffusion.generate CONFIG ...`` of a patched MaxDiffusion (first on
  PYTHONPATH), as each host of a job runs it: its plugin entry points load the svg kernel."""
  import runpy  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  workdir, argv = _workdir(index, args)
  os.chdir(workdir)
  sys.argv = ["maxdiffusion.generate", *argv]
  try:
    runpy.run_module("maxdiffusion.generate", run_name="__main__", alter_sys=True)
  except SystemExit as stop:  # absl's app.run exits when main returns
    if stop.code not in (None, 0):
      raise
  return {"process_count": jax.process_count(), "devices": jax.device_count(),
          "videos": sorted(glob.glob(f"{workdir}/*.mp4"))}


def container(index, args):
  """A manifest's container command, as the pod runs it: ``args["command"]`` (``python``
  is this interpreter) with ``args["env"]``, in its own working directory. The command's own
  ``jax.distributed.initialize()`` joins the job from the environment this process was given."""
  workdir, argv = _workdir(index, args)
  command = [sys.executable if word == "python" else word for word in args["command"]]
  command = [*command, *argv]
  env = {**os.environ, **args["env"], "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}
  done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                        check=False)
  log = done.stdout + done.stderr
  with open(os.path.join(workdir, "log.txt"), "w", encoding="utf-8") as f:
    f.write(log)
  if done.returncode:
    raise RuntimeError(f"the container command exited {done.returncode}:\n{log[-5000:]}")
  return {"videos": sorted(glob.glob(f"{workdir}/*.mp4")),
          "num_devices": sorted({int(n) for n in re.findall(r"num_devices: (\d+)", log)})}
