"""svg on a context axis split Ulysses x ring (``ulysses_shards``) against the single-device path:
8 simulated devices in this process; 16 (8x2, 4x4, 2x8) and 4 processes x 4 in subprocesses."""

import dataclasses
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.schedule import Interval, Schedule
from maxdiffusion_svg.call.attention import scheduled_svg_attention, svg_attention
from maxdiffusion_svg.kernels import dense_attention
from maxdiffusion_svg.parallel.multiprocess import run_processes
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from multiprocess_workers import sharded_config, sharded_inputs

AXES = ("data", "fsdp", "context", "tensor")
SPEC = P(("data", "fsdp"), None, "context", None)
GRID = VideoGrid(6, 8, 16)  # 768 tokens: ring shards of 384 (R=2), 256 (R=4, padded to 1024)
PADDED_GRID = VideoGrid(5, 6, 9)  # 270 tokens
TYPES = ("spatial", "temporal", "temporal", "spatial", "temporal", "spatial", "spatial", "temporal")
KEY = jax.random.key(7)
TESTS = str(pathlib.Path(__file__).parents[1])
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}


def mesh_of(shape):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), AXES)


def config(**kw):
  return SvgConfig(**{"block_q": 128, "block_kv": 128, "backend": "xla", "profile_queries": 16,
                      "density": 0.3, **kw})


def planted(grid=GRID, batch=1, seed=2, head_dim=32):
  return [jnp.asarray(x) for x in planted_qkv(grid, TYPES, head_dim=head_dim, seed=seed,
                                              batch=batch)]


def put(mesh, grid, *arrays):
  if grid.tokens % mesh.shape["context"]:
    return arrays  # jit places them
  return [jax.device_put(x, NamedSharding(mesh, SPEC)) for x in arrays]


@pytest.mark.parametrize("shape,ulysses,batch,mode", [
    ((1, 1, 8, 1), 4, 1, "aligned"), ((1, 1, 8, 1), 2, 1, "split"),
    ((1, 1, 8, 1), 2, 2, "aligned"), ((2, 1, 4, 1), 2, 2, "naive")])
def test_equals_single_device_with_the_same_routing(shape, ulysses, batch, mode):
  mesh = mesh_of(shape)
  cfg = config(tile_mode=mode)
  q, k, v = planted(batch=batch)
  want, want_info = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY, return_info=True)
  flags = np.asarray(want_info["temporal"])
  assert flags.any() and not flags.all()
  run = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY, return_info=True,
      ulysses_shards=ulysses))
  out, info = run(*put(mesh, GRID, q, k, v))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(info["temporal"]), flags)
  np.testing.assert_allclose(np.asarray(info["temporal_error"]),
                             np.asarray(want_info["temporal_error"]), rtol=1e-3, atol=1e-9)
  assert info["plan"] == want_info["plan"]


def test_a_sink_over_several_shards_equals_single_device():
  """svg_sink_frames 3 (VACE's references): 384 sink keys over ring shards of 256, so shard 1
  holds part of the sink; every shard still attends all of it."""
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(sink_frames=3)
  q, k, v = planted()
  want = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY)
  run = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY, ulysses_shards=2))
  np.testing.assert_allclose(np.asarray(run(*put(mesh, GRID, q, k, v))), np.asarray(want),
                             atol=1e-5)
  assert np.abs(np.asarray(want) - np.asarray(svg_attention(
      q, k, v, grid=GRID, config=config(), key=KEY))).max() > 1e-3  # the wider sink matters


@pytest.mark.parametrize("mode", ["aligned", "split"])
def test_padding_of_the_sequence_and_of_the_ring_never_gets_weight(mode):
  """270 tokens: the ring shards (R = 4) hold 128 each, 242 of them padding."""
  mesh = mesh_of((1, 1, 8, 1))
  q, k, v = planted(PADDED_GRID, seed=3)
  cfg = config(tile_mode=mode)
  want = svg_attention(q, k, v, grid=PADDED_GRID, config=cfg, key=KEY)
  out = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=PADDED_GRID, config=cfg, key=KEY, ulysses_shards=2))(q, k, v)
  assert out.shape == q.shape
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(q.shape), jnp.float32) for _ in range(3))
  full = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=PADDED_GRID, config=config(density=1.0),
      ulysses_shards=2))(q, k, v)
  np.testing.assert_allclose(np.asarray(full), np.asarray(dense_attention(q, k, v)), atol=1e-5)


def test_explicit_axis_mesh():
  mesh = jax.make_mesh((1, 1, 8, 1), AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 4)
  q, k, v = planted(PADDED_GRID, seed=4)
  cfg = config()
  out = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=PADDED_GRID, config=cfg, key=KEY, ulysses_shards=2))(q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(
      svg_attention(q, k, v, grid=PADDED_GRID, config=cfg, key=KEY)), atol=1e-5)


@pytest.mark.parametrize("explicit", [False, True])
def test_under_set_mesh(explicit):
  """With the mesh in context (jax.set_mesh), the split mesh's shard_map is traced under it."""
  types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,) * 4
  mesh = jax.make_mesh((1, 1, 8, 1), AXES, axis_types=types)
  q, k, v = planted(seed=4)
  cfg = config()
  with jax.set_mesh(mesh):
    out = jax.jit(lambda q, k, v: sharded_svg_attention(
        q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY, ulysses_shards=2))(
            *put(mesh, GRID, q, k, v))
  np.testing.assert_allclose(np.asarray(out), np.asarray(
      svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY)), atol=1e-5)


def test_our_pallas_kernel_runs_each_shards_rows():
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(backend="pallas")
  q, k, v = planted(head_dim=128, seed=4)
  want = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY)
  out = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY, ulysses_shards=2))(
          *put(mesh, GRID, q, k, v))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-4)


def test_traced_step_and_layer_compile_once_and_follow_the_schedule():
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(schedule=Schedule(Interval(2, None), Interval(1, 4)))
  q, k, v = planted(batch=2, seed=5)
  args = put(mesh, GRID, q, k, v)
  traces = []

  @jax.jit
  def run(q, k, v, step, layer):
    traces.append(1)
    return sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY,
                                 step=step, layer=layer, ulysses_shards=4)

  outs = {}
  for step, layer in ((0, 2), (3, 0), (3, 2), (5, 3)):
    got = run(*args, np.int32(step), np.int32(layer))
    want = scheduled_svg_attention(q, k, v, grid=GRID, config=cfg, step=step, layer=layer,
                                   key=KEY)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    outs[(step, layer)] = np.asarray(got)
  assert len(traces) == 1
  assert not np.allclose(outs[(0, 2)], outs[(3, 2)])  # dense and sparse both ran


def test_on_routing_reports_each_shards_heads():
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(schedule=Schedule(Interval(0, None), Interval(0, None)))
  q, k, v = planted(seed=6)
  seen = []

  def on_routing(temporal, active, step, layer):
    jax.debug.callback(lambda t, a: seen.append((np.asarray(t).copy(), bool(a))), temporal,
                       jnp.asarray(active))

  _, info = svg_attention(q, k, v, grid=GRID, config=cfg, key=jax.random.fold_in(
      jax.random.fold_in(KEY, 0), 1), return_info=True)
  jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY, step=1, layer=0, ulysses_shards=4,
      on_routing=on_routing))(*put(mesh, GRID, q, k, v))
  jax.effects_barrier()
  assert len(seen) == 8 and all(active for _, active in seen)
  # Each of the 4 Ulysses ranks holds 2 heads; both ring shards of a rank report them.
  reported = sorted(tuple(t.reshape(-1)) for t, _ in seen)
  flags = np.asarray(info["temporal"]).reshape(4, 2)
  assert reported == sorted([tuple(row) for row in flags] * 2)


def test_sparse_calls_move_no_whole_ring():
  """At 8 shards of a sparse plan, a shard fetches from its neighbours (collective permutes)
  and the sink's shard (one broadcast), never the R - 1 = 7 shards a ring visits."""
  grid = VideoGrid(8, 16, 32)  # 4096 tokens, 512 per ring shard
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(density=0.1)
  q, k, v = planted(grid, seed=8)
  text = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=grid, config=cfg, ulysses_shards=1)).lower(
          *put(mesh, grid, q, k, v)).as_text()
  permutes = re.findall(r"stablehlo\.collective_permute", text)
  assert len(permutes) == 2 * 2  # k and v, each from the shards either side


def test_bad_splits_name_the_key_and_the_values_that_work():
  mesh = mesh_of((1, 1, 8, 1))
  q, k, v = planted(batch=1)
  call = lambda cfg=config(), **kw: sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID,
                                                         config=cfg, **kw)
  with pytest.raises(ValueError, match=r"ulysses_shards \(3\) must divide the mesh's context "
                                       r"axis \(8 devices\).*1, 2, 4, 8"):
    call(ulysses_shards=3)
  q6 = q[:, :6]
  with pytest.raises(ValueError, match=r"heads \(6\) must be divisible.*ulysses_shards to one "
                                       r"of 1, 2"):
    sharded_svg_attention(q6, q6, q6, mesh=mesh, grid=GRID, config=config())
  with pytest.raises(ValueError, match=r"ulysses_shards \(4\) must divide the model's 6 attention heads.*1, 2"):
    sharded_svg_attention(q6, q6, q6, mesh=mesh, grid=GRID, config=config(), ulysses_shards=4)
  with pytest.raises(ValueError, match=r"ulysses_shards must be an integer"):
    call(ulysses_shards="4")
  with pytest.raises(ValueError, match=r"svg_backend splash cannot run a ring.*pallas"):
    call(config(backend="splash"), ulysses_shards=4)


CALLS = [(0, 0), (3, 0), (3, 2), (5, 1)]  # dense, dense (layer 0), sparse, sparse
CASES = [((1, 1, 16, 1), 8, 1), ((1, 1, 16, 1), 8, 2), ((1, 1, 16, 1), 4, 1),
         ((1, 1, 16, 1), 4, 2), ((1, 1, 16, 1), 2, 1), ((1, 1, 16, 1), 2, 2),
         ((2, 1, 8, 1), 4, 2)]


def _reference(grid_shape, batch, seed):
  grid, qkv = sharded_inputs(grid_shape, batch, seed)
  cfg = sharded_config()
  return np.stack([np.asarray(scheduled_svg_attention(*map(jnp.asarray, qkv), grid=grid,
                                                      config=cfg, step=s, layer=l, key=KEY))
                   for s, l in CALLS])


@pytest.mark.parametrize("grid_shape,cases,processes", [
    # make test: the 480-token case below (rings of 2, 4 and 8 on 16 devices, batch 1 and 2); the
    # 768-token cases, in 1 and 4 processes, in the full tier (CI time). make test keeps 2
    # processes (test_multiprocess.py) and the batch on data with a ring (the 2x1x4x1 case of
    # test_equals_single_device_with_the_same_routing)
    pytest.param((6, 8, 16), [CASES[1], CASES[3], CASES[6]], (1, 4),
                 marks=pytest.mark.full),  # CI: grid_shape2 below; test_multiprocess.py
    pytest.param((6, 8, 16), [CASES[0], CASES[2], CASES[4], CASES[5]], (1, 4),
                 marks=pytest.mark.full),
    # 480 tokens: frames of 96 cross the 128-token tiles, and every split pads the ring
    ((5, 6, 16), [CASES[1], CASES[2], CASES[5]], (1,))])
def test_sixteen_devices_and_four_processes_equal_one_device(tmp_path, grid_shape, cases,
                                                             processes):
  """8x2, 4x4 and 2x8 on 16 devices in one process, batch 1 and 2 (and 2 x 4x2 with the batch
  on the data axis), each with traced step and layer through dense and sparse calls: equal to
  one device; the same in 4 processes of 4 devices (jax.distributed) equal to 1 of 16."""
  outs = {}
  for count in processes:
    args = {"grid": grid_shape, "seed": 3, "cases": cases, "calls": CALLS,
            "out": str(tmp_path / f"out{count}.npz")}
    infos = run_processes("multiprocess_workers:ring_svg", count,
                          devices_per_process=16 // count, args=args, env=ENV, timeout=540)
    for info in infos:
      assert info == {"traces": len(cases), "process_count": count, "devices": 16}
    outs[count] = np.load(args["out"])
  for case, (_, _, batch) in enumerate(cases):
    got = outs[1][f"case{case}"]
    np.testing.assert_allclose(got, _reference(grid_shape, batch, 3), atol=1e-5,
                               err_msg=f"case {cases[case]}")
    if 4 in outs:
      np.testing.assert_allclose(outs[4][f"case{case}"], got, atol=1e-6)


@pytest.mark.parametrize("keys, budget", [
    ({"layer_densities": (0.3, 0.7)}, "svg_layer_densities"),
    ({"layer_compensation": (True, False)}, "svg_layer_compensation"),
    ({"head_densities": (0.3,) * 8}, "svg_head_densities")])
def test_the_run_refuses_a_budget_on_a_ring_in_its_preflights_words(keys, budget):
  """One check of what a ring accepts (ring_plan.check_on_ring): the sharded call's refusal is
  the pre-flight's, word for word, for the keys budget_keys names."""
  from maxdiffusion_svg.parallel.ring_plan import budget_keys  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin import preflight  # pylint: disable=import-outside-toplevel
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(schedule=Schedule(Interval(0, None), Interval(0, None)), **keys)
  assert budget_keys(cfg) == (budget,)
  args = put(mesh, GRID, *planted(seed=6))
  with pytest.raises(ValueError) as run:
    sharded_svg_attention(*args, mesh=mesh, grid=GRID, config=cfg, key=KEY, step=0, layer=0,
                          ulysses_shards=4)
  job = preflight.Job(process_count=1, device_count=8, local_device_count=8, context_shards=8,
                      heads=8, ulysses_shards=4, budgets=budget_keys(cfg))
  with pytest.raises(ValueError) as before_loading:
    preflight.check_job(job, {})
  assert str(run.value) == str(before_loading.value)
  assert str(run.value).startswith(f"{budget} does not run on a ring yet (ulysses_shards 4 ")


def test_per_layer_densities_run_under_ulysses_and_are_refused_on_a_ring():
  """``svg_layer_densities`` and ``svg_layer_compensation`` sharded: the Ulysses exchange (no
  ring) equals one device layer by layer, one compile; a ring refuses each by the key's name."""
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(schedule=Schedule(Interval(0, None), Interval(0, None)),
               layer_densities=(0.3, 0.7), layer_compensation=(True, False))
  q, k, v = planted(seed=6)
  args = put(mesh, GRID, q, k, v)
  traces = []

  @jax.jit
  def run(q, k, v, layer):
    traces.append(1)
    return sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY,
                                 step=np.int32(0), layer=layer)

  for layer in (0, 1):
    want = scheduled_svg_attention(q, k, v, grid=GRID, config=cfg, step=0, layer=layer, key=KEY)
    np.testing.assert_allclose(np.asarray(run(*args, np.int32(layer))), np.asarray(want),
                               atol=1e-5)
  assert len(traces) == 1
  with pytest.raises(ValueError, match="svg_layer_densities does not run on a ring"):
    sharded_svg_attention(*args, mesh=mesh, grid=GRID, config=cfg, key=KEY, step=0, layer=0,
                          ulysses_shards=4)
  with pytest.raises(ValueError, match="svg_layer_compensation does not run on a ring"):
    sharded_svg_attention(*args, mesh=mesh, grid=GRID, key=KEY, step=0, layer=0,
                          config=dataclasses.replace(cfg, layer_densities=None), ulysses_shards=4)
