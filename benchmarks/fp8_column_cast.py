"""Row-wise FP8's cast by columns in one kernel, against ``fp8_linear._quantize_columns``'s two: a
prototype, measured and not adopted (forty-fifth session, docs/benchmarks.md).

Row-wise scaling casts each operand that a GEMM sums over the rows by columns: the weight for the input
gradient's GEMM, the input and the output gradient for the weight gradient's. ``_quantize_columns`` is
a reduction of Inductor's for each column's amax (a split reduction over the rows, then its finish)
and ``fp8_transpose``'s ``transpose_kernel``, which casts as it transposes: the bf16 tensor is read from
memory twice (``before`` below). The prototype does both in one kernel: each program takes a block of
columns, passes over all their rows for the amax, computes the power-of-two scale
(``formats.fp8._power_of_two_scale``'s formula on the amax's bits), and passes again to cast and store
the block transposed; the second pass is meant to find its rows in L2, so that the tensor is read
from memory once. But a program per block of columns is 128 to 352 programs for the Llama's tensors,
each looping over all rows twice: in the Llama cut to 2 layers on an H100 it took 63 µs a tensor
where the two kernels take 34, and the step 18.9 ms against 17.6 (``fp8_column_cast_h100.log``, an
earlier version of this script; ``hf_clients_llama2l_rowwise_profile_bycolumns_h100.log``).

The segmented form splits each block of columns' rows among programs launched together, which wait
for each other's amax (``segmented_kernel``). It keeps the bits and, on the H200, beats the two kernels
compiled alone (8192 x 2048: 42.6 against 59.1 µs); but alone the two kernels take about twice their
time in the model, so it was not put in the product (``fp8_column_cast_segmented_h200.log``).

On a GPU it checks the bits against ``before`` (compiled, as the model runs it) on the shapes of HF
Llama-1B's layer and on values that reach every case of the scale (zero columns, an inf, a nan, the
largest and smallest amaxes), then times both forms at a few block shapes, ``before`` and a plain cast
of the same tensor (one read, one write: the bound), each in a CUDA graph, after a write of the tensor
as its producer's and with L2 emptied::

    python benchmarks/fp8_column_cast.py --out benchmarks/results/fp8_column_cast_segmented_h200.json

On a machine without a GPU, ``TRITON_INTERPRET=1 python benchmarks/fp8_column_cast.py --check-only``
runs the kernel in Triton's interpreter on small shapes against the CPU's cast: the scales must match
bit for bit; of the bytes, those of nans and infs and of values halfway between two e4m3 values differ,
as the interpreter's own conversion to fp8 does not round to nearest even (3.125 gives 3.25, where
torch's cast and the GPU's ``cvt.rn`` give 3.0).
"""

import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from flash_inductor import fp8_linear
from flash_inductor.formats import fp8

# (rows, columns) cast by columns in one Llama-1B layer (8192 tokens): inputs and output gradients of
# 2048 and 5632 features, and the weights (N x K) whose columns the input gradient's GEMM sums over
SHAPES = [(8192, 2048), (8192, 5632), (5632, 2048), (2048, 5632), (2048, 2048)]
# (columns a program, rows a step of its loops, warps)
BLOCKS = [(16, 256, 4), (16, 512, 8), (32, 256, 4), (32, 128, 4), (64, 128, 8), (8, 512, 4)]
# (columns a program, rows a step of its loops, programs a block of columns, warps)
SEGMENTED = [(16, 256, 4, 4), (16, 256, 8, 4), (32, 128, 4, 4), (32, 256, 8, 8), (64, 64, 8, 4), (16, 128, 16, 4)]
_SPIN_LIMIT = 1 << 20  # a program waits at most this many reads of the count for its block's others
before = fp8_linear._quantize_columns


@triton.jit
def column_amax(src, c, in_cols, first, last, cols, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """The amax of columns ``c`` over rows [first, last) and whether they hold a nan."""
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    has_nan = tl.zeros([BLOCK_C], dtype=tl.int32)
    for r0 in range(first, last, BLOCK_R):  # their rows stay in L2 for the second pass
        r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        inside = (r[:, None] < last) & in_cols[None, :]
        x = tl.load(src + r[:, None] * cols + c[None, :], mask=inside, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        has_nan = tl.maximum(has_nan, tl.max((x != x).to(tl.int32), axis=0))
    return amax, has_nan > 0


@triton.jit
def power_of_two_scale(amax, is_nan, MAX_EXPONENT: tl.constexpr, MANTISSA_OF_1_75: tl.constexpr,
                       FLOOR: tl.constexpr):
    """formats.fp8.scale_from_amax(amax, power_of_two=True): _power_of_two_scale's formula on the bits of
    max(amax, AMAX_FLOOR), no division; an infinite amax gives 0 and a nan gives nan."""
    bits = tl.maximum(amax, FLOOR).to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    above_1_75 = ((bits & 0x7FFFFF) > MANTISSA_OF_1_75).to(tl.int32)
    scale = ((2 * 127 + MAX_EXPONENT - exponent - above_1_75) << 23).to(tl.float32, bitcast=True)
    return tl.where(is_nan, float("nan"), tl.where(exponent == 0xFF, 0.0, scale))


@triton.jit
def cast_transposed(src, dst, scale, c, in_cols, first, last, rows, cols, BLOCK_R: tl.constexpr):
    """Rows [first, last) of columns ``c`` times their scales, rounded as transpose_kernel rounds
    (cvt.rn.satfinite), stored transposed."""
    for r0 in range(first, last, BLOCK_R):
        r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        inside = (r[:, None] < last) & in_cols[None, :]
        x = tl.load(src + r[:, None] * cols + c[None, :], mask=inside, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        y = (x * scale[None, :]).to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(dst + c[None, :].to(tl.int64) * rows + r[:, None], y, mask=inside)


@triton.jit
def one_kernel(src, dst, scales, rows, cols, MAX_EXPONENT: tl.constexpr, MANTISSA_OF_1_75: tl.constexpr,
               FLOOR: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """A program per block of columns, two passes over all their rows."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_cols = c < cols
    amax, is_nan = column_amax(src, c, in_cols, 0, rows, cols, BLOCK_C, BLOCK_R)
    scale = power_of_two_scale(amax, is_nan, MAX_EXPONENT, MANTISSA_OF_1_75, FLOOR)
    tl.store(scales + c, scale, mask=in_cols)
    cast_transposed(src, dst, scale, c, in_cols, 0, rows, rows, cols, BLOCK_R)


@triton.jit
def segmented_kernel(src, dst, scales, amax_bits, arrived, rows, cols, MAX_EXPONENT: tl.constexpr,
                     MANTISSA_OF_1_75: tl.constexpr, FLOOR: tl.constexpr, SPIN_LIMIT: tl.constexpr,
                     SEGMENTS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """The rows of each block of columns split among ``SEGMENTS`` programs launched next to each other: each
    reduces its rows' amax into the block's (an atomic max on the amax's bits, which orders non-negative
    floats, nan above inf), counts itself arrived, waits for the others, and casts its rows. A program that
    waits past ``SPIN_LIMIT`` reads goes on with what has arrived (wrong bits, which the check counts,
    rather than a hung GPU)."""
    segment, block = tl.program_id(0), tl.program_id(1)  # a block's segments launched one after the other
    c = block * BLOCK_C + tl.arange(0, BLOCK_C)
    in_cols = c < cols
    per_segment = tl.cdiv(tl.cdiv(rows, SEGMENTS), BLOCK_R) * BLOCK_R
    first, last = segment * per_segment, tl.minimum(rows, (segment + 1) * per_segment)
    amax, is_nan = column_amax(src, c, in_cols, first, last, cols, BLOCK_C, BLOCK_R)
    tl.atomic_max(amax_bits + c, tl.where(is_nan, 0x7FC00000, amax.to(tl.int32, bitcast=True)), mask=in_cols)
    tl.atomic_add(arrived + block, 1)
    count = tl.atomic_add(arrived + block, 0)
    spins = 0
    while (count < SEGMENTS) & (spins < SPIN_LIMIT):
        count = tl.atomic_add(arrived + block, 0)
        spins += 1
    bits = tl.atomic_max(amax_bits + c, 0, mask=in_cols)  # (a read)
    scale = power_of_two_scale(bits.to(tl.float32, bitcast=True), bits > 0x7F800000, MAX_EXPONENT,
                               MANTISSA_OF_1_75, FLOOR)
    if segment == 0:
        tl.store(scales + c, scale, mask=in_cols)
    cast_transposed(src, dst, scale, c, in_cols, first, last, rows, cols, BLOCK_R)


_FORMAT = dict(MAX_EXPONENT=fp8._MAX_EXPONENT[fp8.E4M3], MANTISSA_OF_1_75=fp8._MANTISSA_OF_1_75, FLOOR=fp8.AMAX_FLOOR)


def _outputs(t):
    """Empty ``(t cast by columns, transposed; its scales)``."""
    rows, cols = t.shape
    return (torch.empty((cols, rows), dtype=fp8.E4M3, device=t.device),
            torch.empty((cols,), dtype=torch.float32, device=t.device))


def cast_columns_segmented(t, block=SEGMENTED[0]):
    """``cast_columns`` with each block of columns' rows split among programs."""
    columns, step, segments, warps = block
    rows, cols = t.shape
    out, scales = _outputs(t)
    blocks = -(-cols // columns)
    amax_bits = torch.zeros((cols,), dtype=torch.int32, device=t.device)
    arrived = torch.zeros((blocks,), dtype=torch.int32, device=t.device)
    segmented_kernel[(segments, blocks)](t, out, scales, amax_bits, arrived, rows, cols, **_FORMAT,
                                         SPIN_LIMIT=_SPIN_LIMIT, SEGMENTS=segments, BLOCK_C=columns, BLOCK_R=step,
                                         num_warps=warps)
    return out, fp8.inverse_scale(scales[:, None])


def cast_columns(t, block=BLOCKS[0]):
    """``before(t)``'s ``(t cast by columns in e4m3, transposed; the inverse scales (cols, 1))`` in one kernel."""
    columns, step, warps = block
    rows, cols = t.shape
    out, scales = _outputs(t)
    one_kernel[(-(-cols // columns),)](t, out, scales, rows, cols, **_FORMAT, BLOCK_C=columns, BLOCK_R=step,
                                       num_warps=warps)
    return out, fp8.inverse_scale(scales[:, None])


def _test_values(rows, cols, device, seed=0):
    """bf16 ``rows x cols`` whose columns reach every case of the scale: normal values of many
    magnitudes, zeros, an inf, a nan, amaxes at the largest bf16 and under the floor, and values
    that round to e4m3's subnormals and saturate nowhere."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * 2.0 ** torch.randint(-30, 30, (1, cols), generator=g)
    t[:, 0] = 0
    t[rows // 2, 1] = float("inf")
    t[rows // 3, 2] = float("nan")
    t[:, 3] = torch.finfo(torch.bfloat16).max
    t[:, 4] = 1e-14
    t[:, 5] *= 2.0 ** torch.randint(-20, 0, (rows,), generator=g)  # a column over many magnitudes
    return t.to(torch.bfloat16).to(device)


def check(shape, device, reference, segmented):
    """Bytes and inverse scales of each kernel that differ from ``reference``'s (nan scales equal); the
    segmented one with each block shape of ``segmented`` (segments that must wait for each other: one
    only in the interpreter, which runs programs one at a time)."""
    t = _test_values(*shape, device)
    want, want_inv = reference(t)
    row = dict(shape=list(shape))
    kernels = [("one_kernel", cast_columns(t))]
    kernels += [(f"segmented_{'x'.join(map(str, b))}", cast_columns_segmented(t, b)) for b in segmented]
    for name, (got, got_inv) in kernels:
        same_scale = (got_inv == want_inv) | (got_inv.isnan() & want_inv.isnan())
        row[f"{name}_differing"] = [int((got.view(torch.uint8) != want.view(torch.uint8)).sum()), int((~same_scale).sum())]
    return row


def _graph_us(fn, calls):
    """GPU µs of ``calls`` calls of ``fn`` captured in a CUDA graph and replayed (no launch gaps), median
    of 10 replays."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _median_us(fn, before_each, calls=20):
    """GPU µs of one call of ``fn`` after ``before_each`` (timed alone and taken off)."""
    for _ in range(3):  # (compiled, autotuned, allocated before capture)
        fn()
    torch.cuda.synchronize()
    return (_graph_us(lambda: (before_each(), fn()), calls) - _graph_us(before_each, calls)) / calls


def time_shape(shape, mode):
    """µs of each form on ``shape``. ``mode``: "flushed", L2 emptied before each call (a 256 MiB write); or
    "produced", ``t`` written just before (``t *= 1``), partly in L2 as after the kernel that produces it
    in the model."""
    t = torch.randn(shape, device="cuda").to(torch.bfloat16)
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    before_each = flush.zero_ if mode == "flushed" else lambda: t.mul_(1)
    compiled_before = torch.compile(before)
    plain_cast = torch.compile(lambda t: t.to(fp8.E4M3))  # one read of bf16, one write of e4m3
    row = dict(shape=list(shape), mode=mode, mb_bf16=t.numel() * 2 / 2**20,
               before_us=_median_us(lambda: compiled_before(t), before_each),
               plain_cast_us=_median_us(lambda: plain_cast(t), before_each))
    for block in BLOCKS if mode == "flushed" else BLOCKS[:2]:
        row[f"one_kernel_{block[0]}x{block[1]}w{block[2]}_us"] = _median_us(lambda: cast_columns(t, block), before_each)
    for block in SEGMENTED:
        row[f"segmented_{'x'.join(map(str, block))}_us"] = _median_us(lambda: cast_columns_segmented(t, block), before_each)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-only", action="store_true", help="the bits only (small shapes in the interpreter)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cpu" if interpreted else "cuda"
    reference = before if interpreted else torch.compile(before)
    shapes = [(64, 48), (200, 40), (33, 17)] if interpreted else SHAPES
    segmented = [(16, 32, 1, 4)] if interpreted else SEGMENTED
    results = dict(checks=[check(shape, device, reference, segmented) for shape in shapes], timings=[])
    for row in results["checks"]:
        print(f"{str(tuple(row['shape'])):>14}  differing from before (bytes, scales): "
              + "  ".join(f"{k.removesuffix('_differing')} {v}" for k, v in row.items() if k != "shape"))
    if not (args.check_only or interpreted):
        results["device"] = torch.cuda.get_device_name()
        for mode, shape in [(mode, shape) for mode in ("produced", "flushed") for shape in SHAPES]:
            row = time_shape(shape, mode)
            results["timings"].append(row)
            print(f"{str(tuple(shape)):>14} {mode}  " + "  ".join(f"{k.removesuffix('_us')} {v:.1f}" for k, v in row.items()
                                                          if k.endswith("_us")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
