"""Output PSNR of svg_attention with the `prefix` and `stratified` router pools.

Usage: python scripts/pool_comparison.py
Two cases on the quality benchmark's grid: stationary planted heads (spatial, temporal,
unstructured) and drifting heads alone (spatial in the first quarter of the frames,
temporal after). Mean over 5 router keys; density 0.35, aligned, 256x256 tiles.
"""

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg import SvgConfig, svg_attention
from maxdiffusion_svg.bench.quality import PREFIX_SHARE, QualityBenchConfig, psnr
from maxdiffusion_svg.bench.synthetic import planted_qkv
from maxdiffusion_svg.kernels import dense_attention

GRID = QualityBenchConfig().grid
CASES = {
    "stationary": ("spatial",) * 6 + ("temporal",) * 6 + ("unstructured",) * 4,
    "drifting only": ("drifting",) * 4,
}

for name, types in CASES.items():
  q, k, v = (jnp.asarray(x) for x in planted_qkv(GRID, types, 64, seed=0))
  dense = np.asarray(dense_attention(q, k, v))
  for pool in ("prefix", "stratified"):
    cfg = SvgConfig(density=0.35, block_q=256, block_kv=256, backend="xla", profile_pool=pool,
                    sample_max_row=round(PREFIX_SHARE * GRID.tokens))
    run = jax.jit(lambda q, k, v, key, cfg=cfg: svg_attention(q, k, v, grid=GRID, config=cfg,
                                                               key=key, return_info=True))
    scores, temporal = [], []
    for seed in range(5):
      out, info = run(q, k, v, jax.random.key(seed))
      scores.append(psnr(np.asarray(out), dense))
      temporal.append(float(np.asarray(info["temporal"]).mean()))
    print(f"{name:<14} {pool:<11} PSNR {np.mean(scores):6.2f} dB   temporal heads "
          f"{100 * np.mean(temporal):5.1f}%")
