"""flash_inductor/fp8_transpose.py: ``transpose_fp8`` with row scales, the rescaled transposed copy that
``fp8_linear``'s row-wise hybrid gives the weight gradient's GEMM. Every FP8 value times every power of
two it may be scaled by, against the nearest representable value found by brute force (ties to the even
code); on the CPU (torch's cast) and on CUDA (the Triton kernel, ``gpu`` marker). The kernel's PTX for
sm_90 is read on the CPU: its rounding instruction is the one that makes the two agree."""

import importlib.util

import pytest
import torch

from flash_inductor import fp8_transpose

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _every_finite_value(dtype):
    """Every finite code of ``dtype`` as a (1, 256 - non-finite) row."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).to(torch.float64)
    return codes[values.isfinite()].view(dtype).reshape(1, -1)


def _nearest_even(targets, dtype):
    """The codes of ``dtype`` nearest each fp64 target, ties to the code with an even last bit (round to
    nearest even), by comparing against every finite code: independent of any cast."""
    codes = _every_finite_value(dtype).reshape(-1)
    grid = codes.to(torch.float64)
    grid, order = grid.sort()
    codes = codes.view(torch.uint8)[order]
    distance = (targets.reshape(-1, 1) - grid).abs()
    best = distance.min(dim=1, keepdim=True).values
    candidates = distance == best
    # of two equally near codes, the one whose stored mantissa is even (its last bit 0)
    even = (codes % 2 == 0).expand_as(candidates) & candidates
    pick = torch.where(even.any(dim=1, keepdim=True), even, candidates).to(torch.int8).argmax(dim=1)
    # zero keeps the target's sign (+0 is code 0x00, -0 is 0x80 in both formats)
    signed_zero = torch.where(torch.signbit(targets.reshape(-1)), 0x80, 0x00).to(torch.uint8)
    result = torch.where(grid[pick] == 0, signed_zero, codes[pick])
    return result.reshape(targets.shape)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_row_scaled_transpose_rounds_every_value_times_every_power_of_two_to_nearest_even(dtype, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ratios = 2.0 ** -torch.arange(24, dtype=torch.float64)  # down past every subnormal of both formats
    t = _every_finite_value(dtype).expand(len(ratios), -1).contiguous()
    out = fp8_transpose.transpose_fp8(t.to(device), ratios.to(torch.float32).reshape(-1, 1).to(device))
    assert out.shape == t.shape[::-1] and out.is_contiguous() and out.dtype == dtype
    expected = _nearest_even(t.to(torch.float64) * ratios.reshape(-1, 1), dtype)
    got = out.cpu().t().view(torch.uint8)
    wrong = (got != expected).nonzero()
    assert len(wrong) == 0, [(t[i, j].item(), ratios[i].item(), got[i, j].item(), expected[i, j].item())
                             for i, j in wrong[:5].tolist()]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 64), (130, 7), (8192, 2048)])
def test_row_scaled_transpose_kernel_matches_the_cpu_copy_on_odd_shapes(shape):
    """Tiles cut by the edges: the rows' scales and the tile's mask line up."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = (torch.randn(shape) * 100).to(torch.float8_e4m3fn)
    ratio = 2.0 ** -torch.randint(0, 12, (shape[0], 1)).to(torch.float32)
    expected = fp8_transpose.transpose_fp8(t, ratio)
    got = fp8_transpose.transpose_fp8(t.cuda(), ratio.cuda()).cpu()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_row_scales_are_checked():
    t = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rescales FP8 rows, but t is torch.bfloat16"):
        fp8_transpose.transpose_fp8(t.to(torch.bfloat16), torch.ones(4))
    with pytest.raises(ValueError, match=r"one value per row of t \(4\), got torch.float32 of shape \(8,\)"):
        fp8_transpose.transpose_fp8(t, torch.ones(8))
    with pytest.raises(ValueError, match="fp32"):
        fp8_transpose.transpose_fp8(t, torch.ones(4, dtype=torch.float64))


def _sm90_ptx(row_scale_type):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"src": "*fp8e4nv", "row_scale": row_scale_type, "dst": "*fp8e4nv", "rows": "i32", "cols": "i32",
                 "BLOCK": "constexpr"}
    constants = {"BLOCK": fp8_transpose.BLOCK, **({"row_scale": None} if row_scale_type == "constexpr" else {})}
    source = ASTSource(fn=fp8_transpose._kernel(), signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_kernel_rounds_to_nearest_even_on_sm90_and_copies_bytes_without_row_scales():
    """Read in the PTX, as the CPU cannot run the kernel (Triton's interpreter rounds FP8 toward zero)."""
    rescaled, plain = _sm90_ptx("*fp32"), _sm90_ptx("constexpr")
    conversions = [line.split()[0] for line in rescaled.splitlines() if line.strip().startswith("cvt.") and "e4m3" in line]
    assert "cvt.rn.satfinite.e4m3x2.f32" in conversions, conversions
    assert not any(".rz" in c for c in conversions), conversions
    assert not [line for line in plain.splitlines() if "cvt" in line and "e4m3" in line]
