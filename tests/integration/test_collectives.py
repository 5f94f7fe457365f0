"""svg moves no more between devices than MaxDiffusion's ulysses (compiled HLO, 8 devices)."""

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.bench.wan_collectives import measure


def test_svg_moves_no_more_than_ulysses():
  kernels = measure(log=lambda _: None)["kernels"]
  svg, ulysses, dense = kernels["svg"], kernels["ulysses"], kernels["dot_product"]
  assert svg["bytes"] <= ulysses["bytes"]
  # Self-attention adds exactly the head exchange (q, k, v in, output back); no K/V gather.
  assert svg["collectives"]["all-to-all"]["count"] == dense["collectives"]["all-to-all"]["count"] + 4
  assert svg["collectives"]["all-gather"]["bytes"] < dense["collectives"]["all-gather"]["bytes"] / 4
