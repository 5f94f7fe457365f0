"""Checks that a job can run as configured, made after ``jax.distributed`` starts and before any
weights load.

Every process of a multi-host job runs the same checks on the same inputs, so a bad job
fails in every process at once with the same message, and no process is left waiting in a
collective for a peer that already exited. Nothing here imports MaxDiffusion: the hook that
calls :func:`check_job` (``hooks._preflight``) reads the values from MaxDiffusion's config.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

# TPU types whose number counts TensorCores (two per chip, one JAX device per chip: megacore).
_CORE_COUNTED = ("v2", "v3", "v4", "v5p")
# TPU7x counts TensorCores too, and each is its own JAX device (libtpu: two per chip).


@dataclasses.dataclass(frozen=True)
class Job:
  """What the processes of a job see of it."""

  process_count: int
  device_count: int
  local_device_count: int
  context_shards: int  # the mesh's context axis (where the head exchange runs)
  heads: int  # the transformer's attention heads
  output_dir: str = ""
  run_name: str = ""


def declared_hosts(env: Mapping[str, str]) -> tuple[int, str] | None:
  """How many processes the launcher started, and the variable that says so (GKE's TPU webhook
  sets ``TPU_WORKER_HOSTNAMES``; Open MPI-style launchers ``OMPI_COMM_WORLD_SIZE``)."""
  hostnames = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  if len(hostnames) > 1:
    return len(hostnames), "TPU_WORKER_HOSTNAMES"
  for name in ("JAX_NUM_PROCESSES", "OMPI_COMM_WORLD_SIZE"):
    if env.get(name, "").strip().isdigit():
      return int(env[name]), name
  return None


def slice_devices(accelerator_type: str) -> int | None:
  """JAX devices of a TPU slice type (``v6e-16`` -> 16, ``v5p-8`` -> 4: v4 and v5p count
  TensorCores; ``tpu7x-8`` -> 8: one device per TensorCore); None for a name that is not
  ``<generation>-<count>``."""
  match = re.fullmatch(r"(v\d+[a-z]*?|tpu7x|v7x)(?:litepod)?-(\d+)", accelerator_type.strip())
  if match is None:
    return None
  count = int(match.group(2))
  return count // 2 if match.group(1) in _CORE_COUNTED else count


def check_processes(job: Job, env: Mapping[str, str]) -> None:
  """The processes that joined are the ones started, and they hold the whole slice.

  MaxDiffusion logs a warning and goes on alone when ``jax.distributed.initialize()`` fails,
  which would run every host as a separate one-host job writing the same video."""
  declared = declared_hosts(env)
  if declared is not None and declared[0] != job.process_count:
    count, name = declared
    raise ValueError(
        f"{name} declares {count} processes, but jax.distributed joined {job.process_count} "
        f"(with {job.device_count} devices): distributed initialisation failed or timed out "
        f"(MaxDiffusion logs a warning and continues alone). Check the coordinator address "
        f"and that every host of the slice started; set skip_jax_distributed_system=False.")
  accelerator = env.get("TPU_ACCELERATOR_TYPE", "")
  expected = slice_devices(accelerator) if accelerator else None
  if expected is not None and expected != job.device_count:
    hosts = max(1, expected // max(1, job.local_device_count))
    raise ValueError(
        f"TPU_ACCELERATOR_TYPE {accelerator} has {expected} devices, but this job holds "
        f"{job.device_count} ({job.process_count} processes x {job.local_device_count}): start "
        f"one process per host of the slice ({hosts} hosts of {job.local_device_count} "
        f"devices: JobSet parallelism and completions = {hosts}).")


def check_heads(job: Job) -> None:
  """The head exchange gives each context shard ``heads / shards`` heads."""
  if job.heads % job.context_shards:
    allowed = [n for n in range(1, job.heads + 1) if job.heads % n == 0]
    raise ValueError(
        f"the mesh's context axis has {job.context_shards} shards, which do not divide the "
        f"model's {job.heads} attention heads; the svg kernel needs a divisor of {job.heads} "
        f"({', '.join(map(str, allowed))}). Move the remaining devices to another axis, e.g. "
        f"ici_data_parallelism or ici_fsdp_parallelism (ici_context_parallelism: -1 takes the "
        f"rest).")


def check_run_name(output_dir: str, run_name: str) -> None:
  """A ``gs://`` output needs a run name: MaxDiffusion uploads each video to
  ``output_dir/run_name`` only after the whole generation, and an unset name fails there."""
  if output_dir.startswith("gs://") and not run_name:
    raise ValueError(f"run_name is not set and JOBSET_NAME is not in the environment, but "
                     f"output_dir {output_dir!r} is a bucket: MaxDiffusion uploads each video "
                     f"to output_dir/run_name after generating it. Give run_name=NAME.")


def check_job(job: Job, env: Mapping[str, str]) -> None:
  """Every check, cheapest first."""
  check_run_name(job.output_dir, job.run_name)
  check_processes(job, env)
  check_heads(job)
