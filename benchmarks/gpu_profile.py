"""The GPU kernels one call of a function runs, by total time (``torch.profiler``), for the benchmarks."""

import time

import torch


def _profiled(fn, calls, cpu):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def kernel_times(fn, top=4):
    """The ``top`` GPU kernels of one call of ``fn`` by total time: (name's last 48 characters, calls, µs)."""
    events = [e for e in _profiled(fn, 1, cpu=False) if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    return [(e.key[-48:], e.count, round(e.device_time_total, 1)) for e in events[:top]]


def step_profile(fn, calls=5, top=25):
    """Where ``calls`` calls of ``fn`` (a train step that waits for its result) spend their time, per
    call: wall ms, GPU busy ms (kernel time summed; one stream), the ``top`` GPU kernels and the
    ``top`` CPU operators by self time, as (name's last 100 characters, calls, µs per step). A wall
    time well above GPU busy means the step waits on the CPU (launches, Python, guards)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / calls
    events = _profiled(fn, calls, cpu=True)
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: -e.device_time_total)
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)

    def rows(chosen, total):
        return [(e.key[-100:], e.count // calls, round(total(e) / calls, 1)) for e in chosen[:top]]

    return dict(wall_ms=round(wall_ms, 3), gpu_busy_ms=round(sum(e.device_time_total for e in gpu) / calls / 1e3, 3),
                gpu_kernels=rows(gpu, lambda e: e.device_time_total), cpu_self=rows(cpu, lambda e: e.self_cpu_time_total))


def print_profile(profile, indent="  "):
    """``step_profile``'s result as the benchmarks print it."""
    print(f"{indent}profile: wall {profile['wall_ms']:.2f} ms per step, GPU busy {profile['gpu_busy_ms']:.2f} ms")
    for title, rows in (("GPU kernels", profile["gpu_kernels"]), ("CPU operators (self)", profile["cpu_self"])):
        print(f"{indent}  {title}: calls per step, us per step")
        for name, calls, us in rows:
            print(f"{indent}    {us:10.1f} {calls:5d}  {name}")
