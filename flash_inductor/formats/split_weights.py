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
Decode is plain fp32 arithmetic, ``lo * fp32(1/N)`` rather than ``lo / N`` so that every device
gives the same bits (within one fp32 rounding of the exact value either way).

Non-finite masters (inf/nan, and finite x whose ``hi`` overflows to inf) keep the non-finite ``hi``
and store ``lo = 0``. Encode needs ``torch._inductor.config.emulate_precision_casts=True`` when
compiled: without it Inductor keeps ``x.to(bf16)`` in fp32 inside a fused kernel, so ``x - hi``
becomes 0 and every error term silently stays zero.
"""

import torch

# master_weight_bits -> dtype of the error term; None stores no error term.
ERROR_TERM_DTYPES = {24: torch.int8, 32: torch.int16}
_CODE_MAX = {torch.int8: 127, torch.int16: 32767}
# (mantissa bits, exponent bias, integer view) of the dtypes a split weight can have.
_FORMATS = {torch.bfloat16: (7, 127, torch.int16), torch.float16: (10, 15, torch.int16)}


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


def half_ulp_log2(hi):
    """log2 of half an ULP of ``hi`` (bf16 or fp16), as int32: ``e - m - 1``."""
    mantissa_bits, bias, int_view = _FORMATS[hi.dtype]
    biased = (hi.view(int_view).to(torch.int32) & 0x7FFF) >> mantissa_bits
    biased = torch.where(biased == 0, torch.ones_like(biased), biased)
    return biased - (bias + mantissa_bits + 1)


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
    lo = _round_code(rel.clamp(-1.0, 1.0), _CODE_MAX[lo_dtype])
    return hi, lo.to(lo_dtype)


def decode(hi, lo):
    """The fp32 master value of a split weight.

    ``lo / N`` is computed as ``lo * fp32(1 / N)``: CUDA eager evaluates a division by a Python
    scalar that way, while CPU eager and Triton (with ``eager_numerics.division_rounding``) divide;
    multiplying explicitly gives the same bits on every device, eager or compiled.
    """
    return hi.float() + _scale_by_pow2(lo.float() * (1.0 / _CODE_MAX[lo.dtype]), half_ulp_log2(hi))


def store(hi, lo, master):
    """Write fp32 ``master`` into an existing split weight ``(hi, lo)`` in place."""
    new_hi, new_lo = encode(master, hi.dtype, lo.dtype)
    hi.copy_(new_hi)
    lo.copy_(new_lo)
