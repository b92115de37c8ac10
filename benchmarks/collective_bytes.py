"""Bytes each rank sends per training step for its gradients: fp32, bf16, and FP8 collectives.

    python benchmarks/collective_bytes.py [--ranks 2] [--compiler eager|inductor]
    python benchmarks/collective_bytes.py --device cuda --ranks 2 --model gpt --compiler inductor --steps 20

Starts ``--ranks`` processes (gloo on the CPU; NCCL with one GPU each for ``--device cuda``). Each
trains a model (a small MLP, or ``--model gpt``: ``benchmarks/train_gpt.py``'s GPT at
``--gpt-config``) under DDP with the python reducer traced by compiled autograd
(``optimize_ddp="python_reducer"``: the gradient all-reduces are in the backward graph the backend
compiles) and counts, with ``flash_inductor.collective_bytes.CollectiveBytes``, the bytes rank 0
sends during one backward after a warm-up step. Byte counts are ring-algorithm bytes per rank (see
that module), so they do not depend on ``--compiler``; ``eager`` only skips Inductor's kernel
compile. ``--steps N`` also times N forward + backward passes (median; on the CPU the times say
nothing about a GPU interconnect).
"""

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from flash_inductor.collective_bytes import CollectiveBytes

CONFIGS = [  # name, parameter dtype, fp8_collectives
    ("fp32 gradients", torch.float32, False),
    ("bf16 gradients", torch.bfloat16, False),
    ("bf16 gradients, fp8_collectives", torch.bfloat16, True),
]


def _model(kind, dtype, device, gpt_config):
    torch.manual_seed(0)
    if kind == "gpt":
        sys.path.insert(0, str(pathlib.Path(__file__).parent))
        from train_gpt import GPT, SIZES

        model = GPT(SIZES[gpt_config][0])
    else:
        model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    return model.to(device, dtype)


def _batch(kind, model, rank, dtype, device):
    gen = torch.Generator().manual_seed(rank)
    if kind == "gpt":
        seq = model.pos_embed.weight.shape[0]
        return torch.randint(0, 256, (4, seq), generator=gen).to(device)
    return torch.randn(32, 256, generator=gen).to(device, dtype)


def _loss(model, x):
    return model(x).float().pow(2).mean()


def _measure(rank, args, dtype, fp8):
    """(bytes rank 0 sends in one backward, by collective, parameters, median step seconds)."""
    torch._dynamo.reset()
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    model = _model(args.model, dtype, device, args.gpt_config)
    ddp = nn.parallel.DistributedDataParallel(model)
    backend = torch.compile(backend="flashoptim", options={"fp8_collectives": fp8, "compiler": args.compiler})
    x = _batch(args.model, model, rank, dtype, device)
    times = []
    with torch._dynamo.compiled_autograd._enable(backend):
        _loss(ddp, x).backward()  # warm-up: compiles
        model.zero_grad()
        with CollectiveBytes() as sent:
            _loss(ddp, x).backward()
        for _ in range(args.steps):
            model.zero_grad()
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            _loss(ddp, x).backward()
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    median = statistics.median(times) if times else None
    return sent.total, dict(sent.by_op), sum(p.numel() for p in model.parameters()), median


def _worker(rank, args, init_file, out_file):
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=args.ranks)
    torch._dynamo.config.optimize_ddp = "python_reducer"
    rows = [(name, *_measure(rank, args, dtype, fp8)) for name, dtype, fp8 in CONFIGS]
    if rank == 0:
        torch.save(rows, out_file)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--compiler", choices=["eager", "inductor"], default="eager")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    parser.add_argument("--gpt-config", default="tiny", help="a size of benchmarks/train_gpt.py (tiny, 124m, ...)")
    parser.add_argument("--steps", type=int, default=0, help="forward + backward passes to time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, f"{tmp}/init", f"{tmp}/rows.pt"), nprocs=args.ranks)
        rows = torch.load(f"{tmp}/rows.pt")
    by_name = {name: total for name, total, *_ in rows}
    bf16, fp32 = by_name["bf16 gradients"], by_name["fp32 gradients"]
    where = "NCCL, one GPU each" if args.device == "cuda" else "gloo, CPU"
    print(f"{args.ranks} ranks ({where}), {args.model}, {rows[0][3]:,} parameters, bytes rank 0 sends per step")
    print("| gradients | bytes/step | B/param | vs bf16 | vs fp32 | by collective | fwd+bwd ms (median) |")
    print("|---|---|---|---|---|---|---|")
    for name, total, by_op, params, step_s in rows:
        ops = ", ".join(f"{op} {b:,.0f}" for op, b in by_op.items())
        ms = "-" if step_s is None else f"{step_s * 1e3:.2f}"
        print(f"| {name} | {total:,.0f} | {total / params:.3f} | {total / bf16:.3f} | {total / fp32:.3f} | {ops} | {ms} |")


if __name__ == "__main__":
    main()
