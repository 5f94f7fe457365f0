"""Flash-style gradient of a plan's sparse attention: recompute visited tiles, store no scores.

Per tile, ``p = exp(scale q·k - lse)`` (0 where masked), ``delta = rowsum(dout * out) - dlse``:

    dv += pᵀ dout      dp = dout vᵀ      ds = p (dp - delta)
    dq += scale ds k   dk += scale dsᵀ q

A ``lax.scan`` over the XLA forward's work list scatter-adds into float32 accumulators.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.kernels.row_keys import RowKeys
from maxdiffusion_svg.kernels.worklist import head_table_slots
from maxdiffusion_svg.plan.tiles import FULL, TilePlan

# Float32 logits held per scan step (bytes); a step holds about four arrays of this size.
_STEP_LOGIT_BYTES = 32 * 2**20
_CHUNK_LOGIT_BYTES = 32 * 2**20


class Cotangents(NamedTuple):
  """What the backward is handed: the output's cotangent and the log-sum-exp's (or None)."""

  dout: jax.Array  # [B, H, S, Dv]
  dlse: jax.Array | None  # [B, H, S] float32


def row_delta(out: jax.Array, ct: Cotangents) -> jax.Array:
  """``rowsum(dout * out) - dL`` per query, float32 ``[B, H, S]``: the softmax's own term."""
  delta = jnp.einsum("bhsd,bhsd->bhs", ct.dout.astype(jnp.float32), out.astype(jnp.float32))
  return delta if ct.dlse is None else delta - ct.dlse.astype(jnp.float32)


def _tiles(x: jax.Array, tiles: int, block: int, value: float = 0.0) -> jax.Array:
  """``[B, H, S, ...]`` -> ``[B, H, tiles, block, ...]``, padding the sequence with ``value``."""
  pad = [(0, 0)] * x.ndim
  pad[2] = (0, tiles * block - x.shape[2])
  x = jnp.pad(x, pad, constant_values=value)
  return x.reshape(*x.shape[:2], tiles, block, *x.shape[3:])


def _steps(n: int, per_step: int) -> tuple[int, int]:
  """``(steps, per_step)`` covering ``n`` tiles with the least padding."""
  steps = max(1, -(-n // per_step))
  return steps, -(-n // steps)


def backward_steps(plan: TilePlan, batch: int, heads: int,
                   tiles_per_step: int | None = None) -> int:
  """How many scan steps :func:`sparse_attention_backward` takes for one call over ``plan``."""
  if tiles_per_step is None:
    tiles_per_step = max(1, _STEP_LOGIT_BYTES // (batch * heads * plan.block_q * plan.block_kv * 4))
  return _steps(int(plan.num_visited.sum()), tiles_per_step)[0]


def _split(x: np.ndarray | jax.Array, steps: int, per_step: int, fill: int, axis: int = -1):
  """A flat work list (last axis) padded with ``fill`` and cut into ``[steps, ..., per_step]``."""
  pad = steps * per_step - x.shape[-1]
  widths = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
  lib = np if isinstance(x, np.ndarray) else jnp
  x = lib.pad(x, widths, constant_values=fill).reshape(*x.shape[:-1], steps, per_step)
  return lib.moveaxis(x, -2, 0)


def _scatter_add(acc: jax.Array, index: jax.Array, update: jax.Array) -> jax.Array:
  """``acc[:, :, index] += update``; ``index`` ``[C]`` or ``[B, H, C]``; out of range: dropped."""
  if index.ndim == 1:
    return acc.at[:, :, index].add(update, mode="drop")
  one = lambda a, i, u: a.at[i].add(u, mode="drop")
  return jax.vmap(jax.vmap(one))(acc, index, update)


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
  if index.ndim == 1:
    return jnp.take(x, index, axis=2, mode="clip")
  return jnp.take_along_axis(x, index[..., None, None], axis=2, mode="clip")


def sparse_attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, lse: jax.Array,
                              delta: jax.Array, dout: jax.Array, plan: TilePlan, scale: float,
                              head_tiles: jax.Array | None = None,
                              tiles_per_step: int | None = None
                              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Float32 ``(dq, dk, dv)`` over ``plan``'s visited tiles (or ``head_tiles``, ``-1``: unused),
  from the forward's ``lse`` and :func:`row_delta`'s ``delta``."""
  b, h, _, d = q.shape
  dv_dim = v.shape[-1]
  bq, bkv = plan.block_q, plan.block_kv
  nq, nkv = plan.num_q_tiles, plan.num_kv_tiles
  qt, kt, vt = _tiles(q, nq, bq), _tiles(k, nkv, bkv), _tiles(v, nkv, bkv)
  dot = _tiles(dout, nq, bq)
  # Padding queries weigh nothing: exp(s - inf) = 0. So does a row that kept no key.
  lse = jnp.where(jnp.isfinite(lse), lse, jnp.inf).astype(jnp.float32)
  lt, delt = _tiles(lse, nq, bq, jnp.inf), _tiles(delta.astype(jnp.float32), nq, bq)
  if head_tiles is None:
    rows, cols, kinds = plan.visited_tiles()
    full = kinds == FULL
  else:  # each head's own columns; padding differs per head, so every tile takes the rule
    rows, slots = head_table_slots(plan)
    cols = head_tiles[:, :, rows, slots]
    full = np.full(rows.size, plan.seq_len % bkv == 0)
  steps = backward_steps(plan, b, h, tiles_per_step)
  per_step = -(-rows.size // steps)
  work = (_split(rows.astype(np.int32), steps, per_step, nq),
          _split(jnp.asarray(cols, jnp.int32) if head_tiles is not None
                 else cols.astype(np.int32), steps, per_step, nkv),
          _split(full, steps, per_step, True))
  q_iota = jnp.arange(bq, dtype=jnp.int32)
  k_iota = jnp.arange(bkv, dtype=jnp.int32)

  def step(acc, w):
    dq, dk, dv = acc
    r, c, is_full = w
    qs, dos = jnp.take(qt, r, axis=2, mode="clip"), jnp.take(dot, r, axis=2, mode="clip")
    ls, ds_ = jnp.take(lt, r, axis=2, mode="clip"), jnp.take(delt, r, axis=2, mode="clip")
    ks, vs = _gather(kt, c), _gather(vt, c)
    s = jnp.einsum("bhcqd,bhckd->bhcqk", qs, ks, preferred_element_type=jnp.float32) * scale
    qpos = (r[:, None] * bq + q_iota)[:, :, None]
    kpos = (c[..., None] * bkv + k_iota)[..., None, :]
    keep = is_full[:, None, None] | plan.masked_tile_rule(qpos, kpos)
    keep = keep & (r < nq)[:, None, None]  # padding steps
    if head_tiles is not None:  # a per-head budget's row may end early (-1 in its slots)
      keep = keep & (c >= 0)[..., None, None]
    p = jnp.where(keep, jnp.exp(s - ls[..., None]), 0.0)
    dv_c = jnp.einsum("bhcqk,bhcqd->bhckd", p.astype(dout.dtype), dos,
                      preferred_element_type=jnp.float32)
    dp = jnp.einsum("bhcqd,bhckd->bhcqk", dos, vs, preferred_element_type=jnp.float32)
    ds = (p * (dp - ds_[..., None])).astype(q.dtype)
    dq_r = jnp.einsum("bhcqk,bhckd->bhcqd", ds, ks, preferred_element_type=jnp.float32) * scale
    dk_c = jnp.einsum("bhcqk,bhcqd->bhckd", ds, qs, preferred_element_type=jnp.float32) * scale
    c_drop = jnp.where((r < nq) & (c >= 0), c, nkv)
    return (dq.at[:, :, r].add(dq_r, mode="drop"), _scatter_add(dk, c_drop, dk_c),
            _scatter_add(dv, c_drop, dv_c)), None

  acc = (jnp.zeros((b, h, nq, bq, d), jnp.float32), jnp.zeros((b, h, nkv, bkv, d), jnp.float32),
         jnp.zeros((b, h, nkv, bkv, dv_dim), jnp.float32))
  work = tuple(map(jnp.asarray, work))
  (dq, dk, dv), _ = jax.lax.scan(step, acc, work)
  seq = lambda x, n: x.reshape(b, h, -1, x.shape[-1])[:, :, :n]
  return seq(dq, q.shape[2]), seq(dk, k.shape[2]), seq(dv, v.shape[2])


def row_keys_backward(q: jax.Array, rk: RowKeys, lse: jax.Array, delta: jax.Array,
                      dout: jax.Array, block_q: int, scale: float
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Float32 ``(dq, d rk.k, d rk.v)`` of the row keys, logits ``scale q·rk.k + rk.bias`` inside the
  forward's ``lse``; the bias is a constant."""
  b, h, s, d = q.shape
  nq, m = rk.bias.shape[-2:]
  lse = jnp.where(jnp.isfinite(lse), lse, jnp.inf).astype(jnp.float32)
  by_row = lambda x, value=0.0: jnp.moveaxis(_tiles(x, nq, block_q, value), 2, 0)
  bias = jnp.asarray(rk.bias, jnp.float32)
  bias = bias if bias.ndim == 2 else jnp.moveaxis(bias, 2, 0)  # [nq, m] or [nq, B, H, m]

  def row(args):
    qs, dos, ls, dl, ks, vs, rb = args  # one query tile row: [B, H, bq, ...], keys [B, H, m, D]
    s_ = jnp.einsum("bhqd,bhmd->bhqm", qs, ks.astype(qs.dtype),
                    preferred_element_type=jnp.float32) * scale
    s_ = s_ + (rb[None, None, None] if rb.ndim == 1 else rb[:, :, None])
    p = jnp.exp(s_ - ls[..., None])  # -inf bias (an unused slot) gives 0
    dvs = jnp.einsum("bhqm,bhqd->bhmd", p.astype(dos.dtype), dos,
                     preferred_element_type=jnp.float32)
    dp = jnp.einsum("bhqd,bhmd->bhqm", dos, vs.astype(dos.dtype),
                    preferred_element_type=jnp.float32)
    ds = (p * (dp - dl[..., None])).astype(qs.dtype)
    dqs = jnp.einsum("bhqm,bhmd->bhqd", ds, ks.astype(qs.dtype),
                     preferred_element_type=jnp.float32) * scale
    dks = jnp.einsum("bhqm,bhqd->bhmd", ds, qs, preferred_element_type=jnp.float32) * scale
    return dqs, dks, dvs

  chunk = max(1, min(nq, _CHUNK_LOGIT_BYTES // max(1, b * h * block_q * m * 4)))
  dq, dk, dv = jax.lax.map(row, (by_row(q), by_row(dout), by_row(lse, jnp.inf),
                                 by_row(delta.astype(jnp.float32)), jnp.moveaxis(rk.k, 2, 0),
                                 jnp.moveaxis(rk.v, 2, 0), bias), batch_size=chunk)
  dq = jnp.moveaxis(dq, 0, 2).reshape(b, h, nq * block_q, d)[:, :, :s]
  return dq, jnp.moveaxis(dk, 0, 2), jnp.moveaxis(dv, 0, 2)
