"""``python -m maxdiffusion_svg --version``: what a bug report needs, one line each.

The plugin, MaxDiffusion (found, never imported: importing it loads torch and its models), the
JAX stack, Python and the devices JAX sees. Versions come from the installed distributions'
metadata, so a missing or broken package is a line saying so, never a stack trace.
"""

from __future__ import annotations

import collections
import importlib.util
import pathlib
import re
import sys
from importlib import metadata

from maxdiffusion_svg.plugin.contract import TESTED_COMMIT  # stdlib only: no JAX, no MaxDiffusion

# The line's name -> the distributions that may provide it (libtpu was libtpu-nightly before).
PACKAGES: dict[str, tuple[str, ...]] = {"jax": ("jax",), "jaxlib": ("jaxlib",),
                                        "libtpu": ("libtpu", "libtpu-nightly"),
                                        "tokamax": ("tokamax",), "flax": ("flax",)}
_SHA = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


def git_commit(tree: pathlib.Path) -> str | None:
  """The commit checked out in ``tree`` (a folder holding ``.git``), read from git's own files
  (no ``git`` needed: a TPU VM may lack it); ``None`` where anything is unreadable."""
  try:
    git = tree / ".git"
    if git.is_file():  # a worktree or submodule: "gitdir: PATH"
      text = git.read_text(encoding="utf-8").strip()
      if not text.startswith("gitdir:"):
        return None
      git = (tree / text.removeprefix("gitdir:").strip()).resolve()
    head = (git / "HEAD").read_text(encoding="utf-8").strip()
    if not head.startswith("ref:"):  # a detached HEAD holds the commit itself
      return head if _SHA.fullmatch(head) else None
    ref = head.removeprefix("ref:").strip()
    common = git / "commondir"  # a worktree's branches live in the main repository
    bases = [git] + ([(git / common.read_text(encoding="utf-8").strip()).resolve()]
                     if common.is_file() else [])
    for base in bases:
      loose = base / ref
      if loose.is_file():
        sha = loose.read_text(encoding="utf-8").strip()
        return sha if _SHA.fullmatch(sha) else None
      packed = base / "packed-refs"
      if packed.is_file():
        for line in packed.read_text(encoding="utf-8").splitlines():
          sha, _, name = line.partition(" ")
          if name == ref and _SHA.fullmatch(sha):
            return sha
    return None
  except (OSError, UnicodeDecodeError):
    return None


def checkout_commit(package_dir: pathlib.Path, levels: int = 3) -> str | None:
  """The commit of the git checkout holding ``package_dir`` (``src/NAME`` or ``NAME`` at its
  root), looked for ``levels`` folders up; ``None`` outside one."""
  for tree in [package_dir, *package_dir.parents][:levels]:
    if (tree / ".git").exists():
      return git_commit(tree)
  return None


def distribution_version(*names: str) -> str | None:
  """The first installed distribution's version among ``names``."""
  for name in names:
    try:
      return metadata.version(name)
    except (metadata.PackageNotFoundError, ValueError):
      continue
  return None


def _package_dir(module: str) -> pathlib.Path | None:
  """Where ``module`` would be imported from, without importing it (a top-level name's
  ``find_spec`` runs no code of the package)."""
  try:
    spec = importlib.util.find_spec(module)
  except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
    return None
  if spec is None:
    return None
  if spec.submodule_search_locations:
    return pathlib.Path(list(spec.submodule_search_locations)[0])
  return pathlib.Path(spec.origin).parent if spec.origin else None


def plugin_line(version: str) -> str:
  """``maxdiffusion-svg VERSION``, with the commit where it runs from a git checkout."""
  commit = checkout_commit(pathlib.Path(__file__).resolve().parents[1])
  return f"maxdiffusion-svg {version}" + (f" (checkout at commit {commit[:12]})" if commit else "")


def maxdiffusion_line(tested: str) -> str:
  """MaxDiffusion's version and/or the commit of the source tree used in place, and where it
  is; ``not importable`` where Python cannot find it."""
  package = _package_dir("maxdiffusion")
  if package is None:
    return (f"maxdiffusion: not importable (install it, or PYTHONPATH=/path/to/maxdiffusion/src; "
            f"tested with {tested})")
  found = [f"version {v}" for v in [distribution_version("maxdiffusion")] if v]
  found += [f"commit {c[:12]}" for c in [checkout_commit(package)] if c]
  what = ", ".join(found) or "a source tree with no version or git commit"
  return f"maxdiffusion: {what} at {package} (tested with {tested})"


def package_line(name: str, distributions: tuple[str, ...]) -> str:
  """``NAME: VERSION``, or ``none`` where no distribution provides it."""
  found = distribution_version(*distributions)
  if found is not None:
    return f"{name}: {found}"
  where = _package_dir(name)  # e.g. a source tree on PYTHONPATH
  return f"{name}: importable from {where}, no installed version" if where else f"{name}: none"


def device_kinds(kinds: list[str]) -> str:
  """``cpu x8``, ``TPU v5 lite x8``: each kind JAX reports and how many, in its order."""
  return ", ".join(f"{kind} x{count}" for kind, count in collections.Counter(kinds).items())


def devices_line() -> str:
  """The devices JAX sees (initialising its backend: JAX_PLATFORMS decides which)."""
  try:
    import jax  # pylint: disable=import-outside-toplevel
  except ImportError as err:
    return f"devices: none (jax is not importable: {err})"
  try:
    kinds = [d.device_kind for d in jax.devices()]
  except Exception as err:  # pylint: disable=broad-exception-caught  # a report never crashes
    reason = (str(err).strip().splitlines() or [""])[0][:200]
    return f"devices: none ({type(err).__name__}: {reason})"
  return f"devices: {device_kinds(kinds) or 'none'}"


def report(version: str) -> str:
  """Every line of ``--version``."""
  return "\n".join([plugin_line(version), maxdiffusion_line(TESTED_COMMIT),
                    *(package_line(name, dists) for name, dists in PACKAGES.items()),
                    f"python: {sys.version.split()[0]} ({sys.executable})", devices_line()])
