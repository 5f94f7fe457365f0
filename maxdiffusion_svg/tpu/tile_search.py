"""Tiles by the chip's clock: our kernel timed on the TPU it runs on, over candidate tiles that
fit its VMEM, at a call's shape and density; the fastest kept in a cache per chip, shape,
density and software, so a run searches once.

libtpu's static schedule ranked the v5e's tiles 2.8x wrong (docs/benchmarks.md, "Timed on a
TPU"): only the chip's clock decides a tile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from importlib import metadata
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp

from maxdiffusion_svg.kernels import pallas, sparse_attention
from maxdiffusion_svg.kernels.api import check_tpu_call
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import Target
from maxdiffusion_svg.plan.tiles import TileMode, plan_tiles
from maxdiffusion_svg.plan.tiling import SplashTiles

# Candidate ladders: multiples of 256 (the v6e/TPU7x MXU; v5e's 128 divides them). ``smart``:
# the region that ran within 2% of the fastest on a v5e (q blocks 1024 to 3072, kv 1024 to
# 3072: smaller tiles pay per-step overhead), 16 tiles; ``full``: a wider sweep.
SMART_Q = (1024, 2048, 2560, 3072)
SMART_KV = ((1024, 512), (1536, 512), (2048, 1024), (3072, 512))
FULL_Q = (512, 1024, 1536, 2048, 2560, 3072, 3328, 3584, 4096, 5120)
FULL_KV = ((512, 256), (512, 512), (1024, 256), (1024, 512), (1024, 1024), (1536, 512),
           (2048, 512), (2048, 1024), (3072, 1024))
SEARCH_MODES = ("smart", "full")
CACHE_ENV = "MAXDIFFUSION_SVG_TILE_CACHE"


def candidate_tiles(mode: str = "smart") -> tuple[SplashTiles, ...]:
  """Every tile a search of ``mode`` (``smart``: 16, ``full``: 90) may try, before fitting."""
  if mode not in SEARCH_MODES:
    raise ValueError(f"tile_search_mode must be one of {', '.join(SEARCH_MODES)}, got {mode!r}")
  qs, kvs = (SMART_Q, SMART_KV) if mode == "smart" else (FULL_Q, FULL_KV)
  return tuple(SplashTiles(q, kv, c) for q in qs for kv, c in kvs)


@dataclasses.dataclass(frozen=True)
class CallShape:
  """One attention call as the run makes it on one device: ``[batch, heads, tokens, head_dim]``
  over ``grid``'s tokens, at ``density`` in ``mode``."""

  grid: VideoGrid
  batch: int
  heads: int
  head_dim: int
  dtype: str
  density: float
  mode: str

  def label(self) -> str:
    return (f"{self.batch}x{self.heads} heads x {self.grid.tokens:,} tokens x {self.head_dim} "
            f"{self.dtype}, {self.mode} at density {self.density:g}")

  def plan(self, tiles: SplashTiles):
    return plan_tiles(self.grid, self.density, tiles.block_q, tiles.block_kv,
                      TileMode.parse(self.mode))


def fitting_tiles(shape: CallShape, target: Target,
                  tiles: Iterable[SplashTiles]) -> tuple[list[SplashTiles], dict[str, str]]:
  """``tiles`` our kernel's checks accept on ``target`` (VMEM, SMEM, shapes), and the refused
  ones with the check's first words."""
  fit, refused = [], {}
  for t in tiles:
    try:
      check_tpu_call(shape.plan(t), shape.head_dim, jnp.dtype(shape.dtype), t.block_kv_compute,
                     target, "pallas")
    except ValueError as err:
      refused[t.label()] = str(err).split(":")[0]
      continue
    fit.append(t)
  return fit, refused


@dataclasses.dataclass(frozen=True)
class Timing:
  """A compiled call's seconds: compile, and the best and median of ``calls`` timed calls."""

  compile_s: float
  best_s: float
  median_s: float
  calls: int

  def as_dict(self) -> dict[str, float]:
    return {"compile_s": round(self.compile_s, 2), "best_s": round(self.best_s, 6),
            "median_s": round(self.median_s, 6), "calls": self.calls}


def time_compiled(fn: Callable[..., Any], args: Sequence[Any], calls: int = 5,
                  options: dict[str, str] | None = None) -> Timing:
  """``fn`` jitted and compiled for ``args`` (timed apart), one warm-up call, then ``calls``
  timed calls, each to completion."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile(compiler_options=options or {})
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(max(1, calls)):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  times.sort()
  return Timing(compile_s, times[0], times[len(times) // 2], len(times))


def our_call(shape: CallShape, tiles: SplashTiles, target: Target,
             backend: str = "pallas") -> Callable[..., Any]:
  """The run's kernel call on ``tiles`` (offsets, padding and the kernel; no routing)."""
  plan = shape.plan(tiles)
  return lambda q, k, v: sparse_attention(q, k, v, plan, block_kv_compute=tiles.block_kv_compute,
                                          target=target, backend=backend)


def random_qkv(shape: CallShape, seed: int = 0, q_gain: float = 1.0) -> tuple[Any, Any, Any]:
  """Normal q, k, v on the default device; ``q_gain`` > ~8 sends every head to online softmax
  (past the fixed offset's gate)."""
  dims = (shape.batch, shape.heads, shape.grid.tokens, shape.head_dim)
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  dtype = jnp.dtype(shape.dtype)
  return ((jax.random.normal(kq, dims, jnp.float32) * q_gain).astype(dtype),
          jax.random.normal(kk, dims, dtype), jax.random.normal(kv, dims, dtype))


def software(extra: tuple[str, ...] = ()) -> dict[str, str]:
  """What a timing depends on besides the chip: jax, jaxlib, libtpu, the plugin and its kernel's
  source (a kernel changed within a version is searched again); ``extra``: more distributions'
  versions ("none": not installed)."""
  with open(pallas.__file__, "rb") as f:
    out = {"kernel": hashlib.sha256(f.read()).hexdigest()[:12]}
  for name in ("maxdiffusion-svg", "jax", "jaxlib", "libtpu", *extra):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = "none"
  return out


def cache_key(device_kind: str, shape: CallShape, mode: str, vmem_limit: int | None,
              soft: dict[str, str] | None = None) -> str:
  """One search's identity: chip, call shape, density, tile mode, search mode, VMEM limit,
  software."""
  soft = software() if soft is None else soft
  parts = [device_kind, shape.label(), f"grid {shape.grid.frames}x{shape.grid.height}x"
           f"{shape.grid.width}", mode, f"vmem {vmem_limit}", json.dumps(soft, sort_keys=True)]
  return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def default_cache_path() -> str:
  """``$MAXDIFFUSION_SVG_TILE_CACHE``, else ``~/.cache/maxdiffusion_svg/tiles.json``."""
  return os.environ.get(CACHE_ENV) or os.path.join(
      os.path.expanduser("~"), ".cache", "maxdiffusion_svg", "tiles.json")


def read_cache(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError):
    return {}
  return data if isinstance(data, dict) else {}


def write_cache(path: str, key: str, entry: dict[str, Any]) -> None:
  """Adds ``entry`` under ``key`` (a write through a temporary file: no torn cache)."""
  data = read_cache(path)
  data[key] = entry
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """A search's pick, the default's time beside it, every candidate's row, and whether it came
  from the cache."""

  picked: SplashTiles
  default: SplashTiles
  picked_s: float
  default_s: float | None
  rows: tuple[dict[str, Any], ...]
  cached: bool
  key: str

  def line(self) -> str:
    """The one line a run prints."""
    timed = sum(1 for r in self.rows if r.get("seconds") is not None)
    source = "cached" if self.cached else f"timed {timed} of {len(self.rows)} candidate tiles"
    if self.default_s is None:
      gain = f"the default {self.default.label()} does not fit"
    elif self.picked == self.default:
      gain = "the default is the fastest"
    else:
      gain = (f"{self.default_s / self.picked_s:.2f}x faster than the default "
              f"{self.default.label()} ({self.default_s * 1e3:.1f} ms)")
    return (f"svg tile search ({source}): {self.picked.label()} at {self.picked_s * 1e3:.1f} ms "
            f"a call, {gain}")

  def as_dict(self) -> dict[str, Any]:
    return {"picked": self.picked.label(), "default": self.default.label(),
            "picked_s": self.picked_s, "default_s": self.default_s, "rows": list(self.rows),
            "key": self.key}


def parse_tiles(label: str) -> SplashTiles:
  """``QxKV/STEP`` back to tiles."""
  qkv, step = label.split("/")
  q, kv = qkv.split("x")
  return SplashTiles(int(q), int(kv), int(step))


def search_tiles(shape: CallShape, target: Target, default: SplashTiles, *, mode: str = "smart",
                 calls: int = 5, cache_path: str | None = None, device_kind: str | None = None,
                 log: Callable[[str], None] = lambda _: None,
                 timer: Callable[[SplashTiles], float] | None = None) -> SearchResult:
  """Times our kernel on the chip over the candidates of ``mode`` that fit ``target`` (and
  ``default``), at ``shape``; returns the fastest, from the cache when this chip, shape and
  software were searched before. ``timer(tiles) -> seconds`` replaces the chip's clock (tests)."""
  kind = device_kind or jax.devices()[0].device_kind
  key = cache_key(kind, shape, mode, target.vmem_limit)
  path = cache_path or default_cache_path()
  hit = read_cache(path).get(key)
  if hit:
    return SearchResult(parse_tiles(hit["picked"]), parse_tiles(hit["default"]), hit["picked_s"],
                        hit["default_s"], tuple(hit["rows"]), True, key)
  candidates = list(dict.fromkeys([default, *candidate_tiles(mode)]))
  fit, refused = fitting_tiles(shape, target, candidates)
  if not fit:
    raise ValueError(f"svg tile search: no candidate tile fits {target.describe()} at "
                     f"{shape.label()}")
  if timer is None:
    q, k, v = random_qkv(shape)
    timer = lambda t: time_compiled(our_call(shape, t, target), (q, k, v), calls).best_s
  rows = []
  for i, t in enumerate(fit, 1):
    try:
      seconds = float(timer(t))
      rows.append({"tiles": t.label(), "seconds": seconds})
      log(f"  [{i}/{len(fit)}] {t.label()}: {seconds * 1e3:.2f} ms")
    except Exception as err:  # pylint: disable=broad-except
      rows.append({"tiles": t.label(), "seconds": None, "error": str(err).splitlines()[0][:200]})
      log(f"  [{i}/{len(fit)}] {t.label()}: failed ({rows[-1]['error']})")
  rows.extend({"tiles": label, "seconds": None, "refused": why} for label, why in refused.items())
  timed = [r for r in rows if r["seconds"] is not None]
  if not timed:
    raise ValueError(f"svg tile search: every candidate failed on {kind}: {rows[0]}")
  best = min(timed, key=lambda r: r["seconds"])
  default_row = next((r for r in timed if r["tiles"] == default.label()), None)
  result = SearchResult(parse_tiles(best["tiles"]), default, best["seconds"],
                        default_row["seconds"] if default_row else None, tuple(rows), False, key)
  write_cache(path, key, {**result.as_dict(), "device_kind": kind, "shape": shape.label(),
                          "software": software()})
  return result
