"""A weight held in e4m3 with its per-tensor scale, presenting itself as the high-precision weight.

``Fp8Weight(qdata, scale, dtype)`` stands for ``dequantize(qdata, scale)`` in ``dtype`` (bf16):
``qdata = cast_to_fp8(w, scale, e4m3)`` of the whole weight and ``scale = fp8_max / amax(w)``
(``formats.fp8``). It is what FSDP2 builds from an FP8 all-gather (``flash_inductor/fp8_all_gather.py``):
the unsharded parameter of the forward and backward. ``fp8_linear`` multiplies with ``qdata`` and
``scale`` directly, exactly as it would have cast the weight itself; any other use (an op that is
not an FP8 linear, a layer left in bf16) reads the dequantized weight, so the results are those of
the e4m3-rounded weight.

It is read-only: FSDP2 refills ``qdata`` (a view of its all-gather buffer) and the scale in place
between uses; an in-place op on it raises. AOTAutograd sees through it (``__tensor_flatten__``): a
compiled graph takes ``qdata`` and ``scale`` as inputs.
"""

import torch
from torch.utils._pytree import tree_map

from . import fp8

_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
            torch.ops.aten._unsafe_view.default, torch.ops.aten.as_strided.default)


class Fp8Weight(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, qdata, scale, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, strides=qdata.stride(), dtype=dtype,
                                                   device=qdata.device, requires_grad=False)

    def __init__(self, qdata, scale, dtype):
        if qdata.dtype != fp8.E4M3:
            raise TypeError(f"Fp8Weight: qdata must be {fp8.E4M3}, got {qdata.dtype}")
        self.qdata = qdata
        self.scale = scale

    def dequantize(self):
        return fp8.dequantize(self.qdata, self.scale).to(self.dtype)

    def __tensor_flatten__(self):
        return ["qdata", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8Weight(inner["qdata"], inner["scale"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in _ALIASES and isinstance(first, Fp8Weight) and _whole(first, func, args):
            # FSDP2 and nn.Parameter alias the whole weight: share qdata and scale.
            return Fp8Weight(first.qdata, first.scale, first.dtype)
        written = [a for a, schema_arg in zip(args, func._schema.arguments)
                   if isinstance(a, Fp8Weight) and schema_arg.alias_info is not None and schema_arg.alias_info.is_write]
        if written:
            raise RuntimeError(f"Fp8Weight: {func} would write an e4m3-gathered weight, which is read-only "
                               "(it is rebuilt from the sharded weight at every all-gather)")
        return _on_dequantized(func, args, kwargs)

    def __repr__(self):
        return f"Fp8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, scale={self.scale})"


@torch.compiler.disable
def _on_dequantized(func, args, kwargs):
    """``func`` on the dequantized weights. Not traced: it also runs from eager code inside a
    compiled region (a torch module's frame Dynamo skips), where Dynamo would compile it."""
    unwrap = lambda t: t.dequantize() if isinstance(t, Fp8Weight) else t  # noqa: E731
    return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _whole(weight, func, args):
    """Whether ``func(*args)`` aliases all of ``weight`` with its own shape and strides."""
    if func is torch.ops.aten.view.default or func is torch.ops.aten._unsafe_view.default:
        return tuple(args[1]) == tuple(weight.shape)
    if func is torch.ops.aten.as_strided.default:
        offset = args[3] if len(args) > 3 else 0
        return tuple(args[1]) == tuple(weight.shape) and tuple(args[2]) == weight.stride() and not offset
    return True
