#!/usr/bin/env bash
# Applies patches/maxdiffusion-plugins.patch to a MaxDiffusion source tree (a checkout of the tested
# commit 7cfb8801d41d or a compatible one), or with --check only tells whether it applies.
# The patch adds lines only (zero context): plugin entry points, base_config, Wan and LTX-2 dispatch in generate.
#   scripts/apply_maxdiffusion_patch.sh [--check] /path/to/maxdiffusion
set -euo pipefail
patch="$(cd "$(dirname "$0")/.." && pwd)/patches/maxdiffusion-plugins.patch"
check=""
if [ "${1:-}" = "--check" ]; then check="--check"; shift; fi
target="${1:?usage: $0 [--check] /path/to/maxdiffusion}"
if [ ! -f "$target/src/maxdiffusion/pyconfig.py" ]; then
  echo "error: $target is not a MaxDiffusion source tree (no src/maxdiffusion/pyconfig.py)" >&2
  exit 2
fi
cd "$target"
if git apply --unidiff-zero --reverse --check "$patch" 2>/dev/null; then
  echo "already applied: $patch"
  exit 0
fi
if ! git apply --unidiff-zero --check "$patch"; then
  echo "error: $patch does not apply to $target (tested with MaxDiffusion 7cfb8801d41d)" >&2
  exit 1
fi
if [ -n "$check" ]; then
  echo "applies cleanly: $patch"
else
  git apply --unidiff-zero "$patch"
  echo "applied: $patch"
fi
