"""The semantic layout through MaxDiffusion's own denoising loops: each layer's k-means centroids
carried from step to step (cold at a run's first sparse call, warm after), in the Python loop
and in ``scan_diffusion_loop``'s ``lax.scan``, one compile, and each Wan 2.2 expert its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg import plugin
from maxdiffusion_svg.call.attention import scheduled_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.routing.semantic import Seed
from maxdiffusion_svg.testing import tiny_wan

GRID = VideoGrid(9, 8, 8)  # tiny_wan.VIDEO's latent, patchified
SEMANTIC = dict(svg_layouts="[spatial, temporal, semantic]", svg_semantic_clusters=8,
                svg_semantic_iterations=3, svg_semantic_warm_iterations=1)


@pytest.fixture(scope="module", autouse=True)
def registered():
  plugin.register()


def replay(records, svg, expert=None):
  """Each sparse call of one layer recomputed on one device from its captured q, k, v, in
  order, carrying the centroids as the plugin should: the first cold, each next seeded by the
  previous call's (the batch's mean). Returns the outputs and the centroids after each call."""
  clusters, outs, stored = None, [], []
  for record in records:
    q, k, v, _ = record["qkv_out"]
    seed = Seed(jnp.zeros((q.shape[0], q.shape[1], 8, q.shape[3])) if clusters is None
                else jnp.broadcast_to(clusters, (q.shape[0], *clusters.shape)),
                jnp.bool_(clusters is not None))
    out, aux = scheduled_svg_attention(q, k, v, grid=GRID, config=svg, step=record["step"],
                                       layer=record["layer"], expert=expert, seed=seed)
    clusters = jnp.mean(aux["clusters"], axis=0)
    outs.append(np.asarray(out))
    stored.append(np.asarray(clusters))
  return outs, stored


def assert_close(got, want, atol=1e-5):
  scale = np.abs(want).max()
  np.testing.assert_allclose(got / scale, want / scale, atol=atol)


@pytest.mark.parametrize("scan_diffusion_loop", [
    False, pytest.param(True, marks=pytest.mark.full)])  # the scan's carry: full tier
def test_centroids_carry_from_step_to_step_with_one_compile(tmp_path, traced_kernels,
                                                            scan_diffusion_loop):
  config = tiny_wan.init_config(tiny_wan.write_config(
      tmp_path, attention="svg", svg_density=0.3, svg_active_steps=[2, None],
      svg_active_layers=[1, None], num_inference_steps=5,
      scan_diffusion_loop=scan_diffusion_loop, **SEMANTIC))
  mesh = tiny_wan.make_mesh(config, 8)
  model = tiny_wan.build_transformer(config, mesh)
  pipeline = tiny_wan.pipeline_2_1(config, mesh, model)
  _, text = tiny_wan.inputs(batch=1)
  runs = []
  with plugin.record_calls(arrays=True) as log:
    for steps in (3, 5):  # a warm-up run (one sparse step), then the run
      start = len(log)
      latents = tiny_wan.generate(pipeline, steps, text, guidance_scale=5.0)
      jax.effects_barrier()
      runs.append([r for r in log[start:] if r["kind"] == "self" and r["sparse"]])
  assert sorted(traced_kernels) == ["cross_attn", "self_attn"]  # one compile for both runs
  # Each run starts cold (its timesteps reset the centroids), then every step is warm.
  assert [(r["step"], r["layer"], r["warm"]) for r in runs[0]] == [(2, 1, False)]
  assert [(r["step"], r["layer"], r["warm"]) for r in runs[1]] == [
      (2, 1, False), (3, 1, True), (4, 1, True)]
  svg = model.svg_settings.svg
  outs, stored = replay(runs[1], svg)
  for record, out in zip(runs[1], outs):
    assert_close(record["qkv_out"][3], out)
  # The store holds the last call's centroids for layer 1; layer 0 (dense) never clustered.
  centroids = np.asarray(model.svg_semantic_centroids[...])
  np.testing.assert_allclose(centroids[1], stored[-1], atol=1e-4)
  assert not centroids[0].any() and list(np.asarray(model.svg_semantic_ready[...])) == [0, 1]
  # Warm starts changed what ran: the last call replayed cold clusters otherwise.
  _, cold = replay(runs[1][-1:], svg)
  assert not np.allclose(cold[0], stored[-1], atol=1e-3)
  assert np.isfinite(np.asarray(latents)).all()


@pytest.mark.full  # the CI tier runs both experts with semantic keys in the AOT test
def test_wan22_experts_keep_their_own_centroids(tmp_path):
  config = tiny_wan.init_config(tiny_wan.write_config(
      tmp_path, base="base_wan_27b.yml", attention="svg", svg_high_noise_density=0.5,
      svg_low_noise_density=0.2, svg_active_steps=[0, None], svg_active_layers=[1, None],
      num_inference_steps=4, boundary_ratio=0.875, **SEMANTIC))
  mesh = tiny_wan.make_mesh(config, 8)
  high = tiny_wan.build_transformer(config, mesh, subfolder="transformer")
  low = tiny_wan.build_transformer(config, mesh, subfolder="transformer_2")
  pipeline = tiny_wan.pipeline_2_2(config, mesh, high, low)
  _, text = tiny_wan.inputs(batch=1)
  with plugin.record_calls(arrays=True) as log:
    tiny_wan.generate(pipeline, 4, text)
    jax.effects_barrier()
  calls = [r for r in log if r["kind"] == "self" and r["sparse"]]
  for expert, model in (("high_noise", high), ("low_noise", low)):
    mine = [r for r in calls if r["expert"] == expert]
    # the low-noise expert's first step is cold although the high-noise one ran before it
    assert mine and [r["warm"] for r in mine] == [False] + [True] * (len(mine) - 1), expert
    outs, stored = replay(mine, model.svg_settings.svg, expert)
    for record, out in zip(mine, outs):
      assert_close(record["qkv_out"][3], out)
    np.testing.assert_allclose(np.asarray(model.svg_semantic_centroids[...])[1], stored[-1],
                               atol=1e-4)
  assert not np.allclose(np.asarray(high.svg_semantic_centroids[...]),
                         np.asarray(low.svg_semantic_centroids[...]))
