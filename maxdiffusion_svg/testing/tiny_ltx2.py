"""A tiny random-weight LTX-2 audio-video transformer built the pipeline's way, for CPU tests.

``create_sharded_logical_transformer`` of MaxDiffusion's LTX-2 pipeline runs for real (through
any installed hooks), from a config that is the installed MaxDiffusion's own ``ltx2_video.yml``
plus our keys, written to a temporary file; only the Hugging Face config and weight loaders
are replaced. A real ``LTX2Pipeline`` around it runs ``__call__`` (timesteps set through
``set_timesteps_ltx2``, CFG batch layout, the scanned denoising loop) on given prompt
embeddings: the Gemma connectors are an identity and the VAEs are only their latent
statistics and compression ratios (``output_type="latent"``: no decode).
"""

from __future__ import annotations

import contextlib
import importlib
import types
import zlib
from typing import Any
from unittest import mock

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh

from maxdiffusion_svg.testing import tiny_wan
from maxdiffusion_svg.testing.tiny_wan import init_config, make_mesh

# The LTX-2 pipeline imports TensorFlow before transformers imports Triton, whose library then
# segfaults on load (TensorFlow 2.21, Triton 3.8 here); Triton loaded first is fine.
with contextlib.suppress(ImportError):
  importlib.import_module("triton")
ltx2_pipeline = importlib.import_module("maxdiffusion.pipelines.ltx2.ltx2_pipeline")

__all__ = ["AUDIO_FRAMES", "HEADS", "LATENT_GRID", "build_transformer", "forward", "generate",
           "init_config", "inputs", "make_mesh", "pipeline", "tiny_loaders", "write_config"]

HEADS = 8
HEAD_DIM = 16
AUDIO_HEADS = 8
AUDIO_HEAD_DIM = 8
CHANNELS = 8  # video latent channels (patch size 1: the packed token width)
CAPTION = 32  # prompt-embedding width (video and audio captions alike)
TEXT_LEN = 16  # a multiple of 8: the pipeline shards prompt embeddings' length over `context`
LATENT_GRID = (4, 8, 8)  # frames, height, width -> 256 video tokens
VIDEO = {"num_frames": 25, "height": 256, "width": 256, "frame_rate": 24.0}  # LATENT_GRID's pixels
AUDIO = {"sample_rate": 16000, "mel_hop_length": 160, "latent_channels": 2, "mel_bins": 8}
MEL_RATIO, AUDIO_TIME_RATIO = 4, 4  # the audio VAE's compressions (LTX-2's own)
AUDIO_CHANNELS = AUDIO["latent_channels"] * AUDIO["mel_bins"] // MEL_RATIO  # packed audio width: 4
# Audio latents of VIDEO as the pipeline counts them: round(25 / 24 * 25) = 26 tokens.
AUDIO_FRAMES = round(VIDEO["num_frames"] / VIDEO["frame_rate"] * AUDIO["sample_rate"]
                     / AUDIO["mel_hop_length"] / AUDIO_TIME_RATIO)
TRANSFORMER = {
    "in_channels": CHANNELS, "out_channels": CHANNELS, "patch_size": 1, "patch_size_t": 1,
    "num_attention_heads": HEADS, "attention_head_dim": HEAD_DIM,
    "cross_attention_dim": HEADS * HEAD_DIM, "audio_in_channels": AUDIO_CHANNELS,
    "audio_out_channels": AUDIO_CHANNELS, "audio_num_attention_heads": AUDIO_HEADS,
    "audio_attention_head_dim": AUDIO_HEAD_DIM,
    "audio_cross_attention_dim": AUDIO_HEADS * AUDIO_HEAD_DIM, "caption_channels": CAPTION,
    "num_layers": 2, "activation_fn": "gelu-approximate", "norm_elementwise_affine": False,
    "qk_norm": "rms_norm_across_heads", "rope_type": "split", "rope_double_precision": True,
    "vae_scale_factors": [8, 32, 32], "audio_sampling_rate": AUDIO["sample_rate"],
    "audio_hop_length": AUDIO["mel_hop_length"],
}
BASE_KEYS = {**tiny_wan.BASE_KEYS, "pretrained_model_name_or_path": "tiny-ltx2",
             "precision": "HIGHEST"}
# LTX-2's scheduler settings (exponential dynamic shift, stretched to a terminal sigma).
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
             "time_shift_type": "exponential", "shift_terminal": 0.1, "base_shift": 0.95,
             "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096}


def write_config(directory, base: str = "ltx2_video.yml", **keys: Any) -> str:
  """MaxDiffusion's ``base`` YAML with our keys and ``keys`` added or replaced, in ``directory``."""
  return tiny_wan.write_config(directory, base, **{**BASE_KEYS, **keys})


def _value(name: tuple, shape, dtype, scale: float) -> np.ndarray:
  # NumPy on the host, as a checkpoint loader returns it (and faster than one jit per leaf).
  rng = np.random.default_rng(zlib.crc32("/".join(map(str, name)).encode()))
  return (scale * rng.standard_normal(shape, np.float32)).astype(dtype)


def _random_params(scale: float):
  """A weight loader of random values keyed by name and layer: scanned and per-layer models
  get the same weights."""

  def load(_path, eval_shapes, *args, **kwargs):
    del args, kwargs
    params = {}
    for name, shape in flax.traverse_util.flatten_dict(eval_shapes).items():
      if name[0] == "transformer_blocks" and not isinstance(name[1], int):  # stacked layers
        params[name] = np.stack([_value(("transformer_blocks", i, *name[1:]), shape.shape[1:],
                                         shape.dtype, scale) for i in range(shape.shape[0])])
      else:
        params[name] = _value(name, shape.shape, shape.dtype, scale)
    return flax.traverse_util.unflatten_dict(params)

  return load


@contextlib.contextmanager
def tiny_loaders(num_layers: int = 2, heads: int = HEADS, scale: float = 0.1,
                 head_dim: int = HEAD_DIM):
  """Replaces the Hugging Face config and weight loaders with a tiny random LTX-2."""
  config = {**TRANSFORMER, "num_layers": num_layers, "num_attention_heads": heads,
            "attention_head_dim": head_dim, "cross_attention_dim": heads * head_dim}

  def load_config(*args, return_unused_kwargs=False, **kwargs):
    del args
    return (dict(config), kwargs) if return_unused_kwargs else dict(config)

  model = ltx2_pipeline.LTX2VideoTransformer3DModel
  with mock.patch.object(model, "load_config", side_effect=load_config), \
       mock.patch.object(ltx2_pipeline, "load_transformer_weights",
                         side_effect=_random_params(scale)):
    yield


def build_transformer(config, mesh_devices: tuple[np.ndarray, Mesh], subfolder: str = "transformer",
                      num_layers: int = 2, heads: int = HEADS, head_dim: int = HEAD_DIM):
  array, mesh = mesh_devices
  with tiny_loaders(num_layers, heads, head_dim=head_dim), mesh:
    return ltx2_pipeline.create_sharded_logical_transformer(
        devices_array=array, mesh=mesh, rngs=nnx.Rngs(0), config=config, subfolder=subfolder)


def inputs(batch: int = 1, seed: int = 0, grid: tuple[int, int, int] = LATENT_GRID,
           audio_frames: int = AUDIO_FRAMES, text_len: int = TEXT_LEN) -> tuple[jax.Array, ...]:
  """Packed video latents ``[B, F*H*W, C]``, audio latents ``[B, L, A]`` and the video and audio
  prompt embeddings ``[B, text_len, CAPTION]``."""
  rng = np.random.default_rng(seed)
  shapes = [(batch, int(np.prod(grid)), CHANNELS), (batch, audio_frames, AUDIO_CHANNELS),
            (batch, text_len, CAPTION), (batch, text_len, CAPTION)]
  return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)


def forward(model, mesh: Mesh, config, latents, audio_latents, text, audio_text, t,
            grid: tuple[int, int, int] = LATENT_GRID) -> tuple[jax.Array, jax.Array]:
  """One transformer call through the pipeline's jitted forward: (video, audio) velocities."""
  graphdef, state = nnx.split(model)
  mask = jnp.ones(text.shape[:2], jnp.bool_)
  with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
    return ltx2_pipeline.transformer_forward_pass(
        graphdef, state, latents, audio_latents, jnp.asarray(t, jnp.float32), text, audio_text,
        mask, mask, latent_num_frames=grid[0], latent_height=grid[1], latent_width=grid[2],
        audio_num_frames=audio_latents.shape[1], fps=VIDEO["frame_rate"],
        global_batch_size=latents.shape[0])


class IdentityConnectors(nnx.Module):
  """Stands in for the Gemma connectors: the given embeddings serve video and audio alike."""

  def __call__(self, hidden_states, attention_mask):
    return hidden_states, hidden_states, attention_mask


def _statistics(width: int) -> dict[str, Any]:
  return {"latents_mean": types.SimpleNamespace(value=jnp.zeros(width)),
          "latents_std": types.SimpleNamespace(value=jnp.ones(width))}


def pipeline(config, mesh_devices: tuple[np.ndarray, Mesh], transformer):
  """An ``LTX2Pipeline`` around ``transformer``: the real ``__call__``, latents out."""
  # Only what __call__ reads of the VAEs, text encoder and vocoder before decoding.
  vae = types.SimpleNamespace(config=types.SimpleNamespace(scaling_factor=1.0),
                              spatial_compression_ratio=32, temporal_compression_ratio=8,
                              **_statistics(CHANNELS))
  audio_vae = types.SimpleNamespace(config=types.SimpleNamespace(**AUDIO),
                                    mel_compression_ratio=MEL_RATIO,
                                    temporal_compression_ratio=AUDIO_TIME_RATIO,
                                    **_statistics(AUDIO_CHANNELS))
  scheduler = ltx2_pipeline.FlaxFlowMatchScheduler.from_config(SCHEDULER)
  result = ltx2_pipeline.LTX2Pipeline(
      scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=None, tokenizer=None,
      connectors=IdentityConnectors(), transformer=transformer, vocoder=None, config=config)
  result.mesh = mesh_devices[1]
  return result


def generate(pipe, steps: int, text: jax.Array, seed: int = 0,
             **kwargs) -> tuple[jax.Array, jax.Array]:
  """Denoised (video ``[B, F, H, W, C]``, audio ``[B, L, mel, C]``) latents for ``text``
  embeddings (the negative prompt is their negation; CFG on, STG off unless ``kwargs`` say)."""
  batch = text.shape[0]
  mask = jnp.ones(text.shape[:2], jnp.bool_)
  # Given latents set only the shapes: at noise_scale 1 the pipeline replaces them by noise.
  latents = jnp.zeros((batch, int(np.prod(LATENT_GRID)), CHANNELS), jnp.float32)
  audio_latents = jnp.zeros((batch, AUDIO_FRAMES, AUDIO_CHANNELS), jnp.float32)
  arguments = {**VIDEO, "guidance_scale": 3.0, "stg_scale": 0.0, **kwargs}
  out = pipe(prompt_embeds=text, negative_prompt_embeds=-text, prompt_attention_mask=mask,
             negative_prompt_attention_mask=mask, latents=latents, audio_latents=audio_latents,
             num_inference_steps=steps, generator=jax.random.key(seed), output_type="latent",
             dtype=jnp.float32, noise_scale=1.0, **arguments)
  return out.frames, out.audio
