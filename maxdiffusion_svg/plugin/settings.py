"""The plugin's settings: ``SvgConfig`` plus the keys only the MaxDiffusion kernel reads.

Parsed from MaxDiffusion's flat global config when a transformer is built, so an invalid
or unknown ``svg_*`` key fails before weights load or anything compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from maxdiffusion_svg.config import SvgConfig

KERNEL_NAME = "svg"
# svg_* keys the kernel reads itself (SvgConfig reads the rest).
PLUGIN_KEYS = ("svg_dense_kernel", "svg_min_seq_length")
DEFAULT_MIN_SEQ_LENGTH = 4096


@dataclasses.dataclass(frozen=True)
class PluginSettings:
  """What the ``svg`` kernel needs besides the attention itself.

  ``dense_kernel``: the MaxDiffusion kernel that runs cross-attention, masked calls and
  short sequences (``None``: ``flash`` on TPU, ``dot_product`` elsewhere).
  ``min_seq_length``: self-attention shorter than this runs dense (SVG's masks need
  several frames of tokens to skip anything).
  """

  svg: SvgConfig = SvgConfig()
  dense_kernel: str | None = None
  min_seq_length: int = DEFAULT_MIN_SEQ_LENGTH

  def __post_init__(self):
    if self.dense_kernel is not None and (not isinstance(self.dense_kernel, str)
                                          or self.dense_kernel == KERNEL_NAME):
      raise ValueError(f"svg_dense_kernel must name a dense MaxDiffusion attention kernel "
                       f"(e.g. flash, dot_product), got {self.dense_kernel!r}")
    value = self.min_seq_length
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"svg_min_seq_length must be an integer >= 0, got {value!r}")

  @classmethod
  def from_mapping(cls, mapping: Mapping[str, Any]) -> "PluginSettings":
    """From a flat config (MaxDiffusion's ``config.get_keys()``); errors name the key."""
    dense = mapping.get("svg_dense_kernel")
    return cls(svg=SvgConfig.from_mapping(mapping, extra_keys=PLUGIN_KEYS),
               dense_kernel=dense or None,
               min_seq_length=mapping.get("svg_min_seq_length", DEFAULT_MIN_SEQ_LENGTH))

  def resolved_dense_kernel(self, platform: str) -> str:
    if self.dense_kernel is not None:
      return self.dense_kernel
    return "flash" if platform == "tpu" else "dot_product"
