"""tokamax is optional: without it our kernel and XLA run, and what needs Splash is refused in
one line naming the fix (the TPU chip's stack has no tokamax)."""

import subprocess
import sys

import jax.numpy as jnp
import pytest

from maxdiffusion_svg.kernels import api, splash_backward, tokamax_splash
from maxdiffusion_svg.plan.geometry import VideoGrid
from maxdiffusion_svg.plan.target import tpu_target
from maxdiffusion_svg.plan.tiles import plan_tiles


def test_the_package_runs_our_kernel_and_xla_without_tokamax():
  code = ("import sys; sys.modules['tokamax'] = None\n"
          "import numpy as np, jax.numpy as jnp\n"
          "from maxdiffusion_svg import VideoGrid, plan_tiles, sparse_attention\n"
          "from maxdiffusion_svg.kernels import tokamax_splash\n"
          "assert not tokamax_splash.available()\n"
          "g = VideoGrid(4, 8, 8); plan = plan_tiles(g, 0.5, 128, 128, 'aligned')\n"
          "x = jnp.ones((1, 1, g.tokens, 128))\n"
          "for backend in ('pallas', 'xla'):\n"
          "  assert np.isfinite(np.asarray(sparse_attention(x, x, x, plan, backend=backend))).all()\n"
          "print('ok')\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                        check=False)
  assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.fixture
def without_tokamax(monkeypatch):
  monkeypatch.setattr(tokamax_splash, "_MODULES", None)


def test_splash_is_refused_in_one_line_naming_the_fix(without_tokamax):  # pylint: disable=unused-argument
  plan = plan_tiles(VideoGrid(4, 8, 8), 0.5, 128, 128, "aligned")
  with pytest.raises(ValueError, match=r"^svg_backend splash needs tokamax .*pip install "
                                       r"'tokamax>=0\.0\.17,<0\.1', or use svg_backend pallas"):
    api.check_tpu_call(plan, 128, jnp.bfloat16, 128, tpu_target("v6e"), "splash")
  api.check_tpu_call(plan, 128, jnp.bfloat16, 128, tpu_target("v6e"), "pallas")  # ours: fine


def test_the_tpu_backward_is_refused_without_tokamax(without_tokamax):  # pylint: disable=unused-argument
  plan = plan_tiles(VideoGrid(4, 8, 8), 0.5, 128, 128, "aligned")
  with pytest.raises(ValueError, match=r"^the TPU backward .* needs tokamax"):
    splash_backward.check_backward_fits(plan, (128, 128, 128), 128, jnp.bfloat16,
                                        tpu_target("v6e"))
