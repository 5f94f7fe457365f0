"""A reference frame as a sink or dense (``svg_dense_frames``), at equal cost, through layers.

In one call, making the reference frame's queries dense changes only the reference's own rows:
every video row's output is the same. Its worth shows in the next layers, where every video
token reads the reference's hidden state through the sink. So the benchmark runs a residual
stack: each layer attends with planted queries and keys (synthetic heads, frame 0 the reference
slot, as in Wan Animate) over values read from the stack's hidden state, and adds the result
back. Three stacks run against the all-dense one, at each density: the sink only, the sink with
the first frame dense, and the sink only at the density whose tiles match the dense frame's
(equal cost). The score is the PSNR of the video rows' final hidden state against the dense
stack's; measured on CPU, on a modelled network (planted heads, random value and output maps).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.bench.quality import psnr
from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.attention import svg_attention
from maxdiffusion_svg.kernels import dense_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.tiles import visited_in_tiles_of
from maxdiffusion_svg.plan.tiling import SplashTiles


@dataclasses.dataclass(frozen=True)
class ReferenceBenchConfig:
  grid: VideoGrid = VideoGrid(13, 12, 20)  # the reference slot + 12 latent frames, 3,120 tokens
  head_types: tuple[str, ...] = ("spatial", "temporal", "moving", "moving", "spatial",
                                 "temporal", "moving", "unstructured")
  head_dim: int = 32
  layers: int = 6
  densities: tuple[float, ...] = (0.15, 0.25, 0.35)
  block: int = 128
  seeds: tuple[int, ...] = (0, 1)
  residual: float = 0.5  # the output map's scale: how much each layer adds to the state
  # The reference keys' scale: above 1, video queries lean on the reference harder (their
  # logits to it grow by the factor), as a model conditioned on it may.
  reference_key_scales: tuple[float, ...] = (1.0, 1.5)

  def svg(self, density: float, dense_frames: int = 0) -> SvgConfig:
    return SvgConfig(density=density, dense_frames=dense_frames, block_q=self.block,
                     block_kv=self.block, backend="xla", profile_queries=32)


def _tiles(cfg: ReferenceBenchConfig, svg: SvgConfig) -> float:
  """A sparse call's tiles in the sparse plan's units (the dense rows' counted by size)."""
  plan = svg.plan(cfg.grid)
  tiles = SplashTiles(cfg.block, cfg.block, cfg.block)
  rows = svg.dense_rows_plan_on(cfg.grid, tiles)
  return plan.stats.visited_tiles + (0.0 if rows is None else visited_in_tiles_of(rows, plan))


def equal_cost_density(cfg: ReferenceBenchConfig, density: float) -> tuple[float, float, float]:
  """(the sink-only density whose tiles come nearest the dense-frame run's, its tiles, the
  dense-frame run's tiles): a 0.005 grid from ``density`` up."""
  want = _tiles(cfg, cfg.svg(density, 1))
  grid = np.arange(density, 1.0, 0.005)
  costs = [_tiles(cfg, cfg.svg(float(d))) for d in grid]
  best = int(np.argmin(np.abs(np.asarray(costs) - want)))
  return round(float(grid[best]), 3), costs[best], want


def _stack(cfg: ReferenceBenchConfig, seed: int,
           key_scale: float = 1.0) -> tuple[list[tuple[Any, Any]], Any, Any, Any]:
  """Each layer's planted (q, k) (the reference keys scaled by ``key_scale``), the value and
  output maps, and the initial state."""
  rng = np.random.default_rng(seed)
  heads, dim = len(cfg.head_types), cfg.head_dim
  width = heads * dim
  qk = []
  for layer in range(cfg.layers):
    q, k, _ = planted_qkv(cfg.grid, cfg.head_types, dim, seed=1000 * seed + layer)
    k[:, :, :cfg.grid.frame_size] *= key_scale
    qk.append((jnp.asarray(q), jnp.asarray(k)))
  value = jnp.asarray(np.linalg.qr(rng.standard_normal((width, width)))[0], jnp.float32)
  out = jnp.asarray(np.linalg.qr(rng.standard_normal((width, width)))[0] * cfg.residual,
                    jnp.float32)
  state = jnp.asarray(rng.standard_normal((cfg.grid.tokens, width)), jnp.float32)
  return qk, value, out, state


def run_stack(cfg: ReferenceBenchConfig, seed: int, attend: Callable[[Any, Any, Any, int], Any],
              key_scale: float = 1.0) -> np.ndarray:
  """The stack's final state ``[S, width]``, ``attend(q, k, v, layer)`` in each layer."""
  qk, value, out, state = _stack(cfg, seed, key_scale)
  heads, dim = len(cfg.head_types), cfg.head_dim
  for layer, (q, k) in enumerate(qk):
    v = (state @ value).reshape(1, cfg.grid.tokens, heads, dim).transpose(0, 2, 1, 3)
    o = attend(q, k, v, layer)[0].transpose(1, 0, 2).reshape(cfg.grid.tokens, heads * dim)
    state = state + o @ out
  return np.asarray(state)


def reference_share(cfg: ReferenceBenchConfig, seed: int, key_scale: float = 1.0) -> float:
  """The attention mass video queries give the reference frame's keys, mean over the stack's
  layers and heads (dense)."""
  marker = np.zeros((1, len(cfg.head_types), cfg.grid.tokens, 1), np.float32)
  marker[:, :, :cfg.grid.frame_size] = 1.0
  shares = [float(np.asarray(dense_attention(q, k, jnp.asarray(marker)))[
      :, :, cfg.grid.frame_size:].mean()) for q, k in _stack(cfg, seed, key_scale)[0]]
  return float(np.mean(shares))


def run_reference_bench(cfg: ReferenceBenchConfig = ReferenceBenchConfig(),
                        log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
  """Per reference key scale and density: each run's tiles and the PSNR of the video rows
  (and the reference's) of the final state against the dense stack, averaged over the seeds."""
  ref_rows = cfg.grid.frame_size
  dense_fn = jax.jit(lambda q, k, v: dense_attention(q, k, v))
  matched = {d: equal_cost_density(cfg, d) for d in cfg.densities}
  scales = []
  for scale in cfg.reference_key_scales:
    want = {seed: run_stack(cfg, seed, lambda q, k, v, layer: dense_fn(q, k, v), scale)
            for seed in cfg.seeds}
    rows = []
    for density in cfg.densities:
      equal, equal_tiles, dense_frame_tiles = matched[density]
      runs = {"sink": (cfg.svg(density), _tiles(cfg, cfg.svg(density))),
              "sink + dense frame 0": (cfg.svg(density, 1), dense_frame_tiles),
              f"sink at {equal:g} (equal cost)": (cfg.svg(equal), equal_tiles)}
      scores: dict[str, dict[str, float]] = {}
      for name, (svg, tiles) in runs.items():
        fn = jax.jit(lambda q, k, v, key, svg=svg: svg_attention(q, k, v, grid=cfg.grid,
                                                                 config=svg, key=key))
        video, reference = [], []
        for seed in cfg.seeds:
          got = run_stack(cfg, seed, lambda q, k, v, layer, seed=seed: fn(
              q, k, v, jax.random.fold_in(jax.random.key(seed), layer)), scale)
          video.append(psnr(got[ref_rows:], want[seed][ref_rows:]))
          reference.append(psnr(got[:ref_rows], want[seed][:ref_rows]))
        scores[name] = {"density": svg.density, "tiles": round(tiles, 1),
                        "video_psnr": float(np.mean(video)),
                        "reference_psnr": float(np.mean(reference))}
        log(f"reference keys x{scale:g}, density {density}: {name}: video "
            f"{scores[name]['video_psnr']:.2f} dB")
      rows.append({"density": density, "equal_cost_density": equal, "runs": scores})
    share = float(np.mean([reference_share(cfg, seed, scale) for seed in cfg.seeds]))
    scales.append({"reference_key_scale": scale, "reference_share": share, "rows": rows})
  return {"kind": "measured on CPU (a modelled network: planted heads, random maps)",
          "grid": list(cfg.grid.shape), "tokens": cfg.grid.tokens, "layers": cfg.layers,
          "head_types": list(cfg.head_types), "tiles": cfg.block, "seeds": list(cfg.seeds),
          "scales": scales}


def format_reference_bench(result: dict[str, Any]) -> str:
  lines = [f"A reference frame as a sink or dense, {result['kind']}: grid "
           f"{'x'.join(map(str, result['grid']))} ({result['tokens']:,} tokens, frame 0 the "
           f"reference), {result['layers']} residual layers, heads {', '.join(result['head_types'])}"
           f", {result['tiles']}x{result['tiles']} tiles; PSNR of the final state against the "
           f"dense stack's, mean of {len(result['seeds'])} seeds"]
  for scale in result["scales"]:
    lines += [f"reference keys x{scale['reference_key_scale']:g}: video queries give the "
              f"reference {scale['reference_share']:.1%} of their attention (dense)",
              f"  {'run':<30} {'density':>8} {'tiles':>8} {'video dB':>9} {'reference dB':>13}"]
    for row in scale["rows"]:
      for name, run in row["runs"].items():
        lines.append(f"  {name:<30} {run['density']:>8g} {run['tiles']:>8.1f} "
                     f"{run['video_psnr']:>9.2f} {run['reference_psnr']:>13.2f}")
  return "\n".join(lines)
