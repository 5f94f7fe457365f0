"""Per-head budgets: each head at its own density in one kernel call, against each head's own
dense masked softmax in float64; the ragged grid's cost and its static bound against brute
force over every device's window of heads."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.per_head import check_head_densities, head_budget
from maxdiffusion_svg.budgets.schedule import Interval, Schedule
from maxdiffusion_svg.call.attention import scheduled_svg_attention, svg_attention
from maxdiffusion_svg.kernels.api import sparse_attention
from maxdiffusion_svg.kernels.worklist import pack_ragged_work, ragged_cores, unpack_work
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.geometry import TokenOrder, VideoGrid, layout_positions
from maxdiffusion_svg.plan.tiles import EMPTY
from maxdiffusion_svg.routing.router import route_heads

GRID = VideoGrid(5, 7, 15)  # 525 tokens: 5 tiles of 128, the last one padded
DENSITIES = (0.15, 0.9, 0.35, 0.6, 1.0)


def _inputs(batch, heads, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(key, (batch, heads, GRID.tokens, 128), jnp.float32)
               for key in keys)


def _reference(q, k, v, budget, head_ids):
  """Each head's softmax over its own plan's computed mask, in float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.zeros_like(v)
  for b in range(q.shape[0]):
    for j in range(q.shape[1]):
      mask = budget.plans[0][int(head_ids[b, j])].dense_mask()
      s = np.where(mask, q[b, j] @ k[b, j].T / np.sqrt(q.shape[-1]), -np.inf)
      p = np.exp(s - s.max(axis=1, keepdims=True))
      out[b, j] = (p / p.sum(axis=1, keepdims=True)) @ v[b, j]
  return out


def _call(q, k, v, budget, head_ids, backend):
  return sparse_attention(q, k, v, budget.carrier, backend=backend,
                          head_tiles=budget.tables_for(head_ids),
                          head_steps=budget.steps_bound(*head_ids.shape))


@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("batch,heads", [(2, 5), (1, 3)])
def test_each_head_attends_under_its_own_density(backend, batch, heads):
  budget = head_budget(GRID, DENSITIES, 128, 128)
  # Every window of heads a device may hold: here heads (h0 + j) mod 5 from h0 = 3.
  head_ids = np.broadcast_to((3 + np.arange(heads)) % len(DENSITIES), (batch, heads))
  q, k, v = _inputs(batch, heads)
  out = _call(q, k, v, budget, jnp.asarray(head_ids), backend)
  np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, budget, head_ids),
                             atol=2e-5, rtol=2e-5)
  # Heads at different densities really ran different masks.
  assert len({plan.stats.visited_tiles for plan in budget.plans[0]}) >= 3


def test_gradients_match_each_heads_masked_softmax():
  budget = head_budget(GRID, DENSITIES[:3], 128, 128)
  head_ids = jnp.broadcast_to(jnp.arange(3), (1, 3))
  q, k, v = _inputs(1, 3, seed=1)
  masks = jnp.stack([jnp.asarray(budget.plans[0][h].dense_mask()) for h in range(3)])

  def dense(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(128)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(jnp.where(masks, s, -jnp.inf), -1), v)

  loss = lambda f: lambda *x: jnp.sum(f(*x) * jnp.cos(jnp.arange(128.0)))
  got = jax.grad(loss(lambda *x: _call(*x, budget, head_ids, "pallas")), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-4, rtol=2e-4)


def _real_steps(work):
  kind = unpack_work(np.asarray(work))[2]
  return int((kind != EMPTY).sum())


@pytest.mark.parametrize("batch,local_heads", [(1, 2), (2, 3), (1, 7), (3, 5)])
def test_ragged_cost_follows_the_heads_and_the_bound_holds_on_every_device(batch, local_heads):
  budget = head_budget(GRID, DENSITIES, 128, 128)
  bound = budget.steps_bound(batch, local_heads)
  worst = 0
  for start in range(budget.heads):  # every window a device may hold
    ids = np.broadcast_to((start + np.arange(local_heads)) % budget.heads, (batch, local_heads))
    tables = budget.tables_for(jnp.asarray(ids))
    work, heads = pack_ragged_work(budget.carrier, tables, bound, ragged_cores(ids.size))
    cores = np.asarray(work).reshape(ragged_cores(ids.size), bound)
    # The call walks exactly its heads' tiles: no step of the widest head's carrier.
    assert sum(_real_steps(c) for c in cores) == budget.head_steps[0][ids].sum()
    worst = max(worst, max(_real_steps(c) for c in cores))
    # Each step names a head of its core's contiguous group.
    per = -(-ids.size // ragged_cores(ids.size))
    groups = np.asarray(heads).reshape(cores.shape) // per
    assert (groups == np.arange(cores.shape[0])[:, None]).all()
  assert worst == bound  # tight: some device needs all of it
  assert budget.visited_tiles() == sum(plan.stats.visited_tiles for plan in budget.plans[0])
  assert budget.visited_tiles() < budget.heads * budget.carrier.stats.visited_tiles


def test_carrier_holds_every_heads_row_and_tables_mark_the_rest():
  budget = head_budget(GRID, DENSITIES, 128, 128)
  for h, plan in enumerate(budget.plans[0]):
    assert (plan.num_visited <= budget.carrier.num_visited).all()
    used = budget.tables[0, h] >= 0
    assert (used.sum(axis=1) == plan.num_visited).all()
    for row in range(plan.num_q_tiles):
      np.testing.assert_array_equal(budget.tables[0, h, row, :plan.num_visited[row]],
                                    plan.kv_index[row, :plan.num_visited[row]])


def test_head_densities_read_every_form():
  assert check_head_densities("uniform") is None and check_head_densities(None) is None
  assert check_head_densities([0.3, 1]) == ((0.3, 1.0),)  # one list of heads: every layer
  assert check_head_densities("[[0.3, 0.2], [0.5, 0.1]]") == ((0.3, 0.2), (0.5, 0.1))
  assert check_head_densities({"0-1": [0.3, 0.2], 2: [0.5, 0.1]}) == (
      (0.3, 0.2), (0.3, 0.2), (0.5, 0.1))


@pytest.mark.parametrize("value", [[0.3, 0.0], [1.2], "0.3", [True], [[0.3], []],
                                   [[0.3, 0.2], [0.3]], {"1": [0.3]}, "[0.3, "])
def test_bad_head_densities_are_refused_by_name(value):
  with pytest.raises(ValueError, match="svg_head_densities"):
    check_head_densities(value)


def test_per_layer_tables_share_one_carrier_and_one_bound():
  budget = head_budget(GRID, [[0.15, 0.35], [0.9, 0.15], [0.35, 0.35]], 128, 128)
  assert budget.layers == 3 and budget.heads == 2
  for layer in range(3):
    for h in range(2):
      plan = budget.plans[layer][h]
      assert (plan.num_visited <= budget.carrier.num_visited).all()
      assert (budget.visited[layer, h] == (plan.tile_map() != EMPTY)).all()
  ids = jnp.asarray([[1, 0]])
  traced = jax.jit(lambda layer: budget.tables_for(ids, layer))(1)
  np.testing.assert_array_equal(np.asarray(traced), budget.tables[1][[1, 0]][None])
  assert budget.steps_bound(1, 2) == budget.head_steps.max()  # a lane per head
  assert budget.steps_bound(2, 2) == budget.head_steps.sum(axis=1).max()  # a lane per example


def test_head_steps_without_tables_is_refused():
  budget = head_budget(GRID, DENSITIES[:2], 128, 128)
  q, k, v = _inputs(1, 2)
  with pytest.raises(ValueError, match="head_steps"):
    sparse_attention(q, k, v, budget.carrier, backend="xla", head_steps=10)


# --- The attention path: route each head under its own mask, run it on its own plan ----------

PLANTED_GRID = VideoGrid(6, 8, 16)  # 768 tokens: 96 per shard on 8
TYPES = ("spatial", "temporal", "temporal", "spatial", "temporal", "spatial", "spatial", "temporal")
HEADS = (0.15, 0.6, 0.3, 1.0, 0.15, 0.45, 0.3, 0.6)
KEY = jax.random.key(7)


def _config(heads=HEADS, **kw):
  return SvgConfig(**{"block_q": 128, "block_kv": 128, "backend": "xla", "profile_queries": 16,
                      "head_densities": heads, **kw})


def _planted(batch=2):
  return [jnp.asarray(x) for x in planted_qkv(PLANTED_GRID, TYPES, head_dim=32, seed=2,
                                              batch=batch)]


def _placed_reference(q, k, v, plans, temporal):
  """Each head's softmax, in float64, over its own plan's mask read in its routed order."""
  grid, tokens = PLANTED_GRID, np.arange(PLANTED_GRID.tokens)
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.zeros_like(v)
  for b in range(q.shape[0]):
    for h in range(q.shape[1]):
      layout = TokenOrder.TEMPORAL_MAJOR if temporal[b, h] else TokenOrder.FRAME_MAJOR
      pos = layout_positions(grid, layout, tokens)
      mask = plans[h].dense_mask()[np.ix_(pos, pos)]
      s = np.where(mask, q[b, h] @ k[b, h].T / np.sqrt(q.shape[-1]), -np.inf)
      p = np.exp(s - s.max(axis=1, keepdims=True))
      out[b, h] = (p / p.sum(axis=1, keepdims=True)) @ v[b, h]
  return out


def test_each_head_is_routed_and_run_at_its_own_density():
  q, k, v = _planted()
  cfg = _config()
  out, info = svg_attention(q, k, v, grid=PLANTED_GRID, config=cfg, key=KEY, return_info=True)
  budget = head_budget(PLANTED_GRID, HEADS, 128, 128)
  temporal = np.asarray(info["temporal"])
  assert temporal.any() and not temporal.all()
  np.testing.assert_allclose(np.asarray(out), _placed_reference(q, k, v, budget.plans[0], temporal),
                             atol=2e-5, rtol=2e-5)
  # Each head is routed as a call at its own density would route it (same sampled rows).
  for h, density in enumerate(HEADS):
    alone = route_heads(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], grid=PLANTED_GRID,
                        config=dataclasses.replace(cfg, head_densities=None, density=density),
                        key=KEY)
    np.testing.assert_array_equal(np.asarray(alone)[:, 0], temporal[:, h])
  np.testing.assert_array_equal(np.asarray(info["visited_tiles"]),
                                np.broadcast_to(budget.head_steps[0], temporal.shape))


def test_per_layer_head_densities_follow_a_traced_layer_in_one_compile():
  q, k, v = _planted(batch=1)
  layers = (HEADS, HEADS[::-1], (1.0,) * 8)
  cfg = _config(heads=layers, schedule=Schedule(active_steps=Interval(0, None)))
  traces = []

  def call(layer):
    traces.append(1)
    return scheduled_svg_attention(q, k, v, grid=PLANTED_GRID, config=cfg, step=0, layer=layer,
                                   key=KEY)

  run = jax.jit(call)
  for layer, heads in enumerate(layers):
    want = svg_attention(q, k, v, grid=PLANTED_GRID, config=_config(heads=heads),
                         key=jax.random.fold_in(jax.random.fold_in(KEY, layer), 0))
    np.testing.assert_allclose(np.asarray(run(jnp.int32(layer))), np.asarray(want), atol=1e-5)
  assert len(traces) == 1


@pytest.mark.parametrize("shape", [(1, 1, 8, 1), (2, 1, 4, 1), (1, 2, 2, 2)])
def test_sharded_equals_one_device(shape):
  """The device's head ids travel with its heads through the exchange (with the CFG batch
  folded in where nothing shards it), so every device walks its own heads' tables."""
  devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  mesh = Mesh(devices, ("data", "fsdp", "context", "tensor"))
  q, k, v = _planted()
  cfg = _config()
  want, want_info = svg_attention(q, k, v, grid=PLANTED_GRID, config=cfg, key=KEY, return_info=True)
  spec = NamedSharding(mesh, P(("data", "fsdp"), None, "context", None))
  qs, ks, vs = (jax.device_put(x, spec) for x in (q, k, v))
  out, info = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=PLANTED_GRID, config=cfg, key=KEY, return_info=True))(qs, ks, vs)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(info["temporal"]), np.asarray(want_info["temporal"]))


def test_per_head_budgets_refuse_what_they_cannot_run_by_key():
  q, k, v = _planted(batch=1)
  with pytest.raises(ValueError, match="svg_head_densities lists 3 heads; the call has 8"):
    svg_attention(q, k, v, grid=PLANTED_GRID, config=_config(heads=(0.3, 0.3, 0.3)), key=KEY)
  with pytest.raises(ValueError, match="svg_head_densities gives 2 layers"):
    svg_attention(q, k, v, grid=PLANTED_GRID, config=_config(heads=(HEADS, HEADS)), key=KEY)
  for extra, match in (({"layer_compensation": (True,)}, "svg_layer_compensation"),
                       ({"tile_mode": "split"}, "aligned"),
                       ({"backend": "splash"}, "Splash"),
                       ({"layer_densities": (0.3,)}, "svg_layer_densities"),
                       ({"layouts": ("spatial", "temporal", "semantic")}, "semantic")):
    with pytest.raises(ValueError, match=match):
      _config(**extra)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 1, 8, 1), ("data", "fsdp", "context", "tensor"))
  with pytest.raises(ValueError, match="svg_head_densities does not run on a ring"):
    sharded_svg_attention(q, k, v, mesh=mesh, grid=PLANTED_GRID, config=_config(), key=KEY,
                          ulysses_shards=2)


def test_with_compensation_each_head_is_its_own_compensated_call():
  """``svg_compensation`` with per-head densities: each head's skipped tiles (its own) are
  compensated by its layout's centroids, and it is routed as a compensated call at its own
  density would route it: each head equals that call on the head alone."""
  q, k, v = _planted(batch=1)
  cfg = _config(compensation=True, compensation_blocks=4)
  out, info = svg_attention(q, k, v, grid=PLANTED_GRID, config=cfg, key=KEY, return_info=True)
  plain = svg_attention(q, k, v, grid=PLANTED_GRID, config=_config(), key=KEY)
  assert not np.allclose(np.asarray(out), np.asarray(plain), atol=1e-4)
  for h, density in enumerate(HEADS):
    alone, alone_info = svg_attention(
        q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], grid=PLANTED_GRID, key=KEY, return_info=True,
        config=dataclasses.replace(cfg, head_densities=None, density=density))
    np.testing.assert_array_equal(np.asarray(alone_info["temporal"])[:, 0],
                                  np.asarray(info["temporal"])[:, h])
    np.testing.assert_allclose(np.asarray(out)[:, h], np.asarray(alone)[:, 0], atol=2e-5,
                               rtol=2e-5)
