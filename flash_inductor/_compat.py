"""Differences between the torch versions we support (>= 2.11), and Inductor bugs we work
around, in one place."""

import contextlib
import copy
import functools
import importlib.util
import warnings

import sympy
import torch
from torch.torch_version import TorchVersion

TORCH_VERSION = TorchVersion(torch.__version__)
# CPU builds of torch come without Triton (flash_inductor/triton_adam.py needs it).
HAS_TRITON = importlib.util.find_spec("triton") is not None
# torch 2.11's Dynamo traces ``x.add_(y, alpha=a)`` with a number ``a`` as ``x.add_(torch.mul(y, a))``;
# torch >= 2.12 keeps a number ``alpha`` and splits only a tensor one (pytorch #176799). A step with
# such an ``add_`` (SGDW's momentum, Lion's update) holds one node more on 2.11, captured and rewritten.
DYNAMO_SPLITS_NUMBER_ALPHA = TORCH_VERSION < "2.12"


def inductor_patches_for_rewritten_graphs():
    """Inductor settings for graphs our passes rewrote, beyond ``emulate_precision_casts``."""
    patches = {}
    if TORCH_VERSION < "2.13":
        # torch 2.11's scheduler asserts in reorder_loops_by_dep_pair when loop reordering meets a
        # fused node of the optimizer step (fixed in 2.13, where the base class returns False).
        patches["loop_ordering_after_fusion"] = False
    return patches


def _drops_iterations(nodes):
    """Whether Inductor's C++ loop split would cut a loop whose length its divisor does not divide.

    ``CppScheduling.try_loop_split`` turns a loop of ``n`` iterations whose index holds ``x // k``
    (``k > 8``) into ``n // k`` x ``k`` iterations and never checks ``n % k == 0`` (torch 2.11 to
    2.13), so the last ``n % k`` elements are never computed. A parameter of 4097 elements with
    8-bit states reads its group's scale at ``x // 32``: its last element never updated.
    """
    from torch.utils._sympy.functions import FloorDiv

    for node in nodes:
        _, body, _ = node.node.get_default_sizes_body()
        ranges = body.var_ranges
        for expr in body.indexing_exprs.values():
            if not isinstance(expr, sympy.Expr):
                continue
            for div in expr.find(FloorDiv):
                var, divisor = div.args
                if var in ranges and isinstance(divisor, sympy.Integer) and sympy.Mod(ranges[var], divisor) != 0:
                    return True
    return False


@contextlib.contextmanager
def cpp_codegen_workarounds():
    """While Inductor generates code for one graph: the C++ backend fixes below."""
    with cpp_loop_split_keeps_every_element(), cpp_keeps_precision_casts():
        yield


@contextlib.contextmanager
def cpp_keeps_precision_casts():
    """On torch < 2.13: the C++ backend keeps fp32 -> bf16/fp16 -> fp32 roundings inside a kernel
    under ``emulate_precision_casts``, as torch 2.13 does.

    torch 2.11's ``CppOverrides.to_dtype`` (and ``CppVecOverrides.to_dtype``) always puts the inverse
    conversion into the kernel's CSE cache (``CppKernel.cache_dtype_convert``, for pytorch #115260),
    so a later ``.float()`` of the rounded value reads the fp32 value from before the rounding. The
    split-weight encode ``master - master.to(bf16).float()`` became ``master - master``: every error
    term stayed 0. torch 2.13 skips the cache entry under ``emulate_precision_casts`` (pytorch
    #185337); ``cache_dtype_convert`` has no other caller, so skipping it there is that fix.
    """
    if TORCH_VERSION >= "2.13":
        yield
        return
    from torch._inductor import config
    from torch._inductor.codegen.cpp import CppKernel

    original = CppKernel.cache_dtype_convert

    @functools.wraps(original)
    def cache_dtype_convert(self, *args, **kwargs):
        if not config.emulate_precision_casts:
            original(self, *args, **kwargs)

    CppKernel.cache_dtype_convert = cache_dtype_convert
    try:
        yield
    finally:
        CppKernel.cache_dtype_convert = original


@contextlib.contextmanager
def cpp_loop_split_keeps_every_element():
    """While compiling: skip Inductor's C++ loop split where it would drop iterations (above)."""
    from torch._inductor.codegen.cpp import CppScheduling

    original = CppScheduling.try_loop_split

    @functools.wraps(original)
    def try_loop_split(self, nodes):
        return nodes if _drops_iterations(nodes) else original(self, nodes)

    CppScheduling.try_loop_split = try_loop_split
    try:
        yield
    finally:
        CppScheduling.try_loop_split = original


# Two 32 x 32 bf16 tiles transposed in one function by Inductor's C++ helper (what a kernel that reads
# bf16 tensors across its vectorized dimension does), each tile read back as written.
_BF16_TILE_TRANSPOSES = """
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(const at::BFloat16* a, const at::BFloat16* b, at::BFloat16* out) {
    alignas(64) at::BFloat16 tile_a[32 * 32];
    transpose_mxn<at::BFloat16, 32, 32, false>(a, 64, tile_a, 32);
    for (int i = 0; i < 32 * 32; i++) out[i] = tile_a[i];
    alignas(64) at::BFloat16 tile_b[32 * 32];
    transpose_mxn<at::BFloat16, 32, 32, false>(b, 64, tile_b, 32);
    for (int i = 0; i < 32 * 32; i++) out[32 * 32 + i] = tile_b[i];
}
"""


@functools.cache
def cpp_transposes_bf16_tiles_wrongly():
    """Whether Inductor's 512-bit C++ code transposes bf16 tiles wrongly on this machine.

    Found on torch 2.13 with g++ 12.2 on an AVX-512 CPU: a kernel that transposes two 32 x 32 bf16
    (or fp16) tiles (``at::vec::transpose_mxn<BFloat16>``) gets 988 of each tile's 1024 elements
    wrong; 16 x 16 tiles and fp32 are right. It takes Inductor's ``-D STANDALONE_TORCH_HEADER``
    (``TORCH_CHECK`` then throws ``std::runtime_error``) and ``-O3`` together. Stock
    ``torch.compile`` of ``a + b.t() + c.t()`` on bf16 64 x 64 tensors returns 3,948 wrong elements
    of 4,096; a Granite MoE's FP8 backward, which reads its activations transposed, returned NaN
    gradients. 256-bit code transposes without that helper. The answer comes from compiling and
    running that kernel once per process."""
    from torch._inductor import config, cpu_vec_isa
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    with config.patch({"cpp.simdlen": None}):
        isa = cpu_vec_isa.pick_vec_isa()
        if not isa or isa.bit_width() < 512:
            return False
        try:
            kernel = CppPythonBindingsCodeCache.load_pybinding(
                ["const at::BFloat16*", "const at::BFloat16*", "at::BFloat16*"], _BF16_TILE_TRANSPOSES)
        except Exception:  # noqa: BLE001 - an Inductor without the helper does not emit it either
            return False
    a, b = torch.arange(2 * 32 * 64, dtype=torch.int16).view(torch.bfloat16).reshape(2, 32, 64)  # distinct, finite
    out = torch.empty(2, 32, 32, dtype=torch.bfloat16)
    kernel(a, b, out)
    return not torch.equal(out, torch.stack([a[:, :32].t(), b[:, :32].t()]))


def cpp_patches(example_inputs):
    """Inductor settings for a graph with CPU tensors on this machine: 256-bit vectors where the
    512-bit ones transpose bf16 tiles wrongly (above), unless the user chose a width. (A CUDA
    graph's 0-dim CPU inputs, an optimizer's step counts, make no C++ kernel worth the probe.)"""
    from torch._inductor import config

    if has_cpu_kernels(example_inputs) and config.cpp.simdlen is None and cpp_transposes_bf16_tiles_wrongly():
        return {"cpp.simdlen": 256}
    return {}


def has_cpu_kernels(example_inputs):
    """Whether Inductor writes C++ kernels for a graph of these inputs: CPU tensors of rank > 0."""
    return any(isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0 for x in example_inputs)


def compile_without_cpp_vectorizer_on_its_known_error(compile_subgraph, gm, example_inputs):
    """``compile_subgraph(gm)``; where the C++ backend's vectorized code fails to compile for a known
    Inductor bug, again with the vectorizer off (``cpp.simdlen = 1``: scalar loops, the same math),
    with a warning. The bug (torch 2.13, pytorch #194706): a bf16 reduction's accumulator converted to
    bf16 is declared twice in one scope ("conflicting declaration ... at_BFloat16_tmp_acc0_vec"), in
    Hugging Face's GPT-NeoX and Phi as under stock ``torch.compile``. The second compile takes a copy
    of ``gm`` made before the first: Inductor's post-grad passes rewrite ``gm`` in place, and its
    code generation caches the graph's node order on it (Phi's retry failed with ``KeyError:
    slice_scatter_default_20``, a node the first compile's passes had added)."""
    if not has_cpu_kernels(example_inputs):
        return compile_subgraph(gm)
    untouched = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    untouched.meta = dict(gm.meta)
    try:
        return compile_subgraph(gm)
    except Exception as error:  # Inductor wraps the CppCompileError
        message = str(error)
        if "conflicting declaration" not in message or "tmp_acc" not in message:
            raise
    warnings.warn("Inductor's C++ vectorizer emitted code that does not compile (a bf16 reduction's accumulator "
                  "declared twice, pytorch #194706); this graph is compiled without vectorization", stacklevel=2)
    with torch._inductor.config.patch({"cpp.simdlen": 1}):
        return compile_subgraph(untouched)
