"""Inductor's kernel heuristics where the backend needs other choices (option ``persistent_rows``).

A reduction whose result the same kernel then reads (a row's amax, then the row cast by it: every
row-wise FP8 cast; a norm's sum, then the row scaled by it) is written by Inductor either persistent,
the whole row in one block and read once, or looped, ``for r0_offset`` over the row once to reduce
and once more to use the result. Inductor keeps rows of up to 1024 elements persistent
(``InductorChoices.should_use_persistent_reduction``); a Llama's rows of 2048 and 5632 elements are
looped, so each is read two or three times (docs/benchmarks.md, "Where row-wise's extra bytes come
from"). ``persistent_rows(n)`` makes reductions along contiguous rows of up to ``n`` elements
persistent while Inductor writes a graph's kernels, and leaves every other choice to the handler
in place (Inductor's, or one a user set with ``V.set_choices_handler``).
"""

import contextlib

from torch._inductor import config
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V


class _PersistentRows:
    """The choices handler ``inner``, with reductions along rows of up to ``max_numel`` persistent."""

    def __init__(self, inner, max_numel):
        self._inner = inner
        self._max_numel = max_numel

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def should_use_persistent_reduction(self, features, cooperative_reduction):
        # INNER: the reduced elements are contiguous, a row; a block of a whole row then loads it
        # coalesced. Cooperative reductions split a row across blocks: Inductor's choice.
        if (config.triton.persistent_reductions and not cooperative_reduction
                and features.get_reduction_hint() == ReductionHint.INNER
                and V.graph.sizevars.statically_known_leq(features.reduction_numel, self._max_numel)):
            return True
        return self._inner.should_use_persistent_reduction(features, cooperative_reduction)


@contextlib.contextmanager
def persistent_rows(max_numel):
    """While Inductor lowers a graph: reductions along rows of up to ``max_numel`` elements persistent
    (None: Inductor's own threshold)."""
    if max_numel is None:
        yield
        return
    with V.set_choices_handler(_PersistentRows(V.choices, max_numel)):
        yield
