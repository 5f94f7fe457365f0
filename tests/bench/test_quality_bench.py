"""The quality benchmark on a tiny configuration: it runs, is JSON-ready, and says what it should."""

import dataclasses
import json

import pytest

from maxdiffusion_svg.bench.calibration import CalibrationBenchConfig, format_calibration_bench
from maxdiffusion_svg.bench.quality import (QualityBenchConfig, format_quality_bench, psnr, rel_l2,
                                            run_quality_bench)
from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.cli.plot import plot_quality
from maxdiffusion_svg.plan.geometry import VideoGrid

import numpy as np

TINY = QualityBenchConfig(grid=VideoGrid(6, 8, 16), head_types=("spatial", "temporal", "unstructured"),
                          head_dim=32, densities=(0.35, 1.0), modes=("split", "aligned"),
                          block_q=128, block_kv=128, profile_queries=16, router_seeds=2,
                          router_head_types=("spatial", "temporal", "mixed50", "weak_temporal"),
                          router_densities=(0.35,), timing_resolution=None, repeats=1,
                          compensation_heads=1, compensation_densities=(0.35,),
                          compensation_blocks=(4, 8), semantic_heads=1,
                          semantic_densities=(0.35,), semantic_clusters=8,
                          calibration=CalibrationBenchConfig(
                              grid=VideoGrid(4, 8, 16), density=0.35, ladder=(0.35, 1.0),
                              held_out_seeds=(1,)))


def test_tiny_quality_bench(tmp_path):
  messages = []
  result = run_quality_bench(TINY, log=messages.append)
  json.dumps(result)  # JSON-ready
  assert messages  # progress is shown
  for pool in ("prefix", "stratified"):
    assert result["routing"][pool]["accuracy_vs_planted"] == 1.0
    assert result["routing"][f"{pool}/8"]["profile_queries"] == 8
  assert result["oracle"]["accuracy_vs_planted"] == 1.0
  assert result["quality"]["1.0/aligned"]["psnr_db"] > 100  # density 1 reproduces dense
  assert result["quality"]["1.0/aligned"]["rel_l2"] < 1e-5
  assert result["quality"]["0.35/aligned"]["rel_l2"] > 1e-4  # and 0.35 really is sparse
  assert result["timing"]["router_share_of_kernel"] > 0
  routers = result["routers"]["0.35"]
  for masks in ("probe", "execution"):  # the ideal is an upper bound for any router
    assert routers[masks]["gap_db"] >= -1e-9
    assert routers[masks]["psnr_db"] <= routers["ideal_psnr_db"] + 1e-9
  assert routers["ideal_temporal"][:2] == [False, True]  # the clear heads
  comp = result["compensation"]
  assert comp["groups"] == ["spatial", "temporal", "moving", "soft_spatial", "soft_temporal",
                            "soft_moving"]
  row = comp["rows"]["0.35"]
  assert {e["visited_tile_fraction"] for e in row.values()} == {row["off"]["visited_tile_fraction"]}
  assert row["off"]["visited_tile_fraction"] < 1  # sparse: there is something to compensate
  assert comp["recommended_blocks"] in (4, 8)
  sem = result["semantic"]["rows"]["0.35"]
  for kind in ("plain", "compensated"):  # today's router is [spatial, temporal] forced or routed
    for group in ("spatial", "temporal"):
      forced = sem[kind][group]["psnr_db"][group]
      assert sem[kind]["router SVG1"]["psnr_db"][group] == pytest.approx(forced, abs=1e-6)
    assert set(sem[kind]["semantic"]["layout"]) == {2}
  assert np.isfinite(sem["plain"]["semantic"]["psnr_db"]["moving"])  # the moving heads were scored
  best = result["semantic"]["targets"]["router_from_best_db"]
  for kind in ("plain", "compensated"):  # the routed kind against its best single layout
    cell = sem[kind]
    assert best[f"moving {kind} 0.35"] == pytest.approx(cell["router 3 layouts"]["psnr_db"]["moving"] - max(
        cell[n]["psnr_db"]["moving"] for n in ("spatial", "temporal", "semantic")))
  path = tmp_path / "semantic.png"
  from maxdiffusion_svg.bench.semantic_quality import plot_semantic  # pylint: disable=import-outside-toplevel
  plot_semantic(str(path), result["semantic"])
  assert path.read_bytes()[:4] == b"\x89PNG"
  text = format_quality_bench(result)
  assert "semantic layout (measured on CPU)" in text
  assert "three-layout router vs the best single layout per kind at densities 0.1, 0.2, 0.35" in text
  assert "sampled, stratified" in text and "0.35/split" in text and "execution" in text
  assert "recommended compensation_blocks" in text
  assert "calibrated per-layer densities and compensation vs uniform 0.35" in text
  _check_calibration(result["calibration"], TINY.calibration)
  path = tmp_path / "quality.png"
  plot_quality(str(path), TINY, result)
  assert path.read_bytes()[:4] == b"\x89PNG"


def test_metrics():
  ref = np.array([0.0, 1.0, 2.0, 3.0])
  assert psnr(ref, ref) == float("inf")
  assert psnr(ref + 0.1, ref) == pytest.approx(10 * np.log10(9 / 0.01))
  assert rel_l2(ref * 1.1, ref) == pytest.approx(0.1)


def test_planted_types_are_validated():
  with pytest.raises(ValueError, match="head types must be among"):
    planted_qkv(VideoGrid(2, 2, 2), ("diagonal",))


def _attention_masses(grid, kind, seed):
  """Mean softmax mass (self excluded) on the same place in other frames, on the query's and
  adjacent frames, and on keys two or more frames away at another place."""
  q, k, _ = planted_qkv(grid, (kind,), 64, seed=seed)
  logits = q[0, 0] @ k[0, 0].T / 8.0
  np.fill_diagonal(logits, -np.inf)  # a token's own key matches it in every head type
  p = np.exp(logits - logits.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  frame, pos = np.divmod(np.arange(grid.tokens), grid.frame_size)
  same_place = pos[:, None] == pos[None, :]
  near = np.abs(frame[:, None] - frame[None, :]) <= 1
  return [float((p * m).sum(axis=1).mean()) for m in (same_place, near, ~same_place & ~near)]


@pytest.mark.parametrize("seed", [0, 1])
def test_moving_heads_are_neither_spatial_nor_temporal(seed):
  grid = VideoGrid(8, 8, 12)
  spatial, temporal, moving = (_attention_masses(grid, kind, seed)
                               for kind in ("spatial", "temporal", "moving"))
  assert spatial[1] > 0.95 and temporal[0] > 0.95  # the planted heads are what they say
  assert moving[0] < 0.6 and moving[1] < 0.6  # the moving head is neither
  assert moving[2] > 0.25  # it reaches other places in distant frames: its objects moved
  assert spatial[2] < 0.05 and temporal[2] < 0.05


def test_moving_heads_are_deterministic_float32():
  grid = VideoGrid(4, 6, 8)
  a = planted_qkv(grid, ("moving", "moving"), 32, seed=3)
  b = planted_qkv(grid, ("moving", "moving"), 32, seed=3)
  for x, y in zip(a, b):
    assert x.dtype == np.float32 and np.array_equal(x, y)
  assert not np.array_equal(a[0][:, 0], a[0][:, 1])  # each head draws its own objects


def _check_calibration(cal, cfg):
  """Tiles held to uniform's; on the calibration draw the allocation is no worse than uniform;
  one held-out layer's PSNR (its output's error over its power) recomputed against a float64
  dense softmax."""
  from maxdiffusion_svg.bench.calibration import layer_inputs  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.call.attention import svg_attention  # pylint: disable=import-outside-toplevel
  tiles = cal["visited_tiles"]
  assert tiles["calibrated"] <= tiles["uniform"]
  assert cal["calibration"]["error"] <= cal["calibration"]["uniform_error"] + 1e-12
  assert {f"{d:g}{'+compensation' if c else ''}" for d, c in zip(
      cal["densities"], cal["compensation"])} <= set(cal["rungs"])
  assert tiles["densities_only"] <= tiles["uniform"]
  # at matched quality (uniform's error on the calibration draw): no more tiles, each spending
  # judged on the held-out draws beside uniform
  for count in (tiles["matched"], tiles["densities_matched"], cal["per_head"]["matched_tiles"]):
    assert count <= tiles["uniform"] + 1e-9
  assert set(cal["matched_db"]) == {"uniform", "per_layer", "densities_per_layer", "per_head"}
  assert all(len(v) == len(cfg.held_out_seeds) for v in cal["matched_db"].values())
  text = format_calibration_bench(cal)
  assert f"at uniform {cfg.density}'s whole-model error" in text
  assert (f"  per layer, densities alone{' ' * 16}{tiles['densities_matched']:>7.0f} tiles  "
          f"{tiles['uniform'] / tiles['densities_matched']:>5.2f}x") in text
  (q, k, v), = layer_inputs(cfg, cfg.held_out_seeds[0])[2]  # the moving layer
  out = svg_attention(q, k, v, grid=cfg.grid,
                      config=dataclasses.replace(cfg.svg_config(), density=cal["densities"][2],
                                                 compensation=cal["compensation"][2]))
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum("bhqd,bhkd->bhqk", q64, k64) / np.sqrt(q64.shape[-1])
  p = np.exp(logits - logits.max(-1, keepdims=True))
  dense = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v64)
  # the layer's output error over its power: each head weighed by its output power
  rel = ((np.asarray(out, np.float64) - dense) ** 2).sum() / (dense ** 2).sum()
  assert cal["psnr_db"]["calibrated"][2] == pytest.approx(-10 * np.log10(rel), abs=0.05)
  # Per head: within uniform's tiles, densities from the ladder, and the same layer run with its
  # heads' densities (svg_head_densities) gives the PSNR reported.
  heads = cal["per_head"]
  assert heads["tiles"] <= tiles["uniform"] + 1e-9
  # every call compensated: the tiny ladder (0.35, 1) has no compensated choice in budget
  assert heads["compensated"] is None
  assert {d for layer in heads["head_densities"] for d in layer} <= set(cfg.ladder) | {cfg.density}
  out = svg_attention(q, k, v, grid=cfg.grid, config=dataclasses.replace(
      cfg.svg_config(), head_densities=(tuple(heads["head_densities"][2]),)))
  rel = ((np.asarray(out, np.float64) - dense) ** 2).sum() / (dense ** 2).sum()
  assert heads["psnr_db"][2] == pytest.approx(-10 * np.log10(rel), abs=0.05)
