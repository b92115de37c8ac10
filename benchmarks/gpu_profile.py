"""The GPU kernels one call of a function runs, by total time (``torch.profiler``), for the benchmarks."""

import statistics
import time

import torch

_STEP = "profiled step"


def _profiled(fn, calls, cpu):
    """The profiler's events of ``calls`` calls of ``fn``, each call in a ``_STEP`` range where ``cpu``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            with record_function(_STEP):
                fn()
        torch.cuda.synchronize()
    return prof.events()


def kernel_times(fn, top=4):
    """The ``top`` GPU kernels of one call of ``fn`` by total time: (name's last 48 characters, calls, µs)."""
    events = _device_work(_profiled(fn, 1, cpu=False).key_averages())
    events.sort(key=lambda e: -e.device_time_total)
    return [(e.key[-48:], e.count, round(e.device_time_total, 1)) for e in events[:top]]


def step_profile(fn, calls=5, top=25):
    """Where ``calls`` calls of ``fn`` (a train step that waits for its result) spend their time, per
    call: wall ms, GPU busy ms (kernel time summed; one stream), the ``top`` GPU kernels and the
    ``top`` CPU operators by self time, as (name's last 100 characters, calls, µs per step), and where in
    a step the GPU idles (``gpu_idle``: medians over the calls, the gaps of the first). A wall time well
    above GPU busy means the step waits on the CPU (launches, Python, guards)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / calls
    raw = _profiled(fn, calls, cpu=True)
    events = raw.key_averages()
    gpu = sorted(_device_work(events), key=lambda e: -e.device_time_total)
    cpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)

    def rows(chosen, total):
        return [(e.key[-100:], e.count // calls, round(total(e) / calls, 1)) for e in chosen[:top]]

    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in _device_work(raw)]
    steps = [gpu_idle(e.time_range.start, e.time_range.end, kernels) for e in raw
             if e.name == _STEP and e.device_type == torch.autograd.DeviceType.CPU]
    idle = {key: round(statistics.median(s[key] for s in steps), 1)
            for key in ("before_first_kernel_us", "within_us", "after_last_kernel_us")}
    idle["gaps"] = steps[0]["gaps"]
    return dict(wall_ms=round(wall_ms, 3), gpu_busy_ms=round(sum(e.device_time_total for e in gpu) / calls / 1e3, 3),
                gpu_kernels=rows(gpu, lambda e: e.device_time_total), cpu_self=rows(cpu, lambda e: e.self_cpu_time_total),
                gpu_idle=idle)


def _device_work(events):
    """The events (or their averages) of work on the GPU: kernels, copies and sets. Not the ranges that
    ``record_function`` marks on the GPU's timeline as well (``profiled step``, the optimizer's step),
    which Kineto lists among the device's events: each spans kernels counted already, and a step's
    range would cover all its gaps."""
    annotations = {e.key for e in events if getattr(e, "is_user_annotation", False)}
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.key not in annotations]


def gpu_idle(start, end, kernels, largest=5):
    """Where the GPU idles within one step, from ``start`` to ``end`` (µs on the profiler's clock),
    given ``kernels`` as (start, end, name) on that clock in any order (those of other steps too;
    overlapping ones, from several streams, count once): the idle time before the step's first kernel,
    between its first kernel's start and its last kernel's end, and after that until the step ends,
    and the ``largest`` gaps between as (µs, offset from ``start`` in µs, the kernel that ended before
    it, the kernel that starts it), longest first."""
    inside = sorted(k for k in kernels if k[1] > start and k[0] < end)
    if not inside:
        return dict(before_first_kernel_us=end - start, within_us=0.0, after_last_kernel_us=0.0, gaps=[])
    gaps = []
    busy_until, last = inside[0][1], inside[0]
    for kernel in inside[1:]:
        if kernel[0] > busy_until:
            gaps.append((kernel[0] - busy_until, busy_until - start, last[2], kernel[2]))
        if kernel[1] > busy_until:
            busy_until, last = kernel[1], kernel
    gaps.sort(key=lambda g: -g[0])
    return dict(before_first_kernel_us=max(inside[0][0] - start, 0.0), within_us=sum(g[0] for g in gaps),
                after_last_kernel_us=max(end - busy_until, 0.0), gaps=gaps[:largest])


def print_profile(profile, indent="  "):
    """``step_profile``'s result as the benchmarks print it."""
    print(f"{indent}profile: wall {profile['wall_ms']:.2f} ms per step, GPU busy {profile['gpu_busy_ms']:.2f} ms")
    for title, rows in (("GPU kernels", profile["gpu_kernels"]), ("CPU operators (self)", profile["cpu_self"])):
        print(f"{indent}  {title}: calls per step, us per step")
        for name, calls, us in rows:
            print(f"{indent}    {us:10.1f} {calls:5d}  {name}")
    idle = profile["gpu_idle"]
    print(f"{indent}  GPU idle per step: {idle['before_first_kernel_us']:.1f} us before its first kernel, "
          f"{idle['within_us']:.1f} between kernels, {idle['after_last_kernel_us']:.1f} after its last; longest gaps:")
    for us, at, before, after in idle["gaps"]:
        print(f"{indent}    {us:10.1f} us at +{at / 1e3:.2f} ms, after {before[-60:]}, before {after[-60:]}")
