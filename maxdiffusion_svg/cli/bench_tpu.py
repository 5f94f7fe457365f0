"""``python -m maxdiffusion_svg bench compile|wan-forward|wan-train|backward|vmem|schedule``: the
benchmarks that compile for TPUs with libtpu on this host (no TPU needed), beside
:mod:`maxdiffusion_svg.cli.bench` (the ones that run here)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Mapping

from maxdiffusion_svg.cli.args import (_add_json_arg, _density, _positive_int, _progress, _report,
                                       _tile)
from maxdiffusion_svg.plan.geometry import RESOLUTIONS
from maxdiffusion_svg.plan.target import GENERATIONS, TPU_BACKENDS, generation_named


def _bench_compile(args: argparse.Namespace) -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU
  from maxdiffusion_svg.bench.compile import (CompileBenchConfig, format_compile_bench,  # pylint: disable=import-outside-toplevel
                                              format_compile_summary, parse_list,
                                              run_compile_bench)
  from maxdiffusion_svg.tpu.aot import libtpu_available  # pylint: disable=import-outside-toplevel
  if not libtpu_available():
    raise ValueError("bench compile needs libtpu: pip install 'jax[tpu]' (or -e '.[test]')")
  cfg = CompileBenchConfig(chips=parse_list(args.chips), resolutions=parse_list(args.resolutions),
                           density=args.density, sharded=not args.no_sharded,
                           raised=not args.no_raised, calibrate=args.calibrate,
                           backends=parse_list(args.backends))
  result = run_compile_bench(cfg, log=_progress)
  text = format_compile_bench(result) + "\n\n" + format_compile_summary(result)
  if args.maxdiffusion:
    from maxdiffusion_svg.bench.wan_aot import compile_wan_forwards, format_wan_forwards  # pylint: disable=import-outside-toplevel
    result["maxdiffusion"] = compile_wan_forwards(log=_progress)
    text += "\n\n" + format_wan_forwards(result["maxdiffusion"])
  _report(args, text, result)
  return 0


def _cases(value: str, known: Mapping[str, Any]) -> tuple[str, ...]:
  """``--cases``' comma-separated names, each one of ``known``."""
  cases = tuple(c for c in value.split(",") if c)
  unknown = [c for c in cases if c not in known]
  if unknown:
    raise ValueError(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
  return cases


def _bench_chip(args: argparse.Namespace) -> int:
  from maxdiffusion_svg.bench.chip import (CASES, ChipBenchConfig, format_chip_bench,  # pylint: disable=import-outside-toplevel
                                           run_chip_bench)
  cfg = ChipBenchConfig(cases=_cases(args.cases, CASES), calls=args.calls,
                        budget_s=args.budget_s)
  result = run_chip_bench(cfg, out=args.json, log=_progress)
  print(format_chip_bench(result))
  return 0


def _bench_wan_forward(args: argparse.Namespace) -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU
  from maxdiffusion_svg.bench.wan_aot import compile_wan_forwards, format_wan_forwards  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plan.geometry import RESOLUTIONS  # pylint: disable=import-outside-toplevel
  if args.resolution not in RESOLUTIONS:
    raise ValueError(f"--resolution must be one of {', '.join(RESOLUTIONS)}, got "
                     f"{args.resolution!r}")
  frames, height, width = RESOLUTIONS[args.resolution]
  kernels = [k for k in args.kernels.split(",") if k]
  result = compile_wan_forwards(kernels=kernels, config_path=args.config, topology=args.topology,
                                frames=frames, height=height, width=width,
                                num_layers=args.layers, log=_progress, subfolder=args.subfolder)
  _report(args, format_wan_forwards(result), result)
  return 0


def _tile_choices(text: str) -> list[tuple[int, int, int]]:
  out = []
  for item in text.split(","):
    match = re.fullmatch(r"(\d+)x(\d+)/(\d+)", item.strip())
    if match is None:
      raise argparse.ArgumentTypeError(f"{item!r}: expected QxKV/STEP, e.g. 3328x1536/512")
    out.append(tuple(int(g) for g in match.groups()))
  return out


def _bench_step_on_chip(args: argparse.Namespace) -> int:
  from maxdiffusion_svg.bench.step_chip import (CASES, StepBenchConfig, format_step_chip,  # pylint: disable=import-outside-toplevel
                                                run_step_chip)
  cfg = StepBenchConfig(cases=_cases(args.cases, CASES), kernels=tuple(k for k in args.kernels.split(",") if k),
                        presets=tuple(p for p in args.presets.split(",") if p),
                        repeats=args.repeats, profile=bool(args.profile))

  def save(result: dict) -> None:  # after every program: a run cut short keeps what it timed
    if args.json:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=str)

  result = run_step_chip(cfg, log=_progress, profile_dir=args.profile, on_row=save)
  save(result)
  print(format_step_chip(result))
  return 0


def _bench_step(args: argparse.Namespace) -> int:
  if args.on_chip:
    return _bench_step_on_chip(args)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU
  from maxdiffusion_svg.bench.step import format_step, run_step_bench  # pylint: disable=import-outside-toplevel
  import yaml  # pylint: disable=import-outside-toplevel
  overrides = {}
  for item in args.set or []:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set height=1440")
    overrides[key] = yaml.safe_load(value)
  if args.tiles:
    from maxdiffusion_svg.bench.step import format_tile_choices, run_tile_choices  # pylint: disable=import-outside-toplevel
    result = run_tile_choices(args.config, args.slice, args.tiles, layers=args.layers,
                              log=_progress)
    _report(args, format_tile_choices(result), result)
    return 0
  result = run_step_bench(args.config, args.slice, layers=args.layers, subfolder=args.subfolder,
                          overrides=overrides, log=_progress)
  _report(args, format_step(result), result)
  return 0


def _bench_wan_train(args: argparse.Namespace) -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU
  import yaml  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench.wan_train_aot import compile_wan_train_steps, format_wan_train_steps  # pylint: disable=import-outside-toplevel
  kernels = [k for word in args.kernels for k in word.split(",") if k]
  overrides = {}
  for item in args.set or []:
    if "=" not in item:
      raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
    key, text = item.split("=", 1)
    overrides[key] = yaml.safe_load(text)
  result = compile_wan_train_steps(kernels=kernels, config_path=args.config,
                                   topology=args.topology, num_layers=args.layers, step=args.step,
                                   per_device_batch_size=args.per_device_batch_size,
                                   backward_step_mib=args.backward_step_mib, log=_progress,
                                   overrides=overrides, hlo_dir=args.hlo_dir)
  _report(args, format_wan_train_steps(result), result)
  return 0


def _bench_backward(args: argparse.Namespace) -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench.backward import (VMEM_OUT, format_backward_bench, run_backward_bench,
                                               run_backward_vmem)
  # pylint: enable=import-outside-toplevel
  if args.vmem:
    result = run_backward_vmem(log=_progress)
    out = args.json or str(VMEM_OUT)
    with open(out, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
    print(f"{len(result['rows'])} compiler figures (libtpu {result['libtpu']}) written to {out}")
    return 0
  result = run_backward_bench(args.chip, args.backends.split(","), args.resolution, args.density,
                              args.heads, log=_progress)
  _report(args, format_backward_bench(result), result)
  return 0


def _bench_vmem(args: argparse.Namespace) -> int:
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench.vmem_points import DEFAULT_OUT, run_vmem_points
  from maxdiffusion_svg.kernels.vmem_model import fit
  from maxdiffusion_svg.tpu.aot import libtpu_available, libtpu_version
  # pylint: enable=import-outside-toplevel
  if args.fit:
    with open(args.fit, encoding="utf-8") as f:
      print(json.dumps(fit(json.load(f)), indent=1))
    return 0
  if not libtpu_available():
    raise ValueError("bench vmem needs libtpu: pip install 'jax[tpu]' (or -e '.[test]')")
  chips = [generation_named(c, "--chips").name for c in args.chips.split(",")]
  out = args.json or str(DEFAULT_OUT)
  done = []
  if args.resume:
    with open(out, encoding="utf-8") as f:
      earlier = json.load(f)
    if earlier["libtpu"] != libtpu_version():
      raise ValueError(f"--resume: {out} was measured with libtpu {earlier['libtpu']}, this "
                       f"host has {libtpu_version()}: measure again without --resume")
    done = earlier["rows"]
  result = run_vmem_points(chips, workers=args.workers, log=_progress, done=done)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  print(f"{len(result['rows'])} compiler figures (libtpu {result['libtpu']}) written to {out}; "
        f"fit them: python -m maxdiffusion_svg bench vmem --fit {out}")
  return 0


def _bench_schedule(args: argparse.Namespace) -> int:
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench.schedule import default_tiles, run_schedule_bench, run_tile_sweep
  from maxdiffusion_svg.bench.schedule_format import format_schedule_bench, format_tile_sweep
  # pylint: enable=import-outside-toplevel
  if args.sweep:
    result = run_tile_sweep(args.chip, args.resolution, args.density, backend=args.backend,
                            log=_progress)
    _report(args, format_tile_sweep(result), result)
    return 0
  given = (args.block_q, args.block_kv, args.block_kv_compute)
  tiles = None
  if any(given):
    defaults = default_tiles(args.chip, args.vmem_limit_kib, args.backend)
    tiles = tuple(g or d for g, d in zip(given, defaults))
  if args.semantic:
    # pylint: disable=import-outside-toplevel
    from maxdiffusion_svg.bench.schedule_semantic import format_semantic_bench, run_semantic_bench
    # pylint: enable=import-outside-toplevel
    result = run_semantic_bench(args.chip, args.resolution, args.density, tiles,
                                args.vmem_limit_kib, groups=args.semantic_groups, log=_progress,
                                warm_iterations=args.semantic_warm)
    _report(args, format_semantic_bench(result), result)
    return 0
  if args.compensation:
    # pylint: disable=import-outside-toplevel
    from maxdiffusion_svg.bench.schedule_compensation import (format_compensation_bench,
                                                              run_compensation_bench)
    # pylint: enable=import-outside-toplevel
    result = run_compensation_bench(args.chip, args.resolution, args.density, tiles,
                                    args.vmem_limit_kib, args.backend, args.compensation_blocks,
                                    log=_progress)
    _report(args, format_compensation_bench(result), result)
    return 0
  result = run_schedule_bench(args.chip, args.resolution, args.density, tiles,
                              args.vmem_limit_kib, args.maxdiffusion, args.backend, log=_progress)
  _report(args, format_schedule_bench(result), result)
  failed = failed_cases(result["modes"])
  for line in failed:
    print(f"error: {line}", file=sys.stderr)
  return 1 if failed else 0


def failed_cases(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """One line per case that did not compile: a missing module named with how to get it (the
  MaxDiffusion cases need its runtime), else the compile's own error."""
  lines = []
  for name, row in rows.items():
    if row.get("ok"):
      continue
    error = str(row.get("error", "")) or "no error message"
    missing = re.search(r"No module named '([^']+)'", error)
    if missing:
      lines.append(f"{name}: the compile needs the module {missing.group(1)}, which is missing: "
                   f"install MaxDiffusion's runtime (pip install -r requirements-maxdiffusion.txt) "
                   f"and put its source on PYTHONPATH (PYTHONPATH=/path/to/maxdiffusion/src)")
    else:
      lines.append(f"{name}: {error}")
  return lines


def add_subparsers(bench_sub: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  """The compile benchmarks' parsers, under ``bench``."""
  compile_ = bench_sub.add_parser(
      "compile", help="compile for TPU generations with libtpu on this host: what fits, "
                      "per-device memory, compile time (no TPU needed)")
  compile_.add_argument("--chips", default=",".join(GENERATIONS),
                        help=f"comma-separated TPU generations ({', '.join(GENERATIONS)})")
  compile_.add_argument("--resolutions", default="720p,1080p,1440p",
                        help="comma-separated resolutions (480p, 720p, 1080p, 1440p)")
  compile_.add_argument("--density", type=_density, default=0.3, help="band density in (0, 1]")
  compile_.add_argument("--backends", default="pallas,splash",
                        help="comma-separated TPU kernels: pallas (ours, the default), splash")
  compile_.add_argument("--no-sharded", action="store_true", help="skip the v6e 2x4 sharded rows")
  compile_.add_argument("--no-raised", action="store_true", help="skip the 64 MiB VMEM rows")
  compile_.add_argument("--calibrate", action="store_true",
                        help="also ask the compiler for each kernel's scoped VMEM (3-4 compiles each)")
  compile_.add_argument("--maxdiffusion", action="store_true",
                        help="also compile MaxDiffusion's Wan 2.1 14B forward for a v6e-8 with "
                             "svg, flash and ulysses (needs MaxDiffusion on PYTHONPATH)")
  _add_json_arg(compile_)
  compile_.set_defaults(run=_bench_compile)

  chip = bench_sub.add_parser(
      "chip", help="every kernel timed on the TPU this runs on, in one process: ours (densities, "
                   "modes, online heads, compensated), MaxDiffusion's fixed-m, online and flash "
                   "(its config blocks and a search), at the shipped configs' per-chip shapes")
  chip.add_argument("--cases", default="wan14b_720p,wan1.3b_480p,ltx2_1280x704,wan14b_1440p_ring",
                    help="comma-separated per-chip shapes (bench/chip.py CASES)")
  chip.add_argument("--calls", type=_positive_int, default=5, help="timed calls per kernel")
  chip.add_argument("--budget-s", type=float, default=480.0,
                    help="seconds after which further rows are left out (and listed)")
  chip.add_argument("--json", metavar="FILE",
                    help="write the rows as JSON to FILE, after each row (a cut run keeps them)")
  chip.set_defaults(run=_bench_chip)

  wan = bench_sub.add_parser(
      "wan-forward", help="compile MaxDiffusion's Wan 2.1 14B forward for a TPU slice with libtpu "
                          "(no weights, no TPU): per-device memory per attention kernel (needs "
                          "MaxDiffusion on PYTHONPATH)")
  wan.add_argument("--config", default="configs/wan_svg.yml",
                   help="the run's config (its base_config chain and mesh keys)")
  wan.add_argument("--topology", default="v6e:2x4",
                   help="the slice, e.g. v6e:2x4 (v6e-8), v6e:4x8 (v6e-32), v6e:8x8 (v6e-64)")
  wan.add_argument("--resolution", default="720p", help="480p, 720p, 1080p or 1440p (81 frames)")
  wan.add_argument("--kernels", default="svg,ulysses_custom_fixed_m",
                   help="comma-separated attention kernels (svg, or MaxDiffusion's: flash, "
                        "ulysses, ulysses_custom_fixed_m, ulysses_ring_custom, ...)")
  wan.add_argument("--layers", type=int, default=None,
                   help="transformer layers (default: the model's 40; one scanned body either way)")
  wan.add_argument("--subfolder", default="transformer", choices=["transformer", "transformer_2"],
                   help="with a Wan 2.2 config, the expert: transformer (high noise) or "
                        "transformer_2 (low noise)")
  _add_json_arg(wan)
  wan.set_defaults(run=_bench_wan_forward)

  step = bench_sub.add_parser(
      "step", help="one denoising step of the configured Wan or LTX-2 model compiled by libtpu "
                   "for a slice (no weights, no TPU), priced from the compiled program by class: "
                   "svg against the dense baseline (Wan: ulysses_custom_fixed_m, its ring "
                   "variant on a ring; LTX-2: flash), the step's and the run's bound (needs "
                   "MaxDiffusion on PYTHONPATH)")
  step.add_argument("--config", default="configs/wan_svg.yml", help="the run's config")
  step.add_argument("--slice", default="v6e-8", help="the TPU slice, e.g. v6e-8, v6e-32")
  step.add_argument("--layers", type=_positive_int, default=2,
                    help="scanned layers compiled (the step prices one layer times the model's "
                         "depth; default 2)")
  step.add_argument("--subfolder", default="transformer", choices=["transformer", "transformer_2"],
                    help="with a Wan 2.2 config, the expert: transformer (high noise) or "
                         "transformer_2 (low noise)")
  step.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="a config key (YAML value), e.g. --set height=1440 --set width=2560")
  step.add_argument("--tiles", type=_tile_choices, metavar="QxKV/STEP,...",
                    help="instead: each tile choice's whole step (its kernel's bodies and its "
                         "svg forward compiled), against the stored baseline step, e.g. "
                         "3328x1536/512,2048x1024/512")
  step.add_argument("--on-chip", action="store_true",
                    help="instead: time the step on this host's TPU (random weights at the real "
                         "shapes): svg's sparse and dense steps against the dense kernels, "
                         "every program in this process (bench/step_chip.py)")
  step.add_argument("--cases", default="wan1.3b_720p",
                    help="with --on-chip: comma-separated cases (bench/step_chip.py CASES; "
                         "wan14b_720p is timed at 1 and 2 of its 40 layers and scaled)")
  step.add_argument("--kernels", default="ulysses_custom_fixed_m,flash",
                    help="with --on-chip: the dense kernels timed beside svg")
  step.add_argument("--presets", default="moderate,aggressive",
                    help="with --on-chip: svg_schedule presets timed")
  step.add_argument("--repeats", type=_positive_int, default=2,
                    help="with --on-chip: timed calls after the first (best kept)")
  step.add_argument("--profile", metavar="DIR",
                    help="with --on-chip: trace svg's sparse step into DIR and report its device "
                         "time by part")
  _add_json_arg(step)
  step.set_defaults(run=_bench_step)

  train = bench_sub.add_parser(
      "wan-train", help="compile MaxDiffusion's Wan 2.1 14B training step (loss, gradients, "
                        "AdamW) for a TPU slice with libtpu (no weights, no TPU): per-device "
                        "memory per attention kernel (needs MaxDiffusion on PYTHONPATH)")
  train.add_argument("--config", default="configs/wan_svg_train.yml",
                     help="the run's config (its base_config chain, mesh and batch keys)")
  train.add_argument("--topology", default="v6e:2x4", help="the slice, e.g. v6e:2x4 (v6e-8)")
  train.add_argument("--kernels", nargs="+", default=["svg", "flash"],
                     help="attention kernels (svg, or MaxDiffusion's: flash, ...)")
  train.add_argument("--layers", type=int, default=2,
                     help="transformer layers (40: the model's; one scanned body either way)")
  train.add_argument("--step", choices=["trainer", "grads"], default="trainer",
                     help="trainer: MaxDiffusion's train_step (loss, gradients, AdamW update); "
                          "grads: the loss and its gradients only")
  train.add_argument("--per-device-batch-size", type=float, default=None,
                     help="instead of the config's (the batch must divide data x fsdp)")
  train.add_argument("--backward-step-mib", type=float, default=None,
                     help="svg's XLA backward: float32 logits per scan step, MiB (default 32)")
  train.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="a config key for every kernel (YAML value), e.g. ici_fsdp_parallelism=2")
  train.add_argument("--hlo-dir", metavar="DIR", help="keep each compiled HLO text in DIR")
  _add_json_arg(train)
  train.set_defaults(run=_bench_wan_train)

  backward = bench_sub.add_parser(
      "backward", help="compile one call's gradient for a TPU with libtpu: tokamax's backward "
                       "kernel against the XLA scan behind each forward kernel (temporaries, "
                       "static bundles)")
  backward.add_argument("--chip", choices=list(GENERATIONS), default="v6e")
  backward.add_argument("--backends", default="pallas",
                        help="forward kernels, comma-separated: pallas, splash")
  backward.add_argument("--resolution", choices=list(RESOLUTIONS), default="720p")
  backward.add_argument("--density", type=_density, default=0.3, help="band density in (0, 1]")
  backward.add_argument("--heads", type=_positive_int, default=5, help="heads per call")
  backward.add_argument("--vmem", action="store_true",
                        help="instead: the scoped VMEM libtpu allocates for tokamax's backward "
                             "kernel per chip, beside our bound (docs/measurements/backward_vmem.json)")
  _add_json_arg(backward)
  backward.set_defaults(run=_bench_backward)

  vmem = bench_sub.add_parser(
      "vmem", help="the scoped VMEM libtpu allocates per Splash kernel and generation: the "
                   "points the VMEM model is fitted to (no TPU needed)")
  vmem.add_argument("--chips", default=",".join(GENERATIONS),
                    help=f"comma-separated TPU generations ({', '.join(GENERATIONS)})")
  vmem.add_argument("--workers", type=int, default=2, help="compiles at a time")
  vmem.add_argument("--json", metavar="FILE",
                    help="where to write the points (default: docs/measurements/"
                         "vmem_points.json)")
  vmem.add_argument("--resume", action="store_true",
                    help="keep the cases already in the output file (same libtpu); compile the rest")
  vmem.add_argument("--fit", metavar="FILE",
                    help="instead: fit the model to FILE's points and print it")
  vmem.set_defaults(run=_bench_vmem)

  schedule = bench_sub.add_parser(
      "schedule", help="libtpu's static schedule of the Splash kernel per mode and dense: "
                       "bundles per tile body, static bundles per call (no TPU needed)")
  schedule.add_argument("--chip", choices=list(GENERATIONS), default="v6e",
                        help="TPU generation to compile for")
  schedule.add_argument("--resolution", choices=list(RESOLUTIONS), default="720p",
                        help="Wan preset video, 81 frames")
  schedule.add_argument("--density", type=_density, default=0.35, help="band density in (0, 1]")
  schedule.add_argument("--block-q", type=_tile, help="query tile (default: the chip's)")
  schedule.add_argument("--block-kv", type=_tile, help="key tile (default: the chip's)")
  schedule.add_argument("--block-kv-compute", type=_tile,
                        help="Splash's inner kv step (default: the chip's)")
  schedule.add_argument("--vmem-limit-kib", type=int,
                        help="scoped-VMEM limit to compile under (default: the chip's)")
  schedule.add_argument("--sweep", action="store_true",
                        help="instead: the aligned call per tile choice (what decides the "
                             "defaults): ours with its dense branch; Splash at the chip's default "
                             "and a 64 MiB scoped-VMEM limit")
  schedule.add_argument("--backend", choices=list(TPU_BACKENDS), default=TPU_BACKENDS[0],
                        help="our TPU kernel to price (pallas: ours, the default; splash: tokamax's)")
  schedule.add_argument("--maxdiffusion", action="store_true",
                        help="also MaxDiffusion's own flash attention at its v6e Wan block sizes "
                             "(needs MaxDiffusion on PYTHONPATH)")
  schedule.add_argument("--semantic", action="store_true",
                        help="one semantic head's call (svg_layouts semantic: clustering, order, "
                             "table, kernel, restore) beside the band call and dense")
  schedule.add_argument("--semantic-warm", type=_positive_int, nargs="*", default=[],
                        metavar="N", help="with --semantic, also price the call at these k-means "
                                          "iterations (a warm-started step's) and what each saves")
  schedule.add_argument("--semantic-groups", type=_positive_int, nargs="*", default=[],
                        metavar="N", help="with --semantic, also price these token groups")
  schedule.add_argument("--compensation", action="store_true",
                        help="instead: each mode's compensated call (kernel with its log-sum-exp, "
                             "centroid pass, merge) against its plain one")
  schedule.add_argument("--compensation-blocks", type=_positive_int, default=8,
                        help="centroids per key tile with --compensation (svg_compensation_blocks)")
  _add_json_arg(schedule)
  schedule.set_defaults(run=_bench_schedule)
