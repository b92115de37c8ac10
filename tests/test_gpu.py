"""GPU (CUDA + Triton) checks: run on the H200 with ``pytest -m gpu tests``; skipped without CUDA."""

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn

import flash_inductor
from flash_inductor import inspection, roles, triton_adam
from flash_inductor.formats.fp8 import sqnr_db
from flash_inductor.pipeline import PassFailed
from helpers import assert_same_bits, ref_decode_state, stored_bits
from reference import FLOOR_SCALE, GROUP, ref_split_decode
from test_optimizer_numerics import check_one_step_against_fp64_reference, compare_with_expected_steps, expected_steps

pytestmark = pytest.mark.gpu
LR, WEIGHT_DECAY = 1e-3, 0.1


def _prepared(compiler, foreach=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=foreach)
    # every tensor 8-bit: every bucket runs the hand-written kernel (fp32-state buckets run Inductor's step)
    flash_inductor.prepare(model, opt, min_quantized_numel=1, compile_options={"compiler": compiler})
    return model, opt


def _stock_adamw_step(masters, grads, backend):
    """One step of stock fp32 ``torch.optim.AdamW`` (same hyperparameters) from the decoded masters,
    compiled as the flashoptim step is: traced by Dynamo, torch computes the bias corrections from
    the step tensor in fp32 (not in Python floats), on the GPU (capturable, as the flat step). With
    ``backend="inductor"`` its ``beta ** step`` is libdevice's fp32 pow, which the H200 showed an ulp
    off torch's eager CUDA pow (0.999 ** 1): 3e-5 of the first steps' updates after the cancellation
    in ``1 - beta2 ** step``."""
    params = {name: nn.Parameter(value.clone()) for name, value in masters.items()}
    for name, p in params.items():
        p.grad = grads[name].float()
    # capturable: the step count on the GPU, where the flat step computes its bias corrections too
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False, capturable=True)
    torch.compile(opt.step, backend=backend)()
    return {name: p.detach() for name, p in params.items()}


def _tolerance(before, after_hi):
    """One error-term code step of the new master (half a bf16 ulp / 127), plus a few fp32 roundings
    of the step's operands (|master| and lr), where the fp32 update arithmetic may legitimately
    differ (operation order, FMA contraction)."""
    bf16 = torch.finfo(torch.bfloat16)
    code_step = bf16.eps * after_hi.double().abs().clamp(min=bf16.tiny) / 2 / 127
    return code_step + 4 * torch.finfo(torch.float32).eps * (before.double().abs() + LR)


@pytest.mark.parametrize("foreach", [False, True])
def test_triton_step_matches_stock_adamw_and_eager_rewrite(foreach):
    """One AdamW step from the same state. The masters the Triton kernels store (bf16 + error term,
    decoded) equal stock fp32 AdamW's step, compiled by Inductor, from the same masters within one
    error-term code step (plus fp32 operation-order rounding); the op-by-op CUDA run of the same
    rewritten graph equals stock AdamW traced by Dynamo and run eagerly the same way; the two runs'
    8-bit state codes agree within one."""
    triton_model, triton_opt = _prepared("inductor", foreach)
    eager_model, eager_opt = _prepared("eager", foreach)
    masters_before = flash_inductor.master_state_dict(triton_model, triton_opt)
    grads = {name: torch.randn_like(p) * 1e-2 for name, p in triton_model.named_parameters()}
    for model, opt in ((triton_model, triton_opt), (eager_model, eager_opt)):
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        opt.step()
    # Both against stock AdamW run eagerly: the hand-written kernel computes ``beta ** step`` with torch's
    # eager CUDA pow (flash_inductor/triton_adam.py), the eager run of the rewritten graph in fp64
    # (passes/fp64_step_powers.py); compiled by Inductor, stock AdamW would take libdevice's fp32 pow.
    reference = _stock_adamw_step(masters_before, grads, "eager")
    references = {"triton": reference, "eager": reference}
    params = dict(triton_model.named_parameters())
    for label, model, opt in (("triton", triton_model, triton_opt), ("eager", eager_model, eager_opt)):
        reference = references[label]
        for name, master in flash_inductor.master_state_dict(model, opt).items():
            tol = _tolerance(masters_before[name], params[name].detach())
            err = (master.double() - reference[name].double()).abs() / tol
            worst = int(err.argmax())
            # Say enough to diagnose from the log alone.
            assert err.max() <= 1.0, (
                f"{label} {name}: {int((err > 1).sum())} of {err.numel()} masters are off stock fp32 AdamW by more than "
                f"the tolerance; worst {err.max().item():.2f}x at {worst}: before {masters_before[name].flatten()[worst].item()!r} "
                f"grad {grads[name].flatten()[worst].item()!r} got {master.flatten()[worst].item()!r} "
                f"reference {reference[name].flatten()[worst].item()!r}")
    eager = stored_bits(eager_model, eager_opt)
    for key, a in stored_bits(triton_model, triton_opt).items():
        # 8-bit state codes: at most one code apart. (Error terms are compared through the decoded
        # masters above: a master at a bf16 rounding midpoint is (hi, +127) one way, (hi + ulp, -127)
        # the other.)
        if not a.is_floating_point() and not key.endswith(".error"):
            assert (a.int() - eager[key].int()).abs().max() <= 1, key
    errors = torch.cat([roles.PREPARED[triton_opt].error_term(p).flatten() for p in triton_model.parameters()])
    assert errors.ne(0).float().mean() > 0.9  # the bf16 rounding survived fusion into the Triton kernel


def test_inspection_shows_triton_kernels():
    model, opt = _prepared("inductor")

    def step(x):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    report = flash_inductor.inspect(step, torch.randn(8, 256, device="cuda", dtype=torch.bfloat16))
    assert "triton" in report.graph("optimizer step").kernel_backends
    assert "triton" in report.graph("model").kernel_backends


def _step_kernel_launches(count, step_kernel):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(1024, 1024, device="cuda") * 0.02) for _ in range(count)]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    flash_inductor.prepare(nn.ParameterList(params), opt, compile_options={"step_kernel": step_kernel})
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # compiles
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
            for _ in range(e.count)]


@pytest.mark.parametrize("step_kernel", ["triton", "inductor"])
def test_flat_step_is_one_kernel_whatever_the_number_of_parameters(step_kernel):
    """The flat step of one bucket (all parameters bf16 with 8-bit states) launches one fused
    Triton kernel for the update (with its group absmax and encodes), plus scalar work (bias
    corrections, the step count), the same kernels for 2 parameters as for 16 (issue 13's target:
    one per group and dtype, plus scalar work): the hand-written kernel, or Inductor's."""
    two, sixteen = _step_kernel_launches(2, step_kernel), _step_kernel_launches(16, step_kernel)
    assert two == sixteen, (two, sixteen)
    # the hand-written step: the step count, the powers of its bias corrections and the kernel
    update, most = ("_adam_kernel", 3) if step_kernel == "triton" else ("amax", 3)
    assert sum(update in name for name in two) == 1 and len(two) <= most, two


# FP8 on every linear of the tests' small layers, under the size rules made for real models.
EVERY_LINEAR = dict(fp8_min_weight_numel=0, fp8_min_gemm_size=0)

ADAM_CASES = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1), "adamw"),
    "Adam": (torch.optim.Adam, dict(lr=1e-3, weight_decay=1e-2), "adam"),
}


# the exact arithmetic and the cheaper one (the default; issue 13's numerics policy), the cheaper one on another layout too
ARITHMETICS = ["block64_warps4", "block64_warps4_approx", "block32_warps2_vector8_approx"]


@pytest.mark.parametrize("launch", ARITHMETICS[:2])
@pytest.mark.parametrize("name", list(ADAM_CASES))
def test_triton_adam_step_matches_fp64_reference_within_one_code_step(name, launch, monkeypatch):
    """The hand-written kernel (flash_inductor/triton_adam.py), exact or ``approx``, against the fp64
    reference, step by step, with the tolerances the CPU path meets (tests/test_optimizer_numerics.py)."""
    monkeypatch.setattr(triton_adam, "LAUNCH", triton_adam.LaunchShape.from_name(launch))
    model, opt = check_one_step_against_fp64_reference(*ADAM_CASES[name], device="cuda", compile_options={})
    assert all(triton_adam.ineligible(b, b.optimizer) is None for b in roles.PREPARED[opt].buckets)


def check_kernel_edge_cases(device):
    """The hand-written step (as ``triton_adam.LAUNCH`` launches it) of four parameters on ``device``,
    against the fp64 reference wherever the values stay finite (tests/test_optimizer_numerics.py's
    tolerances), in three steps:
    1. a group of zero gradients (zero states: scale 0, codes 0), a second moment 1e-12 of its
       group's largest (code 1, not 0: docs/numerics.md, "Second-moment floor"), and a parameter
       of zero, subnormal and tiny masters with zero gradients (weight decay only);
    2. lr 0 (every weight and error term keeps its bits, the tiny ones too) with one parameter
       without gradient (all its stored values and its step count keep their bits);
    3. a nan and an inf gradient: those two masters non-finite (as stock torch's), the moments' scales
       nan in their groups and only there (the codes of a nan group are unspecified: they decode to nan).
    Also run by Triton's interpreter (tests/test_triton_interpreter.py)."""
    torch.manual_seed(0)
    tiny = torch.cat([torch.zeros(GROUP), torch.randn(GROUP) * 1e-39, torch.randn(GROUP) * 1e-36])
    params = nn.ParameterList([nn.Parameter(t.to(device)) for t in (
        torch.randn(64, 64) * 0.02, torch.randn(32, 48) * 0.02, torch.randn(96) * 0.02, tiny)])
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    flash_inductor.prepare(params, opt, min_quantized_numel=1, compile_options={})
    assert all(triton_adam.ineligible(b, b.optimizer) is None for b in roles.PREPARED[opt].buckets)
    a, b, c, d = params

    def step(grads):
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.to(device, p.dtype)
        expected = expected_steps(params, opt, "adamw")
        opt.step()
        return expected

    grads = [torch.randn(p.shape) * 1e-2 for p in params[:3]] + [torch.zeros(d.shape)]
    grads[1].view(-1)[:GROUP] = 0  # b's first group
    grads[1].view(-1)[GROUP] = 1e-8  # b's second group: sqrt(v) 1e-6 of its largest
    compare_with_expected_steps(params, opt, step(grads), "step 1")
    for key in ("exp_avg", "exp_avg_sq"):
        state = opt.state[b][key]
        assert state.scales[0].cpu() == FLOOR_SCALE and not state.codes.view(-1)[:GROUP].any() and state.scales[1] > 0, key
    assert opt.state[b]["exp_avg_sq"].codes.view(-1)[GROUP] == 1

    opt.param_groups[0]["lr"].fill_(0.0)
    before = stored_bits(params, opt)
    grads = [torch.randn(p.shape) * 1e-2 for p in params]
    grads[2] = None
    compare_with_expected_steps(params, opt, step(grads), "step 2")
    after = stored_bits(params, opt)
    kept = [k for k in before if k.startswith("2") or k in ("0", "1", "3", "0.error", "1.error", "3.error")]
    assert [k for k in kept if not torch.equal(before[k], after[k])] == []
    assert float(opt.state[c]["step"]) == 1 and float(opt.state[a]["step"]) == 2

    opt.param_groups[0]["lr"].fill_(LR)
    grads = [torch.randn(p.shape) * 1e-2 for p in params]
    grads[0][0, 0], grads[0][5, 7] = float("nan"), float("inf")
    expected = step(grads)
    del expected[a]
    compare_with_expected_steps(params, opt, expected, "step 3")
    master = ref_split_decode(a.detach(), roles.PREPARED[opt].error_term(a), 127)
    assert torch.equal(~master.isfinite(), ~grads[0].to(device).isfinite())
    nonfinite_groups = (~grads[0].to(device).isfinite()).view(-1, GROUP).any(dim=1)
    for key in ("exp_avg", "exp_avg_sq"):
        state = opt.state[a][key]
        assert torch.equal(state.scales.isnan(), nonfinite_groups), key
        decoded = ref_decode_state(state.codes, state.scales, a.shape, state.kind).view(-1, GROUP)
        assert decoded[~nonfinite_groups].isfinite().all(), key


@pytest.mark.parametrize("launch", ARITHMETICS)
def test_triton_step_edge_cases(launch, monkeypatch):
    """Zero groups, the second moment's code-1 floor, lr 0, a parameter without gradient, nan and inf
    gradients (``check_kernel_edge_cases``), with each arithmetic."""
    monkeypatch.setattr(triton_adam, "LAUNCH", triton_adam.LaunchShape.from_name(launch))
    check_kernel_edge_cases("cuda")


def COPY_EVERY_GRADIENT(grad, view):  # noqa: N802 (a constant of the tests: the step that copies them all)
    return "copied for the comparison"


def _prepared_pair(state_format, device):
    """Two copies of one set of parameters whose sizes leave partial groups (one smaller than a group),
    prepared alike with 8-bit states of ``state_format``."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        params = nn.ParameterList([nn.Parameter(torch.randn(*shape, device=device) * 0.02)
                                   for shape in ((64, 48), (7, 8), (96,), (5,), (16,))])
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
        flash_inductor.prepare(params, opt, min_quantized_numel=1, state_format=state_format, compile_options={})
        runs.append((params, opt))
    return runs


def check_gradients_read_in_place(device, state_format, monkeypatch):
    """The kernel reads each ``.grad`` where it is (``triton_adam.unreadable_gradient``): the step meets the
    fp64 reference (companded states) and stores the bits of the step that copies every gradient into
    the flat buffer first; that buffer then gets no storage, and ``.grad`` stays the tensor it was. A
    gradient it cannot read there (transposed, not 16-byte aligned, or of a length that is not a
    multiple of 16 bytes) is copied in, the others still read in place; a parameter without a
    gradient keeps its bits. Also run by Triton's interpreter (tests/test_triton_interpreter.py)."""
    (params, opt), (copied_params, copied_opt) = _prepared_pair(state_format, device)
    (bucket,), (copied_bucket,) = roles.PREPARED[opt].buckets, roles.PREPARED[copied_opt].buckets
    unreadable = triton_adam.unreadable_gradient
    torch.manual_seed(1)
    for step in range(3):
        grads = [(torch.randn(p.shape, device=device) * 1e-2).to(p.dtype) for p in params]
        if step == 1:
            grads[0] = grads[0].t().contiguous().t()  # the same values, transposed strides
            grads[1] = None
            grads[2] = torch.cat([grads[2][:1], grads[2]])[1:]  # 2 bytes past an aligned start
        else:
            grads[3] = None  # the parameter of 5 elements (10 bytes) has a gradient in step 1 only
        given = {}
        for run, (ps, o) in {"copied": (copied_params, copied_opt), "in place": (params, opt)}.items():
            monkeypatch.setattr(triton_adam, "unreadable_gradient", unreadable if run == "in place" else COPY_EVERY_GRADIENT)
            for p, g in zip(ps, grads):
                p.grad = None if g is None else g.clone(memory_format=torch.preserve_format) if run == "copied" else g
            given[run] = [p.grad for p in ps]
            expected = expected_steps(ps, o, "adamw")
            o.step()
        if state_format == "companded":  # (FP8-LM's reference: the fp8lm tests above, whose gradients are read in place)
            assert len(expected) == 4
            compare_with_expected_steps(params, opt, expected, f"step {step}")
        assert_same_bits(stored_bits(params, opt), stored_bits(copied_params, copied_opt))
        assert copied_bucket.gradients_held()
        in_place = [p.grad is g for p, g in zip(params, given["in place"])]
        if step == 1:  # only the last one read in place
            assert bucket.gradients_held() and in_place == [False, True, False, False, True]
        else:
            assert not bucket.gradients_held() and all(in_place)
        for o in (opt, copied_opt):
            o.zero_grad()


def _mlp_the_kernel_steps(device):
    """(model, optimizer, its one bucket) of a small MLP prepared so that the hand-written kernel steps
    every tensor and reads the gradients where autograd leaves them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    flash_inductor.prepare(model, opt, min_quantized_numel=1, compile_options={})
    (bucket,) = roles.PREPARED[opt].buckets
    assert bucket.reads_gradients_in_place
    return model, opt, bucket


def check_backward_leaves_gradients_to_the_kernel(device):
    """With an eager backward the hooks of a bucket the hand-written kernel steps
    (``Bucket.reads_gradients_in_place``) leave each gradient as autograd made it: after backward the
    flat buffer has no storage, also over two micro-batches a step, and three steps store the bits of
    landing each gradient in the flat buffer as it comes (the hooks' way before). Also run by Triton's
    interpreter (tests/test_triton_interpreter.py)."""
    runs = []
    for hooks_land in (False, True):
        model, opt, bucket = _mlp_the_kernel_steps(device)
        bucket.reads_gradients_in_place = not hooks_land
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _ in range(2):
                x = torch.randn(16, 64, generator=generator).to(device, torch.bfloat16)
                model(x).float().square().mean().backward()
            assert bucket.gradients_held() == hooks_land
            opt.step()
            opt.zero_grad()
        runs.append(stored_bits(model, opt))
    assert_same_bits(*runs)


def check_kept_zero_gradients_are_the_flat_views(device):
    """``zero_grad(set_to_none=False)`` after steps that read the gradients where autograd left them:
    each ``.grad`` becomes its zeroed view of the flat buffer (kept, a CUDA graph's output would be
    overwritten by the graph's next replay before autograd adds the next gradient to it), and three
    steps store the bits of setting them to None. Also run by Triton's interpreter."""
    runs = []
    for set_to_none in (True, False):
        model, opt, bucket = _mlp_the_kernel_steps(device)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(16, 64, generator=generator).to(device, torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            if not set_to_none:
                assert [p.grad.data_ptr() for p in model.parameters()] == [v.data_ptr() for v in bucket.grad_views]
                assert not any(p.grad.any() for p in model.parameters())
        runs.append(stored_bits(model, opt))
    assert_same_bits(*runs)


def check_report_names_the_gradients_copied(device):
    """The inspection report says, of a bucket the hand-written kernel steps, that it read every gradient
    where it was, or which it copied into the flat buffer and why. Also run by Triton's interpreter."""
    def decisions(*shapes):
        torch.manual_seed(0)
        params = nn.ParameterList([nn.Parameter(torch.randn(*shape, device=device)) for shape in shapes])
        opt = torch.optim.AdamW(params, lr=LR)
        flash_inductor.prepare(params, opt, min_quantized_numel=1, compile_options={})
        for p in params:
            p.grad = torch.randn(p.shape, device=device).to(p.dtype)
        report = flash_inductor.inspect(lambda: opt.step())
        (step,) = [g for g in report.graphs if g.name == inspection.HAND_WRITTEN_STEP]
        return {kind: decision for kind, _, decision in step.decisions}

    assert decisions((64, 48), (16,)) == {"step_kernel": "hand-written Triton kernel",
                                          "gradients": "read where the backward left them"}
    assert decisions((64, 48), (5,))["gradients"] == (
        "1 copied into the flat buffer: 1 (not 16-byte aligned, or not a whole number of 16 bytes long)")


def test_report_names_the_gradients_copied():
    check_report_names_the_gradients_copied("cuda")


def test_backward_leaves_gradients_to_the_kernel():
    check_backward_leaves_gradients_to_the_kernel("cuda")


def test_kept_zero_gradients_are_the_flat_views():
    check_kept_zero_gradients_are_the_flat_views("cuda")


@pytest.mark.parametrize("state_format", ["companded", "fp8lm"])
def test_triton_step_reads_gradients_where_they_are(state_format, monkeypatch):
    """Gradients read where they are, or copied in where they cannot be (``check_gradients_read_in_place``)."""
    check_gradients_read_in_place("cuda", state_format, monkeypatch)


def _kernel_runs(step_kernel, **prepare_kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 300)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, maximize=True)
    flash_inductor.prepare(model, opt, min_quantized_numel=1, compile_options={"step_kernel": step_kernel}, **prepare_kwargs)
    return model, opt


@pytest.mark.parametrize("launch", ARITHMETICS[:2])
@pytest.mark.parametrize("master_weight_bits", [24, None])
def test_triton_step_agrees_with_inductor_step_and_skips_parameters_without_gradient(master_weight_bits, launch,
                                                                                     monkeypatch):
    """From the same state the hand-written kernel (exact or ``approx``) and Inductor's compiled stock
    update give masters within one code step and state codes within one; a parameter without a
    gradient keeps every bit and its step count in both, also once the bucket's step counts became
    per group."""
    monkeypatch.setattr(triton_adam, "LAUNCH", triton_adam.LaunchShape.from_name(launch))
    runs = {k: _kernel_runs(k, master_weight_bits=master_weight_bits) for k in ("triton", "inductor")}
    for step in range(4):
        grads = [torch.randn_like(p) * 1e-2 for p in runs["triton"][0].parameters()]
        before = {}
        for kind, (model, opt) in runs.items():
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            if step == 2:
                model[2].weight.grad = None
                before[kind] = {k: v.clone() for k, v in stored_bits(model, opt).items() if k.startswith("2.weight")}
            opt.step()
            opt.zero_grad()
            if step == 2:
                after = stored_bits(model, opt)
                changed = [k for k, v in before[kind].items() if not torch.equal(v, after[k])]
                assert not changed, (kind, changed)
        if step == 0:
            masters = {k: flash_inductor.master_state_dict(*r) for k, r in runs.items()}
            for name, p in runs["triton"][0].named_parameters():
                # one code step; without error terms two bf16 ulps: the stock update on bf16 parameters rounds
                # after each in-place op (weight decay, then the step), the kernel once
                code_step = torch.finfo(torch.bfloat16).eps * p.detach().double().abs() * (1 / 254 if master_weight_bits else 2)
                # near zero a master's own resolution is below the update's (about lr at step 0): the two
                # steps round the update apart by an fp32 ulp of it, and bf16 masters by a bf16 ulp
                ulp = 4 * torch.finfo(torch.float32).eps if master_weight_bits else torch.finfo(torch.bfloat16).eps
                update_rounding = LR * ulp
                tol = code_step + 4 * torch.finfo(torch.float32).eps * masters["inductor"][name].double().abs() + update_rounding
                difference = (masters["triton"][name].double() - masters["inductor"][name].double()).abs()
                excess = difference - tol
                assert (excess <= 0).all(), (name, int((excess > 0).sum()), difference.numel(), float(excess.max() / LR))
            bits = {k: stored_bits(*r) for k, r in runs.items()}
            for key, a in bits["triton"].items():
                if not a.is_floating_point() and not key.endswith(".error"):
                    assert (a.int() - bits["inductor"][key].int()).abs().max() <= 1, key
    assert all(triton_adam.ineligible(b, b.optimizer) is None for b in roles.PREPARED[runs["triton"][1]].buckets)


# _kernel_runs has one bucket of ~8900 groups: with blocks of 8 and one program per SM each program loops over ~8 blocks
@pytest.mark.parametrize("base,launch", [
    ("block64_warps4", "block64_warps4_vector8"), ("block64_warps4", "block8_warps2_vector8_persist1_stages2"),
    ("block64_warps4", "block32_warps2_vector16_evict_persist2_stages3"), ("block64_warps4", "block64_warps4_evict"),
    ("block64_warps4_approx", "block16_warps2_vector8_evict_persist2_stages2_approx")])
def test_triton_step_launch_shapes_store_the_same_bytes(base, launch, monkeypatch):
    """A launch shape (triton_adam.LaunchShape) changes the speed only: from the same state and gradients
    each step stores the same bytes as the default shape's (with ``approx``: as the default shape's with
    ``approx``), also with per-group step counts (a parameter without gradient)."""
    runs = [(triton_adam.LaunchShape.from_name(name), *_kernel_runs("triton")) for name in (base, launch)]
    for step in range(3):
        grads = [torch.randn_like(p) * 1e-2 for p in runs[0][1].parameters()]
        for launch_shape, model, opt in runs:
            monkeypatch.setattr(triton_adam, "LAUNCH", launch_shape)
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            if step == 2:
                model[2].weight.grad = None
            opt.step()
            opt.zero_grad()
        assert_same_bits(stored_bits(*runs[0][1:]), stored_bits(*runs[1][1:]))
    assert roles.PREPARED[runs[1][2]].buckets[0].per_group


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(64, 64), (1000, 2056), (130, 7), (8192, 2048)])
def test_fp8_transpose_kernel_is_the_transposed_copy(shape, dtype):
    from flash_inductor.fp8_transpose import transpose_fp8

    t = (torch.randn(shape, device="cuda") * 100).to(dtype)
    out = transpose_fp8(t)
    assert out.shape == shape[::-1] and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), t.t().contiguous().view(torch.uint8))


def _backward_kernel_launches(model, x, **options):
    """{CUDA kernel: launches} of the second forward and backward of ``model`` compiled with
    ``options`` (the first compiles); ``model``'s gradients are that backward's."""
    from torch.profiler import ProfilerActivity, profile

    compiled = flash_inductor.compile(model, **options)
    compiled(x).float().square().mean().backward()
    model.zero_grad()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        compiled(x).float().square().mean().backward()
        torch.cuda.synchronize()
    return {e.key: e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.parametrize("fp8, transposes", [
    ("tensorwise", 4),  # 2 linears x (gradient, input), in the backward
    ("rowwise", 6),  # 2 linears x (gradient; input and weight, cast by columns in the forward)
])
def test_compiled_fp8_step_transposes_in_its_own_kernel(fp8, transposes):
    """The weight gradient's transposed operands (and row-wise's transposed weight) are launches of
    fp8_transpose's kernel, not fused into the norm (forward or backward) that produces the tensor;
    the gradients keep FP8's accuracy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.RMSNorm(512), nn.Linear(512, 512, bias=False)).cuda()
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    model(x).float().square().mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    launches = _backward_kernel_launches(model, x, fp8=fp8, **EVERY_LINEAR)
    assert launches.get("transpose_kernel") == transposes, launches
    for p, ref in zip(model.parameters(), reference):
        assert sqnr_db(ref.float(), p.grad.float()) >= 20, p.shape


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
def test_compiled_fp8_step_serves_every_token_count_from_one_graph(fp8):
    """A token count marked dynamic: Inductor's graphs take it as a symbol, ``_scaled_mm`` and
    fp8_transpose's kernel included, so later counts run without compiling again, and each count's
    gradients keep FP8's accuracy against fp32's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.RMSNorm(512), nn.Linear(512, 512, bias=False)).cuda()
    compiled = flash_inductor.compile(model, fp8=fp8, **EVERY_LINEAR)
    for i, tokens in enumerate((256, 384, 320, 300)):  # 300: padded to 304 for the weight gradients' K
        x = torch.randn(tokens, 512, device="cuda")
        model.zero_grad()
        model(x).float().square().mean().backward()
        reference = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled(x).float().square().mean().backward()
        for p, ref in zip(model.parameters(), reference):
            assert sqnr_db(ref.float(), p.grad.float()) >= 20, (tokens, p.shape)


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
def test_compiled_fp8_step_takes_a_token_count_off_16(fp8):
    """ViT's 4 images of 197 tokens: 788, the K of the weight-gradient GEMM, which ``_scaled_mm``
    refuses off 16 (the H100 failed to compile it); the tokens are zero-padded to 800."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)).cuda()
    x = torch.randn(4, 197, 512, device="cuda")
    model(x).float().square().mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    flash_inductor.compile(model, fp8=fp8, **EVERY_LINEAR)(x).float().square().mean().backward()
    for p, ref in zip(model.parameters(), reference):
        assert sqnr_db(ref.float(), p.grad.float()) >= 20, p.shape


def test_linears_reading_one_input_share_its_transposed_fp8_copy():
    """q, k and v projections of one input (fp8_transpose_cse): the backward transposes the input's
    e4m3 cast once, not three times, and its gradients are the bits of the backward that does not
    merge them."""

    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(512, 512, bias=False) for _ in range(3))

        def forward(self, x):
            return self.q(x) * self.k(x) + self.v(x)

    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    runs = []
    for disable in ((), ("fp8_transpose_cse",)):
        torch.manual_seed(0)
        model = QKV().cuda()
        launches = _backward_kernel_launches(model, x, fp8="tensorwise", **EVERY_LINEAR, disable=disable)
        runs.append((launches.get("transpose_kernel"), [p.grad.clone() for p in model.parameters()]))
        torch._dynamo.reset()
    assert runs[0][0] == 4 and runs[1][0] == 6, (runs[0][0], runs[1][0])  # 3 gradients + the input once, or 3 times
    for merged, separate in zip(runs[0][1], runs[1][1]):
        assert torch.equal(merged, separate)


def test_an_fp8_tensor_that_is_transposed_is_stored_once():
    """fp8_transpose_source: the e5m2 cast of a gradient that the transpose kernel and the dx GEMM
    both read is stored once, where without the pass Inductor stores it twice (a copy for the
    transpose, then the cast itself for the GEMM), and the gradients are the bits of that backward."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    runs = []
    for disable in ((), ("fp8_transpose_source",)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.RMSNorm(512), nn.Linear(512, 512, bias=False)).cuda()
        compiled = flash_inductor.compile(model, fp8="tensorwise", **EVERY_LINEAR, disable=disable)
        with torch._inductor.config.patch(fx_graph_cache=False, allow_buffer_reuse=False):  # one allocation a buffer
            _, codes = run_and_get_code(lambda: compiled(x).float().square().mean().backward())
        e5m2_buffers = sum(len(re.findall(r"empty_strided_cuda\([^\n]*torch\.float8_e5m2\)", code)) for code in codes)
        runs.append((e5m2_buffers, [p.grad.clone() for p in model.parameters()]))
    torch._dynamo.reset()
    # each linear's gradient: its cast and its transposed copy (4), and without the pass the cast twice (6)
    assert (runs[0][0], runs[1][0]) == (4, 6), (runs[0][0], runs[1][0])
    for once, twice in zip(runs[0][1], runs[1][1]):
        assert torch.equal(once, twice)


def test_fp8_linears_in_a_checkpointed_region_run_scaled_mm_in_forward_and_recompute():
    """A block under torch.utils.checkpoint: its linears run as FP8 GEMMs in the forward and again
    in the backward's recompute, and the gradients are FP8's against bf16's. The input needs no
    gradient, so without the checkpoint the backward runs 5 GEMMs (2 for each linear but the
    first's input gradient); with it, 1 or 2 more: the block's first linear recomputed (its output
    is the GELU's input, which the second's backward needs), and the second's unless the partitioner
    drops it (on the CPU's code: 2, tests/test_fp8_linear.py)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(512, 1024, bias=False), nn.GELU(), nn.Linear(1024, 512, bias=False))
    model = nn.ModuleList([block, nn.Linear(512, 512, bias=False)]).cuda().bfloat16()
    reference = copy.deepcopy(model)

    def forward(m, x, checkpointed=True):
        y = torch.utils.checkpoint.checkpoint(m[0], x, use_reentrant=False) if checkpointed else m[0](x)
        return m[1](x + y).float().square().mean()

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    gemms = {}
    for checkpointed in (False, True):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        compiled = flash_inductor.compile(lambda t: forward(model, t, checkpointed), fp8="tensorwise",
                                          **EVERY_LINEAR)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PassFailed)
            _, codes = run_and_get_code(lambda: compiled(x).backward())
        gemms[checkpointed] = [code.count("extern_kernels._scaled_mm(") for code in codes]
    forward(reference, x).backward()
    assert gemms[False] == [3, 5] and gemms[True][0] == 3 and gemms[True][1] - 5 in (1, 2), gemms
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert sqnr_db(p_ref.grad.float(), p.grad.float()) >= 20, name


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
def test_transformer_layers_attention_projections_run_as_fp8_gemms(fp8):
    """torch's ``nn.TransformerEncoderLayer``: its ``nn.MultiheadAttention`` call becomes
    ``fp8_multi_head_attention_forward``, so the forward runs 4 FP8 GEMMs (in- and out-projection,
    two MLP linears) and the backward 8 (each weight's and each input's gradient: the norms' weights
    need the in-projection's), with SDPA's attention between them; outputs and gradients keep the
    bars of the CPU test (tests/test_fp8_linear.py) against bf16's (this body on the CPU: outputs 38.4
    dB, gradients 20.3 dB or more)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    # GELU: with ReLU (the default) FP8's rounding flips the sign of pre-activations near zero, and
    # the first MLP linear's gradients fall to about 15 dB (21 with GELU; on the CPU, for any FP8 MLP)
    layer = nn.TransformerEncoderLayer(512, 8, 1024, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
    layer = layer.cuda().bfloat16()
    reference = copy.deepcopy(layer)
    x = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16)
    mask = nn.Transformer.generate_square_subsequent_mask(128, device="cuda", dtype=torch.bfloat16)
    compiled = flash_inductor.compile(lambda t: layer(t, src_mask=mask, is_causal=True), fp8=fp8, **EVERY_LINEAR)
    grad = torch.randn_like(x)

    def forward_backward():
        out = compiled(x)
        out.backward(grad)
        return out

    out, codes = run_and_get_code(forward_backward)
    ref = reference(x, src_mask=mask, is_causal=True)
    ref.backward(grad)
    assert [code.count("extern_kernels._scaled_mm(") for code in codes] == [4, 8]
    assert sqnr_db(ref.float(), out.float()) >= 22
    for (name, p), q in zip(layer.named_parameters(), reference.parameters()):
        assert sqnr_db(q.grad.float(), p.grad.float()) >= 18, name


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
def test_transposed_operands_and_rank_3_einsums_run_as_cuda_fp8_gemms(fp8):
    """The CUDA ``_scaled_mm`` wants its first operand row-major: a linear whose input and output
    gradient arrive laid out by columns (Hugging Face's Funnel) failed there before they were copied
    to rows. Einsums on parameters of rank 3 (XLNet's attention) run on the parameter's 2-D reshape.
    Inductor's code runs every GEMM in FP8 (Transposed: 1 forward, 2 backward; HeadEinsums: 2 and
    4), and outputs and gradients keep the CPU tests' bars (tests/test_fp8_linear.py)."""
    from test_fp8_linear import HeadEinsums, Transposed
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    cases = [(Transposed(), (torch.randn(64, 64),), [1, 2]),
             (HeadEinsums(), (torch.randn(8, 2, 64), torch.randn(8, 2, 4, 16)), [2, 4])]
    for model, inputs, expected_gemms in cases:
        torch._dynamo.reset()
        model = model.cuda().bfloat16()
        reference = copy.deepcopy(model)
        inputs = [t.cuda().bfloat16().requires_grad_() for t in inputs]
        inputs_ref = [t.detach().clone().requires_grad_() for t in inputs]
        compiled = flash_inductor.compile(model, fp8=fp8, **EVERY_LINEAR)
        outputs, grads = [], []

        def forward_backward():
            outs = compiled(*inputs)
            outputs.extend(outs if isinstance(outs, tuple) else [outs])
            grads.extend(torch.randn_like(o) for o in outputs)
            torch.autograd.backward(outputs, grads)

        with warnings.catch_warnings():
            warnings.simplefilter("error", PassFailed)
            _, codes = run_and_get_code(forward_backward)
        refs = reference(*inputs_ref)
        refs = list(refs) if isinstance(refs, tuple) else [refs]
        torch.autograd.backward(refs, grads)
        name = type(model).__name__
        assert [code.count("extern_kernels._scaled_mm(") for code in codes] == expected_gemms, name
        for out, ref in zip(outputs, refs):
            assert sqnr_db(ref.float(), out.float()) >= 25, name
        for (param, p), q in zip(model.named_parameters(), reference.parameters()):
            assert sqnr_db(q.grad.float(), p.grad.float()) >= 20, f"{name}.{param}"
        for t, t_ref in zip(inputs, inputs_ref):
            assert sqnr_db(t_ref.grad.float(), t.grad.float()) >= 20, name


@pytest.mark.parametrize("fp8", ["tensorwise", "delayed"])
def test_e4m3_gradients_compiled_for_cuda_gain_their_mantissa_bit(fp8):
    """``fp8_e4m3_gradients`` through Inductor's CUDA code and cuBLAS's e4m3 x e4m3 GEMMs: the
    forward is unchanged and both gradients come at least 3 dB closer to bf16's than with e5m2
    (the CPU tests' bar; 4.0 dB there)."""
    from test_fp8_linear import e4m3_gradient_gains

    same_forward, dx_gain, dw_gain = e4m3_gradient_gains(fp8, device="cuda", compiler="inductor")
    assert same_forward and dx_gain >= 3 and dw_gain >= 3, (dx_gain, dw_gain)


@pytest.mark.parametrize("fast_accum, tensorwise_weight_gradient", [(False, False), (True, False), (True, True)])
def test_rowwise_fp8_linear_compiled_for_cuda_matches_the_fp64_reference(fast_accum, tensorwise_weight_gradient):
    """``fp8="rowwise"`` through Inductor on CUDA: three row-wise ``_scaled_mm`` a linear (forward,
    input and weight gradients), each within bf16 rounding of the recipe's fp64 reference
    (tests/test_fp8_rowwise.py), give or take the tensor cores' summation error (below); with
    ``fp8_tensorwise_weight_gradient`` the weight gradient's operands have one scale each."""
    from test_fp8_rowwise import assert_within_bf16, reference_gemm, reference_rows, reference_rows_as_one_scale
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    layer = nn.Linear(512, 1024, bias=False).cuda().bfloat16()
    x = (torch.randn(256, 512, device="cuda") * torch.logspace(-2, 2, 256, device="cuda")[:, None]).bfloat16()
    x.requires_grad_()
    g = torch.randn(256, 1024, device="cuda").bfloat16()
    compiled = flash_inductor.compile(layer, fp8="rowwise", fp8_fast_accum=fast_accum,
                                      fp8_tensorwise_weight_gradient=tensorwise_weight_gradient, **EVERY_LINEAR)
    outputs = []

    def forward_backward():
        outputs.append(compiled(x))
        outputs[0].backward(g)

    with warnings.catch_warnings():
        warnings.simplefilter("error", PassFailed)
        _, codes = run_and_get_code(forward_backward)
    assert [code.count("extern_kernels._scaled_mm(") for code in codes] == [1, 2]
    y = outputs[0]
    w, xd = layer.weight.detach().cpu(), x.detach().cpu()
    gc = g.cpu()
    # FP8 tensor cores keep fewer bits than fp32 in their partial sums: past a bf16 rounding, the
    # H200's _scaled_mm is off by up to 2^-12.6 of the magnitude at K = 64, and 2^-11.1 with fast
    # accumulation at K = 8192, tensorwise and row-wise alike (benchmarks/fp8_accumulation.py).
    tensor_cores = 2.0**-11
    assert_within_bf16(y.detach().cpu(), reference_gemm(xd, w.t()),
                       reference_rows(xd).abs() @ reference_rows(w).abs().t(), accumulation=tensor_cores)
    assert_within_bf16(x.grad.cpu(), reference_gemm(gc, w), reference_rows(gc).abs() @ reference_rows(w.t()).abs().t(),
                       accumulation=tensor_cores)
    if tensorwise_weight_gradient:
        gt, xt = reference_rows_as_one_scale(gc).t(), reference_rows_as_one_scale(xd)
        assert_within_bf16(layer.weight.grad.cpu(), gt @ xt, gt.abs() @ xt.abs(), accumulation=tensor_cores)
    else:
        assert_within_bf16(layer.weight.grad.cpu(), reference_gemm(gc.t(), xd),
                           reference_rows(gc.t()).abs() @ reference_rows(xd.t()).abs().t(), accumulation=tensor_cores)


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
def test_stored_fp8_scales_keep_the_bits_and_leave_the_casts(fp8):
    """passes/fp8_scales_stored.py on CUDA: a linear's output and both gradients keep their bits, and,
    tensorwise, fewer power-of-two scale formulas (each one shift of an amax's bits, `` >> ``) are left
    in the Triton code: each is computed once, not in every kernel that casts by it. A lone row-wise
    linear leaves the pass nothing to save (7 formulas either way on an H100,
    ``benchmarks/results/gpu_tests_scalesfix_h100.log``): its casts by columns take their scales as
    ``transpose_fp8``'s input, stored anyway. In a Llama layer it still saves some
    (tests/test_fp8_layer_kernels.py)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    layer = nn.Linear(1024, 768, bias=False).cuda().bfloat16()
    x = (torch.randn(512, 1024, device="cuda") * torch.logspace(-3, 3, 1024, device="cuda")).bfloat16().requires_grad_()
    g = torch.randn(512, 768, device="cuda").bfloat16()
    runs, formulas = [], []
    for disable in ((), ("fp8_scales_stored",)):
        torch._dynamo.reset()
        x.grad = layer.weight.grad = None
        compiled = flash_inductor.compile(layer, fp8=fp8, fp8_power_of_two_scales=True, disable=disable, **EVERY_LINEAR)

        def forward_backward():
            y = compiled(x)  # noqa: B023 (called in this iteration)
            y.backward(g)
            return y.detach()

        y, codes = run_and_get_code(forward_backward)
        runs.append(dict(y=y, x_grad=x.grad.clone(), weight_grad=layer.weight.grad.clone()))
        formulas.append("".join(codes).count(" >> "))
    assert_same_bits(*runs)
    if fp8 == "tensorwise":
        assert formulas[0] < formulas[1], formulas


@pytest.mark.parametrize("gradient_format", ["e5m2", "e4m3"])
def test_fp8_gradients_step_matches_fp64_reference_on_inductors_kernel(gradient_format):
    """FP8 gradients on CUDA: the buckets go to Inductor's Triton kernel (which fuses the decode; the
    hand-written kernel reads bf16 gradients), held to the fp64 step from the decoded gradients."""
    model, opt = check_one_step_against_fp64_reference(*ADAM_CASES["AdamW"], device="cuda", compile_options={},
                                                       gradient_format=gradient_format)
    reasons = [triton_adam.ineligible(b, b.optimizer) for b in roles.PREPARED[opt].buckets]
    assert reasons and all("FP8 gradients" in r for r in reasons), reasons


def _four_train_steps(set_to_none=True, micro_batches=1, **options):
    """(losses, stored bits) of four ``@train_step`` steps of a small model (two linears around an
    RMSNorm, clipped; ``micro_batches`` backward passes a step), compiled afresh with the backend's
    ``options``; ``zero_grad(set_to_none)``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.RMSNorm(512), nn.Linear(512, 256, bias=False)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    @flash_inductor.train_step(model=model, optimizer=opt, **options)
    def step(x):
        for micro_batch in x.chunk(micro_batches):
            loss = model(micro_batch).float().square().mean()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss.detach()

    torch.manual_seed(1)
    losses = [step(torch.randn(128 * micro_batches, 256, device="cuda", dtype=torch.bfloat16)).item() for _ in range(4)]
    return losses, stored_bits(model, opt)


@pytest.mark.parametrize("fp8", [None, "tensorwise", "rowwise"])
def test_cudagraphs_train_step_stores_the_bits_of_the_ordinary_one(fp8):
    """``cudagraphs=True``: the forward and backward replay as CUDA graphs (none skipped), while the
    clipping and the step run as before, and four steps store exactly what the same steps store
    without CUDA graphs (the same kernels, replayed)."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    runs = []
    for cudagraphs in (False, True):
        counters.clear()
        runs.append(_four_train_steps(cudagraphs=cudagraphs, fp8=fp8, **EVERY_LINEAR))
        if cudagraphs:
            assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
            assert cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False).roots
    assert runs[0][0] == runs[1][0]
    assert_same_bits(runs[0][1], runs[1][1])


@pytest.mark.parametrize("set_to_none, micro_batches", [(False, 1), (True, 2), (False, 2)])
def test_cudagraphs_train_step_keeping_gradients_or_accumulating_stores_the_bits_without_cudagraphs(
        set_to_none, micro_batches):
    """``cudagraphs=True`` with gradients kept zeroed between steps (``zero_grad(set_to_none=False)``)
    or accumulated over two backward passes a step: the backward's graph returns each gradient in
    the CUDA graphs' pool, which its next replay overwrites; four steps store the bits of the same
    steps without CUDA graphs."""
    runs = [_four_train_steps(set_to_none, micro_batches, cudagraphs=cudagraphs) for cudagraphs in (False, True)]
    assert runs[0][0] == runs[1][0]
    assert_same_bits(runs[0][1], runs[1][1])


@pytest.mark.parametrize("cudagraphs", [False, True])
def test_train_step_kernel_reads_the_gradients_the_backward_returned(cudagraphs, monkeypatch):
    """Under ``@train_step`` (gradients landed at the step) the hand-written step reads each gradient
    the compiled backward returned where it is (with ``cudagraphs``: in the CUDA graphs' pool): no
    flat gradient buffer gets storage, and four steps store the bits of copying them in first."""
    held, kernel_step, unreadable = [], triton_adam.step, triton_adam.unreadable_gradient
    monkeypatch.setattr(triton_adam, "step", lambda bucket, o: held.append(bucket.gradients_held()) or kernel_step(bucket, o))
    runs = []
    for in_place in (True, False):
        monkeypatch.setattr(triton_adam, "unreadable_gradient", unreadable if in_place else COPY_EVERY_GRADIENT)
        runs.append(_four_train_steps(cudagraphs=cudagraphs))
    assert len(held) == 8 and held == [False] * 4 + [True] * 4, held
    assert runs[0][0] == runs[1][0]
    assert_same_bits(runs[0][1], runs[1][1])
