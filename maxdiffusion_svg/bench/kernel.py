"""Kernel benchmark: dense attention against ``sparse_attention`` in each traversal mode.

Efficiency is ``visited_tile_fraction / (t_sparse / t_dense)``: 1.0 means the time fell
exactly in proportion to the tiles skipped. Two dense baselines are timed: plain XLA
softmax attention (materialises the ``S x S`` scores), and the same sparse executor on a
density-1 plan ("blocked dense"), which isolates what skipping tiles buys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.bench.timing import time_call
from maxdiffusion_svg.kernels import dense_attention, resolve_backend, sparse_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import check_density
from maxdiffusion_svg.plan.target import target_of
from maxdiffusion_svg.plan.tiles import TileMode, check_block_size, plan_tiles
from maxdiffusion_svg.plan.tiling import choose_tiles

# Skip the plain dense baseline when its score matrix (and softmax) would not fit.
DENSE_SCORE_LIMIT_BYTES = 12 * 2**30


@dataclasses.dataclass(frozen=True)
class KernelBenchConfig:
  grid: VideoGrid
  batch: int = 1
  heads: int = 1
  head_dim: int = 128
  density: float = 0.35
  modes: tuple[str, ...] = tuple(m.value for m in TileMode)
  backend: str = "xla"
  block_q: int | None = None
  block_kv: int | None = None
  dtype: str = "float32"
  repeats: int = 3
  seed: int = 0

  def __post_init__(self):
    check_density(self.density)
    for name in ("batch", "heads", "head_dim", "repeats"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for mode in self.modes:
      TileMode.parse(mode)
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")

  def blocks(self, backend: str) -> tuple[int, int]:
    for name in ("block_q", "block_kv"):
      if getattr(self, name):
        check_block_size(getattr(self, name), name)
    tiles = choose_tiles(target_of(), backend, self.block_q, self.block_kv)
    return tiles.block_q, tiles.block_kv


def run_kernel_bench(cfg: KernelBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Times every configured mode; returns a JSON-ready dict."""
  backend = resolve_backend(cfg.backend)
  block_q, block_kv = cfg.blocks(backend)
  s = cfg.grid.tokens
  rng = np.random.default_rng(cfg.seed)
  shape = (cfg.batch, cfg.heads, s, cfg.head_dim)
  q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), cfg.dtype) for _ in range(3))
  result: dict[str, Any] = {
      "grid": list(cfg.grid.shape), "tokens": s, "batch": cfg.batch, "heads": cfg.heads,
      "head_dim": cfg.head_dim, "dtype": cfg.dtype, "density": cfg.density, "backend": backend,
      "device": jax.devices()[0].device_kind, "block_q": block_q, "block_kv": block_kv,
      "repeats": cfg.repeats, "modes": {},
  }

  def sparse_fn(plan):
    fn = jax.jit(lambda q, k, v: sparse_attention(q, k, v, plan, backend=backend))
    return lambda: fn(q, k, v)

  score_bytes = 2 * cfg.batch * cfg.heads * s * s * 4
  if score_bytes <= DENSE_SCORE_LIMIT_BYTES:
    log(f"timing dense XLA attention ({s:,} tokens)...")
    dense = jax.jit(dense_attention)
    result["dense_compile_s"], result["dense_s"] = time_call(lambda: dense(q, k, v), cfg.repeats)
  else:
    log(f"skipping plain dense: its scores need {score_bytes / 2**30:.0f} GiB")
    result["dense_s"] = None
  log("timing blocked dense (the sparse executor at density 1)...")
  full = plan_tiles(cfg.grid, 1.0, block_q, block_kv, "split")
  _, result["blocked_dense_s"] = time_call(sparse_fn(full), cfg.repeats)

  for mode in cfg.modes:
    plan = plan_tiles(cfg.grid, cfg.density, block_q, block_kv, mode)
    log(f"timing {mode} ({plan.stats.visited_tiles}/{plan.stats.total_tiles} tiles)...")
    compile_s, best = time_call(sparse_fn(plan), cfg.repeats)
    visited = plan.stats.visited_tile_fraction
    row: dict[str, Any] = {"time_s": best, "compile_s": compile_s,
                           "visited_tile_fraction": visited,
                           "masked_tile_fraction": plan.stats.masked_tile_fraction}
    for base in ("dense", "blocked_dense"):
      if result[f"{base}_s"]:
        ratio = best / result[f"{base}_s"]
        row[f"ratio_vs_{base}"] = ratio
        row[f"efficiency_vs_{base}"] = visited / ratio
    result["modes"][plan.mode.value] = row
  return result


def format_kernel_bench(result: dict[str, Any]) -> str:
  head = (f"grid {'x'.join(map(str, result['grid']))} = {result['tokens']:,} tokens, "
          f"B={result['batch']} H={result['heads']} D={result['head_dim']} {result['dtype']}, "
          f"density {result['density']}, backend {result['backend']} on {result['device']}, "
          f"tiles {result['block_q']}x{result['block_kv']}, best of {result['repeats']}")
  dense = result["dense_s"]
  lines = [head,
           f"dense XLA: {dense:.3f} s" if dense else "dense XLA: skipped (too large)",
           f"blocked dense (density 1, same executor): {result['blocked_dense_s']:.3f} s",
           f"{'mode':<8} {'time s':>8} {'visited':>8} {'ratio':>7} {'eff':>6} "
           f"{'ratio/blk':>10} {'eff/blk':>8}"]
  for mode, row in result["modes"].items():
    def cell(key, width):
      return f"{row[key]:>{width}.3f}" if key in row else f"{'-':>{width}}"
    lines.append(f"{mode:<8} {row['time_s']:>8.3f} {row['visited_tile_fraction']:>8.3f} "
                 f"{cell('ratio_vs_dense', 7)} {cell('efficiency_vs_dense', 6)} "
                 f"{cell('ratio_vs_blocked_dense', 10)} {cell('efficiency_vs_blocked_dense', 8)}")
  return "\n".join(lines)
