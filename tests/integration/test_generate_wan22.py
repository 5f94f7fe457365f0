"""Wan 2.2's two experts through generate_wan: a density each, and MaxDiffusion's AOT cache."""

import numpy as np
import pytest
import yaml

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.bench import wan_e2e
from maxdiffusion_svg.testing import tiny_checkpoint
from tiny_runs import ROOT, SVG_KEYS, TINY, launch


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  return {"wan22": tiny_checkpoint.write_wan22(str(tmp_path_factory.mktemp("wan22") / "wan22"))}


@pytest.fixture(scope="module")
def wan22_config(tmp_path_factory):
  """A config chained onto configs/wan22_svg.yml, with the keys the command line sets."""
  config = tmp_path_factory.mktemp("config") / "tiny_wan22.yml"
  config.write_text(yaml.safe_dump({"base_config": str(ROOT / "configs" / "wan22_svg.yml"),
                                    **SVG_KEYS}))
  return str(config)


@pytest.mark.full  # the AOT test below runs the pair through generate_wan; test_pipeline.py
# checks each expert's density through WanPipeline2_2
def test_wan22_pair_uses_its_two_densities(checkpoints, wan22_config, tmp_path):
  video, log = launch(tmp_path, [
      wan22_config, f"pretrained_model_name_or_path={checkpoints['wan22']}", "flow_shift=3.0",
      *TINY])
  densities = {(r["expert"], r["density"]) for r in log if r["kind"] == "self"}
  assert densities == {("high_noise", 0.5), ("low_noise", 0.2)}
  assert video.shape == (33, 128, 128, 3)


# CI time: each expert's own densities run in the CI tier (test_pipeline), and the AOT cache's
# key holds the SVG settings (test_errors_and_dense_paths); this joins them end to end.
@pytest.mark.full
def test_wan22_experts_keep_their_own_executables_with_the_aot_cache(checkpoints, wan22_config,
                                                                     tmp_path, capfd):
  """MaxDiffusion's AOT cache keys an executable by input paths and shapes; the experts differ
  only in a static attribute (their density), so without the plugin's tag the low-noise expert
  ran the high-noise executable. With aot_cache_dir set, a first run (compiling and saving
  each expert's forward) and a second (loading them from disk) equal the run without the
  cache. No call log here: its callbacks would keep the forwards from being serialized."""
  # One guidance scale for both experts: a different one (a static argument) would key their
  # executables apart by itself and hide the bug.
  # With semantic among the layouts: the AOT cache leaves out the centroid store (every step
  # clusters cold) and still compiles once per expert.
  argv = [wan22_config, f"pretrained_model_name_or_path={checkpoints['wan22']}", "flow_shift=3.0",
          "guidance_scale_low=3.5", "guidance_scale_high=3.5",
          "svg_layouts=[spatial, temporal, semantic]", "svg_semantic_clusters=8",
          "svg_semantic_warm_iterations=1", *TINY]
  cache = tmp_path / "aot"

  def run(*extra):
    return wan_e2e.generate([*argv, *extra], str(tmp_path), record=False)["frames"]

  # Under the cache every step clusters cold: the run to match is the cold one (the router may
  # send heads of the tiny random Wan to the semantic layout, where warm and cold clusterings
  # differ).
  plain = run("svg_semantic_warm_iterations=0")
  captured = capfd.readouterr()
  assert "semantic heads " in captured.out + captured.err
  try:
    first = run(f"aot_cache_dir={cache}")
    capfd.readouterr()
    second = run(f"aot_cache_dir={cache}")
    loaded = capfd.readouterr()
  finally:  # the cache is process-global: later tests must not run from it
    from maxdiffusion import aot_cache  # pylint: disable=import-outside-toplevel
    aot_cache.install("", meta={}, mesh=None)
  forwards = sorted(p.name for p in cache.glob("*transformer_forward_pass*.aotx"))
  assert len(forwards) == 2, sorted(p.name for p in cache.glob("*.aotx"))  # one per expert
  assert sum(f"loaded {name}" in loaded.out + loaded.err for name in forwards) == 2
  # No counting callbacks under the cache: the run summary counts from the schedule.
  assert "(from the schedule, not counted (aot_cache_dir is set" in loaded.out + loaded.err
  assert "semantic warm start off: aot_cache_dir is set" in loaded.out + loaded.err
  np.testing.assert_array_equal(first, plain)
  np.testing.assert_array_equal(second, plain)
