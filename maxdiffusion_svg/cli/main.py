"""``python -m maxdiffusion_svg`` (and the ``maxdiffusion-svg`` script): the command-line tools
(``tiles``, ``bench``, ``compare``, ``calibrate``; each in its own module here, their shared
argument helpers in ``args``) and their parser; ``generate``, ``train`` and ``train-vace`` hand
their arguments, unparsed, to :mod:`maxdiffusion_svg.plugin.launcher`."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
import re
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


PROG = "python -m maxdiffusion_svg"
# The launcher's entries, as subcommands: python -m maxdiffusion_svg generate == ....generate.
LAUNCHED = {"generate": ("GENERATE", "run generation with SVG through MaxDiffusion (as python -m "
                                     "maxdiffusion_svg.generate; --help for its usage)"),
            "train": ("TRAIN", "fine-tune Wan 2.1 with SVG through MaxDiffusion's train_wan (as "
                               "python -m maxdiffusion_svg.train)"),
            "train-vace": ("TRAIN_VACE", "fine-tune Wan VACE with SVG through MaxDiffusion's "
                                         "train_wan_vace (as python -m maxdiffusion_svg.train_vace)")}


def version() -> str:
  """The installed distribution's version, else (a source checkout) pyproject.toml's."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  try:
    return metadata.version("maxdiffusion-svg")
  except metadata.PackageNotFoundError:
    pyproject = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.M)
    return found.group(1) if found else "unknown"


def version_report() -> str:
  """``--version``'s lines: the plugin, MaxDiffusion, the JAX stack, Python, the devices."""
  from maxdiffusion_svg.cli import about  # pylint: disable=import-outside-toplevel
  return about.report(version())


class _Version(argparse.Action):
  """``--version``, computed only when asked for (it starts JAX's backend)."""

  def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
               help=None):  # pylint: disable=redefined-builtin
    super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

  def __call__(self, parser, namespace, values, option_string=None):
    print(version_report())
    parser.exit()


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog=PROG, description="Sparse VideoGen attention for MaxDiffusion: tools.")
  parser.add_argument("--version", action=_Version,
                      help="print the versions a bug report needs (this plugin, MaxDiffusion, "
                           "jax, jaxlib, libtpu, tokamax, flax, Python) and the devices JAX "
                           "sees, and exit")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  for name, (_, what) in LAUNCHED.items():  # listed here; main hands them to the launcher
    sub.add_parser(name, help=what, add_help=False)
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


def launch(command: str, argv: Sequence[str]) -> int:
  """``generate``, ``train`` or ``train-vace``: the launcher's main with ``argv`` as its own
  (``--help`` and ``key=value`` as there), its exit status returned."""
  from maxdiffusion_svg.plugin import launcher  # pylint: disable=import-outside-toplevel
  entry = dataclasses.replace(getattr(launcher, LAUNCHED[command][0]), command=f"{PROG} {command}")
  try:
    launcher.main([sys.argv[0], *argv], entry=entry)
  except SystemExit as done:
    return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
  return 0


@quiet_on_broken_pipe  # `python -m maxdiffusion_svg tiles | head -1` ends quietly
def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv == ["--version"]:  # before the parser, whose subcommands import JAX: never fails
    print(version_report())
    return 0
  if argv and argv[0] in LAUNCHED:  # unparsed: the launcher reads its own arguments
    return launch(argv[0], argv[1:])
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
  except BrokenPipeError:  # quiet_on_broken_pipe's, not a user's mistake
    raise
  except (OSError, ValueError) as err:  # a file that cannot be read or written, a bad value
    print(f"error: {err}", file=sys.stderr)
    return 2
