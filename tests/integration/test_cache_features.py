"""MaxDiffusion's step caches with attention: svg, end to end on the tiny Wan 2.1 checkpoint:
CFG cache (cache steps run the conditional half alone, batch 1) and MagCache (skips whole
transformer calls). Each must engage, leave svg's schedule keyed to the real step, and give a
video close to the dense run with the same cache."""

import pathlib

import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
import maxdiffusion

from maxdiffusion_svg.bench import wan_e2e

ROOT = pathlib.Path(__file__).parent.parent.parent
STEPS = 10  # CFG cache (below 720p) caches steps 4-7 of 10: start steps/3, interval 5, end steps-2
TINY = ["height=128", "width=128", "num_frames=33", f"num_inference_steps={STEPS}",
        "max_sequence_length=16", "weights_dtype=float32", "activations_dtype=float32",
        "skip_jax_distributed_system=True", "run_name=tiny", "svg_block_q=128", "svg_block_kv=128",
        "svg_min_seq_length=0", "svg_profile_queries=16",
        # one data shard: MaxDiffusion turns the CFG cache off when the batch does not divide them
        "ici_data_parallelism=1", "ici_context_parallelism=-1"]
SPARSE = ["svg_density=0.3", "svg_active_steps=[2,-1]", "svg_active_layers=[1,-1]"]
LAYERS = 2
WARMUP = 2  # generate_wan's compile warm-up runs two denoising steps before the real run


@pytest.fixture(scope="module")
def setup(tmp_path_factory, wan21_checkpoint):
  base = tmp_path_factory.mktemp("cache_features")
  config = base / "tiny.yml"
  # MagCache's per-step magnitude ratios: MaxDiffusion ships them for Wan 14B only.
  wan14b = pathlib.Path(maxdiffusion.__file__).parent / "configs" / "base_wan_14b.yml"
  ratios = yaml.safe_load(wan14b.read_text())["mag_ratios_base"]
  config.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan_svg_1_3b.yml"),
                                    "mag_ratios_base": ratios}))
  return [str(config), f"pretrained_model_name_or_path={wan21_checkpoint}", *TINY]


def run(setup, workdir, *extra, arrays=False):
  workdir.mkdir()
  out = wan_e2e.generate([*setup, *extra], str(workdir), arrays=arrays)
  return out["frames"], [r for r in out["log"] if r["kind"] == "self"]


def check_schedule(calls):
  for call in calls:
    assert call["sparse"] == (call["step"] >= 2 and call["layer"] >= 1), call


def test_cfg_cache_runs_cached_steps_at_batch_one_on_schedule(setup, tmp_path):
  dense, _ = run(setup, tmp_path / "dense", "attention=dot_product", "use_cfg_cache=True")
  video, calls = run(setup, tmp_path / "svg", "use_cfg_cache=True", *SPARSE, arrays=True)
  real = calls[WARMUP * LAYERS:]
  batches = {c["step"]: c["qkv_out"][0].shape[0] for c in real}
  assert sorted(s for s, b in batches.items() if b == 1) == [4, 5, 6, 7]  # the cached steps
  assert all(b == 2 for s, b in batches.items() if s not in (4, 5, 6, 7))
  assert sorted(batches) == list(range(STEPS))
  check_schedule(real)
  assert wan_e2e.psnr(video, dense) > 40


@pytest.mark.full  # CI time: the CFG-cache test above runs the same skip-on-schedule path
def test_magcache_skips_transformer_calls_and_keeps_the_real_steps(setup, tmp_path):
  # generate_wan's 2-step warm-up keeps int(2 * retention_ratio) steps: at MaxDiffusion's 0.2
  # none, so MagCache skips step 0, before any residual is cached, and fails with any kernel.
  extra = ["use_magcache=True", "retention_ratio=0.5"]
  dense, _ = run(setup, tmp_path / "dense", "attention=dot_product", *extra)
  video, calls = run(setup, tmp_path / "svg", *extra, *SPARSE)
  real = calls[WARMUP * LAYERS:]
  steps = sorted({c["step"] for c in real})
  assert len(real) == LAYERS * len(steps)
  assert steps[:5] == list(range(5)) and len(steps) < STEPS, steps  # skips only after 5 kept
  check_schedule(real)
  assert wan_e2e.psnr(video, dense) > 40
