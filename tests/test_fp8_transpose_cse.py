"""passes/fp8_transpose_cse.py on a hand-made post-grad graph (Triton, and so the real kernel, is
absent on the CPU; tests/test_gpu.py counts the launches on the H200). Regenerate the expectation
after an intended change with ``EXPECTTEST_ACCEPT=1 pytest tests/test_fp8_transpose_cse.py``."""

import operator
import re

import expecttest
import torch
import torch.fx as fx
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional

from flash_inductor import fp8_transpose
from flash_inductor.options import Options
from flash_inductor.passes.fp8_transpose_cse import fp8_transpose_cse_pass
from flash_inductor.pipeline import PassContext


class TestFp8TransposeCse(expecttest.TestCase):
    def test_repeated_transposes_of_one_fp8_tensor_become_one(self):
        transpose_kernel, other_kernel = object(), object()  # stand for Triton kernels
        self._patch_kernel(transpose_kernel)
        graph = fx.Graph()
        x, y = graph.placeholder("x_fp8"), graph.placeholder("y_fp8")

        def call(kernel, src, shape=(64, 32), dst_users=1):
            dst = graph.call_function(torch.ops.aten.empty.memory_format, (list(shape),), {"dtype": torch.float8_e4m3fn})
            for _ in range(dst_users - 1):
                graph.call_function(torch.ops.aten.abs.default, (dst,))
            wrapper = graph.call_function(triton_kernel_wrapper_functional, kwargs={
                "kernel_idx": kernel_side_table.add_kernel(kernel),
                "constant_args_idx": kernel_side_table.add_constant_args({"rows": shape[1], "cols": shape[0], "BLOCK": 64}),
                "grid": [(1, 1, 1)], "tma_descriptor_metadata": {}, "kwargs": {"src": src, "dst": dst},
                "tensors_to_clone": ["dst"]})
            return graph.call_function(operator.getitem, (wrapper, "dst"))

        outputs = [
            call(transpose_kernel, x),  # kept
            call(transpose_kernel, x),  # merged into the first
            call(transpose_kernel, y),  # another source: kept
            call(transpose_kernel, x, shape=(32, 64)),  # other constants: kept
            call(other_kernel, x),  # another kernel: kept
            call(transpose_kernel, x, dst_users=2),  # its buffer is read elsewhere: kept
            call(transpose_kernel, x),  # merged into the first
        ]
        graph.output(tuple(outputs))
        new_graph, merged = fp8_transpose_cse_pass(graph, PassContext({}, set(), Options(fp8="tensorwise")))
        self.assertEqual(merged, ["triton_kernel_wrapper_functional_1", "triton_kernel_wrapper_functional_6"])
        code = "\n".join(line.strip() for line in new_graph.python_code("self").src.splitlines() if line.strip())
        # The side table is the process's: its indices depend on what ran before.
        code = re.sub(r"constant_args_idx = \d+", "constant_args_idx = C", code)
        for kernel, name in ((transpose_kernel, "TRANSPOSE"), (other_kernel, "OTHER")):
            code = code.replace(f"kernel_idx = {kernel_side_table.add_kernel(kernel)},", f"kernel_idx = {name},")
        self.assertExpectedInline(code, """\
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
        unchanged, none = fp8_transpose_cse_pass(graph, PassContext({}, set(), Options()))  # fp8 off
        self.assertIs(unchanged, graph)
        self.assertEqual(none, [])

    def _patch_kernel(self, kernel):
        original = fp8_transpose._kernel
        fp8_transpose._kernel = lambda: kernel
        self.addCleanup(setattr, fp8_transpose, "_kernel", original)
