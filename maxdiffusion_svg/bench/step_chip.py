"""``bench step --on-chip``: one denoising step of MaxDiffusion's Wan timed on the TPU it runs on.

The model is built as a run builds it (MaxDiffusion's ``create_sharded_logical_transformer``, the
plugin's create-transformer hook preparing ``svg``) with random weights at the real shapes: only
the Hugging Face config (the architecture :mod:`~maxdiffusion_svg.bench.wan_aot` holds) and the
weight reader are replaced. Its jitted ``transformer_forward_pass`` (the CFG pair in, guided noise
out) is one step, timed after compiling (best of ``repeats``), for ``svg`` at a sparse step and
at a dense one (the timestep picks the step, as in a run) and for the dense kernels a user could
pick instead, every kernel in one process. The run is the schedule's dense and sparse steps
added up against as many baseline steps (the denoising loop only: text encoder and VAE are the
same for every kernel and left out). A model timed at fewer layers than its depth is scaled
(outside the layers + depth x one layer, from two layer counts) and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import platform
import re
import time
from typing import Any, Callable, Iterator, Mapping, Sequence
from unittest import mock

from maxdiffusion_svg.bench.wan_aot import (DEFAULT_CONFIG, GUIDANCE_SCALE, REPO, WAN_14B,
                                            architecture_for, init_config, latent_shape,
                                            stand_in_loaders)
from maxdiffusion_svg.plan.target import MIB

MODERATE, AGGRESSIVE = "moderate", "aggressive"
FIXED_M, FLASH = "ulysses_custom_fixed_m", "flash"
# The dense kernels' blocks on a v5e: the fastest of each timed per call on the chip
# (docs/measurements/chip_v5e_cases.json: fixed-m's search, flash's search).
DENSE_BLOCKS = {
    FIXED_M: {"block_q": 2048, "block_kv": 2048, "block_kv_compute": 1024,
              "block_kv_compute_in": 1024, "vmem_limit_bytes": 64 * MIB},
    FLASH: {"block_q": 1024, "block_kv": 1024, "block_kv_compute": 512, "block_q_dkv": 1024,
            "block_kv_dkv": 1024, "block_kv_dkv_compute": 512, "block_q_dq": 1024,
            "block_kv_dq": 1024},
}
# One chip: every mesh axis 1, one video (the CFG pair is the forward's batch of 2).
ONE_CHIP = {"ici_data_parallelism": 1, "ici_fsdp_parallelism": 1, "ici_context_parallelism": 1,
            "ici_tensor_parallelism": 1, "per_device_batch_size": 1}


@dataclasses.dataclass(frozen=True)
class StepCase:
  """A model and video timed as a step: ``layers`` None runs the model's depth."""

  name: str
  config: str
  height: int
  width: int
  frames: int = 81
  layers: tuple[int, ...] | None = None  # two counts: scaled to the depth


CASES = {c.name: c for c in (
    StepCase("wan1.3b_480p", "configs/wan_svg_1_3b.yml", 480, 832),
    StepCase("wan1.3b_720p", "configs/wan_svg_1_3b.yml", 720, 1280),
    StepCase("wan14b_720p", str(DEFAULT_CONFIG.relative_to(REPO)), 720, 1280, layers=(1, 2)),
)}


@dataclasses.dataclass(frozen=True)
class StepBenchConfig:
  cases: tuple[str, ...] = ("wan1.3b_720p",)
  kernels: tuple[str, ...] = (FIXED_M, FLASH)  # the dense kernels timed beside svg
  presets: tuple[str, ...] = (MODERATE, AGGRESSIVE)
  repeats: int = 2
  profile: bool = False  # a trace of svg's sparse step: its device time by part


# ------------------------------------------------------------------------ random weights


def random_param(name: tuple[str, ...], shape: tuple[int, ...], dtype: Any, index: int) -> Any:
  """A stand-in weight: norms' scales 1, biases 0, the rest normal with std 0.02."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  leaf = str(name[-1]).lower()
  if "norm" in "/".join(map(str, name)).lower() and leaf in ("scale", "weight"):
    return jnp.ones(shape, dtype)
  if leaf == "bias":
    return jnp.zeros(shape, dtype)
  return (0.02 * jax.random.normal(jax.random.key(index), shape, jnp.float32)).astype(dtype)


@contextlib.contextmanager
def random_loaders(architecture: Mapping[str, Any]) -> Iterator[None]:
  """``create_sharded_logical_transformer`` with ``architecture`` for the Hugging Face config and
  random weights (:func:`random_param`) for the checkpoint; placement is MaxDiffusion's own."""
  from maxdiffusion.pipelines.wan import wan_pipeline  # pylint: disable=import-outside-toplevel
  load_config, load_weights = stand_in_loaders(dict(architecture), random_param)
  with mock.patch.object(wan_pipeline.WanModel, "load_config", side_effect=load_config), \
       mock.patch.object(wan_pipeline, "load_wan_transformer", side_effect=load_weights):
    yield


def build_model(config_path: str, kernel: str, overrides: Mapping[str, Any],
                num_layers: int | None = None,
                architecture: Mapping[str, Any] | None = None) -> tuple[Any, Any, Any]:
  """``(config, mesh, model)``: the run's transformer for ``kernel`` on this host's first device."""
  # pylint: disable=import-outside-toplevel
  from flax import nnx
  from jax.sharding import Mesh
  from maxdiffusion import max_utils
  from maxdiffusion.pipelines.wan import wan_pipeline

  from maxdiffusion_svg import plugin
  # pylint: enable=import-outside-toplevel
  plugin.register()
  config = init_config(REPO / config_path, kernel, **overrides)
  arch = dict(architecture or architecture_for(config))
  if num_layers is not None:
    arch["num_layers"] = num_layers
  import jax  # pylint: disable=import-outside-toplevel
  # One chip (the first) however many the host has: the step of one device's share.
  array = max_utils.create_device_mesh(config, devices=jax.devices()[:1], logging=False)
  mesh = Mesh(array, config.mesh_axes)
  with random_loaders(arch), mesh:
    model = wan_pipeline.create_sharded_logical_transformer(
        devices_array=array, mesh=mesh, rngs=nnx.Rngs(0), config=config, subfolder="transformer")
  return config, mesh, model


# ---------------------------------------------------------------------------------- timing


Clock = Callable[[Callable[[], Any], int], tuple[float, float]]


def _clock(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
  from maxdiffusion_svg.bench.timing import time_call  # pylint: disable=import-outside-toplevel
  return time_call(fn, repeats)


def step_inputs(case: StepCase, text_dim: int, batch: int = 2, text_len: int = 512) -> tuple:
  """Latents, prompt embeddings (the CFG pair) for ``case``'s video, on the default device."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  k1, k2 = jax.random.split(jax.random.key(1))
  latents = jax.random.normal(k1, (batch, *latent_shape(case.frames, case.height, case.width)),
                              jnp.float32)
  text = jax.random.normal(k2, (batch, text_len, text_dim), jnp.float32)
  return latents, text


def forward_call(config: Any, mesh: Any, model: Any, latents: Any, text: Any
                 ) -> tuple[Callable[[float], Any], Callable[[float], str]]:
  """``step(t)``: the run's jitted forward on the CFG pair at timestep ``t``; ``hlo(t)``: its
  compiled program's text (instruction names as the profiler reports them)."""
  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp
  from flax import nnx
  from flax.linen import partitioning as nn_partitioning
  from maxdiffusion.pipelines.wan import wan_pipeline
  # pylint: enable=import-outside-toplevel
  graphdef, state, rest = nnx.split(model, nnx.Param, ...)
  forward = wan_pipeline.transformer_forward_pass
  batch = latents.shape[0]

  def args(t: float) -> tuple[tuple, dict]:
    return ((graphdef, state, rest, latents, jnp.full((batch,), t, jnp.int32), text),
            {"do_classifier_free_guidance": batch > 1, "guidance_scale": GUIDANCE_SCALE})

  def step(t: float) -> Any:
    a, kw = args(t)
    with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
      return forward(*a, **kw)

  def hlo(t: float) -> str:
    a, kw = args(t)
    with mesh, nn_partitioning.axis_rules(config.logical_axis_rules):
      return getattr(forward, "jitted", forward).lower(*a, **kw).compile().as_text()
  return step, hlo


def schedule_steps(model: Any, steps: int) -> tuple[list[float], int | None, int | None, int]:
  """The run's timesteps written into the svg model; its first dense and first sparse step
  (None where there is none) and the count of sparse steps."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  from maxdiffusion_svg.plugin import hooks  # pylint: disable=import-outside-toplevel
  timesteps = [float(t) for t in np.linspace(999.0, 0.0, steps)]
  hooks.set_denoising_schedule(model, timesteps)
  active = model.svg_settings.svg.schedule.active_steps
  sparse = [i for i in range(steps) if active.contains(i)]
  dense = [i for i in range(steps) if not active.contains(i)]
  return timesteps, (dense[0] if dense else None), (sparse[0] if sparse else None), len(sparse)


def time_kernel(case: StepCase, kernel: str, preset: str | None, layers: int | None,
                repeats: int, clock: Clock, log: Callable[[str], None],
                architecture: Mapping[str, Any] | None = None,
                profile_dir: str | None = None) -> dict[str, Any]:
  """One program's step times: a dense kernel's step, or svg's dense and sparse steps."""
  overrides = {**ONE_CHIP, "height": case.height, "width": case.width,
               "num_frames": case.frames}
  if kernel in DENSE_BLOCKS:
    overrides["flash_block_sizes"] = DENSE_BLOCKS[kernel]
  if preset is not None:
    overrides["svg_schedule"] = preset
  start = time.perf_counter()
  config, mesh, model = build_model(case.config, kernel, overrides, layers, architecture)
  arch = dict(architecture or architecture_for(config))
  latents, text = step_inputs(case, arch["text_dim"])
  row: dict[str, Any] = {"case": case.name, "kernel": kernel, "preset": preset,
                         "layers": layers or arch["num_layers"],
                         "steps": int(config.num_inference_steps),
                         "build_s": round(time.perf_counter() - start, 2)}
  points: list[tuple[str, float]] = [("step", 999.0)]
  if kernel == "svg":  # the schedule first: the split model carries it as a static field
    timesteps, dense, sparse, sparse_steps = schedule_steps(model, row["steps"])
    row["sparse_steps"] = sparse_steps
    row["svg"] = model.svg_settings.summary(model.svg_settings.svg.target(mesh=mesh))
    # The run summary's callbacks are in the timed step unless this process leaves them out.
    row["run_summary"] = model.svg_uncounted or "counted: a host callback a layer"
    points = [(name, timesteps[i]) for name, i in (("sparse_step", sparse), ("dense_step", dense))
              if i is not None]
  step, hlo = forward_call(config, mesh, model, latents, text)
  for name, t in points:
    first, best = clock(lambda t=t: step(t), repeats)
    row[f"{name}_s"], row[f"{name}_first_s"] = best, first
    log(f"  {case.name} {kernel}{'/' + preset if preset else ''} {row['layers']} layers "
        f"{name}: {best * 1e3:.1f} ms (first call {first:.1f} s)")
  if profile_dir is not None and "sparse_step_s" in row:
    row["profile"] = profile_step(lambda: step(points[0][1]), profile_dir,
                                  lambda: hlo(points[0][1]))
  del step, hlo, model
  gc.collect()
  return row


# ------------------------------------------------------------------------------- profiling


# Our named scopes (call/attention.py) and MaxDiffusion's attention modules, by the part of a
# step they are reported as.
KERNEL, PREPASS = "self-attention kernel (ours)", "ours: the kernel's XLA prepass"
# First marker found in an op's scope names its part: the dense branch and each of our parts
# before the sparse kernel's scope, whose Pallas call is the kernel and the rest its prepass.
PARTS = (("debug_callback", "ours: the run summary's host callbacks"),
         ("svg_route", "ours: routing"), ("svg_place", "ours: placement"),
         ("svg_restore", "ours: restore"), ("svg_rows", "ours: dense rows"),
         ("svg_dense", "self-attention kernel (ours, dense)"),
         ("svg_pallas_sparse", KERNEL), ("svg_kernel", PREPASS))
OTHER = "projections, MLP, norms and the rest"
# Profiles stored before the prepass had its own part: the kernel with its prepass.
_KERNEL_AND_PREPASS = "self-attention kernel (ours, with its XLA prepass)"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?op_name=\"([^\"]*)\"")


def op_scopes(hlo_text: str) -> dict[str, str]:
  """Instruction name -> its op_name (named scopes) in a compiled program's text."""
  return {m.group(1): m.group(2) for m in map(_INSTRUCTION.match, hlo_text.splitlines()) if m}


def part_of(scope: str) -> str:
  for marker, part in PARTS:
    if marker in scope:
      return part
  return OTHER


def profile_step(fn: Callable[[], Any], directory: str,
                 hlo: Callable[[], str] | None = None) -> dict[str, Any]:
  """One traced call of ``fn``: its device ops' time by part of the step (:data:`PARTS`, from
  each op's named scope in the compiled program ``hlo`` returns) and the longest ops, read with
  ``jax.profiler.ProfileData``. Control flow (a loop, a conditional) is left out: its ops are
  counted themselves. The program's text is written beside the trace (``step.hlo.txt``)."""
  import glob  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel
  text = hlo() if hlo is not None else ""
  scopes = op_scopes(text)
  if text:  # the program beside its trace: what an op without a scope is, read in its operands
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "step.hlo.txt"), "w", encoding="utf-8") as f:
      f.write(text)
  jax.block_until_ready(fn())
  with jax.profiler.trace(directory):
    jax.block_until_ready(fn())
  files = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
  if not files:
    return {"error": f"no trace written under {directory}"}
  data = jax.profiler.ProfileData.from_file(files[-1])
  parts: dict[str, float] = {}
  ops: dict[str, list[Any]] = {}
  stat_names: set[str] = set()
  for plane in data.planes:
    if not plane.name.startswith("/device:TPU"):
      continue
    for line in plane.lines:
      if line.name != "XLA Ops":
        continue
      for event in line.events:
        name = event.name.split(" = ")[0].lstrip("%").split()[0] if event.name else ""
        if name.startswith(("while", "conditional", "call")):
          continue
        stats = dict(event.stats)
        stat_names.update(stats)
        scope = scopes.get(name, "")
        part = part_of(scope)
        seconds = event.duration_ns * 1e-9
        parts[part] = parts.get(part, 0.0) + seconds
        entry = ops.setdefault(name, [0.0, 0, part, scope[-160:]])
        entry[0] += seconds
        entry[1] += 1
  top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:60]
  return {"device_s": sum(parts.values()), "parts_s": parts, "ops": len(ops),
          "scoped_ops": sum(1 for n in ops if n in scopes), "stat_names": sorted(stat_names),
          "top_ops": [{"name": n, "seconds": e[0], "count": e[1], "part": e[2], "scope": e[3]}
                      for n, e in top]}


# ------------------------------------------------------------------------------ the bench


def scaled(rows: Sequence[Mapping[str, Any]], key: str, depth: int) -> float:
  """``key``'s time at ``depth`` layers from rows at two layer counts (linear in layers)."""
  (l1, t1), (l2, t2) = sorted((r["layers"], r[key]) for r in rows)[:2]
  per_layer = (t2 - t1) / (l2 - l1)
  return t1 + (depth - l1) * per_layer


def case_figures(case: StepCase, rows: Sequence[Mapping[str, Any]], depth: int
                 ) -> dict[str, Any]:
  """Steps (scaled to ``depth`` where timed at fewer layers) and runs per preset against the
  fastest dense kernel and each kernel."""
  def at_depth(kernel: str, preset: str | None, key: str) -> float | None:
    mine = [r for r in rows if r["kernel"] == kernel and r.get("preset") == preset and key in r]
    if not mine:
      return None
    full = [r for r in mine if r["layers"] == depth]
    return full[0][key] if full else scaled(mine, key, depth)

  dense = {k: at_depth(k, None, "step_s") for k in {r["kernel"] for r in rows if r["kernel"] != "svg"}}
  dense = {k: v for k, v in dense.items() if v is not None}
  fastest = min(dense, key=dense.get) if dense else None
  out: dict[str, Any] = {"depth": depth, "scaled": any(r["layers"] != depth for r in rows),
                         "dense_steps_s": dense, "fastest_dense": fastest, "presets": {}}
  for preset in {r.get("preset") for r in rows if r["kernel"] == "svg"}:
    sparse, own_dense = at_depth("svg", preset, "sparse_step_s"), at_depth("svg", preset,
                                                                           "dense_step_s")
    row = next(r for r in rows if r["kernel"] == "svg" and r.get("preset") == preset)
    steps, sparse_steps = row["steps"], row["sparse_steps"]
    figures: dict[str, Any] = {"sparse_step_s": sparse, "dense_step_s": own_dense,
                               "steps": steps, "sparse_steps": sparse_steps}
    if sparse is not None and own_dense is not None:
      run = sparse_steps * sparse + (steps - sparse_steps) * own_dense
      figures["run_s"] = run
      for kernel, base in dense.items():
        figures[f"vs_{kernel}"] = {"step_speedup": base / sparse,
                                   "dense_step_ratio": own_dense / base,
                                   "run_speedup": steps * base / run}
      if fastest is not None:
        figures["step_speedup"] = dense[fastest] / sparse
        figures["run_speedup"] = steps * dense[fastest] / run
    out["presets"][preset] = figures
  return out


def software() -> dict[str, str]:
  """The timing's software (:func:`~maxdiffusion_svg.tpu.tile_search.software`), with Python and
  what builds MaxDiffusion's model."""
  from maxdiffusion_svg.tpu.tile_search import software as kernel_software  # pylint: disable=import-outside-toplevel
  return {"python": platform.python_version(),
          **kernel_software(("flax", "transformers", "torch"))}


def run_step_chip(cfg: StepBenchConfig, clock: Clock = _clock,
                  log: Callable[[str], None] = print,
                  architecture: Mapping[str, Any] | None = None,
                  profile_dir: str | None = None,
                  on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
  """Every case's programs timed in this process: the dense kernels, then svg per preset."""
  import jax  # pylint: disable=import-outside-toplevel
  device = jax.devices()[0]
  result: dict[str, Any] = {"kind": "timed on a chip" if device.platform == "tpu" else
                            f"timed on {device.platform} (not a TPU: no speed figure)",
                            "device_kind": device.device_kind, "platform": device.platform,
                            "devices_on_host": jax.device_count(), "devices_timed": 1, "software": software(),
                            "config": dataclasses.asdict(cfg), "rows": [], "cases": {}}
  for name in cfg.cases:
    case = CASES[name]
    counts = case.layers or (None,)
    rows: list[dict[str, Any]] = []
    programs = [(k, None) for k in cfg.kernels] + [("svg", p) for p in cfg.presets]
    for kernel, preset in programs:
      for layers in counts:
        profile = (profile_dir if cfg.profile and kernel == "svg" and layers == counts[-1]
                   and preset == cfg.presets[0] else None)
        row = time_kernel(case, kernel, preset, layers, cfg.repeats, clock, log, architecture,
                          profile)
        rows.append(row)
        result["rows"].append(row)
        if on_row is not None:
          on_row(result)
    depth = (architecture or {}).get("num_layers") or (
        WAN_14B["num_layers"] if case.layers else rows[0]["layers"])
    result["cases"][name] = case_figures(case, rows, depth)
  return result


def step_parts(profile: Mapping[str, Any]) -> dict[str, float]:
  """A traced step's seconds by part, the sparse kernel apart from its prepass (a stored
  profile's combined part is split by its Pallas calls among the longest ops)."""
  parts = dict(profile["parts_s"])
  if _KERNEL_AND_PREPASS in parts:
    both = parts.pop(_KERNEL_AND_PREPASS)
    kernel = sum(op["seconds"] for op in profile["top_ops"]
                 if op["part"] == _KERNEL_AND_PREPASS and "svg_pallas_sparse" in op["name"])
    parts[KERNEL], parts[PREPASS] = kernel, both - kernel
  return parts


def format_parts(preset: str, profile: Mapping[str, Any]) -> list[str]:
  """Where a traced sparse step's device time went, and ours outside the kernel's share."""
  parts, device = step_parts(profile), profile["device_s"]
  lines = [f"  where svg {preset}'s sparse step goes (one traced step, device {device:.3f} s):"]
  for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
    lines.append(f"    {part:<52} {seconds:7.3f} s {seconds / device:6.1%}")
  ours = sum(seconds for part, seconds in parts.items() if part.startswith("ours:"))
  lines.append(f"    ours outside the kernel: {ours:.3f} s, {ours / device:.1%} of the step")
  return lines


def format_step_chip(result: Mapping[str, Any]) -> str:
  lines = [f"One denoising step of MaxDiffusion's Wan, {result['kind']} "
           f"({result['device_kind']}; jax {result['software'].get('jax')}):"]
  for name, case in result["cases"].items():
    scaled_note = f", scaled to {case['depth']} layers" if case["scaled"] else ""
    lines.append(f"{name}{scaled_note}:")
    for kernel, seconds in sorted(case["dense_steps_s"].items(), key=lambda kv: kv[1]):
      lines.append(f"  {kernel:<24} step {seconds * 1e3:9.1f} ms")
    for preset, f in sorted(case["presets"].items()):
      if f.get("sparse_step_s") is None:
        continue
      lines.append(f"  svg {preset:<20} sparse step {f['sparse_step_s'] * 1e3:9.1f} ms, dense "
                   f"step {f['dense_step_s'] * 1e3:.1f} ms, run {f['run_s']:.1f} s "
                   f"({f['sparse_steps']} of {f['steps']} steps sparse)")
      if "step_speedup" in f:
        lines.append(f"    vs {case['fastest_dense']}: step {f['step_speedup']:.2f}x, run "
                     f"{f['run_speedup']:.2f}x")
      summaries = {r.get("run_summary") for r in result.get("rows", ())
                   if r.get("case") == name and r.get("preset") == preset and r["kernel"] == "svg"}
      left_out = sorted(s for s in summaries if s and not s.startswith("counted"))
      if left_out:
        lines.append(f"    run summary's callbacks not in the step: {'; '.join(left_out)}")
    for row in result.get("rows", ()):
      if row.get("case") == name and "device_s" in (row.get("profile") or {}):
        lines += format_parts(row["preset"], row["profile"])
  return "\n".join(lines)
