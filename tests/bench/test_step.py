"""``bench step``: the step's classes sum to the program, the cond's branches are priced apart,
collectives' bytes are their HLO's, and the step's arithmetic (no compile here: a synthetic dump,
and one small CPU program for the collectives)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxdiffusion_svg.bench import step as step_bench
from maxdiffusion_svg.bench.schedule_xla import HLO_FILE, issued_bundles
from maxdiffusion_svg.bench.step import (AUDIO, CLASSES, COLLECTIVES, CROSS, KERNEL, PROJECTIONS,
                                         REST, SELF, Instruction, classify, classify_ltx2,
                                         collective_bytes,
                                         cross_attention, flash_calls, instructions,
                                         price_classes, scan_bodies, step_row, topology_of)
from maxdiffusion_svg.cli import main as cli
from test_schedule_compensation import FUSION  # 23 bundles: a loop of 4 run 5 times

SHORT = "  0x0   :  { %1 = smov 0 }\n  0x1   :  {}\n"  # 2 bundles
# The embedding outside the scan, then the scan (no literal trip count) calling one computation
# of each kind, then the kernel (priced from its plan, skipped here).
TLP = """  0x0   :  { %1 = inlined_call %s1 /* %embed = fusion() */ }
  0x1 LB: > { %2 = inlined_call %s2 /* %qkv = fusion() */ }
  0x2   : > { %3 = inlined_call %s2 /* %sparse_glue = fusion() */ }
  0x3   : > { %4 = inlined_call %s2 /* %dense_glue = fusion() */ }
  0x4   : > { %5 = inlined_call %s2 /* %cross = fusion() */ }
  0x5   : > { %6 = inlined_call %s2 /* %norm = fusion() */ }
  0x6   : > { %7 = inlined_call %s2 /* %exchange = all-to-all() */ }
  0x7   : > { %8 = inlined_call %s3 /* %kernel_call = custom-call() */ }
  0x8   : > { %p9 = scmp.lt.s32.totalorder %s9, %s8 }
  0x9   : > { %10 = sbr.rel (%p9) target = $region2 }
"""
_BODY = "jit(f)/WanModel/while/body/eval_jaxpr"
HLO = f"""HloModule m
ENTRY %main () -> f32[] {{
  %embed = f32[2,64]{{1,0}} fusion(f32[2,64]{{1,0}} %p), kind=kLoop, calls=%c0, metadata={{op_name="jit(f)/WanModel/patch_embedding/conv_general_dilated"}}
  %qkv = bf16[2,64,5120]{{2,1,0}} fusion(%x), kind=kOutput, calls=%c1, metadata={{op_name="{_BODY}/query_proj/dot_general"}}
  %sparse_glue = bf16[10,640,128]{{2,1,0}} fusion(%x), kind=kLoop, calls=%c2, metadata={{op_name="{_BODY}/apply_attention/shard_map/cond/branch_1_fun/transpose"}}
  %dense_glue = bf16[10,640,128]{{2,1,0}} fusion(%x), kind=kLoop, calls=%c3, metadata={{op_name="{_BODY}/apply_attention/shard_map/cond/branch_0_fun/convert_element_type"}}
  %cross = bf16[80,64,512]{{2,1,0}} fusion(%x), kind=kLoop, calls=%c4, metadata={{op_name="{_BODY}/apply_attention/div"}}
  %norm = f32[2,64]{{1,0}} fusion(%x), kind=kLoop, calls=%c5, metadata={{op_name="{_BODY}/rsqrt"}}
  %exchange = bf16[1,10,640,128]{{3,2,1,0}} all-to-all(%x), channel_id=1, dimensions={{1}}, metadata={{op_name="{_BODY}/apply_attention/shard_map/all_to_all"}}
  ROOT %kernel_call = bf16[10,640,128]{{2,1,0}} custom-call(%x), custom_call_target="tpu_custom_call"
}}
"""


def write_dump(directory):
  listings = {"TLP": TLP, "embed": SHORT, "qkv": FUSION, "sparse_glue": FUSION,
              "dense_glue": SHORT, "cross": FUSION, "norm": SHORT, "exchange": SHORT,
              "kernel_call": FUSION}
  for name, text in listings.items():
    (directory / f"1-{name}-02-final_bundles.txt").write_text(text)
  (directory / HLO_FILE).write_text(HLO)


def test_the_classes_sum_to_the_program_and_the_branches_are_apart(tmp_path):
  write_dump(tmp_path)
  layers = 3
  priced = price_classes(str(tmp_path), ("kernel",), layers, text_len=512)
  top = 10 + 9 * (layers - 1)  # the TLP's own: its 10 bundles and the loop's 9 twice more
  assert priced["outside"] == {SELF: 0, CROSS: 0, PROJECTIONS: 2, COLLECTIVES: 0, REST: top}
  assert priced["shared"] == {SELF: 0, CROSS: 23, PROJECTIONS: 23, COLLECTIVES: 2, REST: 2}
  assert priced["layer"][1][SELF] == 23 and priced["layer"][0][SELF] == 2
  assert priced["layer"][1][CROSS] == priced["layer"][0][CROSS] == 23
  # Every priced bundle lands in one class: outside + layers x (shared + each branch's own).
  classes = sum(priced["outside"].values()) + layers * (
      sum(priced["shared"].values()) + sum(sum(b.values()) for b in priced["branches"].values()))
  assert classes == priced["total"] == top + 2 + layers * (23 + 23 + 2 + 23 + 2 + 2)
  assert issued_bundles(FUSION) == 23


def test_mosaic_calls_priced_elsewhere_land_in_their_class_and_the_total(tmp_path):
  write_dump(tmp_path)
  plain = price_classes(str(tmp_path), ("kernel",), 3, text_len=512)
  priced = price_classes(str(tmp_path), ("kernel",), 3, 512, kernels={"kernel_call": 100})
  assert priced["total"] == plain["total"] + 100  # ENTRY's: outside the scan, run once
  assert priced["outside"][REST] == plain["outside"][REST] + 100


# A scanned layer as MaxDiffusion's 1.3B compiles it: cross-attention by MaxDiffusion's flash in a
# shard_map of its own, libtpu's bitcasts without an op_name; ours beside it,
# with a 512-long tile shape inside its shard_map.
_ATTN = "jit(f)/WanModel/while/body/eval_jaxpr/apply_attention"
SCAN = f"""HloModule m
%body.3 (p: (s32[], bf16[1,18944,1536])) -> (s32[], bf16[1,18944,1536]) {{
  %p = (s32[], bf16[1,18944,1536]) parameter(0)
  %x = bf16[1,18944,1536]{{2,1,0}} get-tuple-element(%p), index=1
  %ours = bf16[3,75600,128]{{2,1,0}} fusion(bf16[1,18944,1536]{{2,1,0}} %x), kind=kLoop, calls=%f1, metadata={{op_name="{_ATTN}/shard_map/cond/branch_1_fun/transpose"}}
  %tile = bf16[3,148,512,128]{{3,2,1,0}} fusion(%ours), kind=kLoop, calls=%f2, metadata={{op_name="{_ATTN}/shard_map/reshape"}}
  %q = bf16[12,18944,128]{{2,1,0:T(8,128)(2,1)}} fusion(%x), kind=kLoop, calls=%f3, metadata={{op_name="{_ATTN}/shard_map/jit(_pad)/pad"}}
  %k = bf16[1,512,12,128]{{3,2,1,0}} all-gather(%x), channel_id=1, dimensions={{1}}, metadata={{op_name="{_ATTN}/reshape"}}
  %kb = bf16[12,512,128]{{2,1,0}} bitcast(%k)
  %splash_mha_fwd_segmented_no_residuals.1 = bf16[12,18944,128]{{2,1,0:T(8,128)(2,1)}} custom-call(%q, %kb), custom_call_target="tpu_custom_call", operand_layout_constraints={{s8[1,37,1]{{2,1,0}}, bf16[12,18944,128]{{2,1,0}}, bf16[12,512,128]{{2,1,0}}}}, frontend_attributes={{kernel_metadata={{
"xprof_metadata":"{{\\"block_q\\": 512, \\"block_kv\\": 256, \\"block_kv_compute\\": 256}}"
}}}}, metadata={{op_name="{_ATTN}/shard_map/vmap(jit(_splash_attention))/splash_mha_fwd/pallas_call"}}
  %out = bf16[1,18944,1536]{{2,1,0}} fusion(%splash_mha_fwd_segmented_no_residuals.1), kind=kLoop, calls=%f4, metadata={{op_name="{_ATTN}/transpose"}}
  %proj = bf16[1,18944,1536]{{2,1,0}} fusion(%out, %tile), kind=kOutput, calls=%f5, metadata={{op_name="jit(f)/WanModel/while/body/eval_jaxpr/proj_attn/dot_general"}}
  ROOT %t = (s32[], bf16[1,18944,1536]) tuple(%p, %proj)
}}

ENTRY %main (a: bf16[1,18944,1536]) -> bf16[1,18944,1536] {{
  %w = (s32[], bf16[1,18944,1536]) while(%a), condition=%cond.2, body=%body.3
}}
"""


def test_cross_attention_is_found_by_its_data_path_and_flash_by_its_grid():
  table = instructions(SCAN)
  assert scan_bodies(table) == {"body.3"} and table["kb"].computation == "body.3"
  assert cross_attention(table, 512) == {"q", "k", "kb", "splash_mha_fwd_segmented_no_residuals.1",
                                         "out"}
  # Ours keeps its 512-long tiles: inside its shard_map, not on the text's path.
  assert classify(table["tile"], 512) == SELF
  # Its kernel metadata runs over three lines: one instruction, its op_name on the last.
  assert table["splash_mha_fwd_segmented_no_residuals.1"].op_name.endswith("/pallas_call")
  assert table["out"].operands == ("splash_mha_fwd_segmented_no_residuals.1",)
  # 18,944 queries in 512-row blocks, 512 keys in 256-long ones, for 12 heads.
  assert flash_calls(table) == {"splash_mha_fwd_segmented_no_residuals.1": (12, 37, 2)}


@pytest.mark.parametrize("op_name,line,expected", [
    ("x/while/body/eval_jaxpr/apply_attention/shard_map/cond/branch_1_fun/gather", "", SELF),
    ("x/while/body/eval_jaxpr/apply_attention/b i d, b j d->b i j/dot_general",
     "f32[80,9450,512]", CROSS),
    ("x/while/body/eval_jaxpr/apply_attention/reshape", "bf16[2,9450,5120]", SELF),
    ("x/while/body/eval_jaxpr/key_proj/dot_general", "", PROJECTIONS),
    ("x/while/body/eval_jaxpr/proj_out/dot_general", "", PROJECTIONS),
    ("x/while/body/eval_jaxpr/gelu/dot_general", "", PROJECTIONS),
    ("x/while/body/eval_jaxpr/rsqrt", "", REST),
    ("x/WanModel/concatenate", "", REST)])
def test_an_instruction_is_classed_by_its_scope(op_name, line, expected):
  assert classify(Instruction("fusion", op_name, line), 512) == expected
  assert classify(Instruction("all-gather-done", op_name, line), 512) == COLLECTIVES


_LAYER = "jit(transformer_forward_pass)/Transformer Blocks/while/body/eval_jaxpr/Transformer Layer"


@pytest.mark.parametrize("op_name,expected", [
    (f"{_LAYER}/Video Self-Attention/Attention and Output Project/shard_map/cond/branch_1_fun/"
     "gather", SELF),
    (f"{_LAYER}/Video Self-Attention/Attention and Output Project/shard_map/pallas_call", SELF),
    (f"{_LAYER}/Video Self-Attention/Attention and Output Project/dot_general", PROJECTIONS),
    (f"{_LAYER}/Video Self-Attention/QKV Projection/dot_general", PROJECTIONS),
    (f"{_LAYER}/Video Self-Attention/QKV Norm/rsqrt", REST),
    (f"{_LAYER}/Audio Self-Attention/Attention and Output Project/reduce_max", AUDIO),
    (f"{_LAYER}/Audio-to-Video Cross-Attention/Attention and Output Project/"
     "b n f t, b t n h -> b f n h/dot_general", CROSS),
    (f"{_LAYER}/Video-to-Audio Cross-Attention/Attention and Output Project/sub", CROSS),
    (f"{_LAYER}/Attention and Output Project/jit(_where)/select_n", CROSS),  # text: attn2
    (f"{_LAYER}/dot_general", PROJECTIONS),  # the feed-forward
    (f"{_LAYER}/add", REST),
    ("jit(transformer_forward_pass)/Input Projection/dot_general", PROJECTIONS),
    ("", REST)])
def test_an_ltx2_instruction_is_classed_by_its_named_scopes(op_name, expected):
  assert classify_ltx2(Instruction("fusion", op_name, "")) == expected
  assert classify_ltx2(Instruction("all-to-all", op_name, "")) == COLLECTIVES
  # svg's schedule cond, under LTX-2's video self-attention scope as under Wan's apply_attention.
  assert step_bench.branch(Instruction("fusion", op_name, "")) == (1 if "branch_1" in op_name
                                                                     else None)


def test_a_collectives_bytes_are_its_hlos_on_a_small_mesh():
  mesh = Mesh(np.array(jax.devices()[:8]), ("context",))
  x = jnp.ones((2, 8 * 16, 8, 32), jnp.float32)  # batch, tokens (sharded), heads, head_dim

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "context"),
                     out_specs=P(None, None, "context"))
  def exchange(x):  # Ulysses: tokens whole, heads split
    return jax.lax.all_to_all(x, "context", 2, 1, tiled=True)

  sharded = jax.device_put(x, NamedSharding(mesh, P(None, "context")))
  hlo = jax.jit(exchange).lower(sharded).compile().as_text()
  found = [c for c in collective_bytes(hlo) if c["opcode"] == "all-to-all"]
  # Each device's result: every token of its one head, float32.
  assert sum(c["bytes"] for c in found) == 2 * (8 * 16) * 1 * 32 * 4
  assert all(not c["layer"] and c["branch"] is None for c in found)


def program(outside_rest, layer):
  return {"outside": {**{c: 0 for c in CLASSES}, REST: outside_rest}, "layer": layer}


def test_a_step_is_the_outside_plus_its_layers_and_their_kernels():
  row = {c: 0 for c in CLASSES}
  svg = program(100, {1: {**row, SELF: 30, PROJECTIONS: 50}, 0: {**row, SELF: 10, PROJECTIONS: 50}})
  base = program(100, {None: {**row, SELF: 5, PROJECTIONS: 50}})
  calls = {"fixed_m": 40, "fixed": {"sparse": 10, "dense": 30}}
  out = step_row(svg, base, calls, heads=2, batch=2, depth=4, sparse_layers=3)
  # svg: 100 + 3 x (30 + 50 + 4 x 10) + 1 x (10 + 50 + 4 x 30); baseline: 100 + 4 x (5 + 50 + 160)
  assert out["svg"]["total"] == 100 + 3 * 120 + 180 and out["svg"][KERNEL] == 3 * 40 + 120
  assert out["baseline"]["total"] == 100 + 4 * 215
  assert out["bound"] == pytest.approx(960 / 640)
  assert out["baseline_self_attention_share"] == pytest.approx(4 * 165 / 960)
  # A baseline whose kernel its program holds (LTX-2's flash, 25 of its 5 + 25 a layer): the
  # step is its program's, the kernel named within its self-attention, not added to it.
  base = program(100, {None: {**row, SELF: 30, PROJECTIONS: 50}})
  out = step_row(svg, base, calls, heads=2, batch=2, depth=4, sparse_layers=3, base_kernel=25)
  assert out["baseline"]["total"] == 100 + 4 * 80 and out["baseline"][KERNEL] == 4 * 25
  assert out["baseline"][SELF] == 4 * 30 and out["bound"] == pytest.approx(420 / 640)
  # The ring fixed-m's cond: a layer priced on its every-head-fixed branch (1), not both.
  base = program(100, {0: {**row, SELF: 90, PROJECTIONS: 50}, 1: {**row, SELF: 5, PROJECTIONS: 50}})
  out = step_row(svg, base, calls, heads=2, batch=2, depth=4, sparse_layers=3)
  assert out["baseline"]["total"] == 100 + 4 * 215


def test_the_slice_names_its_topology_and_the_cli_its_defaults():
  assert topology_of("v6e-8") == "v6e:2x4" and topology_of("v6e-32") == "v6e:4x8"
  with pytest.raises(ValueError, match="--slice"):
    topology_of("v6e-3")
  with pytest.raises(ValueError, match="compiles v5e and v6e slices"):
    topology_of("tpu7x-8")  # 8 TensorCores, 4 chips: not a 2x4
  args = cli.build_parser().parse_args(["bench", "step"])
  assert (args.config, args.slice, args.layers) == ("configs/wan_svg.yml", "v6e-8", 2)
  assert args.run.__name__ == "_bench_step"
  # Each family against the dense kernel its users run: Wan's fastest, LTX-2's default.
  assert {f: m.baseline for f, m in step_bench.STEP_MODELS.items()} == {
      "Wan": "ulysses_custom_fixed_m", "LTX-2": "flash"}


def test_a_family_bench_step_cannot_compile_is_refused_before_compiling(tmp_path):
  config = tmp_path / "vace.yml"
  config.write_text("model_name: wan2.1\nattention: svg\nvace_reference_images: [a.png]\n")
  with pytest.raises(ValueError, match="prices Wan and LTX-2 steps, not Wan VACE's"):
    step_bench.run_step_bench(str(config), "v6e-8", log=lambda _: None)


def test_tile_choices_are_parsed_and_a_bad_one_refused(capsys):
  args = cli.build_parser().parse_args(["bench", "step", "--tiles", "3328x1536/512,2048x1024/512"])
  assert args.tiles == [(3328, 1536, 512), (2048, 1024, 512)]
  with pytest.raises(SystemExit):
    cli.build_parser().parse_args(["bench", "step", "--tiles", "3328x1536"])
  assert "QxKV/STEP" in capsys.readouterr().err


def test_every_tile_choice_is_checked_before_the_first_compile(tmp_path, monkeypatch):
  """A choice the run would refuse (its VMEM over a v5e's 16 MiB) stops bench step --tiles
  before it compiles any other choice's kernel or forward."""
  import json  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench import schedule  # pylint: disable=import-outside-toplevel
  config = tmp_path / "wan.yml"
  config.write_text(json.dumps({
      "model_name": "wan2.1", "attention": "svg", "num_frames": 81, "height": 720,
      "width": 1280, "num_inference_steps": 50, "mesh_axes": ["data", "fsdp", "context", "tensor"],
      "ici_data_parallelism": 1, "ici_fsdp_parallelism": 1, "ici_context_parallelism": -1,
      "ici_tensor_parallelism": 1, "dcn_context_parallelism": -1}))
  compiled = []
  monkeypatch.setattr(schedule, "run_case", lambda *a, **k: compiled.append(a))
  monkeypatch.setattr(step_bench, "compile_dumped", lambda *a, **k: compiled.append(a))
  with pytest.raises(ValueError, match="Pallas tiles 4096x2048 with block_kv_compute 512 need about"):
    step_bench.run_tile_choices(str(config), "v5e-8", [(2048, 1536, 512), (4096, 2048, 512)],
                                log=lambda _: None)
  assert not compiled


def test_a_tile_choices_row_shows_its_kernel_and_the_xla_around_it():
  choice = {"tiles": [2048, 1024, 512], "visited_tiles": 700, "sparse_call": 3e6,
            "sparse_layer": 38e6, "xla_sparse_attention": 8e6, "sparse_step": 2.4e9,
            "step_bound": 1.9, "run_bound": 1.6}
  text = step_bench.format_tile_choices({"config": "c.yml", "slice": "v6e-8",
                                         "choices": [choice]})
  assert "| 2048x1024/512 | 700 | 3.0 | 30.0 | 8.0 | 38.0 | 2,400.0 | 1.900x | 1.600x |" in text


def test_our_small_kernels_are_left_out_and_said_so():
  """A step compiled with the router's and the placement's Mosaic kernels prices without them
  and names them; one compiled before them says nothing."""
  import copy  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  from maxdiffusion_svg.bench.step import UNPRICED, format_step  # pylint: disable=import-outside-toplevel
  stored = json.loads((pathlib.Path(__file__).resolve().parents[2] / "docs" / "measurements"
                       / "static_step_v5e1_wan1.3b_720p.json").read_text())
  assert "left out of svg's bundles" not in format_step(stored)
  newer = copy.deepcopy(stored)
  newer["programs"]["svg"]["unpriced_kernels"] = ["svg_sampled_rows.3", "svg_head_order.1",
                                                  "svg_head_order.2"]
  assert UNPRICED == ("svg_sampled_rows", "svg_head_order")
  assert ("left out of svg's bundles (no body model prices them; the XLA they replaced cost "
          "more): svg_head_order, svg_sampled_rows") in format_step(newer)
