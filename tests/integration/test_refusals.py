"""The pre-flight agrees with the run: each refusal, through ``tiles CONFIG`` and through the
launcher (``python -m maxdiffusion_svg.generate``), is one line with the same message and exit
status 2, before any weights load. The launcher's cases that need the job's devices (the batch,
the ring) stop in the run's own checks (``hooks_entry.preflight_run``) on the 8 simulated
devices, which ``tiles --slice v6e-8`` stands for."""

import pathlib

import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.cli.main import main as cli_main
from maxdiffusion_svg.plugin import launcher

from tiny_runs import TINY, write_run_config

MAXDIFFUSION_CONFIGS = pathlib.Path(__import__("maxdiffusion").__file__).parent / "configs"


def _one_line(capsys) -> str:
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1, err
  assert err[0].startswith("error: "), err
  return err[0][len("error: "):]


def _tiles(capsys, config, overrides, slice_type):
  flags = ["--slice", slice_type] if slice_type else []
  assert cli_main(["tiles", "--config", str(config), *flags, *overrides]) == 2
  return _one_line(capsys)


def _launcher(capsys, config, overrides):
  with pytest.raises(SystemExit) as done:
    launcher.main(["maxdiffusion_svg.generate", str(config), *overrides])
  assert done.value.code == 2
  return _one_line(capsys)


@pytest.fixture(name="run_config")
def _run_config(tmp_path, wan21_checkpoint):
  """The tiny Wan on its checkpoint (2 layers, 8 heads), as the launcher's tests run it."""
  config = pathlib.Path(write_run_config(tmp_path))
  return config, [f"pretrained_model_name_or_path={wan21_checkpoint}", *TINY,
                  f"output_dir={tmp_path}/out", "ici_data_parallelism=1"]


CASES = {
    # what the checkpoint's config.json says: 2 layers
    "wrong layer count": (["svg_layer_densities=[0.3, 0.3, 0.3]"], None,
                          "svg_layer_densities gives 3 values; the model has 2 layers"),
    "missing checkpoint": (["pretrained_model_name_or_path=/no/such/checkpoint"], None,
                           "pretrained_model_name_or_path '/no/such/checkpoint' is not a "
                           "checkpoint folder"),
    "offline without the checkpoint": (["pretrained_model_name_or_path=Owner/not-cached"], None,
                                       "is not in this host's Hugging Face cache and "
                                       "HF_HUB_OFFLINE is set"),
    # on the job's devices: 8 (the simulated ones; tiles: a v6e-8)
    "a batch of 0": (["per_device_batch_size=0.1"], "v6e-8",
                     "per_device_batch_size 0.1 on 8 devices makes a batch of 0 videos"),
    "per-layer densities on a ring": (["ici_context_parallelism=8", "ulysses_shards=4",
                                       "svg_layer_densities=[0.3, 0.7]"], "v6e-8",
                                      "svg_layer_densities does not run on a ring yet"),
    "per-head densities on a ring": (["ici_context_parallelism=8", "ulysses_shards=4",
                                      f"svg_head_densities={[0.3] * 8}"], "v6e-8",
                                     "svg_head_densities does not run on a ring yet"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refusal_is_the_same_line_in_tiles_and_the_launcher(case, run_config, capsys,
                                                              monkeypatch, tmp_path):
  overrides, slice_type, needle = CASES[case]
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a host without the Hub
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  config, common = run_config
  argv = [*common, *overrides]
  ours = _tiles(capsys, config, argv, slice_type)
  theirs = _launcher(capsys, config, argv)
  assert needle in theirs
  assert theirs in ours, (ours, theirs)  # tiles says where the run stops, then the run's words


def test_jax_platforms_without_cpu_is_the_same_line_in_tiles_and_the_launcher(run_config, capsys,
                                                                               monkeypatch):
  """MaxDiffusion loads the weights through JAX's CPU device (on the v5e, JAX_PLATFORMS=tpu
  stopped a run there with a traceback): refused before anything loads, naming the fix."""
  config, common = run_config
  monkeypatch.setenv("JAX_PLATFORMS", "tpu")
  ours = _tiles(capsys, config, common, None)
  theirs = _launcher(capsys, config, common)
  assert theirs == ("JAX_PLATFORMS=tpu leaves out cpu, where MaxDiffusion loads the checkpoint's "
                    "weights (and JAX runs host callbacks): set JAX_PLATFORMS=tpu,cpu, or unset it")
  assert theirs in ours, (ours, theirs)


FILES = {
    "LTX-Video": (lambda tmp: MAXDIFFUSION_CONFIGS / "ltx_video.yml",
                  "is an LTX-Video config: LTX-Video (MaxDiffusion's legacy 13B port"),
    "bad YAML": (lambda tmp: _write(tmp / "bad.yml", "attention: svg\nheight: [128\n"),
                 "bad.yml"),
    "not a config": (lambda tmp: pathlib.Path(__file__).parent.parent.parent / "README.md",
                     "README.md"),
    "a folder": (lambda tmp: tmp, "folder"),
}


def _write(path, text):
  path.write_text(text)
  return path


@pytest.mark.parametrize("case", list(FILES))
def test_a_file_that_is_not_a_config_is_the_same_line_in_tiles_and_the_launcher(
    case, capsys, tmp_path):
  make, needle = FILES[case]
  config = make(tmp_path)
  ours = _tiles(capsys, config, [], None)
  theirs = _launcher(capsys, config, [])
  assert needle in theirs and theirs in ours, (ours, theirs)


def test_a_calibrated_overlay_for_the_checkpoint_passes_tiles(run_config, capsys, tmp_path):
  """An overlay as calibrate writes it for the 2-layer checkpoint: tiles reads the layers from
  the checkpoint's config.json, as the run does (it refused 2 values against a 1.3B's 30). On
  XLA: the tiny checkpoint's head_dim 32 is no TPU kernel's, which tiles also reads from it."""
  config, common = run_config
  overlay = tmp_path / "calibrated.yml"
  overlay.write_text(yaml.safe_dump({"base_config": str(config),
                                     "svg_layer_densities": [0.2, 0.45]}))
  assert cli_main(["tiles", "--config", str(overlay), *common]) == 2
  assert "needs head_dim a multiple of 128 (lanes), got 32" in _one_line(capsys)
  assert cli_main(["tiles", "--config", str(overlay), *common, "svg_backend=xla"]) == 0
  out = capsys.readouterr().out
  assert "heads 8 (" in out and "/transformer/config.json)" in out
