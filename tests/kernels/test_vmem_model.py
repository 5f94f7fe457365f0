"""The VMEM model against libtpu's own allocations: the points it was fitted on, and the ones
held out of the fit (docs/measurements/vmem_points.json, `bench vmem`)."""

import json

import numpy as np
import pytest

from maxdiffusion_svg.bench.vmem_points import DEFAULT_OUT, vmem_cases
from maxdiffusion_svg.kernels.vmem_model import MODEL, fit, fitted_bytes, libtpu_note

POINTS = json.loads(DEFAULT_OUT.read_text())
ROWS = [r for r in POINTS["rows"] if r["compiler_bytes"]]


def estimate(row):
  return fitted_bytes(row["chip"], row["strategy"], row["block_q"], row["block_kv"],
                      row["block_kv_compute"], row["head_dim"], np.dtype(row["dtype"]).itemsize)


def test_the_file_holds_every_case_of_the_shipped_command_with_its_libtpu():
  cases = vmem_cases(POINTS["command"].split("--chips ")[1].split(","))
  assert len(POINTS["rows"]) == len(cases)
  assert POINTS["libtpu"] == MODEL["libtpu"] and POINTS["jax"]
  assert {r["chip"] for r in ROWS} == {"v4", "v5e", "v5p", "v6e", "tpu7x"}


def test_the_model_is_the_fit_of_the_file():
  refit = fit(POINTS)
  assert refit["chips"] == MODEL["chips"] and refit["ranges"] == MODEL["ranges"]
  for name, coefficients in MODEL["coefficients"].items():
    np.testing.assert_allclose(refit["coefficients"][name], coefficients, rtol=1e-5, atol=1e-6)


def test_the_model_stays_above_every_point_it_was_fitted_on():
  for row in (r for r in ROWS if not r["held_out"]):
    assert estimate(row) >= row["compiler_bytes"], row


def test_held_out_compiles_never_above_the_model_nor_far_below_it():
  held = [r for r in ROWS if r["held_out"]]
  assert len(held) >= 20
  ratios = []
  for row in held:
    ratio = estimate(row) / row["compiler_bytes"]
    assert ratio >= 1.0, row  # never below the compiler's figure
    ratios.append(ratio)
  # Not so far above that defaults would be refused (tests/plan/test_target.py checks each default).
  # The far ones are single-head calls, which allocate least (docs/benchmarks.md).
  assert max(ratios) < 3.0 and float(np.median(ratios)) < 1.35, sorted(ratios)


def test_outside_the_fitted_ranges_the_model_refuses_naming_them():
  low, high = MODEL["ranges"]["block_q"]
  with pytest.raises(ValueError, match=rf"not fitted for svg_block_q {high + 128} \(fitted "
                                       rf"{low}-{high}\)"):
    fitted_bytes("v6e", "stored", high + 128, 1024, 256, 128, 2)
  with pytest.raises(ValueError, match=r"1-byte inputs \(fitted 2/4\)"):
    fitted_bytes("v6e", "stored", 2048, 1024, 256, 128, 1)
  with pytest.raises(ValueError, match=r"no VMEM model for TPU v9"):
    fitted_bytes("v9", "stored", 2048, 1024, 256, 128, 2)


def test_another_libtpu_is_named_once(monkeypatch):
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
  assert libtpu_note().startswith(f"the VMEM model was fitted on libtpu {MODEL['libtpu']}, "
                                  f"this host has 9.9.9")
  monkeypatch.setattr(importlib.metadata, "version", lambda name: MODEL["libtpu"])
  assert libtpu_note() == ""


def test_the_runs_summary_line_and_tiles_name_another_libtpu(monkeypatch):
  from maxdiffusion_svg.plan.target import tpu_target  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin.settings import PluginSettings  # pylint: disable=import-outside-toplevel
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
  splash = PluginSettings.from_mapping({"svg_backend": "splash"})
  assert "this host has 9.9.9" in splash.summary(tpu_target("v6e"))
  monkeypatch.setattr(importlib.metadata, "version", lambda name: MODEL["libtpu"])
  assert "libtpu" not in splash.summary(tpu_target("v6e"))
