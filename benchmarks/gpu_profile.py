"""The GPU kernels one call of a function runs, by total time (``torch.profiler``), for the benchmarks."""

import torch


def kernel_times(fn, top=4):
    """The ``top`` GPU kernels of one call of ``fn`` by total time: (name's last 48 characters, calls, µs)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    return [(e.key[-48:], e.count, round(e.device_time_total, 1)) for e in events[:top]]
