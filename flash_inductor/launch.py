"""Starting the processes of a multi-GPU run with NVLink multicast off.

NVLink SHARP / multicast (NCCL's NVLS algorithms, symmetric memory, NVSHMEM) must stay off on the
machines we are lent: every process that may start a process group gets ``MULTICAST_OFF`` in its
environment before it does. ``spawn`` sets it in this process (spawned workers inherit it) and
again in each worker, before the worker's function runs.
"""

import os

import torch.multiprocessing as mp

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def turn_multicast_off():
    os.environ.update(MULTICAST_OFF)


def _run(rank, fn, args):
    turn_multicast_off()
    fn(rank, *args)


def spawn(fn, args, nprocs):
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with ``MULTICAST_OFF`` set in every process."""
    turn_multicast_off()
    mp.spawn(_run, args=(fn, args), nprocs=nprocs)
