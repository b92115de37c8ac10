"""Bound hyperparameters: the NaN that a bucket optimizer's group holds in place of SGD's momentum
becomes a graph input, the fp32 tensor the bucket fills with the momentum before every step.

Schedulers change SGD's momentum every step (``OneCycleLR``, ``cycle_momentum=True`` by default).
As a float it would be a constant of the compiled step (a recompile per value); as a tensor, stock
SGD's ``if momentum != 0`` would break the graph. So the bucket optimizer holds a NaN object of its
own there (``flat.BoundHyperparameter``): the branch is taken, Dynamo guards only on "is NaN", and
this pass puts the bucket's tensor where the NaN was traced. An ``alpha`` cannot be a tensor, so
``x.add(y, alpha=nan)`` becomes ``x.add(y * momentum)``.

Before (Dynamo graph of ``torch.optim.SGD.step`` with ``nesterov=True`` on a bucket optimizer)::

    buf = self.state_momentum_buffer
    buf.mul_(nan).add_(grad, alpha=1)
    grad = grad.add(buf, alpha=nan)

After::

    group0_bfloat16_8bit_momentum = placeholder     # f32[], bound to the bucket's tensor
    buf.mul_(group0_bfloat16_8bit_momentum).add_(grad, alpha=1)
    mul = buf * group0_bfloat16_8bit_momentum
    grad = grad.add(mul)

Any other NaN constant in such a graph (a value the traced code computed from the NaN, such as
``1 - momentum``) stands for nothing this pass can bind: it raises, and the step does not compile.
"""

import math
import operator

import torch
import torch.fx as fx

from flash_inductor import graph_utils

# Ops whose ``alpha`` scales their second operand.
_ALPHA_OPS = {"add", "add_", "sub", "sub_", torch.add, torch.sub}


def bound_hyperparameters_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    bound = {}  # id of the traced NaN -> (BoundHyperparameter, the name of its bucket)
    for role in ctx.roles.values():
        hyper = role.prepared.bound_hyperparameter
        if hyper is not None:
            bound[id(hyper.traced_as)] = (hyper, next(iter(role.prepared.param_names.values())))
    users = [n for n in gm.graph.nodes if any(_is_nan(v) for v in _constants(n))]
    if not bound or not users:
        return gm, []
    gm = graph_utils.copy_graph_module(gm)
    placeholders = {}  # id of the traced NaN -> its placeholder

    def tensor_for(value):
        if not _is_nan(value):
            return value
        if id(value) not in bound:
            raise ValueError(
                "a NaN constant that is no bound hyperparameter (computed from one?): the traced step uses "
                f"{', '.join(sorted({hyper.key for hyper, _ in bound.values()}))} other than as a factor, which "
                "cannot be bound"
            )
        if id(value) not in placeholders:
            hyper, bucket = bound[id(value)]
            name = graph_utils.python_name(f"{bucket}_{hyper.key}")
            placeholders[id(value)] = graph_utils.add_bound_placeholder(gm.graph, name, hyper.tensor)
        return placeholders[id(value)]

    nodes = {n.name: n for n in gm.graph.nodes}
    for node in (nodes[n.name] for n in users):
        args, kwargs = node.args, dict(node.kwargs)
        if node.target in _ALPHA_OPS and _is_nan(kwargs.get("alpha")):
            with gm.graph.inserting_before(node):
                scaled = gm.graph.call_function(operator.mul, (args[1], tensor_for(kwargs.pop("alpha"))))
            args = (args[0], scaled, *args[2:])
        node.args = fx.node.map_aggregate(args, tensor_for)
        node.kwargs = fx.node.map_aggregate(kwargs, tensor_for)
    gm.graph.lint()
    gm.recompile()
    return gm, [n.name for n in users]


def _constants(node):
    """The non-node values among ``node``'s arguments, nested ones included."""
    found = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda v: found.append(v) if not isinstance(v, fx.Node) else None)
    return found


def _is_nan(value):
    return isinstance(value, float) and math.isnan(value)
