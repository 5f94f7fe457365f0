"""bench chip's ring case, without a TPU: each shard's call is its rows against its window, and
MaxDiffusion's ring is its chunk-by-chunk calls (the clock faked; shapes and FLOPs checked)."""

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.bench import chip
from maxdiffusion_svg.parallel.ring_plan import ring_split, window_plan, window_slots
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.tiling import SplashTiles
from maxdiffusion_svg.tpu.tile_search import Timing

CASE = chip.ChipCase("tiny_ring", "test", VideoGrid(5, 8, 15), 1, 2, ring=2, ulysses=2)
TILES = SplashTiles(128, 128, 128)


def _bench(monkeypatch, seen):
  def fake_clock(fn, args, calls, options=None):
    seen.append((fn, args))
    return Timing(0.0, 1e-3, 1e-3, calls)
  monkeypatch.setattr(chip, "time_compiled", fake_clock)
  return chip.ChipBench(None, 1, lambda _: None)


def test_each_shard_runs_its_rows_against_its_window(monkeypatch):
  seen = []
  rows = _bench(monkeypatch, seen).ours_on_ring(CASE, TILES, 0.5)
  plan = chip.ChipBench.shape(CASE, 0.5).plan(TILES)
  split = ring_split(CASE.grid.tokens, 2, 2, 128)
  assert [r["shard"] for r in rows] == [0, 1] and split.chunk % 128 == 0
  for r, (fn, (q, k, v)) in enumerate(seen):
    window = window_plan(plan, split, r)
    assert q.shape == (1, 2, split.chunk, 128)
    assert k.shape == v.shape == (1, 2, window_slots(plan, split) * 128, 128)
    assert rows[r]["flops"] == 4.0 * 2 * window.stats.kept_pairs * 128
    assert jax.eval_shape(fn, q, k, v).shape == q.shape
  # The shards' pairs are the plan's: no pair is run twice or dropped.
  assert sum(window_plan(plan, split, r).stats.kept_pairs for r in range(2)) == \
      plan.stats.kept_pairs


def test_maxdiffusions_ring_is_its_chunk_by_chunk_calls(monkeypatch):
  seen = []
  calls = []

  def fake_dense(case, blocks, fixed, tokens=None):
    calls.append((blocks, fixed, tokens))
    return lambda q, k, v: q + 2.0 * k - v
  monkeypatch.setattr(chip, "custom_dense_call", fake_dense)
  row = _bench(monkeypatch, seen).custom_on_ring(CASE, (256, 256, 128), "test")
  chunk = ring_split(CASE.grid.tokens, 2, 2, 256).natural
  assert calls == [((256, 256, 128), True, chunk)] and 2 * chunk >= CASE.grid.tokens
  assert row["flops"] == 4.0 * 2 * 2 * chunk ** 2 * 128
  fn, (q, k, v) = seen[0]
  halves = [slice(0, chunk), slice(chunk, 2 * chunk)]
  want = sum(q + 2.0 * k[:, :, h] - v[:, :, h] for h in halves)
  np.testing.assert_allclose(np.asarray(fn(q, k, v), np.float32), np.asarray(want, np.float32))


def test_the_table_names_each_shard():
  rows = [{"case": "r", "kernel": "fixed_m", "tiles": "2048x2048/1024", "best_s": 2.0,
           "of_floor": 0.9},
          *({"case": "r", "kernel": "svg", "tiles": "2048x3072/512", "mode": "aligned",
             "density": 0.35, "heads": "fixed", "shard": s, "best_s": 0.8 + s, "of_floor": 0.8}
            for s in (0, 1))]
  text = chip.format_chip_bench({"device_kind": "TPU v5 lite", "target": "v5e",
                                 "software": {"jax": "x", "libtpu": "y"}, "calls_timed": 5,
                                 "peak_flops": 1.97e14, "rows": rows})
  assert "fixed s0" in text and "fixed s1" in text and "0.900" in text
