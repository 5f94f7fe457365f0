"""Each model family's shipped config through our launcher and through a patched MaxDiffusion
``generate``: it reaches that model's own entry point (``generate_ltx2``,
``generate_wan_animate``, our ``generate_vace``; ``train_wan_vace`` through
``maxdiffusion_svg.train_vace``) with the merged config and its ``svg_*`` keys. The entry
point's work function is replaced, so nothing loads."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from tiny_runs import ROOT

SCRIPT = """
import json, runpy, sys
from maxdiffusion_svg import plugin
plugin.register()  # its import order (Triton before TensorFlow) as the entry points have it
import importlib
ENTRY = sys.argv[1]
module, function = ENTRY.split(":")
target = importlib.import_module(module)
def run(config, pipeline=None, *args, **kwargs):  # the signatures the drift guard expects
  from maxdiffusion_svg.plugin.settings import PluginSettings
  keys = config.get_keys()
  svg = PluginSettings.from_mapping(keys).svg
  print("RAN " + json.dumps({"entry": ENTRY, "model_name": keys["model_name"],
                             "attention": keys["attention"], "density": svg.density,
                             "steps": [svg.schedule.active_steps.start,
                                       svg.schedule.active_steps.end]}))
run._svg_hook = True  # stands in for the work function and its pre-flight hook: nothing loads
setattr(target, function, run)
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

LTX2 = "maxdiffusion.generate_ltx2:run"
ANIMATE = "maxdiffusion.generate_wan_animate:run"
VACE = "maxdiffusion.train_wan_vace:train"
VACE_GENERATE = "maxdiffusion_svg.plugin.generate_vace:run"  # MaxDiffusion has no VACE main


@pytest.mark.parametrize("module, config, entry, model, steps", [
    ("maxdiffusion.generate", "ltx2_svg.yml", LTX2, "ltx2_video", [8, None]),  # the patch, alone
    pytest.param("maxdiffusion_svg.generate", "ltx2_svg.yml", LTX2, "ltx2_video", [8, None],
                 marks=pytest.mark.full),
    pytest.param("maxdiffusion_svg.generate", "ltx2_3_svg.yml", LTX2, "ltx2.3", [8, None],
                 marks=pytest.mark.full),
    pytest.param("maxdiffusion.generate", "ltx2_3_svg.yml", LTX2, "ltx2.3", [8, None],
                 marks=pytest.mark.full),
    pytest.param("maxdiffusion_svg.generate", "wan_animate_svg.yml", ANIMATE, "wan2.2",
                 [6, None], marks=pytest.mark.full),
    ("maxdiffusion.generate", "wan_animate_svg.yml", ANIMATE, "wan2.2", [6, None]),
    pytest.param("maxdiffusion_svg.train_vace", "wan_vace_svg_train.yml", VACE, "wan2.1", [0, None],
                 marks=pytest.mark.full),
    pytest.param("maxdiffusion_svg.generate", "wan_vace_svg.yml", VACE_GENERATE, "wan2.1",
                 [10, None], marks=pytest.mark.full),
    # the patch runs generate_wan for a wan2.1 config; the plugin hands a VACE one to ours
    ("maxdiffusion.generate", "wan_vace_svg.yml", VACE_GENERATE, "wan2.1", [10, None])])
def test_each_config_reaches_its_models_entry_point(module, config, entry, model, steps,
                                                     patched_maxdiffusion, tmp_path):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(patched_maxdiffusion / "src"),
                                                      str(ROOT)])}
  extra = ["train_data_dir=/nonexistent", "output_dir=/tmp/out"] if "train" in module else []
  if module == "maxdiffusion_svg.generate":
    extra.append("--verbose")  # the stand-in prints RAN where MaxDiffusion prints: on stdout
  result = subprocess.run(
      [sys.executable, "-c", SCRIPT, entry, module, str(ROOT / "configs" / config),
       "svg_density=0.25", "run_name=entry", "enable_ml_diagnostics=false", *extra],
      cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  ran = json.loads(result.stdout.split("RAN ", 1)[1].splitlines()[0])
  assert ran == {"entry": entry, "model_name": model, "attention": "svg", "density": 0.25,
                 "steps": steps}


@pytest.mark.parametrize("tool", ["compare", "calibrate"])
def test_a_vace_checkpoint_goes_with_a_vace_config_only(tool, tmp_path):
  """compare and calibrate run a VACE checkpoint through our VACE main, so a Wan config naming
  one (known by its transformer's vace_layers) is refused before anything loads, and a VACE
  config naming a plain Wan checkpoint too."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin.calibrate import plan_calibration
  from maxdiffusion_svg.plugin.compare import plan_comparison
  # pylint: enable=import-outside-toplevel
  for name, transformer in (("vace", {"num_attention_heads": 12, "vace_layers": [0, 2],
                                      "vace_in_channels": 96}),
                            ("wan", {"num_attention_heads": 12})):
    (tmp_path / name / "transformer").mkdir(parents=True)
    (tmp_path / name / "transformer" / "config.json").write_text(json.dumps(transformer))
  cases = (("wan_svg_1_3b.yml", "vace", r"is a Wan VACE checkpoint \(its transformer has "
                                        r"vace_layers\) but the config is Wan's: give a VACE "
                                        r"config, e.g. configs/wan_vace_svg.yml"),
           ("wan_vace_svg.yml", "wan", r"is not a Wan VACE checkpoint \(its transformer has no "
                                       r"vace_layers\) but the config is Wan VACE's"))
  for config, checkpoint, message in cases:
    overrides = ["prompt=a cat", f"pretrained_model_name_or_path={tmp_path / checkpoint}"]
    with pytest.raises(ValueError, match=message) as err:
      if tool == "compare":
        plan_comparison(str(ROOT / "configs" / config), overrides, "flash", ["config"],
                        str(tmp_path / "out"), False)
      else:
        plan_calibration(str(ROOT / "configs" / config), overrides, str(tmp_path / "out.yml"))
    assert "\n" not in str(err.value)


def test_vace_conditions_load_as_the_pipeline_takes_them(tmp_path):
  """Our VACE main's conditions from files: the references as images, the control video and
  its mask resized to the video and cut to the frames the pipeline generates; a control video
  shorter than that is refused, naming the key and the frames."""
  # pylint: disable=import-outside-toplevel
  import types

  from maxdiffusion_svg.plugin.generate_vace import conditions
  from maxdiffusion_svg.plugin.vace_inputs import VaceInputs
  from maxdiffusion_svg.testing import tiny_vace
  # pylint: enable=import-outside-toplevel
  inputs = VaceInputs.from_mapping(tiny_vace.write_inputs(tmp_path, references=2, control=True))
  config = types.SimpleNamespace(width=64, height=32, num_frames=10)  # the pipeline makes 9
  loaded = conditions(config, inputs)
  assert [image.size for image in loaded["reference_images"]] == [(128, 128)] * 2
  for key in ("video", "mask"):
    assert len(loaded[key]) == 9 and {f.size for f in loaded[key]} == {(64, 32)}
  assert loaded["mask"][0].getpixel((0, 0))[0] < 64 < loaded["mask"][0].getpixel((63, 0))[0]
  config.num_frames = 17  # the control video has 13
  with pytest.raises(ValueError, match=r"vace_video '.*vace_video.mp4' has 13 frames; the "
                                       r"pipeline generates 17 \(num_frames 17\): give a video of "
                                       r"at least 17 frames, or num_frames=13"):
    conditions(config, inputs)
  # The hint is a num_frames the video fills: 12 frames give 9 (the pipeline makes 12 into 13).
  import imageio  # pylint: disable=import-outside-toplevel
  short = tmp_path / "short.mp4"
  imageio.mimwrite(short, [np.zeros((32, 64, 3), np.uint8)] * 12, fps=16, macro_block_size=1)
  with pytest.raises(ValueError, match=r"has 12 frames; the pipeline generates 17 \(num_frames "
                                       r"17\): give a video of at least 17 frames, or "
                                       r"num_frames=9$"):
    conditions(config, VaceInputs(video=str(short)))
