#!/usr/bin/env bash
# Runs a tier of the MaxDiffusion integration tests (tests/integration) against a MaxDiffusion
# source tree used in place, with $MD_PY (the venv holding MaxDiffusion's deps from PyPI).
#   scripts/test_maxdiffusion.sh ci|full [pytest args, test paths...]
# The tree: $MAXDIFFUSION_SRC (a checkout), else the archive $MAXDIFFUSION_ARCHIVE (a file, or a
# folder holding maxdiffusion-<tested commit>.tar.gz; default ../shared/maxdiffusion), unpacked to
# a temporary folder that is removed afterwards. Either must be the tested commit.
# With neither, the tier is skipped with its reason; under CI=true that is a failure instead.
set -euo pipefail
cd "$(dirname "$0")/.."
tier="${1:?usage: $0 ci|full [pytest args...]}"
shift
MD_PY="${MD_PY:-.venv-maxdiffusion/bin/python}"
archive="${MAXDIFFUSION_ARCHIVE:-../shared/maxdiffusion}"
tmp="" cache=""  # temporary folders: the unpacked tree, the compilation cache
trap 'rm -rf ${tmp:+"$tmp"} ${cache:+"$cache"}' EXIT

case "$tier" in
  ci) selection=(-m "not full") ;;
  full) selection=() ;;
  *) echo "error: tier must be ci or full, got '$tier'" >&2; exit 2 ;;
esac

if [ -n "${MAXDIFFUSION_SRC:-}" ]; then
  "$MD_PY" scripts/maxdiffusion_tree.py check "$MAXDIFFUSION_SRC"
  tree="$(cd "$MAXDIFFUSION_SRC" && pwd)"
elif [ -e "$archive" ]; then
  tmp="$(mktemp -d "${TMPDIR:-/tmp}/maxdiffusion-src.XXXXXX")"
  tree="$("$MD_PY" scripts/maxdiffusion_tree.py unpack "$archive" "$tmp")"
  echo "MaxDiffusion: $archive unpacked to $tree (removed afterwards)"
else
  reason="no MaxDiffusion tree: set MAXDIFFUSION_SRC=/path/to/maxdiffusion or MAXDIFFUSION_ARCHIVE (no $archive)"
  if [ "${CI:-}" = "true" ]; then
    echo "error: the MaxDiffusion integration tier cannot run in CI: $reason" >&2
    exit 1
  fi
  echo "MaxDiffusion integration tier ($tier) skipped: $reason"
  exit 0
fi

# Test paths among the arguments narrow the run; by default all of tests/integration.
paths=(tests/integration)
for arg in "$@"; do
  case "$arg" in tests/*) paths=() ;; esac
done

# One JAX compilation cache for the run, shared by the pytest workers and the processes they
# start (the same VAE, text encoder and transformer programs compile in many tests), removed after.
cache="$(mktemp -d "${TMPDIR:-/tmp}/maxdiffusion-svg-jax-cache.XXXXXX")"
# MDSVG_NO_SKIPS: a skipped test fails the tier (tests/integration/conftest.py).
JAX_COMPILATION_CACHE_DIR="$cache" \
MAXDIFFUSION_SRC="$tree" PYTHONPATH="$tree/src" MDSVG_NO_SKIPS=1 \
  "$MD_PY" -m pytest -q -p no:cacheprovider "${paths[@]}" "${selection[@]}" "$@"
