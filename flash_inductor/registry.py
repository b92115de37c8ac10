"""What the package knows about each optimizer class it supports, in one place.

An entry says which per-parameter states the class keeps and how each is companded (signed
softsign codes, or sqrt-linear codes for a second moment), whether it keeps a ``step`` counter,
which float hyperparameter its flat step reads from a tensor (SGD's momentum), and that its update
is elementwise: what the 8-bit group layout and the flat step over ``(groups, 32)`` views need (a
non-elementwise update, such as a per-tensor norm, would mix parameters' segments); and which state
formats it may use: the companded 8-bit format for every class, FP8-LM's (``state_format="fp8lm"``,
one scale per tensor) for Adam and AdamW only, the optimizer FP8-LM was designed and measured with.
``prepare`` allocates the states an entry names, checkpoints restore them, ``flash_inductor/flat.py``
lays them out; the tests parametrize over ``SUPPORTED``. Supporting
another elementwise ``torch.optim`` class (Adagrad, say) is one entry here, plus its tests.
"""

import dataclasses
from typing import Callable

import torch

from flash_inductor.formats import companded
from flash_inductor.formats.state_tensor import STATE_FORMATS
from flash_inductor.optim import SGDW, Lion


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The states one param group's parameters keep."""

    quantized: dict  # state key -> companded.SIGNED / companded.SQRT
    step: bool  # whether it keeps a "step" counter tensor


@dataclasses.dataclass(frozen=True)
class OptimizerEntry:
    states: Callable[[dict], dict]  # param group -> {state key: companded kind}
    counts_steps: bool
    elementwise: bool = True
    # A float hyperparameter that schedulers change every step and that the update both branches
    # on (``if momentum != 0``) and multiplies by, so it can be neither a constant of the compiled
    # step (a recompile per value) nor a plain tensor (a graph break at the branch): the flat step
    # traces it as NaN and binds that NaN to an fp32 tensor (passes/bound_hyperparameters.py).
    bound_hyperparameter: str | None = None
    state_formats: tuple = ("companded",)  # names in STATE_FORMATS

    def layout(self, group):
        return StateLayout(self.states(group), self.counts_steps)


def _adam_states(group):
    return {"exp_avg": companded.SIGNED, "exp_avg_sq": companded.SQRT} | (
        {"max_exp_avg_sq": companded.SQRT} if group["amsgrad"] else {})


def _momentum_states(group):
    return {"momentum_buffer": companded.SIGNED} if group["momentum"] else {}


SUPPORTED = {
    torch.optim.AdamW: OptimizerEntry(_adam_states, counts_steps=True, state_formats=("companded", "fp8lm")),
    torch.optim.Adam: OptimizerEntry(_adam_states, counts_steps=True, state_formats=("companded", "fp8lm")),
    torch.optim.SGD: OptimizerEntry(_momentum_states, counts_steps=False, bound_hyperparameter="momentum"),
    SGDW: OptimizerEntry(_momentum_states, counts_steps=False, bound_hyperparameter="momentum"),
    Lion: OptimizerEntry(lambda group: {"exp_avg": companded.SIGNED}, counts_steps=False),
}


def layout(optimizer_class, group) -> StateLayout:
    return SUPPORTED[optimizer_class].layout(group)


def bound_hyperparameter(optimizer_class) -> str | None:
    return SUPPORTED[optimizer_class].bound_hyperparameter


def _names(classes):
    return ", ".join(sorted(c.__module__.split(".")[0] + "." + c.__name__ for c in classes))


def check_supported(optimizer, state_format="companded"):
    if type(optimizer) not in SUPPORTED:
        raise TypeError(f"flash_inductor.prepare supports {_names(SUPPORTED)}; got {type(optimizer).__qualname__}")
    if state_format not in STATE_FORMATS:
        raise ValueError(f"state_format must be one of {sorted(STATE_FORMATS)}, got {state_format!r}")
    if state_format not in SUPPORTED[type(optimizer)].state_formats:
        able = [c for c, entry in SUPPORTED.items() if state_format in entry.state_formats]
        raise ValueError(
            f"state_format={state_format!r} is for {_names(able)} (FP8-LM's Adam states); "
            f"{type(optimizer).__qualname__} needs state_format='companded'"
        )
