"""LTX-2 and LTX-2.3 (``generate_ltx2``): the family's hooks and how the tools drive its main.

Its facts (grid, depth, which transformer class it is and where its self-attention ops sit, what
runs dense by design, the FLOP model of its step) are its record, :data:`video_models.LTX2`,
which names this module; the installer and ``compare``/``calibrate`` find :func:`install` and
:data:`GENERATION` through it.

LTX-2's attention calls reach the kernel as 3-D ``[B, S, H*D]`` q/k/v, none with a residual
checkpoint name, so the kernel cannot tell video self-attention from the rest by the call: it
goes by the op. Each block's ``attn1`` (video self-attention) is tagged with its layer, as
Wan's are; every other op of a block (audio self-attention, the text and audio-video
cross-attentions) is untagged and runs dense, counted as such.

* ``ltx2_pipeline.create_sharded_logical_transformer``: the Wan factory hook's job (settings
  checked before weights load, the model prepared, the settings line logged).
* ``LTX2VideoTransformer3DModel.__call__``: the grid from its ``num_frames``/``height``/
  ``width`` arguments (latent units, static ints) over the patch size; the step from its
  ``timestep`` against the run's schedule, traced, as for Wan.
* ``LTX2Pipeline.__call__`` and ``FlaxFlowMatchScheduler.set_timesteps_ltx2``: the run's
  timesteps written into the transformer before the pipeline splits it; the run summary.
* ``generate_ltx2.run``: the job's pre-flight checks; its ``maybe_tune_block_sizes``: our
  tile search instead of MaxDiffusion's (:mod:`tile_tuning`).

``compare`` and ``calibrate`` drive ``generate_ltx2`` through :data:`GENERATION`: its
``call_pipeline`` (the output's ``timings`` give the denoising seconds; the steps run in one
compiled loop) and ``export_to_video_with_audio``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

from maxdiffusion_svg.measure import video_metrics
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plugin import generations, hooks, hooks_entry, tile_tuning
from maxdiffusion_svg.plugin.video_models import LTX2

LTX2_MODEL = LTX2.model_class


def _grid(model: Any, frames: Any, height: Any, width: Any) -> VideoGrid:
  """The packed video's grid from the call's latent sizes, which must be static ints."""
  if not all(isinstance(x, int) for x in (frames, height, width)):
    raise ValueError(f"attention='svg': {LTX2_MODEL} was called without static num_frames, "
                     f"height and width (got {frames!r}, {height!r}, {width!r}); the svg "
                     f"kernel needs the video's latent grid, which LTX-2's pipeline passes")
  p_t, p = int(getattr(model, "patch_size_t", 1)), int(getattr(model, "patch_size", 1))
  return VideoGrid(frames // p_t, height // p, width // p)


def _model_call(original: Callable[..., Any]) -> Callable[..., Any]:
  signature = inspect.signature(original)

  @functools.wraps(original)
  def wrapper(self, *args, **kwargs):
    if not hooks.is_prepared(self):
      return original(self, *args, **kwargs)
    bound = signature.bind(self, *args, **kwargs).arguments
    grid = _grid(self, bound.get("num_frames"), bound.get("height"), bound.get("width"))
    with hooks.model_call(hooks.call_of(self, grid, bound["timestep"])):
      return original(self, *args, **kwargs)

  return wrapper


def install(wrap: Callable[[Any, str, Callable[..., Any]], None]) -> None:
  """Installs LTX-2's hooks with ``wrap`` (:func:`hooks.wrap_once`: idempotent)."""
  # pylint: disable=import-outside-toplevel
  # MaxDiffusion's LTX-2 modules import TensorFlow before transformers imports Triton, whose
  # library then crashes the process as it loads (TensorFlow 2.21 with Triton 3.x, where torch
  # brings Triton); loaded first, Triton is fine.
  with contextlib.suppress(ImportError):
    import triton  # noqa: F401  # pylint: disable=unused-import
  from maxdiffusion import generate_ltx2
  from maxdiffusion.models.ltx2 import transformer_ltx2
  from maxdiffusion.pipelines.ltx2 import ltx2_pipeline
  from maxdiffusion.schedulers import scheduling_flow_match_flax

  # pylint: enable=import-outside-toplevel
  wrap(transformer_ltx2.LTX2VideoTransformer3DModel, "__call__", _model_call)
  wrap(ltx2_pipeline, "create_sharded_logical_transformer",
       hooks.create_transformer_hook)
  wrap(ltx2_pipeline.LTX2Pipeline, "__call__", hooks.pipeline_call_hook)
  wrap(scheduling_flow_match_flax.FlaxFlowMatchScheduler, "set_timesteps_ltx2",
       hooks.set_timesteps_hook)
  wrap(generate_ltx2, "run", hooks_entry.preflight_run)
  wrap(generate_ltx2, "maybe_tune_block_sizes", tile_tuning.tune_block_sizes_hook)


@contextlib.contextmanager
def _watching(before_call: generations.BeforeCall,
              on_step: generations.OnStep) -> Iterator[dict[str, Any]]:
  """``generate_ltx2`` watched (:meth:`generations.Generation.watch`)."""
  from maxdiffusion import generate_ltx2  # pylint: disable=import-outside-toplevel
  seen = generations.seen_record()
  call, export = generate_ltx2.call_pipeline, generate_ltx2.export_to_video_with_audio

  def denoising(out: Any, _: float) -> float:
    return (getattr(out, "timings", None) or {}).get("Denoising", float("nan"))

  @functools.wraps(call)
  def call_pipeline(config, pipeline, *args, **kwargs):
    out = generations.watched_call(seen, pipeline, before_call,
                                   lambda: call(config, pipeline, *args, **kwargs), denoising)
    if len(seen["calls"]) % 2 == 0:  # the real call: its steps all at once
      for _ in range(int(config.num_inference_steps)):
        on_step()
    return out

  def export_to_video_with_audio(*args, **kwargs):
    video = kwargs["video"] if "video" in kwargs else args[0]
    seen["frames"].append(video_metrics.as_frames(video))
    return export(*args, **kwargs)

  with generations.patched((generate_ltx2, "call_pipeline", call_pipeline),
                           (generate_ltx2, "export_to_video_with_audio",
                            export_to_video_with_audio)):
    yield seen


GENERATION = generations.Generation(
    LTX2, "seconds per denoising step of the real run (the pipeline's Denoising timing; compile "
          "warm-up excluded)", _watching)
