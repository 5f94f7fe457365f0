"""Wall-clock timing of jitted calls for the benchmarks."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax


def time_call(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
  """(first call incl. compilation, best of ``repeats`` later calls), in seconds."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - start
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return first, best
