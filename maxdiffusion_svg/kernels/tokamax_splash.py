"""tokamax's Splash modules, optional: ``svg_backend: splash`` and the TPU backward need them.

Loaded with the package where tokamax is installed (tokamax registers JAX config values when it
loads: a first trace that loaded it would leave later calls tracing in another context, so
everything would compile twice); elsewhere our kernel and XLA run, and what needs Splash is
refused in one line naming the fix.
"""

from __future__ import annotations

import types

INSTALL = "pip install 'tokamax>=0.0.17,<0.1'"


def _import() -> types.SimpleNamespace | None:
  try:
    # pylint: disable=import-outside-toplevel
    from tokamax._src.ops.experimental.tpu.splash_attention import base
    from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel
    from tokamax._src.ops.experimental.tpu.splash_attention.splash_attention_mask_info import (
        MaskInfo)
  except ImportError:
    return None
  return types.SimpleNamespace(base=base, kernel=splash_attention_kernel, MaskInfo=MaskInfo)


_MODULES = _import()


def available() -> bool:
  """Whether tokamax is installed (its Splash kernels can run)."""
  return _MODULES is not None


def load(what: str = "svg_backend splash") -> types.SimpleNamespace:
  """tokamax's ``base``, ``kernel`` (splash_attention_kernel) and ``MaskInfo``; refuses where
  tokamax is missing, naming ``what`` asked for it."""
  if _MODULES is None:
    raise ValueError(f"{what} needs tokamax (tokamax's Splash kernel), not installed here: "
                     f"{INSTALL}, or use svg_backend pallas (ours, the TPU default) or xla")
  return _MODULES
