"""What a whole denoising step costs by libtpu's static schedule of the compiled forward.

``python -m maxdiffusion_svg bench step`` compiles a Wan forward for a slice with ``svg`` and with
MaxDiffusion's ``ulysses_custom_fixed_m`` and prices every computation of both programs
(docs/measurements/step_*.json). STEP_PRICES keeps, per chip, video and mesh, the XLA around the
attention kernels: a step's program outside the layers, and one layer's besides self-attention
and its self-attention around the kernel (svg's sparse and dense branches, the baseline's). The
kernels come from their plans (:mod:`maxdiffusion_svg.tpu.prices`), so ``tiles --config`` prices
a step at any density, schedule or per-layer budget of a priced video. Counts of issue slots, not
times: a collective's transfer and a memory stall are not bundles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxdiffusion_svg.tpu.prices import LIBTPU


@dataclasses.dataclass(frozen=True)
class StepPrices:
  """Bundles per device of one Wan step's XLA (the self-attention kernels' not included;
  MaxDiffusion's flash, where cross-attention runs it, is in ``layer_rest``)."""

  outside: int  # svg's program outside the scanned layers, once per step
  layer_rest: int  # one layer besides self-attention: cross-attention, projections, MLP, norms
  sparse_attention: int  # svg's self-attention around its kernel in a sparse layer
  dense_attention: int  # ... in a dense layer (the schedule's cond, its other branch)
  baseline_outside: int
  baseline_layer_rest: int
  baseline_attention: int  # ulysses_custom_fixed_m's self-attention around its kernel
  source: str  # the measurement it comes from

  def step(self, layers: int, sparse_layers: int, sparse_call: float, dense_call: float,
           launches: int) -> float:
    """svg's step: ``sparse_layers`` of ``layers`` sparse; ``*_call``: one head's kernel call
    (:class:`~maxdiffusion_svg.tpu.prices.KernelPrices`), ``launches`` (heads x batch) a layer."""
    dense_layers = layers - sparse_layers
    return (self.outside + layers * self.layer_rest
            + sparse_layers * (self.sparse_attention + launches * sparse_call)
            + dense_layers * (self.dense_attention + launches * dense_call))

  def baseline_step(self, layers: int, fixed_m_call: float, launches: int) -> float:
    return self.baseline_outside + layers * (self.baseline_layer_rest + self.baseline_attention
                                             + launches * fixed_m_call)


def prices_from_step(result: dict[str, Any], source: str = "") -> StepPrices:
  """StepPrices from a ``bench step --json`` result."""
  svg, base = result["programs"]["svg"], result["programs"]["baseline"]
  attention = "self-attention"
  rest = lambda layer: round(sum(v for k, v in layer.items() if k != attention))
  sparse, dense = svg["layer"]["1"], svg["layer"]["0"]
  if rest(sparse) != rest(dense):
    raise ValueError("svg's branches differ outside self-attention")
  (layer,) = base["layer"].values()
  return StepPrices(outside=round(sum(svg["outside"].values())), layer_rest=rest(sparse),
                    sparse_attention=round(sparse[attention]),
                    dense_attention=round(dense[attention]),
                    baseline_outside=round(sum(base["outside"].values())),
                    baseline_layer_rest=rest(layer), baseline_attention=round(layer[attention]),
                    source=source)


# (chip, tokens, heads, heads per device, batch per device, ring): from
# docs/measurements/step_*.json (libtpu LIBTPU; tests/tpu/test_schedule_costs.py rebuilds them).
StepKey = tuple[str, int, int, int, int, int]
STEP_PRICES: dict[StepKey, StepPrices] = {
    ("v6e", 75_600, 40, 5, 2, 1): StepPrices(
        2_176_183, 19_505_787, 6_890_867, 3_919_678, 2_118_211, 19_393_584, 2_678_236,
        "docs/measurements/step_wan_svg_v6e8_720p.json"),
    ("v6e", 32_760, 12, 3, 1, 1): StepPrices(  # Wan 2.1 1.3B, 480p, 2-way data x 4-way context
        667_655, 3_193_772, 1_495_537, 918_439, 662_647, 3_059_968, 633_213,
        "docs/measurements/step_wan_svg_1_3b_v6e8_480p.json"),
}


def slice_key(chip: str, tokens: int, heads: int, mesh: dict[str, Any]) -> StepKey:
  """The key of a video on a slice: ``mesh`` as the slice's checks give it (heads per device,
  the mesh's axes, the ring); the CFG pair splits over the data axis (0: it does not divide)."""
  data = mesh["mesh"].get("data", 1)
  return (chip, tokens, heads, mesh["heads_per_device"], 2 // data if 2 % data == 0 else 0,
          mesh["ring"])


def step_key(result: dict[str, Any]) -> StepKey:
  """A ``bench step`` result's key in STEP_PRICES."""
  return (result["chip"], result["tokens"], result["heads"], result["heads_per_device"],
          result["batch"], result["ring"])


def step_prices(key: StepKey) -> StepPrices | None:
  """The compiled figures for a Wan T2V step, if any: ``key`` as STEP_PRICES'."""
  return STEP_PRICES.get(key)
