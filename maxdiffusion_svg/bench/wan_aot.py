"""Wan 2.1 14B's transformer forward, compiled by libtpu for a TPU slice from any host.

One row per attention kernel (``svg``, and MaxDiffusion's ``flash``, ``ulysses`` and
``ulysses_custom_fixed_m`` at its fast recipe's blocks, for comparison): the model is built by MaxDiffusion's own ``create_sharded_logical_transformer``
from ``configs/wan_svg.yml`` (its ``base_config`` chain merged, ``attention`` replaced per
row), with three loaders replaced so that no weight exists: the Hugging Face config (Wan 2.1
T2V 14B's architecture, optionally fewer layers), the weight reader (each parameter's
shape and final dtype) and the device placement (a ``ShapeDtypeStruct`` carrying the
parameter's ``NamedSharding`` from MaxDiffusion's logical axis rules). The mesh is the one
MaxDiffusion builds from the config's ``ici_*`` parallelism, over the abstract devices of a
TPU topology (``v6e:2x4``: 8 chips on 2 hosts, all on ``context``). The ``svg`` transformer
is prepared by the plugin's create-transformer hook (``register()``), and a 50-step schedule
is written so that the kernel's step is traced from the timestep input: one executable for
the whole denoising loop, holding both the sparse and the dense branch.

MaxDiffusion's jitted ``transformer_forward_pass`` (CFG pair in, guided noise out) is then
lowered on ``ShapeDtypeStruct`` inputs and compiled by libtpu, Mosaic kernels included.
Each row records whether it compiled (else the compiler's error line), per-device memory
from ``memory_analysis()``, compile seconds and the number of Mosaic kernel calls
(``tpu_custom_call``) in the compiled HLO. Nothing runs on a device.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import tempfile
import time
from typing import Any, Callable, Sequence
from unittest import mock

from maxdiffusion_svg.plan.target import MIB
from maxdiffusion_svg.testing.stand_ins import config_loader

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "wan_svg.yml"
KERNELS = ("svg", "flash", "ulysses", "ulysses_custom_fixed_m")
# Keys a kernel's row sets on top of the config: MaxDiffusion's own dense kernel (and its ring)
# runs at its fast Wan recipe (run_wan_fast_inference.sh: these blocks, 64 MiB of scoped VMEM),
# the fastest dense attention a Wan user of MaxDiffusion can pick.
_FAST_RECIPE = {"flash_block_sizes": {
    "block_q": 6400, "block_kv": 2048, "block_kv_compute": 2048, "block_kv_compute_in": 1024,
    "vmem_limit_bytes": 64 * MIB}}
KERNEL_KEYS = {"ulysses_custom_fixed_m": _FAST_RECIPE, "ulysses_ring_custom_fixed_m": _FAST_RECIPE}
MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'

# Wan 2.1 T2V 14B's transformer, as its published Hugging Face config gives it.
WAN_14B = {
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256,
    "ffn_dim": 13824, "num_layers": 40, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}
# Wan 2.1 T2V 1.3B's: 12 heads of 128 (width 1536), its feed-forward and depth.
WAN_1_3B = {**WAN_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}


def architecture_for(config) -> dict[str, Any]:
  """The Wan transformer a MaxDiffusion config loads: the 1.3B by its checkpoint's name, else
  the 14B's (Wan 2.1 14B, and each expert of Wan 2.2 A14B)."""
  name = str(getattr(config, "pretrained_model_name_or_path", "") or "")
  return WAN_1_3B if "1.3b" in name.lower() else WAN_14B


# Wan's VAE: 4x temporal (the first frame alone), 8x spatial compression; 16 channels.
VAE_TEMPORAL, VAE_SPATIAL, LATENT_CHANNELS = 4, 8, 16
NUM_STEPS = 50  # the schedule written into the svg transformer (wan_svg.yml's run)
GUIDANCE_SCALE = 5.0


def latent_shape(frames: int, height: int, width: int) -> tuple[int, int, int, int]:
  """``(channels, frames, height, width)`` of Wan's latent for a pixel video."""
  patch = VAE_SPATIAL * WAN_14B["patch_size"][1]
  if frames < 1 or (frames - 1) % VAE_TEMPORAL:
    raise ValueError(f"frames must be 1 + a multiple of {VAE_TEMPORAL}, got {frames}")
  if height % patch or width % patch:
    raise ValueError(f"height and width must be multiples of {patch}, got {height}x{width}")
  return (LATENT_CHANNELS, (frames - 1) // VAE_TEMPORAL + 1, height // VAE_SPATIAL,
          width // VAE_SPATIAL)


def mosaic_kernels(hlo_text: str) -> int:
  """Mosaic (Pallas TPU) kernel calls in a compiled module's HLO text."""
  return hlo_text.count(MOSAIC_CALL)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.-]+?)(?:\.\d+)?\s*=")


def mosaic_kernel_names(hlo_text: str) -> list[str]:
  """Each Mosaic call's HLO instruction name (the kernel's, e.g. ``splash_mha_fwd_no_residuals``)
  without its numeric suffix, in program order."""
  names = []
  for line in hlo_text.splitlines():
    if MOSAIC_CALL in line:
      found = _INSTRUCTION.match(line)
      names.append(found.group(1) if found else "?")
  return names


# ------------------------------------------------------------------------------- config


def merged_config_file(config_path: str | pathlib.Path, attention: str, directory: str,
                       **keys: Any) -> str:
  """``config_path``'s ``base_config`` chain merged into one YAML with ``attention`` (and
  ``keys``) set, written in ``directory`` for MaxDiffusion's ``pyconfig``."""
  from maxdiffusion_svg.plugin import overlay  # pylint: disable=import-outside-toplevel
  merged, _ = overlay.load_config(config_path)
  merged.update({"attention": attention, "skip_jax_distributed_system": True, **keys})
  return overlay.write_config(merged, f"{directory}/{attention}.yml")


def init_config(config_path: str | pathlib.Path, attention: str, **keys: Any):
  """MaxDiffusion's global config for ``config_path`` with ``attention`` (its logical axis
  rules depend on the kernel, so each kernel gets its own)."""
  from maxdiffusion import pyconfig  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory(prefix="maxdiffusion_svg_aot_") as directory:
    pyconfig.initialize([None, merged_config_file(config_path, attention, directory, **keys)],
                        unittest=True)
  return pyconfig.config


def topology_mesh(config, topology: str):
  """MaxDiffusion's mesh for ``config`` over the abstract devices of a TPU ``topology``."""
  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh
  from maxdiffusion import max_utils

  from maxdiffusion_svg.tpu.aot import topology_devices
  # pylint: enable=import-outside-toplevel
  devices = list(topology_devices(topology))
  array = max_utils.create_device_mesh(config, devices=devices, logging=False)
  return array, Mesh(array, config.mesh_axes)


# -------------------------------------------------------------------- the weightless model


def stand_in_loaders(architecture: dict[str, Any],
                     weight: Callable[..., Any] | None = None) -> tuple[Callable[..., Any],
                                                                       Callable[..., Any]]:
  """Stand-ins for a model's Hugging Face loaders: ``load_config`` returns ``architecture``; the
  weight loader gives each parameter ``weight(name, shape, dtype, index)`` at its final dtype
  (``index``: its place in the parameters sorted by name), by default a ``ShapeDtypeStruct``."""
  # pylint: disable=import-outside-toplevel
  import flax
  import jax
  # pylint: enable=import-outside-toplevel
  weight = weight or (lambda name, shape, dtype, index: jax.ShapeDtypeStruct(shape, dtype))

  def load_weights(_path, eval_shapes, *args, cast_dtype_fn=None, **kwargs):
    del args, kwargs
    flat = flax.traverse_util.flatten_dict(eval_shapes)
    return flax.traverse_util.unflatten_dict({
        name: weight(name, tuple(x.shape), cast_dtype_fn(name) if cast_dtype_fn else x.dtype, i)
        for i, (name, x) in enumerate(sorted(flat.items(), key=lambda kv: str(kv[0])))})

  return config_loader(architecture), load_weights


@contextlib.contextmanager
def weightless_loaders(num_layers: int, architecture: dict[str, Any] | None = None):
  """``create_sharded_logical_transformer`` without weights: ``architecture`` (Wan 14B's by
  default) with ``num_layers`` layers, each parameter a ``ShapeDtypeStruct`` with its final dtype
  and the ``NamedSharding`` the pipeline computed for it."""
  # pylint: disable=import-outside-toplevel
  import flax
  import jax
  from maxdiffusion.pipelines.wan import wan_pipeline
  # pylint: enable=import-outside-toplevel
  load_config, load_weights = stand_in_loaders({**(architecture or WAN_14B),
                                                "num_layers": num_layers})

  def place(state, params, shardings, mesh, restored_checkpoint=None, subfolder=""):
    del mesh, restored_checkpoint, subfolder
    for path, x in flax.traverse_util.flatten_dict(params).items():
      value = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[path].get_value())
      state[path].set_value(value)
    return state

  with mock.patch.object(wan_pipeline.WanModel, "load_config", side_effect=load_config), \
       mock.patch.object(wan_pipeline, "load_wan_transformer", side_effect=load_weights), \
       mock.patch.object(wan_pipeline, "put_params_into_state", side_effect=place):
    yield


def weightless_transformer(config, mesh_devices, num_layers: int, subfolder: str = "transformer"):
  """The pipeline's ``WanModel`` for ``config`` (prepared by the hooks when ``attention`` is
  ``svg``), its parameters abstract and sharded on the mesh; ``subfolder``: Wan 2.2's experts
  are ``transformer`` (high noise) and ``transformer_2`` (low noise)."""
  # pylint: disable=import-outside-toplevel
  from flax import nnx
  from maxdiffusion.pipelines.wan import wan_pipeline
  # pylint: enable=import-outside-toplevel
  array, mesh = mesh_devices
  with weightless_loaders(num_layers, architecture_for(config)), mesh:
    return wan_pipeline.create_sharded_logical_transformer(
        devices_array=array, mesh=mesh, rngs=nnx.Rngs(0), config=config,
        subfolder=subfolder)


def abstract_tree(tree: Any, mesh) -> Any:
  """Every leaf a ``ShapeDtypeStruct`` on ``mesh``: sharded leaves keep their sharding, the
  rest (the svg layer index and schedule, RNG state) are replicated."""
  # pylint: disable=import-outside-toplevel
  import jax
  from jax.sharding import NamedSharding, PartitionSpec
  # pylint: enable=import-outside-toplevel
  replicated = NamedSharding(mesh, PartitionSpec())

  def leaf(x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
      sharding = replicated
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(leaf, tree)


# ---------------------------------------------------------------------------- compiling


def mutable_stores(tree: Any) -> Any:
  """``tree`` with its semantic-store variables (abstract values: a compile-only mesh holds
  no arrays) made new mutable arrays, as a run's are; call inside the trace."""
  # pylint: disable=import-outside-toplevel
  import jax
  from flax import nnx

  from maxdiffusion_svg.plugin import semantic_store
  # pylint: enable=import-outside-toplevel

  def as_ref(var: Any) -> Any:
    return type(var)(var[...], ref=True) if isinstance(var, semantic_store.STORES) else var

  return jax.tree.map(as_ref, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _with_semantic_store(forward: Callable[..., Any]) -> Callable[..., Any]:
  """``forward`` whose model state's semantic store becomes mutable arrays inside the trace
  (:func:`mutable_stores`), so the compiled program reads and writes the centroids as a run
  does."""
  import jax  # pylint: disable=import-outside-toplevel

  def wrapped(graphdef, state, rest, *args, **kwargs):
    return forward(graphdef, state, mutable_stores(rest), *args, **kwargs)

  return jax.jit(wrapped, static_argnames=("do_classifier_free_guidance", "guidance_scale"))


def compile_forward(kernel: str, config_path: str | pathlib.Path = DEFAULT_CONFIG,
                    topology: str = "v6e:2x4", latent: Sequence[int] = (16, 21, 90, 160),
                    batch: int = 2, text_len: int = 512, num_layers: int | None = None,
                    options: dict[str, str] | None = None,
                    log: Callable[[str], None] = print,
                    hlo_dir: str | pathlib.Path | None = None,
                    overrides: dict[str, Any] | None = None,
                    subfolder: str = "transformer") -> dict[str, Any]:
  """One kernel's row (see :func:`compile_wan_forwards`)."""
  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp
  from flax import nnx
  from flax.linen import partitioning as nn_partitioning
  from maxdiffusion.pipelines.wan import wan_pipeline

  from maxdiffusion_svg import plugin
  from maxdiffusion_svg.plugin import hooks, semantic_store
  from maxdiffusion_svg.tpu.aot import abstract, compile_lowered
  # pylint: enable=import-outside-toplevel
  plugin.register()
  config = init_config(config_path, kernel, **(overrides or {}))
  layers = num_layers or architecture_for(config)["num_layers"]
  mesh_devices = topology_mesh(config, topology)
  mesh = mesh_devices[1]
  row: dict[str, Any] = {"kernel": kernel, "ok": False, "error": "", "memory": {},
                         "seconds": None, "lower_seconds": None, "mosaic_kernels": None,
                         "mosaic_kernel_names": [], "num_layers": layers, "topology": topology,
                         "mesh": dict(mesh.shape), "latent": tuple(latent), "batch": batch,
                         "text_len": text_len,
                         "flash_min_seq_length": config.flash_min_seq_length}
  start = time.perf_counter()
  model = weightless_transformer(config, mesh_devices, layers, subfolder)
  if kernel == plugin.KERNEL_NAME:
    if not hooks.is_prepared(model):
      raise RuntimeError("the svg transformer was not prepared by the create-transformer hook")
    settings = model.svg_settings
    row["svg"] = settings.summary(settings.svg.target(mesh=mesh))
    # A decreasing schedule makes the kernel's step a traced function of the timestep input.
    hooks.set_denoising_schedule(model, jnp.linspace(999.0, 0.0, NUM_STEPS))
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  state, rest = abstract_tree(state, mesh), abstract_tree(rest, mesh)
  latents = abstract((batch, *latent), jnp.float32, mesh)
  timestep = abstract((batch,), jnp.int32, mesh)
  text = abstract((batch, text_len, WAN_14B["text_dim"]), jnp.float32, mesh)
  forward = getattr(wan_pipeline.transformer_forward_pass, "jitted",
                    wan_pipeline.transformer_forward_pass)
  if semantic_store.refs(model) is not None:
    forward = _with_semantic_store(forward)
  with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
    lowered = forward.lower(graphdef, state, rest, latents, timestep, text,
                            do_classifier_free_guidance=batch > 1,
                            guidance_scale=GUIDANCE_SCALE)
  row["lower_seconds"] = round(time.perf_counter() - start, 1)
  log(f"  {kernel}: built and lowered in {row['lower_seconds']} s; compiling for {topology}...")
  result = compile_lowered(lowered, options)
  row["memory"] = result.memory
  return record_compile(row, result, kernel, hlo_dir, f"wan_{kernel}_{layers}layers", log)


def record_compile(row: dict[str, Any], result: Any, kernel: str,
                   hlo_dir: str | pathlib.Path | None, hlo_name: str,
                   log: Callable[[str], None]) -> dict[str, Any]:
  """``row`` with a compile's outcome (``ok``, ``error``, ``seconds``; compiled: the Mosaic
  kernels in its HLO, which goes to ``hlo_dir/hlo_name.hlo.txt`` when given), logged."""
  row.update(ok=result.ok, error=result.error, seconds=round(result.seconds, 1))
  if result.ok:
    text_hlo = result.executable.as_text()
    row["mosaic_kernels"] = mosaic_kernels(text_hlo)
    row["mosaic_kernel_names"] = mosaic_kernel_names(text_hlo)
    if hlo_dir is not None:
      path = pathlib.Path(hlo_dir) / f"{hlo_name}.hlo.txt"
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text_hlo, encoding="utf-8")
      row["hlo"] = str(path)
  log(f"  {kernel}: {'compiled' if result.ok else 'FAILED'} in {row['seconds']} s"
      f"{'' if result.ok else ': ' + result.error}")
  return row


def compile_wan_forwards(kernels: Sequence[str] = KERNELS,
                         config_path: str | pathlib.Path = DEFAULT_CONFIG,
                         topology: str = "v6e:2x4", frames: int = 81, height: int = 720,
                         width: int = 1280, batch: int = 2, text_len: int = 512,
                         num_layers: int | None = None, options: dict[str, str] | None = None,
                         log: Callable[[str], None] = print,
                         hlo_dir: str | pathlib.Path | None = None,
                         overrides: dict[str, Any] | None = None,
                         subfolder: str = "transformer") -> dict[str, Any]:
  """Wan 2.1 14B's forward compiled for ``topology`` with each attention kernel (with a Wan 2.2
  config, the expert of ``subfolder``: ``transformer`` high noise, ``transformer_2`` low noise).

  ``batch`` 2 is classifier-free guidance's pair; ``num_layers`` (default: the model's 40)
  reduces depth, the layers still one scanned body; ``options`` are XLA TPU compiler flags
  (e.g. ``tpu_aot.vmem_options(65536)``); ``hlo_dir`` keeps each compiled HLO text;
  ``overrides`` are config keys set for every kernel (e.g. ``{"flash_min_seq_length": 0}``,
  which lets cross-attention's 512 text tokens reach ``flash``). Returns ``{"topology",
  "latent", "num_layers", ..., "kernels": {kernel: row}}``; a row has ``kernel, ok, error,
  memory`` (per-device bytes), ``seconds`` (compile), ``lower_seconds`` (build and lower),
  ``mosaic_kernels`` (and their names), ``num_layers, topology, latent``. The compiler's
  failure is a row (``ok`` False, ``error`` its line); an error while building or tracing
  the model (a config or plugin check) propagates.
  """
  latent = latent_shape(frames, height, width)
  layers = num_layers or WAN_14B["num_layers"]
  result: dict[str, Any] = {
      "topology": topology, "config": str(config_path), "video": (frames, height, width),
      "latent": latent, "batch": batch, "text_len": text_len, "num_layers": layers,
      "full_depth": layers == WAN_14B["num_layers"], "options": dict(options or {}),
      "overrides": dict(overrides or {}), "subfolder": subfolder,
      "kernels": {}}
  for kernel in kernels:
    log(f"Wan 2.1 14B forward, attention={kernel}, {layers} layers, latent "
        f"{'x'.join(map(str, latent))}, batch {batch}, on {topology}:")
    # The recipe's blocks unless the caller names its own (a v5e's VMEM holds no 6400 block).
    row = compile_forward(kernel, config_path, topology, latent, batch, text_len, layers,
                          options, log, hlo_dir, {**KERNEL_KEYS.get(kernel, {}), **(overrides or {})},
                          subfolder)
    result["kernels"][kernel] = row
    result["mesh"] = row["mesh"]
  return result


def format_wan_forwards(result: dict[str, Any]) -> str:
  """A markdown table of :func:`compile_wan_forwards`' result (memory per device, MiB)."""
  latent = "x".join(map(str, result["latent"]))
  mesh = ", ".join(f"{k} {v}" for k, v in result.get("mesh", {}).items())
  depth = (f"{result['num_layers']} layers" + ("" if result.get("full_depth")
                                                else " (reduced from 40)"))
  lines = [f"Wan 2.1 14B forward compiled for {result['topology']} (mesh {mesh}): {depth}, "
           f"scan; latent {latent}, batch {result['batch']} (CFG), {result['text_len']} text "
           f"tokens; per-device memory from memory_analysis()",
           "",
           "| kernel | compiles | arguments MiB | outputs MiB | temp MiB | compile s "
           "| Mosaic kernels | error |",
           "|---|---|---|---|---|---|---|---|"]
  for name, row in result["kernels"].items():
    error = row["error"].replace("|", "\\|") if row["error"] else ""
    kernels = "-" if row["mosaic_kernels"] is None else str(row["mosaic_kernels"])
    lines.append(f"| {name} | {'yes' if row['ok'] else 'no'} | {mib(row, 'argument')} "
                 f"| {mib(row, 'output')} | {mib(row, 'temp')} | {row['seconds']} | {kernels} "
                 f"| {error} |")
  named = [f"{name}: " + ", ".join(f"{n}x {k}" for k, n in _counts(row["mosaic_kernel_names"]))
           for name, row in result["kernels"].items() if row["mosaic_kernel_names"]]
  if named:
    lines += ["", "Mosaic kernels by name: " + "; ".join(named) + "."]
  short = sorted({row["flash_min_seq_length"] for row in result["kernels"].values()
                  if result["text_len"] < row.get("flash_min_seq_length", 0)})
  if short:
    lines.append(f"Cross-attention ({result['text_len']} text tokens) is below "
                 f"flash_min_seq_length {short[0]}: MaxDiffusion's dispatcher runs it as "
                 f"dot_product (for flash, ulysses and svg's dense kernel flash alike).")
  return "\n".join(lines)


def mib(row: dict[str, Any], name: str) -> str:
  """A table cell: ``row``'s memory ``name`` (bytes) in MiB, or ``-``."""
  value = row["memory"].get(name)
  return "-" if value is None else f"{value / MIB:,.1f}"


def _counts(names: Sequence[str]) -> list[tuple[str, int]]:
  counts: dict[str, int] = {}
  for name in names:
    counts[name] = counts.get(name, 0) + 1
  return list(counts.items())
