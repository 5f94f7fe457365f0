"""``sparse_attention``: one TilePlan, any JAX backend."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from maxdiffusion_svg.tiles import TilePlan

from maxdiffusion_svg.target import GENERIC_TPU, Target, target_of, tpu_target

BACKENDS = ("auto", "splash", "xla")
# The XLA path's tile when a caller gives none: 512 was fastest on CPU. Splash's depend on
# the TPU's VMEM (kernels.tpu_memory.default_splash_tiles).
XLA_BLOCKS = (512, 512)


def resolve_backend(backend: str, target: Target | None = None) -> str:
  """``auto`` is Splash on a TPU target and the XLA path elsewhere (target: default device)."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
  if backend == "auto":
    return "splash" if (target or target_of()).is_tpu else "xla"
  return backend


def follows_lowering_platform(backend: str, target: Target) -> bool:
  """``auto`` on a host that is not a TPU still picks Splash where the call is lowered for
  one (an ahead-of-time compile from a CPU host), through ``lax.platform_dependent``."""
  return backend == "auto" and not target.is_tpu


def lowering_tpu_target(target: Target) -> Target:
  """The TPU assumed when only the lowering platform says TPU: generation unknown."""
  return target if target.is_tpu else tpu_target(GENERIC_TPU)


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
                     tiles_per_step: int | None = None,
                     target: Target | None = None) -> jax.Array:
  """Attention over the tiles ``plan`` visits, with ``q, k, v`` already in the plan's layout.

  Inputs are ``[B, H, S, D]`` with ``S == plan.seq_len``; every head shares the plan.
  Output is ``[B, H, S, Dv]`` in q's dtype, accumulated in float32. A row with no kept
  key yields zeros. ``block_kv_compute`` (Splash) and ``tiles_per_step`` (XLA) tune the
  backends without changing results. ``target`` (default: the default device) is the
  hardware the call is compiled for: on a TPU, Splash's VMEM and SMEM needs are checked
  against its limits before anything compiles; with ``auto`` off TPU, Splash still runs
  where the call is lowered for a TPU.
  """
  _check_inputs(q, k, v, plan)
  target = target or target_of()
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

  def splash_impl(q, k, v):
    from maxdiffusion_svg.kernels.splash import splash_sparse_attention  # pylint: disable=import-outside-toplevel

    def run(interpret):
      return lambda q, k, v: splash_sparse_attention(q, k, v, plan, scale, interpret=interpret,
                                                     block_kv_compute=block_kv_compute,
                                                     target=lowering_tpu_target(target))

    # The Mosaic kernel where the function is lowered for TPU, its interpreter elsewhere:
    # decided per lowering platform, so one jitted function runs on CPU and exports for TPU.
    return jax.lax.platform_dependent(q, k, v, tpu=run(False), default=run(True))

  def xla_impl(q, k, v):
    from maxdiffusion_svg.kernels.xla import xla_sparse_attention  # pylint: disable=import-outside-toplevel
    return xla_sparse_attention(q, k, v, plan, scale, tiles_per_step)

  if follows_lowering_platform(backend, target):
    impl = lambda q, k, v: jax.lax.platform_dependent(q, k, v, tpu=splash_impl, default=xla_impl)
  else:
    impl = splash_impl if resolve_backend(backend, target) == "splash" else xla_impl
  return _inference_only(impl)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
