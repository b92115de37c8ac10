"""Options of the ``flashoptim`` backend: ``torch.compile(backend="flashoptim", options={...})``."""

import dataclasses
import os
from typing import Any

from flash_inductor.formats.fp8 import HISTORY_LENGTH


@dataclasses.dataclass(frozen=True)
class Options:
    """What the backend does. Every field can be given by name in ``options={...}``.

    disable: names of passes to switch off (see ``flash_inductor.passes.ALL_PASSES``).
    inductor: extra Inductor config patches, e.g. ``{"combo_kernels": True}``; they override the
        backend's defaults for rewritten graphs (``{"eager_numerics.division_rounding": False}``
        trades eager-identical codes for approximate division), except ``emulate_precision_casts``,
        which rewritten graphs need.
    dump: folder to write every graph before and after each pass to (also ``FLASHOPTIM_DUMP``).
    compiler: "inductor", or "eager" to run the rewritten graphs without Inductor (debugging:
        same rewrites, no kernels).
    fp8: None, or run eligible linear layers as FP8 GEMMs (``passes/fp8_linear.py``) with
        "tensorwise" (current) scaling or "delayed" scaling from amax histories kept in buffers of
        the layers (``flash_inductor.prepare_fp8`` makes them).
    fp8_history_length: amax history window of delayed scaling (positive int).
    fp8_power_of_two_scales: round FP8 scales down to powers of two (MS-AMP).
    fp8_fast_accum: the forward GEMM accumulates in the tensor cores' faster, lower-precision mode
        (``_scaled_mm(use_fast_accum=True)``, torchao's default for the output GEMM); the gradient
        GEMMs always accumulate in fp32.
    fp8_min_weight_numel: smallest weight (elements) worth an FP8 GEMM.
    fp8_exclude: fnmatch patterns of module names kept in bf16 (e.g. the first and last layers).
    fp8_filter: callable(module name) -> bool; False keeps that linear in bf16.
    fp8_collectives: gradient all-reduces (sum/avg) send e4m3 bytes with one scale agreed by all
        ranks (``passes/fp8_collectives.py``).
    """

    disable: tuple[str, ...] = ()
    inductor: tuple[tuple[str, Any], ...] = ()
    dump: str | None = None
    compiler: str = "inductor"
    fp8: str | None = None
    fp8_history_length: int = HISTORY_LENGTH
    fp8_power_of_two_scales: bool = False
    fp8_fast_accum: bool = False
    fp8_min_weight_numel: int = 1 << 20
    fp8_exclude: tuple[str, ...] = ()
    fp8_filter: Any = None
    fp8_collectives: bool = False

    @classmethod
    def from_dict(cls, options):
        options = dict(options or {})
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(
                f"flashoptim: unknown option(s) {unknown}; valid options are {sorted(valid)}"
            )
        disable = options.get("disable", ())
        if isinstance(disable, str):
            disable = (disable,)
        _check_pass_names(disable)
        inductor = options.get("inductor", ())
        if isinstance(inductor, dict):
            inductor = tuple(sorted(inductor.items()))
        if dict(inductor).get("emulate_precision_casts", True) is not True:
            raise ValueError(
                "flashoptim: option 'inductor' cannot turn emulate_precision_casts off: the rewritten optimizer "
                "step rounds to bf16/fp16 inside fused kernels, and without it every error term would stay 0"
            )
        dump = options.get("dump") or os.environ.get("FLASHOPTIM_DUMP") or None
        compiler = options.get("compiler", "inductor")
        if compiler not in ("inductor", "eager"):
            raise ValueError(f"flashoptim: option 'compiler' must be 'inductor' or 'eager', got {compiler!r}")
        fp8 = options.get("fp8")
        if fp8 not in (None, "tensorwise", "delayed"):
            raise ValueError(f"flashoptim: option 'fp8' must be None, 'tensorwise' or 'delayed', got {fp8!r}")
        history = options.get("fp8_history_length", cls.fp8_history_length)
        if type(history) is not int or history < 1:
            raise ValueError(
                f"flashoptim: option 'fp8_history_length' must be a positive int (default {HISTORY_LENGTH}), got {history!r}"
            )
        exclude = options.get("fp8_exclude", ())
        if isinstance(exclude, str):
            exclude = (exclude,)
        fp8_filter = options.get("fp8_filter")
        if fp8_filter is not None and not callable(fp8_filter):
            raise ValueError("flashoptim: option 'fp8_filter' must be a callable taking a module name")
        return cls(
            disable=tuple(disable), inductor=tuple(inductor), dump=dump, compiler=compiler, fp8=fp8,
            fp8_min_weight_numel=int(options.get("fp8_min_weight_numel", cls.fp8_min_weight_numel)),
            fp8_exclude=tuple(exclude), fp8_filter=fp8_filter, fp8_history_length=history,
            fp8_power_of_two_scales=_flag(options, "fp8_power_of_two_scales"), fp8_fast_accum=_flag(options, "fp8_fast_accum"),
            fp8_collectives=_flag(options, "fp8_collectives"),
        )

    def enabled(self, pass_name):
        return pass_name not in self.disable


def _flag(options, name):
    value = options.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"flashoptim: option {name!r} must be True or False, got {value!r}")
    return value


def _check_pass_names(names):
    from flash_inductor.passes import ALL_PASSES

    known = [p.name for p in ALL_PASSES]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"flashoptim: option 'disable' names unknown pass(es) {unknown}; passes are {known}")
