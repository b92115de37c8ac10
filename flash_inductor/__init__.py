"""flash_inductor: the ``flashoptim`` torch.compile backend.

    flash_inductor.prepare(model, optimizer)       # bf16 + 24-bit split masters, 8-bit states
    step = torch.compile(step, backend="flashoptim")
    report = flash_inductor.inspect(step, x, y)
"""

from flash_inductor import optim
from flash_inductor.backend import compile, inspect, prepare_fp8
from flash_inductor.checkpoint import load_master_state_dict, master_state_dict
from flash_inductor.gradient_clipping import clip_grad_norm_
from flash_inductor.linear_cross_entropy import linear_cross_entropy
from flash_inductor.memory import memory_report
from flash_inductor.prepare import prepare
from flash_inductor.train_step import train_step

__version__ = "0.1.0"
__all__ = [
    "clip_grad_norm_", "compile", "inspect", "linear_cross_entropy", "load_master_state_dict", "master_state_dict",
    "memory_report", "optim", "prepare", "prepare_fp8", "train_step",
]
