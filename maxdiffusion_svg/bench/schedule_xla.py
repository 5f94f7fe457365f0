"""Static bundles of a whole compiled XLA program, from libtpu's schedule dump.

A Mosaic kernel's cost is its plan's tiles times its bodies (:mod:`maxdiffusion_svg.bench.schedule`);
the XLA around it (fusions, dots, copies) has no plan. libtpu dumps one final schedule per
computation: the top-level program (``TLP``) ``call``s each fusion in order, and a fusion walks
its data in at most a few flat loops whose exit test compares an iteration counter (from 0,
step 1) with a literal trip count. A computation's bundles as issued are its listing's length
plus ``(trips - 1)`` times each loop's, for every run of the loops around it; the program's are
the TLP's plus each called computation's, times the trip count of any TLP loop around the call.

Not exact either way: a predicated region (a software-pipelined loop's first and last steps, a
bounds check) is counted as if it always ran (too many), and a loop nested in another (a gather's
copies, whose trip count is not a literal) as if it ran once per outer step (too few: the
centroid pass avoids gathers for this reason). And bundles are not time: a fusion that streams a
large array from HBM waits on memory that no bundle shows.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from maxdiffusion_svg.tpu.bundles import ScheduleFormatError, _bundles

_EXIT_TEST = re.compile(r"scmp\.ge\.s32\.totalorder %\w+, (\d+) /\* loop exit test")
_CALL = re.compile(r"\b(?:inlined_)?call\b[^;{}]*?/\* %([\w.\-]+) = ")
_EMPTY = re.compile(r":\s*>?\s*\{\s*\}")
_SUFFIX = "-final_bundles.txt"


_DEPTH = re.compile(r"^\s*0?x?[0-9a-f]+\s+\w*\s*:\s*(>*)\s*\{")


def _depth(line: str) -> int:
  """A bundle's loop depth: the ``>`` marks libtpu prints before it."""
  match = _DEPTH.match(line)
  return len(match.group(1)) if match else 0


def loops(text: str, path: str = "listing", unknown: list[tuple[int, int]] | None = None
          ) -> list[tuple[int, int, int]]:
  """``(first, last, trips)`` of each loop in a listing: from its ``LB`` bundle through its back
  edge and the empty delay slots after it, run ``trips`` times per run of the loop around it, if
  any (an exit test closes the open loop of its own depth, the ``>`` marks libtpu prints). A loop
  whose exit test compares addresses, not a counter with a literal (libtpu's fills and copies of
  a buffer), ends where its bundles' loop depth falls back to its own: with ``unknown`` (a list)
  an outermost one is appended there as ``(first, last)`` and priced as run once, else it is
  refused; one inside a counted loop runs once per step of it."""
  bundles, _ = _bundles(text)
  out: list[tuple[int, int, int]] = []
  open_: list[tuple[int, int]] = []  # (depth, first) of the loops entered and not yet closed
  for i, (address, label, line) in enumerate(bundles):
    depth = _depth(line)
    if (open_ and unknown is not None and depth == 0
        and not _EMPTY.search(line) and not _EXIT_TEST.search(line)):
      last = max(j for j in range(i) if _depth(bundles[j][2]) > 0)
      unknown.append((open_[0][1], bundles[last][0]))  # left without a literal exit test
      open_ = []
    if label == "LB":
      open_.append((depth, address))
    match = _EXIT_TEST.search(line)
    if match is None:
      continue
    while open_ and open_[-1][0] > depth:
      open_.pop()  # an inner loop with no literal exit test: once per step of this one
    if not open_:
      raise ScheduleFormatError(f"{path}: a loop exit test at {address:#x} outside any loop")
    first = open_.pop()[1]
    j = i + 1
    while j < len(bundles) and "sbr.rel" not in bundles[j - 1][2]:
      j += 1  # the back edge, at or after the exit test
    while j < len(bundles) and _EMPTY.search(bundles[j][2]) and "exit bundle" not in bundles[j][2]:
      j += 1  # its delay slots
    out.append((first, bundles[j - 1][0], int(match.group(1))))
  if open_ and unknown is not None:
    unknown.append((open_[0][1], bundles[-1][0]))
  elif open_:
    raise ScheduleFormatError(f"{path}: the loop at {open_[0][1]:#x} has no exit test this "
                              f"reader knows")
  return out


def _extra_runs(spans: list[tuple[int, int, int]]) -> int:
  """Bundles the loops add to one pass of a listing: each loop's body ``trips - 1`` more times,
  for every run of the loops around it."""
  extra = 0
  for first, last, trips in spans:
    around = 1
    for other in spans:
      if other != (first, last, trips) and other[0] <= first and last <= other[1]:
        around *= other[2]
    extra += around * (trips - 1) * (last - first + 1)
  return extra


def issued_bundles(text: str, path: str = "listing",
                   unknown: list[tuple[int, int]] | None = None) -> int:
  """Bundles one run of a computation issues: its listing, each loop's body ``trips`` times
  (``unknown``: see :func:`loops`)."""
  bundles, _ = _bundles(text)
  if not bundles:
    raise ScheduleFormatError(f"{path}: no bundles")
  return bundles[-1][0] + 1 + _extra_runs(loops(text, path, unknown))


def calls(text: str, path: str = "TLP", loop_trips: int | None = None) -> dict[str, int]:
  """How many times the top-level program calls each computation (by name), counting the trip
  count of a loop around the call. ``loop_trips``: how many times a loop runs whose exit test
  is no literal (a ``lax.scan`` whose length the caller knows); without it such a loop is
  refused."""
  bundles, _ = _bundles(text)
  spans = scan_loops(text, path, loop_trips)
  counts: dict[str, int] = {}
  for address, _, line in bundles:
    for name in _CALL.findall(line):
      times = 1
      for first, last, trips in spans:
        if first <= address <= last:
          times *= trips
      counts[name] = counts.get(name, 0) + times
  return counts


def scan_loops(text: str, path: str, loop_trips: int | None) -> list[tuple[int, int, int]]:
  """:func:`loops`, where each loop with no literal exit test runs ``loop_trips`` times."""
  if loop_trips is None:
    return loops(text, path)
  unknown: list[tuple[int, int]] = []
  return loops(text, path, unknown) + [(first, last, loop_trips) for first, last in unknown]


def _listings(directory: str) -> dict[str, str]:
  """Each dumped computation's final listing by name (its file's middle part)."""
  out = {}
  for path in glob.glob(os.path.join(directory, f"*{_SUFFIX}")):
    base = os.path.basename(path)
    if "schedule-analysis" in base:
      continue
    name = base[:-len(_SUFFIX)].split("-", 1)[1].rsplit("-", 1)[0]
    out[name] = path
  return out


HLO_FILE = "optimized_hlo.txt"  # the compiled module's text, beside the dumped schedules
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_FUSION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) fusion\(.*calls=%([\w.\-]+)")
_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\(")
_NOISE = re.compile(r", (?:metadata|backend_config|frontend_attributes)=\{.*$|%[\w.\-]+")


def twins(hlo: str) -> dict[str, str]:
  """Each fusion (and plain op) of an optimised HLO module by a key equal for those that compute
  the same thing (same result shape and layout, same fused body or attributes, up to names):
  libtpu compiles such twins once and dumps one schedule for them all. A plain op's operands'
  layouts are not in its line: two with the same result may differ there."""
  bodies: dict[str, list[str]] = {}
  current = None
  for line in hlo.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = bodies.setdefault(match.group(1), [])
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(_NOISE.sub(lambda m: "" if m.group(0).startswith(",") else "%", line.strip()))
  out = {}
  for line in hlo.splitlines():
    match = _FUSION.match(line)
    if match:
      name, shape, callee = match.groups()
      out[name] = shape + "|" + "\n".join(sorted(bodies.get(callee, [callee])))
      continue
    match = _OP.match(line)
    if match:  # a plain op (a copy, a reshape that moves data): its result and attributes
      name, shape, op = match.groups()
      out.setdefault(name, shape + "|" + op + "|" + _NOISE.sub(
          lambda m: "" if m.group(0).startswith(",") else "%", line.split("=", 1)[1].strip()))
  return out


def price_program(directory: str, skip: str | tuple[str, ...],
                  loop_trips: int | None = None) -> dict[str, Any]:
  """Static bundles of the dumped program, less every computation whose name contains ``skip``
  (the kernels, priced from their plans): ``{bundles, top_level, computations, priced_as,
  unpriced, loops_priced_once}``; the last counts, per computation, the loops whose trip count
  is not a literal (buffer fills and copies bounded by addresses), priced as run once.
  ``loop_trips``: the trip count of the top-level loop with no literal exit test (a scan's)."""
  skips = (skip,) if isinstance(skip, str) else tuple(skip)
  listings = _listings(directory)
  top = [n for n in listings if n == "TLP"]
  if not top:
    raise ScheduleFormatError(f"{directory}: no top-level program (TLP) schedule dumped")

  def read(name: str) -> str:
    with open(listings[name], encoding="utf-8") as f:
      return f.read()

  tlp = read("TLP")
  hlo_path = os.path.join(directory, HLO_FILE)
  twin_of: dict[str, str] = {}
  if os.path.exists(hlo_path):
    with open(hlo_path, encoding="utf-8") as f:
      twin_of = twins(f.read())
  once: dict[str, int] = {}

  def price(name: str) -> int:
    unknown: list[tuple[int, int]] = []
    bundles = issued_bundles(read(name), listings[name], unknown)
    if unknown:
      once[name] = len(unknown)
    return bundles

  priced = {name: 0 for name in ("<late-initialization>", "<late-finalization>") if name in listings}
  for name in priced:
    priced[name] = price(name)
  if loop_trips is None:
    top_level = price("TLP")
  else:
    top_level = _bundles(tlp)[0][-1][0] + 1 + _extra_runs(
        scan_loops(tlp, listings["TLP"], loop_trips))
  unpriced, priced_as = [], {}
  for name, times in calls(tlp, listings["TLP"], loop_trips).items():
    if any(s in name for s in skips) or name in priced and name.startswith("<"):
      continue
    source = name
    if name not in listings:
      # libtpu dumps one listing for computations it compiled once and calls twice (k's and
      # v's centroids): priced as a dumped one of the same kind (name less its .N), if any.
      key = twin_of.get(name)
      kin = sorted(n for n in listings if key is not None and twin_of.get(n) == key)
      if not kin and not twin_of:  # no module text: the first dumped one of the same kind
        kin = sorted(n for n in listings if _kind(n) == _kind(name)
                     and not any(s in n for s in skips))
      if not kin:
        unpriced.append(name)
        continue
      source = priced_as[name] = kin[0]
    priced[name] = priced.get(name, 0) + times * price(source)
  return {"bundles": top_level + sum(priced.values()), "top_level": top_level,
          "computations": dict(sorted(priced.items(), key=lambda x: -x[1])),
          "priced_as": priced_as, "unpriced": sorted(unpriced), "loops_priced_once": once}


def _kind(name: str) -> str:
  return re.sub(r"\.\d+$", "", name)
