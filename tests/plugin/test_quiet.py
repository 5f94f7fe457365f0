"""Quiet runs (``plugin.quiet``): what a run prints goes to the log, at the file descriptors too
(a child process's stderr, C++ logs), and only the lines a command keeps reach the terminal."""

import os
import pathlib
import subprocess
import sys

import pytest

from maxdiffusion_svg.plugin import quiet


def test_everything_goes_to_the_log_and_the_plugins_lines_to_the_terminal(tmp_path, capfd):
  log = tmp_path / "run" / "maxdiffusion.log"
  with quiet.to_log(log) as terminal:
    print("Config param attention: svg")  # MaxDiffusion's config dump
    print("maxdiffusion_svg: run summary: 20 self-attention calls")
    print("I0000 port.cc:153] oneDNN custom operations are on", file=sys.stderr)
    os.write(1, b"written at fd 1\n")
    subprocess.run(["sh", "-c", "echo 'fatal: not a git repository' >&2"], check=True)
    print("error: a refusal", file=sys.stderr)
    print("generate: done", file=terminal.out)
    assert terminal.log == log
  out, err = capfd.readouterr()
  assert out == "maxdiffusion_svg: run summary: 20 self-attention calls\ngenerate: done\n"
  assert err == "error: a refusal\n"
  text = log.read_text()
  for line in ("Config param attention: svg", "maxdiffusion_svg: run summary", "oneDNN",
               "written at fd 1", "fatal: not a git repository", "error: a refusal"):
    assert line in text, line
  assert "generate: done" not in text  # the command's own line: the terminal's only
  print("after")  # the terminal is back
  assert capfd.readouterr().out == "after\n"


def test_a_tool_keeps_only_warnings_and_refusals(tmp_path, capfd):
  with quiet.to_log(tmp_path / "x.log", keep=quiet.WARNINGS):
    print("maxdiffusion_svg: transformer: SVG attention: density 0.3")
    print("maxdiffusion_svg: warning: no call was sparse")
  out, _ = capfd.readouterr()
  assert out == "maxdiffusion_svg: warning: no call was sparse\n"


def test_a_progress_bar_or_partial_line_is_not_held_back(tmp_path, capfd):
  with quiet.to_log(tmp_path / "x.log"):
    sys.stdout.write("maxdiffusion_svg: a")
    sys.stdout.write(" line\rstep 1/10\rstep 2/10")
  assert capfd.readouterr().out == "maxdiffusion_svg: a line\n"
  assert (tmp_path / "x.log").read_bytes() == b"maxdiffusion_svg: a line\rstep 1/10\rstep 2/10"


def test_verbose_changes_nothing_and_a_nested_run_shares_the_outer_log(tmp_path, capfd):
  with quiet.to_log(None) as terminal:
    print("Config param attention: svg")
    assert terminal.log is None
  assert capfd.readouterr().out == "Config param attention: svg\n"
  with quiet.to_log(tmp_path / "outer.log") as outer:
    with quiet.to_log(tmp_path / "inner.log") as inner:
      print("Config param height: 128")
    assert inner is outer
  assert not (tmp_path / "inner.log").exists()
  assert "height" in (tmp_path / "outer.log").read_text()
  assert capfd.readouterr() == ("", "")


def test_a_failure_names_the_log_and_an_exit_says_nothing_more(tmp_path, capfd):
  log = tmp_path / "x.log"
  with pytest.raises(RuntimeError):
    with quiet.to_log(log):
      raise RuntimeError("boom")
  assert capfd.readouterr().err == (f"MaxDiffusion's output up to here: {log} "
                                    f"(--verbose prints it)\n")
  with pytest.raises(SystemExit):
    with quiet.to_log(log):
      print("error: one line", file=sys.stderr)
      sys.exit(2)
  assert capfd.readouterr().err == "error: one line\n"  # a refusal stays one line


def test_a_stream_kept_from_the_run_writes_to_the_terminal_after_it(tmp_path, capfd):
  """A logging handler made during the run holds the run's sys.stderr: after it, its lines are
  the terminal's again, not lost."""
  with quiet.to_log(tmp_path / "x.log"):
    kept = sys.stderr
  kept.write("later\n")
  kept.flush()
  assert capfd.readouterr().err == "later\n"


@pytest.mark.parametrize("output_dir, run_name, expected", [
    ("tiny_output", "tiny", pathlib.Path("tiny_output/tiny/maxdiffusion.log").absolute()),
    ("/abs/out", "", pathlib.Path("/abs/out/maxdiffusion.log")),
    ("gs://bucket/out", "job", None),  # a cluster's run: its output stays in the job's log
    ("", "job", None),
])
def test_a_generation_logs_in_its_own_folder(output_dir, run_name, expected):
  assert quiet.log_path(output_dir, run_name) == expected


def test_writing_a_video_warns_of_no_fork(monkeypatch):
  monkeypatch.delenv("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", raising=False)
  quiet.calm_child_processes()
  assert os.environ["IMAGEIO_FFMPEG_NO_PREVENT_SIGINT"] == "1"
