"""Collective counting from HLO text: every printed replica-group form, and a real program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from maxdiffusion_svg.bench.hlo import collective_stats

HLO = """
  %all-to-all = (f32[1,2,8,8]{3,2,1,0}, f32[1,2,8,8]{3,2,1,0}) all-to-all(%a, %b), channel_id=1, replica_groups=mesh['data'=1,'fsdp'=2,'context'=2,'tensor'=2] {'context'}, metadata={}
  %all-gather.3 = bf16[8,128]{1,0} all-gather(%x), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}
  %all-reduce.1 = f32[256]{0} all-reduce(%y), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  ROOT %all-reduce.2 = s32[] all-reduce(%z), channel_id=4, replica_groups={}, to_apply=%add
  %collective-permute = f32[4,4]{1,0} collective-permute(%w), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %reduce-scatter = f32[16]{0} reduce-scatter(%r), channel_id=6, replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-start = (f32[2,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%s), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done = f32[16,8]{1,0} all-gather-done(%all-gather-start)
  %fusion = f32[1,2,8,8]{3,2,1,0} fusion(%all-to-all), kind=kLoop, calls=%fused
"""


def test_each_form_of_replica_groups_and_each_kind():
  stats = collective_stats(HLO, num_devices=8)
  assert stats["all-to-all"] == {"count": 1, "bytes": 2 * 128 * 4 * (1 / 2)}  # group: context=2
  assert stats["all-gather"] == {"count": 2, "bytes": 8 * 128 * 2 * 3 / 4 + 16 * 8 * 4 * 7 / 8}
  assert stats["all-reduce"] == {"count": 2, "bytes": 2 * 1024 * 1 / 2 + 2 * 4 * 7 / 8}
  assert stats["collective-permute"] == {"count": 1, "bytes": 64.0}
  assert stats["reduce-scatter"] == {"count": 1, "bytes": 64 * 7}


def test_a_compiled_all_to_all_is_counted_with_its_bytes():
  if jax.device_count() < 8:
    pytest.skip("needs the 8 simulated devices tests/conftest.py asks for")
  mesh = Mesh(np.array(jax.devices()[:8]), ("context",))
  fn = jax.jit(jax.shard_map(
      lambda x: jax.lax.all_to_all(x, "context", 0, 1, tiled=True) * 2, mesh=mesh,
      in_specs=P(None, "context"), out_specs=P("context", None)))
  x = jnp.zeros((64, 64), jnp.float32)  # 64x8 per device
  stats = collective_stats(fn.lower(x).compile().as_text(), 8)
  assert stats == {"all-to-all": {"count": 1, "bytes": 64 * 8 * 4 * 7 / 8}}
