"""passes/fp8_scales_stored.py: on a hand-made post-grad graph (the rewrite), and through Inductor's
C++ code on the CPU (the same bits with and without it). What it saves is GPU time: Inductor's Triton
code read on the CPU (tests/test_fp8_layer_kernels.py) and the H100's profile (docs/benchmarks.md).
Regenerate the expectation after an intended change with ``EXPECTTEST_ACCEPT=1 pytest tests/test_fp8_scales_stored.py``."""

import expecttest
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_inductor
from flash_inductor.options import Options
from flash_inductor.passes.fp8_scales_stored import fp8_scales_stored_pass
from flash_inductor.pipeline import PassContext
from helpers import assert_same_bits

aten, prims = torch.ops.aten, torch.ops.prims
CONTEXT = PassContext({}, set(), Options(fp8="rowwise"))


def _code(graph):
    return "\n".join(line.strip() for line in graph.python_code("self").src.splitlines() if line.strip())


class TestFp8ScalesStored(expecttest.TestCase):
    def test_each_fp8_casts_computed_scale_is_read_through_a_view_that_stores_it(self):
        graph = fx.Graph()
        fake = FakeTensorMode()

        def add(target, *args):
            node = graph.call_function(target, args)
            with fake:
                node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
            return node

        def cast(x, scale, dtype=torch.float8_e4m3fn):
            return add(prims.convert_element_type.default, add(aten.clamp_max.default, add(
                aten.clamp_min.default, add(aten.mul.Tensor, x, scale), -448.0), 448.0), dtype)

        x, delayed, y = graph.placeholder("x"), graph.placeholder("delayed_scale"), graph.placeholder("y")
        with fake:
            x.meta["val"], delayed.meta["val"], y.meta["val"] = torch.empty(64, 32), torch.empty(()), torch.empty(65, 32)
        column_scale = add(aten.reciprocal.default, add(aten.amax.default, add(aten.abs.default, x), [0], True))
        by_columns = cast(x, add(aten.permute.default, add(aten.permute.default, column_scale, [1, 0]), [1, 0]))
        tensor_scale = add(aten.reciprocal.default, add(aten.amax.default, add(aten.abs.default, x)))
        by_tensor = cast(x, tensor_scale, torch.float8_e5m2)
        inverse = add(aten.reciprocal.default, tensor_scale)  # what _scaled_mm takes: reads the stored scale too
        by_delayed = cast(x, delayed)  # a graph input: stored already
        not_a_cast = add(aten.mul.Tensor, x, column_scale)  # reads the stored scale, is left as it is
        same_size = cast(x, add(aten.abs.default, x))  # no scale broadcast: left alone
        row_scale = add(aten.reciprocal.default, add(aten.amax.default, add(aten.abs.default, y), [1], True))
        by_slice = cast(x, add(aten.slice.Tensor, row_scale, 0, 1, 65))  # read at an offset: left alone
        graph.output((by_columns, by_tensor, inverse, by_delayed, not_a_cast, same_size, by_slice))

        new_graph, stored = fp8_scales_stored_pass(graph, CONTEXT)
        self.assertEqual(stored, ["reciprocal_default", "reciprocal_default_1"])
        self.assertExpectedInline(_code(new_graph), """\
def forward(self, x, delayed_scale, y):
abs_default = torch.ops.aten.abs.default(x)
amax_default = torch.ops.aten.amax.default(abs_default, [0], True);  abs_default = None
reciprocal_default = torch.ops.aten.reciprocal.default(amax_default);  amax_default = None
reciprocal_default_stored = torch.ops.aten.as_strided.default(reciprocal_default, [1, 32], [32, 1]);  reciprocal_default = None
permute_default = torch.ops.aten.permute.default(reciprocal_default_stored, [1, 0])
permute_default_1 = torch.ops.aten.permute.default(permute_default, [1, 0]);  permute_default = None
mul_tensor = torch.ops.aten.mul.Tensor(x, permute_default_1);  permute_default_1 = None
clamp_min_default = torch.ops.aten.clamp_min.default(mul_tensor, -448.0);  mul_tensor = None
clamp_max_default = torch.ops.aten.clamp_max.default(clamp_min_default, 448.0);  clamp_min_default = None
convert_element_type_default = torch.ops.prims.convert_element_type.default(clamp_max_default, torch.float8_e4m3fn);  clamp_max_default = None
abs_default_1 = torch.ops.aten.abs.default(x)
amax_default_1 = torch.ops.aten.amax.default(abs_default_1);  abs_default_1 = None
reciprocal_default_1 = torch.ops.aten.reciprocal.default(amax_default_1);  amax_default_1 = None
reciprocal_default_1_stored = torch.ops.aten.as_strided.default(reciprocal_default_1, [], []);  reciprocal_default_1 = None
mul_tensor_1 = torch.ops.aten.mul.Tensor(x, reciprocal_default_1_stored)
clamp_min_default_1 = torch.ops.aten.clamp_min.default(mul_tensor_1, -448.0);  mul_tensor_1 = None
clamp_max_default_1 = torch.ops.aten.clamp_max.default(clamp_min_default_1, 448.0);  clamp_min_default_1 = None
convert_element_type_default_1 = torch.ops.prims.convert_element_type.default(clamp_max_default_1, torch.float8_e5m2);  clamp_max_default_1 = None
reciprocal_default_2 = torch.ops.aten.reciprocal.default(reciprocal_default_1_stored);  reciprocal_default_1_stored = None
mul_tensor_2 = torch.ops.aten.mul.Tensor(x, delayed_scale);  delayed_scale = None
clamp_min_default_2 = torch.ops.aten.clamp_min.default(mul_tensor_2, -448.0);  mul_tensor_2 = None
clamp_max_default_2 = torch.ops.aten.clamp_max.default(clamp_min_default_2, 448.0);  clamp_min_default_2 = None
convert_element_type_default_2 = torch.ops.prims.convert_element_type.default(clamp_max_default_2, torch.float8_e4m3fn);  clamp_max_default_2 = None
mul_tensor_3 = torch.ops.aten.mul.Tensor(x, reciprocal_default_stored);  reciprocal_default_stored = None
abs_default_2 = torch.ops.aten.abs.default(x)
mul_tensor_4 = torch.ops.aten.mul.Tensor(x, abs_default_2);  abs_default_2 = None
clamp_min_default_3 = torch.ops.aten.clamp_min.default(mul_tensor_4, -448.0);  mul_tensor_4 = None
clamp_max_default_3 = torch.ops.aten.clamp_max.default(clamp_min_default_3, 448.0);  clamp_min_default_3 = None
convert_element_type_default_3 = torch.ops.prims.convert_element_type.default(clamp_max_default_3, torch.float8_e4m3fn);  clamp_max_default_3 = None
abs_default_3 = torch.ops.aten.abs.default(y);  y = None
amax_default_2 = torch.ops.aten.amax.default(abs_default_3, [1], True);  abs_default_3 = None
reciprocal_default_3 = torch.ops.aten.reciprocal.default(amax_default_2);  amax_default_2 = None
slice_tensor = torch.ops.aten.slice.Tensor(reciprocal_default_3, 0, 1, 65);  reciprocal_default_3 = None
mul_tensor_5 = torch.ops.aten.mul.Tensor(x, slice_tensor);  x = slice_tensor = None
clamp_min_default_4 = torch.ops.aten.clamp_min.default(mul_tensor_5, -448.0);  mul_tensor_5 = None
clamp_max_default_4 = torch.ops.aten.clamp_max.default(clamp_min_default_4, 448.0);  clamp_min_default_4 = None
convert_element_type_default_4 = torch.ops.prims.convert_element_type.default(clamp_max_default_4, torch.float8_e4m3fn);  clamp_max_default_4 = None
return (convert_element_type_default, convert_element_type_default_1, reciprocal_default_2, convert_element_type_default_2, mul_tensor_3, convert_element_type_default_3, convert_element_type_default_4)""")  # noqa: E501
        new_graph.lint()
        again, none = fp8_scales_stored_pass(new_graph, CONTEXT)  # every scale stored now
        self.assertIs(again, new_graph)
        self.assertEqual(none, [])

    def test_a_symbolic_row_scale_is_stored_with_its_size_read_off_the_scale(self):
        """A token count compiled as a symbol: the stored view's size is read off the scale itself
        (reading it off the view would use the view before it is defined)."""
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        from flash_inductor.formats import fp8

        def cast_rows(x):
            scale = torch.reciprocal(x.abs().amax(1, keepdim=True))
            return fp8.cast_to_fp8(x, scale, torch.float8_e4m3fn), scale.reshape(-1)  # the scale read again

        graph = make_fx(cast_rows, decomposition_table=select_decomp_table(), tracing_mode="symbolic")(
            torch.randn(48, 32)).graph
        new_graph, stored = fp8_scales_stored_pass(graph, CONTEXT)
        self.assertEqual(stored, ["reciprocal"])
        new_graph.lint()
        self.assertExpectedInline(_code(new_graph), """\
def forward(self, x_1):
abs_1 = torch.ops.aten.abs.default(x_1)
amax = torch.ops.aten.amax.default(abs_1, [1], True);  abs_1 = None
reciprocal = torch.ops.aten.reciprocal.default(amax);  amax = None
sym_size_int = torch.ops.aten.sym_size.int(reciprocal, 0)
reciprocal_stored = torch.ops.aten.as_strided.default(reciprocal, [sym_size_int, 1], [1, 1]);  reciprocal = sym_size_int = None
mul = torch.ops.aten.mul.Tensor(x_1, reciprocal_stored);  x_1 = None
clamp_min = torch.ops.aten.clamp_min.default(mul, -448.0);  mul = None
clamp_max = torch.ops.aten.clamp_max.default(clamp_min, 448.0);  clamp_min = None
convert_element_type = torch.ops.prims.convert_element_type.default(clamp_max, torch.float8_e4m3fn);  clamp_max = None
view = torch.ops.aten.view.default(reciprocal_stored, [-1]);  reciprocal_stored = None
return (convert_element_type, view)""")  # noqa: E501


@pytest.fixture(scope="module")
def fp8_steps_with_and_without_the_pass():
    """{fp8: (with the pass, without)}: a linear's output and gradients through Inductor on the CPU."""
    torch.manual_seed(0)
    layer = nn.Linear(96, 80, bias=False).bfloat16()
    x = (torch.randn(48, 96) * torch.logspace(-3, 3, 96)).bfloat16().requires_grad_()  # columns apart
    g = torch.randn(48, 80).bfloat16()
    runs = {}
    for fp8 in ("tensorwise", "rowwise"):
        for disable in ((), ("fp8_scales_stored",)):
            torch._dynamo.reset()
            x.grad = layer.weight.grad = None
            y = flash_inductor.compile(layer, fp8=fp8, disable=disable, fp8_min_weight_numel=0)(x)
            y.backward(g)
            runs.setdefault(fp8, []).append(dict(y=y.detach(), x_grad=x.grad, weight_grad=layer.weight.grad))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
def test_stored_scales_keep_every_bit_through_inductor(fp8, fp8_steps_with_and_without_the_pass):
    with_pass, without = fp8_steps_with_and_without_the_pass[fp8]
    assert_same_bits(with_pass, without)
