"""The backend's graph passes, in the order they run. One file per rewrite.

Torch-level passes rewrite the Dynamo graph (before AOTAutograd): they may add graph inputs and
change what stored tensors mean. Aten-level passes run inside Inductor on the post-grad graph.
"""

from flash_inductor.pipeline import ATEN, TORCH, GraphPass

from .bound_hyperparameters import bound_hyperparameters_pass
from .chunked_cross_entropy import chunked_cross_entropy_pass
from .companded_states import companded_states_pass
from .fp8_collectives import fp8_collectives_pass
from .fp8_gradients import fp8_gradients_pass
from .fp8_linear import fp8_linear_pass
from .fp8_scales_stored import fp8_scales_stored_pass
from .fp8_transpose_cse import fp8_transpose_cse_pass
from .fp8_transpose_source import fp8_transpose_source_pass
from .fp32_hyperparameters import fp32_hyperparameters_pass
from .fp32_losses import fp32_losses_pass
from .fp64_step_powers import fp64_step_powers_pass
from .split_weights import split_weights_pass
from .untouched_parameters import untouched_parameters_pass

# bound_hyperparameters runs first: the others then see a graph without its NaNs. untouched_parameters
# runs before the storage passes (they then make its copies act on decoded values); fp8_gradients before
# companded_states (which leaves FP8 gradients to it). companded_states sets the layout of the update
# (see update_shape), which split_weights then decodes the master in. fp64_step_powers is a matter of
# an ulp in the bias corrections, not of the stored format: a failure leaves torch's fp32 pow.
# fp32_losses before chunked_cross_entropy (which takes the lm_head's logits through the .float() it
# adds) and fp8_linear (which finds the output layer by the loss its logits reach, through that cast).
# chunked_cross_entropy before fp8_linear: the lm_head it takes into its chunks stays in its dtype.
TORCH_PASSES = (
    GraphPass("bound_hyperparameters", TORCH, bound_hyperparameters_pass, required_for_prepared=True),
    GraphPass("untouched_parameters", TORCH, untouched_parameters_pass, required_for_prepared=True),
    GraphPass("fp32_hyperparameters", TORCH, fp32_hyperparameters_pass, required_for_prepared=True),
    GraphPass("fp64_step_powers", TORCH, fp64_step_powers_pass),
    GraphPass("fp8_gradients", TORCH, fp8_gradients_pass, required_for_prepared=True),
    GraphPass("companded_states", TORCH, companded_states_pass, required_for_prepared=True),
    GraphPass("split_weights", TORCH, split_weights_pass, required_for_prepared=True),
    GraphPass("fp32_losses", TORCH, fp32_losses_pass),
    GraphPass("chunked_cross_entropy", TORCH, chunked_cross_entropy_pass),
    GraphPass("fp8_linear", TORCH, fp8_linear_pass),
    GraphPass("fp8_collectives", TORCH, fp8_collectives_pass),
)
# fp8_transpose_cse first: the source of each merged call is then stored once for all of them.
ATEN_PASSES = (
    GraphPass("fp8_transpose_cse", ATEN, fp8_transpose_cse_pass),
    GraphPass("fp8_transpose_source", ATEN, fp8_transpose_source_pass),
    GraphPass("fp8_scales_stored", ATEN, fp8_scales_stored_pass),
)
ALL_PASSES = TORCH_PASSES + ATEN_PASSES

__all__ = ["ALL_PASSES", "ATEN", "ATEN_PASSES", "TORCH", "TORCH_PASSES", "GraphPass"]
