"""Backend options: their validation, their cache key, and a user's Inductor post-grad pass next to ours."""

import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import flash_inductor
from flash_inductor import passes
from flash_inductor.options import Options
from flash_inductor.pipeline import ATEN, AtenPasses, GraphPass, PassContext

# ---------------------------------------------------------------------------- a user's post-grad pass


class CountingPass(CustomGraphPass):
    """A user's post-grad pass: records the aten targets of every graph it sees."""

    def __init__(self, uuid=None):
        self.seen = []
        self._uuid = uuid

    def __call__(self, graph):
        self.seen.append({node.target for node in graph.nodes if node.op == "call_function"})

    def uuid(self):
        return self._uuid


def _sin_to_cos(graph, ctx):
    new = torch.fx.Graph()
    new.output(new.graph_copy(graph, {}))
    rewritten = []
    for node in new.nodes:
        if node.target is torch.ops.aten.sin.default:
            node.target = torch.ops.aten.cos.default
            rewritten.append(node.name)
    return new, rewritten


SIN_TO_COS = GraphPass("sin_to_cos", ATEN, _sin_to_cos)


def test_a_users_post_grad_pass_runs_under_inspect():
    user_pass = CountingPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=user_pass):
        flash_inductor.inspect(lambda t: torch.sin(t) + 1, torch.randn(8))
    assert len(user_pass.seen) == 1


def test_a_users_post_grad_pass_runs_after_ours_in_a_plain_compile(monkeypatch):
    """Given through ``options={"inductor": ...}``, with an aten pass of ours enabled: the user's
    pass still runs, and sees our rewrite. Its uuid is None, so the FX graph cache is bypassed
    (a cache hit would skip both passes)."""
    monkeypatch.setattr(passes, "ATEN_PASSES", (SIN_TO_COS,))
    monkeypatch.setattr(passes, "ALL_PASSES", passes.TORCH_PASSES + (SIN_TO_COS,))
    user_pass = CountingPass()
    torch._dynamo.reset()
    x = torch.randn(8)
    options = {"inductor": {"post_grad_custom_post_pass": user_pass}}
    f = torch.compile(lambda t: torch.sin(t) * 2, backend="flashoptim", options=options)
    torch.testing.assert_close(f(x), torch.cos(x) * 2)
    (targets,) = user_pass.seen
    assert torch.ops.aten.cos.default in targets and torch.ops.aten.sin.default not in targets


def test_an_inference_aware_user_pass_gets_is_inference_and_a_plain_callable_runs_too():
    aware = getattr(torch._inductor.custom_graph_pass, "CustomInferenceAwareGraphPass", None)
    if aware is None:
        pytest.skip("this torch has no inference-aware passes")
    seen = []

    class Aware(aware):
        def __call__(self, graph, is_inference):
            seen.append(is_inference)

        def uuid(self):
            return "aware"

    post_grad = AtenPasses([], PassContext({}, set(), Options()), "g", [Aware(), lambda graph: seen.append("plain")])
    assert isinstance(post_grad, aware)  # so that Inductor hands it is_inference
    post_grad(torch.fx.Graph(), is_inference=True)
    assert seen == [True, "plain"]


def _uuid(user_passes, options=Options()):
    return AtenPasses([SIN_TO_COS], PassContext({}, set(), options), "g", user_passes).uuid()


def test_the_users_pass_is_part_of_the_uuid_and_one_without_uuid_bypasses_the_cache():
    assert _uuid(CountingPass("a")) == _uuid(CountingPass("a")) == _uuid([CountingPass("a")])
    assert _uuid(CountingPass("a")) != _uuid(CountingPass("b")) != _uuid(None)
    # Inductor does not cache a graph under a pass it cannot key: a pass without uuid, a plain callable
    assert _uuid(CountingPass(None)) is None
    assert _uuid((CountingPass("a"), lambda graph: None)) is None


# ---------------------------------------------------------------------------- CUDA graphs


class CudagraphsPass(CountingPass):
    """Also records whether Inductor compiles the graph with CUDA graphs."""

    def __call__(self, graph):
        super().__call__(graph)
        self.seen[-1].add(("cudagraphs", torch._inductor.config.triton.cudagraphs))


def test_cudagraphs_reach_the_models_graphs_not_the_step_or_the_clipping():
    """The clipping graph reads the gradients and the step writes the parameters: neither may be
    CUDA-graphed (each would copy every gradient into the graph's pool). On the CPU Inductor then
    skips CUDA graphs, but the config it compiles with shows which graphs were asked for them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    user_pass = CudagraphsPass()

    @flash_inductor.train_step(model=model, optimizer=opt, cudagraphs=True, inductor={"post_grad_custom_post_pass": user_pass})
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    step(torch.randn(8, 64, dtype=torch.bfloat16))
    aten = torch.ops.aten
    kinds = {  # an op only that graph has
        "forward": aten.relu.default,
        "backward": aten.le.Scalar,  # relu's derivative
        "clipping": aten._foreach_norm.Scalar,
        "step": aten.addcdiv.default,
    }
    asked = {kind: [("cudagraphs", True) in seen for seen in user_pass.seen if op in seen] for kind, op in kinds.items()}
    assert asked == {"forward": [True], "backward": [True], "clipping": [False], "step": [False]}, user_pass.seen


def test_mode_reduce_overhead_is_the_cudagraphs_option(monkeypatch):
    from flash_inductor import backend

    received = []
    monkeypatch.setattr(backend, "compile_graph", lambda gm, inputs, options: received.append(options))
    backend.flashoptim_backend(None, [], mode="reduce-overhead")
    backend.flashoptim_backend(None, [], options={"fp8": "tensorwise"})
    assert [o.cudagraphs for o in received] == [True, False]
    with pytest.raises(ValueError, match="mode='max-autotune' is not supported; use mode='reduce-overhead'"):
        backend.flashoptim_backend(None, [], mode="max-autotune")


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("name, value, expected", [
    ("fp8_min_weight_numel", 1.9, "non-negative int"),
    ("fp8_min_weight_numel", True, "non-negative int"),
    ("fp8_min_weight_numel", -1, "non-negative int"),
    ("fp8_min_weight_numel", "x", "non-negative int"),
    ("fp8_min_gemm_size", -1, "non-negative int"),
    ("fp8_min_gemm_size", 2.5, "non-negative int"),
    ("fp8_history_length", 0, "positive int"),
    ("fp8_exclude", 3, "str or an iterable of str"),
    ("fp8_exclude", ["lm_head", 3], "str or an iterable of str"),
    ("disable", 3, "str or an iterable of pass names"),
    ("inductor", 3, "dict"),
    ("inductor", [("combo_kernels", True)], "dict"),
    ("inductor", {1: True}, "dict"),
    ("dump", 3, "folder path"),
    ("compiler", "x", "'inductor' or 'eager'"),
    ("fp8", "x", "None, 'tensorwise', 'delayed' or 'rowwise'"),
    ("fp8_filter", 3, "callable"),
    ("fp8_fast_accum", 1, "True or False"),
    ("step_kernel", "cuda", "'triton' or 'inductor'"),
    ("cudagraphs", "yes", "True or False"),
    ("recompute_elementwise", 1, "True or False"),
    ("fp8_tensorwise_weight_gradient", 1, "True or False"),
])
def test_a_bad_option_names_the_option_the_value_and_what_is_expected(name, value, expected):
    with pytest.raises(ValueError) as info:
        Options.from_dict({name: value})
    message = str(info.value)
    assert f"option {name!r}" in message and repr(value) in message and expected in message, message


def test_the_int_options_show_an_example():
    with pytest.raises(ValueError, match=r"'fp8_min_weight_numel' must be a non-negative int \(e\.g\. .*\), got 1\.9"):
        Options.from_dict({"fp8_min_weight_numel": 1.9})


def test_good_options_are_normalized():
    options = Options.from_dict({
        "fp8_min_weight_numel": 0, "fp8_exclude": (p for p in ["first", "last"]), "disable": "split_weights",
        "dump": pathlib.Path("/tmp/flashoptim"), "inductor": {"combo_kernels": True},
    })
    assert options.fp8_min_weight_numel == 0 and options.fp8_exclude == ("first", "last")
    assert options.disable == ("split_weights",) and options.dump == "/tmp/flashoptim"
    assert options.inductor == (("combo_kernels", True),)


# ---------------------------------------------------------------------------- cache key


def _starts_with_a_filter():
    return lambda name: name.startswith("a")


def _prefix_filter(prefix):
    return lambda name: name.startswith(prefix)


def test_the_cache_key_names_a_callable_by_its_code_not_its_address():
    first, second = _starts_with_a_filter(), _starts_with_a_filter()
    assert first is not second
    assert Options(fp8_filter=first).cache_key() == Options(fp8_filter=second).cache_key()
    assert _uuid(None, Options(fp8_filter=first)) == _uuid(None, Options(fp8_filter=second))
    starts, ends = (lambda name: name.startswith("a")), (lambda name: name.endswith("a"))  # one line: one source
    assert Options(fp8_filter=starts).cache_key() != Options(fp8_filter=ends).cache_key()
    assert Options(fp8_filter=first).cache_key() != Options(fp8_filter=_prefix_filter("b")).cache_key()
    assert Options(fp8_filter=_prefix_filter("b")).cache_key() == Options(fp8_filter=_prefix_filter("b")).cache_key()
    copy = types.FunctionType(first.__code__, first.__globals__, first.__name__)
    assert Options(fp8_filter=copy).cache_key() == Options(fp8_filter=first).cache_key()


def test_the_cache_key_names_a_custom_pass_by_its_uuid():
    def key(user_pass):
        return Options(inductor=(("post_grad_custom_post_pass", user_pass),)).cache_key()

    assert key(CountingPass("a")) == key(CountingPass("a")) != key(CountingPass("b"))


def test_the_cache_key_is_the_same_in_every_process(tmp_path):
    """Functions defined in ``python -c`` have no source file: their code object is hashed (a
    frozenset constant among it), under a different hash seed in each process."""
    script = textwrap.dedent("""
        from flash_inductor.options import Options
        keep = lambda name: name not in {"lm_head", "embed", "first"}
        print(Options.from_dict({"fp8_filter": keep, "fp8_exclude": ["x*"], "inductor": {"combo_kernels": True}}).cache_key())
    """)
    keys = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120).stdout
            for _ in range(2)]
    assert keys[0] == keys[1] and "0x" not in keys[0]
