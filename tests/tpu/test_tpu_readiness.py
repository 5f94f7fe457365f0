"""The Splash path without a TPU: lowered for TPU (Pallas -> Mosaic), VMEM, bf16, mask traffic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg import (SvgConfig, grid_for_resolution, plan_tiles, sparse_attention,
                              svg_attention)
from maxdiffusion_svg.kernels import plan_reference
from maxdiffusion_svg.kernels.splash import mask_strategy, mask_traffic, plan_mask_info
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import tpu_target

TILES = (3328, 1536)  # v6e's default (the seed design's)
HEADS, HEAD_DIM = 40, 128  # Wan 14B


def export(fn, shape, platform):
  spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  return jax.export.export(jax.jit(fn), platforms=[platform])(spec, spec, spec).mlir_module()


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", ["naive", "split", "aligned"])
@pytest.mark.parametrize("resolution", ["720p", "1440p"])
def test_splash_lowers_to_the_mosaic_kernel_for_tpu(resolution, mode, batch):
  grid = grid_for_resolution(resolution)
  plan = plan_tiles(grid, 0.3, *TILES, mode)
  fn = lambda q, k, v: sparse_attention(q, k, v, plan, backend="splash", target=tpu_target("v6e"))
  shape = (batch, HEADS, grid.tokens, HEAD_DIM)
  module = export(fn, shape, "tpu")
  assert module.count("tpu_custom_call") == 1  # the kernel, not its interpreter
  # The tile tables (O(tiles)) are its only size-dependent constants: no S-sized mask.
  assert len(module) < 100 * 1024, len(module)  # docs/concepts.md: under 100 KiB (1440p split: 98)
  if mode == "naive" and batch == 1:  # without a target, lowered for CPU it interprets instead
    host = lambda q, k, v: sparse_attention(q, k, v, plan, backend="splash")
    assert "tpu_custom_call" not in export(host, shape, "cpu")


@pytest.mark.parametrize("resolution", ["720p", "1440p"])
def test_svg_attention_with_routing_and_placement_lowers_for_tpu(resolution):
  grid = grid_for_resolution(resolution)
  config = SvgConfig(backend="splash")
  module = export(lambda q, k, v: svg_attention(q, k, v, grid=grid, config=config,
                                                target=tpu_target("v6e")),
                  (2, HEADS, grid.tokens, HEAD_DIM), "tpu")
  # Splash's kernel, and ours (no tokamax needed): the router's sampled rows, placing q, k and v
  # and restoring
  assert module.count("tpu_custom_call") == 6 and "svg_sampled_rows" in module
  assert "svg_head_order" in module


def test_an_oversized_inner_kv_step_is_refused_with_the_numbers():
  grid = VideoGrid(5, 6, 7)
  plan = plan_tiles(grid, 0.3, 3328, 1536, "split")
  q = jnp.zeros((1, 1, grid.tokens, 128), jnp.bfloat16)
  v6e = tpu_target("v6e")
  export(lambda q, k, v: sparse_attention(q, k, v, plan, backend="splash", target=v6e),
         q.shape, "tpu")  # 256-wide inner steps fit
  wide = plan_tiles(grid, 0.3, 4096, 2816, "split")  # 512-wide steps of a 4096-row tile
  with pytest.raises(ValueError, match=r"need about \d+\.\d MiB of VMEM on TPU v6e .*, over "
                                       r"its 32 MiB scoped-VMEM limit \(the chip's default\): lower svg_block_q"):
    export(lambda q, k, v: sparse_attention(q, k, v, wide, backend="splash",
                                            block_kv_compute=512, target=v6e), q.shape, "tpu")
  # A step the VMEM model was not fitted for is refused too, naming the key and the range.
  with pytest.raises(ValueError, match=r"on TPU v6e: the Splash VMEM model was not fitted for "
                                       r"svg_block_kv_compute 1536 \(fitted 128-512\)"):
    export(lambda q, k, v: sparse_attention(q, k, v, plan, backend="splash",
                                            block_kv_compute=1536, target=v6e), q.shape, "tpu")
  # Interpreted on this CPU host nothing is checked: there is no VMEM to overflow.
  sparse_attention(q, q, q, plan, backend="splash", block_kv_compute=1536)
  with pytest.raises(ValueError, match=r"svg_block_kv_compute \(512\) must divide svg_block_kv "
                                       r"\(768\)"):
    SvgConfig(block_kv=768, block_kv_compute=512)


def test_bfloat16_q_is_rounded_once():
  """The scale and log2(e) are folded into one float32 multiply before the bf16 cast."""
  grid = VideoGrid(10, 10, 10)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 3, grid.tokens, 64)) * f, jnp.float32)
             for f in (3, 1, 1))  # sharp logits, where rounding q matters
  for mode in ("split", "aligned"):
    plan = plan_tiles(grid, 0.3, 128, 128, mode)
    want = np.asarray(plan_reference(q, k, v, plan))
    got = sparse_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), plan, backend="splash")
    error = np.abs(np.asarray(got, np.float32) - want).mean()
    assert error < 1.9e-3, error  # 1.97e-3 when q was rounded to bf16 twice


@pytest.mark.parametrize("resolution", ["720p", "1440p"])
def test_each_mode_masks_the_cheaper_way(resolution):
  grid = grid_for_resolution(resolution)
  for mode, cheaper in (("naive", "function"), ("split", "function"), ("aligned", "stored")):
    plan = plan_tiles(grid, 0.3, *TILES, mode)
    traffic = mask_traffic(plan, heads=HEADS // 8)
    assert min(traffic, key=lambda way: traffic[way]["bytes"]) == cheaper == mask_strategy(plan)
    info, mask_fn = plan_mask_info(plan)
    if cheaper == "stored":  # aligned: one padding block, no per-call query-index array
      assert traffic["stored"]["blocks"] == 1 and info.partial_mask_blocks.shape[0] == 1
      assert info.q_sequence is None and mask_fn is None
    else:
      assert info.partial_mask_blocks is None and mask_fn is not None


def test_a_gradient_with_no_platform_named_lowers_tokamaxs_backward_for_tpu_only():
  """Our kernel named, the platform not: the exported gradient for a TPU runs the forward kernel
  and tokamax's backward kernel; for the CPU, their interpreters (no Mosaic call)."""
  grid = VideoGrid(4, 16, 16)  # 1024 tokens: 4 x 4 tiles of 256
  plan = plan_tiles(grid, 0.5, 256, 256, "aligned")
  grad = jax.grad(lambda q, k, v: sparse_attention(q, k, v, plan, backend="pallas")
                  .astype(jnp.float32).sum(), argnums=(0, 1, 2))
  shape = (1, 2, grid.tokens, HEAD_DIM)
  module = export(grad, shape, "tpu")
  assert module.count("tpu_custom_call") == 2 and "dkv" in module
  assert "tpu_custom_call" not in export(grad, shape, "cpu")
