"""Host time at the start of a ``train_step``: what runs before its compiled graph is entered.

A 16-layer HF Llama of hidden 64 (147 parameters, as the ~1B Llama of ``hf_clients.py`` has) trained
through ``@flash_inductor.train_step`` with a gradient clip, on the CPU: the step's compute is small,
so what the host does before the first graph shows. Prints, for one profiled step, the offsets of the
first events (Dynamo's guard lookup, the compiled region, the compiled graph's call) and the number of
guards of each frame Dynamo compiled; writes them as JSON with ``--out``.
``python benchmarks/step_host_time.py --out benchmarks/results/step_host_time_cpu.json``
"""

import argparse
import json
import re

import torch
import transformers
from torch.profiler import ProfilerActivity, profile, record_function

import flash_inductor

_GUARD = re.compile(r"\+- (TENSOR_MATCH|TYPE_MATCH|EQUALS_MATCH|ID_MATCH|NONE_MATCH|TRUE_MATCH|FALSE_MATCH|"
                    r"NO_TENSOR_ALIASING|LENGTH_CHECK|DICT_LENGTH)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @flash_inductor.train_step(model=model, optimizer=optimizer)
    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    x = torch.randint(0, config.vocab_size, (1, 16))
    guards = _guards_by_frame(step, x)
    for _ in range(3):  # warm
        step(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            step(x)
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, parameters=parameters, guards_by_frame=guards, first_events=first), f,
                      indent=1)


def _guards_by_frame(step, x):
    """The number of leaf guards of each frame Dynamo compiles in ``step(x)``'s first call, read off the
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
        step(x)
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
    return counts

if __name__ == "__main__":
    main()
