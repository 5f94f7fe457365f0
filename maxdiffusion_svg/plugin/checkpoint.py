"""What a run reads of its checkpoint before the weights: the transformer's shape.

One reader for every tool: ``tiles``, the launcher's pre-flight, ``compare``, ``calibrate`` and
the run's own checks before weights load. A checkpoint folder's ``transformer/config.json`` is
read as the run reads it; a Hugging Face id's is read from this host's Hugging Face cache, and
downloaded only where ``download`` says so (the run, which downloads the weights next). Where
neither has it, the shape is the model's by its name (:mod:`video_models`), and says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Any, Mapping

from maxdiffusion_svg.plugin.video_models import WAN_VACE, video_model, wan_size

CONFIG_FILE = "transformer/config.json"
# A Hugging Face repo id: "name" or "owner/name", of letters, digits, "-", "_" and ".".
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_TRUE = ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The transformer's depth and self-attention heads, and where the figures come from."""

  layers: int
  heads: int
  head_dim: int
  vace_layers: int  # Wan VACE's control blocks (0 for the other families)
  source: str
  read: bool  # from the checkpoint's own config.json (else the model's by its name)
  unread: str = ""  # why it was not read, where it was not

  @property
  def described(self) -> str:
    """Where the figures come from, and why not from the checkpoint where they do not."""
    return f"{self.source}; its config.json: {self.unread}" if self.unread else self.source


def is_offline(env: Mapping[str, str]) -> bool:
  """Whether the Hugging Face hub is switched off (``HF_HUB_OFFLINE``), as the run reads it."""
  return env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def transformer_config(name: str, env: Mapping[str, str] | None = None,
                       download: bool = False) -> tuple[dict[str, Any] | None, str]:
  """The checkpoint's ``transformer/config.json`` and where it was read; ``(None, why)`` where
  only the run can read it (a Hub id not in this host's cache, the Hub reachable). Raises
  ``ValueError`` naming ``pretrained_model_name_or_path`` where the run could not read it."""
  env = os.environ if env is None else env
  key = "pretrained_model_name_or_path"
  if not name:  # MaxDiffusion's base configs all set it; a config of keys alone (tests) not
    return None, f"{key} is not set"
  path = pathlib.Path(name).expanduser()
  if path.is_dir():
    return _read(path / CONFIG_FILE, key, name), str(path / CONFIG_FILE)
  if path.exists() or not _REPO_ID.fullmatch(name):
    raise ValueError(f"{key} {name!r} is not a checkpoint folder (no such folder) nor a Hugging "
                     f"Face id (owner/name): give the folder holding {CONFIG_FILE}, or an id "
                     f"such as Wan-AI/Wan2.1-T2V-14B-Diffusers")
  try:
    import huggingface_hub  # pylint: disable=import-outside-toplevel
  except ImportError:  # no hub client here (the tools' venv): the run's own venv reads it
    return None, "the Hugging Face client is not installed here"
  cached = huggingface_hub.try_to_load_from_cache(name, CONFIG_FILE)
  if isinstance(cached, str):
    return _read(pathlib.Path(cached), key, name), f"{name}/{CONFIG_FILE} (Hugging Face cache)"
  if is_offline(env):
    raise ValueError(f"{key} {name!r}: its {CONFIG_FILE} is not in this host's Hugging Face "
                     f"cache and HF_HUB_OFFLINE is set, so the run cannot download it: download "
                     f"the checkpoint first (huggingface-cli download {name}), or give a local "
                     f"folder")
  if not download:
    return None, "not in this host's Hugging Face cache"
  try:
    file = huggingface_hub.hf_hub_download(name, "config.json", subfolder="transformer")
  except Exception as err:  # pylint: disable=broad-except  # any hub failure, named in one line
    first = str(err).splitlines()[0] if str(err) else ""
    raise ValueError(f"{key} {name!r} does not load: {type(err).__name__}: {first}") from None
  return _read(pathlib.Path(file), key, name), f"{name}/{CONFIG_FILE}"


def _read(file: pathlib.Path, key: str, name: str) -> dict[str, Any]:
  """The JSON file, read as the run reads it: not with MaxDiffusion's ``load_config``, which
  rewrites it in place (processes sharing a checkpoint folder would race on it)."""
  if not file.is_file():
    raise ValueError(f"{key} {name!r} has no {CONFIG_FILE}: give a diffusers checkpoint folder "
                     f"(transformer/, vae/, text_encoder/, ...)")
  try:
    data = json.loads(file.read_text(encoding="utf-8"))
  except ValueError as err:
    raise ValueError(f"{key} {name!r}: {file} is not JSON ({err})") from None
  if not isinstance(data, dict):
    raise ValueError(f"{key} {name!r}: {file} is not a JSON mapping")
  return data


def model_shape(config: Mapping[str, Any], env: Mapping[str, str] | None = None,
                download: bool = False) -> ModelShape:
  """The shape the run's transformer will have: from the checkpoint's config where it can be
  read here (see :func:`transformer_config`), else the model's by its name."""
  name = str(config.get("pretrained_model_name_or_path") or "")
  transformer, where = transformer_config(name, env, download)
  family, size = video_model(config), wan_size(config)
  layers, heads = (size.layers, size.heads) if size else (family.layers, family.heads)
  vace = size.vace_blocks if size and family is WAN_VACE else 0
  if transformer is None:
    what = f"a {size.name} by its name" if size else f"{family.name}'s by its model_name"
    return ModelShape(layers, heads, family.head_dim, vace, what, read=False, unread=where)
  heads = int(transformer.get("num_attention_heads", heads))
  return ModelShape(
      layers=int(transformer.get("num_layers", layers)), heads=heads,
      head_dim=int(transformer.get("attention_head_dim", family.head_dim)),
      vace_layers=len(transformer.get("vace_layers") or ()), source=where, read=True)
