"""flash_inductor/fp8_transpose.py: ``transpose_fp8`` with a scale per row or per column, the cast and
transposed copy that ``fp8_linear``'s row-wise scaling makes of a tensor cast by columns (from bf16)
and of row casts brought to one scale (from FP8). Every finite bf16 value times powers of two, and
every FP8 value times every power of two it may be scaled by, against the nearest representable value
found by brute force (ties to the even code, saturating at the format's largest); on the CPU (torch's
cast) and on CUDA (the Triton kernel, ``gpu`` marker). The kernel's PTX for sm_90 is read on the CPU:
its rounding instruction is the one that makes the two agree."""

import importlib.util

import pytest
import torch

from flash_inductor import fp8_transpose

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _every_finite_value(dtype):
    """Every finite value of ``dtype`` (an FP8 or 16-bit type), as a 1-D tensor."""
    codes = torch.arange(1 << (8 * dtype.itemsize), dtype=torch.int32)
    codes = codes.to(torch.uint8) if dtype.itemsize == 1 else (codes - (1 << 15)).to(torch.int16)
    values = codes.view(dtype)
    return values[values.to(torch.float64).isfinite()]


def _nearest_even(targets, dtype):
    """The codes (uint8) of the FP8 ``dtype`` nearest each fp64 target, after saturating it to the
    format's largest value; ties to the code whose last bit is 0 (round to nearest even); a zero keeps the
    target's sign. Found by comparing with the format's two neighbouring values: independent of any cast."""
    values = _every_finite_value(dtype)
    grid, order = values.to(torch.float64).sort()
    codes = values.view(torch.uint8)[order]
    flat = targets.reshape(-1).clamp(grid[0], grid[-1])
    above = torch.searchsorted(grid, flat).clamp(max=len(grid) - 1)
    below = (above - 1).clamp(min=0)
    to_below, to_above = flat - grid[below], grid[above] - flat
    pick = torch.where(to_below < to_above, below,
                       torch.where(to_above < to_below, above, torch.where(codes[below] % 2 == 0, below, above)))
    signed_zero = torch.where(torch.signbit(flat), 0x80, 0x00).to(torch.uint8)
    return torch.where(grid[pick] == 0, signed_zero, codes[pick]).reshape(targets.shape)


def _check_against_brute_force(t, scale, dtype, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = fp8_transpose.transpose_fp8(t.to(device), scale.to(device), dtype)
    assert out.shape == t.shape[::-1] and out.is_contiguous() and out.dtype == dtype
    expected = _nearest_even(t.to(torch.float64) * scale.to(torch.float64), dtype)
    got = out.cpu().t().view(torch.uint8)
    wrong = (got != expected).nonzero()
    assert len(wrong) == 0, [(t[i, j].item(), got[i, j].item(), expected[i, j].item()) for i, j in wrong[:5].tolist()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_rescaled_rows_round_every_fp8_value_times_every_power_of_two_to_nearest_even(dtype, device):
    """Row casts brought to one scale (``fp8_linear._rows_as_one_scale_transposed``): a scale per row."""
    ratios = 2.0 ** -torch.arange(24, dtype=torch.float32)  # down past every subnormal of both formats
    t = _every_finite_value(dtype).expand(len(ratios), -1).contiguous()
    _check_against_brute_force(t, ratios.reshape(-1, 1), dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_bf16_cast_by_columns_rounds_every_bf16_value_to_nearest_even_and_saturates(dtype, device):
    """Casts by columns (``fp8_linear._quantize_columns``): a scale per column, from bf16; the values
    beyond the format saturate, those below its subnormals go to a signed zero."""
    scales = torch.tensor([[1.0, 2.0**-7, 2.0**5, 2.0**12]])
    t = _every_finite_value(torch.bfloat16).reshape(-1, 1).expand(-1, scales.shape[1]).contiguous()
    _check_against_brute_force(t, scales, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 64), (130, 7), (8192, 2048)])
@pytest.mark.parametrize("by", ["rows", "columns"])
def test_cast_transposes_match_the_cpu_on_shapes_that_cut_tiles(shape, by):
    """Tiles cut by the edges: the scales and the tile's mask line up. The values are finite: a NaN comes
    out of the kernel as out of torch's CUDA cast, positive (0x7F), where the CPU's cast keeps its sign
    (``benchmarks/results/fp8_transpose_check_h100.log``: torch 2.11's CPU cast turned 27 of 16.8M
    values past 448 into negative NaNs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = (torch.randn(shape) * 100).clamp(-448, 448)
    scale = 2.0 ** -torch.randint(0, 12, (shape[0], 1) if by == "rows" else (1, shape[1])).to(torch.float32)
    for source in (t.to(torch.bfloat16), t.to(torch.float8_e4m3fn)):
        expected = fp8_transpose.transpose_fp8(source, scale, torch.float8_e4m3fn)
        got = fp8_transpose.transpose_fp8(source.cuda(), scale.cuda(), torch.float8_e4m3fn).cpu()
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), source.dtype


def test_scales_and_dtypes_are_checked():
    t = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="a scale casts to FP8, but the output would be torch.bfloat16"):
        fp8_transpose.transpose_fp8(t.to(torch.bfloat16), torch.ones(4, 1))
    shapes = r"scale must be fp32 of shape \(4, 1\) .* or \(1, 8\) .*got torch.float32 of shape \(8,\)"
    with pytest.raises(ValueError, match=shapes):
        fp8_transpose.transpose_fp8(t, torch.ones(8))
    with pytest.raises(ValueError, match="fp32"):
        fp8_transpose.transpose_fp8(t, torch.ones(4, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="casting torch.bfloat16 to torch.float8_e4m3fn needs a scale"):
        fp8_transpose.transpose_fp8(t.to(torch.bfloat16), dtype=torch.float8_e4m3fn)


def _sm90_ptx(src, scale, scale_rows=True):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"src": src, "scale": scale, "dst": "*fp8e4nv", "rows": "i32", "cols": "i32",
                 "SCALE_ROWS": "constexpr", "BLOCK": "constexpr"}
    constants = {"SCALE_ROWS": scale_rows, "BLOCK": fp8_transpose.BLOCK, **({"scale": None} if scale == "constexpr" else {})}
    source = ASTSource(fn=fp8_transpose._kernel(), signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def _fp8_conversions(ptx):
    return [line.split()[0] for line in ptx.splitlines() if line.strip().startswith("cvt.") and "e4m3" in line]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_kernel_rounds_to_nearest_even_on_sm90_and_copies_bytes_without_a_scale():
    """Read in the PTX, as the CPU cannot run the kernel (Triton's interpreter rounds FP8 toward zero)."""
    for src, scale_rows in (("*fp8e4nv", True), ("*bf16", False)):
        conversions = _fp8_conversions(_sm90_ptx(src, "*fp32", scale_rows))
        assert "cvt.rn.satfinite.e4m3x2.f32" in conversions, (src, conversions)
        assert not any(".rz" in c for c in conversions), (src, conversions)
    assert not _fp8_conversions(_sm90_ptx("*fp8e4nv", "constexpr"))
