"""FP8 scaling numerics (DESIGN.md §2.4, §2.5) against independent references.

The references are written from DESIGN.md in float64 / Python ``math``: the scale formula, rounding
down to a power of two (``math.frexp``), rounding to e4m3 / e5m2 by hand (nearest, ties to even,
subnormals, saturation), the amax history as a Python list. No helper of ``flash_inductor.formats.fp8``
is called inside them; the module under test is only ever on the left-hand side of a comparison.
torch's own fp8 dtypes are the ground truth for which values are representable (round trips) and
``torch._scaled_mm`` on CPU for the FP8 GEMM.
"""

import importlib.util
import math
import pathlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("flash_inductor") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from flash_inductor.formats import fp8  # noqa: E402

INF = float("inf")
NAN = float("nan")
FP32_MAX = (2 - 2.0**-23) * 2.0**127
# (mantissa bits, exponent of the smallest normal, largest finite value), from the OCP FP8 spec.
FORMAT = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPE_IDS = ["e4m3", "e5m2"]

# Positive finite fp32 values, from the smallest subnormal to the largest normal.
pos_f32 = st.floats(min_value=2.0**-149, max_value=FP32_MAX, width=32, allow_nan=False, allow_infinity=False)
fast = settings(max_examples=150, deadline=None)

# ============================================================================ fp64 references


def f32(values):
    """float64 tensor of the fp32 roundings of ``values`` (nearest, ties to even)."""
    return torch.as_tensor(values, dtype=torch.float64).float().double()


def ref_scale(amax, fmax):
    """DESIGN §2.4: fp32(fp8_max / max(amax, 1e-12)). The quotient is formed in float64 and rounded
    once to fp32, which is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits)."""
    a = f32(amax)
    return f32(fmax / torch.clamp(a, min=f32(1e-12).item()))


def ref_pow2_floor(v):
    """2 ** floor(log2(v)) for a positive finite float, or of every element of a float64 tensor, via
    frexp (v = m * 2**e, 0.5 <= m < 1)."""
    if not isinstance(v, torch.Tensor):
        return ref_pow2_floor(torch.tensor(v, dtype=torch.float64)).item()
    return torch.ldexp(torch.ones_like(v), torch.frexp(v).exponent - 1)


def ref_round_fp8(v, dtype):
    """float64 tensor ``v`` rounded to ``dtype`` by hand: nearest, ties to even, saturating."""
    mant, emin, fmax = FORMAT[dtype]
    v = v.double().clamp(-fmax, fmax)  # inf -> +-fmax, nan stays nan
    finite = torch.isfinite(v)
    vf = torch.where(finite, v, torch.zeros_like(v))
    _, e = torch.frexp(vf)  # unbiased exponent is e - 1
    quantum = (torch.clamp(e - 1, min=emin) - mant).double()  # log2 of the spacing at vf
    r = torch.round(vf * torch.exp2(-quantum)) * torch.exp2(quantum)  # exact scalings, half to even
    return torch.where(finite, r, v)


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def all_finite_fp8(dtype):
    """Every finite value of ``dtype`` (both zeros included), as an fp8 tensor."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return codes[torch.isfinite(codes.float())]


# ============================================================================ constants, amax


def test_max_values():
    assert fp8.E4M3 is torch.float8_e4m3fn and fp8.E5M2 is torch.float8_e5m2
    assert fp8.max_value(fp8.E4M3) == 448.0 == torch.finfo(fp8.E4M3).max
    assert fp8.max_value(fp8.E5M2) == 57344.0 == torch.finfo(fp8.E5M2).max
    with pytest.raises(ValueError, match="unsupported fp8 dtype"):
        fp8.max_value(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_amax_is_exact_fp32_abs_max(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 29, generator=gen) * 10).to(dtype)
    a = fp8.amax(x)
    assert a.dtype == torch.float32 and a.dim() == 0
    assert a.item() == max(abs(v) for v in x.double().flatten().tolist())
    x[3, 4] = -4096.0
    assert fp8.amax(x).item() == 4096.0
    x[5, 6] = NAN
    assert math.isnan(fp8.amax(x).item())
    assert fp8.amax(torch.empty(0, 8, dtype=dtype)).item() == 0.0


# ============================================================================ scales


@fast
@given(st.lists(st.floats(min_value=0.0, max_value=FP32_MAX, width=32), min_size=1, max_size=64))
def test_scale_formula_matches_fp64(amaxes):
    a = torch.tensor(amaxes, dtype=torch.float32)
    for dtype in DTYPES:
        got = fp8.scale_from_amax(a, dtype)
        assert got.dtype == torch.float32
        assert same_bits(got, ref_scale(a, fp8.max_value(dtype)).float())
        assert torch.isfinite(got).all() and (got >= 2.0**-126).all()  # never inf, never subnormal


def test_scale_formula_edges():
    a = torch.tensor([1.0, 448.0, 1e-12, 1e-30, 0.0, FP32_MAX, 3.0])
    got = fp8.scale_from_amax(a, fp8.E4M3)
    assert same_bits(got, ref_scale(a, 448.0).float())
    assert got[1].item() == 1.0 and got[3].item() == got[4].item() == got[2].item()  # the 1e-12 floor
    # 448 / 3 is not 448 * fp32(1/3): the division is a single rounding.
    assert got[6].item() == f32(448.0 / 3.0).item() != f32(448.0 * f32(1.0 / 3.0).item()).item()


def test_scale_without_previous_is_loud_on_non_finite_amax():
    got = fp8.scale_from_amax(torch.tensor([INF, NAN]), fp8.E4M3)
    assert got[0].item() == 0.0 and math.isnan(got[1].item())


@pytest.mark.parametrize("power_of_two", [False, True])
def test_keep_previous_scale_on_zero_or_non_finite_amax(power_of_two):
    a = torch.tensor([0.0, -0.0, INF, -INF, NAN, 2.0, 1e-20])
    prev = torch.tensor([3.0, 5.0, 7.0, 11.0, 13.0, 17.0, 19.0])  # not powers of two: not rounded again
    got = fp8.scale_from_amax(a, fp8.E5M2, previous_scale=prev, power_of_two=power_of_two)
    fresh = [57344.0 / 2.0, float(f32(57344.0 / f32(1e-12).item()))]
    if power_of_two:
        fresh = [ref_pow2_floor(v) for v in fresh]
    assert got.tolist() == [3.0, 5.0, 7.0, 11.0, 13.0] + fresh
    # A 0-dim previous scale broadcasts; a scalar amax gives a scalar scale.
    assert fp8.scale_from_amax(torch.tensor(0.0), fp8.E4M3, torch.tensor(0.5)).item() == 0.5


def _pow2_edges():
    """Every fp32 power of two (normal and subnormal), the fp32 value just below each, and just above."""
    p = torch.tensor([2.0**k for k in range(-149, 128)], dtype=torch.float32)
    below = torch.nextafter(p, torch.zeros_like(p))
    above = torch.nextafter(p, torch.full_like(p, INF))
    return torch.cat([p, below[below > 0], above[torch.isfinite(above)], torch.tensor([FP32_MAX])])


def test_power_of_two_rounding_at_every_binade_edge():
    v = _pow2_edges()
    got = fp8.round_down_to_power_of_two(v)
    want = ref_pow2_floor(v.double()).float()
    assert same_bits(got, want)
    special = fp8.round_down_to_power_of_two(torch.tensor([0.0, INF, NAN]))
    assert special[0].item() == 0.0 and special[1].item() == INF and math.isnan(special[2].item())


@fast
@given(st.lists(pos_f32, min_size=1, max_size=64))
def test_power_of_two_rounding_is_exact_floor(values):
    v = torch.tensor(values, dtype=torch.float32)
    want = ref_pow2_floor(v.double()).float()
    assert same_bits(fp8.round_down_to_power_of_two(v), want)


@fast
@given(st.lists(st.floats(min_value=2.0**-140, max_value=FP32_MAX, width=32), min_size=1, max_size=64))
def test_power_of_two_scale_is_rounded_fp32_scale(amaxes):
    a = torch.tensor(amaxes, dtype=torch.float32)
    for dtype in DTYPES:
        got = fp8.scale_from_amax(a, dtype, power_of_two=True)
        exact = ref_scale(a, fp8.max_value(dtype))
        want = ref_pow2_floor(exact).float()
        assert same_bits(got, want)
        # amax * scale never exceeds the format's max by more than the fp32 rounding of the division.
        assert (a.double() * got.double() <= fp8.max_value(dtype) * (1 + 2.0**-24)).all()


def _amaxes_at_every_exponent():
    """fp32 amaxes from 1e-12 up: at every exponent the mantissas 1, 1.75 and its two neighbours and
    the largest; every mantissa at three exponents (amaxes in [1e-12's binade], [1, 2), the largest)."""
    def with_exponents(exponents, mantissas):
        return ((exponents[:, None] << 23) | mantissas[None, :]).reshape(-1).view(torch.float32)

    lowest = torch.tensor(1e-12).view(torch.int32).item() >> 23
    edges = with_exponents(torch.arange(lowest, 255, dtype=torch.int32),
                           torch.tensor([0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF], dtype=torch.int32))
    every = with_exponents(torch.tensor([lowest, 127, 254], dtype=torch.int32), torch.arange(1 << 23, dtype=torch.int32))
    return torch.cat([edges, every[every >= 1e-12]])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scales_are_the_spec_at_every_exponent_and_mantissa_edge(dtype):
    """§2.4's scale, correctly rounded fp32 and rounded down to a power of two, for every exponent's
    mantissa edges and every mantissa of three binades (25M amaxes; every one of the 1.4G fp32 amaxes
    from 1e-12 up, both formats, was checked once against eager fp32 division, session 34)."""
    a = _amaxes_at_every_exponent()
    want = ref_scale(a, FORMAT[dtype][2])
    assert same_bits(fp8.scale_from_amax(a, dtype), want.float())
    assert same_bits(fp8.scale_from_amax(a, dtype, power_of_two=True), ref_pow2_floor(want).float())
    assert same_bits(fp8.inverse_scale(want.float()), f32(1 / want).float())  # correctly rounded inverses
    got = fp8.scale_from_amax(torch.tensor([0.0, -1.0, INF, NAN]), dtype, power_of_two=True).tolist()
    floor = ref_pow2_floor(ref_scale(0.0, FORMAT[dtype][2]).item())
    assert got[:3] == [floor, floor, 0.0] and math.isnan(got[3])


@fast
@given(st.lists(st.floats(min_value=0.0, max_value=2.0**100, width=32), min_size=2, max_size=8),
       st.booleans())
def test_shared_scale_max_amax_equals_min_scale(amaxes, power_of_two):
    """§2.5: all-reducing the amax with MAX or the per-rank scales with MIN gives the same bits."""
    a = torch.tensor(amaxes, dtype=torch.float32)
    per_rank = fp8.scale_from_amax(a, fp8.E5M2, power_of_two=power_of_two)
    shared = fp8.scale_from_amax(a.max(), fp8.E5M2, power_of_two=power_of_two)
    assert same_bits(shared, per_rank.min())


# ============================================================================ cast, dequantize


def _cast_inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen) * torch.exp(3 * torch.randn(4096, generator=gen))
    edges = [0.0, -0.0, 1e-45, 2.0**-10, 2.0**-9 * 1.5, 447.0, 448.0, 449.0, 463.9, 464.0, 465.0, 480.0,
             1e4, 57343.0, 57344.0, 61439.0, 61440.0, 1e6, FP32_MAX, INF, -INF, -1e4, -1e6]
    return torch.cat([x, torch.tensor(edges)])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0, 448.0 / 13.7])
def test_cast_matches_hand_rounding_and_saturates(dtype, scale):
    x = _cast_inputs()
    s = torch.tensor(scale, dtype=torch.float32)
    got = fp8.cast_to_fp8(x, s, dtype)
    assert got.dtype == dtype and got.shape == x.shape
    product = f32(x.double() * s.double())  # fp32 product: exact in fp64, then one rounding
    want = ref_round_fp8(product, dtype)
    assert torch.equal(got.double(), want)  # values (and which are zero / saturated)
    assert torch.equal(torch.signbit(got.float()), torch.signbit(want))  # and signs of zeros
    assert not torch.isnan(got.float()).any() and torch.isfinite(got.float()).all()
    fmax = fp8.max_value(dtype)
    assert got.float()[x * s > fmax].eq(fmax).all() and got.float()[x * s < -fmax].eq(-fmax).all()
    assert math.isnan(fp8.cast_to_fp8(torch.tensor([NAN]), s, dtype).float().item())  # nan stays nan


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("k", [-8, -3, 0, 5, 12])
def test_representable_values_round_trip_exactly(dtype, k):
    v = all_finite_fp8(dtype)
    x = v.float() * 2.0**-k  # exact
    s = torch.tensor(2.0**k)
    q = fp8.cast_to_fp8(x, s, dtype)
    assert same_bits(q, v)
    assert same_bits(fp8.dequantize(q, s), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dequantize_matches_fp64(dtype):
    v = all_finite_fp8(dtype)
    s = torch.tensor(448.0 / 13.7)
    got = fp8.dequantize(v, s)
    assert got.dtype == torch.float32
    assert same_bits(got, f32(v.double() / s.double()).float())


@pytest.mark.parametrize("dtype,bound", [(torch.float8_e4m3fn, 2.0**-4), (torch.float8_e5m2, 2.0**-3)],
                         ids=DTYPE_IDS)
def test_round_trip_error_within_half_ulp(dtype, bound):
    """For values in the normal range of the format, |x' - x| <= half an ULP = 2**-(m+1) relative."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8192, generator=gen)
    s = fp8.scale_from_amax(fp8.amax(x), dtype)
    xq = fp8.dequantize(fp8.cast_to_fp8(x, s, dtype), s)
    normal = (x * s).abs() >= 2.0 ** FORMAT[dtype][1]
    assert normal.float().mean() > 0.9
    rel = ((xq.double() - x.double()).abs() / x.double().abs())[normal]
    assert rel.max() <= bound * (1 + 2.0**-20)


def test_overflow_fraction_matches_fp64_count():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(10000, generator=gen) * 100
    x[:3] = torch.tensor([INF, -INF, NAN])
    for dtype in DTYPES:
        s = torch.tensor(fp8.max_value(dtype) / 250.0)
        want = ((f32(x.double() * s.double()).abs() > fp8.max_value(dtype)).sum().item()) / x.numel()
        got = fp8.overflow_fraction(x, s, dtype)
        assert got.dtype == torch.float32 and got.dim() == 0
        assert got.item() == pytest.approx(want, rel=1e-6) and 0.01 < want < 0.02
    assert fp8.overflow_fraction(torch.ones(8), torch.tensor(1.0), fp8.E4M3).item() == 0.0


# ============================================================================ delayed scaling


@pytest.mark.parametrize("length", [1, 4, 16])
def test_amax_history_rolls_newest_first(length):
    hist = fp8.new_amax_history(length)
    assert hist.shape == (length,) and hist.dtype == torch.float32 and not hist.any()
    ref = [0.0] * length
    for step in range(length + 5):
        new = torch.tensor(float(step + 1) * 1.5)
        before = hist.clone()
        out = fp8.update_amax_history(hist, new)
        assert torch.equal(hist, before) and out is not hist  # a new tensor; the input is unchanged
        ref = [float(step + 1) * 1.5] + ref[:-1]
        assert out.tolist() == ref
        hist = out


def test_scale_from_history_is_scale_of_window_max():
    L = fp8.HISTORY_LENGTH
    assert L == 16  # DESIGN §2.4
    hist = fp8.new_amax_history()
    prev = torch.tensor(1.0)
    # All-zero history: keep the initial scale.
    assert fp8.scale_from_history(hist, fp8.E4M3, prev).item() == 1.0
    amaxes = [100.0] + [3.0 + 0.1 * i for i in range(L + 3)]
    ref_window = []
    for step, a in enumerate(amaxes):
        hist = fp8.update_amax_history(hist, torch.tensor(a))
        ref_window = ([a] + ref_window)[:L]
        for pow2 in (False, True):
            got = fp8.scale_from_history(hist, fp8.E4M3, prev, power_of_two=pow2)
            want = ref_scale(max(f32(ref_window).tolist()), 448.0).item()
            want = ref_pow2_floor(want) if pow2 else want
            assert got.item() == want, (step, pow2)
        if step < L:
            assert hist.amax().item() == 100.0  # the outlier stays in the window for L steps ...
    assert hist.amax().item() < 100.0  # ... then leaves it


def test_non_finite_amax_keeps_previous_scale_while_in_window():
    L = 4
    hist = fp8.update_amax_history(fp8.new_amax_history(L), torch.tensor(2.0))
    prev = torch.tensor(0.75)
    hist = fp8.update_amax_history(hist, torch.tensor(NAN))
    for _ in range(L):  # the nan is in the window for L steps
        assert fp8.scale_from_history(hist, fp8.E4M3, prev).item() == 0.75
        hist = fp8.update_amax_history(hist, torch.tensor(8.0))
    assert fp8.scale_from_history(hist, fp8.E4M3, prev).item() == 448.0 / 8.0
    hist = fp8.update_amax_history(hist, torch.tensor(INF))
    assert fp8.scale_from_history(hist, fp8.E4M3, prev).item() == 0.75


# ============================================================================ SQNR, _scaled_mm


def test_sqnr_definition():
    ref = torch.tensor([3.0, 4.0])
    assert fp8.sqnr_db(ref, ref + torch.tensor([0.03, 0.04])).item() == pytest.approx(40.0, abs=1e-4)
    assert fp8.sqnr_db(ref, ref).item() == INF


def _tensorwise_sqnr(x, dtype):
    s = fp8.scale_from_amax(fp8.amax(x), dtype)
    return fp8.sqnr_db(x, fp8.dequantize(fp8.cast_to_fp8(x, s, dtype), s)).item()


def test_tensorwise_sqnr_of_randn():
    """Measured on torch 2.13 CPU (seed 0, 256x1024): e4m3 31.5 dB, e5m2 25.6 dB. The uniform-noise
    estimate for m mantissa bits is about 6.02 (m + 1) + 7.3 dB minus the share of small values."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    e4m3, e5m2 = _tensorwise_sqnr(x, fp8.E4M3), _tensorwise_sqnr(x, fp8.E5M2)
    assert 30.0 <= e4m3 <= 33.0
    assert 24.0 <= e5m2 <= 27.0
    assert e4m3 - e5m2 >= 5.0  # one mantissa bit: ~6 dB


def _scaled_mm_case(a_dtype, b_dtype, M, K, N, power_of_two):
    """out = a @ b with a [M, K] row-major in ``a_dtype`` and b [K, N] column-major in ``b_dtype``."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(M, K, generator=gen)
    b_nk = torch.randn(N, K, generator=gen) * 0.02  # stored like a Linear weight, [N, K]
    sa = fp8.scale_from_amax(fp8.amax(a), a_dtype, power_of_two=power_of_two)
    sb = fp8.scale_from_amax(fp8.amax(b_nk), b_dtype, power_of_two=power_of_two)
    a8 = fp8.cast_to_fp8(a, sa, a_dtype)
    b8 = fp8.cast_to_fp8(b_nk, sb, b_dtype).t()  # [K, N], column-major
    assert a8.stride() == (K, 1) and b8.stride() == (1, K)
    out = torch._scaled_mm(a8, b8, sa.reciprocal(), sb.reciprocal(), out_dtype=torch.bfloat16)
    emulated = (a8.float() @ b8.float()) * sa.reciprocal() * sb.reciprocal()
    return out, a @ b_nk.t(), emulated


@pytest.mark.parametrize("power_of_two", [False, True])
def test_scaled_mm_forward_e4m3(power_of_two):
    out, ref, emulated = _scaled_mm_case(fp8.E4M3, fp8.E4M3, 64, 128, 96, power_of_two)
    assert out.dtype == torch.bfloat16 and out.shape == (64, 96)
    assert fp8.sqnr_db(ref, out).item() >= 25.0
    # The CPU kernel is the emulation (fp32 accumulation, scales applied after, one bf16 rounding),
    # up to the order of the fp32 accumulation.
    torch.testing.assert_close(out.float(), emulated.bfloat16().float(), rtol=2**-7, atol=1e-5)


def test_scaled_mm_backward_e5m2_times_e4m3():
    """grad_input = grad_out [M, N] (e5m2) @ W [N, K] (e4m3, quantized as W^T [K, N] then transposed)."""
    out, ref, _ = _scaled_mm_case(fp8.E5M2, fp8.E4M3, 64, 96, 128, False)
    assert out.dtype == torch.bfloat16 and out.shape == (64, 128)
    assert fp8.sqnr_db(ref, out).item() >= 20.0


# ============================================================================ compiled path


def _delayed_cast(x, history, previous_scale):
    """One delayed-scaling step for both formats, as the FP8 passes will emit it."""
    out = []
    for dtype, pow2 in ((fp8.E4M3, False), (fp8.E5M2, True)):
        s = fp8.scale_from_history(history, dtype, previous_scale, power_of_two=pow2)
        out += [fp8.cast_to_fp8(x, s, dtype), s, fp8.overflow_fraction(x, s, dtype)]
    a = fp8.amax(x)
    current = fp8.scale_from_amax(a, fp8.E4M3)
    out += [fp8.cast_to_fp8(x, current, fp8.E4M3), current, fp8.update_amax_history(history, a)]
    return out


def _every_scale(amaxes, previous):
    scales = [fp8.scale_from_amax(amaxes, dtype, previous, power_of_two) for dtype in DTYPES for power_of_two in (False, True)]
    return scales + [fp8.inverse_scale(s) for s in scales]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_scales_are_eagers_bits_under_inductors_default_division(device, fresh_dynamo):
    """Inductor's default fp32 division in Triton is approximate (``eager_numerics.division_rounding``
    off, which the backend leaves for the graphs it rewrites, as a stock torch.compile does): scales
    compiled so, and their inverses, are still eager's correctly rounded bits, per-tensor and
    power-of-two. A million amaxes over 170 binades, 0, inf and nan."""
    gen = torch.Generator().manual_seed(0)
    amaxes = torch.cat([torch.exp2(torch.rand(1 << 20, generator=gen, dtype=torch.float64) * 170 - 45).float(),
                        torch.tensor([0.0, INF, NAN])])
    previous = torch.full_like(amaxes, 3.0)
    fn = torch.compile(_every_scale, backend="inductor", fullgraph=True, dynamic=False)
    compiled = fn(amaxes.to(device), previous.to(device))
    for got, want in zip(compiled, _every_scale(amaxes, previous)):
        assert same_bits(got.cpu(), want)


@pytest.mark.slow
def test_compiled_matches_eager_bit_for_bit(fresh_dynamo):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1000, 33, generator=gen) * 7
    x[0, :6] = torch.tensor([1e6, -1e6, INF, 2.0**-20, 0.0, -0.0])  # saturation, subnormals, zeros
    history = torch.tensor([5.0, 3.0, 0.0, 2.5])  # window max below amax(x): some values saturate
    prev = torch.tensor(0.5)
    fn = torch.compile(_delayed_cast, backend="inductor", fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = fn(x, history, prev)
    eager = _delayed_cast(x, history, prev)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert same_bits(c, e), i
    assert eager[2].item() > 0  # the delayed e4m3 scale did saturate something
