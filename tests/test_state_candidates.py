"""benchmarks/state_candidates.py and state_fidelity.py (issue 14): the state formats measured on
the H200 by emulation are the formats they name.

- ``round_states(opt, "companded")`` after each step of fp32 states (``state_bits=None``) stores
  what the package's own 8-bit states store, stepped on the same gradients: the emulated rows of
  hf_clients.py (``+emulate_NAME``) train with the format, not an approximation of it.
- ``fp16_scales`` (DESIGN §2.2's scales, the package's until issue 14) loses tiny groups,
  ``bf16_scales`` (as measured) and the package's bf16 scales keep them.
- ``state_fidelity.Shadows``' exact moments are torch AdamW's.
"""

import copy

import torch
import torch.nn as nn

import flash_inductor
from flash_inductor.formats import companded
from flash_inductor.formats.state_tensor import CompandedState
from helpers import benchmark_module

STEPS = 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 40))  # 8192 and 5120 elements: quantized


def _step_both(runs, candidates):
    """Steps every run on the same gradients, rows scaled from 1e-9 to 1 (tiny groups included), and
    rounds each run's states through its candidate (None: none) after each step."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen) * torch.logspace(-9, 0, p.shape[0]).view(-1, *[1] * (p.dim() - 1))
                 for p in runs[0][0].parameters()]
        for (model, opt), name in zip(runs, candidates):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.to(p.dtype)
            opt.step()
            opt.zero_grad()
            if name:
                candidates_module.round_states(opt, name)


candidates_module = benchmark_module("state_candidates")


def test_emulated_companded_states_are_the_packages():
    base = _model()
    runs = []
    for state_bits in (8, None):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        flash_inductor.prepare(model, opt, state_bits=state_bits, compile_options={"compiler": "eager"})
        runs.append((model, opt))
    _step_both(runs, (None, "companded"))
    (real, real_opt), (emulated, emulated_opt) = runs
    for p_real, p_emulated in zip(real.parameters(), emulated.parameters()):
        assert torch.equal(p_real, p_emulated)
        for key, state in real_opt.state[p_real].items():
            if key == "step":
                continue
            got = emulated_opt.state[p_emulated][key].decode(p_emulated.shape)
            want = state.decode(p_real.shape)
            assert isinstance(state, CompandedState) == (p_real.numel() >= 4096)
            assert torch.equal(got, want), key


def test_scale_candidates_keep_or_lose_tiny_groups_as_named():
    """``fp16_scales`` (DESIGN's) decodes groups below fp16's range to zero; ``bf16_scales`` (bf16
    rounded to nearest, as measured on the H200) and the package (bf16, mostly to nearest) keep every one.
    Elsewhere the three differ only by their scales' rounding and a code."""
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(64, 32, generator=gen) * torch.logspace(-12, 2, 64)[:, None]
    stores = candidates_module.CANDIDATES
    for index, kind in enumerate((companded.SIGNED, companded.SQRT)):
        x = rows if kind == companded.SIGNED else rows.square()
        package = stores["companded"][index](x, None)
        bf16 = stores["bf16_scales"][index](x, None)
        fp16 = stores["fp16_scales"][index](x, None)
        nonzero = (x != 0).any(dim=1)
        assert int(((fp16 == 0).all(dim=1) & nonzero).sum()) >= 8  # the groups below fp16's range
        assert torch.equal((package != 0).any(dim=1), nonzero) and torch.equal((bf16 != 0).any(dim=1), nonzero)
        # within two code steps of the group's largest value: the scales' rounding (2**-7 relative
        # at most) and a code
        absmax = x.abs().amax(dim=1, keepdim=True)
        step = absmax * 2 / 127 if kind == companded.SIGNED else absmax * 4 / 255  # v: 2 sqrt(v) d sqrt(v)
        normal = (x.sqrt() if kind == companded.SQRT else x).abs().amax(dim=1) >= 2.0**-14
        assert ((fp16 - package).abs() <= step)[normal].all()
        assert ((bf16 - package).abs() <= step).all()


def test_shadow_exact_moments_are_torch_adamws():
    fidelity = benchmark_module("state_fidelity")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    shadows = fidelity.Shadows(model.named_parameters(), ["companded"], (0.9, 0.95), 1e-8)
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        stats = shadows.step(measure=True)
        opt.step()
    assert set(stats["companded"]["all"]) == {"relerr", "bias", "damped", "inflated", "numel"}
    assert 0 < stats["companded"]["all"]["relerr"] < 0.1
    for (name, p), start, end in zip(shadows.params, shadows.starts, shadows.ends):
        m, v = (t.view(-1)[start * 32:start * 32 + p.numel()].view(p.shape) for t in shadows.moments["exact"])
        torch.testing.assert_close(m, opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-6)  # torch: lerp
        torch.testing.assert_close(v, opt.state[p]["exp_avg_sq"], rtol=1e-5, atol=1e-7)
