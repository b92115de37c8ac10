"""FP8 linear layer (FP8-LM level 1, Transformer Engine's "hybrid" format), current or delayed scaling,
or row-wise scaling.

    forward:   y  = x @ w.T + b       x, w in e4m3 with per-tensor scales, output bf16
    backward:  dx = dy @ w            dy in e5m2 (or e4m3: ``e4m3_gradients``), w in e4m3
               dw = dy.T @ x          dy in e5m2 (or e4m3), x in e4m3
               db = dy.sum(0)

Row-wise scaling (``rowwise=True``, torchao's "rowwise" recipe; ``Fp8RowwiseLinearFunction``): every
operand of every GEMM in e4m3 with one power-of-two scale per row along the dimension that GEMM sums
over, so each tensor is cast twice, once per direction it is summed in: x and w along k for y, w
along n for dx (saved as ``w.T`` cast by rows), dy along n for dx and along the tokens for dw, x
along the tokens for dw (saved as ``x.T`` cast by rows). The saved bytes are tensorwise's (x and w
in e4m3); the forward casts twice as much. A transposed operand is cast by columns where its tensor
is stored and then transposed by ``fp8_transpose`` (``_quantize_columns``).

With ``tensorwise_weight_gradient`` the weight-gradient GEMM, which sums over the tokens, takes one
power-of-two scale per operand instead (tensorwise scaling's precision for that GEMM): x's and dy's
casts by rows rescaled to the smallest of their rows' scales, the one of their largest row, as
``fp8_transpose`` transposes them (``_rows_as_one_scale_transposed``). Nothing passes over the
tokens' columns then, and no activation or gradient is cast from bf16 twice.

Shapes: ``_scaled_mm`` wants the dims it sums over and its output's columns multiples of 16. The
weight's dims are zero-padded to them where that adds at most 1% (``padded_shape``), and the tokens
always, as they are the K of ``dw`` (the forward and ``dx`` GEMMs take the unpadded rows of the same
casts); zero rows and columns change no amax, no product and no sum, and the results are cut back.

Current scaling casts every operand with ``scale = fp8_max / amax`` of its current value
(``formats.fp8``). Delayed scaling takes the scale from an amax history instead and records the
operand's amax in it (``formats.fp8.scale_from_history``); the histories and last scales are
buffers of the layer (``flash_inductor.fp8_delayed``) that this function updates in place: the
forward the rows of x and w, the backward the grad-output's. ``torch._scaled_mm`` multiplies (partial
sums promoted to fp32, ``_scaled_mm`` below) and takes the inverse scales. Its second operand must be column-major: an
``[N, K]`` row-major tensor transposed.

It is a ``torch.autograd.Function`` of plain torch ops, so AOTAutograd traces forward and
backward into the joint graph and Inductor fuses the amax reductions and casts with the
neighbouring ops; ``_scaled_mm`` itself is an extern kernel. AOTAutograd keeps the in-place
buffer updates in the compiled graphs, the backward's too (it supports data mutations in the
backward of forward inputs that do not require grad and that the forward does not mutate; the
forward and backward state are separate buffers for that reason).
"""

import fnmatch

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from flash_inductor.formats import fp8
from flash_inductor.formats.fp8_weight import Fp8Weight
from flash_inductor.fp8_transpose import transpose_fp8

_FP8_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def ineligible_reason(weight, module_name, options, tokens=None):
    """Why the linear layer of ``weight`` (a tensor or fake tensor; its module's name) stays in bf16
    under ``options``, or None when it runs in FP8; ``tokens``: the rows it multiplies, where known
    (its GEMM's size is then checked too)."""
    if weight.dim() != 2:
        return "weight is not a 2-D tensor"
    if weight.dtype not in _FP8_WEIGHT_DTYPES:
        return f"weight dtype {weight.dtype}"
    n, k = weight.shape
    if padded_shape(n, k) is None:
        return f"weight {n}x{k}: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)"
    if n * k < options.fp8_min_weight_numel:
        return f"weight {n}x{k} is under fp8_min_weight_numel={options.fp8_min_weight_numel}"
    least = options.min_gemm_size(weight.device)
    if tokens is not None and tokens * k * n < least:
        return (f"GEMM {tokens}x{k}x{n} (tokens x in x out) is under fp8_min_gemm_size={least}: "
                "its casts would cost more than FP8 saves")
    return refused_by_user(module_name, options)


def layer_weight(module):
    """The weight parameter of ``module`` when it is an ``nn.Linear`` whose weight is one, else None:
    a parametrized weight (``weight_norm``, ``spectral_norm``) is computed at each access, so FP8
    state kept per layer (delayed scaling, FP8 all-gather) has no parameter to follow."""
    if not isinstance(module, torch.nn.Linear) or torch.nn.utils.parametrize.is_parametrized(module, "weight"):
        return None
    return module.weight


def refused_by_user(module_name, options):
    """Why ``fp8_exclude`` or ``fp8_filter`` keep module ``module_name`` in bf16, or None."""
    if any(fnmatch.fnmatchcase(module_name, pattern) for pattern in options.fp8_exclude):
        return f"excluded by fp8_exclude {list(options.fp8_exclude)}"
    if options.fp8_filter is not None and not options.fp8_filter(module_name):
        return "rejected by fp8_filter"
    return None


def _multiple_of_16(n):
    """``n`` rounded up to a multiple of 16: ``_scaled_mm`` wants the dims it sums over (K) and its
    output's columns (N) so; the tokens are the K of the weight-gradient GEMM."""
    return -(-n // 16) * 16


def _padded_tokens(m):
    """The rows the FP8 GEMMs take for ``m`` tokens: ``m`` rounded up to a multiple of 16. A symbolic
    ``m`` (a dynamic sequence length) gets 1 to 16 rows more, never none: with none possible, Inductor's
    CUDA lowering guarded on ``m`` being a multiple of 16 and compiled again at the first count that
    was not (an H100, tensorwise)."""
    return _multiple_of_16(m) if isinstance(m, int) else 16 * (m // 16 + 1)


def padded_shape(n, k):
    """The weight shape the FP8 GEMMs use for an ``n x k`` weight: both dims rounded up to multiples
    of 16 when that adds at most 1% of elements (an lm_head of 50257 rows: 15 rows), else None."""
    pn, pk = _multiple_of_16(n), _multiple_of_16(k)
    return (pn, pk) if pn * pk <= 1.01 * n * k else None


def _pad_to(t, rows, cols):
    """``t`` (2-D) with zero rows and columns appended up to ``rows x cols``, each where its size is not
    known to be that already (a symbolic token count always)."""
    if not statically_known_true(t.shape[1] == cols):
        t = torch.nn.functional.pad(t, (0, cols - t.shape[1]))
    if not statically_known_true(t.shape[0] == rows):
        # Written into zeros rather than padded: constant_pad_nd takes no symbolic padding in a plain fake
        # mode (the passes' type check), and a tensor of the padding alone (cat) guards on its size being 0.
        t = t.new_zeros(rows, cols).slice_scatter(t, 0, 0, t.shape[0])
    return t


def _first_rows(t, m):
    """``t[:m]``, or ``t`` itself where it is known to have ``m`` rows (the graph then stays as it was
    before the tokens were padded)."""
    return t if statically_known_true(t.shape[0] == m) else t[:m]


def _quantize(t, dtype, power_of_two, history=None, scales=None, row=None):
    """``(t in fp8, inverse scale)``: current scaling, or delayed scaling from ``history[row]``
    (whose entry and ``scales[row]`` are then updated with ``t``'s amax and the scale used)."""
    amax = fp8.amax(t)
    if history is None:
        scale = fp8.scale_from_amax(amax, dtype, power_of_two=power_of_two)
    else:
        scale = fp8.scale_from_history(history[row], dtype, scales[row], power_of_two, current_amax=amax)
        history[row].copy_(fp8.update_amax_history(history[row], amax))
        scales[row].copy_(scale)
    return fp8.cast_to_fp8(t, scale, dtype), fp8.inverse_scale(scale)


def _row_scales(t):
    """Row-wise scaling's scales of the 2-D ``t``: one power-of-two e4m3 scale per row, a column
    ``(rows, 1)`` (``formats.fp8.row_amax``)."""
    return fp8.scale_from_amax(fp8.row_amax(t), fp8.E4M3, power_of_two=True)


def _quantize_rows(t):
    """``(t in e4m3, row-major, cast by rows; the inverse scales (rows, 1))``."""
    scale = _row_scales(t)
    return fp8.cast_to_fp8(t, scale, fp8.E4M3).contiguous(), fp8.inverse_scale(scale)


def _rows_as_one_scale_transposed(t_fp8, t_inv):
    """``(the row casts t_fp8 with one scale for the whole tensor, transposed; its inverse scale (1, 1))``.

    The scale is the smallest of the rows' (``t_inv`` holds their inverses): each row is multiplied by
    its scale's ratio to it, an exact power of two of at most 1, so a value is rounded again only where
    it moves into e4m3's subnormals, as a cast of the tensor with that scale would round it."""
    inv = t_inv.amax(dim=0, keepdim=True)
    ratio = t_inv * fp8.inverse_scale(inv)  # a power of two times one: exact
    # rescaled as transposed: one pass over the cast, not a rescaled copy and then its transpose
    return transpose_fp8(t_fp8, ratio), inv


def _quantize_columns(t):
    """``_quantize_rows(t.t())``, the same bits: each column cast with its own scale as ``transpose_fp8``
    copies ``t`` where it is stored. Cast through ``t.t()`` directly, Inductor stores the
    transposed bytes from the kernel that produces ``t``, an RMSNorm's forward or backward among
    them, a column apart per row (the slow kernels ``fp8_transpose`` describes)."""
    scale = _row_scales(t.t())
    return transpose_fp8(t, scale.t(), fp8.E4M3), fp8.inverse_scale(scale)


def _refuse_what_cuda_refuses(a, a_inv_scale, b_t, b_inv_scale):
    """Raise where CUDA's ``_scaled_mm`` would (its checks in torch's meta registrations, which skip
    them on the CPU), so that CPU tests catch the operands a GPU would not take: ``a`` row-major, ``b_t``
    column-major, K and N multiples of 16, fp32 inverse scales of one element each or ``(M, 1)`` and
    contiguous ``(1, N)``. Symbolic sizes are left to the GPU."""
    (m, k), n = a.shape, b_t.shape[1]
    sizes = (m, k, n, *a.stride(), *b_t.stride())
    if not all(isinstance(size, int) for size in sizes):
        return
    problems = [f"{dim} = {size} is not a multiple of 16" for dim, size in (("K", k), ("N", n)) if size % 16]
    if m and k and not (a.stride(1) == 1 and a.stride(0) > 1):
        problems.append(f"the first operand is not row-major (strides {a.stride()})")
    if k and n and not (b_t.stride(0) == 1 and b_t.stride(1) > 1):
        problems.append(f"the second operand is not column-major (strides {b_t.stride()})")
    tensorwise = a_inv_scale.numel() == 1 and b_inv_scale.numel() == 1
    rowwise = (tuple(a_inv_scale.shape) == (m, 1) and tuple(b_inv_scale.shape) == (1, n)
               and a_inv_scale.is_contiguous() and b_inv_scale.is_contiguous())
    if not (tensorwise or rowwise) or {a_inv_scale.dtype, b_inv_scale.dtype} != {torch.float32}:
        problems.append(f"inverse scales {tuple(a_inv_scale.shape)} and {tuple(b_inv_scale.shape)} "
                        f"({a_inv_scale.dtype}, {b_inv_scale.dtype}) are neither one fp32 each nor contiguous (M, 1) and (1, N)")
    if problems:
        raise RuntimeError(f"_scaled_mm of {tuple(a.shape)} @ {tuple(b_t.shape)}: " + "; ".join(problems))


def _scaled_mm(a, a_inv_scale, b_t, b_inv_scale, fast_accum=False):
    """``a @ b_t`` in bf16 (partial sums promoted to fp32 unless ``fast_accum``; on Hopper each holds
    about 13 bits before, benchmarks/fp8_accumulation.py); ``b_t`` is column-major. The
    inverse scales are one each (per-tensor) or a column ``(M, 1)`` and a row ``(1, N)`` (row-wise).

    On the CPU the fp8 operands are multiplied as fp32 matrices: their products are exact in fp32
    and the sum accumulates in fp32, as DESIGN §2.4 asks, while torch's CPU ``_scaled_mm`` has no
    fast kernel without FP8 hardware (512x128 @ 128x384 on the 2-core CI machine: 0.45 s against
    0.02 s, the same bits). ``fast_accum`` only exists on the GPU.
    """
    if a.device.type == "cpu":
        _refuse_what_cuda_refuses(a, a_inv_scale, b_t, b_inv_scale)
        return ((a.float() @ b_t.float()) * (a_inv_scale * b_inv_scale)).to(torch.bfloat16)
    return torch._scaled_mm(a, b_t, scale_a=a_inv_scale, scale_b=b_inv_scale, out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def _rows(t):
    """The 2-D ``t`` laid out row-major, as ``_scaled_mm`` takes its first operand: itself, or a copy
    of one laid out by columns (a transposed input, or a gradient of a transposed output: Hugging
    Face's Funnel)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _col_major(t):
    """The same matrix, laid out column-major (as ``_scaled_mm`` wants its second operand)."""
    return t.t().contiguous().t()


def _output_dtype(x, weight):
    """What ``F.linear`` would return: autocast's dtype inside an autocast region."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)


def _padded_input(ctx, x, weight, bias):
    """``(x as a 2-D matrix padded to the weight's padded in-dim and to a multiple of 16 tokens, its
    tokens, n, pn, pk)``, with what the backward needs of the shapes and dtypes kept on ``ctx``. Zero
    padding (``padded_shape``) changes no amax, no product and no sum; the results are cut back."""
    n, k = weight.shape
    pn, pk = padded_shape(n, k)
    x2 = _rows(x.reshape(-1, k))
    ctx.input_shape, ctx.input_dtype, ctx.weight_dtype = x.shape, x.dtype, weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    return _pad_to(x2, _padded_tokens(x2.shape[0]), pk), x2.shape[0], n, pn, pk


def _output(out, bias, n, pn, x, weight):
    """The forward GEMM's ``out`` cut back to ``n`` columns, with the bias, in ``F.linear``'s dtype:
    2-D and not a view (the caller reshapes), as callers write a linear's output in place
    (``mlp_out += attn_out``), which autograd forbids on a view made inside a Function."""
    if bias is not None:
        out = out[:, :n] + bias
    elif pn != n:
        out = out[:, :n].contiguous()
    return out.to(_output_dtype(x, weight))


def _gradients(ctx, grad_x, grad_w, g2):
    """The backward's ``(dx, dw, db)`` cut back to the unpadded shapes, in the inputs' dtypes."""
    n, k = g2.shape[1], ctx.input_shape[-1]
    grad_b = None if ctx.bias_dtype is None else g2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x[:, :k].reshape(ctx.input_shape).to(ctx.input_dtype), grad_w[:n, :k].to(ctx.weight_dtype), grad_b


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, power_of_two, fast_accum, amax_history, scale, grad_amax_history, grad_scale,
                e4m3_gradients):
        xp, m, n, pn, pk = _padded_input(ctx, x, weight, bias)
        x_fp8, x_inv = _quantize(xp, fp8.E4M3, power_of_two, amax_history, scale, 0)
        if isinstance(weight, Fp8Weight):  # gathered in e4m3 (fp8_all_gather): cast already
            w_fp8, w_inv = _pad_to(weight.qdata.view(torch.uint8), pn, pk).view(fp8.E4M3), fp8.inverse_scale(weight.scale)
        else:
            w_fp8, w_inv = _quantize(_pad_to(weight, pn, pk), fp8.E4M3, power_of_two, amax_history, scale, 1)
        ctx.save_for_backward(x_fp8, x_inv, w_fp8, w_inv)
        # Not saved tensors: the backward writes them, and autograd would refuse saved tensors that
        # a later forward (the next micro-batch) modified in place.
        ctx.grad_state = (grad_amax_history, grad_scale)
        ctx.power_of_two = power_of_two
        ctx.grad_dtype = fp8.E4M3 if e4m3_gradients else fp8.E5M2
        # Column-major already for an (out, in) weight (no copy); a transposed (in, out) one is copied.
        out = _scaled_mm(_first_rows(x_fp8, m), x_inv, _col_major(w_fp8.t()), w_inv, fast_accum)
        return _output(out, bias, n, pn, x, weight)

    @staticmethod
    # Only eager runs (compiler="eager") call this; AOTAutograd traces it without Dynamo. Dynamo
    # would capture it as a frame of its own and unpack the saved tensors twice, which an
    # activation-checkpointed region forbids.
    @torch.compiler.disable
    def backward(ctx, grad_out):
        x_fp8, x_inv, w_fp8, w_inv = ctx.saved_tensors
        g2 = _rows(grad_out.reshape(-1, grad_out.shape[-1]))
        m = g2.shape[0]
        g_fp8, g_inv = _quantize(_pad_to(g2, x_fp8.shape[0], w_fp8.shape[0]), ctx.grad_dtype, ctx.power_of_two,
                                 *ctx.grad_state, 0)
        grad_x = _scaled_mm(_first_rows(g_fp8, m), g_inv, _col_major(w_fp8), w_inv)
        # Both transposed copies in kernels of their own (fp8_transpose: fused into a norm's backward they were slow).
        grad_w = _scaled_mm(transpose_fp8(g_fp8), g_inv, transpose_fp8(x_fp8).t(), x_inv)
        return *_gradients(ctx, grad_x, grad_w, g2), None, None, None, None, None, None, None


class Fp8RowwiseLinearFunction(torch.autograd.Function):
    """Row-wise scaling (module docstring): each GEMM's operands cast by rows along the dimension it sums."""

    @staticmethod
    def forward(ctx, x, weight, bias, fast_accum, tensorwise_weight_gradient):
        xp, m, n, pn, pk = _padded_input(ctx, x, weight, bias)
        wp = _pad_to(weight, pn, pk)
        x_fp8, x_inv = _quantize_rows(xp)
        w_fp8, w_inv = _quantize_rows(wp)
        # What the backward's GEMMs take: w summed over n (dx), x summed over the tokens (dw).
        ctx.tensorwise_weight_gradient = tensorwise_weight_gradient
        xt = _rows_as_one_scale_transposed(x_fp8, x_inv) if tensorwise_weight_gradient else _quantize_columns(xp)
        ctx.save_for_backward(*_quantize_columns(wp), *xt)
        out = _scaled_mm(_first_rows(x_fp8, m), _first_rows(x_inv, m), w_fp8.t(), w_inv.t(), fast_accum)
        return _output(out, bias, n, pn, x, weight)

    @staticmethod
    @torch.compiler.disable  # as Fp8LinearFunction.backward
    def backward(ctx, grad_out):
        wt_fp8, wt_inv, xt_fp8, xt_inv = ctx.saved_tensors
        g2 = _rows(grad_out.reshape(-1, grad_out.shape[-1]))
        gp = _pad_to(g2, xt_fp8.shape[1], wt_fp8.shape[1])
        g_fp8, g_inv = _quantize_rows(gp)
        if ctx.tensorwise_weight_gradient:
            gt_fp8, gt_inv = _rows_as_one_scale_transposed(g_fp8, g_inv)
        else:
            gt_fp8, gt_inv = _quantize_columns(gp)
        m = g2.shape[0]
        grad_x = _scaled_mm(_first_rows(g_fp8, m), _first_rows(g_inv, m), wt_fp8.t(), wt_inv.t())
        grad_w = _scaled_mm(gt_fp8, gt_inv, xt_fp8.t(), xt_inv.t())
        return *_gradients(ctx, grad_x, grad_w, g2), None, None


def fp8_linear(x, weight, bias=None, *, rowwise=False, power_of_two=False, fast_accum=False, e4m3_gradients=False,
               tensorwise_weight_gradient=False, amax_history=None, scale=None, grad_amax_history=None, grad_scale=None):
    """``F.linear(x, weight, bias)`` with FP8 GEMMs in forward and backward.

    Current scaling by default. Delayed scaling with the layer's state (``fp8_delayed``):
    ``amax_history`` [2, L] and ``scale`` [2] for x and w (rows 0 and 1), ``grad_amax_history``
    [1, L] and ``grad_scale`` [1] for the grad-output, all fp32 and updated in place.
    ``power_of_two``: scales rounded down to powers of two. ``fast_accum``: the forward GEMM in the
    tensor cores' fast (lower-precision) accumulation mode, as torchao's default output GEMM.
    ``e4m3_gradients``: the output gradient cast to e4m3 instead of e5m2 (row-wise's always is).
    ``rowwise``: row-wise scaling (current, power-of-two scales; not with delayed scaling's state).
    ``tensorwise_weight_gradient``: with ``rowwise``, the weight gradient's GEMM takes one scale per
    operand, from the row casts (module docstring).
    """
    if tensorwise_weight_gradient and not rowwise:
        raise ValueError("fp8_linear: tensorwise_weight_gradient is an option of rowwise scaling (rowwise=True)")
    if rowwise:
        if amax_history is not None:
            raise ValueError("fp8_linear: rowwise scaling is current scaling; it takes no delayed-scaling state")
        out = Fp8RowwiseLinearFunction.apply(x, weight, bias, fast_accum, tensorwise_weight_gradient)
    else:
        out = Fp8LinearFunction.apply(x, weight, bias, power_of_two, fast_accum, amax_history, scale,
                                      grad_amax_history, grad_scale, e4m3_gradients)
    return out.reshape(*x.shape[:-1], weight.shape[0])
