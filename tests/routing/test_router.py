"""Router against a NumPy oracle written from the definition; planted heads."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.bench.routers import ideal_routing, layout_outputs
from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.kernels import dense_attention
from maxdiffusion_svg.plan.geometry import VideoGrid, frame_major_order
from maxdiffusion_svg.plan.tiles import plan_tiles
from maxdiffusion_svg.routing.router import (SLICED_ROWS, RouterConfig, probe_errors, profile_heads,
                                             route_heads, sample_rows, take_rows)

GRID = VideoGrid(6, 8, 16)  # 768 tokens, 128-token frames: probe band of +-1 block
PROBE = {"profile_masks": "probe"}  # the reference SVG router's masks (the default is execution)


def numpy_probe_mask(grid, include_sink):
  """The probe in its placed layout: k < P or |q//128 - k//128| < 2P//128."""
  n, p = grid.tokens, grid.frame_size
  radius = max(1, 2 * p // 128)
  spatial = np.zeros((n, n), bool)
  for q, k in itertools.product(range(n), repeat=2):
    spatial[q, k] = (include_sink and k < p) or abs(q // 128 - k // 128) < radius
  return spatial


def numpy_layout_errors(q, k, v, rows, grid, placed_mask):
  """Errors of ``rows`` against dense under a dense placed-layout mask put in both layouts."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  pos = frame_major_order(grid)
  logits = np.einsum("bhrd,bhkd->bhrk", q[:, :, rows], k) / np.sqrt(q.shape[-1])

  def out(mask):
    x = logits if mask is None else np.where(mask[rows], logits, -np.inf)
    w = np.exp(x - x.max(-1, keepdims=True))
    return np.einsum("bhrk,bhkd->bhrd", w / w.sum(-1, keepdims=True), v)

  dense = out(None)
  return [((out(m) - dense) ** 2).mean(axis=(2, 3))
          for m in (placed_mask, placed_mask[np.ix_(pos, pos)])]


def numpy_route(q, k, v, rows, grid, include_sink=True):
  err_s, err_t = numpy_layout_errors(q, k, v, rows, grid, numpy_probe_mask(grid, include_sink))
  return err_t < err_s, err_s, err_t


@pytest.mark.parametrize("pool", ["prefix", "stratified"])
@pytest.mark.parametrize("include_sink", [True, False])
def test_router_equals_numpy_oracle(pool, include_sink):
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((2, 4, GRID.tokens, 32)).astype(np.float32) for _ in range(3))
  config = RouterConfig(profile_queries=16, profile_pool=pool, sample_max_row=300, **PROBE,
                        include_sink=include_sink)
  key = jax.random.key(3)
  routing = profile_heads(q, k, v, grid=GRID, config=config, key=key)
  rows = np.asarray(sample_rows(key, GRID.tokens, config))
  flags, err_s, err_t = numpy_route(q, k, v, rows, GRID, include_sink)
  np.testing.assert_allclose(np.asarray(routing.spatial_error), err_s, rtol=1e-4, atol=1e-9)
  np.testing.assert_allclose(np.asarray(routing.temporal_error), err_t, rtol=1e-4, atol=1e-9)
  np.testing.assert_array_equal(np.asarray(routing.temporal), flags)


def test_ties_go_to_spatial():
  # With one frame both orders coincide, so the two probe errors are bitwise equal.
  grid = VideoGrid(1, 8, 16)
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((1, 3, grid.tokens, 8)).astype(np.float32) for _ in range(3))
  routing = profile_heads(q, k, v, grid=grid, config=RouterConfig(profile_queries=4, **PROBE),
                        key=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(routing.spatial_error),
                                np.asarray(routing.temporal_error))
  assert not np.asarray(routing.temporal).any()


def test_planted_heads_are_routed_to_their_type():
  types = ("spatial", "temporal") * 4
  grid = VideoGrid(9, 10, 16)
  q, k, v = planted_qkv(grid, types, head_dim=32, seed=1)
  for seed in range(3):
    flags = route_heads(q, k, v, grid=grid, config=RouterConfig(profile_queries=32, **PROBE),
                        key=jax.random.key(seed))
    assert flags.shape == (1, len(types)) and flags.dtype == bool
    np.testing.assert_array_equal(np.asarray(flags)[0],
                                  [t == "temporal" for t in types])


def test_same_key_same_flags_and_rows():
  rng = np.random.default_rng(1)
  q, k, v = (rng.standard_normal((1, 6, GRID.tokens, 16)).astype(np.float32) for _ in range(3))
  config = RouterConfig(profile_queries=8, **PROBE)
  a = profile_heads(q, k, v, grid=GRID, config=config, key=jax.random.key(7))
  b = profile_heads(q, k, v, grid=GRID, config=config, key=jax.random.key(7))
  np.testing.assert_array_equal(np.asarray(a.temporal), np.asarray(b.temporal))
  np.testing.assert_array_equal(np.asarray(a.spatial_error), np.asarray(b.spatial_error))


def test_sampling_pools():
  key = jax.random.key(0)
  prefix = np.asarray(sample_rows(key, 5000, RouterConfig(profile_queries=64, profile_pool="prefix",
                                                          sample_max_row=700)))
  assert prefix.min() >= 0 and prefix.max() < 700
  strat = np.asarray(sample_rows(key, 5000, RouterConfig(profile_queries=50)))
  np.testing.assert_array_equal(strat // 100, np.arange(50))  # one row in each 100-token slice
  small = np.asarray(sample_rows(key, 30, RouterConfig(profile_queries=64)))
  assert small.max() < 30


@pytest.mark.parametrize("kwargs, needle", [
    (dict(profile_queries=0), "svg_profile_queries must be an integer >= 1"),
    (dict(sample_max_row=0), "svg_sample_max_row must be an integer >= 1"),
    (dict(profile_pool="random"), "svg_profile_pool must be one of prefix, stratified"),
])
def test_router_config_rejects_bad_values(kwargs, needle):
  with pytest.raises(ValueError, match=needle):
    RouterConfig(**kwargs)


def test_router_rejects_sequence_not_matching_grid():
  q = np.zeros((1, 1, 100, 8), np.float32)
  with pytest.raises(ValueError, match="does not match grid 6x8x16"):
    route_heads(q, q, q, grid=GRID, config=RouterConfig(), key=jax.random.key(0))


def test_probe_errors_are_float32_even_for_bfloat16_inputs():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((1, 2, GRID.tokens, 16)), jnp.bfloat16)
  e_s, e_t = probe_errors(q, q, q, jnp.arange(8), GRID)
  assert e_s.dtype == jnp.float32 and e_t.dtype == jnp.float32


def test_stratified_pool_sees_heads_that_change_after_the_first_frames():
  # Drifting heads are spatial in the first quarter of the frames and temporal after it.
  grid = VideoGrid(12, 8, 16)
  q, k, v = planted_qkv(grid, ("drifting",) * 3, head_dim=32, seed=2)
  prefix = RouterConfig(profile_queries=32, profile_pool="prefix", sample_max_row=grid.tokens // 8,
                        **PROBE)
  strat = RouterConfig(profile_queries=32, profile_pool="stratified", **PROBE)
  key = jax.random.key(0)
  assert not np.asarray(route_heads(q, k, v, grid=grid, config=prefix, key=key)).any()
  assert np.asarray(route_heads(q, k, v, grid=grid, config=strat, key=key)).all()


# ------------------------------------------------- execution masks: the mask the kernel runs


@pytest.mark.parametrize("mode", ["split", "aligned"])
def test_execution_masks_are_the_plans_computed_mask(mode):
  rng = np.random.default_rng(1)
  q, k, v = (rng.standard_normal((1, 3, GRID.tokens, 16)).astype(np.float32) for _ in range(3))
  plan = plan_tiles(GRID, 0.3, 128, 256, mode)
  config = RouterConfig(profile_queries=16, profile_masks="execution")
  key = jax.random.key(5)
  routing = profile_heads(q, k, v, grid=GRID, config=config, key=key, plan=plan)
  rows = np.asarray(sample_rows(key, GRID.tokens, config))
  err_s, err_t = numpy_layout_errors(q, k, v, rows, GRID, plan.dense_mask())
  np.testing.assert_allclose(np.asarray(routing.spatial_error), err_s, rtol=1e-4, atol=1e-9)
  np.testing.assert_allclose(np.asarray(routing.temporal_error), err_t, rtol=1e-4, atol=1e-9)
  probe = profile_heads(q, k, v, grid=GRID, config=RouterConfig(profile_queries=16, **PROBE),
                        key=key)
  assert not np.allclose(np.asarray(probe.spatial_error), err_s)  # a different question


def test_execution_routing_agrees_with_the_ideal_router_on_clear_heads():
  types = ("spatial", "temporal", "temporal", "spatial", "weak_temporal", "weak_spatial")
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, types, head_dim=32, seed=3, batch=2))
  for density in (0.2, 0.5):
    plan = plan_tiles(GRID, density, 128, 128, "aligned")
    spatial, temporal = layout_outputs(q, k, v, GRID, plan)
    ideal = ideal_routing(spatial, temporal, np.asarray(dense_attention(q, k, v)))
    np.testing.assert_array_equal(ideal, [[t.endswith("temporal") for t in types]] * 2)
    config = RouterConfig(profile_queries=16, profile_masks="execution")
    for seed in range(3):
      flags = route_heads(q, k, v, grid=GRID, config=config, key=jax.random.key(seed), plan=plan)
      np.testing.assert_array_equal(np.asarray(flags), ideal)


@pytest.mark.parametrize("masks", ["probe", "execution"])
def test_same_key_same_flags_for_both_mask_choices(masks):
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, ("mixed50", "mixed25", "unstructured"),
                                                  head_dim=32, seed=4))
  plan = plan_tiles(GRID, 0.35, 128, 128, "aligned")
  config = RouterConfig(profile_queries=16, profile_masks=masks)
  run = jax.jit(lambda q, k, v, key: route_heads(q, k, v, grid=GRID, config=config, key=key,
                                                 plan=plan))
  first = np.asarray(run(q, k, v, jax.random.key(11)))
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(run(q, k, v, jax.random.key(11))), first)
  np.testing.assert_array_equal(np.asarray(route_heads(q, k, v, grid=GRID, config=config,
                                                       key=jax.random.key(11), plan=plan)), first)


def test_execution_masks_need_the_plan_and_a_valid_name():
  q = jnp.zeros((1, 1, GRID.tokens, 8))
  with pytest.raises(ValueError, match="svg_profile_masks=execution needs the call's tile plan"):
    route_heads(q, q, q, grid=GRID, config=RouterConfig(), key=jax.random.key(0))  # the default
  with pytest.raises(ValueError, match="svg_profile_masks must be one of probe, execution"):
    RouterConfig(profile_masks="exact")


def test_an_svg_config_makes_the_execution_plan_itself():
  """route_heads(q, k, v, grid=, config=SvgConfig(...), key=) as documented: the config's own
  plan (with the expert's density), errors against the NumPy oracle; an explicit plan wins."""
  import doctest  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg import SvgConfig  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.routing import router  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(2)
  q, k, v = (rng.standard_normal((1, 3, GRID.tokens, 16)).astype(np.float32) for _ in range(3))
  config = SvgConfig(density=0.5, low_noise_density=0.2, block_q=128, block_kv=128,
                     profile_queries=16)
  key = jax.random.key(7)
  rows = np.asarray(sample_rows(key, GRID.tokens, config.router))
  for expert, density in ((None, 0.5), ("low_noise", 0.2)):
    routing = profile_heads(q, k, v, grid=GRID, config=config, key=key, expert=expert)
    plan = plan_tiles(GRID, density, 128, 128, "aligned")
    err_s, err_t = numpy_layout_errors(q, k, v, rows, GRID, plan.dense_mask())
    np.testing.assert_allclose(np.asarray(routing.spatial_error), err_s, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(np.asarray(routing.temporal_error), err_t, rtol=1e-4, atol=1e-9)
  other = plan_tiles(GRID, 0.2, 128, 256, "split")
  explicit = profile_heads(q, k, v, grid=GRID, config=config, key=key, plan=other)
  err_s, _ = numpy_layout_errors(q, k, v, rows, GRID, other.dense_mask())
  np.testing.assert_allclose(np.asarray(explicit.spatial_error), err_s, rtol=1e-4, atol=1e-9)
  result = doctest.testmod(router)
  assert result.attempted >= 4 and result.failed == 0  # the docstring example runs


@pytest.mark.parametrize("count", [64, SLICED_ROWS + 1])  # sliced one by one; one gather
def test_taken_rows_are_the_rows_indexed_in_numpy(count):
  q = np.random.default_rng(0).standard_normal((2, 3, 300, 8)).astype(np.float32)
  rows = np.random.default_rng(1).integers(0, 300, count).astype(np.int32)  # with repeats
  got = jax.jit(take_rows)(jnp.asarray(q), jnp.asarray(rows))
  np.testing.assert_array_equal(np.asarray(got), q[:, :, rows])
