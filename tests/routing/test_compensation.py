"""Compensation against an independent float64 reference of the same rule: exact softmax over
the pairs a plan computes, plus, for each query, one pseudo-key per sub-block of every key tile
its query tile row skips (mean key, mean value, logit ``scale * q . k_mean + log(count)``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.schedule import Interval, Schedule
from maxdiffusion_svg.call.attention import placed_attention, scheduled_svg_attention, svg_attention
from maxdiffusion_svg.kernels import dense_attention, sparse_attention
from maxdiffusion_svg.kernels.row_keys import merge
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid, to_temporal_major
from maxdiffusion_svg.plan.tiles import plan_tiles
from maxdiffusion_svg.routing.compensation import compensated_attention
from maxdiffusion_svg.routing.router import profile_heads, sample_rows
from references import compensated_reference as reference  # the rule in float64

GRID = VideoGrid(10, 10, 10)  # 1,000 tokens: padding in the last 128-key tile
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def qkv(dtype=jnp.float32, dim=64, heads=2, seed=0, grid=GRID):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((1, heads, grid.tokens, dim)), dtype) for _ in range(3)]


@pytest.mark.parametrize("backend", ["xla", "splash", "pallas"])
@pytest.mark.parametrize("mode", ["naive", "split", "aligned"])
def test_every_executor_and_mode_matches_the_float64_rule(backend, mode):
  plan = plan_tiles(GRID, 0.3, 128, 128, mode)  # sink on, padded last tile
  q, k, v = qkv(dim=128 if backend == "pallas" else 64)
  out = compensated_attention(q, k, v, plan, blocks=4, backend=backend)
  want = reference(q, k, v, plan, 4)
  np.testing.assert_allclose(np.asarray(out), want, atol=TOLERANCE[jnp.float32])
  plain = np.asarray(sparse_attention(q, k, v, plan, backend=backend))
  assert np.abs(plain - want).max() > 100 * TOLERANCE[jnp.float32]  # it does compensate


@pytest.mark.parametrize("backend", ["xla", "splash", "pallas"])
def test_bfloat16_rectangular_tiles_and_scale(backend):
  plan = plan_tiles(GRID, 0.2, 256, 128, "aligned")
  q, k, v = qkv(jnp.bfloat16, dim=128, seed=1)
  out = compensated_attention(q, k, v, plan, blocks=8, scale=0.05, backend=backend)
  assert out.dtype == jnp.bfloat16
  want = reference(*(x.astype(jnp.float32) for x in (q, k, v)), plan, 8, scale=0.05)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=TOLERANCE[jnp.bfloat16])


def test_our_kernel_takes_more_row_keys_than_one_chunk():
  """32 centroids per 128-key tile: up to 192 row keys, in chunks of the 128-key inner step."""
  plan = plan_tiles(GRID, 0.2, 128, 128, "aligned")
  q, k, v = qkv(dim=128, seed=4)
  out = compensated_attention(q, k, v, plan, blocks=32, backend="pallas", block_kv_compute=128)
  np.testing.assert_allclose(np.asarray(out), reference(q, k, v, plan, 32), atol=2e-5)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_fewer_centroids_in_all_than_a_row_holds(backend):
  """One centroid per 256-key tile, 4 tiles: the rows' slots (rounded up to 8) outnumber them."""
  plan = plan_tiles(GRID, 0.2, 256, 256, "aligned")
  q, k, v = qkv(dim=128, seed=5)
  out = compensated_attention(q, k, v, plan, blocks=1, backend=backend)
  np.testing.assert_allclose(np.asarray(out), reference(q, k, v, plan, 1), atol=2e-5)


def test_without_sink_and_one_block_per_tile():
  plan = plan_tiles(GRID, 0.25, 128, 128, "split", include_sink=False)
  q, k, v = qkv(seed=2)
  np.testing.assert_allclose(np.asarray(compensated_attention(q, k, v, plan, blocks=1)),
                             reference(q, k, v, plan, 1), atol=2e-5)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_density_one_is_the_kernels_output_unchanged(backend):
  plan = plan_tiles(GRID, 1.0, 128, 128, "aligned")
  q, k, v = qkv(dim=128)
  np.testing.assert_array_equal(
      np.asarray(compensated_attention(q, k, v, plan, blocks=4, backend=backend)),
      np.asarray(sparse_attention(q, k, v, plan, backend=backend)))


def test_merge_is_one_softmax_over_both_sets_and_empty_rows_give_zeros():
  rng = np.random.default_rng(3)
  logits, values = rng.standard_normal((2, 7)) * 3, rng.standard_normal((7, 5))
  part = lambda x, vals: (jax.nn.softmax(x) @ vals, jax.nn.logsumexp(x))
  a, b = part(logits[0], values), part(logits[1], values)
  want = jax.nn.softmax(np.concatenate(logits)) @ np.concatenate([values, values])
  np.testing.assert_allclose(np.asarray(merge(a[0], a[1], b[0], b[1])), want, atol=1e-6)
  none = merge(jnp.zeros(5), jnp.asarray(-jnp.inf), jnp.zeros(5), jnp.asarray(-jnp.inf))
  np.testing.assert_array_equal(np.asarray(none), np.zeros(5))


def cfg(**kw):
  return SvgConfig(**{"density": 0.2, "block_q": 128, "block_kv": 128, "backend": "xla",
                      "profile_queries": 16, "compensation": True, "compensation_blocks": 4,
                      **kw})


def planted(grid=GRID, heads=("spatial", "temporal", "temporal", "spatial"), seed=0,
            strength=14.0):
  return [jnp.asarray(x) for x in planted_qkv(grid, heads, head_dim=32, seed=seed,
                                              strength=strength)]


def test_svg_attention_compensates_each_head_in_its_own_layout():
  q, k, v = planted()
  config = cfg()
  out, info = svg_attention(q, k, v, grid=GRID, config=config, key=jax.random.key(0),
                            return_info=True)
  flags = np.asarray(info["temporal"])[0]
  assert flags.any() and not flags.all()
  plan = config.plan(GRID)
  for h, temporal in enumerate(flags):
    place = (lambda x: to_temporal_major(x, GRID)) if temporal else (lambda x: x)
    want = reference(*(place(x[:, h:h + 1]) for x in (q, k, v)), plan, 4)
    np.testing.assert_allclose(np.asarray(place(out[:, h:h + 1])), want, atol=2e-5)


def test_router_judges_the_compensated_output_of_each_layout():
  q, k, v = planted(seed=1, strength=6.0)  # diffuse enough that skipped tiles matter
  config = cfg()
  plan, key = config.plan(GRID), jax.random.key(3)
  routing = profile_heads(q, k, v, grid=GRID, config=config, key=key, plan=plan,
                          compensation_blocks=4)
  plain = profile_heads(q, k, v, grid=GRID, config=config, key=key, plan=plan)
  rows = np.asarray(sample_rows(key, GRID.tokens, config.router))
  dense = np.asarray(dense_attention(q, k, v))[:, :, rows]
  for temporal, errors in ((False, routing.spatial_error), (True, routing.temporal_error)):
    flags = jnp.full(q.shape[:2], temporal)
    out = placed_attention(q, k, v, flags, grid=GRID, plan=plan, backend="xla",
                           compensation_blocks=4)
    want = np.mean((np.asarray(out)[:, :, rows] - dense) ** 2, axis=(2, 3))
    np.testing.assert_allclose(np.asarray(errors), want, rtol=1e-3)
  assert not np.allclose(np.asarray(plain.spatial_error), np.asarray(routing.spatial_error))


def test_one_compile_over_steps_layers_and_data():
  q, k, v = planted()
  config = cfg(schedule=Schedule(Interval(2, None), Interval(1, None)))
  traces = []

  @jax.jit
  def call(q, k, v, step, layer):
    traces.append(1)
    return scheduled_svg_attention(q, k, v, grid=GRID, config=config, step=step, layer=layer)

  outs = [call(q * s, k, v, jnp.int32(step), jnp.int32(layer))
          for s, step, layer in ((1.0, 0, 0), (1.0, 3, 2), (0.5, 5, 1))]
  assert len(traces) == 1
  np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(dense_attention(q, k, v)), atol=2e-5)
  assert np.all(np.isfinite(np.asarray(outs[1]))) and not np.allclose(outs[0], outs[1])


@pytest.mark.parametrize("ulysses", [None, 4, 2])  # all 8 devices exchange heads; rings of 2, 4
def test_sharded_and_ring_equal_one_device(ulysses):
  grid = VideoGrid(6, 8, 16)  # 768 tokens
  heads = ("spatial", "temporal") * 4
  q, k, v = planted(grid, heads, seed=2)
  config = cfg(density=0.3)
  key = jax.random.key(7)
  want, want_info = svg_attention(q, k, v, grid=grid, config=config, key=key, return_info=True)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 1, 8, 1), ("data", "fsdp", "context", "tensor"))
  spec = NamedSharding(mesh, P(("data", "fsdp"), None, "context", None))
  run = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=grid, config=config, key=key, return_info=True,
      ulysses_shards=ulysses))
  out, info = run(*(jax.device_put(x, spec) for x in (q, k, v)))
  np.testing.assert_array_equal(np.asarray(info["temporal"]), np.asarray(want_info["temporal"]))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)
  plain = svg_attention(q, k, v, grid=grid, config=cfg(density=0.3, compensation=False), key=key)
  assert np.abs(np.asarray(plain) - np.asarray(want)).max() > 1e-5


@pytest.mark.parametrize("kw,match", [
    ({"compensation": "yes"}, "svg_compensation must be true or false"),
    ({"compensation": True, "compensation_blocks": 3}, r"svg_compensation_blocks must divide .*128"),
    ({"compensation": True, "compensation_blocks": 0}, "svg_compensation_blocks must be an integer"),
    ({"compensation": True, "compensation_blocks": 2.0}, "svg_compensation_blocks must be an integer"),
])
def test_bad_values_are_refused_naming_the_key(kw, match):
  with pytest.raises(ValueError, match=match):
    SvgConfig(block_kv=128, **kw)


def test_blocks_checked_against_the_executors_tile_when_the_config_leaves_it():
  config = SvgConfig(compensation=True, compensation_blocks=384, backend="xla")  # XLA: 512
  with pytest.raises(ValueError, match=r"svg_compensation_blocks must divide .*512"):
    config.compensation_for()
  assert SvgConfig(compensation=False, compensation_blocks=384).compensation_for() == 0
