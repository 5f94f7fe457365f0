"""``sparse_attention``: one TilePlan, any JAX backend."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.kernels import refusal
from maxdiffusion_svg.kernels.gradient import differentiable
from maxdiffusion_svg.kernels.pallas import check_shapes, pallas_sparse_attention
from maxdiffusion_svg.kernels.row_keys import RowKeys, check_row_keys, with_row_keys
from maxdiffusion_svg.kernels.splash import splash_sparse_attention
from maxdiffusion_svg.kernels.splash_backward import (backward_tiles, check_backward_fits,
                                                      splash_sparse_attention_backward)
from maxdiffusion_svg.kernels.tokamax_splash import load as load_tokamax
from maxdiffusion_svg.kernels.tpu_memory import check_fits
from maxdiffusion_svg.kernels.worklist import ragged_tables
from maxdiffusion_svg.kernels.xla import xla_sparse_attention
from maxdiffusion_svg.plan.target import (BACKENDS, TPU_BACKENDS, Target, lowering_tpu_target,
                                          resolve_backend, target_for_call)
from maxdiffusion_svg.plan.tiles import TilePlan
from maxdiffusion_svg.plan.tiling import default_kv_compute

__all__ = ["BACKENDS", "BACKWARDS", "SparseKernel", "check_tpu_call", "lowering_tpu_target",
           "prepare_kernel", "resolve_backend", "sparse_attention"]


# What a gradient of a call runs (see :func:`sparse_attention`).
BACKWARDS = ("auto", "xla")


def check_tpu_call(plan: TilePlan, head_dim: int, dtype: Any, block_kv_compute: int,
                   target: Target, backend: str, value_dim: int | None = None,
                   row_keys: int = 0, tables: int = 1) -> None:
  """What a TPU lowering of ``backend`` (``pallas``/``splash``) refuses before compiling: shapes,
  then VMEM and SMEM on ``target``; the pre-flight (``tiles --config``) runs the same checks.
  ``row_keys``: extra keys per row; ``tables``: heads walking their own tile tables, else 1."""
  if backend == "pallas":
    check_shapes(head_dim, dtype, plan, block_kv_compute, value_dim)
  else:
    load_tokamax()
  check_fits(plan, head_dim, dtype, block_kv_compute, target, backend, row_keys, tables)


def _check_inputs(q: Any, k: Any, v: Any, plan: TilePlan) -> None:
  if not isinstance(plan, TilePlan):
    raise ValueError(f"plan must be a TilePlan (see plan_tiles), got {type(plan).__name__}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be [B, H, S, D], got shape {getattr(x, 'shape', None)}")
  window = plan.q_len is not None  # a ring shard's rows against the key tiles it fetched
  if (q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]
      or (not window and q.shape[2] != k.shape[2])):
    raise ValueError(f"q, k, v must share [B, H, S]: got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                     f"v {tuple(v.shape)}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"q and k head dims differ: expected {q.shape[-1]}, got {k.shape[-1]}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
  if window:  # keys as a ring window holds them (whole tiles), or the plan's real keys
    keys = plan.num_kv_tiles * plan.block_kv
    if q.shape[2] != plan.q_len or k.shape[2] not in (keys, plan.seq_len):
      raise ValueError(f"plan was built for {plan.q_len} queries against {keys} keys "
                       f"({plan.seq_len} real), but inputs have {q.shape[2]} and {k.shape[2]}")
  elif q.shape[2] != plan.seq_len:
    raise ValueError(f"plan was built for seq_len {plan.seq_len}, but inputs have S = {q.shape[2]}")


def _check_head_tiles(head_tiles: Any, q_shape: tuple[int, ...], plan: TilePlan,
                      backend: str) -> None:
  if backend == "splash":
    raise ValueError("svg_layouts semantic (per-head tile tables computed on device) needs "
                     "svg_backend pallas or xla: Splash's tile tables are static")
  if plan.mode.value != "aligned" or plan.q_len is not None:
    raise ValueError(f"per-head tile tables need an aligned plan of the whole call (svg_tile_mode "
                     f"aligned), got {plan.mode.value}")
  want = (*q_shape[:2], plan.num_q_tiles, plan.width)
  if tuple(head_tiles.shape) != want:
    raise ValueError(f"head_tiles must be int32 [B, H, q_tiles, width] = {want}, got "
                     f"{tuple(head_tiles.shape)}")


@dataclasses.dataclass(frozen=True)
class SparseKernel:
  """``sparse_attention`` prepared once for a plan on a target (as Splash's ``make_splash_mha``):
  executor, TPU target and inner kv step are decided here; a call only runs them."""

  plan: TilePlan
  backend: str  # as given: auto, pallas, splash or xla
  resolved: str  # what runs where the call is lowered for ``target``
  tpu_backend: str  # the kernel a TPU lowering runs (``auto``: the TPU default)
  target: Target
  tpu: Target  # the TPU a lowering for one is held to (``target``, or a speculative one)
  block_kv_compute: int  # the TPU kernels' inner kv step
  tiles_per_step: int | None  # the XLA path's
  backward: str
  on_tpu: bool  # compiled for a TPU: the TPU kernel alone
  follows_lowering: bool  # nothing named the platform: both, behind the lowering platform

  def per_lowering(self, on_tpu: Callable[[], Callable[..., Any]],
                   on_host: Callable[[], Callable[..., Any]],
                   host_only: bool = False) -> Callable[..., Any]:
    """The TPU's function when compiled for a TPU, the host's when only the host runs it, else
    both behind the lowering platform."""
    if self.on_tpu:
      return on_tpu()
    if host_only or not self.follows_lowering:
      return on_host()
    return lambda *xs: jax.lax.platform_dependent(*xs, tpu=on_tpu(), default=on_host())

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None,
               return_lse: bool = False, row_keys: RowKeys | None = None,
               head_tiles: jax.Array | None = None,
               head_steps: int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over the plan's tiles (see :func:`sparse_attention` for the arguments)."""
    plan = self.plan
    _check_inputs(q, k, v, plan)
    if row_keys is not None:
      check_row_keys(row_keys, q.shape, plan.num_q_tiles)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if head_tiles is not None:
      _check_head_tiles(head_tiles, q.shape, plan, self.resolved)
    elif head_steps is not None:
      raise ValueError("head_steps (a per-head budget's ragged work) needs head_tiles")
    executor = functools.partial(self._executor, q.shape[-1], q.dtype, v.shape[-1], scale,
                                 head_steps)
    executor(return_lse, row_keys, head_tiles)  # refusals surface here, before any tracing
    attend = differentiable(executor, plan, scale, return_lse, row_keys, head_tiles,
                            self._tile_backward(q.shape[-1], q.dtype, scale, head_tiles))
    return attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))

  def _executor(self, head_dim: int, dtype: Any, value_dim: int, scale: float,
                head_steps: int | None, return_lse: bool, row_keys: RowKeys | None,
                head_tiles: jax.Array | None) -> Callable[..., Any]:
    """The call's executor for these row keys and tables, with or without its log-sum-exp."""
    plan, tpu, kv_compute = self.plan, self.tpu, self.block_kv_compute
    per_head_bias = row_keys is not None and not isinstance(row_keys.bias, np.ndarray)
    tables = 1 if head_tiles is None else head_tiles.shape[0] * head_tiles.shape[1]
    if head_steps is not None:  # a ragged list and its heads' ids, in plan-long work lists
      tables = ragged_tables(plan, tables, head_steps)

    def merged_after(run):
      """``run`` (no row keys of its own, or a per-head bias), the row keys merged after by lse."""
      if row_keys is None:
        return lambda q, k, v: run(q, k, v, return_lse)
      def call(q, k, v):
        out, lse = with_row_keys(*run(q, k, v, True), q, row_keys, plan.block_q, scale)
        return (out, lse) if return_lse else out
      return call

    def kernel(interpret: bool):
      if self.tpu_backend == "pallas":
        check_shapes(head_dim, dtype, plan, kv_compute, value_dim)
        run = lambda q, k, v, lse, rk: pallas_sparse_attention(
            q, k, v, plan, scale, interpret=interpret, block_kv_compute=kv_compute,
            return_lse=lse, row_keys=rk, head_tiles=head_tiles, head_steps=head_steps)
        if per_head_bias:
          return merged_after(lambda q, k, v, lse: run(q, k, v, lse, None))
        return lambda q, k, v: run(q, k, v, return_lse, row_keys)
      return merged_after(lambda q, k, v, lse: splash_sparse_attention(
          q, k, v, plan, scale, interpret=interpret, block_kv_compute=kv_compute, return_lse=lse))

    xla = merged_after(lambda q, k, v, lse: xla_sparse_attention(
        q, k, v, plan, scale, tiles_per_step=self.tiles_per_step, return_lse=lse,
        head_tiles=head_tiles, ragged=head_steps is not None))

    def on_tpu():
      """Mosaic where it fits; else, for a speculative TPU, a refusal raised at TPU lowering."""
      try:
        check_tpu_call(plan, head_dim, dtype, kv_compute, tpu, self.tpu_backend, value_dim,
                       0 if row_keys is None or per_head_bias else row_keys.bias.shape[-1], tables)
        return kernel(interpret=False)
      except ValueError as err:
        if not tpu.speculative:
          raise
        return refusal.refused_on_tpu(str(err), return_lse)

    if self.on_tpu and self.resolved == "xla":
      return xla
    host = (lambda: xla) if self.resolved == "xla" else (lambda: kernel(interpret=True))
    return self.per_lowering(on_tpu, host, host_only=self.backend == "xla")

  def _tile_backward(self, head_dim: int, dtype: Any, scale: float,
                     head_tiles: jax.Array | None) -> Callable[..., Any] | None:
    """Splash's backward kernel (:mod:`splash_backward`) where a TPU kernel ran forward with one
    table for every head; None (the portable backward) for ring shards, head tables or ``xla``."""
    plan, tpu = self.plan, self.tpu
    if (self.backward == "xla" or self.resolved == "xla" or head_tiles is not None
        or plan.q_len is not None):
      return None
    # Splash's own inner kv step: our kernel's wider one is tuned for its forward, not this one.
    bwd_kv = (self.block_kv_compute if self.tpu_backend == "splash"
              else default_kv_compute(plan.block_kv))
    blocks = backward_tiles(plan, bwd_kv, head_dim, dtype, tpu)
    run = lambda interpret: lambda *xs: splash_sparse_attention_backward(
        *xs, plan, scale, interpret=interpret, block_kv_compute=bwd_kv, bwd_blocks=blocks)

    def on_tpu():
      try:
        check_backward_fits(plan, blocks, head_dim, dtype, tpu)
        return run(False)
      except ValueError as err:
        if not tpu.speculative:
          raise
        return refusal.refused_backward_on_tpu(str(err))

    # Built when the call is differentiated (the backward rule is traced): refusals surface then.
    return lambda q, k, v, lse, delta, dout, _: self.per_lowering(on_tpu, lambda: run(True))(
        q, k, v, lse, delta, dout)


def prepare_kernel(plan: TilePlan, target: Target, *, backend: str = "auto",
                   block_kv_compute: int | None = None, tiles_per_step: int | None = None,
                   backward: str = "auto", tpu: Target | None = None) -> SparseKernel:
  """:class:`SparseKernel` for ``plan`` on ``target``. ``tpu``: the TPU a lowering is held to (None:
  from ``target``); ``block_kv_compute`` None: the TPU kernel's default for ``plan.block_kv``."""
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
  if not isinstance(plan, TilePlan):
    raise ValueError(f"plan must be a TilePlan (see plan_tiles), got {type(plan).__name__}")
  # a named executor needs no resolving (resolve_backend checks the name of any other)
  resolved = backend if backend in BACKENDS[1:] else resolve_backend(backend, target)
  tpu_backend = resolved if resolved in TPU_BACKENDS else TPU_BACKENDS[0]
  return SparseKernel(
      plan, backend, resolved, tpu_backend, target, tpu or lowering_tpu_target(target),
      block_kv_compute or default_kv_compute(plan.block_kv, tpu_backend), tiles_per_step,
      backward, target.is_tpu, target.follows_lowering)


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, plan: TilePlan, *,
                     scale: float | None = None, backend: str = "auto",
                     block_kv_compute: int | None = None,
                     tiles_per_step: int | None = None,
                     target: Target | None = None,
                     return_lse: bool = False,
                     row_keys: RowKeys | None = None,
                     head_tiles: jax.Array | None = None,
                     head_steps: int | None = None,
                     backward: str = "auto") -> jax.Array | tuple[jax.Array, jax.Array]:
  """Attention over the tiles ``plan`` visits, with ``q, k, v`` already in the plan's layout.

  Inputs ``[B, H, S, D]``, ``S == plan.seq_len``, one plan for every head; output ``[B, H, S, Dv]``
  in q's dtype, accumulated in float32; a row with no kept key gives zeros. ``backend``:
  ``pallas`` (ours, the TPU default), ``splash`` (tokamax's) or ``xla``; the TPU kernels run
  interpreted off TPU. ``block_kv_compute`` and ``tiles_per_step`` tune speed, not results.
  ``target`` (None: from the inputs' sharding or the mesh, else the default device): on a TPU,
  VMEM and SMEM are checked before compiling. ``return_lse`` adds float32 ``[B, H, S]``
  log-sum-exp (natural log; ``-inf`` or very negative where a row keeps nothing). ``row_keys``:
  extra keys per query tile row (:mod:`maxdiffusion_svg.kernels.row_keys`). ``head_tiles``:
  int32 ``[B, H, num_q_tiles, width]``, each head's own key tiles at an aligned plan's per-row
  counts (Splash refuses them); ``head_steps``: a per-head budget, tables holding ``-1`` past a
  head's count, at most ``head_steps`` grid steps per core. ``backward``: ``auto`` (Splash's
  backward kernel on TPU where one table serves every head, else portable) or ``xla``.
  """
  kernel = prepare_kernel(plan, target_for_call(q, k, v, target=target), backend=backend,
                          block_kv_compute=block_kv_compute, tiles_per_step=tiles_per_step,
                          backward=backward)
  return kernel(q, k, v, scale=scale, return_lse=return_lse, row_keys=row_keys,
                head_tiles=head_tiles, head_steps=head_steps)
