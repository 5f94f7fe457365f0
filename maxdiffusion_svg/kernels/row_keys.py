"""Row keys: a few extra keys per query tile row, beside the tiles a plan visits.

Compensation (:mod:`maxdiffusion_svg.routing.compensation`) gives each query tile row the centroids
of the key tiles it skips. To a kernel these are just more keys, different per row: ``k [B, H,
num_q_tiles, m, D]`` and ``v [..., m, Dv]`` with an additive logit ``bias [num_q_tiles, m]``
(natural log; ``-inf`` where a row has fewer than ``m``). Our Pallas kernel takes them into the
row's softmax state when it closes the row (one more ``m``-key chunk per row, nothing written
to memory); the other executors return their log-sum-exp and this module's :func:`row_softmax`
and :func:`merge` add them after the kernel.
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
  """Slots our kernel holds for ``count`` row keys: whole chunks of at most ``chunk`` (its inner
  kv step), so the closing step's scores are no larger than a tile's; none for none."""
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
  """Softmax of ``[B, H, Q, D]`` queries over keys ``k [B, H, N, D]`` (values ``[B, H, N, Dv]``)
  with additive logits ``bias`` (broadcast to ``[B, H, N, Q]``; ``-inf``: not seen): ``(out
  [B, H, Q, Dv], lse [B, H, Q])``, float32, ``lse = -inf`` and ``out = 0`` where a query sees
  none. Logits are ``[N, Q]``, queries on lanes as in our kernel: reductions over keys run
  across sublanes and the log-sum-exp comes out lane-major."""
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
  """Softmax of ``[B, H, S, D]`` queries over their query tile row's keys: ``(out [B, H, S,
  Dv], lse [B, H, S])``, float32, ``lse = -inf`` and ``out = 0`` where a row has none. Chunked
  over query tiles; logits are ``[m, block_q]``, queries on lanes as in our kernel."""
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
  """One softmax over two disjoint sets of keys from each set's normalised output and
  log-sum-exp; in ``out``'s dtype, zeros where neither set kept anything.

  As ``out + w * (extra - out)`` with one weight per query, ``w = 1 / (1 + exp(lse -
  extra_lse))`` (the extra set's share): one value to broadcast over the head dim, not three."""
  gap = lse - extra_lse
  w = jnp.where(jnp.isnan(gap), 0.0, 1.0 / (1.0 + jnp.exp(gap)))  # nan: neither set kept any
  base = out.astype(jnp.float32)
  return (base + w[..., None] * (extra.astype(jnp.float32) - base)).astype(out.dtype)


def with_row_keys(out: jax.Array, lse: jax.Array, q: jax.Array, rk: RowKeys, block_q: int,
                  scale: float) -> tuple[jax.Array, jax.Array]:
  """A kernel's ``(out, lse)`` over its tiles, with the row keys added: ``(out, lse)``."""
  extra, extra_lse = row_softmax(q, rk, block_q, scale)
  return merge(out, lse, extra, extra_lse), jnp.logaddexp(lse, extra_lse)
