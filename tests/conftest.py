"""Test session set-up: eight simulated CPU devices, so the sharded tests run everywhere, and
JAX kept on the CPU although libtpu is installed (it is there to compile for TPUs, not to run).

XLA reads the flags when JAX starts its backend, which no test module does at import.
"""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "full: a slow duplicate left out of make test (CI); make test-full runs it")
  config.addinivalue_line(
      "markers", "chip: runs on a real TPU (make test-tpu); skipped, with the reason, elsewhere")
