"""A tiny random-weight LTX-2 audio-video transformer built the pipeline's way, for CPU tests.

``create_sharded_logical_transformer`` of MaxDiffusion's LTX-2 pipeline runs for real (through
any installed hooks), from a config that is the installed MaxDiffusion's own ``ltx2_video.yml``
plus our keys, written to a temporary file; only the Hugging Face config and weight loaders
are replaced. A real ``LTX2Pipeline`` around it runs ``__call__`` (timesteps set through
``set_timesteps_ltx2``, CFG batch layout, the scanned denoising loop) on given prompt
embeddings: the Gemma connectors are an identity and the VAEs are only their latent
statistics and compression ratios (``output_type="latent"``: no decode).

:func:`generate_main` runs MaxDiffusion's own ``generate_ltx2`` (prompts, decoding and the
MP4 with audio): its checkpointer builds the tiny pipeline with stand-ins for the Gemma
encoder (embeddings from the prompt's text), the video and audio VAE decoders, the vocoder and
(``run_latent_upsampler``) the latent upsampler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import types
from typing import Any
from unittest import mock

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
           "generate_main", "init_config", "inputs", "make_mesh", "pipeline", "tiny_loaders",
           "write_checkpoint", "write_config"]

HEADS = 8
HEAD_DIM = 16
AUDIO_HEADS = 8
AUDIO_HEAD_DIM = 8
CHANNELS = 8  # video latent channels (patch size 1: the packed token width)
# The pipeline draws LTX-2's own 128 latent channels when given no latents (generate_ltx2).
GENERATE_CHANNELS = 128
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


@contextlib.contextmanager
def tiny_loaders(num_layers: int = 2, heads: int = HEADS, scale: float = 0.1,
                 head_dim: int = HEAD_DIM, channels: int = CHANNELS):
  """Replaces the Hugging Face config and weight loaders with a tiny random LTX-2."""
  config = {**TRANSFORMER, "num_layers": num_layers, "num_attention_heads": heads,
            "attention_head_dim": head_dim, "cross_attention_dim": heads * head_dim,
            "in_channels": channels, "out_channels": channels}

  load_config = tiny_wan.config_loader(config)

  model = ltx2_pipeline.LTX2VideoTransformer3DModel
  with mock.patch.object(model, "load_config", side_effect=load_config), \
       mock.patch.object(ltx2_pipeline, "load_transformer_weights",
                         side_effect=tiny_wan.host_random_params(scale, "transformer_blocks")):
    yield


def build_transformer(config, mesh_devices: tuple[np.ndarray, Mesh], subfolder: str = "transformer",
                      num_layers: int = 2, heads: int = HEADS, head_dim: int = HEAD_DIM,
                      channels: int = CHANNELS):
  array, mesh = mesh_devices
  with tiny_loaders(num_layers, heads, head_dim=head_dim, channels=channels), mesh:
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


def _video_decode(latents: jax.Array, return_dict: bool = False, **kwargs) -> list[jax.Array]:
  """``[B, f, h, w, C]`` latents to ``[B, 8(f-1)+1, 32h, 32w, 3]`` pixels in [-1, 1]: the first
  three channels, each latent frame and pixel repeated (the VAE's compressions)."""
  del return_dict, kwargs
  video = jnp.tanh(latents[..., :3])
  video = jnp.concatenate([video[:, :1], jnp.repeat(video[:, 1:], 8, axis=1)], axis=1)
  return [jnp.repeat(jnp.repeat(video, 32, axis=2), 32, axis=3)]


def _audio_decode(latents: jax.Array, return_dict: bool = False, **kwargs) -> list[jax.Array]:
  del return_dict, kwargs
  return [latents]  # [B, T, mel, C]: the "spectrogram" the vocoder reads


@dataclasses.dataclass(frozen=True)
class VocoderConfig:
  output_sampling_rate: int = AUDIO["sample_rate"]


class StubVocoder(nnx.Module):
  """Spectrogram ``[B, C, T, mel]`` to a stereo waveform ``[B, 2, T * hop]`` in [-1, 1]."""

  def __init__(self):
    self.config = VocoderConfig()

  def __call__(self, mel: jax.Array) -> jax.Array:
    wave = jnp.repeat(jnp.tanh(mel.mean(axis=(1, 3))), AUDIO["mel_hop_length"], axis=-1)
    return jnp.stack([wave, wave], axis=1).astype(jnp.float32)


class StubUpsampler(nnx.Module):
  """The latent upsampler's stand-in: each latent pixel repeated 2x2 (``[B, f, h, w, C]``)."""

  def __call__(self, latents: jax.Array) -> jax.Array:
    return jnp.repeat(jnp.repeat(latents, 2, axis=2), 2, axis=3)


def _prompt_embeds(prompt, num_videos_per_prompt: int = 1, max_sequence_length: int = 1024,
                   scale_factor: int = 8, dtype=None) -> tuple[jax.Array, jax.Array]:
  """Gemma's stand-in: fixed embeddings per prompt text ``[B, TEXT_LEN, CAPTION]``, all kept."""
  del max_sequence_length, scale_factor
  embeds = jnp.asarray(tiny_wan.prompt_rows(prompt, num_videos_per_prompt, (TEXT_LEN, CAPTION)),
                       dtype or jnp.float32)
  return embeds, jnp.ones(embeds.shape[:2], jnp.bool_)


def pipeline(config, mesh_devices: tuple[np.ndarray, Mesh], transformer, decoding: bool = False):
  """An ``LTX2Pipeline`` around ``transformer``: the real ``__call__``, latents out; with
  ``decoding``, prompts in and video and audio out (the stand-ins of :func:`generate_main`)."""
  # Only what __call__ reads of the VAEs, text encoder and vocoder before decoding.
  vae = types.SimpleNamespace(config=types.SimpleNamespace(scaling_factor=1.0),
                              spatial_compression_ratio=32, temporal_compression_ratio=8,
                              dtype=jnp.float32, decode=_video_decode, use_slicing=False,
                              **_statistics(GENERATE_CHANNELS if decoding else CHANNELS))
  audio_vae = types.SimpleNamespace(config=types.SimpleNamespace(**AUDIO),
                                    mel_compression_ratio=MEL_RATIO,
                                    temporal_compression_ratio=AUDIO_TIME_RATIO,
                                    dtype=jnp.float32, decode=_audio_decode,
                                    **_statistics(AUDIO_CHANNELS))
  scheduler = ltx2_pipeline.FlaxFlowMatchScheduler.from_config(SCHEDULER)
  result = ltx2_pipeline.LTX2Pipeline(
      scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=None, tokenizer=None,
      connectors=IdentityConnectors(), transformer=transformer,
      vocoder=StubVocoder() if decoding else None, config=config)
  if decoding:
    result._get_gemma_prompt_embeds = _prompt_embeds  # pylint: disable=protected-access
  result.mesh = mesh_devices[1]
  return result


def write_checkpoint(directory, num_layers: int = 2) -> str:
  """A checkpoint folder holding only ``transformer/config.json`` (what the tools' checks read
  before loading); :func:`generate_main` builds the weights. Its path."""
  return tiny_wan.write_transformer_config(directory, "tiny-ltx2", {
      **TRANSFORMER, "num_layers": num_layers, "in_channels": GENERATE_CHANNELS,
      "out_channels": GENERATE_CHANNELS})


@contextlib.contextmanager
def generate_main(devices: int | None = None, num_layers: int = 2):
  """``generate_ltx2``'s checkpointer builds the tiny pipeline (through any installed hooks) on
  ``devices`` devices, counting the builds in the yielded list."""
  generate_ltx2 = importlib.import_module("maxdiffusion.generate_ltx2")
  builds = []

  class TinyCheckpointer:
    def __init__(self, config):
      self.config = config

    def load_checkpoint(self, step=None, vae_only=False, load_transformer=True,
                        load_upsampler=False):
      del step, vae_only, load_transformer
      mesh = make_mesh(self.config, devices or jax.device_count())
      builds.append(mesh[1])
      transformer = build_transformer(self.config, mesh, num_layers=num_layers,
                                      channels=GENERATE_CHANNELS)
      pipe = pipeline(self.config, mesh, transformer, decoding=True)
      pipe.latent_upsampler = StubUpsampler() if load_upsampler else None
      return pipe, None, None

  with mock.patch.object(generate_ltx2, "LTX2Checkpointer", TinyCheckpointer):
    yield builds


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
