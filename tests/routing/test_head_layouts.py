"""A head layout is one record: one registered here alone runs through the router,
svg_attention, the sharded path and the run summary, against brute force."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.attention import svg_attention
from maxdiffusion_svg.kernels import masked_attention
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plugin import run_summary
from maxdiffusion_svg.routing import layouts
from maxdiffusion_svg.routing.router import profile_heads, sample_rows

GRID = VideoGrid(6, 8, 16)  # 768 tokens
TYPES = ("spatial", "temporal", "temporal", "spatial", "temporal", "spatial", "spatial", "temporal")
KEY = jax.random.key(3)


def _reverse(x, grid):
  del grid
  return x[..., ::-1, :]


# Reversed token order: the band is the same, but the sink (the placed sequence's first frame)
# is the video's last frame.
REVERSED = layouts.HeadLayout(
    "reversed", positions=lambda grid, tokens: grid.tokens - 1 - tokens,
    order=lambda grid: np.arange(grid.tokens, dtype=np.int32)[::-1].copy(),
    to_placed=_reverse, to_frame_major=_reverse, on_ring=False)


@pytest.fixture(autouse=True)
def reversed_layout():
  layouts.register(REVERSED)
  try:
    yield
  finally:
    layouts.unregister(REVERSED.name)


def config(**kw):
  return SvgConfig(**{"block_q": 128, "block_kv": 128, "backend": "xla", "profile_queries": 16,
                      "density": 0.3, "layouts": ("spatial", "reversed"), **kw})


def positions(name):
  tokens = np.arange(GRID.tokens)
  return tokens if name == "spatial" else GRID.tokens - 1 - tokens


def brute_errors(q, k, v, rows, mask):
  """float64: each head's sampled rows' MSE against dense under ``mask`` (frame-major)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum("bhrd,bhkd->bhrk", q[:, :, rows], k) / np.sqrt(q.shape[-1])

  def out(keep):
    x = np.where(keep, logits, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    return np.einsum("bhrk,bhkd->bhrd", p / p.sum(-1, keepdims=True), v)

  return np.mean((out(mask[rows]) - out(True)) ** 2, axis=(2, 3))


def test_the_registry_gives_it_an_id_and_the_config_accepts_it():
  assert layouts.names()[-1] == "reversed" and layouts.index("reversed") == 3
  assert layouts.check_layouts("reversed, spatial") == ("spatial", "reversed")
  note = layouts.ring_note(("spatial", "reversed"), 2, 4)
  assert note.startswith("reversed left out on the ring")
  with pytest.raises(ValueError, match="registered already"):
    layouts.register(REVERSED)
  assert SvgConfig.from_mapping({"svg_layouts": "[spatial, reversed]"}).layouts == (
      "spatial", "reversed")


def test_the_router_judges_it_by_its_own_mask():
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, TYPES[:4], head_dim=32, seed=4))
  cfg = config()
  routing = profile_heads(q, k, v, grid=GRID, config=cfg, key=KEY)
  rows = np.asarray(sample_rows(KEY, GRID.tokens, cfg.router))
  placed = cfg.plan(GRID).dense_mask()
  want = {name: brute_errors(q, k, v, rows, placed[np.ix_(positions(name), positions(name))])
          for name in ("spatial", "reversed")}
  errors = np.asarray(routing.errors)
  assert errors.shape == (1, 4, 4)
  np.testing.assert_allclose(errors[..., 0], want["spatial"], rtol=1e-4, atol=1e-9)
  np.testing.assert_allclose(errors[..., 3], want["reversed"], rtol=1e-4, atol=1e-9)
  assert np.isinf(errors[..., 1:3]).all()  # temporal and semantic are not candidates
  chosen = np.where(want["reversed"] < want["spatial"], 3, 0)
  np.testing.assert_array_equal(np.asarray(routing.layout), chosen)
  assert len(set(chosen.ravel())) == 2  # both are chosen somewhere: the choice is tested


def test_svg_attention_runs_each_head_in_its_layouts_mask():
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, TYPES[:4], head_dim=32, seed=4))
  cfg = config()
  out, info = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY, return_info=True)
  ids = np.asarray(info["layout"])
  assert set(ids.ravel()) == {0, 3} and "reversed_error" in info
  placed = cfg.plan(GRID).dense_mask()
  for b, h in np.ndindex(*ids.shape):
    pos = positions(layouts.names()[ids[b, h]])
    mask = jnp.asarray(placed[np.ix_(pos, pos)])
    want = masked_attention(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1], mask)
    np.testing.assert_allclose(np.asarray(out[b, h]), np.asarray(want[0, 0]), atol=2e-5)


def test_the_sharded_path_equals_one_device():
  if jax.device_count() < 8:
    pytest.fail("needs 8 devices (tests/conftest.py sets them)")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 1, 8, 1),
              ("data", "fsdp", "context", "tensor"))
  spec = P(("data", "fsdp"), None, "context", None)
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, TYPES, head_dim=32, seed=2))
  cfg = config()
  want, want_info = svg_attention(q, k, v, grid=GRID, config=cfg, key=KEY, return_info=True)
  assert set(np.asarray(want_info["layout"]).ravel()) == {0, 3}
  qs, ks, vs = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
  out, info = jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=GRID, config=cfg, key=KEY, return_info=True))(qs, ks, vs)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
  got, errors = np.asarray(info["errors"]), np.asarray(want_info["errors"])
  np.testing.assert_allclose(got[..., [0, 3]], errors[..., [0, 3]], rtol=1e-3, atol=1e-9)
  # the same choice wherever the two errors are apart (a spatial head's are tied near 0)
  gap = np.abs(errors[..., 0] - errors[..., 3])
  apart = gap > 1e-2 * np.maximum(errors[..., 0], errors[..., 3])
  assert apart.sum() >= 4
  np.testing.assert_array_equal(np.asarray(info["layout"])[apart],
                                np.asarray(want_info["layout"])[apart])


def test_the_run_summary_counts_its_heads():
  run_summary.reset()
  for layer, ids in enumerate(([0, 3, 3, 0], [3, 3, 3, 1])):
    jax.jit(lambda layout, layer=layer: run_summary.on_routing(layout, True, 0, layer))(
        jnp.asarray([ids], jnp.int32))
  jax.effects_barrier()
  counts = run_summary.counted_calls(2, ("spatial", "temporal", "reversed"))
  assert [share.name for share in counts.shares] == ["temporal", "reversed"]
  assert counts.share_of("reversed").share == pytest.approx(5 / 8)
  assert counts.temporal_share == pytest.approx(1 / 8)
  line = run_summary.summary_line(counts, 1, 2, "k", None)
  assert "temporal heads 12.5% of the sparse calls' heads" in line
  assert "reversed heads 62.5% (layers 0-0 50%, layers 1-1 75%)" in line
  run_summary.reset()
