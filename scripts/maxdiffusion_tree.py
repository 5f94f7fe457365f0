#!/usr/bin/env python3
"""The MaxDiffusion source tree the integration tests run against: found, unpacked, checked.

MaxDiffusion is not on PyPI, so the tests use a source tree in place. CI gets it as an archive
of the tested commit (``../shared/maxdiffusion/maxdiffusion-<commit>.tar.gz``); a developer
passes a checkout. Either way the tree must be the tested commit: a tree without ``.git`` is
identified by a digest of its ``src/maxdiffusion`` files, recorded here for that commit.

  maxdiffusion_tree.py unpack ARCHIVE DEST   # extract, check; prints the tree's path
                                            # (ARCHIVE: a .tar.gz, or a folder holding
                                            # maxdiffusion-<tested commit>.tar.gz)
  maxdiffusion_tree.py check TREE            # exit 1, one line, if TREE is another commit
  maxdiffusion_tree.py digest TREE           # print the digest (to record a new commit)

Every failure is one line on stderr naming what is wrong (missing, corrupt, other commit).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile

TESTED_COMMIT = "7cfb8801d41d"  # also maxdiffusion_svg.plugin.contract.TESTED_COMMIT
# sha256 over "path\0sha256(file)\n" for every file under src/maxdiffusion at TESTED_COMMIT
# (bytecode caches excluded), paths relative to src/ and sorted.
TESTED_DIGEST = "e1938653898c9d20524380b51e7a088a71d5d481304201e9a2e842018de57b56"
# A developer testing another MaxDiffusion on purpose sets this to 1.
ANY_COMMIT_ENV = "MAXDIFFUSION_ANY_COMMIT"


class TreeError(Exception):
  """What is wrong with the archive or the tree, in one line."""


def source_digest(tree: pathlib.Path) -> str:
  src = tree / "src"
  package = src / "maxdiffusion"
  if not package.is_dir():
    raise TreeError(f"{tree} is not a MaxDiffusion source tree (no src/maxdiffusion)")
  total = hashlib.sha256()
  files = sorted(p for p in package.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
  for path in files:
    total.update(f"{path.relative_to(src).as_posix()}\0".encode())
    total.update(hashlib.sha256(path.read_bytes()).hexdigest().encode() + b"\n")
  return total.hexdigest()


def git_commit(tree: pathlib.Path) -> str | None:
  if not (tree / ".git").exists():
    return None
  done = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                        text=True, check=False)
  return done.stdout.strip() if done.returncode == 0 else None


def check_tree(tree: pathlib.Path) -> None:
  """Raises :class:`TreeError` unless ``tree`` is MaxDiffusion at the tested commit."""
  digest = source_digest(tree)
  if digest == TESTED_DIGEST or os.environ.get(ANY_COMMIT_ENV) == "1":
    return
  commit = git_commit(tree)
  if commit is not None and commit.startswith(TESTED_COMMIT):
    raise TreeError(f"{tree} is checked out at {TESTED_COMMIT} but its src/maxdiffusion has "
                    f"local changes (source digest {digest[:12]}, expected {TESTED_DIGEST[:12]})")
  found = f"commit {commit[:12]}" if commit else f"source digest {digest[:12]}"
  raise TreeError(f"{tree} is not MaxDiffusion {TESTED_COMMIT}, the commit the plugin is tested "
                  f"with ({found}, expected {TESTED_DIGEST[:12]}); use that commit, or set "
                  f"{ANY_COMMIT_ENV}=1 to test another on purpose")


def unpack(archive: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
  """Extracts ``archive`` (or the tested commit's archive in that folder) into ``dest`` and
  returns the checked tree inside it."""
  if archive.is_dir():
    folder, archive = archive, archive / f"maxdiffusion-{TESTED_COMMIT}.tar.gz"
    if not archive.is_file():
      found = sorted(p.name for p in folder.glob("*.tar.gz"))
      raise TreeError(f"MaxDiffusion archive missing: no {archive.name} in {folder} (found: "
                      f"{', '.join(found) or 'no archive'})")
  if not archive.is_file():
    raise TreeError(f"MaxDiffusion archive missing: {archive} does not exist")
  try:
    with tarfile.open(archive, "r:gz") as tar:
      names = tar.getnames()
      tops = {n.split("/", 1)[0] for n in names}
      if len(tops) != 1 or not any(n.endswith("/src/maxdiffusion/pyconfig.py") for n in names):
        raise TreeError(f"MaxDiffusion archive {archive} does not hold one MaxDiffusion source "
                        f"tree (top-level entries: {sorted(tops)[:5]})")
      tar.extractall(dest, filter="data")
  except (tarfile.TarError, EOFError, OSError, ValueError) as err:
    raise TreeError(f"MaxDiffusion archive {archive} is corrupt ({type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else 'unreadable'})") from None
  tree = dest / tops.pop()
  check_tree(tree)
  return tree


def main(argv: list[str]) -> int:
  usage = "usage: maxdiffusion_tree.py unpack ARCHIVE DEST | check TREE | digest TREE"
  try:
    if len(argv) == 3 and argv[0] == "unpack":
      print(unpack(pathlib.Path(argv[1]), pathlib.Path(argv[2])))
    elif len(argv) == 2 and argv[0] == "check":
      check_tree(pathlib.Path(argv[1]))
      print(f"{argv[1]}: MaxDiffusion {TESTED_COMMIT}")
    elif len(argv) == 2 and argv[0] == "digest":
      print(source_digest(pathlib.Path(argv[1])))
    else:
      print(usage, file=sys.stderr)
      return 2
  except TreeError as err:
    print(f"error: {err}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
