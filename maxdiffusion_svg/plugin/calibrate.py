"""``calibrate``: per-layer densities measured on the user's checkpoint, through the model's own
MaxDiffusion main (``generate_wan``, ``generate_ltx2``, ``generate_wan_animate``), written as an
overlay config.

The config runs as the user would run it (``attention=svg``, its schedule), once per prompt,
weights loaded once. Every video self-attention call also measures, on device, its error
against dense at each rung: a ladder of densities, each with compensation off and on
(:func:`maxdiffusion_svg.measure.calibration.sampled_rung_errors`: sampled rows, the router's
layouts); only those few numbers leave the device. The calls the schedule makes sparse are averaged
per
layer (and Wan 2.2 expert), and :func:`maxdiffusion_svg.measure.calibration.calibrate_layers` picks
each layer's rung within the uniform rung's cost (or, with a target error, the least cost that meets
it). Layers the schedule keeps dense keep the config's density and compensation.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np
import yaml

from maxdiffusion_svg.budgets.budget import own_key
from maxdiffusion_svg.budgets.config import EXPERTS
from maxdiffusion_svg.budgets.per_layer import Rung
from maxdiffusion_svg.measure.calibration import (FLOOR_DB, MAX_LOSS_DB, Calibration,
                                                  HeadCalibration, calibrate_heads,
                                                  calibrate_layers, candidate_rungs,
                                                  compensation_choices, guard_broken,
                                                  head_weights, psnr_db, rung_costs, uniform_rung)
from maxdiffusion_svg.plugin import generations, hooks, launcher
from maxdiffusion_svg.plugin.calibration_record import CHECK_KEY, RECORD_KEY, record
from maxdiffusion_svg.plugin.estimate import estimate_config
from maxdiffusion_svg.plugin.kernel import record_rung_errors
from maxdiffusion_svg.plugin.overlay import BASE_KEY
from maxdiffusion_svg.plugin.settings import KERNEL_NAME, PluginSettings
from maxdiffusion_svg.plugin.video_models import grid_of, video_model
from maxdiffusion_svg.routing.compensation import check_compensation


@dataclasses.dataclass(frozen=True)
class CalibrationPlan:
  """Everything checked before weights load."""

  config: str
  overrides: tuple[str, ...]
  keys: dict[str, Any]
  settings: PluginSettings
  prompts: tuple[str, ...]
  rungs: tuple[Rung, ...]  # the candidates, every expert's uniform rung among them
  target_error: float | None
  out: pathlib.Path
  max_loss_db: float | None = MAX_LOSS_DB  # the guard (calibration.calibrate_layers)
  floor_db: float = FLOOR_DB
  compensation: str = "both"  # calibration.COMPENSATION_CHOICES
  per_head: bool = False  # a density per (layer, head): svg_head_densities
  held_out: int = 0  # the last prompts, not fitted: the budget judged on them
  match_uniform: bool = False  # the fewest tiles at the uniform budget's own measured error

  @property
  def fitted(self) -> tuple[str, ...]:
    return self.prompts[:len(self.prompts) - self.held_out]

  @property
  def per_layer_compensation(self) -> bool:
    """Whether the overlay sets compensation per layer: the candidates held more than the
    config's own (never with per-head budgets, whose heads compensate as the config says)."""
    return (not self.per_head
            and {r.compensation for r in self.rungs} != {self.settings.svg.compensation})


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
                     floor_db: float = FLOOR_DB, compensation: str | None = None,
                     per_head: bool = False, held_out: int | None = None,
                     match_uniform: bool = False) -> CalibrationPlan:
  """Every check ``calibrate`` can make before weights load. ``compensation`` (``--compensation``)
  defaults to ``both``, and to ``config`` with ``per_head`` (``--per-head``), whose heads all
  compensate as ``svg_compensation`` says. ``held_out`` (``--held-out``): the last prompts,
  measured but not fitted (default: half of them, rounded down). ``match_uniform``
  (``--match-uniform``): the fewest tiles whose measured error is the uniform budget's."""
  from maxdiffusion_svg.measure.calibration import LADDER  # pylint: disable=import-outside-toplevel
  argv = ["calibrate", config, *overrides, f"attention={KERNEL_NAME}"]
  keys = launcher.with_overrides(launcher.checked_config(argv)[0], argv[2:])
  generations.generation(video_model(keys), "calibrate")
  settings = PluginSettings.from_mapping(keys)
  compensation = compensation or ("config" if per_head else "both")
  if per_head:
    _check_per_head(settings, compensation)
  if match_uniform and target_error is not None:
    raise ValueError("give --target-error or --match-uniform, not both")
  if target_error is not None and not target_error > 0:
    raise ValueError(f"--target-error must be > 0 (a mean relative error per layer), got "
                     f"{target_error}")
  if True in compensation_choices(compensation, settings.svg):  # compensated: blocks fit?
    check_compensation(True, settings.svg.compensation_blocks, settings.svg.block_kv)
  if max_loss_db is not None and not max_loss_db >= 0:
    raise ValueError(f"--max-layer-loss-db must be >= 0 dB, got {max_loss_db}")
  if keys.get("aot_cache_dir"):
    raise ValueError(f"aot_cache_dir is {keys['aot_cache_dir']!r}: calibrate measures inside the "
                     f"svg kernel, which a cached executable skips; give aot_cache_dir=''")
  path = pathlib.Path(out)
  if path.suffix not in (".yml", ".yaml"):
    raise ValueError(f"--out {out} must name a .yml file (the overlay config)")
  if not path.parent.exists() or not os.access(path.parent, os.W_OK):
    raise ValueError(f"--out {out}: its folder is missing or not writable")
  rungs = candidate_rungs(settings.svg, LADDER if ladder is None else ladder, compensation,
                          (None, *EXPERTS))  # every expert's uniform choice is a candidate
  texts = read_prompts(prompts, keys)
  held_out = len(texts) // 2 if held_out is None else held_out
  if not 0 <= held_out < len(texts):
    raise ValueError(f"--held-out {held_out}: give 0 to {len(texts) - 1} of the {len(texts)} "
                     f"prompt(s) (at least one is fitted; more with --prompts FILE)")
  return CalibrationPlan(config, tuple(overrides), keys, settings, texts, rungs, target_error,
                         path.resolve(), max_loss_db, floor_db, compensation, per_head, held_out,
                         match_uniform)


def _check_per_head(settings: PluginSettings, compensation: str) -> None:
  """What ``--per-head`` cannot calibrate, refused by name before weights load."""
  svg = settings.svg
  if compensation_choices(compensation, svg) != (svg.compensation,):
    raise ValueError(f"--per-head calibrates densities at the config's compensation "
                     f"(svg_compensation: {str(svg.compensation).lower()}), every head of a call "
                     f"alike: give --compensation config (got {compensation})")
  try:  # the overlay's svg_head_densities, refused now as the run would refuse it
    dataclasses.replace(svg, head_densities=((svg.density,),))
  except ValueError as err:
    raise ValueError(f"--per-head: {err}") from None


def layer_table(entries: Sequence[dict[str, Any]], expert: str | None, layers: int,
                rungs: int, field: str = "errors") -> tuple[np.ndarray, np.ndarray]:
  """``(values [L, K, ...], measured [L])``: each layer's mean of ``field`` (``errors``;
  ``temporal``: the share of heads routed temporal; ``head_errors``: ``[K, H]`` each head's)
  over its sparse calls (``measured``: the calls that made the mean; 0 where the schedule kept
  the layer dense)."""
  shape = next((np.shape(e[field]) for e in entries if e["expert"] == expert), (rungs,))
  total, count = np.zeros((layers, *shape)), np.zeros(layers)
  for entry in entries:
    if entry["expert"] == expert and entry["active"] and 0 <= entry["layer"] < layers:
      total[entry["layer"]] += entry[field]
      count[entry["layer"]] += 1
  return total / np.maximum(count, 1).reshape(-1, *[1] * len(shape)), count


def run_calibration(plan: CalibrationPlan, log: Callable[[str], None] = print
                    ) -> tuple[dict[str, Any], np.ndarray]:
  """Generates each prompt once with the rung measurement on, then allocates and writes the
  overlay; returns what the table prints and the last prompt's video (uint8 frames: the
  uniform density's run, which the measurement leaves unchanged)."""
  # pylint: disable=import-outside-toplevel
  import jax
  from maxdiffusion import pyconfig

  from maxdiffusion_svg import plugin
  # pylint: enable=import-outside-toplevel
  plugin.register()
  start = time.perf_counter()
  keys, svg = plan.keys, plan.settings.svg
  steps = int(keys["num_inference_steps"])
  grid = grid_of(keys)
  done = {"steps": 0}
  generation = generations.generation(video_model(keys), "calibrate")

  def on_step() -> None:
    done["steps"] += 1
    log(f"calibrate: step {done['steps']} of {steps * len(plan.prompts)} "
        f"({time.perf_counter() - start:.0f} s)")

  with tempfile.TemporaryDirectory(prefix="maxdiffusion_svg_calibrate_") as tmp, \
      record_rung_errors(plan.rungs) as entries, \
      generation.watch(lambda pipeline: None, on_step) as seen:
    argv = launcher.prepare_argv(["calibrate", plan.config, *plan.overrides,
                                  f"attention={KERNEL_NAME}"], tmp)[0]
    cwd = os.getcwd()
    os.chdir(tmp)  # the main writes its MP4 into the working directory
    try:
      for i, prompt in enumerate(plan.prompts):
        held = " (held out: measured, not fitted)" if i >= len(plan.fitted) else ""
        log(f"calibrate: prompt {i + 1} of {len(plan.prompts)}{held}")
        with_prompt = [*argv, f"prompt={prompt}"]
        if "pipeline" not in seen:
          generation.first(with_prompt)  # loads the weights (once), then runs
        else:
          pyconfig.initialize(with_prompt)
          generation.again(pyconfig.config, seen)
        jax.effects_barrier()  # this prompt's measurements, all in
        if i == len(plan.fitted) - 1:
          fitted_calls = len(entries)
    finally:
      os.chdir(cwd)
    jax.effects_barrier()
    frames = seen["frames"][-1]
    models = hooks.prepared_transformers(seen["pipeline"])
    mesh = getattr(seen["pipeline"], "mesh", None)
  experts = {getattr(model, "svg_expert", None): model.num_layers for model in models}
  target = svg.target(mesh=mesh)
  results: dict[str | None, Calibration | HeadCalibration] = {}
  measured: dict[str | None, list[int]] = {}
  temporal: dict[str | None, np.ndarray] = {}
  fitted, held_entries = entries[:fitted_calls], entries[fitted_calls:]
  held: dict[str | None, dict[str, Any]] = {}
  for expert, layers in experts.items():
    table, count = layer_table(fitted, expert, layers, len(plan.rungs))
    active = count > 0
    if not active.any():
      raise ValueError(f"no sparse call was measured{f' ({expert})' if expert else ''}: the "
                       f"schedule (svg_active_steps/svg_active_layers) keeps every call dense")
    errors = table[active]
    costs = rung_costs(svg, grid, plan.rungs, expert, target)
    if plan.per_head:  # [layers, K, H] -> [layers, H, K]: each head's own errors
      heads = layer_table(fitted, expert, layers, len(plan.rungs), "head_errors")[0][active]
      power = layer_table(fitted, expert, layers, len(plan.rungs), "power")[0][active]
      results[expert] = calibrate_heads(np.swapaxes(heads, 1, 2), costs,
                                        [r.density for r in plan.rungs], svg.budget(expert).density,
                                        plan.target_error, plan.max_loss_db, plan.floor_db,
                                        weights=head_weights(power),
                                        match_uniform=plan.match_uniform)
    else:
      results[expert] = calibrate_layers(errors, costs, plan.rungs, uniform_rung(svg, expert),
                                         plan.target_error, plan.max_loss_db, plan.floor_db,
                                         plan.match_uniform)
    measured[expert] = np.flatnonzero(active).tolist()
    temporal[expert] = layer_table(fitted, expert, layers, len(plan.rungs), "temporal")[0][active]
    if held_entries:
      held[expert] = held_out_errors(held_entries, expert, layers, plan, results[expert],
                                     active, svg.budget(expert).density)
  overlay = {BASE_KEY: str(pathlib.Path(plan.config).resolve())}
  overlay.update(_svg_overrides(plan.overrides))
  report = {"config": plan.config, "overlay": str(plan.out), "prompts": len(plan.prompts),
            "held_out": plan.held_out,
            "guard": None if plan.max_loss_db is None else {"max_loss_db": plan.max_loss_db,
                                                             "floor_db": plan.floor_db},
            "steps": steps, "grid": [grid.frames, grid.height, grid.width], "experts": {},
            "seconds": round(time.perf_counter() - start, 1), "kind": "measured"}
  for expert, result in results.items():
    if plan.per_head:
      report["experts"][str(expert)] = {
          **_head_overlay(overlay, result, expert, experts[expert], measured[expert],
                          svg.budget(expert).density), "held_out": held.get(expert)}
      continue
    densities = [svg.budget(expert).density] * experts[expert]
    compensation = [svg.compensation] * experts[expert]
    for layer, rung in zip(measured[expert], result.chosen):
      densities[layer], compensation[layer] = rung
    overlay[own_key("densities", expert)] = densities
    if plan.per_layer_compensation:
      overlay[own_key("compensation", expert)] = compensation
    chosen = list(result.allocation.choice)
    report["experts"][str(expert)] = {"layers": experts[expert], "measured": measured[expert],
                                      **result.as_dict(), "densities": densities,
                                      "compensation": compensation,
                                      "temporal_share": temporal[expert].tolist(),
                                      "chosen_temporal_share": temporal[expert][
                                          np.arange(len(chosen)), chosen].tolist(),
                                      "held_out": held.get(expert)}
  overlay[RECORD_KEY] = record(plan.keys, len(plan.prompts))
  report["calibrated_on"] = overlay[RECORD_KEY]
  if plan.match_uniform:
    report["matched"] = priced_runs(plan.keys, overlay, target, max(experts.values()))
  plan.out.write_text(_overlay_text(plan, overlay), encoding="utf-8")
  return report, frames


def priced_runs(keys: dict[str, Any], overlay: dict[str, Any], target: Any,
                layers: int | None = None) -> dict[str, Any]:
  """The run at the overlay's budgets and at the config's uniform one, as ``tiles CONFIG``
  prices them on ``target`` (``layers``: the model's, as the run built it): self-attention's
  work against dense over the run, and its bound against ``ulysses_custom_fixed_m`` by
  libtpu's static schedule where figures exist."""
  own = {key: value for key, value in overlay.items() if key.startswith("svg_")}
  out: dict[str, Any] = {"target": target.describe()}
  for name, config in (("calibrated", {**keys, **own}), ("uniform", keys)):
    try:
      result = estimate_config(config, target, layers=layers)
    except ValueError as err:
      return {**out, "priced": False, "why": str(err)}
    combined, row = result["combined"], result["rows"][0]
    out[name] = {"work_vs_dense": combined["work_vs_dense"],
                 "vs_fixed_m": combined.get("vs_fixed_m")}
    out["why"] = row["vs_fixed_m"].get("why", "")
  out["priced"] = out["calibrated"]["vs_fixed_m"] is not None
  return out


def held_out_errors(entries: Sequence[dict[str, Any]], expert: str | None, layers: int,
                    plan: CalibrationPlan, result: Calibration | HeadCalibration,
                    active: np.ndarray, density: float) -> dict[str, Any]:
  """The fitted budget judged on the held-out prompts' calls: each measured layer's error at
  its chosen rung(s) and at the uniform one, and the guard (no layer more than
  ``max_loss_db`` below its uniform PSNR unless above ``floor_db``) held or broken, by layer."""
  if plan.per_head:  # the heads' errors weighed by their power on these prompts
    heads = np.swapaxes(layer_table(entries, expert, layers, len(plan.rungs),
                                    "head_errors")[0][active], 1, 2)  # [L, H, K]
    weights = head_weights(layer_table(entries, expert, layers, len(plan.rungs),
                                       "power")[0][active])
    u = list(result.densities).index(float(density))
    at = np.take_along_axis(heads, result.choice[:, :, None], axis=2)[:, :, 0]
    chosen, uniform = (at * weights).sum(axis=1), (heads[:, :, u] * weights).sum(axis=1)
  else:
    errors = layer_table(entries, expert, layers, len(plan.rungs))[0][active]  # [L, K]
    rows = np.arange(errors.shape[0])
    chosen = errors[rows, list(result.allocation.choice)]
    uniform = errors[:, plan.rungs.index(result.uniform)]
  loss = psnr_db(uniform) - psnr_db(chosen)
  broken = (np.zeros(len(chosen), bool) if plan.max_loss_db is None
            else guard_broken(chosen, uniform, plan.max_loss_db, plan.floor_db))
  broke = [{"layer": int(layer), "loss_db": float(d), "psnr_db": float(psnr_db(c))}
           for layer, d, c, b in zip(np.flatnonzero(active), loss, chosen, broken) if b]
  return {"prompts": plan.held_out, "errors": chosen.tolist(), "uniform_errors": uniform.tolist(),
          "error": float(chosen.sum()), "uniform_error": float(uniform.sum()), "broke": broke}


def _head_overlay(overlay: dict[str, Any], result: HeadCalibration, expert: str | None,
                  layers: int, measured: list[int], density: float) -> dict[str, Any]:
  """Writes ``expert``'s per-head densities into ``overlay`` (layers the schedule keeps dense
  at the config's density) and returns what the table reports."""
  heads = result.errors.shape[1]
  rows = [[density] * heads for _ in range(layers)]
  for layer, chosen in zip(measured, result.chosen):
    rows[layer] = list(chosen)
  overlay[own_key("head", expert)] = rows
  return {"layers": layers, "measured": measured, "per_head": True, "heads": heads,
          **result.as_dict(), "head_densities": rows}


def _svg_overrides(overrides: Sequence[str]) -> dict[str, Any]:
  """The command line's ``svg_*`` keys: the calibration's budget was theirs."""
  pairs = (o.split("=", 1) for o in overrides)
  return {key: yaml.safe_load(value) for key, value in pairs if key.startswith("svg_")}


def _overlay_text(plan: CalibrationPlan, overlay: dict[str, Any]) -> str:
  measured = [o for o in plan.overrides if o.split("=", 1)[0] in overlay[RECORD_KEY]]
  head = (f"# Written by python -m maxdiffusion_svg calibrate {plan.config}"
          f"{' ' + ' '.join(plan.overrides) if plan.overrides else ''}\n"
          f"# Per-layer budgets measured on this checkpoint ({len(plan.prompts)} prompt(s)) at "
          f"the keys of {RECORD_KEY}, which a run must share\n# ({CHECK_KEY}=false runs "
          f"them anyway); run it as any config:\n"
          f"#   python -m maxdiffusion_svg generate {plan.out.name}"
          f"{' ' + ' '.join(measured) if measured else ''}\n")
  return head + yaml.safe_dump(overlay, sort_keys=False, default_flow_style=None)


def format_calibration(report: dict[str, Any]) -> str:
  lines = [f"calibrate: {report['config']} on {report['prompts']} prompt(s), "
           f"{'x'.join(map(str, report['grid']))} tokens, {report['seconds']:.0f} s "
           f"(errors measured on device, relative to dense, sampled rows)"]
  for expert, r in report["experts"].items():
    if r.get("per_head"):
      lines.extend(_head_table(expert, r))
      lines.append(_held_out_line(r["held_out"], r["measured"], report))
      continue
    u = r["uniform_rung"]
    lines.append(f"{'expert ' + expert if expert != 'None' else 'model'}: uniform "
                 f"{r['uniform']}, {r['layers']} layers")
    lines.append(f"{'layer':>6}{'density':>9}{'compensation':>14}{'temporal heads':>16}"
                 f"{'error':>11}{'uniform':>11}{'dB vs uniform':>15}")
    for row, (layer, j) in enumerate(zip(r["measured"], r["choice"])):
      error, uniform = r["errors"][row][j], r["errors"][row][u]
      change = 10 * math.log10(max(uniform, 1e-30) / max(error, 1e-30))
      lines.append(f"{layer:>6}{r['densities'][layer]:>9}"
                   f"{'on' if r['compensation'][layer] else 'off':>14}"
                   f"{r['chosen_temporal_share'][row]:>16.0%}{error:>11.3g}"
                   f"{uniform:>11.3g}{change:>+15.2f}")
    lines.append(f"cost per head (key tiles, with compensation's row keys): {r['tiles']:.0f} "
                 f"(uniform {r['uniform_tiles']:.0f}); total error {r['error']:.3g} (uniform "
                 f"{r['uniform_error']:.3g})")
    lines.append(_held_out_line(r["held_out"], r["measured"], report))
  if report.get("matched"):
    lines.append(_matched_line(report))
  lines.append(f"overlay written: {report['overlay']}")
  return "\n".join(lines)


def _matched_line(report: dict[str, Any]) -> str:
  """``--match-uniform``: the tiles saved at uniform's measured error, and the run priced."""
  saved = "; ".join(
      f"{'expert ' + e + ': ' if e != 'None' else ''}{r['tiles']:.0f} key tiles per head "
      f"against uniform's {r['uniform_tiles']:.0f} ({1 - r['tiles'] / r['uniform_tiles']:.1%} "
      f"fewer)" for e, r in report["experts"].items())
  m = report["matched"]
  if "calibrated" not in m:
    return f"at uniform's measured error: {saved}; the run not priced ({m['why']})"
  work = (f"self-attention work vs dense over the run {m['calibrated']['work_vs_dense']:.3f} "
          f"(uniform {m['uniform']['work_vs_dense']:.3f}: "
          f"{m['uniform']['work_vs_dense'] / m['calibrated']['work_vs_dense']:.2f}x fewer tiles)")
  if m["priced"]:
    mine, theirs = m["calibrated"]["vs_fixed_m"], m["uniform"]["vs_fixed_m"]
    against = (f"against ulysses_custom_fixed_m on {m['target']} at most "
               f"{mine['fixed']['bound']:.2f}x (uniform {theirs['fixed']['bound']:.2f}x; every "
               f"head on online softmax {mine['online']['bound']:.2f}x, uniform "
               f"{theirs['online']['bound']:.2f}x)")
  else:
    against = (f"not priced against ulysses_custom_fixed_m ({m['why']}): price the overlay for "
               f"a slice with python -m maxdiffusion_svg tiles {pathlib.Path(report['overlay']).name}"
               f" --slice v6e-8")
  return f"at uniform's measured error (--match-uniform): {saved}; {work}; {against}"


def _held_out_line(held: dict[str, Any] | None, layers: Sequence[int],
                   report: dict[str, Any]) -> str:
  """The budget on the prompts it was not fitted to: each layer's dB against uniform there, and
  whether the per-layer guard held."""
  if held is None:
    return ("held out: none (one prompt: give --prompts FILE with 2 or more to judge the budget "
            "on prompts it was not fitted to)")
  db = lambda a, b: 10 * math.log10(max(b, 1e-30) / max(a, 1e-30))
  per_layer = ", ".join(f"{layer} {db(e, u):+.2f}" for layer, e, u in
                        zip(layers, held["errors"], held["uniform_errors"]))
  guard = report.get("guard")
  if held["broke"]:
    verdict = "guard broken: " + "; ".join(
        f"layer {b['layer']} {b['loss_db']:.2f} dB below uniform, at {b['psnr_db']:.1f} dB"
        for b in held["broke"])
  else:
    verdict = "guard held" if guard else "no guard (--no-guard)"
  return (f"held out ({held['prompts']} prompt(s), not fitted): total error {held['error']:.3g} "
          f"(uniform {held['uniform_error']:.3g}, {db(held['error'], held['uniform_error']):+.2f}"
          f" dB); dB vs uniform per layer: {per_layer}; {verdict}")


def _head_table(expert: str, r: dict[str, Any]) -> list[str]:
  """Per layer: its heads' densities (least, mean, most), error, uniform's and the change."""
  lines = [f"{'expert ' + expert if expert != 'None' else 'model'}: uniform {r['uniform']:g}, "
           f"{r['layers']} layers x {r['heads']} heads (per-head densities)",
           f"{'layer':>6}{'least':>7}{'mean':>7}{'most':>7}{'error':>11}{'uniform':>11}"
           f"{'dB vs uniform':>15}"]
  for row, layer in enumerate(r["measured"]):
    heads = r["head_densities"][layer]
    error, uniform = r["layer_errors"][row], r["uniform_layer_errors"][row]
    change = 10 * math.log10(max(uniform, 1e-30) / max(error, 1e-30))
    lines.append(f"{layer:>6}{min(heads):>7g}{float(np.mean(heads)):>7.3f}{max(heads):>7g}"
                 f"{error:>11.3g}{uniform:>11.3g}{change:>+15.2f}")
  lines.append(f"cost per head (key tiles over the layers): {r['tiles']:.0f} (uniform "
               f"{r['uniform_tiles']:.0f}); total error {r['error']:.3g} (uniform "
               f"{r['uniform_error']:.3g})")
  return lines
