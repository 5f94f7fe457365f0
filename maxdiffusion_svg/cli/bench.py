"""``python -m maxdiffusion_svg bench ...``: the benchmarks' command lines (those that compile for
TPUs: :mod:`maxdiffusion_svg.cli.bench_tpu`)."""

from __future__ import annotations

import argparse
import os

from maxdiffusion_svg.cli import bench_tpu as cli_bench_tpu
from maxdiffusion_svg.cli.args import (_MODES, _add_grid_args, _add_json_arg, _density,
                                       _grid_from_args, _positive_int, _progress, _report, _tile)
from maxdiffusion_svg.plan.target import BACKENDS
from maxdiffusion_svg.plan.tiling import PALLAS_TILES, tiles_help


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
    from maxdiffusion_svg.cli.plot import plot_quality  # pylint: disable=import-outside-toplevel
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
    from maxdiffusion_svg.tpu.aot import libtpu_available, topology_devices  # pylint: disable=import-outside-toplevel
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
                               compensation=args.compensation, weighting=args.weighting)
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

  cli_bench_tpu.add_subparsers(bench_sub)

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
  calib.add_argument("--weighting", choices=("power", "mean"), default="power",
                     help="how the fit weighs a layer's heads: by their output power (as "
                          "calibrate does) or the plain mean; both are judged on the held-out "
                          "draws")
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
