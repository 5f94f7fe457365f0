"""The compiler's own schedule as the Splash kernel's cost model (no TPU needed).

Each case (a mode, or the dense baseline: density 1 on the same tiles) is compiled for one
chip in a child process whose ``LIBTPU_INIT_ARGS`` dumps the final schedule (libtpu reads the
flag once, when it loads); :mod:`maxdiffusion_svg.tpu.bundles` reads it back. A call's static
bundles are the plan's tiles priced by their body's bundles, plus each row's initialisation and
finalisation and each grid step's loop overhead, for every head: instruction bundles as
scheduled, a count, not time (no DMA or memory stalls, no clock).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tempfile
from typing import Any, Callable, Sequence

import yaml

from maxdiffusion_svg.bench.schedule_xla import HLO_FILE, price_program
from maxdiffusion_svg.kernels.pallas import unrolled
from maxdiffusion_svg.kernels.tpu_memory import mask_strategy
from maxdiffusion_svg.plan.geometry import VideoGrid, grid_for_resolution
from maxdiffusion_svg.plan.tiles import MODES, TilePlan, plan_tiles
from maxdiffusion_svg.tpu.aot import child_result, libtpu_version, print_result
from maxdiffusion_svg.tpu.bundles import (FIXED_OFFSET_LAYOUT, ONLINE_LAST_LAYOUT, OURS_LAYOUT,
                                          ROW_KEYS_LAYOUT, SPLASH_LAYOUT, KernelSchedule,
                                          ScheduleFormatError, dump_flags, read_dump)

# MaxDiffusion's dense flash attention as its Wan users run it on a v6e: the block sizes its
# base_wan_14b.yml gives for v6e (a commented block, read by maxdiffusion_v6e_blocks where
# MaxDiffusion is importable; this copy otherwise), under the scoped-VMEM limit its README's
# LIBTPU_INIT_ARGS set.
MAXDIFFUSION_V6E_BLOCKS = (3024, 2048, 1024)
MAXDIFFUSION_VMEM_KIB = 65536


def maxdiffusion_v6e_blocks() -> tuple[int, int, int]:
  """(block_q, block_kv, block_kv_compute) of base_wan_14b.yml's "Use on v6e" block, read from
  the importable MaxDiffusion's configs; the copy above where MaxDiffusion is absent."""
  from maxdiffusion_svg.plugin.overlay import maxdiffusion_config_dirs  # pylint: disable=import-outside-toplevel
  for folder in maxdiffusion_config_dirs():
    path = folder / "base_wan_14b.yml"
    if path.is_file():
      return _v6e_blocks(path.read_text(encoding="utf-8"), str(path))
  return MAXDIFFUSION_V6E_BLOCKS


def _v6e_blocks(text: str, where: str) -> tuple[int, int, int]:
  lines = text.splitlines()
  try:
    start = next(i for i, line in enumerate(lines) if line.strip() == "# Use on v6e")
  except StopIteration:
    raise ValueError(f"{where}: no '# Use on v6e' flash_block_sizes block") from None
  body = []
  for line in lines[start + 1:]:
    body.append(line.lstrip("#"))
    if line.strip() == "# }":
      break
  blocks = yaml.safe_load("\n".join(body))["flash_block_sizes"]
  return blocks["block_q"], blocks["block_kv"], blocks["block_kv_compute"]


_HLO_ENV = "SVG_SCHEDULE_HLO"  # where the compile child writes the optimised module's text


@dataclasses.dataclass(frozen=True)
class ScheduleCase:
  """One kernel to compile: a chip, a video grid, a plan's parameters, the VMEM limit."""

  chip: str
  grid: tuple[int, int, int]
  density: float
  mode: str
  block_q: int
  block_kv: int
  block_kv_compute: int
  vmem_limit_kib: int | None = None
  head_dim: int = 128
  # "svg" (ours, by backend), "maxdiffusion_flash" (MaxDiffusion's Splash flash attention),
  # "maxdiffusion_custom_fixed_m" / "maxdiffusion_custom" (its own dense kernel, fixed-m or online)
  kernel: str = "svg"
  backend: str = "splash"  # svg only: "pallas" (ours, the TPU default) or "splash"
  block_kv_compute_in: int | None = None  # MaxDiffusion's custom kernel only
  compensation_blocks: int = 0  # svg only: > 0 compiles the compensated call (compensation.py)
  # svg only: "" the kernel alone; "band" the placed call (placement by a traced flag, the
  # shared plan, restore); "semantic" a semantic head's whole call (clustering, order, table,
  # kernel on its table, restore: maxdiffusion_svg.routing.semantic)
  call: str = ""
  semantic_clusters: int = 32
  semantic_iterations: int = 4
  semantic_group: int = 0  # tokens moved as one; 0: the plugin's (semantic.group_size)

  def plan(self) -> TilePlan:
    include_sink = self.density < 1.0
    return plan_tiles(VideoGrid(*self.grid), self.density, self.block_q, self.block_kv,
                      self.mode, include_sink=include_sink)


def dump_env(directory: str, hlo_env: str, vmem_limit_kib: int | None = None) -> dict[str, str]:
  """A compile child's environment: libtpu dumping its final schedules into ``directory`` (and
  the optimised module's text to ``hlo_env``'s path there), on the CPU."""
  flags = [os.environ.get("LIBTPU_INIT_ARGS", ""), dump_flags(directory)]
  if vmem_limit_kib:
    flags.append(f"--xla_tpu_scoped_vmem_limit_kib={vmem_limit_kib}")
  return {**os.environ, "LIBTPU_INIT_ARGS": " ".join(f for f in flags if f),
          "JAX_PLATFORMS": "cpu", hlo_env: os.path.join(directory, HLO_FILE)}


def compile_case(case: ScheduleCase, directory: str) -> dict[str, Any]:
  """Compiles ``case`` in a child process dumping into ``directory``: ``{ok, error, seconds}``."""
  result, error = child_result(__name__, [json.dumps(dataclasses.asdict(case))],
                               dump_env(directory, _HLO_ENV, case.vmem_limit_kib))
  return result if result is not None else {"ok": False, "error": error, "seconds": 0.0}


def _lower_maxdiffusion_flash(case: ScheduleCase, mesh_devices: Any, tokens: int) -> Any:
  """MaxDiffusion's ``flash`` self-attention of one head, as its Wan attention op calls it."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax.linen import partitioning as nn_partitioning
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
  from jax.sharding import Mesh
  from maxdiffusion import common_types
  from maxdiffusion.models import attention_flax

  from maxdiffusion_svg.tpu.aot import abstract
  # pylint: enable=import-outside-toplevel
  mesh = Mesh(np.array(mesh_devices[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "context", "tensor"))
  rules = ((common_types.BATCH, ("data", "fsdp")), (common_types.SELF_ATTN_HEAD, None),
           (common_types.SELF_ATTN_Q_LENGTH, "context"),
           (common_types.SELF_ATTN_KV_LENGTH, None), (common_types.D_KV, None))
  bq, bkv, bkvc = case.block_q, case.block_kv, case.block_kv_compute
  blocks = splash_attention_kernel.BlockSizes(
      block_q=bq, block_kv_compute=bkvc, block_kv=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
      block_kv_dkv_compute=bkvc, block_q_dq=bq, block_kv_dq=bkv, use_fused_bwd_kernel=False)
  names_q = (common_types.BATCH, common_types.SELF_ATTN_HEAD, common_types.SELF_ATTN_Q_LENGTH,
             common_types.D_KV)
  names_kv = (common_types.BATCH, common_types.SELF_ATTN_HEAD, common_types.SELF_ATTN_KV_LENGTH,
              common_types.D_KV)
  spec = abstract((1, tokens, case.head_dim), jnp.bfloat16, mesh)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(rules):
    return jax.jit(lambda q, k, v: attention_flax._tpu_flash_attention(  # pylint: disable=protected-access
        q, k, v, 1, mesh, names_q, names_kv, blocks, dtype=jnp.bfloat16,
        attention_kernel="flash", use_base2_exp=True)).lower(spec, spec, spec)


def _lower_maxdiffusion_custom(case: ScheduleCase, mesh: Any, tokens: int) -> Any:
  """MaxDiffusion's own dense flash kernel for one head, as its ``ulysses_custom`` (online) or
  ``ulysses_custom_fixed_m`` attention calls it on a device's local heads (inputs padded to
  its blocks, base-2 q, smoothed keys and the per-head gate computed in XLA)."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  from maxdiffusion.kernels import custom_splash_attention as custom

  from maxdiffusion_svg.tpu.aot import abstract
  # pylint: enable=import-outside-toplevel
  fixed = case.kernel == "maxdiffusion_custom_fixed_m"
  blocks = custom._BlockSizes(case.block_q, case.block_kv, case.block_kv_compute,  # pylint: disable=protected-access
                              case.block_kv_compute_in or case.block_kv_compute)
  kernel = custom.make_splash_mha(blocks, orig_q_seq_len=tokens, orig_kv_seq_len=tokens,
                                  use_fixed_m=fixed,
                                  vmem_limit_bytes=(case.vmem_limit_kib or 0) * 1024 or None)
  pad_q = -(-tokens // case.block_q) * case.block_q
  pad_kv = -(-tokens // case.block_kv) * case.block_kv
  q = abstract((1, pad_q, case.head_dim), jnp.bfloat16, mesh)
  kv = abstract((1, pad_kv, case.head_dim), jnp.bfloat16, mesh)
  args = (q, kv, kv) + ((abstract((2, 1), jnp.float32, mesh),) if fixed else ())
  with jax.set_mesh(mesh):  # the kernel asks the mesh in context which TPU it compiles for
    return jax.jit(kernel).lower(*args)


def dump_name(case: ScheduleCase) -> tuple[str, tuple[str, ...]]:
  """The dumped kernel's name and its bodies' layout (:func:`tpu_schedule.parse_kernel`)."""
  if case.kernel.startswith("maxdiffusion_custom"):
    fixed = case.kernel.endswith("fixed_m")
    return "_splash_attention", FIXED_OFFSET_LAYOUT if fixed else ONLINE_LAST_LAYOUT
  if case.kernel == "svg" and case.backend == "pallas":
    # Compensated, the row's closing step runs the row keys' matmuls (once per row).
    row_keys = case.compensation_blocks and case.density < 1
    return "svg_pallas", ROW_KEYS_LAYOUT if row_keys else OURS_LAYOUT
  return "splash", SPLASH_LAYOUT


def _compile_here(case: ScheduleCase) -> dict[str, Any]:
  """The child's side: lower ``sparse_attention`` (or MaxDiffusion's flash) for one chip and
  compile it."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp

  from maxdiffusion_svg.kernels import sparse_attention
  from maxdiffusion_svg.plan.target import target_for_devices
  from maxdiffusion_svg.tpu.aot import abstract, chip_mesh, compile_lowered
  # pylint: enable=import-outside-toplevel
  mesh = chip_mesh(case.chip)
  if case.kernel == "maxdiffusion_flash":
    lowered = _lower_maxdiffusion_flash(case, list(mesh.devices.flat), VideoGrid(*case.grid).tokens)
  elif case.kernel != "svg":
    lowered = _lower_maxdiffusion_custom(case, mesh, VideoGrid(*case.grid).tokens)
  else:
    target = target_for_devices(mesh.devices.flat, case.vmem_limit_kib)
    plan = case.plan()
    spec = abstract((1, 1, plan.seq_len, case.head_dim), jnp.bfloat16, mesh)
    call = sparse_attention
    if case.call:
      call = functools.partial(_placed_call, case=case)
    elif case.compensation_blocks:
      from maxdiffusion_svg.routing.compensation import compensated_attention  # pylint: disable=import-outside-toplevel
      call = functools.partial(compensated_attention, blocks=case.compensation_blocks)
    try:
      lowered = jax.jit(lambda q, k, v: call(
          q, k, v, plan, block_kv_compute=case.block_kv_compute, target=target,
          backend=case.backend)).lower(spec, spec, spec)
    except ValueError as err:  # our VMEM/SMEM refusal, before the compiler
      return {"ok": False, "error": str(err).splitlines()[0], "seconds": 0.0}
  result = compile_lowered(lowered)
  if result.ok and os.environ.get(_HLO_ENV):  # which fusions are twins (schedule_xla.twins)
    with open(os.environ[_HLO_ENV], "w", encoding="utf-8") as f:
      f.write(result.executable.as_text())
  return {"ok": result.ok, "error": result.error, "seconds": round(result.seconds, 1)}


def _placed_call(q: Any, k: Any, v: Any, plan: TilePlan, *, case: ScheduleCase, **kwargs: Any) -> Any:
  """A band or semantic head's whole call (``case.call``), as ``svg_attention`` runs it after
  routing; the band's temporal flag is traced (from the data) so both orders are compiled."""
  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp

  from maxdiffusion_svg.call.attention import placed_attention, semantic_placed_attention
  from maxdiffusion_svg.routing.layouts import LAYOUTS, SEMANTIC
  from maxdiffusion_svg.routing.semantic import SemanticConfig, group_size, semantic_layout
  # pylint: enable=import-outside-toplevel
  grid = VideoGrid(*case.grid)
  if case.call == "band":
    return placed_attention(q, k, v, q[:, :, 0, 0] > 0, grid=grid, plan=plan, **kwargs)
  config = SemanticConfig(case.semantic_clusters, case.semantic_iterations)
  layout = jnp.full(q.shape[:2], LAYOUTS.index(SEMANTIC), jnp.int32)
  return semantic_placed_attention(q, k, v, layout, semantic_layout(q, k, v, plan, config,
                                                                                  group=case.semantic_group or group_size(grid)),
                                   grid=grid, plan=plan, **kwargs)


def static_bundles(kernel: KernelSchedule, full: int, masked: int, rows: int,
                  heads: int = 1, body: str = "full") -> int:
  """Bundles one call issues: every visited tile's body and loop step, every row's init and
  finalisation, for each head. ``body``: the full tiles' body (``online`` prices a
  fixed-offset kernel's heads that fail its gate; ours rescales on each row's first full tile,
  and a tile whose maximum jumps past the headroom, not priced, runs both online bodies)."""
  per_head = (full + masked) * kernel.step_overhead + full * kernel.tile_bundles(body)
  if body == "online":
    per_head += min(rows, full) * (kernel.tile_bundles("online_rescaled") - kernel.tile_bundles(body))
  if masked:
    per_head += masked * kernel.tile_bundles("masked")
  per_head += rows * sum(r.bundles for r in (kernel.row_init, kernel.row_final) if r is not None)
  return heads * per_head


def _tiles(case: ScheduleCase) -> tuple[int, int, int]:
  """(full, masked, rows) the case's kernel runs. MaxDiffusion's flash visits every tile of
  the padded sequence with one body (its padding mask is evaluated in every tile); its custom
  kernel runs a row's last kv block (ragged, sliced) with a body of its own."""
  if case.kernel.startswith("maxdiffusion_custom"):
    tokens = VideoGrid(*case.grid).tokens
    rows, cols = -(-tokens // case.block_q), -(-tokens // case.block_kv)
    return rows * (cols - 1), rows, rows
  if case.kernel == "maxdiffusion_flash":
    tokens = VideoGrid(*case.grid).tokens
    rows = -(-tokens // case.block_q)
    return rows * -(-tokens // case.block_kv), 0, rows
  plan = case.plan()
  return plan.stats.full_tiles, plan.stats.masked_tiles, plan.num_q_tiles


def run_case(case: ScheduleCase, log: Callable[[str], None] = print,
             price_xla: bool = False) -> dict[str, Any]:
  """Compiles one case with its schedule dumped to a temporary folder (removed after); with
  ``price_xla``, also the XLA program around the kernel (``xla``: :func:`schedule_xla.price_program`)."""
  full, masked, rows = _tiles(case)
  row: dict[str, Any] = {"case": dataclasses.asdict(case), "tiles_full": full,
                         "tiles_masked": masked, "tiles_visited": full + masked, "rows": rows}
  if case.kernel == "svg" and case.backend == "pallas" and not unrolled(case.plan(), case.block_kv_compute):
    # The reader prices a region once; a rolled loop's body runs once per kv step.
    row.update(ok=False, seconds=0.0, error=(
        f"not priced: {case.block_q}x{case.block_kv} tiles walk their kv steps in a loop "
        f"(kernels/pallas.py UNROLL_SCORE_BYTES), which the schedule reader counts once; time "
        f"them on a chip (bench chip)"))
    log(f"{case.chip} {case.mode} density {case.density} tiles {case.block_q}x{case.block_kv}/"
        f"{case.block_kv_compute}: {row['error']}")
    return row
  with tempfile.TemporaryDirectory(prefix="svg_schedule_") as directory:
    row.update(compile_case(case, directory))
    if row["ok"]:
      try:
        kernels = read_dump(directory, *dump_name(case))
      except ScheduleFormatError as err:
        row.update(ok=False, error=f"schedule not recognised: {err}")
      else:
        kernel = kernels[-1]
        row["kernel"] = kernel.as_dict()
        row["static_bundles"] = static_bundles(kernel, full, masked, rows)
        if kernel.online is not None:
          row["static_bundles_online"] = static_bundles(kernel, full, masked, rows, body="online")
        if case.kernel == "svg":
          row["masking"] = mask_strategy(case.plan())
        if price_xla:
          try:
            row["xla"] = price_program(directory, dump_name(case)[0])
          except ScheduleFormatError as err:
            row.update(ok=False, error=f"XLA schedule not recognised: {err}")
  log(f"{case.chip} {case.mode} density {case.density} tiles {case.block_q}x{case.block_kv}/"
      f"{case.block_kv_compute}: " + (f"{row['static_bundles']:,} static bundles ({row['seconds']} s)"
                                      if row["ok"] else row["error"]))
  return row


# MaxDiffusion's own dense kernel as a Wan user runs it (block_q, block_kv, block_kv_compute,
# block_kv_compute_in): its fast Wan recipe (run_wan_fast_inference.sh, 64 MiB scoped VMEM) and
# the defaults its code takes for keys a config leaves out.
MAXDIFFUSION_CUSTOM_BLOCKS = {"fast recipe": (6400, 2048, 2048, 1024),
                              "defaults": (4864, 1024, 1024, 1024)}


def maxdiffusion_cases(chip: str, grid: tuple[int, int, int]) -> dict[str, ScheduleCase]:
  """MaxDiffusion's dense kernels a Wan user could pick instead of ours, by name."""
  cases = {"maxdiffusion_flash": ScheduleCase(
      chip, grid, 1.0, "aligned", *maxdiffusion_v6e_blocks(), MAXDIFFUSION_VMEM_KIB,
      kernel="maxdiffusion_flash")}
  for kernel in ("maxdiffusion_custom_fixed_m", "maxdiffusion_custom"):
    for label, (bq, bkv, bkc, bkc_in) in MAXDIFFUSION_CUSTOM_BLOCKS.items():
      cases[f"{kernel} {label}"] = ScheduleCase(chip, grid, 1.0, "aligned", bq, bkv, bkc,
                                                MAXDIFFUSION_VMEM_KIB, kernel=kernel,
                                                block_kv_compute_in=bkc_in)
  return cases


def default_tiles(chip: str, vmem_limit_kib: int | None,
                  backend: str = "splash") -> tuple[int, int, int]:
  from maxdiffusion_svg.plan.target import tpu_target  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plan.tiling import choose_tiles  # pylint: disable=import-outside-toplevel
  tiles = choose_tiles(tpu_target(chip, vmem_limit_kib), backend)
  return tiles.block_q, tiles.block_kv, tiles.block_kv_compute


def mode_cases(chip: str, resolution: str, density: float, tiles: tuple[int, int, int] | None,
               vmem_limit_kib: int | None, backend: str) -> list[tuple[str, ScheduleCase]]:
  """Each traversal mode at ``density``, then the dense baseline (density 1, aligned), on the
  same tiles: the cases every schedule bench prices."""
  grid = grid_for_resolution(resolution)
  block_q, block_kv, kv_compute = tiles or default_tiles(chip, vmem_limit_kib, backend)
  return [(mode, ScheduleCase(chip, grid.shape, dens, "aligned" if mode == "dense" else mode,
                              block_q, block_kv, kv_compute, vmem_limit_kib, backend=backend))
          for mode, dens in [(m, density) for m in MODES] + [("dense", 1.0)]]


def run_schedule_bench(chip: str = "v6e", resolution: str = "720p", density: float = 0.35,
                       tiles: tuple[int, int, int] | None = None,
                       vmem_limit_kib: int | None = None, maxdiffusion: bool = False,
                       backend: str = "pallas",
                       log: Callable[[str], None] = print) -> dict[str, Any]:
  """Each mode and the dense baseline on one chip, by ``backend`` (ours: ``pallas``, or
  ``splash``): bundles per tile kind, static bundles; with ``maxdiffusion``, also MaxDiffusion's
  dense kernels as its Wan users run them (its Splash flash, its own fixed-m and online kernel)."""
  grid = grid_for_resolution(resolution)
  block_q, block_kv, kv_compute = tiles or default_tiles(chip, vmem_limit_kib, backend)
  modes = {mode: run_case(case, log)
           for mode, case in mode_cases(chip, resolution, density, tiles, vmem_limit_kib, backend)}
  if maxdiffusion:
    for name, case in maxdiffusion_cases(chip, grid.shape).items():
      modes[name] = run_case(case, log)
  return {"kind": "compiler-static schedule", "libtpu": libtpu_version(), "chip": chip,
          "resolution": resolution, "grid": list(grid.shape), "tokens": grid.tokens,
          "density": density, "tiles": [block_q, block_kv, kv_compute], "backend": backend,
          "vmem_limit_kib": vmem_limit_kib, "modes": modes}


# Tiles tried by the sweep: Splash's defaults per VMEM limit and their neighbours in each
# direction; ours (one tile for every limit) by kv and q extent at a kv step of 512.
SWEEP_TILES = ((2048, 1536, 256), (3328, 1536, 256), (3328, 1536, 512), (3328, 2816, 256),
               (3328, 2816, 512), (4096, 1536, 256))
PALLAS_SWEEP_TILES = ((3328, 1536, 256), (3328, 1536, 512), (3328, 2048, 512), (3328, 3072, 512),
                      (2560, 2048, 512), (4096, 1536, 512), (4608, 1536, 512), (4608, 2048, 512),
                      (6656, 1536, 512))


def run_tile_sweep(chip: str = "v6e", resolution: str = "720p", density: float = 0.35,
                   limits: Sequence[int | None] | None = None,
                   candidates: Sequence[tuple[int, int, int]] | None = None,
                   backend: str = "splash", log: Callable[[str], None] = print) -> dict[str, Any]:
  """The aligned call (the default mode) per tile choice, and for ours also the dense branch,
  by static bundles: what decides the defaults. Choices our VMEM/SMEM checks refuse are listed
  as refused. Splash is swept at its default limit and 64 MiB; ours at the default only (its
  tile does not follow the limit)."""
  pallas = backend == "pallas"
  limits = limits or ((None,) if pallas else (None, 65536))
  candidates = candidates or (PALLAS_SWEEP_TILES if pallas else SWEEP_TILES)
  grid = grid_for_resolution(resolution)
  rows = []
  for limit in limits:
    for block_q, block_kv, kv_compute in candidates:
      for dens in (density, 1.0) if pallas else (density,):
        case = ScheduleCase(chip, grid.shape, dens, "aligned", block_q, block_kv, kv_compute,
                            limit, backend=backend)
        rows.append(run_case(case, log))
  return {"kind": "compiler-static schedule", "libtpu": libtpu_version(), "chip": chip,
          "resolution": resolution, "grid": list(grid.shape), "density": density,
          "backend": backend,
          "defaults": {str(limit): list(default_tiles(chip, limit, backend)) for limit in limits},
          "rows": rows}


def _main(argv: Sequence[str]) -> None:
  fields = json.loads(argv[1])
  case = ScheduleCase(**{**fields, "grid": tuple(fields["grid"])})
  print_result(_compile_here(case))


if __name__ == "__main__":
  _main(sys.argv)
