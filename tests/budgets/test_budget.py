"""One budget record per expert: every combination of shared and own keys, resolved by hand."""

import itertools

import numpy as np
import pytest

from maxdiffusion_svg.budgets.budget import Budget, own_key
from maxdiffusion_svg.budgets.config import EXPERTS, SvgConfig
from maxdiffusion_svg.budgets.per_layer import Rung
from maxdiffusion_svg.parallel.ring_plan import budget_keys

SHARED = {"layer_densities": (0.3, 0.2, 0.2), "layer_compensation": (True, False, False),
          "head_densities": ((0.3, 0.1),)}
OWN = {"layer_densities": (0.4, 0.4, 0.1), "layer_compensation": (False, False, True),
       "head_densities": ((0.2, 0.2), (0.5, 0.1), (0.3, 0.3))}
WHAT = {"layer_densities": "densities", "layer_compensation": "compensation",
        "head_densities": "head"}


def configs():
  """Per-layer keys (shared and each expert's, any subset) or per-head ones (a head key is
  refused beside a per-layer one), with and without an expert's own density."""
  for names in (("layer_densities", "layer_compensation"), ("head_densities",)):
    for shared, own in itertools.product(itertools.product([False, True], repeat=len(names)),
                                         repeat=2):
      kw = {"density": 0.25, "high_noise_density": 0.35, "compensation": False}
      kw.update({n: SHARED[n] for n, on in zip(names, shared) if on})
      kw.update({f"high_noise_{n}": OWN[n] for n, on in zip(names, own) if on})
      yield kw


@pytest.mark.parametrize("kw", list(configs()))
def test_each_value_comes_from_the_experts_key_else_the_shared_one(kw):
  config = SvgConfig(**kw)
  for expert in (None, *EXPERTS):
    budget = config.budget(expert)
    assert budget.density == (0.35 if expert == "high_noise" else 0.25)
    for name, what in WHAT.items():
      own = expert is not None and f"{expert}_{name}" in kw
      want = kw[f"{expert}_{name}"] if own else kw.get(name)
      assert getattr(budget, name) == want
      assert budget.key(what) == (f"svg_{expert}_{name}" if own else f"svg_{name}")
      assert (what in budget.own) == own
    # the config's one-value views read the same record
    assert config.density_for(expert) == budget.density
    assert config.layer_rungs_for(expert) == budget.layer_rungs
    assert config.head_key(expert) == budget.key("head")
    assert config.layer_key("densities", expert) == budget.key("densities")
    set_keys = [budget.key(w) for n, w in WHAT.items() if getattr(budget, n) is not None]
    assert budget.set_keys() == tuple(set_keys)
    assert budget_keys(config, (expert,)) == tuple(set_keys)


def test_layer_rungs_fill_the_missing_list_and_refuse_two_lengths():
  budget = Budget(None, 0.3, True, layer_densities=(0.2, 0.1))
  assert budget.layer_rungs == (Rung(0.2, True), Rung(0.1, True))
  budget = Budget(None, 0.3, False, layer_compensation=(True, False))
  assert budget.layer_rungs == (Rung(0.3, True), Rung(0.3, False))
  assert Budget(None, 0.3, False).layer_rungs is None
  with pytest.raises(ValueError, match="svg_layer_densities gives 2 layers but "
                                       "svg_layer_compensation 3"):
    _ = Budget(None, 0.3, False, (0.2, 0.1), (True, False, True)).layer_rungs


def test_what_calls_record_and_the_run_summary_says():
  assert Budget(None, 0.3, True).recorded() is None
  assert Budget(None, 0.3, True).describe() == "density 0.3"
  per_layer = Budget(None, 0.3, False, (0.2, 0.2, 0.1), (True, False, False))
  assert per_layer.recorded() == ((0.2, 0.2, 0.1), (True, False, False))
  assert per_layer.describe() == "densities per layer 0-1: 0.2, 2: 0.1"
  rows = ((0.2, 0.4), (0.1, 0.1))
  per_head = Budget("low_noise", 0.3, True, head_densities=rows, own=frozenset({"head"}))
  means, compensation = per_head.recorded()
  np.testing.assert_allclose(means, [0.3, 0.1])
  assert compensation == (False, False)  # per-head calls run uncompensated
  assert per_head.describe() == ("densities per head (svg_head_densities) 0: 0.2-0.4 (mean 0.3), "
                                 "1: 0.1-0.1 (mean 0.1)")
  assert per_head.key("head") == "svg_low_noise_head_densities"


def test_the_overlay_writes_each_experts_own_key():
  assert [own_key(w, None) for w in ("densities", "compensation", "head", "density")] == [
      "svg_layer_densities", "svg_layer_compensation", "svg_head_densities", "svg_density"]
  assert own_key("densities", "low_noise") == "svg_low_noise_layer_densities"
  assert own_key("head", "high_noise") == "svg_high_noise_head_densities"
  with pytest.raises(ValueError, match="expert must be one of high_noise, low_noise"):
    SvgConfig().budget("mid_noise")
