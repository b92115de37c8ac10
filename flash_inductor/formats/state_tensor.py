"""Optimizer-state tensors whose storage is not what they present.

A ``StateTensor`` presents itself as a dense tensor of the parameter's shape and dtype, so stock
``torch.optim`` code and Dynamo trace it unchanged, while it stores:

- ``CompandedState``: companded 8-bit codes + bf16 group scales (``formats.companded``);
- ``TensorScaledState``: e4m3 or fp16 codes + one fp32 scale per tensor (``formats.tensor_scaled``,
  FP8-LM's Adam states); also a flat bucket's FP8 gradients (e5m2 codes), which the step reads;
- ``Fp32State``: plain fp32 values (unquantized states of bf16/fp16 parameters).

``STATE_FORMATS`` names the quantized ones for ``prepare(..., state_format=...)``.

Inside graphs compiled by the ``flashoptim`` backend the pass ``companded_states`` decodes each
state once at the start of the step (``decode``) and writes it back once at the end
(``store``), so a step rounds each state exactly once. Used eagerly outside such a graph, each
operation decodes, runs in fp32 and re-encodes in-place results: correct, but it rounds once per
in-place op.

AOTAutograd sees through them (``__tensor_flatten__``): the compiled graph takes the inner
tensors (codes and scales, or values) as inputs.
"""

import copy
import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import companded, tensor_scaled


class StateTensor(torch.Tensor):
    """Base: subclasses define ``_inner`` names, ``decode()``, ``store(value)`` and ``_meta()``."""

    _inner: tuple = ()

    @staticmethod
    def __new__(cls, *inner_and_meta, shape, dtype):
        device = inner_and_meta[0].device
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)

    def __tensor_flatten__(self):
        return list(self._inner), (self._meta(), self.shape, self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        extra, shape, dtype = meta
        return cls(*(inner[k] for k in cls._inner), *extra, shape=shape, dtype=dtype)

    def __deepcopy__(self, memo):
        # Tensor.__deepcopy__ cannot copy a wrapper subclass: copy the stored form.
        copied = self._rebuild(lambda t: copy.deepcopy(t, memo))
        memo[id(self)] = copied
        return copied

    def inner_tensors(self):
        """The tensors that store it, in ``_inner``'s order (codes or values first)."""
        return [getattr(self, k) for k in self._inner]

    def stored_bytes(self):
        """Bytes of its inner tensors: ``{"states": codes or values, "state_scales": scales and
        their layout}`` (what ``memory_report`` shows)."""
        values, *scales = self.inner_tensors()
        return {"states": _nbytes(values), "state_scales": sum(_nbytes(t) for t in scales)}

    def _rebuild(self, fn):
        """The same state with ``fn`` applied to each inner tensor."""
        return type(self)(*map(fn, self.inner_tensors()), *self._meta(), shape=self.shape, dtype=self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        first = args[0] if args else None
        if func is aten.detach.default or (func is aten.view.default and tuple(args[1]) == tuple(first.shape)):
            # Aliases of the whole state share its storage (DTensor.from_local wraps such a view).
            return first._rebuild(lambda t: t)
        if func is aten.copy_.default and type(args[1]) is type(first) and first._meta() == args[1]._meta():
            for k in first._inner:
                getattr(first, k).copy_(getattr(args[1], k))
            return first
        if func is aten._to_copy.default and isinstance(first, StateTensor) and kwargs.keys() <= {"device"}:
            # state.to(device): move the stored form, not a decoded copy.
            return first._rebuild(lambda t: t.to(kwargs.get("device", t.device)))

        # Eager fallback: everything in fp32 (states decoded, other float tensors upcast), in-place
        # results re-encoded, other results returned in the dtype the state presents.
        def fp32(t):
            if isinstance(t, StateTensor):
                return t.decode()
            return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        out = func(*tree_map(fp32, args), **tree_map(fp32, kwargs))
        written = [
            a for a, schema_arg in zip(args, func._schema.arguments)
            if isinstance(a, StateTensor) and schema_arg.alias_info is not None and schema_arg.alias_info.is_write
        ]
        if written:
            for state in written:
                state.store(out)
            return written[0]
        dtype = next(a.dtype for a in tree_flatten((args, kwargs))[0] if isinstance(a, StateTensor))
        return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)


def _nbytes(t):
    return t.numel() * t.element_size()


class CompandedState(StateTensor):
    """Companded 8-bit codes with one bf16 scale per group of 32 (``formats.companded``).

    ``codes`` is stored as ``(groups, 32)``, the layout the compiled step updates in: Inductor
    builds the copy into the stored codes with the destination's shape, and a flat destination
    gives the encode a 1-D loop that cannot fuse with the per-group absmax (its reads of the
    absmax and the reduction's writes do not line up), so every input would be read twice.
    """

    _inner = ("codes", "scales")

    def __init__(self, codes, scales, kind, *, shape, dtype):
        self.codes = codes
        self.scales = scales
        self.kind = kind

    def _meta(self):
        return (self.kind,)

    @classmethod
    def encode(cls, x, kind, dtype=None, saved_scales=None):
        """A new state holding ``x``; it presents as ``dtype`` (default: x's). ``saved_scales``:
        the group scales a checkpoint saved with decoded values ``x``, which give back the codes
        they were decoded from (``companded.encode_with_saved_scales``)."""
        if saved_scales is None:
            codes, scales = companded.encode(x, kind)
        else:
            codes, scales = companded.encode_with_saved_scales(x, kind, saved_scales)
        return cls(codes.view(-1, companded.GROUP_SIZE), scales, kind, shape=x.shape, dtype=dtype or x.dtype)

    @classmethod
    def zeros(cls, like, kind):
        """The all-zero state for parameter ``like``, allocated directly as codes and scales."""
        groups = companded.num_groups(like.numel())
        codes = torch.zeros(groups, companded.GROUP_SIZE, dtype=companded.CODE_DTYPES[kind], device=like.device)
        scales = companded.zero_scales(groups, device=like.device)
        return cls(codes, scales, kind, shape=like.shape, dtype=like.dtype)

    @staticmethod
    def num_scales(numel):
        """Scales a state of ``numel`` elements stores: one per group of 32."""
        return companded.num_groups(numel)

    @staticmethod
    def stored_dtypes(kind):
        """(codes, scales) dtypes of a ``kind`` state."""
        return companded.CODE_DTYPES[kind], companded.SCALE_DTYPE

    @staticmethod
    def codes_problem(codes, kind):
        """Why ``codes`` are not codes ``encode`` gives (a checkpoint's), or None."""
        if kind == companded.SIGNED and bool((codes < -127).any()):
            return "has code -128; signed codes lie in [-127, 127]"
        return None

    @classmethod
    def from_stored(cls, codes, scales, kind, *, shape, dtype):
        """A state of ``shape`` holding copies of checked ``codes`` and ``scales`` (a checkpoint's)."""
        groups = companded.num_groups(math.prod(shape))
        return cls(codes.reshape(groups, companded.GROUP_SIZE).clone(), scales.clone(), kind, shape=shape, dtype=dtype)

    def decode(self, shape=None):
        """The state's value in fp32, in ``shape`` (default: the state's own; ``(groups, 32)`` is
        the layout it is stored in, and needs no data movement)."""
        return companded.decode(self.codes, self.scales, self.shape if shape is None else shape, self.kind)

    def store(self, value):
        """Encode ``value`` (any shape with the state's elements, in order) into this state's
        storage: one rounding."""
        codes, scales = companded.encode(value, self.kind)
        self.codes.copy_(codes.view(self.codes.shape))
        self.scales.copy_(scales)

    def __repr__(self):
        return f"CompandedState(kind={self.kind!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


class Fp32State(StateTensor):
    """An unquantized state kept in fp32 for a bf16/fp16 parameter."""

    _inner = ("values",)

    def __init__(self, values, *, shape, dtype):
        self.values = values

    def _meta(self):
        return ()

    @classmethod
    def encode(cls, x, dtype=None):
        return cls(x.detach().float().clone(), shape=x.shape, dtype=dtype or x.dtype)

    @classmethod
    def zeros(cls, like):
        return cls(torch.zeros(like.shape, dtype=torch.float32, device=like.device), shape=like.shape, dtype=like.dtype)

    def decode(self, shape=None):
        return self.values if shape is None else self.values.view(shape)

    def store(self, value):
        self.values.copy_(value.view(self.values.shape))

    def __repr__(self):
        return f"Fp32State(shape={tuple(self.shape)}, dtype={self.dtype})"


class TensorScaledState(StateTensor):
    """Codes (e4m3 for a signed moment, fp16 for a second moment) with one fp32 scale per tensor
    (``formats.tensor_scaled``): FP8-LM's Adam states.

    ``codes`` is stored as ``(groups, 32)``, zero-padded, like ``CompandedState``'s, so the flat
    step updates it in the same layout. ``scales`` holds one scale per segment and ``starts`` each
    segment's first row: one segment (``[0]``) for a parameter's state, one per parameter for a
    flat bucket's (flash_inductor/flat.py).
    """

    _inner = ("codes", "scales", "starts")

    def __init__(self, codes, scales, starts, kind, *, shape, dtype):
        self.codes = codes
        self.scales = scales
        self.starts = starts
        self.kind = kind

    def _meta(self):
        return (self.kind,)

    @staticmethod
    def one_segment(device):
        return torch.zeros(1, dtype=torch.int64, device=device)

    @classmethod
    def encode(cls, x, kind, dtype=None):
        """A new one-segment state holding ``x``; it presents as ``dtype`` (default: x's). Decoded
        values (a checkpoint's) encode back to the codes and scale they came from."""
        rows, starts = companded.as_groups(x), cls.one_segment(x.device)
        codes, scales = tensor_scaled.encode(rows, starts, tensor_scaled.CODE_DTYPES[kind], kind == companded.SQRT)
        return cls(codes, scales, starts, kind, shape=x.shape, dtype=dtype or x.dtype)

    @classmethod
    def zeros(cls, like, kind):
        """The all-zero state for parameter ``like``, allocated directly as codes and a scale."""
        groups = companded.num_groups(like.numel())
        code_dtype = tensor_scaled.CODE_DTYPES[kind]
        codes = torch.zeros(groups, companded.GROUP_SIZE, dtype=code_dtype, device=like.device)
        scales = tensor_scaled.scale_from_amax(torch.zeros(1, device=like.device), code_dtype)
        return cls(codes, scales, cls.one_segment(like.device), kind, shape=like.shape, dtype=like.dtype)

    @classmethod
    def zeros_segments(cls, num_rows, starts, kind, dtype, code_dtype=None):
        """An all-zero block of ``num_rows`` rows of 32 whose segments start at the rows ``starts``
        (int64 [S]), one scale each: a flat bucket's state, or its FP8 gradients (``code_dtype``,
        default the kind's). It presents as ``dtype`` of shape ``(num_rows, 32)``."""
        code_dtype = code_dtype or tensor_scaled.CODE_DTYPES[kind]
        codes = torch.zeros(num_rows, companded.GROUP_SIZE, dtype=code_dtype, device=starts.device)
        scales = tensor_scaled.scale_from_amax(torch.zeros(starts.shape, device=starts.device), code_dtype)
        return cls(codes, scales, starts, kind, shape=(num_rows, companded.GROUP_SIZE), dtype=dtype)

    def segment(self, index, rows, shape):
        """Segment ``index`` (its ``rows``, a slice) as a one-segment state of ``shape``: views of
        this block's codes and scale, so storing into it writes the block."""
        scale = self.scales[index:index + 1]
        return TensorScaledState(self.codes[rows], scale, self.one_segment(scale.device), self.kind, shape=shape,
                                 dtype=self.dtype)

    @staticmethod
    def num_scales(numel):
        """Scales a state of ``numel`` elements stores: one."""
        return 1

    @staticmethod
    def stored_dtypes(kind):
        """(codes, scales) dtypes of a ``kind`` state."""
        return tensor_scaled.CODE_DTYPES[kind], torch.float32

    @staticmethod
    def codes_problem(codes, kind):
        """Why ``codes`` are not codes ``encode`` gives (a checkpoint's), or None."""
        if bool(codes.float().isinf().any()):
            return "has infinite codes; encode saturates at the largest finite code"
        if kind == companded.SQRT and bool((codes.float() < 0).any()):
            return "has negative codes; a second moment's codes are >= 0"
        return None

    @classmethod
    def from_stored(cls, codes, scales, kind, *, shape, dtype):
        """A one-segment state of ``shape`` holding copies of checked ``codes`` and ``scale`` (a checkpoint's)."""
        groups = companded.num_groups(math.prod(shape))
        codes = codes.reshape(groups, companded.GROUP_SIZE).clone()
        return cls(codes, scales.reshape(1).clone(), cls.one_segment(codes.device), kind, shape=shape, dtype=dtype)

    def decode(self, shape=None):
        """The state's value in fp32, in ``shape`` (default: the state's own)."""
        shape = self.shape if shape is None else shape
        numel = math.prod(shape)
        return tensor_scaled.decode(self.codes, self.scales, self.starts).view(-1)[:numel].view(shape)

    def store(self, value):
        """Encode ``value`` (any shape with the state's elements, in order) into this state's
        storage: one rounding, one scale per segment."""
        rows = companded.as_groups(value).view(self.codes.shape)
        codes, scales = tensor_scaled.encode(rows, self.starts, self.codes.dtype, self.kind == companded.SQRT)
        self.codes.copy_(codes)
        self.scales.copy_(scales)

    def __repr__(self):
        return (f"TensorScaledState(kind={self.kind!r}, codes={self.codes.dtype}, segments={self.starts.numel()}, "
                f"shape={tuple(self.shape)}, dtype={self.dtype})")


# prepare(..., state_format=name): the class that stores quantized states
STATE_FORMATS = {"companded": CompandedState, "fp8lm": TensorScaledState}
QUANTIZED = tuple(STATE_FORMATS.values())
