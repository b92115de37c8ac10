"""Host time at the start of a ``train_step``: what runs before its compiled graph is entered.

A 16-layer HF Llama of hidden 64 (147 parameters, as the ~1B Llama of ``hf_clients.py`` has) trained
through ``@flash_inductor.train_step`` with a gradient clip (``hf_clients.make_step``'s step on
``hf_clients.loss_function``'s loss, as the benchmark's rows), on the CPU: the step's compute is small,
so what the host does before the first graph shows. Prints, for one profiled step, the offsets of the
first events (Dynamo's guard lookup, the compiled region, the compiled graph's call) and the number of
guards of each frame Dynamo compiled. Then, without the profiler, the median offset at which the first
compiled graph is entered over ``--calls`` steps, for this step and for the form of ``hf_clients.py``'s
baseline (``torch.compile`` of the loss; backward, clip and fused AdamW eager) on a fresh model of the
same shape, bf16 as this one (the benchmark's baseline keeps fp32 weights under autocast). Writes them
as JSON with ``--out``.
``python benchmarks/step_host_time.py --out benchmarks/results/step_host_time_cpu.json``
"""

import argparse
import json
import re
import statistics
import time

import torch
import transformers
from hf_clients import loss_function, make_step
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
from torch._inductor.output_code import CompiledFxGraph
from torch.profiler import ProfilerActivity, profile, record_function

import flash_inductor

_GUARD = re.compile(r"\+- (TENSOR_MATCH|TYPE_MATCH|EQUALS_MATCH|ID_MATCH|NONE_MATCH|TRUE_MATCH|FALSE_MATCH|"
                    r"NO_TENSOR_ALIASING|LENGTH_CHECK|DICT_LENGTH)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="steps timed without the profiler, per setup")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config, model = _llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    loss = loss_function(model, False)
    step = flash_inductor.train_step(make_step(loss, model.parameters(), optimizer, clip=1.0), model=model,
                                     optimizer=optimizer)
    x = torch.randint(0, config.vocab_size, (1, 16))
    guards = _guards_by_frame(step, x)
    for _ in range(3):  # warm
        step(x, x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            step(x, x)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    start = next(e for e in events if e.name == "step").time_range.start
    first = {}
    for e in events:
        for name in ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "## Call CompiledFxGraph"):
            if e.name.startswith(name) and name not in first:
                first[name] = dict(offset_us=round(e.time_range.start - start), duration_us=round(e.time_range.elapsed_us()))
    parameters = sum(1 for _ in model.parameters())
    print(f"{parameters} parameters; guards by frame: {guards}")
    for name, at in first.items():
        print(f"  +{at['offset_us']:6d} us  {name} ({at['duration_us']} us)")

    _, baseline_model = _llama()
    baseline_optimizer = torch.optim.AdamW(baseline_model.parameters(), lr=1e-3, fused=True)
    baseline_loss = torch.compile(loss_function(baseline_model, False))
    baseline_step = make_step(baseline_loss, baseline_model.parameters(), baseline_optimizer, clip=1.0)
    unprofiled = {name: _first_graph_offset_us(run, x, args.calls)
                  for name, run in (("train_step", step), ("baseline", baseline_step))}
    print(f"without the profiler, medians over {args.calls} steps each:")
    for name, at in unprofiled.items():
        print(f"  {name:10s}  first compiled graph entered at +{at:7.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, parameters=parameters, guards_by_frame=guards, first_events=first,
                           calls=args.calls, first_graph_us_without_profiler=unprofiled), f, indent=1)


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
    return config, transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def _first_graph_offset_us(run, x, calls):
    """The median over ``calls`` steps of ``run(x, x).item()`` of when the first compiled (Inductor) graph
    is entered after the step begins, in µs. The graph's call is wrapped to stamp the time; Dynamo is
    told to run the wrapper as it is, not to compile it."""
    stamps = []
    call = CompiledFxGraph.__call__

    def stamped(self, inputs):
        stamps.append(time.perf_counter_ns())
        return call(self, inputs)

    set_code_exec_strategy(stamped.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    for _ in range(5):  # compile and warm
        run(x, x).item()
    first = []
    CompiledFxGraph.__call__ = stamped
    try:
        for _ in range(calls):
            stamps.clear()
            start = time.perf_counter_ns()
            run(x, x).item()
            first.append(stamps[0] - start)
    finally:
        CompiledFxGraph.__call__ = call
    return statistics.median(first) / 1e3


def _guards_by_frame(step, x):
    """The number of leaf guards of each frame Dynamo compiles in ``step(x, x)``'s first call, read off the
    guard trees it logs (one record a line, each tree opened by a "GUARDS:" line)."""
    import logging

    counts = []

    class Count(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "GUARDS:" in message:
                counts.append(0)
            elif counts:
                counts[-1] += len(_GUARD.findall(message))

    logger = logging.getLogger("torch._dynamo.guards")
    handler = Count()
    logger.addHandler(handler)
    torch._logging.set_logs(guards=True)
    try:
        step(x, x)
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
    return counts

if __name__ == "__main__":
    main()
