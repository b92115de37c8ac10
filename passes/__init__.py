"""The backend's graph passes, in the order they run. One file per rewrite.

Torch-level passes rewrite the Dynamo graph (before AOTAutograd): they may add graph inputs and
change what stored tensors mean. Aten-level passes run inside Inductor on the post-grad graph.
"""

from flash_inductor.pipeline import ATEN, TORCH, GraphPass

from .companded_states import companded_states_pass
from .split_weights import split_weights_pass

TORCH_PASSES = (
    GraphPass("split_weights", TORCH, split_weights_pass),
    GraphPass("companded_states", TORCH, companded_states_pass),
)
ATEN_PASSES = ()
ALL_PASSES = TORCH_PASSES + ATEN_PASSES

__all__ = ["ALL_PASSES", "ATEN", "ATEN_PASSES", "TORCH", "TORCH_PASSES", "GraphPass"]
