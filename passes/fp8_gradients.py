"""FP8 gradients: a bucket's step reads its gradients decoded from FP8 codes and per-parameter scales.

With ``prepare(..., gradient_format="e5m2")`` a flat bucket keeps its gradients as a
``TensorScaledState`` (``Bucket.fp8_grads``, flash_inductor/flat.py). Its bucket optimizer's ``.grad``
is a stand-in of the right shape and dtype that holds no data (one element, expanded), so Dynamo
traces the stock update unchanged; this pass replaces every read of the stand-in by the decoded
gradients, read from the store's tensors bound as graph inputs. Inductor fuses the decode into the
update kernel: no gradient buffer is materialized.

Before (Dynamo graph of ``torch.optim.AdamW.step`` on a bucket optimizer)::

    grad = placeholder                              # bf16 (G, 32), strides (0, 0): the stand-in
    exp_avg.lerp_(grad, 0.1)

After::

    grad = placeholder                              # no longer read
    grad_codes = placeholder                        # float8_e5m2 (G, 32), bound to the FP8 gradients
    grad_scales = placeholder                       # fp32 (S,): one per parameter
    grad_starts = placeholder                       # int64 (S,): each parameter's first row
    grad_fp32 = fp8_gradients.decode(grad, grad_codes, grad_scales, grad_starts)   # fp32 (G, 32)
    exp_avg.lerp_(grad_fp32, 0.1)

passes/companded_states.py leaves these gradients alone (it reads others in fp32 the same way).
"""

import torch.fx as fx

from flash_inductor import graph_utils, roles
from flash_inductor.formats import tensor_scaled


def decode(stand_in, codes, scales, starts):
    """The fp32 gradients ``(G, 32)`` of FP8 ``codes`` with one scale per segment of ``starts``
    (``stand_in``, the ``.grad`` the stock update reads, holds none)."""
    return tensor_scaled.decode(codes, scales, starts)


def fp8_gradients_pass(gm: fx.GraphModule, ctx) -> tuple[fx.GraphModule, list[str]]:
    updated = ctx.updated_params()
    targets = [
        name for name, role in ctx.roles.items()
        if role.kind == roles.GRAD and role.prepared.fp8_gradients is not None and role.param in updated
    ]
    if not targets:
        return gm, []

    def decode_in_step(graph, node):
        role = ctx.roles[node.name]
        store = role.prepared.fp8_gradients
        parts = [graph_utils.add_bound_placeholder(graph, role.node_name(part), getattr(store, part))
                 for part in ("codes", "scales", "starts")]
        graph_utils.work_on_decoded_copy(graph, node, decode, None, extra=parts, name=role.node_name("fp32"))

    return graph_utils.rewrite_copy(gm, targets, decode_in_step), targets

