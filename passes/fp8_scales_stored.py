"""FP8 scales stored: each FP8 scale is computed once and stored, not once per element it scales.

An FP8 cast ``fp8(clamp(x * scale, -max, max))`` multiplies by a scale that is a small pointwise
formula of an amax (``formats/fp8.scale_from_amax``: about 25 operations for a power-of-two scale,
an fp64 division for a per-tensor one). Inductor inlines a pointwise result into every kernel that
reads it unless something makes it store the result, and a scale has nothing that does: each cast
kernel recomputes its scale for every element it casts. Row-wise scaling's casts by columns are the
worst case: a column's scale is recomputed for each of its 8192 elements, and the Llama's MLP
backward kernel casts three tensors by columns, so it computed three scales per element (on an
H100 that kernel took 372 µs a layer, 335 µs with the scales stored: docs/benchmarks.md, forty-first
session).

The scale is read through ``as_strided`` with its own size and strides
(``graph_utils.read_through_stored_view``): Inductor's lowering of it stores the scale (in the kernel
that reduces its amax, as that kernel's epilogue) and the casts load it. Nothing is recomputed or
rounded differently, so the bits stay the same; the pass only changes where the scale is computed.

Before (post-grad graph; a column scale, read transposed)::

    amax = torch.ops.aten.amax.default(abs_1, [1], True)
    ...
    scale = torch.ops.aten.where.self(finite, power_of_two, where)
    scale_t = torch.ops.aten.permute.default(scale, [1, 0])
    mul = torch.ops.aten.mul.Tensor(x_f32, scale_t)
    x_fp8 = torch.ops.prims.convert_element_type.default(clamp_max(clamp_min(mul, -448.0), 448.0), torch.float8_e4m3fn)

After::

    scale = torch.ops.aten.where.self(finite, power_of_two, where)
    scale_stored = torch.ops.aten.as_strided.default(scale, [N, 1], [1, 1])
    scale_t = torch.ops.aten.permute.default(scale_stored, [1, 0])
    mul = torch.ops.aten.mul.Tensor(x_f32, scale_t)
    ...

Every reader of the scale (the cast, the inverse scale ``_scaled_mm`` takes) reads the stored one.
A scale that is a graph input (delayed scaling's, stored already) is left alone, and so is one
read through a view other than those above (a slice): ``graph_utils.may_store``.
"""

import torch
import torch.fx as fx

from flash_inductor import graph_utils

aten, prims = torch.ops.aten, torch.ops.prims
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_CLAMPS = (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default)
# Views a scale is read through (a column scale transposed, a tensor scale broadcast).
_VIEWS = (aten.permute.default, aten.view.default, aten.expand.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.t.default)


def fp8_scales_stored_pass(graph: fx.Graph, ctx) -> tuple[fx.Graph, list[str]]:
    scales = list(dict.fromkeys(s for s in map(_cast_scale, graph.nodes) if s is not None))
    if not scales:
        return graph, []
    new_graph, copy_of = graph_utils.copy_graph(graph)
    for old in scales:
        graph_utils.read_through_stored_view(new_graph, copy_of[old])
    return new_graph, [s.name for s in scales]


def _cast_scale(node):
    """The node that computes the scale of ``node``, an FP8 cast ``fp8(clamp(x * scale))`` (through
    the views it is read by), where that scale is computed in the graph and not stored already; or None."""
    if node.target is not prims.convert_element_type.default or node.args[1] not in _FP8_DTYPES:
        return None
    product = node.args[0]
    while isinstance(product, fx.Node) and product.target in _CLAMPS:
        product = product.args[0]
    if not isinstance(product, fx.Node) or product.target is not aten.mul.Tensor:
        return None
    operands = [a for a in product.args if isinstance(a, fx.Node) and "val" in a.meta]
    if len(operands) != 2:
        return None
    # The scale is the operand broadcast over the other: the smaller one.
    x, scale = sorted(operands, key=lambda a: a.meta["val"].numel(), reverse=True)
    if scale.meta["val"].numel() >= x.meta["val"].numel():
        return None
    while scale.target in _VIEWS:
        scale = scale.args[0]
    return scale if graph_utils.may_store(scale) else None
