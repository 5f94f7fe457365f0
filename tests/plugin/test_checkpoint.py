"""What the tools and the run read of a checkpoint before its weights, and the checks on it:
one reader (``checkpoint``) and one set of checks (``config_checks.check_before_weights``)."""

import json
import re
import sys
import types

import pytest

from maxdiffusion_svg.plugin import checkpoint
from maxdiffusion_svg.plugin.config_checks import check_before_weights

WAN = {"attention": "svg", "model_name": "wan2.1"}


def _folder(tmp_path, **transformer):
  (tmp_path / "transformer").mkdir()
  (tmp_path / "transformer" / "config.json").write_text(json.dumps(transformer))
  return str(tmp_path)


def test_a_folders_config_gives_layers_heads_and_head_dim(tmp_path):
  name = _folder(tmp_path, num_layers=30, num_attention_heads=12, attention_head_dim=32)
  shape = checkpoint.model_shape({**WAN, "pretrained_model_name_or_path": name}, env={})
  assert (shape.layers, shape.heads, shape.head_dim, shape.read) == (30, 12, 32, True)
  assert shape.source == f"{name}/transformer/config.json"


def test_without_the_file_the_shape_is_the_models_by_its_name_and_says_so():
  shape = checkpoint.model_shape({**WAN, "pretrained_model_name_or_path": "Wan-AI/Wan2.1-T2V-"
                                  "1.3B-Diffusers"}, env={})
  assert (shape.layers, shape.heads, shape.head_dim, shape.read) == (30, 12, 128, False)
  assert shape.source == "a 1.3B by its name" and shape.unread


@pytest.mark.parametrize("name, needle", [
    ("/no/such/folder", "is not a checkpoint folder (no such folder) nor a Hugging Face id"),
    ("./ckpt", "is not a checkpoint folder"),
    ("a/b/c", "is not a checkpoint folder")])
def test_a_missing_folder_is_refused_by_name(name, needle):
  with pytest.raises(ValueError, match=re.escape(f"pretrained_model_name_or_path {name!r} "
                                                 f"{needle}")):
    checkpoint.model_shape({**WAN, "pretrained_model_name_or_path": name}, env={})


def test_a_folder_without_a_transformer_config_is_refused(tmp_path):
  with pytest.raises(ValueError, match="has no transformer/config.json: give a diffusers"):
    checkpoint.model_shape({**WAN, "pretrained_model_name_or_path": str(tmp_path)}, env={})


@pytest.fixture(name="hub")
def _hub(monkeypatch, tmp_path):
  """A Hugging Face client whose cache holds what the test puts in ``cached``."""
  cached = {}
  module = types.SimpleNamespace(
      try_to_load_from_cache=lambda repo, file: cached.get((repo, file)),
      hf_hub_download=lambda *a, **k: (_ for _ in ()).throw(OSError("no network")))
  monkeypatch.setitem(sys.modules, "huggingface_hub", module)
  return cached, tmp_path


def test_a_hub_id_is_read_from_the_cache_and_refused_offline_without_it(hub):
  cached, tmp_path = hub
  keys = {**WAN, "pretrained_model_name_or_path": "Owner/Wan-custom"}
  shape = checkpoint.model_shape(keys, env={})  # online: the run downloads it
  assert not shape.read and shape.unread == "not in this host's Hugging Face cache"
  with pytest.raises(ValueError, match=re.escape(
      "pretrained_model_name_or_path 'Owner/Wan-custom': its transformer/config.json is not in "
      "this host's Hugging Face cache and HF_HUB_OFFLINE is set")):
    checkpoint.model_shape(keys, env={"HF_HUB_OFFLINE": "1"})
  with pytest.raises(ValueError, match="does not load: OSError: no network"):
    checkpoint.model_shape(keys, env={}, download=True)
  file = tmp_path / "config.json"
  file.write_text(json.dumps({"num_layers": 6, "num_attention_heads": 4}))
  cached[("Owner/Wan-custom", "transformer/config.json")] = str(file)
  shape = checkpoint.model_shape(keys, env={"HF_HUB_OFFLINE": "1"})
  assert (shape.layers, shape.heads, shape.read) == (6, 4, True)


def test_the_budgets_are_checked_against_the_checkpoints_layers_and_heads(tmp_path):
  """A 30-layer, 12-head checkpoint under a 14B's name: its own config decides."""
  name = _folder(tmp_path, num_layers=30, num_attention_heads=12)
  keys = {**WAN, "pretrained_model_name_or_path": name}
  assert check_before_weights({**keys, "svg_layer_densities": [0.3] * 30}, {}).layers == 30
  with pytest.raises(ValueError, match="svg_layer_densities gives 40 values; the model has 30 "
                                       "layers"):
    check_before_weights({**keys, "svg_layer_densities": [0.3] * 40}, {})
  with pytest.raises(ValueError, match="svg_head_densities"):
    check_before_weights({**keys, "svg_head_densities": [[0.3] * 40]}, {})
  check_before_weights({**keys, "svg_head_densities": [[0.3] * 12]}, {})
  # tiles' --layers and --heads stand for the checkpoint's
  assert check_before_weights({**keys, "svg_layer_densities": [0.3] * 4}, {}, layers=4,
                              heads=2).source.endswith("layers and heads given with --layers "
                                                       "and --heads")


def test_a_vace_checkpoint_goes_with_a_vace_config_only(tmp_path):
  name = _folder(tmp_path, num_layers=2, num_attention_heads=8, vace_layers=[0])
  with pytest.raises(ValueError, match="is a Wan VACE checkpoint .* but the config is Wan's"):
    check_before_weights({**WAN, "pretrained_model_name_or_path": name}, {})
  vace = {**WAN, "pretrained_model_name_or_path": name, "vace_reference_images": []}
  assert check_before_weights(vace, {}).vace_layers == 1
  plain = _folder(tmp_path / "plain" if (tmp_path / "plain").mkdir() is None else None,
                  num_layers=2, num_attention_heads=8)
  with pytest.raises(ValueError, match="is not a Wan VACE checkpoint"):
    check_before_weights({**vace, "pretrained_model_name_or_path": plain}, {})


def test_an_ltx_video_config_is_refused_by_name():
  with pytest.raises(ValueError, match="ltx_video.yml is an LTX-Video config: LTX-Video"):
    check_before_weights({"pretrained_model_name_or_path": "Lightricks/LTX-Video"}, {},
                         path="ltx_video.yml")


def test_a_shape_by_name_is_checked_by_tiles_and_left_to_the_run_by_the_launcher():
  """Not in the cache, a Hub checkpoint's layers are its name's guess: tiles refuses a budget
  against them, saying how to give the real ones; the launcher leaves it to the run's check,
  which reads the checkpoint's config.json before weights load."""
  keys = {**WAN, "pretrained_model_name_or_path": "Owner/Wan-finetuned",
          "svg_layer_densities": [0.3] * 30}
  with pytest.raises(ValueError, match="the model has 40 layers .*a 14B by its name.*give "
                                       "--layers and --heads where the checkpoint differs"):
    check_before_weights(keys, {})
  assert check_before_weights(keys, {}, layers=30).layers == 30
  assert not check_before_weights(keys, {}, by_name=False).read
