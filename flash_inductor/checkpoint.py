"""Checkpoints of prepared optimizers.

``optimizer.state_dict()`` holds, by default, fp32 decoded states under torch's own keys (a stock
``torch.optim`` optimizer of the same class loads it) plus each parameter's error term under
``"error_term"`` and, for its 8-bit states, their bf16 group scales under ``"group_scales"``
(``{state key: scales}``, 1/64 of the decoded bytes): with them the decoded values load back to
the very codes and scales they came from (``companded.encode_with_saved_scales``), where encoding
decoded values afresh moves the codes of a group that lacks its top code. The fp16 group scales of
a checkpoint saved before the scales were bf16 load too (converted to bf16; a group they do not
reproduce is encoded afresh, within a code step). FP8-LM states
(``state_format="fp8lm"``) need no saved scale: their decoded values encode back to the same codes
and scale (formats/tensor_scaled.py); they ignore ``"group_scales"``, so decoded values load across
formats (re-encoded). Both forms reload bit-exactly. With
``prepare(..., compressed_state_dict=True)`` quantized states are saved as their codes and scales
instead (``{"codes", "scales", "kind"}``), less than half the size; they load only into an optimizer
of the same ``state_format``. Either form loads back into a prepared optimizer, and so does a stock
one.

Loading always leaves every parameter with the states ``prepare`` would give it, in their stored
form: states the loaded dict lacks (e.g. a stock optimizer saved before its first step) start
from zero, as after ``prepare``; never as plain tensors of the parameter's dtype, which the step
would otherwise allocate lazily. Error terms are restored from the dict (rescaled if it was saved
with other ``master_weight_bits``); a dict without them (a stock one) leaves them as they are.
Every entry is checked before anything changes: a refused load leaves the optimizer as it was.
"""

import weakref

import torch

from flash_inductor import module_hooks, roles, sharded
from flash_inductor.formats import companded, split_weights
from flash_inductor.formats.state_tensor import QUANTIZED, STATE_FORMATS, CompandedState, StateTensor
from flash_inductor.optimizer_record import init_state, make_lr_tensor, new_state, prepared

ERROR_TERM_KEY = "error_term"
SCALES_KEY = "group_scales"


def install_hooks(optimizer):
    optimizer.register_state_dict_post_hook(_state_dict_post_hook)
    optimizer.register_load_state_dict_pre_hook(_load_pre_hook)
    optimizer.register_load_state_dict_post_hook(_load_post_hook)


def _params_by_index(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _groups_by_index(optimizer):
    return [group for group in optimizer.param_groups for _ in group["params"]]


def _name(record, param):
    return record.param_names.get(param, "?")


def _state_dict_post_hook(optimizer, state_dict):
    record = roles.PREPARED[optimizer]
    params = _params_by_index(optimizer)
    groups = _groups_by_index(optimizer)
    state = {}
    for index, param in enumerate(params):
        if index not in state_dict["state"] and record.error_term(param) is None:
            continue
        entries = dict(state_dict["state"].get(index, {}))
        scales = {}
        for key, value in entries.items():
            stored = sharded.local(value)  # states of a sharded parameter are DTensors of local states
            if isinstance(stored, QUANTIZED) and record.compressed_state_dict:
                entries[key] = {
                    "codes": sharded.groups_like(value, stored.codes.clone(), _name(record, param)),
                    "scales": sharded.groups_like(value, stored.scales.clone(), _name(record, param)),
                    "kind": stored.kind,
                }
            elif isinstance(stored, StateTensor):
                entries[key] = sharded.like(value, stored.decode().clone())
                if isinstance(stored, CompandedState) and not sharded.is_sharded(param):
                    # (A shard's groups need not line up with the whole tensor's: see sharded.groups_like.)
                    scales[key] = stored.scales.clone()
            elif key == "step" and record.buckets:
                # A view of the bucket's count: saved as the tensor ``prepare`` gives a stock-like group.
                entries[key] = value.detach().to(_step_device(groups[index], param), copy=True)
        error = record.error_term(param)
        if error is not None:
            entries[ERROR_TERM_KEY] = error.clone()
        if scales:
            entries[SCALES_KEY] = scales
        state[index] = entries
    # Entries torch keeps for tensors that are not parameters of this optimizer (rare).
    for key, entries in state_dict["state"].items():
        if not isinstance(key, int) or key >= len(params):
            state[key] = entries
    groups = [dict(g, lr=float(g["lr"])) for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


def _step_device(group, param):
    return param.device if group.get("capturable") or group.get("fused") else "cpu"


# optimizer -> {param index: {key: restored value}}, checked and built by the pre-hook for the post-hook
_pending = weakref.WeakKeyDictionary()

# How to get a loadable entry: for entries of another model, and for entries no prepared optimizer saves.
_SAME_MODEL = "load a checkpoint of an optimizer over this model (the same parameters, in the same order)"
_RESAVE = "save the checkpoint again from a prepared optimizer of this class over this model"


def _load_pre_hook(optimizer, state_dict):
    """Check our entries and build what each restores; take them out before torch casts every
    floating state to the parameter's dtype.

    torch replaces the optimizer's states and param groups between the two load hooks, so every
    refusal is raised here: a refused load leaves the optimizer as it was. Saved entries are matched
    to parameters the way torch matches them (position in the saved groups' ``params`` lists), and
    their kinds come from the saved groups' hyperparameters, which are the ones the optimizer has
    after the load.
    """
    _pending.pop(optimizer, None)
    record = roles.PREPARED[optimizer]
    saved_groups = state_dict["param_groups"]
    groups = optimizer.param_groups
    if len(saved_groups) != len(groups) or any(len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, groups)):
        return None  # torch raises its own error for this
    position, kinds = {}, []
    for group, saved_group in zip(groups, saved_groups):
        layout = record.layout({**group, **saved_group})
        for saved_id in saved_group["params"]:
            position[saved_id] = len(kinds)
            kinds.append(dict(layout.quantized, **{ERROR_TERM_KEY: None, SCALES_KEY: None}))
    params = _params_by_index(optimizer)
    restored, state = {}, {}
    for saved_id, entries in state_dict["state"].items():
        if saved_id not in position:
            state[saved_id] = entries
            continue
        index = position[saved_id]
        ours = kinds[index]
        # Only companded states need their saved scales (module docstring); others drop them.
        saved_scales = entries.get(SCALES_KEY, {}) if record.state_format == "companded" else {}
        scales = _saved_scales(record, params[index], saved_scales)
        restored[index] = {
            k: _restore(record, params[index], k, v, ours[k], scales.get(k))
            for k, v in entries.items() if k in ours and k != SCALES_KEY
        }
        state[saved_id] = {k: v for k, v in entries.items() if k not in ours}
    _pending[optimizer] = restored
    return dict(state_dict, state=state)


def _load_post_hook(optimizer):
    """Install what the pre-hook checked and built; nothing here refuses."""
    record = roles.PREPARED[optimizer]
    restored = _pending.pop(optimizer, {})
    for group in optimizer.param_groups:
        make_lr_tensor(group)
    for index, (param, group) in enumerate(zip(_params_by_index(optimizer), _groups_by_index(optimizer))):
        entries = dict(restored.get(index, {}))
        error = entries.pop(ERROR_TERM_KEY, None)
        if error is not None:
            record.error_term(param).copy_(error)
            module_hooks.error_term_loaded(param)
        optimizer.state[param].update(entries)
        init_state(optimizer, record, group, param)  # whatever the dict lacked starts as after prepare
    for bucket in record.buckets:  # the loaded values into the flat storage, which the states view again
        for param in bucket.params:
            bucket.adopt(optimizer, record, param)
        bucket.adopt_steps(optimizer)


def _refusal(record, param, key, problem, fix):
    """The error refusing the saved entry ``key`` of ``param``."""
    return ValueError(f"load_state_dict: saved {key!r} of parameter '{_name(record, param)}' {problem}; {fix}")


def _describe(value):
    return f"{list(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__


def _restore(record, param, key, saved, kind, saved_scales):
    if key == ERROR_TERM_KEY:
        return _restore_error_term(record, param, saved)
    return _restore_state(record, param, key, saved, kind, saved_scales)


def _saved_scales(record, param, saved):
    """{state key: saved group scales} of ``param``, each checked to be one per group of 32."""
    if not isinstance(saved, dict):
        raise _refusal(record, param, SCALES_KEY, f"is {_describe(saved)}, not a dict of group scales by state key", _RESAVE)
    groups = companded.num_groups(sharded.local(param).numel())
    for key, scales in saved.items():
        scales = sharded.local(scales)
        if not isinstance(scales, torch.Tensor) or not scales.is_floating_point() or scales.numel() != groups:
            raise _refusal(
                record, param, f"{SCALES_KEY}[{key!r}]", f"is {_describe(scales)}, not {groups} floating-point group scales",
                _SAME_MODEL,
            )
    return saved


def _restore_error_term(record, param, saved):
    """The value for ``param``'s error term; None when it has none (an fp32 parameter is its own
    master: there is nothing to restore)."""
    current = record.error_term(param)
    if current is None:
        return None
    if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(current.shape):
        raise _refusal(record, param, ERROR_TERM_KEY, f"is {_describe(saved)}, the error term {list(current.shape)}", _SAME_MODEL)
    if saved.dtype != current.dtype:
        if saved.dtype not in split_weights._CODE_MAX:
            raise _refusal(
                record, param, ERROR_TERM_KEY, f"is {saved.dtype}, not int8 (24-bit masters) or int16 (32-bit masters)", _RESAVE
            )
        # Same relative error, on the other code scale (the checkpoint used other master_weight_bits).
        scaled = saved.double() * split_weights.code_max(current.dtype) / split_weights.code_max(saved.dtype)
        saved = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return saved.to(current.device, current.dtype)


def _restore_state(record, param, key, saved, kind, saved_scales=None):
    """The stored state of ``param`` from a saved entry (decoded values with the group scales they
    were saved with, or the compressed form). For a sharded parameter, everything is restored per
    local shard (the saved DTensors hold this rank's shard)."""
    shard = sharded.local(param)
    if isinstance(saved, dict):  # compressed form
        state = _compressed_state(record, param, key, saved, kind)
        if isinstance(sharded.local(new_state(record, param, kind)), QUANTIZED):
            return sharded.like(param, state)
        saved = state.decode()
    saved = sharded.local(saved)
    if isinstance(saved, StateTensor):
        saved = saved.decode()
    if not isinstance(saved, torch.Tensor) or saved.numel() != shard.numel():
        raise _refusal(record, param, key, f"is {_describe(saved)}, the parameter {list(shard.shape)}", _SAME_MODEL)
    return new_state(record, param, kind, saved.float().reshape(shard.shape), saved_scales)


def _compressed_state(record, param, key, saved, kind):
    """The state a compressed entry holds, once checked to be codes and scales the record's state
    format can give: other codes would wrap or decode to garbage rather than fail."""
    shard = sharded.local(param)
    stored = STATE_FORMATS[record.state_format]
    groups, count = companded.num_groups(shard.numel()), stored.num_scales(shard.numel())
    codes, scales = sharded.local(saved.get("codes")), sharded.local(saved.get("scales"))
    fix = f"{_RESAVE}, or with compressed_state_dict=False (decoded fp32 states)"
    if (
        saved.get("kind") != kind
        or not isinstance(codes, torch.Tensor) or codes.numel() != groups * companded.GROUP_SIZE
        or not isinstance(scales, torch.Tensor) or scales.numel() != count
    ):
        raise _refusal(
            record, param, key,
            f"(kind {saved.get('kind')!r}, codes {_describe(codes)}, scales {_describe(scales)}) does not fit a {kind!r} "
            f"state of state_format={record.state_format!r} and shape {list(shard.shape)} ({groups * companded.GROUP_SIZE} "
            f"codes, {count} scales)",
            fix,
        )
    code_dtype, scale_dtype = stored.stored_dtypes(kind)
    if codes.dtype != code_dtype or scales.dtype != scale_dtype:
        raise _refusal(
            record, param, key,
            f"has {codes.dtype} codes and {scales.dtype} scales, a {kind!r} state of state_format="
            f"{record.state_format!r} {code_dtype} and {scale_dtype}", fix,
        )
    problem = stored.codes_problem(codes, kind)
    if problem is not None:
        raise _refusal(record, param, key, problem, fix)
    if bool(((scales < 0) | scales.isinf()).any()):
        raise _refusal(
            record, param, key, "has negative or infinite scales; scales are finite and >= 0 (nan for a non-finite group)",
            fix,
        )
    return stored.from_stored(codes.to(shard.device), scales.to(shard.device), kind, shape=shard.shape, dtype=shard.dtype)


def master_state_dict(model, optimizer):
    """{parameter name: fp32 master value} (decoded split weights; fp32 parameters as they are).
    Of a sharded (FSDP2) parameter: a DTensor like it."""
    record = prepared(optimizer)
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for p in record.params():
        error = record.error_term(p)
        name = names.get(p, record.param_names.get(p))
        if error is None:
            out[name] = p.detach().float().clone()
        else:
            # Decoded per local shard: DTensor's rules garble the bf16 -> int16 view the decode reads.
            out[name] = sharded.like(p, split_weights.decode(sharded.local(p.detach()), sharded.local(error)))
    return out


@torch.no_grad()
def load_master_state_dict(model, optimizer, masters):
    """Set parameters from fp32 masters: bf16 values plus recomputed error terms.

    Every entry is checked (name, floating-point tensor, shape) before any parameter is written. A
    sharded (FSDP2) parameter takes a DTensor (as ``master_state_dict`` gives) or the whole value,
    of which each rank keeps its shard.
    """
    record = prepared(optimizer)
    params = dict(model.named_parameters())
    missing = [n for n in masters if n not in params]
    if missing:
        raise KeyError(f"load_master_state_dict: no parameter named {missing} in the model")
    problems = [f"'{n}' {problem}" for n, v in masters.items() if (problem := _master_problem(v, params[n]))]
    if problems:
        raise ValueError(
            f"load_master_state_dict: nothing was written: {'; '.join(problems)}; give each parameter a floating-point "
            "tensor of its shape (as master_state_dict returns)"
        )
    for name, value in masters.items():
        p = params[name]
        error = record.error_term(p)
        shard, value = sharded.local(p.detach()), sharded.local(sharded.shard_like(p, value))
        if error is not None:
            split_weights.store(shard, sharded.local(error), value.to(shard.device, torch.float32))
        else:
            shard.copy_(value.to(shard.device, shard.dtype))


def _master_problem(value, param):
    """Why ``value`` cannot be the master of ``param``; None when it can."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return f"is {_describe(value)}, not a floating-point tensor"
    if value.shape != param.shape:
        return f"has shape {list(value.shape)}, the parameter {list(param.shape)}"
    return None
