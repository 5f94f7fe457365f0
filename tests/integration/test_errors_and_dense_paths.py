"""What runs dense, what raises, and the AOT cache key."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion import aot_cache
from maxdiffusion.models import attention_flax
from maxdiffusion.pipelines.wan import wan_pipeline

from maxdiffusion_svg import plugin
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plugin import hooks
from maxdiffusion_svg.plugin.settings import PluginSettings
from maxdiffusion_svg.testing import tiny_wan

EVERYTHING = {"svg_active_steps": [0, None], "svg_active_layers": [0, None]}


@pytest.fixture(scope="module", autouse=True)
def registered():
  plugin.register()


def dispatch(q, k, v, kernel, *, mask=None, checkpoint="cross_attn", heads=2):
  """MaxDiffusion's dispatcher, as NNXAttentionOp calls it."""
  return attention_flax._apply_attention(  # pylint: disable=protected-access
      query=q, key=k, value=v, heads=heads, dim_head=q.shape[-1] // heads if q.ndim == 3 else
      q.shape[-1], split_head_dim=True, float32_qk_product=False, attention_kernel=kernel,
      flash_min_seq_length=0, use_memory_efficient_attention=False, scale=0.25,
      dtype=jnp.float32, mesh=None, axis_names_q=None, axis_names_kv=None,
      flash_block_sizes=None, dpa_layer=None, residual_checkpoint_name=checkpoint,
      attention_mask=mask)


def wan_call(grid=VideoGrid(2, 2, 2)):
  return hooks.model_call(hooks.ModelCall("WanModel", grid, PluginSettings(min_seq_length=0),
                                          None, None))


def test_masked_cross_attention_uses_maxdiffusions_mask_handling():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 12, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((2, 20, 16)), jnp.float32) for _ in range(2))
  mask = jnp.asarray(rng.random((2, 20)) < 0.6)
  want = dispatch(q, k, v, "dot_product", mask=mask)
  with wan_call():
    got = dispatch(q, k, v, "svg", mask=mask)
    unmasked = dispatch(q, k, v, "svg")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
  assert np.abs(np.asarray(unmasked) - np.asarray(want)).max() > 1e-2  # the mask mattered


def test_outside_a_wan_transformer_is_an_error():
  q = jnp.zeros((1, 8, 16))
  with pytest.raises(ValueError, match="called outside a Wan or LTX-2 transformer; it supports Wan 2.1"):
    dispatch(q, q, q, "svg")


def test_self_attention_must_be_the_video_grid():
  q = jnp.zeros((1, 2, 10, 8))
  with wan_call(VideoGrid(2, 2, 2)), pytest.raises(
      ValueError, match="self-attention of 10 tokens in WanModel, but its video grid 2x2x2 has 8"):
    dispatch(q, q, q, "svg", checkpoint="self_attn")


def build_and_run(tmp_path, devices=8, heads=tiny_wan.HEADS, create=None, **keys):
  config = tiny_wan.init_config(tiny_wan.write_config(tmp_path, attention="svg", **keys))
  mesh = tiny_wan.make_mesh(config, devices)
  if create is not None:
    with tiny_wan.tiny_loaders(heads=heads), mesh[1]:
      model = create(devices_array=mesh[0], mesh=mesh[1], rngs=tiny_wan.nnx.Rngs(0),
                     config=config, subfolder="transformer")
  else:
    model = tiny_wan.build_transformer(config, mesh, heads=heads)
  latents, text = tiny_wan.inputs(batch=1)
  return tiny_wan.forward(model, mesh[1], config, latents, text, 500)


@pytest.mark.parametrize("key, value, message", [
    ("svg_densty", 0.3, "unknown SVG config key.*svg_densty"),
    ("svg_density", 1.5, "svg_density"),
    ("svg_dense_kernel", "svg", "svg_dense_kernel must name a dense"),
    ("svg_min_seq_length", -1, "svg_min_seq_length must be an integer >= 0"),
])
def test_invalid_keys_fail_before_weights_load(tmp_path, monkeypatch, key, value, message):
  loaded = []
  monkeypatch.setattr(wan_pipeline, "load_wan_transformer", lambda *a, **k: loaded.append(1))
  config = tiny_wan.init_config(tiny_wan.write_config(tmp_path, attention="svg", **{key: value}))
  mesh = tiny_wan.make_mesh(config, 1)
  with pytest.raises(ValueError, match=message):
    wan_pipeline.create_sharded_logical_transformer(
        devices_array=mesh[0], mesh=mesh[1], rngs=tiny_wan.nnx.Rngs(0), config=config)
  assert not loaded


@pytest.mark.parametrize("key, value", [("svg_layer_densities", [0.3, 0.7]),
                                        ("svg_head_densities", [0.3] * 8)])
def test_a_ring_refuses_per_layer_and_per_head_budgets_before_weights_load(tmp_path, monkeypatch,
                                                                           key, value):
  """generate_wan's pre-flight refuses them with the run's own check (ring_plan.check_on_ring)
  before anything loads: 8 context shards, ulysses_shards 4, a ring of 2."""
  from maxdiffusion import generate_wan  # pylint: disable=import-outside-toplevel
  folder = tmp_path / "checkpoint" / "transformer"
  folder.mkdir(parents=True)
  (folder / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_layers": 2}))
  config = tiny_wan.init_config(tiny_wan.write_config(
      tmp_path, attention="svg", ici_data_parallelism=1, ici_fsdp_parallelism=1,
      ici_context_parallelism=8, ulysses_shards=4,
      pretrained_model_name_or_path=str(folder.parent), **{key: value}))
  loaded = []
  monkeypatch.setattr(wan_pipeline, "load_wan_transformer", lambda *a, **k: loaded.append(1))
  with pytest.raises(ValueError, match=rf"{key} does not run on a ring yet \(ulysses_shards 4 "
                                       rf"leaves the sequence split over 2 devices\)"):
    generate_wan.run(config)
  assert not loaded


def test_heads_not_divisible_by_the_context_shards(tmp_path):
  with pytest.raises(ValueError, match=r"heads \(4\) must be divisible by the 8 shards of mesh "
                                       r"axis 'context'"):
    build_and_run(tmp_path, heads=4, **EVERYTHING)


def test_an_unprepared_wan_transformer_is_an_error(tmp_path):
  unhooked = wan_pipeline.create_sharded_logical_transformer.__wrapped__
  with pytest.raises(ValueError, match="this WanModel was not prepared for SVG"):
    build_and_run(tmp_path, devices=1, create=unhooked, **EVERYTHING)


def test_a_step_schedule_needs_the_denoising_step(tmp_path):
  with pytest.raises(ValueError, match="the denoising step is unknown: run the model through "
                                       "a Wan or LTX-2 pipeline"):
    build_and_run(tmp_path, devices=1, svg_active_steps=[3, None])


def test_short_sequences_run_dense(tmp_path):
  with plugin.record_calls() as log:
    build_and_run(tmp_path, devices=1, svg_min_seq_length=10_000, **EVERYTHING)
    jax.effects_barrier()
  assert sorted(r["kind"] for r in log) == ["cross", "cross", "short", "short"]


@pytest.mark.parametrize("meta", [
    {"attention": "svg"},  # generate_wan's
    {"config": json.dumps({"attention": "svg", "scan_layers": True})}])  # generate_ltx2's
def test_aot_cache_keys_on_the_svg_settings(tmp_path, meta):
  fingerprints = []
  for density in (0.3, 0.4):
    tiny_wan.init_config(tiny_wan.write_config(tmp_path, attention="svg", svg_density=density))
    aot_cache.install(str(tmp_path / "aot"), meta=meta, mesh=None)
    fingerprints.append(aot_cache._STATE.fingerprint)  # pylint: disable=protected-access
  aot_cache.install("", meta={}, mesh=None)
  assert fingerprints[0] != fingerprints[1]


@pytest.mark.parametrize("module, function", [
    ("wan.wan_vace_pipeline_2_1", "create_sharded_logical_transformer"),
    ("wan.wan_pipeline_animate", "create_sharded_animate_transformer"),
    ("ltx2.ltx2_pipeline", "create_sharded_logical_transformer")])
def test_every_factory_checks_the_svg_keys_before_weights_load(tmp_path, module, function):
  """Each model's factory refuses a bad svg_* value before its body runs (which reads the
  checkpoint's config first, here a name that exists nowhere)."""
  import importlib  # pylint: disable=import-outside-toplevel
  pipelines = importlib.import_module(f"maxdiffusion.pipelines.{module}")
  config = tiny_wan.init_config(tiny_wan.write_config(
      tmp_path, attention="svg", svg_density=1.5, pretrained_model_name_or_path="/nonexistent"))
  mesh = tiny_wan.make_mesh(config, 1)
  with pytest.raises(ValueError, match=r"svg_density must be .*\(0, 1\]"):
    getattr(pipelines, function)(mesh[0], mesh[1], tiny_wan.nnx.Rngs(0), config)
