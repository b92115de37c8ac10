"""Gradient clipping over every gradient of a prepared optimizer, FP8 gradients included.

With ``prepare(..., gradient_format="e5m2")`` the gradients of the parameters with 8-bit states
live in FP8 (flash_inductor/flat.py), not in ``p.grad``. ``torch.nn.utils.clip_grad_norm_(
model.parameters(), max_norm)`` then sees only the small tensors' gradients: it computes a norm
far too small and clips too little, without an error (nothing in torch lets the package notice).
``flash_inductor.clip_grad_norm_(optimizer, max_norm)`` is its counterpart, with torch's definitions:

    norm of an FP8 gradient   ||codes||_p / scale          (codes as fp32; padding codes are 0)
    norm of another gradient  ||grad||_p                   (in fp32)
    total                     the p-norm of all those norms (p = inf: their max)
    coefficient               min(1, max_norm / (total + 1e-6))
    applied                   FP8 gradient: scale / coefficient, so that the step's decode
                              (codes times the inverse of the scale) multiplies by the coefficient;
                              another gradient: grad * coefficient, as torch does

Nothing is decoded to the parameters' dtype and nothing but the scales is written, so clipping
costs one read of the codes. The clipped scale is no longer a power of two: decoding rounds once
more (one fp32 rounding, against torch's rounding of the clipped bf16 gradient).
"""

import math

import torch

from flash_inductor import sharded
from flash_inductor.optimizer_record import prepared


@torch.compiler.disable
def clip_grad_norm_(optimizer, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """Clip the gradients of prepared ``optimizer``'s parameters (FP8 ones included) so that their
    total ``norm_type`` norm is at most ``max_norm``, in place; returns the total norm before
    clipping (fp32), like ``torch.nn.utils.clip_grad_norm_``. Call it after backward, before
    ``optimizer.step()``."""
    record = prepared(optimizer)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or inf, got {norm_type!r}")
    if record.gradient_release is not None:
        raise ValueError(
            "clip_grad_norm_: the optimizer was prepared with gradient_release=True, which applies each gradient in "
            "backward and frees it; there is no set of gradients to clip. Use gradient_release=False to clip"
        )
    if any(sharded.is_sharded(p) for p in record.params()):
        raise ValueError(
            "clip_grad_norm_: FSDP2 (DTensor) parameters keep their gradients in .grad; use "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) for them"
        )
    fp8 = [g for bucket in record.buckets if bucket.fp8_grads is not None for g in bucket.fp8_gradients().values()]
    grads = [p.grad for p in record.params() if p.grad is not None]
    norms = [torch.linalg.vector_norm(g.codes.float(), norm_type) / g.scales[0] for g in fp8]
    norms += [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), "
            "so it cannot be clipped; pass error_if_nonfinite=False to clip anyway (the gradients become nan)"
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in fp8:
        g.scales.div_(coefficient.to(g.scales.device))
    for g in grads:
        g.mul_(coefficient.to(g.device))
    return total
