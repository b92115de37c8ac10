"""Row-wise FP8's cast by columns in one kernel (``fp8_transpose.cast_by_columns_transposed``) against
the two it replaced, and the block shapes of its programs.

Row-wise scaling casts each operand that a GEMM sums over the rows by columns: the weight for the input
gradient's GEMM, the input and the output gradient for the weight gradient's. Before, that was a
reduction of Inductor's for each column's amax (a split reduction over the rows, then its finish) and
``fp8_transpose``'s ``transpose_kernel``, which casts as it transposes: the bf16 tensor read from memory
twice (``before`` below). Now one kernel does both: each program takes a block of columns, passes over
all their rows for the amax, computes the power-of-two scale, and passes again to cast and store the
block transposed. The second pass finds its rows in L2 when the programs running at once hold less
than L2, so the tensor is read from memory once.

On a GPU it checks the bits against ``before`` (compiled, as the model ran it) on the shapes of HF
Llama-1B's layer and on values that reach every case of the scale (zero columns, an inf, a nan, the
largest and smallest amaxes), then times both, the kernel at a few block shapes, and a plain cast of
the same tensor (one read, one write: the bound)::

    python benchmarks/fp8_column_cast.py --out benchmarks/results/fp8_column_cast_h200.json

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

from flash_inductor import fp8_linear, fp8_transpose
from flash_inductor.formats import fp8

# (rows, columns) cast by columns in one Llama-1B layer (8192 tokens): inputs and output gradients of
# 2048 and 5632 features, and the weights (N x K) whose columns the input gradient's GEMM sums over
SHAPES = [(8192, 2048), (8192, 5632), (5632, 2048), (2048, 5632), (2048, 2048)]
# (columns a program, rows a step of its loops, warps); the first is the default
BLOCKS = [(fp8_transpose.COLUMN_BLOCK, fp8_transpose.ROW_BLOCK, fp8_transpose.COLUMN_WARPS),
          (16, 512, 8), (32, 256, 4), (32, 128, 4), (64, 128, 8), (8, 512, 4)]


def before(t):
    """The cast by columns as ``fp8_linear._quantize_columns`` made it before: Inductor's column amax and
    scale, then ``transpose_fp8`` casting as it copies."""
    scale = fp8_linear._row_scales(t.t())
    return fp8_transpose.transpose_fp8(t, scale.t(), fp8.E4M3), fp8.inverse_scale(scale)


def cast_columns(t, block=BLOCKS[0]):
    out, scale = fp8_transpose._cast_by_columns(t, fp8.E4M3, block)
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


def check(shape, device, reference, product):
    """Bytes and inverse scales that differ from ``reference``'s: of the kernel, and of ``product``
    (``fp8_linear._quantize_columns``, compiled on a GPU: the op as Inductor launches it)."""
    t = _test_values(*shape, device)
    want, want_inv = reference(t)
    row = dict(shape=list(shape))
    for name, (got, got_inv) in (("kernel", cast_columns(t)), ("product", product(t))):
        row[f"{name}_differing_bytes"] = int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
        row[f"{name}_differing_scales"] = int((got_inv.view(torch.int32) != want_inv.view(torch.int32)).sum())
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
    product = fp8_linear._quantize_columns if interpreted else torch.compile(fp8_linear._quantize_columns)
    shapes = [(64, 48), (200, 40), (33, 17)] if interpreted else SHAPES
    results = dict(checks=[check(shape, device, reference, product) for shape in shapes], timings=[])
    for row in results["checks"]:
        print(f"{str(tuple(row['shape'])):>14}  differing from before: " + "  ".join(f"{k} {v}" for k, v in row.items()
                                                                                    if k != "shape"))
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
