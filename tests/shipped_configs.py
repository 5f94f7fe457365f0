"""The shipped configs as tests without MaxDiffusion see them."""

import pathlib

import yaml

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def own_chain(path: pathlib.Path) -> dict:
  """``path`` merged over the bases it names in ``configs/`` (MaxDiffusion's own base, the end
  of every chain, left out: it is not installed here)."""
  data = yaml.safe_load(path.read_text())
  while (CONFIGS / data.get("base_config", "")).is_file():
    data = {**yaml.safe_load((CONFIGS / data.pop("base_config")).read_text()), **data}
  return data
