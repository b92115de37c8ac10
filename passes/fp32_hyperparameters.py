"""fp32 hyperparameters: tensor hyperparameters are not rounded to the parameters' bf16.

torch's Adam casts tensor betas to the parameter's dtype before using them (``beta1.to(param.
dtype)``, a workaround for lerp's dtype rules). The storage passes make the update run on fp32
masters and states, so with bf16 parameters that cast only rounds ``beta1 = 0.9`` to 0.8984 (and
``1 - beta2`` with it): ``exp_avg`` was 6.5e-3 off fp32 after one step.

Before (Dynamo graph of ``torch.optim.AdamW.step`` with ``betas=(torch.tensor(0.9), ...)``)::

    beta1 = placeholder                                     # f32[], a param group's betas[0]
    device_beta1 = beta1.to(device=cpu, dtype=torch.bfloat16, non_blocking=True)
    exp_avg.lerp_(grad, 1 - device_beta1)

After::

    beta1 = placeholder
    exp_avg.lerp_(grad, 1 - beta1)                          # fp32
"""

import torch
import torch.fx as fx

from flash_inductor import graph_utils, roles

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _lowers_precision(node):
    """``x.to(...)`` whose target dtype is bf16 or fp16."""
    if node.op != "call_method" or node.target != "to":
        return False
    dtype = node.kwargs.get("dtype", next((a for a in node.args[1:] if isinstance(a, torch.dtype)), None))
    return dtype in _LOW_PRECISION


def fp32_hyperparameters_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    hyper = {name for name, role in ctx.roles.items() if role.kind == roles.HYPER}
    casts = [n.name for n in gm.graph.nodes if _lowers_precision(n) and getattr(n.args[0], "name", None) in hyper]
    if not casts:
        return gm, []
    gm = graph_utils.copy_graph_module(gm)
    for node in [n for n in gm.graph.nodes if n.name in casts]:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm, casts
