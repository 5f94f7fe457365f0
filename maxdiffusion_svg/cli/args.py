"""The command line's shared argument helpers (argparse types, the video and ``--json`` flags,
the report printer): a module of their own, so the sub-commands do not import the entry point."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from maxdiffusion_svg.plan.geometry import RESOLUTIONS, VideoGrid, grid_for_resolution
from maxdiffusion_svg.plan.tiles import MODES

_MODES = list(MODES)


def _typed(parse: Callable[[str], Any], ok: Callable[[Any], bool], allowed: str):
  """An argparse type: its errors name the flag the user wrote, and what it allows."""

  def convert(text: str) -> Any:
    try:
      value = parse(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
    if not ok(value):
      raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
    return value

  return convert


_density = _typed(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1] (band density)")
_tile = _typed(int, lambda v: v > 0 and v % 128 == 0, "a positive multiple of 128")


def _latent_grid(text: str) -> VideoGrid:
  parts = text.lower().replace(",", "x").split("x")
  if len(parts) != 3 or not all(p.strip().lstrip("-").isdigit() for p in parts):
    raise ValueError(f"--latent-grid must look like FxHxW (e.g. 21x45x80), got {text!r}")
  return VideoGrid(*(int(p) for p in parts))


def _grid_from_args(args: argparse.Namespace, default: str = "720p") -> VideoGrid:
  pixels = (args.frames, args.height, args.width)
  given = [args.resolution is not None, any(v is not None for v in pixels),
           args.latent_grid is not None]
  if sum(given) > 1:
    raise ValueError("give only one of --resolution, --frames/--height/--width, --latent-grid")
  if args.latent_grid is not None:
    return _latent_grid(args.latent_grid)
  if any(v is not None for v in pixels):
    if any(v is None for v in pixels):
      raise ValueError("--frames, --height and --width must be given together")
    return VideoGrid.for_video(*pixels)
  return grid_for_resolution(args.resolution or default)


def _add_grid_args(parser: argparse.ArgumentParser, default: str = "720p") -> None:
  group = parser.add_argument_group(f"video (default: --resolution {default})")
  group.add_argument("--resolution", help=f"Wan preset, 81 frames: {', '.join(RESOLUTIONS)}")
  group.add_argument("--frames", type=int, help="pixel-space frame count (e.g. 81)")
  group.add_argument("--height", type=int, help="pixel height (e.g. 720)")
  group.add_argument("--width", type=int, help="pixel width (e.g. 1280)")
  group.add_argument("--latent-grid", help="latent token grid FxHxW, e.g. 21x45x80")


def _report(args: argparse.Namespace, text: str, result: dict) -> None:
  """Prints a benchmark's table, and writes its result as JSON where ``--json`` asks."""
  print(text)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=2)


def _add_json_arg(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")


def add_config_args(parser: argparse.ArgumentParser, config_help: str,
                    overrides_help: str) -> None:
  """A generation config and the ``key=value`` overrides after it, as on MaxDiffusion's command
  line (``compare``, ``calibrate``)."""
  parser.add_argument("config", metavar="CONFIG.yml", help=config_help)
  parser.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)


def require_maxdiffusion(command: str) -> None:
  """A command that runs MaxDiffusion's ``generate_wan`` says how to get it, not a stack trace."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec("maxdiffusion") is None:
    raise ValueError(f"{command} runs MaxDiffusion's generate_wan: install its runtime packages "
                     f"and put its source on PYTHONPATH (PYTHONPATH=/path/to/maxdiffusion/src)")


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
  return value


def _progress(message: str) -> None:
  print(message, file=sys.stderr, flush=True)
