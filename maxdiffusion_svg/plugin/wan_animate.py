"""Wan Animate (Wan 2.2 Animate 14B, ``generate_wan_animate``): the family's own hooks and how the
tools drive its main. Its facts are its record, :data:`video_models.WAN_ANIMATE`, which names
this module; Wan's hooks (:mod:`hooks`) serve its model call and factory.

* ``WanAnimatePipeline.__call__``: the pipeline splits its transformer before its segments set
  their timesteps (each segment restarts the same schedule), so the run's schedule is written
  first, from the same scheduler and step count (the pipeline hook then logs the summary).
* ``compare`` and ``calibrate`` drive ``generate_wan_animate`` through :data:`GENERATION`: the
  pipeline's ``__call__`` timed whole (the main calls the pipeline directly, and the call's
  segments each encode, denoise and decode), UniPC's step and ``export_to_video``; its
  checkpointer loads once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

from maxdiffusion_svg.plugin import generations, hooks, hooks_entry, tile_tuning
from maxdiffusion_svg.plugin.video_models import WAN_ANIMATE


def pipeline_call(original: Callable[..., Any]) -> Callable[..., Any]:
  """``WanAnimatePipeline.__call__``: the run's schedule written before the call (see the
  module's docstring), then :func:`hooks.pipeline_call_hook`'s job."""
  logged = hooks.pipeline_call_hook(original)
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


def install(wrap: Callable[[Any, str, Callable[..., Any]], None]) -> None:
  """Installs Wan Animate's hooks with ``wrap`` (:func:`hooks.wrap_once`: idempotent)."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion import generate_wan_animate
  from maxdiffusion.models.wan.transformers import transformer_wan_animate
  from maxdiffusion.pipelines.wan import wan_pipeline_animate
  # pylint: enable=import-outside-toplevel
  wrap(wan_pipeline_animate, "create_sharded_animate_transformer", hooks.create_transformer_hook)
  wrap(transformer_wan_animate.WanAnimateTransformer3DModel, "__call__", hooks.model_call_hook)
  wrap(wan_pipeline_animate.WanAnimatePipeline, "__call__", pipeline_call)
  # its main has no tile search: ours runs after the checks, before the pipeline loads
  wrap(generate_wan_animate, "run",
       lambda run: hooks_entry.preflight_run(tile_tuning.tuning_first(run)))


class _KeptCheckpointer:
  """``generate_wan_animate``'s ``WanCheckpointer`` for a tool: the first load is the real
  one, later runs get the pipeline it loaded."""

  def __init__(self, checkpointer: Any, seen: dict[str, Any]):
    self._checkpointer, self._seen = checkpointer, seen

  def load_pretrained_pipeline_or_diffusers(self, *args, **kwargs):
    if "pipeline" not in self._seen:
      self._seen["pipeline"] = self._checkpointer.load_pretrained_pipeline_or_diffusers(
          *args, **kwargs)
    return self._seen["pipeline"]


@contextlib.contextmanager
def _watching(before_call: generations.BeforeCall,
              on_step: generations.OnStep) -> Iterator[dict[str, Any]]:
  """``generate_wan_animate`` watched (:meth:`generations.Generation.watch`)."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion import generate_wan_animate
  from maxdiffusion.pipelines.wan.wan_pipeline_animate import WanAnimatePipeline
  from maxdiffusion.schedulers.scheduling_unipc_multistep_flax import (
      FlaxUniPCMultistepScheduler as scheduler)
  # pylint: enable=import-outside-toplevel
  seen = generations.seen_record()
  call, export = WanAnimatePipeline.__call__, generate_wan_animate.export_to_video

  @functools.wraps(call)
  def timed_call(self, *args, **kwargs):
    return generations.watched_call(seen, self, before_call,
                                    lambda: call(self, *args, **kwargs),
                                    lambda _, wall_seconds: wall_seconds)

  with generations.patched(
      (WanAnimatePipeline, "__call__", timed_call),
      (generate_wan_animate, "export_to_video",
       generations.exporting(export, seen, into_working_directory=True)),
      (generate_wan_animate, "WanCheckpointer",
       _KeptCheckpointer(generate_wan_animate.WanCheckpointer, seen)),
      (scheduler, "step", generations.counting_step(scheduler, seen, on_step))):
    yield seen


GENERATION = generations.Generation(
    WAN_ANIMATE, "seconds per denoising step of the real run: the whole pipeline call (every "
                 "segment's encoding, denoising and decoding) over its steps; compile warm-up "
                 "excluded", _watching, run_takes_pipeline=False)
