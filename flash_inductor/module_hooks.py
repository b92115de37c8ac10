"""Hooks ``prepare`` installs on the model's modules.

- Modules kept in fp32 (normalization layers, ``keep_fp32``) get their bf16/fp16 inputs cast to
  fp32 and their output cast back (``Fp32Forward``, their ``forward``).
- Modules with split-weight parameters split weights loaded by ``module.load_state_dict`` into
  (bf16, error term): fp32 values become their exact 24-bit split, bf16/fp16 values reset the
  error term to zero, except right after the optimizer's ``load_state_dict`` restored it (a resume
  that loads the optimizer first: the error terms belong to the weights being loaded). Without it a
  loaded bf16 weight kept the old error term, a master that is neither the loaded value nor the
  old one.
- Modules that multiply their inputs by their own weights (linears, convolutions, attention), whose
  weights ``prepare`` cast to bf16, get floating inputs of other dtypes cast to their weights'
  (``cast_inputs_to_weight_dtype``, a forward pre-hook), as autocast casts them.
- With ``prepare(..., fp32_activations=True)``, embeddings return fp32 outputs, and refuse to run
  without autocast.

They are module-level functions and classes, so a prepared model pickles (``torch.save(model)``).
"""

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from flash_inductor import roles, sharded
from flash_inductor.formats import split_weights

_LOADS_SPLIT_WEIGHTS = "_flashoptim_loads_split_weights"
_LOADED = "_flashoptim_loaded_split_weights"  # between the two load hooks
_FP32_ACTIVATIONS = "_flashoptim_fp32_activations"  # the module's name in the prepared model
_CASTS_INPUTS = "_flashoptim_casts_inputs_to_weight_dtype"


def _to_fp32(t):
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) else t


class Fp32Forward:
    """The ``forward`` of a module kept in fp32, set on the instance in place of its class's: bf16/fp16
    inputs cast to fp32, the output cast back to the first floating input's dtype. Nothing is kept
    on the module between the two casts: a pre-hook that kept the input's dtype there for a forward
    hook was a side effect Dynamo cannot trace inside a ``torch.utils.checkpoint`` region, and the
    whole model fell back to eager (Hugging Face's gradient checkpointing)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        output = type(self.module).forward(self.module, *(_to_fp32(a) for a in args), **kwargs)
        if dtype not in (torch.bfloat16, torch.float16):
            return output

        def back(t):  # fp32 only: a complex or integer output is not the input's kind of value
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t

        # Hugging Face's modules often return a tuple of their outputs
        return type(output)(back(t) for t in output) if type(output) is tuple else back(output)


def keep_fp32_with_io_casts(module):
    if not isinstance(module.__dict__.get("forward"), Fp32Forward):
        module.forward = Fp32Forward(module)


# Modules whose forward multiplies its inputs by its own weights. Once ``prepare`` has cast those to bf16,
# an fp32 input (a vision model's pixel values, an audio model's features, continuous features)
# fails the op's dtype check: the user's loop would have to change where autocast's would not.
TAKE_INPUTS_AT_THEIR_WEIGHTS_DTYPE = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.MultiheadAttention)


def cast_inputs_to_weight_dtype(module, args, kwargs):
    """Forward pre-hook: floating tensor arguments of another dtype than the module's weights (bf16
    after ``prepare``) cast to it, as autocast casts a linear's or a convolution's inputs (round to
    nearest; the backward casts the gradient back). Inputs of the weights' dtype, the case inside a
    prepared model, pass untouched."""
    dtype = next(module.parameters()).dtype

    def other(t):
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype

    def cast(t):
        return t.to(dtype) if other(t) else t

    if not any(map(other, args)) and not any(map(other, kwargs.values())):
        return None  # no new tuple: Dynamo's graph stays as it was without the hook
    return tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}


def cast_inputs_to_weight_dtype_from(module):
    """Install ``cast_inputs_to_weight_dtype`` on ``module`` once."""
    if not getattr(module, _CASTS_INPUTS, False):
        module.register_forward_pre_hook(cast_inputs_to_weight_dtype, with_kwargs=True)
        setattr(module, _CASTS_INPUTS, True)


def embedding_output_to_fp32(module, args, output):
    """Forward hook: the embedding's bf16 output as fp32 (exact), as autocast's fp32 embedding gives it.

    Only autocast lets matmuls take these fp32 activations with bf16 weights (without it a dtype
    mismatch fails deep inside the model), so a forward without it is refused here, by name."""
    device_type = output.device.type
    if not torch.is_autocast_enabled(device_type):
        raise RuntimeError(
            f"{type(module).__name__} '{getattr(module, _FP32_ACTIVATIONS)}' ran without autocast: "
            "flash_inductor.prepare(..., fp32_activations=True) runs the model as autocast runs fp32 weights (fp32 "
            "activations from the embeddings on, bf16 matmuls), which needs the forward under "
            f"torch.autocast({device_type!r}, dtype=torch.bfloat16)"
        )
    return output.float()


def fp32_activations_from(module, name):
    """Install ``embedding_output_to_fp32`` on the embedding ``module`` (named ``name``) once."""
    if not hasattr(module, _FP32_ACTIVATIONS):
        module.register_forward_hook(embedding_output_to_fp32)
        setattr(module, _FP32_ACTIVATIONS, name)


# parameter -> True from an optimizer's load_state_dict restoring its error term until the model's
# weights are loaded or the optimizer steps
_ERROR_TERMS_LOADED = WeakIdKeyDictionary()


def error_term_loaded(param):
    _ERROR_TERMS_LOADED[param] = True


def forget_loaded_error_terms(params):
    if not _ERROR_TERMS_LOADED:  # every step calls this: nothing to do unless a load just happened
        return
    for param in params:
        _ERROR_TERMS_LOADED.pop(param, None)


def split_loaded_weights(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """``load_state_dict`` pre-hook: split each loaded weight; ``write_loaded_split_weights`` writes
    it once torch has loaded the module (torch's own copy rounds an fp64 value to bf16 directly,
    which can differ from the split of its fp32 value)."""
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError(
            f"load_state_dict(assign=True) on a prepared model would replace its bf16 parameters (module "
            f"'{prefix.rstrip('.') or type(module).__name__}') by the loaded tensors, which the prepared optimizer does "
            "not hold; load with assign=False (the default)"
        )
    loaded = {}
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        error = None if param is None else roles.error_term_of(param)
        if error is None or not isinstance(value, torch.Tensor) or value.shape != param.shape:
            continue  # torch reports a missing or misshapen entry itself, and then copies nothing
        shard = sharded.local(sharded.shard_like(param, value)).detach().to(sharded.local(param).device)
        if shard.dtype == param.dtype and _ERROR_TERMS_LOADED.pop(param, False):
            # A resume that loaded the optimizer (its error terms) first: they belong to these weights.
            loaded[name] = (shard, sharded.local(error).clone())
        elif shard.dtype == param.dtype:
            loaded[name] = (shard, torch.zeros_like(sharded.local(error)))  # a bf16/fp16 value is its own master
        else:
            loaded[name] = split_weights.encode(shard.to(torch.float32), param.dtype, error.dtype)
    setattr(module, _LOADED, loaded)


@torch.no_grad()
def write_loaded_split_weights(module, incompatible_keys):
    for name, (hi, lo) in getattr(module, _LOADED, {}).items():
        param = module._parameters[name]
        sharded.local(param.detach()).copy_(hi)
        sharded.local(roles.error_term_of(param)).copy_(lo)
    setattr(module, _LOADED, {})


def split_weights_on_load(module):
    """Install the two load hooks on ``module`` once."""
    if not getattr(module, _LOADS_SPLIT_WEIGHTS, False):
        module.register_load_state_dict_pre_hook(split_loaded_weights)
        module.register_load_state_dict_post_hook(write_loaded_split_weights)
        setattr(module, _LOADS_SPLIT_WEIGHTS, True)
