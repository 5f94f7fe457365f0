"""MaxDiffusion's own Wan 2.1 trainer (``train_wan``, unchanged) with ``attention: svg``: a tiny
random Wan on synthetic data, through ``python -m maxdiffusion_svg.train`` and the shipped
fine-tuning config, ``scan_layers`` on (the trainer's default: ``nnx.scan`` inside
``nnx.value_and_grad``)."""

import math

import pytest

from md_required import require_maxdiffusion

require_maxdiffusion()

# pylint: disable=wrong-import-position
from maxdiffusion_svg.testing import tiny_train
from tiny_runs import ROOT

CONFIG = str(ROOT / "configs" / "wan_svg_train.yml")
STEPS = 2


@pytest.fixture(scope="module")
def checkpoint(wan21_checkpoint):
  return wan21_checkpoint


def run(checkpoint, workdir, *keys):
  return tiny_train.train([CONFIG, f"pretrained_model_name_or_path={checkpoint}",
                           f"max_train_steps={STEPS}", *tiny_train.TINY, *keys], str(workdir))


@pytest.fixture(scope="module")
def dense_losses(checkpoint, tmp_path_factory):
  losses, _ = run(checkpoint, tmp_path_factory.mktemp("dense"), "attention=dot_product")
  assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
  return losses


# CI time: svg's gradient is held to the masked reference in tests/kernels/test_gradients.py, and
# the sparse run below takes the trainer's path with the plugin.
@pytest.mark.full
def test_density_one_trains_as_dense_attention(checkpoint, dense_losses, tmp_path):
  # Every layer, every tile: the same model and data, so the same losses.
  losses, log = run(checkpoint, tmp_path, "svg_density=1.0", "svg_active_layers=[0, -1]")
  assert losses == pytest.approx(dense_losses, rel=1e-5)
  assert {(e["layer"], e["density"]) for e in log if e["sparse"]} == {(0, 1.0), (1, 1.0)}


@pytest.fixture(scope="module")
def sparse_run(checkpoint, tmp_path_factory):
  return run(checkpoint, tmp_path_factory.mktemp("sparse"), "svg_density=0.3",
             "svg_active_layers=[1, -1]")


def test_sparse_training_steps_run_on_the_layer_schedule(sparse_run):
  losses, log = sparse_run
  assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
  self_calls = {(e["layer"], e["sparse"], e["density"]) for e in log if e["kind"] == "self"}
  assert self_calls == {(0, False, 0.3), (1, True, 0.3)}  # the layer schedule holds in training


# CI time: the dense run this needs is one more training run; the test above shows the sparse
# calls traced in training.
@pytest.mark.full
def test_sparse_training_steps_have_their_own_losses(sparse_run, dense_losses):
  # Off by more than density 1 may be (a tiny random model's attention moves its loss little).
  assert sparse_run[0] != pytest.approx(dense_losses, rel=1e-5)


@pytest.mark.full
def test_without_scan_layers_and_with_remat(checkpoint, dense_losses, tmp_path):
  losses, _ = run(checkpoint, tmp_path, "svg_density=1.0", "svg_active_layers=[0, -1]",
                  "scan_layers=False", "remat_policy=HIDDEN_STATE_WITH_OFFLOAD")
  assert losses == pytest.approx(dense_losses, rel=1e-5)
