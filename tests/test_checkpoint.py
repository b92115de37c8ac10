"""Checkpoints of prepared optimizers (flash_inductor/checkpoint.py).

- The default ``optimizer.state_dict()`` is a stock torch state dict: fp32 decoded states under
  torch's keys (plus ``error_term``), which stock ``torch.optim`` loads and steps with.
- It round-trips into a freshly prepared optimizer; ``compressed_state_dict=True`` saves codes and
  scales, is under half the size and reloads bit-exactly.
- ``master_state_dict`` / ``load_master_state_dict`` against an fp64 reference of DESIGN §2.1.
- Resuming (model + optimizer state dicts through ``torch.save``) continues bit-for-bit like an
  uninterrupted run, for Adam, AdamW, SGD momentum and Lion, in both state-dict forms.

References (decode of codes, the split-weight format) are written here from DESIGN.md §2.1-2.2;
no helper of ``flash_inductor`` is used to compute an expected value.
"""

import copy
import io
import math
import re

import pytest
import torch

import flash_inductor
from flash_inductor import roles
from flash_inductor.formats.state_tensor import CompandedState, Fp32State
from flash_inductor.optim import Lion
from helpers import EAGER, Net, ref_decode_state, stored_bits

pytestmark = [
    pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed"),
    pytest.mark.usefixtures("fresh_dynamo"),
]

GROUP = 32

OPTIMIZERS = {
    "Adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "SGD": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    "Lion": (Lion, dict(lr=1e-3, weight_decay=0.1)),
}
# torch's state keys per optimizer, and each one's companded kind
STATE_KEYS = {
    "Adam": {"exp_avg": "signed", "exp_avg_sq": "sqrt"},
    "AdamW": {"exp_avg": "signed", "exp_avg_sq": "sqrt"},
    "SGD": {"momentum_buffer": "signed"},
    "Lion": {"exp_avg": "signed"},
}
HAS_STEP = {"Adam": True, "AdamW": True, "SGD": False, "Lion": False}






def make(name, seed=0, **prepare_kw):
    torch.manual_seed(seed)
    model = Net()
    opt_cls, kw = OPTIMIZERS[name]
    opt = opt_cls(model.parameters(), **kw)
    flash_inductor.prepare(model, opt, compile_options=EAGER, **prepare_kw)
    return model, opt


def grad_list(model, steps, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(steps)]


def run(model, opt, grads):
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.to(p.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def serialized_size(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


# ----------------------------------------------------------------------- references (DESIGN.md)




def assert_decodes_to(actual, codes, scales, shape, kind):
    """fp32 ``actual`` is the decode of ``(codes, scales)`` up to fp32 rounding (a few ulps of the
    group scale)."""
    assert actual.dtype == torch.float32 and actual.shape == shape
    ref = ref_decode_state(codes, scales, shape, kind)
    s = scales.double().reshape(-1, 1).expand(-1, GROUP).reshape(-1)[: math.prod(shape)].reshape(shape)
    bound = (s * s if kind == "sqrt" else s) * 2**-21
    assert ((actual.double() - ref).abs() <= bound).all()


def ref_half_ulp_log2(hi):
    """e - m - 1 for bf16 ``hi`` (e = 1 - bias for zero / subnormals), as float64."""
    _, e = torch.frexp(hi.double())
    e = torch.where(hi == 0, torch.full_like(e, -125), e)  # frexp(0) -> 0: zero has e = 1 - bias = -126, as subnormals
    return (torch.clamp(e - 1, min=-126) - 7 - 1).double()  # e - m - 1 with m = 7


def ref_split(x, n=127):
    """DESIGN §2.1 encode in float64: hi = RNE bf16 (stock torch cast), lo = round-half-away."""
    hi = x.to(torch.bfloat16)
    h = torch.exp2(ref_half_ulp_log2(hi))
    rel = ((x.double() - hi.double()) / h).clamp(-1, 1) * n
    lo = torch.sign(rel) * torch.floor(rel.abs() + 0.5)
    return hi, lo.to(torch.int8 if n == 127 else torch.int16)


def ref_master(hi, lo, n=127):
    """DESIGN §2.1 decode, float64."""
    return hi.double() + lo.double() / n * torch.exp2(ref_half_ulp_log2(hi))


def assert_close_fp32(actual, expected64):
    """``actual`` (fp32) is ``expected64`` up to one fp32 rounding (a couple of ulps)."""
    assert actual.dtype == torch.float32
    ulp = torch.exp2(torch.frexp(expected64)[1].double() - 24)
    assert ((actual.double() - expected64).abs() <= 2 * ulp).all()


def assert_same_bits(a, b):
    assert a.keys() == b.keys()
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad}"


def assert_within_one_code_step(got, saved, kind):
    """fp32 ``got`` (a multiple of 32 elements) is within one code step of ``saved`` in every group
    of 32 (DESIGN §2.2), or within the bf16 scale's rounding where values saturate at the top code
    (toward zero: up to 2**-7 of the group's largest): signed, the softsign's steepest step, 2/127 of the
    group's absmax; second moments, 1/255 of the group's largest sqrt(v), in sqrt(v), or 2**-7."""
    got, saved = got.double().reshape(-1, GROUP), saved.double().reshape(-1, GROUP)
    if kind == "signed":
        assert ((got - saved).abs() <= 2 / 127 * saved.abs().amax(1, keepdim=True)).all()
    else:
        assert ((got.sqrt() - saved.sqrt()).abs() <= saved.sqrt().amax(1, keepdim=True) * 2.0**-7).all()


def decoded_states(model, opt, name):
    """{(param name, key): fp32 value} of every state, checked against the reference decode of its
    codes and scales."""
    out = {}
    for pname, p in model.named_parameters():
        for key, kind in STATE_KEYS[name].items():
            value = opt.state[p][key]
            if isinstance(value, CompandedState):
                assert value.kind == kind
                out[pname, key] = value.decode().clone()
                assert_decodes_to(out[pname, key], value.codes, value.scales, p.shape, kind)
            else:
                assert isinstance(value, Fp32State) and p.numel() < 4096
                out[pname, key] = value.values.clone()
    return out


# --------------------------------------------------------------------- (a) stock-compatible form


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_default_state_dict_is_a_stock_torch_state_dict(name):
    model, opt = make(name)
    run(model, opt, grad_list(model, 2))
    expected = decoded_states(model, opt, name)
    record = roles.PREPARED[opt]
    sd = opt.state_dict()
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    assert sorted(sd["state"]) == list(range(len(params)))
    for index, p in enumerate(params):
        entries = sd["state"][index]
        keys = set(STATE_KEYS[name]) | ({"step"} if HAS_STEP[name] else set())
        if p.dtype == torch.bfloat16:
            keys.add("error_term")
            assert entries["error_term"].dtype == torch.int8
            assert torch.equal(entries["error_term"], record.error_term(p))
        if p.numel() >= 4096:  # 8-bit states: their bf16 group scales too
            keys.add("group_scales")
            assert entries["group_scales"].keys() == STATE_KEYS[name].keys()
            for key, scales in entries["group_scales"].items():
                assert scales.dtype == torch.bfloat16 and torch.equal(scales, opt.state[p][key].scales)
        assert set(entries) == keys, names[index]
        for key in STATE_KEYS[name]:
            value = entries[key]
            assert type(value) is torch.Tensor and value.dtype == torch.float32 and value.shape == p.shape
            assert torch.equal(value, expected[names[index], key])
        if HAS_STEP[name]:
            assert float(entries["step"]) == 2.0
    for group in sd["param_groups"]:
        assert type(group["lr"]) is float

    # A stock optimizer on an fp32 copy of the model loads it and steps.
    sd = roundtrip(sd)
    fp32_model = copy.deepcopy(model).float()
    opt_cls, kw = OPTIMIZERS[name]
    stock = opt_cls(fp32_model.parameters(), **kw)
    stock.load_state_dict(sd)
    stock_params = list(fp32_model.parameters())
    for index, p in enumerate(stock_params):
        for key in STATE_KEYS[name]:
            assert torch.equal(stock.state[p][key], expected[names[index], key])
    grads = grad_list(fp32_model, 1, seed=7)[0]
    for p, g in zip(stock_params, grads):
        p.grad = g
    before = [p.detach().clone() for p in stock_params]
    stock.step()
    for index, p in enumerate(stock_params):
        assert torch.isfinite(p).all() and not torch.equal(p, before[index])
        if HAS_STEP[name]:
            assert float(stock.state[p]["step"]) == 3.0
        # torch's documented updates; Adam and SGD add weight_decay * p to the gradient (L2)
        g = grads[index] + (0 if name == "AdamW" else kw["weight_decay"] * before[index])
        if name == "SGD":  # buf = momentum * buf + g
            want = 0.9 * expected[names[index], "momentum_buffer"] + g
            torch.testing.assert_close(stock.state[p]["momentum_buffer"], want)
        else:  # m = beta1 * m + (1 - beta1) g
            want = 0.9 * expected[names[index], "exp_avg"] + 0.1 * g
            torch.testing.assert_close(stock.state[p]["exp_avg"], want)


# ----------------------------------------------------------------------- (b) default round trip


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
def test_default_state_dict_round_trips_into_a_fresh_optimizer(name):
    model, opt = make(name)
    run(model, opt, grad_list(model, 3))
    want = stored_bits(model, opt)
    decoded = decoded_states(model, opt, name)
    sd = roundtrip(opt.state_dict())
    model_sd = roundtrip(model.state_dict())

    model2, opt2 = make(name, seed=1)
    model2.load_state_dict(model_sd)
    opt2.load_state_dict(sd)
    assert decoded_states(model2, opt2, name).keys() == decoded.keys()
    for k, v in decoded_states(model2, opt2, name).items():
        assert torch.equal(v, decoded[k]), k
    record2 = roles.PREPARED[opt2]
    for index, p in enumerate(model2.parameters()):
        if p.dtype == torch.bfloat16:
            assert torch.equal(record2.error_term(p), sd["state"][index]["error_term"])
    # Re-encoding decoded codes reproduces them: the stored bits are those of the saved optimizer.
    assert_same_bits(stored_bits(model2, opt2), want)
    assert isinstance(opt2.param_groups[0]["lr"], torch.Tensor)


def without_group_scales(sd):
    """A copy of optimizer state dict ``sd`` without its "group_scales" entries."""
    sd = copy.deepcopy(sd)
    for entries in sd["state"].values():
        entries.pop("group_scales", None)
    return sd


def test_decoded_state_dict_gives_back_the_codes_of_groups_without_their_top_code():
    """Encode gives every group its top code (docs/numerics.md, "bf16 group scales"), so a decoded
    ``state_dict`` loads back bit for bit even without its group scales. A group without its top
    code (codes from elsewhere: an older checkpoint's, written by hand here) decodes its largest
    value below the scale; encoding its decoded values afresh picks another, smaller scale and moves
    every code of the group (Trainer resumes differed from step 4 on when fp16 scales made such
    groups); the saved group scales give back the very codes. fc1.weight's tiny second moments
    are made such groups, all of them; fc2.weight's are as the steps left them."""
    model, opt = make("AdamW")
    run(model, opt, [[g * 1e-4 for g in step] for step in grad_list(model, 3)])
    fresh = make("AdamW", seed=1)
    fresh[0].load_state_dict(model.state_dict())
    fresh[1].load_state_dict(without_group_scales(roundtrip(opt.state_dict())))
    assert_same_bits(stored_bits(*fresh), stored_bits(model, opt))

    state = opt.state[model.fc1.weight]["exp_avg_sq"]
    state.codes.clamp_(max=254)
    assert (state.codes.amax(dim=1) == 254).all()  # the case
    want = stored_bits(model, opt)
    sd = roundtrip(opt.state_dict())

    model2, opt2 = make("AdamW", seed=1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    assert_same_bits(stored_bits(model2, opt2), want)
    # Without them, every group of fc1.weight's second moments would load with another scale.
    model3, opt3 = make("AdamW", seed=1)
    opt3.load_state_dict(without_group_scales(sd))
    assert (opt3.state[model3.fc1.weight]["exp_avg_sq"].scales != state.scales).all()

    # Values the saved scales do not reproduce (a stock optimizer stepped after loading the dict)
    # are encoded afresh, as without the scales.
    for entries in sd["state"].values():
        if "exp_avg_sq" in entries:
            entries["exp_avg_sq"] = entries["exp_avg_sq"] * 3
    model3, opt3 = make("AdamW", seed=1)
    model4, opt4 = make("AdamW", seed=1)
    opt3.load_state_dict(sd)
    opt4.load_state_dict(without_group_scales(sd))
    assert_same_bits(stored_bits(model3, opt3), stored_bits(model4, opt4))


def test_fp16_group_scales_of_an_older_checkpoint_load():
    """Checkpoints saved before the group scales were bf16 hold fp16 ones. They load: a group whose
    scale, converted to bf16, reproduces its decoded values gets back their codes (fc2.weight's
    states: fp16 holds their bf16 scales exactly); the others (fc1.weight's tiny states, whose
    scales lose bits as fp16 subnormals) are encoded afresh, within one code step of the saved
    values. The next step runs."""
    model, opt = make("AdamW")
    grads = grad_list(model, 4)
    run(model, opt, [[g * 1e-6 if i == 0 else g for i, g in enumerate(step)] for step in grads[:3]])
    want = stored_bits(model, opt)
    sd = roundtrip(opt.state_dict())
    for index, param in ((0, "fc1.weight"), (4, "fc2.weight")):
        for key, scales in sd["state"][index]["group_scales"].items():
            fp16 = scales.to(torch.float16)
            # the case: fc1.weight's scales change through fp16, fc2.weight's do not
            assert (fp16.to(torch.bfloat16) != scales).any() == (param == "fc1.weight"), (param, key)
            sd["state"][index]["group_scales"][key] = fp16

    model2, opt2 = make("AdamW", seed=1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    got = stored_bits(model2, opt2)
    assert got.keys() == want.keys()
    for k in want:
        if not k.startswith("fc1.weight.exp_avg"):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    for key, kind in STATE_KEYS["AdamW"].items():
        state = opt2.state[model2.fc1.weight][key]
        assert state.scales.dtype == torch.bfloat16
        assert_within_one_code_step(state.decode(), sd["state"][0][key], kind)
    run(model2, opt2, grads[3:])
    assert all(torch.isfinite(p).all() for p in model2.parameters())


def test_group_scales_of_another_size_are_refused_and_nothing_changes():
    model, opt = make("AdamW")
    run(model, opt, grad_list(model, 1))
    sd = roundtrip(opt.state_dict())
    sd["state"][0]["group_scales"]["exp_avg"] = sd["state"][0]["group_scales"]["exp_avg"][:-1]
    before = stored_bits(model, opt)
    refusal = r"saved \"group_scales\['exp_avg'\]\" of parameter 'fc1\.weight' is \[255\] torch\.bfloat16, not 256"
    with pytest.raises(ValueError, match=refusal):
        opt.load_state_dict(sd)
    assert_same_bits(stored_bits(model, opt), before)


# -------------------------------------------------------------------------- (c) compressed form


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_compressed_state_dict(name):
    model, opt = make(name, compressed_state_dict=True)
    model_d, opt_d = make(name)
    grads = grad_list(model, 3)
    run(model, opt, grads)
    run(model_d, opt_d, grads)
    want = stored_bits(model, opt)
    sd = opt.state_dict()
    for index, p in enumerate(model.parameters()):
        for key, kind in STATE_KEYS[name].items():
            entry = sd["state"][index][key]
            if p.numel() >= 4096:
                groups = -(-p.numel() // GROUP)
                assert set(entry) == {"codes", "scales", "kind"} and entry["kind"] == kind
                assert entry["codes"].dtype == (torch.int8 if kind == "signed" else torch.uint8)
                assert entry["codes"].numel() == groups * GROUP
                assert entry["scales"].dtype == torch.bfloat16 and entry["scales"].numel() == groups
                state = opt.state[p][key]
                assert torch.equal(entry["codes"], state.codes) and torch.equal(entry["scales"], state.scales)
            else:
                assert entry.dtype == torch.float32 and entry.shape == p.shape
    compressed, default = serialized_size(sd), serialized_size(opt_d.state_dict())
    assert compressed < 0.5 * default, (compressed, default)

    model2, opt2 = make(name, seed=1, compressed_state_dict=True)
    model2.load_state_dict(roundtrip(model.state_dict()))
    opt2.load_state_dict(roundtrip(sd))
    assert_same_bits(stored_bits(model2, opt2), want)
    # and it loads into an optimizer prepared with the default form too (decoded there)
    model3, opt3 = make(name, seed=2)
    model3.load_state_dict(roundtrip(model.state_dict()))
    opt3.load_state_dict(roundtrip(sd))
    assert_same_bits(stored_bits(model3, opt3), want)


# ------------------------------------------------------------------------- (d) master weights


def test_master_state_dict_decodes_split_weights():
    model, opt = make("AdamW")
    run(model, opt, grad_list(model, 2))
    record = roles.PREPARED[opt]
    masters = flash_inductor.master_state_dict(model, opt)
    assert list(masters) == [n for n, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        m = masters[name]
        assert m.dtype == torch.float32 and m.shape == p.shape
        if p.dtype == torch.bfloat16:
            assert_close_fp32(m, ref_master(p.detach(), record.error_term(p)))
        else:
            assert torch.equal(m, p.detach())


def test_load_master_state_dict_recomputes_bf16_and_error_terms():
    model, opt = make("AdamW")
    record = roles.PREPARED[opt]
    g = torch.Generator().manual_seed(5)
    masters = {}
    for name, p in model.named_parameters():
        x = torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-3, 3, p.shape, generator=g)
        masters[name] = x.float()
    # a few exact bf16 ties and values one fp32 ulp away from them
    tie = torch.tensor([1.0 + 2**-8, 1.0078125 + 2**-8, -(1.0 + 2**-8), 3.0 + 2**-7 + 2**-22])
    masters["fc1.weight"].view(-1)[:4] = tie
    flash_inductor.load_master_state_dict(model, opt, masters)
    for name, p in model.named_parameters():
        x = masters[name]
        if p.dtype == torch.bfloat16:
            hi, lo = ref_split(x)
            assert torch.equal(p.detach(), hi), name  # stock round-to-nearest-even
            assert torch.equal(record.error_term(p), lo), name
        else:
            assert torch.equal(p.detach(), x)
    got = flash_inductor.master_state_dict(model, opt)
    for name, p in model.named_parameters():
        x = masters[name]
        if p.dtype == torch.bfloat16:
            hi, lo = ref_split(x)
            assert_close_fp32(got[name], ref_master(hi, lo))
            # 24-bit masters: within half a code step (plus fp32 rounding) of what was loaded
            step = torch.exp2(ref_half_ulp_log2(hi)) / 127
            assert ((got[name].double() - x.double()).abs() <= step / 2 + x.double().abs() * 2**-23).all()
        else:
            assert torch.equal(got[name], x)
    # Loading what master_state_dict gave is idempotent.
    model2, opt2 = make("AdamW", seed=3)
    flash_inductor.load_master_state_dict(model2, opt2, got)
    again = flash_inductor.master_state_dict(model2, opt2)
    for name in got:
        assert torch.equal(again[name], got[name]), name


def test_load_master_state_dict_rejects_bad_input_without_writing():
    model, opt = make("AdamW")
    before = stored_bits(model, opt)
    good = flash_inductor.master_state_dict(model, opt)
    with pytest.raises(KeyError, match="nope"):
        flash_inductor.load_master_state_dict(model, opt, {"fc1.weight": good["fc1.weight"] + 1, "nope": torch.zeros(3)})
    bad_shape = {"fc1.weight": good["fc1.weight"] + 1, "fc2.weight": torch.zeros(96)}
    with pytest.raises(ValueError, match="fc2.weight"):
        flash_inductor.load_master_state_dict(model, opt, bad_shape)
    assert_same_bits(stored_bits(model, opt), before)


def test_state_dict_from_32_bit_masters_loads_into_24_bit():
    model32, opt32 = make("AdamW", master_weight_bits=32)
    run(model32, opt32, grad_list(model32, 2))
    masters32 = flash_inductor.master_state_dict(model32, opt32)
    model, opt = make("AdamW", seed=1)
    model.load_state_dict(model32.state_dict())
    opt.load_state_dict(roundtrip(opt32.state_dict()))
    got = flash_inductor.master_state_dict(model, opt)
    record = roles.PREPARED[opt]
    for name, p in model.named_parameters():
        if p.dtype == torch.bfloat16:
            assert record.error_term(p).dtype == torch.int8
            step = torch.exp2(ref_half_ulp_log2(p.detach())) / 127
            assert ((got[name].double() - masters32[name].double()).abs() <= step / 2 * (1 + 2**-10)).all(), name


# --------------------------------------------------------------- loading stock state dicts


def test_stock_state_dict_before_first_step_keeps_8_bit_states():
    """A stock checkpoint saved before any step has no states: loading it must leave the
    prepared (8-bit / fp32-for-small) states, not let torch allocate bf16 ones lazily."""
    torch.manual_seed(0)
    stock_model = Net()
    stock = torch.optim.AdamW(stock_model.parameters(), lr=1e-2)
    sd = roundtrip(stock.state_dict())
    assert sd["state"] == {}
    model, opt = make("AdamW")
    opt.load_state_dict(sd)
    run(model, opt, grad_list(model, 1))
    for p in model.parameters():
        kinds = {k: type(v) for k, v in opt.state[p].items() if k != "step"}
        want = CompandedState if p.numel() >= 4096 else Fp32State
        assert kinds == {"exp_avg": want, "exp_avg_sq": want}
        assert float(opt.state[p]["step"]) == 1.0


def test_stock_fp32_state_dict_after_steps_is_encoded():
    torch.manual_seed(0)
    stock_model = Net()
    stock = torch.optim.AdamW(stock_model.parameters(), lr=1e-2)
    run(stock_model, stock, grad_list(stock_model, 2))
    sd = roundtrip(stock.state_dict())
    model, opt = make("AdamW")
    opt.load_state_dict(sd)
    for index, (name, p) in enumerate(model.named_parameters()):
        for key, kind in STATE_KEYS["AdamW"].items():
            value = opt.state[p][key]
            saved = sd["state"][index][key]
            if p.numel() >= 4096:
                assert isinstance(value, CompandedState)
                got = ref_decode_state(value.codes, value.scales, p.shape, kind).float()
                assert_within_one_code_step(got, saved, kind)
            else:
                assert isinstance(value, Fp32State) and torch.equal(value.values, saved)
        assert float(opt.state[p]["step"]) == 2.0
    run(model, opt, grad_list(model, 1))


# ---------------------------------------------------------------------------- (e) resume


@pytest.mark.parametrize("compressed", [True, False], ids=["compressed", "decoded"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_bit_exact(name, compressed):
    """3 steps, save, fresh model + optimizer, load, 3 steps == 6 uninterrupted steps, bit for bit
    (the decoded form too: re-encoding decoded codes reproduces them, see test (b))."""
    model, opt = make(name, compressed_state_dict=compressed)
    grads = grad_list(model, 6)
    run(model, opt, grads[:3])
    checkpoint = roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    run(model, opt, grads[3:])
    straight = stored_bits(model, opt)

    model2, opt2 = make(name, seed=1, compressed_state_dict=compressed)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    run(model2, opt2, grads[3:])
    assert_same_bits(stored_bits(model2, opt2), straight)


# ------------------------------------------------------------------ (f) refused loads (issue 12)


def hyperparameters(opt):
    """Each param group's object, its lr tensor (the object schedulers fill) and its other entries."""
    return [(g, g["lr"], float(g["lr"]), {k: v for k, v in g.items() if k not in ("params", "lr")}) for g in opt.param_groups]


def assert_same_hyperparameters(opt, before):
    after = hyperparameters(opt)
    assert len(after) == len(before)
    for (group, lr, value, rest), (group0, lr0, value0, rest0) in zip(after, before):
        assert group is group0 and lr is lr0 and value == value0 and rest == rest0


def _set(entry, key, fn):
    entry[key] = fn(entry[key])


# What each corruption of a compressed AdamW state dict of ``Net`` does (index 4: fc2.weight, 8-bit
# states; index 1: fc1.bias, fp32 states), and the key the refusal must name.
CORRUPTIONS = {
    "error_term_shape": (4, "error_term", lambda e: _set(e, "error_term", lambda t: t[:10])),
    "error_term_dtype": (4, "error_term", lambda e: _set(e, "error_term", lambda t: t.float())),
    "error_term_not_a_tensor": (4, "error_term", lambda e: _set(e, "error_term", lambda t: t.tolist())),
    "state_size": (1, "exp_avg", lambda e: _set(e, "exp_avg", lambda t: t[:10])),
    "compressed_kind": (4, "exp_avg", lambda e: _set(e["exp_avg"], "kind", lambda k: "sqrt")),
    "compressed_size": (4, "exp_avg_sq", lambda e: _set(e["exp_avg_sq"], "codes", lambda c: c[:-1])),
    "compressed_without_scales": (4, "exp_avg", lambda e: e["exp_avg"].pop("scales")),
    "float_codes": (4, "exp_avg", lambda e: _set(e["exp_avg"], "codes", lambda c: c.float())),
    "signed_codes_as_uint8": (4, "exp_avg", lambda e: _set(e["exp_avg"], "codes", lambda c: c.to(torch.uint8))),
    "sqrt_codes_as_int8": (4, "exp_avg_sq", lambda e: _set(e["exp_avg_sq"], "codes", lambda c: c.to(torch.int8))),
    "signed_code_-128": (4, "exp_avg", lambda e: e["exp_avg"]["codes"].view(-1).__setitem__(5, -128)),
    "fp32_scales": (4, "exp_avg", lambda e: _set(e["exp_avg"], "scales", lambda s: s.float())),
    "negative_scale": (4, "exp_avg_sq", lambda e: e["exp_avg_sq"]["scales"].__setitem__(3, -1.0)),
    "inf_scale": (4, "exp_avg", lambda e: e["exp_avg"]["scales"].__setitem__(3, float("inf"))),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_refused_load_leaves_the_optimizer_as_it_was(corruption):
    """Every refusal of ``load_state_dict`` names the parameter and the state key, and changes
    nothing: states, error terms, parameters, param groups (the lr tensor object too); the next step
    runs."""
    model, opt = make("AdamW", compressed_state_dict=True)
    grads = grad_list(model, 4)
    run(model, opt, grads[:2])
    sd = roundtrip(opt.state_dict())
    run(model, opt, grads[2:3])  # the optimizer now differs from sd: a partial load would show
    index, key, corrupt = CORRUPTIONS[corruption]
    corrupt(sd["state"][index])
    before, groups = stored_bits(model, opt), hyperparameters(opt)
    name = list(dict(model.named_parameters()))[index]
    with pytest.raises(ValueError, match=rf"saved '{key}' of parameter '{re.escape(name)}'"):
        opt.load_state_dict(sd)
    assert_same_bits(stored_bits(model, opt), before)
    assert_same_hyperparameters(opt, groups)
    run(model, opt, grads[3:])


def nan_as_bits(tensors):
    """16-bit float tensors (the bf16 scales) as their bits, so that nan equals nan."""
    return {k: v.view(torch.int16) if v.dtype in (torch.float16, torch.bfloat16) else v for k, v in tensors.items()}


def test_compressed_load_accepts_the_nan_scale_of_a_non_finite_group():
    """The format stores a group holding inf/nan as a nan scale (codes 0): such a state reloads."""
    model, opt = make("AdamW", compressed_state_dict=True)
    run(model, opt, grad_list(model, 1))
    fc1 = model.fc1.weight
    opt.state[fc1]["exp_avg"].store(torch.full(fc1.shape, float("inf")))
    assert torch.isnan(opt.state[fc1]["exp_avg"].scales).all()
    model2, opt2 = make("AdamW", seed=1, compressed_state_dict=True)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(roundtrip(opt.state_dict()))
    assert_same_bits(nan_as_bits(stored_bits(model2, opt2)), nan_as_bits(stored_bits(model, opt)))


@pytest.mark.parametrize("entry_point", ["master_state_dict", "load_master_state_dict"])
def test_checkpoint_entry_points_refuse_an_unprepared_optimizer(entry_point):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    args = (model, opt) if entry_point == "master_state_dict" else (model, opt, {})
    with pytest.raises(ValueError, match=r"AdamW was not prepared: call flash_inductor.prepare\(model, optimizer\) first"):
        getattr(flash_inductor, entry_point)(*args)


@pytest.mark.parametrize("bad", ["int64", "bool", "list", "number"])
def test_load_master_state_dict_refuses_non_floating_values_without_writing(bad):
    model, opt = make("AdamW")
    before = stored_bits(model, opt)
    good = flash_inductor.master_state_dict(model, opt)
    value = {
        "int64": good["fc2.weight"].long(), "bool": good["fc2.weight"] > 0,
        "list": good["fc2.weight"].tolist(), "number": 1.0,
    }[bad]
    with pytest.raises(ValueError, match=r"'fc2\.weight'.*floating-point tensor"):
        flash_inductor.load_master_state_dict(model, opt, {"fc1.weight": good["fc1.weight"] + 1, "fc2.weight": value})
    assert_same_bits(stored_bits(model, opt), before)
