"""Routers against the ideal choice: which mask should the router judge layouts by?

The *ideal* router runs both layouts' full sparse outputs (every head spatial, every head
temporal, through the same plan) and keeps, per head, the one closer to dense: no router
that picks one layout per head can do better, so its PSNR is an upper bound. Each real
router (probe masks, execution masks) is scored by how often it makes the ideal choice
and by the PSNR it loses against the ideal, at several densities, on heads where the
choice is easy and heads where it is hard.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.attention import placed_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.tiles import TilePlan
from maxdiffusion_svg.routing.router import PROFILE_MASKS, profile_heads

# Heads where the right layout is clear, and heads where it is not.
EASY_HEADS = ("spatial", "spatial", "temporal", "temporal")
HARD_HEADS = (("mixed25",) * 2 + ("mixed50",) * 2 + ("mixed75",) * 2 + ("weak_spatial",) * 2
              + ("weak_temporal",) * 2 + ("drifting",) * 2)
ROUTER_HEADS = EASY_HEADS + HARD_HEADS


def layout_outputs(q: jax.Array, k: jax.Array, v: jax.Array, grid: VideoGrid,
                   plan: TilePlan) -> tuple[np.ndarray, np.ndarray]:
  """Every head through ``plan`` in the spatial layout, and in the temporal one."""
  run = jax.jit(lambda q, k, v, temporal: placed_attention(q, k, v, temporal, grid=grid,
                                                           plan=plan, backend="xla"))
  return tuple(np.asarray(run(q, k, v, jnp.full(q.shape[:2], t))) for t in (False, True))


def ideal_routing(spatial: np.ndarray, temporal: np.ndarray, dense: np.ndarray) -> np.ndarray:
  """``bool[B, H]``: True where a head's temporal output is closer to dense (ties: spatial)."""
  err_s = np.mean((spatial - dense) ** 2, axis=(2, 3))
  err_t = np.mean((temporal - dense) ** 2, axis=(2, 3))
  return err_t < err_s


def routed(spatial: np.ndarray, temporal: np.ndarray, flags: np.ndarray) -> np.ndarray:
  """The output of routing by ``flags`` (heads are independent: a per-head select)."""
  return np.where(flags[:, :, None, None], temporal, spatial)


def compare_routers(q: jax.Array, k: jax.Array, v: jax.Array, dense: np.ndarray,
                    head_types: Sequence[str], svg: Callable[..., SvgConfig], grid: VideoGrid,
                    densities: Sequence[float], seeds: int, psnr: Callable[..., float],
                    log: Callable[[str], None] = print) -> dict[str, Any]:
  """Per density: the ideal's PSNR, and per router its accuracy against the ideal choice,
  PSNR and gap to the ideal (means over ``seeds`` router keys)."""
  hard = ~np.isin(np.array(head_types), EASY_HEADS)
  out: dict[str, Any] = {}
  for density in densities:
    config = svg(density=density, tile_mode="aligned")
    plan = config.plan(grid)
    spatial, temporal = layout_outputs(q, k, v, grid, plan)
    ideal = ideal_routing(spatial, temporal, dense)
    ideal_psnr = psnr(routed(spatial, temporal, ideal), dense)
    row: dict[str, Any] = {"ideal_psnr_db": ideal_psnr, "ideal_temporal": ideal[0].tolist()}
    for masks in PROFILE_MASKS:
      router = svg(density=density, tile_mode="aligned", profile_masks=masks)
      route = jax.jit(lambda q, k, v, key, router=router: profile_heads(
          q, k, v, grid=grid, config=router, key=key, plan=plan).temporal)
      accuracy, hard_accuracy, quality = [], [], []
      for seed in range(seeds):
        flags = np.asarray(route(q, k, v, jax.random.key(seed)))
        accuracy.append(np.mean(flags == ideal))
        hard_accuracy.append(np.mean((flags == ideal)[:, hard]))
        quality.append(psnr(routed(spatial, temporal, flags), dense))
      row[masks] = {"accuracy_vs_ideal": float(np.mean(accuracy)),
                    "hard_accuracy_vs_ideal": float(np.mean(hard_accuracy)),
                    "psnr_db": float(np.mean(quality)),
                    "gap_db": float(ideal_psnr - np.mean(quality))}
      log(f"  density {density}, {masks} masks: {100 * row[masks]['accuracy_vs_ideal']:.1f}% "
          f"ideal choices, PSNR {row[masks]['psnr_db']:.2f} dB, gap {row[masks]['gap_db']:.2f} dB")
    out[str(density)] = row
  return out


def format_router_comparison(rows: dict[str, Any]) -> list[str]:
  lines = ["router vs ideal (aligned)   ideal PSNR   router      ideal choices  "
           "(hard heads)   PSNR dB   gap dB"]
  for density, row in rows.items():
    for masks in PROFILE_MASKS:
      r = row[masks]
      lines.append(f"density {density:<19} {row['ideal_psnr_db']:>10.2f}   {masks:<10} "
                   f"{100 * r['accuracy_vs_ideal']:>12.1f}% {100 * r['hard_accuracy_vs_ideal']:>12.1f}%"
                   f" {r['psnr_db']:>9.2f} {r['gap_db']:>8.2f}")
  return lines
