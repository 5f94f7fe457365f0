"""One prepared SVG call: every decision made once per (config, grid, expert, target); off TPU with
``svg_backend: auto``, a TPU and an XLA branch (:meth:`PreparedCall.per_platform`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax

from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.per_head import HeadBudget
from maxdiffusion_svg.budgets.per_layer import Rung
from maxdiffusion_svg.kernels.api import SparseKernel, prepare_kernel
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import Executor, Target, call_executors, resolve_call
from maxdiffusion_svg.plan.tiles import TilePlan
from maxdiffusion_svg.plan.tiling import SplashTiles
from maxdiffusion_svg.routing.router import RouterConfig
from maxdiffusion_svg.routing.semantic import SemanticConfig, group_size


@dataclasses.dataclass(frozen=True)
class Branch:
  """One executor on one target, with its kernels: what a call runs on that platform."""

  executor: Executor  # backend and target (and the TPU a lowering for one is held to)
  tiles: SplashTiles
  plan: TilePlan  # the sparse plan every head shares (with per-head budgets: their carrier)
  compensation_blocks: int  # centroids per key tile; 0: off
  grid: VideoGrid
  heads: HeadBudget | None = None  # each head's own plan (svg_head_densities), else None
  # The leading frames' dense rows (svg_dense_frames): every key tile of their query tiles.
  rows_plan: TilePlan | None = None
  kernel: SparseKernel = dataclasses.field(init=False, repr=False, compare=False)
  # The schedule's dense branch: every tile of the same tiles, no mask, and its kernel.
  dense_plan: TilePlan = dataclasses.field(init=False, repr=False, compare=False)
  dense_kernel: SparseKernel = dataclasses.field(init=False, repr=False, compare=False)
  rows_kernel: SparseKernel | None = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    dense_plan = SvgConfig.dense_plan_on(self.grid, self.tiles)
    # Splash runs whole sequences only: the rows (a rectangle) take our kernel on a TPU (auto:
    # the XLA path where the host runs them).
    rows_kernel = None if self.rows_plan is None else self.kernel_for(
        self.rows_plan, "auto" if self.backend == "splash" else None)
    for name, value in (("kernel", self.kernel_for(self.plan)), ("dense_plan", dense_plan),
                        ("dense_kernel", self.kernel_for(dense_plan)),
                        ("rows_kernel", rows_kernel)):
      object.__setattr__(self, name, value)

  @property
  def backend(self) -> str:
    return self.executor.backend

  @property
  def target(self) -> Target:
    return self.executor.target

  def kernel_for(self, plan: TilePlan, backend: str | None = None) -> SparseKernel:
    """This executor's kernel on another plan of the same tiles, or ``backend``'s on them."""
    if backend is not None and backend != self.executor.backend:
      return prepare_kernel(plan, self.executor.target, backend=backend, tpu=self.executor.tpu)
    return prepare_kernel(plan, self.executor.target, backend=self.executor.backend,
                          block_kv_compute=self.tiles.block_kv_compute, tpu=self.executor.tpu)


@dataclasses.dataclass(frozen=True)
class PreparedCall:
  """Everything an SVG call decides before seeing data; one :class:`Branch` per executor."""

  config: SvgConfig
  grid: VideoGrid
  expert: str | None
  target: Target
  branches: tuple[Branch, ...]  # (TPU, host) behind the lowering platform, or one

  @property
  def host(self) -> Branch:
    """The branch this host's executor lowers: whose plan a call's info reports."""
    return self.branches[-1]

  @functools.cached_property
  def router(self) -> RouterConfig:
    """How the router samples rows (:attr:`SvgConfig.router`)."""
    return self.config.router

  @functools.cached_property
  def semantic(self) -> SemanticConfig | None:
    """How semantic heads are clustered (None where semantic is not among the layouts)."""
    return self.config.semantic

  @functools.cached_property
  def semantic_group(self) -> int:
    """Tokens a semantic head's placement moves together (:func:`group_size`)."""
    return group_size(self.grid)

  def per_platform(self, build: Callable[[Branch], Callable[..., Any]]) -> Callable[..., Any]:
    """``build(branch)`` for the executor the call runs on (two branches: both, behind
    ``lax.platform_dependent``)."""
    if len(self.branches) == 1:
      return build(self.branches[0])
    tpu, default = (build(branch) for branch in self.branches)
    return lambda *xs: jax.lax.platform_dependent(*xs, tpu=tpu, default=default)

  def at_density(self, density: float) -> "PreparedCall":
    """This call with every layer at ``density``, on the same target and executors."""
    return self.at_rung(Rung(density, self.config.compensation))

  def at_rung(self, rung: Rung) -> "PreparedCall":
    """This call with every layer at ``rung`` (density and compensation), same executors."""
    return _prepared(self.config.at_rung(rung), self.grid, self.expert, self.target,
                     tuple(branch.executor for branch in self.branches))

  def on_ring(self, ulysses: int, ring: int) -> "PreparedCall":
    """This call on a ring of ``ring`` shards: semantic left out, tiles and plans unchanged."""
    config = self.config.on_ring(ulysses, ring)
    return self if config is self.config else dataclasses.replace(self, config=config)


def prepare(config: SvgConfig, grid: VideoGrid, expert: str | None = None, *,
            target: Target | None = None, mesh: Any = None,
            arrays: Sequence[Any] = ()) -> PreparedCall:
  """The prepared call (cached). Target: ``target``, else ``mesh``'s, else what ``arrays`` or the
  mesh in context name, else the default device (``resolve_call``)."""
  resolved, executors = resolve_call(*arrays, target=target, mesh=mesh,
                                     vmem_limit_kib=config.vmem_limit_kib,
                                     backend=config.backend)
  return _prepared(config, grid, expert, resolved, executors)


def prepare_on(config: SvgConfig, grid: VideoGrid, target: Target,
               expert: str | None = None) -> PreparedCall:
  """:func:`prepare` on a resolved ``target`` (:meth:`SvgConfig.target`)."""
  return _prepared(config, grid, expert, target, call_executors(target, config.backend))


@functools.lru_cache(maxsize=64)
def _prepared(config: SvgConfig, grid: VideoGrid, expert: str | None, target: Target,
              executors: tuple[Executor, ...]) -> PreparedCall:
  branches = []
  for executor in executors:
    tiles = config.tiles_on(executor.target, executor.backend)
    heads = config.head_budget_on(grid, tiles, expert)
    plan = config.plan_on(grid, tiles, expert) if heads is None else heads.carrier
    branches.append(Branch(executor, tiles, plan, config.compensation_on(tiles), grid, heads,
                           config.dense_rows_plan_on(grid, tiles)))
  return PreparedCall(config, grid, expert, target, tuple(branches))
