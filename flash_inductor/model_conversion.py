"""What ``prepare`` does to the model: fp32 parameters and buffers become bf16, except
normalization layers and modules the user keeps in fp32 (those get fp32 input/output casts) and
the frequency tables of rotary position embeddings. Linears, convolutions and attention layers made
bf16 cast their inputs to bf16 (an fp32 model's fp32 inputs keep working). The fp32 values of the
cast parameters become their masters."""

import fnmatch
import re
import traceback
import warnings

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from flash_inductor import fp8_delayed, module_hooks, sharded

NORM_LAYERS = (
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm,
    nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
)

# Class names of other libraries' normalization layers: Hugging Face's LlamaRMSNorm, T5LayerNorm,
# Qwen2RMSNorm, apex's FusedLayerNorm, BatchNorm2d-like names. Not "Normalizer" or "NormHead".
_NORM_CLASS_NAME = re.compile(r"Norm([123]d)?$")


def is_norm_layer(module):
    """A torch normalization layer, or a module of another library that looks like one: its class
    name ends in ``Norm`` (or ``Norm1d``/``2d``/``3d``) and it has parameters of its own, all 1-D
    (a per-channel weight and bias). A 2-D weight means a projection, whatever the name."""
    if isinstance(module, NORM_LAYERS):
        return True
    params = list(module.parameters(recurse=False))
    return bool(_NORM_CLASS_NAME.search(type(module).__name__)) and bool(params) and all(p.dim() == 1 for p in params)


# Hugging Face's rotary embeddings (LlamaRotaryEmbedding, Qwen2RotaryEmbedding, ...) compute their
# angles in fp32 from an ``inv_freq`` buffer and return cos/sin in the input's dtype: in bf16 that
# buffer's rounding moves the angle at position 4095 by up to 1.8 rad (head size 64, base 10000).
_ROTARY_CLASS_NAME = re.compile(r"RotaryEmbedding$")


def keeps_fp32_buffers(module):
    """A rotary position embedding: its fp32 buffers stay fp32 (it casts its outputs itself)."""
    return bool(_ROTARY_CLASS_NAME.search(type(module).__name__))


def named_by(name, patterns):
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def keeps_fp32(name, module, patterns):
    return is_norm_layer(module) or named_by(name, patterns)


# parameter -> its fp32 value before ``prepare`` cast it, for trainable parameters the preparing
# optimizer did not hold: another optimizer's ``prepare`` takes it as their master.
FP32_ORIGINALS = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise


def convert_model(model, keep_fp32, held):
    """Cast fp32 parameters and buffers (except FP8 delayed-scaling state) to bf16 in place (same
    Parameter objects); return the original fp32 values of the cast parameters in ``held``, which
    become their masters. Those of other trainable parameters are kept in ``FP32_ORIGINALS``
    until the optimizer that holds them is prepared."""
    masters = {}
    kept = []
    retained = []
    for name, module in model.named_modules():
        if keeps_fp32(name, module, keep_fp32):
            # A module named by the user computes in fp32 also without parameters of its own: one
            # that calls an op with no bf16 kernel (torch.fft's, FNet's token mixing).
            if named_by(name, keep_fp32) or any(p.dtype == torch.float32 for p in module.parameters(recurse=False)):
                kept.append(module)
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.dtype != torch.float32:
                continue
            if isinstance(module, module_hooks.TAKE_INPUTS_AT_THEIR_WEIGHTS_DTYPE):
                module_hooks.cast_inputs_to_weight_dtype_from(module)
            if sharded.is_sharded(p):
                original = sharded.cast_parameter(p, torch.bfloat16)
            else:
                original = p.data  # the fp32 storage itself: p.data is replaced, not written
                p.data = p.data.to(torch.bfloat16)
            if p in held:
                masters[p] = original
            elif p.requires_grad:
                FP32_ORIGINALS[p] = original
                retained.append((f"{name}.{pname}" if name else pname, original))
        for bname, b in module.named_buffers(recurse=False):
            if b.dtype == torch.float32 and not fp8_delayed.is_state_buffer(bname) and not keeps_fp32_buffers(module):
                setattr(module, bname, b.to(torch.bfloat16))
    for module in kept:
        module_hooks.keep_fp32_with_io_casts(module)
    if retained:
        mib = sum(t.numel() * t.element_size() for _, t in retained) / 2**20
        warnings.warn(
            f"flash_inductor.prepare: {len(retained)} trainable parameters of the model are not in this optimizer "
            f"(e.g. '{retained[0][0]}'); they became bf16 and their fp32 values ({mib:.1f} MiB) are kept until the "
            "optimizer that holds them is prepared, which takes them as masters. Freeze parameters no optimizer "
            "trains (requires_grad_(False)) before prepare to drop them.",
            stacklevel=3,
        )
    return masters


# What torch says when an op has no kernel for bf16/fp16 inputs: torch.fft's, CPU kernels not
# written for them, torch.linalg's.
_NO_HALF_KERNEL = re.compile(r"Unsupported dtype (BFloat16|Half)|not implemented for '(BFloat16|Half)'"
                             r"|Low precision dtypes not supported")


def explain_missing_bf16_kernel(error, model):
    """Add a note to ``error`` when it says an op of the prepared ``model`` has no bf16 kernel: which
    module called it, and the fix (keep it in fp32, as autocast runs such ops). The module is found from
    the error's stack (Dynamo's user frames, or the traceback's), matched against the code of the
    model's modules' ``forward``s."""
    if not _NO_HALF_KERNEL.search(str(error)):
        return
    frames = getattr(error, "real_stack", None) or traceback.extract_tb(error.__traceback__)
    names = _innermost_module_names(frames, model)
    where = f"keep_fp32=[{', '.join(repr(n) for n in names)}]" if names else "keep_fp32=[<its name>]"
    error.add_note(
        "flash_inductor: prepare made the model's parameters, and so its activations, bf16, and this op has no "
        "bf16 kernel (under torch.autocast, fp32 training runs it in fp32). Keep the module that calls it in "
        f"fp32: prepare(model, optimizer, {where}) or train_step(..., {where}); its inputs are then cast to "
        "fp32 and its outputs back."
    )


def _innermost_module_names(frames, model):
    """Name patterns (indices as ``*``) of the modules whose ``forward`` runs the innermost of ``frames``
    that is a module's forward."""
    by_code = {}
    for name, module in model.named_modules():
        by_code.setdefault(getattr(type(module).forward, "__code__", None), []).append(name)
    for frame in reversed(frames):
        for code, names in by_code.items():
            if code is None or (frame.filename, frame.name) != (code.co_filename, code.co_name):
                continue
            lines = [line for _, _, line in code.co_lines() if line is not None]
            if min(lines) <= frame.lineno <= max(lines):
                return sorted({re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", n) for n in names})
    return []
