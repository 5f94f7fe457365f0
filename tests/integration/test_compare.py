"""``compare`` end to end on the tiny checkpoint: weights loaded once, each run the kernel it
names, figures recomputed independently, and what an interrupted comparison keeps."""

import json
import math

import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg import plugin
from maxdiffusion_svg.plugin import compare, hooks
from tiny_runs import STEPS, TINY, launch, write_run_config

LAYERS = 2  # the tiny checkpoint's blocks


@pytest.fixture(scope="module")
def checkpoint(wan21_checkpoint):
  return wan21_checkpoint


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
  return write_run_config(tmp_path_factory.mktemp("config"))


def _overrides(checkpoint):
  return [f"pretrained_model_name_or_path={checkpoint}", *TINY]


@pytest.fixture(scope="module")
def compared(checkpoint, run_config, tmp_path_factory):
  """dense (dot_product), the config's svg, svg at density 1 and the config's svg compensated,
  counting weight loads and recording the svg kernel's calls."""
  import jax  # pylint: disable=import-outside-toplevel
  out = tmp_path_factory.mktemp("compare")
  plan = compare.plan_comparison(run_config, _overrides(checkpoint), "dot_product",
                                 ["config", "1.0", "config+compensation"], str(out),
                                 lpips=False)
  loads, rules = [], {}
  prepare = hooks.prepare_transformer  # the hook calls it once per transformer it builds
  hooks.prepare_transformer = lambda *a, **k: loads.append(1) or prepare(*a, **k)
  set_run = compare.set_run

  def recording(pipeline, run, settings, axis_rules):
    rules.setdefault(run.name, axis_rules)
    set_run(pipeline, run, settings, axis_rules)

  compare.set_run = recording
  try:
    with plugin.record_calls() as log:
      result, videos = compare.run_comparison(plan, log=lambda m: None, progress=True,
                                              quiet=True)
      jax.effects_barrier()
  finally:
    hooks.prepare_transformer, compare.set_run = prepare, set_run
  return plan, result, videos, list(log), loads, out, rules


def test_runs_share_one_load_and_each_runs_its_kernel(compared):
  plan, result, _, log, loads, _, _ = compared
  assert [r.name for r in plan.runs] == ["dense (dot_product)", "svg", "svg density 1",
                                         "svg +compensation"]
  assert len(loads) == 1  # one transformer built: the weights loaded once
  self_calls = [r for r in log if r["kind"] == "self"]
  # The dense run never enters the svg kernel; each svg run makes steps x layers calls in its
  # real call and 2 x layers in generate_wan's 2-step warm-up.
  assert len(self_calls) == 3 * (2 + STEPS) * LAYERS
  sparse = [r for r in self_calls if r["sparse"]]
  assert {(r["step"], r["layer"]) for r in sparse} == {(1, 1), (2, 1)}
  assert {r["density"] for r in sparse} == {0.3, 1.0}  # each run's own settings
  expected_share = (STEPS - 1) * (LAYERS - 1) / (STEPS * LAYERS)
  rows = {r["name"]: r for r in result["runs"]}
  assert rows["svg"]["sparse_call_share"] == pytest.approx(expected_share)
  assert (rows["svg"]["sparse_calls"], rows["svg"]["dense_calls"]) == (2, 4)
  assert rows["svg"]["calls_counted"] and 0 <= rows["svg"]["temporal_head_share"] <= 1
  assert rows["svg"]["density"] == 0.3 and rows["svg density 1"]["density"] == 1.0
  assert "sparse_call_share" not in rows["dense (dot_product)"]
  assert (rows["svg"]["compensation_blocks"], rows["svg +compensation"]["compensation_blocks"]) \
      == (0, 8)
  assert rows["svg +compensation"]["sparse_calls"] == 2
  assert all(r["step_s"] > 0 for r in rows.values())


def test_maxdiffusions_output_goes_to_a_log_and_cpu_seconds_are_marked(compared):
  """Quiet (compare's default): each run's config dump is in maxdiffusion.log, not the output;
  the table says its seconds are a CPU's."""
  _, result, _, _, _, out, _ = compared
  assert result["maxdiffusion_log"] == str(out / "maxdiffusion.log")
  assert (out / "maxdiffusion.log").read_text().count("Config param attention:") >= 1
  text = compare.format_comparison(result)
  assert "on CPU" in text and "speed-up: not meaningful on CPU" in text
  table = text.splitlines()[2:2 + len(result["runs"])]
  assert all(" n/a " in line for line in table), table  # no CPU ratio shown as a speed-up
  rows = {r["name"]: r for r in result["runs"]}
  assert 0 < rows["svg"]["visited_tile_share"] < rows["svg density 1"]["visited_tile_share"] == 1
  assert "maxdiffusion.log (--verbose prints it)" in text


def test_dense_run_is_maxdiffusions_own_and_figures_recompute(compared, checkpoint, run_config,
                                                              tmp_path):
  _, result, videos, _, _, out, _ = compared
  alone, _ = launch(tmp_path, [run_config, *_overrides(checkpoint), "attention=dot_product"])
  dense = videos["dense (dot_product)"]
  assert dense.shape == (33, 128, 128, 3)
  assert np.abs(dense.astype(int) - alone.astype(int)).max() <= 1  # same model, same kernel
  rows = {r["name"]: r for r in result["runs"]}
  assert rows["dense (dot_product)"]["psnr_db"] == math.inf
  assert rows["dense (dot_product)"]["ssim"] == pytest.approx(1.0, abs=1e-6)
  for name in ("svg", "svg density 1"):
    a, b = videos[name].astype(np.float64) / 255, dense.astype(np.float64) / 255
    mse = ((a - b) ** 2).reshape(len(a), -1).mean(axis=1)
    expected = np.mean([math.inf if m == 0 else 10 * math.log10(1 / m) for m in mse])
    assert rows[name]["psnr_db"] == pytest.approx(expected, rel=1e-4)
  # Density 1 is dense up to rounding; the sparse run differs (little: random weights attend
  # almost uniformly, and 2 of its 6 calls are sparse).
  assert np.abs(videos["svg density 1"].astype(int) - dense.astype(int)).max() <= 1
  assert math.isfinite(rows["svg"]["psnr_db"])
  assert rows["svg density 1"]["psnr_db"] > rows["svg"]["psnr_db"]
  assert 0 < rows["svg"]["ssim"] < rows["svg density 1"]["ssim"] <= 1
  # Compensated: the same sparse calls with their skipped tiles' centroids merged in, through
  # generate_wan: a video of its own (not the uncompensated run's, not dense), every frame scored.
  compensated = videos["svg +compensation"]
  assert compensated.shape == dense.shape and (compensated != videos["svg"]).any()
  assert math.isfinite(rows["svg +compensation"]["psnr_db"])
  assert 0 < rows["svg +compensation"]["ssim"] < 1
  written = json.loads((out / "compare.json").read_text())
  assert [r["name"] for r in written["runs"]] == list(rows)
  assert (out / "side_by_side.mp4").stat().st_size > 0
  for row in written["runs"]:
    assert row["videos"] and all(p.endswith(".mp4") for p in row["videos"])


def test_an_interrupted_comparison_keeps_the_finished_runs(checkpoint, run_config, tmp_path,
                                                           monkeypatch):
  # Interrupted at its second run (one finished run is enough to keep; CI time).
  plan = compare.plan_comparison(run_config, _overrides(checkpoint), "dot_product",
                                 ["aggressive"], str(tmp_path), lpips=False)
  set_run = compare.set_run

  def interrupt(pipeline, run, *args):
    if run.name == "svg aggressive":
      raise KeyboardInterrupt
    set_run(pipeline, run, *args)

  monkeypatch.setattr(compare, "set_run", interrupt)
  with pytest.raises(KeyboardInterrupt):
    compare.run_comparison(plan, log=lambda m: None)
  written = json.loads((tmp_path / "compare.json").read_text())
  assert [r["name"] for r in written["runs"]] == ["dense (dot_product)"]
  assert all(p for r in written["runs"] for p in r["videos"])
  assert not (tmp_path / "svg_aggressive").exists() or not list(
      (tmp_path / "svg_aggressive").glob("*.mp4"))


@pytest.mark.parametrize("change, message", [
    ({"dense": "flashy"}, "--dense 'flashy' is not a MaxDiffusion attention kernel; known: "),
    ({"svg": ["fast"]}, "--svg takes config, a preset"),
    ({"svg": ["1.5"]}, "--svg density must be in (0, 1]"),
    ({"svg": ["0.5", "0.5"]}, "--svg names a run twice"),
    ({"svg": ["0.5+comp"]}, "--svg 0.5+comp: after + a run takes compensation"),
    ({"svg": ["config+compensation=0"]}, "compensation=N (N >= 1 centroids per key tile)"),
    ({"svg": ["config+compensation=3", "0.5"], "extra": ["svg_block_kv=256"]},
     "svg_compensation_blocks must divide the key tile svg_block_kv (256), got 3"),
    ({"extra": ["aot_cache_dir=/tmp/aot"]}, "aot_cache_dir is '/tmp/aot'"),
    ({"extra": ["prompt= "]}, "prompt is empty"),
    ({"extra": ["svg_density=0"]}, "svg_density"),
    ({"checkpoint": "/nonexistent/wan"}, "pretrained_model_name_or_path '/nonexistent/wan' is "
                                         "not a checkpoint folder"),
    ({"lpips": True}, "--lpips needs"),
])
def test_bad_input_is_one_line_before_anything_loads(checkpoint, run_config, tmp_path, change,
                                                     message):
  overrides = [f"pretrained_model_name_or_path={change.get('checkpoint', checkpoint)}", *TINY,
               *change.get("extra", [])]
  with pytest.raises(ValueError) as err:
    compare.plan_comparison(run_config, overrides, change.get("dense", "dot_product"),
                            change.get("svg", ["config"]), str(tmp_path),
                            lpips=change.get("lpips", False))
  assert message in str(err.value) and "\n" not in str(err.value)


def test_the_dense_kernel_defaults_to_the_base_configs(run_config):
  # wan_svg_1_3b.yml sets attention: svg over MaxDiffusion's base_wan_1_3b.yml.
  base = compare.base_attention(run_config)
  assert base is not None and base != "svg" and base in compare.dense_kernels()


def test_each_run_gets_the_axis_rules_pyconfig_gives_its_kernel(compared, checkpoint, run_config,
                                                                tmp_path):
  """ulysses kernels keep K/V sequence-sharded (pyconfig's rules for them), where the rules for
  svg leave K/V whole: the dense run must run under its own kernel's rules."""
  *_, rules = compared
  argv = lambda kernel: compare.launcher.prepare_argv(
      ["compare", run_config, *_overrides(checkpoint), f"attention={kernel}"], str(tmp_path))[0]
  svg, dense, ulysses = (compare.axis_rules_for(argv(k)) for k in ("svg", "dot_product", "ulysses"))
  assert rules == {"dense (dot_product)": dense, "svg": svg, "svg density 1": svg,
                   "svg +compensation": svg}
  as_tuples = lambda rules: {tuple(r) for r in rules}
  kv_rule = ("activation_self_attn_kv_length", "context")
  assert kv_rule in as_tuples(ulysses) and kv_rule not in as_tuples(svg)
