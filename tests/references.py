"""Float64 references the tests share (small shapes only)."""

import numpy as np


def compensated_reference(q, k, v, plan, blocks, scale=None):
  """Compensation's rule in float64, pair by pair and block by block (small shapes only)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s, d = q.shape[2], q.shape[3]
  scale = d ** -0.5 if scale is None else scale
  logits = np.where(np.asarray(plan.dense_mask()), np.einsum("bhqd,bhkd->bhqk", q, k) * scale,
                    -np.inf)
  visited = plan.tile_map() != 0
  size = plan.block_kv // blocks
  keys, values, logs, tiles = [], [], [], []
  for start in range(0, s, size):  # sub-blocks holding at least one real key
    stop = min(start + size, s)
    keys.append(k[:, :, start:stop].mean(axis=2))
    values.append(v[:, :, start:stop].mean(axis=2))
    logs.append(np.log(stop - start))
    tiles.append(start // plan.block_kv)
  extra = np.einsum("bhqd,bhnd->bhqn", q, np.stack(keys, 2)) * scale + np.array(logs)
  sees = ~visited[np.arange(s)[:, None] // plan.block_q, np.array(tiles)[None, :]]
  extra = np.where(sees, extra, -np.inf)
  both = np.concatenate([logits, extra], axis=-1)
  weights = np.exp(both - both.max(axis=-1, keepdims=True))
  weights /= weights.sum(axis=-1, keepdims=True)
  return np.einsum("bhqk,bhkd->bhqd", weights, np.concatenate([v, np.stack(values, 2)], axis=2))
