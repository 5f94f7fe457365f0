"""End-to-end smoke benchmark: the stock Wan pipeline on a tiny random checkpoint, dense vs SVG.

Each run goes through the launcher (config chain -> ``generate_wan.main``) in this process,
on the shipped 1.3B config with the tiny checkpoint's sizes as overrides. Per run: seconds
per denoising step of the real run (the pipeline's own ``denoise_total``; the warm-up is
excluded), video PSNR against the dense video (uint8 frames before MP4 encoding), and the
share of self-attention calls that ran sparse. Random weights on CPU: this checks the
whole path and its bookkeeping, not the seed's TPU speed-ups.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import tempfile
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import yaml

from maxdiffusion_svg.budgets.schedule import PRESETS
from maxdiffusion_svg.plugin import launcher
from maxdiffusion_svg.testing import tiny_checkpoint

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
VIDEO = ["height=128", "width=128", "num_frames=33"]  # a 9x8x8 = 576-token grid
TINY = ["max_sequence_length=16", "weights_dtype=float32", "activations_dtype=float32",
        "skip_jax_distributed_system=True", "run_name=e2e", "svg_block_q=128",
        "svg_block_kv=128", "svg_min_seq_length=0"]


@contextlib.contextmanager
def _capturing() -> Iterator[dict[str, Any]]:
  """Captures the exported frames and the last pipeline call's trace of a generate_wan run."""
  from maxdiffusion import generate_wan  # pylint: disable=import-outside-toplevel
  captured: dict[str, Any] = {}
  export, call = generate_wan.export_to_video, generate_wan.call_pipeline

  def export_frames(video, path, fps):
    captured["frames"] = np.asarray(video)
    return export(video, path, fps=fps)

  def call_traced(*args, **kwargs):
    outputs = call(*args, **kwargs)
    captured["trace"] = outputs[1] if isinstance(outputs, tuple) else {}
    return outputs

  generate_wan.export_to_video, generate_wan.call_pipeline = export_frames, call_traced
  try:
    yield captured
  finally:
    generate_wan.export_to_video, generate_wan.call_pipeline = export, call


def psnr(video: np.ndarray, reference: np.ndarray) -> float:
  """PSNR (dB) of a uint8 video against a reference video."""
  mse = float(np.mean((video.astype(np.float64) - reference.astype(np.float64)) ** 2))
  return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def generate(argv: Sequence[str], workdir: str, record: bool = True,
             arrays: bool = False) -> dict[str, Any]:
  """Runs the launcher in this process on ``argv`` (``[config, key=value ...]``) from
  ``workdir``: the exported ``frames`` (uint8), the pipeline ``trace`` of the last call
  and the svg kernel's call ``log``. ``record=False`` leaves the log empty and the compiled
  functions free of its callbacks (which MaxDiffusion's AOT cache cannot serialize);
  ``arrays=True`` keeps each self-attention call's q, k, v and output in the log."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxdiffusion_svg import plugin  # pylint: disable=import-outside-toplevel
  cwd = os.getcwd()
  os.chdir(workdir)  # generate_wan writes its MP4 into the working directory
  try:
    recording = plugin.record_calls(arrays) if record else contextlib.nullcontext([])
    with _capturing() as captured, recording as log:
      launcher.run(["maxdiffusion_svg.generate", *argv])
      jax.effects_barrier()
  finally:
    os.chdir(cwd)
  return {**captured, "log": log}


def run_e2e_bench(steps: int = 10, presets: Sequence[str] = tuple(PRESETS),
                  log: Callable[[str], None] = print) -> dict[str, Any]:
  """Dense, then SVG for each preset; returns a JSON-ready dict (frames left out)."""
  if not (CONFIGS / "wan_svg_1_3b.yml").is_file():
    raise ValueError(f"the e2e benchmark runs from a checkout: no {CONFIGS / 'wan_svg_1_3b.yml'}")
  unknown = sorted(set(presets) - set(PRESETS))
  if unknown:
    raise ValueError(f"presets must be among {', '.join(PRESETS)}, got {unknown}")
  with tempfile.TemporaryDirectory(prefix="svg_e2e_") as tmp:
    log("writing a tiny random Wan 2.1 checkpoint...")
    checkpoint = tiny_checkpoint.write_wan21(f"{tmp}/checkpoint")
    config = f"{tmp}/e2e.yml"
    with open(config, "w", encoding="utf-8") as f:
      yaml.safe_dump({"base_config": str(CONFIGS / "wan_svg_1_3b.yml"), "svg_profile_queries": 16}, f)
    common = [f"pretrained_model_name_or_path={checkpoint}", f"num_inference_steps={steps}",
              f"output_dir={tmp}/out", *VIDEO, *TINY]
    runs = {"dense": ["attention=dot_product"]}
    runs.update({preset: [f"svg_schedule={preset}"] for preset in presets})
    result: dict[str, Any] = {"steps": steps, "video": "33x128x128", "grid": "9x8x8",
                              "tokens": 576, "runs": {}}
    dense_frames = None
    for name, extra in runs.items():
      log(f"generating: {name}...")
      out = generate([config, *common, *extra], tmp)
      frames = out["frames"]
      dense_frames = frames if dense_frames is None else dense_frames
      calls = [r for r in out["log"] if r["kind"] == "self"][-2 * steps:]  # the real run
      row = {"step_s": out["trace"]["denoise_total"] / steps,
             "psnr_db": psnr(frames, dense_frames),
             "sparse_call_share": sum(r["sparse"] for r in calls) / len(calls) if calls else 0.0}
      if name != "dense":
        row["density"] = PRESETS[name].density
        row["sparse_steps"] = sorted({r["step"] for r in calls if r["sparse"]})
      result["runs"][name] = row
  dense_step = result["runs"]["dense"]["step_s"]
  for row in result["runs"].values():
    # A speed-up (above 1 = faster than dense), as every "x" figure in the docs.
    row["speedup_vs_dense"] = dense_step / row["step_s"]
  return result


def format_e2e_bench(result: dict[str, Any]) -> str:
  lines = [f"CPU smoke benchmark on random weights: tiny Wan 2.1 (2 layers, 8 heads of 32), "
           f"{result['video']} video = {result['grid']} = {result['tokens']} tokens, "
           f"{result['steps']} steps, through generate_wan",
           f"{'run':<14}{'density':>8}{'sparse steps':>15}{'sparse calls':>14}{'s/step':>9}"
           f"{'speed-up':>10}{'PSNR dB':>9}"]
  for name, row in result["runs"].items():
    steps = row.get("sparse_steps")
    span = f"[{steps[0]}, {steps[-1] + 1})" if steps else "-"
    density = f"{row['density']:.2f}" if "density" in row else "-"
    quality = "inf" if math.isinf(row["psnr_db"]) else f"{row['psnr_db']:.1f}"
    lines.append(f"{name:<14}{density:>8}{span:>15}{row['sparse_call_share']:>13.0%}"
                 f"{row['step_s']:>9.3f}{row['speedup_vs_dense']:>9.2f}x{quality:>9}")
  return "\n".join(lines)
