"""The ``flashoptim`` torch.compile backend.

    Dynamo graph ─ roles ─ torch-level passes ─ AOTAutograd + Inductor (aten-level passes) ─ code

Found by name through the ``torch_dynamo_backends`` entry point, so
``torch.compile(fn, backend="flashoptim", options={...})`` works without importing this package.
"""

import dataclasses
import functools
import itertools
import warnings

import torch
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

from flash_inductor import _compat, fp8_all_gather, fp8_delayed, graph_utils, inspection, memory, passes, roles, sharded
from flash_inductor.fp8_linear import refused_by_user
from flash_inductor.options import Options
from flash_inductor.pipeline import AtenPasses, PassContext, run_torch_passes, written_param_roles

_graph_ids = itertools.count()


def flashoptim_backend(gm, example_inputs, *, options=None, mode=None):
    """Dynamo backend entry point. ``options`` come from ``torch.compile(..., options=...)``;
    ``mode="reduce-overhead"`` (torch.compile takes a mode or options, not both) is
    ``options={"cudagraphs": True}``."""
    if mode == "reduce-overhead":
        options = {"cudagraphs": True}
    elif mode not in (None, "default"):
        raise ValueError(
            f"flashoptim: mode={mode!r} is not supported; use mode='reduce-overhead' (CUDA graphs) or pass Inductor "
            "settings as options={'inductor': {...}}"
        )
    return compile_graph(gm, example_inputs, Options.from_dict(options))


def compile(fn=None, **options):
    """``torch.compile(fn, backend="flashoptim", options=options)`` as a function (or decorator).

    With ``fp8="delayed"`` or ``fp8_all_gather=True``, a module ``fn`` is first prepared for them
    (``prepare_fp8``).
    """
    parsed = Options.from_dict(options)  # fail early on bad options
    if isinstance(fn, torch.nn.Module):
        graph_utils.remember_names(fn)
        if parsed.fp8_state_per_layer:
            prepare_fp8(fn, **options)
    if fn is None:
        return functools.partial(compile, **options)
    return torch.compile(fn, backend=flashoptim_backend, options=options or None)


def prepare_fp8(model: torch.nn.Module, **options):
    """Set up, in place, what the backend's FP8 ``options`` need on ``model``; returns ``model``.

    - ``fp8="delayed"`` (implied without ``fp8`` and ``fp8_all_gather``): every ``nn.Linear`` that
      runs in FP8 under ``options`` gets its delayed-scaling buffers (flash_inductor/fp8_delayed.py).
    - ``fp8_all_gather=True`` (``fp8="tensorwise"`` implied): every such layer's FSDP2-sharded weight
      is all-gathered in e4m3 (flash_inductor/fp8_all_gather.py); call it after ``fully_shard`` and
      before the first forward.

    ``compile(model, ...)`` and ``train_step`` call it for these options.
    """
    opts = Options.from_dict({"fp8": "tensorwise" if options.get("fp8_all_gather") else "delayed", **options})
    if opts.fp8_all_gather:
        sharded.check_fsdp_not_started(model, "prepare_fp8(model, fp8_all_gather=True, ...)")
        return fp8_all_gather.add(model, opts)
    if opts.fp8 != "delayed":
        raise ValueError(f"prepare_fp8 prepares fp8='delayed' or fp8_all_gather=True; got fp8={opts.fp8!r}")
    return fp8_delayed.add_state(model, opts)


# Set on a step whose model's blocks are compiled rather than the step itself (train_step's
# regional=True): the list of those blocks.
COMPILED_BLOCKS = "_flashoptim_compiled_blocks"


def inspect(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once through the backend and return an ``inspection.Report``.

    ``fn`` may be a plain function (compiled here with ``backend="flashoptim"``) or one already
    compiled with it (its options are kept), such as a ``train_step``; one made with
    ``regional=True`` runs as it is, its blocks' graphs being what it compiles. Dynamo's caches are
    reset first, so every graph is captured and every pass really runs: other compiled functions
    recompile on their next call.
    """
    report = inspection.Report()
    compiled = hasattr(fn, "_torchdynamo_orig_callable") or hasattr(fn, COMPILED_BLOCKS)
    target = fn if compiled else compile(fn)
    torch._dynamo.reset()
    with inspection.collecting(report):
        target(*args, **kwargs)
    # The user's optimizers, not the optimizers their steps run (buckets, local shards, gradient release).
    report.memory = [memory.memory_report(None, opt) for opt, record in list(roles.PREPARED.items())
                     if not record.internal]
    return report


@dataclasses.dataclass
class Rewritten:
    graph_module: torch.fx.GraphModule
    is_step: bool  # an optimizer step's graph (it writes parameters), else a model's
    bound_inputs: list  # tensors the passes added as placeholders, appended at run time
    rewritten: dict  # pass name -> rewritten node names
    context: PassContext
    name: str


def rewrite(gm, example_inputs, options: Options) -> Rewritten:
    """Roles, then the torch-level passes on a Dynamo graph."""
    graph_roles = roles.find_roles(gm, example_inputs)
    written = roles.mutated_inputs(gm.graph)
    # An optimizer step's graph writes prepared parameters in place: the record's label, no FP8 choices
    # check, no pattern matcher and no CUDA graphs in _inductor.
    is_step = bool(written_param_roles(graph_roles, written))
    name = f"graph_{next(_graph_ids)}"
    record = inspection.new_graph_record(name, "optimizer step" if is_step else "model", graph_roles, options)
    inputs = {node.name: tensor for node, tensor in roles.graph_input_tensors(gm, example_inputs).items()}
    ctx = PassContext(graph_roles, written, options, record, inputs)
    with inspection.timing(record, "passes"):
        new_gm, rewritten = run_torch_passes(gm, example_inputs, passes.TORCH_PASSES, ctx, name)
    return Rewritten(new_gm, is_step, graph_utils.bound_inputs(new_gm), rewritten, ctx, name)


def compile_graph(gm, example_inputs, options: Options):
    result = rewrite(gm, example_inputs, options)
    check_choices = None if result.is_step else _fp8_choices_check(gm, example_inputs, options)
    if options.compiler == "eager":
        compiled = result.graph_module.forward
    else:
        compiled = _inductor(result, list(example_inputs) + _static_fakes(result.bound_inputs, example_inputs),
                             passes.ATEN_PASSES)
    if result.bound_inputs:
        bind = graph_utils.bound_input_binder(result.graph_module)
        compiled = functools.partial(_run_with_bound_inputs, compiled, bind)
    if check_choices is not None:
        compiled = functools.partial(_run_checked, compiled, check_choices)
    return compiled


def _run_with_bound_inputs(compiled, bind, *args):
    return compiled(*args, *bind(args))


def _run_checked(compiled, check, *args):
    check(args)
    return compiled(*args)


def _fp8_choices_check(gm, example_inputs, options):
    """With ``fp8_exclude`` or ``fp8_filter``: a check of each call's arguments, else None.

    Dynamo may run one graph for several modules: a submodule's forward, compiled as a frame of its
    own after a graph break, serves every instance, their parameters coming as its inputs. The FP8
    pass decided for the modules it was compiled for; the check raises ValueError where the user's
    patterns choose otherwise for the modules of a call's matrices (2-D parameters)."""
    if options.fp8 is None or not (options.fp8_exclude or options.fp8_filter):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    watched = []  # (argument index, name within its frame, name compiled for, in FP8 by the patterns)
    for i, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(example, torch.nn.Parameter) and example.dim() == 2:
            frame_name = graph_utils.source_name(node)
            name = graph_utils.name_in_model(frame_name, example)  # input_name's, from the example at hand
            watched.append((i, frame_name, name, _in_fp8_by_user(name, options)))
    if not watched:
        return None
    checked = set()  # ids of tensors found to be chosen alike

    def check(args):
        for i, frame_name, compiled_for, in_fp8 in watched:
            tensor = args[i]
            if id(tensor) in checked:
                continue
            name = graph_utils.name_in_model(frame_name, tensor)
            if _in_fp8_by_user(name, options) != in_fp8:
                fp8, other = (compiled_for, name) if in_fp8 else (name, compiled_for)
                raise ValueError(
                    f"fp8_exclude / fp8_filter keep {fp8} in FP8 but not {other}, and one compiled graph runs both: "
                    "Dynamo compiled their module's forward once (a frame of its own, after a graph break) for every "
                    "instance. Choose both alike (a pattern that matches both, or neither), or remove the graph break"
                )
            checked.add(id(tensor))

    return check


def _in_fp8_by_user(weight_name, options):
    """Whether ``fp8_exclude`` and ``fp8_filter`` leave the module of ``weight_name`` to FP8."""
    return refused_by_user(weight_name.rpartition(".")[0], options) is None


def _static_fakes(tensors, example_inputs):
    """The added inputs as fake tensors of Dynamo's fake mode with static shapes. Handed over as
    real tensors, AOTAutograd would give them symbolic sizes that no guard source backs (Dynamo
    then fails to build the frame's guards)."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        return list(tensors)
    return [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]


def _inductor(result: Rewritten, example_inputs, aten_passes):
    ctx, record = result.context, result.context.recorder
    patches = {}
    if result.rewritten:
        # Inductor's default division stays (approximate in Triton, as for a stock torch.compile):
        # FP8 scales are computed without an fp32 division (formats/fp8.py), so they follow the spec.
        patches.update(_compat.inductor_patches_for_rewritten_graphs())
    if result.is_step:
        # Inductor's pattern matcher looks for matmul/attention patterns an optimizer step has none
        # of; off, a 16-tensor step compiled 12% faster on the CPU, to the same bits.
        patches["pattern_matcher"] = False
    if ctx.options.cudagraphs and not result.is_step and not any(r.kind == roles.GRAD for r in ctx.roles.values()):
        patches["triton.cudagraphs"] = True
    patches.update(_compat.cpp_patches(example_inputs))
    patches.update(ctx.options.inductor)
    if result.rewritten:
        # Required, not a default: the passes' numerics round to bf16/fp16 inside fused kernels,
        # and Inductor would otherwise keep the fp32 value there (DESIGN.md §3, pitfall).
        patches["emulate_precision_casts"] = True
    # Ours takes the hook: the user's pass (option ``inductor`` or Inductor's config) runs after ours.
    user_post_grad = patches.get("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass)
    # Inductor keeps the pass (in its config and cache key) as long as the compiled graph: without
    # the graph inputs' tensors, or it would keep the first call's gradients alive.
    post_grad = AtenPasses(aten_passes, dataclasses.replace(ctx, inputs={}), result.name, user_post_grad)
    if post_grad.passes or result.rewritten or record is not None:
        # Its uuid keys Inductor's FX graph cache by this package's sources, so a graph our passes
        # rewrote is never taken from a cache entry that other numerics or an Inductor workaround
        # of ours (_compat) compiled. When inspecting, it records the post-grad graphs.
        patches["post_grad_custom_post_pass"] = post_grad
    if record is not None:
        patches.update(inspection.uncached_config())

    def inner_compile(aot_gm, aot_inputs, **kwargs):
        # Per subgraph, not around compile_fx: AOTAutograd lowers a backward at its first call.
        subgraph = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        with warnings.catch_warnings(), _compat.cpp_codegen_workarounds(), inspection.compiling_subgraph(record, subgraph):
            # Inductor's C++ backend notes every kernel that mixes bf16 weights with fp16 scales.
            warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")
            return _compat.compile_without_cpp_vectorizer_on_its_known_error(
                lambda gm: compile_fx_inner(gm, aot_inputs, **kwargs), aot_gm, aot_inputs)

    # The partitioner runs here, at the forward's compile (the backward's kernels come at its first call).
    partitioner = {"ban_recompute_materialized_backward": False} if ctx.options.recompute_elementwise else {}
    with torch._functorch.config.patch(partitioner):
        return compile_fx(result.graph_module, example_inputs, inner_compile=inner_compile,
                          config_patches=patches or None)
