"""FP8 linear layer (FP8-LM level 1, Transformer Engine's "hybrid" format), current scaling.

    forward:   y  = x @ w.T + b       x, w in e4m3 with per-tensor scales, output bf16
    backward:  dx = dy @ w            dy in e5m2, w in e4m3
               dw = dy.T @ x          dy in e5m2, x in e4m3
               db = dy.sum(0)

Every operand is scaled with ``scale = fp8_max / amax`` of its current value
(``formats.fp8``); ``torch._scaled_mm`` multiplies with fp32 accumulation and takes the inverse
scales. Its second operand must be column-major: an ``[N, K]`` row-major tensor transposed.

It is a ``torch.autograd.Function`` of plain torch ops, so AOTAutograd traces forward and
backward into the joint graph and Inductor fuses the amax reductions and casts with the
neighbouring ops; ``_scaled_mm`` itself is an extern kernel.
"""

import torch

from flash_inductor.formats import fp8


def _quantize(x, dtype):
    """``(x in fp8, inverse scale)`` with the current per-tensor scale."""
    scale = fp8.scale_from_amax(fp8.amax(x), dtype)
    return fp8.cast_to_fp8(x, scale, dtype), scale.reciprocal()


def _scaled_mm(a, a_inv_scale, b_t, b_inv_scale):
    """``a @ b_t`` in bf16 (fp32 accumulation); ``b_t`` is column-major."""
    return torch._scaled_mm(a, b_t, scale_a=a_inv_scale, scale_b=b_inv_scale, out_dtype=torch.bfloat16)


def _col_major(t):
    """The same matrix, laid out column-major (as ``_scaled_mm`` wants its second operand)."""
    return t.t().contiguous().t()


def _output_dtype(x, weight):
    """What ``F.linear`` would return: autocast's dtype inside an autocast region."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.shape[-1])
        x_fp8, x_inv = _quantize(x2, fp8.E4M3)
        w_fp8, w_inv = _quantize(weight, fp8.E4M3)
        ctx.save_for_backward(x_fp8, x_inv, w_fp8, w_inv)
        ctx.input_shape, ctx.input_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = _scaled_mm(x_fp8, x_inv, w_fp8.t(), w_inv)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0]).to(_output_dtype(x, weight))

    @staticmethod
    def backward(ctx, grad_out):
        x_fp8, x_inv, w_fp8, w_inv = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g_fp8, g_inv = _quantize(g2, fp8.E5M2)
        grad_x = _scaled_mm(g_fp8, g_inv, _col_major(w_fp8), w_inv).reshape(ctx.input_shape)
        grad_w = _scaled_mm(g_fp8.t().contiguous(), g_inv, _col_major(x_fp8), x_inv)
        grad_b = None if ctx.bias_dtype is None else g2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x.to(ctx.input_dtype), grad_w.to(ctx.weight_dtype), grad_b


def fp8_linear(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` with FP8 GEMMs in forward and backward."""
    return Fp8LinearFunction.apply(x, weight, bias)
