"""``bench router`` on a small grid: each routed head's loss is one of its single layouts' (heads
are independent), today's router's one of the two static ones, and the targets' arithmetic."""

import numpy as np
import pytest

from maxdiffusion_svg.bench.router_families import (BEST_DB, SVG1_KINDS, RouterFamiliesConfig,
                                                    family_qkv, format_router_families,
                                                    run_router_families)
from maxdiffusion_svg.cli import main as cli
from maxdiffusion_svg.plan.geometry import VideoGrid

CFG = RouterFamiliesConfig(grid=VideoGrid(6, 8, 16), densities=(0.3,), block_q=128, block_kv=128,
                           clusters=4, scenes=("few", "fast"))


def test_routed_heads_end_at_one_of_their_single_layouts():
  result = run_router_families(CFG, log=lambda _: None)
  (q, _, _), names = family_qkv(CFG)
  assert names[:4] == ["few", "soft_few", "fast", "soft_fast"] and names[4:] == list(SVG1_KINDS)
  assert q.shape == (1, len(names), CFG.grid.tokens, 64)
  row = result["rows"]["0.3"]
  for loss in (row["router 3 layouts"], row["router SVG1"]):
    assert len(loss) == len(names) and min(loss) > -1e-3  # the best single layout is a floor
  single = np.array([row["single"][name] for name in ("spatial", "temporal", "semantic")])
  for h in range(len(names)):  # each head runs one layout, whatever the others run
    assert np.abs(single[:, h] - row["router 3 layouts"][h]).min() < 0.01
    assert np.abs(single[:2, h] - row["router SVG1"][h]).min() < 0.01
  best_is_static = [b != "semantic" for b in row["best_layout"]]
  t = result["targets"]
  assert t["worst_from_best_db"] == pytest.approx(max(row["router 3 layouts"]))
  assert t["best_met"] == (t["worst_from_best_db"] <= BEST_DB)
  svg1 = [i for i, n in enumerate(names) if n in SVG1_KINDS]
  assert t["worst_svg1_kinds_from_today_db"] == pytest.approx(
      max(row["router 3 layouts"][i] - row["router SVG1"][i] for i in svg1))
  assert any(best_is_static) and not all(best_is_static)
  text = format_router_families(result)
  assert text.splitlines()[-1].startswith("three-layout router: worst")
  assert np.isfinite(row["router SVG1"]).all()


def test_bad_density_is_refused(capsys):
  assert cli.main(["bench", "router", "--densities", "0"]) == 2
  assert "--densities: must be a number in (0, 1]" in capsys.readouterr().err
