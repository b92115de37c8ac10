"""Which inputs of a Dynamo graph are parameters, gradients and optimizer states.

Dynamo hands a backend parameters and states as ``get_attr`` nodes or placeholders (it depends on
the torch version and on whether the step was traced inside a module call) and gradients as
placeholders, with names that change with ``foreach`` and with the version. Tensor identity does
not change: the backend matches each graph input against the tensors of the optimizers that
``flash_inductor.prepare`` registered.
"""

import dataclasses
import operator
import weakref

import torch
import torch.fx as fx

from flash_inductor import graph_utils

PARAM = "param"
GRAD = "grad"
STATE = "state"
HYPER = "hyperparameter"  # a tensor in a param group: lr, betas

# optimizer -> its PreparedOptimizer record; filled by flash_inductor.prepare.
PREPARED = weakref.WeakKeyDictionary()


def holder(param):
    """The PreparedOptimizer whose optimizer holds ``param``, or None."""
    for record in list(PREPARED.values()):  # a list: see _tensor_index
        optimizer = record.optimizer
        if optimizer is not None and any(p is param for g in optimizer.param_groups for p in g["params"]):
            return record
    return None


def error_term_of(param):
    """The error term of ``param`` in the prepared optimizer that holds it, or None."""
    for record in list(PREPARED.values()):
        error = record.error_terms.get(param)
        if error is not None:
            return error
    return None


@dataclasses.dataclass(frozen=True)
class Role:
    kind: str  # PARAM, GRAD or STATE
    param: torch.Tensor
    prepared: object  # the PreparedOptimizer the parameter belongs to
    state_key: str | None = None

    def describe(self):
        if self.kind == HYPER:
            return f"{HYPER}:{self.state_key}"
        name = self.prepared.param_names.get(self.param, "?")
        return f"{self.kind}:{name}" + (f"[{self.state_key}]" if self.state_key else "")

    def node_name(self, suffix):
        """A readable name for a node derived from this input: ``fc1_weight_exp_avg_fp32``."""
        if self.kind == HYPER:
            return graph_utils.python_name(f"{self.state_key}_{suffix}")
        parts = [self.prepared.param_names.get(self.param, "param")]
        parts += {PARAM: [], GRAD: ["grad"], STATE: [self.state_key]}[self.kind]
        return graph_utils.python_name("_".join(parts + [suffix]))


def graph_input_tensors(gm, example_inputs):
    """{node: tensor} for the placeholders and get_attr nodes of a Dynamo graph."""
    inputs = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor):
            inputs[node] = value
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, torch.Tensor):
                inputs[node] = value
    return inputs


def _tensor_index():
    index = {}
    # The list holds each optimizer strongly while we read it: a cyclic garbage collection in the
    # middle of the loop could otherwise free one whose record we are reading.
    for optimizer, prepared in list(PREPARED.items()):
        for group in optimizer.param_groups:
            for key, value in group.items():
                items = enumerate(value) if isinstance(value, (tuple, list)) else [(None, value)]
                for i, v in items:
                    if isinstance(v, torch.Tensor) and key != "params":
                        index[id(v)] = Role(HYPER, None, prepared, key if i is None else f"{key}[{i}]")
        for param in prepared.params():
            index[id(param)] = Role(PARAM, param, prepared)
            if param.grad is not None:
                index[id(param.grad)] = Role(GRAD, param, prepared)
            for key, value in prepared.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    index[id(value)] = Role(STATE, param, prepared, key)
    return index


def find_roles(gm, example_inputs):
    """{node name: Role} for every graph input that belongs to a prepared optimizer."""
    index = _tensor_index()
    roles = {}
    for node, tensor in graph_input_tensors(gm, example_inputs).items():
        role = index.get(id(tensor))
        if role is not None:
            roles[node.name] = role
    return roles


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


def mutated_inputs(graph: fx.Graph):
    """Names of graph inputs written in place (``x.mul_(...)``, ``x += 1``, foreach ops)."""
    inputs = {n for n in graph.nodes if n.op in ("placeholder", "get_attr")}
    written = set()
    for node in graph.nodes:
        if not is_in_place(node):
            continue
        first = node.args[0] if node.args else None
        targets = first if isinstance(first, (list, tuple)) else [first]
        written.update(t.name for t in targets if isinstance(t, fx.Node) and t in inputs)
    return written


def is_in_place(node: fx.Node):
    """Whether ``node`` writes its first argument in place (``x.mul_(...)``, ``x += 1``, foreach ops)."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.target in _INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("__"))
