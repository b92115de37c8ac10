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
each looping over all rows twice: on an H100 it was slower than the two kernels on most shapes, and
the Llama cut to 2 layers ran 18.9 ms a step with it against 17.6 without
(``fp8_column_cast_h100.log``, ``hf_clients_llama2l_rowwise_profile_bycolumns_h100.log``).

On a GPU it checks the bits against ``before`` (compiled, as the model runs it) on the shapes of HF
Llama-1B's layer and on values that reach every case of the scale (zero columns, an inf, a nan, the
largest and smallest amaxes), then times both, the kernel at a few block shapes, and a plain cast of
the same tensor (one read, one write: the bound), each in a CUDA graph with L2 emptied before every
call::

    python benchmarks/fp8_column_cast.py --out benchmarks/results/fp8_column_cast_h100.json

On a machine without a GPU, ``TRITON_INTERPRET=1 python benchmarks/fp8_column_cast.py --check-only``
runs the kernel in Triton's interpreter on small shapes against the CPU's cast: the scales must match
bit for bit; of the bytes, those of nans and infs and of values halfway between two e4m3 values differ,
as the interpreter's own conversion to fp8 does not round to nearest even (3.125 gives 3.25, where
torch's cast and the GPU's ``cvt.rn`` give 3.0).
"""

import argparse
import functools
import json
import os
import statistics

import torch

from flash_inductor import fp8_linear
from flash_inductor.formats import fp8

# (rows, columns) cast by columns in one Llama-1B layer (8192 tokens): inputs and output gradients of
# 2048 and 5632 features, and the weights (N x K) whose columns the input gradient's GEMM sums over
SHAPES = [(8192, 2048), (8192, 5632), (5632, 2048), (2048, 5632), (2048, 2048)]
# (columns a program, rows a step of its loops, warps)
BLOCKS = [(16, 256, 4), (16, 512, 8), (32, 256, 4), (32, 128, 4), (64, 128, 8), (8, 512, 4)]
before = fp8_linear._quantize_columns


@functools.cache
def _cast_by_columns_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_by_columns_kernel(src, dst, scales, rows, cols, MAX_EXPONENT: tl.constexpr, MANTISSA_OF_1_75: tl.constexpr,
                               FLOOR: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_cols = c < cols
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        has_nan = tl.zeros([BLOCK_C], dtype=tl.int32)
        for r0 in range(0, rows, BLOCK_R):  # the columns' amax; their rows stay in L2 for the second pass
            r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            inside = (r[:, None] < rows) & in_cols[None, :]
            x = tl.load(src + r[:, None] * cols + c[None, :], mask=inside, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
            has_nan = tl.maximum(has_nan, tl.max((x != x).to(tl.int32), axis=0))
        # formats.fp8.scale_from_amax(amax, power_of_two=True), its formula on the bits of max(amax, AMAX_FLOOR)
        # (_power_of_two_scale): no division; an infinite amax gives 0 and a nan gives nan
        a = tl.maximum(amax, FLOOR)
        bits = a.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) & 0xFF
        above_1_75 = ((bits & 0x7FFFFF) > MANTISSA_OF_1_75).to(tl.int32)
        scale = ((2 * 127 + MAX_EXPONENT - exponent - above_1_75) << 23).to(tl.float32, bitcast=True)
        scale = tl.where(exponent == 0xFF, 0.0, scale)
        scale = tl.where(has_nan > 0, float("nan"), scale)
        tl.store(scales + c, scale, mask=in_cols)
        for r0 in range(0, rows, BLOCK_R):
            r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            inside = (r[:, None] < rows) & in_cols[None, :]
            x = tl.load(src + r[:, None] * cols + c[None, :], mask=inside, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            # rounded as transpose_kernel rounds (cvt.rn.satfinite)
            y = (x * scale[None, :]).to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(dst + c[None, :].to(tl.int64) * rows + r[:, None], y, mask=inside)

    return cast_by_columns_kernel


def _cast_by_columns(t, dtype, block):
    columns, step, warps = block
    rows, cols = t.shape
    out = torch.empty((cols, rows), dtype=dtype, device=t.device)
    scales = torch.empty((cols,), dtype=torch.float32, device=t.device)
    _cast_by_columns_kernel()[(-(-cols // columns),)](
        t, out, scales, rows, cols, MAX_EXPONENT=fp8._MAX_EXPONENT[dtype], MANTISSA_OF_1_75=fp8._MANTISSA_OF_1_75,
        FLOOR=fp8.AMAX_FLOOR, BLOCK_C=columns, BLOCK_R=step, num_warps=warps)
    return out, scales


def cast_columns(t, block=BLOCKS[0]):
    """``before(t)``'s ``(t cast by columns in e4m3, transposed; the inverse scales (cols, 1))`` in one kernel."""
    out, scale = _cast_by_columns(t, fp8.E4M3, block)
    return out, fp8.inverse_scale(scale[:, None])


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


def check(shape, device, reference):
    """Bytes and inverse scales of the kernel that differ from ``reference``'s (nan scales equal)."""
    t = _test_values(*shape, device)
    want, want_inv = reference(t)
    got, got_inv = cast_columns(t)
    same_scale = (got_inv == want_inv) | (got_inv.isnan() & want_inv.isnan())
    return dict(shape=list(shape), differing_bytes=int((got.view(torch.uint8) != want.view(torch.uint8)).sum()),
                differing_scales=int((~same_scale).sum()))


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


def _median_us(fn, calls=20):
    """GPU µs of one call of ``fn`` with L2 emptied before it (a 256 MiB write, timed alone and taken
    off), as a tensor a kernel before it wrote in the model is partly in L2 and partly not."""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    for _ in range(3):  # (compiled, autotuned, allocated before capture)
        fn()
    torch.cuda.synchronize()
    flushed = _graph_us(lambda: (flush.zero_(), fn()), calls)
    return (flushed - _graph_us(flush.zero_, calls)) / calls


def time_shape(shape):
    t = torch.randn(shape, device="cuda").to(torch.bfloat16)
    compiled_before = torch.compile(before)
    plain_cast = torch.compile(lambda t: t.to(fp8.E4M3))  # one read of bf16, one write of e4m3
    row = dict(shape=list(shape), mb_bf16=t.numel() * 2 / 2**20, before_us=_median_us(lambda: compiled_before(t)),
               plain_cast_us=_median_us(lambda: plain_cast(t)))
    for block in BLOCKS:
        row[f"one_kernel_{block[0]}x{block[1]}w{block[2]}_us"] = _median_us(lambda: cast_columns(t, block))
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
    results = dict(checks=[check(shape, device, reference) for shape in shapes], timings=[])
    for row in results["checks"]:
        print(f"{str(tuple(row['shape'])):>14}  differing from before: bytes {row['differing_bytes']}, "
              f"scales {row['differing_scales']}")
    if not (args.check_only or interpreted):
        results["device"] = torch.cuda.get_device_name()
        for shape in SHAPES:
            row = time_shape(shape)
            results["timings"].append(row)
            print(f"{str(tuple(shape)):>14}  " + "  ".join(f"{k.removesuffix('_us')} {v:.1f}" for k, v in row.items()
                                                          if k.endswith("_us")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
