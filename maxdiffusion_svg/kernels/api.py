"""``sparse_attention``: one TilePlan, any JAX backend."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from maxdiffusion_svg.tiles import TilePlan

BACKENDS = ("auto", "splash", "xla")
# Tile sizes when a caller gives none: 512 was fastest for the XLA path on CPU;
# 3328x1536 is the seed design's TPU tile.
DEFAULT_BLOCKS = {"xla": (512, 512), "splash": (3328, 1536)}


def resolve_backend(backend: str) -> str:
  """``auto`` is Splash on TPU and the XLA path elsewhere."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
  if backend == "auto":
    return "splash" if jax.default_backend() == "tpu" else "xla"
  return backend


def _check_inputs(q: Any, k: Any, v: Any, plan: TilePlan) -> None:
  if not isinstance(plan, TilePlan):
    raise ValueError(f"plan must be a TilePlan (see plan_tiles), got {type(plan).__name__}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be [B, H, S, D], got shape {getattr(x, 'shape', None)}")
  if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3]:
    raise ValueError(f"q, k, v must share [B, H, S]: got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                     f"v {tuple(v.shape)}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"q and k head dims differ: expected {q.shape[-1]}, got {k.shape[-1]}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
  if q.shape[2] != plan.seq_len:
    raise ValueError(f"plan was built for seq_len {plan.seq_len}, but inputs have S = {q.shape[2]}")


def _inference_only(fn):
  """Wraps ``fn`` so that any derivative raises instead of silently producing garbage."""
  guarded = jax.custom_jvp(fn)

  @guarded.defjvp
  def _no_derivative(primals, tangents):
    del primals, tangents
    raise NotImplementedError(
        "sparse_attention is inference-only: it has no gradient. Use dense attention for "
        "training or fine-tuning.")

  return guarded


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, plan: TilePlan, *,
                     scale: float | None = None, backend: str = "auto",
                     block_kv_compute: int | None = None,
                     tiles_per_step: int | None = None) -> jax.Array:
  """Attention over the tiles ``plan`` visits, with ``q, k, v`` already in the plan's layout.

  Inputs are ``[B, H, S, D]`` with ``S == plan.seq_len``; every head shares the plan.
  Output is ``[B, H, S, Dv]`` in q's dtype, accumulated in float32. A row with no kept
  key yields zeros. ``block_kv_compute`` (Splash) and ``tiles_per_step`` (XLA) tune the
  backends without changing results.
  """
  _check_inputs(q, k, v, plan)
  backend = resolve_backend(backend)
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

  if backend == "splash":
    from maxdiffusion_svg.kernels.splash import splash_sparse_attention  # pylint: disable=import-outside-toplevel

    def run(interpret):
      return lambda q, k, v: splash_sparse_attention(q, k, v, plan, scale, interpret=interpret,
                                                     block_kv_compute=block_kv_compute)

    # The Mosaic kernel where the function is lowered for TPU, its interpreter elsewhere:
    # decided per lowering platform, so one jitted function runs on CPU and exports for TPU.
    impl = lambda q, k, v: jax.lax.platform_dependent(q, k, v, tpu=run(False), default=run(True))
  else:
    from maxdiffusion_svg.kernels.xla import xla_sparse_attention  # pylint: disable=import-outside-toplevel
    impl = lambda q, k, v: xla_sparse_attention(q, k, v, plan, scale, tiles_per_step)
  return _inference_only(impl)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
