"""Every table in the docs renders as one (CommonMark with GitHub's table extension, as
markdown-it-py parses them), with as many cells in each row as in its header."""

import pathlib
import re

import pytest
from markdown_it import MarkdownIt

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "configs" / "README.md"])
PIPE = re.compile(r"(?<!\\)\|")  # a cell boundary: a pipe not escaped


def cells(line: str) -> int:
  """Cells in a table row as GitHub counts them: unescaped pipes, the outer ones optional."""
  inner = line.strip()
  inner = inner[1:] if inner.startswith("|") else inner
  inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
  return len(PIPE.split(inner))


def pipe_blocks(lines: list[str]) -> list[tuple[int, int]]:
  """[start, end) line ranges of consecutive lines starting with ``|``, outside fenced code."""
  blocks, start, fence = [], None, False
  for i, line in enumerate([*lines, ""]):
    fence = fence != line.startswith("```")
    if line.startswith("|") and not fence:
      start = i if start is None else start
    elif start is not None:
      blocks.append((start, i))
      start = None
  return blocks


def broken_tables(text: str) -> list[str]:
  """What is wrong with the tables in ``text``: a block of ``|`` lines that does not render as
  one whole table, or a row whose cells differ from its header's."""
  lines = text.splitlines()
  tokens = MarkdownIt("commonmark").enable("table").parse(text)
  tables = [tuple(t.map) for t in tokens if t.type == "table_open"]
  problems = [f"line {a + 1}: {lines[a][:60]!r}... is not a table (a blank line above it, or "
              f"no |---| row under its header?)"
              for a, b in pipe_blocks(lines) if (a, b) not in tables]
  for a, b in tables:
    header = cells(lines[a])
    for i in range(a + 2, b):
      if cells(lines[i]) != header:
        problems.append(f"line {i + 1}: {cells(lines[i])} cells, its header {header}")
  return problems


def test_the_check_finds_a_table_cut_by_a_blank_line_and_a_short_row():
  table = "| a | b |\n|---|---|\n| 1 | 2 |\n"
  assert broken_tables(table) == []
  assert broken_tables("| `x \\| y` | b |\n|---|---|\n| 1 | 2 |\n") == []  # an escaped pipe
  assert len(broken_tables(table + "\n| 3 | 4 |\n")) == 1  # rows after a blank line: text
  assert broken_tables(table + "| 3 |\n") == ["line 4: 1 cells, its header 2"]
  assert broken_tables("```\n| not | a table |\n```\n") == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_table_renders_whole(page):
  assert broken_tables(page.read_text()) == [], page.name
