"""The MaxDiffusion tree the integration tier runs against: a missing or corrupt archive, or
another commit, fails in one line that says which; the tier never skips silently in CI."""

import io
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

ROOT = pathlib.Path(__file__).parent.parent
TREE = ROOT / "scripts" / "maxdiffusion_tree.py"
TIER = ROOT / "scripts" / "test_maxdiffusion.sh"
SHARED = ROOT.parent / "shared" / "maxdiffusion"


def tree_cli(*args, env=None):
  done = subprocess.run([sys.executable, str(TREE), *map(str, args)], capture_output=True,
                        text=True, check=False, env={**os.environ, **(env or {})})
  return done.returncode, done.stdout, done.stderr


def fake_archive(path: pathlib.Path, top="maxdiffusion-abc", pyconfig=b"x = 1\n"):
  """A tar.gz shaped as the shared archive, holding a MaxDiffusion that is not the tested one."""
  with tarfile.open(path, "w:gz") as tar:
    for name, data in ((f"{top}/src/maxdiffusion/pyconfig.py", pyconfig),
                       (f"{top}/src/maxdiffusion/__init__.py", b"")):
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return path


def one_error_line(stderr):
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), stderr
  return lines[0]


def test_the_tested_commit_is_the_drift_guards():
  """The script stands alone (no package import); its commit must be the plugin's."""
  from maxdiffusion_svg.plugin import contract  # pylint: disable=import-outside-toplevel
  assert f'TESTED_COMMIT = "{contract.TESTED_COMMIT}"' in TREE.read_text(encoding="utf-8")


def test_a_missing_archive_is_named(tmp_path):
  code, _, err = tree_cli("unpack", tmp_path / "none.tar.gz", tmp_path / "out")
  assert code == 1 and "archive missing" in one_error_line(err) and "none.tar.gz" in err
  code, _, err = tree_cli("unpack", tmp_path, tmp_path / "out")  # a folder without it
  assert code == 1 and "no maxdiffusion-7cfb8801d41d.tar.gz in" in one_error_line(err)


def test_a_corrupt_archive_is_named(tmp_path):
  good = fake_archive(tmp_path / "good.tar.gz").read_bytes()
  (tmp_path / "cut.tar.gz").write_bytes(good[:len(good) // 2])
  code, _, err = tree_cli("unpack", tmp_path / "cut.tar.gz", tmp_path / "out")
  assert code == 1 and "is corrupt" in one_error_line(err)
  (tmp_path / "text.tar.gz").write_text("not an archive")
  code, _, err = tree_cli("unpack", tmp_path / "text.tar.gz", tmp_path / "out")
  assert code == 1 and "is corrupt" in one_error_line(err)


def test_another_commit_is_named_and_can_be_allowed_on_purpose(tmp_path):
  archive = fake_archive(tmp_path / "other.tar.gz")
  code, _, err = tree_cli("unpack", archive, tmp_path / "out")
  assert code == 1
  assert "is not MaxDiffusion 7cfb8801d41d" in one_error_line(err) and "source digest" in err
  code, out, _ = tree_cli("unpack", archive, tmp_path / "out2",
                          env={"MAXDIFFUSION_ANY_COMMIT": "1"})
  assert code == 0 and out.strip() == str(tmp_path / "out2" / "maxdiffusion-abc")
  code, _, err = tree_cli("check", tmp_path)
  assert code == 1 and "not a MaxDiffusion source tree" in one_error_line(err)


def run_tier(tmp_path, **env):
  full = {k: v for k, v in os.environ.items()
          if k not in ("MAXDIFFUSION_SRC", "MAXDIFFUSION_ARCHIVE", "CI")}
  full.update({"MD_PY": sys.executable, **env})
  done = subprocess.run(["bash", str(TIER), "ci"], capture_output=True, text=True, check=False,
                        env=full, cwd=tmp_path)
  return done.returncode, done.stdout, done.stderr


def test_the_tier_skips_with_its_reason_outside_ci_and_fails_in_ci(tmp_path):
  missing = str(tmp_path / "no-such-folder")
  code, out, _ = run_tier(tmp_path, MAXDIFFUSION_ARCHIVE=missing)
  assert code == 0 and "MaxDiffusion integration tier (ci) skipped: no MaxDiffusion tree" in out
  code, out, err = run_tier(tmp_path, MAXDIFFUSION_ARCHIVE=missing, CI="true")
  assert code == 1 and "cannot run in CI" in one_error_line(err) and "skipped" not in out


def test_the_tier_fails_on_a_corrupt_or_foreign_archive(tmp_path):
  (tmp_path / "bad.tar.gz").write_text("not an archive")
  code, _, err = run_tier(tmp_path, MAXDIFFUSION_ARCHIVE=str(tmp_path / "bad.tar.gz"), CI="true")
  assert code == 1 and "is corrupt" in err
  archive = fake_archive(tmp_path / "other.tar.gz")
  temporary = tmp_path / "tmp"
  temporary.mkdir()
  code, _, err = run_tier(tmp_path, MAXDIFFUSION_ARCHIVE=str(archive), TMPDIR=str(temporary))
  assert code == 1 and "is not MaxDiffusion 7cfb8801d41d" in err
  assert list(temporary.iterdir()) == []  # the unpacked tree is removed


@pytest.mark.skipif(not SHARED.is_dir(), reason="no ../shared/maxdiffusion beside the checkout")
def test_the_shared_archive_is_the_tested_commit(tmp_path):
  code, out, err = tree_cli("unpack", SHARED, tmp_path)
  assert code == 0, err
  assert out.strip() == str(tmp_path / "maxdiffusion-7cfb8801d41d")
