"""The quality benchmark's semantic section: PSNR against dense per layout at equal visited tiles.

Every layout runs the band plan's visited tiles per query tile row (the semantic layout picks
its own tiles within that count), so each density is one cost for all of them: the visited
tile fraction is the x axis. Heads are the compensation section's (:func:`compensation_qkv`):
planted spatial, temporal and moving-content heads, sharp and soft. Per density and with
compensation off and on, each head group's mean PSNR for:

* each layout forced (``svg_layouts`` ``[spatial]``, ``[temporal]``, ``[semantic]``);
* today's router (``[spatial, temporal]``) and the three-layout router.

Targets (issue 35): the semantic layout at least :data:`GAIN_DB` over the better SVG1 layout on
moving content at :data:`TARGET_DENSITIES`; the three-layout router within
:data:`ROUTER_SLACK_DB` of today's on the spatial and temporal heads; (issue 45) and within
:data:`BEST_SLACK_DB` of the best single layout for each kind at :data:`BEST_DENSITIES`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.bench.compensation_quality import compensation_qkv
from maxdiffusion_svg.call.attention import svg_attention
from maxdiffusion_svg.kernels import dense_attention

CANDIDATES = {"spatial": ("spatial",), "temporal": ("temporal",), "semantic": ("semantic",),
              "router SVG1": ("spatial", "temporal"),
              "router 3 layouts": ("spatial", "temporal", "semantic")}
TARGET_DENSITIES = (0.1, 0.15, 0.2)
GAIN_DB = 3.0
ROUTER_SLACK_DB = 0.1
BEST_SLACK_DB = 0.5  # issue 45: the three-layout router against the best single layout per kind
BEST_DENSITIES = (0.1, 0.2, 0.35)
MOVING, STATIC = ("moving", "soft_moving"), ("spatial", "temporal", "soft_spatial", "soft_temporal")


def run_semantic(cfg, psnr: Callable[[np.ndarray, np.ndarray], float],
                 log: Callable[[str], None] = print) -> dict[str, Any]:
  """PSNR per head group, per density of ``cfg.semantic_densities``, compensation off and on,
  for each of :data:`CANDIDATES`; with the targets' verdicts. JSON-ready."""
  (q, k, v), heads = compensation_qkv(cfg.grid, cfg.semantic_heads, cfg.head_dim, cfg.seed + 2)
  q, k, v = (jnp.asarray(x) for x in (q, k, v))
  dense = np.asarray(jax.jit(dense_attention)(q, k, v))
  groups = list(dict.fromkeys(heads))
  members = {g: [h for h, name in enumerate(heads) if name == g] for g in groups}
  rows: dict[str, Any] = {}
  for density in cfg.semantic_densities:
    row = rows[str(density)] = {}
    for compensation in (False, True):
      cell = row["compensated" if compensation else "plain"] = {}
      for name, layouts in CANDIDATES.items():
        svg = cfg.svg_config(density=density, tile_mode="aligned", layouts=layouts,
                             compensation=compensation, semantic_clusters=cfg.semantic_clusters)
        run = jax.jit(lambda q, k, v, svg=svg: svg_attention(q, k, v, grid=cfg.grid, config=svg,
                                                             return_info=True))
        out, info = run(q, k, v)
        out = np.asarray(out)
        per_head = [psnr(out[:, h], dense[:, h]) for h in range(len(heads))]
        cell[name] = {"psnr_db": {g: float(np.mean([per_head[h] for h in members[g]]))
                                  for g in groups},
                      "layout": np.asarray(info["layout"])[0].tolist()}
      row["visited_tile_fraction"] = float(info["plan"]["visited_tile_fraction"])
    plain = row["plain"]
    log(f"  density {density}: semantic vs best SVG1 layout on moving: " + ", ".join(
        f"{g} {plain['semantic']['psnr_db'][g] - _best_svg1(plain, g):+.2f} dB" for g in MOVING))
  return {"kind": "measured on CPU", "heads": heads, "groups": groups, "rows": rows,
          "tokens": cfg.grid.tokens, "clusters": cfg.semantic_clusters,
          "tiles": [cfg.block_q, cfg.block_kv], "targets": _targets(rows)}


def _best_svg1(cell: dict[str, Any], group: str) -> float:
  return max(cell["spatial"]["psnr_db"][group], cell["temporal"]["psnr_db"][group])


def _targets(rows: dict[str, Any]) -> dict[str, Any]:
  gains, slack, best = {}, {}, {}
  for density, row in rows.items():
    for kind, cell in row.items():
      if not isinstance(cell, dict):
        continue
      if float(density) in BEST_DENSITIES:
        for g in cell["router 3 layouts"]["psnr_db"]:
          best[f"{g} {kind} {density}"] = cell["router 3 layouts"]["psnr_db"][g] - max(
              cell[name]["psnr_db"][g] for name in ("spatial", "temporal", "semantic"))
      if float(density) in TARGET_DENSITIES:
        for g in MOVING:
          gains[f"{g} {kind} {density}"] = cell["semantic"]["psnr_db"][g] - _best_svg1(cell, g)
      for g in STATIC:
        slack[f"{g} {kind} {density}"] = (cell["router 3 layouts"]["psnr_db"][g]
                                          - cell["router SVG1"]["psnr_db"][g])
  return {"gain_db": GAIN_DB, "densities": list(TARGET_DENSITIES), "semantic_gain_db": gains,
          "missed_gain": sorted(k for k, x in gains.items() if x < GAIN_DB),
          "router_slack_db": ROUTER_SLACK_DB, "router_change_db": slack,
          "missed_router": sorted(k for k, x in slack.items() if x < -ROUTER_SLACK_DB),
          "best_slack_db": BEST_SLACK_DB, "router_from_best_db": best,
          "missed_best": sorted(k for k, x in best.items() if x < -BEST_SLACK_DB)}


def format_semantic(r: dict[str, Any]) -> list[str]:
  """The section's table: per density and compensation, each candidate's PSNR per group."""
  groups = r["groups"]
  lines = [f"semantic layout ({r['kind']}): PSNR against dense, dB, at equal visited tiles "
           f"(every layout visits the band's count per row); {r['clusters']} clusters, tiles "
           f"{r['tiles'][0]}x{r['tiles'][1]}; C = compensated",
           f"{'density':<8}{'visited%':>9}  {'candidate':<19}" + "".join(f"{g:>14}" for g in groups)]
  for density, row in r["rows"].items():
    first = True
    for kind in ("plain", "compensated"):
      for name, cell in row[kind].items():
        label = name + (" C" if kind == "compensated" else "")
        lead = (f"{density:<8}{100 * row['visited_tile_fraction']:>8.1f}%" if first else " " * 17)
        lines.append(f"{lead}  {label:<19}" + "".join(f"{cell['psnr_db'][g]:>14.2f}" for g in groups))
        first = False
  t = r["targets"]
  gains = t["semantic_gain_db"]
  lines.append(f"semantic over the better SVG1 layout on moving content at densities "
               f"{', '.join(map(str, t['densities']))}: " + ", ".join(
                   f"{k} {x:+.2f}" for k, x in gains.items() if "plain" in k) + " dB")
  lines.append(f"+{t['gain_db']:.0f} dB target: " + (f"missed for {', '.join(t['missed_gain'])}"
                                                    if t["missed_gain"] else "met"))
  worst = min(t["router_change_db"].values())
  lines.append(f"three-layout router vs today's on spatial/temporal heads: worst {worst:+.2f} dB "
               f"(target within {t['router_slack_db']} dB: "
               + (f"missed for {', '.join(t['missed_router'])})" if t["missed_router"] else "met)"))
  if t.get("router_from_best_db"):
    worst = min(t["router_from_best_db"].values())
    missed = ", ".join(f"{k} {t['router_from_best_db'][k]:+.2f}" for k in t["missed_best"])
    lines.append(f"three-layout router vs the best single layout per kind at densities "
                 f"{', '.join(map(str, BEST_DENSITIES))}: worst {worst:+.2f} dB (target within "
                 f"{t['best_slack_db']} dB: " + (f"missed for {missed})" if missed else "met)"))
  return lines


def plot_semantic(path: str, r: dict[str, Any]) -> None:
  """PSNR against visited tiles per candidate, compensation off (solid) and on (dashed), on the
  moving-content heads and on the spatial/temporal heads (each panel: its groups' mean)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
  densities = list(r["rows"])
  x = [100 * r["rows"][d]["visited_tile_fraction"] for d in densities]
  fig, axes = pyplot.subplots(1, 2, figsize=(12, 5.4), sharey=False)
  colours = {"spatial": "#2e86ab", "temporal": "#a23b72", "semantic": "#f18f01",
             "router SVG1": "#6c757d", "router 3 layouts": "#2a9d8f"}
  for ax, (title, groups) in zip(axes, (("moving content (sharp and soft)", MOVING),
                                        ("planted spatial and temporal heads", STATIC))):
    for name, colour in colours.items():
      for kind, style in (("plain", "-"), ("compensated", "--")):
        y = [np.mean([r["rows"][d][kind][name]["psnr_db"][g] for g in groups]) for d in densities]
        wide = name in ("spatial", "temporal", "semantic")  # under the routers that pick them
        ax.plot(x, y, style, color=colour, marker="o" if wide else "s", ms=3,
                lw=4 if wide else 1.4, alpha=0.55 if wide else 1.0,
                label=f"{name}{' + compensation' if kind == 'compensated' else ''}")
    ax.set_title(title)
    ax.set_xlabel("visited tiles, % of all (equal for every layout)")
    ax.set_ylabel("PSNR against dense, dB")
    ax.grid(alpha=0.3)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
  fig.suptitle(f"SVG layouts at equal cost (solid: plain, dashed: compensated)\nmeasured on CPU, "
               f"{r['tokens']:,} tokens, synthetic heads; each panel the mean of its head groups")
  fig.tight_layout(rect=(0, 0.1, 1, 1))
  fig.savefig(path, dpi=110)
  pyplot.close(fig)
