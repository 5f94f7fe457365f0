"""A stand-in for imageio on a borrowed TPU machine (scripts/tpu_env.sh).

That machine's package index holds neither imageio, imageio-ffmpeg nor OpenCV, and a real
ffmpeg would not fit the tree it carries. MaxDiffusion's ``export_to_video`` writes each video
through ``get_writer``; here the frames are saved as one uint8 array in NumPy's ``.npy`` format
at the path asked for: the run completes and its frames can be read back (``numpy.load``), but
the file is not a playable MP4.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from imageio import plugins  # noqa: F401  (MaxDiffusion asks plugins.ffmpeg for its executable)


class _Writer:
  def __init__(self, path: str) -> None:
    self.path, self.frames = path, []

  def append_data(self, frame: Any) -> None:
    self.frames.append(np.asarray(frame, np.uint8))

  def close(self) -> None:
    with open(self.path, "wb") as f:
      np.save(f, np.stack(self.frames))

  def __enter__(self) -> "_Writer":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def get_writer(path: str, **_: Any) -> _Writer:
  return _Writer(str(path))
