"""One denoising step priced from its compiled program (``bench step``), not an assumed share.

The configured Wan model's forward (the CFG pair in, guided noise out: one step) is compiled by
libtpu for the slice, at ``layers`` layers in MaxDiffusion's scan, once with ``svg`` and once with
the dense baseline (``ulysses_custom_fixed_m`` at its fast recipe), each in a child whose libtpu
dumps its final schedules. Every computation the program calls is priced by
:func:`~maxdiffusion_svg.bench.schedule_xla.price_program` and put in one class by its HLO
instruction (:func:`classify`). The self-attention kernels are priced from their plans
(:mod:`maxdiffusion_svg.tpu.prices`: ours per visited tile, fixed-m's per tile of its recipe);
MaxDiffusion's flash (cross-attention where ``flash_min_seq_length`` lets it) from its own
schedule in the dump, every tile of its grid visited (:func:`flash_prices`).

The scan's body is one layer: a step is the program outside the scan plus the model's depth times
one layer (priced from ``layers`` compiled layers, so two suffice). svg's program holds both
branches of the schedule's ``lax.cond``: a sparse layer is priced without the dense branch's
computations, a dense one without the sparse branch's. Collectives: each one's result bytes per
device, and their time at the chip's ICI bandwidth (:data:`ICI`). Static bundles, not time: no
memory stall shows, and a collective's transfer is not a bundle.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
from typing import Any, Callable, Mapping, Sequence

from maxdiffusion_svg.bench.hlo import collective_ops
from maxdiffusion_svg.bench.schedule import static_bundles
from maxdiffusion_svg.bench.schedule_xla import HLO_FILE, price_program
from maxdiffusion_svg.tpu.aot import child_result, print_result
from maxdiffusion_svg.tpu.bundles import SPLASH_LAYOUT, dump_flags, read_dump
from maxdiffusion_svg.tpu.step_prices import StepPrices, slice_key, step_prices

SELF, CROSS, PROJECTIONS, COLLECTIVES, REST = (
    "self-attention", "cross-attention", "projections and MLP", "collectives", "norms and the rest")
CLASSES = (SELF, CROSS, PROJECTIONS, COLLECTIVES, REST)
KERNEL = "self-attention kernel"  # the Mosaic kernels' share of SELF, priced from plans
COLLECTIVE_OPS = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
# Bidirectional ICI bandwidth per chip, bytes/s, as Google Cloud's TPU pages state it.
ICI = {"v5e": (400e9, "cloud.google.com/tpu/docs/v5e"),
       "v6e": (800e9, "cloud.google.com/tpu/docs/v6e")}
# Module names MaxDiffusion's Wan gives its projections and feed-forward (in HLO op_name paths).
_PROJECTION = re.compile(r"/(?:\w*_proj|proj_\w+|gelu|ffn|net_\d|linear_?\d*|to_out\w*|\w*embed\w*)/")
_BRANCH = re.compile(r"apply_attention/.*?cond/branch_(\d+)_fun")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
_SHAPE = re.compile(r"\b(?:bf16|f16|f32|f64|s8|u8|s16|u16|s32|u32|s64|u64|pred)\[([\d,]*)\]")
BASELINES = {"wan": "ulysses_custom_fixed_m"}
# The self-attention kernels a step is priced with from their plans, by their HLO names: ours
# and fixed-m's (its vmap'd kernel). MaxDiffusion's flash (jax's Splash, FLASH) is priced from its
# own dumped schedule; a program calling any other Mosaic kernel is refused, naming it.
PRICED_KERNELS = {"svg": ("svg_pallas",), "ulysses_custom_fixed_m": ("vmap__",)}
FLASH = "splash_mha"
_FLASH_BLOCKS = re.compile(r'\\"block_q\\": (\d+), \\"block_kv\\": (\d+)')
_FLOAT_SHAPE = re.compile(r"\b(?:bf16|f16|f32)\[([\d,]+)\]")
_LAYOUT_OPS = ("bitcast", "copy", "copy-start", "copy-done", "reshape", "transpose")
_TOPOLOGIES = {8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8"}
TEXT_LEN = 512  # the text tokens the forward is compiled with (Wan's max_sequence_length)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: its opcode, op_name (metadata), text, operands' names and the
  computation holding it."""

  opcode: str
  op_name: str
  line: str
  operands: tuple[str, ...] = ()
  computation: str = ""


def _operands(line: str, start: int) -> tuple[str, ...]:
  """The instruction names inside the parentheses opening at ``line[start]``."""
  depth = 0
  for end in range(start, len(line)):
    depth += {"(": 1, ")": -1}.get(line[end], 0)
    if depth == 0:
      return tuple(re.findall(r"%([\w.\-]+)", line[start:end]))
  return ()


def instructions(hlo: str) -> dict[str, Instruction]:
  """Each instruction of an optimised HLO module by name (a Mosaic call's kernel metadata runs
  over several lines: they are one instruction)."""
  out, computation, lines = {}, "", []

  def close() -> None:
    if lines:
      line = " ".join(lines)
      match = _INSTRUCTION.match(line)
      op_name = re.search(r'op_name="([^"]*)"', line)
      out[match.group(1)] = Instruction(match.group(3), op_name.group(1) if op_name else "", line,
                                        _operands(line, match.end() - 1), computation)
      lines.clear()

  for line in hlo.splitlines():
    header = _COMPUTATION.match(line)
    if header or _INSTRUCTION.match(line) or line.strip() == "}":
      close()
      if header:
        computation = header.group(1)
      elif line.strip() != "}":
        lines.append(line)
    elif lines:
      lines.append(line.strip())
  close()
  return out


def scan_bodies(table: Mapping[str, Instruction]) -> frozenset[str]:
  """The computations that are a while loop's body (the scanned layers')."""
  return frozenset(m for i in table.values() if i.opcode == "while"
                   for m in re.findall(r"body=%([\w.\-]+)", i.line))


def _dims(line: str) -> set[int]:
  return {int(d) for dims in _SHAPE.findall(line) for d in dims.split(",") if d}


def classify(inst: Instruction, text_len: int, cross: bool = False) -> str:
  """The class of the step an instruction belongs to: a collective by its opcode; attention by
  MaxDiffusion's ``apply_attention`` scope, cross-attention where ``cross``
  (:func:`cross_attention`) or outside the ``shard_map`` over ``text_len`` keys; projections and
  the feed-forward by their modules' names; the rest (norms, modulation, embeddings, copies)
  otherwise."""
  if re.sub(r"-(start|done)$", "", inst.opcode) in COLLECTIVE_OPS:
    return COLLECTIVES
  if cross:
    return CROSS
  if "apply_attention" in inst.op_name:
    return CROSS if _text_keys(inst, text_len) else SELF
  return PROJECTIONS if _PROJECTION.search(inst.op_name + "/") else REST


def _text_keys(inst: Instruction, text_len: int) -> bool:
  # Outside the shard_map: ours (and Ulysses') runs inside it, where a tile can be 512 long.
  return "shard_map" not in inst.op_name and text_len in _dims(inst.line)


def cross_attention(table: Mapping[str, Instruction], text_len: int) -> frozenset[str]:
  """Cross-attention's instructions: in MaxDiffusion's ``apply_attention`` scope (outside svg's
  cond), the ones over the text's keys outside a ``shard_map``, every one that uses their
  results, and every one those use. The scan's op_names do not say ``attn2``: the data path
  does (MaxDiffusion's flash runs cross-attention inside a ``shard_map`` of its own)."""
  scope = {n for n, i in table.items() if ("apply_attention" in i.op_name and branch(i) is None)
           or (not i.op_name and i.opcode in _LAYOUT_OPS)}  # layout ops libtpu added
  users: dict[str, list[str]] = {}
  for name in scope:
    for operand in table[name].operands:
      users.setdefault(operand, []).append(name)

  def reach(start: set[str], step: Callable[[str], Sequence[str]]) -> set[str]:
    seen, todo = set(start), list(start)
    while todo:
      for n in step(todo.pop()):
        if n in scope and n not in seen:
          seen.add(n)
          todo.append(n)
    return seen

  down = reach({n for n in scope if _text_keys(table[n], text_len)}, lambda n: users.get(n, ()))
  return frozenset(reach(down, lambda n: table[n].operands))


def branch(inst: Instruction) -> int | None:
  """Which branch of svg's schedule ``lax.cond`` runs the instruction (0: dense, 1: sparse)."""
  match = _BRANCH.search(inst.op_name)
  return int(match.group(1)) if match else None


def in_layer(inst: Instruction) -> bool:
  """Whether the instruction is in the scanned layers' body."""
  return "/while/body/" in inst.op_name


def collective_bytes(hlo: str) -> list[dict[str, Any]]:
  """Each collective of a module (:func:`~maxdiffusion_svg.bench.hlo.collective_ops`):
  ``{opcode, bytes, layer, branch}``, ``bytes`` its result's per device."""
  out = []
  for op in collective_ops(hlo):
    inst = Instruction(str(op["op"]), str(op["op_name"]), "")
    out.append({"opcode": inst.opcode, "bytes": op["result_bytes"], "layer": in_layer(inst),
                "branch": branch(inst)})
  return out


def flash_calls(table: Mapping[str, Instruction]) -> dict[str, tuple[int, int, int]]:
  """Each call of MaxDiffusion's flash kernel by instruction name: its grid, (heads x batch,
  q rows, kv columns), from its q's and k's shapes and the block sizes in its kernel metadata."""
  out = {}
  for name, inst in table.items():
    if not (name.startswith(FLASH) and inst.opcode == "custom-call"):
      continue
    blocks = _FLASH_BLOCKS.search(inst.line)
    operands = inst.line.partition("operand_layout_constraints=")[2]
    shapes = [[int(d) for d in s.split(",")] for s in _FLOAT_SHAPE.findall(operands)]
    if blocks is None or len(shapes) < 2:
      raise ValueError(f"{name}: no block sizes or q and k shapes to read its grid from")
    (block_q, block_kv), (q, k) = map(int, blocks.groups()), shapes[:2]
    heads = 1
    for d in q[:-2]:
      heads *= d
    out[name] = (heads, -(-q[-2] // block_q), -(-k[-2] // block_kv))
  return out


def flash_prices(directory: str, table: Mapping[str, Instruction]) -> dict[str, int]:
  """Bundles of each call of MaxDiffusion's flash kernel, from its own schedule in the dump:
  every tile of its grid runs the mask-free body (a ``FullMask``; the text's padding is its
  segment ids, applied in every tile), every row opens and closes."""
  calls = flash_calls(table)
  if not calls:
    return {}
  schedules = {k.name.split("-", 1)[-1]: k for k in read_dump(directory, FLASH, SPLASH_LAYOUT)}
  out = {}
  for name, (heads, rows, cols) in calls.items():
    if name not in schedules:
      raise ValueError(f"{name}: no schedule dumped for MaxDiffusion's flash call")
    out[name] = static_bundles(schedules[name], rows * cols, 0, rows, heads)
  return out


def price_classes(directory: str, skip: Sequence[str], layers: int, text_len: int,
                  kernels: Mapping[str, int] | None = None) -> dict[str, Any]:
  """A dumped program's bundles by class: ``outside`` (once per step) and ``layer`` (one layer
  of the scan, ``layer[b]`` without the other branch's computations for cond branch ``b``; key
  ``None``: a program with no cond), each ``{class: bundles}``, and ``total`` (the program as
  compiled, ``layers`` layers, both branches) equal to the classes' sum. MaxDiffusion's flash
  calls are priced from their schedules (:func:`flash_prices`; ``flash_calls``: bundles per
  call); ``kernels``: bundles per call of other skipped Mosaic calls, by instruction."""
  priced = price_program(directory, tuple(skip), loop_trips=layers)
  with open(os.path.join(directory, HLO_FILE), encoding="utf-8") as f:
    table = instructions(f.read())
  cross, bodies = cross_attention(table, text_len), scan_bodies(table)
  layer_of = lambda inst: in_layer(inst) or inst.computation in bodies
  computations = dict(priced["computations"])
  flash = flash_prices(directory, table)
  for name, bundles in {**flash, **(kernels or {})}.items():
    computations[name] = bundles * (layers if layer_of(table[name]) else 1)
  outside = {c: 0 for c in CLASSES}
  outside[REST] = priced["top_level"]  # the program's own bundles: control, the loop, waits
  by_branch: dict[int | None, dict[str, float]] = {}
  shared = {c: 0.0 for c in CLASSES}
  for name, bundles in computations.items():
    inst = table.get(name, Instruction("", "", ""))
    cls = classify(inst, text_len, name in cross)
    if not layer_of(inst):
      outside[cls] += bundles
      continue
    b = branch(inst)
    target = shared if b is None else by_branch.setdefault(b, {c: 0.0 for c in CLASSES})
    target[cls] += bundles / layers
  layer = {None: shared} if not by_branch else {
      b: {c: shared[c] + own[c] for c in CLASSES} for b, own in by_branch.items()}
  return {"total": priced["bundles"] + sum(computations.values()) - sum(
              priced["computations"].values()), "outside": outside, "layer": layer,
          "branches": {b: own for b, own in by_branch.items()}, "shared": shared,
          "unpriced": priced["unpriced"], "priced_as": priced["priced_as"], "flash_calls": flash}


# ----------------------------------------------------------------------------- compiling


def topology_of(slice_type: str) -> str:
  """``v6e-8`` -> ``v6e:2x4``."""
  chip, _, count = slice_type.partition("-")
  if not count.isdigit() or int(count) not in _TOPOLOGIES:
    raise ValueError(f"--slice {slice_type!r}: expected <chip>-<chips> with {sorted(_TOPOLOGIES)} "
                     f"chips, e.g. v6e-8")
  return f"{chip}:{_TOPOLOGIES[int(count)]}"


def compile_dumped(kernel: str, config: str, topology: str, video: Sequence[int], layers: int,
                   directory: str, subfolder: str = "transformer",
                   overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Compiles the Wan forward with ``kernel`` in a child dumping its schedules and HLO into
  ``directory``: the compile's row (``ok``, ``error``, ``seconds``, Mosaic kernel names)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "LIBTPU_INIT_ARGS": " ".join(f for f in (os.environ.get("LIBTPU_INIT_ARGS", ""),
                                                   dump_flags(directory)) if f)}
  args = json.dumps({"kernel": kernel, "config": config, "topology": topology,
                     "video": list(video), "layers": layers, "directory": directory,
                     "subfolder": subfolder, "overrides": dict(overrides or {})})
  result, error = child_result(__name__, [args], env)
  return result if result is not None else {"ok": False, "error": error}


def _compile_here(fields: Mapping[str, Any]) -> dict[str, Any]:
  from maxdiffusion_svg.bench.wan_aot import compile_wan_forwards  # pylint: disable=import-outside-toplevel
  frames, height, width = fields["video"]
  with tempfile.TemporaryDirectory() as hlo_dir:
    result = compile_wan_forwards(
        kernels=(fields["kernel"],), config_path=fields["config"], topology=fields["topology"],
        frames=frames, height=height, width=width, num_layers=fields["layers"],
        hlo_dir=hlo_dir, subfolder=fields["subfolder"], overrides=fields.get("overrides") or None,
        log=lambda line: print(line, file=sys.stderr))
    row = result["kernels"][fields["kernel"]]
    if row["ok"]:
      os.replace(row.pop("hlo"), os.path.join(fields["directory"], HLO_FILE))
  return {k: row[k] for k in ("ok", "error", "seconds", "mosaic_kernel_names", "mesh", "memory")
          if k in row}


# ----------------------------------------------------------------------------- the step


def kernel_prices(estimate: Mapping[str, Any], expert_row: int = 0) -> dict[str, Any]:
  """Per-head Mosaic calls of one layer from ``tiles --config``'s estimate (libtpu's figures):
  our sparse and dense calls (fixed-offset and online paths) and fixed-m's."""
  priced = estimate["rows"][expert_row]["vs_fixed_m"]
  if not priced.get("priced"):
    raise ValueError(f"the kernels cannot be priced: {priced.get('why')}")
  return {"fixed_m": priced["fixed_m_call"],
          **{path: {"sparse": priced[path]["sparse_call"], "dense": priced[path]["dense_call"]}
             for path in ("fixed", "online")}}


def step_row(svg: dict[str, Any], base: dict[str, Any], calls: dict[str, Any], heads: int,
             batch: int, depth: int, sparse_layers: int, path: str = "fixed") -> dict[str, Any]:
  """Bundles of one step at ``depth`` layers by class, svg's at ``sparse_layers`` sparse ones
  (the rest dense) against the baseline's; ``heads`` per device, ``batch`` (CFG's 2)."""
  per_call = heads * batch  # one kernel launch runs every local head of the batch

  def step(program: dict[str, Any], layers: dict[Any, float]) -> dict[str, float]:
    out = {c: float(program["outside"][c]) for c in CLASSES}
    out[KERNEL] = 0.0
    for key, (count, kernel) in layers.items():
      layer = program["layer"][key]
      for c in CLASSES:
        out[c] += count * layer[c]
      out[KERNEL] += count * kernel * per_call
    out[SELF] += out[KERNEL]
    out["total"] = sum(out[c] for c in CLASSES)
    return out

  dense_key, sparse_key = (0, 1) if 1 in svg["layer"] else (None, None)
  ours = step(svg, {sparse_key: (sparse_layers, calls[path]["sparse"]),
                    **({dense_key: (depth - sparse_layers, calls[path]["dense"])}
                       if depth > sparse_layers else {})}
              if sparse_key is not None else {None: (depth, calls[path]["dense"])})
  theirs = step(base, {None: (depth, calls["fixed_m"])})
  return {"svg": ours, "baseline": theirs, "bound": theirs["total"] / ours["total"],
          "baseline_self_attention_share": theirs[SELF] / theirs["total"]}


def collectives_row(hlo: str, layers: int, depth: int, chip: str,
                    sparse: bool = True) -> dict[str, Any]:
  """One step's collective bytes per device (the scan's at ``depth`` layers; svg's cond: the
  ``sparse`` or dense branch) and their time at the chip's ICI bandwidth."""
  total = 0.0
  by_op: dict[str, float] = {}
  for c in collective_bytes(hlo):
    if c["branch"] is not None and c["branch"] != int(sparse):
      continue
    size = c["bytes"] * (depth / layers if c["layer"] else 1)
    by_op[c["opcode"]] = by_op.get(c["opcode"], 0.0) + size
    total += size
  bandwidth, source = ICI.get(chip, (None, ""))
  return {"bytes": total, "by_op": by_op,
          "ici_seconds": total / bandwidth if bandwidth else None,
          "ici_bytes_per_s": bandwidth, "ici_source": source}


def run_step_bench(config: str, slice_type: str, layers: int = 2, subfolder: str = "transformer",
                   overrides: Mapping[str, Any] | None = None,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
  """``bench step``: the configured Wan model's step and run priced from its compiled programs
  (svg's and the baseline's), by class, with ``overrides`` (config keys) on the config; see the
  module's docstring."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin.config_checks import slice_chip
  from maxdiffusion_svg.plugin.estimate import estimate_config
  from maxdiffusion_svg.plugin.overlay import load_config
  from maxdiffusion_svg.plan.target import generation_named, tpu_target
  # pylint: enable=import-outside-toplevel
  keys, chain = load_config(config)
  keys.update(overrides or {})
  chip = slice_chip(slice_type, None)
  estimate = estimate_config(keys, tpu_target(generation_named(chip, "--slice")),
                             slice_type=slice_type, path=chain[0])
  experts = [row["expert"] for row in estimate["rows"]]
  expert = {"transformer": "high_noise", "transformer_2": "low_noise"}.get(subfolder)
  index = experts.index(expert) if expert in experts else 0
  row = estimate["rows"][index]
  calls = kernel_prices(estimate, index)
  video = estimate["video"]
  _, _, _, heads, batch, ring = slice_key(chip, estimate["tokens"], estimate["checks"]["heads"],
                                          estimate["checks"]["slice"])
  topology = topology_of(slice_type)
  out: dict[str, Any] = {
      "kind": "compiled (libtpu's static schedule of the whole program)", "config": config,
      "overrides": dict(overrides or {}),
      "slice": slice_type, "topology": topology, "chip": chip, "video": video,
      "tokens": estimate["tokens"], "layers_compiled": layers, "depth": row["layers"],
      "expert": row["expert"], "steps": row["steps"], "sparse_steps": row["sparse_steps"],
      "sparse_layers": row["sparse_layers"], "kernel_calls_per_head": calls, "programs": {}}
  hlo: dict[str, str] = {}
  for name, kernel in (("svg", "svg"), ("baseline", BASELINES["wan"])):
    with tempfile.TemporaryDirectory(prefix="maxdiffusion_svg_step_") as directory:
      log(f"compiling the forward with attention={kernel}, {layers} layers, for {topology}...")
      compiled = compile_dumped(kernel, config, topology, video, layers, directory, subfolder,
                                overrides)
      if not compiled.get("ok"):
        raise RuntimeError(f"{kernel}: the forward did not compile: {compiled.get('error')}")
      names = sorted(set(compiled["mosaic_kernel_names"]))
      other = [n for n in names if not n.startswith((*PRICED_KERNELS[kernel], FLASH))]
      if other:
        raise ValueError(f"{kernel}'s program calls Mosaic kernels bench step cannot price: "
                         f"{', '.join(other)} (it prices ours, fixed-m's and MaxDiffusion's "
                         f"flash)")
      with open(os.path.join(directory, HLO_FILE), encoding="utf-8") as f:
        hlo[name] = f.read()
      program = price_classes(directory, (*names, "custom-call"), layers, TEXT_LEN)
    program["kernel"] = kernel
    program["mosaic_kernels"] = compiled["mosaic_kernel_names"]
    program["compile_seconds"] = compiled.get("seconds")
    out["programs"][name] = program
  depth, svg, base = row["layers"], out["programs"]["svg"], out["programs"]["baseline"]
  out["heads_per_device"], out["batch"] = heads, batch
  out["heads"] = estimate["checks"]["heads"]
  out["ring"] = ring
  for path in ("fixed", "online"):
    sparse = step_row(svg, base, calls, heads, batch, depth, row["sparse_layers"], path)
    dense = step_row(svg, base, calls, heads, batch, depth, 0, path)
    run = row["sparse_steps"] * sparse["svg"]["total"] + (
        row["steps"] - row["sparse_steps"]) * dense["svg"]["total"]
    out[path] = {"sparse_step": sparse, "dense_step": dense,
                 "run_bound": row["steps"] * sparse["baseline"]["total"] / run}
  out["collectives"] = {
      "svg_sparse": collectives_row(hlo["svg"], layers, depth, chip, sparse=True),
      "svg_dense": collectives_row(hlo["svg"], layers, depth, chip, sparse=False),
      "baseline": collectives_row(hlo["baseline"], layers, depth, chip)}
  assumed = estimate["end_to_end"]
  out["amdahl"] = {"assumed_share": assumed["attention_share"], "source": assumed["source"],
                   "assumed_step_bound": assumed["step_speedup_bound"],
                   "priced_share": out["fixed"]["sparse_step"]["baseline_self_attention_share"]}
  for program in out["programs"].values():  # JSON keys: the cond's branches by number
    program["layer"] = {str(k): v for k, v in program["layer"].items()}
    program["branches"] = {str(k): v for k, v in program["branches"].items()}
  return out


def run_tile_choices(config: str, slice_type: str, choices: Sequence[tuple[int, int, int]],
                     layers: int = 2, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Each tile choice's whole step and run against the baseline (the stored step's, STEP_PRICES):
  its kernel's bodies compiled (``bench schedule``'s case), its svg forward compiled and priced
  (the XLA around the kernel changes with the tiles too), the calls from the config's plan."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench.schedule import ScheduleCase, run_case
  from maxdiffusion_svg.plugin.config_checks import slice_chip
  from maxdiffusion_svg.plugin.estimate import estimate_config
  from maxdiffusion_svg.plugin.overlay import load_config
  from maxdiffusion_svg.plan.target import generation_named, tpu_target
  from maxdiffusion_svg.tpu.prices import PRICES, kernel_prices as prices_of
  # pylint: enable=import-outside-toplevel
  keys, chain = load_config(config)
  chip, topology = slice_chip(slice_type, None), topology_of(slice_type)
  target = tpu_target(generation_named(chip, "--slice"))
  out: dict[str, Any] = {"kind": "compiled (libtpu's static schedule of the whole program)",
                         "config": config, "slice": slice_type, "choices": []}
  for block_q, block_kv, block_kv_compute in choices:
    tiles = {"svg_block_q": block_q, "svg_block_kv": block_kv,
             "svg_block_kv_compute": block_kv_compute}
    estimate = estimate_config({**keys, **tiles}, target, slice_type=slice_type, path=chain[0])
    row = estimate["rows"][0]
    key = slice_key(chip, estimate["tokens"], estimate["checks"]["heads"],
                    estimate["checks"]["slice"])
    stored = step_prices(key)
    if stored is None:
      raise ValueError(f"no stored step for {key}: run bench step on this config first")
    case = ScheduleCase(chip, tuple(estimate["grid"]), 0.35, "aligned", block_q, block_kv,
                        block_kv_compute, backend="pallas")
    kernel = run_case(case, log)
    if not kernel["ok"]:
      raise RuntimeError(f"{block_q}x{block_kv}/{block_kv_compute}: {kernel['error']}")
    prices = prices_of(kernel)
    with tempfile.TemporaryDirectory(prefix="maxdiffusion_svg_step_") as directory:
      log(f"compiling the svg forward at tiles {block_q}x{block_kv}/{block_kv_compute}...")
      compiled = compile_dumped("svg", config, topology, estimate["video"], layers, directory,
                                overrides=tiles)
      if not compiled.get("ok"):
        raise RuntimeError(f"svg at {block_q}x{block_kv}: {compiled.get('error')}")
      program = price_classes(directory, (*sorted(set(compiled["mosaic_kernel_names"])),
                                          "custom-call"), layers, TEXT_LEN)
    rest = lambda layer: sum(v for c, v in layer.items() if c != SELF)
    step = StepPrices(round(sum(program["outside"].values())), round(rest(program["layer"][1])),
                      round(program["layer"][1][SELF]), round(program["layer"][0][SELF]),
                      stored.baseline_outside, stored.baseline_layer_rest,
                      stored.baseline_attention, stored.source)
    tokens, launches = estimate["tokens"], key[3] * key[4]
    sparse = prices.call(row["full_tiles"], row["masked_tiles"], -(-tokens // block_q))
    dense = prices.dense_call(tokens)
    fixed_m = PRICES[chip]["maxdiffusion_fixed_m"].dense_call(tokens)  # as tiles prices it
    ours_sparse = step.step(row["layers"], row["sparse_layers"], sparse, dense, launches)
    ours_dense = step.step(row["layers"], 0, sparse, dense, launches)
    theirs = step.baseline_step(row["layers"], fixed_m, launches)
    run = row["sparse_steps"] * ours_sparse + (row["steps"] - row["sparse_steps"]) * ours_dense
    out["choices"].append({
        "tiles": [block_q, block_kv, block_kv_compute], "kernel": dataclasses.asdict(prices),
        "sparse_call": sparse, "dense_call": dense, "visited_tiles": row["full_tiles"] + row[
            "masked_tiles"], "xla_sparse_attention": step.sparse_attention,
        "xla_dense_attention": step.dense_attention, "xla_layer_rest": step.layer_rest,
        "sparse_layer": step.sparse_attention + launches * sparse,
        "sparse_step": ours_sparse, "dense_step": ours_dense, "baseline_step": theirs,
        "step_bound": theirs / ours_sparse,
        "run_bound": row["steps"] * theirs / run})
  return out


def format_tile_choices(result: dict[str, Any]) -> str:
  """One row per tile choice: the sparse layer's kernel and XLA, the step and the run."""
  m = lambda x: f"{x / 1e6:,.1f}"
  lines = [f"Tiles by the whole step, {result['config']} on {result['slice']} (Mbundles per "
           f"device, libtpu's static schedule of the compiled forward; kernels from their bodies "
           f"and the config's plan):", "",
           "| tiles | tiles visited | sparse call (one head) | kernel per sparse layer | XLA "
           "around it | sparse layer | sparse step | step bound | run bound |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for c in result["choices"]:
    bq, bkv, bkvc = c["tiles"]
    kernel = c["sparse_layer"] - c["xla_sparse_attention"]
    lines.append(f"| {bq}x{bkv}/{bkvc} | {c['visited_tiles']} | {m(c['sparse_call'])} "
                 f"| {m(kernel)} | {m(c['xla_sparse_attention'])} | {m(c['sparse_layer'])} "
                 f"| {m(c['sparse_step'])} | {c['step_bound']:.3f}x | {c['run_bound']:.3f}x |")
  return "\n".join(lines)


def format_step(result: dict[str, Any]) -> str:
  """The step's table: bundles per class, svg (a sparse and a dense step) against the baseline."""
  m = lambda x: f"{x / 1e6:,.1f}"
  fixed = result["fixed"]
  sparse, dense = fixed["sparse_step"], fixed["dense_step"]
  base = sparse["baseline"]
  lines = [f"One denoising step, compiled by libtpu for {result['slice']} ({result['topology']}), "
           f"static bundles per device (Mbundles, not time): {result['config']}"
           + (f", expert {result['expert']}" if result["expert"] else "")
           + f"; video {'x'.join(map(str, result['video']))} ({result['tokens']:,} tokens); "
           f"{result['layers_compiled']} scanned layers compiled, priced as the program outside "
           f"the scan plus {result['depth']} x one layer; self-attention kernels priced from their "
           f"plans" + (", MaxDiffusion's flash from its schedule" if any(
               p.get("flash_calls") for p in result["programs"].values()) else ""),
           "",
           f"| class | baseline ({result['programs']['baseline']['kernel']}) | svg, sparse step "
           f"({result['sparse_layers']} of {result['depth']} layers sparse) | svg, dense step |",
           "|---|---:|---:|---:|"]
  for cls in (SELF, KERNEL, *CLASSES[1:]):
    label = f"  of which the kernel" if cls == KERNEL else cls
    lines.append(f"| {label} | {m(base[cls])} | {m(sparse['svg'][cls])} | {m(dense['svg'][cls])} |")
  lines.append(f"| **step** | {m(base['total'])} | {m(sparse['svg']['total'])} "
               f"| {m(dense['svg']['total'])} |")
  online = result["online"]
  lines += ["",
            f"step bound against the baseline: sparse step {sparse['bound']:.2f}x (every head on "
            f"online softmax: {online['sparse_step']['bound']:.2f}x), dense step "
            f"{dense['bound']:.2f}x; the run ({result['sparse_steps']} of {result['steps']} steps "
            f"sparse): {fixed['run_bound']:.2f}x (online: {online['run_bound']:.2f}x)"]
  coll = result["collectives"]
  ici = coll["baseline"]["ici_bytes_per_s"]
  where = (f"at {ici / 1e9:,.0f} GB/s bidirectional ICI per chip ({coll['baseline']['ici_source']})"
           if ici else "no ICI bandwidth stated for this chip")
  lines.append("collectives per step and device (result bytes): baseline "
               f"{coll['baseline']['bytes'] / 2**20:,.0f} MiB, svg sparse step "
               f"{coll['svg_sparse']['bytes'] / 2**20:,.0f} MiB, dense step "
               f"{coll['svg_dense']['bytes'] / 2**20:,.0f} MiB; {where}"
               + (f": {coll['baseline']['ici_seconds'] * 1e3:,.1f} / "
                  f"{coll['svg_sparse']['ici_seconds'] * 1e3:,.1f} / "
                  f"{coll['svg_dense']['ici_seconds'] * 1e3:,.1f} ms, not in the bundles" if ici else ""))
  amdahl = result["amdahl"]
  lines.append(f"cross-check: the baseline's self-attention is {amdahl['priced_share']:.1%} of its "
               f"step's bundles; Amdahl's law had assumed {amdahl['assumed_share']:.1%} "
               f"({amdahl['source']}), a step bound of {amdahl['assumed_step_bound']:.2f}x")
  return "\n".join(lines)


def _main(argv: Sequence[str]) -> None:
  print_result(_compile_here(json.loads(argv[1])))


if __name__ == "__main__":
  _main(sys.argv)
