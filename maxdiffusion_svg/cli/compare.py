"""``python -m maxdiffusion_svg compare CONFIG [key=value ...]``: dense vs SVG on one checkpoint."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from maxdiffusion_svg.budgets.schedule import PRESETS, check_preset_overrides, preset_hint
from maxdiffusion_svg.cli.args import add_config_args, require_maxdiffusion

CONFIG_RUN = "config"  # plugin.compare.CONFIG_RUN, not imported: that module loads for seconds

COMMAND_HELP = ("the config's dense kernel and SVG on the same prompt and seed, weights loaded "
                "once: seconds per step, sparse calls, PSNR/SSIM(/LPIPS) against the dense video, "
                "a side-by-side MP4 and a JSON (needs MaxDiffusion on PYTHONPATH)")


def add_parser(sub: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  compare = sub.add_parser("compare", help=COMMAND_HELP)
  add_config_args(compare, "a Wan, LTX-2 or Wan Animate generation config (base_config chains "
                           "merged), e.g. configs/wan_svg.yml; its checkpoint, prompt, seed and "
                           "video are used",
                  "keys to change for every run, as on MaxDiffusion's command line")
  compare.add_argument("--dense", metavar="KERNEL",
                       help="the dense kernel to compare with (e.g. flash, ulysses, "
                            "ulysses_custom_fixed_m; default: the attention of the config's "
                            "base_config chain, what you run without SVG)")
  compare.add_argument("--svg", default="config", metavar="RUN[,RUN...]",
                       help="comma-separated SVG runs after the dense one: config (the config's "
                            "own svg_* keys), a preset (conservative, moderate, aggressive) or a "
                            "band density such as 0.25, each with options after +: compensation"
                            "[=N|off], semantic (SVG2's clustered layout among the router's "
                            "choices), layouts=A/B, sink=on|off; e.g. --svg 0.25,0.25+semantic")
  compare.add_argument("--out", default="svg_compare", metavar="DIR",
                       help="folder for each run's MP4, side_by_side.mp4 and compare.json")
  compare.add_argument("--lpips", action="store_true",
                       help="also LPIPS (AlexNet): needs the lpips, torch and torchvision "
                            "packages and AlexNet's ImageNet weights in torch's hub folder")
  compare.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
  compare.add_argument("--verbose", action="store_true",
                       help="print what MaxDiffusion prints (each run's config dump and logs); "
                            "by default it goes to maxdiffusion.log in --out")
  compare.set_defaults(run=run)


def check_svg_runs(runs: Sequence[str]) -> None:
  """Each ``--svg`` run's name (before its ``+options``) is config, a preset or a number: a
  typo is refused at once, with the nearest preset, not after MaxDiffusion and the config have
  loaded (:func:`maxdiffusion_svg.plugin.compare.svg_run` checks the rest of each run)."""
  for spec in runs:
    base = spec.split("+", 1)[0]
    if base == CONFIG_RUN or base in PRESETS:
      continue
    try:
      float(base)
    except ValueError:
      raise ValueError(f"--svg {base!r} is not a run: give {CONFIG_RUN}, a preset "
                       f"({', '.join(PRESETS)}) or a band density in (0, 1]"
                       f"{preset_hint(base)}") from None


def run(args: argparse.Namespace) -> int:
  runs = [r.strip() for r in args.svg.split(",") if r.strip()]
  check_svg_runs(runs)
  check_preset_overrides(args.overrides)
  require_maxdiffusion("compare")
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin import quiet
  from maxdiffusion_svg.plugin.compare import format_comparison, plan_comparison, run_comparison
  # pylint: enable=import-outside-toplevel
  plan = plan_comparison(args.config, args.overrides, args.dense, runs, args.out, args.lpips)
  print(f"compare: {len(plan.runs)} runs ({', '.join(r.name for r in plan.runs)}), "
        f"outputs in {plan.out_dir}", file=sys.stderr, flush=True)
  quiet.calm_child_processes()
  log = None if args.verbose else plan.out_dir / quiet.LOG_NAME
  with quiet.to_log(log, keep=quiet.WARNINGS) as terminal:  # run_comparison's quiet: this one
    result, _ = run_comparison(plan, log=lambda m: print(m, file=terminal.err, flush=True),
                               progress=not args.no_progress, quiet=not args.verbose)
  print(format_comparison(result))
  return 0
