"""``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention`` and torch's ``nn.Transformer``
layers call) with its projections through a linear function the caller gives: the FP8 pass
(``passes/fp8_linear.py``) gives ``fp8_linear``.

Dynamo keeps torch's function as one node of its graph, with the layer's weights as operands, so
its four projections are no linears a graph pass could rewrite. Written here with the same
arguments and results, for the layers ``unsupported_reason`` accepts (``bias_k``/``bias_v``,
``add_zero_attn`` and ``static_k``/``static_v`` are left to torch's); with ``F.linear`` for every projection it
gives torch's values, bit for bit (``tests/test_multi_head_attention.py`` compares the two).
"""

import functools
import inspect
import math

import torch
import torch.nn.functional as F

from flash_inductor.fp8_linear import fp8_linear

SIGNATURE = inspect.signature(F.multi_head_attention_forward)
# The arguments naming a weight a projection multiplies by (in_proj_weight: q, k and v stacked).
WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj_weight")


def unused_weights(arguments):
    """The ``WEIGHTS`` a call with these ``arguments`` (by name) never multiplies by: the separate q, k, v
    weights, or with ``use_separate_proj_weight`` the stacked one (``_in_projections``)."""
    if arguments.get("use_separate_proj_weight", False):
        return ("in_proj_weight",)
    return ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def unsupported_reason(arguments):
    """Why a call with these ``arguments`` (by name, as ``SIGNATURE.bind`` gives them; values or graph
    nodes) is left to torch's function, or None."""
    if arguments.get("bias_k") is not None or arguments.get("bias_v") is not None or arguments.get("add_zero_attn"):
        return "nn.MultiheadAttention with add_bias_kv or add_zero_attn"
    if arguments.get("static_k") is not None or arguments.get("static_v") is not None:
        return "F.multi_head_attention_forward with static_k/static_v"
    return None


def _in_projections(query, key, value, arguments, linears):
    """q, k, v: each input through its projection. As torch's: one GEMM for self-attention's stacked
    weight, two for a query and a shared key-value input, else three (the same split gives the same bits)."""
    bias = arguments["in_proj_bias"]
    b_q, b_k, b_v = (None, None, None) if bias is None else bias.chunk(3)
    if arguments["use_separate_proj_weight"]:
        names = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        return tuple(linears.get(name, F.linear)(x, arguments[name], b)
                     for x, name, b in zip((query, key, value), names, (b_q, b_k, b_v)))
    weight = arguments["in_proj_weight"]
    linear = linears.get("in_proj_weight", F.linear)
    if query is key and key is value:
        return linear(query, weight, bias).chunk(3, dim=-1)
    embed_dim = query.shape[-1]
    if key is value:
        b_kv = None if bias is None else bias[embed_dim:]
        return linear(query, weight[:embed_dim], b_q), *linear(key, weight[embed_dim:], b_kv).chunk(2, dim=-1)
    return tuple(linear(x, w, b) for x, w, b in zip((query, key, value), weight.chunk(3), (b_q, b_k, b_v)))


def _attention_mask(a, query_dtype):
    """(key_padding_mask, attn_mask, is_causal) as torch's function takes them: float masks, or no
    mask where scaled_dot_product_attention's causal kernel can serve."""
    key_padding_mask, attn_mask, is_causal = a["key_padding_mask"], a["attn_mask"], a["is_causal"]
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask", target_type=query_dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("multi_head_attention_forward: is_causal needs attn_mask (the causal mask) too")
    if is_causal and key_padding_mask is None and not a["need_weights"]:
        return None, None, True
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                  target_type=query_dtype, check_other=False)
    return key_padding_mask, attn_mask, is_causal and key_padding_mask is None


def multi_head_attention_forward(*args, linears=None, **kwargs):
    """``F.multi_head_attention_forward(*args, **kwargs)`` with the projection by each weight named in
    ``linears`` (``WEIGHTS``) computed as ``linears[name](x, w, b)``, the others by ``F.linear``."""
    linears = linears or {}
    bound = SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    reason = unsupported_reason(a)
    if reason is not None:
        raise NotImplementedError(f"multi_head_attention_forward: {reason}")
    query, key, value, num_heads = a["query"], a["key"], a["value"], a["num_heads"]
    batched = query.dim() == 3
    if not batched:  # (L, E) as a batch of one, (L, 1, E); as in torch's, three new tensors
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if a["key_padding_mask"] is not None:
            a["key_padding_mask"] = a["key_padding_mask"].unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len, head_dim = key.shape[0], embed_dim // num_heads
    key_padding_mask, attn_mask, is_causal = _attention_mask(a, query.dtype)

    q, k, v = _in_projections(query, key, value, a, linears)
    # (L, N, E) -> (N * heads, L, head_dim)
    q, k, v = (t.reshape(t.shape[0], bsz * num_heads, head_dim).transpose(0, 1) for t in (q, k, v))
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1)
        padding = padding.reshape(bsz * num_heads, 1, src_len)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    dropout_p = a["dropout_p"] if a["training"] else 0.0

    if a["need_weights"]:
        q = q * math.sqrt(1.0 / head_dim)
        kt = k.transpose(-2, -1)
        scores = torch.bmm(q, kt) if attn_mask is None else torch.baddbmm(attn_mask, q, kt)
        weights = F.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        heads = torch.bmm(weights, v).transpose(0, 1)  # (L, N * heads, head_dim)
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if a["average_attn_weights"]:
            weights = weights.mean(dim=1)
    else:
        if attn_mask is not None:
            attn_mask = (attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 and attn_mask.dim() == 3
                         else attn_mask.view(bsz, num_heads, -1, src_len))
        q, k, v = (t.view(bsz, num_heads, t.shape[1], head_dim) for t in (q, k, v))
        heads = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        heads = heads.permute(2, 0, 1, 3)  # (L, N, heads, head_dim)
        weights = None
    out_proj = linears.get("out_proj_weight", F.linear)
    out = out_proj(heads.contiguous().view(tgt_len * bsz, embed_dim), a["out_proj_weight"], a["out_proj_bias"])
    out = out.view(tgt_len, bsz, out.shape[-1])
    if not batched:
        out = out.squeeze(1)
        weights = None if weights is None else weights.squeeze(0)
    return out, weights


def fp8_multi_head_attention_forward(*args, fp8_weights, fp8_options, **kwargs):
    """``multi_head_attention_forward`` with the projections by the weights named in ``fp8_weights``
    through ``fp8_linear(..., **fp8_options)``."""
    fp8 = functools.partial(fp8_linear, **fp8_options)
    return multi_head_attention_forward(*args, linears=dict.fromkeys(fp8_weights, fp8), **kwargs)
