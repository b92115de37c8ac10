"""Untouched parameters: a bucket step leaves the groups of parameters without a gradient as they were,
and the weights as they were at ``lr == 0``.

A flat bucket (``flash_inductor/flat.py``) steps all its parameters in one update; torch skips a
parameter whose ``.grad`` is None. Each value the step writes is restored, where the bucket's
``active`` mask (one flag per group of 32, False for the groups of such parameters) says so, to
what it was before the step: weights, error terms, states and step counts stay bit-identical.

The weights are also restored where the group's ``lr`` is 0 (a warmup's first step), as torch's
updates leave them then. Bucket optimizers run Adam's capturable form, which folds the step size
into the denominator: at ``lr == 0`` an element whose second moment is 0 (an embedding row not in
the batch) divides 0 by -0 and writes nan (pytorch #126514); states still advance, as in torch.

Before (Dynamo graph of ``torch.optim.AdamW.step`` on a bucket optimizer)::

    flat = self.param                             # bf16 (G, 32)
    step = self.state_step                        # f32 (G, 1)
    step.add_(1)
    flat.mul_(1 - lr * wd)
    flat.addcdiv_(exp_avg, denom)

After::

    active = placeholder                          # bool (G, 1), bound to the bucket's mask
    step_before = step.clone()
    step.add_(1)
    step.copy_(torch.where(active, step, step_before))
    flat_before = flat.clone()
    flat.mul_(1 - lr * wd)
    flat.addcdiv_(exp_avg, denom)
    flat_moves = torch.logical_and(active, torch.ne(lr, 0))
    flat.copy_(torch.where(flat_moves, flat, flat_before))

It runs before the storage passes, which then make ``clone`` and ``copy_`` act on the decoded
fp32 values; after functionalization ``*_before`` is the input itself, read once by the fused kernel.
"""

import torch
import torch.fx as fx

from flash_inductor import graph_utils, roles


def untouched_parameters_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    targets = [
        name for name, role in ctx.roles.items()
        if role.kind in (roles.PARAM, roles.STATE) and name in ctx.written and role.prepared.active_groups is not None
    ]
    if not targets:
        return gm, []
    gm = graph_utils.copy_graph_module(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    masks = {}  # record -> its mask's placeholder
    for name in targets:
        role = ctx.roles[name]
        record = role.prepared
        if record not in masks:
            masks[record] = graph_utils.add_bound_placeholder(gm.graph, f"active_groups_{len(masks)}", record.active_groups)
        keep = masks[record]
        if role.kind == roles.PARAM:
            keep = _weights_move(gm.graph, nodes[name], keep, _lr_node(ctx, nodes, record), role.node_name("moves"))
        graph_utils.restore_where(gm.graph, nodes[name], keep, name=role.node_name("before"))
    gm.graph.lint()
    gm.recompile()
    return gm, targets


def _lr_node(ctx, nodes, record):
    """The graph input holding the bucket optimizer's lr tensor (None for a float lr)."""
    lr = record.optimizer.param_groups[0]["lr"]
    return next((nodes[name] for name, tensor in ctx.inputs.items() if tensor is lr), None)


def _weights_move(graph, weights, active, lr, name):
    """``active & (lr != 0)``, before the first use of ``weights``."""
    if lr is None:
        return active
    position = {node: i for i, node in enumerate(graph.nodes)}
    with graph.inserting_before(min(weights.users, key=position.__getitem__)):
        moves = graph.call_function(torch.ne, (lr, 0))
        return graph.create_node("call_function", torch.logical_and, (active, moves), name=name)
