"""One denoising step priced from its compiled program (``bench step``), not an assumed share.

The configured model's forward (the CFG pair in, guided noise out: one step; Wan's or LTX-2's,
:data:`STEP_MODELS`) is compiled by libtpu for the slice, at ``layers`` layers in MaxDiffusion's
scan, once with ``svg`` and once with the dense baseline (Wan: ``ulysses_custom_fixed_m`` at its
fast recipe; LTX-2: its default ``flash``), each in a child whose libtpu dumps its final
schedules. Every computation the program calls is priced by
:func:`~maxdiffusion_svg.bench.schedule_xla.price_program` and put in one class by its HLO
instruction (Wan: :func:`classify`; LTX-2, by its named scopes: :func:`classify_ltx2`). Our
kernel and fixed-m's are priced from their plans (:mod:`maxdiffusion_svg.tpu.prices`: ours per
visited tile, fixed-m's per tile of its recipe); MaxDiffusion's flash (Wan's cross-attention
where ``flash_min_seq_length`` lets it, LTX-2's video self-attention) from its own schedule in
the dump, every tile of its grid visited (:func:`flash_prices`). Where the mesh splits the
sequence over a ring (Ulysses shards x a ring), Wan's baseline is ``ulysses_ring_custom_fixed_m``
and the kernels are priced per device (:func:`ring_calls`: svg's slowest ring shard).

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
from maxdiffusion_svg.bench.ltx2_model import TEXT_LEN as LTX2_TEXT_LEN
from maxdiffusion_svg.bench.schedule import static_bundles
from maxdiffusion_svg.bench.schedule_xla import HLO_FILE, price_program
from maxdiffusion_svg.tpu.aot import child_result, print_result
from maxdiffusion_svg.tpu.bundles import SPLASH_LAYOUT, dump_flags, read_dump
from maxdiffusion_svg.tpu.step_prices import StepPrices, slice_key, step_prices

SELF, CROSS, PROJECTIONS, COLLECTIVES, REST = (
    "self-attention", "cross-attention", "projections and MLP", "collectives", "norms and the rest")
CLASSES = (SELF, CROSS, PROJECTIONS, COLLECTIVES, REST)
AUDIO = "audio self-attention"  # LTX-2's, dense in both programs
LTX2_CLASSES = (SELF, AUDIO, CROSS, PROJECTIONS, COLLECTIVES, REST)
KERNEL = "self-attention kernel"  # the Mosaic kernels' share of SELF, priced from plans
COLLECTIVE_OPS = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")
# Bidirectional ICI bandwidth per chip, bytes/s, as Google Cloud's TPU pages state it.
ICI = {"v5e": (400e9, "cloud.google.com/tpu/docs/v5e"),
       "v6e": (800e9, "cloud.google.com/tpu/docs/v6e")}
# Module names MaxDiffusion's Wan gives its projections and feed-forward (in HLO op_name paths).
_PROJECTION = re.compile(r"/(?:\w*_proj|proj_\w+|gelu|ffn|net_\d|linear_?\d*|to_out\w*|\w*embed\w*)/")
_BRANCH = re.compile(r"(?:apply_attention|Video Self-Attention)/.*?cond/branch_(\d+)_fun")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
_SHAPE = re.compile(r"\b(?:bf16|f16|f32|f64|s8|u8|s16|u16|s32|u32|s64|u64|pred)\[([\d,]*)\]")
# The self-attention kernels a step is priced with from their plans, by their HLO names: ours
# and fixed-m's (its vmap'd kernel). MaxDiffusion's flash (jax's Splash, FLASH) is priced from its
# own dumped schedule; a program calling any other Mosaic kernel is refused, naming it.
PRICED_KERNELS = {"svg": ("svg_pallas",), "ulysses_custom_fixed_m": ("vmap__",),
                  "ulysses_ring_custom_fixed_m": ("branch_",)}  # the ring's two scan bodies
FLASH = "splash_mha"
# Our small Mosaic kernels around the sparse one (the router's sampled rows, the placement of
# temporal heads): no body model prices them, so a step leaves their bundles out and says so.
UNPRICED = ("svg_sampled_rows", "svg_head_order")
_FLASH_BLOCKS = re.compile(r'\\"block_q\\": (\d+), \\"block_kv\\": (\d+)')
_FLOAT_SHAPE = re.compile(r"\b(?:bf16|f16|f32)\[([\d,]+)\]")
_LAYOUT_OPS = ("bitcast", "copy", "copy-start", "copy-done", "reshape", "transpose")
_TOPOLOGIES = {1: "1x1", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8"}
TEXT_LEN = 512  # the text tokens the forward is compiled with (Wan's max_sequence_length)
# LTX-2's block scopes and the class of the attention inside each (text cross-attention, attn2
# and audio_attn2, has none of its own).
_LTX2_BLOCKS = (("Video Self-Attention/", SELF), ("Audio Self-Attention/", AUDIO),
                ("Audio-to-Video Cross-Attention/", CROSS),
                ("Video-to-Audio Cross-Attention/", CROSS))
_LTX2_ATTENTION = "Attention and Output Project/"


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


def classify_ltx2(inst: Instruction, text_len: int = 0, cross: bool = False) -> str:
  """An LTX-2 instruction's class by MaxDiffusion's named scopes (``enable_jax_named_scopes``):
  q/k/v projections, the output projection (the ``dot_general`` right inside ``Attention and
  Output Project``) and every other ``dot_general`` (feed-forward, embeddings, modulation) are
  projections; the attention between them is its block's class, text cross-attention having no
  block scope; q/k norms, RoPE and the rest otherwise (``text_len``, ``cross``: unused)."""
  del text_len, cross
  if re.sub(r"-(start|done)$", "", inst.opcode) in COLLECTIVE_OPS:
    return COLLECTIVES
  name = inst.op_name + "/"
  if "/QKV Projection/" in name:
    return PROJECTIONS
  head, found, tail = name.partition(_LTX2_ATTENTION)
  if found:
    if tail.startswith("dot_general/"):
      return PROJECTIONS
    return next((cls for scope, cls in _LTX2_BLOCKS if scope in head), CROSS)
  return PROJECTIONS if "/dot_general/" in name else REST


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


def price_classes(directory: str, skip: Sequence[str], layers: int, text_len: int | None = None,
                  kernels: Mapping[str, int] | None = None,
                  model: StepModel | None = None) -> dict[str, Any]:
  """A dumped program's bundles by class: ``outside`` (once per step) and ``layer`` (one layer
  of the scan, ``layer[b]`` without the other branch's computations for cond branch ``b``; key
  ``None``: a program with no cond), each ``{class: bundles}``, and ``total`` (the program as
  compiled, ``layers`` layers, both branches) equal to the classes' sum. MaxDiffusion's flash
  calls are priced from their schedules (:func:`flash_prices`; ``flash_calls``: bundles per
  call, ``flash_layer``: a layer's by class); ``kernels``: bundles per call of other skipped
  Mosaic calls, by instruction. ``model``: the family's classes (default Wan's); ``text_len``:
  its text tokens unless given."""
  model = model or STEP_MODELS["Wan"]
  text_len = model.text_len if text_len is None else text_len
  classes = model.classes
  priced = price_program(directory, tuple(skip), loop_trips=layers)
  with open(os.path.join(directory, HLO_FILE), encoding="utf-8") as f:
    table = instructions(f.read())
  bodies = scan_bodies(table)
  cross = cross_attention(table, text_len) if model.data_path else frozenset()
  layer_of = lambda inst: in_layer(inst) or inst.computation in bodies
  computations = dict(priced["computations"])
  flash = flash_prices(directory, table)
  for name, bundles in {**flash, **(kernels or {})}.items():
    computations[name] = bundles * (layers if layer_of(table[name]) else 1)
  outside = {c: 0 for c in classes}
  outside[REST] = priced["top_level"]  # the program's own bundles: control, the loop, waits
  by_branch: dict[int | None, dict[str, float]] = {}
  shared = {c: 0.0 for c in classes}
  flash_layer = {c: 0.0 for c in classes}
  for name, bundles in computations.items():
    inst = table.get(name, Instruction("", "", ""))
    cls = model.classify(inst, text_len, name in cross)
    if not layer_of(inst):
      outside[cls] += bundles
      continue
    b = branch(inst)
    target = shared if b is None else by_branch.setdefault(b, {c: 0.0 for c in classes})
    target[cls] += bundles / layers
    if name in flash:
      flash_layer[cls] += bundles / layers
  layer = {None: shared} if not by_branch else {
      b: {c: shared[c] + own[c] for c in classes} for b, own in by_branch.items()}
  return {"total": priced["bundles"] + sum(computations.values()) - sum(
              priced["computations"].values()), "outside": outside, "layer": layer,
          "branches": {b: own for b, own in by_branch.items()}, "shared": shared,
          "unpriced": priced["unpriced"], "priced_as": priced["priced_as"], "flash_calls": flash,
          "flash_layer": flash_layer}


# ----------------------------------------------------------------------------- compiling


def topology_of(slice_type: str) -> str:
  """``v6e-8`` -> ``v6e:2x4``."""
  chip, _, count = slice_type.partition("-")
  if chip not in ("v5e", "v6e"):  # the others' slice names count TensorCores, not chips
    raise ValueError(f"--slice {slice_type!r}: bench step compiles v5e and v6e slices (a device "
                     f"per chip), e.g. v6e-8")
  if not count.isdigit() or int(count) not in _TOPOLOGIES:
    raise ValueError(f"--slice {slice_type!r}: expected <chip>-<chips> with {sorted(_TOPOLOGIES)} "
                     f"chips, e.g. v6e-8")
  return f"{chip}:{_TOPOLOGIES[int(count)]}"


def compile_dumped(kernel: str, config: str, topology: str, video: Sequence[int], layers: int,
                   directory: str, subfolder: str = "transformer",
                   overrides: Mapping[str, Any] | None = None,
                   family: str = "Wan") -> dict[str, Any]:
  """Compiles ``family``'s forward (:data:`STEP_MODELS`) with ``kernel`` in a child dumping its
  schedules and HLO into ``directory``: the compile's row (``ok``, ``error``, ``seconds``,
  Mosaic kernel names)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "LIBTPU_INIT_ARGS": " ".join(f for f in (os.environ.get("LIBTPU_INIT_ARGS", ""),
                                                   dump_flags(directory)) if f)}
  args = json.dumps({"kernel": kernel, "config": config, "topology": topology,
                     "video": list(video), "layers": layers, "directory": directory,
                     "subfolder": subfolder, "overrides": dict(overrides or {}),
                     "family": family})
  result, error = child_result(__name__, [args], env)
  return result if result is not None else {"ok": False, "error": error}


def _compile_wan(fields: Mapping[str, Any], hlo_dir: str) -> dict[str, Any]:
  from maxdiffusion_svg.bench.wan_aot import compile_wan_forwards  # pylint: disable=import-outside-toplevel
  frames, height, width = fields["video"]
  result = compile_wan_forwards(
      kernels=(fields["kernel"],), config_path=fields["config"], topology=fields["topology"],
      frames=frames, height=height, width=width, num_layers=fields["layers"],
      hlo_dir=hlo_dir, subfolder=fields["subfolder"], overrides=fields.get("overrides") or None,
      log=lambda line: print(line, file=sys.stderr))
  return result["kernels"][fields["kernel"]]


def _compile_ltx2(fields: Mapping[str, Any], hlo_dir: str) -> dict[str, Any]:
  from maxdiffusion_svg.bench.ltx2_aot import KERNEL_KEYS, compile_forward  # pylint: disable=import-outside-toplevel
  kernel = fields["kernel"]
  return compile_forward(kernel, fields["config"], fields["topology"], tuple(fields["video"]),
                         num_layers=fields["layers"], hlo_dir=hlo_dir,
                         overrides={**(fields.get("overrides") or {}),
                                    **KERNEL_KEYS.get(kernel, {})},
                         log=lambda line: print(line, file=sys.stderr))


@dataclasses.dataclass(frozen=True)
class StepModel:
  """What ``bench step`` needs of a model family."""

  baseline: str  # the dense kernel its step is priced against
  ring_baseline: str | None  # ... on a mesh with a ring (None: not priced there)
  text_len: int  # the text tokens its forward is compiled with
  classes: tuple[str, ...]
  classify: Callable[[Instruction, int, bool], str]  # (instruction, text_len, cross) -> class
  data_path: bool  # cross-attention found by its data path (:func:`cross_attention`)
  overrides: Mapping[str, Any]  # config keys its compile needs
  compile: Callable[[Mapping[str, Any], str], dict[str, Any]]  # in the child: (fields, HLO dir)


# By the family's name (plugin.video_models). LTX-2's baseline is its default kernel: fixed-m
# does not compile for it (bench/ltx2_aot.py); its named scopes class its streams.
STEP_MODELS = {
    "Wan": StepModel("ulysses_custom_fixed_m", "ulysses_ring_custom_fixed_m", TEXT_LEN, CLASSES,
                     classify, True, {}, _compile_wan),
    "LTX-2": StepModel("flash", None, LTX2_TEXT_LEN, LTX2_CLASSES, classify_ltx2, False,
                       {"enable_jax_named_scopes": True}, _compile_ltx2),
}


def _compile_here(fields: Mapping[str, Any]) -> dict[str, Any]:
  with tempfile.TemporaryDirectory() as hlo_dir:
    row = STEP_MODELS[fields.get("family", "Wan")].compile(fields, hlo_dir)
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


def ring_calls(keys: Mapping[str, Any], estimate: Mapping[str, Any], chip: str, launches: int,
               expert: str | None = None) -> dict[str, Any]:
  """One device's self-attention kernels a layer on a ring mesh, from the config's plan
  (:func:`~maxdiffusion_svg.tpu.prices.ring_kernel_prices`, ``launches`` heads x items): svg's
  slowest ring shard (the step waits for it) and our dense branch, on the fixed offset and
  online, against ``ulysses_ring_custom_fixed_m``'s ring calls; ``step_row``'s ``calls``
  (``expert``: Wan 2.2's, None otherwise)."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plan.target import generation_named, resolve_backend, tpu_target
  from maxdiffusion_svg.plugin.settings import PluginSettings, config_defaults
  from maxdiffusion_svg.plugin.video_models import grid_of
  from maxdiffusion_svg.tpu.prices import ring_kernel_prices
  # pylint: enable=import-outside-toplevel
  merged = {**config_defaults(), **keys}
  svg = PluginSettings.from_mapping(merged).svg
  target = svg.target(target=tpu_target(generation_named(chip, "--slice")))
  plan = svg.plan(grid_of(merged), expert, target, resolve_backend(svg.backend, target))
  mesh = estimate["checks"]["slice"]
  args = (plan, estimate["tokens"], mesh["context_shards"], mesh["ulysses_shards"], launches, chip)
  fixed, online = ring_kernel_prices(*args), ring_kernel_prices(*args, online=True)
  if fixed is None:
    raise ValueError(f"no static-schedule prices for {chip}: the ring's kernels cannot be priced")
  return {"fixed_m": fixed["ring_custom_fixed_m"], "svg_shards": fixed["svg_shards"],
          **{path: {"sparse": p["svg_max"], "dense": p["ours_dense"]}
             for path, p in (("fixed", fixed), ("online", online))}}


def step_row(svg: dict[str, Any], base: dict[str, Any], calls: dict[str, Any], heads: int,
             batch: int, depth: int, sparse_layers: int, path: str = "fixed",
             base_kernel: float | None = None) -> dict[str, Any]:
  """Bundles of one step at ``depth`` layers by class, svg's at ``sparse_layers`` sparse ones
  (the rest dense) against the baseline's; ``heads`` per device, ``batch`` (CFG's 2).
  ``base_kernel``: the baseline's self-attention kernel a layer, already in its program (LTX-2's
  flash, priced from its schedule); None: fixed-m's from its plan (``calls["fixed_m"]``)."""
  per_call = heads * batch  # one kernel launch runs every local head of the batch

  def step(program: dict[str, Any], layers: dict[Any, float]) -> dict[str, float]:
    classes = tuple(program["outside"])
    out = {c: float(program["outside"][c]) for c in classes}
    out[KERNEL] = 0.0
    for key, (count, kernel) in layers.items():
      layer = program["layer"][key]
      for c in classes:
        out[c] += count * layer[c]
      out[KERNEL] += count * kernel * per_call
    out[SELF] += out[KERNEL]
    out["total"] = sum(out[c] for c in classes)
    return out

  dense_key, sparse_key = (0, 1) if 1 in svg["layer"] else (None, None)
  ours = step(svg, {sparse_key: (sparse_layers, calls[path]["sparse"]),
                    **({dense_key: (depth - sparse_layers, calls[path]["dense"])}
                       if depth > sparse_layers else {})}
              if sparse_key is not None else {None: (depth, calls[path]["dense"])})
  # A cond in the baseline is the ring fixed-m's: branch 1 its every-head-fixed path.
  base_key = None if None in base["layer"] else 1
  if base_kernel is None:
    theirs = step(base, {base_key: (depth, calls["fixed_m"])})
  else:
    theirs = step(base, {base_key: (depth, 0.0)})
    theirs[KERNEL] = depth * base_kernel
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
  """``bench step``: the configured model's step and run priced from its compiled programs
  (svg's and the baseline's), by class, with ``overrides`` (config keys) on the config; see the
  module's docstring."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plugin.config_checks import slice_chip
  from maxdiffusion_svg.plugin.estimate import estimate_config
  from maxdiffusion_svg.plugin.overlay import load_config
  from maxdiffusion_svg.plugin.video_models import video_model
  from maxdiffusion_svg.plan.target import generation_named, tpu_target
  # pylint: enable=import-outside-toplevel
  keys, chain = load_config(config)
  keys.update(overrides or {})
  family = video_model(keys).name
  if family not in STEP_MODELS:
    raise ValueError(f"--config {config}: bench step prices {' and '.join(STEP_MODELS)} "
                     f"steps, not {family}'s")
  model = STEP_MODELS[family]
  chip = slice_chip(slice_type, None)
  estimate = estimate_config(keys, tpu_target(generation_named(chip, "--slice")),
                             slice_type=slice_type, path=chain[0])
  experts = [row["expert"] for row in estimate["rows"]]
  expert = {"transformer": "high_noise", "transformer_2": "low_noise"}.get(subfolder)
  index = experts.index(expert) if expert in experts else 0
  row = estimate["rows"][index]
  calls = kernel_prices(estimate, index)
  video = estimate["video"]
  _, _, _, _, heads, batch, ring = slice_key(family, chip, estimate["tokens"],
                                             estimate["checks"]["heads"],
                                             estimate["checks"]["slice"])
  baseline = model.baseline if ring == 1 else model.ring_baseline
  if baseline is None:
    raise ValueError(f"--slice {slice_type}: bench step prices {family} where no ring splits the "
                     f"sequence; this mesh has a ring of {ring}")
  # On a ring a device runs one shard's share of each head: its kernels come per device.
  per_device = ring_calls(keys, estimate, chip, heads * batch, row["expert"]) if ring > 1 else None
  topology = topology_of(slice_type)
  out: dict[str, Any] = {
      "kind": "compiled (libtpu's static schedule of the whole program)", "config": config,
      "family": family, "overrides": dict(overrides or {}),
      "slice": slice_type, "topology": topology, "chip": chip, "video": video,
      "tokens": estimate["tokens"], "layers_compiled": layers, "depth": row["layers"],
      "expert": row["expert"], "steps": row["steps"], "sparse_steps": row["sparse_steps"],
      "sparse_layers": row["sparse_layers"], "programs": {},
      **({"kernel_calls_per_head": calls} if per_device is None else
         {"kernel_per_device": per_device})}
  hlo: dict[str, str] = {}
  for name, kernel in (("svg", "svg"), ("baseline", baseline)):
    with tempfile.TemporaryDirectory(prefix="maxdiffusion_svg_step_") as directory:
      log(f"compiling the forward with attention={kernel}, {layers} layers, for {topology}...")
      compiled = compile_dumped(kernel, config, topology, video, layers, directory, subfolder,
                                {**(overrides or {}), **model.overrides}, family)
      if not compiled.get("ok"):
        raise RuntimeError(f"{kernel}: the forward did not compile: {compiled.get('error')}")
      names = sorted(set(compiled["mosaic_kernel_names"]))
      other = [n for n in names
               if not n.startswith((*PRICED_KERNELS.get(kernel, ()), FLASH, *UNPRICED))]
      if other:
        raise ValueError(f"{kernel}'s program calls Mosaic kernels bench step cannot price: "
                         f"{', '.join(other)} (it prices ours, fixed-m's and MaxDiffusion's "
                         f"flash)")
      with open(os.path.join(directory, HLO_FILE), encoding="utf-8") as f:
        hlo[name] = f.read()
      program = price_classes(directory, (*names, "custom-call"), layers, model=model)
    program["kernel"] = kernel
    program["mosaic_kernels"] = compiled["mosaic_kernel_names"]
    program["unpriced_kernels"] = [n for n in names if n.startswith(UNPRICED)]
    program["compile_seconds"] = compiled.get("seconds")
    out["programs"][name] = program
  depth, svg, base = row["layers"], out["programs"]["svg"], out["programs"]["baseline"]
  out["heads_per_device"], out["batch"] = heads, batch
  out["heads"] = estimate["checks"]["heads"]
  out["ring"] = ring
  # A baseline whose kernel is not priced from its plan (LTX-2's flash) has it in its program.
  base_kernel = None if model.baseline in PRICED_KERNELS else base["flash_layer"][SELF]
  launch = (heads, batch) if per_device is None else (1, 1)
  for path in ("fixed", "online"):
    sparse = step_row(svg, base, per_device or calls, *launch, depth, row["sparse_layers"], path,
                      base_kernel)
    dense = step_row(svg, base, per_device or calls, *launch, depth, 0, path, base_kernel)
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
  tiled = [{"svg_block_q": q, "svg_block_kv": kv, "svg_block_kv_compute": step}
           for q, kv, step in choices]
  # Every choice checked (the run's own checks) before the first compile.
  estimates = [estimate_config({**keys, **tiles}, target, slice_type=slice_type, path=chain[0])
               for tiles in tiled]
  for (block_q, block_kv, block_kv_compute), tiles, estimate in zip(choices, tiled, estimates):
    row = estimate["rows"][0]
    key = slice_key("Wan", chip, estimate["tokens"], estimate["checks"]["heads"],
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
    tokens, launches = estimate["tokens"], key[4] * key[5]
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
           f"the scan plus {result['depth']} x one layer; "
           + ("self-attention kernels priced from their plans" if result["programs"]["baseline"][
               "kernel"] in PRICED_KERNELS else "our kernel priced from its plans")
           + (" per device (svg: its slowest ring shard)" if "kernel_per_device" in result
              else "")
           + (", MaxDiffusion's flash from its schedule" if any(
               p.get("flash_calls") for p in result["programs"].values()) else ""),
           "",
           f"| class | baseline ({result['programs']['baseline']['kernel']}) | svg, sparse step "
           f"({result['sparse_layers']} of {result['depth']} layers sparse) | svg, dense step |",
           "|---|---:|---:|---:|"]
  classes = tuple(result["programs"]["baseline"]["outside"])
  for cls in (SELF, KERNEL, *(c for c in classes if c != SELF)):
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
  unpriced = sorted({n.rsplit(".", 1)[0] for p in result["programs"].values()
                     for n in p.get("unpriced_kernels", ())})
  if unpriced:
    lines.append(f"left out of svg's bundles (no body model prices them; the XLA they replaced "
                 f"cost more): {', '.join(unpriced)}")
  amdahl = result["amdahl"]
  lines.append(f"cross-check: the baseline's self-attention is {amdahl['priced_share']:.1%} of its "
               f"step's bundles; Amdahl's law had assumed {amdahl['assumed_share']:.1%} "
               f"({amdahl['source']}), a step bound of {amdahl['assumed_step_bound']:.2f}x")
  return "\n".join(lines)


def _main(argv: Sequence[str]) -> None:
  print_result(_compile_here(json.loads(argv[1])))


if __name__ == "__main__":
  _main(sys.argv)
