"""The record ``prepare`` keeps of a prepared optimizer, and the stored form of its states.

``roles.PREPARED`` maps each prepared optimizer (and each bucket or local optimizer its step runs)
to a ``PreparedOptimizer``. ``init_state`` / ``new_state`` give a parameter its states in stored
form (``prepare``, ``add_param_group``, checkpoint loads); ``make_lr_tensor`` makes a group's lr a
tensor.
"""

import dataclasses
import weakref

import torch

from flash_inductor import registry, roles, sharded
from flash_inductor.formats import companded
from flash_inductor.formats.state_tensor import QUANTIZED, STATE_FORMATS, Fp32State, StateTensor


@dataclasses.dataclass(eq=False)
class PreparedOptimizer:
    """What ``prepare`` added to an optimizer: error terms and the settings it was prepared with."""

    optimizer_ref: weakref.ReferenceType
    master_weight_bits: int | None
    state_bits: int | None
    min_quantized_numel: int
    compressed_state_dict: bool
    check_numerics: bool
    error_terms: dict = dataclasses.field(default_factory=dict)  # param -> error term
    param_names: dict = dataclasses.field(default_factory=dict)  # param -> name
    # param -> the address of its view of its bucket's flat weights, which its .data must stay
    weight_addresses: dict = dataclasses.field(default_factory=dict)
    gradient_release: object = None  # a gradient_release.GradientRelease when prepared with it
    compile_options: dict = dataclasses.field(default_factory=dict)  # how its step is compiled
    buckets: list = dataclasses.field(default_factory=list)  # flat.Bucket, when its step is flat
    active_groups: object = None  # of a bucket optimizer: its Bucket.active mask
    bound_hyperparameter: object = None  # of a bucket optimizer: its Bucket.bound (flat.BoundHyperparameter)
    fp8_gradients: object = None  # of a bucket optimizer: its Bucket.fp8_grads (passes/fp8_gradients.py)
    state_format: str = "companded"  # how quantized states are stored: a name in STATE_FORMATS
    gradient_format: str | None = None  # FP8 gradients of quantized buckets: a name in tensor_scaled.GRADIENT_FORMATS
    internal: bool = False  # an optimizer a prepared step runs (bucket, local, gradient release), not the user's
    # Gradients stay autograd's own tensors until the step, which copies them into the flat buffers
    # at once (a whole-step graph's backward: flat.land_gradients_at_step).
    gradients_land_at_step: bool = False
    bucket_numel: int | None = None  # at most this many elements per flat bucket (prepare's bucket_numel)

    @property
    def optimizer(self):
        return self.optimizer_ref()

    def params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def error_term(self, param):
        return self.error_terms.get(param)

    def layout(self, group):
        return registry.layout(type(self.optimizer), group)

    def update_shape(self, param):
        """The shape the compiled step updates ``param`` in.

        With quantized states that is their storage layout, ``(groups, 32)``, for the master, the
        gradient and every state alike: the update, the per-group absmax and the encode then share
        one iteration space, and Inductor fuses each parameter's step into one kernel without an
        fp32 copy of any state. Valid because every supported optimizer is elementwise. Tensors
        whose size is not a multiple of 32 (or whose states are unquantized) keep their shape.
        """
        states = self.optimizer.state.get(param, {}).values()
        if param.numel() % companded.GROUP_SIZE == 0 and any(isinstance(s, QUANTIZED) for s in states):
            return (param.numel() // companded.GROUP_SIZE, companded.GROUP_SIZE)
        return tuple(param.shape)


def prepared(optimizer) -> PreparedOptimizer:
    try:
        return roles.PREPARED[optimizer]
    except KeyError:
        raise ValueError(
            f"{type(optimizer).__name__} was not prepared: call flash_inductor.prepare(model, optimizer) first"
        ) from None


def make_lr_tensor(group):
    """A tensor ``lr`` lets schedulers change it without recompiling the step (they ``fill_`` it).

    torch's Adam refuses a tensor lr with foreach unless ``capturable``; under compile the step is
    graph-captured anyway, so prepared Adam groups are marked capturable.
    """
    if not isinstance(group["lr"], torch.Tensor):
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
    if "capturable" in group and group.get("foreach"):
        group["capturable"] = True


def init_state(optimizer, record, group, p):
    """Give ``p`` every state ``prepare`` allocates, in stored form; states already stored are kept."""
    layout = record.layout(group)
    state = optimizer.state[p]
    if layout.step and "step" not in state:
        on_device = group.get("capturable") or group.get("fused")
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if on_device else "cpu")
    for key, kind in layout.quantized.items():
        existing = state.get(key)
        if not isinstance(sharded.local(existing), StateTensor):
            state[key] = new_state(record, p, kind, None if existing is None else existing.float())


def new_state(record, param, kind, value=None, saved_scales=None):
    """The stored form of one optimizer state of ``param`` (zeros when ``value`` is None; quantized
    states of a checkpoint's decoded ``value`` are encoded with its ``saved_scales``, if any), in
    the record's ``state_format``.

    For a sharded parameter: the local shard's state as a DTensor like ``param``; whether it is
    quantized depends on the whole parameter's size, as without sharding."""
    quantize = record.state_bits == 8 and param.numel() >= record.min_quantized_numel
    shard, value = sharded.local(param), sharded.local(value)
    if value is not None:
        value = value.to(shard.device)
    stored = STATE_FORMATS[record.state_format]
    if quantize and value is not None and saved_scales is not None:
        state = stored.encode(value, kind, shard.dtype, saved_scales=sharded.local(saved_scales))
    elif quantize and value is not None:
        state = stored.encode(value, kind, shard.dtype)
    elif quantize:
        state = stored.zeros(shard, kind)
    else:
        state = Fp32State.zeros(shard) if value is None else Fp32State.encode(value, shard.dtype)
    return sharded.like(param, state)
