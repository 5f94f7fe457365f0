"""``tiles CONFIG --slice v5e-1`` says what the run does on that chip: its "the run will log" line
is the line the svg transformer logged on a TPU v5e when ``bench step --on-chip`` built it
(stored with the timed steps), for each case and preset timed there."""

import json
import pathlib

import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.bench.step_chip import CASES, ONE_CHIP
from maxdiffusion_svg.cli.main import main

ROOT = pathlib.Path(__file__).parent.parent.parent
TIMED = json.loads((ROOT / "docs" / "measurements" / "chip_v5e_step_wan1.3b.json").read_text())
ROWS = [r for r in TIMED["rows"] if r["kernel"] == "svg"]


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['case']}-{r['preset']}" for r in ROWS])
def test_the_run_logs_what_tiles_said(row, capsys):
  case = CASES[row["case"]]
  keys = {**ONE_CHIP, "height": case.height, "width": case.width, "svg_schedule": row["preset"]}
  code = main(["tiles", str(ROOT / case.config), "--slice", "v5e-1",
               *(f"{k}={v}" for k, v in keys.items())])
  out = capsys.readouterr().out
  assert code == 0, out
  assert f"the run will log: {row['svg']};" in out, out  # the chip's line, then what is dense
