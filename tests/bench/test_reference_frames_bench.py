"""bench reference-frames: the equal-cost density, the stack against the dense one, the report."""

import numpy as np

from maxdiffusion_svg.bench.reference_frames import (ReferenceBenchConfig, equal_cost_density,
                                                     format_reference_bench, run_reference_bench,
                                                     run_stack)
from maxdiffusion_svg.kernels import dense_attention
from maxdiffusion_svg.plan.geometry import VideoGrid

SMALL = ReferenceBenchConfig(grid=VideoGrid(6, 8, 16), layers=2, densities=(0.25,), seeds=(0,),
                             head_types=("spatial", "temporal", "moving", "spatial"),
                             reference_key_scales=(1.0,))


def test_the_dense_frames_tiles_and_the_equal_cost_density():
  """768 tokens in 128-token tiles: frame 0's 128 rows are one query tile of all 6 key tiles."""
  density, tiles, want = equal_cost_density(SMALL, 0.25)
  sink = SMALL.svg(0.25).plan(SMALL.grid).stats.visited_tiles
  assert want == sink + 6
  costs = {d: SMALL.svg(d).plan(SMALL.grid).stats.visited_tiles
           for d in np.round(np.arange(0.25, 1.0, 0.005), 3)}
  assert tiles == costs[density] and abs(tiles - want) == min(abs(c - want) for c in costs.values())


def test_the_stack_reproduces_the_dense_one_with_dense_attention_and_the_bench_reports():
  dense = lambda q, k, v, layer: dense_attention(q, k, v)
  a, b = run_stack(SMALL, 0, dense), run_stack(SMALL, 0, dense)
  np.testing.assert_array_equal(a, b)  # the same draw from the same seed
  result = run_reference_bench(SMALL)
  runs = result["scales"][0]["rows"][0]["runs"]
  sink, dense_frame = runs["sink"], runs["sink + dense frame 0"]
  # the reference's own rows are exact in every layer with it dense: its state gains the most
  assert dense_frame["reference_psnr"] > sink["reference_psnr"] + 3
  assert np.isfinite(sink["video_psnr"]) and 0 < result["scales"][0]["reference_share"] < 1
  text = format_reference_bench(result)
  assert "sink + dense frame 0" in text and "(equal cost)" in text
