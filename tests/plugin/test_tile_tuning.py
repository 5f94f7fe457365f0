"""MaxDiffusion's ``enable_tile_search`` keys under ``attention: svg`` (plugin/tile_tuning.py): our
search over our kernel's tiles for the run's per-device call, its pick written into the run's
``svg_block_*`` keys, the cache a second run reads, the keys a user set winning, the skip off a
TPU, and bad keys refused before weights load. No TPU: the chip's clock is a fake keyed on the
tiles, the chip a v6e target."""

import subprocess
import sys

import pytest
import yaml

from maxdiffusion_svg.plan.target import tpu_target
from maxdiffusion_svg.plan.tiling import SplashTiles
from maxdiffusion_svg.plugin import contract, hooks_entry, launcher, preflight, tile_tuning
from maxdiffusion_svg.plugin.config_checks import check_before_weights
from maxdiffusion_svg.plugin.settings import PluginSettings

V6E = tpu_target("v6e", vmem_limit_kib=65536)
KIND = "TPU v6 lite"
FASTEST = SplashTiles(2560, 1024, 512)
MESH = {"data": 1, "fsdp": 1, "context": 8, "tensor": 1}  # configs/wan_svg.yml on a v6e-8


def run_keys(**keys):
  """A Wan 2.1 14B run's keys (480p, 81 frames), one video on 8 devices, the search on."""
  return {"attention": "svg", "model_name": "wan2.1", "num_frames": 81, "height": 480,
          "width": 832, "num_inference_steps": 30, "per_device_batch_size": 0.125,
          "ici_data_parallelism": 1, "ici_fsdp_parallelism": 1, "ici_context_parallelism": -1,
          "dcn_context_parallelism": -1, "ici_tensor_parallelism": 1,
          "mesh_axes": ["data", "fsdp", "context", "tensor"], "enable_tile_search": True,
          "tile_search_mode": "smart", "tile_search_iters": 3, "tile_search_out": "",
          "svg_block_q": 0, "svg_block_kv": 0, "svg_block_kv_compute": 0, **keys}


class Clock:
  """The chip's clock, faked: a call's seconds by its tiles, fastest at ``FASTEST``."""

  def __init__(self):
    self.timed = []

  def __call__(self, tiles):
    self.timed.append(tiles)
    return 1e-3 * (1 + abs(tiles.block_q - FASTEST.block_q) / 1024
                   + abs(tiles.block_kv - FASTEST.block_kv) / 1024
                   + abs(tiles.block_kv_compute - FASTEST.block_kv_compute) / 4096)


class StandInConfig:
  """MaxDiffusion's ``pyconfig`` config: attributes read the raw keys, ``get_keys()`` is them."""

  def __init__(self, **keys):
    self.keys = run_keys(**keys)

  def __getattr__(self, name):
    try:
      return self.__dict__["keys"][name]
    except KeyError:
      raise AttributeError(name) from None

  def get_keys(self):
    return self.keys


def on_v6e(config, clock, **options):
  """The run's search as the hook makes it, on a v6e-8's mesh and chip."""
  return tile_tuning.tune_for_run(config, timer=clock, target=V6E, device_kind=KIND, devices=8,
                                  mesh_shape=MESH, **options)


def test_the_run_takes_the_fastest_tiles_and_a_second_run_reads_the_cache(max_logging, tmp_path):
  config, clock = StandInConfig(tile_search_out=str(tmp_path)), Clock()
  result = on_v6e(config, clock)
  assert result.picked == FASTEST and not result.cached
  assert FASTEST in clock.timed and len(clock.timed) > 10  # the smart ladder, what fits
  keys = config.get_keys()
  assert (keys["svg_block_q"], keys["svg_block_kv"], keys["svg_block_kv_compute"]) == (
      2560, 1024, 512)
  assert (tmp_path / "svg_tiles.json").is_file()  # tile_search_out's cache
  assert max_logging[-1] == f"maxdiffusion_svg: {result.line()}"
  assert "2560x1024/512" in max_logging[-1] and "faster than the default 3328x1536/512" in (
      max_logging[-1])
  # The settings every reader builds from the keys now hold the pick.
  assert PluginSettings.from_mapping(keys).svg.tiles(V6E) == FASTEST

  again, clock = StandInConfig(tile_search_out=str(tmp_path)), Clock()
  del max_logging[:]
  cached = on_v6e(again, clock)
  assert cached.cached and cached.picked == FASTEST and clock.timed == []
  assert again.get_keys()["svg_block_q"] == 2560
  assert max_logging == [f"maxdiffusion_svg: {cached.line()}"] and "(cached)" in max_logging[0]


def test_the_search_times_the_runs_own_call_per_device(tmp_path):
  """40 heads over 8 context shards; one video's CFG pair on each device; moderate's 0.3."""
  call, why = tile_tuning.run_call(run_keys(), V6E, devices=8, mesh_shape=MESH)
  assert why == ""
  shape = call.shape
  assert (shape.batch, shape.heads, shape.head_dim, shape.dtype, shape.density, shape.mode) == (
      2, 5, 128, "bfloat16", 0.3, "aligned")
  assert (shape.grid.frames, shape.grid.height, shape.grid.width) == (21, 30, 52)
  assert call.default == SplashTiles(3328, 1536, 512)  # the run's tiles without the search
  # A 2-way data axis halves the batch; Wan 2.2 times its expert running more sparse steps.
  keys = run_keys(model_name="wan2.2", boundary_ratio=0.875, flow_shift=12.0,
                  svg_high_noise_density=0.5, svg_low_noise_density=0.2,
                  per_device_batch_size=0.0625)
  mesh = {"data": 2, "fsdp": 1, "context": 8, "tensor": 1}
  call, _ = tile_tuning.run_call(keys, V6E, devices=16, mesh_shape=mesh)
  # 30 steps: high-noise runs 0-18, low-noise 19-29; moderate's sparse steps are 6+
  assert (call.shape.batch, call.shape.heads, call.expert, call.shape.density) == (
      1, 5, "high_noise", 0.5)
  keys["svg_active_steps"] = [20, -1]  # sparse only where the low-noise expert runs
  call, _ = tile_tuning.run_call(keys, V6E, devices=16, mesh_shape=mesh)
  assert (call.expert, call.shape.density) == ("low_noise", 0.2)


def test_tiles_the_user_set_win(max_logging, tmp_path):
  config, clock = StandInConfig(svg_block_q=1024, tile_search_out=str(tmp_path)), Clock()
  assert on_v6e(config, clock) is None
  assert clock.timed == [] and not (tmp_path / "svg_tiles.json").exists()
  assert config.get_keys()["svg_block_kv"] == 0  # nothing written
  assert max_logging == ["maxdiffusion_svg: svg tile search: skipped, the tiles are set "
                         "(svg_block_q=1024): the run uses them; set svg_block_q to 0 to search"]


def test_off_a_tpu_the_search_is_skipped_in_one_line(max_logging, tmp_path):
  """The tests' devices are CPUs: the run's own target, nothing injected but the mesh."""
  config, clock = StandInConfig(tile_search_out=str(tmp_path)), Clock()
  assert tile_tuning.tune_for_run(config, timer=clock, mesh_shape=MESH) is None
  assert clock.timed == [] and config.get_keys()["svg_block_q"] == 0
  assert max_logging == ["maxdiffusion_svg: svg tile search: skipped, it times the TPU kernel "
                         "and this run is on cpu: the run keeps its tiles 512x512/256"]


def test_the_search_is_off_unless_enabled_and_for_svg_only(max_logging):
  clock = Clock()
  assert on_v6e(StandInConfig(enable_tile_search=False), clock) is None
  assert on_v6e(StandInConfig(attention="flash"), clock) is None
  assert clock.timed == [] and max_logging == []


def test_maxdiffusions_search_runs_for_other_kernels_only(max_logging, monkeypatch):
  """The hook on generate_wan's and generate_ltx2's maybe_tune_block_sizes."""
  ran = []
  hooked = tile_tuning.tune_block_sizes_hook(ran.append)
  flash = StandInConfig(attention="flash")
  hooked(flash)
  assert ran == [flash]
  monkeypatch.setattr(tile_tuning, "_run_mesh_shape", lambda config: MESH)  # MaxDiffusion's mesh
  hooked(StandInConfig())
  assert ran == [flash] and "skipped, it times the TPU kernel" in max_logging[0]
  hooked_functions = {(e.module, e.name) for e in contract.EXPECTED}
  assert {("maxdiffusion.generate_wan", "maybe_tune_block_sizes"),
          ("maxdiffusion.generate_ltx2", "maybe_tune_block_sizes")} <= hooked_functions


def test_a_pick_the_runs_checks_refuse_is_not_applied(max_logging, tmp_path):
  """Compensation's 3 centroids divide the default key tile (1536), not the fastest (1024)."""
  config = StandInConfig(svg_compensation=True, svg_compensation_blocks=3,
                         tile_search_out=str(tmp_path))
  assert on_v6e(config, Clock()) is None
  assert config.get_keys()["svg_block_q"] == 0
  assert "the run's checks refuse 2560x1024/512" in max_logging[-1]
  assert "keeps its tiles 3328x1536/512" in max_logging[-1]


@pytest.mark.parametrize("keys, named", [
    ({"tile_search_mode": "fast"}, "tile_search_mode must be smart or full, got 'fast': give "
                                   "tile_search_mode=smart"),
    ({"tile_search_iters": 0}, "tile_search_iters must be an integer of at least 1"),
    ({"tile_search_iters": "ten"}, "give tile_search_iters=10"),
    ({"enable_tile_search": "maybe"}, "enable_tile_search must be true or false"),
])
def test_bad_search_keys_are_refused_before_weights_load(keys, named):
  with pytest.raises(ValueError, match=named):
    check_before_weights(run_keys(**keys))
  # the run's own check (generate_wan.run's hook): a Refusal, before the pipeline loads
  loaded = []
  run = hooks_entry.preflight_run(lambda config, pipeline=None: loaded.append(config))
  with pytest.raises(preflight.Refusal, match=named):
    run(StandInConfig(**keys))
  assert loaded == []


def test_a_cache_folder_that_is_a_file_is_refused(tmp_path):
  (tmp_path / "out").write_text("")
  with pytest.raises(ValueError, match="tile_search_out .* is a file, not a folder"):
    check_before_weights(run_keys(tile_search_out=str(tmp_path / "out")))


def test_a_ring_mesh_keeps_its_tiles(tmp_path):
  """The search times whole-sequence calls; a ring's shards run part of one."""
  lines, clock = [], Clock()
  assert tile_tuning.tune_tiles(run_keys(ulysses_shards=4), log=lines.append, timer=clock,
                                target=V6E, device_kind=KIND, devices=8, mesh_shape=MESH,
                                cache_path=str(tmp_path / "tiles.json")) is None
  assert clock.timed == [] and lines == [
      "svg tile search: skipped, ulysses_shards 4 leaves a ring of 2 sequence shards on this "
      "mesh, and the search times whole-sequence calls: the run keeps its tiles 3328x1536/512"]


def test_search_keys_are_not_read_with_the_search_off():
  check_before_weights(run_keys(enable_tile_search=False, tile_search_mode="fast",
                                tile_search_iters=0))


def test_the_launcher_refuses_a_bad_search_key_in_one_line(capsys, tmp_path):
  path = tmp_path / "run.yml"
  path.write_text(yaml.safe_dump({**run_keys(), "output_dir": "/tmp/out", "run_name": "test"}))
  with pytest.raises(SystemExit) as done:
    launcher.main(["prog", str(path), "tile_search_mode=exhaustive"])
  out, err = capsys.readouterr()
  assert (done.value.code, out) == (2, "") and err.count("\n") == 1
  assert err.startswith("error: tile_search_mode must be smart or full, got 'exhaustive'")


def test_tune_tiles_imports_neither_maxdiffusion_nor_tokamax_nor_flax():
  """A script on a TPU host without MaxDiffusion calls tune_tiles (JAX and pyyaml needed)."""
  code = (
      "import sys, importlib.abc\n"
      "class Block(importlib.abc.MetaPathFinder):\n"
      "  def find_spec(self, name, path, target=None):\n"
      "    if name.split('.')[0] in ('maxdiffusion', 'tokamax', 'flax'):\n"
      "      raise ImportError(name)\n"
      "sys.meta_path.insert(0, Block())\n"
      "from maxdiffusion_svg.plugin.tile_tuning import tune_tiles\n")
  subprocess.run([sys.executable, "-c", code], check=True)
