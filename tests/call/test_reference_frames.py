"""The leading (reference) frames: svg_sink_frames (every query attends their keys) and
svg_dense_frames (their queries attend every key), each head on its own mask otherwise, against
a dense masked softmax; sharded, scheduled, differentiated and refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.schedule import Interval, Schedule
from maxdiffusion_svg.call.attention import scheduled_svg_attention, svg_attention
from maxdiffusion_svg.kernels import masked_attention
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid, frame_major_order
from maxdiffusion_svg.plan.masks import probe_mask
from maxdiffusion_svg.plan.tiles import FULL, MASKED, dense_rows_plan
from maxdiffusion_svg.plugin import preflight

GRID = VideoGrid(6, 8, 20)  # 960 tokens: a 160-token frame, padding in the last 128-token tile
TYPES = ("spatial", "temporal", "temporal", "spatial")
KEY = jax.random.key(3)


def config(**kw):
  return SvgConfig(**{"block_q": 128, "block_kv": 128, "backend": "xla", "profile_queries": 16,
                      "density": 0.25, "dense_frames": 1, **kw})


def planted(grid=GRID, types=TYPES, dim=32, seed=2, batch=2):
  """Planted heads (the router still tells them apart) whose queries carry as much noise again:
  the leading rows' dense softmax then differs from their band's, so the tests can tell."""
  q, k, v = planted_qkv(grid, types, head_dim=dim, seed=seed, batch=batch)
  q = q + q.std() * np.random.default_rng(seed).standard_normal(q.shape).astype(q.dtype)
  return [jnp.asarray(x) for x in (q, k, v)]


def reference(q, k, v, cfg, temporal, grid=GRID):
  """Each head's plan mask in frame-major tokens (placed by its flag), its first
  ``dense_frames`` frames' rows all kept: dense masked softmax, head by head."""
  placed = cfg.plan(grid).dense_mask()
  pos = frame_major_order(grid)
  rows = cfg.dense_frames * grid.frame_size
  out = np.zeros(q.shape, np.float32)
  for b, h in np.ndindex(*temporal.shape):
    mask = placed[np.ix_(pos, pos)] if temporal[b, h] else placed.copy()
    mask[:rows] = True
    out[b, h] = np.asarray(masked_attention(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1],
                                            v[b:b + 1, h:h + 1], jnp.asarray(mask))[0, 0])
  return out


def test_the_rows_plan_visits_every_key_tile_of_the_leading_rows():
  plan = dense_rows_plan(GRID.tokens, 2 * GRID.frame_size, 128, 256)
  assert plan.q_len == 320 and plan.num_q_tiles == 3 and plan.num_kv_tiles == 4
  np.testing.assert_array_equal(plan.num_visited, [4, 4, 4])
  np.testing.assert_array_equal(plan.kv_index, [[0, 1, 2, 3]] * 3)
  # 960 keys in 256-key tiles: the last holds padding, the only tiles with a mask
  np.testing.assert_array_equal(plan.kind, [[FULL, FULL, FULL, MASKED]] * 3)
  assert plan.stats.kept_pairs == 320 * 960 and plan.stats.visited_tiles == 12
  with pytest.raises(ValueError, match=r"dense rows must be in \[1, 960\]"):
    dense_rows_plan(GRID.tokens, 0, 128, 128)


@pytest.mark.parametrize("mode,backend,frames,sink", [
    ("aligned", "xla", 1, 1), ("split", "xla", 2, 1), ("naive", "xla", 1, 1),
    ("split", "xla", 2, 2)])
def test_leading_rows_are_dense_and_every_other_row_keeps_its_heads_mask(mode, backend, frames,
                                                                         sink):
  q, k, v = planted()
  cfg = config(tile_mode=mode, backend=backend, dense_frames=frames, sink_frames=sink)
  out, info = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY, return_info=True)
  temporal = np.asarray(info["temporal"])
  assert temporal.any() and not temporal.all()  # both placements hold reference rows
  np.testing.assert_allclose(np.asarray(out), reference(q, k, v, cfg, temporal), atol=2e-5)
  # the rows' call is counted: every key tile of their query tiles, beside the band's
  rows_tiles = -(-frames * GRID.frame_size // 128) * -(-GRID.tokens // 128)
  np.testing.assert_array_equal(np.asarray(info["visited_tiles"]),
                                cfg.plan(GRID).stats.visited_tiles + rows_tiles)


@pytest.mark.parametrize("backend", ["splash", "pallas"])
def test_the_tpu_kernels_run_them_too(backend):
  """Splash runs whole sequences: its rows (a rectangle) take our kernel on a TPU, the XLA path
  here; ours runs them itself (interpreted here)."""
  q, k, v = planted(dim=128, seed=5, batch=1)
  cfg = config(backend=backend)
  out, info = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY, return_info=True)
  want = reference(q, k, v, cfg, np.asarray(info["temporal"]))
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
  if backend == "splash":  # our kernel needs 128-lane heads, wherever the call runs
    with pytest.raises(ValueError, match="svg_dense_frames with svg_backend splash runs the "
                                         "dense rows on our kernel, which needs head_dim a "
                                         "multiple of 128, got 32"):
      svg_attention(*planted(batch=1), grid=GRID, config=cfg, key=KEY)


def test_without_dense_frames_the_reference_rows_stay_sparse():
  q, k, v = planted()
  out = np.asarray(svg_attention(q, k, v, grid=GRID, config=config(dense_frames=0), key=KEY))
  dense = np.asarray(svg_attention(q, k, v, grid=GRID, config=config(), key=KEY))
  rows = GRID.frame_size
  np.testing.assert_array_equal(out[:, :, rows:], dense[:, :, rows:])
  assert np.abs(out[:, :, :rows] - dense[:, :, :rows]).max() > 1e-3  # the option does something


def test_schedule_flags_and_routing_change_without_recompiling():
  cfg = config(schedule=Schedule(Interval(1, None), Interval(0, None)))
  traces = []

  @jax.jit
  def run(q, k, v, step, layer):
    traces.append(1)
    return scheduled_svg_attention(q, k, v, grid=GRID, config=cfg, step=step, layer=layer)

  first, reversed_types = planted(), planted(types=TYPES[::-1], seed=4)
  for step in (0, 2, 3):
    for data in (first, reversed_types):
      got = run(*data, jnp.int32(step), jnp.int32(1))
      want = scheduled_svg_attention(*data, grid=GRID, config=cfg, step=step, layer=1)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  assert len(traces) == 1


@pytest.mark.parametrize("shape,ulysses", [((1, 1, 8, 1), None), ((2, 1, 2, 2), None)])
def test_sharded_equals_one_device(shape, ulysses):
  if jax.device_count() < 8:
    pytest.fail("needs 8 devices (tests/conftest.py sets them)")
  types = ("spatial", "temporal") * 4
  q, k, v = planted(types=types)
  cfg = config()
  want, info = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY, return_info=True)
  assert np.asarray(info["temporal"]).any()
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "fsdp", "context", "tensor"))
  spec = NamedSharding(mesh, P(("data", "fsdp"), None, "context", None))
  run = jax.jit(lambda q, k, v: sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID, config=cfg,
                                                      key=KEY, ulysses_shards=ulysses))
  out = run(*(jax.device_put(x, spec) for x in (q, k, v)))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)


def test_a_ring_refuses_them_by_key():
  if jax.device_count() < 8:
    pytest.fail("needs 8 devices (tests/conftest.py sets them)")
  q, k, v = planted(types=("spatial", "temporal") * 4)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 1, 8, 1), ("data", "fsdp", "context", "tensor"))
  refusal = ("svg_dense_frames is 1, whose dense rows need every key: ulysses_shards 2 leaves a "
             "ring of 4 sequence shards on this mesh")
  with pytest.raises(ValueError, match=refusal):  # the run and its pre-flight, in one's words
    sharded_svg_attention(q, k, v, mesh=mesh, grid=GRID, config=config(), key=KEY,
                          ulysses_shards=2)
  with pytest.raises(ValueError, match=refusal):
    preflight.check_dense_frames_on_ring(1, 2, 4)
  preflight.check_dense_frames_on_ring(0, 2, 4)
  preflight.check_dense_frames_on_ring(1, 8, 1)


def test_gradients_follow_the_dense_rows():
  q, k, v = planted(seed=6)
  cfg = config()
  w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  _, info = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY, return_info=True)
  temporal = np.asarray(info["temporal"])
  placed = cfg.plan(GRID).dense_mask()
  pos = frame_major_order(GRID)
  masks = np.stack([np.stack([placed[np.ix_(pos, pos)] if t else placed for t in row])
                    for row in temporal])
  masks[:, :, :GRID.frame_size] = True

  def loss_ref(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(jnp.where(masks, s, -jnp.inf), -1), v)
    return (out * w).sum()

  got = jax.grad(lambda q, k, v: (svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY)
                                  * w).sum(), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss_ref, argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip("qkv", got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("value", [-1, True, 1.5, "1"])
def test_bad_values_are_refused_by_key(value):
  with pytest.raises(ValueError, match="svg_dense_frames must be an integer >= 0"):
    SvgConfig(dense_frames=value)
  with pytest.raises(ValueError, match="svg_sink_frames must be an integer >= 1"):
    SvgConfig(sink_frames=0 if value == -1 else value)


@pytest.mark.parametrize("frames", [1, 2, 3])
def test_the_sink_covers_the_leading_frames_in_every_mask(frames):
  """Brute force on the exact (split) plan: every query keeps every key of the first
  ``frames`` frames (a spatial head's placed order is frame-major), the router's probe too;
  beyond them only the band."""
  cfg = config(tile_mode="split", sink_frames=frames, dense_frames=0)
  sink = frames * GRID.frame_size
  mask = cfg.plan(GRID).dense_mask()
  assert mask[:, :sink].all() and not mask[:, sink:].all()
  band = dataclasses.replace(cfg, include_sink=False).plan(GRID).dense_mask()
  np.testing.assert_array_equal(mask[:, sink:], band[:, sink:])
  assert probe_mask(GRID, True, frames).sink == sink
  assert cfg.router.sink_frames == frames
  probe = probe_mask(GRID, cfg.router.include_sink, cfg.router.sink_frames)
  assert probe.dense()[:, :sink].all()
  with pytest.raises(ValueError, match=r"svg_sink_frames \(6\) must be less than the video's 6"):
    config(sink_frames=6).plan(GRID)


def test_the_yaml_key_and_a_grid_with_too_few_frames():
  cfg = SvgConfig.from_mapping({"svg_dense_frames": 2})
  assert cfg.dense_frames == 2 and cfg.dense_rows(GRID) == 2 * GRID.frame_size
  assert SvgConfig().dense_rows(GRID) == 0
  q, k, v = planted()
  with pytest.raises(ValueError, match=r"svg_dense_frames \(6\) must be less than the video's 6"):
    svg_attention(q, k, v, grid=GRID, config=config(dense_frames=6))
