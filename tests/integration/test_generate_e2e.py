"""End to end, offline, on CPU: a tiny random Wan 2.1 checkpoint generated through the launcher,
through a patched ``python -m maxdiffusion.generate`` and the patched stock ``generate_wan``.
(Wan 2.2, I2V and the patch's config merging and plugin loading have modules of their own.)"""

import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.bench import wan_e2e
from tiny_runs import ROOT, STEPS, SVG_KEYS, TINY, launch

@pytest.fixture(scope="module")
def checkpoints(wan21_checkpoint):
  return {"wan21": wan21_checkpoint}


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
  """A config that extends the shipped 1.3B one (a chain: run -> wan_svg_1_3b -> MaxDiffusion's)."""
  path = tmp_path_factory.mktemp("config") / "tiny_svg.yml"
  path.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan_svg_1_3b.yml"),
                                  **SVG_KEYS}))
  return str(path)


@pytest.fixture(scope="module")
def dense_video(checkpoints, run_config, tmp_path_factory):
  video, _ = launch(tmp_path_factory.mktemp("dense"), [
      run_config, f"pretrained_model_name_or_path={checkpoints['wan21']}",
      "attention=dot_product", *TINY])
  return video


def test_density_one_gives_the_dense_video(checkpoints, run_config, dense_video, tmp_path):
  video, log = launch(tmp_path, [
      run_config, f"pretrained_model_name_or_path={checkpoints['wan21']}", "svg_density=1.0",
      *TINY])
  assert video.shape == dense_video.shape == (33, 128, 128, 3) and video.dtype == np.uint8
  diff = np.abs(video.astype(int) - dense_video.astype(int))
  assert diff.max() <= 1 and diff.mean() < 1e-3, (diff.max(), diff.mean())  # rounding only
  assert any(r["sparse"] for r in log)


@pytest.mark.parametrize("density", [1.0, pytest.param(0.3, marks=pytest.mark.full)])
def test_semantic_heads_through_generate_wan(checkpoints, run_config, dense_video, tmp_path,
                                             density):
  """Every head forced semantic (its clusters, order and tile table, warm from step to step):
  at density 1 its tables visit every tile and the video is the dense one; sparse, it differs
  and stays finite."""
  video, log = launch(tmp_path, [
      run_config, f"pretrained_model_name_or_path={checkpoints['wan21']}",
      f"svg_density={density}", "svg_layouts=[semantic]", "svg_semantic_clusters=8",
      "svg_semantic_warm_iterations=1", *TINY])
  sparse = [r for r in log if r["kind"] == "self" and r["sparse"]][-(STEPS - 1):]  # the run's
  assert [r["warm"] for r in sparse] == [False] + [True] * (STEPS - 2)  # layer 1, steps 1, 2
  diff = np.abs(video.astype(int) - dense_video.astype(int))
  if density == 1.0:
    assert diff.max() <= 1 and diff.mean() < 1e-3, (diff.max(), diff.mean())  # rounding only
  else:
    quality = wan_e2e.psnr(video, dense_video)
    print(f"tiny Wan 2.1, every head semantic, density 0.3: video PSNR {quality:.1f} dB")
    assert 15 < quality < 80 and np.isfinite(video).all()


@pytest.fixture(scope="module")
def sparse_run(checkpoints, run_config, tmp_path_factory):
  """The launcher at density 0.3: its frames, its MP4 and its call log."""
  workdir = tmp_path_factory.mktemp("sparse")
  video, log = launch(workdir, [
      run_config, f"pretrained_model_name_or_path={checkpoints['wan21']}", "svg_density=0.3",
      *TINY])
  (mp4,) = workdir.glob("wan_output_*.mp4")
  return video, mp4.read_bytes(), log


def test_sparse_video_follows_the_schedule(sparse_run, dense_video):
  video, _, log = sparse_run
  self_calls = [(r["step"], r["layer"], r["sparse"]) for r in log if r["kind"] == "self"]
  # generate_wan's 2-step warm-up, then the run: sparse from step 1 in layer 1 (the config's keys).
  assert self_calls[-2 * STEPS:] == [(s, l, s >= 1 and l >= 1) for s in range(STEPS)
                                     for l in range(2)]
  assert sum(r["kind"] == "cross" for r in log) == len(self_calls)
  quality = wan_e2e.psnr(video, dense_video)
  print(f"tiny Wan 2.1, density 0.3, steps [1, {STEPS}) x layer 1 sparse: video PSNR "
        f"{quality:.1f} dB against dense")
  assert 20 < quality < 80  # really sparse, and still the same video


def test_an_unknown_svg_key_fails_before_weights_load(checkpoints, tmp_path, monkeypatch):
  config = tmp_path / "typo.yml"
  config.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan_svg_1_3b.yml"),
                                    "svg_densty": 0.3}))
  from maxdiffusion.pipelines.wan import wan_pipeline  # pylint: disable=import-outside-toplevel
  loaded = []
  monkeypatch.setattr(wan_pipeline, "load_wan_transformer", lambda *a, **k: loaded.append(1))
  with pytest.raises(ValueError, match="unknown SVG config key.*svg_densty"):
    launch(tmp_path, [
        str(config), f"pretrained_model_name_or_path={checkpoints['wan21']}", *TINY])
  assert not loaded


@pytest.mark.parametrize("module, config", [
    ("maxdiffusion.generate", "chained"),  # the config alone, through the patched generate
    pytest.param("maxdiffusion.generate_wan", "chained",  # the stock entry point, plugins loaded
                 marks=pytest.mark.full),  # the other two run the same path, in the CI tier
    pytest.param("maxdiffusion.generate_wan", "base",  # MaxDiffusion's own YAML, attention=svg
                 marks=pytest.mark.full),  # CI time: the chained run above takes the same path
])
def test_patched_maxdiffusion_runs_the_config_alone(module, config, patched_maxdiffusion,
                                                    checkpoints, run_config, sparse_run, tmp_path):
  env = {**os.environ, "PYTHONPATH": str(patched_maxdiffusion / "src"), "HF_HUB_OFFLINE": "1",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  if config == "chained":
    argv = [run_config, "svg_density=0.3", *TINY]
  else:  # every svg_* key at its default; the base has no svg keys to override
    base = patched_maxdiffusion / "src" / "maxdiffusion" / "configs" / "base_wan_14b.yml"
    argv = [str(base), "attention=svg", "per_device_batch_size=0.125",
            *(a for a in TINY if not a.startswith("svg_"))]
  result = subprocess.run(
      [sys.executable, "-m", module, *argv,
       f"pretrained_model_name_or_path={checkpoints['wan21']}"],
      cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  log = result.stdout + result.stderr
  assert "maxdiffusion_svg: transformer: SVG attention: preset moderate, density 0.3" in \
      log  # the entry point registered the plugin
  # After the real call (3 steps): the calls the kernel counted, not the schedule's.
  if config == "chained":  # svg_active_steps [1, end) and layers [1, end) of 2
    assert ("maxdiffusion_svg: run summary: 3 steps x 2 layers: 6 self-attention calls, 2 sparse "
            "and 4 dense (counted); temporal heads ") in log
  else:  # every svg_* key at its default: 576 tokens run dense
    assert ("maxdiffusion_svg: run summary: 3 steps x 2 layers: 6 self-attention calls, 0 sparse "
            "and 6 dense (from the schedule, not counted (576 tokens is below "
            "svg_min_seq_length 4096: all dense))") in log
  assert "; kernel svg on xla, aligned tiles " in log and " s per step (denoising " in log
  (mp4,) = tmp_path.glob("wan_output_*.mp4")
  if config == "chained":  # the same video as through the launcher
    assert mp4.read_bytes() == sparse_run[1]
  else:
    import imageio.v3 as iio  # pylint: disable=import-outside-toplevel
    assert iio.imread(mp4).shape[:3] == (33, 128, 128)
