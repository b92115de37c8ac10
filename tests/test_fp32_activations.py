"""prepare(..., fp32_activations=True): a prepared bf16 model whose activations are those of fp32
weights under bf16 autocast (the usual baseline): embeddings return fp32, so the residual stream
stays fp32, while matmuls take bf16 under autocast."""

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor import roles
from helpers import EAGER, Net

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

VOCAB, SEQ, DIM = 96, 8, 32


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, dim):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, 2, d // 2).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def bf16_valued(model):
    """``model`` (fp32) with every parameter rounded through bf16: its 24-bit masters are then its bf16
    weights exactly, and a prepared copy holds the reference's values."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms start at ones and zeros: values whose rounding to bf16 would show
                p.add_(torch.randn_like(p), alpha=0.1)
            p.copy_(p.bfloat16().float())
    return model


def lm_loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()), logits


def record_residual_dtypes(model):
    """The dtypes of the blocks' outputs (the residual stream), appended at each forward."""
    dtypes = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    return dtypes


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.fixture
def reference_and_prepared():
    torch.manual_seed(0)
    reference = bf16_valued(TinyLM())
    prepared = copy.deepcopy(reference)
    opt = torch.optim.AdamW(prepared.parameters(), lr=3e-3)
    flash_inductor.prepare(prepared, opt, fp32_activations=True, compile_options=EAGER)
    return reference, prepared, opt


def test_a_prepared_model_runs_as_fp32_weights_under_autocast_bit_for_bit(reference_and_prepared):
    reference, prepared, _ = reference_and_prepared
    default = copy.deepcopy(reference)
    flash_inductor.prepare(default, torch.optim.AdamW(default.parameters(), lr=1e-3), compile_options=EAGER)
    assert prepared.tok.weight.dtype == prepared.blocks[0].qkv.weight.dtype == torch.bfloat16
    x, y = batch(0)
    ref_dtypes, dtypes, default_dtypes = (record_residual_dtypes(m) for m in (reference, prepared, default))
    upstream = {}  # the gradients that reach the reference's embedding outputs

    def keep_upstream(module, args, output):
        output.register_hook(lambda g: upstream.setdefault("tok" if module is reference.tok else "pos", g))

    reference.tok.register_forward_hook(keep_upstream)
    reference.pos.register_forward_hook(keep_upstream)

    ref_loss, ref_logits = lm_loss(reference, x, y)
    loss, logits = lm_loss(prepared, x, y)
    default_loss, default_logits = lm_loss(default, x, y)
    # Bit for bit: the embeddings' bf16 weights hold the reference's fp32 values, so their outputs cast
    # to fp32 are the reference's outputs exactly; from there every op sees the same values in the same
    # dtypes: fp32 + bf16 residual adds give fp32, LayerNorms run fp32 in both (fp32 weights, fp32
    # input, output left fp32), and autocast's bf16 matmuls read the same bf16 values (the reference's
    # weights cast to bf16 are the prepared model's weights).
    assert ref_dtypes == dtypes == [torch.float32] * 2
    assert logits.dtype == ref_logits.dtype == torch.bfloat16
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    # Without the option the residual stream is bf16, each add rounded: the comparison can fail.
    assert default_dtypes == [torch.bfloat16] * 2
    assert not torch.equal(default_logits, ref_logits)

    ref_loss.backward()
    loss.backward()
    indices = {"tok": x.flatten(), "pos": torch.arange(SEQ)}  # pos's output broadcasts over the batch
    ref_grads = dict(reference.named_parameters())
    for name, p in prepared.named_parameters():
        ref = ref_grads[name].grad
        module = name.partition(".")[0]
        if module in indices:
            # The reference adds its embedding gradient up in fp32 from fp32 upstream gradients; here the
            # cast's backward rounds each to bf16 and the bf16 embedding backward rounds each running sum.
            assert p.grad.dtype == torch.bfloat16
            bound = embedding_gradient_bound(indices[module], upstream[module].reshape(-1, DIM), p.shape[0])
            assert ((p.grad.float() - ref).abs() <= bound).all(), name
            assert not torch.equal(p.grad.float(), ref)  # the rounding is real
        elif p.dtype == torch.bfloat16:
            # Matmul weights and biases: autocast's bf16 matmul computes the reference's gradient in bf16
            # (from the same upstream gradients) and casts it to fp32, exactly.
            assert ref.dtype == torch.float32 and torch.equal(p.grad.float(), ref), name
        else:
            assert p.dtype == torch.float32 and torch.equal(p.grad, ref), name  # LayerNorms: fp32 in both


def embedding_gradient_bound(indices, upstream, rows):
    """Per element, how far a bf16 embedding gradient may be from the fp32 one: each of a row's n upstream
    gradients is rounded to bf16 (relative error 2^-8) and so is each of the n running sums, each at most
    the sum of their magnitudes: (n + 1) * 2^-8 * sum |g|."""
    magnitude = torch.zeros(rows, upstream.shape[-1]).index_add_(0, indices, upstream.abs())
    n = torch.zeros(rows).index_add_(0, indices, torch.ones(len(indices)))
    return (n + 1)[:, None] * 2**-8 * magnitude


def test_fp32_activations_train_compiled_through_the_backend(reference_and_prepared):
    """One graph (forward + derived backward) compiled by the flashoptim backend with Inductor; the
    optimizer steps op by op. The residual stream is fp32 in the compiled forward, and its losses
    follow the eager prepared model's while they drop."""
    reference, eager_model, eager_opt = reference_and_prepared
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    flash_inductor.prepare(model, opt, fp32_activations=True, compile_options=EAGER)
    dtypes = record_residual_dtypes(model)
    compiled_loss = torch.compile(lambda x, y: lm_loss(model, x, y)[0], backend="flashoptim")
    x, y = batch(1)  # one batch, seen again: the loss must drop
    losses, eager_losses = [], []
    for _ in range(4):
        for o, loss_fn, out in ((opt, compiled_loss, losses),
                                (eager_opt, lambda x, y: lm_loss(eager_model, x, y)[0], eager_losses)):
            loss = loss_fn(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    assert dtypes and set(dtypes) == {torch.float32}
    assert losses[-1] < losses[0] - 0.1
    # Inductor fuses and reorders fp32 arithmetic: not bit for bit (1e-7 apart here), but far closer than a
    # bf16 residual stream (without fp32_activations the first loss on this batch is 3e-4 off).
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0)


def test_a_forward_without_autocast_is_refused_by_name(reference_and_prepared):
    _, prepared, _ = reference_and_prepared
    x, _ = batch(0)
    expected = r"Embedding 'tok' ran without autocast.*torch\.autocast\('cpu', dtype=torch\.bfloat16\)"
    with pytest.raises(RuntimeError, match=expected):
        prepared(x)
    # The hook is a module-level function: the prepared model pickles, and its copy refuses too.
    buffer = io.BytesIO()
    torch.save(prepared, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with pytest.raises(RuntimeError, match=expected):
        loaded(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(loaded(x), prepared(x))


def test_a_model_without_embeddings_or_a_bad_value_is_refused_before_anything_changes():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="fp32_activations=True found no nn.Embedding or nn.EmbeddingBag"):
        flash_inductor.prepare(model, opt, fp32_activations=True)
    with pytest.raises(ValueError, match="fp32_activations must be True or False, got 'yes'"):
        flash_inductor.prepare(model, opt, fp32_activations="yes")
    with pytest.raises(ValueError, match="fp32_activations=True found no nn.Embedding"):  # train_step passes it on
        flash_inductor.train_step(lambda x: x, model=model, optimizer=opt, fp32_activations=True)
    after = dict(model.named_parameters())
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], v) for n, v in before.items())
    assert opt not in roles.PREPARED and not opt.state and isinstance(opt.param_groups[0]["lr"], float)
    assert not any(m._forward_hooks or "forward" in m.__dict__ for m in model.modules())


def test_embedding_bags_start_fp32_activations_too():
    model = nn.Sequential(nn.EmbeddingBag(16, 8), nn.Linear(8, 4))
    flash_inductor.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), fp32_activations=True)
    x = torch.tensor([[1, 2], [3, 4]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model[0](x).dtype == torch.float32 and model(x).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="EmbeddingBag '0' ran without autocast"):
        model(x)


def test_hugging_face_llama_keeps_fp32_hidden_states_and_the_baselines_loss():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
                                      intermediate_size=176, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    reference = bf16_valued(transformers.LlamaForCausalLM(config))
    models = {}
    for name, options in (("default", {}), ("fp32_activations", {"fp32_activations": True})):
        models[name] = copy.deepcopy(reference)
        flash_inductor.prepare(models[name], torch.optim.AdamW(models[name].parameters(), lr=1e-3), **options,
                               compile_options=EAGER)
    tokens = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))

    def run(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(tokens, labels=tokens, output_hidden_states=True)

    ref, default, fp32act = run(reference), run(models["default"]), run(models["fp32_activations"])
    # hidden_states: the embeddings' output, then each decoder layer's (the last after the final norm)
    assert [h.dtype for h in fp32act.hidden_states] == [torch.float32] * 3
    assert [h.dtype for h in default.hidden_states] == [torch.bfloat16] * 3
    gap, default_gap = (abs(out.loss.item() - ref.loss.item()) for out in (fp32act, default))
    print(f"llama loss: reference {ref.loss.item():.7f}, fp32_activations {fp32act.loss.item():.7f} (gap {gap:.2e}), "
          f"default {default.loss.item():.7f} (gap {default_gap:.2e})")
    # Bit for bit, as for TinyLM: LlamaRMSNorm keeps fp32 weights, the rotary embedding its fp32 inv_freq
    # and returns cos/sin in the hidden states' dtype, fp32 in both; the rest are autocast's bf16 matmuls.
    assert torch.equal(fp32act.logits, ref.logits) and torch.equal(fp32act.loss, ref.loss)
    assert default_gap > 0
