#!/usr/bin/env bash
# Here, before borrowing a TPU machine (docs/development.md, "On a TPU"): what MaxDiffusion needs
# there that the machine lacks. Wheels for Python 3.11 into .whl-tpu/ (git-ignored), and
# MaxDiffusion's source (without its tests) into .chip/md/; carry both (carry: [".whl-tpu",
# ".chip"]) and start the command with `source scripts/tpu_env.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
archive="${MAXDIFFUSION_ARCHIVE:-../shared/maxdiffusion/maxdiffusion-7cfb8801d41d.tar.gz}"
for path in /.whl-tpu/ /.chip/; do
  grep -qxF "$path" .git/info/exclude || echo "$path" >> .git/info/exclude
done
rm -rf .chip/md && mkdir -p .chip/md
tar xzf "$archive" -C .chip/md --strip-components=1 --exclude='*/tests/*' --wildcards '*/src/*'
python3 -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 \
  -d .whl-tpu -r scripts/tpu_requirements.txt
# The machine has these (its JAX, numpy, scipy) or its own index holds them (large binaries).
rm -f .whl-tpu/{jax,jaxlib,numpy,scipy,ml_dtypes,opt_einsum,tensorstore,pillow}-*.whl
du -sh .whl-tpu .chip/md
