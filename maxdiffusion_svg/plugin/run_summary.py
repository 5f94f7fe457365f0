"""The end-of-run line: what the ``svg`` kernel did in a pipeline call, from the log alone.

Each self-attention call reports, from every device inside the head exchange, its step, layer,
whether the schedule made it sparse, its heads and how many of them the router sent to each head
layout (one host callback per call and device; no collective). The model's other attention calls
(cross-attention, LTX-2's audio self-attention, Wan VACE's control blocks) run dense and are
counted where they are traced (:class:`Traced`): each runs once for every run of the forward that
traced it, as the self-attention calls beside it, whose runs the callbacks count. A callback of
their own cost as much as the self-attention call's on a TPU (docs/benchmarks.md, "A denoising
step timed on a TPU v5e"). The pipeline hook resets the tally before a call and logs the summary
after it: sparse and dense calls, each reported layout's head share per layer range (temporal
always; others, e.g. semantic, where they are among the layouts), the kernel and tiles, the other
calls run dense, and seconds per step.

``svg_run_summary: false``, MaxDiffusion's AOT cache (``aot_cache_dir``, which cannot
serialise host callbacks), or a ``JAX_PLATFORMS`` without ``cpu`` (JAX runs a callback's operands
on a CPU device) leaves the callbacks out; the calls are then counted from the schedule and
temporal heads are not counted.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.kernels.api import resolve_backend
from maxdiffusion_svg.plan.target import TPU_BACKENDS
from maxdiffusion_svg.plugin.settings import PluginSettings
from maxdiffusion_svg.plugin.video_models import WAN
from maxdiffusion_svg.routing.layouts import SEMANTIC, TEMPORAL, get, index, names

# Layer ranges the temporal share is reported over.
RANGES = 4


def host_callbacks_missing(platforms: str | None = None) -> str:
  """Why this process cannot run host callbacks ("" where it can): JAX hands a callback its
  operands on a CPU device, and ``platforms`` (default: ``jax_platforms``, from
  ``JAX_PLATFORMS``) naming others but not ``cpu``, e.g. ``tpu``, leaves it none."""
  platforms = jax.config.jax_platforms if platforms is None else platforms
  names = [p.strip() for p in (platforms or "").split(",") if p.strip()]
  if not names or "cpu" in names:
    return ""
  return (f"JAX_PLATFORMS={platforms} leaves JAX no CPU device for host callbacks "
          f"(JAX_PLATFORMS={platforms},cpu counts them)")


@dataclasses.dataclass
class _Tally:
  """What the callbacks of one pipeline call reported (host side; callbacks run on threads)."""

  calls: dict[tuple[int, int], bool] = dataclasses.field(default_factory=dict)
  # per layout name, per layer: its heads in sparse calls
  routed: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)
  heads: dict[int, int] = dataclasses.field(default_factory=dict)
  schedules: int = 0  # timesteps the pipeline set: Wan Animate sets them once per segment
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  def add(self, active, step, layer, temporal, heads, semantic=0) -> None:
    """One call's report with temporal and semantic counts (the built-in layouts')."""
    self.add_counts(active, step, layer, heads, {TEMPORAL: temporal, SEMANTIC: semantic})

  def add_counts(self, active, step, layer, heads, counts: dict[str, Any]) -> None:
    """One call's report: its heads and how many went to each layout (by name)."""
    step, layer, active = int(step), int(layer), bool(active)
    with self.lock:
      self.calls[(step, layer)] = active
      if active:
        for name, count in counts.items():
          tally = self.routed.setdefault(name, {})
          tally[layer] = tally.get(layer, 0) + int(count)
        self.heads[layer] = self.heads.get(layer, 0) + int(heads)


_TALLY = _Tally()


@dataclasses.dataclass(eq=False)
class Traced:
  """A prepared model's attention calls as its forward was traced (host side, at trace time):
  the self-attention calls the run summary counts and the other calls by the kind they run dense
  as. A static attribute of the model (compared by identity), kept across runs: a compiled forward
  is not traced again."""

  self_calls: int = 0
  dense: dict[str, int] = dataclasses.field(default_factory=dict)

  def add(self, dense_reason: str | None) -> None:
    """A call traced: video self-attention (``dense_reason`` None, or ``short``: a short video's,
    run dense), else another call by the kind it runs dense as."""
    if dense_reason in (None, "short"):
      self.self_calls += 1
    else:
      self.dense[dense_reason] = self.dense.get(dense_reason, 0) + 1


def other_dense(traced: Sequence[Traced], executed: int) -> tuple[tuple[str, int], ...]:
  """The other calls run dense, by kind, in a run whose counted self-attention calls ran
  ``executed`` times: each traced beside ``self_calls`` of them runs as often as they do."""
  selves = sum(t.self_calls for t in traced)
  kinds: dict[str, int] = {}
  for t in traced:
    for kind, n in t.dense.items():
      kinds[kind] = kinds.get(kind, 0) + n
  if not selves:
    return ()
  return tuple(sorted((kind, round(n * executed / selves)) for kind, n in kinds.items()))


def reset() -> None:
  global _TALLY  # pylint: disable=global-statement
  _TALLY = _Tally()


def on_routing(layout: jax.Array, active: Any, step: Any, layer: Any) -> None:
  """``sharded_svg_attention``'s ``on_routing``: one host callback with this device's counts
  (``layout``: its heads' layout ids)."""
  counted = names()[1:]  # the first layout's heads are the rest
  counts = [jnp.sum((layout == index(name)).astype(jnp.int32)) for name in counted]
  # One int32 vector: each operand of a callback is a transfer of its own, and the chip waits on
  # each (docs/benchmarks.md, "A denoising step timed on a TPU v5e").
  packed = jnp.stack([jnp.asarray(x, jnp.int32) for x in
                      (active, step, layer, layout.size, *counts)])

  def add(values: Any) -> None:
    active, step, layer, heads, *counts = (int(x) for x in np.asarray(values))
    _TALLY.add_counts(bool(active), step, layer, heads, dict(zip(counted, counts)))

  # The compiled call keeps this callback: it adds to whichever tally is current when it runs.
  jax.debug.callback(add, packed)


def on_schedule() -> None:
  """The pipeline set its timesteps (host side): each time starts a run of the schedule, e.g.
  one per Wan Animate segment, whose calls repeat the same (step, layer) keys."""
  with _TALLY.lock:
    _TALLY.schedules += 1


def segments() -> int:
  """How many runs of the schedule the call just finished made (at least 1)."""
  return max(1, _TALLY.schedules)


class LayoutShare(NamedTuple):
  """A head layout's share of the sparse calls' heads, overall (None: no sparse call) and per
  layer range (first layer, last layer, share)."""

  name: str
  share: float | None
  by_range: tuple[tuple[int, int, float], ...]


@dataclasses.dataclass(frozen=True)
class CallCounts:
  """Self-attention calls of one pipeline call."""

  sparse: int
  dense: int
  counted: bool  # False: from the schedule (no callbacks ran)
  shares: tuple[LayoutShare, ...] = ()  # each reported layout's, in id order
  other_dense: tuple[tuple[str, int], ...] = ()  # counted calls outside video self-attention

  def share_of(self, name: str) -> LayoutShare | None:
    return next((share for share in self.shares if share.name == name), None)

  @property
  def temporal_share(self) -> float | None:
    found = self.share_of(TEMPORAL)
    return None if found is None else found.share

  @property
  def by_range(self) -> tuple[tuple[int, int, float], ...]:
    found = self.share_of(TEMPORAL)
    return () if found is None else found.by_range

  def repeated(self, runs: int) -> CallCounts:
    """The calls of ``runs`` runs of the schedule in one pipeline call (Wan Animate's
    segments), each making these."""
    return dataclasses.replace(self, sparse=self.sparse * runs, dense=self.dense * runs,
                               other_dense=tuple((k, n * runs) for k, n in self.other_dense))


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


def reported(layouts: tuple[str, ...] = ()) -> tuple[str, ...]:
  """The layouts whose share the summary gives: after the first (its heads are the rest), those
  whose record says ``reported`` (temporal) and those among the run's ``layouts``."""
  return tuple(name for name in names()[1:] if get(name).reported or name in layouts)


def counted_calls(layers: int, layouts: tuple[str, ...] = (),
                  traced: Sequence[Traced] = ()) -> CallCounts:
  """The tally of the pipeline call just finished (after ``jax.effects_barrier``);
  ``layouts``: the run's (their shares are reported, :func:`reported`); ``traced``: the models'
  traced calls, for the other calls run dense (:func:`other_dense`)."""
  tally = _TALLY
  with tally.lock:
    calls, heads = dict(tally.calls), dict(tally.heads)
    routed = {name: dict(counts) for name, counts in tally.routed.items()}
  sparse = sum(calls.values())
  shares = tuple(LayoutShare(name, *_shares(routed.get(name, {}), heads, layers))
                 for name in reported(layouts))
  return CallCounts(sparse, len(calls) - sparse, True, shares, other_dense(traced, len(calls)))


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
  if counts.shares and counts.shares[0].share is not None:
    for i, (name, share, by_range) in enumerate(counts.shares):
      spans = ", ".join(f"layers {a}-{b} {s:.0%}" for a, b, s in by_range)
      whose = " of the sparse calls' heads" if i == 0 else ""
      parts.append(f"{name} heads {share:.1%}{whose} ({spans})")
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
  return model.svg_settings.svg.budget(model.svg_expert).describe()


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
    counts = counted_calls(layers, settings.svg.layouts, [m.svg_traced for m in models])
    if counts.sparse + counts.dense == 0:
      return (f"run summary: {steps} steps: no self-attention call reached the svg kernel "
              f"(the model's self-attention runs another kernel)")
  else:
    counts = scheduled_calls(settings, steps, layers, tokens)
  return summary_line(counts, steps, layers, _kernel(models, mesh), denoise, why,
                      family.dense_by_design, segments())
