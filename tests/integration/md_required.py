"""MaxDiffusion tests skip, with how to run them, where MaxDiffusion is not importable.

Under ``make test-maxdiffusion`` (which sets ``MAXDIFFUSION_SRC``) they must run: a failed
import is then an error, never a skip.
"""

import importlib
import os

import pytest

HOW = "make test-maxdiffusion MAXDIFFUSION_SRC=/path/to/maxdiffusion"


def require_maxdiffusion() -> None:
  try:
    importlib.import_module("maxdiffusion.pipelines.wan.wan_pipeline")
  except Exception as err:  # pylint: disable=broad-except
    if os.environ.get("MAXDIFFUSION_SRC"):
      raise
    pytest.skip(f"MaxDiffusion is not importable ({type(err).__name__}: {err}); run these "
                f"tests with `{HOW}`", allow_module_level=True)
