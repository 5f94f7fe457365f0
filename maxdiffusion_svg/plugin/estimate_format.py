"""``tiles --config``'s text: the checks the run makes, then the estimate (its JSON holds the
same figures, from :func:`maxdiffusion_svg.plugin.estimate.estimate_config`)."""

from __future__ import annotations

from typing import Any

from maxdiffusion_svg.plugin.config_checks import format_fit

# The measured price of a semantic head (docs/benchmarks.md, "The semantic layout: what it costs").
SEMANTIC_CALL_NOTE = ("1.11x a band head's call at 720p on a v6e, density 0.35 (1.19x at 0.15; "
                      "compiler-static schedule, docs/benchmarks.md)")


def _checks(result: dict[str, Any]) -> list[str]:
  checks = result["checks"]
  parts = [f"attention svg and the svg_* keys; heads {checks['heads']} "
           f"({checks['heads_source']})"]
  mesh = checks["slice"]
  if mesh:
    sizes = " x ".join(f"{axis} {size}" for axis, size in mesh["mesh"].items())
    over = (f"{mesh['context_shards']} context shards" if mesh["ring"] == 1 else
            f"{mesh['context_shards']} context shards as ulysses_shards {mesh['ulysses_shards']} "
            f"x a ring of {mesh['ring']}")
    parts.append(f"mesh on a {mesh['type']}: {sizes}, {checks['heads']} heads over {over} = "
                 f"{mesh['heads_per_device']} per device")
  unchecked = "" if mesh else (" (not checked: the mesh's context axis against the heads; "
                               "give --slice TYPE, e.g. --slice v6e-8)")
  if checks["kernel"]:
    parts.append(f"{result['backend']} kernel (head_dim {checks['head_dim']}, {checks['dtype']}): "
                 + ", ".join(format_fit(fit) for fit in checks["kernel"]))
  else:
    parts.append(f"svg_backend {result['backend']}: no TPU kernel to fit")
  lines = ["checks the run makes, passed: " + "; ".join(parts) + unchecked,
           f"the run will log: {result['summary']}"]
  return lines + [f"warning: {warning}" for warning in checks["warnings"]]


def _sink(frames: int) -> str:
  if not frames:
    return "without a sink"
  return "with the first-frame sink" if frames == 1 else f"with the first {frames} frames as the sink"


def _dense_rows(row: dict[str, Any]) -> str:
  tiles = row.get("dense_rows_tiles")
  return (f", {tiles:,} of them ({row['dense_rows_block_q']}-row query tiles, counted in the "
          f"fraction by their size) the leading frames' dense rows (svg_dense_frames)" if tiles
          else "")


def _row(row: dict[str, Any], wan22: bool) -> list[str]:
  who = f"{row['expert']} expert: " if row["expert"] else ""
  first, end = row["first_step"], row["first_step"] + row["steps"]
  steps = (f"{row['sparse_steps']} of its {row['steps']} steps [{first}, {end})" if wan22
           else f"{row['sparse_steps']} of {row['steps']} steps")
  if row.get("per_head"):
    density = (f"per-head densities {', '.join(row['layer_rungs'])} (svg_head_densities; mean "
               f"{row['density']} over the sparse layers' heads, each head on its own plan")
  elif row.get("layer_rungs"):
    density = (f"per-layer rungs {', '.join(row['layer_rungs'])} (svg_layer_densities, "
               f"svg_layer_compensation; mean {row['density']} over the sparse layers")
  else:
    density = f"svg_density {row['density']} (band density"
  lines = [
      f"{who}{density}; {_sink(row.get('sink_frames', 1))} "
      f"{row['kept_pair_fraction']:.1%} of pairs kept); a sparse call visits "
      f"{row['visited_tile_fraction']:.1%} of the tiles ({row['full_tiles']:,} full, "
      f"{row['masked_tiles']:,} masked){_dense_rows(row)}",
      f"  sparse calls: {steps} x {row['sparse_layers']} of {row['layers']} layers = "
      f"{row['sparse_call_share']:.1%} of {'its' if wan22 else ''}{' ' if wan22 else ''}"
      f"self-attention calls",
      f"  self-attention work vs dense: {row['work_vs_dense']:.3f} -> attention speed-up at "
      f"most {row['speedup_bound']:.2f}x (tiles only: the router, the permutation and "
      f"masked-tile cost are not counted)",
  ]
  vs = row.get("vs_fixed_m") or {}
  if vs.get("priced"):
    fixed, online = vs["fixed"], vs["online"]
    lines.append(
        f"  against MaxDiffusion's ulysses_custom_fixed_m (fast recipe; libtpu {vs['libtpu']}'s "
        f"static schedule, {vs['chip']}): a sparse call {fixed['sparse_call'] / vs['fixed_m_call']:.2f}"
        f" of its call, a dense step {fixed['dense_call'] / vs['fixed_m_call']:.2f}; attention "
        f"speed-up at most {fixed['bound']:.2f}x with dense steps (heads on online softmax: "
        f"{online['bound']:.2f}x)")
    if online["bound"] < 1:
      what = "expert" if row["expert"] else "run"
      lines.append(
          f"  warning: where its heads fail the fixed-offset gate this {what} is slower than "
          f"ulysses_custom_fixed_m ({online['bound']:.2f}x): lower its density, or make fewer of "
          f"its steps and layers sparse")
  elif vs:
    lines.append(f"  against MaxDiffusion's ulysses_custom_fixed_m: not priced ({vs['why']})")
  return lines


def _whole_run(combined: dict[str, Any], calls: str, note: str = "") -> str:
  """The whole run's sparse share and bounds (``note``: after the online-softmax bound)."""
  vs = combined.get("vs_fixed_m")
  against = (f"; against ulysses_custom_fixed_m at most {vs['fixed']['bound']:.2f}x "
             f"(online softmax: {vs['online']['bound']:.2f}x{note})") if vs else ""
  return (f"{combined['sparse_call_share']:.1%} of {calls} sparse; work vs dense "
          f"{combined['work_vs_dense']:.3f} -> attention speed-up at most "
          f"{combined['speedup_bound']:.2f}x{against}")


def format_estimate(result: dict[str, Any]) -> str:
  frames, height, width = result["video"]
  lines = [
      f"Estimate, {result['kind']} (not measured): {result['target']}, {result['backend']} "
      f"tiles {result['tiles'][0]}x{result['tiles'][1]}/{result['block_kv_compute']}, mode "
      f"{result['tile_mode']}",
      f"video {frames}x{height}x{width} -> grid {'x'.join(map(str, result['grid']))} = "
      f"{result['tokens']:,} tokens; preset {result['preset']}",
      *_checks(result),
  ]
  experts = result["experts"]
  if experts:
    lines.append(
        f"Wan 2.2 experts, as MaxDiffusion picks them: a step whose timestep (UniPC flow sigmas, "
        f"flow_shift {experts['flow_shift']:g}) is at least boundary_ratio "
        f"{experts['boundary_ratio']:g} x 1000 runs the high-noise expert: high_noise steps "
        f"[{experts['high_noise'][0]}, {experts['high_noise'][1]}), low_noise steps "
        f"[{experts['low_noise'][0]}, {experts['low_noise'][1]})")
  for row in result["rows"]:
    lines += _row(row, bool(experts))
  combined = result["combined"]
  blocks = combined.get("dense_blocks")
  if experts:
    lines.append(f"whole run, both experts: {_whole_run(combined, 'self-attention calls')}")
  if blocks:
    lines.append(
        f"with the VACE control blocks: {blocks['count']} more self-attention calls per step "
        f"({blocks['source']}), each dense (svg_dense_kernel): "
        + _whole_run(combined, "the run's self-attention calls", "; a control block's call "
                     "priced as the cheaper of ours dense and fixed-m's"))
  comp = result.get("compensation")
  lines.append(
      "compensation off: the tiles a sparse call skips get no weight (svg_compensation: false)"
      if comp is None else
      f"compensation {comp['blocks']} centroids per key tile"
      f"{' in the layers svg_layer_compensation turns on' if comp.get('per_layer') else ''}: "
      f"each query of a sparse call also "
      f"scores the centroids of the key tiles its row skips (at most {comp['row_keys']:,} of the "
      f"{comp['pseudo_keys']:,}; our kernel as it closes the row), "
      f"{comp['score_work_vs_dense']:.2%} of a dense call's scores; not in the bounds here")
  sem = result.get("semantic")
  if sem is not None:
    warm = (f"the run's first call per layer; later steps {sem['warm_iterations']} from the "
            f"previous step's centroids, {sem['warm_vs_attention']:.2%}" if sem["warm_iterations"]
            else "every step")
    lines.append(
        f"semantic layout ({sem['clusters']} clusters, tokens in groups of {sem['group']}): its "
        f"k-means is {sem['cold_vs_attention']:.2%} of a sparse call's attention multiply-adds "
        f"({sem['cold_iterations']} iterations, {warm}; computed); what a semantic head costs is "
        f"its placement gathers: {SEMANTIC_CALL_NOTE}; not in the bounds here")
  e2e = result["end_to_end"]
  lines.append(_end_to_end(e2e))
  lines.append(
      f"  cross-check, Amdahl's law: a step at most {e2e['step_speedup_bound']:.2f}x faster if "
      f"self-attention were {e2e['attention_share']:.1%} of a dense step ({e2e['source']})")
  if result.get("libtpu_note"):
    lines.append(f"note: {result['libtpu_note']}")
  return "\n".join(lines)


def _end_to_end(e2e: dict[str, Any]) -> str:
  """The step's and the run's bound from the compiled program, or why there is none."""
  step = e2e.get("priced") or {"priced": False, "why": "not priced"}
  if not step["priced"]:
    return f"end to end: not priced from a compiled program ({step['why']})"
  parts = []
  for expert, row in step["experts"].items():
    name = f"{expert}: " if expert else ""
    parts.append(f"{name}a sparse step at most {row['fixed']['sparse_step']:.2f}x "
                 f"({row['online']['sparse_step']:.2f}x with every head on online softmax), a "
                 f"dense one {row['fixed']['dense_step']:.2f}x; self-attention "
                 f"{row['attention_share']:.1%} of the baseline's step")
  baseline = step.get("baseline", "ulysses_custom_fixed_m")
  kernels = {"flash": "ours from its plans, flash from its schedule there",
             "ulysses_ring_custom_fixed_m": "the kernels from their plans, per device (svg's "
                                            "slowest ring shard)"}.get(
                                                baseline, "the kernels from their plans")
  return (f"end to end, against {baseline}'s step (libtpu {step['libtpu']}'s static "
          f"schedule of the compiled {step.get('family', 'Wan')} forward, {step['source']}; "
          f"{kernels}): {'; '.join(parts)}; the run at most {step['fixed']['run']:.2f}x "
          f"({step['online']['run']:.2f}x)")
