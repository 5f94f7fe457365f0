"""The three-layout router: its whole-sequence estimate against a float64 rule, its choice against
the best single layout on planted heads, no margin, and one compile as the data changes it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.bench.synthetic import MovingScene, planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.attention import svg_attention
from maxdiffusion_svg.kernels import dense_attention
from maxdiffusion_svg.plan.geometry import VideoGrid, to_temporal_major
from maxdiffusion_svg.routing import router
from maxdiffusion_svg.routing.compensation import ordered_block_means
from maxdiffusion_svg.routing.layouts import LAYOUTS
from maxdiffusion_svg.routing.semantic import semantic_layout, token_positions, visited_table

LAYOUT_NAMES = ("spatial", "temporal", "semantic")
SEMANTIC_ID = LAYOUTS.index("semantic")


def _config(density, layouts=LAYOUT_NAMES, **kw):
  return SvgConfig(density=density, tile_mode="aligned", block_q=128, block_kv=128, backend="xla",
                   layouts=tuple(layouts), semantic_clusters=8, **kw)


def _left_out_reference(q, k, key_pos, row_tiles, visited, block_kv, size):
  """One head in float64: key sub-blocks of ``size`` placed positions, their mean key and count;
  each row's softmax over ``scale q.k_mean + log(count)``, summed over the blocks of the key
  tiles its query tile skips."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  order = np.argsort(key_pos)
  scale = q.shape[-1] ** -0.5
  means, logs, tiles = [], [], []
  for start in range(0, len(order), size):
    members = order[start:start + size]
    means.append(k[members].mean(0))
    logs.append(np.log(members.size))
    tiles.append(start // block_kv)
  logits = scale * q @ np.stack(means).T + np.array(logs)
  share = np.exp(logits - logits.max(1, keepdims=True))
  share /= share.sum(1, keepdims=True)
  skipped = ~visited[row_tiles[:, None], np.array(tiles)[None, :]]
  return (share * skipped).sum(1).mean()


@pytest.mark.parametrize("group", [1, 4])
def test_left_out_matches_the_float64_rule_for_each_layout(group):
  grid = VideoGrid(6, 8, 20)  # 960 tokens: the last key tile is padded
  q, k, v = (jnp.asarray(x) for x in planted_qkv(grid, ("moving", "temporal"), 32, seed=1))
  config = _config(0.3)
  plan = config.plan(grid, backend="xla")
  sem = semantic_layout(q, k, v, plan, config.semantic, group=group)
  rows = jnp.arange(0, grid.tokens, 7, dtype=jnp.int32)
  got = np.asarray(router.layout_left_out(q, k, rows, grid, plan, sem, LAYOUT_NAMES,
                                          q.shape[-1] ** -0.5))
  static = plan.tile_map() != 0
  frame_major = np.arange(grid.tokens)
  temporal_pos = np.asarray(to_temporal_major(jnp.asarray(frame_major)[None, None, :, None],
                                              grid))[0, 0, :, 0]
  temporal_pos = np.argsort(temporal_pos)  # each frame-major token's temporal-major position
  r = np.asarray(rows)
  for h in range(2):
    placements = {"spatial": (frame_major, static), "temporal": (temporal_pos, static),
                  "semantic": (np.asarray(token_positions(sem.q_pos, grid.tokens))[0, h],
                               np.asarray(visited_table(sem.kv_index, plan))[0, h])}
    for i, name in enumerate(LAYOUT_NAMES):
      pos, visited = placements[name]
      key_pos = pos if name != "semantic" else np.asarray(token_positions(sem.k_pos, grid.tokens))[0, h]
      want = _left_out_reference(q[0, h, r], k[0, h], key_pos, pos[r] // plan.block_q, visited,
                                 plan.block_kv, router.ESTIMATE_KEYS)
      assert got[0, h, i] == pytest.approx(want, rel=2e-4, abs=1e-7), (name, h)


def test_ordered_means_equal_the_means_of_the_placed_copy():
  """The strided gathers give each sub-block's mean of the placed real tokens: a partial last
  sub-block and whole padding ones (count 0) included."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(1, 2, 300, 16)).astype(np.float32)
  order = rng.permutation(300)
  got = np.asarray(ordered_block_means(jnp.asarray(x), order, block_kv=128, blocks=16))
  placed = np.concatenate([x[:, :, order], np.zeros((1, 2, 84, 16), np.float32)], axis=2)
  counts = np.minimum(np.maximum(300 - np.arange(48) * 8, 0), 8)
  want = placed.reshape(1, 2, 48, 8, 16).sum(3) / np.maximum(counts, 1)[:, None]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_no_margin_the_lower_estimate_wins_and_ties_stay_static():
  errors = {"spatial": jnp.array([[1.0, 2.0, 1.0]]), "temporal": jnp.array([[2.0, 1.0, 1.0]])}
  # the static winner by the sampled errors: spatial, temporal, spatial (a tie goes to spatial)
  estimates = jnp.array([[[0.5, 9.0, 0.5 * 0.999], [9.0, 0.5, 0.5 * 1.001], [0.5, 0.1, 0.5]]])
  layout = router.choose_layouts(errors, estimates, LAYOUT_NAMES)
  np.testing.assert_array_equal(layout, [[SEMANTIC_ID, 1, 0]])
  assert not hasattr(router, "SEMANTIC_MARGIN")
  only = router.choose_layouts(errors, estimates, ("semantic",))
  np.testing.assert_array_equal(only, [[SEMANTIC_ID] * 3])


def _heads(grid):
  sharp = planted_qkv(grid, ("spatial", "temporal", "moving", "moving"), 64, seed=3)
  other = planted_qkv(grid, ("moving",), 64, seed=4, scene=MovingScene(objects=2, pan=1.0))
  return [jnp.asarray(np.concatenate(pair, axis=1)) for pair in zip(sharp, other)]


@pytest.mark.parametrize("density", [0.2, 0.35])
def test_choice_is_the_best_single_layout_on_planted_heads(density):
  grid = VideoGrid(8, 8, 16)
  q, k, v = _heads(grid)
  dense = np.asarray(dense_attention(q, k, v))
  errors = []
  for name in LAYOUT_NAMES:
    out = svg_attention(q, k, v, grid=grid, config=_config(density, (name,)))
    errors.append(((np.asarray(out) - dense) ** 2).mean((-1, -2))[0])
  errors = np.stack(errors, -1)  # [H, layouts]
  best = np.argmin(errors, -1)
  assert best[1] == 1 and (best[2:] == SEMANTIC_ID).all()  # temporal; semantic for moving content
  _, info = svg_attention(q, k, v, grid=grid, config=_config(density), return_info=True)
  chosen = np.asarray(info["layout"])[0]
  # the best single layout, or one within 0.1 dB of it (the spatial head: spatial and semantic
  # both exact to float precision)
  np.testing.assert_array_less(errors[np.arange(5), chosen], errors.min(-1) * 10 ** 0.01 + 1e-12)
  np.testing.assert_array_equal(chosen[1:], best[1:])
  assert np.asarray(info["left_out"]).shape == (1, 5, len(LAYOUTS))


def test_one_compile_while_the_data_changes_the_choice():
  grid = VideoGrid(8, 8, 16)
  config = _config(0.3)
  traces = []

  @jax.jit
  def run(q, k, v):
    traces.append(1)
    return svg_attention(q, k, v, grid=grid, config=config, return_info=True)[1]["layout"]

  choices = []
  for kinds in (("spatial", "moving"), ("moving", "temporal"), ("temporal", "spatial")):
    choices.append(np.asarray(run(*(jnp.asarray(x) for x in planted_qkv(grid, kinds, 64, seed=5))))[0])
  assert len({tuple(c) for c in choices}) == 3 and SEMANTIC_ID in np.concatenate(choices)
  assert len(traces) == 1 and run._cache_size() == 1
