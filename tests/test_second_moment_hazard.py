"""The second moment's small-value hazard (issue 15): Adam with the package's 8-bit states against
fp64 Adam, through benchmarks/second_moment_hazard.py's simulation (its fp64 Adam is the reference).

Gradients whose per-element scale spreads log-normally (sigma 2) within each group of 32 put many
second moments below 1/510 of their group's largest: the paper's rounding stores them as 0 and the
next update explodes; the package's floor (code 1 for any positive sqrt(v)) keeps them bounded.
"""

import pytest

from helpers import benchmark_module, one_thread


@pytest.fixture(scope="module")
def hazard():
    with one_thread():  # 2k-element ops
        yield benchmark_module("second_moment_hazard")


@pytest.mark.parametrize("beta2", [0.999, 0.95])
def test_package_states_keep_adam_updates_bounded(hazard, beta2):
    package = hazard.simulate(hazard.store_package, sigma=2.0, beta2=beta2, groups=64, steps=200)
    paper = hazard.simulate(hazard.store_paper, sigma=2.0, beta2=beta2, groups=64, steps=200)
    assert package["max_fp64"] == paper["max_fp64"] < 1.2  # same gradients, fp64 Adam
    # the hazard is real under the paper's rounding ...
    assert paper["max_quantized"] > 1000 * paper["max_fp64"]
    assert paper["over_5x_above_1"] > 1e-3
    # ... and the floor removes it: within a few times fp64's largest update, and a mean within 20%
    assert package["max_quantized"] < 3 * package["max_fp64"]
    assert package["over_5x_above_1"] < 1e-4
    assert 0.8 < package["mean_ratio"] < 1.05


def test_without_spread_every_rule_matches_fp64(hazard):
    """sigma 0: no element is far below its group's largest, so no rule has anything to fix."""
    for store in hazard.RULES.values():
        row = hazard.simulate(store, sigma=0.0, beta2=0.999, groups=16, steps=100)
        assert row["max_quantized"] < 1.5 * row["max_fp64"] and row["over_5x_above_1"] == 0
        assert abs(row["mean_ratio"] - 1) < 0.01
