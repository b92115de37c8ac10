"""Where a prepared optimizer's memory goes, on the CPU (issue 14): bytes in use counted by glibc
(``mallinfo2``: heap in use + mmapped), in bytes per parameter.

    prepare   the most in use while ``flash_inductor.prepare`` runs (a thread samples), above the
              level before the model was built (8 x 2048^2 linears: the fp32 model is 4)
    landings  bytes in use when each gradient lands in the flat buffer (a post-accumulate-grad hook
              per parameter), above the level between steps: HF GPT-2's shape (2 x 768) through
              ``train_step`` with Inductor (one backward graph returns every gradient) and with
              ``compiler="eager"``, and the fp32 baseline of hf_clients.py with Inductor
    between   after each step: the storages of the tensors Python reaches (``gc``) against
              ``memory_report`` without gradients, and glibc's bytes in use
    step_peak the most in use during a steady train step of the linears (Inductor, clipped), with
              bf16 and with e5m2 gradients (``gradient_format``), above the level between steps

    python benchmarks/cpu_memory_phases.py --out benchmarks/results/cpu_memory_phases.json
    python benchmarks/cpu_memory_phases.py --phases step_peak --out benchmarks/results/cpu_step_peak_fp8_gradients_cpu.json
"""

import argparse
import ctypes
import gc
import json
import pathlib
import sys
import threading
import time

import torch
import torch.nn as nn

import flash_inductor

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import hf_clients  # noqa: E402
from snapshot_analysis import python_tensor_storages  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def in_use():
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def peak_during(fn):
    """The most bytes in use while ``fn()`` runs. A thread samples; it keeps no frame of the caller,
    whose tensors a held frame would keep alive and count."""
    peak, done = [in_use()], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], in_use())
            time.sleep(1e-4)

    sampler = threading.Thread(target=sample)
    sampler.start()
    fn()
    done.set()
    sampler.join()
    return peak[0]


def linears():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])
    return model, sum(p.numel() for p in model.parameters())


def prepare_peak():
    """The most bytes in use during prepare."""
    gc.collect()
    base = in_use()
    model, n = linears()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fp32 = in_use() - base
    peak = peak_during(lambda: flash_inductor.prepare(model, opt))
    gc.collect()
    return dict(num_params=n, fp32_model=fp32 / n, prepare_peak=(peak - base) / n, after=(in_use() - base) / n)


def step_peak(gradient_format, steps=3):
    """A steady train step's peak above the level between steps, and that level above the one before
    the model was built: ``train_step`` (Inductor) over the linears, clipped (FP8 gradients with
    ``flash_inductor.clip_grad_norm_``), after 3 warm-up steps."""
    gc.collect()
    base = in_use()
    model, n = linears()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x):
        model(x).float().square().mean().backward()
        if gradient_format:
            flash_inductor.clip_grad_norm_(opt, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    step = flash_inductor.train_step(step, model=model, optimizer=opt, gradient_format=gradient_format)
    x = torch.randn(64, 2048, dtype=torch.bfloat16)
    for _ in range(3):
        step(x)
    rows = []
    for _ in range(steps):
        gc.collect()
        between = in_use()
        peak = peak_during(lambda: step(x))
        rows.append(dict(between_steps=(between - base) / n, step_peak_above_between=(peak - between) / n,
                         step_peak=(peak - base) / n))
    torch._dynamo.reset()
    return dict(num_params=n, steps=rows)


def gpt2_args(row, compiler):
    return hf_clients.parse_args(["--model", "gpt2", "--size", "tiny", "--configs", row, "--device", "cpu",
                                  "--batch", "1", "--seq", "128", *(["--no-inductor"] if compiler == "eager" else [])])


def landings_and_between(row, compiler, steps=3):
    """Per step: bytes in use at the gradient landings (first, most, last) and after the step, above
    the level between steps; the tensors Python reaches, against memory_report."""
    args = gpt2_args(row, compiler)
    args.config = hf_clients.transformers.GPT2Config(
        n_layer=2, n_embd=768, n_head=12, vocab_size=1024, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        use_cache=False, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    setup, _, _ = hf_clients.build(row, args, torch.device("cpu"))
    params = list(setup.model.parameters())
    n = sum(p.numel() for p in params)
    levels = []
    for p in params:
        p.register_post_accumulate_grad_hook(torch.compiler.disable(lambda p: levels.append(in_use())))
    x = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))
    rows = []
    for _ in range(steps):
        levels.clear()
        gc.collect()
        between = in_use()
        setup.step(x, x).item()
        gc.collect()
        stored = sum(v for k, v in hf_clients.memory_components(setup).items() if k != "grads")  # torch's states exist from step 1
        rows.append(dict(first_landing=(levels[0] - between) / n, most=(max(levels) - between) / n,
                         last_landing=(levels[-1] - between) / n, after_step=(in_use() - between) / n,
                         python_tensors=sum(python_tensor_storages("cpu").values()) / n, report_without_grads=stored / n))
    torch._dynamo.reset()
    return dict(num_params=n, steps=rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="cpu_memory_phases.json")
    parser.add_argument("--phases", default="prepare,landings,step_peak", help="comma list of prepare, landings, step_peak")
    args = parser.parse_args(argv)
    phases = args.phases.split(",")
    results = {"torch": torch.__version__}
    if "prepare" in phases:
        results["prepare"] = prepare_peak()
        print("prepare (B/param):", json.dumps({k: round(v, 3) for k, v in results["prepare"].items()}), flush=True)
    runs = {}
    if "landings" in phases:
        runs.update({f"{row}_{compiler}": (landings_and_between, row, compiler)
                     for row, compiler in (("flashoptim", "inductor"), ("flashoptim", "eager"), ("baseline", "inductor"))})
    if "step_peak" in phases:
        runs.update({f"step_peak_{fmt or 'bf16'}_gradients": (step_peak, fmt) for fmt in (None, "e5m2")})
    for key, (phase, *phase_args) in runs.items():
        results[key] = phase(*phase_args)
        for i, r in enumerate(results[key]["steps"]):
            print(f"{key} step {i + 1} (B/param):", json.dumps({k: round(v, 3) for k, v in r.items()}), flush=True)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
