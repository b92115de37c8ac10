"""Adam-state formats to compare, as functions that store fp32 moments and give back what decode reads.

Used by ``state_fidelity.py`` (shadow states on a real run's gradients) and by ``hf_clients.py
--emulate-states`` (a flashoptim row with fp32 states whose moments are rounded through one of these
after every step: the format's effect on training, without writing its kernels). Each function
takes fp32 rows ``[groups, 32]`` holding whole tensors, each a run of rows from ``starts`` (the
per-tensor formats need those), and returns fp32 rows.

    companded          the package's default (formats/companded.py): softsign m, sqrt-linear v, bf16 scales
    companded_m_only   its first moment only (v exact)
    companded_v_only   its second moment only (m exact)
    fp8lm              FP8-LM's states (formats/tensor_scaled.py): e4m3 m, fp16 v, one scale per tensor
    root4_v            companded m; v with codes linear in v ** (1/4) (fp16 group scales, floor, same bytes)
    sr_v               companded m; the package's codes of v, rounded stochastically (floor kept)
    sr                 both moments' package codes rounded stochastically
    e4m3_m             m as float8_e4m3fn codes against the same fp16 group scales; companded v
    e4m3_m_root4_v     the same m; root4_v's v
    fp16_scales        the package's codes against fp16 group scales: DESIGN §2.2's and FlashOptim's scales,
                       the package's before issue 14's measurements
    bf16_scales        the same against bf16 group scales rounded to nearest, as measured; the package's
                       format rounds them to nearest only where that keeps the top code (so that decode then
                       encode keeps every bit), else toward zero: within a code step and the scale's rounding of
                       this (tests/test_state_candidates.py)

The proposals (root4_v, sr_v, sr, e4m3_m, e4m3_m_root4_v) keep fp16 group scales, as measured.
"""

import torch

from flash_inductor import optimizer_record, registry
from flash_inductor.formats import companded, tensor_scaled
from flash_inductor.formats.state_tensor import Fp32State

GROUP = companded.GROUP_SIZE


def exact(rows, starts):
    return rows


def companded_signed(rows, starts):
    codes, scales = companded.encode(rows, companded.SIGNED)
    return companded.decode(codes, scales, rows.shape, companded.SIGNED)


def companded_sqrt(rows, starts):
    codes, scales = companded.encode(rows, companded.SQRT)
    return companded.decode(codes, scales, rows.shape, companded.SQRT)


def fp8lm_first(rows, starts):
    codes, scales = tensor_scaled.encode(rows, starts, tensor_scaled.CODE_DTYPES[companded.SIGNED], floor=False)
    return tensor_scaled.decode(codes, scales, starts)


def fp8lm_second(rows, starts):
    codes, scales = tensor_scaled.encode(rows, starts, tensor_scaled.CODE_DTYPES[companded.SQRT], floor=True)
    return tensor_scaled.decode(codes, scales, starts)


def _group_scales(values, dtype):
    """Each group's scale, ``dtype(clamp(absmax, 1e-12))`` as fp32 (fp16: also at most 65504, DESIGN's)."""
    absmax = values.abs().amax(dim=1, keepdim=True).clamp(min=companded.SCALE_FLOOR)
    return (absmax.clamp(max=65504.0) if dtype == torch.float16 else absmax).to(dtype).float()


def _scaled(rows, kind, dtype):
    """The package's codes of ``kind`` against group scales rounded to ``dtype``: fp16 as DESIGN §2.2
    and FlashOptim have them (the package's until issue 14's measurements: they round to zero below
    2**-25 and keep a few bits below 2**-14, where Adam, being scale-invariant, still moves
    tiny-gradient weights by full steps), or bf16 (the same bytes, fp32's exponent range)."""
    values = companded._coded_values(rows, kind)
    scale = _group_scales(values, dtype)
    return companded.decode(companded._codes(values, scale, kind), scale, rows.shape, kind)


def _sqrt_groups(rows):
    """sqrt(v) per element, its group's fp16 scale as fp32, and their ratio: the proposals below were
    measured against fp16 group scales, before the package's became bf16."""
    s = rows.clamp(min=0).sqrt()
    scale = _group_scales(s, torch.float16)
    return s, scale, torch.where(scale > 0, s / scale, torch.zeros_like(s))


def _over_fp16_scale(rows):
    scale = _group_scales(rows, torch.float16)
    return scale, torch.where(scale > 0, rows / scale, torch.zeros_like(rows))


def root4_sqrt(rows, starts):
    """Codes linear in sqrt(sqrt(v) / scale): relative steps that stay small for small v."""
    _, scale, u = _sqrt_groups(rows)
    q = torch.where(u > 0, torch.floor(255 * u.sqrt() + 0.5).clamp(1, 255), 0)
    return ((q / 255) ** 2 * scale) ** 2


def stochastic_sqrt(rows, starts):
    """The package's codes of sqrt(v), rounded up with probability of the fraction (floor kept)."""
    _, scale, u = _sqrt_groups(rows)
    q = torch.where(u > 0, torch.floor(255 * u + torch.rand_like(u)).clamp(1, 255), 0)
    return (q / 255 * scale) ** 2


def stochastic_signed(rows, starts):
    scale, u = _over_fp16_scale(rows)
    y = torch.floor(127 * (2 * u / (1 + u.abs())) + torch.rand_like(u)).clamp(-127, 127) / 127
    return y / (2 - y.abs()) * scale


def e4m3_signed(rows, starts):
    """float8_e4m3fn codes of m against its group's fp16 scale (absmax maps to 448): relative steps of
    at most 12.5% down to 2**-9 / 448 of the group's largest, where softsign codes give a few codes
    or none below 1/250 of it."""
    scale, u = _over_fp16_scale(rows)
    return (u * 448).clamp(-448, 448).to(torch.float8_e4m3fn).float() / 448 * scale


# name -> (first moment's store, second moment's store)
CANDIDATES = {
    "companded": (companded_signed, companded_sqrt),
    "companded_m_only": (companded_signed, exact),
    "companded_v_only": (exact, companded_sqrt),
    "fp8lm": (fp8lm_first, fp8lm_second),
    "root4_v": (companded_signed, root4_sqrt),
    "sr_v": (companded_signed, stochastic_sqrt),
    "sr": (stochastic_signed, stochastic_sqrt),
    "e4m3_m": (e4m3_signed, companded_sqrt),
    "e4m3_m_root4_v": (e4m3_signed, root4_sqrt),
    "fp16_scales": (lambda rows, starts: _scaled(rows, companded.SIGNED, torch.float16),
                    lambda rows, starts: _scaled(rows, companded.SQRT, torch.float16)),
    "bf16_scales": (lambda rows, starts: _scaled(rows, companded.SIGNED, torch.bfloat16),
                    lambda rows, starts: _scaled(rows, companded.SQRT, torch.bfloat16)),
}


@torch.no_grad()
def store_by_tensor(store, rows, starts, ends):
    """``rows[a:b] = store(rows[a:b])`` for each tensor's rows ``a:b`` (``starts``, ``ends``): one tensor
    at a time, so that the temporaries are one tensor's, not the whole flat buffer's."""
    one = torch.zeros(1, dtype=torch.int64, device=rows.device)
    for a, b in zip(starts, ends):
        rows[a:b] = store(rows[a:b], one)


@torch.no_grad()
def round_states(optimizer, name, min_numel=4096):
    """Store a prepared optimizer's fp32 flat states (``prepare(..., state_bits=None)``) through
    candidate ``name``, as a step in that format would have stored them; only tensors of
    ``min_numel`` elements or more (``prepare``'s ``min_quantized_numel``: smaller ones keep fp32)."""
    stores = dict(zip((companded.SIGNED, companded.SQRT), CANDIDATES[name]))
    optimizer_class = type(optimizer)
    for bucket in optimizer_record.prepared(optimizer).buckets:
        rows = [s.groups for s in bucket.segments.values() if s.numel >= min_numel]
        kinds = registry.layout(optimizer_class, optimizer.param_groups[bucket.group_index]).quantized
        for key, state in bucket.states.items():
            if not isinstance(state, Fp32State):
                raise TypeError(f"emulating {name!r} needs fp32 states (state_bits=None); {key} is {state!r}")
            store_by_tensor(stores[kinds[key]], state.values, [r.start for r in rows], [r.stop for r in rows])


def rounding_after(step, optimizer, name):
    """``step``, then ``round_states(optimizer, name)``."""

    def rounded_step(*args):
        loss = step(*args)
        round_states(optimizer, name)
        return loss

    return rounded_step
