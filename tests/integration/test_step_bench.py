"""``bench step`` on MaxDiffusion's Wan 2.1 14B (720p) and 1.3B (480p, its cross-attention on
MaxDiffusion's flash) forwards for a v6e-8 (libtpu, no TPU needed; two 2-layer compiles each,
full tier): each program's classes sum to its priced total, the router leaves no computation
larger than the sparse kernel in a sparse layer, the flash calls are cross-attention's, and the
step is the stored one."""

import pytest
from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.tpu.aot import libtpu_available

if not libtpu_available():
  pytest.skip("libtpu is not installed (pip install 'jax[tpu]'): nothing can compile for a TPU",
              allow_module_level=True)

from maxdiffusion_svg.bench.step import CLASSES, format_step, run_step_bench
from maxdiffusion_svg.tpu.step_prices import STEP_PRICES, prices_from_step, step_key

pytestmark = pytest.mark.full


@pytest.fixture(scope="module", params=["configs/wan_svg.yml", "configs/wan_svg_1_3b.yml"])
def result(request):
  out = run_step_bench(request.param, "v6e-8", layers=2, log=lambda _: None)
  print(format_step(out))
  return out


def test_each_programs_classes_sum_to_its_total(result):
  for program in result["programs"].values():
    layers = result["layers_compiled"]
    own = sum(sum(b.values()) for b in program["branches"].values())
    classed = sum(program["outside"].values()) + layers * (sum(program["shared"].values()) + own)
    assert classed == pytest.approx(program["total"])
    assert set(program["outside"]) == set(CLASSES)


def test_no_xla_in_a_sparse_layer_outweighs_its_kernel(result):
  svg = result["programs"]["svg"]
  kernel = result["kernel_calls_per_head"]["fixed"]["sparse"] * result["heads_per_device"] * (
      result["batch"])
  # The XLA around the kernel grows with the tokens, the kernel with their square: 22% of it for
  # the 14B at 720p, 85% for the 1.3B at 480p (docs/benchmarks.md); the router's gather had
  # made it twice the kernel.
  share = 1.0 if "1_3b" in result["config"] else 0.5
  assert svg["layer"]["1"]["self-attention"] < share * kernel


def test_flash_runs_cross_attention_where_the_config_sends_it(result):
  for program in result["programs"].values():
    flash = sum(program["flash_calls"].values())
    assert bool(flash) == ("1_3b" in result["config"])
    # Each flash call is one per layer, in cross-attention (its XLA beside it).
    assert program["shared"]["cross-attention"] >= flash


def test_the_step_is_the_stored_one(result):
  key = step_key(result)
  assert prices_from_step(result, STEP_PRICES[key].source) == STEP_PRICES[key]
