"""What the end-to-end tests share: the tiny video's overrides and the in-process launcher."""

import pathlib

from maxdiffusion_svg.bench import wan_e2e

ROOT = pathlib.Path(__file__).parent.parent.parent
STEPS = 3
# A 33-frame 128x128 video: a 9x8x8 = 576-token grid; 128-token tiles so SVG has tiles to skip.
TINY = ["height=128", "width=128", "num_frames=33", f"num_inference_steps={STEPS}",
        "max_sequence_length=16", "weights_dtype=float32", "activations_dtype=float32",
        "skip_jax_distributed_system=True", "run_name=tiny", "svg_block_q=128",
        "svg_block_kv=128", "svg_min_seq_length=0"]
# Keys the shipped configs leave to the preset; here so that the command line can set them.
SVG_KEYS = {"svg_density": 0.3, "svg_active_steps": [1, -1], "svg_active_layers": [1, -1],
            "svg_profile_queries": 16}


def write_run_config(directory):
  """A config that extends the shipped 1.3B one with :data:`SVG_KEYS` (a chain: run ->
  wan_svg_1_3b -> MaxDiffusion's); its path."""
  import yaml  # pylint: disable=import-outside-toplevel
  path = directory / "tiny_svg.yml"
  path.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan_svg_1_3b.yml"),
                                  **SVG_KEYS}))
  return str(path)


def launch(workdir, argv):
  """The launcher in this process: the frames it exported and the svg kernel's call log."""
  out = wan_e2e.generate(argv, str(workdir))
  return out["frames"], out["log"]
