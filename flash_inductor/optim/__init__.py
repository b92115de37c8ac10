"""Optimizers the project adds to torch's SGD, Adam and AdamW, with the same API as FlashOptim's.

They are ordinary ``torch.optim.Optimizer`` subclasses written in plain in-place tensor ops, so
Dynamo traces them like torch's own and ``flash_inductor.prepare`` gives them split weights and
8-bit states the same way.
"""

from .lion import Lion
from .sgdw import SGDW

__all__ = ["Lion", "SGDW"]
