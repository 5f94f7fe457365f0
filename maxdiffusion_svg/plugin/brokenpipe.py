"""Output piped into a reader that stops early (``... | head -1``) ends the command quietly.

Python ignores SIGPIPE, so the write after the reader has gone raises ``BrokenPipeError``, and
the interpreter's final flush of ``stdout`` raises it again: a traceback for a normal use of a
pipe. The recipe from Python's ``signal`` documentation: catch it, point ``stdout`` at devnull so
that the final flush has somewhere to go, and exit with status 1.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
BROKEN_PIPE_STATUS = 1  # what Python itself returns on EPIPE


def quiet_on_broken_pipe(main: F) -> F:
  """``main`` (a command's entry point), ending with status 1 and no traceback when its reader
  closes the pipe."""

  @functools.wraps(main)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    try:
      try:
        return main(*args, **kwargs)
      finally:  # on return and on sys.exit: what is still buffered fails here, not at exit
        sys.stdout.flush()
    except BrokenPipeError:
      devnull = os.open(os.devnull, os.O_WRONLY)
      os.dup2(devnull, sys.stdout.fileno())
      sys.exit(BROKEN_PIPE_STATUS)

  return wrapper  # type: ignore[return-value]
