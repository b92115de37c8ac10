"""Inspection reports and the train-step decorator, on one small model compiled once by Inductor."""

import inspect
import logging
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor


def mse_train_step(model, opt, **options):
    """``@train_step`` of an MSE loss's forward, backward, step and ``zero_grad``."""

    @flash_inductor.train_step(model=model, optimizer=opt, **options)
    def step(x, y):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.fixture(scope="module")
def inspected():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    step = mse_train_step(model, opt, min_quantized_numel=1024)
    x, y = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(32, 8)
    report = flash_inductor.inspect(step, x, y)
    losses = [step(x, y).item() for _ in range(5)]
    return report, model, opt, step, losses


def test_train_step_prepares_once_and_trains(inspected):
    report, model, opt, step, losses = inspected
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32  # LayerNorm stays fp32
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="already prepared"):
        flash_inductor.prepare(model, opt)


def test_report_has_forward_backward_and_one_optimizer_graph(inspected):
    report = inspected[0]
    kinds = [g.kind for g in report.graphs]
    assert kinds.count("optimizer step") == 1  # the whole AdamW step is one graph
    assert "model" in kinds
    model_graph = report.graph("model")
    subgraphs = {s.subgraph for s in model_graph.stages}
    assert {"dynamo", "forward", "backward"} <= subgraphs
    assert {s.subgraph for s in report.graph("optimizer step").stages} == {"dynamo", "inference"}
    for g in report.graphs:
        assert g.kernel_backends == ["cpp"]
    # where the first step's time went, per graph: the passes, then Inductor per subgraph
    assert list(model_graph.compile_seconds) == ["passes", "forward", "backward"]
    assert list(report.graph("optimizer step").compile_seconds) == ["passes", "inference"]
    assert all(seconds > 0 for g in report.graphs for seconds in g.compile_seconds.values())
    assert f"{model_graph.name}: compile seconds: passes " in report.summary()


def test_report_shows_the_rewrite_with_dtypes(inspected):
    report, model = inspected[:2]
    step = report.graph("optimizer step")
    code = {s.name: s.code for s in step.stages if s.subgraph == "dynamo"}
    assert "split_weights_decode" not in code["captured"]
    # The step runs on flat buckets: the 64x64 weight (8-bit states) is 128 groups of 32; the three
    # small bf16 tensors (fp32 states) and the fp32 LayerNorm tensors form two more buckets.
    flat = "group0_bfloat16_8bit"
    assert f'{flat}_master: "f32[128, 32]cpu" = flash_inductor_formats_split_weights_decode_for_step(' in code["split_weights"]
    assert f'{flat}_error: "i8[128, 32]cpu"' in code["split_weights"]
    assert "CompandedState(bf16[128, 32]cpu)" in code["companded_states"]
    assert f'{flat}_exp_avg_fp32: "f32[128, 32]cpu"' in code["companded_states"]
    rows = {(r[0], r[3]): r[4] for r in report.summary_rows()}
    # the two bf16 buckets have error terms; the fp32 one (LayerNorm) is its own master
    assert rows[(step.name, "split_weights")] == 2
    summary = report.summary()
    assert f"AdamW: {sum(p.numel() for p in model.parameters()):,} parameters; bytes/param: weights" in summary


def test_report_prints_and_saves(inspected, tmp_path):
    report = inspected[0]
    text = str(report)
    assert text.startswith(report.summary())
    assert "after split_weights" in text
    report.save(tmp_path)
    step = report.graph("optimizer step")
    files = sorted(os.listdir(tmp_path / step.name))
    assert "dynamo.captured.py" in files and "dynamo.split_weights.py" in files
    assert "inference.inductor_output.py" in files
    assert (tmp_path / "summary.txt").read_text().strip() == report.summary().strip()


def test_dump_environment_variable_writes_every_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHOPTIM_DUMP", str(tmp_path))
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="flashoptim", options={"compiler": "eager"})
    f(torch.randn(4))
    (graph_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert "relu" in (graph_dir / "dynamo.captured.py").read_text()


class Branching(nn.Module):
    """A forward with a data-dependent Python branch, which Dynamo cannot put in one graph."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        h = self.a(x)
        if h.float().sum().item() > 0:  # BREAK: .item() of a traced tensor
            h = h * 2
        return self.b(h)


def _line_of(function, marker):
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if marker in line)


def test_report_names_each_graph_break_with_its_reason_and_location():
    torch.manual_seed(0)
    model = Branching()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @flash_inductor.train_step(model=model, optimizer=opt, compiler="eager")
    def step(x, y):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()  # STEP: the prepared step runs as its own graph
        opt.zero_grad()
        return loss

    report = flash_inductor.inspect(step, torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 8))
    assert [g.kind for g in report.graphs].count("model") >= 2  # the forward, split at the branch
    here = os.path.abspath(__file__)
    (branch,) = [b for b in report.graph_breaks if b.location == f"{here}:{_line_of(Branching.forward, '# BREAK')}"]
    assert "Tensor.item()" in branch.headline and "capture_scalar_outputs" in branch.reason
    assert f"graph break at {branch.location}: {branch.headline}" in report.summary()
    # The deliberate break at the prepared optimizer step, at the line of the user's opt.step().
    step_line = f"{here}:{_line_of(step, '# STEP')}"
    assert any(b.location == step_line and "torch.compiler.disable" in b.reason for b in report.graph_breaks)
    text = str(report)
    assert f"==== graph break at {branch.location}\n{branch.reason}" in text


@pytest.mark.parametrize("gradient_release", [False, True])
def test_a_compiled_train_step_logs_no_warning_about_the_optimizer_steps_wrapper(gradient_release):
    """The prepared ``opt.step`` runs eagerly with torch's wrapper (step hooks, profiling), and the
    compiled steps (gradient release's per parameter too) are the class's update without it: Dynamo
    had traced that wrapper and logged, in every train step, that it ignores its profiler
    ``record_function``."""
    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    step = mse_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), compiler="eager",
                          gradient_release=gradient_release)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(handler)
    torch._logging._internal.warning_once.cache_clear()  # each warning is logged once per process
    try:
        step(torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 8))
    finally:
        dynamo_log.removeHandler(handler)
    assert [r.getMessage() for r in records] == []
