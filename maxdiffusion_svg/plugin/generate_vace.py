"""Wan VACE generation: the generate main MaxDiffusion does not ship, over its own
``VaceWanPipeline2_1``.

MaxDiffusion trains Wan VACE (``train_wan_vace``) and has its pipeline, but no main that runs
it; ``python -m maxdiffusion_svg.generate configs/wan_vace_svg.yml`` runs this one, and
``compare`` and ``calibrate`` drive it as they drive ``generate_wan``. It does what
``generate_wan`` does for Wan 2.1: loads the pipeline (a training checkpoint in
``output_dir/run_name/checkpoints`` first, e.g. one ``maxdiffusion_svg.train_vace`` wrote, else the
pretrained weights), keys MaxDiffusion's AOT cache, warms up with two denoising steps, then
generates and writes ``wan_vace_output_<seed>_<i>.mp4`` into the working directory (and under
``output_dir/run_name/videos`` on GCS). The conditions come from the ``vace_*`` keys
(:mod:`vace_inputs`).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Sequence

from maxdiffusion_svg.plugin import hooks_entry, tile_tuning
from maxdiffusion_svg.plugin.vace_inputs import VaceInputs
from maxdiffusion_svg.plugin.video_models import VACE_REFERENCES, WAN_VACE, video_model

OUTPUT = "wan_vace_output"


def export_to_video(video: Any, path: str, fps: int = 16) -> Any:
  """MaxDiffusion's ``export_to_video`` (looked up here, so a tool can watch what is written)."""
  from maxdiffusion.utils import export_to_video as export  # pylint: disable=import-outside-toplevel
  return export(video, path, fps=fps)


def load_pipeline(config: Any) -> Any:
  """The ``VaceWanPipeline2_1`` of ``config``: the latest training checkpoint of the run (as
  ``train_wan_vace`` saves them), else the pretrained weights (through MaxDiffusion's
  ``pretrained_orbax_dir`` cache where set)."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion.checkpointing.wan_vace_checkpointer_2_1 import WanVaceCheckpointer2_1
  from maxdiffusion.pipelines.wan.wan_vace_pipeline_2_1 import VaceWanPipeline2_1
  # pylint: enable=import-outside-toplevel
  loader = WanVaceCheckpointer2_1(config=config)
  step = loader.checkpoint_manager.latest_step()
  if step is not None:
    pipeline, _, _ = loader.load_checkpoint(step)
    return pipeline
  return loader.load_pretrained_pipeline_or_diffusers(
      config, VaceWanPipeline2_1, (("wan_state", "transformer"),), "transformer")


def conditions(config: Any, inputs: VaceInputs) -> dict[str, Any]:
  """The pipeline's ``video``, ``mask`` and ``reference_images`` from the files the keys name:
  the control video and mask resized to the video's size and cut to ``num_frames`` as the
  pipeline rounds it to ``1 + 4k`` (it needs exactly that many frames)."""
  from maxdiffusion.utils.loading_utils import load_image, load_video  # pylint: disable=import-outside-toplevel
  size = (int(config.width), int(config.height))
  frames = pipeline_frames(int(config.num_frames))

  def clip(key: str, source: str) -> list[Any] | None:
    if not source:
      return None
    video = load_video(source)
    if len(video) < frames:
      fits = (len(video) - 1) // WAN_VACE.vae_temporal * WAN_VACE.vae_temporal + 1
      raise ValueError(f"{key} {source!r} has {len(video)} frames; the pipeline generates "
                       f"{frames} (num_frames {config.num_frames}): give a video of at least "
                       f"{frames} frames, or num_frames={fits}")
    return [frame.convert("RGB").resize(size) for frame in video[:frames]]

  references = [load_image(path) for path in inputs.reference_images]
  return {"video": clip("vace_video", inputs.video), "mask": clip("vace_mask", inputs.mask),
          "reference_images": references or None}


def pipeline_frames(num_frames: int) -> int:
  """The frames ``VaceWanPipeline2_1`` generates for ``num_frames``, as its ``__call__`` rounds
  it: ``1 + t·k`` (``t`` the Wan VAE's temporal compression), ``k = num_frames // t`` unless it
  already is, at least 1."""
  step = WAN_VACE.vae_temporal
  if num_frames % step == 1:
    return num_frames
  return max(num_frames // step * step + 1, 1)


def call_pipeline(config: Any, pipeline: Any, prompt: list[str], negative_prompt: list[str],
                  conditioned: dict[str, Any], inputs: VaceInputs,
                  num_inference_steps: int | None = None) -> Any:
  """One generation: the denoised, decoded videos ``[B, F, H, W, 3]`` (uint8)."""
  return pipeline(
      **conditioned, conditioning_scale=inputs.conditioning_scale, prompt=prompt,
      negative_prompt=negative_prompt, height=config.height, width=config.width,
      num_frames=config.num_frames,
      num_inference_steps=num_inference_steps or config.num_inference_steps,
      guidance_scale=config.guidance_scale, use_kv_cache=config.use_kv_cache)


def _install_aot_cache(config: Any, pipeline: Any) -> None:
  """MaxDiffusion's AOT executable cache, keyed as ``generate_wan`` keys it (the plugin adds
  the SVG settings), plus the pipeline's name."""
  import jax  # pylint: disable=import-outside-toplevel
  from maxdiffusion import aot_cache  # pylint: disable=import-outside-toplevel
  aot_cache.install(getattr(config, "aot_cache_dir", ""), meta={
      "model": config.pretrained_model_name_or_path, "pipeline": "VaceWanPipeline2_1",
      "attention": config.attention, "flash_block_sizes": str(config.flash_block_sizes),
      "mesh_shape": str(pipeline.mesh.shape), "weights_dtype": str(config.weights_dtype),
      "activations_dtype": str(config.activations_dtype), "scan_layers": str(config.scan_layers),
      "jax": jax.__version__}, mesh=pipeline.mesh)
  aot_cache.wait_for_loads()


@hooks_entry.preflight_run  # the job's checks where it will load the weights
def run(config: Any, pipeline: Any = None, filename_prefix: str = "",
        commit_hash: str | None = None) -> list[str]:
  """Generates the config's video: loads ``pipeline`` unless given, warms up, generates and
  exports. The paths of the videos written. ``generate_wan.run``'s signature (a VACE config
  reaches it from there, :func:`vace_to_our_main`); ``commit_hash`` is logged."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion import aot_cache, max_logging, max_utils
  # pylint: enable=import-outside-toplevel
  inputs = VaceInputs.from_mapping(config.get_keys())
  if commit_hash:
    max_logging.log(f"MaxDiffusion commit: {commit_hash}")
  load_time = 0.0
  if pipeline is None:
    tile_tuning.tune_for_run(config)  # enable_tile_search, as generate_wan's run does it
    start = time.perf_counter()
    pipeline = load_pipeline(config)
    load_time = time.perf_counter() - start
    max_logging.log(f"load_time: {load_time:.1f}s")
  _install_aot_cache(config, pipeline)
  conditioned = conditions(config, inputs)
  # The pipeline generates one video per call (VaceWanPipeline2_1 refuses a batch).
  prompt, negative_prompt = [config.prompt], [config.negative_prompt]
  max_logging.log(
      f"Wan VACE: {config.num_inference_steps} steps, {config.num_frames}x{config.height}x"
      f"{config.width}, {inputs.reference_frames} reference image(s), control video "
      f"{inputs.video or 'none'}, mask {inputs.mask or 'none'}, conditioning scale "
      f"{inputs.conditioning_scale}")
  start = time.perf_counter()
  with aot_cache.warmup_mode():  # compiles every executable on two steps, computes none
    call_pipeline(config, pipeline, prompt, negative_prompt, conditioned, inputs,
                  num_inference_steps=min(2, int(config.num_inference_steps)))
  aot_cache.save_pending()
  compile_time = time.perf_counter() - start
  max_logging.log(f"compile_time: {compile_time}")
  start = time.perf_counter()
  videos = call_pipeline(config, pipeline, prompt, negative_prompt, conditioned, inputs)
  generation_time = time.perf_counter() - start
  paths = []
  for index, video in enumerate(videos):
    path = f"{filename_prefix}{OUTPUT}_{config.seed}_{index}.mp4"
    export_to_video(video, path, fps=config.fps)
    paths.append(path)
    if str(config.output_dir).startswith("gs://"):
      max_utils.upload_file_to_gcs(os.path.join(config.output_dir, config.run_name), path,
                                   subdir="videos")
  max_logging.log(f"generation_time: {generation_time}")
  max_logging.log(f"Wan VACE timing: load {load_time:.1f}s, compile {compile_time:.1f}s, "
                  f"generation {generation_time:.1f}s; videos {', '.join(paths)}")
  return paths


def main(argv: Sequence[str]) -> None:
  """``generate_wan``'s main for Wan VACE: ``pyconfig`` from ``argv``, then :func:`run`."""
  # pylint: disable=import-outside-toplevel
  import flax
  from maxdiffusion import max_utils, pyconfig
  # pylint: enable=import-outside-toplevel
  pyconfig.initialize(list(argv))
  try:
    flax.config.update("flax_always_shard_variable", False)
  except LookupError:
    pass
  max_utils.ensure_machinelearning_job_runs(pyconfig.config)
  run(pyconfig.config)


def vace_to_our_main(original: Callable[..., Any]) -> Callable[..., Any]:
  """``generate_wan.run`` for a Wan VACE config (one holding ``vace_reference_images``, which
  only our VACE config has): MaxDiffusion's Wan main would load the VACE checkpoint into Wan's
  pipeline and drop its conditions, so the run goes to our VACE main
  (:func:`run`), said in the log. That is how a patched ``python -m
  maxdiffusion.generate configs/wan_vace_svg.yml`` generates VACE."""

  @functools.wraps(original)
  def wrapper(config, *args, **kwargs):
    if video_model(config.get_keys()) is not WAN_VACE:
      return original(config, *args, **kwargs)
    from maxdiffusion import max_logging  # pylint: disable=import-outside-toplevel
    max_logging.log(f"maxdiffusion_svg: a Wan VACE config (it holds {VACE_REFERENCES}): "
                    f"generate_wan runs no VACE, so maxdiffusion_svg.plugin.generate_vace runs it")
    return run(config, *args, **kwargs)

  return wrapper
