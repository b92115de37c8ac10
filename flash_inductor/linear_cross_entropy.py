"""``linear_cross_entropy``: a language model's last linear and its cross-entropy, some rows at a time.

``F.cross_entropy(F.linear(x, weight, bias).float(), target)`` holds the whole logits three times
at the loss: the linear's output, its fp32 copy and the log-softmax (and their gradients in
backward); for the Llama ~1B at 2 x 4096 tokens that is 8192 x 32000 values, 2.5 GiB, and it is
where a compiled train step peaks (docs/benchmarks.md). Computed ``chunk_rows`` rows at a time,
only one chunk's logits exist at once:

    forward:  per chunk: logits = linear(x_c, weight, bias).float(); lse = logsumexp(logits)
              loss_c = lse - logits[target]  (0 where target == ignore_index)
              loss = sum(loss_c), divided by the count of kept targets for "mean"
    backward: per chunk, from the saved lse (N floats): p = exp(logits - lse); p[target] -= 1;
              rows of ignored targets 0; times d loss (and 1 / count for "mean"), cast to the
              linear's dtype as autograd casts the gradient of ``.float()``; then
              grad_x_c = g @ weight, grad_weight += g.T @ x_c (summed over chunks in fp32),
              grad_bias += sum(g)

The logits are the linear's, rounded to its dtype then widened, as the unchunked code computes
them; the per-row sums are the same, and only the order of the sums over rows (the loss, the
weight's gradient, accumulated in fp32 across chunks) differs. Both directions are opaque custom
ops, so Inductor runs them as written and cannot bring the chunks' logits back together.
``passes/chunked_cross_entropy.py`` puts it in place of the pattern (option ``loss_chunk_rows``).
"""

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum")


def _kept_count(target, ignore_index):
    return (target != ignore_index).sum()


def _chunk(x, weight, bias, target, ignore_index, start, chunk_rows):
    """The chunk's fp32 logits [n, V], which of its rows count (bool [n, 1]) and their targets, 0
    where ignored (int [n, 1]: an index for ``gather``)."""
    logits = F.linear(x[start:start + chunk_rows], weight, bias).float()
    chunk_target = target[start:start + chunk_rows].unsqueeze(1)
    kept = chunk_target != ignore_index
    return logits, kept, torch.where(kept, chunk_target, 0)


@torch.library.custom_op("flash_inductor::linear_cross_entropy", mutates_args=())
def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
             ignore_index: int, reduction: str, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss, fp32 0-dim; each row's logsumexp, fp32 [N], for backward)."""
    lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], chunk_rows):
        logits, kept, index = _chunk(x, weight, bias, target, ignore_index, start, chunk_rows)
        chunk_lse = torch.logsumexp(logits, dim=1, keepdim=True)
        lse[start:start + chunk_rows] = chunk_lse.squeeze(1)
        total += torch.where(kept, chunk_lse - logits.gather(1, index), 0.0).sum()
    if reduction == "mean":
        total = total / _kept_count(target, ignore_index)  # 0 / 0 = nan when every target is ignored, as torch
    return total, lse


@_forward.register_fake
def _forward_shapes(x, weight, bias, target, ignore_index, reduction, chunk_rows):
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("flash_inductor::linear_cross_entropy_backward", mutates_args=())
def _backward(grad_loss: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              target: torch.Tensor, lse: torch.Tensor, ignore_index: int, reduction: str,
              chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad weight, grad bias: empty without a bias)."""
    scale = grad_loss.float()
    if reduction == "mean":
        scale = scale / _kept_count(target, ignore_index)
    grad_x = torch.empty_like(x)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    grad_bias = torch.zeros(weight.shape[0] if bias is not None else 0, dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], chunk_rows):
        logits, kept, index = _chunk(x, weight, bias, target, ignore_index, start, chunk_rows)
        grad = torch.exp(logits - lse[start:start + chunk_rows].unsqueeze(1))
        grad.scatter_add_(1, index, grad.new_full(index.shape, -1.0))
        grad = (torch.where(kept, grad, 0.0) * scale).to(x.dtype)  # the linear's gradient, in its dtype
        grad_x[start:start + chunk_rows] = grad @ weight
        grad_weight += grad.t() @ x[start:start + chunk_rows]  # each chunk's product in the linear's dtype
        if bias is not None:
            grad_bias += grad.float().sum(0)
    return grad_x, grad_weight.to(weight.dtype), grad_bias.to((x if bias is None else bias).dtype)


@_backward.register_fake
def _backward_shapes(grad_loss, x, weight, bias, target, lse, ignore_index, reduction, chunk_rows):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias) if bias is not None else x.new_empty(0)


def _setup_context(ctx, inputs, output):
    x, weight, bias, target, ignore_index, reduction, chunk_rows = inputs
    ctx.save_for_backward(x, weight, bias, target, output[1])
    ctx.options = ignore_index, reduction, chunk_rows


def _differentiate(ctx, grad_loss, grad_lse):
    x, weight, bias, target, lse = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = _backward(grad_loss, x, weight, bias, target, lse, *ctx.options)
    return grad_x, grad_weight, grad_bias if bias is not None else None, None, None, None, None


_forward.register_autograd(_differentiate, setup_context=_setup_context)


def linear_cross_entropy(x, weight, bias, target, ignore_index=-100, reduction="mean", chunk_rows=1024):
    """``F.cross_entropy(F.linear(x, weight, bias).float(), target, ignore_index=, reduction=)``
    for 2-D ``x`` [N, K] and 1-D ``target`` [N], ``chunk_rows`` rows at a time (the module docstring)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows must be a positive int, got {chunk_rows!r}")
    return _forward(x, weight, bias, target, ignore_index, reduction, chunk_rows)[0]
