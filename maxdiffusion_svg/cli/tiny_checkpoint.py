"""``python -m maxdiffusion_svg tiny-checkpoint DIR``: a tiny random Wan checkpoint and its config.

A first run without a TPU: the checkpoint (random weights, about 10 MB) and ``tiny_wan_svg.yml``
beside it, a config that ``tiles``, ``generate``, ``compare`` and ``calibrate`` take as it is.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import re

COMMAND_HELP = ("write a tiny random-weight Wan 2.1 checkpoint (diffusers layout, about 10 MB) "
                "and DIR/tiny_wan_svg.yml, a config for it, to try the tools on a CPU (needs "
                "torch, diffusers, transformers and tokenizers: MaxDiffusion's runtime packages)")
CONFIG = "tiny_wan_svg.yml"
NEEDS = ("torch", "diffusers", "transformers", "tokenizers")

# A 65-frame 128x128 video: a 17x8x8 = 1,088-token grid, 128-token tiles, 9 a side: enough that
# the presets' densities keep different tiles (at 33 frames, 576 tokens, 0.2 and 0.3 kept the same
# ones); float32 and one video on one device. MaxDiffusion's base_wan_1_3b.yml holds the rest.
FRAMES, TOKENS = 65, 1088
LAYERS = 3  # layer 0 dense as in every preset; layers 1 and 2 sparse
LOCAL_LAYERS = (1,)  # attends mostly to each token itself: calibrate gives its tiles to layer 2
_KEYS = f"""\
attention: svg
height: 128
width: 128
num_frames: {FRAMES}
num_inference_steps: 10
max_sequence_length: 16
flash_min_seq_length: 128       # the 16 text tokens: dot_product (flash's kv blocks are 128 wide)
weights_dtype: float32
activations_dtype: float32
skip_jax_distributed_system: true
output_dir: tiny_output         # MaxDiffusion's TensorBoard and checkpoint folders, generate's log
run_name: tiny
svg_block_q: 128                # 128-token tiles: the 1,088-token video has tiles to skip
svg_block_kv: 128
svg_min_seq_length: 0           # sparse at any length (the default runs below 4096 tokens dense)
svg_backend: xla                # its heads of 32 fit no TPU kernel (128 lanes); the CPU's anyway
svg_density: 0.3
svg_active_steps: [1, -1]       # every step but the first sparse
svg_active_layers: [1, -1]      # layers 1 and 2 of the checkpoint's 3 sparse
svg_profile_queries: 16         # the router's sampled rows per head (default 64)
# generate_wan reads these for Wan 2.1 T2V; base_wan_1_3b.yml lacks them (MagCache off).
use_magcache: false
magcache_thresh: 0.12
magcache_K: 2
retention_ratio: 0.2
"""


def add_parser(sub: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  tiny = sub.add_parser("tiny-checkpoint", help=COMMAND_HELP)
  tiny.add_argument("directory", metavar="DIR", help="folder to write (created if missing)")
  tiny.add_argument("--family", choices=("wan",), default="wan",
                    help="the model family: wan (Wan 2.1 T2V: 3 layers, 8 heads of 32)")
  tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
  tiny.add_argument("--head-dim", type=int, choices=(32, 128), default=32,
                    help="32: 8 heads of 32 (the CPU try-out); 128: 2 heads of 128, the width "
                         "our TPU kernel runs (its config lets svg_backend pick it on a TPU)")
  tiny.set_defaults(run=run)


_AUTO = ("svg_backend: auto               # heads of 128: our kernel on a TPU, the XLA executor "
         "on a CPU\n")


def config_text(directory: str, head_dim: int = 32) -> str:
  """The config beside the checkpoint: MaxDiffusion's 1.3B base, this checkpoint, a tiny video
  (``head_dim`` 128: the backend left to pick our TPU kernel)."""
  keys = _KEYS if head_dim != 128 else re.sub(r"^svg_backend: .*\n", _AUTO, _KEYS, flags=re.M)
  where = "CPU runs" if head_dim != 128 else "CPU and TPU runs"
  return (f"# A tiny random Wan 2.1 checkpoint ({os.path.abspath(directory)}) at a "
          f"{TOKENS:,}-token video, for {where}.\n"
          f"# Written by python -m maxdiffusion_svg tiny-checkpoint.\n"
          f"base_config: base_wan_1_3b.yml   # MaxDiffusion's\n"
          f"pretrained_model_name_or_path: {os.path.abspath(directory)}\n{keys}")


def install_hint(root: pathlib.Path = pathlib.Path(__file__).resolve().parents[2]) -> str:
  """How to get MaxDiffusion's runtime packages: the checkout's requirements file by its path
  where this package runs from a checkout (a wheel does not carry it), else by name."""
  requirements = root / "requirements-maxdiffusion.txt"
  make = ("make venv-maxdiffusion{where} (a new .venv-maxdiffusion with them and this package, "
          "about 9 GB; then run its bin/python)")
  if requirements.is_file():
    return (f"pip install -r {requirements} into this environment, or "
            f"{make.format(where=f' in {root}')}")
  return (f"pip install -r requirements-maxdiffusion.txt from a maxdiffusion-svg checkout, or "
          f"{make.format(where=' there')}")


def run(args: argparse.Namespace) -> int:
  missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
  if missing:
    raise ValueError(f"tiny-checkpoint needs MaxDiffusion's runtime packages {', '.join(NEEDS)} "
                     f"(missing: {', '.join(missing)}); get them with {install_hint()}")
  from maxdiffusion_svg.testing import tiny_checkpoint  # pylint: disable=import-outside-toplevel
  tiny_checkpoint.write_wan21(args.directory, seed=args.seed, head_dim=args.head_dim,
                              layers=LAYERS, local_layers=LOCAL_LAYERS)
  config = os.path.join(args.directory, CONFIG)
  with open(config, "w", encoding="utf-8") as f:
    f.write(config_text(args.directory, args.head_dim))
  print(f"tiny Wan 2.1 checkpoint (random weights) in {args.directory}; its config: {config}")
  return 0
