"""Figures in the docs' tables and prose, held to what a command prints: shared by
tests/test_figures.py (commands run on stored measurements) and tests/integration/
test_figures_tiles.py (``tiles CONFIG``, which needs MaxDiffusion's base configs).

A figure as written is the printed one rounded: it must lie within half a unit of its own last
digit of the printed value (``0.40x`` holds ``0.4005``; ``0.39`` holds a printed ``0.395``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
MEASUREMENTS = ROOT / "docs" / "measurements"
NUMBER = re.compile(r"(?<![\w.-])[+-]?\d[\d,]*(?:\.\d+)?")
CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\([^)]*\)")
SHAPE = re.compile(r"\b\d+(?:x\d+(?:/\d+)?|p)\b")  # a video or tile shape (1280x704, 720p), not a figure


def stored(name: str) -> dict:
  """A stored measurement, docs/measurements/NAME.json."""
  return json.loads((MEASUREMENTS / f"{name}.json").read_text())


def section(page: str, heading: str) -> str:
  """The text of ``page`` under ``heading`` up to the next heading of its level or higher."""
  text = (ROOT / page).read_text()
  start = text.index(f"\n{heading}\n") + len(heading) + 2
  level = len(heading.split(" ")[0])
  end = re.search(rf"\n#{{1,{level}}} ", text[start:])
  return text[start:start + end.start()] if end else text[start:]


def cells(line: str) -> list[str]:
  return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


@dataclasses.dataclass(frozen=True)
class Table:
  """A markdown table: its header's cells and its rows' cells."""

  header: tuple[str, ...]
  rows: tuple[tuple[str, ...], ...]

  def row(self, label: str) -> tuple[str, ...]:
    """The row whose first cell is ``label`` (exactly one)."""
    found = [r for r in self.rows if r[0] == label]
    assert len(found) == 1, (label, [r[0] for r in self.rows])
    return found[0]


def tables(text: str) -> list[Table]:
  """Every table in ``text``, in order."""
  out, block = [], []
  for line in [*text.splitlines(), ""]:
    if line.startswith("|"):
      block.append(cells(line))
    elif block:
      out.append(Table(tuple(block[0]), tuple(tuple(r) for r in block[2:])))
      block = []
  return out


def table(text: str, first_header_cell: str) -> Table:
  """The one table in ``text`` whose header starts with ``first_header_cell``."""
  found = [t for t in tables(text) if t.header[0].startswith(first_header_cell)]
  assert len(found) == 1, (first_header_cell, [t.header[0] for t in tables(text)])
  return found[0]


def row_of(text: str, label: str) -> tuple[str, ...]:
  """The one row, in any table of ``text``, whose first cell is ``label``."""
  found = [r for t in tables(text) for r in t.rows if r[0] == label]
  assert len(found) == 1, (label, len(found))
  return found[0]


def figures(text: str) -> list[str]:
  """The figures written in ``text``: its numbers, outside code spans, link targets and shapes."""
  text = SHAPE.sub("", LINK.sub("]", CODE.sub("", text)))
  return NUMBER.findall(text)


def _value(figure: str) -> float:
  return float(figure.replace(",", "").rstrip("x"))


def _decimals(figure: str) -> int:
  return len(figure.split(".")[1]) if "." in figure else 0


def mismatches(written: Sequence[str], printed: Sequence[str | float]) -> list[str]:
  """Where the figures as written differ from the printed ones (in order; rounding allowed)."""
  if len(written) != len(printed):
    return [f"{len(written)} figures written {list(written)}, {len(printed)} printed "
            f"{list(printed)}"]
  out = []
  for w, p in zip(written, printed):
    half = 0.5 * 10 ** -_decimals(w)
    if abs(_value(w) - _value(str(p))) > half + 1e-9:
      out.append(f"written {w}, printed {p}")
  return out


def printed(pattern: str, output: str, groups: int | None = None) -> list[str]:
  """Every match of ``pattern`` in ``output``, its groups in order; asserts at least one."""
  found = re.findall(pattern, output)
  assert found, (pattern, output)
  flat = [g for m in found for g in (m if isinstance(m, tuple) else (m,))]
  return flat if groups is None else flat[:groups]
