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


def test_paired_difference_takes_each_seeds_gaps_against_its_own_baseline_run(windows):
    # baseline losses differ by seed; A and B sit above each seed's baseline by their own gaps; a seed
    # that B did not run, and one outside --seeds, do not count
    base = {0: 2.0, 1: 1.8, 2: 2.2, 3: 1.9, 4: 2.1}
    gap_a = {0: 0.02, 1: -0.01, 2: 0.03, 3: 0.00, 4: 0.5}
    gap_b = {0: 0.01, 1: 0.01, 2: 0.00, 4: -0.5}
    runs = {}
    for name, gaps in (("baseline", dict.fromkeys(base, 0.0)), ("A", gap_a), ("B", gap_b)):
        for s, g in gaps.items():
            runs[f"{name}@seed{s}" if s else name] = {"last50_loss": base[s] * (1 + g)}
    seeds = windows.parse_seeds("0-3")
    assert seeds == {0, 1, 2, 3} and windows.parse_seeds("0-1,4") == {0, 1, 4}
    n, mean, low, high, median, sd = windows.paired_difference(runs, "A", "B", seeds)
    diffs = [100 * (gap_a[s] - gap_b[s]) for s in (0, 1, 2)]
    assert n == 3
    assert mean == pytest.approx(statistics.mean(diffs)) and median == pytest.approx(statistics.median(diffs))
    assert sd == pytest.approx(statistics.stdev(diffs))
    # the t quantile of 2 degrees of freedom, 4.303
    assert high - mean == pytest.approx(mean - low) == pytest.approx(4.303 * sd / 3 ** 0.5, rel=1e-3)
    assert windows.describe(windows.last50_gaps(runs, "A", seeds=seeds))[0] == 4
    assert windows.paired_difference(runs, "A", "B", {0, 3}) is None  # one seed both ran: no spread
