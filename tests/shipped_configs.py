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


# A command-line value for every svg_* key, each different from the key's default.
OVERRIDES = {
    "svg_schedule": "aggressive", "svg_density": "0.2", "svg_active_steps": "[3, -1]",
    "svg_active_layers": "[2, -1]", "svg_high_noise_density": "0.5",
    "svg_low_noise_density": "0.25", "svg_tile_mode": "split", "svg_block_q": "1024",
    "svg_block_kv": "1024", "svg_block_kv_compute": "512", "svg_backend": "xla",
    "svg_vmem_limit_kib": "65536", "svg_include_sink": "false", "svg_dense_frames": "1",
    "svg_sink_frames": "2",
    "svg_profile_queries": "32",
    "svg_profile_pool": "prefix", "svg_sample_max_row": "5000", "svg_profile_masks": "probe",
    "svg_profile_seed": "3", "svg_dense_kernel": "dot_product", "svg_min_seq_length": "1024",
    "svg_run_summary": "false", "svg_compensation": "true", "svg_compensation_blocks": "4",
    "svg_layouts": "[spatial]", "svg_semantic_clusters": "16", "svg_semantic_iterations": "2",
    "svg_semantic_warm_iterations": "2", "svg_layer_densities": "[0.2, 0.4]",
    "svg_high_noise_layer_densities": "{0-1: 0.5}", "svg_low_noise_layer_densities": "[0.1, 0.3]",
    "svg_layer_compensation": "[true, false]", "svg_high_noise_layer_compensation": "{0-1: true}",
    "svg_low_noise_layer_compensation": "[false, true]", "svg_head_densities": "[0.2, 0.4]",
    "svg_high_noise_head_densities": "[[0.5, 0.3]]",
    "svg_low_noise_head_densities": "{0-1: [0.1, 0.3]}",
    "svg_calibrated_on": '{"prompts": 3}', "svg_calibration_check": "false",
}
