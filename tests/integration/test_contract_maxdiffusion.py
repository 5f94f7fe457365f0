"""The drift guard's expectations against the real MaxDiffusion: its signatures, and exactly
the functions the hooks wrap."""

import importlib
import inspect

import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.plugin import contract, hooks, installer


def real(expected: contract.Expected):
  obj = importlib.import_module(expected.module)
  for part in expected.name.split("."):
    obj = getattr(obj, part)
  return inspect.unwrap(obj, stop=lambda f: not getattr(f, "_svg_hook", False))


def test_the_real_maxdiffusion_meets_the_plugins_expectations():
  contract.check()


@pytest.mark.parametrize("expected", contract.EXPECTED, ids=lambda e: e.where)
def test_each_expectation_is_the_real_signature(expected):
  """Leading parameters as MaxDiffusion declares them, and every keyword the plugin passes a
  named parameter (not swallowed by a ``**kwargs`` that would hide a rename)."""
  params = inspect.signature(real(expected)).parameters
  names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
  assert names[:len(expected.leading)] == list(expected.leading)
  assert [k for k in expected.keywords if k not in names] == []
  if expected.keywords:  # the plugin supplies every parameter the function requires
    required = [n for n, p in params.items()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert [n for n in required if n not in expected.keywords] == []


def test_the_hooks_wrap_exactly_what_the_contract_names(monkeypatch):
  """Every function install() wraps has an expectation (subclasses' ``__call__`` under
  ``WanPipeline.__call__``'s), and every hook expectation is wrapped."""
  wrapped = []
  original = hooks.wrap_once

  def recording(owner, name, make):
    module = owner.__module__ if isinstance(owner, type) else owner.__name__
    qualified = f"{owner.__qualname__}.{name}" if isinstance(owner, type) else name
    wrapped.append((module, qualified, owner))
    original(owner, name, make)

  monkeypatch.setattr(hooks, "wrap_once", recording)
  installer.install()
  named = {(e.module, e.name) for e in contract.EXPECTED}
  pipeline = importlib.import_module(contract.WAN_PIPELINE).WanPipeline
  for module, qualified, owner in wrapped:
    if isinstance(owner, type) and issubclass(owner, pipeline) and qualified.endswith(".__call__"):
      contract.check_one(contract.Expected(module, qualified, "a Wan pipeline's call",
                                           leading=("self",)), importlib.import_module)
      continue
    assert (module, qualified) in named, (module, qualified)
  calls = {(m, q) for m, q, _ in wrapped}
  if any(q.endswith(".__call__") and issubclass(o, pipeline) for _, q, o in wrapped
         if isinstance(o, type)):  # the pipelines' calls, wrapped where each defines one
    calls.add((contract.WAN_PIPELINE, "WanPipeline.__call__"))
  re_entered = {"_apply_attention", "_reshape_heads_to_head_dim", "register_kernel"}
  assert {n for n in named if n[1] not in re_entered} <= calls
