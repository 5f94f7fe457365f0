"""Each video model family's pixel-to-grid map and config dispatch, against the numbers its
MaxDiffusion pipeline gives (VAE compression, patch size, reference frames)."""

import ast
import pathlib
import re

import pytest

from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plugin import families, generations, ltx2, wan_animate, wan_vace
from maxdiffusion_svg.plugin.video_models import (LTX2, WAN, WAN_ANIMATE, WAN_VACE, experts_of,
                                                  grid_of, video_model, wan_size)


@pytest.mark.parametrize("family, video, grid", [
    (WAN, (81, 720, 1280), (21, 45, 80)),  # 4x / 8x VAE, patch 1x2x2
    (LTX2, (121, 704, 1280), (16, 22, 40)),  # 8x / 32x VAE, patch 1: 14,080 tokens
    (LTX2, (121, 1088, 1920), (16, 34, 60)),  # 32,640
    (LTX2, (121, 2176, 3840), (16, 68, 120)),  # 130,560
    (WAN_ANIMATE, (77, 720, 1280), (21, 45, 80)),  # the reference slot + 20 latent frames
    (WAN_VACE, (81, 720, 1280), (21, 45, 80))])
def test_each_family_maps_pixels_to_its_grid(family, video, grid):
  assert family.grid(*video) == VideoGrid(*grid)


def test_a_size_the_vae_does_not_divide_is_refused():
  with pytest.raises(ValueError, match="height must be a multiple of vae_spatial\\*patch = 32"):
    LTX2.grid(121, 720, 1280)
  with pytest.raises(ValueError, match="num_frames must be 1 \\+ a multiple of vae_temporal=8"):
    LTX2.grid(120, 704, 1280)


@pytest.mark.parametrize("keys, family", [
    ({"model_name": "wan2.1"}, WAN), ({"model_name": "wan2.2"}, WAN), ({}, WAN),
    ({"model_name": "ltx2_video"}, LTX2), ({"model_name": "ltx2.3"}, LTX2),
    ({"model_name": "wan2.2", "pose_video_path": ""}, WAN_ANIMATE)])
def test_a_config_names_its_family(keys, family):
  assert video_model(keys) is family


def test_an_unknown_model_is_refused_by_name():
  with pytest.raises(ValueError, match="model_name 'flux' is not a video model the svg kernel "
                                       "runs; it runs wan2.1, wan2.2, ltx2_video, ltx2.3"):
    video_model({"model_name": "flux"})


def test_a_config_grid_reads_its_familys_frames_key():
  keys = {"model_name": "wan2.2", "pose_video_path": "", "segment_frame_length": 77,
          "num_frames": 121, "height": 720, "width": 1280}
  assert grid_of(keys) == VideoGrid(21, 45, 80)  # a segment, not the whole video
  assert grid_of({"model_name": "ltx2_video", "num_frames": 121, "height": 704,
                  "width": 1280}).tokens == 14_080


def test_the_attention_share_is_modelled_for_ltx2_and_the_seeds_for_wan_families():
  from maxdiffusion_svg.plugin.estimate import attention_share  # pylint: disable=import-outside-toplevel
  share, source = attention_share(14_080, family=LTX2)
  assert share == pytest.approx(14_080 / (14_080 + 8 * 4096)) and "modelled from LTX-2" in source
  for family in (WAN, WAN_ANIMATE, WAN_VACE):  # Wan blocks: the seed design's stated 720p share
    share, source = attention_share(75_600, family=family)
    assert share == 0.555 and "seed design" in source


@pytest.mark.parametrize("keys, size", [
    ({"pretrained_model_name_or_path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"}, (30, 12, 15)),
    ({"pretrained_model_name_or_path": "Wan-AI/Wan2.1-T2V-14B-Diffusers"}, (40, 40, 8)),
    ({"model_name": "wan2.2", "pretrained_model_name_or_path": "Wan-AI/Wan2.2-T2V-A14B-Diffusers"},
     (40, 40, 8)),
    ({"vace_reference_images": ["r.png"],
      "pretrained_model_name_or_path": "Wan-AI/Wan2.1-VACE-1.3B-diffusers"}, (30, 12, 15)),
    ({"model_name": "ltx2_video", "pretrained_model_name_or_path": "Lightricks/LTX-2"}, None)])
def test_a_wan_checkpoints_size_comes_from_its_name_once(keys, size):
  """One rule: layers, heads and VACE control blocks by the name; estimate and the pre-flight
  read it where the checkpoint's own config.json is not here (other families have one size:
  their VideoModel's)."""
  from maxdiffusion_svg.plugin import checkpoint, estimate  # pylint: disable=import-outside-toplevel
  found = wan_size(keys)
  assert (None if found is None else (found.layers, found.heads, found.vace_blocks)) == size
  family = video_model(keys)
  shape = checkpoint.model_shape(keys, env={})
  assert not shape.read and "by its" in shape.source and shape.unread
  assert shape.layers == (family.layers if size is None else size[0])
  assert shape.heads == (family.heads if size is None else size[1])
  if family is WAN_VACE:
    assert estimate.dense_blocks_of(keys, shape)[0] == size[2]


@pytest.mark.parametrize("keys, experts", [
    ({"model_name": "wan2.2"}, ("high_noise", "low_noise")),
    ({"model_name": "wan2.2", "pose_video_path": "p.mp4"}, (None,)),  # Animate: one transformer
    ({"model_name": "wan2.1"}, (None,)), ({"model_name": "ltx2_video"}, (None,))])
def test_the_experts_a_run_prepares(keys, experts):
  assert experts_of(keys) == experts


def _ltx2_mentions(path):
  """Whether a module's code names LTX-2: an identifier, an import, or a module path string
  (prose in docstrings and messages aside)."""
  for node in ast.walk(ast.parse(path.read_text())):
    names = []
    if isinstance(node, ast.Name):
      names = [node.id]
    elif isinstance(node, ast.Attribute):
      names = [node.attr]
    elif isinstance(node, ast.ImportFrom):
      names = [node.module or "", *(a.name for a in node.names)]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      names = [node.value] if re.fullmatch(r"maxdiffusion[\w.]*", node.value) else []
    if any("ltx2" in name.lower() for name in names):
      return True
  return False


def test_the_ltx2_family_occupies_its_record_its_module_and_the_drift_guard():
  """Adding a family is its record, its module and what the drift guard expects of MaxDiffusion
  (its benchmarks, bench/ltx2_*, and tiny model, testing/, aside)."""
  package = pathlib.Path(__file__).resolve().parents[2] / "maxdiffusion_svg"
  found = {str(p.relative_to(package)) for p in package.rglob("*.py")
           if p.parts[-2] not in ("bench", "testing") and _ltx2_mentions(p)}
  assert found == {"plugin/video_models.py", "plugin/ltx2.py", "plugin/contract.py"}, found


def test_a_family_module_is_found_through_its_record():
  for family, module in ((LTX2, ltx2), (WAN_ANIMATE, wan_animate), (WAN_VACE, wan_vace)):
    assert family.module == module.__name__
    assert generations.GENERATIONS[family] is module.GENERATION
  assert list(generations.GENERATIONS) == [WAN, LTX2, WAN_ANIMATE, WAN_VACE]
  assert families.family(type(LTX2.model_class, (), {})()) is LTX2  # by its class's name
  assert families.family(type("WanModel", (), {"vace_blocks": ()})()) is WAN_VACE
