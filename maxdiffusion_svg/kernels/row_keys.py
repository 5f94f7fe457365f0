"""Row keys: a few extra keys per query tile row (compensation's centroids), beside the tiles.

``k [B, H, num_q_tiles, m, D]``, ``v [..., m, Dv]``, natural-log ``bias [num_q_tiles, m]``
(``-inf``: unused slot). Our kernel takes them as it closes a row; other executors merge them
after by log-sum-exp (:func:`row_softmax`, :func:`merge`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Logits the separate pass holds at once (bytes): it walks query tiles in chunks of this size.
_CHUNK_LOGIT_BYTES = 64 * 2**20


class RowKeys(NamedTuple):
  """Per query tile row, ``m`` extra keys and values and their static additive logits."""

  k: jax.Array  # [B, H, num_q_tiles, m, D], q's dtype
  v: jax.Array  # [B, H, num_q_tiles, m, Dv], v's dtype
  # float32 [num_q_tiles, m]: log(weight), -inf for an unused slot; static, or on device per
  # head, [B, H, num_q_tiles, m], where each head has its own tiles (the semantic layout's)
  bias: Any


def check_row_keys(rk: RowKeys, q_shape: tuple[int, ...], num_q_tiles: int) -> None:
  """Shapes that agree with the call's queries and plan, or a message naming them."""
  b, h, _, d = q_shape
  nq, m = rk.bias.shape[-2:]
  if (rk.bias.ndim not in (2, 4) or rk.bias.shape[:-2] not in ((), (b, h)) or nq != num_q_tiles or rk.k.shape != (b, h, nq, m, d)
      or rk.v.shape[:4] != (b, h, nq, m)):
    raise ValueError(f"row keys must be k [B, H, q_tiles, m, D] = {(b, h, num_q_tiles, m, d)} "
                     f"with bias [q_tiles, m] = {(num_q_tiles, m)}, got k {tuple(rk.k.shape)}, "
                     f"v {tuple(rk.v.shape)}, bias {rk.bias.shape}")


def row_key_slots(count: int, chunk: int) -> int:
  """Our kernel's slots for ``count`` row keys: whole chunks of at most ``chunk``; 0 for none."""
  if not count:
    return 0
  step = min(-(-count // 8) * 8, chunk)
  return -(-count // step) * step


def pad_row_keys(rk: RowKeys, chunk: int) -> RowKeys:
  """``rk`` with unused slots appended up to :func:`row_key_slots` (their logit is ``-inf``)."""
  m = rk.bias.shape[-1]
  pad = row_key_slots(m, chunk) - m
  if not pad:
    return rk
  slots = ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0))
  return RowKeys(jnp.pad(rk.k, slots), jnp.pad(rk.v, slots),
                 np.pad(rk.bias, ((0, 0), (0, pad)), constant_values=-np.inf))


def softmax_over(q: jax.Array, k: jax.Array, v: jax.Array, bias: Any,
                 scale: float) -> tuple[jax.Array, jax.Array]:
  """Float32 ``(out [B, H, Q, Dv], lse [B, H, Q])`` of ``[B, H, Q, D]`` queries over ``k``, ``v``
  ``[B, H, N, .]`` plus ``bias`` (to ``[B, H, N, Q]``; ``-inf``: unseen); zeros and ``-inf`` where
  a query sees none. Logits are ``[N, Q]``: queries on lanes, as in our kernel."""
  logits = jnp.einsum("bhnd,bhqd->bhnq", k.astype(q.dtype), q,
                      preferred_element_type=jnp.float32) * scale + bias
  peak = logits.max(axis=-2)
  safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
  p = jnp.exp(logits - safe[..., None, :])
  total = p.sum(axis=-2)
  out = jnp.einsum("bhnq,bhnd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  kept = total > 0
  out = out * jnp.where(kept, 1.0 / jnp.where(kept, total, 1.0), 0.0)[..., None]
  lse = jnp.where(kept, safe + jnp.log(jnp.where(kept, total, 1.0)), -jnp.inf)
  return out, lse


def row_softmax(q: jax.Array, rk: RowKeys, block_q: int,
                scale: float) -> tuple[jax.Array, jax.Array]:
  """:func:`softmax_over` each query tile row's keys: float32 ``(out [B, H, S, Dv],
  lse [B, H, S])``, zeros and ``-inf`` where a row has none; chunked over query tiles."""
  b, h, s, d = q.shape
  nq, m = rk.bias.shape[-2:]
  dv = rk.v.shape[-1]
  qt = jnp.pad(q, ((0, 0), (0, 0), (0, nq * block_q - s), (0, 0)))
  qt = jnp.moveaxis(qt.reshape(b, h, nq, block_q, d), 2, 0)  # [nq, B, H, bq, D]

  def row(args):
    qs, ks, vs, rb = args
    return softmax_over(qs, ks, vs, rb[..., None], scale)  # rb: [m] or [B, H, m]

  chunk = max(1, min(nq, _CHUNK_LOGIT_BYTES // max(1, b * h * block_q * m * 4)))
  keys, values = jnp.moveaxis(rk.k, 2, 0), jnp.moveaxis(rk.v, 2, 0)  # [nq, B, H, m, D]
  bias = jnp.asarray(rk.bias)
  bias = bias if bias.ndim == 2 else jnp.moveaxis(bias, 2, 0)  # [nq, m] or [nq, B, H, m]
  out, lse = jax.lax.map(row, (qt, keys, values, bias), batch_size=chunk)
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, nq * block_q, dv)[:, :, :s]
  lse = jnp.moveaxis(lse, 0, 2).reshape(b, h, nq * block_q)[:, :, :s]
  return out, lse


def merge(out: jax.Array, lse: jax.Array, extra: jax.Array, extra_lse: jax.Array) -> jax.Array:
  """One softmax over two disjoint key sets from each's output and lse, in ``out``'s dtype (zeros
  where neither kept any), as ``out + w (extra - out)`` with one weight ``w`` per query."""
  gap = lse - extra_lse
  w = jnp.where(jnp.isnan(gap), 0.0, 1.0 / (1.0 + jnp.exp(gap)))  # nan: neither set kept any
  base = out.astype(jnp.float32)
  return (base + w[..., None] * (extra.astype(jnp.float32) - base)).astype(out.dtype)


def with_row_keys(out: jax.Array, lse: jax.Array, q: jax.Array, rk: RowKeys, block_q: int,
                  scale: float) -> tuple[jax.Array, jax.Array]:
  """A kernel's ``(out, lse)`` over its tiles, with the row keys added: ``(out, lse)``."""
  extra, extra_lse = row_softmax(q, rk, block_q, scale)
  return merge(out, lse, extra, extra_lse), jnp.logaddexp(lse, extra_lse)
