"""``bench schedule``'s tables: tile bodies, calls against dense and against MaxDiffusion's
dense kernels, tile sweeps (from :mod:`maxdiffusion_svg.bench.schedule`'s results)."""

from __future__ import annotations

from typing import Any

from maxdiffusion_svg.plan.tiles import MODES
from maxdiffusion_svg.tpu.bundles import unit_bounds

# The seed design's 720p latencies on a TPU v6e, ms (quoted): dense Splash, then B1/B2/B3.
DESIGN_MS = {"dense": 78.70, "naive": 96.37, "split": 54.12, "aligned": 32.76}


def format_tile_sweep(result: dict[str, Any]) -> str:
  lines = [f"tile sweep of {result.get('backend', 'splash')}, aligned, compiler-static schedule "
           f"(libtpu {result['libtpu']}, TPU {result['chip']}), {result['resolution']}, band "
           f"density {result['density']} (density 1: the dense branch), 1 head",
           f"{'scoped VMEM':<14}{'tiles':<16}{'density':>8}{'static Mbundles':>16}{'full body':>11}"
           f"{'masked body':>13}   note"]
  for row in result["rows"]:
    case = row["case"]
    density = f"{case['density']:g}"
    limit = f"{case['vmem_limit_kib'] // 1024} MiB" if case["vmem_limit_kib"] else "default"
    tiles = f"{case['block_q']}x{case['block_kv']}/{case['block_kv_compute']}"
    default = result["defaults"][str(case["vmem_limit_kib"])] == [
        case["block_q"], case["block_kv"], case["block_kv_compute"]]
    if not row.get("ok"):
      lines.append(f"{limit:<14}{tiles:<16}{density:>8}{'-':>16}{'':>11}{'':>13}   "
                   f"{row['error'][:90]}")
      continue
    kernel = row["kernel"]
    masked = (kernel["masked"] or {}).get("bundles")
    lines.append(f"{limit:<14}{tiles:<16}{density:>8}{row['static_bundles'] / 1e6:>16.2f}"
                 f"{kernel['full']['bundles']:>11,}{'' if masked is None else f'{masked:,}':>13}"
                 f"   {'default' if default else ''}")
  return "\n".join(lines)


def _pct(share: float) -> str:
  return f"{share:.0%}"


def format_schedule_bench(result: dict[str, Any]) -> str:
  block_q, block_kv, kv_compute = result["tiles"]
  kernel_name = {"pallas": "our kernel", "splash": "Splash"}.get(result.get("backend", "splash"))
  lines = [f"compiler-static schedule of {kernel_name} (libtpu {result['libtpu']}, TPU "
           f"{result['chip']}): {result['resolution']} grid {'x'.join(map(str, result['grid']))} = "
           f"{result['tokens']:,} tokens, band density {result['density']}, tiles "
           f"{block_q}x{block_kv}, kv step {kv_compute}, 1 head, bf16",
           "issue slots as scheduled, one bundle per cycle; no DMA or memory stalls, no clock",
           "", f"{'tile body':<28}{'bundles':>9}{'vs full':>9}{'matmuls':>9}{'exp':>7}   busiest units"]
  modes = result["modes"]
  full = next((m["kernel"]["full"] for name, m in sorted(modes.items(), key=lambda x: x[0] != "aligned")
               if m.get("ok")), None)
  pallas = result.get("backend") == "pallas"
  bodies = [("full (mask-free)" + (", fixed offset" if pallas else ""), "aligned", "full"),
            *([("full, online, lazy (held)", "aligned", "online"),
               ("full, online, rescaling", "aligned", "online_rescaled")] if pallas else []),
            ("masked, mask function", "split", "masked"),
            ("masked, " + ("padding keys" if pallas else "stored block"), "aligned", "masked")]
  for label, mode, body in bodies:
    row = modes.get(mode, {})
    region = row.get("kernel", {}).get(body) if row.get("ok") else None
    if region is None or full is None:
      continue
    units = dict(zip(row["kernel"]["units"], row["kernel"]["body_use"].get(body, ())))
    busiest = ", ".join(f"{u} {_pct(s)}" for u, s in sorted(units.items(), key=lambda x: -x[1])[:4])
    lines.append(f"{label:<28}{region['bundles']:>9,}{region['bundles'] / full['bundles']:>8.2f}x"
                 f"{region['matmuls']:>9,}{region['exps']:>7,}   {busiest}")
  ok = {m: r for m, r in modes.items() if r.get("ok")}
  if ok:
    kernel = next(iter(ok.values()))["kernel"]
    init = (kernel["row_init"] or {}).get("bundles", 0)
    final = (kernel["row_final"] or {}).get("bundles", 0)
    lines.append(f"{'row init / finalisation':<28}{init:>9,} / {final:,}; loop overhead per "
                 f"grid step {kernel['step_overhead']:,}")
  aligned = modes.get("aligned", {})
  if aligned.get("ok"):
    kernel = aligned["kernel"]
    body = kernel["full"]
    lines += ["", f"full-tile body by unit ({body['bundles']:,} bundles; MXU pushes by operand type: "
                  + ", ".join(f"{t} {n:,}" for t, n in body.get("matmul_types", {}).items()) + ")",
              f"{'unit':<12}{'slots used':>11}{'fewest bundles its work needs':>31}"]
    for unit, share, least in unit_bounds(body["bundles"], kernel["units"],
                                          kernel["body_use"]["full"]):
      if share == 0:
        continue
      lines.append(f"{unit:<12}{share:>11.0%}{least:>31,}")
  dense = modes.get("dense", {}).get("static_bundles")
  lines += ["", f"{'mode':<20}{'tiles full/masked':>19}{'static Mbundles':>16}{'vs dense':>10}"
                f"{'design (v6e, measured)':>24}{'difference':>12}"]
  for mode, row in modes.items():
    if not row.get("ok"):
      lines.append(f"{mode:<20}  {row.get('error', '')}")
      continue
    ratio = row["static_bundles"] / dense if dense else None
    design = DESIGN_MS[mode] / DESIGN_MS["dense"] if mode in DESIGN_MS else None
    label = "MaxDiffusion flash" if mode == "maxdiffusion_flash" else mode
    lines.append(f"{label:<20}{row['tiles_full']:>9,}/{row['tiles_masked']:<9,}"
                 f"{row['static_bundles'] / 1e6:>16.2f}"
                 f"{'' if ratio is None else f'{ratio:.2f}':>10}"
                 f"{'' if design is None else f'{design:.2f}':>24}"
                 f"{'' if None in (ratio, design) else f'{ratio - design:+.2f}':>12}")
  lines.append("design: the seed design's 720p latencies over its dense Splash (quoted; "
               "78.70 ms dense)")
  lines += _against_maxdiffusion_custom(result)
  flash = modes.get("maxdiffusion_flash", {})
  if flash.get("ok"):
    blocks = flash["case"]
    lines.append(f"MaxDiffusion flash: its dense Splash at its v6e Wan blocks {blocks['block_q']}x"
                 f"{blocks['block_kv']}, kv step {blocks['block_kv_compute']}, scoped VMEM "
                 f"{blocks['vmem_limit_kib'] // 1024} MiB; sparse modes against it: " + ", ".join(
                     f"{m} {modes[m]['static_bundles'] / flash['static_bundles']:.2f}"
                     for m in MODES if modes.get(m, {}).get("ok")))
  return "\n".join(lines)


def _per_kpairs(row: dict[str, Any], body: str) -> float | None:
  region = (row.get("kernel") or {}).get(body)
  case = row["case"]
  return None if not region else region["bundles"] / (case["block_q"] * case["block_kv"] / 1000)


def _against_maxdiffusion_custom(result: dict[str, Any]) -> list[str]:
  """Bodies per 1,000 query-key pairs, and our calls against MaxDiffusion's fixed-m kernel."""
  modes = result["modes"]
  base_name = "maxdiffusion_custom_fixed_m fast recipe"
  base = modes.get(base_name, {})
  if not base.get("ok"):
    return []
  lines = ["", "full-tile bodies, bundles per 1,000 query-key pairs (and the body's other paths):"]
  for name, row in modes.items():
    if not row.get("ok") or (name not in MODES and name != "dense" and
                             not name.startswith("maxdiffusion_custom")):
      continue
    if name in MODES and name != "aligned":
      continue
    case = row["case"]
    label = "ours" if name == "aligned" else name.replace("maxdiffusion_custom", "MaxDiffusion custom")
    parts = [f"full {_per_kpairs(row, 'full'):.2f}"]
    if (row["kernel"].get("online") or None) is not None:
      parts.append(f"online {_per_kpairs(row, 'online'):.2f}")
    if (row["kernel"].get("online_rescaled") or None) is not None:
      parts.append(f"online rescaling {_per_kpairs(row, 'online_rescaled'):.2f}")
    lines.append(f"  {label} ({case['block_q']}x{case['block_kv']}/{case['block_kv_compute']}): "
                 + ", ".join(parts))
  lines.append(f"per call against MaxDiffusion's fixed-m kernel at its fast recipe "
               f"({base['static_bundles'] / 1e6:.2f} M bundles; every head on its fixed path):")
  for name in [*MODES, "dense"]:
    row = modes.get(name, {})
    if row.get("ok"):
      online = row.get("static_bundles_online")
      lines.append(f"  {name:<9}{row['static_bundles'] / base['static_bundles']:>6.2f}" + (
          "" if online is None else
          f"   (heads on online softmax: {online / base['static_bundles']:.2f})"))
  return lines
