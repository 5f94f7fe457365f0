"""Per-layer budgets: the allocation against brute force, the budget held, the keys read and
refused by name, and one compile as a traced layer picks its rung (density, compensation)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.per_layer import (Rung, allocate, allocate_greedy,
                                                check_layer_compensation, check_layer_densities,
                                                least_cost, levels)
from maxdiffusion_svg.budgets.schedule import Interval, Schedule
from maxdiffusion_svg.call.attention import scheduled_svg_attention
from maxdiffusion_svg.kernels import dense_attention
from maxdiffusion_svg.measure.calibration import (calibrate_heads, calibrate_layers,
                                                  candidate_rungs, relative_error, rung_costs)
from maxdiffusion_svg.plan.geometry import VideoGrid


def _brute(errors, costs, ok):
  best = None
  for choice in itertools.product(range(errors.shape[1]), repeat=errors.shape[0]):
    cost = costs[np.arange(len(choice)), choice].sum()
    error = errors[np.arange(len(choice)), choice].sum()
    if ok(cost, error) and (best is None or (error, cost) < best[:2]):
      best = (error, cost, choice)
  return best


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_optimal_against_brute_force(seed):
  rng = np.random.default_rng(seed)
  layers, rungs = 5, 4
  costs = np.broadcast_to(np.sort(rng.integers(1, 20, rungs)), (layers, rungs)).astype(float)
  if seed % 2:  # per-layer costs too
    costs = np.sort(rng.integers(1, 20, (layers, rungs)), axis=1).astype(float)
  errors = np.sort(rng.random((layers, rungs)), axis=1)[:, ::-1].copy()
  budget = float(costs[:, 1].sum())
  got = allocate(errors, costs, budget)
  error, cost, _ = _brute(errors, costs, lambda c, e: c <= budget)
  assert got.cost <= budget  # the budget is held
  assert got.error == pytest.approx(error)
  assert got.cost == pytest.approx(costs[np.arange(layers), list(got.choice)].sum())
  caps = errors[:, 1] * 1.5  # a guard: no layer left above 1.5x its second rung's error
  guarded = allocate(errors, costs, budget, caps)
  within = lambda ch: all(errors[i, r] <= caps[i] for i, r in enumerate(ch))
  best = min((errors[np.arange(layers), ch].sum(), costs[np.arange(layers), ch].sum())
             for ch in itertools.product(range(rungs), repeat=layers)
             if within(ch) and costs[np.arange(layers), ch].sum() <= budget)
  assert within(guarded.choice) and guarded.error == pytest.approx(best[0])
  target = float(errors[:, 2].sum())
  cheapest = least_cost(errors, costs, target)
  want = min((c, e) for c, e, _ in [
      (costs[np.arange(layers), ch].sum(), errors[np.arange(layers), ch].sum(), ch)
      for ch in itertools.product(range(rungs), repeat=layers)] if e <= target)
  assert cheapest.error <= target and cheapest.cost == pytest.approx(want[0])


@pytest.mark.parametrize("seed", range(8))
def test_greedy_allocation_holds_the_budget_within_one_step_of_brute_force(seed):
  """Layers x heads is too many items for the exact front: the greedy allocation never spends
  more than the budget, is never better than the optimum (a check on the brute force), and is
  within the largest single step's error of it; with a guard, no item above its cap."""
  rng = np.random.default_rng(seed)
  items, rungs = 6, 4
  costs = np.broadcast_to(np.sort(rng.integers(1, 25, rungs)), (items, rungs)).astype(float)
  errors = np.sort(rng.random((items, rungs)), axis=1)[:, ::-1].copy()
  budget = float(costs[:, 1].sum()) + seed  # budgets on and off the rungs' sums
  got = allocate_greedy(errors, costs, budget)
  error, _, _ = _brute(errors, costs, lambda c, e: c <= budget)
  step = np.max(errors[:, :-1] - errors[:, 1:])
  assert got.cost <= budget and got.cost == pytest.approx(costs[0, list(got.choice)].sum())
  assert error - 1e-12 <= got.error <= error + step
  caps = errors[:, 1] * 1.2
  guarded = allocate_greedy(errors, costs, budget, caps)
  assert all(errors[i, r] <= caps[i] * (1 + 1e-9) for i, r in enumerate(guarded.choice))
  with pytest.raises(ValueError, match="budget"):
    allocate_greedy(errors, costs, float(costs[:, 0].sum()) - 1)


def test_head_calibration_holds_uniform_tiles_and_reports_per_head_densities():
  rng = np.random.default_rng(3)
  densities, costs = (0.1, 0.2, 0.4, 1.0), np.array([10.0, 20.0, 40.0, 100.0])
  errors = np.sort(rng.random((3, 4, 4)), axis=2)[:, :, ::-1]  # [layers, heads, densities]
  result = calibrate_heads(errors, costs, densities, 0.2)
  assert result.tiles <= result.uniform_tiles == 3 * 20.0  # per head, over the layers
  assert result.allocation.error <= result.uniform_allocation.error
  assert np.array(result.chosen).shape == (3, 4)
  assert result.uniform_allocation.error == pytest.approx(errors[:, :, 1].mean(axis=1).sum())
  np.testing.assert_allclose(result.layer_errors().sum(), result.allocation.error)
  met = calibrate_heads(errors, costs, densities, 0.2, target_error=errors[:, :, 2].mean())
  assert met.allocation.error <= errors[:, :, 2].mean() * 3 + 1e-12
  tight = calibrate_heads(errors, costs, densities, 0.2, budget=45.0)  # a given budget is held
  assert tight.tiles <= 45.0
  with pytest.raises(ValueError, match="uniform density 0.3"):
    calibrate_heads(errors, costs, densities, 0.3)


def test_calibration_never_exceeds_uniform_tiles_nor_its_error():
  rng = np.random.default_rng(7)
  rungs = tuple(Rung(d, c) for d in (0.1, 0.2, 0.4, 1.0) for c in (False, True))
  costs = np.array([10.0, 10.5, 20.0, 20.5, 40.0, 40.5, 100.0, 100.0])
  errors = np.sort(rng.random((6, 8)), axis=1)[:, ::-1]
  result = calibrate_layers(errors, costs, rungs, Rung(0.2, False))
  assert result.allocation.cost <= result.uniform_allocation.cost == 120.0
  assert result.allocation.error <= result.uniform_allocation.error
  assert set(result.chosen) <= set(rungs)
  assert result.densities == tuple(r.density for r in result.chosen)
  with pytest.raises(ValueError, match=r"uniform rung 0.3"):
    calibrate_layers(errors, costs, rungs, Rung(0.3, False))
  with pytest.raises(ValueError, match="target-error"):
    calibrate_layers(errors, costs, rungs, Rung(0.2, False), target_error=-1.0)


def test_matching_uniform_spends_the_fewest_tiles_at_uniforms_own_error():
  """--match-uniform: brute force over every choice finds no cheaper one at uniform's error or
  below; per head, the greedy bisection meets it too."""
  rng = np.random.default_rng(11)
  rungs = tuple(Rung(d, False) for d in (0.1, 0.2, 0.4, 1.0))
  costs = np.array([10.0, 20.0, 40.0, 100.0])
  # layers that lose little below the uniform rung, and one that gains much above it
  errors = np.array([[0.11, 0.1, 0.05, 0.0], [0.02, 0.015, 0.01, 0.0], [0.9, 0.5, 0.1, 0.0],
                     [0.5, 0.4, 0.3, 0.0]])
  matched = calibrate_layers(errors, costs, rungs, Rung(0.2, False), match_uniform=True,
                             max_loss_db=None)
  uniform = errors[:, 1].sum()
  want = min(costs[list(c)].sum() for c in itertools.product(range(4), repeat=4)
             if errors[np.arange(4), list(c)].sum() <= uniform + 1e-12)
  assert matched.allocation.error <= uniform + 1e-12 and matched.allocation.cost == want
  assert matched.allocation.cost < matched.uniform_allocation.cost == 80.0
  with pytest.raises(ValueError, match="--target-error or --match-uniform, not both"):
    calibrate_layers(errors, costs, rungs, Rung(0.2, False), target_error=0.1, match_uniform=True)
  heads = np.sort(rng.random((3, 4, 4)), axis=2)[:, :, ::-1]
  met = calibrate_heads(heads, costs, (0.1, 0.2, 0.4, 1.0), 0.2, match_uniform=True)
  assert met.allocation.error <= met.uniform_allocation.error + 1e-12
  assert met.tiles <= met.uniform_tiles


def test_candidate_rungs_hold_every_uniform_choice():
  config = SvgConfig(density=0.25, high_noise_density=0.35)
  both = candidate_rungs(config, (0.1, 0.5), "both", (None, "high_noise"))
  assert both == tuple(sorted({Rung(d, c) for d in (0.1, 0.5) for c in (False, True)}
                              | {Rung(0.25, False), Rung(0.35, False)}))
  assert candidate_rungs(config, (0.1,), "config") == (Rung(0.1, False), Rung(0.25, False))
  assert candidate_rungs(config, (0.1,), "on") == (Rung(0.1, True), Rung(0.25, False))
  with pytest.raises(ValueError, match="--compensation must be one of both, off, on, config"):
    candidate_rungs(config, (0.1,), "sometimes")


def test_budget_below_the_cheapest_choice_is_refused():
  with pytest.raises(ValueError, match="no choice fits the budget"):
    allocate(np.ones((2, 2)), np.array([5.0, 9.0]), 9.0)


@pytest.mark.parametrize("value,want", [
    ([0.3, 0.2], (0.3, 0.2)), ("[0.3, 0.2]", (0.3, 0.2)), ("uniform", None), (None, None),
    ({"0-1": 0.5, 2: 0.1}, (0.5, 0.5, 0.1)), ("{0-1: 0.5, 2: 0.1}", (0.5, 0.5, 0.1))])
def test_layer_densities_read_lists_ranges_and_uniform(value, want):
  assert check_layer_densities(value) == want


@pytest.mark.parametrize("value,match", [
    ([0.3, 0.0], r"svg_layer_densities\[1\] must be in \(0, 1\]"),
    ({"0-1": 0.5, "3": 0.1}, r"layers \[2\] are in no range"),
    ({"0-2": 0.5, "2": 0.1}, "layer 2 is in two ranges"),
    ({"a-b": 0.5}, "layer range 'a-b'"),
    (0.3, "must be a list of densities per layer")])
def test_bad_layer_densities_are_refused_naming_the_key(value, match):
  with pytest.raises(ValueError, match=match):
    SvgConfig(layer_densities=value)


@pytest.mark.parametrize("value,want", [
    ([True, False], (True, False)), ("[true, false]", (True, False)), ("uniform", None),
    ({"0-1": True, 2: False}, (True, True, False))])
def test_layer_compensation_reads_lists_ranges_and_uniform(value, want):
  assert check_layer_compensation(value) == want


@pytest.mark.parametrize("kw,match", [
    ({"layer_compensation": [True, 1]}, r"svg_layer_compensation\[1\] must be true or false"),
    ({"high_noise_layer_compensation": "{0-1: true, 3: false}"},
     r"svg_high_noise_layer_compensation: layers \[2\] are in no range"),
    ({"layer_compensation": [True], "compensation_blocks": 3, "block_kv": 128},
     "svg_compensation_blocks must divide the key tile")])
def test_bad_layer_compensation_is_refused_naming_the_key(kw, match):
  with pytest.raises(ValueError, match=match):
    SvgConfig(**kw)


def test_layer_rungs_pair_each_layers_density_and_compensation():
  config = SvgConfig(density=0.25, compensation=True, layer_densities=(0.1, 0.4),
                     low_noise_layer_compensation=(False, True))
  assert config.layer_rungs_for(None) == (Rung(0.1, True), Rung(0.4, True))
  assert config.layer_rungs_for("low_noise") == (Rung(0.1, False), Rung(0.4, True))
  assert config.layer_key("compensation", "low_noise") == "svg_low_noise_layer_compensation"
  assert config.layer_key("compensation", "high_noise") == "svg_layer_compensation"
  assert SvgConfig(density=0.25, layer_compensation=(True,)).layer_rungs_for() == (
      Rung(0.25, True),)
  assert SvgConfig().layer_rungs_for() is None
  with pytest.raises(ValueError, match="svg_layer_densities gives 2 layers but "
                                       "svg_layer_compensation 3"):
    SvgConfig(layer_densities=(0.1, 0.2), layer_compensation=(True,) * 3).layer_rungs_for()


def test_yaml_keys_set_each_experts_list():
  config = SvgConfig.from_mapping({"svg_layer_densities": "[0.2, 0.3]",
                                   "svg_high_noise_layer_densities": "{0-1: 0.5}",
                                   "svg_low_noise_layer_densities": "uniform"})
  assert config.layer_densities_for(None) == (0.2, 0.3)
  assert config.layer_densities_for("high_noise") == (0.5, 0.5)
  assert config.layer_densities_for("low_noise") == (0.2, 0.3)
  assert SvgConfig.from_mapping({"svg_layer_densities": "uniform"}).layer_densities is None
  assert SvgConfig.from_mapping({"svg_low_noise_layer_compensation": "{0-1: true}"}
                                ).layer_compensation_for("low_noise") == (True, True)
  assert levels((0.3, 0.1, 0.3))[0] == (0.1, 0.3)
  assert levels((0.3, 0.1, 0.3))[1].tolist() == [1, 0, 1]


GRID = VideoGrid(8, 8, 16)  # 1,024 tokens: 8 tiles of 128 (22, 44, 58 of 64 visited at 0.2, 0.5, 0.8)


def _config(density=0.25, **kw):
  return SvgConfig(density=density, block_q=128, block_kv=128, backend="xla",
                   schedule=Schedule(Interval(0, None), Interval(0, None)), **kw)


def _each_layer_at_its_rung(config, rungs, seed):
  """Each layer's output through one jitted call with a traced layer, checked equal to the
  uniform call at that layer's rung; returns each layer's error against dense and the number of
  traces."""
  q, k, v = jax.random.normal(jax.random.key(seed), (3, 1, 2, GRID.tokens, 64))
  traces = []

  @jax.jit
  def call(q, k, v, layer):
    traces.append(layer)
    return scheduled_svg_attention(q, k, v, grid=GRID, config=config, step=jnp.int32(0),
                                   layer=layer)

  dense = dense_attention(q, k, v)
  errors = []
  for layer, (density, on) in enumerate(rungs):
    got = call(q, k, v, jnp.int32(layer))
    want = scheduled_svg_attention(q, k, v, grid=GRID, step=0, layer=layer,
                                   config=_config(density=density, compensation=on))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    errors.append(relative_error(got, dense).mean())
  return errors, len(traces)


def test_one_compile_each_layer_runs_its_own_density():
  """A traced layer picks its rung: each layer's output equals the call at its density, which
  differ (so a wrong rung is seen), in one compiled function."""
  densities = (0.2, 0.8, 0.2, 0.5)
  errors, traces = _each_layer_at_its_rung(_config(layer_densities=densities),
                                           [(d, False) for d in densities], seed=0)
  outs = dict(zip(densities, errors))
  assert traces == 1
  assert outs[0.2] > outs[0.5] > outs[0.8]  # the rungs differ, more tiles less error


def test_one_compile_each_layer_runs_its_own_compensation():
  """Compensation per layer: each layer equals the uniform call at its rung, which differ (the
  compensated call is nearer dense at the same density), in one compiled function."""
  densities, compensation = (0.2, 0.2, 0.5), (False, True, True)
  config = _config(layer_densities=densities, layer_compensation=compensation)
  errors, traces = _each_layer_at_its_rung(config, list(zip(densities, compensation)), seed=2)
  assert traces == 1
  assert errors[0] > errors[1] > errors[2]


def test_a_compensated_rung_costs_its_row_keys():
  """A rung's cost: visited tiles, plus, compensated, each query tile row's row keys in key
  tiles; counted here from the plan's skipped tiles (no padding on this grid: every skipped tile
  gives ``blocks`` centroids, the rows padded to the most any row sees, rounded up to 8)."""
  config = _config(compensation_blocks=8)
  costs = rung_costs(config, GRID, (Rung(0.2, False), Rung(0.2, True), Rung(1.0, True)))
  plan = config.at_density(0.2).plan(GRID)
  skipped = plan.num_kv_tiles - np.asarray(plan.num_visited)
  row_keys = -(-int(skipped.max()) * 8 // 8) * 8
  assert costs[0] == plan.stats.visited_tiles
  assert costs[1] == pytest.approx(costs[0] + plan.num_q_tiles * row_keys / 128)
  assert costs[2] == config.at_density(1.0).plan(GRID).stats.visited_tiles  # nothing skipped


def test_one_compile_under_a_scan_over_layers():
  """As a scanned forward runs them: the layer index is the scan's, one body for every layer."""
  q, k, v = jax.random.normal(jax.random.key(1), (3, 1, 2, GRID.tokens, 64))
  densities = (0.5, 0.2, 1.0)
  config = _config(layer_densities=densities)
  traces = []

  @jax.jit
  def forward(x):
    def body(x, layer):
      traces.append(layer)
      out = scheduled_svg_attention(x, k, v, grid=GRID, config=config, step=jnp.int32(0),
                                    layer=layer)
      return x, out
    return jax.lax.scan(body, x, jnp.arange(len(densities), dtype=jnp.int32))[1]

  outs = forward(q)
  assert len(traces) == 1
  for layer, density in enumerate(densities):
    want = scheduled_svg_attention(q, k, v, grid=GRID, config=_config(density=density),
                                   step=0, layer=layer)
    np.testing.assert_allclose(np.asarray(outs[layer]), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_sampled_rung_errors_equal_the_kernels_over_every_row(monkeypatch):
  """With every row sampled, a rung's on-device error is each head's better layout's relative
  error, as the kernel's outputs of each forced layout give it against dense."""
  from maxdiffusion_svg.bench.synthetic import planted_qkv  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.measure import calibration  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(calibration, "CALIBRATION_ROWS", GRID.tokens)
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, ("spatial", "moving", "temporal"), 64,
                                                   seed=3))
  rungs = (Rung(0.2), Rung(0.2, True), Rung(0.5), Rung(1.0))
  config = _config()
  got, temporal, _ = calibration.sampled_rung_errors(q, k, v, grid=GRID, config=config,
                                                     rungs=rungs, key=jax.random.key(0))
  got, temporal = np.asarray(got), np.asarray(temporal)
  mean, _, _ = calibration.sampled_rung_errors(q, k, v, grid=GRID, config=config, rungs=rungs,
                                               key=jax.random.key(0), weighting="mean")
  heads, _, power = calibration.sampled_rung_errors(q, k, v, grid=GRID, config=config,
                                                    rungs=rungs, key=jax.random.key(0),
                                                    per_head=True)
  dense = dense_attention(q, k, v)
  want_power = (np.asarray(dense, np.float64) ** 2).mean((-1, -2))[0]  # each head's output
  np.testing.assert_allclose(np.asarray(power), want_power, rtol=1e-4)
  for j, (density, on) in enumerate(rungs):
    per_layout = [relative_error(scheduled_svg_attention(
        q, k, v, grid=GRID, config=_config(density=density, layouts=(name,), compensation=on),
        step=0, layer=0), dense)[0] for name in ("spatial", "temporal")]
    mse = np.minimum(*per_layout)  # relative to each head's power: the same rows, all of them
    assert mean[j] == pytest.approx(mse.mean(), rel=2e-3, abs=1e-9), rungs[j]
    # the layer's output error over its power: each head's error weighed by its output power
    absolute = np.minimum(*[((np.asarray(scheduled_svg_attention(
        q, k, v, grid=GRID, config=_config(density=density, layouts=(name,), compensation=on),
        step=0, layer=0), np.float64) - np.asarray(dense, np.float64)) ** 2).mean((-1, -2))[0]
                            for name in ("spatial", "temporal")])
    assert got[j] == pytest.approx(absolute.sum() / want_power.sum(), rel=2e-3, abs=1e-9)
    np.testing.assert_allclose(np.asarray(heads)[j], mse, rtol=2e-3, atol=1e-9)  # each head
    if j < 3:  # (density 1: both layouts are dense, a tie)
      assert temporal[j] == pytest.approx(np.mean(per_layout[1] < per_layout[0])), rungs[j]
  assert got[0] > got[2] > got[3] >= 0 and got[0] > got[1]


@pytest.mark.parametrize("shape,spec", [
    ((1, 1, 8, 1), P(None, None, "context", None)),  # the CFG pair folded into the heads
    ((2, 1, 4, 1), P(("data", "fsdp"), None, "context", None)),  # the batch over data
    ((1, 1, 2, 4), P(None, None, "context", None))])  # a ring: the global measurement stands
def test_each_device_measures_its_own_heads_as_one_device_measures_them(shape, spec):
  """calibrate's on-device measurement inside the head exchange (each device its own heads)
  equals the single-device one, per head and in the mean."""
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench.synthetic import planted_qkv  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.measure import calibration  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "fsdp", "context", "tensor"))
  q, k, v = (jnp.asarray(x) for x in planted_qkv(
      GRID, ("spatial", "moving", "temporal", "mixed50") * 2, 64, seed=3, batch=2))
  kwargs = {"grid": GRID, "config": _config(), "rungs": (Rung(0.2), Rung(0.2, True), Rung(0.5)),
            "key": jax.random.key(0)}
  for per_head in (True, False):
    want = calibration.sampled_rung_errors(q, k, v, per_head=per_head, **kwargs)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    ulysses = 2 if shape[3] == 4 else None
    got = jax.jit(lambda q, k, v: calibration.sharded_rung_errors(
        q, k, v, mesh=mesh, qkv_spec=spec, ulysses_shards=ulysses, per_head=per_head,
        **kwargs))(*placed)
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-9)
