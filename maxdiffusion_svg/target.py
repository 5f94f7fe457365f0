"""The hardware a call is compiled for: platform, TPU generation and its on-chip memory limits.

Everything chosen by platform (the executor behind ``svg_backend: auto``, Splash tile defaults,
the VMEM and SMEM checks, the plugin's dense kernel) follows the devices the call is compiled
for, not the process's default backend: a Wan forward compiled ahead of time for a v6e slice
from a CPU host must pick the TPU kernel and fit a v6e's memory. Those devices are the mesh's
when there is one (``target_of``); without one, the default device's, and a TPU generation
only when that device is a TPU (``svg_attention`` adds the lowering platform on top).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable

MIB = 2**20
# libtpu's flag for the scoped-VMEM limit every kernel compiles under (MaxDiffusion's Wan
# runs set --xla_tpu_scoped_vmem_limit_kib=65536 in LIBTPU_INIT_ARGS).
VMEM_FLAG = "xla_tpu_scoped_vmem_limit_kib"


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
  """One TPU generation's limits as its compiler applies them (per TensorCore)."""

  name: str
  device_kinds: tuple[str, ...]  # jax Device.device_kind values
  default_scoped_vmem: int  # bytes, the limit without --xla_tpu_scoped_vmem_limit_kib
  vmem: int  # physical VMEM: the most a raised limit can give
  smem: int  # scalar memory, where Splash keeps its tile tables


# Default scoped-VMEM limits are the compiler's own (its CompileTimeScopedVmemOom message
# names them; tests/test_tpu_compile.py checks them against libtpu).
GENERATIONS: dict[str, TpuGeneration] = {g.name: g for g in (
    TpuGeneration("v4", ("TPU v4",), 16 * MIB, 16 * MIB, 1 * MIB),
    TpuGeneration("v5e", ("TPU v5 lite", "TPU v5e"), 16 * MIB, 128 * MIB, 1 * MIB),
    TpuGeneration("v5p", ("TPU v5", "TPU v5p"), 16 * MIB, 96 * MIB, 1 * MIB),
    TpuGeneration("v6e", ("TPU v6 lite", "TPU v6e"), 32 * MIB, 128 * MIB, 1 * MIB),
)}
# A TPU whose generation is unknown (a newer chip, or only the lowering platform is known)
# gets the smallest limits of the known ones, so what is chosen for it compiles on all.
GENERIC_TPU = TpuGeneration("tpu", (), 16 * MIB, 16 * MIB, 1 * MIB)


def generation_for_kind(device_kind: str) -> TpuGeneration:
  for generation in GENERATIONS.values():
    if device_kind in generation.device_kinds:
      return generation
  return GENERIC_TPU


def vmem_limit_from_flags(flags: str | None = None) -> int | None:
  """The scoped-VMEM limit (bytes) ``LIBTPU_INIT_ARGS`` (or ``flags``) raises, if any."""
  flags = os.environ.get("LIBTPU_INIT_ARGS", "") if flags is None else flags
  found = re.findall(rf"--{VMEM_FLAG}=(\d+)", flags)
  return int(found[-1]) * 1024 if found else None


@dataclasses.dataclass(frozen=True)
class Target:
  """Where a call runs: ``platform`` (``tpu``, ``cpu``, ``gpu``), the TPU generation, and the
  scoped-VMEM limit its kernels compile under (the generation's default unless raised)."""

  platform: str
  generation: TpuGeneration | None = None
  vmem_limit: int | None = None  # bytes; None off TPU

  @property
  def is_tpu(self) -> bool:
    return self.platform == "tpu"

  @property
  def smem(self) -> int | None:
    return self.generation.smem if self.generation else None

  def describe(self) -> str:
    if not self.is_tpu:
      return self.platform
    return f"TPU {self.generation.name}, scoped VMEM {self.vmem_limit / MIB:g} MiB"


def tpu_target(generation: TpuGeneration | str = GENERIC_TPU,
               vmem_limit_kib: int | None = None) -> Target:
  """A TPU target; the VMEM limit is ``vmem_limit_kib``, else ``LIBTPU_INIT_ARGS``'s (capped at
  the chip's VMEM, as the compiler caps it), else the generation's default."""
  if isinstance(generation, str):
    if generation not in GENERATIONS:
      raise ValueError(f"TPU generation must be one of {', '.join(GENERATIONS)}, "
                       f"got {generation!r}")
    generation = GENERATIONS[generation]
  if vmem_limit_kib:
    limit = vmem_limit_kib * 1024
    if limit > generation.vmem:
      raise ValueError(f"svg_vmem_limit_kib asks for {vmem_limit_kib} KiB of scoped VMEM, more "
                       f"than TPU {generation.name}'s {generation.vmem // 1024} KiB")
  else:
    flags = vmem_limit_from_flags()
    limit = min(flags, generation.vmem) if flags else generation.default_scoped_vmem
  return Target("tpu", generation, limit)


def target_for_devices(devices: Iterable[Any], vmem_limit_kib: int | None = None) -> Target:
  """The target of a set of devices (concrete, or a topology's abstract TPU devices)."""
  device = next(iter(devices))
  if device.platform != "tpu":
    return Target(device.platform)
  return tpu_target(generation_for_kind(device.device_kind), vmem_limit_kib)


def target_of(mesh: Any = None, vmem_limit_kib: int | None = None) -> Target:
  """The target of ``mesh``'s devices; without a mesh, of the default device."""
  if mesh is not None and getattr(mesh, "devices", None) is not None:
    return target_for_devices(mesh.devices.flat, vmem_limit_kib)
  import jax  # pylint: disable=import-outside-toplevel
  return target_for_devices(jax.devices()[:1], vmem_limit_kib)
