"""Bytes per parameter of a prepared optimizer, read off the tensors that actually hold them."""

import dataclasses

import torch

from flash_inductor import roles, sharded
from flash_inductor.formats.state_tensor import StateTensor


@dataclasses.dataclass
class MemoryReport:
    optimizer: str
    num_params: int  # number of parameter elements
    bytes: dict  # component -> bytes: weights, error_terms, states, state_scales, grads

    def per_param(self):
        return {k: v / self.num_params for k, v in self.bytes.items()}

    @property
    def total_per_param(self):
        return sum(self.bytes.values()) / self.num_params

    def __str__(self):
        per = self.per_param()
        parts = ", ".join(f"{k} {v:.4g}" for k, v in per.items())
        return (
            f"{self.optimizer}: {self.num_params:,} parameters; bytes/param: {parts}; "
            f"total {self.total_per_param:.4g}"
        )


def _nbytes(t):
    t = sharded.local(t)  # this rank's shard of a sharded (FSDP2) tensor
    return t.numel() * t.element_size()


def memory_report(model, optimizer):
    """Bytes by component for the parameters of ``optimizer`` (prepared or stock).

    ``grads`` counts the gradient tensors present now, or, when none are allocated (after
    ``zero_grad``), what they will take: one gradient of each parameter's dtype, for parameters
    that require one; with gradient release, where each gradient is freed as soon as its
    parameter is updated, the largest one. ``model`` may be None; when given, it must own the
    optimizer's parameters. Of an FSDP2-sharded model: this rank's shards (bytes and parameter count).
    Of an optimizer with flat buckets (flash_inductor/flat.py): the bytes of their buffers, padding
    included, and ``grads`` their gradient buffers (held between steps or not; none for a bucket of
    frozen parameters).
    """
    record = roles.PREPARED.get(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is not None:
        owned = {id(p) for p in model.parameters()}
        foreign = sum(id(p) not in owned for p in params)
        if foreign:
            raise ValueError(f"memory_report: {foreign} optimizer parameters are not parameters of the model")
    if record is not None and record.buckets:
        return _flat_report(optimizer, record, params)
    sizes = dict.fromkeys(("weights", "error_terms", "states", "state_scales", "grads"), 0)
    released = record is not None and record.gradient_release is not None
    for p in params:
        sizes["weights"] += _nbytes(p)
        if p.grad is not None:
            sizes["grads"] += _nbytes(p.grad)
        elif p.requires_grad and released:
            sizes["grads"] = max(sizes["grads"], _nbytes(p))
        elif p.requires_grad:
            sizes["grads"] += _nbytes(p)
        if record is not None and record.error_term(p) is not None:
            sizes["error_terms"] += _nbytes(record.error_term(p))
        for key, value in optimizer.state.get(p, {}).items():
            value = sharded.local(value)
            if isinstance(value, StateTensor):
                for component, n in value.stored_bytes().items():
                    sizes[component] += n
            elif isinstance(value, torch.Tensor) and key != "step":
                sizes["states"] += _nbytes(value)
    return MemoryReport(type(optimizer).__name__, sum(sharded.local(p).numel() for p in params), sizes)


def _flat_report(optimizer, record, params):
    """Of flat buckets: their buffers' bytes, padding included (gradients: the flat buffer, held
    or not between steps; with gradient release, the largest gradient)."""
    sizes = {}
    for bucket in record.buckets:
        for key, n in bucket.nbytes().items():
            sizes[key] = sizes.get(key, 0) + n
    if record.gradient_release is not None:  # each gradient is freed once its parameter is updated
        sizes["grads"] = max((_nbytes(p) for p in params if p.requires_grad), default=0)
    return MemoryReport(type(optimizer).__name__, sum(p.numel() for p in params), sizes)
