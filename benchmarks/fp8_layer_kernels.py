"""The Triton kernels Inductor writes for one Llama decoder layer's FP8 forward and backward on an
H200, read on a machine without a GPU.

It looks for the slow kernels ``flash_inductor/fp8_transpose.py`` describes: a reduction over each
row (an RMSNorm's forward or backward, a row's amax) that also stores a tensor transposed, so that
each program writes one column of it, elements a whole row apart. On the H200 such kernels took
1.2-1.3 ms a call where the norm alone took 0.05 ms.

The layer is HF Llama-1B's (hidden 2048, intermediate 5632, 16 heads, 8192 tokens): RMSNorm, q/k/v
projections, causal attention, o projection, RMSNorm, gate/up/down MLP, with every linear through
``fp8_linear``. AOTAutograd traces it and partitions forward from backward (Inductor's
decompositions, the min-cut partitioner) on fake CPU tensors, as a CPU build cannot run autograd on
fake CUDA tensors; ``_scaled_mm`` is the op itself and ``transpose_fp8`` a placeholder op while
tracing. Each graph is then moved to fake CUDA tensors and lowered by Inductor for sm_90 with the
backend's aten passes, up to its generated code (``lowering_probe``: nothing is compiled or run).
Not the backend's whole pipeline (no Dynamo, no joint-graph passes), so the counts are of this
layer as traced here.

``--trace backend`` takes the graphs from the backend itself instead: Hugging Face's
``LlamaForCausalLM`` cut to one layer (the same shapes; from its input embeddings, as the
embedding's backward decomposes to an op a CPU build cannot trace on fake CUDA tensors; with its
lm_head and loss) compiled by ``flash_inductor.compile`` with the configuration's options, Dynamo,
the joint-graph passes and the partitioner included; the forward and backward graphs the backend
hands Inductor are lowered as above. Its kernels are those the H100's profiles name (the
forty-second session compared the MLP's backward). Needs ``transformers``. Written against torch 2.13::

    python benchmarks/fp8_layer_kernels.py   # every configuration (tensorwise, row-wise, before, persistent, ...)
    python benchmarks/fp8_layer_kernels.py --show rowwise-before  # that configuration's kernels
    python benchmarks/fp8_layer_kernels.py --trace backend --configurations tensorwise rowwise rowwise-tensorwise-dw
"""

import argparse
import contextlib
import json
import math
import re
import time
from typing import Optional

import torch
import torch.nn.functional as F
from lowering_probe import pretend_sm90

TOKENS, HIDDEN, INTERMEDIATE, HEADS = 8192, 2048, 5632, 16

CONFIGURATIONS = {
    "tensorwise": dict(rowwise=False, power_of_two=True),
    "rowwise": dict(rowwise=True),
    # fp8_linear before the twenty-ninth session: the transposed casts written as casts of t.t()
    "rowwise-before": dict(rowwise=True),
    # every reduction of up to 16 x Inductor's threshold persistent (a whole row in one block, read once):
    # the variant that triton.multi_kernel=1 compiles beside the looped one and picks at run time if faster
    "tensorwise-persistent": dict(rowwise=False, power_of_two=True),
    "rowwise-persistent": dict(rowwise=True),
    # without the pass fp8_scales_stored: each cast kernel computes its scales again for every element
    "rowwise-recomputed-scales": dict(rowwise=True),
    # the weight gradient's GEMM with one scale per operand, from the row casts
    "rowwise-tensorwise-dw": dict(rowwise=True, tensorwise_weight_gradient=True),
    # the same with casts by columns and the rows' rescale as kernels of their own before their transposes
    # (before the forty-second session)
    "rowwise-tensorwise-dw-before": dict(rowwise=True, tensorwise_weight_gradient=True),
}


class _GeneratedCode(Exception):
    """Raised where Inductor has written its code, carrying it."""


@torch.library.custom_op("fp8_layer_kernels::transpose", mutates_args=())
def _transpose_placeholder(t: torch.Tensor, scale: Optional[torch.Tensor] = None,
                           dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    from flash_inductor import fp8_transpose

    return fp8_transpose.transpose_fp8(t, scale, dtype)  # (the CPU's copy)


@_transpose_placeholder.register_fake
def _(t, scale=None, dtype=None):
    return t.new_empty(t.shape[1], t.shape[0], dtype=dtype or t.dtype)


@contextlib.contextmanager
def _fp8_linear_as_on_cuda(configuration):
    """fp8_linear's CUDA code while tracing on the CPU: ``_scaled_mm`` itself, ``transpose_fp8`` as the
    placeholder op; with ``rowwise-before``, the transposed casts as casts of ``t.t()``; with
    ``rowwise-tensorwise-dw-before``, the casts that ``transpose_fp8`` makes as it copies (by columns,
    and the rows' rescale to one scale) made before it (before the forty-second session)."""
    from flash_inductor import fp8_linear as module
    from flash_inductor.formats import fp8

    saved = module._scaled_mm, module.transpose_fp8, module._quantize_columns
    module._scaled_mm = lambda a, a_inv, b_t, b_inv, fast_accum=False: torch._scaled_mm(
        a, b_t, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    module.transpose_fp8 = _transpose_placeholder
    if configuration == "rowwise-before":
        module._quantize_columns = lambda t: module._quantize_rows(t.t())
    if configuration == "rowwise-tensorwise-dw-before":
        # the cast a kernel of Inductor's, the copy moving its FP8 bytes
        module.transpose_fp8 = lambda t, scale=None, dtype=None: _transpose_placeholder(
            t if scale is None else fp8.cast_to_fp8(t, scale, dtype or t.dtype))
    try:
        yield
    finally:
        module._scaled_mm, module.transpose_fp8, module._quantize_columns = saved


def _layer(options):
    from flash_inductor.fp8_linear import fp8_linear

    def rms_norm(x, weight):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(torch.bfloat16)

    def linear(x, weight):
        return fp8_linear(x, weight, fast_accum=True, **options)

    def heads(t):
        return t.view(1, TOKENS, HEADS, -1).transpose(1, 2)

    def layer(x, norm1, wq, wk, wv, wo, norm2, wg, wu, wd):
        h = rms_norm(x, norm1)
        attention = F.scaled_dot_product_attention(heads(linear(h, wq)), heads(linear(h, wk)), heads(linear(h, wv)),
                                                   is_causal=True)
        x = x + linear(attention.transpose(1, 2).reshape(TOKENS, HIDDEN), wo)
        h = rms_norm(x, norm2)
        return x + linear(F.silu(linear(h, wg)) * linear(h, wu), wd)

    return layer


def _input_specs():
    bf16, fp32 = torch.bfloat16, torch.float32
    square, up, down = (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)
    return [((TOKENS, HIDDEN), bf16), ((HIDDEN,), fp32), (square, bf16), (square, bf16), (square, bf16),
            (square, bf16), ((HIDDEN,), fp32), (up, bf16), (up, bf16), (down, bf16)]


def _partitioned_graphs(configuration):
    """{"forward", "backward"}: the layer's graphs as AOTAutograd partitions them (Inductor's
    decompositions, the min-cut partitioner that recomputes cheap ops in the backward), traced on
    fake CPU tensors."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = {}

    def keep(name):
        def compiler(graph_module, inputs):
            graphs[name] = graph_module
            return graph_module
        return compiler

    with _fp8_linear_as_on_cuda(configuration), FakeTensorMode():
        layer = aot_function(_layer(CONFIGURATIONS[configuration]), fw_compiler=keep("forward"),
                             bw_compiler=keep("backward"), partition_fn=min_cut_rematerialization_partition,
                             decompositions=select_decomp_table())
        out = layer(*[torch.empty(shape, dtype=dtype).requires_grad_() for shape, dtype in _input_specs()])
        out.backward(torch.empty_like(out))
    return graphs


class _Captured(Exception):
    """Raised where the backend hands Inductor the backward, the last graph wanted."""


def _backend_graphs(configuration):
    """{"forward", "backward"}: the graphs ``flash_inductor.compile`` hands Inductor for HF Llama cut to
    one layer (bf16, batch 2 x 4096, from its input embeddings, lm_head in bf16 as the hf_clients rows
    keep it), traced on CPU tensors and stopped there: nothing is lowered for the CPU or run."""
    import hf_clients

    import flash_inductor
    from flash_inductor import backend

    options = CONFIGURATIONS[configuration]
    fp8_options = dict(fp8="rowwise" if options["rowwise"] else "tensorwise", fp8_fast_accum=True, fp8_exclude=("lm_head",),
                       fp8_tensorwise_weight_gradient=options.get("tensorwise_weight_gradient", False))
    if not options["rowwise"]:  # (row-wise scales are powers of two always)
        fp8_options["fp8_power_of_two_scales"] = options.get("power_of_two", False)
    model = hf_clients.build_model("llama", hf_clients.model_config("llama", "full", TOKENS // 2, "is_causal", layers=1))
    model = model.to(torch.bfloat16)

    def loss(embeddings, labels):
        logits = model(inputs_embeds=embeddings).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    graphs = {}

    def keep(graph_module, inputs, **kwargs):
        graphs["backward" if kwargs.get("is_backward") else "forward"] = graph_module
        if kwargs.get("is_backward"):
            raise _Captured
        return lambda *args: None

    torch._dynamo.reset()  # each configuration traced afresh: Dynamo would keep the previous one's graphs
    compiled = flash_inductor.compile(loss, **fp8_options)
    inner = backend.compile_fx_inner
    backend.compile_fx_inner = keep
    try:
        # the backward lowered with the forward, so both come before anything runs
        with _fp8_linear_as_on_cuda(configuration), torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            compiled(torch.zeros(2, TOKENS // 2, HIDDEN, dtype=torch.bfloat16, requires_grad=True),
                     torch.zeros(2, TOKENS // 2, dtype=torch.long))
    except Exception as error:  # Dynamo wraps what the backend raises
        while error is not None and not isinstance(error, _Captured):
            error = error.__cause__ or error.__context__
        if error is None:
            raise
    finally:
        backend.compile_fx_inner = inner
    return graphs


@contextlib.contextmanager
def _fake_cuda_scatter():
    """Inductor's reinplacing of view scatters (rotary's backward) with a fake result a CPU build can
    make on fake CUDA tensors: the scatter's output has its input's size, strides and dtype, which is
    all a fake result carries; the real one copies into a view of it, which needs CUDA."""
    from torch._inductor.fx_passes import reinplace

    original = reinplace._inplace_generalized_scatter
    reinplace._inplace_generalized_scatter = lambda out, src, view_ops: out
    try:
        yield
    finally:
        reinplace._inplace_generalized_scatter = original


def _cuda_code(graph_module, fp8_option, disable=()):
    """Inductor's code (sm_90) for ``graph_module`` (traced on the CPU) run on CUDA tensors."""
    import torch._inductor.graph as inductor_graph
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from flash_inductor import fp8_transpose, passes
    from flash_inductor.options import Options
    from flash_inductor.pipeline import AtenPasses, PassContext

    class OnCuda(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is torch.ops.fp8_layer_kernels.transpose.default:
                return fp8_transpose.transpose_fp8(*args)
            kwargs = {k: torch.device("cuda") if k == "device" else v for k, v in kwargs.items()}
            return super().call_function(target, args, kwargs)

    torch._inductor.config.post_grad_custom_post_pass = AtenPasses(
        passes.ATEN_PASSES, PassContext({}, set(), Options(fp8=fp8_option, disable=disable)), "fp8_layer_kernels")
    codegen = inductor_graph.GraphLowering.codegen

    def stop_at_code(self):
        raise _GeneratedCode(codegen(self)[0].value)

    inductor_graph.GraphLowering.codegen = stop_at_code
    placeholders = [n.meta["val"] for n in graph_module.graph.nodes if n.op == "placeholder"]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
            inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") for t in placeholders]
            graph = make_fx(lambda *args: OnCuda(graph_module).run(*args))(*inputs)
        torch._inductor.compile_fx.compile_fx(graph, inputs)
    except Exception as error:  # Inductor wraps what is raised inside it
        while error is not None and not isinstance(error, _GeneratedCode):
            error = error.__cause__ or error.__context__
        if error is None:
            raise
        return error.args[0]
    finally:
        inductor_graph.GraphLowering.codegen = codegen
    raise AssertionError("Inductor finished without writing code")


def _record_kernel_bytes():
    """Each Triton kernel's estimated bytes in its metadata (``kernel_num_gb``), as
    ``config.benchmark_kernel`` would write them without changing what it fuses."""
    from torch._inductor.codegen.triton import TritonKernel

    meta = TritonKernel.inductor_meta_per_kernel
    if getattr(meta, "records_bytes", False):
        return

    def with_bytes(self):
        out = meta(self)
        out.setdefault("kernel_num_gb", self.estimate_kernel_num_bytes() / 1e9)
        return out

    with_bytes.records_bytes = True
    TritonKernel.inductor_meta_per_kernel = with_bytes


@contextlib.contextmanager
def _persistent_as_multi_kernel(configuration):
    """With a ``-persistent`` configuration: Inductor's choice of a persistent reduction as under
    ``triton.multi_kernel`` (its threshold times 16), without the looped twin beside it."""
    from torch._inductor.choices import InductorChoices

    original = InductorChoices.should_use_persistent_reduction
    if configuration.endswith("-persistent"):
        def wider(features, cooperative_reduction):
            with torch._inductor.config.patch({"triton.multi_kernel": 1}):
                return original(features, cooperative_reduction)
        InductorChoices.should_use_persistent_reduction = staticmethod(wider)
    try:
        yield
    finally:
        InductorChoices.should_use_persistent_reduction = staticmethod(original)


def generated_code(configuration, trace="layer"):
    """{"forward", "backward"}: for the layer's two graphs under ``configuration``, Inductor's code
    (sm_90), the graph's operators and the seconds Inductor took to lower it to that code (its share
    of a GPU compile that does not depend on the GPU; Triton's compile of the kernels comes on top)."""
    if trace == "backend":
        pretend_sm90()  # before tracing too: what the backend and Dynamo ask of CUDA then is answered alike each time
        graphs = _backend_graphs(configuration)
    else:
        graphs = _partitioned_graphs(configuration)
    pretend_sm90()
    _record_kernel_bytes()
    fp8_option = "rowwise" if CONFIGURATIONS[configuration]["rowwise"] else "tensorwise"
    generated = {}
    # the backend compiles the graphs it rewrote so (flash_inductor/backend.py); the layer's counts predate it
    patches = dict(emulate_precision_casts=trace == "backend")
    for name, graph in graphs.items():
        start = time.perf_counter()
        with _persistent_as_multi_kernel(configuration), torch._inductor.config.patch(patches), _fake_cuda_scatter():
            code = _cuda_code(graph, fp8_option, ("fp8_scales_stored",) if configuration.endswith("-recomputed-scales") else ())
        generated[name] = dict(code=code, graph_ops=sum(n.op == "call_function" for n in graph.graph.nodes),
                               lowering_s=round(time.perf_counter() - start, 1))
    return generated


_KERNEL = re.compile(r"@triton_heuristics\.(\w+)\((.*?)@triton\.jit\ndef (\w+)\(.*?\):\n(.*?)\n'''", re.S)


_BYTES = {"*bf16": 2, "*fp16": 2, "*fp32": 4, "*fp8e4nv": 1, "*fp8e5": 1, "*i32": 4, "*i64": 8}


def _reread_gb(decorator, body, sizes):
    """GB a looped reduction reads again: Inductor's ``kernel_num_gb`` counts each buffer once, but a kernel
    whose reduction result feeds later work loops over each row again (``for r0_offset``) and loads the
    same rows again. Counted: every load of a whole tensor (indexed by both a row and a reduced element)
    after the first of its pointer, at the tensor's size. Broadcast vectors (cached) are not counted.
    On an H100 these reads come from L2, not HBM: persistent reductions, which do not make them, did not
    make the Llama's layers faster (docs/benchmarks.md, forty-first session)."""
    loops = body.split("for r0_offset in")[1:]
    if len(loops) < 2 or "xnumel" not in sizes or "r0_numel" not in sizes:
        return 0.0
    dtypes = dict(re.findall(r"'(in_ptr\d+|in_out_ptr\d+)': '(\*\w+)'", decorator))
    elements = int(sizes["xnumel"]) * int(sizes["r0_numel"])
    seen, again = set(), 0
    for loop in loops:
        for pointer, index in re.findall(r"tl\.load\((in_ptr\d+|in_out_ptr\d+) \+ \((.*?)\),", loop):
            if not (re.search(r"\br0_\d", index) and re.search(r"\bx\d", index)):
                continue
            if pointer in seen:
                again += elements * _BYTES.get(dtypes.get(pointer), 0)
            seen.add(pointer)
    return again / 1e9


def kernels(code):
    """[{name, kind, sizes, gb, reread_gb, loops, stores, transposed_stores}] of the Triton kernels in
    ``code``. A store is transposed in a reduction kernel when consecutive elements of the reduced
    dimension (``r0_1``) land a row apart (its index multiplies ``r0_1`` by a constant)."""
    found = []
    for kind, decorator, name, body in _KERNEL.findall(code):
        stores = re.findall(r"tl\.store\(\w+ \+ \((.*?)\)", body)
        transposed = [s for s in stores if "reduction" in kind and re.search(r"\b\d+\*r0_1\b", s)]
        gb = re.search(r"'kernel_num_gb': ([0-9.e-]+)", decorator)
        sizes = dict(re.findall(r"(\w+numel) = (\d+)", body))
        found.append(dict(name=name, kind=kind, sizes=sizes, gb=float(gb.group(1)) if gb else None,
                          reread_gb=_reread_gb(decorator, body, sizes), loops=body.count("for r0_offset in"),
                          stores=len(stores), transposed_stores=len(transposed),
                          elements=math.prod(int(n) for n in sizes.values()), scale_formulas=body.count(" >> ")))
    return found


def transposes(code):
    """[(rows, cols)] of each ``transpose_fp8`` launch in ``code``."""
    # run(src (a buffer, or a view of one), scale (a buffer, or -1 for None), dst, rows, cols, ...)
    source = r"(?:reinterpret_tensor\(\w+, \([^)]*\), \([^)]*\), \d+\)|\w+)"
    return [(int(r), int(c)) for r, c in re.findall(rf"\btranspose_kernel_\d+\.run\({source}, [\w-]+, \w+, (\d+), (\d+),", code)]


def summary(code):
    """Counts over the layer's kernels, and the bytes they move: Inductor's estimate for its kernels
    (each buffer read or written once), one byte read and one written per element for a transpose."""
    found, copies = kernels(code), transposes(code)
    inductor_gb = sum(k["gb"] or 0 for k in found)
    return dict(triton_kernels=len(found),
                transpose_kernel_launches=len(copies),
                inductor_kernels_gb=round(inductor_gb, 3),
                reread_gb=round(sum(k["reread_gb"] for k in found), 3),
                transposes_gb=round(sum(2 * r * c for r, c in copies) / 1e9, 3),
                reductions_storing_transposed=sum(k["transposed_stores"] > 0 for k in found),
                transposed_stores=sum(k["transposed_stores"] for k in found),
                # power-of-two scale formulas (one shift of an amax's bits each) in kernels of 1M elements or
                # more: there a column's scale is computed for every element it scales (a row's once a row)
                scale_formulas_in_large_kernels=sum(k["scale_formulas"] for k in found if k["elements"] >= 1 << 20))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configurations", nargs="*", default=list(CONFIGURATIONS), choices=list(CONFIGURATIONS))
    parser.add_argument("--show", choices=list(CONFIGURATIONS), help="list that configuration's kernels")
    parser.add_argument("--trace", choices=["layer", "backend"], default="layer",
                        help="the hand-written layer through AOTAutograd, or HF Llama's layer through the backend")
    parser.add_argument("--json", help="write the summaries here")
    args = parser.parse_args()
    results = {}
    for configuration in args.configurations:
        generated = generated_code(configuration, args.trace)
        results[configuration] = {graph: dict(summary(g["code"]), graph_ops=g["graph_ops"], lowering_s=g["lowering_s"])
                                  for graph, g in generated.items()}
        for graph, g in generated.items():
            if configuration == args.show:
                print(f"-- {graph}")
                for k in kernels(g["code"]):
                    print(f"{k['kind']:21} {str(k['sizes']):40} {k['gb'] or 0:6.3f} GB loops {k['loops']} "
                          f"read again {k['reread_gb']:5.3f} GB stores {k['stores']} "
                          f"transposed {k['transposed_stores']}  {k['name'][:60]}")
    columns = [*summary(""), "graph_ops", "lowering_s"]
    print(f"{'configuration':15} {'graph':8} " + " ".join(f"{c:>29}" for c in columns))
    for configuration, graphs in results.items():
        for graph, s in graphs.items():
            print(f"{configuration:15} {graph:8} " + " ".join(f"{s[c]:>29}" for c in columns))
    if args.json:
        with open(args.json, "w") as f:
            layer = dict(tokens=TOKENS, hidden=HIDDEN, intermediate=INTERMEDIATE,
                         heads=32 if args.trace == "backend" else HEADS)  # (HF Llama-1B's config has 32)
            json.dump(dict(torch=torch.__version__, trace=args.trace, layer=layer, results=results), f, indent=1)


if __name__ == "__main__":
    main()
