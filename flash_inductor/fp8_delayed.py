"""Delayed-scaling state of FP8 linear layers (option ``fp8="delayed"``): buffers on the modules.

``prepare_fp8(model, **options)`` gives each ``nn.Linear`` whose weight runs in FP8 under
``options`` four fp32 buffers, named after its weight::

    weight_fp8_amax_history       [2, L]  amaxes of the input (row 0) and the weight (row 1), newest first
    weight_fp8_scale              [2]     the scales they were last cast with (kept when an amax is bad)
    weight_fp8_grad_amax_history  [1, L]  amaxes of the grad-output
    weight_fp8_grad_scale         [1]

The compiled forward updates the first two, the compiled backward the last two
(``flash_inductor.fp8_linear``).

Why buffers made by an explicit step, before anything is compiled, rather than by the pass on the
first compile: they are in ``model.state_dict()`` from the start, so a fresh model prepared the same
way loads a checkpoint before its first step (state made at compile time would not exist yet:
"unexpected keys"); ``load_state_dict`` copies into them in place and ``model.to()`` moves them.
``flash_inductor.compile(model, ...)`` and ``train_step`` call ``prepare_fp8`` themselves.

The graph reads them as extra inputs (``graph_utils.add_bound_placeholder``) looked up at every
call from the weight that call passes in: Dynamo shares one compiled forward between instances of
a module class (their parameters are graph inputs), so state bound at compile time could belong to
another instance. A recompile looks them up the same way and continues the same histories.
"""

import warnings
import weakref

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from flash_inductor.formats import fp8
from flash_inductor.fp8_linear import ineligible_reason, layer_weight

KEYS = ("amax_history", "scale", "grad_amax_history", "grad_scale")  # fp8_linear's keyword names
_SUFFIXES = tuple(f"_fp8_{key}" for key in KEYS)

# weight -> weak reference to the nn.Linear holding its state; by identity (a WeakKeyDictionary
# would compare tensors with ==)
_OWNER = WeakIdKeyDictionary()

def buffer_name(param_name, key):
    return f"{param_name}_fp8_{key}"


def is_state_buffer(name):
    """Whether a module's buffer ``name`` is delayed-scaling state (it must stay fp32)."""
    return name.endswith(_SUFFIXES)


def _new_state(weight, length):
    """Empty histories; scales 1.0 (used only while an amax is 0 or not finite from the start)."""
    def rows(n):
        return fp8.new_amax_history(length, weight.device).repeat(n, 1)

    def ones(n):
        return torch.ones(n, dtype=torch.float32, device=weight.device)

    return {"amax_history": rows(2), "scale": ones(2), "grad_amax_history": rows(1), "grad_scale": ones(1)}


def add_state(model: nn.Module, opts):
    """``prepare_fp8`` (flash_inductor/backend.py) with the options parsed (``flash_inductor.options.
    Options``, ``fp8="delayed"``): give every ``nn.Linear`` of ``model`` that runs in FP8 under them
    its delayed-scaling buffers, in place; returns ``model``.

    Layers that already have them keep them (calling it again, e.g. on every compile, is harmless);
    state of another history length is refused, and nothing is changed then.
    """
    new, seen = [], set()
    for name, module in model.named_modules():
        weight = layer_weight(module)
        if weight is None or ineligible_reason(weight, name, opts) is not None:
            continue
        if id(weight) in seen or _owner(weight) not in (None, module):
            continue  # a weight shared by several layers: the first one holds its state
        seen.add(id(weight))
        existing = getattr(module, buffer_name("weight", "amax_history"), None)
        if existing is None:
            new.append(module)
        elif existing.shape[-1] != opts.fp8_history_length:
            raise ValueError(
                f"prepare_fp8: {name + '.' if name else ''}weight_fp8_amax_history has length {existing.shape[-1]}, "
                f"not fp8_history_length={opts.fp8_history_length}; pass the length the model was prepared "
                "(and saved) with"
            )
    for module in new:
        for key, tensor in _new_state(module.weight, opts.fp8_history_length).items():
            module.register_buffer(buffer_name("weight", key), tensor)
    for module in model.modules():
        if isinstance(module, nn.Linear) and hasattr(module, buffer_name("weight", "amax_history")):
            if _owner(module.weight) is None:
                _OWNER[module.weight] = weakref.ref(module)
    return model


def _owner(weight):
    ref = _OWNER.get(weight)
    return None if ref is None else ref()


def state_of(weight, weight_name):
    """{``fp8_linear`` keyword: buffer} of ``weight``'s layer, or None if it has no state."""
    module = _owner(weight)
    if module is None:
        return None
    state = {key: getattr(module, buffer_name("weight", key)) for key in KEYS}
    for key, tensor in state.items():
        if tensor.dtype != torch.float32:
            raise TypeError(
                f"fp8='delayed': the buffer {buffer_name(weight_name, key)} is {tensor.dtype}, but delayed-scaling "
                "state must stay fp32; convert the model's dtype before prepare_fp8, or cast these buffers back"
            )
    return state


_HOW_TO_PREPARE = (
    "call flash_inductor.prepare_fp8(model, **options) before compiling (flash_inductor.compile(model, ...) "
    "and train_step do it; it serves nn.Linear layers)"
)


def warn_missing_state(weight_name):
    warnings.warn(
        f"fp8='delayed': '{weight_name}' has no delayed-scaling state, so it stays in bf16; {_HOW_TO_PREPARE}, "
        "or exclude the layer with fp8_exclude / fp8_filter",
        stacklevel=3,
    )


def look_up_at_run_time(weight_index, key, expected, weight_name, args):
    """The ``key`` buffer of the weight passed as ``args[weight_index]``, checked against the one
    the graph was compiled with (``expected``: shape, dtype, device)."""
    module = _owner(args[weight_index])
    if module is None:
        raise RuntimeError(f"fp8='delayed': the '{weight_name}' of this call has no delayed-scaling state; {_HOW_TO_PREPARE}")
    tensor = getattr(module, buffer_name("weight", key))
    if (tensor.shape, tensor.dtype, tensor.device) != expected:
        shape, dtype, device = expected
        raise RuntimeError(
            f"fp8='delayed': {buffer_name(weight_name, key)} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
            f"the compiled graph expects {tuple(shape)} {dtype} on {device}: the state must stay fp32 and keep the "
            "fp8_history_length it was compiled with (torch._dynamo.reset() makes the next call recompile)"
        )
    return tensor
