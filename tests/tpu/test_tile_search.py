"""Tiles by the chip's clock (tpu/tile_search.py): candidates, the VMEM fit, the pick and the
cache, with a fake clock (no TPU here); bench chip's table from stored rows."""

import json

import pytest

from maxdiffusion_svg.bench.chip import best_of, format_chip_bench
from maxdiffusion_svg.plan.geometry import grid_for_resolution
from maxdiffusion_svg.plan.target import tpu_target
from maxdiffusion_svg.plan.tiling import SplashTiles
from maxdiffusion_svg.tpu import tile_search as ts

SHAPE = ts.CallShape(grid_for_resolution("720p"), 1, 5, 128, "bfloat16", 0.3, "aligned")
DEFAULT = SplashTiles(2048, 1536, 512)


def test_candidates_are_lane_aligned_and_their_steps_divide_the_kv_tile():
  for mode in ts.SEARCH_MODES:
    tiles = ts.candidate_tiles(mode)
    assert len(set(tiles)) == len(tiles)
    assert all(t.block_q % 128 == t.block_kv % 128 == 0 == t.block_kv % t.block_kv_compute
               for t in tiles)
  assert len(ts.candidate_tiles("smart")) < len(ts.candidate_tiles("full"))
  with pytest.raises(ValueError, match="tile_search_mode must be one of smart, full"):
    ts.candidate_tiles("fast")


def test_only_tiles_our_checks_accept_are_timed():
  fit, refused = ts.fitting_tiles(SHAPE, tpu_target("v5e"), ts.candidate_tiles("full"))
  assert DEFAULT in fit and refused
  assert all("need about" in why for why in refused.values())
  wide, _ = ts.fitting_tiles(SHAPE, tpu_target("v5e", 65536), ts.candidate_tiles("full"))
  assert set(fit) < set(wide)  # a raised limit lets larger tiles in


def _clock(calls):
  """A fake chip: 2048-row tiles of 1024 keys fastest, the default 10% slower."""
  def timer(t):
    calls.append(t)
    return 0.05 + 1e-6 * abs(t.block_q - 2048) + 1e-6 * abs(t.block_kv - 1024) + (
        0.004 if t == DEFAULT else 0.0)
  return timer


def test_the_fastest_candidate_is_picked_cached_and_read_back(tmp_path):
  cache, calls = str(tmp_path / "tiles.json"), []
  first = ts.search_tiles(SHAPE, tpu_target("v5e"), DEFAULT, cache_path=cache,
                          device_kind="TPU v5 lite", timer=_clock(calls))
  timed = [r for r in first.rows if r["seconds"] is not None]
  assert first.picked.label() == min(timed, key=lambda r: r["seconds"])["tiles"]
  assert not first.cached
  assert first.picked == SplashTiles(2048, 1024, 512) and len(calls) == len(timed)
  assert first.default_s > first.picked_s
  assert "timed" in first.line() and "faster than the default 2048x1536/512" in first.line()
  stored = json.load(open(cache, encoding="utf-8"))
  assert list(stored) == [first.key] and stored[first.key]["device_kind"] == "TPU v5 lite"
  again = ts.search_tiles(SHAPE, tpu_target("v5e"), DEFAULT, cache_path=cache,
                          device_kind="TPU v5 lite", timer=_clock(calls := []))
  assert again.cached and not calls and again.picked == first.picked
  assert again.line().startswith("svg tile search (cached)")


def test_the_cache_is_per_chip_shape_density_and_software():
  key = lambda **kw: ts.cache_key(kw.get("kind", "TPU v5 lite"), kw.get("shape", SHAPE), "smart",
                                  16 * 2**20, kw.get("soft", {"jax": "0.10.2"}))
  base = key()
  import dataclasses
  assert key(kind="TPU v6 lite") != base
  assert key(shape=dataclasses.replace(SHAPE, density=0.2)) != base
  assert key(shape=dataclasses.replace(SHAPE, heads=3)) != base
  assert key(soft={"jax": "0.12.0"}) != base
  assert key() == base




def test_failed_candidates_are_recorded(tmp_path):
  def timer(t):
    if t.block_q == 2048:
      raise RuntimeError("RESOURCE_EXHAUSTED: vmem\nmore")
    return 0.05 + 1e-6 * t.block_q
  result = ts.search_tiles(SHAPE, tpu_target("v5e"), DEFAULT, cache_path=str(tmp_path / "c.json"),
                           device_kind="x", timer=timer)
  failed = [r for r in result.rows if r.get("error")]
  assert failed and all(r["error"] == "RESOURCE_EXHAUSTED: vmem" for r in failed)
  assert result.picked.block_q == 1024 and result.default_s is None
  assert "does not fit" in result.line()


def test_the_chip_table_sets_each_kernel_beside_maxdiffusions_fastest():
  rows = [{"case": "c", "kernel": "fixed_m", "tiles": "2048x2048/1024", "best_s": 0.080,
           "of_floor": 0.93},
          {"case": "c", "kernel": "fixed_m", "tiles": "4864x1024/1024", "best_s": 0.082,
           "of_floor": 0.9},
          {"case": "c", "kernel": "svg", "tiles": "2048x1536/512", "mode": "aligned",
           "density": 0.35, "heads": "fixed", "best_s": 0.032, "of_floor": 0.9},
          {"case": "c", "kernel": "flash", "tiles": "512x512/512", "error": "boom"}]
  result = {"device_kind": "TPU v5 lite", "target": "TPU v5e", "software": {"jax": "0.10.2",
            "libtpu": "0.0.42.1"}, "calls_timed": 5, "peak_flops": 197e12, "rows": rows}
  assert best_of(rows, kernel="fixed_m")["tiles"] == "2048x2048/1024"
  text = format_chip_bench(result)
  assert "fixed-m 2048x2048/1024, 80.00 ms" in text
  line = next(l for l in text.splitlines() if l.strip().startswith("svg"))
  assert "32.00" in line and "0.400" in line
  assert "flash" in text and "failed: boom" in text
