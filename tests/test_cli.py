"""The tile report CLI: output agrees with the planner; bad input exits 2 with a clear message."""

import json
import subprocess
import sys

import pytest

from maxdiffusion_svg.cli import main
from maxdiffusion_svg.geometry import grid_for_resolution
from maxdiffusion_svg.tiles import plan_tiles


def run_json(capsys, *args):
  assert main(["tiles", *args, "--json"]) == 0
  return json.loads(capsys.readouterr().out)


def test_json_report_matches_the_planner(capsys):
  report = run_json(capsys, "--resolution", "720p", "--density", "0.35")
  assert report["grid"] == [21, 45, 80] and report["tokens"] == 75_600
  assert report["q_tiles"] == 23 and report["kv_tiles"] == 50
  assert set(report["modes"]) == {"naive", "split", "aligned"}
  for mode, heads in report["modes"].items():
    stats = plan_tiles(grid_for_resolution("720p"), 0.35, 3328, 1536, mode).stats
    assert set(heads) == {"spatial", "temporal", "temporal_unplaced"}
    for head in ("spatial", "temporal"):  # placed heads share the band+sink plan
      for key in ("retained_pair_fraction", "visited_tile_fraction", "masked_tile_fraction",
                  "masked_visited_fraction", "budget_error"):
        assert heads[head][key] == pytest.approx(getattr(stats, key))
    assert heads["temporal_unplaced"]["exact_pairs"] == stats.exact_pairs
  assert report["modes"]["split"]["temporal_unplaced"]["visited_tile_fraction"] == 1.0


def test_pixel_sizes_and_latent_grid_select_the_grid(capsys):
  assert run_json(capsys, "--frames", "17", "--height", "64", "--width", "128",
                  "--mode", "split", "--block-q", "128", "--block-kv", "128")["grid"] == [5, 4, 8]
  report = run_json(capsys, "--latent-grid", "5x6x7", "--mode", "aligned",
                    "--block-q", "128", "--block-kv", "256")
  assert report["grid"] == [5, 6, 7] and list(report["modes"]) == ["aligned"]


def test_table_lists_every_mode_and_head(capsys):
  assert main(["tiles", "--resolution", "480p"]) == 0
  out = capsys.readouterr().out
  assert "32,760 tokens" in out
  for mode in ("naive", "split", "aligned"):
    for head in ("spatial", "temporal", "temporal_unplaced"):
      assert any(line.split()[:2] == [mode, head] for line in out.splitlines())


@pytest.mark.parametrize("args, needle", [
    (["--density", "0"], "density must be in (0, 1]"),
    (["--density", "1.2"], "density must be in (0, 1]"),
    (["--block-q", "100"], "block_q must be a positive multiple of 128"),
    (["--block-kv", "-128"], "block_kv must be a positive multiple of 128"),
    (["--resolution", "2k"], "resolution must be one of"),
    (["--frames", "80", "--height", "720", "--width", "1280"], "num_frames"),
    (["--frames", "81", "--height", "720"], "--frames, --height and --width"),
    (["--latent-grid", "21x0x80"], "height must be a positive integer"),
    (["--latent-grid", "21x45"], "--latent-grid must look like FxHxW"),
    (["--resolution", "720p", "--latent-grid", "1x1x1"], "only one of"),
])
def test_bad_input_exits_2_naming_the_argument(capsys, args, needle):
  assert main(["tiles", *args]) == 2
  assert needle in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path, capsys):
  path = tmp_path / "tiles.png"
  assert main(["tiles", "--latent-grid", "5x6x7", "--block-q", "128", "--block-kv", "128",
               "--plot", str(path)]) == 0
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert str(path) in capsys.readouterr().out


def test_module_entry_point_runs():
  out = subprocess.run([sys.executable, "-m", "maxdiffusion_svg", "tiles", "--mode", "aligned"],
                       capture_output=True, text=True, check=True).stdout
  assert "21x45x80 = 75,600 tokens" in out


def test_kernel_bench_reports_every_mode(tmp_path, capsys):
  path = tmp_path / "kernel.json"
  assert main(["bench", "kernel", "--latent-grid", "5x6x7", "--block-q", "128", "--block-kv", "128",
               "--heads", "2", "--head-dim", "32", "--repeats", "1", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  result = json.loads(path.read_text())
  assert result["tokens"] == 210 and result["backend"] == "xla"
  assert set(result["modes"]) == {"naive", "split", "aligned"}
  for mode, row in result["modes"].items():
    assert row["time_s"] > 0
    assert row["efficiency_vs_dense"] == pytest.approx(
        row["visited_tile_fraction"] / (row["time_s"] / result["dense_s"]))
    assert any(line.split()[:1] == [mode] for line in out.splitlines())


@pytest.mark.parametrize("args, needle", [
    (["--density", "0"], "density must be in (0, 1]"),
    (["--heads", "0"], "heads must be >= 1"),
    (["--block-q", "96"], "block_q must be a positive multiple of 128"),
])
def test_kernel_bench_bad_input_exits_2(capsys, args, needle):
  assert main(["bench", "kernel", "--latent-grid", "5x6x7", *args]) == 2
  assert needle in capsys.readouterr().err


def test_quality_bench_bad_input_exits_2(capsys):
  assert main(["bench", "--seeds", "0"]) == 2
  assert "router_seeds must be >= 1" in capsys.readouterr().err


def test_compile_bench_table_and_bad_chip(capsys):
  from maxdiffusion_svg.bench.compile import format_compile_bench
  row = {"case": "default", "chip": "v5e", "resolution": "720p", "mode": "split",
         "tiles": "3328x1536/256", "ok": False, "seconds": 9.1,
         "error": "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom ... Scoped allocation with "
                  "size 20.07M and limit 16.00M", "memory": {}, "vmem_estimate": 22 * 2**20,
         "vmem_limit": 16 * 2**20, "smem_estimate": 8192, "smem_limit": 2**20,
         "vmem_compiler": 21045248}
  text = format_compile_bench({"libtpu": "0.0.50.1", "jax": "0.12.0.1", "rows": [row]})
  assert ("| default | v5e | 720p | split | 3328x1536/256 | **no** | 22.0 / 16.0 | 20.1 | 8 |"
          in text) and "size 20.07M and limit 16.00M" in text
  assert main(["bench", "compile", "--chips", "v9z"]) == 2
  assert "--chips must be among v4, v5e, v5p, v6e, got 'v9z'" in capsys.readouterr().err
