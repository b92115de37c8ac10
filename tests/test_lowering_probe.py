"""benchmarks/lowering_probe.py: Inductor's CUDA lowering on the CPU stores the FP8 cast that both
``_scaled_mm`` and ``transpose_fp8`` read once with fp8_transpose_source and twice without it. It
needs Triton (skipped where it is not installed, as with CPU builds of torch) and runs in a process of
its own (the probe answers CUDA queries as an H200 would)."""

import importlib.util
import subprocess
import sys

import pytest

from helpers import BENCHMARKS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


@pytest.mark.parametrize("dynamic", [[], ["--dynamic"]])
@pytest.mark.parametrize("disable, stores", [((), 1), (("fp8_transpose_source",), 2)])
def test_the_cast_read_by_the_transpose_and_the_gemm_is_stored_once_with_the_pass(disable, stores, dynamic):
    probe = subprocess.run([sys.executable, str(BENCHMARKS / "lowering_probe.py"), *dynamic, "--disable", *disable],
                           capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert f"the cast of g (arg0_1) stored {stores} time(s)" in probe.stdout, probe.stdout
