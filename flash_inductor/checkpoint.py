"""Checkpoints of prepared optimizers.

``optimizer.state_dict()`` holds, by default, fp32 decoded states under torch's own keys (a stock
``torch.optim`` optimizer of the same class loads it) plus each parameter's error term under
``"error_term"``. With ``prepare(..., compressed_state_dict=True)`` the 8-bit states are saved as
their codes and scales instead (``{"codes", "scales", "kind"}``), less than half the size, and
reload bit-exactly. Either form loads back into a prepared optimizer, and so does a stock one.

Loading always leaves every parameter with the states ``prepare`` would give it, in their stored
form: states the loaded dict lacks (e.g. a stock optimizer saved before its first step) start
from zero, as after ``prepare``; never as plain tensors of the parameter's dtype, which the step
would otherwise allocate lazily. Error terms are restored from the dict (rescaled if it was saved
with other ``master_weight_bits``); a dict without them (a stock one) leaves them as they are.
"""

import weakref

import torch

from flash_inductor import roles, sharded
from flash_inductor.formats import companded, split_weights
from flash_inductor.formats.state_tensor import CompandedState, StateTensor
from flash_inductor.prepare import init_state, make_lr_tensor, new_state

ERROR_TERM_KEY = "error_term"


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
    state = {}
    for index, param in enumerate(params):
        if index not in state_dict["state"] and record.error_term(param) is None:
            continue
        entries = dict(state_dict["state"].get(index, {}))
        for key, value in entries.items():
            stored = sharded.local(value)  # states of a sharded parameter are DTensors of local states
            if isinstance(stored, CompandedState) and record.compressed_state_dict:
                entries[key] = {
                    "codes": sharded.groups_like(value, stored.codes.clone(), _name(record, param)),
                    "scales": sharded.groups_like(value, stored.scales.clone(), _name(record, param)),
                    "kind": stored.kind,
                }
            elif isinstance(stored, StateTensor):
                entries[key] = sharded.like(value, stored.decode().clone())
        error = record.error_term(param)
        if error is not None:
            entries[ERROR_TERM_KEY] = error.clone()
        state[index] = entries
    # Entries torch keeps for tensors that are not parameters of this optimizer (rare).
    for key, entries in state_dict["state"].items():
        if not isinstance(key, int) or key >= len(params):
            state[key] = entries
    groups = [dict(g, lr=float(g["lr"])) for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


# optimizer -> {param index: {key: (saved value, kind)}}, between the two load hooks
_pending = weakref.WeakKeyDictionary()


def _load_pre_hook(optimizer, state_dict):
    """Take our entries out before torch casts every floating state to the parameter's dtype.

    Saved entries are matched to parameters the way torch matches them (position in the saved
    groups' ``params`` lists), and their kinds come from the saved groups' hyperparameters, which
    are the ones the optimizer has after the load.
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
            kinds.append(dict(layout.quantized, **{ERROR_TERM_KEY: None}))
    held, state = {}, {}
    for saved_id, entries in state_dict["state"].items():
        if saved_id not in position:
            state[saved_id] = entries
            continue
        index = position[saved_id]
        ours = kinds[index]
        held[index] = {k: (v, ours[k]) for k, v in entries.items() if k in ours}
        state[saved_id] = {k: v for k, v in entries.items() if k not in ours}
    _pending[optimizer] = held
    return dict(state_dict, state=state)


def _load_post_hook(optimizer):
    record = roles.PREPARED[optimizer]
    held = _pending.pop(optimizer, {})
    for group in optimizer.param_groups:
        make_lr_tensor(group)
    for index, (param, group) in enumerate(zip(_params_by_index(optimizer), _groups_by_index(optimizer))):
        entries = dict(held.get(index, {}))
        state = optimizer.state[param]
        error = entries.pop(ERROR_TERM_KEY, (None, None))[0]
        if error is not None and record.error_term(param) is not None:
            _restore_error_term(record, param, error)
        for key, (saved, kind) in entries.items():
            state[key] = _restore_state(saved, param, record, kind)
        init_state(optimizer, record, group, param)  # whatever the dict lacked starts as after prepare


def _restore_error_term(record, param, saved):
    current = record.error_term(param)
    if tuple(saved.shape) != tuple(current.shape):
        raise ValueError(
            f"load_state_dict: saved error term of parameter '{_name(record, param)}' has shape "
            f"{list(saved.shape)}, the parameter {list(current.shape)}"
        )
    if saved.dtype != current.dtype:
        if saved.dtype not in split_weights._CODE_MAX:
            raise ValueError(
                f"load_state_dict: saved error term of parameter '{_name(record, param)}' is {saved.dtype}; "
                "expected int8 (24-bit masters) or int16 (32-bit masters)"
            )
        # Same relative error, on the other code scale (the checkpoint used other master_weight_bits).
        scaled = saved.double() * split_weights.code_max(current.dtype) / split_weights.code_max(saved.dtype)
        saved = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    current.copy_(saved.to(current.device, current.dtype))


def _restore_state(saved, param, record, kind):
    """The stored state of ``param`` from a saved entry. For a sharded parameter, everything is
    restored per local shard (the saved DTensors hold this rank's shard)."""
    name = _name(record, param)
    shard = sharded.local(param)
    if isinstance(saved, dict):  # compressed form
        groups = companded.num_groups(shard.numel())
        codes, scales = sharded.local(saved["codes"]), sharded.local(saved["scales"])
        if saved.get("kind") != kind or codes.numel() != groups * companded.GROUP_SIZE or scales.numel() != groups:
            raise ValueError(
                f"load_state_dict: compressed state of parameter '{name}' (kind {saved.get('kind')!r}, "
                f"{codes.numel()} codes, {scales.numel()} scales) does not fit a {kind!r} state of shape "
                f"{list(shard.shape)} ({groups * companded.GROUP_SIZE} codes, {groups} scales)"
            )
        state = CompandedState(
            codes.to(shard.device, companded.CODE_DTYPES[kind]).reshape(groups, companded.GROUP_SIZE).clone(),
            scales.to(shard.device, torch.float16).clone(),
            kind, shape=shard.shape, dtype=shard.dtype,
        )
        if isinstance(sharded.local(new_state(record, param, kind)), CompandedState):
            return sharded.like(param, state)
        saved = state.decode()
    saved = sharded.local(saved)
    if isinstance(saved, StateTensor):
        saved = saved.decode()
    if not isinstance(saved, torch.Tensor) or saved.numel() != shard.numel():
        shape = list(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
        raise ValueError(f"load_state_dict: saved state of parameter '{name}' is {shape}, the parameter {list(shard.shape)}")
    return new_state(record, param, kind, saved.float().reshape(shard.shape))


def master_state_dict(model, optimizer):
    """{parameter name: fp32 master value} (decoded split weights; fp32 parameters as they are).
    Of a sharded (FSDP2) parameter: a DTensor like it."""
    record = roles.PREPARED[optimizer]
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

    Every entry is checked (name and shape) before any parameter is written. A sharded (FSDP2)
    parameter takes a DTensor (as ``master_state_dict`` gives) or the whole value, of which each
    rank keeps its shard.
    """
    record = roles.PREPARED[optimizer]
    params = dict(model.named_parameters())
    missing = [n for n in masters if n not in params]
    if missing:
        raise KeyError(f"load_master_state_dict: no parameter named {missing} in the model")
    wrong = [f"{n}: {list(v.shape)} vs {list(params[n].shape)}" for n, v in masters.items() if v.shape != params[n].shape]
    if wrong:
        raise ValueError(f"load_master_state_dict: shapes do not match the parameters ({'; '.join(wrong)})")
    for name, value in masters.items():
        p = params[name]
        error = record.error_term(p)
        shard, value = sharded.local(p.detach()), sharded.local(sharded.shard_like(p, value))
        if error is not None:
            split_weights.store(shard, sharded.local(error), value.to(shard.device, torch.float32))
        else:
            shard.copy_(value.to(shard.device, shard.dtype))
