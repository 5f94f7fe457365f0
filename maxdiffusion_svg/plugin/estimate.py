"""What a generation config buys, computed from its tile plans, after the run's own checks.

For a config's video, steps and SVG keys: the checks the run makes (``config_checks``), the
tiles each sparse call visits, the share of self-attention calls that run sparse (steps x
layers of the schedule; for Wan 2.2, each expert over the steps it runs), the attention work
relative to dense, the bound that puts on attention's speed-up, and by Amdahl's law on a
stated self-attention share, on a whole denoising step's. Every figure is computed from the
plan (tile counts), not measured: the router, the permutation and the extra cost of masked
tiles are not counted, so the real speed-up is below the bound.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from maxdiffusion_svg.budgets.per_layer import Rung
from maxdiffusion_svg.kernels.vmem_model import libtpu_note
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import Target, resolve_backend
from maxdiffusion_svg.plan.tiles import visited_in_tiles_of
from maxdiffusion_svg.plugin.checkpoint import ModelShape
from maxdiffusion_svg.plugin.config_checks import (check_attention, check_before_weights,
                                                   check_config)
from maxdiffusion_svg.plugin.settings import PluginSettings, config_defaults
from maxdiffusion_svg.plugin.video_models import (WAN, WAN_VACE, VideoModel, experts_of,
                                                  grid_of, video_model)
from maxdiffusion_svg.plugin.wan22 import expert_steps
from maxdiffusion_svg.routing.compensation import plan_row_keys
from maxdiffusion_svg.routing.semantic import SAMPLE_PER_CLUSTER, group_size
from maxdiffusion_svg.tpu.prices import LIBTPU, PRICES, ring_kernel_prices
from maxdiffusion_svg.tpu.step_prices import slice_key, step_prices

# Self-attention's share of a dense Wan step's time on TPU, as the seed design states it (Wan
# 2.1 14B, eight v6e chips): "full attention's share of per-layer latency" grows "from 55.5% to
# 88.2%" from 720p to 1440p. Other sizes: interpolated in log-odds over log tokens.
SHARE_SOURCE = "the seed design (quoted in docs/benchmarks.md)"
STATED_SHARES = ((75_600, 0.555, "720p"), (302_400, 0.882, "1440p"))


def dense_blocks_of(config: Mapping[str, Any], shape: ModelShape) -> tuple[int, str]:
  """Self-attention calls per step that run dense by design besides the layers' (Wan VACE's
  control blocks) and where the count comes from."""
  if video_model(config) is not WAN_VACE:
    return 0, ""
  return shape.vace_layers, shape.source


def attention_share(tokens: int, given: float | None = None,
                    family: VideoModel = WAN) -> tuple[float, str]:
  """Self-attention's share of a dense step at ``tokens`` and where it comes from."""
  if given is not None:
    if not 0 < given <= 1:
      raise ValueError(f"--attention-share must be a fraction in (0, 1], got {given}")
    return given, "given with --attention-share"
  if family.flop_model is not None:  # no measured share: a FLOP model of one block
    width, dense = family.flop_model
    attention, rest = 4 * tokens * width, dense * width ** 2
    return attention / (attention + rest), (
        f"modelled from {family.name}'s FLOPs per block (self-attention 4·N·d against "
        f"{dense}·d² of projections and feed-forward, d {width}; not "
        f"measured: give --attention-share)")
  for count, share, name in STATED_SHARES:
    if tokens == count:
      return share, f"assumed, from {SHARE_SOURCE} (stated at {name})"
  (n0, f0, r0), (n1, f1, r1) = STATED_SHARES
  logit = lambda f: math.log(f / (1 - f))
  x = math.log(tokens / n0) / math.log(n1 / n0)
  share = 1 / (1 + math.exp(-(logit(f0) + x * (logit(f1) - logit(f0)))))
  how = "interpolated" if 0 < x < 1 else "extrapolated"
  return share, (f"assumed, from {SHARE_SOURCE} ({how} in log-odds over log tokens from its "
                 f"{r0} {f0:.1%} and {r1} {f1:.1%})")


def amdahl(share: float, work: float) -> float:
  """A step's speed-up when ``share`` of it does ``work`` of its dense work."""
  return 1 / ((1 - share) + share * work)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """One model's (or Wan 2.2 expert's) sparse attention over the steps it runs."""

  expert: str | None
  density: float
  kept_pair_fraction: float  # of all pairs: the band plus the first-frame sink (exact mask)
  visited_tile_fraction: float  # tiles a sparse call computes, of all tiles
  full_tiles: int
  masked_tiles: int
  first_step: int  # the model runs steps [first_step, first_step + steps)
  steps: int
  run_steps: int  # the run's (num_inference_steps)
  sparse_steps: int
  sparse_layers: int
  layers: int
  layer_densities: tuple[float, ...] | None = None  # the distinct per-layer rungs' densities
  layer_rungs: tuple[str, ...] | None = None  # ... as rungs: ``0.2`` or ``0.2+compensation``
  per_head: bool = False  # the rungs are the heads' densities (svg_head_densities)
  dense_rows_tiles: int = 0  # svg_dense_frames: tiles of the leading frames' dense rows (counted above)
  dense_rows_block_q: int = 0  # ... their query tile
  sink_frames: int = 1  # the leading frames every query attends (0: no sink)

  @property
  def calls(self) -> int:
    return self.steps * self.layers

  @property
  def sparse_call_share(self) -> float:
    return self.sparse_steps * self.sparse_layers / self.calls if self.calls else 0.0

  @property
  def work_vs_dense(self) -> float:
    """Self-attention tiles computed over the model's calls, relative to all-dense."""
    share = self.sparse_call_share
    return (1 - share) + share * self.visited_tile_fraction

  @property
  def speedup_bound(self) -> float:
    return 1 / self.work_vs_dense

  def as_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "sparse_call_share": self.sparse_call_share,
            "work_vs_dense": self.work_vs_dense, "speedup_bound": self.speedup_bound}


def estimate_config(config: Mapping[str, Any], target: Target, layers: int | None = None,
                    slice_type: str | None = None,
                    given_share: float | None = None,
                    heads: int | None = None, path: str = "") -> dict[str, Any]:
  """The pre-flight and estimate for a merged MaxDiffusion config (its ``svg_*`` keys over
  their defaults; ``path``, its file) on ``target``; ``slice_type`` (e.g. ``v6e-8``) adds the
  mesh's checks."""
  keys = {**config_defaults(), **config}
  shape = check_before_weights(keys, path=path, layers=layers, heads=heads)
  check_attention(keys)
  for key in ("num_frames", "height", "width", "num_inference_steps"):
    if key not in keys:
      raise ValueError(f"the config has no {key}: the estimate needs the video and the steps")
  steps = keys["num_inference_steps"]
  settings = PluginSettings.from_mapping(keys)
  svg = settings.svg
  grid = grid_of(keys)
  layers, heads = shape.layers, shape.heads
  target = svg.target(target=target)  # under the config's svg_vmem_limit_kib, if set
  backend = resolve_backend(svg.backend, target)
  tiles = svg.tiles(target, backend)
  experts = experts_of(keys)  # Wan 2.2's split the steps
  split = expert_steps(keys, steps) if experts != (None,) else None
  rungs = {expert: _rungs(svg, expert, layers, heads) for expert in experts}
  plans = {expert: svg.plan(grid, expert, target, backend) for expert in experts}
  dense_rows = svg.dense_rows_plan_on(grid, tiles)  # svg_dense_frames: one more call per sparse one
  extra = dense_rows.stats if dense_rows is not None else None
  # per-layer rungs (density, compensation): each rung's plan, checked and priced
  rung_plans = {expert: {r: svg.at_rung(r).plan(grid, expert, target, backend)
                         for r in weights} for expert, weights in rungs.items()}
  named = {f"{expert} sparse" if expert else "sparse": plan for expert, plan in plans.items()}
  for expert, by_rung in rung_plans.items():
    for rung, plan in by_rung.items():
      named[f"{expert + ' ' if expert else ''}sparse at {rung}"] = plan
  ragged = {}  # per-head budgets: each expert's one ragged call, on the carrier of its heads
  for expert in experts:
    budget = svg.head_budget_on(grid, tiles, expert)
    if budget is not None:
      ragged[f"{expert + ' ' if expert else ''}per-head ragged"] = budget
  checks = check_config(keys, settings, grid, target, backend,
                        {**named, **{name: b.carrier for name, b in ragged.items()},
                         "dense": svg.dense_plan(grid, target, backend),
                         # Splash's calls run the rectangle on our kernel, checked as its own
                         **({"dense rows": dense_rows}
                            if dense_rows is not None and backend != "splash" else {})},
                        steps, shape, slice_type, ragged)
  rows, priced = [], []
  for expert, plan in plans.items():
    first, end = split.of(expert) if split else (0, steps)
    own = Rung(svg.budget(expert).density, svg.compensation)
    weights = rungs[expert] or {own: 1.0}
    by_rung = rung_plans[expert] or {own: plan}
    mean = lambda f: sum(w * f(by_rung[r]) for r, w in weights.items())
    rows.append(Estimate(
        expert=expert, density=round(sum(w * r.density for r, w in weights.items()), 6),
        kept_pair_fraction=mean(lambda p: p.stats.exact_pair_fraction),
        visited_tile_fraction=mean(lambda p: (p.stats.visited_tiles + (
            visited_in_tiles_of(dense_rows, p) if extra else 0)) / p.stats.total_tiles),
        full_tiles=round(mean(lambda p: p.stats.full_tiles)) + (extra.full_tiles if extra else 0),
        masked_tiles=round(mean(lambda p: p.stats.masked_tiles)) + (
            extra.masked_tiles if extra else 0), first_step=first,
        steps=end - first, run_steps=steps,
        sparse_steps=svg.schedule.active_steps.within(first, end),
        sparse_layers=svg.schedule.active_layers.count(layers), layers=layers,
        layer_densities=tuple(r.density for r in weights) if rungs[expert] else None,
        layer_rungs=tuple(map(str, weights)) if rungs[expert] else None,
        per_head=svg.budget(expert).head_densities is not None,
        dense_rows_tiles=extra.visited_tiles if extra else 0,
        dense_rows_block_q=dense_rows.block_q if extra else 0,
        sink_frames=svg.sink_frames if svg.include_sink else 0))
    priced.append(_weighted({r: _against_fixed_m(by_rung[r], rows[-1].sparse_call_share,
                                                 tiles, target, backend, dense_rows)
                             for r in weights}, weights))
  blocks_count, blocks_source = dense_blocks_of(keys, shape)
  combined = _combined(rows, priced, blocks_count, blocks_source)
  share, source = attention_share(grid.tokens, given_share, video_model(keys))
  mesh = checks["slice"]
  # checked by check_config above; per-layer compensation: what its compensated layers add
  compensated = any(svg.budget(e).layer_compensation is not None for e in experts) and any(
      r.compensation for weights in rungs.values() for r in weights)
  blocks = svg.any_compensation_for(target, backend)
  return {"kind": "computed from the tile plan", "target": target.describe(),
          "libtpu_note": libtpu_note() if backend == "splash" else "",
          "backend": backend, "tiles": [tiles.block_q, tiles.block_kv],
          "block_kv_compute": tiles.block_kv_compute,
          "tile_mode": svg.tile_mode.value, "video": [keys["num_frames"], keys["height"],
                                                       keys["width"]],
          "grid": list(grid.shape), "tokens": grid.tokens, "preset": settings.preset,
          # the transformer's settings line, as the run logs it when the model is built
          "summary": settings.summary(target, (checks["slice"]["ulysses_shards"],
                                               checks["slice"]["ring"]) if checks["slice"]
                                      else (0, 1))
                     + f"; dense by design: {video_model(keys).dense_by_design}",
          "checks": checks, "semantic": _semantic(svg, grid, next(iter(plans.values()))),
          "experts": split.as_dict() if split else None,
          "rows": [{**row.as_dict(), "vs_fixed_m": vs} for row, vs in zip(rows, priced)],
          "combined": combined,
          "compensation": _compensation(blocks, next(iter(plans.values())),
                                        per_layer=compensated),
          "end_to_end": {"priced": _priced_step(rows, priced, target, grid.tokens, heads, mesh,
                                                keys, blocks_count, plans),
                         "attention_share": share, "source": source,
                         "step_speedup_bound": amdahl(share, combined["work_vs_dense"])}}


def _priced_step(rows: list[Estimate], priced: list[dict[str, Any]], target: Target,
                 tokens: int, heads: int, mesh: dict[str, Any] | None, keys: Mapping[str, Any],
                 blocks: int, plans: Mapping[str | None, Any]) -> dict[str, Any]:
  """A sparse step's and the whole run's bound against the dense baseline's step (Wan:
  ``ulysses_custom_fixed_m``, its ring variant on a ring mesh; LTX-2: ``flash``) from the
  compiled forward (:data:`~maxdiffusion_svg.tpu.step_prices.STEP_PRICES`: the XLA around the
  kernels) and the kernels' plans (``plans``: each expert's), per expert; or why it cannot be
  priced (``mesh``: the slice's checks, None without one)."""
  if mesh is None:
    return {"priced": False, "why": "no slice given (--slice)"}
  family = video_model(keys)
  key = slice_key(family.name, target.generation.name if target.known else "", tokens, heads,
                  mesh)
  # STEP_PRICES is keyed by the family's name: a family none was compiled for finds no step.
  t2v = str(keys.get("model_type", "T2V")).upper() == "T2V" and not blocks
  prices = step_prices(key) if t2v else None
  ring = key[6] > 1  # per-layer and per-head budgets do not run on a ring (checked): one plan
  if prices is None or not all(vs.get("priced") for vs in priced):
    why = (f"no compiled step for {family.name} {keys.get('model_type', 'T2V')}, {tokens:,} "
           f"tokens, {heads} heads, {key[4]} per device, batch {key[5]} per device, ring "
           f"{key[6]} on {target.chip}: `python -m maxdiffusion_svg bench step --config CONFIG "
           f"--slice SLICE` compiles and prices one")
    return {"priced": False, "why": why}
  launches = key[4] * key[5]  # the device's heads of its share of the CFG pair, one launch a layer
  out: dict[str, Any] = {"priced": True, "source": prices.source, "libtpu": LIBTPU,
                         "family": family.name, "baseline": (
                             "flash" if prices.baseline_kernel_in_program else
                             "ulysses_ring_custom_fixed_m" if ring
                             else "ulysses_custom_fixed_m"), "experts": {}}
  for path in ("fixed", "online"):
    run = base = 0.0
    for row, vs in zip(rows, priced):
      calls, n, fixed_m = vs[path], launches, vs["fixed_m_call"]
      if ring:  # a device's kernels a layer: its shard's share of each head (the slowest's)
        shards = ring_kernel_prices(plans[row.expert], tokens, mesh["context_shards"],
                                    mesh["ulysses_shards"], launches, key[1], path == "online")
        calls = {"sparse_call": shards["svg_max"], "dense_call": shards["ours_dense"]}
        n, fixed_m = 1, shards["ring_custom_fixed_m"]
      sparse = prices.step(row.layers, row.sparse_layers, calls["sparse_call"],
                           calls["dense_call"], n)
      dense = prices.step(row.layers, 0, calls["sparse_call"], calls["dense_call"], n)
      theirs = prices.baseline_step(row.layers, fixed_m, n)
      run += row.sparse_steps * sparse + (row.steps - row.sparse_steps) * dense
      base += row.steps * theirs
      expert = out["experts"].setdefault(row.expert or "", {})
      expert[path] = {"sparse_step": theirs / sparse, "dense_step": theirs / dense}
      expert["attention_share"] = 1 - (prices.baseline_outside + row.layers * (
          prices.baseline_layer_rest)) / theirs
    out[path] = {"run": base / run}
  return out


def _compensation(blocks: int, plan, per_layer: bool = False) -> dict[str, Any] | None:
  """What a compensated sparse call adds: each query tile row also scores, in our kernel's
  closing step (Splash and XLA: after the kernel), the ``blocks`` centroids of each key tile it
  skips, at most ``row_keys`` of them (the slots every row holds), ``row_keys / S`` of a dense
  call's scores; None when compensation is off (``per_layer``: on in the layers
  ``svg_layer_compensation`` names)."""
  if not blocks:
    return None
  row_keys = plan_row_keys(plan, blocks)
  return {"blocks": blocks, "pseudo_keys": plan.num_kv_tiles * blocks, "row_keys": row_keys,
          "score_work_vs_dense": row_keys / plan.seq_len, "per_layer": per_layer}


def _semantic(svg: Any, grid: VideoGrid, plan: Any) -> dict[str, Any] | None:
  """What a call's semantic layout adds, computed (multiply-adds): the k-means of the keys
  (each update reads a strided sample: distances and sums, two matrix products; the final
  assignment reads every token) cold and warm, against the call's attention work (its visited
  tiles' two matrix products). The gathers, the order and the table are not counted (the
  static schedule's figures, docs/benchmarks.md, count them). None when semantic is off."""
  if svg.semantic is None:
    return None
  clusters, group = svg.semantic_clusters, group_size(grid)
  points = grid.tokens // group
  stride = max(1, points // (clusters * SAMPLE_PER_CLUSTER))
  sample = -(-points // stride)
  per_update = 2 * sample * clusters  # distances and sums, per head-dim
  final = points * clusters
  attention = 2 * plan.stats.visited_tiles * plan.block_q * plan.block_kv
  cold = svg.semantic_iterations * per_update + final
  warm = svg.semantic_warm_iterations * per_update + final if svg.semantic_warm_iterations else cold
  return {"clusters": clusters, "group": group, "cold_iterations": svg.semantic_iterations,
          "warm_iterations": svg.semantic_warm_iterations, "cold_vs_attention": cold / attention,
          "warm_vs_attention": warm / attention}


def _rungs(svg: Any, expert: str | None, layers: int, heads: int) -> dict[Rung, float]:
  """Per-layer rungs (density, compensation): each distinct rung's share of the layers the
  schedule makes sparse (empty: one density for all). Per-head densities: each distinct
  density's share of the sparse layers' heads (a ragged call costs its heads' tiles)."""
  budget = svg.budget(expert)  # its shape against the model's: check_before_weights
  per_head = budget.head_densities
  if per_head is not None:
    rows = per_head if len(per_head) > 1 else per_head * layers
    sparse = [row for i, row in enumerate(rows) if svg.schedule.active_layers.contains(i)]
    flat = [d for row in (sparse or rows) for d in row]
    return {Rung(d, budget.compensation): flat.count(d) / len(flat) for d in sorted(set(flat))}
  per_layer = budget.layer_rungs
  if per_layer is None:
    return {}
  active = [r for i, r in enumerate(per_layer) if svg.schedule.active_layers.contains(i)]
  active = active or list(per_layer)
  return {r: active.count(r) / len(active) for r in sorted(set(active))}


def _weighted(priced: dict[Rung, dict[str, Any]], weights: dict[Rung, float]) -> dict[str, Any]:
  """One rung's pricing, or the layers' rungs priced together (their calls averaged)."""
  first = next(iter(priced.values()))
  unpriced = next((p for p in priced.values() if not p.get("priced")), None)
  if len(priced) == 1 or unpriced is not None:
    return unpriced or first
  out = {**first}
  for path in ("fixed", "online"):
    row = {name: sum(weights[d] * p[path][name] for d, p in priced.items())
           for name in ("sparse_call", "dense_call", "run_call")}
    out[path] = {**row, "bound": first["fixed_m_call"] / row["run_call"]}
  return out


def _combined(rows: list[Estimate], priced: list[dict[str, Any]], blocks: int = 0,
              blocks_source: str = "") -> dict[str, Any]:
  """The whole run: each model's calls weighted by the steps it runs (every step has the
  same layers and video, so the same dense attention work). ``blocks``: more self-attention
  calls per step, each dense (VACE's control blocks, over the same grid), so every per-call
  figure averages over ``layers + blocks`` calls; against fixed-m a block's call is priced as
  the cheaper of our dense call and fixed-m's (it runs ``svg_dense_kernel``), so the bound
  stays an upper one."""
  steps, layers = sum(row.steps for row in rows), rows[0].layers

  def per_call(layer_call: float, block_call: float) -> float:
    return layer_call if not blocks else (layers * layer_call + blocks * block_call) / (
        layers + blocks)

  layers_work = sum(row.steps * row.work_vs_dense for row in rows) / steps
  work = per_call(layers_work, 1.0)
  sparse = sum(row.sparse_steps * row.sparse_layers for row in rows)
  out: dict[str, Any] = {"steps": steps, "layers": layers,
                         "sparse_call_share": sparse / (steps * (layers + blocks)),
                         "work_vs_dense": work, "speedup_bound": 1 / work}
  if blocks:
    out["dense_blocks"] = {"count": blocks, "source": blocks_source,
                           "layers_work_vs_dense": layers_work}
  if all(vs.get("priced") for vs in priced):
    out["vs_fixed_m"] = {}
    fixed_m = priced[0]["fixed_m_call"]
    for path in ("fixed", "online"):
      run = sum(row.steps * vs[path]["run_call"] for row, vs in zip(rows, priced)) / steps
      run = per_call(run, min(fixed_m, priced[0][path]["dense_call"]))
      out["vs_fixed_m"][path] = {"bound": fixed_m / run}
  return out


def _against_fixed_m(plan, share: float, tiles, target: Target, backend: str,
                     dense_rows=None) -> dict[str, Any]:
  """The run's self-attention bundles by libtpu's static schedule (schedule_costs.PRICES),
  ours (``share`` of the calls sparse, the rest dense; a sparse call with ``dense_rows``, the
  leading frames' call too) against MaxDiffusion's fixed-m kernel at its fast recipe on every
  call; or why it cannot be priced."""
  chip = target.generation.name if target.known else None
  prices = PRICES.get(chip or "", {})
  ours, theirs = prices.get("ours"), prices.get("maxdiffusion_fixed_m")
  if backend != "pallas" or ours is None or theirs is None:
    return {"priced": False, "why": f"no static-schedule figures for {backend} on "
                                    f"{target.chip} (measured: pallas on {', '.join(PRICES)})"}
  if (tiles.block_q, tiles.block_kv, tiles.block_kv_compute) != ours.tiles or plan.masks_exact:
    return {"priced": False, "why": f"figures are for aligned {ours.tiles[0]}x{ours.tiles[1]}/"
                                    f"{ours.tiles[2]} tiles"}
  stats, tokens = plan.stats, plan.seq_len
  out: dict[str, Any] = {"priced": True, "chip": chip, "libtpu": LIBTPU,
                         "fixed_m_call": theirs.dense_call(tokens)}
  for path, online in (("fixed", False), ("online", True)):
    sparse = ours.call(stats.full_tiles, stats.masked_tiles, plan.num_q_tiles, online)
    if dense_rows is not None:  # priced on our tiles, scaled by its shorter query tile (modelled)
      sparse += round(ours.call(dense_rows.stats.full_tiles, dense_rows.stats.masked_tiles,
                                dense_rows.num_q_tiles, online)
                      * dense_rows.block_q / plan.block_q)
    dense = ours.dense_call(tokens, online)
    run = share * sparse + (1 - share) * dense
    out[path] = {"sparse_call": sparse, "dense_call": dense, "run_call": run,
                 "bound": out["fixed_m_call"] / run}
  return out
