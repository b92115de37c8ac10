"""FP8 weight all-gather under FSDP2 against bf16 all-gathers: loss after N steps and bytes on the wire.

    python benchmarks/fp8_all_gather.py [--steps 100] [--ranks 2] [--compiler eager|inductor]

Starts ``--ranks`` gloo processes on the CPU. Each trains the same small FSDP2 model (``Net``: two
``fully_shard``-ed residual MLP blocks and a head in the root's group), prepared with a flashoptim AdamW
(24-bit masters, 8-bit states per shard), to fit a fixed random teacher on its own batches, three ways:

- ``bf16``: bf16 all-gathers, bf16 linears (what FSDP2 does with a prepared model);
- ``fp8_linears``: bf16 all-gathers, FP8 linears (``fp8="tensorwise"``);
- ``fp8_all_gather``: FP8 all-gathers (``fp8_all_gather=True``) and FP8 linears.

It prints the training loss (mean of the last 10 steps), the held-out loss after training (an eager
forward: there an FP8-gathered weight is used dequantized) and the bytes each rank sends in one
forward's all-gathers, measured by ``flash_inductor.collective_bytes.CollectiveBytes``, by collective.
``tests/test_fp8_all_gather.py`` runs the same code for a few steps.
"""

import argparse
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import flash_inductor
from flash_inductor.collective_bytes import CollectiveBytes

EAGER = {"compiler": "eager"}
FP8 = {"fp8": "tensorwise", "fp8_min_weight_numel": 0, "fp8_min_gemm_size": 0}
CONFIGS = {  # name -> backend options of the train step (the compiler is added)
    "bf16": {},
    "fp8_linears": FP8,
    "fp8_all_gather": dict(FP8, fp8_all_gather=True),
}
LR = 1e-2
BATCH, DIM, HIDDEN, OUT = 16, 64, 128, 32


class Block(nn.Module):
    """A fully_shard group of two FP8 weights, one with a bias (the group's all-gather then mixes e4m3
    and bf16 payloads)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    """Two blocks and a head in the root's group."""

    def __init__(self):
        super().__init__()
        self.block0, self.block1 = Block(), Block()
        self.head = nn.Linear(DIM, OUT, bias=False)

    def forward(self, x):
        # No loop over the blocks: a graph break (FSDP2's hooks) inside a loop makes Dynamo run the
        # rest of the frame uncompiled, and the head would not be an FP8 linear.
        return self.head(self.block1(self.block0(x)))


def prepared(model_cls, options, groups=(Block,), seed=0):
    """``model_cls()`` with each child of a type in ``groups`` and the root ``fully_shard``-ed, and its
    prepared AdamW; ``prepare_fp8`` when ``options`` ask for FP8 all-gathers."""
    torch.manual_seed(seed)
    model = model_cls()
    for module in model.children():
        if isinstance(module, groups):
            fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    if options.get("fp8_all_gather"):
        flash_inductor.prepare_fp8(model, **options)
    return model, opt


def device_of(model):
    """Where a model's shards live: FSDP2 puts them on the default mesh's device (the rank's GPU
    when there is one)."""
    return next(model.parameters()).device


def teacher():
    torch.manual_seed(123)
    net = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, OUT))
    for p in net.parameters():
        nn.init.normal_(p, std=0.3)
    return net


def batch(step, rank):
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1000 * step + rank))


def train(rank, options, steps):
    """``steps`` train steps of a Net on this rank's batches: the losses, the first step's output,
    and the loss on held-out data after training."""
    model, opt = prepared(Net, options)
    device = device_of(model)
    target = teacher().to(device)

    @torch.compile(backend="flashoptim", options=options)
    def step(x, y):
        out = model(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        return out, loss

    losses = []
    for i in range(steps):
        x = batch(i, rank).to(device)
        out, loss = step(x.bfloat16(), target(x).detach())
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if i == 0:
            first_out = out.detach()
    held_out = batch(10**6, rank).to(device)
    with torch.no_grad():
        held_out_loss = F.mse_loss(model(held_out.bfloat16()).float(), target(held_out))
    return {"losses": torch.stack(losses), "first_out": first_out, "held_out_loss": held_out_loss}


def forward_bytes(rank, options):
    """Bytes this rank sends, by collective, in the first forward of a Net (every group gathered once)."""
    model, _ = prepared(Net, options)
    with torch.no_grad(), CollectiveBytes() as sent:
        model(batch(0, rank).bfloat16().to(device_of(model)))
    return dict(sent.by_op)


def _worker(rank, args, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks)
    rows = {}
    for name, options in CONFIGS.items():
        torch._dynamo.reset()
        options = dict(options, compiler=args.compiler)
        rows[name] = {**train(rank, options, args.steps), "bytes": forward_bytes(rank, options)}
    if rank == 0:
        torch.save(rows, out_file)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--compiler", choices=["eager", "inductor"], default="eager")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, f"{tmp}/init", f"{tmp}/rows.pt"), nprocs=args.ranks)
        rows = torch.load(f"{tmp}/rows.pt")
    base = rows["bf16"]
    base_gather = base["bytes"]["all_gather_into_tensor"]
    print(f"{args.ranks} ranks (gloo, CPU), {args.steps} steps, compiler={args.compiler}, rank 0")
    print("| run | loss (last 10 steps) | held-out loss | vs bf16 | forward all-gather bytes | vs bf16 | other collectives |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        train_loss = row["losses"][-10:].mean().item()
        held_out = row["held_out_loss"].item()
        gather = row["bytes"]["all_gather_into_tensor"]
        other = ", ".join(f"{op} {b:,.0f}" for op, b in row["bytes"].items() if op != "all_gather_into_tensor") or "-"
        print(f"| {name} | {train_loss:.4f} | {held_out:.4f} | {held_out / base['held_out_loss'].item():.4f} | "
              f"{gather:,.0f} | {gather / base_gather:.3f} | {other} |")
    same = torch.equal(rows["fp8_all_gather"]["losses"], rows["fp8_linears"]["losses"])
    print(f"fp8_all_gather losses equal fp8_linears' at every step: {same}")
    print("losses at steps 1, 10, 50, 100:", {name: [round(row["losses"][i].item(), 4) for i in (0, 9, 49, 99)
                                                      if i < len(row["losses"])] for name, row in rows.items()})


if __name__ == "__main__":
    main()
