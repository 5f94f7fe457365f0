"""The launcher's answers before MaxDiffusion starts (no MaxDiffusion needed): help, the form of
the overrides, their values typed as MaxDiffusion's pyconfig types them and checked as the plugin
checks them, a base config that only an importable MaxDiffusion holds, and a closed pipe."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from maxdiffusion_svg.plugin import launcher, overlay

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def config(tmp_path) -> str:
  """A chained config holding a key of each type MaxDiffusion's pyconfig can override."""
  (tmp_path / "base.yml").write_text(yaml.safe_dump({
      "model_name": "wan2.1", "attention": "flash", "num_inference_steps": 50,
      "per_device_batch_size": 1.0,
      "enable_profiler": False, "logical_axis_rules": [["batch", "data"]],
      "flash_block_sizes": {"block_q": 512}, "lora_config": None, "output_dir": "/tmp/out",
      "run_name": "test"}))
  (tmp_path / "run.yml").write_text(yaml.safe_dump({"base_config": "base.yml",
                                                    "attention": "svg"}))
  return str(tmp_path / "run.yml")


def launch(capsys, *argv: str) -> tuple[int, str, str]:
  """``main``'s exit status, stdout and stderr."""
  with pytest.raises(SystemExit) as done:
    launcher.main(["prog", *argv])
  out, err = capsys.readouterr()
  return done.value.code, out, err


def refused(capsys, *argv: str) -> str:
  """The one line the launcher refuses ``argv`` with (exit status 2)."""
  code, out, err = launch(capsys, *argv)
  assert (code, out) == (2, ""), (code, out, err)
  assert err.startswith("error: ") and err.count("\n") == 1, err
  return err


# Each bad value: the key and the allowed values its one line must name.
@pytest.mark.parametrize("override, named", [
    ("svg_density=0", ["svg_density must be in (0, 1]", "got 0"]),
    ("svg_density=abc", ["svg_density must be a number in (0, 1]", "'abc'"]),
    ("svg_block_q=100", ["svg_block_q must be a positive multiple of 128", "100"]),
    ("svg_schedule=fast", ["svg_schedule must be one of conservative, moderate, aggressive",
                           "'fast'"]),
    ("svg_backend=gpu", ["svg_backend must be one of auto, pallas, splash, xla", "'gpu'"]),
    ("svg_active_steps=[5]", ["svg_active_steps must be a [start, end) pair", "[5]"]),
    ("svg_high_noise_density=2", ["svg_high_noise_density must be in (0, 1]"]),
    ("svg_min_seq_length=-1", ["svg_min_seq_length must be an integer >= 0"]),
    ("svg_compensation_blocks=0", ["svg_compensation_blocks must be an integer >= 1 dividing "
                                   "the key tile (svg_block_kv), got 0"]),
    # With the key tile given, a block count that does not divide it is refused here too.
    ("svg_compensation_blocks=5 svg_block_kv=1024", [
        "svg_compensation_blocks must divide the key tile svg_block_kv (1024), got 5"]),
    # Text MaxDiffusion's pyconfig itself cannot type: named with the type it reads.
    ("svg_block_q=abc", ["svg_block_q=abc: MaxDiffusion reads svg_block_q as an integer"]),
    ("svg_include_sink=yes", ["svg_include_sink=yes: MaxDiffusion reads svg_include_sink as "
                              "true or false"]),
    ("svg_compensation=on", ["svg_compensation=on: MaxDiffusion reads svg_compensation as "
                             "true or false"]),
    ("num_inference_steps=2.5", ["reads num_inference_steps as an integer (the config holds 50)"]),
    ("num_inference_steps=0", ["num_inference_steps must be a positive integer, got 0"]),
    ("enable_profiler=1", ["reads enable_profiler as true or false"]),
    ("per_device_batch_size=x", ["reads per_device_batch_size as a number"]),
    ("logical_axis_rules=[[", ["reads logical_axis_rules as a list"]),
    ("flash_block_sizes=512", ["reads flash_block_sizes as a JSON mapping",
                               """flash_block_sizes='{"block_q": 512}'"""]),
    ("lora_config=x", ["lora_config is None in the config", "set lora_config in a config"]),
])
def test_a_bad_value_is_refused_in_one_line_naming_the_key(capsys, config, override, named):
  err = refused(capsys, config, "svg_density=0.5", *override.split())
  for text in named:
    assert text in err, err


def test_a_bad_value_in_the_config_file_is_refused_too(capsys, tmp_path, config):
  (tmp_path / "bad.yml").write_text("base_config: run.yml\nsvg_tile_mode: diagonal\n")
  err = refused(capsys, str(tmp_path / "bad.yml"))
  assert "svg_tile_mode must be one of naive, split, aligned, got 'diagonal'" in err


def test_overrides_are_typed_as_pyconfig_types_them(config):
  keys, _ = overlay.load_config(config)
  typed = {item.split("=")[0]: launcher.parse_override(*item.split("=", 1), keys)
           for item in ("num_inference_steps=30", "per_device_batch_size=0.125",
                        "enable_profiler=TRUE", "logical_axis_rules=[['batch', 'fsdp']]",
                        'flash_block_sizes={"block_q": 1024}', "attention=0.5")}
  assert typed == {"num_inference_steps": 30, "per_device_batch_size": 0.125,
                   "enable_profiler": True, "logical_axis_rules": [["batch", "fsdp"]],
                   "flash_block_sizes": {"block_q": 1024}, "attention": "0.5"}
  # Good values pass, and the config returned is the file's (MaxDiffusion applies overrides).
  merged, _ = launcher.checked_config(["prog", config, "svg_density=0.25", "svg_block_q=1024",
                                       "svg_active_steps=[5,-1]", "num_inference_steps=30"])
  assert merged["svg_density"] == "preset" and merged["num_inference_steps"] == 50


def test_an_override_without_equals_is_named(capsys, config):
  err = refused(capsys, config, "svg_density=0.3", "svg_density")
  assert err == "error: overrides are key=value, got 'svg_density'\n"
  assert "not an option of the launcher" in refused(capsys, "--config", config)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_exits_0(capsys, flag):
  code, out, err = launch(capsys, flag)
  assert code == 0 and err == ""
  assert out.startswith("usage: python -m maxdiffusion_svg.generate [-h] [--verbose]\n")
  assert "CONFIG.yml [key=value ...]\n" in out
  assert "docs/reference.md" in out and "key=value" in out and "maxdiffusion.log" in out
  assert launch(capsys, "configs/wan_svg.yml", flag)[0] == 0  # anywhere on the line


def test_verbose_is_taken_anywhere_and_only_by_a_generation():
  assert launcher.split_verbose(["prog", "c.yml", "--verbose", "a=1"]) == (["prog", "c.yml", "a=1"],
                                                                           True)
  assert launcher.split_verbose(["prog", "--verbose", "c.yml"]) == (["prog", "c.yml"], True)
  assert launcher.split_verbose(["prog", "c.yml"]) == (["prog", "c.yml"], False)
  # training prints as it always has: --verbose is no flag of it
  assert launcher.split_verbose(["prog", "--verbose", "c.yml"], launcher.TRAIN) == (
      ["prog", "--verbose", "c.yml"], False)


def test_a_quiet_run_logs_in_its_output_folder(config, tmp_path):
  merged, _ = launcher.checked_config(["prog", config])
  assert launcher.quiet_log(merged, []) == "/tmp/out/test/maxdiffusion.log"
  assert launcher.quiet_log(merged, [f"output_dir={tmp_path}", "run_name=r"]) == str(
      tmp_path / "r" / "maxdiffusion.log")
  assert launcher.quiet_log(merged, ["run_name="], env={"JOBSET_NAME": "job"}) == (
      "/tmp/out/job/maxdiffusion.log")
  assert launcher.quiet_log(merged, ["output_dir=gs://bucket/out"]) is None  # on the terminal


def test_an_output_dir_that_cannot_hold_the_log_is_refused_in_one_line(capsys, config, tmp_path):
  (tmp_path / "file").write_text("")
  err = refused(capsys, config, f"output_dir={tmp_path}/file")
  assert err.startswith(f"error: output_dir: cannot write {tmp_path}/file/test/maxdiffusion.log")
  assert "--verbose" in err


def test_a_quiet_runs_last_line_names_the_videos_it_wrote(tmp_path):
  (tmp_path / "old.mp4").write_bytes(b"x")
  os.utime(tmp_path / "old.mp4", (1, 1))  # before the run
  assert launcher.written_line(launcher.GENERATE, 100, str(tmp_path)) == (
      f"generate: done; no new video in {tmp_path}")
  (tmp_path / "wan_output_0_0.mp4").write_bytes(b"x")
  assert launcher.written_line(launcher.GENERATE, 100, str(tmp_path)) == (
      f"generate: done; wan_output_0_0.mp4 in {tmp_path}")


def test_no_arguments_print_the_usage_and_exit_2(capsys):
  code, out, err = launch(capsys)
  assert code == 2 and out == "" and err.startswith("usage: ")


def test_help_imports_neither_maxdiffusion_nor_jax():
  code = ("import sys\n"
          "from maxdiffusion_svg.plugin.launcher import main\n"
          "try:\n  main(['prog', '--help'])\nexcept SystemExit as done:\n  assert done.code == 0\n"
          "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'maxdiffusion'))\n"
          "assert not loaded, loaded\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        check=False, cwd=ROOT)
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith("usage: ")


def hide_maxdiffusion(monkeypatch):
  """This process as if MaxDiffusion were not installed (whatever this venv holds)."""
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *args: None if name == "maxdiffusion" else find_spec(name, *args))


def test_a_maxdiffusion_base_without_maxdiffusion_says_to_put_it_on_pythonpath(capsys, monkeypatch):
  hide_maxdiffusion(monkeypatch)
  err = refused(capsys, str(ROOT / "configs" / "wan_svg.yml"))
  assert "base_config 'base_wan_14b.yml' not found" in err
  assert "MaxDiffusion is not importable here" in err
  assert "PYTHONPATH=/path/to/maxdiffusion/src" in err


def test_a_missing_base_with_maxdiffusion_importable_is_only_missing(tmp_path, monkeypatch):
  package = tmp_path / "site" / "maxdiffusion"
  (package / "configs").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "configs" / "base_wan_14b.yml").write_text("attention: flash\n")
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  if "maxdiffusion" in sys.modules:
    pytest.skip("a real MaxDiffusion is imported in this process")
  config, chain = overlay.load_config(ROOT / "configs" / "wan_svg.yml")
  assert chain[-1] == str(package / "configs" / "base_wan_14b.yml")
  (tmp_path / "typo.yml").write_text("base_config: base_wan_14bb.yml\n")
  with pytest.raises(ValueError) as missing:
    overlay.load_config(tmp_path / "typo.yml")
  assert "base_wan_14bb.yml" in str(missing.value) and "PYTHONPATH" not in str(missing.value)


@pytest.mark.parametrize("command", [
    ["-m", "maxdiffusion_svg", "tiles", "--mode", "all"],
    ["-m", "maxdiffusion_svg.generate", "--help"],
])
def test_a_reader_that_closes_early_gets_no_traceback(command):
  """``... | head -1``: the reader is gone before the command writes (its end closed first)."""
  read, write = os.pipe()
  os.close(read)
  try:
    done = subprocess.run([sys.executable, *command], stdout=write, stderr=subprocess.PIPE,
                          text=True, check=False, cwd=ROOT)
  finally:
    os.close(write)
  assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
  assert done.returncode == 1  # Python's own status for EPIPE, as with SIGPIPE ignored


def train(capsys, *argv: str) -> tuple[int, str, str]:
  with pytest.raises(SystemExit) as done:
    launcher.main(["prog", *argv], launcher.TRAIN)
  out, err = capsys.readouterr()
  return done.value.code, out, err


def test_train_help_names_the_trainer_and_its_config(capsys):
  code, out, _ = train(capsys, "--help")
  assert code == 0
  assert out.startswith("usage: python -m maxdiffusion_svg.train [-h] CONFIG.yml")
  assert "train_wan" in out and "configs/wan_svg_train.yml" in out


@pytest.mark.parametrize("override, named", [
    ("svg_active_steps=[10, -1]", ["svg_active_steps=(10, -1)", "a training step has no "
                                   "denoising step", "svg_active_steps: [0, -1]"]),
    ("svg_semantic_warm_iterations=1", ["svg_semantic_warm_iterations=1",
                                        "svg_semantic_warm_iterations: 0"]),
])
def test_training_refuses_what_a_training_step_cannot_mean(capsys, config, override, named):
  keys = [override, "svg_active_steps=[0, -1]"] if "active_steps" not in override else [override]
  if "semantic" in override:
    keys.append("svg_layouts=[spatial, temporal, semantic]")
  code, out, err = train(capsys, config, *keys)
  assert (code, out) == (2, "") and err.count("\n") == 1, err
  for text in named:
    assert text in err


def test_training_checks_apply_to_svg_only(capsys, config):
  # Another kernel trains as MaxDiffusion would: the svg step schedule is not its concern.
  launcher.checked_config(["prog", config, "attention=flash", "svg_active_steps=[10, -1]"],
                          launcher.TRAIN)
  code, _, err = train(capsys, config, "svg_active_steps=[10, -1]")
  assert code == 2 and "a training step has no denoising step" in err


def test_the_shipped_training_config_passes_the_training_checks():
  from maxdiffusion_svg.plugin.settings import config_defaults
  from maxdiffusion_svg.plugin.training import check_training
  from shipped_configs import own_chain
  settings = check_training({**config_defaults(),
                             **own_chain(ROOT / "configs" / "wan_svg_train.yml")})
  assert settings is not None and settings.svg.schedule.active_steps.start == 0


@pytest.mark.parametrize("keys, named", [
    ({"model_name": None, "pretrained_model_name_or_path": "Lightricks/LTX-Video"},
     ["is an LTX-Video config: LTX-Video (MaxDiffusion's legacy 13B port, generate_ltx_video) is "
      "not supported", "calls Pallas flash attention directly"]),
    ({"model_name": "z_image"}, ["model_name is 'z_image': python -m maxdiffusion_svg.generate "
                                 "runs Wan (model_name wan2.1 or wan2.2) through generate_wan and "
                                 "LTX-2 (model_name ltx2_video or ltx2.3) through generate_ltx2"])])
def test_a_config_of_another_model_is_refused_by_name(capsys, tmp_path, config, keys, named):
  """Generation runs generate_wan or generate_ltx2: LTX-Video (whose attention never reaches
  the registry) and other models are refused before anything loads, each saying why."""
  path = tmp_path / "other.yml"
  path.write_text(yaml.safe_dump({"base_config": "run.yml", **keys}))
  err = refused(capsys, str(path))
  for text in named:
    assert text in err, err


@pytest.mark.parametrize("keys, main", [
    ({"model_name": "wan2.1"}, "maxdiffusion.generate_wan"),
    ({"model_name": "wan2.2"}, "maxdiffusion.generate_wan"),
    ({"model_name": "ltx2_video"}, "maxdiffusion.generate_ltx2"),
    ({"model_name": "ltx2.3"}, "maxdiffusion.generate_ltx2"),
    ({"model_name": "wan2.2", "pose_video_path": ""}, "maxdiffusion.generate_wan_animate"),
    # MaxDiffusion has no VACE generate main: ours drives its VACE pipeline
    ({"model_name": "wan2.1", "vace_reference_images": []},
     "maxdiffusion_svg.plugin.generate_vace")])
def test_generation_runs_the_model_familys_own_main(keys, main):
  from maxdiffusion_svg.plugin.launcher import GENERATE, TRAIN, TRAIN_VACE, maxdiffusion_main
  assert maxdiffusion_main(keys, GENERATE) == main
  assert maxdiffusion_main(keys, TRAIN) == "maxdiffusion.train_wan"  # Wan 2.1's trainer
  assert maxdiffusion_main(keys, TRAIN_VACE) == "maxdiffusion.train_wan_vace"
