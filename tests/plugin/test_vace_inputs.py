"""A Wan VACE generation config: its ``vace_*`` keys make it VACE's (grid, main), and every
mistake in them is refused by the launcher in one line before anything loads."""

import pytest
import yaml

from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plugin import launcher
from maxdiffusion_svg.plugin.vace_inputs import DEFAULTS, VaceInputs
from maxdiffusion_svg.plugin.video_models import WAN, WAN_VACE, grid_of, video_model


def test_the_reference_images_key_makes_a_wan_config_vace_and_adds_its_frames():
  keys = {"model_name": "wan2.1", "num_frames": 81, "height": 720, "width": 1280}
  assert video_model(keys) is WAN and grid_of(keys) == VideoGrid(21, 45, 80)
  for references in (0, 1, 3):  # each reference one latent frame in front of the video's 21
    vace = {**keys, **DEFAULTS, "vace_reference_images": ["r.png"] * references}
    assert video_model(vace) is WAN_VACE
    assert grid_of(vace) == VideoGrid(21 + references, 45, 80)
  assert WAN_VACE.generate_module == "maxdiffusion_svg.plugin.generate_vace"
  assert WAN.generate_module == "maxdiffusion.generate_wan"


def test_the_keys_read_as_the_pipeline_takes_them(tmp_path):
  for name in ("a.png", "b.png", "control.mp4", "mask.mp4"):
    (tmp_path / name).write_bytes(b"x")
  inputs = VaceInputs.from_mapping({
      "vace_reference_images": [str(tmp_path / "a.png"), "https://example.com/b.png"],
      "vace_video": str(tmp_path / "control.mp4"), "vace_mask": f" {tmp_path / 'mask.mp4'} ",
      "vace_conditioning_scale": 0})
  assert inputs == VaceInputs((str(tmp_path / "a.png"), "https://example.com/b.png"),
                              str(tmp_path / "control.mp4"), str(tmp_path / "mask.mp4"), 0.0)
  assert inputs.reference_frames == 2
  assert VaceInputs.from_mapping(DEFAULTS) == VaceInputs()  # reference-free, no control video


@pytest.mark.parametrize("keys, named", [
    ({"vace_reference_images": "ref.png"}, "vace_reference_images is 'ref.png': give a list of "
                                           "image paths or URLs"),
    ({"vace_reference_images": [""]}, "give a list of image paths or URLs"),
    ({"vace_reference_images": ["missing.png"]}, "vace_reference_images[0] is 'missing.png': "
                                                 "no such file"),
    ({"vace_video": "missing.mp4"}, "vace_video is 'missing.mp4': no such file"),
    ({"vace_video": 3}, "vace_video is 3: give a path or URL, or '' for none"),
    ({"vace_mask": "https://example.com/m.mp4"}, "vace_mask is 'https://example.com/m.mp4' but "
                                                 "vace_video is empty"),
    ({"vace_conditioning_scale": -1.0}, "vace_conditioning_scale is -1.0: give a number >= 0"),
    ({"vace_conditioning_scale": True}, "vace_conditioning_scale is True: give a number >= 0")])
def test_a_bad_condition_is_refused_naming_its_key(keys, named, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError) as err:
    VaceInputs.from_mapping({**DEFAULTS, **keys})
  assert named in str(err.value) and "\n" not in str(err.value)


def test_the_launcher_refuses_a_missing_reference_before_anything_loads(tmp_path, capsys):
  (tmp_path / "run.yml").write_text(yaml.safe_dump({
      "model_name": "wan2.1", "attention": "svg", "output_dir": "/tmp/out", "run_name": "t",
      "num_frames": 81, "height": 720, "width": 1280, **DEFAULTS}))
  argv = ["prog", str(tmp_path / "run.yml"), "vace_reference_images=['nowhere.png']"]
  with pytest.raises(SystemExit) as done:
    launcher.main(argv)
  out, err = capsys.readouterr()
  assert (done.value.code, out) == (2, "")
  assert err == ("error: vace_reference_images[0] is 'nowhere.png': no such file (give a local "
                 "path or an http(s) URL)\n")
  # The same config with an existing image passes every check, and names our VACE main.
  (tmp_path / "ref.png").write_bytes(b"x")
  keys, _ = launcher.checked_config([argv[0], argv[1], f"vace_reference_images=['{tmp_path}/ref.png']"])
  assert launcher.maxdiffusion_main(keys, launcher.GENERATE) == WAN_VACE.generate_module


def test_the_run_summary_counts_a_vace_calls_reference_frames_in_its_tokens():
  """A VACE pipeline call's reference images are latent frames of its grid, so a video just
  under ``svg_min_seq_length`` with its references above it is not called short."""
  # pylint: disable=import-outside-toplevel,protected-access
  from maxdiffusion_svg.plugin.run_summary import _reference_frames
  # pylint: enable=import-outside-toplevel,protected-access
  image = object()  # the pipeline's PIL image, as the summary sees it: only counted
  assert [_reference_frames(k) for k in (
      {}, {"reference_images": None}, {"reference_images": image},
      {"reference_images": [image, image]}, {"reference_images": [[image] * 3]})] == [0, 0, 1, 2, 3]
  assert WAN_VACE.grid(13, 128, 128, _reference_frames({"reference_images": [image]})).tokens == 320


def test_the_control_video_is_cut_to_the_frames_the_pipeline_rounds_to():
  from maxdiffusion_svg.plugin.generate_vace import pipeline_frames  # pylint: disable=import-outside-toplevel
  # VaceWanPipeline2_1 makes num_frames 1 + 4k (4·(n // 4) + 1), as the Wan VAE compresses time.
  assert [pipeline_frames(n) for n in (81, 80, 79, 77, 13, 1)] == [81, 81, 77, 77, 13, 1]
