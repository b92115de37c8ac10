"""How many kernels Inductor's GPU scheduler makes of a graph, without a GPU.

    python benchmarks/fusion_check.py optimizer [--params 4] [--shape 256x256]
    python benchmarks/fusion_check.py fp8                 # FP8 MLP forward + backward, ours and torchao's

Inductor's fusion decisions for CUDA are made by the same SIMD scheduler that serves its Triton CPU
backend; only the loop reorder/reindex paths also check ``is_cpu()``. So with
``cpu_backend="triton"`` and ``is_cpu`` patched to False the CPU run takes the GPU's fusion
decisions. Each graph is scheduled and not compiled (no GPU): its module is a stub, and the
backward is lowered right after the forward (``force_non_lazy_backward_lowering``), so one call
schedules both; running the stub then stops the call. Method from docs/notes_optimizer_fusion.md.

Expected for ``optimizer`` with the (groups, 32) layout: one kernel per parameter plus one per
``step`` counter.
"""

import argparse
import contextlib
import types

import torch
import torch._functorch.config as functorch_config
import torch.nn as nn
from torch._inductor import graph, scheduler

import flash_inductor


@contextlib.contextmanager
def gpu_scheduling(graphs):
    """Schedule every Inductor graph compiled inside as for a GPU; append ``(nodes before fusion,
    nodes after, extern kernels after)`` of each to ``graphs``."""
    fuse_nodes = scheduler.Scheduler.fuse_nodes

    def counting_fuse_nodes(self, nodes):
        fused = fuse_nodes(self, nodes)
        externs = sum(isinstance(n, scheduler.ExternKernelSchedulerNode) for n in fused)
        graphs.append((len(nodes), len(fused), externs))
        return fused

    def schedule_only(self):
        self.init_wrapper_code()
        self._update_scheduler()
        stub = types.ModuleType("scheduled_only")
        stub.call = lambda args: None
        stub.__file__ = "/dev/null"
        return stub

    patches = [(scheduler.Scheduler, "fuse_nodes", counting_fuse_nodes),
               (scheduler.BaseSchedulerNode, "is_cpu", lambda self: False),
               (graph.GraphLowering, "compile_to_module", schedule_only)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with torch._inductor.config.patch(cpu_backend="triton", fx_graph_cache=False), \
                functorch_config.patch(force_non_lazy_backward_lowering=True):
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def run_stopped(fn):
    """Call ``fn``; the stub modules make it stop once the graphs are scheduled."""
    try:
        fn()
    except Exception as error:  # expected: the stubs return nothing
        print(f"(stopped after scheduling: {type(error).__name__})")


def optimizer_step(params, shape):
    torch.manual_seed(0)
    tensors = [torch.nn.Parameter(torch.randn(shape) * 0.02) for _ in range(params)]
    opt = torch.optim.AdamW(tensors, lr=1e-4, weight_decay=0.1, foreach=False)
    flash_inductor.prepare(torch.nn.ParameterList(tensors), opt, min_quantized_numel=0,
                           compile_options={"inductor": {"cpu_backend": "triton"}})
    for p in tensors:
        p.grad = torch.randn(shape, dtype=torch.bfloat16) * 1e-3
    return opt.step


def fp8_mlp(peer):
    """Forward + backward of a 2-linear MLP (256 -> 512 -> 256, bf16) with FP8 linears."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.GELU(), nn.Linear(512, 256, bias=False)).bfloat16()
    if peer == "torchao":
        from torchao.float8 import convert_to_float8_training

        compiled = torch.compile(convert_to_float8_training(model))
    else:
        compiled = torch.compile(model, backend="flashoptim", options={
            "fp8": "tensorwise", "fp8_min_weight_numel": 0, "inductor": {"cpu_backend": "triton"}})
    x = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    return lambda: compiled(x).float().sum().backward()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["optimizer", "fp8"], nargs="?", default="optimizer")
    parser.add_argument("--params", type=int, default=4)
    parser.add_argument("--shape", default="256x256")
    args = parser.parse_args()
    if args.what == "optimizer":
        cases = {"flashoptim AdamW step": optimizer_step(args.params, tuple(int(d) for d in args.shape.split("x")))}
    else:
        cases = {f"{peer} FP8 MLP": fp8_mlp(peer) for peer in ("flashoptim", "torchao")}
    for name, fn in cases.items():
        graphs = []
        with gpu_scheduling(graphs):
            run_stopped(fn)
        for i, (before, after, externs) in enumerate(graphs):
            print(f"{name}, graph {i}: {before} scheduler nodes before fusion, {after} after "
                  f"({externs} extern kernels)")
        print(f"{name}: {sum(g[1] for g in graphs)} nodes after fusion in all")


if __name__ == "__main__":
    main()
