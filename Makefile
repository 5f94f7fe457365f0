# Each target bootstraps a Python 3.12 virtual environment in .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test bench tiles venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@py=$$(scripts/find_python.sh) && echo "creating $(VENV) with $$py" && "$$py" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

# The test suite (what .ci/run calls).
test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The main job on its default: the quality benchmark.
bench: venv
	$(PY) -m maxdiffusion_svg bench $(ARGS)

# The tile report (720p by default).
tiles: venv
	$(PY) -m maxdiffusion_svg tiles $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
