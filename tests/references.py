"""Float64 references the tests share (small shapes only)."""

import jax
import jax.numpy as jnp
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


def masked_loss64(mask, w, u=None):
  """``sum(out * w) [+ sum(lse * u)]`` of dense attention under ``mask`` (broadcast to [B, H,
  S, S]), in float64."""
  def loss(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = jnp.where(mask, s, -jnp.inf)
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
    total = (out * w).sum()
    return total if u is None else total + (jax.nn.logsumexp(s, axis=-1) * u).sum()
  return loss


def reference_grads(loss, *xs):
  with jax.enable_x64(True):
    grads = jax.grad(loss, argnums=tuple(range(len(xs))))(*(np.asarray(x, np.float64) for x in xs))
    return [np.asarray(g) for g in grads]


def assert_grads_close(got, want, atol):
  for name, a, b in zip("qkv", got, want):
    assert np.abs(b).max() > 0.1, name  # a gradient that could fail
    np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=atol, rtol=2e-5,
                               err_msg=f"d{name}")
