"""The drift guard (maxdiffusion_svg.plugin.contract) against stand-in MaxDiffusion modules: each
kind of drift fails at once, naming the function, expected vs found and the tested commit.

The stand-ins are built from ``contract.EXPECTED``, so they only show that the check tells a
drifted module from a conforming one. Whether ``EXPECTED`` is what the real MaxDiffusion has is
checked against its signatures in tests/integration/test_contract_maxdiffusion.py; whether it is
what the plugin calls, here, read from the plugin's own source."""

import ast
import inspect
import pathlib
import types

import pytest

from maxdiffusion_svg.plugin import PluginSettings, contract, hooks


def _fn(*names, var_keyword=False):
  """A function with exactly these parameters."""
  params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
  if var_keyword:
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))

  def fn(*args, **kwargs):
    del args, kwargs
  fn.__signature__ = inspect.Signature(params)
  return fn


def stand_ins():
  """Modules shaped as MaxDiffusion 7cfb8801d41d is, as far as the plugin relies on it."""
  def cls(**methods):
    return type("C", (), methods)
  modules = {}
  for expected in contract.EXPECTED:
    module = modules.setdefault(expected.module, types.SimpleNamespace())
    owner, _, attr = expected.name.rpartition(".")
    fn = _fn(*expected.leading, *[k for k in expected.keywords if k not in expected.leading])
    if owner:
      existing = getattr(module, owner, None) or cls()
      setattr(existing, attr, fn)
      setattr(module, owner, existing)
    else:
      setattr(module, attr, fn)
  return modules


def test_stand_ins_shaped_as_expected_pass():
  """The baseline the drift cases below change one thing of."""
  modules = stand_ins()
  contract.check(modules.__getitem__)


def _keywords_of_calls(path: pathlib.Path, function: str, callee: str) -> list[list[str]]:
  """The keyword names of every call of ``callee`` inside ``function`` in ``path``'s source."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
  return [[k.arg for k in node.keywords] for node in ast.walk(fn)
          if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == callee]


def test_the_dispatcher_keywords_are_exactly_what_the_kernel_passes():
  """APPLY_ATTENTION_KEYWORDS is what the guard checks MaxDiffusion's dispatcher for; read the
  keywords off the kernel's call itself, so adding or dropping one there cannot go unchecked."""
  source = pathlib.Path(inspect.getfile(contract)).with_name("kernel.py")
  (passed,) = _keywords_of_calls(source, "dense_attention", "_apply_attention")
  assert None not in passed  # no **kwargs: every keyword is named
  assert len(passed) == len(set(passed))
  assert sorted(passed) == sorted(contract.APPLY_ATTENTION_KEYWORDS)
  # The reader itself: it sees a keyword added to a call.
  assert _keywords_of_calls(pathlib.Path(__file__), "_probe", "_apply_attention") == [["a", "b"]]


def _probe(module):
  return module._apply_attention(a=1, b=2)  # pylint: disable=protected-access


def test_a_missing_function_is_named():
  modules = stand_ins()
  del modules["maxdiffusion.models.attention_flax"]._reshape_heads_to_head_dim
  with pytest.raises(contract.MaxDiffusionDrift,
                     match=r"attention_flax._reshape_heads_to_head_dim should exist.*"
                           r"tested with MaxDiffusion 7cfb8801d41d"):
    contract.check(modules.__getitem__)


def test_a_missing_module_is_named():
  def lookup(name):
    raise ImportError(f"No module named {name!r}")
  with pytest.raises(contract.MaxDiffusionDrift, match=r"WanModel.__call__ should exist, found "
                                                       r"ImportError"):
    contract.check(lookup)


def test_renamed_leading_parameters_are_shown_both_ways():
  modules = stand_ins()
  pipeline = modules["maxdiffusion.pipelines.wan.wan_pipeline"]
  pipeline.create_sharded_logical_transformer = _fn("devices", "mesh", "rngs", "config")
  with pytest.raises(contract.MaxDiffusionDrift,
                     match=r"create_sharded_logical_transformer should start with parameters "
                           r"\(devices_array, mesh, rngs, config, restored_checkpoint, "
                           r"subfolder\), found \(devices, mesh, rngs, config\).*reads the svg "
                           r"keys before weights load"):
    contract.check(modules.__getitem__)


def test_a_dropped_keyword_of_the_dispatcher_is_named():
  modules = stand_ins()
  attention = modules["maxdiffusion.models.attention_flax"]
  keywords = [k for k in contract.APPLY_ATTENTION_KEYWORDS if k != "ulysses_shards"]
  attention._apply_attention = _fn(*keywords)
  with pytest.raises(contract.MaxDiffusionDrift, match=r"_apply_attention should accept "
                                                       r"ulysses_shards"):
    contract.check(modules.__getitem__)
  attention._apply_attention = _fn("query", "key", "value", var_keyword=True)  # takes any
  contract.check(modules.__getitem__)


def test_not_callable_is_drift():
  modules = stand_ins()
  modules["maxdiffusion.aot_cache"].install = "disabled"
  with pytest.raises(contract.MaxDiffusionDrift, match=r"aot_cache.install should be callable, "
                                                       r"found str"):
    contract.check(modules.__getitem__)


# ------------------------------------------------ the model's layout the hooks rely on


def _op(name):
  return types.SimpleNamespace(residual_checkpoint_name=name)


def _model(names, scan=False):
  blocks = [types.SimpleNamespace(attn1=types.SimpleNamespace(attention_op=_op(n)))
            for n in names]
  return types.SimpleNamespace(scan_layers=scan, blocks=blocks, num_layers=len(blocks))


def test_prepare_tags_each_self_attention_op():
  model = hooks.prepare_transformer(_model(["self_attn", "self_attn"]),
                                    PluginSettings.from_mapping({}))
  assert [int(b.attn1.attention_op.svg_layer[...]) for b in model.blocks] == [0, 1]


def test_a_changed_self_attention_name_is_drift_before_the_model_is_touched():
  model = _model(["self_attn", "attn"])
  with pytest.raises(contract.MaxDiffusionDrift,
                     match=r"attn1.attention_op with residual_checkpoint_name 'self_attn'.*"
                           r"found SimpleNamespace with 'attn'"):
    hooks.prepare_transformer(model, PluginSettings.from_mapping({}))
  assert not hasattr(model, "svg_settings") and not hasattr(model.blocks[0].attn1.attention_op,
                                                            "svg_layer")


def test_a_model_without_blocks_is_drift():
  with pytest.raises(contract.MaxDiffusionDrift, match=r"SimpleNamespace has no blocks"):
    hooks.prepare_transformer(types.SimpleNamespace(scan_layers=False, num_layers=2),
                              PluginSettings.from_mapping({}))


def test_experts_carry_a_tag_of_their_own_shape():
  """MaxDiffusion's AOT cache keys executables by input shapes: the experts' must differ."""
  settings = PluginSettings.from_mapping({})
  shapes = {expert: hooks.prepare_transformer(_model(["self_attn"]), settings,
                                              expert).svg_expert_tag[...].shape
            for expert in ("high_noise", "low_noise")}
  assert shapes["high_noise"] != shapes["low_noise"]
  assert not hasattr(hooks.prepare_transformer(_model(["self_attn"]), settings), "svg_expert_tag")
