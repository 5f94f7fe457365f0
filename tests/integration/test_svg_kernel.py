"""The svg kernel inside a tiny random Wan transformer built the pipeline's way."""

import jax
import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg import plugin
from maxdiffusion_svg.testing import tiny_wan

EVERYTHING = {"svg_active_steps": [0, None], "svg_active_layers": [0, None]}


@pytest.fixture(scope="module", autouse=True)
def registered():
  plugin.register()


_RESULTS = {}


def forward(tmp_path_factory, devices, attention, scan_layers=True, head_dim=tiny_wan.HEAD_DIM,
            heads=tiny_wan.HEADS, **keys):
  """Transformer output on fixed inputs (batch 2, as with classifier-free guidance), and
  the svg kernel's call log; cached, since several tests compare the same runs."""
  cache_key = repr((devices, attention, scan_layers, head_dim, heads, sorted(keys.items())))
  if cache_key not in _RESULTS:
    config = tiny_wan.init_config(tiny_wan.write_config(
        str(tmp_path_factory.mktemp("config")), attention=attention, scan_layers=scan_layers,
        **keys))
    mesh = tiny_wan.make_mesh(config, devices)
    model = tiny_wan.build_transformer(config, mesh, head_dim=head_dim, heads=heads)
    latents, text = tiny_wan.inputs(batch=2)
    with plugin.record_calls() as log:
      out = np.asarray(tiny_wan.forward(model, mesh[1], config, latents, text, 500))
      jax.effects_barrier()
    _RESULTS[cache_key] = (out, log)
  return _RESULTS[cache_key]


@pytest.mark.parametrize("devices", [1, 8])
def test_density_one_equals_dot_product(tmp_path_factory, devices):
  dense, _ = forward(tmp_path_factory, devices, "dot_product")
  svg, log = forward(tmp_path_factory, devices, "svg", svg_density=1.0, **EVERYTHING)
  scale = np.abs(dense).max()
  np.testing.assert_allclose(svg / scale, dense / scale, atol=1e-4)
  assert [r["kind"] for r in log].count("self") == 2  # both layers ran the svg path
  assert all(r["sparse"] for r in log if r["kind"] == "self")


# Our TPU kernel, interpreted: it needs head_dim in whole lanes, so a tiny Wan with 128-wide heads.
OURS = {"svg_backend": "pallas", "svg_block_q": 128, "svg_block_kv": 128, **EVERYTHING}


def test_our_kernel_at_density_one_equals_dot_product(tmp_path_factory):
  dense, _ = forward(tmp_path_factory, 8, "dot_product", head_dim=128)
  svg, log = forward(tmp_path_factory, 8, "svg", head_dim=128, svg_density=1.0, **OURS)
  scale = np.abs(dense).max()
  np.testing.assert_allclose(svg / scale, dense / scale, atol=1e-4)
  assert [r["kind"] for r in log].count("self") == 2


def test_our_kernels_sparse_calls_equal_the_xla_paths(tmp_path_factory):
  """Same routing and plan through our kernel and through the XLA executor."""
  ours, log = forward(tmp_path_factory, 8, "svg", head_dim=128, svg_density=0.3, **OURS)
  xla, _ = forward(tmp_path_factory, 8, "svg", head_dim=128, svg_density=0.3,
                   **{**OURS, "svg_backend": "xla"})
  dense, _ = forward(tmp_path_factory, 8, "dot_product", head_dim=128)
  scale = np.abs(xla).max()
  np.testing.assert_allclose(ours / scale, xla / scale, atol=1e-4)
  assert np.linalg.norm(ours - dense) / np.linalg.norm(dense) > 1e-3  # really sparse
  assert all(r["sparse"] for r in log if r["kind"] == "self")


def test_sparse_density_runs_and_stays_close(tmp_path_factory):
  dense, _ = forward(tmp_path_factory, 8, "dot_product")
  sparse, log = forward(tmp_path_factory, 8, "svg", svg_density=0.3, **EVERYTHING)
  rel = np.linalg.norm(sparse - dense) / np.linalg.norm(dense)
  assert 1e-3 < rel < 0.05, rel  # really sparse, and close (docs/development.md: "tiny Wan" figures)
  assert [(r["kind"], r["layer"], r["sparse"], r["density"]) for r in log
          if r["kind"] == "self"] == [("self", 0, True, 0.3), ("self", 1, True, 0.3)]


def test_cross_attention_and_outside_the_schedule_run_dense(tmp_path_factory):
  dense, _ = forward(tmp_path_factory, 8, "dot_product")
  # Layer 0 is outside svg_active_layers: it runs dense, layer 1 sparse.
  out, log = forward(tmp_path_factory, 8, "svg", svg_density=0.3,
                     svg_active_steps=[0, None], svg_active_layers=[1, None])
  assert sorted((r["kind"], r["layer"], r["sparse"]) for r in log) == [
      ("cross", -1, False), ("cross", -1, False), ("self", 0, False), ("self", 1, True)]
  all_sparse, _ = forward(tmp_path_factory, 8, "svg", svg_density=0.3, **EVERYTHING)
  assert not np.allclose(out, all_sparse, atol=1e-4)  # layer 0 really was dense
  assert not np.allclose(out, dense, atol=1e-4)


def test_scan_layers_on_and_off_agree(tmp_path_factory):
  keys = {"svg_density": 0.3, "svg_active_steps": [0, None], "svg_active_layers": [1, None]}
  scanned, log_scanned = forward(tmp_path_factory, 8, "svg", scan_layers=True, **keys)
  looped, log_looped = forward(tmp_path_factory, 8, "svg", scan_layers=False, **keys)
  scale = np.abs(scanned).max()
  np.testing.assert_allclose(looped / scale, scanned / scale, atol=1e-5)
  assert sorted(map(str, log_scanned)) == sorted(map(str, log_looped))


def test_per_layer_rungs_with_scan_layers_on_and_off(tmp_path_factory):
  """``svg_layer_densities`` and ``svg_layer_compensation`` in MaxDiffusion's transformer, its
  layers scanned (``nnx.scan``: the layer index traced) and looped (one block each): the same
  output, each layer at its own rung, and not the uniform run's."""
  keys = {"svg_density": 0.3, **EVERYTHING}
  rungs = {"svg_layer_densities": [0.2, 0.6], "svg_layer_compensation": [True, False]}
  scanned, log_scanned = forward(tmp_path_factory, 8, "svg", scan_layers=True, **keys, **rungs)
  looped, log_looped = forward(tmp_path_factory, 8, "svg", scan_layers=False, **keys, **rungs)
  uniform, _ = forward(tmp_path_factory, 8, "svg", **keys)
  scale = np.abs(scanned).max()
  np.testing.assert_allclose(looped / scale, scanned / scale, atol=1e-5)
  assert not np.allclose(scanned / scale, uniform / scale, atol=1e-4)
  for log in (log_scanned, log_looped):
    assert sorted((r["layer"], r["density"], r["compensation"]) for r in log
                  if r["kind"] == "self") == [(0, 0.2, True), (1, 0.6, False)]


def test_per_head_densities_with_scan_layers_on_and_off_and_sharded(tmp_path_factory):
  """``svg_head_densities`` in MaxDiffusion's transformer: each layer's heads at their own
  densities, scanned and looped, on 8 devices (each device's heads after the exchange) and on
  one: the same output, not the uniform run's, and the call log has each layer's mean."""
  per_head = [[0.2 if h % 2 else 0.6 for h in range(tiny_wan.HEADS)],
              [1.0] + [0.2] * (tiny_wan.HEADS - 1)]
  keys = {"svg_density": 0.3, "svg_head_densities": per_head, **EVERYTHING}
  scanned, log_scanned = forward(tmp_path_factory, 8, "svg", scan_layers=True, **keys)
  looped, log_looped = forward(tmp_path_factory, 8, "svg", scan_layers=False, **keys)
  single, _ = forward(tmp_path_factory, 1, "svg", **keys)
  uniform, _ = forward(tmp_path_factory, 8, "svg", svg_density=0.3, **EVERYTHING)
  scale = np.abs(scanned).max()
  np.testing.assert_allclose(looped / scale, scanned / scale, atol=1e-5)
  np.testing.assert_allclose(single / scale, scanned / scale, atol=1e-5)
  assert not np.allclose(scanned / scale, uniform / scale, atol=1e-4)
  means = [round(float(np.mean(row)), 6) for row in per_head]
  for log in (log_scanned, log_looped):
    assert sorted((r["layer"], r["density"]) for r in log if r["kind"] == "self") == [
        (0, means[0]), (1, means[1])]


def test_the_layout_follows_the_configs_logical_axis_rules(tmp_path_factory):
  """A rule set that splits the batch over ``data`` only, on a data x fsdp x context mesh
  (2 x 2 x 2): the kernel reads the layout from the rules, as MaxDiffusion's ulysses does.
  With the layout fixed to batch over data x fsdp it refused the CFG pair (2 over 4 shards);
  now it gives the 8-way context result."""
  rules = [[name, axes] for name, axes in tiny_wan.base_rules()
           if name not in ("batch", "activation_batch")]
  rules = [["batch", "data"], ["activation_batch", "data"], *rules]
  keys = {"svg_density": 0.3, **EVERYTHING}
  want, _ = forward(tmp_path_factory, 8, "svg", **keys)
  got, log = forward(tmp_path_factory, 8, "svg", logical_axis_rules=rules,
                     ici_data_parallelism=2, ici_fsdp_parallelism=2,
                     ici_context_parallelism=2, **keys)
  assert [r["kind"] for r in log].count("self") == 2
  scale = np.abs(want).max()
  np.testing.assert_allclose(got / scale, want / scale, atol=1e-5)


@pytest.mark.parametrize("mesh", [
    # as configs/wan_svg_v6e32.yml splits 32 chips: data x context, the context axis (4) not
    # dividing the heads (6), ulysses_shards 2 leaving a ring of 2
    {"ici_data_parallelism": 2, "ici_context_parallelism": 4, "ulysses_shards": 2},
    # context only (the CFG pair folded into the heads), a ring of 4 (full tier: the same path)
    pytest.param({"ici_context_parallelism": 8, "ulysses_shards": 2}, marks=pytest.mark.full),
])
def test_ulysses_shards_run_a_context_axis_that_does_not_divide_the_heads(tmp_path_factory,
                                                                          mesh):
  """MaxDiffusion's ulysses_shards reaches the kernel through its attention context: heads
  exchanged in groups of 2, the rest of the context axis a ring, and the transformer's output is
  the single device's, sparse (density 0.3) in every layer."""
  keys = {"svg_density": 0.3, **EVERYTHING}
  want, _ = forward(tmp_path_factory, 1, "svg", heads=6, **keys)
  got, log = forward(tmp_path_factory, 8, "svg", heads=6, **mesh, **keys)
  assert [(r["kind"], r["sparse"]) for r in log if r["kind"] == "self"] == [("self", True)] * 2
  scale = np.abs(want).max()
  np.testing.assert_allclose(got / scale, want / scale, atol=1e-5)
  dense, _ = forward(tmp_path_factory, 1, "dot_product", heads=6)
  assert np.linalg.norm(got - dense) / np.linalg.norm(dense) > 1e-3  # really sparse
