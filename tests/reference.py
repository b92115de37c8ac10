"""fp64 references written from DESIGN.md §2.1-2.2, §2.6 and the optimizers' documented algorithms.

No helper of ``flash_inductor`` is used here: the package is only ever on the left-hand side of a
comparison with these.
"""

import math

import torch

# ============================================================================ fp64 format references

INF = float("inf")
# (mantissa bits, exponent of the smallest normal, largest finite value)
BF16 = (7, -126, (2 - 2.0**-7) * 2.0**127)
FP16 = (10, -14, 65504.0)
FP32 = (23, -126, (2 - 2.0**-23) * 2.0**127)
E4M3 = (3, -6, 448.0)  # float8_e4m3fn (no inf; 448 is its largest finite value)
E5M2 = (2, -14, 57344.0)  # float8_e5m2
GROUP = 32


def ref_round(v, fmt):
    """Round float64 ``v`` to format ``fmt``: nearest, ties to even, overflow to inf (by hand, so
    no double rounding through fp32)."""
    mant, emin, fmax = fmt
    v = v.double()
    finite = torch.isfinite(v)
    vf = torch.where(finite, v, torch.zeros_like(v))
    _, e = torch.frexp(vf)
    quantum = (torch.clamp(e - 1, min=emin) - mant).double()
    r = torch.round(vf * torch.exp2(-quantum)) * torch.exp2(quantum)
    r = torch.where(r.abs() > fmax, torch.copysign(torch.full_like(r, INF), vf), r)
    return torch.where(finite, r, v)


def f32(v):
    """An fp32 operation's result from its exact float64 result (innocuous double rounding)."""
    return ref_round(v, FP32)


SCALE_FLOOR32 = f32(torch.tensor(1e-12, dtype=torch.float64))  # the smallest companded scale's fp32 floor


def ref_round_toward_zero(v, fmt):
    """Round finite float64 ``v`` to the format ``fmt`` toward zero."""
    mant, emin, _ = fmt
    v = v.double()
    _, e = torch.frexp(v)
    quantum = (torch.clamp(e - 1, min=emin) - mant).double()
    return torch.trunc(v * torch.exp2(-quantum)) * torch.exp2(quantum)


def ref_group_scale(absmax):
    """The bf16 group scale of the companded states (docs/numerics.md, "bf16 group scales") for fp32
    values ``absmax`` (float64, positive, finite, already clamped): to nearest, or toward zero where
    nearest is more than 2**-9 above ``absmax`` (that bound one fp32 product, as the package has it)."""
    nearest = ref_round(absmax, BF16)
    bound = ref_round(absmax.double() * (1 + 2.0**-9), FP32)
    return torch.where(nearest <= bound, nearest, ref_round_toward_zero(absmax, BF16))


FLOOR_SCALE = ref_group_scale(SCALE_FLOOR32).to(torch.bfloat16)  # an all-zero group's scale (0-d, bf16)


def ulp_log2(v64, fmt):
    """log2 of the spacing of format ``fmt`` at |v| (finite v)."""
    mant, emin, _ = fmt
    _, e = torch.frexp(v64)
    return (torch.where(v64 == 0, emin, torch.clamp(e - 1, min=emin)) - mant).double()


def ref_split_decode(hi, lo, n):
    """DESIGN §2.1 decode, exact in float64: ``hi + lo / N * 2**(e - m - 1)``."""
    hi = hi.double()
    return hi + lo.double() / n * torch.exp2(ulp_log2(hi, BF16) - 1)


def ref_split_encode(x64, n):
    """DESIGN §2.1 encode of a float64 master: (hi float64, lo int64, log2 of half an ulp of hi)."""
    hi = ref_round(x64, BF16)
    k = ulp_log2(hi, BF16) - 1
    r = ((x64 - hi) * torch.exp2(-k)).clamp(-1, 1)
    s = (r * n).abs()
    whole = torch.floor(s)
    lo = torch.sign(r) * (whole + (s - whole >= 0.5).double())  # round half away from zero
    return hi, lo.long(), k


def ref_companded_encode(x, kind):
    """DESIGN §2.2 encode of fp32 states ``x`` (float64 values of fp32 states; signed first moments,
    kind "signed", or second moments, kind "sqrt"), in float64: (codes [groups, 32] int64, bf16
    scales as float64), the last group zero-padded.

    Scale: the group's absmax (of s = fp32 sqrt(v) for second moments), clamped to [fp32 1e-12,
    bf16's max], rounded to bf16 by ``ref_group_scale`` (DESIGN: fp16, to nearest; docs/numerics.md,
    "bf16 group scales"); the codes divide by that stored scale. Beyond DESIGN (docs/numerics.md):
    finite absmax above bf16's max saturates to it; a group holding inf/nan gets a nan scale and
    zero codes; a positive sqrt(v) gets code 1 at least ("Second-moment floor"; the paper rounds it
    to 0)."""
    flat = f32(x.double().reshape(-1))
    groups = torch.cat([flat, flat.new_zeros((-flat.numel()) % GROUP)]).view(-1, GROUP)
    if kind == "sqrt":
        groups = f32(torch.sqrt(groups.clamp(min=0)))
    finite = torch.isfinite(groups).all(dim=1)
    scale = ref_group_scale(torch.clamp(groups.abs().amax(dim=1), min=float(SCALE_FLOOR32), max=BF16[2]))
    scale = torch.where(finite, scale, torch.full_like(scale, math.nan))
    live = (scale > 0)[:, None]
    u = torch.where(live, groups / torch.where(live, scale[:, None], 1.0), 0.0)
    if kind == "signed":
        q = torch.floor(127 * (2 * u / (1 + u.abs())) + 0.5).clamp(-127, 127)
    else:
        q = torch.where(u > 0, torch.floor(255 * u + 0.5).clamp(1, 255), 0.0)  # positive sqrt(v): code >= 1
    return q.long(), scale


def ref_tensor_scaled_encode(x64, fmt, floor):
    """DESIGN §2.6's per-tensor scaled states (FP8-LM: first moment e4m3, second moment fp16), as
    docs/numerics.md makes them exact, in float64: (code values float64, the fp32 scale as float64).

    target = the format's largest value + half the spacing of its top values; amax = max(max |x|, 1e-12);
    scale = the largest power of two with amax * scale <= target (0 for an infinite amax, nan for nan);
    code = round-to-nearest-even(clamp(x * scale, -max, max)); ``floor``: a positive x whose code is 0
    stores the smallest positive (subnormal) code."""
    mant, emin, fmax = fmt
    x = x64.double().reshape(-1)
    target = fmax + 2.0 ** (math.floor(math.log2(fmax)) - mant) / 2
    amax = float(x.abs().max()) if x.numel() else 0.0
    if math.isnan(amax):
        scale = math.nan
    elif math.isinf(amax):
        scale = 0.0
    else:
        amax = max(amax, 1e-12)
        k = math.floor(math.log2(target / amax))
        while amax * 2.0 ** (k + 1) <= target:
            k += 1
        while amax * 2.0**k > target:
            k -= 1
        scale = 2.0**k
    q = ref_round((x * scale).clamp(-fmax, fmax), fmt)
    if floor:
        q = torch.where((x > 0) & (q == 0), 2.0 ** (emin - mant), q)
    return q, scale


def ref_fp8_gradient(g, fmt=E5M2):
    """A gradient as the step reads it with FP8 gradients: encoded with one power-of-two scale
    (``ref_tensor_scaled_encode``, no floor) and decoded, float64 in ``g``'s shape."""
    q, scale = ref_tensor_scaled_encode(g, fmt, False)
    return (q / scale).view(g.shape)


# ============================================================================ fp64 reference optimizers


class RefLion:
    """fp64 Lion from ``flash_inductor.optim.Lion``'s docstring (momentum starts at zero)::

        p <- p * (1 - lr * wd) - lr * sign(beta1 * m + (1 - beta1) * g);  m <- beta2 * m + (1 - beta2) * g
    """

    def __init__(self, params, lr, weight_decay=0.0, betas=(0.9, 0.99)):
        self.params, self.lr, self.wd, self.betas = list(params), lr, weight_decay, betas
        self.m = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        for p, m in zip(self.params, self.m):
            g = p.grad
            p.copy_(p * (1 - self.lr * self.wd) - self.lr * torch.sign(b1 * m + (1 - b1) * g))
            m.copy_(b2 * m + (1 - b2) * g)


class RefSGDW:
    """fp64 SGDW from ``flash_inductor.optim.SGDW``'s docstring (buffer starts at zero)::

        p <- p * (1 - lr * wd);  buf <- momentum * buf + g;  d = g + momentum * buf if nesterov else buf
        p <- p - lr * d
    """

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
        self.params, self.lr, self.mom, self.wd, self.nesterov = list(params), lr, momentum, weight_decay, nesterov
        self.buf = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        for p, buf in zip(self.params, self.buf):
            g = p.grad
            p.mul_(1 - self.lr * self.wd)
            if self.mom:
                buf.copy_(self.mom * buf + g)
                d = g + self.mom * buf if self.nesterov else buf
            else:
                d = g
            p.sub_(self.lr * d)


def fp32_bias_correction(beta, step):
    """``1 - beta**step`` as the flashoptim step computes it. torch's Adam, traced by Dynamo, takes
    the power of the fp32 ``step`` tensor (``_get_value`` returns the tensor while compiling), so of
    ``beta`` rounded to fp32, where ``1 - 0.999`` is 1.3e-5 relatively off: that rounding belongs to
    torch.optim, not to the formats under test, so the reference reproduces it. The power itself is
    the exact one rounded to fp32 (passes/fp64_step_powers.py computes it in fp64; torch's fp32 pow
    may differ by an ulp, as CUDA's libdevice pow did at ``0.999 ** 1``)."""
    power = torch.tensor(beta, dtype=torch.float32).double() ** step
    return 1 - power.float().double()


def ref_one_step(algo, h, p, g, states, step):
    """One fp64 step of ``algo`` from master ``p``, bf16 grad ``g`` and decoded ``states``.

    Returns (new master, new states, size, ambiguous):
    - size: ``|p|`` plus the update recomputed with every term taken in absolute value, the scale
      that the fp32 rounding errors of the step are relative to (cancellation in, e.g., Nesterov's
      ``g + momentum * buf`` leaves those errors in a small result);
    - ambiguous: elements whose update direction fp32 cannot decide (Lion's sign of a sum that
      cancels to within fp32 rounding)."""
    lr, wd = h["lr"], h.get("weight_decay", 0.0)
    new = dict(states)
    size = p.abs()
    ambiguous = torch.zeros_like(p, dtype=torch.bool)
    if algo in ("adamw", "adam"):  # torch.optim.Adam / AdamW, single- and multi-tensor alike
        b1, b2 = h["betas"]
        g_size = g.abs()
        if algo == "adamw":
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
            g_size = g_size + wd * size
        new["exp_avg"] = b1 * states["exp_avg"] + (1 - b1) * g
        m_size = b1 * states["exp_avg"].abs() + (1 - b1) * g_size
        new["exp_avg_sq"] = b2 * states["exp_avg_sq"] + (1 - b2) * g * g
        v = new["exp_avg_sq"]
        if h["amsgrad"]:
            new["max_exp_avg_sq"] = torch.maximum(states["max_exp_avg_sq"], v)
            v = new["max_exp_avg_sq"]
        bc1, bc2 = fp32_bias_correction(b1, step), fp32_bias_correction(b2, step)
        denom = v.sqrt() / bc2.sqrt() + h["eps"]
        p = p - lr / bc1 * new["exp_avg"] / denom
        size = size + lr / bc1 * m_size / denom
    elif algo in ("sgd", "sgdw"):  # torch.optim.SGD (dampening 0) / SGDW docstring
        mom = h["momentum"]
        g_size = g.abs()
        if algo == "sgdw":
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
            g_size = g_size + wd * size
        d, d_size = g, g_size
        if mom:
            new["momentum_buffer"] = mom * states["momentum_buffer"] + g
            buf_size = mom * states["momentum_buffer"].abs() + g_size
            if h["nesterov"]:
                d, d_size = g + mom * new["momentum_buffer"], g_size + mom * buf_size
            else:
                d, d_size = new["momentum_buffer"], buf_size
        p = p - lr * d
        size = size + lr * d_size
    elif algo == "lion":
        b1, b2 = h["betas"]
        p = p * (1 - lr * wd)
        a, b = b1 * states["exp_avg"], (1 - b1) * g
        c = a + b
        # fp32 cannot decide the sign where the sum cancels to within its rounding, exact
        # cancellation (c == 0 from nonzero terms) included
        ambiguous = (c.abs() <= 2.0**-20 * (a.abs() + b.abs())) & ((a != 0) | (b != 0))
        p = p - lr * torch.sign(c)
        size = size + lr
        new["exp_avg"] = b2 * states["exp_avg"] + (1 - b2) * g
    else:
        raise AssertionError(algo)
    return p, new, size, ambiguous
