"""FP8 linear: eligible linear layers of the forward graph run as FP8 GEMMs (option ``fp8``).

Before (Dynamo graph of a model with an ``nn.Linear(4096, 4096)`` named ``fc1``, and a Hugging Face
``Conv1D`` named ``c_attn`` whose weight is stored (in, out))::

    linear = torch._C._nn.linear(x, fc1_weight, fc1_bias)
    matmul = x @ head_weight.T                      # also: F.linear, x @ w.t()
    conv1d = torch.addmm(c_attn_bias, x2, c_attn_weight)   # also: x @ w, matmul(x, w), mm(x, w),
                                                    # einsum("...k,kn->...n", x, w) (or "...k,nk->...n")
    attn = torch.nn.functional.multi_head_attention_forward(x3, x3, x3, 64, 4, attn_in_proj_weight, ...,
        attn_out_proj_weight, ...)                  # an nn.MultiheadAttention: one node, its weights operands
    norm = torch._weight_norm(fc2_parametrizations_weight_original1, fc2_parametrizations_weight_original0, 0)
    linear_1 = torch._C._nn.linear(x4, norm, fc2_bias)   # a weight computed from parameters: weight_norm's
    heads = torch.functional.einsum('ibh,hnd->ibnd', x5, q)  # a parameter of rank 3 (XLNet's (64, 4, 16));
                                                    # also 'ibnd,hnd->ibh' (x5 flattened, q not transposed)

After::

    linear = flash_inductor.fp8_linear.fp8_linear(x, fc1_weight, fc1_bias)
    matmul = flash_inductor.fp8_linear.fp8_linear(x, head_weight, None)
    t = c_attn_weight.t()
    conv1d = flash_inductor.fp8_linear.fp8_linear(x2, t, c_attn_bias)
    attn = flash_inductor.multi_head_attention.fp8_multi_head_attention_forward(x3, x3, x3, 64, 4, ...,
        fp8_weights=("in_proj_weight", "out_proj_weight"), fp8_options={"power_of_two": False})
    norm = torch._weight_norm(fc2_parametrizations_weight_original1, fc2_parametrizations_weight_original0, 0)
    linear_1 = flash_inductor.fp8_linear.fp8_linear(x4, norm, fc2_bias)
    reshape = q.reshape(64, 64);  t_1 = reshape.t()
    fp8_linear = flash_inductor.fp8_linear.fp8_linear(x5, t_1, None)
    heads = fp8_linear.unflatten(-1, (4, 16))

``fp8_linear`` is an autograd function of plain ops (e4m3 forward, e5m2 gradients, per-tensor
scaling: ``flash_inductor/fp8_linear.py``); AOTAutograd traces its backward and Inductor fuses the
amax and cast ops into their neighbours. With ``fp8="rowwise"`` each call takes ``rowwise=True``
(every operand e4m3, one scale per row).

With ``fp8="delayed"`` the layer's delayed-scaling buffers (``flash_inductor/fp8_delayed.py``)
become inputs of the graph, bound once per weight::

    fc1_weight_fp8_amax_history = placeholder        # f32[2, 16], looked up from fc1_weight at run time
    ...                                              # _scale, _grad_amax_history, _grad_scale
    linear = flash_inductor.fp8_linear.fp8_linear(x, fc1_weight, fc1_bias, power_of_two=False,
        amax_history=fc1_weight_fp8_amax_history, scale=fc1_weight_fp8_scale,
        grad_amax_history=fc1_weight_fp8_grad_amax_history, grad_scale=fc1_weight_fp8_grad_scale)

An einsum with a parameter of rank 3 or more is first written as the linear it is, where it is one
(``_einsums_as_linears``): its weight the parameter reshaped to 2-D, a weight computed from a parameter.

A linear is eligible when its weight is a graph input (a parameter) or, for ``F.linear`` and ``x @ w.T``,
computed from module state alone (parameters, buffers, constants: a parametrization such as
``weight_norm``, ``spectral_norm`` or a LoRA merge, a cast or slice of a parameter; decided and
reported under the parametrized attribute's name, ``fc2.weight``, or its first parameter's, with
current scaling only, delayed scaling's state being a parameter's; not when it is upcast, wider
than its parameters: the model asks for that precision), both weight dims are
multiples of 16 (``_scaled_mm``'s requirement) or zero padding to them adds at most 1% (an lm_head
of 50257 rows; ``fp8_linear.padded_shape``), the weight has at least ``fp8_min_weight_numel``
elements and its forward GEMM (tokens x in x out, the input's shape as compiled) at least
``fp8_min_gemm_size`` on CUDA (smaller GEMMs do not pay for the casts), and its module name passes ``fp8_exclude``
(fnmatch patterns, e.g. the first and last layers) and ``fp8_filter`` (a callable on the module
name, like torchao's ``module_filter_fn``); with ``fp8="delayed"`` it must also have delayed-scaling
state (else it stays bf16, with a warning that says how to add it). The output layer stays bf16
unless ``fp8_output_layer``: a linear whose output reaches a loss (``cross_entropy``, ``nll_loss``,
``log_softmax``) through views, casts and scalings only, or whose weight is also an embedding's
table (a head tied to the input embedding, whose loss may be in another graph). Every linear's
decision is recorded for inspection. Option ``fp8_fast_accum`` adds ``fast_accum=True`` (the forward GEMM in
the tensor cores' fast accumulation mode), ``fp8_e4m3_gradients`` adds ``e4m3_gradients=True`` (the
output gradient cast to e4m3 instead of e5m2), ``fp8_tensorwise_weight_gradient`` adds
``tensorwise_weight_gradient=True`` (row-wise scaling's weight gradient with one scale per operand).

A linear inside an activation-checkpointed region (``torch.utils.checkpoint``, which Dynamo captures
as a ``tag_activation_checkpoint`` whose body takes the region's weights as operands) is rewritten
in the body the same way, decided on the parameter the operand is; a copy of the body replaces it,
so the input graph is left as it was::

    tag_activation_checkpoint = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_0, x, fc1_weight)
    class wrap_body_0:
        def forward(self, x, fc1_weight):
            fp8_linear = flash_inductor.fp8_linear.fp8_linear(x, fc1_weight, None)   # was linear(x, fc1_weight)

Only current scaling runs there (delayed scaling's and ``fp8_all_gather``'s per-layer state would
have to enter the region as operands of its own); such linears stay bf16 with that reason.
An ``nn.MultiheadAttention`` (torch's ``nn.Transformer`` layers, OpenCLIP) reaches the graph as one
call of ``F.multi_head_attention_forward``; each of its projection weights is decided as a linear's,
and the call becomes ``fp8_multi_head_attention_forward`` (``flash_inductor/multi_head_attention.py``,
the same function written with ``fp8_linear`` for the weights decided FP8). Layers with
``add_bias_kv`` or ``add_zero_attn``, and delayed scaling or ``fp8_all_gather``, stay with torch's
function, their weights reported in bf16 with the reason.

Every other matmul on a parameter (a slice of a 3-D expert weight, a parameter as the left or
batched operand, ``torch._grouped_mm`` of a mixture of experts), in the graph or a region's body,
is reported in bf16 with its reason, and so is every convolution with a parameter (a vision or
audio model's).

Under FSDP2 with ``fp8_all_gather`` an eligible weight arrives already in e4m3 (an ``Fp8Weight``,
``flash_inductor/fp8_all_gather.py``); the rewrite is the same, and ``fp8_linear`` uses its e4m3 data
and scale instead of casting it. The decision says so ("weight all-gathered in e4m3").
"""

import functools
import math
import operator
import re

import torch
import torch.fx as fx

from flash_inductor import fp8_delayed, graph_utils, multi_head_attention
from flash_inductor.formats.fp8_weight import Fp8Weight
from flash_inductor.fp8_linear import fp8_linear, ineligible_reason, padded_shape

from .fp32_losses import is_classification_loss

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint  # torch.utils.checkpoint's region, as Dynamo captures it
OUT_IN = "out_in"  # weight stored (out, in), as nn.Linear's: y = x @ w.T
IN_OUT = "in_out"  # weight stored (in, out), as Hugging Face's Conv1D: y = x @ w


def is_transpose(node):
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"))
        or (node.op == "call_method" and node.target == "t")
        or (node.op == "call_function" and node.target is torch.t)
    )


def out_in_weight(graph, weight, layout):
    """``weight`` as ``(out, in)``, the layout ``F.linear`` takes: itself, or for an ``IN_OUT`` weight a
    transpose added to ``graph`` at its insertion point (a view: its gradient flows back)."""
    return weight if layout == OUT_IN else graph.call_method("t", (weight,))


def as_linear(node):
    """``(x, weight, bias, layout)`` if ``node`` multiplies by a 2-D right operand, else None:
    ``F.linear``, ``x @ w.T`` / ``matmul(x, w.t())`` (``OUT_IN``), and ``x @ w``, ``matmul``,
    ``mm``, ``addmm(b, x, w)`` with default alpha and beta (``IN_OUT``), and einsums of either.
    Whether the operand is a parameter is ``_decide``'s question."""
    if node.op != "call_function":
        return None
    if node.target in (torch._C._nn.linear, torch.nn.functional.linear):
        args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
        return args[0], args[1], args[2], OUT_IN
    if node.target in (operator.matmul, torch.matmul, torch.mm) and len(node.args) == 2 and not node.kwargs:
        x, rhs = node.args
        if is_transpose(rhs):
            return x, rhs.args[0], None, OUT_IN
        if isinstance(rhs, fx.Node) and rhs.op in ("placeholder", "get_attr"):
            return x, rhs, None, IN_OUT
    if node.target is torch.addmm and len(node.args) == 3 and not node.kwargs:
        bias, x, rhs = node.args
        if isinstance(rhs, fx.Node) and rhs.op in ("placeholder", "get_attr"):
            return x, rhs, bias, IN_OUT
    return _einsum_as_linear(node)


def _two_operand_einsum(node):
    """``(x's letters, w's letters, the output's, x, w)`` of an ``einsum(equation, x, w)`` call, else None."""
    if node.op != "call_function" or node.target not in (torch.einsum, torch.functional.einsum) or node.kwargs:
        return None
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or equation.count("->") != 1 or len(operands) != 2:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    if inputs.count(",") != 1:
        return None
    return (*inputs.split(","), out, *operands)


def _einsum_as_linear(node):
    """An einsum that is ``x @ w`` (``"bsk,kn->bsn"``, ``"...k,kn->...n"``) or ``x @ w.T``
    (``"...k,nk->...n"``) with ``w`` a graph input: ``(x, w, None, layout)``, else None."""
    einsum = _two_operand_einsum(node)
    if einsum is None:
        return None
    a, b, out, x, rhs = einsum
    if len(b) != 2 or not a or a[-1] not in b or not _is_input(rhs):
        return None
    k = a[-1]
    n = b[1] if b[0] == k else b[0]
    if k == n or k in a[:-1] or n in a or out != a[:-1] + n:
        return None
    return x, rhs, None, IN_OUT if b[0] == k else OUT_IN


def _einsum_product_with_parameter(node, ctx):
    """An einsum that is a linear on a parameter ``w`` of rank 3 or more: ``w``'s contracted dims (K)
    end ``x``'s, in ``w``'s order, and its other dims (N) end the output, after ``x``'s other dims;
    ``w`` is K then N (``"ibh,hnd->ibnd"``: ``x @ w.reshape(h, n*d)``) or N then K (``"ibnd,hnd->ibh"``:
    ``x @ w.reshape(h, n*d).T``). Returns ``(x, w, len(K), K first)``, else None."""
    einsum = _two_operand_einsum(node)
    if einsum is None:
        return None
    a, b, out, x, w = einsum
    if (not (_is_input(w) and isinstance(ctx.inputs.get(w.name), torch.nn.Parameter)) or len(b) < 3
            or isinstance(w.meta.get("example_value"), Fp8Weight)):  # FSDP2's e4m3-gathered weights stay 2-D
        return None
    k = "".join(c for c in b if c in a)
    n = "".join(c for c in b if c not in a)
    prefix = a[:-len(k)] if k else a
    if (not k or not n or not b.isalpha() or len(set(b)) != len(b) or b not in (k + n, n + k) or not a.endswith(k)
            or any(c in prefix for c in b) or out != prefix + n):
        return None
    return x, w, len(k), b == k + n


def _einsums_as_linears(gm, ctx):
    """``gm`` with each einsum of ``_einsum_product_with_parameter`` written as the linear it is, so
    that the pass decides and rewrites it as any other (its weight a reshape of the parameter)::

        einsum: "bf16[8, 2, 4, 16]" = torch.functional.einsum('ibh,hnd->ibnd', x, q)   # q: (64, 4, 16)

    becomes::

        reshape = q.reshape(64, 64);  t = reshape.t()
        linear = torch.nn.functional.linear(x, t)
        unflatten = linear.unflatten(-1, (4, 16))

    (``x.flatten(-2)`` first where two dims are contracted, ``"ibnd,hnd->ibh"``.) ``gm`` itself when
    there is none; a copy otherwise. Not in activation-checkpointed regions' bodies: there such an
    einsum is reported and stays."""
    found = [n.name for n in gm.graph.nodes if _einsum_product_with_parameter(n, ctx)]
    if not found:
        return gm

    def rewrite(graph, node):
        x, w, contracted, contracted_first = _einsum_product_with_parameter(node, ctx)
        shape = tuple(w.meta["example_value"].shape)
        k_dims, n_dims = (shape[:contracted], shape[contracted:]) if contracted_first else (
            shape[-contracted:], shape[:-contracted])

        def add(method, *args):
            new = graph.call_method(method, args)
            new.meta.update(stack_trace=node.meta.get("stack_trace"),
                            example_value=getattr(args[0].meta["example_value"], method)(*args[1:]))
            return new

        with graph.inserting_before(node):
            flat_x = add("flatten", x, -contracted) if contracted > 1 else x
            if contracted_first:
                weight = add("t", add("reshape", w, math.prod(k_dims), math.prod(n_dims)))
            else:
                weight = add("reshape", w, math.prod(n_dims), math.prod(k_dims))
            out = graph.call_function(torch.nn.functional.linear, (flat_x, weight))
            out.meta.update(stack_trace=node.meta.get("stack_trace"), example_value=torch.nn.functional.linear(
                flat_x.meta["example_value"], weight.meta["example_value"]))
            if len(n_dims) > 1:
                out = add("unflatten", out, -1, n_dims)
        node.replace_all_uses_with(out)
        graph.erase_node(node)

    return graph_utils.rewrite_copy(gm, found, rewrite)


# Matmuls that are not linears (as_linear) yet may take a parameter: each is reported, kept in bf16.
MATMULS = {torch.bmm: "batched matmul", torch.baddbmm: "batched matmul", torch.matmul: "matmul", operator.matmul: "matmul",
           torch.mm: "matmul", torch.addmm: "matmul", torch.einsum: "einsum", torch.functional.einsum: "einsum",
           torch._C._nn.linear: "linear", torch.nn.functional.linear: "linear"}
# Products with a parameter that are not GEMMs FP8 can take, whatever the operands' layout: the reason in full.
UNSUPPORTED = {torch._grouped_mm: "grouped matmul (a mixture of experts' weights): FP8 grouped GEMMs are not supported",
               torch.bilinear: "bilinear (x1 W x2): no FP8 GEMM takes it",
               # nn.TransformerEncoderLayer and nn.MultiheadAttention without autograd (eval, no_grad)
               torch._transformer_encoder_layer_fwd: "nn.TransformerEncoderLayer's inference fast path: torch's fused op",
               torch._native_multi_head_attention: "nn.MultiheadAttention's inference fast path: torch's fused op",
               **{conv: "convolution: torch has no FP8 convolution" for conv in (
                   torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
                   torch.conv_transpose3d)}}
# Ops through which an operand is still the parameter's values (a view, a slice, a copy in another dtype).
_SAME_VALUES = {"t", "transpose", "permute", "view", "reshape", "flatten", "contiguous", "clone", "to", "float", "bfloat16",
                "__getitem__", "select", "narrow", "expand", "unsqueeze", "squeeze"}


def _op_name(node):
    """A method's name, or a function's (``torch.tanh`` and ``x.tanh()`` are both ``"tanh"``)."""
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", None)


def _keeps_values(node):
    """Whether ``node`` is a view, slice or cast of its first argument (``_SAME_VALUES``)."""
    return _op_name(node) in _SAME_VALUES or node.target is operator.getitem


def parameter_behind(node, ctx, operands):
    """The parameter input whose values ``node`` is (itself, or a view, slice or cast of it), else
    None; ``operands`` maps a region body's inputs to the region's operands (``_regions``)."""
    while isinstance(node, fx.Node):
        if node in operands:
            node = operands[node]
            continue
        if node.op in ("placeholder", "get_attr"):
            return node if isinstance(ctx.inputs.get(node.name), torch.nn.Parameter) else None
        if not (_keeps_values(node) or is_transpose(node)):
            return None
        node = node.args[0] if node.args else None
    return None


def _unsupported_matmuls(gm, ctx, decided):
    """``(name, reason)`` for each matmul of ``gm`` and of its regions' bodies with a parameter
    operand that is not among the linears already ``decided``: why it stays bf16."""
    for _, module, region_operands in _regions(gm):
        for node in module.graph.nodes:
            yield from _unsupported_matmul(node, ctx, decided, region_operands)


def _unsupported_matmul(node, ctx, decided, region_operands):
    if node.op != "call_function" or node in decided or (node.target not in MATMULS and node.target not in UNSUPPORTED):
        return
    for operand in [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]:
        param = parameter_behind(operand, ctx, region_operands)
        if param is None:
            continue
        shape = tuple(param.meta["example_value"].shape) if "example_value" in param.meta else "?"
        detail = UNSUPPORTED.get(node.target) or (
            f"{MATMULS[node.target]} with the parameter (shape {shape}) or a view or slice of it as an operand, not as "
            "a linear's 2-D weight")
        yield graph_utils.input_name(param), detail
        return


# Elementwise ops with no other tensor operand that logits pass through (Gemma 2's soft-capping:
# tanh(logits / cap) * cap).
_SCALED = {"truediv", "div", "mul", "tanh"}


def feeds_loss(node):
    """Whether ``node``'s value reaches a loss over classes (``is_classification_loss``) through views,
    slices, casts and scalings only: where a language model's logits end, so ``node`` is the output layer."""
    for user in node.users:
        if is_classification_loss(user):
            return True
        passes_on = _keeps_values(user) or (
            _op_name(user) in _SCALED and sum(isinstance(a, fx.Node) for a in user.args) == 1)
        if user.args and user.args[0] is node and passes_on and feeds_loss(user):
            return True
    return False


def is_tied_embedding(weight):
    """Whether ``weight`` is also an embedding's table (a language model's head tied to it)."""
    return any(u.op == "call_function" and u.target is torch.nn.functional.embedding and u.args[1] is weight
               for u in weight.users)


def _decide(weight, layout, name, ctx, node, x, computed_from=None):
    """``None`` when the linear ``node`` of ``weight`` and input ``x`` is eligible, else why not;
    ``computed_from``: the parameters a computed weight comes from."""
    reason = _decide_weight(weight, layout, name, ctx, _tokens(x))
    if reason is None and not ctx.options.fp8_output_layer:
        if feeds_loss(node):
            return "the output layer: the loss reads its output (fp8_output_layer=True puts it in FP8)"
        if any(map(is_tied_embedding, computed_from or [weight])):
            return "the output layer: its weight is the input embedding's (fp8_output_layer=True puts it in FP8)"
    return reason


def _decide_weight(weight, layout, name, ctx, tokens):
    if layout == IN_OUT and not isinstance(ctx.inputs.get(weight.name), torch.nn.Parameter):
        return "right operand is not a parameter"  # x @ y of two inputs: not a layer's matmul
    value = _used_as(weight, layout)
    if value is None:
        return "weight is not a 2-D tensor"
    return ineligible_reason(value, name.rpartition(".")[0], ctx.options, tokens)


def _tokens(x):
    """The rows a linear multiplies (its input's elements over the last dim), or None unknown; a
    dynamic count at its hint, the size the graph is first compiled for."""
    value = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    rows = value.numel() // value.shape[-1] if value.shape[-1] else 0
    return rows.node.hint if isinstance(rows, torch.SymInt) else rows


def _used_as(weight, layout):
    """The (out, in) matrix ``weight`` is multiplied as (its example value; transposed for
    ``IN_OUT``), or None without one."""
    value = weight.meta.get("example_value")
    return value.t() if value is not None and layout == IN_OUT and value.dim() == 2 else value


def _padding_note(weight, layout):
    """``", padded to NxK"`` when the GEMMs pad the weight (``fp8_linear.padded_shape``), else ``""``."""
    n, k = _used_as(weight, layout).shape
    padded = padded_shape(n, k)
    return "" if padded == (n, k) else f", padded to {padded[0]}x{padded[1]}"


def _bind_delayed_state(gm, weight, name, ctx, bound):
    """The keyword arguments of ``fp8_linear`` that pass ``weight``'s delayed-scaling buffers, as
    placeholders added once per weight (``bound``: weight node -> kwargs)."""
    if weight in bound:
        return bound[weight]
    state = fp8_delayed.state_of(ctx.inputs[weight.name], name)
    length = state["amax_history"].shape[-1]
    if length != ctx.options.fp8_history_length:
        raise ValueError(
            f"fp8='delayed': '{name}' was prepared with history length {length}, the options say "
            f"fp8_history_length={ctx.options.fp8_history_length}; use one length"
        )
    index = [n for n in gm.graph.nodes if n.op == "placeholder"].index(weight) if weight.op == "placeholder" else None
    kwargs = {}
    for key, tensor in state.items():
        # A parameter placeholder may be another module instance's on a later call (Dynamo shares
        # the graph): look its state up from it each call. A get_attr weight is this one for good.
        lookup = None if index is None else functools.partial(
            fp8_delayed.look_up_at_run_time, index, key, (tensor.shape, tensor.dtype, tensor.device), name)
        kwargs[key] = graph_utils.add_bound_placeholder(
            gm.graph, graph_utils.python_name(fp8_delayed.buffer_name(name, key)), tensor, lookup)
    bound[weight] = kwargs
    return kwargs


def _regions(gm):
    """``(body, module, operands)`` for ``gm`` (``body`` None, no operands) and for the body of each
    of its activation-checkpointed regions (``body``: the attribute holding it), ``operands`` mapping
    the body's inputs to the region's operands in ``gm``."""
    yield None, gm, {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is CHECKPOINT:
            module = getattr(gm, node.args[0].target)
            inputs = [n for n in module.graph.nodes if n.op == "placeholder"]
            yield node.args[0].target, module, dict(zip(inputs, node.args[1:]))


def _linears(gm):
    """``(body, node, linear, weight, operands)`` for each linear of ``gm`` and of its regions' bodies
    (``_regions``), ``weight`` being what the linear multiplies by (for a body's, the region's operand
    when it is one), ``operands`` the body's inputs' operands."""
    for body, module, operands in _regions(gm):
        for node in module.graph.nodes:
            linear = as_linear(node)
            if linear is not None:
                yield body, node, linear, operands.get(linear[1], linear[1]), operands


def _is_input(node):
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def _parameters_computing(weight, ctx, operands):
    """The parameters ``weight`` is computed from, sorted by name, when only module state enters it
    (parameters, buffers, constants): a parametrization's weight (``weight_norm``, ``spectral_norm``,
    a LoRA merge), a cast or a slice of a parameter. None when an activation enters it, or no parameter."""
    params, seen, todo = set(), set(), [weight]
    while todo:
        node = todo.pop()
        node = operands.get(node, node)
        if node in seen:
            continue
        seen.add(node)
        if _is_input(node):
            if isinstance(ctx.inputs.get(node.name), torch.nn.Parameter):
                params.add(node)
            elif node.op == "placeholder" and not graph_utils.is_buffer_input(node):
                return None  # an activation (or a size) enters it
            continue
        todo.extend(node.all_input_nodes)
    return sorted(params, key=graph_utils.input_name) or None


_SHORT_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _decide_computed(weight, params, ctx):
    """``(reason or None, what it runs in otherwise)`` for an otherwise eligible weight computed from
    ``params``. One computed wider than every parameter it comes from stays as it is: the model asks
    for that precision (DeepSeek's router multiplies by ``weight.float()``)."""
    dtype = weight.meta["example_value"].dtype
    widest = max((ctx.inputs[p.name].dtype for p in params), key=lambda d: d.itemsize)
    if dtype.itemsize > widest.itemsize:
        wide, narrow = _SHORT_NAMES.get(dtype, str(dtype)), _SHORT_NAMES.get(widest, str(widest))
        return f"weight upcast from its {narrow} parameters: the model computes this product in {wide}", wide
    if ctx.options.fp8_state_per_layer:
        return ("weight computed from parameters, where only fp8='tensorwise' or 'rowwise' without "
                "fp8_all_gather runs in FP8 (their state is a parameter's)"), "bf16"
    return None, "bf16"


def _computed_weight_name(params):
    """The name a computed weight is decided and reported under: a parametrized module's attribute
    (``fc1.weight`` for ``fc1.parametrizations.weight.original0`` and ``original1``, and for the
    deprecated ``torch.nn.utils.weight_norm``'s ``fc1.weight_g`` and ``fc1.weight_v``), else its first
    parameter's name."""
    names = [graph_utils.input_name(p) for p in params]
    owners = {re.sub(r"(^|\.)parametrizations\.(\w+)\.original\d*$", r"\1\2", name) for name in names}
    if len(owners) == 1:
        return owners.pop()
    if len(names) == 2 and names[0][:-2] == names[1][:-2] and [n[-2:] for n in names] == ["_g", "_v"]:
        return names[0][:-2]
    return names[0]


def _attentions(gm):
    """``(body, node, arguments, weights)`` for each ``F.multi_head_attention_forward`` call (an
    ``nn.MultiheadAttention``) of ``gm`` and of its regions' bodies: its arguments by name, and
    ``{argument: graph input}`` for the weights its projections multiply by."""
    for body, module, operands in _regions(gm):
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target is torch.nn.functional.multi_head_attention_forward:
                arguments = multi_head_attention.SIGNATURE.bind(*node.args, **node.kwargs).arguments
                # The weights the call multiplies by: the stacked one or the separate ones, never both
                # (Hugging Face's WavLM passes torch.empty([0]) for the stacked one it does not use).
                unused = multi_head_attention.unused_weights(arguments)
                weights = {k: operands.get(arguments[k], arguments[k]) for k in multi_head_attention.WEIGHTS
                           if k not in unused and isinstance(arguments.get(k), fx.Node)}
                yield body, node, arguments, weights


def _self_attention(arguments):
    """Whether the call projects one batched input by the whole stacked weight (torch's function
    unsqueezes an unbatched one into three tensors, and slices the weight)."""
    query = arguments["query"]
    value = query.meta.get("example_value") if isinstance(query, fx.Node) else None
    return query is arguments["key"] is arguments["value"] and isinstance(value, torch.Tensor) and value.dim() == 3


def _decide_attention(arguments, weights, ctx):
    """``{argument: reason or None}`` for an ``nn.MultiheadAttention``'s weights (None: in FP8)."""
    reason = multi_head_attention.unsupported_reason(arguments)
    if reason is None and ctx.options.fp8_state_per_layer:
        reason = ("nn.MultiheadAttention runs in FP8 with current scaling only (fp8='tensorwise' or 'rowwise', "
                  "without fp8_all_gather)")
    tokens = _tokens(arguments["query"])
    decisions = {}
    for argument, weight in weights.items():
        if reason is not None or weight.op not in ("placeholder", "get_attr"):
            decisions[argument] = reason or "weight is not a parameter"
        else:
            decisions[argument] = _decide_weight(weight, OUT_IN, graph_utils.input_name(weight), ctx, tokens)
        if argument == "in_proj_weight" and decisions[argument] is None and not _self_attention(arguments):
            # Other attention multiplies by the weight's slices (q's, and k's and v's together or apart).
            n, k = weight.meta["example_value"].shape
            if any(padded_shape(rows, k) is None for rows in (n // 3, 2 * n // 3)):
                decisions[argument] = (f"weight {n}x{k}: its q, k, v slices would need over 1% of padding to "
                                       "multiples of 16")
    return decisions


def _fp8_decision(ctx, weight, layout):
    fp8_decision = {"delayed": "fp8 e4m3/e5m2, delayed scaling", "rowwise": "fp8 e4m3, row-wise scales"}.get(
        ctx.options.fp8, "fp8 e4m3/e5m2")
    if ctx.options.fp8_tensorwise_weight_gradient:
        fp8_decision += " (the weight gradient's: one per operand)"
    return fp8_decision + _padding_note(weight, layout)


def fp8_linear_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    if ctx.options.fp8 is None:
        return gm, []
    captured, gm = gm, _einsums_as_linears(gm, ctx)
    eligible = []  # (body, node name, the weights an attention runs in FP8; None for a linear)
    decided = set()
    for body, node, linear, weight, operands in _linears(gm):
        computed_from = None
        if not _is_input(weight):
            computed_from = _parameters_computing(weight, ctx, operands)
            if computed_from is None:
                continue  # an activation, or a product of one
        decided.add(node)
        layout = linear[3]
        name = graph_utils.input_name(weight) if computed_from is None else _computed_weight_name(computed_from)
        reason = _decide(weight, layout, name, ctx, node, linear[0], computed_from)
        kept = "bf16"  # what the report says a linear not in FP8 runs in
        if reason is None and computed_from:
            reason, kept = _decide_computed(weight, computed_from, ctx)
        if reason is None and body is not None and ctx.options.fp8_state_per_layer:
            # Their per-layer state would have to enter the region as operands of its own.
            reason = ("in an activation-checkpointed region, where only fp8='tensorwise' without "
                      "fp8_all_gather runs in FP8")
        if reason is None and ctx.options.fp8 == "delayed" and fp8_delayed.state_of(ctx.inputs[weight.name], name) is None:
            fp8_delayed.warn_missing_state(name)
            reason = "no delayed-scaling state (flash_inductor.prepare_fp8 makes it)"
        if ctx.recorder:
            decision = _fp8_decision(ctx, weight, layout) if reason is None else f"{kept}: {reason}"
            if computed_from:
                decision += ", weight computed from " + ", ".join(map(graph_utils.input_name, computed_from))
            if isinstance(weight.meta.get("example_value"), Fp8Weight):
                decision += ", weight all-gathered in e4m3" if reason is None else " (on the e4m3-gathered weight, dequantized)"
            ctx.recorder.decision("fp8_linear", name, decision)
        if reason is None:
            eligible.append((body, node.name, None))
    for body, node, arguments, weights in _attentions(gm):
        decided.add(node)
        decisions = _decide_attention(arguments, weights, ctx)
        if ctx.recorder:
            for argument, reason in decisions.items():
                decision = _fp8_decision(ctx, weights[argument], OUT_IN) if reason is None else f"bf16: {reason}"
                ctx.recorder.decision("fp8_linear", graph_utils.input_name(weights[argument]), decision)
        fp8_weights = tuple(argument for argument, reason in decisions.items() if reason is None)
        if fp8_weights:
            eligible.append((body, node.name, fp8_weights))
    if ctx.recorder:
        for name, reason in _unsupported_matmuls(gm, ctx, decided):
            ctx.recorder.decision("fp8_linear", name, f"bf16: {reason}")
    if not eligible:  # an einsum written as a linear (above) stays an einsum
        return captured, []
    gm = graph_utils.copy_graph_module(gm)
    rewrites_by_body = {}
    for body, name, fp8_weights in eligible:
        rewrites_by_body.setdefault(body, []).append((name, fp8_weights))
    bound = {}
    for body, rewrites in rewrites_by_body.items():
        if body is not None:  # a copy of the region's body: the input graph's stays as it was
            setattr(gm, body, graph_utils.copy_graph_module(getattr(gm, body)))
        module = gm if body is None else getattr(gm, body)
        nodes = {n.name: n for n in module.graph.nodes}
        for name, fp8_weights in rewrites:
            if fp8_weights is None:
                _rewrite(gm, module.graph, nodes[name], ctx, bound)
            else:
                _rewrite_attention(module.graph, nodes[name], fp8_weights, ctx)
        module.graph.lint()
        module.recompile()
    return gm, [name if body is None else f"{body}.{name}" for body, name, _ in eligible]


def _fp8_options(ctx):
    """``fp8_linear``'s keyword arguments for the scaling ``ctx.options`` asks (delayed scaling's
    per-weight state is bound on top, ``_rewrite``)."""
    kwargs = {"rowwise": True} if ctx.options.fp8 == "rowwise" else {"power_of_two": ctx.options.fp8_power_of_two_scales}
    if ctx.options.fp8_fast_accum:
        kwargs["fast_accum"] = True
    if ctx.options.fp8_e4m3_gradients and ctx.options.fp8 != "rowwise":  # row-wise's are e4m3 already
        kwargs["e4m3_gradients"] = True
    if ctx.options.fp8_tensorwise_weight_gradient:
        kwargs["tensorwise_weight_gradient"] = True
    return kwargs


def _rewrite_attention(graph, node, fp8_weights, ctx):
    """Replace the ``F.multi_head_attention_forward`` call ``node`` by ``fp8_multi_head_attention_forward``,
    its projections by ``fp8_weights`` in FP8."""
    kwargs = {**node.kwargs, "fp8_weights": fp8_weights, "fp8_options": _fp8_options(ctx)}
    with graph.inserting_before(node):
        replacement = graph.call_function(multi_head_attention.fp8_multi_head_attention_forward, node.args, kwargs)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


def _rewrite(gm, graph, node, ctx, bound):
    """Replace the linear ``node`` of ``graph`` (``gm``'s or a checkpointed region's) by ``fp8_linear``."""
    x, weight, bias, layout = as_linear(node)
    kwargs = _fp8_options(ctx)
    if ctx.options.fp8 == "delayed":  # never in a region's body (fp8_linear_pass)
        kwargs.update(_bind_delayed_state(gm, weight, graph_utils.input_name(weight), ctx, bound))
    with graph.inserting_before(node):
        replacement = graph.call_function(fp8_linear, (x, out_in_weight(graph, weight, layout), bias), kwargs)
    node.replace_all_uses_with(replacement)
    transposed = [a for a in node.args if is_transpose(a) and a.args[0] is weight]
    graph.erase_node(node)
    if transposed and not transposed[0].users:
        graph.erase_node(transposed[0])
