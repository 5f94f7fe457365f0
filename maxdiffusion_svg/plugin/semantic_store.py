"""The semantic layout's warm start across denoising steps, held by a prepared Wan model.

MaxDiffusion's jitted forward takes the model's state and returns only the noise prediction; its
``lax.scan`` loop carries latents and the scheduler state. Centroids that step t leaves for step
t+1 therefore live in the model itself, in mutable arrays (``jax.Ref``, nnx variables with
``ref=True``): they enter every forward as inputs like the rest of the state, a semantic call
reads its layer's and writes its own, so no signature changes. Per model (each Wan 2.2 expert its
own): ``[layers, heads, clusters, head_dim]`` float32 centroids and a ``[layers]`` ready flag,
which setting a run's timesteps clears (each run starts cold and is reproducible).

MaxDiffusion's AOT cache describes an executable by ``Lowered.out_info``, which JAX cannot give
where inputs hold mutable arrays: with ``aot_cache_dir`` set the store is left out and every step
clusters cold (:data:`NO_WARM_START_WITH_AOT`, logged).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxdiffusion_svg.plugin.settings import PluginSettings
from maxdiffusion_svg.routing.semantic import Seed

NO_WARM_START_WITH_AOT = ("warm start off: aot_cache_dir is set (MaxDiffusion's AOT cache cannot "
                          "hold the mutable arrays that carry the centroids), every step clusters "
                          "cold")


class SvgSemanticCentroids(nnx.Variable):
  """Each layer's and head's k-means centroids of the keys, ``[num_layers, heads, clusters,
  head_dim]`` float32, in a mutable array."""


class SvgSemanticReady(nnx.Variable):
  """``[num_layers]`` int32: whether the layer's centroids are from this run (1) or not yet
  (0: the cold start runs)."""


STORES = (SvgSemanticCentroids, SvgSemanticReady)


def _replicated(mesh: Any) -> Any:
  """How a store's value is placed: on ``mesh``, replicated; on a compile-only topology's mesh
  (ahead-of-time compiles for TPUs this host does not have), its shape alone: a compile lowers
  the forward with the store as mutable arrays made from abstract inputs
  (:func:`maxdiffusion_svg.bench.wan_aot.compile_forward`)."""
  if mesh is None:
    return lambda x: x
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  if not set(mesh.devices.flat) <= set(jax.devices()):
    return lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return lambda x: jax.device_put(x, sharding)


def attach(model: Any, settings: PluginSettings, mesh: Any = None) -> None:
  """Gives ``model`` its store where its settings ask for warm starts (semantic among the
  layouts, ``svg_semantic_warm_iterations`` above 0), replicated over ``mesh`` if given."""
  svg = settings.svg
  if svg.semantic is None or not svg.semantic_warm_iterations:
    return
  heads, head_dim = model.config.num_attention_heads, model.config.attention_head_dim
  put = _replicated(mesh)
  model.svg_semantic_centroids = SvgSemanticCentroids(
      put(jnp.zeros((model.num_layers, heads, svg.semantic_clusters, head_dim), jnp.float32)),
      ref=True)
  model.svg_semantic_ready = SvgSemanticReady(
      put(jnp.zeros((model.num_layers,), jnp.int32)), ref=True)


def refs(model: Any) -> tuple[Any, Any] | None:
  """The model's (centroids, ready) mutable arrays, if it holds them."""
  if getattr(model, "svg_semantic_centroids", None) is None:
    return None
  return model.svg_semantic_centroids.get_raw_value(), model.svg_semantic_ready.get_raw_value()


def reset(model: Any) -> None:
  """Marks a model's centroids stale: its next run starts cold."""
  store = refs(model)
  if store is not None and isinstance(store[1], jax.Ref):  # not a compile's shapes
    store[1][...] = jnp.zeros_like(store[1][...])


def seed(store: tuple[Any, Any], layer: jax.Array, batch: int) -> Seed:
  """A call's warm start: its layer's centroids for every example of the batch."""
  stored, ready = store
  return Seed(jnp.broadcast_to(stored[layer][None], (batch, *stored.shape[1:])), ready[layer] > 0)


def write(store: tuple[Any, Any], layer: jax.Array, clusters: jax.Array, active: Any) -> None:
  """Keeps a call's centroids ``[B, H, C, D]`` for its layer's next step: their mean over the
  batch (CFG's two halves are one video); the layer is ready once a sparse call ran."""
  stored, ready = store
  stored[layer] = jnp.mean(clusters, axis=0)
  ready[layer] = jnp.maximum(ready[layer], jnp.asarray(active, jnp.int32))
