"""Tensors with one scale per tensor: FP8-LM's Adam states (MS-AMP O2), DESIGN §2.6, and FP8 gradients.

    first moment  (exp_avg):                       float8_e4m3fn codes, one fp32 scale per tensor
    second moment (exp_avg_sq, max_exp_avg_sq):    float16 codes of v itself, one fp32 scale per tensor
    gradients (``prepare(..., gradient_format=)``): float8_e5m2 (or e4m3) codes, one fp32 scale per tensor

The registry's kinds say which is which (``companded.SIGNED``: a signed moment; ``companded.SQRT``:
a second moment, stored here as ``v``, not ``sqrt(v)``). Per tensor, all in fp32:

    amax   = max(max |x|, 1e-12)
    scale  = the largest power of two with amax * scale <= target   (exact)
    code   = dtype(clamp(x * scale, -code_max, code_max))            (round to nearest even)
    second moments: a positive x whose code is 0 stores the smallest positive code instead
    decode: x = float(code) * (1 / scale)

``code_max`` is 448 (e4m3), 57344 (e5m2) or 65504 (fp16); ``target`` is ``code_max`` plus half the
spacing of the top codes, 464, 61440 or 65520 (values in ``(code_max, target]`` round to ``code_max``,
as they would to nearest in a wider format). The scale multiplies into the code's range, as in ``formats/fp8.py``
(whose rounding to a power of two is reused); MS-AMP's scaling tensors use powers of two too.

Why powers of two, and why this target: ``x * scale`` and ``1 / scale`` are exact, so encode rounds
once and decode is exact; and a scaled amax in ``(target / 2, target]`` rounds to a largest code
above ``target / 2`` (240 or 32768 at least), whose decoded value gives back the same scale.
Re-encoding decoded values is therefore the identity on codes and scale: a parameter the flat step
leaves untouched (passes/untouched_parameters.py re-encodes its decoded state) keeps every bit,
and a checkpoint's decoded values load back to the very codes and scale (no scales need saving).
With ``target = code_max`` a largest code of 224 (e4m3) would re-encode with twice the scale.

The floor on second moments is the companded format's (docs/numerics.md, "Second-moment floor"):
a positive ``v`` that would decode to 0 would make Adam's next update ``m / eps``. Below the
smallest positive code (2**-9 of the scale's unit for e4m3, 2**-24 for fp16) values are stored as
that code. With fp16 this only touches ``v`` more than 2**40 below the tensor's largest.

Segments: a flat bucket (``flash_inductor/flat.py``) keeps the states of many tensors as one block of
rows of ``companded.GROUP_SIZE``, each tensor a run of whole rows (zero padding at its end). ``starts``
(int64, increasing, the first 0) holds each tensor's first row and ``scales`` one scale per tensor;
a single tensor is one segment, ``starts = [0]``. The segment of each row is found by
``bucketize`` and a tensor's amax is a segmented max of its rows' maxima (``segment_max``: gathers,
no atomics): a fixed number of operations, whatever the number of tensors.

Gradients (``flash_inductor/flat.py``) are signed values without a floor, stored in e5m2 as FP8-LM
stores them (its 1 B/param gradients: 2 mantissa bits, range 2**-16 .. 57344 of the scale's unit) or
in e4m3; encode and decode are the ones above. Gradient clipping multiplies a scale by the inverse of
its coefficient (``gradient_clipping.py``): decoding then rounds once more, and the scale is no power
of two until the next encode.

Edge cases: an all-zero tensor stores scale ``2**floor(log2(target * 1e12))`` and codes 0. A tensor
holding inf has amax inf, scale 0: every element decodes to nan (``0 * inf``); one holding nan has a
nan scale: also all nan. Loud, like an fp32 state, and never a silently wrong finite value.
"""

import math

import torch

from . import companded, fp8

E4M3 = torch.float8_e4m3fn
# The FP8-LM preset: a signed (first) moment in e4m3, a second moment in fp16 (FP8-LM's "precision
# decoupling": an e4m3 second moment diverges, benchmarks/fp8lm_ablation.py).
CODE_DTYPES = {companded.SIGNED: E4M3, companded.SQRT: torch.float16}
# prepare(..., gradient_format=name): the code dtype of a bucket's gradients (FP8-LM: e5m2)
GRADIENT_FORMATS = {"e5m2": torch.float8_e5m2, "e4m3": E4M3}


def code_max(dtype):
    """The largest finite code: 448 for e4m3, 57344 for e5m2, 65504 for fp16."""
    return torch.finfo(dtype).max


def scale_target(dtype):
    """``code_max`` plus half the spacing of the codes at the top: 464 for e4m3, 61440 for e5m2, 65520
    for fp16. A value up to it rounds to ``code_max`` (the clamp before the cast does what rounding to nearest
    would), and a scaled amax in ``(target / 2, target]`` rounds to a largest code above
    ``target / 2``, so re-encoding decoded values finds the same scale."""
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def smallest_code(dtype):
    """The smallest positive code (a subnormal): 2**-9 for e4m3, 2**-16 for e5m2, 2**-24 for fp16."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def row_segments(starts, num_rows):
    """The segment (tensor) index of each of ``num_rows`` rows, int64 [num_rows]."""
    rows = torch.arange(num_rows, device=starts.device, dtype=starts.dtype)
    return torch.bucketize(rows, starts, right=True) - 1


# Values a piece of ``segment_max`` spans at most: one gathered reduction of this length per piece.
PIECE_ROWS = 1024


@torch.library.custom_op("flash_inductor::segment_pieces", mutates_args=())
def segment_pieces(starts: torch.Tensor, n: int, piece_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``segment_max``'s pieces of ``n`` values cut at every segment start and every ``piece_rows``-th
    value: (each piece's first value, its last one, each segment's first piece), int64 [M], [M], [S]
    with ``M = ceil(n / piece_rows) + S`` (a cut equal to a start makes an empty piece, whose last
    value is its first).

    An opaque operator, so that Inductor runs these few thousand indices through aten's kernels into
    buffers of their own. Traced into Inductor's graph (torch 2.11, CUDA) the concatenation of the
    cuts and starts was written in place into its slices, and a later kernel reused that buffer while
    still reading the starts through one of those slices: on the H200 a 1B Llama's per-tensor amaxes
    came out wrong for 14 of its 114 tensors, and on a smaller layout the kernel stopped with
    "misaligned address" (docs/numerics.md, "FP8-LM optimizer states")."""
    cuts = torch.arange(0, n, piece_rows, device=starts.device, dtype=starts.dtype)
    piece_starts = torch.cat([cuts, starts]).sort().values
    piece_ends = torch.cat([piece_starts[1:], piece_starts.new_full((1,), n)])
    return piece_starts, torch.maximum(piece_ends - 1, piece_starts), torch.searchsorted(piece_starts, starts)


@segment_pieces.register_fake
def _segment_pieces_shapes(starts, n, piece_rows):
    pieces = piece_count(n, starts.numel(), piece_rows)
    return starts.new_empty(pieces), starts.new_empty(pieces), torch.empty_like(starts)


def piece_count(n, segments, piece_rows):
    """How many pieces ``segment_pieces`` cuts ``n`` values of ``segments`` segments into (empty ones included)."""
    return -(-n // piece_rows) + segments


def segment_max(values, starts, piece_rows=PIECE_ROWS):
    """The max of each segment of the non-negative 1-D ``values`` (nan where one holds a nan),
    segments starting at ``starts`` (int64, increasing, the first 0); fp32 [S].

    ``scatter_reduce(amax)`` runs one float atomic per value, all of a segment's aimed at one
    address, which on a GPU serialises a tensor's million rows (82 of the FP8-LM step's 96 ms on a
    1.2B model's tensors, H200). So the values are first cut at every segment start and every ``piece_rows``-th
    value into pieces (``N / piece_rows + S`` with the empty ones), each reduced by a gather of
    ``piece_rows`` indices clamped into it (a repeated value leaves a max unchanged); the pieces'
    maxima are segments again, and so on while that halves the values. The few left per segment
    go to ``scatter_reduce``. Every shape is static: the levels depend on ``N`` and ``S`` only."""
    n, device = values.numel(), values.device
    if starts.numel() == 1:
        return values.amax().reshape(1)
    if 2 * piece_count(n, starts.numel(), piece_rows) > n:
        return torch.zeros(starts.shape, dtype=values.dtype, device=device).scatter_reduce(
            0, row_segments(starts, n), values, "amax")
    piece_starts, last, piece_segments = segment_pieces(starts, n, piece_rows)
    # An empty piece reads the value at its start, which belongs to the segment it is counted in.
    offsets = torch.arange(piece_rows, device=device, dtype=starts.dtype)
    piece_max = values[torch.minimum(piece_starts.unsqueeze(1) + offsets, last.unsqueeze(1))].amax(dim=1)
    return segment_max(piece_max, piece_segments, piece_rows)


def segment_amax(rows, starts):
    """``max |x|`` of each segment of fp32 ``rows`` [R, 32] (nan where it holds a nan)."""
    return segment_max(rows.abs().amax(dim=1), starts)


def scale_from_amax(amax, dtype):
    """The largest power of two ``s`` with ``max(amax, 1e-12) * s <= scale_target(dtype)``, fp32
    (elementwise; 0 for an infinite amax, nan for nan).

    ``target / amax`` rounded down to a power of two, then corrected by one power where the
    division's rounding crossed one: the products with powers of two are exact, so the result is.
    """
    a = amax.to(torch.float32).clamp(min=fp8.AMAX_FLOOR)
    target = scale_target(dtype)
    # A tensor numerator: Python's ``float / tensor`` computes ``reciprocal(t) * float`` (two roundings).
    scale = fp8.round_down_to_power_of_two(torch.full_like(a, target) / a)
    scale = torch.where(a * (2 * scale) <= target, 2 * scale, scale)
    return torch.where(a * scale > target, scale / 2, scale)


def _codes(rows, scale_of_rows, dtype, floor):
    """Codes of fp32 ``rows`` [R, 32] against each row's fp32 scale [R, 1]."""
    limit = code_max(dtype)
    scaled = (rows * scale_of_rows).clamp(-limit, limit)  # exact: the scale is a power of two
    if floor:
        # The code of a positive value is 0 exactly when its scaled value is at most half the smallest
        # code (round to nearest even). Asked in fp32, not of the cast's result: without
        # emulate_precision_casts (the backend sets it, a bare torch.compile does not) Inductor drops a
        # cast to fp16 and back, and the compare never saw the 0.
        smallest = smallest_code(dtype)
        scaled = torch.where((rows > 0) & (scaled <= smallest / 2), smallest, scaled)
    return scaled.to(dtype)  # the cast rounds once


def encode(rows, starts, dtype, floor):
    """Encode fp32 ``rows`` [R, 32] as ``(codes [R, 32] of dtype, fp32 scales [S])``, one scale per
    segment of ``starts`` [S]. ``floor``: positive values store the smallest positive code at
    least (second moments)."""
    segments = row_segments(starts, rows.shape[0])
    scales = scale_from_amax(segment_amax(rows, starts), dtype)
    return _codes(rows, scales[segments].unsqueeze(1), dtype, floor), scales


def decode(codes, scales, starts):
    """fp32 rows [R, 32] from ``codes`` [R, 32] and the fp32 ``scales`` of the segments ``starts``."""
    segments = row_segments(starts, codes.shape[0])
    return codes.float() * (1 / scales)[segments].unsqueeze(1)


def add_gradient(grad, codes, scale, accumulate):
    """Encode ``grad`` (its elements in order, any dtype) into one segment's ``codes`` [R, 32] and
    ``scale`` [1], in place; with ``accumulate``, the sum in fp32 of what they hold and ``grad``.
    The same encode as ``encode``, written for ``torch.compile`` (backward's hooks,
    flash_inductor/flat.py): one reduction and one pointwise kernel, with no fp32 copy of ``grad``,
    where eager torch launches some thirty kernels per gradient and keeps fp32 temporaries of it."""
    rows = companded.as_groups(grad)
    if accumulate:
        rows = codes.float() * (1 / scale) + rows
    new_scale = scale_from_amax(rows.abs().amax().reshape(1), codes.dtype)
    codes.copy_(_codes(rows, new_scale.view(1, 1), codes.dtype, False))
    scale.copy_(new_scale)
