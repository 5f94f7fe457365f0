"""The GKE launch files: the JobSet runs the launcher on a v6e-8 slice; the XPK script stages the
plugin into a MaxDiffusion checkout and asks XPK for the same command."""

import os
import pathlib
import subprocess
import sys
import zipfile

import yaml

ROOT = pathlib.Path(__file__).parent.parent
GKE = ROOT / "scripts" / "gke"


def test_jobset_runs_the_launcher_on_a_v6e8_slice():
  jobset = yaml.safe_load((GKE / "jobset_v6e8.yaml").read_text())
  assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  (job,) = jobset["spec"]["replicatedJobs"]
  pod = job["template"]["spec"]["template"]["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                 "cloud.google.com/gke-tpu-topology": "2x4"}
  (container,) = pod["containers"]
  assert container["resources"]["limits"]["google.com/tpu"] == 8
  script = " ".join(container["command"] + container["args"])
  install, run = script.split(" && ")
  assert install.endswith("pip install --no-deps /gcs/maxdiffusion_svg/*.whl")
  words = run.split()
  assert words[:4] == ["python", "-m", "maxdiffusion_svg.generate",
                       "/gcs/maxdiffusion_svg/configs/wan_svg.yml"]
  assert (ROOT / "configs" / "wan_svg.yml").is_file()  # what the staged configs hold
  assert all("=" in w for w in words[4:]) and any(w.startswith("output_dir=gs://") for w in words)
  # run_name is always defined: MaxDiffusion joins output_dir with it to upload the video.
  assert "run_name=${JOBSET_NAME}" in words
  (env,) = container["env"]
  assert env["name"] == "JOBSET_NAME" and env["valueFrom"]["fieldRef"]["fieldPath"] == (
      "metadata.labels['jobset.sigs.k8s.io/jobset-name']")
  mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
  (volume,) = pod["volumes"]
  assert mounts[volume["name"]] == "/gcs" and volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"


def test_xpk_script_stages_the_plugin_and_runs_the_launcher(tmp_path):
  checkout = tmp_path / "maxdiffusion"
  (checkout / "src" / "maxdiffusion").mkdir(parents=True)
  (checkout / "src" / "maxdiffusion" / "generate_wan.py").write_text("")
  record = tmp_path / "xpk_args"
  fake_xpk = tmp_path / "xpk"
  fake_xpk.write_text(f"#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" > {record}\n")
  fake_xpk.chmod(0o755)
  env = {**os.environ, "CLUSTER": "c1", "OUTPUT_DIR": "gs://b/out", "RUN_NAME": "svg-test",
         "XPK": str(fake_xpk), "PYTHON": sys.executable}
  result = subprocess.run([str(GKE / "xpk_v6e8.sh"), str(checkout), "wan22_svg.yml",
                           "num_inference_steps=20"], env=env, capture_output=True, text=True,
                          check=False)
  assert result.returncode == 0, result.stderr
  args = record.read_text().splitlines()
  assert args[:2] == ["workload", "create"]
  assert "--tpu-type=v6e-8" in args and "--num-slices=1" in args
  assert args[args.index("--cluster") + 1] == "c1" and args[args.index("--workload") + 1] == "svg-test"
  command = args[args.index("--command") + 1]
  assert command.split(" && ") == [
      "pip install .", "pip install --no-deps maxdiffusion_svg_stage/*.whl",
      "python -m maxdiffusion_svg.generate maxdiffusion_svg_stage/configs/wan22_svg.yml "
      "run_name=svg-test output_dir=gs://b/out num_inference_steps=20"]
  stage = checkout / "maxdiffusion_svg_stage"
  (wheel,) = stage.glob("*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert "maxdiffusion_svg/plugin/launcher.py" in names
  entry_points = next(n for n in names if n.endswith("entry_points.txt"))
  assert "maxdiffusion.plugins" in zipfile.ZipFile(wheel).read(entry_points).decode()
  assert (stage / "configs" / "wan22_svg.yml").is_file()


def test_xpk_script_refuses_what_is_not_a_maxdiffusion_checkout(tmp_path):
  env = {**os.environ, "CLUSTER": "c1", "OUTPUT_DIR": "gs://b/out"}
  result = subprocess.run([str(GKE / "xpk_v6e8.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 2 and "is not a MaxDiffusion checkout" in result.stderr
