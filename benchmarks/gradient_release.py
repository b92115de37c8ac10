"""Peak memory of a training step with and without gradient release (CPU or GPU).

A stack of ``--layers`` bias-free ``width x width`` linear layers (an eager model, batch 8, so
activations are negligible), prepared with 24-bit masters and 8-bit states, AdamW or SGD momentum;
one warm-up step (compiles), then the measured steps.

- GPU: ``torch.cuda.max_memory_allocated`` during the measured steps, less what was allocated
  before the model was built.
- CPU (no allocator statistics): storage-based, the bytes ``memory_report`` counts for weights,
  error terms and states plus the most gradient bytes alive at once, seen from post-accumulate-grad
  hooks registered before ``prepare``'s (they run while each gradient is complete, before it is
  released).

    python benchmarks/gradient_release.py --out benchmarks/results/gradient_release_h200.json
    python benchmarks/gradient_release.py --device cpu --layers 4 --width 256
"""

import argparse
import gc
import json
import platform
import statistics
import time

import torch
import torch.nn as nn

import flash_inductor

OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def _grad_bytes(params):
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def measure(device, optimizer, release, *, layers=16, width=2048, steps=3, compile_options=None):
    """One configuration's memory figures (bytes) and step times, as a dict."""
    cuda = device == "cuda"
    # Dynamo's cache holds a previous configuration's compiled steps, and they its tensors (bucket
    # optimizers' flat buffers are graph attributes): freed only by a reset, or they would count in
    # this configuration's baseline.
    torch._dynamo.reset()
    if cuda:
        gc.collect()  # a previous configuration's model and optimizer hold reference cycles (hooks)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # cuBLAS keeps a workspace per thread (32 MiB each on the H200: forward, and autograd's
        # backward thread) from its first matmul on: allocate both before the baseline.
        w = torch.ones(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        (w @ w).sum().backward()
        del w
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False, device=device) for _ in range(layers)])
    params = list(model.parameters())
    peak_live = [0]
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: peak_live.__setitem__(0, max(peak_live[0], _grad_bytes(params))))
    opt = OPTIMIZERS[optimizer](params)
    flash_inductor.prepare(model, opt, gradient_release=release, compile_options=compile_options)
    x = torch.randn(8, width, device=device, dtype=torch.bfloat16)

    def step():
        model(x).float().square().mean().backward()
        alive = sum(p.grad is not None for p in params)
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        return alive

    start = time.perf_counter()
    step()
    compile_seconds = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        peak_live[0] = 0
        start = time.perf_counter()
        alive = step()
        times.append(time.perf_counter() - start)
    report = flash_inductor.memory_report(model, opt)
    persistent = sum(v for k, v in report.bytes.items() if k != "grads")
    peak = torch.cuda.max_memory_allocated() - base if cuda else persistent + peak_live[0]
    numel = report.num_params
    return {
        "device": device, "optimizer": optimizer, "gradient_release": release, "params": numel,
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "largest_grad_bytes": max(p.numel() * p.element_size() for p in params),
        "persistent_bytes": persistent,
        "peak_live_grad_bytes": peak_live[0],
        "grads_alive_after_backward": alive,
        "report_grad_bytes": report.bytes["grads"],
        "peak_bytes": peak,
        "peak_bytes_per_param": peak / numel,
        "first_step_seconds": compile_seconds,
        "step_seconds": statistics.median(times),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    rows = [
        measure(args.device, opt, release, layers=args.layers, width=args.width, compile_options={"compiler": args.compiler})
        for opt in OPTIMIZERS for release in (False, True)
    ]
    kind = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "storage-based (see the docstring)"
    print(f"{args.layers} x Linear({args.width}, {args.width}), {rows[0]['params']:,} parameters, {args.device}; peak: {kind}")
    print(f"{'optimizer':9} {'release':7} {'peak MiB':>9} {'B/param':>8} {'grads MiB':>9} {'max live grads MiB':>18} "
          f"{'drop MiB':>9} {'step ms':>8}")
    for row in rows:
        without = next(r for r in rows if r["optimizer"] == row["optimizer"] and not r["gradient_release"])
        print(f"{row['optimizer']:9} {str(row['gradient_release']):7} {row['peak_bytes'] / 2**20:9.1f} "
              f"{row['peak_bytes_per_param']:8.3f} {row['grad_bytes'] / 2**20:9.1f} {row['peak_live_grad_bytes'] / 2**20:18.1f} "
              f"{(without['peak_bytes'] - row['peak_bytes']) / 2**20:9.1f} {row['step_seconds'] * 1e3:8.2f}")
    if args.out:
        meta = {"torch": torch.__version__, "machine": platform.node(), "layers": args.layers, "width": args.width,
                "compiler": args.compiler, "date": time.strftime("%Y-%m-%d")}
        if args.device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name()
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
