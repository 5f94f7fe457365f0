#!/usr/bin/env bash
# Wan generation with SVG attention on a TPU slice through XPK, from a MaxDiffusion checkout.
#
#   CLUSTER=my-cluster OUTPUT_DIR=gs://my-bucket/wan [TPU_TYPE=v6e-16] \
#       scripts/gke/xpk.sh /path/to/maxdiffusion [CONFIG] [key=value ...]
#
# XPK makes one pod per host of the slice (v6e-8: 2 hosts x 4 chips; v6e-16: 4 x 4; v6e-32: 8 x 4;
# v6e-64: 16 x 4), each running the same command; MaxDiffusion joins them with jax.distributed.
# CONFIG (a file of this repo's configs/) defaults by TPU_TYPE: wan_svg.yml for v6e-8 (8-way
# context), wan_svg_v6e16.yml for v6e-16 (2-way data x 8-way context: 8 divides the 40 heads),
# wan_svg_v6e32.yml for v6e-32 (2 x 16, ulysses_shards 8: heads exchanged in groups of 8, a ring
# of 2) and wan_svg_v6e64.yml for v6e-64 (2 x 32, ulysses_shards 8, a ring of 4); other types
# need it named. key=value pairs are passed on.
# XPK builds the job's image from the MaxDiffusion checkout on top of BASE_IMAGE (MaxDiffusion's
# dependency image, see its docs/getting_started/run_maxdiffusion_via_xpk.md), so the plugin is
# staged into the checkout first and installed from it in the pod: no bucket is mounted.
# The container gets LIBTPU_INIT_ARGS from libtpu_init_args.txt (the flags MaxDiffusion's Wan runs
# use, the 64 MiB scoped-VMEM limit among them; the JobSets set the same) through xpk's --env.
# Environment: CLUSTER (required), OUTPUT_DIR (required, gs://...), TPU_TYPE (default v6e-8),
# RUN_NAME (default: $USER-wan-svg; also the workload name: XPK's JobSet has no JOBSET_NAME env, so
# the run name goes in the command), BASE_IMAGE (default: maxdiffusion_base_image), XPK (default:
# xpk), XPK_ARGS (more xpk arguments, e.g. "--project P --zone Z --dry-run"; more variables as
# --env NAME=VALUE: xpk takes no --env-file beside --env).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
maxdiffusion="${1:?usage: $0 /path/to/maxdiffusion [CONFIG] [key=value ...]}"
shift
tpu_type="${TPU_TYPE:-v6e-8}"
case "$tpu_type" in
  v6e-8) config="wan_svg.yml" ;;
  v6e-16) config="wan_svg_v6e16.yml" ;;
  v6e-32) config="wan_svg_v6e32.yml" ;;
  v6e-64) config="wan_svg_v6e64.yml" ;;
  *) config="" ;;
esac
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then config="$1"; shift; fi
[ -n "$config" ] || {
  echo "error: no default config for TPU_TYPE=$tpu_type (v6e-8, v6e-16, v6e-32, v6e-64): name one" >&2; exit 2; }
: "${CLUSTER:?set CLUSTER to your GKE cluster}"
: "${OUTPUT_DIR:?set OUTPUT_DIR to a gs:// folder for videos and logs}"
# Every host writes its video locally and uploads it there: a local path would stay in the pod.
[[ "$OUTPUT_DIR" == gs://?* ]] || {
  echo "error: OUTPUT_DIR must be a gs:// folder (the pods upload videos there), got '$OUTPUT_DIR'" >&2
  exit 2; }
run_name="${RUN_NAME:-${USER:-user}-wan-svg}"
[ -f "$maxdiffusion/src/maxdiffusion/generate_wan.py" ] || {
  echo "error: $maxdiffusion is not a MaxDiffusion checkout" >&2; exit 2; }
(cd "$maxdiffusion" && "$here/stage.sh" maxdiffusion_svg_stage)
[ -f "$maxdiffusion/maxdiffusion_svg_stage/configs/$config" ] || {
  echo "error: no config $config in configs/" >&2; exit 2; }
libtpu_init_args="$(sed 's/#.*//' "$here/libtpu_init_args.txt" | xargs)"
command="pip install . && pip install --no-deps maxdiffusion_svg_stage/*.whl && \
python -m maxdiffusion_svg.generate maxdiffusion_svg_stage/configs/$config \
run_name=$run_name output_dir=$OUTPUT_DIR $*"
cd "$maxdiffusion"
# shellcheck disable=SC2086  # XPK_ARGS is a list of words
"${XPK:-xpk}" workload create \
  --cluster "$CLUSTER" \
  --base-docker-image "${BASE_IMAGE:-maxdiffusion_base_image}" \
  --workload "$run_name" \
  --tpu-type="$tpu_type" \
  --num-slices=1 \
  --env "LIBTPU_INIT_ARGS=$libtpu_init_args" \
  --command "$command" ${XPK_ARGS:-}
