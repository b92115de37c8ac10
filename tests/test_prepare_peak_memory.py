"""``prepare``'s own peak memory (issue 14: a model that fits must not fail at start-up), counted
exactly on the CPU by the profiler's allocator events, and the chunked split of the masters giving
the bits of one whole split."""

import importlib

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

import flash_inductor
from flash_inductor.formats import split_weights
from helpers import allocations_in

prepare_module = importlib.import_module("flash_inductor.prepare")


@pytest.mark.parametrize("gradient_release", [False, True])
def test_prepare_peaks_at_the_stored_bytes_and_one_gradient_buffer(monkeypatch, gradient_release):
    """Built inside the profiled region, every byte is counted (the fp32 model's frees too), and
    ``prepare``'s most is measured above the fp32 model (4 B/param): at most the stored bytes with
    one flat gradient buffer (7.125 B/param, before that buffer is released) plus one chunk's
    temporaries. Before the flat buffers were laid out one kind at a time and the masters split in
    chunks it reached 14.25 B/param: every per-parameter tensor next to every flat buffer, and a
    whole parameter's fp32 temporaries."""
    monkeypatch.setattr(prepare_module, "ENCODE_CHUNK", 1 << 14)
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with record_function("prepare"):
            flash_inductor.prepare(model, opt, gradient_release=gradient_release)
    n = sum(p.numel() for p in model.parameters())
    events = allocations_in(prof, "prepare")
    before = events[0][1] - events[0][0]  # the allocator's total (counted since the profiler first ran) before prepare
    peak = max(total for _, total in events)
    assert sum(size for size, _ in events) == pytest.approx(1.125 * n, rel=0.01)  # 4 B/param fp32 -> 5.125 stored
    chunk_temporaries = 64 * prepare_module.ENCODE_CHUNK
    assert peak - before <= 3.125 * n + chunk_temporaries, (peak - before) / n  # 4 + 3.125 = 7.125 B/param


def test_chunked_split_gives_the_bits_of_one_split(monkeypatch):
    monkeypatch.setattr(prepare_module, "ENCODE_CHUNK", 100)  # several chunks of every tensor but the scalar
    torch.manual_seed(0)
    module = nn.Module()
    for name, shape in {"matrix": (300, 70), "vector": (1000,), "cube": (4, 50, 30), "scalar": (), "empty": (0,)}.items():
        module.register_parameter(name, nn.Parameter(torch.randn(shape) * 3))
    expected = {name: split_weights.encode(p.detach().clone(), torch.bfloat16, torch.int8) for name, p in module.named_parameters()}
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    flash_inductor.prepare(module, opt)
    record = prepare_module.prepared(opt)
    for name, p in module.named_parameters():
        hi, lo = expected[name]
        assert torch.equal(p.detach(), hi) and p.shape == hi.shape, name
        assert torch.equal(record.error_term(p), lo), name
