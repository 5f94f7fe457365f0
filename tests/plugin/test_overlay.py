"""base_config chains: lookup order, merging, cycles and missing bases (no MaxDiffusion needed)."""

import pathlib

import pytest
import yaml

from maxdiffusion_svg.plugin import overlay
from maxdiffusion_svg.plugin.launcher import prepare_argv
from maxdiffusion_svg.plugin.settings import config_defaults


def write(path: pathlib.Path, **keys) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(yaml.safe_dump(keys, sort_keys=False))
  return path


def test_chain_merges_later_files_over_their_bases(tmp_path):
  search = tmp_path / "maxdiffusion_configs"
  write(search / "base.yml", attention="flash", height=720, steps=50, block={"q": 512, "kv": 512})
  write(tmp_path / "mid.yml", base_config="base.yml", height=480, svg_density=0.3)
  top = write(tmp_path / "run.yml", base_config="mid.yml", attention="svg", block={"q": 1024})
  config, chain = overlay.load_config(top, search_dirs=[search])
  assert config == {"attention": "svg", "height": 480, "steps": 50, "block": {"q": 1024},
                    "svg_density": 0.3}  # a dict value is replaced whole, as on the command line
  assert chain == [str(top), str(tmp_path / "mid.yml"), str(search / "base.yml")]
  assert list(config)[:3] == ["attention", "height", "steps"]  # the base's key order


def test_a_base_beside_the_file_wins_over_the_search_dirs(tmp_path):
  search = tmp_path / "search"
  write(search / "base.yml", origin="search")
  write(tmp_path / "base.yml", origin="beside")
  config, _ = overlay.load_config(write(tmp_path / "run.yml", base_config="base.yml"),
                                  search_dirs=[search])
  assert config == {"origin": "beside"}
  absolute = write(tmp_path / "abs.yml", base_config=str(search / "base.yml"))
  assert overlay.load_config(absolute, search_dirs=[])[0] == {"origin": "search"}


def test_cycles_and_missing_bases_name_the_files(tmp_path):
  write(tmp_path / "a.yml", base_config="b.yml")
  write(tmp_path / "b.yml", base_config="a.yml")
  with pytest.raises(ValueError, match=r"base_config cycle: .*a\.yml -> .*b\.yml -> .*a\.yml"):
    overlay.load_config(tmp_path / "a.yml", search_dirs=[])
  missing = write(tmp_path / "m.yml", base_config="nowhere.yml")
  with pytest.raises(ValueError, match=rf"{missing}: base_config 'nowhere.yml' not found; "
                                       rf"looked in {tmp_path}/nowhere.yml, {tmp_path}/s/nowhere.yml"):
    overlay.load_config(missing, search_dirs=[tmp_path / "s"])
  (tmp_path / "list.yml").write_text("- 1\n- 2\n")
  with pytest.raises(ValueError, match="a config must be a YAML mapping"):
    overlay.load_config(tmp_path / "list.yml", search_dirs=[])
  with pytest.raises(ValueError, match="does not exist"):
    overlay.load_config(tmp_path / "absent.yml")


def test_launcher_argv_points_maxdiffusion_at_the_merged_config(tmp_path):
  write(tmp_path / "base.yml", model_name="wan2.1", attention="flash", num_inference_steps=50)
  top = write(tmp_path / "run.yml", base_config="base.yml", attention="svg")
  out = tmp_path / "out"
  out.mkdir()
  argv, chain = prepare_argv(["prog", str(top), "num_inference_steps=3", "svg_density=0.5"],
                             str(out))
  assert chain == [str(top), str(tmp_path / "base.yml")]
  assert argv == ["prog", str(out / "merged_config.yml"), "num_inference_steps=3", "svg_density=0.5"]
  merged = yaml.safe_load((out / "merged_config.yml").read_text())
  # Every svg_* key is there (so each can be overridden), under the config's own keys.
  assert merged == {**config_defaults(), "model_name": "wan2.1", "attention": "svg",
                    "num_inference_steps": 50}
  assert merged["svg_density"] == "preset" and merged["svg_block_kv_compute"] == 0
  with pytest.raises(ValueError, match="usage: python -m maxdiffusion_svg.generate CONFIG.yml"):
    prepare_argv(["prog", "attention=svg"], str(out))


def test_an_override_the_config_does_not_hold_is_named_before_maxdiffusion_starts(tmp_path):
  write(tmp_path / "base.yml", attention="flash", num_inference_steps=50)
  top = write(tmp_path / "run.yml", base_config="base.yml", attention="svg")
  with pytest.raises(ValueError, match=r"svg_dnesity=0.2: svg_dnesity is not a key of the config "
                                       r"\(.*run\.yml -> .*base\.yml\) nor an svg_\* key; .* "
                                       r"did you mean svg_density"):
    prepare_argv(["prog", str(top), "svg_dnesity=0.2"], str(tmp_path))
  with pytest.raises(ValueError, match="did you mean num_inference_steps"):
    prepare_argv(["prog", str(top), "svg_density=0.2", "num_inference_stps=3"], str(tmp_path))
  with pytest.raises(ValueError, match=r"zzz=1: zzz is not a key .*holds$"):  # nothing close
    prepare_argv(["prog", str(top), "zzz=1"], str(tmp_path))


def test_shipped_configs_name_maxdiffusion_bases():
  bases = {p.name: yaml.safe_load(p.read_text())["base_config"]
           for p in (pathlib.Path(__file__).parents[2] / "configs").glob("*.yml")}
  assert bases == {"wan_svg.yml": "base_wan_14b.yml", "wan_svg_1_3b.yml": "base_wan_1_3b.yml",
                   "wan22_svg.yml": "base_wan_27b.yml", "wan_i2v_svg.yml": "base_wan_i2v_14b.yml",
                   "wan_svg_v6e16.yml": "wan_svg.yml", "wan_svg_v6e32.yml": "wan_svg.yml",
                   "wan_svg_v6e64.yml": "wan_svg.yml",
                   "wan_svg_train.yml": "base_wan_14b.yml", "ltx2_svg.yml": "ltx2_video.yml",
                   "ltx2_3_svg.yml": "ltx2_3_video.yml",
                   "wan_animate_svg.yml": "base_wan_animate.yml",
                   "wan_vace_svg.yml": "wan_svg.yml",
                   "wan_vace_svg_train.yml": "wan_svg_train.yml"}  # chains: ours on MaxDiffusion's


def test_a_bucket_output_needs_a_run_name_before_anything_loads():
  from maxdiffusion_svg.plugin.launcher import check_run_name  # pylint: disable=import-outside-toplevel
  bucket = {"output_dir": "gs://b/out", "run_name": ""}
  with pytest.raises(ValueError, match=r"run_name is not set .* output_dir 'gs://b/out' is a "
                                       r"bucket.*Give run_name=NAME"):
    check_run_name(bucket, ["num_inference_steps=3"], env={})
  check_run_name(bucket, ["run_name=job"], env={})
  check_run_name(bucket, [], env={"JOBSET_NAME": "wan-svg"})  # as XPK and our JobSet set it
  check_run_name({"output_dir": "/tmp/out", "run_name": ""}, [], env={})  # local: no upload
  with pytest.raises(ValueError, match="run_name is not set"):
    check_run_name({"output_dir": "/tmp", "run_name": ""}, ["output_dir=gs://b"], env={})
