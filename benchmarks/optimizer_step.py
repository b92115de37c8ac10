"""Optimizer-step benchmark (GPU): the flashoptim AdamW step against torch's fused AdamW.

Peer (when installed): the ``flashoptim`` package's FlashAdamW. Two parameter lists: 64 tensors of
2048x2048 (268M parameters) and GPT-2-124M's 148 tensors. Each configuration runs in this one
process; times are medians of ``triton.testing.do_bench``. Each flashoptim configuration also
reports its largest GPU kernels (``torch.profiler``), to tell kernel time from launch overhead.

    python benchmarks/optimizer_step.py --out benchmarks/results/optimizer_step.json

Bytes moved per parameter by one step (each tensor read once and written once):
  torch AdamW, fp32 params: read p, g, m, v (16) + write p, m, v (12)            = 28
  torch AdamW, bf16 params: read p, g, m, v (8) + write p, m, v (6)              = 14
  flashoptim 24-bit / 8-bit: read p 2, err 1, g 2, codes 2, scales 0.125 (7.125)
                             + write p 2, err 1, codes 2, scales 0.125 (5.125)   = 12.25
  flashoptim FP8-LM states:  read p 2, err 1, g 2, m 1, v 2 (8) + write p, err, m, v (6) = 14
"""

import argparse
import importlib.util
import json
import platform
import time

import torch
from gpu_profile import kernel_times

import flash_inductor
from flash_inductor import triton_adam

BYTES_PER_PARAM = {"torch_fused_fp32": 28.0, "torch_fused_bf16": 14.0, "flashoptim": 12.25, "flashoptim_pypi": 12.25,
                   "flashoptim_bf16masters": 10.25, "flashoptim_fp32states": 24.0, "flashoptim_fp8lmstates": 14.0,
                   "flashoptim_fp8lmstates_inductor": 14.0}


def gpt2_124m_shapes():
    d, v, ctx, layers = 768, 50257, 1024, 12
    shapes = [(v, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def gpt_1b_shapes():
    """Our GPT at 24 x 2048 (benchmarks/train_gpt.py's ``1b``, 1.2B parameters), built on the meta device."""
    from train_gpt import GPT, SIZES

    with torch.device("meta"):
        return [tuple(p.shape) for p in GPT(SIZES["1b"][0]).parameters()]


PARAM_LISTS = {
    "64x2048x2048": [(2048, 2048)] * 64,
    "gpt2_124m": gpt2_124m_shapes(),
    "gpt_1b": None,  # built when asked for (gpt_1b_shapes)
    # Smaller lists for comparing compile variants (each flashoptim variant compiles anew):
    # the same per-kernel work, and GPT-2's mix of large and small tensors for 3 layers.
    "16x2048x2048": [(2048, 2048)] * 16,
    "4x2048x2048": [(2048, 2048)] * 4,
    "gpt2_3layers": gpt2_124m_shapes()[:2 + 3 * 12],
}


def make_params(shapes, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32).mul_(0.02).to(dtype))
        p.grad = torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32).mul_(1e-3).to(dtype)
        params.append(p)
    return params


def time_ms(fn, warmup=50, rep=300):
    """Median ms of ``fn`` (``triton.testing.do_bench``: CUDA events, L2 flushed between calls), after
    ``warmup`` ms of calls, over ``rep`` ms of them."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_torch_fused(shapes, dtype):
    params = make_params(shapes, dtype)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    return {"ms": time_ms(opt.step), "compile_s": 0.0}


def bench_flashoptim_pypi(shapes):
    """Peer: the ``flashoptim`` package's FlashAdamW (bf16 params, 24-bit masters, 8-bit states; Triton)."""
    from flashoptim import FlashAdamW

    params = make_params(shapes, torch.bfloat16)
    opt = FlashAdamW(params, lr=1e-4, weight_decay=0.1, master_weight_bits=24)
    t0 = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    return {"ms": time_ms(opt.step), "compile_s": time.perf_counter() - t0}


def prepared_flashoptim(shapes, foreach, options, **prepare_kwargs):
    """Parameters of ``shapes`` (fp32, seeded) with bf16 gradients, prepared with an AdamW: (model, opt)."""
    params = make_params(shapes, torch.float32)
    model = torch.nn.ParameterList(params)
    grads = [p.grad.to(torch.bfloat16) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=foreach)
    # tensors under 4096 elements keep fp32 states
    flash_inductor.prepare(model, opt, compile_options=options, **prepare_kwargs)
    for p, g in zip(params, grads):
        p.grad = g
    return model, opt


def bench_flashoptim(shapes, foreach, options, **prepare_kwargs):
    model, opt = prepared_flashoptim(shapes, foreach, options, **prepare_kwargs)
    t0 = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    kernels = kernel_times(opt.step, top=100)
    return {"ms": time_ms(opt.step), "compile_s": compile_s, "kernels": kernels[:4],
            "kernel_launches": sum(k[1] for k in kernels), "memory": flash_inductor.memory_report(model, opt).per_param()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="optimizer_step.json")
    parser.add_argument("--lists", default="64x2048x2048,gpt2_124m")
    parser.add_argument("--configs", default="torch_fused_fp32,torch_fused_bf16,flashoptim,flashoptim_pypi",
                        help="comma list of torch_fused_fp32, torch_fused_bf16, flashoptim, flashoptim_inductor, "
                             "flashoptim_cudagraphs, flashoptim_combo, flashoptim_coordesc, flashoptim_tuned, "
                             "flashoptim_cppwrapper, flashoptim_exactdiv, flashoptim_bf16masters, flashoptim_fp32states, "
                             "flashoptim_fp8lmstates, flashoptim_fp8lmstates_inductor, "
                             "flashoptim_pypi (skipped when not installed), and the hand-written kernel launched with a given "
                             "triton_adam.LaunchShape: flashoptim_block{B}_warps{W}[_vector{V}][_evict][_persist{K}][_stages{S}]"
                             "[_approx] (B groups of 32 per block, W warps, V contiguous elements per thread, evict-first loads "
                             "and streaming stores, persistent with K programs per SM, S pipeline stages of its loop, the "
                             "cheaper arithmetic; parts in any order, those left out default, but without approx the exact "
                             "arithmetic, e.g. "
                             "flashoptim_block32_warps2_vector8_evict_persist4_stages2)")
    args = parser.parse_args()
    for name in set(args.configs.split(",")) - set(configs_for([])):  # before measuring anything
        try:
            kernel_launch_config(name, [])
        except ValueError as e:
            parser.error(str(e))
    bandwidth = measure_copy_bandwidth()
    info = dict(torch=torch.__version__, device=torch.cuda.get_device_name(), copy_bandwidth_GBps=bandwidth / 1e9,
                python=platform.python_version(), date=time.strftime("%Y-%m-%d"))
    rows = []
    for list_name in args.lists.split(","):
        shapes = PARAM_LISTS[list_name] or gpt_1b_shapes()
        n = sum(torch.Size(s).numel() for s in shapes)
        configs = configs_for(shapes)
        for name in args.configs.split(","):
            if name == "flashoptim_pypi" and importlib.util.find_spec("flashoptim") is None:
                print("flashoptim package not installed: flashoptim_pypi skipped")
                continue
            run = configs[name] if name in configs else kernel_launch_config(name, shapes)
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            result = run()
            bpp = BYTES_PER_PARAM.get(name, BYTES_PER_PARAM["flashoptim"] if name.startswith("flashoptim") else None)
            floor_ms = n * bpp / bandwidth * 1e3
            row = dict(params=list_name, num_params=n, num_tensors=len(shapes), config=name, bytes_per_param=bpp,
                       achieved_GBps=n * bpp / (result["ms"] * 1e-3) / 1e9, floor_ms=floor_ms, **result)
            rows.append(row)
            print(f"{list_name:14s} {name:48s} {result['ms']:8.3f} ms  {row['achieved_GBps']:7.0f} GB/s  "
                  f"floor {floor_ms:.3f} ms  compile {result['compile_s']:.1f} s  "
                  f"kernels/step {result.get('kernel_launches', '-')}", flush=True)
            for kernel in result.get("kernels", []):
                print(f"    {kernel}", flush=True)
            with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
                json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; wrote {args.out}")


def configs_for(shapes):
    """The named configurations (each a function that measures it) on the parameter list ``shapes``."""
    # The Inductor-compiled stock update with extra Inductor config patches.
    inductor = lambda patches={}: bench_flashoptim(shapes, False, {"step_kernel": "inductor", "inductor": patches})  # noqa: E731,B006
    return {
        "torch_fused_fp32": lambda: bench_torch_fused(shapes, torch.float32),
        "torch_fused_bf16": lambda: bench_torch_fused(shapes, torch.bfloat16),
        # the default: AdamW buckets run flash_inductor/triton_adam.py's hand-written kernel
        "flashoptim": lambda: bench_flashoptim(shapes, False, {}),
        # the stock update traced and compiled by Inductor (the reference path; the default before)
        "flashoptim_inductor": inductor,
        "flashoptim_cudagraphs": lambda: inductor({"triton.cudagraphs": True}),
        # exactly rounded fp32 divisions (the default until issue 13; now approximate)
        "flashoptim_exactdiv": lambda: inductor({"eager_numerics.division_rounding": True}),
        # kernels launched from a C++ wrapper instead of Inductor's Python one (less CPU per launch)
        "flashoptim_cppwrapper": lambda: inductor({"cpp_wrapper": True}),
        # Inductor's horizontal fusion of independent kernels (fewer launches)
        "flashoptim_combo": lambda: inductor({"combo_kernels": True}),
        # Inductor searches block sizes and warps per kernel by timing them
        "flashoptim_coordesc": lambda: inductor({"coordinate_descent_tuning": True}),
        # both: without launch overhead and with tuned kernels
        "flashoptim_tuned": lambda: inductor({"coordinate_descent_tuning": True, "triton.cudagraphs": True}),
        "flashoptim_pypi": lambda: bench_flashoptim_pypi(shapes),
        # what the step's parts cost: without error terms (bf16 masters), with fp32 states (Inductor)
        "flashoptim_bf16masters": lambda: bench_flashoptim(shapes, False, {}, master_weight_bits=None),
        "flashoptim_fp32states": lambda: bench_flashoptim(shapes, False, {}, state_bits=None),
        # FP8-LM's states (e4m3 m, fp16 v, one scale per tensor): the hand-written kernels (the default), Inductor's
        "flashoptim_fp8lmstates": lambda: bench_flashoptim(shapes, False, {}, state_format="fp8lm"),
        "flashoptim_fp8lmstates_inductor": lambda: bench_flashoptim(shapes, False, {"step_kernel": "inductor"},
                                                                    state_format="fp8lm"),
    }


def kernel_launch_config(name, shapes):
    """``flashoptim_{shape}``: the hand-written step launched as ``triton_adam.LaunchShape.from_name(shape)``."""
    if not name.startswith("flashoptim_"):
        raise ValueError(f"unknown config {name!r}")
    shape = triton_adam.LaunchShape.from_name(name.removeprefix("flashoptim_"))

    def run():
        saved = triton_adam.LAUNCH
        triton_adam.LAUNCH = shape
        try:
            return bench_flashoptim(shapes, False, {})
        finally:
            triton_adam.LAUNCH = saved

    return run


def measure_copy_bandwidth():
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


if __name__ == "__main__":
    main()
