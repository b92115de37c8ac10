"""Gradient release: each parameter is updated in backward, as soon as its gradient is complete.

``prepare(model, optimizer, gradient_release=True)`` registers a post-accumulate-grad hook on
every parameter of the optimizer that requires a gradient. When autograd has finished a
parameter's gradient, the hook runs the optimizer's own ``step`` on that parameter alone, compiled
through the ``flashoptim`` backend (the same rewritten numerics as the whole step: master and
states decoded once, updated in fp32, each stored value rounded once), then sets ``p.grad = None``.
Only the gradients of the layer being differentiated are alive at a time instead of all of them
at the end of backward, so peak memory drops by about the gradient bytes (AdamW with 24-bit
masters: 7.1 -> 5.1 bytes/param, DESIGN.md §2.3).

The step runs on a single-parameter optimizer: the optimizer's class, built the way unpickling
builds one, whose one param group holds, before each update, the current hyperparameters of the
parameter's group (the same ``lr`` tensor, so LR schedulers keep working). Its parameter, error
term and states are *windows*: tensor objects of its own that are pointed (``Tensor.set_``) at the
updated parameter's tensors before the call, so its updates write the parameter's slices of the
flat storage, and its state is the parameter's entry of the optimizer's state (also after a
``load_state_dict``). Parameters whose stored tensors are laid out alike (same group, dtype, shape
and state formats: ``layout_key``) share one such optimizer and one compiled step: Dynamo guards
the step on the identity and shapes of the optimizer's tensors, and the windows change their
storage, not their objects. A model compiles one step per layout, not per parameter: the 16-layer
Llama of docs/benchmarks.md has 5 layouts for its 147 tensors (one step per tensor took 375 s there).

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
reduce-scattered; the windows are pointed at the local shard's tensors (FSDP2 may replace them:
they are looked up at every update), one parameter at a time, like the sharded step.
"""

import collections
import dataclasses
import types
import weakref

import torch
import torch.distributed as dist

from flash_inductor import checks, flat, roles, sharded
from flash_inductor.backend import compile as compile_with_backend
from flash_inductor.formats.state_tensor import StateTensor
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
    """The optimizer's step on one parameter at a time, compiled once for every parameter of one
    layout (``layout_key``): a single-parameter optimizer of the optimizer's class (built the way
    unpickling builds one) over *window* tensors of its own, which ``point_at`` makes views of a
    parameter's tensors (value, error term, each state's stored tensors, step count) before a call.

    Dynamo guards a step on the identity of the optimizer's tensors (it marks them static
    addresses: ID_MATCH) and on their shapes; the passes bind the error term that belongs to the
    optimizer's parameter. Both hold for every call: the window objects stay the same, only the
    storage they view changes (``Tensor.set_``)."""

    def __init__(self, optimizer, record, group_index, param, error, state, compile_options):
        self.param = _window(param)
        self.error = None if error is None else _window(error)
        self.state = {key: _window(value) for key, value in state.items()}
        self.windows = _stored_tensors(self.param, self.error, self.state)
        self.optimizer = type(optimizer).__new__(type(optimizer))
        self.optimizer.__setstate__({
            "defaults": optimizer.defaults,
            "state": collections.defaultdict(dict, {self.param: self.state}),
            "param_groups": [{"params": [self.param]}],
        })
        self.optimizer._warned_capturable_if_run_uncaptured = True
        shape = "x".join(map(str, param.shape)) or "scalar"
        roles.PREPARED[self.optimizer] = dataclasses.replace(
            record,
            optimizer_ref=weakref.ref(self.optimizer),
            error_terms={} if error is None else {self.param: self.error},
            param_names={self.param: f"group{group_index}_{str(param.dtype).removeprefix('torch.')}_{shape}"},
            gradient_release=None,
            buckets=[],
            internal=True,
        )
        # The class's own update, without torch's wrappers (flat.step_buckets): an internal optimizer has no
        # user hooks, and the wrappers' graph breaks and profiler record_function (a Dynamo warning) cost only.
        self.compiled = compile_with_backend(flat.step_buckets, **compile_options)

    def point_at(self, group, param, error, state, grad):
        """Make the windows views of ``param``'s tensors, with the hyperparameters ``group`` holds
        now (the same ``lr`` tensor: LR schedulers keep working) and ``grad`` as the gradient."""
        self.optimizer.param_groups[0].update(group)
        for window, tensor in zip(self.windows, _stored_tensors(param, error, state), strict=True):
            window.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
        self.param.grad = grad

    def release(self):
        """Let go of the gradient and of the storage the windows viewed."""
        self.param.grad = None
        for window in self.windows:
            window.set_()


def layout_key(group_index, param, error, state):
    """What a parameter's step is compiled for: its group (float hyperparameters are constants of
    the step) and the layout of each stored tensor; parameters of equal keys share one step."""
    return group_index, _layout(param), None if error is None else _layout(error), tuple(
        (key, _layout(value)) for key, value in state.items())


def _layout(t):
    if isinstance(t, StateTensor):
        return type(t), t._meta(), tuple(t.shape), t.dtype, tuple(_layout(inner) for inner in _stored(t))
    # Inductor assumes a static input that was aligned when compiled stays aligned (its note "Input
    # Alignment handling"; no runtime check on GPUs), so aligned and unaligned views compile apart.
    # The CPU code assumes nothing.
    aligned = t.device.type == "cpu" or t.data_ptr() % 16 == 0
    return tuple(t.shape), t.stride(), t.dtype, t.device, aligned


def _stored(t):
    """The tensors that hold ``t``: a StateTensor's inner tensors, or ``t`` itself."""
    return t.inner_tensors() if isinstance(t, StateTensor) else [t]


def _stored_tensors(param, error, state):
    """Every tensor that holds a parameter's training state, in an order its layout fixes."""
    return [param, *([] if error is None else [error]), *(t for value in state.values() for t in _stored(value))]


def _window(t):
    """A tensor object (or StateTensor of window objects) to be pointed at tensors laid out like ``t``."""
    if isinstance(t, StateTensor):
        return t._rebuild(_window)
    return torch.empty(0, dtype=t.dtype, device=t.device)


class GradientRelease:
    """The compiled steps of one prepared optimizer's parameters and the step boundary they share."""

    def __init__(self, optimizer, record, compile_options):
        self.optimizer_ref = weakref.ref(optimizer)
        self.record = record
        self.compile_options = compile_options
        self.steps = {}  # layout_key -> SingleParameterStep
        self.group_index = {}  # param -> index of its group
        self.updated = set()  # ids of parameters updated since the last step() / zero_grad()

    @classmethod
    def install(cls, optimizer, record, compile_options):
        release = cls(optimizer, record, compile_options)
        handles = []
        for group_index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    release.group_index[p] = group_index
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
        """Post-accumulate-grad hook: update ``param`` with its gradient, then free the gradient.
        A sharded (FSDP2) parameter is updated on its local shard: its local tensors are what the
        step's windows view."""
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
        checks.check_storage(self.record, param)
        checks.check_grad(self.record, param)
        group_index = self.group_index[param]
        group = {k: v for k, v in optimizer.param_groups[group_index].items() if k != "params"}
        target, grad = sharded.local(param), sharded.local(param.grad)
        error = sharded.local(self.record.error_term(param))
        _step_count_on_device(optimizer.state[param], target.device)
        state = {key: sharded.local(value) for key, value in optimizer.state[param].items()}
        if self.record.check_numerics:
            checks.check_lr_moves_weights(self.record, dict(group, params=[target]), stepped={target})
        key = layout_key(group_index, target, error, state)
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = SingleParameterStep(optimizer, self.record, group_index, target, error, state,
                                                         self.compile_options)
        # The gradient is the window's alone from here on: in the graph, it is the window's gradient.
        param.grad = None
        step.point_at(group, target, error, state, grad)
        try:
            run_compiled_step(step.compiled, step.optimizer, [step.optimizer])
        finally:
            step.release()
        # The step wrote through the windows: autograd's check that a saved tensor was not modified
        # in place still sees the write.
        torch.autograd.graph.increment_version(target)
        self.updated.add(id(param))


def _step_count_on_device(state, device):
    """Move a step count to its parameter's device, as Dynamo does when it traces a step
    (``OptimizerVariable.move_step_if_cpu``). Left to Dynamo, it would replace the step count's
    window in the window optimizer's state by a copy, which no later update would point at."""
    count = state.get("step")
    if count is not None and count.device != device:
        state["step"] = count.to(device)


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


