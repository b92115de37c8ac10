"""FP8 weight all-gather under FSDP2 (option ``fp8_all_gather``; FP8-LM's "FP8 ZeRO", torchao's
float8 all-gather): the forward's all-gathers move 1 byte per weight element instead of bf16's 2.

``prepare_fp8(model, fp8="tensorwise", fp8_all_gather=True)`` (after ``fully_shard``, before the first
forward) wraps the local shard of every FP8 linear's weight (``nn.Linear`` weights that run in FP8 under
the options, as ``fp8_linear.ineligible_reason`` decides) in an ``Fp8AllGatherShard``. FSDP2 calls its
all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the local tensor of the
sharded parameter) at every all-gather::

    amax_g  = all_reduce(stack(max |shard_i| for the group's weights i), MAX)      one collective per group
    scale_i = fp8_max / max(amax_g[i], 1e-12)         the scale of the whole weight i, on every rank
    payload = uint8 bytes of e4m3(clamp(shard_i * scale_i))   padded to FSDP2's padded shard rows
    -- FSDP2's all-gather (1 byte per element) --
    weight  = Fp8Weight(gathered[:rows] viewed as e4m3, scale_i)      the unsharded parameter

``fp8_linear`` multiplies with the gathered e4m3 data and the scale as they are (no second cast).
Its cast of the whole weight would give the same bits: the max of the shards' amaxes is the whole
weight's amax, and the cast is elementwise; so the forward and backward equal those of FP8 linears
over a bf16 all-gather bit for bit (tests/test_fp8_all_gather.py).

Why here: FSDP2 casts nothing itself; what it gathers is decided by the local tensor's hooks, and the
only way to give the forward fewer bytes is to cast before the collective. The group's scales come
from one all-reduce of its amaxes (``ScaleGroup``), computed when the group is gathered, so they are
never stale (a scale computed after the optimizer step, as torchao's precompute does, would have to
be called by the user and recomputed after every load). gloo refuses float8 tensors (DESIGN §2.5), so
the payload is a ``uint8`` view.

The shard stays the bf16 tensor it was: the wrapper runs every op on it (``local``), and the
prepared optimizer's local step, checkpoints and ``memory_report`` see it through ``sharded.local``.
Only tensorwise scaling: the scale must be a function of the weight alone (delayed scaling keeps a
per-layer history that the hooks cannot update in step with the compiled forward).
"""

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_leaves, tree_map

from flash_inductor.formats import fp8
from flash_inductor.formats.fp8_weight import Fp8Weight
from flash_inductor.fp8_linear import ineligible_reason, layer_weight

_aten = torch.ops.aten
# Ops whose result is the same shard, which FSDP2 and DTensor make when they pad, narrow, view and
# cast it; every other op gives a plain tensor.
_KEEPS_SHARD = {
    _aten.detach.default, _aten.alias.default, _aten.view.default, _aten._unsafe_view.default,
    _aten.as_strided.default, _aten.slice.Tensor, _aten.clone.default, _aten._to_copy.default,
    _aten.new_zeros.default, _aten.empty_like.default, _aten.zeros_like.default,
}


class ScaleGroup:
    """The FP8-gathered weights of one ``fully_shard`` module, and the scales they are gathered with.

    The first member asked for its payload computes every member's shard amax and all-reduces them
    with MAX in one collective. FSDP2 gathers every parameter of the module at each all-gather, so a
    round ends when each member took its scale; a member asked again starts a new round (the same on
    every rank: all ranks gather the same groups in the same order).
    """

    def __init__(self, params, process_group, power_of_two):
        self.params = params  # the sharded (DTensor) parameters
        self.group_name = process_group.group_name
        self.power_of_two = power_of_two
        self.scales = None
        self.left = set()

    def scale(self, index):
        if index not in self.left:
            amaxes = torch.stack([fp8.amax(unwrap_shard(p._local_tensor)) for p in self.params])
            amaxes = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(amaxes, "max", self.group_name))
            self.scales = fp8.scale_from_amax(amaxes, fp8.E4M3, power_of_two=self.power_of_two)
            self.left = set(range(len(self.params)))
        self.left.discard(index)
        return self.scales[index]


class Fp8AllGatherShard(torch.Tensor):
    """A rank's shard of an FP8-gathered weight (the local tensor of its DTensor parameter): the plain
    shard ``local`` in every op, plus FSDP2's all-gather extension."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local, group, index):
        return torch.Tensor._make_wrapper_subclass(cls, local.shape, strides=local.stride(), dtype=local.dtype,
                                                   device=local.device, requires_grad=False)

    def __init__(self, local, group, index):
        self.local = local
        self.group = group
        self.index = index

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shard = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, Fp8AllGatherShard))
        out = func(*tree_map(unwrap_shard, args), **tree_map(unwrap_shard, kwargs))
        first = func._schema.arguments[0] if func._schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write:
            return args[0]  # written in place (a loaded value copied in): it stays the shard
        if func in _KEEPS_SHARD:
            return Fp8AllGatherShard(out, shard.group, shard.index)
        return out

    def untyped_storage(self):
        return self.local.untyped_storage()  # FSDP2 compares storages when it re-pads a shard

    def __reduce_ex__(self, protocol):
        return self.local.__reduce_ex__(protocol)  # saved (torch.save, DCP) as the plain shard

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        scale = self.group.scale(self.index)
        # FSDP2 wants every rank's payload as large as the largest shard (rows split as torch.chunk).
        padded_rows = -(-outer_size[0] // mesh.size())
        payload = torch.zeros((padded_rows, *self.shape[1:]), dtype=torch.uint8, device=self.device)
        payload[: self.shape[0]] = fp8.cast_to_fp8(self.local, scale, fp8.E4M3).view(torch.uint8)
        return (payload,), (scale, outer_size[0])

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,), (scale, rows) = all_gather_outputs, metadata
        qdata = gathered[:rows].view(fp8.E4M3)
        if out is None:
            return Fp8Weight(qdata, scale.clone(), param_dtype), ()
        # Later all-gathers refill the unsharded parameter that autograd may have saved, in place:
        # FSDP2 gathers into the same buffer (qdata is a view of it), so only the scale moves.
        with torch.autograd._unsafe_preserve_version_counter(out.scale):
            out.scale.copy_(scale)
        if out.qdata.data_ptr() != qdata.data_ptr():
            with torch.autograd._unsafe_preserve_version_counter(out.qdata):
                out.qdata.copy_(qdata)
        return None

    def __repr__(self):
        return f"Fp8AllGatherShard({self.local!r})"


def unwrap_shard(t):
    """The plain shard inside an ``Fp8AllGatherShard``; any other value as it is."""
    return t.local if isinstance(t, Fp8AllGatherShard) else t


def add(model: nn.Module, opts):
    """``prepare_fp8`` (flash_inductor/backend.py) with ``fp8_all_gather=True``, the options parsed:
    wrap the local shard of every FP8 linear's weight of ``model``, in place; returns ``model``.
    Wrapped shards stay as they are (calling it again is harmless)."""
    groups = {}
    for owner, name, weight in _fp8_linear_weights(model, opts):
        if weight.placements != (Shard(0),):
            raise ValueError(f"fp8_all_gather: '{name}' is sharded as {weight.placements}; FP8 all-gather supports "
                             "fully_shard's default Shard(0) only")
        groups.setdefault(owner, {})[id(weight)] = weight  # a weight shared by two layers: once
    if not groups:
        raise ValueError("fp8_all_gather: no nn.Linear weight that runs in FP8 under these options is sharded by "
                         "fully_shard; call prepare_fp8 after fully_shard(model), with the backend's fp8 options")
    for weights in groups.values():
        params = list(weights.values())
        group = ScaleGroup(params, params[0].device_mesh.get_group(), opts.fp8_power_of_two_scales)
        for index, p in enumerate(params):
            if isinstance(p._local_tensor, Fp8AllGatherShard):
                continue
            shard = Fp8AllGatherShard(p._local_tensor, group, index)
            wrapped = DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                         stride=p.stride())
            # The same Parameter object (the optimizer holds it), now over the wrapped shard.
            torch.utils.swap_tensors(p, nn.Parameter(wrapped, requires_grad=p.requires_grad))
    return model


def _fp8_linear_weights(model, opts):
    """(innermost fully_shard module above it, name, weight) of each ``nn.Linear`` of ``model`` with a
    sharded weight that runs in FP8 under ``opts``."""

    def walk(module, name, owner):
        if isinstance(module, FSDPModule):
            owner = module
        weight = layer_weight(module)
        if isinstance(weight, DTensor) and owner is not None and ineligible_reason(weight, name, opts) is None:
            yield owner, f"{name}.weight" if name else "weight", weight
        for child_name, child in module.named_children():
            yield from walk(child, f"{name}.{child_name}" if name else child_name, owner)

    yield from walk(model, "", None)
