"""Row-wise FP8 scaling (option ``fp8="rowwise"``, ``fp8_linear(..., rowwise=True)``) on the CPU,
against an fp64 reference written from the recipe (flash_inductor/fp8_linear.py's docstring): every
GEMM operand in e4m3, one power-of-two scale per row along the dimension the GEMM sums over."""

import math

import pytest
import torch
import torch.nn as nn

import flash_inductor
from flash_inductor.formats import fp8
from flash_inductor.fp8_linear import fp8_linear
from helpers import EAGER, decisions_of

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def reference_rows(t):
    """``t`` (2-D) as the recipe stores it, dequantized, in fp64: each row scaled by the power of two
    ``2 ** floor(log2(448 / max |row|))``, rounded to e4m3 (saturating at 448), divided back."""
    t = t.double()
    amax = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = torch.tensor([[2.0 ** math.floor(math.log2(448 / a))] for a in amax.flatten().tolist()], dtype=torch.float64)
    return (t * scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() / scale


def reference_rows_as_one_scale(t):
    """``t`` (2-D) as ``tensorwise_weight_gradient`` gives it to the weight gradient, dequantized, in fp64:
    cast by rows (``reference_rows``' e4m3 values), each row then multiplied by the smallest row
    scale over its own and rounded to e4m3 again; divided back by that one scale."""
    t = t.double()
    amax = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = torch.tensor([[2.0 ** math.floor(math.log2(448 / a))] for a in amax.flatten().tolist()], dtype=torch.float64)
    rows = (t * scale).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    smallest = scale.min()
    return (rows * (smallest / scale)).to(torch.float8_e4m3fn).double() / smallest


def reference_gemm(a, b):
    """``a @ b`` of the recipe: ``a`` by rows and ``b`` by columns (the dimension summed), in fp64."""
    return reference_rows(a) @ reference_rows(b.t()).t()


def assert_within_bf16(actual, expected, magnitude, rounded=(), accumulation=2.0**-20):
    """``actual`` (bf16) is ``expected`` rounded to bf16, give or take the summation's error,
    ``accumulation`` (fp32's, by default) of ``magnitude`` (the sum of the products' magnitudes), and
    a bf16 rounding of each of the ``rounded`` intermediate values (the GEMM's output before a bias
    is added)."""
    error = (actual.double() - expected).abs()
    bound = 2.0**-8 * (expected.abs() + sum(t.abs() for t in rounded)) + accumulation * magnitude + 1e-30
    assert (error <= bound).all(), f"{(error / bound).max().item():.2f}x the bound"


@pytest.mark.parametrize("tensorwise_weight_gradient", [False, True], ids=["dw-rowwise", "dw-one-scale"])
@pytest.mark.parametrize("n, k, bias", [(96, 64, True), (1000, 64, False), (64, 1000, True)],
                         ids=["96x64-bias", "out-dim-1000-padded", "in-dim-1000-padded-bias"])
def test_rowwise_gemms_match_the_fp64_reference_of_the_recipe(n, k, bias, tensorwise_weight_gradient):
    """Forward, input gradient and weight gradient of ``fp8_linear(rowwise=True)``: each GEMM's
    operands quantized by rows along the summed dimension (x and w along k; dy and w along n; dy and
    x along the tokens), within bf16 rounding of the fp64 reference, padded dims included. With
    ``tensorwise_weight_gradient`` the weight gradient's operands are dy's and x's row casts with one
    scale each (``reference_rows_as_one_scale``); the rows span 10^4, so most of them are rescaled."""
    torch.manual_seed(0)
    x = (torch.randn(3, 16, k) * torch.logspace(-2, 2, 16)[:, None]).bfloat16().requires_grad_()  # rows of other magnitudes
    w = (torch.randn(n, k) * 0.05).bfloat16().requires_grad_()
    b = torch.randn(n).bfloat16().requires_grad_() if bias else None
    y = fp8_linear(x, w, b, rowwise=True, tensorwise_weight_gradient=tensorwise_weight_gradient)
    g = torch.randn(y.shape).bfloat16()
    y.backward(g)

    x2, g2 = x.detach().reshape(-1, k), g.reshape(-1, n)
    product = reference_gemm(x2, w.detach().t())
    magnitude = reference_rows(x2).abs() @ reference_rows(w.detach()).abs().t()
    assert y.shape == (3, 16, n) and y.dtype == torch.bfloat16
    if bias:
        assert_within_bf16(y.reshape(-1, n), product + b.detach().double(), magnitude, rounded=[product])
    else:
        assert_within_bf16(y.reshape(-1, n), product, magnitude)
    assert_within_bf16(x.grad.reshape(-1, k), reference_gemm(g2, w.detach()),
                       reference_rows(g2).abs() @ reference_rows(w.detach().t()).abs().t())
    if tensorwise_weight_gradient:
        gt, xt = reference_rows_as_one_scale(g2).t(), reference_rows_as_one_scale(x2)
        assert_within_bf16(w.grad, gt @ xt, gt.abs() @ xt.abs())
    else:
        assert_within_bf16(w.grad, reference_gemm(g2.t(), x2), reference_rows(g2.t()).abs() @ reference_rows(x2.t()).abs().t())
    if bias:
        torch.testing.assert_close(b.grad.double(), g2.double().sum(0), rtol=2.0**-8, atol=1e-6)


def test_rowwise_keeps_the_precision_of_rows_beside_an_outlier():
    """A token 10^5 times larger than the others (an activation outlier): one scale for the whole
    tensor flushes the other tokens towards e4m3's subnormals, one scale per row keeps them."""
    torch.manual_seed(0)
    x = torch.randn(64, 256).bfloat16()
    x[5] *= 1e5
    w = (torch.randn(128, 256) * 0.05).bfloat16()
    reference = (x.double() @ w.double().t())
    others = torch.arange(64) != 5
    sqnr = {rowwise: fp8.sqnr_db(reference[others], fp8_linear(x, w, rowwise=rowwise)[others]).item()
            for rowwise in (False, True)}
    assert sqnr[True] >= 25 and sqnr[False] < 15, sqnr


def test_rowwise_is_current_scaling():
    with pytest.raises(ValueError, match="rowwise scaling is current scaling"):
        fp8_linear(torch.randn(4, 32), torch.randn(16, 32), rowwise=True, amax_history=torch.zeros(2, 16))
    with pytest.raises(ValueError, match="tensorwise_weight_gradient is an option of rowwise scaling"):
        fp8_linear(torch.randn(4, 32), torch.randn(16, 32), tensorwise_weight_gradient=True)


@pytest.mark.parametrize("tensorwise_weight_gradient", [False, True])
def test_the_option_rewrites_each_linear_with_rowwise_scales_and_says_so(tensorwise_weight_gradient):
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 20))
    options = dict(EAGER, fp8="rowwise", fp8_min_weight_numel=0, fp8_fast_accum=True,
                   fp8_tensorwise_weight_gradient=tensorwise_weight_gradient)
    report = flash_inductor.inspect(flash_inductor.compile(model, **options), torch.randn(4, 64))
    one_scale = " (the weight gradient's: one per operand)" if tensorwise_weight_gradient else ""
    assert decisions_of(report) == {
        "0.weight": "fp8 e4m3, row-wise scales" + one_scale,
        "2.weight": "bf16: weight 20x128: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)",
    }
    code = next(s.code for s in report.graph("model").stages if s.name == "fp8_linear")
    (call,) = [line for line in code.splitlines() if "fp8_linear_fp8_linear(" in line]
    expected = "rowwise = True, fast_accum = True" + (", tensorwise_weight_gradient = True)" if tensorwise_weight_gradient else ")")
    assert expected in call and "power_of_two" not in call


@pytest.mark.parametrize("options, message", [
    (dict(fp8="rowwise", fp8_all_gather=True), r"'fp8_all_gather' needs fp8='tensorwise', got fp8='rowwise' \(an all-gathered"),
    (dict(fp8="columnwise"), r"'fp8'.*'rowwise'"),
    (dict(fp8="tensorwise", fp8_tensorwise_weight_gradient=True),
     r"'fp8_tensorwise_weight_gradient' needs fp8='rowwise', got fp8='tensorwise'"),
])
def test_rowwise_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        flash_inductor.compile(nn.Linear(64, 64), **options)
