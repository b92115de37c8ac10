"""What a compiled train step saves for its backward, tensor by tensor, on the CPU.

Builds a Hugging Face model of ``benchmarks/hf_zoo.py`` (its tiny config, random init, no download),
runs one step of a zoo row (``flashoptim``, ``flashoptim+recompute``, ``flashoptim_fp8``, ...) and lists
the forward graph's outputs that the backward reads (the partition's saved activations: not the
graph's inputs, which are the parameters and the batch), with dtype, shape, bytes and the model's
source line. On the CPU the FP8 linears are an emulation whose partition differs from the GPU's; the
GPU's is in Inductor's output code (``TORCH_LOGS=output_code``, e.g. ``h200_session.sh fp8kernels``).
Needs transformers::

    python benchmarks/saved_activations.py --model llama --rows flashoptim,flashoptim+recompute \\
        --out benchmarks/results/saved_activations_llama_tiny_cpu.json
"""

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch._inductor.compile_fx as compile_fx

sys.path.insert(0, str(Path(__file__).parent))
import hf_zoo  # noqa: E402


def saved_activations(model_name, row):
    """[(name, dtype, shape, bytes, source line)] of what the forward graphs of ``row``'s first step save."""
    partitions = []
    partition = compile_fx.min_cut_rematerialization_partition

    def spy(*args, **kwargs):  # Inductor's partitioner, recording what it returns
        partitions.append(partition(*args, **kwargs))
        return partitions[-1]

    compile_fx.min_cut_rematerialization_partition = spy
    try:
        torch._dynamo.reset()
        model = hf_zoo.build_model(model_name, "tiny", "cpu")
        args = argparse.Namespace(device="cpu", size="tiny", lr=1e-3, compiler="inductor")
        step, _ = hf_zoo.make_step(row, model, args)
        # a cache hit would skip the partitioner
        with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
            step(hf_zoo.fixed_batch("tiny", "cpu"))
    finally:
        compile_fx.min_cut_rematerialization_partition = partition
    rows = []
    for forward, _ in partitions:
        (outputs,) = [n.args[0] for n in forward.graph.nodes if n.op == "output"]
        for node in outputs:
            value = getattr(node, "meta", {}).get("val")
            if not isinstance(value, torch.Tensor) or node.op == "placeholder":
                continue
            lines = [line.strip() for line in node.meta.get("stack_trace", "").splitlines()
                     if line.strip() and not set(line.strip()) <= set("^~ ")]
            rows.append((node.name, str(value.dtype).removeprefix("torch."), list(value.shape),
                         value.numel() * value.element_size(), lines[-1] if lines else ""))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", choices=sorted(hf_zoo.ARCHITECTURES))
    parser.add_argument("--rows", default="flashoptim,flashoptim+recompute", help=f"of {', '.join(hf_zoo.ROWS[1:])}")
    parser.add_argument("--out", help="JSON: each row's saved tensors and total")
    args = parser.parse_args(argv)
    results = {}
    for row in args.rows.split(","):
        saved = saved_activations(args.model, row)
        by_dtype = collections.Counter()
        print(f"== {args.model} {row}")
        for name, dtype, shape, nbytes, line in saved:
            by_dtype[dtype] += nbytes
            print(f"{name:28} {dtype:10} {str(shape):18} {nbytes / 1024:8.1f} KiB  {line[:80]}")
        print(f"saved: {sum(by_dtype.values()) / 1024:.1f} KiB ({', '.join(f'{k} {v / 1024:.1f}' for k, v in by_dtype.items())})")
        results[row] = dict(saved=saved, total_bytes=sum(by_dtype.values()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, size=hf_zoo.SIZES["tiny"], rows=results), f, indent=1)


if __name__ == "__main__":
    main()
