"""Installs every hook once: Wan's (:mod:`hooks`), each family module's own (its record's
:attr:`~video_models.VideoModel.module`: :mod:`ltx2`, :mod:`wan_animate`, :mod:`wan_vace`)
and the entry points' (:mod:`hooks_entry`; Wan VACE's hand-over from ``generate_wan`` in
:mod:`generate_vace`; the tile search in :mod:`tile_tuning`)."""

from __future__ import annotations

import importlib
from typing import Iterator

from maxdiffusion_svg.plugin import contract, generate_vace, hooks, hooks_entry, tile_tuning
from maxdiffusion_svg.plugin.video_models import EVERY_FAMILY


def _all_subclasses(cls: type) -> Iterator[type]:
  for sub in cls.__subclasses__():
    yield sub
    yield from _all_subclasses(sub)


def install() -> None:
  """Installs every hook (idempotent). Imports MaxDiffusion's modules of every family."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion import aot_cache, generate_wan
  from maxdiffusion.models import attention_flax
  from maxdiffusion.models.wan.transformers import transformer_wan
  # every Wan pipeline module, so that the loop below finds each pipeline class
  from maxdiffusion.pipelines.wan import (wan_pipeline, wan_pipeline_2_1, wan_pipeline_2_2,  # noqa: F401
                                          wan_pipeline_animate, wan_pipeline_i2v_2p1,
                                          wan_pipeline_i2v_2p2, wan_vace_pipeline_2_1)
  from maxdiffusion.schedulers import scheduling_unipc_multistep_flax
  # pylint: enable=import-outside-toplevel
  contract.check()  # before wrapping anything: a drifted MaxDiffusion fails here, named
  wrap = hooks.wrap_once  # looked up per call: a test records what is wrapped
  wrap(transformer_wan.WanModel, "__call__", hooks.model_call_hook)
  wrap(attention_flax.NNXAttentionOp, "apply_attention", hooks.binding_self(hooks.ATTENTION_OP))
  wrap(wan_pipeline, "create_sharded_logical_transformer", hooks.create_transformer_hook)
  # Each family's own hooks, before the pipelines' calls below: Wan Animate's call is its own.
  for family in EVERY_FAMILY:
    if family.module:
      importlib.import_module(family.module).install(wrap)
  for pipeline in _all_subclasses(wan_pipeline.WanPipeline):
    if "__call__" in vars(pipeline):
      wrap(pipeline, "__call__", hooks.pipeline_call_hook)
  wrap(scheduling_unipc_multistep_flax.FlaxUniPCMultistepScheduler, "set_timesteps",
       hooks.set_timesteps_hook)
  wrap(aot_cache, "install", hooks_entry.aot_install)
  wrap(generate_wan, "run",
       lambda run: generate_vace.vace_to_our_main(hooks_entry.preflight_run(run)))
  wrap(generate_wan, "maybe_tune_block_sizes", tile_tuning.tune_block_sizes_hook)
