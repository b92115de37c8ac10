"""A linear and its cross-entropy some rows at a time (``flash_inductor/linear_cross_entropy.py``,
``passes/chunked_cross_entropy.py``, option ``loss_chunk_rows``).

1. The op against an fp64 reference from the same logits (the linear's, in its dtype): loss and
   gradients, mean and sum, ignored targets, with and without bias, chunks that do not divide the rows;
   a well-formed custom op; its peak memory holds one chunk's logits, not all of them.
2. The pass: the rewritten graph of a small model (pinned), what it leaves whole and why, bad options.
3. A Hugging Face Llama through ``@train_step`` on Inductor: the same losses as without it.
"""

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_golden_graphs import without_comments

import flash_inductor
from flash_inductor.linear_cross_entropy import _backward, _forward, linear_cross_entropy
from helpers import allocations_in

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# ============================================================================ 1. the op


def inputs(dtype, bias, rows=300, features=64, classes=1000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=gen).to(dtype)
    weight = (torch.randn(classes, features, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(classes, generator=gen) * 0.1).to(dtype) if bias else None
    target = torch.randint(0, classes, (rows,), generator=gen)
    target[::7] = -100
    return x, weight, b, target


def reference(x, weight, bias, target, reduction):
    """Loss and gradients in fp64 from the linear's logits as its dtype rounds them; the gradient of
    the logits is rounded to that dtype, as autograd's cast back from ``.float()`` does."""
    logits = F.linear(x, weight, bias).double().requires_grad_()
    loss = F.cross_entropy(logits, target, reduction=reduction)
    (grad,) = torch.autograd.grad(loss, logits)
    grad = grad.to(x.dtype).double()
    grads = [grad @ weight.double(), grad.t() @ x.double()] + ([grad.sum(0)] if bias is not None else [])
    return loss, grads


@pytest.mark.parametrize("chunk_rows", [64, 1000])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_fp64_reference(dtype, reduction, bias, chunk_rows):
    x, weight, b, target = inputs(dtype, bias)
    leaves = [t.requires_grad_() for t in (x, weight, b) if t is not None]
    loss = linear_cross_entropy(x, weight, b, target, reduction=reduction, chunk_rows=chunk_rows)
    grads = torch.autograd.grad(loss, leaves)
    expected_loss, expected_grads = reference(x.detach(), weight.detach(), None if b is None else b.detach(), target,
                                              reduction)
    assert loss.dtype == torch.float32 and abs(loss.double() - expected_loss) <= 1e-6 * expected_loss
    # fp32 sums in another order; in bf16 each chunk's product of the weight's gradient rounds once more
    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-7
    for got, expected in zip(grads, expected_grads):
        assert got.dtype == dtype and got.shape == expected.shape
        assert (got.double() - expected).abs().max() <= tolerance * expected.abs().max()


def test_every_target_ignored_gives_nan_for_mean_and_zero_for_sum():
    x, weight, _, target = inputs(torch.float32, False)
    target[:] = -100
    assert torch.isnan(linear_cross_entropy(x, weight, None, target)).item()
    assert torch.isnan(F.cross_entropy(F.linear(x, weight), target)).item()  # as torch
    assert linear_cross_entropy(x, weight, None, target, reduction="sum").item() == 0.0


def test_bad_arguments_are_refused():
    x, weight, _, target = inputs(torch.float32, False)
    with pytest.raises(ValueError, match="reduction must be one of"):
        linear_cross_entropy(x, weight, None, target, reduction="none")
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        linear_cross_entropy(x, weight, None, target, chunk_rows=0)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_is_a_well_formed_custom_op(bias):
    x, weight, b, target = inputs(torch.bfloat16, bias, rows=40, classes=50)
    leaves = [t.requires_grad_() if t is not None else None for t in (x, weight, b)]
    torch.library.opcheck(_forward, (*leaves, target, -100, "mean", 16))
    lse = _forward(x, weight, b, target, -100, "mean", 16)[1].detach()
    detached = [t.detach() if t is not None else None for t in (x, weight, b)]
    torch.library.opcheck(_backward, (torch.tensor(1.0), *detached, target, lse, -100, "sum", 16))


def peak_bytes(fn):
    """The most bytes ``fn`` had allocated at once above what was allocated when it started (CPU)."""
    with torch.profiler.profile(profile_memory=True) as prof, torch.profiler.record_function("measured"):
        fn()
    totals = [(size, total) for size, total in allocations_in(prof, "measured")]
    start = totals[0][1] - totals[0][0]
    return max(total for _, total in totals) - start


def test_peak_memory_holds_one_chunk_of_logits():
    """Forward and backward of 4096 rows x 2000 classes: the unchunked code holds the fp32 logits (32 MB)
    several times; the chunked one a 256-row chunk's (2 MB) and the gradients."""
    x, weight, _, target = inputs(torch.float32, False, rows=4096, classes=2000)
    x.requires_grad_()
    weight.requires_grad_()

    def run(loss_fn):
        return lambda: torch.autograd.grad(loss_fn(), (x, weight))

    whole = peak_bytes(run(lambda: F.cross_entropy(F.linear(x, weight).float(), target)))
    chunked = peak_bytes(run(lambda: linear_cross_entropy(x, weight, None, target, chunk_rows=256)))
    logits = 4096 * 2000 * 4
    gradients = x.numel() * 4 + weight.numel() * 4
    assert whole >= 2 * logits
    assert chunked <= gradients + 4 * 256 * 2000 * 4 + 4096 * 4 * 4, (chunked, whole)


# ============================================================================ 2. the pass


class LanguageModelHead(nn.Module):
    """Embedding, a norm and an lm_head whose loss is taken as Hugging Face's ``ForCausalLMLoss`` does."""

    def __init__(self, vocab=96, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        logits = self.lm_head(self.norm(self.embed(ids))).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def loss_graph(model, options, *args):
    report = flash_inductor.inspect(flash_inductor.compile(model, compiler="eager", **options), *args)
    graph = report.graph("model")
    return graph, {s.name: without_comments(s.code) for s in graph.stages}


class TestRewrittenGraph(expecttest.TestCase):
    def test_the_loss_becomes_one_chunked_op(self):
        torch.manual_seed(0)
        ids = torch.randint(0, 96, (2, 8))
        graph, stages = loss_graph(LanguageModelHead(), {"loss_chunk_rows": 4}, ids, ids)
        self.assertExpectedInline(stages["chunked_cross_entropy"], """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_modules_embed_parameters_weight_: "f32[96, 32]cpu", L_ids_: "i64[2, 8]cpu", L_self_modules_norm_parameters_weight_: "f32[32]cpu", L_self_modules_norm_parameters_bias_: "f32[32]cpu", L_self_modules_lm_head_parameters_weight_: "f32[96, 32]cpu"):
        l_self_modules_embed_parameters_weight_ = L_self_modules_embed_parameters_weight_
        l_ids_ = L_ids_
        l_self_modules_norm_parameters_weight_ = L_self_modules_norm_parameters_weight_
        l_self_modules_norm_parameters_bias_ = L_self_modules_norm_parameters_bias_
        l_self_modules_lm_head_parameters_weight_ = L_self_modules_lm_head_parameters_weight_
        embedding: "f32[2, 8, 32]cpu" = torch.nn.functional.embedding(l_ids_, l_self_modules_embed_parameters_weight_, None, None, 2.0, False, False);  l_self_modules_embed_parameters_weight_ = None
        layer_norm: "f32[2, 8, 32]cpu" = torch.nn.functional.layer_norm(embedding, (32,), l_self_modules_norm_parameters_weight_, l_self_modules_norm_parameters_bias_, 1e-05);  embedding = l_self_modules_norm_parameters_weight_ = l_self_modules_norm_parameters_bias_ = None
        view_1: "i64[16]cpu" = l_ids_.view(-1);  l_ids_ = None
        reshape: "f32[16, 32]cpu" = layer_norm.reshape(-1, 32);  layer_norm = None
        linear_cross_entropy: "f32[]cpu" = flash_inductor_linear_cross_entropy_linear_cross_entropy(reshape, l_self_modules_lm_head_parameters_weight_, None, view_1, ignore_index = -100, reduction = 'mean', chunk_rows = 4);  reshape = l_self_modules_lm_head_parameters_weight_ = view_1 = None
        return (linear_cross_entropy,)""")
        assert ("chunked_cross_entropy", "lm_head.weight", "chunked, 4 rows at a time") in graph.decisions


def test_logits_used_elsewhere_stay_whole_and_the_report_says_why():
    model = LanguageModelHead()

    def loss_and_logits(ids):
        logits = model.lm_head(model.norm(model.embed(ids))).float()
        return F.cross_entropy(logits.view(-1, 96), ids.view(-1)), logits.argmax(-1)

    graph, stages = loss_graph(loss_and_logits, {"loss_chunk_rows": 4}, torch.randint(0, 96, (2, 8)))
    assert "linear_cross_entropy" not in stages["chunked_cross_entropy"]
    assert any(d[0] == "chunked_cross_entropy" and "used elsewhere" in d[2] for d in graph.decisions), graph.decisions


VIEWS = {
    "view": lambda logits: logits.view(-1, 96),
    "reshape": lambda logits: logits.reshape(16, 96),
    "flatten": lambda logits: logits.flatten(0, 1),
    "torch.flatten": lambda logits: torch.flatten(logits, 0, 1),
    "classes moved": lambda logits: logits.view(96, -1),  # [2, 8, 96] as 96 rows of 16 classes: left whole
}


@pytest.mark.parametrize("view", VIEWS)
def test_views_that_keep_the_classes_are_rewritten(view):
    """The logits reach the loss through any view that keeps the linear's outputs as the classes (as
    ``flatten(0, 1)`` of [batch, seq, vocab]); one that moves them into the rows stays whole, said why."""
    model = LanguageModelHead()
    rows = 96 if view == "classes moved" else 16

    def loss_fn(ids, target):
        return F.cross_entropy(VIEWS[view](model.lm_head(model.norm(model.embed(ids))).float()), target)

    ids, target = torch.randint(0, 96, (2, 8)), torch.randint(0, 16, (rows,))
    graph, stages = loss_graph(loss_fn, {"loss_chunk_rows": 4}, ids, target)
    decisions = [d[2] for d in graph.decisions if d[0] == "chunked_cross_entropy"]
    if view == "classes moved":
        assert "linear_cross_entropy" not in stages["chunked_cross_entropy"]
        assert decisions == ["whole: its views move the linear's outputs out of the classes' dim"]
        return
    assert "linear_cross_entropy" in stages["chunked_cross_entropy"] and decisions == ["chunked, 4 rows at a time"]
    got = flash_inductor.compile(loss_fn, compiler="eager", loss_chunk_rows=4)(ids, target)
    assert torch.allclose(got, loss_fn(ids, target), rtol=1e-6)


@pytest.mark.parametrize("form", ["x @ w.T", "x @ w"])
def test_matmul_forms_are_rewritten_with_their_gradients(form):
    """``x @ w.T`` (w stored (out, in)) and ``x @ w`` (stored (in, out), as Hugging Face's Conv1D):
    rewritten, with the loss and the weight's gradient of the unchunked code."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(96, 32) if form == "x @ w.T" else torch.randn(32, 96))
    h = torch.randn(2, 8, 32)
    target = torch.randint(0, 96, (16,))

    def loss_fn(h, target):
        logits = (h @ w.T if form == "x @ w.T" else h @ w).float()
        return F.cross_entropy(logits.view(-1, 96), target, reduction="sum")

    expected = loss_fn(h, target)
    (expected_grad,) = torch.autograd.grad(expected, w)
    graph, stages = loss_graph(loss_fn, {"loss_chunk_rows": 5}, h, target)
    assert "linear_cross_entropy" in stages["chunked_cross_entropy"] and "@" not in stages["chunked_cross_entropy"]
    got = flash_inductor.compile(loss_fn, compiler="eager", loss_chunk_rows=5)(h, target)
    (grad,) = torch.autograd.grad(got, w)
    assert torch.allclose(got, expected, rtol=1e-6) and torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_off_by_default_and_bad_values_refused():
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 8))
    _, stages = loss_graph(LanguageModelHead(), {}, ids, ids)
    assert "linear_cross_entropy" not in stages["chunked_cross_entropy"]
    with pytest.raises(ValueError, match="'loss_chunk_rows' must be a non-negative int"):
        flash_inductor.compile(LanguageModelHead(), loss_chunk_rows=-1)


# ============================================================================ 3. a Hugging Face Llama


def llama_losses(options, steps=3):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @flash_inductor.train_step(model=model, optimizer=opt, **options)
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    gen = torch.Generator().manual_seed(1)
    return [step(torch.randint(0, 256, (2, 32), generator=gen)).item() for _ in range(steps)]


def test_hugging_face_llama_trains_as_without_it():
    """Through Inductor, 64 rows in chunks of 12 (the last one short): the loss of each step within
    fp32 summation order of the unchunked step's (the weights stay bf16 copies of the same masters)."""
    chunked, whole = llama_losses({"loss_chunk_rows": 12}), llama_losses({})
    assert all(abs(a - b) <= 1e-3 * b for a, b in zip(chunked, whole)), (chunked, whole)
