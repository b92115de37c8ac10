import torch

from ._base import SimpleOptimizer


class Lion(SimpleOptimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

    Per step, with decoupled weight decay::

        p  <- p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)
        m  <- beta2 * m + (1 - beta2) * g
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid betas: {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def _update(self, p, grad, state, group):
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avg = state["exp_avg"]
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        update = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
        p.sub_(update * lr)
        exp_avg.lerp_(grad, 1 - beta2)
