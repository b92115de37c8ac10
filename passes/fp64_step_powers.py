"""fp64 step powers: ``beta ** step`` of Adam's bias corrections is computed in float64 and rounded
to fp32 once.

torch's compiled (capturable) Adam computes its bias corrections ``1 - beta1 ** step`` and
``1 - beta2 ** step`` from the fp32 ``step`` tensor, in fp32. Inductor lowers that ``pow`` to an
fp32 ``pow`` that is not correctly rounded: libdevice's on CUDA was one ulp off for ``0.999 ** 1``
on the H200 (after the cancellation in ``1 - beta2 ** step``, 6e-5 of the bias correction; the first
updates were 3.6e-5 off), and the vectorized C++ one on the CPU rounds ``0.9 ** 31`` the other way.
In float64 the power is within a few fp64 ulps of the exact one, so rounded to fp32 it is the
correctly rounded fp32 power on every device (unless the exact one lies within those few fp64 ulps
of an fp32 rounding tie). A float ``beta`` is first rounded to fp32, as torch does against the fp32 ``step``: the value
is the power of torch's fp32 beta, and does not change when a scheduler turns the betas into fp32
tensors (``flat.py``, ``_betas_as_tensors_once_changed``). It costs nothing: ``step`` is a scalar,
or one count per group of 32 in a flat bucket.

A ``pow`` is rewritten where its base is a hyperparameter (a float constant, or a tensor of a
param group: role HYPER), its exponent the step count (the input of role ``step``, or an in-place
op's result on it: ``step_t += 1``) and its result fp32.

Before (Dynamo graph of ``torch.optim.AdamW.step``, single-tensor and capturable)::

    step_t = self.state_step                                # f32[], or f32[groups, 1] in a bucket
    step_t += 1;  step_t_1 = step_t
    pow_1 = 0.9 ** step_t_1                                 # with tensor betas: beta1 ** step_t_1
    bias_correction1 = 1 - pow_1

After::

    pow_1 = pow_in_fp64(0.8999999761581421, step_t_1)       # 0.9 in fp32; pow_in_fp64(beta1, step_t_1)
    bias_correction1 = 1 - pow_1

where ``pow_in_fp64(beta, step) = torch.pow(beta.double(), step.double()).float()``. The
multi-tensor form ``torch._foreach_pow(0.9, [step_t, ...])`` becomes ``foreach_pow_in_fp64(...)``
(the same, per step tensor).
"""

import math
import operator

import torch
import torch.fx as fx

from flash_inductor import graph_utils, roles

_POWS = {operator.pow, torch.pow, "pow"}


def pow_in_fp64(base, exponent):
    """``base ** exponent`` computed in float64 and rounded to fp32."""
    base = base.double() if isinstance(base, torch.Tensor) else base
    return torch.pow(base, exponent.double()).float()


def foreach_pow_in_fp64(base, exponents):
    return [pow_in_fp64(base, e) for e in exponents]


def fp64_step_powers_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    steps = {name for name, role in ctx.roles.items() if role.kind == roles.STATE and role.state_key == "step"}
    hyper = {name for name, role in ctx.roles.items() if role.kind == roles.HYPER}
    found = [n.name for n in gm.graph.nodes if _step_power(n, steps, hyper)]
    if not found:
        return gm, []
    gm = graph_utils.copy_graph_module(gm)
    for node in [n for n in gm.graph.nodes if n.name in found]:
        base, exponent = node.args
        if isinstance(base, float):
            base = float(torch.tensor(base, dtype=torch.float32))  # as torch takes it against an fp32 step
        foreach = node.target is torch._foreach_pow
        node.op, node.target = "call_function", foreach_pow_in_fp64 if foreach else pow_in_fp64
        node.args = (base, exponent)
    gm.graph.lint()
    gm.recompile()
    return gm, found


def _step_power(node, steps, hyper):
    """Whether ``node`` is ``beta ** step`` (or ``torch._foreach_pow(beta, steps)``) with an fp32 result."""
    if node.op not in ("call_function", "call_method") or len(node.args) != 2 or node.kwargs:
        return False
    base, exponent = node.args
    if node.target in _POWS:
        exponents, results = [exponent], [node.meta.get("example_value")]
    elif node.target is torch._foreach_pow and isinstance(exponent, (list, tuple)):
        exponents, results = exponent, node.meta.get("example_value") or [None]
    else:
        return False
    hyperparameter = (isinstance(base, float) and math.isfinite(base)) or getattr(base, "name", None) in hyper
    fp32 = all(isinstance(r, torch.Tensor) and r.dtype == torch.float32 for r in results)
    return hyperparameter and fp32 and all(_is_step_count(e, steps) for e in exponents)


def _is_step_count(node, steps):
    """A step-count input, or the result of in-place ops on one (``step_t += 1`` returns ``step_t``)."""
    while isinstance(node, fx.Node) and node.name not in steps:
        if not roles.is_in_place(node) or not node.args:
            return False
        node = node.args[0]
    return isinstance(node, fx.Node)
