"""The ring's static plans against brute force: each shard's rows and window, the key fetch and the
temporal placement, simulated in NumPy on small grids; what they move at real sizes."""

import numpy as np
import pytest

from maxdiffusion_svg.parallel.ring_placement import ring_placement
from maxdiffusion_svg.parallel.ring_plan import (check_ulysses_shards, key_fetch, ring_split,
                                                 window_plan, window_tiles)
from maxdiffusion_svg.plan.geometry import VideoGrid, grid_for_resolution, temporal_major_order
from maxdiffusion_svg.plan.tiles import EMPTY, plan_tiles

GRIDS = [VideoGrid(6, 8, 16), VideoGrid(5, 6, 9), VideoGrid(7, 12, 20)]


def plans(grid):
  for mode in ("aligned", "split", "naive"):
    for density in (0.15, 0.4, 1.0):
      yield plan_tiles(grid, density, 128, 256, mode)


def shards(x, split):
  """``x`` (the sequence) in the plan's ring shards: ``[R, chunk]``, zeros past each shard."""
  out = np.zeros((split.ring, split.chunk), x.dtype)
  for r, (first, stop) in enumerate(zip(split.starts, split.starts[1:])):
    piece = x[first:min(stop, x.size)]
    out[r, :piece.size] = piece
  return out


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("ring", [2, 3, 4])
def test_each_shard_runs_its_rows_of_the_single_device_plan_on_its_window(grid, ring):
  for plan in plans(grid):
    split = ring_split(grid.tokens, ring, 2, plan.block_q)
    assert all(a % plan.block_q == 0 for a in split.starts)
    assert split.padded_len >= grid.tokens and split.starts[0] == 0
    seen = np.zeros_like(plan.tile_map())
    for r in range(ring):
      local = window_plan(plan, split, r)
      tiles = window_tiles(plan, split, r)
      unused = local.num_kv_tiles - tiles.size
      local_map = local.tile_map()
      rows, cols = np.nonzero(local_map)
      assert (cols >= unused).all()
      global_rows = rows + split.starts[r] // plan.block_q
      seen[global_rows, tiles[cols - unused]] = local_map[rows, cols]
      # The local rule is the global one, moved: queries by the shard's offset, keys by
      # the window's runs (brute force over every local pair).
      q = np.arange(split.chunk)[:, None]
      k = np.arange(local.num_kv_tiles * plan.block_kv)[None, :]
      global_k = np.full(k.shape, grid.tokens + 1)
      for j, t in enumerate(tiles):
        span = slice((unused + j) * plan.block_kv, (unused + j + 1) * plan.block_kv)
        global_k[0, span] = t * plan.block_kv + np.arange(plan.block_kv)
      size = split.starts[r + 1] - split.starts[r]
      want = plan.mask.contains(q + split.starts[r], global_k) & (q < size)
      np.testing.assert_array_equal(local.mask.contains(q, k), want)
      if not plan.masks_exact:  # aligned: masked tiles only drop keys past the sequence
        fetched = slice(unused * plan.block_kv, None)  # unused slots are never visited
        np.testing.assert_array_equal(local.masked_tile_rule(q, k)[0, fetched],
                                      global_k[0, fetched] < grid.tokens)
    np.testing.assert_array_equal(seen, plan.tile_map())


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("ring", [2, 4, 5])
def test_the_fetch_assembles_each_window_from_the_shards_holding_it(grid, ring):
  keys = np.arange(1, grid.tokens + 1, dtype=np.int64)  # 0 = nothing
  for plan in plans(grid):
    split = ring_split(grid.tokens, ring, 1, plan.block_q)
    fetch = key_fetch(plan, split)
    held = shards(keys, split).reshape(ring, -1, fetch.piece)
    for r in range(ring):
      window = np.zeros((fetch.window_pieces + 1, fetch.piece), np.int64)  # +1: dropped
      take = lambda shard, idx: np.where((idx < held.shape[1])[:, None],
                                         held[shard][np.minimum(idx, held.shape[1] - 1)], 0)
      window[fetch.own_dst[r]] = take(r, fetch.own_src[r])
      sources = [held[r]]
      for hop in fetch.hops:
        got = np.zeros((hop.send.shape[1], fetch.piece), np.int64)
        for src, dst in hop.pairs:
          if dst == r:
            window[hop.recv[r]] = got = take(src, hop.send[src])
        sources.append(got)
      if fetch.broadcasts_sink:
        window[fetch.sink_dst[r]] = take(0, fetch.sink_src)
      sources.append(take(0, fetch.sink_src))
      window = window[:-1].reshape(-1)
      # What the shard runs: a sum of one gather per source (written above slot by slot).
      summed = sum(np.concatenate([source, np.zeros((1, fetch.piece), np.int64)])[
          np.minimum(part[r], len(source))] for source, part in zip(sources, fetch.window_parts))
      np.testing.assert_array_equal(summed.reshape(-1), window)
      tiles = window_tiles(plan, split, r)
      unused = fetch.slots - tiles.size
      want = np.zeros(fetch.slots * plan.block_kv, np.int64)
      for j, t in enumerate(tiles):
        span = np.arange(t * plan.block_kv, (t + 1) * plan.block_kv)
        want[(unused + j) * plan.block_kv:(unused + j + 1) * plan.block_kv] = np.where(
            span < grid.tokens, span + 1, 0)
      np.testing.assert_array_equal(window, want)
      assert fetch.shards_fetched()[r] <= ring - 1


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("ring,ulysses", [(2, 1), (3, 2), (4, 4)])
def test_placement_across_the_ring_and_back(grid, ring, ulysses):
  """From the exchange's shards to the plan's, frame-major (spatial heads) and temporal-major
  (temporal heads), and back: simulated gather / all-to-all / gather."""
  split = ring_split(grid.tokens, ring, ulysses, 128)
  assert split.natural % ulysses == 0 and split.natural_len >= grid.tokens
  spatial, temporal = ring_placement(grid.frames, grid.frame_size, split)
  assert (spatial is None) == split.aligned
  tokens = np.arange(1, grid.tokens + 1)
  x = np.zeros(split.natural_len, np.int64)
  x[:grid.tokens] = tokens
  x = x.reshape(ring, split.natural)

  def move(held, send, place):  # each side a gather; out-of-range entries are zeros
    sent = np.concatenate([held, np.zeros((ring, 1), held.dtype)], axis=1)
    kept = [np.concatenate([sent[s][send[s, d]] for s in range(ring)] + [held[d], [0]])
            for d in range(ring)]  # what crossed the ring, then what stayed
    for d in range(ring):
      assert (send[d, d] == held.shape[1]).all()  # nothing is sent to itself
    return np.stack([kept[d][place[d]] for d in range(ring)])

  for perm, order in ((temporal, temporal_major_order(grid) + 1), (spatial, tokens)):
    if perm is None:
      continue
    assert perm.send.shape[2] == temporal.send.shape[2]  # one all-to-all serves both
    placed = move(x, perm.send, perm.place_from)
    np.testing.assert_array_equal(placed, shards(order, split))
    np.testing.assert_array_equal(move(placed, perm.recv, perm.back_from), x)


@pytest.mark.parametrize("resolution,ring", [("720p", 2), ("720p", 4), ("1440p", 4),
                                             ("1440p", 8)])
def test_a_sparse_shard_fetches_its_neighbours_and_the_sink_not_the_ring(resolution, ring):
  """Computed from the plan at real sizes (our kernel's tiles, density 0.2): each shard takes
  keys from at most 3 others, and far fewer than the (R - 1) shards a ring passes around."""
  grid = grid_for_resolution(resolution)
  plan = plan_tiles(grid, 0.2, 3328, 1536, "aligned")
  split = ring_split(grid.tokens, ring, 8, plan.block_q)
  assert split.padded_len < 1.06 * grid.tokens
  fetch = key_fetch(plan, split)
  assert fetch.shards_fetched().max() <= min(3, ring - 1)
  received = fetch.pieces_received() * fetch.piece
  assert received.max() < 0.75 * (ring - 1) * split.chunk
  if ring >= 4:
    assert received.max() < 0.5 * (ring - 1) * split.chunk
  dense = key_fetch(plan_tiles(grid, 1.0, 3328, 1536, "aligned"), split)
  assert (dense.shards_fetched() == ring - 1).all()


def test_ulysses_shards_splits_and_refusals():
  assert check_ulysses_shards(None, 8, 40) == (8, 1)
  assert check_ulysses_shards(-1, 8, 40) == (8, 1)
  assert check_ulysses_shards(0, 8, 40) == (8, 1)
  assert check_ulysses_shards(8, 32, 40) == (8, 4)
  assert check_ulysses_shards(4, 16, 80) == (4, 4)
  with pytest.raises(ValueError, match=r"ulysses_shards \(16\) must divide the model's 40 "
                                       r"attention heads.*: 1, 2, 4, 8$"):
    check_ulysses_shards(16, 16, 40)
  with pytest.raises(ValueError, match=r": 1, 2, 4, 8, or -1 \(Ulysses over all 8\)$"):
    check_ulysses_shards(3, 8, 40)
  with pytest.raises(ValueError, match=r"ulysses_shards \(3\) must divide the mesh's context "
                                       r"axis \(32 devices\) into Ulysses groups; values that "
                                       r"work on this mesh: 1, 2, 4, 8"):
    check_ulysses_shards(3, 32, 40)
  with pytest.raises(ValueError, match="ulysses_shards must be an integer, got 2.5"):
    check_ulysses_shards(2.5, 16, 40)
  with pytest.raises(ValueError, match="ulysses_shards must be an integer, got True"):
    check_ulysses_shards(True, 16, 40)


def test_plan_shards_are_whole_tiles_nearest_the_exchanges():
  split = ring_split(75600, 8, 8, 3328)  # 720p on a ring of 8
  assert split.natural == 9456 and split.chunk == 9984 and split.padded_len == 76544
  for r in range(8):
    assert abs(split.starts[r] - r * split.natural) <= 3328 // 2
  assert ring_split(768, 2, 4, 128).aligned and ring_split(768, 2, 4, 128).chunk == 384
  # More shards than tiles: some shards run no row, and their plans visit nothing.
  split = ring_split(768, 8, 1, 128)
  plan = plan_tiles(VideoGrid(6, 8, 16), 0.3, 128, 128, "aligned")
  empty = [r for r in range(8) if split.starts[r] == split.starts[r + 1]]
  assert empty and all((window_plan(plan, split, r).kind == EMPTY).all() for r in empty)


def test_a_shards_plan_checks_its_inputs_like_any_plan():
  """A window plan's inputs get the same checks as a square plan's, and its own shapes."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.kernels import sparse_attention  # pylint: disable=import-outside-toplevel
  plan = plan_tiles(VideoGrid(6, 8, 16), 0.3, 128, 128, "aligned")
  local = window_plan(plan, ring_split(768, 2, 1, 128), 1)
  q = jnp.zeros((1, 2, local.q_len, 32), jnp.float32)
  kv = jnp.zeros((1, 2, local.num_kv_tiles * 128, 32), jnp.float32)
  assert sparse_attention(q, kv, kv, local, backend="xla").shape == q.shape
  with pytest.raises(ValueError, match="q, k, v dtypes differ"):
    sparse_attention(q, kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), local, backend="xla")
  with pytest.raises(ValueError, match="q and k head dims differ"):
    sparse_attention(q, kv[..., :16], kv, local, backend="xla")
  with pytest.raises(ValueError, match=r"plan was built for 384 queries against"):
    sparse_attention(q[:, :, :128], kv, kv, local, backend="xla")
