"""Companded 8-bit optimizer states with one bf16 scale per group of 32 elements.

DESIGN.md §2.2, with bf16 scales where it says fp16 (below). The tensor is flattened and cut into
groups of ``GROUP_SIZE`` (a partial last group is padded with zeros); each group stores
``scale = bf16(max(absmax, 1e-12))``, rounded to nearest, or toward zero where nearest would be more
than ``SCALE_ROUND_UP_MAX`` (2**-9) above it.

Signed states (momentum, Adam's first moment) use a softsign compander, which spends more codes
near zero where most values are:

    u = x / scale;  y = 2u / (1 + |u|);  q = floor(127 y + 0.5)            (int8)
    decode: y = q / 127;  u = y / (2 - |y|);  x = u * scale

Second moments store ``s = sqrt(v)`` linearly, which halves the dynamic range to cover:

    u = s / scale(s);  q = floor(255 u + 0.5), and q = 1 where that is 0 but u > 0    (uint8)
    decode: v = (q / 255 * scale) ** 2

The floor at code 1 is ours (issue 15; FlashOptim and DESIGN §2.2 round to 0): an element whose
sqrt(v) is below 1/510 of its group's largest would decode to v = 0 while its first moment does
not, and the next Adam step would divide m by sqrt((1 - beta2) g**2), this step's gradient alone
(updates up to 1e6 times fp64 Adam's in benchmarks/second_moment_hazard.py). With the floor the
stored sqrt(v) is at least 2/3 of the true one: such elements are damped (as if their eps were
scale/255), never blown up. docs/numerics.md has the measurements.

**bf16 scales, not DESIGN's and FlashOptim's fp16** (ours, issue 14): Adam's update is
scale-invariant, so a weight whose gradients are tiny (the lm_head rows of tokens a batch never
has, whose gradients shrink with their probabilities) still moves a full step in fp32 Adam. With
fp16 scales such a group's scale loses its bits below 2**-14 and rounds to 0 below 2**-25: its
moments decode to 0 and the weights stop. bf16 scales take the same two bytes with fp32's exponent
range. They are rounded to nearest, except where that would put the scale more than 2**-9 above the
group's largest value: there they are rounded toward zero. So that value always takes the top code
(255 / (1 + 2**-9) > 254.5, and softsign's 127 * 2u / (1 + u) > 126.5 there), and decoded values
encode back to the same codes and scale, also where arithmetic put the top value a few ulps off.
Rounding toward zero everywhere (this package's first bf16 scales) biased the second moments low: a
step's change of sqrt(v) is far below a bf16 spacing (2**-8..2**-7 of it), so the largest value of a
group never grew by a small step and fell a whole spacing at every small decrease
(benchmarks/results/state_fidelity_llama_small_towardzero_cpu.log: Adam's update 0.77% too large on
average where nearest scales make it 0.24%; 3.5% and 1.5% on the lm_head). On the Llama of
docs/benchmarks.md the 300-step loss ended +2.10% above the baseline's with fp16 scales, +0.82%
with bf16 ones rounded toward zero and +0.39% with this rounding (means over seven or eight seeds;
fp32 states: -0.14%).

Encoding divides by the *stored* scale, so the codes are relative to exactly what decode
multiplies by. FlashOptim instead divides by the fp32 absmax and only rounds the scale when
storing it. All arithmetic is
fp32; tests/test_formats.py checks codes against an fp64 reference (equal, or one code step apart at
a rounding boundary) and decode bit for bit against an fp32 op-by-op reference. Decode multiplies by
``fp32(1/127)`` / ``fp32(1/255)`` instead of dividing, so it gives the same bits on every device.

Compiling: the scale is rounded with integer operations on its bits, so its cast to bf16 is exact
(no ``emulate_precision_casts`` needed for it). Compiled
codes may differ from eager ones by one at a rounding boundary (Triton's divisions and square roots
are approximate): the bar is the fp64 reference, within one code.

Edge cases:
- A partial last group is padded with zeros (codes 0).
- absmax is clamped to >= 1e-12 in fp32 (DESIGN), a normal bf16: an all-zero group stores scale
  bf16(1e-12) and codes 0, and decodes to zeros. No finite group underflows.
- Finite absmax beyond the largest scale stores that scale and the codes saturate at +-127 / 255:
  bf16's largest finite value for signed states (fp32's largest would round above it), and for
  second moments the largest bf16 whose square is finite (about 1.84e19; the next one, 2**64,
  would decode its top code to inf), so v beyond about 3.38e38 decodes to that.
- A group holding inf or nan stores a nan scale and codes 0, so the whole group decodes to nan
  (loud, like fp32 state would be; never garbage codes from a nan-to-int cast).
"""

import torch

GROUP_SIZE = 32
SCALE_FLOOR = 1e-12
SCALE_DTYPE = torch.bfloat16

SIGNED = "signed"  # int8 softsign codes
SQRT = "sqrt"  # uint8 linear codes of sqrt(v)
CODE_DTYPES = {SIGNED: torch.int8, SQRT: torch.uint8}
# A scale rounds up by at most this much (relative) to the nearest bf16, else toward zero (``_rounded``).
SCALE_ROUND_UP_MAX = 2.0**-9
# The largest scale of each kind (module docstring): every decoded value stays finite.
SCALE_MAX = {SIGNED: torch.finfo(SCALE_DTYPE).max,
             SQRT: torch.tensor([0x5F7F], dtype=torch.int16).view(SCALE_DTYPE).item()}


def num_groups(numel):
    return -(-numel // GROUP_SIZE)


def as_groups(x):
    """fp32 view of ``x`` as [groups, GROUP_SIZE], zero-padded."""
    flat = x.float().reshape(-1)
    pad = (-flat.numel()) % GROUP_SIZE
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, GROUP_SIZE)


def _scales(groups, kind):
    """bf16 group scales of ``kind``'s coded values and their fp32 value (nan for inf/nan groups)."""
    absmax = groups.abs().amax(dim=1, keepdim=True)  # nan if the group holds a nan
    finite = torch.isfinite(absmax)
    # rounded from a finite value only: a nan's bits could overflow the integer rounding
    scale = _rounded(torch.where(finite, absmax, 1.0).clamp(min=SCALE_FLOOR, max=SCALE_MAX[kind]))
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    scale = scale.to(SCALE_DTYPE)  # exact
    return scale.view(-1), scale.float()


def _rounded(scale):
    """fp32 ``scale`` (positive, at most ``SCALE_MAX``) as a bf16 value in fp32: to nearest, ties to
    even, unless that is more than ``SCALE_ROUND_UP_MAX`` above it, then toward zero (module docstring).
    Integer operations on the bits, so eager, compiled and Triton code agree bit for bit."""
    bits = scale.view(torch.int32)
    nearest = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).view(torch.float32)
    toward_zero = (bits & -65536).view(torch.float32)
    return torch.where(nearest <= scale * (1 + SCALE_ROUND_UP_MAX), nearest, toward_zero)


def zero_scales(groups, device=None):
    """The scales ``encode`` gives all-zero groups: the floor, rounded."""
    return _rounded(torch.full((groups,), SCALE_FLOOR, device=device)).to(SCALE_DTYPE)


def _over_scale(x, scale):
    """``x / scale`` as ``x`` times one reciprocal per group (faster than a division per element,
    within an fp32 ulp of it), and 0 where the scale is 0 (underflow) or nan (non-finite group)."""
    return torch.where(scale > 0, x * (1 / scale), torch.zeros_like(x))  # not x * 0: x may be inf


def encode(x, kind):
    """Encode fp32-valued ``x`` as ``(codes, scales)``: flat codes of length groups*32, bf16 scales.

    ``kind`` is ``SIGNED`` (x any sign) or ``SQRT`` (x is a second moment, >= 0).
    """
    values = _coded_values(x, kind)
    scale16, scale = _scales(values, kind)
    return _codes(values, scale, kind).view(-1), scale16


def encode_with_saved_scales(x, kind, saved_scales):
    """``encode(x, kind)``, except in each group whose values are exactly the decode of codes
    against its saved scale (``saved_scales``, one per group, as ``state_dict`` saved them
    with the decoded values): that group gets those codes and that scale back.

    Decoded values alone do not always give back their codes: a group without its top code (its
    largest value decodes below the scale, as happens where bf16 rounded the scale up) encodes
    afresh against its smaller decoded absmax, another scale, and
    every code of the group moves. A group the saved scale does not reproduce (other values, a
    stale or non-finite scale, or the fp16 scales of a checkpoint from before the scales were
    bf16) is encoded afresh.
    """
    codes, scales = encode(x, kind)
    saved = saved_scales.to(device=scales.device, dtype=SCALE_DTYPE).view(-1)
    saved_codes = _codes(_coded_values(x, kind), saved.float().view(-1, 1), kind)
    decoded = decode(saved_codes, saved, saved_codes.shape, kind)
    exact = (decoded == as_groups(x)).all(dim=1) & torch.isfinite(saved) & (saved >= 0)
    codes = torch.where(exact.view(-1, 1), saved_codes, codes.view(-1, GROUP_SIZE))
    return codes.view(-1), torch.where(exact, saved, scales)


def _coded_values(x, kind):
    """The fp32 groups the codes store: ``x`` itself (signed) or ``sqrt(x)`` (second moments)."""
    if kind == SIGNED:
        return as_groups(x)
    if kind == SQRT:
        # A second square root rather than the optimizer's own ``v.sqrt()``: sharing that one (a
        # select after it) made the fused H200 step kernel 3.3x slower, likely by keeping it live
        # across the group reduction (benchmarks/results/optimizer_step_sqrt_reuse_h200.log).
        return as_groups(x).clamp(min=0).sqrt()
    raise ValueError(f"unknown companded state kind {kind!r}; expected {SIGNED!r} or {SQRT!r}")


def _codes(values, scale, kind):
    """Codes of fp32 ``values`` [groups, 32] against fp32 ``scale`` [groups, 1]."""
    u = _over_scale(values, scale)
    if kind == SIGNED:
        y = 2 * u / (1 + u.abs())
        return torch.floor(127 * y + 0.5).clamp(-127, 127).to(torch.int8)
    # The floor at code 1 for a positive sqrt(v) (module docstring). u > 0 exactly when s > 0 and
    # the scale is positive (not underflowed to 0, not nan): those groups keep codes 0.
    return torch.where(u > 0, torch.floor(255 * u + 0.5).clamp(1, 255), 0).to(torch.uint8)


def decode(codes, scales, shape, kind):
    """fp32 tensor of ``shape`` from ``(codes, scales)``."""
    scale = scales.float().view(-1, 1)
    q = codes.view(-1, GROUP_SIZE).float()
    # q / 127 and q / 255 as q * fp32(1/127) etc.: CUDA eager divides by a Python scalar that way,
    # so multiplying explicitly gives the same bits on CPU, CUDA and compiled code.
    if kind == SIGNED:
        y = q * (1.0 / 127)
        x = y / (2 - y.abs()) * scale
    elif kind == SQRT:
        x = (q * (1.0 / 255) * scale) ** 2
    else:
        raise ValueError(f"unknown companded state kind {kind!r}; expected {SIGNED!r} or {SQRT!r}")
    numel = 1
    for d in shape:
        numel *= d
    return x.view(-1)[:numel].view(shape)
