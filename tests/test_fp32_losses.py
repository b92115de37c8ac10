"""Losses of bf16 values computed in fp32 (``passes/fp32_losses.py``).

1. The rewritten graph of a bf16 head's cross-entropy (pinned), and what the report says.
2. Each loss, compiled, against the fp64 loss of the same bf16 values: within fp32's rounding, where
   the loss computed in bf16 is not; the logits' gradient is the fp64 one rounded to bf16 once.
3. What is left as it is: fp32 inputs, a ``log_softmax`` given its own dtype.
4. A Hugging Face BERT through ``@train_step``: its loss comes out in fp32, next to the fp32 model's.
"""

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_golden_graphs import without_comments

import flash_inductor

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Head(nn.Module):
    """An embedding and a head whose cross-entropy is taken on its logits as they are (BERT's)."""

    def __init__(self, vocab=96, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        logits = self.head(self.embed(ids))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def rewritten(fn, *args, **options):
    report = flash_inductor.inspect(flash_inductor.compile(fn, compiler="eager", **options), *args)
    graph = report.graph("model") if isinstance(fn, nn.Module) else report.graphs[0]
    return graph, {s.name: without_comments(s.code) for s in graph.stages}


class TestRewrittenGraph(expecttest.TestCase):
    def test_a_bf16_cross_entropy_reads_its_logits_as_fp32(self):
        torch.manual_seed(0)
        ids = torch.randint(0, 96, (2, 8))
        graph, stages = rewritten(Head().to(torch.bfloat16), ids, ids)
        self.assertExpectedInline(stages["fp32_losses"], """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_modules_embed_parameters_weight_: "bf16[96, 32]cpu", L_ids_: "i64[2, 8]cpu", L_self_modules_head_parameters_weight_: "bf16[96, 32]cpu", L_self_modules_head_parameters_bias_: "bf16[96]cpu"):
        l_self_modules_embed_parameters_weight_ = L_self_modules_embed_parameters_weight_
        l_ids_ = L_ids_
        l_self_modules_head_parameters_weight_ = L_self_modules_head_parameters_weight_
        l_self_modules_head_parameters_bias_ = L_self_modules_head_parameters_bias_
        embedding: "bf16[2, 8, 32]cpu" = torch.nn.functional.embedding(l_ids_, l_self_modules_embed_parameters_weight_, None, None, 2.0, False, False);  l_self_modules_embed_parameters_weight_ = None
        logits: "bf16[2, 8, 96]cpu" = torch._C._nn.linear(embedding, l_self_modules_head_parameters_weight_, l_self_modules_head_parameters_bias_);  embedding = l_self_modules_head_parameters_weight_ = l_self_modules_head_parameters_bias_ = None
        view: "bf16[16, 96]cpu" = logits.view(-1, 96);  logits = None
        view_1: "i64[16]cpu" = l_ids_.view(-1);  l_ids_ = None
        float_1: "f32[16, 96]cpu" = view.float();  view = None
        cross_entropy: "f32[]cpu" = torch.nn.functional.cross_entropy(float_1, view_1);  float_1 = view_1 = None
        return (cross_entropy,)""")
        assert ("fp32_losses", "cross_entropy", "computed in fp32: view was torch.bfloat16") in graph.decisions


# ============================================================================ 2. each loss against fp64

def _targets(x):
    """Class indices, and in ``x``'s dtype: values, probabilities over the last dim, probabilities of
    each element, and positive class weights."""
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(x.shape, generator=gen)
    others = (values, values.softmax(-1), values.sigmoid(), values[0].abs() + 0.5)
    return torch.randint(0, x.shape[-1], (x.shape[0],), generator=gen), *(t.to(x.dtype) for t in others)


# Each loss as a function of the logits and _targets.
LOSSES = {
    "cross_entropy": lambda x, c, v, p, s, w: F.cross_entropy(x, c),
    "cross_entropy, class weights": lambda x, c, v, p, s, w: F.cross_entropy(x, c, weight=w),
    "cross_entropy, probabilities": lambda x, c, v, p, s, w: F.cross_entropy(x, p),
    "nll_loss of log_softmax": lambda x, c, v, p, s, w: F.nll_loss(F.log_softmax(x, dim=-1), c),
    "torch.log_softmax": lambda x, c, v, p, s, w: -torch.log_softmax(x, -1).mean(),
    "Tensor.log_softmax": lambda x, c, v, p, s, w: -x.log_softmax(-1).mean(),
    "binary_cross_entropy_with_logits": lambda x, c, v, p, s, w: F.binary_cross_entropy_with_logits(x, s),
    "kl_div": lambda x, c, v, p, s, w: F.kl_div(F.log_softmax(x, -1), p, reduction="batchmean"),
    "mse_loss": lambda x, c, v, p, s, w: F.mse_loss(x, v),
    "l1_loss": lambda x, c, v, p, s, w: F.l1_loss(x, v),
    "smooth_l1_loss": lambda x, c, v, p, s, w: F.smooth_l1_loss(x, v),
    "huber_loss": lambda x, c, v, p, s, w: F.huber_loss(x, v, delta=0.5),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_is_computed_in_fp32(loss, dtype):
    """The compiled loss of half-precision logits is the fp64 loss of those same values within fp32's
    rounding; the uncompiled one, computed in half precision, is coarser; the logits' gradient is the
    fp64 gradient rounded once to the logits' dtype."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 200, generator=gen) * 3).to(dtype).requires_grad_()
    classes, *targets = _targets(x.detach())
    fn = LOSSES[loss]
    exact_x = x.detach().double().requires_grad_()
    exact = fn(exact_x, classes, *(t.double() for t in targets))
    (exact_grad,) = torch.autograd.grad(exact, exact_x)

    got = flash_inductor.compile(fn, compiler="eager")(x, classes, *targets)
    (grad,) = torch.autograd.grad(got, x)
    assert got.dtype == torch.float32
    assert abs(got.double() - exact) <= 1e-5 * abs(exact) + 1e-7
    in_half = fn(x.detach(), classes, *targets)
    if loss not in ("l1_loss", "mse_loss", "smooth_l1_loss", "huber_loss"):  # elementwise in half: rounded the same
        assert in_half.dtype == dtype and abs(in_half.double() - exact) > 10 * abs(got.double() - exact)
    # Rounded once to bf16/fp16: within half an ulp of the fp64 gradient (the subnormals' spacing at
    # the least), plus fp32's own error.
    assert grad.dtype == dtype
    info = torch.finfo(dtype)
    ulp = torch.clamp(info.eps * exact_grad.abs(), min=info.smallest_normal * info.eps)
    assert ((grad.double() - exact_grad).abs() <= 0.5 * ulp + 1e-6 * exact_grad.abs().max()).all()


def test_on_inductor_too():
    """Inductor's kernels compute the rewritten loss in fp32 as well."""
    torch.manual_seed(0)
    model = Head().to(torch.bfloat16)
    ids = torch.randint(0, 96, (4, 16))
    exact = F.cross_entropy(model.head(model.embed(ids)).double().view(-1, 96), ids.view(-1))
    got = flash_inductor.compile(model)(ids, ids)
    assert got.dtype == torch.float32 and abs(got.double() - exact) <= 1e-6 * exact


# ============================================================================ 3. left as it is

def test_fp32_losses_and_a_log_softmax_given_its_dtype_are_left_alone():
    x = torch.randn(8, 16)
    classes = torch.randint(0, 16, (8,))
    graph, _ = rewritten(lambda x, c: F.cross_entropy(x, c), x, classes)
    assert not [d for d in graph.decisions if d[0] == "fp32_losses"]

    def asked(x):
        return F.log_softmax(x, dim=-1, dtype=torch.bfloat16).sum() + torch.log_softmax(x, -1, torch.bfloat16).sum()

    graph, _ = rewritten(asked, x.to(torch.bfloat16))
    assert not [d for d in graph.decisions if d[0] == "fp32_losses"]
    assert flash_inductor.compile(asked, compiler="eager")(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_disabled_by_name():
    ids = torch.randint(0, 96, (2, 8))
    model = Head().to(torch.bfloat16)
    assert flash_inductor.compile(model, compiler="eager", disable=["fp32_losses"])(ids, ids).dtype == torch.bfloat16


# ============================================================================ 4. a Hugging Face BERT

def test_bert_trains_with_an_fp32_loss_next_to_the_fp32_model():
    """BERT's masked-LM head takes its cross-entropy on its logits as they are: through ``@train_step``
    (bf16 weights) the loss was bf16 (6.250 and 5.750, bf16's steps of 1/32). Now fp32, and within
    bf16 rounding of the fp32 model's over three steps."""
    transformers = pytest.importorskip("transformers")

    def build():
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(config)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))

    def losses(model, opt, step_fn=None):
        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = step_fn(step) if step_fn else step
        return [step() for _ in range(3)]

    reference = losses(*build())
    model, opt = build()
    got = losses(model, opt, flash_inductor.train_step(model=model, optimizer=opt, compiler="eager"))
    assert all(loss.dtype == torch.float32 for loss in got)
    assert all(abs(g.item() / r.item() - 1) < 5e-3 for g, r in zip(got, reference)), (got, reference)
    assert any(loss.item() != loss.to(torch.bfloat16).item() for loss in got)  # not bf16 values
