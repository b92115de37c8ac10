"""The hand-written step's launch names (flash_inductor/triton_adam.py ``LaunchShape``): what the
benchmarks and results call a launch is what runs. Plain Python, no Triton needed."""

import pytest

from flash_inductor.triton_adam import LaunchShape


def test_the_default_is_the_approx_arithmetic_and_names_round_trip():
    default = LaunchShape()
    assert default.approx and default.name == "block64_warps4_approx"
    for name in ("block64_warps4_approx", "block64_warps4", "block16_warps2_vector8_evict_persist2_stages2_approx",
                 "block32_warps2"):
        assert LaunchShape.from_name(name).name == name


def test_a_name_without_approx_is_the_exact_arithmetic():
    """Results of earlier sessions name the exact kernel ``block64_warps4``: it keeps that meaning."""
    exact = LaunchShape.from_name("block64_warps4")
    assert not exact.approx and not exact.same_bytes_as_default
    assert LaunchShape.from_name("warps4_block64_approx") == LaunchShape()


@pytest.mark.parametrize("name", ["block64_block32", "approx_approx", "block3", "blocks64", "stages2"])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError):
        LaunchShape.from_name(name)
