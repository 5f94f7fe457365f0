"""I2V end to end: Wan 2.1 I2V (a CLIP image encoder, image cross-attention) and Wan 2.2 I2V
(the image as latent conditioning), through MaxDiffusion's I2V pipelines."""

import numpy as np
import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.bench import wan_e2e
from maxdiffusion_svg.testing import tiny_checkpoint
from tiny_runs import ROOT, STEPS, SVG_KEYS, TINY, launch


@pytest.fixture(scope="module")
def wan21_i2v(tmp_path_factory):
  """A tiny Wan 2.1 I2V checkpoint (CLIP image encoder, image cross-attention), an image, and
  a config chained onto configs/wan_i2v_svg.yml; and a launcher for it."""
  base = tmp_path_factory.mktemp("i2v")
  checkpoint = tiny_checkpoint.write_wan21_i2v(str(base / "checkpoint"))
  image = tiny_checkpoint.write_image(str(base / "image.png"))
  config = base / "tiny_i2v.yml"
  config.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan_i2v_svg.yml"),
                                    **SVG_KEYS}))
  common = [str(config), f"pretrained_model_name_or_path={checkpoint}", f"image_url={image}",
            *TINY]

  def run(name, *extra):
    (base / name).mkdir()
    return launch(base / name, [*common, *extra])
  return run


@pytest.fixture(scope="module")
def wan21_i2v_dense(wan21_i2v):
  return wan21_i2v("dense", "attention=dot_product")[0]


def test_wan21_i2v_is_sparse_in_self_attention_and_dense_where_the_image_enters(
    wan21_i2v, wan21_i2v_dense):
  """Wan 2.1 I2V through MaxDiffusion's I2V pipeline, from configs/wan_i2v_svg.yml: a tiny CLIP
  image encoder, the image's tokens in cross-attention (their own key/value projections and
  a padding mask), which runs dense; self-attention follows the schedule; the video at
  density 0.3 is sparse and close to the dense one."""
  dense = wan21_i2v_dense
  video, log = wan21_i2v("sparse", "svg_density=0.3")
  assert video.shape == dense.shape == (33, 128, 128, 3)
  self_calls = [(r["step"], r["layer"], r["sparse"]) for r in log if r["kind"] == "self"]
  assert self_calls[-2 * STEPS:] == [(s, l, s >= 1 and l >= 1) for s in range(STEPS)
                                     for l in range(2)]
  # Each block's cross-attention is two dense calls: the text's and the image's (masked).
  assert sum(r["kind"] == "cross" for r in log) == 2 * len(self_calls)
  quality = wan_e2e.psnr(video, dense)
  print(f"tiny Wan 2.1 I2V, density 0.3: video PSNR {quality:.1f} dB against dense")
  assert 20 < quality < 80


@pytest.mark.full  # density 1 = dense is in the CI tier for T2V (test_generate_e2e.py)
def test_wan21_i2v_at_density_one_is_the_dense_video(wan21_i2v, wan21_i2v_dense):
  video, _ = wan21_i2v("one", "svg_density=1.0")
  diff = np.abs(video.astype(int) - wan21_i2v_dense.astype(int))
  assert diff.max() <= 1 and diff.mean() < 1e-3, (diff.max(), diff.mean())


# Full tier: Wan 2.2's experts at their own densities are in the CI tier for T2V
# (test_pipeline.py), image conditioning for Wan 2.1 I2V (above).
@pytest.mark.full
def test_wan22_i2v_experts_run_their_densities_on_the_image_conditioned_latent(
    tmp_path_factory, tmp_path):
  """Wan 2.2 I2V (the image as latent conditioning, no image encoder) through MaxDiffusion's
  I2V 2.2 pipeline, with a config chained onto MaxDiffusion's base_wan_i2v_27b.yml: both
  experts run, each at its own density, and cross-attention stays dense."""
  base = tmp_path_factory.mktemp("i2v22")
  checkpoint = tiny_checkpoint.write_wan22_i2v(str(base / "checkpoint"))
  image = tiny_checkpoint.write_image(str(base / "image.png"))
  config = tmp_path / "tiny_i2v22.yml"
  config.write_text(yaml.safe_dump({
      "base_config": "base_wan_i2v_27b.yml", "attention": "svg", "svg_high_noise_density": 0.5,
      "svg_low_noise_density": 0.2, "svg_active_steps": [0, -1], "svg_active_layers": [0, -1],
      "svg_profile_queries": 16, "svg_block_q": 128, "svg_block_kv": 128,
      "svg_min_seq_length": 0}))
  video, log = launch(tmp_path, [
      str(config), f"pretrained_model_name_or_path={checkpoint}", f"image_url={image}",
      "flow_shift=3.0", "per_device_batch_size=0.125", "num_inference_steps=4",
      *(a for a in TINY if not a.startswith(("svg_", "num_inference_steps")))])
  assert video.shape == (33, 128, 128, 3)
  densities = {(r["expert"], r["density"]) for r in log if r["kind"] == "self" and r["sparse"]}
  assert densities == {("high_noise", 0.5), ("low_noise", 0.2)}
  # No image tokens in cross-attention here: one dense (text) call per block.
  assert sum(r["kind"] == "cross" for r in log) == sum(r["kind"] == "self" for r in log)
