"""The scoped-VMEM model of one Splash kernel, fitted to what libtpu allocates.

Non-negative least squares over :data:`TERMS` per family and mask strategy, on
``docs/measurements/vmem_points.json`` (``python -m maxdiffusion_svg bench vmem``); each chip
scales its family to stay above every fitted point. Outside the fitted ranges it refuses.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

TERMS = ("bq*bkc", "bq*bkc*itemsize", "bq*bkv/bkc", "bq*d*itemsize", "bkv*d*itemsize", "bq*d",
         "bq*bkv", "bq", "1")
MARGIN = 0.05
# The generations every case is compiled for: each is a family the others scale.
FAMILIES = ("v5e", "v6e")


def features(bq: int, bkv: int, bkc: int, head_dim: int, itemsize: int) -> np.ndarray:
  """The terms' values; head_dim padded to whole 128-lane vregs (64 allocates as 128)."""
  head_dim = -(-head_dim // 128) * 128
  return np.array([bq * bkc, bq * bkc * itemsize, bq * (bkv // bkc), bq * head_dim * itemsize,
                   bkv * head_dim * itemsize, bq * head_dim, bq * bkv, bq, 1.0], np.float64)


def _row_features(row: Mapping[str, Any]) -> np.ndarray:
  return features(row["block_q"], row["block_kv"], row["block_kv_compute"], row["head_dim"],
                  np.dtype(row["dtype"]).itemsize)


def scale_group(strategy: str, head_dim: int, itemsize: int) -> str:
  """Scale group by mask strategy, lane fill and input width (v5p allocates more for head_dim
  under 128); each at least its strategy's bf16 full-lane scale."""
  return f"{strategy}/{'narrow' if head_dim < 128 else 'full'}/{itemsize}"


def _unscaled(chip: str, strategy: str, x: np.ndarray, coefficients: Any) -> float:
  """The family's bytes, plus v4's widening of int8 mask blocks to 32 bits (stored)."""
  widened = 3 * x[TERMS.index("bq*bkv")] if chip == "v4" and strategy == "stored" else 0.0
  return float(x @ np.asarray(coefficients)) + widened


def fit(points: Mapping[str, Any]) -> dict[str, Any]:
  """The model from a points file's rows (those not held out, that fit the chip)."""
  from scipy.optimize import nnls  # pylint: disable=import-outside-toplevel
  rows = [r for r in points["rows"] if not r["held_out"] and r["compiler_bytes"]]
  coefficients = {}
  for family in FAMILIES:
    for strategy in ("stored", "function"):
      own = [r for r in rows if r["chip"] == family and r["strategy"] == strategy]
      a = np.stack([_row_features(r) for r in own])
      b = np.array([r["compiler_bytes"] for r in own], np.float64)
      # Relative error: each row divided by its own bytes (the scale bounds the worst ratio, so
      # a small kernel's miss counts as much as a large one's); columns on one scale.
      weighted = a / b[:, None]
      scale = weighted.max(axis=0)
      scale[scale == 0] = 1.0
      x, _ = nnls(weighted / scale, np.ones_like(b))
      coefficients[f"{family}/{strategy}"] = [round(float(v), 6) for v in x / scale]
  chips = {}
  # Families first: a chip scaled from a family keeps at least the family's own scales (its
  # few points cannot show every tile the family's did).
  for chip in sorted({r["chip"] for r in rows}, key=lambda c: (c not in FAMILIES, c)):
    own = [r for r in rows if r["chip"] == chip]
    best = None
    for family in ((chip,) if chip in FAMILIES else FAMILIES):
      scales, ratios = {}, []
      for r in own:
        base = _unscaled(chip, r["strategy"], _row_features(r),
                         coefficients[f"{family}/{r['strategy']}"])
        group = scale_group(r["strategy"], r["head_dim"], np.dtype(r["dtype"]).itemsize)
        scales[group] = max(scales.get(group, 0.0), r["compiler_bytes"] / base)
        ratios.append((group, r["compiler_bytes"] / base))
      for group in scales:
        base = scale_group(group.split("/")[0], 128, 2)
        floor = chips[family]["scale"].get(group, 0.0) - MARGIN if family != chip else 0.0
        scales[group] = max(scales[group], scales.get(base, 0.0), floor)
      # The family whose shape this chip's bf16 full-lane points follow most closely (the
      # other points only raise scales): fitting the family to few points would overfit them.
      shape = [ratio for group, ratio in ratios if group.endswith("/full/2")]
      candidate = (max(shape) / min(shape), family, scales)
      best = candidate if best is None or candidate[0] < best[0] else best
    chips[chip] = {"family": best[1],
                   "scale": {g: round(v + MARGIN, 4) for g, v in sorted(best[2].items())}}
  ranges = {}
  for name in ("block_q", "block_kv", "block_kv_compute", "head_dim"):
    ranges[name] = [min(r[name] for r in rows), max(r[name] for r in rows)]
  ranges["itemsize"] = sorted({int(np.dtype(r["dtype"]).itemsize) for r in rows})
  return {"libtpu": points["libtpu"], "coefficients": coefficients, "chips": chips,
          "ranges": ranges}


# Fitted by ``fit`` to docs/measurements/vmem_points.json (tests refit and compare).
MODEL: dict[str, Any] | None = {'libtpu': '0.0.50.1',
 'coefficients': {'v5e/stored': [4.771188, 2.537212, 34.395762, 0.0, 2.228124, 0.0, 1.62022,
                                 0.0, 126692.929872],
                  'v5e/function': [6.568014, 2.108284, 21.8932, 0.510899, 1.202607, 0.0,
                                   1.687349, 0.0, 128210.178349],
                  'v6e/stored': [9.472213, 0.112302, 55.367607, 1.682596, 4.786892, 0.0, 0.0,
                                 0.0, 24513.166964],
                  'v6e/function': [9.679838, 0.0, 24.403062, 1.890838, 3.588358, 4.16249, 0.0,
                                   0.0, 0.0]},
 'chips': {'v5e': {'family': 'v5e',
                   'scale': {'function/full/2': 1.1411,
                             'function/full/4': 1.1411,
                             'function/narrow/2': 1.1411,
                             'stored/full/2': 1.1315,
                             'stored/full/4': 1.1315,
                             'stored/narrow/2': 1.1315}},
           'v6e': {'family': 'v6e',
                   'scale': {'function/full/2': 1.4046,
                             'function/full/4': 1.4046,
                             'function/narrow/2': 1.4046,
                             'stored/full/2': 1.4417,
                             'stored/full/4': 1.4417,
                             'stored/narrow/2': 1.4417}},
           'tpu7x': {'family': 'v6e',
                     'scale': {'function/full/2': 1.4046,
                               'function/full/4': 1.4046,
                               'stored/full/2': 1.4417,
                               'stored/full/4': 1.4417}},
           'v4': {'family': 'v6e',
                  'scale': {'function/full/2': 1.4046,
                            'function/full/4': 1.4046,
                            'stored/full/2': 1.4417,
                            'stored/full/4': 1.4417}},
           'v5p': {'family': 'v5e',
                   'scale': {'function/full/2': 1.1411,
                             'function/full/4': 1.1411,
                             'function/narrow/2': 1.1819,
                             'stored/full/2': 1.1315,
                             'stored/full/4': 1.1315,
                             'stored/narrow/2': 1.6086}}},
 'ranges': {'block_q': [128, 4096],
            'block_kv': [128, 2816],
            'block_kv_compute': [128, 512],
            'head_dim': [64, 128],
            'itemsize': [2, 4]}}


def libtpu_note(model: Mapping[str, Any] | None = None) -> str:
  """A note when the installed libtpu is not the model's; "" when it is or none is installed."""
  from importlib.metadata import PackageNotFoundError, version  # pylint: disable=import-outside-toplevel
  model = model or MODEL
  try:
    installed = version("libtpu")
  except PackageNotFoundError:
    return ""
  if model is None:
    return ""
  if installed == model["libtpu"]:
    return ""
  return (f"the VMEM model was fitted on libtpu {model['libtpu']}, this host has {installed}: "
          f"its allocations may differ (python -m maxdiffusion_svg bench vmem refits)")


def check_range(bq: int, bkv: int, bkc: int, head_dim: int, itemsize: int,
                model: Mapping[str, Any] | None = None) -> None:
  model = model or MODEL
  ranges = model["ranges"]
  given = {"block_q": bq, "block_kv": bkv, "block_kv_compute": bkc, "head_dim": head_dim}
  outside = [f"{'svg_' if name != 'head_dim' else ''}{name} {value} "
             f"(fitted {ranges[name][0]}-{ranges[name][1]})"
             for name, value in given.items()
             if not ranges[name][0] <= value <= ranges[name][1]]
  if itemsize not in ranges["itemsize"]:
    outside.append(f"{itemsize}-byte inputs (fitted {'/'.join(map(str, ranges['itemsize']))})")
  if outside:
    raise ValueError(
        f"the Splash VMEM model was not fitted for {', '.join(outside)}: it cannot vouch "
        f"for this kernel; pick tiles inside the range, or add cases to "
        f"maxdiffusion_svg/bench/vmem_points.py and run python -m maxdiffusion_svg "
        f"bench vmem")


def fitted_bytes(chip: str, strategy: str, bq: int, bkv: int, bkc: int, head_dim: int,
                 itemsize: int, model: Mapping[str, Any] | None = None) -> float:
  """Scoped-VMEM bytes of one kernel on a fitted ``chip``, above every fitted compile (v4 holds
  int8 mask blocks as 32-bit)."""
  model = model or MODEL
  if model is None:
    raise ValueError("no VMEM model: run python -m maxdiffusion_svg bench vmem")
  check_range(bq, bkv, bkc, head_dim, itemsize, model)
  if chip not in model["chips"]:
    raise ValueError(f"no VMEM model for TPU {chip}: run python -m maxdiffusion_svg "
                     f"bench vmem --chips {chip}")
  own = model["chips"][chip]
  scale = own["scale"].get(scale_group(strategy, head_dim, itemsize),
                          max(own["scale"].values()))
  return scale * _unscaled(chip, strategy, features(bq, bkv, bkc, head_dim, itemsize),
                                  model["coefficients"][f"{own['family']}/{strategy}"])
