"""``flash_inductor.multi_head_attention``: torch's ``F.multi_head_attention_forward`` written with
its projections through a given linear function. With ``F.linear`` it must give torch's values bit
for bit (the reference is torch's own function, called by ``nn.MultiheadAttention``), over the
layouts, attention kinds, masks and results a layer can ask for."""

import itertools
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flash_inductor import multi_head_attention

E, HEADS, L, S, N = 32, 4, 6, 7, 3
MASKS = ("none", "float", "bool", "key_padding", "float+key_padding", "causal")


def _inputs(kind, batch_first, kdim, masks, batched=True):
    def shape(length, dim):
        return ((N, length, dim) if batch_first else (length, N, dim)) if batched else (length, dim)

    q = torch.randn(shape(L, E), requires_grad=True)
    k = q if kind == "self" else torch.randn(shape(S, kdim or E), requires_grad=True)
    v = k if kind in ("self", "shared key-value") else torch.randn(shape(S, kdim or E), requires_grad=True)
    src = L if kind == "self" else S
    kwargs = {}
    if masks in ("float", "float+key_padding"):
        kwargs["attn_mask"] = torch.randn(L, src)
    if masks == "bool":
        kwargs["attn_mask"] = torch.rand(L, src) > 0.8
    if masks in ("key_padding", "float+key_padding"):
        kwargs["key_padding_mask"] = torch.rand((N, src) if batched else (src,)) > 0.7
    if masks == "causal":
        kwargs.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(L), is_causal=True)
    return (q, k, v), kwargs


def _both(layer, inputs, kwargs):
    """The layer's outputs and its inputs' and weights' gradients: torch's function, then ours."""
    results = []
    for forward in (F.multi_head_attention_forward, multi_head_attention.multi_head_attention_forward):
        layer.zero_grad()
        leaves = {id(t): t for t in inputs}.values()
        for t in leaves:
            t.grad = None
        with mock.patch.object(F, "multi_head_attention_forward", forward):
            out, weights = layer(*inputs, **kwargs)
        out.square().sum().backward()
        results.append([out, weights, *(t.grad for t in leaves), *(p.grad for p in layer.parameters())])
    return results


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask is deprecated")
@pytest.mark.parametrize("kind", ["self", "shared key-value", "cross", "cross, other dims"])
def test_equals_torchs_function_bit_for_bit(kind):
    """Every combination of layout, results asked for (weights averaged or per head, or none: SDPA),
    masks and train/eval mode gives torch's outputs, attention weights and gradients bit for bit."""
    torch.manual_seed(0)
    kdim = 24 if kind == "cross, other dims" else None
    compared = 0
    for batch_first, need_weights, average, masks, training, bias in itertools.product(
            (True, False), (True, False), (True, False), MASKS, (True, False), (True, False)):
        if masks == "causal" and kind != "self":
            continue
        layer = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=kdim, vdim=kdim, bias=bias).train(training)
        inputs, kwargs = _inputs(kind.split(",")[0], batch_first, kdim, masks)
        theirs, ours = _both(layer, inputs, dict(kwargs, need_weights=need_weights, average_attn_weights=average))
        for a, b in zip(theirs, ours):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (
                batch_first, need_weights, average, masks, training, bias)
        compared += 1
    assert compared == (192 if kind == "self" else 160)  # causal masks are for self-attention


@pytest.mark.parametrize("need_weights", [True, False])
def test_unbatched_inputs_equal_torchs(need_weights):
    torch.manual_seed(0)
    layer = nn.MultiheadAttention(E, HEADS)
    inputs, kwargs = _inputs("self", False, None, "key_padding", batched=False)
    theirs, ours = _both(layer, inputs, dict(kwargs, need_weights=need_weights))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(theirs, ours))


@pytest.mark.parametrize("option", [dict(add_bias_kv=True), dict(add_zero_attn=True)])
def test_what_it_does_not_write_is_refused(option):
    layer = nn.MultiheadAttention(E, HEADS, **option)
    x = torch.randn(L, N, E)
    with mock.patch.object(F, "multi_head_attention_forward", multi_head_attention.multi_head_attention_forward):
        with pytest.raises(NotImplementedError, match="add_bias_kv or add_zero_attn"):
            layer(x, x, x)
