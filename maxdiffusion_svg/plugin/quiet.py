"""Quiet runs: what MaxDiffusion prints goes to a log file, the plugin's own lines to the terminal.

MaxDiffusion prints its whole config (some 250 lines) and its logs on every run, and the
libraries under it add absl's, TensorFlow's and git's lines on stderr: the plugin's few lines (the
settings line, the run summary, the result) are lost among them. :func:`to_log` sends file
descriptors 1 and 2 (so C++ logs and child processes too) into a log file, and ``sys.stdout`` /
``sys.stderr`` through a filter that copies the lines a command keeps (by their start) to the
terminal. ``generate``, ``compare`` and ``calibrate`` run quiet unless ``--verbose``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import sys
from typing import Any, Iterator, Sequence, TextIO

LOG_NAME = "maxdiffusion.log"  # in a run's output folder
# Lines that reach the terminal by default: the plugin's own (MaxDiffusion's max_logging prints
# them with this prefix) and a refusal's one line.
PLUGIN_LINES = ("maxdiffusion_svg: ", "error: ")
# For a tool whose table says it all (compare, calibrate): only warnings and refusals.
WARNINGS = ("maxdiffusion_svg: warning", "error: ")


@dataclasses.dataclass(frozen=True)
class Terminal:
  """Where a command's own lines go: the terminal's streams; ``log``, MaxDiffusion's output
  (None: not quiet, everything on the terminal). Valid inside :func:`to_log` only."""

  out: TextIO
  err: TextIO
  log: pathlib.Path | None = None


_ACTIVE: list[Terminal] = []  # the quiet run in progress (nested quiet runs share it)


def local_folder(path: str) -> bool:
  """Whether ``path`` (a config's ``output_dir``) is a folder on this machine, not ``gs://...``."""
  return bool(path) and "://" not in path


def log_path(output_dir: str, run_name: str) -> pathlib.Path | None:
  """The log of a generation run: in MaxDiffusion's own folder for it (``output_dir/run_name``,
  where its TensorBoard and checkpoint folders go); None where ``output_dir`` is not local
  (``gs://``: the output stays on the terminal, e.g. a cluster's log)."""
  if not local_folder(output_dir):
    return None
  return pathlib.Path(output_dir, run_name or "", LOG_NAME).absolute()


def calm_child_processes() -> None:
  """No ``os.fork() was called ... JAX is multithreaded`` warning when a video is written:
  imageio-ffmpeg starts ffmpeg with a Python ``preexec_fn`` (so that Ctrl-C does not reach it),
  which makes Python run the fork hooks, JAX's among them. Without it the child is a plain
  fork-exec, which is safe in a threaded process; Ctrl-C then stops ffmpeg with the run."""
  os.environ.setdefault("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", "1")


class _Lines:
  """A text stream writing everything to ``log`` and the lines starting with one of ``keep``
  also to ``terminal``; after :meth:`detach`, everything to ``after`` (a handler that took
  ``sys.stderr`` during the run keeps this object)."""

  def __init__(self, log: TextIO, terminal: TextIO, keep: tuple[str, ...], after: TextIO):
    self._log, self._terminal, self._keep, self._after = log, terminal, keep, after
    self._line = ""
    self._attached = True

  def write(self, text: str) -> int:
    if not self._attached:
      return self._after.write(text)
    self._log.write(text)
    # a progress bar's \r ends a line too: what is pending stays short
    *lines, self._line = (self._line + text).replace("\r", "\n").split("\n")
    for line in lines:
      if line.startswith(self._keep):
        self._terminal.write(line + "\n")
        self._terminal.flush()
    return len(text)

  def writelines(self, lines: Sequence[str]) -> None:
    for line in lines:
      self.write(line)

  def flush(self) -> None:
    (self._log if self._attached else self._after).flush()

  def isatty(self) -> bool:
    return False  # no colours, no live bars: it is a file

  def detach(self) -> None:
    self._attached = False

  def __getattr__(self, name: str) -> Any:  # encoding, errors, fileno, ... of the stream behind
    return getattr(self._log if self._attached else self._after, name)


def _terminal_stream(stream: TextIO, fd: int) -> tuple[TextIO, bool]:
  """A stream to the terminal that stays one while ``fd`` points at the log: a copy of ``fd``
  where ``stream`` writes to it, else ``stream`` itself (e.g. pytest's capture, no real file);
  and whether it was opened here."""
  try:
    on_fd = stream.fileno() == fd
  except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
    on_fd = False
  if not on_fd:
    return stream, False
  encoding = getattr(stream, "encoding", None) or "utf-8"
  return open(os.dup(fd), "w", buffering=1, encoding=encoding, errors="replace"), True  # pylint: disable=consider-using-with


@contextlib.contextmanager
def to_log(path: pathlib.Path | None, keep: tuple[str, ...] = PLUGIN_LINES) -> Iterator[Terminal]:
  """Within: file descriptors 1 and 2 and ``sys.stdout``/``sys.stderr`` write to ``path``
  (created, with its folder; emptied), lines starting with one of ``keep`` also to the
  terminal; yields the terminal's streams for the command's own lines. ``path`` None: nothing
  changes (``--verbose``). Inside another quiet run: that run's. An exception leaves one line
  on stderr naming the log, before its stack trace."""
  if path is None:
    yield Terminal(sys.stdout, sys.stderr)
    return
  if _ACTIVE:
    yield _ACTIVE[-1]
    return
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  stdout, stderr = sys.stdout, sys.stderr
  for stream in (stdout, stderr):
    stream.flush()
  out, own_out = _terminal_stream(stdout, 1)
  err, own_err = _terminal_stream(stderr, 2)
  saved = (os.dup(1), os.dup(2))
  log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
  log = open(os.dup(log_fd), "w", buffering=1, encoding="utf-8", errors="replace")  # pylint: disable=consider-using-with
  os.dup2(log_fd, 1)
  os.dup2(log_fd, 2)
  os.close(log_fd)
  lines = (_Lines(log, out, keep, stdout), _Lines(log, err, keep, stderr))
  sys.stdout, sys.stderr = lines  # type: ignore[assignment]
  terminal = Terminal(out, err, path)
  _ACTIVE.append(terminal)
  failed = False
  try:
    yield terminal
  except SystemExit:  # a refusal or the end: what exits has said why (a refusal, one line)
    raise
  except BaseException:  # a stack trace follows: where to read what led to it
    failed = True
    raise
  finally:
    _ACTIVE.pop()
    for stream in (*lines, log):
      stream.flush()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    for fd in saved:
      os.close(fd)
    for line in lines:
      line.detach()
    sys.stdout, sys.stderr = stdout, stderr
    log.close()
    for stream, own in ((out, own_out), (err, own_err)):
      if own:
        stream.close()
    if failed:
      print(f"MaxDiffusion's output up to here: {path} (--verbose prints it)", file=sys.stderr,
            flush=True)
