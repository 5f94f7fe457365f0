"""``bench schedule --compensation``: its flags, its JSON fields, and the XLA schedule reader it
prices the centroid pass with (fast: no compile, except one small one where libtpu is here)."""

import json

import pytest

from maxdiffusion_svg.bench import schedule_compensation
from maxdiffusion_svg.bench.schedule import ScheduleCase, run_case
from maxdiffusion_svg.bench.schedule_compensation import compensated_row, format_compensation_bench
from maxdiffusion_svg.bench.schedule_xla import calls, issued_bundles, loops, price_program
from maxdiffusion_svg.cli import main as cli
from maxdiffusion_svg.tpu.aot import libtpu_available


def parse(*flags):
  return cli.build_parser().parse_args(["bench", "schedule", *flags])


def test_the_flags_and_their_defaults():
  args = parse()
  assert not args.compensation and args.compensation_blocks == 8
  args = parse("--compensation", "--compensation-blocks", "4", "--density", "0.2")
  assert args.compensation and args.compensation_blocks == 4 and args.density == 0.2


@pytest.mark.parametrize("bad", ["0", "-2", "x"])
def test_a_block_count_below_one_is_refused(bad, capsys):
  with pytest.raises(SystemExit):
    parse("--compensation", "--compensation-blocks", bad)
  assert "--compensation-blocks" in capsys.readouterr().err


def fake_row(kernel, xla, ok=True):
  return {"ok": ok, "error": "" if ok else "refused", "case": {}, "static_bundles": kernel,
          "xla": {"bundles": xla}}


def test_a_compensated_row_adds_the_kernels_lse_and_the_xla_difference():
  row = compensated_row(fake_row(1000, 300), fake_row(1010, 340))
  assert row["ok"] and row["plain_static_bundles"] == 1000 and row["kernel_bundles"] == 1010
  assert row["kernel_lse_bundles_added"] == 10 and row["centroid_pass_and_merge_bundles"] == 40
  # static_bundles: the plain figure's kind (the kernel) plus everything compensation adds.
  assert row["static_bundles"] == 1050 and row["ratio_to_plain"] == 1.05
  assert not compensated_row(fake_row(1000, 300), fake_row(0, 0, ok=False))["ok"]


def test_the_cli_writes_the_modes_with_the_plain_fields(monkeypatch, tmp_path, capsys):
  seen = {}

  def fake_bench(chip, resolution, density, tiles, vmem, backend, blocks, log):
    seen.update(chip=chip, density=density, blocks=blocks, backend=backend)
    row = compensated_row(fake_row(2000, 100), fake_row(2004, 150))
    return {"kind": "compiler-static schedule", "libtpu": "x", "chip": chip,
            "resolution": resolution, "grid": [1, 1, 1], "tokens": 1, "density": density,
            "tiles": [1, 1, 1], "backend": backend, "vmem_limit_kib": None,
            "compensation_blocks": blocks, "caveat": "c", "modes": {"aligned": row}}

  monkeypatch.setattr(schedule_compensation, "run_compensation_bench", fake_bench)
  out = tmp_path / "r.json"
  assert cli.main(["bench", "schedule", "--compensation", "--compensation-blocks", "4",
                   "--density", "0.2", "--json", str(out)]) == 0
  assert seen == {"chip": "v6e", "density": 0.2, "blocks": 4, "backend": "pallas"}
  aligned = json.loads(out.read_text())["modes"]["aligned"]
  assert aligned["static_bundles"] == 2054 and aligned["ratio_to_plain"] == 1.027
  (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("aligned")]
  assert "1.027" in line


# A listing in libtpu's layout: 2 bundles before a loop of 3 (run 5 times, back edge plus one
# empty delay slot), then the exit bundle; the TLP calls it twice, once in a loop of 4 steps.
FUSION = """  0x0   :  { %1 = smov 0 }
  0x1   :  { %2 = smov 0 }
  0x2 LB: > { %3 = sadd.s32 1, %2 }
  0x3   : > { %p4 = scmp.ge.s32.totalorder %3, 5 /* loop exit test */ }
  0x4   :  { %5 = sbr.rel (!%p4) target = $region7 }
  0x5   :  {}
  0x6   :  {} /* exit bundle: %f = fusion() */
"""
TLP = """  0x0   :  { %1 = inlined_call %s1 /* %f = fusion() */ }
  0x1 LB: > { %2 = inlined_call %s2 /* %f = fusion() */ }
  0x2   : > { %p3 = scmp.ge.s32.totalorder %s9, 4 /* loop exit test */ }
  0x3   :  { %4 = sbr.rel (!%p3) target = $region2 }
  0x4   :  { %5 = inlined_call %s3 /* %kernel_call = custom-call() */ }
"""


def test_the_xla_reader_runs_each_loop_its_trip_count(tmp_path):
  assert loops(FUSION) == [(2, 5, 5)]
  assert issued_bundles(FUSION) == 7 + 4 * 4
  assert calls(TLP) == {"f": 5, "kernel_call": 1}
  for name, text in (("TLP", TLP), ("f", FUSION), ("kernel_call", FUSION)):
    (tmp_path / f"1-{name}-02-final_bundles.txt").write_text(text)
  priced = price_program(str(tmp_path), "kernel")
  assert priced["computations"] == {"f": 5 * 23} and priced["unpriced"] == []
  assert priced["bundles"] == 5 * 23 + issued_bundles(TLP)


# A scan's loop: its exit test compares two registers (no literal trip count).
SCAN_TLP = """  0x0   :  { %1 = inlined_call %s1 /* %f = fusion() */ }
  0x1 LB: > { %2 = inlined_call %s2 /* %f = fusion() */ }
  0x2   : > { %p3 = scmp.lt.s32.totalorder %s9, %s8 }
  0x3   : > { %4 = sbr.rel (%p3) target = $region2 }
  0x4   :  { %5 = inlined_call %s3 /* %kernel_call = custom-call() */ }
"""


def test_a_scan_loop_runs_the_trip_count_its_caller_knows(tmp_path):
  from maxdiffusion_svg.tpu.bundles import ScheduleFormatError  # pylint: disable=import-outside-toplevel
  with pytest.raises(ScheduleFormatError, match="no exit test"):
    calls(SCAN_TLP)
  assert calls(SCAN_TLP, loop_trips=6) == {"f": 7, "kernel_call": 1}
  for name, text in (("TLP", SCAN_TLP), ("f", FUSION), ("kernel_call", FUSION)):
    (tmp_path / f"1-{name}-02-final_bundles.txt").write_text(text)
  priced = price_program(str(tmp_path), ("kernel", "other"), loop_trips=6)
  assert priced["computations"] == {"f": 7 * 23}
  assert priced["top_level"] == 5 + 5 * 3 and priced["bundles"] == 7 * 23 + 20


@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")
def test_a_small_compensated_call_is_priced_whole(tmp_path_factory):
  """Ours on a v6e, 5x8x16 tokens in 256-token tiles: the compensated call costs more than the
  plain one, by its centroid pass and merge (and the kernel's log-sum-exp output)."""
  case = ScheduleCase("v6e", (5, 8, 16), 0.35, "aligned", 256, 256, 128, backend="pallas")
  plain = run_case(case, log=lambda _: None, price_xla=True)
  comp = run_case(ScheduleCase(**{**case.__dict__, "compensation_blocks": 4}),
                  log=lambda _: None, price_xla=True)
  row = compensated_row(plain, comp)
  assert row["ok"], row.get("error")
  assert row["centroid_pass_and_merge_bundles"] > 0 and row["kernel_lse_bundles_added"] >= 0
  assert row["static_bundles"] > row["plain_static_bundles"] and row["ratio_to_plain"] > 1
  text = format_compensation_bench({"libtpu": "x", "chip": "v6e", "backend": "pallas",
                                    "resolution": "tiny", "tokens": 640, "density": 0.35,
                                    "tiles": [256, 256, 128], "compensation_blocks": 4,
                                    "caveat": "c", "modes": {"aligned": row}})
  assert f"{row['ratio_to_plain']:.3f}" in text


# Two loops, one inside the other (libtpu marks the depth with '>'): the inner body of 2 bundles
# runs 3 times per step of the outer one, which runs 4 times.
NESTED = """  0x0   :  { %1 = smov 0 }
  0x1 LB: > { %2 = sadd.s32 1, %1 }
  0x2 LB: >> { %3 = sadd.s32 1, %2 }
  0x3   : >> { %p4 = scmp.ge.s32.totalorder %3, 3 /* loop exit test */ }
  0x4   : > { %5 = sbr.rel (!%p4) target = $region3 }
  0x5   : > { %p6 = scmp.ge.s32.totalorder %2, 4 /* loop exit test */ }
  0x6   :  { %7 = sbr.rel (!%p6) target = $region2 }
  0x7   :  {} /* exit bundle: %f = fusion() */
"""


def test_a_loop_inside_a_loop_runs_its_trips_each_outer_step():
  assert loops(NESTED) == [(2, 4, 3), (1, 6, 4)]
  # 8 bundles; the outer body (0x1-0x6, 6) 3 more times; the inner (0x2-0x4, 3) twice more in
  # each of the outer's 4 steps.
  assert issued_bundles(NESTED) == 8 + 3 * 6 + 4 * 2 * 3
