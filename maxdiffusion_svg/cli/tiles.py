"""``python -m maxdiffusion_svg tiles``: the tile report, or with a config (``tiles CONFIG.yml
[key=value ...]``, or ``--config CONFIG.yml``) the run's own pre-flight checks and the estimate
for a generation config.

A flag that does not apply where it is given is an error naming what to do instead: with a
config its keys set the video, density and tiles, so the report's flags would be silently
beaten by them; without one there is no config for ``--layers``, ``--slice``,
``--attention-share`` or ``key=value`` to act on.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Mapping

from maxdiffusion_svg.cli.args import (_MODES, _add_grid_args, _add_json_arg, _density,
                                       _grid_from_args, _report, _tile, _typed)
from maxdiffusion_svg.plan.geometry import RESOLUTIONS
from maxdiffusion_svg.plan.target import GENERATIONS, Target, generation_named, tpu_target
from maxdiffusion_svg.plan.tiling import choose_tiles, tiles_help

# The report's defaults, applied after parsing so that a flag given can be told from one not.
DENSITY, MODE, CHIP = 0.35, "all", "v6e"


_share = _typed(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
_positive = _typed(int, lambda v: v > 0, "a positive integer")


def add_parser(sub: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  tiles = sub.add_parser(
      "tiles", usage="%(prog)s [CONFIG.yml] [key=value ...] [options]",
      help="tile report: what a density and tile size cost per mode; with a config "
           "(tiles CONFIG.yml), the run's own checks and the estimate for it")
  _add_grid_args(tiles)
  tiles.add_argument("--density", type=_density,
                     help=f"band density in (0, 1] (the first-frame sink comes on top) "
                          f"(default: {DENSITY})")
  tiles.add_argument("--block-q", type=_tile,
                     help=f"query tile, a multiple of 128 (default: --chip's; {tiles_help()})")
  tiles.add_argument("--block-kv", type=_tile, help="key tile (default: --chip's)")
  tiles.add_argument("--mode", choices=_MODES + [MODE],
                     help=f"traversal mode (default: {MODE})")
  tiles.add_argument("--no-sink", action="store_true", help="drop the first-frame attention sink")
  _add_json_arg(tiles)
  tiles.add_argument("--plot", metavar="FILE.png", help="draw tile maps and a token-mask crop")
  tiles.add_argument("--chip",
                     help=f"with a config: the TPU generation whose tiles and limits to check "
                          f"({', '.join(GENERATIONS)}; --slice implies it) (default: {CHIP})")
  tiles.add_argument("--libtpu-init-args", metavar="FLAGS",
                     help="with a config: the job's LIBTPU_INIT_ARGS (its scoped-VMEM limit "
                          "sets the tiles and the kernel's check) (default: this environment's "
                          "LIBTPU_INIT_ARGS, as a job that exports it runs; without it the "
                          "chip's own limit)")
  estimate = tiles.add_argument_group(
      "pre-flight and estimate for a generation config (computed from the tile plan, not "
      "measured)")
  estimate.add_argument("config", nargs="?", metavar="CONFIG.yml",
                        help="a generation config (Wan, Wan VACE, Wan Animate or LTX-2; "
                             "base_config chains merged; a bare name such as wan_svg.yml is "
                             "also looked up among the shipped configs): the run's checks, then "
                             "its estimate; its video, steps and svg_* keys replace the report's "
                             "options above")
  estimate.add_argument("--config", dest="config_flag", metavar="CONFIG.yml",
                        help="the same as CONFIG.yml given first (give one or the other)")
  estimate.add_argument("--slice", metavar="TYPE",
                        help="the TPU slice the job runs on (a size Cloud TPU offers, e.g. "
                             "v6e-8, v6e-16, v5p-8, tpu7x-8): also checks "
                             "the mesh the config's ici_*_parallelism builds there against the "
                             "heads; implies --chip")
  estimate.add_argument("--layers", type=_positive,
                        help="transformer layers (default: the checkpoint's transformer/"
                             "config.json, from its folder or this host's Hugging Face cache, "
                             "else the model's by its name: Wan 1.3B 30, other Wan 40, LTX-2 48)")
  estimate.add_argument("--heads", type=_positive,
                        help="attention heads, which svg_head_densities lists (default: as "
                             "--layers: Wan 1.3B 12, other Wan 40, LTX-2 32)")
  estimate.add_argument("--attention-share", type=_share, metavar="F",
                        help="self-attention's share of a dense step's time, for the end-to-end "
                             "bound (default: the seed design's 55.5%% at 720p and 88.2%% at "
                             "1440p, interpolated between)")
  estimate.add_argument("overrides", nargs="*", metavar="key=value",
                        help="with a config: keys to change, as on MaxDiffusion's command line")
  tiles.set_defaults(run=run)


def _instead(args: argparse.Namespace) -> dict[str, str]:
  """The report's flags given, each with the config key that does its job under --config."""
  pixels = RESOLUTIONS.get(args.resolution or "")
  keys = {
      "density": f"give svg_density={args.density}",
      "resolution": (f"give num_frames={pixels[0]} height={pixels[1]} width={pixels[2]}"
                     if pixels else "give num_frames, height and width"),
      "frames": f"give num_frames={args.frames}", "height": f"give height={args.height}",
      "width": f"give width={args.width}",
      "latent_grid": "give num_frames, height and width (pixels; the grid follows from them)",
      "block_q": f"give svg_block_q={args.block_q}",
      "block_kv": f"give svg_block_kv={args.block_kv}",
      "mode": (f"give svg_tile_mode={args.mode}" if args.mode != MODE else
               "give svg_tile_mode=naive, split or aligned (the run has one)"),
      "no_sink": "give svg_include_sink=false",
      "plot": "run tiles without a config for the tile map (--resolution, --density)",
  }
  return {name: hint for name, hint in keys.items() if getattr(args, name) not in (None, False)}


def config_of(config: str | None, flag: str | None,
              overrides: list[str]) -> tuple[str | None, list[str]]:
  """The config (first positional, or ``--config``) and the ``key=value`` overrides: a first
  positional holding ``=`` is an override (``tiles svg_density=0.2`` names no config)."""
  if config is not None and "=" in config:
    config, overrides = None, [config, *overrides]
  if config is not None and flag is not None:
    raise ValueError(f"two configs: CONFIG.yml {config} and --config {flag}; give one "
                     f"(tiles CONFIG.yml [key=value ...])")
  return (config if flag is None else flag), overrides


def _check_flags(args: argparse.Namespace) -> None:
  """Refuses a flag that would be silently ignored where it is given."""
  flag = lambda name: "--" + name.replace("_", "-")
  if args.config:
    for name, hint in _instead(args).items():
      raise ValueError(f"{flag(name)} does not apply with a config: {hint}")
    return
  for name in ("slice", "layers", "heads", "attention_share"):
    if getattr(args, name) is not None:
      raise ValueError(f"{flag(name)} needs a config to check: tiles CONFIG.yml "
                       f"{flag(name)} ... (e.g. tiles wan_svg.yml)")
  for name in ("chip", "libtpu_init_args"):  # the report's tiles are our kernel's on every chip
    if getattr(args, name) is not None:
      tiles = choose_tiles(chip_target(CHIP, None), "auto")
      raise ValueError(f"{flag(name)} does not apply without a config: the report's tiles are "
                       f"our kernel's, {tiles.block_q}x{tiles.block_kv} on every chip and limit "
                       f"(give --block-q and --block-kv for others); give a config (tiles "
                       f"CONFIG.yml) to check a config's kernel on a chip")
  if args.overrides:
    raise ValueError(f"key=value overrides ({' '.join(args.overrides)}) need a config: tiles "
                     f"CONFIG.yml {' '.join(args.overrides)}")


def run(args: argparse.Namespace) -> int:
  args.config, args.overrides = config_of(args.config, args.config_flag, args.overrides)
  _check_flags(args)
  if args.config:
    return _estimate(args)
  from maxdiffusion_svg.cli.report import format_report, tile_report  # pylint: disable=import-outside-toplevel
  grid = _grid_from_args(args)
  density = DENSITY if args.density is None else args.density
  modes = _MODES if args.mode in (None, MODE) else [args.mode]
  tiles = choose_tiles(chip_target(CHIP, None), "auto", args.block_q, args.block_kv)
  block_q, block_kv = tiles.block_q, tiles.block_kv
  report = tile_report(grid, density, block_q, block_kv, modes, include_sink=not args.no_sink)
  if args.plot:
    from maxdiffusion_svg.cli.plot import plot_tiles  # pylint: disable=import-outside-toplevel
    plot_tiles(args.plot, grid, density, block_q, block_kv, modes,
               include_sink=not args.no_sink)
  _report(args, format_report(report), report)
  if args.plot:
    print(f"tile map written to {args.plot}")
  return 0


def chip_target(chip: str, libtpu_init_args: str | None, source: str = "") -> Target:
  """The chip a ``tiles`` answer is for, under the job's LIBTPU_INIT_ARGS as given (never read
  here from the environment); ``source`` names where they came from in the limit's label.
  ``svg_vmem_limit_kib`` in the config or overrides comes on top."""
  target = tpu_target(generation_named(chip, "--chip"), flags=libtpu_init_args or "")
  if not source:
    return target
  if target.vmem_source == "LIBTPU_INIT_ARGS":  # the flags set the limit
    return dataclasses.replace(target, vmem_source=source)
  return dataclasses.replace(target, vmem_source=f"{target.vmem_source}; {source} sets no "
                                                 f"scoped-VMEM limit")


def job_flags(given: str | None, env: Mapping[str, str]) -> tuple[str | None, str]:
  """The job's LIBTPU_INIT_ARGS and where they come from: ``--libtpu-init-args`` where given,
  else this environment's (a GKE job exports them, and ``tiles`` runs in the job's shell)."""
  if given is not None:
    return given, "--libtpu-init-args"
  if env.get("LIBTPU_INIT_ARGS"):
    return env["LIBTPU_INIT_ARGS"], "LIBTPU_INIT_ARGS from the environment"
  return None, ""


def _estimate(args: argparse.Namespace) -> int:
  """``tiles CONFIG.yml [key=value ...]``: the config's own video, steps and keys."""
  # pylint: disable=import-outside-toplevel
  import jax
  import yaml
  from maxdiffusion_svg.plugin.config_checks import slice_chip
  from maxdiffusion_svg.plugin.estimate import estimate_config
  from maxdiffusion_svg.plugin.estimate_format import format_estimate
  from maxdiffusion_svg.plugin.launcher import check_form, check_overrides
  from maxdiffusion_svg.plugin.overlay import load_config
  # pylint: enable=import-outside-toplevel
  if not os.environ.get("JAX_PLATFORMS"):  # a host-side tool: the Wan 2.2 timesteps on the CPU
    jax.config.update("jax_platforms", "cpu")
  config, chain = load_config(args.config)
  check_form(args.overrides)
  # svg_* keys are left to SvgConfig, which names an unknown one with its own close matches.
  check_overrides(config, [o for o in args.overrides if not o.startswith("svg_")], chain)
  for override in args.overrides:
    key, text = override.split("=", 1)
    config[key] = yaml.safe_load(text)
  target = chip_target(slice_chip(args.slice, args.chip),
                       *job_flags(args.libtpu_init_args, os.environ))
  result = estimate_config(config, target, layers=args.layers, slice_type=args.slice,
                           given_share=args.attention_share, heads=args.heads,
                           path=chain[0])
  _report(args, format_estimate(result), result)
  return 0
