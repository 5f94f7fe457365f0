"""What a calibrated overlay was measured on, and the check that a run matches it.

``calibrate`` writes ``svg_calibrated_on`` into its overlay: the checkpoint, the video, the
steps and the dense kernel its budgets were measured with (and how many prompts). Every tool
and the run compare a config holding it with the config's own keys before weights load
(:func:`config_checks.check_before_weights`), so a calibrated budget never runs silently on
another model or grid; ``svg_calibration_check: false`` runs it anyway.
"""

from __future__ import annotations

import pathlib
from typing import Any, Mapping

from maxdiffusion_svg.plugin.video_models import video_model

RECORD_KEY = "svg_calibrated_on"
CHECK_KEY = "svg_calibration_check"
CHECKPOINT = "pretrained_model_name_or_path"
PROMPTS = "prompts"  # how many were measured: recorded, not compared


def _compared(keys: Mapping[str, Any]) -> tuple[str, ...]:
  """The keys a run must share with its calibration (the family's frames key)."""
  return (CHECKPOINT, "height", "width", video_model(keys).frames_key, "num_inference_steps",
          "svg_dense_kernel")


def _checkpoint(name: Any) -> str:
  """A checkpoint folder by its absolute path (the overlay may run from another folder)."""
  path = pathlib.Path(str(name)).expanduser()
  return str(path.resolve()) if path.is_dir() else str(name)


def record(keys: Mapping[str, Any], prompts: int) -> dict[str, Any]:
  """``svg_calibrated_on`` for a calibration of ``keys`` on ``prompts`` prompts."""
  measured = {key: keys.get(key, "") for key in _compared(keys)}
  measured[CHECKPOINT] = _checkpoint(measured[CHECKPOINT])
  return {**measured, PROMPTS: prompts}


def measured_on(keys: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
  """A config's ``svg_calibrated_on`` as sorted ``(key, value)`` pairs (empty: none)."""
  measured = keys.get(RECORD_KEY) or {}
  if not isinstance(measured, Mapping) or not all(
      isinstance(v, (str, int, float, bool)) for v in measured.values()):
    raise ValueError(f"{RECORD_KEY} must be a mapping of the keys calibrate measured on to "
                     f"their values (calibrate writes it), got {measured!r}")
  return tuple(sorted((str(k), v) for k, v in measured.items()))


def check_record(keys: Mapping[str, Any]) -> None:
  """Refuses a run whose checkpoint, video, steps or dense kernel differ from those its
  calibrated budgets were measured on, naming the key; nothing where the config holds no
  record or ``svg_calibration_check`` is false."""
  measured = dict(measured_on(keys))
  if not measured or keys.get(CHECK_KEY, True) is False:
    return
  for key in _compared(keys):
    if key not in measured:
      continue
    ours, theirs = keys.get(key, ""), measured[key]
    if key == CHECKPOINT:
      ours = _checkpoint(ours)
    if ours != theirs:
      raise ValueError(f"{RECORD_KEY}: the config's calibrated budgets were measured with {key} "
                       f"{theirs!r}, and this run has {key} {ours!r}: calibrate again for this "
                       f"run (python -m maxdiffusion_svg calibrate), or give "
                       f"{CHECK_KEY}=false to run them anyway")
