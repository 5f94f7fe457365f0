"""Configs that hold only their own keys: ``base_config:`` names the YAML they extend.

MaxDiffusion reads one complete YAML (no includes), and a ``key=value`` override must name
a key that YAML already has. A config here names its base instead of copying it; the
chain is merged (later files win, key by key) into one complete YAML before MaxDiffusion
reads it, so overrides then work for every key, ours included. A base is looked up
beside the file naming it, then among the installed MaxDiffusion's configs; a config given by
bare name that is not a file here (``wan_svg.yml``) among the shipped configs, then
MaxDiffusion's. MaxDiffusion itself is not imported: its configs folder is found from the
package's location.
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any, Sequence

import yaml

BASE_KEY = "base_config"
EXAMPLE = "wan_svg.yml"  # a shipped config, for the refusals' examples


def maxdiffusion_config_dirs() -> list[pathlib.Path]:
  """``configs/`` folders of the importable ``maxdiffusion`` package (none if absent)."""
  try:
    spec = importlib.util.find_spec("maxdiffusion")
  except (ImportError, ValueError):
    return []
  locations = spec.submodule_search_locations if spec is not None else None
  return [pathlib.Path(p) / "configs" for p in (locations or [])
          if (pathlib.Path(p) / "configs").is_dir()]


def shipped_config_dir() -> pathlib.Path:
  """The configs shipped with the package: ``maxdiffusion_svg/configs`` in a wheel (setup.py
  puts them there), else the checkout's ``configs/`` (a source tree, an editable install)."""
  package = pathlib.Path(__file__).resolve().parents[1]
  inside = package / "configs"
  return inside if inside.is_dir() else package.parent / "configs"


def find_base(name: str, referrer: pathlib.Path,
              search_dirs: Sequence[pathlib.Path] | None = None) -> pathlib.Path:
  """The file ``name`` refers to from ``referrer``: beside it, then in ``search_dirs``."""
  candidate = pathlib.Path(name)
  if candidate.is_absolute():
    places = [candidate]
  else:
    dirs = maxdiffusion_config_dirs() if search_dirs is None else search_dirs
    places = [referrer.parent / candidate, *(pathlib.Path(d) / candidate for d in dirs)]
  for place in places:
    if place.is_file():
      return place.resolve()
  hint = missing_maxdiffusion_hint() if search_dirs is None and not candidate.is_absolute() else ""
  raise ValueError(f"{referrer}: {BASE_KEY} {name!r} not found; looked in "
                   f"{', '.join(str(p) for p in places)}{hint}")


def missing_maxdiffusion_hint() -> str:
  """Why MaxDiffusion's configs were not searched, when they were not: a base such as
  ``base_wan_14b.yml`` is found only through an importable ``maxdiffusion`` package."""
  try:
    spec = importlib.util.find_spec("maxdiffusion")
  except (ImportError, ValueError):
    spec = None
  if spec is None:
    return ("; MaxDiffusion is not importable here, so its configs were not searched: put its "
            "source on PYTHONPATH (PYTHONPATH=/path/to/maxdiffusion/src) or pip install it")
  if not maxdiffusion_config_dirs():
    places = ", ".join(spec.submodule_search_locations or [str(spec.origin)])
    return (f"; the maxdiffusion package found ({places}) has no configs/ folder: put a "
            f"MaxDiffusion checkout's src on PYTHONPATH")
  return ""


def _read(path: pathlib.Path) -> dict[str, Any]:
  """One file's keys; a file that is not a YAML mapping is named in one line, not a traceback."""
  try:
    with open(path, encoding="utf-8") as f:
      data = yaml.safe_load(f)
  except UnicodeDecodeError:
    raise ValueError(f"{path} is not a config: not UTF-8 text (give a .yml file, e.g. "
                     f"{EXAMPLE})") from None
  except yaml.YAMLError as err:
    mark = getattr(err, "problem_mark", None)
    where = f" line {mark.line + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    raise ValueError(f"{path}{where}: not valid YAML ({problem}); a config is a YAML mapping "
                     f"of keys, e.g. {EXAMPLE}") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ValueError(f"{path}: a config must be a YAML mapping of keys, got "
                     f"{type(data).__name__} (give a .yml file, e.g. {EXAMPLE})")
  return data


def find_config(path: str | pathlib.Path,
                search_dirs: Sequence[pathlib.Path] | None = None) -> pathlib.Path:
  """The file a config argument names: the path as given, else (a bare name) the shipped
  config of that name, else MaxDiffusion's (``search_dirs`` in its place, as for bases)."""
  given = pathlib.Path(path).expanduser()
  if given.is_dir():
    raise ValueError(f"config {path} is a folder: give a .yml file, e.g. {EXAMPLE}")
  if given.is_file():
    return given.resolve()
  places = [given.resolve()]
  # No folder part and a YAML name: a shipped (or MaxDiffusion's) config's, as wan_svg.yml.
  if given.name == str(path) and given.suffix in (".yml", ".yaml"):
    dirs = maxdiffusion_config_dirs() if search_dirs is None else list(search_dirs)
    places += [pathlib.Path(d) / given.name for d in [shipped_config_dir(), *dirs]]
    for place in places[1:]:
      if place.is_file():
        return place.resolve()
  if len(places) > 1:
    hint = missing_maxdiffusion_hint() if search_dirs is None else ""
  else:
    hint = (f"; a bare .yml name (e.g. {EXAMPLE}) is also looked up among the shipped "
            f"configs")
  raise ValueError(f"config file {path} does not exist; looked in "
                   f"{', '.join(str(p) for p in places)}{hint}")


def load_config(path: str | pathlib.Path,
                search_dirs: Sequence[pathlib.Path] | None = None) -> tuple[dict[str, Any], list[str]]:
  """The merged config of ``path`` (:func:`find_config`) and its chain of bases, and the
  chain (file first)."""
  chain: list[pathlib.Path] = []
  current = find_config(path, search_dirs)
  layers = []
  while True:
    if current in chain:
      cycle = " -> ".join(str(p) for p in [*chain[chain.index(current):], current])
      raise ValueError(f"{BASE_KEY} cycle: {cycle}")
    chain.append(current)
    data = _read(current)
    base = data.pop(BASE_KEY, None)
    layers.append(data)
    if base is None:
      break
    if not isinstance(base, str) or not base:
      raise ValueError(f"{current}: {BASE_KEY} must be a file name, got {base!r}")
    current = find_base(base, current, search_dirs)
  merged: dict[str, Any] = {}
  for layer in reversed(layers):  # the base first, each file over it
    merged.update(layer)
  return merged, [str(p) for p in chain]


def write_config(config: dict[str, Any], path: str | pathlib.Path) -> str:
  """Writes a complete (merged) config where MaxDiffusion's ``pyconfig`` can read it."""
  with open(path, "w", encoding="utf-8") as f:
    yaml.safe_dump(config, f, sort_keys=False)
  return str(path)
