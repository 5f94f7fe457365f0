"""The ring half of a Ulysses x ring context split, planned statically (numpy, at trace time).

After the head exchange ring shard ``r`` holds ``H / U`` heads over tokens ``[r L, (r + 1) L)``.
Rather than ``R - 1`` ring hops, each fetches only the key tiles its rows visit (:class:`KeyFetch`)
and runs the single-device plan's own rows (:func:`window_plan`): one device's result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from maxdiffusion_svg.plan.masks import Mask
from maxdiffusion_svg.plan.tiles import EMPTY, MASKED, TilePlan, TileStats
from maxdiffusion_svg.routing.layouts import ring_note

if TYPE_CHECKING:
  from maxdiffusion_svg.budgets.config import SvgConfig


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def asks_for_ring(ulysses_shards: Any, context: int) -> bool:
  """Whether ``ulysses_shards`` asks for a ring (unset, -1, 0 and ``context`` do not)."""
  return not (ulysses_shards is None
              or (_is_int(ulysses_shards) and (ulysses_shards <= 0 or ulysses_shards == context)))


def check_dense_frames_on_ring(dense_frames: int, ulysses: int, ring: int) -> None:
  """Refuses ``svg_dense_frames`` on a ring: dense rows need every key, which a ring splits."""
  if ring > 1 and dense_frames:
    raise ValueError(
        f"svg_dense_frames is {dense_frames}, whose dense rows need every key: ulysses_shards "
        f"{ulysses} leaves a ring of {ring} sequence shards on this mesh. Set ulysses_shards to "
        f"the context axis's size, or svg_dense_frames to 0.")


def budget_keys(config: SvgConfig, experts: Sequence[str | None] = (None,)) -> tuple[str, ...]:
  """The per-layer and per-head keys that ``experts``' calls read, where set."""
  return tuple(dict.fromkeys(key for expert in experts for key in config.budget(expert).set_keys()))


def check_on_ring(ulysses: int, ring: int, *, dense_frames: int = 0,
                  budgets: Sequence[str] = (), layouts: Sequence[str] | None = None) -> str:
  """What a ring accepts, for the run and its pre-flight alike: no ``svg_dense_frames``, no
  per-layer or per-head ``budgets``. Returns the note on ``layouts`` (semantic left out, or "")."""
  check_dense_frames_on_ring(dense_frames, ulysses, ring)
  if ring > 1 and budgets:
    raise ValueError(f"{budgets[0]} does not run on a ring yet (ulysses_shards {ulysses} leaves "
                     f"the sequence split over {ring} devices): set ulysses_shards to the "
                     f"context axis's size, or leave {budgets[0]} unset")
  return "" if layouts is None else ring_note(tuple(layouts), ulysses, ring)


def working_ulysses_shards(context: int, heads: int) -> list[int]:
  """The ``ulysses_shards`` a context axis of ``context`` devices and ``heads`` heads allow."""
  return [u for u in range(1, context + 1) if context % u == 0 and heads % u == 0]


def check_ulysses_shards(ulysses_shards: Any, context: int, heads: int) -> tuple[int, int]:
  """``(U, R)``: ``None``, -1, 0 or ``context`` mean Ulysses over the whole axis (``R = 1``);
  otherwise ``U`` devices exchange heads and ``R = context / U`` shards form the ring."""
  if ulysses_shards is not None and not _is_int(ulysses_shards):
    raise ValueError(f"ulysses_shards must be an integer, got {ulysses_shards!r}")
  ulysses = int(ulysses_shards) if asks_for_ring(ulysses_shards, context) else context
  hint = ("values that work on this mesh: "
          f"{', '.join(map(str, working_ulysses_shards(context, heads)))}")
  if heads % context == 0:
    hint += f", or -1 (Ulysses over all {context})"
  if context % ulysses:
    raise ValueError(f"ulysses_shards ({ulysses}) must divide the mesh's context axis "
                     f"({context} devices) into Ulysses groups; {hint}")
  if heads % ulysses:
    raise ValueError(f"ulysses_shards ({ulysses}) must divide the model's {heads} attention "
                     f"heads (each device of a group takes heads / ulysses_shards); {hint}")
  return ulysses, context // ulysses


@dataclasses.dataclass(frozen=True)
class RingSplit:
  """The sequence over the ring: the exchange's ``ring`` shards of ``natural`` tokens, and the
  plan's ``[starts[r], starts[r + 1])`` of whole query tiles, at the tile boundary nearest the
  natural one; buffers hold ``chunk``, the largest. Past ``seq_len``: padding (never a key)."""

  seq_len: int
  ring: int
  natural: int
  starts: tuple[int, ...]

  @property
  def chunk(self) -> int:
    return max(b - a for a, b in zip(self.starts, self.starts[1:]))

  @property
  def padded_len(self) -> int:
    return self.starts[-1]

  @property
  def natural_len(self) -> int:
    return self.ring * self.natural

  @property
  def aligned(self) -> bool:
    """Whether the exchange's shards already are the plan's (no re-chunking across the ring)."""
    return self.starts[:-1] == tuple(r * self.natural for r in range(self.ring))

  def shard_of(self, positions: np.ndarray) -> np.ndarray:
    """The plan shard holding each position."""
    return np.searchsorted(np.asarray(self.starts[1:-1]), positions, side="right")


def ring_split(seq_len: int, ring: int, ulysses: int, block_q: int) -> RingSplit:
  """The exchange's shards (even over the Ulysses group) and the plan's (whole query tiles)."""
  natural = -(-seq_len // (ring * ulysses)) * ulysses
  tiles = -(-seq_len // block_q)
  starts = [min(tiles, round(r * natural / block_q)) * block_q for r in range(ring)]
  return RingSplit(seq_len, ring, natural, (*starts, tiles * block_q))


@dataclasses.dataclass(frozen=True)
class WindowMask(Mask):
  """A global mask on a ring shard's buffers (query ``q`` is ``q + q_offset``; keys are ``runs``
  of global keys, unused slots first), in static ``where`` arithmetic so it runs inside Pallas."""

  mask: Mask
  q_offset: int
  q_len: int
  seq_len: int  # local keys that are real: the window, up to the global sequence's end
  runs: tuple[tuple[int, int], ...]

  def contains(self, q: Any, k: Any) -> Any:
    return (q < self.q_len) & (k < self.seq_len) & self._rule(q, k)

  def _rule(self, q: Any, k: Any) -> Any:
    numpy = all(isinstance(x, (np.ndarray, np.integer, int)) for x in (q, k))
    where = np.where if numpy else __import__("jax.numpy", fromlist=["where"]).where
    global_k = k + self.mask.seq_len  # unused slots: past the sequence, never kept
    for local, start in self.runs:
      global_k = where(k >= local, k - local + start, global_k)
    return self.mask.contains(q + self.q_offset, global_k)


def _tile_pairs(plan: TilePlan, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
  """Pairs each visited tile keeps: the exact rule's, or in aligned plans every real pair."""
  s, bq, bkv = plan.seq_len, plan.block_q, plan.block_kv
  q0, k0 = rows * bq, cols * bkv
  q1, k1 = np.minimum(q0 + bq, s), np.minimum(k0 + bkv, s)
  if plan.masks_exact:
    return plan.mask.kept_pairs(q0, q1, k0, k1)
  return (q1 - q0) * (k1 - k0)


def window_tiles(plan: TilePlan, split: RingSplit, shard: int) -> np.ndarray:
  """The global kv tiles shard ``shard``'s rows visit, ascending."""
  row0, row1 = _shard_rows(plan, split, shard)
  visited = plan.kind[row0:row1] != EMPTY
  return np.unique(plan.kv_index[row0:row1][visited]).astype(np.int64)


def _shard_rows(plan: TilePlan, split: RingSplit, shard: int) -> tuple[int, int]:
  first, stop = split.starts[shard], split.starts[shard + 1]
  if first % plan.block_q or stop % plan.block_q:
    raise ValueError(f"ring shard {shard} [{first}, {stop}) splits block_q {plan.block_q} tiles")
  return first // plan.block_q, stop // plan.block_q


def window_slots(plan: TilePlan, split: RingSplit) -> int:
  """Key tiles every shard's window holds: the most any shard visits (shapes are static)."""
  return max(1, max(window_tiles(plan, split, r).size for r in range(split.ring)))


def window_plan(plan: TilePlan, split: RingSplit, shard: int) -> TilePlan:
  """Shard ``shard``'s rows of ``plan``: ``chunk`` queries against its :class:`KeyFetch` window
  (unused slots, then visited tiles ascending, so the padded last tile stays last)."""
  bq, bkv = plan.block_q, plan.block_kv
  slots = window_slots(plan, split)
  tiles = window_tiles(plan, split, shard)
  unused = slots - tiles.size
  row0, row1 = _shard_rows(plan, split, shard)
  rows = split.chunk // bq
  width = plan.width
  kv_index = np.zeros((rows, width), np.int32)
  kind = np.zeros((rows, width), np.int8)
  visited = np.zeros(rows, np.int32)
  real = row1 - row0
  if real:
    kv_index[:real] = unused + np.searchsorted(tiles, plan.kv_index[row0:row1])
    kind[:real] = plan.kind[row0:row1]
    visited[:real] = plan.num_visited[row0:row1]
  for a in (kv_index, kind, visited):
    a.setflags(write=False)
  runs = _runs(tiles, unused, bkv)
  last = plan.num_kv_tiles - 1
  kv_len = slots * bkv
  if tiles.size and tiles[-1] == last:
    kv_len = (slots - 1) * bkv + plan.seq_len - last * bkv
  first = split.starts[shard]
  mask = WindowMask(plan.mask, first, split.starts[shard + 1] - first, kv_len, runs)
  local_rows, slot = np.nonzero(kind)
  global_rows = local_rows + row0
  pairs = _tile_pairs(plan, global_rows, tiles[kv_index[local_rows, slot] - unused])
  kinds = kind[local_rows, slot]
  q_real = max(0, min(split.starts[shard + 1], plan.seq_len) - first)
  k_real = sum(min(bkv, plan.seq_len - t * bkv) for t in tiles)
  kept = int(pairs.sum())
  stats = TileStats(total_tiles=rows * slots, visited_tiles=int(kinds.size),
                    masked_tiles=int((kinds == MASKED).sum()),
                    full_tiles=int((kinds != MASKED).sum()), real_pairs=q_real * k_real,
                    exact_pairs=kept, kept_pairs=kept, recall=1.0, precision=1.0)
  return TilePlan(mask, plan.mode, bq, bkv, kv_index, kind, visited, stats, q_len=split.chunk)


def _runs(tiles: np.ndarray, unused: int, bkv: int) -> tuple[tuple[int, int], ...]:
  """``(local_start, global_start)`` of each run of consecutive global tiles."""
  if not tiles.size:
    return ()
  breaks = np.flatnonzero(np.diff(tiles) != 1) + 1
  starts = np.concatenate([[0], breaks])
  return tuple((int((unused + j) * bkv), int(tiles[j] * bkv)) for j in starts)


@dataclasses.dataclass(frozen=True, eq=False)
class Hop:
  """One collective permute: shard ``s`` sends ``send[s]`` to ``(s + offset) % R``, which takes
  them as window pieces ``recv[...]``. Out-of-range padding is dropped."""

  offset: int
  pairs: tuple[tuple[int, int], ...]
  send: np.ndarray  # int32 [R, M], indexed by the sending shard
  recv: np.ndarray  # int32 [R, M], indexed by the receiving shard


@dataclasses.dataclass(frozen=True, eq=False)
class KeyFetch:
  """How every ring shard assembles its key window in ``piece``-token pieces: own pieces stay, the
  sink (first frame, on shard 0) reaches shards >= 2 by one broadcast (a ring sum), the band's
  neighbours by one collective permute per shard offset."""

  split: RingSplit
  block_kv: int
  slots: int
  piece: int
  own_src: np.ndarray  # int32 [R, n]: pieces of the shard's own chunk (padding: out of range)
  own_dst: np.ndarray  # int32 [R, n]: their window pieces
  hops: tuple[Hop, ...]
  sink_src: np.ndarray  # int32 [m]: shard 0's sink pieces that shards >= 2 need
  sink_dst: np.ndarray  # int32 [R, m]: their window pieces (out of range: not taken)
  # int32 [R, window pieces] per source (the shard's own pieces, each hop's buffer, the sink's):
  # where each window piece is in that source, out of range where it comes from another. The
  # window is the sum of one gather per source: no scatter, no concatenated copy.
  window_parts: tuple[np.ndarray, ...]

  @property
  def window_pieces(self) -> int:
    return self.slots * self.block_kv // self.piece

  @property
  def broadcasts_sink(self) -> bool:
    return self.sink_src.size > 0

  def pieces_received(self) -> np.ndarray:
    """``[R]`` pieces each shard receives from others (buffer sizes, padding included)."""
    counts = np.zeros(self.split.ring, np.int64)
    for hop in self.hops:
      for _, dst in hop.pairs:
        counts[dst] += hop.send.shape[1]
    counts[1:] += self.sink_src.size if self.broadcasts_sink else 0
    return counts

  def shards_fetched(self) -> np.ndarray:
    """``[R]`` other shards each shard takes keys from."""
    sources = [set() for _ in range(self.split.ring)]
    for hop in self.hops:
      for src, dst in hop.pairs:
        sources[dst].add(src)
    for r in range(self.split.ring):
      if (self.sink_dst[r] < self.window_pieces).any():
        sources[r].add(0)
    return np.array([len(s) for s in sources], np.int64)


def key_fetch(plan: TilePlan, split: RingSplit) -> KeyFetch:
  """The fetch of every shard's :func:`window_plan` keys."""
  return _key_fetch(plan, split)


@functools.lru_cache(maxsize=32)
def _key_fetch(plan: TilePlan, split: RingSplit) -> KeyFetch:
  bkv, chunk, ring = plan.block_kv, split.chunk, split.ring
  piece = math.gcd(bkv, *split.starts)
  per_tile, per_chunk = bkv // piece, chunk // piece
  first_piece = np.asarray(split.starts) // piece
  slots = window_slots(plan, split)
  limit = slots * per_tile  # an out-of-range window piece: dropped
  real_pieces = -(-plan.seq_len // piece)
  sink_pieces = min(-(-getattr(plan.mask, "sink", 0) // piece), first_piece[1])  # on shard 0
  sink_dst = np.full((ring, sink_pieces), limit, np.int32)
  sink_taken = np.zeros(sink_pieces, bool)
  own: list[tuple[np.ndarray, np.ndarray]] = []
  moves: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
  for r in range(ring):
    tiles = window_tiles(plan, split, r)
    unused = slots - tiles.size
    window = ((unused + np.arange(tiles.size))[:, None] * per_tile
              + np.arange(per_tile)[None, :]).reshape(-1)
    pieces = (tiles[:, None] * per_tile + np.arange(per_tile)[None, :]).reshape(-1)
    keep = pieces < real_pieces  # pieces wholly past the sequence stay zero
    window, pieces = window[keep], pieces[keep]
    if r >= 2:  # the sink, broadcast from shard 0 (its neighbour takes it with the band)
      sink = pieces < sink_pieces
      sink_dst[r, pieces[sink]] = window[sink]
      sink_taken[pieces[sink]] = True
      window, pieces = window[~sink], pieces[~sink]
    owner = split.shard_of(pieces * piece)
    for o in np.unique(owner):
      at = owner == o
      pair = (pieces[at] - first_piece[o], window[at])
      if o == r:
        own.append(pair)
      else:
        moves.setdefault(int((r - o) % ring), {})[int(o)] = pair
    if not (owner == r).any():
      own.append((np.zeros(0, np.int64), np.zeros(0, np.int64)))
  shards = list(range(ring))
  own_src, own_dst = _stack(own, ring, per_chunk, limit, shards, shards)
  hops = []
  for offset in sorted(moves, key=lambda d: (min(d, ring - d), d)):
    by_src = moves[offset]
    sources = sorted(by_src)
    targets = [(o + offset) % ring for o in sources]
    send, recv = _stack([by_src[o] for o in sources], ring, per_chunk, limit, sources, targets)
    hops.append(Hop(offset, tuple(zip(sources, targets)), send, recv))
  sink_src = np.flatnonzero(sink_taken).astype(np.int32)
  sink_dst = np.ascontiguousarray(sink_dst[:, sink_src])
  sources = [(own_dst, own_src, per_chunk)]
  sources += [(hop.recv, np.broadcast_to(np.arange(hop.send.shape[1]), hop.recv.shape),
               hop.send.shape[1]) for hop in hops]
  sources.append((sink_dst, np.broadcast_to(np.arange(sink_src.size), sink_dst.shape),
                  sink_src.size))
  parts = []
  for dst, at, size in sources:
    part = np.full((ring, limit), size, np.int32)
    for r in range(ring):
      taken = dst[r] < limit
      part[r, dst[r][taken]] = at[r][taken]
    part.setflags(write=False)
    parts.append(part)
  for a in (sink_src, sink_dst):
    a.setflags(write=False)
  return KeyFetch(split, bkv, slots, piece, own_src, own_dst, tuple(hops), sink_src, sink_dst,
                  tuple(parts))


def _stack(pairs, ring, src_pad, dst_pad, src_rows, dst_rows):
  """``[R, width]`` (source, window) piece tables, rows by sender and by receiver, padded."""
  width = max(1, max(p[0].size for p in pairs))
  src = np.full((ring, width), src_pad, np.int32)
  dst = np.full((ring, width), dst_pad, np.int32)
  for (s, d), src_row, dst_row in zip(pairs, src_rows, dst_rows):
    src[src_row, :s.size], dst[dst_row, :d.size] = s, d
  for a in (src, dst):
    a.setflags(write=False)
  return src, dst
