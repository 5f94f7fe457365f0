"""Functions the multi-process tests run in each JAX process
(maxdiffusion_svg.parallel.multiprocess).

Every process builds the same NumPy inputs and places its own shards with
``make_array_from_callback``, as each host of a slice would; process 0 saves the gathered output.
"""

import numpy as np


def sharded_config(semantic=False):
  """The multi-process tests' config; ``semantic``: the three layouts, 4 clusters."""
  from maxdiffusion_svg.budgets.config import SvgConfig  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.budgets.schedule import Interval, Schedule  # pylint: disable=import-outside-toplevel
  layouts = dict(layouts=["spatial", "temporal", "semantic"], semantic_clusters=4,
                 semantic_warm_iterations=1) if semantic else {}
  return SvgConfig(block_q=128, block_kv=128, backend="xla", profile_queries=16, density=0.3,
                   schedule=Schedule(Interval(2, None), Interval(1, None)), **layouts)


def carried_calls(run, arrays, calls, semantic, gather=np.asarray):
  """``run(q, k, v, step, layer[, centroids, ready])`` over ``calls``; with ``semantic`` each
  call's centroids seed the next, as the plugin carries them (the batch's mean, ready once a
  sparse call ran). The outputs (and the last centroids), gathered."""
  b, h = arrays[0].shape[:2]
  # NumPy: a host value every process holds alike (a replicated input of the jitted call)
  centroids, ready, outputs = np.zeros((b, h, 4, arrays[0].shape[3]), np.float32), False, []
  for step, layer in calls:
    if not semantic:
      outputs.append(gather(run(*arrays, np.int32(step), np.int32(layer))))
      continue
    out, clusters = run(*arrays, np.int32(step), np.int32(layer), centroids, np.bool_(ready))
    outputs.append(gather(out))
    centroids = np.ascontiguousarray(np.broadcast_to(np.mean(gather(clusters), axis=0),
                                                     clusters.shape))
    ready = ready or (step >= 2 and layer >= 1)
  return np.stack(outputs), (centroids if semantic else None)


def sharded_inputs(grid_shape, batch, seed):
  from maxdiffusion_svg.bench.synthetic import planted_qkv  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.plan.geometry import VideoGrid  # pylint: disable=import-outside-toplevel
  types = ("spatial", "temporal", "temporal", "spatial", "temporal", "spatial", "spatial",
           "temporal")
  grid = VideoGrid(*grid_shape)
  return grid, planted_qkv(grid, types, head_dim=32, seed=seed, batch=batch)


def sharded_svg(index, args):
  """Scheduled ``sharded_svg_attention`` with traced step and layer on the global mesh."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.parallel.sharding import sharded_svg_attention  # pylint: disable=import-outside-toplevel
  grid, qkv = sharded_inputs(args["grid"], args["batch"], args["seed"])
  mesh = Mesh(np.array(jax.devices()).reshape(args["mesh"]), ("data", "fsdp", "context", "tensor"))
  sharding = NamedSharding(mesh, P(("data", "fsdp"), None, "context", None))
  arrays = [jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx]) for x in qkv]
  traces = []
  semantic = args.get("semantic", False)
  config = sharded_config(semantic)
  from maxdiffusion_svg.routing.semantic import Seed  # pylint: disable=import-outside-toplevel

  def fn(q, k, v, step, layer, *seed):
    traces.append(1)
    return sharded_svg_attention(q, k, v, mesh=mesh, grid=grid, config=config,
                                 key=jax.random.key(7), step=step, layer=layer,
                                 seed=Seed(*seed) if seed else None)

  outputs, centroids = carried_calls(
      jax.jit(fn), arrays, args["calls"], semantic,
      lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)))
  if index == 0:
    np.save(args["out"], outputs)
    if semantic:
      np.save(args["out"] + ".centroids.npy", centroids)
  return {"traces": len(traces), "process_count": jax.process_count(),
          "devices": jax.device_count(), "local_devices": jax.local_device_count(),
          "addressable_shards": len(arrays[0].addressable_shards)}


def sleep(index, seconds):
  """Never finishes within the test's timeout."""
  del index
  import time  # pylint: disable=import-outside-toplevel
  time.sleep(seconds)


def fail_first(index, seconds):
  """Process 0 fails at once; the others finish after ``seconds``."""
  if index == 0:
    raise RuntimeError("process 0 fails")
  import time  # pylint: disable=import-outside-toplevel
  time.sleep(seconds)
  return "done"


def ring_svg(index, args):
  """Scheduled ``sharded_svg_attention`` on a context axis split Ulysses x ring, for each case
  ``(mesh shape, ulysses_shards, batch)``: traced step and layer, one compile per case."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.parallel.sharding import sharded_svg_attention  # pylint: disable=import-outside-toplevel
  config = sharded_config()
  results, traces = {}, []
  for case, (mesh_shape, ulysses, batch) in enumerate(args["cases"]):
    grid, qkv = sharded_inputs(args["grid"], batch, args["seed"])
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("data", "fsdp", "context", "tensor"))
    sharding = NamedSharding(mesh, P(("data", "fsdp"), None, "context", None))
    arrays = [jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx]) for x in qkv]

    def fn(q, k, v, step, layer, mesh=mesh, grid=grid, ulysses=ulysses):
      traces.append(case)
      return sharded_svg_attention(q, k, v, mesh=mesh, grid=grid, config=config,
                                   key=jax.random.key(7), step=step, layer=layer,
                                   ulysses_shards=ulysses)

    run = jax.jit(fn)
    results[f"case{case}"] = np.stack([
        np.asarray(multihost_utils.process_allgather(run(*arrays, np.int32(s), np.int32(l)),
                                                     tiled=True))
        for s, l in args["calls"]])
  if index == 0:
    np.savez(args["out"], **results)
  return {"traces": len(traces), "process_count": jax.process_count(),
          "devices": jax.device_count()}
