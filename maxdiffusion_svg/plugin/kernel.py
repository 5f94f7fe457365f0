"""The ``svg`` attention kernel as MaxDiffusion calls it: ``(q, k, v, context) -> [B, S, H*D]``.

Video self-attention of a prepared Wan or LTX-2 transformer runs ``sharded_svg_attention`` on the
call's mesh, with the step, layer and expert the hooks supply. Cross-attention, masked
calls and short sequences run MaxDiffusion's dense path, as users expect. Anything else
(a model the hooks do not cover, a sequence that is not the video grid) raises.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec as P

from maxdiffusion_svg.budgets.per_layer import Rung
from maxdiffusion_svg.budgets.schedule import Interval
from maxdiffusion_svg.call.attention import profile_key
from maxdiffusion_svg.call.prepared import prepare
from maxdiffusion_svg.kernels.gradient import residuals_named
from maxdiffusion_svg.measure.calibration import layer_error, sharded_rung_errors
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plugin import hooks, run_summary, semantic_store
from maxdiffusion_svg.plugin.settings import KERNEL_NAME, SUPPORTED_MODELS


_CALL_LOG: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar(
    "svg_call_log", default=None)
_CAPTURE: contextvars.ContextVar[bool] = contextvars.ContextVar("svg_capture", default=False)
# ``calibrate``'s rungs and log, while it runs: each sparse call measures every rung.
_RUNGS: contextvars.ContextVar[tuple[tuple[Rung, ...], list[dict[str, Any]]] | None] = (
    contextvars.ContextVar("svg_rungs", default=None))


@contextlib.contextmanager
def record_rung_errors(rungs: tuple[Rung, ...]) -> Iterator[list[dict[str, Any]]]:
  """While the block traces, each video self-attention call also measures its error at every
  rung of ``rungs`` (density, compensation) on device
  (:func:`maxdiffusion_svg.measure.calibration.sampled_rung_errors`) and logs ``{"step", "layer",
  "expert", "active", "errors", "temporal", "head_errors", "power"}``
  (``active``: the schedule makes the call sparse; ``errors``: per rung, the layer's error, its
  heads' weighted by their output ``power`` [H];
  ``temporal``: per rung, the share of heads whose better layout is temporal; ``head_errors
  [K, H]``: each head's, what per-head budgets allocate). Call ``jax.effects_barrier()`` before
  reading the list."""
  log: list[dict[str, Any]] = []
  token = _RUNGS.set((tuple(rungs), log))
  try:
    yield log
  finally:
    _RUNGS.reset(token)


def _record_rungs(q: jax.Array, k: jax.Array, v: jax.Array, call: Any, settings: Any,
                  context: dict[str, Any], step: Any, layer: Any) -> None:
  recording = _RUNGS.get()
  if recording is None:
    return
  rungs, log = recording
  svg = settings.svg
  # Each device measures its own heads after the exchange, as the kernel runs them.
  errors, temporal, power = sharded_rung_errors(
      q, k, v, mesh=context["mesh"], qkv_spec=qkv_layout(context["axis_names_q"]),
      ulysses_shards=context["ulysses_shards"], per_head=True, grid=call.grid, config=svg,
      rungs=rungs, key=profile_key(svg, step, layer), scale=context["scale"],
      expert=call.expert, target=svg.target(mesh=context["mesh"]))

  def append(step, layer, active, errors, temporal, power):
    errors, temporal = np.asarray(errors, np.float64), np.asarray(temporal, np.float64)
    power = np.asarray(power, np.float64)
    log.append({"step": int(step), "layer": int(layer), "expert": call.expert,
                "active": bool(active), "errors": layer_error(errors.T, power),
                "temporal": temporal.mean(axis=1),
                "head_errors": errors, "power": power})

  jax.debug.callback(append, jnp.asarray(step), jnp.asarray(layer),
                     jnp.asarray(svg.schedule.is_active(step, layer)), errors, temporal, power)


@contextlib.contextmanager
def record_calls(arrays: bool = False) -> Iterator[list[dict[str, Any]]]:
  """Logs every ``svg`` kernel execution of the functions traced inside the block.

  A test and benchmark aid: each execution appends ``{"kind", "sparse", "step", "layer",
  "expert", "density", "compensation", "warm"}`` (``kind``: ``self``, or
  ``cross``/``masked``/``short``/``vace`` for dense calls (``cross``: any op not tagged as
  video self-attention, e.g. LTX-2's audio self-attention; ``vace``: Wan VACE's control blocks); ``density`` and ``compensation``: the sparse
  branch's, the layer's own under per-layer keys (the mean of its heads' under
  ``svg_head_densities``); ``warm``: the semantic clustering started from
  the previous step's centroids)
  through ``jax.debug.callback``, so steps and layers are the traced values of that run.
  ``arrays``: self-attention entries also get ``"qkv_out"``, the call's global ``[B, H, S, D]``
  q, k, v and output as NumPy arrays, so a test can recompute the call independently.
  Call ``jax.effects_barrier()`` before reading the list.
  """
  log: list[dict[str, Any]] = []
  token, capture = _CALL_LOG.set(log), _CAPTURE.set(arrays)
  try:
    yield log
  finally:
    _CALL_LOG.reset(token)
    _CAPTURE.reset(capture)


def _record(kind: str, expert: str | None, sparse: Any = False, step: Any = -1,
            layer: Any = -1, density: Any = None,
            arrays: tuple[jax.Array, ...] = (), warm: Any = False,
            compensation: Any = False) -> None:
  log = _CALL_LOG.get()
  if log is None:
    return

  def append(sparse, step, layer, warm, density, compensation, *values):
    entry = {"kind": kind, "sparse": bool(sparse), "step": int(step), "layer": int(layer),
             "expert": expert, "density": None if density < 0 else round(float(density), 6),
             "compensation": bool(compensation), "warm": bool(warm)}
    if values:
      entry["qkv_out"] = tuple(np.asarray(x) for x in values)
    log.append(entry)

  jax.debug.callback(append, jnp.asarray(sparse), jnp.asarray(step), jnp.asarray(layer),
                     jnp.asarray(warm), jnp.asarray(-1.0 if density is None else density,
                                                    jnp.float32), jnp.asarray(compensation),
                     *(arrays if _CAPTURE.get() else ()))


def _is_everything(interval: Interval) -> bool:
  return interval.start == 0 and interval.end is None


def qkv_layout(axis_names_q: tuple[Any, ...], seq_axis: str = "context") -> P:
  """The layout of self-attention's ``[B, H, S, D]`` q/k/v, resolved as MaxDiffusion's
  ``ulysses`` resolves it: by the active logical axis rules (the config's), with the heads on
  no mesh axis and the sequence on ``context`` in front of them (the rules ``pyconfig`` adds
  for ``attention=ulysses``). So a custom batch rule is matched, not resharded."""
  _, heads, seq, _ = axis_names_q
  ulysses = ((heads, None), (seq, seq_axis))
  with nn_partitioning.axis_rules((*ulysses, *nn_partitioning.get_axis_rules())):
    return P(*nn.logical_to_mesh_axes(axis_names_q))


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, context: dict[str, Any],
                    kernel: str) -> jax.Array:
  """MaxDiffusion's own dispatcher with another kernel name, so its mask handling (a boolean
  keep-mask becomes a bias for ``dot_product``) and short-sequence fallback apply."""
  from maxdiffusion.models import attention_flax  # pylint: disable=import-outside-toplevel
  op = hooks.current_attention_op()
  return attention_flax._apply_attention(  # pylint: disable=protected-access
      query=q, key=k, value=v, heads=context["heads"], dim_head=context["dim_head"],
      split_head_dim=context["split_head_dim"], float32_qk_product=context["float32_qk_product"],
      attention_kernel=kernel, flash_min_seq_length=getattr(op, "flash_min_seq_length", 0),
      use_memory_efficient_attention=context["use_memory_efficient_attention"],
      scale=context["scale"], dtype=context["dtype"], mesh=context["mesh"],
      axis_names_q=context["axis_names_q"], axis_names_kv=context["axis_names_kv"],
      flash_block_sizes=context["flash_block_sizes"], dpa_layer=context["dpa_layer"],
      mask_padding_tokens=context["mask_padding_tokens"],
      residual_checkpoint_name=context["residual_checkpoint_name"],
      attention_mask=context["attention_mask"], use_base2_exp=context["use_base2_exp"],
      use_experimental_scheduler=context["use_experimental_scheduler"],
      ulysses_shards=context["ulysses_shards"],
      ulysses_attention_chunks=context["ulysses_attention_chunks"],
      is_causal=context["is_causal"])


def svg_kernel(q: jax.Array, k: jax.Array, v: jax.Array, context: dict[str, Any]) -> jax.Array:
  """The registered ``svg`` kernel."""
  from maxdiffusion.models import attention_flax  # pylint: disable=import-outside-toplevel
  call = hooks.current_model_call()
  if call is None:
    raise ValueError(f"attention={KERNEL_NAME!r} was called outside a Wan or LTX-2 transformer; it "
                     f"supports {SUPPORTED_MODELS}. Use another attention kernel for this model.")
  if call.settings is None:
    raise ValueError(f"attention={KERNEL_NAME!r}: this {call.model} was not prepared for SVG "
                     f"(no svg settings); it supports {SUPPORTED_MODELS}.")
  settings = call.settings
  seq_len = q.shape[2] if q.ndim == 4 else q.shape[1]
  # Video self-attention: a tagged op (every model's blocks' attn1), or Wan's by its name.
  op = hooks.current_attention_op()
  layer = hooks.layer_index(op)
  if getattr(op, "svg_dense_by_design", None):  # e.g. Wan VACE's control blocks
    dense_reason = op.svg_dense_by_design
  elif layer is None and (q.ndim != 4 or context["residual_checkpoint_name"] != "self_attn"):
    dense_reason = "cross"
  elif context["attention_mask"] is not None:
    dense_reason = "masked"
  elif settings.is_short(seq_len):
    dense_reason = "short"
  else:
    dense_reason = None
  if call.count_calls:  # the other calls run as often as the self-attention traced beside them
    call.traced.add(dense_reason)
  if dense_reason is not None:
    _record(dense_reason, call.expert)
    return dense_attention(q, k, v, context,
                           settings.resolved_dense_kernel(settings.svg.target(mesh=context["mesh"]).platform))
  if q.ndim == 3:  # LTX-2's [B, S, H*D]
    q, k, v = (attention_flax._unflatten_heads(x, context["heads"])  # pylint: disable=protected-access
               for x in (q, k, v))
  # LTX-2 normalises q and k in float32 and projects v in the activations' dtype: the
  # attention runs in v's (bfloat16 on TPU), as its MXU would take them.
  q, k = q.astype(v.dtype), k.astype(v.dtype)
  if seq_len != call.grid.tokens:
    raise ValueError(f"attention={KERNEL_NAME!r}: self-attention of {seq_len} tokens in "
                     f"{call.model}, but its video grid {call.grid} has {call.grid.tokens}; "
                     f"it supports {SUPPORTED_MODELS} whose sequence is the patchified video")
  schedule = settings.svg.schedule
  step = call.step
  if step is None:
    if not _is_everything(schedule.active_steps):
      raise ValueError(f"attention={KERNEL_NAME!r}: svg_active_steps is "
                       f"{schedule.active_steps} but the denoising step is unknown: run the "
                       f"model through a Wan or LTX-2 pipeline, or call "
                       f"maxdiffusion_svg.plugin.set_denoising_schedule(model, timesteps); "
                       f"a training step has none: set svg_active_steps: [0, -1] to train")
    step = 0
  if layer is None:
    raise ValueError(f"attention={KERNEL_NAME!r}: a self-attention op of {call.model} has no "
                     f"layer index (prepare_transformer tags blocks[*].attn1 only)")
  # the previous step's centroids of this layer, where the model keeps them
  seed = (None if call.semantic_store is None
          else semantic_store.seed(call.semantic_store, layer, q.shape[0]))
  # Under a gradient, the kernel's residuals carry MaxDiffusion's name for this attention
  # (self_attn), which its remat policies save or offload.
  # Every decision before the data (target, executor, tiles, plans) once, for the call's mesh.
  prepared = prepare(settings.svg, call.grid, call.expert, mesh=context["mesh"])
  _record_rungs(q, k, v, call, settings, context, step, layer)
  with residuals_named(context["residual_checkpoint_name"]):
    out = sharded_svg_attention(q, k, v, mesh=context["mesh"], grid=call.grid,
                                config=settings.svg, scale=context["scale"], step=step,
                                layer=layer, expert=call.expert, prepared=prepared,
                                qkv_spec=qkv_layout(context["axis_names_q"]),
                                ulysses_shards=context["ulysses_shards"],
                                on_routing=run_summary.on_routing if call.count_calls else None,
                                seed=seed)
  if seed is not None:
    out, clusters = out
    semantic_store.write(call.semantic_store, layer, clusters, schedule.is_active(step, layer))
  budget = settings.svg.budget(call.expert)
  recorded = budget.recorded()
  if recorded is None:
    density, compensation = budget.density, budget.compensation
  elif budget.head_densities is not None:  # per-head budgets: the mean of the layer's heads
    means = recorded[0]
    density = jnp.asarray(means, jnp.float32)[layer if len(means) > 1 else 0]
    compensation = False
  else:  # the layer's own rung
    density = jnp.asarray(recorded[0], jnp.float32)[layer]
    compensation = jnp.asarray(recorded[1])[layer]
  _record("self", call.expert, schedule.is_active(step, layer), step, layer, density,
          arrays=(q, k, v, out), warm=False if seed is None else seed.ready,
          compensation=compensation)
  return attention_flax._reshape_heads_to_head_dim(out)  # pylint: disable=protected-access
