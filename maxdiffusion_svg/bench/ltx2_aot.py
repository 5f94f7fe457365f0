"""LTX-2 19B's transformer forward, compiled by libtpu for a TPU slice from any host.

The LTX-2 counterpart of :mod:`maxdiffusion_svg.bench.wan_aot`: one row per attention kernel and
video size. ``flash`` is LTX-2's default in MaxDiffusion (``ltx2_video.yml``);
``ulysses_custom_fixed_m`` is MaxDiffusion's own dense kernel at its fast Wan recipe's blocks
(``wan_aot.KERNEL_KEYS``), the fastest dense attention it offers; ``svg`` is ours. The model is
built by MaxDiffusion's LTX-2 ``create_sharded_logical_transformer`` from a config
(MaxDiffusion's ``ltx2_video.yml`` unless another is given, ``base_config`` chains merged,
``attention`` replaced per row), with its loaders replaced so that no weight exists: the
Hugging Face config (LTX-2 19B's architecture, :data:`LTX2_19B`, optionally fewer layers), the
weight reader (each parameter's shape and final dtype) and the device placement (a
``ShapeDtypeStruct`` carrying the parameter's ``NamedSharding`` from MaxDiffusion's logical
axis rules). The mesh is MaxDiffusion's, from the config's ``ici_*`` parallelism, over the
abstract devices of a TPU topology (``v6e:2x4``: 8 chips, all on ``context``). The ``svg``
transformer is prepared by the plugin's create-transformer hook (``register()``), and a 40-step
schedule is written so that the kernel's step is traced from the timestep input.

MaxDiffusion's jitted LTX-2 ``transformer_forward_pass`` (video and audio latents of the CFG
pair in, both velocity predictions out) is lowered on ``ShapeDtypeStruct`` inputs, as its
denoising loop calls it, and compiled by libtpu, Mosaic kernels included. Each row records
whether it compiled (else the compiler's error line), per-device memory from
``memory_analysis()``, compile seconds and the Mosaic kernel calls (``tpu_custom_call``) in the
compiled HLO. Nothing runs on a device.

``python -m maxdiffusion_svg.bench.ltx2_aot --help`` runs it from a shell.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import pathlib
import sys
import time
from typing import Any, Callable, Sequence
from unittest import mock

from maxdiffusion_svg.bench.ltx2_model import (CONFIG_NAME, LTX2_19B, TEXT_LEN, FPS, NUM_STEPS,
                                               RESOLUTIONS, default_config, latent_grid,
                                               audio_frames, resolution_video)
from maxdiffusion_svg.bench.wan_aot import (KERNEL_KEYS as WAN_KERNEL_KEYS, _counts,
                                            abstract_tree, init_config, mib, mutable_stores,
                                            record_compile, stand_in_loaders, topology_mesh)

KERNELS = ("flash", "ulysses_custom_fixed_m", "svg")
# MaxDiffusion's fixed-m kernel at its fast recipe (the blocks it ships for Wan; LTX-2 has no
# recipe of its own). flash keeps ltx2_video.yml's own flash_block_sizes. LTX-2 hands its
# attention float32 q and k (its q/k RMSNorm runs in float32) and bfloat16 v: at these blocks
# the fixed-m kernel then needs more scoped VMEM than the compiler has (libtpu 0.0.50.1, v6e:
# 80.41M of 79.00M at 14,080 tokens), a row the compiler refuses.
KERNEL_KEYS = {"ulysses_custom_fixed_m": WAN_KERNEL_KEYS["ulysses_custom_fixed_m"]}


def ltx2_pipeline_module() -> Any:
  """MaxDiffusion's ``ltx2_pipeline``, imported the way its entry points load it: Triton first
  (as the plugin's LTX-2 hooks do), then ``pyconfig``. Imported first on its own, the pipeline
  loads TensorFlow before ``transformers`` loads Triton (through ``torch._dynamo``), whose
  library then segfaults the process (TensorFlow 2.21 with Triton 3.x here)."""
  try:
    importlib.import_module("triton")
  except ImportError:
    pass
  importlib.import_module("maxdiffusion.pyconfig")
  from maxdiffusion.pipelines.ltx2 import ltx2_pipeline  # pylint: disable=import-outside-toplevel
  return ltx2_pipeline


# -------------------------------------------------------------------- the weightless model


class _CompileOnlyJax:
  """``jax`` as the LTX-2 factory sees it while it places weights: one of several processes
  (so each parameter goes through ``device_put_replicated``, replaced below, not a batched
  ``device_put`` of host arrays) with nothing to wait for."""

  def __getattr__(self, name: str) -> Any:
    import jax  # pylint: disable=import-outside-toplevel
    return getattr(jax, name)

  @staticmethod
  def process_count() -> int:
    return 2

  @staticmethod
  def block_until_ready(tree: Any) -> Any:
    return tree


@contextlib.contextmanager
def weightless_loaders(num_layers: int):
  """LTX-2's ``create_sharded_logical_transformer`` without weights: LTX-2 19B's architecture
  with ``num_layers`` layers, each parameter a ``ShapeDtypeStruct`` with its final dtype and
  the ``NamedSharding`` the pipeline computed for it."""
  import jax  # pylint: disable=import-outside-toplevel
  ltx2_pipeline = ltx2_pipeline_module()
  load_config, load_weights = stand_in_loaders({**LTX2_19B, "num_layers": num_layers})

  def place(value, sharding):
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

  model = ltx2_pipeline.LTX2VideoTransformer3DModel
  with mock.patch.object(model, "load_config", side_effect=load_config), \
       mock.patch.object(ltx2_pipeline, "load_transformer_weights", side_effect=load_weights), \
       mock.patch.object(ltx2_pipeline, "device_put_replicated", side_effect=place), \
       mock.patch.object(ltx2_pipeline, "jax", _CompileOnlyJax()):
    yield


def weightless_transformer(config, mesh_devices, num_layers: int, subfolder: str = "transformer"):
  """The pipeline's ``LTX2VideoTransformer3DModel`` for ``config`` (prepared by the hooks when
  ``attention`` is ``svg``), its parameters abstract and sharded on the mesh."""
  # pylint: disable=import-outside-toplevel
  from flax import nnx
  # pylint: enable=import-outside-toplevel
  ltx2_pipeline = ltx2_pipeline_module()
  array, mesh = mesh_devices
  with weightless_loaders(num_layers), mesh:
    return ltx2_pipeline.create_sharded_logical_transformer(
        devices_array=array, mesh=mesh, rngs=nnx.Rngs(0), config=config, subfolder=subfolder)


# ---------------------------------------------------------------------------- compiling


def _with_semantic_store(forward: Any) -> Callable[..., Any]:
  """LTX-2's ``forward`` (``graphdef, state, ...``: the whole model state) with the semantic
  store's abstract values made mutable arrays inside the trace, as a run's are (see
  ``wan_aot._with_semantic_store`` for Wan's split state)."""
  import jax  # pylint: disable=import-outside-toplevel

  def wrapped(graphdef, state, *args, **kwargs):
    return forward.jitted(graphdef, mutable_stores(state), *args, **kwargs)

  return jax.jit(wrapped, static_argnames=forward.static_argnames)


def compile_forward(kernel: str, config_path: str | pathlib.Path | None = None,
                    topology: str = "v6e:2x4", video: Sequence[int] = RESOLUTIONS["720p"],
                    batch: int = 2, text_len: int = TEXT_LEN, num_layers: int | None = None,
                    options: dict[str, str] | None = None,
                    log: Callable[[str], None] = print,
                    hlo_dir: str | pathlib.Path | None = None,
                    overrides: dict[str, Any] | None = None) -> dict[str, Any]:
  """One kernel's row at one video size (see :func:`compile_ltx2_forwards`)."""
  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp
  from flax import nnx
  from flax.linen import partitioning as nn_partitioning

  from maxdiffusion_svg.tpu.aot import abstract, compile_lowered
  # pylint: enable=import-outside-toplevel
  frames, height, width = video
  grid = latent_grid(frames, height, width)
  audio = audio_frames(frames)
  svg = kernel == "svg"
  if svg:  # the flash and fixed-m rows are MaxDiffusion alone: no hook is needed for them
    from maxdiffusion_svg import plugin  # pylint: disable=import-outside-toplevel
    plugin.register()
  keys = {"num_frames": frames, "height": height, "width": width, **(overrides or {})}
  config = init_config(config_path or default_config(), kernel, **keys)
  layers = num_layers or LTX2_19B["num_layers"]
  mesh_devices = topology_mesh(config, topology)
  mesh = mesh_devices[1]
  row: dict[str, Any] = {"kernel": kernel, "ok": False, "error": "", "memory": {},
                         "seconds": None, "lower_seconds": None, "mosaic_kernels": None,
                         "mosaic_kernel_names": [], "num_layers": layers, "topology": topology,
                         "mesh": dict(mesh.shape), "video": (frames, height, width),
                         "latent": grid, "tokens": grid[0] * grid[1] * grid[2],
                         "audio_frames": audio, "batch": batch, "text_len": text_len,
                         "flash_min_seq_length": config.flash_min_seq_length,
                         "flash_block_sizes": dict(config.flash_block_sizes)}
  start = time.perf_counter()
  model = weightless_transformer(config, mesh_devices, layers)
  if svg:
    from maxdiffusion_svg.plugin import hooks  # pylint: disable=import-outside-toplevel
    if not hooks.is_prepared(model):
      raise RuntimeError("the svg transformer was not prepared by the create-transformer hook")
    settings = model.svg_settings
    row["svg"] = settings.summary(settings.svg.target(mesh=mesh))
    # LTX-2's timesteps are its sigmas x 1000, decreasing: the kernel's step is then a traced
    # function of the timestep input.
    hooks.set_denoising_schedule(model, jnp.linspace(1000.0, 1000.0 / NUM_STEPS, NUM_STEPS))
  graphdef, state = nnx.split(model)
  state = abstract_tree(state, mesh)
  dtype = jnp.bfloat16  # the connectors' output (ltx2_video.yml: activations bfloat16)
  latents = abstract((batch, row["tokens"], LTX2_19B["in_channels"]), jnp.float32, mesh)
  audio_latents = abstract((batch, audio, LTX2_19B["audio_in_channels"]), jnp.float32, mesh)
  timestep = abstract((), jnp.float32, mesh)
  text = abstract((batch, text_len, LTX2_19B["caption_channels"]), dtype, mesh)
  mask = abstract((batch, text_len), jnp.bool_, mesh)
  forward = ltx2_pipeline_module().transformer_forward_pass
  from maxdiffusion_svg.plugin import semantic_store  # pylint: disable=import-outside-toplevel
  call = (_with_semantic_store(forward) if semantic_store.refs(model) is not None
          else getattr(forward, "jitted", forward))
  with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
    # as run_diffusion_loop calls it: sigma is the timestep; CFG without STG
    lowered = call.lower(graphdef, state, latents, audio_latents, timestep, text, text, mask,
                         mask, latent_num_frames=grid[0], latent_height=grid[1],
                         latent_width=grid[2], audio_num_frames=audio,
                         fps=float(getattr(config, "fps", FPS)),
                         global_batch_size=max(batch // 2, 1), sigma=timestep,
                         audio_sigma=timestep, use_cross_timestep=False, is_cfg_stg_mode=False)
  row["lower_seconds"] = round(time.perf_counter() - start, 1)
  log(f"  {kernel}: built and lowered in {row['lower_seconds']} s; compiling for {topology}...")
  result = compile_lowered(lowered, options)
  row["memory"] = result.memory
  return record_compile(row, result, kernel, hlo_dir,
                        f"ltx2_{kernel}_{'x'.join(map(str, grid))}_{layers}layers", log)


def compile_ltx2_forwards(kernels: Sequence[str] = KERNELS, num_layers: int | None = 2,
                          resolutions: Sequence[str | Sequence[int]] = ("720p",),
                          log: Callable[[str], None] = print,
                          overrides: dict[str, Any] | None = None,
                          config_path: str | pathlib.Path | None = None,
                          topology: str = "v6e:2x4", batch: int = 2, text_len: int = TEXT_LEN,
                          options: dict[str, str] | None = None,
                          hlo_dir: str | pathlib.Path | None = None) -> dict[str, Any]:
  """LTX-2 19B's forward compiled for ``topology`` with each attention kernel at each video size.

  ``resolutions``: names of :data:`RESOLUTIONS` or ``(frames, height, width)``; ``batch`` 2 is
  classifier-free guidance's pair; ``num_layers`` (None: the model's 48) reduces depth, the
  layers still one scanned body, so per-device temporaries are one layer's; ``config_path``
  (None: MaxDiffusion's ``ltx2_video.yml``) is merged with its bases and each row's
  ``attention``; ``overrides`` are config keys set for every row (``svg_*`` keys among them);
  ``options`` are XLA TPU compiler flags; ``hlo_dir`` keeps each compiled HLO text. Returns
  ``{"topology", "config", "num_layers", ..., "resolutions": {name: {"video", "latent",
  "tokens", "audio_frames", "kernels": {kernel: row}}}}``; a row is :func:`compile_forward`'s
  (``ok, error, memory`` per device in bytes, ``seconds`` to compile, ``lower_seconds`` to build
  and lower, ``mosaic_kernels`` and their names). The compiler's failure is a row; an error
  while building or tracing the model (a config or plugin check) propagates.
  """
  layers = num_layers or LTX2_19B["num_layers"]
  config = config_path or default_config()
  result: dict[str, Any] = {
      "topology": topology, "config": str(config), "num_layers": layers,
      "full_depth": layers == LTX2_19B["num_layers"], "batch": batch, "text_len": text_len,
      "options": dict(options or {}), "overrides": dict(overrides or {}), "resolutions": {}}
  for resolution in resolutions:
    video = resolution_video(resolution)
    name = resolution if isinstance(resolution, str) else "x".join(map(str, video))
    grid = latent_grid(*video)
    entry = {"video": video, "latent": grid, "tokens": grid[0] * grid[1] * grid[2],
             "audio_frames": audio_frames(video[0]), "kernels": {}}
    result["resolutions"][name] = entry
    for kernel in kernels:
      log(f"LTX-2 19B forward, attention={kernel}, {layers} layers, {video[2]}x{video[1]} "
          f"{video[0]} frames (latent {'x'.join(map(str, grid))} = {entry['tokens']:,} tokens, "
          f"{entry['audio_frames']} audio), batch {batch}, on {topology}:")
      row = compile_forward(kernel, config, topology, video, batch, text_len, layers, options,
                            log, hlo_dir, {**(overrides or {}), **KERNEL_KEYS.get(kernel, {})})
      entry["kernels"][kernel] = row
      result["mesh"] = row["mesh"]
  return result


def format_ltx2_forwards(result: dict[str, Any]) -> str:
  """A markdown table of :func:`compile_ltx2_forwards`' result (memory per device, MiB)."""
  mesh = ", ".join(f"{k} {v}" for k, v in result.get("mesh", {}).items())
  depth = (f"{result['num_layers']} layers" + ("" if result.get("full_depth")
                                                else f" (reduced from {LTX2_19B['num_layers']})"))
  lines = [f"LTX-2 19B forward compiled for {result['topology']} (mesh {mesh}): {depth}, scan; "
           f"batch {result['batch']} (CFG), {result['text_len']} text tokens; per-device memory "
           f"from memory_analysis()",
           "",
           "| video | latent (tokens) | kernel | compiles | arguments MiB | outputs MiB | temp MiB "
           "| compile s | Mosaic kernels | error |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  named = []
  for name, entry in result["resolutions"].items():
    frames, height, width = entry["video"]
    latent = f"{'x'.join(map(str, entry['latent']))} ({entry['tokens']:,})"
    for kernel, row in entry["kernels"].items():
      error = row["error"].replace("|", "\\|") if row["error"] else ""
      calls = "-" if row["mosaic_kernels"] is None else str(row["mosaic_kernels"])
      lines.append(f"| {name} ({width}x{height}, {frames} frames) | {latent} | {kernel} "
                   f"| {'yes' if row['ok'] else 'no'} | {mib(row, 'argument')} "
                   f"| {mib(row, 'output')} | {mib(row, 'temp')} | {row['seconds']} | {calls} "
                   f"| {error} |")
      if row["mosaic_kernel_names"]:
        named.append(f"{name} {kernel}: " + ", ".join(
            f"{n}x {k}" for k, n in _counts(row["mosaic_kernel_names"])))
  if named:
    lines += ["", "Mosaic kernels by name: " + "; ".join(named) + "."]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """``python -m maxdiffusion_svg.bench.ltx2_aot [--kernels ...] [--resolutions ...]``."""
  parser = argparse.ArgumentParser(
      prog="python -m maxdiffusion_svg.bench.ltx2_aot",
      description="LTX-2 19B's transformer forward compiled by libtpu for a TPU slice, per "
                  "attention kernel and video size (no TPU needed).")
  parser.add_argument("--kernels", default=",".join(KERNELS),
                      help=f"comma-separated attention kernels (default {','.join(KERNELS)})")
  parser.add_argument("--resolutions", default="720p",
                      help=f"comma-separated, among {', '.join(RESOLUTIONS)} (default 720p)")
  parser.add_argument("--layers", type=int, default=2,
                      help="transformer layers (default 2; 0: the model's 48)")
  parser.add_argument("--config", default=None,
                      help=f"config YAML (default MaxDiffusion's {CONFIG_NAME})")
  parser.add_argument("--topology", default="v6e:2x4")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="a config key for every row (repeatable; the value is YAML)")
  parser.add_argument("--json", default=None, help="also write the result to this file")
  parser.add_argument("--hlo-dir", default=None, help="keep each compiled HLO text here")
  parser.add_argument("--static-schedule", action="store_true",
                      help="instead: self-attention's bound against MaxDiffusion's flash and "
                           "fixed-m kernels by libtpu's static schedule (--config: the svg "
                           "config, default configs/ltx2_svg.yml)")
  args = parser.parse_args(argv)
  log = lambda line: print(line, file=sys.stderr, flush=True)
  resolutions = tuple(args.resolutions.split(","))
  import yaml  # pylint: disable=import-outside-toplevel
  overrides = {}
  for item in args.set:
    key, sep, value = item.partition("=")
    if not sep:
      parser.error(f"--set wants KEY=VALUE, got {item!r}")
    overrides[key] = yaml.safe_load(value)
  if args.static_schedule:
    from maxdiffusion_svg.bench.ltx2_schedule import (  # pylint: disable=import-outside-toplevel
        format_static_schedule_bounds, static_schedule_bounds)
    result = static_schedule_bounds(resolutions, svg_config=args.config, overrides=overrides,
                                    log=log)
    print(format_static_schedule_bounds(result))
  else:
    result = compile_ltx2_forwards(
        kernels=tuple(args.kernels.split(",")), num_layers=args.layers or None,
        resolutions=resolutions, overrides=overrides, config_path=args.config,
        topology=args.topology, hlo_dir=args.hlo_dir, log=log)
    print(format_ltx2_forwards(result))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1, default=str)
  return result


if __name__ == "__main__":
  main()
