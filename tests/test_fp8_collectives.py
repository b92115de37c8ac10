"""FP8 gradient collectives (option ``fp8_collectives``): 2 processes, started here: gloo on the CPU,
and NCCL on 2 GPUs (marked gpu; there the explicit all-reduce steps are compiled by Inductor, Triton).

The workers run every scenario once (module fixture) and save what they saw; the tests compare it
with fp64 references written from DESIGN §2.5 and the e4m3 format, not with the package's helpers.
"""

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol
import torch.nn as nn

import flash_inductor
from flash_inductor.collective_bytes import CollectiveBytes
from flash_inductor.formats import fp8_collective
from flash_inductor.options import Options
from flash_inductor.passes import fp8_collectives
from helpers import BACKENDS, on_gpus, rank_device, run_ranks

WORLD = 2
NUMEL = 1001  # not a multiple of the world size: the exchange pads
PLANTED, HUGE = 7, 1.0e4  # a gradient spike at the same element on both ranks
E4M3_MAX = 448.0
OPTIONS = {"fp8_collectives": True, "compiler": "eager"}


def _gradient(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(NUMEL, generator=gen) * (1 + rank)  # rank 1's amax is larger: the ranks disagree


def _state():
    return list(fp8_collectives.states().values())[-1]  # the newest collective's


def _explicit_all_reduce(rank):
    """A step that all-reduces a gradient itself: plain steps, then a planted spike with mu forced
    to 1 (the start, 1/n, cannot overflow), then the spike again. On GPUs compiled by Inductor."""
    reduce_sum = flash_inductor.compile(lambda g: fcol.all_reduce(g, "sum", dist.group.WORLD), fp8_collectives=True,
                                        compiler="inductor" if on_gpus() else "eager")
    steps = []
    for step in range(4):
        g = _gradient(rank, step).to(rank_device())
        if step >= 2:
            g[PLANTED] = HUGE
        if step == 2:
            _state()[fp8_collective.MU] = 1.0
        mu_before = _state()[fp8_collective.MU].item() if step else None
        out = reduce_sum(g)
        unrewritten = g.clone()
        dist.all_reduce(unrewritten)
        steps.append({"input": g, "out": out, "unrewritten": unrewritten, "mu_before": mu_before,
                      "state": _state().clone()})
    return steps


def _average_bf16(rank):
    reduce_avg = flash_inductor.compile(lambda g: fcol.all_reduce(g, "avg", dist.group.WORLD), **OPTIONS)
    g = _gradient(rank, 10).bfloat16().to(rank_device())
    return {"input": g, "out": reduce_avg(g), "state": _state().clone()}


def _ddp_compiled_autograd(rank):
    """DDP's python reducer traced by compiled autograd: the all-reduces live in the backward graph."""
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(rank_device())
    local = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(rank_device())
    local.load_state_dict(model.state_dict())
    ddp = nn.parallel.DistributedDataParallel(model)
    x = (torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)) * (1 + rank)).to(rank_device())
    compiler = torch.compile(backend="flashoptim", options=OPTIONS)
    before = set(fp8_collectives.states())
    with torch._dynamo.compiled_autograd._enable(compiler):
        ddp(x).sum().backward()
    local(x).sum().backward()
    return {"grads": {n: p.grad for n, p in model.named_parameters()},
            "local_grads": {n: p.grad for n, p in local.named_parameters()},
            "states": [s.clone() for k, s in fp8_collectives.states().items() if k not in before]}


def _inductor(rank):
    """The rewritten graph compiled by Inductor (C++ kernels around the collectives), on step 0's input."""
    reduce_sum = flash_inductor.compile(lambda g: fcol.all_reduce(g, "sum", dist.group.WORLD), fp8_collectives=True)
    return {"out": reduce_sum(_gradient(rank, 0)), "state": _state().clone()}


def _bytes_sent(rank):
    """Bytes per step of an all-reduce of 2**16 elements: FP8 (of bf16 gradients) vs bf16 and fp32."""
    g = torch.randn(1 << 16).to(rank_device())
    reduce_fp8 = flash_inductor.compile(lambda g: fcol.all_reduce(g, "sum", dist.group.WORLD), **OPTIONS)
    reduce_plain = flash_inductor.compile(lambda g: fcol.all_reduce(g, "sum", dist.group.WORLD), compiler="eager")
    sent = {}
    for name, fn, x in [("fp8", reduce_fp8, g.bfloat16()), ("bf16", reduce_plain, g.bfloat16()), ("fp32", reduce_plain, g)]:
        fn(x)  # compile first: only the step is counted
        with CollectiveBytes() as counted:
            fn(x)
        sent[name] = dict(counted.by_op)
    return sent


def _reduce_scatter(rank):
    """A sharded engine's gradient collective: reduce-scatter along dim 0, the sum of fp32 and the
    average of bf16 gradients, each with the bytes its step sends."""
    g = (torch.randn(WORLD * 6, 40, generator=torch.Generator().manual_seed(7 + rank)) * (1 + rank)).to(rank_device())
    out = {}
    for op, x in (("sum", g), ("avg", g.bfloat16())):
        fn = flash_inductor.compile(lambda t, op=op: fcol.reduce_scatter_tensor(t, op, 0, dist.group.WORLD), **OPTIONS)
        fn(x)  # compile first: only the step is counted
        with CollectiveBytes() as counted:
            y = fn(x)
        out[op] = {"input": x, "out": y, "state": _state().clone(), "bytes": dict(counted.by_op)}
    return out


def _three_all_reduces(g):
    """A gradient's sum (rewritten), a scalar metric's sum and a max (both left alone)."""
    world = dist.group.WORLD
    return fcol.all_reduce(g, "sum", world), fcol.all_reduce(g.abs().sum(), "sum", world), fcol.all_reduce(g, "max", world)


def _golden_graph(rank):
    report = flash_inductor.inspect(flash_inductor.compile(_three_all_reduces, **OPTIONS), _gradient(rank, 0))
    (graph,) = report.graphs
    stage = next(s for s in graph.stages if s.name == "fp8_collectives")
    lines = [line.rstrip() for line in stage.code.splitlines() if line.strip() and not line.strip().startswith("#")]
    return {"code": "\n".join(lines), "decisions": graph.decisions}


SCENARIOS = {"explicit": _explicit_all_reduce, "avg": _average_bf16, "ddp": _ddp_compiled_autograd,
             "inductor": _inductor, "bytes": _bytes_sent, "golden": _golden_graph, "reduce_scatter": _reduce_scatter}
# Not run on GPUs: the explicit steps are Inductor's there already, and the golden graph is the CPU one.
CPU_ONLY = ("inductor", "golden")


def _worker(rank, out_dir):
    results = {}
    for name, scenario in SCENARIOS.items():
        if on_gpus() and name in CPU_ONLY:
            continue
        torch._dynamo.reset()
        results[name] = scenario(rank)
    return results


@pytest.fixture(scope="module", params=BACKENDS)
def ranks(request):
    return run_ranks(_worker, request.param, WORLD)


def _ran(ranks, scenario):
    if scenario not in ranks[0]:
        pytest.skip(f"scenario {scenario!r} runs on the CPU only")


# ---- fp64 references, from the e4m3 format ----

def ref_scale(inputs, mu):
    """fp8_max * mu / max over ranks of amax (DESIGN §2.5)."""
    return E4M3_MAX * mu / max(x.double().abs().max().item() for x in inputs)


def fp8_sum_bound(inputs, scale):
    """Largest |FP8 all-reduce - exact sum| per element. Rounding v (|v| <= 448) to e4m3 errs by at
    most half an ulp: 2**-4 |v| for normals (3 mantissa bits), 2**-10 below 2**-6 (spacing 2**-9).
    The ranks' values v_r = x_r * scale round once, their sum s is exact, s rounds once, and the
    result is s / scale (fp32: a relative 2**-23 covers the product, division and final cast)."""
    phase1, v = _cast_error(inputs, scale)
    phase2 = 2**-4 * (sum(v).abs() + phase1) + 2**-10
    return (phase1 + phase2) / scale + 2**-22 * sum(vr.abs() for vr in v) / scale


def _cast_error(inputs, scale):
    """(largest summed error of casting each rank's ``x * scale`` to e4m3, in scaled units; the
    scaled values)."""
    v = [x.double() * scale for x in inputs]
    return sum(2**-4 * vr.abs() + 2**-10 for vr in v), v


def exact_sum(inputs):
    return sum(x.double() for x in inputs)


# ---- numerics of mu, no processes ----

def ref_mu_steps(mu, counts, numel):
    """DESIGN §2.5 in fp64: halve when more than 0.001% overflowed, else grow 2x per 1000 steps up to 1."""
    out = []
    for count in counts:
        mu = mu / 2 if count * 100_000 > numel else min(mu * 2 ** (1 / 1000), 1.0)
        out.append(mu)
    return out


def test_mu_rule_matches_fp64_reference():
    numel = 1_000_000  # 0.001% = 10 elements
    counts = [11] + [0] * 999 + [10, 10] + [0] * 500 + [50, 11, 11] + [0] * 4000
    mu, got = torch.tensor(0.5), []
    for count in counts:
        mu = fp8_collective.next_mu(mu, torch.tensor(count), numel)
        got.append(mu.item())
    ref = ref_mu_steps(0.5, counts, numel)
    # fp32 rounds the growth factor and each product: at most 2**-23 relative per step.
    assert all(abs(g - r) / r <= (i + 1) * 2**-23 for i, (g, r) in enumerate(zip(got, ref)))
    assert got[0] == 0.25  # 11 > 10: halved
    assert abs(got[1000] / 0.5 - 1) <= 1000 * 2**-23 and got[999] < 0.5  # 1000 clean steps: back to 2x, not sooner
    assert got[1001] > got[1000]  # exactly 10 is not "more than 0.001%"
    assert got[-1] == 1.0 and max(got) == 1.0  # capped at 1


def test_fp8_collectives_option_is_checked():
    assert Options.from_dict({"fp8_collectives": True}).fp8_collectives
    with pytest.raises(ValueError, match="'fp8_collectives' must be True or False"):
        Options.from_dict({"fp8_collectives": "yes"})


# ---- 2 processes ----

def test_all_ranks_use_one_scale_from_the_max_amax(ranks):
    for step in range(4):
        states = [r["explicit"][step]["state"] for r in ranks]
        assert torch.equal(states[0], states[1])
        mu = ranks[0]["explicit"][step]["mu_before"] or 1 / WORLD
        scale = ref_scale([r["explicit"][step]["input"] for r in ranks], mu)
        assert states[0][fp8_collective.SCALE].item() == pytest.approx(scale, rel=2**-22)
    # The ranks' own amaxes differ by about 2x, so per-rank scales would have differed.
    inputs = [r["explicit"][0]["input"] for r in ranks]
    assert inputs[1].abs().max() > 1.5 * inputs[0].abs().max()


@pytest.mark.parametrize("step", [0, 1])
def test_sum_within_fp8_error_of_exact_and_unrewritten(ranks, step):
    inputs = [r["explicit"][step]["input"] for r in ranks]
    scale = ranks[0]["explicit"][step]["state"][fp8_collective.SCALE].item()
    bound = fp8_sum_bound(inputs, scale)
    for r in ranks:
        out = r["explicit"][step]["out"]
        assert out.dtype == torch.float32 and out.shape == (NUMEL,)
        assert torch.equal(out, ranks[0]["explicit"][step]["out"])  # every rank gets the same result
        assert ((out.double() - exact_sum(inputs)).abs() <= bound).all()
        unrewritten = r["explicit"][step]["unrewritten"].double()  # gloo's fp32 sum: rounds by 2**-24
        assert ((out.double() - unrewritten).abs() <= bound + 2**-23 * unrewritten.abs()).all()
        assert (out - unrewritten.float()).abs().max() > 0  # FP8 really was on the wire


def test_planted_spike_halves_mu_and_stays_finite(ranks):
    overflow, after = ranks[0]["explicit"][2], ranks[0]["explicit"][3]
    inputs = [r["explicit"][2]["input"] for r in ranks]
    # mu = 1: the spike's sum 2 * HUGE is twice the range; it saturates to amax / mu = HUGE.
    assert overflow["mu_before"] == 1.0
    assert overflow["state"][fp8_collective.MU].item() == 0.5
    assert torch.isfinite(overflow["out"]).all()
    assert overflow["out"][PLANTED].item() == HUGE
    rest = torch.arange(NUMEL) != PLANTED
    bound = fp8_sum_bound(inputs, overflow["state"][fp8_collective.SCALE].item())
    assert ((overflow["out"].double() - exact_sum(inputs)).abs() <= bound)[rest].all()
    # The next step (same spike) fits at mu = 1/2 and mu starts growing again.
    assert after["mu_before"] == 0.5
    assert after["out"][PLANTED].item() == 2 * HUGE
    assert after["state"][fp8_collective.MU].item() == pytest.approx(0.5 * 2 ** (1 / 1000), rel=1e-6)


def test_average_of_bf16_divides_by_world_size_after_the_sum(ranks):
    """gloo itself cannot average; the rewrite sums and divides."""
    inputs = [r["avg"]["input"] for r in ranks]
    scale = ranks[0]["avg"]["state"][fp8_collective.SCALE].item()
    assert scale == pytest.approx(ref_scale(inputs, 1 / WORLD), rel=2**-22)
    out = ranks[0]["avg"]["out"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, ranks[1]["avg"]["out"])
    mean = exact_sum(inputs) / WORLD
    bf16_rounding = 2**-8 * mean.abs() * 1.1
    assert ((out.double() - mean).abs() <= fp8_sum_bound(inputs, scale) / WORLD + bf16_rounding).all()


def test_ddp_compiled_autograd_gradients(ranks):
    """All four gradient all-reduces of the backward graph are rewritten; gradients are the ranks'
    mean within FP8 error (DDP divides by the world size before its sum; mu = 1/2 on step 1)."""
    assert len(ranks[0]["ddp"]["states"]) == 4
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["ddp"]["states"], ranks[1]["ddp"]["states"]))
    for name, grad in ranks[0]["ddp"]["grads"].items():
        inputs = [r["ddp"]["local_grads"][name] / WORLD for r in ranks]
        bound = fp8_sum_bound(inputs, ref_scale(inputs, 1 / WORLD)) * (1 + 2**-20)
        assert torch.equal(grad, ranks[1]["ddp"]["grads"][name])
        assert ((grad.double() - exact_sum(inputs)).abs() <= bound).all(), name


def test_inductor_compiled_equals_the_rewritten_graph_run_eagerly(ranks):
    _ran(ranks, "inductor")
    for r in ranks:
        assert torch.equal(r["inductor"]["out"], r["explicit"][0]["out"])
        assert torch.equal(r["inductor"]["state"], r["explicit"][0]["state"])


def test_bytes_sent_per_step_half_of_bf16(ranks):
    n, numel = WORLD, 1 << 16
    sent = ranks[0]["bytes"]
    ring = 2 * (n - 1) / n  # bytes per element and byte of element size, ring all-reduce
    assert sent["fp32"] == {"all_reduce": ring * numel * 4}
    assert sent["bf16"] == {"all_reduce": ring * numel * 2}
    assert sent["fp8"] == {"all_reduce": ring * 4,  # the amax
                           "all_to_all_single": (n - 1) / n * numel,
                           "all_gather_into_tensor": (n - 1) * (numel / n + 4)}  # sums and the overflow count
    fp8_total = sum(sent["fp8"].values())
    assert fp8_total / sum(sent["bf16"].values()) < 0.501
    assert fp8_total / sum(sent["fp32"].values()) < 0.2505


def test_rewritten_graph(ranks):
    _ran(ranks, "golden")
    golden = ranks[0]["golden"]
    assert [d[2] for d in golden["decisions"]] == [
        "e4m3 all-to-all + all-gather of uint8 bytes, summed locally in fp32",
        "unchanged: a scalar (a loss or metric, not a gradient)", "unchanged: reduce op 'max'"]
    # Regenerate after an intended change with EXPECTTEST_ACCEPT=1.
    expecttest.TestCase().assertExpectedInline(golden["code"], """\
class GraphModule(torch.nn.Module):
    def forward(self, L_g_: "f32[1001]cpu", fp8_collective_0: "f32[2]cpu"):
        l_g_ = L_g_
        all_reduce: "f32[1001]cpu" = flash_inductor_formats_fp8_collective_all_reduce(l_g_, fp8_collective_0, 'sum', '0', 2);  fp8_collective_0 = None
        abs_1: "f32[1001]cpu" = l_g_.abs()
        sum_1: "f32[]cpu" = abs_1.sum();  abs_1 = None
        tensor_1: "f32[]cpu" = torch.ops._c10d_functional.all_reduce(sum_1, 'sum', '0');  sum_1 = None
        wait_tensor_1: "f32[]cpu" = torch.ops._c10d_functional.wait_tensor(tensor_1);  tensor_1 = None
        tensor_2: "f32[1001]cpu" = torch.ops._c10d_functional.all_reduce(l_g_, 'max', '0');  l_g_ = None
        wait_tensor_2: "f32[1001]cpu" = torch.ops._c10d_functional.wait_tensor(tensor_2);  tensor_2 = None
        return (all_reduce, wait_tensor_1, wait_tensor_2)""")


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_keeps_each_ranks_rows_of_the_sum_within_fp8_error(ranks, op):
    """Rank r gets rows r of the ranks' sum (or mean): one e4m3 rounding per rank's value (the sum
    stays fp32, so there is no second rounding and no mu: the state records [1, scale]); one scale
    from the max amax on both ranks; half the bytes of a bf16 reduce-scatter."""
    inputs = [r["reduce_scatter"][op]["input"] for r in ranks]
    states = [r["reduce_scatter"][op]["state"] for r in ranks]
    assert torch.equal(states[0], states[1])
    scale = states[0][fp8_collective.SCALE].item()
    assert states[0][fp8_collective.MU].item() == 1.0
    assert scale == pytest.approx(ref_scale(inputs, 1.0), rel=2**-22)
    divisor = WORLD if op == "avg" else 1
    exact = exact_sum(inputs) / divisor
    phase1, v = _cast_error(inputs, scale)  # one rounding per rank's value; the fp32 sum is exact
    bound = (phase1 / scale + 2**-22 * sum(vr.abs() for vr in v) / scale) / divisor
    rows = inputs[0].shape[0] // WORLD
    for rank, r in enumerate(ranks):
        out = r["reduce_scatter"][op]["out"]
        assert out.dtype == inputs[0].dtype and out.shape == (rows, inputs[0].shape[1])
        want, err = exact[rank * rows:(rank + 1) * rows], bound[rank * rows:(rank + 1) * rows]
        rounding = 2**-8 * want.abs() * 1.1 if out.dtype == torch.bfloat16 else 0
        assert ((out.double() - want).abs() <= err + rounding).all()
    numel = inputs[0].numel()
    assert ranks[0]["reduce_scatter"][op]["bytes"] == {"all_reduce": 2 * (WORLD - 1) / WORLD * 4,  # the amax
                                                       "all_to_all_single": (WORLD - 1) / WORLD * numel}
    bf16_reduce_scatter = (WORLD - 1) / WORLD * numel * 2
    assert sum(ranks[0]["reduce_scatter"][op]["bytes"].values()) / bf16_reduce_scatter < 0.51
