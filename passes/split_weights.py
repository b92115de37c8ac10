"""Split weights: the optimizer step updates 24-bit (or 32-bit) master weights.

A prepared bf16/fp16 parameter has an integer error term (``flash_inductor.formats.
split_weights``). In an optimizer-step graph, where the parameter is written in place, the
update must read and write the master value ``hi + error``, not ``hi`` alone.

Before (Dynamo graph of ``torch.optim.AdamW.step``, one parameter)::

    p = self.param                                  # bf16
    p.mul_(0.99)
    p.addcdiv_(exp_avg, denom)

After::

    p = self.param                                  # bf16
    p_error = placeholder                           # int8, bound to the parameter's error term
    p_master = split_weights.decode_for_step(p, p_error)  # fp32 (of p.view(groups, 32), p_error.view(...)
                                                    # when its states are 8-bit: see update_shape)
    p_master.mul_(0.99)
    p_master.addcdiv_(exp_avg, denom)
    split_weights.store_from_step(p, p_error, p_master)  # p, p_error <- encode(p_master)

Inductor fuses decode, the update and encode into one kernel per parameter (or per group with
``foreach``); the bf16 rounding inside ``encode`` needs ``emulate_precision_casts``, which the
backend turns on for every graph a pass rewrote.
"""

import torch.fx as fx

from flash_inductor import graph_utils, roles
from flash_inductor.formats import split_weights


def split_weights_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    targets = [
        name for name, role in ctx.roles.items()
        if role.kind == roles.PARAM and name in ctx.written and role.prepared.error_term(role.param) is not None
    ]
    if not targets:
        return gm, []

    def split(graph, node):
        role = ctx.roles[node.name]
        error = role.prepared.error_term(role.param)
        error_node = graph_utils.add_bound_placeholder(graph, role.node_name("error"), error)
        shape = role.prepared.update_shape(role.param)
        graph_utils.work_on_decoded_copy(
            graph, node, split_weights.decode_for_step, split_weights.store_from_step, extra=(error_node,),
            name=role.node_name("master"), view=shape if shape != tuple(role.param.shape) else None,
        )

    return graph_utils.rewrite_copy(gm, targets, split), targets
