"""What each attention kernel makes a Wan forward move between devices (from compiled HLO).

One forward of the tiny random Wan (``tiny_wan``) on a mesh with every device on
``context`` is compiled per kernel, and its collectives are read with ``bench.hlo``.
MaxDiffusion's ``ulysses`` runs Splash, which runs on CPU only in interpret mode; the
interpreter is switched on for the measurement (it changes the kernel body, not what
moves between devices).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from maxdiffusion_svg.bench.hlo import KINDS, collective_stats
from maxdiffusion_svg.testing import tiny_wan

KERNELS = ("svg", "ulysses", "dot_product")
# Video tokens per text token as in Wan at 720p (75,600 : 512) would need a large model to
# compile; 21x15x26 = 8,190 video tokens to 128 text tokens keeps the ratio above 60.
DEFAULT_LATENT = (4, 21, 30, 52)


@contextlib.contextmanager
def _splash_interpreted():
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel  # pylint: disable=import-outside-toplevel
  original = splash_attention_kernel.make_splash_mha
  splash_attention_kernel.make_splash_mha = functools.partial(original, interpret=True)
  try:
    yield
  finally:
    splash_attention_kernel.make_splash_mha = original


def forward_collectives(attention: str, devices: int, batch: int = 2,
                        latent: Sequence[int] = tiny_wan.LATENT, text_len: int = 128,
                        **keys: Any) -> dict[str, dict[str, float]]:
  """Collectives of one compiled tiny-Wan forward (batch 2: classifier-free guidance)."""
  with tempfile.TemporaryDirectory() as tmp:
    config = tiny_wan.init_config(tiny_wan.write_config(tmp, attention=attention, **keys))
  mesh = tiny_wan.make_mesh(config, devices)
  model = tiny_wan.build_transformer(config, mesh)
  latents, text = tiny_wan.inputs(batch=batch, text_len=text_len, latent=tuple(latent))
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  timestep = jax.numpy.full((batch,), 500, jax.numpy.int32)
  from maxdiffusion.pipelines.wan import wan_pipeline  # pylint: disable=import-outside-toplevel
  with mesh[1], nn_partitioning.axis_rules(config.logical_axis_rules), _splash_interpreted():
    lowered = wan_pipeline.transformer_forward_pass.jitted.lower(
        graphdef, state, rest, latents, timestep, text, do_classifier_free_guidance=False,
        guidance_scale=1.0)
    return collective_stats(lowered.compile().as_text(), devices)


def measure(kernels: Sequence[str] = KERNELS, devices: int = 8,
            latent: Sequence[int] = DEFAULT_LATENT, text_len: int = 128,
            log: Callable[[str], None] = print) -> dict[str, Any]:
  """Collectives per kernel; ``svg`` runs sparse in every step and layer."""
  from maxdiffusion_svg import plugin  # pylint: disable=import-outside-toplevel
  plugin.register()
  svg_keys = {"svg_density": 0.3, "svg_active_steps": [0, None], "svg_active_layers": [0, None]}
  grid = [n // p for n, p in zip(latent[1:], tiny_wan.TRANSFORMER["patch_size"])]
  result: dict[str, Any] = {"devices": devices, "grid": "x".join(map(str, grid)),
                            "tokens": int(np.prod(grid)), "text_len": text_len,
                            "heads": tiny_wan.HEADS, "kernels": {}}
  for kernel in kernels:
    log(f"compiling a tiny Wan forward with attention={kernel}...")
    stats = forward_collectives(kernel, devices, latent=latent, text_len=text_len,
                                **(svg_keys if kernel == "svg" else {}))
    result["kernels"][kernel] = {"collectives": stats,
                                 "bytes": sum(c["bytes"] for c in stats.values()),
                                 "count": sum(c["count"] for c in stats.values())}
  return result


def format_collectives(result: dict[str, Any]) -> str:
  rows = result["kernels"]
  kinds = [k for k in KINDS if any(k in r["collectives"] for r in rows.values())]
  lines = [f"tiny Wan forward: 2 layers (one scanned body), {result['heads']} heads, grid "
           f"{result['grid']} = {result['tokens']:,} tokens, {result['text_len']} text tokens, "
           f"batch 2, float32, {result['devices']} devices on context; bytes sent per device",
           f"{'attention':<13}" + "".join(f"{k:>24}" for k in kinds) + f"{'total':>14}"]
  for name, row in rows.items():
    cells = [f"{c['count']} ops, {c['bytes'] / 1024:.1f} KiB" if (c := row["collectives"].get(k))
             else "-" for k in kinds]
    lines.append(f"{name:<13}" + "".join(f"{c:>24}" for c in cells)
                 + f"{row['bytes'] / 1024:>10.1f} KiB")
  return "\n".join(lines)
