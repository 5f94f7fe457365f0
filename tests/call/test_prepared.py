"""The prepared call: every decision before the data made once, in one object, and the call path
only reading it (maxdiffusion_svg.call.prepared)."""

import collections
import contextlib
import os
import pathlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from maxdiffusion_svg import SvgConfig, VideoGrid
from maxdiffusion_svg.call.attention import (prepared_scheduled_attention, prepared_svg_attention,
                                             scheduled_svg_attention, svg_attention)
from maxdiffusion_svg.call.prepared import prepare, prepare_on
from maxdiffusion_svg.parallel.sharding import sharded_svg_attention
from maxdiffusion_svg.plan.target import Target, target_for_call, tpu_target

GRID = VideoGrid(frames=4, height=8, width=16)
CONFIG = SvgConfig(density=0.5, block_q=128, block_kv=128)
PACKAGE = pathlib.Path(__file__).parents[2] / "maxdiffusion_svg"


def inputs(batch=1, heads=2, dim=128):
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(key, (batch, heads, GRID.tokens, dim)) for key in keys]


@contextlib.contextmanager
def walk():
  """The package's modules a traced call enters, by file name, in order (one entry per function
  call)."""
  entered = []
  prefix = f"{PACKAGE}{os.sep}"

  def profile(frame, event, _):
    # every Python call of the trace comes here: a string test, not a Path, keeps it cheap
    if event == "call" and frame.f_code.co_filename.startswith(prefix):
      entered.append((pathlib.Path(frame.f_code.co_filename).name, frame.f_code.co_name))

  sys.setprofile(profile)
  try:
    yield entered
  finally:
    sys.setprofile(None)


def stays(entered):
  """Consecutive calls in one module are one stay."""
  return [module for i, (module, _) in enumerate(entered) if i == 0 or entered[i - 1][0] != module]


def traced_walk(fn, *args):
  """The modules ``fn`` enters while traced (a new function, so jit traces it afresh)."""
  with walk() as entered:
    jax.jit(lambda *xs: fn(*xs)).lower(*args)
  return entered


def test_a_call_resolves_its_target_once_and_then_only_reads_the_prepared_call():
  q, k, v = inputs()
  run = lambda q, k, v: svg_attention(q, k, v, grid=GRID, config=CONFIG)
  jax.jit(lambda *xs: run(*xs)).lower(q, k, v)  # plans built, prepared call cached
  counts = collections.Counter(stays(traced_walk(run, q, k, v)))
  # auto on a CPU host builds both executors (ours for a TPU lowering, XLA's): still one stay
  assert counts["target.py"] == 1
  assert counts["config.py"] == 0  # decided in prepare: tiles, plans, compensation, router
  assert counts["tiling.py"] <= 1  # the backward's kv step (kernels/splash_backward.py)
  call = prepare(CONFIG, GRID)
  prepared = collections.Counter(stays(traced_walk(
      lambda q, k, v: prepared_svg_attention(call, q, k, v), q, k, v)))
  assert prepared["target.py"] == 0 and prepared["config.py"] == 0


def test_a_scheduled_sharded_call_resolves_its_target_once():
  q, k, v = inputs(batch=2, heads=8)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 1, 8, 1), ("data", "fsdp", "context", "tensor"))
  run = lambda q, k, v, step, layer: sharded_svg_attention(
      q, k, v, mesh=mesh, grid=GRID, config=CONFIG, step=step, layer=layer)
  args = (q, k, v, np.int32(3), np.int32(1))
  jax.jit(lambda *xs: run(*xs)).lower(*args)  # plans built, prepared call cached
  entered = traced_walk(run, *args)
  assert collections.Counter(stays(entered))["target.py"] == 1
  assert [f for m, f in entered if m == "target.py"][0] == "resolve_call"


def test_branches_are_the_configs_own_decisions():
  host = target_for_call()  # this CPU host, nothing pinned: both executors behind the lowering
  call = prepare(CONFIG, GRID)
  assert call.target == host
  assert [b.backend for b in call.branches] == ["pallas", "xla"]
  tpu, xla = call.branches
  assert tpu.target.is_tpu and tpu.target.speculative and not tpu.target.known
  assert xla.target == host and call.host is xla
  for branch in call.branches:
    assert branch.tiles == CONFIG.tiles(branch.target, branch.backend)
    assert branch.plan is CONFIG.plan(GRID, None, branch.target, branch.backend)  # cached plans
    assert branch.dense_plan is CONFIG.dense_plan(GRID, branch.target, branch.backend)
    assert branch.kernel.plan is branch.plan and branch.dense_kernel.plan is branch.dense_plan
    assert branch.kernel.tpu == tpu.target  # a TPU lowering is held to the strictest limits
  on_v6e = prepare(CONFIG, GRID, target=tpu_target("v6e"))
  (branch,) = on_v6e.branches
  assert branch.backend == "pallas" and branch.target.generation.name == "v6e"
  assert branch.kernel.on_tpu and not branch.kernel.follows_lowering
  (xla_only,) = prepare(SvgConfig(density=0.5, block_q=128, block_kv=128, backend="xla"),
                        GRID).branches
  assert xla_only.backend == "xla"


def test_expert_density_and_compensation_are_prepared():
  config = SvgConfig(density=0.5, high_noise_density=0.25, block_q=128, block_kv=128,
                     compensation=True, compensation_blocks=4)
  target = Target("cpu")
  high = prepare_on(config, GRID, target, "high_noise").host
  assert high.plan is config.plan(GRID, "high_noise", target)
  assert high.compensation_blocks == 4
  shared = prepare_on(config, GRID, target).host.plan
  assert shared is config.plan(GRID, None, target)
  assert high.plan.stats.visited_tiles < shared.stats.visited_tiles  # 0.25 against 0.5
  with pytest.raises(ValueError, match="expert must be one of"):
    prepare(config, GRID, "middle_noise")


def test_prepared_calls_are_cached_and_a_ring_leaves_semantic_out():
  assert prepare(CONFIG, GRID) is prepare(CONFIG, GRID)
  semantic = SvgConfig(density=0.5, block_q=128, block_kv=128,
                       layouts=("spatial", "temporal", "semantic"))
  call = prepare(semantic, GRID)
  assert call.semantic is not None
  ring = call.on_ring(ulysses=2, ring=2)
  assert ring.semantic is None and ring.branches is call.branches
  assert call.on_ring(ulysses=8, ring=1) is call


def test_the_prepared_path_is_the_public_one():
  q, k, v = inputs()
  call = prepare(CONFIG, GRID)
  key = jax.random.key(3)
  np.testing.assert_array_equal(prepared_svg_attention(call, q, k, v, key=key),
                                svg_attention(q, k, v, grid=GRID, config=CONFIG, key=key))
  for step in (0, 40):  # the moderate preset: dense, then sparse
    np.testing.assert_array_equal(
        prepared_scheduled_attention(call, q, k, v, step=step, layer=2, key=key),
        scheduled_svg_attention(q, k, v, grid=GRID, config=CONFIG, step=step, layer=2, key=key))
