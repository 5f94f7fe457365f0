"""The head exchange's record: how one call's ``[B, H, S, D]`` arrays are spread over a mesh
(sequence shards outside, local heads inside), validated once, and the resharding its calls
share."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.parallel.ring_plan import (asks_for_ring, check_ulysses_shards,
                                                 working_ulysses_shards)


@dataclasses.dataclass(frozen=True)
class HeadExchange:
  """How one call is spread over a mesh: sequence shards outside, local heads inside."""

  mesh: Mesh
  seq_axis: str
  batch_axes: tuple[str, ...]  # those present in the mesh
  shards: int  # size of seq_axis
  seq_len: int
  ulysses: int = 0  # devices exchanging heads (ulysses_shards); 0: all of seq_axis

  @property
  def ring(self) -> int:
    """Sequence shards left after the head exchange (1: Ulysses over the whole axis)."""
    return self.shards // (self.ulysses or self.shards)

  @property
  def padded_len(self) -> int:
    """The sequence padded to a multiple of the shards (the pad tail is never attended)."""
    return -(-self.seq_len // self.shards) * self.shards

  @property
  def batch_shards(self) -> int:
    return math.prod(self.mesh.shape[axis] for axis in self.batch_axes)

  @property
  def qkv_spec(self) -> P:
    """``[B, H, S, D]`` sharded by batch and sequence: the layout outside the exchange."""
    return P(self.batch_axes or None, None, self.seq_axis, None)

  @property
  def head_spec(self) -> P:
    """``[B, H, ...]`` per-head values (e.g. routing flags) of each device's local heads."""
    return P(self.batch_axes or None, self.seq_axis)

  def reshard(self, x: jax.Array, spec: P) -> jax.Array:
    """``x`` at ``spec`` where the exchange's axes are explicit (:func:`reshard_explicit`)."""
    return reshard_explicit(x, self.mesh, spec, (self.seq_axis, *self.batch_axes))


def head_exchange(mesh: Mesh, q_shape: Sequence[int], *, seq_axis: str = "context",
                  batch_axes: Sequence[str] = ("data", "fsdp"),
                  ulysses_shards: Any = None) -> HeadExchange:
  """Validates a ``[B, H, S, D]`` shape against the mesh. ``ulysses_shards``: devices exchanging
  heads; unset, -1, 0 or the whole axis mean all of ``seq_axis``, fewer leave a ring."""
  if seq_axis not in mesh.shape:
    raise ValueError(f"seq_axis {seq_axis!r} is not an axis of the mesh (axes: "
                     f"{', '.join(mesh.axis_names)})")
  if seq_axis in batch_axes:
    raise ValueError(f"seq_axis {seq_axis!r} cannot also be a batch axis")
  present = tuple(a for a in batch_axes if a in mesh.shape)
  batch, heads = q_shape[0], q_shape[1]
  n = mesh.shape[seq_axis]
  if heads % n and not asks_for_ring(ulysses_shards, n):
    working = working_ulysses_shards(n, heads)
    raise ValueError(f"heads ({heads}) must be divisible by the {n} shards of mesh axis "
                     f"{seq_axis!r}: the head exchange gives each shard heads / {n} heads; "
                     f"or set ulysses_shards to one of {', '.join(map(str, working))} to "
                     f"exchange heads in groups that size and ring the rest")
  ulysses, _ = check_ulysses_shards(ulysses_shards, n, heads)
  ex = HeadExchange(mesh, seq_axis, present, n, q_shape[2], ulysses)
  if batch % ex.batch_shards:
    raise ValueError(f"batch ({batch}) must be divisible by the {ex.batch_shards} shards of the "
                     f"batch axes {present}")
  return ex


def _mesh_axes(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def layout_axes(mesh: Mesh, spec: P) -> tuple[str, tuple[str, ...]]:
  """``(seq_axis, batch_axes)`` of a ``[B, H, S, D]`` partition spec (the caller's layout).
  Refused: heads or head dims split over devices, or the sequence not over exactly one axis."""
  entries = (tuple(spec) + (None,) * 4)[:4]
  if len(tuple(spec)) > 4:
    raise ValueError(f"qkv_spec {spec} has {len(tuple(spec))} entries; a [B, H, S, D] layout "
                     f"has 4")
  batch, heads, seq, dim = (_mesh_axes(e) for e in entries)
  unknown = [a for a in batch + heads + seq + dim if a not in mesh.shape]
  if unknown:
    raise ValueError(f"qkv_spec {spec} names {unknown}, not axes of the mesh "
                     f"({', '.join(mesh.axis_names)})")
  for what, axes in (("heads", heads), ("head dims", dim)):
    split = [a for a in axes if mesh.shape[a] > 1]
    if split:
      raise ValueError(f"qkv_spec {spec} splits the {what} over mesh axes {split} outside "
                       f"attention; SVG exchanges sequence shards for heads itself, so the "
                       f"{what} must arrive whole (map their logical axis to no mesh axis, as "
                       f"MaxDiffusion's ulysses rules do)")
  if len(seq) != 1:
    raise ValueError(f"qkv_spec {spec} shards the sequence over {len(seq)} mesh axes "
                     f"{list(seq)}; SVG's head exchange runs over exactly one (e.g. 'context')")
  return seq[0], batch


def in_context(mesh: Mesh) -> bool:
  """Whether ``mesh`` is the mesh in context (``jax.set_mesh``), abstractly."""
  context = jax.sharding.get_abstract_mesh()
  return not context.empty and context == mesh.abstract_mesh


def reshard_explicit(x: jax.Array, mesh: Mesh, spec: P, axes: Sequence[str]) -> jax.Array:
  """``x`` at ``spec`` where ``mesh``'s ``axes`` are explicit (shard_map needs it there); on auto
  axes XLA's propagation does it, so ``x`` is returned as is."""
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if all(types[a] == jax.sharding.AxisType.Explicit for a in axes):
    return jax.reshard(x, NamedSharding(mesh, spec))
  return x
