"""The GKE launch files: every JobSet manifest holds what the controller and the TPU webhook need
and runs the launcher; the XPK script, run against the real ``xpk`` CLI in ``--dry-run``,
generates a JobSet with our command and run name for each slice. (Each manifest's command runs
locally in 1 and 2 processes in tests/integration/test_gke_local.py.)"""

import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml
from shipped_configs import own_chain

ROOT = pathlib.Path(__file__).parent.parent
GKE = ROOT / "scripts" / "gke"
WAN14B_HEADS = 40
# Slices: manifest -> (topology, hosts, chips per host).
MANIFESTS = {"jobset_v6e8.yaml": ("2x4", 1, 8), "jobset_v6e16.yaml": ("4x4", 4, 4)}
LABEL = "metadata.labels['jobset.sigs.k8s.io/jobset-name']"


def merged_config(name: str) -> dict:
  """Our chain of configs, over base_wan_14b.yml's mesh keys (context auto, the rest 1)."""
  data = own_chain(ROOT / "configs" / name)
  return {"ici_data_parallelism": 1, "ici_fsdp_parallelism": 1, "ici_tensor_parallelism": 1,
          "ici_context_parallelism": -1, **data}


def context_shards(config: dict, devices: int) -> int:
  fixed = math.prod(config[f"ici_{axis}_parallelism"] for axis in ("data", "fsdp", "tensor"))
  context = config["ici_context_parallelism"]
  return devices // fixed if context == -1 else context


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_manifest_holds_what_the_controller_needs(manifest):
  topology, hosts, chips = MANIFESTS[manifest]
  jobset = yaml.safe_load((GKE / manifest).read_text())
  assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  assert jobset["metadata"]["annotations"] == {
      "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  (job,) = jobset["spec"]["replicatedJobs"]
  spec = job["template"]["spec"]
  # One pod per host of the slice, all of them needed.
  assert job["replicas"] == 1 and spec["parallelism"] == spec["completions"] == hosts
  assert spec["backoffLimit"] == 0 and jobset["spec"]["failurePolicy"]["maxRestarts"] == 0
  pod = spec["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                 "cloud.google.com/gke-tpu-topology": topology}
  assert math.prod(map(int, topology.split("x"))) == hosts * chips
  assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
  assert "volumes" not in pod  # the plugin is in the image: no bucket mount under hostNetwork
  (container,) = pod["containers"]
  assert container["resources"]["limits"] == {"google.com/tpu": chips}
  command = [*container["command"], *container.get("args", [])]
  assert command[:3] == ["python", "-m", "maxdiffusion_svg.generate"]
  config = pathlib.PurePosixPath(command[3])
  assert config.parent == pathlib.PurePosixPath("/opt/maxdiffusion_svg/configs")
  assert (ROOT / "configs" / config.name).is_file()  # what the image's stage holds
  assert all("=" in w for w in command[4:])
  keys = dict(w.split("=", 1) for w in command[4:])
  assert keys["output_dir"].startswith("gs://")
  # run_name is always defined: MaxDiffusion joins output_dir with it to upload the video.
  assert keys["run_name"] == "$(JOBSET_NAME)"
  env = {v["name"]: v for v in container["env"]}
  assert env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == LABEL
  # The config's mesh divides Wan 14B's heads on this slice.
  assert WAN14B_HEADS % context_shards(merged_config(config.name), hosts * chips) == 0


def test_dockerfile_installs_the_staged_wheel_where_the_manifests_look():
  text = (GKE / "Dockerfile").read_text()
  assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
  assert re.search(r"^COPY \. /opt/maxdiffusion_svg$", text, re.M)
  assert "pip install --no-deps /opt/maxdiffusion_svg/*.whl" in text


def xpk_binary() -> str | None:
  """The real xpk CLI: $MDSVG_XPK, .venv-xpk (make xpk), or PATH."""
  for candidate in (os.environ.get("MDSVG_XPK"), str(ROOT / ".venv-xpk" / "bin" / "xpk"),
                    shutil.which("xpk")):
    if candidate and os.access(candidate, os.X_OK):
      return candidate
  return None


def fake_checkout(tmp_path: pathlib.Path) -> pathlib.Path:
  checkout = tmp_path / "maxdiffusion"
  (checkout / "src" / "maxdiffusion").mkdir(parents=True)
  (checkout / "src" / "maxdiffusion" / "generate_wan.py").write_text("")
  return checkout


def run_xpk_script(tmp_path, *args, **env):
  env = {**os.environ, "CLUSTER": "c1", "OUTPUT_DIR": "gs://b/out", "PYTHON": sys.executable,
         **env}
  return subprocess.run([str(GKE / "xpk.sh"), str(fake_checkout(tmp_path)), *args], env=env,
                        capture_output=True, text=True, check=False, cwd=tmp_path)


def dry_run_jobset(stdout: str) -> dict:
  """The JobSet xpk prints in --dry-run (the YAML between its apiVersion and its next task)."""
  start = stdout.index("apiVersion: jobset.x-k8s.io")
  end = stdout.index("[XPK]", start)
  return yaml.safe_load(stdout[start:end])


@pytest.mark.parametrize("tpu_type, hosts, chips, topology, config", [
    ("v6e-8", 2, 4, "2x4", "wan_svg.yml"), ("v6e-16", 4, 4, "4x4", "wan_svg_v6e16.yml")])
def test_xpk_dry_run_makes_a_jobset_running_our_command(tmp_path, tpu_type, hosts, chips,
                                                        topology, config):
  xpk = xpk_binary()
  if xpk is None:
    pytest.fail("the xpk CLI is needed: `make test` installs it in .venv-xpk (make xpk)")
  result = run_xpk_script(tmp_path, "num_inference_steps=20", XPK=xpk, TPU_TYPE=tpu_type,
                          RUN_NAME="svg-test",
                          XPK_ARGS="--project p --zone us-east5-b --dry-run")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  jobset = dry_run_jobset(result.stdout)
  assert jobset["metadata"]["name"] == "svg-test"
  (job,) = jobset["spec"]["replicatedJobs"]
  spec = job["template"]["spec"]
  assert spec["parallelism"] == spec["completions"] == hosts  # XPK: one pod per host
  pod = spec["template"]["spec"]
  assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
  (container,) = pod["containers"]
  assert container["resources"]["limits"]["google.com/tpu"] == chips
  assert not container.get("env")  # no JOBSET_NAME: the run name must be in the command
  script = container["command"][-1]
  ours = (f"pip install . && pip install --no-deps maxdiffusion_svg_stage/*.whl && "
          f"python -m maxdiffusion_svg.generate maxdiffusion_svg_stage/configs/{config} "
          f"run_name=svg-test output_dir=gs://b/out num_inference_steps=20")
  assert ours in script
  heads_ok = WAN14B_HEADS % context_shards(merged_config(config), hosts * chips) == 0
  assert heads_ok, f"{config} on {tpu_type}"
  stage = tmp_path / "maxdiffusion" / "maxdiffusion_svg_stage"
  (wheel,) = stage.glob("*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert "maxdiffusion_svg/plugin/launcher.py" in names
  entry_points = next(n for n in names if n.endswith("entry_points.txt"))
  assert "maxdiffusion.plugins" in zipfile.ZipFile(wheel).read(entry_points).decode()
  assert (stage / "configs" / config).is_file()


def test_xpk_script_needs_a_config_for_other_slices(tmp_path):
  result = run_xpk_script(tmp_path, TPU_TYPE="v5p-32", XPK="false")
  assert result.returncode == 2 and "no default config for TPU_TYPE=v5p-32" in result.stderr


def test_xpk_script_refuses_what_is_not_a_maxdiffusion_checkout(tmp_path):
  env = {**os.environ, "CLUSTER": "c1", "OUTPUT_DIR": "gs://b/out"}
  result = subprocess.run([str(GKE / "xpk.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 2 and "is not a MaxDiffusion checkout" in result.stderr
