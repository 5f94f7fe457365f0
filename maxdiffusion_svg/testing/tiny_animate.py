"""A tiny random-weight Wan Animate transformer built the pipeline's way, for CPU tests.

``create_sharded_animate_transformer`` of MaxDiffusion's Animate pipeline runs for real (through
any installed hooks), from a config that is the installed MaxDiffusion's own
``base_wan_animate.yml`` plus our keys, written to a temporary file; only the Hugging Face
config and weight loaders are replaced. A real ``WanAnimatePipeline`` around it runs
``__call__`` (segments, reference and pose conditioning, face motion, the denoising loop) on
given prompt embeddings: the CLIP encoder returns fixed embeddings and the VAE is a
shape-correct stand-in (pooled frames in, repeated frames out), so no checkpoint is read.

Layout (``animate_transformer_forward_pass``): latents ``[B, T+1, H, W, Z]`` channel-last, frame
0 the reference-image slot; reference latents ``[B, T+1, H, W, 4+Z]`` (I2V mask, then latents:
frame 0 the reference image, frames 1.. the previous segment's conditioning); pose latents
``[B, T, H, W, Z]`` (patch-embedded and added to frames 1..); face pixels ``[B, 3, 4(T-1)+1,
S, S]`` at the motion encoder's size. Image tokens are CLIP's 257: keep ``flash_min_seq_length``
at most 257 (ours is 0). Above it the image embedder does not pad them to 384, where MaxDiffusion's
I2V cross-attention still splits image from text, and the text is attended as image tokens.

:func:`generate_main` runs MaxDiffusion's own ``generate_wan_animate`` (prompts, the reference
image and the pose and face videos read from files, decoding and the MP4): its checkpointer
builds the tiny pipeline, with a stand-in for the UMT5 text encoder (embeddings from the
prompt's text); :func:`write_inputs` writes the files.
"""

from __future__ import annotations

import contextlib
import pathlib
import types
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh
from maxdiffusion.pipelines.wan import wan_pipeline_animate

from maxdiffusion_svg.testing import tiny_wan
from maxdiffusion_svg.testing.tiny_wan import init_config, make_mesh

__all__ = ["FACE_SIZE", "HEADS", "LATENT", "SEGMENT_FRAMES", "build_transformer", "forward",
           "generate", "generate_main", "init_config", "inputs", "make_mesh", "pipeline",
           "tiny_loaders", "write_checkpoint", "write_config", "write_inputs"]

HEADS = 8
HEAD_DIM = 16
Z = 4  # VAE latent channels
MASK = 4  # I2V mask channels: the VAE's temporal compression
TEXT_DIM, TEXT_LEN = 32, 16
IMAGE_DIM, IMAGE_LEN = 16, 257  # CLIP's token count: the I2V attention's default image length
FACE_SIZE = 8  # the smallest face size the pipeline's video processor keeps (multiple of 8)
SEGMENT_FRAMES = 9  # pixel frames per segment -> T = 3 latent frames + the reference slot
LATENT = (SEGMENT_FRAMES - 1) // 4 + 2, 16, 16  # frames, height, width -> grid 4x8x8 = 256 tokens
VIDEO = {"height": 128, "width": 128}  # LATENT's pixels
TRANSFORMER = {
    "patch_size": [1, 2, 2], "num_attention_heads": HEADS, "attention_head_dim": HEAD_DIM,
    "in_channels": 2 * Z + MASK, "latent_channels": Z, "out_channels": Z, "text_dim": TEXT_DIM,
    "freq_dim": 32, "ffn_dim": 64, "num_layers": 2, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": IMAGE_DIM,
    "added_kv_proj_dim": HEADS * HEAD_DIM, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
    "motion_encoder_channel_sizes": {"4": 16, "8": 16}, "motion_encoder_size": FACE_SIZE,
    "motion_style_dim": 16, "motion_dim": 4, "motion_encoder_dim": 16,
    "face_encoder_hidden_dim": 16, "face_encoder_num_heads": 2,
    "inject_face_latents_blocks": 2,  # of 2 layers: a face adapter after block 0, none after 1
    "motion_encoder_batch_size": 8,
}
BASE_KEYS = {**tiny_wan.BASE_KEYS, "pretrained_model_name_or_path": "tiny-wan-animate",
             "precision": "HIGHEST", "jax_cache_dir": "", **VIDEO}  # the YAML's cache: in cwd


def write_config(directory, base: str = "base_wan_animate.yml", **keys: Any) -> str:
  """MaxDiffusion's ``base`` YAML with our keys and ``keys`` added or replaced, in ``directory``."""
  return tiny_wan.write_config(directory, base, **{**BASE_KEYS, **keys})


@contextlib.contextmanager
def tiny_loaders(num_layers: int = 2, heads: int = HEADS, scale: float = 0.1,
                 head_dim: int = HEAD_DIM):
  """Replaces the Hugging Face config and weight loaders with a tiny random Wan Animate
  (weights keyed by name and layer: scanned and per-block models get the same ones)."""
  config = {**TRANSFORMER, "num_layers": num_layers, "num_attention_heads": heads,
            "attention_head_dim": head_dim, "added_kv_proj_dim": heads * head_dim}

  load_config, weights = tiny_wan.config_loader(config), tiny_wan.host_random_params(scale)
  model = wan_pipeline_animate.WanAnimateTransformer3DModel
  with mock.patch.object(model, "load_config", side_effect=load_config), \
       mock.patch.object(wan_pipeline_animate, "load_wan_animate_transformer", side_effect=weights):
    yield


def build_transformer(config, mesh_devices: tuple[np.ndarray, Mesh], subfolder: str = "transformer",
                      num_layers: int = 2, heads: int = HEADS, head_dim: int = HEAD_DIM):
  array, mesh = mesh_devices
  with tiny_loaders(num_layers, heads, head_dim=head_dim), mesh:
    return wan_pipeline_animate.create_sharded_animate_transformer(
        devices_array=array, mesh=mesh, rngs=nnx.Rngs(0), config=config, subfolder=subfolder)


def inputs(batch: int = 1, seed: int = 0,
           latent: tuple[int, int, int] = LATENT) -> dict[str, jax.Array]:
  """One segment's transformer inputs laid out as the pipeline builds them (segment 0: only the
  reference frame is masked as known), with text and CLIP image embeddings."""
  rng = np.random.default_rng(seed)
  frames, height, width = latent

  def normal(*shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)

  mask = jnp.zeros((batch, frames, height, width, MASK)).at[:, 0].set(1.0)
  face = jnp.asarray(rng.uniform(-1, 1, (batch, 3, 4 * (frames - 2) + 1, FACE_SIZE, FACE_SIZE)),
                     jnp.float32)
  return {"latents": normal(batch, frames, height, width, Z),
          "reference": jnp.concatenate([mask, normal(batch, frames, height, width, Z)], -1),
          "pose": normal(batch, frames - 1, height, width, Z), "face": face,
          "text": normal(batch, TEXT_LEN, TEXT_DIM), "image": normal(batch, IMAGE_LEN, IMAGE_DIM)}


def forward(model, mesh: Mesh, config, latents, reference, pose, face, text, image,
            t) -> jax.Array:
  """One denoising call as the pipeline makes it: the segment's face motion (jitted), then the
  jitted forward; the velocity ``[B, T+1, H, W, Z]``."""
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  timestep = jnp.broadcast_to(jnp.asarray(t, jnp.int32), (latents.shape[0],))
  with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
    motion = wan_pipeline_animate.animate_encode_face_motion(graphdef, state, rest, face,
                                                             face.shape[0])
    return wan_pipeline_animate.animate_transformer_forward_pass(
        graphdef, state, rest, latents, reference, pose, motion, timestep, text, image)


class StubVae:
  """What the pipeline reads of the Wan VAE, at its compressions (4x in time, 8x in space):
  ``encode`` keeps every 4th frame and pools 8x8 pixels, ``decode`` repeats them back."""

  z_dim, latents_mean, latents_std = Z, [0.0] * Z, [1.0] * Z
  temperal_downsample = [False, True, True]
  dtype = jnp.float32

  def encode(self, video: jax.Array, cache=None) -> list[Any]:
    del cache  # [B, 3, T, H, W] -> [B, t, h, w, Z] (channel-last)
    b, c, _, h, w = video.shape
    frames = video[:, :, ::4].reshape(b, c, -1, h // 8, 8, w // 8, 8).mean((4, 6))
    latents = jnp.concatenate([frames, frames.mean(1, keepdims=True)], 1)[:, :Z]
    return [types.SimpleNamespace(mode=lambda: jnp.transpose(latents, (0, 2, 3, 4, 1)))]

  def decode(self, latents: jax.Array, cache=None) -> list[jax.Array]:
    del cache  # [B, Z, t, h, w] -> [B, 4(t-1)+1, 8h, 8w, 3]
    video = jnp.tanh(jnp.transpose(latents[:, :3], (0, 2, 3, 4, 1)))
    video = jnp.concatenate([video[:, :1], jnp.repeat(video[:, 1:], 4, axis=1)], axis=1)
    return [jnp.repeat(jnp.repeat(video, 8, axis=2), 8, axis=3)]


class StubClip:
  """The CLIP image processor and encoder in one: fixed embeddings ``[n, IMAGE_LEN, IMAGE_DIM]``."""

  def __init__(self, seed: int = 0):
    self.embeds = np.random.default_rng(seed).standard_normal((1, IMAGE_LEN, IMAGE_DIM), np.float32)

  def __call__(self, images=None, return_tensors=None, output_hidden_states=None):
    del return_tensors, output_hidden_states
    if isinstance(images, list):  # the processor: one row per image
      return types.SimpleNamespace(pixel_values=np.zeros((len(images), 1), np.float32))
    states = jnp.asarray(np.repeat(self.embeds, images.shape[0], axis=0))
    return types.SimpleNamespace(hidden_states=(states, states))


def pipeline(config, mesh_devices: tuple[np.ndarray, Mesh], transformer, seed: int = 0):
  """A ``WanAnimatePipeline`` around ``transformer``: the real ``__call__``, latents out."""
  array, mesh = mesh_devices
  scheduler, state = tiny_wan._scheduler(config)  # pylint: disable=protected-access
  clip = StubClip(seed)
  return wan_pipeline_animate.WanAnimatePipeline(
      config=config, transformer=transformer, tokenizer=None, text_encoder=None,
      image_processor=clip, image_encoder=clip, vae=StubVae(), vae_cache=None,
      scheduler=scheduler, scheduler_state=state, devices_array=array, mesh=mesh)


def _frames(count: int, size: tuple[int, int], rng: np.random.Generator) -> list[PIL.Image.Image]:
  return [PIL.Image.fromarray(rng.integers(0, 256, (*size, 3), np.uint8)) for _ in range(count)]


def generate(pipe, steps: int, text: jax.Array, segments: int = 1, seed: int = 0,
             **kwargs) -> jax.Array:
  """The last segment's denoised latents ``[B, T+1, H, W, Z]`` (frame 0 the reference slot) for
  ``text`` embeddings (negative: their negation), in ``segments`` segments of SEGMENT_FRAMES
  pixel frames overlapping by one; random reference image, pose and face videos."""
  rng = np.random.default_rng(seed)
  size = VIDEO["height"], VIDEO["width"]
  frames = 1 + segments * (SEGMENT_FRAMES - 1)
  arguments = {"segment_frame_length": SEGMENT_FRAMES, "prev_segment_conditioning_frames": 1,
               **VIDEO, **kwargs}
  return pipe(image=_frames(1, size, rng)[0], pose_video=_frames(frames, size, rng),
              face_video=_frames(frames, (2 * FACE_SIZE, 2 * FACE_SIZE), rng),
              prompt_embeds=text, negative_prompt_embeds=-text, num_inference_steps=steps,
              output_type="latent", rng=jax.random.key(seed), **arguments)


def write_checkpoint(directory, num_layers: int = 2) -> str:
  """A checkpoint folder holding only ``transformer/config.json`` (what the tools' checks read
  before loading); :func:`generate_main` builds the weights. Its path."""
  return tiny_wan.write_transformer_config(directory, "tiny-wan-animate",
                                          {**TRANSFORMER, "num_layers": num_layers})


def write_inputs(directory, segments: int = 1, seed: int = 0) -> dict[str, str]:
  """A random reference image (PNG) and pose and face videos (MP4, as MaxDiffusion's
  ``load_video`` reads them) of ``segments`` segments of SEGMENT_FRAMES frames overlapping by
  one: the config keys that name them."""
  import imageio  # pylint: disable=import-outside-toplevel  # with imageio-ffmpeg, as load_video
  rng = np.random.default_rng(seed)
  size = VIDEO["height"], VIDEO["width"]
  frames = 1 + segments * (SEGMENT_FRAMES - 1)
  folder = pathlib.Path(directory)
  paths = {"reference_image_path": folder / "reference.png",
           "pose_video_path": folder / "pose.mp4", "face_video_path": folder / "face.mp4"}
  _frames(1, size, rng)[0].save(paths["reference_image_path"])
  for key, count, shape in (("pose_video_path", frames, size),
                            ("face_video_path", frames, (2 * FACE_SIZE, 2 * FACE_SIZE))):
    imageio.mimwrite(paths[key], [np.asarray(f) for f in _frames(count, shape, rng)], fps=16,
                     macro_block_size=1)
  return {key: str(path) for key, path in paths.items()}


@contextlib.contextmanager
def generate_main(devices: int | None = None, num_layers: int = 2):
  """``generate_wan_animate``'s checkpointer builds the tiny pipeline (through any installed
  hooks) on ``devices`` devices (all, as the mains' meshes take them), counting the builds in
  the yielded list."""
  from maxdiffusion import generate_wan_animate  # pylint: disable=import-outside-toplevel
  builds = []

  class TinyCheckpointer:
    @staticmethod
    def load_pretrained_pipeline_or_diffusers(config, pipeline_cls, *args, **kwargs):
      del pipeline_cls, args, kwargs
      mesh = make_mesh(config, devices or jax.device_count())
      builds.append(mesh[1])
      pipe = pipeline(config, mesh, build_transformer(config, mesh, num_layers=num_layers))
      pipe._get_t5_prompt_embeds = tiny_wan.t5_stand_in((TEXT_LEN, TEXT_DIM))  # pylint: disable=protected-access
      return pipe

  with mock.patch.object(generate_wan_animate, "WanCheckpointer", TinyCheckpointer):
    yield builds
