"""prepare(): what it does to the model and the optimizer."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor import registry, roles
from flash_inductor.formats import split_weights
from helpers import EAGER, Net, stored_bits

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_fp32_model_becomes_bf16_except_norms_and_kept_names():
    torch.manual_seed(0)
    model = Net()
    original = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params_before = [id(p) for p in model.parameters()]
    flash_inductor.prepare(model, opt, keep_fp32=["fc2"], compile_options=EAGER)
    assert [id(p) for p in model.parameters()] == params_before  # same Parameter objects
    assert model.fc1.weight.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.float32 and model.fc2.weight.dtype == torch.float32
    record = roles.PREPARED[opt]
    assert record.error_term(model.fc2.weight) is None and record.error_term(model.norm.weight) is None
    # The fp32 value became the master: decoding gives it back to 24-bit precision.
    master = split_weights.decode(model.fc1.weight, record.error_term(model.fc1.weight))
    half_ulp = torch.exp2(split_weights.half_ulp_log2(model.fc1.weight).float())
    assert ((master - original.fc1.weight).abs() <= half_ulp / 127 + 1e-12).all()
    # bf16 input runs through fp32 norm and kept layers (inputs cast in, outputs cast back).
    x = torch.randn(4, 128)
    out = model(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), original(x), atol=0.05, rtol=0.05)


class CheckpointedBlocks(nn.Module):
    """Blocks of a norm and a linear, each run under ``torch.utils.checkpoint`` (as Hugging Face's
    ``gradient_checkpointing_enable`` runs its decoder layers)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.RMSNorm(64), nn.Linear(64, 64)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_norms_kept_fp32_inside_checkpointed_blocks_compile_with_the_model():
    """A norm's fp32 casts inside a checkpointed region are traced into the region, also when the
    compiled forward is the model's first (they kept the input's dtype on the module, a side effect
    Dynamo refuses there: the whole model fell back to eager), and the gradients are those of the
    eager model."""
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    grads = []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = CheckpointedBlocks()
        flash_inductor.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), compile_options=EAGER)
        assert model.blocks[0][0].weight.dtype == torch.float32
        loss = lambda t: model(t).float().square().mean()  # noqa: E731
        if compiled:
            loss = flash_inductor.compile(loss, **EAGER)
            report = flash_inductor.inspect(loss, x)
            assert report.graph_breaks == [] and [g.kind for g in report.graphs] == ["model"]
        loss(x).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=0, atol=0, msg=n)


class LibraryRMSNorm(nn.Module):
    """Another library's RMSNorm (as Hugging Face's LlamaRMSNorm): not an ``nn.RMSNorm``."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n) + 0.01 * torch.randn(n))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Normalizer(nn.Module):
    """A projection whose class name starts like a norm layer's."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n**0.5)

    def forward(self, x):
        return x @ self.weight


class MixingNorm(Normalizer):
    """Named like a norm layer, but its 2-D weight makes it a projection."""


def test_other_libraries_norm_layers_stay_fp32_and_projections_named_like_them_do_not():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), LibraryRMSNorm(64), Normalizer(64), MixingNorm(64))
    original = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    record = roles.PREPARED[opt]
    assert model[1].weight.dtype == torch.float32 and record.error_term(model[1].weight) is None
    for module in (model[0], model[2], model[3]):
        assert module.weight.dtype == torch.bfloat16 and record.error_term(module.weight) is not None
    x = torch.randn(4, 64)
    out = model(x.bfloat16())
    assert out.dtype == torch.bfloat16  # the fp32 norm's output is cast back
    torch.testing.assert_close(out.float(), original(x), atol=0.05, rtol=0.05)


class LibraryRotaryEmbedding(nn.Module):
    """A rotary embedding as Hugging Face writes them: fp32 frequencies, angles in fp32, cos/sin in x's dtype."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x, positions):
        angles = positions[:, None].float() * self.inv_freq.float()
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


class PositionTable(nn.Module):
    def __init__(self, n, dim):
        super().__init__()
        self.register_buffer("table", torch.randn(n, dim))


def test_rotary_frequencies_stay_fp32_and_other_buffers_become_bf16():
    """In bf16 the frequencies' rounding moves the angle at position 4095 by up to 1.8 rad (head size
    64, base 10000); kept fp32, the angles are those of the fp32 model, bit for bit."""
    model = nn.ModuleDict({"rotary": LibraryRotaryEmbedding(64), "positions": PositionTable(8, 64), "proj": nn.Linear(64, 64)})
    original = copy.deepcopy(model)
    flash_inductor.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), compile_options=EAGER)
    assert model["rotary"].inv_freq.dtype == torch.float32 and model["positions"].table.dtype == torch.bfloat16
    x, positions = torch.randn(1, 64).bfloat16(), torch.arange(4096)
    assert torch.equal(model["rotary"](x, positions)[0], original["rotary"](x, positions)[0])
    rounded = original["rotary"].inv_freq.bfloat16().float()
    assert (positions[-1] * (rounded - original["rotary"].inv_freq)).abs().max() > 0.1  # what bf16 would cost


# A layer that multiplies its inputs by its own weights, and its fp32 inputs: (args, kwargs).
LAYERS_TAKING_INPUTS = {
    "linear": (lambda: nn.Linear(16, 32), lambda: ((torch.randn(4, 16),), {})),
    "bilinear": (lambda: nn.Bilinear(16, 8, 32), lambda: ((torch.randn(4, 16), torch.randn(4, 8)), {})),
    "conv1d": (lambda: nn.Conv1d(3, 16, 3), lambda: ((torch.randn(2, 3, 20),), {})),
    "conv2d": (lambda: nn.Conv2d(3, 16, 3, padding=1), lambda: ((torch.randn(2, 3, 8, 8),), {})),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(3, 16, 3, stride=2),
                         lambda: ((torch.randn(2, 3, 8, 8),), {"output_size": [18, 18]})),
    "attention": (lambda: nn.MultiheadAttention(16, 4, batch_first=True),
                  lambda: ((torch.randn(2, 5, 16),) * 3, {"attn_mask": torch.randn(5, 5)})),
}


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("layer", LAYERS_TAKING_INPUTS)
def test_an_fp32_models_layers_take_fp32_inputs_cast_as_autocast_casts_them(layer):
    """After ``prepare`` an fp32 model's linears, convolutions and attention still take fp32 inputs
    (a vision model's pixel values, an audio model's features; they failed torch's dtype check
    against the bf16 weights): cast to bf16 on the way in, as autocast casts them, the outputs and
    the fp32 inputs' gradients are those of the bf16 layer fed the rounded inputs, bit for bit."""
    make, inputs = LAYERS_TAKING_INPUTS[layer]
    torch.manual_seed(0)
    module = make()
    bf16_layer = copy.deepcopy(module).bfloat16()
    flash_inductor.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-3), compile_options=EAGER)
    args, kwargs = inputs()
    args = [a.clone().requires_grad_() for a in args]
    rounded = [a.detach().bfloat16().requires_grad_() for a in args]
    rounded_kwargs = {k: v.bfloat16() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out, expected = _first(module(*args, **kwargs)), _first(bf16_layer(*rounded, **rounded_kwargs))
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for a, r in zip(args, rounded):
        assert a.grad.dtype == torch.float32 and torch.equal(a.grad, r.grad.float())
    # bf16 inputs, the case inside a prepared model, run as they are
    assert torch.equal(_first(module(*rounded, **rounded_kwargs)), expected)


def test_an_already_bf16_model_is_left_to_cast_its_own_inputs():
    """Only layers ``prepare`` cast cast their inputs: a model the user made bf16 runs as it did."""
    model = nn.Conv2d(3, 8, 3).bfloat16()
    flash_inductor.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), compile_options=EAGER)
    with pytest.raises(RuntimeError, match="should be the same"):
        model(torch.randn(1, 3, 8, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_keep_their_dtype_and_gain_masters(dtype):
    torch.manual_seed(0)
    reference = nn.Linear(64, 64, bias=False)
    model = copy.deepcopy(reference).to(dtype)
    plain = copy.deepcopy(reference).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, eps=1e-4)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-4)  # 1e-8 underflows fp16
    flash_inductor.prepare(model, opt, state_bits=None, compile_options=EAGER)
    assert model.weight.dtype == dtype
    assert roles.PREPARED[opt].error_term(model.weight).dtype == torch.int8
    x = torch.randn(16, 64)
    for _ in range(20):
        F.mse_loss(model(x.to(dtype)).float(), x).backward()
        reference.weight.grad = model.weight.grad.float()
        plain.weight.grad = model.weight.grad.clone()
        opt.step(), plain_opt.step(), ref_opt.step()
        opt.zero_grad()
    master = flash_inductor.master_state_dict(model, opt)["weight"]
    master_error = (master - reference.weight).abs().max()
    plain_error = (plain.weight.float() - reference.weight).abs().max()
    assert master_error * 10 < plain_error, (master_error, plain_error)


@pytest.mark.slow
def test_a_restarted_run_compiles_the_prepared_step_from_inductors_cache(tmp_path, monkeypatch):
    """The first step compiles for minutes on large models; a restart (fresh Dynamo, new objects of
    the same shapes and options) takes the step from Inductor's FX graph cache and stores the same
    bits (CPU: 24.8 s -> 5.0 s for 4 tensors)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def run():
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Linear(64, 128, bias=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        flash_inductor.prepare(model, opt)
        model.weight.grad = torch.randn_like(model.weight)
        opt.step()
        return {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}, stored_bits(model, opt)

    first_counts, first = run()
    second_counts, second = run()
    assert first_counts == {"fxgraph_cache_miss": 1}
    assert second_counts == {"fxgraph_cache_hit": 1}
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    torch._dynamo.reset()


def test_every_input_a_prepared_step_writes_is_static_for_cuda_graphs(monkeypatch):
    """The passes copy the Dynamo graph; Dynamo's metadata must survive (and the error-term
    placeholders they add be marked static), or AOTAutograd sees no static input and Inductor skips
    CUDA graphs for the step ("mutated inputs", seen on the H200)."""
    import flash_inductor.backend as backend

    seen = []
    compile_fx_inner = backend.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        written = {n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default}
        seen.append(({i for i, n in enumerate(placeholders) if n in written}, set(kwargs.get("static_input_idxs") or ())))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    monkeypatch.setattr(backend, "compile_fx_inner", spy)
    model = nn.Linear(64, 128, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt)
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    ((written, static),) = seen
    # weight, error term, step counter, codes and scales of both moments
    assert len(written) == 7 and written <= static


_REGISTRY_CASES = {  # a constructor per registry entry, with the options that change its states
    torch.optim.AdamW: dict(lr=1e-3, amsgrad=True),
    torch.optim.Adam: dict(lr=1e-3),
    torch.optim.SGD: dict(lr=1e-2, momentum=0.9),
    flash_inductor.optim.SGDW: dict(lr=1e-2, momentum=0.9),
    flash_inductor.optim.Lion: dict(lr=1e-4),
}


@pytest.mark.parametrize("cls", list(registry.SUPPORTED), ids=lambda c: c.__name__)
def test_prepare_allocates_what_the_registry_names(cls):
    """Every supported class has a case here, and prepare gives each parameter exactly the states
    (and step counter) its registry entry names."""
    assert set(_REGISTRY_CASES) == set(registry.SUPPORTED)
    model = nn.Linear(64, 64)
    opt = cls(model.parameters(), **_REGISTRY_CASES[cls])
    flash_inductor.prepare(model, opt, compile_options={"compiler": "eager"})
    entry = registry.SUPPORTED[cls]
    for p in model.parameters():
        keys = set(opt.state[p])
        assert keys - {"step"} == set(entry.states(opt.param_groups[0]))
        assert ("step" in keys) == entry.counts_steps
