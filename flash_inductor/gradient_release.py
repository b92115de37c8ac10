"""Gradient release: each parameter is updated in backward, as soon as its gradient is complete.

``prepare(model, optimizer, gradient_release=True)`` registers a post-accumulate-grad hook on
every parameter of the optimizer that requires a gradient. When autograd has finished a
parameter's gradient, the hook runs the optimizer's own ``step`` on that parameter alone, compiled
through the ``flashoptim`` backend (the same rewritten numerics as the whole step: master and
states decoded once, updated in fp32, each stored value rounded once), then sets ``p.grad = None``.
Only the gradients of the layer being differentiated are alive at a time instead of all of them
at the end of backward, so peak memory drops by about the gradient bytes (AdamW with 24-bit
masters: 7.1 -> 5.1 bytes/param, DESIGN.md §2.3).

Each parameter gets a single-parameter optimizer: the optimizer's class, built the way unpickling
builds one, whose one param group holds the parameter and, before each update, the current
hyperparameters of the parameter's group (the same ``lr`` tensor, so LR schedulers keep working),
and whose state is the parameter's entry of the optimizer's state (also after a
``load_state_dict``). Dynamo compiles one step per parameter (it guards on the optimizer object
and its tensors); parameters of one shape and dtype give the same graph, which Inductor's FX graph
cache compiles once.

``optimizer.step()`` updates nothing: it marks the end of a training step (a closure passed to it
is still evaluated), and so does ``optimizer.zero_grad()``. Refused with an error naming the fix:

- a second gradient for a parameter within one step (gradient accumulation, or two backward
  passes before ``step()``): raised from that backward, before anything is written;
- a model wrapped in ``DistributedDataParallel``, or plain (non-DTensor) parameters in a
  multi-process run: the update would use the local gradient before the all-reduce.

Global gradient clipping cannot be detected: ``clip_grad_norm_`` after backward finds no
gradients, clips nothing and returns 0. Optimizer step hooks (``register_step_pre_hook``) do not
run.

Under FSDP2 the hooks fire on each sharded (DTensor) parameter once its gradient shard is
reduce-scattered; the update runs on the local shard through the sharded optimizer's local
optimizer (``flash_inductor/sharded.py``), one parameter at a time, like the sharded step.
"""

import collections
import types
import weakref

import torch
import torch.distributed as dist

from flash_inductor import checks, roles, sharded, sharded_step
from flash_inductor.backend import compile as compile_with_backend
from flash_inductor.steps import evaluate_closure, run_compiled_step

OPTION = "prepare(..., gradient_release=True)"


def check_model(model):
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            f"{OPTION} cannot be used with DistributedDataParallel: each parameter would be updated with its "
            "local gradient before DDP all-reduces it; use gradient_release=False with DDP, or shard the model "
            "with FSDP2 (fully_shard)"
        )


class SingleParameterStep:
    """The optimizer's step on one parameter, compiled through the backend (for a sharded parameter:
    on its local shard, through the local optimizer)."""

    def __init__(self, optimizer, group_index, param, compile_options):
        self.group_index = group_index
        self.param = param
        self.optimizer = type(optimizer).__new__(type(optimizer))
        self.optimizer.__setstate__(
            {"defaults": optimizer.defaults, "state": collections.defaultdict(dict), "param_groups": [{"params": []}]}
        )
        self.optimizer._warned_capturable_if_run_uncaptured = True
        self.sync(optimizer)
        self.compiled = compile_with_backend(self.optimizer.step, **compile_options)

    def sync(self, optimizer):
        """Take the current hyperparameters and state of the parameter in ``optimizer``."""
        group = self.optimizer.param_groups[0]
        group.update(optimizer.param_groups[self.group_index])
        group["params"] = [self.param]
        self.optimizer.state[self.param] = optimizer.state[self.param]
        return group


class GradientRelease:
    """The single-parameter steps of one prepared optimizer and the step boundary they share."""

    def __init__(self, optimizer, record, compile_options):
        self.optimizer_ref = weakref.ref(optimizer)
        self.record = record
        self.compile_options = compile_options
        self.optimizers = {}  # param -> SingleParameterStep
        self.group_index = {}  # param -> index of its group
        self.updated = set()  # ids of parameters updated since the last step() / zero_grad()
        self.local_optimizer = None  # sharded_step.LocalOptimizer, for FSDP2 parameters

    @classmethod
    def install(cls, optimizer, record, compile_options):
        release = cls(optimizer, record, compile_options)
        if any(sharded.is_sharded(p) for p in record.params()):
            release.local_optimizer = sharded_step.LocalOptimizer.build(optimizer, record)
        handles = []
        for group_index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    release.group_index[p] = group_index
                    if release.local_optimizer is None:
                        release.optimizers[p] = SingleParameterStep(optimizer, group_index, p, compile_options)
                    handles.append(p.register_post_accumulate_grad_hook(release.update))
        # The hooks live on the parameters, which may outlive the optimizer.
        weakref.finalize(optimizer, lambda: [h.remove() for h in handles])
        original_zero_grad = optimizer.zero_grad

        @torch.compiler.disable
        def zero_grad(self, set_to_none=True):
            original_zero_grad(set_to_none)
            release.updated.clear()

        optimizer.step = types.MethodType(_step, optimizer)
        optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
        return release

    # Autograd calls hooks from inside a function being compiled (a train step's loss.backward());
    # the hook runs as Python, and compiles only the step.
    @torch.compiler.disable
    def update(self, param):
        """Post-accumulate-grad hook: update ``param`` with its gradient, then free the gradient."""
        optimizer = self.optimizer_ref()
        name = self.record.param_names.get(param, "?")
        if id(param) in self.updated:
            raise RuntimeError(
                f"{OPTION}: parameter '{name}' received a second gradient before optimizer.step(): gradient "
                "accumulation (or several backward passes per step) is not possible when each gradient is applied "
                "and freed in backward; call optimizer.step() (or zero_grad()) after every backward, or use "
                "gradient_release=False"
            )
        if sharded.data_parallel(param):
            raise RuntimeError(
                f"{OPTION}: parameter '{name}' is a plain tensor in a {dist.get_world_size()}-process run: with data "
                "parallelism (DistributedDataParallel) it would be updated with its local gradient before the "
                "all-reduce; use gradient_release=False, or shard the model with FSDP2 (fully_shard)"
            )
        checks.check_grad(self.record, param)
        if self.local_optimizer is None:
            step = self.optimizers[param]
            group = step.sync(optimizer)
        else:
            step, group = self._local_step(param)
        if self.record.check_numerics:
            checks.check_lr_moves_weights(self.record, group)
        try:
            run_compiled_step(step.compiled, step.optimizer)
        finally:
            step.param.grad = None
        self.updated.add(id(param))
        param.grad = None

    def _local_step(self, param):
        """The single-parameter step of a sharded ``param``'s local shard, synced. FSDP2 may swap a
        local tensor object (in its lazy initialisation at the first forward), so the step is
        built for the current one."""
        local_param = self.local_optimizer.sync_one(param, self.group_index[param])
        step = self.optimizers.get(param)
        if step is None or step.param is not local_param:
            step = SingleParameterStep(self.local_optimizer.optimizer, self.group_index[param], local_param,
                                       self.compile_options)
            self.optimizers[param] = step
        return step, step.sync(self.local_optimizer.optimizer)


@torch.compiler.disable
def _step(optimizer, closure=None):
    """``optimizer.step()`` under gradient release: the updates happened in backward."""
    loss = evaluate_closure(closure)
    release = roles.PREPARED[optimizer].gradient_release
    # A gradient still there at the step did not pass through a hook (set by hand, or of a parameter
    # that did not require grad at prepare): it would be silently ignored.
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                raise RuntimeError(
                    f"{OPTION}: parameter '{release.record.param_names.get(p, '?')}' has a gradient at "
                    "optimizer.step(); only gradients computed by backward for parameters that required grad at "
                    "prepare are applied (in backward), so this one would be ignored; use gradient_release=False"
                )
    release.updated.clear()
    return loss


