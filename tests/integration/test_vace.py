"""The svg kernel inside a tiny random Wan VACE transformer built the pipeline's way: the main
blocks' self-attention sparse over the video and its reference frame, the control blocks'
self-attention and every cross-attention dense, through the forward and VaceWanPipeline2_1."""

import jax
import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg import plugin
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.testing import tiny_vace
from model_checks import CachedForward, FamilyBattery, kinds, summary_lines
_, FRAMES, HEIGHT, WIDTH = tiny_vace.LATENT
GRID = VideoGrid(FRAMES, HEIGHT // 2, WIDTH // 2)  # 1 reference + 4 video frames, patch 1x2x2
LAYERS = 2  # main blocks, each with a control block (vace_layers [0, 1])


@pytest.fixture(scope="module", autouse=True)
def registered():
  plugin.register()


FORWARD = CachedForward(tiny_vace, lambda model, mesh, config: tiny_vace.forward(
    model, mesh, config, *tiny_vace.inputs(batch=2), 500))  # batch 2, as with CFG
build, forward = FORWARD.build, FORWARD


class TestWanVace(FamilyBattery):
  """The battery on the (1 + 4)-frame grid: the first-frame sink is the reference frame; the
  main and control blocks' cross-attention and the control blocks' self-attention run dense."""

  forward, grid, layers = FORWARD, GRID, LAYERS
  other_calls = {"vace": LAYERS, "cross": 2 * LAYERS}


def test_the_pipeline_follows_the_schedule_with_one_compile_and_counts_its_calls(
    tmp_path_factory, traced_kernels, capsys):
  """VaceWanPipeline2_1's own loop with a reference image: steps 1.. sparse and layer 0 dense,
  one trace per call site for two runs, and the run summary's counts."""
  config, mesh, model = build(tmp_path_factory, 8, "svg", svg_density=0.3,
                              svg_active_steps=[1, None], svg_active_layers=[1, None])
  pipe = tiny_vace.pipeline(config, mesh, model)
  _, _, text = tiny_vace.inputs(batch=1)
  with plugin.record_calls() as log:
    first = tiny_vace.generate(pipe, 3, text, guidance_scale=5.0)
    jax.effects_barrier()
    calls, traces = len(log), len(traced_kernels)
    second = tiny_vace.generate(pipe, 3, text, guidance_scale=5.0)
    jax.effects_barrier()
  selfs = sorted((r["step"], r["layer"], r["sparse"]) for r in log[:calls] if r["kind"] == "self")
  assert selfs == [(s, l, s >= 1 and l >= 1) for s in range(3) for l in range(LAYERS)]
  assert kinds(log[:calls]) == {"self": 6, "vace": 6, "cross": 12}
  # Per block, attn1 and attn2 of the main and of the control blocks (unscanned), each traced
  # twice: the loop's first step compiles apart (dot_product's too: 16 traces), whatever the
  # routing; the second run compiles nothing.
  assert traces == len(traced_kernels) == 2 * 4 * LAYERS, traced_kernels
  np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
  lines = summary_lines(capsys)
  assert len(lines) == 2 and all(
      "run summary: 3 steps x 2 layers: 6 self-attention calls, 2 sparse and 4 dense "
      "(counted)" in line and line.endswith(
          "; other attention calls dense: 12 cross, 6 vace (cross-attention and the VACE "
          "control blocks' self-attention runs svg_dense_kernel)") for line in lines), lines
