"""The hooks on MaxDiffusion's entry points, installed by :func:`installer.install`: the job's
checks (:mod:`preflight`) around each generate main's ``run`` before weights load, a Wan VACE config
handed from ``generate_wan`` to our VACE main, and the SVG settings in the AOT cache's key
(``aot_cache.install``)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable

import jax

from maxdiffusion_svg.parallel.ring_plan import budget_keys
from maxdiffusion_svg.plugin import preflight
from maxdiffusion_svg.plugin.settings import KERNEL_NAME, PluginSettings
from maxdiffusion_svg.plugin.video_models import experts_of


def aot_install(original: Callable[..., Any]) -> Callable[..., Any]:
  """``aot_cache.install`` with the run's SVG settings in the cache's metadata: a compiled
  executable is keyed by them too."""

  @functools.wraps(original)
  def wrapper(cache_dir, meta, mesh):
    from maxdiffusion import pyconfig  # pylint: disable=import-outside-toplevel
    config = pyconfig.config
    if config is not None and attention_of(meta) == KERNEL_NAME:
      meta = {**meta, "svg": repr(PluginSettings.from_mapping(config.get_keys()))}
    return original(cache_dir, meta, mesh)

  return wrapper


def attention_of(meta: dict[str, Any]) -> Any:
  """The ``attention`` key of an AOT cache's metadata: at the top (``generate_wan``) or inside
  its ``config``, a mapping or its JSON text (``generate_ltx2``)."""
  if "attention" in meta:
    return meta["attention"]
  config = meta.get("config")
  if isinstance(config, str):
    try:
      config = json.loads(config)
    except ValueError:
      return None
  return config.get("attention") if isinstance(config, dict) else None


def job_of(config: Any, heads: int, backend: str = "auto", layouts: tuple[str, ...] = (),
           dense_frames: int = 0, budgets: tuple[str, ...] = ()) -> preflight.Job:
  """What :mod:`preflight` checks, read from a MaxDiffusion config: the mesh the pipeline will
  build, its ``ulysses_shards`` and batch, and ``heads`` (the transformer's, from its config.json),
  ``backend``, ``layouts``, ``dense_frames`` and the per-layer and per-head keys set (the
  settings' ``svg_*`` keys)."""
  from maxdiffusion import max_utils  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(max_utils.create_device_mesh(config, logging=False), config.mesh_axes)
  return preflight.Job(process_count=jax.process_count(), device_count=jax.device_count(),
                       local_device_count=jax.local_device_count(),
                       context_shards=mesh.shape.get("context", 1),
                       heads=heads,
                       output_dir=str(config.output_dir or ""), run_name=str(config.run_name or ""),
                       ulysses_shards=config.get_keys().get("ulysses_shards", -1), backend=backend,
                       layouts=layouts, dense_frames=dense_frames, budgets=budgets,
                       per_device_batch_size=float(config.per_device_batch_size))


def preflight_run(original: Callable[..., Any]) -> Callable[..., Any]:
  """A generate main's ``run`` with the job's checks first, where it will load the weights: the
  checks every tool makes (:func:`config_checks.check_before_weights`, the checkpoint's
  config.json downloaded where it is a Hub id), then the job's on its devices. A failure is a
  :class:`preflight.Refusal`."""

  @functools.wraps(original)
  def wrapper(config, *args, **kwargs):
    pipeline = args[0] if args else kwargs.get("pipeline")  # generate_wan_animate takes none
    if pipeline is None and getattr(config, "attention", None) == KERNEL_NAME:  # it will load
      from maxdiffusion_svg.plugin.config_checks import check_before_weights  # pylint: disable=import-outside-toplevel
      keys = config.get_keys()
      try:
        shape = check_before_weights(keys, os.environ, download=True)
        svg = PluginSettings.from_mapping(keys).svg
        budgets = budget_keys(svg, experts_of(keys))
        preflight.check_job(job_of(config, shape.heads, svg.backend, svg.layouts,
                                   svg.dense_frames, budgets), os.environ)
      except ValueError as err:
        raise preflight.Refusal(str(err)) from None
    return original(config, *args, **kwargs)

  return wrapper
