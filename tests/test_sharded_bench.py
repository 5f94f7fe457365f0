"""The sharded benchmark: collectives read from HLO, both placements agree, CLI errors."""

import dataclasses
import json

import jax
import pytest

from maxdiffusion_svg.bench.sharded import ShardedBenchConfig, format_sharded_bench, run_sharded_bench
from maxdiffusion_svg.cli import main
from maxdiffusion_svg.geometry import VideoGrid

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
