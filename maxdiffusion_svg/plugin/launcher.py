"""``python -m maxdiffusion_svg.generate CONFIG [key=value ...]``: Wan generation with SVG, on
an unmodified MaxDiffusion.

Merges the config's ``base_config`` chain into one complete YAML (in a temporary folder,
kept for the run) over every ``svg_*`` key's default, registers the plugin, and runs MaxDiffusion's ``generate_wan`` main the
way its own ``__main__`` does. The SVG summary line is logged when each transformer is built.
"""

from __future__ import annotations

import difflib
import os
import sys
import tempfile
from typing import Any, Mapping, Sequence

from maxdiffusion_svg.plugin import overlay, preflight
from maxdiffusion_svg.plugin.settings import config_defaults


def checked_config(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
  """The merged config of ``[prog, config.yml, *overrides]`` over every ``svg_*`` default, and
  its chain of files, after checking the overrides and the run name against it."""
  if len(argv) < 2 or "=" in argv[1]:
    raise ValueError("usage: python -m maxdiffusion_svg.generate CONFIG.yml [key=value ...]")
  config, chain = overlay.load_config(argv[1])
  config = {**config_defaults(), **config}  # every svg_* key, so each can be overridden
  check_overrides(config, argv[2:], chain)
  check_run_name(config, argv[2:])
  return config, chain


def prepare_argv(argv: Sequence[str], directory: str) -> tuple[list[str], list[str]]:
  """``[prog, merged.yml, *overrides]`` for MaxDiffusion from ``[prog, config.yml, *overrides]``,
  and the chain of config files merged."""
  config, chain = checked_config(argv)
  merged = overlay.write_config(config, f"{directory}/merged_config.yml")
  return [argv[0], merged, *argv[2:]], chain


def check_overrides(config: Mapping[str, Any], overrides: Sequence[str],
                    chain: Sequence[str]) -> None:
  """MaxDiffusion overrides only keys its config holds; say so here, naming the key and its
  closest matches, instead of its stack trace after the plugin has registered."""
  for item in overrides:
    key = item.split("=", 1)[0]
    if "=" in item and key not in config:
      close = difflib.get_close_matches(key, list(config), n=3)
      hint = f"; did you mean {' or '.join(close)}?" if close else ""
      raise ValueError(
          f"{item}: {key} is not a key of the config ({' -> '.join(chain)}) nor an svg_* key; "
          f"MaxDiffusion overrides only keys its config holds{hint}")


def check_run_name(config: Mapping[str, Any], overrides: Sequence[str],
                   env: Mapping[str, str] | None = None) -> None:
  """:func:`preflight.check_run_name` on the merged keys, before anything loads (MaxDiffusion
  takes an empty ``run_name`` from ``JOBSET_NAME``, which XPK sets and our JobSets pass)."""
  env = os.environ if env is None else env
  keys = {**config, **dict(o.split("=", 1) for o in overrides if "=" in o)}
  preflight.check_run_name(str(keys.get("output_dir") or ""),
                           str(keys.get("run_name") or env.get("JOBSET_NAME") or ""))


def run(argv: Sequence[str]) -> None:
  """Everything ``main`` does but the absl app wrapper (which exits): for tests and scripts."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion import generate_wan, max_logging

  from maxdiffusion_svg import plugin
  # pylint: enable=import-outside-toplevel
  plugin.register()
  with tempfile.TemporaryDirectory(prefix="maxdiffusion_svg_") as directory:
    maxdiffusion_argv, chain = prepare_argv(argv, directory)
    max_logging.log(f"maxdiffusion_svg: config {' -> '.join(chain)} merged into "
                    f"{maxdiffusion_argv[1]}")
    generate_wan.main(maxdiffusion_argv)


def main(argv: Sequence[str] | None = None) -> None:
  try:
    # pylint: disable=import-outside-toplevel
    from absl import app
    from maxdiffusion.train_utils import transformer_engine_context
    # pylint: enable=import-outside-toplevel
  except ImportError as err:
    print(f"error: MaxDiffusion is not importable ({err}); install its runtime packages and put "
          f"its source on PYTHONPATH (PYTHONPATH=/path/to/maxdiffusion/src), then run "
          f"python -m maxdiffusion_svg.generate CONFIG.yml [key=value ...] again", file=sys.stderr)
    sys.exit(2)
  argv = list(sys.argv if argv is None else argv)
  try:  # the config, the overrides and the run name, checked before MaxDiffusion starts
    checked_config(argv)
  except (OSError, ValueError) as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
  with transformer_engine_context():
    app.run(run, argv=argv)
