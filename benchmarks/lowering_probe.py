"""Inductor's CUDA lowering of an FP8 cast read by ``_scaled_mm`` and ``transpose_fp8``, on a machine without a GPU.

The evidence behind ``passes/fp8_transpose_source.py``: which buffers Inductor makes of ``g_fp8`` in

    g_fp8 = cast_to_e5m2(g * scale);  dx = _scaled_mm(g_fp8, w);  g_fp8_t = transpose_fp8(g_fp8)

lowered for an sm_90 GPU with the backend's aten-level passes (``--disable fp8_transpose_source``
leaves that one out). It needs Triton (the kernel of ``transpose_fp8``) but no GPU: CUDA tensors are
fake, Triton's driver answers for an sm_90 target, the few CUDA queries Inductor makes on the way are
answered for an H200, and nothing is compiled or run: the probe stops where Inductor's scheduler would
start, and prints each buffer it lowered with the buffers it reads. Written against torch 2.13 (it
replaces internals, so another version may need other replacements)::

    python benchmarks/lowering_probe.py                                  # one buffer read by both
    python benchmarks/lowering_probe.py --disable fp8_transpose_source   # the cast stored twice
    python benchmarks/lowering_probe.py --dynamic                        # g's rows symbolic
"""

import argparse
import contextlib
import types

import torch


class _LoweredBuffers(Exception):
    """Raised where the scheduler would start, carrying the lowered operations."""

    def __init__(self, operations):
        super().__init__("lowered")
        self.operations = operations


def pretend_sm90():
    """Answer Inductor's CUDA and Triton queries as an H200 would, on a machine without one."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    real = None
    with contextlib.suppress(RuntimeError):  # no GPU: no active driver
        real = driver.active

    class Sm90Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def __getattr__(self, name):
            return getattr(real, name)

    driver.set_active(Sm90Driver())
    import torch._dynamo.device_interface as device_interface
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.fx_passes.joint_graph as joint_graph
    import torch._inductor.fx_passes.post_grad as post_grad
    import torch._inductor.kernel.mm as mm
    import torch._inductor.utils as utils

    properties = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132, name="NVIDIA H200", warp_size=32,
                                       total_memory=141 << 30, gcnArchName="", regs_per_multiprocessor=65536,
                                       max_threads_per_multi_processor=2048, max_threads_per_block=1024,
                                       L2_cache_size=50 << 20, shared_memory_per_block_optin=232448)
    interface = device_interface.CudaInterface
    replacements = [
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "_exchange_device", lambda index: 0),
        (torch.cuda, "_maybe_exchange_device", lambda index: 0),
        (torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0)),
        (torch.cuda, "get_device_properties", lambda *args, **kwargs: properties),
        (interface, "get_device_properties", staticmethod(lambda *args, **kwargs: properties)),
        (interface.Worker, "get_device_properties", staticmethod(lambda *args, **kwargs: properties)),
        (torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.zeros(16, dtype=torch.uint8)),
        (torch.cuda, "set_rng_state", lambda *args, **kwargs: None),
        (compile_fx, "get_cuda_device_context", lambda gm: contextlib.nullcontext()),
        # pattern replacements are traced on real CUDA tensors: off (the backend's passes still run)
        (joint_graph, "lazy_init", lambda *args, **kwargs: None),
        (post_grad, "lazy_init", lambda *args, **kwargs: None),
        # _scaled_mm as the cuBLAS extern kernel only (Triton templates would be benchmarked)
        (utils, "is_big_gpu", lambda *args, **kwargs: False),
        (utils, "use_triton_template", lambda *args, **kwargs: False),
        (mm, "use_triton_template", lambda *args, **kwargs: False),
    ]
    for module, name, value in replacements:
        setattr(module, name, value)
    torch._inductor.config.pattern_matcher = False
    torch._inductor.config.joint_graph_constant_folding = False  # it would run ops on (real) CUDA tensors
    torch.utils._triton.has_triton.cache_clear()  # answered "no GPU" if asked before
    torch._inductor.config.max_autotune_gemm_backends = "ATEN"


def lowered_buffers(disable, dynamic=False):
    """[(name, kind, names it reads)] of what Inductor lowers the probe's graph into; ``dynamic``: with
    the number of ``g``'s rows symbolic (as in a graph compiled for dynamic shapes)."""
    import torch._inductor.scheduler as scheduler
    from torch._dynamo.source import ConstantSource
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from flash_inductor import fp8_transpose, passes
    from flash_inductor.formats import fp8
    from flash_inductor.options import Options
    from flash_inductor.pipeline import AtenPasses, PassContext

    pretend_sm90()

    def stop(self, nodes):
        raise _LoweredBuffers([(op.get_name() if getattr(op, "name", None) else "-", type(op).__name__,
                                sorted(dep.name for dep in op.get_read_writes().reads)) for op in V.graph.operations])

    scheduler.Scheduler.__init__ = stop
    options = Options(fp8="tensorwise", disable=tuple(disable))
    torch._inductor.config.post_grad_custom_post_pass = AtenPasses(passes.ATEN_PASSES, PassContext({}, set(), options),
                                                                   "probe")

    def step(g, scale, w_t):
        g_fp8 = fp8.cast_to_fp8(g, scale, fp8.E5M2)
        return torch._scaled_mm(g_fp8, w_t, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16), \
            fp8_transpose.transpose_fp8(g_fp8)

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    rows = mode.shape_env.create_symintnode(mode.shape_env.create_symbol(256, ConstantSource("rows")), hint=256) \
        if dynamic else 256
    with mode:
        inputs = (torch.empty(rows, 128, dtype=torch.bfloat16, device="cuda"),
                  torch.empty((), dtype=torch.float32, device="cuda"),
                  torch.empty(64, 128, dtype=fp8.E5M2, device="cuda").t())
        graph = make_fx(step)(*inputs)
    try:
        torch._inductor.compile_fx.compile_fx(graph, list(inputs))
    except Exception as error:  # Inductor wraps what is raised inside it
        while error is not None and not isinstance(error, _LoweredBuffers):
            error = error.__cause__ or error.__context__
        if error is None:
            raise
        return error.operations
    raise AssertionError("Inductor compiled without reaching its scheduler")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--disable", nargs="*", default=[], help="passes to leave out")
    parser.add_argument("--dynamic", action="store_true", help="g's number of rows symbolic")
    args = parser.parse_args()
    buffers = lowered_buffers(args.disable, args.dynamic)
    for name, kind, reads in buffers:
        print(f"{name:6} {kind:24} reads {', '.join(reads) or '-'}")
    casts = [name for name, kind, reads in buffers if kind == "ComputedBuffer" and "arg0_1" in reads]
    print(f"the cast of g (arg0_1) stored {len(casts)} time(s): {', '.join(casts)}")


if __name__ == "__main__":
    main()
