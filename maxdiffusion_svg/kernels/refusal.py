"""A refusal that waits for the lowering platform.

With ``svg_backend: auto`` on a host that is not a TPU, and nothing naming the platform, the
TPU executor is traced beside the host's in case the call is lowered for a TPU (an export).
Tiles the strictest known TPU cannot hold must not stop runs on this host, yet must never
reach libtpu: the TPU branch becomes this identity whose TPU lowering raises our message.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

_refused = Primitive("svg_refused_on_tpu")
_refused.def_impl(lambda x, *, message: x)
_refused.def_abstract_eval(lambda x, *, message: x)


def _identity(ctx, x, *, message):  # pylint: disable=unused-argument
  return [x]


def _refuse(ctx, x, *, message):  # pylint: disable=unused-argument
  raise ValueError(message)


mlir.register_lowering(_refused, _identity)
mlir.register_lowering(_refused, _refuse, platform="tpu")


def refused_on_tpu(message: str, return_lse: bool = False) -> Callable[..., Any]:
  """An attention executor (``q, k, v -> out`` shaped like q, and with ``return_lse`` a
  float32 ``[B, H, S]`` log-sum-exp) that cannot be lowered for a TPU: lowering it there
  raises ``ValueError(message)``."""
  def run(q, k, v):
    out = _refused.bind(jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype), message=message)
    return (out, jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)) if return_lse else out
  return run


def refused_backward_on_tpu(message: str) -> Callable[..., Any]:
  """A tiles' backward (``q, k, v, lse, delta, dout, tables -> dq, dk, dv`` in float32) that
  cannot be lowered for a TPU, as :func:`refused_on_tpu` for the forward."""
  def run(q, k, v, *_):
    return tuple(_refused.bind(jnp.zeros(x.shape, jnp.float32), message=message)
                 for x in (q, k, v))
  return run
