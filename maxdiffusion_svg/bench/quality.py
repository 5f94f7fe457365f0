"""The quality benchmark: SVG on synthetic video attention with planted head types.

Reports routing accuracy (against the planted types and against an every-row oracle
router), attention-output PSNR and relative L2 error against dense per density and mode,
PSNR with compensation off and on at equal visited tiles (on planted and moving-content
heads, :mod:`maxdiffusion_svg.bench.compensation_quality`), time against dense, and the
router's share of the time, also at a 720p sequence length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.bench.calibration import LAYERS as CALIBRATION_LAYERS
from maxdiffusion_svg.bench.calibration import (CalibrationBenchConfig, format_calibration_bench,
                                                run_calibration_bench)
from maxdiffusion_svg.bench.compensation_quality import format_compensation, run_compensation
from maxdiffusion_svg.bench.routers import ROUTER_HEADS, compare_routers, format_router_comparison
from maxdiffusion_svg.bench.semantic_quality import format_semantic, run_semantic
from maxdiffusion_svg.bench.synthetic import EXPECTED_TEMPORAL, planted_qkv
from maxdiffusion_svg.bench.timing import time_call
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.attention import placed_attention, svg_attention
from maxdiffusion_svg.kernels import dense_attention, sparse_attention
from maxdiffusion_svg.plan.geometry import VideoGrid, grid_for_resolution
from maxdiffusion_svg.routing.router import (PROFILE_MASKS, PROFILE_POOLS, probe_errors,
                                             profile_heads, route_heads)

# The reference router samples the first 10,000 of 75,600 tokens at 720p (2.8 of 21
# frames); the benchmark keeps that share on its smaller grid.
PREFIX_SHARE = 10_000 / 75_600


@dataclasses.dataclass(frozen=True)
class QualityBenchConfig:
  grid: VideoGrid = VideoGrid(21, 12, 20)  # Wan's 21 latent frames, 5,040 tokens
  head_types: tuple[str, ...] = (("spatial",) * 5 + ("temporal",) * 5 + ("drifting",) * 2
                                 + ("unstructured",) * 4)
  head_dim: int = 64
  densities: tuple[float, ...] = (0.2, 0.35, 0.5, 1.0)
  modes: tuple[str, ...] = ("naive", "split", "aligned")
  block_q: int = 256
  block_kv: int = 256
  profile_queries: int = 64
  query_sweep: tuple[int, ...] = (8, 16)  # also route with this few rows, to compare pools
  router_seeds: int = 5
  router_head_types: tuple[str, ...] = ROUTER_HEADS  # probe vs execution masks, against the ideal
  router_densities: tuple[float, ...] = (0.2, 0.35, 0.5)
  compensation_heads: int = 2  # per kind and strength (compensation_quality); 0 skips
  compensation_densities: tuple[float, ...] = (0.1, 0.15, 0.2, 0.35)
  compensation_blocks: tuple[int, ...] = (8, 16, 32)  # centroids per key tile, each tried
  semantic_heads: int = 2  # per kind and strength (semantic_quality); 0 skips
  semantic_densities: tuple[float, ...] = (0.1, 0.15, 0.2, 0.35)
  semantic_clusters: int = 32
  # per-layer densities against one for all (bench.calibration); None skips
  calibration: CalibrationBenchConfig | None = CalibrationBenchConfig(held_out_seeds=(1, 2))
  timing_density: float = 0.35
  timing_resolution: str | None = "720p"  # router share at a real length; None to skip
  repeats: int = 2
  seed: int = 0

  def __post_init__(self):
    for name in ("router_seeds", "repeats", "profile_queries"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.compensation_heads and not self.compensation_blocks:
      raise ValueError("compensation_blocks must name at least one value when "
                       "compensation_heads > 0")

  def svg_config(self, **overrides: Any) -> SvgConfig:
    kwargs: dict[str, Any] = dict(
        density=self.timing_density, tile_mode="aligned", block_q=self.block_q,
        block_kv=self.block_kv, backend="xla", profile_queries=self.profile_queries,
        sample_max_row=max(1, round(PREFIX_SHARE * self.grid.tokens)))
    kwargs.update(overrides)
    return SvgConfig(**kwargs)


def psnr(out: np.ndarray, ref: np.ndarray) -> float:
  """Peak signal-to-noise ratio (dB) against ``ref``, peak = ``ref``'s value range."""
  mse = float(np.mean((out - ref) ** 2))
  peak = float(ref.max() - ref.min())
  return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def rel_l2(out: np.ndarray, ref: np.ndarray) -> float:
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def oracle_routing(q, k, v, grid: VideoGrid, *, include_sink: bool = True, chunk: int = 256):
  """The router's decision with every query row profiled (chunked over rows)."""
  errors = jax.jit(lambda rows: probe_errors(q, k, v, rows, grid, include_sink=include_sink))
  spatial = temporal = 0.0
  s = grid.tokens
  for start in range(0, s, chunk):
    rows = jnp.minimum(jnp.arange(start, start + chunk, dtype=jnp.int32), s - 1)
    weight = min(chunk, s - start)  # the clipped tail repeats the last row: weigh it out
    e_s, e_t = errors(rows)
    spatial = spatial + e_s * weight
    temporal = temporal + e_t * weight
  return np.asarray(temporal < spatial)


def _expected(planted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(heads with a right answer, the right answer: True = temporal)."""
  known = np.array([t in EXPECTED_TEMPORAL for t in planted])
  return known, np.array([EXPECTED_TEMPORAL.get(t, False) for t in planted])


def _routing_section(cfg, q, k, v, planted, oracle, log) -> dict[str, Any]:
  out: dict[str, Any] = {}
  known, want = _expected(planted)
  for pool in PROFILE_POOLS:
    for queries in sorted({*cfg.query_sweep, cfg.profile_queries}):
      svg = cfg.svg_config(profile_pool=pool, profile_queries=queries)
      route = jax.jit(lambda q, k, v, key, svg=svg: profile_heads(
          q, k, v, grid=cfg.grid, config=svg, key=key, plan=svg.plan(cfg.grid)))
      vs_planted, vs_oracle = [], []
      for i in range(cfg.router_seeds):
        routing = route(q, k, v, jax.random.key(i))
        flags = np.asarray(routing.temporal)[0]
        if i == 0 and queries == cfg.profile_queries:
          out[f"{pool}_errors"] = {"spatial": np.asarray(routing.spatial_error)[0].tolist(),
                                   "temporal": np.asarray(routing.temporal_error)[0].tolist()}
        vs_planted.append(np.mean(flags[known] == want[known]))
        vs_oracle.append(np.mean(flags == oracle))
      name = pool if queries == cfg.profile_queries else f"{pool}/{queries}"
      out[name] = {"profile_queries": queries, "accuracy_vs_planted": float(np.mean(vs_planted)),
                   "min_accuracy_vs_planted": float(np.min(vs_planted)),
                   "agreement_vs_oracle": float(np.mean(vs_oracle))}
      log(f"  router pool {pool}, {queries} rows: {100 * out[name]['accuracy_vs_planted']:.1f}% of "
          f"planted heads correct, {100 * out[name]['agreement_vs_oracle']:.1f}% agree with the oracle")
  return out


def _quality_section(cfg, q, k, v, dense, planted, log) -> dict[str, Any]:
  out: dict[str, Any] = {}
  groups = {t: planted == t for t in sorted(set(planted))}
  for density in cfg.densities:
    for mode in cfg.modes:
      svg = cfg.svg_config(density=density, tile_mode=mode)
      run = jax.jit(lambda q, k, v, svg=svg: svg_attention(q, k, v, grid=cfg.grid, config=svg,
                                                           return_info=True))
      o, info = run(q, k, v)
      o = np.asarray(o)
      row = {"psnr_db": psnr(o, dense), "rel_l2": rel_l2(o, dense),
             "retained_pair_fraction": float(info["plan"]["retained_pair_fraction"]),
             "visited_tile_fraction": float(info["plan"]["visited_tile_fraction"]),
             "temporal_heads": int(np.asarray(info["temporal"]).sum())}
      for name, sel in groups.items():
        row[f"psnr_db_{name}"] = psnr(o[:, sel], dense[:, sel])
      out[f"{density}/{mode}"] = row
      log(f"  density {density} {mode}: PSNR {row['psnr_db']:.2f} dB, rel L2 {row['rel_l2']:.4f}")
  # What routing buys: every head forced to one layout, same density and tiles.
  svg = cfg.svg_config()
  plan = svg.plan(cfg.grid)
  for name, temporal in (("all_spatial", False), ("all_temporal", True)):
    o = np.asarray(placed_attention(q, k, v, jnp.full(q.shape[:2], temporal), grid=cfg.grid,
                                    plan=plan, backend="xla"))
    out[f"{cfg.timing_density}/aligned/{name}"] = {"psnr_db": psnr(o, dense),
                                                    "rel_l2": rel_l2(o, dense)}
  return out


def _timing_section(cfg, q, k, v, log) -> dict[str, Any]:
  svg = cfg.svg_config()
  grid = cfg.grid
  dense_fn = jax.jit(dense_attention)
  svg_fn = jax.jit(lambda q, k, v: svg_attention(q, k, v, grid=grid, config=svg))
  plan = svg.plan(grid)
  route_fn = jax.jit(lambda q, k, v: route_heads(q, k, v, grid=grid, config=svg,
                                                 key=jax.random.key(0), plan=plan))
  kernel_fn = jax.jit(lambda q, k, v: sparse_attention(q, k, v, plan, backend="xla"))
  out = {"dense_s": time_call(lambda: dense_fn(q, k, v), cfg.repeats)[1],
         "svg_s": time_call(lambda: svg_fn(q, k, v), cfg.repeats)[1],
         "router_s": time_call(lambda: route_fn(q, k, v), cfg.repeats)[1],
         "kernel_s": time_call(lambda: kernel_fn(q, k, v), cfg.repeats)[1]}
  out["router_share_of_kernel"] = out["router_s"] / out["kernel_s"]
  log(f"  bench grid: dense {out['dense_s']:.3f} s, svg {out['svg_s']:.3f} s, router "
      f"{out['router_s']:.4f} s ({100 * out['router_share_of_kernel']:.1f}% of the sparse kernel)")
  if cfg.timing_resolution:
    big = grid_for_resolution(cfg.timing_resolution)
    log(f"  timing the router against the sparse kernel at {cfg.timing_resolution} "
        f"({big.tokens:,} tokens, 1 head)...")
    rng = np.random.default_rng(cfg.seed)
    qb, kb, vb = (jnp.asarray(rng.standard_normal((1, 1, big.tokens, 128), np.float32))
                  for _ in range(3))
    big_svg = SvgConfig(density=cfg.timing_density, backend="xla",
                        profile_queries=cfg.profile_queries)
    big_plan = big_svg.plan(big)
    kernel_big = jax.jit(lambda q, k, v: sparse_attention(q, k, v, big_plan, backend="xla"))
    large = out["large"] = {"resolution": cfg.timing_resolution, "tokens": big.tokens,
                            "kernel_s": time_call(lambda: kernel_big(qb, kb, vb), 1)[1]}
    for masks in PROFILE_MASKS:
      router = dataclasses.replace(big_svg, profile_masks=masks)
      route_big = jax.jit(lambda q, k, v, router=router: route_heads(
          q, k, v, grid=big, config=router, key=jax.random.key(0), plan=big_plan))
      large[f"router_{masks}_s"] = time_call(lambda: route_big(qb, kb, vb), cfg.repeats)[1]
      large[f"router_{masks}_share_of_kernel"] = large[f"router_{masks}_s"] / large["kernel_s"]
      log(f"  {cfg.timing_resolution}: router ({masks} masks) {large[f'router_{masks}_s']:.3f} s, "
          f"sparse kernel {large['kernel_s']:.2f} s: router = "
          f"{100 * large[f'router_{masks}_share_of_kernel']:.2f}% of the kernel")
  return out


def run_quality_bench(cfg: QualityBenchConfig = QualityBenchConfig(),
                      log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs every section; returns a JSON-ready dict."""
  planted = np.array(cfg.head_types)
  log(f"planting {len(planted)} heads on grid {cfg.grid} ({cfg.grid.tokens:,} tokens)...")
  q, k, v = (jnp.asarray(x) for x in planted_qkv(cfg.grid, cfg.head_types, cfg.head_dim,
                                                  seed=cfg.seed))
  dense = np.asarray(jax.jit(dense_attention)(q, k, v))
  log("routing with every row profiled (oracle)...")
  oracle = oracle_routing(q, k, v, cfg.grid)[0]
  known, want = _expected(planted)
  result: dict[str, Any] = {
      "grid": list(cfg.grid.shape), "tokens": cfg.grid.tokens, "heads": list(cfg.head_types),
      "head_dim": cfg.head_dim, "tiles": [cfg.block_q, cfg.block_kv],
      "profile_queries": cfg.profile_queries,
      "prefix_rows": cfg.svg_config().sample_max_row,
      "oracle": {"temporal": oracle.tolist(),
                 "accuracy_vs_planted": float(np.mean(oracle[known] == want[known]))},
  }
  log("routing with sampled rows...")
  result["routing"] = _routing_section(cfg, q, k, v, planted, oracle, log)
  log("attention quality against dense...")
  result["quality"] = _quality_section(cfg, q, k, v, dense, planted, log)
  log(f"probe vs execution masks against the ideal router ({len(cfg.router_head_types)} heads)...")
  qr, kr, vr = (jnp.asarray(x) for x in planted_qkv(cfg.grid, cfg.router_head_types,
                                                     cfg.head_dim, seed=cfg.seed + 1))
  result["router_heads"] = list(cfg.router_head_types)
  result["routers"] = compare_routers(qr, kr, vr, np.asarray(jax.jit(dense_attention)(qr, kr, vr)),
                                      cfg.router_head_types, cfg.svg_config, cfg.grid,
                                      cfg.router_densities, cfg.router_seeds, psnr, log)
  if cfg.compensation_heads:
    log(f"compensation off and on at equal visited tiles ({6 * cfg.compensation_heads} heads)...")
    result["compensation"] = run_compensation(cfg, psnr, log)
  if cfg.semantic_heads:
    log(f"each layout at equal visited tiles ({6 * cfg.semantic_heads} heads)...")
    result["semantic"] = run_semantic(cfg, psnr, log)
  if cfg.calibration is not None:
    log(f"per-layer densities against one for all ({len(CALIBRATION_LAYERS)} planted layers)...")
    result["calibration"] = run_calibration_bench(cfg.calibration, log)
  log("timing...")
  result["timing"] = _timing_section(cfg, q, k, v, log)
  return result


def format_quality_bench(r: dict[str, Any]) -> str:
  kinds = ", ".join(f"{r['heads'].count(t)} {t}" for t in dict.fromkeys(r["heads"]))
  lines = [f"grid {'x'.join(map(str, r['grid']))} = {r['tokens']:,} tokens, {len(r['heads'])} heads "
           f"({kinds}), "
           f"D={r['head_dim']}, tiles {r['tiles'][0]}x{r['tiles'][1]}, "
           f"prefix pool = first {r['prefix_rows']} tokens",
           "",
           "routing                      planted-correct   min over seeds   agrees with oracle",
           f"{'oracle (every row)':<28} {100 * r['oracle']['accuracy_vs_planted']:>14.1f}%"]
  for name, row in r["routing"].items():
    if name.endswith("_errors"):
      continue
    label = f"sampled, {name.split('/')[0]}, {row['profile_queries']} rows"
    lines.append(f"{label:<28} {100 * row['accuracy_vs_planted']:>14.1f}% "
                 f"{100 * row['min_accuracy_vs_planted']:>15.1f}% "
                 f"{100 * row['agreement_vs_oracle']:>19.1f}%")
  if "routers" in r:
    heads = r["router_heads"]
    lines += ["", f"routers on {len(heads)} heads "
              f"({', '.join(f'{heads.count(t)} {t}' for t in dict.fromkeys(heads))}); "
              "hard = all but plain spatial/temporal", *format_router_comparison(r["routers"])]
  lines += ["", "quality vs dense        PSNR dB   rel L2   kept%  visited%  temporal heads"]
  for name, row in r["quality"].items():
    extra = (f"{100 * row['retained_pair_fraction']:>7.1f} {100 * row['visited_tile_fraction']:>9.1f}"
             f" {row['temporal_heads']:>15}" if "retained_pair_fraction" in row else
             "   (no routing)")
    lines.append(f"{name:<22} {row['psnr_db']:>8.2f} {row['rel_l2']:>8.4f} {extra}")
  if "compensation" in r:
    lines += ["", *format_compensation(r["compensation"])]
  if "semantic" in r:
    lines += ["", *format_semantic(r["semantic"])]
  if "calibration" in r:
    lines += ["", format_calibration_bench(r["calibration"])]
  t = r["timing"]
  lines += ["", f"time on the bench grid: dense {t['dense_s']:.3f} s, svg_attention {t['svg_s']:.3f} s "
            f"(ratio {t['svg_s'] / t['dense_s']:.2f}); router {t['router_s'] * 1e3:.1f} ms = "
            f"{100 * t['router_share_of_kernel']:.1f}% of the sparse kernel"]
  if "large" in t:
    lg = t["large"]
    for masks in PROFILE_MASKS:
      lines.append(f"at {lg['resolution']} ({lg['tokens']:,} tokens, per head): router ({masks} "
                   f"masks) {lg[f'router_{masks}_s'] * 1e3:.0f} ms, sparse kernel "
                   f"{lg['kernel_s']:.2f} s: router = "
                   f"{100 * lg[f'router_{masks}_share_of_kernel']:.2f}% of the kernel")
  return "\n".join(lines)


def compare_backends(cfg: QualityBenchConfig = QualityBenchConfig(head_dim=128),
                     backends: tuple[str, ...] = ("splash", "pallas"),
                     densities: tuple[float, ...] = (0.2, 0.35, 1.0),
                     modes: tuple[str, ...] = ("split", "aligned"), dtype: str = "bfloat16",
                     log: Callable[[str], None] = print) -> dict[str, Any]:
  """The planted heads through ``svg_attention`` on each TPU kernel (interpreted on this host),
  same routing and plan: PSNR against dense per density and mode, and each kernel's distance
  from the first one's output."""
  q, k, v = (jnp.asarray(x, dtype) for x in planted_qkv(cfg.grid, cfg.head_types, cfg.head_dim,
                                                         seed=cfg.seed))
  dense = np.asarray(jax.jit(dense_attention)(*(x.astype(jnp.float32) for x in (q, k, v))))
  rows: dict[str, Any] = {}
  for density in densities:
    for mode in modes:
      outs = {}
      for backend in backends:
        svg = cfg.svg_config(density=density, tile_mode=mode, backend=backend)
        outs[backend] = np.asarray(jax.jit(lambda q, k, v, svg=svg: svg_attention(
            q, k, v, grid=cfg.grid, config=svg))(q, k, v), np.float32)
      first = outs[backends[0]]
      rows[f"{density}/{mode}"] = {b: {"psnr_db": psnr(o, dense), "rel_l2": rel_l2(o, dense),
                                       "max_abs_vs_first": float(np.abs(o - first).max())}
                                   for b, o in outs.items()}
      log(f"  density {density} {mode}: " + ", ".join(
          f"{b} {r['psnr_db']:.2f} dB" for b, r in rows[f"{density}/{mode}"].items()))
  return {"kind": "measured on CPU (Pallas interpret mode)", "grid": list(cfg.grid.shape),
          "heads": len(cfg.head_types), "head_dim": cfg.head_dim, "dtype": dtype,
          "tiles": [cfg.block_q, cfg.block_kv], "backends": list(backends), "rows": rows}


def format_backend_comparison(r: dict[str, Any]) -> str:
  backends = r["backends"]
  lines = [f"planted heads ({r['heads']}, grid {'x'.join(map(str, r['grid']))}, D={r['head_dim']}, "
           f"{r['dtype']}, tiles {r['tiles'][0]}x{r['tiles'][1]}), {r['kind']}: PSNR against "
           "dense, dB", f"{'density/mode':<16}" + "".join(f"{b:>10}" for b in backends)
           + f"{'difference':>12}{'max |diff|':>12}"]
  for name, row in r["rows"].items():
    values = [row[b]["psnr_db"] for b in backends]
    lines.append(f"{name:<16}" + "".join(f"{x:>10.2f}" for x in values)
                 + f"{values[-1] - values[0]:>+12.3f}{row[backends[-1]]['max_abs_vs_first']:>12.4f}")
  return "\n".join(lines)
