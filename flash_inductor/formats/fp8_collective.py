"""FP8 gradient all-reduce (FP8-LM, DESIGN.md §2.5): one scale agreed by all ranks, FP8 on the wire.

``all_reduce(x, state, reduce_op, group_name, group_size)`` computes what
``_c10d_functional.all_reduce(x, reduce_op, group_name)`` ("sum" or "avg") computes, moving e4m3
bytes instead of ``x``'s dtype; ``reduce_scatter`` likewise for ``reduce_scatter_tensor`` (the
first phase below alone: each rank keeps its fp32-summed chunk). With ``n`` ranks and ``mu`` from
``state``:

    amax   = all_reduce(max |x|, "max")                     every rank gets the same amax ...
    scale  = fp8_max / max(amax, 1e-12) * mu                ... and so the same scale
    x8     = e4m3(clamp(x * scale))                          |x * scale| <= mu * fp8_max: no saturation
    -- reduce-scatter: all_to_all_single of the uint8 bytes of x8 (chunk j goes to rank j) --
    s      = sum over ranks of float(x8 chunk)              fp32, exact for n <= 64 (below)
    count  = #{|s| > fp8_max}                               elements the next cast saturates
    -- all-gather: all_gather_into_tensor of the bytes of e4m3(clamp(s)), each with its count --
    out    = float(gathered) / scale   (/ n for "avg")     division by the world size after the sum
    mu'    = next_mu(mu, sum of the n counts, numel)         every rank sees the same counts

**Why an exchange and not an FP8 sum.** gloo refuses float8 tensors (DESIGN §2.5) and cannot sum
them, so the payload travels as ``uint8`` views and the sum is done locally in fp32 (the
"exchange" path; the only one implemented, on every backend: a native FP8 sum in NCCL was not
tried). Each rank sends ``(n-1)/n`` of its bytes in each of the two phases: ``2 (n-1)/n`` bytes
per element, like a ring all-reduce of 1-byte elements, plus the amax all-reduce (4 bytes) and the
count (4 bytes per rank in the all-gather).

**e4m3, not e5m2.** With one dynamic scale per tensor the range is set by the scale; what the
format adds is precision. e4m3 halves the rounding error of e5m2 (3 mantissa bits: relative error
at most 2**-4 instead of 2**-3) and keeps ``2**17.8`` of dynamic range below amax (e5m2:
``2**31.8``). MS-AMP, FP8-LM's code, sends weight gradients as e4m3 too (``wgrad_qtype``).

**Exact local sum.** e4m3 values are multiples of ``2**-9`` below ``2**9``; the sum of ``n`` of
them is a multiple of ``2**-9`` below ``n * 2**9``, which fp32 holds exactly while that is at most
``2**24`` units: ``n <= 64``. Beyond, the sum rounds once more in fp32.

**mu** (automatic scaling; FP8-LM "auto-scaling"). The sum of ``n`` ranks can reach
``n * mu * fp8_max`` in scaled units; the all-gather cast saturates what exceeds ``fp8_max`` (the
value becomes ``±amax / mu``, finite, never inf or nan). ``mu = 1`` (the most) lets the ranks'
casts use the whole range; ``mu = 1/n`` can never overflow but wastes ``log2 n`` binades at the
bottom. mu starts at ``1/n``, where no sum can overflow (on the first step of highly correlated
gradients, a start at 1 clipped a third of the elements), and the rule moves it between the two:
- more than ``OVERFLOW_THRESHOLD`` (0.001%) of the elements saturated this step: ``mu <- mu / 2``;
- otherwise ``mu <- min(mu * 2**(1/1000), 1)``: after 1000 consecutive clean steps mu has grown
  back by 2x, exponentially. Above 1 the ranks' own largest values would saturate before any sum.
The decision uses the summed counts all ranks receive in the all-gather, so all ranks keep the
same ``mu`` (and hence the same scale) without another collective. It applies from the next step.

``state`` is a 2-element fp32 tensor ``[mu, scale of the last step]`` that the call updates in
place (``new_state``); the scale is kept so that the agreement can be checked and logged.

Non-finite input: an inf or nan anywhere makes amax non-finite, the scale 0 or nan, and every
output element nan on every rank (loud, as for an fp32 all-reduce the step must be skipped).
"""

import torch

from flash_inductor.formats import fp8

FORMAT = fp8.E4M3
OVERFLOW_THRESHOLD = 1e-5  # 0.001% of the elements
GROWTH_STEPS = 1000
MU_MAX = 1.0
_GROWTH = 2.0 ** (1.0 / GROWTH_STEPS)
_COUNT_BYTES = 4  # an int32 per rank in the all-gather payload

MU, SCALE = 0, 1  # indices into the state tensor


def new_state(group_size, device=None):
    """``[mu, last scale]`` for a fresh collective over ``group_size`` ranks: mu = 1/n, no scale yet (0)."""
    return torch.tensor([1.0 / group_size, 0.0], dtype=torch.float32, device=device)


def next_mu(mu, overflow_count, numel):
    """mu for the next step: halved when more than 0.001% of ``numel`` elements saturated, else grown
    by ``2**(1/1000)`` up to 1 (fp32, elementwise)."""
    overflowed = overflow_count > OVERFLOW_THRESHOLD * numel
    return torch.where(overflowed, mu * 0.5, (mu * _GROWTH).clamp(max=MU_MAX))


def _wait(tensor):
    return torch.ops._c10d_functional.wait_tensor(tensor)


def _check_op(reduce_op, name):
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"fp8 {name}: reduce_op must be 'sum' or 'avg', got {reduce_op!r}")


def _agreed_scale(flat, mu, group_name):
    """fp8_max * mu / amax, with amax all-reduced with MAX: the same on every rank."""
    amax = _wait(torch.ops._c10d_functional.all_reduce(fp8.amax(flat), "max", group_name))
    return fp8.scale_from_amax(amax, FORMAT) * mu


def _exchange_and_sum(padded, scale, n, group_name):
    """The reduce-scatter phase: e4m3 bytes of ``padded`` (``n`` equal chunks), chunk j to rank j
    (all_to_all_single), summed over the ranks in fp32; in units of ``1 / scale``."""
    chunk = padded.numel() // n
    sent = fp8.cast_to_fp8(padded, scale, FORMAT).view(torch.uint8)
    received = _wait(torch.ops._c10d_functional.all_to_all_single(sent, [chunk] * n, [chunk] * n, group_name))
    return received.view(FORMAT).to(torch.float32).view(n, chunk).sum(0)


def all_reduce(x, state, reduce_op, group_name, group_size):
    """``all_reduce(x, reduce_op)`` over ``group_name`` (``group_size`` ranks) with e4m3 payloads;
    returns a new tensor of ``x``'s dtype and shape and updates ``state`` (see the module doc)."""
    _check_op(reduce_op, "all_reduce")
    n = group_size
    flat = x.reshape(-1).to(torch.float32)
    numel = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, (-numel) % n))
    chunk = padded.numel() // n
    mu = state[MU]
    scale = _agreed_scale(flat, mu, group_name)
    reduced = _exchange_and_sum(padded, scale, n, group_name)

    overflow = fp8.overflow_count(reduced, 1.0, FORMAT).to(torch.int32).reshape(1)
    payload = torch.cat([fp8.cast_to_fp8(reduced, 1.0, FORMAT).view(torch.uint8), overflow.view(torch.uint8)])
    gathered = _wait(torch.ops._c10d_functional.all_gather_into_tensor(payload, n, group_name))
    gathered = gathered.view(n, chunk + _COUNT_BYTES)
    summed = fp8.dequantize(gathered[:, :chunk].view(FORMAT).reshape(-1)[:numel], scale)
    if reduce_op == "avg":
        summed = summed / n
    overflow_total = gathered[:, chunk:].contiguous().view(torch.int32).sum()

    state.copy_(torch.stack([next_mu(mu, overflow_total, numel), scale]))
    return summed.to(x.dtype).view(x.shape)


def reduce_scatter(x, state, reduce_op, group_name, group_size):
    """``reduce_scatter_tensor(x, reduce_op)`` (rank j gets the sum of the ranks' j-th slice of dim 0)
    with e4m3 payloads: the all-reduce's first phase alone. The sum stays fp32 and is never cast
    again, so nothing can saturate: mu stays 1 and ``state`` records ``[1, scale]``."""
    _check_op(reduce_op, "reduce_scatter")
    n = group_size
    flat = x.reshape(-1).to(torch.float32)
    scale = _agreed_scale(flat, 1.0, group_name)
    summed = fp8.dequantize(_exchange_and_sum(flat, scale, n, group_name), scale)
    if reduce_op == "avg":
        summed = summed / n
    state.copy_(torch.stack([torch.ones_like(scale), scale]))
    return summed.to(x.dtype).view(x.shape[0] // n, *x.shape[1:])
