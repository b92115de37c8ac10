"""FP8 linear: eligible linear layers of the forward graph run as FP8 GEMMs (option ``fp8``).

Before (Dynamo graph of a model with an ``nn.Linear(4096, 4096)`` named ``fc1``)::

    linear = torch._C._nn.linear(x, fc1_weight, fc1_bias)
    matmul = x @ head_weight.T                      # also: F.linear, x @ w.t()

After::

    linear = flash_inductor.fp8_linear.fp8_linear(x, fc1_weight, fc1_bias)
    matmul = flash_inductor.fp8_linear.fp8_linear(x, head_weight, None)

``fp8_linear`` is an autograd function of plain ops (e4m3 forward, e5m2 gradients, per-tensor
current scaling: ``flash_inductor/fp8_linear.py``); AOTAutograd traces its backward and Inductor
fuses the amax and cast ops into their neighbours.

A linear is eligible when its weight is a graph input (a parameter), both weight dims are
multiples of 16 (``_scaled_mm``'s requirement), the weight has at least ``fp8_min_weight_numel``
elements (smaller GEMMs do not pay for the casts), and its module name passes ``fp8_exclude``
(fnmatch patterns, e.g. the first and last layers) and ``fp8_filter`` (a callable on the module
name, like torchao's ``module_filter_fn``). Every linear's decision is recorded for inspection.
"""

import fnmatch
import operator

import torch
import torch.fx as fx

from flash_inductor import graph_utils
from flash_inductor.fp8_linear import fp8_linear

_FP8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _as_linear(node):
    """``(x, weight, bias)`` if ``node`` computes a linear layer, else None."""
    if node.op != "call_function":
        return None
    if node.target in (torch._C._nn.linear, torch.nn.functional.linear):
        args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
        return args[0], args[1], args[2]
    if node.target in (operator.matmul, torch.matmul) and len(node.args) == 2:
        x, rhs = node.args
        transposed = isinstance(rhs, fx.Node) and (
            (rhs.op == "call_function" and rhs.target is getattr and rhs.args[1] in ("T", "mT"))
            or (rhs.op == "call_method" and rhs.target == "t")
            or (rhs.op == "call_function" and rhs.target is torch.t)
        )
        if transposed:
            return x, rhs.args[0], None
    return None


def _decide(weight, name, options):
    """``None`` when eligible, else why not."""
    if weight.op not in ("placeholder", "get_attr"):
        return "weight is computed in the graph, not a parameter"
    value = weight.meta.get("example_value")
    if value is None or value.dim() != 2:
        return "weight is not a 2-D tensor"
    if value.dtype not in _FP8_DTYPES:
        return f"weight dtype {value.dtype}"
    n, k = value.shape
    if n % 16 or k % 16:
        return f"weight {n}x{k}: FP8 GEMMs need both dims to be multiples of 16"
    if n * k < options.fp8_min_weight_numel:
        return f"weight {n}x{k} is under fp8_min_weight_numel={options.fp8_min_weight_numel}"
    module = name.rpartition(".")[0]
    if any(fnmatch.fnmatchcase(module, pattern) for pattern in options.fp8_exclude):
        return f"excluded by fp8_exclude {list(options.fp8_exclude)}"
    if options.fp8_filter is not None and not options.fp8_filter(module):
        return "rejected by fp8_filter"
    return None


def fp8_linear_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    if ctx.options.fp8 is None:
        return gm, []
    eligible = []
    for node in gm.graph.nodes:
        linear = _as_linear(node)
        if linear is None:
            continue
        weight = linear[1]
        name = graph_utils.input_name(weight) if isinstance(weight, fx.Node) else "?"
        reason = _decide(weight, name, ctx.options) if isinstance(weight, fx.Node) else "weight is not a tensor"
        if ctx.recorder:
            ctx.recorder.decision("fp8_linear", name, "fp8 e4m3/e5m2" if reason is None else f"bf16: {reason}")
        if reason is None:
            eligible.append((node.name, linear))
    if not eligible:
        return gm, []
    gm = graph_utils.copy_graph_module(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, _ in eligible:
        node = nodes[name]
        x, weight, bias = _as_linear(node)
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(fp8_linear, (x, weight, bias))
        node.replace_all_uses_with(replacement)
        transposed = node.args[1] if node.args[1] is not weight else None
        gm.graph.erase_node(node)
        if transposed is not None and not transposed.users:
            gm.graph.erase_node(transposed)
    gm.graph.lint()
    gm.recompile()
    return gm, [name for name, _ in eligible]
