"""End to end, offline, on CPU: a tiny random Wan checkpoint generated through the launcher,
through a patched ``python -m maxdiffusion.generate`` and the patched stock ``generate_wan``."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.bench import wan_e2e
from maxdiffusion_svg.plugin import overlay
from maxdiffusion_svg.testing import tiny_checkpoint

ROOT = pathlib.Path(__file__).parent.parent.parent
STEPS = 3
# A 33-frame 128x128 video: a 9x8x8 = 576-token grid; 128-token tiles so SVG has tiles to skip.
TINY = ["height=128", "width=128", "num_frames=33", f"num_inference_steps={STEPS}",
        "max_sequence_length=16", "weights_dtype=float32", "activations_dtype=float32",
        "skip_jax_distributed_system=True", "run_name=tiny", "svg_block_q=128",
        "svg_block_kv=128", "svg_min_seq_length=0"]
# Keys the shipped configs leave to the preset; here so that the command line can set them.
SVG_KEYS = {"svg_density": 0.3, "svg_active_steps": [1, -1], "svg_active_layers": [1, -1],
            "svg_profile_queries": 16}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  base = tmp_path_factory.mktemp("checkpoints")
  return {"wan21": tiny_checkpoint.write_wan21(str(base / "wan21")),
          "wan22": tiny_checkpoint.write_wan22(str(base / "wan22"))}


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
  """A config that extends the shipped 1.3B one (a chain: run -> wan_svg_1_3b -> MaxDiffusion's)."""
  path = tmp_path_factory.mktemp("config") / "tiny_svg.yml"
  path.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan_svg_1_3b.yml"),
                                  **SVG_KEYS}))
  return str(path)


def launch(workdir, argv):
  """The launcher in this process: the frames it exported and the svg kernel's call log."""
  out = wan_e2e.generate(argv, str(workdir))
  return out["frames"], out["log"]


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
    ("maxdiffusion.generate_wan", "chained"),  # the stock Wan entry point, plugins loaded
    ("maxdiffusion.generate_wan", "base"),  # MaxDiffusion's own YAML with attention=svg
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
  assert "maxdiffusion_svg: transformer: SVG attention: preset moderate, density 0.3" in \
      result.stdout + result.stderr  # the entry point registered the plugin
  (mp4,) = tmp_path.glob("wan_output_*.mp4")
  if config == "chained":  # the same video as through the launcher
    assert mp4.read_bytes() == sparse_run[1]
  else:
    import imageio.v3 as iio  # pylint: disable=import-outside-toplevel
    assert iio.imread(mp4).shape[:3] == (33, 128, 128)


def test_patched_pyconfig_merges_as_the_launcher_does(patched_maxdiffusion, tmp_path):
  """Both merge as MaxText's base_config does: top-level keys override (a nested mapping is
  replaced whole); a base is looked up beside the file, then among MaxDiffusion's configs."""
  code = ("import json, sys, yaml\nfrom maxdiffusion import pyconfig\n"
          "path = sys.argv[1]\nwith open(path) as f:\n  raw = yaml.safe_load(f)\n"
          "print(json.dumps(pyconfig._with_base_configs(path, raw)))")
  configs = patched_maxdiffusion / "src" / "maxdiffusion" / "configs"
  nested = tmp_path / "nested.yml"
  nested.write_text(yaml.safe_dump({"base_config": "base_wan_14b.yml", "attention": "svg",
                                    "flash_block_sizes": {"block_q": 1024}}))
  for path, links in [(ROOT / "configs" / "wan_svg.yml", 2),
                      (ROOT / "configs" / "wan_svg_1_3b.yml", 2),
                      (ROOT / "configs" / "wan22_svg.yml", 2),
                      (ROOT / "configs" / "wan_i2v_svg.yml", 2),
                      (ROOT / "configs" / "wan_svg_v6e16.yml", 3), (nested, 2)]:
    result = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(patched_maxdiffusion / "src")})
    merged = json.loads(result.stdout.strip().splitlines()[-1])
    ours, chain = overlay.load_config(path, search_dirs=[configs])
    assert merged == json.loads(json.dumps(ours)) and len(chain) == links
    assert merged["attention"] == "svg" and "logical_axis_rules" in merged
  assert merged["flash_block_sizes"] == {"block_q": 1024}  # not merged into the base's mapping
  assert len(yaml.safe_load((configs / "base_wan_14b.yml").read_text())["flash_block_sizes"]) > 1


def test_wan22_pair_uses_its_two_densities(checkpoints, tmp_path):
  config = tmp_path / "tiny_wan22.yml"
  config.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan22_svg.yml"),
                                    **SVG_KEYS}))
  video, log = launch(tmp_path, [
      str(config), f"pretrained_model_name_or_path={checkpoints['wan22']}", "flow_shift=3.0",
      *TINY])
  densities = {(r["expert"], r["density"]) for r in log if r["kind"] == "self"}
  assert densities == {("high_noise", 0.5), ("low_noise", 0.2)}
  assert video.shape == (33, 128, 128, 3)


def test_wan21_i2v_is_sparse_in_self_attention_and_dense_where_the_image_enters(
    tmp_path_factory, tmp_path):
  """Wan 2.1 I2V through MaxDiffusion's I2V pipeline, from configs/wan_i2v_svg.yml: a tiny CLIP
  image encoder, the image's tokens in cross-attention (their own key/value projections and
  a padding mask), which runs dense; self-attention follows the schedule. At density 1 the
  video is the dense one; at 0.3 it is sparse and close."""
  base = tmp_path_factory.mktemp("i2v")
  checkpoint = tiny_checkpoint.write_wan21_i2v(str(base / "checkpoint"))
  image = tiny_checkpoint.write_image(str(base / "image.png"))
  config = tmp_path / "tiny_i2v.yml"
  config.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan_i2v_svg.yml"),
                                    **SVG_KEYS}))
  common = [str(config), f"pretrained_model_name_or_path={checkpoint}", f"image_url={image}",
            *TINY]
  runs = {}
  for name, extra in (("dense", ["attention=dot_product"]), ("one", ["svg_density=1.0"]),
                      ("sparse", ["svg_density=0.3"])):
    (tmp_path / name).mkdir()
    runs[name] = launch(tmp_path / name, [*common, *extra])
  dense, _ = runs["dense"]
  video, log = runs["sparse"]
  assert video.shape == dense.shape == (33, 128, 128, 3)
  self_calls = [(r["step"], r["layer"], r["sparse"]) for r in log if r["kind"] == "self"]
  assert self_calls[-2 * STEPS:] == [(s, l, s >= 1 and l >= 1) for s in range(STEPS)
                                     for l in range(2)]
  # Each block's cross-attention is two dense calls: the text's and the image's (masked).
  assert sum(r["kind"] == "cross" for r in log) == 2 * len(self_calls)
  diff = np.abs(runs["one"][0].astype(int) - dense.astype(int))
  assert diff.max() <= 1 and diff.mean() < 1e-3, (diff.max(), diff.mean())
  quality = wan_e2e.psnr(video, dense)
  print(f"tiny Wan 2.1 I2V, density 0.3: video PSNR {quality:.1f} dB against dense")
  assert 20 < quality < 80


def test_wan22_i2v_experts_run_their_densities_on_the_image_conditioned_latent(
    tmp_path_factory, tmp_path):
  """Wan 2.2 I2V (the image as latent conditioning, no image encoder) through MaxDiffusion's
  I2V 2.2 pipeline, with a config chained onto MaxDiffusion's base_wan_i2v_27b.yml: both
  experts run, each at its own density, and cross-attention stays dense."""
  base = tmp_path_factory.mktemp("i2v22")
  checkpoint = tiny_checkpoint.write_wan22_i2v(str(base / "checkpoint"))
  image = tiny_checkpoint.write_image(str(base / "image.png"))
  config = tmp_path / "tiny_i2v22.yml"
  config.write_text(yaml.safe_dump({
      "base_config": "base_wan_i2v_27b.yml", "attention": "svg", "svg_high_noise_density": 0.5,
      "svg_low_noise_density": 0.2, "svg_active_steps": [0, -1], "svg_active_layers": [0, -1],
      "svg_profile_queries": 16, "svg_block_q": 128, "svg_block_kv": 128,
      "svg_min_seq_length": 0}))
  video, log = launch(tmp_path, [
      str(config), f"pretrained_model_name_or_path={checkpoint}", f"image_url={image}",
      "flow_shift=3.0", "per_device_batch_size=0.125", "num_inference_steps=4",
      *(a for a in TINY if not a.startswith(("svg_", "num_inference_steps")))])
  assert video.shape == (33, 128, 128, 3)
  densities = {(r["expert"], r["density"]) for r in log if r["kind"] == "self" and r["sparse"]}
  assert densities == {("high_noise", 0.5), ("low_noise", 0.2)}
  # No image tokens in cross-attention here: one dense (text) call per block.
  assert sum(r["kind"] == "cross" for r in log) == sum(r["kind"] == "self" for r in log)


def test_wan22_experts_keep_their_own_executables_with_the_aot_cache(checkpoints, tmp_path,
                                                                     capfd):
  """MaxDiffusion's AOT cache keys an executable by input paths and shapes; the experts differ
  only in a static attribute (their density), so without the plugin's tag the low-noise expert
  ran the high-noise executable. With aot_cache_dir set, a first run (compiling and saving
  each expert's forward) and a second (loading them from disk) equal the run without the
  cache. No call log here: its callbacks would keep the forwards from being serialized."""
  config = tmp_path / "tiny_wan22.yml"
  config.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan22_svg.yml"),
                                    **SVG_KEYS}))
  # One guidance scale for both experts: a different one (a static argument) would key their
  # executables apart by itself and hide the bug.
  argv = [str(config), f"pretrained_model_name_or_path={checkpoints['wan22']}", "flow_shift=3.0",
          "guidance_scale_low=3.5", "guidance_scale_high=3.5", *TINY]
  cache = tmp_path / "aot"

  def run(*extra):
    return wan_e2e.generate([*argv, *extra], str(tmp_path), record=False)["frames"]

  plain = run()
  try:
    first = run(f"aot_cache_dir={cache}")
    capfd.readouterr()
    second = run(f"aot_cache_dir={cache}")
    loaded = capfd.readouterr()
  finally:  # the cache is process-global: later tests must not run from it
    from maxdiffusion import aot_cache  # pylint: disable=import-outside-toplevel
    aot_cache.install("", meta={}, mesh=None)
  forwards = sorted(p.name for p in cache.glob("*transformer_forward_pass*.aotx"))
  assert len(forwards) == 2, sorted(p.name for p in cache.glob("*.aotx"))  # one per expert
  assert sum(f"loaded {name}" in loaded.out + loaded.err for name in forwards) == 2
  np.testing.assert_array_equal(first, plain)
  np.testing.assert_array_equal(second, plain)


PLUGIN_ORDER_SCRIPT = """
import json, sys
from maxdiffusion import max_utils, pyconfig
order = []
real = max_utils.maybe_initialize_jax_distributed_system
def distributed(raw_keys):
  order.append("distributed")
max_utils.maybe_initialize_jax_distributed_system = distributed
import fake_plugin
fake_plugin.ORDER = order
try:
  pyconfig.initialize([None, sys.argv[1], "run_name=order"])
except RuntimeError as e:
  order.append("error: " + str(e))
print(json.dumps(order))
"""


def fake_plugin_dist(folder, behaviour):
  """A package with a ``maxdiffusion.plugins`` entry point, importable from ``folder``."""
  (folder / "fake_plugin.py").write_text(
      "ORDER = []\n"
      "def register():\n"
      f"  {behaviour}\n"
      "  import jax\n"
      "  ORDER.append('plugin: ' + jax.devices()[0].platform)\n", encoding="utf-8")
  info = folder / "fake_plugin-0.1.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugin\nVersion: 0.1\n",
                                 encoding="utf-8")
  (info / "entry_points.txt").write_text(
      "[maxdiffusion.plugins]\nfake = fake_plugin:register\n", encoding="utf-8")


@pytest.mark.parametrize("behaviour, want", [
    ("pass", ["distributed", "plugin: cpu"]),
    ("raise KeyError('boom')", ["distributed", "error: maxdiffusion plugin 'fake' "
                                "(fake_plugin:register, entry point group "
                                "'maxdiffusion.plugins') failed to load: KeyError: 'boom'"]),
])
def test_plugins_load_after_distributed_init_and_errors_name_the_entry_point(
    patched_maxdiffusion, tmp_path, behaviour, want):
  """A plugin that touches a device at load must not start JAX's backends before
  jax.distributed.initialize: in a multi-host job every host would then run alone."""
  fake_plugin_dist(tmp_path, behaviour)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path),
                                                      str(patched_maxdiffusion / "src")])}
  config = patched_maxdiffusion / "src" / "maxdiffusion" / "configs" / "base_wan_14b.yml"
  result = subprocess.run([sys.executable, "-c", PLUGIN_ORDER_SCRIPT, str(config)], env=env,
                          capture_output=True, text=True, check=False, cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  order = json.loads(result.stdout.strip().splitlines()[-1])
  assert order == want
