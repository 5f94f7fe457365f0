"""On a real TPU: does our kernel's VMEM bound agree with the chip's own compiler at its edge?

    python scripts/chip_vmem_check.py OUT.json [--heads 5] [--topology v5e]

Picks the tiles of our Pallas kernel (Wan 14B's call: 720p, 5 heads, head_dim 128, bfloat16)
that our VMEM bound (``kernel_vmem``, as ``check_fits`` applies it) accepts with the least room
under the chip's default scoped-VMEM limit, and those it refuses with the least excess, about a
dozen in all; compiles each with
``jax.jit(...).lower(...).compile()`` past our check, and records the bound, whether the bound
accepts it, whether the chip's libtpu compiled it, and the first line of its error. A bound
that is right never accepts a tile the compiler refuses ("accepted_but_refused" stays empty);
a refused tile that compiles is room the bound gives away. Prints the JSON and writes it to
OUT.json. Runs on the chip's own JAX (Python 3.11, no tokamax needed); compiles only, runs
nothing. ``--topology CHIP`` compiles for a chip off it with this host's libtpu (a dry run of
the same points; the chip's own libtpu is the judge that counts).
"""

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp

from maxdiffusion_svg.kernels.pallas import pallas_sparse_attention
from maxdiffusion_svg.kernels.tpu_memory import kernel_vmem
from maxdiffusion_svg.plan.geometry import grid_for_resolution
from maxdiffusion_svg.plan.target import target_for_devices
from maxdiffusion_svg.plan.tiles import plan_tiles

MIB = 2 ** 20
RESOLUTION, HEADS, HEAD_DIM, DTYPE = "720p", 5, 128, jnp.bfloat16
BLOCK_Q = (512, 1024, 1536, 2048, 2560, 3072, 3328, 4096, 4608, 5120)
BLOCK_KV = (512, 1024, 1536, 2048, 2560, 3072)
BLOCK_KV_COMPUTE = (256, 512, 1024)
MODES = (("aligned", 1.0), ("aligned", 0.35), ("split", 0.35))
EACH_SIDE = 6  # tiles the bound accepts with the least room, and refuses with the least excess


def first_line(message):
  lines = [line.strip() for line in str(message).splitlines() if line.strip()]
  return lines[0][:300] if lines else ""


SCOPED = re.compile(r"Scoped allocation with size ([\d.]+)([KMG]) and limit ([\d.]+)([KMG])")


def scoped(message):
  """The compiler's 'Scoped allocation with size X and limit Y' clause and X in bytes, if any."""
  found = SCOPED.search(" ".join(str(message).split()))
  if not found:
    return "", None
  size = float(found.group(1)) * {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}[found.group(2)]
  return found.group(0), int(size)


def candidates(grid, target):
  """Every (tiles, mode) the grid takes, with our bound; the bound's edge on both sides."""
  limit = target.vmem_limit
  rows = []
  for bq in BLOCK_Q:
    for bkv in BLOCK_KV:
      for bkc in BLOCK_KV_COMPUTE:
        if bkv % bkc:
          continue
        for mode, density in MODES:
          plan = plan_tiles(grid, density, bq, bkv, mode)
          bound = kernel_vmem(plan, HEAD_DIM, DTYPE, bkc, target, "pallas")
          rows.append({"block_q": bq, "block_kv": bkv, "block_kv_compute": bkc, "mode": mode,
                       "density": density, "bound_bytes": int(bound),
                       "accepted": bool(bound <= limit)})
  accepted = sorted((r for r in rows if r["accepted"]), key=lambda r: limit - r["bound_bytes"])
  refused = sorted((r for r in rows if not r["accepted"]), key=lambda r: r["bound_bytes"] - limit)
  return pick(accepted) + pick(refused)


def pick(rows):
  """The first EACH_SIDE tiles of ``rows``, one mode each, the modes taken in turn (the bound
  does not tell them apart, the compiler might)."""
  tiles = {}
  for row in rows:
    tiles.setdefault((row["block_q"], row["block_kv"], row["block_kv_compute"]), []).append(row)
  chosen = []
  for same_tile in list(tiles.values())[:EACH_SIDE]:
    mode = MODES[len(chosen) % len(MODES)]
    chosen.append(next((r for r in same_tile if (r["mode"], r["density"]) == mode), same_tile[0]))
  return chosen


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out", help="where the JSON goes (it is printed too)")
  parser.add_argument("--heads", type=int, default=HEADS, help="heads per call (Wan 14B: 5)")
  parser.add_argument("--topology", default="",
                      help="off a TPU: compile for this chip (v5e, v6e, ...) with this host's libtpu")
  args = parser.parse_args()
  if args.topology:
    from maxdiffusion_svg.tpu.aot import abstract, chip_mesh  # pylint: disable=import-outside-toplevel
    mesh = chip_mesh(args.topology)
    devices = list(mesh.devices.flat)
  else:
    devices = jax.devices()[:1]
    if devices[0].platform != "tpu":
      sys.exit("chip_vmem_check.py runs on a TPU (jax.devices()[0] is %s): its libtpu is the "
               "judge; --topology CHIP compiles for one from here" % devices[0].platform)
  device = devices[0]
  target = target_for_devices(devices)
  limit = target.vmem_limit
  grid = grid_for_resolution(RESOLUTION)
  if args.topology:
    shape = abstract((1, args.heads, grid.tokens, HEAD_DIM), DTYPE, mesh)
  else:
    shape = jax.ShapeDtypeStruct((1, args.heads, grid.tokens, HEAD_DIM), DTYPE)
  try:
    from importlib.metadata import version  # pylint: disable=import-outside-toplevel
    libtpu = version("libtpu")
  except Exception:  # pylint: disable=broad-except
    libtpu = "unknown"
  result = {"device_kind": device.device_kind, "chip": target.chip, "libtpu": libtpu,
            "jax": jax.__version__, "limit_bytes": int(limit), "limit_source": target.vmem_source,
            "compile_only": bool(args.topology),
            "call": {"resolution": RESOLUTION, "tokens": grid.tokens, "batch": 1,
                     "heads": args.heads, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
            "rows": []}
  start = time.perf_counter()
  for row in candidates(grid, target):
    plan = plan_tiles(grid, row["density"], row["block_q"], row["block_kv"], row["mode"])
    bkc = row["block_kv_compute"]
    fn = lambda q, k, v, plan=plan, bkc=bkc: pallas_sparse_attention(
        q, k, v, plan, 0.1, interpret=False, block_kv_compute=bkc)
    began = time.perf_counter()
    try:
      jax.jit(fn).lower(shape, shape, shape).compile()
      row.update(compiled=True, error="", scoped="", scoped_bytes=None)
    except Exception as err:  # pylint: disable=broad-except
      sentence, size = scoped(err)
      row.update(compiled=False, error=first_line(err), scoped=sentence, scoped_bytes=size)
    row["compile_s"] = round(time.perf_counter() - began, 1)
    row["bound_mib"] = round(row["bound_bytes"] / MIB, 2)
    result["rows"].append(row)
    print("%dx%d/%d %s %.2f: bound %.2f MiB %s, %s (%.1f s) %s" % (
        row["block_q"], row["block_kv"], bkc, row["mode"], row["density"], row["bound_mib"],
        "accepted" if row["accepted"] else "refused",
        "compiled" if row["compiled"] else "refused by libtpu", row["compile_s"],
        row["scoped"]), file=sys.stderr, flush=True)
  rows = result["rows"]
  result["accepted_but_refused"] = [
      "%dx%d/%d %s %g" % (r["block_q"], r["block_kv"], r["block_kv_compute"], r["mode"],
                          r["density"]) for r in rows if r["accepted"] and not r["compiled"]]
  result["refused_but_compiled"] = [
      "%dx%d/%d %s %g" % (r["block_q"], r["block_kv"], r["block_kv_compute"], r["mode"],
                          r["density"]) for r in rows if not r["accepted"] and r["compiled"]]
  result["seconds"] = round(time.perf_counter() - start, 1)
  text = json.dumps(result, indent=1)
  print(text)
  with open(args.out, "w", encoding="utf-8") as out:
    out.write(text + "\n")
  return 1 if result["accepted_but_refused"] else 0


if __name__ == "__main__":
  sys.exit(main())
