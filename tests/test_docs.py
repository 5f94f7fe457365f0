"""The docs cover what a user can set and type, and their links lead somewhere in the repository."""

import argparse
import pathlib
import re

import pytest

from maxdiffusion_svg.cli.main import build_parser
from maxdiffusion_svg.plugin.settings import config_defaults

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "configs").glob("*.md"), *(ROOT / "patches").glob("*.md")])
REFERENCE = ROOT / "docs" / "reference.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
  seen: dict[str, int] = {}
  out = set()
  in_code = False
  for line in page.read_text().splitlines():
    if line.startswith("```"):
      in_code = not in_code
    elif not in_code and (match := re.match(r"#+ (.*)", line)):
      base = slug(match.group(1))
      count = seen.get(base, 0)
      seen[base] = count + 1
      out.add(base if count == 0 else f"{base}-{count}")
  return out


def section(page: pathlib.Path, heading: str) -> str:
  """The text under ``heading`` up to the next heading of the same or a higher level."""
  text = page.read_text()
  level = heading.split(" ")[0]
  start = text.index(f"\n{heading}\n")
  rest = text[start + len(heading) + 2:]
  end = re.search(rf"\n#{{1,{len(level)}}} ", rest)
  return rest[:end.start()] if end else rest


def test_slug_follows_github():
  assert slug("The drift guard (`maxdiffusion_svg/plugin/contract.py`)") == \
      "the-drift-guard-maxdiffusion_svgplugincontractpy"
  assert slug("### `python -m maxdiffusion_svg tiles`".lstrip("# ")) == \
      "python--m-maxdiffusion_svg-tiles"


def test_every_svg_key_is_in_the_reference_table_with_its_default():
  table = section(REFERENCE, "## Config keys")
  rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(svg_\w+)` \| ([^|]+) \|", table,
                                                       re.M)}
  assert set(rows) == set(config_defaults())
  for key, default in config_defaults().items():
    shown = rows[key]
    text = str(default).lower() if isinstance(default, bool) else str(default)
    if isinstance(default, tuple):  # a list key, shown as its YAML list
      text = f"[{', '.join(default)}]"
    assert (f"`{text}`" in shown or shown.startswith(text) or
            (default == "" and "''" in shown)), (key, default, shown)


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
  yield path, parser
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, argparse._SubParsersAction):  # pylint: disable=protected-access
      for name, sub in action.choices.items():
        yield from _commands(sub, path + (name,))


COMMANDS = list(_commands(build_parser()))


@pytest.mark.parametrize("path,parser", COMMANDS[1:], ids=[" ".join(p) for p, _ in COMMANDS[1:]])
def test_every_cli_flag_is_documented_under_its_command(path, parser):
  text = section(REFERENCE, f"### `python -m maxdiffusion_svg {' '.join(path)}`")
  for action in parser._actions:  # pylint: disable=protected-access
    if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):  # pylint: disable=protected-access
      continue
    names = [n for n in action.option_strings if n.startswith("--")] or [action.metavar]
    for name in names:
      assert re.search(rf"`{re.escape(name)}[ `=]", text), (path, name)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve_inside_the_repository(page):
  for target in LINK.findall(page.read_text()):
    if re.match(r"[a-z]+:", target):
      assert target.startswith("https://"), (page.name, target)
      continue
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve() if file else page
    assert dest.is_relative_to(ROOT) and dest.exists(), (page.name, target)
    if anchor:
      assert anchor in anchors(dest), (page.name, target, sorted(anchors(dest)))


def test_no_page_points_outside_the_repository_or_leaves_the_seed_undefined():
  for page in PAGES:
    text = page.read_text()
    assert "../shared" not in text, page.name
  readme = (ROOT / "README.md").read_text()
  for page in (ROOT / "README.md", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "expect.md"):
    text = page.read_text()
    first = text.index("seed design")  # named for what it is where a reader first meets it
    assert "an internal design document, not public" in text[first:first + 200], page.name
  assert len(readme.splitlines()) <= 200  # the front door; the rest lives in docs/


def test_each_schedule_table_follows_from_the_command_beside_it():
  """A ``bench schedule`` output in the benchmarks has the tiles its command line gives: the
  nearest command above it, run as written (optional ``[...]`` parts left out)."""
  from maxdiffusion_svg.bench.schedule import default_tiles  # pylint: disable=import-outside-toplevel
  text = (ROOT / "docs" / "benchmarks.md").read_text()
  command = re.compile(r"`python -m maxdiffusion_svg (bench schedule[^`]*)`")
  header = re.compile(r"^compiler-static schedule.*\(libtpu [\d.]+, TPU (\w+)\):.* tiles "
                      r"(\d+)x(\d+), kv step (\d+),", re.M)
  checked = 0
  for out in header.finditer(text):
    *_, last = command.finditer(text, 0, out.start())
    argv = re.sub(r"\[[^\]]*\]", " ", last.group(1)).split()
    args, _ = build_parser().parse_known_args(argv)
    assert args.chip == out.group(1).lower(), (last.group(0), out.group(0))
    tiles = (args.block_q, args.block_kv, args.block_kv_compute)
    defaults = default_tiles(args.chip, args.vmem_limit_kib, args.backend)
    given = tuple(t or d for t, d in zip(tiles, defaults))
    assert given == tuple(int(g) for g in out.groups()[1:]), (last.group(0), out.group(0))
    checked += 1
  assert checked >= 3
