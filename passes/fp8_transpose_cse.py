"""FP8 transpose CSE: one transposed copy of an FP8 tensor per graph, however many GEMMs read it.

Linear layers that read the same input (an attention block's q, k and v projections, an MLP's gate
and up projections) share its e4m3 cast: AOTAutograd's CSE merges their identical casts. Each
layer's weight-gradient GEMM still asks for the cast's transposed copy
(``flash_inductor/fp8_transpose.py``), and those calls are never merged: ``transpose_fp8`` is a
Triton kernel, whose functional form writes a fresh ``empty`` buffer (which CSE leaves alone) and
names its constant arguments by a per-call index. In HF Llama-1B's backward that is 3 of the 14
transposes of each layer (docs/benchmarks.md).

Before (post-grad backward graph, CUDA; ``K`` is ``transpose_kernel``'s index in Triton's side table)::

    empty = torch.ops.aten.empty.memory_format([2048, 8192], dtype=torch.float8_e4m3fn, device=cuda)
    wrapper = triton_kernel_wrapper_functional(kernel_idx=K, constant_args_idx=3, grid=[(128, 32, 1)],
        kwargs={'src': x_fp8, 'dst': empty}, tensors_to_clone=['dst'])
    x_fp8_t = wrapper['dst']
    empty_1 = torch.ops.aten.empty.memory_format([2048, 8192], dtype=torch.float8_e4m3fn, device=cuda)
    wrapper_1 = triton_kernel_wrapper_functional(kernel_idx=K, constant_args_idx=4, grid=[(128, 32, 1)],
        kwargs={'src': x_fp8, 'dst': empty_1}, tensors_to_clone=['dst'])
    x_fp8_t_1 = wrapper_1['dst']
    mm_k = torch.ops.aten._scaled_mm.default(g_k_t, x_fp8_t_1.t(), ...)

After::

    empty = ...
    wrapper = triton_kernel_wrapper_functional(... 'src': x_fp8, 'dst': empty ...)
    x_fp8_t = wrapper['dst']
    mm_k = torch.ops.aten._scaled_mm.default(g_k_t, x_fp8_t.t(), ...)

A call is merged into an earlier one of the same kernel when both read the same source (and scales,
where given) with the same grid and constant arguments (compared by value) into equal fresh
``empty`` buffers that nothing else uses. Other Triton kernels are left alone (a kernel may write
more than its output).
"""

import operator

import torch
import torch.fx as fx
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

from flash_inductor import fp8_transpose, graph_utils

_EMPTY = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)


def fp8_transpose_cse_pass(graph: fx.Graph, ctx) -> tuple[fx.Graph, list[str]]:
    if ctx.options.fp8 is None:
        return graph, []
    first_of, duplicates = {}, []
    for node in fp8_transpose.transpose_calls(graph):
        key = _key(node)
        if key is None:
            continue
        if key in first_of:
            duplicates.append((node, first_of[key]))
        else:
            first_of[key] = node
    if not duplicates:
        return graph, []
    new_graph, copy_of = graph_utils.copy_graph(graph)
    for old_duplicate, old_first in duplicates:
        duplicate, first = copy_of[old_duplicate], copy_of[old_first]
        for getitem in list(duplicate.users):
            getitem.replace_all_uses_with(_output(new_graph, first, getitem.args[1]))
            new_graph.erase_node(getitem)
        empty = duplicate.kwargs["kwargs"]["dst"]
        new_graph.erase_node(duplicate)
        new_graph.erase_node(empty)
    return new_graph, [duplicate.name for duplicate, _ in duplicates]


def _key(node):
    """What makes two calls of ``transpose_kernel`` equal, or None for a call whose ``dst`` is not a
    fresh buffer only it writes."""
    kwargs = node.kwargs
    tensors = kwargs["kwargs"]
    dst = tensors.get("dst")
    if not isinstance(dst, fx.Node) or dst.target not in _EMPTY or len(dst.users) != 1:
        return None
    if any(user.target is not operator.getitem for user in node.users):
        return None
    constants = kernel_side_table.get_constant_args(kwargs["constant_args_idx"])
    return (
        kwargs["kernel_idx"],
        tuple(sorted((name, tensor) for name, tensor in tensors.items() if name != "dst")),  # src, scale
        repr(kwargs["grid"]),
        repr(sorted(constants.items())),
        dst.target,
        repr(dst.args),
        repr(sorted(dst.kwargs.items())),
    )


def _output(graph, call, key):
    """``call[key]``: its existing getitem node, or a new one right after ``call``."""
    for user in call.users:
        if user.target is operator.getitem and user.args[1] == key:
            return user
    with graph.inserting_after(call):
        return graph.call_function(operator.getitem, (call, key))
