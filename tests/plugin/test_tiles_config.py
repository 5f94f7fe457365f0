"""`tiles --config` as a pre-flight: each check refuses or warns with the key named, in the words
of the function the run itself calls; flags that do not apply are refused; Wan 2.2's experts
split the steps; the whole-run and end-to-end figures equal a hand computation."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

from maxdiffusion_svg.cli.main import main
from maxdiffusion_svg.kernels.api import sparse_attention
from maxdiffusion_svg.plan.geometry import grid_for_resolution
from maxdiffusion_svg.plan.target import tpu_target
from maxdiffusion_svg.plan.tiles import plan_tiles
from maxdiffusion_svg.plugin import preflight
from maxdiffusion_svg.plugin.wan22 import expert_steps
from maxdiffusion_svg.tpu.step_prices import STEP_PRICES

WAN14B = {"model_name": "wan2.1", "attention": "svg", "num_frames": 81, "height": 720,
          "width": 1280, "num_inference_steps": 50, "activations_dtype": "bfloat16",
          "pretrained_model_name_or_path": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
          # MaxDiffusion's Wan mesh keys (base_wan_14b.yml)
          "mesh_axes": ["data", "fsdp", "context", "tensor"], "ici_data_parallelism": 1,
          "ici_fsdp_parallelism": 1, "ici_context_parallelism": -1, "ici_tensor_parallelism": 1,
          "dcn_data_parallelism": 1, "dcn_fsdp_parallelism": 1, "dcn_context_parallelism": -1,
          "dcn_tensor_parallelism": 1}
WAN22 = {**WAN14B, "model_name": "wan2.2", "num_inference_steps": 40, "boundary_ratio": 0.875,
         "flow_shift": 12.0, "pretrained_model_name_or_path": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
         "svg_high_noise_density": 0.5, "svg_low_noise_density": 0.2,
         "svg_active_steps": [11, -1], "svg_active_layers": [1, -1]}


def tiles(tmp_path, capsys, config, *args):
  """(exit code, stdout, stderr, the JSON or None) of `tiles --config` on ``config``."""
  path, out = tmp_path / "config.yml", tmp_path / "estimate.json"
  path.write_text(json.dumps(config))  # JSON is YAML
  out.unlink(missing_ok=True)
  code = main(["tiles", "--config", str(path), *args, "--json", str(out)])
  captured = capsys.readouterr()
  return code, captured.out, captured.err, json.loads(out.read_text()) if out.exists() else None


def run_refusal(fn) -> str:
  with pytest.raises(ValueError) as err:
    fn()
  return str(err.value)


# ------------------------------------------------ the checks, each against the run's own


def test_tiles_the_chip_cannot_hold_are_refused_as_the_run_refuses_them(tmp_path, capsys):
  """8192x2048 tiles on a v5e (16 MiB scoped VMEM): the run's kernel call raises before
  compiling, and the pre-flight says the same."""
  code, out, err, _ = tiles(tmp_path, capsys, WAN14B, "--chip", "v5e", "svg_block_q=8192",
                            "svg_block_kv=2048")
  assert code == 2 and out == ""
  plan = plan_tiles(grid_for_resolution("720p"), 0.3, 8192, 2048, "aligned")
  x = jax.ShapeDtypeStruct((1, 5, plan.seq_len, 128), jnp.bfloat16)
  theirs = run_refusal(lambda: jax.eval_shape(
      lambda q, k, v: sparse_attention(q, k, v, plan, backend="pallas", block_kv_compute=512,
                                       target=tpu_target("v5e", flags="")), x, x, x))
  assert "svg_block_q (8192)" in theirs and "16 MiB scoped-VMEM limit" in theirs
  assert err.strip() == f"error: the run would stop at its first call (sparse plan): {theirs}"
  # The job's raised limit is the run's too: the same tiles then fit.
  code, out, _, result = tiles(tmp_path, capsys, WAN14B, "--chip", "v5e", "svg_block_q=8192",
                               "svg_block_kv=2048",
                               "--libtpu-init-args=--xla_tpu_scoped_vmem_limit_kib=65536")
  assert code == 0 and [fit["plan"] for fit in result["checks"]["kernel"]] == ["sparse", "dense"]
  assert all(fit["vmem"] <= fit["vmem_limit"] == 64 * 2**20 for fit in result["checks"]["kernel"])


def test_context_shards_that_do_not_divide_the_heads_are_refused_on_the_slice(tmp_path, capsys):
  """v6e-16 with the Wan default mesh: 16 context shards, 40 heads. The run's check_job on
  that job gives the same message."""
  code, _, err, _ = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-16")
  job = preflight.Job(process_count=4, device_count=16, local_device_count=4, context_shards=16,
                      heads=40)
  theirs = run_refusal(lambda: preflight.check_job(job, {}))
  assert code == 2 and "ici_data_parallelism" in theirs
  assert err.strip() == f"error: the run would stop before loading weights on a v6e-16: {theirs}"
  code, out, _, result = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-16",
                               "ici_data_parallelism=2")
  assert code == 0 and "40 heads over 8 context shards = 5 per device" in out
  assert result["checks"]["slice"] == {"type": "v6e-16", "devices": 16, "context_shards": 8,
                                       "ulysses_shards": 8, "ring": 1,
                                       "heads_per_device": 5, "layouts_note": "",
                                       "mesh": {"data": 2, "fsdp": 1, "context": 8, "tensor": 1}}
  assert result["target"].startswith("TPU v6e")  # --slice implies the chip


def test_ulysses_shards_split_the_context_axis_on_the_slice(tmp_path, capsys):
  """v6e-32 as configs/wan_svg_v6e32.yml runs it: 2 data x 16 context, ulysses_shards 8 (a ring
  of 2); splash cannot run a ring shard and a ulysses_shards that does not divide the axis is
  refused, each in the run's own words."""
  v6e32 = {**WAN14B, "ici_data_parallelism": 2, "ulysses_shards": 8}
  code, out, _, result = tiles(tmp_path, capsys, v6e32, "--slice", "v6e-32")
  assert code == 0, out
  assert ("40 heads over 16 context shards as ulysses_shards 8 x a ring of 2 = 5 per device"
          in out)
  assert result["checks"]["slice"]["mesh"] == {"data": 2, "fsdp": 1, "context": 16, "tensor": 1}
  assert (result["checks"]["slice"]["ulysses_shards"], result["checks"]["slice"]["ring"]) == (8, 2)
  job = preflight.Job(process_count=8, device_count=32, local_device_count=4, context_shards=16,
                      heads=40)
  for keys, job_keys in (({"svg_backend": "splash"}, {"ulysses_shards": 8, "backend": "splash"}),
                         ({"ulysses_shards": 3}, {"ulysses_shards": 3}),
                         ({"ulysses_shards": -1}, {"ulysses_shards": -1}),
                         ({"svg_layouts": "[semantic]"},
                          {"ulysses_shards": 8, "layouts": ("semantic",)})):
    code, _, err, _ = tiles(tmp_path, capsys, {**v6e32, **keys}, "--slice", "v6e-32")
    theirs = run_refusal(lambda: preflight.check_job(dataclasses.replace(job, **job_keys), {}))
    assert code == 2
    assert err.strip() == f"error: the run would stop before loading weights on a v6e-32: {theirs}"


def test_a_ring_leaves_semantic_out_and_says_so_and_the_clustering_is_priced(tmp_path, capsys):
  """With semantic among the layouts: on v6e-32's ring the warning and the settings line name
  what the ring runs (and the run's pre-flight agrees: no refusal); on v6e-8 (no ring) nothing is
  left out; either way the clustering is priced, cold and warm, against the attention work."""
  semantic = {"svg_layouts": "[spatial, temporal, semantic]", "svg_semantic_warm_iterations": 1}
  note = ("semantic left out on the ring (ulysses_shards 8, sequence split over 2 devices): "
          "layouts [spatial, temporal]")
  code, out, _, result = tiles(tmp_path, capsys, {**WAN14B, "ici_data_parallelism": 2,
                                                   "ulysses_shards": 8, **semantic},
                               "--slice", "v6e-32")
  assert code == 0 and f"warning: {note}" in out and f"({note})" in result["summary"]
  preflight.check_job(preflight.Job(process_count=8, device_count=32, local_device_count=4,
                                    context_shards=16, heads=40, ulysses_shards=8,
                                    layouts=("spatial", "temporal", "semantic")), {})
  code, out, _, result = tiles(tmp_path, capsys, {**WAN14B, **semantic}, "--slice", "v6e-8")
  assert code == 0 and "left out" not in out
  sem = result["semantic"]
  assert (sem["clusters"], sem["group"], sem["cold_iterations"], sem["warm_iterations"]) == (
      32, 8, 4, 1)
  # by hand: 75,600 tokens in 9,450 groups; a strided sample of every stride-th group
  stride = 9450 // (32 * 256)
  sample = -(-9450 // stride)
  assert sem["warm_vs_attention"] < sem["cold_vs_attention"]
  assert sem["cold_vs_attention"] / sem["warm_vs_attention"] == pytest.approx(
      (4 * 2 * sample * 32 + 9450 * 32) / (1 * 2 * sample * 32 + 9450 * 32))
  assert ("semantic layout (32 clusters, tokens in groups of 8): its k-means is 0.07% of a sparse "
          "call's attention multiply-adds (4 iterations, the run's first call per layer; later "
          "steps 1 from the previous step's centroids, 0.02%; computed); what a semantic head "
          "costs is its placement gathers: 1.11x") in out
  code, out, _, result = tiles(tmp_path, capsys, WAN14B)
  assert result["semantic"] is None and "semantic layout" not in out


def test_a_mesh_the_slice_cannot_build_is_refused_naming_the_key(tmp_path, capsys):
  code, _, err, _ = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-8",
                          "ici_context_parallelism=3")
  theirs = run_refusal(lambda: preflight.mesh_shape({**WAN14B, "ici_context_parallelism": 3}, 8))
  assert code == 2 and "ici_context_parallelism 3" in theirs
  assert err.strip() == (f"error: the run would stop building its mesh on a v6e-8 (8 devices): "
                         f"{theirs}")


@pytest.mark.parametrize("args, needle", [
    (["--slice", "v6e-8", "--chip", "v5e"], "--chip v5e contradicts --slice v6e-8 (a v6e "
                                            "slice): drop --chip"),
    (["--slice", "v6e"], "--slice must be a TPU slice type <generation>-<count>"),
])
def test_slice_errors_name_the_flag(tmp_path, capsys, args, needle):
  code, _, err, _ = tiles(tmp_path, capsys, WAN14B, *args)
  assert code == 2 and needle in err


def test_an_empty_sparse_window_warns_and_the_bound_is_one(tmp_path, capsys):
  code, out, _, result = tiles(tmp_path, capsys, WAN14B, "svg_active_steps=[60, -1]")
  warning = ("no self-attention call runs sparse: svg_active_steps [60, end) holds none of the "
             "run's 50 steps (num_inference_steps); give svg_active_steps a start below 50")
  assert code == 0 and result["checks"]["warnings"] == [warning]
  assert f"warning: {warning}" in out.splitlines()
  assert result["combined"]["speedup_bound"] == 1.0
  assert result["end_to_end"]["step_speedup_bound"] == 1.0


def test_a_worst_case_slower_than_the_dense_kernel_warns(tmp_path, capsys):
  """At density 1 every head on online softmax costs more than fixed-m's fixed path: the
  estimate says so; at the shipped density it does not."""
  code, out, _, result = tiles(tmp_path, capsys, {**WAN14B, "svg_density": 1.0},
                               "--slice", "v6e-8")
  online = result["rows"][0]["vs_fixed_m"]["online"]["bound"]
  assert code == 0 and online < 1
  assert (f"  warning: where its heads fail the fixed-offset gate this run is slower than "
          f"ulysses_custom_fixed_m ({online:.2f}x)") in out
  code, out, _, result = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-8")
  assert result["rows"][0]["vs_fixed_m"]["online"]["bound"] >= 1 and "warning" not in out


def test_a_sequence_under_svg_min_seq_length_warns(tmp_path, capsys):
  code, out, _, _ = tiles(tmp_path, capsys, WAN14B, "svg_min_seq_length=100000")
  assert code == 0
  assert "warning: self-attention of 75,600 tokens is shorter than svg_min_seq_length 100000" in out


def test_a_bucket_without_a_run_name_warns_with_the_runs_words(tmp_path, capsys):
  code, out, _, _ = tiles(tmp_path, capsys, {**WAN14B, "output_dir": "gs://bucket/out"})
  theirs = run_refusal(lambda: preflight.check_run_name("gs://bucket/out", ""))
  assert code == 0 and f"warning: {theirs}" in out


def test_a_config_that_runs_no_svg_is_refused(tmp_path, capsys):
  code, _, err, _ = tiles(tmp_path, capsys, {**WAN14B, "attention": "flash"})
  assert code == 2 and err.strip() == (
      "error: attention is 'flash' in the config: it runs no SVG (the plugin prepares a "
      "transformer only under attention: svg); give attention=svg")


# ------------------------------------------------ flags that do not apply


@pytest.mark.parametrize("args, needle", [
    (["--density", "0.25"], "--density does not apply with a config: give svg_density=0.25"),
    (["--resolution", "1080p"], "--resolution does not apply with a config: give num_frames=81 "
                                "height=1088 width=1920"),
    (["--height", "480"], "--height does not apply with a config: give height=480"),
    (["--latent-grid", "21x45x80"], "--latent-grid does not apply with a config: give "
                                    "num_frames, height and width"),
    (["--block-q", "2048"], "--block-q does not apply with a config: give svg_block_q=2048"),
    (["--block-kv", "1024"], "--block-kv does not apply with a config: give svg_block_kv=1024"),
    (["--mode", "split"], "--mode does not apply with a config: give svg_tile_mode=split"),
    (["--no-sink"], "--no-sink does not apply with a config: give svg_include_sink=false"),
    (["--plot", "x.png"], "--plot does not apply with a config: run tiles without a config"),
])
def test_report_flags_are_refused_with_config(tmp_path, capsys, args, needle):
  code, out, err, _ = tiles(tmp_path, capsys, WAN14B, *args)
  assert code == 2 and out == "" and needle in err


@pytest.mark.parametrize("args, needle", [
    (["--slice", "v6e-8"], "--slice needs a config to check"),
    (["--layers", "30"], "--layers needs a config to check"),
    (["--attention-share", "0.5"], "--attention-share needs a config to check"),
    (["--chip", "v5e"], "--chip does not apply without a config: the report's tiles are our "
                        "kernel's, 3328x1536 on every chip"),
    (["--libtpu-init-args=--xla_tpu_scoped_vmem_limit_kib=65536"],
     "--libtpu-init-args does not apply without a config"),
])
def test_config_flags_are_refused_without_config(capsys, args, needle):
  assert main(["tiles", *args]) == 2
  assert needle in capsys.readouterr().err


# ------------------------------------------------ Wan 2.2 and the whole run


def test_wan22_experts_run_their_own_steps_and_the_run_combines_them(tmp_path, capsys):
  """40 steps at flow_shift 12, boundary 0.875: the high-noise expert runs [0, 26) (sparse from
  step 11: 15 steps), the low-noise one [26, 40) (14), each over 39 of 40 layers."""
  code, out, _, result = tiles(tmp_path, capsys, WAN22, "--attention-share", "0.5")
  assert code == 0
  assert expert_steps(WAN22, 40).boundary_step == 26 == result["experts"]["boundary_step"]
  high, low = result["rows"]
  assert (high["first_step"], high["steps"], high["sparse_steps"]) == (0, 26, 15)
  assert (low["first_step"], low["steps"], low["sparse_steps"]) == (26, 14, 14)
  visited = {density: plan_tiles(grid_for_resolution("720p"), density, 3328, 1536,
                                 "aligned").stats.visited_tile_fraction for density in (0.5, 0.2)}
  # By hand: dense calls count 1, sparse calls their visited tiles, over 40 steps x 40 layers.
  dense_calls = 40 * 40 - (15 + 14) * 39
  work = (dense_calls + 15 * 39 * visited[0.5] + 14 * 39 * visited[0.2]) / (40 * 40)
  assert result["combined"]["work_vs_dense"] == pytest.approx(work)
  assert result["combined"]["sparse_call_share"] == pytest.approx(29 * 39 / 1600)
  assert result["combined"]["speedup_bound"] == pytest.approx(1 / work)
  assert high["work_vs_dense"] == pytest.approx(1 - 15 * 39 / 1040 * (1 - visited[0.5]))
  assert "high_noise steps [0, 26), low_noise steps [26, 40)" in out
  assert f"whole run, both experts: 70.7% of self-attention calls sparse; work vs dense " \
         f"{work:.3f} -> attention speed-up at most {1 / work:.2f}x" in out
  # Amdahl at the given share.
  step = 1 / (0.5 + 0.5 * work)
  assert result["end_to_end"] == {"attention_share": 0.5, "source": "given with --attention-share",
                                  "step_speedup_bound": pytest.approx(step),
                                  "priced": {"priced": False, "why": "no slice given (--slice)"}}
  assert (f"cross-check, Amdahl's law: a step at most {step:.2f}x faster if self-attention were "
          f"50.0% of a dense step (given with --attention-share)") in out
  assert "end to end: not priced from a compiled program (no slice given (--slice))" in out


def test_a_step_is_priced_from_the_compiled_forward_for_each_expert(tmp_path, capsys):
  """On a v6e-8 at 720p the step is the compiled forward's XLA (STEP_PRICES) plus each layer's
  kernel calls from its plan, the run both experts' steps (by hand, against fixed-m's)."""
  prices = STEP_PRICES[("Wan", "v6e", 75_600, 40, 5, 2, 1)]
  code, out, _, result = tiles(tmp_path, capsys, WAN22, "--slice", "v6e-8")
  step = result["end_to_end"]["priced"]
  assert code == 0 and step["priced"] and step["source"] == prices.source
  for path in ("fixed", "online"):
    ours = theirs = 0.0
    for row in result["rows"]:
      vs = row["vs_fixed_m"]
      layer_xla = prices.layer_rest
      sparse = (prices.outside + 40 * layer_xla + 39 * (prices.sparse_attention
                                                        + 10 * vs[path]["sparse_call"])
                + 1 * (prices.dense_attention + 10 * vs[path]["dense_call"]))
      dense = prices.outside + 40 * (layer_xla + prices.dense_attention + 10 * vs[path]["dense_call"])
      base = prices.baseline_outside + 40 * (prices.baseline_layer_rest + prices.baseline_attention
                                             + 10 * vs["fixed_m_call"])
      assert step["experts"][row["expert"]][path]["sparse_step"] == pytest.approx(base / sparse)
      ours += row["sparse_steps"] * sparse + (row["steps"] - row["sparse_steps"]) * dense
      theirs += row["steps"] * base
    assert step[path]["run"] == pytest.approx(theirs / ours)
  assert f"the run at most {step['fixed']['run']:.2f}x" in out and "high_noise: a sparse step" in out
  # A video no compiled step holds names the command that prices one.
  _, out, _, result = tiles(tmp_path, capsys, {**WAN14B, "height": 480, "width": 832},
                            "--slice", "v6e-8")
  assert not result["end_to_end"]["priced"]["priced"] and "bench step --config" in out
  # Nor one on another mesh (the CFG pair split over data: a device's batch of 1), nor I2V's.
  for config, slice_type in (({**WAN14B, "ici_data_parallelism": 2}, "v6e-16"),
                             ({**WAN14B, "model_type": "I2V"}, "v6e-8")):
    code, _, _, result = tiles(tmp_path, capsys, config, "--slice", slice_type)
    assert code == 0 and not result["end_to_end"]["priced"]["priced"]


# LTX-2 19B as ltx2_svg.yml runs it on a v6e-8 (ltx2_video.yml's mesh: 8-way context).
LTX2_704 = {"model_name": "ltx2_video", "attention": "svg", "num_frames": 121, "height": 704,
            "width": 1280, "num_inference_steps": 40, "flash_min_seq_length": 4096,
            "ici_data_parallelism": 1, "ici_fsdp_parallelism": 1, "ici_context_parallelism": -1,
            "ici_tensor_parallelism": 1, "dcn_context_parallelism": 1}


@pytest.mark.parametrize("height,width", [(704, 1280), (1088, 1920)])
def test_an_ltx2_step_is_priced_against_flash_from_its_compiled_forward(tmp_path, capsys,
                                                                       height, width):
  """LTX-2's step against its default flash, whose kernel is in its compiled program: the
  bounds `tiles` prints are the ones bench step printed from the two programs."""
  code, out, _, result = tiles(tmp_path, capsys, {**LTX2_704, "height": height, "width": width},
                               "--slice", "v6e-8")
  step = result["end_to_end"]["priced"]
  stored = json.loads((pathlib.Path(__file__).resolve().parents[2] / step["source"]).read_text())
  assert code == 0 and step["priced"] and step["baseline"] == "flash"
  assert stored["video"] == [121, height, width]
  (expert,) = step["experts"].values()
  for path in ("fixed", "online"):
    assert expert[path]["sparse_step"] == pytest.approx(stored[path]["sparse_step"]["bound"])
    assert expert[path]["dense_step"] == pytest.approx(stored[path]["dense_step"]["bound"])
    assert step[path]["run"] == pytest.approx(stored[path]["run_bound"])
  assert expert["attention_share"] == pytest.approx(stored["amdahl"]["priced_share"])
  assert "end to end, against flash's step" in out and "compiled LTX-2 forward" in out


def test_a_ring_step_is_priced_per_device_against_the_ring_fixed_m(tmp_path, capsys):
  """One 1440p video on a v6e-32 (8 Ulysses x a ring of 2): each device's kernels are its ring
  shard's (svg: the slowest shard), against ulysses_ring_custom_fixed_m's ring calls; the
  bounds `tiles` prints are the ones bench step printed from the two programs."""
  config = {**WAN14B, "height": 1440, "width": 2560, "ici_data_parallelism": 2,
            "ulysses_shards": 8, "per_device_batch_size": 0.03125,
            "allow_split_physical_axes": True}
  code, out, _, result = tiles(tmp_path, capsys, config, "--slice", "v6e-32")
  step = result["end_to_end"]["priced"]
  stored = json.loads((pathlib.Path(__file__).resolve().parents[2] / step["source"]).read_text())
  assert code == 0 and step["priced"] and step["baseline"] == "ulysses_ring_custom_fixed_m"
  assert stored["video"] == [81, 1440, 2560] and "kernel_per_device" in stored
  (expert,) = step["experts"].values()
  for path in ("fixed", "online"):
    assert expert[path]["sparse_step"] == pytest.approx(stored[path]["sparse_step"]["bound"])
    assert step[path]["run"] == pytest.approx(stored[path]["run_bound"])
  assert "per device (svg's slowest ring shard)" in out


def test_vace_counts_its_references_in_the_grid_and_its_control_blocks_dense(tmp_path, capsys):
  """Wan VACE at 720p with two reference images: a grid of 21 + 2 frames; its 8 control blocks
  (14B) add 8 dense self-attention calls per step to the 40 layers' (by hand)."""
  vace = {**WAN14B, "pretrained_model_name_or_path": "Wan-AI/Wan2.1-VACE-14B-diffusers",
          "vace_reference_images": ["https://example.com/a.png", "https://example.com/b.png"]}
  code, out, _, result = tiles(tmp_path, capsys, vace)
  assert code == 0 and result["grid"] == [23, 45, 80]
  row, combined = result["rows"][0], result["combined"]
  layers_work = row["work_vs_dense"]
  work = (40 * layers_work + 8) / 48
  assert combined["work_vs_dense"] == pytest.approx(work)
  assert combined["speedup_bound"] == pytest.approx(1 / work)
  assert combined["sparse_call_share"] == pytest.approx(40 * 39 / (50 * 48))
  assert combined["dense_blocks"] == {"count": 8, "source": "a 14B by its name",
                                      "layers_work_vs_dense": pytest.approx(layers_work)}
  vs, fixed_m = row["vs_fixed_m"], row["vs_fixed_m"]["fixed_m_call"]
  for path in ("fixed", "online"):  # each block's call at the cheaper of ours dense and fixed-m
    run = (40 * vs[path]["run_call"] + 8 * min(fixed_m, vs[path]["dense_call"])) / 48
    assert combined["vs_fixed_m"][path]["bound"] == pytest.approx(fixed_m / run)
  share = result["end_to_end"]["attention_share"]  # 82,800 tokens: interpolated past 720p's
  assert 0.555 < share < 0.882
  assert result["end_to_end"]["step_speedup_bound"] == pytest.approx(
      1 / (1 - share + share * work))
  assert result["summary"].endswith("; dense by design: cross-attention and the VACE control "
                                    "blocks' self-attention")  # as the run's settings line
  assert (f"with the VACE control blocks: 8 more self-attention calls per step (a 14B by its "
          f"name), each dense (svg_dense_kernel): 65.0% of the run's self-attention calls "
          f"sparse; work vs dense {work:.3f}") in out
  # A checkpoint folder's vace_layers count (the 1.3B: 15 blocks), and a plain Wan none.
  folder = tmp_path / "vace" / "transformer"
  folder.mkdir(parents=True)
  (folder / "config.json").write_text(json.dumps({"num_attention_heads": 40,
                                                  "vace_layers": list(range(0, 30, 2))}))
  _, _, _, result = tiles(tmp_path, capsys, {**vace, "pretrained_model_name_or_path":
                                             str(tmp_path / "vace")})
  assert result["combined"]["dense_blocks"]["count"] == 15
  assert "dense_blocks" not in tiles(tmp_path, capsys, WAN14B)[3]["combined"]


def test_wan22_needs_the_keys_that_split_its_steps(tmp_path, capsys):
  config = {k: v for k, v in WAN22.items() if k != "boundary_ratio"}
  code, _, err, _ = tiles(tmp_path, capsys, config)
  assert code == 2 and "boundary_ratio, which the config lacks" in err


def test_the_end_to_end_share_is_the_seed_designs_at_720p(tmp_path, capsys):
  """The seed design states self-attention at 55.5% of per-layer latency at 720p."""
  code, out, _, result = tiles(tmp_path, capsys, WAN14B)
  e2e, work = result["end_to_end"], result["combined"]["work_vs_dense"]
  assert code == 0 and e2e["attention_share"] == 0.555
  assert e2e["source"] == ("assumed, from the seed design (quoted in docs/benchmarks.md) "
                           "(stated at 720p)")
  assert e2e["step_speedup_bound"] == pytest.approx(1 / (0.445 + 0.555 * work))
  assert result["combined"]["work_vs_dense"] == result["rows"][0]["work_vs_dense"]
  assert "computed from the tile plan (not measured)" in out
  for key in ("summary", "checks", "experts", "rows", "combined", "end_to_end",
              "block_kv_compute"):
    assert key in result


# ------------------------------------------------ compensation


def test_compensation_is_estimated_and_its_row_keys_counted_in_the_sparse_plans_vmem(
    tmp_path, capsys):
  """On a v6e-8: our kernel's 3328x1536/512 tiles, 8 centroids per key tile. The sparse plan
  also reads each row's centroids (at most 328 of the 400 at density 0.3): keys and values
  (328, 128) bfloat16 and their bias (328, 128) float32, double-buffered; the dense plan skips
  nothing, so it is not compensated and its need is unchanged."""
  _, _, _, off = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-8")
  code, out, _, on = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-8", "svg_compensation=true")
  assert code == 0 and off["compensation"] is None
  assert on["checks"]["compensation"] == "compensation 8 centroids per key tile"
  fits = {fit["plan"]: fit for fit in on["checks"]["kernel"]}
  before = {fit["plan"]: fit for fit in off["checks"]["kernel"]}
  assert (fits["sparse"]["row_keys"], fits["dense"]["row_keys"]) == (328, 0)
  assert fits["sparse"]["vmem"] - before["sparse"]["vmem"] == 2 * 328 * (2 * 128 * 2 + 128 * 4)
  assert fits["dense"]["vmem"] == before["dense"]["vmem"]
  tiles_kv = 1536
  assert on["compensation"] == {"blocks": 8, "pseudo_keys": -(-75_600 // tiles_kv) * 8,
                                "row_keys": 328, "score_work_vs_dense": 328 / 75_600,
                                "per_layer": False}
  assert "compensation 8 centroids per key tile, layouts spatial, temporal, dense kernel" in on["summary"]
  assert "sparse plan 16.3 of 32 MiB VMEM (328 row keys included)" in out
  assert "compensation 8 centroids per key tile: each query of a sparse call also scores the " \
         "centroids of the key tiles its row skips (at most 328 of the 400" in out
  assert "0.43% of a dense call's scores" in out
  # The speed-up bounds are the tiles' alone, as without compensation.
  assert on["combined"] == off["combined"]


def test_dense_frames_are_counted_priced_checked_and_refused_on_a_ring(tmp_path, capsys):
  """svg_dense_frames 1 on a v6e-8 at 720p: the first frame's 3,600 rows in two 1,920-row
  query tiles against all 50 key tiles of 1,536 (the last masked for padding): 100 tiles, each
  1920/3328 of a sparse plan's, checked as their own plan; a ring refuses them by key."""
  _, _, _, off = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-8")
  code, out, _, on = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-8", "svg_dense_frames=1")
  assert code == 0
  row, before = on["rows"][0], off["rows"][0]
  assert (row["dense_rows_tiles"], row["dense_rows_block_q"]) == (100, 1920)
  assert (row["full_tiles"] - before["full_tiles"], row["masked_tiles"] - before["masked_tiles"]) \
      == (98, 2)
  total = -(-75_600 // 3328) * -(-75_600 // 1536)
  assert row["visited_tile_fraction"] == pytest.approx(
      before["visited_tile_fraction"] + 100 * 1920 / 3328 / total)
  assert row["work_vs_dense"] > before["work_vs_dense"]
  assert on["rows"][0]["vs_fixed_m"]["fixed"]["bound"] < off["rows"][0]["vs_fixed_m"]["fixed"]["bound"]
  assert "dense rows" in {fit["plan"] for fit in on["checks"]["kernel"]}
  assert "the first frame's queries dense (svg_dense_frames)" in on["summary"]
  assert "100 of them (1920-row query tiles, counted in the fraction by their size) the " \
         "leading frames' dense rows (svg_dense_frames)" in out
  _, out, _, _ = tiles(tmp_path, capsys, WAN14B, "svg_sink_frames=2")
  assert "(band density; with the first 2 frames as the sink " in out
  _, out, _, _ = tiles(tmp_path, capsys, WAN14B, "svg_include_sink=false")
  assert "(band density; without a sink " in out
  ring = {**WAN14B, "ulysses_shards": 4}
  code, _, err, _ = tiles(tmp_path, capsys, ring, "--slice", "v6e-8", "svg_dense_frames=1")
  assert code != 0 and "svg_dense_frames is 1, whose dense rows need every key" in err


def test_a_ring_refuses_per_layer_and_per_head_budgets_as_the_run_does(tmp_path, capsys):
  """Per-layer and per-head keys on a ring: refused by the run's own check (before, only the
  traced call refused them, after the weights loaded); each Wan 2.2 expert's own key by name."""
  ring = {**WAN14B, "ulysses_shards": 4}
  forty = lambda value: f"[{', '.join([value] * 40)}]"  # a layer's, or each of 40 heads'
  for key, value in (("svg_layer_densities", forty("0.3")),
                     ("svg_layer_compensation", forty("true")),
                     ("svg_head_densities", forty("0.3"))):
    code, _, err, _ = tiles(tmp_path, capsys, ring, "--slice", "v6e-8", f"{key}={value}")
    assert code == 2, err
    assert (f"{key} does not run on a ring yet (ulysses_shards 4 leaves the sequence split "
            f"over 2 devices)") in err
    code, _, err, _ = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-8", f"{key}={value}")
    assert code == 0, err  # no ring: the whole context axis exchanges heads
  wan22 = {**WAN22, "ulysses_shards": 4}
  code, _, err, _ = tiles(tmp_path, capsys, wan22, "--slice", "v6e-8",
                          f"svg_low_noise_layer_densities={forty('0.3')}")
  assert code == 2 and "svg_low_noise_layer_densities does not run on a ring yet" in err


def test_a_block_count_that_does_not_divide_the_chips_key_tile_is_refused(tmp_path, capsys):
  """7 centroids in our kernel's 1536-key tile on a v6e; the same 7 pass the launcher (no tile
  is known there) and are refused by the transformer's build on the mesh's chip."""
  from maxdiffusion_svg.plugin.settings import PluginSettings  # pylint: disable=import-outside-toplevel
  code, out, err, _ = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-8",
                            "svg_compensation=true", "svg_compensation_blocks=7")
  settings = PluginSettings.from_mapping({**WAN14B, "svg_compensation": True,
                                          "svg_compensation_blocks": 7})
  theirs = run_refusal(lambda: settings.compensation_text(
      settings.svg.target(target=tpu_target("v6e", flags=""))))
  assert code == 2 and out == ""
  assert err.strip() == f"error: the run would stop before loading weights on a v6e-8: {theirs}"
  assert "svg_compensation_blocks must divide the key tile svg_block_kv (1536), got 7" in theirs
  # Off, the block count is not used, and not refused.
  code, *_ = tiles(tmp_path, capsys, WAN14B, "--slice", "v6e-8", "svg_compensation_blocks=7")
  assert code == 0


def test_the_row_keys_can_be_what_passes_the_vmem_limit(tmp_path, capsys):
  """A scoped-VMEM limit between our kernel's need without and with the row keys' blocks:
  uncompensated it fits, compensated the sparse plan is refused, naming the compensation."""
  limit_kib = 16_400  # 3328x1536/512 needs 16,401,367 bytes, and 17,073,111 with 328 row keys
  code, *_ = tiles(tmp_path, capsys, WAN14B, "--chip", "v6e", f"svg_vmem_limit_kib={limit_kib}")
  assert code == 0
  code, out, err, _ = tiles(tmp_path, capsys, WAN14B, "--chip", "v6e",
                            f"svg_vmem_limit_kib={limit_kib}", "svg_compensation=true")
  assert code == 2 and out == ""
  assert err.startswith("error: the run would stop at its first call (sparse plan): Pallas tiles "
                        "3328x1536 with block_kv_compute 512 and 328 row keys "
                        "(svg_compensation) need about 16.3 MiB of VMEM on TPU v6e")


def test_per_layer_densities_are_priced_layer_by_layer_and_counted(tmp_path, capsys):
  """``svg_layer_densities``: the sparse calls' tiles are each sparse layer's own plan, averaged
  over the layers the schedule makes sparse (layer 0 is dense here); a list that does not give
  every layer a density is refused as the run refuses it."""
  from maxdiffusion_svg.budgets.per_layer import check_layer_count  # pylint: disable=import-outside-toplevel
  densities = [0.9] + [0.2] * 9 + [0.4] * 30  # layer 0 runs dense: its 0.9 is not counted
  code, out, _, result = tiles(tmp_path, capsys, {**WAN14B, "svg_layer_densities": densities})
  assert code == 0, out
  grid = grid_for_resolution("720p")
  fractions = {d: plan_tiles(grid, d, 3328, 1536, "aligned").stats.visited_tile_fraction
               for d in (0.2, 0.4)}
  row = result["rows"][0]
  assert row["visited_tile_fraction"] == pytest.approx((9 * fractions[0.2] + 30 * fractions[0.4])
                                                       / 39)
  assert row["layer_densities"] == [0.2, 0.4]
  assert "per-layer rungs 0.2, 0.4 (svg_layer_densities, svg_layer_compensation; mean" in out
  assert "compensation off" in out
  code, out, err, _ = tiles(tmp_path, capsys, {**WAN14B, "svg_layer_densities": [0.2, 0.3]})
  assert code == 2
  assert run_refusal(lambda: check_layer_count((0.2, 0.3), 40)) in err
  # compensation per layer: its rungs priced apart, its row keys named
  compensation = "{0-9: false, 10-39: true}"
  code, out, _, result = tiles(tmp_path, capsys, {**WAN14B, "svg_layer_densities": densities,
                                                  "svg_layer_compensation": compensation})
  assert code == 0, out
  assert result["rows"][0]["layer_rungs"] == ["0.2", "0.4+compensation"]
  assert result["rows"][0]["visited_tile_fraction"] == pytest.approx(row["visited_tile_fraction"])
  assert "compensation 8 centroids per key tile in the layers svg_layer_compensation turns on" in out
  assert "per layer: 0-9: false, 10-39: true" in result["summary"]
  code, out, err, _ = tiles(tmp_path, capsys, {**WAN14B, "svg_layer_compensation": [True] * 2})
  assert code == 2
  assert run_refusal(lambda: check_layer_count((True,) * 2, 40, "svg_layer_compensation")) in err


def test_per_head_densities_are_priced_head_by_head_and_their_ragged_call_checked(tmp_path,
                                                                                  capsys):
  """``svg_head_densities``: the sparse calls' tiles are each head's own plan, averaged over
  the sparse layers' heads; the ragged call's work lists are checked in SMEM for the heads a
  device holds (as the run checks them), refused at 1440p on one device where a v6e-8's
  devices hold them; a list of the wrong heads or layers is refused as the run refuses it."""
  from maxdiffusion_svg.budgets.per_head import check_head_shape  # pylint: disable=import-outside-toplevel
  heads = [0.1, 0.3, 0.5, 0.2] * 10
  code, out, _, result = tiles(tmp_path, capsys, {**WAN14B, "svg_head_densities": heads})
  assert code == 0, out
  grid = grid_for_resolution("720p")
  fraction = lambda d: plan_tiles(grid, d, 3328, 1536, "aligned").stats.visited_tile_fraction
  row = result["rows"][0]
  assert row["visited_tile_fraction"] == pytest.approx(sum(map(fraction, heads)) / len(heads))
  assert row["per_head"] and row["layer_densities"] == [0.1, 0.2, 0.3, 0.5]
  assert "per-head densities 0.1, 0.2, 0.3, 0.5 (svg_head_densities; mean 0.275" in out
  assert "per head (svg_head_densities: 40 heads x every layer, 0.1 to 0.5, mean 0.275)" in out
  assert "per-head ragged plan" in out
  dense_heads = {**WAN14B, "height": 1440, "width": 2560,
                 "svg_head_densities": [0.3, 0.6, 0.9, 0.5] * 10}
  code, out, _, _ = tiles(tmp_path, capsys, dense_heads, "--slice", "v6e-8")
  assert code == 0, out  # 5 heads a device: the CFG pair's 10 lists fit
  code, _, err, _ = tiles(tmp_path, capsys, dense_heads)  # all 40 on one device: they do not
  assert code == 2 and "svg_head_densities' ragged list" in err
  for bad, layers, count in (([0.3] * 39, 40, 40), ([[0.3] * 40] * 2, 40, 40)):
    code, _, err, _ = tiles(tmp_path, capsys, {**WAN14B, "svg_head_densities": bad})
    assert code == 2
    shaped = tuple(map(tuple, bad)) if isinstance(bad[0], list) else (tuple(bad),)
    assert run_refusal(lambda: check_head_shape(shaped, layers, count)) in err
