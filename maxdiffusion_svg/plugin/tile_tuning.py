"""MaxDiffusion's ``enable_tile_search`` keys for ``attention: svg``: our kernel's tiles searched
on the run's chip (:func:`maxdiffusion_svg.tpu.tile_search.search_tiles`) instead of
MaxDiffusion's grid search over ``flash_block_sizes``, which tunes a dense kernel an SVG run's
self-attention does not use.

* :func:`tune_tiles`: the search for a run's raw config keys (no MaxDiffusion, no ``pyconfig``):
  its per-device self-attention call (the video's grid, heads and batch per device as the
  pre-flight splits them over the mesh, the density of its sparse steps, its tile mode, head
  width and dtype), on its chip, against the tiles it would otherwise use. Returns the search's
  result, or None where it is skipped (one line says why).
* :func:`tune_for_run`: the same for a MaxDiffusion run, ``enable_tile_search: True`` being the
  switch; the picked tiles become the run's ``svg_block_q``, ``svg_block_kv`` and
  ``svg_block_kv_compute`` in ``config.get_keys()`` (as MaxDiffusion writes its own pick into
  ``flash_block_sizes``) before any transformer is built, so every reader of the settings (the
  transformer's build, the AOT cache's key, the run summary) sees them.
* :func:`tune_block_sizes_hook`: ``generate_wan`` and ``generate_ltx2``'s
  ``maybe_tune_block_sizes`` under ``attention: svg`` (MaxDiffusion's search does not run);
  other kernels' runs go to MaxDiffusion's own. Our VACE main and Wan Animate's ``run`` (whose
  MaxDiffusion main has no search) call :func:`tune_for_run` themselves.
* :func:`tile_search_keys.check_tile_search`: the keys' values, checked before weights load by
  every tool's pre-flight (:func:`config_checks.check_before_weights`).

Nothing here imports MaxDiffusion at import time (only :func:`tune_for_run` and the hook do,
when they run).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
from typing import Any, Callable, Mapping

from maxdiffusion_svg.budgets.config_keys import DEFAULT_NUM_STEPS
from maxdiffusion_svg.plan.target import Target, resolve_backend, target_of
from maxdiffusion_svg.plan.tiling import SplashTiles
from maxdiffusion_svg.plugin import checkpoint, preflight
from maxdiffusion_svg.plugin.settings import KERNEL_NAME, PluginSettings
from maxdiffusion_svg.plugin.video_models import experts_of, grid_of
from maxdiffusion_svg.plugin.tile_search_keys import ENABLE_KEY, search_settings
from maxdiffusion_svg.tpu.tile_search import CallShape, SearchResult, search_tiles

TILE_KEYS = ("svg_block_q", "svg_block_kv", "svg_block_kv_compute")
TIMED_BACKEND = "pallas"  # the kernel search_tiles times


def tile_keys(tiles: SplashTiles) -> dict[str, int]:
  """``tiles`` as the run's ``svg_block_*`` keys."""
  return dict(zip(TILE_KEYS, (tiles.block_q, tiles.block_kv, tiles.block_kv_compute)))


# ------------------------------------------------------------------ the run's call


@dataclasses.dataclass(frozen=True)
class RunCall:
  """What the search times for a run: its per-device self-attention call, on its chip, and the
  tiles it would otherwise use (``expert``: the Wan 2.2 expert whose density it is)."""

  shape: CallShape
  target: Target
  default: SplashTiles
  expert: str | None


def _most_common(values: list[float]) -> float:
  """The value most layers (or heads) run at; the smallest among equals."""
  counts = collections.Counter(values)
  return min(counts, key=lambda d: (-counts[d], d))


def sparse_density(svg: Any, keys: Mapping[str, Any], layers: int) -> tuple[str | None, float]:
  """The expert and density of the run's sparse calls: of Wan 2.2's experts, the one running
  more sparse steps; its per-layer (or per-head) densities' most common one over the sparse
  layers, else its density."""
  experts = experts_of(keys)
  expert = experts[0]
  if len(experts) > 1:
    from maxdiffusion_svg.plugin.wan22 import expert_steps  # pylint: disable=import-outside-toplevel
    split = expert_steps(keys, keys.get("num_inference_steps", DEFAULT_NUM_STEPS))
    expert = max(experts, key=lambda e: svg.schedule.active_steps.within(*split.of(e)))
  budget = svg.budget(expert)
  active = lambda rows: [r for i, r in enumerate(rows)
                         if svg.schedule.active_layers.contains(i)] or list(rows)
  if budget.head_densities is not None:
    rows = budget.head_densities if len(budget.head_densities) > 1 else (
        budget.head_densities * layers)
    return expert, _most_common([d for row in active(rows) for d in row])
  if budget.layer_densities is not None:
    return expert, _most_common(active(budget.layer_densities))
  return expert, budget.density


def run_call(keys: Mapping[str, Any], target: Target, *, devices: int,
             mesh_shape: Mapping[str, int] | None = None,
             env: Mapping[str, str] | None = None) -> tuple[RunCall | None, str]:
  """The run's self-attention call on one of ``devices`` devices (``mesh_shape``: the mesh the
  run builds, else MaxDiffusion's rule for one slice, :func:`preflight.mesh_shape`), or None and
  why the search cannot time it."""
  settings = PluginSettings.from_mapping(keys)
  svg = settings.svg
  shape = checkpoint.model_shape(keys, os.environ if env is None else env)
  for key in ("num_frames", "height", "width"):
    if key not in keys:
      raise ValueError(f"the config has no {key}: the tile search times the run's video")
  grid = grid_of(keys)
  mesh = dict(mesh_shape) if mesh_shape is not None else preflight.mesh_shape(keys, devices)
  batch_size = float(keys.get("per_device_batch_size", 1))
  preflight.check_batch(batch_size, devices)
  ulysses, ring = preflight.check_heads(preflight.Job(
      process_count=1, device_count=devices, local_device_count=devices,
      context_shards=mesh.get("context", 1), heads=shape.heads,
      ulysses_shards=keys.get("ulysses_shards", -1), per_device_batch_size=batch_size))
  if ring > 1:
    return None, (f"ulysses_shards {ulysses} leaves a ring of {ring} sequence shards on this "
                  f"mesh, and the search times whole-sequence calls")
  # The CFG pair of each video, split over the batch axes (MaxDiffusion's activation_batch).
  examples = 2 * int(devices * batch_size)
  batch = max(1, math.ceil(examples / (mesh.get("data", 1) * mesh.get("fsdp", 1))))
  expert, density = sparse_density(svg, keys, shape.layers)
  call = CallShape(grid=grid, batch=batch, heads=shape.heads // ulysses, head_dim=shape.head_dim,
                   dtype=str(keys.get("activations_dtype") or "bfloat16"), density=density,
                   mode=svg.tile_mode.value)
  return RunCall(call, target, svg.tiles_on(target, TIMED_BACKEND), expert), ""


def check_picked(keys: Mapping[str, Any], call: RunCall, picked: SplashTiles) -> None:
  """``picked`` through the checks the run makes of its tiles: the keys, compensation's blocks
  against the key tile, and the kernel's VMEM and SMEM on the sparse and dense plans (the
  sink and compensation's row keys included, which the search's own fit leaves out)."""
  from maxdiffusion_svg.plugin.config_checks import check_kernel  # pylint: disable=import-outside-toplevel
  settings = PluginSettings.from_mapping({**keys, **tile_keys(picked)})
  svg, target = settings.svg, call.target
  settings.compensation_text(target, TIMED_BACKEND)
  grid = call.shape.grid
  check_kernel(settings, {"sparse": svg.plan(grid, call.expert, target, TIMED_BACKEND),
                          "dense": svg.dense_plan(grid, target, TIMED_BACKEND)},
               target, TIMED_BACKEND, call.shape.dtype, call.shape.head_dim)


def _agreed(result: SearchResult) -> SearchResult:
  """Process 0's pick on every process of a multi-host job (each timed its own chip; one
  program must run everywhere)."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.process_count() == 1:
    return result
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  picked = result.picked
  ours = np.asarray([picked.block_q, picked.block_kv, picked.block_kv_compute], np.int32)
  q, kv, step = (int(v) for v in multihost_utils.broadcast_one_to_all(ours))
  agreed = SplashTiles(q, kv, step)
  return result if agreed == picked else dataclasses.replace(result, picked=agreed)


def tune_tiles(config_keys: Mapping[str, Any], *, log: Callable[[str], None],
               cache_path: str | None = None,
               timer: Callable[[SplashTiles], float] | None = None,
               target: Target | None = None, device_kind: str | None = None,
               devices: int | None = None, mesh_shape: Mapping[str, int] | None = None,
               env: Mapping[str, str] | None = None) -> SearchResult | None:
  """Our kernel's tiles for a run, searched on its chip: its raw config keys (a MaxDiffusion
  config's, merged; no ``pyconfig`` needed), whatever ``enable_tile_search`` says (it is the
  run's switch, :func:`tune_for_run`); ``tile_search_mode``, ``tile_search_iters`` and
  ``tile_search_out`` as the run reads them. Logs the search's one line (and a line per
  candidate timed) with ``log`` and returns the result; the caller applies ``result.picked``
  (:func:`tile_keys`). Returns None, said in one line, where the search is skipped: the
  ``svg_block_*`` keys set, no TPU, another executor than ours, a ring mesh, or a pick the run's
  checks refuse.

  ``cache_path``: the cache file (None: ``tile_search_out``'s, else the default cache);
  ``timer(tiles) -> seconds`` replaces the chip's clock (tests); ``target``, ``device_kind``: the
  chip (None: the default device's, under ``svg_vmem_limit_kib``); ``devices``,
  ``mesh_shape``: the job's device count and mesh, which set the call's heads and batch per
  device (None: this host's devices, the mesh MaxDiffusion builds on one slice of them: pass the
  job's, e.g. ``devices=8``, to search a v6e-8's call on one chip); ``env``: where the
  checkpoint's config is looked up (``HF_HUB_OFFLINE``)."""
  keys = dict(config_keys)
  search = search_settings({**keys, ENABLE_KEY: True})
  settings = PluginSettings.from_mapping(keys)
  svg = settings.svg
  given = {k: keys[k] for k in TILE_KEYS if keys.get(k)}
  if given:
    named = ", ".join(f"{k}={v}" for k, v in given.items())
    log(f"svg tile search: skipped, the tiles are set ({named}): the run uses them; set "
        f"{' and '.join(given)} to 0 to search")
    return None
  target = (svg.target(target=target) if target is not None  # under svg_vmem_limit_kib
            else target_of(vmem_limit_kib=svg.vmem_limit_kib))
  backend = resolve_backend(svg.backend, target)
  if not target.is_tpu:
    log(f"svg tile search: skipped, it times the TPU kernel and this run is on "
        f"{target.platform}: the run keeps its tiles {svg.tiles_on(target, backend).label()}")
    return None
  if backend != TIMED_BACKEND:
    log(f"svg tile search: skipped, it times our kernel (svg_backend pallas) and this run's "
        f"svg_backend is {backend}: the run keeps its tiles "
        f"{svg.tiles_on(target, backend).label()}")
    return None
  if devices is None:
    import jax  # pylint: disable=import-outside-toplevel
    devices = jax.device_count()
  call, why = run_call(keys, target, devices=devices, mesh_shape=mesh_shape, env=env)
  if call is None:
    log(f"svg tile search: skipped, {why}: the run keeps its tiles "
        f"{svg.tiles_on(target, backend).label()}")
    return None
  result = _agreed(search_tiles(call.shape, call.target, call.default, mode=search.mode,
                                calls=search.calls, cache_path=cache_path or search.cache_path,
                                device_kind=device_kind, log=log, timer=timer))
  log(result.line())
  try:
    check_picked(keys, call, result.picked)
  except ValueError as err:
    log(f"svg tile search: the run's checks refuse {result.picked.label()} ({err}): the run "
        f"keeps its tiles {call.default.label()}")
    return None
  return result


# ------------------------------------------------------------------ the MaxDiffusion run


def _run_mesh_shape(config: Any) -> dict[str, int]:
  """The mesh the pipeline will build (MaxDiffusion's rule, every slice's axes)."""
  import jax  # pylint: disable=import-outside-toplevel
  from maxdiffusion import max_utils  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(max_utils.create_device_mesh(config, logging=False), config.mesh_axes)
  return dict(mesh.shape)


def tune_for_run(config: Any, **options: Any) -> SearchResult | None:
  """A MaxDiffusion run's search before its pipeline loads (``config``: ``pyconfig``'s): under
  ``attention: svg`` and ``enable_tile_search: True``, :func:`tune_tiles` on the run's mesh, and
  the pick written into ``config.get_keys()`` as the run's ``svg_block_*`` keys (MaxDiffusion's
  config is read-only by attribute; its own search writes the raw keys too). ``options``: passed
  to :func:`tune_tiles` (tests)."""
  keys = config.get_keys()
  if keys.get("attention") != KERNEL_NAME or not search_settings(keys).enabled:
    return None
  from maxdiffusion import max_logging  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  options.setdefault("log", lambda line: max_logging.log(f"maxdiffusion_svg: {line}"))
  if "mesh_shape" not in options:
    options["mesh_shape"] = _run_mesh_shape(config)
  options.setdefault("devices", jax.device_count())
  result = tune_tiles(keys, **options)
  if result is not None:
    keys.update(tile_keys(result.picked))
  return result


def tune_block_sizes_hook(original: Callable[..., Any]) -> Callable[..., Any]:
  """``maybe_tune_block_sizes(config)`` of ``generate_wan`` and ``generate_ltx2``: our search
  (:func:`tune_for_run`) under ``attention: svg``, MaxDiffusion's for every other kernel."""

  @functools.wraps(original)
  def wrapper(config, *args, **kwargs):
    if getattr(config, "attention", None) != KERNEL_NAME:
      return original(config, *args, **kwargs)
    tune_for_run(config)
    return None

  return wrapper


def tuning_first(original: Callable[..., Any]) -> Callable[..., Any]:
  """A generate main's ``run(config)`` whose MaxDiffusion main has no tile search (Wan
  Animate's): :func:`tune_for_run` first."""

  @functools.wraps(original)
  def wrapper(config, *args, **kwargs):
    tune_for_run(config)
    return original(config, *args, **kwargs)

  return wrapper
