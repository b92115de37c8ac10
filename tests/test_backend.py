"""The backend itself: found by name, options, the pass pipeline and its failure handling."""

import importlib.metadata
import subprocess
import sys
import textwrap
import warnings
import zipfile

import pytest
import torch
import torch.nn as nn

import flash_inductor
from flash_inductor import passes
from flash_inductor.options import Options
from flash_inductor.pipeline import ATEN, TORCH, AtenPasses, GraphPass, PassContext, PassFailed


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    (ep,) = [e for e in eps if e.name == "flashoptim"]
    assert ep.load() is flash_inductor.backend.flashoptim_backend


def test_backend_by_name_without_importing_the_package(tmp_path):
    script = textwrap.dedent("""
        import sys, torch
        f = torch.compile(lambda x: x * 2 + 1, backend="flashoptim", options={"compiler": "eager"})
        assert f(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
        assert "flash_inductor.backend" in sys.modules  # loaded through the entry point
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_wheel_ships_the_passes_package(tmp_path):
    root = flash_inductor.__file__.rsplit("/flash_inductor/", 1)[0]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), root],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("flash_inductor-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "flash_inductor/passes/__init__.py" in names
    assert "flash_inductor/passes/split_weights.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)


def test_unknown_option_lists_valid_ones():
    listed = r".*'compiler', 'cudagraphs', 'disable', 'dump', 'fp8', .*'inductor'"
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['bogus'\]" + listed):
        flash_inductor.compile(lambda x: x, bogus=1)
    f = torch.compile(lambda x: x + 1, backend="flashoptim", options={"bogus": 1})
    with pytest.raises(Exception, match="unknown option"):
        f(torch.ones(2))


def test_disable_names_must_be_passes():
    with pytest.raises(ValueError, match="unknown pass.*'nope'.*split_weights"):
        Options.from_dict({"disable": ["nope"]})
    assert not Options.from_dict({"disable": "split_weights"}).enabled("split_weights")


def _prepared_sgdw(**compile_options):
    torch.manual_seed(0)
    model = nn.Linear(8, 4, bias=False)
    opt = flash_inductor.optim.SGDW(model.parameters(), lr=0.1, momentum=0.9)
    flash_inductor.prepare(model, opt, min_quantized_numel=0, compile_options={"compiler": "eager", **compile_options})
    model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    return model, opt


def test_options_reach_the_backend_and_disable_a_pass():
    model, opt = _prepared_sgdw(disable=["split_weights"])
    error = flash_inductor.roles.PREPARED[opt].error_term(model.weight)
    before = error.clone()
    opt.step()
    assert torch.equal(error, before)  # no split-weights rewrite: the error term is not touched
    model, opt = _prepared_sgdw()
    error = flash_inductor.roles.PREPARED[opt].error_term(model.weight)
    before = error.clone()
    opt.step()
    assert not torch.equal(error, before)


def _broken_pass(gm, ctx):
    raise RuntimeError("pattern not supported")


def test_failing_pass_is_skipped_with_a_warning(monkeypatch):
    monkeypatch.setattr(passes, "TORCH_PASSES", (GraphPass("broken", TORCH, _broken_pass),) + passes.TORCH_PASSES)
    model, opt = _prepared_sgdw()
    error = flash_inductor.roles.PREPARED[opt].error_term(model.weight)
    before = error.clone()
    with pytest.warns(PassFailed, match=r"pass 'broken' skipped on graph graph_\d+: RuntimeError: pattern not supported"):
        opt.step()
    assert not torch.equal(error, before)  # the other passes still ran


def _pass_deciding_then_failing(gm, ctx):
    if ctx.recorder:
        ctx.recorder.decision("decides_then_fails", "weight", "rewritten")
    raise RuntimeError("pattern not supported")


def test_decisions_of_a_failing_pass_give_way_to_its_failure_in_the_report(monkeypatch):
    failing = GraphPass("decides_then_fails", TORCH, _pass_deciding_then_failing)
    monkeypatch.setattr(passes, "TORCH_PASSES", (failing,) + passes.TORCH_PASSES)
    with pytest.warns(PassFailed, match="pass 'decides_then_fails' skipped"):
        report = flash_inductor.inspect(lambda t: t * 2, torch.ones(4))
    (graph,) = report.graphs
    assert graph.decisions == [
        ("decides_then_fails", "dynamo graph", "pass skipped, no rewrite: RuntimeError: pattern not supported")]


def _pass_breaking_types(gm, ctx):
    """A rewrite that produces an ill-typed graph: caught by fake propagation, not at run time."""
    gm = flash_inductor.graph_utils.copy_graph_module(gm)
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "sub_":
            node.args = (node.args[0], node.args[1], node.args[1])  # sub_ takes no third tensor
    gm.recompile()
    return gm, ["sub_"]


def test_ill_typed_rewrite_is_rejected_before_compiling(monkeypatch):
    monkeypatch.setattr(passes, "TORCH_PASSES", passes.TORCH_PASSES + (GraphPass("ill_typed", TORCH, _pass_breaking_types),))
    model, opt = _prepared_sgdw()
    with pytest.warns(PassFailed, match="pass 'ill_typed' skipped"):
        opt.step()


def test_aten_pass_runs_inside_inductor_and_changes_the_uuid(monkeypatch):
    def sin_to_cos(graph, ctx):
        rewritten = []
        new = torch.fx.Graph()
        new.output(new.graph_copy(graph, {}))
        for node in new.nodes:
            if node.target is torch.ops.aten.sin.default:
                node.target = torch.ops.aten.cos.default
                rewritten.append(node.name)
        return new, rewritten

    aten_pass = GraphPass("sin_to_cos", ATEN, sin_to_cos)
    monkeypatch.setattr(passes, "ATEN_PASSES", (aten_pass,))
    monkeypatch.setattr(passes, "ALL_PASSES", passes.TORCH_PASSES + (aten_pass,))
    x = torch.randn(16)
    f = flash_inductor.compile(lambda t: torch.sin(t) * 2)
    torch.testing.assert_close(f(x), torch.cos(x) * 2)
    g = flash_inductor.compile(lambda t: torch.sin(t) * 3, disable=["sin_to_cos"])
    torch.testing.assert_close(g(x), torch.sin(x) * 3)

    ctx = PassContext({}, set(), Options())
    assert AtenPasses([aten_pass], ctx, "g").uuid() == AtenPasses([aten_pass], ctx, "g").uuid()
    other_options = PassContext({}, set(), Options(inductor=(("max_autotune", False),)))
    assert AtenPasses([aten_pass], ctx, "g").uuid() != AtenPasses([aten_pass], other_options, "g").uuid()
    other_source = GraphPass("sin_to_cos", ATEN, _broken_pass)
    assert AtenPasses([aten_pass], ctx, "g").uuid() != AtenPasses([other_source], ctx, "g").uuid()


def test_graphs_without_rewrites_match_inductor_bit_for_bit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)

    def loss_and_grads(backend):
        torch._dynamo.reset()
        for p in model.parameters():
            p.grad = None
        loss = torch.compile(lambda t: model(t).square().mean(), backend=backend)(x)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("error", PassFailed)
        ours = loss_and_grads("flashoptim")
    reference = loss_and_grads("inductor")
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)


def test_an_optimizer_step_is_a_graph_that_writes_parameters(monkeypatch):
    """One definition labels a graph "optimizer step" and turns Inductor's pattern matcher off for it:
    it writes prepared parameters. Plain SGD on fp32 parameters under gradient release is one, though
    no storage pass rewrites it; the model's graph keeps the pattern matcher. (Inductor stubbed: no compile.)"""
    patches = []
    monkeypatch.setattr(flash_inductor.backend, "compile_fx",
                        lambda gm, inputs, config_patches=None, **kwargs: patches.append(config_patches) or gm.forward)
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flash_inductor.prepare(model, opt, keep_fp32=["*"], gradient_release=True)  # fp32, stateless: nothing to decode

    def step(x):
        model(x).sum().backward()  # the updates run in backward's hooks, each a compiled graph

    report = flash_inductor.inspect(step, torch.randn(4, 8))
    kinds = [g.kind for g in report.graphs]
    assert kinds.count("model") == 1 and kinds.count("optimizer step") == 2, kinds  # the weight's and the bias's
    for graph, config in zip(report.graphs, patches, strict=True):
        if graph.kind == "optimizer step":
            assert not any(s.rewritten for s in graph.stages if s.level == "torch")  # no storage pass rewrote it
            assert config["pattern_matcher"] is False
        else:
            assert "pattern_matcher" not in (config or {})
