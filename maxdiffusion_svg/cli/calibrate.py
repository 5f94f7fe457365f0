"""``python -m maxdiffusion_svg calibrate CONFIG [key=value ...] --out OVERLAY.yml``."""

from __future__ import annotations

import argparse
import json
import pathlib

from maxdiffusion_svg.budgets.schedule import check_preset_overrides
from maxdiffusion_svg.cli.args import add_config_args, require_maxdiffusion
from maxdiffusion_svg.plugin import quiet

COMMAND_HELP = ("per-layer budgets for your checkpoint: runs the config's prompt(s) through "
                "the model's own main (generate_wan, generate_ltx2, generate_wan_animate), measures each layer's error against dense at a ladder of "
                "densities, compensation off and on, on device, and writes an overlay config "
                "whose layers spend the uniform density's tiles where they matter (needs "
                "MaxDiffusion on PYTHONPATH)")


def _ladder(text: str) -> tuple[float, ...]:
  try:
    return tuple(float(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"--ladder takes comma-separated densities, got {text!r}") from None


def add_parser(sub: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  calibrate = sub.add_parser("calibrate", help=COMMAND_HELP)
  add_config_args(calibrate, "a Wan generation config with attention svg (base_config chains "
                             "merged), e.g. configs/wan_svg.yml",
                  "keys to change, as on MaxDiffusion's command line; svg_* keys are written "
                  "into the overlay too (the budget was theirs)")
  calibrate.add_argument("--out", required=True, metavar="OVERLAY.yml",
                         help="the overlay to write: base_config CONFIG plus "
                              "svg_layer_densities and svg_layer_compensation, or with "
                              "--per-head svg_head_densities (per expert for Wan 2.2)")
  calibrate.add_argument("--prompts", metavar="FILE",
                         help="prompts to measure on, one per line (default: the config's)")
  calibrate.add_argument("--held-out", type=int, metavar="N",
                         help="the last N prompts are measured but not fitted: the budget's "
                              "per-layer error and guard are reported on them (default: half "
                              "the prompts, rounded down)")
  calibrate.add_argument("--ladder", type=_ladder, metavar="D1,D2,...",
                         help="densities a layer may take (default 0.05,0.1,0.15,0.2,0.3,0.45,"
                              "0.7,1.0; the config's density is added)")
  calibrate.add_argument("--compensation", choices=("both", "off", "on", "config"),
                         default=None,
                         help="compensation a layer may take: both (each density with it off "
                              "and on, default), only off, only on, or the config's "
                              "svg_compensation (then no svg_layer_compensation is written); "
                              "config with --per-head")
  calibrate.add_argument("--per-head", action="store_true",
                         help="a density per (layer, head), written as svg_head_densities: "
                              "each head's error measured on device, layers x heads allocated "
                              "together within the uniform density's tiles (every head "
                              "compensated as svg_compensation says)")
  calibrate.add_argument("--target-error", type=float, metavar="E",
                         help="instead of the uniform density's tiles: the fewest tiles whose "
                              "mean relative error per layer is at most E")
  calibrate.add_argument("--match-uniform", action="store_true",
                         help="instead of the uniform density's tiles: the fewest tiles whose "
                              "measured error is the uniform density's own (the speed at "
                              "matched quality)")
  calibrate.add_argument("--max-layer-loss-db", type=float, default=3.0, metavar="DB",
                         help="how far below its uniform PSNR a layer may fall when it gives "
                              "tiles away, unless it stays above --floor-db (default 3)")
  calibrate.add_argument("--floor-db", type=float, default=30.0, metavar="DB",
                         help="a layer above this PSNR against dense may fall further (default 30)")
  calibrate.add_argument("--no-guard", action="store_true",
                         help="no per-layer guard: the total error alone decides")
  calibrate.add_argument("--json", metavar="FILE", help="also write the measurements as JSON")
  calibrate.add_argument("--verbose", action="store_true",
                         help="print what MaxDiffusion prints (its config dump, its logs); by "
                              "default it goes to OVERLAY.maxdiffusion.log beside --out")
  calibrate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  check_preset_overrides(args.overrides)  # a typo'd svg_schedule named before anything loads
  require_maxdiffusion("calibrate")
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin.calibrate import (format_calibration, plan_calibration,
                                                 run_calibration)
  # pylint: enable=import-outside-toplevel
  plan = plan_calibration(args.config, args.overrides, args.out, args.prompts, args.ladder,
                          args.target_error, None if args.no_guard else args.max_layer_loss_db,
                          args.floor_db, args.compensation, args.per_head, args.held_out,
                          args.match_uniform)
  quiet.calm_child_processes()
  log = None if args.verbose else log_path(args.out)
  with quiet.to_log(log, keep=quiet.WARNINGS) as terminal:
    report, _ = run_calibration(plan, log=lambda m: print(m, file=terminal.err, flush=True))
  print(format_calibration(report))
  if log is not None:
    print(f"MaxDiffusion's output (its config, its logs): {log} (--verbose prints it)")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1)
  return 0


def log_path(overlay: str) -> pathlib.Path:
  """Where a quiet calibration's MaxDiffusion output goes: beside the overlay, named after it."""
  path = pathlib.Path(overlay).absolute()
  return path.with_name(f"{path.stem}.{quiet.LOG_NAME}")
