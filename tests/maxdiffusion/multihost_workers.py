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
