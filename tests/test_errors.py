"""Clear errors for unsupported input, and bad input never corrupts state.

- ``prepare`` refuses what it cannot support with a message that names the optimizer option /
  parameter and says how to fix it, and leaves the model and optimizer as they were.
- At step time (sparse gradient, wrong gradient dtype, ``check_numerics`` with an lr that cannot
  move the weights) the error names the parameter, and parameters, error terms and states keep
  every bit.
- Parameters without gradients are skipped, as stock torch does.
- Backend options are validated with the valid names in the message.
"""

import dataclasses
import re

import pytest
import torch
import torch.nn as nn
from torch._dynamo.exc import BackendCompilerFailed

import flash_inductor
from flash_inductor import passes, roles
from helpers import EAGER, Net, assert_unchanged, snapshot

pytestmark = [
    pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


def snapshot_model(model):
    return {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()}


# ------------------------------------------------------------------------ errors at prepare time


def _sgd(**kw):
    return lambda params: torch.optim.SGD(params, lr=0.1, **kw)


def _adamw(**kw):
    return lambda params: torch.optim.AdamW(params, lr=1e-3, **kw)


# name -> (optimizer factory, extra parameter, prepare kwargs, exception, patterns the message must
# contain: what is wrong (option / parameter name) and the fix)
CASES = {
    "unsupported_class": (lambda ps: torch.optim.RMSprop(ps), None, {}, TypeError, [r"RMSprop", r"AdamW", r"SGD"]),
    "fused": (_adamw(fused=True), None, {}, ValueError, [r"fused=True", r"fused=None"]),
    "differentiable": (_adamw(differentiable=True), None, {}, ValueError, [r"differentiable=True", r"differentiable=False"]),
    "sgd_dampening": (_sgd(momentum=0.9, dampening=0.1), None, {}, ValueError, [r"dampening=0\.1", r"dampening=0\b"]),
    "fp64_param": (
        _adamw(), nn.Parameter(torch.zeros(8, dtype=torch.float64)), {}, TypeError, [r"extra", r"float64", r"float\(\)"],
    ),
    "complex_param": (_adamw(), nn.Parameter(torch.zeros(8, dtype=torch.complex64)), {}, TypeError, [r"extra", r"complex64"]),
    "int_param": (
        _sgd(), nn.Parameter(torch.zeros(8, dtype=torch.int64), requires_grad=False), {}, TypeError, [r"extra", r"int64"],
    ),
    "state_bits_4": (_adamw(), None, {"state_bits": 4}, ValueError, [r"state_bits", r"8 or None"]),
    "master_weight_bits_16": (
        _adamw(), None, {"master_weight_bits": 16}, ValueError, [r"master_weight_bits", r"24", r"32", r"None"],
    ),
    "bad_compile_option": (_adamw(), None, {"compile_options": {"bogus": 1}}, ValueError, [r"bogus", r"compiler", r"disable"]),
    "bucket_numel_0": (_adamw(), None, {"bucket_numel": 0}, ValueError, [r"bucket_numel", r"positive int", r"None"]),
}

def _attempt(case):
    make_opt, extra, kw, exc, _ = CASES[case]
    kw = dict(kw)
    torch.manual_seed(0)
    model = Net(extra)
    opt = make_opt(model.parameters())
    before = snapshot_model(model)
    lr_before = [g["lr"] for g in opt.param_groups]
    with pytest.raises(exc) as info:
        flash_inductor.prepare(model, opt, compile_options=kw.pop("compile_options", EAGER), **kw)
    return model, opt, before, lr_before, str(info.value)


@pytest.mark.parametrize("case", list(CASES))
def test_prepare_error_names_the_problem_and_the_fix(case):
    message = _attempt(case)[-1]
    for pattern in CASES[case][-1]:
        assert re.search(pattern, message), (pattern, message)


@pytest.mark.parametrize("case", list(CASES))
def test_prepare_error_leaves_model_and_optimizer_untouched(case):
    model, opt, before, lr_before, _ = _attempt(case)
    after = snapshot_model(model)
    assert {n: d for n, (d, _) in after.items()} == {n: d for n, (d, _) in before.items()}
    for n in before:
        assert torch.equal(after[n][1], before[n][1]), n
    assert opt not in roles.PREPARED
    assert [g["lr"] for g in opt.param_groups] == lr_before
    assert all(len(s) == 0 for s in opt.state.values())


def test_preparing_twice_is_refused_without_changes():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"AdamW.*already prepared"):
        flash_inductor.prepare(model, opt, compile_options=EAGER)
    assert_unchanged(before, snapshot(model, opt))


# --------------------------------------------------------------------------- errors at step time


class Embedder(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.emb = nn.Embedding(256, 32, sparse=sparse)  # 8192: 8-bit momentum

    def forward(self, idx):
        return self.fc1(self.emb(idx))


def test_sparse_gradient_is_refused_and_nothing_changes():
    torch.manual_seed(0)
    model = Embedder(sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    model(torch.randint(0, 256, (16,))).float().square().mean().backward()
    assert model.emb.weight.grad.is_sparse and model.fc1.weight.grad is not None
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match=r"'emb\.weight'.*sparse.*sparse=False"):
        opt.step()
    assert_unchanged(before, snapshot(model, opt))


def test_gradient_of_another_dtype_is_refused_and_nothing_changes():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model.fc2.weight.grad_dtype = None  # torch would refuse the assignment otherwise
    model.fc2.weight.grad = torch.randn(model.fc2.weight.shape)  # fp32 gradient, bf16 parameter
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match=r"'fc2\.weight'.*float32.*bfloat16"):
        opt.step()
    assert_unchanged(before, snapshot(model, opt))


def _one_linear(largest=1.5):
    """A bf16 Linear whose largest |w| is exactly ``largest`` (so hi = largest, error term 0)."""
    torch.manual_seed(0)
    model = nn.Module()
    model.fc = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        model.fc.weight.uniform_(-1, 1)
        model.fc.weight[0, 0] = largest
    return model


def _code_step(largest=1.5):
    """One error-term code of a 24-bit master at |w| = largest (DESIGN §2.1): half ULP of bf16 / 127."""
    exponent = torch.frexp(torch.tensor(largest, dtype=torch.float64))[1].item() - 1
    return 2.0 ** (exponent - 7 - 1) / 127


def _master(model, opt, index=(0, 0)):
    """Decoded master of one element, DESIGN §2.1 in float64."""
    p = model.fc.weight
    hi = p.detach()[index].double()
    lo = roles.PREPARED[opt].error_term(p)[index].double()
    exponent = torch.frexp(hi)[1].item() - 1
    return float(hi + lo / 127 * 2.0 ** (exponent - 8))


def test_check_numerics_refuses_an_lr_too_small_to_move_the_weights():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-12)
    flash_inductor.prepare(model, opt, check_numerics=True, compile_options=EAGER)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = snapshot(model, opt)
    with pytest.raises(ValueError) as info:
        opt.step()
    message = str(info.value)
    assert "fc1.weight" in message and "lr=1e-12" in message
    assert "master_weight_bits=32" in message and "check_numerics=False" in message and "raise lr" in message
    assert_unchanged(before, snapshot(model, opt))
    # a normal lr passes, and the step happens
    opt.param_groups[0]["lr"].fill_(1e-3)
    opt.step()
    assert not torch.equal(model.fc1.weight.detach(), before["fc1.weight"])


@pytest.mark.parametrize("fraction, moves", [(0.4, False), (0.6, True)])
def test_check_numerics_threshold_is_where_updates_round_away(fraction, moves):
    """SGD, grad 1, lr = fraction * (one 24-bit code at the largest weight): below half a code the
    update rounds back to the same master (checked with check_numerics=False), and exactly then
    check_numerics=True refuses the lr."""
    lr = fraction * _code_step()
    for check in (False, True):
        torch._dynamo.reset()
        model = _one_linear()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        flash_inductor.prepare(model, opt, check_numerics=check, compile_options=EAGER)
        assert model.fc.weight[0, 0].item() == 1.5 and _master(model, opt) == 1.5
        model.fc.weight.grad = torch.ones_like(model.fc.weight)
        if check and not moves:
            with pytest.raises(ValueError, match=r"'fc\.weight'"):
                opt.step()
            assert _master(model, opt) == 1.5
            continue
        opt.step()
        assert (_master(model, opt) != 1.5) == moves
        if moves:
            assert _master(model, opt) == pytest.approx(1.5 - _code_step(), rel=0, abs=1e-12)


def test_check_numerics_accepts_lr_zero():
    """lr = 0 (e.g. the first warmup step) is a deliberate no-op, not an lr that rounds away."""
    model = _one_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    flash_inductor.prepare(model, opt, check_numerics=True, compile_options=EAGER)
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    opt.step()
    assert _master(model, opt) == 1.5


# ------------------------------------------------------- parameters replaced after prepare

def _flat_storage(opt):
    """Every flat buffer of the prepared optimizer's buckets: what its step updates."""
    out = {}
    for i, bucket in enumerate(roles.PREPARED[opt].buckets):
        tensors = dict(weights=bucket.weights, errors=bucket.errors, step=bucket.step)
        for key, state in bucket.states.items():
            tensors.update({f"{key}.{name}": getattr(state, name) for name in state.__tensor_flatten__()[0]})
        out.update({f"{i}.{k}": t.clone() for k, t in tensors.items() if t is not None})
    return out


REPLACEMENTS = {
    "model.float()": lambda model: model.float(),
    # what model.to(another device) does to each parameter: p.data = a copy
    "model.to(device)": lambda model: model._apply(torch.clone),
    ".data = ...": lambda model: setattr(model.fc2.weight, "data", model.fc2.weight.data.clone()),
}


@pytest.mark.parametrize("when", ["before backward", "between backward and step", "gradient release"])
@pytest.mark.parametrize("replace", list(REPLACEMENTS))
def test_a_parameter_replaced_after_prepare_is_refused_and_nothing_changes(replace, when):
    """``model.float()``, ``.half()``, ``model.to(device)`` or ``p.data = ...`` after ``prepare`` give a
    parameter a tensor the step does not update (it updates the flat storage): backward's hook or the
    step names the parameter and the fix, before writing anything. Stock torch would train the new
    tensor, so the step must not silently leave it as it is."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt, compile_options=EAGER, gradient_release=when == "gradient release")
    before = _flat_storage(opt)
    x = torch.randn(8, 128)
    message = r"parameter '.*' \(torch\.\w+ on cpu\) no longer holds the storage.*before prepare\(model, optimizer\)"
    if when == "between backward and step":
        model(x.bfloat16()).float().square().mean().backward()
        REPLACEMENTS[replace](model)
        with pytest.raises(RuntimeError, match=message):
            opt.step()
    else:
        REPLACEMENTS[replace](model)
        with pytest.raises(RuntimeError, match=message):
            model(x.to(model.fc2.weight.dtype)).float().square().mean().backward()
    assert_unchanged(before, _flat_storage(opt))


# ------------------------------------------------------------------ parameters without gradients


def test_parameters_without_gradients_are_skipped_like_stock_torch():
    torch.manual_seed(0)
    model = Net()
    stock_model = Net()
    stock_model.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stock = torch.optim.AdamW(stock_model.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    record = roles.PREPARED[opt]
    frozen = {"fc2.weight", "norm.weight"}
    before = snapshot(model, opt)
    for (name, p), sp in zip(model.named_parameters(), stock_model.parameters()):
        if name not in frozen:
            g = torch.randn(p.shape)
            p.grad, sp.grad = g.to(p.dtype), g
    stock_before = {n: p.detach().clone() for n, p in stock_model.named_parameters()}
    opt.step()
    stock.step()
    after = snapshot(model, opt)
    for name, p in model.named_parameters():
        keys = [k for k in before if k == name or k.startswith(name + ".")]
        if name in frozen:
            assert all(torch.equal(before[k], after[k]) for k in keys), name
            assert torch.equal(dict(stock_model.named_parameters())[name].detach(), stock_before[name])
            assert len(stock.state[dict(stock_model.named_parameters())[name]]) == 0  # stock: never touched
            assert float(opt.state[p]["step"]) == 0.0
        else:
            assert not torch.equal(before[name], after[name]) or not torch.equal(
                before.get(name + ".error", before[name]), after.get(name + ".error", after[name])
            ), name
            assert float(opt.state[p]["step"]) == 1.0
    # next step with every gradient: the skipped ones take their first step, as in stock torch
    for p, sp in zip(model.parameters(), stock_model.parameters()):
        g = torch.randn(p.shape)
        p.grad, sp.grad = g.to(p.dtype), g
    opt.step()
    stock.step()
    for p, sp in zip(model.parameters(), stock_model.parameters()):
        assert float(opt.state[p]["step"]) == float(stock.state[sp]["step"])
    assert record.error_term(model.fc2.weight) is not None


# ----------------------------------------------------------------------- silent fallbacks


def test_sequential_model_steps_with_split_weights():
    """nn.Sequential parameter names start with a digit; the split-weights pass must still apply
    (a skipped pass warns PassFailed, which this module turns into an error)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    record = roles.PREPARED[opt]
    errors = {n: record.error_term(p).clone() for n, p in model.named_parameters() if record.error_term(p) is not None}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for name, p in model.named_parameters():
        if name in errors:
            assert not torch.equal(errors[name], record.error_term(p)), name


def test_many_prepared_optimizers_all_update_their_error_terms():
    for i in range(torch._dynamo.config.recompile_limit + 1):
        model = nn.Module()
        model.fc = nn.Linear(32, 32, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        flash_inductor.prepare(model, opt, compile_options=EAGER)
        error = roles.PREPARED[opt].error_term(model.fc.weight)
        before = error.clone()
        model.fc.weight.grad = torch.randn_like(model.fc.weight)
        opt.step()
        assert not torch.equal(before, error), f"optimizer {i}: error term not updated"


def test_a_changed_weight_decay_inside_a_compiled_train_step_recompiles_the_step():
    """A whole train step compiled by the user, with weight decay changed between steps: the
    prepared step runs its own compiled step (under ``specialize_float``), so the change recompiles
    it and takes effect. (Traced inline, Dynamo made the changed float a graph input read with
    ``.item()``, which the storage passes cannot rewrite.)"""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    flash_inductor.prepare(model, opt, compile_options=EAGER)

    @torch.compile(backend="flashoptim", options=EAGER)
    def step(x):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    x = torch.randn(4, 128, dtype=torch.bfloat16)
    step(x)
    opt.param_groups[0]["weight_decay"] = 0.05
    before = snapshot(model, opt)
    step(x)
    assert not torch.equal(before["fc1.weight"], model.fc1.weight)
    buckets = roles.PREPARED[opt].buckets
    assert all(b.optimizer.param_groups[0]["weight_decay"] == 0.05 for b in buckets)


def test_a_step_the_passes_cannot_rewrite_fails_loudly_instead_of_compiling_without_them(monkeypatch):
    """A pass that the stored format needs and that fails on a graph with prepared tensors stops
    the compile (compiling without it would update the stored codes as values), naming the pass;
    nothing is written."""
    def broken(gm, ctx):
        raise RuntimeError("cannot rewrite this graph")

    monkeypatch.setattr(passes, "TORCH_PASSES", tuple(
        p if p.name != "companded_states" else dataclasses.replace(p, fn=broken) for p in passes.TORCH_PASSES))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = snapshot(model, opt)
    with pytest.raises(BackendCompilerFailed, match=r"(?s)pass 'companded_states' could not rewrite.*cannot rewrite this graph"):
        opt.step()
    assert_unchanged(before, snapshot(model, opt))

class _ClampsItsWeight(nn.Module):
    """A model that writes its own weight in its forward: a clamp under ``no_grad`` before the linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.clamp_(-0.1, 0.1)
        return self.out(torch.relu(self.fc(x)))


def _clamping_step(keep_fp32):
    torch.manual_seed(0)
    model = _ClampsItsWeight()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt, keep_fp32=keep_fp32, compile_options=EAGER)

    @flash_inductor.train_step(model=model, optimizer=opt, **EAGER)
    def step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, opt, step


def test_a_model_that_writes_its_prepared_weight_in_its_forward_names_it_and_the_fix():
    """A forward that clamps a split (bf16 + error term) weight in place cannot compile: the storage pass
    that would store the write fails on the model's graph. The error names the parameter and the way out
    (keep its module fp32), nothing is written, and kept fp32 the model trains with its clamp."""
    model, opt, step = _clamping_step(keep_fp32=())
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    before = snapshot(model, opt)
    with pytest.raises(BackendCompilerFailed, match=r"(?s)writes the prepared parameters \['fc\.weight'\].*keep_fp32"):
        step(x, y)
    assert_unchanged(before, snapshot(model, opt))

    model, opt, step = _clamping_step(keep_fp32=["fc"])
    losses = [step(x, y).item() for _ in range(3)]
    # clamped in the last forward, then one step of lr 1e-2
    assert model.fc.weight.dtype == torch.float32 and model.fc.weight.abs().max() <= 0.1 + 1.5e-2
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------- backend options


def test_unknown_backend_option_lists_valid_options():
    f = lambda x: x + 1  # noqa: E731
    with pytest.raises(ValueError) as info:
        flash_inductor.compile(f, bogus=1)
    assert "bogus" in str(info.value)
    for option in ("compiler", "disable", "dump", "inductor"):
        assert option in str(info.value)
    # through torch.compile the backend raises the same ValueError at the first call; Dynamo wraps
    # every backend exception in BackendCompilerFailed (torch behaviour, not the backend's)
    compiled = torch.compile(f, backend="flashoptim", options={"bogus": 1})
    with pytest.raises((ValueError, BackendCompilerFailed)) as info:
        compiled(torch.ones(3))
    inner = info.value if isinstance(info.value, ValueError) else info.value.inner_exception
    assert isinstance(inner, ValueError)
    assert "bogus" in str(inner) and all(o in str(inner) for o in ("compiler", "disable", "dump", "inductor"))


def test_disabling_an_unknown_pass_names_known_passes():
    f = lambda x: x * 2  # noqa: E731
    with pytest.raises(ValueError) as info:
        flash_inductor.compile(f, disable=["nope"])
    assert all(name in str(info.value) for name in ("nope", "split_weights", "companded_states"))
    compiled = torch.compile(f, backend="flashoptim", options={"disable": ["nope"]})
    with pytest.raises((ValueError, BackendCompilerFailed)) as info:
        compiled(torch.ones(3))
    inner = info.value if isinstance(info.value, ValueError) else info.value.inner_exception
    assert isinstance(inner, ValueError)
    assert all(name in str(inner) for name in ("nope", "split_weights", "companded_states"))
    # a known pass is accepted
    compiled = torch.compile(f, backend="flashoptim", options={"disable": ["split_weights"]})
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))


def test_inductor_option_overrides_defaults_but_cannot_turn_off_precision_casts(monkeypatch):
    """``options={"inductor": ...}`` reaches Inductor for a rewritten optimizer step and overrides
    Inductor's defaults and keeps the backend's others (no pattern matcher);
    ``emulate_precision_casts`` stays on, and asking to turn it off is refused up front."""
    seen = []
    compile_fx = flash_inductor.backend.compile_fx
    monkeypatch.setattr(flash_inductor.backend, "compile_fx",
                        lambda *a, config_patches=None, **k: seen.append(config_patches) or compile_fx(*a, **k))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    flash_inductor.prepare(model, opt, compile_options={"inductor": {"eager_numerics.division_rounding": False,
                                                                     "emulate_precision_casts": True}})
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert seen  # one graph per flat bucket of the step
    for patches in seen:
        assert patches["eager_numerics.division_rounding"] is False and patches["emulate_precision_casts"] is True
        assert patches["pattern_matcher"] is False  # a default for optimizer steps, not overridden here
    with pytest.raises(ValueError, match="cannot turn emulate_precision_casts off"):
        flash_inductor.compile(lambda x: x, inductor={"emulate_precision_casts": False})
