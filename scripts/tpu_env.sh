# On the borrowed TPU machine, from the repository root: `source scripts/tpu_env.sh` installs
# what scripts/tpu_wheels.sh carried, plus torch (the CPU build MaxDiffusion imports for checkpoint
# conversion), tensorstore and pillow from the machine's own index, under /tmp (commands run as
# an ordinary user), and puts MaxDiffusion's source and the TensorFlow stand-in on PYTHONPATH
# after the machine's JAX. Reinstalls nothing already installed on this machine.
# TPU_ENV_INDEX=0: the carried wheels alone (enough for our package without MaxDiffusion).
_tpu_pip() { PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-compile \
  --no-cache-dir --disable-pip-version-check "$@"; }
if [ ! -e /tmp/site/.wheels ]; then
  _tpu_pip --no-index --no-deps --target /tmp/site .whl-tpu/*.whl || return 1
  touch /tmp/site/.wheels
fi
if [ "${TPU_ENV_INDEX:-1}" != 0 ] && [ ! -e /tmp/site/.done ]; then
  _tpu_pip --only-binary=:all: --index-url file:///opt/pypi/simple --find-links /opt/wheels \
    --target /tmp/site-index torch tensorstore pillow || return 1
  touch /tmp/site/.done
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site:/tmp/site-index:$PWD/.chip/md/src:$PWD/scripts/tpu_stubs"
export MAXDIFFUSION_SRC="$PWD/.chip/md"
