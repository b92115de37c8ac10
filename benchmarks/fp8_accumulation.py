"""How precisely ``torch._scaled_mm`` accumulates, and how fast it is, per scaling and accumulation mode.

For tensorwise scaling (one scale per operand, cuBLASLt) and row-wise scaling (a scale per row of
each operand, torch's CUTLASS kernel on sm90), each with ``use_fast_accum`` off and on:

- accumulation: random e4m3 operands (M = N = 1024) for each K, the bf16 output against the fp64
  product of the same fp8 values. The error a correct bf16 rounding allows (half a bf16 ulp of the
  result) is taken off, and what remains is divided by the products' magnitude ``|a| @ |b|``: the
  partial sums' lost bits. fp32 accumulation would leave at most K x 2^-24 of it (2^-18 at K = 64);
  FP8 tensor cores keep fewer bits between promotions to fp32.
- speed: median milliseconds of one GEMM at the Llama ~1B's shapes (8192 tokens), with bf16 ``mm``
  beside them.

    python benchmarks/fp8_accumulation.py --out benchmarks/results/fp8_accumulation_h200.json
"""

import argparse
import json
import math

import torch
import triton.testing

E4M3 = torch.float8_e4m3fn


def operands(m, k, n, generator):
    """Random e4m3 ``a`` (m x k, row-major) and ``b`` (k x n, column-major), values of a normal."""
    a = torch.randn(m, k, device="cuda", generator=generator).to(E4M3)
    b = torch.randn(n, k, device="cuda", generator=generator).to(E4M3).t()
    return a, b


def scaled_mm(a, b, rowwise, fast_accum):
    """``a @ b`` in bf16 with unit scales, one per tensor or one per row of each operand."""
    if rowwise:
        sa = torch.ones(a.shape[0], 1, device="cuda")
        sb = torch.ones(1, b.shape[1], device="cuda")
    else:
        sa = sb = torch.ones((), device="cuda")
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


MODES = {f"{scaling}{'_fast_accum' if fast else ''}": (scaling == "rowwise", fast)
         for scaling in ("tensorwise", "rowwise") for fast in (False, True)}


def accumulation_error(k, generator):
    """``{mode: (max, 99.9th percentile) of the excess error over the magnitude, as log2}`` for one K."""
    a, b = operands(1024, k, 1024, generator)
    exact = a.double() @ b.double()
    magnitude = a.double().abs() @ b.double().abs()
    half_ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=2.0**-133))) - 8)  # of bf16
    row = {}
    for mode, (rowwise, fast) in MODES.items():
        error = (scaled_mm(a, b, rowwise, fast).double() - exact).abs()
        excess = ((error - half_ulp).clamp(min=0) / magnitude).flatten()
        worst = excess.max().item()
        p999 = excess.kthvalue(int(0.999 * excess.numel())).values.item()
        row[mode] = [math.log2(v) if v > 0 else None for v in (worst, p999)]
    return row


def gemm_ms(m, k, n, generator):
    a, b = operands(m, k, n, generator)
    times = {mode: triton.testing.do_bench(lambda: scaled_mm(a, b, *flags), return_mode="median")
             for mode, flags in MODES.items()}
    ab, bb = a.bfloat16(), b.bfloat16()
    times["bf16"] = triton.testing.do_bench(lambda: ab @ bb, return_mode="median")
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="64,128,256,512,1024,2048,4096,8192")
    parser.add_argument("--shapes", default="8192x2048x2048,8192x2048x5632,8192x5632x2048,8192x2048x512")
    parser.add_argument("--out")
    args = parser.parse_args()
    generator = torch.Generator("cuda").manual_seed(0)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, accumulation={}, gemm_ms={})
    print("excess error / magnitude, log2 (max, 99.9th percentile); fp32 accumulation: at most log2(K) - 24")
    print(f"{'K':>6}  " + "  ".join(f"{mode:>26}" for mode in MODES))
    for k in map(int, args.ks.split(",")):
        row = result["accumulation"][k] = accumulation_error(k, generator)
        print(f"{k:>6}  " + "  ".join(f"{v[0] or -99:>12.1f} {v[1] or -99:>12.1f} " for v in row.values()))
    print(f"\nmedian ms per GEMM (tokens x in -> out)\n{'shape':>16}  " + "  ".join(f"{m:>22}" for m in [*MODES, "bf16"]))
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        times = result["gemm_ms"][shape] = gemm_ms(m, k, n, generator)
        print(f"{shape:>16}  " + "  ".join(f"{t:>22.3f}" for t in times.values()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
