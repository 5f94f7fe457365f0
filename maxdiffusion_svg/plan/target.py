"""The hardware a call is compiled for (platform, TPU generation, memory limits), not the host:
an AOT export for a v6e from a CPU host picks the TPU kernel and fits a v6e. A TPU of unknown
generation gets the strictest known limits."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable

MIB = 2**20
# libtpu's flag for the scoped-VMEM limit every kernel compiles under (MaxDiffusion's Wan
# runs set --xla_tpu_scoped_vmem_limit_kib=65536 in LIBTPU_INIT_ARGS).
VMEM_FLAG = "xla_tpu_scoped_vmem_limit_kib"
VMEM_KEY = "svg_vmem_limit_kib"


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
  """One TPU generation's limits as its compiler applies them (per TensorCore: one JAX device,
  except v4 and v5p, whose two TensorCores form one megacore device)."""

  name: str
  device_kinds: tuple[str, ...]  # jax Device.device_kind values
  default_scoped_vmem: int  # bytes, the limit without --xla_tpu_scoped_vmem_limit_kib
  vmem: int  # physical VMEM: the most a raised limit can give
  smem: int  # scalar memory, where Splash keeps its tile tables
  # bf16 matrix FLOP/s per JAX device, as Google Cloud's TPU pages state them (TPU7x: half a
  # chip's): the MXU floor a timed call is set beside.
  peak_flops: float = 0.0


# Limits are the compiler's own: its CompileTimeScopedVmemOom and SMEM messages name them
# (tests/tpu/test_tpu_compile.py checks them against libtpu; docs/reference.md lists them).
GENERATIONS: dict[str, TpuGeneration] = {g.name: g for g in (
    TpuGeneration("v4", ("TPU v4",), 16 * MIB, 16 * MIB, 1 * MIB, 275e12),
    TpuGeneration("v5e", ("TPU v5 lite", "TPU v5e"), 16 * MIB, 128 * MIB, 1 * MIB, 197e12),
    TpuGeneration("v5p", ("TPU v5", "TPU v5p"), 16 * MIB, 96 * MIB, 1 * MIB, 459e12),
    TpuGeneration("v6e", ("TPU v6 lite", "TPU v6e"), 32 * MIB, 128 * MIB, 1 * MIB, 918e12),
    # Two TensorCores per chip, each its own JAX device with its own VMEM.
    TpuGeneration("tpu7x", ("TPU7x",), 32 * MIB, 64 * MIB, 1 * MIB, 1153.5e12),
)}
# A TPU whose generation nothing names (only the lowering platform says TPU), or a newer one:
# held to the smallest limits of the known ones, so what passes for it compiles on all.
GENERIC_TPU = TpuGeneration(
    "unknown", (), min(g.default_scoped_vmem for g in GENERATIONS.values()),
    min(g.vmem for g in GENERATIONS.values()), min(g.smem for g in GENERATIONS.values()))
CHIP_ALIASES = {"v7x": "tpu7x"}


def generation_named(name: str, key: str = "chip") -> TpuGeneration:
  """A generation by name (``v6e``, ``tpu7x``, alias ``v7x``); an error names ``key``."""
  name = CHIP_ALIASES.get(name, name)
  if name not in GENERATIONS:
    raise ValueError(f"{key} must be one of {', '.join(GENERATIONS)} (or v7x), got {name!r}")
  return GENERATIONS[name]


def generation_for_kind(device_kind: str) -> TpuGeneration:
  for generation in GENERATIONS.values():
    if device_kind in generation.device_kinds:
      return generation
  return GENERIC_TPU


def vmem_limit_from_flags(flags: str | None = None) -> int | None:
  """The scoped-VMEM limit (bytes) ``LIBTPU_INIT_ARGS`` (or ``flags``) raises, if any."""
  flags = os.environ.get("LIBTPU_INIT_ARGS", "") if flags is None else flags
  found = re.findall(rf"--{VMEM_FLAG}=(\S*)", flags)
  if not found:
    return None
  if not found[-1].isdigit():
    raise ValueError(f"LIBTPU_INIT_ARGS: --{VMEM_FLAG} must be a whole number of KiB, got "
                     f"{found[-1]!r}")
  return int(found[-1]) * 1024


@dataclasses.dataclass(frozen=True)
class Target:
  """Where a call runs: ``platform`` (``tpu``, ``cpu``, ``gpu``), TPU generation, scoped-VMEM
  limit and that limit's source."""

  platform: str
  generation: TpuGeneration | None = None
  vmem_limit: int | None = None  # bytes; None off TPU
  vmem_source: str = ""  # svg_vmem_limit_kib, LIBTPU_INIT_ARGS, or the generation's default
  # The inputs or a mesh named this platform: the call is lowered for it and nothing else. A
  # non-TPU target nothing named (the host's) may still be lowered for a TPU (an export).
  pinned: bool = False
  # A TPU assumed for the TPU branch of a call whose platform nothing named: its refusals wait
  # until a lowering for a TPU (kernels/refusal.py), so runs on this host are unaffected.
  speculative: bool = False
  # Derived, as plain values (read on every call's path, decided when the target is made):
  is_tpu: bool = dataclasses.field(init=False, repr=False, compare=False)
  # A TPU whose generation is named (not held to the strictest limits).
  known: bool = dataclasses.field(init=False, repr=False, compare=False)
  smem: int | None = dataclasses.field(init=False, repr=False, compare=False)
  # Nothing named the platform and it is not a TPU: the call may still be lowered for a TPU
  # (an ahead-of-time export from a CPU host), see :func:`follows_lowering_platform`.
  follows_lowering: bool = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    tpu = self.platform == "tpu"
    derived = {"is_tpu": tpu, "known": tpu and self.generation is not GENERIC_TPU,
               "smem": self.generation.smem if self.generation else None,
               "follows_lowering": not tpu and not self.pinned}
    for name, value in derived.items():
      object.__setattr__(self, name, value)

  @property
  def chip(self) -> str:
    return f"TPU {self.generation.name}" if self.known else "a TPU of unknown generation"

  def describe(self) -> str:
    if not self.is_tpu:
      return self.platform
    strictest = "" if self.known else " (held to the strictest known limits)"
    return (f"{self.chip}{strictest}, scoped VMEM {self.vmem_limit / MIB:g} MiB "
            f"({self.vmem_source})")

  def with_vmem_limit(self, vmem_limit_kib: int | None) -> "Target":
    """This target under ``svg_vmem_limit_kib`` (None: unchanged)."""
    if not vmem_limit_kib or not self.is_tpu:
      return self
    return dataclasses.replace(tpu_target(self.generation, vmem_limit_kib), pinned=self.pinned)


def tpu_target(generation: TpuGeneration | str = GENERIC_TPU, vmem_limit_kib: int | None = None,
               flags: str | None = None) -> Target:
  """A TPU target. VMEM limit: ``vmem_limit_kib``, else ``flags``' ``LIBTPU_INIT_ARGS`` (None:
  this process's) capped at the chip's VMEM, else the generation's default."""
  if isinstance(generation, str):
    generation = generation_named(generation)
  if vmem_limit_kib:
    limit = vmem_limit_kib * 1024
    if limit > generation.vmem:
      chip = f"TPU {generation.name}" if generation is not GENERIC_TPU else (
          "a TPU of unknown generation (the smallest known VMEM)")
      raise ValueError(f"{VMEM_KEY} asks for {vmem_limit_kib} KiB of scoped VMEM, more than "
                       f"{chip}'s {generation.vmem // 1024} KiB")
    return Target("tpu", generation, limit, VMEM_KEY)
  raised = vmem_limit_from_flags(flags)
  if raised:
    return Target("tpu", generation, min(raised, generation.vmem), "LIBTPU_INIT_ARGS")
  source = "the chip's default" if generation is not GENERIC_TPU else "the strictest known default"
  return Target("tpu", generation, generation.default_scoped_vmem, source)


def target_for_devices(devices: Iterable[Any], vmem_limit_kib: int | None = None) -> Target:
  """The target of devices: concrete, a topology's abstract ones, or a mesh's ``AbstractDevice``."""
  device = next(iter(devices))
  if device.platform != "tpu":
    return Target(device.platform)
  return tpu_target(generation_for_kind(device.device_kind), vmem_limit_kib)


def target_of(mesh: Any = None, vmem_limit_kib: int | None = None) -> Target:
  """The target of ``mesh``'s devices; without a mesh, of the default device."""
  named = _mesh_device(mesh)
  if named is not None:
    return target_for_devices([named], vmem_limit_kib)
  import jax  # pylint: disable=import-outside-toplevel
  return target_for_devices(jax.devices()[:1], vmem_limit_kib)


def _mesh_device(mesh: Any) -> Any:
  """A device (or AbstractDevice) a concrete or abstract mesh names, if any."""
  if mesh is None:
    return None
  from jax.sharding import AbstractMesh  # pylint: disable=import-outside-toplevel
  if isinstance(mesh, AbstractMesh):
    return mesh.abstract_device
  devices = getattr(mesh, "devices", None)
  return devices.flat[0] if devices is not None and devices.size else None


def _array_device(x: Any) -> Any:
  """The device an input names: a traced value's mesh (``jax.typeof``), a concrete array's."""
  import jax  # pylint: disable=import-outside-toplevel
  try:
    sharding = jax.typeof(x).sharding
  except (TypeError, AttributeError):
    sharding = None
  named = _mesh_device(getattr(sharding, "mesh", None))
  if named is not None:
    return named
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return next(iter(x.sharding.device_set), None)
  return None


def target_for_call(*arrays: Any, target: Target | None = None, mesh: Any = None,
                    vmem_limit_kib: int | None = None) -> Target:
  """A call's target: ``target``, else ``mesh``'s, else what the inputs' sharding or the mesh
  in context names, else the default device's; ``vmem_limit_kib`` applies to any of them."""
  if target is not None:
    return target.with_vmem_limit(vmem_limit_kib)
  import jax  # pylint: disable=import-outside-toplevel
  candidates = [_mesh_device(mesh)] + [_array_device(x) for x in arrays]
  candidates.append(_mesh_device(jax.sharding.get_abstract_mesh()))
  for device in candidates:
    if device is not None:
      return dataclasses.replace(target_for_devices([device], vmem_limit_kib), pinned=True)
  return target_for_devices(jax.devices()[:1], vmem_limit_kib)


BACKENDS = ("auto", "pallas", "splash", "xla")
# Kernels that compile only for a TPU (interpreted elsewhere); ``auto`` picks the first there.
TPU_BACKENDS = ("pallas", "splash")


def resolve_backend(backend: str, target: Target | None = None) -> str:
  """``auto``: our Pallas kernel on a TPU target, else XLA (None target: the default device)."""
  if backend not in BACKENDS:
    raise ValueError(f"svg_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
  if backend == "auto":
    return TPU_BACKENDS[0] if (target or target_of()).is_tpu else "xla"
  return backend


def follows_lowering_platform(target: Target) -> bool:
  """An unpinned non-TPU target, which may still be lowered for a TPU (AOT export): both
  executors are traced and ``lax.platform_dependent`` keeps one."""
  return target.follows_lowering


def lowering_tpu_target(target: Target) -> Target:
  """The TPU a call is held to: ``target``, else one of unknown generation whose refusals
  wait for the lowering."""
  if target.is_tpu:
    return target
  return dataclasses.replace(tpu_target(GENERIC_TPU), speculative=True)


@dataclasses.dataclass(frozen=True)
class Executor:
  """An executor a call may run: resolved ``backend`` on ``target``, held to ``tpu`` on a TPU."""

  backend: str
  target: Target
  tpu: Target


def call_executors(target: Target, backend: str) -> tuple[Executor, ...]:
  """The executors a call on a resolved ``target`` runs: one, or with ``auto`` where lowering
  decides, our TPU kernel (unknown-generation limits) and XLA, of which the lowering keeps one."""
  if backend == "auto" and target.follows_lowering:
    tpu = lowering_tpu_target(target)
    return Executor(TPU_BACKENDS[0], tpu, tpu), Executor("xla", target, tpu)
  return (Executor(resolve_backend(backend, target), target, lowering_tpu_target(target)),)


def resolve_call(*arrays: Any, target: Target | None = None, mesh: Any = None,
                 vmem_limit_kib: int | None = None,
                 backend: str = "auto") -> tuple[Target, tuple[Executor, ...]]:
  """A call's target and executors (:func:`target_for_call`, :func:`call_executors`)."""
  resolved = target_for_call(*arrays, target=target, mesh=mesh, vmem_limit_kib=vmem_limit_kib)
  return resolved, call_executors(resolved, backend)
