"""Runs the passes: torch-level on the Dynamo graph, aten-level inside Inductor.

A pass is a pure function ``(graph, ctx) -> (new graph, names of rewritten nodes)``: it returns
its input unchanged when its pattern is absent. A pass that raises, or whose output does not
type-check on fake tensors, is skipped with a warning naming it; the graph then compiles without
that rewrite, never with a half-done one.
"""

import dataclasses
import functools
import hashlib
import inspect
import pathlib
import pickle
import sys
import warnings
from typing import Callable

import torch.fx as fx
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass

from flash_inductor import graph_utils, roles

TORCH = "torch"
ATEN = "aten"


@dataclasses.dataclass(frozen=True)
class GraphPass:
    name: str
    level: str  # TORCH or ATEN
    fn: Callable
    # The stored format of prepared tensors needs this rewrite: a graph that reads or writes them
    # must not compile without it (the update would use the codes as values), so a failure raises.
    required_for_prepared: bool = False

    def source(self):
        """The pass function's source and that of its module."""
        return inspect.getsource(self.fn) + inspect.getsource(sys.modules[self.fn.__module__])


@dataclasses.dataclass
class PassContext:
    roles: dict  # input node name -> flash_inductor.roles.Role (torch level)
    written: set  # names of the inputs the captured graph writes in place
    options: object  # flash_inductor.options.Options
    recorder: object = None  # flash_inductor.inspection.GraphRecorder, when inspecting
    inputs: dict = dataclasses.field(default_factory=dict)  # input node name -> tensor (torch level)

    def updated_params(self):
        """The prepared parameters the graph writes in place: the ones its optimizer step updates."""
        return {role.param for role in written_param_roles(self.roles, self.written)}


def written_param_roles(graph_roles, written):
    """The roles of the prepared parameters a graph writes in place (``roles.mutated_inputs``'s names):
    an optimizer step's graph is one that has any."""
    return [role for name, role in graph_roles.items() if role.kind == roles.PARAM and name in written]


class PassFailed(Warning):
    pass


class RewriteFailed(RuntimeError):
    """A pass that prepared tensors' stored format needs could not rewrite a graph that uses them."""


def _skip(graph_pass, graph_name, error, recorder, first_decision):
    """Warn that ``graph_pass`` failed on the graph; in the inspection report, what it had decided
    there (from ``first_decision`` on) gives way to the failure."""
    reason = f"{type(error).__name__}: {error}"
    if recorder:
        recorder.pass_skipped(graph_pass.name, first_decision, reason)
    warnings.warn(
        f"flashoptim: pass '{graph_pass.name}' skipped on graph {graph_name}: {reason}. "
        "The graph compiles without this rewrite.",
        PassFailed,
        stacklevel=3,
    )


def _decision_count(recorder):
    return len(recorder.decisions) if recorder else 0


def run_torch_passes(gm: fx.GraphModule, example_inputs, passes, ctx, graph_name):
    """Apply the enabled torch-level passes in order; each result must type-check on fake tensors."""
    rewritten = {}
    if ctx.recorder:
        ctx.recorder.stage(TORCH, "captured", graph_utils.readable_code(gm, example_inputs))
    for graph_pass in passes:
        if not ctx.options.enabled(graph_pass.name):
            continue
        first_decision = _decision_count(ctx.recorder)
        try:
            new_gm, names = graph_pass.fn(gm, ctx)
            if new_gm is not gm:
                graph_utils.propagate_fake(new_gm, example_inputs)
        except Exception as error:  # noqa: BLE001 - any failure means: compile without this pass
            if graph_pass.required_for_prepared and ctx.roles:
                raise RewriteFailed(
                    f"flashoptim: pass '{graph_pass.name}' could not rewrite graph {graph_name}, which uses "
                    f"prepared parameters or optimizer states: {type(error).__name__}: {error}. Compiled without "
                    "it, the step would update their stored codes as if they were values. If a float "
                    "hyperparameter (weight decay, betas, momentum) changes between steps, compile under "
                    "torch._dynamo.config.patch(specialize_float=True) (a prepared optimizer's own step does) "
                    "or keep it fixed." + _written_parameters_hint(ctx)
                ) from error
            _skip(graph_pass, graph_name, error, ctx.recorder, first_decision)
            continue
        gm = new_gm
        if names:
            rewritten[graph_pass.name] = names
        if ctx.recorder:
            ctx.recorder.stage(TORCH, graph_pass.name, graph_utils.readable_code(gm, example_inputs), names)
    return gm, rewritten


def _written_parameters_hint(ctx):
    """What to do where the graph writes prepared parameters in place: a model that writes its own weights
    (a clamp or renorm in its forward) cannot, as the step alone stores them (bf16 + error term)."""
    names = sorted(role.prepared.param_names.get(role.param, "?") for role in written_param_roles(ctx.roles, ctx.written))
    if not names:
        return ""
    return (f" The graph writes the prepared parameters {names} in place. If that is the model's own write "
            "(a clamp or a renorm in its forward), make it outside the compiled function, or keep their modules "
            "fp32 (prepare's keep_fp32), whose parameters are stored as they are.")


def _assign_graph(dst: fx.Graph, src: fx.Graph):
    """Make ``dst`` (owned by Inductor) hold the nodes of ``src``."""
    for node in reversed(list(dst.nodes)):
        dst.erase_node(node)
    dst.output(dst.graph_copy(src, {}))


# Newer torch hands a post-grad pass of this class ``is_inference``; AtenPasses is one, to hand it on
# to a user's pass that needs it. torch 2.11 has no such passes.
_INFERENCE_AWARE = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)


class AtenPasses(_INFERENCE_AWARE or CustomGraphPass):
    """The aten-level passes as one Inductor post-grad custom pass, then the user's post-grad passes.

    torch 2.11 accepts one pass object per hook, so all sub-passes run from here, and so does the
    user's ``post_grad_custom_post_pass`` (Inductor's config or the option ``inductor``), after them:
    this object takes its place in the hook. ``uuid`` hashes the sources of the passes, of this
    package (the numerics they call), the user's passes' uuids and the options, so Inductor's FX
    graph cache never returns a graph compiled with other passes or options.
    """

    def __init__(self, passes, ctx, graph_name, user_passes=None):
        self.passes = [p for p in passes if ctx.options.enabled(p.name)]
        self.ctx = ctx
        self.graph_name = graph_name
        self.user_passes = _as_pass_tuple(user_passes)
        self.rewritten = {}

    def __call__(self, graph: fx.Graph, is_inference: bool = False) -> None:
        if self.ctx.recorder:
            self.ctx.recorder.stage(ATEN, "post_grad", _graph_code(graph))
        for graph_pass in self.passes:
            first_decision = _decision_count(self.ctx.recorder)
            try:
                new_graph, names = graph_pass.fn(graph, self.ctx)
                new_graph.lint()
            except Exception as error:  # noqa: BLE001
                _skip(graph_pass, self.graph_name, error, self.ctx.recorder, first_decision)
                continue
            if new_graph is not graph:
                _assign_graph(graph, new_graph)
            if names:
                self.rewritten.setdefault(graph_pass.name, []).extend(names)
            if self.ctx.recorder:
                self.ctx.recorder.stage(ATEN, graph_pass.name, _graph_code(graph), names)
        for user_pass in self.user_passes:
            if _INFERENCE_AWARE is not None and isinstance(user_pass, _INFERENCE_AWARE):
                user_pass(graph, is_inference=is_inference)
            else:
                user_pass(graph)

    def uuid(self):
        user_uuids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.user_passes]
        if not all(user_uuids):
            # Inductor bypasses the FX graph cache for a pass it cannot key (a plain callable, or a
            # uuid of None); None makes it bypass the cache for ours, which runs that pass.
            return None
        digest = hashlib.sha256(_package_source_digest())
        for graph_pass in self.passes:
            digest.update(graph_pass.name.encode())
            digest.update(graph_pass.source().encode())
        for user_uuid in user_uuids:
            digest.update(pickle.dumps(user_uuid))  # Inductor asks of a uuid only that it pickles
        digest.update(self.ctx.options.cache_key().encode())
        return digest.hexdigest()


def _as_pass_tuple(value):
    """A post-grad hook's value (None, one pass or, in newer torch, a list of them) as a tuple."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@functools.cache
def _package_source_digest():
    # The passes (flash_inductor.passes, imported by then: the backend runs them) may be installed
    # outside this package's folder (pyproject maps them from passes/).
    digest = hashlib.sha256()
    for folder in (pathlib.Path(__file__).parent, sys.modules["flash_inductor.passes"].__path__[0]):
        for path in sorted(pathlib.Path(folder).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.digest()


def _graph_code(graph: fx.Graph):
    return graph.python_code("self", verbose=True, include_device=True).src
