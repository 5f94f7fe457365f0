"""The per-layer guard as calibrate's held-out report and bench calibrate judge a choice: the
items the allocation's caps would have forbidden."""

import numpy as np

from maxdiffusion_svg.measure.calibration import FLOOR_DB, MAX_LOSS_DB, guard_broken, psnr_db


def test_an_item_breaks_the_guard_exactly_where_it_passes_its_cap():
  """By hand: more than 3 dB below uniform and under 30 dB; the cap the allocation puts on an
  item (its uniform error x 10^(3/10), or the 30 dB floor if higher) forbids the same ones."""
  rng = np.random.default_rng(0)
  uniform = 10 ** -rng.uniform(0, 12, 2000)
  chosen = uniform * 10 ** rng.uniform(-1, 2, 2000)
  broken = guard_broken(chosen, uniform)
  by_hand = [(-10 * np.log10(u)) - (-10 * np.log10(c)) > MAX_LOSS_DB and -10 * np.log10(c) < FLOOR_DB
             for c, u in zip(chosen, uniform)]
  np.testing.assert_array_equal(broken, by_hand)
  caps = np.maximum(uniform * 10 ** (MAX_LOSS_DB / 10), 10 ** (-FLOOR_DB / 10))
  np.testing.assert_array_equal(broken, chosen > caps)
  assert broken.any() and not broken.all()
  assert psnr_db(1e-3) == 30 and psnr_db(0) == 300  # (an exact output: the clamp)
