"""svg_attention: placement, per-head masks against brute force, schedules without recompiling."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.schedule import Interval, Schedule
from maxdiffusion_svg.call.attention import place, restore, scheduled_svg_attention, svg_attention
from maxdiffusion_svg.kernels import dense_attention, masked_attention
from maxdiffusion_svg.plan.geometry import VideoGrid, frame_major_order

GRID = VideoGrid(6, 8, 16)  # 768 tokens
TYPES = ("spatial", "temporal", "temporal", "spatial")


def config(**kw):
  kw = {"block_q": 128, "block_kv": 128, "backend": "xla", "profile_queries": 16, **kw}
  return SvgConfig(**kw)


def test_place_and_restore_round_trip_for_every_flag_pattern():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 3, GRID.tokens, 4)), jnp.float32)
  order = frame_major_order(GRID)
  for bits in itertools.product([False, True], repeat=6):
    flags = jnp.asarray(np.array(bits).reshape(2, 3))
    placed = place(x, flags, GRID)
    for b, h in np.ndindex(2, 3):
      want = np.asarray(x[b, h])[np.argsort(order)] if bits[b * 3 + h] else np.asarray(x[b, h])
      np.testing.assert_array_equal(np.asarray(placed[b, h]), want)
    np.testing.assert_array_equal(np.asarray(restore(placed, flags, GRID)), np.asarray(x))


def head_mask_in_original_order(plan, temporal):
  """Brute force: the plan's mask in placed positions, re-indexed to frame-major tokens."""
  placed = plan.dense_mask()
  if not temporal:
    return placed
  pos = frame_major_order(GRID)  # pos[t] = temporal-major position of token t
  return placed[np.ix_(pos, pos)]


@pytest.mark.parametrize("mode", ["naive", "split", "aligned"])
@pytest.mark.parametrize("backend", ["xla", "splash"])
def test_each_head_gets_its_chosen_mask(mode, backend):
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, TYPES, head_dim=32, seed=2, batch=2))
  cfg = config(density=0.3, tile_mode=mode, backend=backend)
  out, info = svg_attention(q, k, v, grid=GRID, config=cfg, return_info=True)
  flags = np.asarray(info["temporal"])
  np.testing.assert_array_equal(flags, [[t == "temporal" for t in TYPES]] * 2)
  plan = cfg.plan(GRID)
  for b, h in np.ndindex(*flags.shape):
    mask = jnp.asarray(head_mask_in_original_order(plan, flags[b, h]))
    want = masked_attention(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1], mask)
    np.testing.assert_allclose(np.asarray(out[b, h]), np.asarray(want[0, 0]), atol=2e-5)
  assert info["plan"]["visited_tile_fraction"] == plan.stats.visited_tile_fraction
  assert info["spatial_error"].shape == info["temporal_error"].shape == (2, 4)


def test_density_one_reproduces_dense():
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, TYPES, head_dim=32, seed=3))
  out = svg_attention(q, k, v, grid=GRID, config=config(density=1.0))
  np.testing.assert_allclose(np.asarray(out), np.asarray(dense_attention(q, k, v)), atol=2e-5)


def test_sequence_must_match_the_grid():
  q = jnp.zeros((1, 2, 700, 16))
  with pytest.raises(ValueError, match="S = grid.tokens = 768 .*got shape \\(1, 2, 700, 16\\)"):
    svg_attention(q, q, q, grid=GRID, config=config())


def test_routing_flags_steps_and_layers_change_without_recompiling():
  cfg = config(density=0.3, schedule=Schedule(Interval(2, None), Interval(1, None)))
  traces = []

  @jax.jit
  def run(q, k, v, step, layer):
    traces.append(1)
    return scheduled_svg_attention(q, k, v, grid=GRID, config=cfg, step=step, layer=layer)

  spatial_first = [jnp.asarray(x) for x in planted_qkv(GRID, TYPES, head_dim=32, seed=4)]
  temporal_first = [jnp.asarray(x) for x in planted_qkv(GRID, TYPES[::-1], head_dim=32, seed=4)]
  outs = {}
  for (step, layer), data in itertools.product([(0, 0), (3, 0), (3, 2), (7, 5)],
                                               [spatial_first, temporal_first]):
    outs[step, layer, id(data)] = run(*data, jnp.int32(step), jnp.int32(layer))
  assert len(traces) == 1  # new flags, steps and layers reuse one executable
  q, k, v = spatial_first
  dense = np.asarray(dense_attention(q, k, v))
  sparse = np.asarray(svg_attention(q, k, v, grid=GRID, config=cfg,
                                    key=jax.random.fold_in(jax.random.fold_in(
                                        jax.random.key(cfg.profile_seed), 2), 3)))
  np.testing.assert_allclose(np.asarray(outs[0, 0, id(spatial_first)]), dense, atol=2e-5)  # warm-up
  np.testing.assert_allclose(np.asarray(outs[3, 0, id(spatial_first)]), dense, atol=2e-5)  # layer 0
  np.testing.assert_allclose(np.asarray(outs[3, 2, id(spatial_first)]), sparse, atol=2e-5)
  assert np.abs(sparse - dense).max() > 1e-3  # the sparse branch really is sparse
  # Every other call, the reversed head types included, against its own uncompiled result.
  for (step, layer, data), out in outs.items():
    data = spatial_first if data == id(spatial_first) else temporal_first
    want = scheduled_svg_attention(*data, grid=GRID, config=cfg, step=step, layer=layer)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)


def test_python_int_schedule_decides_at_trace_time():
  cfg = config(density=0.3, schedule=Schedule(Interval(5, None), Interval(0, None)))
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, TYPES, head_dim=32, seed=5))
  jaxpr = str(jax.make_jaxpr(lambda q, k, v: scheduled_svg_attention(
      q, k, v, grid=GRID, config=cfg, step=0, layer=0))(q, k, v))
  assert "cond" not in jaxpr
  np.testing.assert_allclose(
      np.asarray(scheduled_svg_attention(q, k, v, grid=GRID, config=cfg, step=0, layer=0)),
      np.asarray(dense_attention(q, k, v)), atol=2e-5)


def test_wan22_experts_use_their_own_density():
  cfg = config(density=0.4, high_noise_density=0.6, low_noise_density=0.2)
  assert cfg.plan(GRID, "high_noise").stats.exact_pair_fraction > \
      cfg.plan(GRID).stats.exact_pair_fraction > cfg.plan(GRID, "low_noise").stats.exact_pair_fraction
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, TYPES, head_dim=32, seed=6))
  _, info = svg_attention(q, k, v, grid=GRID, config=cfg, expert="low_noise", return_info=True)
  assert info["plan"]["exact_pair_fraction"] == cfg.plan(GRID, "low_noise").stats.exact_pair_fraction


def test_placement_leaves_semantic_heads_and_differentiates_as_its_inverse():
  """Heads of a layout with its own table (semantic) keep their order; the gradient of a
  placement is the restore of the cotangent (training differentiates through both)."""
  from maxdiffusion_svg.routing.layouts import SEMANTIC, SPATIAL, TEMPORAL, index
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 3, GRID.tokens, 4)), jnp.float32)
  ids = jnp.asarray([[index(SEMANTIC), index(TEMPORAL), index(SPATIAL)],
                     [index(TEMPORAL), index(SEMANTIC), index(TEMPORAL)]], jnp.int32)
  layouts = (SPATIAL, TEMPORAL, SEMANTIC)
  placed = place(x, ids, GRID, layouts)
  np.testing.assert_array_equal(np.asarray(place(np.asarray(x), ids, GRID, layouts)),
                                np.asarray(placed))  # NumPy in, as a caller may pass
  temporal = np.asarray(ids) == index(TEMPORAL)
  np.testing.assert_array_equal(np.asarray(placed), np.asarray(place(x, jnp.asarray(temporal),
                                                                     GRID)))
  np.testing.assert_array_equal(np.asarray(placed)[~temporal], np.asarray(x)[~temporal])
  c = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  grad = jax.grad(lambda x: jnp.sum(place(x, ids, GRID, layouts) * c))(x)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(restore(c, ids, GRID, layouts)))


def test_our_kernel_takes_q_scaled_by_its_placement(monkeypatch):
  """With our Pallas kernel (interpreted) q is multiplied by the scale and log2(e) on its way to
  the placed order and the kernel takes BASE2_SCALE: the routing, output and gradient of XLA's
  executor, which scales inside."""
  from maxdiffusion_svg.call import attention  # pylint: disable=import-outside-toplevel
  factors = []
  factor = attention.base2_factor
  monkeypatch.setattr(attention, "base2_factor", lambda *a: factors.append(a) or factor(*a))
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, TYPES, head_dim=128, seed=4))
  key = jax.random.key(1)
  run = lambda backend, *x: svg_attention(*x, grid=GRID, config=config(backend=backend, density=0.3),
                                          key=key, return_info=True)
  ours, ours_info = run("pallas", q, k, v)
  assert factors  # the scale rode the placement
  want, want_info = run("xla", q, k, v)
  flags = np.asarray(want_info["temporal"])
  assert flags.any() and not flags.all()
  np.testing.assert_array_equal(np.asarray(ours_info["temporal"]), flags)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(want), atol=2e-5)
  w = jnp.cos(jnp.arange(128.0))
  grads = [jax.grad(lambda *x: (run(backend, *x)[0] * w).sum(), argnums=(0, 1, 2))(q, k, v)
           for backend in ("pallas", "xla")]
  for a, b in zip(*grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
