"""Gradients of the sparse paths against autodiff of a float64 dense masked softmax.

The reference is plain attention under the mask the call computes (a plan's dense mask, a
head's own table, a routed head's placed mask), written as masked dense softmax in float64
and differentiated by JAX; ours is the custom VJP's flash-style backward over visited tiles.
"""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.attention import svg_attention
from maxdiffusion_svg.kernels import sparse_attention
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid, to_frame_major, to_temporal_major
from maxdiffusion_svg.plan.tiles import plan_tiles
from maxdiffusion_svg.routing.compensation import compensated_attention
from references import assert_grads_close, masked_loss64, reference_grads

GRID = VideoGrid(5, 6, 7)  # 210 tokens: padding in the last 128-token tile; the sink is frame 0
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 6e-2}


def qkvw(grid=GRID, dim=64, heads=3, batch=2, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  shape = (batch, heads, grid.tokens, dim)
  return [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(4)]


def test_our_kernel_differentiates_by_tokamaxs_backward_kernel_or_the_portable_one():
  # backward="auto": tokamax's Splash dkv kernel fed our kernel's log-sum-exp; "xla": the scan.
  plan = plan_tiles(GRID, 0.3, 128, 128, "aligned")
  q, k, v, w = qkvw(dim=128)
  grad = lambda backward: jax.grad(lambda q, k, v: (sparse_attention(
      q, k, v, plan, backend="pallas", backward=backward) * w).sum(), argnums=(0, 1, 2))
  assert "dkv" in str(jax.make_jaxpr(grad("auto"))(q, k, v))
  assert "dkv" not in str(jax.make_jaxpr(grad("xla"))(q, k, v))
  assert_grads_close(grad("xla")(q, k, v), reference_grads(
      masked_loss64(np.asarray(plan.dense_mask()), w), q, k, v), TOLERANCE[jnp.float32])
  with pytest.raises(ValueError, match="backward must be one of"):
    sparse_attention(q, k, v, plan, backend="pallas", backward="splash")


def test_each_heads_own_table_differentiates_by_its_own_mask():
  # The semantic layout's per-head tables: same counts per row as the plan, other columns.
  plan = plan_tiles(GRID, 0.3, 128, 128, "aligned")
  q, k, v, w = qkvw()
  rng = np.random.default_rng(3)
  nq, nkv = plan.num_q_tiles, plan.num_kv_tiles
  counts = plan.num_visited
  tables = np.zeros((*q.shape[:2], nq, plan.width), np.int32)
  mask = np.zeros((*q.shape[:2], GRID.tokens, GRID.tokens), bool)
  for b in range(q.shape[0]):
    for h in range(q.shape[1]):
      for r in range(nq):
        cols = np.sort(rng.choice(nkv, counts[r], replace=False))
        tables[b, h, r, :counts[r]] = cols
        for c in cols:
          mask[b, h, r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] = True
  got = jax.grad(lambda q, k, v: (sparse_attention(q, k, v, plan, backend="xla",
                                                   head_tiles=jnp.asarray(tables)) * w).sum(),
                 argnums=(0, 1, 2))(q, k, v)
  assert_grads_close(got, reference_grads(masked_loss64(mask, w), q, k, v), 2e-5)


def compensated_loss64(plan, blocks, w):
  """The compensation rule differentiated in float64: visited keys plus, per query tile row,
  the mean key and value of each sub-block it skips (weighted by its key count)."""
  s = GRID.tokens
  size = plan.block_kv // blocks
  starts = list(range(0, s, size))
  visited = plan.tile_map() != 0
  tiles = np.array([start // plan.block_kv for start in starts])
  sees = ~visited[np.arange(s)[:, None] // plan.block_q, tiles[None, :]]
  logs = np.array([np.log(min(start + size, s) - start) for start in starts])

  def loss(q, k, v):
    means = lambda x: jnp.stack([x[:, :, a:a + size].mean(axis=2) for a in starts], axis=2)
    scale = q.shape[-1] ** -0.5
    logits = jnp.where(plan.dense_mask(), jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale, -jnp.inf)
    extra = jnp.where(sees, jnp.einsum("bhqd,bhnd->bhqn", q, means(k)) * scale + logs, -jnp.inf)
    p = jax.nn.softmax(jnp.concatenate([logits, extra], axis=-1), axis=-1)
    out = jnp.einsum("bhqk,bhkd->bhqd", p, jnp.concatenate([v, means(v)], axis=2))
    return (out * w).sum()
  return loss


@pytest.mark.parametrize("backend", ["xla", "splash", "pallas"])
def test_compensation_differentiates_through_the_centroid_means(backend):
  plan = plan_tiles(VideoGrid(5, 6, 7), 0.3, 128, 128, "aligned")
  q, k, v, w = qkvw(dim=128 if backend == "pallas" else 64, heads=2, batch=1)
  got = jax.grad(lambda q, k, v: (compensated_attention(q, k, v, plan, blocks=2, backend=backend)
                                  * w).sum(), argnums=(0, 1, 2))(q, k, v)
  assert_grads_close(got, reference_grads(compensated_loss64(plan, 2, w), q, k, v), 2e-5)


def config(**kw):
  return SvgConfig(**{"block_q": 128, "block_kv": 128, "backend": "xla", "profile_queries": 16,
                      "density": 0.3, **kw})


SVG_GRID = VideoGrid(6, 8, 16)  # 768 tokens, 96 per shard on 8 devices
TYPES = ("spatial", "temporal") * 4


def test_svg_attention_differentiates_with_the_routing_held_fixed():
  cfg = config()
  q, k, v = (jnp.asarray(x) for x in planted_qkv(SVG_GRID, TYPES, head_dim=32, seed=2))
  w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  key = jax.random.key(7)
  _, info = svg_attention(q, k, v, grid=SVG_GRID, config=cfg, key=key, return_info=True)
  temporal = np.asarray(info["temporal"])
  assert temporal.any() and not temporal.all()
  got = jax.grad(lambda q, k, v: (svg_attention(q, k, v, grid=SVG_GRID, config=cfg, key=key)
                                  * w).sum(), argnums=(0, 1, 2))(q, k, v)
  plan_mask = np.asarray(cfg.plan(SVG_GRID).dense_mask())
  flags = temporal[:, :, None, None]

  def loss(q, k, v):  # each head placed by its flag, the plan's mask, placed back
    place = lambda x: jnp.where(flags, to_temporal_major(x, SVG_GRID), x)
    out = masked_loss_out(place(q), place(k), place(v), plan_mask)
    return (jnp.where(flags, to_frame_major(out, SVG_GRID), out) * w).sum()

  assert_grads_close(got, reference_grads(loss, q, k, v), 2e-5)


def masked_loss_out(q, k, v, mask):
  s = jnp.where(mask, jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5, -jnp.inf)
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("ulysses", [None, 2])  # the head exchange on 8 devices; rings of 4
@pytest.mark.parametrize("compensation", [False, True])
def test_sharded_and_ring_gradients_equal_one_devices(ulysses, compensation):
  if jax.device_count() < 8:
    pytest.fail("needs 8 devices (tests/conftest.py sets them)")
  cfg = config(compensation=compensation, tile_mode="aligned")
  q, k, v = (jnp.asarray(x) for x in planted_qkv(SVG_GRID, TYPES, head_dim=32, seed=2))
  w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  key = jax.random.key(7)
  want = jax.grad(lambda q, k, v: (svg_attention(q, k, v, grid=SVG_GRID, config=cfg, key=key)
                                   * w).sum(), argnums=(0, 1, 2))(q, k, v)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 1, 8, 1), ("data", "fsdp", "context", "tensor"))
  spec = NamedSharding(mesh, P(("data", "fsdp"), None, "context", None))
  run = jax.jit(jax.grad(lambda q, k, v: (sharded_svg_attention(
      q, k, v, mesh=mesh, grid=SVG_GRID, config=cfg, key=key, ulysses_shards=ulysses) * w).sum(),
      argnums=(0, 1, 2)))
  got = run(*(jax.device_put(x, spec) for x in (q, k, v)))
  for name, a, b in zip("qkv", got, want):
    assert np.abs(np.asarray(b)).max() > 0.1
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5, err_msg=f"d{name}")


def test_semantic_heads_differentiate_with_clusters_and_tables_held_fixed():
  # Float64 through the XLA path; a directional finite difference of q and v (a small step of
  # either leaves the clusters, tables and routing as they are; keys move the clusters).
  cfg = config(tile_mode="aligned", layouts=("spatial", "temporal", "semantic"),
               semantic_clusters=8)
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(x, jnp.float64)
               for x in planted_qkv(SVG_GRID, TYPES[:4], head_dim=32, seed=2))
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape))
    key = jax.random.key(7)
    _, info = svg_attention(q, k, v, grid=SVG_GRID, config=cfg, key=key, return_info=True)
    assert (np.asarray(info["layout"]) == 2).any()  # semantic heads present
    loss = lambda q, k, v: (svg_attention(q, k, v, grid=SVG_GRID, config=cfg, key=key) * w).sum()
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    rng = np.random.default_rng(4)
    for i in (0, 2):
      d = jnp.asarray(rng.standard_normal(q.shape))
      step = [jnp.zeros_like(q)] * 3
      step[i] = 1e-3 * d
      plus = loss(*(x + s for x, s in zip((q, k, v), step)))
      minus = loss(*(x - s for x, s in zip((q, k, v), step)))
      np.testing.assert_allclose(float((plus - minus) / 2e-3), float((grads[i] * d).sum()),
                                 rtol=2e-2)


def test_remat_policies_see_the_residuals_by_name():
  # A policy that saves only the named residuals keeps the output and log-sum-exp, under our
  # names and under the caller's (MaxDiffusion's self_attn, which its policies name).
  from maxdiffusion_svg.kernels.gradient import residuals_named
  plan = plan_tiles(GRID, 0.3, 128, 128, "aligned")
  q = qkvw(batch=1, heads=2)[0]

  def loss(q):
    with residuals_named("self_attn"):
      return jnp.sin(sparse_attention(jnp.cos(q), q, q, plan, backend="xla")).sum()

  for name in ("self_attn", "svg_attention_lse"):
    policy = jax.checkpoint_policies.save_only_these_names(name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=policy), q)
    named = [line for line in printed.getvalue().splitlines() if f"named '{name}'" in line]
    named = [tuple(int(n) for n in line.split("[", 1)[1].split("]")[0].split(",")) for line in named]
    assert (1, 2, GRID.tokens) in named  # the log-sum-exp
    assert name != "self_attn" or (1, 2, GRID.tokens, 64) in named  # and the output
