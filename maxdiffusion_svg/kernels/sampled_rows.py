"""The router's sampled rows on a TPU: a few query rows against every key, under several masks
at once, in one pass over the keys (Pallas).

The router compares each head layout's masked output with the dense one on sampled rows. In XLA
that is a float32 logits array over every key and one softmax and product with ``v`` per mask,
each reading it again (6.5 ms of a 720p layer on a v5e: docs/benchmarks.md, "A denoising step
timed on a TPU v5e"). Here each key block is read once and every mask's online softmax takes it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Keys a grid step reads: a v5e's HBM streams 512 KiB blocks at full speed, and the scores of
# 64 rows x 2048 keys (and their split products) stay far under the default scoped VMEM.
BLOCK_KEYS = 2048
_LANES = 128
_ROWS = 32  # an int8 tile's rows
# A masked score: finite, so no inf - inf; a row's running maximum starts there.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
_FULL = jax.lax.Precision.HIGHEST


def _split_dot(p: jax.Array, v: jax.Array) -> jax.Array:
  """``p @ v`` for float32 ``p``: with bf16 ``v`` in two bf16 passes (``v`` is exact in bf16, so
  the product keeps ``p`` to 16 bits where one pass keeps 8); else at full precision."""
  if v.dtype != jnp.bfloat16:
    return jax.lax.dot_general(p, v.astype(jnp.float32), (((1,), (0,)), ((), ())),
                               precision=_FULL, preferred_element_type=jnp.float32)
  hi = p.astype(jnp.bfloat16)
  lo = (p - hi.astype(jnp.float32)).astype(jnp.bfloat16)
  both = jnp.concatenate([hi, lo], axis=0)
  out = jax.lax.dot_general(both, v, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
  rows = p.shape[0]
  return out[:rows] + out[rows:]


def _kernel(q_ref, k_ref, v_ref, keep_ref, out_ref, m_ref, l_ref, m_scr, l_scr, acc_scr, *,
            masks: int, seq_len: int, block: int, scale: float):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, _MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  q = q_ref[...]
  rows = q.shape[0]
  # bf16 q and k multiply exactly into float32 sums; wider inputs at full precision.
  s = jax.lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())),
                          precision=None if q.dtype == jnp.bfloat16 else _FULL,
                          preferred_element_type=jnp.float32) * scale  # [R, block]
  key = j * block + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
  valid = key < seq_len
  key_col = j * block + jax.lax.broadcasted_iota(jnp.int32, (block, v_ref.shape[-1]), 0)
  # The last block reads past the keys: whatever lies there must not reach the sums.
  v = jnp.where(key_col < seq_len, v_ref[...], jnp.zeros((), v_ref.dtype))
  for i in range(masks + 1):  # 0: every key (the dense row); then each given mask
    keep = valid if i == 0 else valid & (keep_ref[i - 1].astype(jnp.int32) != 0)
    m_prev = m_scr[i][:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(jnp.where(keep, s, _MASKED), axis=1, keepdims=True))
    p = jnp.where(keep, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_scr[i] = alpha * l_scr[i] + jnp.sum(p, axis=1, keepdims=True)
    acc_scr[i] = alpha * acc_scr[i] + _split_dot(p, v)
    m_scr[i] = jnp.broadcast_to(m_new, m_scr.shape[1:])

  @pl.when(j == pl.num_programs(1) - 1)
  def _close():
    out_ref[...] = acc_scr[...]
    m_ref[...] = m_scr[...]
    l_ref[...] = l_scr[...]


def sampled_rows(q_rows: jax.Array, k: jax.Array, v: jax.Array, keeps: jax.Array | None,
                 scale: float, *, interpret: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of ``q_rows [B, H, R, D]`` over all of ``k``, ``v [B, H, S, D]``, dense
  and under each of ``keeps`` (``[M, R, S]`` shared or ``[B, H, M, R, S]``; nonzero: kept).
  Returns float32 ``out [B, H, 1 + M, R, D]`` and ``lse [B, H, 1 + M, R]``; index 0 is the
  dense row. A row keeping no key gets NaN output and ``-inf`` lse, as a softmax over nothing."""
  b, h, rows, d = q_rows.shape
  s, dv = k.shape[2], v.shape[-1]
  masks = 0 if keeps is None else keeps.shape[-3]
  r = -(-rows // _ROWS) * _ROWS  # whole int8 tiles of rows; the padding rows keep nothing
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, r - rows), (0, 0)))
  if keeps is not None:
    keeps = jnp.pad(keeps, [(0, 0)] * (keeps.ndim - 2) + [(0, r - rows), (0, 0)])
  block = min(BLOCK_KEYS, -(-s // _LANES) * _LANES)
  fold = lambda x: x.reshape(b * h, *x.shape[2:])
  if keeps is None:
    keep_arg = jnp.zeros((1, 1, r, block), jnp.int8)
    keep_spec = pl.BlockSpec((None, 1, r, block), lambda i, j: (0, 0, 0, 0))
  else:
    shared = keeps.ndim == 3
    keep_arg = (keeps[None] if shared else fold(keeps)).astype(jnp.int8)
    keep_spec = pl.BlockSpec((None, masks, r, block),
                             (lambda i, j: (0, 0, 0, j)) if shared else (lambda i, j: (i, 0, 0, j)))
  out, m, l = pl.pallas_call(
      functools.partial(_kernel, masks=masks, seq_len=s, block=block, scale=float(scale)),
      grid=(b * h, -(-s // block)),
      in_specs=[pl.BlockSpec((None, r, d), lambda i, j: (i, 0, 0)),
                pl.BlockSpec((None, block, d), lambda i, j: (i, j, 0)),
                pl.BlockSpec((None, block, dv), lambda i, j: (i, j, 0)),
                keep_spec],
      out_specs=[pl.BlockSpec((None, masks + 1, r, dv), lambda i, j: (i, 0, 0, 0)),
                 pl.BlockSpec((None, masks + 1, r, _LANES), lambda i, j: (i, 0, 0, 0)),
                 pl.BlockSpec((None, masks + 1, r, _LANES), lambda i, j: (i, 0, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((b * h, masks + 1, r, dv), jnp.float32),
                 jax.ShapeDtypeStruct((b * h, masks + 1, r, _LANES), jnp.float32),
                 jax.ShapeDtypeStruct((b * h, masks + 1, r, _LANES), jnp.float32)],
      scratch_shapes=[pltpu.VMEM((masks + 1, r, _LANES), jnp.float32),
                      pltpu.VMEM((masks + 1, r, _LANES), jnp.float32),
                      pltpu.VMEM((masks + 1, r, dv), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="svg_sampled_rows",
  )(fold(q_rows), fold(k), fold(v), keep_arg)
  l = l[..., 0]
  kept = l > 0
  lse = jnp.where(kept, m[..., 0] + jnp.log(jnp.where(kept, l, 1.0)), -jnp.inf)
  out = out / l[..., None]
  return (out.reshape(b, h, masks + 1, r, dv)[:, :, :, :rows],
          lse.reshape(b, h, masks + 1, r)[:, :, :, :rows])


# The same in XLA, in float32 at full precision: the router's host path.


def row_logits(q_rows: jax.Array, k: jax.Array, scale: float) -> jax.Array:
  """``float32 [B, H, R, S]``: the rows' scaled logits against every key."""
  f32 = jnp.float32
  return jnp.einsum("bhrd,bhkd->bhrk", q_rows.astype(f32), k.astype(f32), precision=_FULL) * scale


def masked_rows(logits: jax.Array, v32: jax.Array, keep: jax.Array | None) -> jax.Array:
  """The rows' softmax over the keys ``keep`` marks (None: every key) times float32 ``v32``."""
  if keep is not None:
    logits = jnp.where(keep, logits, -jnp.inf)
  return jnp.einsum("bhrk,bhkd->bhrd", jax.nn.softmax(logits, axis=-1), v32, precision=_FULL)


def masked_lse(logits: jax.Array, keep: jax.Array | None) -> jax.Array:
  """The rows' log-sum-exp over the keys ``keep`` marks (None: every key)."""
  return jax.nn.logsumexp(logits if keep is None else jnp.where(keep, logits, -jnp.inf), axis=-1)


def sampled_rows_xla(q_rows: jax.Array, k: jax.Array, v: jax.Array, keeps: jax.Array | None,
                     scale: float) -> tuple[jax.Array, jax.Array]:
  """:func:`sampled_rows` in XLA (:func:`row_logits`, :func:`masked_rows`, :func:`masked_lse`)."""
  logits, v32 = row_logits(q_rows, k, scale), v.astype(jnp.float32)
  masks = [None] if keeps is None else [None] + [keeps[..., i, :, :] != 0
                                                 for i in range(keeps.shape[-3])]
  return (jnp.stack([masked_rows(logits, v32, keep) for keep in masks], 2),
          jnp.stack([masked_lse(logits, keep) for keep in masks], 2))
