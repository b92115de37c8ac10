"""FP8 gradient collectives (option ``fp8_collectives``): sum/avg all-reduces move e4m3 bytes.

Before (the compiled-autograd graph of DDP under ``optimize_ddp="python_reducer"``, or a step that
calls ``torch.distributed._functional_collectives.all_reduce`` itself)::

    tensor = torch.ops._c10d_functional.all_reduce(gradient, 'sum', '0')
    gradient_1 = torch.ops._c10d_functional.wait_tensor(tensor)

    shard = torch.ops._c10d_functional.reduce_scatter_tensor(gradient, 'avg', 2, '0')
    shard_1 = torch.ops._c10d_functional.wait_tensor(shard)

After::

    gradient_1 = flash_inductor.formats.fp8_collective.all_reduce(gradient, fp8_collective_0, 'sum', '0', 2)
    shard_1 = flash_inductor.formats.fp8_collective.reduce_scatter(gradient, fp8_collective_1, 'avg', '0', 2)

``fp8_collective_0`` is a graph input the pass adds: the collective's ``[mu, scale]`` state, which
the call updates every step (``formats/fp8_collective.py`` has the numerics: amax all-reduced with
MAX, one scale on all ranks, all-to-all of e4m3 chunks summed in fp32, all-gather of the e4m3
sums, division by the world size after). Each rewritten collective keeps its own ``mu``, for as
long as its compiled graph lives (a recompile starts again from mu = 1/n). Live states are listed by
``states()``.

Rewritten: all-reduces and reduce-scatters (``reduce_scatter_tensor``, the sharded engines'
gradient collective; no mu there: its fp32 sum is never cast again) with op "sum" or "avg" of
fp32/bf16/fp16 tensors of at least one dimension over more than one rank, whose result is only
read through ``wait_tensor``. Every such collective in a compiled graph is taken for a gradient's;
scalars (losses, metrics) are left alone. Every candidate's decision is recorded for
inspection. The rewrite is at torch level because the state must be a graph input, which an
aten-level pass cannot add.
"""

import itertools
import weakref

import torch
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group

from flash_inductor import graph_utils
from flash_inductor.formats import fp8_collective

_C10D = torch.ops._c10d_functional
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# collective -> (its FP8 version, positions of (x, reduce_op, group_name) in its args, what travels)
_REWRITES = {
    _C10D.all_reduce: (fp8_collective.all_reduce, (0, 1, 2),
                       "e4m3 all-to-all + all-gather of uint8 bytes, summed locally in fp32"),
    _C10D.reduce_scatter_tensor: (fp8_collective.reduce_scatter, (0, 1, 3),
                                  "e4m3 all-to-all of uint8 bytes, summed locally in fp32"),
}

_ids = itertools.count()
_states = weakref.WeakValueDictionary()  # "<id>: <node>" -> [mu, scale] tensor of a compiled graph


def states():
    """The ``[mu, scale]`` state of every rewritten collective whose graph is alive, in creation order."""
    return {key: _states[key] for key in sorted(_states.keys(), key=lambda k: int(k.split(":")[0]))}


def _is(node, op):
    return node.op == "call_function" and node.target in (op, op.default)


def _collective(node):
    """The ``_REWRITES`` key of ``node``, or None."""
    return next((op for op in _REWRITES if _is(node, op)), None)


def _arguments(node, op):
    """``(x, reduce_op, group_name)`` of collective ``op``'s ``node``."""
    return tuple(node.args[i] for i in _REWRITES[op][1])


def _decide(node, op):
    """``(group size, None)`` when ``node`` is a rewritable collective ``op``, else ``(None, why not)``."""
    x, reduce_op, group_name = _arguments(node, op)
    if reduce_op not in ("sum", "avg"):
        return None, f"reduce op {reduce_op!r}"
    value = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    if value is None or value.dtype not in _FLOAT_DTYPES:
        return None, f"dtype {getattr(value, 'dtype', None)}"
    if value.dim() == 0:
        return None, "a scalar (a loss or metric, not a gradient)"
    if not node.users or not all(_is(user, _C10D.wait_tensor) for user in node.users):
        return None, "result is used without wait_tensor"
    size = _resolve_process_group(group_name).size()
    if size < 2:
        return None, "group of one rank"
    return size, None


def fp8_collectives_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    if not ctx.options.fp8_collectives:
        return gm, []
    eligible = []
    for node in gm.graph.nodes:
        op = _collective(node)
        if op is None:
            continue
        size, reason = _decide(node, op)
        if ctx.recorder:
            ctx.recorder.decision("fp8_collectives", node.name, _REWRITES[op][2] if reason is None else f"unchanged: {reason}")
        if reason is None:
            eligible.append((node.name, op, size))
    if not eligible:
        return gm, []
    gm = graph_utils.copy_graph_module(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, (name, op, size) in enumerate(eligible):
        node = nodes[name]
        x, reduce_op, group_name = _arguments(node, op)
        state = fp8_collective.new_state(size, device=x.meta["example_value"].device)
        _states[f"{next(_ids)}: {name}"] = state
        state_input = graph_utils.add_bound_placeholder(gm.graph, f"fp8_collective_{i}", state)
        with gm.graph.inserting_before(node):
            reduced = gm.graph.call_function(_REWRITES[op][0], (x, state_input, reduce_op, group_name, size))
        for wait in list(node.users):
            wait.replace_all_uses_with(reduced)
            gm.graph.erase_node(wait)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm, [name for name, _, _ in eligible]
