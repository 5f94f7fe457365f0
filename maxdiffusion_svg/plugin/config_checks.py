"""The run's own checks on a config, made before it runs: ``tiles --config``'s pre-flight.

Each check calls the function the run calls at that point, so a config passes here exactly
when the run would pass it, and a refusal or warning carries the run's words:

* ``attention``: the hooks prepare a transformer only under ``attention: svg``;
* the ``svg_*`` keys: :meth:`PluginSettings.from_mapping` (``generate_wan.run``, each build);
* with ``enable_tile_search`` on, ``tile_search_mode``, ``tile_search_iters`` and
  ``tile_search_out``: :func:`tile_search_keys.check_tile_search` (``generate_wan.run``);
* the run name: :func:`preflight.check_run_name` (``generate_wan.run``; a warning here, since
  ``JOBSET_NAME`` is the job's to set);
* heads over the mesh's context axis and ``ulysses_shards``: :func:`preflight.mesh_shape`
  (MaxDiffusion's rule), :func:`preflight.check_heads` and
  :func:`preflight.check_backend_on_ring` (``generate_wan.run``), for a ``--slice`` type;
* an empty sparse window: :meth:`PluginSettings.empty_window` (logged at each build);
* a sequence under ``svg_min_seq_length``: :meth:`PluginSettings.is_short` (the first call);
* ``svg_compensation_blocks`` against the key tile on the chip:
  :meth:`PluginSettings.compensation_text` (the create-transformer hook, before weights load);
* the TPU kernel's shapes, VMEM and SMEM: :func:`kernels.api.check_tpu_call` on the sparse
  plan of each model and on the schedule's dense plan (the first call, at trace time); with
  compensation, our kernel's sparse calls also take each row's centroids as extra keys, whose
  blocks are counted in the VMEM need (:func:`kernels.tpu_memory.check_fits`, ``row_keys``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from maxdiffusion_svg.kernels.api import check_tpu_call
from maxdiffusion_svg.kernels.tpu_memory import kernel_smem, kernel_vmem
from maxdiffusion_svg.kernels.worklist import ragged_tables
from maxdiffusion_svg.parallel.ring_plan import budget_keys
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import MIB, TPU_BACKENDS, Target, generation_named
from maxdiffusion_svg.budgets.budget import PER_LAYER
from maxdiffusion_svg.budgets.per_head import check_head_shape
from maxdiffusion_svg.budgets.per_layer import check_layer_count
from maxdiffusion_svg.plugin import checkpoint, preflight, run_summary, tile_search_keys
from maxdiffusion_svg.plugin.calibration_record import check_record
from maxdiffusion_svg.plugin.settings import KERNEL_NAME, PluginSettings
from maxdiffusion_svg.plugin.video_models import FAMILIES, WAN_VACE, experts_of, video_model
from maxdiffusion_svg.routing.compensation import plan_row_keys


class Refused(ValueError):
  """What the run would stop on, with the run's own message."""


def check_attention(config: Mapping[str, Any]) -> None:
  """A config whose ``attention`` is not ``svg`` runs no SVG: nothing here would apply."""
  value = config.get("attention")
  if value != KERNEL_NAME:
    raise ValueError(f"attention is {value!r} in the config: it runs no SVG (the plugin prepares "
                     f"a transformer only under attention: {KERNEL_NAME}); give "
                     f"attention={KERNEL_NAME}")


def check_model(config: Mapping[str, Any], path: str = "") -> None:
  """A config of a model no family of :data:`video_models.FAMILIES` is refused by name
  (MaxDiffusion's main would fail on it far later, or not say why)."""
  model = config.get("model_name")
  if any(model in family.model_names for family in FAMILIES):
    return
  weights = str(config.get("pretrained_model_name_or_path") or "")
  if model is None and ("LTX-Video" in weights or os.path.basename(path) == "ltx_video.yml"):
    raise ValueError(f"{path or 'the config'} is an LTX-Video config: LTX-Video (MaxDiffusion's "
                     f"legacy 13B port, generate_ltx_video) is not supported. Its transformer "
                     f"calls Pallas flash attention directly, not MaxDiffusion's attention "
                     f"kernels, so attention: svg would be ignored; run it with MaxDiffusion's "
                     f"own generate_ltx_video")
  runs = " and ".join(f"{f.name} (model_name {' or '.join(f.model_names)}) through "
                      f"{f.generate_main}" for f in FAMILIES)
  raise ValueError(f"model_name is {model!r}: python -m maxdiffusion_svg.generate runs {runs}")


def check_platforms(env: Mapping[str, str]) -> None:
  """MaxDiffusion loads a checkpoint's weights through JAX's CPU device (and JAX runs host
  callbacks there): a ``JAX_PLATFORMS`` without ``cpu`` is refused before anything loads."""
  platforms = env.get("JAX_PLATFORMS", "")
  if run_summary.host_callbacks_missing(platforms):
    raise ValueError(f"JAX_PLATFORMS={platforms} leaves out cpu, where MaxDiffusion loads the "
                     f"checkpoint's weights (and JAX runs host callbacks): set "
                     f"JAX_PLATFORMS={platforms},cpu, or unset it")


def check_before_weights(keys: Mapping[str, Any], env: Mapping[str, str] | None = None, *,
                         path: str = "", training: bool = False, download: bool = False,
                         layers: int | None = None, heads: int | None = None,
                         by_name: bool = True) -> checkpoint.ModelShape:
  """The checks of a merged config that need its checkpoint, made by every tool (``tiles``,
  the launcher, ``compare``, ``calibrate``) and by the run before weights load: ``JAX_PLATFORMS``
  in ``env`` (:func:`check_platforms`), the model
  family (generation), a calibrated overlay's record against the run
  (:func:`calibration_record.check_record`), with ``enable_tile_search`` on (generation, under
  ``attention: svg``) its ``tile_search_*`` keys (:func:`tile_search_keys.check_tile_search`), the
  checkpoint readable
  (:func:`checkpoint.model_shape`), a VACE checkpoint with a VACE config and only with one, and
  the per-layer and per-head budgets
  against the transformer's layers and heads (``layers``, ``heads``: ``tiles``' flags, over
  the checkpoint's). ``by_name``: check the budgets against a shape by the model's name too
  (where the checkpoint's config.json is not here to read; the launcher leaves that to the
  run, which reads it before weights load). Returns the shape."""
  env = os.environ if env is None else env
  check_platforms(env)
  if not training:
    check_model(keys, path)
    if keys.get("attention") == KERNEL_NAME:  # enable_tile_search and its keys (generation only)
      tile_search_keys.check_tile_search(keys)
  check_record(keys)
  shape = checkpoint.model_shape(keys, env, download)
  given = {k: v for k, v in (("layers", layers), ("heads", heads)) if v is not None}
  if given:
    shape = dataclasses.replace(shape, **given, source=f"{shape.source}; {' and '.join(given)} "
                                f"given with --{' and --'.join(given)}", unread="")
  name, family = keys.get("pretrained_model_name_or_path"), video_model(keys)
  if shape.read and shape.vace_layers and family is not WAN_VACE and not training:
    raise ValueError(f"pretrained_model_name_or_path {name!r} is a Wan VACE checkpoint (its "
                     f"transformer has vace_layers) but the config is {family.name}'s: give a "
                     f"VACE config, e.g. configs/wan_vace_svg.yml (its vace_* keys name the "
                     f"reference images, control video and mask)")
  if shape.read and family is WAN_VACE and not shape.vace_layers:
    raise ValueError(f"pretrained_model_name_or_path {name!r} is not a Wan VACE checkpoint (its "
                     f"transformer has no vace_layers) but the config is Wan VACE's (it holds "
                     f"vace_reference_images): give a VACE checkpoint, e.g. "
                     f"Wan-AI/Wan2.1-VACE-14B-diffusers")
  if keys.get("attention") == KERNEL_NAME and (shape.read or by_name):
    svg = PluginSettings.from_mapping(keys).svg
    try:
      for expert in experts_of(keys):
        budget = svg.budget(expert)
        for what in PER_LAYER:
          check_layer_count(budget.per_layer(what), shape.layers, budget.key(what))
        if budget.head_densities is not None:
          check_head_shape(budget.head_densities, shape.layers, shape.heads, budget.key("head"))
    except ValueError as err:
      if shape.read or given:
        raise
      raise ValueError(f"{err} ({shape.described}: give --layers and --heads where the "
                       f"checkpoint differs, or put its transformer/config.json in the "
                       f"Hugging Face cache: huggingface-cli download {name} "
                       f"transformer/config.json)") from None
  return shape


def _refused(where: str, err: ValueError) -> Refused:
  return Refused(f"the run would stop {where}: {err}")


def check_slice(config: Mapping[str, Any], slice_type: str, heads: int,
                layouts: tuple[str, ...] = (), dense_frames: int = 0,
                budgets: tuple[str, ...] = ()) -> dict[str, Any]:
  """The mesh MaxDiffusion builds on one ``slice_type`` slice and the job checks on its
  context axis against the heads, its ``ulysses_shards``, the ``svg_backend`` and the
  ``svg_layouts`` (a ring leaves semantic out)."""
  devices = preflight.slice_devices(slice_type)
  if devices is None or preflight.slice_generation(slice_type) is None:
    raise ValueError(f"--slice must be a TPU slice type <generation>-<count> (e.g. v6e-8, "
                     f"v6e-16, v5litepod-16, v5p-8, tpu7x-8), got {slice_type!r}")
  try:
    mesh = preflight.mesh_shape(config, devices)
  except ValueError as err:
    raise _refused(f"building its mesh on a {slice_type} ({devices} devices)", err) from None
  context = mesh.get("context", 1)
  job = preflight.Job(process_count=1, device_count=devices, local_device_count=devices,
                      context_shards=context, heads=heads,
                      ulysses_shards=config.get("ulysses_shards", -1),
                      backend=str(config.get("svg_backend", "auto")),
                      layouts=tuple(layouts), dense_frames=dense_frames, budgets=budgets,
                      per_device_batch_size=float(config.get("per_device_batch_size", 1)))
  try:
    preflight.check_batch(job.per_device_batch_size, job.device_count)
    ulysses, ring = preflight.check_heads(job)
    note = preflight.check_ring(job, ulysses, ring)
  except ValueError as err:
    raise _refused(f"before loading weights on a {slice_type}", err) from None
  return {"type": slice_type, "devices": devices, "mesh": mesh, "context_shards": context,
          "ulysses_shards": ulysses, "ring": ring, "heads_per_device": heads // ulysses,
          "layouts_note": note}


def check_kernel(settings: PluginSettings, plans: Mapping[str, Any], target: Target,
                 backend: str, dtype: str, head_dim: int,
                 tables: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
  """Every plan the first call compiles, checked as the run checks it on ``target``: the need
  and the limit of each, or the run's refusal. ``tables``: per plan, the work lists in SMEM
  where heads walk their own (a per-head budget's ragged call), else one."""
  tables = tables or {}
  if backend not in TPU_BACKENDS:
    return []
  kv_compute = settings.svg.tiles(target, backend).block_kv_compute
  # Our kernel's compensated calls read each row's centroids as extra keys (Splash merges them
  # after, outside its kernel); a plan that skips nothing (the dense branch) is not compensated.
  blocks = settings.svg.any_compensation_for(target, backend)
  fits = []
  for name, plan in plans.items():
    # (per-layer compensation: every rung's plan is checked as if compensated, the larger need)
    row_keys = plan_row_keys(plan, blocks) if blocks and backend == "pallas" else 0
    try:
      check_tpu_call(plan, head_dim, dtype, kv_compute, target, backend, row_keys=row_keys,
                     tables=tables.get(name, 1))
    except ValueError as err:
      raise _refused(f"at its first call ({name} plan)", err) from None
    fits.append({"plan": name, "vmem": kernel_vmem(plan, head_dim, dtype, kv_compute, target,
                                                     backend, row_keys),
                 "vmem_limit": target.vmem_limit,
                 "smem": kernel_smem(plan, backend, tables.get(name, 1)),
                 "smem_limit": target.smem, "row_keys": row_keys})
  return fits


def check_config(keys: Mapping[str, Any], settings: PluginSettings, grid: VideoGrid,
                 target: Target, backend: str, plans: Mapping[str, Any], steps: int,
                 shape: checkpoint.ModelShape, slice_type: str | None,
                 per_head: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Every check, in the order the run makes them; raises :class:`Refused` on the first the
  run would stop on. Returns what passed and the warnings. ``per_head``: the per-head budgets
  (:class:`~maxdiffusion_svg.budgets.per_head.HeadBudget`) by the name of the plan that carries
  each one's ragged call, checked with its work list and heads for the (example, head)s a
  device holds (the CFG pair folded into the heads the slice leaves each device; without
  ``--slice``, all of them on one). ``shape``: :func:`check_before_weights`'."""
  heads, layers = shape.heads, shape.layers
  warnings = []
  try:
    preflight.check_run_name(str(keys.get("output_dir") or ""), str(keys.get("run_name") or ""))
  except ValueError as err:
    warnings.append(f"{err} (XPK and our JobSets set JOBSET_NAME; elsewhere the run stops here)")
  mesh = (check_slice(keys, slice_type, heads, settings.svg.layouts, settings.svg.dense_frames,
                      budget_keys(settings.svg, experts_of(keys)))
          if slice_type else None)
  if mesh and mesh["layouts_note"]:
    warnings.append(mesh["layouts_note"])
  try:  # the key tile of the chip's executor: what the transformer's build checks
    compensation = settings.compensation_text(target, backend)
  except ValueError as err:
    where = f"a {slice_type}" if slice_type else target.chip if target.is_tpu else target.platform
    raise _refused(f"before loading weights on {where}", err) from None
  if empty := settings.empty_window(steps, layers):
    warnings.append(empty)
  if settings.is_short(grid.tokens):
    warnings.append(f"self-attention of {grid.tokens:,} tokens is shorter than "
                    f"svg_min_seq_length {settings.min_seq_length}: every call runs dense")
  dtype = str(keys.get("activations_dtype") or "bfloat16")
  local = 2 * (mesh["heads_per_device"] if mesh else heads)  # the CFG pair's (example, head)s
  fits = check_kernel(settings, plans, target, backend, dtype, shape.head_dim,
                      {name: ragged_tables(budget.carrier, local, budget.steps_bound(1, local))
                       for name, budget in (per_head or {}).items()})
  return {"heads": heads, "heads_source": shape.described, "head_dim": shape.head_dim, "dtype": dtype,
          "slice": mesh, "compensation": compensation, "kernel": fits, "warnings": warnings}


# The slice sizes Cloud TPU offers, by the count in the type's name (chips for v5e and v6e;
# TensorCores, two per chip, for v4, v5p and tpu7x), read from Cloud TPU's topology tables:
# v5e and v6e come as 1 chip or 2D tori of 4 to 256 chips; v4 and v5p as 3D tori of 2x2x1,
# 2x2x2, 2x2x4 or 2x4x4 chips, then AxBxC with each side a multiple of 4 (64 chips times any
# count), up to the pod (4,096 and 8,960 chips). TPU7x (9,216 chips a pod) is taken to follow
# v5p's rule, which its topologies share (2x2x1 on one 4-chip VM, ...).
_PLANAR_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)
_CUBE_SMALL = (8, 16, 32, 64)  # TensorCores: 2x2x1, 2x2x2, 2x2x4, 2x4x4 chips
_POD_CORES = {"v4": 8192, "v5p": 17920, "tpu7x": 18432}


def slice_size_ok(generation: str, count: int) -> bool:
  """Whether ``<generation>-<count>`` is a slice size Cloud TPU offers (the table above)."""
  if generation in _POD_CORES:
    return count in _CUBE_SMALL or (count % 128 == 0 and count <= _POD_CORES[generation])
  return count in _PLANAR_SIZES


def slice_chip(slice_type: str | None, chip: str | None) -> str:
  """The chip a pre-flight is for: ``--slice``'s generation (a ``--chip`` must agree), else
  ``--chip``, else v6e."""
  if not slice_type:
    return chip or "v6e"
  generation = preflight.slice_generation(slice_type)
  if generation is None:
    raise ValueError(f"--slice must be a TPU slice type <generation>-<count> (e.g. v6e-8, "
                     f"v6e-16, v5litepod-16, v5p-8, tpu7x-8), got {slice_type!r}")
  prefix, count = slice_type.strip().rsplit("-", 1)
  if not slice_size_ok(generation, int(count)):
    sizes = ", ".join(f"{prefix}-{n}" for n in (_CUBE_SMALL if generation in _POD_CORES
                                                   else _PLANAR_SIZES[:5]))
    raise ValueError(f"--slice {slice_type} is not a {generation} slice size: give one Cloud "
                     f"TPU offers, e.g. {sizes}, ...")
  if chip and generation_named(chip, "--chip").name != generation:
    raise ValueError(f"--chip {chip} contradicts --slice {slice_type} (a {generation} slice): "
                     f"drop --chip (--slice implies it)")
  return generation


def format_fit(fit: Mapping[str, Any]) -> str:
  keys = f" ({fit['row_keys']} row keys included)" if fit.get("row_keys") else ""
  return (f"{fit['plan']} plan {fit['vmem'] / MIB:.1f} of {fit['vmem_limit'] / MIB:g} MiB VMEM"
          f"{keys}, "
          f"{fit['smem'] / 1024:.1f} of {fit['smem_limit'] // 1024} KiB SMEM")
