"""Bytes each rank sends per training step for its gradients: fp32, bf16, and FP8 collectives.

    python benchmarks/collective_bytes.py [--ranks 2] [--compiler eager|inductor]

Starts ``--ranks`` gloo processes on the CPU. Each trains a small MLP under DDP with the python
reducer traced by compiled autograd (``optimize_ddp="python_reducer"``: the gradient all-reduces
are in the backward graph the backend compiles) and counts, with
``flash_inductor.collective_bytes.CollectiveBytes``, the bytes rank 0 sends during one step after a
warm-up step. Byte counts are ring-algorithm bytes per rank (see that module), so they do not depend
on ``--compiler``; ``eager`` only skips Inductor's kernel compile.
"""

import argparse
import tempfile

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


def _model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(dtype)


def _bytes_per_step(rank, dtype, fp8, compiler):
    torch._dynamo.reset()
    model = _model(dtype)
    ddp = nn.parallel.DistributedDataParallel(model)
    backend = torch.compile(backend="flashoptim", options={"fp8_collectives": fp8, "compiler": compiler})
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank)).to(dtype)
    with torch._dynamo.compiled_autograd._enable(backend):
        ddp(x).float().pow(2).mean().backward()  # warm-up: compiles
        model.zero_grad()
        with CollectiveBytes() as sent:
            ddp(x).float().pow(2).mean().backward()
    return sent.total, dict(sent.by_op), sum(p.numel() for p in model.parameters())


def _worker(rank, world, compiler, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch._dynamo.config.optimize_ddp = "python_reducer"
    rows = [(name, *_bytes_per_step(rank, dtype, fp8, compiler)) for name, dtype, fp8 in CONFIGS]
    if rank == 0:
        torch.save(rows, out_file)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--compiler", choices=["eager", "inductor"], default="eager")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.ranks, args.compiler, f"{tmp}/init", f"{tmp}/rows.pt"), nprocs=args.ranks)
        rows = torch.load(f"{tmp}/rows.pt")
    by_name = {name: total for name, total, _, _ in rows}
    bf16, fp32 = by_name["bf16 gradients"], by_name["fp32 gradients"]
    print(f"{args.ranks} ranks (gloo, CPU), {rows[0][3]:,} parameters in 4 tensors, bytes rank 0 sends per step")
    print("| gradients | bytes/step | B/param | vs bf16 | vs fp32 | by collective |")
    print("|---|---|---|---|---|---|")
    for name, total, by_op, params in rows:
        ops = ", ".join(f"{op} {b:,}" for op, b in by_op.items())
        print(f"| {name} | {total:,} | {total / params:.3f} | {total / bf16:.3f} | {total / fp32:.3f} | {ops} |")


if __name__ == "__main__":
    main()
