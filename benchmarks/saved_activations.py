"""What a compiled train step saves for its backward, tensor by tensor, on the CPU.

Builds a small Hugging Face ``LlamaForCausalLM`` from a config (random init, no download), runs one
``@flash_inductor.train_step`` with the given backend options, and lists the forward graph's outputs
that the backward reads (the partition's saved activations: not the graph's inputs, which are the
parameters and the batch), with dtype, shape, bytes and the model's source line. On the CPU the FP8
linears are an emulation whose partition differs from the GPU's; the GPU's is in Inductor's output
code (``TORCH_LOGS=output_code``, e.g. ``benchmarks/h200_session.sh fp8kernels``). Needs transformers::

    python benchmarks/saved_activations.py --out benchmarks/results/saved_activations_llama_tiny_cpu.json
    python benchmarks/saved_activations.py --recompute-elementwise --fp8
"""

import argparse
import collections
import json

import torch
import torch._inductor.compile_fx as compile_fx

import flash_inductor


def saved_activations(fp8=False, recompute_elementwise=False, hidden=256, intermediate=704, layers=2, seq=128):
    """[(name, dtype, shape, bytes, source line)] of every forward graph's saved activations."""
    import transformers

    partitions = []
    partition = compile_fx.min_cut_rematerialization_partition

    def spy(*args, **kwargs):  # Inductor's partitioner, recording what it returns
        partitions.append(partition(*args, **kwargs))
        return partitions[-1]

    compile_fx.min_cut_rematerialization_partition = spy
    try:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                          max_position_embeddings=seq)
        model = transformers.LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        options = dict(recompute_elementwise=recompute_elementwise)
        if fp8:
            options.update(fp8="tensorwise", fp8_min_weight_numel=0, fp8_min_gemm_size=0)

        @flash_inductor.train_step(model=model, optimizer=opt, **options)
        def step(ids):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        # a cache hit would skip the partitioner
        with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
            step(torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(1)))
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
    parser.add_argument("--fp8", action="store_true", help="fp8='tensorwise' on every linear (CPU: emulated)")
    parser.add_argument("--recompute-elementwise", action="store_true", help="the backend option recompute_elementwise")
    parser.add_argument("--out", help="JSON: both settings of --recompute-elementwise, rows and totals")
    args = parser.parse_args(argv)
    settings = (False, True) if args.out else (args.recompute_elementwise,)
    results = {}
    for recompute in settings:
        rows = saved_activations(fp8=args.fp8, recompute_elementwise=recompute)
        by_dtype = collections.Counter()
        print(f"== recompute_elementwise={recompute}, fp8={args.fp8}")
        for name, dtype, shape, nbytes, line in rows:
            by_dtype[dtype] += nbytes
            print(f"{name:28} {dtype:10} {str(shape):18} {nbytes / 1024:8.1f} KiB  {line[:80]}")
        print(f"saved: {sum(by_dtype.values()) / 1024:.1f} KiB ({', '.join(f'{k} {v / 1024:.1f}' for k, v in by_dtype.items())})")
        results[str(recompute)] = dict(rows=rows, total_bytes=sum(by_dtype.values()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(fp8=args.fp8, recompute_elementwise=results), f, indent=1)


if __name__ == "__main__":
    main()
