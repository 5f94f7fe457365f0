"""Which model family a transformer is, and where its self-attention ops sit: Wan (its blocks'
``attn1``), Wan VACE (and its control blocks, dense by design), Wan Animate and LTX-2 (each
block's video ``attn1``). Read by the hooks; no MaxDiffusion import.
"""

from __future__ import annotations

from typing import Any, Iterator

from maxdiffusion_svg.plugin import contract
from maxdiffusion_svg.plugin.video_models import (LTX2, VACE_BLOCKS, WAN, WAN_ANIMATE, WAN_VACE,
                                                  VideoModel)

LTX2_MODEL = "LTX2VideoTransformer3DModel"


def is_ltx2(model: Any) -> bool:
  """An LTX-2 transformer (MaxDiffusion's ``LTX2VideoTransformer3DModel`` or a subclass)."""
  return any(cls.__name__ == LTX2_MODEL for cls in type(model).__mro__)


def ltx2_self_attention_ops(model: Any) -> Iterator[tuple[Any, int | None]]:
  """(op, layer) of each block's video self-attention ``attn1``; layer None for the stacked
  op of ``scan_layers``."""
  contract.require_attributes(model, LTX2_MODEL, ("scan_layers", "transformer_blocks",
                                                  "num_layers"),
                              "the svg kernel tags each block's video self-attention")
  blocks = [(model.transformer_blocks, None)] if model.scan_layers else [
      (block, i) for i, block in enumerate(model.transformer_blocks)]
  for block, layer in blocks:
    op = getattr(getattr(block, "attn1", None), "attention_op", None)
    if op is None or not hasattr(op, "apply_attention") or not hasattr(op, "heads"):
      raise contract.MaxDiffusionDrift(
          f"MaxDiffusion drift: {LTX2_MODEL}'s transformer_blocks should hold video "
          f"self-attention as attn1.attention_op (an NNXAttentionOp), found "
          f"{type(op).__name__ if op is not None else 'no attn1.attention_op'}; "
          f"maxdiffusion_svg is tested with MaxDiffusion {contract.TESTED_COMMIT}.")
    yield op, layer


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
  if is_ltx2(model):
    return LTX2
  if any(cls.__name__ == ANIMATE_MODEL for cls in type(model).__mro__):
    return WAN_ANIMATE
  return WAN_VACE if getattr(model, "vace_blocks", None) is not None else WAN


# The kernel tells self-attention from cross-attention by this name, which WanModel gives
# its blocks' attn1 ops.
SELF_ATTENTION_CHECKPOINT_NAME = "self_attn"


def self_attention_ops(model: Any) -> Iterator[tuple[Any, int | None]]:
  """(op, layer) for every video self-attention op; layer None for the stacked scanned op."""
  if is_ltx2(model):
    yield from ltx2_self_attention_ops(model)
    return
  contract.require_attributes(model, type(model).__name__, ("scan_layers", "blocks", "num_layers"),
                              "the svg kernel tags each block's self-attention with its layer")
  blocks = [(model.blocks, None)] if model.scan_layers else [
      (block, i) for i, block in enumerate(model.blocks)]
  for block, layer in blocks:
    attn = getattr(block, "attn1", None)
    op = getattr(attn, "attention_op", None)
    name = getattr(op, "residual_checkpoint_name", None)
    if name != SELF_ATTENTION_CHECKPOINT_NAME:
      raise contract.MaxDiffusionDrift(
          f"MaxDiffusion drift: {type(model).__name__}'s blocks should hold self-attention as "
          f"attn1.attention_op with residual_checkpoint_name {SELF_ATTENTION_CHECKPOINT_NAME!r} "
          f"(how the svg kernel tells it from cross-attention), found "
          f"{type(op).__name__ if op is not None else 'no attn1.attention_op'} with {name!r}; "
          f"maxdiffusion_svg is tested with MaxDiffusion {contract.TESTED_COMMIT}.")
    yield op, layer
