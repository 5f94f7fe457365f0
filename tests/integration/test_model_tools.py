"""``compare`` and ``calibrate`` on LTX-2 (``generate_ltx2``), Wan Animate
(``generate_wan_animate``) and Wan VACE (our ``generate_vace`` over MaxDiffusion's VACE
pipeline), each main run for real on a tiny random model: the weights build once, each run is
the kernel it names, the figures recompute from the videos the mains exported, and calibration
measures every sparse call of every segment."""

import contextlib
import json
import math
import pathlib

import jax
import numpy as np
import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg import plugin
from maxdiffusion_svg.plugin import calibrate, compare
from maxdiffusion_svg.plugin.settings import PluginSettings
from maxdiffusion_svg.testing import tiny_animate, tiny_ltx2, tiny_vace
from tiny_runs import ROOT

STEPS, LAYERS = 2, 2
SVG = {"svg_density": 0.3, "svg_active_steps": [0, None], "svg_active_layers": [0, None]}
COMMON = {"attention": "dot_product", "num_inference_steps": STEPS, "prompt": "a cat",
          "enable_ml_diagnostics": False, "ici_context_parallelism": -1, **SVG}  # 8 devices


def _ltx2(directory):
  return tiny_ltx2, tiny_ltx2.write_config(
      directory, pretrained_model_name_or_path=tiny_ltx2.write_checkpoint(directory),
      num_frames=25, height=256, width=256, fps=24, per_device_batch_size=0.125,  # 1 video
      **COMMON), 1, (25, 256, 256, 3)


def _animate(directory):
  # Two segments of 9 frames sharing one: each segment one run of the schedule.
  return tiny_animate, tiny_animate.write_config(
      directory, pretrained_model_name_or_path=tiny_animate.write_checkpoint(directory),
      num_frames=17, segment_frame_length=9, prev_segment_conditioning_frames=1,
      output_dir=str(directory / "maxdiffusion"), **tiny_animate.write_inputs(directory, 2),
      **COMMON), 2, (17, 128, 128, 3)


def _vace(directory):
  # One reference image (a latent frame in front of the video's 4) and a control video with its
  # mask: the VACE pipeline's three conditions, read from files by our main.
  return tiny_vace, tiny_vace.write_config(
      directory, pretrained_model_name_or_path=tiny_vace.write_checkpoint(directory),
      **tiny_vace.VIDEO, **tiny_vace.write_inputs(directory, control=True),
      vace_conditioning_scale=1.0, **COMMON), 1, (13, 128, 128, 3)


MODELS = {"LTX-2": _ltx2, "Wan Animate": _animate, "Wan VACE": _vace}
_RESULTS = {}


def compared(name, tmp_path_factory):
  """dense (the config's own dot_product), svg at density 1 and the config's svg (0.3, every
  call sparse): the plan, result, videos, the svg kernel's call log, builds, segments, shape."""
  if name not in _RESULTS:
    directory = tmp_path_factory.mktemp(name.replace(" ", "_"))
    tiny, config, segments, shape = MODELS[name](directory)
    plan = compare.plan_comparison(config, [], None, ["1.0", "config"], str(directory / "out"),
                                   lpips=False)
    plugin.register()
    with tiny.generate_main() as builds, plugin.record_calls() as log:
      result, videos = compare.run_comparison(plan, log=lambda m: None)
      jax.effects_barrier()
    _RESULTS[name] = plan, result, videos, list(log), builds, segments, shape, directory
  return _RESULTS[name]


@pytest.mark.parametrize("name", [
    "LTX-2", pytest.param("Wan Animate", marks=pytest.mark.full),
    pytest.param("Wan VACE", marks=pytest.mark.full)])
def test_runs_share_one_build_and_each_runs_its_kernel(name, tmp_path_factory):
  plan, result, videos, log, builds, segments, shape, _ = compared(name, tmp_path_factory)
  assert [r.name for r in plan.runs] == ["dense (dot_product)", "svg density 1", "svg"]
  assert len(builds) == 1  # the pipeline built once, every run on it
  assert result["model"] == name and result["steps"] == STEPS
  assert {k: v.shape for k, v in videos.items()} == {r.name: shape for r in plan.runs}
  # Video self-attention enters the svg kernel only in the svg runs: per run a warm-up and a
  # real call (generate_ltx2 warms up with every step of its scanned loop), each segment
  # STEPS x LAYERS calls, every one sparse.
  self_calls = [r for r in log if r["kind"] == "self"]
  assert len(self_calls) == 2 * 2 * segments * STEPS * LAYERS
  assert all(r["sparse"] for r in self_calls)
  assert sorted({r["density"] for r in self_calls}) == [0.3, 1.0]
  rows = {r["name"]: r for r in result["runs"]}
  for run in ("svg density 1", "svg"):
    assert (rows[run]["sparse_calls"], rows[run]["dense_calls"]) == (
        segments * STEPS * LAYERS, 0)
    assert rows[run]["calls_counted"] and rows[run]["sparse_call_share"] == 1.0
  assert "sparse_calls" not in rows["dense (dot_product)"]
  assert all(r["step_s"] > 0 and math.isfinite(r["step_s"]) for r in rows.values())


@pytest.mark.parametrize("name", [
    "LTX-2", pytest.param("Wan Animate", marks=pytest.mark.full),
    pytest.param("Wan VACE", marks=pytest.mark.full)])
def test_density_one_is_dense_and_the_figures_recompute(name, tmp_path_factory):
  plan, result, videos, _, _, _, shape, directory = compared(name, tmp_path_factory)
  dense, full, sparse = (videos[r.name] for r in plan.runs)
  rows = {r["name"]: r for r in result["runs"]}
  # Every tile runs at density 1: the dense kernel's video up to rounding.
  assert np.abs(full.astype(int) - dense.astype(int)).max() <= 1
  assert rows["svg density 1"]["psnr_db"] > 40
  # At 0.3 the video is its own (random weights attend almost uniformly: it differs little).
  assert (sparse != dense).any() and math.isfinite(rows["svg"]["psnr_db"])
  a, b = sparse.astype(np.float64) / 255, dense.astype(np.float64) / 255
  mse = ((a - b) ** 2).reshape(len(a), -1).mean(axis=1)
  expected = np.mean([math.inf if m == 0 else 10 * math.log10(1 / m) for m in mse])
  assert rows["svg"]["psnr_db"] == pytest.approx(expected, rel=1e-4)
  assert 0 < rows["svg"]["ssim"] <= 1
  written = json.loads((directory / "out" / "compare.json").read_text())
  assert [r["name"] for r in written["runs"]] == list(rows)
  assert (directory / "out" / "side_by_side.mp4").stat().st_size > 0
  for row in written["runs"]:  # each run's MP4 as its main wrote it, in the run's folder
    assert len(row["videos"]) == 1 and row["videos"][0].endswith(".mp4")
  assert shape[0] == len(dense)


@pytest.mark.full
@pytest.mark.parametrize("name", ["LTX-2", "Wan Animate", "Wan VACE"])
def test_calibrate_measures_every_sparse_call_through_the_models_main(name, tmp_path,
                                                                      monkeypatch):
  tiny, config, segments, _ = MODELS[name](tmp_path)
  plan = calibrate.plan_calibration(config, [], str(tmp_path / "overlay.yml"))
  measured = []
  record = calibrate.record_rung_errors

  @contextlib.contextmanager
  def recording(rungs):  # the kernel's measurements, kept for the count below
    with record(rungs) as entries:
      measured.append(entries)
      yield entries

  monkeypatch.setattr(calibrate, "record_rung_errors", recording)
  plugin.register()
  with tiny.generate_main() as builds:
    report, frames = calibrate.run_calibration(plan, log=lambda m: None)
  assert len(builds) == 1 and frames.ndim == 4
  # Warm-up and real call, each segment STEPS x LAYERS sparse calls, each measured once.
  entries = measured[0]
  assert len(entries) == 2 * segments * STEPS * LAYERS
  assert all(np.isfinite(e["errors"]).all() and e["active"] for e in entries)
  assert sorted({e["layer"] for e in entries}) == list(range(LAYERS))
  overlay = (tmp_path / "overlay.yml").read_text()
  assert "svg_layer_densities" in overlay
  keys = yaml.safe_load(overlay)
  densities = keys["svg_layer_densities"]
  assert len(densities) == LAYERS and all(d in [r.density for r in plan.rungs] for d in densities)
  merged = {**plan.keys, **{k: v for k, v in keys.items() if k.startswith("svg_")}}
  assert PluginSettings.from_mapping(merged).svg is not None  # the overlay is a valid config
  assert report["prompts"] == 1


@pytest.mark.full
@pytest.mark.parametrize("name, config, extra", [
    ("LTX-2", "ltx2_svg.yml", []),
    ("LTX-2", "ltx2_svg.yml", ["run_latent_upsampler=true"]),
    ("Wan Animate", "wan_animate_svg.yml", []),
    ("Wan VACE", "wan_vace_svg.yml", [])])
def test_the_shipped_config_generates_through_the_launcher(name, config, extra, tmp_path, capsys,
                                                           monkeypatch):
  """``python -m maxdiffusion_svg.generate configs/CONFIG`` in this process, end to end: the
  model's main loads the tiny checkpoint, denoises under the shipped schedule (moderate: the
  first fifth of the steps and layer 0 dense) and writes its MP4. LTX-2's latent upsampler
  runs after the denoising loop (no attention of its own): the same calls, twice the pixels."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin import generations, launcher
  from maxdiffusion_svg.plugin.video_models import LTX2, WAN_ANIMATE, WAN_VACE
  # pylint: enable=import-outside-toplevel
  tiny, run_config, segments, shape = MODELS[name](tmp_path)
  keys = yaml.safe_load(pathlib.Path(run_config).read_text(encoding="utf-8"))
  steps = 5  # steps 1-4 sparse on layer 1
  overrides = [f"{key}={value}" for key, value in keys.items()
               if key in ("pretrained_model_name_or_path", "num_frames", "height", "width",
                          "per_device_batch_size", "segment_frame_length", "output_dir",
                          "prev_segment_conditioning_frames", "reference_image_path",
                          "pose_video_path", "face_video_path", "weights_dtype",
                          "activations_dtype", "svg_block_q", "svg_block_kv",
                          "svg_min_seq_length", "svg_profile_queries", "svg_backend",
                          "skip_jax_distributed_system", "run_name", "jax_cache_dir",
                          "precision", "flash_min_seq_length", "vace_reference_images",
                          "vace_video", "vace_mask")
               or key.startswith("ici_")]
  overrides += [f"num_inference_steps={steps}", "enable_ml_diagnostics=false", "prompt=a cat",
                *extra]
  if extra:  # upsampled 2x in height and width
    shape = (shape[0], 2 * shape[1], 2 * shape[2], shape[3])
  family = {"LTX-2": LTX2, "Wan Animate": WAN_ANIMATE, "Wan VACE": WAN_VACE}[name]
  monkeypatch.chdir(tmp_path)
  with tiny.generate_main() as builds, \
      generations.GENERATIONS[family].watch(lambda pipeline: None, lambda: None) as seen:
    launcher.run(["maxdiffusion_svg.generate", str(ROOT / "configs" / config), *overrides])
    jax.effects_barrier()
  assert len(builds) == 1 and seen["frames"][-1].shape == shape
  assert list(tmp_path.glob("*.mp4"))  # the main's own export
  calls, sparse = steps * LAYERS * segments, (steps - 1) * (LAYERS - 1) * segments
  lines = [l for l in capsys.readouterr().out.splitlines() if "run summary:" in l]
  # The real call's summary (the last; our VACE main warms up on two steps, as generate_wan).
  assert lines and (f"{calls} self-attention calls, {sparse} sparse and {calls - sparse} "
                    f"dense (counted)" in lines[-1]), lines
  if name == "Wan VACE":  # each control block's self-attention per step, dense by design
    assert f"{2 * steps} vace" in lines[-1] and "2 steps x 2 layers" in lines[0], lines
