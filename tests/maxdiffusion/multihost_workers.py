"""What each JAX process runs in the multi-host tests (maxdiffusion_svg.multiprocess)."""

import glob
import os


def launch(index, args):
  """The launcher in this process, in its own working directory; MaxDiffusion initializes
  jax.distributed itself (from the job's environment) in pyconfig."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin import e2e  # pylint: disable=import-outside-toplevel
  workdir = os.path.join(args["workdir"], f"process{index}")
  os.makedirs(workdir, exist_ok=True)
  out = e2e.generate(args["argv"], workdir)
  np.save(os.path.join(workdir, "frames.npy"), out["frames"])
  return {"process_count": jax.process_count(), "devices": jax.device_count(),
          "local_devices": jax.local_device_count(),
          "videos": sorted(os.path.basename(p) for p in glob.glob(f"{workdir}/*.mp4")),
          "sparse_calls": sum(call["sparse"] for call in out["log"])}


def patched_generate(index, args):
  """``python -m maxdiffusion.generate CONFIG ...`` of a patched MaxDiffusion (first on
  PYTHONPATH), as each host of a job runs it: its plugin entry points load the svg kernel."""
  import runpy  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  workdir = os.path.join(args["workdir"], f"process{index}")
  os.makedirs(workdir, exist_ok=True)
  os.chdir(workdir)
  sys.argv = ["maxdiffusion.generate", *args["argv"]]
  try:
    runpy.run_module("maxdiffusion.generate", run_name="__main__", alter_sys=True)
  except SystemExit as stop:  # absl's app.run exits when main returns
    if stop.code not in (None, 0):
      raise
  return {"process_count": jax.process_count(), "devices": jax.device_count(),
          "videos": sorted(glob.glob(f"{workdir}/*.mp4"))}
