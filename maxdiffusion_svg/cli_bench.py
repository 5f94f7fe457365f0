"""``python -m maxdiffusion_svg bench ...``: the benchmarks' command lines."""

from __future__ import annotations

import argparse
import json
import os
import sys

from maxdiffusion_svg.cli_args import (_MODES, _add_grid_args, _add_json_arg, _density,
                                       _grid_from_args, _report, _tile)
from maxdiffusion_svg.geometry import RESOLUTIONS
from maxdiffusion_svg.target import BACKENDS, GENERATIONS, TPU_BACKENDS, generation_named
from maxdiffusion_svg.tiling import PALLAS_TILES, tiles_help


def _add_call_args(parser: argparse.ArgumentParser, heads: int, heads_help: str,
                   modes: list[str], mode: str) -> None:
  """The attention call a kernel benchmark times: shapes, density, mode, executor, tiles."""
  parser.add_argument("--batch", type=int, default=1, help="examples per call")
  parser.add_argument("--heads", type=int, default=heads, help=heads_help)
  parser.add_argument("--head-dim", type=int, default=128, help="head dimension")
  parser.add_argument("--density", type=_density, default=0.35, help="band density in (0, 1]")
  parser.add_argument("--mode", choices=modes, default=mode, help="traversal mode")
  parser.add_argument("--backend", choices=list(BACKENDS), default="auto",
                      help="executor (auto: pallas on TPU, xla elsewhere)")
  parser.add_argument("--block-q", type=_tile, help=f"query tile (default: {tiles_help()})")
  parser.add_argument("--block-kv", type=_tile, help="key tile (default: the executor's)")
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                      help="q, k, v dtype")


def _add_devices_arg(parser: argparse.ArgumentParser, help_text: str = "simulated on CPU") -> None:
  parser.add_argument("--devices", type=int, default=8, help=help_text)


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
  return value


def _progress(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _bench_kernel(args: argparse.Namespace) -> int:
  from maxdiffusion_svg.bench.kernel import (KernelBenchConfig, format_kernel_bench,  # pylint: disable=import-outside-toplevel
                                             run_kernel_bench)
  cfg = KernelBenchConfig(grid=_grid_from_args(args, default="480p"), batch=args.batch,
                          heads=args.heads, head_dim=args.head_dim, density=args.density,
                          modes=tuple(_MODES if args.mode == "all" else [args.mode]),
                          backend=args.backend, block_q=args.block_q, block_kv=args.block_kv,
                          dtype=args.dtype, repeats=args.repeats)
  result = run_kernel_bench(cfg, log=_progress)
  _report(args, format_kernel_bench(result), result)
  return 0


def _bench_backends(args: argparse.Namespace) -> int:
  from maxdiffusion_svg.bench.quality import compare_backends, format_backend_comparison  # pylint: disable=import-outside-toplevel
  result = compare_backends(backends=tuple(args.backends.split(",")), dtype=args.dtype,
                            log=_progress)
  _report(args, format_backend_comparison(result), result)
  return 0


def _bench_quality(args: argparse.Namespace) -> int:
  from maxdiffusion_svg.bench.quality import (QualityBenchConfig, format_quality_bench,  # pylint: disable=import-outside-toplevel
                                              run_quality_bench)
  cfg = QualityBenchConfig(router_seeds=args.seeds,
                           timing_resolution=None if args.no_large_timing else "720p")
  result = run_quality_bench(cfg, log=_progress)
  _report(args, format_quality_bench(result), result)
  if args.plot:
    from maxdiffusion_svg.plot import plot_quality  # pylint: disable=import-outside-toplevel
    plot_quality(args.plot, cfg, result)
    print(f"plot written to {args.plot}")
  if args.semantic_plot and "semantic" in result:
    from maxdiffusion_svg.bench.semantic_quality import plot_semantic  # pylint: disable=import-outside-toplevel
    plot_semantic(args.semantic_plot, result["semantic"])
    print(f"semantic plot written to {args.semantic_plot}")
  return 0


def simulate_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` host devices. Only takes effect before JAX starts its backend,
  which the CLI has not done when a subcommand begins."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={count}"])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu, if installed, is for compiling only


def _int_list(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _bench_ring(args: argparse.Namespace) -> int:
  """``bench sharded --ulysses-shards``: svg 2D on a Ulysses x ring split (compile only)."""
  devices = args.devices
  if args.topology:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU
    from maxdiffusion_svg.tpu_aot import libtpu_available, topology_devices  # pylint: disable=import-outside-toplevel
    if not libtpu_available():
      raise ValueError("--topology needs libtpu: pip install 'jax[tpu]' (or -e '.[test]')")
    devices = len(topology_devices(args.topology))
  else:
    simulate_cpu_devices(devices)
  from maxdiffusion_svg.bench.ring import RingBenchConfig, format_ring_bench, run_ring_bench  # pylint: disable=import-outside-toplevel
  cfg = RingBenchConfig(grid=_grid_from_args(args, default="480p"), ulysses=args.ulysses_shards,
                        devices=devices, data=args.data, topology=args.topology,
                        batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                        density=args.density, mode=args.mode, backend=args.backend,
                        block_q=args.block_q, block_kv=args.block_kv, dtype=args.dtype,
                        against=tuple(a for a in (args.against or "").split(",") if a))
  result = run_ring_bench(cfg, log=_progress)
  _report(args, format_ring_bench(result), result)
  return 0


def _bench_sharded(args: argparse.Namespace) -> int:
  if args.ulysses_shards:
    return _bench_ring(args)
  for flag, given in (("--data", args.data != 1), ("--topology", args.topology),
                      ("--against", args.against)):
    if given:
      raise ValueError(f"{flag} is for the Ulysses x ring comparison: give --ulysses-shards")
  simulate_cpu_devices(args.devices)
  from maxdiffusion_svg.bench.sharded import (ShardedBenchConfig, format_sharded_bench,  # pylint: disable=import-outside-toplevel
                                              run_sharded_bench)
  cfg = ShardedBenchConfig(grid=_grid_from_args(args, default="480p"), devices=args.devices,
                           batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                           density=args.density, mode=args.mode, backend=args.backend,
                           block_q=args.block_q, block_kv=args.block_kv, dtype=args.dtype,
                           timing=not args.no_timing, repeats=args.repeats)
  result = run_sharded_bench(cfg, log=_progress)
  _report(args, format_sharded_bench(result), result)
  return 0


def _bench_collectives(args: argparse.Namespace) -> int:
  simulate_cpu_devices(args.devices)
  from maxdiffusion_svg.bench.wan_collectives import format_collectives, measure  # pylint: disable=import-outside-toplevel
  latent = tuple(int(n) for n in args.latent.lower().split("x"))
  if len(latent) != 4:
    raise ValueError(f"--latent must be CxFxHxW, got {args.latent!r}")
  result = measure(args.kernels, args.devices, latent, args.text_len, log=_progress)
  _report(args, format_collectives(result), result)
  return 0


def _bench_semantic_warm(args: argparse.Namespace) -> int:
  simulate_cpu_devices(args.devices)
  from maxdiffusion_svg.bench.semantic_warm import format_warm_bench, run_warm_bench  # pylint: disable=import-outside-toplevel
  result = run_warm_bench(args.steps, args.clusters, tuple(args.updates), log=_progress)
  _report(args, format_warm_bench(result), result)
  return 0


def _bench_semantic_720p(args: argparse.Namespace) -> int:
  from maxdiffusion_svg.bench.semantic_720p import (Semantic720pConfig, format_semantic_720p,  # pylint: disable=import-outside-toplevel
                                                    run_semantic_720p)
  cfg = Semantic720pConfig(densities=tuple(args.densities), groups=tuple(args.groups),
                           heads=args.heads, routers=args.routers,
                           compensation=args.compensation, clusters=args.clusters,
                           block_q=args.block_q, block_kv=args.block_kv)
  result = run_semantic_720p(cfg, log=_progress)
  _report(args, format_semantic_720p(result), result)
  return 0


def _bench_reference_frames(args: argparse.Namespace) -> int:
  from maxdiffusion_svg.bench.reference_frames import (ReferenceBenchConfig,  # pylint: disable=import-outside-toplevel
                                                       format_reference_bench, run_reference_bench)
  cfg = ReferenceBenchConfig(densities=tuple(args.densities), seeds=tuple(args.seeds))
  result = run_reference_bench(cfg, log=_progress)
  _report(args, format_reference_bench(result), result)
  return 0


def _bench_calibrate(args: argparse.Namespace) -> int:
  from maxdiffusion_svg.bench.calibration import (CalibrationBenchConfig,  # pylint: disable=import-outside-toplevel
                                                  format_calibration_bench, run_calibration_bench)
  cfg = CalibrationBenchConfig(density=args.density, held_out_seeds=tuple(args.held_out),
                               compensation=args.compensation)
  result = run_calibration_bench(cfg, log=_progress)
  _report(args, format_calibration_bench(result), result)
  return 0


def _bench_router(args: argparse.Namespace) -> int:
  from maxdiffusion_svg.bench.router_families import (RouterFamiliesConfig,  # pylint: disable=import-outside-toplevel
                                                      format_router_families, run_router_families)
  cfg = RouterFamiliesConfig(densities=tuple(args.densities), compensation=args.compensation,
                             seed=args.seed)
  result = run_router_families(cfg, log=_progress)
  _report(args, format_router_families(result), result)
  return 0


def _bench_e2e(args: argparse.Namespace) -> int:
  simulate_cpu_devices(args.devices)
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  from maxdiffusion_svg.bench.wan_e2e import format_e2e_bench, run_e2e_bench  # pylint: disable=import-outside-toplevel
  result = run_e2e_bench(args.steps, args.presets, log=_progress)
  _report(args, format_e2e_bench(result), result)
  return 0


def _bench_compile(args: argparse.Namespace) -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU
  from maxdiffusion_svg.bench.compile import (CompileBenchConfig, format_compile_bench,  # pylint: disable=import-outside-toplevel
                                              format_compile_summary, parse_list,
                                              run_compile_bench)
  from maxdiffusion_svg.tpu_aot import libtpu_available  # pylint: disable=import-outside-toplevel
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


def _bench_wan_forward(args: argparse.Namespace) -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU
  from maxdiffusion_svg.geometry import RESOLUTIONS  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench.wan_aot import compile_wan_forwards, format_wan_forwards  # pylint: disable=import-outside-toplevel
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
  from maxdiffusion_svg.bench.vmem_calibration import DEFAULT_OUT, run_vmem_calibration
  from maxdiffusion_svg.kernels.vmem_model import fit
  from maxdiffusion_svg.tpu_aot import libtpu_available, libtpu_version
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
  result = run_vmem_calibration(chips, workers=args.workers, log=_progress, done=done)
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
  return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # pylint: disable=protected-access
  bench = sub.add_parser("bench", help="benchmarks; without a subcommand: the quality benchmark")
  _add_json_arg(bench)
  bench.add_argument("--plot", metavar="FILE.png", help="attention maps, masks, per-head routing")
  bench.add_argument("--seeds", type=int, default=5, help="router keys to average over")
  bench.add_argument("--semantic-plot", metavar="FILE.png",
                     help="PSNR against visited tiles per layout (docs/images/semantic_quality.png)")
  bench.add_argument("--no-large-timing", action="store_true",
                     help="skip timing the router against the kernel at 720p")
  bench.set_defaults(run=_bench_quality)
  bench_sub = bench.add_subparsers(dest="bench_command")
  kernel = bench_sub.add_parser("kernel", help="dense vs sparse_attention per mode (timing)")
  _add_grid_args(kernel, default="480p")
  _add_call_args(kernel, heads=1, heads_help="attention heads", modes=_MODES + ["all"],
                 mode="all")
  kernel.add_argument("--repeats", type=int, default=3, help="timed runs after the first")
  _add_json_arg(kernel)
  kernel.set_defaults(run=_bench_kernel)

  backends = bench_sub.add_parser(
      "backends", help="the quality benchmark's planted heads on each TPU kernel (interpreted "
                       "here): PSNR against dense, and how far the kernels' outputs differ")
  backends.add_argument("--backends", default="splash,pallas",
                        help="comma-separated: splash, pallas, xla (the first is the reference)")
  backends.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="q, k, v dtype")
  _add_json_arg(backends)
  backends.set_defaults(run=_bench_backends)

  sharded = bench_sub.add_parser(
      "sharded", help="permutation after vs before the Ulysses exchange: collectives and time")
  _add_grid_args(sharded, default="480p")
  _add_devices_arg(sharded, "devices on the context axis (simulated on CPU)")
  _add_call_args(sharded, heads=8, heads_help="a multiple of --devices", modes=_MODES,
                 mode="aligned")
  sharded.add_argument("--no-timing", action="store_true",
                       help="compile and count collectives only (abstract inputs: any size)")
  sharded.add_argument("--repeats", type=int, default=2, help="timed runs after the first")
  sharded.add_argument("--ulysses-shards", type=_int_list, metavar="U[,U...]",
                       help="instead: svg with the context axis split as Ulysses U x ring "
                            "context/U, compiled only (one program per U): collectives by role "
                            "from the HLO, the ring plan's fetches, one device's static schedule")
  sharded.add_argument("--data", type=int, default=1,
                       help="with --ulysses-shards: devices on the data axis (batch); the "
                            "rest form the context axis")
  sharded.add_argument("--topology", metavar="NAME",
                       help="with --ulysses-shards: compile for this TPU topology with libtpu "
                            "(e.g. v6e:4x8 for 32 chips) instead of simulated CPU devices")
  sharded.add_argument("--against", metavar="KERNEL[,KERNEL]",
                       help="with --ulysses-shards and --topology: also compile MaxDiffusion's "
                            "ulysses_ring and/or ulysses_ring_custom on the same mesh (needs "
                            "MaxDiffusion on PYTHONPATH)")
  _add_json_arg(sharded)
  sharded.set_defaults(run=_bench_sharded)

  collectives = bench_sub.add_parser(
      "collectives", help="bytes each attention kernel moves in a tiny Wan forward (needs "
                          "MaxDiffusion on PYTHONPATH)")
  _add_devices_arg(collectives)
  collectives.add_argument("--kernels", nargs="+", default=["svg", "ulysses", "dot_product"],
                           help="MaxDiffusion attention kernels to compare")
  collectives.add_argument("--latent", default="4x21x30x52", help="latent CxFxHxW")
  collectives.add_argument("--text-len", type=int, default=128, help="a multiple of 128")
  _add_json_arg(collectives)
  collectives.set_defaults(run=_bench_collectives)

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
                   "VMEM model's calibration points (no TPU needed)")
  vmem.add_argument("--chips", default=",".join(GENERATIONS),
                    help=f"comma-separated TPU generations ({', '.join(GENERATIONS)})")
  vmem.add_argument("--workers", type=int, default=2, help="compiles at a time")
  vmem.add_argument("--json", metavar="FILE",
                    help="where to write the points (default: docs/measurements/"
                         "vmem_calibration.json)")
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

  s720 = bench_sub.add_parser(
      "semantic-720p", help="the semantic layout's quality at 720p on moving-content heads: each "
                            "layout forced (semantic at each token group) against dense, measured "
                            "on CPU (minutes)")
  s720.add_argument("--densities", type=_density, nargs="+", default=[0.15],
                    help="band densities in (0, 1]")
  s720.add_argument("--groups", type=_positive_int, nargs="+", default=[1, 8, 16],
                    help="tokens a semantic placement moves together (8: the 720p default)")
  s720.add_argument("--heads", type=_positive_int, default=2,
                    help="moving-content heads per strength (sharp, soft)")
  s720.add_argument("--routers", action="store_true",
                    help="also today's router and the three-layout router")
  s720.add_argument("--compensation", action="store_true",
                    help="also each SVG1 layout, the default group and the routers compensated "
                         "(8 centroids per key tile)")
  s720.add_argument("--clusters", type=_positive_int, default=32, help="k-means clusters per head")
  s720.add_argument("--block-q", type=_positive_int, default=PALLAS_TILES.block_q,
                    help="query tile (our kernel's TPU tile by default)")
  s720.add_argument("--block-kv", type=_positive_int, default=PALLAS_TILES.block_kv, help="key tile")
  _add_json_arg(s720)
  s720.set_defaults(run=_bench_semantic_720p)

  routed = bench_sub.add_parser(
      "router", help="the three-layout router against the best single layout per head on "
                     "held-out head families (6,144 tokens), measured on CPU (minutes)")
  routed.add_argument("--densities", type=_density, nargs="+", default=[0.1, 0.2, 0.35],
                      help="band densities in (0, 1]")
  routed.add_argument("--compensation", action="store_true", help="every call compensated")
  routed.add_argument("--seed", type=int, default=3, help="the families' seed")
  _add_json_arg(routed)
  routed.set_defaults(run=_bench_router)

  calib = bench_sub.add_parser(
      "calibrate", help="per-layer densities and compensation calibrated on one draw of "
                        "planted layers vs one density for all, at equal cost, PSNR on "
                        "held-out draws (4,096 tokens), measured on CPU (minutes)")
  calib.add_argument("--density", type=_density, default=0.2,
                     help="the uniform density: the budget in visited tiles")
  calib.add_argument("--held-out", type=int, nargs="+", default=[1, 2, 3], metavar="SEED",
                     help="seeds of the held-out draws")
  calib.add_argument("--compensation", choices=("both", "off", "on", "config"), default="both",
                     help="compensation a layer may take (as calibrate's; default both)")
  _add_json_arg(calib)
  calib.set_defaults(run=_bench_calibrate)

  ref = bench_sub.add_parser(
      "reference-frames", help="a reference frame as a sink or dense (svg_dense_frames) at "
                               "equal cost, through a residual stack of planted layers, "
                               "measured on CPU (minutes)")
  ref.add_argument("--densities", type=_density, nargs="+", default=[0.15, 0.25, 0.35])
  ref.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  _add_json_arg(ref)
  ref.set_defaults(run=_bench_reference_frames)

  e2e = bench_sub.add_parser(
      "e2e", help="dense vs SVG presets through generate_wan on a tiny random checkpoint (needs "
                  "MaxDiffusion on PYTHONPATH and its runtime deps)")
  _add_devices_arg(e2e)
  e2e.add_argument("--steps", type=int, default=10, help="denoising steps per run")
  e2e.add_argument("--presets", nargs="+", default=["conservative", "moderate", "aggressive"],
                   help="SVG presets to run after dense")
  _add_json_arg(e2e)
  e2e.set_defaults(run=_bench_e2e)

  warm = bench_sub.add_parser(
      "semantic-warm", help="k-means updates a semantic head needs cold vs warm (from the previous "
                            "step's centroids), on the tiny Wan's denoising loop (needs MaxDiffusion)")
  _add_devices_arg(warm)
  warm.add_argument("--steps", type=_positive_int, default=10, help="denoising steps")
  warm.add_argument("--clusters", type=_positive_int, default=16, help="k-means clusters")
  warm.add_argument("--updates", type=_positive_int, nargs="+", default=[1, 2, 4, 8],
                    help="update counts to judge")
  _add_json_arg(warm)
  warm.set_defaults(run=_bench_semantic_warm)
