"""Fixtures the plugin's tests share."""

import sys
import types

import pytest


@pytest.fixture
def max_logging(monkeypatch):
  """MaxDiffusion's logger, stood in: the lines the run logs (the hooks log what they applied)."""
  lines = []
  package = types.ModuleType("maxdiffusion")
  package.max_logging = types.SimpleNamespace(log=lines.append)
  monkeypatch.setitem(sys.modules, "maxdiffusion", package)
  monkeypatch.setitem(sys.modules, "maxdiffusion.max_logging", package.max_logging)
  return lines
