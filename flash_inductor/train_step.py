"""``@flash_inductor.train_step``: prepare, and compile a training step (whole, or its model's blocks), in one place."""

import functools

import torch
import torch.nn as nn

from flash_inductor import flat, graph_utils, model_conversion, roles
from flash_inductor.backend import COMPILED_BLOCKS, prepare_fp8
from flash_inductor.backend import compile as compile_with_backend
from flash_inductor.fp8_linear import refused_by_user
from flash_inductor.optimizer_record import prepared
from flash_inductor.options import Options
from flash_inductor.prepare import prepare

_PREPARE_ARGS = ("master_weight_bits", "state_bits", "state_format", "keep_fp32", "min_quantized_numel",
                 "compressed_state_dict", "check_numerics", "gradient_release", "gradient_format",
                 "fp32_activations", "bucket_numel")


def train_step(fn=None, *, model, optimizer, regional=False, **options):
    """Compile a step function (forward, ``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad()``) through the ``flashoptim`` backend.

    ``optimizer`` is prepared once, with the keyword arguments of ``prepare`` found in
    ``options`` (``master_weight_bits``, ``state_bits``, ...); the rest are backend options.
    With ``fp8="delayed"`` or ``fp8_all_gather=True``, ``model`` is prepared for them (``prepare_fp8``).
    Dynamo captures the forward (AOTAutograd derives the backward) and the optimizer step as one
    graph each: the prepared ``step`` graph-breaks and runs its own compiled flat step
    (flash_inductor/steps.py), with the same backend options. With ``gradient_release=True`` the
    updates run in backward hooks instead, each parameter's step compiled with them too.

    ``regional=True`` compiles the model's repeated blocks instead of the step (regional
    compilation): each module of ``model``'s largest ``nn.ModuleList`` (a transformer's layers,
    such as Hugging Face's ``model.layers``) has its forward compiled in place with the backend and
    ``options``, and the rest of the step runs eagerly, the optimizer's step as its own compiled flat
    step. Blocks of one class share their graphs (Dynamo compiles the first block's, then one for
    all the others), so the compile is short. Each block's backward is then a graph of its
    own, so with ``gradient_release=True`` a block's gradients are applied and freed as soon as its
    backward ends; a whole-step graph returns every gradient at its end, before any hook runs, and
    the peak does not drop (docs/architecture.md, "Gradient release").
    """
    prepare_args = {k: options.pop(k) for k in _PREPARE_ARGS if k in options}
    if fn is None:
        return functools.partial(train_step, model=model, optimizer=optimizer, regional=regional, **prepare_args,
                                 **options)
    if regional:  # checked before anything changes
        if Options.from_dict(options).loss_chunk_rows:
            raise ValueError(
                "train_step(regional=True): loss_chunk_rows rewrites a loss in a compiled graph, and a regional step "
                "runs its loss eagerly; call flash_inductor.linear_cross_entropy(hidden, lm_head.weight, None, "
                "targets, chunk_rows=...) in the step instead, or compile the whole step (regional=False)"
            )
        blocks = repeated_blocks(model)
        _check_blocks_choose_alike(model, blocks, options)
    if optimizer not in roles.PREPARED:
        # The optimizer's own compiled step (and gradient release's) runs with these options too.
        prepare(model, optimizer, compile_options=options, **prepare_args)
    elif prepare_args:
        raise ValueError(f"train_step: optimizer is already prepared; drop {sorted(prepare_args)}")
    if options.get("fp8") == "delayed" or options.get("fp8_all_gather"):
        prepare_fp8(model, **options)
    graph_utils.remember_names(model)  # frames compiled after a graph break name their layers within the model
    if regional:
        for block in blocks:
            block.forward = _compiled_block_forward(block, len(blocks), options)
        step = _explaining_failures(fn, fn, model)
        setattr(step, COMPILED_BLOCKS, blocks)
        return step
    record = prepared(optimizer)
    if not record.gradient_release:
        # The whole step's backward is one graph: its gradients all come out at its end.
        flat.land_gradients_at_step(record)
    return _explaining_failures(fn, compile_with_backend(fn, **options), model)


def _explaining_failures(fn, run, model):
    """``run`` as ``fn``'s wrapper (``run``'s attributes kept: ``inspect`` sees a compiled step), with
    a note added to an error that an op of the prepared ``model`` has no bf16 kernel."""
    @functools.wraps(fn)
    def step(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except RuntimeError as error:
            model_conversion.explain_missing_bf16_kernel(error, model)
            raise

    step.__dict__.update(getattr(run, "__dict__", {}))
    return step


def _compiled_block_forward(block, num_blocks, options):
    """``block.forward`` compiled with the backend, to be set in place of it.

    The forward, not ``nn.Module.compile``'s ``_call_impl``: Dynamo does not trace that frame for
    torch's own modules (``nn.Sequential``, ``nn.TransformerEncoderLayer``), which would then run
    eagerly without a word. Hooks stay eager; ``state_dict`` names do not change. All blocks share
    one code object, so one Dynamo cache: a block that cannot reuse another's graph (a Hugging Face
    layer given a KV cache guards on its own entry of it) compiles its own, and the recompile limit
    (default 8) is raised to let every block compile rather than run the rest eagerly."""
    compiled = compile_with_backend(block.forward, **options)

    @functools.wraps(block.forward)
    def forward(*args, **kwargs):
        config = torch._dynamo.config
        limit = max(config.recompile_limit, num_blocks + 8)
        with config.patch(recompile_limit=limit, accumulated_recompile_limit=max(config.accumulated_recompile_limit, limit)):
            return compiled(*args, **kwargs)

    return forward


def _check_blocks_choose_alike(model, blocks, options):
    """ValueError where ``fp8_exclude`` or ``fp8_filter`` choose differently for two blocks' layers
    of one name within a block: the blocks share compiled graphs (one graph serves both)."""
    parsed = Options.from_dict(options)
    if parsed.fp8 is None or not (parsed.fp8_exclude or parsed.fp8_filter):
        return
    block_name = {id(m): name for name, m in model.named_modules()}
    chosen = {}  # name within a block -> (in FP8, the first full name it was decided for)
    for block in blocks:
        for inner, _ in block.named_modules():
            name = ".".join(filter(None, (block_name[id(block)], inner)))
            in_fp8 = refused_by_user(name, parsed) is None
            first = chosen.setdefault(inner, (in_fp8, name))
            if first[0] != in_fp8:
                fp8, other = (first[1], name) if first[0] else (name, first[1])
                raise ValueError(
                    f"train_step(regional=True): fp8_exclude / fp8_filter keep {fp8} in FP8 but not {other}; the "
                    "blocks share compiled graphs, so one block's layers cannot differ from another's: choose layers "
                    "by their name within a block (fp8_exclude=['*.mlp.down_proj']), or compile the whole step "
                    "(regional=False)"
                )


def repeated_blocks(model):
    """The modules of ``model``'s largest ``nn.ModuleList`` (``regional=True`` compiles each), or
    ValueError saying why there are none."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"train_step(regional=True): {type(model).__name__} has no nn.ModuleList of blocks to compile one by one; "
            "compile the whole step (regional=False), or hold the model's repeated layers in an nn.ModuleList"
        )
    return list(max(lists, key=len))
