"""The svg kernel through MaxDiffusion's own denoising loops: steps, warm-up, Wan 2.2 experts."""

import jax
import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg import plugin
from maxdiffusion_svg.call.attention import dense_tiled_attention, scheduled_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.testing import tiny_wan

GRID = VideoGrid(9, 8, 8)  # tiny_wan.VIDEO's latent, patchified


@pytest.fixture(scope="module", autouse=True)
def registered():
  plugin.register()


def self_calls(log):
  return [(r["step"], r["layer"], r["sparse"]) for r in log if r["kind"] == "self"]


def recompute(record, svg, expert=None):
  """The call recomputed on one device from its captured q, k, v: the schedule's branch
  for the logged step and layer, as the library computes it."""
  q, k, v, _ = record["qkv_out"]
  return np.asarray(scheduled_svg_attention(q, k, v, grid=GRID, config=svg, step=record["step"],
                                            layer=record["layer"], expert=expert))


def assert_close(got, want, atol=1e-5):
  scale = np.abs(want).max()
  np.testing.assert_allclose(got / scale, want / scale, atol=atol)


# The scanned loop (a traced step inside the scan) in the CI tier; the Python loop in the full.
@pytest.mark.parametrize("scan_diffusion_loop", [pytest.param(False, marks=pytest.mark.full), True])
def test_steps_follow_the_schedule_after_a_shorter_warmup_with_one_compile(
    tmp_path, traced_kernels, scan_diffusion_loop):
  config = tiny_wan.init_config(tiny_wan.write_config(
      tmp_path, attention="svg", svg_density=0.3, svg_active_steps=[2, None],
      svg_active_layers=[1, None], num_inference_steps=5,
      scan_diffusion_loop=scan_diffusion_loop))
  mesh = tiny_wan.make_mesh(config, 8)
  pipeline = tiny_wan.pipeline_2_1(config, mesh, tiny_wan.build_transformer(config, mesh))
  _, text = tiny_wan.inputs(batch=1)
  with plugin.record_calls(arrays=True) as log:
    warm = tiny_wan.generate(pipeline, 2, text, guidance_scale=5.0)  # generate_wan's warm-up
    jax.effects_barrier()
    warmup = len(log)
    latents = tiny_wan.generate(pipeline, 5, text, guidance_scale=5.0)
    jax.effects_barrier()
  assert self_calls(log[:warmup]) == [(s, l, False) for s in range(2) for l in range(2)]
  assert self_calls(log[warmup:]) == [(s, l, s >= 2 and l >= 1)
                                      for s in range(5) for l in range(2)]
  assert sorted(traced_kernels) == ["cross_attn", "self_attn"]  # one compile for both runs
  # What each call computed, not just what it logged: dense steps give the dense executor's
  # output exactly, sparse ones the library's SVG for that step and layer.
  svg = pipeline.transformer.svg_settings.svg
  for record in (r for r in log if r["kind"] == "self"):
    q, k, v, out = record["qkv_out"]
    if record["sparse"]:
      assert_close(out, recompute(record, svg))
      assert not np.allclose(out, np.asarray(dense_tiled_attention(q, k, v, grid=GRID, config=svg)),
                             atol=1e-4)
    else:
      np.testing.assert_array_equal(out, np.asarray(dense_tiled_attention(q, k, v, grid=GRID,
                                                                          config=svg)))
  assert np.isfinite(np.asarray(latents)).all() and np.isfinite(np.asarray(warm)).all()
  assert np.asarray(latents).shape == np.asarray(warm).shape


def test_wan22_experts_use_their_own_densities(tmp_path, traced_kernels):
  config = tiny_wan.init_config(tiny_wan.write_config(
      tmp_path, base="base_wan_27b.yml", attention="svg", svg_high_noise_density=0.5,
      svg_low_noise_density=0.2, svg_active_steps=[0, None], svg_active_layers=[0, None],
      num_inference_steps=4, boundary_ratio=0.875))
  mesh = tiny_wan.make_mesh(config, 8)
  high = tiny_wan.build_transformer(config, mesh, subfolder="transformer")
  low = tiny_wan.build_transformer(config, mesh, subfolder="transformer_2")
  assert (high.svg_expert, low.svg_expert) == ("high_noise", "low_noise")
  pipeline = tiny_wan.pipeline_2_2(config, mesh, high, low)
  _, text = tiny_wan.inputs(batch=1)
  with plugin.record_calls(arrays=True) as log:
    tiny_wan.generate(pipeline, 4, text)
    jax.effects_barrier()
  # Each expert's calls are its own SVG: recomputed from the captured q, k, v with its
  # expert they match, with the other expert's density they do not.
  svg = high.svg_settings.svg
  other = {"high_noise": "low_noise", "low_noise": "high_noise"}
  for record in (r for r in log if r["kind"] == "self"):
    out = record["qkv_out"][3]
    assert_close(out, recompute(record, svg, record["expert"]))
    assert not np.allclose(out, recompute(record, svg, other[record["expert"]]), atol=1e-4)
  calls = [(r["step"], r["expert"], r["density"]) for r in log if r["kind"] == "self"]
  experts = {step: expert for step, expert, _ in calls}
  assert set(experts.values()) == {"high_noise", "low_noise"}  # both ran
  assert experts[0] == "high_noise" and experts[3] == "low_noise"  # high noise comes first
  assert all(density == {"high_noise": 0.5, "low_noise": 0.2}[expert]
             for _, expert, density in calls)
  assert sorted(r["step"] for r in log if r["kind"] == "self") == sorted(
      [s for s in range(4) for _ in range(2)])
