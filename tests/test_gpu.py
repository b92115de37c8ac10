"""GPU (CUDA + Triton) checks: run on the H200 with ``pytest -m gpu tests``; skipped without CUDA."""

import pytest
import torch
import torch.nn as nn

import flash_inductor
from flash_inductor import roles
from helpers import stored_bits

pytestmark = pytest.mark.gpu


def _prepared(compiler, foreach=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach)
    flash_inductor.prepare(model, opt, compile_options={"compiler": compiler})
    return model, opt


@pytest.mark.xfail(
    strict=True,
    reason="seen on the H200 (torch 2.11, 2026-11-29): after one AdamW step some bf16 parameters differ from the "
    "op-by-op CUDA run of the same rewritten graph by up to 2e-4 (more than one bf16 ulp); cause not found yet. "
    "On CPU the Inductor and op-by-op runs agree bit for bit (tests/test_optimizer_numerics.py).",
)
@pytest.mark.parametrize("foreach", [False, True])
def test_triton_step_matches_eager_rewrite_and_keeps_error_terms(foreach):
    """One step from the same state: the Triton kernels and the op-by-op rewritten graph agree up
    to one rounding step (FMA contraction may differ)."""
    triton_model, triton_opt = _prepared("inductor", foreach)
    eager_model, eager_opt = _prepared("eager", foreach)
    grads = [torch.randn_like(p) * 1e-2 for p in triton_model.parameters()]
    for model, opt in ((triton_model, triton_opt), (eager_model, eager_opt)):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
    grad_of = {name: g for (name, _), g in zip(triton_model.named_parameters(), grads)}
    eager = stored_bits(eager_model, eager_opt)
    for key, a in stored_bits(triton_model, triton_opt).items():
        b = eager[key]
        if a.is_floating_point():  # bf16 params, fp16 scales: at most one ulp apart
            ulp = torch.finfo(a.dtype).eps * b.float().abs().clamp(min=torch.finfo(a.dtype).tiny)
            bad = ((a.float() - b.float()).abs() > ulp).nonzero()
            # Say enough to diagnose from the log alone: where, the two values, the gradient there.
            details = [(tuple(i.tolist()), a[tuple(i)].item(), b[tuple(i)].item(),
                        grad_of[key][tuple(i)].item() if key in grad_of else None) for i in bad[:5]]
            assert len(bad) == 0, f"{key}: {len(bad)} of {a.numel()} differ; (index, triton, eager, grad): {details}"
        else:  # error terms and codes: at most one code apart
            assert (a.int() - b.int()).abs().max() <= 1, key
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
