import torch

from ._base import SimpleOptimizer


class SGDW(SimpleOptimizer):
    """SGD with momentum and decoupled weight decay (Loshchilov & Hutter, 2019).

    Per step (the momentum buffer starts at zero)::

        p   <- p * (1 - lr * weight_decay)
        buf <- momentum * buf + (1 - dampening) * g
        d   <- g + momentum * buf   if nesterov else buf     (d = g without momentum)
        p   <- p - lr * d
    """

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(
            params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        )

    def _update(self, p, grad, state, group):
        lr, momentum = group["lr"], group["momentum"]
        p.mul_(1 - lr * group["weight_decay"])
        direction = grad
        if momentum != 0:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
            direction = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
        p.sub_(direction * lr)
