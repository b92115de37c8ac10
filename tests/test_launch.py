"""flash_inductor.launch: every spawned worker starts with NVLink multicast off, whatever the
environment it was started from said (the device notes' variables, written out here)."""

import os

import torch

from flash_inductor import launch

OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _save_environment(rank, out_dir):
    torch.save({name: os.environ.get(name) for name in OFF}, f"{out_dir}/env{rank}.pt")


def test_spawned_workers_start_with_multicast_off(monkeypatch, tmp_path):
    for name, value in OFF.items():  # the opposite of what the workers must see
        monkeypatch.setenv(name, "1" if value == "0" else "0")
    launch.spawn(_save_environment, (str(tmp_path),), nprocs=2)
    assert [torch.load(tmp_path / f"env{rank}.pt") for rank in range(2)] == [OFF, OFF]
