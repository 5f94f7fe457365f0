"""The svg kernel inside a tiny random Wan Animate transformer built the pipeline's way: the
blocks' self-attention sparse over the reference slot and the segment's frames, text and image
cross-attention dense, through the forward and WanAnimatePipeline's segments."""

import jax
import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg import plugin
from maxdiffusion_svg.kernels import dense_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.testing import tiny_animate
from model_checks import (EVERYTHING, CachedForward, FamilyBattery, assert_calls_are_svg,
                          assert_close, rel, summary_lines)
FRAMES, HEIGHT, WIDTH = tiny_animate.LATENT
GRID = VideoGrid(FRAMES, HEIGHT // 2, WIDTH // 2)  # the reference slot + 3 frames, patch 1x2x2
LAYERS = 2


@pytest.fixture(scope="module", autouse=True)
def registered():
  plugin.register()


def _forward(model, mesh, config):
  x = tiny_animate.inputs(batch=2)  # batch 2, as with CFG
  return tiny_animate.forward(model, mesh, config, x["latents"], x["reference"], x["pose"],
                              x["face"], x["text"], x["image"], 500)


FORWARD = CachedForward(tiny_animate, _forward)
build, forward = FORWARD.build, FORWARD


class TestWanAnimate(FamilyBattery):
  """The battery on the (1 + 3)-frame grid: the first-frame sink is the reference slot; text
  and image cross-attention run dense."""

  forward, grid, layers, other_calls = FORWARD, GRID, LAYERS, {"cross": 2 * LAYERS}


@pytest.mark.full
def test_dense_frames_run_the_reference_slots_queries_dense(tmp_path_factory):
  """svg_dense_frames 1 from the config reaches every call: each is the library's SVG with the
  reference slot's rows dense (those rows equal dense attention's), and the model's output moves."""
  sink, _ = forward(tmp_path_factory, 1, "svg", svg_density=0.3, **EVERYTHING)
  both, log = forward(tmp_path_factory, 1, "svg", svg_density=0.3, svg_dense_frames=1,
                      **EVERYTHING)
  assert rel(both, sink) > 1e-4
  assert_calls_are_svg(log, GRID, 0.3, svg_dense_frames=1)
  for record in (r for r in log if r["kind"] == "self"):
    q, k, v, out = record["qkv_out"]
    rows = GRID.frame_size
    assert_close(out[:, :, :rows], np.asarray(dense_attention(q, k, v))[:, :, :rows])


def test_segments_restart_the_schedule_with_one_compile_and_count_their_calls(
    tmp_path_factory, traced_kernels, capsys):
  """WanAnimatePipeline's own segments, each restarting the schedule (its transformer is split
  before a segment sets its timesteps: the run's schedule is written before the call): steps
  1.. sparse and layer 0 dense in both segments, one trace per call site for two runs, and the
  run summary's counts (model_name wan2.2, one transformer: no expert)."""
  config, mesh, model = build(tmp_path_factory, 8, "svg", svg_density=0.3,
                              svg_active_steps=[1, None], svg_active_layers=[1, None])
  assert model.svg_expert is None
  pipe = tiny_animate.pipeline(config, mesh, model)
  text = tiny_animate.inputs(batch=1)["text"]
  with plugin.record_calls() as log:
    first = tiny_animate.generate(pipe, 3, text, segments=2)
    jax.effects_barrier()
    calls, traces = len(log), len(traced_kernels)
    second = tiny_animate.generate(pipe, 3, text, segments=2)
    jax.effects_barrier()
  selfs = [(r["step"], r["layer"], r["sparse"]) for r in log[:calls] if r["kind"] == "self"]
  one_segment = [(s, l, s >= 1 and l >= 1) for s in range(3) for l in range(LAYERS)]
  assert sorted(selfs) == sorted(one_segment * 2)
  assert traces == len(traced_kernels), traced_kernels  # the second run compiled nothing
  np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
  lines = summary_lines(capsys)
  assert len(lines) == 2 and all(
      "run summary: 3 steps x 2 layers x 2 segments: 12 self-attention calls, 4 sparse and 8 "
      "dense (counted)" in line and line.endswith(
          "; other attention calls dense: 24 cross (cross-attention runs svg_dense_kernel)")
      for line in lines), lines
