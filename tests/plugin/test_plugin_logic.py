"""The plugin's pure logic, with small stand-ins for MaxDiffusion (which CI cannot install)."""

import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec as P

from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import tpu_target
from maxdiffusion_svg.plugin import hooks
from maxdiffusion_svg.plugin.kernel import qkv_layout
from maxdiffusion_svg.plugin.settings import PluginSettings

# The logical names MaxDiffusion gives self-attention's q ([B, H, S, D]), and rules in the
# shape of its Wan configs': heads on (context, tensor), no rule for the sequence.
SELF_ATTN_Q = ("activation_batch", "activation_self_attn_heads",
               "activation_self_attn_q_length", "activation_kv")
WAN_RULES = (("batch", ("data", "fsdp")), ("activation_batch", ("data", "fsdp")),
             ("activation_self_attn_heads", ("context", "tensor")),
             ("activation_length", "context"), ("heads", "tensor"))


@pytest.mark.parametrize("rules, want", [
    (WAN_RULES, P(("data", "fsdp"), None, "context", None)),
    ((("activation_batch", "data"),) + WAN_RULES, P("data", None, "context", None)),
    ((("activation_batch", None),) + WAN_RULES, P(None, None, "context", None)),
    (WAN_RULES + (("activation_kv", "tensor"),), P(("data", "fsdp"), None, "context", "tensor")),
])
def test_the_qkv_layout_is_the_rules_with_ulysses_heads_and_sequence(rules, want):
  """Heads whole and the sequence on context whatever the rules say of them (as pyconfig's
  ulysses rules); the batch and head dims as the config's rules map them."""
  with nn_partitioning.axis_rules(rules):
    assert qkv_layout(SELF_ATTN_Q) == want


# ------------------------------------------------ the WanModel hook: grid and step


TIMESTEPS = [999.0, 937.5, 833.3, 666.7, 400.0]  # a 5-step run, decreasing


class StandInWan:
  """What the hooks read of a WanModel: config.patch_size and the blocks' self-attention."""

  def __init__(self, layers=2):
    self.config = types.SimpleNamespace(patch_size=(1, 2, 2))
    self.scan_layers, self.num_layers = False, layers
    self.blocks = [types.SimpleNamespace(attn1=types.SimpleNamespace(
        attention_op=types.SimpleNamespace(residual_checkpoint_name="self_attn")))
        for _ in range(layers)]


def seen_by_the_kernel(model, latent_shape, timestep):
  """The ModelCall a kernel inside the wrapped ``WanModel.__call__`` sees."""
  seen = []

  def call(self, hidden_states, timestep):
    seen.append(hooks.current_model_call())
    return hidden_states

  hooks.model_call_hook(call)(model, jnp.zeros(latent_shape), timestep)
  return seen[0]


def test_the_grid_is_the_latent_over_the_patch():
  call = seen_by_the_kernel(StandInWan(), (2, 4, 9, 16, 12), jnp.int32(500))
  assert call.grid == VideoGrid(9, 8, 6) and call.model == "StandInWan"
  assert call.settings is None and call.step is None  # not prepared: the kernel refuses it


@pytest.mark.parametrize("index", range(5))
def test_the_step_is_the_timesteps_index_scalar_or_per_token(index):
  """Wan 2.1/2.2 pass one timestep per example; Wan 2.2 TI2V one per token, 0 on the
  conditioning frame: the step is the largest's."""
  model = hooks.prepare_transformer(StandInWan(), PluginSettings.from_mapping({}))
  hooks.set_denoising_schedule(model, TIMESTEPS)
  t = TIMESTEPS[index]
  per_token = jnp.full((2, 9 * 8 * 6), t).at[:, :8 * 6].set(0.0)  # first frame: t = 0
  for timestep in (jnp.full((2,), t), per_token):
    assert int(seen_by_the_kernel(model, (2, 4, 9, 16, 12), timestep).step) == index
  # Traced, as in the jitted forward: one function for every step.
  step = jax.jit(lambda ts: seen_by_the_kernel(model, (2, 4, 9, 16, 12), ts).step)
  assert int(step(per_token)) == index


def test_no_schedule_no_step():
  model = hooks.prepare_transformer(StandInWan(), PluginSettings.from_mapping({}))
  assert seen_by_the_kernel(model, (1, 4, 9, 16, 12), jnp.int32(3)).step is None
  with pytest.raises(ValueError, match="at most 1000 denoising steps"):
    hooks.set_denoising_schedule(model, np.arange(1001.0)[::-1])


def test_a_process_without_jaxs_cpu_backend_counts_from_the_schedule():
  """With JAX_PLATFORMS=tpu (as a TPU VM may set it) JAX has no CPU device to run a host
  callback on: the model's calls then report no callbacks, and the run summary says why."""
  before = jax.config.jax_platforms
  try:
    jax.config.update("jax_platforms", "tpu")
    model = hooks.prepare_transformer(StandInWan(), PluginSettings.from_mapping({}))
  finally:
    jax.config.update("jax_platforms", before)
  assert model.svg_uncounted.startswith("JAX_PLATFORMS=tpu leaves JAX no CPU device")
  assert not hooks.counts_calls(model)
  counted = hooks.prepare_transformer(StandInWan(), PluginSettings.from_mapping({}))
  assert counted.svg_uncounted == "" and hooks.counts_calls(counted)


# ------------------------------------------------ the transformer factory hook: the expert


class StandInConfig:

  def __init__(self, model_name="wan2.2", attention="svg", **keys):
    self.model_name, self.attention = model_name, attention
    self.keys = {"attention": attention, "model_name": model_name, **keys}

  def get_keys(self):
    return self.keys


def create(config, subfolder, loaded=None):
  def factory(devices_array, mesh, rngs, config, restored_checkpoint=None, subfolder=""):
    if loaded is not None:
      loaded.append(subfolder)
    return StandInWan()
  return hooks.create_transformer_hook(factory)(None, None, None, config, subfolder=subfolder)


@pytest.mark.parametrize("model_name, subfolder, expert", [
    ("wan2.2", "transformer", "high_noise"), ("wan2.2", "transformer_2", "low_noise"),
    ("wan2.1", "transformer", None), ("wan2.1", "", None)])
def test_the_expert_comes_from_the_subfolder_of_a_wan22_checkpoint(max_logging, model_name,
                                                                   subfolder, expert):
  config = StandInConfig(model_name, svg_high_noise_density=0.5, svg_low_noise_density=0.2)
  model = create(config, subfolder)
  assert model.svg_expert == expert
  assert model.svg_settings.svg.density_for(expert) == {"high_noise": 0.5, "low_noise": 0.2,
                                                        None: 0.3}[expert]
  assert len(max_logging) == 1 and (expert or "transformer") in max_logging[0]


def test_other_kernels_are_left_alone_and_bad_keys_fail_before_loading(max_logging):
  assert not hooks.is_prepared(create(StandInConfig(attention="flash"), "transformer"))
  loaded = []
  with pytest.raises(ValueError, match="svg_density"):
    create(StandInConfig(svg_density=1.5), "transformer", loaded)
  assert loaded == [] and max_logging == []  # refused before the factory ran


def test_the_settings_summary_says_what_will_run():
  settings = PluginSettings.from_mapping({"svg_schedule": "moderate", "svg_low_noise_density": 0.2,
                                          "num_inference_steps": 50})
  given = settings.summary()
  assert "density 0.3 (high-noise 0.3, low-noise 0.2)" in given and "default" in given
  on_v6e = settings.summary(tpu_target("v6e"))
  assert "3328x1536 (kv step 512)" in on_v6e and "backend pallas" in on_v6e and "flash" in on_v6e
  splash = PluginSettings.from_mapping({"svg_backend": "splash", "num_inference_steps": 50})
  assert "backend splash" in splash.summary(tpu_target("v6e"))


# ------------------------------------------------ the patch script's refusals


SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "apply_maxdiffusion_patch.sh"


def run_script(*args):
  return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                        check=False)


def test_the_patch_script_refuses_what_is_not_a_maxdiffusion_tree(tmp_path):
  done = run_script(tmp_path)
  assert done.returncode == 2 and "is not a MaxDiffusion source tree (no src/maxdiffusion/" \
      "pyconfig.py)" in done.stderr
  done = run_script()
  assert done.returncode != 0 and "usage:" in done.stderr


def test_the_patch_script_names_the_tested_commit_when_the_patch_does_not_apply(tmp_path):
  source = tmp_path / "src" / "maxdiffusion"
  source.mkdir(parents=True)
  (source / "pyconfig.py").write_text("# not MaxDiffusion's pyconfig\n")
  for args in ((tmp_path,), ("--check", tmp_path)):
    done = run_script(*args)
    assert done.returncode == 1, done
    assert "does not apply" in done.stderr and "7cfb8801d41d" in done.stderr
  assert (source / "pyconfig.py").read_text() == "# not MaxDiffusion's pyconfig\n"


def test_the_run_logs_the_empty_window_warning_that_tiles_gives(max_logging, tmp_path, capsys):
  """svg_active_steps past the run's steps: the transformer's build logs the warning, and
  `tiles --config` on the same keys (2 layers, as the stand-in) prints the same line."""
  from maxdiffusion_svg.cli.main import main  # pylint: disable=import-outside-toplevel
  keys = {"num_inference_steps": 50, "svg_active_steps": [60, -1]}
  create(StandInConfig("wan2.1", **keys), "transformer")
  assert len(max_logging) == 2 and max_logging[1].startswith("maxdiffusion_svg: warning: ")
  logged = max_logging[1].removeprefix("maxdiffusion_svg: warning: ")
  assert logged == ("no self-attention call runs sparse: svg_active_steps [60, end) holds none "
                    "of the run's 50 steps (num_inference_steps); give svg_active_steps a start "
                    "below 50")
  path = tmp_path / "config.yml"
  path.write_text(str({"attention": "svg", "model_name": "wan2.1", "num_frames": 81,
                       "height": 480, "width": 832, **keys}))
  assert main(["tiles", "--config", str(path), "--layers", "2"]) == 0
  assert f"warning: {logged}" in capsys.readouterr().out.splitlines()
  create(StandInConfig("wan2.1", num_inference_steps=50, svg_active_layers=[2, -1]), "")
  assert "svg_active_layers [2, end) holds none of the transformer's 2 layers" in max_logging[-1]
