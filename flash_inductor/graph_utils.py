"""Small FX helpers shared by the passes and the pipeline."""

import re

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

# Placeholders a pass adds carry the runtime tensor they stand for under this meta key; the
# backend appends those tensors to the arguments of the compiled graph (or, where the pass gave
# one under BOUND_LOOKUP, what ``lookup(args)`` returns for each call's arguments).
BOUND_INPUT = "flashoptim_bound_input"
BOUND_LOOKUP = "flashoptim_bound_lookup"


def copy_graph(graph: fx.Graph) -> tuple[fx.Graph, dict]:
    """A copy of ``graph`` (a pass's output, never its edited input) and {node of ``graph``: its copy}."""
    copy = fx.Graph()
    copies = {}
    copy.output(copy.graph_copy(graph, copies))
    return copy, copies


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of ``gm``'s graph, so a pass never edits its input.

    Dynamo's metadata travels with it (the module's ``meta`` and ``_param_name_to_source``, each
    placeholder's ``_dynamo_source``): from it AOTAutograd learns which inputs are static
    (parameters, optimizer states), which CUDA graphs need; without it every mutated input of a
    rewritten graph counted as non-static and Inductor skipped CUDA graphs.
    """
    graph, copies = copy_graph(gm.graph)
    copied = fx.GraphModule(gm, graph, gm.__class__.__name__)
    copied.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    for node, copy in copies.items():
        if hasattr(node, "_dynamo_source"):
            copy._dynamo_source = node._dynamo_source
    return copied


def rewrite_copy(gm: fx.GraphModule, names, rewrite) -> fx.GraphModule:
    """A copy of ``gm`` (``copy_graph_module``) in which ``rewrite(graph, node)`` has rewritten each node
    named in ``names``, in that order; linted and recompiled. The skeleton of most passes."""
    gm = copy_graph_module(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in names:
        rewrite(gm.graph, nodes[name])
    gm.graph.lint()
    gm.recompile()
    return gm


# The attribute in which ``remember_names`` keeps a parameter's or buffer's names on the tensor itself:
# a weak reference would make ``torch.utils.swap_tensors`` (FSDP2's ``fully_shard``) refuse it, and
# ``swap_tensors`` moves the attribute with the tensor's other Python state.
_MODEL_NAMES = "_flashoptim_model_names"


def remember_names(model: torch.nn.Module):
    """Record ``model``'s names of its parameters and buffers (every name of a tied one) for
    ``input_name``: after a graph break Dynamo compiles a submodule's forward as a frame of its own,
    whose inputs it names from that submodule (``fc.weight`` for the model's ``blocks.0.fc.weight``)."""
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names = tensor.__dict__.setdefault(_MODEL_NAMES, [])
        if name not in names:
            names.append(name)


def input_name(node: fx.Node):
    """The dotted name (``blocks.0.fc1.weight``) of a parameter or buffer input, read off Dynamo's
    source for it (``L['self']._modules['blocks']._modules['0']._parameters['weight']``); the
    node's name when it has none.

    The name is relative to the object the step reaches first: an argument, a global, or a
    closure's captured variable (``fn.__closure__[0].cell_contents``, a train step's ``model``),
    so it is the name ``model.named_parameters()`` gives and ``fp8_exclude`` patterns match. A
    compiled module's ``_orig_mod`` is skipped the same way. Where that object is a submodule (a
    frame after a graph break) of a model ``remember_names`` recorded, the model's name that ends
    with it is given instead."""
    return name_in_model(source_name(node), _example(node))


def name_in_model(name, tensor):
    """The name ``remember_names`` recorded for ``tensor`` that is ``name`` or ends with it (one
    named within a submodule), else ``name``."""
    known = getattr(tensor, _MODEL_NAMES, ()) if isinstance(tensor, torch.Tensor) else ()
    if name in known:
        return name
    longer = [k for k in known if k.endswith("." + name)]
    return longer[0] if len(longer) == 1 else name


def _example(node: fx.Node):
    """The tensor Dynamo compiled input ``node`` for, or None once it is gone."""
    try:
        return getattr(node.meta.get("grapharg"), "example", None)
    except AssertionError:  # Dynamo holds it by a weak reference
        return None


def source_name(node: fx.Node):
    """``input_name`` as Dynamo's source gives it, relative to the frame's first object."""
    containers = ("_modules", "_parameters", "_buffers")
    source = getattr(node.meta.get("grapharg"), "source", None)
    parts = []
    while source is not None:
        base = getattr(source, "base", None)
        member = getattr(source, "member", None)
        if member == "cell_contents":
            break  # the closure's variable is the root; what is above it is the function
        if hasattr(source, "index") and getattr(base, "member", None) in containers:
            parts.append(str(source.index))  # module._modules['fc1'] and the like
        elif member not in (None, "_orig_mod", *containers):
            parts.append(str(member))  # plain attribute access: module.fc1
        source = base
    return ".".join(reversed(parts)) if parts else node.name


def is_buffer_input(node: fx.Node):
    """Whether ``node`` is a module's buffer as Dynamo lifted it (its source reads ``_buffers``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    while source is not None:
        if getattr(getattr(source, "base", None), "member", None) == "_buffers":
            return True
        source = getattr(source, "base", None)
    return False


def python_name(text):
    """``text`` as a Python identifier (``fc1.weight`` -> ``fc1_weight``): placeholders become arguments."""
    name = re.sub(r"\W", "_", text)
    return f"_{name}" if name[0].isdigit() else name


def add_bound_placeholder(graph: fx.Graph, name, tensor, lookup=None):
    """Append a placeholder for ``tensor``, which the backend passes in at run time.

    With ``lookup``, each call passes ``lookup(args)`` instead (``args``: the graph's own
    arguments): for a tensor that belongs to an input, which Dynamo may hand in as another object
    on a later call (a parameter of another instance of the same module class).
    """
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name)
    # No user-code source; a static input (error terms, FP8 state: tensors that live as long as
    # their parameter), as AOTAutograd reads it off Dynamo's placeholder metadata.
    node._dynamo_source = None
    node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
    node.meta[BOUND_INPUT] = tensor
    if lookup is not None:
        node.meta[BOUND_LOOKUP] = lookup
    return node


def _bound_placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder" and BOUND_INPUT in n.meta]


def bound_inputs(gm: fx.GraphModule):
    """The compile-time tensors of placeholders added by passes, in placeholder order."""
    return [n.meta[BOUND_INPUT] for n in _bound_placeholders(gm)]


def bound_input_binder(gm: fx.GraphModule):
    """``args -> the tensors to append to args`` for the placeholders added by passes."""
    fixed = bound_inputs(gm)
    lookups = [(i, n.meta[BOUND_LOOKUP]) for i, n in enumerate(_bound_placeholders(gm)) if BOUND_LOOKUP in n.meta]
    if not lookups:
        return lambda args: fixed

    def bind(args):
        bound = list(fixed)
        for i, lookup in lookups:
            bound[i] = lookup(args)
        return bound

    return bind


def work_on_decoded_copy(graph: fx.Graph, node: fx.Node, decode, store, extra=(), name=None, view=None,
                         decode_kwargs=None):
    """Make every use of the stored input ``node`` use ``decode(node, *extra, **decode_kwargs)``
    instead, and write the result back once with ``store(node, *extra, decoded)`` (unless
    ``store`` is None: a read-only input). With ``view`` (a shape), ``node`` and ``extra`` are
    viewed as that shape before both calls.

    The decode goes right before the first use and the store right after the last one: inputs
    stay first, the decoded value lives no longer than needed, and both run under the grad mode
    of the code they replace (an optimizer step's ``no_grad`` region ends inside its graph).
    """
    position = _position(graph)
    first_use = min(node.users, key=position)
    with graph.inserting_before(first_use):
        inputs = [node, *extra]
        if view is not None:
            inputs = [graph.call_method("view", (x, *view)) for x in inputs]
        decoded = graph.create_node("call_function", decode, tuple(inputs), decode_kwargs or {}, name=name)
    keep = {decoded, *inputs}
    node.replace_all_uses_with(decoded, delete_user_cb=lambda user: user not in keep)
    if store is not None:
        last_use = max(_uses_through_views(decoded), key=_position(graph))
        where = graph.inserting_before(last_use) if last_use.op == "output" else graph.inserting_after(last_use)
        with where:
            graph.call_function(store, (*inputs, decoded))
    return decoded


def restore_where(graph: fx.Graph, node: fx.Node, keep: fx.Node, name=None):
    """Around every use of the written input ``node``: a copy of it before the first use, and after
    the last one ``node.copy_(torch.where(keep, node, before))``: where ``keep`` is False the
    writes are undone."""
    position = _position(graph)
    with graph.inserting_before(min(node.users, key=position)):
        before = graph.create_node("call_method", "clone", (node,), name=name)
    last_use = max(node.users, key=_position(graph))
    with graph.inserting_before(last_use) if last_use.op == "output" else graph.inserting_after(last_use):
        kept = graph.call_function(torch.where, (keep, node, before))
    with graph.inserting_after(kept):
        graph.call_method("copy_", (node, kept))


def view_as(graph: fx.Graph, node: fx.Node, shape, name=None):
    """Make every use of ``node`` use ``node.view(shape)`` (in-place updates still reach it)."""
    first_use = min(node.users, key=_position(graph))
    with graph.inserting_before(first_use):
        viewed = graph.create_node("call_method", "view", (node, *shape), name=name)
    node.replace_all_uses_with(viewed, delete_user_cb=lambda user: user is not viewed)
    return viewed


def _uses_through_views(node):
    """Users of ``node`` and of views of it (``view`` nodes alias their input)."""
    for user in node.users:
        if user.op == "call_method" and user.target == "view":
            yield from _uses_through_views(user)
        yield user


def _position(graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


class _FakeProp(fx.Interpreter):
    """Runs a Dynamo-level graph on fake copies of its real inputs."""

    def __init__(self, gm, mode, overwrite):
        super().__init__(gm)
        self.mode = mode
        self.overwrite = overwrite

    def placeholder(self, target, args, kwargs):
        if BOUND_INPUT in self.node.meta:
            return self._fake(self.node.meta[BOUND_INPUT], static_shapes=True)
        # Dynamo's fake mode gives back the fake it made of this input, with its symbolic sizes.
        return self._fake(next(self.args_iter))

    def get_attr(self, target, args, kwargs):
        # Not every attribute is a tensor: a higher-order op's body (an autograd.Function's
        # fwd_body, a checkpointed region) is a GraphModule.
        return self._fake(super().get_attr(target, args, kwargs), static_shapes=True)

    def _fake(self, value, static_shapes=None):
        """``static_shapes`` for tensors Dynamo did not see: a symbol without a source in its shape
        environment would break its guards."""
        return self.mode.from_tensor(value, static_shapes=static_shapes) if isinstance(value, torch.Tensor) else value

    def run_node(self, n):
        self.node = n
        with self.mode:
            value = super().run_node(n)
        if n.op != "output" and (self.overwrite or "example_value" not in n.meta):
            n.meta["example_value"] = value
        return value


def propagate_fake(gm: fx.GraphModule, example_inputs, overwrite=False):
    """Run ``gm`` on fake tensors: raises where a rewritten graph is inconsistent, and gives nodes
    without one (or all, with ``overwrite``) an ``example_value``: dtype and shape.

    In Dynamo's fake mode when the inputs come from it: a mode of its own would copy them with
    concrete sizes, and a reshape by a symbolic size then pins that symbol to the size compiled
    for (a dynamic sequence length recompiled for every length)."""
    mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode()
    # A graph may hold real tensors as constants (compiled autograd's do).
    allowed, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    try:
        _FakeProp(gm, mode, overwrite).run(*example_inputs)
    finally:
        mode.allow_non_fake_inputs = allowed


def readable_code(gm: fx.GraphModule, example_inputs):
    """``gm`` as Python annotated with each value's dtype, shape and device as it is after the
    passes (Dynamo's annotations of rewritten nodes are stale)."""
    annotated = copy_graph_module(gm)
    propagate_fake(annotated, example_inputs, overwrite=True)
    return annotated.print_readable(print_output=False, include_device=True)


def may_store(node: fx.Node) -> bool:
    """Whether ``stored_view`` may store ``node``: a value the graph computes (not an input), not read
    through ``as_strided`` already, and not a view: ``as_strided`` addresses its input's base from
    offset 0, so a view at an offset (a slice) would be read at the wrong elements."""
    return (node.op == "call_function" and node.target is not torch.ops.aten.as_strided.default
            and not node.meta["val"]._is_view())


def stored_view(graph: fx.Graph, src: fx.Node) -> fx.Node:
    """``as_strided(src, its size, its strides)``, right after ``src``: Inductor's ``as_strided`` lowering
    stores ``src`` (realizes it in place) and its readers read it through the view, which changes no
    value. In a graph compiled for dynamic shapes, a symbolic size or stride is read off ``src`` by a
    ``sym_size`` / ``sym_stride`` node."""
    val = src.meta["val"]
    with graph.inserting_before(src.next):  # in order, right after src
        size = _dims(graph, src, val.shape, torch.ops.aten.sym_size.int)
        stride = _dims(graph, src, val.stride(), torch.ops.aten.sym_stride.int)
        view = graph.create_node("call_function", torch.ops.aten.as_strided.default, (src, size, stride),
                                 name=f"{src.name}_stored")
    view.meta["val"] = val.as_strided(val.shape, val.stride())
    return view


def read_through_stored_view(graph: fx.Graph, src: fx.Node) -> fx.Node:
    """``stored_view(graph, src)``, which every reader of ``src`` then reads instead (all but the view
    and the ``sym_size`` / ``sym_stride`` nodes it reads its own size off ``src`` with)."""
    view = stored_view(graph, src)
    own = {view, *(d for d in (*view.args[1], *view.args[2]) if isinstance(d, fx.Node))}
    src.replace_all_uses_with(view, delete_user_cb=lambda user: user not in own)
    return view


def _dims(graph, src, values, read_dim):
    """``values`` (a size or strides of ``src``), each symbolic one as a node that reads it off ``src``."""
    dims = []
    for dim, value in enumerate(values):
        if not isinstance(value, int):
            node = graph.call_function(read_dim, (src, dim))
            node.meta["val"] = value
            value = node
        dims.append(value)
    return dims
