"""Prepared optimizers over FSDP2-sharded parameters (``fully_shard``: DTensor parameters).

FSDP2 keeps each parameter as a DTensor sharded on one dimension: a rank holds one shard (the
DTensor's local tensor) and, after the backward, that shard of the gradient. Every supported
optimizer is elementwise, so a rank's shard is updated from its gradient shard alone, and
everything ``prepare`` adds is kept per local shard:

- the parameter's local tensor becomes bf16, so FSDP2 all-gathers (and reduce-scatters) bf16;
- its error term and 8-bit states are encoded from the local shard (groups of 32 of the local
  tensor, flattened) and shown to the user's optimizer as DTensors with the parameter's
  placements (``opt.state[p]["exp_avg"]`` wraps a ``CompandedState``), so state dicts and
  ``torch.distributed.checkpoint`` see sharded tensors;
- the step runs a *local optimizer* (flash_inductor/sharded_step.py): the same class and
  hyperparameters over the local tensors, with the local states and error terms, compiled through
  the backend exactly as for an unsharded model. The passes never see a DTensor.

This module holds the DTensor helpers every other module uses on such tensors.
"""


import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from flash_inductor.formats import companded
from flash_inductor.fp8_all_gather import unwrap_shard


def is_sharded(t):
    return isinstance(t, DTensor)


def data_parallel(param):
    """A plain (not DTensor) parameter in a multi-process run: replicated, its gradient local (until
    DDP all-reduces it)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return False
    return not is_sharded(param)


def local(t):
    """The rank's shard of a DTensor (the tensor object itself, which FSDP2 updates in place and
    the local optimizer is keyed by; the bf16 shard inside an FP8 all-gather wrapper,
    flash_inductor/fp8_all_gather.py); any other value as it is."""
    return unwrap_shard(t._local_tensor) if isinstance(t, DTensor) else t


def like(ref, t):
    """``t``, a local shard shaped like ``ref``'s, as a DTensor with ``ref``'s placements (``t``
    itself when ``ref`` is not a DTensor)."""
    if not isinstance(ref, DTensor):
        return t
    return DTensor.from_local(t, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride())


def shard_like(ref, value):
    """``value`` (a whole tensor, or a DTensor) with ``ref``'s sharding, when ``ref`` is a
    DTensor; a whole tensor is cut locally on each rank (no communication)."""
    if not isinstance(ref, DTensor):
        return value
    if isinstance(value, DTensor):
        return value.redistribute(ref.device_mesh, ref.placements)
    return distribute_tensor(value, ref.device_mesh, ref.placements, src_data_rank=None)


def check_fsdp_not_started(model, call="prepare(model, optimizer)"):
    """``prepare`` casts parameters to bf16 and ``prepare_fp8(..., fp8_all_gather=True)`` gives the shards
    all-gather hooks; FSDP2 adopts new local tensors (their dtype, their hooks) only in its lazy
    initialisation, at the first forward. After it, it would keep all-gathering the old shards.
    ``call``: what to call before the first forward, for the message."""
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        # FSDPState._is_root stays None until the lazy initialisation (all FSDP2 releases so far).
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._is_root is not None:
            raise ValueError(
                f"flash_inductor.{call.partition('(')[0]}: the fully_shard-ed module '{name or type(module).__name__}' "
                f"already ran a forward; call {call} after fully_shard and before the first forward"
            )


def check_fsdp_groups_keep_one_dtype(model, keeps_fp32):
    """FSDP2 needs one dtype among the parameters of each ``fully_shard`` call; refuse (before
    anything changes) a model where ``prepare`` would cast some of them to bf16 and keep others
    fp32 (normalization layers, ``keep_fp32``). ``keeps_fp32(name, module)`` is prepare's rule."""
    from torch.distributed.fsdp import FSDPModule

    def managed(module, name, owner):
        """(fully_shard module, parameter name, dtype after prepare) of each parameter below
        ``module``; a parameter belongs to the innermost fully_shard module above it."""
        if isinstance(module, FSDPModule):
            owner = name or "<root>"
        for param_name, p in module.named_parameters(recurse=False):
            cast = p.dtype == torch.float32 and not keeps_fp32(name, module)
            yield owner, f"{name}.{param_name}" if name else param_name, torch.bfloat16 if cast else p.dtype
        for child_name, child in module.named_children():
            yield from managed(child, f"{name}.{child_name}" if name else child_name, owner)

    dtypes = {}
    for owner, param_name, dtype in managed(model, "", None):
        if owner is not None:
            dtypes.setdefault(owner, {}).setdefault(dtype, []).append(param_name)
    for owner, by_dtype in dtypes.items():
        if len(by_dtype) > 1:
            listed = "; ".join(f"{dtype}: {', '.join(names)}" for dtype, names in by_dtype.items())
            raise ValueError(
                f"flash_inductor.prepare: the parameters fully_shard('{owner}') manages would get different dtypes "
                f"({listed}), and FSDP2 needs one dtype per fully_shard call; call fully_shard on the modules that "
                "stay fp32 (normalization layers, keep_fp32) separately, before fully_shard on their parent"
            )


def cast_parameter(p, dtype):
    """Give DTensor parameter ``p`` a ``dtype`` local shard, keeping the Parameter object; return
    its previous value. ``p.data = ...`` would not do: it leaves a DTensor's local tensor as it
    was. FSDP2 picks the new local tensor up in its lazy initialisation (first forward)."""
    cast = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, cast)
    return cast.detach()


def groups_like(ref, t, name):
    """``t``, one row per group of 32 of ``ref``'s local shard (8-bit codes ``(groups, 32)`` or
    scales ``(groups,)``), as a DTensor sharded on dim 0 (``t`` itself when ``ref`` is not a
    DTensor): how compressed state dicts save a sharded state.

    Each rank's groups must be the rows DTensor assigns it, which holds when the shards split
    the parameter into whole groups evenly (e.g. even FSDP2 shards of a multiple of 32 elements);
    the rows are then exactly the groups of the unsharded parameter.
    """
    if not isinstance(ref, DTensor):
        return t
    world = ref.device_mesh.size()
    row_numel = ref.numel() // max(ref.shape[0], 1)
    elements = [rows * row_numel for rows in _chunk_sizes(ref.shape[0], world)]
    groups = [n // companded.GROUP_SIZE for n in elements]
    if (
        ref.placements != (Shard(0),)
        or any(n % companded.GROUP_SIZE for n in elements)
        or groups != _chunk_sizes(sum(groups), world)
    ):
        raise ValueError(
            f"state_dict: parameter '{name}' (shape {list(ref.shape)}, placements {ref.placements}) is not split "
            f"into whole groups of {companded.GROUP_SIZE} elements evenly across {world} ranks, so its compressed "
            "8-bit state cannot be saved as one sharded tensor; use prepare(..., compressed_state_dict=False) "
            "(decoded fp32 states)"
        )
    # t is contiguous and only its dim 0 differs from the whole tensor's: same strides.
    return DTensor.from_local(t, ref.device_mesh, [Shard(0)], run_check=False, shape=(sum(groups), *t.shape[1:]),
                              stride=t.stride())


def _chunk_sizes(n, world):
    """Rows per rank when ``n`` rows are split like ``torch.chunk`` (FSDP2's and DTensor's rule)."""
    sizes = [len(c) for c in torch.arange(n).chunk(world)] if n else []
    return sizes + [0] * (world - len(sizes))
