"""`bench schedule --maxdiffusion`: MaxDiffusion's own flash attention compiled for a v6e with
its schedule read back, priced over every tile of the padded sequence."""

import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.bench.schedule import (MAXDIFFUSION_VMEM_KIB, maxdiffusion_v6e_blocks,
                                             ScheduleCase, run_case)
from maxdiffusion_svg.tpu.aot import libtpu_available


@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")
def test_maxdiffusion_flash_is_one_body_over_every_tile():
  # 5x16x32 = 2,560 tokens: one 3024-row q tile, two 2048-column kv tiles.
  row = run_case(ScheduleCase("v6e", (5, 16, 32), 1.0, "aligned", *maxdiffusion_v6e_blocks(),
                              MAXDIFFUSION_VMEM_KIB, kernel="maxdiffusion_flash"),
                 log=lambda _: None)
  assert row["ok"], row["error"]
  kernel = row["kernel"]
  assert (row["tiles_full"], row["tiles_masked"], row["rows"]) == (2, 0, 1)
  # A 3024x2048 tile with kv steps of 1024: two steps of QK^T and PV per tile.
  assert kernel["full"]["matmuls"] > 0 and kernel["full"]["exps"] > 0
  init = kernel["row_init"]["bundles"] if kernel["row_init"] else 0
  final = kernel["row_final"]["bundles"] if kernel["row_final"] else 0
  assert row["static_bundles"] == init + final + 2 * (kernel["full"]["bundles"] +
                                                     kernel["step_overhead"])


def test_the_v6e_blocks_are_read_from_maxdiffusions_own_config():
  # base_wan_14b.yml's commented "# Use on v6e" flash_block_sizes block, at the tested commit.
  assert maxdiffusion_v6e_blocks() == (3024, 2048, 1024)
