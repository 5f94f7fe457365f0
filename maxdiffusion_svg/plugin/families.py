"""Which model family a transformer is, and where its self-attention ops sit, read from the
families' records (:mod:`video_models`): Wan (its blocks' ``attn1``), Wan VACE (and its
control blocks, dense by design), Wan Animate and LTX-2 (each block's video ``attn1``). Read by
the hooks; no MaxDiffusion import.
"""

from __future__ import annotations

from typing import Any, Iterator

from maxdiffusion_svg.plugin import contract
from maxdiffusion_svg.plugin.video_models import (EVERY_FAMILY, VACE_BLOCKS, WAN, WAN_VACE,
                                                  VideoModel)

# Told apart in this order: by class, then by control blocks; Wan otherwise.
_RECOGNISED = tuple(f for f in EVERY_FAMILY if f.model_class or f.control_blocks)


def _is(model: Any, family: VideoModel) -> bool:
  if family.model_class:
    return any(cls.__name__ == family.model_class for cls in type(model).__mro__)
  return getattr(model, family.control_blocks, None) is not None


def family(model: Any) -> VideoModel:
  """The model's family: its pixel-to-grid map and what runs dense by design."""
  return next((f for f in _RECOGNISED if _is(model, f)), WAN)


def dense_by_design_ops(model: Any) -> Iterator[tuple[Any, str]]:
  """(op, kind) of self-attention that runs dense by design: a Wan VACE model's control
  blocks (``vace_blocks[*].attn1``), counted as ``vace`` calls."""
  for block in getattr(model, WAN_VACE.control_blocks, None) or ():
    op = getattr(getattr(block, "attn1", None), "attention_op", None)
    if op is None:
      raise contract.MaxDiffusionDrift(
          f"MaxDiffusion drift: {type(model).__name__}'s vace_blocks should hold self-attention "
          f"as attn1.attention_op; maxdiffusion_svg is tested with MaxDiffusion "
          f"{contract.TESTED_COMMIT}.")
    yield op, VACE_BLOCKS


def self_attention_ops(model: Any) -> Iterator[tuple[Any, int | None]]:
  """(op, layer) for every video self-attention op; layer None for the stacked scanned op."""
  fam = family(model)
  tagged = fam.self_attention_name is None  # the op is self-attention by its place
  # Wan's messages name the model's own class (VACE and Animate subclass WanModel)
  owner = fam.model_class if tagged else type(model).__name__
  why = ("the svg kernel tags each block's video self-attention" if tagged
         else "the svg kernel tags each block's self-attention with its layer")
  contract.require_attributes(model, owner, ("scan_layers", fam.blocks, "num_layers"), why)
  stacked = getattr(model, fam.blocks)
  blocks = [(stacked, None)] if model.scan_layers else list(
      (block, i) for i, block in enumerate(stacked))
  for block, layer in blocks:
    op = getattr(getattr(block, "attn1", None), "attention_op", None)
    found = type(op).__name__ if op is not None else "no attn1.attention_op"
    if tagged:
      if op is None or not hasattr(op, "apply_attention") or not hasattr(op, "heads"):
        raise contract.MaxDiffusionDrift(
            f"MaxDiffusion drift: {owner}'s {fam.blocks} should hold video self-attention as "
            f"attn1.attention_op (an NNXAttentionOp), found {found}; maxdiffusion_svg is tested "
            f"with MaxDiffusion {contract.TESTED_COMMIT}.")
    else:
      name = getattr(op, "residual_checkpoint_name", None)
      if name != fam.self_attention_name:
        raise contract.MaxDiffusionDrift(
            f"MaxDiffusion drift: {owner}'s {fam.blocks} should hold self-attention as "
            f"attn1.attention_op with residual_checkpoint_name {fam.self_attention_name!r} (how "
            f"the svg kernel tells it from cross-attention), found {found} with {name!r}; "
            f"maxdiffusion_svg is tested with MaxDiffusion {contract.TESTED_COMMIT}.")
    yield op, layer
