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
from test_gpu import ADAM_CASES, ARITHMETICS, check_kernel_edge_cases
from test_optimizer_numerics import check_one_step_against_fp64_reference

pytestmark = [
    pytest.mark.skipif(not (_compat.HAS_TRITON and triton_adam.INTERPRETED),
                       reason="needs Triton, imported with TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),  # numpy evaluates both sides of a tl.where
]


@pytest.fixture(autouse=True)
def bf16_casts(monkeypatch):
    """bf16 <-> fp32 as on the GPU (and in torch): the interpreter truncates fp32 to bf16, and reads
    bf16 subnormals as zero."""
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def torch_cast(self, src, dst_type):
        data = np.ascontiguousarray(src.data)
        if (src.dtype.scalar, dst_type.scalar) == (tl.float32, tl.bfloat16):
            rounded = torch.from_numpy(data).bfloat16().view(torch.int16).numpy()
            return interpreter.TensorHandle(rounded.view(np.uint16), dst_type.scalar)
        if (src.dtype.scalar, dst_type.scalar) == (tl.bfloat16, tl.float32):
            return interpreter.TensorHandle(torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).float().numpy(),
                                            dst_type.scalar)
        return cast(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", torch_cast)


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
