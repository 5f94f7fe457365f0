"""MaxDiffusion's own Wan trainer (``train_wan``) on a tiny random Wan 2.1, in this process.

Synthetic data (``dataset_type: synthetic``: latents and text embeddings drawn at random, so no
dataset, VAE encode or text encoder runs per step), a tiny diffusers checkpoint
(:mod:`tiny_checkpoint`) loaded offline, and every step's loss captured as the trainer records
it (its log prints each step's loss one step late and never the last).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence
from unittest import mock

from maxdiffusion_svg.plugin import launcher

# A 33-frame 128x128 video: latents (2, 4, 9, 16, 16), a 9x8x8 = 576-token grid. Batch 2 (one
# device): the trainer's timestep sampler squeezes a batch of 1 into a scalar.
TINY = ["height=128", "width=128", "num_frames=33", "per_device_batch_size=2",
        "weights_dtype=float32", "activations_dtype=float32", "skip_jax_distributed_system=True",
        "hardware=cpu", "dataset_type=synthetic", "flash_min_seq_length=0", "run_name=tiny_train",
        "remat_policy=NONE",
        # SVG at test scale: 128-token tiles, no length floor, 16 probe rows, the XLA path
        "svg_block_q=128", "svg_block_kv=128", "svg_min_seq_length=0",
        "svg_profile_queries=16", "svg_backend=xla"]


@contextlib.contextmanager
def _losses() -> Iterator[list[float]]:
  from maxdiffusion import train_utils  # pylint: disable=import-outside-toplevel
  losses: list[float] = []
  original = train_utils.record_scalar_metrics

  def record(metrics: Any, *args: Any, **kwargs: Any) -> Any:
    losses.append(float(metrics["scalar"]["learning/loss"]))
    return original(metrics, *args, **kwargs)

  with mock.patch.object(train_utils, "record_scalar_metrics", record):
    yield losses


def train(argv: Sequence[str], workdir: str) -> tuple[list[float], list[dict[str, Any]]]:
  """Runs ``python -m maxdiffusion_svg.train`` on ``argv`` (``[config, key=value ...]``, the tiny
  keys :data:`TINY` are the caller's to add) from ``workdir``: each step's loss, and the svg
  kernel's call log (:func:`maxdiffusion_svg.plugin.record_calls`)."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxdiffusion_svg import plugin  # pylint: disable=import-outside-toplevel
  cwd = os.getcwd()
  os.chdir(workdir)
  try:
    with _losses() as losses, plugin.record_calls() as log:
      launcher.run(["maxdiffusion_svg.train", *argv, f"output_dir={workdir}/out"], launcher.TRAIN)
      jax.effects_barrier()
  finally:
    os.chdir(cwd)
  return losses, log
