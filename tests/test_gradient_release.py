"""``prepare(..., gradient_release=True)``: each parameter is updated in backward and its gradient freed.

1. Numerics: N steps with gradient release store exactly the bits of N steps of the normal prepared
   step (AdamW with an LR scheduler and a checkpoint round trip, SGD momentum with a closure, a
   ``@train_step``), with the rewritten graphs run op by op and, once, with Inductor kernels.
2. Memory: after backward no gradient is alive, and the most gradient bytes alive at once during
   backward are one parameter's (without release: all of them); ``memory_report`` counts that.
3. Errors: gradient accumulation, a gradient that bypassed the hooks, DistributedDataParallel and
   plain parameters in a 2-process run are refused, naming the option and the fix.

The GPU test measures ``torch.cuda.max_memory_allocated`` with and without release through
``benchmarks/gradient_release.py`` (``python -m pytest -q -m gpu tests/test_gradient_release.py``).
"""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters

import flash_inductor
from helpers import EAGER, Net, benchmark_module, bf16_batches, square_loss, stored_bits

pytestmark = [
    pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed"),
    pytest.mark.usefixtures("fresh_dynamo"),
]
STEPS = 3


def _train(make_model, make_opt, release, compile_options=EAGER, closure=False, reload_after=None):
    """STEPS training steps (with an LR scheduler); returns model, optimizer and stored bits.
    ``make_model()`` takes inputs of 128 features."""
    torch.manual_seed(0)
    model = make_model()
    opt = make_opt(model.parameters())
    flash_inductor.prepare(model, opt, compile_options=compile_options, gradient_release=release)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for i, x in enumerate(bf16_batches(128, STEPS)):
        if closure:
            opt.step(lambda: square_loss(model, x).backward())
        else:
            square_loss(model, x).backward()
            opt.step()
        scheduler.step()
        opt.zero_grad()
        if i == reload_after:
            opt.load_state_dict(opt.state_dict())  # new state dicts and param groups
    return model, opt, stored_bits(model, opt)


OPTIMIZERS = {
    "AdamW": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), dict(reload_after=0)),
    "SGD-momentum": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01), dict(closure=True)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_release_stores_the_bits_of_the_prepared_step(name):
    make_opt, variant = OPTIMIZERS[name]
    _, _, normal = _train(Net, make_opt, release=False, **variant)
    normal_graphs = counters["stats"]["unique_graphs"]
    model, opt, released = _train(Net, make_opt, release=True, **variant)
    assert list(released) == list(normal)
    for key in normal:
        assert torch.equal(released[key], normal[key]), key
    torch.manual_seed(0)
    initial = Net()
    assert all(not torch.equal(p.float(), q) for p, q in zip(model.parameters(), initial.parameters()))
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.5**STEPS)
    # One step per layout of the stored tensors (here: per parameter dtype and shape), also after a
    # load_state_dict (new state tensors, laid out the same).
    release_graphs = counters["stats"]["unique_graphs"] - normal_graphs
    assert release_graphs == len({(p.dtype, p.shape) for p in model.parameters()})


def test_train_step_with_release_stores_the_bits_of_the_normal_train_step():
    """``@train_step``: backward runs inside the compiled function, and the hooks compile each
    parameter's step with the train step's options (here ``compiler="eager"``)."""

    def train(release):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        @flash_inductor.train_step(model=model, optimizer=opt, gradient_release=release, **EAGER)
        def step(x):
            square_loss(model, x).backward()
            opt.step()
            opt.zero_grad()

        for x in bf16_batches(128):
            step(x)
        assert all(p.grad is None for p in model.parameters())
        return stored_bits(model, opt)

    normal, released = train(False), train(True)
    for key in normal:
        assert torch.equal(released[key], normal[key]), key


def _linears():
    return nn.Sequential(nn.Linear(128, 128, bias=False), nn.ReLU(), nn.Linear(128, 128, bias=False))


@pytest.mark.slow
def test_inductor_release_matches_the_prepared_step_and_compiles_once_per_shape(tmp_path, monkeypatch):
    """Inductor kernels, two parameters of one shape: one Dynamo graph and one Inductor compile
    (a fresh FX graph cache), run on each parameter's slices of the flat storage in turn. The bits
    equal the normal step's through Inductor (not always eager's: DESIGN §3 allows one code step
    between kernels and op-by-op)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    _, _, released = _train(_linears, make_opt, release=True, compile_options={})
    assert counters["stats"]["unique_graphs"] == 1
    assert (counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]) == (1, 0)
    _, _, normal = _train(_linears, make_opt, release=False, compile_options={})
    for key in normal:
        assert torch.equal(released[key], normal[key]), key


def _stack(widths, bias):
    """Linear layers ``widths[0] -> widths[1] -> ...`` taking 128 features."""
    widths = [128, *widths]
    return nn.Sequential(*[nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:])])


@pytest.mark.parametrize("layers", [
    pytest.param(lambda n: _stack([128] * n, bias=False), id="one-shape"),
    pytest.param(lambda n: _stack([96, 128] * (n // 2), bias=True), id="four-shapes"),
])
def test_compiles_one_step_per_layout_whatever_the_number_of_parameters(layers):
    """2 and 8 layers compile as many steps: one per layout of the parameters (dtype and shape,
    here); the bits are those of the normal (flat) step."""
    make_opt = lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)  # noqa: E731
    compiled, layouts = {}, {}
    for n in (2, 8):
        _, _, normal = _train(lambda: layers(n), make_opt, release=False)
        before = counters["stats"]["unique_graphs"]
        model, _, released = _train(lambda: layers(n), make_opt, release=True)
        for key in normal:
            assert torch.equal(released[key], normal[key]), key
        compiled[n] = counters["stats"]["unique_graphs"] - before
        layouts[n] = {(p.dtype, p.shape) for p in model.parameters()}
    assert layouts[2] == layouts[8]
    assert compiled[2] == compiled[8] == len(layouts[8])


@pytest.fixture(scope="module")
def release_benchmark():
    """benchmarks/gradient_release.py, whose ``measure`` the memory tests use."""
    return benchmark_module("gradient_release")


def test_gradients_are_freed_in_backward(release_benchmark):
    """3 layers of 64x64 bf16 (8 KiB of gradient each): with release, no gradient outlives
    backward and at most one is alive at a time; without, all three are alive at its end."""
    layer = 64 * 64 * 2
    figures = {release: release_benchmark.measure("cpu", "SGD", release, layers=3, width=64, steps=1, compile_options=EAGER)
               for release in (False, True)}
    normal, released = figures[False], figures[True]
    assert (normal["grads_alive_after_backward"], released["grads_alive_after_backward"]) == (3, 0)
    assert (normal["peak_live_grad_bytes"], released["peak_live_grad_bytes"]) == (3 * layer, layer)
    assert (normal["report_grad_bytes"], released["report_grad_bytes"]) == (3 * layer, layer)
    assert normal["peak_bytes"] - released["peak_bytes"] == 2 * layer


# ---------------------------------------------------------------------------------------- errors

def _prepared(release=True):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt, compile_options=EAGER, gradient_release=release)
    return model, opt


def test_gradient_accumulation_is_refused_before_anything_is_written():
    model, opt = _prepared()
    first, second = bf16_batches(128, 2)
    square_loss(model, first).backward()
    after_one_step = stored_bits(model, opt)
    with pytest.raises(RuntimeError, match=r"gradient_release=True\).*second gradient.*optimizer.step\(\)"):
        square_loss(model, second).backward()
    for key, value in stored_bits(model, opt).items():
        assert torch.equal(value, after_one_step[key]), key
    opt.zero_grad()  # the end of the step: the next backward updates again
    square_loss(model, second).backward()
    assert not torch.equal(model.fc2.weight, after_one_step["fc2.weight"])


def test_a_gradient_that_bypassed_the_hooks_is_refused_at_step():
    """One set by hand, and one of a parameter frozen at prepare (no hook) and unfrozen later."""
    model, opt = _prepared()
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    with pytest.raises(RuntimeError, match=r"'fc1.weight' has a gradient at optimizer.step\(\).*gradient_release=False"):
        opt.step()

    torch.manual_seed(0)
    model = Net()
    model.fc2.weight.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    flash_inductor.prepare(model, opt, compile_options=EAGER, gradient_release=True)
    model.fc2.weight.requires_grad_(True)
    square_loss(model, bf16_batches(128, 1)[0]).backward()
    assert [n for n, p in model.named_parameters() if p.grad is not None] == ["fc2.weight"]
    with pytest.raises(RuntimeError, match=r"'fc2.weight' has a gradient at optimizer.step\(\)"):
        opt.step()


def test_steps_of_freed_release_optimizers_do_not_exhaust_the_recompile_limit():
    """Dynamo keeps the compiled entries of single-parameter steps after their optimizer is freed;
    they count towards the step code's recompile limit. A new prepared optimizer must still compile
    its step (H200 run of benchmarks/gradient_release.py: it failed at the limit)."""

    def train_once(release, layers):
        model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(layers)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        flash_inductor.prepare(model, opt, gradient_release=release, compile_options=EAGER)
        before = model[0].weight.detach().clone()
        square_loss(model, torch.randn(2, 16, dtype=torch.bfloat16)).backward()
        opt.step()
        assert not torch.equal(model[0].weight, before)

    layers = torch._dynamo.config.recompile_limit + 4
    for release in (True, False, True):
        gc.collect()  # frees the previous model and optimizers (their hooks form reference cycles)
        train_once(release, layers)


def test_option_value_is_checked():
    model = Net()
    with pytest.raises(ValueError, match="gradient_release must be True or False"):
        flash_inductor.prepare(model, torch.optim.AdamW(model.parameters()), gradient_release="yes")
    assert model.fc1.weight.dtype == torch.float32


@pytest.fixture
def two_process_group():
    """A real process group of world size 2 in this one process (torch's fake backend: collectives
    do nothing), so DistributedDataParallel can be constructed without a second process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_data_parallel_is_refused(two_process_group):
    model = Net()
    with pytest.raises(ValueError, match=r"gradient_release=True\) cannot be used with DistributedDataParallel.*FSDP2"):
        flash_inductor.prepare(nn.parallel.DistributedDataParallel(model), torch.optim.AdamW(model.parameters()),
                               gradient_release=True)
    assert model.fc1.weight.dtype == torch.float32  # nothing was changed
    opt = torch.optim.AdamW(model.parameters())
    flash_inductor.prepare(model, opt, compile_options=EAGER, gradient_release=True)
    before = stored_bits(model, opt)
    with pytest.raises(RuntimeError, match="plain tensor in a 2-process run.*gradient_release=False"):
        square_loss(model, bf16_batches(128, 1)[0]).backward()
    for key, value in stored_bits(model, opt).items():
        assert torch.equal(value, before[key]), key


# ------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_peak_memory_drops_by_the_gradient_bytes(release_benchmark, optimizer):
    """8 layers of 2048x2048 (an eager model): peak memory during a training step drops by the
    gradient bytes (less the one or two gradients alive at a time), to about 5.1 (AdamW) / 4.1
    (SGD) bytes/param (DESIGN §2.3)."""
    normal = release_benchmark.measure("cuda", optimizer, release=False, layers=8)
    released = release_benchmark.measure("cuda", optimizer, release=True, layers=8)
    grads, largest = normal["grad_bytes"], normal["largest_grad_bytes"]
    drop = normal["peak_bytes"] - released["peak_bytes"]
    assert grads - 2 * largest <= drop <= 1.1 * grads, (drop, grads)
    # weights 2, error terms 1, states + scales; and at most two layers' gradients at a time
    stored = {"AdamW": 2 + 1 + 2 + 1 / 8, "SGD": 2 + 1 + 1 + 1 / 16}[optimizer]
    n = released["params"]
    assert stored <= released["peak_bytes_per_param"] <= stored + (2 * largest) / n + 0.05, released
