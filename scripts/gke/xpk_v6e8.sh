#!/usr/bin/env bash
# Wan generation with SVG attention on a TPU v6e-8 slice through XPK, from a MaxDiffusion checkout.
#
#   CLUSTER=my-cluster OUTPUT_DIR=gs://my-bucket/wan scripts/gke/xpk_v6e8.sh /path/to/maxdiffusion \
#       [CONFIG] [key=value ...]
#
# CONFIG defaults to wan_svg.yml (a file of this repo's configs/); key=value pairs are passed on.
# XPK builds the job's image from the MaxDiffusion checkout on top of BASE_IMAGE (MaxDiffusion's
# dependency image, see its docs/getting_started/run_maxdiffusion_via_xpk.md), so the plugin is
# staged into the checkout first. Environment: CLUSTER (required), OUTPUT_DIR (required, gs://...),
# RUN_NAME (default: $USER-wan-svg; also the workload name), BASE_IMAGE (default:
# maxdiffusion_base_image), XPK (default: xpk).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
maxdiffusion="${1:?usage: $0 /path/to/maxdiffusion [CONFIG] [key=value ...]}"
shift
config="wan_svg.yml"
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then config="$1"; shift; fi
: "${CLUSTER:?set CLUSTER to your GKE cluster}"
: "${OUTPUT_DIR:?set OUTPUT_DIR to a gs:// folder for videos and logs}"
run_name="${RUN_NAME:-${USER:-user}-wan-svg}"
[ -f "$maxdiffusion/src/maxdiffusion/generate_wan.py" ] || {
  echo "error: $maxdiffusion is not a MaxDiffusion checkout" >&2; exit 2; }
(cd "$maxdiffusion" && "$here/stage.sh" maxdiffusion_svg_stage)
[ -f "$maxdiffusion/maxdiffusion_svg_stage/configs/$config" ] || {
  echo "error: no config $config in configs/" >&2; exit 2; }
command="pip install . && pip install --no-deps maxdiffusion_svg_stage/*.whl && \
python -m maxdiffusion_svg.generate maxdiffusion_svg_stage/configs/$config \
run_name=$run_name output_dir=$OUTPUT_DIR $*"
cd "$maxdiffusion"
"${XPK:-xpk}" workload create \
  --cluster "$CLUSTER" \
  --base-docker-image "${BASE_IMAGE:-maxdiffusion_base_image}" \
  --workload "$run_name" \
  --tpu-type=v6e-8 \
  --num-slices=1 \
  --command "$command"
