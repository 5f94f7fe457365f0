"""``bench backward``: its flags, its table, and the backward kernel's steps it prices (no
compile; the compiled figures are in docs/benchmarks.md)."""

import jax.numpy as jnp

from maxdiffusion_svg.bench import backward as bench
from maxdiffusion_svg.cli import main as cli
from maxdiffusion_svg.kernels.splash_backward import backward_tiles, dkv_table_entries
from maxdiffusion_svg.plan.geometry import grid_for_resolution
from maxdiffusion_svg.plan.target import tpu_target
from maxdiffusion_svg.plan.tiles import plan_tiles


def test_the_flags_and_their_defaults():
  args = cli.build_parser().parse_args(["bench", "backward"])
  assert (args.chip, args.backends, args.resolution, args.density, args.heads) == (
      "v6e", "pallas", "720p", 0.3, 5)


def test_the_backward_kernels_steps_are_its_table():
  # Every visited tile once, one empty step per kv tile no query visits, every kv column.
  case = bench.BackwardCase(resolution="480p")
  target, plan, _ = case.setup()
  blocks = bench.backward_blocks_of(case, plan, target)
  full, masked, empty, columns = bench._dkv_tiles(plan, blocks)  # pylint: disable=protected-access
  assert full + masked + empty == dkv_table_entries(plan, blocks)
  assert (full, masked) == (plan.stats.full_tiles, plan.stats.masked_tiles)
  assert columns == plan.num_kv_tiles


def test_the_tiles_are_the_calls():
  # The bench prices the tiles the call's backward takes: on a v5e (16 MiB) a forward tile too
  # large for the backward there (its default 2048x3072, 3328x1536) gets a smaller query tile
  # dividing it, with Splash's kv step; one that fits (2048x1536) is the forward's.
  case = bench.BackwardCase(chip="v5e")
  target, plan, _ = case.setup()
  assert target == tpu_target("v5e")
  blocks = bench.backward_blocks_of(case, plan, target)
  assert blocks == backward_tiles(plan, 256, 128, jnp.bfloat16, target)
  grid = grid_for_resolution("720p")
  for bq, bkv in ((2048, 3072), (3328, 1536)):
    big = plan_tiles(grid, 0.3, bq, bkv, "aligned")
    smaller = backward_tiles(big, 256, 128, jnp.bfloat16, target)
    assert smaller[0] < bq and bq % smaller[0] == 0 and smaller[1:] == (bkv, 256)
  fits = plan_tiles(grid, 0.3, 2048, 1536, "aligned")
  assert backward_tiles(fits, 256, 128, jnp.bfloat16, target) == (2048, 1536, 256)


def test_the_table_names_each_backward():
  row = lambda backward, ok=True: {
      "case": {"backend": "pallas", "backward": backward}, "ok": ok, "error": "boom",
      "temp_mib": 787.0, "backward_bundles": 54_055_525, "xla_bundles": 1_849_032,
      "forward_bundles": 15_859_225}
  text = bench.format_backward_bench({"chip": "v6e", "resolution": "720p", "density": 0.3,
                                      "heads": 5, "libtpu": "x",
                                      "rows": [row("auto"), row("xla", ok=False)]})
  assert "pallas | tokamax's kernel | 787.0 MiB | 54,055,525 | 1,849,032 | 15,859,225" in text
  assert "pallas | XLA scan | failed: boom" in text
