"""Hand-written Triton kernels for the flat Adam/AdamW step on CUDA (issue 13; FP8-LM's states, issue 14).

Inductor's kernel for the traced stock update (``flat.step_buckets``) stays the reference and the
path for every other case: the CPU, other optimizers, amsgrad, fp32 states, FP8 gradients, or
32-bit masters. On the H200 this kernel is faster (docs/benchmarks.md, "The flat optimizer step"): it processes
blocks of groups of 32 (``LaunchShape``: how many, on how many warps, ...) with few registers, where
Inductor's persistent reductions over the two state scales keep more values live.

The math is the stock capturable Adam(W) update on the decoded fp32 values, with the storage formats
of ``formats/split_weights.py`` (the step's plain pair, int8 error terms) and
``formats/companded.py`` (signed and sqrt codes, bf16 group scales, one reciprocal per group),
written once more in Triton; ``tests/test_gpu.py`` holds it to the fp64 reference and to the
Inductor step. Groups whose parameter has no gradient (``bucket.active``) are not written. The
kernels read each parameter's gradient where it is (``_gradient``: a table of ``.grad`` addresses),
so the flat gradient buffer is written only for gradients they cannot read there (``unreadable_gradient``).
FP8-LM's states (``formats/tensor_scaled.py``: one scale per tensor) take two kernels
(``_step_tensor_scaled``), held to the same reference by tests/test_fp8lm_states.py.
``LaunchShape.approx`` computes the same step with cheaper arithmetic (``_adam_block``), inside the
numerics policy but not bit for bit; Triton's interpreter runs both on CPU tensors
(tests/test_triton_interpreter.py).
"""

import dataclasses
import functools
import os
import re
import weakref

import torch

from flash_inductor import _compat
from flash_inductor.formats import companded, split_weights, tensor_scaled
from flash_inductor.formats.state_tensor import CompandedState, TensorScaledState


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    """How ``step`` launches the kernel: knobs of speed. The stored bytes depend on none of them but
    ``approx`` (``same_bytes_as_default``).

    block_groups: groups of 32 per block (a power of two); num_warps: warps per program.
    vector: the contiguous elements a thread handles at a time along a group (a power of two up to
        32); the tile is ``[block_groups, 32 // vector, vector]``. Triton vectorizes each load by the
        contiguity it can prove (the last dimension) and its element size (16 B: 16 int8 or 8 bf16), so
        with 32 the int8 and bf16 tensors get different register layouts, converted through shared
        memory between them; with 8 every load takes 8 elements per thread, one layout.
    evict: streamed loads marked ``evict_first`` and stores ``.cs`` (each byte is touched once).
    programs_per_sm: 0: one program per block; k > 0: persistent, ``k`` programs per SM, each
        looping over the blocks with ``stages`` software-pipelining stages.
    approx: cheaper arithmetic within issue 13's numerics policy (``_adam_block``'s docstring): the
        codes and masters stored may differ from the exact kernel's by a rounding, within one code of
        the fp64 reference (states) and one error-code step (masters). A knob here, with the launch
        ones, so that one name (``from_name``) picks both and one sweep times them side by side.
    """

    block_groups: int = 64  # the fastest timed on the H200 (64 x 4 warps, before the other knobs)
    num_warps: int = 4
    vector: int = 32
    evict: bool = False
    programs_per_sm: int = 0
    stages: int = 1
    approx: bool = True  # 1.46x faster than the exact arithmetic on the H200, within the policy (docs/benchmarks.md)

    def __post_init__(self):
        powers = {"block_groups": self.block_groups, "num_warps": self.num_warps, "vector": self.vector}
        bad = [k for k, v in powers.items() if v < 1 or v & (v - 1)]
        if bad or self.vector > 32 or self.programs_per_sm < 0 or self.stages < 1:
            raise ValueError(f"{self}: block_groups, num_warps and vector are powers of two (vector <= 32), "
                             "programs_per_sm >= 0, stages >= 1")
        if self.stages > 1 and not self.programs_per_sm:
            raise ValueError(f"{self}: stages pipeline the persistent loop (programs_per_sm > 0)")

    @property
    def name(self):
        """``block{B}_warps{W}``, then the knobs off their defaults:
        ``_vector{V}_evict_persist{K}_stages{S}_approx``."""
        default = LaunchShape()
        parts = [f"block{self.block_groups}", f"warps{self.num_warps}"]
        parts += [f"vector{self.vector}"] if self.vector != default.vector else []
        parts += ["evict"] if self.evict else []
        parts += [f"persist{self.programs_per_sm}"] if self.programs_per_sm else []
        parts += [f"stages{self.stages}"] if self.stages != default.stages else []
        parts += ["approx"] if self.approx else []
        return "_".join(parts)

    @property
    def same_bytes_as_default(self):
        """Whether steps launched so store the default shape's bytes (every knob but ``approx``)."""
        return self.approx == LaunchShape().approx

    @classmethod
    def from_name(cls, name):
        """The shape named by ``_``-separated parts, in any order, each at most once, the others
        default: ``block{B}``, ``warps{W}``, ``vector{V}``, ``evict``, ``persist{K}`` (programs per
        SM), ``stages{S}``, ``approx``; e.g. ``block32_warps2_vector8_evict_persist4_stages2_approx``. A name
        without ``approx`` is the exact arithmetic, whatever the default: names say which arithmetic they
        store (``block64_warps4`` in the results of earlier sessions is the exact one)."""
        fields = {"block": "block_groups", "warps": "num_warps", "vector": "vector", "persist": "programs_per_sm",
                  "stages": "stages"}
        knobs = {}
        for part in name.split("_"):
            match = re.fullmatch(r"(block|warps|vector|persist|stages)(\d+)|evict|approx", part)
            key = match and (part if part in ("evict", "approx") else fields[match[1]])
            if not match or key in knobs:
                raise ValueError(f"launch shape {name!r}: bad or repeated part {part!r} (the parts: block{{B}}, "
                                 "warps{W}, vector{V}, evict, persist{K}, stages{S}, approx, each at most once)")
            knobs[key] = True if key in ("evict", "approx") else int(match[2])
        return cls(**{"approx": False, **knobs})


LAUNCH = LaunchShape()  # what ``step`` launches (benchmarks swap it)
AMAX_SLOTS = 32  # addresses per tensor for the FP8-LM step's amax atomics (_step_tensor_scaled)
# Triton's interpreter (TRITON_INTERPRET=1 before the first import of triton: tests/test_triton_interpreter.py)
# runs the kernel on CPU tensors, in numpy.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if _compat.HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    _INTERPRETED = tl.constexpr(INTERPRETED)  # no libdevice, and numpy has no fused multiply-add
    # the largest group scales (formats/companded.py)
    _SIGNED_SCALE_MAX = tl.constexpr(companded.SCALE_MAX[companded.SIGNED])
    _SQRT_SCALE_MAX = tl.constexpr(companded.SCALE_MAX[companded.SQRT])
    _SCALE_ROUND_UP_MAX = tl.constexpr(companded.SCALE_ROUND_UP_MAX)
    _SCALE_FLOOR = tl.constexpr(companded.SCALE_FLOOR)

    @triton.jit
    def _pow2(k):
        """2.0 ** k for int32 k in [-126, 127], from the exponent bits."""
        return ((k + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _scale_by_pow2(x, k):
        half = k >> 1
        return x * _pow2(half) * _pow2(k - half)

    @triton.jit
    def _half_ulp_log2(hi, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
        biased = (hi.to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF) >> MANTISSA
        return tl.maximum(biased, 1) - (BIAS + MANTISSA + 1)

    @triton.jit
    def _divide(x, y, APPROX: tl.constexpr):
        """``x / y``: Triton's fp32 division, div.full (within 2 ulps; on sm_90 range fix-ups around the
        reciprocal, 8 instructions), or (APPROX) div.approx.ftz: the reciprocal and a product (within
        2 ulps too for |y| < 2**126, subnormal operands and results flushed to zero)."""
        if APPROX and not _INTERPRETED:
            return libdevice.fast_dividef(x, y)
        else:
            return x / y

    @triton.jit
    def _codes_to_float(codes, NEGATE: tl.constexpr, APPROX: tl.constexpr):
        """8-bit integer codes (NEGATE: their negations, 0 giving +0.0) as fp32, exactly. APPROX: not
        by I2F, which like every conversion runs on the unit of MUFU (on sm_90 16 results per clock
        and SM, an eighth of the fp32 rate), but as the low mantissa bits of 1.5 * 2**23 (whose ulp
        is 1), taken out by an fp32 subtraction: an integer add and an fp32 add."""
        if APPROX:
            if NEGATE:
                bits = 0x4B400000 - codes.to(tl.int32)
            else:
                bits = codes.to(tl.int32) + 0x4B400000
            return bits.to(tl.float32, bitcast=True) - 12582912.0
        else:
            if NEGATE:
                codes = -codes
            return codes.to(tl.float32)

    @triton.jit
    def _uint8_times(codes, k):
        """``codes * k`` (uint8 codes) rounded once, without I2F: ``f = 2**23 + code`` from the bits, and
        ``f * k - 2**23 * k`` in one fused multiply-add (``2**23 * k`` is exact)."""
        f = (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        if _INTERPRETED:  # numpy rounds the product before the sum
            return (f - 8388608.0) * k
        else:
            return tl.fma(f, k, -8388608.0 * k)

    @triton.jit
    def _rounded_bits(z):
        """``z`` (|z| < 2**22) rounded to the nearest integer, ties to even, in the low bits of an int32
        whose low byte is then the int8 or uint8 code: 1.5 * 2**23 + z rounds on that binade's integer
        grid (one fp32 add, or fused into the product before it, instead of FRND and F2I)."""
        return (z + 12582912.0).to(tl.int32, bitcast=True)

    @triton.jit
    def _exponent_bits(hi32, BIAS: tl.constexpr):
        """The exponent field, in place, of ``hi32``: a bf16/fp16 ``hi`` as fp32; at least that of the
        format's smallest normal (zero and subnormals have its ulp)."""
        return tl.maximum(hi32.to(tl.int32, bitcast=True) & 0x7F800000, (128 - BIAS) << 23)

    @triton.jit
    def _decoded_error(codes, hi, hi32, GUARD: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                       APPROX: tl.constexpr):
        """What split_weights.decode_for_step subtracts from ``hi`` (``hi32`` as fp32): ``fine = -code / 127``
        (negated: -0.0 stays), codes +-127 pulled in by the guard, times ``hi``'s half ulp
        ``h = 2 ** (e - m - 1)``, exactly. APPROX, exactly the same: ``fine * 2**-(m+1)`` in one
        product, times ``2 ** (e - 127)``, the fp32 holding ``hi32``'s exponent field (inf and nan
        capped, to stay finite): integer masks where the exact kernel builds two powers of two."""
        fine = _codes_to_float(codes, True, APPROX)
        if APPROX:
            half = 2.0 ** -(MANTISSA + 1)  # 2 ** (e - 127) times this is h
            fine = tl.clamp(fine * (half / 127), (-1.0 + GUARD) * half, (1.0 - GUARD) * half)
            return fine * tl.minimum(_exponent_bits(hi32, BIAS), 254 << 23).to(tl.float32, bitcast=True)
        else:
            fine = tl.minimum(tl.maximum(fine * (1.0 / 127), -1.0 + GUARD), 1.0 - GUARD)
            return _scale_by_pow2(fine, _half_ulp_log2(hi, MANTISSA, BIAS))

    @triton.jit
    def _error_code(x, new_hi, CODE_SCALE: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                    APPROX: tl.constexpr):
        """split_weights.store_from_step's int8 code of master ``x`` stored as ``new_hi``: ``rel = (x - hi) / h``
        (0 where non-finite) clamped to [-1, 1], ``floor(rel * CODE_SCALE + 0.5)``. APPROX: ``rel * 2**-m``
        exactly as ``(x - hi) * 2 ** (128 - e)`` (normal for every e in [1, 254]; 0 for inf and nan),
        rounded to nearest even by one fused multiply-add (``_rounded_bits``)."""
        new_hi32 = new_hi.to(tl.float32)
        if APPROX:
            scaled = (x - new_hi32) * (0x7F800000 - _exponent_bits(new_hi32, BIAS)).to(tl.float32, bitcast=True)
            scaled = tl.where(tl.abs(scaled) < float("inf"), scaled, 0.0)  # non-finite masters: code 0
            bound = 2.0**-MANTISSA
            return _rounded_bits(tl.clamp(scaled, -bound, bound) * (CODE_SCALE * 2.0**MANTISSA)).to(tl.int8)
        else:
            rel = _scale_by_pow2(x - new_hi32, -_half_ulp_log2(new_hi, MANTISSA, BIAS))
            rel = tl.where(tl.abs(rel) < float("inf"), rel, 0.0)  # non-finite masters: code 0
            rel = tl.minimum(tl.maximum(rel, -1.0), 1.0)
            return tl.floor(rel * CODE_SCALE + 0.5).to(tl.int8)

    @triton.jit
    def _row_max_bits(values):
        """The max of ``|values|`` over each row (group of 32) of a ``[block, 32 // vector, vector]`` tile, as
        the int32 view of the fp32 result: int32 views of non-negative floats are ordered as the floats, nan
        above inf (a row holding nan gives nan, as ``amax``), so integer maxima and atomics compute float ones."""
        return tl.max(tl.max(tl.abs(values).to(tl.int32, bitcast=True), axis=2), axis=1)

    @triton.jit
    def _group_scale(x, FACTOR: tl.constexpr, SCALE_MAX: tl.constexpr, APPROX: tl.constexpr):
        """bf16 scales of the groups of ``x`` (``[block, 32 // vector, vector]``) and ``FACTOR`` over
        their fp32 values: absmax clamped to [SCALE_FLOOR, SCALE_MAX] and rounded to nearest, or toward
        zero where nearest is more than SCALE_ROUND_UP_MAX above it, nan for a group holding inf or nan
        (formats/companded.py), in one reduction. APPROX: the same scales from the max of the int32
        views of ``|x|`` (ordered as ``|x|``, nan above inf), where the exact kernel compares and
        selects before each max."""
        if APPROX:
            bits = _row_max_bits(x)
            absmax = bits.to(tl.float32, bitcast=True)
            finite = bits < 0x7F800000
        else:
            magnitude = tl.abs(x)
            absmax = tl.max(tl.max(tl.where(magnitude == magnitude, magnitude, float("inf")), axis=2), axis=1)
            finite = absmax != float("inf")
        # from a finite value only (a nan's bits could overflow the integer rounding); nan at the end
        clamped = tl.where(finite, tl.minimum(tl.maximum(absmax, _SCALE_FLOOR), SCALE_MAX), 1.0)
        # rounded as formats/companded.py's ``_rounded``, on the bits; then an exact cast
        clamped_bits = clamped.to(tl.int32, bitcast=True)
        nearest = ((clamped_bits + (0x7FFF + ((clamped_bits >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
        toward_zero = (clamped_bits & -65536).to(tl.float32, bitcast=True)
        scale32 = tl.where(nearest <= clamped * (1 + _SCALE_ROUND_UP_MAX), nearest, toward_zero)
        scale_bf16 = tl.where(finite, scale32, float("nan")).to(tl.bfloat16)
        scale = scale_bf16.to(tl.float32)
        inverse = tl.where(scale > 0, FACTOR / scale, 0.0)  # 0 where the group is nan
        return scale_bf16, inverse[:, None, None]

    @triton.jit
    def _decoded_first_moment(codes, scale, APPROX: tl.constexpr):
        """formats/companded.py's signed decode: ``y / (2 - |y|) * scale`` with ``y = code / 127``;
        APPROX: ``code * scale / (254 - |code|)``, one division."""
        c = _codes_to_float(codes, False, APPROX)
        if APPROX:
            return _divide(c * scale, 254 - tl.abs(c), APPROX)
        else:
            y = c * (1.0 / 127)
            return y / (2 - tl.abs(y)) * scale

    @triton.jit
    def _decoded_root(codes, scale, APPROX: tl.constexpr):
        """formats/companded.py's sqrt decode, before squaring: ``code / 255 * scale``; APPROX: ``code *
        (scale / 255)``, ``scale / 255`` once per group."""
        if APPROX:
            return _uint8_times(codes, scale * (1.0 / 255))
        else:
            return codes.to(tl.float32) * (1.0 / 255) * scale

    @triton.jit
    def _first_moment_codes(m, APPROX: tl.constexpr):
        """formats/companded.py's signed encode of ``m``: the group scales (bf16) and codes
        ``floor(127 * 2u / (1 + |u|) + 0.5)`` of ``u = m / scale``, within [-127, 127]. APPROX: ``254 u``
        from the group's reciprocal times 254, and ``254 u / (1 + |u|)`` rounded by ``_rounded_bits``."""
        if APPROX:
            scale_bf16, inverse = _group_scale(m, 254.0, _SIGNED_SCALE_MAX, APPROX)
            u = tl.clamp(m * inverse, -254.0, 254.0)  # |m| may pass its bf16-rounded (or clamped) scale
            return scale_bf16, _rounded_bits(u * _divide(1.0, 1 + tl.abs(u) * (1.0 / 254), APPROX)).to(tl.int8)
        else:
            scale_bf16, inverse = _group_scale(m, 1.0, _SIGNED_SCALE_MAX, APPROX)
            u = m * inverse
            q = tl.floor(127 * (2 * u / (1 + tl.abs(u))) + 0.5)
            return scale_bf16, tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)

    @triton.jit
    def _root_codes(root, APPROX: tl.constexpr):
        """formats/companded.py's sqrt encode of ``root = sqrt(v)``: the group scales (bf16) and codes
        ``floor(255 u + 0.5)`` of ``u = root / scale``, at least 1 where ``u > 0`` (docs/numerics.md,
        "Second-moment floor"). APPROX: ``255 u`` from the group's reciprocal times 255, rounded by
        ``_rounded_bits``."""
        if APPROX:
            scale_bf16, inverse = _group_scale(root, 255.0, _SQRT_SCALE_MAX, APPROX)
            u = root * inverse
            return scale_bf16, _rounded_bits(tl.where(u > 0, tl.minimum(tl.maximum(u, 1.0), 255.0), 0.0)).to(tl.uint8)
        else:
            scale_bf16, inverse = _group_scale(root, 1.0, _SQRT_SCALE_MAX, APPROX)
            u = root * inverse
            q = tl.where(u > 0, tl.minimum(tl.maximum(tl.floor(255 * u + 0.5), 1.0), 255.0), 0.0)  # code 1 at least
            return scale_bf16, q.to(tl.uint8)

    @triton.jit
    def _load(pointer, mask, other, EVICT: tl.constexpr):
        """A load of data the step reads once (EVICT: the first to leave the cache)."""
        return tl.load(pointer, mask=mask, other=other, eviction_policy="evict_first" if EVICT else "")

    @triton.jit
    def _store(pointer, value, mask, EVICT: tl.constexpr):
        """A store of data the step writes once (EVICT: streamed, ``.cs``)."""
        tl.store(pointer, value, mask=mask, cache_modifier=".cs" if EVICT else "")

    @triton.jit
    def _block_rows(block, num_groups, BLOCK: tl.constexpr):
        """Block ``block``'s groups (rows of 32), and which of them exist."""
        rows = block * BLOCK + tl.arange(0, BLOCK)
        return rows, rows < num_groups

    @triton.jit
    def _row_segments(rows, starts, num_segments, SEARCH_STEPS: tl.constexpr):
        """The segment (tensor) of each row: the last of the increasing ``starts`` (the first 0) at most
        the row, by a binary search of ``SEARCH_STEPS >= log2(num_segments)`` halvings (few loads, all
        rows of a block reading the same few starts from the cache)."""
        segment = tl.zeros_like(rows)
        for i in tl.static_range(SEARCH_STEPS):
            probe = segment + (1 << (SEARCH_STEPS - 1 - i))
            inside = probe < num_segments
            segment = tl.where(inside & (tl.load(starts + probe, mask=inside, other=0) <= rows), probe, segment)
        return segment

    @triton.jit
    def _stepped_rows(rows, row_ok, beta_powers, active, num_groups, lr, PER_GROUP: tl.constexpr, EVICT: tl.constexpr):
        """(which rows to step, the step size ``lr / (1 - beta1 ** step)``, ``1 / sqrt(1 - beta2 ** step)``):
        torch's eager bias corrections (fp32) folded into per-row or per-bucket factors, so that each element
        costs one division."""
        if PER_GROUP:
            power1 = _load(beta_powers + rows, row_ok, 0.0, EVICT).to(tl.float32)[:, None, None]
            power2 = _load(beta_powers + num_groups + rows, row_ok, 0.0, EVICT).to(tl.float32)[:, None, None]
            ok = row_ok & (_load(active + rows, row_ok, 0, EVICT) != 0)
        else:  # one step count for the bucket
            power1 = tl.load(beta_powers).to(tl.float32)
            power2 = tl.load(beta_powers + 1).to(tl.float32)
            ok = row_ok
        return ok, lr / (1 - power1), 1 / tl.sqrt_rn(1 - power2)

    @triton.jit
    def _element_offsets(rows, VECTOR: tl.constexpr):
        """Each element's offset: a group (companded.GROUP_SIZE) as 32 // VECTOR runs of VECTOR contiguous
        elements, a tile ``[block, 32 // VECTOR, VECTOR]``."""
        runs = tl.arange(0, 32 // VECTOR)[None, :, None] * VECTOR
        return rows[:, None, None] * 32 + runs + tl.arange(0, VECTOR)[None, None, :]

    @triton.jit
    def _master(weights, errors, at, mask, HAS_ERRORS: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                GUARD: tl.constexpr, EVICT: tl.constexpr, APPROX: tl.constexpr):
        """The fp32 masters of the elements ``at``: the weights' ``hi`` less their decoded error terms."""
        hi = _load(weights + at, mask, 0.0, EVICT)
        x = hi.to(tl.float32)
        if HAS_ERRORS:
            x -= _decoded_error(_load(errors + at, mask, 0, EVICT), hi, x, GUARD, MANTISSA, BIAS, APPROX)
        return x

    @triton.jit
    def _gradient(weights, grad_addresses, starts, numels, segment, rows, mask, MAXIMIZE: tl.constexpr,
                  EVICT: tl.constexpr, VECTOR: tl.constexpr):
        """The gradient of rows ``rows`` (of segments ``segment``), read where each parameter's gradient
        is: ``grad_addresses[s]`` is the address of segment s's gradient (``unreadable_gradient``: contiguous,
        16-byte aligned, the weights' dtype; 0 for none), ``starts[s]`` its first row and ``numels[s]``
        its elements. The segment's padding and a parameter without gradient read 0, as the zeros of the
        flat buffer did."""
        base = tl.load(grad_addresses + segment)
        local = _element_offsets(rows - tl.load(starts + segment), VECTOR)
        # aligned, so that the loads take 16 bytes at a time as from the flat buffer
        pointers = tl.multiple_of(base.to(tl.pointer_type(weights.dtype.element_ty)), 16)[:, None, None] + local
        # masked in runs of 16 bytes, not per element, which would split every load into 2-byte ones: a
        # gradient read in place is a whole number of runs long, and a view's last run reads its zero padding
        run = 128 // weights.dtype.element_ty.primitive_bitwidth
        runs = (tl.load(numels + segment)[:, None, None] + run - 1) // run
        inside = mask & (local // run < runs) & (base != 0)[:, None, None]
        g = _load(pointers, inside, 0.0, EVICT).to(tl.float32)
        if MAXIMIZE:
            g = -g
        return g

    @triton.jit
    def _adam_moments(x, g, m, v, lr, weight_decay, one_minus_beta1, beta2, one_minus_beta2, DECOUPLED: tl.constexpr):
        """(the masters after AdamW's decay, Adam's moments after this step's gradient, Adam's L2 term in it)."""
        if DECOUPLED:
            x = x * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * x
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        return x, m, v

    @triton.jit
    def _store_update(x, m, root, step_size, inverse_root_correction2, eps, lr, weights, errors, at, mask,
                      HAS_ERRORS: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, CODE_SCALE: tl.constexpr,
                      EVICT: tl.constexpr, APPROX: tl.constexpr):
        """The masters ``x`` after the update of moments ``m`` and ``root = sqrt(v)``, stored as weights and
        error terms."""
        if APPROX:  # the step size over the denominator first: div.approx.ftz would flush a subnormal m
            update = m * _divide(step_size, root * inverse_root_correction2 + eps, APPROX)
        else:
            update = step_size * m / (root * inverse_root_correction2 + eps)
        # a step at lr 0 keeps the weights, also where the update is nan (passes/untouched_parameters.py)
        x = x - tl.where(lr != 0, update, 0.0)
        new_hi = x.to(weights.dtype.element_ty)
        _store(weights + at, new_hi, mask, EVICT)
        if HAS_ERRORS:
            _store(errors + at, _error_code(x, new_hi, CODE_SCALE, MANTISSA, BIAS, APPROX), mask, EVICT)

    @triton.jit
    def _adam_block(
        block, weights, errors, grad_addresses, starts, numels, num_segments, m_codes, m_scales, v_codes, v_scales,
        beta_powers, active, num_groups, lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
        DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_ERRORS: tl.constexpr, PER_GROUP: tl.constexpr,
        MANTISSA: tl.constexpr, BIAS: tl.constexpr, GUARD: tl.constexpr, CODE_SCALE: tl.constexpr,
        BLOCK: tl.constexpr, VECTOR: tl.constexpr, EVICT: tl.constexpr, APPROX: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        """The step of the ``BLOCK`` groups of block ``block``, companded states.

        APPROX: the same step in fewer instructions, within issue 13's numerics policy (states within
        one code of the fp64 reference, masters within one error-code step; docs/numerics.md), most of
        them taken off the unit that runs MUFU and every conversion (I2F, F2I, FRND, F2F: 16 results
        per clock and SM on sm_90, an eighth of the fp32 rate), which the exact kernel keeps busy with
        about 12 operations per element (benchmarks/adam_kernel_sass.py counts them):
        - codes decode without I2F and encode without FRND and F2I (``_codes_to_float``,
          ``_rounded_bits``): rounded to nearest even where the exact kernel floors ``z + 0.5``;
        - divisions are div.approx, the reciprocal and a product, instead of div.full (``_divide``), and
          the first moment decodes in one;
        - the error term's half ulp comes from the exponent field of ``hi`` (``_decoded_error``,
          ``_error_code``: the same values), the group absmax from an integer max (``_group_scale``).
        Codes inside a group whose scale is nan differ (they decode to nan either way).
        """
        rows, row_ok = _block_rows(block, num_groups, BLOCK)
        ok, step_size, inverse_root_correction2 = _stepped_rows(rows, row_ok, beta_powers, active, num_groups, lr,
                                                                PER_GROUP, EVICT)
        at = _element_offsets(rows, VECTOR)
        mask = ok[:, None, None]

        x = _master(weights, errors, at, mask, HAS_ERRORS, MANTISSA, BIAS, GUARD, EVICT, APPROX)
        segment = _row_segments(rows, starts, num_segments, SEARCH_STEPS)
        g = _gradient(weights, grad_addresses, starts, numels, segment, rows, mask, MAXIMIZE, EVICT, VECTOR)
        m = _decoded_first_moment(_load(m_codes + at, mask, 0, EVICT),
                                  _load(m_scales + rows, ok, 0.0, EVICT).to(tl.float32)[:, None, None], APPROX)
        s = _decoded_root(_load(v_codes + at, mask, 0, EVICT),
                          _load(v_scales + rows, ok, 0.0, EVICT).to(tl.float32)[:, None, None], APPROX)
        x, m, v = _adam_moments(x, g, m, s * s, lr, weight_decay, one_minus_beta1, beta2, one_minus_beta2, DECOUPLED)
        root = tl.sqrt(v)  # sqrt.approx.ftz; also the encoded value of the second moment (v >= 0)
        _store_update(x, m, root, step_size, inverse_root_correction2, eps, lr, weights, errors, at, mask, HAS_ERRORS,
                      MANTISSA, BIAS, CODE_SCALE, EVICT, APPROX)

        m_scale_bf16, m_code = _first_moment_codes(m, APPROX)
        _store(m_codes + at, m_code, mask, EVICT)
        _store(m_scales + rows, m_scale_bf16, ok, EVICT)
        v_scale_bf16, v_code = _root_codes(root, APPROX)
        _store(v_codes + at, v_code, mask, EVICT)
        _store(v_scales + rows, v_scale_bf16, ok, EVICT)

    @triton.jit
    def _adam_kernel(
        weights, errors, grad_addresses, starts, numels, num_segments, m_codes, m_scales, v_codes, v_scales,
        beta_powers, active, num_groups, lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
        DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_ERRORS: tl.constexpr, PER_GROUP: tl.constexpr,
        MANTISSA: tl.constexpr, BIAS: tl.constexpr, GUARD: tl.constexpr, CODE_SCALE: tl.constexpr,
        BLOCK: tl.constexpr, VECTOR: tl.constexpr, EVICT: tl.constexpr, PERSISTENT: tl.constexpr, STAGES: tl.constexpr,
        APPROX: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        """The step of block ``program_id``, or (PERSISTENT) of every ``num_programs``-th block from it."""
        if PERSISTENT:
            for block in tl.range(tl.program_id(0), tl.cdiv(num_groups, BLOCK), tl.num_programs(0), num_stages=STAGES):
                _adam_block(
                    block, weights, errors, grad_addresses, starts, numels, num_segments, m_codes, m_scales, v_codes,
                    v_scales, beta_powers, active, num_groups, lr, one_minus_beta1, beta2, one_minus_beta2, eps,
                    weight_decay, DECOUPLED, MAXIMIZE, HAS_ERRORS, PER_GROUP, MANTISSA, BIAS, GUARD, CODE_SCALE, BLOCK,
                    VECTOR, EVICT, APPROX, SEARCH_STEPS)
        else:
            _adam_block(
                tl.program_id(0), weights, errors, grad_addresses, starts, numels, num_segments, m_codes, m_scales,
                v_codes, v_scales, beta_powers, active, num_groups, lr, one_minus_beta1, beta2, one_minus_beta2, eps,
                weight_decay, DECOUPLED, MAXIMIZE, HAS_ERRORS, PER_GROUP, MANTISSA, BIAS, GUARD, CODE_SCALE, BLOCK,
                VECTOR, EVICT, APPROX, SEARCH_STEPS)

    # ----------------------------------------------------------------- FP8-LM's states (tensor-scaled)

    @triton.jit
    def _tensor_scaled_moments(x, g, m_codes, m_scales, v_codes, v_scales, segment, at, mask, lr, weight_decay,
                               one_minus_beta1, beta2, one_minus_beta2, DECOUPLED: tl.constexpr, EVICT: tl.constexpr):
        """``_adam_moments`` from FP8-LM's codes and the rows' segments' scales (formats/tensor_scaled.py's
        decode: ``code * (1 / scale)``, exact for a power of two), the same bits in both kernels."""
        m_inverse = tl.div_rn(1.0, tl.load(m_scales + segment))[:, None, None]
        v_inverse = tl.div_rn(1.0, tl.load(v_scales + segment))[:, None, None]
        m = _load(m_codes + at, mask, 0.0, EVICT).to(tl.float32) * m_inverse
        v = _load(v_codes + at, mask, 0.0, EVICT).to(tl.float32) * v_inverse
        return _adam_moments(x, g, m, v, lr, weight_decay, one_minus_beta1, beta2, one_minus_beta2, DECOUPLED)

    @triton.jit
    def _segment_atomic_max(amax, bits, segment, ok):
        """``amax[segment] = max(amax[segment], bits)`` for the block's rows ``ok``, in few atomics: one for
        the rows of the block's first tensor, one for its last one's if it is another, one per row of the
        tensors wholly inside the block (small ones), so that a tensor of many rows takes one atomic per
        block, not per row. ``amax`` is this program's slot (``_step_tensor_scaled``)."""
        first = tl.min(tl.where(ok, segment, 2**30))
        last = tl.max(tl.where(ok, segment, -1))
        tl.atomic_max(amax + first, tl.max(tl.where(ok & (segment == first), bits, 0)))
        tl.atomic_max(amax + last, tl.max(tl.where(ok & (segment == last), bits, 0)), mask=last != first)
        tl.atomic_max(amax + segment, bits, mask=ok & (segment != first) & (segment != last))

    @triton.jit
    def _fp8lm_amax_kernel(
        weights, errors, grad_addresses, numels, m_codes, m_scales, v_codes, v_scales, starts, num_segments, amax,
        num_groups, one_minus_beta1, beta2, one_minus_beta2, weight_decay,
        DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_ERRORS: tl.constexpr,
        MANTISSA: tl.constexpr, BIAS: tl.constexpr, GUARD: tl.constexpr,
        BLOCK: tl.constexpr, VECTOR: tl.constexpr, EVICT: tl.constexpr, APPROX: tl.constexpr, SEARCH_STEPS: tl.constexpr,
        SLOTS: tl.constexpr,
    ):
        """First pass of the FP8-LM step: each tensor's max of ``|m|`` and of ``v`` after this step's
        gradient (``amax`` [2, SLOTS, S], int32 views of fp32, zeroed before; program p writes slot
        p % SLOTS), which its new scales come from. Reads the gradients and the codes (and for Adam's L2
        term the masters). Parameters without a gradient keep their scales (``_step_tensor_scaled``),
        whatever their rows give here."""
        rows, ok = _block_rows(tl.program_id(0), num_groups, BLOCK)
        at = _element_offsets(rows, VECTOR)
        mask = ok[:, None, None]
        segment = _row_segments(rows, starts, num_segments, SEARCH_STEPS)
        if DECOUPLED:
            x = 0.0
        else:
            x = _master(weights, errors, at, mask, HAS_ERRORS, MANTISSA, BIAS, GUARD, EVICT, APPROX)
        g = _gradient(weights, grad_addresses, starts, numels, segment, rows, mask, MAXIMIZE, EVICT, VECTOR)
        _, m, v = _tensor_scaled_moments(x, g, m_codes, m_scales, v_codes, v_scales, segment, at, mask, 0.0, weight_decay,
                                         one_minus_beta1, beta2, one_minus_beta2, DECOUPLED, EVICT)
        slot = amax + (tl.program_id(0) % SLOTS) * num_segments
        _segment_atomic_max(slot, _row_max_bits(m), segment, ok)
        _segment_atomic_max(slot + SLOTS * num_segments, _row_max_bits(v), segment, ok)

    @triton.jit
    def _fp8lm_step_kernel(
        weights, errors, grad_addresses, numels, m_codes, m_scales, v_codes, v_scales, starts, num_segments, new_scales,
        beta_powers, active, num_groups, lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
        DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_ERRORS: tl.constexpr, PER_GROUP: tl.constexpr,
        MANTISSA: tl.constexpr, BIAS: tl.constexpr, GUARD: tl.constexpr, CODE_SCALE: tl.constexpr,
        BLOCK: tl.constexpr, VECTOR: tl.constexpr, EVICT: tl.constexpr, APPROX: tl.constexpr, SEARCH_STEPS: tl.constexpr,
        M_MAX: tl.constexpr, V_MAX: tl.constexpr, V_SMALLEST: tl.constexpr,
    ):
        """Second pass: the same moments again (recomputed, not stored in fp32 between the passes), the
        update of the masters, and the moments encoded against the new scales (``new_scales`` [2, S]):
        formats/tensor_scaled.py's ``_codes``, the second moment's floor included."""
        rows, row_ok = _block_rows(tl.program_id(0), num_groups, BLOCK)
        ok, step_size, inverse_root_correction2 = _stepped_rows(rows, row_ok, beta_powers, active, num_groups, lr,
                                                                PER_GROUP, EVICT)
        at = _element_offsets(rows, VECTOR)
        mask = ok[:, None, None]
        segment = _row_segments(rows, starts, num_segments, SEARCH_STEPS)
        x = _master(weights, errors, at, mask, HAS_ERRORS, MANTISSA, BIAS, GUARD, EVICT, APPROX)
        g = _gradient(weights, grad_addresses, starts, numels, segment, rows, mask, MAXIMIZE, EVICT, VECTOR)
        x, m, v = _tensor_scaled_moments(x, g, m_codes, m_scales, v_codes, v_scales, segment, at, mask, lr, weight_decay,
                                         one_minus_beta1, beta2, one_minus_beta2, DECOUPLED, EVICT)
        _store_update(x, m, tl.sqrt_rn(v), step_size, inverse_root_correction2, eps, lr, weights, errors, at, mask,
                      HAS_ERRORS, MANTISSA, BIAS, CODE_SCALE, EVICT, APPROX)
        m_scaled = m * tl.load(new_scales + segment)[:, None, None]  # exact: powers of two
        _store(m_codes + at, tl.clamp(m_scaled, -M_MAX, M_MAX).to(m_codes.dtype.element_ty), mask, EVICT)
        v_scaled = tl.minimum(v * tl.load(new_scales + num_segments + segment)[:, None, None], V_MAX)
        v_scaled = tl.where((v > 0) & (v_scaled <= V_SMALLEST / 2), V_SMALLEST, v_scaled)  # the floor
        _store(v_codes + at, v_scaled.to(v_codes.dtype.element_ty), mask, EVICT)


def ineligible(bucket, optimizer):
    """Why this kernel cannot step ``bucket`` (whose bucket optimizer is ``optimizer``), or None."""
    group = optimizer.param_groups[0]
    states = bucket.states
    if not _compat.HAS_TRITON:
        return "Triton is not installed"
    if bucket.weights.device.type != "cuda" and not INTERPRETED:
        return "not on a CUDA device"
    if not isinstance(optimizer, torch.optim.Adam):
        return f"{type(optimizer).__name__} has no hand-written kernel"
    if bucket.fp8_grads is not None:
        return "FP8 gradients (gradient_format): Inductor's kernel fuses their decode into the update"
    if group.get("amsgrad") or group.get("differentiable"):
        return "amsgrad/differentiable"
    if bucket.weights.dtype not in split_weights.SPLIT_DTYPES:
        return f"{bucket.weights.dtype} weights"
    if bucket.errors is not None and bucket.errors.dtype != torch.int8:
        return "32-bit masters (int16 error terms) use the exact split-weight pair"
    formats = {type(s) for s in states.values()}
    if set(states) != {"exp_avg", "exp_avg_sq"} or not (formats == {CompandedState} or formats == {TensorScaledState}):
        return "fp32 states"
    if any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in (group["lr"], *group["betas"])):
        return "a hyperparameter tensor on the GPU (read here as a float)"
    return None


def step(bucket, optimizer):
    """One Adam/AdamW step of ``bucket`` (``ineligible`` said None), in place: the step counts of its
    active groups advance, ``beta ** step`` of their bias corrections is computed in fp64 from the
    fp32 betas and rounded to fp32 once, as Inductor's step takes it (passes/fp64_step_powers.py; an
    fp32 pow is not correctly rounded everywhere: libdevice's inside the kernel was an ulp off for
    0.999 ** 1 on the H200, 3e-5 of the first updates; the kernel rounds them), then one kernel updates
    weights, error terms and states (companded states: three launches), or two with FP8-LM's
    (``_step_tensor_scaled``)."""
    group = optimizer.param_groups[0]
    lr, (beta1, beta2) = float(group["lr"]), (float(b) for b in group["betas"])
    bucket.step.add_(bucket.active)
    beta_powers = torch.pow(_device_betas(beta1, beta2, bucket.step.device), bucket.step)  # fp64: the kernel rounds
    m, v = bucket.states["exp_avg"], bucket.states["exp_avg_sq"]
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    shape = LAUNCH
    constants = kernel_constants(shape, bucket.weights.dtype, bucket.errors is not None, bucket.per_group,
                                 bool(decoupled), bool(group.get("maximize")))
    tensors = dict(weights=bucket.weights, errors=bucket.errors if bucket.errors is not None else bucket.weights,
                   m_codes=m.codes, m_scales=m.scales, v_codes=v.codes, v_scales=v.scales, **_gradients(bucket))
    hyper = (1 - beta1, beta2, 1 - beta2)
    eps, weight_decay = float(group["eps"]), float(group["weight_decay"])
    if isinstance(m, TensorScaledState):
        _step_tensor_scaled(bucket, tensors, m, v, beta_powers, lr, hyper, eps, weight_decay, constants)
        return
    blocks = triton.cdiv(bucket.num_groups, shape.block_groups)
    programs = min(blocks, shape.programs_per_sm * _sm_count(bucket.weights.device)) if shape.programs_per_sm else blocks
    _adam_kernel[(programs,)](
        **tensors, beta_powers=beta_powers, active=bucket.active, num_groups=bucket.num_groups, lr=lr,
        one_minus_beta1=hyper[0], beta2=hyper[1], one_minus_beta2=hyper[2], eps=eps, weight_decay=weight_decay,
        **constants, num_warps=shape.num_warps)


def unreadable_gradient(grad, view):
    """Why the kernel cannot read ``grad``, a parameter's gradient whose view of the flat buffer is
    ``view``, where it is (``_gradient``), or None: it must be dense and contiguous, 16-byte aligned
    and a whole number of 16 bytes long (its loads take 16 bytes at a time), of the view's dtype,
    shape and device. ``flat.collect_gradients`` copies the others into the flat buffer, where under
    ``@train_step`` every gradient was copied before (a foreach copy of 4 B/param, and the gradients
    held twice at the step: docs/architecture.md)."""
    if grad.layout != torch.strided or (grad.dtype, grad.shape, grad.device) != (view.dtype, view.shape, view.device):
        return f"{grad.dtype}{list(grad.shape)} on {grad.device}, not as its parameter"
    if not grad.is_contiguous():
        return f"not contiguous: strides {list(grad.stride())}"
    if grad.data_ptr() % 16 or grad.numel() * grad.element_size() % 16:
        return "not 16-byte aligned, or not a whole number of 16 bytes long"
    return None


_ADDRESSES = weakref.WeakKeyDictionary()  # bucket -> (its gradients' addresses, as a tuple and on its device)


def _gradients(bucket):
    """The kernels' arguments that locate each parameter's gradient (``_gradient``): the address of its
    ``.grad`` (0 for none), its segment's first row and its length. Unchanged addresses (CUDA graphs'
    outputs, or the caching allocator's usual reuse) are not copied to the device again."""
    addresses = tuple(0 if p.grad is None else p.grad.data_ptr() for p in bucket.params)
    cached = _ADDRESSES.get(bucket)
    if cached is None or cached[0] != addresses:
        device = bucket.segment_starts.device
        host = torch.tensor(addresses, dtype=torch.int64, pin_memory=device.type == "cuda")
        cached = _ADDRESSES[bucket] = addresses, host.to(device, non_blocking=True)
    count = len(addresses)
    return dict(grad_addresses=cached[1], starts=bucket.segment_starts, numels=bucket.segment_numels,
                num_segments=count, SEARCH_STEPS=max(1, (count - 1).bit_length()))


def _step_tensor_scaled(bucket, tensors, m, v, beta_powers, lr, hyper, eps, weight_decay, constants):
    """The step with FP8-LM's states (formats/tensor_scaled.py), whose new codes need the new per-tensor
    scales, so the amax of every tensor's new moments first: a first kernel reduces them per tensor
    (``_segment_atomic_max``: integer atomics, about one per block), and a second kernel recomputes the
    moments, updates the masters and encodes. Each tensor's maxima are spread over ``AMAX_SLOTS``
    addresses, reduced here: atomics on one address serialize, and a tensor spans thousands of blocks.
    Recomputing reads 5 B/param more (gradient and codes)
    where keeping the fp32 moments between the passes would write and read 16. Tensors of parameters
    without a gradient keep their scales, and their rows are not written. Launched one block per
    program (``LaunchShape``'s block, warps, vector, evict and approx; not persistent)."""
    shape, starts = LAUNCH, bucket.segment_starts  # FP8-LM's tensors are the bucket's segments
    blocks = triton.cdiv(bucket.num_groups, shape.block_groups)
    slots = torch.zeros(2, AMAX_SLOTS, starts.numel(), dtype=torch.int32, device=starts.device)
    _fp8lm_amax_kernel[(blocks,)](
        **tensors, amax=slots, num_groups=bucket.num_groups, one_minus_beta1=hyper[0], beta2=hyper[1],
        one_minus_beta2=hyper[2], weight_decay=weight_decay, **_arguments_of(_fp8lm_amax_kernel, constants),
        SLOTS=AMAX_SLOTS, num_warps=shape.num_warps)
    amax = slots.amax(1).view(torch.float32)
    new_scales = torch.stack([tensor_scaled.scale_from_amax(amax[i], state.codes.dtype) for i, state in enumerate((m, v))])
    if bucket.per_group:
        new_scales = torch.where(bucket.active.view(-1)[starts], new_scales, torch.stack([m.scales, v.scales]))
    _fp8lm_step_kernel[(blocks,)](
        **tensors, new_scales=new_scales, beta_powers=beta_powers, active=bucket.active, num_groups=bucket.num_groups,
        lr=lr, one_minus_beta1=hyper[0], beta2=hyper[1], one_minus_beta2=hyper[2], eps=eps, weight_decay=weight_decay,
        **_arguments_of(_fp8lm_step_kernel, constants), M_MAX=tensor_scaled.code_max(m.codes.dtype),
        V_MAX=tensor_scaled.code_max(v.codes.dtype), V_SMALLEST=tensor_scaled.smallest_code(v.codes.dtype),
        num_warps=shape.num_warps)
    m.scales.copy_(new_scales[0])
    v.scales.copy_(new_scales[1])


def _arguments_of(kernel, constants):
    """The ones of ``kernel_constants`` that ``kernel`` takes."""
    return {k: value for k, value in constants.items() if k in kernel.arg_names}


def kernel_constants(shape, weights_dtype, has_errors, per_group, decoupled, maximize):
    """``_adam_kernel``'s compile-time arguments for ``shape`` and a bucket of ``weights_dtype`` weights
    (with int8 error terms or none), with per-group step counts or one, an AdamW (``decoupled``) or Adam
    step (also benchmarks/adam_kernel_sass.py's)."""
    mantissa, bias = split_weights.mantissa_bits_and_bias(weights_dtype)
    return dict(DECOUPLED=decoupled, MAXIMIZE=maximize, HAS_ERRORS=has_errors, PER_GROUP=per_group, MANTISSA=mantissa,
                BIAS=bias, GUARD=split_weights.step_guard(weights_dtype), CODE_SCALE=split_weights.STEP_CODE_SCALE,
                BLOCK=shape.block_groups, VECTOR=shape.vector, EVICT=shape.evict, PERSISTENT=shape.programs_per_sm > 0,
                STAGES=shape.stages, APPROX=shape.approx)


@functools.cache
def _sm_count(device):
    """The number of SMs of the CUDA ``device`` (persistent launches: programs per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=64)
def _device_betas(beta1, beta2, device):
    """``[[[beta1]], [[beta2]]]`` rounded to fp32 (as torch takes a float beta against the fp32 step),
    held in fp64 on ``device``, made once per value (not a copy every step)."""
    return torch.tensor([beta1, beta2], dtype=torch.float32).double().to(device).view(2, 1, 1)
