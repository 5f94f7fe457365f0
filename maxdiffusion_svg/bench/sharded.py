"""Sharded benchmark: where the permutation goes relative to the Ulysses head exchange.

* ``after`` (the design, ``sharded_svg_attention``): exchange to local heads, then route,
  place, run the kernel and restore on each device, then exchange back.
* ``before`` (what the seed replaced): route and place the global, sequence-sharded
  arrays, exchange, run the kernel, exchange back, restore globally. XLA has to move
  tokens across devices for every reorder and for the router's full-length keys.

Both are compiled on one mesh; the collectives each program runs are read from its HLO
(``bench.hlo``), and each is timed. On simulated CPU devices the bytes are faithful to
what a TPU slice would move, but the times are not interconnect times.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench.hlo import KINDS, collective_stats
from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.bench.timing import time_call
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.call.attention import place, restore, svg_attention
from maxdiffusion_svg.kernels import resolve_backend, sparse_attention
from maxdiffusion_svg.parallel.sharding import exchange_heads, head_exchange, sharded_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid, grid_for_resolution
from maxdiffusion_svg.routing.router import route_heads

MESH_AXES = ("data", "fsdp", "context", "tensor")
PLACEMENTS = ("after", "before")


@dataclasses.dataclass(frozen=True)
class ShardedBenchConfig:
  grid: VideoGrid = dataclasses.field(default_factory=lambda: grid_for_resolution("480p"))
  devices: int = 8
  batch: int = 1
  heads: int = 8
  head_dim: int = 128
  density: float = 0.35
  mode: str = "aligned"
  backend: str = "xla"
  block_q: int | None = None
  block_kv: int | None = None
  dtype: str = "float32"
  timing: bool = True  # False: compile and count collectives only, on abstract inputs
  repeats: int = 2
  seed: int = 0

  def __post_init__(self):
    for name in ("devices", "batch", "heads", "head_dim", "repeats"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
    self.svg_config()  # validates density, mode, backend and tiles

  def svg_config(self) -> SvgConfig:
    return SvgConfig(density=self.density, tile_mode=self.mode, backend=self.backend,
                     block_q=self.block_q, block_kv=self.block_kv)


def bench_mesh(devices: int) -> Mesh:
  """A MaxDiffusion-shaped mesh with every device on the ``context`` axis."""
  available = jax.devices()
  if len(available) < devices:
    raise ValueError(
        f"--devices {devices} needs {devices} devices but JAX has {len(available)}; on CPU set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts")
  return Mesh(np.array(available[:devices]).reshape(1, 1, devices, 1), MESH_AXES)


def permute_before_exchange(mesh: Mesh, grid: VideoGrid, config: SvgConfig, key: jax.Array,
                            spec: P) -> Callable[..., jax.Array]:
  """The replaced design: route and place the global arrays, kept in ``spec`` (sequence
  shards), then exchange."""

  def run(q, k, v):
    ex = head_exchange(mesh, q.shape)
    seq = NamedSharding(mesh, spec)
    plan = config.plan(grid)
    temporal = route_heads(q, k, v, grid=grid, config=config, key=key, plan=plan)
    placed = [jax.lax.with_sharding_constraint(place(x, temporal, grid), seq) for x in (q, k, v)]
    kernel = lambda q, k, v: sparse_attention(q, k, v, plan, backend=config.backend,
                                              block_kv_compute=config.block_kv_compute)
    out = exchange_heads(kernel, ex)(*placed)
    return jax.lax.with_sharding_constraint(restore(out, temporal, grid), seq)

  return run


def run_sharded_bench(cfg: ShardedBenchConfig,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
  """Compiles (and with ``cfg.timing`` times) both placements and the single-device path.

  Returns a JSON-ready dict. Without timing, inputs are abstract shapes: nothing is
  allocated, so the collectives of full-size Wan calls can be counted on a small machine.
  """
  mesh = bench_mesh(cfg.devices)
  svg = cfg.svg_config()
  grid = cfg.grid
  key = jax.random.key(cfg.seed)
  shape = (cfg.batch, cfg.heads, grid.tokens, cfg.head_dim)
  ex = head_exchange(mesh, shape)
  # Inputs arrive sequence-sharded as in a Wan forward; a length the devices do not
  # divide cannot be laid out so, and enters sharded by batch only.
  even = ex.padded_len == ex.seq_len
  spec = ex.qkv_spec if even else P(ex.batch_axes or None)
  sharding = NamedSharding(mesh, spec)
  if cfg.timing:
    log(f"building planted q, k, v ({'x'.join(map(str, shape))})...")
    types = tuple(("spatial", "temporal")[h % 2] for h in range(cfg.heads))
    host = [jnp.asarray(x, cfg.dtype) for x in planted_qkv(grid, types, cfg.head_dim,
                                                            seed=cfg.seed, batch=cfg.batch)]
    q, k, v = (jax.device_put(x, sharding) for x in host)
  else:
    q = k = v = jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype), sharding=sharding)
  tiles = svg.tiles(svg.target(mesh=mesh))
  block_q, block_kv = tiles.block_q, tiles.block_kv
  result: dict[str, Any] = {
      "grid": list(grid.shape), "tokens": grid.tokens, "batch": cfg.batch, "heads": cfg.heads,
      "head_dim": cfg.head_dim, "dtype": cfg.dtype, "density": cfg.density,
      "mode": svg.tile_mode.value, "backend": resolve_backend(svg.backend, svg.target(mesh=mesh)),
      "block_q": block_q,
      "block_kv": block_kv, "devices": cfg.devices, "platform": jax.devices()[0].platform,
      "mesh": dict(mesh.shape), "inputs_sequence_sharded": even, "timing": cfg.timing,
      "repeats": cfg.repeats, "placements": {}}

  functions = {
      "after": lambda q, k, v: sharded_svg_attention(q, k, v, mesh=mesh, grid=grid, config=svg,
                                                     key=key),
      "before": permute_before_exchange(mesh, grid, svg, key, spec),
  }
  outputs = {}
  for name in PLACEMENTS:
    log(f"compiling the permutation {name} the exchange...")
    compiled = jax.jit(functions[name]).lower(q, k, v).compile()
    collectives = collective_stats(compiled.as_text(), cfg.devices)
    row = result["placements"][name] = {
        "collectives": collectives,
        "collective_count": sum(c["count"] for c in collectives.values()),
        "collective_bytes": sum(c["bytes"] for c in collectives.values())}
    if cfg.timing:
      log("timing it...")
      row["first_call_s"], row["time_s"] = time_call(lambda c=compiled: c(q, k, v), cfg.repeats)
      outputs[name] = np.asarray(compiled(q, k, v), np.float32)
  if not cfg.timing:
    return result
  result["max_abs_difference"] = float(np.abs(outputs["after"] - outputs["before"]).max())
  log("timing single-device svg_attention...")
  single = jax.jit(lambda q, k, v: svg_attention(q, k, v, grid=grid, config=svg, key=key))
  local = [jax.device_put(x, jax.devices()[0]) for x in host]
  _, result["single_device_s"] = time_call(lambda: single(*local), cfg.repeats)
  return result


def _mebibytes(n: float) -> str:
  return f"{n / 2**20:.2f} MiB"


def format_sharded_bench(result: dict[str, Any]) -> str:
  mesh = " ".join(f"{a}={n}" for a, n in result["mesh"].items())
  lines = [
      f"grid {'x'.join(map(str, result['grid']))} = {result['tokens']:,} tokens, "
      f"B={result['batch']} H={result['heads']} D={result['head_dim']} {result['dtype']}, density "
      f"{result['density']} {result['mode']}, backend {result['backend']}, tiles "
      f"{result['block_q']}x{result['block_kv']}, {result['devices']} {result['platform']} "
      f"devices (mesh {mesh})"
      + (f", best of {result['repeats']}" if result["timing"] else ", compiled only"),
      "bytes are sent per device per call, read from the compiled HLO"
      + ("; XLA:CPU moves bfloat16 collectives as float32 (a TPU moves half these bytes)"
         if result["dtype"] == "bfloat16" and result["platform"] == "cpu" else "")
      + ("" if result["inputs_sequence_sharded"] else
         f"; {result['tokens']:,} tokens do not split evenly, so inputs enter unsharded"),
  ]
  rows = result["placements"]
  kinds = [kind for kind in KINDS if any(kind in row["collectives"] for row in rows.values())]
  timed = result["timing"]
  lines.append(f"{'permutation':<16}" + "".join(f"{kind:>22}" for kind in kinds)
               + f"{'total':>13}" + (f"{'time s':>9}" if timed else ""))
  for name, row in rows.items():
    cells = []
    for kind in kinds:
      c = row["collectives"].get(kind)
      cells.append(f"{c['count']} ops, {_mebibytes(c['bytes'])}" if c else "-")
    lines.append(f"{name + ' exchange':<16}" + "".join(f"{c:>22}" for c in cells)
                 + f"{_mebibytes(row['collective_bytes']):>13}"
                 + (f"{row['time_s']:>9.3f}" if timed else ""))
  after, before = rows["after"], rows["before"]
  summary = f"before/after: {before['collective_bytes'] / after['collective_bytes']:.2f}x bytes"
  if timed:
    summary += (f", {before['time_s'] / after['time_s']:.2f}x time; outputs agree to "
                f"{result['max_abs_difference']:.1e}")
    lines += [summary, f"single-device svg_attention (all heads on one device): "
                       f"{result['single_device_s']:.3f} s"]
  else:
    lines.append(summary)
  return "\n".join(lines)
