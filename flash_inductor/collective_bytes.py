"""Bytes a rank sends through functional collectives, counted while they run.

    with CollectiveBytes() as sent:
        step(x, y)
    sent.total, sent.by_op      # bytes this rank put on the wire, overall and per collective op

It reads torch's profiler events of the ``_c10d_functional`` ops (with their input shapes and
dtypes), so it sees eager calls, graphs the backend runs with ``compiler="eager"`` and the code
Inductor generates alike; a ``TorchDispatchMode`` would not do: Dynamo runs the original,
uncompiled code while one is active. Of the eager ``torch.distributed`` calls it counts the
tensor all-gathers and reduce-scatters (``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``:
FSDP2's collectives, whose events record their tensors); eager all-reduces (DDP's C++ reducer)
are not counted: their events record no shapes.

Bytes per call are those of the bandwidth-optimal algorithms (ring; NCCL-tests' "bus bytes"),
from the input's size ``B`` and the group size ``n``, whatever the backend really does:

    all_reduce              2 (n-1)/n * B      (reduce-scatter, then all-gather)
    reduce_scatter_tensor     (n-1)/n * B
    all_gather_into_tensor    (n-1)   * B      (B is this rank's piece)
    all_to_all_single       B minus the piece this rank keeps
"""

import collections
import math

import torch
import torch.distributed as dist

_ITEM_BYTES = {  # the profiler's dtype names
    "double": 8, "float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
    "unsigned char": 1, "signed char": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}
_PREFIX = "_c10d_functional::"
# Eager c10d ops counted: event name -> (op, position of the input among the event's tensors).
_EAGER = {"c10d::_allgather_base_": ("all_gather_into_tensor", 1),
          "c10d::_reduce_scatter_base_": ("reduce_scatter_tensor", 1)}


def bytes_sent(op, size, input_splits, n, rank):
    """Bytes one rank of ``n`` sends for the collective ``op`` (its name without namespace) whose
    input has ``size`` bytes (``input_splits``: all_to_all_single's, or None for equal pieces)."""
    if op in ("all_reduce", "all_reduce_"):
        return 2 * (n - 1) * size // n
    if op == "reduce_scatter_tensor":
        return (n - 1) * size // n
    if op == "all_gather_into_tensor":
        return (n - 1) * size
    if op == "all_to_all_single":
        kept = size // n if not input_splits else size * input_splits[rank] // sum(input_splits)
        return size - kept
    return None


class CollectiveBytes:
    """Adds up ``bytes_sent`` of every functional collective run inside the ``with`` block, for
    ranks of ``group`` (default: the world)."""

    def __init__(self, group=None):
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.by_op = collections.Counter()
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)

    @property
    def total(self):
        return sum(self.by_op.values())

    def __enter__(self):
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc):
        self._profiler.__exit__(*exc)
        for event in self._profiler.events():
            if event.name in _EAGER:
                op, position = _EAGER[event.name]
            elif event.name.startswith(_PREFIX) and event.name != _PREFIX + "wait_tensor":
                op, position = event.name[len(_PREFIX):], 0
            else:
                continue
            dtype = event.input_dtypes[position]
            if dtype not in _ITEM_BYTES:
                raise ValueError(f"CollectiveBytes: unknown dtype {dtype!r} of {event.name}; add its size to _ITEM_BYTES")
            size = math.prod(event.input_shapes[position]) * _ITEM_BYTES[dtype]
            splits = event.concrete_inputs[2] if op == "all_to_all_single" else None
            sent = bytes_sent(op, size, splits, self.n, self.rank)
            if sent is None:
                raise ValueError(f"CollectiveBytes: no byte count for {event.name}")
            self.by_op[op] += sent
        return False
