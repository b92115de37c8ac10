"""FP8-LM's per-tensor states under Inductor on a GPU: each piece of ``formats/tensor_scaled.py`` compiled
alone and in an Adam-like update, against the same functions run eagerly on the same device.

Found in the sixteenth session: on the H200 the compiled FP8-LM step on 40 tensors stopped with
"CUDA error: misaligned address", and on the Llama it trained 2% below the baseline where the same
graphs run by aten's kernels (``+eager``) did not. Each check runs in its own process (a CUDA error
poisons its context) with ``CUDA_LAUNCH_BLOCKING=1``, so a failing kernel is the one named; the
Inductor code of every failing check is written beside the log.

    python benchmarks/fp8lm_gpu_check.py --out benchmarks/results/fp8lm_gpu_check_h200.json
"""

import argparse
import concurrent.futures
import glob
import json
import os
import subprocess
import sys

import torch

from flash_inductor.formats import tensor_scaled

E4M3, FP16 = torch.float8_e4m3fn, torch.float16
CHECKS = ("segment_max", "encode_m", "encode_v", "decode", "adam_update")


def layout(name):
    """Row counts (of 32 elements) of each tensor of a layout: ``many`` (tests/test_fp8lm_states.py's
    40 linears) or ``llama`` (the ~1B HF Llama of hf_clients.py, its 2-D weights)."""
    if name == "many":
        sizes = [31 * 33 if i % 5 == 0 else (256 + 32 * (i % 4)) * 384 for i in range(40)]
    else:
        d, f, v = 2048, 5632, 32000
        sizes = [v * d] + [d * d, d * d, d * d, d * d, f * d, f * d, f * d] * 16 + [v * d]
    return torch.tensor([-(-n // 32) for n in sizes])


def inputs(name, device):
    rows = layout(name)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), rows.cumsum(0)[:-1]]).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    n = int(rows.sum())
    size = torch.exp(torch.randn(len(rows), generator=gen, device=device) * 3).repeat_interleave(rows.to(device))[:, None]
    g = torch.randn(n, 32, generator=gen, device=device) * size
    return g, starts


def adam_update(m_codes, m_scales, v_codes, v_scales, starts, g):
    """Decode both moments, one Adam moment update from ``g``, encode both (as the step's pass does)."""
    m = tensor_scaled.decode(m_codes, m_scales, starts).lerp(g, 0.1)
    v = tensor_scaled.decode(v_codes, v_scales, starts) * 0.95 + 0.05 * g * g
    return (*tensor_scaled.encode(m, starts, E4M3, False), *tensor_scaled.encode(v, starts, FP16, True),
            m / (v.sqrt() + 1e-8))


def run_check(check, name, device):
    """One check in this process: compiled against eager; prints a JSON line."""
    g, starts = inputs(name, device)
    if check == "segment_max":
        fn, args = tensor_scaled.segment_max, (g.abs().amax(dim=1), starts)
    elif check in ("encode_m", "encode_v"):
        m = check == "encode_m"
        fn, args = tensor_scaled.encode, ((g if m else g * g), starts, E4M3 if m else FP16, not m)
    elif check == "decode":
        codes, scales = tensor_scaled.encode(g, starts, E4M3, False)
        fn, args = tensor_scaled.decode, (codes, scales, starts)
    else:
        m = tensor_scaled.encode(g * 0.5, starts, E4M3, False)
        v = tensor_scaled.encode(g * g, starts, FP16, True)
        fn, args = adam_update, (*m, *v, starts, g)
    expected = fn(*args)
    got = torch.compile(fn, fullgraph=True, dynamic=False)(*args)
    expected, got = (x if isinstance(x, tuple) else (x,) for x in (expected, got))
    result = []
    for e, o in zip(expected, got):
        e, o = e.float(), o.float()
        differ = ~((e == o) | (e.isnan() & o.isnan()))
        result.append(dict(shape=list(e.shape), differ=int(differ.sum()),
                           max_rel=float(((e - o).abs() / e.abs().clamp(min=1e-30))[differ].max()) if differ.any() else 0.0))
    print(json.dumps(dict(check=check, layout=name, outputs=result)))


def checked(check, name, device):
    """``run_check`` in a process of its own: (its result, or the error's lines; the Inductor code of a failure)."""
    cache = f"/tmp/fp8lm_gpu_check/{name}_{check}"
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", TORCHINDUCTOR_CACHE_DIR=cache)
    proc = subprocess.run([sys.executable, __file__, "--one", check, name, device], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    code = []
    if proc.returncode == 0 and lines:
        result = json.loads(lines[-1])
    else:
        error = [ln for ln in proc.stderr.splitlines() if "Error" in ln or ".run(" in ln]
        result = dict(check=check, layout=name, error=error[-6:])
        for path in glob.glob(f"{cache}/**/*.py", recursive=True):
            text = open(path).read()
            if "def call(" in text:
                code.append(f"# ==== {name} {check}: {path}\n{text}")
    print(json.dumps(result), flush=True)
    return result, code


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="fp8lm_gpu_check.json")
    parser.add_argument("--layouts", nargs="+", default=["many", "llama"])
    parser.add_argument("--checks", nargs="+", default=list(CHECKS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--jobs", type=int, default=5, help="checks at once")
    parser.add_argument("--one", nargs=3, metavar=("CHECK", "LAYOUT", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return run_check(*args.one)
    cases = [(check, name) for name in args.layouts for check in args.checks]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda case: checked(*case, args.device), cases))
    results = [result for result, _ in done]
    code = [text for _, texts in done for text in texts]
    with open(args.out, "w") as f:
        json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                       results=results), f, indent=1)
    if code:
        with open(os.path.splitext(args.out)[0] + "_code.txt", "w") as f:
            f.write("\n".join(code))


if __name__ == "__main__":
    main()
