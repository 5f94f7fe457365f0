"""A tiny random-weight Wan transformer built the pipeline's way: smoke tests and benchmarks.

``create_sharded_logical_transformer`` runs for real (through the installed hooks), from a
config that is the installed MaxDiffusion's own ``base_wan_14b.yml`` plus our keys, written
to a temporary file; only the Hugging Face config and weight loaders are replaced, as
MaxDiffusion's own tests do. A pipeline around it runs the real denoising loop on given
prompt embeddings (no text encoder, no VAE decode).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import pathlib
import types
import zlib
from typing import Any
from unittest import mock

import flax
import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh
from maxdiffusion import max_utils, pyconfig
from maxdiffusion.pipelines.wan import wan_pipeline

from maxdiffusion_svg.testing.stand_ins import config_loader  # also the other tiny models'


HEADS = 8
HEAD_DIM = 32
TEXT_LEN = 16
TRANSFORMER = {
    "added_kv_proj_dim": None, "attention_head_dim": HEAD_DIM, "cross_attn_norm": True,
    "eps": 1e-06, "ffn_dim": 64, "freq_dim": 32, "image_dim": None, "in_channels": 4,
    "num_attention_heads": HEADS, "num_layers": 2, "out_channels": 4, "patch_size": [1, 2, 2],
    "pos_embed_seq_len": None, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024,
    "text_dim": 32,
}
LATENT = (4, 9, 16, 16)  # channels, frames, height, width -> grid 9x8x8 = 576 tokens
VIDEO = {"num_frames": 33, "height": 128, "width": 128}  # the pixel video of LATENT
BASE_KEYS = {
    "skip_jax_distributed_system": True, "weights_dtype": "float32",
    "activations_dtype": "float32", "pretrained_model_name_or_path": "tiny-wan",
    "flash_min_seq_length": 0, "run_name": "tiny",
    # SVG at test scale: 128-token tiles, no length floor, probe 16 rows.
    "svg_block_q": 128, "svg_block_kv": 128, "svg_min_seq_length": 0,
    "svg_profile_queries": 16, "svg_backend": "xla",
}


def base_config_path(name: str = "base_wan_14b.yml") -> str:
  return str(importlib.resources.files("maxdiffusion.configs") / name)


def write_config(directory, base: str = "base_wan_14b.yml", **keys: Any) -> str:
  """MaxDiffusion's ``base`` YAML with ``keys`` added or replaced, in ``directory``."""
  with open(base_config_path(base), encoding="utf-8") as f:
    data = yaml.safe_load(f)
  data.update(BASE_KEYS)
  data.update(keys)
  path = f"{directory}/config.yml"
  with open(path, "w", encoding="utf-8") as f:
    yaml.safe_dump(data, f)
  return path


def base_rules(base: str = "base_wan_14b.yml") -> list[tuple[str, Any]]:
  """The ``logical_axis_rules`` of MaxDiffusion's ``base`` YAML (to derive custom rule sets)."""
  with open(base_config_path(base), encoding="utf-8") as f:
    return [tuple(rule) for rule in yaml.safe_load(f)["logical_axis_rules"]]


def init_config(path: str, *overrides: str):
  pyconfig.initialize([None, path, *overrides], unittest=True)
  return pyconfig.config


def _value(name: tuple, shape, dtype, scale: float) -> jax.Array:
  seed = zlib.crc32("/".join(map(str, name)).encode())
  return scale * jax.random.normal(jax.random.key(seed), shape, dtype)


def _random_params(scale: float):
  """A loader of random weights keyed by parameter name and layer, so that stacked
  (``scan_layers``) and per-block models get the same weights."""

  def load(_path, eval_shapes, *args, **kwargs):
    del args, kwargs
    params = {}
    for name, shape in flax.traverse_util.flatten_dict(eval_shapes).items():
      if name[0] == "blocks" and isinstance(name[1], int):  # one block of a Python loop
        params[name] = _value(name, shape.shape, shape.dtype, scale)
      elif name[0] == "blocks":  # stacked over layers
        params[name] = jnp.stack([_value(("blocks", i, *name[1:]), shape.shape[1:], shape.dtype,
                                         scale) for i in range(shape.shape[0])])
      else:
        params[name] = _value(name, shape.shape, shape.dtype, scale)
    return flax.traverse_util.unflatten_dict(params)

  return load


def host_random_params(scale: float, blocks: str = "blocks"):
  """A weight loader of host (NumPy) random values keyed by name and layer, as a checkpoint
  loader returns them (and without one compile per leaf shape): stacked layers under
  ``blocks`` get each layer's own, so scanned and per-block models get the same weights."""

  def value(name: tuple, shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32("/".join(map(str, name)).encode()))
    return (scale * rng.standard_normal(shape, np.float32)).astype(dtype)

  def load(_path, eval_shapes, *args, **kwargs):
    del args, kwargs
    params = {}
    for name, leaf in flax.traverse_util.flatten_dict(eval_shapes).items():
      if name[0] == blocks and not isinstance(name[1], int):  # stacked over layers
        params[name] = np.stack([value((blocks, i, *name[1:]), leaf.shape[1:], leaf.dtype)
                                 for i in range(leaf.shape[0])])
      else:
        params[name] = value(name, leaf.shape, leaf.dtype)
    return flax.traverse_util.unflatten_dict(params)

  return load


def prompt_rows(prompt, copies: int, shape: tuple[int, int]) -> np.ndarray:
  """A text encoder's stand-in: fixed embeddings per prompt text, ``copies`` rows each,
  ``[len(prompts) * copies, *shape]``."""
  prompts = [prompt] if isinstance(prompt, str) else list(prompt)
  return np.stack([np.random.default_rng(zlib.crc32(p.strip().encode())).standard_normal(
      shape, np.float32) for p in prompts for _ in range(copies)])


def t5_stand_in(shape: tuple[int, int]):
  """UMT5's stand-in for a Wan pipeline's ``_get_t5_prompt_embeds``: :func:`prompt_rows` of
  ``shape`` per prompt text (torch, as the pipeline converts them)."""

  def prompt_embeds(prompt, num_videos_per_prompt: int = 1, max_sequence_length: int = 512):
    import torch  # pylint: disable=import-outside-toplevel
    del max_sequence_length
    return torch.from_numpy(prompt_rows(prompt, num_videos_per_prompt, shape))

  return prompt_embeds


def write_transformer_config(directory, name: str, config: dict[str, Any]) -> str:
  """A checkpoint folder ``directory/name`` holding only ``transformer/config.json`` (what the
  tools' checks read before anything loads); its path."""
  path = pathlib.Path(directory) / name
  (path / "transformer").mkdir(parents=True, exist_ok=True)
  (path / "transformer" / "config.json").write_text(json.dumps(config))
  return str(path)


@contextlib.contextmanager
def tiny_loaders(num_layers: int = 2, heads: int = HEADS, scale: float = 0.1,
                 head_dim: int = HEAD_DIM):
  """Replaces the Hugging Face config and weight loaders with a tiny random Wan."""
  load_config = config_loader({**TRANSFORMER, "num_layers": num_layers,
                               "num_attention_heads": heads, "attention_head_dim": head_dim})
  with mock.patch.object(wan_pipeline.WanModel, "load_config", side_effect=load_config), \
       mock.patch.object(wan_pipeline, "load_wan_transformer", side_effect=_random_params(scale)):
    yield


def make_mesh(config, devices: int) -> tuple[np.ndarray, Mesh]:
  array = max_utils.create_device_mesh(config, devices=jax.devices()[:devices], logging=False)
  return array, Mesh(array, config.mesh_axes)


def build_transformer(config, mesh_devices: tuple[np.ndarray, Mesh], subfolder: str = "transformer",
                      num_layers: int = 2, heads: int = HEADS, head_dim: int = HEAD_DIM):
  array, mesh = mesh_devices
  with tiny_loaders(num_layers, heads, head_dim=head_dim), mesh:
    return wan_pipeline.create_sharded_logical_transformer(
        devices_array=array, mesh=mesh, rngs=nnx.Rngs(0), config=config, subfolder=subfolder)


def inputs(batch: int = 2, seed: int = 0, text_len: int = TEXT_LEN,
           latent: tuple[int, ...] = LATENT) -> tuple[jax.Array, jax.Array]:
  """Latents and text embeddings (Splash kernels need ``text_len`` a multiple of 128)."""
  rng = np.random.default_rng(seed)
  latents = jnp.asarray(rng.standard_normal((batch, *latent)), jnp.float32)
  text = jnp.asarray(rng.standard_normal((batch, text_len, TRANSFORMER["text_dim"])), jnp.float32)
  return latents, text


def forward(model, mesh: Mesh, config, latents, text, t) -> jax.Array:
  """One transformer call through the pipeline's jitted forward (reused across steps)."""
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  timestep = jnp.broadcast_to(jnp.asarray(t, jnp.int32), (latents.shape[0],))
  with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
    out, _ = wan_pipeline.transformer_forward_pass(
        graphdef, state, rest, latents, timestep, text, do_classifier_free_guidance=False,
        guidance_scale=1.0)
  return out


def _scheduler(config):
  from maxdiffusion.schedulers.scheduling_unipc_multistep_flax import FlaxUniPCMultistepScheduler  # pylint: disable=import-outside-toplevel
  scheduler = FlaxUniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                          use_flow_sigmas=True, flow_shift=config.flow_shift)
  return scheduler, scheduler.create_state()


def _components(config, mesh_devices) -> dict[str, Any]:
  array, mesh = mesh_devices
  channels = LATENT[0]
  # Only what the denoising loop reads of a VAE: latent statistics and scale factors.
  vae = types.SimpleNamespace(latents_mean=[0.0] * channels, latents_std=[1.0] * channels,
                              z_dim=channels, temperal_downsample=[False, True, True])
  scheduler, state = _scheduler(config)
  return {"tokenizer": None, "text_encoder": None, "vae": vae, "vae_cache": None,
          "scheduler": scheduler, "scheduler_state": state, "devices_array": array, "mesh": mesh}


def pipeline_2_1(config, mesh_devices, transformer):
  """A ``WanPipeline2_1`` around ``transformer``: the real loop, latents out."""
  from maxdiffusion.pipelines.wan.wan_pipeline_2_1 import WanPipeline2_1  # pylint: disable=import-outside-toplevel
  return WanPipeline2_1(config=config, transformer=transformer, **_components(config, mesh_devices))


def pipeline_2_2(config, mesh_devices, high_noise, low_noise):
  """A ``WanPipeline2_2`` around two transformers (high-noise first, as Wan 2.2 runs them)."""
  from maxdiffusion.pipelines.wan.wan_pipeline_2_2 import WanPipeline2_2  # pylint: disable=import-outside-toplevel
  return WanPipeline2_2(config=config, high_noise_transformer=high_noise,
                        low_noise_transformer=low_noise, **_components(config, mesh_devices))


def generate(pipeline, steps: int, text: jax.Array, **kwargs) -> jax.Array:
  """Denoised latents for ``text`` embeddings (the negative prompt is its negation)."""
  latents, _ = pipeline(prompt_embeds=text, negative_prompt_embeds=-text,
                        num_inference_steps=steps, output_type="latent", **VIDEO, **kwargs)
  return latents
