"""bench step --on-chip without a chip: the run's arithmetic from timed steps, the scaling of a
model timed at fewer layers, the profile's parts by named scope, the stand-in weights."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from maxdiffusion_svg.bench import step_chip

CASE = step_chip.StepCase("t", "configs/wan_svg_1_3b.yml", 480, 832)


def _rows(layers=30, dense=(("fixed", 10.0), ("flash", 12.0))):
  rows = [{"kernel": k, "preset": None, "layers": layers, "step_s": s} for k, s in dense]
  rows.append({"kernel": "svg", "preset": "moderate", "layers": layers, "steps": 30,
               "sparse_steps": 24, "sparse_step_s": 5.0, "dense_step_s": 10.5})
  return rows


def test_the_run_is_the_schedules_steps_added_up_against_the_fastest_dense_kernel():
  figures = step_chip.case_figures(CASE, _rows(), 30)
  assert figures["fastest_dense"] == "fixed" and not figures["scaled"]
  f = figures["presets"]["moderate"]
  assert f["run_s"] == pytest.approx(24 * 5.0 + 6 * 10.5)
  assert f["step_speedup"] == pytest.approx(2.0)
  assert f["run_speedup"] == pytest.approx(30 * 10.0 / (24 * 5.0 + 6 * 10.5))
  assert f["vs_flash"]["step_speedup"] == pytest.approx(12.0 / 5.0)
  assert f["vs_fixed"]["dense_step_ratio"] == pytest.approx(1.05)


def test_a_model_timed_at_two_layer_counts_is_scaled_to_its_depth():
  one, two = _rows(1, (("fixed", 1.5),)), _rows(2, (("fixed", 2.0),))
  for row in two:  # each extra layer: 0.5 s dense, 0.2 s sparse
    if row["kernel"] == "svg":
      row.update(sparse_step_s=5.2, dense_step_s=10.5 + 0.5)
  figures = step_chip.case_figures(CASE, one + two, 40)
  assert figures["scaled"]
  assert figures["dense_steps_s"]["fixed"] == pytest.approx(1.5 + 39 * 0.5)
  assert figures["presets"]["moderate"]["sparse_step_s"] == pytest.approx(5.0 + 39 * 0.2)


def test_device_ops_are_parted_by_their_named_scopes():
  hlo = "\n".join([
      '  %fusion.1 = f32[2] fusion(%p), metadata={op_name="jit(f)/cond/branch_1_fun/svg_route/dot_general"}',
      '  ROOT %copy.7 = bf16[2] copy(%x), metadata={op_name="jit(f)/svg_place/transpose"}',
      '  %svg_pallas_sparse.5 = bf16[2] custom-call(%a), metadata={op_name="jit(f)/svg_kernel/svg_pallas_sparse/pallas_call"}',
      '  %fusion.3 = f32[2] fusion(%q), metadata={op_name="jit(f)/svg_kernel/reduce_max"}',
      '  %svg_pallas_sparse.4 = bf16[2] custom-call(%a), metadata={op_name="jit(f)/svg_dense/svg_pallas_sparse/pallas_call"}',
      '  %fusion.9 = bf16[2] fusion(%b), metadata={op_name="jit(f)/WanModel/gelu/dot_general"}',
      '  %recv-done.12 = token[] recv-done(%r), metadata={op_name="jit(f)/apply_attention/debug_callback"}',
      '  %param.1 = bf16[2] parameter(0)'])
  scopes = step_chip.op_scopes(hlo)
  assert set(scopes) == {"fusion.1", "copy.7", "svg_pallas_sparse.5", "fusion.3",
                         "svg_pallas_sparse.4", "fusion.9", "recv-done.12"}
  assert step_chip.part_of(scopes["recv-done.12"]) == "ours: the run summary's host callbacks"
  assert [step_chip.part_of(scopes[n]) for n in ("fusion.1", "copy.7", "svg_pallas_sparse.5",
                                                  "fusion.3", "svg_pallas_sparse.4",
                                                  "fusion.9")] == [
      "ours: routing", "ours: placement", step_chip.KERNEL, step_chip.PREPASS,
      "self-attention kernel (ours, dense)", step_chip.OTHER]


def test_the_parts_printed_and_ours_outside_the_kernel():
  """A stored profile's kernel-with-prepass part is split by its Pallas calls; the share of
  ours outside the kernel sums the parts that are ours."""
  stored = {"device_s": 10.0, "parts_s": {
      "self-attention kernel (ours, with its XLA prepass)": 4.5, step_chip.OTHER: 3.5,
      "ours: routing": 0.5, "ours: placement": 1.0},
      "top_ops": [{"name": "svg_pallas_sparse.5", "seconds": 4.0,
                   "part": "self-attention kernel (ours, with its XLA prepass)"},
                  {"name": "fusion.3", "seconds": 0.5,
                   "part": "self-attention kernel (ours, with its XLA prepass)"}]}
  parts = step_chip.step_parts(stored)
  assert parts[step_chip.KERNEL] == 4.0 and parts[step_chip.PREPASS] == pytest.approx(0.5)
  lines = step_chip.format_parts("moderate", stored)
  assert lines[-1] == "    ours outside the kernel: 2.000 s, 20.0% of the step"
  assert lines[1].split() == ["self-attention", "kernel", "(ours)", "4.000", "s", "40.0%"]


def test_stand_in_weights_are_ones_for_norm_scales_zeros_for_biases_else_small():
  assert np.all(np.asarray(step_chip.random_param(("blocks", "norm2", "scale"), (8,),
                                                  jnp.bfloat16, 0)) == 1)
  assert np.all(np.asarray(step_chip.random_param(("proj_out", "bias"), (8,), jnp.float32, 1)) == 0)
  w = np.asarray(step_chip.random_param(("proj_out", "kernel"), (256, 256), jnp.float32, 2))
  assert math.isclose(float(w.std()), 0.02, rel_tol=0.05) and abs(float(w.mean())) < 1e-3


def test_a_profiled_step_writes_its_program_beside_its_trace(tmp_path):
  """On the host no TPU plane is traced (no parts); the program's text is kept all the same."""
  text = '  %copy.1 = bf16[2] copy(%x), metadata={op_name="jit(f)/svg_place/transpose"}'
  profile = step_chip.profile_step(lambda: jnp.ones(3) + 1, str(tmp_path), lambda: text)
  assert (tmp_path / "step.hlo.txt").read_text() == text
  assert profile.get("parts_s", {}) == {} or "error" in profile
