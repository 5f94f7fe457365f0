"""``bench step --on-chip``'s path on this host's CPU (no TPU: no speed figure): MaxDiffusion's
Wan built by its own pipeline with random weights and the plugin's hook, the forward called as
a run calls it, svg's sparse and dense steps picked by the timestep; the clock faked so the
figures can be checked, the real one once so each program truly runs."""

import pytest
from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.bench import step_chip
from maxdiffusion_svg.bench.wan_aot import WAN_1_3B

TINY = {**WAN_1_3B, "num_attention_heads": 2, "ffn_dim": 256, "num_layers": 2, "text_dim": 64}


@pytest.fixture(autouse=True)
def tiny_case(monkeypatch):
  cases = {**step_chip.CASES,
           "tiny": step_chip.StepCase("tiny", "configs/wan_svg_1_3b.yml", 128, 128, frames=17)}
  monkeypatch.setattr(step_chip, "CASES", cases)


def test_each_program_runs_and_the_figures_follow_from_the_clock():
  calls = []

  def clock(fn, repeats):  # each program's points in order: 2 s for a dense kernel's step
    out = fn()
    noise = out[0] if isinstance(out, tuple) else out
    assert noise.shape[-3:] == (5, 16, 16)  # the guided noise, at the latent's grid
    calls.append(repeats)
    return 9.0, {0: 2.0, 1: 1.0, 2: 2.1}[len(calls) - 1]

  cfg = step_chip.StepBenchConfig(cases=("tiny",), kernels=("dot_product",),
                                  presets=("aggressive",), repeats=3)
  result = step_chip.run_step_chip(cfg, clock=clock, log=lambda _: None, architecture=TINY)
  assert calls == [3, 3, 3]  # dot_product's step; svg's sparse, then dense step
  svg = next(r for r in result["rows"] if r["kernel"] == "svg")
  assert "preset aggressive" in svg["svg"] and svg["steps"] == 30
  assert svg["sparse_steps"] == 27  # aggressive: the first 10% of 30 steps dense
  f = result["cases"]["tiny"]["presets"]["aggressive"]
  assert f["run_s"] == pytest.approx(27 * 1.0 + 3 * 2.1)
  assert f["run_speedup"] == pytest.approx(30 * 2.0 / (27 * 1.0 + 3 * 2.1))
  assert "not a TPU" in result["kind"]
  assert svg["run_summary"].startswith("counted")  # its callbacks are in the timed step
  assert "tiny" in step_chip.format_step_chip(result)
  assert "callbacks not in the step" not in step_chip.format_step_chip(result)


def test_a_step_without_the_run_summarys_callbacks_says_so(monkeypatch):
  """Timed where the run summary's callbacks are left out (here svg_run_summary: false; on a
  chip, a process without JAX's CPU device), the step is labelled so."""
  build = step_chip.build_model
  monkeypatch.setattr(step_chip, "build_model", lambda config, kernel, overrides, *a: build(
      config, kernel, {**overrides, "svg_run_summary": False}, *a))
  cfg = step_chip.StepBenchConfig(cases=("tiny",), kernels=(), presets=("aggressive",), repeats=1)

  def clock(fn, repeats):  # each program runs once; its figures are not checked here
    fn()
    return 1.0, 1.0

  result = step_chip.run_step_chip(cfg, clock=clock, log=lambda _: None, architecture=TINY)
  (row,) = result["rows"]
  assert row["run_summary"] == "svg_run_summary: false"
  assert ("run summary's callbacks not in the step: svg_run_summary: false"
          in step_chip.format_step_chip(result))


def test_the_real_clock_times_each_step():
  cfg = step_chip.StepBenchConfig(cases=("tiny",), kernels=(), presets=("moderate",), repeats=1)
  result = step_chip.run_step_chip(cfg, log=lambda _: None, architecture=TINY)
  (row,) = result["rows"]
  assert row["sparse_step_s"] > 0 and row["dense_step_s"] > 0
