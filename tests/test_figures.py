"""Every figure of the README's "What to expect" and docs/expect.md is what the command its row
names prints: each command's own printer run on the measurement it stored (docs/measurements;
timed on a chip, compiled, measured on CPU), its figures compared with the text's, in order.
``tiles CONFIG`` rows need MaxDiffusion's base configs: tests/integration/test_figures_tiles.py.
"""

from __future__ import annotations

import re

import pytest

from figures import figures, mismatches, printed, row_of, section, stored, table
from maxdiffusion_svg.bench.calibration import format_calibration_bench
from maxdiffusion_svg.bench.chip import format_chip_bench
from maxdiffusion_svg.bench.ltx2_aot import format_ltx2_forwards
from maxdiffusion_svg.bench.ltx2_schedule import format_static_schedule_bounds
from maxdiffusion_svg.bench.step import format_step
from maxdiffusion_svg.bench.step_chip import format_step_chip
from maxdiffusion_svg.bench.wan_aot import format_wan_forwards

README = section("README.md", "## What to expect")
EXPECT = section("docs/expect.md", "## Every figure, with its baseline and kind")


# ---------------------------------------------------------------- bench chip: one call, timed


def chip_calls(name: str) -> dict[tuple[str, ...], tuple[str, str, str]]:
  """``bench chip``'s printed rows of a stored run: (case, kernel, tiles, mode, density, heads)
  -> (ms, / fixed-m, of floor), as printed."""
  out: dict[tuple[str, ...], tuple[str, str, str]] = {}
  case = ""
  for line in format_chip_bench(stored(name)).splitlines():
    if re.match(r"\w", line) and ":" in line:
      case = line.split(":")[0]
    fields = line.split()
    if len(fields) >= 5 and re.fullmatch(r"[\d.]+", fields[-1]) and fields[0] != "kernel":
      *key, ms, ratio, floor = fields
      out[(case, *key)] = (ms, ratio, floor)
  return out


def chip_call_rows() -> dict[str, list[str]]:
  """The README's call table, row by row, from ``bench chip``'s printout."""
  cases = chip_calls("chip_v5e_cases")
  svg = lambda case, density, heads="fixed", tiles="2048x3072/512": cases[
      (case, "svg", tiles, "aligned", density, heads)]
  fixed_m = lambda case: cases[(case, "fixed_m", "2048x2048/1024")][0]
  wan = "wan14b_720p"
  by_col = lambda *rows: [r[i] for i in range(3) for r in rows]  # ms of each, then ratios, ...
  small = [svg("wan1.3b_480p", "1.0"), svg("ltx2_1280x704", "1.0"),
           svg("wan1.3b_480p", "0.35"), svg("ltx2_1280x704", "0.35")]
  earlier = [chip_calls("chip_v5e_720p")[(wan, "svg", "2048x1536/512", "aligned", "1.0", "fixed")],
             chip_calls("chip_v5e_tile_sweep")[(wan, "svg", "3328x1536/512", "aligned", "1.0",
                                                 "fixed")]]
  return {
      "density 1 (svg's dense steps)": [*svg(wan, "1.0")],
      "aligned, band density 0.35": [*svg(wan, "0.35")],
      "aligned, 0.2 (`aggressive`) / 0.15": by_col(svg(wan, "0.2"), svg(wan, "0.15")),
      "heads on online softmax: density 1 / 0.35": by_col(svg(wan, "1.0", "online"),
                                                         svg(wan, "0.35", "online")),
      "Wan 1.3B 480p (3 heads x 32,760) / LTX-2 1280x704 (2 x 4 heads x 14,080): density 1; 0.35":
          by_col(*small) + [fixed_m("wan1.3b_480p"), fixed_m("ltx2_1280x704")],
      "the previous defaults at density 1: 2048x1536/512; 3328x1536/512": by_col(*earlier),
  }


def check_chip_calls(text: str) -> list[str]:
  calls = table(text, "our call on one v5e chip")
  problems = [f"{label}: {m}" for label, want in chip_call_rows().items()
              for m in mismatches(figures(" | ".join(calls.row(label)[1:])), want)]
  fixed_m = chip_calls("chip_v5e_cases")[("wan14b_720p", "fixed_m", "2048x2048/1024")][0]
  said = re.search(r"with 64 MiB of VMEM, ([\d.]+) ms", text)
  return problems + [f"fixed-m: {m}" for m in mismatches([said.group(1)], [fixed_m])]


def test_the_call_table_is_what_bench_chip_printed():
  assert check_chip_calls(README) == []


# ----------------------------------------------------- bench step --on-chip: a step, timed


def chip_steps(name: str = "chip_v5e_step_wan1.3b") -> dict[str, dict[str, float]]:
  """``bench step --on-chip``'s printout of a stored run, per case: the baseline's step (s),
  `flash`'s, each preset's sparse and dense step (s), run (s) and speed-ups, the steps, and
  the traced step's untouched part (s) and ours outside the kernel (share)."""
  out: dict[str, dict[str, float]] = {}
  for line in format_step_chip(stored(name)).splitlines():
    if m := re.match(r"(wan\S+?)(,.*)?:$", line):
      case = out.setdefault(m.group(1), {})
    elif m := re.match(r"\s+ulysses_custom_fixed_m\s+step\s+([\d.]+) ms", line):
      case["base"] = float(m.group(1)) / 1e3
    elif m := re.match(r"\s+flash\s+step\s+([\d.]+) ms", line):
      case["flash"] = float(m.group(1)) / 1e3
    elif m := re.match(r"\s+projections, MLP, norms and the rest\s+([\d.]+) s", line):
      case["untouched"] = float(m.group(1))
    elif m := re.match(r"\s+ours outside the kernel: [\d.]+ s, ([\d.]+)% of the step", line):
      case["ours %"] = float(m.group(1))
    elif m := re.match(r"\s+svg (\w+)\s+sparse step\s+([\d.]+) ms, dense step ([\d.]+) ms, run "
                       r"([\d.]+) s \((\d+) of (\d+) steps", line):
      preset = m.group(1)
      case[f"{preset} sparse"], case[f"{preset} dense"] = (float(m.group(i)) / 1e3 for i in (2, 3))
      case[f"{preset} run"], case["steps"] = float(m.group(4)), float(m.group(6))
    elif m := re.match(r"\s+vs ulysses_custom_fixed_m: step ([\d.]+)x, run ([\d.]+)x", line):
      case[f"{preset} step x"], case[f"{preset} run x"] = float(m.group(1)), float(m.group(2))
  return out


def check_chip_steps(text: str) -> list[str]:
  """The timed step table and the dense steps' ratio under it. The baseline's run is its step
  times the steps (the command prints the step and the steps)."""
  steps = chip_steps()
  hd, sd = steps["wan1.3b_720p"], steps["wan1.3b_480p"]
  rows = {"`ulysses_custom_fixed_m` (MaxDiffusion's fastest dense)":
              [hd["base"], hd["base"] * hd["steps"], sd["base"], sd["base"] * sd["steps"]]}
  for preset in ("moderate", "aggressive"):
    rows[preset] = [c[k] for c in (hd, sd) for k in (f"{preset} sparse", f"{preset} step x",
                                                     f"{preset} run", f"{preset} run x")]
  timed = table(text, "Wan 1.3B, timed on a chip")
  problems = []
  for label, want in rows.items():
    row = next(r for r in timed.rows if r[0] == label or f"`{label}`" in r[0])
    problems += [f"{label}: {m}" for m in mismatches(figures(" | ".join(row[1:])), want)]
  said = re.search(r"svg's dense steps run ([\d.]+)x \(720p\) and ([\d.]+)x \(480p\)", text)
  problems += mismatches(said.groups(), [hd["moderate dense"] / hd["base"],
                                         sd["moderate dense"] / sd["base"]])
  # flash was timed in the previous run, beside its own fixed-m
  earlier = chip_steps("chip_v5e_step_wan1.3b_code1758420")["wan1.3b_480p"]
  said = re.search(r"`flash` ran ([\d.]+) s a step at\s+480p, ([\d.]+)x fixed-m's", text)
  problems += mismatches(said.groups(), [earlier["flash"], earlier["flash"] / earlier["base"]])
  said = re.search(r"keeps ([\d.]+) s of MaxDiffusion's", text)
  problems += mismatches(said.groups(), [hd["untouched"]])
  said = re.search(r"is ([\d.]+)% of the `moderate`\s+sparse step at 720p and ([\d.]+)% at 480p",
                   text)
  problems += mismatches(said.groups(), [hd["ours %"], sd["ours %"]])
  said = re.search(r"a denoising step ([\d.]+)x faster on\s+`moderate` and ([\d.]+)x on "
                   r"`aggressive`, the 30-step run ([\d.]+)x and ([\d.]+)x", text)
  problems += mismatches(said.groups(), [hd["moderate step x"], hd["aggressive step x"],
                                         hd["moderate run x"], hd["aggressive run x"]])
  big = chip_steps("chip_v5e_step_wan14b_720p")["wan14b_720p"]
  said = re.search(r"a `moderate` sparse\s+step ([\d.]+)x, the run ([\d.]+)x; `aggressive` "
                   r"([\d.]+)x and ([\d.]+)x", text)
  return problems + mismatches(said.groups(), [big["moderate step x"], big["moderate run x"],
                                               big["aggressive step x"], big["aggressive run x"]])


def test_the_timed_step_table_is_what_bench_step_on_chip_printed():
  assert check_chip_steps(README) == []


# ------------------------------------------------------------------- bench calibrate, on CPU


def test_match_uniform_is_what_bench_calibrate_printed():
  out = format_calibration_bench(stored("calibration_bench_cpu"))
  said = re.search(r"`calibrate --match-uniform` visits ([\d.]+)x fewer tiles than uniform "
                   r"density ([\d.]+) at\s+its quality, \+([\d.]+) dB on held-out draws", README)
  want = [*printed(r"per layer, compensation chosen per layer\s+\d+ tiles\s+([\d.]+)x", out),
          *printed(r"vs uniform ([\d.]+) \(measured on CPU", out),
          *printed(r"per layer, compensation chosen per layer.*\(\+([\d.]+)\)", out)]
  assert said, "the README's calibrate sentence"
  assert mismatches(said.groups(), want) == []


# --------------------------------------------------- bench step: a step, compiled (stored)


STEPS = {  # expect.md's runs priced from a stored bench step that tiles does not price
    "`wan_svg.yml` on a v5e-8, 720p": "step_wan_svg_v5e8_720p",
}


def step_bounds(name: str) -> list[str]:
  """``bench step``'s bounds of a stored step: sparse step (online), the run (online)."""
  out = format_step(stored(name))
  return [*printed(r"sparse step ([\d.]+)x \(every head on online softmax: ([\d.]+)x\)", out),
          *printed(r"\): ([\d.]+)x \(online: ([\d.]+)x\)$", out.split("\ncollectives")[0])]


@pytest.mark.parametrize("label", list(STEPS))
def test_expect_step_rows_are_what_bench_step_printed(label):
  assert mismatches(figures(row_of(EXPECT, label)[1]), step_bounds(STEPS[label])) == []


def check_expect_timed_run(text: str) -> list[str]:
  """Wan 1.3B's runs timed on the chip: written moderate's step (480p's), run (480p's), then
  aggressive's, then svg's dense step over fixed-m's (480p's)."""
  steps = chip_steps()
  hd, sd = steps["wan1.3b_720p"], steps["wan1.3b_480p"]
  want = [c[f"{p} {k}"] for p in ("moderate", "aggressive") for k in ("step x", "run x")
          for c in (hd, sd)]
  want += [hd["moderate dense"] / hd["base"], sd["moderate dense"] / sd["base"]]
  row = row_of(text, "Wan 1.3B (`wan_svg_1_3b.yml`, all 30 layers, random weights) on one v5e "
                     "chip, 720p (480p)")
  return mismatches(figures(row[1]), want)


def test_expect_timed_run_is_what_bench_step_on_chip_printed():
  assert check_expect_timed_run(EXPECT) == []
  big = chip_steps("chip_v5e_step_wan14b_720p")["wan14b_720p"]
  row = row_of(EXPECT, "Wan 2.1 14B (`wan_svg.yml`'s model, all 40 heads, random weights) on one "
                       "v5e chip, 720p: timed at 1 and 2 of 40 layers, scaled to 40")
  want = [big[f"{p} {k}"] for p in ("moderate", "aggressive") for k in ("step x", "run x")]
  assert mismatches(figures(row[1]), want + [big["moderate dense"] / big["base"]]) == []


# -------------------------------------- bench.ltx2_aot --static-schedule: LTX-2's calls


def test_ltx2_call_bounds_are_what_the_static_schedule_printed():
  out = format_static_schedule_bounds(stored("ltx2_static_schedule_v6e"))
  rows = [r for r in out.splitlines() if re.match(r"\| (720p|1080p) ", r)]
  bounds = [re.findall(r"\| ([\d.]+)x \(([\d.]+)x\)", r) for r in rows]  # fixed-m, flash, per device
  vs_flash = [x for b in bounds for x in b[2]]
  vs_fixed_m = [x for b in bounds for x in b[0]]
  row = row_of(EXPECT, "self-attention alone over a run, `ltx2_svg.yml` on a v6e-8 at 1280x704 / "
                       "1920x1088")
  # written: against flash per device at 1280x704 (online), 1920x1088's; then against fixed-m
  assert mismatches(figures(row[1]), vs_flash + vs_fixed_m) == []


# ------------------------------------------------------ compiled forwards: memory per device


def temp_mib(out: str) -> dict[tuple[str, str], str]:
  """A compiled forward's printed table: (video, kernel) -> temp MiB, as printed (video ""
  where the table has one)."""
  found = {}
  for line in out.splitlines():
    c = [x.strip() for x in line.strip().strip("|").split("|")]
    if "yes" in c:
      at = c.index("yes")
      video = c[0].split(" ")[0] if at > 1 else ""
      found[(video, c[at - 1])] = c[at + 3]
  return found


def test_expect_memory_rows_are_what_the_compiles_printed():
  wan = temp_mib(format_wan_forwards(stored("wan14b_forward_v6e8")))
  row = row_of(EXPECT, "Wan 14B forward, v6e-8, temporary memory per device")
  want = [wan[("", k)] for k in ("svg", "ulysses_custom_fixed_m", "ulysses", "flash")]
  assert mismatches(figures(" | ".join(row[1:3])), want) == []
  ltx = temp_mib(format_ltx2_forwards(stored("ltx2_19b_forward_v6e8")))
  row = row_of(EXPECT, "LTX-2 19B forward, v6e-8, 1280x704 / 1920x1088 x 121 frames, temporary "
                       "memory per device")
  want = [ltx[(v, k)] for k in ("svg", "flash") for v in ("720p", "1080p")]
  assert mismatches(figures(" | ".join(row[1:3])), want) == []


# ------------------------------------------------------------------- the check itself


def test_a_changed_figure_fails():
  assert check_chip_calls(README) == []
  assert check_chip_calls(README.replace("| 31.94 |", "| 31.95 |"))
  assert check_chip_steps(README.replace("1.011x (720p)", "1.021x (720p)"))
  assert check_chip_steps(README.replace("7.7% at 480p", "8.1% at 480p"))
  assert check_chip_steps(README.replace("the 30-step run 1.59x", "the 30-step run 1.57x"))
  assert check_expect_timed_run(EXPECT.replace("the run 1.59x (1.36x)", "the run 1.59x (1.34x)"))
  assert mismatches(["0.40x"], ["0.4005"]) == [] and mismatches(["0.39"], ["0.395"]) == []
  assert mismatches(["0.41x"], ["0.4005"]) and mismatches(["1.2"], ["1.2", "3"])
