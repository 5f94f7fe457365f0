"""The pre-flight's rules against MaxDiffusion's own code: the mesh its create_device_mesh
builds (and refuses) on the 8 simulated devices, and the steps its UniPC scheduler gives each
Wan 2.2 expert."""

import numpy as np
import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.plugin import preflight
from maxdiffusion_svg.plugin.wan22 import expert_steps, flow_timesteps

WAN_MESH = {"ici_data_parallelism": 1, "ici_fsdp_parallelism": 1, "ici_context_parallelism": -1,
            "ici_tensor_parallelism": 1, "dcn_context_parallelism": -1,
            "mesh_axes": ["data", "fsdp", "context", "tensor"]}


class _Config:
  """What MaxDiffusion's create_device_mesh reads of its config."""

  def __init__(self, keys):
    self.__dict__.update(keys)
    self.allow_split_physical_axes = False
    self._keys = keys

  def get_keys(self):
    return self._keys


@pytest.mark.parametrize("keys", [{}, {"ici_data_parallelism": 2},
                                  {"ici_context_parallelism": 4, "ici_fsdp_parallelism": -1},
                                  {"ici_context_parallelism": 2, "ici_tensor_parallelism": -1}])
def test_the_mesh_is_maxdiffusions(keys):
  """Against MaxDiffusion's own max_utils.create_device_mesh on the 8 simulated devices."""
  from maxdiffusion import max_utils  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  keys = {**WAN_MESH, **keys, "dcn_data_parallelism": 1, "dcn_fsdp_parallelism": 1,
          "dcn_tensor_parallelism": 1}
  theirs = jax.sharding.Mesh(max_utils.create_device_mesh(_Config(dict(keys)), logging=False),
                             keys["mesh_axes"])
  assert preflight.mesh_shape(keys, jax.device_count()) == dict(theirs.shape)


@pytest.mark.parametrize("keys", [{"ici_context_parallelism": 3}, {"ici_data_parallelism": -1},
                                  {"ici_data_parallelism": 3}])
def test_a_mesh_maxdiffusion_refuses_is_refused(keys):
  from maxdiffusion import max_utils  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  keys = {**WAN_MESH, **keys, "dcn_data_parallelism": 1, "dcn_fsdp_parallelism": 1,
          "dcn_tensor_parallelism": 1}
  with pytest.raises(AssertionError):
    max_utils.create_device_mesh(_Config(dict(keys)), logging=False)
  with pytest.raises(ValueError):
    preflight.mesh_shape(keys, jax.device_count())


def test_the_steps_equal_maxdiffusions_scheduler():
  """MaxDiffusion's UniPC scheduler with the Wan checkpoints' flow sigmas, and its pipelines'
  rule (t >= boundary_ratio * num_train_timesteps runs the high-noise expert)."""
  from maxdiffusion.schedulers import scheduling_unipc_multistep_flax as module  # pylint: disable=import-outside-toplevel
  for shift in (3.0, 5.0, 12.0):
    scheduler = module.FlaxUniPCMultistepScheduler(
        num_train_timesteps=1000, use_flow_sigmas=True, flow_shift=shift,
        prediction_type="flow_prediction")
    state = scheduler.create_state()
    for steps in (1, 2, 7, 20, 30, 40, 50, 77, 100):
      theirs = np.asarray(scheduler.set_timesteps(state, num_inference_steps=steps,
                                                  shape=(1,)).timesteps, np.int32)
      np.testing.assert_array_equal(flow_timesteps(steps, shift), theirs)
      for ratio in (0.5, 0.875, 0.9):
        boundary = ratio * scheduler.config.num_train_timesteps
        high = [bool(t >= boundary) for t in theirs]
        split = expert_steps({"boundary_ratio": ratio, "flow_shift": shift}, steps)
        assert high == [i < split.boundary_step for i in range(steps)]
