"""``@flash_inductor.train_step``: prepare and compile a whole training step in one place."""

import functools

from flash_inductor import roles
from flash_inductor.backend import compile as compile_with_backend
from flash_inductor.backend import prepare_fp8
from flash_inductor.prepare import prepare

_PREPARE_ARGS = ("master_weight_bits", "state_bits", "state_format", "keep_fp32", "min_quantized_numel",
                 "compressed_state_dict", "check_numerics", "gradient_release", "gradient_format",
                 "fp32_activations")


def train_step(fn=None, *, model, optimizer, **options):
    """Compile a step function (forward, ``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad()``) through the ``flashoptim`` backend.

    ``optimizer`` is prepared once, with the keyword arguments of ``prepare`` found in
    ``options`` (``master_weight_bits``, ``state_bits``, ...); the rest are backend options.
    With ``fp8="delayed"`` or ``fp8_all_gather=True``, ``model`` is prepared for them (``prepare_fp8``).
    Dynamo captures the forward (AOTAutograd derives the backward) and the optimizer step as one
    graph each: the prepared ``step`` graph-breaks and runs its own compiled flat step
    (flash_inductor/steps.py), with the same backend options. With ``gradient_release=True`` the
    updates run in backward hooks instead, each parameter's step compiled with them too.
    """
    prepare_args = {k: options.pop(k) for k in _PREPARE_ARGS if k in options}
    if fn is None:
        return functools.partial(train_step, model=model, optimizer=optimizer, **prepare_args, **options)
    if optimizer not in roles.PREPARED:
        # The optimizer's own compiled step (and gradient release's) runs with these options too.
        prepare(model, optimizer, compile_options=options, **prepare_args)
    elif prepare_args:
        raise ValueError(f"train_step: optimizer is already prepared; drop {sorted(prepare_args)}")
    if options.get("fp8") == "delayed" or options.get("fp8_all_gather"):
        prepare_fp8(model, **options)
    compiled = compile_with_backend(fn, **options)
    return functools.wraps(fn)(compiled)
