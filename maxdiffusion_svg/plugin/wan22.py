"""Which denoising steps each Wan 2.2 expert runs, decided as MaxDiffusion decides it.

MaxDiffusion's Wan 2.2 pipelines (T2V and I2V, at the tested commit) run the high-noise expert
on every step whose timestep ``t`` is at least ``boundary_ratio * num_train_timesteps``, and
the low-noise expert on the others. The timesteps are its UniPC scheduler's
(``set_timesteps``) under flow sigmas, which the Wan Diffusers checkpoints' scheduler configs
turn on, with 1000 training timesteps and the config's ``flow_shift``. The rule, in float32 as
the scheduler computes it, for ``n`` steps and shift ``s``:

    sigma_i = 1 + i * (1/1000 - 1) / n                 for i = 0 .. n-1 (a linspace to 1/1000)
    sigma_i = s * sigma_i / (1 + (s - 1) * sigma_i)     (the flow shift)
    sigma_0 = sigma_0 - 1e-6 if |sigma_0 - 1| < 1e-6    (t_0 stays below 1000)
    t_i = floor(1000 * sigma_i)                         (cast to int32)

The timesteps fall, so the high-noise expert runs steps ``[0, b)`` and the low-noise one
``[b, n)``, ``b`` being how many ``t_i >= boundary_ratio * 1000``. A test holds this to
MaxDiffusion's own scheduler where MaxDiffusion is importable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

# The Wan checkpoints' scheduler: flow sigmas over 1000 training timesteps.
TRAIN_TIMESTEPS = 1000
HIGH_NOISE, LOW_NOISE = "high_noise", "low_noise"


def flow_timesteps(steps: int, flow_shift: float,
                   train_timesteps: int = TRAIN_TIMESTEPS) -> np.ndarray:
  """The ``steps`` timesteps of a run, in the order the run takes them (falling)."""
  sigma = jnp.linspace(1.0, 1.0 / train_timesteps, steps + 1, dtype=jnp.float32)[:-1]
  sigma = flow_shift * sigma / (1 + (flow_shift - 1) * sigma)
  near_one = jnp.abs(sigma[0] - 1.0) < 1e-6
  sigma = sigma.at[0].set(jnp.where(near_one, sigma[0] - 1e-6, sigma[0]))
  return np.asarray((sigma * train_timesteps).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class ExpertSteps:
  """The steps of a Wan 2.2 run on each expert: high-noise ``[0, boundary_step)``, low-noise
  ``[boundary_step, steps)``."""

  steps: int
  boundary_ratio: float
  flow_shift: float
  timesteps: tuple[int, ...]

  @property
  def boundary_timestep(self) -> float:
    return self.boundary_ratio * TRAIN_TIMESTEPS

  @property
  def boundary_step(self) -> int:
    """The first low-noise step (the number of timesteps at or above the boundary)."""
    return int(sum(t >= self.boundary_timestep for t in self.timesteps))

  def of(self, expert: str) -> tuple[int, int]:
    """``[first, end)``: the steps ``expert`` runs."""
    if expert == HIGH_NOISE:
      return 0, self.boundary_step
    if expert == LOW_NOISE:
      return self.boundary_step, self.steps
    raise ValueError(f"expert must be {HIGH_NOISE} or {LOW_NOISE}, got {expert!r}")

  def as_dict(self) -> dict[str, Any]:
    return {"boundary_ratio": self.boundary_ratio, "flow_shift": self.flow_shift,
            "boundary_timestep": self.boundary_timestep, "boundary_step": self.boundary_step,
            "timesteps": list(self.timesteps),
            HIGH_NOISE: list(self.of(HIGH_NOISE)), LOW_NOISE: list(self.of(LOW_NOISE))}


def expert_steps(config: Mapping[str, Any], steps: int) -> ExpertSteps:
  """The split of a ``model_name: wan2.2`` config's ``steps`` between its experts."""
  values = {}
  for key, allowed in (("boundary_ratio", "a number in [0, 1], e.g. 0.875 (T2V) or 0.9 (I2V)"),
                       ("flow_shift", "a number > 0, e.g. 12.0 (T2V) or 5.0 (I2V)")):
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"model_name wan2.2 splits the steps between its experts by {key}, which "
                       f"the config {'lacks' if value is None else f'gives as {value!r}'}: "
                       f"give {allowed}")
    values[key] = float(value)
  if not 0 <= values["boundary_ratio"] <= 1 or values["flow_shift"] <= 0:
    raise ValueError(f"boundary_ratio must be in [0, 1] and flow_shift > 0, got "
                     f"{values['boundary_ratio']} and {values['flow_shift']}")
  timesteps = flow_timesteps(steps, values["flow_shift"])
  return ExpertSteps(steps, values["boundary_ratio"], values["flow_shift"],
                     tuple(int(t) for t in timesteps))
