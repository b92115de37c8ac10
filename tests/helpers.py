"""Small models and settings shared by the tests."""

import contextlib
import importlib.util
import math
import pathlib
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from flash_inductor import launch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name):
    """``benchmarks/{name}.py`` imported as a module, for tests of a benchmark script's logic; its
    sibling imports resolve as when it runs as a script."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def one_thread():
    """torch on one CPU thread: for many small ops, where threads cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# Run prepared optimizers' steps through the rewritten graph without Inductor: the same passes,
# no 15-35 s kernel compile per test.
EAGER = {"compiler": "eager"}

# The process-group backends the multi-process tests run on: gloo on the CPU (always), NCCL with one
# GPU per rank (marked gpu; skipped with fewer than 2 GPUs). Parametrize a module fixture with them.
BACKENDS = ["gloo", pytest.param("nccl", marks=[
    pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")])]


def run_ranks(worker, backend, world, *args):
    """Runs ``worker(rank, out_dir, *args)`` in ``world`` processes of a ``backend`` process group
    (NCCL: rank r on cuda:r, NVLink multicast off) and returns what each returned, on the CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        launch.spawn(_rank_main, (worker, backend, world, tmp, args), nprocs=world)
        return [torch.load(f"{tmp}/rank{r}.pt", weights_only=False, map_location="cpu") for r in range(world)]


def _rank_main(rank, worker, backend, world, tmp, args):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        torch.save(worker(rank, tmp, *args), f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def on_gpus():
    """Whether this process is a rank of an NCCL process group (its tensors then live on its GPU)."""
    return dist.is_initialized() and dist.get_backend() == "nccl"


def rank_device():
    return torch.device("cuda", torch.cuda.current_device()) if on_gpus() else torch.device("cpu")


def step_options():
    """Prepared optimizers' compile options: op by op on the CPU (no kernel compile per test), the
    Triton step on GPUs."""
    return {} if on_gpus() else EAGER


class Net(nn.Module):
    """fc1.weight 8192 elements (8-bit states), fc1.bias 64 (fp32 states), LayerNorm (stays fp32),
    fc2.weight 6144 (8-bit states); ``extra`` adds one more parameter or module."""

    def __init__(self, extra=None):
        super().__init__()
        self.fc1 = nn.Linear(128, 64)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 96, bias=False)
        if extra is not None:
            self.extra = extra

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


def decisions_of(report, kind="model"):
    """{subject: decision} of the ``kind`` graph of an inspection report (every pass's decisions)."""
    return {subject: decision for _, subject, decision in report.graph(kind).decisions}


def bits(t):
    """A tensor's bits as integers (nan equals nan; float8 has no ``torch.equal`` for nan)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(a, b):
    """Two ``stored_bits`` dicts hold the same tensors, bit for bit."""
    assert a.keys() == b.keys()
    assert not [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(bits(a[k]), bits(b[k]))]


def stored_bits(model, opt):
    """Every stored tensor of the training state, by name: parameters, error terms, and each
    optimizer state in its stored form (codes and scales, fp32 values, step counters). Of sharded
    (DTensor) parameters: this rank's shards."""
    from flash_inductor import roles

    def shard(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    record = roles.PREPARED.get(opt)
    out = {}
    for name, p in model.named_parameters():
        out[name] = shard(p.detach()).clone()
        if record is not None and record.error_term(p) is not None:
            out[name + ".error"] = shard(record.error_term(p)).clone()
        for key, value in opt.state.get(p, {}).items():
            value = shard(value)
            if hasattr(value, "__tensor_flatten__"):
                for inner in value.__tensor_flatten__()[0]:
                    out[f"{name}.{key}.{inner}"] = getattr(value, inner).clone()
            else:
                out[f"{name}.{key}"] = value.clone()
    return out


def ref_decode_state(codes, scales, shape, kind):
    """DESIGN §2.2 decode of companded codes, in float64 (written from the spec, not the package)."""
    q = codes.double().reshape(-1, 32)
    s = scales.double().reshape(-1, 1)
    if kind == "signed":
        y = q / 127
        x = y / (2 - y.abs()) * s
    else:
        x = (q / 255 * s) ** 2
    return x.reshape(-1)[: math.prod(shape)].reshape(shape)


def snapshot(model, opt):
    """Every stored bit: parameters, error terms, states (their stored form), lr."""
    out = stored_bits(model, opt)
    for i, group in enumerate(opt.param_groups):
        out[f"lr{i}"] = torch.as_tensor(group["lr"]).clone()
    return out


def assert_unchanged(before, after):
    assert before.keys() == after.keys()
    changed = [k for k in before if before[k].dtype != after[k].dtype or not torch.equal(before[k], after[k])]
    assert not changed, f"changed: {changed}"


def bf16_batches(in_features, steps=3):
    """``steps`` batches of 8 bf16 inputs of ``in_features``, the same at every call."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, in_features, generator=gen, dtype=torch.bfloat16) for _ in range(steps)]


def square_loss(model, x):
    """A loss of ``model``'s output alone (mean square, in fp32)."""
    return model(x).float().square().mean()


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def allocations_in(prof, scope):
    """(bytes, the allocator's total after it) of each allocation under ``record_function(scope)`` of a
    ``torch.profiler.profile(profile_memory=True)`` run, in order."""
    from torch._C._profiler import _EventType

    root = next(e for e in _walk(prof.profiler.kineto_results.experimental_event_tree()) if e.name == scope)
    events = sorted((e for e in _walk([root]) if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    return [(e.extra_fields.alloc_size, e.extra_fields.total_allocated) for e in events]
