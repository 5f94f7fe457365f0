"""libtpu's final schedule of small kernels (Splash, ours), read back: regions, bundles, static bundles."""

import glob
import os
import re
import tempfile

import pytest

from maxdiffusion_svg.bench.schedule import (ScheduleCase, compile_case, dump_name, run_case,
                                             static_bundles)
from maxdiffusion_svg.bench.schedule_format import DESIGN_MS, format_schedule_bench
from maxdiffusion_svg.tpu.aot import libtpu_available
from maxdiffusion_svg.tpu.bundles import ScheduleFormatError, parse_kernel, read_dump

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
  assert runs["dense"]["static_bundles"] == 5 * kernel["row_init"]["bundles"] + \
      5 * kernel["row_final"]["bundles"] + 25 * (kernel["full"]["bundles"] +
                                                 kernel["step_overhead"])


def test_static_bundles_price_the_plan(runs):
  row = runs["aligned"]
  kernel = kernel_of(row)
  plan = small("aligned").plan()
  expected = (plan.stats.full_tiles * kernel["full"]["bundles"] +
              plan.stats.masked_tiles * kernel["masked"]["bundles"] +
              plan.stats.visited_tiles * kernel["step_overhead"] +
              plan.num_q_tiles * (kernel["row_init"]["bundles"] + kernel["row_final"]["bundles"]))
  assert row["static_bundles"] == expected
  assert (row["tiles_full"], row["tiles_masked"]) == (plan.stats.full_tiles,
                                                      plan.stats.masked_tiles)


def test_the_table_shows_bodies_and_ratios(runs):
  result = {"libtpu": "x", "chip": "v6e", "resolution": "tiny", "grid": list(GRID),
            "tokens": 640, "density": 0.35, "tiles": [256, 256, 128],
            "modes": {"split": runs["split"], "aligned": runs["aligned"], "dense": runs["dense"]}}
  text = format_schedule_bench(result)
  assert "masked, mask function" in text and "masked, stored block" in text
  ratio = runs["aligned"]["static_bundles"] / runs["dense"]["static_bundles"]
  (line,) = [l for l in text.splitlines() if l.split() and l.split()[0] == "aligned"]
  # Ours, and the design's aligned ratio from its quoted latencies, on the aligned row.
  assert f"{ratio:.2f}" in line
  assert f"{DESIGN_MS['aligned'] / DESIGN_MS['dense']:.2f}" in line


# ---------------------------------------- the static total, counted another way
# 5x8x15 = 600 tokens in 128-token tiles at density 1: five q rows of five kv tiles, the last
# holding 40 padding keys. By hand: each row runs tiles 0-3 unmasked and tile 4 masked,
# initialises its row at tile 0 and finalises it at tile 4.
HAND_GRID = (5, 8, 15)
HAND_STEPS = [{"step", "full", "init"}, {"step", "full"}, {"step", "full"}, {"step", "full"},
              {"step", "masked", "final"}] * 5
# The loop's forward branches in program order, each skipping its region unless the step runs it:
# the grid step itself (Splash's pipeline runs extra steps that only move data), the row's
# initialisation, the mask-free body, the masked body, the row's finalisation.
ROLES = ("step", "init", "full", "masked", "final")
_BUNDLE = re.compile(r"^\s*0x([0-9a-f]+)\s+(LH|LB|LE|PB|PF)?\s*:")
_BRANCH = re.compile(r"sbr\.rel\s*(?:\([^)]*\))?\s*target = \$region(\d+)")


def _bundle_lines(listing: str) -> list[str]:
  """One string per bundle: an instruction continued on the next line joins its bundle."""
  out = []
  for line in listing.splitlines():
    if _BUNDLE.match(line):
      out.append(line)
    elif out:
      out[-1] += line
  return out


def walk_listing(listing: str, steps, roles=ROLES) -> tuple[int, list[tuple[int, int]]]:
  """Bundles the loop issues over ``steps``, walked bundle by bundle through the raw listing:
  a forward branch skips to its region's fallthrough on a step that does not run its role; a
  step ends with the back edge and its delay slots. Nothing of maxdiffusion_svg's parser."""
  bundles = [(_BUNDLE.match(line).group(2) or "", line) for line in _bundle_lines(listing)]
  start = next(i for i, (label, _) in enumerate(bundles) if label == "LB")
  fallthrough = {region: i for i, (label, text) in enumerate(bundles) if label == "PF"
                 for region in re.findall(r"Start/End empty region (\d+)", text)}
  branches, back = [], None
  for i in range(start, len(bundles)):
    for target in _BRANCH.findall(bundles[i][1]):
      if fallthrough.get(target, -1) > i:
        branches.append((i, fallthrough[target]))
      else:
        back = i
    if back is not None:
      break
  end = back
  while (end + 1 < len(bundles) and bundles[end + 1][0] != "PF"
         and "exit bundle" not in bundles[end + 1][1]):
    end += 1  # the back edge's delay slots (the kernel's exit bundle runs once, after the loop)
  assert len(branches) == len(roles), branches
  total = 0
  for runs in steps:
    i = start
    while i <= end:
      total += 1
      skip = [f for (b, f), role in zip(branches, roles) if b == i and role not in runs]
      i = skip[0] if skip else i + 1
  return total, branches


@pytest.fixture(scope="module")
def hand_case(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("hand_dump"))
  case = ScheduleCase("v6e", HAND_GRID, 1.0, "aligned", 128, 128, 128)
  assert compile_case(case, directory)["ok"]
  (path,) = [p for p in glob.glob(os.path.join(directory, "*splash*-final_bundles.txt"))
             if "schedule-analysis" not in p]
  with open(path, encoding="utf-8") as f:
    return case, directory, f.read()


def test_the_static_total_equals_the_listing_walked_over_the_hand_counted_steps(hand_case):
  case, directory, listing = hand_case
  plan = case.plan()
  assert (plan.stats.full_tiles, plan.stats.masked_tiles, plan.num_q_tiles) == (20, 5, 5)
  walked, branches = walk_listing(listing, HAND_STEPS)
  kernel = read_dump(directory)[-1]
  assert static_bundles(kernel, 20, 5, 5) == walked
  # The roles by content: the bodies push to the MXU, the row's start and end do not.
  pushes = [sum("vmatmul" in line or "vmatpush" in line
                for line in _bundle_lines(listing)[b + 1:f]) for b, f in branches]
  assert pushes[2] == pushes[3] > 0 and pushes[1] == pushes[4] == 0, pushes


def test_the_walk_tells_the_tile_kinds_apart(hand_case):
  """The independent count is not blind to what the plan says: one masked tile priced as full
  changes it by the two bodies' difference."""
  _, directory, listing = hand_case
  kernel = read_dump(directory)[-1]
  swapped = [{"step", "full", "init"}, *HAND_STEPS[1:4], {"step", "full", "final"},
             *HAND_STEPS[5:]]
  difference = walk_listing(listing, HAND_STEPS)[0] - walk_listing(listing, swapped)[0]
  assert difference == kernel.masked.bundles - kernel.full.bundles != 0


# Our kernel's loop: the grid step, the row's opening, the fixed-offset mask-free body, the
# online one's lazy pass and, inside it, its commit, the online body that rescales, the masked
# body, the row's closing, and (its blocks ragged: 600 tokens in 128-token tiles) the output's
# write-back as the row closes.
OUR_ROLES = ("step", "init", "full", "online", "commit", "online_rescaled", "masked", "final",
             "write")


@pytest.mark.parametrize("path", ["full", "online",
                                  pytest.param("online_rerun", marks=pytest.mark.full)])
def test_our_kernels_static_total_equals_its_listing_walked(tmp_path, path):
  """The same hand count for our kernel, for a head on the fixed offset and one on online
  softmax: each row's tiles 0-3 run that mask-free body, tile 4 the masked one. On online
  softmax a row's first tile rescales and the next run the lazy pass, which commits; where its
  maximum jumped past the headroom (``online_rerun``) a tile runs the lazy pass, no commit,
  then the rescaling body."""
  case = ScheduleCase("v6e", HAND_GRID, 1.0, "aligned", 128, 128, 128, backend="pallas")
  assert compile_case(case, str(tmp_path))["ok"]
  (listing_path,) = [p for p in glob.glob(str(tmp_path / "*svg_pallas*-final_bundles.txt"))
                     if "schedule-analysis" not in p]
  with open(listing_path, encoding="utf-8") as f:
    listing = f.read()
  later = {"full": {"full"}, "online": {"online", "commit"},
           "online_rerun": {"online", "online_rescaled"}}[path]
  first = {"full"} if path == "full" else {"online_rescaled"}
  steps = [{"step", "init", *first}, *[{"step", *later}] * 3,
           {"step", "masked", "final", "write"}] * 5
  walked, branches = walk_listing(listing, steps, OUR_ROLES)
  kernel = read_dump(str(tmp_path), *dump_name(case))[-1]
  if path == "online_rerun":  # not what a call is priced at: each rerun adds a lazy pass
    commit = branches[4][1] - branches[4][0] - 1
    rerun = walked - static_bundles(kernel, 20, 5, 5, body="online_rescaled")
    assert rerun == 15 * (kernel.online.bundles - commit) and commit > 0
  else:
    assert static_bundles(kernel, 20, 5, 5, body=path) == walked
  pushes = [sum("vmatmul" in line for line in _bundle_lines(listing)[b + 1:f]) for b, f in branches]
  assert (pushes[2] == pushes[3] == pushes[5] == pushes[6] > 0
          and pushes[1] == pushes[4] == pushes[7] == 0), pushes
  assert kernel.online_rescaled.bundles > kernel.online.bundles  # the lazy pass saves the rescale


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


def test_tiles_our_kernel_rolls_are_refused_not_mispriced():
  """The reader counts a region once; a rolled kv-step loop runs once per step: no figure."""
  from maxdiffusion_svg.bench.schedule import ScheduleCase, run_case  # pylint: disable=import-outside-toplevel
  logged = []
  row = run_case(ScheduleCase("v6e", (21, 45, 80), 0.35, "aligned", 3328, 1536, 512,
                              backend="pallas"), log=logged.append)
  assert not row["ok"] and "walk their kv steps in a loop" in row["error"]
  assert "static_bundles" not in row and logged == [logged[0]] and "bench chip" in logged[0]
