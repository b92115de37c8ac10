"""``benchmarks/gpu_profile.py``'s account of where a step leaves the GPU idle, against a count on a
grid of microseconds (CPU: the intervals are made up; the profiler's events feed it on a GPU)."""

import random

import pytest
import torch

from helpers import benchmark_module

gpu_profile = benchmark_module("gpu_profile")


def _idle_on_a_grid(start, end, kernels):
    """Idle microseconds before the first busy one, between busy ones and after the last, within
    [start, end), each microsecond busy where any kernel covers it."""
    busy = [any(k_start <= t < k_end for k_start, k_end, _ in kernels) for t in range(start, end)]
    if not any(busy):
        return end - start, 0, 0
    first = busy.index(True)
    last = len(busy) - 1 - busy[::-1].index(True)
    return first, busy[first:last + 1].count(False), len(busy) - 1 - last


@pytest.mark.parametrize("seed", range(40))
def test_idle_time_matches_a_count_on_a_grid(seed):
    rng = random.Random(seed)
    kernels = []
    for i in range(rng.randrange(0, 12)):  # some overlap (two streams), some cross the step's edges
        k_start = rng.randrange(-20, 200)
        kernels.append((k_start, k_start + rng.randrange(1, 40), f"k{i}"))
    start, end = 0, 180
    idle = gpu_profile.gpu_idle(start, end, kernels, largest=100)
    before, within, after = _idle_on_a_grid(start, end, kernels)
    assert (idle["before_first_kernel_us"], idle["within_us"], idle["after_last_kernel_us"]) == (before, within, after)
    assert sum(g[0] for g in idle["gaps"]) == within
    assert [g[0] for g in idle["gaps"]] == sorted((g[0] for g in idle["gaps"]), reverse=True)


def test_a_gap_names_the_kernels_around_it_and_where_it_falls():
    kernels = [(10, 30, "forward"), (12, 50, "other stream"), (90, 95, "optimizer"), (200, 210, "next step")]
    idle = gpu_profile.gpu_idle(0, 100, kernels)
    assert idle["before_first_kernel_us"] == 10 and idle["after_last_kernel_us"] == 5
    assert idle["gaps"] == [(40, 50, "other stream", "optimizer")]


def test_the_gpu_work_leaves_out_the_ranges_record_function_marks_on_the_gpu():
    """Kineto lists a ``record_function`` range twice, on the CPU flagged as a user annotation and on
    the GPU's timeline as a device event of the same name; only kernels, copies and sets are work."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device_type, annotation=False):
        return SimpleNamespace(key=name, name=name, device_type=device_type, is_user_annotation=annotation)

    events = [event("profiled step", cpu, True), event("profiled step", cuda), event("Optimizer.step#AdamW.step", cpu, True),
              event("Optimizer.step#AdamW.step", cuda), event("_adam_kernel", cuda), event("Memset (Unknown)", cuda),
              event("aten::mm", cpu), event("nvjet_sm90_tst", cuda)]
    assert [e.name for e in gpu_profile._device_work(events)] == ["_adam_kernel", "Memset (Unknown)", "nvjet_sm90_tst"]
