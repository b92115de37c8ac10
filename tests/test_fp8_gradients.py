"""FP8 gradients: ``prepare(model, opt, gradient_format="e5m2")`` (issue 16, item 3).

1. Format: e5m2 (and e4m3) codes and per-tensor power-of-two scales equal an fp64 reference written
   from the spec (``reference.ref_tensor_scaled_encode``); zero, inf and nan tensors.
2. Backward: each hook encodes its gradient (equal to the reference encode of the bf16 gradient
   autograd computed) and leaves ``p.grad`` None; a second backward adds (decode, add in fp32,
   encode); ``zero_grad`` either way and the step discard them; parameters without a gradient keep
   every bit.
3. The step: bit for bit the step of bf16 gradients holding the decoded FP8 values (the fp64
   reference steps are in tests/test_optimizer_numerics.py); Inductor reads the codes only in
   the update kernel (the decode is fused).
4. Clipping, ``memory_report``, checkpoints, refused combinations.
The 200-step transformer is in tests/test_fp8_linear.py.
"""

import io
import re

import pytest
import torch

import flash_inductor
from flash_inductor import roles
from flash_inductor.formats import tensor_scaled
from helpers import EAGER, Net, stored_bits
from reference import E4M3, E5M2, ref_fp8_gradient, ref_tensor_scaled_encode, ulp_log2

pytestmark = [
    pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed"),
    pytest.mark.usefixtures("fresh_dynamo"),
]
FORMATS = {torch.float8_e5m2: E5M2, torch.float8_e4m3fn: E4M3}
BATCHES = [torch.randn(8, 128, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(6)]


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def make(seed=0, compile_options=EAGER, **prepare_kw):
    """``Net`` prepared with AdamW: fc1.weight and fc2.weight have 8-bit states (FP8 gradients with
    ``gradient_format``), fc1.bias and the LayerNorm keep theirs in ``.grad``."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    flash_inductor.prepare(model, opt, compile_options=compile_options, **prepare_kw)
    return model, opt


def fp8_bucket(opt):
    (bucket,) = [b for b in roles.PREPARED[opt].buckets if b.fp8_grads is not None]
    return bucket


def loss(model, x):
    return model(x).float().square().mean()


def train(model, opt, batches, zero_grad=lambda model, opt: opt.zero_grad()):
    for x in batches:
        loss(model, x).backward()
        opt.step()
        zero_grad(model, opt)


def stored_gradient(opt, p):
    """``p``'s FP8 gradient as (codes as float64, scale as a float)."""
    bucket = fp8_bucket(opt)
    g = bucket._fp8_gradient(p)
    return g.codes.double().reshape(-1)[:p.numel()], g.scales.item()


# ============================================================================ 1. format


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_codes_and_scales_match_the_fp64_reference(dtype):
    """Three segments of very different magnitudes (one all zero) and values that saturate or
    round to zero within a segment."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(20, 32, generator=gen) * torch.tensor([1e-5, 0.0, 300.0]).repeat_interleave(
        torch.tensor([5, 3, 12]))[:, None]
    rows[2, 0] = 1e-30  # below the smallest code of its segment
    starts = torch.tensor([0, 5, 8])
    codes, scales = tensor_scaled.encode(rows, starts, dtype, False)
    decoded = tensor_scaled.decode(codes, scales, starts)
    for segment, first, last in ((0, 0, 5), (1, 5, 8), (2, 8, 20)):
        q, scale = ref_tensor_scaled_encode(rows[first:last], FORMATS[dtype], False)
        assert scales[segment].item() == scale
        assert torch.equal(codes[first:last].double().reshape(-1), q)
        assert torch.equal(decoded[first:last].double().reshape(-1), q / scale)  # exact
    assert codes[2, 0].item() == 0 and not decoded[5:8].any()
    assert codes[8:].double().abs().max() > tensor_scaled.scale_target(dtype) / 2  # the top codes are used


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_gradients_decode_to_nan(value):
    rows = torch.randn(4, 32)
    rows[1, 3] = value
    starts = torch.tensor([0])
    codes, scales = tensor_scaled.encode(rows, starts, torch.float8_e5m2, False)
    assert torch.isnan(tensor_scaled.decode(codes, scales, starts)).all()


# ============================================================================ 2. backward


def test_backward_encodes_each_gradient_and_leaves_grad_empty():
    model, opt = make(gradient_format="e5m2")
    x = BATCHES[0]
    expected = dict(zip(model.parameters(), torch.autograd.grad(loss(model, x), list(model.parameters()))))
    loss(model, x).backward()
    for name, p in model.named_parameters():
        if name in ("fc1.weight", "fc2.weight"):
            assert p.grad is None, name
            q, scale = ref_tensor_scaled_encode(expected[p].double(), E5M2, False)
            codes, got_scale = stored_gradient(opt, p)
            assert got_scale == scale and torch.equal(codes, q), name
        else:  # small tensors keep their gradients
            assert torch.equal(p.grad, expected[p]), name


def test_a_second_backward_adds_in_fp32():
    """Micro-batch accumulation: decode, add the new bf16 gradient in fp32, encode. Against the fp64
    reference of that rule (the same codes, but at a tie of fp32 rounding) and within one code step
    of encoding the fp32 sum of the two bf16 gradients."""
    model, opt = make(gradient_format="e5m2")
    params = list(model.parameters())
    g1 = torch.autograd.grad(loss(model, BATCHES[0]), params)
    g2 = torch.autograd.grad(loss(model, BATCHES[1]), params)
    loss(model, BATCHES[0]).backward()
    loss(model, BATCHES[1]).backward()
    for p, a, b in zip(params, g1, g2):
        if p.grad is not None:  # not an FP8 gradient: torch accumulates
            assert torch.equal(p.grad, a + b)
            continue
        codes, scale = stored_gradient(opt, p)
        total = ref_fp8_gradient(a.double()) + b.double()
        q, ref_scale = ref_tensor_scaled_encode(total, E5M2, False)
        assert scale == ref_scale
        one_code = torch.exp2(ulp_log2(q, E5M2))
        assert ((codes - q).abs() <= one_code).all()
        assert (codes != q).float().mean() < 1e-3
        # two roundings away from the sum in fp32: half a code of each encoding
        a_codes, a_scale = ref_tensor_scaled_encode(a.double(), E5M2, False)
        bound = torch.exp2(ulp_log2(a_codes, E5M2)) / a_scale / 2 + torch.exp2(ulp_log2(codes, E5M2)) / scale / 2
        assert ((codes / scale - (a.float() + b.float()).double().reshape(-1)).abs() <= bound).all()


def test_step_and_zero_grad_discard_fp8_gradients():
    """A gradient belongs to one step: after the step (also after ``model.zero_grad()``, which
    cannot reach them) and after ``opt.zero_grad(set_to_none=...)`` either way, the next backward
    starts afresh, and a step without one leaves the FP8 bucket's every bit."""
    runs = {}
    zero_grads = {
        "opt": lambda model, opt: opt.zero_grad(),
        "opt_keep": lambda model, opt: opt.zero_grad(set_to_none=False),
        "model": lambda model, opt: model.zero_grad(),
    }
    for name, zero_grad in zero_grads.items():
        model, opt = make(gradient_format="e5m2")
        train(model, opt, BATCHES[:3], zero_grad)
        runs[name] = stored_bits(model, opt)
    assert_same_bits(runs["opt"], runs["opt_keep"])
    assert_same_bits(runs["opt"], runs["model"])

    for set_to_none in (True, False):
        model, opt = make(gradient_format="e5m2")
        loss(model, BATCHES[0]).backward()
        opt.zero_grad(set_to_none=set_to_none)
        before = stored_bits(model, opt)
        opt.step()
        after = stored_bits(model, opt)
        fp8 = [n for n in before if n.startswith(("fc1.weight", "fc2.weight"))]
        assert_same_bits({n: before[n] for n in fp8}, {n: after[n] for n in fp8})


def test_the_store_holds_memory_from_the_first_gradient_to_zero_grad():
    """Like the flat bf16 buffer: no storage between steps (a compiled backward peaks before any
    gradient lands, so a store held then would add to the peak), 1 B per element from backward's
    first gradient until ``zero_grad``."""
    model, opt = make(gradient_format="e5m2")
    store = fp8_bucket(opt).fp8_grads.codes
    held = lambda: store.untyped_storage().nbytes()  # noqa: E731
    assert held() == 0
    for set_to_none in (True, False):
        loss(model, BATCHES[0]).backward()
        assert held() == store.numel()
        opt.step()
        assert held() == store.numel()
        opt.zero_grad(set_to_none=set_to_none)
        assert held() == 0


def assert_same_bits(a, b):
    assert a.keys() == b.keys()
    assert not [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(bits(a[k]), bits(b[k]))]


def test_parameter_without_a_gradient_keeps_every_bit():
    model, opt = make(gradient_format="e5m2")
    train(model, opt, BATCHES[:1])
    model.fc2.weight.requires_grad_(False)  # no gradient in this step
    before = stored_bits(model, opt)
    train(model, opt, BATCHES[1:2])
    after = stored_bits(model, opt)
    kept = [k for k in before if k.startswith("fc2.weight")]
    assert len(kept) == 7  # weights, error term, step, two states of codes and scales
    assert_same_bits({k: before[k] for k in kept}, {k: after[k] for k in kept})
    assert not torch.equal(before["fc1.weight"], after["fc1.weight"])


# ============================================================================ 3. the step


def decoded_gradients(opt):
    return {p: g.decode().to(p.dtype) for p, g in fp8_bucket(opt).fp8_gradients().items()}


def run_against_bf16_gradients(compile_options, steps=3):
    """FP8 gradients vs a twin prepared without them whose ``.grad`` holds the FP8 run's decoded
    gradients (exact in bf16) and the same small gradients: every stored bit agrees."""
    fp8_model, fp8_opt = make(gradient_format="e5m2", compile_options=compile_options)
    twin, twin_opt = make(compile_options=compile_options)
    for x in BATCHES[:steps]:
        loss(fp8_model, x).backward()
        grads = decoded_gradients(fp8_opt)
        for p, q in zip(fp8_model.parameters(), twin.parameters()):
            q.grad = grads[p] if p in grads else p.grad.clone()
        fp8_opt.step()
        twin_opt.step()
        fp8_opt.zero_grad()
        twin_opt.zero_grad()
        assert_same_bits(stored_bits(fp8_model, fp8_opt), stored_bits(twin, twin_opt))
    return fp8_model, fp8_opt


def test_step_equals_the_step_of_the_decoded_gradients():
    run_against_bf16_gradients(EAGER)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_inductor_fuses_the_decode_into_the_update_kernel():
    """Inductor (C++ here) compiles the same bits, and the FP8 codes are read by one kernel of the
    step, the AdamW update (``lerp``), which writes the weights: no gradient buffer is materialized.
    Backward's hooks encode each gradient in one kernel too (its amax and codes)."""
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(run_against_bf16_gradients, {}, 1)
    # each C++ kernel: name = async_compile.cpp_pybinding([argument types], ...)
    kernels = re.findall(r"(cpp_fused_\w+) = async_compile.cpp_pybinding\(\[([^]]*)\]", "\n".join(codes))
    reading = [name for name, arguments in kernels if "Float8_e5m2" in arguments]
    update = [name for name in reading if "lerp" in name]
    assert len(update) == 1 and "addcdiv" in update[0], reading
    encoding = [name for name in reading if name not in update]
    assert encoding and all("amax" in name for name in encoding), reading


def test_an_fp8_gradient_bucket_says_so_in_its_name():
    # (that the hand-written CUDA kernel leaves these buckets to Inductor's: tests/test_gpu.py)
    _, opt = make(gradient_format="e5m2")
    assert fp8_bucket(opt).name == "group0_bfloat16_8bit_e5m2_grads"


# ============================================================================ 4. clipping, memory, checkpoints, errors


def test_clip_grad_norm_includes_fp8_gradients():
    """The total norm of the decoded FP8 gradients and the others (fp64 reference), and after
    clipping every gradient the step reads is the coefficient times the one before."""
    model, opt = make(gradient_format="e5m2")
    loss(model, BATCHES[0]).backward()
    before = {p: g.decode() for p, g in fp8_bucket(opt).fp8_gradients().items()}
    others = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
    every = [g.double().reshape(-1) for g in (*before.values(), *others.values())]
    norm = torch.cat(every).norm().item()
    max_norm = norm / 3
    total = flash_inductor.clip_grad_norm_(opt, max_norm)
    assert total.item() == pytest.approx(norm, rel=1e-6)
    coefficient = max_norm / (total.item() + 1e-6)
    for p, g in fp8_bucket(opt).fp8_gradients().items():
        torch.testing.assert_close(g.decode().double(), before[p].double() * coefficient, rtol=1e-6, atol=0)
    for p, g in others.items():
        torch.testing.assert_close(p.grad, (g * torch.tensor(coefficient)).to(p.dtype), rtol=0, atol=0)

    # torch's clip sees only the gradients left in .grad (the documented hazard)
    small = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert small.item() < 0.5 * total.item()


def test_clip_grad_norm_refuses_gradient_release():
    model, opt = make(gradient_release=True)
    with pytest.raises(ValueError, match=r"gradient_release=True.*no set of gradients to clip"):
        flash_inductor.clip_grad_norm_(opt, 1.0)


def test_memory_report_counts_one_byte_per_gradient_and_a_scale_per_tensor():
    model, opt = make(gradient_format="e5m2")
    bucket = fp8_bucket(opt)
    report = flash_inductor.memory_report(model, opt)
    small = model.fc1.bias.numel() + model.norm.weight.numel() + model.norm.bias.numel()
    # fp8 codes (every weight a multiple of 32: no padding), one fp32 scale and int64 start per tensor;
    # the small tensors' buffers: fc1.bias (bf16) and the LayerNorm (fp32), 32 elements each at least
    expected = 8192 + 6144 + 2 * (4 + 8) + 2 * 64 + 4 * 2 * 64
    assert bucket.num_groups * 32 == 8192 + 6144 and small == 3 * 64
    assert report.bytes["grads"] == expected
    default = flash_inductor.memory_report(*make())
    assert default.bytes["grads"] - report.bytes["grads"] == (8192 + 6144) - 24


def test_resume_is_bit_exact():
    """3 steps, save, fresh model + optimizer, load, 3 steps == 6 uninterrupted steps (gradients are
    not saved: none is held between steps)."""
    model, opt = make(gradient_format="e5m2")
    train(model, opt, BATCHES[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    train(model, opt, BATCHES[3:])
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    model2, opt2 = make(seed=1, gradient_format="e5m2")
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    train(model2, opt2, BATCHES[3:])
    assert_same_bits(stored_bits(model2, opt2), stored_bits(model, opt))


BAD = {
    "unknown": (dict(gradient_format="fp8"), r"gradient_format must be None or one of \['e4m3', 'e5m2'\], got 'fp8'"),
    "fp32_states": (dict(gradient_format="e5m2", state_bits=None), r"state_bits=None gives none 8-bit states"),
    "release": (dict(gradient_format="e5m2", gradient_release=True),
                r"cannot be combined with gradient_release=True.*choose one of them"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_combinations_are_refused_before_anything_changes(case):
    kwargs, message = BAD[case]
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=message):
        flash_inductor.prepare(model, opt, **kwargs)
    assert opt not in roles.PREPARED and not opt.state
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_ddp_and_fsdp2_are_refused(one_rank):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    message = r"gradient_format='e5m2' is not supported with DistributedDataParallel or FSDP2.*use gradient_format=None"
    ddp = DistributedDataParallel(Net())
    with pytest.raises(ValueError, match=message):
        flash_inductor.prepare(ddp, torch.optim.AdamW(ddp.parameters()), gradient_format="e5m2")
    sharded = Net()
    fully_shard(sharded.norm)  # stays fp32
    fully_shard(sharded)
    with pytest.raises(ValueError, match=message):
        flash_inductor.prepare(sharded, torch.optim.AdamW(sharded.parameters()), gradient_format="e5m2")


def test_sparse_gradient_is_refused_in_backward():
    model, opt = make(gradient_format="e5m2", seed=0)
    p = model.fc1.weight
    p.grad = torch.zeros_like(p).to_sparse()
    with pytest.raises(RuntimeError, match=r"parameter 'fc1.weight' has a sparse gradient"):
        opt.step()
