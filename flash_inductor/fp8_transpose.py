"""A transposed copy of an FP8 matrix, in a kernel of its own.

Hopper's FP8 GEMMs take both operands K-major, so the weight-gradient GEMM ``dw = dy.T @ x`` needs
the e5m2 gradient and the e4m3 input transposed. Written as ``t.t().contiguous()``, Inductor fuses
the transposed copy into the kernel that produces ``t``'s rows, also when that kernel is a
per-row reduction (an RMSNorm or LayerNorm backward): each program then writes one row of ``t`` as
one column of the copy, 1-byte stores a whole column apart. On the H200, in HF Llama-1B's FP8
backward, such kernels took 1.2-1.3 ms a call (``benchmarks/results/hf_clients_llama_h200.log``,
first run of 2026-12-02), where the same RMSNorm backward without the copy took 0.05 ms. Row-wise
scaling's casts by columns are transposed here too (``fp8_linear._quantize_columns``;
``benchmarks/fp8_layer_kernels.py`` lists the kernels Inductor writes either way).

With a scale per row or per column, the copy also casts to FP8 on the way. Row-wise scaling casts
its operands by columns so (``fp8_linear._quantize_columns``: a weight, a gradient that a GEMM
stored, read once in bf16), and its hybrid (``tensorwise_weight_gradient``) brings the rows of a
row-wise cast to one scale for the weight gradient's GEMM. Done by a kernel of Inductor's before the
copy, each was one more write and read of the FP8 tensor (``benchmarks/fp8_layer_kernels.py``).

``transpose_fp8`` is a ``torch.library.triton_op``: Inductor launches its Triton kernel as written
and fuses nothing into it, so ``t`` is stored row by row where it is produced, and the copy moves
square tiles (Triton stages each tile through shared memory, so reads and writes are both whole
lines). On the CPU it is the plain transposed copy (Inductor fuses it there as it likes).

Its input is stored once: Inductor would otherwise store it twice, once for this kernel and once
for ``_scaled_mm``, because this kernel's lowering copies an input not yet realized
(``passes/fp8_transpose_source.py`` reads it through a view that realizes it first). Written as
``t().contiguous()`` instead, AOTAutograd recomputed the input's copy in backward and Inductor fused
it into the RMSNorm backward again (the Llama 0.94x the baseline's speed, against 1.18-1.21x;
docs/benchmarks.md, twenty-second session).
"""

import functools
from typing import Optional

import torch

from flash_inductor import _compat
from flash_inductor.formats import fp8

BLOCK = 64  # a BLOCK x BLOCK tile per program: 4 KiB of 1-byte elements


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def transpose_kernel(src, scale, dst, rows, cols, SCALE_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        r = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        tile = tl.load(src + r[:, None] * cols + c[None, :], mask=inside)
        if scale is not None:  # (a constexpr None compiles the plain copy)
            if SCALE_ROWS:
                factor = tl.load(scale + r, mask=r < rows)[:, None]
            else:
                factor = tl.load(scale + c, mask=c < cols)[None, :]
            # the product is exact (a power of two); sm_90 rounds it as torch's cast does, to nearest even,
            # and saturates as formats.fp8.cast_to_fp8 clamps: cvt.rn.satfinite (tests/test_fp8_transpose.py
            # reads the PTX)
            tile = (tile.to(tl.float32) * factor).to(dst.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(dst + c[None, :] * rows + r[:, None], tile, mask=inside)

    return transpose_kernel


def transpose_calls(graph):
    """The calls of ``transpose_kernel`` in a post-grad graph: AOTAutograd turns each ``transpose_fp8``
    into a ``triton_kernel_wrapper_functional`` node that names the kernel by its side-table index."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional

    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is triton_kernel_wrapper_functional]
    if not calls:  # (Triton is imported only when there are Triton calls)
        return []
    kernel = _kernel()
    return [n for n in calls if kernel_side_table.get_kernel(n.kwargs["kernel_idx"]) is kernel]


def transpose_fp8(t: torch.Tensor, scale: Optional[torch.Tensor] = None,
                  dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t.t().contiguous()`` for a 2-D ``t`` (any dtype; meant for FP8), as a kernel of its own on CUDA.

    With ``scale`` (fp32, ``(rows, 1)``: one a row of ``t``, or ``(1, cols)``: one a column) it casts
    on the way: ``formats.fp8.cast_to_fp8(t, scale, dtype)`` transposed, in one pass over ``t``
    (``dtype``: an FP8 dtype, ``t``'s own by default). Meant for powers of two, whose products are
    exact: ``fp8_linear`` casts a tensor by columns this way, and rescales row casts to one scale."""
    dtype = t.dtype if dtype is None else dtype
    if scale is not None:
        _check_scale(t, scale, dtype)
    elif dtype != t.dtype:
        raise ValueError(f"transpose_fp8: casting {t.dtype} to {dtype} needs a scale")
    if t.device.type != "cuda" or not _compat.HAS_TRITON:
        if scale is not None:
            t = fp8.cast_to_fp8(t, scale, dtype)
        # a copy also of a ``t`` laid out by columns: a custom op's output may not alias its input
        return t.t().clone(memory_format=torch.contiguous_format)
    t = t.contiguous()
    rows, cols = t.shape
    out = torch.empty((cols, rows), dtype=dtype, device=t.device)
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    scale_rows = scale is not None and tuple(scale.shape) == (rows, 1)
    flat_scale = None if scale is None else scale.reshape(-1).contiguous()
    torch.library.wrap_triton(_kernel())[grid](t, flat_scale, out, rows, cols, SCALE_ROWS=scale_rows, BLOCK=BLOCK)
    return out


def _check_scale(t, scale, dtype):
    if dtype not in (fp8.E4M3, fp8.E5M2):
        raise ValueError(f"transpose_fp8: a scale casts to FP8, but the output would be {dtype}")
    rows, cols = t.shape
    if scale.dtype != torch.float32 or tuple(scale.shape) not in ((rows, 1), (1, cols)):
        raise ValueError(f"transpose_fp8: scale must be fp32 of shape ({rows}, 1) (one a row of t) or (1, {cols}) "
                         f"(one a column), got {scale.dtype} of shape {tuple(scale.shape)}")


if _compat.HAS_TRITON:  # (without Triton, registering it logs a warning at import)
    transpose_fp8 = torch.library.triton_op("flash_inductor::transpose_fp8", mutates_args=())(transpose_fp8)
