"""Reading libtpu's final schedule of a Mosaic kernel: a static cost model from the compiler.

Compiled with ``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR``, libtpu writes each kernel's final
VLIW schedule (``*-final_bundles.txt``: one bundle per cycle, conditional regions as branches
to a fallthrough label) and its per-bundle use of each unit
(``*-final_hlo-static-per-bundle-utilization.txt``). For a Splash kernel the conditional
regions inside the grid loop are the row initialisation, the tile bodies (mask-free first,
then masked) and the row finalisation; the rest of the loop runs on every grid step.

What the figures count: issue slots, one bundle per cycle, as scheduled. What they do not:
DMA and memory stalls, synchronisation waits, the clock. They rank tile kinds and modes on
one chip; they are not times.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Any, Sequence

# Pass labels to dump: only the final schedule and its utilisation (a full dump is ~800 MB).
DUMP_PASS_REGEX = "final_"

_BUNDLE = re.compile(r"^\s*0x([0-9a-f]+)\s+(LH|LB|LE|PB|PF)?\s*:")
_BRANCH = re.compile(r"sbr\.rel\s*(?:\([^)]*\))?\s*target = \$region(\d+)")
_FALLTHROUGH = re.compile(r"Start/End empty region (\d+)")
_MATMUL = re.compile(r"\bvmatmul[\w.]*")
_MATMUL_TYPE = re.compile(r"\bvmatmul[\w.]*?\.(bf16|f32|s8|f8\w*)\b")
_EXP = re.compile(r"\bv(?:exp2|pow2)[\w.]*")


class ScheduleFormatError(ValueError):
  """The dump is not in the layout this reader knows (another libtpu version)."""


def dump_flags(directory: str) -> str:
  """``LIBTPU_INIT_ARGS`` for dumping the final schedules into ``directory``."""
  return f"--xla_jf_dump_to={directory} --xla_jf_dump_llo_pass_label_regex={DUMP_PASS_REGEX}"


@dataclasses.dataclass(frozen=True)
class Region:
  """A conditional region: bundles ``[start, end)`` skipped when its branch is taken."""

  start: int
  end: int
  matmuls: int
  exps: int
  matmul_types: tuple[tuple[str, int], ...] = ()  # operand type of the MXU pushes: bf16, f32

  @property
  def bundles(self) -> int:
    return self.end - self.start

  def contains(self, other: "Region") -> bool:
    return self.start <= other.start and other.end <= self.end and self != other


@dataclasses.dataclass(frozen=True)
class KernelSchedule:
  """One Splash kernel's static schedule, split the way its grid executes it."""

  name: str
  total_bundles: int
  full: Region  # the mask-free tile body
  masked: Region | None  # the masked tile body, when the kernel has one
  row_init: Region | None
  row_final: Region | None
  step_overhead: int  # loop bundles outside every region: run on each grid step
  units: tuple[str, ...]
  capacity: tuple[int, ...]
  body_use: dict[str, tuple[float, ...]]  # per body: each unit's share of its slots
  online: Region | None = None  # a fixed-offset kernel's online-softmax full-tile body
  # Ours: the online body that rescales (a row's first mask-free tile, or a rerun of a tile
  # whose lazy pass, ``online``, broke its headroom); MaxDiffusion's online body always does.
  online_rescaled: Region | None = None

  def tile_bundles(self, kind: str) -> int:
    body = {"full": self.full, "masked": self.masked, "online": self.online,
            "online_rescaled": self.online_rescaled or self.online}[kind]
    if body is None:
      raise ValueError(f"{self.name} has no {kind} tile body")
    return body.bundles

  def as_dict(self) -> dict[str, Any]:
    def region(r: Region | None) -> dict[str, int] | None:
      return None if r is None else {"bundles": r.bundles, "matmuls": r.matmuls, "exps": r.exps,
                                     "matmul_types": dict(r.matmul_types)}
    return {"name": self.name, "total_bundles": self.total_bundles, "full": region(self.full),
            "masked": region(self.masked), "online": region(self.online),
            "online_rescaled": region(self.online_rescaled), "row_init": region(self.row_init),
            "row_final": region(self.row_final), "step_overhead": self.step_overhead,
            "units": list(self.units), "capacity": list(self.capacity),
            "body_use": {k: [round(x, 4) for x in v] for k, v in self.body_use.items()}}


def _bundles(text: str) -> tuple[list[tuple[int, str, str]], int | None]:
  """``(address, label, text)`` per bundle, and the first loop-body address."""
  out, loop = [], None
  for line in text.splitlines():
    match = _BUNDLE.match(line)
    if match:
      address = int(match.group(1), 16)
      out.append((address, match.group(2) or "", line))
      if match.group(2) == "LB" and loop is None:
        loop = address
    elif out:  # an instruction continued on the next line
      out[-1] = (out[-1][0], out[-1][1], out[-1][2] + "\n" + line)
  return out, loop


def _regions(bundles: Sequence[tuple[int, str, str]]) -> list[Region]:
  fallthrough = {}
  for address, label, line in bundles:
    if label == "PF":
      for region in _FALLTHROUGH.findall(line):
        fallthrough[region] = address
  index = {address: i for i, (address, _, _) in enumerate(bundles)}
  regions = []
  for address, _, line in bundles:
    for target in _BRANCH.findall(line):
      end = fallthrough.get(target)
      if end is None or end <= address:
        continue
      body = bundles[index[address] + 1:index.get(end, len(bundles))]
      types: dict[str, int] = {}
      for _, _, text in body:
        for kind in _MATMUL_TYPE.findall(text):
          types[kind] = types.get(kind, 0) + 1
      regions.append(Region(address + 1, end, sum(len(_MATMUL.findall(b[2])) for b in body),
                            sum(len(_EXP.findall(b[2])) for b in body),
                            tuple(sorted(types.items()))))
  return sorted(set(regions), key=lambda r: (r.start, -r.end))


def unit_bounds(bundles: int, units: Sequence[str], shares: Sequence[float]) -> list[tuple[str, float, int]]:
  """Per unit: its share of the body's slots and the fewest bundles its work alone needs
  (share x bundles: no schedule of the same instructions can be shorter)."""
  return sorted(((u, s, round(s * bundles)) for u, s in zip(units, shares)), key=lambda x: -x[1])


def _utilisation(text: str, path: str) -> tuple[tuple[str, ...], tuple[int, ...], list[list[int]]]:
  lines = text.splitlines()
  try:
    head = lines.index("== CAPACTIY:") if "== CAPACTIY:" in lines else lines.index("== CAPACITY:")
    units = tuple(u.strip() for u in lines[head + 1].split(","))
    capacity = tuple(int(x) for x in lines[head + 2].split())
    start = lines.index("== UTILIZATION:") + 1
    rows = [[int(x) for x in line.split()] for line in lines[start:] if line.strip()]
  except (ValueError, IndexError) as err:
    raise ScheduleFormatError(f"{path}: not a per-bundle utilisation table ({err})") from None
  if len(units) != len(capacity) or any(len(r) != len(units) for r in rows):
    raise ScheduleFormatError(f"{path}: units, capacities and rows disagree in length")
  return units, capacity, rows


# Tile bodies in code order: Splash's (mask-free, then masked, equal matmul counts);
# MaxDiffusion's fixed-m kernel (fixed full, online full, ragged-last); ours (fixed full, online
# lazy, online rescaled, masked); MaxDiffusion's online kernel (full, then ragged-last, priced
# as masked).
SPLASH_LAYOUT = ("full", "masked")
FIXED_OFFSET_LAYOUT = ("full", "online", "masked")
OURS_LAYOUT = ("full", "online", "online_rescaled", "masked")
# Ours with row keys (compensation): the row's closing step has matmuls of its own, once per row.
ROW_KEYS_LAYOUT = (*OURS_LAYOUT, "row_final")
ONLINE_LAST_LAYOUT = ("full", "last")


def children_of(bodies: list[Any], final: Any) -> list[Any]:
  return [*bodies, *([final] if final is not None else [])]


def parse_kernel(bundles_text: str, utilisation_text: str, name: str = "kernel",
                 paths: tuple[str, str] = ("final_bundles", "utilisation"),
                 layout: tuple[str, ...] = SPLASH_LAYOUT) -> KernelSchedule:
  """A tile kernel's schedule from its two dump files' text; ``layout`` names its bodies."""
  bundles, loop = _bundles(bundles_text)
  if not bundles or loop is None:
    raise ScheduleFormatError(f"{paths[0]}: no bundles or no loop body (LB) found")
  regions = _regions(bundles)
  with_matmuls = [r for r in regions if r.matmuls]
  bodies = [r for r in with_matmuls if not any(r.contains(o) for o in with_matmuls)]
  if layout == SPLASH_LAYOUT:
    if not 1 <= len(bodies) <= 2 or len({b.matmuls for b in bodies}) != 1:
      raise ScheduleFormatError(
          f"{paths[0]}: expected one or two tile bodies with equal matmul counts, found "
          f"{[(b.bundles, b.matmuls) for b in bodies]}")
  elif len(bodies) != len(layout):
    raise ScheduleFormatError(f"{paths[0]}: expected {len(layout)} tile bodies {layout}, found "
                              f"{[(b.bundles, b.matmuls) for b in bodies]}")
  final = None
  if layout[-1] == "row_final":  # a closing step with matmuls: priced once per row, not per tile
    *bodies, final = bodies
    layout = layout[:-1]
  parents = [r for r in regions if all(r.contains(b) for b in (*bodies, *([final] if final else [])))]
  parent = min(parents, key=lambda r: r.bundles) if parents else None
  siblings = [r for r in regions if parent is not None and parent.contains(r)
              and not any(o.contains(r) and parent.contains(o) for o in regions)]
  before = [r for r in siblings if r.end <= bodies[0].start and not r.matmuls]
  after = [r for r in siblings if r.start >= bodies[-1].end and not r.matmuls]
  row_init = before[-1] if before else None
  row_final = final or (after[0] if after else None)
  if layout == OURS_LAYOUT and len(after) == 2:
    # Ours over ragged blocks: the output's write-back is a region of its own after the row's
    # finalisation, run when the row closes: both priced once per row, as one.
    row_final = Region(after[0].start, after[0].start + after[0].bundles + after[1].bundles, 0,
                       after[0].exps + after[1].exps)
  # The loop: from its first bundle to the end of the smallest region holding it and the bodies,
  # else through its back edge's delay slots (the kernel's exit bundle runs once, not per step).
  last = bundles[-1][0] + (0 if "exit bundle" in bundles[-1][2] else 1)
  loop_end = min((r.end for r in regions if r.start <= loop and all(r.contains(b) or r == b
                                                                     for b in children_of(bodies, final))),
                 default=last)
  children = [r for r in (row_init, *bodies, row_final) if r is not None]
  overhead = loop_end - loop - sum(r.bundles for r in children)
  units, capacity, rows = _utilisation(utilisation_text, paths[1])
  if len(rows) < bundles[-1][0] + 1:
    raise ScheduleFormatError(f"{paths[1]}: {len(rows)} rows for {bundles[-1][0] + 1} bundles")

  def use(region: Region) -> tuple[float, ...]:
    sums = [sum(rows[i][u] for i in range(region.start, region.end)) for u in range(len(units))]
    return tuple(s / (c * region.bundles) if c else 0.0 for s, c in zip(sums, capacity))

  named = dict(zip(layout, bodies))
  body_use = {k: use(r) for k, r in named.items()}
  if "last" in named:  # a ragged last kv block: one per row, priced as the masked body
    named["masked"] = named.pop("last")
    body_use["masked"] = body_use.pop("last")
  return KernelSchedule(name, bundles[-1][0] + 1, named["full"], named.get("masked"), row_init,
                        row_final, overhead, units, capacity, body_use, named.get("online"),
                        named.get("online_rescaled"))


def read_dump(directory: str, kernel: str = "splash",
              layout: tuple[str, ...] = SPLASH_LAYOUT) -> list[KernelSchedule]:
  """Every dumped kernel whose name contains ``kernel``, in file order."""
  found = []
  for path in sorted(glob.glob(os.path.join(directory, f"*{kernel}*-final_bundles.txt"))):
    if "schedule-analysis" in os.path.basename(path):
      continue
    prefix = path[:-len("final_bundles.txt")].rsplit("-", 2)[0]
    util = glob.glob(f"{prefix}-*-final_hlo-static-per-bundle-utilization.txt")
    if len(util) != 1:
      raise ScheduleFormatError(f"{path}: no matching per-bundle utilisation file")
    with open(path, encoding="utf-8") as f, open(util[0], encoding="utf-8") as g:
      found.append(parse_kernel(f.read(), g.read(), os.path.basename(prefix), (path, util[0]),
                                layout))
  if not found:
    raise ScheduleFormatError(f"{directory}: no *{kernel}*-final_bundles.txt (was the "
                              f"kernel compiled with {dump_flags(directory)!r}?)")
  return found
