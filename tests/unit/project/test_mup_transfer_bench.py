"""bench.mup_transfer's reading of a sweep: the best LR of the mean over seeds, each seed's best, the
paired margin of the better grid neighbour, and how many grid steps the best LR moves over the
widths (the figures docs/mup.md and docs/benchmarks.md report)."""

from __future__ import annotations

import math

import pytest

from bench.mup_transfer import Sweep, vertex

LRS = [0.001, 0.002, 0.004, 0.008]


def sweep() -> Sweep:
    """Standard: the best LR halves with each doubling of the width (0.008 at 32, 0.002 at 128);
    µP: 0.004 everywhere. Seed 1 is 0.1 worse everywhere than seed 0 (paired noise cancels), and
    at width 128 under µP one seed prefers the neighbour."""
    loss = {}
    for w, best in ((32, 3), (64, 2), (128, 1)):
        for i, lr in enumerate(LRS):
            for s in (0, 1):
                loss["standard", w, lr, s] = 2.0 + 0.05 * abs(i - best) + 0.1 * s
                loss["mup", w, lr, s] = 2.0 + 0.05 * abs(i - 2) + 0.1 * s
    loss["mup", 128, 0.008, 1] = 2.0 + 0.1 - 0.01  # seed 1 alone: 0.008 better than 0.004
    loss["standard", 64, 0.008, 0] = math.inf  # a diverged run: that cell's mean is inf
    return Sweep([32, 64, 128], LRS, [0, 1], loss)


def test_best_lr_of_the_mean_each_seeds_best_and_the_paired_margin():
    sw = sweep()
    assert [sw.best("standard", w) for w in (32, 64, 128)] == [3, 2, 1] and sw.moves("standard") == 2
    assert [sw.best("mup", w) for w in (32, 64, 128)] == [2, 2, 2] and sw.moves("mup") == 0
    assert sw.seed_best("mup", 128) == [2, 3]
    mean, std, neighbour = sw.margin("mup", 128)  # paired differences 0.05 and -0.01
    assert (mean, neighbour) == (pytest.approx(0.02), 0.008) and std == pytest.approx(math.sqrt(2 * 0.03**2))
    mean, std, neighbour = sw.margin("standard", 32)  # seed offsets cancel: exactly 0.05, no spread
    assert (mean, std, neighbour) == (pytest.approx(0.05), pytest.approx(0.0), 0.004)
    assert sw.mean_std("standard", 64, 0.008) == (math.inf, math.inf)
    text = sw.text("adamw", 100)
    assert (
        "| 32 | 2.200 (± 0.071) | 2.150 (± 0.071) | 2.100 (± 0.071) | 2.050 (± 0.071) | 0.008 (edge) | 0.008, 0.008 "
        "| 0.050 (± 0.000, vs 0.004) | 0.008 (± 0.00 grid steps) |"
    ) in text
    assert "diverged" in text
    assert sw.summary() == [["standard", "0.008, 0.004, 0.002", 2, "no"], ["mup", "0.004, 0.004, 0.004", 0, "yes"]]


def test_the_fitted_optimum_is_the_parabolas_vertex_in_grid_steps():
    assert vertex([3.0, 1.0, 2.0]) == pytest.approx(1 + 0.5 * (3 - 2) / 3)  # leans toward the lower neighbour
    assert vertex([2.0, 1.0, 2.0, 5.0]) == 1.0 and vertex([1.0, 2.0, 3.0]) == 0.0  # symmetric; at the edge
    assert vertex([math.inf, 1.0, 2.0]) == 1.0  # next to a diverged run
    sw = sweep()
    assert sw.fitted("mup", 64) == (pytest.approx(2.0), pytest.approx(0.0))
    assert sw.fitted("mup", 128) == (pytest.approx(2.5), pytest.approx(0.5**0.5))  # seed 0 at 2, seed 1 at the edge (3)
    assert sw.lr_at(2.0) == pytest.approx(0.004) and sw.lr_at(2.5) == pytest.approx(0.004 * 2**0.5)
