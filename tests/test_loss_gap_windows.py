"""benchmarks/loss_gap_windows.py: per-window loss gaps against the baseline, seed by seed."""

import statistics

import pytest

from helpers import benchmark_module


@pytest.fixture(scope="module")
def windows():
    return benchmark_module("loss_gap_windows")


def test_each_window_gives_the_mean_and_spread_of_the_seeds_gaps(windows):
    # baseline losses 2.0 everywhere; the config's seed s is above it by gap[s] in the first window, then
    # by twice that; a seed only the config ran does not count
    gap = {0: 0.01, 1: 0.03, 2: -0.01}
    runs = {f"baseline@seed{s}" if s else "baseline": {"train_loss": [2.0] * 10} for s in gap}
    for s, g in {**gap, 3: 0.5}.items():
        runs[f"cfg@seed{s}" if s else "cfg"] = {"train_loss": [2.0 * (1 + g)] * 4 + [2.0 * (1 + 2 * g)] * 6}
    gaps, seeds = windows.gap_windows(runs, "cfg", [0, 4, 10])
    assert seeds == 3
    first = [100 * g for g in gap.values()]
    second = [200 * g for g in gap.values()]
    for (mean, sd), expected in zip(gaps, (first, second)):
        assert mean == pytest.approx(statistics.mean(expected))
        assert sd == pytest.approx(statistics.stdev(expected))
