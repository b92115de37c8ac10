"""The step of a prepared optimizer over FSDP2-sharded parameters: a local optimizer.

The same class and hyperparameters over the parameters' local tensors, with their local states and
error terms (flash_inductor/sharded.py), synced before every step and stepped per parameter
through the backend (``steps.route_step_per_parameter``): FSDP2 owns the local tensors and may
replace them, so they are not laid out flat.
"""

import dataclasses
import types
import weakref

import torch

from flash_inductor import roles
from flash_inductor.sharded import local
from flash_inductor.steps import evaluate_closure, route_step_per_parameter


@dataclasses.dataclass(eq=False)
class LocalOptimizer:
    """The optimizer the step of a sharded prepared optimizer runs: ``optimizer``'s class over
    its parameters' local tensors, kept in sync with it before every step."""

    outer_ref: weakref.ReferenceType  # the user's optimizer (DTensor parameters)
    optimizer: torch.optim.Optimizer  # over the local tensors

    @classmethod
    def build(cls, outer, record):
        # The groups already hold every hyperparameter, so the base class's __init__ suffices (the
        # classes' own signatures differ).
        opt = object.__new__(type(outer))
        groups = [dict(g, params=[local(p) for p in g["params"]]) for g in outer.param_groups]
        torch.optim.Optimizer.__init__(opt, groups, outer.defaults)
        roles.PREPARED[opt] = dataclasses.replace(record, optimizer_ref=weakref.ref(opt), error_terms={}, param_names={},
                                                  internal=True)
        return cls(weakref.ref(outer), opt)

    def sync(self):
        """Local tensors, gradients, states, error terms and hyperparameters from the sharded
        optimizer. FSDP2 may replace a local tensor object (re-padding in its lazy init, loads),
        so they are looked up again each step; unchanged objects keep the compiled step's cache."""
        local_record = roles.PREPARED[self.optimizer]
        local_record.error_terms.clear()
        local_record.param_names.clear()
        self.optimizer.state.clear()
        for group_index, group in enumerate(self.outer_ref().param_groups):
            self._sync_hyperparameters(group_index)
            self.optimizer.param_groups[group_index]["params"] = [self._sync_param(p) for p in group["params"]]

    def _sync_hyperparameters(self, group_index):
        group = self.outer_ref().param_groups[group_index]
        self.optimizer.param_groups[group_index].update({k: v for k, v in group.items() if k != "params"})

    def _sync_param(self, p):
        """Register the current local tensor of ``p`` with its gradient shard, name, error term
        and states in the local optimizer; return it."""
        outer = self.outer_ref()
        record, local_record = roles.PREPARED[outer], roles.PREPARED[self.optimizer]
        lp = local(p)
        lp.grad = local(p.grad)
        local_record.param_names[lp] = record.param_names[p]
        if record.error_term(p) is not None:
            local_record.error_terms[lp] = local(record.error_term(p))
        if p in outer.state:
            self.optimizer.state[lp] = {k: local(v) for k, v in outer.state[p].items()}
        return lp

    def release_grads(self):
        """Drop the local optimizer's references to the gradient shards (the user's
        ``zero_grad`` frees them)."""
        for group in self.optimizer.param_groups:
            for lp in group["params"]:
                lp.grad = None


def route_step_through_local_optimizer(optimizer, record, compile_options):
    """Replace ``optimizer.step`` by one that runs the local optimizer's step, itself routed
    through the backend like any prepared optimizer's."""
    local_optimizer = LocalOptimizer.build(optimizer, record)
    route_step_per_parameter(local_optimizer.optimizer, compile_options)

    # Dynamo does not trace this (the sync sets .grad of local tensors): a compiled train step
    # graph-breaks at opt.step(), and the local step is compiled on its own.
    @torch.compiler.disable
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        local_optimizer.sync()
        try:
            local_optimizer.optimizer.step()
        finally:
            local_optimizer.release_grads()
        return loss

    optimizer.step = types.MethodType(step, optimizer)
