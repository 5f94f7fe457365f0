"""Our kernel's VMEM check against the TPU v5e chip's own compiler: every tile the chip's libtpu
refused at its 16 MiB, the check refuses before compiling; the v5e's default tile passes."""

import json
import pathlib

import jax.numpy as jnp
import pytest

from maxdiffusion_svg.kernels.tpu_memory import check_fits
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import tpu_target
from maxdiffusion_svg.plan.tiles import plan_tiles
from maxdiffusion_svg.plan.tiling import choose_tiles

OUTCOMES = json.loads((pathlib.Path(__file__).parents[2] / "docs" / "measurements" /
                       "chip_v5e_vmem_outcomes.json").read_text(encoding="utf-8"))["rows"]


def _plan(row):
  return plan_tiles(VideoGrid(*row["grid"]), row["density"], row["block_q"], row["block_kv"],
                    row["mode"])


@pytest.mark.parametrize("row", [r for r in OUTCOMES if not r["compiled"]],
                         ids=lambda r: f"{r['block_q']}x{r['block_kv']}/{r['block_kv_compute']}")
def test_tiles_the_chip_refused_are_refused_before_compiling(row):
  with pytest.raises(ValueError, match=r"need about [\d.]+ MiB of VMEM on TPU v5e"):
    check_fits(_plan(row), 128, jnp.bfloat16, row["block_kv_compute"], tpu_target("v5e"),
               "pallas")


def test_the_v5e_default_passes_and_compiled_on_the_chip():
  tiles = choose_tiles(tpu_target("v5e"), "auto")
  rows = [r for r in OUTCOMES if r["compiled"] and (r["block_q"], r["block_kv"],
          r["block_kv_compute"]) == (tiles.block_q, tiles.block_kv, tiles.block_kv_compute)]
  assert {r["mode"] for r in rows} == {"aligned", "split"}
  for row in rows:
    check_fits(_plan(row), 128, jnp.bfloat16, tiles.block_kv_compute, tpu_target("v5e"),
               "pallas")
