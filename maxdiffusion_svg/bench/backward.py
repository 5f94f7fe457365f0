"""One call's gradient compiled for a TPU: which backward a training step should run.

The forward of a TPU call is our Pallas kernel or Splash; its backward can be the portable
flash-style XLA backward (:mod:`maxdiffusion_svg.kernels.backward`: a ``lax.scan`` over the
visited tiles) or tokamax's Splash backward kernel fed the forward's log-sum-exp
(:mod:`maxdiffusion_svg.kernels.splash_backward`). Each case compiles ``jax.grad`` of one
call (``B=1``, a few heads, bf16, the chip's default tiles) with libtpu, dumping its final
schedule, and reports:

- ``temp_mib``: the program's temporaries per device (``memory_analysis``);
- ``forward_bundles``: our forward kernel's static bundles from its plan
  (:func:`maxdiffusion_svg.bench.schedule.static_bundles`);
- ``backward_bundles``: tokamax's kernel priced the same way from its transposed table (every
  visited sub-tile's body and loop step, one step per kv tile no query visits, each kv
  column's init and write-back), or the XLA backward's scan (its body and the fusions it
  calls, times the scan's steps);
- ``xla_bundles``: the rest of the program (padding, casts, the reductions around the kernels),
  :func:`maxdiffusion_svg.bench.schedule_xla.price_program`.

Figures are issue slots as libtpu scheduled them, not times (see
:mod:`maxdiffusion_svg.tpu.bundles`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from maxdiffusion_svg.bench.schedule import dump_env, static_bundles
from maxdiffusion_svg.bench.schedule_xla import price_program
from maxdiffusion_svg.plan.geometry import grid_for_resolution
from maxdiffusion_svg.tpu.aot import child_result, print_result
from maxdiffusion_svg.tpu.bundles import OURS_LAYOUT, ScheduleFormatError, read_dump

VMEM_OUT = pathlib.Path(__file__).resolve().parents[2] / "docs" / "measurements" / \
    "backward_vmem.json"
_HLO_ENV = "SVG_BACKWARD_HLO"  # where the compile child writes the optimised module's text
DKV_KERNEL = "dkv"  # tokamax's backward kernel's dumped name contains it
FORWARD_KERNEL = {"pallas": ("svg_pallas", OURS_LAYOUT), "splash": ("splash_mha_fwd", None)}


@dataclasses.dataclass(frozen=True)
class BackwardCase:
  """One call's gradient: the chip, the forward kernel, the backward (``auto``: tokamax's
  kernel; ``xla``: the scan), the video and band density, and heads per call."""

  chip: str = "v6e"
  backend: str = "pallas"
  backward: str = "auto"
  resolution: str = "720p"
  density: float = 0.3
  heads: int = 5

  def setup(self) -> tuple[Any, Any, Any]:
    """``(target, plan, tiles)``: the chip's default tiles, an aligned plan."""
    # pylint: disable=import-outside-toplevel
    from maxdiffusion_svg.budgets.config import SvgConfig
    from maxdiffusion_svg.call.prepared import prepare
    from maxdiffusion_svg.plan.target import tpu_target
    # pylint: enable=import-outside-toplevel
    config = SvgConfig(tile_mode="aligned", density=self.density, backend=self.backend)
    branch = prepare(config, grid_for_resolution(self.resolution),
                     target=tpu_target(self.chip)).host
    return branch.target, branch.plan, branch.tiles


def _compile_here(case: BackwardCase) -> dict[str, Any]:
  """The child's side: compile ``jax.grad`` of one call for ``case.chip``."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp

  from maxdiffusion_svg.kernels import sparse_attention
  from maxdiffusion_svg.plan.target import target_for_devices
  from maxdiffusion_svg.tpu.aot import abstract, chip_mesh, compile_lowered
  # pylint: enable=import-outside-toplevel
  mesh = chip_mesh(case.chip)
  _, plan, tiles = case.setup()
  target = target_for_devices(mesh.devices.flat)
  x = abstract((1, case.heads, plan.seq_len, 128), jnp.bfloat16, mesh)

  def loss(q, k, v):
    return sparse_attention(q, k, v, plan, block_kv_compute=tiles.block_kv_compute,
                            target=target, backend=case.backend,
                            backward=case.backward).astype(jnp.float32).sum()

  result = compile_lowered(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x))
  out = {"ok": result.ok, "error": result.error, "seconds": round(result.seconds, 1)}
  if result.ok:
    out["temp_mib"] = round(result.executable.memory_analysis().temp_size_in_bytes / 2**20, 1)
    if os.environ.get(_HLO_ENV):
      with open(os.environ[_HLO_ENV], "w", encoding="utf-8") as f:
        f.write(result.executable.as_text())
  return out


def _dkv_tiles(plan: Any, blocks: tuple[int, int, int]) -> tuple[int, int, int, int]:
  """``(full, masked, empty, kv_columns)`` steps of tokamax's backward kernel over ``plan``."""
  # pylint: disable=import-outside-toplevel
  import numpy as np

  from maxdiffusion_svg.kernels.splash_backward import plan_dkv_mask_info
  from maxdiffusion_svg.plan.tiles import EMPTY, FULL
  # pylint: enable=import-outside-toplevel
  info, _ = plan_dkv_mask_info(plan, blocks[0], blocks[1])
  kinds = np.asarray(info.block_mask)
  full, empty = int((kinds == FULL).sum()), int((kinds == EMPTY).sum())
  return full, kinds.size - full - empty, empty, int(np.unique(np.asarray(info.active_rows)).size)


def backward_blocks_of(case: BackwardCase, plan: Any, target: Any) -> tuple[int, int, int]:
  """The backward tiles :func:`maxdiffusion_svg.kernels.sparse_attention` picks for the case."""
  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp

  from maxdiffusion_svg.kernels.splash_backward import backward_tiles
  from maxdiffusion_svg.plan.tiling import default_kv_compute
  # pylint: enable=import-outside-toplevel
  return backward_tiles(plan, default_kv_compute(plan.block_kv), 128, jnp.bfloat16, target)


def price(case: BackwardCase, directory: str) -> dict[str, Any]:
  """The dumped program's static bundles, split as the module docstring says."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.kernels.backward import backward_steps
  # pylint: enable=import-outside-toplevel
  target, plan, _ = case.setup()
  out: dict[str, Any] = {}
  name, layout = FORWARD_KERNEL[case.backend]
  if layout is not None:
    forward = read_dump(directory, name, layout)[-1]
    out["forward_bundles"] = static_bundles(forward, plan.stats.full_tiles,
                                            plan.stats.masked_tiles, plan.num_q_tiles, case.heads)
  if case.backward == "auto":
    kernel = read_dump(directory, DKV_KERNEL)[-1]
    blocks = backward_blocks_of(case, plan, target)
    full, masked, empty, columns = _dkv_tiles(plan, blocks)
    out["backward_kernel"] = kernel.as_dict()
    out["backward_tiles"] = {"blocks": list(blocks), "full": full, "masked": masked,
                             "empty": empty}
    out["backward_bundles"] = (static_bundles(kernel, full, masked, columns, case.heads)
                               + case.heads * empty * kernel.step_overhead)
    out["xla_bundles"] = price_program(directory, (name, DKV_KERNEL))["bundles"]
  else:
    steps = backward_steps(plan, 1, case.heads)
    with_scan = price_program(directory, name, loop_trips=steps)["bundles"]
    without = price_program(directory, name, loop_trips=1)["bundles"]
    out["scan_steps"] = steps
    # The scan's share: what its steps after the first add, plus one step's worth.
    out["backward_bundles"] = (with_scan - without) * steps // (steps - 1) if steps > 1 else without
    out["xla_bundles"] = with_scan - out["backward_bundles"]
  return out


def run_case(case: BackwardCase, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Compiles one case in a child process with its schedule dumped, then prices it."""
  row: dict[str, Any] = {"case": dataclasses.asdict(case)}
  with tempfile.TemporaryDirectory(prefix="svg_backward_") as directory:
    result, error = child_result(__name__, [json.dumps(dataclasses.asdict(case))],
                                 dump_env(directory, _HLO_ENV))
    row.update(result if result is not None else {"ok": False, "error": error})
    if row["ok"]:
      try:
        row.update(price(case, directory))
      except ScheduleFormatError as err:
        row.update(ok=False, error=f"schedule not recognised: {err}")
  log(f"{case.chip} {case.backend} forward, {case.backward} backward: "
      + (f"{row['temp_mib']:,} MiB temporaries, backward {row['backward_bundles']:,} bundles"
         if row["ok"] else row["error"]))
  return row


def run_backward_bench(chip: str = "v6e", backends: Sequence[str] = ("pallas",),
                       resolution: str = "720p", density: float = 0.3, heads: int = 5,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
  """Both backwards behind each forward kernel on one chip."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.tpu.aot import libtpu_version
  # pylint: enable=import-outside-toplevel
  rows = [run_case(BackwardCase(chip, backend, backward, resolution, density, heads), log)
          for backend in backends for backward in ("auto", "xla")]
  return {"kind": "compiled (libtpu), compiler-static schedule", "libtpu": libtpu_version(),
          "chip": chip, "resolution": resolution, "density": density, "heads": heads,
          "rows": rows}


def format_backward_bench(result: dict[str, Any]) -> str:
  """A table: per forward kernel and backward, temporaries and static bundles."""
  lines = [f"One call's gradient, {result['chip']}, {result['resolution']}, density "
           f"{result['density']}, {result['heads']} heads, bf16 (libtpu {result['libtpu']}; "
           f"static bundles are issue slots, not time)",
           "forward | backward | temporaries | backward bundles | rest of the program | "
           "forward kernel"]
  for row in result["rows"]:
    case = row["case"]
    what = "tokamax's kernel" if case["backward"] == "auto" else "XLA scan"
    if not row["ok"]:
      lines.append(f"{case['backend']} | {what} | failed: {row['error']}")
      continue
    forward = row.get("forward_bundles")
    lines.append(f"{case['backend']} | {what} | {row['temp_mib']:,} MiB | "
                 f"{row['backward_bundles']:,} | {row['xla_bundles']:,} | "
                 f"{'-' if forward is None else f'{forward:,}'}")
  return "\n".join(lines)


# The backward kernel's VMEM points per chip: (block_q, block_kv, block_kv_compute, dtype), at
# 720p (tiles under 1024 at 480p, whose tables fit SMEM), head_dim 128, 5 heads, aligned. The
# two families (v5e: 16 MiB, no bf16 VPU; v6e: 32 MiB) get more; the others a few each.
VMEM_POINTS = {
    "v6e": ((3328, 1536, 256, "bfloat16"), (1664, 1536, 256, "bfloat16"),
            (2048, 1024, 128, "bfloat16"), (2048, 1536, 256, "float32")),
    "v5e": ((2048, 1536, 256, "bfloat16"), (1024, 1536, 256, "bfloat16"),
            (1664, 1536, 512, "bfloat16"), (1024, 1536, 256, "float32")),
    "v5p": ((1664, 1536, 256, "bfloat16"), (1024, 1536, 256, "bfloat16")),
    "v4": ((1664, 1536, 256, "bfloat16"), (1024, 1536, 256, "bfloat16")),
    "tpu7x": ((3328, 1536, 256, "bfloat16"), (1664, 1536, 256, "bfloat16")),
}


def measure_backward_vmem(chip: str, block_q: int, block_kv: int, block_kv_compute: int,
                          dtype: str = "bfloat16", heads: int = 5) -> dict[str, Any]:
  """The scoped VMEM libtpu allocates for tokamax's backward kernel at these tiles on one chip
  (:func:`maxdiffusion_svg.tpu.aot.scoped_vmem_need`), beside our bound for it."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp

  from maxdiffusion_svg.kernels.splash_backward import (dkv_vmem_bound,
                                                        splash_sparse_attention_backward)
  from maxdiffusion_svg.plan.target import tpu_target
  from maxdiffusion_svg.plan.tiles import plan_tiles
  from maxdiffusion_svg.tpu.aot import abstract, chip_mesh, scoped_vmem_need
  # pylint: enable=import-outside-toplevel
  mesh = chip_mesh(chip)
  grid = grid_for_resolution("720p" if min(block_q, block_kv) >= 1024 else "480p")
  plan = plan_tiles(grid, 0.3, block_q, block_kv, "aligned")
  x = abstract((1, heads, grid.tokens, 128), jnp.dtype(dtype), mesh)
  rows = abstract((1, heads, grid.tokens), jnp.float32, mesh)
  blocks = (block_q, block_kv, block_kv_compute)
  fn = lambda q, k, v, lse, delta, do: splash_sparse_attention_backward(
      q, k, v, lse, delta, do, plan, 0.088, interpret=False, block_kv_compute=block_kv_compute,
      bwd_blocks=blocks)
  bound = dkv_vmem_bound(blocks, 128, dtype, tpu_target(chip))
  start = time.perf_counter()
  need = scoped_vmem_need(jax.jit(fn).lower(x, x, x, rows, rows, x),
                          start_kib=max(1024, int(bound * 0.8) // 1024))
  return {"chip": chip, "block_q": block_q, "block_kv": block_kv,
          "block_kv_compute": block_kv_compute, "dtype": dtype, "heads": heads,
          "compiler_bytes": None if need is None else need.bytes,
          "exact": None if need is None else need.exact, "bound_bytes": int(bound),
          "seconds": round(time.perf_counter() - start, 1)}


def run_backward_vmem(chips: Sequence[str] = tuple(VMEM_POINTS),
                      log: Callable[[str], None] = print) -> dict[str, Any]:
  """Every chip's points (:data:`VMEM_POINTS`), each in a child process."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.tpu.aot import libtpu_version
  # pylint: enable=import-outside-toplevel
  rows = []
  for chip in chips:
    for bq, bkv, bkc, dtype in VMEM_POINTS[chip]:
      result, error = child_result(__name__, ["--vmem", json.dumps([chip, bq, bkv, bkc, dtype])],
                                   {**os.environ, "JAX_PLATFORMS": "cpu"})
      row = result if result is not None else {
          "chip": chip, "block_q": bq, "block_kv": bkv, "block_kv_compute": bkc, "dtype": dtype,
          "compiler_bytes": None, "error": error}
      rows.append(row)
      need = row["compiler_bytes"]
      log(f"{chip} {bq}x{bkv}/{bkc} {dtype}: " + (
          f"libtpu {need / 2**20:.2f} MiB, bound {row['bound_bytes'] / 2**20:.2f} MiB"
          if need else f"no figure ({row.get('error', 'compile failed')})"))
  return {"kind": "compiled (libtpu): scoped VMEM of tokamax's backward kernel",
          "libtpu": libtpu_version(), "rows": rows}


def _main(argv: Sequence[str]) -> None:
  if argv[1] == "--vmem":
    print_result(measure_backward_vmem(*json.loads(argv[2])))
    return
  case = BackwardCase(**json.loads(argv[1]))
  print_result(_compile_here(case))


if __name__ == "__main__":
  _main(sys.argv)
