"""Collectives in compiled HLO: how many, and how many bytes each device sends.

Read from ``jitted.lower(...).compile().as_text()``, the per-device program after SPMD
partitioning, so shapes are per-device buffers. Each instruction is counted once, as
written (a collective inside a loop body runs once per iteration but appears once).
Bytes are what one device sends for one execution, under the usual algorithms:

| collective | bytes sent per device |
|---|---|
| all-to-all | result x (g-1)/g: all but its own slice |
| all-gather | result x (g-1)/g: its slice to each of the others |
| reduce-scatter | result x (g-1) (a ring over the g-times-larger operand) |
| all-reduce | 2 x result x (g-1)/g (ring: reduce-scatter, then all-gather) |
| collective-permute | result |

``g`` is the size of the collective's replica group.
"""

from __future__ import annotations

import math
import re

KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def _array_bytes(shape: str) -> list[int]:
  sizes = []
  for dtype, dims in _ARRAY.findall(shape):
    width = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
    if width is None:
      raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
    sizes.append(width * math.prod(int(d) for d in dims.split(",") if d))
  return sizes


def _group_size(rest: str, num_devices: int) -> int:
  """Size of the replica group in any of the printed forms (mesh, iota, explicit list)."""
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
  if mesh:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2)))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
  if iota:
    return int(iota.group(2))
  listed = re.search(r"replica_groups=\{\{([^}]*)\}", rest)
  if listed:
    return len(listed.group(1).split(","))
  return num_devices  # replica_groups={} or absent: every device


_MESH_GROUP = re.compile(r"replica_groups=mesh\[[^\]]*\]\s*\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def collective_ops(hlo_text: str, num_devices: int = 1) -> list[dict[str, object]]:
  """Every collective instruction: ``{"op", "bytes"}`` (sent per device, as in
  :func:`collective_stats`), ``"result_bytes"`` (its result's per device), ``"axes"`` (the mesh axes of its replica group where printed as
  a mesh, else ``[]``) and ``"op_name"`` (the JAX operation it came from, from the metadata;
  a collective XLA inserted to reshard has no ``shard_map`` in it)."""
  ops = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.search(line)
    if not match:
      continue
    op = match.group("op")
    sizes = _array_bytes(match.group("shape"))
    result = max(sizes) if match.group("start") else sum(sizes)
    rest = match.group("rest")
    g = _group_size(rest, num_devices)
    sent = {"all-to-all": result * (g - 1) / g, "all-gather": result * (g - 1) / g,
            "reduce-scatter": result * (g - 1), "all-reduce": 2 * result * (g - 1) / g,
            "collective-permute": result}[op]
    group = _MESH_GROUP.search(rest)
    name = _OP_NAME.search(rest)
    ops.append({"op": op, "bytes": sent, "result_bytes": result,
                "axes": re.findall(r"'([^']+)'", group.group(1)) if group else [],
                "op_name": name.group(1) if name else ""})
  return ops


def collective_stats(hlo_text: str, num_devices: int = 1) -> dict[str, dict[str, float]]:
  """``{kind: {"count": n, "bytes": bytes sent per device}}`` for each collective present.

  ``num_devices`` is the group size of collectives printed without replica groups.
  Asynchronous ``*-start`` forms are counted once (their ``*-done`` is skipped), with the
  largest buffer of their result tuple as the result.
  """
  stats: dict[str, dict[str, float]] = {}
  for row in collective_ops(hlo_text, num_devices):
    entry = stats.setdefault(row["op"], {"count": 0, "bytes": 0.0})
    entry["count"] += 1
    entry["bytes"] += row["bytes"]
  return stats
