"""Checkpoints of prepared optimizers.

``optimizer.state_dict()`` holds, by default, fp32 decoded states under torch's own keys (a stock
``torch.optim`` optimizer of the same class loads it) plus each parameter's error term under
``"error_term"``. With ``prepare(..., compressed_state_dict=True)`` the 8-bit states are saved as
their codes and scales instead (``{"codes", "scales", "kind"}``), less than half the size, and
reload bit-exactly. Either form loads back into a prepared optimizer, and so does a stock one.
"""

import torch

from flash_inductor import roles
from flash_inductor.formats import split_weights
from flash_inductor.formats.state_tensor import CompandedState, StateTensor
from flash_inductor.prepare import new_state

ERROR_TERM_KEY = "error_term"


def install_hooks(optimizer):
    optimizer.register_state_dict_post_hook(_state_dict_post_hook)
    optimizer.register_load_state_dict_pre_hook(_load_pre_hook)
    optimizer.register_load_state_dict_post_hook(_load_post_hook)


def _params_by_index(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _layouts_by_index(optimizer):
    record = roles.PREPARED[optimizer]
    return [record.layout(group) for group in optimizer.param_groups for _ in group["params"]]


def _state_dict_post_hook(optimizer, state_dict):
    record = roles.PREPARED[optimizer]
    params = _params_by_index(optimizer)
    state = {}
    for index, entries in state_dict["state"].items():
        entries = dict(entries)
        for key, value in entries.items():
            if isinstance(value, CompandedState) and record.compressed_state_dict:
                entries[key] = {"codes": value.codes.clone(), "scales": value.scales.clone(), "kind": value.kind}
            elif isinstance(value, StateTensor):
                entries[key] = value.decode().clone()
        error = record.error_term(params[index])
        if error is not None:
            entries[ERROR_TERM_KEY] = error.clone()
        state[index] = entries
    groups = [dict(g, lr=float(g["lr"])) for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


_pending = {}  # optimizer id -> {param index: {key: saved value}} between the load hooks


def _load_pre_hook(optimizer, state_dict):
    """Take our entries out before torch casts every floating state to the parameter's dtype."""
    keys_by_index = [set(layout.quantized) | {ERROR_TERM_KEY} for layout in _layouts_by_index(optimizer)]
    held, state = {}, {}
    for index, entries in state_dict["state"].items():
        keys = keys_by_index[int(index)]
        held[int(index)] = {k: v for k, v in entries.items() if k in keys}
        state[index] = {k: v for k, v in entries.items() if k not in keys}
    _pending[id(optimizer)] = held
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _load_post_hook(optimizer):
    record = roles.PREPARED[optimizer]
    held = _pending.pop(id(optimizer))
    params = _params_by_index(optimizer)
    layouts = _layouts_by_index(optimizer)
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
        if "capturable" in group and group.get("foreach"):
            group["capturable"] = True
    for index, entries in held.items():
        p = params[index]
        state = optimizer.state[p]
        error = entries.pop(ERROR_TERM_KEY, None)
        if error is not None and record.error_term(p) is not None:
            record.error_terms[p].copy_(error)
        for key, saved in entries.items():
            state[key] = _restore_state(saved, p, record, layouts[index].quantized[key])


def _restore_state(saved, param, record, kind):
    if isinstance(saved, dict):  # compressed form
        state = CompandedState(
            saved["codes"].to(param.device), saved["scales"].to(param.device), saved["kind"],
            shape=param.shape, dtype=param.dtype,
        )
        if isinstance(new_state(record, param, kind), CompandedState):
            return state
        saved = state.decode()
    return new_state(record, param, kind, saved.float())


def master_state_dict(model, optimizer):
    """{parameter name: fp32 master value} (decoded split weights; fp32 parameters as they are)."""
    record = roles.PREPARED[optimizer]
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for p in record.params():
        error = record.error_term(p)
        out[names[p]] = split_weights.decode(p.detach(), error) if error is not None else p.detach().float().clone()
    return out


@torch.no_grad()
def load_master_state_dict(model, optimizer, masters):
    """Set parameters from fp32 masters: bf16 values plus recomputed error terms."""
    record = roles.PREPARED[optimizer]
    params = dict(model.named_parameters())
    missing = [n for n in masters if n not in params]
    if missing:
        raise KeyError(f"load_master_state_dict: no parameter named {missing} in the model")
    for name, value in masters.items():
        p = params[name]
        error = record.error_term(p)
        if error is not None:
            split_weights.store(p, error, value.to(p.device, torch.float32))
        else:
            p.copy_(value.to(p.device, p.dtype))
