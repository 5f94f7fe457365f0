"""A tiny random-weight Wan VACE transformer built the pipeline's way, for CPU integration tests.

VACE adds a second token stream (control latents through their own patch embedding and
VACE blocks, whose outputs are added after the main blocks listed in ``vace_layers``) and
reference images, which the pipeline prepends to the latents as extra latent frames: one
reference gives ``N = (F + 1)·H·W`` tokens. MaxDiffusion's VACE
``create_sharded_logical_transformer`` runs for real (through any installed hooks), from
``base_wan_14b.yml`` plus our keys; only the Hugging Face config and weight loaders are
replaced. A real ``VaceWanPipeline2_1`` around it runs ``__call__`` (control latents, masks and
reference frames as the pipeline prepares them) on given prompt embeddings, with a stand-in
VAE encoder and an identity decode: its ``__call__`` has no latent output type.

:func:`generate_main` runs our VACE generate main (:mod:`maxdiffusion_svg.plugin.generate_vace`:
prompts, reference images and control video read from files, decoding and the MP4) on the tiny
pipeline, with stand-ins for the UMT5 text encoder (embeddings from the prompt's text) and the
VAE decoder (latents to uint8 frames); :func:`write_inputs` writes the files.
"""

# pylint: disable=protected-access  # tiny_wan's loader and components; the identity decode

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
from maxdiffusion.pipelines.wan import wan_vace_pipeline_2_1 as vace_pipeline

from maxdiffusion_svg.testing import tiny_wan
from maxdiffusion_svg.testing.tiny_wan import HEADS, TEXT_LEN, init_config, make_mesh

__all__ = ["HEADS", "LATENT", "REFERENCES", "VACE_CHANNELS", "VIDEO", "build_transformer",
           "forward", "generate", "generate_main", "init_config", "inputs", "make_mesh",
           "pipeline", "reference_image", "tiny_loaders", "write_checkpoint", "write_config",
           "write_inputs"]

CHANNELS = tiny_wan.TRANSFORMER["in_channels"]  # latent channels (the VAE's z_dim)
SPATIAL = 8  # the VAE's spatial compression: a latent cell is 8x8 pixels
# Control latents as the pipeline builds them: the VAE latents of the inactive and reactive
# video, then the 8x8 pixel mask of each latent cell as channels.
VACE_CHANNELS = 2 * CHANNELS + SPATIAL * SPATIAL  # 72
TRANSFORMER = {**tiny_wan.TRANSFORMER, "vace_layers": [0, 1], "vace_in_channels": VACE_CHANNELS}
REFERENCES = 1  # reference images: latent frames prepended to the video's
LATENT = (CHANNELS, 5, 16, 16)  # channels, 1 reference + 4 video frames, height, width
# -> grid 5x8x8 = 320 tokens, frame 0 the reference
VIDEO = {"num_frames": 13, "height": 128, "width": 128}  # the pixel video of LATENT's 4 frames


def write_config(directory, base: str = "base_wan_14b.yml", **keys: Any) -> str:
  """MaxDiffusion's ``base`` YAML with our keys and ``keys``: ``scan_layers`` off, as
  ``WanVACEModel`` requires (the VACE factory forces it on the model; the weight loader reads
  the config's)."""
  return tiny_wan.write_config(directory, base, **{"scan_layers": False, **keys})


@contextlib.contextmanager
def tiny_loaders(num_layers: int = 2, heads: int = HEADS, scale: float = 0.1,
                 head_dim: int = tiny_wan.HEAD_DIM, vace_layers: tuple[int, ...] = (0, 1)):
  """Replaces the Hugging Face config and weight loaders with a tiny random Wan VACE (the main
  blocks get tiny_wan's weights for the same layers)."""
  config = {**TRANSFORMER, "num_layers": num_layers, "num_attention_heads": heads,
            "attention_head_dim": head_dim, "vace_layers": list(vace_layers)}

  load_config = tiny_wan.config_loader(config)

  with mock.patch.object(vace_pipeline.WanVACEModel, "load_config", side_effect=load_config), \
       mock.patch.object(vace_pipeline, "load_wan_transformer",
                         side_effect=tiny_wan._random_params(scale)):
    yield


def build_transformer(config, mesh_devices: tuple[np.ndarray, Mesh], subfolder: str = "transformer",
                      num_layers: int = 2, heads: int = HEADS, head_dim: int = tiny_wan.HEAD_DIM,
                      vace_layers: tuple[int, ...] = (0, 1)):
  """A ``WanVACEModel`` through MaxDiffusion's VACE factory (``vace_layers``: the main blocks
  after which a VACE block's hint is added, in order; the one for block 0 projects its input)."""
  array, mesh = mesh_devices
  with tiny_loaders(num_layers, heads, head_dim=head_dim, vace_layers=vace_layers), mesh:
    return vace_pipeline.create_sharded_logical_transformer(
        devices_array=array, mesh=mesh, rngs=nnx.Rngs(0), config=config, subfolder=subfolder)


def inputs(batch: int = 2, seed: int = 0, text_len: int = TEXT_LEN,
           latent: tuple[int, ...] = LATENT) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Latents ``[B, C, R+F, H, W]``, control ``[B, VACE_CHANNELS, R+F, H, W]`` laid out as the
  pipeline's (a reference frame has no reactive latent and a zero mask; video frames a mask of
  ones) and text embeddings ``[B, text_len, text_dim]``."""
  rng = np.random.default_rng(seed)
  latents = rng.standard_normal((batch, *latent))
  control = np.concatenate([rng.standard_normal((batch, 2 * CHANNELS, *latent[1:])),
                            np.ones((batch, SPATIAL * SPATIAL, *latent[1:]))], axis=1)
  control[:, CHANNELS:, :REFERENCES] = 0.0
  text = rng.standard_normal((batch, text_len, TRANSFORMER["text_dim"]))
  return tuple(jnp.asarray(x, jnp.float32) for x in (latents, control, text))


def forward(model, mesh: Mesh, config, latents, control, text, t,
            scale: jax.Array | None = None) -> jax.Array:
  """One transformer call through the VACE pipeline's jitted forward (``scale``: the
  per-VACE-layer conditioning scale, ones by default)."""
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  timestep = jnp.broadcast_to(jnp.asarray(t, jnp.int32), (latents.shape[0],))
  if scale is None:
    scale = jnp.ones((len(model.config.vace_layers),), jnp.float32)
  with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
    out, _ = vace_pipeline.transformer_forward_pass(
        graphdef, state, rest, latents, timestep, text, control, scale,
        do_classifier_free_guidance=False, guidance_scale=1.0)
  return out


def _encode(pixels: jax.Array, feat_cache=None) -> types.SimpleNamespace:
  """A stand-in VAE encoder with the Wan VAE's shapes: every 4th frame from the first, 8x8
  average pools, the RGB channels repeated to ``CHANNELS``."""
  del feat_cache
  if pixels.shape[-1] != 3:  # [B, 3, F, H, W] -> channels last, as the Wan VAE does
    pixels = jnp.moveaxis(pixels, 1, -1)
  b, f, h, w, c = pixels[:, ::4].shape
  pooled = pixels[:, ::4].reshape(b, f, h // SPATIAL, SPATIAL, w // SPATIAL, SPATIAL, c)
  return types.SimpleNamespace(latents=pooled.mean((3, 5))[..., np.arange(CHANNELS) % c])


def pipeline(config, mesh_devices: tuple[np.ndarray, Mesh], transformer):
  """A ``VaceWanPipeline2_1`` around ``transformer``: the real ``__call__``, latents out."""
  # What __call__ reads of a VAE before decoding; decoding is the identity.
  vae = types.SimpleNamespace(
      latents_mean=[0.0] * CHANNELS, latents_std=[1.0] * CHANNELS, z_dim=CHANNELS,
      temperal_downsample=[False, True, True], encode=_encode,
      decoder=types.SimpleNamespace(conv_in=types.SimpleNamespace(
          conv=types.SimpleNamespace(bias=jnp.zeros((1,), jnp.float32)))))
  components = {**tiny_wan._components(config, mesh_devices), "vae": vae}
  result = vace_pipeline.VaceWanPipeline2_1(config=config, transformer=transformer, **components)
  result._decode_latents_to_video = lambda latents, trace=None: latents
  return result


def reference_image(seed: int = 0) -> PIL.Image.Image:
  """A random RGB image of the video's size (the pipeline fits any size into its frame)."""
  rng = np.random.default_rng(seed)
  pixels = rng.integers(0, 256, (VIDEO["height"], VIDEO["width"], 3), dtype=np.uint8)
  return PIL.Image.fromarray(pixels)


def generate(pipe, steps: int, text: jax.Array, references: int = REFERENCES,
             **kwargs) -> jax.Array:
  """Denoised latents ``[1, C, F, H, W]`` of the video frames (the pipeline drops the
  reference frames) for ``text`` embeddings of batch 1 (the negative prompt is their
  negation), with ``references`` random reference images."""
  images = [reference_image(i) for i in range(references)] or None
  return pipe(prompt_embeds=text, negative_prompt_embeds=-text, reference_images=images,
              num_inference_steps=steps, **{**VIDEO, **kwargs})


def _decode(latents: jax.Array, trace=None) -> np.ndarray:
  """The Wan VAE decoder's stand-in: latents ``[B, C, F, h, w]`` to uint8 frames ``[B,
  4(F-1)+1, 8h, 8w, 3]`` (the first latent frame once, each later one four times)."""
  del trace
  x = np.asarray(latents, np.float32)[:, :3]
  x = np.repeat(x, 4, axis=2)[:, :, 3:].repeat(SPATIAL, axis=3).repeat(SPATIAL, axis=4)
  return np.moveaxis(((np.tanh(x) + 1) * 127.5).astype(np.uint8), 1, -1)


def write_checkpoint(directory, num_layers: int = 2) -> str:
  """A checkpoint folder holding only ``transformer/config.json`` (what the tools' checks read
  before loading: the heads, and ``vace_layers`` that make it VACE's); :func:`generate_main`
  builds the weights. Its path."""
  return tiny_wan.write_transformer_config(directory, "tiny-wan-vace",
                                          {**TRANSFORMER, "num_layers": num_layers})


def write_inputs(directory, references: int = REFERENCES, control: bool = False,
                 seed: int = 0) -> dict[str, object]:
  """``references`` random reference images (PNG) and, with ``control``, a random control video
  and a mask video (MP4, as MaxDiffusion's ``load_video`` reads them; the mask's right half
  white: generated, its left half kept): the config keys that name them."""
  folder = pathlib.Path(directory)
  keys: dict[str, object] = {"vace_reference_images": []}
  for index in range(references):
    path = folder / f"reference_{index}.png"
    reference_image(seed + index).save(path)
    keys["vace_reference_images"].append(str(path))
  if control:
    import imageio  # pylint: disable=import-outside-toplevel  # with imageio-ffmpeg, as load_video
    rng = np.random.default_rng(seed)
    shape = (VIDEO["num_frames"], VIDEO["height"], VIDEO["width"], 3)
    mask = np.zeros(shape, np.uint8)
    mask[:, :, VIDEO["width"] // 2:] = 255
    for key, frames in (("vace_video", rng.integers(0, 256, shape, np.uint8)), ("vace_mask", mask)):
      path = folder / f"{key}.mp4"
      imageio.mimwrite(path, list(frames), fps=16, macro_block_size=1)
      keys[key] = str(path)
  return keys


@contextlib.contextmanager
def generate_main(devices: int | None = None, num_layers: int = 2):
  """Our VACE main's loader builds the tiny pipeline (through any installed hooks) on
  ``devices`` devices (all, as the mains' meshes take them), counting the builds in the
  yielded list."""
  from maxdiffusion_svg.plugin import generate_vace  # pylint: disable=import-outside-toplevel
  builds = []

  def load_pipeline(config):
    mesh = make_mesh(config, devices or jax.device_count())
    builds.append(mesh[1])
    pipe = pipeline(config, mesh, build_transformer(config, mesh, num_layers=num_layers))
    pipe._get_t5_prompt_embeds = tiny_wan.t5_stand_in((TEXT_LEN, TRANSFORMER["text_dim"]))
    pipe._decode_latents_to_video = _decode
    return pipe

  with mock.patch.object(generate_vace, "load_pipeline", load_pipeline):
    yield builds
