"""Calls as a user makes them, in a fresh process: one compilation from the first call on, and
compiling for a topology leaves the process environment alone."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from maxdiffusion_svg.tpu.aot import libtpu_available


def run_fresh(code: str) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "XLA_FLAGS"))}
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=env, timeout=600, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def test_the_first_jitted_svg_call_is_the_only_compilation():
  """With ``auto`` on this CPU host both executors are traced; nothing the first trace loads
  may change the tracing context of the next (it once recompiled the whole call)."""
  result = run_fresh("""
      import json
      import jax, jax.numpy as jnp
      from maxdiffusion_svg import SvgConfig, VideoGrid, svg_attention
      grid = VideoGrid(4, 6, 10)
      config = SvgConfig.from_mapping({"svg_density": 0.3})
      f = jax.jit(lambda q, k, v, key: svg_attention(q, k, v, grid=grid, config=config, key=key))
      q = jnp.ones((1, 2, grid.tokens, 32), jnp.float32)
      for i in range(6):
        f(q, q * 0.5, q, jax.random.key(i)).block_until_ready()
      print(json.dumps({"compiled": f._cache_size()}))
  """)
  assert result == {"compiled": 1}


@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")
def test_compiling_for_a_topology_leaves_the_environment_alone():
  result = run_fresh("""
      import json, os
      import jax
      jax.devices()  # JAX's own start-up (it may note that this host has no TPU chips)
      before = dict(os.environ)
      from maxdiffusion_svg.tpu.aot import topology_devices
      devices = topology_devices("v5e:1x1")
      after = dict(os.environ)
      print(json.dumps({"kind": devices[0].device_kind,
                        "changed": sorted(k for k in set(before) | set(after)
                                          if before.get(k) != after.get(k))}))
  """)
  assert result == {"kind": "TPU v5 lite", "changed": []}
