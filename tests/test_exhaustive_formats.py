"""Exhaustive round trips of the storage formats (issue 12, item 4).

Split weights: ``encode(decode(encode(x))) == encode(x)`` for every fp32 ``x``, so exporting the fp32
masters and loading them back changes no bit. Checked for every finite bf16 / fp16 ``hi`` and every
code the encoder can emit for it (int8: all of them; int16: a subset holding every edge code). Which
codes it can emit is established from the spec, not from the module: the fp32 interval of values
that round to ``hi`` (from its neighbours' midpoints and ties-to-even), and one witness per code,
the fp32 value of that interval nearest the code's centre (``witnesses``). Also: decode stays within
half a code step of the value encoded (fp64 reference of DESIGN §2.1 and its one deviation), and a
prepared model's masters reload without a bit changing.

Companded states: decode then encode gives back every code and every bf16 scale encode stores for
finite values (from fp32(1e-12) rounded to bf16, the floor where all-zero groups go, up to bf16's largest finite
value, or for second moments the largest bf16 whose square is finite), when the group holds the top code
(so that its absmax is the scale); groups without it come back with the scales saved with them.

The float64 references come from tests/test_formats.py (written from DESIGN.md, no module helper).
"""

import importlib.util
import pathlib
import sys

import pytest
import torch

if importlib.util.find_spec("flash_inductor") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from test_formats import (  # noqa: E402
    CODE_MAX,
    FORMAT,
    SPLIT_CASES,
    SPLIT_IDS,
    all_values,
    bits,
    ref_half_ulp_log2,
    ref_split_encode,
    ulp32,
)

import flash_inductor  # noqa: E402
from flash_inductor.formats import companded as cp  # noqa: E402
from flash_inductor.formats import split_weights as sw  # noqa: E402
from helpers import EAGER, Net, ref_decode_state, stored_bits  # noqa: E402
from reference import FLOOR_SCALE, FP32, INF, ref_companded_encode, ref_round  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many small elementwise ops on ~1M-element chunks: with a second OpenMP thread on 2 busy cores
    they ran 13x slower (spinning threads); one thread is about as fast as two on idle ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# ============================================================================ spec-side helpers


def finite_values(dtype):
    v, finite = all_values(dtype)
    return v[finite]


def sign_of(v64):
    """+-1 by the sign bit (so -0.0 gives -1)."""
    return torch.copysign(torch.ones_like(v64), v64)


def next32(v64, toward64):
    """The fp32 neighbour of the fp32 value ``v64`` in the direction of ``toward64`` (as float64)."""
    return torch.nextafter(v64.float(), toward64.float()).double()


def half_ulp(hi):
    return torch.exp2(ref_half_ulp_log2(hi.double().abs(), FORMAT[hi.dtype]).double())


def rounding_interval(hi):
    """Magnitudes ``(bottom, top)`` (float64, both fp32 values) of the fp32 values that round to each
    finite ``hi``, and ``h``: the midpoints to the neighbours, which round to the even significand."""
    mant, emin, _ = FORMAT[hi.dtype]
    a = hi.double().abs()
    h = half_ulp(hi)
    significand = a / (2 * h)  # an integer: |hi| in units of its ULP
    even = significand % 2 == 0
    # |hi| = 2**e above the smallest normal: the next value toward zero is only h away
    edge = (significand == 2**mant) & (a >= 2.0 ** (emin + 1))
    up = a + h  # the largest value's upper midpoint is the overflow threshold (odd: excluded)
    down = torch.where(edge, a - h / 2, (a - h).clamp(min=0))
    top = torch.where(even, up, next32(up, a))
    bottom = torch.where(even, down, next32(down, a))
    return bottom, top, h


def interval_ends(hi):
    """fp32 [H, 2]: the two ends of each ``hi``'s interval, and [H, 2]: the fp32 values just outside."""
    bottom, top, _ = rounding_interval(hi)
    s = sign_of(hi.double())
    ends = torch.stack([s * bottom, s * top], 1)
    outside = torch.stack([next32(ends[:, 0], -s * INF), next32(ends[:, 1], s * INF)], 1)
    return ends.float(), outside.float()


def witnesses(hi, codes, n):
    """fp32 x [H, C]: for each ``hi`` and code, the fp32 value of ``hi``'s interval nearest the code's
    centre ``hi + code * h / n``: it encodes to ``(hi, code)`` if any fp32 value does.

    The reference code is monotone in x, and the x with a given code form an interval around its
    centre, of radius ``h / (2n)``, open at one end (closed at both for a capped code: its far end is
    the tie rel = -0.5). An fp32 x with the code is at least as far from the centre as this value,
    which is therefore inside too: it cannot lie on the open end at the same distance, as the centre
    is dyadic only for codes 0 and +-n, where it is an fp32 value itself (or outside the interval,
    whose end is then the nearest). float64 places the centre far closer than its distance to any
    fp32 midpoint (at least about 2**-40 relative).
    """
    bottom, top, h = rounding_interval(hi)
    s = sign_of(hi.double())[:, None]
    centre = hi.double().abs()[:, None] + s * codes.double() * (h[:, None] / n)
    nearest = centre.float()  # IEEE float64 -> fp32 conversion: round to nearest
    nearest = torch.minimum(torch.maximum(nearest, bottom.float()[:, None]), top.float()[:, None])
    return s.float() * nearest


def int16_codes(n):
    """The int16 codes tested for every hi: the edges of the range, of the binade-edge cap and of
    zero, and a stride through the rest."""
    half = n // 2
    edges = [0, 1, 2, half - 1, half, half + 1, half + 2, n - 2, n - 1, n]
    stride = list(range(3, n - 2, 331))
    return torch.tensor(sorted({c * s for c in edges + stride for s in (1, -1)}))


def same_bits(a, b):
    """Same dtype, shape and bytes (so -0.0 != 0.0)."""
    same_kind = a.dtype == b.dtype and a.shape == b.shape
    return same_kind and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ============================================================================ split weights: round trip


def design_code(x64, hi64, h, n):
    """DESIGN §2.1's plain code: round_half_away(clamp((x - hi) / h, -1, 1) * n), in float64 (exact)."""
    r = ((x64 - hi64) / h).clamp(-1, 1) * n
    return (torch.sign(r) * torch.floor(r.abs() + 0.5)).long()


def below_binade_edge(x64, hi64, hi_dtype):
    """|hi| = 2**e above the smallest normal and |x| < |hi|: where the code magnitude is capped."""
    edge = (torch.frexp(hi64)[0].abs() == 0.5) & (hi64.abs() >= 2.0 ** (FORMAT[hi_dtype][1] + 1))
    return edge & (x64.abs() < hi64.abs())


def round_trip_chunk(hi, codes, lo_dtype, contiguous):
    """The checks of ``test_split_round_trip_every_hi_every_emitted_code`` for rows ``hi`` [H] and
    their codes [H, C] (the last two columns: the codes of the interval's ends)."""
    hi_dtype, n = hi.dtype, CODE_MAX[lo_dtype]
    x = witnesses(hi, codes, n)
    got_hi, got_lo = sw.encode(x, hi_dtype, lo_dtype)
    assert (bits(got_hi) == bits(hi)[:, None]).all()  # every witness lies in hi's interval
    # the module's codes are the reference's (DESIGN's plus the cap), whose preimages ``witnesses`` uses
    x64, hi64, h = x.double(), hi.double()[:, None], half_ulp(hi)[:, None]
    want = design_code(x64, hi64, h, n)
    want = torch.where(below_binade_edge(x64, hi64, hi_dtype), want.clamp(-(n // 2), n // 2), want)
    assert torch.equal(got_lo.long(), want)
    emitted = got_lo.long() == codes
    ends = codes[:, -2:]
    in_range = (codes >= ends.min(1, keepdim=True).values) & (codes <= ends.max(1, keepdim=True).values)
    assert not (emitted & ~in_range).any()  # the code is monotone in x: the interval's ends bound it
    assert emitted[:, -2:].all()
    if contiguous:
        assert torch.equal(emitted, in_range)

    pair_hi = hi[:, None].expand_as(codes)[emitted]
    pair_lo = codes[emitted].to(lo_dtype)
    again_hi, again_lo = sw.encode(sw.decode(pair_hi, pair_lo), hi_dtype, lo_dtype)
    assert same_bits(again_hi, pair_hi)
    assert torch.equal(again_lo, pair_lo)
    return emitted


@pytest.mark.parametrize("hi_dtype,lo_dtype", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_round_trip_every_hi_every_emitted_code(hi_dtype, lo_dtype):
    """encode(decode(hi, c)) == (hi, c), bit for bit, for every finite hi and every code c the
    encoder emits for it (int8: all; int16: those of ``int16_codes`` and the interval ends' codes).
    The emitted codes are those whose witness encodes to them; for int8 (and bf16 + int16, where a
    code step is about one fp32 ulp) they are every code between the ends' codes."""
    n = CODE_MAX[lo_dtype]
    hi = finite_values(hi_dtype)
    ends, outside = interval_ends(hi)
    # the spec's interval is exactly what rounds to hi
    assert (bits(ends.to(hi_dtype)) == bits(hi)[:, None]).all()
    assert (bits(outside.to(hi_dtype)) != bits(hi)[:, None]).all()
    end_codes = sw.encode(ends, hi_dtype, lo_dtype)[1].long()
    tested = torch.arange(-n, n + 1) if lo_dtype == torch.int8 else int16_codes(n)
    contiguous = lo_dtype == torch.int8 or hi_dtype == torch.bfloat16
    emitted = []
    for rows in torch.arange(hi.numel()).split(4096):  # chunks: 16.6M pairs at once page-fault a lot
        codes = torch.cat([tested.expand(rows.numel(), -1), end_codes[rows]], 1)
        emitted.append(round_trip_chunk(hi[rows], codes, lo_dtype, contiguous))
    emitted = torch.cat(emitted)
    if not contiguous:
        # fp16 + int16: a code step is 2**-15 h, fp32's spacing 2**-12 h for normal hi: most codes
        # have no fp32 value there
        normal = hi.double().abs() >= 2.0**-14
        assert emitted[normal, :-2].float().mean() < 0.5


# ============================================================================ split weights: accuracy


def dense_inputs(hi_dtype, gen, n):
    """fp32 x around every finite ``hi``: both ends of its interval and the fp32 values just outside,
    both midpoints (ties), random interior values, and the fp32 values at and next to random code
    boundaries ``(c + 1/2) h / n`` on both sides, including the top one."""
    hi = finite_values(hi_dtype)
    bottom, top, h = rounding_interval(hi)
    s = sign_of(hi.double())[:, None]
    ends, outside = interval_ends(hi)
    a, h1 = hi.double().abs()[:, None], h[:, None]
    ties = torch.cat([a + h1, a - h1 / 2, a - h1], 1).clamp(min=0)  # only some are a neighbour's end
    lo_bits, hi_bits = bottom.float().view(torch.int32).long(), top.float().view(torch.int32).long()
    span = (hi_bits - lo_bits + 1)[:, None]
    interior = lo_bits[:, None] + (torch.rand(hi.numel(), 8, generator=gen, dtype=torch.float64) * span).long()
    interior = interior.clamp(max=hi_bits[:, None]).to(torch.int32).view(torch.float32).double()
    c = torch.randint(0, n, (hi.numel(), 6), generator=gen).double()
    c = torch.cat([c, torch.full_like(c[:, :1], n - 1)], 1) + 0.5
    boundary = ref_round(torch.cat([a + c * h1 / n, (a - c * h1 / n).clamp(min=0)], 1), FP32)
    near = torch.cat([boundary, next32(boundary, boundary * 0), next32(boundary, boundary + INF)], 1)
    mags = torch.cat([ties, interior, near], 1)
    return torch.cat([ends, outside, (s * mags).float()], 1).reshape(-1)


def random_fp32(count, gen):
    """Finite fp32 values with uniformly random bit patterns (every exponent), fp32 subnormals,
    +-0, and values beyond bf16's and fp16's overflow thresholds."""
    b = torch.randint(-(2**31), 2**31, (count,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = b.view(torch.float32)
    sub = (b & 0x807FFFFF).view(torch.float32)[: count // 8]  # exponent bits cleared: subnormal
    over = torch.cat([
        torch.empty(1000).uniform_(3.3961e38, 3.4028e38, generator=gen),
        torch.empty(1000).uniform_(65520.0, 1e9, generator=gen),
        torch.tensor([65520.0, (2 - 2.0**-8) * 2.0**127, 3.4028234663852886e38]),
    ])
    x = torch.cat([x, sub, over, -over, torch.tensor([0.0, -0.0])])
    return x[torch.isfinite(x)]


@pytest.mark.parametrize("hi_dtype,lo_dtype", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_decode_within_half_a_code_step(hi_dtype, lo_dtype):
    """Against the fp64 reference: hi == RNE(x) and the code as DESIGN §2.1 (plus the cap below binade
    edges, which changes exactly the code of the tie hi - h/2 there, by one); the decoded master
    rounds back to hi; the code's exact value is within half a code step, h / (2N), of x; decode is
    that value rounded once to fp32 (up to 2**-21 of a code unit; at the odd ties one fp32 ulp toward
    hi), so within h / (2N) + half an fp32 ulp of x."""
    n = CODE_MAX[lo_dtype]
    gen = torch.Generator().manual_seed(12)
    x = torch.cat([dense_inputs(hi_dtype, gen, n), random_fp32(200_000, gen)])
    hi, lo = sw.encode(x, hi_dtype, lo_dtype)
    ref_hi, ref_lo = ref_split_encode(x, hi_dtype, lo_dtype)
    assert same_bits(hi, ref_hi.to(hi_dtype))  # float64 -> 16 bits is exact (ref_hi is a value of it)
    assert torch.equal(lo.long(), ref_lo)
    dec = sw.decode(hi, lo)

    over = torch.isinf(hi)
    assert over.sum() >= 1000 and (lo[over] == 0).all() and same_bits(dec[over], hi[over].float())
    fin = ~over
    x64, hi64, lo64, dec, h = x.double()[fin], ref_hi[fin], ref_lo[fin], dec[fin], half_ulp(hi[fin])
    # the deviation: exactly the ties below binade edges, one code toward zero
    plain = design_code(x64, hi64, h, n)
    edge_tie = (torch.frexp(hi64)[0].abs() == 0.5) & ((hi64 - x64) * sign_of(hi64) == h / 2)
    edge_tie &= hi64.abs() >= 2.0 ** (FORMAT[hi_dtype][1] + 1)
    every = finite_values(hi_dtype).double()
    edges = (torch.frexp(every)[0].abs() == 0.5) & (every.abs() >= 2.0 ** (FORMAT[hi_dtype][1] + 1))
    assert torch.unique(hi64[edge_tie]).numel() == edges.sum()  # the tie below every binade edge
    assert torch.equal(lo64 != plain, edge_tie)
    assert torch.equal((plain - lo64)[edge_tie], -sign_of(hi64[edge_tie]).long())

    assert same_bits(dec.to(hi_dtype), hi[fin]), "the decoded master rounds to another hi"
    assert ((lo64 - (x64 - hi64) / h * n).abs() <= 0.5).all()  # in code steps, exact in float64
    # decode is the code's value rounded once to fp32, but for the 2**-21 of a code unit u = 2**-b h
    # to which lo / N is computed; at the odd ties it is the fp32 value next to the tie on hi's side;
    # for code 0 it is hi itself (so -0.0 stays)
    hi_f = hi[fin].float()
    value = hi64 + lo64.double() * h / n
    odd_tie = ((bits(hi[fin]) & 1) == 1) & (lo64.abs() == n)
    value = torch.where(odd_tie, torch.nextafter(value.float(), hi_f).double(), value)
    slack = h * 2.0 ** -(n.bit_length() + 21)
    assert ((dec.double() - value).abs() <= ulp32(value) / 2 + slack).all()
    assert same_bits(dec[lo64 == 0], hi_f[lo64 == 0])
    assert ((dec.double() - x64).abs() <= h / (2 * n) + ulp32(dec.double()) / 2 + slack).all()


@pytest.mark.parametrize("hi_dtype,lo_dtype", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_reencode_random_fp32(hi_dtype, lo_dtype):
    """encode(decode(encode(x))) == encode(x) bit for bit on random fp32 of every exponent, and on
    values a few fp32 ulps from random ties hi +- h and hi - h/2 (where the round trip broke)."""
    gen = torch.Generator().manual_seed(4)
    x = random_fp32(1_000_000, gen)
    v, finite = all_values(hi_dtype)
    hi = v[finite][torch.randint(0, int(finite.sum()), (200_000,), generator=gen)]
    h = half_ulp(hi)
    ties = hi.double() + torch.tensor([1.0, -1.0, -0.5])[torch.randint(0, 3, hi.shape, generator=gen)] * h
    near = ties.float().view(torch.int32) + torch.randint(-3, 4, hi.shape, generator=gen, dtype=torch.int32)
    near = near.view(torch.float32)
    x = torch.cat([x, near[torch.isfinite(near)]])
    hi, lo = sw.encode(x, hi_dtype, lo_dtype)
    again_hi, again_lo = sw.encode(sw.decode(hi, lo), hi_dtype, lo_dtype)
    assert same_bits(again_hi, hi)
    assert torch.equal(again_lo, lo)


# ============================================================================ split weights: the step's plain pair

STEP_CASES = [(torch.bfloat16, torch.int8), (torch.float16, torch.int8)]


def step_round(hi, lo):
    """One optimizer step that changes nothing: ``store_from_step(decode_for_step(hi, lo))``."""
    new_hi, new_lo = hi.clone(), lo.clone()
    sw.store_from_step(new_hi, new_lo, sw.decode_for_step(hi, lo))
    return new_hi, new_lo


@pytest.mark.parametrize("hi_dtype,lo_dtype", STEP_CASES, ids=["bf16-int8", "fp16-int8"])
def test_step_pair_every_hi_every_code(hi_dtype, lo_dtype):
    """The plain decode/encode of optimizer steps, for every finite hi and every code, against the fp64
    value ``hi + c h / N``: decode is within 2**-6 of a code step of it (codes +-N: plus their guard,
    ``2**(m - 20)`` of h); every pair the exact encoder writes (``prepare``, checkpoints) and every pair
    a step writes is a fixed point of a step that changes nothing, bit for bit (so untouched groups stay
    untouched and zero updates do not drift); the only pairs it changes are codes the exact encoder
    never writes, below binade edges, and their value stays the same."""
    n = CODE_MAX[lo_dtype]
    guard = 2.0 ** (FORMAT[hi_dtype][0] - 20)
    hi = finite_values(hi_dtype)
    codes = torch.arange(-n, n + 1).to(lo_dtype)
    for rows in torch.arange(hi.numel()).split(8192):
        h_rows = hi[rows][:, None].expand(-1, codes.numel()).reshape(-1)
        c_rows = codes.repeat(rows.numel())
        h = half_ulp(h_rows)
        step = h / n
        value = h_rows.double() + c_rows.double() * h / n
        allowed = step * 2.0**-6 + torch.where(c_rows.abs() == n, guard * h, 0.0)
        assert ((sw.decode_for_step(h_rows, c_rows).double() - value).abs() <= allowed).all()
        once = step_round(h_rows, c_rows)
        twice = step_round(*once)
        assert same_bits(twice[0], once[0]) and torch.equal(twice[1], once[1])
        changed = (bits(once[0]) != bits(h_rows)) | (once[1] != c_rows)
        exact_hi, exact_lo = sw.encode(sw.decode(h_rows, c_rows), hi_dtype, lo_dtype)
        written_by_encode = (bits(exact_hi) == bits(h_rows)) & (exact_lo == c_rows)
        assert not (changed & written_by_encode).any()
        mantissa = bits(h_rows) & ((1 << FORMAT[hi_dtype][0]) - 1)
        assert not (changed & (mantissa != 0)).any()
        assert torch.equal(once[0].double() + once[1].double() * half_ulp(once[0]) / n, value)


# ============================================================================ master export / import


def tie_rich_masters(shape, gen):
    """fp32 masters for bf16 split weights: exact ties hi +- h, values one fp32 ulp inside them,
    binade-edge ties 2**e - h/2, +-0 and plain random values, mixed."""
    hi = (torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 3, shape, generator=gen)).to(torch.bfloat16)
    h = half_ulp(hi)
    tie = hi.double() + torch.where(torch.rand(shape, generator=gen) < 0.5, h, -h)
    inside = next32(tie, hi.double())
    edge = torch.exp2(torch.randint(-20, 20, shape, generator=gen).double())
    edge = edge - half_ulp(edge.to(torch.bfloat16)) / 2
    plain = torch.randn(shape, generator=gen, dtype=torch.float64)
    zero = torch.where(torch.rand(shape, generator=gen) < 0.5, 0.0, -0.0).double()
    pick = torch.randint(0, 5, shape, generator=gen)
    x = torch.stack([tie, inside, edge, plain, zero])
    return x.gather(0, pick[None]).squeeze(0).float()


@pytest.mark.parametrize("master_weight_bits", [24, 32])
def test_master_export_import_changes_no_bit(master_weight_bits):
    """load_master_state_dict(master_state_dict()) on a prepared model changes no parameter and no
    error term, after loading masters full of ties."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt, compile_options=EAGER, master_weight_bits=master_weight_bits)
    gen = torch.Generator().manual_seed(7)
    masters = {name: tie_rich_masters(p.shape, gen) for name, p in model.named_parameters()}
    flash_inductor.load_master_state_dict(model, opt, masters)
    before = stored_bits(model, opt)
    assert any(k.endswith(".error") for k in before)
    flash_inductor.load_master_state_dict(model, opt, flash_inductor.master_state_dict(model, opt))
    after = stored_bits(model, opt)
    changed = [k for k in before if not same_bits(before[k], after[k])]
    assert not changed, f"changed: {changed}"


# ============================================================================ companded states


def groups_with_every_code(kind):
    """Codes [9, 32]: every code of ``kind`` once, each group led by the top code (for signed states
    alternately +127 and -127) so that every group's absmax decodes to its scale."""
    if kind == cp.SIGNED:
        every, tops = torch.arange(-127, 128), torch.tensor([127, -127] * 5)[:9]
    else:
        every, tops = torch.arange(0, 256), torch.full((9,), 255)
    body = torch.cat([every, tops[:1].repeat(9 * 31 - every.numel())]).view(9, 31)  # pad: top codes
    return torch.cat([tops[:, None], body], 1)


def bf16_range(lo_bits, hi_bits):
    """The bf16 values of the bit patterns ``lo_bits`` .. ``hi_bits``, both included."""
    return torch.arange(lo_bits, hi_bits + 1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def scale_bits(kind):
    """Bit patterns of the smallest and largest bf16 scale encode stores for finite values of
    ``kind`` (from the spec: ``bf16(max(absmax, 1e-12))`` by ``ref_group_scale``, absmax in fp32 and clamped to
    the largest scale whose top code decodes finite): ``FLOOR_SCALE``, and the largest scale:
    bf16's largest finite value (signed), or the largest bf16 whose fp32 square is finite (second
    moments decode ``(code / 255 * scale) ** 2``). Checked against encode."""
    f32max = torch.tensor(torch.finfo(torch.float32).max)
    floor = FLOOR_SCALE
    lo = int(bits(floor))
    if kind == cp.SIGNED:
        hi = int(bits(torch.tensor(torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)))
    else:
        hi = int(bits(f32max.sqrt().to(torch.bfloat16)))
        while not torch.isfinite(bf16_range(hi, hi).float() ** 2).all():
            hi -= 1
    for value, want in [(0.0, lo), (f32max, hi)]:
        assert bits(cp.encode(torch.full((32,), value), kind)[1]).tolist() == [want]
    return lo, hi


def assert_every_code_round_trips(kind, scales):
    """The checks of ``test_companded_every_code_every_bf16_scale_round_trips`` for bf16 ``scales``
    (the smallest one, if it is the floor, also gets an all-zero group)."""
    codes = groups_with_every_code(kind).repeat(scales.numel(), 1)
    group_scales = scales.repeat_interleave(9)
    floor = FLOOR_SCALE
    if same_bits(scales[:1], floor.view(1)):
        codes = torch.cat([torch.zeros_like(codes[:1]), codes])
        group_scales = torch.cat([floor.view(1), group_scales])
    codes = codes.to(cp.CODE_DTYPES[kind]).view(-1)
    x = cp.decode(codes, group_scales, codes.shape, kind)
    assert torch.isfinite(x).all()
    again_codes, again_scales = cp.encode(x, kind)
    assert same_bits(again_scales, group_scales)
    assert torch.equal(again_codes, codes)
    ref = ref_decode_state(codes, group_scales, codes.shape, kind)
    assert ((x.double() - ref).abs() <= 6 * 2.0**-24 * ref.abs()).all()


@pytest.mark.parametrize("kind", [cp.SIGNED, cp.SQRT])
def test_companded_scale_of_every_fp32_absmax_between_chosen_bf16_values(kind):
    """Every fp32 group absmax from a bf16 value to the next (all 2**16 low bit patterns above
    mantissas 1, 1.5 and 2 - 2**-7, and above the floor's scale): the scale is
    ``ref_group_scale``'s (to nearest, or toward zero where nearest is more than 2**-9 above), the
    group's largest value takes the top code, and the codes are the fp64 reference's."""
    floor_bits = int(bits(FLOOR_SCALE))
    highs = torch.tensor([0x3F80, 0x3FC0, 0x3FFF, floor_bits], dtype=torch.int32)
    absmax = ((highs[:, None] << 16) | torch.arange(1 << 16, dtype=torch.int32)).view(torch.float32).view(-1, 1)
    values = torch.cat([absmax, -absmax / 3, absmax * 0.7, torch.zeros(absmax.shape[0], 29)], 1)
    x = values.square() if kind == cp.SQRT else values
    codes, scales = cp.encode(x, kind)
    ref_codes, ref_scale = ref_companded_encode(x, kind)
    assert torch.equal(scales.double(), ref_scale)
    top = 127 if kind == cp.SIGNED else 255
    assert (codes.view(-1, 32)[:, 0] == top).all()
    assert (codes.view(-1, 32).long() - ref_codes).abs().max() <= 1
    # rounded to nearest in most of each binade's spacing, toward zero in the rest
    coded_max = cp._coded_values(x, kind).amax(dim=1)
    up = scales.float() > coded_max
    assert 0.2 < up.float().mean() < 0.5


@pytest.mark.parametrize("kind", [cp.SIGNED, cp.SQRT])
def test_companded_every_code_every_bf16_scale_round_trips(kind):
    """For every bf16 scale encode stores for finite values and every code: decode is finite, and
    decode then encode gives back the same scale and codes, bit for bit; decode is within fp32
    rounding of the fp64 reference. An all-zero group
    comes back at the floor scale bf16(1e-12), where encode puts it (scale 0 is never stored)."""
    lo, hi = scale_bits(kind)
    assert_every_code_round_trips(kind, bf16_range(lo, hi))


@pytest.mark.parametrize("kind", [cp.SIGNED, cp.SQRT])
def test_companded_groups_without_their_top_code_round_trip_with_their_saved_scales(kind):
    """Every code below the top one, in groups that lack it, for every bf16 scale encode stores for
    finite values:
    decoded and encoded with the saved scales (as a decoded ``state_dict`` is loaded), the codes and
    scales come back bit for bit. Encoded afresh, every group moves to a smaller scale (its decoded
    absmax is at most 126/128 or 254/255 of the scale, more than half a bf16 spacing below it) but
    those at the floor scale, where the smaller absmax is clamped back to the floor."""
    scales = bf16_range(*scale_bits(kind))
    top = 127 if kind == cp.SIGNED else 255
    every = torch.arange(-top + 1, top) if kind == cp.SIGNED else torch.arange(0, top)
    body = torch.cat([every, every[-1:].repeat(9 * 32 - every.numel())]).view(9, 32)
    codes = body.repeat(scales.numel(), 1).to(cp.CODE_DTYPES[kind]).view(-1)
    group_scales = scales.repeat_interleave(9)
    x = cp.decode(codes, group_scales, codes.shape, kind)
    again_codes, again_scales = cp.encode_with_saved_scales(x, kind, group_scales)
    assert same_bits(again_scales, group_scales)
    assert torch.equal(again_codes, codes)
    _, fresh_scales = cp.encode(x, kind)
    moved = fresh_scales < group_scales  # the case the saved scales are for
    assert torch.equal(moved, group_scales > scales[0])
    assert same_bits(fresh_scales[~moved], group_scales[~moved])
