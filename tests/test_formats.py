"""Storage formats (DESIGN.md §2.1-2.3) against independent references.

The references below are written from DESIGN.md alone, in float64 / Python ``math``: rounding to
bf16 / fp16 / fp32 is done by hand (round half to even on a float64 grid, overflow to inf), and no
helper of ``flash_inductor.formats`` is called inside them. The module under test is only ever on
the left-hand side of a comparison.

Compiled path: one function that round-trips every format is compiled once per module (Inductor,
CPU, ``emulate_precision_casts=True``) and shared by the tests at the end of this file.
"""

import importlib.util
import math
import pathlib
import sys
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("flash_inductor") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from flash_inductor import _compat  # noqa: E402
from flash_inductor.formats import companded as cp  # noqa: E402
from flash_inductor.formats import split_weights as sw  # noqa: E402
from reference import (  # noqa: E402
    BF16,
    FLOOR_SCALE,
    FP16,
    INF,
    SCALE_FLOOR32,
    f32,
    ref_companded_encode,
    ref_group_scale,
    ref_round,
)

# ============================================================================ fp64 references

FORMAT = {torch.bfloat16: BF16, torch.float16: FP16}
CODE_MAX = {torch.int8: 127, torch.int16: 32767}
SPLIT_CASES = [
    (torch.bfloat16, torch.int8),
    (torch.bfloat16, torch.int16),
    (torch.float16, torch.int8),
    (torch.float16, torch.int16),
]
SPLIT_IDS = ["bf16-int8", "bf16-int16", "fp16-int8", "fp16-int16"]
def ref_half_ulp_log2_scalar(v, fmt):
    """``e - m - 1`` (DESIGN §2.1) for one finite Python float ``v`` of format ``fmt``."""
    mant, emin, _ = fmt
    e = emin if v == 0 else max(math.frexp(v)[1] - 1, emin)
    return e - mant - 1


def ref_half_ulp_log2(hi64, fmt):
    """Vectorised ``ref_half_ulp_log2_scalar`` over a float64 tensor of finite values."""
    mant, emin, _ = fmt
    _, e = torch.frexp(hi64)
    return torch.where(hi64 == 0, emin, torch.clamp(e - 1, min=emin)) - mant - 1


def ref_split_encode(x32, hi_dtype, lo_dtype):
    """(hi as float64, lo as int64) per DESIGN §2.1 and its one deviation, exactly in float64."""
    n = CODE_MAX[lo_dtype]
    x = x32.double()
    hi = ref_round(x, FORMAT[hi_dtype])
    ok = torch.isfinite(hi)
    hi_f = torch.where(ok, hi, torch.zeros_like(hi))
    x_f = torch.where(ok, x, torch.zeros_like(x))
    k = ref_half_ulp_log2(hi_f, FORMAT[hi_dtype])
    # x - hi and the power-of-two scaling are exact in float64; so is r * n (<= 24 + 15 bits).
    r = ((x_f - hi_f) * torch.exp2(-k.double())).clamp(-1.0, 1.0)
    s = (r * n).abs()
    whole = torch.floor(s)
    mag = whole + (s - whole >= 0.5).double()  # round half away from zero (s - whole is exact)
    # Deviation from DESIGN §2.1 (module docstring, docs/numerics.md): below a binade edge (|hi| =
    # 2**e above the smallest normal) r >= -0.5, and the code magnitude is capped at (N - 1) / 2 so
    # that the tie r = -0.5 does not decode past it.
    edge = (torch.frexp(hi_f)[0].abs() == 0.5) & (hi_f.abs() >= 2.0 ** (FORMAT[hi_dtype][1] + 1))
    mag = torch.where(edge & (x_f.abs() < hi_f.abs()), mag.clamp(max=n // 2), mag)
    lo = torch.where(ok, torch.sign(r) * mag, torch.zeros_like(r))
    return hi, lo.long()


def ref_split_decode(hi64, lo, hi_dtype, lo_dtype):
    """The exact (float64) value ``hi + lo / N * 2**half_ulp_log2(hi)`` for finite ``hi``."""
    k = ref_half_ulp_log2(hi64, FORMAT[hi_dtype])
    return hi64 + lo.double() / CODE_MAX[lo_dtype] * torch.exp2(k.double())


def ulp32(v64):
    """Spacing of fp32 at |v| (2**-149 in the subnormal range)."""
    _, e = torch.frexp(v64)
    return torch.exp2((torch.clamp(e - 1, min=-126) - 23).double())


def ref_companded_decode(codes, scale64, kind):
    """DESIGN §2.2 decode, one fp32 rounding per operation, in the order the formula is written,
    with ``q / 127`` taken as ``q * fp32(1/127)`` (the module's documented device-independent form)."""
    q = codes.double().view(-1, 32)
    s = scale64.double().view(-1, 1)
    inv = lambda n: f32(torch.tensor(1 / n, dtype=torch.float64))  # noqa: E731
    if kind == cp.SIGNED:
        y = f32(q * inv(127))
        return f32(f32(y / f32(2 - y.abs())) * s)
    t = f32(f32(q * inv(255)) * s)
    return f32(t * t)


def ref_companded_decode_exact(codes, scale64, kind):
    """The same decode with no intermediate rounding."""
    q = codes.double().view(-1, 32)
    s = scale64.double().view(-1, 1)
    if kind == cp.SIGNED:
        y = q / 127
        return y / (2 - y.abs()) * s
    return (q / 255 * s) ** 2


def bits(t):
    """Integer view for bit-for-bit comparisons."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(a, b):
    """Bit for bit (so -0.0 != 0.0), except that any nan equals any nan (payloads mean nothing)."""
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(bits(a)[~nan], bits(b)[~nan])


# ============================================================================ the references themselves


def test_reference_rounding_agrees_with_ieee_on_known_values():
    """Sanity of ``ref_round`` on hand-worked values (ties to even, subnormals, overflow)."""
    v = torch.tensor(
        [1 + 2.0**-8, 1 + 3 * 2.0**-8, 2.0**-134, 3 * 2.0**-134, 1.5 * 2.0**-134, 65519.0, 65520.0,
         (2 - 2.0**-8) * 2.0**127, -0.0, 2.0**-25, 3 * 2.0**-26],
        dtype=torch.float64,
    )
    bf = ref_round(v[:5], BF16).tolist()
    assert bf == [1.0, 1 + 2.0**-6, 0.0, 2.0**-132, 2.0**-133]
    assert ref_round(v[5:7], FP16).tolist() == [65504.0, INF]
    assert ref_round(v[7:8], BF16).tolist() == [INF]  # the tie at the top rounds to inf
    assert math.copysign(1, ref_round(v[8:9], BF16).item()) == -1
    assert ref_round(v[9:], FP16).tolist() == [0.0, 2.0**-24]


# ============================================================================ split weights (§2.1)


def all_values(dtype):
    """Every bit pattern of a 16-bit float dtype, and the mask of the finite ones."""
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return v, torch.isfinite(v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_ulp_log2_every_value(dtype):
    v, finite = all_values(dtype)
    v = v[finite]
    got = sw.half_ulp_log2(v)
    assert got.dtype == torch.int32
    want = [ref_half_ulp_log2_scalar(f, FORMAT[dtype]) for f in v.double().tolist()]
    assert got.tolist() == want
    # and it is what it claims to be: half the gap to the next value away from zero
    mag = v.abs()
    nxt = (bits(mag) + 1).view(dtype)  # the next value away from zero
    ok = torch.isfinite(nxt)
    gap = nxt.double() - mag.double()
    assert torch.equal(gap[ok] / 2, torch.exp2(got.double())[ok])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lo_dtype", [torch.int8, torch.int16], ids=["int8", "int16"])
def test_decode_full_scale_code_every_value(dtype, lo_dtype):
    """decode(hi, +-N) == hi +- half_ulp(hi) exactly for every finite hi of even significand: the
    two-halves power of two neither overflows nor underflows anywhere from the smallest subnormal to
    the largest value. Next to an odd significand hi +- half_ulp(hi) is a tie that rounds away from
    hi, so decode gives the fp32 value next to it on hi's side (split_weights' round-trip rule)."""
    v, finite = all_values(dtype)
    hi = v[finite]
    n = CODE_MAX[lo_dtype]
    h = torch.exp2(ref_half_ulp_log2(hi.double(), FORMAT[dtype]).double())
    odd = (bits(hi) & 1) == 1
    for sign in (1, -1):
        got = sw.decode(hi, torch.full(hi.shape, sign * n, dtype=lo_dtype))
        assert got.dtype == torch.float32
        tie = hi.double() + sign * h  # exact in fp32
        want = torch.where(odd, torch.nextafter(tie.float(), hi.float()).double(), tie)
        assert torch.equal(got.double(), want)


def sweep_inputs(dtype, gen):
    """fp32 x around every finite value of ``dtype``: its fp32 bit pattern plus offsets of up to one
    ``dtype`` ulp (ties, just-off-ties, ends, random), so every exponent and mantissa is covered."""
    v, finite = all_values(dtype)
    base = v[finite].float().view(torch.int32).long()
    half = 1 << (22 - FORMAT[dtype][0])  # half a ``dtype`` ulp, in fp32 bit units
    fixed = [0, 1, -1, half - 1, half, half + 1, -half + 1, -half, -half - 1, 2 * half - 1, -2 * half + 1]
    rand = torch.randint(-2 * half, 2 * half, (9,), generator=gen).tolist()
    offsets = torch.tensor(fixed + rand, dtype=torch.int64)
    xb = (base[:, None] + offsets[None, :]).reshape(-1)
    xb = xb[(xb >= -(2**31)) & (xb < 2**31)]
    x = xb.to(torch.int32).view(torch.float32)
    return x[torch.isfinite(x)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_split_sweep_every_hi_vs_reference_and_invariants(dtype):
    """Like FlashOptim's ECC invariant sweep (every mantissa of every exponent), checked exactly."""
    gen = torch.Generator().manual_seed(0)
    x = sweep_inputs(dtype, gen)
    x64 = x.double()
    errs = {}
    for lo_dtype in (torch.int8, torch.int16):
        n = CODE_MAX[lo_dtype]
        hi, lo = sw.encode(x, dtype, lo_dtype)
        assert hi.dtype == dtype and lo.dtype == lo_dtype and hi.shape == lo.shape == x.shape
        ref_hi, ref_lo = ref_split_encode(x, dtype, lo_dtype)
        assert torch.equal(hi.double(), ref_hi), "hi is not x rounded to nearest even"
        assert torch.equal(lo.long(), ref_lo)

        fin = torch.isfinite(ref_hi)
        x_f, hi64, lo64 = x64[fin], ref_hi[fin], lo.long()[fin]
        assert (lo.long()[~fin] == 0).all()  # hi overflowed to inf: no garbage error term
        assert lo64.abs().max() <= n  # never -128 / -32768
        exact = x_f == hi64
        assert (lo64[exact] == 0).all()  # exactly representable -> no error term
        assert ((lo64 == 0) | (torch.sign(lo64) == torch.sign(x_f - hi64))).all()

        dec = sw.decode(hi, lo).double()[fin]
        assert torch.equal(dec[exact], x_f[exact])
        h = torch.exp2(ref_half_ulp_log2(hi64, FORMAT[dtype]).double())
        err = (dec - x_f).abs()
        # code rounding (<= h / 2N), fp32 rounding of lo / N (<= h 2**-24) and of the sum
        bound = 0.5 * h / n + h * 2.0**-23 + ulp32(torch.maximum(x_f.abs(), dec.abs()))
        assert (err <= bound).all()
        assert (err <= h / n * (1 + 2.0**-10) + ulp32(x_f)).all()  # the brief's looser form
        # decode is within one fp32 rounding of the exact value the codes stand for
        exact_val = ref_split_decode(hi64, lo64, dtype, lo_dtype)
        assert ((dec - exact_val).abs() <= ulp32(exact_val)).all()
        # error correction never hurts (up to one fp32 rounding)
        assert (err <= (x_f - hi64).abs() + ulp32(x_f)).all()
        errs[lo_dtype] = (err, x_f)

    (e8, x_f), (e16, _) = errs[torch.int8], errs[torch.int16]
    assert (e16 <= e8 + ulp32(x_f)).all()  # 16-bit terms are never worse than 8-bit ones
    normal = x_f.abs() >= 2.0 ** FORMAT[dtype][1]
    # 32-bit masters: within one fp32 ulp of x wherever hi is normal (for bf16: everywhere)
    assert (e16[normal] <= ulp32(x_f[normal])).all()
    # and 24-bit masters for bf16 carry 16 significant bits: |err| <= 2**-16 relative
    if dtype == torch.bfloat16:
        big = x_f.abs() >= 2.0**-126
        assert (e8[big] <= x_f[big].abs() * 2.0**-15).all()


FP32_MAX = (2 - 2.0**-23) * 2.0**127
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
tiny32 = st.floats(min_value=-(2.0**-100), max_value=2.0**-100, width=32)  # fp32/bf16 subnormals
huge32 = st.floats(min_value=1.75 * 2.0**127, max_value=FP32_MAX, width=32).flatmap(
    lambda v: st.sampled_from([v, -v])
)  # around bf16's max and its overflow threshold
fp16_edges = st.one_of(
    st.floats(min_value=6.0e4, max_value=7.0e4, width=32),  # fp16 max / overflow
    st.floats(min_value=-(2.0**-13), max_value=2.0**-13, width=32),  # fp16 subnormals
)
mixed32 = st.lists(st.one_of(finite32, tiny32, huge32, fp16_edges, st.just(0.0)), min_size=1, max_size=64)


@pytest.mark.parametrize("hi_dtype,lo_dtype", SPLIT_CASES, ids=SPLIT_IDS)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=mixed32)
def test_split_encode_decode_random_vs_reference(hi_dtype, lo_dtype, values):
    x = torch.tensor(values, dtype=torch.float32)
    hi, lo = sw.encode(x, hi_dtype, lo_dtype)
    ref_hi, ref_lo = ref_split_encode(x, hi_dtype, lo_dtype)
    assert torch.equal(hi.double(), ref_hi)
    assert torch.equal(lo.long(), ref_lo)
    fin = torch.isfinite(ref_hi)
    assert (lo[~fin] == 0).all()
    n = CODE_MAX[lo_dtype]
    dec = sw.decode(hi, lo).double()[fin]
    h = torch.exp2(ref_half_ulp_log2(ref_hi[fin], FORMAT[hi_dtype]).double())
    x_f = x.double()[fin]
    bound = 0.5 * h / n + h * 2.0**-23 + ulp32(torch.maximum(x_f.abs(), dec.abs()))
    assert ((dec - x_f).abs() <= bound).all()


@pytest.mark.parametrize("hi_dtype,lo_dtype", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_non_finite_and_overflow(hi_dtype, lo_dtype):
    top = FORMAT[hi_dtype][2]
    threshold = top + 2.0 ** (math.frexp(top)[1] - 1 - FORMAT[hi_dtype][0] - 1)  # ties to inf
    vals = [INF, -INF, math.nan, FP32_MAX, -FP32_MAX, threshold, -threshold]
    x = torch.tensor(vals, dtype=torch.float32)
    assert torch.equal(x.double()[5:], torch.tensor(vals[5:], dtype=torch.float64))
    hi, lo = sw.encode(x, hi_dtype, lo_dtype)
    want = [INF, -INF, math.nan, INF, -INF, INF, -INF]
    for got, w, r in zip(hi.double().tolist(), want, ref_round(x.double(), FORMAT[hi_dtype]).tolist()):
        assert (math.isnan(got) and math.isnan(w) and math.isnan(r)) or got == w == r
    assert (lo == 0).all()
    dec = sw.decode(hi, lo)
    assert torch.equal(torch.isnan(dec), torch.isnan(hi.float()))
    assert torch.equal(dec[~torch.isnan(dec)], hi.float()[~torch.isnan(dec)])
    # just below the threshold: hi is the largest finite value, the error term is full scale
    below = torch.tensor([threshold, -threshold], dtype=torch.float32)
    below = torch.nextafter(below, torch.zeros_like(below))
    hi, lo = sw.encode(below, hi_dtype, lo_dtype)
    assert hi.double().tolist() == [top, -top]
    n = CODE_MAX[lo_dtype]
    assert lo.tolist() == ref_split_encode(below, hi_dtype, lo_dtype)[1].tolist()
    assert (lo.abs() >= 0.99 * n).all()  # r = 1 - 2**-15 (bf16) or 1 - 2**-12 (fp16)


def test_split_extreme_exponents_bf16():
    """Both ends of bf16's range, where a single 2**(+-134) or 2**(+-119) factor would over- or
    underflow fp32: the largest finite values, min normal, subnormals and fp32's own subnormals."""
    s = 2.0**-149  # smallest fp32 subnormal
    vals = [
        s, 2 * s, 2.0**-134 - s, 2.0**-134, 2.0**-134 + s, 2.0**-133 + 2.0**-134 - s,
        2.0**-126 - s, 2.0**-126, 2.0**-126 + 2.0**-134 - s, 2.0**-126 + 2.0**-135,
        BF16[2], BF16[2] + 2.0**119 - 2.0**104, BF16[2] - 2.0**119 + 2.0**104, 2.0**127 + 2.0**104,
    ]
    x = torch.tensor(vals + [-v for v in vals], dtype=torch.float64).float()
    assert torch.equal(x.double(), torch.tensor(vals + [-v for v in vals], dtype=torch.float64))
    for lo_dtype in (torch.int8, torch.int16):
        n = CODE_MAX[lo_dtype]
        hi, lo = sw.encode(x, torch.bfloat16, lo_dtype)
        ref_hi, ref_lo = ref_split_encode(x, torch.bfloat16, lo_dtype)
        assert torch.equal(hi.double(), ref_hi)
        assert torch.equal(lo.long(), ref_lo)
        assert torch.isfinite(hi).all()
        # r = (x - hi) / half_ulp is (close to) +-1 for the ``... - s`` / ``+ 2**119 - ...`` cases
        assert lo.abs().max() >= n - 1
        assert (lo != 0).sum() >= 10
        dec = sw.decode(hi, lo).double()
        h = torch.exp2(ref_half_ulp_log2(ref_hi, BF16).double())
        assert ((dec - x.double()).abs() <= 0.5 * h / n + h * 2.0**-23 + ulp32(x.double())).all()


def test_split_zero_and_negative_zero():
    x = torch.tensor([0.0, -0.0])
    for hi_dtype, lo_dtype in SPLIT_CASES:
        hi, lo = sw.encode(x, hi_dtype, lo_dtype)
        assert bits(hi).tolist() == bits(x.to(hi_dtype)).tolist()  # sign of zero kept in hi
        assert (lo == 0).all()
        assert (sw.decode(hi, lo) == 0).all()


def test_store_writes_encode_in_place_and_code_max():
    assert sw.code_max(torch.int8) == 127 and sw.code_max(torch.int16) == 32767
    x = torch.randn(257, generator=torch.Generator().manual_seed(4)) * 3
    for hi_dtype, lo_dtype in SPLIT_CASES:
        hi = torch.zeros(257, dtype=hi_dtype)
        lo = torch.zeros(257, dtype=lo_dtype)
        hi_ptr, lo_ptr = hi.data_ptr(), lo.data_ptr()
        sw.store(hi, lo, x)
        assert hi.data_ptr() == hi_ptr and lo.data_ptr() == lo_ptr
        ref_hi, ref_lo = ref_split_encode(x, hi_dtype, lo_dtype)
        assert torch.equal(hi.double(), ref_hi) and torch.equal(lo.long(), ref_lo)


def test_error_term_dtype():
    assert sw.error_term_dtype(24) == torch.int8
    assert sw.error_term_dtype(32) == torch.int16
    assert sw.error_term_dtype(None) is None  # fp32 masters: no error term (DESIGN §2.1)
    for bad in (16, 8, 0, "24"):
        with pytest.raises(ValueError):
            sw.error_term_dtype(bad)


# ============================================================================ companded states (§2.2)


def make_state(case, numel, kind, gen):
    x = torch.randn(numel, generator=gen)
    if case == "mixed_scales":  # every group of its own magnitude, 1e-9 .. 1e4
        g = -(-numel // 32)
        mag = torch.exp(torch.empty(g).uniform_(math.log(1e-9), math.log(1e4), generator=gen))
        x = x * mag.repeat_interleave(32)[:numel]
    elif case == "heavy_tailed":
        x = x * torch.exp(2 * torch.randn(numel, generator=gen))  # stays below fp16's max
    elif case == "small":
        x = x * 1e-3
    if kind == cp.SQRT:
        x = x * x  # second moments
    return x


def assert_codes_close(codes, ref_codes, what=""):
    """Equal, or one step apart where fp32 and fp64 round a .5 boundary differently (rarely)."""
    d = (codes.long().view(-1) - ref_codes.view(-1)).abs()
    assert d.max() <= 1, f"{what}: code differs by {int(d.max())}"
    n = int((d != 0).sum())  # about 2 per million elements are seen
    assert n <= max(2, 1e-4 * d.numel()), f"{what}: {n} of {d.numel()} codes differ by one"
    return n


CODE_DTYPE = {cp.SIGNED: torch.int8, cp.SQRT: torch.uint8}
SHAPES = [(1, 5), (1, 12), (17,), (31,), (32,), (33,), (17, 32), (3, 7, 11), (1024, 16), (4097,)]


@pytest.mark.parametrize("kind", [cp.SIGNED, cp.SQRT])
@pytest.mark.parametrize("case", ["normal", "mixed_scales", "heavy_tailed", "small"])
def test_companded_encode_decode_vs_reference(kind, case):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{case}".encode()))
    total_diffs = total = 0
    for shape in SHAPES:
        numel = math.prod(shape)
        x = make_state(case, numel, kind, gen).view(shape)
        codes, scales = cp.encode(x, kind)
        groups = -(-numel // 32)
        # bytes: one code per (padded) element, one bf16 scale per group of 32
        assert codes.shape == (groups * 32,) and codes.dtype == CODE_DTYPE[kind]
        assert scales.shape == (groups,) and scales.dtype == torch.bfloat16
        ref_codes, ref_scale = ref_companded_encode(x, kind)
        assert torch.equal(scales.double(), ref_scale), "bf16 scale != ref_group_scale(max(absmax, 1e-12))"
        total_diffs += assert_codes_close(codes, ref_codes, f"{kind} {case} {shape}")
        total += numel
        pad = groups * 32 - numel
        if pad:
            assert (codes[numel:] == 0).all()
        # the tail group's scale is the absmax of its real elements only
        tail = x.reshape(-1)[(groups - 1) * 32 :].double()
        if kind == cp.SQRT:
            tail = f32(tail.sqrt())
        tail_max = tail.abs().max().clamp(min=float(SCALE_FLOOR32), max=BF16[2])
        assert scales[-1].item() == ref_group_scale(tail_max).item()

        dec = cp.decode(codes, scales, shape, kind)
        assert dec.shape == x.shape and dec.dtype == torch.float32
        # decode is bit exact against the op-by-op fp32 reference of DESIGN's formula
        want = ref_companded_decode(codes, scales.double(), kind).reshape(-1)[:numel]
        assert torch.equal(dec.reshape(-1).double(), want)
        exact = ref_companded_decode_exact(codes, scales.double(), kind).reshape(-1)[:numel]
        # ... and close to the exact value: at most ~5 fp32 roundings (2**-24 relative each; the
        # rounding of q/127 is doubled by du/dy <= 2, and SQRT squares two rounded factors)
        assert ((dec.reshape(-1).double() - exact).abs() <= 6 * 2.0**-24 * exact.abs()).all()

        # round-trip error from the code step alone (both companders)
        s = ref_scale.repeat_interleave(32)[:numel]
        xd = x.reshape(-1).double()
        if kind == cp.SIGNED:
            # |dy| <= 1/254, and du/dy = 2 / (2 - |y|)**2 <= 2  ->  |dx| <= scale / 127
            inside = xd.abs() <= s
            err = (dec.reshape(-1).double() - xd).abs()
            assert (err[inside] <= s[inside] / 127 * (1 + 2.0**-10) + ulp32(xd[inside])).all()
        else:
            # sqrt(v) is quantised linearly: |d sqrt(v)| <= half a code step, scale / 510; below half a
            # step a positive sqrt(v) is stored as one step (the floor), never as 0
            inside = xd.sqrt() <= s
            root, stored = xd.sqrt()[inside], dec.reshape(-1).double().sqrt()[inside]
            step = s[inside] / 255
            floored = (root > 0) & (root < step / 2)
            assert ((stored[floored] - step[floored]).abs() <= 2.0**-20 * step[floored]).all()
            err = (stored - root).abs()[~floored]
            assert (err <= step[~floored] / 2 * (1 + 2.0**-10) + ulp32(s[inside][~floored])).all()
            # hence never below 2/3 of the true sqrt(v) (every bf16 scale is a normal)
            assert (stored >= 2 / 3 * root * (1 - 2.0**-10)).all()
    assert total_diffs <= max(2, total * 1e-4)


def test_companded_tiny_and_huge_groups_keep_their_scales():
    """bf16 scales (docs/numerics.md, "bf16 group scales"): groups far below fp16's range keep a
    positive scale and their full range of codes, where fp16 scales rounded to 0 below 2**-25 (the
    group decoded to 0) and kept a few bits below 2**-14; groups far above 65504 are stored too.
    Only an all-zero group has the floor's scale, fp32(1e-12) rounded to bf16, and codes 0."""
    g = torch.zeros(8, 32)
    g[1, 3] = 2.0**-26  # fp16 scales: 0
    g[2, 5] = -(2.0**-25)  # fp16 scales: 0 (a tie to even)
    g[3] = torch.linspace(-1e-6, 1e-6, 32)  # fp16 scales: subnormal, 4 bits
    g[4] = torch.linspace(-3e-11, 1e-11, 32)  # near the 1e-12 floor
    g[5] = torch.linspace(-3.0, 2.0, 32)
    g[6] = torch.linspace(-1e6, 3e5, 32)  # fp16 scales: saturated at 65504
    g[7] = torch.linspace(-1e18, 2e17, 32)  # squared (second moments): 1e36, finite
    for kind in (cp.SIGNED, cp.SQRT):
        x = g.abs() ** 2 if kind == cp.SQRT else g
        codes, scales = cp.encode(x, kind)
        ref_codes, ref_scale = ref_companded_encode(x, kind)
        assert torch.equal(scales.double(), ref_scale)
        assert scales[0].item() == FLOOR_SCALE.item() and (codes.view(8, 32)[0] == 0).all()
        # a fresh state (CompandedState.zeros) stores what encoding zeros gives
        assert torch.equal(cp.zero_scales(3).view(torch.int16), cp.encode(torch.zeros(70), kind)[1].view(torch.int16))
        assert (scales[1:].float() > 0).all()
        assert_codes_close(codes, ref_codes, kind)
        dec = cp.decode(codes, scales, x.shape, kind)
        assert torch.equal(dec.double(), ref_companded_decode(codes, scales.double(), kind))
        assert (dec[0] == 0).all()
        # every group's largest element takes the top code and decodes to the scale: at most 2**-9 above
        # it (rounded up to nearest), at most a bf16 spacing, 2**-7 relative, below it (toward zero;
        # v = sqrt(v)**2: twice as much)
        top = x.abs().argmax(dim=1)
        rows = torch.arange(8)
        want, got = x[rows, top].abs().double(), dec[rows, top].abs().double()
        power = 1 if kind == cp.SIGNED else 2
        assert (codes.view(8, 32)[rows, top].long().abs() == (127 if kind == cp.SIGNED else 255))[1:].all()
        assert (got <= want * (1 + 2.0**-9 + 2.0**-20) ** power)[1:].all() and (want - got <= want * power * 2.0**-7)[1:].all()


def test_companded_beyond_the_largest_scale_saturates():
    """Signed states: bf16's largest finite value is the largest scale (fp32's largest would round
    to inf). Second moments: the largest bf16 whose square is finite, so that the top code never
    decodes to inf (the next bf16, 2**64, would): v near fp32's largest decodes to that square."""
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    big = torch.finfo(torch.float32).max
    top = cp.SCALE_MAX[cp.SIGNED]
    assert top == torch.finfo(torch.bfloat16).max
    x[0, :4] = torch.tensor([big, -big, top, 1e37])
    codes, scales = cp.encode(x, cp.SIGNED)
    assert scales.float().tolist()[0] == top
    c = codes.view(2, 32)
    assert c[0, :3].tolist() == [127, -127, 127]
    ref_codes, ref_scale = ref_companded_encode(x, cp.SIGNED)
    assert torch.equal(scales.double(), ref_scale)
    assert_codes_close(codes, ref_codes, "signed")
    dec = cp.decode(codes, scales, x.shape, cp.SIGNED)
    assert dec[0, :3].tolist() == [top, -top, top]
    assert abs(dec[0, 3].item() - 1e37) <= top / 127

    root_top = cp.SCALE_MAX[cp.SQRT]
    above = torch.tensor(root_top, dtype=torch.bfloat16).view(torch.int16) + 1
    squares = torch.tensor([root_top, above.view(torch.bfloat16).item()]).square()  # fp32
    assert torch.isfinite(squares[0]) and torch.isinf(squares[1])
    v = x.abs()
    v[0, :3] = torch.tensor([big, squares[0].item(), 1.0])
    codes, scales = cp.encode(v, cp.SQRT)
    assert scales.float().tolist()[0] == root_top and codes.view(2, 32)[0, :2].tolist() == [255, 255]
    dec = cp.decode(codes, scales, v.shape, cp.SQRT)
    assert torch.isfinite(dec).all() and dec[0, 0].item() == dec[0, 1].item() == torch.tensor(root_top).square().item()


def test_companded_non_finite_groups_decode_to_nan():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    x[1, 7], x[2, 0] = INF, math.nan
    for kind in (cp.SIGNED, cp.SQRT):
        xi = x.abs() if kind == cp.SQRT else x
        codes, scales = cp.encode(xi, kind)
        assert torch.isnan(scales[1:3]).all() and torch.isfinite(scales[[0, 3]]).all()
        assert (codes.view(4, 32)[1:3] == 0).all()  # defined codes, not a nan cast
        ref_codes, ref_scale = ref_companded_encode(xi, kind)
        assert torch.equal(scales.double()[[0, 3]], ref_scale[[0, 3]])
        assert torch.isnan(ref_scale[1:3]).all()
        assert (codes.long().view(4, 32) - ref_codes).abs().max() <= 1
        dec = cp.decode(codes, scales, xi.shape, kind)
        assert torch.isnan(dec[1:3]).all() and torch.isfinite(dec[[0, 3]]).all()


def test_companded_decode_every_code_bit_exact():
    """All 256 codes of each kind against a spread of scales, from the 1e-12 floor to bf16's max, and 0."""
    sc = torch.tensor([0.0, 1e-12, 2.0**-24, 1e-6, 6.1e-5, 0.1, 1.0, 3.14, 1000.0, 65504.0, 1e30, cp.SCALE_MAX[cp.SIGNED]]
                      + [1.0] * 4)
    scales = sc.to(torch.bfloat16)
    for kind, lo, hi in ((cp.SIGNED, -128, 128), (cp.SQRT, 0, 256)):
        q = torch.arange(lo, hi).to(CODE_DTYPE[kind])
        q = q.view(-1, 32).repeat(scales.numel() * 32 // q.numel(), 1).view(-1)[: scales.numel() * 32]
        dec = cp.decode(q, scales, (scales.numel() * 32,), kind)
        want = ref_companded_decode(q, scales.double(), kind).view(-1)
        assert torch.equal(dec.double(), want)
    # SIGNED: q = +-127 decodes to +-scale, q = 0 to 0, and decode is odd in q
    q = torch.tensor([127, -127, 0] + [0] * 29, dtype=torch.int8)
    s = torch.tensor([3.14], dtype=torch.bfloat16)
    d = cp.decode(q, s, (32,), cp.SIGNED)
    assert d[:3].tolist() == [s.item(), -s.item(), 0.0]
    q = torch.arange(-127, 128).to(torch.int8)
    q = torch.cat([q, q.new_zeros(1)])
    d = cp.decode(q, torch.full((8,), 1.5, dtype=torch.bfloat16), (256,), cp.SIGNED)
    assert torch.equal(d[:255], -d[:255].flip(0))
    assert (d[1:255] > d[:254]).all()


def test_companded_partial_and_empty_and_bad_kind():
    for numel in (1, 5, 31, 33, 100, 1000):
        x = torch.arange(1, numel + 1, dtype=torch.float32)
        codes, scales = cp.encode(x, cp.SQRT)
        groups = -(-numel // 32)
        assert codes.numel() == groups * 32 and scales.numel() == groups
        assert (codes[numel:] == 0).all()
        assert cp.num_groups(numel) == groups
    codes, scales = cp.encode(torch.empty(0), cp.SIGNED)
    assert codes.numel() == 0 and scales.numel() == 0
    assert cp.decode(codes, scales, (0, 3), cp.SIGNED).shape == (0, 3)
    with pytest.raises(ValueError):
        cp.encode(torch.ones(3), "linear")
    with pytest.raises(ValueError):
        cp.decode(torch.zeros(32, dtype=torch.int8), torch.ones(1, dtype=torch.bfloat16), (3,), "x")


def test_companded_sqrt_negative_zero_and_bf16_input():
    v = torch.tensor([-0.0, 0.0, 4.0, 1.0]).to(torch.bfloat16)
    codes, scales = cp.encode(v, cp.SQRT)
    assert scales.tolist() == [2.0] and codes[:4].tolist() == [0, 0, 255, 128]
    dec = cp.decode(codes, scales, v.shape, cp.SQRT)
    assert dec.tolist()[:3] == [0.0, 0.0, 4.0]
    assert dec[3].item() == pytest.approx((128 / 255 * 2) ** 2, rel=1e-6)


def test_companded_sqrt_floor_keeps_positive_second_moments_nonzero():
    """Issue 15's rule: a positive sqrt(v) gets code 1 at least, where DESIGN §2.2's rounding gives 0
    (below half a code step); 0, -0.0 and groups whose scale is nan keep code 0. A group whose fp16
    scale would have underflowed to 0 keeps its codes (bf16 scales).
    Codes equal the fp64 reference exactly (no value here is near a .5 boundary)."""
    fractions = [1e-12, 1e-6, 0.1 / 255, 0.49 / 255, 0.51 / 255, 1 / 255, 1.4 / 255, 0.31, 1.0]
    groups = []
    for top in (3 * 2.0**-14, 1e-3, 1.0, 300.0, 6e4):  # sqrt(v)'s absmax
        groups.append(torch.tensor([f * top for f in fractions] + [0.0] * (32 - len(fractions)), dtype=torch.float64).square())
    groups.append(torch.tensor([2.0**-149, 1.0] + [0.0] * 30, dtype=torch.float64))  # the smallest fp32 v
    groups.append(torch.full((32,), 2.0**-52, dtype=torch.float64))  # sqrt 2**-26: an fp16 scale was 0
    groups.append(torch.tensor([1e-20, math.nan] + [1.0] * 30, dtype=torch.float64))  # nan group
    v = torch.stack(groups).float()
    v[0, -1] = -0.0
    codes, scales = cp.encode(v, cp.SQRT)
    ref_codes, ref_scale = ref_companded_encode(v, cp.SQRT)
    torch.testing.assert_close(scales.double(), ref_scale, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(codes.long().view(-1, 32), ref_codes)

    codes = codes.view(-1, 32).long()
    live = (v > 0) & (scales.float() > 0).view(-1, 1)  # positive v in a group with a positive scale
    assert int(live.sum()) == 5 * len(fractions) + 2 + 32
    assert (codes[live] >= 1).all() and (codes[~live] == 0).all()
    # DESIGN §2.2's rounding would store 0 for 21 of them: this test sees the floor
    paper = torch.floor(255 * v.double().sqrt() / ref_scale.view(-1, 1) + 0.5)
    assert int((live & (paper == 0)).sum()) == 21
    dec = cp.decode(codes.to(torch.uint8).view(-1), scales, v.shape, cp.SQRT)
    assert (dec[live] > 0).all()
    assert (dec[:6].sqrt() >= 2 / 3 * v[:6].sqrt() * (1 - 2.0**-20)).all()


# ============================================================================ bytes per parameter (§2.3)


def test_bytes_per_parameter():
    numel = 4096 * 4  # a multiple of 32: no padding
    x = torch.randn(numel)
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    m = cp.encode(x, cp.SIGNED)
    v = cp.encode(x.square(), cp.SQRT)
    assert nbytes(*m) / numel == 1 + 1 / 16  # SGD momentum
    assert nbytes(*m, *v) / numel == 2 + 1 / 8  # AdamW exp_avg + exp_avg_sq
    hi, lo = sw.encode(x, torch.bfloat16, sw.error_term_dtype(24))
    assert nbytes(hi, lo) / numel == 3  # 24-bit master: bf16 weight + int8 error term
    hi, lo = sw.encode(x, torch.bfloat16, sw.error_term_dtype(32))
    assert nbytes(hi, lo) / numel == 4
    # AdamW flashoptim 24-bit: weights 2 + error 1 + grads 2 + states 2 1/8 = 7.125
    assert 2 + 1 + 2 + nbytes(*m, *v) / numel == 7.125


# ============================================================================ compiled path


def _round_trip_all(x, v):
    """Every format, encode then decode, in one graph."""
    out = {}
    for name, hd, ld in (("bf16_i8", torch.bfloat16, torch.int8),
                         ("bf16_i16", torch.bfloat16, torch.int16),
                         ("fp16_i16", torch.float16, torch.int16)):
        hi, lo = sw.encode(x, hd, ld)
        out[name] = (hi, lo, sw.decode(hi, lo))
    codes, scales = cp.encode(x, cp.SIGNED)
    out["signed"] = (codes, scales, cp.decode(codes, scales, x.shape, cp.SIGNED))
    codes, scales = cp.encode(v, cp.SQRT)
    out["sqrt"] = (codes, scales, cp.decode(codes, scales, v.shape, cp.SQRT))
    return out


def _compile_inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3000 - 7, generator=gen)  # not a multiple of 32
    x[:64] *= torch.exp(20 * torch.randn(64, generator=gen))  # wide range of magnitudes
    x[64:80] = torch.tensor([2.0**-149, -(2.0**-140), 2.0**-134, 1e-38, 3.3e38, -3.38e38, 65519.0,
                             65520.0, 0.0, -0.0, 1e-30, -1e-7, 6e-8, 2.0**-126, 3.39e38, 1.0])
    x[96:128] *= 1e-9  # a group with an fp16-subnormal scale
    x[128:160] = 0.0  # an all-zero group
    x[200] = INF  # a non-finite group ...
    x[300] = math.nan  # ... and another
    v = x.square() * torch.rand(x.shape, generator=gen)
    return x, v


def _inductor_options():
    """Eager-like numerics: keep fp32 -> bf16/fp16 -> fp32 round trips inside fused kernels, and (on
    Triton, where fp32 ``/`` is otherwise the approximate div.full) round divisions like eager."""
    opts = {"emulate_precision_casts": True}
    if hasattr(getattr(torch._inductor.config, "eager_numerics", None), "division_rounding"):
        opts["eager_numerics.division_rounding"] = True
    return opts


@pytest.fixture(scope="module")
def compiled_and_eager():
    x, v = _compile_inputs()
    fn = torch.compile(_round_trip_all, backend="inductor", fullgraph=True, dynamic=False)
    # As the backend compiles: with its C++ codegen workarounds, which Inductor's FX graph cache key
    # does not see (so no cache: an entry compiled without them would be returned).
    with torch._inductor.config.patch({**_inductor_options(), "fx_graph_cache": False}), \
            _compat.cpp_codegen_workarounds():
        compiled = fn(x, v)
    return x, v, compiled, _round_trip_all(x, v)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16_i8", "bf16_i16", "fp16_i16"])
def test_compiled_split_weights_bit_exact(compiled_and_eager, name):
    x, _, compiled, eager = compiled_and_eager
    (hi_c, lo_c, dec_c), (hi_e, lo_e, dec_e) = compiled[name], eager[name]
    assert_same_bits(hi_c, hi_e)
    assert torch.equal(lo_c, lo_e)
    assert_same_bits(dec_c, dec_e)
    hd, ld = {"bf16_i8": (torch.bfloat16, torch.int8), "bf16_i16": (torch.bfloat16, torch.int16),
              "fp16_i16": (torch.float16, torch.int16)}[name]
    ref_hi, ref_lo = ref_split_encode(x, hd, ld)
    ok = ~torch.isnan(x)
    assert torch.equal(hi_c.double()[ok], ref_hi[ok]) and torch.equal(lo_c.long(), ref_lo)


@pytest.mark.slow
def test_compiled_encode_keeps_error_terms(compiled_and_eager):
    """The known pitfall: without emulate_precision_casts Inductor keeps x.to(bf16) in fp32 inside
    the fused kernel, so x - float(bf16(x)) == 0 and every error term is silently 0. With the
    setting (as the backend compiles), random data gets nonzero error terms almost everywhere."""
    x, _, compiled, _ = compiled_and_eager
    body = slice(400, None)  # plain randn values
    for name in ("bf16_i8", "bf16_i16", "fp16_i16"):
        hi, lo, dec = compiled[name]
        assert (lo[body] != 0).double().mean() > 0.9, name
        # and they matter: the decoded master is much closer to x than hi is
        assert (dec[body] - x[body]).abs().sum() < 0.05 * (hi[body].float() - x[body]).abs().sum()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_compiled_companded_matches_eager(compiled_and_eager, kind):
    x, v, compiled, eager = compiled_and_eager
    (codes_c, scales_c, dec_c), (codes_e, scales_e, dec_e) = compiled[kind], eager[kind]
    assert codes_c.dtype == codes_e.dtype and codes_c.shape == codes_e.shape
    assert_same_bits(scales_c, scales_e)
    assert_codes_close(codes_c, codes_e.long(), f"compiled {kind}")
    same = (codes_c == codes_e).view(-1, 32).all(dim=1).repeat_interleave(32)[: x.numel()]
    assert_same_bits(dec_c.view(-1)[same], dec_e.view(-1)[same])
    ref_codes, ref_scale = ref_companded_encode(x if kind == "signed" else v, kind)
    torch.testing.assert_close(scales_c.double(), ref_scale, rtol=0, atol=0, equal_nan=True)
    assert_codes_close(codes_c, ref_codes, f"compiled {kind} vs reference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_on_gpu_matches_cpu_eager():
    """Triton kernels (Inductor on CUDA) give the same codes as eager on CPU."""
    x, v = _compile_inputs()
    fn = torch.compile(_round_trip_all, backend="inductor", fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(_inductor_options()):
        got = {k: tuple(t.cpu() for t in ts) for k, ts in fn(x.cuda(), v.cuda()).items()}
    eager_gpu = {k: tuple(t.cpu() for t in ts) for k, ts in _round_trip_all(x.cuda(), v.cuda()).items()}
    want = _round_trip_all(x, v)
    for out in (got, eager_gpu):
        for name in ("bf16_i8", "bf16_i16", "fp16_i16"):
            assert_same_bits(out[name][0], want[name][0])
            assert torch.equal(out[name][1], want[name][1]), name
            assert_same_bits(out[name][2], want[name][2])
        for kind in ("signed", "sqrt"):
            assert_same_bits(out[kind][1], want[kind][1])
            assert_codes_close(out[kind][0], want[kind][0].long(), f"gpu {kind}")
