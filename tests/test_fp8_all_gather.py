"""FP8 weight all-gather under FSDP2 (option ``fp8_all_gather``): 2 processes, started here (gloo on the
CPU; NCCL on 2 GPUs, marked gpu), and single-process checks of the pieces.

The workers run every scenario once (module fixture), each model trained by a prepared AdamW (24-bit
masters and 8-bit states per shard) under ``fully_shard``, three ways: bf16 all-gather with bf16
linears, bf16 all-gather with FP8 linears, and FP8 all-gather (FP8 linears). The tests compare what
the ranks saw with each other and with fp64 references written from the e4m3/e5m2 formats (DESIGN
§2.4), not with the package's helpers. The 100-step comparison is ``benchmarks/fp8_all_gather.py``
(its CPU result: ``benchmarks/results/fp8_all_gather_cpu.txt``); here it runs ``STEPS`` steps.
"""

import io
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import flash_inductor
from flash_inductor import fp8_linear, sharded
from flash_inductor.formats.fp8_weight import Fp8Weight
from flash_inductor.fp8_all_gather import Fp8AllGatherShard
from flash_inductor.options import Options
from flash_inductor.pipeline import PassFailed
from helpers import BACKENDS, EAGER, benchmark_module, run_ranks, stored_bits

bench = benchmark_module("fp8_all_gather")  # the model, training and byte count of benchmarks/fp8_all_gather.py

WORLD = 2
STEPS = 8
CONFIGS = {name: dict(options, **EAGER) for name, options in bench.CONFIGS.items()}
E4M3 = torch.float8_e4m3fn
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
# Elements of each rank's shards that a forward of bench.Net all-gathers (all split evenly): weights, biases.
NET_WEIGHT_SHARD = (2 * (2 * bench.HIDDEN * bench.DIM) + bench.OUT * bench.DIM) // WORLD
NET_BIAS_SHARD = 2 * bench.HIDDEN // WORLD
NET_WEIGHTS_PER_GROUP = [2, 2, 1]  # block0, block1, the root (head)


class Head(nn.Module):
    """One FP8 linear of 111 rows: FSDP2 shards it unevenly (56 + 55 rows), and the FP8 GEMMs pad it to 112."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 111, bias=False)
        with torch.no_grad():  # rows of growing size: the ranks' shards have different amaxes
            self.proj.weight.mul_(torch.linspace(0.5, 2.0, 111)[:, None])

    def forward(self, x):
        return self.proj(x)


def _parity(rank, config, compiler="eager"):
    """One forward and backward of a Head on this rank's batch, loss sum(out * r): the output, the
    gradient FSDP2 reduce-scattered (the ranks' average) and, under FP8 all-gather, the gathered
    weight, all whole; and the inputs and the whole bf16 weight to check them with."""
    model, _ = bench.prepared(Head, CONFIGS[config], groups=())
    gen, device = torch.Generator().manual_seed(10 + rank), bench.device_of(model)
    x = torch.randn(8, 64, generator=gen).bfloat16().to(device)
    r = torch.randn(8, 111, generator=gen).bfloat16().to(device)
    weight = model.proj.weight.detach().full_tensor().clone()
    gathered = []
    model.proj.register_forward_pre_hook(lambda m, args: gathered.append(
        (type(m.weight), m.weight.qdata.clone(), m.weight.scale.clone()) if isinstance(m.weight, Fp8Weight) else
        (type(m.weight),)))

    @torch.compile(backend="flashoptim", options=dict(CONFIGS[config], compiler=compiler))
    def step(x):
        out = model(x)
        (out.float() * r.float()).sum().backward()
        return out

    out = step(x)
    return {"x": x, "r": r, "weight": weight, "out": out.detach(), "grad": model.proj.weight.grad.full_tensor(),
            "gathered": gathered}


def _worker(rank, out_dir):
    warnings.simplefilter("error", PassFailed)  # a skipped rewrite would make the runs meaningless
    results = {}
    for config in CONFIGS:
        torch._dynamo.reset()
        results["parity", config] = _parity(rank, config)
    torch._dynamo.reset()
    results["parity", "fp8_all_gather", "inductor"] = _parity(rank, "fp8_all_gather", compiler="inductor")
    for config in CONFIGS:
        torch._dynamo.reset()
        results["training", config] = bench.train(rank, CONFIGS[config], STEPS)
    results["bytes"] = {config: bench.forward_bytes(rank, CONFIGS[config]) for config in ("bf16", "fp8_all_gather")}
    return results


@pytest.fixture(scope="module", params=BACKENDS)
def ranks(request):
    return run_ranks(_worker, request.param, WORLD)


# ---- fp64 references, from the formats ----

def _cast_error(t, fp8_max, relative, subnormal_half):
    """Largest |fp8 cast of t - t| per element, in t's units, with the scale of t's amax: half an ulp,
    ``relative`` * |t| for normals, ``subnormal_half`` (in scaled units) below them."""
    t = t.double()
    return relative * t.abs() + subnormal_half * t.abs().max() / fp8_max


def _product_bound(a, ea, b, eb):
    """Largest |sum_k a'_ik b'_jk - sum_k a_ik b_jk| for |a' - a| <= ea, |b' - b| <= eb, with the
    fp32 sum's rounding (2**-16 of the sum of |products|, for k <= 128)."""
    a, b = a.double(), b.double()
    return a.abs() @ eb.T + ea @ b.abs().T + ea @ eb.T + 2**-16 * ((a.abs() + ea) @ (b.abs() + eb).T)


def fp8_linear_bound(x, w):
    """|FP8 linear output (bf16) - x @ w.T| (e4m3 x and w, DESIGN §2.4), as ``_product_bound`` plus the
    output's bf16 rounding (half an ulp: 2**-8 relative)."""
    ex = _cast_error(x, E4M3_MAX, 2**-4, 2**-10)
    ew = _cast_error(w, E4M3_MAX, 2**-4, 2**-10)
    exact = x.double() @ w.double().T
    b = _product_bound(x, ex, w, ew)
    return b + 2**-8 * (exact.abs() + b)


def fp8_weight_grad_bound(r, x):
    """|FP8 weight gradient (bf16) - r.T @ x|: grad-output in e5m2 (half ulp 2**-3, subnormals 2**-17)
    times the input in e4m3, with the bf16 rounding."""
    er = _cast_error(r, E5M2_MAX, 2**-3, 2**-17)
    ex = _cast_error(x, E4M3_MAX, 2**-4, 2**-10)
    exact = r.double().T @ x.double()
    b = _product_bound(r.T, er.T, x.T, ex.T)
    return b + 2**-8 * (exact.abs() + b)


def bf16_bound(a, b):
    """|bf16 GEMM - a @ b.T| (fp32 accumulation, bf16 result)."""
    exact = a.double() @ b.double().T
    return 2**-16 * (a.double().abs() @ b.double().abs().T) * 1.01 + 2**-8 * exact.abs() * 1.01


def averaged(bounds, exacts):
    """A bound of FSDP2's bf16 average of the ranks' gradients (each within its bound of its exact
    value) against the exact average: the ranks' bounds averaged, plus the average's bf16 rounding."""
    avg_bound = sum(bounds) / len(bounds)
    avg_exact = sum(exacts) / len(exacts)
    return avg_bound + 2**-8 * (avg_exact.abs() + avg_bound)


# ---- 2 processes ----

def test_gathered_weight_is_e4m3_of_the_whole_weight_with_the_scale_of_its_amax(ranks):
    """What the forward gets under FP8 all-gather: the whole weight cast to e4m3 with
    scale = 448 / max |W| (fp32), the same on both ranks though each only holds its rows."""
    for r in ranks:
        run = r["parity", "fp8_all_gather"]
        ((kind, qdata, scale),) = run["gathered"]
        w = run["weight"].float()
        ref_scale = torch.tensor(E4M3_MAX) / w.abs().max()
        assert kind is Fp8Weight and scale.dtype == torch.float32 and scale.item() == ref_scale.item()
        ref = (w * ref_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        assert qdata.dtype == E4M3 and qdata.shape == (111, 64)
        assert torch.equal(qdata.view(torch.uint8), ref.view(torch.uint8))
        # The ranks' rows alone have other amaxes: the scale is agreed, not local.
        assert w[:56].abs().max() != w[56:].abs().max()
    assert all(r["parity", "fp8_linears"]["gathered"] == [(nn.Parameter,)] for r in ranks)


@pytest.mark.parametrize("scenario", ["parity", "training"])
def test_equals_fp8_linears_over_a_bf16_all_gather_bit_for_bit(ranks, scenario):
    """The gathered e4m3 weight is what the FP8 linear's own cast of the bf16-gathered weight gives,
    so forward, gradients and the whole training run are the same bits."""
    for r in ranks:
        fp8, ref = r[scenario, "fp8_all_gather"], r[scenario, "fp8_linears"]
        if scenario == "parity":
            assert torch.equal(fp8["out"], ref["out"]) and torch.equal(fp8["grad"], ref["grad"])
        else:
            assert torch.equal(fp8["first_out"], ref["first_out"]) and torch.equal(fp8["losses"], ref["losses"])
            assert not torch.equal(fp8["losses"], r[scenario, "bf16"]["losses"])  # FP8 really was used


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_output_and_gradient_within_e4m3_error_of_the_bf16_all_gather(ranks, compiler):
    """Against the exact product of the bf16 weight (what a bf16 all-gather gives) and against the
    bf16 run itself: within the e4m3 (forward) and e5m2 x e4m3 (weight gradient) cast errors."""
    key = ("parity", "fp8_all_gather") + (("inductor",) if compiler == "inductor" else ())
    runs, bf16_runs = [r[key] for r in ranks], [r["parity", "bf16"] for r in ranks]
    w = runs[0]["weight"]
    for run, bf16_run in zip(runs, bf16_runs):
        assert torch.equal(run["weight"], w)
        exact, bound = run["x"].double() @ w.double().T, fp8_linear_bound(run["x"], w)
        assert run["out"].dtype == torch.bfloat16
        assert ((run["out"].double() - exact).abs() <= bound).all()
        bf16_error = (run["out"].double() - bf16_run["out"].double()).abs()
        assert (bf16_error <= bound + bf16_bound(run["x"], w)).all() and bf16_error.max() > 0
    exacts = [run["r"].double().T @ run["x"].double() for run in runs]
    bound = averaged([fp8_weight_grad_bound(run["r"], run["x"]) for run in runs], exacts)
    bf16_bound_ = averaged([bf16_bound(run["r"].T, run["x"].T) for run in runs], exacts)
    exact = sum(exacts) / WORLD
    for run, bf16_run in zip(runs, bf16_runs):
        assert run["grad"].dtype == torch.bfloat16 and torch.equal(run["grad"], runs[0]["grad"])
        assert ((run["grad"].double() - exact).abs() <= bound).all()
        assert ((run["grad"].double() - bf16_run["grad"].double()).abs() <= bound + bf16_bound_).all()


def test_training_tracks_the_bf16_all_gather(ranks):
    """STEPS steps (100 in benchmarks/fp8_all_gather.py, whose CPU result is committed): the losses
    fall, and the held-out loss is within 2% of the run with bf16 all-gathers and bf16 linears."""
    for r in ranks:
        fp8, bf16 = r["training", "fp8_all_gather"], r["training", "bf16"]
        assert fp8["losses"][-3:].mean() < 0.8 * fp8["losses"][:3].mean()
        assert abs(fp8["held_out_loss"] / bf16["held_out_loss"] - 1) <= 0.02


def test_forward_all_gather_sends_half_the_bytes_of_bf16(ranks):
    """Measured (flash_inductor.collective_bytes): each rank sends (n-1) x its padded shard per
    all-gather; the weights' bytes halve, the bias stays bf16; one all-reduce of the amaxes per group."""
    for r in ranks:
        bf16, fp8 = r["bytes"]["bf16"], r["bytes"]["fp8_all_gather"]
        bias_bytes = (WORLD - 1) * 2 * NET_BIAS_SHARD
        assert bf16 == {"all_gather_into_tensor": (WORLD - 1) * 2 * NET_WEIGHT_SHARD + bias_bytes}
        assert fp8["all_gather_into_tensor"] - bias_bytes == (bf16["all_gather_into_tensor"] - bias_bytes) / 2
        ring = 2 * (WORLD - 1) / WORLD
        assert fp8 == {"all_gather_into_tensor": (WORLD - 1) * NET_WEIGHT_SHARD + bias_bytes,
                       "all_reduce": sum(ring * 4 * k for k in NET_WEIGHTS_PER_GROUP)}


# ---- one process ----

def test_fp8_linear_multiplies_a_gathered_weight_without_casting_it_again(monkeypatch):
    """``fp8_linear`` of an ``Fp8Weight`` (e4m3 of w with the scale of w's amax) casts only x in the
    forward, and gives the bits of ``fp8_linear`` of w, forward and backward, also when the GEMMs pad
    the weight (111 -> 112 rows); the gradient is the bf16 gradient of the weight w stands for."""
    casts = []
    quantize = fp8_linear._quantize
    monkeypatch.setattr(fp8_linear, "_quantize", lambda t, *args: casts.append(t.shape) or quantize(t, *args))
    torch.manual_seed(0)
    w = torch.randn(111, 64).bfloat16()
    x = torch.randn(8, 64).bfloat16()
    g = torch.randn(8, 111).bfloat16()
    scale = torch.tensor(E4M3_MAX) / w.float().abs().max()
    gathered = Fp8Weight((w.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale, torch.bfloat16)
    outs, grads = [], []
    for weight in (w.clone(), gathered):
        weight.requires_grad_()
        xr = x.clone().requires_grad_()
        casts.clear()
        out = fp8_linear.fp8_linear(xr, weight)
        forward_casts = list(casts)
        out.backward(g)
        outs.append(out)
        grads.append((xr.grad, weight.grad))
        # the 8 tokens padded to 16 (the weight gradient's K)
        assert forward_casts == ([(16, 64)] if weight is gathered else [(16, 64), (112, 64)])
        assert casts[len(forward_casts):] == [(16, 112)]  # the grad-output, padded
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert type(grads[1][1]) is torch.Tensor and grads[1][1].dtype == torch.bfloat16


def test_gathered_weight_outside_an_fp8_linear_is_the_dequantized_weight_and_read_only():
    w8 = torch.tensor([[1.0, -2.5], [0.375, 448.0]]).to(E4M3)
    weight = Fp8Weight(w8, torch.tensor(4.0), torch.bfloat16)
    assert weight.shape == (2, 2) and weight.dtype == torch.bfloat16
    # float(w8) / scale, in bf16
    assert torch.equal(weight + 0, torch.tensor([[0.25, -0.625], [0.09375, 112.0]], dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="read-only"):
        weight.add_(1)


@pytest.mark.parametrize(("options", "message"), [
    ({"fp8_all_gather": True}, "'fp8_all_gather' needs fp8='tensorwise', got fp8=None"),
    ({"fp8_all_gather": True, "fp8": "delayed"}, "delayed scaling is not supported with fp8 all-gather"),
    ({"fp8_all_gather": 1, "fp8": "tensorwise"}, "'fp8_all_gather' must be True or False"),
])
def test_option_is_checked(options, message):
    with pytest.raises(ValueError, match=message):
        Options.from_dict(options)
    assert Options.from_dict({"fp8": "tensorwise", "fp8_all_gather": True}).fp8_all_gather


def test_prepare_fp8_refuses_a_model_without_sharded_fp8_linears():
    with pytest.raises(ValueError, match="call prepare_fp8 after fully_shard"):
        flash_inductor.prepare_fp8(bench.Net(), fp8_all_gather=True, fp8_min_weight_numel=0)


def test_prepare_fp8_refuses_after_the_first_forward_and_changes_nothing(one_rank):
    model, _ = bench.prepared(bench.Net, EAGER)
    model(torch.randn(2, 64).bfloat16())
    model.reshard()  # the root group stays gathered after a forward
    with pytest.raises(ValueError, match=r"call prepare_fp8\(model, fp8_all_gather=True, ...\) after fully_shard and before"):
        flash_inductor.prepare_fp8(model, fp8_all_gather=True, fp8_min_weight_numel=0)
    assert not any(isinstance(p._local_tensor, Fp8AllGatherShard) for p in model.parameters())


def test_one_rank_wraps_only_fp8_linear_weights_and_keeps_the_shards(one_rank):
    """Eligibility is fp8_linear's (here: fp8_exclude); the shard stays the very bf16 tensor the
    prepared optimizer steps (``sharded.local``); it is saved as that plain tensor, and a load
    copies into it."""
    model, _ = bench.prepared(bench.Net, EAGER)
    before = {n: p.to_local() for n, p in model.named_parameters()}
    flash_inductor.prepare_fp8(model, fp8_all_gather=True, fp8_min_weight_numel=0, fp8_exclude=["head"])
    wrapped = {n for n, p in model.named_parameters() if isinstance(p._local_tensor, Fp8AllGatherShard)}
    assert wrapped == {"block0.fc1.weight", "block0.fc2.weight", "block1.fc1.weight", "block1.fc2.weight"}
    for n, p in model.named_parameters():
        assert sharded.local(p) is (p._local_tensor.local if n in wrapped else p._local_tensor)
        assert torch.equal(sharded.local(p), before[n])
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert all(type(saved[n]._local_tensor) is torch.Tensor and torch.equal(saved[n].to_local(), before[n]) for n in saved)
    zeros = {n: torch.zeros_like(t) for n, t in saved.items()}
    model.load_state_dict(zeros)
    for n, p in model.named_parameters():
        assert isinstance(p._local_tensor, Fp8AllGatherShard) == (n in wrapped) and not sharded.local(p).any()


def test_one_rank_inspection_says_which_linears_multiply_the_gathered_e4m3_weight(one_rank):
    """The report's decisions: FP8 linears on a gathered weight say so; a linear the compile options
    keep in bf16 (here the head, under a larger fp8_min_weight_numel than prepare_fp8's) multiplies
    the dequantized e4m3 weight, and says that too."""
    model, _ = bench.prepared(bench.Net, CONFIGS["fp8_all_gather"])

    def step(x):
        model(x).float().sum().backward()

    options = dict(CONFIGS["fp8_all_gather"], fp8_min_weight_numel=4096)
    report = flash_inductor.inspect(flash_inductor.compile(step, **options), torch.randn(4, 64).bfloat16())
    decisions = sorted(decision for graph in report.graphs for _, _, decision in graph.decisions)
    assert decisions == ["bf16: weight 32x64 is under fp8_min_weight_numel=4096 (on the e4m3-gathered weight, dequantized)",
                         *["fp8 e4m3/e5m2, weight all-gathered in e4m3"] * 4]


def test_one_rank_checkpoint_round_trip_through_dcp(one_rank, tmp_path):
    """``torch.distributed.checkpoint`` saves the wrapped shards as plain tensors and loads them back
    into another model's wrapped shards: every stored bit (weights, error terms, 8-bit states) equal."""
    model, opt = bench.prepared(bench.Net, CONFIGS["fp8_all_gather"])
    model(torch.randn(4, 64).bfloat16()).float().sum().backward()
    opt.step()
    opt.zero_grad()
    model.reshard()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)
    resumed, resumed_opt = bench.prepared(bench.Net, CONFIGS["fp8_all_gather"], seed=1)
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=tmp_path)
    set_state_dict(resumed, resumed_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert all(isinstance(p._local_tensor, Fp8AllGatherShard) for n, p in resumed.named_parameters() if "weight" in n)
    saved, restored = stored_bits(model, opt), stored_bits(resumed, resumed_opt)
    assert saved.keys() == restored.keys() and any(".error" in k for k in saved)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)


def test_one_rank_prepare_fp8_before_or_after_prepare_trains_the_same_bits(one_rank):
    """``prepare`` casts the wrapped fp32 shards to bf16 and they stay wrapped: either order gives the
    same stored bits after a step (weights, error terms, 8-bit states)."""
    runs = []
    for prepare_fp8_first in (False, True):
        torch.manual_seed(0)
        model = bench.Net()
        for module in (model.block0, model.block1, model):
            fully_shard(module)
        opt = torch.optim.AdamW(model.parameters(), lr=bench.LR)
        if prepare_fp8_first:
            flash_inductor.prepare_fp8(model, **CONFIGS["fp8_all_gather"])
        flash_inductor.prepare(model, opt, compile_options=EAGER)
        if not prepare_fp8_first:
            flash_inductor.prepare_fp8(model, **CONFIGS["fp8_all_gather"])
        assert all(isinstance(p._local_tensor, Fp8AllGatherShard) and p.dtype == torch.bfloat16
                   for n, p in model.named_parameters() if "weight" in n)
        model(bench.batch(0, 0).bfloat16()).float().sum().backward()
        opt.step()
        model.reshard()
        runs.append(stored_bits(model, opt))
    assert runs[0].keys() == runs[1].keys() and all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
