"""Data-parallel training of our GPT (issue 17): DDP and FSDP2, bf16 vs FP8 gradient collectives.

    python benchmarks/distributed.py --config 124m --gpus all --steps 200 --out distributed_124m.json
    python benchmarks/distributed.py --config 1b --gpus all --steps 200 --out distributed_1b.json
    python benchmarks/distributed.py --device cpu --config tiny --steps 5          # CPU smoke run (gloo)

Starts one process per GPU (``--gpus all``: every GPU of the machine; NCCL, rank r on cuda:r) or
``--ranks`` gloo processes on the CPU, every one with NVLink multicast off
(``flash_inductor.launch``). Each trains ``benchmarks/train_gpt.py``'s GPT at ``--config`` with a
prepared AdamW (24-bit split masters, 8-bit states; on GPUs the Triton step) on the same batches:
step ``s`` takes ``--batch`` sequences per rank, rank r the r-th slice of the global batch. Rows:

    ddp_bf16         DDP, its python reducer traced by compiled autograd into the backend (bf16 all-reduces)
    ddp_fp8          the same with ``fp8_collectives=True``: the all-reduces send e4m3
    fsdp_bf16        FSDP2 (``fully_shard`` per block and the root), bf16 all-gathers and reduce-scatters
    fsdp_fp8         the same with ``fp8_collectives=True``: FSDP2's reduce-scatter runs eagerly, in no
                     graph (docs/architecture.md), so nothing is rewritten (``fp8_rewrites`` 0) until
                     FSDP2's collectives are traced; the row is there to show that
    single           one process, the global batch as ``ranks`` accumulated micro-batches: the loss reference

Per row (JSON ``--out`` and a printed table): median step time after ``--warmup`` steps, tokens/s
(global), bytes rank 0 sends in one step measured by ``flash_inductor.collective_bytes.CollectiveBytes``
(by collective), the FP8 collectives rewritten, peak memory per GPU (largest over ranks), the
optimizer-side bytes per parameter of a rank's shard (``memory_report``: weights, error terms,
states, scales, gradients; largest over ranks), and the loss: the ranks' mean over the last 10
steps and at the last step, and its ratio to the single run's. ``--rows`` picks rows (e.g. only
``single``, to run the reference on its own within a time limit).
"""

import argparse
import gc
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import flash_inductor
from flash_inductor import launch
from flash_inductor.collective_bytes import CollectiveBytes
from flash_inductor.passes import fp8_collectives

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_gpt import GPT, SIZES, batch, lm_loss, load_corpus, train_starts  # noqa: E402

ROWS = {  # name -> (data-parallel engine, fp8_collectives)
    "ddp_bf16": ("ddp", False),
    "ddp_fp8": ("ddp", True),
    "fsdp_bf16": ("fsdp", False),
    "fsdp_fp8": ("fsdp", True),
    "single": ("single", False),
}


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _model_and_optimizer(engine, args, device):
    cfg = SIZES[args.config][0]
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if engine == "fsdp":  # one dtype per group: each LayerNorm (stays fp32), each block, the root
        for module in [m for m in model.modules() if isinstance(m, nn.LayerNorm)] + list(model.blocks) + [model]:
            fully_shard(module)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr or SIZES[args.config][2], betas=(0.9, 0.95),
                            weight_decay=0.1)
    flash_inductor.prepare(model, opt, compile_options={"compiler": args.compiler})
    return model, opt


def _run_row(name, rank, world, args, corpus, device):
    """Trains one row on this rank of ``world`` (whose global batch the single row takes alone);
    returns its measurements (this rank's bytes, memory and the ranks' mean loss)."""
    engine, fp8 = ROWS[name]
    torch._dynamo.reset()
    gc.collect()  # the previous row's model and optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, opt = _model_and_optimizer(engine, args, device)
    forward = nn.parallel.DistributedDataParallel(model) if engine == "ddp" else model
    compiled_backward = torch.compile(backend="flashoptim", options={"fp8_collectives": fp8, "compiler": args.compiler})
    seq = SIZES[args.config][0].seq
    starts = train_starts(len(corpus.train), args.steps, args.batch * world, seq, seed=0)
    pieces = 1 if engine != "single" else world  # the single run accumulates the ranks' slices

    def step(s):
        rows = starts[s] if engine == "single" else starts[s].chunk(world)[rank]
        total = torch.zeros((), device=device)
        for piece in rows.chunk(pieces):
            x, y = (t.to(device) for t in batch(corpus.train, piece, seq))  # the corpus stays in host memory
            loss = lm_loss(forward, x, y) / pieces
            if engine != "ddp":  # FSDP2's hooks under compiled autograd trained wrongly on the CPU (issue 17 notes)
                loss.backward()
            else:
                with torch._dynamo.compiled_autograd._enable(compiled_backward):
                    loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return total

    states_before = set(fp8_collectives.states())
    losses, times, sent = [], [], None
    for s in range(args.steps):
        _synchronize(device)
        t0 = time.perf_counter()
        if s == min(args.warmup, args.steps - 1) and engine != "single":
            with CollectiveBytes() as counted:
                losses.append(step(s))
            sent = dict(counted.by_op)
        else:
            losses.append(step(s))
        _synchronize(device)
        times.append(time.perf_counter() - t0)
    losses = torch.stack(losses).float()
    if engine != "single":  # the global batch's loss: the mean of the ranks'
        dist.all_reduce(losses)
        losses /= world
    report = flash_inductor.memory_report(None, opt)  # FSDP2 may hold the root unsharded here
    timed = times[args.warmup:] or times
    return {
        "step_s": statistics.median(timed),
        "first_step_s": times[0],
        "tokens_per_s": args.batch * world * seq / statistics.median(timed),
        "bytes_sent": sent,
        "bytes_sent_total": None if sent is None else sum(sent.values()),
        "fp8_rewrites": len(set(fp8_collectives.states()) - states_before),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "optimizer_bytes_per_param": report.total_per_param,
        "optimizer_bytes": report.bytes,
        "shard_params": report.num_params,
        "losses": losses.tolist(),
    }


def _worker(rank, processes, world, args, tmp, rows, tag):
    """Runs ``rows`` in one of ``processes`` ranks; ``world``: the ranks whose global batch a step takes."""
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch._dynamo.config.optimize_ddp = "python_reducer"  # DDP's all-reduces in the compiled backward
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/init_{tag}",
                            rank=rank, world_size=processes)
    corpus = load_corpus()
    results = {}
    for name in rows:
        result = _run_row(name, rank, world, args, corpus, device)
        gathered = [None] * processes
        dist.all_gather_object(gathered, {k: result[k] for k in ("peak_memory_bytes", "optimizer_bytes_per_param")})
        for key in ("peak_memory_bytes", "optimizer_bytes_per_param"):
            values = [g[key] for g in gathered]
            result[key] = None if None in values else max(values)
        results[name] = result
    if rank == 0:
        torch.save(results, f"{tmp}/{tag}.pt")
    dist.destroy_process_group()


def _table(results, args, world):
    single = results.get("single")
    where = f"{world} x {torch.cuda.get_device_name(0)} (NCCL)" if args.device == "cuda" else f"{world} ranks (gloo, CPU)"
    lines = [f"GPT {args.config}, {where}, {args.batch} sequences per rank, {args.steps} steps, compiler={args.compiler}",
             "| row | step ms (median) | tokens/s | bytes sent/rank/step | vs bf16 | fp8 rewrites | peak GiB/GPU "
             "| optimizer B/param (shard) | loss (last 10) | vs single |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        engine = ROWS[name][0]
        bf16 = results.get(f"{engine}_bf16", {}).get("bytes_sent_total")
        sent = r["bytes_sent_total"]
        loss = statistics.mean(r["losses"][-10:])
        cells = [
            name, f"{r['step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
            "-" if sent is None else f"{sent:,.0f}",
            f"{sent / bf16:.3f}" if sent is not None and bf16 else "-",
            str(r["fp8_rewrites"]),
            "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.2f}",
            f"{r['optimizer_bytes_per_param']:.3f}", f"{loss:.4f}",
            f"{loss / statistics.mean(single['losses'][-10:]):.4f}" if single else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(SIZES), default="tiny")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpus", default="all", help="GPUs (ranks) to use with --device cuda: a number or 'all'")
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes with --device cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing; bytes are counted on the next")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank (default: train_gpt.py's batch)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--compiler", choices=["inductor", "eager"], default=None,
                        help="default: inductor on GPUs, eager (no kernel compile) on the CPU")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows of " + ", ".join(ROWS))
    parser.add_argument("--out", default=None, help="JSON file")
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU here; use --device cpu for the gloo smoke run")
        world = torch.cuda.device_count() if args.gpus == "all" else int(args.gpus)
    else:
        world = args.ranks
    args.batch = args.batch or SIZES[args.config][1]
    args.compiler = args.compiler or ("inductor" if args.device == "cuda" else "eager")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        parallel = [r for r in rows if r != "single"]
        if parallel:
            launch.spawn(_worker, (world, world, args, tmp, parallel, "parallel"), nprocs=world)
            results.update(torch.load(f"{tmp}/parallel.pt"))
        if "single" in rows:  # one process (a process group of 1), the global batch of `world` ranks
            launch.spawn(_worker, (1, world, args, tmp, ["single"], "single"), nprocs=1)
            results.update(torch.load(f"{tmp}/single.pt"))
    print(_table(results, args, world))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"config": args.config, "device": args.device, "ranks": world,
                                                      "batch_per_rank": args.batch, "steps": args.steps,
                                                      "compiler": args.compiler, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
