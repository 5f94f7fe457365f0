"""``python -m maxdiffusion_svg``: the command-line tools (``tiles``, ``bench``, ``compare``; each
in its own ``cli_*`` module) and what their parsers share."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from typing import Any, Callable, Sequence

from maxdiffusion_svg.brokenpipe import quiet_on_broken_pipe
from maxdiffusion_svg.geometry import RESOLUTIONS, VideoGrid, grid_for_resolution
from maxdiffusion_svg.tiles import MODES

_MODES = list(MODES)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
  """Every default in ``--help``, except the empty ones (no value, an unset switch)."""

  def _get_help_string(self, action):
    if action.default in (None, False, argparse.SUPPRESS):
      return action.help
    return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
  """Shows every default in ``--help``; an unknown flag is answered with the close matches."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", _Help)
    super().__init__(*args, **kwargs)

  def parse_known_args(self, args=None, namespace=None):
    parsed, extra = super().parse_known_args(args, namespace)
    flags = [a for a in extra if a.startswith("-")]
    if flags:
      options = [o for action in self._all_actions() for o in action.option_strings]
      hints = []
      for flag in flags:
        close = difflib.get_close_matches(flag.split("=", 1)[0], options, n=3)
        hints.append(f"{flag}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
      self.error(f"unrecognized arguments: {', '.join(hints)}")
    return parsed, extra

  def _all_actions(self):
    actions = list(self._actions)
    for action in self._actions:
      if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
        for sub in action.choices.values():
          actions += sub._actions  # pylint: disable=protected-access
    return actions


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


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="python -m maxdiffusion_svg",
                   description="Sparse VideoGen attention for MaxDiffusion: tools.")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  from maxdiffusion_svg import cli_tiles  # pylint: disable=import-outside-toplevel
  cli_tiles.add_parser(sub)

  from maxdiffusion_svg import cli_bench  # pylint: disable=import-outside-toplevel
  cli_bench.add_parser(sub)

  from maxdiffusion_svg import cli_compare  # pylint: disable=import-outside-toplevel
  cli_compare.add_parser(sub)
  return parser


@quiet_on_broken_pipe  # `python -m maxdiffusion_svg tiles | head -1` ends quietly
def main(argv: Sequence[str] | None = None) -> int:
  parser = build_parser()
  try:
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow the flags (argparse takes positionals in one run only).
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
        "=" in e and not e.startswith("-") for e in extra):
      args.overrides += extra
    elif extra:
      parser.error(f"unrecognized arguments: {' '.join(extra)}")
  except SystemExit as done:  # --help, or a bad flag that argparse has already explained
    return done.code if isinstance(done.code, int) else 2
  try:
    return args.run(args)
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
