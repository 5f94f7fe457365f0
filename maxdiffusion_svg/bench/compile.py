"""``bench compile``: what compiles for which TPU, by libtpu's own word (no TPU needed).

For each TPU generation libtpu knows and each resolution: the Splash kernel of every mode and
the schedule's dense branch with the generation's default tiles, under its default scoped-VMEM
limit; the raised-limit tiles under 64 MiB; the tiles a TPU of unknown generation gets, on
each known one (they must compile on all); the sharded path on a v6e 2x4 slice (40 heads,
batch 1 and the CFG pair). Each row: compiles or not, the compiler's error line, our VMEM and
SMEM estimates against the limits, per-device memory from ``memory_analysis()``, compile time.
``--calibrate`` adds the scoped VMEM the compiler actually allocates for each kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.prepared import prepare_on
from maxdiffusion_svg.kernels import sparse_attention
from maxdiffusion_svg.kernels.tpu_memory import kernel_smem, kernel_vmem
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.geometry import grid_for_resolution
from maxdiffusion_svg.plan.target import (GENERATIONS, GENERIC_TPU, MIB, TPU_BACKENDS,
                                          target_for_devices, tpu_target)
from maxdiffusion_svg.plan.tiles import MODES, plan_tiles
from maxdiffusion_svg.plan.tiling import choose_tiles
from maxdiffusion_svg.tpu.aot import (SINGLE_CHIP, abstract, compile_lowered, chip_mesh,
                                      libtpu_version, scoped_vmem_need, topology_devices,
                                      vmem_options)

RAISED_KIB = 65536


@dataclasses.dataclass(frozen=True)
class CompileBenchConfig:
  chips: tuple[str, ...] = tuple(GENERATIONS)
  resolutions: tuple[str, ...] = ("720p", "1080p", "1440p")
  density: float = 0.3
  local_heads: int = 5  # Wan 14B's 40 heads over an 8-way exchange
  head_dim: int = 128
  sharded: bool = True
  raised: bool = True
  calibrate: bool = False
  unknown: bool = True  # also the unknown generation's tiles on each chip
  backends: tuple[str, ...] = TPU_BACKENDS  # ours (the TPU default), tokamax's

  def __post_init__(self):
    for chip in self.chips:
      if chip not in SINGLE_CHIP:
        raise ValueError(f"--chips must be among {', '.join(SINGLE_CHIP)}, got {chip!r}")
    for resolution in self.resolutions:
      grid_for_resolution(resolution)
    for backend in self.backends:
      if backend not in TPU_BACKENDS:
        raise ValueError(f"--backends must be among {', '.join(TPU_BACKENDS)}, got {backend!r}")


def _row(case: str, chip: str, resolution: str, mode: str, tiles: str, result: Any,
         estimates: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
  return {"case": case, "chip": chip, "resolution": resolution, "mode": mode, "tiles": tiles,
          **result.as_dict(), **(estimates or {}), **extra}


def _kernel_rows(cfg: CompileBenchConfig, chip: str, resolution: str, raised: bool,
                 log: Callable[[str], None], backend: str) -> list[dict[str, Any]]:
  mesh = chip_mesh(chip)
  limit = RAISED_KIB if raised else None
  target = target_for_devices(mesh.devices.flat, limit)
  grid = grid_for_resolution(resolution)
  spec = abstract((1, cfg.local_heads, grid.tokens, cfg.head_dim), jnp.bfloat16, mesh)
  rows = []
  for mode in MODES + ("dense",):
    config = SvgConfig(tile_mode="aligned" if mode == "dense" else mode, density=cfg.density,
                       vmem_limit_kib=limit, backend=backend)
    branch = prepare_on(config, grid, target).host  # one executor: the target is a TPU
    tiles = branch.tiles
    plan, kernel = ((branch.dense_plan, branch.dense_kernel) if mode == "dense"
                    else (branch.plan, branch.kernel))
    fn = lambda q, k, v, kernel=kernel: kernel(q, k, v)
    lowered = jax.jit(fn).lower(spec, spec, spec)
    result = compile_lowered(lowered, vmem_options(limit))
    estimate = kernel_vmem(plan, cfg.head_dim, jnp.bfloat16, tiles.block_kv_compute, target,
                           backend)
    extra = {"backend": backend, "vmem_estimate": estimate, "vmem_limit": target.vmem_limit,
             "smem_estimate": kernel_smem(plan, backend), "smem_limit": target.smem}
    if cfg.calibrate and result.ok:
      need = scoped_vmem_need(lowered)
      extra["vmem_compiler"] = need.bytes if need else None
    label = f"{tiles.block_q}x{tiles.block_kv}/{tiles.block_kv_compute}"
    rows.append(_row("raised" if raised else "default", chip, resolution, mode, label, result,
                     extra))
    log(f"{backend} {chip} {resolution} {mode} {'64 MiB' if raised else 'default'}: "
        f"{'compiles' if result.ok else result.error} ({result.seconds:.0f} s)")
  return rows


def _unknown_rows(cfg: CompileBenchConfig, chip: str, log: Callable[[str], None],
                  backend: str) -> list[dict[str, Any]]:
  """The tiles a TPU of unknown generation gets, compiled on this known one (they must compile
  on every one), under its default limit."""
  mesh = chip_mesh(chip)
  target = target_for_devices(mesh.devices.flat)
  tiles = choose_tiles(tpu_target(GENERIC_TPU), backend)
  grid = grid_for_resolution(cfg.resolutions[0])
  spec = abstract((1, cfg.local_heads, grid.tokens, cfg.head_dim), jnp.bfloat16, mesh)
  rows = []
  for mode in MODES:
    plan = plan_tiles(grid, cfg.density, tiles.block_q, tiles.block_kv, mode)
    fn = lambda q, k, v, plan=plan: sparse_attention(
        q, k, v, plan, block_kv_compute=tiles.block_kv_compute, target=target, backend=backend)
    result = compile_lowered(jax.jit(fn).lower(spec, spec, spec))
    rows.append(_row("unknown-generation tiles", chip, cfg.resolutions[0], mode, tiles.label(),
                     result, {"backend": backend,
                              "vmem_estimate": kernel_vmem(plan, cfg.head_dim, jnp.bfloat16,
                                                           tiles.block_kv_compute, target, backend),
                              "vmem_limit": target.vmem_limit}))
    log(f"{backend} {chip} {cfg.resolutions[0]} {mode} unknown-generation tiles: "
        f"{'compiles' if result.ok else result.error} ({result.seconds:.0f} s)")
  return rows


def _sharded_rows(cfg: CompileBenchConfig, resolution: str,
                  log: Callable[[str], None]) -> list[dict[str, Any]]:
  mesh = Mesh(np.array(topology_devices("v6e:2x4")).reshape(1, 8), ("data", "context"))
  grid = grid_for_resolution(resolution)
  rows = []
  for batch, fold in ((1, True), (2, True), (2, False)):
    spec = abstract((batch, 8 * cfg.local_heads, grid.tokens, cfg.head_dim), jnp.bfloat16, mesh,
                    P("data", None, "context", None))
    fn = lambda q, k, v, fold=fold: sharded_svg_attention(
        q, k, v, mesh=mesh, grid=grid, config=SvgConfig(density=cfg.density),
        key=jax.random.key(0), fold_batch=fold)
    result = compile_lowered(jax.jit(fn).lower(spec, spec, spec))
    t2 = None
    if result.ok:
      t2 = result.executable.as_text().count("T(2,128)")
    rows.append(_row("sharded", "v6e 2x4", resolution, f"batch {batch}" +
                     ("" if fold else ", no fold"), "default", result, t2_tiles=t2))
    log(f"sharded v6e 2x4 {resolution} batch {batch} fold {fold}: "
        f"{'compiles' if result.ok else result.error} ({result.seconds:.0f} s)")
  return rows


def run_compile_bench(cfg: CompileBenchConfig,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
  rows: list[dict[str, Any]] = []
  for backend in cfg.backends:
    for chip in cfg.chips:
      for resolution in cfg.resolutions:
        rows += _kernel_rows(cfg, chip, resolution, False, log, backend)
      # v4 has 16 MiB in all; our kernel's tiles do not change with the limit
      if cfg.raised and backend == "splash" and GENERATIONS[chip].vmem >= RAISED_KIB * 1024:
        rows += _kernel_rows(cfg, chip, cfg.resolutions[0], True, log, backend)
      if cfg.unknown:
        rows += _unknown_rows(cfg, chip, log, backend)
  if cfg.sharded:
    for resolution in cfg.resolutions:
      rows += _sharded_rows(cfg, resolution, log)
  return {"config": dataclasses.asdict(cfg), "jax": jax.__version__, "libtpu": libtpu_version(),
          "rows": rows}


def _mib(value: Any) -> str:
  return "" if value is None else f"{value / MIB:.1f}"


def format_compile_bench(result: dict[str, Any]) -> str:
  """The table: one row per compile, memory in MiB."""
  head = ("| case | chip | video | mode | tiles (q x kv / kv step) | compiles | VMEM est / limit "
          "| compiler VMEM | SMEM est KiB | args | temp | s | compiler's error |")
  lines = [f"Compiled by libtpu {result['libtpu']} (jax {result['jax']}) for TPU topologies on "
           f"this host; memory per device in MiB (measured: compiler).", "", head,
           "|" + "---|" * 13]
  for r in result["rows"]:
    memory = r.get("memory", {})
    vmem = (f"{_mib(r['vmem_estimate'])} / {_mib(r['vmem_limit'])}"
            if "vmem_estimate" in r else "")
    smem = f"{r['smem_estimate'] / 1024:.0f}" if "smem_estimate" in r else ""
    lines.append(
        f"| {r['case']} | {r['chip']} | {r['resolution']} | {r['mode']} | {r['tiles']} | "
        f"{'yes' if r['ok'] else '**no**'} | {vmem} | {_mib(r.get('vmem_compiler'))} | {smem} | "
        f"{_mib(memory.get('argument'))} | {_mib(memory.get('temp'))} | {r['seconds']} | "
        f"{r['error']} |")
  return "\n".join(lines)


def format_compile_summary(result: dict[str, Any]) -> str:
  """One row per chip, limit and resolution: does each mode compile, and what it needs."""
  groups: dict[tuple[str, str, str, str], dict[str, dict[str, Any]]] = {}
  for r in result["rows"]:
    if r["case"] in ("default", "raised"):
      key = (r.get("backend", "splash"), r["chip"], r["case"], r["resolution"])
      groups.setdefault(key, {})[r["mode"]] = r
  lines = ["| kernel | chip | scoped VMEM | video | tiles | naive | split | aligned | dense branch | "
           "VMEM estimate, MiB (mask function / stored) | temp per device, MiB (aligned) | "
           "compile s |", "|" + "---|" * 12]
  mark = lambda r: "compiles" if r["ok"] else "**fails**"
  for (backend, chip, case, resolution), modes in groups.items():
    any_row = next(iter(modes.values()))
    estimates = f"{_mib(modes['split']['vmem_estimate'])} / {_mib(modes['aligned']['vmem_estimate'])}"
    seconds = [m["seconds"] for m in modes.values()]
    lines.append(
        f"| {backend} | {chip} | {_mib(any_row['vmem_limit']).replace('.0', '')} MiB"
        f"{' (raised)' if case == 'raised' else ''} | {resolution} | {any_row['tiles']} | "
        f"{mark(modes['naive'])} | {mark(modes['split'])} | {mark(modes['aligned'])} | "
        f"{mark(modes['dense'])} | {estimates} | "
        f"{_mib(modes['aligned'].get('memory', {}).get('temp'))} | "
        f"{min(seconds):.0f}-{max(seconds):.0f} |")
  unknown = [r for r in result["rows"] if r["case"] == "unknown-generation tiles"]
  if unknown:
    lines += ["", "| kernel | unknown-generation tiles on | video | tiles | mode | compiles | "
              "VMEM estimate / limit, MiB |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.get('backend', 'splash')} | {r['chip']} | {r['resolution']} | {r['tiles']} | "
              f"{r['mode']} | {mark(r)} | "
              f"{_mib(r['vmem_estimate'])} / {_mib(r['vmem_limit'])} |" for r in unknown]
  sharded = [r for r in result["rows"] if r["case"] == "sharded"]
  if sharded:
    lines += ["", "| sharded_svg_attention, v6e 2x4, 40 heads | video | compiles | args MiB | temp MiB "
              "| T(2,128) layouts | compile s |", "|---|---|---|---|---|---|---|"]
    for r in sharded:
      memory = r.get("memory", {})
      lines.append(f"| {r['mode']} | {r['resolution']} | {mark(r)} | "
                   f"{_mib(memory.get('argument'))} | {_mib(memory.get('temp'))} | "
                   f"{r.get('t2_tiles', '')} | {r['seconds']:.0f} |")
  return "\n".join(lines)


def parse_list(text: str | Sequence[str]) -> tuple[str, ...]:
  return tuple(text.split(",")) if isinstance(text, str) else tuple(text)
