# Each target bootstraps a Python 3.12 virtual environment in .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

# The venv holds libtpu (the test extra) to compile for TPUs, not to run on one: targets run JAX
# on the CPU unless JAX_PLATFORMS is set (e.g. JAX_PLATFORMS=tpu make bench on a TPU VM).
export JAX_PLATFORMS ?= cpu

MD_VENV ?= .venv-maxdiffusion
MD_PY := $(MD_VENV)/bin/python
MD_STAMP := $(MD_VENV)/.installed-stamp

.PHONY: test test-full test-tpu bench bench-chip tiles venv clean test-maxdiffusion test-maxdiffusion-ci venv-maxdiffusion compile-tpu xpk

# The xpk CLI for tests/test_gke.py's dry runs, in its own venv (it pins protobuf and packaging).
XPK_VENV ?= .venv-xpk
XPK_VERSION ?= 1.16.0
XPK_BIN := $(XPK_VENV)/bin/xpk

venv: $(STAMP)

$(STAMP): pyproject.toml
	@py=$$(scripts/find_python.sh) && echo "creating $(VENV) with $$py" && "$$py" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

xpk: $(XPK_BIN)

$(XPK_BIN):
	@py=$$(scripts/find_python.sh) && echo "creating $(XPK_VENV) with $$py" && "$$py" -m venv $(XPK_VENV)
	$(XPK_VENV)/bin/python -m pip install -q 'xpk==$(XPK_VERSION)'

# The test suite (what .ci/run calls): one worker per core (the TPU compiles are single-threaded).
# Tests marked full (slow duplicates: more chips, modes and cases of what the suite checks) are
# left out; make test-full runs everything.
PYTEST_ARGS ?= -n auto --dist loadscope --durations=20
test: venv $(XPK_BIN)
	MDSVG_XPK="$(abspath $(XPK_BIN))" $(PY) -m pytest -q -m "not full" $(PYTEST_ARGS)

test-full: venv $(XPK_BIN)
	MDSVG_XPK="$(abspath $(XPK_BIN))" $(PY) -m pytest -q $(PYTEST_ARGS)

# On a TPU VM (or the chip a developer borrows), with the Python that has JAX for the TPU: the
# kernels' exactness on the chip (one process: one program holds a TPU at a time) and every
# kernel timed there (bench chip). CI has no TPU: make test skips the chip tests, saying so.
TPU_PY ?= python3
test-tpu:
	JAX_PLATFORMS=tpu $(TPU_PY) -m pytest -q -m chip -p no:cacheprovider tests/tpu/test_kernels_on_chip.py

bench-chip:
	JAX_PLATFORMS=tpu $(TPU_PY) -m maxdiffusion_svg bench chip $(ARGS)

# The main job on its default: the quality benchmark.
bench: venv
	$(PY) -m maxdiffusion_svg bench $(ARGS)

# The tile report (720p by default).
tiles: venv
	$(PY) -m maxdiffusion_svg tiles $(ARGS)

# Compile for every TPU generation libtpu knows, on this host (no TPU): the full matrix.
compile-tpu: venv
	$(PY) -m maxdiffusion_svg bench compile $(ARGS)

# The MaxDiffusion integration tests (tests/integration) against a MaxDiffusion source tree used
# in place: MAXDIFFUSION_SRC=/path/to/maxdiffusion, or the archive of the tested commit in
# MAXDIFFUSION_ARCHIVE (default ../shared/maxdiffusion, where CI has it), unpacked and removed.
#   make test-maxdiffusion-ci   the CI tier (what .ci/run runs after make test)
#   make test-maxdiffusion      the full tier
# The venv holds MaxDiffusion's runtime deps from PyPI (~9 GB: PyPI's torch is the CUDA build).
venv-maxdiffusion: $(MD_STAMP)

$(MD_STAMP): pyproject.toml requirements-maxdiffusion.txt
	@py=$$(scripts/find_python.sh) && echo "creating $(MD_VENV) with $$py" && "$$py" -m venv $(MD_VENV)
	$(MD_PY) -m pip install -q --upgrade pip
	$(MD_PY) -m pip install -q -r requirements-maxdiffusion.txt
	$(MD_PY) -m pip install -q -e '.[test]'
	@touch $@

MD_PYTEST_ARGS ?= -n auto --dist loadscope --durations=20
test-maxdiffusion-ci: $(MD_STAMP)
	MD_PY=$(MD_PY) scripts/test_maxdiffusion.sh ci $(MD_PYTEST_ARGS)

test-maxdiffusion: $(MD_STAMP)
	MD_PY=$(MD_PY) scripts/test_maxdiffusion.sh full $(MD_PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(MD_VENV) $(XPK_VENV) .pytest_cache
