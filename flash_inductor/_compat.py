"""Differences between the torch versions we support (>= 2.11), in one place."""

import torch
from torch.torch_version import TorchVersion

TORCH_VERSION = TorchVersion(torch.__version__)


def inductor_patches_for_rewritten_graphs():
    """Inductor settings for graphs our passes rewrote, beyond ``emulate_precision_casts``."""
    patches = {}
    if TORCH_VERSION < "2.13":
        # torch 2.11's scheduler asserts in reorder_loops_by_dep_pair when loop reordering meets a
        # fused node of the optimizer step (fixed in 2.13, where the base class returns False).
        patches["loop_ordering_after_fusion"] = False
    return patches
