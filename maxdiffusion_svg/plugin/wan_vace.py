"""Wan VACE: the family's own hooks and how the tools drive its generate main (ours,
:mod:`generate_vace`, since MaxDiffusion ships none). Its facts are its record,
:data:`video_models.WAN_VACE`, which names this module; Wan's hooks (:mod:`hooks`) serve its
model call and factory, and ``generate_wan``'s run hands a VACE config to our main
(:func:`generate_vace.vace_to_our_main`, installed with Wan's).

``compare`` and ``calibrate`` drive the main through :data:`GENERATION`: its pipeline call
timed whole (the VACE pipeline encodes the conditions, denoises and decodes in one call).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from maxdiffusion_svg.plugin import generate_vace, generations, hooks
from maxdiffusion_svg.plugin.video_models import WAN_VACE


def install(wrap: Callable[[Any, str, Callable[..., Any]], None]) -> None:
  """Installs Wan VACE's hooks with ``wrap`` (:func:`hooks.wrap_once`: idempotent)."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion.models.wan.transformers import transformer_wan_vace
  from maxdiffusion.pipelines.wan import wan_vace_pipeline_2_1
  # pylint: enable=import-outside-toplevel
  wrap(transformer_wan_vace.WanVACEModel, "__call__", hooks.model_call_hook)  # overrides WanModel's
  wrap(wan_vace_pipeline_2_1, "create_sharded_logical_transformer", hooks.create_transformer_hook)


def _watching(before_call: generations.BeforeCall,
              on_step: generations.OnStep) -> contextlib.AbstractContextManager:
  """Our VACE main watched (:meth:`generations.Generation.watch`)."""
  return generations.watching_main(generate_vace, before_call, on_step,
                                   lambda _, wall_seconds: wall_seconds)


GENERATION = generations.Generation(
    WAN_VACE, "seconds per denoising step of the real run: the whole pipeline call (the "
              "conditions' VAE encoding, denoising and decoding) over its steps; compile warm-up "
              "excluded", _watching)
