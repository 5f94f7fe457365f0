"""Calibration: each layer's error at a ladder of rungs (band density x compensation off or
on), measured on a checkpoint's own attention inputs, and the per-layer rungs that spend the
uniform budget best.

The measurement is the call a run makes: at each rung, every head routed among the configured
layouts by :func:`maxdiffusion_svg.call.attention.svg_attention` (compensated or not as the rung
says), its output against dense attention of the same inputs. A layer's error is the mean over
its heads and samples of the squared error relative to the dense output's power, so layers
whose outputs differ in scale weigh alike; within a layer, each head weighs by its dense output's
power (:func:`layer_error`), so a soft head with little output counts for what it adds to the
residual stream, not as much as the layer's strongest head. A rung costs its plan's visited key tiles, plus, when
compensated, the row keys each query tile row scores (in key tiles). The allocation
(:mod:`maxdiffusion_svg.budgets.per_layer`) then picks one rung per layer at a total cost no larger
than the uniform rung's (the config's density and compensation).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.per_layer import (Allocation, Rung, allocate, allocate_greedy,
                                                least_cost)
from maxdiffusion_svg.call.attention import svg_attention
from maxdiffusion_svg.kernels import dense_attention
from maxdiffusion_svg.parallel.sharding import head_exchange, layout_axes, per_local_heads
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import check_density
from maxdiffusion_svg.plan.target import Target
from maxdiffusion_svg.routing.compensation import plan_row_keys
from maxdiffusion_svg.routing.router import layout_errors, sample_dense, sample_rows

# How far a layer the allocation takes tiles from may fall: at most MAX_LOSS_DB below its
# uniform PSNR against dense, or down to FLOOR_DB (a relative error of 1e-3) where that is
# lower. The total error alone would strip a sharp layer from 87 to 11 dB to win 4 dB on the
# whole model (docs/benchmarks.md, "Per-layer budgets calibrated on the checkpoint").
MAX_LOSS_DB = 3.0
FLOOR_DB = 30.0
# Densities a layer may take. Dense (1.0) is a rung: a layer no band serves runs every tile.
LADDER = (0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.7, 1.0)
# Compensation a layer may take (``--compensation``): both, or only what the config says.
COMPENSATION_CHOICES = {"both": (False, True), "off": (False,), "on": (True,), "config": None}

QKV = tuple[Any, Any, Any]
# How a layer's error weighs its heads' relative errors: by each head's dense output power (the
# layer's output error relative to its power), or the plain mean over heads (before issue 59).
WEIGHTINGS = ("power", "mean")
# Rows a call's on-device measurement reads (the router's stratified sample, more of it): the
# errors are averaged over steps and prompts too.
CALIBRATION_ROWS = 256


def check_ladder(ladder: Sequence[float], key: str = "--ladder") -> tuple[float, ...]:
  if not ladder:
    raise ValueError(f"{key} needs at least one density")
  for i, density in enumerate(ladder):
    check_density(density, f"{key}[{i}]")
  return tuple(sorted(set(float(d) for d in ladder)))


def uniform_rung(config: SvgConfig, expert: str | None = None) -> Rung:
  """What every layer of ``expert`` runs without per-layer keys: the budget to spend."""
  return Rung(config.budget(expert).density, config.compensation)


def candidate_rungs(config: SvgConfig, ladder: Sequence[float], compensation: str = "both",
                    experts: Sequence[str | None] = (None,)) -> tuple[Rung, ...]:
  """Every (density, compensation) of ``ladder`` x ``compensation``'s choices
  (:data:`COMPENSATION_CHOICES`; ``config``: the config's own), with each expert's uniform rung
  on it: the uniform choice is always a candidate, so the allocation is never worse than it on
  the measured inputs."""
  choices = compensation_choices(compensation, config)
  rungs = {Rung(d, c) for d in check_ladder(ladder) for c in choices}
  return tuple(sorted(rungs | {uniform_rung(config, e) for e in experts}))


def compensation_choices(compensation: str, config: SvgConfig) -> tuple[bool, ...]:
  """The compensation a layer may take under ``--compensation`` (``config``: the config's
  own); any other name is refused."""
  if compensation not in COMPENSATION_CHOICES:
    raise ValueError(f"--compensation must be one of {', '.join(COMPENSATION_CHOICES)}, got "
                     f"{compensation!r}")
  return COMPENSATION_CHOICES[compensation] or (config.compensation,)


def rung_costs(config: SvgConfig, grid: VideoGrid, rungs: Sequence[Rung],
               expert: str | None = None, target: Target | None = None) -> np.ndarray:
  """``[K]``: what one head's call costs at each rung, in key tiles, by the plans the run
  builds: the visited tiles, and a compensated rung's row keys (each query tile row scores
  them beside its tiles, ``row keys / block_kv`` tiles a row)."""
  costs = []
  for rung in rungs:
    config_at = config.at_rung(rung)
    plan = config_at.plan(grid, expert, target=target)
    blocks = config_at.compensation_for(target)
    row_keys = plan_row_keys(plan, blocks) if blocks else 0
    costs.append(plan.stats.visited_tiles + plan.num_q_tiles * row_keys / plan.block_kv)
  return np.asarray(costs, np.float64)


def relative_error(out: Any, dense: Any) -> np.ndarray:
  """``[B, H]``: squared error over the dense output's power, per head."""
  out, dense = np.asarray(out, np.float64), np.asarray(dense, np.float64)
  return ((out - dense) ** 2).sum((-1, -2)) / np.maximum((dense ** 2).sum((-1, -2)), 1e-30)


def _check_weighting(weighting: str) -> None:
  if weighting not in WEIGHTINGS:
    raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")


def layer_error(head_errors: Any, power: Any, weighting: str = "power") -> Any:
  """``[..., K]``: a layer's error from its heads' relative errors ``[..., H, K]`` and their
  dense outputs' power ``[..., H]``: weighted by the power (``"power"``: the layer output's
  squared error over its power, what reaches the residual stream), or the plain mean."""
  _check_weighting(weighting)
  if weighting == "mean":
    return head_errors.mean(axis=-2)
  return (head_errors * power[..., None]).sum(axis=-2) / power.sum(axis=-1)[..., None]


def head_weights(power: Any, weighting: str = "power") -> np.ndarray:
  """``[..., H]``: each head's share of its layer's error (:func:`layer_error`), summing to 1."""
  _check_weighting(weighting)
  power = np.asarray(power, np.float64)
  if weighting == "mean":
    return np.full(power.shape, 1 / power.shape[-1])
  return power / np.maximum(power.sum(axis=-1, keepdims=True), 1e-30)


def head_errors(layers: Sequence[Sequence[QKV]], config: SvgConfig, grid: VideoGrid,
                rungs: Sequence[Rung], *, target: Target | None = None,
                log: Callable[[str], None] = lambda _: None) -> tuple[np.ndarray, np.ndarray]:
  """``[L, H, K]`` and ``[L, H]``: each head's relative error at each rung and its dense output's
  power, over the layer's samples. ``layers[l]``: that layer's ``(q, k, v)`` samples,
  ``[B, H, S, D]`` frame-major."""
  dense = jax.jit(dense_attention)
  calls = [jax.jit(lambda q, k, v, c=config.at_rung(r): svg_attention(
      q, k, v, grid=grid, config=c, target=target)) for r in rungs]
  heads = layers[0][0][0].shape[1]
  errors = np.zeros((len(layers), heads, len(rungs)))
  power = np.zeros((len(layers), heads))
  for i, samples in enumerate(layers):
    for q, k, v in samples:
      ref = dense(q, k, v)
      power[i] += (np.asarray(ref, np.float64) ** 2).mean((-1, -2)).mean(axis=0) / len(samples)
      for j, call in enumerate(calls):
        errors[i, :, j] += relative_error(call(q, k, v), ref).mean(axis=0) / len(samples)
    log(f"layer {i}: {len(samples)} samples x {len(rungs)} rungs")
  return errors, power


def layer_errors(layers: Sequence[Sequence[QKV]], config: SvgConfig, grid: VideoGrid,
                 rungs: Sequence[Rung], *, target: Target | None = None,
                 log: Callable[[str], None] = lambda _: None,
                 per_head: bool = False, weighting: str = "power") -> np.ndarray:
  """``[L, K]``: each layer's error at each rung (:func:`layer_error` of :func:`head_errors`);
  ``per_head``: ``[L, H, K]``, each head's relative error."""
  errors, power = head_errors(layers, config, grid, rungs, target=target, log=log)
  return errors if per_head else layer_error(errors, power, weighting)


def sampled_rung_errors(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid,
                        config: SvgConfig, rungs: Sequence[Rung], key: jax.Array,
                        scale: float | None = None, expert: str | None = None,
                        target: Target | None = None, per_head: bool = False,
                        weighting: str = "power") -> tuple[jax.Array, jax.Array, jax.Array]:
  """``float32 [K]`` twice: one call's error per rung (:func:`layer_error` of its heads'), on
  device, from
  :data:`CALIBRATION_ROWS` sampled rows against their dense output: each head takes the lower
  of its spatial and temporal errors under the rung's execution mask (as the router would
  choose), compensated where the rung compensates; and the share of heads whose better layout
  is temporal at each rung (the layouts the table reports). What ``calibrate`` records per step and
  layer of a real run, where the whole inputs cannot leave the device. ``per_head``: ``[K, H]``
  each, every head's over the batch (what per-head budgets allocate). Third: the heads' dense
  output power over the batch, ``[H]`` (``per_head``) or its sum over heads."""
  errors, temporal, power = head_rung_errors(q, k, v, grid=grid, config=config, rungs=rungs,
                                             key=key, scale=scale, expert=expert, target=target)
  return _reduced(errors, temporal, power, per_head, weighting)


def _reduced(errors: jax.Array, temporal: jax.Array, power: jax.Array, per_head: bool,
             weighting: str = "power") -> tuple[jax.Array, jax.Array, jax.Array]:
  """``[B, H, K]``, ``[B, H, K]``, ``[B, H]`` -> ``[K]`` (the layer's error over the batch, the
  share of heads temporal) or ``[K, H]`` (over the batch), and the power over the batch."""
  if per_head:
    return jnp.mean(errors, axis=0).T, jnp.mean(temporal, axis=0).T, jnp.mean(power, axis=0)
  return (jnp.mean(layer_error(errors, power, weighting), axis=0),
          jnp.mean(temporal, axis=(0, 1)), jnp.mean(jnp.sum(power, axis=1)))


def head_rung_errors(q: jax.Array, k: jax.Array, v: jax.Array, *, grid: VideoGrid,
                     config: SvgConfig, rungs: Sequence[Rung], key: jax.Array,
                     scale: float | None = None, expert: str | None = None,
                     target: Target | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``float32 [B, H, K]`` twice: :func:`sampled_rung_errors` of each (example, head), and
  whether its better layout is temporal (0 or 1); and ``[B, H]``, each head's dense output power
  on the sampled rows: independent per head, so a device can measure its own heads
  (:func:`sharded_rung_errors`)."""
  router = dataclasses.replace(config.router, profile_queries=CALIBRATION_ROWS)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  rows = sample_rows(key, grid.tokens, router)
  sampled = sample_dense(q, k, v, rows, scale)
  power = jnp.maximum(jnp.mean(sampled.dense ** 2, axis=(2, 3)), 1e-30)
  errors, temporal_first = [], []
  for rung in rungs:
    config_at = config.at_rung(rung)
    plan = config_at.plan(grid, expert, target=target)
    blocks = config_at.compensation_for(target)
    spatial, temporal = layout_errors(q, k, v, rows, grid, plan.computed_mask, scale=scale,
                                      sampled=sampled,
                                      compensation=(plan, blocks) if blocks else None)
    errors.append(jnp.minimum(spatial, temporal) / power)
    temporal_first.append((temporal < spatial).astype(jnp.float32))
  return jnp.stack(errors, axis=-1), jnp.stack(temporal_first, axis=-1), power


def sharded_rung_errors(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Any,
                        qkv_spec: Any, ulysses_shards: Any = None, per_head: bool = False,
                        weighting: str = "power",
                        **kwargs: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`sampled_rung_errors` of global sequence-sharded inputs, each device measuring its own
  heads after the Ulysses exchange (the batch folded into the heads where nothing shards it),
  as the kernel runs them: measured on the global arrays instead, XLA held every head's sampled
  logits on every device (the Wan 14B forward with 16 rungs compiled for a v6e-8: 23,334 MiB of
  temporaries against 2,472 without the measurement). On a ring (``ulysses_shards`` below the
  context axis) the global measurement stands."""
  seq_axis, batch_axes = layout_axes(mesh, qkv_spec)
  ex = head_exchange(mesh, q.shape, seq_axis=seq_axis, batch_axes=batch_axes,
                     ulysses_shards=ulysses_shards)
  if ex.ring > 1:
    return sampled_rung_errors(q, k, v, per_head=per_head, weighting=weighting, **kwargs)
  batch, heads = q.shape[:2]
  fold = batch > 1 and ex.batch_shards == 1  # every (example, head) is independent
  if fold:
    q, k, v = (x.reshape(1, batch * heads, *x.shape[2:]) for x in (q, k, v))
    ex = head_exchange(mesh, q.shape, seq_axis=seq_axis, batch_axes=batch_axes,
                       ulysses_shards=ulysses_shards)
  key = kwargs.pop("key")
  measure = per_local_heads(lambda q, k, v, key: head_rung_errors(q, k, v, key=key, **kwargs),
                            ex, extra_specs=(P(),))
  errors, temporal, power = measure(q, k, v, key)
  if fold:
    errors, temporal = (x.reshape(batch, heads, -1) for x in (errors, temporal))
    power = power.reshape(batch, heads)
  return _reduced(errors, temporal, power, per_head, weighting)


def psnr_db(error: Any) -> np.ndarray:
  """PSNR (dB) of a relative squared error: the dense output's power as the peak."""
  return -10 * np.log10(np.maximum(np.asarray(error, np.float64), 1e-30))


def guard_broken(chosen: Any, uniform: Any, max_loss_db: float = MAX_LOSS_DB,
                 floor_db: float = FLOOR_DB) -> np.ndarray:
  """``[N]`` bool: the items whose ``chosen`` error the guard would not have allowed (what
  :func:`_spend`'s caps forbid): more than ``max_loss_db`` below their ``uniform`` PSNR and
  under ``floor_db``. For judging a choice on inputs it was not fitted to."""
  chosen = np.asarray(chosen, np.float64)
  return ((psnr_db(uniform) - psnr_db(chosen) > max_loss_db + 1e-9)
          & (psnr_db(chosen) < floor_db))


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Per-layer rungs and what they cost and leave, beside the uniform rung's."""

  rungs: tuple[Rung, ...]
  costs: tuple[float, ...]  # key tiles per head's call, per rung (rung_costs)
  errors: tuple[tuple[float, ...], ...]  # [L, K], measured
  chosen: tuple[Rung, ...]  # per layer
  uniform: Rung
  allocation: Allocation
  uniform_allocation: Allocation

  @property
  def densities(self) -> tuple[float, ...]:
    return tuple(r.density for r in self.chosen)

  @property
  def compensation(self) -> tuple[bool, ...]:
    return tuple(r.compensation for r in self.chosen)

  def as_dict(self) -> dict[str, Any]:
    return {"rungs": [str(r) for r in self.rungs], "costs": list(self.costs),
            "errors": [list(row) for row in self.errors], "densities": list(self.densities),
            "compensation": list(self.compensation), "choice": list(self.allocation.choice),
            "uniform": str(self.uniform), "uniform_rung": self.rungs.index(self.uniform),
            "tiles": self.allocation.cost,
            "uniform_tiles": self.uniform_allocation.cost, "error": self.allocation.error,
            "uniform_error": self.uniform_allocation.error}


def calibrate_layers(errors: Any, costs: Any, rungs: Sequence[Rung], uniform: Rung,
                     target_error: float | None = None, max_loss_db: float | None = MAX_LOSS_DB,
                     floor_db: float = FLOOR_DB, match_uniform: bool = False) -> Calibration:
  """Rungs per layer from measured ``errors [L, K]`` at ``rungs`` (which holds ``uniform``):
  the least total error within the uniform rung's cost, or with
  ``target_error`` (a mean relative error per layer) the fewest tiles that meet it
  (``match_uniform``: the uniform rung's own measured error is the target). No layer
  ends more than ``max_loss_db`` below its uniform PSNR unless it stays above ``floor_db``
  (None: no guard, the total error alone)."""
  errors, costs = np.asarray(errors, np.float64), np.asarray(costs, np.float64)
  rungs, uniform = tuple(Rung(*r) for r in rungs), Rung(*uniform)
  if uniform not in rungs:
    raise ValueError(f"the rungs {[str(r) for r in rungs]} must hold the uniform rung {uniform}")
  u = rungs.index(uniform)
  chosen, uniform_allocation = _spend(errors, costs, u, target_error, errors.shape[0],
                                      max_loss_db, floor_db, match_uniform=match_uniform)
  return Calibration(rungs, tuple(costs.tolist()), tuple(map(tuple, errors.tolist())),
                     tuple(rungs[i] for i in chosen.choice), uniform, chosen, uniform_allocation)


@dataclasses.dataclass(frozen=True)
class HeadCalibration:
  """Per-head densities, (layer, head) items allocated together, beside the uniform density's.
  An item's error is its head's relative error over the layer's heads (so a layer's items sum to
  the layer's mean, and totals read as :class:`Calibration`'s)."""

  densities: tuple[float, ...]  # the candidates
  costs: tuple[float, ...]  # key tiles per head's call, per candidate
  errors: np.ndarray  # [L, H, K], measured (each head's share of its layer's mean)
  chosen: tuple[tuple[float, ...], ...]  # [L][H]
  choice: np.ndarray  # [L, H] indices into ``densities``
  uniform: float
  allocation: Allocation
  uniform_allocation: Allocation

  @property
  def tiles(self) -> float:
    """Key tiles per head over the layers (the mean head's): comparable with a per-layer
    :class:`Calibration`'s cost."""
    return self.allocation.cost / self.errors.shape[1]

  @property
  def uniform_tiles(self) -> float:
    return self.uniform_allocation.cost / self.errors.shape[1]

  def layer_errors(self) -> np.ndarray:
    """``[L]``: each layer's error at the chosen densities (its heads' mean)."""
    rows = np.arange(self.errors.shape[0])[:, None]
    cols = np.arange(self.errors.shape[1])[None, :]
    return self.errors[rows, cols, self.choice].sum(axis=1)

  def as_dict(self) -> dict[str, Any]:
    u = self.densities.index(self.uniform)
    return {"densities": list(self.densities), "costs": list(self.costs),
            "head_densities": [list(layer) for layer in self.chosen], "uniform": self.uniform,
            "layer_errors": self.layer_errors().tolist(),
            "uniform_layer_errors": self.errors[:, :, u].sum(axis=1).tolist(),
            "tiles": self.tiles, "uniform_tiles": self.uniform_tiles,
            "error": self.allocation.error, "uniform_error": self.uniform_allocation.error}


def calibrate_heads(errors: Any, costs: Any, densities: Sequence[float], uniform: float,
                    target_error: float | None = None, max_loss_db: float | None = MAX_LOSS_DB,
                    floor_db: float = FLOOR_DB, budget: float | None = None,
                    weights: Any = None, match_uniform: bool = False) -> HeadCalibration:
  """Densities per (layer, head) from measured ``errors [L, H, K]`` (each head's relative error
  at ``densities``, which holds ``uniform``): the least total error within the uniform
  density's cost (every head at it), or with ``target_error`` (a mean relative error per layer)
  about the fewest tiles that meet it (:func:`~maxdiffusion_svg.budgets.per_layer.allocate_greedy`:
  layers x heads is too many items for the exact front). The guard is per head, as
  :func:`calibrate_layers`' per layer. ``budget``: key tiles per head over the layers to spend
  instead of the uniform density's (e.g. a plain call's, for compensated candidates).
  ``weights [L, H]``: each head's share of its layer's error (:func:`head_weights`; default
  alike, ``1 / H``). ``match_uniform``: as :func:`calibrate_layers`'."""
  errors, costs = np.asarray(errors, np.float64), np.asarray(costs, np.float64)
  densities = tuple(float(d) for d in densities)
  if float(uniform) not in densities:
    raise ValueError(f"the densities {list(densities)} must hold the uniform density {uniform}")
  u = densities.index(float(uniform))
  layers, heads, _ = errors.shape
  weights = (np.full((layers, heads), 1 / heads) if weights is None
             else np.asarray(weights, np.float64))
  shares = errors * weights[:, :, None]  # each head's share of its layer's error
  items = shares.reshape(layers * heads, -1)
  chosen, uniform_allocation = _spend(items, costs, u, target_error, layers, max_loss_db,
                                      floor_db, floor_share=weights.reshape(-1), exact=False,
                                      budget=None if budget is None else budget * heads,
                                      match_uniform=match_uniform)
  choice = np.asarray(chosen.choice).reshape(layers, heads)
  return HeadCalibration(densities, tuple(costs.tolist()), shares,
                         tuple(tuple(densities[k] for k in row) for row in choice), choice,
                         float(uniform), chosen, uniform_allocation)


def _spend(items: np.ndarray, costs: np.ndarray, u: int, target_error: float | None,
           layers: int, max_loss_db: float | None, floor_db: float, floor_share: Any = 1.0,
           exact: bool = True, budget: float | None = None,
           match_uniform: bool = False) -> tuple[Allocation, Allocation]:
  """``(chosen, uniform)``: the allocation of ``items [N, K]`` (layers, or layers x heads) within
  the uniform rung ``u``'s cost, or with ``target_error`` (per layer) the least cost meeting it;
  each item capped by the guard (``floor_share``: an item's share of the floor, one or
  ``[N]``). ``exact``: the multiple-choice front, else the greedy (many items). ``budget``: the
  cost to spend in place of the uniform rung's. ``match_uniform``: the target is the uniform
  allocation's own error (which it meets, so some allocation always does)."""
  n = items.shape[0]
  uniform = Allocation((u,) * n, float(costs[u] * n), float(items[:, u].sum()))
  caps = None if max_loss_db is None else np.maximum(
      items[:, u] * 10 ** (max_loss_db / 10), 10 ** (-floor_db / 10) * floor_share)
  if match_uniform:
    if target_error is not None:
      raise ValueError("give --target-error or --match-uniform, not both")
    target_error = uniform.error / layers
  if target_error is None:
    spend = uniform.cost if budget is None else budget
    return (allocate if exact else allocate_greedy)(items, costs, spend, caps), uniform
  if not target_error > 0:
    raise ValueError(f"--target-error must be > 0 (a mean relative error per layer), got "
                     f"{target_error}")
  return (least_cost if exact else _least_cost_greedy)(items, costs, target_error * layers,
                                                       caps), uniform


def _least_cost_greedy(items: np.ndarray, costs: np.ndarray, target: float,
                       caps: Any) -> Allocation:
  """About the fewest tiles whose greedy allocation meets ``target``: a bisection on the
  budget (the greedy's error falls as its budget grows)."""
  lo, hi = float(costs.min()) * len(items), float(costs.max()) * len(items)
  best = allocate_greedy(items, costs, hi, caps)
  if best.error > target + 1e-12:
    raise ValueError(f"--target-error is below the least total error {best.error:.4g} any "
                     f"choice reaches")
  for _ in range(40):
    mid = (lo + hi) / 2
    try:
      trial = allocate_greedy(items, costs, mid, caps)
    except ValueError:
      lo = mid
      continue
    if trial.error <= target + 1e-12:
      best, hi = trial, mid
    else:
      lo = mid
  return best
