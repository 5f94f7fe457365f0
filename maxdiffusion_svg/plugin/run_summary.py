"""The end-of-run line: what the ``svg`` kernel did in a pipeline call, from the log alone.

Each self-attention call reports, from every device inside the head exchange, its step, layer,
whether the schedule made it sparse and how many of the device's heads the router sent
temporal and semantic (one host callback per call and device, five integers; no collective).
The pipeline hook resets the tally before a call and logs the summary after it: sparse and
dense calls, the temporal-head (and, with semantic among the layouts, semantic-head) share per
layer range, the kernel and tiles, and seconds per step.

``svg_run_summary: false``, or MaxDiffusion's AOT cache (``aot_cache_dir``, which cannot
serialise host callbacks), leaves the callbacks out; the calls are then counted from the
schedule and temporal heads are not counted.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Any

import jax
import jax.numpy as jnp

from maxdiffusion_svg.budgets.per_layer import layer_ranges
from maxdiffusion_svg.kernels.api import resolve_backend
from maxdiffusion_svg.plan.target import TPU_BACKENDS
from maxdiffusion_svg.plugin.settings import PluginSettings
from maxdiffusion_svg.plugin.video_models import WAN
from maxdiffusion_svg.routing.layouts import LAYOUTS, SEMANTIC, TEMPORAL

# Layer ranges the temporal share is reported over.
RANGES = 4


@dataclasses.dataclass
class _Tally:
  """What the callbacks of one pipeline call reported (host side; callbacks run on threads)."""

  calls: dict[tuple[int, int], bool] = dataclasses.field(default_factory=dict)
  temporal: dict[int, int] = dataclasses.field(default_factory=dict)  # per layer, sparse calls
  semantic: dict[int, int] = dataclasses.field(default_factory=dict)
  heads: dict[int, int] = dataclasses.field(default_factory=dict)
  dense: dict[str, int] = dataclasses.field(default_factory=dict)  # other calls, by kind
  schedules: int = 0  # timesteps the pipeline set: Wan Animate sets them once per segment
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  def add_dense(self, kind: str) -> None:
    with self.lock:
      self.dense[kind] = self.dense.get(kind, 0) + 1

  def add(self, active, step, layer, temporal, heads, semantic=0) -> None:
    step, layer, active = int(step), int(layer), bool(active)
    with self.lock:
      self.calls[(step, layer)] = active
      if active:
        for tally, count in ((self.temporal, temporal), (self.semantic, semantic)):
          tally[layer] = tally.get(layer, 0) + int(count)
        self.heads[layer] = self.heads.get(layer, 0) + int(heads)


_TALLY = _Tally()


def reset() -> None:
  global _TALLY  # pylint: disable=global-statement
  _TALLY = _Tally()


def on_routing(layout: jax.Array, active: Any, step: Any, layer: Any) -> None:
  """``sharded_svg_attention``'s ``on_routing``: one host callback with this device's counts
  (``layout``: its heads' layout ids)."""
  count = lambda name: jnp.sum((layout == LAYOUTS.index(name)).astype(jnp.int32))
  # The compiled call keeps this callback: it adds to whichever tally is current when it runs.
  jax.debug.callback(lambda *xs: _TALLY.add(*xs),
                     jnp.asarray(active), jnp.asarray(step), jnp.asarray(layer),
                     count(TEMPORAL), jnp.int32(layout.size), count(SEMANTIC))


def on_schedule() -> None:
  """The pipeline set its timesteps (host side): each time starts a run of the schedule, e.g.
  one per Wan Animate segment, whose calls repeat the same (step, layer) keys."""
  with _TALLY.lock:
    _TALLY.schedules += 1


def segments() -> int:
  """How many runs of the schedule the call just finished made (at least 1)."""
  return max(1, _TALLY.schedules)


def on_dense(kind: str) -> None:
  """A call the kernel ran dense outside video self-attention (``cross``: cross-attention and
  any other untagged op, e.g. LTX-2's audio self-attention; ``masked``): one host callback
  per execution (outside the head exchange: once per call)."""
  jax.debug.callback(lambda: _TALLY.add_dense(kind))


@dataclasses.dataclass(frozen=True)
class CallCounts:
  """Self-attention calls of one pipeline call."""

  sparse: int
  dense: int
  counted: bool  # False: from the schedule (no callbacks ran)
  temporal_share: float | None = None  # of the sparse calls' heads
  by_range: tuple[tuple[int, int, float], ...] = ()  # (first layer, last layer, share)
  semantic_share: float | None = None  # None: semantic is not among the layouts
  semantic_by_range: tuple[tuple[int, int, float], ...] = ()
  other_dense: tuple[tuple[str, int], ...] = ()  # counted calls outside video self-attention

  def repeated(self, runs: int) -> CallCounts:
    """The calls of ``runs`` runs of the schedule in one pipeline call (Wan Animate's
    segments), each making these."""
    return dataclasses.replace(self, sparse=self.sparse * runs, dense=self.dense * runs)


def _shares(counts: dict[int, int], heads: dict[int, int],
            layers: int) -> tuple[float | None, tuple[tuple[int, int, float], ...]]:
  """A count's share of the sparse calls' heads, overall and per layer range."""
  total = sum(heads.values())
  ranges = []
  size = -(-layers // RANGES)
  for first in range(0, layers, size):
    last = min(layers, first + size) - 1
    h = sum(heads.get(i, 0) for i in range(first, last + 1))
    if h:
      ranges.append((first, last, sum(counts.get(i, 0) for i in range(first, last + 1)) / h))
  return (sum(counts.values()) / total if total else None), tuple(ranges)


def counted_calls(layers: int, semantic: bool = False) -> CallCounts:
  """The tally of the pipeline call just finished (after ``jax.effects_barrier``);
  ``semantic``: semantic is among the layouts (its share is reported)."""
  tally = _TALLY
  with tally.lock:
    calls, heads = dict(tally.calls), dict(tally.heads)
    temporal, semantic_heads = dict(tally.temporal), dict(tally.semantic)
    other = tuple(sorted(tally.dense.items()))
  sparse = sum(calls.values())
  share, ranges = _shares(temporal, heads, layers)
  sem_share, sem_ranges = _shares(semantic_heads, heads, layers) if semantic else (None, ())
  return CallCounts(sparse, len(calls) - sparse, True, share, ranges, sem_share, sem_ranges,
                    other)


def scheduled_calls(settings: PluginSettings, steps: int, layers: int,
                    tokens: int | None) -> CallCounts:
  """The calls as the schedule makes them, for a run without callbacks (``tokens`` None: a
  video not known to be short)."""
  if tokens is not None and settings.is_short(tokens):
    return CallCounts(0, steps * layers, False)
  schedule = settings.svg.schedule
  sparse = schedule.active_steps.count(steps) * schedule.active_layers.count(layers)
  return CallCounts(sparse, steps * layers - sparse, False)


def summary_line(counts: CallCounts, steps: int, layers: int, kernel: str,
                 denoise_s: float | None, why_uncounted: str = "",
                 dense_by_design: str = "cross-attention", runs: int = 1) -> str:
  """One line for the log; ``runs``: runs of the schedule (Wan Animate's segments), whose
  self-attention calls ``counts`` holds once."""
  counts = counts.repeated(runs)
  calls = counts.sparse + counts.dense
  how = "counted" if counts.counted else f"from the schedule, not counted ({why_uncounted})"
  segments = f" x {runs} segments" if runs > 1 else ""
  parts = [f"run summary: {steps} steps x {layers} layers{segments}: {calls:,} self-attention calls, "
           f"{counts.sparse:,} sparse and {counts.dense:,} dense ({how})"]
  if counts.temporal_share is not None:
    spans = ", ".join(f"layers {a}-{b} {s:.0%}" for a, b, s in counts.by_range)
    parts.append(f"temporal heads {counts.temporal_share:.1%} of the sparse calls' heads "
                 f"({spans})")
    if counts.semantic_share is not None:
      spans = ", ".join(f"layers {a}-{b} {s:.0%}" for a, b, s in counts.semantic_by_range)
      parts.append(f"semantic heads {counts.semantic_share:.1%} ({spans})")
  elif counts.counted and counts.sparse == 0:
    parts.append("no sparse call: SVG did not run in this call")
  parts.append(kernel)
  if denoise_s is not None and steps:
    parts.append(f"{denoise_s / steps:.3f} s per step (denoising {denoise_s:.1f} s)")
  if counts.other_dense:
    kinds = ", ".join(f"{n:,} {kind}" for kind, n in counts.other_dense)
    parts.append(f"other attention calls dense: {kinds} ({dense_by_design} runs "
                 f"svg_dense_kernel)")
  return "; ".join(parts)


def _steps(kwargs: dict[str, Any], call: Any) -> int:
  if "num_inference_steps" in kwargs:
    return int(kwargs["num_inference_steps"])
  return int(inspect.signature(call).parameters["num_inference_steps"].default)


def _density(model: Any) -> str:
  """The density a model's sparse calls ran: one, or per layer range (``svg_layer_densities``)."""
  svg = model.svg_settings.svg
  per_head = svg.head_densities_for(model.svg_expert)
  if per_head is not None:  # each layer's heads, as least-most (mean), per layer range
    spans = [f"{min(row):g}-{max(row):g} (mean {sum(row) / len(row):.3g})" for row in per_head]
    which = "every layer" if len(per_head) == 1 else layer_ranges(spans)
    return (f"densities per head (svg_head_densities), {spans[0]} in every layer"
            if len(per_head) == 1 else f"densities per head (svg_head_densities) {which}")
  per_layer = svg.layer_densities_for(model.svg_expert)
  if per_layer is None:
    return f"density {svg.density_for(model.svg_expert)}"
  return f"densities per layer {layer_ranges(per_layer)}"


def _kernel(models: list[Any], mesh: Any) -> str:
  """The kernel, executor and tiles of the prepared models, each one's density, and the
  compensation (the experts share it: one ``svg_compensation`` per run)."""
  settings = models[0].svg_settings
  target = settings.svg.target(mesh=mesh)
  backend = resolve_backend(settings.svg.backend, target)
  tiles = settings.svg.tiles(target, backend)
  densities = ", ".join(f"{m.svg_expert + ' ' if m.svg_expert else ''}{_density(m)}"
                        for m in models)
  step = f" (kv step {tiles.block_kv_compute})" if backend in TPU_BACKENDS else ""
  return (f"kernel svg on {backend}, {settings.svg.tile_mode.value} tiles "
          f"{tiles.block_q}x{tiles.block_kv}{step}, {densities}, "
          f"{settings.compensation_text(target, backend)}")


def _reference_frames(kwargs: dict[str, Any]) -> int:
  """Latent frames a VACE call's ``reference_images`` add in front of the video (one image, a
  list, or a batch's list of lists as the pipeline takes them)."""
  references = kwargs.get("reference_images")
  if references is None:
    return 0
  if not isinstance(references, (list, tuple)):
    return 1
  if references and isinstance(references[0], (list, tuple)):
    return len(references[0])
  return len(references)


def after_call(models: list[Any], mesh: Any, outputs: Any, kwargs: dict[str, Any], call: Any,
               counted: bool) -> str | None:
  """The summary of a Wan or LTX-2 pipeline call just finished through its svg-prepared ``models``
  (None if there are none); ``counted``: their calls reported to the tally."""
  if not models:
    return None
  steps, layers = _steps(kwargs, call), models[0].num_layers
  trace = outputs[1] if isinstance(outputs, tuple) and isinstance(outputs[1], dict) else {}
  denoise = trace.get("denoise_total")
  settings = models[0].svg_settings
  frames, height, width = (kwargs.get(k) for k in ("num_frames", "height", "width"))
  family = getattr(models[0], "svg_video_model", WAN)  # how its pixels map to tokens
  tokens = family.grid(frames, height, width, _reference_frames(kwargs)).tokens if all(
      isinstance(x, int) for x in (frames, height, width)) else None
  why = models[0].svg_uncounted
  if tokens is not None and settings.is_short(tokens):
    counts = scheduled_calls(settings, steps, layers, tokens)
    why = f"{tokens:,} tokens is below svg_min_seq_length {settings.min_seq_length}: all dense"
  elif counted:
    jax.effects_barrier()  # every callback of the call has run
    counts = counted_calls(layers, settings.svg.semantic is not None)
    if counts.sparse + counts.dense == 0:
      return (f"run summary: {steps} steps: no self-attention call reached the svg kernel "
              f"(the model's self-attention runs another kernel)")
  else:
    counts = scheduled_calls(settings, steps, layers, tokens)
  return summary_line(counts, steps, layers, _kernel(models, mesh), denoise, why,
                      family.dense_by_design, segments())
