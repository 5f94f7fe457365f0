"""A fixed softmax offset per query, and the per-head gate that says where it is safe.

With a fixed offset ``m_i`` each tile adds ``exp2(s - m_i)`` and nothing is rescaled. Keys are
smoothed (``k - c``, the shift folded into the offset; ``c`` is ``mean(k)``, or for sparse plans
the mean of every ``S // CENTRE_ROWS``-th key) and ``m_i = ceil(G_i) - 88`` with
``G_i = |q_i| max|k - c|`` (Cauchy-Schwarz): no term exceeds ``2**88``, and sums stay finite while
``S max|v| < 2**39``. TPUs flush float32 below ``2**-126``, so a head qualifies only if
``G <= 203 - log2 S`` (dense plans; half that for sparse ones); the rest run online softmax,
whose offset may lag the row's running maximum by a headroom of at most ``HEADROOM`` (terms up
to ``2**headroom``, no rescale) while sums stay finite. Computed in XLA on every call, from the
activations. Derivation: docs/concepts.md, "A fixed softmax offset".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

OFFSET = 88.0  # C: no kept term exceeds 2**C
FLUSH_EXPONENT = 126  # float32 below 2**-126 is flushed to zero on TPUs
LOSS_EXPONENT = 10  # flushed terms may add at most 2**-10 of the row's largest term
OVERFLOW_EXPONENT = 127  # float32's largest finite value is below 2**128
HEADROOM = 64  # an online row keeps its offset while each tile's sums stay within 2**64 of it
# A sparse plan's keys are centred on the mean of this many of them, evenly strided: any centre
# keeps the bound and the sparse gate (which never counts on a row's largest logit), and the
# pass over every key that the exact mean takes is saved. Dense plans keep the exact mean: their
# gate counts on it (each row's largest smoothed logit over all keys is >= 0).
CENTRE_ROWS = 512


def gate(seq_len: int, every_key_visited: bool) -> float:
  """The largest ``|q| * max|k|`` (base-2 logits) a head may have to use the fixed offset."""
  dense = OFFSET - 1 + FLUSH_EXPONENT - LOSS_EXPONENT - math.log2(seq_len)
  return dense if every_key_visited else dense / 2


# The softmax scale of a q its caller already multiplied by the scale and log2(e) (in its dtype,
# as :func:`fixed_offsets` would): ln(2) * log2(e) is 1.0 exactly, so the prepass takes q as is.
BASE2_SCALE = math.log(2.0)


def base2_factor(scale: float | None, head_dim: int) -> float:
  """What the kernel multiplies q by: the softmax ``scale`` (default ``head_dim ** -0.5``) and
  log2(e)."""
  return (head_dim ** -0.5 if scale is None else float(scale)) * math.log2(math.e)


def scaled(x: jax.Array, factor: float, dtype=None) -> jax.Array:
  """``x`` times ``factor`` in float32, in ``dtype`` (default x's): how q is scaled for the
  kernel, by the prepass, the placement pass or XLA's placement alike (bitwise)."""
  return (x.astype(jnp.float32) * factor).astype(dtype or x.dtype)


class FixedOffsets(NamedTuple):
  """What the kernel reads: base-2 q, ``m [BH, 1, S]``, ``fixed [BH]`` (int32, 1: passed gate),
  ``headroom [BH]`` (int32: an online row's largest term, base 2, before it rescales)."""

  q: jax.Array
  m: jax.Array
  fixed: jax.Array
  headroom: jax.Array


def fixed_offsets(q: jax.Array, k: jax.Array, v: jax.Array, q_scale: float, *,
                  every_key_visited: bool) -> FixedOffsets:
  """Offsets and gate for ``[BH, S, D]`` inputs; ``q_scale`` folds the softmax scale and log2(e)."""
  s = k.shape[1]  # the terms a row may sum
  # q_scale 1: q came scaled (BASE2_SCALE), and no pass writes a copy of it.
  qs = q if q_scale == 1.0 else scaled(q, q_scale)
  # Of the values the kernel multiplies (q after rounding), so the bound holds for them.
  q32, k32 = qs.astype(jnp.float32), k.astype(jnp.float32)
  centre = k32 if every_key_visited else k32[:, ::max(1, s // CENTRE_ROWS)]
  k_mean = centre.mean(axis=1, keepdims=True)  # [BH, 1, D]
  q_norm = jnp.sqrt(jnp.square(q32).sum(axis=-1))  # [BH, S]
  k_norm = jnp.sqrt(jnp.square(k32 - k_mean).sum(axis=-1)).max(axis=1)  # [BH]
  bound = q_norm * k_norm[:, None]
  # Float32 products summed where q is read for its norm (a v5e timed it as the HIGHEST-precision
  # matmul it replaced: the pass is bound by reading q).
  shift = (q32 * k_mean).sum(axis=-1)
  m = (jnp.ceil(bound) - OFFSET + shift)[:, None, :]
  v_max = jnp.abs(v.astype(jnp.float32)).max(axis=(1, 2))
  sums = jnp.log2(v_max * s + 1e-30)  # the largest accumulator, over a term of 1
  # The kernel casts each term to v's dtype for its matmul: float16 holds none above 2**15.
  top = min(OVERFLOW_EXPONENT, jnp.finfo(v.dtype).maxexp - 1)
  fits = (sums + OFFSET < OVERFLOW_EXPONENT) & (OFFSET < top)
  fixed = (bound.max(axis=1) <= gate(s, every_key_visited)) & fits & jnp.isfinite(bound).all(axis=1)
  # Headroom 0 (rescale whenever the maximum grows: plain online softmax) where values are huge.
  room = jnp.clip(jnp.floor(OVERFLOW_EXPONENT - 1 - sums), 0, min(HEADROOM, top - 1))
  headroom = jnp.where(jnp.isfinite(room), room, 0).astype(jnp.int32)
  return FixedOffsets(qs, m, fixed.astype(jnp.int32), headroom)
