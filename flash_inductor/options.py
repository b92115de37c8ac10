"""Options of the ``flashoptim`` backend: ``torch.compile(backend="flashoptim", options={...})``."""

import dataclasses
import hashlib
import inspect
import os
import types
from collections.abc import Iterable
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from flash_inductor import passes
from flash_inductor.formats.fp8 import HISTORY_LENGTH

# Where an FP8 linear starts to pay on the H200 (torch 2.11): forward + backward of one linear,
# GPU kernel time, bf16 against FP8 (current scaling, fast accumulation), docs/benchmarks.md
# "Where an FP8 linear pays": 0.96-0.98x bf16's at 1.7e10 and 2.4e10, 1.14-1.22x at 4.7e10.
FP8_MIN_GEMM_SIZE_CUDA = 1 << 35


@dataclasses.dataclass(frozen=True)
class Options:
    """What the backend does. Every field can be given by name in ``options={...}``.

    disable: names of passes to switch off (see ``flash_inductor.passes.ALL_PASSES``).
    inductor: extra Inductor config patches, e.g. ``{"combo_kernels": True}``; they override the
        backend's defaults for rewritten graphs (``{"eager_numerics.division_rounding": True}``
        makes Triton's fp32 divisions exactly rounded, as eager's, at some speed), except ``emulate_precision_casts``,
        which rewritten graphs need. A ``post_grad_custom_post_pass`` there (or in Inductor's config)
        runs after the backend's aten-level passes.
    dump: folder to write every graph before and after each pass to (also ``FLASHOPTIM_DUMP``).
    compiler: "inductor", or "eager" to run the rewritten graphs without Inductor (debugging:
        same rewrites, no kernels).
    fp8: None, or run eligible linear layers as FP8 GEMMs (``passes/fp8_linear.py``) with
        "tensorwise" (current) scaling, "delayed" scaling from amax histories kept in buffers of
        the layers (``flash_inductor.prepare_fp8`` makes them), or "rowwise" (current) scaling: one
        power-of-two scale per row of each GEMM operand along the dimension it sums over, every
        operand in e4m3 (torchao's "rowwise" recipe; ``flash_inductor/fp8_linear.py``).
    fp8_history_length: amax history window of delayed scaling (positive int).
    fp8_power_of_two_scales: round FP8 scales down to powers of two (MS-AMP); row-wise scales always are.
    fp8_fast_accum: the forward GEMM accumulates in the tensor cores' faster, lower-precision mode
        (``_scaled_mm(use_fast_accum=True)``, torchao's default for the output GEMM); the gradient
        GEMMs always accumulate in fp32.
    fp8_e4m3_gradients: tensorwise and delayed scaling cast the output gradient to e4m3 (3 mantissa
        bits, 2**17.8 of range below its amax) instead of e5m2 (2 bits, the recipes' default), as
        row-wise scaling always does: half the output gradient's rounding error, at the same speed.
        A value under 2**-17.8 of the tensor's amax flushes to zero (e5m2: 2**-31.8). Off by default:
        the Llama's loss over 15 seeds came no closer to the baseline's than with e5m2 (docs/benchmarks.md).
    fp8_tensorwise_weight_gradient: with ``fp8="rowwise"``, the weight-gradient GEMM (which sums over
        the tokens) takes one power-of-two scale per operand, as tensorwise scaling does, made from the
        row-wise casts of the input and the output gradient (``flash_inductor/fp8_linear.py``), instead
        of a scale per column of each: no pass over the tokens' columns, no activation or gradient cast
        from bf16 twice.
        The forward and input-gradient GEMMs stay row-wise.
    fp8_min_weight_numel: smallest weight (elements) worth an FP8 GEMM.
    fp8_min_gemm_size: smallest forward GEMM, tokens x in x out, worth FP8 GEMMs: below it the amax
        passes, casts and transposed copies cost more GPU time than the FP8 GEMMs save. None (the
        default): ``FP8_MIN_GEMM_SIZE_CUDA`` on CUDA, 0 on the CPU (whose FP8 is an emulation, for
        tests). Decided on the shape the graph is compiled for (a dynamic token count: its hint).
    fp8_output_layer: also run the output layer in FP8: the linear whose output the graph's loss
        reads (a language model's head; its logits reach ``cross_entropy``, ``nll_loss`` or
        ``log_softmax``), which otherwise stays bf16, as torchtitan and torchao's recipes keep it:
        the loss is the most sensitive to it (docs/benchmarks.md, "Hugging Face clients").
    fp8_exclude: fnmatch patterns of module names kept in bf16 (e.g. the first and last layers).
    fp8_filter: callable(module name) -> bool; False keeps that linear in bf16.
    fp8_all_gather: under FSDP2, all-gather the FP8 linears' weights in e4m3 with one scale agreed by
        all ranks (half the bytes of bf16), and multiply with them as gathered
        (``flash_inductor/fp8_all_gather.py``; ``flash_inductor.prepare_fp8`` sets it up). Needs
        ``fp8="tensorwise"``.
    fp8_collectives: gradient all-reduces (sum/avg) send e4m3 bytes with one scale agreed by all
        ranks (``passes/fp8_collectives.py``).
    cudagraphs: CUDA-graph the model's graphs (forward and backward; Inductor's cudagraph trees): each
        replays as one launch, so a step of many small kernels and GEMMs stops waiting on the CPU.
        Graphs that update parameters (the optimizer step) or read gradients (gradient clipping)
        are left out: their inputs are not at fixed addresses, so the graph would copy every gradient
        into a pool of its own each step (+2 B/param). ``mode="reduce-overhead"`` sets it.
    loss_chunk_rows: 0 leaves losses as written; N > 0 computes a cross-entropy of a linear's output
        N rows at a time, so the whole fp32 logits never exist (``passes/chunked_cross_entropy.py``).
    recompute_elementwise: the backward recomputes an elementwise result that it would save only for
        a matmul to read (a norm's output, ``silu(gate) * up`` before a down projection) from the
        tensors it saves anyway, where Inductor's partitioner saves it (its heuristic
        ``ban_recompute_materialized_backward`` off): less activation memory, one more elementwise
        kernel in the backward for each.
    step_kernel: "triton" runs the flat Adam/AdamW step of each eligible CUDA bucket (8-bit states,
        24-bit or no masters) as the hand-written kernel of ``flash_inductor/triton_adam.py``;
        "inductor" compiles the stock update for every bucket (the reference; always on the CPU).
    """

    disable: tuple[str, ...] = ()
    inductor: tuple[tuple[str, Any], ...] = ()
    dump: str | None = None
    compiler: str = "inductor"
    fp8: str | None = None
    fp8_history_length: int = HISTORY_LENGTH
    fp8_power_of_two_scales: bool = False
    fp8_fast_accum: bool = False
    fp8_e4m3_gradients: bool = False
    fp8_tensorwise_weight_gradient: bool = False
    fp8_min_weight_numel: int = 1 << 20
    fp8_min_gemm_size: int | None = None
    fp8_output_layer: bool = False
    fp8_exclude: tuple[str, ...] = ()
    fp8_filter: Any = None
    fp8_all_gather: bool = False
    fp8_collectives: bool = False
    cudagraphs: bool = False
    loss_chunk_rows: int = 0
    recompute_elementwise: bool = False
    step_kernel: str = "triton"

    @classmethod
    def from_dict(cls, options):
        options = dict(options or {})
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(
                f"flashoptim: unknown option(s) {unknown}; valid options are {sorted(valid)}"
            )
        disable = _strings(options, "disable", "pass names", ["split_weights"])
        _check_pass_names(disable)
        inductor = _config_patches(options, "inductor")
        if inductor.get("emulate_precision_casts", True) is not True:
            raise ValueError(
                "flashoptim: option 'inductor' cannot turn emulate_precision_casts off: the rewritten optimizer "
                "step rounds to bf16/fp16 inside fused kernels, and without it every error term would stay 0"
            )
        fp8 = _choice(options, "fp8", (None, "tensorwise", "delayed", "rowwise"), cls.fp8)
        fp8_all_gather = _flag(options, "fp8_all_gather")
        if fp8_all_gather and fp8 != "tensorwise":
            raise ValueError(
                f"flashoptim: option 'fp8_all_gather' needs fp8='tensorwise', got fp8={fp8!r}"
                + {"delayed": " (delayed scaling is not supported with fp8 all-gather)",
                   "rowwise": " (an all-gathered weight has one scale, a row-wise GEMM one per row)"}.get(fp8, "")
            )
        fp8_tensorwise_weight_gradient = _flag(options, "fp8_tensorwise_weight_gradient")
        if fp8_tensorwise_weight_gradient and fp8 != "rowwise":
            raise ValueError(f"flashoptim: option 'fp8_tensorwise_weight_gradient' needs fp8='rowwise', got fp8={fp8!r}")
        return cls(
            disable=disable,
            inductor=tuple(sorted(inductor.items())),
            dump=_folder(options, "dump") or os.environ.get("FLASHOPTIM_DUMP") or None,
            compiler=_choice(options, "compiler", ("inductor", "eager"), cls.compiler),
            fp8=fp8,
            fp8_history_length=_int(options, "fp8_history_length", "positive", 1, cls.fp8_history_length),
            fp8_power_of_two_scales=_flag(options, "fp8_power_of_two_scales"),
            fp8_fast_accum=_flag(options, "fp8_fast_accum"),
            fp8_e4m3_gradients=_flag(options, "fp8_e4m3_gradients"),
            fp8_tensorwise_weight_gradient=fp8_tensorwise_weight_gradient,
            fp8_min_weight_numel=_int(options, "fp8_min_weight_numel", "non-negative", 0, cls.fp8_min_weight_numel),
            fp8_min_gemm_size=None if options.get("fp8_min_gemm_size") is None else _int(
                options, "fp8_min_gemm_size", "non-negative", 0, FP8_MIN_GEMM_SIZE_CUDA),
            fp8_output_layer=_flag(options, "fp8_output_layer"),
            fp8_exclude=_strings(options, "fp8_exclude", "str (fnmatch patterns of module names)", ["layers.0.*", "lm_head"]),
            fp8_filter=_callable(options, "fp8_filter", "a callable taking a module name"),
            fp8_all_gather=fp8_all_gather,
            fp8_collectives=_flag(options, "fp8_collectives"),
            cudagraphs=_flag(options, "cudagraphs"),
            loss_chunk_rows=_int(options, "loss_chunk_rows", "non-negative", 0, cls.loss_chunk_rows),
            recompute_elementwise=_flag(options, "recompute_elementwise"),
            step_kernel=_choice(options, "step_kernel", ("triton", "inductor"), cls.step_kernel),
        )

    def min_gemm_size(self, device):
        """``fp8_min_gemm_size`` for weights on ``device``."""
        if self.fp8_min_gemm_size is not None:
            return self.fp8_min_gemm_size
        return FP8_MIN_GEMM_SIZE_CUDA if torch.device(device).type == "cuda" else 0

    @property
    def fp8_state_per_layer(self):
        """Whether FP8 keeps state per layer on its weight parameter: delayed scaling's amax histories
        and scales, or ``fp8_all_gather``'s e4m3 shards (``prepare_fp8`` makes them)."""
        return self.fp8 == "delayed" or self.fp8_all_gather

    def enabled(self, pass_name):
        return pass_name not in self.disable

    def cache_key(self):
        """These options as text that is the same in every process for the same options (the FX graph
        cache key hashes it): ``repr`` shows a callable's address, so with one every process missed the cache."""
        return repr([(f.name, _stable_key(getattr(self, f.name))) for f in dataclasses.fields(self)])


def _bad(name, value, expected):
    return ValueError(f"flashoptim: option {name!r} must be {expected}, got {value!r}")


def _flag(options, name):
    value = options.get(name, False)
    if not isinstance(value, bool):
        raise _bad(name, value, "True or False")
    return value


def is_int_at_least(value, minimum):
    """Whether ``value`` is an int of at least ``minimum``, not a bool (an int subclass)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _int(options, name, kind, minimum, default):
    value = options.get(name, default)
    if not is_int_at_least(value, minimum):
        raise _bad(name, value, f"a {kind} int (e.g. {default}, the default)")
    return value


def _choice(options, name, choices, default):
    value = options.get(name, default)
    if value not in choices:
        raise _bad(name, value, ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}")
    return value


def _strings(options, name, items, example):
    """A str, or an iterable of str, as a tuple."""
    value = options.get(name, ())
    if isinstance(value, str):
        return (value,)
    names = tuple(value) if isinstance(value, Iterable) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise _bad(name, value, f"a str or an iterable of {items}, e.g. {example!r}")
    return names


def _config_patches(options, name):
    value = options.get(name, {})
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise _bad(name, value, "a dict of Inductor config names to values, e.g. {'combo_kernels': True}")
    return value


def _folder(options, name):
    value = options.get(name)
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise _bad(name, value, "a folder path (str or os.PathLike) or None")
    return None if value is None else os.fspath(value)


def _callable(options, name, expected):
    value = options.get(name)
    if value is not None and not callable(value):
        raise _bad(name, value, f"None or {expected}")
    return value


def _check_pass_names(names):
    known = [p.name for p in passes.ALL_PASSES]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"flashoptim: option 'disable' names unknown pass(es) {unknown}; passes are {known}")


def _stable_key(value):
    """``value`` as text that does not depend on the process: a custom pass by its uuid (as Inductor
    keys it), a function by its code, a tuple item by item, anything else by repr."""
    if isinstance(value, CustomGraphPass):
        return f"{_qualified_name(type(value))} uuid {value.uuid()!r}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(map(_stable_key, value))})"
    if inspect.isfunction(value) or inspect.ismethod(value):
        return _function_key(value)
    return repr(value)


def _function_key(fn):
    """Module, qualname and a hash of the code object, then what else decides the result: defaults,
    closure cells and the bound object, by repr (where that shows an address, it only costs misses).
    The code object, not ``inspect.getsource``: that is the whole line, the same for two lambdas on it,
    and there is none for a function defined in ``python -c``."""
    code = hashlib.sha256(repr(_code_key(fn.__code__)).encode()).hexdigest()
    cells = tuple(cell.cell_contents for cell in fn.__closure__ or ())
    state = (fn.__defaults__, fn.__kwdefaults__, cells, getattr(fn, "__self__", None))
    return f"{_qualified_name(fn)} code {code} state {state!r}"


def _code_key(code):
    """What a code object does, without its address or source position."""
    return code.co_code, code.co_names, tuple(map(_constant_key, code.co_consts))


def _constant_key(constant):
    if isinstance(constant, types.CodeType):  # a nested function, lambda or comprehension
        return _code_key(constant)
    if isinstance(constant, frozenset):  # its order follows the process's hash seed
        return "frozenset", sorted(repr(_constant_key(c)) for c in constant)
    if isinstance(constant, tuple):
        return tuple(map(_constant_key, constant))
    return constant


def _qualified_name(obj):
    return f"{obj.__module__}.{obj.__qualname__}"
