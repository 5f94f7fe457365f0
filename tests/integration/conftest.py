"""Fixtures shared by the MaxDiffusion tests, and the tier rules.

Tiers: the CI tier is every test not marked ``full`` (``make test-maxdiffusion-ci``, run by
``.ci/run``); ``make test-maxdiffusion`` runs them all. Under ``MDSVG_NO_SKIPS=1`` (set by both
targets) a skipped test is a failure: a skip in CI would hide what the tier is for.
"""

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).parent.parent.parent


def pytest_configure(config):
  config.addinivalue_line("markers", "full: left out of the CI tier (make test-maxdiffusion "
                                     "runs it)")


@pytest.fixture
def traced_kernels(monkeypatch):
  """Counts traces of the svg kernel (each compile of a forward traces it once per call site)."""
  from maxdiffusion.models import attention_flax  # pylint: disable=import-outside-toplevel
  traces = []
  kernel = attention_flax.KERNEL_REGISTRY["svg"]

  def counting(q, k, v, context):
    traces.append(context["residual_checkpoint_name"])
    return kernel(q, k, v, context)

  monkeypatch.setitem(attention_flax.KERNEL_REGISTRY, "svg", counting)
  return traces


def _fail_skips() -> bool:
  return os.environ.get("MDSVG_NO_SKIPS") == "1"


def _as_failure(report):
  if report.skipped and _fail_skips() and not hasattr(report, "wasxfail"):
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"skipped, which the integration tier does not allow: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # pylint: disable=unused-argument
  outcome = yield
  _as_failure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # pylint: disable=unused-argument
  outcome = yield
  _as_failure(outcome.get_result())


@pytest.fixture(scope="session")
def wan21_checkpoint(tmp_path_factory):
  """The tiny random Wan 2.1 checkpoint, written once per pytest worker and shared by its
  modules (read-only: MaxDiffusion's loads rewrite its component configs in place, the same
  bytes; tests that start processes give each its own copy)."""
  from maxdiffusion_svg.testing import tiny_checkpoint  # pylint: disable=import-outside-toplevel
  return tiny_checkpoint.write_wan21(str(tmp_path_factory.mktemp("checkpoint") / "wan21"))


@pytest.fixture(scope="session")
def patched_maxdiffusion(tmp_path_factory):
  """A copy of the MaxDiffusion source with patches/maxdiffusion-plugins.patch applied."""
  copy = tmp_path_factory.mktemp("patched") / "maxdiffusion"
  shutil.copytree(pathlib.Path(os.environ.get("MAXDIFFUSION_SRC", "")) / "src",
                  copy / "src", ignore=shutil.ignore_patterns("__pycache__", "tests"))
  script = ROOT / "scripts" / "apply_maxdiffusion_patch.sh"
  check = subprocess.run([str(script), "--check", str(copy)], capture_output=True, text=True,
                         check=False)
  assert check.returncode == 0 and "applies cleanly" in check.stdout, check.stderr
  subprocess.run([str(script), str(copy)], check=True, capture_output=True)
  again = subprocess.run([str(script), str(copy)], capture_output=True, text=True, check=True)
  assert "already applied" in again.stdout
  return copy
