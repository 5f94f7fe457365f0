"""libtpu's final schedule of small Splash kernels, read back: regions, bundles, static cycles."""

import os
import tempfile

import pytest

from maxdiffusion_svg.bench.schedule import ScheduleCase, format_schedule_bench, run_case
from maxdiffusion_svg.tpu_aot import libtpu_available
from maxdiffusion_svg.tpu_schedule import (ScheduleFormatError, parse_kernel,
                                           read_dump)

pytestmark = pytest.mark.skipif(not libtpu_available(),
                                reason="libtpu is not installed (pip install -e '.[test]')")

# 5x8x16 = 640 tokens in 256-token tiles: three q rows, the last one padded.
GRID = (5, 8, 16)


def small(mode: str, density: float = 0.35, block: int = 256) -> ScheduleCase:
  return ScheduleCase("v6e", GRID, density, mode, block, block, 128)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Each case compiled once, with the temporary dump folders counted before and after."""
  tmp = str(tmp_path_factory.mktemp("dumps"))
  saved, tempfile.tempdir = tempfile.tempdir, tmp
  try:
    out = {name: run_case(case, log=lambda _: None) for name, case in {
        "split": small("split"), "aligned": small("aligned"),
        "dense": small("aligned", density=1.0, block=128)}.items()}
  finally:
    tempfile.tempdir = saved
  out["left_behind"] = os.listdir(tmp)
  return out


def kernel_of(row) -> dict:
  assert row["ok"], row["error"]
  return row["kernel"]


def test_the_dump_folders_are_removed(runs):
  assert runs["left_behind"] == []


def test_tile_bodies_found_with_equal_matmul_work(runs):
  for name in ("split", "aligned"):
    kernel = kernel_of(runs[name])
    full, masked = kernel["full"], kernel["masked"]
    # Every tile does the same matmuls and exps (256x256 tiles, kv step 128: two steps).
    assert full["matmuls"] == masked["matmuls"] > 0 and full["exps"] == masked["exps"] > 0
    assert masked["bundles"] > full["bundles"] > 0  # masking costs issue slots
    assert kernel["row_init"]["bundles"] > 0 and kernel["row_final"]["bundles"] > 0
    assert kernel["step_overhead"] > 0
    parts = full["bundles"] + masked["bundles"] + kernel["row_init"]["bundles"] + \
        kernel["row_final"]["bundles"] + kernel["step_overhead"]
    assert parts < kernel["total_bundles"]  # the prologue and epilogue lie outside the loop
    for shares in kernel["body_use"].values():
      assert len(shares) == len(kernel["units"]) and all(0 <= s <= 1 for s in shares)
      assert max(shares) > 0.2
  # The mask function costs more than one stored block: the design's B2 vs B3 point.
  assert kernel_of(runs["split"])["masked"]["bundles"] > \
      kernel_of(runs["aligned"])["masked"]["bundles"]


def test_a_plan_without_masked_tiles_prices_only_full_bodies(runs):
  kernel = kernel_of(runs["dense"])
  assert runs["dense"]["tiles_masked"] == 0
  # Splash still emits its masked branch; with nothing to mask it is the full body again.
  assert kernel["masked"] is None or kernel["masked"]["bundles"] == kernel["full"]["bundles"]
  assert runs["dense"]["static_cycles"] == 5 * kernel["row_init"]["bundles"] + \
      5 * kernel["row_final"]["bundles"] + 25 * (kernel["full"]["bundles"] +
                                                 kernel["step_overhead"])


def test_static_cycles_price_the_plan(runs):
  row = runs["aligned"]
  kernel = kernel_of(row)
  plan = small("aligned").plan()
  expected = (plan.stats.full_tiles * kernel["full"]["bundles"] +
              plan.stats.masked_tiles * kernel["masked"]["bundles"] +
              plan.stats.visited_tiles * kernel["step_overhead"] +
              plan.num_q_tiles * (kernel["row_init"]["bundles"] + kernel["row_final"]["bundles"]))
  assert row["static_cycles"] == expected
  assert (row["tiles_full"], row["tiles_masked"]) == (plan.stats.full_tiles,
                                                      plan.stats.masked_tiles)


def test_the_table_shows_bodies_and_ratios(runs):
  result = {"libtpu": "x", "chip": "v6e", "resolution": "tiny", "grid": list(GRID),
            "tokens": 640, "density": 0.35, "tiles": [256, 256, 128],
            "modes": {"split": runs["split"], "aligned": runs["aligned"], "dense": runs["dense"]}}
  text = format_schedule_bench(result)
  assert "masked, mask function" in text and "masked, stored block" in text
  ratio = runs["aligned"]["static_cycles"] / runs["dense"]["static_cycles"]
  assert f"{ratio:.2f}" in text and "0.42" in text  # ours, and the design's aligned ratio


def test_a_case_that_does_not_compile_says_why_in_one_line():
  row = run_case(ScheduleCase("v5e", (21, 45, 80), 0.35, "aligned", 3328, 1536, 256),
                 log=lambda _: None)
  assert not row["ok"] and "VMEM" in row["error"] and "\n" not in row["error"]


def test_an_unknown_dump_layout_is_named(tmp_path):
  with pytest.raises(ScheduleFormatError, match="no bundles or no loop body"):
    parse_kernel("nothing here", "", paths=("a-final_bundles.txt", "b"))
  with pytest.raises(ScheduleFormatError, match="no \\*splash\\*-final_bundles.txt"):
    read_dump(str(tmp_path))
  listing = "  0x0   :  { %1 = sbr.rel (%p) target = $region2 }\n  0x1 LB: > { %2 = vmatmul.x }\n" \
            "  0x2 PF: > { %3 = sadd } /* Start/End empty region 2 */\n"
  with pytest.raises(ScheduleFormatError, match="b.txt: not a per-bundle utilisation table"):
    parse_kernel(listing, "garbage", paths=("a.txt", "b.txt"))
