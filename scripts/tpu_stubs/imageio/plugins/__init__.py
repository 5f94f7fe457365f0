"""The stand-in's plugins (see ``imageio``)."""
from imageio.plugins import ffmpeg  # noqa: F401
