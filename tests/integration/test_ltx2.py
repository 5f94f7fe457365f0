"""The svg kernel inside a tiny random LTX-2 transformer built the pipeline's way: video
self-attention (each block's attn1) sparse, audio self-attention and every cross-attention
dense, through the forward and through LTX2Pipeline's own denoising loop."""

import jax
import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg import plugin
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.testing import tiny_ltx2
from model_checks import (EVERYTHING, CachedForward, FamilyBattery, assert_close, kinds, rel,
                          summary_lines)

GRID = VideoGrid(*tiny_ltx2.LATENT_GRID)
# Per block through the svg kernel: attn1 (video self-attention, svg), then audio
# self-attention and the two text cross-attentions (dense). The audio<->video
# cross-attentions run their own keys' kernels (a2v/v2a_attention_kernel).
DENSE_PER_LAYER = 3


@pytest.fixture(scope="module", autouse=True)
def registered():
  plugin.register()


def _forward(model, mesh, config):
  """Video and audio output on fixed inputs (batch 2, as with CFG)."""
  latents, audio, text, audio_text = tiny_ltx2.inputs(batch=2)
  return tiny_ltx2.forward(model, mesh, config, latents, audio, text, audio_text, 500.0)


FORWARD = CachedForward(tiny_ltx2, _forward)
build, forward = FORWARD.build, FORWARD


class TestLtx2(FamilyBattery):
  """The battery on the packed video's grid, video and audio outputs: audio self-attention and
  the text cross-attentions run dense (on CPU the dense kernel is the dot_product LTX-2 falls
  back to)."""

  forward, grid, layers = FORWARD, GRID, 2
  other_calls = {"cross": 2 * DENSE_PER_LAYER}


def test_the_pipeline_follows_the_schedule_with_one_compile_and_counts_its_calls(
    tmp_path_factory, traced_kernels, capsys):
  """LTX2Pipeline's own scanned loop: the step traced from the timestep (steps 1.. sparse,
  layer 0 dense), one trace of each call site for two runs, and the run summary's counts."""
  config, mesh, model = build(tmp_path_factory, 8, "svg", svg_density=0.3,
                              svg_active_steps=[1, None], svg_active_layers=[1, None])
  pipe = tiny_ltx2.pipeline(config, mesh, model)
  _, _, text, _ = tiny_ltx2.inputs(batch=1)
  with plugin.record_calls() as log:
    first = tiny_ltx2.generate(pipe, 3, text)
    jax.effects_barrier()
    calls = len(log)
    second = tiny_ltx2.generate(pipe, 3, text)
    jax.effects_barrier()
  selfs = sorted((r["step"], r["layer"], r["sparse"]) for r in log[:calls] if r["kind"] == "self")
  assert selfs == [(s, l, s >= 1 and l >= 1) for s in range(3) for l in range(2)]
  assert kinds(log[:calls]) == {"self": 6, "cross": 6 * DENSE_PER_LAYER}
  # one trace per call site (scanned blocks: attn1, audio_attn1, attn2, audio_attn2)
  assert len(traced_kernels) == 1 + DENSE_PER_LAYER, traced_kernels
  np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(second[0]))
  lines = summary_lines(capsys)
  assert len(lines) == 2 and all(
      "run summary: 3 steps x 2 layers: 6 self-attention calls, 2 sparse and 4 dense "
      "(counted)" in line and line.endswith(
          f"; other attention calls dense: {6 * DENSE_PER_LAYER} cross (audio self-attention, "
          f"text and audio-video cross-attention runs svg_dense_kernel)")
      for line in lines), lines



def test_bfloat16_activations_run_sparse_with_float32_q_and_k(tmp_path_factory):
  """LTX-2 normalises q and k in float32 and projects v in bfloat16: the svg kernel runs them
  in v's dtype, at density 1 as close to the dense kernel as bfloat16 allows."""
  keys = {"activations_dtype": "bfloat16", "weights_dtype": "bfloat16"}
  video, _, _ = forward(tmp_path_factory, 1, "dot_product", **keys)
  svg_video, _, log = forward(tmp_path_factory, 1, "svg", svg_density=1.0, **EVERYTHING, **keys)
  assert all(r["sparse"] for r in log if r["kind"] == "self")
  assert rel(svg_video.astype(np.float32), video.astype(np.float32)) < 2e-2


@pytest.mark.full
def test_ltx2_3s_cfg_and_stg_batch_of_4_runs_the_schedule(tmp_path_factory):
  """LTX-2.3's config (CFG and spatio-temporal guidance on a block: a batch of 4, the perturbed
  item's block self-attention replaced after the kernel ran): every call of the batch routed,
  the schedule followed, the video finite and apart from the dense kernel's."""
  keys = {"base": "ltx2_3_video.yml", "spatio_temporal_guidance_blocks": [1],
          # its audio-video kernels are flash: on CPU, MaxDiffusion's own dot_product
          "a2v_attention_kernel": "dot_product", "v2a_attention_kernel": "dot_product"}
  runs = {}
  for attention, extra in (("dot_product", {}),
                           ("svg", {"svg_density": 0.3, "svg_active_steps": [1, None],
                                    "svg_active_layers": [1, None]})):
    config = tiny_ltx2.init_config(tiny_ltx2.write_config(
        str(tmp_path_factory.mktemp("config")), attention=attention, **keys, **extra))
    mesh = tiny_ltx2.make_mesh(config, 8)
    pipe = tiny_ltx2.pipeline(config, mesh, tiny_ltx2.build_transformer(config, mesh))
    _, _, text, _ = tiny_ltx2.inputs(batch=1)
    with plugin.record_calls(arrays=True) as log:
      video, _ = tiny_ltx2.generate(pipe, 2, text, stg_scale=1.0)
      jax.effects_barrier()
    runs[attention] = (np.asarray(video), log)
  dense, (sparse, log) = runs["dot_product"][0], runs["svg"]
  selfs = [r for r in log if r["kind"] == "self"]
  assert sorted((r["step"], r["layer"], r["sparse"]) for r in selfs) == [
      (s, l, s >= 1 and l >= 1) for s in range(2) for l in range(2)]
  assert all(r["qkv_out"][0].shape[0] == 4 for r in selfs)  # uncond, cond, perturbed, isolated
  assert np.isfinite(sparse).all() and 1e-4 < rel(sparse, dense) < 0.2, rel(sparse, dense)


@pytest.mark.full
def test_unscanned_layers_equal_scanned_ones(tmp_path_factory):
  scanned, _, _ = forward(tmp_path_factory, 1, "svg", svg_density=0.3, **EVERYTHING)
  unscanned, _, log = forward(tmp_path_factory, 1, "svg", svg_density=0.3, scan_layers=False,
                              **EVERYTHING)
  assert_close(unscanned, scanned)
  assert [(r["layer"], r["sparse"]) for r in log if r["kind"] == "self"] == [(0, True), (1, True)]
