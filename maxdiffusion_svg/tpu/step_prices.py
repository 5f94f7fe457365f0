"""What a whole denoising step costs by libtpu's static schedule of the compiled forward.

``python -m maxdiffusion_svg bench step`` compiles a Wan or LTX-2 forward for a slice with ``svg``
and with the dense baseline (Wan: MaxDiffusion's ``ulysses_custom_fixed_m``; LTX-2: its default
``flash``) and prices every computation of both programs (docs/measurements/step_*.json).
STEP_PRICES keeps, per family, chip, video and mesh, the XLA around the attention kernels: a
step's program outside the layers, and one layer's besides self-attention and its self-attention
around the kernel (svg's sparse and dense branches, the baseline's). Our kernel and fixed-m's
come from their plans (:mod:`maxdiffusion_svg.tpu.prices`), so ``tiles --config`` prices a step
at any density, schedule or per-layer budget of a priced video; LTX-2's flash is priced from its
schedule in the compiled program, inside the baseline's self-attention. Counts of issue slots,
not times: a collective's transfer and a memory stall are not bundles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxdiffusion_svg.tpu.prices import LIBTPU


@dataclasses.dataclass(frozen=True)
class StepPrices:
  """Bundles per device of one step's XLA (the self-attention kernels' not included, but for a
  baseline kernel priced in its program; MaxDiffusion's flash, where cross-attention runs it,
  is in ``layer_rest``)."""

  outside: int  # svg's program outside the scanned layers, once per step
  layer_rest: int  # one layer besides self-attention: cross-attention, projections, MLP, norms
  sparse_attention: int  # svg's self-attention around its kernel in a sparse layer
  dense_attention: int  # ... in a dense layer (the schedule's cond, its other branch)
  baseline_outside: int
  baseline_layer_rest: int
  baseline_attention: int  # the baseline's self-attention around its kernel
  source: str  # the measurement it comes from
  # The baseline's kernel is in baseline_attention (LTX-2's flash, from its compiled schedule);
  # False: fixed-m's, priced from its plan per call.
  baseline_kernel_in_program: bool = False

  def step(self, layers: int, sparse_layers: int, sparse_call: float, dense_call: float,
           launches: int) -> float:
    """svg's step: ``sparse_layers`` of ``layers`` sparse; ``*_call``: one head's kernel call
    (:class:`~maxdiffusion_svg.tpu.prices.KernelPrices`), ``launches`` (heads x batch) a layer."""
    dense_layers = layers - sparse_layers
    return (self.outside + layers * self.layer_rest
            + sparse_layers * (self.sparse_attention + launches * sparse_call)
            + dense_layers * (self.dense_attention + launches * dense_call))

  def baseline_step(self, layers: int, fixed_m_call: float, launches: int) -> float:
    """The baseline's step; ``fixed_m_call``: one head's fixed-m call, unless its kernel is in
    its program (then unused)."""
    kernel = 0.0 if self.baseline_kernel_in_program else launches * fixed_m_call
    return self.baseline_outside + layers * (self.baseline_layer_rest + self.baseline_attention
                                             + kernel)


def prices_from_step(result: dict[str, Any], source: str = "") -> StepPrices:
  """StepPrices from a ``bench step --json`` result."""
  svg, base = result["programs"]["svg"], result["programs"]["baseline"]
  attention = "self-attention"
  rest = lambda layer: round(sum(v for k, v in layer.items() if k != attention))
  sparse, dense = svg["layer"]["1"], svg["layer"]["0"]
  # On a ring the branches issue different collectives (the sparse one's window fetch): the
  # difference goes with the sparse branch's attention; anything larger is a misclassing.
  extra = rest(sparse) - rest(dense)
  if abs(extra) > 0.01 * rest(dense):
    raise ValueError("svg's branches differ outside self-attention")
  # the ring fixed-m's cond: its every-head-fixed branch, 1; else the one layer
  layer = base["layer"]["1"] if "1" in base["layer"] else next(iter(base["layer"].values()))
  return StepPrices(outside=round(sum(svg["outside"].values())), layer_rest=rest(dense),
                    sparse_attention=round(sparse[attention]) + extra,
                    dense_attention=round(dense[attention]),
                    baseline_outside=round(sum(base["outside"].values())),
                    baseline_layer_rest=rest(layer), baseline_attention=round(layer[attention]),
                    source=source,  # flash running self-attention is the baseline's kernel
                    baseline_kernel_in_program=bool(base.get("flash_layer", {}).get(attention)))


# (family, chip, tokens, heads, heads per device, batch per device, ring): from
# docs/measurements/step_*.json (libtpu LIBTPU; tests/tpu/test_schedule_costs.py rebuilds them).
StepKey = tuple[str, str, int, int, int, int, int]
STEP_PRICES: dict[StepKey, StepPrices] = {
    ("Wan", "v6e", 75_600, 40, 5, 2, 1): StepPrices(
        2_176_183, 19_505_787, 6_890_867, 3_919_678, 2_118_211, 19_393_584, 2_678_236,
        "docs/measurements/step_wan_svg_v6e8_720p.json"),
    ("Wan", "v5e", 75_600, 40, 5, 2, 1): StepPrices(  # the 14B at 720p on a v5e-8
        2_902_077, 48_315_312, 8_449_306, 4_653_930, 2_907_537, 47_753_685, 3_750_726,
        "docs/measurements/step_wan_svg_v5e8_720p.json"),
    ("Wan", "v6e", 32_760, 12, 3, 1, 1): StepPrices(  # Wan 2.1 1.3B, 480p, 2-way data x 4-way context
        667_655, 3_193_772, 1_495_537, 918_439, 662_647, 3_059_968, 633_213,
        "docs/measurements/step_wan_svg_1_3b_v6e8_480p.json"),
    # Wan 2.1 14B, 1440p, one video on 32 chips: 2-way data x 16-way context as 8 Ulysses x a
    # ring of 2, against ulysses_ring_custom_fixed_m; kernels per device (tpu.prices.ring_kernel_prices)
    ("Wan", "v6e", 302_400, 40, 5, 1, 2): StepPrices(
        42_404_852, 36_108_974, 15_175_224, 12_068_155, 42_386_287, 35_269_056, 2_422_907,
        "docs/measurements/step_wan_svg_v6e32_1440p.json"),
    # LTX-2 19B against its default flash (its kernel in baseline_attention), 8-way context
    ("LTX-2", "v6e", 14_080, 32, 4, 2, 1): StepPrices(
        1_266_945, 5_014_015, 1_533_516, 971_768, 1_263_167, 5_090_723, 7_234_164,
        "docs/measurements/step_ltx2_svg_v6e8_1280x704.json", baseline_kernel_in_program=True),
    ("LTX-2", "v6e", 32_640, 32, 4, 2, 1): StepPrices(
        2_450_416, 10_340_480, 2_492_508, 1_453_424, 2_440_425, 10_407_733, 29_400_537,
        "docs/measurements/step_ltx2_svg_v6e8_1920x1088.json", baseline_kernel_in_program=True),
}


def slice_key(family: str, chip: str, tokens: int, heads: int, mesh: dict[str, Any]) -> StepKey:
  """The key of a family's video on a slice: ``mesh`` as the slice's checks give it (heads per
  device, the mesh's axes, the ring); the CFG pair splits over the data axis (0: it does not
  divide)."""
  data = mesh["mesh"].get("data", 1)
  return (family, chip, tokens, heads, mesh["heads_per_device"],
          2 // data if 2 % data == 0 else 0, mesh["ring"])


def step_key(result: dict[str, Any]) -> StepKey:
  """A ``bench step`` result's key in STEP_PRICES."""
  return (result.get("family", "Wan"), result["chip"], result["tokens"], result["heads"],
          result["heads_per_device"], result["batch"], result["ring"])


def step_prices(key: StepKey) -> StepPrices | None:
  """The compiled figures for a T2V step, if any: ``key`` as STEP_PRICES'."""
  return STEP_PRICES.get(key)
