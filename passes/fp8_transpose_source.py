"""FP8 transpose source: the FP8 tensor a transposed copy is made from is stored once.

An FP8 operand that the weight-gradient GEMM needs transposed (``flash_inductor/fp8_transpose.py``)
has two readers: ``_scaled_mm`` and the transpose's Triton kernel. Both want it in memory with fixed
strides, while Inductor still holds it as an unrealized pointwise cast (its elements as a formula).
``_scaled_mm``'s lowering realizes its input in place; the Triton kernel's lowering
(``triton_kernel_default_layout_constraint="needs_fixed_stride_order"``) instead copies an
unrealized input (``ExternKernel.require_strides`` → ``copy_input``) and leaves the original
unrealized. The Triton kernel lowers first, so the cast kernel stores the tensor twice: once for
the transpose, once more when ``_scaled_mm`` realizes the original: one extra byte per element of
every transposed tensor, about 240 MB a layer of HF Llama-1B. Stored once, the Llama's FP8 step took
85.3-85.8 ms of GPU time on the H200, against 87.4-87.8 before (docs/benchmarks.md, twenty-third session).
``benchmarks/lowering_probe.py`` shows both lowerings on a machine without a GPU.

Reading the source through ``as_strided`` with its own size and strides fixes the order: Inductor's
``as_strided`` lowering realizes its input in place and returns a view of that buffer, and it runs
right after the cast, before either reader. The view changes no value.

Before (post-grad graph, CUDA; ``K`` is ``transpose_kernel``'s index in Triton's side table)::

    g_fp8 = torch.ops.prims.convert_element_type.default(clamp, torch.float8_e5m2)
    empty = torch.ops.aten.empty.memory_format([512, 256], dtype=torch.float8_e5m2, device=cuda)
    wrapper = triton_kernel_wrapper_functional(kernel_idx=K, ..., kwargs={'src': g_fp8, 'dst': empty}, ...)
    mm = torch.ops.aten._scaled_mm.default(g_fp8, w_t, ...)

After::

    g_fp8 = torch.ops.prims.convert_element_type.default(clamp, torch.float8_e5m2)
    g_fp8_stored = torch.ops.aten.as_strided.default(g_fp8, [256, 512], [512, 1])
    empty = ...
    wrapper = triton_kernel_wrapper_functional(kernel_idx=K, ..., kwargs={'src': g_fp8_stored, 'dst': empty}, ...)
    mm = torch.ops.aten._scaled_mm.default(g_fp8, w_t, ...)

A source that is a graph input (stored already) or a view (``graph_utils.may_store``) is left
alone, and so are other Triton kernels. In
a graph compiled for dynamic shapes, a symbolic size or stride of the view is read off the source
(``sym_size`` / ``sym_stride``).
"""

import torch.fx as fx

from flash_inductor import fp8_transpose, graph_utils


def fp8_transpose_source_pass(graph: fx.Graph, ctx) -> tuple[fx.Graph, list[str]]:
    if ctx.options.fp8 is None:
        return graph, []
    calls = [c for c in fp8_transpose.transpose_calls(graph) if graph_utils.may_store(c.kwargs["kwargs"]["src"])]
    if not calls:
        return graph, []
    new_graph, copy_of = graph_utils.copy_graph(graph)
    stored = {}  # source in graph -> its as_strided view in new_graph
    for old_call in calls:
        old_src = old_call.kwargs["kwargs"]["src"]
        if old_src not in stored:
            stored[old_src] = graph_utils.stored_view(new_graph, copy_of[old_src])
        call = copy_of[old_call]
        call.update_kwarg("kwargs", {**call.kwargs["kwargs"], "src": stored[old_src]})
    return new_graph, [src.name for src in stored]
