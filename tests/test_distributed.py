"""Data parallel training with prepared optimizers: 2 processes, started here: gloo on the CPU, and
NCCL on 2 GPUs (marked gpu; the prepared optimizers then step with Triton kernels).

One spawn runs every scenario: DDP and FSDP2 (``fully_shard``) training, and checkpoint round
trips through ``torch.distributed.checkpoint``; the tests compare what the ranks saved against
each other, against single-process runs and against the layout FSDP2 shards imply. FSDP2 on a
single rank (where a shard is the whole tensor) runs in this process, against unsharded runs.
"""

import contextlib
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import flash_inductor
from flash_inductor import roles
from flash_inductor.formats import split_weights
from flash_inductor.optim import Lion
from flash_inductor.pipeline import PassFailed
from helpers import BACKENDS, EAGER, Net, rank_device, run_ranks, step_options, stored_bits

WORLD = 2
STEPS = 3
LR, MOMENTUM = 0.1, 0.9


class UnevenNet(nn.Module):
    """All bf16, with dims FSDP2 cannot split evenly over 2 ranks: fc1.weight (33, 128) is 17 + 16
    rows (8-bit states), fc1.bias 17 + 16 elements."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(128, 33)
        self.fc2 = nn.Linear(33, 96, bias=False)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 128, generator=gen), torch.randn(16, 96, generator=gen)) for _ in range(STEPS)]


def _prepared(model_cls=Net, seed=0, fsdp=False, **prepare_kw):
    torch.manual_seed(seed)
    model = model_cls().to(rank_device())
    if fsdp:
        _shard_each_layer(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    flash_inductor.prepare(model, opt, compile_options=step_options(), **prepare_kw)
    return model, opt


def _my_part(rank):
    """This rank's piece of a global batch tensor, on its device."""
    return lambda t: t.chunk(WORLD)[rank].to(rank_device())


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, forward, opt, batches, shard, micro_batches=1, no_sync=None, max_norm=None):
    """Steps on ``shard(batch)``, accumulating gradients over ``micro_batches`` pieces of it (all
    but the last under ``no_sync``) and clipping them to ``max_norm``; returns the (whole)
    gradients each step used (for DDP and FSDP2: what they averaged)."""
    grads = []
    for x, y in batches:
        pieces = list(zip(shard(x).chunk(micro_batches), shard(y).chunk(micro_batches)))
        for i, (xs, ys) in enumerate(pieces):
            last = i == len(pieces) - 1
            with no_sync() if (no_sync is not None and not last) else contextlib.nullcontext():
                (F.mse_loss(forward(xs.bfloat16()).float(), ys) / micro_batches).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        grads.append({n: _full(p.grad).float().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return grads


def _whole_parameters(model, opt):
    """Parameters and error terms by name, whole (all-gathered from the shards under FSDP2)."""
    record = roles.PREPARED[opt]
    out = {}
    for name, p in model.named_parameters():
        out[name] = _full(p.detach()).clone()
        if record.error_term(p) is not None:
            out[name + ".error"] = _full(record.error_term(p)).clone()
    return out


def _shard_layout(model, opt):
    """What this rank stores per parameter: (dtype, shape) of its shard, of its error term's shard,
    and of each inner tensor of its states."""
    bits = stored_bits(model, opt)
    return {
        name: {k[len(name):]: (v.dtype, tuple(v.shape)) for k, v in bits.items() if k == name or k.startswith(name + ".")}
        for name, _ in model.named_parameters()
    }


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# name -> (model, training arguments): plain steps; steps with 2 accumulated micro-batches and
# gradient clipping; plain steps of a model FSDP2 shards unevenly (FSDP2 only).
VARIANTS = {
    "plain": (Net, {}),
    "accumulate_and_clip": (Net, {"micro_batches": 2, "max_norm": 0.5}),
    "uneven_shards": (UnevenNet, {}),
}
KINDS = ("ddp", "fsdp")
RUNS = [(kind, variant) for kind in KINDS for variant in VARIANTS if (kind, variant) != ("ddp", "uneven_shards")]
CHECKPOINT_FORMS = {"decoded": {}, "compressed": {"compressed_state_dict": True}}
# The compressed form of an unsharded optimizer is covered by tests/test_checkpoint.py.
CHECKPOINTS = [("ddp", "decoded"), ("fsdp", "decoded"), ("fsdp", "compressed")]


def _data_parallel_run(kind, rank, model_cls, train_kw):
    model, opt = _prepared(model_cls, fsdp=kind == "fsdp")
    result = {}
    if kind == "ddp":
        forward = nn.parallel.DistributedDataParallel(model)
        no_sync = forward.no_sync
    else:
        forward, no_sync = model, lambda: _fsdp_no_sync(model)
        result["layout"] = _shard_layout(model, opt)
        # What the forward computes with: FSDP2's all-gathered (unsharded) weight.
        seen = result["forward_weight"] = []
        model.fc1.register_forward_pre_hook(lambda m, args: seen.append((type(m.weight), m.weight.dtype)))
    result["grads"] = _train(model, forward, opt, _batches(), _my_part(rank), no_sync=no_sync, **train_kw)
    if kind == "ddp":
        result["state"] = stored_bits(model, opt)
        return result
    result["state"] = _whole_parameters(model, opt)
    result["masters"] = {k: _full(v) for k, v in flash_inductor.master_state_dict(model, opt).items()}
    flash_inductor.load_master_state_dict(model, opt, result["masters"])  # whole values: each rank keeps its shard
    result["masters_after_loading"] = {k: _full(v) for k, v in flash_inductor.master_state_dict(model, opt).items()}
    return result


def _checkpoint_round_trip(kind, rank, ckpt_dir, **prepare_kw):
    """Train, save model and optimizer with DCP, train on; load into freshly prepared objects (other
    initial weights) and train on the same way. Returns this rank's stored bits after both."""
    fsdp = kind == "fsdp"
    batches, shard = _batches(), _my_part(rank)

    def train(model, opt, batches):
        _train(model, model if fsdp else nn.parallel.DistributedDataParallel(model), opt, batches, shard)

    model, opt = _prepared(fsdp=fsdp, **prepare_kw)
    train(model, opt, batches[:2])
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)
    train(model, opt, batches[2:])

    resumed, resumed_opt = _prepared(seed=1, fsdp=fsdp, **prepare_kw)
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=ckpt_dir)
    set_state_dict(resumed, resumed_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    train(resumed, resumed_opt, batches[2:])
    return {"straight": stored_bits(model, opt), "resumed": stored_bits(resumed, resumed_opt)}


def _fsdp_compiled_train_step(rank):
    """The plain FSDP2 run, with the whole train step compiled through the backend."""
    model, opt = _prepared(fsdp=True)

    @torch.compile(backend="flashoptim", options=EAGER)
    def step(x, y):
        F.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()

    part = _my_part(rank)
    for x, y in _batches():
        step(part(x), part(y))
    return _whole_parameters(model, opt)


def _fsdp_gradient_release(rank):
    """The plain FSDP2 run with gradient release: each shard updated in its hook, after the
    reduce-scatter; the stored bits of the plain FSDP2 run, and no gradient left after backward."""
    model, opt = _prepared(fsdp=True, gradient_release=True)
    grads_left, part = [], _my_part(rank)
    for x, y in _batches():
        F.mse_loss(model(part(x).bfloat16()).float(), part(y)).backward()
        grads_left.append(sum(p.grad is not None for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    return {"state": _whole_parameters(model, opt), "grads_left": grads_left}


def _compressed_uneven_state_dict_error():
    _, opt = _prepared(UnevenNet, fsdp=True, compressed_state_dict=True)
    try:
        opt.state_dict()
    except ValueError as error:
        return str(error)
    return None


def _worker(rank, out_dir):
    warnings.simplefilter("error", PassFailed)  # a skipped rewrite would make the runs meaningless
    results = {}
    for kind, variant in RUNS:
        results[kind, variant] = _data_parallel_run(kind, rank, *VARIANTS[variant])
    for kind, form in CHECKPOINTS:
        results[kind, "checkpoint", form] = _checkpoint_round_trip(kind, rank, f"{out_dir}/{kind}_{form}", **CHECKPOINT_FORMS[form])
    results["fsdp", "compiled_train_step"] = _fsdp_compiled_train_step(rank)
    results["fsdp", "gradient_release"] = _fsdp_gradient_release(rank)
    results["compressed_uneven_error"] = _compressed_uneven_state_dict_error()
    return results


@pytest.fixture(scope="module", params=BACKENDS)
def results(request):
    return run_ranks(_worker, request.param, WORLD)


@pytest.mark.parametrize("variant", [v for k, v in RUNS if k == "ddp"])
def test_ddp_ranks_stay_in_sync_bit_for_bit(results, variant):
    first, second = (r["ddp", variant]["state"] for r in results)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize(("kind", "variant"), RUNS)
def test_matches_a_single_process_on_the_global_batch(results, kind, variant):
    """Same masters up to what the gradients' rounding explains: DDP and FSDP2 average bf16
    gradients of half batches, the single process computes the bf16 gradient of the whole batch."""
    model_cls, train_kw = VARIANTS[variant]
    model, opt = _prepared(model_cls)
    single_grads = _train(model, model, opt, _batches(), lambda t: t, **train_kw)
    single = stored_bits(model, opt)
    parallel = results[0][kind, variant]
    for name, p in model.named_parameters():
        if name + ".error" not in single:
            continue
        # |master difference| <= lr * sum over steps of the momentum-accumulated difference: of the
        # gradients, and of the two runs' 8-bit momentum codes (each within 2/127 of its group's
        # largest |buf|, the softsign's steepest code step; bounded here by the largest |buf|)
        bound, velocity, largest_buf = 0.0, 0.0, 0.0
        for g_parallel, g_single in zip(parallel["grads"], single_grads):
            largest_buf = MOMENTUM * largest_buf + g_single[name].abs().max().item()
            velocity = (MOMENTUM * velocity + (g_parallel[name] - g_single[name]).abs().max().item()
                        + 2 * 2 / 127 * largest_buf)
            bound += LR * velocity
        resolution = torch.exp2(split_weights.half_ulp_log2(single[name]).float()).max().item() / 127
        master_parallel = split_weights.decode(parallel["state"][name], parallel["state"][name + ".error"])
        master_single = split_weights.decode(single[name], single[name + ".error"])
        assert (master_parallel - master_single).abs().max().item() <= bound + 2 * resolution, name
        assert bound > 0  # the two runs really had different gradients to account for


def _rows(n, rank):
    """Rows of an n-row parameter on ``rank`` (FSDP2 shards dim 0 like torch.chunk)."""
    per_rank = -(-n // WORLD)
    return max(0, min(per_rank, n - rank * per_rank))


@pytest.mark.parametrize("variant", ["plain", "uneven_shards"])
def test_fsdp_keeps_error_terms_and_states_per_shard(results, variant):
    """Each rank stores its rows of the bf16 parameter, an int8 error term of the same rows, and
    8-bit states over just those rows (groups of 32 of the shard) when the whole parameter is
    large enough (4096 elements), fp32 ones otherwise; FSDP2 all-gathers the bf16 weight."""
    model_cls, _ = VARIANTS[variant]
    for rank, rank_results in enumerate(results):
        layout = rank_results["fsdp", variant]["layout"]
        for name, p in model_cls().named_parameters():
            shard = (_rows(p.shape[0], rank), *p.shape[1:])
            numel = torch.Size(shard).numel()
            expected = {}
            if "norm" in name:
                expected[""] = (torch.float32, shard)
            else:
                expected[""] = (torch.bfloat16, shard)
                expected[".error"] = (torch.int8, shard)
            if p.numel() >= 4096:
                expected[".momentum_buffer.codes"] = (torch.int8, (-(-numel // 32), 32))
                expected[".momentum_buffer.scales"] = (torch.bfloat16, (-(-numel // 32),))
            else:
                expected[".momentum_buffer.values"] = (torch.float32, shard)
            assert layout[name] == expected, (rank, name)
        seen = rank_results["fsdp", variant]["forward_weight"]
        assert seen and all(s == (nn.Parameter, torch.bfloat16) for s in seen)


def test_fsdp_train_step_compiled_through_the_backend_trains_like_the_loop(results):
    """Forward, backward, ``opt.step()`` and ``zero_grad`` in one function compiled with
    ``backend="flashoptim"`` (Dynamo breaks the graph at the sharded step, which compiles the
    local step on its own) give the uncompiled loop's bits; the op-by-op compiler keeps that exact."""
    for rank_results in results:
        compiled, loop = rank_results["fsdp", "compiled_train_step"], rank_results["fsdp", "plain"]["state"]
        assert compiled.keys() == loop.keys()
        assert all(torch.equal(compiled[k], loop[k]) for k in loop)


@pytest.mark.parametrize("variant", ["plain", "uneven_shards"])
def test_fsdp_master_state_dict_decodes_the_shards_and_loads_back(results, variant):
    """``master_state_dict`` of a sharded model holds the masters of the whole parameters (the
    reference: decode of the gathered bf16 values and error terms); loading them back as whole
    tensors keeps every master to within one error-code step of the binade above it (a master
    halfway below a power of two re-encodes in that coarser binade)."""
    for rank_results in results:
        run = rank_results["fsdp", variant]
        state = run["state"]
        for name, master in run["masters"].items():
            assert master.dtype == torch.float32, name
            if name + ".error" not in state:  # fp32 parameter: its own master
                assert torch.equal(master, state[name]), name
                continue
            expected = _ref_master(state[name], state[name + ".error"])
            fp32_ulp = torch.exp2(torch.frexp(expected)[1].double() - 24)
            assert ((master.double() - expected).abs() <= fp32_ulp).all(), name  # one fp32 rounding
        after = run["masters_after_loading"]
        assert after.keys() == run["masters"].keys()
        for name, before in run["masters"].items():
            code_step_above = torch.exp2(torch.frexp(before)[1].double() - 8) / 127
            assert ((after[name].double() - before.double()).abs() <= code_step_above).all(), name


def _ref_master(hi, lo):
    """DESIGN §2.1 decode in float64: hi + lo / 127 * 2**(e - 7 - 1), e the unbiased exponent of
    bf16 ``hi`` (1 - 127 for zero and subnormals)."""
    _, exponent = torch.frexp(hi.double())  # hi = m * 2**exponent, 0.5 <= |m| < 1
    e = torch.where(hi == 0, torch.full_like(exponent, -125), exponent).clamp(min=-125) - 1
    return hi.double() + lo.double() / 127 * torch.exp2((e - 8).double())


def test_fsdp_compressed_state_dict_of_uneven_shards_is_refused_clearly(results):
    for rank_results in results:
        message = rank_results["compressed_uneven_error"]
        assert message is not None and "'fc1.weight'" in message and "compressed_state_dict=False" in message


@pytest.mark.parametrize(("kind", "form"), CHECKPOINTS)
def test_checkpoint_round_trip_continues_bit_for_bit(results, kind, form):
    """Saved with torch.distributed.checkpoint mid-run and loaded into freshly prepared objects,
    training continues exactly as without the interruption, on every rank."""
    for rank_results in results:
        straight, resumed = rank_results[kind, "checkpoint", form].values()
        assert straight.keys() == resumed.keys()
        bad = [k for k in straight if not torch.equal(straight[k], resumed[k])]
        assert not bad, f"differ after resuming: {bad}"


# ------------------------------------------------- FSDP2 on one rank, in this process (no spawn)


ONE_RANK_OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Lion": (Lion, dict(lr=1e-3, weight_decay=0.1)),
}


@pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed")
@pytest.mark.parametrize("name", list(ONE_RANK_OPTIMIZERS))
def test_one_rank_fsdp_steps_exactly_like_the_unsharded_optimizer(one_rank, name):
    """On one rank a shard is the whole tensor, so the step of the local optimizer must give the
    unsharded prepared optimizer's bits, also when the lr changes between steps (as schedulers
    change it, in place); ``memory_report`` counts the same stored bytes and ``master_state_dict``
    gives the same masters."""
    opt_cls, kw = ONE_RANK_OPTIMIZERS[name]
    runs, memory, masters = [], [], []
    for fsdp in (False, True):
        torch.manual_seed(0)
        model = Net()
        if fsdp:
            _shard_each_layer(model)
        opt = opt_cls(model.parameters(), **kw)
        flash_inductor.prepare(model, opt, compile_options=EAGER)
        for x, y in _batches():
            F.mse_loss(model(x.bfloat16()).float(), y).backward()
            opt.step()
            opt.zero_grad()
            opt.param_groups[0]["lr"].mul_(0.5)
        runs.append({k: v.clone() for k, v in stored_bits(model, opt).items()})
        memory.append(flash_inductor.memory_report(model, opt))
        masters.append({k: _full(v) for k, v in flash_inductor.master_state_dict(model, opt).items()})
    unsharded, sharded = runs
    assert memory[0].bytes == memory[1].bytes and memory[0].num_params == memory[1].num_params
    assert masters[0].keys() == masters[1].keys() and all(torch.equal(masters[0][k], masters[1][k]) for k in masters[0])
    assert unsharded.keys() == sharded.keys()
    bad = [k for k in unsharded if not torch.equal(unsharded[k], sharded[k])]
    assert not bad, f"differ: {bad}"
    assert any(k.endswith(".error") and sharded[k].any() for k in sharded)  # the masters really were split


def test_one_rank_fsdp_refuses_fp8lm_states_before_anything_changes(one_rank):
    """One scale per tensor needs the whole tensor; a shard has only its part."""
    model = Net()
    _shard_each_layer(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"state_format='fp8lm' keeps one scale per tensor.*use state_format='companded'"):
        flash_inductor.prepare(model, opt, state_format="fp8lm")
    assert opt not in roles.PREPARED and all(p.dtype == torch.float32 for p in model.parameters())


def _shard_each_layer(model):
    """FSDP2 wants one dtype per fully_shard group: Net's norm layer stays fp32, its linears become bf16."""
    for module in [*model.children(), model]:
        fully_shard(module)


def _shard_each_layer_then_run_a_forward(model):
    _shard_each_layer(model)
    model(torch.randn(2, 128))


# setup of a Net -> (prepare's keyword arguments, what the error must say)
REFUSED_FSDP_SETUPS = {
    "one_fully_shard_would_mix_dtypes": (fully_shard, {}, [r"fully_shard\('<root>'\)", r"norm\.weight", "separately"]),
    "after_the_first_forward": (_shard_each_layer_then_run_a_forward, {},
                                ["after fully_shard and before the first forward"]),
}


@pytest.mark.parametrize("setup", list(REFUSED_FSDP_SETUPS))
def test_prepare_refuses_what_fsdp_cannot_train_and_changes_nothing(one_rank, setup):
    shard, kwargs, messages = REFUSED_FSDP_SETUPS[setup]
    torch.manual_seed(0)
    model = Net()
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as error:
        flash_inductor.prepare(model, opt, **kwargs)
    for message in messages:
        assert re.search(message, str(error.value)), message
    assert opt not in roles.PREPARED and not opt.state
    after = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], before[n]) for n in before)


def test_fsdp_gradient_release_updates_each_shard_in_backward_like_the_step(results):
    """Gradient release under FSDP2 (2 ranks): the whole parameters and error terms are the bits of
    the plain FSDP2 run (same local optimizer, updated in the post-accumulate-grad hooks), and no
    gradient is left once backward returns."""
    for rank, r in enumerate(results):
        released, plain = r["fsdp", "gradient_release"]["state"], r["fsdp", "plain"]["state"]
        assert released.keys() == plain.keys()
        bad = [k for k in plain if not torch.equal(released[k], plain[k])]
        assert not bad, f"rank {rank}: differ: {bad}"
        assert r["fsdp", "gradient_release"]["grads_left"] == [0] * STEPS
