"""The target decides: executor, Splash tiles and the limits they are checked against."""

import types

import jax
import jax.numpy as jnp
import pytest

from maxdiffusion_svg import SvgConfig, grid_for_resolution, plan_tiles, sparse_attention
from maxdiffusion_svg.kernels.tpu_memory import check_fits, smem_estimate, vmem_need
from maxdiffusion_svg.plan.target import (GENERATIONS, GENERIC_TPU, MIB, Target,
                                          generation_for_kind, generation_named, target_for_devices,
                                          target_of, tpu_target, vmem_limit_from_flags)
from maxdiffusion_svg.plan.tiling import (PALLAS_TILES, PALLAS_TILES_BY_GENERATION,
                                          PALLAS_TIMED_TILES, SPLASH_TILES, UNKNOWN_TPU_TILES,
                                          SplashTiles, default_tiles)
from maxdiffusion_svg.tpu.aot import abstract, chip_mesh, libtpu_available

needs_libtpu = pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")


def device(kind, platform="tpu"):
  return types.SimpleNamespace(device_kind=kind, platform=platform)


def test_device_kinds_name_their_generation_and_unknown_tpus_get_the_smallest_limits():
  assert generation_for_kind("TPU v5 lite").name == "v5e"
  assert generation_for_kind("TPU v6 lite").name == "v6e"
  assert generation_for_kind("TPU v5").name == "v5p"
  assert generation_for_kind("TPU v4").name == "v4"
  assert generation_for_kind("TPU7x").name == "tpu7x"
  assert generation_named("v7x").name == "tpu7x"  # the name Google's docs also use
  assert generation_for_kind("TPU9z") is GENERIC_TPU
  assert GENERIC_TPU.default_scoped_vmem == min(g.default_scoped_vmem for g in GENERATIONS.values())
  assert target_for_devices([device("cpu", "cpu")]) == Target("cpu")
  assert target_of().platform == "cpu"  # this host


def test_the_vmem_limit_comes_from_the_key_then_libtpu_flags_then_the_generation(monkeypatch):
  monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
  assert target_for_devices([device("TPU v5 lite")]).vmem_limit == 16 * MIB
  assert target_for_devices([device("TPU v6 lite")]).vmem_limit == 32 * MIB
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--foo=1 --xla_tpu_scoped_vmem_limit_kib=65536")
  assert vmem_limit_from_flags() == 64 * MIB
  assert target_for_devices([device("TPU v5 lite")]).vmem_limit == 64 * MIB
  assert target_for_devices([device("TPU v5 lite")], vmem_limit_kib=32768).vmem_limit == 32 * MIB
  with pytest.raises(ValueError, match=r"asks for 262144 KiB of scoped VMEM, more than TPU v6e's "
                                       r"131072 KiB"):
    tpu_target("v6e", vmem_limit_kib=262144)
  # LIBTPU_INIT_ARGS is capped at the chip's VMEM, as the compiler caps it.
  assert tpu_target("v4").vmem_limit == 16 * MIB


def test_default_tiles_follow_the_limit_and_user_keys_win(monkeypatch):
  monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
  tiles = lambda config, gen, limit=None: config.tiles(tpu_target(gen, limit))
  splash = SvgConfig(backend="splash")
  assert tiles(splash, "v5e") == SPLASH_TILES[-1][1]
  assert (tiles(splash, "v6e").block_q, tiles(splash, "v6e").block_kv) == (3328, 1536)
  assert tiles(splash, "v6e", 65536) == default_tiles(tpu_target("v6e", 65536), "splash")
  # The config's own limit reaches the tiles, whatever target it is given.
  assert SvgConfig(vmem_limit_kib=65536, backend="splash").tiles(tpu_target("v6e")) == \
      SPLASH_TILES[0][1]
  assert splash.tiles(tpu_target()) == UNKNOWN_TPU_TILES
  # Our kernel (auto on a TPU): the tile timed on a v5e where the MXU is 128 wide (and on a TPU
  # of unknown generation), the static schedule's pick on v6e and TPU7x, whatever the limit.
  for target in (tpu_target("v5e"), tpu_target("v4"), tpu_target("v5p"), tpu_target()):
    assert SvgConfig().tiles(target) == PALLAS_TIMED_TILES == SplashTiles(2048, 3072, 512)
  for target in (tpu_target("v6e"), tpu_target("v6e", 65536), tpu_target("tpu7x")):
    assert SvgConfig().tiles(target) == PALLAS_TILES == SplashTiles(3328, 1536, 512)
  assert set(PALLAS_TILES_BY_GENERATION) == set(GENERATIONS)
  assert tiles(SvgConfig(block_kv=1024), "v6e").block_kv_compute == 512
  assert tiles(SvgConfig(block_kv=1280), "v6e").block_kv_compute == 256
  assert tiles(SvgConfig(block_q=1024), "v6e").block_q == 1024
  assert tiles(SvgConfig(block_kv=1024, backend="splash"), "v6e").block_kv_compute == 256
  assert tiles(SvgConfig(block_kv=1152, backend="splash"), "v6e").block_kv_compute == 128
  assert SvgConfig(backend="auto").tiles(Target("cpu")).block_q == 512  # the XLA path's
  assert SvgConfig(block_q=0, vmem_limit_kib=0) == SvgConfig()  # 0: the default, from YAML
  with pytest.raises(ValueError, match=r"svg_block_kv_compute \(1024\) must divide svg_block_kv "
                                       r"\(1536, the default for TPU v6e"):
    SvgConfig(block_kv_compute=1024).tiles(tpu_target("v6e"))


def test_every_default_fits_its_own_limit_by_the_estimate():
  for generation in GENERATIONS:
    for limit in (None, 65536) if GENERATIONS[generation].vmem >= 64 * MIB else (None,):
      target = tpu_target(generation, limit)
      for resolution in ("720p", "1080p", "1440p"):
        for mode in ("naive", "split", "aligned"):
          for backend in ("pallas", "splash"):
            config = SvgConfig(tile_mode=mode, density=0.3, backend=backend)
            t = config.tiles(target)
            check_fits(config.plan(grid_for_resolution(resolution), target=target), 128,
                       jnp.bfloat16, t.block_kv_compute, target, backend)


def test_smem_estimate_matches_the_compiler_report():
  # libtpu: "Used 1.17M of 1.00M smem" for this plan's tables (tests/tpu/test_tpu_compile.py).
  plan = plan_tiles(grid_for_resolution("1440p"), 1.0, 1024, 1024, "aligned", include_sink=False)
  assert abs(smem_estimate(plan) / MIB - 1.17) < 0.01


# --- One target per call: what the call is lowered for decides, never the host -------------

REPRO_TILES = (3328, 1536, 256)  # the seed's v6e tile, split: ~20 MiB on a v5e


def _repro(target=None):
  grid = grid_for_resolution("720p")
  plan = plan_tiles(grid, 0.3, *REPRO_TILES[:2], "split")
  return grid, plan, lambda q, k, v: sparse_attention(
      q, k, v, plan, backend="splash", block_kv_compute=REPRO_TILES[2], target=target)


def _needs(plan, chip):
  return vmem_need(plan, 128, jnp.bfloat16, REPRO_TILES[2], tpu_target(chip)) > \
      tpu_target(chip).vmem_limit


@needs_libtpu
@pytest.mark.parametrize("chip", list(GENERATIONS))
def test_the_inputs_sharding_names_the_tpu_a_call_is_checked_for(chip, monkeypatch):
  """The wrong accept: lowered for a chip's topology from this CPU host, no ``target=``."""
  monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
  grid, plan, fn = _repro()
  mesh = chip_mesh(chip)
  spec = abstract((1, 1, grid.tokens, 128), jnp.bfloat16, mesh)
  bare = jax.ShapeDtypeStruct(spec.shape, spec.dtype)
  for lower in (lambda: jax.jit(fn).lower(spec, spec, spec),  # the inputs' sharding names it
                lambda: _lower_in_context(fn, mesh, bare)):  # the mesh in context names it
    if _needs(plan, chip):
      with pytest.raises(ValueError, match=rf"on TPU {chip} .*over its \d+ MiB scoped-VMEM limit "
                                           rf"\(the chip's default\): .*svg_vmem_limit_kib .*"
                                           rf"--xla_tpu_scoped_vmem_limit_kib in LIBTPU_INIT_ARGS"):
        lower()
    else:
      assert "tpu_custom_call" in lower().as_text()
  assert {chip: _needs(plan, chip) for chip in ("v5e", "v6e")} == {"v5e": True, "v6e": False}


def _lower_in_context(fn, mesh, bare):
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(bare, bare, bare)


def test_with_nothing_naming_the_tpu_the_strictest_known_limits_hold_when_lowered_for_one():
  grid, plan, fn = _repro()
  bare = jax.ShapeDtypeStruct((1, 1, grid.tokens, 128), jnp.bfloat16)
  # This host runs it (interpreted): nothing to refuse here...
  assert "tpu_custom_call" not in jax.jit(fn).lower(bare, bare, bare).as_text()
  # ...but an export for a TPU of unknown generation is refused, before anything compiles.
  with pytest.raises(ValueError, match=r"on a TPU of unknown generation .*over its 16 MiB"):
    jax.export.export(jax.jit(fn), platforms=["tpu"])(bare, bare, bare)
  assert vmem_need(plan, 128, jnp.bfloat16, 256, tpu_target()) == max(
      vmem_need(plan, 128, jnp.bfloat16, 256, tpu_target(g)) for g in GENERATIONS)
  # The unknown generation's default tiles pass that check (and compile on every known
  # generation: tests/tpu/test_tpu_compile.py).
  for mode in ("naive", "split", "aligned"):
    for backend in ("pallas", "splash"):
      config = SvgConfig(tile_mode=mode, density=0.3, backend=backend)
      t = config.tiles(tpu_target())
      check_fits(config.plan(grid, target=tpu_target()), 128, jnp.bfloat16, t.block_kv_compute,
                 tpu_target(), backend)


def test_bad_limits_name_the_key_the_chip_and_the_bytes(monkeypatch):
  with pytest.raises(ValueError, match=r"svg_vmem_limit_kib asks for 131072 KiB of scoped VMEM, "
                                       r"more than TPU tpu7x's 65536 KiB"):
    SvgConfig(vmem_limit_kib=131072).tiles(tpu_target("tpu7x"))
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=65536.5")
  with pytest.raises(ValueError, match=r"must be a whole number of KiB, got '65536.5'"):
    tpu_target("v6e")
  with pytest.raises(ValueError, match=r"svg_vmem_limit_kib must be an integer >= 0"):
    SvgConfig(vmem_limit_kib=65536.5)
