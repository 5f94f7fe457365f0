"""``bench chip``: every kernel timed on the TPU this runs on, in one process.

Our kernel (density 1; aligned and split at several densities; heads on online softmax;
compensated), MaxDiffusion's dense kernels (``ulysses_custom_fixed_m``'s and ``ulysses_custom``'s
kernel at its config's blocks and at the fastest of a small search; ``flash``, JAX's Splash, at
its config's blocks and searched) at the per-chip shapes of the shipped configs. Each call: its
compile seconds, the best of several calls after compiling, its FLOPs at the chip's peak (the MXU
floor). MaxDiffusion's kernels come from an installed MaxDiffusion or ``MAXDIFFUSION_SRC``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
import time
from typing import Any, Callable

from maxdiffusion_svg.plan.geometry import VideoGrid, grid_for_resolution
from maxdiffusion_svg.plan.tiling import SplashTiles
from maxdiffusion_svg.tpu.tile_search import (CallShape, our_call,
                                              random_qkv, software, time_compiled)

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class ChipCase:
  """A shipped config's self-attention call on one device (``tiles CONFIG --slice`` prints it);
  on a ring (``ring`` > 1, heads exchanged in groups of ``ulysses``), one ring shard's call."""

  name: str
  config: str
  grid: VideoGrid
  batch: int
  heads: int
  head_dim: int = 128
  ring: int = 1
  ulysses: int = 1


CASES: dict[str, ChipCase] = {c.name: c for c in (
    # wan_svg.yml on 8 chips: 40 heads over 8 context shards, one video.
    ChipCase("wan14b_720p", "wan_svg.yml, 8 chips", grid_for_resolution("720p"), 1, 5),
    # wan_svg_1_3b.yml on a v6e-8: 2-way data (CFG's halves) x 4-way context, 12 heads.
    ChipCase("wan1.3b_480p", "wan_svg_1_3b.yml, 8 chips", grid_for_resolution("480p"), 1, 3),
    # ltx2_svg.yml on a v6e-8: 32 heads over 8 context shards, CFG's pair in one batch.
    ChipCase("ltx2_1280x704", "ltx2_svg.yml, 8 chips", VideoGrid(16, 22, 40), 2, 4),
    # wan_svg_v6e32.yml at 1440p: 8-way Ulysses (5 heads a device) x a ring of 2, one video.
    ChipCase("wan14b_1440p_ring", "wan_svg_v6e32.yml at 1440p, 32 chips: one ring shard",
             grid_for_resolution("1440p"), 1, 5, ring=2, ulysses=8),
)}
DENSITIES = (0.15, 0.2, 0.35, 0.5)
# MaxDiffusion's dense kernels: blocks (block_q, block_kv, block_kv_compute), scoped VMEM (KiB).
# Its defaults for the custom kernel (4864 / 1024 / 1024), its v6e fast recipe, and a small
# search around what fits a 16 MiB chip.
CUSTOM_CONFIG_BLOCKS = ((4864, 1024, 1024, 65536), (6400, 2048, 2048, 65536))
# MaxDiffusion's fastest dense kernel on a v5e at Wan 720p (the chip sweep): the headline row.
HEADLINE_BLOCKS = (2048, 2048, 1024, 65536)
CUSTOM_SEARCH = ((2048, 2048, 1024), (2048, 1024, 1024), (3072, 1024, 1024), (4096, 2048, 1024),
                 (2048, 2048, 2048))
# flash (JAX's Splash): base_wan_*.yml's 512 blocks and a small search.
FLASH_BLOCKS = ((512, 512, 512), (1024, 1024, 512), (2048, 1024, 512))


def maxdiffusion_custom_kernel() -> Any:
  """MaxDiffusion's ``custom_splash_attention`` module: installed, or under ``MAXDIFFUSION_SRC``."""
  try:
    return importlib.import_module("maxdiffusion.kernels.custom_splash_attention")
  except ImportError:
    src = os.environ.get("MAXDIFFUSION_SRC")
    if not src:
      raise
  path = os.path.join(src, "src", "maxdiffusion", "kernels", "custom_splash_attention.py")
  spec = importlib.util.spec_from_file_location("md_custom_splash_attention", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def custom_dense_call(case: ChipCase, blocks: tuple[int, ...], fixed: bool,
                      tokens: int | None = None) -> Callable[..., Any]:
  """``ulysses_custom_fixed_m`` (``fixed``) or ``ulysses_custom``'s local call as MaxDiffusion
  makes it: base-2 q, smoothed keys and the per-head gate in XLA, padding to blocks, the kernel
  over ``[B, H, S, D]``, its ``[H, D, S]`` output transposed back (``tokens``: S, else the
  case's video)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  custom = maxdiffusion_custom_kernel()
  bq, bkv, bkvc = blocks[:3]
  vmem = blocks[3] * 1024 if len(blocks) > 3 and blocks[3] else None
  s, d = tokens or case.grid.tokens, case.head_dim
  kernel = custom.make_splash_mha(custom._BlockSizes(bq, bkv, bkvc, bkvc),  # pylint: disable=protected-access
                                  orig_q_seq_len=s, orig_kv_seq_len=s, use_fixed_m=fixed,
                                  vmem_limit_bytes=vmem)
  pad = lambda x, b: jnp.pad(x, ((0, 0), (0, 0), (0, -(-s // b) * b - s), (0, 0)))

  def call(q, k, v):
    q = (q * (d ** -0.5 * LOG2E)).astype(q.dtype)
    if fixed:
      k = k - jnp.mean(k, axis=2, keepdims=True)
    q, k, v = pad(q, bq), pad(k, bkv), pad(v, bkv)
    if fixed:
      qn = jnp.sqrt(jnp.square(q.astype(jnp.float32)).sum(-1)).max(axis=(0, 2))
      kn = jnp.sqrt(jnp.square(k.astype(jnp.float32)).sum(-1)).max(axis=(0, 2))
      mk = jnp.stack([kn, (qn * kn <= custom._FIXED_M_SAFE_BOUND).astype(jnp.float32)])  # pylint: disable=protected-access
      out = jax.vmap(kernel, in_axes=(0, 0, 0, None))(q, k, v, mk)
    else:
      out = jax.vmap(kernel)(q, k, v)
    return jnp.swapaxes(out, 2, 3)[:, :, :s]

  return call


def flash_call(case: ChipCase, blocks: tuple[int, int, int]) -> Callable[..., Any]:
  """``flash``: JAX's Splash with a full mask at ``blocks``, base-2 q, as MaxDiffusion runs it."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=import-outside-toplevel
      splash_attention_kernel as sk, splash_attention_mask as sm)
  bq, bkv, bkvc = blocks
  s, d, h = case.grid.tokens, case.head_dim, case.heads
  pq, pkv = -(-s // bq) * bq, -(-s // bkv) * bkv
  mask = sm.MultiHeadMask([sm.FullMask((pq, pkv)) for _ in range(h)])
  sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=bq,
                        block_kv_dkv=bkv, block_kv_dkv_compute=bkvc, block_q_dq=bq, block_kv_dq=bkv)
  kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)
  seg = lambda n, real: (jnp.arange(n) >= real).astype(jnp.int32)

  def call(q, k, v):
    ids = sk.SegmentIds(q=seg(pq, s), kv=seg(pkv, s))
    q = (q * d ** -0.5).astype(q.dtype)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pq - s), (0, 0)))
    k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pkv - s), (0, 0))) for x in (k, v))
    return jax.vmap(lambda a, b, c: kernel(a, b, c, segment_ids=ids))(q, k, v)[:, :, :s]

  return call


def _floor_s(flops: float, peak: float) -> float:
  return flops / peak if peak else float("nan")


class ChipBench:
  """Rows of one process's timings, written to ``out`` after each row (a cut run keeps them)."""

  def __init__(self, out: str | None, calls: int, log: Callable[[str], None]):
    import jax  # pylint: disable=import-outside-toplevel
    from maxdiffusion_svg.plan.target import target_of  # pylint: disable=import-outside-toplevel
    self.out, self.calls, self.log = out, calls, log
    self.target = target_of()
    device = jax.devices()[0]
    self.peak = self.target.generation.peak_flops if self.target.is_tpu else 0.0
    self.result: dict[str, Any] = {
        "device_kind": device.device_kind, "platform": device.platform,
        "target": self.target.describe(), "peak_flops": self.peak, "software": software(),
        "python": sys.version.split()[0], "calls_timed": calls, "rows": [],
        "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    self._inputs: dict[Any, Any] = {}

  def inputs(self, case: ChipCase, q_gain: float = 1.0) -> tuple[Any, Any, Any]:
    key = (case.name, q_gain)
    if key not in self._inputs:
      self._inputs = {key: random_qkv(self.shape(case, 1.0), q_gain=q_gain)}
    return self._inputs[key]

  @staticmethod
  def shape(case: ChipCase, density: float, mode: str = "aligned") -> CallShape:
    return CallShape(case.grid, case.batch, case.heads, case.head_dim, "bfloat16", density, mode)

  def dense_flops(self, case: ChipCase) -> float:
    return 4.0 * case.batch * case.heads * case.grid.tokens ** 2 * case.head_dim

  def record(self, row: dict[str, Any], fn: Callable[..., Any], args: tuple[Any, ...],
             flops: float, options: dict[str, str] | None = None) -> dict[str, Any]:
    try:
      timing = time_compiled(fn, args, self.calls, options)
      row.update(timing.as_dict(), flops=flops, floor_s=_floor_s(flops, self.peak))
      row["of_floor"] = round(row["floor_s"] / timing.best_s, 3) if self.peak else None
      self.log(f"  {row['kernel']:<22} {row.get('tiles', ''):<16} {row.get('mode', ''):<8} "
               f"{row.get('density', ''):<5} {row.get('heads', ''):<7} {timing.best_s * 1e3:8.2f} ms "
               f"(compile {timing.compile_s:.1f} s)")
    except Exception as err:  # pylint: disable=broad-except
      row["error"] = " ".join(str(err).split())[:300]
      self.log(f"  {row['kernel']} {row.get('tiles', '')}: failed: {row['error'][:160]}")
    self.result["rows"].append(row)
    self.flush()
    return row

  def flush(self) -> None:
    if self.out:
      with open(self.out, "w", encoding="utf-8") as f:
        json.dump(self.result, f, indent=1)

  def ours(self, case: ChipCase, tiles: SplashTiles, density: float, mode: str = "aligned",
           heads: str = "fixed", label: str = "svg", options: dict[str, str] | None = None,
           call: Callable[..., Any] | None = None) -> dict[str, Any]:
    shape = self.shape(case, density, mode)
    plan = shape.plan(tiles)
    fn = call or our_call(shape, tiles, self.target)
    row = {"case": case.name, "kernel": label, "tiles": tiles.label(), "mode": mode,
           "density": density, "heads": heads,
           "visited_tile_fraction": round(float(plan.stats.visited_tile_fraction), 4),
           "kept_pair_fraction": round(plan.stats.kept_pairs / plan.stats.real_pairs, 4)}
    if options:
      row["compiler_options"] = options
    flops = self.dense_flops(case) * plan.stats.kept_pairs / plan.stats.real_pairs
    return self.record(row, fn, self.inputs(case, 1.0 if heads == "fixed" else 12.0), flops, options)

  def custom(self, case: ChipCase, blocks: tuple[int, ...], fixed: bool, label: str) -> dict[str, Any]:
    row = {"case": case.name, "kernel": "fixed_m" if fixed else "custom_online",
           "tiles": f"{blocks[0]}x{blocks[1]}/{blocks[2]}", "blocks_from": label,
           "vmem_kib": blocks[3] if len(blocks) > 3 else None}
    return self.record(row, custom_dense_call(case, blocks, fixed), self.inputs(case),
                       self.dense_flops(case))

  def _normal(self, dims: tuple[int, ...], seed: int) -> Any:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    return jax.random.normal(jax.random.key(seed), dims, jnp.bfloat16)

  def ours_on_ring(self, case: ChipCase, tiles: SplashTiles, density: float,
                   mode: str = "aligned") -> list[dict[str, Any]]:
    """Each ring shard's call as the ring runs it: its rows of the plan (``chunk`` queries)
    against the key tiles it fetched (its window), one row per shard."""
    from maxdiffusion_svg.kernels import sparse_attention  # pylint: disable=import-outside-toplevel
    from maxdiffusion_svg.parallel.ring_plan import (ring_split, window_plan,  # pylint: disable=import-outside-toplevel
                                                     window_slots)
    plan = self.shape(case, density, mode).plan(tiles)
    split = ring_split(case.grid.tokens, case.ring, case.ulysses, tiles.block_q)
    dims = (case.batch, case.heads)
    q = self._normal((*dims, split.chunk, case.head_dim), 0)
    k, v = (self._normal((*dims, window_slots(plan, split) * tiles.block_kv, case.head_dim), s)
            for s in (1, 2))
    rows = []
    for r in range(case.ring):
      window = window_plan(plan, split, r)
      fn = lambda q, k, v, window=window: sparse_attention(
          q, k, v, window, block_kv_compute=tiles.block_kv_compute, target=self.target,
          backend="pallas")
      row = {"case": case.name, "kernel": "svg", "tiles": tiles.label(), "mode": mode,
             "density": density, "heads": "fixed", "shard": r,
             "visited_tile_fraction": round(float(window.stats.visited_tile_fraction), 4),
             "kept_pair_fraction": round(plan.stats.kept_pairs / plan.stats.real_pairs, 4)}
      flops = 4.0 * case.batch * case.heads * window.stats.kept_pairs * case.head_dim
      rows.append(self.record(row, fn, (q, k, v), flops))
    return rows

  def custom_on_ring(self, case: ChipCase, blocks: tuple[int, ...], label: str) -> dict[str, Any]:
    """``ulysses_ring_custom_fixed_m`` on one device: its ``ring`` chunk-by-chunk kernel calls
    (its shards, ``natural`` tokens each) in one program; the hops' merge is left out."""
    from maxdiffusion_svg.parallel.ring_plan import ring_split  # pylint: disable=import-outside-toplevel
    chunk = ring_split(case.grid.tokens, case.ring, case.ulysses, blocks[0]).natural
    call = custom_dense_call(case, blocks, True, tokens=chunk)

    def fn(q, k, v):
      parts = [call(q, k[:, :, r * chunk:(r + 1) * chunk], v[:, :, r * chunk:(r + 1) * chunk])
               for r in range(case.ring)]
      return sum(parts[1:], parts[0])

    dims = (case.batch, case.heads)
    q = self._normal((*dims, chunk, case.head_dim), 0)
    k, v = (self._normal((*dims, case.ring * chunk, case.head_dim), s) for s in (1, 2))
    row = {"case": case.name, "kernel": "fixed_m", "tiles": f"{blocks[0]}x{blocks[1]}/{blocks[2]}",
           "blocks_from": f"{label}; {case.ring} chunk x chunk calls, the merge left out",
           "vmem_kib": blocks[3] if len(blocks) > 3 else None}
    flops = 4.0 * case.batch * case.heads * case.ring * chunk ** 2 * case.head_dim
    return self.record(row, fn, (q, k, v), flops)

  def flash(self, case: ChipCase, blocks: tuple[int, int, int], label: str) -> dict[str, Any]:
    row = {"case": case.name, "kernel": "flash", "tiles": f"{blocks[0]}x{blocks[1]}/{blocks[2]}",
           "blocks_from": label}
    return self.record(row, flash_call(case, blocks), self.inputs(case), self.dense_flops(case))


def best_of(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
  """The fastest timed row matching ``match``."""
  ok = [r for r in rows if "best_s" in r and all(r.get(k) == v for k, v in match.items())]
  return min(ok, key=lambda r: r["best_s"]) if ok else None


@dataclasses.dataclass(frozen=True)
class ChipBenchConfig:
  cases: tuple[str, ...] = tuple(CASES)
  calls: int = 5
  # Full cases (every kernel) run first; the rest get the headline rows only.
  full_cases: tuple[str, ...] = ("wan14b_720p",)
  budget_s: float = 480.0  # rows past it are left out, and said so


def run_chip_bench(cfg: ChipBenchConfig, out: str | None = None,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
  """Every kernel of :data:`CASES` on this process's TPU (any device kind), rows in one JSON."""
  from maxdiffusion_svg.plan.tiling import choose_tiles  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  bench = ChipBench(out, cfg.calls, log)
  if not bench.target.is_tpu:
    raise ValueError(f"bench chip times kernels on a TPU; this process's JAX runs on "
                     f"{bench.target.platform} (on a TPU VM: JAX_PLATFORMS=tpu)")
  tiles = choose_tiles(bench.target, "auto")
  bench.result.update(default_tiles=tiles.label(), config=dataclasses.asdict(cfg))
  skipped = []

  def room(what: str) -> bool:
    if time.perf_counter() - start < cfg.budget_s:
      return True
    skipped.append(what)
    return False

  for name in cfg.cases:
    case = CASES[name]
    full = name in cfg.full_cases
    log(f"{name}: {case.batch} x {case.heads} heads x {case.grid.tokens:,} tokens x "
        f"{case.head_dim} ({case.config}); our tiles {tiles.label()}")
    if case.ring > 1:  # one ring shard's device: the headline rows only
      if room(f"{name} fixed_m {HEADLINE_BLOCKS}"):
        bench.custom_on_ring(case, HEADLINE_BLOCKS, "search")
      for density in (1.0, 0.35):
        if room(f"{name} svg {density} aligned fixed"):
          bench.ours_on_ring(case, tiles, density)
      continue
    # The headline first (a budget cuts the rest): MaxDiffusion's fixed-m at the fastest blocks
    # timed on a v5e, ours at density 1 and aligned at 0.35; then the rest.
    if room(f"{name} fixed_m {HEADLINE_BLOCKS}"):
      bench.custom(case, HEADLINE_BLOCKS, True, "search")
    rows = [(1.0, "aligned", "fixed"), (0.35, "aligned", "fixed"), (0.35, "aligned", "online")]
    if full:
      rows += [(1.0, "aligned", "online"), (0.2, "aligned", "online")]
      rows += [(d, m, "fixed") for d in DENSITIES for m in ("aligned", "split")
               if (d, m) != (0.35, "aligned")]
    for density, mode, heads in rows:
      if room(f"{name} svg {density} {mode} {heads}"):
        bench.ours(case, tiles, density, mode, heads)
    if full and room(f"{name} compensated"):
      from maxdiffusion_svg.routing.compensation import compensated_attention  # pylint: disable=import-outside-toplevel
      plan = bench.shape(case, 0.35).plan(tiles)
      call = lambda q, k, v, plan=plan: compensated_attention(
          q, k, v, plan, blocks=8, block_kv_compute=tiles.block_kv_compute, target=bench.target)
      bench.ours(case, tiles, 0.35, label="svg_compensated", call=call)
    # MaxDiffusion's kernels: fixed-m at its configs' blocks and a small search (64 MiB, as its
    # Wan recipe raises the limit); its online kernel at fixed-m's fastest; flash.
    searched = CUSTOM_CONFIG_BLOCKS + tuple((*b, 65536) for b in CUSTOM_SEARCH)
    for blocks in (searched if full else ()):
      if blocks != HEADLINE_BLOCKS and room(f"{name} fixed_m {blocks}"):
        bench.custom(case, blocks, True, "config" if blocks in CUSTOM_CONFIG_BLOCKS else "search")
    fastest = best_of(bench.result["rows"], case=name, kernel="fixed_m")
    if fastest and room(f"{name} online"):
      b = tuple(int(x) for x in fastest["tiles"].replace("/", "x").split("x"))
      bench.custom(case, (*b, 65536), False, "fixed_m's fastest")
    for blocks in (FLASH_BLOCKS if full else FLASH_BLOCKS[1:2]):
      if room(f"{name} flash {blocks}"):
        bench.flash(case, blocks, "config" if blocks == FLASH_BLOCKS[0] else "search")
  bench.result["skipped_for_time"] = skipped
  bench.result["seconds"] = round(time.perf_counter() - start, 1)
  bench.flush()
  return bench.result


def format_chip_bench(result: dict[str, Any]) -> str:
  """Per case: each kernel's best time, against MaxDiffusion's fastest dense kernel, and the floor."""
  lines = [f"{result['device_kind']} ({result['target']}); jax {result['software']['jax']}, "
           f"libtpu {result['software']['libtpu']}; best of {result['calls_timed']} calls after "
           f"compiling; floor: the call's FLOPs at {result['peak_flops'] / 1e12:g} TFLOP/s"]
  rows = result["rows"]
  for name in dict.fromkeys(r["case"] for r in rows):
    own = [r for r in rows if r["case"] == name and "best_s" in r]
    base = best_of(own, kernel="fixed_m")
    lines += ["", f"{name}" + (f": MaxDiffusion's fastest dense kernel, fixed-m "
                               f"{base['tiles']}, {base['best_s'] * 1e3:.2f} ms" if base else ""),
              f"  {'kernel':<16} {'tiles':<15} {'mode':<8} {'density':>7} {'heads':<7} "
              f"{'ms':>8} {'/ fixed-m':>9} {'of floor':>8}"]
    for r in own:
      ratio = f"{r['best_s'] / base['best_s']:.3f}" if base else "-"
      heads = r.get("heads", "") + (f" s{r['shard']}" if "shard" in r else "")  # a ring shard
      lines.append(f"  {r['kernel']:<16} {r.get('tiles', ''):<15} {r.get('mode', ''):<8} "
                   f"{r.get('density', '') if r.get('density') is not None else '':>7} "
                   f"{heads:<7} {r['best_s'] * 1e3:8.2f} {ratio:>9} "
                   f"{r['of_floor'] if r.get('of_floor') is not None else '-':>8}")
    for r in rows:
      if r["case"] == name and "error" in r:
        lines.append(f"  {r['kernel']:<16} {r.get('tiles', ''):<15} failed: {r['error'][:90]}")
  if result.get("skipped_for_time"):
    lines += ["", f"left out for time: {', '.join(result['skipped_for_time'])}"]
  return "\n".join(lines)
