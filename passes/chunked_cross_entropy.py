"""Chunked cross-entropy: the last linear and its cross-entropy computed some rows at a time
(option ``loss_chunk_rows``), so the whole fp32 logits never exist.

Before (Dynamo graph of a Hugging Face ``LlamaForCausalLM``'s loss, ``loss_function`` inlined)::

    logits = torch._C._nn.linear(hidden_states, lm_head_weight, None)
    logits_1 = logits.float()
    logits_2 = logits_1.view(-1, 32000)
    loss = torch.nn.functional.cross_entropy(logits_2, shift_labels, ignore_index=-100, reduction='mean')

After::

    reshape = hidden_states.reshape(-1, 2048)
    loss = flash_inductor.linear_cross_entropy.linear_cross_entropy(reshape, lm_head_weight, None,
        shift_labels, ignore_index=-100, reduction='mean', chunk_rows=1024)

The pattern: ``F.cross_entropy`` (mean or sum, no class weights, no label smoothing) of a 2-D input
that is a linear's output (``F.linear``, ``x @ w.T``, ``x @ w`` with ``w`` a 2-D graph input: the
forms of ``passes/fp8_linear.py``) through any of ``.float()``, ``.to(torch.float32)``, ``.view``,
``.reshape`` and ``flatten`` that keep the linear's outputs as the classes, each used only there
(logits the step also returns are needed whole). The linear must
compute in its operands' dtype: under autocast, where it casts fp32 operands to bf16, it is left as
it is. ``flash_inductor/linear_cross_entropy.py`` computes the same logits and the same per-row
terms; runs before ``fp8_linear``, so a chunked lm_head stays in its dtype. Every cross-entropy's
decision is recorded for inspection.
"""

import torch
import torch.fx as fx
import torch.nn.functional as F

from flash_inductor import graph_utils
from flash_inductor.linear_cross_entropy import REDUCTIONS, linear_cross_entropy

from .fp8_linear import as_linear, is_transpose, out_in_weight

_DEFAULTS = {"weight": None, "size_average": None, "reduce": None, "label_smoothing": 0.0}


def _is_widening_or_view(node):
    """``.float()``, ``.to(torch.float32)``, or a view that keeps the order of the elements (``view``,
    ``reshape``, ``flatten``): the cross-entropy's rows are then the linear's rows where the classes
    stay the last dim, which ``_match`` checks."""
    if node.op == "call_function":
        return node.target is torch.flatten
    if node.op != "call_method":
        return False
    if node.target in ("float", "view", "reshape", "flatten"):
        return node.target != "float" or len(node.args) == 1
    return node.target == "to" and node.args[1:] == (torch.float32,) and not node.kwargs


def _match(node):
    """``(the linear's node, (x, weight, bias, layout), target, ignore_index, reduction)`` for a
    cross-entropy of the pattern, else why not (a string)."""
    input_, target, *rest = list(node.args) + [None] * (2 - len(node.args))
    kwargs = dict(zip(("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"), rest))
    kwargs.update(node.kwargs)
    if any(kwargs.get(k, v) != v for k, v in _DEFAULTS.items()):
        return "class weights or label smoothing"
    reduction, ignore_index = kwargs.get("reduction", "mean"), kwargs.get("ignore_index", -100)
    if reduction not in REDUCTIONS or not isinstance(ignore_index, int):
        return f"reduction {reduction!r}, ignore_index {ignore_index!r}"
    logits = input_.meta.get("example_value") if isinstance(input_, fx.Node) else None
    labels = target.meta.get("example_value") if isinstance(target, fx.Node) else None
    if logits is None or logits.dim() != 2 or labels is None or labels.dim() != 1 or labels.is_floating_point():
        return "not 2-D logits with 1-D class indices"
    chain = [input_]
    while isinstance(chain[-1], fx.Node) and _is_widening_or_view(chain[-1]):
        chain.append(chain[-1].args[0])
    input_ = chain[-1]
    linear = as_linear(input_) if isinstance(input_, fx.Node) else None
    if linear is None:
        return "its input is not a linear's output (widened or viewed only)"
    if any(len(n.users) != 1 for n in chain):
        return "the logits are used elsewhere too"
    if logits.shape[-1] != input_.meta["example_value"].shape[-1]:
        return "its views move the linear's outputs out of the classes' dim"
    x, weight = linear[0], linear[1]
    dtypes = {t.meta["example_value"].dtype for t in (input_, x, weight) if "example_value" in getattr(t, "meta", {})}
    if len(dtypes) != 1:
        return "the linear casts its operands (autocast)"
    return input_, linear, target, ignore_index, reduction


def chunked_cross_entropy_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    chunk_rows = ctx.options.loss_chunk_rows
    if not chunk_rows:
        return gm, []
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not F.cross_entropy:
            continue
        match = _match(node)
        weight = match[1][1] if isinstance(match, tuple) else None
        name = graph_utils.input_name(weight) if isinstance(weight, fx.Node) else node.name
        if ctx.recorder:
            ctx.recorder.decision("chunked_cross_entropy", name, f"chunked, {chunk_rows} rows at a time"
                                  if isinstance(match, tuple) else f"whole: {match}")
        if isinstance(match, tuple):
            found.append(node.name)
    if not found:
        return gm, []

    def chunk(graph, node):
        linear_node, (x, weight, bias, layout), target, ignore_index, reduction = _match(node)
        features = x.meta["example_value"].shape[-1]
        with graph.inserting_before(node):
            rows = graph.call_method("reshape", (x, -1, features))
            loss = graph.call_function(linear_cross_entropy, (rows, out_in_weight(graph, weight, layout), bias, target), {
                "ignore_index": ignore_index, "reduction": reduction, "chunk_rows": chunk_rows})
        node.replace_all_uses_with(loss)
        chain, current = [], node.args[0]
        while current is not linear_node:  # its widening and views, then the linear and a transposed weight
            chain.append(current)
            current = current.args[0]
        chain += [linear_node] + [a for a in linear_node.args if is_transpose(a)]
        graph.erase_node(node)
        for dead in chain:
            if not dead.users:
                graph.erase_node(dead)

    return graph_utils.rewrite_copy(gm, found, chunk), found
