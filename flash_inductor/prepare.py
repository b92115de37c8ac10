"""``prepare(model, optimizer)``: bf16 parameters with split master weights and 8-bit states.

Everything is converted in place and allocated in its compressed form from the start: the
optimizer keeps its class, its param groups and its hyperparameters. This module checks the
arguments (before anything changes) and puts the pieces together:

- the model's dtypes: ``model_conversion``;
- the record and the stored form of states: ``optimizer_record``; flat buckets: ``flat``;
- how ``step`` runs: ``steps`` (flat), ``sharded_step`` (FSDP2), ``gradient_release``;
- checkpoints and model load hooks: ``checkpoint``, ``module_hooks``.
"""

import copy
import dataclasses
import math
import types
import weakref

import torch
import torch.nn as nn

from flash_inductor import checkpoint, flat, graph_utils, model_conversion, module_hooks, registry, roles, sharded
from flash_inductor import gradient_release as release
from flash_inductor.formats import split_weights, tensor_scaled
from flash_inductor.optimizer_record import PreparedOptimizer, init_state, make_lr_tensor, prepared
from flash_inductor.options import Options, is_int_at_least
from flash_inductor.sharded_step import route_step_through_local_optimizer
from flash_inductor.steps import route_step_through_buckets


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    master_weight_bits: int | None = 24,
    state_bits: int | None = 8,
    state_format: str = "companded",
    keep_fp32=(),
    min_quantized_numel: int = 4096,
    compressed_state_dict: bool = False,
    check_numerics: bool = False,
    compile_options: dict | None = None,
    gradient_release: bool = False,
    gradient_format: str | None = None,
    fp32_activations: bool = False,
    bucket_numel: int | None = None,
):
    """Make ``model`` + ``optimizer`` memory-efficient, in place; returns ``model``.

    - Floating-point parameters become bf16, except normalization layers and modules whose names
      match a pattern in ``keep_fp32`` (fnmatch, e.g. ``"lm_head"`` or ``"*.norm*"``): those stay
      fp32, with their inputs cast to fp32 and outputs cast back. A module named there computes in
      fp32 also without parameters of its own: one that calls an op with no bf16 kernel (the
      step's error then names it, ``train_step``). Normalization layers are torch's
      (``nn.LayerNorm``, ``nn.RMSNorm``, batch/group/instance norms) and any module whose class name
      ends in ``Norm`` (or ``Norm1d``/``2d``/``3d``) with parameters of its own that are all 1-D,
      such as Hugging Face's ``LlamaRMSNorm`` or ``T5LayerNorm``. fp32 buffers become bf16 too,
      except those of rotary embeddings (class name ending in ``RotaryEmbedding``), which compute
      their angles in fp32. Linears, convolutions and ``nn.MultiheadAttention`` layers made bf16
      cast floating inputs of other dtypes to bf16, as autocast would (an fp32 model's fp32 pixel
      values or features keep working). Already-bf16/fp16 models keep their dtype.
    - Each bf16/fp16 parameter gets an error term: int8 for ``master_weight_bits=24``, int16 for
      32, none for None. An fp32 parameter's value becomes the master (nothing is lost).
    - Moment states are allocated as companded 8-bit codes with fp16 group scales
      (``state_bits=8``), except tensors under ``min_quantized_numel`` elements, which stay
      fp32; ``state_bits=None`` keeps every state in fp32. ``state_format="fp8lm"`` (Adam and
      AdamW only; not with FSDP2) stores them as FP8-LM does instead: the first moment in
      float8_e4m3fn and the second in fp16, each with one fp32 scale per tensor (DESIGN §2.6;
      masters stay the split weights ``master_weight_bits`` asks for; docs/numerics.md).
    - ``optimizer.step()`` then runs through the ``flashoptim`` backend (compiled on first call,
      with ``compile_options``), or the hand-written Triton kernel where it applies; inside a
      function compiled with ``backend="flashoptim"`` it stays a graph of its own (the function's
      graph breaks at the call), compiled once for the optimizer's flat buckets.
    - ``gradient_release=True`` instead updates each parameter in backward, as soon as its
      gradient is complete, and frees the gradient; ``optimizer.step()`` only marks the end of a
      step (flash_inductor/gradient_release.py).
    - ``gradient_format="e5m2"`` (or ``"e4m3"``) keeps the gradients of the parameters with 8-bit
      states (``min_quantized_numel`` elements or more) in FP8 with one scale per tensor (1 B/param)
      from backward until the step, which decodes them in its kernel; ``p.grad`` stays None, so clip
      with ``flash_inductor.clip_grad_norm_(optimizer, max_norm)``, not torch's. Default None: the
      parameters' dtype. Not with gradient release, DDP or FSDP2 (flash_inductor/flat.py).
    - ``fp32_activations=True`` makes every ``nn.Embedding`` / ``nn.EmbeddingBag`` return fp32: under
      ``torch.autocast(device_type, dtype=torch.bfloat16)`` (required) the activations are then those
      of fp32 weights under autocast, an fp32 residual stream with bf16 matmuls (docs/numerics.md).
    - ``bucket_numel`` caps the elements of each flat bucket (the parameters of one param group,
      dtype and state kind share one by default). Where the step copies the gradients into the flat
      buffers (the compiled stock update: the CPU, other optimizers; CUDA Adam/AdamW's hand-written
      step reads them where they are), smaller buckets lower the peak of a step whose backward is
      one compiled graph (``train_step``): the step lands the gradients bucket by bucket, so it holds
      them once plus one bucket's buffer instead of twice (docs/architecture.md). Each bucket is one
      more launch of the step; the stored bits do not depend on it.
    """
    # Everything is checked before anything is changed: a refused call leaves model and optimizer as
    # they were.
    if optimizer in roles.PREPARED:
        raise ValueError(f"{type(optimizer).__name__} is already prepared")
    if state_bits not in (8, None):
        raise ValueError(f"state_bits must be 8 or None, got {state_bits!r}")
    split_weights.error_term_dtype(master_weight_bits)  # refuses other values
    registry.check_supported(optimizer, state_format)
    if state_format != "companded" and state_bits is None:
        raise ValueError(
            f"state_format={state_format!r} stores quantized states, but state_bits=None keeps every state in fp32; "
            "pass state_bits=8 (the default) with it, or drop state_format"
        )
    names = _check_params(model, optimizer)
    if state_format == "fp8lm" and any(sharded.is_sharded(p) for p in names):
        raise ValueError(
            "state_format='fp8lm' keeps one scale per tensor, which the shards of an FSDP2 parameter would each need "
            "whole; use state_format='companded' (scales per group of 32) with fully_shard"
        )
    for group in optimizer.param_groups:
        _check_group(optimizer, group, names)
    Options.from_dict(compile_options)
    if isinstance(keep_fp32, str):
        keep_fp32 = (keep_fp32,)
    sharded.check_fsdp_not_started(model)
    sharded.check_fsdp_groups_keep_one_dtype(model, lambda name, module: model_conversion.keeps_fp32(name, module, keep_fp32))
    if gradient_release not in (True, False):
        raise ValueError(f"gradient_release must be True or False, got {gradient_release!r}")
    if gradient_release:
        release.check_model(model)
    _check_gradient_format(gradient_format, model, names, state_bits, gradient_release)
    if bucket_numel is not None and not is_int_at_least(bucket_numel, 1):
        raise ValueError(f"bucket_numel must be None or a positive int (elements per flat bucket), got {bucket_numel!r}")
    embeddings = _embeddings_for_fp32_activations(model, fp32_activations)
    masters = model_conversion.convert_model(model, keep_fp32, held=set(names))
    for name, module in embeddings:
        module_hooks.fp32_activations_from(module, name or type(module).__name__)

    record = PreparedOptimizer(
        weakref.ref(optimizer), master_weight_bits, state_bits, min_quantized_numel,
        compressed_state_dict, check_numerics, compile_options=compile_options or {}, state_format=state_format,
        gradient_format=gradient_format, bucket_numel=bucket_numel,
    )
    for group in optimizer.param_groups:
        prepare_group(optimizer, record, group, masters, names)
    for name, module in model.named_modules():
        if any(record.error_term(p) is not None for p in module.parameters(recurse=False)):
            module_hooks.split_weights_on_load(module)
    roles.PREPARED[optimizer] = record
    if gradient_release:
        if not any(sharded.is_sharded(p) for p in record.params()):
            # Each parameter's update runs on its slices of the flat storage.
            lay_out_flat(optimizer, record, range(len(optimizer.param_groups)), flat_step=False)
        record.gradient_release = release.GradientRelease.install(optimizer, record, compile_options or {})
    elif any(sharded.is_sharded(p) for p in record.params()):
        route_step_through_local_optimizer(optimizer, record, compile_options or {})
    else:
        lay_out_flat(optimizer, record, range(len(optimizer.param_groups)))
        route_step_through_buckets(optimizer, compile_options or {})
    _install_prepared_methods(optimizer)
    graph_utils.remember_names(model)  # for a model compiled in place after, whose graph breaks start frames
    return model


def lay_out_flat(optimizer, record, group_indices, flat_step=True):
    """Move the parameters of the param groups ``group_indices`` into flat buckets (and, for the
    flat step, land their gradients there)."""
    for gi in group_indices:
        buckets = flat.lay_out(optimizer, record, gi, flat_step)
        record.buckets.extend(buckets)
        if flat_step:
            flat.install_gradient_hooks(optimizer, buckets)


def prepare_group(optimizer, record, group, masters, names):
    """Give the parameters of ``group`` their stored form: error terms from their fp32 masters
    (``masters``, else their own values) and states; ``lr`` becomes a tensor."""
    if group.get("foreach", False) is None:
        # torch would pick foreach on CUDA; its horizontal kernels cannot fuse with the
        # per-group absmax of the 8-bit states (docs/notes_optimizer_fusion.md). An explicit
        # foreach=True is kept.
        group["foreach"] = False
    make_lr_tensor(group)
    lo_dtype = None if record.master_weight_bits is None else split_weights.error_term_dtype(record.master_weight_bits)
    for p in group["params"]:
        record.param_names[p] = names[p]
        master = masters.pop(p, None)  # dropped once encoded: peak memory stays low
        if master is None:
            master = model_conversion.FP32_ORIGINALS.pop(p, None)
        if master is None:
            master = p.detach()
        if not sharded.is_sharded(p) and not p.is_contiguous():
            # The compiled step views parameters, gradients and states in groups of 32.
            p.data = p.data.contiguous()
        if lo_dtype is not None and p.dtype in (torch.bfloat16, torch.float16):
            # Per local shard for a sharded (DTensor) parameter: see flash_inductor/sharded.py.
            lo = _encode_into(sharded.local(master), sharded.local(p.detach()), lo_dtype)
            record.error_terms[p] = sharded.like(p, lo)
        init_state(optimizer, record, group, p)


# Elements ``prepare`` encodes at once: ``split_weights.encode``'s fp32 temporaries take ~40 bytes per
# element, for a whole 50257 x 768 embedding 1.5 GB, more than the stored bytes of all of GPT-2.
ENCODE_CHUNK = 1 << 20


def _encode_into(master, hi, lo_dtype):
    """Split fp32 ``master`` into ``hi`` (written in place: the parameter) and the returned error term,
    a block of rows at a time (the split is elementwise, so the bits are those of one call)."""
    lo = torch.empty(hi.shape, dtype=lo_dtype, device=hi.device)
    rows_of = (lambda t: t.unsqueeze(0)) if hi.dim() == 0 else (lambda t: t)  # noqa: E731
    master, hi_rows, lo_rows = rows_of(master), rows_of(hi), rows_of(lo)
    step = max(1, ENCODE_CHUNK // max(1, math.prod(hi_rows.shape[1:])))
    for start in range(0, hi_rows.shape[0], step):
        h, e = split_weights.encode(master[start:start + step].float().contiguous(), hi.dtype, lo_dtype)
        hi_rows[start:start + step].copy_(h)
        lo_rows[start:start + step].copy_(e)
    return lo


def _install_prepared_methods(optimizer):
    """Checkpoint hooks, and ``add_param_group`` / ``copy.deepcopy`` that know the stored form."""
    checkpoint.install_hooks(optimizer)
    original_add_param_group = optimizer.add_param_group

    def add_param_group(self, param_group):
        record = prepared(self)
        if record.gradient_release is not None or any(sharded.is_sharded(p) for p in record.params()):
            raise ValueError(
                f"{type(self).__name__}.add_param_group after flash_inductor.prepare is not supported with gradient "
                "release or FSDP2; add every param group before prepare"
            )
        new = dict(param_group, params=_as_param_list(param_group["params"]))
        names = {p: f"param_groups[{len(self.param_groups)}][{i}]" for i, p in enumerate(new["params"])}
        _check_group(self, new, names)
        _check_not_held_elsewhere(self, names)
        original_add_param_group(new)
        prepare_group(self, record, self.param_groups[-1], {}, names)
        lay_out_flat(self, record, [len(self.param_groups) - 1])

    optimizer.add_param_group = types.MethodType(add_param_group, optimizer)
    optimizer.__deepcopy__ = types.MethodType(_deepcopy_prepared, optimizer)


def _as_param_list(params):
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _deepcopy_prepared(optimizer, memo):
    """``copy.deepcopy`` of a prepared optimizer: a prepared optimizer over the copied parameters,
    with copies of their error terms and states, stepping through the backend like the original.
    Like torch's own deepcopy of an optimizer, it holds only defaults, state and param groups."""
    record = prepared(optimizer)
    if record.gradient_release is not None or any(sharded.is_sharded(p) for p in record.params()):
        raise TypeError(
            "copy.deepcopy of an optimizer prepared with gradient_release=True or over FSDP2 parameters is not "
            "supported; save and load its state_dict instead"
        )
    copied = type(optimizer).__new__(type(optimizer))
    memo[id(optimizer)] = copied
    copied.__setstate__(copy.deepcopy(optimizer.__getstate__(), memo))
    copied_record = dataclasses.replace(
        record,
        optimizer_ref=weakref.ref(copied),
        error_terms={copy.deepcopy(p, memo): copy.deepcopy(e, memo) for p, e in record.error_terms.items()},
        param_names={copy.deepcopy(p, memo): n for p, n in record.param_names.items()},
        buckets=[],
    )
    roles.PREPARED[copied] = copied_record
    lay_out_flat(copied, copied_record, range(len(copied.param_groups)))
    route_step_through_buckets(copied, record.compile_options)
    _install_prepared_methods(copied)
    return copied


def _check_gradient_format(gradient_format, model, names, state_bits, gradient_release):
    """``gradient_format`` is one of GRADIENT_FORMATS or None, and fits the other arguments: the FP8
    gradients live in the flat buckets of quantized states, and nothing else may need ``.grad``."""
    if gradient_format is None:
        return
    option = f"gradient_format={gradient_format!r}"
    if gradient_format not in tensor_scaled.GRADIENT_FORMATS:
        formats = sorted(tensor_scaled.GRADIENT_FORMATS)
        raise ValueError(f"gradient_format must be None or one of {formats}, got {gradient_format!r}")
    if state_bits is None:
        raise ValueError(
            f"{option} keeps the gradients of the parameters with 8-bit states in FP8, but state_bits=None gives none "
            "8-bit states; pass state_bits=8 (the default) with it, or drop gradient_format"
        )
    if gradient_release:
        raise ValueError(
            f"{option} cannot be combined with gradient_release=True: gradient release applies each gradient in backward "
            "and frees it, so there is no gradient to keep until the step; choose one of them"
        )
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or any(sharded.is_sharded(p) for p in names):
        raise ValueError(
            f"{option} is not supported with DistributedDataParallel or FSDP2 (fully_shard): their gradient "
            "collectives read and write .grad, which FP8 gradients leave empty; use gradient_format=None"
        )


def _embeddings_for_fp32_activations(model, fp32_activations):
    """[(name, module)] of the embeddings ``fp32_activations=True`` starts fp32 activations from; [] for False."""
    if fp32_activations not in (True, False):
        raise ValueError(f"fp32_activations must be True or False, got {fp32_activations!r}")
    if not fp32_activations:
        return []
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    if not embeddings:
        raise ValueError(
            f"fp32_activations=True found no nn.Embedding or nn.EmbeddingBag in the {type(model).__name__} passed to "
            "prepare to start fp32 activations from; drop fp32_activations, or cast your model's first activations "
            "to fp32 yourself"
        )
    return embeddings


def _check_group(optimizer, group, names):
    name = type(optimizer).__name__
    if group.get("fused"):
        raise ValueError(f"{name}(fused=True) cannot use split weights; construct it with fused=None (the backend fuses the step)")
    if group.get("differentiable"):
        raise ValueError(
            f"{name}(differentiable=True) is not supported by flash_inductor.prepare; construct it with differentiable=False"
        )
    if type(optimizer) is torch.optim.SGD and group.get("dampening", 0) != 0:
        raise ValueError(
            f"{name}(dampening={group['dampening']}) is not supported: prepared momentum buffers start at zero, "
            "so torch's first-step rule (buffer = grad, undampened) cannot be reproduced; use dampening=0"
        )
    for p in group["params"]:
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(
                f"parameter '{names[p]}' has dtype {p.dtype}, which flash_inductor does not support: it keeps "
                "fp32/bf16/fp16 parameters; convert it (e.g. model.float()) or leave it out of the optimizer"
            )


def _check_params(model, optimizer):
    """{param: name in ``model``} of the optimizer's parameters; refuses a parameter that is not the
    model's, appears twice, or belongs to another prepared optimizer (they would share, and fight
    over, one error term and one state)."""
    by_param = {p: n for n, p in model.named_parameters()}
    names = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            where = f"param_groups[{gi}][{pi}]"
            if p not in by_param:
                raise ValueError(
                    f"flash_inductor.prepare: the optimizer's {where} ({p.dtype}{list(p.shape)}) is not a parameter of "
                    f"the {type(model).__name__} passed to prepare; pass the model whose parameters the optimizer holds"
                )
            if p in names:
                raise ValueError(
                    f"flash_inductor.prepare: parameter '{by_param[p]}' appears twice in the optimizer ({where} and "
                    "earlier); each parameter may be in one param group once"
                )
            names[p] = by_param[p]
    _check_not_held_elsewhere(optimizer, names)
    return names


def _check_not_held_elsewhere(optimizer, names):
    for p, name in names.items():
        other = roles.holder(p)
        if other is not None and other.optimizer is not optimizer:
            raise ValueError(
                f"flash_inductor.prepare: parameter '{name}' is already held by another prepared "
                f"{type(other.optimizer).__name__}; two optimizers over one parameter would overwrite each other's "
                "error term and states: give each parameter to one optimizer"
            )
