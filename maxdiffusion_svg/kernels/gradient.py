"""``sparse_attention``'s derivative: any executor's forward, the flash-style backward.

A ``jax.custom_vjp``: differentiated, the forward also saves ``q, k, v``, the output and its
log-sum-exp (``O(S)`` per head); the backward recomputes visited tiles. Tile choice gets no
derivative and the row keys' bias is constant; the row keys' ``k`` and ``v`` get theirs.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.kernels.backward import (Cotangents, row_delta, row_keys_backward,
                                               sparse_attention_backward)
from maxdiffusion_svg.kernels.row_keys import RowKeys
from maxdiffusion_svg.plan.tiles import TilePlan

# Names a remat policy can save or offload (``jax.checkpoint_policies`` by name): the
# attention's output and its log-sum-exp, what the flash backward keeps beside q, k and v.
RESIDUAL_NAMES = ("svg_attention_out", "svg_attention_lse")
# A caller's name for both as well: MaxDiffusion's (``self_attn``), which its policies name.
_CALLER_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("svg_residual_name",
                                                                          default=None)

Executor = Callable[[bool, "RowKeys | None", "jax.Array | None"], Callable[..., Any]]


@contextlib.contextmanager
def residuals_named(name: str | None) -> Iterator[None]:
  """Calls traced inside also name their residuals ``name`` (e.g. for a remat offload policy)."""
  token = _CALLER_NAME.set(name)
  try:
    yield
  finally:
    _CALLER_NAME.reset(token)


def _named(out: jax.Array, lse: jax.Array, caller: str | None) -> tuple[jax.Array, jax.Array]:
  name = jax.ad_checkpoint.checkpoint_name
  out, lse = name(out, RESIDUAL_NAMES[0]), name(lse, RESIDUAL_NAMES[1])
  return (out, lse) if caller is None else (name(out, caller), name(lse, caller))


# The tiles' backward: ``(q, k, v, lse, delta, dout, head_tiles) -> (dq, dk, dv)`` in float32.
TileBackward = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def xla_backward(plan: TilePlan, scale: float) -> TileBackward:
  """The portable backward (:func:`sparse_attention_backward`), for any executor's forward."""
  return lambda q, k, v, lse, delta, dout, tables: sparse_attention_backward(
      q, k, v, lse, delta, dout, plan, scale, head_tiles=tables)


def differentiable(executor: Executor, plan: TilePlan, scale: float, return_lse: bool,
                   row_keys: RowKeys | None, head_tiles: jax.Array | None,
                   tile_backward: TileBackward | None = None) -> Callable[..., Any]:
  """``f(q, k, v)``: ``executor`` with a derivative in ``q, k, v`` and the row keys' ``k, v``;
  ``tile_backward`` None: :func:`xla_backward`. Traced row keys and tables are passed as
  arguments (a custom VJP must not close over tracers)."""
  tile_backward = tile_backward or xla_backward(plan, scale)
  static_bias = row_keys is not None and isinstance(row_keys.bias, np.ndarray)
  # Read now: the forward rule may be traced later (a remat traces it when it differentiates).
  caller = _CALLER_NAME.get()

  def keys_of(rk_k, rk_v, rk_bias):
    if rk_k is None:
      return None
    return RowKeys(rk_k, rk_v, row_keys.bias if static_bias else rk_bias)

  @jax.custom_vjp
  def attend(q, k, v, rk_k, rk_v, rk_bias, tables):
    return executor(return_lse, keys_of(rk_k, rk_v, rk_bias), tables)(q, k, v)

  def forward(q, k, v, rk_k, rk_v, rk_bias, tables):
    out, lse = executor(True, keys_of(rk_k, rk_v, rk_bias), tables)(q, k, v)
    out, lse = _named(out, lse, caller)
    # The inputs are kept too (placed copies a remat would otherwise hold on the device): named
    # so that a policy offloading the caller's name offloads them with the output.
    if caller is not None:
      q, k, v = (jax.ad_checkpoint.checkpoint_name(x, caller) for x in (q, k, v))
    return ((out, lse) if return_lse else out), (q, k, v, rk_k, rk_v, rk_bias, tables, out, lse)

  def backward(res, ct):
    q, k, v, rk_k, rk_v, rk_bias, tables, out, lse = res
    ct = Cotangents(*ct) if return_lse else Cotangents(ct, None)
    delta = row_delta(out, ct)
    dq, dk, dv = tile_backward(q, k, v, lse, delta, ct.dout, tables)
    d_rk_k = d_rk_v = None
    rk = keys_of(rk_k, rk_v, rk_bias)
    if rk is not None:
      dq_rows, d_rk_k, d_rk_v = row_keys_backward(q, rk, lse, delta, ct.dout, plan.block_q, scale)
      dq = dq + dq_rows
      d_rk_k, d_rk_v = d_rk_k.astype(rk_k.dtype), d_rk_v.astype(rk_v.dtype)
    zero_bias = None if rk_bias is None else jnp.zeros_like(rk_bias)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_rk_k, d_rk_v,
            zero_bias, None)

  attend.defvjp(forward, backward)
  rk_args = ((None, None, None) if row_keys is None
             else (row_keys.k, row_keys.v, None if static_bias else row_keys.bias))
  return lambda q, k, v: attend(q, k, v, *rk_args, head_tiles)
