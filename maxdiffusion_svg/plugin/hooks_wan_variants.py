"""The hooks' knowledge of Wan's variants: Wan VACE (``WanVACEModel``, its control blocks) and
Wan Animate (``WanAnimateTransformer3DModel``, its segments), beside :mod:`hooks` (Wan) and
:mod:`hooks_ltx2` (LTX-2).

VACE's main blocks are Wan's (tagged by :mod:`hooks`), its control blocks' self-attention is
marked dense by design; Animate's blocks are Wan's, but its pipeline splits the transformer
before each segment sets its timesteps, so the run's schedule is written before the call.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterator

from maxdiffusion_svg.plugin import contract, hooks_ltx2
from maxdiffusion_svg.video_models import (LTX2, VACE_BLOCKS, WAN, WAN_ANIMATE, WAN_VACE,
                                           VideoModel)

ANIMATE_MODEL = "WanAnimateTransformer3DModel"


def dense_by_design_ops(model: Any) -> Iterator[tuple[Any, str]]:
  """(op, kind) of self-attention that runs dense by design: a Wan VACE model's control
  blocks (``vace_blocks[*].attn1``), counted as ``vace`` calls."""
  for block in getattr(model, "vace_blocks", None) or ():
    op = getattr(getattr(block, "attn1", None), "attention_op", None)
    if op is None:
      raise contract.MaxDiffusionDrift(
          f"MaxDiffusion drift: {type(model).__name__}'s vace_blocks should hold self-attention "
          f"as attn1.attention_op; maxdiffusion_svg is tested with MaxDiffusion "
          f"{contract.TESTED_COMMIT}.")
    yield op, VACE_BLOCKS


def family(model: Any) -> VideoModel:
  """The model's family: its pixel-to-grid map and what runs dense by design."""
  if hooks_ltx2.is_ltx2(model):
    return LTX2
  if any(cls.__name__ == ANIMATE_MODEL for cls in type(model).__mro__):
    return WAN_ANIMATE
  return WAN_VACE if getattr(model, "vace_blocks", None) is not None else WAN


def animate_pipeline_call(original: Callable[..., Any]) -> Callable[..., Any]:
  """Wan Animate splits its transformer before its segments set their timesteps (each segment
  restarts the same schedule): the run's schedule is written first, from the same scheduler and
  step count, so the split state carries it (the pipeline hook then logs the summary)."""
  from maxdiffusion_svg.plugin import hooks  # pylint: disable=import-outside-toplevel
  logged = hooks._pipeline_call(original)  # pylint: disable=protected-access
  steps_default = inspect.signature(original).parameters["num_inference_steps"].default

  @functools.wraps(original)
  def wrapper(self, *args, **kwargs):
    models = hooks.prepared_transformers(self)
    if models:
      steps = kwargs.get("num_inference_steps", steps_default)
      state = self.scheduler.set_timesteps(self.scheduler_state, num_inference_steps=steps,
                                           shape=(1,))
      for model in models:
        hooks.set_denoising_schedule(model, state.timesteps)
    return logged(self, *args, **kwargs)

  return wrapper
