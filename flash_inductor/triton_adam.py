"""A hand-written Triton kernel for the flat Adam/AdamW step on CUDA (issue 13).

Inductor's kernel for the traced stock update (``flat.step_buckets``) stays the reference and the
path for every other case: the CPU, other optimizers, amsgrad, fp32 or FP8-LM states, FP8 gradients, or
32-bit masters. On the H200 this kernel is faster (docs/benchmarks.md, "The flat optimizer step"): it processes
blocks of groups of 32 (``LaunchShape``: how many, on how many warps, ...) with few registers, where
Inductor's persistent reductions over the two state scales keep more values live.

The math is the stock capturable Adam(W) update on the decoded fp32 values, with the storage formats
of ``formats/split_weights.py`` (the step's plain pair, int8 error terms) and
``formats/companded.py`` (signed and sqrt codes, fp16 group scales, one reciprocal per group),
written once more in Triton; ``tests/test_gpu.py`` holds it to the fp64 reference and to the
Inductor step. Groups whose parameter has no gradient (``bucket.active``) are not written.
"""

import dataclasses
import functools
import re

import torch

from flash_inductor import _compat
from flash_inductor.formats import split_weights
from flash_inductor.formats.state_tensor import CompandedState, TensorScaledState


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    """How ``step`` launches the kernel: knobs of speed only, the stored bytes do not depend on them.

    block_groups: groups of 32 per block (a power of two); num_warps: warps per program.
    vector: the contiguous elements a thread handles at a time along a group (a power of two up to
        32); the tile is ``[block_groups, 32 // vector, vector]``. Triton vectorizes each load by the
        contiguity it can prove (the last dimension) and its element size (16 B: 16 int8 or 8 bf16), so
        with 32 the int8 and bf16 tensors get different register layouts, converted through shared
        memory between them; with 8 every load takes 8 elements per thread, one layout.
    evict: streamed loads marked ``evict_first`` and stores ``.cs`` (each byte is touched once).
    programs_per_sm: 0: one program per block; k > 0: persistent, ``k`` programs per SM, each
        looping over the blocks with ``stages`` software-pipelining stages.
    """

    block_groups: int = 64  # the fastest timed on the H200 (64 x 4 warps, before the other knobs)
    num_warps: int = 4
    vector: int = 32
    evict: bool = False
    programs_per_sm: int = 0
    stages: int = 1

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
        """``block{B}_warps{W}``, then the knobs off their defaults: ``_vector{V}_evict_persist{K}_stages{S}``."""
        default = LaunchShape()
        parts = [f"block{self.block_groups}", f"warps{self.num_warps}"]
        parts += [f"vector{self.vector}"] if self.vector != default.vector else []
        parts += ["evict"] if self.evict else []
        parts += [f"persist{self.programs_per_sm}"] if self.programs_per_sm else []
        parts += [f"stages{self.stages}"] if self.stages != default.stages else []
        return "_".join(parts)

    @classmethod
    def from_name(cls, name):
        """The shape named by ``_``-separated parts, in any order, each at most once, the others
        default: ``block{B}``, ``warps{W}``, ``vector{V}``, ``evict``, ``persist{K}`` (programs per
        SM), ``stages{S}``; e.g. ``block32_warps2_vector8_evict_persist4_stages2``."""
        fields = {"block": "block_groups", "warps": "num_warps", "vector": "vector", "persist": "programs_per_sm",
                  "stages": "stages"}
        knobs = {}
        for part in name.split("_"):
            match = re.fullmatch(r"(block|warps|vector|persist|stages)(\d+)|evict", part)
            key = match and ("evict" if part == "evict" else fields[match[1]])
            if not match or key in knobs:
                raise ValueError(f"launch shape {name!r}: bad or repeated part {part!r} (the parts: block{{B}}, "
                                 "warps{W}, vector{V}, evict, persist{K}, stages{S}, each at most once)")
            knobs[key] = True if key == "evict" else int(match[2])
        return cls(**knobs)


LAUNCH = LaunchShape()  # what ``step`` launches (benchmarks swap it)

if _compat.HAS_TRITON:
    import triton
    import triton.language as tl

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
    def _group_scale(x):
        """fp16 scales of the groups of ``x`` (``[block, 32 // vector, vector]``) and the reciprocals of
        their fp32 values: absmax clamped to [1e-12, 65504], nan for a group holding inf or nan
        (formats/companded.py), in one reduction."""
        magnitude = tl.abs(x)
        absmax = tl.max(tl.max(tl.where(magnitude == magnitude, magnitude, float("inf")), axis=2), axis=1)
        scale16 = tl.where(absmax == float("inf"), float("nan"), tl.minimum(tl.maximum(absmax, 1e-12), 65504.0))
        scale16 = scale16.to(tl.float16)
        scale = scale16.to(tl.float32)
        inverse = tl.where(scale > 0, 1.0 / scale, 0.0)  # 0 where fp16 underflowed or the group is nan
        return scale16, inverse[:, None, None]

    @triton.jit
    def _load(pointer, mask, other, EVICT: tl.constexpr):
        """A load of data the step reads once (EVICT: the first to leave the cache)."""
        return tl.load(pointer, mask=mask, other=other, eviction_policy="evict_first" if EVICT else "")

    @triton.jit
    def _store(pointer, value, mask, EVICT: tl.constexpr):
        """A store of data the step writes once (EVICT: streamed, ``.cs``)."""
        tl.store(pointer, value, mask=mask, cache_modifier=".cs" if EVICT else "")

    @triton.jit
    def _adam_block(
        block, weights, errors, grads, m_codes, m_scales, v_codes, v_scales, beta_powers, active,
        num_groups, lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
        DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_ERRORS: tl.constexpr, PER_GROUP: tl.constexpr,
        MANTISSA: tl.constexpr, BIAS: tl.constexpr, GUARD: tl.constexpr, CODE_SCALE: tl.constexpr,
        BLOCK: tl.constexpr, VECTOR: tl.constexpr, EVICT: tl.constexpr,
    ):
        """The step of the ``BLOCK`` groups of block ``block``."""
        rows = block * BLOCK + tl.arange(0, BLOCK)
        row_ok = rows < num_groups
        # bias corrections 1 - beta ** step (fp32, as torch's eager Adam) folded into per-row or per-bucket
        # factors, so that each element costs one division
        if PER_GROUP:
            power1 = _load(beta_powers + rows, row_ok, 0.0, EVICT).to(tl.float32)[:, None, None]
            power2 = _load(beta_powers + num_groups + rows, row_ok, 0.0, EVICT).to(tl.float32)[:, None, None]
            ok = row_ok & (_load(active + rows, row_ok, 0, EVICT) != 0)
        else:  # one step count for the bucket
            power1 = tl.load(beta_powers).to(tl.float32)
            power2 = tl.load(beta_powers + 1).to(tl.float32)
            ok = row_ok
        step_size = lr / (1 - power1)
        inverse_root_correction2 = 1 / tl.sqrt_rn(1 - power2)
        # a group (companded.GROUP_SIZE) as 32 // VECTOR runs of VECTOR contiguous elements
        runs = tl.arange(0, 32 // VECTOR)[None, :, None] * VECTOR
        at = rows[:, None, None] * 32 + runs + tl.arange(0, VECTOR)[None, None, :]
        mask = ok[:, None, None]

        hi = _load(weights + at, mask, 0.0, EVICT)
        x = hi.to(tl.float32)
        if HAS_ERRORS:
            # split_weights.decode_for_step: negated (-0.0 stays), codes +-127 pulled in by the guard
            fine = (-_load(errors + at, mask, 0, EVICT)).to(tl.float32) * (1.0 / 127)
            fine = tl.minimum(tl.maximum(fine, -1.0 + GUARD), 1.0 - GUARD)
            x -= _scale_by_pow2(fine, _half_ulp_log2(hi, MANTISSA, BIAS))
        g = _load(grads + at, mask, 0.0, EVICT).to(tl.float32)
        if MAXIMIZE:
            g = -g
        y = _load(m_codes + at, mask, 0, EVICT).to(tl.float32) * (1.0 / 127)
        m = y / (2 - tl.abs(y)) * _load(m_scales + rows, ok, 0.0, EVICT).to(tl.float32)[:, None, None]
        s = _load(v_codes + at, mask, 0, EVICT).to(tl.float32) * (1.0 / 255)
        s = s * _load(v_scales + rows, ok, 0.0, EVICT).to(tl.float32)[:, None, None]
        v = s * s

        if DECOUPLED:
            x = x * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * x
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        root = tl.sqrt(v)  # also the encoded value of the second moment (v >= 0)
        # a step at lr 0 keeps the weights, also where the update is nan (passes/untouched_parameters.py)
        x = x - tl.where(lr != 0, step_size * m / (root * inverse_root_correction2 + eps), 0.0)

        new_hi = x.to(weights.dtype.element_ty)
        _store(weights + at, new_hi, mask, EVICT)
        if HAS_ERRORS:
            rel = _scale_by_pow2(x - new_hi.to(tl.float32), -_half_ulp_log2(new_hi, MANTISSA, BIAS))
            rel = tl.where(tl.abs(rel) < float("inf"), rel, 0.0)  # non-finite masters: code 0
            rel = tl.minimum(tl.maximum(rel, -1.0), 1.0)
            _store(errors + at, tl.floor(rel * CODE_SCALE + 0.5).to(tl.int8), mask, EVICT)

        m_scale16, m_inverse = _group_scale(m)
        u = m * m_inverse
        q = tl.floor(127 * (2 * u / (1 + tl.abs(u))) + 0.5)
        _store(m_codes + at, tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8), mask, EVICT)
        _store(m_scales + rows, m_scale16, ok, EVICT)
        v_scale16, v_inverse = _group_scale(root)
        u = root * v_inverse
        q = tl.where(u > 0, tl.minimum(tl.maximum(tl.floor(255 * u + 0.5), 1.0), 255.0), 0.0)  # code 1 at least
        _store(v_codes + at, q.to(tl.uint8), mask, EVICT)
        _store(v_scales + rows, v_scale16, ok, EVICT)

    @triton.jit
    def _adam_kernel(
        weights, errors, grads, m_codes, m_scales, v_codes, v_scales, beta_powers, active,
        num_groups, lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
        DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_ERRORS: tl.constexpr, PER_GROUP: tl.constexpr,
        MANTISSA: tl.constexpr, BIAS: tl.constexpr, GUARD: tl.constexpr, CODE_SCALE: tl.constexpr,
        BLOCK: tl.constexpr, VECTOR: tl.constexpr, EVICT: tl.constexpr, PERSISTENT: tl.constexpr, STAGES: tl.constexpr,
    ):
        """The step of block ``program_id``, or (PERSISTENT) of every ``num_programs``-th block from it."""
        if PERSISTENT:
            for block in tl.range(tl.program_id(0), tl.cdiv(num_groups, BLOCK), tl.num_programs(0), num_stages=STAGES):
                _adam_block(
                    block, weights, errors, grads, m_codes, m_scales, v_codes, v_scales, beta_powers, active,
                    num_groups, lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                    DECOUPLED, MAXIMIZE, HAS_ERRORS, PER_GROUP, MANTISSA, BIAS, GUARD, CODE_SCALE, BLOCK, VECTOR, EVICT)
        else:
            _adam_block(
                tl.program_id(0), weights, errors, grads, m_codes, m_scales, v_codes, v_scales, beta_powers, active,
                num_groups, lr, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                DECOUPLED, MAXIMIZE, HAS_ERRORS, PER_GROUP, MANTISSA, BIAS, GUARD, CODE_SCALE, BLOCK, VECTOR, EVICT)


def ineligible(bucket, optimizer):
    """Why this kernel cannot step ``bucket`` (whose bucket optimizer is ``optimizer``), or None."""
    group = optimizer.param_groups[0]
    states = bucket.states
    if not _compat.HAS_TRITON:
        return "Triton is not installed"
    if bucket.weights.device.type != "cuda":
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
    if any(isinstance(s, TensorScaledState) for s in states.values()):
        return "FP8-LM states (state_format='fp8lm'): their per-tensor scales need a reduction over each parameter"
    if set(states) != {"exp_avg", "exp_avg_sq"} or not all(isinstance(s, CompandedState) for s in states.values()):
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
    weights, error terms and states: three launches."""
    group = optimizer.param_groups[0]
    lr, (beta1, beta2) = float(group["lr"]), (float(b) for b in group["betas"])
    bucket.step.add_(bucket.active)
    beta_powers = torch.pow(_device_betas(beta1, beta2, bucket.step.device), bucket.step)  # fp64: the kernel rounds
    m, v = bucket.states["exp_avg"], bucket.states["exp_avg_sq"]
    mantissa, bias = split_weights.mantissa_bits_and_bias(bucket.weights.dtype)
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    shape = LAUNCH
    blocks = triton.cdiv(bucket.num_groups, shape.block_groups)
    programs = min(blocks, shape.programs_per_sm * _sm_count(bucket.weights.device)) if shape.programs_per_sm else blocks
    _adam_kernel[(programs,)](
        bucket.weights, bucket.errors if bucket.errors is not None else bucket.weights, bucket.grads,
        m.codes, m.scales, v.codes, v.scales, beta_powers, bucket.active,
        bucket.num_groups, lr, 1 - beta1, beta2, 1 - beta2,
        float(group["eps"]), float(group["weight_decay"]),
        DECOUPLED=bool(decoupled), MAXIMIZE=bool(group.get("maximize")), HAS_ERRORS=bucket.errors is not None,
        PER_GROUP=bucket.per_group, MANTISSA=mantissa, BIAS=bias, GUARD=split_weights.step_guard(bucket.weights.dtype),
        CODE_SCALE=split_weights.STEP_CODE_SCALE, BLOCK=shape.block_groups, VECTOR=shape.vector, EVICT=shape.evict,
        PERSISTENT=shape.programs_per_sm > 0, STAGES=shape.stages, num_warps=shape.num_warps,
    )


@functools.cache
def _sm_count(device):
    """The number of SMs of the CUDA ``device`` (persistent launches: programs per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=64)
def _device_betas(beta1, beta2, device):
    """``[[[beta1]], [[beta2]]]`` rounded to fp32 (as torch takes a float beta against the fp32 step),
    held in fp64 on ``device``, made once per value (not a copy every step)."""
    return torch.tensor([beta1, beta2], dtype=torch.float32).double().to(device).view(2, 1, 1)
