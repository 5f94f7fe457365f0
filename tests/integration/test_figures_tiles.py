"""The docs' figures that ``tiles CONFIG --slice SLICE`` prints (computed from the tile plan,
priced by the stored static schedule of the compiled step; seconds, no compile): each row's
commands are run as the row names them and its figures compared with what they print. The
other figures: tests/test_figures.py. MaxDiffusion's base configs make the configs whole."""

import contextlib
import functools
import io
import re

import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from figures import figures, mismatches, printed, row_of, section, tables
from maxdiffusion_svg.cli.main import main

README = section("README.md", "## What to expect")
EXPECT = section("docs/expect.md", "## Every figure, with its baseline and kind")
COMMAND = re.compile(r"`(tiles [^`]+)`")
STEP = r"a sparse step at most ([\d.]+)x \(([\d.]+)x with every head on online softmax\)"
RUN = r"the run at most ([\d.]+)x \(([\d.]+)x\)"
ATTENTION = (r"attention speed-up at most ([\d.]+)x with dense steps \(heads on online softmax: "
             r"([\d.]+)x\)|against ulysses_custom_fixed_m at most ([\d.]+)x \(online softmax: "
             r"([\d.]+)x\)")


@functools.cache
def tiles(command: str) -> str:
  """What ``python -m maxdiffusion_svg COMMAND`` prints."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert main(command.split()) == 0, command
  return out.getvalue()


def step_and_run(output: str) -> list[str]:
  """A run's sparse steps (each expert's), then the run: each at most X; Y."""
  return printed(STEP, output) + printed(RUN, output)


def attention_alone(output: str) -> list[str]:
  """Self-attention's bound over the run against fixed-m (each expert's, then the whole run)."""
  return [g for g in printed(ATTENTION, output) if g]


def rows(text: str, first_header_cell: str, command_cell: int):
  table = next(t for t in tables(text) if t.header[0] == first_header_cell)
  return [(r, COMMAND.findall(r[command_cell])) for r in table.rows
          if r[command_cell].startswith("`tiles ")]


README_RUNS = rows(README, "run (config; slice; video)", -1)
EXPECT_RUNS = rows(EXPECT, "run", 3)
EXPECT_ALONE = rows(EXPECT, "figure", 3)


@pytest.mark.parametrize("row,commands", README_RUNS, ids=[r[0] for r, _ in README_RUNS])
def test_readme_runs_are_what_tiles_prints(row, commands):
  want = [f for c in commands for f in step_and_run(tiles(c))]
  assert mismatches(figures(" | ".join(row[1:3])), want) == []


@pytest.mark.parametrize("row,commands", EXPECT_RUNS, ids=[r[0] for r, _ in EXPECT_RUNS])
def test_expect_runs_are_what_tiles_prints(row, commands):
  want = [f for c in commands for f in step_and_run(tiles(c))]
  assert mismatches(figures(row[1]), want) == []


@pytest.mark.parametrize("row,commands", EXPECT_ALONE, ids=[r[0] for r, _ in EXPECT_ALONE])
def test_expect_self_attention_alone_is_what_tiles_prints(row, commands):
  want = [f for c in commands for f in attention_alone(tiles(c))]
  assert mismatches(figures(row[1]), want) == []


def test_ltx2_against_fixed_m_is_what_tiles_prints():
  row = row_of(EXPECT, "self-attention alone over a run, `ltx2_svg.yml` on a v6e-8 at 1280x704 / "
                       "1920x1088")
  written = figures(row[1].split("`ulysses_custom_fixed_m`")[1])[:2]  # 1280x704's
  assert mismatches(written, attention_alone(tiles("tiles ltx2_svg.yml --slice v6e-8"))) == []


def test_readme_shares_are_what_tiles_prints():
  said = re.search(r"self-attention is ([\d.]+)% of\s+`ulysses_custom_fixed_m`'s step at 720p, "
                   r"not the ([\d.]+)% once assumed \(both printed by `tiles\s+wan_svg.yml "
                   r"--slice v6e-8`\)", README)
  out = tiles("tiles wan_svg.yml --slice v6e-8")
  want = printed(r"self-attention ([\d.]+)% of the baseline's step", out)
  want += printed(r"if self-attention were ([\d.]+)% of a dense step", out)
  assert said and mismatches(said.groups(), want) == []


def test_every_tiles_row_is_checked_and_a_changed_figure_fails():
  assert len(README_RUNS) == 7 and len(EXPECT_RUNS) == 5 and len(EXPECT_ALONE) == 2
  row, commands = README_RUNS[0]
  want = [f for c in commands for f in step_and_run(tiles(c))]
  changed = [row[1].replace("1.93x", "1.95x"), row[2]]
  assert mismatches(figures(" | ".join(changed)), want)
