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

import jax.numpy as jnp
import pytest
import yaml
from shipped_configs import own_chain

from maxdiffusion_svg.kernels.tpu_memory import check_fits
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import TPU_BACKENDS, resolve_backend, tpu_target
from maxdiffusion_svg.plugin import preflight
from maxdiffusion_svg.plugin.settings import PluginSettings

ROOT = pathlib.Path(__file__).parent.parent
GKE = ROOT / "scripts" / "gke"
WAN14B_HEADS = 40
# Slices: manifest -> (topology, hosts, chips per host).
MANIFESTS = {"jobset_v6e8.yaml": ("2x4", 1, 8), "jobset_v6e16.yaml": ("4x4", 4, 4),
             "jobset_v6e32.yaml": ("4x8", 8, 4)}
LABEL = "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
# base_wan_14b.yml's video and Wan 14B's head size (MaxDiffusion's base is not installed here).
WAN14B_VIDEO = {"num_frames": 81, "height": 720, "width": 1280}
WAN14B_HEAD_DIM = 128


def libtpu_flags() -> list[str]:
  """The flags of scripts/gke/libtpu_init_args.txt, the one list the launch files pass."""
  lines = (line.split("#", 1)[0].strip() for line in
           (GKE / "libtpu_init_args.txt").read_text().splitlines())
  return [line for line in lines if line]


def topology_devices(manifest: str) -> int:
  topology, _, _ = MANIFESTS[manifest]
  return math.prod(map(int, topology.split("x")))


def container_of(manifest: str) -> dict:
  jobset = yaml.safe_load((GKE / manifest).read_text())
  (job,) = jobset["spec"]["replicatedJobs"]
  (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
  return container


def merged_config(name: str) -> dict:
  """Our chain of configs, over base_wan_14b.yml's mesh keys (context auto, the rest 1)."""
  data = own_chain(ROOT / "configs" / name)
  return {"ici_data_parallelism": 1, "ici_fsdp_parallelism": 1, "ici_tensor_parallelism": 1,
          "ici_context_parallelism": -1, **data}


def context_shards(config: dict, devices: int) -> int:
  fixed = math.prod(config[f"ici_{axis}_parallelism"] for axis in ("data", "fsdp", "tensor"))
  context = config["ici_context_parallelism"]
  return devices // fixed if context == -1 else context


def ulysses_and_ring(config: dict, devices: int) -> tuple[int, int]:
  """The config's split of its context axis on ``devices`` for Wan 14B, as the pre-flight
  checks it before weights load (raises where the run would stop)."""
  job = preflight.Job(process_count=1, device_count=devices, local_device_count=devices,
                      context_shards=context_shards(config, devices), heads=WAN14B_HEADS,
                      ulysses_shards=config.get("ulysses_shards", -1),
                      backend=config.get("svg_backend", "auto"))
  ulysses, ring = preflight.check_heads(job)
  preflight.check_backend_on_ring(job.backend, ulysses, ring)
  return ulysses, ring


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
  # The config's mesh passes the pre-flight for Wan 14B's heads on this slice.
  ulysses, _ = ulysses_and_ring(merged_config(config.name), hosts * chips)
  assert WAN14B_HEADS % ulysses == 0


def test_libtpu_flags_are_maxdiffusion_wan_runs_with_its_vmem_limit():
  flags = libtpu_flags()
  assert len(flags) == len(set(flags)) and all(re.fullmatch(r"--\w+=\S+", f) for f in flags)
  for flag in ("--xla_tpu_scoped_vmem_limit_kib=65536", "--xla_tpu_enable_async_all_to_all=true",
               "--xla_tpu_enable_async_collective_fusion=true"):
    assert flag in flags


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_manifest_passes_the_libtpu_flags_and_the_plugin_fits_its_vmem_limit(manifest,
                                                                            monkeypatch):
  """The JobSet's LIBTPU_INIT_ARGS are the shared list; read as the plugin reads them in the
  pod, they give a v6e the 64 MiB limit MaxDiffusion's Wan runs compile under, and the tiles the
  config gets there fit it (each TPU kernel's defaults, as the plugin checks before compiling)."""
  env = {v["name"]: v.get("value") for v in container_of(manifest)["env"]}
  assert env["LIBTPU_INIT_ARGS"].split() == libtpu_flags()
  monkeypatch.setenv("LIBTPU_INIT_ARGS", env["LIBTPU_INIT_ARGS"])
  target = tpu_target("v6e")  # what the plugin builds for the pod's v6e devices
  assert (target.vmem_limit, target.vmem_source) == (65536 * 1024, "LIBTPU_INIT_ARGS")
  command = container_of(manifest)["command"]
  config = {**WAN14B_VIDEO, **merged_config(pathlib.PurePosixPath(command[3]).name)}
  grid = VideoGrid.for_video(config["num_frames"], config["height"], config["width"])
  _, ring = ulysses_and_ring(config, topology_devices(manifest))
  for backend in ("auto", *TPU_BACKENDS):
    if ring > 1 and backend == "splash":
      continue  # refused before weights load on a ring (test_preflight.py)
    svg = PluginSettings.from_mapping({**config, "svg_backend": backend}).svg
    kernel = resolve_backend(backend, target)
    assert kernel in TPU_BACKENDS
    tiles = svg.tiles(target, kernel)
    check_fits(svg.plan(grid, target=target, backend=kernel), WAN14B_HEAD_DIM, jnp.bfloat16,
               tiles.block_kv_compute, target, kernel)


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
    ("v6e-8", 2, 4, "2x4", "wan_svg.yml"), ("v6e-16", 4, 4, "4x4", "wan_svg_v6e16.yml"),
    ("v6e-32", 8, 4, "4x8", "wan_svg_v6e32.yml"), ("v6e-64", 16, 4, "8x8", "wan_svg_v6e64.yml")])
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
  # No JOBSET_NAME (the run name must be in the command); the shared libtpu flags.
  env = {v["name"]: v["value"] for v in container["env"]}
  assert env == {"LIBTPU_INIT_ARGS": " ".join(libtpu_flags())}
  script = container["command"][-1]
  ours = (f"pip install . && pip install --no-deps maxdiffusion_svg_stage/*.whl && "
          f"python -m maxdiffusion_svg.generate maxdiffusion_svg_stage/configs/{config} "
          f"run_name=svg-test output_dir=gs://b/out num_inference_steps=20")
  assert ours in script
  ulysses, ring = ulysses_and_ring(merged_config(config), hosts * chips)  # the pre-flight passes
  assert (ulysses, ring) == ((8, 1) if hosts * chips <= 16 else (8, hosts * chips // 16))
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


@pytest.mark.parametrize("output_dir", ["/tmp/out", "out", "gs:/b/out", "gs://", "s3://b/out",
                                        "gs://b/out"])
def test_xpk_script_takes_only_a_bucket_output_dir(tmp_path, output_dir):
  """A fake xpk records its arguments: it runs, with the shared libtpu flags, only for gs://."""
  calls = tmp_path / "xpk_calls"
  fake_xpk = tmp_path / "xpk"
  fake_xpk.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
  fake_xpk.chmod(0o755)
  result = run_xpk_script(tmp_path, XPK=str(fake_xpk), OUTPUT_DIR=output_dir)
  if output_dir == "gs://b/out":
    assert result.returncode == 0, result.stderr
    assert f"--env LIBTPU_INIT_ARGS={' '.join(libtpu_flags())} --command" in calls.read_text()
    return
  assert result.returncode == 2, result.stderr
  assert result.stderr == (f"error: OUTPUT_DIR must be a gs:// folder (the pods upload videos "
                           f"there), got '{output_dir}'\n")
  assert not calls.exists()  # xpk never ran
  assert not (tmp_path / "maxdiffusion" / "maxdiffusion_svg_stage").exists()  # nor the stage


def test_xpk_script_refuses_what_is_not_a_maxdiffusion_checkout(tmp_path):
  env = {**os.environ, "CLUSTER": "c1", "OUTPUT_DIR": "gs://b/out"}
  result = subprocess.run([str(GKE / "xpk.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, check=False)
  assert result.returncode == 2 and "is not a MaxDiffusion checkout" in result.stderr
