"""LTX-2's video self-attention priced by libtpu's static schedule: the speed bound of a run
against MaxDiffusion's kernels (``flash``, LTX-2's default, and ``ulysses_custom_fixed_m``), per
video size. Issue slots as the compiler scheduled them, not time
(``python -m maxdiffusion_svg.bench.ltx2_aot --static-schedule``)."""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Sequence

from maxdiffusion_svg.bench.ltx2_model import (LTX2_19B, default_config, latent_grid,
                                               resolution_video)

REPO = pathlib.Path(__file__).resolve().parents[2]
SVG_CONFIG = REPO / "configs" / "ltx2_svg.yml"


def _flash_prices(row: dict[str, Any]) -> Any:
  """``schedule_costs.KernelPrices`` of MaxDiffusion's flash from a ``schedule.run_case`` row:
  Splash runs every tile with one body (the padding mask evaluated in each)."""
  from maxdiffusion_svg.tpu.prices import KernelPrices  # pylint: disable=import-outside-toplevel
  kernel, case = row["kernel"], row["case"]
  region = lambda key: (kernel.get(key) or {}).get("bundles", 0)
  return KernelPrices(tiles=(case["block_q"], case["block_kv"], case["block_kv_compute"]),
                      full=region("full"), online=region("full"), masked=region("masked"),
                      row=region("row_init") + region("row_final"),
                      step=kernel["step_overhead"])


def static_schedule_bounds(resolutions: Sequence[str | Sequence[int]] = ("720p", "1080p"),
                           chip: str = "v6e", svg_config: str | pathlib.Path | None = None,
                           overrides: dict[str, Any] | None = None,
                           context_shards: int = 8,
                           log: Callable[[str], None] = print) -> dict[str, Any]:
  """Self-attention's speed bound for LTX-2 against MaxDiffusion's kernels, by libtpu's static
  schedule (issue slots as scheduled: no DMA or memory stalls, no clock), per video size.

  Ours and MaxDiffusion's ``ulysses_custom_fixed_m`` (fast recipe) are priced as ``tiles
  --config`` prices them (:func:`maxdiffusion_svg.plugin.estimate.estimate_config` on
  ``svg_config``, default ``configs/ltx2_svg.yml``, at the video's size: the run's sparse share
  of calls, each call one head over the whole sequence, from ``schedule_costs.PRICES``).
  MaxDiffusion's ``flash``, LTX-2's default, is compiled here at ``ltx2_video.yml``'s
  ``flash_block_sizes`` under the chip's default scoped-VMEM limit (its LTX-2 command sets
  none) with its schedule dumped (``bench.schedule.run_case``, a child process) and priced two
  ways: one head over the whole sequence (the convention of ``bench schedule``), and per
  device as the forward runs it (queries split over ``context_shards``, each padded to
  ``block_q``, every head on every device, keys whole) against our ``heads / context_shards``
  local heads over the whole sequence. Returns ``{"chip", "libtpu", "resolutions": {name:
  {...}}}``."""
  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench.schedule import ScheduleCase, run_case
  from maxdiffusion_svg.plan.target import tpu_target
  from maxdiffusion_svg.plugin.estimate import estimate_config
  from maxdiffusion_svg.plugin.overlay import load_config
  from maxdiffusion_svg.tpu.prices import LIBTPU
  # pylint: enable=import-outside-toplevel
  svg_keys, _ = load_config(svg_config or SVG_CONFIG)
  flash_keys, _ = load_config(default_config())
  blocks = flash_keys["flash_block_sizes"]
  block_q = max(blocks["block_q"], blocks.get("block_q_dkv", 0))  # as MaxDiffusion pads q
  block_kv = max(blocks["block_kv"], blocks.get("block_kv_dkv", 0))
  heads = LTX2_19B["num_attention_heads"]
  local_heads = heads // context_shards
  out: dict[str, Any] = {"kind": "compiler-static schedule", "chip": chip, "libtpu": LIBTPU,
                         "svg_config": str(svg_config or SVG_CONFIG),
                         "flash_blocks": [block_q, block_kv, blocks["block_kv_compute"]],
                         "heads": heads, "context_shards": context_shards, "resolutions": {}}
  for resolution in resolutions:
    frames, height, width = resolution_video(resolution)
    name = resolution if isinstance(resolution, str) else f"{width}x{height}x{frames}"
    grid = latent_grid(frames, height, width)
    tokens = grid[0] * grid[1] * grid[2]
    keys = {**svg_keys, **(overrides or {}), "num_frames": frames, "height": height,
            "width": width}
    estimate = estimate_config(keys, tpu_target(chip))
    row = estimate["rows"][0]
    ours = row["vs_fixed_m"]
    if not ours.get("priced"):
      raise ValueError(f"our calls cannot be priced by the static schedule: {ours['why']}")
    flash_row = run_case(ScheduleCase(chip, grid, 1.0, "aligned", block_q, block_kv,
                                      blocks["block_kv_compute"], None,
                                      kernel="maxdiffusion_flash"), log)
    entry: dict[str, Any] = {
        "video": [frames, height, width], "grid": list(grid), "tokens": tokens,
        "density": row["density"], "tiles": estimate["tiles"],
        "full_tiles": row["full_tiles"], "masked_tiles": row["masked_tiles"],
        "sparse_call_share": row["sparse_call_share"], "sparse_steps": row["sparse_steps"],
        "steps": row["steps"], "sparse_layers": row["sparse_layers"], "layers": row["layers"],
        "ours": {path: {k: ours[path][k] for k in ("sparse_call", "dense_call", "run_call")}
                 for path in ("fixed", "online")},
        "fixed_m_call": ours["fixed_m_call"],
        "vs_fixed_m": {path: ours[path]["bound"] for path in ("fixed", "online")},
        "flash": {"ok": flash_row["ok"], "error": flash_row.get("error", ""),
                  "seconds": flash_row.get("seconds")}}
    out["resolutions"][name] = entry
    if not flash_row["ok"]:
      continue
    prices = _flash_prices(flash_row)
    q_local = -(-tokens // context_shards)
    rows_local, cols = -(-q_local // block_q), -(-tokens // block_kv)
    per_device = heads * prices.call(rows_local * cols, 0, rows_local)
    entry["flash"].update(
        call=flash_row["static_bundles"], tiles_visited=flash_row["tiles_visited"],
        bodies={"full": prices.full, "row": prices.row, "step": prices.step},
        per_device_call=per_device, per_device_tiles=heads * rows_local * cols,
        per_device_shape=[heads, q_local, tokens])
    for path in ("fixed", "online"):
      run, sparse, dense = (ours[path][k] for k in ("run_call", "sparse_call", "dense_call"))
      entry.setdefault("vs_flash", {})[path] = {
          "bound": flash_row["static_bundles"] / run,
          "sparse_call": sparse / flash_row["static_bundles"],
          "dense_call": dense / flash_row["static_bundles"],
          "per_device_bound": per_device / (local_heads * run),
          "per_device_sparse_call": local_heads * sparse / per_device,
          "per_device_dense_call": local_heads * dense / per_device}
  return out


def format_static_schedule_bounds(result: dict[str, Any]) -> str:
  """The bounds of :func:`static_schedule_bounds`, one line per video size and kernel."""
  bq, bkv, bkc = result["flash_blocks"]
  lines = [f"compiler-static schedule (libtpu {result['libtpu']}, TPU {result['chip']}): "
           f"LTX-2 video self-attention, {result['heads']} heads over {result['context_shards']} "
           f"devices, head_dim 128, bf16; issue slots as scheduled, not time", "",
           "| video | tokens | density | sparse calls | ours: sparse / dense call (M bundles) "
           "| fixed-m call | vs fixed-m (online) | flash call | vs flash, one head (online) "
           "| flash per device | vs flash per device (online) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  m = lambda x: f"{x / 1e6:.3f}"
  for name, e in result["resolutions"].items():
    ours, flash = e["ours"]["fixed"], e["flash"]
    head = (f"| {name} | {e['tokens']:,} | {e['density']} | {e['sparse_steps']} of {e['steps']}"
            f" steps x {e['sparse_layers']} of {e['layers']} layers "
            f"({e['sparse_call_share']:.1%}) | {m(ours['sparse_call'])} / {m(ours['dense_call'])}"
            f" | {m(e['fixed_m_call'])} | {e['vs_fixed_m']['fixed']:.2f}x "
            f"({e['vs_fixed_m']['online']:.2f}x)")
    if not flash["ok"]:
      lines.append(f"{head} | flash failed: {flash['error']} | | | |")
      continue
    vs = e["vs_flash"]
    lines.append(f"{head} | {m(flash['call'])} | {vs['fixed']['bound']:.2f}x "
                 f"({vs['online']['bound']:.2f}x) | {m(flash['per_device_call'])} "
                 f"({flash['per_device_tiles']:,} tiles) | {vs['fixed']['per_device_bound']:.2f}x "
                 f"({vs['online']['per_device_bound']:.2f}x) |")
  lines += ["", f"flash: MaxDiffusion's Splash at ltx2_video.yml's blocks {bq}x{bkv}, kv step "
                f"{bkc}, default scoped VMEM; 'one head': one head over the whole sequence, as "
                f"bench schedule prices Wan's; 'per device': every head's queries split over "
                f"the context axis as LTX-2's forward runs flash, against our "
                f"{result['heads'] // result['context_shards']} local heads after the "
                f"exchange. Ours and fixed-m: tiles --config's pricing (schedule_costs.PRICES); "
                f"bounds count the dense steps and layers."]
  return "\n".join(lines)
