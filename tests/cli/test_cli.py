"""The tile report CLI: output agrees with the planner; bad input exits 2 with a clear message."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from maxdiffusion_svg.cli.main import main
from maxdiffusion_svg.plan.geometry import grid_for_resolution
from maxdiffusion_svg.plan.tiles import plan_tiles

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_json(capsys, *args):
  """The tiles report as the JSON file ``--json FILE`` writes (the table goes to stdout)."""
  import tempfile  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as folder:
    path = f"{folder}/report.json"
    assert main(["tiles", *args, "--json", path]) == 0
    assert "tokens" in capsys.readouterr().out
    with open(path, encoding="utf-8") as f:
      return json.load(f)


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
    (["--density", "0"], "argument --density: must be a number in (0, 1]"),
    (["--density", "1.2"], "argument --density: must be a number in (0, 1]"),
    (["--density", "dense"], "argument --density: must be a number in (0, 1] (band density), got 'dense'"),
    (["--block-q", "100"], "argument --block-q: must be a positive multiple of 128"),
    (["--block-kv", "-128"], "argument --block-kv: must be a positive multiple of 128"),
    (["--densty", "0.3"], "unrecognized arguments: --densty (did you mean --density?)"),
    (["svg_density=0.2"], "key=value overrides (svg_density=0.2) need a config"),
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
    (["--density", "0"], "argument --density: must be a number in (0, 1]"),
    (["--heads", "0"], "heads must be >= 1"),
    (["--block-q", "96"], "argument --block-q: must be a positive multiple of 128"),
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
  assert "--chips must be among v4, v5e, v5p, v6e, tpu7x, got 'v9z'" in capsys.readouterr().err


WAN14B_720P = {"model_name": "wan2.1", "attention": "svg", "num_frames": 81, "height": 720,
               "width": 1280, "num_inference_steps": 50,
               "pretrained_model_name_or_path": "Wan-AI/Wan2.1-T2V-14B-Diffusers"}


def estimate(tmp_path, capsys, config, *args):
  path = tmp_path / "config.yml"
  path.write_text(json.dumps(config))  # JSON is YAML
  out = tmp_path / "estimate.json"
  code = main(["tiles", "--config", str(path), *args, "--json", str(out)])
  captured = capsys.readouterr()
  assert code == 0, captured.err
  return json.loads(out.read_text()), captured.out


def test_the_estimate_of_a_config_is_its_plan_over_its_schedule(tmp_path, capsys):
  """moderate at 720p, 50 steps x 40 layers: steps [10, 50) x layers [1, 40) sparse at density
  0.3 on v6e's 3328x1536 tiles."""
  result, text = estimate(tmp_path, capsys, WAN14B_720P)
  (row,) = result["rows"]
  visited = plan_tiles(grid_for_resolution("720p"), 0.3, 3328, 1536, "aligned").stats
  assert result["tiles"] == [3328, 1536] and result["kind"] == "computed from the tile plan"
  assert (row["sparse_steps"], row["sparse_layers"], row["layers"]) == (40, 39, 40)
  assert row["visited_tile_fraction"] == visited.visited_tile_fraction
  share = 40 * 39 / (50 * 40)
  assert row["work_vs_dense"] == pytest.approx(1 - share + share * visited.visited_tile_fraction)
  assert row["speedup_bound"] == pytest.approx(1 / row["work_vs_dense"])
  assert "computed from the tile plan (not measured)" in text and "at most" in text


def test_overrides_and_wan22_experts_change_the_estimate(tmp_path, capsys):
  result, _ = estimate(tmp_path, capsys, WAN14B_720P, "svg_density=0.2",
                       "svg_active_steps=[25, -1]", "--layers", "30")
  (row,) = result["rows"]
  assert (row["density"], row["sparse_steps"], row["layers"]) == (0.2, 25, 30)
  wan22 = {**WAN14B_720P, "model_name": "wan2.2", "svg_high_noise_density": 0.5,
           "svg_low_noise_density": 0.2, "boundary_ratio": 0.875, "flow_shift": 12.0}
  result, text = estimate(tmp_path, capsys, wan22)
  assert [(r["expert"], r["density"]) for r in result["rows"]] == [("high_noise", 0.5),
                                                                   ("low_noise", 0.2)]
  assert result["rows"][0]["speedup_bound"] < result["rows"][1]["speedup_bound"]
  # 50 steps at flow_shift 12: 32 timesteps at or above 875 (as MaxDiffusion's scheduler gives
  # them: tests/plugin/test_wan22.py).
  assert [(r["first_step"], r["steps"]) for r in result["rows"]] == [(0, 32), (32, 18)]
  assert "boundary_ratio 0.875" in text and "whole run, both experts" in text


def test_estimate_refusals_name_the_key(tmp_path, capsys):
  path = tmp_path / "config.yml"
  path.write_text(json.dumps(WAN14B_720P))
  assert main(["tiles", "--config", str(path), "num_inference_step=30"]) == 2
  err = capsys.readouterr().err
  assert "num_inference_step is not a key of" in err and "did you mean num_inference_steps" in err
  assert main(["tiles", "--config", str(path), "svg_densty=0.2"]) == 2
  assert "unknown SVG config key(s) svg_densty" in capsys.readouterr().err
  path.write_text(json.dumps({k: v for k, v in WAN14B_720P.items() if k != "num_frames"}))
  assert main(["tiles", "--config", str(path)]) == 2
  assert "the config has no num_frames" in capsys.readouterr().err


def test_help_shows_defaults(capsys):
  assert main(["tiles", "--help"]) == 0
  out = capsys.readouterr().out
  assert "(default: 0.35)" in out and "(default: v6e)" in out
  # The tile defaults in the help are computed by the one tile policy, per generation.
  assert "v6e 3328x1536/256" in " ".join(out.split()) and "v4 1536x1024/256" in " ".join(out.split())


def test_the_launcher_without_maxdiffusion_says_so_in_one_line(tmp_path):
  done = subprocess.run([sys.executable, "-m", "maxdiffusion_svg.generate", "configs/wan_svg.yml"],
                        capture_output=True, text=True, check=False,
                        env={**os.environ, "PYTHONPATH": ""}, cwd=ROOT)
  assert done.returncode == 2
  assert "Traceback" not in done.stderr
  assert "MaxDiffusion is not importable" in done.stderr and "PYTHONPATH" in done.stderr


def test_compare_takes_overrides_after_its_flags_and_a_comma_separated_svg_list(monkeypatch):
  from maxdiffusion_svg.cli import compare as cli_compare  # pylint: disable=import-outside-toplevel
  seen = {}
  monkeypatch.setattr(cli_compare, "run", lambda args: seen.update(vars(args)) or 0)
  assert main(["compare", "cfg.yml", "seed=1", "--svg", "config,aggressive,0.2", "prompt=a cat",
               "--out", "d", "num_inference_steps=4"]) == 0
  assert seen["overrides"] == ["seed=1", "prompt=a cat", "num_inference_steps=4"]
  assert (seen["svg"], seen["out"], seen["config"]) == ("config,aggressive,0.2", "d", "cfg.yml")
  assert main(["compare", "cfg.yml", "--out", "d", "stray"]) == 2  # not key=value: refused


def test_compare_without_maxdiffusion_says_how_to_get_it(capsys):
  import importlib.util  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec("maxdiffusion") is not None:
    pytest.skip("MaxDiffusion is importable here")
  assert main(["compare", "cfg.yml"]) == 2
  assert "put its source on PYTHONPATH" in capsys.readouterr().err


def test_wan_forward_bench_refuses_an_unknown_resolution_before_building_anything(capsys):
  assert main(["bench", "wan-forward", "--resolution", "900p"]) == 2
  assert "--resolution must be one of 480p, 720p, 1080p, 1440p, got '900p'" in (
      capsys.readouterr().err)


# ------------------------------------------------ one command-line shape


def test_the_config_is_tiles_first_positional_or_its_config_flag(tmp_path, capsys):
  path = tmp_path / "config.yml"
  path.write_text(json.dumps(WAN14B_720P))
  outs = []
  for args in ([str(path), "svg_density=0.2"], ["--config", str(path), "svg_density=0.2"],
               ["--chip", "v6e", str(path), "svg_density=0.2"]):
    out = tmp_path / "estimate.json"
    assert main(["tiles", *args, "--json", str(out)]) == 0, capsys.readouterr().err
    outs.append(json.loads(out.read_text())["rows"][0]["density"])
  assert outs == [0.2, 0.2, 0.2]
  capsys.readouterr()
  assert main(["tiles", "other.yml", "--config", str(path)]) == 2
  err = capsys.readouterr().err
  assert "CONFIG.yml other.yml and --config" in err and str(path) in err
  assert main(["tiles", "svg_density=0.2"]) == 2  # a first positional with = is an override
  assert "need a config: tiles CONFIG.yml svg_density=0.2" in capsys.readouterr().err


@pytest.mark.parametrize("slice_type, ok", [
    ("v6e-3", False), ("v6e-2", False), ("v6e-512", False), ("v5litepod-16", True),
    ("v5p-12", False), ("v5p-384", True), ("tpu7x-4", False), ("v6e-1", True)])
def test_slice_types_are_the_sizes_cloud_tpu_offers(slice_type, ok):
  from maxdiffusion_svg.plugin.config_checks import slice_chip  # pylint: disable=import-outside-toplevel
  if ok:
    slice_chip(slice_type, None)
    return
  with pytest.raises(ValueError, match=rf"^--slice {slice_type} is not a .* slice size: give one "
                                       rf"Cloud TPU offers, e.g. "):
    slice_chip(slice_type, None)


def test_tiles_reads_the_jobs_libtpu_init_args_where_the_flag_is_not_given(
    tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=65536")
  _, text = estimate(tmp_path, capsys, WAN14B_720P)
  assert "scoped VMEM 64 MiB (LIBTPU_INIT_ARGS from the environment)" in text
  _, text = estimate(tmp_path, capsys, WAN14B_720P,
                     "--libtpu-init-args=--xla_tpu_scoped_vmem_limit_kib=49152")
  assert "scoped VMEM 48 MiB (--libtpu-init-args)" in text  # the flag wins
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_gather=true")
  _, text = estimate(tmp_path, capsys, WAN14B_720P)
  assert ("(the chip's default; LIBTPU_INIT_ARGS from the environment sets no scoped-VMEM "
          "limit)") in text


def test_version_and_help_name_every_subcommand(capsys):
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  assert main(["--version"]) == 0  # each line: tests/cli/test_version.py
  assert capsys.readouterr().out.startswith(
      f"maxdiffusion-svg {metadata.version('maxdiffusion-svg')}")
  assert main(["--help"]) == 0
  out = capsys.readouterr().out
  for command in ("generate", "train", "train-vace", "tiles", "bench", "compare", "calibrate"):
    assert f"\n    {command} " in out, command


@pytest.mark.parametrize("command, entry", [("generate", "GENERATE"), ("train", "TRAIN"),
                                            ("train-vace", "TRAIN_VACE")])
def test_launcher_subcommands_run_the_launchers_main(capsys, monkeypatch, command, entry):
  from maxdiffusion_svg.plugin import launcher  # pylint: disable=import-outside-toplevel
  assert main([command, "--help"]) == 0
  out = capsys.readouterr().out
  # argparse's help, as the other subcommands': usage, the positionals, the options.
  verbose = "" if command.startswith("train") else " [--verbose]"  # a generation's only
  assert " ".join(out.split()).startswith(f"usage: python -m maxdiffusion_svg {command} [-h]"
                                          f"{verbose} CONFIG.yml [key=value ...] ")
  assert "\npositional arguments:\n  CONFIG.yml " in out and "\n  key=value " in out
  assert "\noptions:\n  -h, --help " in out
  assert getattr(launcher, entry).what in " ".join(out.split())
  seen = []
  monkeypatch.setattr(launcher, "main", lambda argv, entry: seen.append((argv[1:], entry.name)))
  assert main([command, "cfg.yml", "seed=1", "--x"]) == 0  # unparsed
  assert seen == [(["cfg.yml", "seed=1", "--x"], getattr(launcher, entry).name)]


def test_the_console_script_is_this_parser():
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  (script,) = [e for e in metadata.entry_points(group="console_scripts")
               if e.name == "maxdiffusion-svg"]
  assert script.load() is main


def bad_configs(tmp_path):
  """A config argument that is not a config, each with what its one line must say."""
  (tmp_path / "broken.yml").write_text("attention: svg\nheight: [720\nwidth: 1280\n")
  (tmp_path / "notes.md").write_text("# Notes\n\nSome words, not keys.\n")
  (tmp_path / "folder").mkdir()
  return [(tmp_path / "broken.yml", f"{tmp_path}/broken.yml line 3: not valid YAML"),
          (tmp_path / "notes.md", "a config must be a YAML mapping of keys, got str"),
          (ROOT / "README.md", "not valid YAML"),
          (tmp_path / "folder", f"config {tmp_path}/folder is a folder: give a .yml file, e.g. "
                                f"wan_svg.yml"),
          (tmp_path / "absent.yml", f"config file {tmp_path}/absent.yml does not exist; looked "
                                    f"in {tmp_path}/absent.yml; a bare .yml name"),
          ("absent_svg.yml", f"looked in {pathlib.Path.cwd()}/absent_svg.yml, "
                             f"{ROOT}/configs/absent_svg.yml")]


def test_a_config_that_is_not_one_is_named_in_one_line(tmp_path, capsys):
  from maxdiffusion_svg.plugin import launcher  # pylint: disable=import-outside-toplevel
  for path, needle in bad_configs(tmp_path):
    assert main(["tiles", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    with pytest.raises(SystemExit) as done:
      launcher.main(["prog", str(path)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and needle in err, err


def test_a_shipped_config_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
  from maxdiffusion_svg.plugin import overlay  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(tmp_path)
  found = overlay.find_config("wan_svg_1_3b.yml")
  assert found == ROOT / "configs" / "wan_svg_1_3b.yml"
  (tmp_path / "wan_svg_1_3b.yml").write_text("attention: svg\n")  # a file here comes first
  assert overlay.find_config("wan_svg_1_3b.yml") == tmp_path / "wan_svg_1_3b.yml"


def test_schedule_bench_fails_when_a_case_does_not_compile(capsys, monkeypatch):
  """Without MaxDiffusion's runtime each MaxDiffusion case's compile child fails on an import:
  simulated here (no compile), the run exits 1 with one line per failing case."""
  from maxdiffusion_svg.bench import schedule  # pylint: disable=import-outside-toplevel
  def compile_case(case, directory):  # pylint: disable=unused-argument
    error = ("ModuleNotFoundError: No module named 'huggingface_hub'"
             if case.kernel.startswith("maxdiffusion") else "E1001: out of scoped VMEM")
    return {"ok": False, "error": f"compile process exited 1: {error}", "seconds": 0.0}
  monkeypatch.setattr(schedule, "compile_case", compile_case)
  monkeypatch.setattr(schedule, "libtpu_version", lambda: "0.0")
  assert main(["bench", "schedule", "--maxdiffusion"]) == 1
  lines = capsys.readouterr().err.splitlines()
  errors = [l for l in lines if l.startswith("error: ")]
  missing = [l for l in errors if "needs the module huggingface_hub, which is missing: install "
                                  "MaxDiffusion's runtime" in l]
  assert len(missing) == 5 and all(l.startswith("error: maxdiffusion_") for l in missing)
  assert len(errors) == 5 + 4  # and each of ours (3 modes, dense) with its compile error
  from maxdiffusion_svg.cli.bench_tpu import failed_cases  # pylint: disable=import-outside-toplevel
  assert failed_cases({"aligned": {"ok": True}, "split": {"ok": False, "error": "E1"}}) == [
      "split: E1"]
