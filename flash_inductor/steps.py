"""How a prepared optimizer's ``step`` runs: through the ``flashoptim`` backend.

``route_step_through_buckets`` (the default: the flat step of flash_inductor/flat.py) and
``route_step_per_parameter`` (the local optimizer of FSDP2 shards) replace ``optimizer.step``;
``run_compiled_step`` calls a compiled step with a Dynamo cache large enough for every prepared step.
"""

import collections
import types
import weakref

import torch

from flash_inductor import checks, flat, inspection, module_hooks, triton_adam
from flash_inductor.backend import compile as compile_with_backend
from flash_inductor.optimizer_record import prepared
from flash_inductor.options import Options


def route_step_through_buckets(optimizer, compile_options):
    """Replace ``optimizer.step`` (a bound method, so LR schedulers can wrap it) by the flat step:
    the gradients collected into the buckets, then the stock step of every bucket optimizer with a
    gradient, through the ``flashoptim`` backend. And ``zero_grad(set_to_none=True)`` frees the
    flat gradient buffers (FP8 gradients: ``zero_grad`` discards them either way).

    Inside a compiled function (a train step) too, the step runs this way, as its own graph (torch
    breaks the graph around every optimizer step anyway): traced inline it would miss
    ``run_compiled_step``'s Dynamo settings, and a float hyperparameter seen with another value at
    the same place (a second model's bucket optimizers) became a dynamic float, read with
    ``.item()``, which the passes cannot rewrite.

    With ``step_kernel="triton"`` (the default) the buckets ``triton_adam`` can step run its kernel
    instead (CUDA Adam/AdamW); the others go through the compiled stock update."""
    compiled = compile_with_backend(flat.step_buckets, **compile_options)
    options = Options.from_dict(compile_options)
    hand_written = options.step_kernel == "triton" and options.compiler == "inductor"
    for bucket in prepared(optimizer).buckets:  # (a hint for backward's hooks: the step checks again)
        bucket.reads_gradients_in_place = hand_written and triton_adam.ineligible(bucket, bucket.optimizer) is None
    original_zero_grad = optimizer.zero_grad

    def step(self, closure=None):
        record = prepared(self)
        loss = evaluate_closure(closure)
        why_not = {}  # bucket -> why the kernel does not step it (None: it does)

        def kernel_reads(bucket):  # why the kernel cannot read a gradient in place, for a bucket it steps
            why_not[bucket] = triton_adam.ineligible(bucket, bucket.optimizer)
            return triton_adam.unreadable_gradient if why_not[bucket] is None else None

        stepping = flat.collect_gradients(record, kernel_reads if hand_written else None)  # checks each gradient
        checks.check_numerics(record, self, stepped={p for b in stepping for p in b.stepped_params()})
        module_hooks.forget_loaded_error_terms(record.params())
        if hand_written:
            inspection.note_step_kernels(record, {b: why_not[b] for b in stepping})
        by_kernel = [b for b in stepping if b in why_not and why_not[b] is None]
        for bucket in by_kernel:
            triton_adam.step(bucket, bucket.optimizer)
        compiled_buckets = [b.optimizer for b in stepping if b not in by_kernel]
        if compiled_buckets:
            run_compiled_step(compiled, self, compiled_buckets)
        return loss

    @torch.compiler.disable
    def zero_grad(self, set_to_none=True):
        original_zero_grad(set_to_none)
        flat.release_gradients(prepared(self), set_to_none)

    # torch's wrapper of ``step``: the user's step hooks (register_step_pre_hook) and profiling; all
    # of it eager (Dynamo would trace the wrapper up to the step and log that it ignores its profiler
    # record_function, a warning in every compiled train step).
    optimizer.step = types.MethodType(torch.compiler.disable(torch.optim.Optimizer.profile_hook_step(step)), optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)


def route_step_per_parameter(optimizer, compile_options):
    """Replace ``optimizer.step`` by the stock step over its parameters (unrolled per parameter),
    through the ``flashoptim`` backend. The step of the local optimizer of FSDP2 shards, whose
    local tensors FSDP2 owns and may replace; called from ``sharded_step``'s step, never traced."""
    compiled = compile_with_backend(flat.step_buckets, **compile_options)  # the class's update, unwrapped

    def step(self, closure=None):
        loss = evaluate_closure(closure)
        checks.check_before_step(self)
        module_hooks.forget_loaded_error_terms(prepared(self).params())
        run_compiled_step(compiled, self, [self])
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
    gradient release adds one single-parameter optimizer per parameter layout. Entries of optimizers that
    were freed stay in that cache and count towards the limit, so the room is sized by every step
    run so far (two entries each: a hook in CUDA's autograd thread runs under another grad mode).
    Past the limit Dynamo would silently run the step eagerly, without the passes; it raises
    instead. Float hyperparameters (weight decay; with gradient release or FSDP2 also betas and
    momentum) are specialized: a changed value recompiles the step, where Dynamo would otherwise
    make it a graph input read with ``.item()``, which the passes cannot rewrite; a recompile limit
    hit because they change every step raises an error naming them. The flat step takes the ones
    schedulers change every step from tensors instead (flat.py: betas, SGD's momentum).
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
                "compiled step, except lr, and (in the flat step, not with gradient_release=True or FSDP2) Adam's "
                "and Lion's betas and SGD's momentum, which may change every step. Keep the others fixed; with "
                "gradient release or FSDP2, a scheduler such as OneCycleLR needs cycle_momentum=False"
            ) from error


# optimizer -> {(group index, key): values of its float hyperparameters seen at compiled steps}
_FLOAT_HYPERPARAMETERS = weakref.WeakKeyDictionary()


def _is_float_constant(value):
    return isinstance(value, float) or (isinstance(value, tuple) and all(isinstance(v, float) for v in value))

