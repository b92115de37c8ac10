"""How many kernels Inductor's GPU scheduler makes of a prepared AdamW step, without a GPU.

    python benchmarks/fusion_check.py [--params 4] [--shape 256x256]

Inductor's fusion decisions for CUDA are made by the same SIMD scheduler that serves its Triton CPU
backend; only the loop reorder/reindex paths also check ``is_cpu()``. So with
``cpu_backend="triton"`` and ``is_cpu`` patched to False the CPU run takes the GPU's fusion
decisions. Compiling the Triton kernels then fails (no GPU), after the schedule is known.
Expected with the (groups, 32) layout: one kernel per parameter plus one per ``step`` counter.
(Method from docs/notes_optimizer_fusion.md.)
"""

import argparse

import torch
from torch._inductor import scheduler

import flash_inductor


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=4)
    parser.add_argument("--shape", default="256x256")
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split("x"))

    counts = []
    fuse_nodes = scheduler.Scheduler.fuse_nodes

    def counting_fuse_nodes(self, nodes):
        fused = fuse_nodes(self, nodes)
        counts.append((len(nodes), len(fused)))
        return fused

    scheduler.Scheduler.fuse_nodes = counting_fuse_nodes
    scheduler.BaseSchedulerNode.is_cpu = lambda self: False

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for _ in range(args.params)]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=False)
    flash_inductor.prepare(torch.nn.ParameterList(params), opt, min_quantized_numel=0,
                           compile_options={"inductor": {"cpu_backend": "triton"}})
    for p in params:
        p.grad = torch.randn(shape, dtype=torch.bfloat16) * 1e-3
    try:
        opt.step()
    except Exception as error:  # expected: the Triton kernels cannot be built without a GPU
        print(f"(kernel build stopped as expected: {type(error).__name__})")
    for before, after in counts:
        print(f"scheduler nodes: {before} before fusion, {after} after "
              f"({args.params} parameters + {args.params} step counters)")


if __name__ == "__main__":
    main()
