"""``python -m maxdiffusion_svg tiles``: the tile report, or with ``--config`` the run's own
pre-flight checks and the estimate for a generation config.

A flag that does not apply where it is given is an error naming what to do instead: with
``--config`` the config's keys set the video, density and tiles, so the report's flags would
be silently beaten by them; without it there is no config for ``--layers``, ``--slice``,
``--attention-share`` or ``key=value`` to act on.
"""

from __future__ import annotations

import argparse
import os

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
      "tiles", help="tile report: what a density and tile size cost per mode; with --config, "
                    "the run's own checks and the estimate for a generation config")
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
                     help=f"with --config: the TPU generation whose tiles and limits to check "
                          f"({', '.join(GENERATIONS)}; --slice implies it) (default: {CHIP})")
  tiles.add_argument("--libtpu-init-args", metavar="FLAGS",
                     help="with --config: the job's LIBTPU_INIT_ARGS (its scoped-VMEM limit "
                          "sets the tiles and the kernel's check; default: the chip's own limit)")
  estimate = tiles.add_argument_group(
      "pre-flight and estimate for a generation config (computed from the tile plan, not "
      "measured)")
  estimate.add_argument("--config", metavar="FILE.yml",
                        help="a MaxDiffusion Wan config (base_config chains merged): the run's "
                             "checks, then its estimate; its video, steps and svg_* keys replace "
                             "the report's options above")
  estimate.add_argument("--slice", metavar="TYPE",
                        help="the TPU slice the job runs on (e.g. v6e-8, v6e-16): also checks "
                             "the mesh the config's ici_*_parallelism builds there against the "
                             "heads; implies --chip")
  estimate.add_argument("--layers", type=_positive,
                        help="transformer layers (default: 30 for a 1.3B checkpoint, else 40)")
  estimate.add_argument("--heads", type=_positive,
                        help="attention heads, which svg_head_densities lists (default: 12 for "
                             "a 1.3B checkpoint, else 40)")
  estimate.add_argument("--attention-share", type=_share, metavar="F",
                        help="self-attention's share of a dense step's time, for the end-to-end "
                             "bound (default: the seed design's 55.5%% at 720p and 88.2%% at "
                             "1440p, interpolated between)")
  estimate.add_argument("overrides", nargs="*", metavar="key=value",
                        help="with --config: keys to change, as on MaxDiffusion's command line")
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
      "plot": "run tiles without --config for the tile map (--resolution, --density)",
  }
  return {name: hint for name, hint in keys.items() if getattr(args, name) not in (None, False)}


def _check_flags(args: argparse.Namespace) -> None:
  """Refuses a flag that would be silently ignored where it is given."""
  flag = lambda name: "--" + name.replace("_", "-")
  if args.config:
    for name, hint in _instead(args).items():
      raise ValueError(f"{flag(name)} does not apply with --config: {hint}")
    return
  for name in ("slice", "layers", "heads", "attention_share"):
    if getattr(args, name) is not None:
      raise ValueError(f"{flag(name)} needs --config (a generation config to check)")
  for name in ("chip", "libtpu_init_args"):  # the report's tiles are our kernel's on every chip
    if getattr(args, name) is not None:
      tiles = choose_tiles(chip_target(CHIP, None), "auto")
      raise ValueError(f"{flag(name)} does not apply without --config: the report's tiles are "
                       f"our kernel's, {tiles.block_q}x{tiles.block_kv} on every chip and limit "
                       f"(give --block-q and --block-kv for others); give --config FILE.yml to "
                       f"check a config's kernel on a chip")
  if args.overrides:
    raise ValueError(f"key=value overrides ({' '.join(args.overrides)}) need --config")


def run(args: argparse.Namespace) -> int:
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


def chip_target(chip: str, libtpu_init_args: str | None) -> Target:
  """The chip a ``tiles`` answer is for, under the job's LIBTPU_INIT_ARGS as given (never this
  host's); ``svg_vmem_limit_kib`` in the config or overrides comes on top."""
  return tpu_target(generation_named(chip, "--chip"), flags=libtpu_init_args or "")


def _estimate(args: argparse.Namespace) -> int:
  """``tiles --config FILE [key=value ...]``: the config's own video, steps and keys."""
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
  target = chip_target(slice_chip(args.slice, args.chip), args.libtpu_init_args)
  result = estimate_config(config, target, layers=args.layers, slice_type=args.slice,
                           given_share=args.attention_share, heads=args.heads,
                           path=chain[0])
  _report(args, format_estimate(result), result)
  return 0
