"""Diagnostic (GPU): who holds the memory of a prepared AdamW over 8 x 2048^2 linears, right after
``prepare`` and between steps. Records the allocator's history
(``torch.cuda.memory._record_memory_history``) and prints each live block of 1 MiB or more with the
frames of the code that allocated it (this package's, the benchmark's and torch.optim's).

    python benchmarks/memory_snapshot_diag.py --out benchmarks/results/memory_snapshot_diag_h200.json
"""

import argparse
import json

import torch
import torch.nn as nn

import flash_inductor


def live_blocks(label):
    snapshot = torch.cuda.memory._snapshot()
    rows = []
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated" or block["size"] < 2**20:
                continue
            frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in block.get("frames", [])
                      if any(k in f["filename"] for k in ("flash_inductor", "benchmarks", "torch/optim", "torch/nn"))]
            rows.append({"MiB": round(block["size"] / 2**20, 2), "frames": frames[:6]})
    rows.sort(key=lambda r: -r["MiB"])
    print(f"--- {label}: {sum(r['MiB'] for r in rows):.1f} MiB in blocks >= 1 MiB, "
          f"allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB")
    for row in rows:
        print(f"  {row['MiB']:8.2f} MiB  " + " <- ".join(row["frames"][:3]))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="memory_snapshot_diag.json")
    args = parser.parse_args()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False, device="cuda") for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    flash_inductor.prepare(model, opt)
    print(flash_inductor.memory_report(model, opt))
    out = {"after_prepare": live_blocks("after prepare")}
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    out["between_steps"] = live_blocks("between steps")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
