"""The hand-written Adam kernel (flash_inductor/triton_adam.py) run by Triton's interpreter on the CPU,
with its exact and its ``approx`` arithmetic: against the fp64 reference (tests/test_optimizer_numerics.py's
check, fewer steps: the interpreter takes about a second per step) and on the edge cases of
tests/test_gpu.py. The interpreter is chosen when triton is first imported, so these run only in a
process started with it (and skip where Triton is not installed, as on CPU builds of torch):

    TRITON_INTERPRET=1 python -m pytest tests/test_triton_interpreter.py

The interpreter computes in numpy: divisions and square roots exactly rounded, no fused multiply-add
(``_INTERPRETED`` branches of the kernel), NaN-propagating min/max; that tests the kernel's logic
and its exactness claims, not the GPU's instructions (tests/test_gpu.py does).
"""

import numpy as np
import pytest
import torch

from flash_inductor import _compat, roles, triton_adam
from test_gpu import (
    ADAM_CASES,
    ARITHMETICS,
    check_backward_leaves_gradients_to_the_kernel,
    check_gradients_read_in_place,
    check_kept_zero_gradients_are_the_flat_views,
    check_kernel_edge_cases,
    check_report_names_the_gradients_copied,
)
from test_optimizer_numerics import check_one_step_against_fp64_reference

pytestmark = [
    pytest.mark.skipif(not (_compat.HAS_TRITON and triton_adam.INTERPRETED),
                       reason="needs Triton, imported with TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),  # numpy evaluates both sides of a tl.where
]


@pytest.fixture(autouse=True)
def torch_casts(monkeypatch):
    """Conversions between fp32 and bf16 or e4m3 as on the GPU (and in torch): the interpreter
    truncates fp32 to bf16, reads bf16 subnormals as zero, and rounds to e4m3 half up without carrying
    into the exponent."""
    import triton.language as tl
    from triton.runtime import interpreter

    narrow = {tl.bfloat16: (torch.bfloat16, np.uint16), tl.float8e4nv: (torch.float8_e4m3fn, np.uint8)}
    cast, fp_to_fp = interpreter.InterpreterBuilder.cast_impl, interpreter.InterpreterBuilder.create_fp_to_fp

    def through_torch(src, dst_type):
        data, kinds = np.ascontiguousarray(src.data), (src.dtype.scalar, dst_type.scalar)
        if kinds[0] == tl.float32 and kinds[1] in narrow:
            dtype, bits = narrow[kinds[1]]
            rounded = torch.from_numpy(data).to(dtype).view(getattr(torch, f"int{8 * np.dtype(bits).itemsize}"))
            return interpreter.TensorHandle(rounded.numpy().view(bits), dst_type.scalar)
        if kinds[1] == tl.float32 and kinds[0] in narrow:
            dtype, bits = narrow[kinds[0]]
            stored = torch.from_numpy(data.view(getattr(np, f"int{8 * np.dtype(bits).itemsize}"))).view(dtype)
            return interpreter.TensorHandle(stored.float().numpy(), dst_type.scalar)
        return None

    def patched(original):
        def convert(self, src, dst_type, *rounding):
            converted = through_torch(src, dst_type)
            return original(self, src, dst_type, *rounding) if converted is None else converted
        return convert

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", patched(cast))
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", patched(fp_to_fp))


@pytest.mark.parametrize("launch", ARITHMETICS[:2])
@pytest.mark.parametrize("name", list(ADAM_CASES))
def test_interpreted_kernel_matches_fp64_reference(name, launch, monkeypatch):
    monkeypatch.setattr(triton_adam, "LAUNCH", triton_adam.LaunchShape.from_name(launch))
    model, opt = check_one_step_against_fp64_reference(*ADAM_CASES[name], device="cpu", compile_options={}, steps=8)
    assert all(triton_adam.ineligible(b, b.optimizer) is None for b in roles.PREPARED[opt].buckets)


@pytest.mark.parametrize("launch", ARITHMETICS)
def test_interpreted_kernel_edge_cases(launch, monkeypatch):
    monkeypatch.setattr(triton_adam, "LAUNCH", triton_adam.LaunchShape.from_name(launch))
    check_kernel_edge_cases("cpu")


@pytest.mark.parametrize("launch", ARITHMETICS[:2])
def test_interpreted_fp8lm_kernels_match_fp64_reference(launch, monkeypatch):
    """FP8-LM's states (``_step_tensor_scaled``'s two kernels) against the fp64 reference, as the
    Inductor step is held to it (tests/test_fp8lm_states.py: three tensors of very different
    gradient sizes in one bucket, one of them without a gradient in a step)."""
    from test_fp8lm_states import STEPS, check_counts, check_untouched, run_against_reference

    monkeypatch.setattr(triton_adam, "LAUNCH", triton_adam.LaunchShape.from_name(launch))
    calls, kernel_step = [], triton_adam._step_tensor_scaled
    monkeypatch.setattr(triton_adam, "_step_tensor_scaled", lambda *args: calls.append(args) or kernel_step(*args))
    counts, snapshots = run_against_reference({})
    assert len(calls) == STEPS
    check_counts(counts)
    check_untouched(snapshots)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam], ids=["AdamW", "Adam"])
def test_interpreted_fp8lm_kernel_edge_cases(cls):
    from test_fp8lm_states import check_hand_written_kernel_edge_cases

    check_hand_written_kernel_edge_cases("cpu", cls)


def test_interpreted_fp8lm_kernels_on_small_tensors_match_fp64_reference():
    from test_fp8lm_states import Small, check_many_tensors

    check_many_tensors(Small(), "cpu", {})



@pytest.mark.parametrize("state_format", ["companded", "fp8lm"])
def test_interpreted_kernel_reads_gradients_where_they_are(state_format, monkeypatch):
    check_gradients_read_in_place("cpu", state_format, monkeypatch)


def test_interpreted_kernel_takes_the_gradients_an_eager_backward_leaves():
    check_backward_leaves_gradients_to_the_kernel("cpu")


def test_interpreted_kept_zero_gradients_are_the_flat_views():
    check_kept_zero_gradients_are_the_flat_views("cpu")


def test_interpreted_step_reports_the_gradients_it_copied():
    check_report_names_the_gradients_copied("cpu")
