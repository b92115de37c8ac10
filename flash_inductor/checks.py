"""Checks on a prepared optimizer's inputs before its step runs.

Everything here only reads: a step that fails a check raises before anything is written, so
parameters, error terms and states are left as they were.
"""

import math

import torch

from flash_inductor import roles
from flash_inductor.formats import split_weights


def check_before_step(optimizer):
    record = roles.PREPARED[optimizer]
    for group in optimizer.param_groups:
        for p in group["params"]:
            check_grad(record, p)
    check_numerics(record, optimizer)


def check_numerics(record, optimizer, stepped=None):
    """With ``prepare(..., check_numerics=True)``: every group's lr must move its weights (those of
    the parameters in ``stepped``; default: those with a ``.grad``)."""
    if record.check_numerics:
        for group in optimizer.param_groups:
            check_lr_moves_weights(record, group, stepped)


def check_storage(record, p):
    """A parameter of a flat bucket must still be its view of the bucket's weights: ``model.to()``,
    ``.float()``, ``.half()`` or ``p.data = ...`` after ``prepare`` give it another tensor, which the
    step would never update (it updates the flat storage) or which its bf16 gradient could not be
    assigned to."""
    expected = record.weight_addresses.get(p)
    if expected is not None and p.data_ptr() != expected:
        name = record.param_names.get(p, "?")
        raise RuntimeError(
            f"parameter '{name}' ({p.dtype} on {p.device}) no longer holds the storage flash_inductor.prepare gave "
            "it: its .data was replaced after prepare (model.to(device or dtype), model.float(), model.half(), or "
            "an assignment to .data), so the optimizer would update a tensor the model no longer reads. Move and "
            "convert the model before prepare(model, optimizer), and leave its parameters as prepare made them"
        )


def check_grad(record, p):
    """The compiled step needs a dense gradient of the parameter's dtype and shape (or none)."""
    if p.grad is None:
        return
    name = record.param_names.get(p, "?")
    if p.grad.is_sparse:
        raise RuntimeError(
            f"parameter '{name}' has a sparse gradient; flash_inductor optimizers need dense gradients "
            "(e.g. nn.Embedding(sparse=False))"
        )
    if p.grad.dtype != p.dtype or p.grad.shape != p.shape:
        raise RuntimeError(
            f"parameter '{name}': gradient is {p.grad.dtype}{list(p.grad.shape)} but the parameter is "
            f"{p.dtype}{list(p.shape)}"
        )


def smallest_step(param, error_term):
    """The smallest update that still changes the stored master of ``param`` at its largest
    magnitude: half the master's resolution there (a smaller change rounds back to the same
    stored value; FlashOptim's ``check_numerics`` uses the same criterion).

    The resolution is one ULP of an fp32 parameter, one ULP of a bf16/fp16 parameter without an
    error term, and one error-term code step, ``half_ulp(hi) / N``, of a split weight.
    """
    largest = param.detach().abs().max().float()
    if not torch.isfinite(largest):
        return 0.0  # non-finite weights: nothing meaningful to check
    if param.dtype == torch.float32:
        if float(largest) == 0.0:
            return 2.0 ** -150  # half the smallest subnormal
        exponent = max(math.frexp(float(largest))[1] - 1, -126)
        return 2.0 ** (exponent - 23) / 2
    half_ulp = 2.0 ** float(split_weights.half_ulp_log2(largest.to(param.dtype)))
    if error_term is None:
        return half_ulp
    return half_ulp / split_weights.code_max(error_term.dtype) / 2


def _master_description(record, param):
    error = record.error_term(param)
    if error is not None:
        return f"{record.master_weight_bits}-bit split masters ({param.dtype} + {error.dtype} error term)"
    return f"{param.dtype} masters (no error term)"


def check_lr_moves_weights(record, group, stepped=None):
    """FlashOptim's ``check_numerics``: refuse a learning rate whose steps round away to nothing.

    Only parameters this step updates are checked (``stepped``; default: those with a ``.grad``;
    FP8 gradients are not in ``.grad``); ``lr = 0`` (e.g. the first step of a warmup) is a
    deliberate no-op and passes.
    """
    lr = float(group["lr"])
    if lr == 0.0:
        return
    for p in group["params"]:
        if (p.grad is None if stepped is None else p not in stepped) or p.numel() == 0:
            continue
        floor = smallest_step(p, record.error_term(p))
        if lr < floor:
            name = record.param_names.get(p, "?")
            fixes = "raise lr"
            if record.error_term(p) is not None and record.master_weight_bits != 32:
                fixes += ", use prepare(..., master_weight_bits=32)"
            raise ValueError(
                f"lr={lr:g} is too small to move parameter '{name}': its largest |w| = "
                f"{float(p.detach().abs().max()):g} stored as {_master_description(record, p)} only changes by "
                f"steps of at least {floor:g}; {fixes}, or pass check_numerics=False to prepare"
            )
