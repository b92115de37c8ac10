"""benchmarks/fp8_layer_kernels.py: the Triton kernels Inductor writes for a Llama decoder layer's FP8
forward and backward on an H200, read on the CPU. No reduction over rows (an RMSNorm, a row's amax)
stores a tensor transposed, the slow kernels of flash_inductor/fp8_transpose.py: with tensorwise
scales, and with row-wise scales since their transposed casts go through ``transpose_fp8``; the
row-wise casts written as casts of ``t.t()`` (before) had such kernels. Looped reductions read rows
again; persistent ones do not. Stored scales (passes/fp8_scales_stored.py) leave the large
kernels that cast; the row-wise hybrid's rescaled casts are transposed without a pass of their own. It needs Triton and runs in a
process of its own (the probe answers CUDA queries as an H200 would)."""

import functools
import importlib.util
import json
import subprocess
import sys

import pytest

from helpers import BENCHMARKS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def _probe(tmp_path, *args):
    """The probe's summaries ({configuration: {graph: counts}}), run in a process of its own with ``args``."""
    out = tmp_path / "kernels.json"
    probe = subprocess.run([sys.executable, str(BENCHMARKS / "fp8_layer_kernels.py"), "--json", str(out), *args],
                           capture_output=True, text=True, timeout=900)
    assert probe.returncode == 0, probe.stderr[-3000:]
    return json.loads(out.read_text())["results"]


def _total(results, configuration, count):
    return sum(graph[count] for graph in results[configuration].values())


def _moved(results, configuration):
    """GB a configuration's layer moves: its Inductor kernels, their second reads and the transposes."""
    return sum(_total(results, configuration, count) for count in ("inductor_kernels_gb", "reread_gb", "transposes_gb"))


def test_no_reduction_kernel_stores_an_fp8_tensor_transposed(tmp_path):
    results = _probe(tmp_path)
    total = functools.partial(_total, results)

    assert total("tensorwise", "reductions_storing_transposed") == 0, results
    assert total("rowwise", "reductions_storing_transposed") == 0, results
    assert total("rowwise-before", "reductions_storing_transposed") > 0, results
    # row-wise transposes each weight (7), each distinct input (4: q/k/v and gate/up share theirs) and
    # each gradient (7); tensorwise the inputs and gradients of the weight-gradient GEMMs
    assert (total("rowwise", "transpose_kernel_launches"), total("tensorwise", "transpose_kernel_launches")) == (18, 11)
    # Rows of 2048 and 5632 are over Inductor's persistent-reduction threshold (1024): a kernel that casts
    # a row by its own amax loops over it twice or three times, and row-wise has more such kernels;
    # persistent reductions (as triton.multi_kernel compiles them) read each row once.
    assert total("rowwise", "reread_gb") > total("tensorwise", "reread_gb") > 0, results
    assert total("rowwise-persistent", "reread_gb") == total("tensorwise-persistent", "reread_gb") == 0, results
    # passes/fp8_scales_stored.py: the scales are computed where their amaxes are reduced, and the large
    # kernels that cast keep only row scales (one a row), where each computed its column scales per element
    assert total("rowwise", "scale_formulas_in_large_kernels") < total("rowwise-recomputed-scales",
                                                                       "scale_formulas_in_large_kernels"), results
    # fp8_tensorwise_weight_gradient: the weight gradient's operands come from the row casts, so the backward
    # has no casts by columns of the tokens: fewer kernels, and fewer rows read again
    hybrid, rowwise = results["rowwise-tensorwise-dw"]["backward"], results["rowwise"]["backward"]
    assert hybrid["triton_kernels"] < rowwise["triton_kernels"] and hybrid["reread_gb"] < rowwise["reread_gb"], results
    # and the casts are rescaled to one scale as transpose_fp8 copies them, not by kernels of their own: the
    # hybrid's backward moves no more bytes than tensorwise's (the same, with these shapes)
    assert hybrid["inductor_kernels_gb"] <= results["tensorwise"]["backward"]["inductor_kernels_gb"], results

    # row-wise casts by columns as transpose_fp8 copies the tensor, from a bf16 tensor stored once: its layer
    # moves about tensorwise's bytes (3% more), where casts by columns of their own moved 32% more
    assert _moved(results, "rowwise") < 1.1 * _moved(results, "tensorwise"), results


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_hf_llama_through_the_backend_moves_fewer_bytes_with_the_rescale_in_the_transpose(tmp_path):
    """``--trace backend``: HF Llama's layer through the backend's whole pipeline. No reduction stores a
    transposed tensor there either, and the row-wise hybrid's rescale inside ``transpose_fp8`` moves
    fewer bytes than a cast of its own before the copy did."""
    results = _probe(tmp_path, "--trace", "backend", "--configurations", "tensorwise", "rowwise-tensorwise-dw",
                     "rowwise-tensorwise-dw-before")
    for configuration in results:
        assert _total(results, configuration, "reductions_storing_transposed") == 0, configuration
    assert _moved(results, "rowwise-tensorwise-dw") < _moved(results, "rowwise-tensorwise-dw-before") - 0.2, results
    # every transpose of the hybrid's is still there (the weights' columns, the inputs, the gradients): rescaled as copied
    launches = {c: _total(results, c, "transpose_kernel_launches") for c in results}
    assert launches["rowwise-tensorwise-dw"] == launches["rowwise-tensorwise-dw-before"] == 18, launches
