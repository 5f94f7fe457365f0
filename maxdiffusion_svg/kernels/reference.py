"""Dense attention references: the ground truth for tests and the router (small shapes only)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxdiffusion_svg.plan.tiles import TilePlan


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None) -> jax.Array:
  """Plain XLA softmax attention over ``[B, H, S, D]``, float32 logits; output in q's dtype."""
  return masked_attention(q, k, v, None, scale=scale)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Any, *,
                     scale: float | None = None) -> jax.Array:
  """Float32 softmax attention under a boolean ``[S_q, S_kv]`` (or broadcastable) mask; empty rows
  give zeros. Materialises the scores: tests and small shapes only."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  logits = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * scale
  if mask is not None:
    logits = jnp.where(mask, logits, -jnp.inf)
  peak = jnp.max(logits, axis=-1, keepdims=True)
  weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
  total = jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights / jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("bhqk,bhkd->bhqd", weights, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  return out.astype(q.dtype)


def plan_reference(q: jax.Array, k: jax.Array, v: jax.Array, plan: TilePlan, *,
                   scale: float | None = None) -> jax.Array:
  """Dense attention under exactly the mask ``plan`` computes (rounded, for aligned plans)."""
  return masked_attention(q, k, v, jnp.asarray(np.asarray(plan.dense_mask())), scale=scale)
