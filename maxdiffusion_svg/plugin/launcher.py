"""``python -m maxdiffusion_svg.generate CONFIG [key=value ...]``: Wan, Wan VACE, Wan Animate or
LTX-2 generation with SVG, on an unmodified MaxDiffusion; ``python -m maxdiffusion_svg.train
...``: its Wan 2.1 trainer.

Merges the config's ``base_config`` chain into one complete YAML (in a temporary folder,
kept for the run) over every ``svg_*`` key's default, registers the plugin, and runs the model's
generate main the way its own ``__main__`` does: MaxDiffusion's ``generate_wan``,
``generate_wan_animate`` or ``generate_ltx2``, or ours for Wan VACE (:mod:`generate_vace`, over
MaxDiffusion's VACE pipeline); ``train_wan``'s for training, after the training checks of
:mod:`training`. The SVG summary line is logged when each transformer is built.
Before any of that (and before MaxDiffusion or JAX is imported, for ``--help`` and the form of
the arguments) every mistake it can see is refused in one line with exit status 2.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence

from maxdiffusion_svg.plugin.brokenpipe import quiet_on_broken_pipe
# JAX comes with the settings (imported where used), so that --help answers at once.
from maxdiffusion_svg.plugin import overlay, preflight, quiet
from maxdiffusion_svg.plugin.vace_inputs import VaceInputs
from maxdiffusion_svg.plugin.video_models import WAN_VACE, video_model


VERBOSE = "--verbose"  # a generation's MaxDiffusion output on the terminal, not in a log file


@dataclasses.dataclass(frozen=True)
class Entry:
  """A MaxDiffusion main the launcher runs: generation or training."""

  name: str  # our module: python -m maxdiffusion_svg.<name>
  maxdiffusion_main: str  # for training: MaxDiffusion's module whose main it runs
  what: str  # the help's first sentence
  example: str  # a shipped config
  training: bool = False
  command: str = ""  # how the user runs it (default: python -m maxdiffusion_svg.<name>)

  @property
  def invocation(self) -> str:
    return self.command or f"python -m maxdiffusion_svg.{self.name}"

  @property
  def starts(self) -> str:
    return (self.maxdiffusion_main if self.training
            else "the model's generate main (generate_wan, generate_wan_animate, "
                 "generate_ltx2; for Wan VACE, maxdiffusion_svg's generate_vace over "
                 "MaxDiffusion's VACE pipeline)")

  @property
  def usage_line(self) -> str:
    return f"usage: {self.invocation} CONFIG.yml [key=value ...]"

  def help_parser(self) -> argparse.ArgumentParser:
    """The ``--help`` of the other subcommands' shape. Only for the help: ``main`` reads the
    arguments itself, so every ``key=value`` reaches MaxDiffusion as written."""
    parser = argparse.ArgumentParser(
        prog=self.invocation,
        description=f"{self.what}. On an unmodified MaxDiffusion it merges CONFIG.yml's "
                    f"base_config chain into one YAML over every svg_* key's default, checks "
                    f"the overrides, registers the plugin and starts {self.starts}.",
        epilog=f"Keys: docs/reference.md (\"Config keys\"); guide: "
               f"docs/{'fine-tuning' if self.training else 'getting-started'}.md.")
    parser.add_argument("config", metavar="CONFIG.yml",
                        help=f"a config, e.g. {self.example}; a bare name that is not a file "
                             f"here is one of the shipped configs (then MaxDiffusion's); its "
                             f"base_config is looked up beside it, then among the installed "
                             f"MaxDiffusion's configs (PYTHONPATH=/path/to/maxdiffusion/src)")
    if not self.training:
      parser.add_argument(VERBOSE, action="store_true",
                          help=f"print what MaxDiffusion prints (its config dump, its logs) as it "
                               f"runs; by default it goes to {quiet.LOG_NAME} in the run's "
                               f"folder (output_dir/run_name; a gs:// output_dir keeps it on "
                               f"the terminal) and only this plugin's lines are printed")
    example = "max_train_steps=100" if self.training else "num_inference_steps=30"
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help=f"overrides any key of the merged config, MaxDiffusion's or svg_* "
                             f"(e.g. {example} svg_density=0.25), typed as MaxDiffusion types "
                             f"it")
    return parser

  @property
  def usage(self) -> str:
    return self.help_parser().format_help().rstrip("\n")


GENERATE = Entry("generate", "generate_wan",
                 "Runs Wan, Wan VACE, Wan Animate or LTX-2 generation (by the config's "
                 "model_name and inputs) with Sparse VideoGen attention (attention: svg)",
                 "configs/wan_svg.yml")
TRAIN = Entry("train", "train_wan",
              "Fine-tunes Wan 2.1 with MaxDiffusion's own trainer (train_wan) and Sparse "
              "VideoGen attention (attention: svg): every training step sparse in "
              "svg_active_layers",
              "configs/wan_svg_train.yml", training=True)
TRAIN_VACE = Entry("train_vace", "train_wan_vace",
                   "Fine-tunes Wan VACE with MaxDiffusion's own trainer (train_wan_vace) and "
                   "Sparse VideoGen attention (attention: svg) in the main blocks: every "
                   "training step sparse in svg_active_layers", "configs/wan_vace_svg_train.yml",
                   training=True)
USAGE_LINE, USAGE = GENERATE.usage_line, GENERATE.usage
HELP = ("-h", "--help")


def split_verbose(argv: Sequence[str], entry: Entry = GENERATE) -> tuple[list[str], bool]:
  """``argv`` without ``--verbose`` (anywhere after the program), and whether it was there;
  a training entry takes no ``--verbose`` (its output is always on the terminal)."""
  if entry.training:
    return list(argv), False
  rest = [argv[0], *(a for a in argv[1:] if a != VERBOSE)] if argv else []
  return rest, len(rest) != len(argv)


def quiet_log(config: Mapping[str, Any], overrides: Sequence[str],
              env: Mapping[str, str] | None = None) -> str | None:
  """Where a quiet generation run's MaxDiffusion output goes: ``maxdiffusion.log`` in
  ``output_dir/run_name`` (the run's keys: the config's, the overrides', ``run_name`` empty:
  ``JOBSET_NAME``, as MaxDiffusion takes it); None for a ``gs://`` output_dir."""
  env = os.environ if env is None else env
  keys = with_overrides(config, overrides)
  path = quiet.log_path(str(keys.get("output_dir") or ""),
                        str(keys.get("run_name") or env.get("JOBSET_NAME") or ""))
  return None if path is None else str(path)


def checked_config(argv: Sequence[str], entry: Entry = GENERATE) -> tuple[dict[str, Any], list[str]]:
  """The merged config of ``[prog, config.yml, *overrides]`` over every ``svg_*`` default, and
  its chain of files, after checking the overrides (form, key, value) and the run name (and for
  training, :func:`training.check_training`)."""
  if len(argv) < 2 or "=" in argv[1]:
    raise ValueError(entry.usage_line)
  if argv[1].startswith("-"):
    options = "-h, --help" if entry.training else f"-h, --help, {VERBOSE}"
    raise ValueError(f"{argv[1]} is not an option of the launcher (only {options}); "
                     f"{entry.usage_line}")
  check_form(argv[2:])
  from maxdiffusion_svg.budgets.schedule import check_preset_overrides  # pylint: disable=import-outside-toplevel
  check_preset_overrides(argv[2:])  # a typo'd preset named at once, before the config loads
  from maxdiffusion_svg.plugin.settings import config_defaults  # pylint: disable=import-outside-toplevel
  config, chain = overlay.load_config(argv[1])
  config = {**config_defaults(), **config}  # every svg_* key, so each can be overridden
  check_overrides(config, argv[2:], chain)
  check_values(config, argv[2:])
  check_run_name(config, argv[2:])
  keys = with_overrides(config, argv[2:])  # what the run will read
  from maxdiffusion_svg.plugin.config_checks import check_before_weights  # pylint: disable=import-outside-toplevel
  if entry.training:
    from maxdiffusion_svg.plugin.training import check_training  # pylint: disable=import-outside-toplevel
    check_training(keys)
  # (a Hub checkpoint's shape not in the cache: the run's own check reads it, before weights)
  check_before_weights(keys, path=argv[1], training=entry.training, by_name=False)
  if not entry.training and video_model(keys) is WAN_VACE:
    VaceInputs.from_mapping(keys)  # the files, before loading
  return config, chain


def maxdiffusion_main(config: Mapping[str, Any], entry: Entry) -> str:
  """The module whose main runs ``config``: the model family's generate main
  (``maxdiffusion.generate_wan``, ..., ``maxdiffusion_svg.plugin.generate_vace``), or the
  entry's own MaxDiffusion trainer."""
  if entry.training:
    return f"maxdiffusion.{entry.maxdiffusion_main}"
  return video_model(config).generate_module


def check_form(overrides: Sequence[str]) -> None:
  """MaxDiffusion splits each word after the config at its first ``=``; a word without one
  fails there in a stack trace."""
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"overrides are key=value, got {item!r}")


def parse_override(key: str, text: str, config: Mapping[str, Any]) -> Any:
  """``key=text`` typed as MaxDiffusion's ``pyconfig`` types it: like the config's value (an
  integer, a number, ``true``/``false``, a Python list literal, a JSON mapping), text as given.
  A value it cannot type is named here, with what the key takes."""
  current = config[key]
  kind = type(current)
  if isinstance(current, dict):
    try:
      value = json.loads(text)
    except ValueError:
      value = None
    if isinstance(value, dict):
      return value
    example = json.dumps(dict(list(current.items())[:1]))  # the config's first entry
    raise ValueError(f"{key}={text}: MaxDiffusion reads {key} as a JSON mapping (the config "
                     f"holds one), e.g. {key}='{example}'")
  parsers = {str: str, int: int, float: float, bool: _bool, list: ast.literal_eval}
  if kind not in parsers:
    raise ValueError(f"{key}={text}: {key} is {current!r} in the config, and MaxDiffusion "
                     f"overrides only a text, integer, number, true/false, list or mapping "
                     f"from the command line; set {key} in a config instead")
  try:
    return parsers[kind](text)
  except (ValueError, SyntaxError, TypeError):
    what = {int: "an integer", float: "a number", bool: "true or false",
            list: "a list, e.g. [1, 2]"}[kind]
    raise ValueError(f"{key}={text}: MaxDiffusion reads {key} as {what} (the config holds "
                     f"{current!r})") from None


def _bool(text: str) -> bool:
  """``pyconfig``'s own rule: ``true`` or ``false``, any case."""
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  raise ValueError(text)


def check_values(config: Mapping[str, Any], overrides: Sequence[str]) -> None:
  """Every override typed as MaxDiffusion will type it, then every ``svg_*`` value checked as
  the plugin checks it when a transformer is built (its errors name the key and what it
  allows), so that a bad value stops here and not after MaxDiffusion has started."""
  from maxdiffusion_svg.plugin.settings import PluginSettings  # pylint: disable=import-outside-toplevel
  PluginSettings.from_mapping(with_overrides(config, overrides))


def with_overrides(config: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
  """The config with each ``key=value`` typed as MaxDiffusion will type it."""
  keys = dict(config)
  for item in overrides:
    key, text = item.split("=", 1)
    keys[key] = parse_override(key, text, config)
  return keys


def prepare_argv(argv: Sequence[str], directory: str,
                 entry: Entry = GENERATE) -> tuple[list[str], list[str]]:
  """``[prog, merged.yml, *overrides]`` for MaxDiffusion from ``[prog, config.yml, *overrides]``,
  and the chain of config files merged."""
  config, chain = checked_config(argv, entry)
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


def run(argv: Sequence[str], entry: Entry = GENERATE) -> None:
  """Everything ``main`` does but the absl app wrapper (which exits): for tests and scripts."""
  # pylint: disable=import-outside-toplevel
  import importlib

  from maxdiffusion import max_logging

  from maxdiffusion_svg import plugin
  # pylint: enable=import-outside-toplevel
  plugin.register()
  with tempfile.TemporaryDirectory(prefix="maxdiffusion_svg_") as directory:
    config, _ = checked_config(argv, entry)
    main = maxdiffusion_main(with_overrides(config, argv[2:]), entry)
    maxdiffusion_argv, chain = prepare_argv(argv, directory, entry)
    max_logging.log(f"maxdiffusion_svg: config {' -> '.join(chain)} merged into "
                    f"{maxdiffusion_argv[1]}; running {main}")
    importlib.import_module(main).main(maxdiffusion_argv)


@quiet_on_broken_pipe  # `... | head` ends quietly, whatever MaxDiffusion prints
def main(argv: Sequence[str] | None = None, entry: Entry = GENERATE) -> None:
  argv, verbose = split_verbose(list(sys.argv if argv is None else argv), entry)
  if any(a in HELP for a in argv[1:]):
    print(entry.usage)
    sys.exit(0)
  if len(argv) < 2:
    print(entry.usage, file=sys.stderr)
    sys.exit(2)
  try:  # the config, the overrides and the run name, checked before MaxDiffusion starts
    config, _ = checked_config(argv, entry)
  except (OSError, ValueError) as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
  log = None if verbose or entry.training else quiet_log(config, argv[2:])
  if log is not None:
    try:
      pathlib.Path(log).parent.mkdir(parents=True, exist_ok=True)
      pathlib.Path(log).touch()
    except OSError as err:
      print(f"error: output_dir: cannot write {log} ({err.strerror}); give output_dir= a "
            f"writable folder, or {VERBOSE} to keep MaxDiffusion's output on the terminal",
            file=sys.stderr)
      sys.exit(2)
  quiet.calm_child_processes()
  started = time.time()
  # quiet from here: importing MaxDiffusion already prints (TensorFlow's C++ logs)
  with quiet.to_log(None if log is None else pathlib.Path(log)) as terminal:
    try:
      # pylint: disable=import-outside-toplevel
      from absl import app
      from maxdiffusion.train_utils import transformer_engine_context
      # pylint: enable=import-outside-toplevel
    except ImportError as err:
      print(f"error: MaxDiffusion is not importable ({err}); install its runtime packages and "
            f"put its source on PYTHONPATH (PYTHONPATH=/path/to/maxdiffusion/src), then run "
            f"{entry.invocation} CONFIG.yml [key=value ...] again",
            file=sys.stderr)
      sys.exit(2)
    if log is not None:
      print(f"{entry.name}: MaxDiffusion's output (its config dump, its logs) goes to {log} "
            f"({VERBOSE} prints it here)", file=terminal.out, flush=True)

    def generation(maxdiffusion_argv: list[str]) -> None:
      refusing(run, maxdiffusion_argv, entry)
      if log is not None:
        print(written_line(entry, started), file=terminal.out, flush=True)

    with transformer_engine_context():
      app.run(generation, argv=argv)


def written_line(entry: Entry, since: float, folder: str = ".") -> str:
  """The last line of a quiet generation: the videos the main wrote into ``folder`` (the
  working directory, where MaxDiffusion's mains write them) since ``since``."""
  videos = sorted(p.name for p in pathlib.Path(folder).glob("*.mp4")
                  if p.stat().st_mtime >= since)
  where = os.path.abspath(folder)
  if not videos:
    return f"{entry.name}: done; no new video in {where}"
  return f"{entry.name}: done; {', '.join(videos)} in {where}"


def refusing(main_run: Any, *args: Any) -> None:
  """``main_run(*args)``, where a :class:`preflight.Refusal` (the run's checks before weights
  load, in every process) is one line and exit status 2, not a stack trace."""
  try:
    main_run(*args)
  except preflight.Refusal as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
