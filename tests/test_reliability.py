"""Bad and unusual input found by trying the product as a new user (issue 12): each case here was
silently wrong, crashed or was accepted when it should not be, and is pinned by a test that
failed before its fix. docs/reliability.md lists every case tried and the test that pins it.

References are stock ``torch.optim`` on fp32 parameters fed the same gradients, and the fp64
formulas of tests/reference.py.
"""

import copy
import gc
import importlib
import io
import weakref

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flash_inductor
from flash_inductor import roles
from flash_inductor.formats.state_tensor import CompandedState
from flash_inductor.optim import Lion
from helpers import EAGER, Net, assert_unchanged, snapshot, stored_bits
from reference import RefLion, ref_split_decode, ref_split_encode

pytestmark = [
    pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


class Params(nn.Module):
    """One bare parameter per shape, named p0, p1, ..."""

    def __init__(self, shapes, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape, generator=gen) * 0.5))


def master(model, opt, p):
    error = roles.PREPARED[opt].error_term(p)
    return p.detach().double() if error is None else ref_split_decode(p.detach(), error, 127)


def train_side_by_side(model, opt, ref_model, ref_opt, steps, seed=1):
    """``steps`` steps of both with the same random positive gradients (bf16-rounded, as bf16
    parameters get them): every element moves by about the lr each step, never back. Returns the
    prepared model's masters before training, by name."""
    gen = torch.Generator().manual_seed(seed)
    initial = {n: master(model, opt, p).clone() for n, p in model.named_parameters()}
    for _ in range(steps):
        for p, rp in zip(model.parameters(), ref_model.parameters()):
            g = (torch.rand(p.shape, generator=gen) + 0.5).bfloat16()
            p.grad, rp.grad = g.to(p.dtype), g.to(rp.dtype)
        opt.step()
        ref_opt.step()
    return initial


# ------------------------------------------------------------------ 1. last partial group of 32

RAGGED = [(4097,), (4100,), (5000,), (8191,), (1, 4097), (4097, 1)]
RAGGED_CASES = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD-momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    "Lion": (Lion, dict(lr=1e-3, weight_decay=0.1)),
}


class RaggedFp32(nn.Module):
    """fp32 parameters with 8-bit states whose size is not a multiple of 32 either: a kept-fp32
    linear bias and a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 5000)
        self.norm = nn.LayerNorm(5000)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RAGGED_CASES))
def test_last_partial_group_updates_under_inductor(name):
    """Inductor's C++ loop split dropped the last ``numel % 32`` elements of every parameter with
    8-bit states (flash_inductor/_compat.py): they never moved while their states advanced."""
    cls, kwargs = RAGGED_CASES[name]
    torch.manual_seed(0)
    model = nn.ModuleDict({"bare": Params(RAGGED), "fp32": RaggedFp32()})
    ref = copy.deepcopy(model)
    opt = cls(model.parameters(), **kwargs)
    ref_opt = RefLion(ref.double().parameters(), **kwargs) if cls is Lion else cls(ref.parameters(), **kwargs)
    flash_inductor.prepare(model, opt, keep_fp32=("fp32.lin",))
    assert all(isinstance(s, CompandedState) for p in model.parameters() for k, s in opt.state[p].items() if k != "step")
    initial = train_side_by_side(model, opt, ref, ref_opt, steps=3)
    for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
        got = master(model, opt, p).flatten()
        moved = got != initial[n].flatten()
        assert moved[-(p.numel() % 32 or 32):].all(), f"{n} {list(p.shape)}: the last group did not move"
        assert moved.all(), f"{n}: {(~moved).sum().item()} elements did not move"
        # Within what 8-bit states and bf16 gradients allow: a fraction of the lr per step.
        err = (got - rp.detach().double().flatten()).abs().max().item()
        assert err < 0.1 * kwargs["lr"] * 3, f"{n}: {err:.3g} off the fp32 reference"


def _sum_of_transposed_bf16(a, b, c):
    """A kernel that reads ``b`` and ``c`` across its vectorized dimension: Inductor's C++ code
    transposes a 32 x 32 tile of each."""
    return a.float() + 2 * b.t().float() + c.t().float()


def _bf16_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, 64, generator=g).to(torch.bfloat16) for _ in range(3)]


class FourierMix(nn.Module):
    """FNet's token mixing: no parameters, ``torch.fft.fftn`` (no bf16 kernel), a tuple out."""

    def forward(self, x):
        return (torch.fft.fftn(x, dim=(1, 2)).real,)


class FourierNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(mix=FourierMix(), norm=nn.LayerNorm(32))) for _ in range(2))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block.norm(h + block.mix(h)[0])
        return self.head(h).float().square().mean()


def _fourier_step(model, opt):
    def step(x):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def test_an_op_without_a_bf16_kernel_names_the_module_to_keep_fp32_and_changes_nothing():
    """``torch.fft.fftn`` has no bf16 kernel: under ``prepare`` a module calling it fails, where fp32
    training under autocast ran it in fp32. The error says which modules to keep in fp32 (a pattern
    prepare's ``keep_fp32`` takes) and nothing stored has changed."""
    model = FourierNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = flash_inductor.train_step(_fourier_step(model, opt), model=model, optimizer=opt, **EAGER)
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="BFloat16") as caught:
        step(torch.randn(2, 8, 16))
    assert any("keep_fp32=['blocks.*.mix']" in note for note in caught.value.__notes__), caught.value.__notes__
    assert_unchanged(before, snapshot(model, opt))


def test_a_module_without_parameters_kept_fp32_by_name_computes_in_fp32_and_trains_like_stock():
    """Named in ``keep_fp32``, the parameterless module gets fp32 inputs, and its tuple's fp32 output
    comes back bf16; the step follows stock fp32 AdamW on the fp32 model."""
    x = [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    stock = FourierNet()
    stock_opt = torch.optim.AdamW(stock.parameters(), lr=1e-3)
    expected = [_fourier_step(stock, stock_opt)(xi).item() for xi in x]
    model = FourierNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = flash_inductor.train_step(_fourier_step(model, opt), model=model, optimizer=opt, keep_fp32=["blocks.*.mix"],
                                     **EAGER)
    seen = []
    model.blocks[0].mix.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out[0].dtype)))
    losses = [step(xi).item() for xi in x]
    assert seen[0] == (torch.bfloat16, torch.bfloat16)  # the hook sees the module's own call, outside the casts
    assert model.embed.weight.dtype == torch.bfloat16
    assert losses == pytest.approx(expected, rel=0.02), (losses, expected)


def test_bf16_tiles_read_transposed_compile_to_the_eager_result():
    """Where Inductor's 512-bit C++ code transposes bf16 tiles wrongly (torch 2.13, g++ 12.2,
    AVX-512; flash_inductor/_compat.py), the backend compiles with 256-bit vectors: a Granite MoE's
    FP8 backward had returned NaN gradients."""
    inputs = _bf16_inputs()
    torch._dynamo.reset()
    got = torch.compile(_sum_of_transposed_bf16, backend="flashoptim")(*inputs)
    torch.testing.assert_close(got, _sum_of_transposed_bf16(*inputs), rtol=0, atol=0)


def test_the_transpose_probe_says_what_stock_inductor_computes():
    """``_compat.cpp_transposes_bf16_tiles_wrongly`` is True exactly where stock ``torch.compile``
    gets the transposed bf16 sum wrong on this machine (3,948 of 4,096 elements, where it is)."""
    from flash_inductor import _compat

    inputs = _bf16_inputs()
    torch._dynamo.reset()
    stock = torch.compile(_sum_of_transposed_bf16, backend="inductor")(*inputs)
    assert _compat.cpp_transposes_bf16_tiles_wrongly() == (not torch.equal(stock, _sum_of_transposed_bf16(*inputs)))


# ------------------------------------------------------------------ 2. model.load_state_dict after prepare


def _prepared_net():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    model(torch.randn(8, 128).bfloat16()).float().sum().backward()
    opt.step()  # error terms hold something other than zero now
    opt.zero_grad()
    return model, opt


def test_loading_fp32_weights_after_prepare_gives_their_exact_split():
    model, opt = _prepared_net()
    loaded = Net().state_dict()  # fp32, other values
    model.load_state_dict(loaded)
    record = roles.PREPARED[opt]
    for name, p in model.named_parameters():
        error = record.error_term(p)
        if error is None:  # LayerNorm, kept fp32
            assert torch.equal(p.detach(), loaded[name])
            continue
        hi, lo, _ = ref_split_encode(loaded[name].double(), 127)
        assert torch.equal(p.detach().double(), hi), name
        assert torch.equal(error.long(), lo), name


def test_loading_bf16_weights_after_prepare_resets_the_error_terms():
    model, opt = _prepared_net()
    loaded = {k: v.bfloat16() if k.startswith("fc") else v for k, v in Net().state_dict().items()}
    model.load_state_dict(loaded)
    for name, p in model.named_parameters():
        error = roles.PREPARED[opt].error_term(p)
        if error is not None:
            assert torch.equal(p.detach(), loaded[name]) and not error.any(), name


def test_resume_that_loads_the_optimizer_before_the_model_keeps_the_error_terms():
    model, opt = _prepared_net()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    expected = stored_bits(model, opt)
    model2, opt2 = _prepared_net()
    model2(torch.randn(8, 128).bfloat16()).float().sum().backward()
    opt2.step()  # somewhere else
    opt2.load_state_dict(saved_opt)
    model2.load_state_dict(saved_model)
    got = stored_bits(model2, opt2)
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []


def test_load_state_dict_with_assign_is_refused_before_anything_changes():
    model, opt = _prepared_net()
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="assign=True"):
        model.load_state_dict(Net().state_dict(), assign=True)
    assert_unchanged(before, snapshot(model, opt))


# ------------------------------------------------------------------ 3. a second optimizer on one model


def test_second_optimizer_on_the_same_model_keeps_its_fp32_masters():
    torch.manual_seed(0)
    model = Net()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    first = torch.optim.AdamW(model.fc1.parameters(), lr=1e-3)
    second = torch.optim.SGD(model.fc2.parameters(), lr=1e-2, momentum=0.9)
    with pytest.warns(UserWarning, match="fc2.weight"):
        flash_inductor.prepare(model, first, compile_options=EAGER)
    assert model.fc2.weight.dtype == torch.bfloat16  # the model is cast whole, as before
    flash_inductor.prepare(model, second, compile_options=EAGER)
    for opt, name in ((first, "fc1.weight"), (second, "fc2.weight")):
        p = dict(model.named_parameters())[name]
        hi, lo, _ = ref_split_encode(original[name].double(), 127)
        assert torch.equal(p.detach().double(), hi) and torch.equal(roles.PREPARED[opt].error_term(p).long(), lo), name


# ------------------------------------------------------------------ 7-8. hyperparameters


def test_tensor_betas_are_used_in_fp32():
    torch.manual_seed(0)
    model, ref = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(torch.tensor(0.9), torch.tensor(0.999)))  # fp32 params
    flash_inductor.prepare(model, opt, state_bits=None, compile_options=EAGER)
    train_side_by_side(model, opt, ref, ref_opt, steps=2)
    for key in ("exp_avg", "exp_avg_sq"):
        got, want = opt.state[model.weight][key].decode(), ref_opt.state[ref.weight][key]
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), key  # bf16 betas: 6.5e-3 off


def test_one_cycle_lr_changing_momentum_with_gradient_release_names_momentum_and_the_fix(monkeypatch):
    """The flat step reads SGD's momentum from a tensor (test_optimizer_numerics.py, section 4), but
    gradient release steps each parameter with its group's floats as constants: OneCycleLR's
    cycling momentum recompiles every step there, and is refused naming momentum and the fix."""
    # The recompile limit grows with the steps this process ran (steps.run_compiled_step): start
    # from none, as in a fresh process (fresh_dynamo emptied Dynamo's cache).
    monkeypatch.setattr(importlib.import_module("flash_inductor.steps"), "_run_step_count", 0)
    model = nn.Linear(64, 64, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    flash_inductor.prepare(model, opt, compile_options=EAGER, gradient_release=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['momentum'\].*cycle_momentum=False"):
        for _ in range(40):
            model(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean().backward()
            opt.step()
            sched.step()


@pytest.mark.parametrize("prepared_with,then", [(0.9, 0.0), (0.0, 0.9)], ids=["to-zero", "from-zero"])
def test_momentum_moved_to_or_from_zero_is_refused_before_anything_changes(prepared_with, then):
    """A schedule may move SGD's momentum, but not to or from 0: stock SGD then skips or creates its
    momentum buffer, which a prepared step (its buffers laid out at prepare, its update traced with
    momentum) cannot do. Refused, naming the param group and the fix; nothing is written."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=prepared_with)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = snapshot(model, opt)
    opt.param_groups[0]["momentum"] = then
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['momentum'\] became .* prepare the optimizer with the momentum"):
        opt.step()
    assert_unchanged(before, snapshot(model, opt))
    opt.param_groups[0]["momentum"] = prepared_with
    opt.step()  # and the optimizer still steps
    assert not torch.equal(before["fc1.weight"], model.fc1.weight)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_a_zero_lr_step_leaves_the_weights_and_advances_the_states_like_stock(cls):
    """A warmup's first step (lr 0: Trainer's default linear schedule with warmup) with gradients
    that are zero in places (embedding rows not in the batch): stock torch leaves every weight as it
    is and advances the states. The bucket optimizers run Adam's capturable form, which wrote nan
    where the second moment was 0 (0 / -0; pytorch #126514): a Trainer run trained on nan."""
    torch.manual_seed(0)
    model = Net()  # 8-bit and fp32 states, bf16 weights and the fp32 LayerNorm: three buckets
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), lr=0.0, weight_decay=0.1), cls(ref.parameters(), lr=0.0, weight_decay=0.1)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    before, ref_before = stored_bits(model, opt), copy.deepcopy(ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    for p, rp in zip(model.parameters(), ref.parameters()):
        g = torch.randn(p.shape, generator=gen).bfloat16()
        g.view(-1)[::3] = 0
        p.grad, rp.grad = g.to(p.dtype), g.to(rp.dtype)
    opt.step()
    ref_opt.step()
    after = stored_bits(model, opt)
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in ref_before.items())  # the reference: no weight moves
    weights = [k for k in before if k in dict(model.named_parameters()) or k.endswith(".error")]
    assert len(weights) == 8 and all(torch.equal(after[k], before[k]) for k in weights)
    for p, rp in zip(model.parameters(), ref.parameters()):
        assert float(opt.state[p]["step"]) == 1
        # within a code step and the top's saturation (a bf16 scale rounded toward zero: up to 2**-7 of
        # sqrt(v), 2**-6 of v)
        for key, tolerance in (("exp_avg", 0.01), ("exp_avg_sq", 0.01 + 2.0**-6)):
            got, want = opt.state[p][key].decode(), ref_opt.state[rp][key]
            assert want.abs().max() > 0 and (got - want).abs().max() <= tolerance * want.abs().max(), key
    opt.param_groups[0]["lr"].fill_(1e-2)  # as a scheduler does after the warmup step
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, before[n]) for n, p in model.named_parameters())


# ------------------------------------------------------------------ 9. parameters prepare did not see coming


def test_non_contiguous_parameter_with_8bit_states_trains_like_stock():
    torch.manual_seed(0)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(128, 64).t())
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt, min_quantized_numel=1, compile_options=EAGER)
    initial = train_side_by_side(model, opt, ref, ref_opt, steps=3)
    got = master(model, opt, model.w)
    assert (got != initial["w"]).all()
    assert (got - ref.w.detach().double()).abs().max() < 0.1 * 1e-2 * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_param_group_added_after_prepare_is_prepared(dtype):
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.fc1.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.fc1.parameters(), lr=1e-2)
    with pytest.warns(UserWarning):  # fc2 is in no optimizer yet
        flash_inductor.prepare(model, opt, compile_options=EAGER)
    model.fc2.weight.data = model.fc2.weight.data.to(dtype)
    extra = model.fc2.weight
    opt.add_param_group({"params": [extra], "lr": 1e-3})
    ref_opt.add_param_group({"params": [ref.fc2.weight], "lr": 1e-3})
    assert extra.dtype == dtype and isinstance(opt.state[extra]["exp_avg"], CompandedState)
    assert (roles.PREPARED[opt].error_term(extra) is not None) == (dtype == torch.bfloat16)
    model.norm.requires_grad_(False), ref.norm.requires_grad_(False)
    initial = train_side_by_side(nn.ModuleList([model.fc1, model.fc2]), opt, nn.ModuleList([ref.fc1, ref.fc2]), ref_opt, 3)
    got = master(model, opt, extra)
    assert (got != initial["1.weight"]).all()
    assert (got - ref.fc2.weight.detach().double()).abs().max() < 0.1 * 1e-3 * 3


# ------------------------------------------------------------------ 10. copies


def test_deepcopy_of_a_prepared_optimizer_is_a_prepared_optimizer_of_the_copies():
    model, opt = _prepared_net()
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt2.param_groups[0]["params"][0] is model2.fc1.weight and model2.fc1.weight is not model.fc1.weight
    x = torch.randn(8, 128).bfloat16()
    for m, o in ((model, opt), (model2, opt2)):
        m(x).float().sum().backward()
        o.step()
        o.zero_grad()
    mine, theirs = stored_bits(model, opt), stored_bits(model2, opt2)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    opt2.step()  # its own step: the original's bits stay
    assert all(torch.equal(mine[k], v) for k, v in stored_bits(model, opt).items())


def test_torch_save_of_a_prepared_model_with_norm_layers_round_trips():
    model, _ = _prepared_net()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(8, 128).bfloat16()
    assert torch.equal(loaded(x), model(x))


# ------------------------------------------------------------------ 11. whose parameters


def _refused(make_optimizers, match):
    torch.manual_seed(0)
    model, other = Net(), Net()
    optimizers = make_optimizers(model, other)
    for opt in optimizers[:-1]:
        flash_inductor.prepare(model, opt, compile_options=EAGER)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        flash_inductor.prepare(model, optimizers[-1], compile_options=EAGER)
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes
    assert optimizers[-1] not in roles.PREPARED


def test_prepare_refuses_an_optimizer_of_another_model():
    _refused(lambda model, other: [torch.optim.AdamW(other.parameters())], "not a parameter of the Net")


def test_prepare_refuses_a_parameter_twice_in_one_optimizer():
    def make(model, other):
        opt = torch.optim.AdamW(model.parameters())
        opt.param_groups[0]["params"].append(model.fc1.weight)
        return [opt]

    _refused(make, "'fc1.weight' appears twice")


def test_prepare_refuses_two_optimizers_over_one_parameter():
    _refused(lambda model, other: [torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.fc2.parameters(), lr=0.1)],
             "'fc2.weight' is already held by another prepared AdamW")


# ------------------------------------------------------------------ shapes, as a property

# Every size from 1 to 300 and 4096 +- 64, 0-dim and empty tensors, transposed and sliced (odd
# strides) parameters: drawn by hypothesis, several per optimizer (one compile each).
SIZES = st.one_of(st.integers(1, 300), st.integers(4096 - 64, 4096 + 64))
SHAPES = st.one_of(
    SIZES.map(lambda n: (n,)),
    st.sampled_from([(), (0,), (0, 7), (3, 0)]),
    st.tuples(st.integers(1, 40), st.integers(1, 40)),
)


def _strided(shape, kind, gen):
    """A parameter of ``shape`` whose storage is laid out oddly: transposed, or a strided slice."""
    if kind == "transposed" and len(shape) == 2:
        return torch.randn(shape[::-1], generator=gen).t()
    if kind == "sliced" and len(shape) == 1:
        return torch.randn(shape[0] * 3, generator=gen)[::3]
    return torch.randn(shape, generator=gen)


@pytest.mark.slow
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(st.tuples(SHAPES, st.sampled_from(["dense", "transposed", "sliced"])), min_size=4, max_size=6))
@example(shapes=[((), "dense"), ((0,), "dense"), ((4097,), "sliced"), ((33, 7), "transposed"), ((1,), "dense")])
def test_compiled_step_of_any_shape_matches_stock_adamw(shapes):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    model = nn.Module()
    for i, (shape, kind) in enumerate(shapes):
        model.register_parameter(f"p{i}", nn.Parameter(_strided(shape, kind, gen) * 0.5))
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt, min_quantized_numel=1)
    initial = train_side_by_side(model, opt, ref, ref_opt, steps=2)
    for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
        got = master(model, opt, p)
        assert got.shape == rp.shape
        if p.numel():
            assert (got != initial[n]).all(), f"{n} {list(p.shape)}: some elements did not move"
            assert (got - rp.detach().double()).abs().max() < 0.1 * 1e-2 * 2, n


@pytest.mark.slow
def test_compiled_step_keeps_no_gradient_alive():
    """The backend's post-grad pass object lives as long as the compiled step; it held the graph
    inputs of the first call, so that call's gradients were never freed (2 B/param on the H200)."""
    model = nn.Linear(64, 64, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flash_inductor.prepare(model, opt)
    model.weight.grad = torch.randn(64, 64).bfloat16()
    first = weakref.ref(model.weight.grad)
    opt.step()
    opt.zero_grad()
    gc.collect()
    assert first() is None
