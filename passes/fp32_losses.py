"""fp32 losses: a loss taken on bf16 or fp16 values is computed in fp32, as autocast computes it.

Prepared weights are bf16, so a model's head gives bf16 logits. Hugging Face's causal LMs upcast
them before their loss; BERT and T5 call ``CrossEntropyLoss`` on them as they are, and the loss
then comes out in bf16: log-probabilities rounded to 8 bits, a loss that moves in steps of 1/32
near 6, gradients from those rounded values. The step the user had, fp32 weights under
``torch.autocast``, computed these ops in fp32 (autocast's fp32 list); the rewritten step does too.
Only losses: autocast's other fp32 ops (softmax, norms) are left as the model wrote them (an
attention's softmax in fp32 would double its memory; norms keep fp32 weights already).

Before (Dynamo graph of a ``BertForMaskedLM``'s loss)::

    prediction_scores: "bf16[64, 512]" = torch._C._nn.linear(hidden, decoder_weight, decoder_bias)
    view: "bf16[64, 512]" = prediction_scores.view(-1, 512)
    loss: "bf16[]" = torch.nn.functional.cross_entropy(view, labels, None, None, -100, None, 'mean', 0.0)

After::

    view: "bf16[64, 512]" = prediction_scores.view(-1, 512)
    float_1: "f32[64, 512]" = view.float()
    loss: "f32[]" = torch.nn.functional.cross_entropy(float_1, labels, None, None, -100, None, 'mean', 0.0)

The pattern: a call of a loss of ``FP32_LOSSES`` (or ``x.log_softmax(dim)``; a ``log_softmax``
given its own ``dtype`` is left as asked) with a bf16 or fp16 tensor argument; each such argument
(the input, a target of probabilities or values, class weights) is cast with ``.float()``. The
backward casts the gradient back to the argument's dtype, as autocast's does.
"""

import torch
import torch.fx as fx
import torch.nn.functional as F

from flash_inductor import graph_utils

# Losses over classes: their input is a model's logits (passes/fp8_linear.py keeps the layer that
# computes them, the output layer, in bf16).
CLASSIFICATION_LOSSES = {F.cross_entropy, torch._C._nn.cross_entropy_loss, F.nll_loss, F.log_softmax, torch.log_softmax}
FP32_LOSSES = CLASSIFICATION_LOSSES | {F.binary_cross_entropy_with_logits, F.kl_div, F.mse_loss, F.l1_loss,
                                       F.smooth_l1_loss, F.huber_loss}
_HALF = (torch.bfloat16, torch.float16)


def is_classification_loss(node):
    """A call of a loss of ``CLASSIFICATION_LOSSES``, or ``x.log_softmax(...)``."""
    return (node.op == "call_function" and node.target in CLASSIFICATION_LOSSES
            or node.op == "call_method" and node.target == "log_softmax")


def is_loss(node):
    """A call of a loss of ``FP32_LOSSES``, or ``x.log_softmax(...)``."""
    return is_classification_loss(node) or node.op == "call_function" and node.target in FP32_LOSSES


def _half_arguments(node):
    """The bf16 or fp16 tensor arguments of loss ``node`` (none when a ``log_softmax`` names its dtype)."""
    if _asked_dtype(node) is not None:
        return []
    values = [a.meta.get("example_value") for a in node.all_input_nodes]
    return [a for a, v in zip(node.all_input_nodes, values) if isinstance(v, torch.Tensor) and v.dtype in _HALF]


def _asked_dtype(node):
    """A ``log_softmax``'s ``dtype`` argument: ``F.log_softmax(x, dim, _stacklevel, dtype)``,
    ``torch.log_softmax(x, dim, dtype)``, ``x.log_softmax(dim, dtype)``."""
    if node.target not in (F.log_softmax, torch.log_softmax, "log_softmax"):
        return None
    position = 3 if node.target is F.log_softmax else 2
    return node.kwargs.get("dtype", node.args[position] if len(node.args) > position else None)


def fp32_losses_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    found = [n.name for n in gm.graph.nodes if is_loss(n) and _half_arguments(n)]
    if not found:
        return gm, []

    def widen(graph, node):
        for argument in _half_arguments(node):
            with graph.inserting_before(node):
                node.replace_input_with(argument, graph.call_method("float", (argument,)))
            if ctx.recorder:
                ctx.recorder.decision("fp32_losses", node.name, f"computed in fp32: {argument.name} was "
                                      f"{argument.meta['example_value'].dtype}")

    return graph_utils.rewrite_copy(gm, found, widen), found
