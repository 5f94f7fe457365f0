"""Per-layer budgets: each layer's density (and compensation), chosen from measured errors by
an exact knapsack over the (cost, error) Pareto front (:func:`allocate`, :func:`least_cost`).
Each distinct rung is one prepared plan; a traced layer index picks one (``lax.switch``)."""

from __future__ import annotations

import dataclasses
import heapq
import re
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import yaml

from maxdiffusion_svg.plan.masks import check_density

UNIFORM = "uniform"  # leaves a per-layer key unset: every layer svg_density (svg_compensation)
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+))?\s*$")


class Rung(NamedTuple):
  """What one layer runs: its band density and whether it compensates what it skips."""

  density: float
  compensation: bool = False

  def __str__(self) -> str:
    return f"{self.density:g}{'+compensation' if self.compensation else ''}"


def check_layer_densities(value: Any, key: str = "svg_layer_densities") -> tuple[float, ...] | None:
  """``value`` as one density per layer (None: unset), from a list, ``uniform``, YAML text, or
  layer ranges (``{0-4: 0.3, 5-39: 0.15}``, covering every layer from 0 once)."""
  values = per_layer_values(value, key, "densities")
  if values is None:
    return None
  for i, density in enumerate(values):
    check_density(density, f"{key}[{i}]")
  return tuple(float(d) for d in values)


def check_layer_compensation(value: Any,
                             key: str = "svg_layer_compensation") -> tuple[bool, ...] | None:
  """``value`` as compensation per layer (None: unset); :func:`check_layer_densities`' forms."""
  values = per_layer_values(value, key, "booleans")
  if values is None:
    return None
  for i, on in enumerate(values):
    if not isinstance(on, (bool, np.bool_)):
      raise ValueError(f"{key}[{i}] must be true or false, got {on!r}")
  return tuple(bool(on) for on in values)


def per_layer_values(value: Any, key: str, what: str) -> list[Any] | None:
  """A per-layer key's values as a list (None: unset); the items are the caller's to check."""
  if value is None or (isinstance(value, (list, tuple, dict)) and not value):
    return None
  if isinstance(value, str):
    if value.strip() == UNIFORM:
      return None
    try:
      value = yaml.safe_load(value)
    except yaml.YAMLError as e:
      raise ValueError(f"{key}: cannot read {value!r} (a list of {what} per layer, a "
                       f"mapping of layer ranges to {what}, or {UNIFORM!r})") from e
    return per_layer_values(value, key, what)
  if isinstance(value, Mapping):
    value = _from_ranges(value, key)
  if not isinstance(value, (list, tuple)):
    raise ValueError(f"{key} must be a list of {what} per layer, a mapping of layer ranges "
                     f"to {what}, or {UNIFORM!r}; got {value!r}")
  return list(value)


def _from_ranges(ranges: Mapping[Any, Any], key: str) -> list[Any]:
  layers: dict[int, Any] = {}
  for span, density in ranges.items():
    match = _RANGE.match(str(span))
    if not match:
      raise ValueError(f"{key}: layer range {span!r} must be 'first-last' or one layer index")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if last < first:
      raise ValueError(f"{key}: layer range {span!r} ends before it starts")
    for layer in range(first, last + 1):
      if layer in layers:
        raise ValueError(f"{key}: layer {layer} is in two ranges")
      layers[layer] = density
  missing = sorted(set(range(max(layers) + 1)) - set(layers))
  if missing:
    raise ValueError(f"{key}: layers {missing} are in no range (cover every layer from 0)")
  return [layers[i] for i in range(len(layers))]


def check_layer_count(values: Sequence[Any] | None, num_layers: int,
                      key: str = "svg_layer_densities") -> None:
  """A model of ``num_layers`` layers takes exactly one value per layer."""
  if values is not None and len(values) != num_layers:
    raise ValueError(f"{key} gives {len(values)} values; the model has {num_layers} "
                     f"layers (give one per layer, or {UNIFORM!r})")


def layer_ranges(values: Sequence[Any]) -> str:
  """Per-layer ``values`` as runs of layers, the form the keys read: ``0-9: 0.3, 10-39: 0.15``."""
  runs, start = [], 0
  for i in range(1, len(values) + 1):
    if i == len(values) or values[i] != values[start]:
      span = f"{start}-{i - 1}" if i - 1 > start else f"{start}"
      value = values[start]
      text = (str(value).lower() if isinstance(value, bool)
              else value if isinstance(value, str) else f"{value:g}")
      runs.append(f"{span}: {text}")
      start = i
  return ", ".join(runs)


def levels(values: Sequence[Any]) -> tuple[tuple[Any, ...], np.ndarray]:
  """The distinct per-layer values, ascending, and each layer's index among them."""
  distinct = tuple(sorted(set(values)))
  return distinct, np.asarray([distinct.index(d) for d in values], np.int32)


@dataclasses.dataclass(frozen=True)
class Allocation:
  """One rung per layer: ``choice [L]`` (ladder indices), total ``cost`` and ``error``."""

  choice: tuple[int, ...]
  cost: float
  error: float


def _front(errors: np.ndarray, costs: np.ndarray) -> list[tuple[float, float, tuple[int, ...]]]:
  """Every non-dominated (cost, error, choice) over the layers: the least error at each cost."""
  front = [(0.0, 0.0, ())]
  for layer_errors, layer_costs in zip(errors, costs):
    grown = sorted((c + float(cost), e + float(err), choice + (rung,))
                   for c, e, choice in front
                   for rung, (cost, err) in enumerate(zip(layer_costs, layer_errors)))
    front, best = [], np.inf
    for c, e, choice in grown:  # ascending cost: keep what lowers the error
      if e < best:
        front.append((c, e, choice))
        best = e
  return front


def _check(errors: Any, costs: Any) -> tuple[np.ndarray, np.ndarray]:
  errors = np.asarray(errors, np.float64)
  costs = np.broadcast_to(np.asarray(costs, np.float64), errors.shape)
  if errors.ndim != 2 or not errors.size:
    raise ValueError(f"errors must be [layers, rungs], got shape {errors.shape}")
  if not (np.isfinite(errors).all() and np.isfinite(costs).all()) or (costs < 0).any():
    raise ValueError("errors and costs must be finite, costs >= 0")
  return errors, costs


def _capped(errors: np.ndarray, caps: Any) -> np.ndarray:
  """``errors`` with each rung above its layer's cap out of reach (infinite)."""
  if caps is None:
    return errors
  caps = np.broadcast_to(np.asarray(caps, np.float64), errors.shape[:1])
  return np.where(errors <= caps[:, None] * (1 + 1e-12), errors, np.inf)


def allocate(errors: Any, costs: Any, budget: float, caps: Any = None) -> Allocation:
  """The rung per layer with the least total error within ``budget`` (ties: the cheaper).
  ``errors [L, K]``; ``costs [K]`` or ``[L, K]``; ``caps [L]``: the most error per layer."""
  errors, costs = _check(errors, costs)
  feasible = [p for p in _front(_capped(errors, caps), costs)
              if p[0] <= budget + 1e-9 and np.isfinite(p[1])]
  if not feasible:
    raise ValueError(f"no choice fits the budget {budget} (the least is "
                     f"{costs.min(axis=1).sum()})")
  cost, error, choice = feasible[-1]
  return Allocation(choice, cost, error)


def least_cost(errors: Any, costs: Any, target_error: float, caps: Any = None) -> Allocation:
  """The cheapest rung per layer with total error at most ``target_error``."""
  errors, costs = _check(errors, costs)
  for cost, error, choice in _front(_capped(errors, caps), costs):
    if error <= target_error + 1e-12:
      return Allocation(choice, cost, error)
  raise ValueError(f"--target-error {target_error} is below the least total error "
                   f"{errors.min(axis=1).sum():.4g} any choice reaches")


def allocate_greedy(errors: Any, costs: Any, budget: float, caps: Any = None) -> Allocation:
  """:func:`allocate` for many items (layers x heads), greedily along each item's convex hull:
  error at most the exact optimum's plus the largest single upgrade's drop."""
  errors, costs = _check(errors, costs)
  capped = _capped(errors, caps)
  hulls = [_hull(c, e) for c, e in zip(costs, capped)]
  if any(not hull for hull in hulls):
    raise ValueError("an item has no rung within its cap")
  at = [0] * len(hulls)
  spent = sum(float(costs[i, hull[0]]) for i, hull in enumerate(hulls))
  if spent > budget + 1e-9:
    raise ValueError(f"no choice fits the budget {budget} (the least is {spent})")
  heap = []

  def push(i: int) -> None:
    if at[i] + 1 < len(hulls[i]):
      a, b = hulls[i][at[i]], hulls[i][at[i] + 1]
      gain = (capped[i, a] - capped[i, b]) / max(costs[i, b] - costs[i, a], 1e-12)
      heapq.heappush(heap, (-gain, i, at[i]))

  for i in range(len(hulls)):
    push(i)
  while heap:
    _, i, step = heapq.heappop(heap)
    if step != at[i]:
      continue
    extra = float(costs[i, hulls[i][step + 1]] - costs[i, hulls[i][step]])
    if spent + extra > budget + 1e-9:
      continue  # this item's next step does not fit; cheaper steps of others still may
    spent += extra
    at[i] += 1
    push(i)
  choice = [hull[a] for hull, a in zip(hulls, at)]
  rows = np.arange(len(choice))
  # Then the budget left: the single move (any item to any rung) that lowers the error most and
  # fits, until none does.
  while True:
    extra = costs - costs[rows, choice][:, None]
    drop = np.where(extra <= budget - spent + 1e-9, capped[rows, choice][:, None] - capped, 0.0)
    i, k = np.unravel_index(np.argmax(drop), drop.shape)
    if not drop[i, k] > 0:
      break
    spent += float(extra[i, k])
    choice[i] = int(k)
  choice = tuple(choice)
  return Allocation(choice, float(costs[rows, list(choice)].sum()),
                    float(errors[rows, list(choice)].sum()))


def _hull(costs: np.ndarray, errors: np.ndarray) -> list[int]:
  """The finite-error rungs on the lower convex hull of an item's (cost, error), cheapest first."""
  order = sorted((float(c), float(e), k) for k, (c, e) in enumerate(zip(costs, errors))
                 if np.isfinite(e))
  hull: list[tuple[float, float, int]] = []
  for c, e, k in order:
    if hull and e >= hull[-1][1]:
      continue  # costs more, no better
    if hull and c == hull[-1][0]:
      hull.pop()
    while len(hull) >= 2:
      (c0, e0, _), (c1, e1, _) = hull[-2], hull[-1]
      if (e1 - e0) * (c - c0) >= (e - e0) * (c1 - c0):  # the middle one is above the chord
        hull.pop()
      else:
        break
    hull.append((c, e, k))
  return [k for _, _, k in hull]
