"""Stand-ins for a model's Hugging Face loaders (no MaxDiffusion import): the tiny models' and
the weightless AOT compiles'."""

from __future__ import annotations

from typing import Any, Callable


def config_loader(config: dict[str, Any]) -> Callable[..., Any]:
  """A Hugging Face ``load_config`` stand-in that returns ``config``."""

  def load_config(*args, return_unused_kwargs=False, **kwargs):
    del args
    return (dict(config), kwargs) if return_unused_kwargs else dict(config)

  return load_config
