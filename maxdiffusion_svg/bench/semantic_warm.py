"""``bench semantic-warm``: how many k-means updates a semantic head needs cold and warm.

SVG2 keeps its clustering affordable by starting each denoising step from the previous step's
centroids. This measures that on the tiny random Wan (needs MaxDiffusion): the real denoising
loop with semantic heads, every self-attention call's keys captured. For each step ``t >= 1``
and layer, the reference is a converged clustering of step t's keys (:data:`CONVERGED` updates
from the deterministic start). Each count of updates is then judged against it, started cold
(evenly spaced tokens, as a run's first call) or warm (step ``t - 1``'s converged centroids, as
the plugin carries them): the share of token pairs the two clusterings put together or apart
alike (1: the same assignment up to the cluster names) and the k-means objective's excess.
Measured on CPU; random weights, so the keys drift as the latents do, not as a trained model's.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

CONVERGED = 50  # updates of the reference clustering
AGREEMENT = 0.99  # "the same assignment": this share of token pairs agrees
_PAIRS = 50_000


def pair_agreement(a: np.ndarray, b: np.ndarray, seed: int = 0) -> float:
  """Share of sampled token pairs two assignments ``[..., S]`` treat alike (same cluster in
  both, or different in both), per head, averaged."""
  a, b = (np.asarray(x).reshape(-1, np.shape(x)[-1]) for x in (a, b))
  i, j = np.random.default_rng(seed).integers(0, a.shape[1], (2, _PAIRS))
  return float(np.mean((a[:, i] == a[:, j]) == (b[:, i] == b[:, j])))


def objective(x: np.ndarray, assign: np.ndarray) -> float:
  """Mean squared distance of each token to its cluster's mean (the k-means objective)."""
  x = np.asarray(x, np.float64)
  total = 0.0
  for head, labels in zip(x.reshape(-1, *x.shape[-2:]), np.asarray(assign).reshape(-1, x.shape[-2])):
    for c in np.unique(labels):
      members = head[labels == c]
      total += float(np.sum((members - members.mean(0)) ** 2))
  return total / (x.size / x.shape[-1])


def compare_counts(keys: list[np.ndarray], clusters: int, counts: tuple[int, ...]) -> dict[str, Any]:
  """Cold and warm clusterings of each ``keys[t]`` (``[B, H, S, D]``, consecutive steps of one
  layer), ``t >= 1``, against the converged one: per update count, the mean agreement and the
  objective's excess over the reference."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.routing.semantic import Seed, kmeans  # pylint: disable=import-outside-toplevel
  rows = {"cold": {n: [] for n in counts}, "warm": {n: [] for n in counts}}
  excess = {"cold": {n: [] for n in counts}, "warm": {n: [] for n in counts}}
  previous = kmeans(jnp.asarray(keys[0]), clusters, CONVERGED)[1]
  for k in keys[1:]:
    k = jnp.asarray(k)
    assign, centroids, _ = kmeans(k, clusters, CONVERGED)
    best = objective(k, assign)
    for n in counts:
      runs = {"cold": kmeans(k, clusters, n)[0],
              "warm": kmeans(k, clusters, n, seed=Seed(previous, jnp.bool_(True)),
                             warm_iterations=n)[0]}
      for how, got in runs.items():
        rows[how][n].append(pair_agreement(got, assign))
        excess[how][n].append(objective(k, got) / best - 1.0)
    previous = centroids
  mean = lambda table: {n: float(np.mean(v)) for n, v in table.items()}
  return {"agreement": {how: mean(t) for how, t in rows.items()},
          "objective_excess": {how: mean(t) for how, t in excess.items()}}


def run_warm_bench(steps: int = 10, clusters: int = 16, counts: tuple[int, ...] = (1, 2, 4, 8),
                   log: Callable[[str], None] = print) -> dict[str, Any]:
  """The tiny Wan's denoising loop with every head semantic, then :func:`compare_counts` over
  its layers; JSON-ready. Needs MaxDiffusion on the path."""
  import tempfile  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  from maxdiffusion_svg import plugin  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.testing import tiny_wan  # pylint: disable=import-outside-toplevel
  plugin.register()
  with tempfile.TemporaryDirectory(prefix="svg_warm_") as tmp:
    config = tiny_wan.init_config(tiny_wan.write_config(
        tmp, attention="svg", svg_density=0.3, svg_active_steps=[0, None],
        svg_active_layers=[0, None], num_inference_steps=steps, svg_layouts="[semantic]",
        svg_semantic_clusters=clusters))
    mesh = tiny_wan.make_mesh(config, min(8, jax.device_count()))
    pipeline = tiny_wan.pipeline_2_1(config, mesh, tiny_wan.build_transformer(config, mesh))
    _, text = tiny_wan.inputs(batch=1)
    log(f"tiny Wan: {steps} steps, keys of every self-attention call captured...")
    with plugin.record_calls(arrays=True) as calls:
      tiny_wan.generate(pipeline, steps, text, guidance_scale=5.0)
      jax.effects_barrier()
  calls = [r for r in calls if r["kind"] == "self"]
  layers = sorted({r["layer"] for r in calls})
  per_layer = {}
  for layer in layers:
    keys = [r["qkv_out"][1] for r in sorted((r for r in calls if r["layer"] == layer),
                                            key=lambda r: r["step"])]
    log(f"layer {layer}: clustering {len(keys)} steps' keys cold and warm...")
    per_layer[layer] = compare_counts(keys, clusters, counts)
  table = {how: {n: float(np.mean([per_layer[l]["agreement"][how][n] for l in layers]))
                 for n in counts} for how in ("cold", "warm")}
  excess = {how: {n: float(np.mean([per_layer[l]["objective_excess"][how][n] for l in layers]))
                  for n in counts} for how in ("cold", "warm")}
  needed = {how: next((n for n in counts if table[how][n] >= AGREEMENT), None) for how in table}
  return {"kind": "measured on CPU (tiny random Wan 2.1)", "steps": steps, "clusters": clusters,
          "tokens": int(calls[0]["qkv_out"][1].shape[2]) if calls else 0,
          "reference_updates": CONVERGED, "agreement_target": AGREEMENT, "counts": list(counts),
          "agreement": table, "objective_excess": excess, "updates_needed": needed}


def format_warm_bench(result: dict[str, Any]) -> str:
  lines = [f"semantic k-means, cold vs warm ({result['kind']}): {result['steps']} steps, "
           f"{result['tokens']} tokens, {result['clusters']} clusters; against {result['reference_updates']}"
           f" updates from the cold start, per step t >= 1 and layer",
           f"{'updates':>8}{'cold agree':>12}{'warm agree':>12}{'cold obj+':>11}{'warm obj+':>11}"]
  for n in result["counts"]:
    a, e = result["agreement"], result["objective_excess"]
    lines.append(f"{n:>8}{a['cold'][n]:>12.4f}{a['warm'][n]:>12.4f}{e['cold'][n]:>10.2%}"
                 f"{e['warm'][n]:>10.2%}")
  need = result["updates_needed"]
  lines.append(f"updates to {result['agreement_target']:.0%} pair agreement: cold "
               f"{need['cold'] or 'more than ' + str(result['counts'][-1])}, warm "
               f"{need['warm'] or 'more than ' + str(result['counts'][-1])}")
  return "\n".join(lines)


__all__ = ["compare_counts", "format_warm_bench", "pair_agreement", "run_warm_bench"]
