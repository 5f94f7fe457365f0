#!/usr/bin/env bash
# Stages the plugin for a TPU job: a wheel of this package and its configs, in DEST
# (default: ./maxdiffusion_svg_stage). The job installs the wheel in MaxDiffusion's image with
# `pip install --no-deps` (the image already has jax, flax and tokamax) and reads the configs there.
#   scripts/gke/stage.sh [DEST]
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-maxdiffusion_svg_stage}"
rm -rf "$dest"
mkdir -p "$dest"
"${PYTHON:-python3}" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$repo" 2>/dev/null \
  || "${PYTHON:-python3}" -m pip wheel -q --no-deps -w "$dest" "$repo"
cp -r "$repo/configs" "$dest/configs"
echo "staged $(ls "$dest"/*.whl) and configs/ in $dest"
