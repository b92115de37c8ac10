"""``flash_inductor.memory_report``: bytes per parameter read off the tensors that hold them.

Expected byte counts are computed here from element counts and DESIGN.md §2.1-2.3 (bf16 weights
2 B, int8/int16 error terms 1/2 B, one 1-byte code per state element padded to groups of 32 plus
one fp16 scale per group, fp32 for states of tensors under ``min_quantized_numel``), never from
what ``flash_inductor`` returns. The stock-torch baseline is checked the same way.
"""

import pytest
import torch
import torch.nn as nn

import flash_inductor
from flash_inductor.formats.state_tensor import CompandedState, StateTensor
from flash_inductor.optim import SGDW, Lion
from helpers import EAGER

pytestmark = [
    pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

MIN_Q = 4096
GROUP = 32
COMPONENTS = ("weights", "error_terms", "states", "state_scales", "grads")




class Big(nn.Module):
    """Every weight a multiple of 32 elements and >= min_quantized_numel (no biases)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(128, 64, bias=False)  # 8192
        self.fc2 = nn.Linear(64, 256, bias=False)  # 16384
        self.out = nn.Linear(256, 32, bias=False)  # 8192

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Mixed(nn.Module):
    """Big and small tensors, a norm layer (stays fp32) and a weight that is not a multiple of 32."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(100, 50)  # weight 5000 (not a multiple of 32), bias 50
        self.norm = nn.LayerNorm(50)  # fp32, 50 + 50
        self.fc2 = nn.Linear(50, 128, bias=False)  # 6400

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


def numel(model):
    return sum(p.numel() for p in model.parameters())


def backward(model, dtype=torch.bfloat16):
    torch.manual_seed(1)
    x = torch.randn(8, model.fc1.in_features, dtype=dtype)
    model(x).float().square().mean().backward()


def prepared(model_cls, opt_cls, *, steps=1, **kw):
    torch.manual_seed(0)
    model = model_cls()
    opt_kw = kw.pop("opt_kw", {})
    opt = opt_cls(model.parameters(), **opt_kw)
    flash_inductor.prepare(model, opt, compile_options=EAGER, min_quantized_numel=MIN_Q, **kw)
    for _ in range(steps):
        opt.zero_grad()
        backward(model)
        opt.step()
    return model, opt


def as_dict(report):
    assert set(report.bytes) == set(COMPONENTS)
    return dict(report.bytes)


# ------------------------------------------------------------------------------ DESIGN §2.3 table

# optimizer -> (constructor kwargs, number of 8-bit states per parameter)
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-3), 2),
    "Adam": (torch.optim.Adam, dict(lr=1e-3), 2),
    "SGD-momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9), 1),
    "SGDW-momentum": (SGDW, dict(lr=1e-2, momentum=0.9), 1),
    "Lion": (Lion, dict(lr=1e-4), 1),
    "SGD-plain": (torch.optim.SGD, dict(lr=1e-2), 0),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bytes_per_param_table(name):
    """AdamW 24-bit/8-bit: weights 2, error terms 1, states 2 + 1/8, grads 2 (DESIGN §2.3);
    one-state optimizers (SGD momentum, Lion): states 1 + 1/16."""
    opt_cls, opt_kw, n_states = OPTIMIZERS[name]
    model, opt = prepared(Big, opt_cls, opt_kw=opt_kw)
    n = numel(model)
    assert n % GROUP == 0
    expected = {
        "weights": 2 * n,
        "error_terms": 1 * n,
        "states": n_states * n,
        "state_scales": n_states * (n // GROUP) * 2,
        "grads": 2 * n,
    }
    report = flash_inductor.memory_report(model, opt)
    assert as_dict(report) == expected
    assert report.num_params == n
    per = report.per_param()
    table = {"weights": 2, "error_terms": 1, "states": n_states, "state_scales": n_states / 16, "grads": 2}
    assert per == pytest.approx(table, rel=0, abs=1e-12)
    assert report.total_per_param == pytest.approx(sum(table.values()), abs=1e-12)
    if name == "AdamW":
        assert report.total_per_param == pytest.approx(7.125)  # "≈7.1" in the table
    if name == "SGD-momentum":
        assert report.total_per_param == pytest.approx(6.0625)  # "≈6.1"


@pytest.mark.parametrize("bits, error_bytes", [(24, 1), (32, 2), (None, 0)])
def test_error_term_bytes_follow_master_weight_bits(bits, error_bytes):
    model, opt = prepared(Big, torch.optim.AdamW, opt_kw=dict(lr=1e-3), master_weight_bits=bits)
    n = numel(model)
    report = as_dict(flash_inductor.memory_report(model, opt))
    assert report["error_terms"] == error_bytes * n
    assert report["weights"] == 2 * n
    assert report["states"] == 2 * n


def test_state_bits_none_keeps_fp32_states():
    model, opt = prepared(Big, torch.optim.AdamW, opt_kw=dict(lr=1e-3), state_bits=None)
    n = numel(model)
    report = as_dict(flash_inductor.memory_report(model, opt))
    assert report["states"] == 2 * 4 * n
    assert report["state_scales"] == 0


def test_stock_fp32_adamw_baseline():
    """Unprepared stock fp32 AdamW after one step: weights 4, error 0, states 8, scales 0, grads 4
    (the 'step' counters are not parameter-sized and are not counted)."""
    torch.manual_seed(0)
    model = Big()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backward(model, torch.float32)
    opt.step()
    n = numel(model)
    report = flash_inductor.memory_report(model, opt)
    assert as_dict(report) == {"weights": 4 * n, "error_terms": 0, "states": 8 * n, "state_scales": 0, "grads": 4 * n}
    assert report.total_per_param == 16


def expected_mixed(model, n_states, error_bytes=1):
    """Per-tensor expectation for models with small / fp32 / unaligned tensors."""
    exp = dict.fromkeys(COMPONENTS, 0)
    for name, p in model.named_parameters():
        # Flat storage: each tensor takes whole groups of 32 (one at least) in every buffer.
        n = max(GROUP, -(-p.numel() // GROUP) * GROUP)
        is_norm = name.startswith("norm.")
        elem = 4 if is_norm else 2
        exp["weights"] += elem * n
        exp["grads"] += elem * n
        if not is_norm:
            exp["error_terms"] += error_bytes * n
        if n >= MIN_Q:
            groups = -(-n // GROUP)
            exp["states"] += n_states * groups * GROUP  # codes are padded to whole groups
            exp["state_scales"] += n_states * groups * 2
        else:
            exp["states"] += n_states * 4 * n  # unquantized: fp32
    return exp


def test_mixed_model_counts_each_tensor_as_stored():
    model, opt = prepared(Mixed, torch.optim.AdamW, opt_kw=dict(lr=1e-3))
    assert model.norm.weight.dtype == torch.float32 and model.fc1.weight.dtype == torch.bfloat16
    assert as_dict(flash_inductor.memory_report(model, opt)) == expected_mixed(model, 2)


def test_grads_after_zero_grad_and_frozen_params():
    """With gradients released (None) the report predicts the flat gradient buffer of trainable
    parameters; parameters frozen at prepare are laid out apart and never get one."""
    model, opt = prepared(Big, torch.optim.SGD, opt_kw=dict(lr=1e-2, momentum=0.9))
    opt.zero_grad(set_to_none=True)
    n = numel(model)
    assert as_dict(flash_inductor.memory_report(model, opt))["grads"] == 2 * n
    torch.manual_seed(0)
    model = Big()
    model.fc2.weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    backward(model)
    opt.step()
    assert model.fc2.weight.grad is None
    assert as_dict(flash_inductor.memory_report(model, opt))["grads"] == 2 * (n - model.fc2.weight.numel())


def test_report_rejects_foreign_parameters():
    model, opt = prepared(Big, torch.optim.AdamW, opt_kw=dict(lr=1e-3), steps=0)
    with pytest.raises(ValueError, match="not parameters of the model"):
        flash_inductor.memory_report(Big(), opt)
    assert flash_inductor.memory_report(None, opt).num_params == numel(model)


# --------------------------------------------------------------- nothing fp32 is allocated for states


def stored_tensors(value):
    """The tensors that really hold a state (inner tensors of a tensor subclass)."""
    if isinstance(value, StateTensor):
        names, _ = value.__tensor_flatten__()
        return [getattr(value, n) for n in names]
    return [value] if isinstance(value, torch.Tensor) else []


@pytest.mark.parametrize("name", ["AdamW", "SGD-momentum", "Lion"])
def test_prepare_allocates_no_fp32_states(name):
    opt_cls, opt_kw, n_states = OPTIMIZERS[name]
    model, opt = prepared(Big, opt_cls, opt_kw=opt_kw, steps=0)
    before = {}
    for p in model.parameters():
        state = opt.state[p]
        big = [k for k, v in state.items() if k != "step"]
        assert len(big) == n_states
        for key in big:
            assert isinstance(state[key], CompandedState), (key, type(state[key]))
        for key, value in state.items():
            for t in stored_tensors(value):
                assert t.element_size() <= 2 or t.numel() == 1, (key, t.dtype, t.shape)
                assert not (t.dtype == torch.float32 and t.numel() >= p.numel())
        before[p] = {k: [t.data_ptr() for t in stored_tensors(v)] for k, v in state.items()}
    # A step updates the stored form in place: same storage, still no fp32 state.
    backward(model)
    opt.step()
    for p in model.parameters():
        state = opt.state[p]
        assert {k: [t.data_ptr() for t in stored_tensors(v)] for k, v in state.items()} == before[p]
        for key, value in state.items():
            if key != "step":
                assert isinstance(value, CompandedState)
                assert all(t.element_size() <= 2 for t in stored_tensors(value))
    n = numel(model)
    assert as_dict(flash_inductor.memory_report(model, opt))["states"] == n_states * n


class _GatedBlock(nn.Module):
    """A pre-norm block with a SiLU-gated MLP (Llama's): the norm's output and ``silu(gate) * up``
    are elementwise results that only matmuls read in the backward."""

    def __init__(self, width=64, hidden=256):
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


@pytest.mark.usefixtures("fresh_dynamo")
def test_recompute_elementwise_saves_fewer_activations_for_the_same_gradients():
    """Option ``recompute_elementwise``: the compiled forward saves fewer activations for the backward
    (counted by autograd's saved-tensor hooks: what the compiled graph hands to autograd), exactly the
    norms' outputs and the gated products, and the gradients are those of saving them (the same bits
    on the CPU)."""
    runs = {}
    for recompute in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(_GatedBlock(), _GatedBlock()).to(torch.bfloat16)
        loss = flash_inductor.compile(lambda x: model(x).float().square().mean(), recompute_elementwise=recompute)
        weights, saved = {p.untyped_storage().data_ptr() for p in model.parameters()}, []

        def pack(t):  # the activations' bytes (the weights are saved too, and cost nothing)
            saved.append(0 if t.untyped_storage().data_ptr() in weights else t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = loss(torch.randn(128, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)))
        value.backward()
        runs[recompute] = sum(saved), [p.grad for p in model.parameters()]
    (kept, grads), (recomputed, recomputed_grads) = runs[False], runs[True]
    # per block: the norm's output (128 x 64) and silu(gate) * up (128 x 256), bf16
    assert kept - recomputed == 2 * (128 * 64 + 128 * 256) * 2, (kept, recomputed)
    assert all(torch.equal(a, b) for a, b in zip(grads, recomputed_grads))
