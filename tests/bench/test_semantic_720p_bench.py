"""``bench semantic-720p`` on a small grid: its forced layouts against independent masked-softmax
references, its target arithmetic, its table and its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.bench.quality import psnr
from maxdiffusion_svg.bench.semantic_720p import (KINDS, Semantic720pConfig, format_semantic_720p,
                                                  moving_qkv, run_semantic_720p)
from maxdiffusion_svg.cli import main as cli
from maxdiffusion_svg.kernels import dense_attention, plan_reference
from maxdiffusion_svg.plan.geometry import VideoGrid, to_frame_major, to_temporal_major

from references import compensated_reference  # the float64 rule

GRID = VideoGrid(6, 8, 16)  # 768 tokens
CFG = Semantic720pConfig(grid=GRID, densities=(0.3,), groups=(1, 2), heads=1, head_dim=32,
                         clusters=4, block_q=128, block_kv=128, routers=True,
                         compensation=True, compensation_blocks=4)


@pytest.fixture(scope="module")
def result():
  return run_semantic_720p(CFG, log=lambda _: None)


def test_forced_layouts_match_masked_softmax_references(result):
  (q, k, v), kinds = moving_qkv(GRID, CFG.heads, CFG.head_dim, CFG.seed)
  assert kinds == list(KINDS)
  plan = CFG.svg_config(0.3).plan(GRID, backend="xla")
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    dense = np.asarray(dense_attention(q, k, v))
    spatial = np.asarray(plan_reference(q, k, v, plan))
    temporal = np.asarray(to_frame_major(plan_reference(
        *(to_temporal_major(x, GRID) for x in (q, k, v)), plan), GRID))
    comp_spatial = compensated_reference(q, k, v, plan, CFG.compensation_blocks)
    comp_temporal = np.asarray(to_frame_major(jnp.asarray(compensated_reference(
        *(to_temporal_major(x, GRID) for x in (q, k, v)), plan, CFG.compensation_blocks)), GRID))
  row = result["rows"]["0.3"]
  for name, out in (("spatial", spatial), ("temporal", temporal),
                    ("spatial +comp", comp_spatial), ("temporal +comp", comp_temporal)):
    for h, kind in enumerate(kinds):
      assert row[name][kind] == pytest.approx(psnr(out[:, h], dense[:, h]), abs=0.05)
  assert row["visited_tile_fraction"] == pytest.approx(plan.stats.visited_tile_fraction)


def test_every_layout_and_router_is_reported_and_the_target_is_the_default_groups(result):
  row = result["rows"]["0.3"]
  assert set(row) == {"visited_tile_fraction", "spatial", "temporal", "semantic g1",
                      "semantic g2", "router SVG1", "router 3 layouts", "spatial +comp",
                      "temporal +comp", "semantic g1 +comp", "router SVG1 +comp",
                      "router 3 layouts +comp"}
  for cell in (v for v in row.values() if isinstance(v, dict)):
    assert set(cell) == set(KINDS) and all(np.isfinite(x) for x in cell.values())
  # today's router takes, per head, one of the two layouts it chooses between
  for kind in KINDS:
    assert row["router SVG1"][kind] <= max(row["spatial"][kind], row["temporal"][kind]) + 1e-6
  default = result["default_group"]
  assert default == 1  # a grid this small moves single tokens
  gains = result["targets"]["semantic_gain_db"]
  for kind in KINDS:
    want = row[f"semantic g{default}"][kind] - max(row["spatial"][kind], row["temporal"][kind])
    assert gains[f"{kind} 0.3"] == pytest.approx(want)
  assert result["targets"]["met"] == (min(gains.values()) >= 1.0)
  comp = result["targets"]["compensation_gain_db"]
  for kind in KINDS:
    best = lambda suffix: max(row["spatial" + suffix][kind], row["temporal" + suffix][kind])
    assert comp[f"{kind} 0.3"] == pytest.approx(best(" +comp") - best(""))
  assert result["targets"]["compensation_met"] == (min(comp.values()) >= 1.0)
  text = format_semantic_720p(result)
  assert "semantic g2" in text
  semantic_line, comp_line = text.splitlines()[-2:]
  assert semantic_line.endswith("met)" if result["targets"]["met"] else "missed)")
  assert comp_line.startswith("compensation")


def test_groups_that_do_not_divide_the_frame_width_are_refused(capsys):
  with pytest.raises(ValueError, match="--groups: each must divide the frame's width"):
    Semantic720pConfig(grid=GRID, groups=(3,))
  assert cli.main(["bench", "semantic-720p", "--densities", "1.5"]) == 2
  assert "--densities: must be a number in (0, 1]" in capsys.readouterr().err
