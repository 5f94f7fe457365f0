"""``python -m maxdiffusion_svg compare``: the user's dense kernel and SVG on one prompt and seed.

Each run is the config's model through its own generate main (MaxDiffusion's ``generate_wan``,
``generate_ltx2``, ``generate_wan_animate``; ours for Wan VACE, :mod:`generate_vace`:
:mod:`maxdiffusion_svg.plugin.generations`).
The weights load once, with ``attention: svg`` (so the hooks prepare the transformers); each
run then sets, on the loaded model, what MaxDiffusion would have built for it: the
self-attention ops' kernel name (the dense kernel, or ``svg``) and the SVG settings of the run.
Both are static attributes of the model's graph, so each run compiles its own forward
(MaxDiffusion's warm-up, which is not timed) and the weights are shared. Cross-attention runs
the same in every run: ``svg`` hands it to its dense kernel, as MaxDiffusion's own kernels do
(with Wan's ``flash_min_seq_length: 4096``, as ``dot_product``); so do LTX-2's audio
self-attention and text cross-attentions.

Per run: seconds per denoising step of the real call (as the model's driver times it), the
self-attention calls that ran sparse and the temporal-head share (as the kernel counted them for
the run summary) and, against the dense
video, PSNR, SSIM and optionally LPIPS. Each run's video and the JSON are written as soon as
the run ends, so an interrupted comparison keeps what finished.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import yaml

from maxdiffusion_svg.budgets.per_layer import Rung
from maxdiffusion_svg.budgets.schedule import PRESETS, preset_hint
from maxdiffusion_svg.measure import video_metrics
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plugin import families, generations, hooks, launcher, overlay, run_summary
from maxdiffusion_svg.plugin import quiet as quiet_output
from maxdiffusion_svg.plugin.settings import KERNEL_NAME, PluginSettings
from maxdiffusion_svg.plugin.video_models import grid_of, video_model
from maxdiffusion_svg.routing.layouts import check_layouts

MAXDIFFUSION_LOG = quiet_output.LOG_NAME  # what MaxDiffusion prints during a quiet compare

CONFIG_RUN = "config"  # the svg run the config itself describes


@dataclasses.dataclass(frozen=True)
class Run:
  """One generation of the comparison."""

  name: str
  kernel: str  # the self-attention kernel: a dense MaxDiffusion kernel or "svg"
  overrides: tuple[str, ...] = ()  # svg_* keys of this run, over the config's

  @property
  def is_dense(self) -> bool:
    return self.kernel != KERNEL_NAME


def svg_run(spec: str) -> Run:
  """A run from ``config`` (the config's own SVG keys), a preset name, or a band density,
  optionally followed by options, each after a ``+``: ``compensation`` (on, the config's
  blocks), ``compensation=N`` (on, ``N`` centroids per key tile), ``compensation=off``,
  ``semantic`` (SVG2's clustered layout among the router's choices: ``svg_layouts [spatial,
  temporal, semantic]``), ``layouts=A/B`` (``svg_layouts`` as given, e.g. ``layouts=semantic``)
  , ``sink=on|off`` (``svg_include_sink``: the first frame, a reference frame in VACE and
  Animate, attended by every query or not), ``sink_frames=N`` (``svg_sink_frames``: the sink
  covers the first ``N`` frames, VACE's ``N`` references) or ``dense_frames=N``
  (``svg_dense_frames``: the first ``N`` frames' queries attend every key; with the sink, a
  reference frame run dense)."""
  base, *extras = spec.split("+")
  run = _base_run(base)
  if not extras:
    return run
  keys = tuple(key for extra in extras for key in _option_keys(extra, spec))
  return Run(f"{run.name} +{'+'.join(extras)}", KERNEL_NAME, (*run.overrides, *keys))


def _option_keys(extra: str, spec: str) -> tuple[str, ...]:
  """The ``svg_*`` overrides of one ``+option`` of a run."""
  name, _, value = extra.partition("=")
  if name == "semantic" and not value:
    return ("svg_layouts=[spatial, temporal, semantic]",)
  if name == "layouts" and value:
    names = [n for n in value.split("/") if n]
    check_layouts(names)  # refused here, naming the layouts, before any run starts
    return (f"svg_layouts=[{', '.join(names)}]",)
  if name == "sink" and value in ("on", "off"):  # e.g. Animate's reference slot as the sink, or not
    return (f"svg_include_sink={'true' if value == 'on' else 'false'}",)
  if name == "dense_frames" and value.isdigit():  # a reference frame dense, not only a sink
    return (f"svg_dense_frames={int(value)}",)
  if name == "sink_frames" and value.isdigit() and int(value) > 0:  # VACE's R references
    return (f"svg_sink_frames={int(value)}",)
  return _compensation_keys(extra, spec)


def _base_run(spec: str) -> Run:
  if spec == CONFIG_RUN:
    return Run("svg", KERNEL_NAME)
  if spec in PRESETS:
    return Run(f"svg {spec}", KERNEL_NAME, (f"svg_schedule={spec}",))
  try:
    density = float(spec)
  except ValueError:
    raise ValueError(f"--svg takes {CONFIG_RUN}, a preset ({', '.join(PRESETS)}) or a band "
                     f"density in (0, 1], each optionally +compensation[=N|off], got "
                     f"{spec!r}{preset_hint(spec)}") from None
  if not 0.0 < density <= 1.0:
    raise ValueError(f"--svg density must be in (0, 1], got {spec}")
  return Run(f"svg density {density:g}", KERNEL_NAME, (f"svg_density={density:g}",))


def _compensation_keys(extra: str, spec: str) -> tuple[str, ...]:
  """The ``svg_compensation*`` overrides of a run's ``+compensation[=N|off]``."""
  name, _, value = extra.partition("=")
  if name == "compensation" and value in ("", "on"):
    return ("svg_compensation=true",)
  if name == "compensation" and value == "off":
    return ("svg_compensation=false",)
  if name == "compensation" and value.isdigit() and int(value) > 0:
    return ("svg_compensation=true", f"svg_compensation_blocks={int(value)}")
  raise ValueError(f"--svg {spec}: after + a run takes compensation (on, the config's "
                   f"svg_compensation_blocks), compensation=N (N >= 1 centroids per key tile), "
                   f"compensation=off, semantic, layouts=A/B (of spatial, temporal, "
                   f"semantic), sink=on|off, sink_frames=N (N >= 1) or dense_frames=N (N >= 0), "
                   f"got {extra!r}")


def base_attention(config_path: str) -> str | None:
  """The ``attention`` of the first config in the file's ``base_config`` chain that does not
  set ``svg``: what the user runs without this plugin."""
  _, chain = overlay.load_config(config_path)
  for path in chain:
    with open(path, encoding="utf-8") as f:
      value = (yaml.safe_load(f) or {}).get("attention")
    if value is not None and value != KERNEL_NAME:
      return str(value)
  return None


def dense_kernels() -> list[str]:
  """The dense kernels MaxDiffusion dispatches by name."""
  from maxdiffusion.models import attention_flax  # pylint: disable=import-outside-toplevel
  return sorted({"dot_product", *attention_flax.KERNEL_REGISTRY} - {KERNEL_NAME})


@dataclasses.dataclass(frozen=True)
class Plan:
  """What ``compare`` will do, checked before anything loads."""

  config: str
  overrides: tuple[str, ...]
  runs: tuple[Run, ...]
  keys: dict[str, Any]  # the merged config with the overrides (attention: svg)
  settings: dict[str, PluginSettings]  # per svg run
  out_dir: pathlib.Path
  lpips: bool


def plan_comparison(config: str, overrides: Sequence[str], dense: str | None,
                    svg: Sequence[str], out_dir: str, lpips: bool) -> Plan:
  """Every check ``compare`` can make before weights load: one line each."""
  argv = ["compare", config, *overrides, f"attention={KERNEL_NAME}"]
  keys = launcher.with_overrides(launcher.checked_config(argv)[0], argv[2:])
  generations.generation(video_model(keys), "compare")
  dense = dense or base_attention(config)
  if dense is None:
    raise ValueError(f"no dense kernel: {config}'s base_config chain sets no attention other "
                     f"than svg; give --dense KERNEL (e.g. flash, ulysses_custom_fixed_m)")
  known = dense_kernels()
  if dense not in known:
    raise ValueError(f"--dense {dense!r} is not a MaxDiffusion attention kernel; known: "
                     f"{', '.join(known)}")
  runs = [Run(f"dense ({dense})", dense), *(svg_run(s) for s in svg)]
  names = [r.name for r in runs]
  if len(set(names)) != len(names):
    raise ValueError(f"--svg names a run twice: {', '.join(names[1:])}")
  settings = {}
  for run in runs[1:]:
    run_keys = launcher.with_overrides(keys, run.overrides)
    if run.overrides and run.overrides[0].startswith("svg_schedule="):
      for key in ("svg_density", "svg_active_steps", "svg_active_layers"):
        run_keys[key] = "preset"  # a preset run takes the preset's values, not the config's
    settings[run.name] = PluginSettings.from_mapping(run_keys)
  if keys.get("aot_cache_dir"):
    raise ValueError(f"aot_cache_dir is {keys['aot_cache_dir']!r}: compare runs several kernels "
                     f"on one model and MaxDiffusion's AOT cache keys executables by the config's "
                     f"attention only; give aot_cache_dir=''")
  if not str(keys.get("prompt") or "").strip():
    raise ValueError("prompt is empty: give prompt='...' (the same prompt runs for every kernel)")
  video_metrics.check_metrics(lpips)
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  if not os.access(out, os.W_OK):
    raise ValueError(f"--out {out} is not writable")
  return Plan(config, tuple(overrides), tuple(runs), keys, settings, out.resolve(), lpips)


def call_counts(settings: PluginSettings, steps: int, layers: int, grid: VideoGrid,
                segments: int = 1) -> run_summary.CallCounts:
  """The real call's self-attention calls as the kernel counted them (the run summary's
  tally), or as the schedule makes them where nothing was counted (a too-short video);
  ``segments``: runs of the schedule in the call (Wan Animate's), each making the same calls."""
  counts = run_summary.counted_calls(layers)
  if counts.sparse + counts.dense == 0:
    counts = run_summary.scheduled_calls(settings, steps, layers, grid.tokens)
  return counts.repeated(segments)


def visited_tile_share(settings: PluginSettings, grid: VideoGrid, target: Any = None) -> float:
  """The share of its tiles a sparse call computes, from the run's tile plan (as ``tiles``
  prints it); with per-layer densities, the mean over the layers."""
  svg = settings.svg
  per_layer = svg.layer_densities_for(None)
  if per_layer is None:
    return svg.plan(grid, None, target).stats.visited_tile_fraction
  plans = [svg.at_rung(Rung(d, svg.compensation)).plan(grid, None, target) for d in per_layer]
  return sum(p.stats.visited_tile_fraction for p in plans) / len(plans)


def _self_attention_ops(pipeline: Any) -> Iterator[tuple[Any, Any]]:
  for model in hooks.prepared_transformers(pipeline):
    for op, _ in families.self_attention_ops(model):
      yield model, op


def set_run(pipeline: Any, run: Run, settings: PluginSettings | None,
            axis_rules: Any = None) -> None:
  """Makes the loaded model what MaxDiffusion would have built for ``run``: the self-attention
  kernel, the SVG settings, and the logical axis rules ``pyconfig`` derives for the kernel
  (the pipeline reads them from the config at each call; e.g. ``ulysses*`` keep K/V
  sequence-sharded where the rules for ``svg`` would not)."""
  for model, op in _self_attention_ops(pipeline):
    op.attention_kernel = run.kernel
    if settings is not None:
      model.svg_settings = settings
  if axis_rules is not None:
    from maxdiffusion import pyconfig  # pylint: disable=import-outside-toplevel
    pyconfig.config.get_keys()["logical_axis_rules"] = axis_rules


def axis_rules_for(argv: Sequence[str]) -> Any:
  """The logical axis rules ``pyconfig`` derives for ``argv`` (its attention kernel decides
  some); ``unittest=True`` keeps it from starting ``jax.distributed``. Leaves ``pyconfig.config``
  to the next ``initialize``."""
  from maxdiffusion import pyconfig  # pylint: disable=import-outside-toplevel
  pyconfig.initialize(list(argv), unittest=True)
  return pyconfig.config.logical_axis_rules


def run_comparison(plan: Plan, log: Callable[[str], None] = print, progress: bool = False,
                   quiet: bool = False) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Generates every run of ``plan`` in this process, writing each run's video, the
  side-by-side video and the JSON as each run ends; returns the JSON's dict and each run's
  frames (uint8, the videos of the batch one after another). ``progress``: a bar over the
  runs' denoising steps on stderr. ``quiet``: what MaxDiffusion prints (each run's config
  dump, its own progress) goes to ``maxdiffusion.log`` in the output folder."""
  # pylint: disable=import-outside-toplevel
  import jax
  from maxdiffusion import pyconfig

  from maxdiffusion_svg import plugin
  # pylint: enable=import-outside-toplevel
  plugin.register()
  keys = plan.keys
  family = video_model(keys)
  generation = generations.generation(family, "compare")
  steps = int(keys["num_inference_steps"])
  grid = grid_of(keys)
  result: dict[str, Any] = {
      "config": plan.config, "overrides": list(plan.overrides),
      "checkpoint": keys["pretrained_model_name_or_path"], "prompt": keys["prompt"],
      "seed": keys.get("seed"), "video": [keys["num_frames"], keys["height"], keys["width"]],
      "tokens": grid.tokens, "steps": steps,
      "model": family.name, "time": generation.time,
      "metrics": "mean over frames against the dense video: PSNR (dB), SSIM"
                 + (", LPIPS (AlexNet)" if plan.lpips else ""),
      "platform": jax.default_backend(),
      "maxdiffusion_log": str(plan.out_dir / MAXDIFFUSION_LOG) if quiet else None, "runs": []}
  scorer = video_metrics.lpips_scorer() if plan.lpips else None
  current: dict[str, Run] = {}
  videos: dict[str, np.ndarray] = {}

  rules: dict[str, Any] = {}

  def before_call(pipeline: Any) -> None:
    run = current["run"]
    if KERNEL_NAME not in rules:  # the first call: the rules of the config as loaded
      rules[KERNEL_NAME] = pyconfig.config.logical_axis_rules
      for settings in plan.settings.values():  # each run's blocks against the mesh's key tile
        settings.compensation_text(settings.svg.target(mesh=getattr(pipeline, "mesh", None)))
    set_run(pipeline, run, plan.settings.get(run.name), rules[run.kernel])

  eta = _Eta()
  bars: list[Any] = []

  def on_step() -> None:
    bar = bars[0]
    bar.update(1)
    bar.set_postfix_str(eta.step(bar.total - bar.n), refresh=False)

  with quiet_output.to_log(plan.out_dir / MAXDIFFUSION_LOG if quiet else None,
                           keep=quiet_output.WARNINGS) as terminal, \
      tempfile.TemporaryDirectory(prefix="maxdiffusion_svg_compare_") as tmp, \
      generation.watch(before_call, on_step) as seen, \
      _bar(len(plan.runs) * steps, progress, terminal.err) as bar:
    bars.append(bar)
    dense = plan.runs[0].kernel
    rules[dense] = axis_rules_for(launcher.prepare_argv(
        ["compare", plan.config, *plan.overrides, f"attention={dense}"], tmp)[0])
    argv = launcher.prepare_argv(["compare", plan.config, *plan.overrides,
                                  f"attention={KERNEL_NAME}"], tmp)[0]
    per_run = steps  # denoising steps a run takes (Animate: steps x segments, known after one)
    for index, run in enumerate(plan.runs):
      current["run"] = run
      bar.set_description(f"run {index + 1}/{len(plan.runs)}: {run.name}")
      bar.n = index * per_run
      log(f"compare: run {index + 1} of {len(plan.runs)}: {run.name}")
      eta.new_run()
      run_dir = plan.out_dir / run_folder(run.name)
      run_dir.mkdir(exist_ok=True)
      seen["frames"].clear()
      cwd = os.getcwd()
      os.chdir(run_dir)  # the main writes its MP4 into the working directory
      try:
        if "pipeline" not in seen:
          generation.first(argv)  # loads the weights (once), then runs
        else:
          generation.again(pyconfig.config, seen)
      finally:
        os.chdir(cwd)
      taken = generations.real_call(seen)["steps"]
      if taken > per_run:
        per_run, bar.total = taken, len(plan.runs) * taken
      videos[run.name] = frames = np.concatenate(seen["frames"])
      row: dict[str, Any] = {
          "name": run.name, "kernel": run.kernel, "overrides": list(run.overrides),
          "step_s": generations.step_seconds(seen, steps),
          "videos": sorted(str(p) for p in run_dir.glob("*.mp4"))}
      settings = plan.settings.get(run.name)
      if settings is not None:
        layers = hooks.prepared_transformers(seen["pipeline"])[0].num_layers
        counts = call_counts(settings, steps, layers, grid, run_summary.segments())
        target = settings.svg.target(mesh=getattr(seen["pipeline"], "mesh", None))
        row.update(density=settings.svg.density, preset=settings.preset,
                   visited_tile_share=visited_tile_share(settings, grid, target),
                   compensation_blocks=settings.svg.compensation_blocks
                   if settings.svg.compensation else 0,
                   sparse_calls=counts.sparse, dense_calls=counts.dense,
                   sparse_call_share=counts.sparse / (counts.sparse + counts.dense),
                   calls_counted=counts.counted, temporal_head_share=counts.temporal_share)
      scores = video_metrics.compare_videos(frames, videos[plan.runs[0].name], scorer)
      row.update(psnr_db=scores.psnr_db, ssim=scores.ssim, lpips=scores.lpips)
      result["runs"].append(row)
      write_outputs(plan, result, videos, int(keys.get("fps") or 16))
  return result, videos


def _bar(total: int, show: bool, file: Any = None) -> Any:
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel  # a MaxDiffusion dependency
  # tqdm's own remaining time would count each run's compiling first step: ours (_Eta) does not
  return tqdm(total=total, unit="step", disable=not show, dynamic_ncols=True,
              file=file or sys.stderr,
              bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")


class _Eta:
  """The time left from the steps after each run's first (which compiles): the mean of those
  steps times the steps left; each remaining run's compilation is not in it."""

  def __init__(self) -> None:
    self.last: float | None = None
    self.seconds, self.steps = 0.0, 0

  def new_run(self) -> None:
    self.last = None  # the next step compiles: not timed

  def step(self, left: int) -> str:
    now = time.perf_counter()
    if self.last is not None:
      self.seconds, self.steps = self.seconds + now - self.last, self.steps + 1
    self.last = now
    if not self.steps:
      return ", ETA after the first compiled step"
    remaining = round(self.seconds / self.steps * left)
    return f", ETA {remaining // 60}:{remaining % 60:02d} (+ each run's compile)"


def run_folder(name: str) -> str:
  return "".join(c if c.isalnum() or c in "._-" else "_" for c in name).strip("_")


def write_outputs(plan: Plan, result: dict[str, Any], videos: dict[str, np.ndarray],
                  fps: int) -> None:
  """Speed-ups against dense, the JSON and the side-by-side video of the runs so far."""
  from maxdiffusion.utils import export_to_video  # pylint: disable=import-outside-toplevel
  dense_step = result["runs"][0]["step_s"]
  for row in result["runs"]:
    row["speedup_vs_dense"] = dense_step / row["step_s"] if row["step_s"] else float("nan")
  result["side_by_side"] = str(plan.out_dir / "side_by_side.mp4")
  result["side_by_side_order"] = [row["name"] for row in result["runs"]]
  export_to_video(video_metrics.side_by_side(list(videos.values())), result["side_by_side"],
                  fps=fps)
  with open(plan.out_dir / "compare.json", "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)


def format_comparison(result: dict[str, Any]) -> str:
  frames, height, width = result["video"]
  platform = result.get("platform", "tpu")
  on_tpu = platform == "tpu"
  name = platform.upper() if platform in ("tpu", "cpu", "gpu") else platform
  lines = [f"compare: {result['checkpoint']}, {frames}x{height}x{width} video "
           f"({result['tokens']:,} tokens), {result['steps']} steps, seed {result['seed']}, "
           f"on {name}",
           f"{'run':<32}{'sparse calls':>13}{'tiles':>7}{'temporal':>9}{'s/step':>10}"
           f"{'speed-up':>10}{'PSNR dB':>9}{'SSIM':>8}{'LPIPS':>8}"]
  for row in result["runs"]:
    share = f"{row['sparse_call_share']:.0%}" if "sparse_call_share" in row else "-"
    tiles = row.get("visited_tile_share")
    tiles = "-" if tiles is None else f"{tiles:.0%}"
    temporal = row.get("temporal_head_share")
    temporal = "-" if temporal is None else f"{temporal:.0%}"
    psnr = "inf" if row["psnr_db"] == float("inf") else f"{row['psnr_db']:.2f}"
    lpips = "-" if row["lpips"] is None else f"{row['lpips']:.3f}"
    # a CPU's (or GPU's) ratio of seconds says nothing of a TPU's: not printed as a speed-up
    speedup = f"{row['speedup_vs_dense']:.2f}x" if on_tpu else "n/a"
    lines.append(f"{row['name']:<32}{share:>13}{tiles:>7}{temporal:>9}{row['step_s']:>10.3f}"
                 f"{speedup:>10}{psnr:>9}{row['ssim']:>8.3f}{lpips:>8}")
  lines.append("sparse calls: self-attention calls run sparse; tiles: share of its tiles a sparse "
               "call computes; temporal: share of the sparse calls' heads on the temporal layout")
  if not on_tpu:
    lines.append(f"speed-up: not meaningful on {name} (its s/step is noise at this size and no "
                 f"TPU figure): for what the tiles save on a TPU see python -m maxdiffusion_svg "
                 f"tiles {result['config']} (the bound) and docs/benchmarks.md (measured); "
                 f"the quality columns hold anywhere")
  lines.append(f"time: {result['time']}; quality: {result['metrics']}")
  lines.append(f"videos: {result['side_by_side']} (left to right: "
               f"{', '.join(result['side_by_side_order'])}); JSON beside it")
  if result.get("maxdiffusion_log"):
    lines.append(f"MaxDiffusion's output (each run's config, its logs): "
                 f"{result['maxdiffusion_log']} (--verbose prints it)")
  return "\n".join(lines)
