"""``SvgConfig``: every SVG setting, read from MaxDiffusion-style flat ``svg_*`` YAML keys."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from maxdiffusion_svg.budgets.budget import Budget
from maxdiffusion_svg.budgets.config_keys import DEFAULT_NUM_STEPS, DEFAULT_PRESET, config_kwargs
from maxdiffusion_svg.budgets.per_head import HeadBudget, check_head_densities, head_budget
from maxdiffusion_svg.budgets.per_layer import Rung, check_layer_compensation, check_layer_densities
from maxdiffusion_svg.budgets.schedule import PRESETS, Schedule
from maxdiffusion_svg.kernels.api import BACKENDS
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.masks import check_density
from maxdiffusion_svg.plan.target import VMEM_FLAG, Target, target_for_call
from maxdiffusion_svg.plan.tiles import (TILE_QUANTUM, TileMode, TilePlan, check_block_size,
                                         dense_rows_plan, plan_tiles)
from maxdiffusion_svg.plan.tiling import SplashTiles, choose_tiles
from maxdiffusion_svg.routing.compensation import check_compensation
from maxdiffusion_svg.routing.layouts import DEFAULT_LAYOUTS, SEMANTIC, check_layouts, ring_layouts
from maxdiffusion_svg.routing.router import RouterConfig
from maxdiffusion_svg.routing.semantic import SEMANTIC_CRITERION, SemanticConfig, check_semantic

EXPERTS = ("high_noise", "low_noise")  # Wan 2.2's two transformers


@dataclasses.dataclass(frozen=True)
class SvgConfig:
  """SVG settings. Defaults are the ``moderate`` preset for a 50-step run."""

  density: float = PRESETS[DEFAULT_PRESET].density
  high_noise_density: float | None = None  # Wan 2.2 high-noise expert; None = density
  low_noise_density: float | None = None  # Wan 2.2 low-noise expert; None = density
  schedule: Schedule = PRESETS[DEFAULT_PRESET].schedule(DEFAULT_NUM_STEPS)
  # One density per layer (``calibrate`` writes them; maxdiffusion_svg.budgets.per_layer); None:
  # every
  # layer the expert's density. Each Wan 2.2 expert may have its own.
  layer_densities: tuple[float, ...] | None = None
  high_noise_layer_densities: tuple[float, ...] | None = None
  low_noise_layer_densities: tuple[float, ...] | None = None
  tile_mode: TileMode | str = TileMode.ALIGNED
  # None or 0: the target's default (XLA: 512; ours: 3328x1536/512; Splash: by the VMEM limit).
  block_q: int | None = None
  block_kv: int | None = None
  block_kv_compute: int | None = None
  backend: str = "auto"
  # The scoped-VMEM limit (KiB) TPU kernels compile under; None or 0: LIBTPU_INIT_ARGS's
  # --xla_tpu_scoped_vmem_limit_kib, else the generation's default.
  vmem_limit_kib: int | None = None
  include_sink: bool = True
  # Frames the sink covers (VACE with R reference images: R; they lead the grid).
  sink_frames: int = 1
  # Leading frames whose queries attend every key (VACE's reference images, Animate's reference
  # slot): a dense call of those rows replaces their sparse ones. 0: none (the sink alone).
  dense_frames: int = 0
  profile_queries: int = 64
  profile_pool: str = "stratified"
  sample_max_row: int = 10_000
  profile_masks: str = "execution"
  profile_seed: int = 0
  # Skipped key tiles enter each row's softmax as centroids (maxdiffusion_svg.routing.compensation).
  compensation: bool = False
  compensation_blocks: int = 8  # centroids per key tile; must divide the executor's block_kv
  # Compensation on or off per layer (``calibrate`` writes it beside the densities); None:
  # every layer ``compensation``. Each Wan 2.2 expert may have its own.
  layer_compensation: tuple[bool, ...] | None = None
  high_noise_layer_compensation: tuple[bool, ...] | None = None
  low_noise_layer_compensation: tuple[bool, ...] | None = None
  # One density per head, for every layer or per layer (maxdiffusion_svg.budgets.per_head); None:
  # every head the layer's density. Each Wan 2.2 expert may have its own.
  head_densities: tuple[tuple[float, ...], ...] | None = None
  high_noise_head_densities: tuple[tuple[float, ...], ...] | None = None
  low_noise_head_densities: tuple[tuple[float, ...], ...] | None = None
  # The head layouts the router chooses among (maxdiffusion_svg.routing.layouts); semantic: SVG2's
  # clustered order with a tile table per head (maxdiffusion_svg.routing.semantic).
  layouts: tuple[str, ...] = DEFAULT_LAYOUTS
  semantic_clusters: int = 32
  semantic_iterations: int = 4  # k-means updates of a cold start (a run's first semantic call)
  # ... from the previous step's centroids (the plugin's runs); 0: every step cold. Measured
  # (docs/benchmarks.md, "Warm starts across denoising steps"): no gain yet, so off.
  semantic_warm_iterations: int = 0

  def __post_init__(self):
    check_density(self.density, "svg_density")
    for name in ("high_noise_density", "low_noise_density"):
      if getattr(self, name) is not None:
        check_density(getattr(self, name), f"svg_{name}")
    for name in ("layer_densities", "high_noise_layer_densities", "low_noise_layer_densities"):
      object.__setattr__(self, name, check_layer_densities(getattr(self, name), f"svg_{name}"))
    object.__setattr__(self, "tile_mode", TileMode.parse(self.tile_mode, "svg_tile_mode"))
    for name in ("block_q", "block_kv", "block_kv_compute", "vmem_limit_kib"):
      if getattr(self, name) == 0 and not isinstance(getattr(self, name), bool):
        object.__setattr__(self, name, None)  # 0: the target's default (YAML cannot override null)
    for name in ("block_q", "block_kv", "block_kv_compute"):
      if getattr(self, name) is not None:
        check_block_size(getattr(self, name), f"svg_{name}")
    if self.block_kv and self.block_kv_compute and self.block_kv % self.block_kv_compute:
      raise ValueError(f"svg_block_kv_compute ({self.block_kv_compute}) must divide svg_block_kv "
                       f"({self.block_kv})")
    if self.vmem_limit_kib is not None and (
        isinstance(self.vmem_limit_kib, bool) or not isinstance(self.vmem_limit_kib, int)
        or self.vmem_limit_kib < 0):
      raise ValueError(f"svg_vmem_limit_kib must be an integer >= 0 (0: LIBTPU_INIT_ARGS's "
                       f"{VMEM_FLAG}, else the generation's default), got {self.vmem_limit_kib!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"svg_backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
    if not isinstance(self.include_sink, bool):
      raise ValueError(f"svg_include_sink must be true or false, got {self.include_sink!r}")
    if isinstance(self.sink_frames, bool) or not isinstance(self.sink_frames, int) or (
        self.sink_frames < 1):
      raise ValueError(f"svg_sink_frames must be an integer >= 1 (the leading frames every "
                       f"query attends, with svg_include_sink), got {self.sink_frames!r}")
    if isinstance(self.dense_frames, bool) or not isinstance(self.dense_frames, int) or (
        self.dense_frames < 0):
      raise ValueError(f"svg_dense_frames must be an integer >= 0 (leading frames whose queries "
                       f"attend every key; 0: none), got {self.dense_frames!r}")
    if isinstance(self.profile_seed, bool) or not isinstance(self.profile_seed, int):
      raise ValueError(f"svg_profile_seed must be an integer, got {self.profile_seed!r}")
    _ = self.router  # validates the router keys
    for name in ("layer_compensation", "high_noise_layer_compensation",
                 "low_noise_layer_compensation"):
      object.__setattr__(self, name, check_layer_compensation(getattr(self, name), f"svg_{name}"))
    check_compensation(self.compensation, self.compensation_blocks, self.block_kv)
    if self.compensates:  # a layer compensates: the blocks must fit the key tile as with the key
      check_compensation(True, self.compensation_blocks, self.block_kv)
    object.__setattr__(self, "layouts", check_layouts(self.layouts))
    self._check_head_densities()
    check_semantic(self.semantic_clusters, self.semantic_iterations,
                   warm_iterations=self.semantic_warm_iterations)
    if SEMANTIC in self.layouts:
      if self.tile_mode is not TileMode.ALIGNED:
        raise ValueError(f"svg_layouts with semantic needs svg_tile_mode aligned (a semantic head's "
                         f"tiles run whole), got {self.tile_mode.value}")
      if self.backend == "splash":
        raise ValueError("svg_layouts with semantic needs svg_backend pallas, xla or auto: Splash's "
                         "tile tables are static, a semantic head's are computed on device")

  def _check_head_densities(self) -> None:
    """Per-head budgets: read, and refused by key where they cannot run (yet)."""
    for expert in ("", "high_noise_", "low_noise_"):
      name = f"{expert}head_densities"
      object.__setattr__(self, name, check_head_densities(getattr(self, name), f"svg_{name}"))
    for expert in (None, *EXPERTS):
      key = self.head_key(expert)
      if self.head_densities_for(expert) is None:
        continue
      if self.layer_densities_for(expert) is not None:
        raise ValueError(f"{key} and {self.layer_key('densities', expert)} both set each "
                         f"layer's budget: give one (a per-head list per layer holds both)")
      if self.tile_mode is not TileMode.ALIGNED:
        raise ValueError(f"{key} needs svg_tile_mode aligned (a head's tiles run whole), got "
                         f"{self.tile_mode.value}")
      if self.backend == "splash":
        raise ValueError(f"{key} needs svg_backend pallas, xla or auto: Splash's tile tables "
                         f"are shared by every head")
      if self.layer_compensation_for(expert) is not None:
        raise ValueError(f"{key} with {self.layer_key('compensation', expert)} is not built "
                         f"yet: every head of a per-head budget compensates as svg_compensation "
                         f"says")
      if SEMANTIC in self.layouts:
        raise ValueError(f"{key} with semantic among svg_layouts is not built yet: a semantic "
                         f"head's table has the band's count per row")

  def budget(self, expert: str | None = None) -> Budget:
    """What ``expert``'s calls run (None: no experts): each value its own key's, else the
    shared one's."""
    if expert is not None and expert not in EXPERTS:
      raise ValueError(f"expert must be one of {', '.join(EXPERTS)} or None, got {expert!r}")
    fields = {"densities": "layer_densities", "compensation": "layer_compensation",
              "head": "head_densities"}
    own = frozenset(what for what, name in fields.items()
                    if expert and getattr(self, f"{expert}_{name}") is not None)
    value = lambda what: getattr(self, (f"{expert}_" if what in own else "") + fields[what])
    density = getattr(self, f"{expert}_density") if expert else None
    return Budget(expert, self.density if density is None else density, self.compensation,
                  value("densities"), value("compensation"), value("head"), own)

  def head_densities_for(self, expert: str | None = None) -> tuple[tuple[float, ...], ...] | None:
    """``expert``'s per-head densities, one list per layer (or one for all), or None."""
    return self.budget(expert).head_densities

  def head_key(self, expert: str | None = None) -> str:
    """The key :meth:`head_densities_for` reads for ``expert``."""
    return self.budget(expert).key("head")

  def head_budget_on(self, grid: VideoGrid, tiles: SplashTiles,
                     expert: str | None = None) -> HeadBudget | None:
    """Each head's plan on ``tiles``, or None where no per-head key is set for ``expert``."""
    densities = self.head_densities_for(expert)
    if densities is None:
      return None
    return head_budget(grid, densities, tiles.block_q, tiles.block_kv,
                       include_sink=self.include_sink, sink_frames=self.sink_of(grid))

  def on_ring(self, ulysses: int, ring: int) -> "SvgConfig":
    """This config as a ring of ``ring`` sequence shards runs it (no semantic layout)."""
    if ring <= 1 or SEMANTIC not in self.layouts:
      return self
    return dataclasses.replace(self, layouts=ring_layouts(self.layouts, ulysses, ring))

  @property
  def semantic(self) -> SemanticConfig | None:
    """How semantic heads are clustered and tiled (None where semantic is not a candidate);
    with compensation on, tiles are chosen by the error centroids would leave, not by mass."""
    if SEMANTIC not in self.layouts:
      return None
    return SemanticConfig(self.semantic_clusters, self.semantic_iterations,
                          self.semantic_warm_iterations, self.compensation_blocks,
                          criterion=SEMANTIC_CRITERION[self.compensation],
                          compensated=self.compensation)

  @property
  def router(self) -> RouterConfig:
    return RouterConfig(self.profile_queries, self.profile_pool, self.sample_max_row,
                        self.include_sink, self.profile_masks, self.sink_frames)

  # The budget's values one at a time (each reads :meth:`budget`).
  def density_for(self, expert: str | None = None) -> float:
    """The density of a Wan 2.2 expert (``high_noise``/``low_noise``), or the shared one."""
    return self.budget(expert).density

  def layer_densities_for(self, expert: str | None = None) -> tuple[float, ...] | None:
    """One density per layer for ``expert``, or None: every layer :meth:`density_for`."""
    return self.budget(expert).layer_densities

  def layer_compensation_for(self, expert: str | None = None) -> tuple[bool, ...] | None:
    """Compensation per layer for ``expert``, or None: every layer ``compensation``."""
    return self.budget(expert).layer_compensation

  def layer_key(self, what: str, expert: str | None = None) -> str:
    """The key ``expert``'s per-layer ``what`` (``densities``/``compensation``) is read from."""
    return self.budget(expert).key(what)

  def layer_rungs_for(self, expert: str | None = None) -> tuple[Rung, ...] | None:
    """Each layer's rung for ``expert``, or None where neither per-layer key is set; lists of
    two lengths are refused."""
    return self.budget(expert).layer_rungs

  def at_density(self, density: float) -> "SvgConfig":
    """This config with every layer (and expert) at ``density``."""
    return self.at_rung(Rung(density, self.compensation))

  def at_rung(self, rung: Rung) -> "SvgConfig":
    """This config with every layer (and expert) at ``rung``'s density and compensation."""
    return dataclasses.replace(self, density=rung.density, high_noise_density=None,
                               low_noise_density=None, layer_densities=None,
                               high_noise_layer_densities=None, low_noise_layer_densities=None,
                               compensation=bool(rung.compensation), layer_compensation=None,
                               head_densities=None, high_noise_head_densities=None,
                               low_noise_head_densities=None,
                               high_noise_layer_compensation=None,
                               low_noise_layer_compensation=None)

  def target(self, *arrays: Any, mesh: Any = None, target: Target | None = None) -> Target:
    """A call's target under ``svg_vmem_limit_kib``
    (:func:`maxdiffusion_svg.plan.target.target_for_call`)."""
    return target_for_call(*arrays, target=target, mesh=mesh,
                           vmem_limit_kib=self.vmem_limit_kib)

  def tiles(self, target: Target | None = None, backend: str | None = None) -> SplashTiles:
    """Tile and inner kv step on ``target`` (None: the default device)."""
    return self.tiles_on(self.target(target=target), backend or self.backend)

  def tiles_on(self, target: Target, backend: str) -> SplashTiles:
    """Tile and inner kv step on a resolved ``target``
    (:func:`maxdiffusion_svg.plan.tiling.choose_tiles`)."""
    return choose_tiles(target, backend, self.block_q, self.block_kv, self.block_kv_compute)

  def compensation_for(self, target: Target | None = None, backend: str | None = None) -> int:
    """Centroids per key tile a call compensates with on ``target`` (0: compensation off)."""
    if not self.compensation:
      return 0
    return self.compensation_on(self.tiles(target, backend))

  @property
  def compensates(self) -> bool:
    """Whether any call compensates: ``svg_compensation``, or a layer of a per-layer key."""
    return self.compensation or any(
        any(getattr(self, f"{expert}layer_compensation") or ())
        for expert in ("", "high_noise_", "low_noise_"))

  def any_compensation_for(self, target: Target | None = None, backend: str | None = None) -> int:
    """Centroids per key tile the compensating calls use on ``target`` (0: none compensates)."""
    if not self.compensates:
      return 0
    return dataclasses.replace(self, compensation=True).compensation_for(target, backend)

  def compensation_on(self, tiles: SplashTiles) -> int:
    """Centroids per key tile a call on ``tiles`` compensates with (0: off), checked against
    its key tile."""
    if not self.compensation:
      return 0
    check_compensation(True, self.compensation_blocks, tiles.block_kv)
    return self.compensation_blocks

  def plan(self, grid: VideoGrid, expert: str | None = None, target: Target | None = None,
           backend: str | None = None) -> TilePlan:
    """The tile plan every head of a call shares on ``target`` (:meth:`plan_on`)."""
    return self.plan_on(grid, self.tiles(target, backend), expert)

  def plan_on(self, grid: VideoGrid, tiles: SplashTiles, expert: str | None = None) -> TilePlan:
    """The tile plan every head of a call on ``tiles`` shares (built at trace time, cached)."""
    return plan_tiles(grid, self.density_for(expert), tiles.block_q, tiles.block_kv,
                      self.tile_mode, include_sink=self.include_sink,
                      sink_frames=self.sink_of(grid))

  def sink_of(self, grid: VideoGrid) -> int:
    """The sink's frames (``svg_sink_frames``), checked against the video's frames."""
    if self.include_sink:
      _check_leading_frames("svg_sink_frames", self.sink_frames, grid)
    return self.sink_frames

  def dense_rows(self, grid: VideoGrid) -> int:
    """Queries attending densely (``svg_dense_frames`` leading frames; 0: none)."""
    _check_leading_frames("svg_dense_frames", self.dense_frames, grid,
                          "; every frame dense is svg_density 1.0")
    return self.dense_frames * grid.frame_size

  def dense_rows_plan_on(self, grid: VideoGrid, tiles: SplashTiles) -> TilePlan | None:
    """The dense rows' plan on ``tiles``, or None; its query tile shrinks to split rows evenly."""
    rows = self.dense_rows(grid)
    if not rows:
      return None
    count = -(-rows // tiles.block_q)
    block_q = min(tiles.block_q, -(-rows // (count * TILE_QUANTUM)) * TILE_QUANTUM)
    return dense_rows_plan(grid.tokens, rows, block_q, tiles.block_kv)

  def dense_plan(self, grid: VideoGrid, target: Target | None = None,
                 backend: str | None = None) -> TilePlan:
    """The schedule's dense branch on ``target`` (:meth:`dense_plan_on`)."""
    return self.dense_plan_on(grid, self.tiles(target, backend))

  @staticmethod
  def dense_plan_on(grid: VideoGrid, tiles: SplashTiles) -> TilePlan:
    """The schedule's dense branch: every tile of the executor's tiles, no mask."""
    return plan_tiles(grid, 1.0, tiles.block_q, tiles.block_kv, TileMode.ALIGNED,
                      include_sink=False)

  @classmethod
  def from_mapping(cls, mapping: Mapping[str, Any], num_steps: int | None = None,
                   extra_keys: tuple[str, ...] = ()) -> "SvgConfig":
    """Reads a flat config's ``svg_*`` keys over the ``svg_schedule`` preset (warm-up placed by
    ``num_steps``, else ``num_inference_steps``, else 50). Unknown ``svg_*`` keys raise, except
    ``extra_keys``; other keys are ignored."""
    return cls(**config_kwargs(mapping, num_steps, extra_keys))


def _check_leading_frames(key: str, frames: int, grid: VideoGrid, hint: str = "") -> None:
  """A count of leading frames (the sink's, the dense rows') must leave the video some."""
  if frames >= grid.frames:
    raise ValueError(f"{key} ({frames}) must be less than the video's {grid.frames} latent "
                     f"frames (grid {grid}){hint}")
