"""The first run's refusals (getting started's "Try it on a CPU"): each is one line naming the
fix, exit 2, before anything heavy loads."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from maxdiffusion_svg.cli import compare as cli_compare
from maxdiffusion_svg.cli import tiny_checkpoint as cli_tiny
from maxdiffusion_svg.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRESET_LINE = ("error: svg_schedule must be one of conservative, moderate, aggressive, got "
               "'agressive'; did you mean 'aggressive'?\n")


def one_line(capsys) -> str:
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1, (out, err)
  return err


def test_tiny_checkpoint_without_its_packages_names_how_to_get_them(tmp_path, capsys, monkeypatch):
  find_spec = importlib.util.find_spec
  present = {"diffusers": object(), "transformers": object(), "torch": None, "tokenizers": None}
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
      present[name] if name in present else find_spec(name, *args)))
  assert main(["tiny-checkpoint", str(tmp_path / "tiny")]) == 2
  err = one_line(capsys)
  assert err.startswith("error: tiny-checkpoint needs MaxDiffusion's runtime packages torch, "
                        "diffusers, transformers, tokenizers (missing: torch, tokenizers); get "
                        f"them with pip install -r {ROOT}/requirements-maxdiffusion.txt"), err
  assert f"make venv-maxdiffusion in {ROOT}" in err
  assert not (tmp_path / "tiny").exists()
  # The target the line names builds a venv from that file.
  makefile = (ROOT / "Makefile").read_text()
  assert re.search(r"^venv-maxdiffusion: \$\(MD_STAMP\)$", makefile, re.M)
  assert "-m pip install -q -r requirements-maxdiffusion.txt" in makefile
  # Installed from a wheel (no checkout beside the package): the file is named, not a path.
  assert cli_tiny.install_hint(tmp_path).startswith(
      "pip install -r requirements-maxdiffusion.txt from a maxdiffusion-svg checkout, or make "
      "venv-maxdiffusion there")


def test_a_typod_svg_run_is_refused_with_the_nearest_preset_before_maxdiffusion(
    capsys, monkeypatch):
  def loaded(command):
    raise AssertionError(f"{command} went on to look for MaxDiffusion")

  monkeypatch.setattr(cli_compare, "require_maxdiffusion", loaded)
  assert main(["compare", "absent.yml", "--svg", "config,agressive+semantic"]) == 2
  assert one_line(capsys) == (
      "error: --svg 'agressive' is not a run: give config, a preset (conservative, moderate, "
      "aggressive) or a band density in (0, 1]; did you mean 'aggressive'?\n")
  assert main(["compare", "absent.yml", "--svg", "fast"]) == 2
  assert one_line(capsys).endswith("a band density in (0, 1]\n")  # nothing near: no guess
  assert main(["compare", "absent.yml", "svg_schedule=agressive"]) == 2
  assert one_line(capsys) == PRESET_LINE


def test_every_run_compare_takes_passes_the_early_check():
  from maxdiffusion_svg.plugin import compare  # pylint: disable=import-outside-toplevel
  assert cli_compare.CONFIG_RUN == compare.CONFIG_RUN
  runs = ["config", "aggressive", "moderate+semantic", "0.25+compensation=4", "1"]
  cli_compare.check_svg_runs(runs)
  assert [compare.svg_run(r).name for r in runs][:2] == ["svg", "svg aggressive"]
  with pytest.raises(ValueError, match=r"got 'moderat'; did you mean 'moderate'\?$"):
    compare.svg_run("moderat")  # the plugin's own check, for callers of the library


@pytest.mark.parametrize("command", [["calibrate", "absent.yml", "--out", "o.yml"],
                                     ["generate", "absent.yml"]])
def test_a_typod_svg_schedule_is_refused_before_the_config_loads(capsys, command):
  assert main([*command, "num_inference_steps=3", "svg_schedule=agressive"]) == 2
  assert one_line(capsys) == PRESET_LINE  # not "absent.yml does not exist": checked first


def test_the_typo_is_answered_without_loading_the_comparison_or_maxdiffusion():
  code = ("import sys\n"
          "from maxdiffusion_svg.cli.main import main\n"
          "assert main(['compare', 'absent.yml', '--svg', 'agressive']) == 2\n"
          "print(sorted(m for m in sys.modules if m.split('.')[0] == 'maxdiffusion' or m in "
          "('maxdiffusion_svg.plugin.compare', 'maxdiffusion_svg.plugin.settings')))\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        check=False, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr
  assert done.stdout == "[]\n"
  assert "did you mean 'aggressive'?" in done.stderr


@pytest.mark.parametrize("head_dim", [32, 128])
def test_the_tiny_config_keeps_its_text_tokens_off_flash(head_dim):
  """Its 16 text tokens are under flash_min_seq_length: on a TPU, svg's dense kernel (flash)
  runs cross-attention as dot_product there; flash refused 16-key blocks on the chip."""
  import yaml  # pylint: disable=import-outside-toplevel
  keys = yaml.safe_load(cli_tiny.config_text("/tmp/tiny", head_dim))
  assert keys["max_sequence_length"] < keys["flash_min_seq_length"] <= min(
      keys["svg_block_kv"], cli_tiny.TOKENS)
  assert keys["svg_backend"] == ("auto" if head_dim == 128 else "xla")
