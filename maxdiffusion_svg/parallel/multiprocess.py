"""Several JAX processes on one machine, as the hosts of a multi-host TPU slice would be.

Each joins ``jax.distributed`` (loopback coordinator, CPU, gloo); on a timeout or failure all are
killed and the error carries every log. The environment mimics a launcher's (Open MPI,
``JAX_COORDINATOR_ADDRESS``), so code calling ``jax.distributed.initialize()`` itself joins too
(pass ``initialize=False``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

_ENV_PREFIX = "MDSVG_MP_"
_LEAVE_TIMEOUT_S = 120.0  # how long a finished process waits for the others' results


@dataclasses.dataclass(frozen=True)
class ProcessResult:
  index: int
  returncode: int | None  # None: killed at the timeout
  log: str
  value: Any = None


class ProcessesFailed(RuntimeError):
  """Raised when a process fails or time runs out; ``results`` hold every process's log."""

  def __init__(self, message: str, results: Sequence[ProcessResult]):
    logs = "\n".join(f"--- process {r.index} (exit {r.returncode}) ---\n{r.log[-4000:]}"
                     for r in results)
    super().__init__(f"{message}\n{logs}")
    self.results = list(results)


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def run_processes(worker: str, num_processes: int, *, devices_per_process: int = 4,
                  args: Any = None, timeout: float = 300.0,
                  env: dict[str, str] | None = None, initialize: bool = True,
                  kill_on_failure: bool = True) -> list[Any]:
  """Runs ``worker`` ("module:function", as ``function(process_index, args)``) in
  ``num_processes`` processes; returns their results in order. ``kill_on_failure=False``: the
  others run on to the timeout."""
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError(f"num_processes and devices_per_process must be >= 1, got "
                     f"{num_processes}, {devices_per_process}")
  module, _, function = worker.partition(":")
  if not module or not function:
    raise ValueError(f"worker must be 'module:function', got {worker!r}")
  port = free_port()
  with tempfile.TemporaryDirectory(prefix="mdsvg-mp-") as tmp:
    folder = pathlib.Path(tmp)
    (folder / "args.json").write_text(json.dumps(args), encoding="utf-8")
    procs = []
    for index in range(num_processes):
      child_env = {**os.environ, **(env or {}),
                   f"{_ENV_PREFIX}WORKER": worker, f"{_ENV_PREFIX}DIR": tmp,
                   f"{_ENV_PREFIX}INITIALIZE": "1" if initialize else "",
                   f"{_ENV_PREFIX}INDEX": str(index),
                   # What jax.distributed.initialize() detects without arguments.
                   "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                   "OMPI_MCA_orte_hnp_uri": "4096.0;tcp://127.0.0.1:1",
                   "OMPI_COMM_WORLD_SIZE": str(num_processes),
                   "OMPI_COMM_WORLD_RANK": str(index),
                   "OMPI_COMM_WORLD_LOCAL_RANK": str(index),
                   "JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}"}
      log = open(folder / f"log{index}.txt", "w", encoding="utf-8")  # pylint: disable=consider-using-with
      procs.append((subprocess.Popen([sys.executable, "-m", __name__], env=child_env,  # pylint: disable=consider-using-with
                                     stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p, _ in procs):
      failed = kill_on_failure and any(p.poll() not in (None, 0) for p, _ in procs)
      if time.monotonic() > deadline or failed:
        timed_out = time.monotonic() > deadline
        for p, _ in procs:
          if p.poll() is None:
            p.kill()
        break
      time.sleep(0.1)
    results = []
    for index, (p, log) in enumerate(procs):
      code = p.wait()
      log.close()
      out = folder / f"result{index}.json"
      value = json.loads(out.read_text(encoding="utf-8")) if out.exists() else None
      results.append(ProcessResult(index, None if timed_out and code < 0 else code,
                                   (folder / f"log{index}.txt").read_text(encoding="utf-8"),
                                   value))
  if timed_out:
    raise ProcessesFailed(f"{worker} did not finish in {timeout:.0f} s", results)
  if any(r.returncode != 0 for r in results):
    raise ProcessesFailed(f"{worker} failed", results)
  return [r.value for r in results]


def _child() -> None:
  env = os.environ
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  index = int(env[f"{_ENV_PREFIX}INDEX"])
  if env.get(f"{_ENV_PREFIX}INITIALIZE"):
    jax.distributed.initialize(initialization_timeout=120)  # from the job's environment
  module, _, function = env[f"{_ENV_PREFIX}WORKER"].partition(":")
  folder = pathlib.Path(env[f"{_ENV_PREFIX}DIR"])
  args = json.loads((folder / "args.json").read_text(encoding="utf-8"))
  value = getattr(importlib.import_module(module), function)(index, args)
  (folder / f"result{index}.json").write_text(json.dumps(value), encoding="utf-8")
  if jax.distributed.is_initialized():
    # Every process leaves once all have written their results, and without
    # jax.distributed.shutdown(): the coordinator's service can abort as it is destroyed while
    # a peer's own shutdown request is still in flight (seen in CI: "Check failed:
    # queue.Pop() == nullptr" in DistributedRuntimeService::Shutdown, after the work was done).
    _all_written(folder, int(env["OMPI_COMM_WORLD_SIZE"]), _LEAVE_TIMEOUT_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # pylint: disable=protected-access


def _all_written(folder: pathlib.Path, count: int, timeout: float) -> None:
  """Waits (at most ``timeout`` seconds) until ``count`` processes' results are in ``folder``."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if all((folder / f"result{i}.json").exists() for i in range(count)):
      return
    time.sleep(0.05)


if __name__ == "__main__":
  _child()
