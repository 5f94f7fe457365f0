"""calibrate's record of what its budgets were measured on, and the run's check against it."""

import re

import pytest

from maxdiffusion_svg.plugin.calibration_record import check_record, measured_on, record

RUN = {"pretrained_model_name_or_path": "Wan-AI/Wan2.1-T2V-14B-Diffusers", "height": 720,
       "width": 1280, "num_frames": 81, "num_inference_steps": 50, "svg_dense_kernel": ""}


def test_a_run_at_the_recorded_keys_passes_and_each_other_key_is_refused_by_name():
  calibrated = {**RUN, "svg_calibrated_on": record(RUN, prompts=4)}
  assert dict(measured_on(calibrated))["prompts"] == 4
  check_record(calibrated)
  check_record({**calibrated, "prompt": "another prompt"})  # prompts are not compared
  for key, value in (("height", 480), ("width", 832), ("num_frames", 121),
                     ("num_inference_steps", 30), ("svg_dense_kernel", "dot_product"),
                     ("pretrained_model_name_or_path", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")):
    with pytest.raises(ValueError, match=re.escape(f"measured with {key} {RUN[key]!r}, and this "
                                                   f"run has {key} {value!r}")):
      check_record({**calibrated, key: value})
    check_record({**calibrated, key: value, "svg_calibration_check": False})


def test_animate_compares_its_segment_length_and_a_checkpoint_folder_by_its_path(tmp_path,
                                                                                 monkeypatch):
  animate = {**RUN, "model_name": "wan2.2", "pose_video_path": "p.mp4",
             "segment_frame_length": 77, "pretrained_model_name_or_path": str(tmp_path)}
  measured = record(animate, 1)
  assert "segment_frame_length" in measured and "num_frames" not in measured
  monkeypatch.chdir(tmp_path.parent)  # the same folder, named relatively
  check_record({**animate, "pretrained_model_name_or_path": tmp_path.name,
                "svg_calibrated_on": measured})
  with pytest.raises(ValueError, match="segment_frame_length 77, and this run has "
                                       "segment_frame_length 49"):
    check_record({**animate, "segment_frame_length": 49, "svg_calibrated_on": measured})


def test_no_record_checks_nothing_and_a_bad_one_names_the_key():
  check_record({**RUN, "svg_calibrated_on": {}})
  check_record(RUN)
  with pytest.raises(ValueError, match="svg_calibrated_on must be a mapping"):
    check_record({**RUN, "svg_calibrated_on": [1, 2]})
