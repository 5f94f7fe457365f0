"""How ``compare`` and ``calibrate`` drive each model's own MaxDiffusion generate main.

A tool loads the weights once, through the main as the user runs it, and then runs it again
on the loaded pipeline: ``generate_wan.run``, ``generate_ltx2.run`` and our Wan VACE main's
take the pipeline (each family other than Wan is driven from its own module: :mod:`ltx2`,
:mod:`wan_vace`, :mod:`wan_animate`); ``generate_wan_animate.run`` always loads, so its
checkpointer hands back the loaded one. While
a :meth:`Generation.watch` block is open, every pipeline call of the main is seen
(``before_call`` sets the run's kernel on the pipeline before the call traces), the denoising
steps it takes are counted, and the frames it exports are kept (the MP4s go to the working
directory). Each main makes a compile warm-up call, then the real one: the real call's
denoising seconds and steps make the tool's seconds per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from maxdiffusion_svg.measure import video_metrics
from maxdiffusion_svg.plugin.video_models import EVERY_FAMILY, WAN, VideoModel

BeforeCall = Callable[[Any], None]
OnStep = Callable[[], None]


@dataclasses.dataclass(frozen=True)
class Generation:
  """One family's generate main, as the tools drive it."""

  family: VideoModel
  time: str  # what a run's seconds per step measure
  watching: Callable[[BeforeCall, OnStep], contextlib.AbstractContextManager[dict[str, Any]]]
  run_takes_pipeline: bool = True  # False: the main's run always loads (its watch hands it back)

  def watch(self, before_call: BeforeCall,
            on_step: OnStep) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """See the module's docstring. The plugin's hooks are installed first: the watch wraps
    them, and puts back what it found."""
    from maxdiffusion_svg import plugin  # pylint: disable=import-outside-toplevel
    plugin.register()
    return self.watching(before_call, on_step)

  @property
  def module(self) -> Any:
    """The family's generate module (MaxDiffusion's, or ours for Wan VACE)."""
    return importlib.import_module(self.family.generate_module)

  def first(self, argv: Sequence[str]) -> None:
    """The main as the user runs it: ``pyconfig`` from ``argv``, the weights loaded."""
    self.module.main(list(argv))

  def again(self, config: Any, seen: dict[str, Any]) -> None:
    """The main's ``run`` on the pipeline the first run loaded."""
    if self.run_takes_pipeline:
      self.module.run(config, pipeline=seen["pipeline"])
    else:
      self.module.run(config)


def seen_record() -> dict[str, Any]:
  """What a watch keeps: the pipeline, the frames exported, and per pipeline call its
  denoising seconds and steps (``calls``)."""
  return {"frames": [], "calls": []}


def real_call(seen: dict[str, Any]) -> dict[str, Any]:
  """The last finished pipeline call (each main's real call follows its warm-up)."""
  return seen["calls"][-1] if seen["calls"] else {"denoise_s": float("nan"), "steps": 0}


def step_seconds(seen: dict[str, Any], steps: int) -> float:
  """Seconds per denoising step of the last real call; ``steps`` where the call stepped in
  a compiled loop (no Python step to count)."""
  call = real_call(seen)
  return call["denoise_s"] / (call["steps"] or steps)


@contextlib.contextmanager
def patched(*patches: tuple[Any, str, Any]) -> Iterator[None]:
  """Sets ``owner.name = value`` for each patch, restoring every one after."""
  saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
  for owner, name, value in patches:
    setattr(owner, name, value)
  try:
    yield
  finally:
    for owner, name, value in reversed(saved):
      setattr(owner, name, value)


def watched_call(seen: dict[str, Any], pipeline: Any, before_call: BeforeCall,
                  call: Callable[[], Any], denoise_seconds: Callable[[Any, float], float]) -> Any:
  """One pipeline call of the main: ``before_call`` first, then the call, recorded with its
  denoising seconds (``denoise_seconds(output, wall seconds)``) and the Python steps it took."""
  seen["pipeline"], seen["steps"] = pipeline, 0
  before_call(pipeline)
  start = time.perf_counter()
  out = call()
  seen["calls"].append({"denoise_s": denoise_seconds(out, time.perf_counter() - start),
                        "steps": seen["steps"]})
  return out


def exporting(export: Callable[..., Any], seen: dict[str, Any],
               into_working_directory: bool = False) -> Callable[..., Any]:
  """An ``export_to_video(video, path, fps)`` that keeps the frames; ``into_working_directory``:
  the MP4 goes there under its file name, as the other mains write (the tool's run folder)."""

  def export_to_video(video, path, fps=16, **kwargs):
    seen["frames"].append(video_metrics.as_frames(video))
    return export(video, os.path.basename(path) if into_working_directory else path, fps=fps,
                  **kwargs)

  return export_to_video


def counting_step(scheduler: Any, seen: dict[str, Any], on_step: OnStep) -> Callable[..., Any]:
  """A scheduler ``step`` that counts the Python steps of the call in progress; ``on_step``
  on the real calls' (every second call: each main warms up first)."""
  step = scheduler.step

  @functools.wraps(step)
  def counted(self, *args, **kwargs):
    out = step(self, *args, **kwargs)
    seen["steps"] = seen.get("steps", 0) + 1
    if len(seen["calls"]) % 2 == 1:
      on_step()
    return out

  return counted


@contextlib.contextmanager
def watching_main(module: Any, before_call: BeforeCall, on_step: OnStep,
                   denoise_seconds: Callable[[Any, float], float]) -> Iterator[dict[str, Any]]:
  """A main whose module holds ``call_pipeline(config, pipeline, ...)`` and
  ``export_to_video``, stepping with UniPC: ``generate_wan``, our VACE main."""
  from maxdiffusion.schedulers.scheduling_unipc_multistep_flax import (  # pylint: disable=import-outside-toplevel
      FlaxUniPCMultistepScheduler as scheduler)
  seen = seen_record()
  call, export = module.call_pipeline, module.export_to_video

  @functools.wraps(call)
  def call_pipeline(config, pipeline, *args, **kwargs):
    return watched_call(seen, pipeline, before_call,
                         lambda: call(config, pipeline, *args, **kwargs), denoise_seconds)

  with patched((module, "call_pipeline", call_pipeline),
                (module, "export_to_video", exporting(export, seen)),
                (scheduler, "step", counting_step(scheduler, seen, on_step))):
    yield seen


def _wan(before_call: BeforeCall, on_step: OnStep) -> contextlib.AbstractContextManager:
  """``generate_wan``: the pipeline's own trace gives the denoising seconds
  (``denoise_total``)."""
  from maxdiffusion import generate_wan  # pylint: disable=import-outside-toplevel

  def denoise_total(outputs: Any, _: float) -> float:
    trace = outputs[1] if isinstance(outputs, tuple) else {}
    return trace.get("denoise_total", float("nan"))

  return watching_main(generate_wan, before_call, on_step, denoise_total)


_HERE = {
    WAN: Generation(WAN, "seconds per denoising step of the real run (the pipeline's "
                         "denoise_total; compile warm-up excluded)", _wan),
}


class _Generations(Mapping[VideoModel, Generation]):
  """Each family's driver: Wan's here, a family with its own module (:attr:`VideoModel.module`:
  LTX-2's, Wan Animate's, Wan VACE's) that module's ``GENERATION``, imported when asked."""

  def __getitem__(self, family: VideoModel) -> Generation:
    if family in _HERE:
      return _HERE[family]
    if family.module:
      return importlib.import_module(family.module).GENERATION
    raise KeyError(family)

  def __iter__(self) -> Iterator[VideoModel]:
    return iter([f for f in EVERY_FAMILY if f in _HERE or f.module])

  def __len__(self) -> int:
    return len(list(iter(self)))


GENERATIONS: Mapping[VideoModel, Generation] = _Generations()


def generation(family: VideoModel, tool: str) -> Generation:
  """The driver of ``family``'s generate main; another family is refused by name."""
  if family not in GENERATIONS:
    runs = ", ".join(f"{f.name} ({f.generate_main})" for f in GENERATIONS)
    raise ValueError(f"{tool} drives {runs}; {family.name} has no generate main "
                     f"({family.generate_module})")
  return GENERATIONS[family]
