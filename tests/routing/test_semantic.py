"""The semantic layout against independent references: float64 softmax over the pairs its order
and tile table keep (plus, compensated, one pseudo-key per skipped key sub-block), brute-force
orders, the band's per-row budget, the router's own errors, one compile as the data changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.attention import semantic_placed_attention, svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.tiles import plan_tiles
from maxdiffusion_svg.routing.layouts import LAYOUTS, check_layouts
from maxdiffusion_svg.routing.semantic import (SemanticConfig, cluster_order, gather_tokens,
                                               group_size, placed_positions, semantic_layout,
                                               token_positions, visited_table)

GRID = VideoGrid(6, 8, 20)  # 960 tokens: the last 128-key tile is padded; groups of 4
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
SEMANTIC_ID = LAYOUTS.index("semantic")


def qkv(dtype=jnp.float32, dim=64, heads=2, seed=0, grid=GRID):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((1, heads, grid.tokens, dim)), dtype) for _ in range(3)]


def reference(q, k, v, sem, plan, blocks=0):
  """Each head in float64, in frame-major order: query t keeps key u where the head's table
  visits (tile of t's placed position, tile of u's); compensated, plus the mean key and value
  of every sub-block (of placed positions) of each tile its row skips, logit + log(count)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, h, s, d = q.shape
  q_pos = np.asarray(token_positions(sem.q_pos, s))
  k_pos = np.asarray(token_positions(sem.k_pos, s))
  visited = np.asarray(visited_table(sem.kv_index, plan))
  out = np.zeros_like(v)
  for bi in range(b):
    for hi in range(h):
      rows, cols = q_pos[bi, hi] // plan.block_q, k_pos[bi, hi] // plan.block_kv
      keep = visited[bi, hi][rows[:, None], cols[None, :]]
      logits = np.where(keep, q[bi, hi] @ k[bi, hi].T * d ** -0.5, -np.inf)
      values = v[bi, hi]
      if blocks:
        size = plan.block_kv // blocks
        order = np.argsort(k_pos[bi, hi])  # the frame-major key at each placed position
        keys, vals, logs, tiles = [], [], [], []
        for start in range(0, s, size):
          members = order[start:min(start + size, s)]
          keys.append(k[bi, hi, members].mean(0))
          vals.append(v[bi, hi, members].mean(0))
          logs.append(np.log(members.size))
          tiles.append(start // plan.block_kv)
        extra = q[bi, hi] @ np.stack(keys).T * d ** -0.5 + np.array(logs)
        extra = np.where(~visited[bi, hi][rows[:, None], np.array(tiles)[None, :]], extra, -np.inf)
        logits = np.concatenate([logits, extra], axis=1)
        values = np.concatenate([values, np.stack(vals)])
      w = np.exp(logits - logits.max(1, keepdims=True))
      out[bi, hi] = (w / w.sum(1, keepdims=True)) @ values
  return out


@pytest.mark.parametrize("group", [1, 2, 4])
def test_order_is_a_permutation_and_restores_exactly(group):
  x = jax.random.normal(jax.random.key(0), (2, 3, GRID.tokens, 32))
  perm, pos = (np.asarray(a) for a in cluster_order(x, 5, 2, group)[:2])
  n = GRID.tokens // group
  assert perm.shape == (2, 3, n)
  for p, inv in zip(perm.reshape(-1, n), pos.reshape(-1, n)):
    assert sorted(p) == list(range(n))
    np.testing.assert_array_equal(inv[p], np.arange(n))
  placed = gather_tokens(x, jnp.asarray(perm))
  np.testing.assert_array_equal(gather_tokens(placed, jnp.asarray(pos)), x)
  tokens = np.asarray(token_positions(jnp.asarray(pos), GRID.tokens))
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(placed), tokens[..., None], 2), x)


def test_counted_positions_equal_a_stable_sort():
  slot = jax.random.randint(jax.random.key(1), (2, 2, 700), 0, 9)
  want = np.argsort(np.argsort(np.asarray(slot), axis=-1, kind="stable"), axis=-1, kind="stable")
  np.testing.assert_array_equal(placed_positions(slot, 9), want)


def test_each_row_visits_the_bands_count_of_distinct_tiles():
  plan = plan_tiles(GRID, 0.25, 128, 128, "aligned")
  q, k, v = qkv(heads=3)
  sem = semantic_layout(q, k, v, plan, SemanticConfig(clusters=6), group=group_size(GRID))
  table = np.asarray(sem.kv_index)
  for head in table.reshape(-1, *table.shape[2:]):
    for row, count in zip(head, plan.num_visited):
      used = row[:count]
      assert (np.diff(used) > 0).all() and used.min() >= 0 and used.max() < plan.num_kv_tiles
      assert (row[count:] == used[-1]).all()  # the plan's packing
  visited = np.asarray(visited_table(sem.kv_index, plan))
  np.testing.assert_array_equal(visited.sum(-1), np.broadcast_to(plan.num_visited, visited.shape[:-1]))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("blocks", [0, 4])
def test_semantic_call_matches_the_float64_rule(backend, dtype, blocks):
  plan = plan_tiles(GRID, 0.3, 128, 128, "aligned")
  dim = 128 if backend == "pallas" else 64
  q, k, v = qkv(dtype, dim)
  config = SemanticConfig(clusters=5, iterations=2, blocks=blocks or 8, compensated=bool(blocks))
  sem = semantic_layout(q, k, v, plan, config, group=group_size(GRID))
  layout = jnp.full(q.shape[:2], SEMANTIC_ID, jnp.int32)
  out = semantic_placed_attention(q, k, v, layout, sem, grid=GRID, plan=plan, backend=backend,
                                  compensation_blocks=blocks, cents=None)
  np.testing.assert_allclose(np.asarray(out, np.float64), reference(q, k, v, sem, plan, blocks),
                             atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_splash_naive_tiles_and_rings_are_refused_naming_the_keys():
  with pytest.raises(ValueError, match="svg_backend pallas, xla or auto"):
    SvgConfig(layouts=["semantic"], backend="splash")
  with pytest.raises(ValueError, match="svg_tile_mode aligned"):
    SvgConfig(layouts=["spatial", "semantic"], tile_mode="naive")
  plan = plan_tiles(GRID, 0.3, 128, 128, "aligned")
  q, k, v = qkv()
  sem = semantic_layout(q, k, v, plan, SemanticConfig(clusters=4), group=4)
  from maxdiffusion_svg.kernels import sparse_attention  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="needs svg_backend pallas or xla"):
    sparse_attention(q, k, v, plan, backend="splash", head_tiles=sem.kv_index)


@pytest.mark.parametrize("kw,match", [
    (dict(layouts=["spatial", "bogus"]), r"svg_layouts: unknown layout\(s\) 'bogus'; allowed: "
                                         r"spatial, temporal, semantic"),
    (dict(layouts=[]), "svg_layouts must be a non-empty list"),
    (dict(layouts=["temporal", "temporal"]), "lists a layout twice"),
    (dict(semantic_clusters=0), "svg_semantic_clusters must be an integer >= 1"),
    (dict(semantic_iterations=0), "svg_semantic_iterations must be an integer >= 1"),
    (dict(semantic_iterations=1.5), "svg_semantic_iterations must be an integer >= 1"),
])
def test_bad_values_are_refused_naming_the_key(kw, match):
  with pytest.raises(ValueError, match=match):
    SvgConfig(**kw)


def test_more_clusters_than_tokens_is_refused_at_the_call():
  config = SvgConfig(density=0.3, block_q=128, block_kv=128, backend="xla", layouts=["semantic"],
                     semantic_clusters=GRID.tokens + 1)
  with pytest.raises(ValueError, match=rf"svg_semantic_clusters must be an integer >= 1 and <= "
                                       rf"the tokens \({GRID.tokens}\)"):
    svg_attention(*qkv(), grid=GRID, config=config)


def test_layouts_read_from_yaml_text_and_lists_in_canonical_order():
  assert check_layouts("[semantic, spatial]") == ("spatial", "semantic")
  assert check_layouts("temporal,semantic") == ("temporal", "semantic")
  config = SvgConfig.from_mapping({"svg_layouts": "[spatial, temporal, semantic]",
                                   "svg_semantic_clusters": 16, "svg_semantic_iterations": 2})
  assert config.layouts == ("spatial", "temporal", "semantic")
  assert (config.semantic.clusters, config.semantic.iterations) == (16, 2)
  assert SvgConfig().semantic is None and SvgConfig().layouts == ("spatial", "temporal")


def planted(heads=("spatial", "temporal", "moving", "moving"), grid=VideoGrid(8, 8, 16)):
  return grid, [jnp.asarray(x) for x in planted_qkv(grid, heads, 64, seed=3)]


def test_router_takes_the_least_estimate_and_info_reports_it():
  grid, (q, k, v) = planted()
  config = SvgConfig(density=0.25, block_q=128, block_kv=128, backend="xla",
                     layouts=["spatial", "temporal", "semantic"], semantic_clusters=8)
  out, info = svg_attention(q, k, v, grid=grid, config=config, return_info=True)
  # the static winner by its sampled error, then semantic where its estimate is lower
  winner = (np.asarray(info["temporal_error"]) < np.asarray(info["spatial_error"])).astype(int)
  left_out = np.asarray(info["left_out"])
  static = np.take_along_axis(left_out, winner[..., None], -1)[..., 0]
  np.testing.assert_array_equal(info["layout"], np.where(left_out[..., 2] < static, 2, winner))
  np.testing.assert_array_equal(info["temporal"], np.asarray(info["layout"]) == 1)
  plan = config.plan(grid, backend="xla")
  np.testing.assert_array_equal(info["visited_tiles"], np.full((1, 4), plan.stats.visited_tiles))
  assert (np.asarray(info["layout"])[0, 2:] == SEMANTIC_ID).all()  # moving heads
  # Forced: every head semantic; two layouts: today's router, bit for bit.
  forced = SvgConfig(density=0.25, block_q=128, block_kv=128, backend="xla", layouts=["semantic"],
                     semantic_clusters=8)
  _, info = svg_attention(q, k, v, grid=grid, config=forced, return_info=True)
  assert (np.asarray(info["layout"]) == SEMANTIC_ID).all()
  two = SvgConfig(density=0.25, block_q=128, block_kv=128, backend="xla")
  out2, info2 = svg_attention(q, k, v, grid=grid, config=two, return_info=True)
  out3, info3 = svg_attention(q, k, v, grid=grid, return_info=True,
                              config=SvgConfig(density=0.25, block_q=128, block_kv=128,
                                               backend="xla", layouts=["spatial", "temporal"]))
  np.testing.assert_array_equal(out2, out3)
  np.testing.assert_array_equal(info2["layout"], np.asarray(info2["temporal"]).astype(int))


def test_one_compile_as_the_clusters_change():
  grid = VideoGrid(4, 8, 16)
  config = SvgConfig(density=0.3, block_q=128, block_kv=128, backend="xla",
                     layouts=["spatial", "temporal", "semantic"], semantic_clusters=4,
                     compensation=True, compensation_blocks=4)
  plan = config.plan(grid, backend="xla")
  traces = []

  @jax.jit
  def run(q, k, v):
    traces.append(1)
    table = semantic_layout(q, k, v, plan, config.semantic, group=group_size(grid)).kv_index
    return svg_attention(q, k, v, grid=grid, config=config, return_info=True)[1]["layout"], table

  tables = {np.asarray(run(*qkv(grid=grid, heads=3, seed=seed))[1]).tobytes() for seed in range(3)}
  assert len(tables) > 1  # the data changed each head's tiles...
  assert len(traces) == 1 and run._cache_size() == 1  # ...and nothing traced or compiled again


@pytest.mark.parametrize("ulysses", [None, 4])  # all 8 devices exchange heads; a ring of 2
def test_head_exchange_equals_one_device_and_a_ring_leaves_semantic_out(ulysses):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.parallel.sharding import sharded_svg_attention  # pylint: disable=import-outside-toplevel
  grid, (q, k, v) = planted(("moving", "spatial") * 4, VideoGrid(6, 8, 16))
  config = SvgConfig(density=0.3, block_q=128, block_kv=128, backend="xla",
                     layouts=["spatial", "temporal", "semantic"], semantic_clusters=4)
  key = jax.random.key(7)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 1, 8, 1), ("data", "fsdp", "context", "tensor"))
  spec = NamedSharding(mesh, P(("data", "fsdp"), None, "context", None))
  run = lambda config: jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=grid, config=config, key=key, ulysses_shards=ulysses))(
          *(jax.device_put(x, spec) for x in (q, k, v)))
  if ulysses is not None:  # the ring runs the static layouts: the same as asking for them
    static = SvgConfig(density=0.3, block_q=128, block_kv=128, backend="xla")
    np.testing.assert_array_equal(np.asarray(run(config)), np.asarray(run(static)))
    with pytest.raises(ValueError, match=r"svg_layouts \[semantic\] cannot run on a ring "
                                         r"\(ulysses_shards 4 leaves the sequence split over 2"):
      run(SvgConfig(density=0.3, block_q=128, block_kv=128, backend="xla", layouts=["semantic"]))
    return
  want = svg_attention(q, k, v, grid=grid, config=config, key=key)
  np.testing.assert_allclose(np.asarray(run(config)), np.asarray(want), atol=2e-5)


def test_the_settings_line_names_the_layouts():
  from maxdiffusion_svg.plugin.settings import PluginSettings  # pylint: disable=import-outside-toplevel
  line = PluginSettings.from_mapping({"svg_layouts": "[spatial, temporal, semantic]",
                                      "svg_semantic_clusters": 16}).summary()
  assert ", layouts spatial, temporal, semantic (16 clusters, k-means 4 iterations every step), " in line
  warm = PluginSettings.from_mapping({"svg_layouts": "[spatial, temporal, semantic]",
                                      "svg_semantic_warm_iterations": 1}).summary()
  assert ("semantic (32 clusters, k-means 4 iterations cold, 1 warm from the previous step's "
          "centroids), ") in warm
  assert ", layouts spatial, temporal, dense kernel" in PluginSettings.from_mapping({}).summary()
  on_ring = PluginSettings.from_mapping({"svg_layouts": "[spatial, temporal, semantic]"}).summary(
      ring=(8, 2))
  assert ("iterations every step) (semantic left out on the ring "
          "(ulysses_shards 8, sequence split over 2 devices): layouts [spatial, temporal]), ") in on_ring
