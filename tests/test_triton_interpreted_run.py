"""The hand-written Triton kernels under Triton's interpreter, in the default test run.

tests/test_triton_interpreter.py runs only in a process where Triton's interpreter was chosen before
triton was first imported (``TRITON_INTERPRET=1``); this test starts one, so that every run with
Triton installed (CI installs it with the ``test`` extra) checks the kernels' logic on the CPU: the
fp64 reference, the edge cases, the gradients read where they are.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from flash_inductor import _compat, triton_adam

TESTS = pathlib.Path(__file__).parent


@pytest.mark.skipif(not _compat.HAS_TRITON, reason="needs Triton (pip install -e '.[test]')")
@pytest.mark.skipif(triton_adam.INTERPRETED, reason="this process runs tests/test_triton_interpreter.py itself")
def test_triton_kernels_pass_under_the_interpreter():
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_triton_interpreter.py")]
    run = subprocess.run(command, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]
