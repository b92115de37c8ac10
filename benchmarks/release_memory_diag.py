"""Diagnostic (H200): where gradient release's peak goes. Prints, for AdamW over 8 x 2048^2
linears with and without gradient release: bytes/param persistent (memory_report), allocated
between steps, after backward, and the peaks of a steady step's forward + backward and of its
optimizer step, all above the allocation before the model.

    python benchmarks/release_memory_diag.py
"""
import gc
import json
import sys

import torch
import torch.nn as nn

import flash_inductor

rows = []
for release in (False, True):
    torch._dynamo.reset()  # the previous configuration's compiled step holds its tensors (graph attributes)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False, device="cuda") for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flash_inductor.prepare(model, opt, gradient_release=release)
    after_prepare = torch.cuda.memory_allocated() - base
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    phases = {}
    for i in range(3):
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        model(x).float().square().mean().backward()
        if i == 2:  # the steady step by phase: backward, then the optimizer step
            torch.cuda.synchronize()
            phases = {"after_backward": torch.cuda.memory_allocated() - base,
                      "peak_forward_backward": torch.cuda.max_memory_allocated() - base}
            torch.cuda.reset_peak_memory_stats()
        opt.step()
        if i == 2:
            torch.cuda.synchronize()
            phases["peak_step"] = torch.cuda.max_memory_allocated() - base
        opt.zero_grad()
    torch.cuda.synchronize()
    report = flash_inductor.memory_report(model, opt)
    n = report.num_params
    persistent = sum(v for k, v in report.bytes.items() if k != "grads")
    row = {"release": release, "persistent": persistent / n, "after_prepare": after_prepare / n,
           "between_steps": (torch.cuda.memory_allocated() - base) / n,
           **{k: v / n for k, v in phases.items()}}
    segments = torch.cuda.memory_snapshot()
    blocks = sorted((b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"), reverse=True)
    row["largest_live_blocks_MiB"] = [round(b / 2**20, 2) for b in blocks[:24]]
    rows.append(row)
    print(json.dumps(row), flush=True)
    del model, opt, x
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "release_memory_diag.json", "w"), indent=1)
