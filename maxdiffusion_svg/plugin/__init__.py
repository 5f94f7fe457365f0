"""MaxDiffusion integration: the ``svg`` attention kernel and the hooks that feed it.

What runs in a user's job. It imports MaxDiffusion only when :func:`register` runs, so
importing ``maxdiffusion_svg`` (or this package) touches neither MaxDiffusion nor JAX's
devices (multi-host runs initialise ``jax.distributed`` later, in ``pyconfig``). JAX itself is
imported only when a name of ``settings`` is first used, so the launcher's ``--help`` is instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from maxdiffusion_svg.plugin.settings import PluginSettings


def register() -> None:
  """Registers the ``svg`` kernel with MaxDiffusion and installs the hooks (idempotent)."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion.models import attention_flax

  from maxdiffusion_svg.plugin import installer
  from maxdiffusion_svg.plugin.kernel import svg_kernel
  from maxdiffusion_svg.plugin.settings import KERNEL_NAME
  # pylint: enable=import-outside-toplevel
  installer.install()
  attention_flax.register_kernel(KERNEL_NAME)(svg_kernel)


def __getattr__(name: str) -> Any:
  if name in ("KERNEL_NAME", "PluginSettings"):  # settings imports JAX: on first use only
    from maxdiffusion_svg.plugin import settings  # pylint: disable=import-outside-toplevel
    return getattr(settings, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def prepare_transformer(model, settings: PluginSettings, expert: str | None = None):
  """See :func:`maxdiffusion_svg.plugin.hooks.prepare_transformer`."""
  from maxdiffusion_svg.plugin import hooks  # pylint: disable=import-outside-toplevel
  return hooks.prepare_transformer(model, settings, expert)


def set_denoising_schedule(model, timesteps) -> None:
  """See :func:`maxdiffusion_svg.plugin.hooks.set_denoising_schedule`."""
  from maxdiffusion_svg.plugin import hooks  # pylint: disable=import-outside-toplevel
  hooks.set_denoising_schedule(model, timesteps)


def record_calls(arrays: bool = False):
  """See :func:`maxdiffusion_svg.plugin.kernel.record_calls`."""
  from maxdiffusion_svg.plugin.kernel import record_calls as record  # pylint: disable=import-outside-toplevel
  return record(arrays)


__all__ = ["KERNEL_NAME", "PluginSettings", "prepare_transformer", "record_calls", "register",
           "set_denoising_schedule"]
