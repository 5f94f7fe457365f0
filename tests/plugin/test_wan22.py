"""Which steps each Wan 2.2 expert runs (maxdiffusion_svg.plugin.wan22), against the rule
written out in float64 and, where MaxDiffusion is importable, against its own scheduler."""

import math
import re

import numpy as np
import pytest

from maxdiffusion_svg.plugin.wan22 import expert_steps, flow_timesteps


def float64_timesteps(steps: int, shift: float) -> list[float]:
  """The flow-sigma timesteps before the cast, in float64: the rule as the docstring gives it."""
  out = []
  for i in range(steps):
    sigma = 1 + i * (1 / 1000 - 1) / steps
    sigma = shift * sigma / (1 + (shift - 1) * sigma)
    out.append(1000 * (sigma - 1e-6 if abs(sigma - 1) < 1e-6 else sigma))
  return out


@pytest.mark.parametrize("steps", [1, 4, 30, 40, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 12.0])
def test_the_timesteps_follow_the_flow_sigma_rule(steps, shift):
  """Truncated as the int32 cast truncates: within float32's rounding of the float64 value
  (which may sit a hair either side of a whole number)."""
  got = flow_timesteps(steps, shift)
  want = float64_timesteps(steps, shift)
  assert got.dtype == np.int32 and len(got) == steps
  assert all(w - 1 - 1e-6 < g <= w + 1e-6 for g, w in zip(got, want))
  assert list(got) == sorted(got, reverse=True) and got[0] < 1000


@pytest.mark.parametrize("config, steps, boundary", [
    # MaxDiffusion's base_wan_27b.yml: "~step 26 of 40 at boundary_ratio 0.875" (flow_shift 12).
    ({"boundary_ratio": 0.875, "flow_shift": 12.0}, 40, 26),
    # base_wan_i2v_27b.yml: "the dip near step 15 marks the high->low boundary" (0.9, shift 5).
    ({"boundary_ratio": 0.9, "flow_shift": 5.0}, 40, 15),
    ({"boundary_ratio": 0.0, "flow_shift": 5.0}, 40, 40),  # every step at or above 0
    ({"boundary_ratio": 1.0, "flow_shift": 5.0}, 40, 0),  # no step reaches 1000
])
def test_the_boundary_step_is_where_the_timesteps_drop_below_the_ratio(config, steps, boundary):
  split = expert_steps(config, steps)
  assert split.boundary_step == boundary
  assert split.of("high_noise") == (0, boundary) and split.of("low_noise") == (boundary, steps)
  reference = sum(math.floor(t) >= config["boundary_ratio"] * 1000
                  for t in float64_timesteps(steps, config["flow_shift"]))
  assert abs(split.boundary_step - reference) <= 1


@pytest.mark.parametrize("config, needle", [
    ({"flow_shift": 12.0}, "by boundary_ratio, which the config lacks: give a number in [0, 1]"),
    ({"boundary_ratio": 0.875}, "by flow_shift, which the config lacks"),
    ({"boundary_ratio": "high", "flow_shift": 12.0}, "gives as 'high'"),
    ({"boundary_ratio": 1.5, "flow_shift": 12.0}, "boundary_ratio must be in [0, 1]"),
])
def test_missing_or_bad_keys_are_named(config, needle):
  with pytest.raises(ValueError, match=re.escape(needle)):
    expert_steps(config, 40)
