"""Checks on a prepared optimizer's inputs before its step runs."""

import torch

from flash_inductor import roles
from flash_inductor.formats import split_weights


def check_before_step(optimizer):
    record = roles.PREPARED[optimizer]
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
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
        if record.check_numerics:
            check_lr_moves_weights(record, group)


def smallest_step(param, error_term):
    """The smallest change the stored master of ``param`` can represent at its largest magnitude."""
    largest = param.detach().abs().max().float()
    if param.dtype == torch.float32:
        return float(largest) * torch.finfo(torch.float32).eps / 2
    half_ulp = 2.0 ** float(split_weights.half_ulp_log2(largest.to(param.dtype)))
    if error_term is None:
        return half_ulp
    return half_ulp / split_weights.code_max(error_term.dtype)


def check_lr_moves_weights(record, group):
    """FlashOptim's ``check_numerics``: refuse a learning rate whose steps round away to nothing."""
    lr = float(group["lr"])
    for p in group["params"]:
        floor = smallest_step(p, record.error_term(p))
        if lr < floor:
            raise ValueError(
                f"lr={lr:g} is too small to move parameter '{record.param_names.get(p, '?')}' "
                f"(largest |w| = {float(p.detach().abs().max()):g}, smallest representable step {floor:g} with "
                f"{record.master_weight_bits or p.dtype}-bit masters); raise lr, use master_weight_bits=32, "
                "or pass check_numerics=False to prepare"
            )
