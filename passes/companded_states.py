"""Companded states: the optimizer step works on fp32 states, decoded once and encoded once.

Prepared optimizers keep their moments as ``StateTensor``s that present the parameter's dtype, so
stock optimizer code traces unchanged: ``CompandedState`` (int8/uint8 codes + fp16 group scales),
``TensorScaledState`` (``state_format="fp8lm"``: e4m3/fp16 codes + one scale per parameter) or, for
unquantized states, ``Fp32State``. Operating on them op by op would re-quantize after
every in-place op; this pass makes the step work on an fp32 copy and round exactly once. The
update must run in one dtype, so the gradients of bf16/fp16 parameters are read in fp32 too.

Before (Dynamo graph of ``torch.optim.AdamW.step``, one parameter)::

    grad = placeholder                              # bf16
    exp_avg = self.state_exp_avg                    # CompandedState, presents bf16
    exp_avg.lerp_(grad, 0.1)
    p.addcdiv_(exp_avg, denom)

After::

    grad = placeholder
    grad_fp32 = companded_states.to_fp32(grad)
    exp_avg = self.state_exp_avg
    exp_avg_fp32 = CompandedState.decode(exp_avg)   # fp32 (Fp32State.decode for fp32 states)
    exp_avg_fp32.lerp_(grad_fp32, 0.1)
    p.addcdiv_(exp_avg_fp32, denom)
    CompandedState.store(exp_avg, exp_avg_fp32)     # codes, scales <- encode(exp_avg_fp32)

FP8 gradients (a bucket optimizer with ``fp8_gradients``) are decoded to fp32 by
passes/fp8_gradients.py instead.

Only states the graph writes, and gradients of parameters it updates, are rewritten. With quantized
states every input of a parameter's update is viewed in the states' storage layout, ``(groups,
32)`` (see ``PreparedOptimizer.update_shape``), so Inductor fuses update and encode per group.
"""

import torch
import torch.fx as fx

from flash_inductor import graph_utils, roles
from flash_inductor.formats.state_tensor import StateTensor


def to_fp32(t):
    return t.float()


def companded_states_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    updated = ctx.updated_params()
    rewrites = {}  # node name -> work_on_decoded_copy keyword arguments
    raw_params = {}  # parameter node name -> update shape, for parameters updated in groups
    for name, role in ctx.roles.items():
        if role.param not in updated:
            continue
        if role.kind == roles.GRAD and role.prepared.fp8_gradients is not None:
            continue  # passes/fp8_gradients.py decodes them
        shape = role.prepared.update_shape(role.param)
        regrouped = shape != tuple(role.param.shape)
        if role.kind == roles.GRAD and (regrouped or role.param.grad.dtype in (torch.bfloat16, torch.float16)):
            rewrites[name] = dict(decode=to_fp32, store=None, view=shape if regrouped else None)
        elif role.kind == roles.STATE and name in ctx.written:
            state = role.prepared.optimizer.state[role.param][role.state_key]
            if isinstance(state, StateTensor):
                rewrites[name] = dict(decode=type(state).decode, store=type(state).store, decode_kwargs={"shape": shape})
        elif role.kind == roles.PARAM and regrouped:
            raw_params[name] = shape
    if not rewrites:
        return gm, []
    gm = graph_utils.copy_graph_module(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, kwargs in rewrites.items():
        graph_utils.work_on_decoded_copy(gm.graph, nodes[name], name=ctx.roles[name].node_name("fp32"), **kwargs)
    for name, shape in raw_params.items():
        graph_utils.view_as(gm.graph, nodes[name], shape, name=ctx.roles[name].node_name("groups"))
    gm.graph.lint()
    gm.recompile()
    return gm, list(rewrites)
