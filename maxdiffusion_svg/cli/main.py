"""``python -m maxdiffusion_svg``: the command-line tools (``tiles``, ``bench``, ``compare``; each
in its own ``cli_*`` module, their shared argument helpers in ``cli_args``) and their parser."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Sequence

from maxdiffusion_svg.plugin.brokenpipe import quiet_on_broken_pipe


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


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="python -m maxdiffusion_svg",
                   description="Sparse VideoGen attention for MaxDiffusion: tools.")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  from maxdiffusion_svg.cli import tiles as cli_tiles  # pylint: disable=import-outside-toplevel
  cli_tiles.add_parser(sub)

  from maxdiffusion_svg.cli import bench as cli_bench  # pylint: disable=import-outside-toplevel
  cli_bench.add_parser(sub)

  from maxdiffusion_svg.cli import compare as cli_compare  # pylint: disable=import-outside-toplevel
  cli_compare.add_parser(sub)

  from maxdiffusion_svg.cli import calibrate as cli_calibrate  # pylint: disable=import-outside-toplevel
  cli_calibrate.add_parser(sub)
  from maxdiffusion_svg.cli import tiny_checkpoint as cli_tiny  # pylint: disable=import-outside-toplevel
  cli_tiny.add_parser(sub)
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
