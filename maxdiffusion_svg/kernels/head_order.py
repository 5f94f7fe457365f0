"""Per-head token order on a TPU (Pallas): the heads flagged are swapped between frame-major
``(F, P)`` and temporal-major ``(P, F)`` order, the others copied, in one pass over the array.

XLA's per-head loop (one head a turn, a dynamic update in place) moved q, k and v of a 720p
layer in 9.2 ms where the bytes take 3.4 (docs/benchmarks.md, "A denoising step timed on a TPU
v5e"). Here each grid step moves ``F x rows`` tokens of one head: a swapped head's block is read
as ``F`` slabs of ``rows`` positions and written with the frames interleaved (strided stores;
restoring, strided loads), a kept head's block copied as it lies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maxdiffusion_svg.kernels.fixed_offset import scaled

# A grid step's block, at most: large enough to stream at the HBM's pace, small enough that its
# double-buffered input and output views stay a few MiB of VMEM.
BLOCK_BYTES = 2**20
_SUBLANES = 8


def block_positions(positions: int, frames: int, row_bytes: int) -> int | None:
  """Positions a grid step moves: the largest multiple of 8 dividing ``positions`` whose block
  (``frames x`` it ``x row_bytes``) fits :data:`BLOCK_BYTES`; None where no multiple of 8 divides."""
  fits = [p for p in range(_SUBLANES, positions + 1, _SUBLANES)
          if positions % p == 0 and frames * p * row_bytes <= BLOCK_BYTES]
  if fits:
    return fits[-1]
  return _SUBLANES if positions % _SUBLANES == 0 else None


def supported(frames: int, positions: int, head_dim: int, dtype) -> bool:
  """Whether the kernel takes these heads: lane-wide rows and positions in whole sublanes."""
  return (head_dim % 128 == 0
          and block_positions(positions, frames, head_dim * jnp.dtype(dtype).itemsize) is not None)


def _scaled(x: jax.Array, scale: float | None, dtype) -> jax.Array:
  return x.astype(dtype) if scale is None else scaled(x, scale, dtype)


def _kernel(swap_ref, frame_ref, flat_ref, out_ref, *scratch, frames: int, rows: int,
            to_temporal: bool, scale: float | None):
  swap = swap_ref[pl.program_id(0)] != 0

  if to_temporal:  # frame_ref (F, rows, D) -> out_ref (rows * F, D), row p * F + f
    @pl.when(swap)
    def _swap():
      # Mosaic strides loads and stores of 32-bit rows only: narrower ones interleave in a
      # float32 scratch (exact), then move as one block.
      into = scratch[0] if scratch else out_ref
      for f in range(frames):
        into[pl.ds(f, rows, stride=frames), :] = _scaled(frame_ref[f], scale, into.dtype)
      if scratch:
        out_ref[...] = into[...].astype(out_ref.dtype)

    @pl.when(~swap)
    def _keep():
      out_ref[...] = _scaled(flat_ref[...], scale, out_ref.dtype)
  else:  # flat_ref (rows * F, D) -> out_ref (F, rows, D)
    @pl.when(swap)
    def _swap():
      source = scratch[0] if scratch else flat_ref  # strided loads: 32-bit rows too
      if scratch:
        source[...] = flat_ref[...].astype(source.dtype)
      for f in range(frames):
        out_ref[f] = source[pl.ds(f, rows, stride=frames), :].astype(out_ref.dtype)

    @pl.when(~swap)
    def _keep():
      out_ref[...] = frame_ref[...]


def reorder_heads(x: jax.Array, swap: jax.Array, frames: int, *, to_temporal: bool,
                  interpret: bool = False, scale: float | None = None) -> jax.Array:
  """``x [N, S, D]`` (``S = frames x P``) with each head where ``swap [N]`` is set reordered:
  frame-major to temporal-major (``to_temporal``) or back; the other heads as they are. A
  permutation: its gradient is the reverse reorder of the cotangent. ``scale`` (placing only):
  every head also multiplied by it in float32, rounded to x's dtype, in the same pass."""
  if scale is not None and not to_temporal:
    raise ValueError("reorder_heads scales on the way to the temporal-major order only")
  return _reorder(x, jnp.asarray(swap).astype(jnp.int32), frames, to_temporal, interpret,
                  None if scale is None else float(scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _reorder(x: jax.Array, swap: jax.Array, frames: int, to_temporal: bool,
             interpret: bool, scale: float | None) -> jax.Array:
  return _reorder_call(x, swap, frames, to_temporal, interpret, scale)


def _reorder_fwd(x, swap, frames, to_temporal, interpret, scale):
  return _reorder_call(x, swap, frames, to_temporal, interpret, scale), swap


def _reorder_bwd(frames, to_temporal, interpret, scale, swap, cotangent):
  back = _reorder_call(cotangent, swap, frames, not to_temporal, interpret, None)
  return _scaled(back, scale, back.dtype), None


_reorder.defvjp(_reorder_fwd, _reorder_bwd)


def _reorder_call(x: jax.Array, swap: jax.Array, frames: int, to_temporal: bool,
                  interpret: bool, scale: float | None) -> jax.Array:
  n, s, d = x.shape
  positions = s // frames
  rows = block_positions(positions, frames, d * x.dtype.itemsize)
  if rows is None or s != frames * positions:
    raise ValueError(f"reorder_heads needs {s} tokens as {frames} frames of a multiple of 8 "
                     f"positions")
  steps = positions // rows
  frame_view = x.reshape(n, frames, positions, d)
  flat_view = x.reshape(n, steps, rows * frames, d)

  # The view a head does not read keeps one block index, so it is fetched once per head.
  def frame_at(i, j, swap_ref):
    read = (swap_ref[i] != 0) == to_temporal
    return i, 0, jnp.where(read, j, 0), 0

  def flat_at(i, j, swap_ref):
    read = (swap_ref[i] != 0) != to_temporal
    return i, jnp.where(read, j, 0), 0, 0

  frame_spec = pl.BlockSpec((None, frames, rows, d), frame_at)
  flat_spec = pl.BlockSpec((None, None, rows * frames, d), flat_at)
  out_spec = (pl.BlockSpec((None, None, rows * frames, d), lambda i, j, _: (i, j, 0, 0))
              if to_temporal else
              pl.BlockSpec((None, frames, rows, d), lambda i, j, _: (i, 0, j, 0)))
  out_shape = jax.ShapeDtypeStruct(flat_view.shape if to_temporal else frame_view.shape, x.dtype)
  narrow = x.dtype.itemsize < 4
  scratch = [pltpu.VMEM((rows * frames, d), jnp.float32)] if narrow else []
  out = pl.pallas_call(
      functools.partial(_kernel, frames=frames, rows=rows, to_temporal=to_temporal,
                        scale=scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(n, steps),
                                             in_specs=[frame_spec, flat_spec],
                                             out_specs=out_spec, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="svg_head_order",
  )(swap, frame_view, flat_view)
  return out.reshape(n, s, d)
