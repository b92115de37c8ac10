"""First-step (compile) time of a prepared AdamW against the number of parameter tensors.

Each count runs in a fresh process with an empty Inductor cache, so every figure includes what a new
user pays: Dynamo tracing, the passes, Inductor's compile (C++ on the CPU, Triton on a GPU) and the
step itself. The flat step (flash_inductor/flat.py) traces one update per bucket, so the time should
not grow with the number of tensors.

    python benchmarks/compile_time.py --out benchmarks/results/compile_time_cpu.json            # CPU
    python benchmarks/compile_time.py --device cuda --shape 2048 --out compile_time_h200.json   # GPU
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time


def first_step(count, shape, device):
    import torch

    import flash_inductor

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, shape, device=device) * 0.02) for _ in range(count)]
    model = torch.nn.ParameterList(params)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    flash_inductor.prepare(model, opt)
    for p in params:
        p.grad = torch.randn_like(p)
    t0 = time.perf_counter()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return {"tensors": count, "shape": [shape, shape], "first_step_s": first, "second_step_s": time.perf_counter() - t0}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", default="4,16,64")
    parser.add_argument("--shape", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="compile_time.json")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(first_step(args.child, args.shape, args.device)))
        return
    rows = []
    for count in map(int, args.counts.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            out = subprocess.run([sys.executable, __file__, "--child", str(count), "--shape", str(args.shape),
                                  "--device", args.device], env=env, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{count:4d} tensors of {args.shape}x{args.shape} on {args.device}: first step {row['first_step_s']:6.1f} s, "
              f"then {row['second_step_s'] * 1e3:.2f} ms", flush=True)
    ratio = rows[-1]["first_step_s"] / rows[0]["first_step_s"]
    print(f"first step, {rows[-1]['tensors']} tensors / {rows[0]['tensors']}: {ratio:.2f}x")
    with open(args.out, "w") as f:
        json.dump({"info": {"python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}, "rows": rows,
                   "ratio_last_to_first": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
