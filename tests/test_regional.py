"""``train_step(..., regional=True)``: the model's repeated blocks compiled one by one, the rest eager.

1. Gradient release: each block's parameters are updated, and their gradients freed, before the
   backward of the block before it starts; the bits equal the normal regional step's.
2. Compiling: torch's own modules compile too, every block compiles past Dynamo's recompile
   limit, and ``inspect`` shows the blocks' graphs.
3. FP8: ``fp8_exclude`` / ``fp8_filter`` name a block's layers as they do the model's; a choice
   that differs between blocks (which share graphs) is refused, as is a model without blocks.
"""

import re

import pytest
import torch
import torch.nn as nn

import flash_inductor
from helpers import EAGER, Net, bf16_batches, square_loss, stored_bits

pytestmark = [
    pytest.mark.filterwarnings("error::flash_inductor.pipeline.PassFailed"),
    pytest.mark.usefixtures("fresh_dynamo"),
]
class _Marker(torch.autograd.Function):
    """Identity at the input of block ``index``; its backward runs once that block's backward is done
    and before the block before it starts, and logs how many parameters of that block and the later
    ones were already updated in this step (``model.before``: their values when the step began)."""

    @staticmethod
    def forward(ctx, x, index, model):
        ctx.index, ctx.model = index, model
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        model, index = ctx.model, ctx.index
        later = [p for block in model.blocks[index:] for p in block.parameters()]
        ctx.model.log.append((index, sum(not torch.equal(p, model.before[p]) for p in later)))
        return g, None, None


class _Blocks(nn.Module):
    """Three residual blocks in an ``nn.ModuleList`` (what ``regional=True`` compiles), an eager
    marker before each."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(3))
        self.log, self.before = [], {}

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = _Marker.apply(x, i, self)
            x = x + block(x)
        return x


def _blocks_step(release=False):
    """``_Blocks``, its AdamW and their ``train_step(..., regional=True)``; each call of the step
    logs afresh."""
    torch.manual_seed(0)
    model = _Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @flash_inductor.train_step(model=model, optimizer=opt, gradient_release=release, regional=True, **EAGER)
    def step(x):
        model.log.clear()
        model.before = {p: p.detach().clone() for p in model.parameters()}
        square_loss(model, x).backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def _train_regional(release):
    """Three steps of ``_blocks_step``: the last step's log and the stored bits."""
    model, opt, step = _blocks_step(release)
    for x in bf16_batches(128):
        step(x)
    return model.log, stored_bits(model, opt)


def test_regional_train_step_applies_each_blocks_gradients_before_the_next_blocks_backward():
    """``train_step(..., regional=True)`` compiles each block on its own, so its backward is a graph
    of its own. With release, a block's parameters are updated, and their gradients freed, before
    the backward of the block before it starts: the gradients of one block are alive at a time (a
    whole-step graph returns them all at its end: the H200 measures that peak,
    docs/benchmarks.md). Without release nothing is updated before ``step()``. Release stores the
    bits of the normal regional step."""
    normal_log, normal = _train_regional(release=False)
    released_log, released = _train_regional(release=True)
    per_block = 2  # weight and bias
    # (Block 0's marker has no backward: the input needs no gradient.)
    assert normal_log == [(2, 0), (1, 0)]
    assert released_log == [(2, per_block), (1, 2 * per_block)]
    for key in normal:
        assert torch.equal(released[key], normal[key]), key


def test_a_regional_step_compiles_each_block_and_inspect_shows_their_graphs():
    """The blocks are torch's own ``nn.Sequential`` (``nn.Module.compile`` would leave them eager):
    the step compiles model graphs that each hold one block's weight and bias, and its optimizer
    step, and ``inspect`` runs it as it is (not the whole step compiled)."""
    _, _, step = _blocks_step()
    report = flash_inductor.inspect(step, bf16_batches(128, 1)[0])
    model_graphs = [g for g in report.graphs if g.kind == "model"]
    assert model_graphs and {sum(r.startswith("param") for r in g.roles.values()) for g in model_graphs} == {2}
    assert any(g.kind == "optimizer step" for g in report.graphs)


class _Scaled(nn.Module):
    """A block whose forward reads a Python number of its own: Dynamo guards on it, so each block
    compiles a graph of its own."""

    def __init__(self, scale):
        super().__init__()
        self.linear, self.scale = nn.Linear(16, 16), scale

    def forward(self, x):
        return self.linear(x) * self.scale


def _regional_step_of_blocks(blocks, **options):
    """A regional train step (SGD) of the model ``nn.Sequential(nn.ModuleList(blocks))``."""
    model = nn.Sequential(nn.ModuleList(blocks))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    @flash_inductor.train_step(model=model, optimizer=opt, regional=True, **options, **EAGER)
    def step(x):
        for block in model[0]:
            x = block(x)
        x.float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def test_a_regional_step_compiles_every_block_past_dynamos_recompile_limit():
    step = _regional_step_of_blocks([_Scaled(i + 1) for i in range(10)])
    report = flash_inductor.inspect(step, torch.randn(4, 16, dtype=torch.bfloat16))
    assert sum(g.kind == "model" for g in report.graphs) == 10  # Dynamo's default limit: 8


class _UpDown(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _fp8_regional_step(**options):
    torch.manual_seed(0)
    return _regional_step_of_blocks([_UpDown() for _ in range(3)], fp8="tensorwise", fp8_min_weight_numel=0, **options)


def test_fp8_exclude_names_a_regional_blocks_layers_as_the_model_does():
    """Dynamo names a block's inputs within the block (``up.weight``); the report, the patterns and
    the filter see the model's names (``0.1.down.weight``), and choose as they would on the model's.
    A choice that differs between blocks is refused."""
    step = _fp8_regional_step(fp8_exclude=["*.down"], fp8_filter=lambda name: name.startswith("0."))
    report = flash_inductor.inspect(step, torch.randn(8, 32, dtype=torch.bfloat16))
    decisions = {subject: decision.split(":")[0] for g in report.graphs for p, subject, decision in g.decisions
                 if p == "fp8_linear"}
    assert decisions and all(re.fullmatch(r"0\.[0-2]\.(up|down)\.weight", name) for name in decisions), decisions
    assert all(d == ("fp8 e4m3/e5m2" if name.endswith("up.weight") else "bf16") for name, d in decisions.items())
    with pytest.raises(ValueError, match=r"keep 0\.0\.up in FP8 but not 0\.2\.up.*within a block.*regional=False"):
        _fp8_regional_step(fp8_filter=lambda name: name != "0.2.up")


def test_regional_train_step_needs_a_module_list():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"regional=True.*Net has no nn.ModuleList.*regional=False"):
        flash_inductor.train_step(lambda x: x, model=model, optimizer=opt, regional=True)
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not opt.state  # not prepared


def test_regional_train_step_refuses_a_chunked_loss_it_cannot_apply():
    """A regional step's loss runs eagerly, where no pass can rewrite it: ``loss_chunk_rows`` is
    refused with the call that does it, before anything is prepared."""
    model = nn.Sequential(nn.ModuleList([nn.Linear(8, 8)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"regional=True.*loss_chunk_rows.*flash_inductor\.linear_cross_entropy"):
        flash_inductor.train_step(lambda x: x, model=model, optimizer=opt, regional=True, loss_chunk_rows=1024)
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not opt.state  # not prepared
