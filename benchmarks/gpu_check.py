"""GPU check: the inspection report of a prepared AdamW train step on CUDA, with Triton code.

    python benchmarks/gpu_check.py OUT_FOLDER

Writes the report (one file per graph and pass, Inductor's output code) under OUT_FOLDER, the
optimizer step's generated code as OUT_FOLDER/optimizer_step_triton.py, and
prints the summary plus, for the optimizer-step graph, the number of Triton kernels and whether
which fp32 buffers the step allocates (an fp32 copy of a state would show as one of its size).
"""

import re
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor


def main(folder):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    flash_inductor.prepare(model, opt)

    def step(x, y):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16), torch.randn(64, 1024, device="cuda")
    report = flash_inductor.inspect(step, x, y)
    report.save(folder)
    print(report.summary())
    code = "\n".join(report.graph("optimizer step").kernels.values())
    with open(f"{folder}/optimizer_step_triton.py", "w") as f:
        f.write(code)
    kernels = re.findall(r"^def (triton_\w+)\(", code, re.M)
    fp32_bufs = re.findall(r"empty_strided_cuda\(\(([\d, ]+)\), \([\d, ]*\), torch\.float32\)", code)
    print(f"optimizer step: {len(kernels)} Triton kernels: {kernels}")
    print(f"fp32 buffers allocated in the step: {fp32_bufs}")
    for _ in range(3):
        print("loss", step(x, y).item())


if __name__ == "__main__":
    main(sys.argv[1])
