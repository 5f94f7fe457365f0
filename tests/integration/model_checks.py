"""Checks shared by the per-model integration tests (LTX-2, Wan VACE, Wan Animate): each model's
calls are compared with an independent recomputation by the library, and its pipeline's run
summary read from the log MaxDiffusion prints."""

import collections
from typing import Any, Callable

import jax
import numpy as np
import pytest

from maxdiffusion_svg import plugin

from maxdiffusion_svg.call.attention import scheduled_svg_attention
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plugin.settings import PluginSettings
from maxdiffusion_svg.testing import tiny_wan

EVERYTHING = {"svg_active_steps": [0, None], "svg_active_layers": [0, None]}


def kinds(log):
  return collections.Counter(r["kind"] for r in log)


def rel(a, b):
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def assert_close(got, want, atol=1e-5):
  np.testing.assert_allclose(got, want, atol=atol * np.abs(want).max())


def assert_calls_are_svg(log, grid: VideoGrid, density: float, **keys: Any) -> None:
  """Each logged self-attention call (every step and layer active) equals the library's SVG of
  its own q, k, v on ``grid`` at ``density`` (the tiny models' test keys, and ``keys``), and is
  sparse."""
  svg = PluginSettings.from_mapping({**tiny_wan.BASE_KEYS, "svg_density": density,
                                     **EVERYTHING, **keys}).svg
  selfs = [r for r in log if r["kind"] == "self"]
  assert selfs and all(r["sparse"] and r["density"] == density for r in selfs)
  for record in selfs:
    q, k, v, out = record["qkv_out"]
    assert q.shape[2] == grid.tokens, (q.shape, grid)
    kwargs = {"grid": grid, "step": 0, "layer": record["layer"], "expert": None,
              "scale": q.shape[-1] ** -0.5}
    want = np.asarray(scheduled_svg_attention(q, k, v, config=svg, **kwargs))
    assert_close(out, want)
    full = np.asarray(scheduled_svg_attention(q, k, v, config=svg.at_density(1.0), **kwargs))
    assert rel(out, full) > 1e-3  # really sparse


def summary_lines(capsys):
  """The run summaries the pipeline logged (max_logging prints)."""
  return [line for line in capsys.readouterr().out.splitlines()
          if "maxdiffusion_svg: run summary" in line]


class CachedForward:
  """A tiny model family's transformer called on fixed inputs, with the svg kernel's call log
  (arrays kept), built and run once per (devices, attention, keys): ``forward(tmp_path_factory,
  devices, attention, **keys)`` returns ``(*outputs, log)``; ``run(model, mesh, config)`` makes
  the call (one output or a tuple)."""

  def __init__(self, tiny: Any, run: Callable[[Any, Any, Any], Any]):
    self._tiny, self._run, self._results = tiny, run, {}

  def build(self, tmp_path_factory, devices: int, attention: str, **keys):
    """``(config, (device array, mesh), transformer)`` as the pipeline builds them."""
    config = self._tiny.init_config(self._tiny.write_config(
        str(tmp_path_factory.mktemp("config")), attention=attention, **keys))
    mesh = self._tiny.make_mesh(config, devices)
    return config, mesh, self._tiny.build_transformer(config, mesh)

  def __call__(self, tmp_path_factory, devices: int, attention: str, **keys):
    cache_key = repr((devices, attention, sorted(keys.items())))
    if cache_key not in self._results:
      config, mesh, model = self.build(tmp_path_factory, devices, attention, **keys)
      with plugin.record_calls(arrays=True) as log:
        outputs = self._run(model, mesh[1], config)
        jax.effects_barrier()
      outputs = outputs if isinstance(outputs, tuple) else (outputs,)
      self._results[cache_key] = (*(np.asarray(o) for o in outputs), log)
    return self._results[cache_key]


class FamilyBattery:
  """What every model family passes through its tiny transformer's forward: svg at density 1
  equals the model's dense kernel, at 0.3 each call is the library's SVG of its own q, k, v on
  the family's grid (sparse), and sharded over 8 devices it equals one device. A subclass per
  family sets ``forward`` (a :class:`CachedForward`, outputs first, the call log last),
  ``grid``, ``layers`` and ``other_calls`` (the forward's calls besides video self-attention,
  by kind: dense by design). Each family's own pipeline test (one compile, the schedule, the
  run summary's counts) stays beside its subclass."""

  forward: CachedForward
  grid: VideoGrid
  layers: int
  other_calls: dict

  def selfs(self, log):
    return [(r["layer"], r["sparse"]) for r in log if r["kind"] == "self"]

  @pytest.mark.full  # each family's CI-tier test runs it through its pipeline
  def test_density_one_equals_the_dense_kernel(self, tmp_path_factory):
    *dense, _ = self.forward(tmp_path_factory, 1, "dot_product")
    *svg, log = self.forward(tmp_path_factory, 1, "svg", svg_density=1.0, **EVERYTHING)
    for got, want in zip(svg, dense):
      assert_close(got, want)
    assert kinds(log) == {"self": self.layers, **self.other_calls}
    assert self.selfs(log) == [(layer, True) for layer in range(self.layers)]

  @pytest.mark.full
  def test_sparse_at_0_3_is_the_svg_of_the_calls_own_qkv_on_the_grid(self, tmp_path_factory):
    dense = self.forward(tmp_path_factory, 1, "dot_product")[0]
    sparse, *_, log = self.forward(tmp_path_factory, 1, "svg", svg_density=0.3, **EVERYTHING)
    assert 1e-3 < rel(sparse, dense) < 0.1, rel(sparse, dense)
    assert self.selfs(log) == [(layer, True) for layer in range(self.layers)]
    assert_calls_are_svg(log, self.grid, 0.3)

  @pytest.mark.full
  def test_sharded_over_8_devices_equals_one_device(self, tmp_path_factory):
    *one, _ = self.forward(tmp_path_factory, 1, "svg", svg_density=0.3, **EVERYTHING)
    *eight, log = self.forward(tmp_path_factory, 8, "svg", svg_density=0.3, **EVERYTHING)
    for got, want in zip(eight, one):
      assert_close(got, want)
    assert kinds(log) == {"self": self.layers, **self.other_calls}
