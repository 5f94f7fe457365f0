"""Compiled for real TPUs by libtpu on this host: the defaults fit, the checks agree with it.

Each test lowers with abstract inputs placed on a TPU topology's devices and compiles with
libtpu (Mosaic included), so VMEM, SMEM and layout limits are the compiler's, not ours.
About 3 minutes on 2 cores; the full matrix is ``make compile-tpu``.
"""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from maxdiffusion_svg import SvgConfig, grid_for_resolution, plan_tiles, sparse_attention
from maxdiffusion_svg.call.attention import scheduled_svg_attention, svg_attention
from maxdiffusion_svg.kernels.splash import splash_sparse_attention
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.target import GENERIC_TPU, target_for_devices, tpu_target
from maxdiffusion_svg.tpu.aot import (abstract, aot_compile, chip_mesh, libtpu_available,
                                      topology_devices, vmem_options)

pytestmark = pytest.mark.skipif(not libtpu_available(),
                                reason="libtpu is not installed (pip install -e '.[test]')")

LOCAL_HEADS, HEADS, HEAD_DIM = 5, 40, 128  # Wan 14B: 40 heads, 5 per device after 8-way Ulysses


def qkv(mesh, grid, heads=LOCAL_HEADS, batch=1, spec=None):
  return (abstract((batch, heads, grid.tokens, HEAD_DIM), jnp.bfloat16, mesh, spec),) * 3


def compile_ok(fn, args, options=None):
  result = aot_compile(fn, args, options)
  assert result.ok, result.error
  return result


def _tile_cases():
  """Every chip, executor, resolution and tile mode; make test keeps the default (our kernel,
  aligned) on both chips at 720p and on a v6e at 1440p; the rest are in the full tier (CI time)."""
  # Splash's default tiles: full tier; CI: test_the_gradient_of_a_call_compiles[v5e-splash]
  core_cases = {("v5e", "pallas", "720p"), ("v6e", "pallas", "720p"), ("v6e", "pallas", "1440p")}
  for chip in ("v5e", "v6e"):
    for backend, resolution in (("pallas", "720p"), ("pallas", "1440p"), ("splash", "720p"),
                                ("splash", "1440p")):
      for mode in ("naive", "split", "aligned"):
        core = mode == "aligned" and (chip, backend, resolution) in core_cases
        yield pytest.param(chip, backend, resolution, mode, marks=() if core else pytest.mark.full,
                           id=f"{chip}-{backend}-{resolution}-{mode}")


@pytest.mark.parametrize("chip,backend,resolution,mode", _tile_cases())
def test_default_tiles_compile_under_the_default_vmem_limit(chip, backend, resolution, mode):
  mesh = chip_mesh(chip)
  target = target_for_devices(mesh.devices.flat)
  config = SvgConfig(tile_mode=mode, density=0.3, backend=backend)
  grid = grid_for_resolution(resolution)
  plan, tiles = config.plan(grid, target=target), config.tiles(target)
  result = compile_ok(lambda q, k, v: sparse_attention(
      q, k, v, plan, block_kv_compute=tiles.block_kv_compute, target=target, backend=backend),
      qkv(mesh, grid))
  kernel = "svg_pallas_sparse" if backend == "pallas" else "splash"
  assert kernel in result.executable.as_text()


@pytest.mark.parametrize("chip", [
    pytest.param("v4", marks=pytest.mark.full), pytest.param("v5p", marks=pytest.mark.full),
    # TPU7x: CI compiles our kernel there in test_tpu7x_is_two_devices_per_chip_with_its_own_limits
    pytest.param("tpu7x", marks=pytest.mark.full)])
def test_our_kernel_compiles_on_the_other_generations(chip):
  """make compile-tpu covers every generation, resolution and mode; make test compiles our kernel
  on TPU7x in test_tpu7x_is_two_devices_per_chip_with_its_own_limits."""
  mesh = chip_mesh(chip)
  target = target_for_devices(mesh.devices.flat)
  grid = grid_for_resolution("720p")
  for mode, density in (("split", 0.3), ("aligned", 1.0)):
    config = SvgConfig(tile_mode=mode, density=density)
    plan, tiles = config.plan(grid, target=target), config.tiles(target)
    assert tiles.label() == ("3328x1536/512" if chip == "tpu7x" else "2048x3072/512")
    compile_ok(lambda q, k, v: sparse_attention(
        q, k, v, plan, block_kv_compute=tiles.block_kv_compute, target=target), qkv(mesh, grid))


def _over_v5e_limit():
  """Aligned 720p at 4096x2048/512 tiles with Wan 14B's 5 heads: libtpu needs 23.6 MiB here (kv
  steps rolled; the v5e chip's libtpu refused it unrolled at 16.1), over a v5e's 16 (the bound
  before its refit said 16.0 MiB and let it through; now 26.4)."""
  grid = grid_for_resolution("720p")
  plan = plan_tiles(grid, 0.35, 4096, 2048, "aligned")
  mesh = chip_mesh("v5e")
  return mesh, plan, qkv(mesh, grid)


PALLAS_POINTS = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "measurements"
                 / "pallas_vmem_points.json")


def _pallas_points():
  """(row, plan, our bound) for every point libtpu was asked about."""
  from maxdiffusion_svg.kernels.tpu_memory import pallas_vmem_bound  # pylint: disable=import-outside-toplevel
  data = json.loads(PALLAS_POINTS.read_text())
  grids = {}
  for row in data["rows"]:
    grid = grids.setdefault(row["resolution"], grid_for_resolution(row["resolution"]))
    plan = plan_tiles(grid, row["density"], row["block_q"], row["block_kv"], row["mode"])
    yield row, plan, pallas_vmem_bound(plan, row["head_dim"], jnp.dtype(row["dtype"]),
                                       row["block_kv_compute"], row["row_keys"], row["chip"])


def test_our_kernels_vmem_bound_is_above_every_need_libtpu_reported():
  """docs/measurements/pallas_vmem_points.json, held-out points included (no compile): the bound
  is never under libtpu's need, and at most 1.6x it at the heads' ceiling (the need grows with
  the heads up to about 8 at 720p) for tiles of up to 4M score elements; where the kernel did
  not fit the chip's VMEM at all, the bound is over it too."""
  from maxdiffusion_svg.plan.target import generation_named  # pylint: disable=import-outside-toplevel
  held_out, rows = 0, 0
  for row, plan, bound in _pallas_points():
    rows += 1
    held_out += row["held_out"]
    label = (f"{row['chip']} {plan.block_q}x{plan.block_kv}/{row['block_kv_compute']} "
             f"{row['mode']} {row['dtype']} d{row['head_dim']} row keys {row['row_keys']} "
             f"heads {row['heads']}")
    if row["compiler_bytes"] is None:  # over the chip's whole VMEM
      assert bound > generation_named(row["chip"]).vmem, label
      continue
    assert bound >= row["compiler_bytes"], (label, bound, row["compiler_bytes"])
    if row["heads"] >= 8 and plan.block_q * row["block_kv_compute"] <= 4 * 2**20:
      assert bound <= 1.6 * row["compiler_bytes"], (label, bound, row["compiler_bytes"])
  assert rows >= 80 and held_out >= rows // 6


@pytest.mark.full  # walks libtpu's allocation errors, a few compiles per point (CI time)
def test_our_kernels_vmem_bound_holds_the_compilers_need():
  """The bound sits above libtpu's own need, measured by walking its allocation errors."""
  from maxdiffusion_svg.kernels.pallas import pallas_sparse_attention  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.kernels.tpu_memory import pallas_vmem_bound  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.tpu.aot import scoped_vmem_need  # pylint: disable=import-outside-toplevel
  _, plan, args = _over_v5e_limit()
  lowered = jax.jit(lambda q, k, v: pallas_sparse_attention(
      q, k, v, plan, 0.1, interpret=False, block_kv_compute=512)).lower(*args)
  need = scoped_vmem_need(lowered, start_kib=16384)
  bound = pallas_vmem_bound(plan, HEAD_DIM, jnp.bfloat16, 512, generation="v5e")
  assert need.exact and need.bytes <= bound <= 1.6 * need.bytes, (need, bound)
  assert need.bytes > 16 * 2**20  # the call below is over the v5e's limit for libtpu too


@pytest.mark.full  # a few compiles per point (CI time); the unit test above holds the stored ones
def test_the_tightest_stored_points_hold_under_this_libtpu():
  """The points the bound holds with the least room, measured again by this host's libtpu (a
  newer one may allocate more): the bound still sits above each."""
  from maxdiffusion_svg.kernels.pallas import pallas_sparse_attention  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.tpu.aot import scoped_vmem_need  # pylint: disable=import-outside-toplevel
  measured = [(bound / row["compiler_bytes"], row, plan, bound) for row, plan, bound
              in _pallas_points() if row["compiler_bytes"] and not row["row_keys"]]
  for _, row, plan, bound in sorted(measured, key=lambda m: m[0])[:4]:
    grid = grid_for_resolution(row["resolution"])
    spec = abstract((1, row["heads"], grid.tokens, row["head_dim"]), jnp.dtype(row["dtype"]),
                    chip_mesh(row["chip"]))
    lowered = jax.jit(lambda q, k, v, plan=plan, bkc=row["block_kv_compute"]:
                      pallas_sparse_attention(q, k, v, plan, 0.1, interpret=False,
                                              block_kv_compute=bkc)).lower(spec, spec, spec)
    need = scoped_vmem_need(lowered, start_kib=int(row["compiler_bytes"] * 0.97) // 1024)
    assert need is not None and need.bytes <= bound, (row, need, bound)


@pytest.mark.full  # one compile per chip (CI time)
@pytest.mark.parametrize("chip", ["v4", "v5e", "v6e"])
def test_the_tile_the_bound_accepts_with_the_least_room_compiles_at_the_heads_ceiling(chip):
  """Of the tiles up to 4096x3072 at 720p, the one our bound accepts under the chip's default
  limit with the least room compiles at 16 heads (libtpu's need is highest from about 8)."""
  from maxdiffusion_svg.kernels.pallas import pallas_sparse_attention  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.kernels.tpu_memory import kernel_vmem  # pylint: disable=import-outside-toplevel
  mesh = chip_mesh(chip)
  target = target_for_devices(mesh.devices.flat)
  grid = grid_for_resolution("720p")
  tiles = [(bq, bkv, bkc) for bq in (1024, 1536, 2048, 2560, 3072, 3328, 4096)
           for bkv in (1024, 1536, 2048, 3072) for bkc in (256, 512, 1024) if bkv % bkc == 0]
  plans = {t: plan_tiles(grid, 0.35, t[0], t[1], "aligned") for t in tiles}
  room = {t: target.vmem_limit - kernel_vmem(plans[t], HEAD_DIM, jnp.bfloat16, t[2], target,
                                              "pallas") for t in tiles}
  edge = min((t for t in tiles if room[t] >= 0), key=lambda t: room[t])
  compile_ok(lambda q, k, v: pallas_sparse_attention(
      q, k, v, plans[edge], 0.1, interpret=False, block_kv_compute=edge[2]),
      qkv(mesh, grid, heads=16))


def test_a_call_over_the_vmem_limit_is_refused_before_compiling_and_by_the_compiler():
  """Refused before compiling where libtpu refuses it too (its need is over the limit: above)."""
  from maxdiffusion_svg.kernels.pallas import pallas_sparse_attention  # pylint: disable=import-outside-toplevel
  mesh, plan, args = _over_v5e_limit()
  v5e = target_for_devices(mesh.devices.flat)  # 16 MiB: the bound is over it
  with pytest.raises(ValueError, match=r"Pallas tiles 4096x2048 with block_kv_compute 512 need "
                                       r"about [\d.]+ MiB of VMEM on TPU v5e .*over its 16 MiB"):
    aot_compile(lambda q, k, v: sparse_attention(q, k, v, plan, target=v5e,
                                                 block_kv_compute=512), args)
  result = aot_compile(lambda q, k, v: pallas_sparse_attention(
      q, k, v, plan, 0.1, interpret=False, block_kv_compute=512), args)
  assert not result.ok and "CompileTimeScopedVmemOom" in result.error, result.error
  assert re.search(r"Scoped allocation with size [\d.]+M and limit 16.00M", result.error)


@pytest.mark.parametrize("chip,keys,calls", [
    # the router's sampled rows, placing q, k and v, the sparse kernel, restoring, the dense branch
    pytest.param("v5e", {}, 7, marks=pytest.mark.full),
    # the call with dense frames below compiles the same routing, placement, kernel and branch
    pytest.param("v6e", {}, 7, marks=pytest.mark.full),
    # svg_dense_frames 1: the first frame's 3,600 rows against every key on our kernel, two
    # 1,920-row query tiles (Splash's calls too), beside the sparse kernel and the dense branch
    ("v6e", {"dense_frames": 1}, 8),
    pytest.param("v6e", {"dense_frames": 1, "backend": "splash"}, 8, marks=pytest.mark.full)])
def test_scheduled_call_with_its_dense_branch_compiles(chip, keys, calls):
  """Traced step and layer: routing, placement, the sparse kernel and the dense branch, at 720p."""
  mesh = chip_mesh(chip)
  grid = grid_for_resolution("720p")
  config = SvgConfig(**keys)
  fn = lambda q, k, v, step, layer: scheduled_svg_attention(
      q, k, v, grid=grid, config=config, step=step, layer=layer,
      target=target_for_devices(mesh.devices.flat))
  scalar = abstract((), jnp.int32, mesh)
  result = compile_ok(fn, (*qkv(mesh, grid), scalar, scalar))
  text = result.executable.as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == calls and "svg_sampled_rows" in text
  assert "svg_head_order" in text
  # The router's rows are sliced from q as the kernels take it: no copy of q with the heads minor.
  assert not re.search(r"= bf16\[[\d,]*%d,128\]\{3,1,2,0\S* copy\(" % grid.tokens, text)
  # Our kernel's q comes scaled by its placement: its prepass writes no copy (Splash's scales).
  assert config.backend == "splash" or not [
      line for line in text.splitlines()
      if "svg_kernel" in line and re.search(r"= [^=]*bf16\[[^=]* fusion\(", line)]


@pytest.mark.full  # training with svg_dense_frames (VACE's references): the forward's twin above
def test_the_gradient_of_a_call_with_dense_frames_compiles():
  """The rows' call differentiates by the portable backward (a rectangle), the band's by
  tokamax's kernel: v6e, 720p, our kernel."""
  mesh = chip_mesh("v6e")
  target = target_for_devices(mesh.devices.flat)
  grid = grid_for_resolution("720p")
  config = SvgConfig(dense_frames=1, backend="pallas")
  loss = lambda q, k, v: svg_attention(q, k, v, grid=grid, config=config,
                                       target=target).astype(jnp.float32).sum()
  text = compile_ok(jax.grad(loss, argnums=(0, 1, 2)), qkv(mesh, grid)).executable.as_text()
  assert "dkv" in text and text.count("svg_pallas_sparse") >= 2


def test_the_gradient_of_a_routed_call_compiles():
  """Training through the whole call on a TPU: placement and restore (our Pallas pass) are
  differentiated by the reverse pass, the router's sampled rows not at all: v5e, 480p."""
  mesh = chip_mesh("v5e")
  target = target_for_devices(mesh.devices.flat)
  grid = grid_for_resolution("480p")
  loss = lambda q, k, v: svg_attention(q, k, v, grid=grid, config=SvgConfig(),
                                       target=target).astype(jnp.float32).sum()
  text = compile_ok(jax.grad(loss, argnums=(0, 1, 2)), qkv(mesh, grid)).executable.as_text()
  assert "svg_head_order" in text and "svg_sampled_rows" in text and "dkv" in text


@pytest.mark.full  # bench schedule --compensation compiles the same call (CI time)
def test_compensated_scheduled_call_compiles_with_the_kernels_log_sum_exp(backend="pallas"):
  """svg_compensation on, v6e, 720p: the kernel returns its log-sum-exp, the centroid pass and the
  merge follow it (XLA); the dense branch skips nothing, so it is the plain kernel. Beside the two:
  the router's sampled rows, placing q, k, v and restoring (our Mosaic passes)."""
  mesh = chip_mesh("v6e")
  grid = grid_for_resolution("720p")
  config = SvgConfig(compensation=True, backend=backend)
  target = target_for_devices(mesh.devices.flat)
  fn = lambda q, k, v, step, layer: scheduled_svg_attention(
      q, k, v, grid=grid, config=config, step=step, layer=layer, target=target)
  scalar = abstract((), jnp.int32, mesh)
  result = compile_ok(fn, (*qkv(mesh, grid), scalar, scalar))
  text = result.executable.as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == 7
  assert text.count("svg_pallas_sparse") >= 2 and "svg_sampled_rows" in text


@pytest.mark.parametrize("chip", [
    pytest.param("v5e", marks=pytest.mark.full),
    # the v6e fits these tiles under its default limit too; CI: tests/plan/test_target.py's
    # test_default_tiles_follow_the_limit_and_user_keys_win holds the tiles, Splash compiles on a
    # v6e in test_tile_tables_over_smem_are_refused_and_the_compiler_agrees
    pytest.param("v6e", marks=pytest.mark.full)])
def test_raised_vmem_limit_tiles_compile_under_that_limit(chip):
  mesh = chip_mesh(chip)
  target = target_for_devices(mesh.devices.flat, vmem_limit_kib=65536)
  config = SvgConfig(tile_mode="split", vmem_limit_kib=65536, backend="splash")
  tiles = config.tiles(target)
  assert (tiles.block_q, tiles.block_kv) == (3328, 2816)
  grid = grid_for_resolution("720p")
  plan = config.plan(grid, target=target)
  fn = lambda q, k, v: sparse_attention(q, k, v, plan, block_kv_compute=tiles.block_kv_compute,
                                        target=target, backend="splash")
  compile_ok(fn, qkv(mesh, grid), vmem_options(65536))
  if chip == "v6e":
    return  # 3328x2816 needs ~14 MiB on a v6e: it fits the default 32 MiB as well
  # On a v5e, the same tiles under the default limit are refused before compiling.
  with pytest.raises(ValueError, match=rf"on TPU {chip} .*, over its \d+ MiB scoped-VMEM limit"):
    aot_compile(lambda q, k, v: sparse_attention(q, k, v, plan, target=target_for_devices(
        mesh.devices.flat), backend="splash"), qkv(mesh, grid))


# CI: test_a_call_over_the_vmem_limit_is_refused_before_compiling_and_by_the_compiler (our check
# and libtpu refusing together on a v5e); tests/plan/test_target.py refuses these tiles on a v5e
@pytest.mark.full
def test_v5e_refuses_the_seed_tiles_before_compiling_and_the_compiler_agrees():
  mesh = chip_mesh("v5e")
  grid = grid_for_resolution("720p")
  plan = plan_tiles(grid, 0.3, 3328, 1536, "split")
  args = qkv(mesh, grid)
  v5e = target_for_devices(mesh.devices.flat)
  with pytest.raises(ValueError, match=r"need about [\d.]+ MiB of VMEM on TPU v5e .*, over its 16 "
                                       r"MiB scoped-VMEM limit \(the chip's default\): lower svg_block_q \(3328\)"):
    aot_compile(lambda q, k, v: sparse_attention(q, k, v, plan, target=v5e, backend="splash"), args)
  # The kernel itself, past our check (sparse_attention holds it), libtpu refuses it too.
  result = aot_compile(lambda q, k, v: splash_sparse_attention(
      q, k, v, plan, 0.1, interpret=False), args)
  assert not result.ok and "CompileTimeScopedVmemOom" in result.error, result.error
  assert re.search(r"Scoped allocation with size [\d.]+M and limit 16.00M", result.error)


def test_tile_tables_over_smem_are_refused_and_the_compiler_agrees():
  """1440p at 1024x1024, every tile visited: ~1.2 MB of tile tables against 1 MiB."""
  mesh = chip_mesh("v6e")
  grid = grid_for_resolution("1440p")
  plan = plan_tiles(grid, 1.0, 1024, 1024, "aligned", include_sink=False)
  args = qkv(mesh, grid, heads=1)
  v6e = target_for_devices(mesh.devices.flat)
  with pytest.raises(ValueError, match=r"tile tables for 296x296 tiles of 1024x1024 need about "
                                       r"\d+ KiB of SMEM, over TPU v6e's 1024 KiB"):
    aot_compile(lambda q, k, v: sparse_attention(q, k, v, plan, target=v6e, backend="splash"), args)
  result = aot_compile(lambda q, k, v: splash_sparse_attention(
      q, k, v, plan, 0.1, interpret=False), args)
  assert not result.ok and "smem" in result.error, result.error
  # Fewer, larger tiles fit, and compile.
  plan = plan_tiles(grid, 1.0, 1280, 1280, "aligned", include_sink=False)
  compile_ok(lambda q, k, v: sparse_attention(q, k, v, plan, target=v6e, backend="splash"), args)


def test_auto_follows_the_compile_target_not_the_host():
  """On this CPU host, ``auto`` runs the XLA path; lowered for a TPU it holds our kernel (a
  lowering shows the choice; the calls above compile it)."""
  assert jax.default_backend() == "cpu"
  grid = grid_for_resolution("480p")
  fn = lambda q, k, v: svg_attention(q, k, v, grid=grid, config=SvgConfig())
  tpu = jax.jit(fn).lower(*qkv(chip_mesh("v6e"), grid)).as_text()
  # our kernel, the router's sampled rows, placing q, k and v and restoring
  assert tpu.count("tpu_custom_call") == 6 and "svg_pallas_sparse" in tpu
  assert "svg_sampled_rows" in tpu and "svg_head_order" in tpu
  cpu_args = (jax.ShapeDtypeStruct((1, LOCAL_HEADS, grid.tokens, HEAD_DIM), jnp.bfloat16),) * 3
  assert "tpu_custom_call" not in jax.jit(fn).lower(*cpu_args).as_text()


def sharded(mesh, grid, batch, fold=True):
  config = SvgConfig()
  spec = P("data", None, "context", None)
  fn = lambda q, k, v: sharded_svg_attention(q, k, v, mesh=mesh, grid=grid, config=config,
                                             key=jax.random.key(0), fold_batch=fold)
  return fn, qkv(mesh, grid, heads=HEADS, batch=batch, spec=spec)


def a2a_layouts(hlo_text):
  return re.findall(r"= \w+\[[\d,]+\]\{([^}]*)\} all-to-all\(", hlo_text)


@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.full), 2])
def test_sharded_svg_compiles_for_a_v6e_2x4_slice(batch):
  mesh = Mesh(np.array(topology_devices("v6e:2x4")).reshape(1, 8), ("data", "context"))
  grid = grid_for_resolution("720p")
  result = compile_ok(*sharded(mesh, grid, batch))
  text = result.executable.as_text()
  # our kernel, the router's sampled rows, placing q, k and v and restoring, on the local heads
  assert text.count('custom_call_target="tpu_custom_call"') == 6 and "svg_sampled_rows" in text
  layouts = a2a_layouts(text)
  assert len(layouts) == 4 and not any("T(2,128)" in layout for layout in layouts), layouts


def test_cfg_batch_fold_keeps_the_exchange_off_t2_tiles():
  """At batch 2 without the fold, libtpu tiles the exchanged output as T(2,128)."""
  mesh = Mesh(np.array(topology_devices("v6e:2x4")).reshape(1, 8), ("data", "context"))
  grid = grid_for_resolution("720p")
  unfolded = compile_ok(*sharded(mesh, grid, 2, fold=False)).executable.as_text()
  assert any("T(2,128)" in layout for layout in a2a_layouts(unfolded))


@pytest.mark.full  # the tool's own check: test_vmem_model holds the model to its points offline
def test_the_compilers_own_vmem_need_is_the_calibrated_one():
  """tpu_aot.scoped_vmem_need walks libtpu's allocation errors up to the kernel's real need;
  it reproduces a point of docs/measurements/vmem_points.json, from below and (a first
  limit that already fits) from above."""
  from maxdiffusion_svg.bench.vmem_points import DEFAULT_OUT  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.tpu.aot import scoped_vmem_need  # pylint: disable=import-outside-toplevel
  data = json.loads(DEFAULT_OUT.read_text())
  rows = data["rows"]
  row = next(r for r in rows if (r["chip"], r["strategy"], r["block_q"], r["block_kv"],
                                 r["dtype"], r["head_dim"]) == ("v6e", "stored", 2048, 1024,
                                                                "bfloat16", 128))
  mesh = chip_mesh("v6e")
  grid = grid_for_resolution(data["resolution"])
  plan = plan_tiles(grid, 0.3, row["block_q"], row["block_kv"], "aligned")
  lowered = jax.jit(lambda q, k, v: splash_sparse_attention(
      q, k, v, plan, 0.1, interpret=False,
      block_kv_compute=row["block_kv_compute"])).lower(*qkv(mesh, grid, heads=row["heads"]))
  below = scoped_vmem_need(lowered, start_kib=4096)
  assert abs(below.bytes - row["compiler_bytes"]) <= 16 * 1024 and below.exact
  above = scoped_vmem_need(lowered, start_kib=65536)
  assert abs(above.bytes - row["compiler_bytes"]) <= 16 * 1024 and above.compiles >= 3


@pytest.mark.parametrize("chip", ["v4", "tpu7x"])
def test_an_unknown_generations_tiles_compile_on_the_most_different_known_ones(chip):
  """v4 (16 MiB in all, 32-bit masks) and TPU7x (two devices per chip); make compile-tpu
  compiles them on every generation."""
  mesh = chip_mesh(chip)
  grid = grid_for_resolution("720p")
  config = SvgConfig(tile_mode="aligned", density=0.3, backend="splash")
  unknown = tpu_target(GENERIC_TPU)
  plan, tiles = config.plan(grid, target=unknown), config.tiles(unknown)
  assert (tiles.block_q, tiles.block_kv) == (1536, 1024)
  compile_ok(lambda q, k, v: sparse_attention(q, k, v, plan, block_kv_compute=tiles.block_kv_compute,
                                              target=target_for_devices(mesh.devices.flat),
                                              backend="splash"),
             qkv(mesh, grid))


def test_tpu7x_is_two_devices_per_chip_with_its_own_limits():
  devices = topology_devices("tpu7x:1x1")
  assert len(devices) == 2 and {d.device_kind for d in devices} == {"TPU7x"}
  target = target_for_devices(devices)
  assert (target.generation.name, target.vmem_limit) == ("tpu7x", 32 * 2**20)
  mesh = chip_mesh("tpu7x")
  grid = grid_for_resolution("720p")
  config = SvgConfig(tile_mode="split", density=0.3)
  plan, tiles = config.plan(grid, target=target), config.tiles(target)
  compile_ok(lambda q, k, v: sparse_attention(q, k, v, plan, block_kv_compute=tiles.block_kv_compute),
             qkv(mesh, grid))


# CI time (84 s): the full tier's; the CI tier keeps the v6e 2x4 sharded compile below and the
# ring's permutes on the CPU (test_ring_sharding.py).
@pytest.mark.full
def test_sharded_svg_on_a_ulysses_by_ring_split_compiles_for_a_v6e_32_slice():
  """One video on 32 chips: CFG on the data axis, 16-way context split 8 (Ulysses) x 2 (ring),
  the scheduled call (sparse and dense branch): each branch runs one kernel per ring shard, keys
  move by collective permutes (no all-gather of the sequence)."""
  mesh = Mesh(np.array(topology_devices("v6e:4x8")).reshape(2, 16), ("data", "context"))
  grid = grid_for_resolution("720p")
  config = SvgConfig()
  fn = lambda q, k, v, step, layer: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=grid, config=config, key=jax.random.key(0), step=step,
      layer=layer, ulysses_shards=8)
  args = qkv(mesh, grid, heads=HEADS, batch=2, spec=P("data", None, "context", None))
  text = compile_ok(fn, args + (jax.ShapeDtypeStruct((), jnp.int32),) * 2).executable.as_text()
  assert text.count('custom_call_target="tpu_custom_call"') == 2 * 2
  assert "collective-permute" in text and "all-gather" not in text


@pytest.mark.parametrize("chip,backend", [("v6e", "pallas"), ("v5e", "splash"),
                                          pytest.param("v5e", "pallas", marks=pytest.mark.full)])
def test_the_gradient_of_a_call_compiles(chip, backend):
  """Training: either TPU kernel's forward with tokamax's backward kernel fed its log-sum-exp,
  at 720p, with the backward tiles the VMEM bound picks (v6e: the forward's; v5e, 16 MiB of
  scoped VMEM: Splash's 2048x1536 forward tiles, whose backward libtpu allocates 11.9 MiB, and
  half our kernel's 3328x1536)."""
  mesh = chip_mesh(chip)
  target = target_for_devices(mesh.devices.flat)
  config = SvgConfig(tile_mode="aligned", density=0.3, backend=backend)
  grid = grid_for_resolution("720p")
  plan, tiles = config.plan(grid, target=target), config.tiles(target)

  def loss(q, k, v):
    return sparse_attention(q, k, v, plan, block_kv_compute=tiles.block_kv_compute, target=target,
                            backend=backend).astype(jnp.float32).sum()

  result = compile_ok(jax.grad(loss, argnums=(0, 1, 2)), qkv(mesh, grid))
  text = result.executable.as_text()
  assert ("svg_pallas_sparse" if backend == "pallas" else "splash_mha_fwd") in text
  assert "dkv" in text  # tokamax's backward kernel


@pytest.mark.parametrize("chip", ["v6e", *(pytest.param(c, marks=pytest.mark.full)
                                           for c in ("v5e", "v5p", "v4", "tpu7x"))])
def test_a_per_head_budget_compiles_as_one_ragged_call(chip):
  """Wan 14B's 5 local heads of a CFG pair at 720p, each head at its own density: one call of
  our kernel on a ragged grid, its tables gathered by the device's head ids (on two-core chips,
  v4 and v5p, its two lanes are the cores' parallel dimension)."""
  from maxdiffusion_svg.budgets.per_head import head_budget  # pylint: disable=import-outside-toplevel
  mesh = chip_mesh(chip)
  target = target_for_devices(mesh.devices.flat)
  grid = grid_for_resolution("720p")
  tiles = SvgConfig().tiles(target)
  budget = head_budget(grid, (0.1, 0.2, 0.3, 0.45, 0.7, 0.25, 0.3, 0.35), tiles.block_q,
                       tiles.block_kv)
  steps = budget.steps_bound(2, LOCAL_HEADS)
  assert steps < LOCAL_HEADS * budget.carrier.stats.visited_tiles  # ragged, not the widest
  result = compile_ok(lambda q, k, v, ids: sparse_attention(
      q, k, v, budget.carrier, block_kv_compute=tiles.block_kv_compute, target=target,
      head_tiles=budget.tables_for(ids), head_steps=steps),
      qkv(mesh, grid, batch=2) + (abstract((2, LOCAL_HEADS), jnp.int32, mesh),))
  assert result.executable.as_text().count("svg_pallas_sparse") >= 1
