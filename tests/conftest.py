import tempfile

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """Each test compiles from scratch (and Dynamo's counters start at zero)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo process group for the module's tests (FSDP2 in this process, no spawn)."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
