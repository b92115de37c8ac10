"""FP8 scaling numerics: the one place that defines amax, scales, casts and delayed scaling.

DESIGN.md §2.4 (FP8 linear) and §2.5 (FP8 gradient collectives). Everything is fp32 torch ops
without Python loops over elements or ``.item()``, so the same functions run eagerly and inside the
graphs the FP8 passes rewrite (Inductor fuses them with the neighbouring kernels).

Formats (``max_value``): ``E4M3 = float8_e4m3fn`` (3 mantissa bits, max 448, no inf; forward
operands) and ``E5M2 = float8_e5m2`` (2 mantissa bits, max 57344, has inf; gradients).

Per-tensor ("current") scaling, all in fp32:

    amax  = max |x|                                                 (exact in any float dtype)
    scale = fp8_max / max(amax, 1e-12)                              (one correctly rounded division)
    x8    = fp8(clamp(x * scale, -fp8_max, fp8_max))                (round to nearest even)
    x'    = float(x8) / scale

The fp8 value holds ``x * scale``; ``torch._scaled_mm(a8, b8, scale_a, scale_b, out_dtype=bf16)`` wants
the *dequantization* factors, i.e. ``inverse_scale(scale)`` (fp32, one element), and ``b8`` column-major
(quantize W as [N, K], pass ``w8.t()``). ``dequantize`` divides by the scale, ``_scaled_mm`` multiplies
by the rounded reciprocal; the two agree exactly for power-of-two scales and within one fp32 rounding
otherwise.

Power-of-two scales (MS-AMP, ``power_of_two=True``): the fp32 scale rounded *down* to
``2 ** floor(log2(scale))``. Multiplying by such a scale is exact, so the cast rounds only once, and
dequantization is exact. Rounding down keeps ``amax * scale <= fp8_max`` except when the fp32
division itself rounded up onto a power of two (then the excess is below 2**-24 relative and the
clamp absorbs it). It is computed from amax's exponent and mantissa, without the division
(``_power_of_two_scale``); ``round_down_to_power_of_two`` rounds any fp32 value so, by clearing its
mantissa bits.

How a compiler divides does not change a scale or its inverse: Triton's default fp32 division is
approximate (Inductor's ``eager_numerics.division_rounding`` off), and the per-tensor scale's
division and every inverse are done in fp64 (``scale_from_amax``, ``inverse_scale``).

Row-wise scaling (torchao's "rowwise" recipe): one scale per row of a 2-D GEMM operand, the row
being along the dimension the GEMM sums over, so an outlier spoils the precision of its row only:

    amax  = max_j |x[i, j]|               per row i, an fp32 column (rows, 1)  (``row_amax``)
    scale = fp8_max / max(amax, 1e-12)    elementwise, as above; ``_scaled_mm`` takes the inverses as
                                          scale_a (M, 1) and scale_b (1, N)

Delayed scaling (Transformer Engine's recipe, window ``HISTORY_LENGTH = 16``): the scale used to cast
step t's tensor comes from the amaxes of the previous steps, and step t's amax is recorded afterwards:

    scale_t   = scale_from_history(history, dtype, scale_{t-1}, current_amax=amax(x_t))
              = scale of max(history), or of amax(x_t) while the history is all zero
    x8_t      = cast_to_fp8(x_t, scale_t, dtype)                     (values above the window saturate)
    history'  = update_amax_history(history, amax(x_t))             = [amax_t, history[:-1]]

A fresh history is all zeros (nothing recorded yet): that step uses its own amax, as torchao initialises
its history from the first tensor, rather than an arbitrary initial scale (with 1.0, e5m2 holds a
gradient of 1e-5 as its smallest subnormal, 2**-16, and flushes smaller ones to zero). Without
``current_amax`` it keeps ``previous_scale``.

FP8 collectives (§2.5): all ranks use the scale of the all-reduced MAX of their amaxes. Because fp32
division and the power-of-two rounding are monotone, ``scale_from_amax(max_r amax_r)`` equals
``min_r scale_from_amax(amax_r)`` exactly, so reducing either gives the same bits. ``overflow_count`` / ``overflow_fraction``
measure how much of a tensor (e.g. the reduced sum) a scale would saturate, for the ``mu`` auto-scaling
(``formats/fp8_collective.py``).

Edge cases:
- amax 0 (an all-zero tensor) or not finite (inf or nan anywhere in x): with ``previous_scale`` the
  previous scale is kept (DESIGN §2.4). Without it the formula applies literally: amax 0 gives
  ``fp8_max / 1e-12`` (harmless: the tensor is zero), inf gives scale 0 and nan gives scale nan, both
  loud (the dequantized values are nan), never a silently wrong finite scale.
- The 1e-12 floor bounds the scale by 57344e12 < fp32 max, so a finite amax never gives an infinite
  scale; and ``fp8_max / fp32_max >= 448 / 3.41e38 > 2**-126``, so a finite positive amax never gives a
  subnormal scale either. ``round_down_to_power_of_two`` is exact for subnormals anyway.
- Saturation: the clamp before the cast is required, not cosmetic. ``float8_e5m2`` overflows to inf,
  and ``float8_e4m3fn`` has no inf: the conversion of some torch versions and backends turns values
  from 464 up into nan (torch 2.13's c10 conversion saturates, but a fused kernel need not use it).
  With the clamp, finite values and +-inf beyond the range become +-fp8_max on every backend (the point
  of delayed scaling is to tolerate a few such outliers); nan stays nan.
- Values below the smallest fp8 normal (2**-6 for e4m3, 2**-14 for e5m2) round to fp8 subnormals and
  to zero below half the smallest subnormal, like any cast.
"""

import math

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
AMAX_FLOOR = 1e-12
HISTORY_LENGTH = 16
_MAX = {E4M3: 448.0, E5M2: 57344.0}
_MAX_EXPONENT = {dtype: int(math.log2(m / 1.75)) for dtype, m in _MAX.items()}  # each max is 1.75 * 2**E
_MANTISSA_BITS, _FP32_BIAS = 23, 127
_MANTISSA_OF_1_75 = 3 << 21  # the stored mantissa bits of 1.75 (binary 1.11)
_SMALLEST_NORMAL = 2.0**-126
_SUBNORMAL_LIFT = 64  # 2**64 * (smallest fp32 subnormal, 2**-149) is a normal number


def max_value(dtype):
    """The largest finite value of the fp8 ``dtype``: 448 (e4m3fn) or 57344 (e5m2)."""
    if dtype not in _MAX:
        raise ValueError(f"unsupported fp8 dtype {dtype!r}; expected {E4M3} or {E5M2}")
    return _MAX[dtype]


def amax(x):
    """``max |x|`` as a 0-dim fp32 tensor (exact; nan if x holds a nan; 0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().to(torch.float32)


def row_amax(x):
    """``max |x|`` of each row of the 2-D ``x``, an fp32 column ``(rows, 1)`` (exact; nan in a row with a nan)."""
    return x.abs().amax(dim=1, keepdim=True).to(torch.float32)


def round_down_to_power_of_two(scale):
    """``2 ** floor(log2(scale))`` for positive fp32 ``scale``, exactly: the mantissa bits are cleared.

    Subnormals are first lifted by 2**64 (exact), rounded, and scaled back (exact, the result is a
    power of two >= 2**-149). 0, inf and nan are returned unchanged.
    """
    s = scale.to(torch.float32)
    tiny = s.abs() < _SMALLEST_NORMAL
    lifted = torch.where(tiny, s * 2.0**_SUBNORMAL_LIFT, s)
    rounded = (lifted.view(torch.int32) & -(1 << 23)).view(torch.float32)  # keep sign and exponent
    rounded = torch.where(tiny, rounded * 2.0**-_SUBNORMAL_LIFT, rounded)
    return torch.where(torch.isnan(s), s, rounded)


def scale_from_amax(amax, dtype, previous_scale=None, power_of_two=False):
    """``fp8_max / max(amax, 1e-12)`` in fp32 (elementwise over ``amax``), correctly rounded.

    ``power_of_two``: the scale rounded down to a power of two. ``previous_scale``: returned instead
    where ``amax`` is 0 or not finite (it is not rounded again). Neither form divides in fp32, so the
    bits do not depend on how a compiler divides (Triton's default fp32 division is approximate).
    """
    fp8_max = max_value(dtype)
    amax = amax.to(torch.float32)
    a = amax.clamp(min=AMAX_FLOOR)
    if power_of_two:
        scale = _power_of_two_scale(a, dtype)
    else:
        # Divided in fp64 and rounded once more to fp32: exactly fp32's correctly rounded quotient, as
        # fp64 holds over twice fp32's 24 bits and more (double rounding is innocuous, Figueroa 1995).
        # A tensor numerator: Python's ``float / tensor`` computes ``reciprocal(t) * float`` (two roundings).
        a64 = a.to(torch.float64)
        scale = (torch.full_like(a64, fp8_max) / a64).to(torch.float32)
    if previous_scale is not None:
        valid = (amax > 0) & torch.isfinite(amax)
        scale = torch.where(valid, scale, previous_scale)
    return scale


def _power_of_two_scale(a, dtype):
    """``2 ** floor(log2(fp32(fp8_max / a)))`` for fp32 ``a >= 1e-12``, from ``a``'s exponent and mantissa.

    Both formats' max is 1.75 * 2**E (E = 8 for e4m3, 15 for e5m2). With a = m * 2**e (1 <= m < 2),
    fp8_max / a = (1.75 / m) * 2**(E - e): its power of two is 2**(E - e) while m <= 1.75 and
    2**(E - e - 1) above, where 1.75 / m < 1 - 2**-24 stays under 1 after fp32's rounding (m is at least
    1.75 + 2**-23 there). No division, about six integer operations per element: a cast reads the scale
    of its row or column for every element it casts (Inductor computes it where it is read).
    An infinite ``a`` gives 0 and a nan gives nan, as the division would.
    """
    bits = a.view(torch.int32)
    exponent = (bits >> _MANTISSA_BITS) & 0xFF  # biased; 255 for inf and nan
    above_1_75 = (bits & ((1 << _MANTISSA_BITS) - 1)) > _MANTISSA_OF_1_75
    scale_exponent = 2 * _FP32_BIAS + _MAX_EXPONENT[dtype] - exponent - above_1_75.to(torch.int32)
    scale = (scale_exponent << _MANTISSA_BITS).view(torch.float32)
    return torch.where(torch.isfinite(a), scale, torch.where(torch.isnan(a), a, torch.zeros_like(a)))


def inverse_scale(scale):
    """``1 / scale`` in fp32, correctly rounded (exact for a power of two): the factor ``_scaled_mm``
    multiplies by. A reciprocal in fp64 rounded to fp32, as ``scale_from_amax`` divides, so that a
    compiler's approximate fp32 division does not change it."""
    return torch.reciprocal(scale.to(torch.float64)).to(torch.float32)


def cast_to_fp8(x, scale, dtype):
    """``fp8(clamp(x * scale, -fp8_max, fp8_max))`` with the product in fp32 (saturating; nan stays nan)."""
    m = max_value(dtype)
    return (x.to(torch.float32) * scale).clamp(-m, m).to(dtype)


def dequantize(x_fp8, scale):
    """``float(x_fp8) / scale`` in fp32 (exact for power-of-two scales)."""
    return x_fp8.to(torch.float32) / scale


def new_amax_history(length=HISTORY_LENGTH, device=None):
    """An all-zero amax history of ``length`` (fp32)."""
    return torch.zeros(length, dtype=torch.float32, device=device)


def update_amax_history(history, new_amax):
    """A new history ``[new_amax, history[0], ..., history[L-2]]`` (newest first, shape [L])."""
    return torch.cat([new_amax.reshape(1).to(history.dtype), history[:-1]])


def scale_from_history(history, dtype, previous_scale, power_of_two=False, current_amax=None):
    """The delayed scale: ``scale_from_amax(max(history), ...)``.

    A non-finite amax in the window makes the window max non-finite, so the previous scale is kept
    until that entry leaves the window (L steps), as in Transformer Engine. ``current_amax``: used
    instead of the window max while the history is all zero (nothing recorded yet).
    """
    window = history.amax()
    if current_amax is not None:
        window = torch.where(window == 0, current_amax.to(window.dtype), window)
    return scale_from_amax(window, dtype, previous_scale, power_of_two)


def overflow_count(x, scale, dtype):
    """How many elements have ``|x * scale| > fp8_max`` (int64; fp32 product; inf counts, nan does not)."""
    return torch.count_nonzero((x.to(torch.float32) * scale).abs() > max_value(dtype))


def overflow_fraction(x, scale, dtype):
    """The fraction of elements with ``|x * scale| > fp8_max`` (see ``overflow_count``)."""
    return overflow_count(x, scale, dtype).to(torch.float32) / x.numel()


def sqnr_db(reference, approx):
    """Signal-to-quantization-noise ratio ``20 log10(||ref|| / ||ref - approx||)`` in dB (fp32)."""
    ref = reference.to(torch.float32)
    noise = ref - approx.to(torch.float32)
    return 20 * torch.log10(torch.linalg.vector_norm(ref) / torch.linalg.vector_norm(noise))
