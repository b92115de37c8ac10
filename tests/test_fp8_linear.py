"""FP8 linear layers through the backend (option fp8="tensorwise"), on CPU (the FP8 GEMMs multiply
the float8 operands as fp32 there: ``flash_inductor.fp8_linear._scaled_mm``)."""

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor import fp8_linear
from flash_inductor.demo import TinyGPT, lm_train_step
from flash_inductor.formats import fp8
from helpers import EAGER, decisions_of

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.body = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.odd = nn.Linear(64, 20)  # 20 is not a multiple of 16
        self.proj = nn.Parameter(torch.randn(32, 64) * 0.1)

    def forward(self, x):
        h = self.body(self.first(x))
        return self.odd(h), h @ self.proj.T


def test_eligible_linears_are_rewritten_and_every_decision_is_reported():
    model = Mixed()
    options = dict(EAGER, fp8="tensorwise", fp8_min_weight_numel=0, fp8_exclude=["first"],
                   fp8_filter=lambda name: name != "body.2")
    report = flash_inductor.inspect(flash_inductor.compile(model, **options), torch.randn(4, 64))
    graph = report.graph("model")
    decisions = decisions_of(report)
    assert decisions == {
        "first.weight": "bf16: excluded by fp8_exclude ['first']",
        "body.0.weight": "fp8 e4m3/e5m2",
        "body.2.weight": "bf16: rejected by fp8_filter",
        "odd.weight": "bf16: weight 20x64: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)",
        "proj": "fp8 e4m3/e5m2",
    }
    code = next(s.code for s in graph.stages if s.name == "fp8_linear")
    assert code.count("flash_inductor_fp8_linear_fp8_linear(") == 2
    assert code.count("torch._C._nn.linear(") == 3
    summary = report.summary()
    assert "fp8_linear: odd.weight: bf16: weight 20x64" in summary


@pytest.mark.parametrize("wrap", [lambda m: m, lambda m: torch.compile(m, backend="eager")], ids=["module", "compiled module"])
def test_a_model_captured_by_the_step_is_named_as_its_parameters(wrap):
    """A train step reaches its model through a closure of a function it calls
    (``loss.__closure__[0].cell_contents``), maybe a compiled module (``_orig_mod``): the weights
    are still named as ``named_parameters()`` names them, so ``fp8_exclude`` patterns match
    (the ``lm_head`` of benchmarks/hf_clients.py's Llama ran in FP8 before)."""
    model = wrap(Mixed())

    def loss(x):
        out, projected = model(x)
        return out.sum() + projected.sum()

    def step(x):
        return loss(x)

    options = dict(EAGER, fp8="tensorwise", fp8_min_weight_numel=0, fp8_exclude=["first", "body.*"])
    report = flash_inductor.inspect(flash_inductor.compile(step, **options), torch.randn(4, 64))
    decisions = decisions_of(report)
    assert decisions == {
        "first.weight": "bf16: excluded by fp8_exclude ['first', 'body.*']",
        "body.0.weight": "bf16: excluded by fp8_exclude ['first', 'body.*']",
        "body.2.weight": "bf16: excluded by fp8_exclude ['first', 'body.*']",
        "odd.weight": "bf16: weight 20x64: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)",
        "proj": "fp8 e4m3/e5m2",
    }


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 32)

    def forward(self, x):
        return self.qkv(x).relu()


class _BlockWithGraphBreak(nn.Module):
    """A block whose forward breaks the graph (a print, as a model's logging does): Dynamo compiles
    its attention's forward and what follows the break as frames of their own, which it names within
    the submodule (``qkv.weight``, ``fc.weight``), and runs the latter for every block."""

    def __init__(self):
        super().__init__()
        self.attn, self.fc = _Attention(), nn.Linear(32, 32)

    def forward(self, x):
        x = self.attn(x)
        print("a graph break")
        return self.fc(x)


def _blocks_with_graph_breaks():
    torch.manual_seed(0)
    return nn.Sequential(*[_BlockWithGraphBreak() for _ in range(3)]).bfloat16()


def test_layers_in_frames_after_a_graph_break_are_named_and_excluded_as_the_model_names_them():
    """The report, ``fp8_exclude`` and ``fp8_filter`` see ``1.attn.qkv.weight`` where Dynamo's frame
    says ``qkv.weight``: a pattern naming the model's layers keeps them in bf16 (before, a Hugging Face
    vision tower excluded by ``model.visual.*`` ran in FP8)."""
    model = _blocks_with_graph_breaks()
    options = dict(EAGER, fp8="tensorwise", fp8_min_weight_numel=0, fp8_exclude=["*.fc"],
                   fp8_filter=lambda name: name != "0.attn.qkv")
    report = flash_inductor.inspect(flash_inductor.compile(model, **options), torch.randn(16, 32, dtype=torch.bfloat16))
    decisions = {subject: decision for g in report.graphs for p, subject, decision in g.decisions if p == "fp8_linear"}
    assert len(report.graphs) > 1  # the graph break
    assert decisions["0.attn.qkv.weight"] == "bf16: rejected by fp8_filter"
    assert decisions["1.attn.qkv.weight"] == "fp8 e4m3/e5m2"
    assert decisions["0.fc.weight"] == "bf16: excluded by fp8_exclude ['*.fc']"
    assert all(name[0].isdigit() for name in decisions), decisions  # no name within a submodule


def test_a_graph_run_for_several_modules_refuses_patterns_that_choose_differently_for_them():
    """The frame after the break serves every block with the decisions made for block 0's ``fc``:
    a pattern that keeps block 1's in bf16 but not block 0's is refused at block 1's call, naming
    both layers, before that graph runs with a choice the pattern did not make."""
    model = _blocks_with_graph_breaks()
    step = flash_inductor.compile(model, **EAGER, fp8="tensorwise", fp8_min_weight_numel=0, fp8_exclude=["1.*"])
    with pytest.raises(ValueError, match=r"keep 0\.fc\.weight in FP8 but not 1\.fc\.weight.*one compiled graph"):
        step(torch.randn(16, 32, dtype=torch.bfloat16))


def test_size_threshold_keeps_small_layers_in_bf16():
    model = nn.Linear(64, 64)
    report = flash_inductor.inspect(flash_inductor.compile(model, **EAGER, fp8="tensorwise"), torch.randn(4, 64))
    ((_, subject, decision),) = report.graph("model").decisions
    assert decision == f"bf16: weight 64x64 is under fp8_min_weight_numel={1 << 20}"


def test_gemms_under_fp8_min_gemm_size_stay_bf16_and_say_their_size():
    """The rows a linear multiplies count: the same 64x64 weight in FP8 at 32 rows (131072 =
    32 x 64 x 64) and bf16 at 16, with the GEMM's size in the reason."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"wide": nn.Linear(64, 64, bias=False), "narrow": nn.Linear(64, 64, bias=False)})

    def step(x):
        return model["wide"](x).sum() + model["narrow"](x[:16]).sum()

    options = dict(EAGER, fp8="tensorwise", fp8_min_weight_numel=0, fp8_min_gemm_size=32 * 64 * 64)
    decisions = decisions_of(flash_inductor.inspect(flash_inductor.compile(step, **options), torch.randn(32, 64)))
    assert decisions == {
        "wide.weight": "fp8 e4m3/e5m2",
        "narrow.weight": "bf16: GEMM 16x64x64 (tokens x in x out) is under fp8_min_gemm_size=131072: "
                         "its casts would cost more than FP8 saves",
    }


@pytest.mark.parametrize("least, expected", [(32 * 64 * 128, "fp8"), (32 * 64 * 128 + 1, "bf16: GEMM 32x64x128")])
def test_gemm_size_decides_inside_a_checkpointed_region_too(least, expected):
    block = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU())

    def loss(x):
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum()

    options = dict(EAGER, fp8="tensorwise", fp8_min_weight_numel=0, fp8_min_gemm_size=least)
    decisions = decisions_of(flash_inductor.inspect(flash_inductor.compile(loss, **options), torch.randn(32, 64)))
    assert decisions["0.weight"].startswith(expected), decisions


def test_a_dynamic_token_count_is_decided_at_its_hint():
    """Compiled for a dynamic batch (``mark_dynamic``), the rows are a symbol: the decision takes the
    size it is first compiled for."""
    layer = nn.Linear(64, 64, bias=False)
    options = dict(EAGER, fp8="tensorwise", fp8_min_weight_numel=0, fp8_min_gemm_size=32 * 64 * 64)
    for rows, expected in ((32, "fp8"), (16, "bf16: GEMM 16x64x64")):
        torch._dynamo.reset()
        x = torch.randn(rows, 64)
        torch._dynamo.mark_dynamic(x, 0)
        report = flash_inductor.inspect(flash_inductor.compile(layer, **options), x)
        assert "Sym(" in report.graph("model").stages[0].code, "the rows are not symbolic"
        assert decisions_of(report)["weight"].startswith(expected)


class _Heads(nn.Module):
    """A projection split into attention heads and joined back, with sizes read from the input, as
    Hugging Face's attention does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.proj(x).view(b, t, 4, 16).transpose(1, 2)
        return heads.transpose(1, 2).reshape(b, t, 64)


@pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed")
@pytest.mark.parametrize("fp8_mode", ["tensorwise", "rowwise"])
def test_an_fp8_graph_compiled_for_a_dynamic_sequence_length_serves_every_length(fp8_mode):
    """The passes' type check ran the rewritten graph in a fake mode of its own, on copies of the
    inputs with concrete sizes: a reshape by the symbolic length then pinned the length to the
    one compiled for, so each new length recompiled, and a length marked dynamic failed with a
    ConstraintViolationError."""
    model = _Heads()
    compiled = flash_inductor.compile(model, **EAGER, fp8=fp8_mode, fp8_min_weight_numel=0)
    x = torch.randn(2, 32, 64)
    torch._dynamo.mark_dynamic(x, 1)
    assert decisions_of(flash_inductor.inspect(compiled, x))["proj.weight"].startswith("fp8")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in (48, 40, 33):  # 66 tokens: padded to 80, without a guard on 16's divisibility
            x = torch.randn(2, length, 64)
            y = compiled(x)
            assert y.shape == (2, length, 64)
            assert fp8.sqnr_db(model(x), y).item() >= 25
            y.sum().backward()  # the tokens are the weight gradient's K


def test_an_inductor_step_compiled_for_a_dynamic_token_count_pads_counts_off_16_without_compiling_again():
    """Through Inductor (AOTAutograd's functionalization), padding by a tensor of the missing rows alone
    guarded on their number being 0, so the first count off 16 compiled the step again (the H100's
    test_compiled_fp8_step_serves_every_token_count_from_one_graph); the rows are written into zeros instead."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.RMSNorm(64), nn.Linear(64, 64, bias=False))
    compiled = flash_inductor.compile(model, fp8="tensorwise", fp8_min_weight_numel=0)
    for i, tokens in enumerate((32, 48, 30, 17)):
        x = torch.randn(tokens, 64)
        if i == 0:
            torch._dynamo.mark_dynamic(x, 0)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled(x).float().square().mean().backward()
        assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_fp8_min_gemm_size_defaults_to_the_h200_measurement_on_cuda_only():
    """FP8 on the CPU is an emulation (for tests): no size pays there, so no GEMM is too small; on
    CUDA the default is where an FP8 linear started to pay on the H200 (docs/benchmarks.md)."""
    from flash_inductor.options import FP8_MIN_GEMM_SIZE_CUDA, Options

    default, chosen = Options.from_dict({}), Options.from_dict({"fp8_min_gemm_size": 7})
    assert (default.min_gemm_size("cuda"), default.min_gemm_size("cpu")) == (FP8_MIN_GEMM_SIZE_CUDA, 0)
    assert FP8_MIN_GEMM_SIZE_CUDA == 1 << 35 and (chosen.min_gemm_size("cuda"), chosen.min_gemm_size("cpu")) == (7, 7)


@pytest.mark.parametrize("fast_accum", [False, True])
def test_fast_accum_option_reaches_the_forward_gemm_only(fast_accum, monkeypatch):
    """Option ``fp8_fast_accum``: the forward GEMM runs with ``use_fast_accum=True`` (torchao's
    default for the output GEMM); both gradient GEMMs keep fp32 accumulation."""
    calls = []
    scaled_mm = fp8_linear._scaled_mm

    def recording_scaled_mm(a, a_inv_scale, b_t, b_inv_scale, fast_accum=False):
        calls.append(fast_accum)
        return scaled_mm(a, a_inv_scale, b_t, b_inv_scale, fast_accum)

    monkeypatch.setattr(fp8_linear, "_scaled_mm", recording_scaled_mm)
    model = nn.Linear(64, 128)
    compiled = flash_inductor.compile(model, **EAGER, fp8="tensorwise", fp8_min_weight_numel=0, fp8_fast_accum=fast_accum)
    out = compiled(torch.randn(4, 64))
    forward_calls = list(calls)  # Dynamo's trace (fake tensors) and the run
    out.sum().backward()
    assert forward_calls and set(forward_calls) == {fast_accum}
    assert calls[len(forward_calls):] == [False, False]  # grad-input and grad-weight GEMMs


@pytest.mark.parametrize("option", ["fp8_fast_accum", "fp8_e4m3_gradients"])
def test_fp8_flags_must_be_bools(option):
    with pytest.raises(ValueError, match=rf"option '{option}' must be True or False"):
        flash_inductor.compile(nn.Linear(64, 64), fp8="tensorwise", **{option: "yes"})


def _sqnr(reference, approx):
    return fp8.sqnr_db(reference.float(), approx.float())


def e4m3_gradient_gains(fp8_mode, device="cpu", compiler="eager"):
    """One linear's forward and backward with e5m2 and with e4m3 output gradients
    (``fp8_e4m3_gradients``), against bf16's: (the two FP8 outputs equal, dx's gain in dB, dw's)."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 128).to(device, torch.bfloat16)
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    # tokens of different magnitudes, as a loss's gradients are
    grad_out = torch.randn(64, 128, device=device, dtype=torch.bfloat16) * torch.rand(64, 1, device=device,
                                                                                      dtype=torch.bfloat16)
    results = []
    for e4m3 in (None, False, True):  # None: bf16, the reference
        torch._dynamo.reset()
        model = copy.deepcopy(layer)
        run = model if e4m3 is None else flash_inductor.compile(
            model, compiler=compiler, fp8=fp8_mode, fp8_min_weight_numel=0, fp8_min_gemm_size=0,
            fp8_e4m3_gradients=e4m3)
        xi = x.clone().requires_grad_()
        out = run(xi)
        out.backward(grad_out)
        results.append((out.detach(), xi.grad, model.weight.grad))
    (_, ref_dx, ref_dw), (e5_out, e5_dx, e5_dw), (e4_out, e4_dx, e4_dw) = results
    # a linear left in bf16 (as fp8_min_gemm_size once left it on CUDA) would make both gains inf - inf
    assert not torch.equal(e5_dw, ref_dw) and not torch.equal(e4_dw, ref_dw), "the linear did not run in FP8"
    return (torch.equal(e4_out, e5_out), _sqnr(ref_dx, e4_dx) - _sqnr(ref_dx, e5_dx),
            _sqnr(ref_dw, e4_dw) - _sqnr(ref_dw, e5_dw))


@pytest.mark.parametrize("fp8_mode,compiler", [("tensorwise", "eager"), ("delayed", "eager"), ("tensorwise", "inductor")])
def test_e4m3_gradients_halve_the_gradient_gemms_rounding_error(fp8_mode, compiler):
    """Option ``fp8_e4m3_gradients``: the output gradient is cast to e4m3 (3 mantissa bits) instead
    of e5m2 (2): both gradients come about 4 dB closer to bf16's (measured, either scaling: dx
    24.8 -> 28.8 dB, dw 24.5 -> 28.6; the rest is the e4m3 casts of x and w); the forward is
    unchanged, bit for bit."""
    same_forward, dx_gain, dw_gain = e4m3_gradient_gains(fp8_mode, compiler=compiler)
    assert same_forward and dx_gain >= 3 and dw_gain >= 3, (dx_gain, dw_gain)


def test_fp8_layer_output_and_gradients_against_bf16():
    torch.manual_seed(0)
    layer = nn.Linear(256, 128).bfloat16()
    reference = copy.deepcopy(layer)
    compiled = flash_inductor.compile(layer, fp8="tensorwise", fp8_min_weight_numel=0)
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad_out = torch.randn(64, 128, dtype=torch.bfloat16)
    out = compiled(x)
    out.backward(grad_out)
    out_ref = reference(x_ref)
    out_ref.backward(grad_out)
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert _sqnr(out_ref, out) >= 25
    assert _sqnr(x_ref.grad, x.grad) >= 20
    assert _sqnr(reference.weight.grad, layer.weight.grad) >= 20
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, rtol=1e-2, atol=1e-2)


def test_autocast_output_dtype_and_accuracy():
    torch.manual_seed(0)
    layer = nn.Linear(128, 64)
    x = torch.randn(32, 128)
    compiled = flash_inductor.compile(layer, **EAGER, fp8="tensorwise", fp8_min_weight_numel=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
        out_ref = layer(x)
    assert out.dtype == out_ref.dtype == torch.bfloat16
    assert _sqnr(out_ref, out) >= 25


@functools.cache  # losses shared by the tests of this module
def _train(fp8_option, steps, gradient_format=None, **fp8_options):
    torch.manual_seed(0)
    model = TinyGPT(dim=128, layers=2, seq=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    options = {"fp8": fp8_option, "fp8_min_weight_numel": 0, "fp8_exclude": ["head"], **fp8_options} if fp8_option else {}
    options["gradient_format"] = gradient_format

    step = lm_train_step(model, opt, **options)
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog; " * 40))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, text.numel() - 33, (16,), generator=gen)
        idx = starts[:, None] + torch.arange(32)
        losses.append(step(text[idx], text[idx + 1]).item())
    return losses


def test_small_transformer_trains_with_fp8_and_the_optimizer_rewrite():
    """200 steps, FP8 linears + split weights + 8-bit states vs the same without FP8."""
    fp8_losses = _train("tensorwise", 200)
    bf16_losses = _train(None, 200)
    final_fp8, final_bf16 = sum(fp8_losses[-10:]) / 10, sum(bf16_losses[-10:]) / 10
    assert final_bf16 < 0.5 * bf16_losses[0]  # it learned
    assert abs(final_fp8 - final_bf16) <= 0.02 * final_bf16, (final_fp8, final_bf16)


@pytest.mark.parametrize("tensorwise_weight_gradient", [False, True])
def test_small_transformer_trains_with_rowwise_fp8(tensorwise_weight_gradient):
    """``fp8="rowwise"`` (every GEMM operand e4m3 by rows, Inductor's kernels), also with the weight
    gradient's operands one scale each (``fp8_tensorwise_weight_gradient``): 200 steps within 2% of the
    same without FP8, as tensorwise scaling."""
    rowwise_losses = _train("rowwise", 200, fp8_tensorwise_weight_gradient=tensorwise_weight_gradient)
    bf16_losses = _train(None, 200)
    final_rowwise, final_bf16 = sum(rowwise_losses[-10:]) / 10, sum(bf16_losses[-10:]) / 10
    assert abs(final_rowwise - final_bf16) <= 0.02 * final_bf16, (final_rowwise, final_bf16)


def test_small_transformer_trains_with_fp8_gradients():
    """Issue 16: FP8 linears whose weight gradients (and those of every tensor with 8-bit states,
    embedding and head included) are kept in e5m2 until the step, 200 steps, within 2% of the same
    with bf16 gradients."""
    fp8_grad_losses = _train("tensorwise", 200, "e5m2")
    bf16_grad_losses = _train("tensorwise", 200)
    final_fp8, final_bf16 = sum(fp8_grad_losses[-10:]) / 10, sum(bf16_grad_losses[-10:]) / 10
    assert final_fp8 < 0.5 * fp8_grad_losses[0]  # it learned
    assert abs(final_fp8 - final_bf16) <= 0.02 * final_bf16, (final_fp8, final_bf16)


# FP8 for every eligible matmul whatever its size, the passes run without kernels.
FP8_ALL = dict(EAGER, fp8="tensorwise", fp8_min_weight_numel=0)


def _inspected_fp8(model, *inputs):
    """The model graph's inspection record under ``FP8_ALL`` and its decisions by subject; Dynamo
    is reset afterwards, so the model compiles again."""
    graph = flash_inductor.inspect(flash_inductor.compile(model, **FP8_ALL), *inputs).graph("model")
    torch._dynamo.reset()
    return graph, {subject: decision for _, subject, decision in graph.decisions}


class InOut(nn.Module):
    """Weights stored (in, out), as Hugging Face's Conv1D: ``addmm(b, x, w)``, ``x @ w``, ``mm``."""

    def __init__(self):
        super().__init__()
        self.c_attn_weight = nn.Parameter(torch.randn(64, 96) * 0.1)
        self.c_attn_bias = nn.Parameter(torch.randn(96) * 0.1)
        self.c_proj = nn.Parameter(torch.randn(64, 48) * 0.1)
        self.c_fc = nn.Parameter(torch.randn(64, 32) * 0.1)
        self.odd = nn.Parameter(torch.randn(64, 20) * 0.1)  # 20 is not a multiple of 16

    def forward(self, x):
        # One matmul per output: the SQNR bars are for one FP8 GEMM (chained ones compound).
        x2 = x.view(-1, 64)
        return torch.addmm(self.c_attn_bias, x2, self.c_attn_weight), x @ self.c_proj, torch.mm(x2, self.c_fc), x @ self.odd


def test_matmuls_with_in_out_weights_run_in_fp8_like_bf16():
    """Each (in, out) matmul on a parameter is rewritten to ``fp8_linear`` of the weight's transpose,
    or reported with the reason it is not; outputs and gradients stay within the FP8 bars."""
    torch.manual_seed(0)
    model = InOut().bfloat16()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    graph, decisions = _inspected_fp8(model, x)
    assert decisions == {
        "c_attn_weight": "fp8 e4m3/e5m2", "c_proj": "fp8 e4m3/e5m2", "c_fc": "fp8 e4m3/e5m2",
        "odd": "bf16: weight 20x64: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)",
    }
    code = "\n".join(line for line in next(s.code for s in graph.stages if s.name == "fp8_linear").splitlines()
                     if not line.strip().startswith("#"))  # comments quote the model's source
    assert code.count("flash_inductor_fp8_linear_fp8_linear(") == 3 and "torch.addmm" not in code
    compiled = flash_inductor.compile(model, **FP8_ALL)
    outs, refs = compiled(x), reference(x)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape and out.dtype == torch.bfloat16
        assert _sqnr(ref, out) >= 25
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert _sqnr(q.grad, p.grad) >= 20, name


class Einsums(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_in_out = nn.Parameter(torch.randn(64, 48) * 0.1)
        self.w_out_in = nn.Parameter(torch.randn(32, 64) * 0.1)
        self.w_other = nn.Parameter(torch.randn(64, 64) * 0.1)

    def forward(self, x):
        return (torch.einsum("bsk,kn->bsn", x, self.w_in_out), torch.einsum("...k,nk->...n", x, self.w_out_in),
                torch.einsum("bsk,kk->bs", x, self.w_other))  # not x @ w: stays as it is, reported


def test_einsums_that_are_matmuls_on_a_parameter_run_in_fp8():
    torch.manual_seed(0)
    model = Einsums().bfloat16()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    _, decisions = _inspected_fp8(model, x)
    assert decisions == {"w_in_out": "fp8 e4m3/e5m2", "w_out_in": "fp8 e4m3/e5m2", "w_other": (
        "bf16: einsum with the parameter (shape (64, 64)) or a view or slice of it as an operand, not as a linear's "
        "2-D weight")}
    outs, refs = flash_inductor.compile(model, **FP8_ALL)(x), reference(x)
    for out, ref in zip(outs[:2], refs[:2]):
        assert out.shape == ref.shape and _sqnr(ref, out) >= 25
    torch.testing.assert_close(outs[2], refs[2])


class HeadEinsums(nn.Module):
    """Parameters of rank 3 in einsums, as XLNet's attention: (hidden, heads, head dim)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(64, 4, 16) * 0.1)
        self.o = nn.Parameter(torch.randn(64, 4, 16) * 0.1)
        self.bias_like = nn.Parameter(torch.randn(64, 4, 16) * 0.1)

    def forward(self, x, heads):
        return (torch.einsum("ibh,hnd->ibnd", x, self.q), torch.einsum("ibnd,hnd->ibh", heads, self.o),
                torch.einsum("ibh,hnd->ibn", x, self.bias_like))  # d summed away: not a linear, stays


def test_einsums_on_a_parameter_of_rank_3_run_as_fp8_linears_on_its_2d_reshape():
    """Each einsum that is a linear on the parameter's dims taken together (contracted dims ending the
    input, the others ending the output) runs in FP8 on the parameter reshaped to 2-D; outputs and
    gradients stay within the FP8 bars. One that is not is reported and left as it is."""
    torch.manual_seed(0)
    model = HeadEinsums().bfloat16()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    heads = torch.randn(8, 2, 4, 16, dtype=torch.bfloat16)
    _, decisions = _inspected_fp8(model, x, heads)
    assert decisions == {"q": "fp8 e4m3/e5m2, weight computed from q", "o": "fp8 e4m3/e5m2, weight computed from o",
                         "bias_like": "bf16: einsum with the parameter (shape (64, 4, 16)) or a view or slice of it as "
                                      "an operand, not as a linear's 2-D weight"}
    x, heads = x.requires_grad_(), heads.requires_grad_()
    x_ref, heads_ref = x.detach().clone().requires_grad_(), heads.detach().clone().requires_grad_()
    outs, refs = flash_inductor.compile(model, **FP8_ALL)(x, heads), reference(x_ref, heads_ref)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    for out, ref in zip(outs[:2], refs[:2]):
        assert out.shape == ref.shape and _sqnr(ref, out) >= 25
    torch.testing.assert_close(outs[2], refs[2])
    for name in ("q", "o"):
        assert _sqnr(getattr(reference, name).grad, getattr(model, name).grad) >= 20, name
    assert _sqnr(x_ref.grad, x.grad) >= 20 and _sqnr(heads_ref.grad, heads.grad) >= 20


class Transposed(nn.Module):
    """A linear that reads its input transposed and whose output is read transposed, so that its
    input and its output's gradient arrive laid out by columns (Hugging Face's Funnel)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x.t()).t()


@pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed")
@pytest.mark.parametrize("fp8_mode", ["tensorwise", "rowwise"])
def test_an_input_and_a_gradient_laid_out_by_columns_are_multiplied_row_major(fp8_mode):
    """``_scaled_mm`` takes its first operand row-major: a transposed input or output gradient is
    copied to rows (by columns they failed: "the first operand is not row-major", the FP8 pass was
    skipped), and row-wise scaling's transposed copies of operands already laid out by columns do not
    alias them; output and gradients stay within the FP8 bars."""
    torch.manual_seed(0)
    model = Transposed().bfloat16()
    reference = copy.deepcopy(model)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    x, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = flash_inductor.compile(model, **dict(FP8_ALL, fp8=fp8_mode))(x)
    out_ref = reference(x_ref)
    grad = torch.randn(64, 64, dtype=torch.bfloat16)
    out.backward(grad)
    out_ref.backward(grad)
    assert _sqnr(out_ref, out) >= 25
    assert _sqnr(x_ref.grad, x.grad) >= 20 and _sqnr(reference.fc.weight.grad, model.fc.weight.grad) >= 20


@pytest.mark.parametrize("features", [(64, 1000), (1000, 64)], ids=["out-dim-1000", "in-dim-1000"])
def test_dims_off_16_are_zero_padded_where_that_adds_at_most_1_percent(features):
    """1000 = 62.5 x 16: the GEMMs run on the weight padded to 1008 (0.8% more), the results are cut
    back; output and gradients stay within the FP8 bars. GPT-2's lm_head (50257 x 768) pads by 15
    rows; 20 x 64 would add 60% and stays bf16 (test_eligible_linears_...)."""
    assert fp8_linear.padded_shape(50257, 768) == (50272, 768) and fp8_linear.padded_shape(20, 64) is None
    torch.manual_seed(0)
    layer = nn.Linear(*features).bfloat16()
    x = torch.randn(2, 16, features[0], dtype=torch.bfloat16)
    _, decisions = _inspected_fp8(layer, x)
    n, k = features[1], features[0]
    assert decisions == {"weight": f"fp8 e4m3/e5m2, padded to {-(-n // 16) * 16}x{-(-k // 16) * 16}"}
    _check_linear_against_bf16(layer, x, FP8_ALL)


def _check_linear_against_bf16(layer, x, options):
    """``layer`` (an ``nn.Linear`` with a bias) compiled with ``options`` against its bf16 copy: output and
    the input's and weight's gradients within the FP8 bars (25 and 20 dB), the bias's within 1%."""
    layer.zero_grad()
    reference = copy.deepcopy(layer)
    x, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_out = torch.randn(*x.shape[:-1], layer.out_features, dtype=x.dtype)
    out = flash_inductor.compile(layer, **options)(x)
    out.backward(grad_out)
    out_ref = reference(x_ref)
    out_ref.backward(grad_out)
    assert out.shape == out_ref.shape and x.grad.shape == x_ref.grad.shape
    assert _sqnr(out_ref, out) >= 25
    assert _sqnr(x_ref.grad, x.grad) >= 20 and _sqnr(reference.weight.grad, layer.weight.grad) >= 20
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fp8_mode", ["tensorwise", "rowwise"])
def test_a_token_count_off_16_is_zero_padded_for_the_weight_gradient_gemm(fp8_mode):
    """The tokens are the K of the weight-gradient GEMM (dw = dy.T @ x), which ``_scaled_mm`` wants a
    multiple of 16: ViT's 4 images of 197 tokens (788) failed to compile on an H100. The tokens are
    padded with zero rows, which change no amax and no sum; the forward and dx GEMMs take the unpadded
    rows. (The CPU's ``_scaled_mm``
    refuses what the GPU's refuses: without the padding this test fails there too.)"""
    torch.manual_seed(0)
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16)  # 21 tokens
    _check_linear_against_bf16(nn.Linear(64, 64).bfloat16(), x, dict(FP8_ALL, fp8=fp8_mode))


def test_the_cpus_fp8_gemm_refuses_what_the_gpus_refuses():
    """As ``torch._scaled_mm`` on CUDA: K and N multiples of 16 (M free), the first operand row-major,
    the second column-major, the inverse scales one fp32 each or contiguous (M, 1) and (1, N)."""
    a, b = torch.zeros(5, 32, dtype=fp8.E4M3), torch.zeros(48, 32, dtype=fp8.E4M3).t()
    one = torch.ones(())
    assert fp8_linear._scaled_mm(a, one, b, one).shape == (5, 48)
    assert fp8_linear._scaled_mm(a, torch.ones(5, 1), b, torch.ones(1, 48)).shape == (5, 48)
    refused = {
        r"K = 24 is not a multiple of 16": (a[:, :24], one, b[:24], one),
        r"N = 40 is not a multiple of 16": (a, one, b[:, :40], one),
        r"first operand is not row-major": (a.t().contiguous().t(), one, b, one),
        r"second operand is not column-major": (a, one, b.contiguous(), one),
        r"neither one fp32 each": (a, torch.ones(1, 5), b, torch.ones(1, 48)),
    }
    for message, args in refused.items():
        with pytest.raises(RuntimeError, match=message):
            fp8_linear._scaled_mm(*args)
    with pytest.raises(RuntimeError, match=r"neither one fp32 each"):
        fp8_linear._scaled_mm(a, one.double(), b, one)


def _check_fp8_against_bf16(model, reference, x):
    """``model`` compiled with ``FP8_ALL`` against its bf16 copy ``reference``: output and every
    parameter's gradient within the FP8 bars (25 and 20 dB)."""
    model.zero_grad()
    out = flash_inductor.compile(model, **FP8_ALL)(x)
    out_ref = reference(x)
    grad_out = torch.randn_like(out_ref)
    out.backward(grad_out)
    out_ref.backward(grad_out)
    assert _sqnr(out_ref, out) >= 25
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert _sqnr(p_ref.grad, p.grad) >= 20, name


class OutputAddedToInPlace(nn.Module):
    """Falcon's decoder layer: ``mlp_output += attention_output``, an in-place add on a linear's output."""

    def __init__(self, out_features, bias):
        super().__init__()
        self.first = nn.Linear(64, out_features, bias=bias)
        self.second = nn.Linear(64, out_features, bias=bias)

    def forward(self, x):
        out = self.first(x)
        out += self.second(x)
        return out


@pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed")
@pytest.mark.parametrize("out_features", [64, 1000], ids=["unpadded", "padded"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("tokens", [(2, 16), (3, 7)], ids=["32-tokens", "21-tokens"])
def test_a_linear_output_written_in_place_runs_in_fp8(out_features, bias, tokens):
    """The FP8 linear's output is not a view made inside its autograd.Function, which autograd would
    refuse to let the caller write in place (the pass was skipped on Falcon's graphs); also where the
    tokens are padded (21 to 32)."""
    torch.manual_seed(0)
    model = OutputAddedToInPlace(out_features, bias).bfloat16()
    reference = copy.deepcopy(model)
    x = torch.randn(*tokens, 64, dtype=torch.bfloat16)
    _, decisions = _inspected_fp8(model, x)
    assert set(decisions) == {"first.weight", "second.weight"}
    assert all(d.startswith("fp8 e4m3/e5m2") for d in decisions.values())
    _check_fp8_against_bf16(model, reference, x)


class CheckpointedBlocks(nn.Module):
    """Two blocks, the first run under ``torch.utils.checkpoint`` (Dynamo captures it as a region
    whose body takes the block's weights as operands)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2))

    def forward(self, x):
        x = x + torch.utils.checkpoint.checkpoint(self.blocks[0], x, use_reentrant=False)
        return x + self.blocks[1](x)


@pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed")
def test_linears_in_an_activation_checkpointed_region_run_in_fp8():
    torch.manual_seed(0)
    model = CheckpointedBlocks().bfloat16()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    _, decisions = _inspected_fp8(model, x)
    assert decisions == {f"blocks.{i}.{j}.weight": "fp8 e4m3/e5m2" for i in range(2) for j in (0, 2)}
    _check_fp8_against_bf16(model, reference, x)
    torch._dynamo.reset()
    delayed = dict(FP8_ALL, fp8="delayed")
    flash_inductor.prepare_fp8(model, **delayed)
    graph = flash_inductor.inspect(flash_inductor.compile(model, **delayed), x).graph("model")
    decisions = {subject: decision for _, subject, decision in graph.decisions}
    assert decisions["blocks.0.0.weight"].startswith("bf16: in an activation-checkpointed region, where only fp8='tensorwise'")
    assert decisions["blocks.1.0.weight"] == "fp8 e4m3/e5m2, delayed scaling"


def test_a_checkpointed_region_recomputes_its_fp8_linears_in_the_backward():
    """The region's FP8 linears run again in the backward (what saves their activations' memory): on
    Inductor's CPU code, where the FP8 GEMMs are fp32 ``mm`` calls, 3 in the forward and 5 gradient
    GEMMs without the checkpoint (the input needs no gradient); with it, the block's 2 forward
    GEMMs again (tests/test_gpu.py counts ``_scaled_mm`` the same way on CUDA)."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False))
    model = nn.ModuleList([block, nn.Linear(64, 64, bias=False)]).bfloat16()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    gemms = {}
    for checkpointed in (False, True):
        torch._dynamo.reset()

        def loss(t, checkpointed=checkpointed):
            y = torch.utils.checkpoint.checkpoint(model[0], t, use_reentrant=False) if checkpointed else model[0](t)
            return model[1](t + y).float().square().mean()

        compiled = flash_inductor.compile(loss, fp8="tensorwise", fp8_min_weight_numel=0)
        _, codes = run_and_get_code(lambda: compiled(x).backward())
        gemms[checkpointed] = [len(re.findall(r"extern_kernels\.mm\(", code)) for code in codes]
    assert gemms == {False: [3, 5], True: [3, 7]}, gemms


class Attentions(nn.Module):
    """torch's ``nn.MultiheadAttention`` three ways: self-attention (one stacked in-projection; no
    attention weights asked: SDPA), cross-attention with other key/value dims (separate projection
    weights) returning its attention weights, and one with ``add_bias_kv``, left to torch's function."""

    def __init__(self):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.cross = nn.MultiheadAttention(64, 4, kdim=32, vdim=32, batch_first=True)
        self.biased = nn.MultiheadAttention(64, 4, add_bias_kv=True, batch_first=True)

    def forward(self, x, memory):
        a = self.self_attn(x, x, x, need_weights=False)[0]
        b, weights = self.cross(x, memory, memory)
        return a, b, weights, self.biased(x, x, x, need_weights=False)[0]


def test_multi_head_attention_projections_run_in_fp8_like_bf16():
    """Dynamo keeps ``F.multi_head_attention_forward`` as one node, the weights its operands: the pass
    replaces it by ``fp8_multi_head_attention_forward`` (``flash_inductor/multi_head_attention.py``),
    whose projections are ``fp8_linear``; every weight's decision is reported (they were missing)."""
    torch.manual_seed(0)
    model = Attentions().bfloat16()
    reference = copy.deepcopy(model)
    x, memory = torch.randn(2, 16, 64, dtype=torch.bfloat16), torch.randn(2, 24, 32, dtype=torch.bfloat16)
    graph, _ = _inspected_fp8(model, x, memory)
    biased = "bf16: nn.MultiheadAttention with add_bias_kv or add_zero_attn"
    assert [(subject, decision) for _, subject, decision in graph.decisions] == [
        ("self_attn.in_proj_weight", "fp8 e4m3/e5m2"), ("self_attn.out_proj.weight", "fp8 e4m3/e5m2"),
        ("cross.q_proj_weight", "fp8 e4m3/e5m2"), ("cross.k_proj_weight", "fp8 e4m3/e5m2"),
        ("cross.v_proj_weight", "fp8 e4m3/e5m2"), ("cross.out_proj.weight", "fp8 e4m3/e5m2"),
        ("biased.in_proj_weight", biased), ("biased.out_proj.weight", biased),
    ]
    code = next(s.code for s in graph.stages if s.name == "fp8_linear")
    assert code.count("fp8_multi_head_attention_forward(") == 2 and code.count("multi_head_attention_forward(") == 3
    outs, refs = flash_inductor.compile(model, **FP8_ALL)(x, memory), reference(x, memory)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    # Two FP8 GEMMs in a chain with the attention between them, whose softmax amplifies the
    # projections' errors: an FP8 MLP of two linears (64 -> 192 -> 64) gives 25.3 dB here, the first
    # weight's gradient 21.3 dB; these give 23.4-24.3 dB, and 20.0-20.7 dB for the in-projections,
    # whose gradients passed two e5m2 casts (about 23 dB each), so their bars are lower than one GEMM's.
    for out, ref in zip(outs[:3], refs[:3]):
        assert out.shape == ref.shape and out.dtype == torch.bfloat16 and _sqnr(ref, out) >= 22
    assert torch.equal(outs[3], refs[3])
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if name.startswith("biased"):
            assert torch.equal(p.grad, q.grad), name
        else:
            assert _sqnr(q.grad, p.grad) >= (20 if "out_proj" in name or "bias" in name else 18), name


def test_attention_whose_weight_slices_would_need_too_much_padding_stays_bf16():
    """Embedding dim 682: the stacked 2046 x 682 weight pads to 2048 x 688 (0.99% more), so self-attention's
    one GEMM runs in FP8; cross-attention multiplies by its 682- and 1364-row slices, which would need
    more than 1%, so that layer stays with torch's function, and says why."""
    torch.manual_seed(0)
    layer = nn.MultiheadAttention(682, 2, batch_first=True).bfloat16()
    x, memory = torch.randn(1, 16, 682, dtype=torch.bfloat16), torch.randn(1, 8, 682, dtype=torch.bfloat16)
    decisions = {kind: _inspected_fp8(call, x, memory)[1] for kind, call in (
        ("self", lambda t, m: layer(t, t, t)[0]), ("cross", lambda t, m: layer(t, m, m)[0]))}
    out_proj = "bf16: weight 682x682: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)"
    assert decisions == {
        "self": {"in_proj_weight": "fp8 e4m3/e5m2, padded to 2048x688", "out_proj.weight": out_proj},
        "cross": {"in_proj_weight": "bf16: weight 2046x682: its q, k, v slices would need over 1% of padding to "
                                    "multiples of 16", "out_proj.weight": out_proj},
    }


class SeparateProjections(nn.Module):
    """``F.multi_head_attention_forward`` called as Hugging Face's WavLM calls it: separate q, k, v
    weights (``use_separate_proj_weight=True``) and ``torch.empty([0])`` for the unused stacked one."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        x = x.transpose(0, 1)
        return F.multi_head_attention_forward(
            x, x, x, 64, 4, torch.empty([0]), torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)),
            None, None, False, 0.0, self.out_proj.weight, self.out_proj.bias, training=True, need_weights=False,
            use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight)[0].transpose(0, 1)


def test_an_unused_stacked_weight_of_separate_projections_is_not_reported():
    """With ``use_separate_proj_weight=True`` torch's function never multiplies by ``in_proj_weight``:
    the report listed WavLM's ``torch.empty([0])`` there as a matmul kept in bf16 ("weight is not a
    parameter"), one a layer that does not exist. The four projections run in FP8, as before."""
    torch.manual_seed(0)
    model = SeparateProjections().bfloat16()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    _, decisions = _inspected_fp8(model, x)
    assert decisions == {f"{name}.weight": "fp8 e4m3/e5m2" for name in ("q_proj", "k_proj", "v_proj", "out_proj")}
    assert _sqnr(reference(x), flash_inductor.compile(model, **FP8_ALL)(x)) >= 22


def test_a_transformer_layer_in_a_checkpointed_region_runs_its_attention_in_fp8():
    """torch's ``nn.TransformerEncoderLayer`` under ``torch.utils.checkpoint``: the attention's call is
    rewritten in the region's body too, its weights being operands of the region."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, activation="gelu", batch_first=True).bfloat16()
    reference = copy.deepcopy(layer)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    def checkpointed(t):
        return torch.utils.checkpoint.checkpoint(layer, t, use_reentrant=False)

    _, decisions = _inspected_fp8(checkpointed, x)
    assert sorted(subject for subject, decision in decisions.items() if decision == "fp8 e4m3/e5m2") == [
        "linear1.weight", "linear2.weight", "self_attn.in_proj_weight", "self_attn.out_proj.weight"]
    out, ref = flash_inductor.compile(checkpointed, **FP8_ALL)(x), reference(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    assert _sqnr(ref, out) >= 25  # the residual stream carries most of the output
    for (name, p), q in zip(layer.named_parameters(), reference.parameters()):
        assert _sqnr(q.grad, p.grad) >= 20, name


def test_a_transformer_layers_inference_fast_path_is_reported_in_bf16():
    """In eval mode without autograd ``nn.TransformerEncoderLayer`` runs torch's fused op, one node
    with every weight as an operand: nothing to rewrite, but the report says so."""
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).bfloat16().eval()
    with torch.no_grad():
        _, decisions = _inspected_fp8(layer, torch.randn(2, 16, 64, dtype=torch.bfloat16))
    assert decisions == {"self_attn.in_proj_weight": "bf16: nn.TransformerEncoderLayer's inference fast path: torch's fused op"}


class ComputedWeights(nn.Module):
    """Linears whose weights are computed from parameters alone: parametrizations (``weight_norm``, and
    ``spectral_norm``, whose power iteration updates two buffers), a LoRA merge written out, a slice of
    a 3-D expert weight; one upcast to fp32 (a router's, as DeepSeek's: kept in fp32); and one whose
    weight an activation scales (not a layer's weight)."""

    def __init__(self):
        super().__init__()
        self.normed = torch.nn.utils.parametrizations.weight_norm(nn.Linear(64, 96))
        self.spectral = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(96, 64))
        self.base = nn.Parameter(torch.randn(64, 64) * 0.1)
        self.lora_a, self.lora_b = nn.Parameter(torch.randn(4, 64) * 0.1), nn.Parameter(torch.randn(64, 4) * 0.1)
        self.experts = nn.Parameter(torch.randn(4, 64, 64) * 0.1)
        self.router = nn.Parameter(torch.randn(16, 64) * 0.1)
        self.gated = nn.Parameter(torch.randn(64, 64) * 0.1)

    def forward(self, x):
        h = self.spectral(F.gelu(self.normed(x)))
        h = F.linear(h, self.base + self.lora_b @ self.lora_a)
        h = F.linear(h, self.experts[2])
        return h, F.linear(x, self.gated * x.mean()) + F.linear(x.float(), self.router.float()).sum()


def test_linears_whose_weights_are_computed_from_parameters_run_in_fp8():
    """A weight computed from module state only (parameters, buffers) is still a layer's weight: its
    linear runs in FP8 and is reported under the weight's name, the gradients flowing back through
    the computation to the parameters."""
    torch.manual_seed(0)
    model = ComputedWeights().bfloat16()
    reference = copy.deepcopy(model)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    _, decisions = _inspected_fp8(model, x)
    assert decisions == {
        "normed.weight": "fp8 e4m3/e5m2, weight computed from normed.parametrizations.weight.original0, "
                         "normed.parametrizations.weight.original1",
        "spectral.weight": "fp8 e4m3/e5m2, weight computed from spectral.parametrizations.weight.original",
        "base": "fp8 e4m3/e5m2, weight computed from base, lora_a, lora_b",
        # the merge's own product lora_b @ lora_a, as x @ w
        "lora_a": "bf16: weight 64x4: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)",
        "experts": "fp8 e4m3/e5m2, weight computed from experts",
        "router": "fp32: weight upcast from its bf16 parameters: the model computes this product in fp32, weight "
                  "computed from router",
    }
    (out, gated), (ref, ref_gated) = flash_inductor.compile(model, **FP8_ALL)(x), reference(x)
    # four FP8 GEMMs in a chain: each costs about 25 dB alone
    assert _sqnr(ref, out) >= 20 and torch.equal(gated, ref_gated)
    grad = torch.randn_like(out)
    torch.autograd.backward((out, gated), (grad, torch.ones_like(gated)))
    torch.autograd.backward((ref, ref_gated), (grad, torch.ones_like(gated)))
    # 18.7-22.7 dB: the first weight's gradient has passed three e5m2 casts
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad) if name in ("gated", "router") else _sqnr(q.grad, p.grad) >= 17, name
    for name, buffer in model.named_buffers():  # the power iteration's vectors
        torch.testing.assert_close(buffer, dict(reference.named_buffers())[name], rtol=0.02, atol=0.02)


def test_the_deprecated_weight_norm_is_reported_under_the_weights_name():
    """``torch.nn.utils.weight_norm`` (a forward pre-hook over ``weight_g`` and ``weight_v``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation
        normed = torch.nn.utils.weight_norm(nn.Linear(64, 64))
    _, decisions = _inspected_fp8(normed.bfloat16(), torch.randn(16, 64, dtype=torch.bfloat16))
    assert decisions == {"weight": "fp8 e4m3/e5m2, weight computed from weight_g, weight_v"}


def test_weights_computed_inside_a_checkpointed_region_run_in_fp8():
    """In a ``torch.utils.checkpoint`` region the computation's parameters are the region's operands."""
    torch.manual_seed(0)
    normed, experts = nn.utils.parametrizations.weight_norm(nn.Linear(64, 64)).bfloat16(), nn.Parameter(
        torch.randn(2, 64, 64, dtype=torch.bfloat16) * 0.1)
    model = nn.ModuleDict(dict(normed=normed))
    model.experts = experts
    def region(t):
        return F.linear(model["normed"](t), model.experts[1])
    def forward(t):
        return torch.utils.checkpoint.checkpoint(region, t, use_reentrant=False)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    graph, decisions = _inspected_fp8(forward, x)
    assert decisions == {
        "normed.weight": "fp8 e4m3/e5m2, weight computed from normed.parametrizations.weight.original0, "
                         "normed.parametrizations.weight.original1",
        "experts": "fp8 e4m3/e5m2, weight computed from experts"}
    assert next(s.code for s in graph.stages if s.name == "fp8_linear").count("fp8_linear(") == 2


def test_a_computed_weight_stays_bf16_under_delayed_scaling_and_gets_no_state():
    """``prepare_fp8`` gives a parametrized linear no state either (its weight is computed at each access)."""
    model = torch.nn.utils.parametrizations.weight_norm(nn.Linear(64, 64)).bfloat16()
    flash_inductor.prepare_fp8(model, **{**FP8_ALL, "fp8": "delayed"})
    assert list(model.buffers()) == []
    graph = flash_inductor.inspect(flash_inductor.compile(model, **{**FP8_ALL, "fp8": "delayed"}),
                                   torch.randn(16, 64, dtype=torch.bfloat16)).graph("model")
    torch._dynamo.reset()
    assert {s: d for _, s, d in graph.decisions} == {"weight": (
        "bf16: weight computed from parameters, where only fp8='tensorwise' or 'rowwise' without fp8_all_gather "
        "runs in FP8 (their state is a parameter's), weight computed from parametrizations.weight.original0, "
        "parametrizations.weight.original1")}


class OtherParameterMatmuls(nn.Module):
    """Matmuls on parameters that are not a linear's 2-D weight: a slice of a 3-D expert weight as a
    matmul's right operand (stored (in, out); ``F.linear`` on a slice runs in FP8), a parameter as the
    left operand, a batched matmul, a grouped matmul (Hugging Face's default for mixture-of-experts
    layers), the parameter as the left operand again in a checkpointed region, a bilinear form and a
    convolution."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Parameter(torch.randn(4, 32, 64) * 0.1)
        self.left = nn.Parameter(torch.randn(16, 8) * 0.1)
        self.batched = nn.Parameter(torch.randn(2, 64, 32) * 0.1)
        self.bilinear = nn.Parameter(torch.randn(4, 64, 64) * 0.1)
        self.conv = nn.Parameter(torch.randn(8, 16, 3) * 0.1)

    def forward(self, x):
        a = x[:, :32] @ self.experts[1]
        b = self.left @ x[:8]
        c = torch.bmm(x.view(2, 8, 64), self.batched)
        offsets = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
        d = torch._grouped_mm(x, self.experts.transpose(-2, -1), offs=offsets)
        e = torch.utils.checkpoint.checkpoint(lambda t: self.left @ t, x[:8, :16], use_reentrant=False)
        f = F.bilinear(x, x, self.bilinear)
        g = F.conv1d(x.view(4, 16, 16), self.conv)
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + f.sum() + g.sum()


def test_every_other_matmul_on_a_parameter_is_reported_in_bf16_with_its_reason():
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    model = OtherParameterMatmuls().bfloat16()
    graph, _ = _inspected_fp8(model, x)
    view = "with the parameter (shape {}) or a view or slice of it as an operand, not as a linear's 2-D weight"
    assert [(subject, decision) for _, subject, decision in graph.decisions] == [
        ("experts", "bf16: matmul " + view.format((4, 32, 64))),
        ("left", "bf16: matmul " + view.format((16, 8))),
        ("batched", "bf16: batched matmul " + view.format((2, 64, 32))),
        ("experts", "bf16: grouped matmul (a mixture of experts' weights): FP8 grouped GEMMs are not supported"),
        ("bilinear", "bf16: bilinear (x1 W x2): no FP8 GEMM takes it"),
        ("conv", "bf16: convolution: torch has no FP8 convolution"),
        ("left", "bf16: matmul " + view.format((16, 8))),  # in the region's body
    ]


class TinyLM(nn.Module):
    """An embedding, a hidden linear and a head: tied to the embedding (the model returns the logits,
    as a Hugging Face model that graph-breaks before its loss), or a linear of its own (the model
    returns the loss)."""

    def __init__(self, tied):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.hidden = nn.Linear(32, 32)
        self.head = None if tied else nn.Linear(32, 64, bias=False)

    def forward(self, ids):
        h = self.hidden(self.embed(ids))
        if self.head is None:
            return h @ self.embed.weight.t()
        return F.cross_entropy(self.head(h).float().flatten(0, 1), ids.flatten())


class ScaledTiedLM(TinyLM):
    """A head tied to the embedding through a computation (its table scaled), the logits returned."""

    def forward(self, ids):
        return self.hidden(self.embed(ids)) @ (self.embed.weight * 0.5).t()


def test_a_head_computed_from_the_embeddings_table_is_the_output_layer_too():
    graph = flash_inductor.inspect(flash_inductor.compile(ScaledTiedLM(tied=True), **FP8_ALL),
                                   torch.randint(0, 64, (4, 16))).graph("model")
    torch._dynamo.reset()
    assert {s: d for _, s, d in graph.decisions} == {
        "hidden.weight": "fp8 e4m3/e5m2",
        "embed.weight": "bf16: the output layer: its weight is the input embedding's (fp8_output_layer=True puts it "
                        "in FP8), weight computed from embed.weight"}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "own head"])
def test_the_output_layer_stays_bf16_unless_asked(tied):
    """The head whose logits the loss reads, or whose weight is the embedding's, stays bf16 by default
    (it costs the most loss in FP8); ``fp8_output_layer=True`` puts it in FP8."""
    head = "embed.weight" if tied else "head.weight"
    why = "its weight is the input embedding's" if tied else "the loss reads its output"
    ids = torch.randint(0, 64, (4, 16))
    for output_layer, decision in [(False, f"bf16: the output layer: {why} (fp8_output_layer=True puts it in FP8)"),
                                   (True, "fp8 e4m3/e5m2")]:
        options = dict(FP8_ALL, fp8_output_layer=output_layer)
        graph = flash_inductor.inspect(flash_inductor.compile(TinyLM(tied), **options), ids).graph("model")
        torch._dynamo.reset()
        assert {s: d for _, s, d in graph.decisions} == {"hidden.weight": "fp8 e4m3/e5m2", head: decision}
