"""FP8 linear benchmark (issue 4): forward + backward of linear layers and of a transformer block.

In one process, for each shape (tokens x in_features -> out_features), these peers:

    bf16        nn.Linear in bf16, torch.compile (Inductor)
    flashoptim  the same module through backend="flashoptim" with fp8="tensorwise"
    flashoptim_fast_accum  the same with fp8_fast_accum=True (torchao's forward accumulation mode)
    flashoptim_delayed  the same with fp8="delayed" (amax histories of 16)
    bf16_cudagraphs, flashoptim_fast_accum_cudagraphs  CUDA-graphed (mode="reduce-overhead";
                cudagraphs=True), run when named in --peers
    flashoptim_delayed_fast_accum  delayed scaling and fp8_fast_accum=True
    flashoptim_rowwise, flashoptim_rowwise_fast_accum  fp8="rowwise" (a power-of-two scale per row,
                every operand e4m3), without and with fp8_fast_accum
    torchao     torchao.float8.convert_to_float8_training (tensorwise) + torch.compile, when
                torchao is installed (benchmark only; not a project dependency)
    torchao_rowwise  the same with torchao's "rowwise" recipe

Times are medians of ``triton.testing.do_bench`` over ``y = f(x); y.backward(dy)``; the SQNR of
the output and of both gradients against the bf16 layer (same inputs) is measured in the same run,
and each row lists its ten largest GPU kernels of one forward + backward (``torch.profiler``).
The block rows time one pre-norm transformer block (attention + MLP, ``benchmarks/train_gpt.py``'s
``Block``) the same way.

    python benchmarks/fp8_linear.py --out benchmarks/results/fp8_linear_h200.json
    python benchmarks/fp8_linear.py --smoke          # tiny shapes, CPU, no timing claims
    python benchmarks/fp8_linear.py --shapes 4096x1024x2816,8192x2048x5632 --blocks none --peers bf16,flashoptim
"""

import argparse
import copy
import json
import pathlib
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn

from flash_inductor.formats import fp8

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gpu_profile import kernel_times  # noqa: E402
from train_gpt import Block, GPTConfig  # noqa: E402

LINEAR_SHAPES = [  # (tokens, in_features, out_features): DESIGN.md's anchor shapes
    (16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (8192, 8192, 8192),
]
BLOCK_SHAPES = [(8, 1024, 4096, 32)]  # (batch, seq, dim, heads)
SMOKE_LINEAR_SHAPES = [(64, 64, 128)]
SMOKE_BLOCK_SHAPES = [(2, 32, 64, 4)]


def flashoptim(**options):
    """The module through backend="flashoptim" with these FP8 options (every linear eligible)."""
    import flash_inductor

    return lambda module: flash_inductor.compile(module, fp8_min_weight_numel=0, fp8_min_gemm_size=0, **options)


def inductor(module):
    return torch.compile(module)


def torchao_float8(recipe):
    def convert(module):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        return torch.compile(convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe)))

    return convert


PEERS = {
    "bf16": inductor,
    "bf16_cudagraphs": lambda module: torch.compile(module, mode="reduce-overhead"),
    "flashoptim": flashoptim(fp8="tensorwise"),
    "flashoptim_fast_accum": flashoptim(fp8="tensorwise", fp8_fast_accum=True),
    "flashoptim_fast_accum_cudagraphs": flashoptim(fp8="tensorwise", fp8_fast_accum=True, cudagraphs=True),
    "flashoptim_delayed": flashoptim(fp8="delayed"),
    "flashoptim_delayed_fast_accum": flashoptim(fp8="delayed", fp8_fast_accum=True),
    "flashoptim_rowwise": flashoptim(fp8="rowwise"),
    "flashoptim_rowwise_fast_accum": flashoptim(fp8="rowwise", fp8_fast_accum=True),
    "torchao": torchao_float8("tensorwise"),
    "torchao_rowwise": torchao_float8("rowwise"),
}


def time_ms(fn, smoke):
    if smoke:  # CPU: a few wall-clock repeats, only to check the script runs
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def fwd_bwd(module, x, dy):
    """Forward + backward once; returns (output, dx, gradients of the parameters)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad for p in module.parameters()]


def measure(name, make_module, x, dy, smoke):
    """Compile ``make_module()`` through peer ``name``; time it; its outputs for the SQNR."""
    torch._dynamo.reset()
    module = PEERS[name](make_module())
    t0 = time.perf_counter()
    # Copies: a CUDA-graphed peer's next replay overwrites its outputs.
    out = torch.utils._pytree.tree_map(torch.clone, fwd_bwd(module, x, dy))
    compile_s = time.perf_counter() - t0
    ms = time_ms(lambda: fwd_bwd(module, x, dy), smoke)
    kernels = [] if smoke else kernel_times(lambda: fwd_bwd(module, x, dy), top=10)
    return {"ms": ms, "compile_s": compile_s, "kernels": kernels}, out


def sqnr(reference, approx):
    y_ref, dx_ref, grads_ref = reference
    y, dx, grads = approx
    return {"sqnr_out_db": fp8.sqnr_db(y_ref, y).item(), "sqnr_dx_db": fp8.sqnr_db(dx_ref, dx).item(),
            "sqnr_dw_min_db": min(fp8.sqnr_db(a, b).item() for a, b in zip(grads_ref, grads) if a is not None)}


def run_case(kind, shape, make_module, make_input, peers, smoke):
    x = make_input()
    y = make_module()(x)
    dy = torch.randn_like(y)
    rows, outs = [], {}
    for name in peers:
        try:
            result, outs[name] = measure(name, make_module, x, dy, smoke)
        except Exception as exc:  # a peer that fails here is reported, not fatal
            print(f"{kind} {shape} {name}: failed: {type(exc).__name__}: {exc}"[:400], flush=True)
            continue
        rows.append(dict(kind=kind, shape=list(shape), peer=name, **result))
    for row in rows:
        row["speedup_vs_bf16"] = rows[0]["ms"] / row["ms"] if rows[0]["peer"] == "bf16" else None
        if row["peer"] != "bf16" and "bf16" in outs:
            row.update(sqnr(outs["bf16"], outs[row["peer"]]))
    for row in rows:
        extra = "  ".join(f"{k} {row[k]:.1f}" for k in ("sqnr_out_db", "sqnr_dx_db", "sqnr_dw_min_db") if k in row)
        speedup = f"{row['speedup_vs_bf16']:.2f}x" if row["speedup_vs_bf16"] else "-"
        print(f"{kind:6s} {str(shape):24s} {row['peer']:29s} {row['ms']:9.3f} ms  {speedup:>6s}  "
              f"compile {row['compile_s']:5.1f} s  {extra}", flush=True)
        for kernel in row["kernels"]:
            print(f"    {kernel}", flush=True)
    return rows


def _shapes(text):
    """``"4096x1024x2816,..."`` -> [(4096, 1024, 2816), ...]; ``"none"`` -> []."""
    return [] if text == "none" else [tuple(int(d) for d in shape.split("x")) for shape in text.split(",")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="fp8_linear.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, not speed")
    parser.add_argument("--peers", default=",".join(p for p in PEERS if "cudagraphs" not in p))
    parser.add_argument("--shapes", default=None, type=_shapes, help="linears as TOKENSxINxOUT,... (default: the anchor shapes)")
    parser.add_argument("--blocks", default=None, type=_shapes, help="blocks as BATCHxSEQxDIMxHEADS,... or none")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    peers = args.peers.split(",")
    try:
        import torchao
        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
        peers = [p for p in peers if not p.startswith("torchao")]
        print("torchao not installed: its rows are skipped")
    info = dict(torch=torch.__version__, torchao=torchao_version, python=platform.python_version(),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu", date=time.strftime("%Y-%m-%d"))
    rows = []
    for tokens, k, n in args.shapes or (SMOKE_LINEAR_SHAPES if args.smoke else LINEAR_SHAPES):
        torch.manual_seed(0)
        base = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        rows += run_case("linear", (tokens, k, n), lambda: copy.deepcopy(base),
                         lambda: torch.randn(tokens, k, device=device, dtype=torch.bfloat16), peers, args.smoke)
        _write(args.out, info, rows)
    for batch, seq, dim, heads in args.blocks if args.blocks is not None else (
            SMOKE_BLOCK_SHAPES if args.smoke else BLOCK_SHAPES):
        torch.manual_seed(0)
        base = Block(GPTConfig(layers=1, dim=dim, heads=heads, seq=seq)).to(device, torch.bfloat16)
        rows += run_case("block", (batch, seq, dim, heads), lambda: copy.deepcopy(base),
                         lambda: torch.randn(batch, seq, dim, device=device, dtype=torch.bfloat16), peers, args.smoke)
        _write(args.out, info, rows)
    print(f"wrote {args.out}")


def _write(path, info, rows):
    with open(path, "w") as f:  # after every case: a run cut short keeps what it measured
        json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
