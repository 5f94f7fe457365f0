"""The end-of-run line's counts: the callbacks' tally and the schedule's, against brute force."""

import itertools

import pytest

from maxdiffusion_svg.budgets.config import SvgConfig
from maxdiffusion_svg.budgets.schedule import Interval, Schedule
from maxdiffusion_svg.plugin import run_summary
from maxdiffusion_svg.plugin.settings import PluginSettings


def test_the_tally_merges_devices_and_reports_per_layer_range():
  run_summary.reset()
  tally = run_summary._TALLY  # pylint: disable=protected-access
  layers, devices = 8, 4
  for step, layer in itertools.product(range(3), range(layers)):
    active = step >= 1 and layer >= 2
    for device in range(devices):  # each device: its 2 heads; temporal on layers >= 4, device 0
      temporal = 2 if active and layer >= 4 and device == 0 else 0
      tally.add(active, step, layer, temporal, 2)
  counts = run_summary.counted_calls(layers)
  assert (counts.sparse, counts.dense, counts.counted) == (2 * 6, 24 - 12, True)
  # sparse calls' heads: 12 calls x 8 heads; temporal: 2 steps x 4 layers x 2 heads
  assert counts.temporal_share == pytest.approx(16 / 96)
  assert counts.by_range == ((2, 3, 0.0), (4, 5, 0.25), (6, 7, 0.25))  # layers 0-1: no sparse
  line = run_summary.summary_line(counts, 3, layers, "kernel svg on xla", 6.0)
  assert "24 self-attention calls, 12 sparse and 12 dense (counted)" in line
  assert "temporal heads 16.7% of the sparse calls' heads (layers 2-3 0%, layers 4-5 25%" in line
  assert line.endswith("2.000 s per step (denoising 6.0 s)")
  run_summary.reset()
  assert run_summary.counted_calls(layers).sparse == 0


@pytest.mark.parametrize("steps_window, layers_window, min_seq, tokens", [
    ((3, None), (1, 30), 0, 1000),
    ((0, 2), (0, None), 0, 1000),
    ((60, None), (0, None), 0, 1000),  # an empty window: nothing sparse
    ((0, None), (0, None), 4096, 1000),  # too short: all dense
])
def test_counts_from_the_schedule_match_brute_force(steps_window, layers_window, min_seq, tokens):
  schedule = Schedule(Interval(*steps_window), Interval(*layers_window))
  settings = PluginSettings(svg=SvgConfig(schedule=schedule), min_seq_length=min_seq)
  steps, layers = 50, 40
  counts = run_summary.scheduled_calls(settings, steps, layers, tokens)
  want = 0 if tokens < min_seq else sum(
      bool(schedule.is_active(s, l)) for s in range(steps) for l in range(layers))
  assert (counts.sparse, counts.dense, counts.counted) == (want, steps * layers - want, False)
  line = run_summary.summary_line(counts, steps, layers, "k", None, "svg_run_summary: false")
  assert "(from the schedule, not counted (svg_run_summary: false))" in line
  assert "temporal heads" not in line


def test_run_summary_key_is_validated():
  with pytest.raises(ValueError, match="svg_run_summary must be true or false"):
    PluginSettings.from_mapping({"svg_run_summary": "yes"})
  assert PluginSettings.from_mapping({"svg_run_summary": False}).run_summary is False


@pytest.mark.parametrize("keys, says", [
    ({}, "compensation off"),
    ({"svg_compensation": True, "svg_compensation_blocks": 4}, "compensation 4 centroids per key tile"),
])
def test_the_kernel_part_of_the_line_says_the_compensation(keys, says):
  """Both Wan 2.2 experts share one svg_compensation: said once, after their densities."""
  import types  # pylint: disable=import-outside-toplevel
  settings = PluginSettings.from_mapping({"svg_high_noise_density": 0.5, **keys})
  models = [types.SimpleNamespace(svg_settings=settings, svg_expert=expert)
            for expert in ("high_noise", "low_noise")]
  text = run_summary._kernel(models, None)  # pylint: disable=protected-access
  assert text.endswith(f"high_noise density 0.5, low_noise density 0.3, {says}")
  line = run_summary.summary_line(run_summary.CallCounts(1, 1, True), 1, 2, text, None)
  assert line.endswith(says)


def test_other_calls_run_as_often_as_the_self_attention_traced_beside_them():
  """Each traced call runs once per run of its forward, like the counted self-attention calls
  traced with it: 3 blocks of (self, cross, cross) and a VACE block of (vace, cross) per
  forward, 10 forwards: 30 counted self-attention calls."""
  run_summary.reset()
  tally = run_summary._TALLY  # pylint: disable=protected-access
  traced = run_summary.Traced()
  for _ in range(3):
    for reason in (None, "cross", "cross"):
      traced.add(reason)
  traced.add("vace")
  traced.add("cross")
  for step, layer in itertools.product(range(10), range(3)):
    for _ in range(2):  # two devices report each call
      tally.add(True, step, layer, 0, 2)
  counts = run_summary.counted_calls(3, traced=[traced])
  assert counts.other_dense == (("cross", 70), ("vace", 10))
  assert counts.repeated(2).other_dense == (("cross", 140), ("vace", 20))
  line = run_summary.summary_line(counts, 10, 3, "k", None)
  assert line.endswith("other attention calls dense: 70 cross, 10 vace (cross-attention runs "
                       "svg_dense_kernel)")
  # two experts' forwards (Wan 2.2), traced alike: their counts add up
  assert run_summary.other_dense([traced, traced], 30) == (("cross", 70), ("vace", 10))
  assert run_summary.other_dense([run_summary.Traced()], 30) == ()
  short = run_summary.Traced()  # a short video's self-attention, run dense, is still one
  short.add("short")
  assert (short.self_calls, short.dense) == (1, {})
  run_summary.reset()


@pytest.mark.parametrize("platforms, missing", [
    ("tpu", True), ("tpu,cuda", True), (" tpu ", True),
    ("tpu,cpu", False), ("cpu", False), ("", False), (None, False)])
def test_host_callbacks_need_jaxs_cpu_backend(platforms, missing):
  """JAX hands a callback its operands on a CPU device: JAX_PLATFORMS naming others but not cpu
  (a TPU VM's ``tpu``) leaves none, and the reason names the variable and its fix."""
  why = run_summary.host_callbacks_missing("" if platforms is None else platforms)
  assert bool(why) == missing
  if missing:
    assert why.startswith(f"JAX_PLATFORMS={platforms} leaves JAX no CPU device")
    assert why.endswith(f"(JAX_PLATFORMS={platforms},cpu counts them)")
