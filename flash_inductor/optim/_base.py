import torch


class SimpleOptimizer(torch.optim.Optimizer):
    """Shared ``step`` loop: grad checks, then ``_update(p, grad, state, group)`` per parameter."""

    def __init__(self, params, defaults):
        if not 0.0 <= float(defaults["lr"]):
            raise ValueError(f"Invalid learning rate: {defaults['lr']}")
        if not 0.0 <= defaults["weight_decay"]:
            raise ValueError(f"Invalid weight_decay value: {defaults['weight_decay']}")
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                self._update(p, p.grad, self.state[p], group)
        return loss
