"""``calibrate`` end to end on the tiny checkpoint: measured through generate_wan (each density
with compensation off and on), an overlay that MaxDiffusion's own pyconfig reads, and a
calibrated run no further from dense than the uniform one at no more cost."""

import pathlib
import re
import shutil

import numpy as np
import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.bench import wan_e2e
from maxdiffusion_svg.plugin import calibrate, launcher
from maxdiffusion_svg.plugin.settings import PluginSettings
from tiny_runs import STEPS, SVG_KEYS, TINY, launch, write_run_config

LAYERS = 2  # the tiny checkpoint's blocks
LADDER = (0.1, 0.3, 0.6, 1.0)
# both layers sparse from step 1: each has a density to choose
ACTIVE = ["svg_active_layers=[0, -1]"]


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
  return write_run_config(tmp_path_factory.mktemp("config"))


def _overrides(checkpoint):
  return [f"pretrained_model_name_or_path={checkpoint}", *TINY, *ACTIVE]


def test_a_process_without_jaxs_cpu_backend_is_refused_before_weights_load(
    run_config, wan21_checkpoint, tmp_path, monkeypatch):
  """MaxDiffusion loads the weights through JAX's CPU device and calibrate measures each layer
  through host callbacks, which JAX runs there: JAX_PLATFORMS=tpu (as a TPU VM may set it) is
  refused in the pre-flight, naming the fix."""
  monkeypatch.setenv("JAX_PLATFORMS", "tpu")
  with pytest.raises(ValueError, match=r"^JAX_PLATFORMS=tpu leaves out cpu, where MaxDiffusion "
                                       r"loads the checkpoint's weights .*: set "
                                       r"JAX_PLATFORMS=tpu,cpu, or unset it$"):
    calibrate.plan_calibration(run_config, _overrides(wan21_checkpoint),
                               str(tmp_path / "out.yml"), ladder=LADDER)
  monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")
  calibrate.plan_calibration(run_config, _overrides(wan21_checkpoint), str(tmp_path / "out.yml"),
                             ladder=LADDER)


@pytest.fixture(scope="module")
def dense_video(wan21_checkpoint, run_config, tmp_path_factory):
  """The tiny checkpoint's dense video, which both calibrated runs are judged against."""
  video, _ = launch(tmp_path_factory.mktemp("dense"),
                    [run_config, *_overrides(wan21_checkpoint), "attention=dot_product"])
  return video


@pytest.fixture(scope="module")
def calibrated(wan21_checkpoint, run_config, tmp_path_factory):
  out = tmp_path_factory.mktemp("calibrate") / "calibrated.yml"
  prompts = out.parent / "prompts.txt"  # the second is held out: measured, not fitted
  prompts.write_text("a red fox runs through snow\na lighthouse at dusk, waves breaking\n")
  plan = calibrate.plan_calibration(run_config, _overrides(wan21_checkpoint), str(out),
                                    prompts=str(prompts), ladder=LADDER)
  messages = []
  report, uniform = calibrate.run_calibration(plan, log=messages.append)
  return plan, report, out, messages, uniform


def test_each_layer_is_measured_and_the_budget_held(calibrated):
  plan, report, out, messages, _ = calibrated
  model = report["experts"]["None"]
  assert model["layers"] == LAYERS and model["measured"] == [0, 1]
  uniform = SVG_KEYS["svg_density"]  # the config's compensation: off
  assert model["uniform"] == f"{uniform:g}"
  assert model["rungs"] == [f"{d:g}{c}" for d in sorted({*LADDER, uniform})
                            for c in ("", "+compensation")]
  assert model["tiles"] <= model["uniform_tiles"]
  assert model["error"] <= model["uniform_error"] + 1e-12
  assert len(model["densities"]) == LAYERS and set(model["densities"]) <= {*LADDER, uniform}
  assert len(model["compensation"]) == LAYERS and {*model["compensation"]} <= {False, True}
  errors = np.asarray(model["errors"])
  plain, compensated = errors[:, 0::2], errors[:, 1::2]
  assert (plain[:, -1] < 1e-6).all() and (compensated[:, -1] < 1e-6).all()  # density 1: dense
  assert (np.diff(plain, axis=1) <= 1e-9).all()  # more tiles, no more error
  assert (np.diff(compensated, axis=1) <= 1e-9).all()
  costs = np.asarray(model["costs"])
  assert (costs[1::2] >= costs[0::2]).all() and costs[-1] == costs[-2]  # row keys cost
  assert any("step" in m for m in messages) and any("prompt 1 of 2" in m for m in messages)
  assert any("prompt 2 of 2 (held out: measured, not fitted)" in m for m in messages)
  assert plan.fitted == plan.prompts[:1] and report["held_out"] == 1
  held = model["held_out"]  # the fitted choice on the other prompt's calls
  assert held["prompts"] == 1 and len(held["errors"]) == len(held["uniform_errors"]) == LAYERS
  assert held["error"] == pytest.approx(sum(held["errors"]))
  assert held["errors"] != [row[j] for row, j in zip(model["errors"], model["choice"])]
  assert held["broke"] == [] or all(b["loss_db"] > 3 for b in held["broke"])
  assert str(out) == report["overlay"]
  text = calibrate.format_calibration(report)
  assert "cost per head (key tiles, with compensation's row keys)" in text and str(out) in text
  assert "temporal heads" in text  # the layouts each layer's heads took at its rung
  assert "held out (1 prompt(s), not fitted): total error" in text
  assert "dB vs uniform per layer: 0 " in text and ("guard held" in text or "guard broken" in text)
  share = np.asarray(model["temporal_share"])
  assert share.shape == errors.shape and ((share >= 0) & (share <= 1)).all()
  assert model["chosen_temporal_share"] == [share[i, j] for i, j in enumerate(model["choice"])]
  del plan


def test_the_overlay_round_trips_through_maxdiffusions_pyconfig(calibrated, wan21_checkpoint,
                                                                tmp_path):
  from maxdiffusion import pyconfig  # pylint: disable=import-outside-toplevel
  _, report, out, _, _ = calibrated
  written = yaml.safe_load(out.read_text())
  assert written["svg_layer_densities"] == report["experts"]["None"]["densities"]
  assert written["svg_layer_compensation"] == report["experts"]["None"]["compensation"]
  argv = launcher.prepare_argv(["generate", str(out), *_overrides(wan21_checkpoint)],
                               str(tmp_path))[0]
  pyconfig.initialize(argv, unittest=True)
  keys = pyconfig.config.get_keys()
  settings = PluginSettings.from_mapping(keys)
  assert settings.svg.layer_densities == tuple(report["experts"]["None"]["densities"])
  assert settings.svg.layer_compensation == tuple(report["experts"]["None"]["compensation"])
  assert settings.svg.density == SVG_KEYS["svg_density"]  # the chain to the config is kept


def test_the_overlay_refuses_a_run_on_another_checkpoint_or_video_by_name(
    calibrated, wan21_checkpoint, tmp_path):
  """It records what it was measured on; the run's own checks (the launcher's, here) compare,
  and svg_calibration_check=false runs it anyway."""
  _, report, out, _, _ = calibrated
  recorded = yaml.safe_load(out.read_text())["svg_calibrated_on"]
  assert recorded == report["calibrated_on"] == {
      "pretrained_model_name_or_path": str(pathlib.Path(wan21_checkpoint).resolve()),
      "height": 128, "width": 128, "num_frames": 33, "num_inference_steps": STEPS,
      "svg_dense_kernel": "", "prompts": 2}
  same = _overrides(wan21_checkpoint)
  launcher.checked_config(["generate", str(out), *same])
  other = tmp_path / "other"
  shutil.copytree(wan21_checkpoint, other)
  for change, needle in ((f"pretrained_model_name_or_path={other}",
                          f"measured with pretrained_model_name_or_path "
                          f"'{pathlib.Path(wan21_checkpoint).resolve()}', and this run has "
                          f"pretrained_model_name_or_path '{other}'"),
                         ("height=256", "measured with height 128, and this run has height 256")):
    with pytest.raises(ValueError, match=re.escape(needle)):
      launcher.checked_config(["generate", str(out), *same, change])
    launcher.checked_config(["generate", str(out), *same, change, "svg_calibration_check=false"])
  assert "svg_calibrated_on" in out.read_text().split("\n", 3)[1]  # the header says so


def test_the_calibrated_run_is_no_further_from_dense(calibrated, wan21_checkpoint, dense_video,
                                                     tmp_path):
  _, report, out, _, uniform = calibrated  # the calibration's own run: the uniform density's
  common, dense = _overrides(wan21_checkpoint), dense_video
  (tmp_path / "calibrated").mkdir()
  video, log = launch(tmp_path / "calibrated", [str(out), *common])
  densities = report["experts"]["None"]["densities"]
  rungs = list(zip(densities, report["experts"]["None"]["compensation"]))
  sparse = [r for r in log if r["kind"] == "self" and r["sparse"]]
  assert {(r["layer"], (r["density"], r["compensation"])) for r in sparse} == set(enumerate(rungs))
  assert len(sparse) >= LAYERS * (STEPS - 1)
  calibrated_db, uniform_db = wan_e2e.psnr(video, dense), wan_e2e.psnr(uniform, dense)
  print(f"tiny Wan 2.1: calibrated {rungs} {calibrated_db:.2f} dB, uniform "
        f"{SVG_KEYS['svg_density']} {uniform_db:.2f} dB against dense")
  assert calibrated_db >= uniform_db - 1e-9


def test_a_matched_run_is_priced_against_fixed_m_on_a_tpu():
  """What --match-uniform prints on a v6e: the run at the overlay's per-layer densities and at
  the uniform one, each as `tiles` prices it (work and the bound against fixed-m)."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plan.target import tpu_target
  from maxdiffusion_svg.plugin import overlay
  from maxdiffusion_svg.plugin.estimate import estimate_config
  from tiny_runs import ROOT
  # pylint: enable=import-outside-toplevel
  keys, _ = overlay.load_config(ROOT / "configs" / "wan_svg.yml")
  v6e = tpu_target("v6e")
  cheaper = {"svg_layer_densities": [0.2] * 40, "base_config": "ignored"}
  priced = calibrate.priced_runs(keys, cheaper, v6e, layers=40)
  assert priced["priced"]
  want = estimate_config({**keys, "svg_layer_densities": [0.2] * 40}, v6e, layers=40)["combined"]
  assert priced["calibrated"]["work_vs_dense"] == pytest.approx(want["work_vs_dense"])
  assert priced["calibrated"]["vs_fixed_m"] == want["vs_fixed_m"]
  mine, uniform = priced["calibrated"]["vs_fixed_m"], priced["uniform"]["vs_fixed_m"]
  assert mine["fixed"]["bound"] > uniform["fixed"]["bound"] > 1
  report = {"overlay": "/x/matched.yml", "matched": priced,
            "experts": {"None": {"tiles": 80.0, "uniform_tiles": 100.0}}}
  line = calibrate._matched_line(report)  # pylint: disable=protected-access
  assert line.startswith("at uniform's measured error (--match-uniform): 80 key tiles per head "
                         "against uniform's 100 (20.0% fewer)")
  assert (f"against ulysses_custom_fixed_m on {priced['target']} at most "
          f"{mine['fixed']['bound']:.2f}x (uniform {uniform['fixed']['bound']:.2f}x") in line


@pytest.mark.full  # one more generation; the allocation's rule is tested in tests/budgets
def test_match_uniform_spends_fewer_tiles_at_uniforms_error_from_the_command_line(
    wan21_checkpoint, run_config, tmp_path, capsys):
  """``calibrate --match-uniform`` through the CLI: the fewest tiles whose measured error is
  the uniform density's, the tiles saved and the run's work printed, and why it is not priced
  against fixed-m here (a CPU's devices, the XLA executor)."""
  import json  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.cli.main import main  # pylint: disable=import-outside-toplevel
  out, report_path = tmp_path / "matched.yml", tmp_path / "matched.json"
  code = main(["calibrate", str(run_config), *_overrides(wan21_checkpoint), "--out", str(out),
               "--ladder", ",".join(map(str, LADDER)), "--match-uniform", "--json",
               str(report_path)])
  text = capsys.readouterr().out
  assert code == 0 and out.is_file()
  report = json.loads(report_path.read_text())
  model, matched = report["experts"]["None"], report["matched"]
  assert model["error"] <= model["uniform_error"] + 1e-12
  assert model["tiles"] <= model["uniform_tiles"]
  saved = 1 - model["tiles"] / model["uniform_tiles"]
  assert (f"at uniform's measured error (--match-uniform): {model['tiles']:.0f} key tiles per "
          f"head against uniform's {model['uniform_tiles']:.0f} ({saved:.1%} fewer)") in text
  # the run's self-attention work over its steps and layers, from the overlay; no static
  # schedule prices the XLA executor on a CPU
  assert matched["calibrated"]["work_vs_dense"] <= matched["uniform"]["work_vs_dense"] + 1e-9
  assert not matched["priced"] and "no static-schedule figures for xla" in matched["why"]
  assert (f"self-attention work vs dense over the run {matched['calibrated']['work_vs_dense']:.3f}"
          in text and "not priced against ulysses_custom_fixed_m" in text)


@pytest.mark.full  # a second checkpoint and two more generations
def test_wan22_calibrates_each_expert_and_runs_each_ones_densities(tmp_path):
  """Wan 2.2's two experts in one run: each its own layers' errors over the steps it runs, its
  own key in the overlay, and each expert's calls at its own densities."""
  from maxdiffusion_svg.testing import tiny_checkpoint  # pylint: disable=import-outside-toplevel
  from tiny_runs import ROOT  # pylint: disable=import-outside-toplevel
  checkpoint = tiny_checkpoint.write_wan22(str(tmp_path / "wan22"))
  config = tmp_path / "tiny_wan22.yml"
  config.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan22_svg.yml"),
                                    **SVG_KEYS}))
  # every step sparse: the high-noise expert runs the first of the three
  common = [f"pretrained_model_name_or_path={checkpoint}", "flow_shift=3.0", *TINY, *ACTIVE,
            "svg_active_steps=[0, -1]"]
  out = tmp_path / "calibrated.yml"
  plan = calibrate.plan_calibration(str(config), common, str(out), ladder=LADDER)
  report, _ = calibrate.run_calibration(plan, log=lambda _: None)
  assert set(report["experts"]) == {"high_noise", "low_noise"}
  written = yaml.safe_load(out.read_text())
  for expert in ("high_noise", "low_noise"):
    result = report["experts"][expert]
    assert result["uniform"] in ("0.5", "0.2") and result["tiles"] <= result["uniform_tiles"]
    assert written[f"svg_{expert}_layer_densities"] == result["densities"]
    assert written[f"svg_{expert}_layer_compensation"] == result["compensation"]
  (tmp_path / "run").mkdir()
  _, log = launch(tmp_path / "run", [str(out), *common])
  seen = {(r["expert"], r["layer"], r["density"], r["compensation"]) for r in log
          if r["kind"] == "self" and r["sparse"]}
  assert seen == {(expert, layer, density, on) for expert in ("high_noise", "low_noise")
                  for layer, (density, on) in enumerate(zip(report["experts"][expert]["densities"],
                                                            report["experts"][expert]["compensation"]))}


# CI time: the per-layer calibration above takes the same on-device measurement (each head's
# errors and power are in every entry); the per-head allocation is tested in tests/budgets.
@pytest.mark.full
def test_per_head_calibration_writes_head_densities_that_the_run_uses(
    wan21_checkpoint, run_config, calibrated, dense_video, tmp_path):
  """``--per-head``: each head's error measured through generate_wan, layers x heads allocated
  within the uniform density's tiles, ``svg_head_densities`` written; MaxDiffusion's pyconfig
  reads the overlay, and the run's calls run each layer's heads (the call log's density is
  their mean) no further from dense than the uniform run."""
  from maxdiffusion import pyconfig  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.testing.tiny_wan import HEADS  # pylint: disable=import-outside-toplevel
  out = tmp_path / "heads.yml"
  plan = calibrate.plan_calibration(run_config, _overrides(wan21_checkpoint), str(out),
                                    ladder=LADDER, per_head=True)
  assert plan.compensation == "config" and not plan.per_layer_compensation
  report, _ = calibrate.run_calibration(plan, log=lambda _: None)
  model = report["experts"]["None"]
  rows = model["head_densities"]
  assert model["per_head"] and len(rows) == LAYERS and all(len(r) == HEADS for r in rows)
  assert {d for row in rows for d in row} <= {*LADDER, SVG_KEYS["svg_density"]}
  assert model["tiles"] <= model["uniform_tiles"] + 1e-9
  assert model["error"] <= model["uniform_error"] + 1e-12
  assert "per-head densities" in calibrate.format_calibration(report)
  written = yaml.safe_load(out.read_text())
  assert written["svg_head_densities"] == rows and "svg_layer_densities" not in written
  argv = launcher.prepare_argv(["generate", str(out), *_overrides(wan21_checkpoint)],
                               str(tmp_path))[0]
  pyconfig.initialize(argv, unittest=True)
  settings = PluginSettings.from_mapping(pyconfig.config.get_keys())
  assert settings.svg.head_densities == tuple(map(tuple, rows))
  common, dense = _overrides(wan21_checkpoint), dense_video
  (tmp_path / "heads").mkdir()
  video, log = launch(tmp_path / "heads", [str(out), *common])
  means = [round(float(np.mean(row)), 6) for row in rows]
  sparse = [r for r in log if r["kind"] == "self" and r["sparse"]]
  assert {(r["layer"], r["density"]) for r in sparse} == set(enumerate(means))
  uniform = calibrated[4]
  assert wan_e2e.psnr(video, dense) >= wan_e2e.psnr(uniform, dense) - 1e-9
  with pytest.raises(ValueError, match="--per-head calibrates densities at the config's"):
    calibrate.plan_calibration(run_config, _overrides(wan21_checkpoint), str(out),
                               ladder=LADDER, per_head=True, compensation="both")
