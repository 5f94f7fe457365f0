"""Compiling for a real TPU from any host: libtpu's compiler on a topology's abstract devices.

``jax[tpu]`` brings libtpu, which compiles for a named TPU topology on a CPU machine,
Mosaic kernels included, and reports memory. That makes the compiler the judge of every
TPU claim (VMEM, SMEM, layouts) without a TPU; this module is how tests and the compile
benchmark ask it. Nothing here runs anything on a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Callable, Iterator, Sequence

# libtpu looks for TPU hosts when it loads and takes a process lockfile; a compile-only user
# wants neither. Must be set before libtpu loads (the first topology request).
_LIBTPU_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
               "TPU_SKIP_MDS_QUERY": "1"}


def libtpu_available() -> bool:
  try:
    import libtpu  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return False
  return True


def libtpu_version() -> str:
  from importlib.metadata import version  # pylint: disable=import-outside-toplevel
  return version("libtpu")


@contextlib.contextmanager
def _libtpu_env() -> Iterator[None]:
  """libtpu's compile-only settings while it loads, then the environment as it was: compiling
  for a topology must not tell the rest of the process (``preflight`` reads the job's TPU
  variables) that it runs on one."""
  saved = {name: os.environ.get(name) for name in _LIBTPU_ENV}
  os.environ.update({name: value for name, value in _LIBTPU_ENV.items() if saved[name] is None})
  try:
    yield
  finally:
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str) -> tuple[Any, ...]:
  """Abstract devices of a TPU topology, e.g. ``v5e:1x1``, ``v6e:2x4``, ``tpu7x:2x2x1``.

  libtpu warns that it cannot tell the accelerator type (none is set: this host is not a TPU)
  and compiles for the topology named all the same."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  with _libtpu_env():
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


# A compile child's answer: one line of JSON behind this prefix on its standard output.
RESULT_PREFIX = "RESULT "


def print_result(result: Any) -> None:
  """The child's side of :func:`child_result`."""
  print(RESULT_PREFIX + json.dumps(result), flush=True)


def child_result(module: str, args: Sequence[str],
                 env: dict[str, str] | None = None) -> tuple[Any, str]:
  """Runs ``python -m module *args`` (a compile with its own libtpu flags, its memory returned
  when it exits) and returns ``(result, "")``, the JSON its last :func:`print_result` line
  holds, or ``(None, error)`` naming its exit status and last line of standard error."""
  done = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True,
                        text=True, check=False)
  lines = [l for l in done.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
  if lines:
    return json.loads(lines[-1][len(RESULT_PREFIX):]), ""
  tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
  return None, f"compile process exited {done.returncode}: {tail}"


def vmem_options(limit_kib: int | None) -> dict[str, str]:
  """``compile(compiler_options=...)`` for a scoped-VMEM limit (None: the default)."""
  return {} if limit_kib is None else {"xla_tpu_scoped_vmem_limit_kib": str(limit_kib)}


@dataclasses.dataclass(frozen=True)
class CompileResult:
  """What libtpu said: compiled or not, its error line, per-device bytes, seconds."""

  ok: bool
  seconds: float
  error: str = ""
  memory: dict[str, int] = dataclasses.field(default_factory=dict)
  executable: Any = None

  def as_dict(self) -> dict[str, Any]:
    return {"ok": self.ok, "seconds": round(self.seconds, 1), "error": self.error,
            "memory": self.memory}


def error_line(message: str) -> str:
  """The compiler's own sentence: the error code line and the allocation that failed."""
  lines = [line.strip() for line in message.splitlines() if line.strip()]
  keep = [line for line in lines if re.search(r"E\d{4}:|Ran out of memory|Scoped allocation"
                                               r"|exceeded|INVALID_ARGUMENT|error", line)]
  text = " ".join(keep or lines[:1])
  sentence = re.search(r"Scoped allocation with size [\d.]+[KMG] and limit [\d.]+[KMG]"
                       r"|Used [\d.]+[KMG] of [\d.]+[KMG] \w+", text)
  head = re.search(r"(RESOURCE_EXHAUSTED|INVALID_ARGUMENT|INTERNAL|UNIMPLEMENTED)[^|]{0,90}", text)
  parts = [p.group(0).strip() for p in (head, sentence) if p]
  return " ... ".join(dict.fromkeys(parts)) or text[:240]


def compile_lowered(lowered: Any, options: dict[str, str] | None = None) -> CompileResult:
  start = time.perf_counter()
  try:
    executable = lowered.compile(compiler_options=options or {})
  except Exception as err:  # pylint: disable=broad-except
    return CompileResult(False, time.perf_counter() - start, error_line(str(err)))
  seconds = time.perf_counter() - start
  analysis = executable.memory_analysis()
  memory = {} if analysis is None else {
      name: int(getattr(analysis, f"{name}_size_in_bytes", 0))
      for name in ("argument", "output", "temp", "generated_code")}
  return CompileResult(True, seconds, memory=memory, executable=executable)


def aot_compile(fn: Callable[..., Any], args: Sequence[Any],
                options: dict[str, str] | None = None) -> CompileResult:
  """jit, lower on ``args`` (``ShapeDtypeStruct``s carrying shardings on a topology's
  devices) and compile; errors while tracing (our own checks) propagate."""
  import jax  # pylint: disable=import-outside-toplevel
  return compile_lowered(jax.jit(fn).lower(*args), options)


_SCOPED = re.compile(r"Scoped allocation with size ([\d.]+)([KMG])")


@dataclasses.dataclass(frozen=True)
class VmemNeed:
  """What the compiler allocated: ``bytes`` of scoped VMEM (to its 0.01M rounding; an upper
  bound of ``bytes`` when even the smallest limit tried fit), and the compiles it took."""

  bytes: int
  compiles: int
  exact: bool = True


def scoped_vmem_need(lowered: Any, start_kib: int = 1024, max_kib: int = 131072) -> VmemNeed | None:
  """The scoped VMEM the program needs, by the compiler's word.

  The compiler names the allocation that overflowed a limit; raising the limit to it and
  compiling again walks up the allocations until the program fits. A ``start_kib`` near the
  need (just below it) takes two compiles. When the first limit already fits, the walk
  starts again an eighth as high, down to 1 KiB. None when the program fails otherwise, or
  needs more than ``max_kib``.
  """
  limit, need, compiles = start_kib, 0, 0
  while limit <= max_kib:
    result = compile_lowered(lowered, vmem_options(limit))
    compiles += 1
    if result.ok:
      if need:
        return VmemNeed(need, compiles)
      if limit <= 1:
        return VmemNeed(1024, compiles, exact=False)
      limit = max(1, limit // 8)
      continue
    found = _SCOPED.search(result.error)
    if not found:
      return None
    need = int(float(found.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30}[found.group(2)])
    limit = max(limit + 64, -(-need // 1024) + 16)
  return None


# One chip of each generation libtpu knows (v4's smallest topology holds two devices; a TPU7x
# chip is two devices, one per TensorCore, each with its own VMEM).
SINGLE_CHIP = {"v4": "v4:1x1x1", "v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1",
               "tpu7x": "tpu7x:1x1"}


def chip_mesh(chip: str, axis: str = "x") -> Any:
  """A one-device mesh of one ``chip`` (``v4``, ``v5e``, ``v5p``, ``v6e``, ``tpu7x``)."""
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plan.target import generation_named  # pylint: disable=import-outside-toplevel
  chip = generation_named(chip).name
  return Mesh(list(topology_devices(SINGLE_CHIP[chip])[:1]), (axis,))


def abstract(shape: Sequence[int], dtype: Any, mesh: Any, spec: Any = None) -> Any:
  """A ``ShapeDtypeStruct`` placed on ``mesh`` (replicated unless ``spec``)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  return jax.ShapeDtypeStruct(tuple(shape), dtype,
                              sharding=NamedSharding(mesh, spec or PartitionSpec()))
