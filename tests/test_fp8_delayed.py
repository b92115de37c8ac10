"""FP8 linear layers with delayed scaling (option fp8="delayed"), on CPU.

One forward is compiled by Inductor for the whole module and shared by the tests: Dynamo reuses it
for every fresh ``nn.Linear`` of the same shape, which the backend binds to that layer's own
buffers at each call. The reference of the scaling rule is written from DESIGN §2.4 in float64
over Python lists (``ref_delayed``); the FP8 roundings use the hand rounding of test_fp8_formats.
"""

import math

import pytest
import torch
import torch.nn as nn
from test_fp8_formats import f32, ref_pow2_floor, ref_round_fp8, ref_scale

import flash_inductor
from flash_inductor.demo import TinyGPT, lm_train_step
from flash_inductor.fp8_delayed import KEYS, buffer_name
from flash_inductor.fp8_linear import fp8_linear
from flash_inductor.options import Options
from helpers import EAGER, decisions_of

pytestmark = pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed")

L = 4
OPTIONS = {"fp8": "delayed", "fp8_min_weight_numel": 0, "fp8_min_gemm_size": 0, "fp8_history_length": L}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INF = float("inf")
# Step k: input times X_MULT[k] (inf: one element is inf), grad-output times G_MULT[k]; the weight
# is scaled by 1.25 before step 3. Covers: a fresh history (step 0), a zero grad-output on a fresh
# history (step 0: keep the initial scale), growth beyond the window (step 1 saturates), a zero
# input (step 2), an inf amax kept in the window for L steps (5..8), and recovery (9).
X_MULT = [1.0, 4.0, 0.0, 0.5, INF, 1.0, 1.0, 1.0, 1.0, 2.0]
G_MULT = [0.0, 1e-3, 1e-2, 1e-3, 1e-3, 1e-4, 1e-3, 1e-3, 1e-3, 1e-3]


def _forward(layer, x):
    return layer(x)


@pytest.fixture(scope="module")
def compiled():
    """The forward compiled once by Inductor (forward and backward graphs)."""
    torch._dynamo.reset()
    yield flash_inductor.compile(_forward, **OPTIONS)
    torch._dynamo.reset()


def _layer(seed):
    torch.manual_seed(seed)
    return flash_inductor.prepare_fp8(nn.Linear(64, 48).bfloat16(), **OPTIONS)


def _step_data(k, seed=0):
    gen = torch.Generator().manual_seed(seed * 100 + k)
    x = torch.randn(2, 8, 64, generator=gen).bfloat16()
    if X_MULT[k] == INF:
        x[0, 0, 0] = INF
    else:
        x = x * X_MULT[k]  # exact
    g = (torch.randn(2, 8, 48, generator=gen) * G_MULT[k]).bfloat16()
    return x, g


def _run(fn, layer, x, g):
    """One forward and backward on the layer's device; (output, grad x, grad w, grad b, copies of
    the layer's buffers), on the CPU."""
    layer.zero_grad(set_to_none=True)
    x = x.to(layer.weight.device, copy=True).requires_grad_()
    out = fn(layer, x)
    out.backward(g.to(out.device))
    state = {key: getattr(layer, buffer_name("weight", key)).to("cpu", copy=True) for key in KEYS}
    return out.detach().cpu(), x.grad.cpu(), layer.weight.grad.cpu(), layer.bias.grad.cpu(), state


def ref_delayed(amaxes, fmax, length, power_of_two=False):
    """DESIGN §2.4 over one tensor's amaxes (one per step), in float64: (history after each step,
    newest first, zero-padded; the scale used at each step). The window of step k holds the amaxes
    of steps k-L..k-1; while none of them is nonzero (nothing recorded yet) the step's own amax
    stands in. A window max of 0 or not finite keeps the previous scale (initially 1.0)."""
    recorded, previous = [], 1.0
    histories, scales = [], []
    for a in amaxes:
        window = recorded[:length]
        w = math.nan if any(math.isnan(v) for v in window) else max(window, default=0.0)
        if w == 0.0:
            w = a
        if 0.0 < w < INF:
            s = ref_scale(w, fmax).item()
            previous = ref_pow2_floor(s) if power_of_two else s
        scales.append(previous)
        recorded = [a] + recorded
        histories.append((recorded + [0.0] * length)[:length])
    return histories, scales


def _ref_cast(t, scale, dtype):
    """t (float64 values) times ``scale`` in fp32, rounded to ``dtype`` (saturating), float64."""
    return ref_round_fp8(f32(t.double() * scale), dtype)


def _check_against_reference(fn, power_of_two, device="cpu"):
    layer = _layer(0).to(device)
    steps, results, weights = [], [], []
    for k in range(len(X_MULT)):
        if k == 3:
            with torch.no_grad():
                layer.weight.mul_(1.25)
        x, g = _step_data(k)
        steps.append((x, g))
        weights.append(layer.weight.detach().to("cpu", copy=True))
        results.append(_run(fn, layer, x, g))

    def amaxes(tensors):
        return [t.double().abs().max().item() for t in tensors]

    ref = {
        "x": ref_delayed(amaxes(x for x, _ in steps), 448.0, L, power_of_two),
        "w": ref_delayed(amaxes(weights), 448.0, L, power_of_two),
        "g": ref_delayed(amaxes(g for _, g in steps), 57344.0, L, power_of_two),
    }
    for k, ((x, g), w, (out, grad_x, grad_w, _, state)) in enumerate(zip(steps, weights, results)):
        want_history = torch.tensor([ref["x"][0][k], ref["w"][0][k]]).float()
        assert torch.equal(state["amax_history"], want_history), k
        assert torch.equal(state["grad_amax_history"], torch.tensor([ref["g"][0][k]]).float()), k
        sx, sw, sg = ref["x"][1][k], ref["w"][1][k], ref["g"][1][k]
        assert state["scale"].tolist() == [sx, sw], k
        assert state["grad_scale"].tolist() == [sg], k
        if X_MULT[k] == INF:
            continue  # the output is inf/nan there; the state above is what matters
        # The scales above are the ones the GEMMs used: outputs and gradients equal FP8 GEMMs of
        # operands cast with them (fp64 products; the compiled result is rounded to bf16).
        xq = _ref_cast(x.reshape(-1, 64), sx, E4M3)
        wq = _ref_cast(w, sw, E4M3)
        gq = _ref_cast(g.reshape(-1, 48), sg, E5M2)
        want_out = (xq @ wq.T) / (sx * sw) + layer.bias.double().cpu()
        want_grad_x = (gq @ wq) / (sg * sw)
        want_grad_w = (gq.T @ xq) / (sg * sx)
        for got, want in ((out, want_out), (grad_x, want_grad_x), (grad_w, want_grad_w)):
            atol = 2**-7 * want.abs().max().item() + 1e-30
            torch.testing.assert_close(got.double().reshape(want.shape), want, rtol=2**-7, atol=atol)
    return results


def test_scales_and_histories_follow_the_spec_step_by_step(compiled):
    """Inductor-compiled forward and backward update the buffers as the reference does; the scale
    of step k comes from the amaxes of steps < k (its own only while nothing is recorded)."""
    results = _check_against_reference(compiled, power_of_two=False)
    x_scales = [r[4]["scale"][0].item() for r in results]
    assert x_scales[5:9] == [x_scales[4]] * 4 and x_scales[9] != x_scales[4]  # the inf's window
    assert results[0][4]["grad_scale"].item() == 1.0  # zero grad-output, nothing recorded


@pytest.mark.gpu
def test_cuda_compiled_forward_and_backward_follow_the_spec():
    """Triton and cuBLAS FP8 GEMMs, on the device machine's torch (2.11): the compiled backward
    writes the grad-output state there too."""
    torch._dynamo.reset()
    _check_against_reference(flash_inductor.compile(_forward, **OPTIONS), power_of_two=False, device="cuda")
    torch._dynamo.reset()


def test_power_of_two_scales_follow_the_spec():
    fn = flash_inductor.compile(_forward, **OPTIONS, **EAGER, fp8_power_of_two_scales=True)
    results = _check_against_reference(fn, power_of_two=True)
    for r in results:
        for s in (*r[4]["scale"].tolist(), *r[4]["grad_scale"].tolist()):
            assert s == ref_pow2_floor(s)


def test_power_of_two_scales_with_current_scaling():
    """The option reaches tensorwise scaling too: the GEMM equals _scaled_mm of operands cast with
    the reference power-of-two scales, and differs from the one with unrounded scales."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(32, 64, generator=gen), torch.randn(48, 64, generator=gen) * 0.05
    out = fp8_linear(x, w, power_of_two=True)

    def gemm(round_scale):
        sx, sw = (round_scale(ref_scale(t.double().abs().max().item(), 448.0).item()) for t in (x, w))
        xq, wq = (_ref_cast(t, s, E4M3).to(E4M3) for t, s in ((x, sx), (w, sw)))
        return torch._scaled_mm(xq, wq.t(), torch.tensor(1 / sx), torch.tensor(1 / sw), out_dtype=torch.bfloat16)

    assert torch.equal(out, gemm(ref_pow2_floor).float())
    assert not torch.equal(out, gemm(lambda s: s).float())


def test_state_dict_round_trip_then_continuing_is_bit_identical(compiled):
    original = _layer(1)
    for k in range(5):
        _run(compiled, original, *_step_data(k, seed=1))
    fresh = _layer(2)  # other weights, empty histories
    pointers = {key: getattr(fresh, buffer_name("weight", key)).data_ptr() for key in KEYS}
    fresh.load_state_dict(original.state_dict())
    assert all(getattr(fresh, buffer_name("weight", key)).data_ptr() == p for key, p in pointers.items())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for k in range(5, len(X_MULT)):
        a = _run(compiled, original, *_step_data(k, seed=1))
        b = _run(compiled, fresh, *_step_data(k, seed=1))
        for got, want in zip(b[:4], a[:4]):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), k
        for key in KEYS:
            assert torch.equal(b[4][key], a[4][key]), (k, key)
    # Both layers ran the one compiled graph, each with its own buffers.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert original.weight_fp8_amax_history[0, 0].item() == fresh.weight_fp8_amax_history[0, 0].item() > 0


def _sqnr(reference, approx):
    return flash_inductor.formats.fp8.sqnr_db(reference.float(), approx.float()).item()


def test_output_and_gradients_against_bf16(compiled):
    layer = _layer(3)
    reference = nn.Linear(64, 48).bfloat16()
    reference.load_state_dict(layer.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):  # the histories fill up with amaxes of the same distribution
        x, g = torch.randn(2, 8, 64, generator=gen).bfloat16(), torch.randn(2, 8, 48, generator=gen).bfloat16()
        out, grad_x, grad_w, grad_b, _ = _run(compiled, layer, x, g)
    ref_x = x.clone().requires_grad_()
    reference(ref_x).backward(g)
    ref_out = reference(x)
    assert out.dtype == grad_x.dtype == torch.bfloat16
    assert _sqnr(ref_out, out) >= 25
    assert _sqnr(ref_x.grad, grad_x) >= 20
    assert _sqnr(reference.weight.grad, grad_w) >= 20
    torch.testing.assert_close(grad_b, reference.bias.grad, rtol=1e-2, atol=1e-2)


def test_recompile_continues_the_same_buffers(fresh_dynamo):
    layer = _layer(4)
    fn = flash_inductor.compile(_forward, **OPTIONS, **EAGER)
    pointers = {key: getattr(layer, buffer_name("weight", key)).data_ptr() for key in KEYS}
    amaxes = []
    for batch in (2, 4, 4):  # the second shape recompiles
        x, g = torch.randn(batch, 8, 64).bfloat16(), torch.randn(batch, 8, 48).bfloat16()
        _run(fn, layer, x, g)
        amaxes.insert(0, x.float().abs().max().item())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert all(getattr(layer, buffer_name("weight", key)).data_ptr() == p for key, p in pointers.items())
    assert layer.weight_fp8_amax_history[0].tolist() == amaxes + [0.0]


# ============================================================================ preparation, errors


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 32)
        self.small = nn.Linear(32, 16)  # under the size threshold below
        self.odd = nn.Linear(32, 20)  # 20 is not a multiple of 16
        self.proj = nn.Parameter(torch.randn(48, 32) * 0.1)  # a bare parameter: no state

    def forward(self, x):
        h = self.fc(x)
        return self.small(h), self.odd(h), h @ self.proj.T


def test_prepare_fp8_gives_eligible_linears_fp32_buffers_once():
    model = Mixed()
    flash_inductor.prepare_fp8(model, **dict(OPTIONS, fp8_min_weight_numel=1024))
    state_keys = [k for k in model.state_dict() if "_fp8_" in k]
    assert state_keys == [f"fc.weight_fp8_{key}" for key in KEYS]
    assert model.fc.weight_fp8_amax_history.shape == (2, L) and model.fc.weight_fp8_grad_amax_history.shape == (1, L)
    history = model.fc.weight_fp8_amax_history
    flash_inductor.prepare_fp8(model, **OPTIONS)  # again, and now also `small`: fc keeps its state
    assert model.fc.weight_fp8_amax_history is history and hasattr(model.small, "weight_fp8_scale")
    opt = torch.optim.AdamW(model.parameters())
    flash_inductor.prepare(model, opt, compile_options=EAGER)
    assert model.fc.weight.dtype == torch.bfloat16
    assert {getattr(model.fc, buffer_name("weight", key)).dtype for key in KEYS} == {torch.float32}


def test_bad_history_length_is_refused_and_changes_nothing():
    for bad in (0, -3, 2.5, True, "16"):
        with pytest.raises(ValueError, match=rf"option 'fp8_history_length' must be a positive int .* got {bad!r}"):
            Options.from_dict({"fp8": "delayed", "fp8_history_length": bad})
    with pytest.raises(ValueError, match=r"option 'fp8_power_of_two_scales' must be True or False, got 'no'"):
        Options.from_dict({"fp8": "delayed", "fp8_power_of_two_scales": "no"})
    model = flash_inductor.prepare_fp8(Mixed(), **OPTIONS)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"fc.weight_fp8_amax_history has length {L}, not fp8_history_length=8"):
        flash_inductor.prepare_fp8(model, **dict(OPTIONS, fp8_history_length=8))
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_inspection_shows_each_decision_and_unprepared_layers_warn(fresh_dynamo):
    model = flash_inductor.prepare_fp8(Mixed(), **dict(OPTIONS, fp8_min_weight_numel=1024))
    fn = flash_inductor.compile(model.forward, **dict(OPTIONS, **EAGER, fp8_min_weight_numel=1024))
    with pytest.warns(UserWarning, match=r"'proj' has no delayed-scaling state, so it stays in bf16; call flash_inductor"):
        report = flash_inductor.inspect(fn, torch.randn(4, 64))
    decisions = decisions_of(report)
    assert decisions == {
        "fc.weight": "fp8 e4m3/e5m2, delayed scaling",
        "small.weight": "bf16: weight 16x32 is under fp8_min_weight_numel=1024",
        "odd.weight": "bf16: weight 20x32: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)",
        "proj": "bf16: no delayed-scaling state (flash_inductor.prepare_fp8 makes it)",
    }
    assert "fp8_linear: fc.weight: fp8 e4m3/e5m2, delayed scaling" in report.summary()
    assert model.fc.weight_fp8_amax_history[0, 0].item() > 0  # the compiled graph updated it


def test_a_model_without_state_on_the_shared_graph_is_refused(fresh_dynamo):
    fn = flash_inductor.compile(_forward, **OPTIONS, **EAGER)
    x = torch.randn(2, 8, 64).bfloat16()
    fn(_layer(5), x)
    unprepared = nn.Linear(64, 48).bfloat16()
    with pytest.raises(RuntimeError, match=r"the 'weight' of this call has no delayed-scaling state; call flash_inductor"):
        fn(unprepared, x)


def test_train_step_prepares_the_state_and_trains(fresh_dynamo):
    """train_step: prepare (bf16 + 8-bit states), then prepare_fp8; the step's forward and backward
    update the state of the FP8 layers (all but the excluded head), which stays fp32."""
    torch.manual_seed(0)
    model = TinyGPT(dim=32, heads=2, layers=1, seq=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    step = lm_train_step(model, opt, **OPTIONS, **EAGER, fp8_exclude=["head"])
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    report = flash_inductor.inspect(step, tokens[:, :-1], tokens[:, 1:])
    losses = [step(tokens[:, :-1], tokens[:, 1:]).item() for _ in range(L + 1)]
    decisions = decisions_of(report)
    fp8_layers = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "head"]
    assert decisions == {
        **{f"{name}.weight": "fp8 e4m3/e5m2, delayed scaling" for name in fp8_layers},
        "head.weight": "bf16: excluded by fp8_exclude ['head']",
    }
    assert not hasattr(model.head, "weight_fp8_scale")
    for name in fp8_layers:
        layer = model.get_submodule(name)
        assert layer.weight.dtype == torch.bfloat16 and layer.weight_fp8_amax_history.dtype == torch.float32
        assert bool((layer.weight_fp8_amax_history > 0).all()) and bool((layer.weight_fp8_grad_amax_history > 0).all())
    assert losses[-1] < losses[0]

