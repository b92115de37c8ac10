"""passes/fp8_transpose_cse.py and passes/fp8_transpose_source.py on hand-made post-grad graphs
(Triton, and so the real kernel, is absent on the CPU; tests/test_gpu.py counts the launches and the
stored buffers on the H200). Regenerate the expectations after an intended change with
``EXPECTTEST_ACCEPT=1 pytest tests/test_fp8_transpose_passes.py``."""

import operator
import re

import expecttest
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from flash_inductor import fp8_transpose
from flash_inductor.options import Options
from flash_inductor.passes.fp8_transpose_cse import fp8_transpose_cse_pass
from flash_inductor.passes.fp8_transpose_source import fp8_transpose_source_pass
from flash_inductor.pipeline import PassContext

FP8_ON, FP8_OFF = (PassContext({}, set(), Options(fp8=fp8)) for fp8 in ("tensorwise", None))


def _call(graph, kernel, src, shape=(64, 32), dst_users=1, scale=None):
    """``kernel(src, dst=empty(shape))`` as AOTAutograd writes a ``transpose_fp8`` call (with a tensor
    ``scale``, as its casting form); its ``dst``."""
    dst = graph.call_function(torch.ops.aten.empty.memory_format, (list(shape),), {"dtype": torch.float8_e4m3fn})
    for _ in range(dst_users - 1):
        graph.call_function(torch.ops.aten.abs.default, (dst,))
    wrapper = graph.call_function(triton_kernel_wrapper_functional, kwargs={
        "kernel_idx": kernel_side_table.add_kernel(kernel),
        "constant_args_idx": kernel_side_table.add_constant_args({"rows": shape[1], "cols": shape[0], "BLOCK": 64}),
        "grid": [(1, 1, 1)], "tma_descriptor_metadata": {},
        "kwargs": {"src": src, **({} if scale is None else {"scale": scale}), "dst": dst},
        "tensors_to_clone": ["dst"]})
    return graph.call_function(operator.getitem, (wrapper, "dst"))


def _code(graph, kernels):
    """``graph``'s code, one statement a line, the process-dependent side-table indices named."""
    code = "\n".join(line.strip() for line in graph.python_code("self").src.splitlines() if line.strip())
    code = re.sub(r"constant_args_idx = \d+", "constant_args_idx = C", code)
    for kernel, name in kernels:
        code = code.replace(f"kernel_idx = {kernel_side_table.add_kernel(kernel)},", f"kernel_idx = {name},")
    return code


class TestFp8TransposeCse(expecttest.TestCase):
    def test_repeated_transposes_of_one_fp8_tensor_become_one(self):
        transpose_kernel, other_kernel = object(), object()  # stand for Triton kernels
        self._patch_kernel(transpose_kernel)
        graph = fx.Graph()
        x, y = graph.placeholder("x_fp8"), graph.placeholder("y_fp8")
        outputs = [
            _call(graph, transpose_kernel, x),  # kept
            _call(graph, transpose_kernel, x),  # merged into the first
            _call(graph, transpose_kernel, y),  # another source: kept
            _call(graph, transpose_kernel, x, shape=(32, 64)),  # other constants: kept
            _call(graph, other_kernel, x),  # another kernel: kept
            _call(graph, transpose_kernel, x, dst_users=2),  # its buffer is read elsewhere: kept
            _call(graph, transpose_kernel, x),  # merged into the first
        ]
        graph.output(tuple(outputs))
        new_graph, merged = fp8_transpose_cse_pass(graph, FP8_ON)
        self.assertEqual(merged, ["triton_kernel_wrapper_functional_1", "triton_kernel_wrapper_functional_6"])
        self.assertExpectedInline(_code(new_graph, ((transpose_kernel, "TRANSPOSE"), (other_kernel, "OTHER"))), """\
def forward(self, x_fp8, y_fp8):
empty_memory_format = torch.ops.aten.empty.memory_format([64, 32], dtype = torch.float8_e4m3fn)
triton_kernel_wrapper_functional = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = TRANSPOSE, constant_args_idx = C, grid = [(1, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'src': x_fp8, 'dst': empty_memory_format}, tensors_to_clone = ['dst']);  empty_memory_format = None
getitem = triton_kernel_wrapper_functional['dst'];  triton_kernel_wrapper_functional = None
empty_memory_format_2 = torch.ops.aten.empty.memory_format([64, 32], dtype = torch.float8_e4m3fn)
triton_kernel_wrapper_functional_2 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = TRANSPOSE, constant_args_idx = C, grid = [(1, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'src': y_fp8, 'dst': empty_memory_format_2}, tensors_to_clone = ['dst']);  y_fp8 = empty_memory_format_2 = None
getitem_2 = triton_kernel_wrapper_functional_2['dst'];  triton_kernel_wrapper_functional_2 = None
empty_memory_format_3 = torch.ops.aten.empty.memory_format([32, 64], dtype = torch.float8_e4m3fn)
triton_kernel_wrapper_functional_3 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = TRANSPOSE, constant_args_idx = C, grid = [(1, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'src': x_fp8, 'dst': empty_memory_format_3}, tensors_to_clone = ['dst']);  empty_memory_format_3 = None
getitem_3 = triton_kernel_wrapper_functional_3['dst'];  triton_kernel_wrapper_functional_3 = None
empty_memory_format_4 = torch.ops.aten.empty.memory_format([64, 32], dtype = torch.float8_e4m3fn)
triton_kernel_wrapper_functional_4 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = OTHER, constant_args_idx = C, grid = [(1, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'src': x_fp8, 'dst': empty_memory_format_4}, tensors_to_clone = ['dst']);  empty_memory_format_4 = None
getitem_4 = triton_kernel_wrapper_functional_4['dst'];  triton_kernel_wrapper_functional_4 = None
empty_memory_format_5 = torch.ops.aten.empty.memory_format([64, 32], dtype = torch.float8_e4m3fn)
abs_default = torch.ops.aten.abs.default(empty_memory_format_5);  abs_default = None
triton_kernel_wrapper_functional_5 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = TRANSPOSE, constant_args_idx = C, grid = [(1, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'src': x_fp8, 'dst': empty_memory_format_5}, tensors_to_clone = ['dst']);  x_fp8 = empty_memory_format_5 = None
getitem_5 = triton_kernel_wrapper_functional_5['dst'];  triton_kernel_wrapper_functional_5 = None
return (getitem, getitem, getitem_2, getitem_3, getitem_4, getitem_5, getitem)""")
        unchanged, none = fp8_transpose_cse_pass(graph, FP8_OFF)
        self.assertIs(unchanged, graph)
        self.assertEqual(none, [])

    def test_casting_transposes_merge_only_with_the_same_scales(self):
        transpose_kernel = object()
        self._patch_kernel(transpose_kernel)
        graph = fx.Graph()
        x, s, t = graph.placeholder("x_fp8"), graph.placeholder("s"), graph.placeholder("t")
        outputs = [
            _call(graph, transpose_kernel, x, scale=s),  # kept
            _call(graph, transpose_kernel, x),  # no scales: kept
            _call(graph, transpose_kernel, x, scale=t),  # other scales: kept
            _call(graph, transpose_kernel, x, scale=s),  # merged into the first
        ]
        graph.output(tuple(outputs))
        new_graph, merged = fp8_transpose_cse_pass(graph, FP8_ON)
        self.assertEqual(merged, ["triton_kernel_wrapper_functional_3"])
        returned = [n.name for n in new_graph.output_node().args[0]]
        self.assertEqual(returned, ["getitem", "getitem_1", "getitem_2", "getitem"])

    def test_a_cast_that_is_transposed_is_read_through_a_view_that_stores_it_once(self):
        transpose_kernel, other_kernel = object(), object()
        self._patch_kernel(transpose_kernel)
        graph = fx.Graph()
        g, x_fp8 = graph.placeholder("g"), graph.placeholder("x_fp8")
        with FakeTensorMode():
            g.meta["val"] = torch.empty(32, 64, dtype=torch.bfloat16)
            x_fp8.meta["val"] = torch.empty(32, 64, dtype=torch.float8_e4m3fn)
            g_fp8 = graph.call_function(torch.ops.prims.convert_element_type.default, (g, torch.float8_e5m2))
            g_fp8.meta["val"] = torch.empty(32, 64, dtype=torch.float8_e5m2)
        mm_operand = graph.call_function(torch.ops.aten.abs.default, (g_fp8,))  # stands for _scaled_mm
        outputs = [
            _call(graph, transpose_kernel, g_fp8),  # reads the view
            _call(graph, transpose_kernel, g_fp8),  # reads the same view
            _call(graph, transpose_kernel, x_fp8),  # a graph input: stored already
            _call(graph, other_kernel, g_fp8),  # another kernel: left alone
        ]
        graph.output((mm_operand, *outputs))
        new_graph, stored = fp8_transpose_source_pass(graph, FP8_ON)
        self.assertEqual(stored, ["convert_element_type_default"])
        self.assertExpectedInline(_code(new_graph, ((transpose_kernel, "TRANSPOSE"), (other_kernel, "OTHER"))), """\
def forward(self, g, x_fp8):
convert_element_type_default = torch.ops.prims.convert_element_type.default(g, torch.float8_e5m2);  g = None
convert_element_type_default_stored = torch.ops.aten.as_strided.default(convert_element_type_default, [32, 64], [64, 1])
abs_default = torch.ops.aten.abs.default(convert_element_type_default)
empty_memory_format = torch.ops.aten.empty.memory_format([64, 32], dtype = torch.float8_e4m3fn)
triton_kernel_wrapper_functional = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = TRANSPOSE, constant_args_idx = C, grid = [(1, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'src': convert_element_type_default_stored, 'dst': empty_memory_format}, tensors_to_clone = ['dst']);  empty_memory_format = None
getitem = triton_kernel_wrapper_functional['dst'];  triton_kernel_wrapper_functional = None
empty_memory_format_1 = torch.ops.aten.empty.memory_format([64, 32], dtype = torch.float8_e4m3fn)
triton_kernel_wrapper_functional_1 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = TRANSPOSE, constant_args_idx = C, grid = [(1, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'src': convert_element_type_default_stored, 'dst': empty_memory_format_1}, tensors_to_clone = ['dst']);  convert_element_type_default_stored = empty_memory_format_1 = None
getitem_1 = triton_kernel_wrapper_functional_1['dst'];  triton_kernel_wrapper_functional_1 = None
empty_memory_format_2 = torch.ops.aten.empty.memory_format([64, 32], dtype = torch.float8_e4m3fn)
triton_kernel_wrapper_functional_2 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = TRANSPOSE, constant_args_idx = C, grid = [(1, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'src': x_fp8, 'dst': empty_memory_format_2}, tensors_to_clone = ['dst']);  x_fp8 = empty_memory_format_2 = None
getitem_2 = triton_kernel_wrapper_functional_2['dst'];  triton_kernel_wrapper_functional_2 = None
empty_memory_format_3 = torch.ops.aten.empty.memory_format([64, 32], dtype = torch.float8_e4m3fn)
triton_kernel_wrapper_functional_3 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = OTHER, constant_args_idx = C, grid = [(1, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'src': convert_element_type_default, 'dst': empty_memory_format_3}, tensors_to_clone = ['dst']);  convert_element_type_default = empty_memory_format_3 = None
getitem_3 = triton_kernel_wrapper_functional_3['dst'];  triton_kernel_wrapper_functional_3 = None
return (abs_default, getitem, getitem_1, getitem_2, getitem_3)""")
        view = next(n for n in new_graph.nodes if n.target is torch.ops.aten.as_strided.default)
        assert (view.meta["val"].shape, view.meta["val"].stride()) == ((32, 64), (64, 1))
        again, none = fp8_transpose_source_pass(new_graph, FP8_ON)  # every source read through a view now
        self.assertIs(again, new_graph)
        self.assertEqual(none, [])
        dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])  # a graph compiled
        g_fp8.meta["val"] = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(  # for dynamic shapes
            torch.empty(32, 64, dtype=torch.float8_e5m2), source=ConstantSource("g"), symbolic_context=dynamic)
        dynamic_graph, stored = fp8_transpose_source_pass(graph, FP8_ON)
        self.assertEqual(stored, ["convert_element_type_default"])
        view = next(n for n in dynamic_graph.nodes if n.target is torch.ops.aten.as_strided.default)
        (tokens, columns), strides = view.args[1:]
        assert (tokens.target, tokens.args[1], columns, strides) == (torch.ops.aten.sym_size.int, 0, 64, [64, 1])
        assert tokens.args[0] is view.args[0] and str(tokens.meta["val"]) == str(g_fp8.meta["val"].shape[0])  # s<n>
        dynamic_graph.lint()  # each node after what it reads
        unchanged, none = fp8_transpose_source_pass(graph, FP8_OFF)
        self.assertIs(unchanged, graph)
        self.assertEqual(none, [])

    def _patch_kernel(self, kernel):
        original = fp8_transpose._kernel
        fp8_transpose._kernel = lambda: kernel
        self.addCleanup(setattr, fp8_transpose, "_kernel", original)
