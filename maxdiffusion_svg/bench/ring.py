"""What svg on a Ulysses x ring context axis moves, against MaxDiffusion's ring kernels.

``bench sharded --ulysses-shards U`` compiles one self-attention call (not the model) on a
mesh of ``data`` x ``context`` devices, with the context axis split as Ulysses ``U`` x ring
``R = context / U``: ``sharded_svg_attention(..., ulysses_shards=U)`` and, given
``--against``, MaxDiffusion's ``ulysses_ring`` / ``ulysses_ring_custom`` on the same mesh and
inputs. Three kinds of figure come out, labelled as such:

* **measured from compiled HLO**: every collective of each compiled program, bytes one device
  sends per call (``bench.hlo``), sorted into what it does (the head exchange over the
  Ulysses axis, the ring's own traffic, reshards XLA inserts outside the kernel);
* **computed from the plan** (``ring_plan``): the key tiles each ring shard fetches and from
  how many shards, the placement's all-to-all block, beside the
  ``2 (R - 1)`` shard-sized K/V transfers of a ring;
* **compiler-static schedule** (where ``schedule_costs.PRICES`` has the chip): one device's
  kernel work per call, its shard's tiles priced by the bundles libtpu scheduled per tile body.

Compiled for a TPU topology with libtpu (``--topology``) or for simulated CPU devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from maxdiffusion_svg.bench.hlo import collective_ops
from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.parallel.ring_placement import ring_placement
from maxdiffusion_svg.parallel.ring_plan import check_ulysses_shards, key_fetch, ring_split
from maxdiffusion_svg.plan.geometry import VideoGrid, grid_for_resolution
from maxdiffusion_svg.tpu.prices import ring_kernel_prices

MESH_AXES = ("data", "fsdp", "context", "tensor")
AGAINST = ("ulysses_ring", "ulysses_ring_custom")
# What each collective does, by where it came from (op_name) and the axes it runs over.
ROLES = ("exchange", "placement", "keys", "merge", "reshard")
ROLE_HELP = {"exchange": "head exchange (all-to-all over the Ulysses axis, in and out)",
             "placement": "temporal heads placed across the ring (all-to-all over the ring)",
             "keys": "K/V between ring shards (svg: the window fetch; ring: the rotation)",
             "merge": "reductions over the ring (svg: the router's softmax merge)",
             "reshard": "inserted by XLA outside the kernel's shard_map (padding, slicing)"}


@dataclasses.dataclass(frozen=True)
class RingBenchConfig:
  grid: VideoGrid = dataclasses.field(default_factory=lambda: grid_for_resolution("720p"))
  ulysses: tuple[int, ...] = (8,)
  devices: int = 16
  data: int = 1
  topology: str | None = None  # a TPU topology to compile for with libtpu (else CPU devices)
  batch: int = 2
  heads: int = 40
  head_dim: int = 128
  density: float = 0.35
  mode: str = "aligned"
  backend: str = "auto"
  block_q: int | None = None
  block_kv: int | None = None
  dtype: str = "bfloat16"
  against: tuple[str, ...] = ()
  seed: int = 0

  def __post_init__(self):
    for name in ("devices", "data", "batch", "heads", "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.devices % self.data:
      raise ValueError(f"--data {self.data} must divide the {self.devices} devices")
    if self.batch % self.data:
      raise ValueError(f"--batch {self.batch} must be divisible by --data {self.data}")
    for u in self.ulysses:
      check_ulysses_shards(u, self.context, self.heads)
    unknown = [k for k in self.against if k not in AGAINST]
    if unknown:
      raise ValueError(f"--against: {', '.join(unknown)} not among {', '.join(AGAINST)}")
    if self.against and not self.topology:
      raise ValueError("--against compiles MaxDiffusion's TPU ring kernels: give --topology "
                       "(e.g. v6e:4x8); they do not compile for CPU devices")
    self.svg_config()

  @property
  def context(self) -> int:
    return self.devices // self.data

  def svg_config(self) -> SvgConfig:
    return SvgConfig(density=self.density, tile_mode=self.mode, backend=self.backend,
                     block_q=self.block_q, block_kv=self.block_kv)


def ring_mesh(cfg: RingBenchConfig) -> Any:
  """``data x 1 x context x 1`` over the topology's abstract devices, or this host's."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  if cfg.topology:
    from maxdiffusion_svg.tpu.aot import topology_devices  # pylint: disable=import-outside-toplevel
    available = list(topology_devices(cfg.topology))
    where = f"topology {cfg.topology}"
  else:
    available = jax.devices()
    where = "JAX"
  if len(available) != cfg.devices and cfg.topology or len(available) < cfg.devices:
    raise ValueError(f"{cfg.devices} devices asked, {where} has {len(available)}"
                     + ("" if cfg.topology else "; on CPU set XLA_FLAGS=--xla_force_host_"
                        f"platform_device_count={cfg.devices} before JAX starts"))
  return Mesh(np.array(available[:cfg.devices]).reshape(cfg.data, 1, cfg.context, 1), MESH_AXES)


def role(op: dict[str, Any]) -> str:
  """What a collective of either program does (see ``ROLES``)."""
  name, axes = op["op_name"], " ".join(op["axes"])
  if "shard_map" not in name:
    return "reshard"
  if op["op"] == "all-to-all":
    return "exchange" if "ulysses" in axes else "placement"
  if op["op"] == "collective-permute" or name.endswith("ppermute"):
    return "keys"
  return "merge"


def summarize(ops: Sequence[dict[str, Any]]) -> dict[str, Any]:
  by_role: dict[str, dict[str, float]] = {}
  for op in ops:
    entry = by_role.setdefault(role(op), {"count": 0, "bytes": 0.0})
    entry["count"] += 1
    entry["bytes"] += op["bytes"]
  return {"roles": by_role, "bytes": sum(op["bytes"] for op in ops), "count": len(ops),
          "ops": list(ops)}


def _compile(lowered: Any, topology: str | None) -> tuple[str, dict[str, int]]:
  if topology:
    from maxdiffusion_svg.tpu.aot import compile_lowered  # pylint: disable=import-outside-toplevel
    # MaxDiffusion's Wan recipe raises the scoped-VMEM limit to 64 MiB; ours fits either way.
    result = compile_lowered(lowered, {"xla_tpu_scoped_vmem_limit_kib": "65536"})
    if not result.ok:
      raise RuntimeError(f"libtpu refused the program: {result.error}")
    return result.executable.as_text(), result.memory
  compiled = lowered.compile()
  return compiled.as_text(), {}


def inputs_sequence_sharded(cfg: RingBenchConfig) -> bool:
  return cfg.grid.tokens % cfg.context == 0


def _inputs(cfg: RingBenchConfig, mesh: Any, flat: bool) -> Any:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  batch = ("data", "fsdp")
  # A length the context axis does not divide cannot enter sequence-sharded: it enters
  # sharded by batch only (each device slices its part; nothing moves for it).
  seq = "context" if inputs_sequence_sharded(cfg) else None
  if flat:  # MaxDiffusion's [B, S, H * D] activations
    shape, spec = (cfg.batch, cfg.grid.tokens, cfg.heads * cfg.head_dim), P(batch, seq)
  else:
    shape = (cfg.batch, cfg.heads, cfg.grid.tokens, cfg.head_dim)
    spec = P(batch, None, seq, None)
  return jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype), sharding=NamedSharding(mesh, spec))


def lower_svg(cfg: RingBenchConfig, mesh: Any, ulysses: int) -> Any:
  import jax  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.parallel.sharding import sharded_svg_attention  # pylint: disable=import-outside-toplevel
  svg, grid, key = cfg.svg_config(), cfg.grid, jax.random.key(cfg.seed)
  x = _inputs(cfg, mesh, flat=False)
  return jax.jit(lambda q, k, v: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=grid, config=svg, key=key, ulysses_shards=ulysses)).lower(x, x, x)


def lower_maxdiffusion(kernel: str, cfg: RingBenchConfig, mesh: Any, ulysses: int) -> Any:
  """MaxDiffusion's ``kernel`` self-attention as its Wan attention op calls it (sequence on
  ``context``, ``ULYSSES_RING_ATTENTION_AXIS_RULES``), at its v6e Wan block sizes."""
  # pylint: disable=import-outside-toplevel,protected-access
  import jax
  import jax.numpy as jnp
  from flax.linen import partitioning as nn_partitioning
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
  from maxdiffusion import common_types as ct
  from maxdiffusion.models import attention_flax

  from maxdiffusion_svg.bench.schedule import MAXDIFFUSION_VMEM_KIB, maxdiffusion_v6e_blocks
  from maxdiffusion_svg.tpu.prices import PRICES
  # pylint: enable=import-outside-toplevel
  rules = ([[ct.BATCH, ["data", "fsdp"]]] + [list(r) for r in ct.ULYSSES_RING_ATTENTION_AXIS_RULES]
           + [[ct.D_KV, None]])
  names_q = (ct.BATCH, ct.SELF_ATTN_HEAD, ct.SELF_ATTN_Q_LENGTH, ct.D_KV)
  names_kv = (ct.BATCH, ct.SELF_ATTN_HEAD, ct.SELF_ATTN_KV_LENGTH, ct.D_KV)
  dtype = jnp.dtype(cfg.dtype)
  if kernel == "ulysses_ring":
    bq, bkv, bkvc = maxdiffusion_v6e_blocks()
    blocks = splash_attention_kernel.BlockSizes(
        block_q=bq, block_kv_compute=bkvc, block_kv=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
        block_kv_dkv_compute=bkvc, block_q_dq=bq, block_kv_dq=bkv, use_fused_bwd_kernel=False)
    fn = lambda q, k, v: attention_flax._ulysses_ring_attention(
        q, k, v, cfg.heads, mesh, names_q, names_kv, blocks, dtype, use_base2_exp=True,
        ulysses_shards=ulysses)
  else:
    bq, bkv, bkvc = PRICES["v6e"]["maxdiffusion_fixed_m"].tiles  # its fast Wan recipe
    blocks = {"block_q": bq, "block_kv": bkv, "block_kv_compute": bkvc,
              "block_kv_compute_in": bkvc, "vmem_limit_bytes": MAXDIFFUSION_VMEM_KIB * 1024}
    fn = lambda q, k, v: attention_flax._ulysses_ring_custom_attention(
        q, k, v, cfg.heads, mesh, names_q, names_kv, blocks, dtype, ulysses_shards=ulysses)
  x = _inputs(cfg, mesh, flat=True)
  with mesh, nn_partitioning.axis_rules(rules):
    return jax.jit(fn).lower(x, x, x)


def plan_figures(cfg: RingBenchConfig, ulysses: int, plan: Any) -> dict[str, Any]:
  """What ``ring_plan`` says each device moves (computed; no compiling)."""
  grid, context = cfg.grid, cfg.context
  ring = context // ulysses
  split = ring_split(grid.tokens, ring, ulysses, plan.block_q)
  fetch = key_fetch(plan, split)
  _, perm = ring_placement(grid.frames, grid.frame_size, split)
  itemsize = np.dtype(cfg.dtype).itemsize if cfg.dtype != "bfloat16" else 2
  # One token of one device's heads after the exchange: its batch x H / U heads x D.
  token = cfg.batch // cfg.data * cfg.heads // ulysses * cfg.head_dim * itemsize
  received = fetch.pieces_received() * fetch.piece
  real_chunk = grid.tokens / ring
  ring_tokens = 2 * (ring - 1) * real_chunk
  return {
      "ring": ring, "chunk": split.chunk, "padded_len": split.padded_len,
      "natural": split.natural, "aligned": split.aligned,
      "piece": fetch.piece, "window_tiles": fetch.slots,
      "key_tokens_received": [int(n) for n in received],
      "shards_fetched": [int(n) for n in fetch.shards_fetched()],
      "hops": len(fetch.hops),
      "keys_bytes": [int(2 * n * token) for n in received],  # K and V
      "ring_keys_bytes": ring_tokens * token,  # a ring's 2 (R - 1) shard-sized transfers
      "placement_block": perm.block,
      "placement_bytes": 4 * (ring - 1) * perm.block * token,  # q, k, v in, the output back
      "exchange_bytes": 4 * (ulysses - 1) / ulysses * split.natural * token,
  }


def schedule_figures(cfg: RingBenchConfig, ulysses: int, plan: Any, chip: str | None
                     ) -> dict[str, Any] | None:
  """One device's kernel work per call by libtpu's static schedule (``PRICES``): svg's
  slowest and fastest ring shard (fixed-offset heads), against MaxDiffusion's custom kernel
  run as ``ulysses_ring_custom`` does (``R`` chunk x chunk calls, online or fixed-m)."""
  return ring_kernel_prices(plan, cfg.grid.tokens, cfg.context, ulysses,
                            cfg.batch // cfg.data * cfg.heads // ulysses, chip)


def run_ring_bench(cfg: RingBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Compiles each program on the mesh and returns a JSON-ready dict (see the module)."""
  import jax  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.kernels import resolve_backend  # pylint: disable=import-outside-toplevel
  mesh = ring_mesh(cfg)
  svg = cfg.svg_config()
  target = svg.target(mesh=mesh)
  tiles = svg.tiles(target)
  backend = resolve_backend(svg.backend, target)
  plan = svg.plan(cfg.grid, None, target, backend)
  platform = "tpu" if cfg.topology else jax.devices()[0].platform
  result: dict[str, Any] = {
      "grid": list(cfg.grid.shape), "tokens": cfg.grid.tokens, "batch": cfg.batch,
      "heads": cfg.heads, "head_dim": cfg.head_dim, "dtype": cfg.dtype, "density": cfg.density,
      "mode": svg.tile_mode.value, "backend": backend, "block_q": tiles.block_q,
      "block_kv": tiles.block_kv, "devices": cfg.devices, "data": cfg.data,
      "context": cfg.context, "topology": cfg.topology, "platform": platform,
      "inputs_sequence_sharded": inputs_sequence_sharded(cfg),
      "chip": target.generation.name if target.known else None, "splits": {}}
  for u in cfg.ulysses:
    ring = cfg.context // u
    row = result["splits"][f"{u}x{ring}"] = {"ulysses": u, "ring": ring, "kernels": {}}
    programs = {"svg": lambda u=u: lower_svg(cfg, mesh, u)}
    programs.update({k: (lambda k=k, u=u: lower_maxdiffusion(k, cfg, mesh, u))
                     for k in cfg.against})
    for name, lower in programs.items():
      log(f"compiling {name} on U={u} x R={ring} ({cfg.topology or platform})...")
      text, memory = _compile(lower(), cfg.topology)
      row["kernels"][name] = {**summarize(collective_ops(text, cfg.devices)), "memory": memory}
    if ring > 1:
      row["plan"] = plan_figures(cfg, u, plan)
      row["schedule"] = schedule_figures(cfg, u, plan, result["chip"])
  return result


def _mib(n: float) -> str:
  return f"{n / 2**20:,.1f}"


def format_ring_bench(result: dict[str, Any]) -> str:
  where = (f"compiled for {result['topology']} with libtpu" if result["topology"] else
           f"compiled for {result['devices']} simulated {result['platform']} devices")
  lines = [f"grid {'x'.join(map(str, result['grid']))} = {result['tokens']:,} tokens, "
           f"B={result['batch']} H={result['heads']} D={result['head_dim']} {result['dtype']}, "
           f"density {result['density']} {result['mode']}, backend {result['backend']}, tiles "
           f"{result['block_q']}x{result['block_kv']}; mesh data={result['data']} x context="
           f"{result['context']}; {where}",
           "measured from compiled HLO: MiB one device sends per call (ops), by role"
           + ("" if result["inputs_sequence_sharded"] else
              f"; {result['tokens']:,} tokens do not split over {result['context']} devices, so "
              f"inputs enter sharded by batch only")]
  roles = [r for r in ROLES if any(r in k["roles"] for s in result["splits"].values()
                                   for k in s["kernels"].values())]
  lines.append(f"{'U x R':<7}{'kernel':<21}" + "".join(f"{r:>17}" for r in roles)
               + f"{'total':>10}")
  for split, row in result["splits"].items():
    for name, k in row["kernels"].items():
      cells = [f"{_mib(c['bytes'])} ({c['count']})" if (c := k["roles"].get(r)) else "-"
               for r in roles]
      lines.append(f"{split:<7}{name:<21}" + "".join(f"{c:>17}" for c in cells)
                   + f"{_mib(k['bytes']):>10}")
  for split, row in result["splits"].items():
    plan = row.get("plan")
    if not plan:
      continue
    lines += [f"computed from the plan, U x R = {split}: the exchange's ring shards of "
              f"{plan['natural']:,} tokens, the plan's of {plan['chunk']:,} (padded sequence "
              f"{plan['padded_len']:,}), key pieces of {plan['piece']}, {plan['hops']} permutes",
              "  shard:              " + "".join(f"{r:>9}" for r in range(plan["ring"])),
              "  other shards read:  " + "".join(f"{n:>9}" for n in plan["shards_fetched"]),
              "  key tokens fetched: " + "".join(f"{n:>9,}" for n in plan["key_tokens_received"]),
              "  K+V MiB fetched:    " + "".join(f"{_mib(n):>9}" for n in plan["keys_bytes"]),
              f"  a ring's 2(R-1) shard-sized K/V transfers: {_mib(plan['ring_keys_bytes'])} MiB; "
              f"placement all-to-all block {plan['placement_block']:,} tokens "
              f"({_mib(plan['placement_bytes'])} MiB for q, k, v, out); head exchange "
              f"{_mib(plan['exchange_bytes'])} MiB"]
    sched = row.get("schedule")
    if sched:
      lines.append(
          f"  compiler-static schedule ({sched['chip']}), one device's kernel per call, Mbundles: "
          f"svg shards {', '.join(f'{b / 1e6:.1f}' for b in sched['svg_shards'])}; "
          f"our dense branch {sched['ours_dense'] / 1e6:.1f}; MaxDiffusion's custom kernel "
          f"as ulysses_ring_custom {sched['ring_custom_online'] / 1e6:.1f} (online), "
          f"{sched['ring_custom_fixed_m'] / 1e6:.1f} (fixed-m)")
  return "\n".join(lines)
