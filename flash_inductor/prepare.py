"""``prepare(model, optimizer)``: bf16 parameters with split master weights and 8-bit states.

Everything is converted in place and allocated in its compressed form from the start: the
optimizer keeps its class, its param groups and its hyperparameters.
"""

import collections
import copy
import dataclasses
import fnmatch
import types
import warnings
import weakref

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from flash_inductor import flat, fp8_delayed, module_hooks, registry, roles, sharded
from flash_inductor.formats import companded, split_weights
from flash_inductor.formats.state_tensor import CompandedState, Fp32State, StateTensor

NORM_LAYERS = (
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm,
    nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
)


@dataclasses.dataclass(eq=False)
class PreparedOptimizer:
    """What ``prepare`` added to an optimizer: error terms and the settings it was prepared with."""

    optimizer_ref: weakref.ReferenceType
    master_weight_bits: int | None
    state_bits: int | None
    min_quantized_numel: int
    compressed_state_dict: bool
    check_numerics: bool
    error_terms: dict = dataclasses.field(default_factory=dict)  # param -> error term
    param_names: dict = dataclasses.field(default_factory=dict)  # param -> name
    gradient_release: object = None  # a gradient_release.GradientRelease when prepared with it
    compile_options: dict = dataclasses.field(default_factory=dict)  # how its step is compiled
    buckets: list = dataclasses.field(default_factory=list)  # flat.Bucket, when its step is flat
    active_groups: object = None  # of a bucket optimizer: its Bucket.active mask

    @property
    def optimizer(self):
        return self.optimizer_ref()

    def params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def error_term(self, param):
        return self.error_terms.get(param)

    def layout(self, group):
        return registry.layout(type(self.optimizer), group)

    def update_shape(self, param):
        """The shape the compiled step updates ``param`` in.

        With 8-bit states that is their storage layout, ``(groups, 32)``, for the master, the
        gradient and every state alike: the update, the per-group absmax and the encode then share
        one iteration space, and Inductor fuses each parameter's step into one kernel without an
        fp32 copy of any state. Valid because every supported optimizer is elementwise. Tensors
        whose size is not a multiple of 32 (or whose states are unquantized) keep their shape.
        """
        states = self.optimizer.state.get(param, {}).values()
        if param.numel() % companded.GROUP_SIZE == 0 and any(isinstance(s, CompandedState) for s in states):
            return (param.numel() // companded.GROUP_SIZE, companded.GROUP_SIZE)
        return tuple(param.shape)


def prepared(optimizer) -> PreparedOptimizer:
    try:
        return roles.PREPARED[optimizer]
    except KeyError:
        raise ValueError(
            f"{type(optimizer).__name__} was not prepared: call flash_inductor.prepare(model, optimizer) first"
        ) from None


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    master_weight_bits: int | None = 24,
    state_bits: int | None = 8,
    keep_fp32=(),
    min_quantized_numel: int = 4096,
    compressed_state_dict: bool = False,
    check_numerics: bool = False,
    compile_options: dict | None = None,
    gradient_release: bool = False,
):
    """Make ``model`` + ``optimizer`` memory-efficient, in place; returns ``model``.

    - Floating-point parameters become bf16, except normalization layers and modules whose names
      match a pattern in ``keep_fp32`` (fnmatch, e.g. ``"lm_head"`` or ``"*.norm*"``): those stay
      fp32, with their inputs cast to fp32 and outputs cast back. Already-bf16/fp16 models keep
      their dtype.
    - Each bf16/fp16 parameter gets an error term: int8 for ``master_weight_bits=24``, int16 for
      32, none for None. An fp32 parameter's value becomes the master (nothing is lost).
    - Moment states are allocated as companded 8-bit codes with fp16 group scales
      (``state_bits=8``), except tensors under ``min_quantized_numel`` elements, which stay
      fp32; ``state_bits=None`` keeps every state in fp32.
    - ``optimizer.step()`` then runs through the ``flashoptim`` backend (compiled on first call,
      with ``compile_options``); inside a function compiled with ``backend="flashoptim"`` it is
      traced with the rest.
    - ``gradient_release=True`` instead updates each parameter in backward, as soon as its
      gradient is complete, and frees the gradient; ``optimizer.step()`` only marks the end of a
      step (flash_inductor/gradient_release.py).
    """
    # Everything is checked before anything is changed: a refused call leaves model and optimizer as
    # they were.
    if optimizer in roles.PREPARED:
        raise ValueError(f"{type(optimizer).__name__} is already prepared")
    if state_bits not in (8, None):
        raise ValueError(f"state_bits must be 8 or None, got {state_bits!r}")
    split_weights.error_term_dtype(master_weight_bits)  # refuses other values
    registry.check_supported(optimizer)
    names = _check_params(model, optimizer)
    for group in optimizer.param_groups:
        _check_group(optimizer, group, names)
    from flash_inductor.options import Options

    Options.from_dict(compile_options)
    if isinstance(keep_fp32, str):
        keep_fp32 = (keep_fp32,)
    sharded.check_fsdp_not_started(model)
    sharded.check_fsdp_groups_keep_one_dtype(model, lambda name, module: _keeps_fp32(name, module, keep_fp32))
    if gradient_release not in (True, False):
        raise ValueError(f"gradient_release must be True or False, got {gradient_release!r}")
    if gradient_release:
        from flash_inductor import gradient_release as release

        release.check_model(model)
    masters = _convert_model(model, keep_fp32, held=set(names))

    record = PreparedOptimizer(
        weakref.ref(optimizer), master_weight_bits, state_bits, min_quantized_numel,
        compressed_state_dict, check_numerics, compile_options=compile_options or {},
    )
    for group in optimizer.param_groups:
        prepare_group(optimizer, record, group, masters, names)
    for name, module in model.named_modules():
        if any(record.error_term(p) is not None for p in module.parameters(recurse=False)):
            module_hooks.split_weights_on_load(module)
    roles.PREPARED[optimizer] = record
    if gradient_release:
        record.gradient_release = release.GradientRelease.install(optimizer, record, compile_options or {})
    elif any(sharded.is_sharded(p) for p in record.params()):
        sharded.route_step_through_local_optimizer(optimizer, record, compile_options or {})
    else:
        lay_out_flat(optimizer, record, range(len(optimizer.param_groups)))
        route_step_through_buckets(optimizer, compile_options or {})
    _install_prepared_methods(optimizer)
    return model


def lay_out_flat(optimizer, record, group_indices):
    """Move the parameters of the param groups ``group_indices`` into flat buckets."""
    for gi in group_indices:
        buckets = flat.lay_out(optimizer, record, gi)
        record.buckets.extend(buckets)
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
            master = _FP32_ORIGINALS.pop(p, None)
        if master is None:
            master = p.detach()
        if not sharded.is_sharded(p) and not p.is_contiguous():
            # The compiled step views parameters, gradients and states in groups of 32.
            p.data = p.data.contiguous()
        if lo_dtype is not None and p.dtype in (torch.bfloat16, torch.float16):
            # Per local shard for a sharded (DTensor) parameter: see flash_inductor/sharded.py.
            hi, lo = split_weights.encode(sharded.local(master).float().contiguous(), p.dtype, lo_dtype)
            sharded.local(p.detach()).copy_(hi)
            record.error_terms[p] = sharded.like(p, lo)
        init_state(optimizer, record, group, p)


def _install_prepared_methods(optimizer):
    """Checkpoint hooks, and ``add_param_group`` / ``copy.deepcopy`` that know the stored form."""
    from flash_inductor import checkpoint

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


def _keeps_fp32(name, module, patterns):
    return isinstance(module, NORM_LAYERS) or any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


# parameter -> its fp32 value before ``prepare`` cast it, for trainable parameters the preparing
# optimizer did not hold: another optimizer's ``prepare`` takes it as their master.
_FP32_ORIGINALS = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise


def _convert_model(model, keep_fp32, held):
    """Cast fp32 parameters and buffers (except FP8 delayed-scaling state) to bf16 in place (same
    Parameter objects); return the original fp32 values of the cast parameters in ``held``, which
    become their masters. Those of other trainable parameters are kept in ``_FP32_ORIGINALS``
    until the optimizer that holds them is prepared."""
    masters = {}
    kept = []
    retained = []
    for name, module in model.named_modules():
        if _keeps_fp32(name, module, keep_fp32):
            if any(p.dtype == torch.float32 for p in module.parameters(recurse=False)):
                kept.append(module)
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.dtype != torch.float32:
                continue
            if sharded.is_sharded(p):
                original = sharded.cast_parameter(p, torch.bfloat16)
            else:
                original = p.data  # the fp32 storage itself: p.data is replaced, not written
                p.data = p.data.to(torch.bfloat16)
            if p in held:
                masters[p] = original
            elif p.requires_grad:
                _FP32_ORIGINALS[p] = original
                retained.append((f"{name}.{pname}" if name else pname, original))
        for bname, b in module.named_buffers(recurse=False):
            if b.dtype == torch.float32 and not fp8_delayed.is_state_buffer(bname):
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


def make_lr_tensor(group):
    """A tensor ``lr`` lets schedulers change it without recompiling the step (they ``fill_`` it).

    torch's Adam refuses a tensor lr with foreach unless ``capturable``; under compile the step is
    graph-captured anyway, so prepared Adam groups are marked capturable.
    """
    if not isinstance(group["lr"], torch.Tensor):
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
    if "capturable" in group and group.get("foreach"):
        group["capturable"] = True


def init_state(optimizer, record, group, p):
    """Give ``p`` every state ``prepare`` allocates, in stored form; states already stored are kept."""
    layout = record.layout(group)
    state = optimizer.state[p]
    if layout.step and "step" not in state:
        on_device = group.get("capturable") or group.get("fused")
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if on_device else "cpu")
    for key, kind in layout.quantized.items():
        existing = state.get(key)
        if not isinstance(sharded.local(existing), StateTensor):
            state[key] = new_state(record, p, kind, None if existing is None else existing.float())


def new_state(record, param, kind, value=None):
    """The stored form of one optimizer state of ``param`` (zeros when ``value`` is None).

    For a sharded parameter: the local shard's state as a DTensor like ``param``; whether it is
    quantized depends on the whole parameter's size, as without sharding."""
    quantize = record.state_bits == 8 and param.numel() >= record.min_quantized_numel
    shard, value = sharded.local(param), sharded.local(value)
    if value is not None:
        value = value.to(shard.device)
    if quantize:
        state = CompandedState.zeros(shard, kind) if value is None else CompandedState.encode(value, kind, shard.dtype)
    else:
        state = Fp32State.zeros(shard) if value is None else Fp32State.encode(value, shard.dtype)
    return sharded.like(param, state)


def route_step_through_buckets(optimizer, compile_options):
    """Replace ``optimizer.step`` (a bound method, so LR schedulers can wrap it) by the flat step:
    the gradients collected into the buckets, then the stock step of every bucket optimizer with a
    gradient, through the ``flashoptim`` backend (traced inline when already compiling). And
    ``zero_grad(set_to_none=True)`` frees the flat gradient buffers."""
    from flash_inductor import checks
    from flash_inductor.backend import compile as compile_with_backend

    compiled = compile_with_backend(flat.step_buckets, **compile_options)
    original_zero_grad = optimizer.zero_grad

    def step(self, closure=None):
        record = prepared(self)
        loss = evaluate_closure(closure)
        if torch.compiler.is_compiling():
            flat.step_buckets(flat.collect_gradients(record))
            return loss
        stepping = flat.collect_gradients(record)  # checks each gradient it has to copy in
        if record.check_numerics:
            for group in self.param_groups:
                checks.check_lr_moves_weights(record, group)
        module_hooks.forget_loaded_error_terms(record.params())
        if stepping:
            run_compiled_step(compiled, self, stepping)
        return loss

    @torch.compiler.disable
    def zero_grad(self, set_to_none=True):
        original_zero_grad(set_to_none)
        if set_to_none:
            flat.release_gradients(prepared(self))

    # torch's wrapper of ``step``: the user's step hooks (register_step_pre_hook) and profiling.
    optimizer.step = types.MethodType(torch.optim.Optimizer.profile_hook_step(step), optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)


def route_step_per_parameter(optimizer, compile_options):
    """Replace ``optimizer.step`` by the stock step over its parameters (unrolled per parameter),
    through the ``flashoptim`` backend, or traced inline when already compiling. The step of the
    local optimizer of FSDP2 shards, whose local tensors FSDP2 owns and may replace."""
    from flash_inductor import checks
    from flash_inductor.backend import compile as compile_with_backend

    original = optimizer.step
    compiled = compile_with_backend(original, **compile_options)

    def step(self, closure=None):
        if torch.compiler.is_compiling():
            return original(closure)
        loss = evaluate_closure(closure)
        checks.check_before_step(self)
        module_hooks.forget_loaded_error_terms(prepared(self).params())
        run_compiled_step(compiled, self)
        return loss

    optimizer.step = types.MethodType(step, optimizer)


def evaluate_closure(closure):
    """What ``step(closure)`` returns: the closure's loss, evaluated with grad enabled (as torch's
    optimizers do), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


_RUN_STEPS = weakref.WeakSet()  # the compiled steps run so far (alive)
_run_step_count = 0  # how many distinct compiled steps have run in this process, dead ones included


def run_compiled_step(compiled, optimizer, *args):
    """Call a compiled optimizer step (on ``args``) with a Dynamo cache large enough for every prepared step.

    Every optimizer of a class shares one Dynamo cache (one code object, guarded on ``self``), and
    gradient release adds one single-parameter optimizer per parameter. Entries of optimizers that
    were freed stay in that cache and count towards the limit, so the room is sized by every step
    run so far (two entries each: a hook in CUDA's autograd thread runs under another grad mode).
    Past the limit Dynamo would silently run the step eagerly, without the passes; it raises
    instead. Float hyperparameters (betas, weight decay, momentum) are specialized: a changed value
    recompiles the step, where Dynamo would otherwise make it a graph input read with ``.item()``,
    which the passes cannot rewrite; a recompile limit hit because they change every step raises
    an error naming them.
    """
    global _run_step_count
    if compiled not in _RUN_STEPS:
        _RUN_STEPS.add(compiled)
        _run_step_count += 1
    config = torch._dynamo.config
    limit = max(config.recompile_limit, 2 * _run_step_count + 8)
    with config.patch(recompile_limit=limit, accumulated_recompile_limit=max(config.accumulated_recompile_limit, limit),
                      fail_on_recompile_limit_hit=True, specialize_float=True,
                      # A bucket whose step count becomes per group recompiles with static shapes.
                      automatic_dynamic_shapes=False):
        seen = _FLOAT_HYPERPARAMETERS.setdefault(optimizer, collections.defaultdict(set))
        for gi, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if key != "params" and _is_float_constant(value):
                    seen[gi, key].add(value)
        try:
            compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            changing = [f"param_groups[{gi}]['{key}']" for (gi, key), values in seen.items() if len(values) > 1]
            if not changing:
                raise
            raise RuntimeError(
                f"flash_inductor: the {type(optimizer).__name__} step recompiled for every new value of "
                f"{', '.join(changing)} and hit Dynamo's recompile limit: float hyperparameters are constants of the "
                "compiled step (lr, and Adam's and Lion's betas, are tensors and may change freely). A scheduler "
                "that changes them every step, such as OneCycleLR with its default cycle_momentum=True (SGD's "
                "momentum), needs cycle_momentum=False; or keep them fixed"
            ) from error


# optimizer -> {(group index, key): values of its float hyperparameters seen at compiled steps}
_FLOAT_HYPERPARAMETERS = weakref.WeakKeyDictionary()


def _is_float_constant(value):
    return isinstance(value, float) or (isinstance(value, tuple) and all(isinstance(v, float) for v in value))

