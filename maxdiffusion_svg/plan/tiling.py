"""The one place a target becomes tiles: :func:`choose_tiles`. Keys given win; Splash's default
is the largest tile compiling under the target's VMEM limit (docs/reference.md, "Default tiles")."""

from __future__ import annotations

import dataclasses

from maxdiffusion_svg.plan.target import BACKENDS, MIB, Target, resolve_backend
from maxdiffusion_svg.plan.tiles import check_block_size


@dataclasses.dataclass(frozen=True)
class SplashTiles:
  """A ``block_q x block_kv`` tile walked in ``block_kv_compute``-wide steps (XLA ignores them)."""

  block_q: int
  block_kv: int
  block_kv_compute: int

  def label(self) -> str:
    return f"{self.block_q}x{self.block_kv}/{self.block_kv_compute}"


# The XLA path's tile (CPU, GPU): 512 was fastest on CPU.
XLA_TILES = SplashTiles(512, 512, 256)
# Splash by the scoped-VMEM limit in force, largest first. 32 MiB is the seed design's v6e
# tile; 64 MiB (MaxDiffusion's Wan runs raise the limit to it) the upstream port's tuned one.
SPLASH_TILES: tuple[tuple[int, SplashTiles], ...] = (
    (64 * MIB, SplashTiles(3328, 2816, 256)),
    (32 * MIB, SplashTiles(3328, 1536, 256)),
    (16 * MIB, SplashTiles(2048, 1536, 256)),
)
# v4 has 16 MiB of VMEM in all and widens int8 mask blocks to 32 bits: a smaller tile, the
# largest libtpu fits with room (docs/benchmarks.md, "Figures behind choices in the code"). A TPU
# of unknown generation gets it too: it compiles on every known generation.
V4_TILES = SplashTiles(1536, 1024, 256)
UNKNOWN_TPU_TILES = V4_TILES
# Our Pallas kernel (the TPU default), per generation. Timed on a v5e (``bench chip``,
# docs/benchmarks.md "Timed on a TPU"): 2048x3072/512 (its six kv steps in two groups of
# three) is its fastest at densities 1 and 0.35, within 2% of every tile from 1024 to 3072 x
# 1024 to 3072; v4 and v5p take it untimed (the same 128-wide MXUs and 16 MiB default scoped
# VMEM). v6e and TPU7x keep the tile libtpu's static schedule of the whole step ranked first
# ("Our kernel's tiles"), not timed on a chip; its kv steps run in groups (kernels/pallas.py,
# UNROLL_SCORE_BYTES), as the v5e's clock asked.
PALLAS_TILES = SplashTiles(3328, 1536, 512)
PALLAS_TIMED_TILES = SplashTiles(2048, 3072, 512)
PALLAS_TILES_BY_GENERATION = {"v4": PALLAS_TIMED_TILES, "v5e": PALLAS_TIMED_TILES,
                              "v5p": PALLAS_TIMED_TILES, "v6e": PALLAS_TILES,
                              "tpu7x": PALLAS_TILES}
# The inner kv step when block_kv is the user's: the widest of these dividing it (ours takes
# wider steps: its per-step accumulator update is amortised over more keys).
KV_COMPUTE_CHOICES = {"splash": (256, 128), "pallas": (512, 256, 128)}


def default_kv_compute(block_kv: int, backend: str = "splash") -> int:
  choices = KV_COMPUTE_CHOICES["pallas" if backend == "pallas" else "splash"]
  return next(c for c in choices if block_kv % c == 0)


def default_tiles(target: Target, backend: str = "auto") -> SplashTiles:
  """The executor's default tile on ``target`` (Splash's by generation and VMEM limit)."""
  if backend not in BACKENDS[1:]:  # a named executor needs no resolving
    backend = resolve_backend(backend, target)
  if backend == "xla":
    return XLA_TILES
  if backend == "pallas":
    if not target.is_tpu:  # an interpreted or exported call: the static schedule's pick
      return PALLAS_TILES
    # A TPU of unknown generation gets the tile timed under the strictest limits.
    return PALLAS_TILES_BY_GENERATION.get(target.generation.name, PALLAS_TIMED_TILES)
  if not target.known:
    return UNKNOWN_TPU_TILES
  if target.generation.name == "v4":
    return V4_TILES
  for floor, tiles in SPLASH_TILES:
    if target.vmem_limit >= floor:
      return tiles
  return SPLASH_TILES[-1][1]


def choose_tiles(target: Target, backend: str = "auto", block_q: int | None = None,
                 block_kv: int | None = None, block_kv_compute: int | None = None) -> SplashTiles:
  """A call's tile on ``target``: the ``svg_block_*`` keys given, else the executor's defaults."""
  default = default_tiles(target, backend)
  for name, value in (("svg_block_q", block_q), ("svg_block_kv", block_kv),
                      ("svg_block_kv_compute", block_kv_compute)):
    if value:
      check_block_size(value, name)
  block_q, block_kv = block_q or default.block_q, block_kv or default.block_kv
  compute = block_kv_compute or (
      default.block_kv_compute if block_kv == default.block_kv else default_kv_compute(
          block_kv, backend if backend in BACKENDS[1:] else resolve_backend(backend, target)))
  if block_kv % compute:
    raise ValueError(f"svg_block_kv_compute ({compute}) must divide svg_block_kv ({block_kv}, "
                     f"{'given' if block_kv != default.block_kv else 'the default'} for "
                     f"{target.describe()})")
  return SplashTiles(block_q, block_kv, compute)


def tiles_help(backend: str = "splash") -> str:
  """The defaults per generation, for CLI help (computed, so it cannot drift)."""
  from maxdiffusion_svg.plan.target import GENERATIONS  # pylint: disable=import-outside-toplevel
  parts = [f"{name} {default_tiles(Target('tpu', g, g.default_scoped_vmem), backend).label()}"
           for name, g in GENERATIONS.items()]
  ours = ", ".join(f"{name} {t.label()}" for name, t in PALLAS_TILES_BY_GENERATION.items())
  return (f"xla {XLA_TILES.block_q}x{XLA_TILES.block_kv}; pallas (the TPU default) {ours}; "
          f"splash at the default VMEM limit: " + ", ".join(parts))
