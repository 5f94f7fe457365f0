"""Placement across the ring: the exchange's ring shards to the plan's, per head type.

Static O(S) tables, built once per shape, for one all-to-all whose sides are gathers."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from maxdiffusion_svg.parallel.ring_plan import RingSplit


@dataclasses.dataclass(frozen=True, eq=False)
class ShardPermutation:
  """``out[p] = x[source[p]]``, from the exchange's ``natural`` shards to the plan's shards.

  Staying tokens gather locally; shard ``s`` sends ``send[s, d]`` to fill ``recv[d, s]`` in one
  all-to-all. ``place_from[d, p]`` indexes ``[received (R x M) | own natural tokens]``, the
  inverse's ``back_from`` ``[received | own plan positions]``; out-of-range padding gives zeros."""

  split: RingSplit
  send: np.ndarray  # int32 [R(src), R(dst), M]
  recv: np.ndarray  # int32 [R(dst), R(src), M]
  place_from: np.ndarray  # int32 [R, chunk]
  back_from: np.ndarray  # int32 [R, natural]

  @property
  def block(self) -> int:
    return self.send.shape[2]


@functools.lru_cache(maxsize=16)
def ring_placement(frames: int, frame_size: int,
                   split: RingSplit) -> tuple[ShardPermutation | None, ShardPermutation]:
  """``(spatial, temporal)``: frame-major (None where shards match) and temporal-major tables
  with one block size, so a head's flag picks its tables around one all-to-all."""
  s = frames * frame_size
  if s != split.seq_len:
    raise ValueError(f"grid of {s} tokens, ring split of {split.seq_len}")
  p = np.arange(s, dtype=np.int64)
  temporal = (p % frames) * frame_size + p // frames  # frame-major token at position p
  if split.aligned:
    return None, shard_permutation(temporal, split)
  block = max(_crossing(p, split), _crossing(temporal, split))
  return shard_permutation(p, split, block), shard_permutation(temporal, split, block)


def _crossing(source: np.ndarray, split: RingSplit) -> int:
  """The most tokens one shard sends another (the all-to-all's block)."""
  src, dst = source // split.natural, split.shard_of(np.arange(source.size))
  crossing = src != dst
  counts = np.bincount(src[crossing] * split.ring + dst[crossing], minlength=split.ring ** 2)
  return max(1, int(counts.max()))


def shard_permutation(source: np.ndarray, split: RingSplit,
                      block: int | None = None) -> ShardPermutation:
  """Tables for ``out[p] = x[source[p]]`` (``p < seq_len``; later positions stay zero)."""
  ring, chunk, natural = split.ring, split.chunk, split.natural
  p = np.arange(source.size, dtype=np.int64)
  t = np.asarray(source, np.int64)
  src, dst = t // natural, split.shard_of(p)
  src_at, dst_at = t - src * natural, p - np.asarray(split.starts)[dst]
  block = max(block or 0, _crossing(t, split))
  place_from = np.full((ring, chunk), ring * block + natural, np.int32)  # past both: zeros
  back_from = np.full((ring, natural), ring * block + chunk, np.int32)
  stay = src == dst
  place_from[dst[stay], dst_at[stay]] = ring * block + src_at[stay]
  back_from[src[stay], src_at[stay]] = ring * block + dst_at[stay]
  move = np.flatnonzero(~stay)
  order = move[np.lexsort((p[move], dst[move], src[move]))]
  group = src[order] * ring + dst[order]
  counts = np.bincount(group, minlength=ring * ring)
  rank = np.arange(order.size) - np.repeat(np.cumsum(counts) - counts, counts)
  send = np.full((ring, ring, block), natural, np.int32)
  recv = np.full((ring, ring, block), chunk, np.int32)
  s_, d_ = src[order], dst[order]
  send[s_, d_, rank] = src_at[order]
  recv[d_, s_, rank] = dst_at[order]
  place_from[d_, dst_at[order]] = s_ * block + rank
  back_from[s_, src_at[order]] = d_ * block + rank
  for a in (send, recv, place_from, back_from):
    a.setflags(write=False)
  return ShardPermutation(split, send, recv, place_from, back_from)
