"""The semantic layout's warm start across denoising steps: a cold seed is the cold start, a warm
one starts from the given centroids (fewer updates for the same assignment), and the sharded
call carries each head's centroids through the head exchange exactly as one device does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.schedule import Interval, Schedule
from maxdiffusion_svg.call.attention import scheduled_svg_attention
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.routing.semantic import Seed, kmeans

GRID = VideoGrid(6, 8, 16)
CLUSTERS = 4


def blobs(seed=0, shift=0.0, n=2048, clusters=6, d=16, spread=3.0):
  """Points around ``clusters`` centres (moved by ``shift``): a clustering with a clear answer."""
  rng = np.random.default_rng(seed)
  centres = np.random.default_rng(99).standard_normal((clusters, d)) * spread + shift
  labels = rng.integers(0, clusters, n)
  return jnp.asarray((centres[labels] + rng.standard_normal((n, d)))[None, None], jnp.float32), labels


def agreement(a, b):
  """Share of point pairs (a sample) that two assignments put together or apart alike."""
  a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
  i, j = np.random.default_rng(0).integers(0, a.size, (2, 20_000))
  return np.mean((a[i] == a[j]) == (b[i] == b[j]))


def test_a_seed_not_ready_is_the_cold_start():
  x, _ = blobs()
  cold = kmeans(x, 6, 3)
  seeded = kmeans(x, 6, 3, seed=Seed(jnp.full((6, 16), 7.0), jnp.bool_(False)), warm_iterations=1)
  for a, b in zip(cold, seeded):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_warm_start_reaches_the_converged_assignment_in_one_update():
  """The next step's points (their centres moved a little) from centroids found on this step's:
  one warm update finds the true clusters; one cold update, or four, from the evenly spaced
  start does worse (it may merge two of them)."""
  x0, labels0 = blobs(0, clusters=12, spread=1.5)
  given = jnp.asarray([np.asarray(x0)[0, 0][labels0 == c].mean(0) for c in range(12)])
  previous = kmeans(x0, 12, 1, seed=Seed(given, jnp.bool_(True)))[1]  # this step's clusters
  x, labels = blobs(1, shift=0.3, clusters=12, spread=1.5)
  warm = kmeans(x, 12, 4, seed=Seed(previous[0, 0], jnp.bool_(True)), warm_iterations=1)[0]
  assert agreement(warm, labels) > 0.995
  for cold in (1, 4, 20):  # measured: 0.960, 0.965, 0.966
    assert agreement(warm, labels) > agreement(kmeans(x, 12, cold)[0], labels) + 0.02


@pytest.mark.parametrize("kw,match", [
    (dict(semantic_warm_iterations=-1), r"svg_semantic_warm_iterations must be an integer from 0 "
                                        r"\(no warm start\) to svg_semantic_iterations"),
    (dict(semantic_iterations=2, semantic_warm_iterations=3), r"svg_semantic_iterations \(2\), "
                                                              r"got 3"),
    (dict(semantic_warm_iterations=True), "svg_semantic_warm_iterations must be an integer"),
])
def test_bad_warm_iterations_are_refused_naming_the_key(kw, match):
  with pytest.raises(ValueError, match=match):
    SvgConfig(layouts=["spatial", "semantic"], **kw)


def config(layouts=("spatial", "temporal", "semantic"), iterations=3):
  return SvgConfig(density=0.3, block_q=128, block_kv=128, backend="xla", layouts=list(layouts),
                   semantic_clusters=CLUSTERS, semantic_iterations=iterations,
                   semantic_warm_iterations=1,
                   schedule=Schedule(Interval(1, None), Interval(0, None)))


def inputs(batch, grid=GRID):
  q, k, v = (jnp.asarray(x) for x in planted_qkv(grid, ("moving", "spatial") * 4, 64, seed=5))
  return [jnp.concatenate([x] * batch) * jnp.arange(1, batch + 1)[:, None, None, None]
          for x in (q, k, v)]


@pytest.mark.parametrize("batch,ulysses,mesh_shape,grid", [
    pytest.param(1, None, (1, 1, 8, 1), GRID,
                 marks=pytest.mark.full),  # CI: the batch 2 case next, its first element this one
    (2, None, (1, 1, 8, 1), GRID),  # batch 2 folded into heads
    (2, None, (2, 1, 4, 1), VideoGrid(5, 7, 15)),  # batch on data; 525 tokens padded to 528
    (1, 4, (1, 1, 8, 1), GRID)])  # a ring of 2
def test_sharded_seed_equals_one_device_and_a_dense_step_keeps_it(batch, ulysses, mesh_shape, grid):
  """8 devices, traced step and layer: the output and each head's centroids equal one
  device's; a dense step returns the seed; a ring (ulysses 4) leaves semantic out and keeps the
  seed."""
  q, k, v = inputs(batch, grid)
  cfg, key = config(), jax.random.key(3)
  rng = np.random.default_rng(2)
  stored = jnp.asarray(rng.standard_normal((batch, 8, CLUSTERS, 64)), jnp.float32)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "fsdp", "context", "tensor"))
  spec = NamedSharding(mesh, P(("data", "fsdp"), None, "context", None))
  run = jax.jit(lambda q, k, v, step, ready: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=grid, config=cfg, key=key, step=step, layer=jnp.int32(0),
      ulysses_shards=ulysses, seed=Seed(stored, ready)))
  # an uneven sequence enters whole (the call pads and shards it)
  put = [x if grid.tokens % mesh.shape["context"] else jax.device_put(x, spec) for x in (q, k, v)]
  for step, ready in ((1, False), (1, True), (0, True)):
    out, clusters = run(*put, jnp.int32(step), jnp.bool_(ready))
    if ulysses is not None or step == 0:
      np.testing.assert_array_equal(np.asarray(clusters), np.asarray(stored))
      continue
    want, aux = scheduled_svg_attention(q, k, v, grid=grid, config=cfg, step=step, layer=0,
                                        key=key, seed=Seed(stored, jnp.bool_(ready)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)
    np.testing.assert_allclose(np.asarray(clusters), np.asarray(aux["clusters"]), atol=1e-5)
    assert not np.allclose(np.asarray(clusters), np.asarray(stored))
  assert run._cache_size() == 1  # steps and readiness are data


def test_warm_and_cold_calls_differ_only_where_the_seed_is_used():
  """Not ready: the seed is ignored. Ready: one update from the 3-update cold start's centroids
  is the 4-update cold start (the same sample, the same steps)."""
  q, k, v = inputs(1)
  call = lambda seed, iterations=3: scheduled_svg_attention(
      q, k, v, grid=GRID, config=config(iterations=iterations), step=1, layer=0,
      seed=seed)[1]["clusters"]
  cold = call(Seed(jnp.zeros((1, 8, CLUSTERS, 64)), jnp.bool_(False)))
  np.testing.assert_array_equal(np.asarray(cold), np.asarray(
      call(Seed(jnp.ones((1, 8, CLUSTERS, 64)), jnp.bool_(False)))))  # not ready: ignored
  warm = call(Seed(cold, jnp.bool_(True)))
  cold4 = call(Seed(cold, jnp.bool_(False)), iterations=4)
  np.testing.assert_allclose(np.asarray(warm), np.asarray(cold4), atol=1e-6)
  assert not np.allclose(np.asarray(warm), np.asarray(cold), atol=1e-3)
  with pytest.raises(ValueError, match="a warm start .* semantic among svg_layouts"):
    scheduled_svg_attention(q, k, v, grid=GRID, config=config(("spatial", "temporal")), step=1,
                            layer=0, seed=Seed(cold, jnp.bool_(True)))
