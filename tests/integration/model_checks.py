"""Checks shared by the per-model integration tests (LTX-2, Wan VACE, Wan Animate): each model's
calls are compared with an independent recomputation by the library, and its pipeline's run
summary read from the log MaxDiffusion prints."""

import collections

import numpy as np

from maxdiffusion_svg.attention import scheduled_svg_attention
from maxdiffusion_svg.geometry import VideoGrid
from maxdiffusion_svg.plugin.settings import PluginSettings
from maxdiffusion_svg.testing import tiny_wan

EVERYTHING = {"svg_active_steps": [0, None], "svg_active_layers": [0, None]}


def kinds(log):
  return collections.Counter(r["kind"] for r in log)


def rel(a, b):
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def assert_close(got, want, atol=1e-5):
  np.testing.assert_allclose(got, want, atol=atol * np.abs(want).max())


def assert_calls_are_svg(log, grid: VideoGrid, density: float) -> None:
  """Each logged self-attention call (every step and layer active) equals the library's SVG of
  its own q, k, v on ``grid`` at ``density`` (the tiny models' test keys), and is sparse."""
  svg = PluginSettings.from_mapping({**tiny_wan.BASE_KEYS, "svg_density": density,
                                     **EVERYTHING}).svg
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
