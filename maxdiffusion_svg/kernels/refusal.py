"""A refusal that waits for the lowering platform: an identity whose TPU lowering raises.

A speculative TPU branch (nothing named the platform) refuses without stopping host runs.
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
  """An executor (``q, k, v -> out``; with ``return_lse`` also float32 ``[B, H, S]`` lse) whose
  TPU lowering raises ``ValueError(message)``."""
  def run(q, k, v):
    out = _refused.bind(jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype), message=message)
    return (out, jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)) if return_lse else out
  return run


def refused_backward_on_tpu(message: str) -> Callable[..., Any]:
  """A backward (float32 ``dq, dk, dv``) whose TPU lowering raises ``ValueError(message)``."""
  def run(q, k, v, *_):
    return tuple(_refused.bind(jnp.zeros(x.shape, jnp.float32), message=message)
                 for x in (q, k, v))
  return run
