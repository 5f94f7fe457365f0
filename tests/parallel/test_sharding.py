"""sharded_svg_attention on 8 simulated CPU devices against the single-device path."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench.hlo import collective_stats
from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.schedule import Interval, Schedule
from maxdiffusion_svg.call.attention import scheduled_svg_attention, svg_attention
from maxdiffusion_svg.kernels import dense_attention
from maxdiffusion_svg.parallel.sharding import layout_axes, sharded_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid

AXES = ("data", "fsdp", "context", "tensor")
SPEC = P(("data", "fsdp"), None, "context", None)
GRID = VideoGrid(6, 8, 16)  # 768 tokens: 96 per shard on 8
PADDED_GRID = VideoGrid(5, 6, 9)  # 270 tokens: padded to 272 on 8 shards
TYPES = ("spatial", "temporal", "temporal", "spatial", "temporal", "spatial", "spatial", "temporal")
KEY = jax.random.key(7)


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
  if jax.device_count() < 8:
    pytest.fail("the sharded tests need 8 devices: run them through pytest from the repository "
                "(tests/conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                "before JAX starts), or set it yourself")


def mesh_of(shape, explicit=False):
  if explicit:
    return jax.make_mesh(shape, AXES)
  devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, AXES)


def config(**kw):
  return SvgConfig(**{"block_q": 128, "block_kv": 128, "backend": "xla", "profile_queries": 16,
                      "density": 0.3, **kw})


def planted(grid=GRID, batch=2, seed=2):
  return [jnp.asarray(x) for x in planted_qkv(grid, TYPES, head_dim=32, seed=seed, batch=batch)]


def sharded(mesh, *arrays):
  return [jax.device_put(x, NamedSharding(mesh, SPEC)) for x in arrays]


@pytest.mark.parametrize("shape", [(1, 1, 8, 1), (2, 1, 4, 1), (1, 2, 2, 2)])
def test_equals_single_device_with_the_same_routing_and_sharding(shape):
  mesh = mesh_of(shape)
  cfg = config()
  q, k, v = planted()
  want, want_info = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY, return_info=True)
  flags = np.asarray(want_info["temporal"])
  assert flags.any() and not flags.all()  # a mix, so per-device routing is really tested
  qs, ks, vs = sharded(mesh, q, k, v)
  run = jax.jit(lambda q, k, v, key: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=GRID, config=cfg, key=key, return_info=True))
  out, info = run(qs, ks, vs, KEY)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(info["temporal"]), flags)
  np.testing.assert_allclose(np.asarray(info["temporal_error"]),
                             np.asarray(want_info["temporal_error"]), rtol=1e-4, atol=1e-12)
  assert info["plan"] == want_info["plan"]
  assert out.sharding.is_equivalent_to(qs.sharding, out.ndim)


def test_cfg_batch_folds_into_heads_where_nothing_shards_the_batch():
  """Batch 2 on a context-only mesh: the exchange moves [1, 2H, ...] (MaxDiffusion's ulysses
  fold), with the same result as the unfolded exchange; a sharded batch is left alone."""
  q, k, v = planted(seed=9)
  cfg = config()
  outs = {}
  for shape, fold in (((1, 1, 8, 1), True), ((1, 1, 8, 1), False), ((2, 1, 4, 1), True)):
    mesh = mesh_of(shape)
    run = jax.jit(lambda q, k, v, mesh=mesh, fold=fold: sharded_svg_attention(
        q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY, fold_batch=fold))
    args = sharded(mesh, q, k, v)
    # What each device sends into the exchange: [local batch, heads, S / shards, D].
    exchanged = re.findall(r'"stablehlo.all_to_all".*split_dimension = 1 .*: \(tensor<(\d+)x(\d+)x',
                           run.lower(*args).as_text())
    want = {((1, 1, 8, 1), True): ("1", "16"), ((1, 1, 8, 1), False): ("2", "8"),
            ((2, 1, 4, 1), True): ("1", "8")}[(shape, fold)]
    assert exchanged == [want] * 3, exchanged  # q, k, v
    outs[(shape, fold)] = np.asarray(run(*args))
  np.testing.assert_array_equal(outs[((1, 1, 8, 1), True)], outs[((1, 1, 8, 1), False)])
  np.testing.assert_allclose(outs[((2, 1, 4, 1), True)], outs[((1, 1, 8, 1), True)], atol=1e-5)


@pytest.mark.parametrize("backend", ["xla", "splash"])
def test_padded_sequence_never_gets_weight(backend):
  """270 tokens on 8 shards: padded to 272 for the exchange, cut before attention."""
  mesh = mesh_of((1, 1, 8, 1))
  q, k, v = planted(PADDED_GRID, batch=1, seed=3)
  cfg = config(backend=backend)
  want = svg_attention(q, k, v, grid=PADDED_GRID, config=cfg, key=KEY)
  out = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=PADDED_GRID, config=cfg, key=KEY))(q, k, v)
  assert out.shape == q.shape
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
  # At density 1 every real key is kept: any weight on a pad key (logit 0, against O(1)
  # logits of Gaussian inputs) would show against dense.
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(q.shape), jnp.float32) for _ in range(3))
  full = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=PADDED_GRID, config=config(backend=backend, density=1.0)))(q, k, v)
  np.testing.assert_allclose(np.asarray(full), np.asarray(dense_attention(q, k, v)), atol=1e-5)


def test_explicit_axis_mesh():
  mesh = mesh_of((1, 1, 8, 1), explicit=True)
  q, k, v = planted(PADDED_GRID, batch=1, seed=4)
  cfg = config()
  out = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=PADDED_GRID, config=cfg, key=KEY))(q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(
      svg_attention(q, k, v, grid=PADDED_GRID, config=cfg, key=KEY)), atol=1e-5)


def test_traced_step_and_layer_compile_once_and_follow_the_schedule():
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(schedule=Schedule(Interval(2, None), Interval(1, 4)))
  q, k, v = planted(batch=1, seed=5)
  qs, ks, vs = sharded(mesh, q, k, v)
  traces = []

  @jax.jit
  def run(q, k, v, step, layer):
    traces.append(1)
    return sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY,
                                 step=step, layer=layer)

  dense = np.asarray(dense_attention(q, k, v))
  for step, layer in itertools.product([0, 1, 2, 9], [0, 1, 3, 4]):
    out = np.asarray(run(qs, ks, vs, jnp.int32(step), jnp.int32(layer)))
    if step >= 2 and 1 <= layer < 4:
      want = scheduled_svg_attention(q, k, v, grid=GRID, config=cfg, step=step, layer=layer,
                                     key=KEY)
      np.testing.assert_allclose(out, np.asarray(want), atol=1e-5)
      assert np.abs(out - dense).max() > 1e-3  # really sparse
    else:
      np.testing.assert_allclose(out, dense, atol=2e-5)
  assert len(traces) == 1


@pytest.mark.parametrize("shape,batch", [((1, 1, 8, 1), 2), ((2, 1, 4, 1), 2)])
def test_on_routing_reports_each_devices_heads_without_changing_the_output(shape, batch):
  """Per device, inside the exchange: the temporal flags of its heads sum to the single-device
  routing's, the dense steps report none, and the output is the call without the hook."""
  mesh = mesh_of(shape)
  cfg = config(schedule=Schedule(Interval(1, None), Interval(0, None)))
  q, k, v = planted(batch=batch, seed=8)
  qs, ks, vs = sharded(mesh, q, k, v)
  reports = []

  def on_routing(temporal, active, step, layer):
    jax.debug.callback(lambda *xs: reports.append(tuple(int(x) for x in xs)), active, step,
                       layer, jnp.sum(temporal.astype(jnp.int32)), jnp.int32(temporal.size))

  def run(q, k, v, step, hook):
    return sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY,
                                 step=step, layer=jnp.int32(0), on_routing=hook)

  with_hook = jax.jit(lambda q, k, v, step: run(q, k, v, step, on_routing))
  plain = jax.jit(lambda q, k, v, step: run(q, k, v, step, None))
  for step in (0, 1):
    reports.clear()
    out = with_hook(qs, ks, vs, jnp.int32(step))
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain(qs, ks, vs, jnp.int32(step))))
    active = step >= 1
    assert len(reports) == 8 and {r[:3] for r in reports} == {(active, step, 0)}
    assert sum(r[4] for r in reports) == batch * len(TYPES)  # every (example, head) once
    want = scheduled_svg_attention(q, k, v, grid=GRID, config=cfg, step=step, layer=0, key=KEY,
                                   return_layout=True)[1]["layout"]
    assert sum(r[3] for r in reports) == int(np.asarray(want).sum())
    assert (int(np.asarray(want).sum()) > 0) == active  # planted temporal heads, when sparse


def test_python_int_step_and_layer_decide_while_tracing():
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(schedule=Schedule(Interval(2, None), Interval(0, None)))
  q, k, v = planted(batch=1, seed=6)
  run = lambda q, k, v: sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID, config=cfg,
                                              step=0, layer=0)
  assert "cond" not in str(jax.make_jaxpr(run)(q, k, v))
  np.testing.assert_allclose(np.asarray(jax.jit(run)(q, k, v)),
                             np.asarray(dense_attention(q, k, v)), atol=2e-5)


@pytest.mark.parametrize("shape", [(2, 1, 1, 4), (1, 2, 1, 1)])
def test_one_sequence_shard_compiles_no_collective(shape):
  mesh = mesh_of(shape)
  q, k, v = planted(batch=2, seed=7)
  lowered = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=GRID, config=config())).lower(*sharded(mesh, q, k, v))
  assert collective_stats(lowered.compile().as_text()) == {}


def test_bad_input_names_the_problem():
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config()
  q = jnp.zeros((1, 4, GRID.tokens, 16))
  with pytest.raises(ValueError, match=r"heads \(4\) must be divisible by the 8 shards of mesh "
                                       r"axis 'context'"):
    sharded_svg_attention(q, q, q, mesh=mesh, grid=GRID, config=cfg)
  q = jnp.zeros((1, 8, GRID.tokens, 16))
  with pytest.raises(ValueError, match="seq_axis 'sequence' is not an axis of the mesh"):
    sharded_svg_attention(q, q, q, mesh=mesh, grid=GRID, config=cfg, seq_axis="sequence")
  with pytest.raises(ValueError, match="S = grid.tokens = 270"):
    sharded_svg_attention(q, q, q, mesh=mesh, grid=PADDED_GRID, config=cfg)
  with pytest.raises(ValueError, match=r"batch \(1\) must be divisible by the 2 shards"):
    sharded_svg_attention(q, q, q, mesh=mesh_of((2, 1, 4, 1)), grid=GRID, config=cfg)
  with pytest.raises(ValueError, match="give both step and layer"):
    sharded_svg_attention(q, q, q, mesh=mesh, grid=GRID, config=cfg, step=3)
  with pytest.raises(ValueError, match="return_info is for unscheduled calls"):
    sharded_svg_attention(q, q, q, mesh=mesh, grid=GRID, config=cfg, step=3, layer=1,
                          return_info=True)


def test_missing_batch_axes_are_ignored():
  mesh = Mesh(np.array(jax.devices()).reshape(8), ("context",))
  q, k, v = planted(batch=1, seed=8)
  cfg = config()
  out = jax.jit(lambda q, k, v: sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID,
                                                      config=cfg, key=KEY))(q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(
      svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY)), atol=1e-5)


def test_a_given_layout_decides_the_axes_and_is_matched_without_resharding():
  """A layout whose batch is split over ``data`` only (fsdp replicating it), as a custom
  rule set gives: the exchange takes its axes from the spec, so it runs where the default
  axes (batch over data x fsdp = 4 shards) refuse a batch of 2, gives the single-device
  result, and the compiled call moves nothing but the exchange."""
  mesh = mesh_of((2, 2, 2, 1))
  spec = P("data", None, "context", None)
  cfg = config()
  q, k, v = planted(batch=2, seed=11)
  want = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY)
  with pytest.raises(ValueError, match=r"batch \(2\) must be divisible by the 4 shards"):
    sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY)
  args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
  run = jax.jit(lambda q, k, v: sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID, config=cfg,
                                                      key=KEY, qkv_spec=spec))
  out = run(*args)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
  assert out.sharding.is_equivalent_to(args[0].sharding, out.ndim)
  stats = collective_stats(run.lower(*args).compile().as_text())
  assert set(stats) == {"all-to-all"}, stats


def test_layout_axes_read_the_spec_and_refuse_what_the_exchange_cannot_match():
  mesh = mesh_of((2, 2, 2, 1))
  assert layout_axes(mesh, P(("data", "fsdp"), None, "context", None)) == (
      "context", ("data", "fsdp"))
  assert layout_axes(mesh, P(None, "tensor", ("context",))) == ("context", ())  # size-1 axis
  with pytest.raises(ValueError, match=r"splits the heads over mesh axes \['context'\]"):
    layout_axes(mesh, P(("data", "fsdp"), "context", None, None))
  with pytest.raises(ValueError, match=r"splits the head dims over mesh axes \['fsdp'\]"):
    layout_axes(mesh, P("data", None, "context", "fsdp"))
  with pytest.raises(ValueError, match=r"shards the sequence over 2 mesh axes \['context', "
                                       r"'fsdp'\]"):
    layout_axes(mesh, P("data", None, ("context", "fsdp"), None))
  with pytest.raises(ValueError, match=r"shards the sequence over 0 mesh axes"):
    layout_axes(mesh, P("data", None, None, None))
  with pytest.raises(ValueError, match=r"names \['sequence'\], not axes of the mesh"):
    layout_axes(mesh, P("data", None, "sequence", None))


@pytest.mark.parametrize("scheduled", [False, True])
def test_each_expert_gets_its_own_density_through_the_exchange(scheduled):
  """Wan 2.2: the expert reaches the local call, so each expert's sharded output is its own
  single-device SVG (and the two differ: the densities really differ)."""
  mesh = mesh_of((1, 1, 8, 1))
  cfg = config(high_noise_density=0.6, low_noise_density=0.2,
               schedule=Schedule(Interval(2, None), Interval(1, None)))  # step 3, layer 1: sparse
  q, k, v = planted(batch=1, seed=12)
  when = {"step": 3, "layer": 1} if scheduled else {}
  outs = {}
  for expert in ("high_noise", "low_noise"):
    if scheduled:
      want = scheduled_svg_attention(q, k, v, grid=GRID, config=cfg, expert=expert, key=KEY,
                                     **when)
    else:
      want = svg_attention(q, k, v, grid=GRID, config=cfg, expert=expert, key=KEY)
    outs[expert] = np.asarray(jax.jit(lambda q, k, v, expert=expert: sharded_svg_attention(
        q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY, expert=expert, **when))(
            *sharded(mesh, q, k, v)))
    np.testing.assert_allclose(outs[expert], np.asarray(want), atol=1e-5)
  assert not np.allclose(outs["high_noise"], outs["low_noise"], atol=1e-3)
