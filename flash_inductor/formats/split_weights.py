"""Split weights: an fp32 master value stored as a bf16/fp16 value plus a small integer error term.

DESIGN.md §2.1 (FlashOptim's ULP-scaled error correction). With ``hi = x.to(bf16)`` the model
reads ``hi``; the error ``x - hi`` is at most half an ULP of ``hi``, so it is stored relative to
that half ULP, as a signed integer code ``lo`` in [-N, N]:

    encode:  lo = round_half_away(clamp((x - hi) / half_ulp(hi), -1, 1) * N)
    decode:  x' = hi + lo / N * half_ulp(hi)

``half_ulp(hi) = 2 ** (e - m - 1)`` with ``e`` the unbiased exponent of ``hi`` (``1 - bias`` for
zero and subnormals) and ``m`` its mantissa bits. int8 codes give 24-bit masters, int16 32-bit.

Exactness (tests/test_formats.py checks ``hi`` and ``lo`` bit for bit against an fp64 reference):
``x - hi`` and the power-of-two scaling are exact in fp32, but the product ``rel * N`` is not (up to
24 + 15 significant bits), and ``floor(s + 0.5)`` misrounds just below a .5 boundary. So the code is
rounded exactly, in fp32 only (no fp64, so it fuses into any Inductor kernel); see ``_round_code``.

Round trip: ``encode(decode(encode(x))) == encode(x)`` for every fp32 ``x``, so loading the masters
that ``master_state_dict`` gives changes no bit (tests/test_exhaustive_formats.py; docs/numerics.md
has the counts). The plain formulas break it in four ways, fixed as follows; each fix keeps the
decoded master within half a code step, ``h / (2N)``, of every ``x`` that encodes to the code:

1. Decode of ``lo = +-N`` is the tie ``hi +- h``. Next to an odd mantissa round-to-nearest-even takes
   it to the neighbour (past the largest value: to inf), which re-encodes with the opposite code.
   There decode steps one fp32 ulp back toward ``hi``: the largest-magnitude fp32 value on ``hi``'s
   side of the tie. The encoder emits ``+-N`` next to an odd ``hi`` only when that value itself
   encodes to ``+-N``, so it round-trips.
2. The one change to DESIGN's encode: at a binade edge (``hi = +-2**e``, mantissa 0, biased exponent
   >= 2) the neighbour toward zero is only ``h`` away, so the values on that side that round to
   ``hi`` span ``rel`` in [-0.5, 0]. Their end, the tie ``rel = -0.5`` (it rounds to the even ``hi``),
   would get ``round_half_away(-N/2) = -(N+1)/2``, which decodes past the tie to the neighbour. On
   that side the code magnitude is capped at ``(N-1)/2`` (63 / 16383): half a code step from the tie.
3. Decode rounds once. ``hi + fp32(lo * fp32(1/N)) * h`` rounds twice; with int16 codes on bf16 a
   code step is about one fp32 ulp, and codes near ``+-N/2`` decoded to the fp32 value of the next
   code. ``decode`` sums exactly up to 2**-21 of a code step, then rounds once (its docstring).
4. ``-0.0`` decodes to ``-0.0``: decode subtracts the negated term (``-0.0 + 0.0`` is ``+0.0``).

Optimizer steps use ``decode_for_step`` / ``store_from_step`` instead: the plain formulas with two
cheap guards, about a third of the arithmetic (the exact pair made the fused H200 step
compute-bound). With int8 codes they keep the numerics policy: decode is within 2**-6 of a code step
of ``hi + lo / N * h`` (codes +-N: 2**-6 plus their guard, 0.016 of a code step for bf16, 0.12 for
fp16), encode within half a code step plus an fp32 rounding. And every pair either encoder writes is
a fixed point of the step's decode and encode, so the groups a step must leave untouched
(``passes/untouched_parameters``) keep every bit, and a zero update does not drift
(tests/test_exhaustive_formats.py checks every (bf16/fp16, code) pair). The guards:
- decode pulls codes +-N back by ``2**(m - 20)`` of ``h``: at least 1.5 fp32 ulps, so the tie ``hi +- h``,
  which would round to an odd ``hi``'s neighbour, is never produced;
- encode rounds ``rel * N * (1 - 2**-20) + 1/2`` down, so exact ties of the code round toward zero: the tie
  ``rel = -1/2`` below a binade edge gets ``-(N-1)/2``, never the code that would decode past it;
- decode subtracts the negated term, so ``-0.0`` stays ``-0.0``.
int16 codes are about one fp32 ulp apart, below the plain decode's double rounding, so their steps
keep the exact pair.

Non-finite masters (inf/nan, and finite x whose ``hi`` overflows to inf) keep the non-finite ``hi``
and store ``lo = 0``. Encode needs ``torch._inductor.config.emulate_precision_casts=True`` when
compiled: without it Inductor keeps ``x.to(bf16)`` in fp32 inside a fused kernel, so ``x - hi``
becomes 0 and every error term silently stays zero. torch < 2.13's C++ backend does so even with it
unless compiled under ``_compat.cpp_keeps_precision_casts`` (as the backend compiles).
"""

import torch

# master_weight_bits -> dtype of the error term; None stores no error term.
ERROR_TERM_DTYPES = {24: torch.int8, 32: torch.int16}
_CODE_MAX = {torch.int8: 127, torch.int16: 32767}
# (mantissa bits, exponent bias, integer view) of the dtypes a split weight can have.
_FORMATS = {torch.bfloat16: (7, 127, torch.int16), torch.float16: (10, 15, torch.int16)}


SPLIT_DTYPES = tuple(_FORMATS)


def mantissa_bits_and_bias(hi_dtype):
    """The mantissa bits and exponent bias of a split weight's ``hi`` dtype (bf16 or fp16)."""
    return _FORMATS[hi_dtype][:2]


def error_term_dtype(master_weight_bits):
    """The integer dtype that holds the error term for ``master_weight_bits`` (24 or 32; None: None)."""
    if master_weight_bits is None:
        return None
    if master_weight_bits not in ERROR_TERM_DTYPES:
        raise ValueError(
            f"master_weight_bits must be one of {sorted(ERROR_TERM_DTYPES)} or None, "
            f"got {master_weight_bits!r}"
        )
    return ERROR_TERM_DTYPES[master_weight_bits]


def code_max(lo_dtype):
    """N: the largest error-term code (127 for int8, 32767 for int16)."""
    return _CODE_MAX[lo_dtype]


def _pow2(k):
    """Exact ``2.0 ** k`` for int32 ``k`` in [-126, 127], built from the fp32 exponent bits."""
    return ((k + 127) << 23).view(torch.float32)


def _scale_by_pow2(x, k):
    """``x * 2**k`` in two halves, so neither factor over- or underflows fp32 (|k| <= 252)."""
    half = k >> 1  # floor(k / 2): an arithmetic shift, one instruction where a floor division is several
    return x * _pow2(half) * _pow2(k - half)


def _magnitude_bits(hi):
    """The bit pattern of ``|hi|`` (bf16 or fp16) as int32: biased exponent, then mantissa."""
    return hi.view(_FORMATS[hi.dtype][2]).to(torch.int32) & 0x7FFF


def half_ulp_log2(hi):
    """log2 of half an ULP of ``hi`` (bf16 or fp16), as int32: ``e - m - 1``."""
    mantissa_bits, bias, _ = _FORMATS[hi.dtype]
    biased = _magnitude_bits(hi) >> mantissa_bits
    biased = torch.where(biased == 0, torch.ones_like(biased), biased)
    return biased - (bias + mantissa_bits + 1)


def _below_binade_edge(x, hi):
    """Where ``hi = +-2**e`` (mantissa 0, biased exponent >= 2) and ``|x| < |hi|``: the side where the
    next value toward zero is only half an ULP of ``hi`` away (for biased exponent 1 it is a
    subnormal a whole ULP away)."""
    mantissa_bits = _FORMATS[hi.dtype][0]
    mag = _magnitude_bits(hi)
    edge = ((mag & ((1 << mantissa_bits) - 1)) == 0) & (mag >= (2 << mantissa_bits))
    return edge & (x.abs() < hi.float().abs())


def _round_code(rel, n):
    """``round_half_away(rel * n)`` for fp32 ``|rel| <= 1``, exactly, with fp32 ops only.

    ``n = 2**b - 1`` (127 or 32767), so ``a * n = a * 2**b - a`` (``a = |rel|``). ``a * 2**b`` is exact;
    split it into ``whole + frac``; then ``a * n = whole + (frac - a)`` with ``-1 <= frac - a < 1``,
    and rounding adds 1 when ``frac - a >= 0.5`` and subtracts 1 when ``frac - a < -0.5``. Both tests
    are evaluated as ``frac - 0.5 >= a`` and ``frac + 0.5 < a``, whose left sides are exact whenever
    the comparison can go either way (Sterbenz; ``frac`` has no bits below 2**-23 when ``a >= 2**-b``).
    """
    a = rel.abs()
    big = a * float(n + 1)
    whole = torch.floor(big)
    frac = big - whole
    mag = torch.where(frac - 0.5 >= a, whole + 1.0, torch.where(frac + 0.5 < a, whole - 1.0, whole))
    return torch.sign(rel) * mag


def encode(x, hi_dtype, lo_dtype):
    """Split fp32 ``x`` into ``(hi, lo)``: ``hi = x.to(hi_dtype)`` and the integer error term."""
    x = x.float()
    hi = x.to(hi_dtype)
    rel = _scale_by_pow2(x - hi.float(), -half_ulp_log2(hi))
    # Non-finite masters (inf/nan, or hi overflowed to inf) have no meaningful error term; hi
    # carries the value.
    rel = torch.where(torch.isfinite(rel), rel, torch.zeros_like(rel))
    n = _CODE_MAX[lo_dtype]
    lo = _round_code(rel.clamp(-1.0, 1.0), n)
    # Below a binade edge rel >= -0.5, whose code -(n+1)/2 would decode past the tie (module doc).
    half = float(n // 2)
    lo = torch.where(_below_binade_edge(x, hi), lo.clamp(-half, half), lo)
    return hi, lo.to(lo_dtype)


def _coarse_shift(hi_dtype, lo_dtype):
    """How many low bits of the code decode adds separately: ``hi`` has ``m + 1`` significant bits (plus
    one for a carry) and a code of ``b`` bits reaches ``2**-b`` below ``h``, so the exact fp32 sum
    ``hi + code * 2**-b * h`` (24 bits) takes ``22 - m`` of them: all for bf16, 12 of 15 for fp16 + int16."""
    b = _CODE_MAX[lo_dtype].bit_length()
    return max(0, b - (22 - _FORMATS[hi_dtype][0]))


def decode(hi, lo):
    """The fp32 master value of a split weight: ``hi + lo / N * h`` rounded once to fp32, except that a
    tie rounding away from ``hi`` steps back to ``hi``'s side (module docstring).

    With ``N = 2**b - 1``, ``lo / N * h = (lo + lo / N) * u`` in code units ``u = 2**-b * h``. The sum
    is taken in code units and scaled back exactly: ``hi / u - lo`` is an exact integer (for fp16 +
    int16 only the code's high bits go there, see ``_coarse_shift``), ``lo / N`` is computed to
    2**-21, and one rounding follows. That error cannot move the result across the boundary of a
    code's interval: fp32 spacings are powers of two times ``u``, half a code step is
    ``(1 + 1/N) * u / 2``, at least 2**-16 u from half of any of them. So decode gives a value that
    encodes to the code whenever some fp32 value does (tests/test_exhaustive_formats.py).

    ``lo / N`` is taken as ``lo * fp32(1 / N)``: CUDA eager evaluates a division by a Python scalar
    that way, CPU eager and Triton divide; multiplying explicitly gives the same bits on every
    device, eager or compiled.
    """
    n = _CODE_MAX[lo.dtype]
    mantissa_bits, bias, _ = _FORMATS[hi.dtype]
    unit_log2 = half_ulp_log2(hi) - n.bit_length()
    # Negated: hi - 0.0 keeps hi = -0.0 (hi + 0.0 would give +0.0, another hi). Integer, so 0 stays +0.0.
    m = -lo.to(torch.int32)
    shift = _coarse_shift(hi.dtype, lo.dtype)
    coarse = (m >> shift) << shift if shift else m
    fine = m.float() * (1.0 / n)
    if shift:
        fine = fine + (m - coarse).float()
    scale_log2, unit = unit_log2, 1.0
    if bias > 126:
        # bf16 below 2**-125 (biased exponent <= 1) decodes to fp32 subnormals, whose spacing is
        # absolute: there the sum is taken unscaled, on that grid (every term but the once-rounded
        # fine * u lies on it), with their code unit u = 2**-149 (int16) or 2**-141 (int8).
        tiny = (_magnitude_bits(hi) >> mantissa_bits) <= 1
        scale_log2 = torch.where(tiny, 0, unit_log2)
        unit = torch.where(tiny, 2.0 ** (1 - bias - mantissa_bits - 1 - n.bit_length()), 1.0)
    y = (_scale_by_pow2(hi.float(), -scale_log2) - coarse.float() * unit) - fine * unit
    x = _scale_by_pow2(y, scale_log2)
    # lo = +-n gives the tie hi +- h (exactly), which rounds away from an odd-mantissa hi: step one
    # fp32 ulp back toward hi. The int32 view of |x| grows with |x| for either sign.
    tie_away = (lo.abs() == n) & ((_magnitude_bits(hi) & 1) == 1)
    step = torch.where(x.abs() > hi.float().abs(), -1, 1).to(torch.int32)
    return torch.where(tie_away, (x.view(torch.int32) + step).view(torch.float32), x)


def store(hi, lo, master):
    """Write fp32 ``master`` into an existing split weight ``(hi, lo)`` in place."""
    new_hi, new_lo = encode(master, hi.dtype, lo.dtype)
    hi.copy_(new_hi)
    lo.copy_(new_lo)


def decode_for_step(hi, lo):
    """The master an optimizer step updates: ``hi + lo / N * h`` plainly, for int8 codes (module doc)."""
    if lo.dtype != torch.int8:
        return decode(hi, lo)
    n, guard = _CODE_MAX[lo.dtype], step_guard(hi.dtype)
    fine = ((-lo).float() * (1.0 / n)).clamp(-1.0 + guard, 1.0 - guard)  # negated: -0.0 stays -0.0
    return hi.float() - _scale_by_pow2(fine, half_ulp_log2(hi))


def store_from_step(hi, lo, master):
    """Write an optimizer step's fp32 ``master`` into ``(hi, lo)``: the plain encode for int8 codes."""
    if lo.dtype != torch.int8:
        return store(hi, lo, master)
    new_hi = master.to(hi.dtype)
    rel = _scale_by_pow2(master - new_hi.float(), -half_ulp_log2(new_hi))
    rel = torch.where(torch.isfinite(rel), rel, torch.zeros_like(rel))  # non-finite masters: lo = 0
    hi.copy_(new_hi)
    lo.copy_(torch.floor(rel.clamp(-1.0, 1.0) * STEP_CODE_SCALE + 0.5).to(lo.dtype))


def step_guard(hi_dtype):
    """How far (in units of ``h``) ``decode_for_step`` pulls codes +-N in from the tie ``hi +- h``."""
    return 2.0 ** (_FORMATS[hi_dtype][0] - 20)


# N * (1 - 2**-20) for int8 codes: exact ties of ``rel * N`` round toward zero (module doc).
STEP_CODE_SCALE = 127 * (1 - 2.0**-20)
