"""Data parallel training with prepared optimizers: 2 processes on the CPU (gloo), started here."""

import contextlib
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor.formats import split_weights
from helpers import EAGER, Net, stored_bits

WORLD = 2
STEPS = 3
LR, MOMENTUM = 0.1, 0.9


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 128, generator=gen), torch.randn(16, 96, generator=gen)) for _ in range(STEPS)]


def _prepared():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    return model, opt


def _train(model, forward, opt, batches, shard, micro_batches=1, no_sync=None, max_norm=None):
    """Steps on ``shard(batch)``, accumulating gradients over ``micro_batches`` pieces of it (all
    but the last under ``no_sync``) and clipping them to ``max_norm``; returns the gradients each
    step used (for DDP: what it averaged)."""
    grads = []
    for x, y in batches:
        pieces = list(zip(shard(x).chunk(micro_batches), shard(y).chunk(micro_batches)))
        for i, (xs, ys) in enumerate(pieces):
            last = i == len(pieces) - 1
            with no_sync() if (no_sync is not None and not last) else contextlib.nullcontext():
                (F.mse_loss(forward(xs.bfloat16()).float(), ys) / micro_batches).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        grads.append({n: p.grad.float().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads


# Plain steps, and steps with 2 accumulated micro-batches and gradient clipping.
VARIANTS = {"plain": {}, "accumulate_and_clip": {"micro_batches": 2, "max_norm": 0.5}}


def _ddp_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results = {}
    for name, variant in VARIANTS.items():
        model, opt = _prepared()
        ddp = nn.parallel.DistributedDataParallel(model)
        grads = _train(model, ddp, opt, _batches(), lambda t: t.chunk(WORLD)[rank], no_sync=ddp.no_sync, **variant)
        results[name] = {"state": stored_bits(model, opt), "grads": grads}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ddp_worker, args=(f"{tmp}/init", tmp), nprocs=WORLD)
        return [torch.load(f"{tmp}/rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ranks_stay_in_sync_bit_for_bit(ddp_results, variant):
    first, second = (r[variant]["state"] for r in ddp_results)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ddp_matches_a_single_process_on_the_global_batch(ddp_results, variant):
    """Same masters up to what the gradients' rounding explains: DDP averages bf16 gradients of
    half batches, the single process computes the bf16 gradient of the whole batch."""
    model, opt = _prepared()
    single_grads = _train(model, model, opt, _batches(), lambda t: t, **VARIANTS[variant])
    single = stored_bits(model, opt)
    ddp = ddp_results[0][variant]
    for name, p in model.named_parameters():
        if name + ".error" not in single:
            continue
        # |master difference| <= lr * sum over steps of the momentum-accumulated gradient difference
        bound, velocity = 0.0, 0.0
        for g_ddp, g_single in zip(ddp["grads"], single_grads):
            velocity = MOMENTUM * velocity + (g_ddp[name] - g_single[name]).abs().max().item()
            bound += LR * velocity
        resolution = torch.exp2(split_weights.half_ulp_log2(single[name]).float()).max().item() / 127
        master_ddp = split_weights.decode(ddp["state"][name], ddp["state"][name + ".error"])
        master_single = split_weights.decode(single[name], single[name + ".error"])
        assert (master_ddp - master_single).abs().max().item() <= bound + 2 * resolution, name
        assert bound > 0  # the two runs really had different gradients to account for
