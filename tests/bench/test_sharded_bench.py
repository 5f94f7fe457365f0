"""The sharded benchmark: collectives read from HLO, both placements agree, CLI errors."""

import dataclasses
import json

import jax
import pytest

from maxdiffusion_svg.bench.sharded import (ShardedBenchConfig, format_sharded_bench,
                                            run_sharded_bench)
from maxdiffusion_svg.cli.main import main
from maxdiffusion_svg.plan.geometry import VideoGrid

ARGS = ["--latent-grid", "5x6x9", "--heads", "8", "--head-dim", "16", "--block-q", "128",
        "--block-kv", "128", "--repeats", "1"]


@pytest.fixture(autouse=True)
def eight_devices():
  if jax.device_count() < 8:
    pytest.fail("needs the 8 simulated devices tests/conftest.py asks for")


def test_after_moves_only_the_four_exchanges_and_agrees_with_before():
  cfg = ShardedBenchConfig(grid=VideoGrid(5, 6, 8), heads=8, head_dim=16, block_q=128,
                           block_kv=128, repeats=1)
  result = run_sharded_bench(cfg, log=lambda _: None)
  after, before = result["placements"]["after"], result["placements"]["before"]
  # q, k, v in and the output back: [1, 8, 240 / 8, 16] float32 per device, 7/8 of it sent.
  local = 1 * 8 * (240 // 8) * 16 * 4
  assert after["collectives"] == {"all-to-all": {"count": 4, "bytes": 4 * local * 7 / 8}}
  assert before["collective_bytes"] > 2 * after["collective_bytes"]
  assert result["max_abs_difference"] < 1e-5
  text = format_sharded_bench(result)
  assert "after exchange" in text and "before exchange" in text and "single-device" in text
  # Compiling on abstract inputs counts the same collectives, without running anything.
  counted = run_sharded_bench(dataclasses.replace(cfg, timing=False), log=lambda _: None)
  assert counted["placements"] == {name: {key: row[key] for key in counted["placements"][name]}
                                   for name, row in result["placements"].items()}
  assert "time_s" not in counted["placements"]["after"]
  assert "compiled only" in format_sharded_bench(counted)


def test_cli_writes_json(tmp_path, capsys):
  path = tmp_path / "sharded.json"
  assert main(["bench", "sharded", *ARGS, "--json", str(path)]) == 0
  assert "before/after:" in capsys.readouterr().out
  result = json.loads(path.read_text())
  assert result["tokens"] == 270 and result["devices"] == 8
  assert not result["inputs_sequence_sharded"]  # 270 tokens do not split over 8 devices
  assert result["max_abs_difference"] < 1e-5
  assert set(result["placements"]) == {"after", "before"}


def test_cli_errors_name_the_problem(capsys):
  assert main(["bench", "sharded", *ARGS[:2], "--heads", "4"]) == 2
  assert "heads (4) must be divisible by the 8 shards" in capsys.readouterr().err
  assert main(["bench", "sharded", *ARGS[:2], "--devices", "64"]) == 2
  assert "--devices 64 needs 64 devices" in capsys.readouterr().err


RING_ARGS = ["--latent-grid", "8x8x16", "--heads", "4", "--head-dim", "16", "--block-q", "128",
             "--block-kv", "128", "--batch", "2", "--density", "0.5"]


def test_ulysses_shards_measures_what_the_ring_plan_says(tmp_path, capsys):
  """svg on 2 x 4 simulated devices: the compiled program's exchange, placement and key
  permutes are exactly the bytes the ring plan computes, and nothing is resharded."""
  from maxdiffusion_svg.budgets.config import SvgConfig
  from maxdiffusion_svg.parallel.ring_plan import key_fetch, ring_split
  path = tmp_path / "ring.json"
  assert main(["bench", "sharded", *RING_ARGS, "--ulysses-shards", "2", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "measured from compiled HLO" in out and "computed from the plan, U x R = 2x4" in out
  result = json.loads(path.read_text())
  row = result["splits"]["2x4"]
  roles, plan = row["kernels"]["svg"]["roles"], row["plan"]
  assert set(roles) <= {"exchange", "placement", "keys", "merge"}  # no reshard: 1,024 tokens fit
  assert roles["exchange"] == {"count": 4, "bytes": plan["exchange_bytes"]}
  assert roles["placement"]["count"] == 4 and roles["placement"]["bytes"] == plan["placement_bytes"]
  # Every hop's buffer, for K and V: [1, 2 batch x 4 heads / 2, width x piece, 16] float32.
  grid = VideoGrid(8, 8, 16)
  svg_plan = SvgConfig(density=0.5, block_q=128, block_kv=128, backend="xla").plan(grid)
  fetch = key_fetch(svg_plan, ring_split(grid.tokens, 4, 2, 128))
  token = 2 * 4 // 2 * 16 * 4
  permuted = sum(2 * hop.send.shape[1] * fetch.piece * token for hop in fetch.hops)
  assert sum(op["bytes"] for op in row["kernels"]["svg"]["ops"]
             if op["op"] == "collective-permute") == permuted
  assert plan["ring"] == 4 and plan["chunk"] == 256 and len(plan["shards_fetched"]) == 4
  assert max(plan["keys_bytes"]) <= plan["ring_keys_bytes"]
  assert row["schedule"] is None  # CPU devices: no chip to price


def test_ulysses_shards_flags_name_the_problem(capsys):
  assert main(["bench", "sharded", *RING_ARGS, "--ulysses-shards", "2",
               "--against", "ulysses_ring"]) == 2
  assert "give --topology" in capsys.readouterr().err
  assert main(["bench", "sharded", *RING_ARGS, "--ulysses-shards", "3"]) == 2
  assert "ulysses_shards (3)" in capsys.readouterr().err
  assert main(["bench", "sharded", *RING_ARGS, "--data", "2"]) == 2
  assert "give --ulysses-shards" in capsys.readouterr().err
