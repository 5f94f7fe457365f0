"""A tiny random-weight Wan checkpoint on disk, in the Hugging Face diffusers folder layout.

Unlike ``tiny_wan`` (which patches MaxDiffusion's loaders), this lets the stock
``maxdiffusion.generate_wan`` run end to end, offline and on CPU: tokenizer, text
encoder, transformer(s), VAE and scheduler all load from ``directory``. Needs torch,
diffusers, transformers and tokenizers, imported only when a checkpoint is written.
"""

# pylint: disable=import-outside-toplevel  # heavy torch stack, loaded only to write

from __future__ import annotations

import os
import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  import diffusers
  import transformers

HEADS = 8
HEAD_DIM = 32  # 8 heads divide a context axis of 8 devices
TEXT_DIM = 32  # the text encoder's d_model
LATENT_CHANNELS = 4  # the VAE's z_dim and the transformer's in/out channels
TRANSFORMER = {
    "patch_size": (1, 2, 2), "num_attention_heads": HEADS, "attention_head_dim": HEAD_DIM,
    "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS, "text_dim": TEXT_DIM,
    "freq_dim": 32, "ffn_dim": 64, "num_layers": 2, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}
IMAGE_DIM = 32  # the CLIP image encoder's hidden size (Wan 2.1 I2V's image_dim)
# Wan 2.1 I2V: image tokens enter cross-attention through their own key/value projections, and
# the transformer's input is the noise, the temporal mask (4 channels) and the image's latent.
TRANSFORMER_I2V = {**TRANSFORMER, "image_dim": IMAGE_DIM, "added_kv_proj_dim": HEADS * HEAD_DIM,
                   "in_channels": 2 * LATENT_CHANNELS + 4}
# A local layer's query and key norms are scaled by this: its logits by 4, so that a query's own
# key outweighs the 1,000 others (random weights otherwise attend nearly uniformly).
LOCAL_SHARPNESS = 2.0
# MaxDiffusion's loader reads the transformer through its shard index, so shard it.
SHARD_SIZE = "2MB"


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
  """A character-level fast tokenizer built in memory: no sentencepiece model, no download,
  and different prompts still give different ids (T5 ids: pad 0, eos 1, unk 2)."""
  from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast
  chars = string.ascii_lowercase + string.digits + string.punctuation
  symbols = ["<pad>", "</s>", "<unk>", *chars]
  tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
  tok.normalizer = normalizers.Lowercase()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")])
  tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                 unk_token="<unk>", model_max_length=512,
                                 model_input_names=["input_ids", "attention_mask"])


def _text_encoder() -> transformers.UMT5EncoderModel:
  """UMT5 as in Wan, two layers; its d_model is the transformer's text_dim."""
  from transformers import UMT5Config, UMT5EncoderModel
  return UMT5EncoderModel(UMT5Config(
      vocab_size=128, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
      relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
      eos_token_id=1, decoder_start_token_id=0))


def _vae() -> diffusers.AutoencoderKLWan:
  """Wan 2.1's VAE layout (8x spatial, 4x temporal) at a small width."""
  from diffusers import AutoencoderKLWan
  return AutoencoderKLWan(base_dim=8, z_dim=LATENT_CHANNELS, latents_mean=[0.0] * LATENT_CHANNELS,
                          latents_std=[1.0] * LATENT_CHANNELS)


def _image_encoder() -> transformers.CLIPVisionModel:
  """A CLIP vision tower as Wan 2.1 I2V's: 257 tokens (16x16 patches and the class token),
  of which the pipeline takes the second-to-last hidden state."""
  from transformers import CLIPVisionConfig, CLIPVisionModel
  return CLIPVisionModel(CLIPVisionConfig(
      hidden_size=IMAGE_DIM, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
      image_size=32, patch_size=2, projection_dim=IMAGE_DIM))


def _image_processor() -> transformers.CLIPImageProcessor:
  from transformers import CLIPImageProcessor
  return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def _make_local(block, sharpness: float = LOCAL_SHARPNESS) -> None:
  """A self-attention that attends mostly to the query's own token, as a local layer of a real
  model attends to its neighbourhood: its keys are its queries (``to_k`` = ``to_q``, ``norm_k``
  = ``norm_q``), both norms scaled by ``sharpness`` (the logits by its square)."""
  import torch
  attention = block.attn1
  with torch.no_grad():
    attention.to_k.weight.copy_(attention.to_q.weight)
    attention.to_k.bias.copy_(attention.to_q.bias)
    attention.norm_q.weight.mul_(sharpness)
    attention.norm_k.weight.copy_(attention.norm_q.weight)


def _write(directory: str, seed: int, experts: tuple[str, ...], transformer: dict | None = None,
           image: bool = False, i2v: bool = False, local_layers: tuple[int, ...] = (),
           **pipeline_config) -> str:
  """Writes every component, then ``model_index.json`` from a diffusers ``WanPipeline`` (or
  ``WanImageToVideoPipeline`` with ``i2v``; ``image`` adds a CLIP image encoder and its
  processor); ``local_layers``: the transformers' blocks made local (:func:`_make_local`)."""
  import torch
  from diffusers import (UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline,
                         WanTransformer3DModel)
  os.makedirs(directory, exist_ok=True)
  torch.manual_seed(seed)
  parts = {
      "tokenizer": _tokenizer(), "text_encoder": _text_encoder(), "vae": _vae(),
      "scheduler": UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                           flow_shift=3.0),
  }
  if image:
    parts.update(image_encoder=_image_encoder(), image_processor=_image_processor())
  for i, name in enumerate(experts):
    torch.manual_seed(seed + 1 + i)  # different weights for each expert
    parts[name] = WanTransformer3DModel(**(transformer or TRANSFORMER))
    for layer in local_layers:
      _make_local(parts[name].blocks[layer])
  for name, part in parts.items():
    path = os.path.join(directory, name)
    if name.startswith("transformer"):
      part.save_pretrained(path, max_shard_size=SHARD_SIZE)
    else:
      part.save_pretrained(path)
  pipeline = WanImageToVideoPipeline if i2v or image else WanPipeline
  pipeline(**parts, **pipeline_config).save_config(directory)
  return directory


def write_wan21(directory: str, *, seed: int = 0, head_dim: int = HEAD_DIM,
                layers: int = TRANSFORMER["num_layers"], local_layers: tuple[int, ...] = ()) -> str:
  """A tiny Wan 2.1 T2V checkpoint in ``directory`` (about 10 MB); returns ``directory``.
  ``head_dim``: the same width in fewer, wider heads (128: two, the width our TPU kernel runs);
  ``layers`` transformer blocks, those of ``local_layers`` attending mostly to their own token
  (:func:`_make_local`: layers that need few tiles, beside random ones that need many)."""
  width = HEADS * HEAD_DIM
  if head_dim < 1 or width % head_dim:
    raise ValueError(f"head_dim must divide the tiny model's width {width}, got {head_dim}")
  if not all(0 <= layer < layers for layer in local_layers):
    raise ValueError(f"local_layers must be among the {layers} layers, got {local_layers}")
  transformer = {**TRANSFORMER, "num_attention_heads": width // head_dim,
                 "attention_head_dim": head_dim, "num_layers": layers}
  return _write(directory, seed, ("transformer",), transformer=transformer,
                local_layers=local_layers)


def write_wan22(directory: str, *, seed: int = 0) -> str:
  """A tiny Wan 2.2 A14B-style T2V checkpoint: ``transformer`` is the high-noise expert,
  ``transformer_2`` the low-noise one, as in diffusers."""
  return _write(directory, seed, ("transformer", "transformer_2"), boundary_ratio=0.875)


def write_wan21_i2v(directory: str, *, seed: int = 0) -> str:
  """A tiny Wan 2.1 I2V checkpoint (CLIP image encoder, image cross-attention); returns it."""
  return _write(directory, seed, ("transformer",), transformer=TRANSFORMER_I2V, image=True)


def write_wan22_i2v(directory: str, *, seed: int = 0) -> str:
  """A tiny Wan 2.2 A14B-style I2V checkpoint: two experts conditioned on the image's latent
  (no image encoder, no image cross-attention); returns ``directory``."""
  transformer = {**TRANSFORMER, "in_channels": 2 * LATENT_CHANNELS + 4}
  return _write(directory, seed, ("transformer", "transformer_2"), transformer=transformer,
                i2v=True, boundary_ratio=0.9)


def write_image(path: str, size: int = 128, seed: int = 0) -> str:
  """A random RGB PNG to condition I2V on; returns ``path``."""
  import numpy as np
  from PIL import Image
  pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
  Image.fromarray(pixels).save(path)
  return path
