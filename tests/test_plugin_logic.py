"""The plugin's pure logic, with small stand-ins for MaxDiffusion (which CI cannot install)."""

import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import PartitionSpec as P

from maxdiffusion_svg.plugin.kernel import qkv_layout

# The logical names MaxDiffusion gives self-attention's q ([B, H, S, D]), and rules in the
# shape of its Wan configs': heads on (context, tensor), no rule for the sequence.
SELF_ATTN_Q = ("activation_batch", "activation_self_attn_heads",
               "activation_self_attn_q_length", "activation_kv")
WAN_RULES = (("batch", ("data", "fsdp")), ("activation_batch", ("data", "fsdp")),
             ("activation_self_attn_heads", ("context", "tensor")),
             ("activation_length", "context"), ("heads", "tensor"))


@pytest.mark.parametrize("rules, want", [
    (WAN_RULES, P(("data", "fsdp"), None, "context", None)),
    ((("activation_batch", "data"),) + WAN_RULES, P("data", None, "context", None)),
    ((("activation_batch", None),) + WAN_RULES, P(None, None, "context", None)),
    (WAN_RULES + (("activation_kv", "tensor"),), P(("data", "fsdp"), None, "context", "tensor")),
])
def test_the_qkv_layout_is_the_rules_with_ulysses_heads_and_sequence(rules, want):
  """Heads whole and the sequence on context whatever the rules say of them (as pyconfig's
  ulysses rules); the batch and head dims as the config's rules map them."""
  with nn_partitioning.axis_rules(rules):
    assert qkv_layout(SELF_ATTN_Q) == want
