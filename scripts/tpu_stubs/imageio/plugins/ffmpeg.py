"""The stand-in has no ffmpeg; MaxDiffusion only asks that one be named."""


def get_exe() -> str:
  return "none (scripts/tpu_stubs/imageio writes .npy frames)"
