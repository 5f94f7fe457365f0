"""What a Wan VACE generation config conditions on, checked before anything loads.

MaxDiffusion's ``VaceWanPipeline2_1`` takes reference images, a control video and its mask;
it has no generate main, so no config key names them. Ours (:mod:`generate_vace`) reads these
keys, which only a VACE generation config holds (``configs/wan_vace_svg.yml``; their presence
is what makes a Wan config a VACE one, :func:`maxdiffusion_svg.plugin.video_models.video_model`):

- ``vace_reference_images``: image paths or URLs, each one more latent frame in front of the
  video (the first is the first-frame sink);
- ``vace_video``: a control video (path or URL), or ``''`` for none (an all-zero video, every
  pixel generated: reference-to-video);
- ``vace_mask``: its mask video (white: generate, black: keep the control video), or ``''``
  (generate everywhere); only with ``vace_video``;
- ``vace_conditioning_scale``: how strongly the control blocks' hints are added (1.0: as
  trained).

No MaxDiffusion or JAX import: the launcher checks these before either loads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from maxdiffusion_svg.plugin.video_models import VACE_REFERENCES

DEFAULTS: dict[str, Any] = {VACE_REFERENCES: [], "vace_video": "", "vace_mask": "",
                            "vace_conditioning_scale": 1.0}
URL_PREFIXES = ("http://", "https://")  # what MaxDiffusion's load_image and load_video fetch


@dataclasses.dataclass(frozen=True)
class VaceInputs:
  """A VACE generation's conditions, as the config names them."""

  reference_images: tuple[str, ...] = ()
  video: str = ""
  mask: str = ""
  conditioning_scale: float = 1.0

  @classmethod
  def from_mapping(cls, keys: Mapping[str, Any]) -> VaceInputs:
    """The conditions of a config's keys; a missing file or a value of the wrong kind is
    refused naming its key."""
    references = keys.get(VACE_REFERENCES, DEFAULTS[VACE_REFERENCES])
    if not isinstance(references, (list, tuple)) or not all(
        isinstance(r, str) and r.strip() for r in references):
      raise ValueError(f"{VACE_REFERENCES} is {references!r}: give a list of image paths or "
                       f"URLs, e.g. {VACE_REFERENCES}=\"['ref.png']\" ([] for none)")
    for index, reference in enumerate(references):
      _check_source(f"{VACE_REFERENCES}[{index}]", reference)
    video, mask = (_text(keys, key) for key in ("vace_video", "vace_mask"))
    _check_source("vace_video", video)
    _check_source("vace_mask", mask)
    if mask and not video:
      raise ValueError(f"vace_mask is {mask!r} but vace_video is empty: the mask says which "
                       f"pixels of the control video to generate; give vace_video too")
    scale = keys.get("vace_conditioning_scale", DEFAULTS["vace_conditioning_scale"])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale:
      raise ValueError(f"vace_conditioning_scale is {scale!r}: give a number >= 0 (1.0: the "
                       f"control hints as trained, 0: none)")
    return cls(tuple(references), video, mask, float(scale))

  @property
  def reference_frames(self) -> int:
    """Latent frames the references add in front of the video."""
    return len(self.reference_images)


def _text(keys: Mapping[str, Any], key: str) -> str:
  value = keys.get(key, DEFAULTS[key])
  if value is None:
    return ""
  if not isinstance(value, str):
    raise ValueError(f"{key} is {value!r}: give a path or URL, or '' for none")
  return value.strip()


def _check_source(key: str, source: str) -> None:
  """A local file must exist (a URL is fetched when the run loads it)."""
  if source and not source.startswith(URL_PREFIXES) and not os.path.isfile(source):
    raise ValueError(f"{key} is {source!r}: no such file (give a local path or an http(s) URL)")
