"""A fixed softmax offset per query, and the per-head gate that says where it is safe.

Online softmax keeps a running row max and rescales the row's sum and accumulator whenever it
grows. With a fixed offset ``m_i`` per query, each tile adds ``exp2(s - m_i)`` and nothing is
rescaled. Any offset gives the same softmax; the offset only has to keep every term that
matters inside float32's range. The derivation (docs/concepts.md, "A fixed softmax offset"):

- Keys are smoothed: logits are taken against ``k_j - mean(k)`` over the real sequence
  (softmax is unchanged: each row shifts by the constant ``q_i . mean(k)``), so over *all* keys
  a row's largest logit is >= 0. The shift goes into the offset, not into k: rounding smoothed
  keys to bfloat16 would cost precision for nothing.
- Cauchy-Schwarz bounds every logit by ``G_i = |q_i| * max_j |k_j|``; we take
  ``m_i = ceil(G_i) - C`` with ``C = 88``, so no term exceeds ``2**88``: the sum of ``S`` terms
  times ``max|v|`` stays below float32's ``2**127`` while ``S * max|v| < 2**39``.
- The largest term a row keeps is ``>= 2**(C - 1 - G_i)`` when the row visits every key
  (its max logit is >= 0), but only ``>= 2**(C - 1 - 2 G_i)`` for a sparse row, whose visited
  keys may all score as low as ``-G_i``. TPUs flush float32 below ``2**-126`` to zero; the kept
  terms that flush add at most ``S * 2**-126``, which must stay below ``2**-10`` of the largest
  term (under bfloat16's rounding). Hence the gate ``G <= 203 - log2 S`` for dense plans and
  half that for sparse ones (93.4 at 720p).

Heads whose largest ``G_i`` passes run the fixed body; the rest run online softmax. The gate is
computed here, in XLA, on every call: it follows the activations, so no head is ever wrong.
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


def gate(seq_len: int, every_key_visited: bool) -> float:
  """The largest ``|q| * max|k|`` (base-2 logits) a head may have to use the fixed offset."""
  dense = OFFSET - 1 + FLUSH_EXPONENT - LOSS_EXPONENT - math.log2(seq_len)
  return dense if every_key_visited else dense / 2


class FixedOffsets(NamedTuple):
  """What the kernel reads: q scaled to base-2 logits, ``m [BH, 1, S]`` (smoothing included) and
  the per-head flag ``fixed [BH]`` (int32, 1 where the head passed the gate)."""

  q: jax.Array
  m: jax.Array
  fixed: jax.Array


def fixed_offsets(q: jax.Array, k: jax.Array, v: jax.Array, q_scale: float, *,
                  every_key_visited: bool) -> FixedOffsets:
  """Offsets and gate for ``[BH, S, D]`` inputs; ``q_scale`` folds the softmax scale and log2(e)."""
  s = k.shape[1]  # the terms a row may sum
  qs = (q.astype(jnp.float32) * q_scale).astype(q.dtype)
  # Of the values the kernel multiplies (q after rounding), so the bound holds for them.
  q32, k32 = qs.astype(jnp.float32), k.astype(jnp.float32)
  k_mean = k32.mean(axis=1, keepdims=True)  # [BH, 1, D]
  q_norm = jnp.sqrt(jnp.square(q32).sum(axis=-1))  # [BH, S]
  k_norm = jnp.sqrt(jnp.square(k32 - k_mean).sum(axis=-1)).max(axis=1)  # [BH]
  bound = q_norm * k_norm[:, None]
  shift = jnp.einsum("bsd,bod->bs", q32, k_mean, precision=jax.lax.Precision.HIGHEST)
  m = (jnp.ceil(bound) - OFFSET + shift)[:, None, :]
  v_max = jnp.abs(v.astype(jnp.float32)).max(axis=(1, 2))
  fits = jnp.log2(v_max * s + 1e-30) + OFFSET < OVERFLOW_EXPONENT
  fixed = (bound.max(axis=1) <= gate(s, every_key_visited)) & fits & jnp.isfinite(bound).all(axis=1)
  return FixedOffsets(qs, m, fixed.astype(jnp.int32))
