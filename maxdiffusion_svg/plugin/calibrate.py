"""``calibrate``: per-layer densities measured on the user's checkpoint, through MaxDiffusion's
own ``generate_wan``, written as an overlay config.

The config runs as the user would run it (``attention=svg``, its schedule), once per prompt,
weights loaded once. Every video self-attention call also measures, on device, its error
against dense at each density of a ladder (:func:`maxdiffusion_svg.calibration.
sampled_rung_errors`: sampled rows, the router's layouts, compensation as configured); only
those few numbers leave the device. The calls the schedule makes sparse are averaged per layer
(and Wan 2.2 expert), and :func:`maxdiffusion_svg.calibration.calibrate_layers` picks each
layer's density within the uniform density's visited tiles (or, with a target error, the
fewest tiles that meet it). Layers the schedule keeps dense keep the uniform density.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np
import yaml

from maxdiffusion_svg.calibration import (FLOOR_DB, MAX_LOSS_DB, Calibration, calibrate_layers,
                                          check_ladder, rung_costs, with_uniform)
from maxdiffusion_svg.config import EXPERTS
from maxdiffusion_svg.geometry import VideoGrid
from maxdiffusion_svg.plugin import hooks, launcher
from maxdiffusion_svg.plugin.compare import generate_wan_calls, check_checkpoint
from maxdiffusion_svg.plugin.kernel import record_rung_errors
from maxdiffusion_svg.plugin.overlay import BASE_KEY
from maxdiffusion_svg.plugin.settings import KERNEL_NAME, PluginSettings

KEY_FOR = {None: "svg_layer_densities", "high_noise": "svg_high_noise_layer_densities",
           "low_noise": "svg_low_noise_layer_densities"}


@dataclasses.dataclass(frozen=True)
class CalibrationPlan:
  """Everything checked before weights load."""

  config: str
  overrides: tuple[str, ...]
  keys: dict[str, Any]
  settings: PluginSettings
  prompts: tuple[str, ...]
  ladder: tuple[float, ...]
  target_error: float | None
  out: pathlib.Path
  max_loss_db: float | None = MAX_LOSS_DB  # the guard (calibration.calibrate_layers)
  floor_db: float = FLOOR_DB


def read_prompts(path: str | None, keys: dict[str, Any]) -> tuple[str, ...]:
  """``--prompts`` (one per non-empty line), else the config's prompt."""
  if path is None:
    prompt = str(keys.get("prompt") or "").strip()
    if not prompt:
      raise ValueError("prompt is empty: give prompt='...' or --prompts FILE")
    return (prompt,)
  try:
    lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
  except OSError as err:
    raise ValueError(f"--prompts {path}: {err.strerror or err}") from None
  prompts = tuple(line.strip() for line in lines if line.strip())
  if not prompts:
    raise ValueError(f"--prompts {path} holds no prompt (one per line)")
  return prompts


def plan_calibration(config: str, overrides: Sequence[str], out: str, prompts: str | None = None,
                     ladder: Sequence[float] | None = None,
                     target_error: float | None = None, max_loss_db: float | None = MAX_LOSS_DB,
                     floor_db: float = FLOOR_DB) -> CalibrationPlan:
  """Every check ``calibrate`` can make before weights load."""
  from maxdiffusion_svg.calibration import LADDER  # pylint: disable=import-outside-toplevel
  argv = ["calibrate", config, *overrides, f"attention={KERNEL_NAME}"]
  keys = launcher.with_overrides(launcher.checked_config(argv)[0], argv[2:])
  settings = PluginSettings.from_mapping(keys)
  if target_error is not None and not target_error > 0:
    raise ValueError(f"--target-error must be > 0 (a mean relative error per layer), got "
                     f"{target_error}")
  if max_loss_db is not None and not max_loss_db >= 0:
    raise ValueError(f"--max-layer-loss-db must be >= 0 dB, got {max_loss_db}")
  if keys.get("aot_cache_dir"):
    raise ValueError(f"aot_cache_dir is {keys['aot_cache_dir']!r}: calibrate measures inside the "
                     f"svg kernel, which a cached executable skips; give aot_cache_dir=''")
  check_checkpoint(str(keys.get("pretrained_model_name_or_path") or ""))
  path = pathlib.Path(out)
  if path.suffix not in (".yml", ".yaml"):
    raise ValueError(f"--out {out} must name a .yml file (the overlay config)")
  if not path.parent.exists() or not os.access(path.parent, os.W_OK):
    raise ValueError(f"--out {out}: its folder is missing or not writable")
  return CalibrationPlan(config, tuple(overrides), keys, settings, read_prompts(prompts, keys),
                         _with_uniforms(settings.svg, LADDER if ladder is None else ladder),
                         target_error, path.resolve(), max_loss_db, floor_db)


def _with_uniforms(svg: Any, ladder: Sequence[float]) -> tuple[float, ...]:
  """The ladder with every expert's own density on it: the uniform choice is a candidate."""
  return check_ladder((*check_ladder(ladder), *(svg.density_for(e) for e in EXPERTS)))


def layer_table(entries: Sequence[dict[str, Any]], expert: str | None, layers: int,
                rungs: int) -> tuple[np.ndarray, np.ndarray]:
  """``(errors [L, K], measured [L])``: each layer's mean over its sparse calls (``measured``:
  the calls that made the mean; 0 where the schedule kept the layer dense)."""
  total, count = np.zeros((layers, rungs)), np.zeros(layers)
  for entry in entries:
    if entry["expert"] == expert and entry["active"] and 0 <= entry["layer"] < layers:
      total[entry["layer"]] += entry["errors"]
      count[entry["layer"]] += 1
  return total / np.maximum(count, 1)[:, None], count


def run_calibration(plan: CalibrationPlan, log: Callable[[str], None] = print
                    ) -> tuple[dict[str, Any], np.ndarray]:
  """Generates each prompt once with the rung measurement on, then allocates and writes the
  overlay; returns what the table prints and the last prompt's video (uint8 frames: the
  uniform density's run, which the measurement leaves unchanged)."""
  # pylint: disable=import-outside-toplevel
  import jax
  from maxdiffusion import generate_wan, pyconfig

  from maxdiffusion_svg import plugin
  # pylint: enable=import-outside-toplevel
  plugin.register()
  start = time.perf_counter()
  keys, svg = plan.keys, plan.settings.svg
  steps = int(keys["num_inference_steps"])
  grid = VideoGrid.for_video(keys["num_frames"], keys["height"], keys["width"])
  done = {"steps": 0}

  def on_step() -> None:
    done["steps"] += 1
    log(f"calibrate: step {done['steps']} of {steps * len(plan.prompts)} "
        f"({time.perf_counter() - start:.0f} s)")

  with tempfile.TemporaryDirectory(prefix="maxdiffusion_svg_calibrate_") as tmp, \
      record_rung_errors(plan.ladder) as entries, \
      generate_wan_calls(lambda pipeline: None, on_step) as seen:
    argv = launcher.prepare_argv(["calibrate", plan.config, *plan.overrides,
                                  f"attention={KERNEL_NAME}"], tmp)[0]
    cwd = os.getcwd()
    os.chdir(tmp)  # generate_wan writes its MP4 into the working directory
    try:
      for i, prompt in enumerate(plan.prompts):
        log(f"calibrate: prompt {i + 1} of {len(plan.prompts)}")
        with_prompt = [*argv, f"prompt={prompt}"]
        if "pipeline" not in seen:
          generate_wan.main(with_prompt)  # loads the weights (once), then runs
        else:
          pyconfig.initialize(with_prompt)
          generate_wan.run(pyconfig.config, pipeline=seen["pipeline"])
    finally:
      os.chdir(cwd)
    jax.effects_barrier()
    frames = seen["frames"][-1]
    models = hooks.prepared_transformers(seen["pipeline"])
    mesh = getattr(seen["pipeline"], "mesh", None)
  experts = {getattr(model, "svg_expert", None): model.num_layers for model in models}
  target = svg.target(mesh=mesh)
  results: dict[str | None, Calibration] = {}
  measured: dict[str | None, list[int]] = {}
  for expert, layers in experts.items():
    ladder = with_uniform(svg, plan.ladder, expert)  # plan.ladder holds it: the same rungs
    table, count = layer_table(entries, expert, layers, len(plan.ladder))
    active = count > 0
    if not active.any():
      raise ValueError(f"no sparse call was measured{f' ({expert})' if expert else ''}: the "
                       f"schedule (svg_active_steps/svg_active_layers) keeps every call dense")
    errors = table[active]
    costs = rung_costs(svg, grid, ladder, expert, target)
    results[expert] = calibrate_layers(errors, costs, ladder, svg.density_for(expert),
                                       plan.target_error, plan.max_loss_db, plan.floor_db)
    measured[expert] = np.flatnonzero(active).tolist()
  overlay = {BASE_KEY: str(pathlib.Path(plan.config).resolve())}
  overlay.update(_svg_overrides(plan.overrides))
  report = {"config": plan.config, "overlay": str(plan.out), "prompts": len(plan.prompts),
            "steps": steps, "grid": [grid.frames, grid.height, grid.width], "experts": {},
            "seconds": round(time.perf_counter() - start, 1), "kind": "measured"}
  for expert, result in results.items():
    densities = [svg.density_for(expert)] * experts[expert]
    for layer, density in zip(measured[expert], result.densities):
      densities[layer] = density
    overlay[KEY_FOR[expert]] = densities
    report["experts"][str(expert)] = {"layers": experts[expert], "measured": measured[expert],
                                      "densities": densities, **result.as_dict()}
  plan.out.write_text(_overlay_text(plan, overlay), encoding="utf-8")
  return report, frames


def _svg_overrides(overrides: Sequence[str]) -> dict[str, Any]:
  """The command line's ``svg_*`` keys: the calibration's budget was theirs."""
  pairs = (o.split("=", 1) for o in overrides)
  return {key: yaml.safe_load(value) for key, value in pairs if key.startswith("svg_")}


def _overlay_text(plan: CalibrationPlan, overlay: dict[str, Any]) -> str:
  head = (f"# Written by python -m maxdiffusion_svg calibrate {plan.config}"
          f"{' ' + ' '.join(plan.overrides) if plan.overrides else ''}\n"
          f"# Per-layer densities measured on this checkpoint ({len(plan.prompts)} prompt(s));"
          f" run it as any config:\n#   python -m maxdiffusion_svg.generate {plan.out.name}\n")
  return head + yaml.safe_dump(overlay, sort_keys=False, default_flow_style=None)


def format_calibration(report: dict[str, Any]) -> str:
  lines = [f"calibrate: {report['config']} on {report['prompts']} prompt(s), "
           f"{'x'.join(map(str, report['grid']))} tokens, {report['seconds']:.0f} s "
           f"(errors measured on device, relative to dense, sampled rows)"]
  for expert, r in report["experts"].items():
    u = r["ladder"].index(r["uniform"])
    lines.append(f"{'expert ' + expert if expert != 'None' else 'model'}: uniform density "
                 f"{r['uniform']}, {r['layers']} layers")
    lines.append(f"{'layer':>6}{'density':>9}{'error':>11}{'uniform':>11}")
    for row, layer in enumerate(r["measured"]):
      j = r["ladder"].index(r["densities"][layer])
      lines.append(f"{layer:>6}{r['densities'][layer]:>9}{r['errors'][row][j]:>11.3g}"
                   f"{r['errors'][row][u]:>11.3g}")
    lines.append(f"visited tiles per head: {r['tiles']:.0f} (uniform {r['uniform_tiles']:.0f}); "
                 f"total error {r['error']:.3g} (uniform {r['uniform_error']:.3g})")
  lines.append(f"overlay written: {report['overlay']}")
  return "\n".join(lines)
