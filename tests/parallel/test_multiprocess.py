"""Two JAX processes of four CPU devices each, as two hosts of a slice: the same results as one
process of eight (maxdiffusion_svg.parallel.multiprocess)."""

import os
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.parallel.multiprocess import ProcessesFailed, run_processes
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.routing.semantic import Seed
from multiprocess_workers import carried_calls, sharded_config, sharded_inputs

TESTS = str(pathlib.Path(__file__).parents[1])
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
CALLS = [(0, 0), (3, 0), (3, 2), (5, 1)]  # dense, dense (layer 0), sparse, sparse


def single_process(grid_shape, batch, seed, mesh_shape, semantic=False):
  grid, qkv = sharded_inputs(grid_shape, batch, seed)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "fsdp", "context", "tensor"))
  sharding = NamedSharding(mesh, P(("data", "fsdp"), None, "context", None))
  q, k, v = (jax.device_put(x, sharding) for x in qkv)
  run = jax.jit(lambda q, k, v, step, layer, *seed: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=grid, config=sharded_config(semantic), key=jax.random.key(7),
      step=step, layer=layer, seed=Seed(*seed) if seed else None))
  return carried_calls(run, (q, k, v), CALLS + [(6, 1)] * semantic, semantic)


# semantic: the three layouts, each call's centroids seeding the next (cold, then warm)
@pytest.mark.parametrize("batch,mesh_shape,semantic", [(2, (1, 1, 8, 1), False),
                                                       (2, (2, 1, 4, 1), False),
                                                       (2, (2, 1, 4, 1), True)])
def test_two_processes_equal_one_with_traced_step_and_layer(tmp_path, batch, mesh_shape, semantic):
  args = {"grid": (6, 8, 16), "batch": batch, "seed": 3, "mesh": mesh_shape,
          "calls": CALLS + [(6, 1)] * semantic, "out": str(tmp_path / "out.npy"),
          "semantic": semantic}
  infos = run_processes("multiprocess_workers:sharded_svg", 2, devices_per_process=4,
                        args=args, env=ENV, timeout=240)
  for info in infos:  # each process saw the global mesh and compiled once for all four calls
    assert info == {"traces": 1, "process_count": 2, "devices": 8, "local_devices": 4,
                    "addressable_shards": 4}
  got = np.load(tmp_path / "out.npy")
  want, centroids = single_process(args["grid"], batch, args["seed"], mesh_shape, semantic)
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert not np.allclose(got[0], got[2])  # the dense and the sparse branch both ran
  if semantic:  # the carried centroids too, after a cold and two warm sparse calls
    np.testing.assert_allclose(np.load(tmp_path / "out.npy.centroids.npy"), centroids, atol=1e-5)


def test_a_failing_process_is_reported_with_every_log():
  with pytest.raises(ProcessesFailed, match=r"(?s)failed.*--- process 0 .*--- process 1 "):
    run_processes("multiprocess_workers:no_such_function", 2, env=ENV, timeout=60)


def test_the_others_run_on_when_asked():
  """kill_on_failure=False: a test can see that every process fails (or not) by itself."""
  with pytest.raises(ProcessesFailed) as failed:
    run_processes("multiprocess_workers:fail_first", 2, args=2, env=ENV, timeout=60,
                  initialize=False, kill_on_failure=False)
  first, second = failed.value.results
  assert first.returncode == 1 and "process 0 fails" in first.log
  assert (second.returncode, second.value) == (0, "done")


def test_time_is_bounded():
  with pytest.raises(ProcessesFailed, match=r"did not finish in 5 s"):
    run_processes("multiprocess_workers:sleep", 2, args=60, env=ENV, timeout=5)
