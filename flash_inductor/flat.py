"""Flat storage: the parameters of a param group laid end to end, and one optimizer step over them.

``prepare`` cuts each param group into buckets of parameters that share device, dtype and state
format (quantized or fp32 states). A bucket holds one flat buffer per stored tensor:

    weights  (N,)      bf16/fp16/fp32   every parameter's ``.data`` is a view of it
    errors   (N,)      int8/int16       the error terms (``record.error_terms[p]`` are views)
    grads    (N,)      the parameters' dtype; every ``p.grad`` lands in its view
    fp8_grads          instead of ``grads`` with ``prepare(..., gradient_format="e5m2")``, in quantized
                       buckets: a TensorScaledState of e5m2 (or e4m3) codes (G, 32) + one fp32 scale
                       per parameter, which backward's hooks encode each gradient into
    states   per key: CompandedState of codes (G, 32) + scales (G,), TensorScaledState of codes
             (G, 32) + one scale per parameter and each parameter's first row, or Fp32State (G, 32)
    step     (G, 1)    fp32             the step count, per group of 32 (optimizers that count steps)
    active   (G, 1)    bool             which groups belong to a parameter that has a gradient this step

Each parameter's segment starts at a multiple of 32 (and holds one group at least), so no group of
32 straddles two parameters: its padding is zero in every buffer, and a zero gradient keeps it zero
for every supported optimizer. ``opt.state[p][key]`` and the error terms stay per-parameter views,
so checkpoints, ``memory_report`` and inspection read them as before.

The step is the user's optimizer class run once per bucket, on a *bucket optimizer*: an instance of
the same class whose one parameter is ``weights.view(G, 32)``, whose gradient is ``grads.view(G,
32)`` (with FP8 gradients: a stand-in that passes/fp8_gradients.py replaces by ``fp8_grads``,
decoded inside the step) and whose states are the flat states. Its hyperparameters are the user's group's, read before
every step (SGD's momentum through a tensor of the bucket: ``BoundHyperparameter``). Dynamo traces
the stock update once per bucket, whatever the number of parameters; the storage passes rewrite it
like any prepared step, and ``passes/untouched_parameters`` keeps the groups of parameters without
a gradient as they were (``active``). The step count is per group so
that a parameter skipped in some steps keeps its own count, as in torch.

FP8 gradients (FP8-LM's 1 B/param gradients): each parameter's post-accumulate-grad hook encodes the
gradient autograd produced into its segment of ``fp8_grads`` (one power-of-two scale per parameter,
``formats/tensor_scaled.py``; one compiled kernel pair) and sets ``p.grad = None``, so with eager
autograd only the gradients of the layer being differentiated exist in the parameters' dtype at a
time. Like the flat buffer, the codes hold storage from the first gradient until ``zero_grad``. A
second gradient before the step (micro-batch accumulation) is added in fp32 to the decoded first
and encoded again. A gradient belongs to the next step only: the step consumes it, and ``zero_grad``
(either ``set_to_none``) discards it. ``p.grad`` stays None, so code that reads ``.grad``
(``torch.nn.utils.clip_grad_norm_``) finds nothing: ``flash_inductor.clip_grad_norm_``
(gradient_clipping.py) clips them.
"""

import collections
import dataclasses
import functools
import inspect
import weakref

import torch

from flash_inductor import checks, registry, roles, sharded
from flash_inductor.formats import companded, tensor_scaled
from flash_inductor.formats.state_tensor import QUANTIZED, CompandedState, Fp32State, TensorScaledState

GROUP = companded.GROUP_SIZE


@functools.cache
def _compiled_add_gradient():
    """``tensor_scaled.add_gradient`` compiled once for gradients of every shape (dynamic): backward's
    hooks call it per parameter, where encoding in eager torch (some thirty launches per gradient)
    made the H200's 1B GPT step 1.9x slower (docs/benchmarks.md, issue 16's 1B model)."""
    return torch.compile(tensor_scaled.add_gradient, dynamic=True, fullgraph=True)


def segment_length(numel):
    """Elements a parameter of ``numel`` elements takes in a bucket: whole groups, one at least."""
    return max(GROUP, -(-numel // GROUP) * GROUP)


@dataclasses.dataclass(frozen=True)
class Segment:
    offset: int  # first element, a multiple of GROUP
    numel: int
    shape: tuple
    index: int  # its parameter's position in the bucket

    @property
    def groups(self):
        """Its rows of a flat ``(G, 32)`` state: the groups its elements fill (none when empty)."""
        return slice(self.offset // GROUP, self.offset // GROUP + companded.num_groups(self.numel))

    @property
    def rows(self):
        """Its rows of a per-group step count or mask: every group of its segment."""
        return slice(self.offset // GROUP, (self.offset + segment_length(self.numel)) // GROUP)

    def of(self, flat):
        """This parameter's view of a flat (N,) buffer, in its shape."""
        return flat[self.offset:self.offset + self.numel].view(self.shape)


def bucket_key(record, p):
    """Parameters of one param group with equal keys share a bucket."""
    quantized = record.state_bits == 8 and p.numel() >= record.min_quantized_numel
    # Frozen parameters apart: their bucket's gradient buffer never gets storage.
    return p.device, p.dtype, quantized, p.requires_grad


class Bucket:
    """The parameters of one bucket, their flat storage and their bucket optimizer."""

    def __init__(self, optimizer, record, group_index, params, flat_step=True, part=None):
        self.group_index = group_index
        self.params = params
        self.segments = {}
        offset = 0
        for index, p in enumerate(params):
            self.segments[p] = Segment(offset, p.numel(), tuple(p.shape), index)
            offset += segment_length(p.numel())
        self.num_groups = offset // GROUP
        first = params[0]
        device, dtype, quantized, trainable = bucket_key(record, first)
        # Names the bucket's tensors in graphs: group0_bfloat16_8bit (device index when several).
        states = ("8bit" if record.state_format == "companded" else record.state_format) if quantized else "fp32"
        self.name = f"group{group_index}_{str(dtype).removeprefix('torch.')}_{states}"
        if device.index:
            self.name += f"_{device.type}{device.index}"
        if part is not None:  # one of several buckets of one key (prepare's bucket_numel)
            self.name += f"_part{part}"
        if not trainable:
            self.name += "_frozen"
        fp8_gradients = record.gradient_format is not None and quantized and trainable
        if fp8_gradients:
            self.name += f"_{record.gradient_format}_grads"
        # One kind of flat buffer at a time, each parameter's own tensor freed as it moves in: prepare's
        # peak stays near the stored bytes (all per-parameter and all flat buffers at once were 2x).
        zeros = lambda dtype: torch.zeros(offset, dtype=dtype, device=first.device)  # noqa: E731
        self.weights = zeros(first.dtype)
        for p in params:
            self._adopt_weights(p)
            record.weight_addresses[p] = p.data_ptr()
        error = record.error_term(first)
        self.errors = None if error is None else zeros(error.dtype)
        for p in params:
            self._adopt_error(record, p)
        layout = record.layout(optimizer.param_groups[group_index])
        self.states = {}
        starts = [self.segments[p].offset // GROUP for p in params]  # each parameter's first row
        # where each parameter's gradient goes, for a step that reads them where they are (triton_adam)
        self.segment_starts = torch.tensor(starts, dtype=torch.int32, device=first.device)
        self.segment_numels = torch.tensor([p.numel() for p in params], dtype=torch.int32, device=first.device)
        for key in layout.quantized:
            self.states[key] = _flat_state(optimizer.state[first][key], self.num_groups, starts)
            for p in params:
                self._adopt_state(optimizer, key, p)
        self._record = weakref.ref(record)  # names for the errors of gradient hooks
        if fp8_gradients:  # codes released below like ``grads``; a scale per parameter always held
            self.fp8_grads = TensorScaledState.zeros_segments(
                self.num_groups, torch.tensor(starts, dtype=torch.int64, device=first.device), companded.SIGNED,
                first.dtype, tensor_scaled.GRADIENT_FORMATS[record.gradient_format])
            self.grads = self.grad_views = None
        else:
            self.fp8_grads = None
            self.grads = zeros(first.dtype)  # released below: storage from the first gradient on (hold_gradients)
            self.grad_views = [self.segments[p].of(self.grads) for p in params]
        # Without the flat step (gradient release updates each parameter alone, on its views) step
        # counts stay the parameters' own tensors, and there is no bucket optimizer.
        self.counts_steps = layout.step and flat_step
        self.per_group = False
        self.step = torch.zeros(1, 1, dtype=torch.float32, device=first.device) if self.counts_steps else None
        self.active = torch.ones(1, 1, dtype=torch.bool, device=first.device)
        self._active_flags = [True] * len(params)
        # Parameters whose gradient autograd computed (hooks) since the last step, and the zero views
        # given as ``.grad`` ahead of backward that no gradient has reached yet (``_preset_views``).
        self._received, self._last_received, self._expected = set(), set(), set()
        self._unlanded = []  # collected gradients not in the flat buffer yet (``land_gradients``)
        # Set where the bucket's step reads gradients where they are (steps.py: the hand-written kernel):
        # backward's hooks then leave each one as autograd made it. The flat buffer would otherwise get
        # its storage, whole, at the first gradient, when the backward's activations are all alive.
        self.reads_gradients_in_place = False
        self.copied_gradients = {}  # parameter index -> why the step could not read it in place (last step)
        self._tensor_hyperparameters = {}  # key -> the fp32 tensors the bucket optimizer's group holds
        self._first_hyperparameters = {}  # key -> its value at the first step
        self.bound = _bind_hyperparameter(optimizer, group_index) if flat_step else None
        self.optimizer = None  # the bucket optimizer, made once the storage is in place
        self.adopt_steps(optimizer)
        self.optimizer = _bucket_optimizer(optimizer, record, self) if flat_step else None
        self.release_gradients()

    # ------------------------------------------------------------------ storage
    def adopt(self, optimizer, record, p):
        """Copy ``p``'s value, error term and states into its segment and make them views of it.
        Values already there (views of this bucket) are left alone."""
        self._adopt_weights(p)
        self._adopt_error(record, p)
        for key in self.states:
            self._adopt_state(optimizer, key, p)

    def _adopt_weights(self, p):
        weights = self.segments[p].of(self.weights)
        if p.data.data_ptr() != weights.data_ptr():
            weights.copy_(p.detach())
            p.data = weights

    def _adopt_error(self, record, p):
        if self.errors is not None:
            errors = self.segments[p].of(self.errors)
            if record.error_terms[p].data_ptr() != errors.data_ptr():
                errors.copy_(record.error_terms[p])
                record.error_terms[p] = errors

    def _adopt_state(self, optimizer, key, p):
        state = optimizer.state[p]
        view = self.state_view(key, p)
        current = state.get(key)
        if current is None:
            view.copy_(type(view).zeros(view, **_kind(view)))
        elif not _same_storage(current, view):
            view.copy_(current)
        state[key] = view

    def adopt_steps(self, optimizer):
        """The step counts of ``optimizer.state[p]["step"]`` into the bucket, which they then view.

        While every parameter has the same count (and a gradient at every step) the bucket keeps one,
        ``(1, 1)``, and an all-True ``active`` of the same shape: the step broadcasts both. The first
        step where only some parameters have a gradient (or a load of unequal counts) makes both
        per group, ``(G, 1)``, for good."""
        if not self.counts_steps:
            return
        counts = [optimizer.state[p].get("step") for p in self.params]
        counts = [0.0 if c is None else float(c) for c in counts]
        if len(set(counts)) > 1 and not self.per_group:
            self._go_per_group(optimizer)
        if self.per_group:
            for p, count in zip(self.params, counts):
                self.step[self.segments[p].rows].fill_(count)
        else:
            self.step.fill_(counts[0])
        self._point_steps(optimizer)

    def _point_steps(self, optimizer):
        for p in self.params:
            row = self.segments[p].rows.start if self.per_group else 0
            optimizer.state[p]["step"] = self.step[row, 0]

    def _go_per_group(self, optimizer):
        """Per-group step counts and ``active``; a new bucket optimizer, so the step recompiles."""
        self.per_group = True
        self.active = self.active.expand(self.num_groups, 1).clone()
        if self.step is not None:
            self.step = self.step.expand(self.num_groups, 1).clone()
            self._point_steps(optimizer)
        if self.optimizer is not None:
            self.optimizer = _bucket_optimizer(optimizer, roles.PREPARED[optimizer], self)

    def state_view(self, key, p):
        """``p``'s state ``key`` as a view of the flat state (a new object, same storage)."""
        flat, segment = self.states[key], self.segments[p]
        if isinstance(flat, CompandedState):
            groups = segment.groups
            return CompandedState(flat.codes[groups], flat.scales[groups], flat.kind, shape=segment.shape, dtype=flat.dtype)
        if isinstance(flat, TensorScaledState):  # one segment: the parameter's own scale
            return flat.segment(segment.index, segment.groups, segment.shape)
        return Fp32State(segment.of(flat.values.view(-1)), shape=segment.shape, dtype=flat.dtype)

    def nbytes(self):
        """Bytes of each kind of flat storage (gradients: what they take when held)."""
        states = scales = 0
        for flat in self.states.values():
            stored = flat.stored_bytes()
            states += stored["states"]
            scales += stored["state_scales"]
        if self.per_group:
            # Per-group step counts and mask: bytes per parameter (like torch, one scalar step count,
            # as while every parameter steps together, is not counted).
            states += (0 if self.step is None else _bytes(self.step)) + _bytes(self.active)
        return {
            "weights": _bytes(self.weights), "error_terms": 0 if self.errors is None else _bytes(self.errors),
            "states": states, "state_scales": scales,
            "grads": self._gradient_bytes(),
        }

    def _gradient_bytes(self):
        if self.fp8_grads is not None:  # codes, scales and segment starts
            return sum(self.fp8_grads.stored_bytes().values())
        return _bytes(self.grads) if self.gradients_held() or any(p.requires_grad for p in self.params) else 0

    # ------------------------------------------------------------------ gradients
    def _gradient_store(self):
        """The tensor that holds the bucket's gradients: the flat buffer, or the FP8 gradients' codes."""
        return self.grads if self.fp8_grads is None else self.fp8_grads.codes

    def gradients_held(self):
        store = self._gradient_store()
        return store is not None and store.untyped_storage().nbytes() > 0

    def hold_gradients(self, filled_by=()):
        """Give the gradient store its storage again (zeros) after ``release_gradients``. The views of
        parameters ``filled_by`` (indices), which the caller writes whole next, are left unzeroed:
        zeroing a 1B model's buffer took 0.56 ms of the H200's step."""
        if self.gradients_held():
            return
        store = self._gradient_store()
        store.untyped_storage().resize_(store.numel() * store.element_size())
        if not filled_by:
            store.zero_()
            return
        # What no copy writes: the other parameters' segments and the padding of the filled ones.
        zeros = []
        for index, p in enumerate(self.params):
            segment = self.segments[p]
            end = segment.offset + segment_length(segment.numel)
            start = segment.offset + segment.numel if index in filled_by else segment.offset
            if end > start:
                zeros.append(store[start:end])
        if zeros:
            torch._foreach_zero_(zeros)

    def release_gradients(self):
        """Free the gradient store (``zero_grad``; the flat buffer with ``set_to_none=True``, when no
        parameter holds a view), discarding FP8 gradients. Under a compiled backward the peak comes
        while its graph runs, before any gradient lands: a store held between steps would add to it
        (the H200's 1B GPT peaked 1.1 GiB higher with an FP8 store always held)."""
        store = self._gradient_store()
        if store is not None:
            store.untyped_storage().resize_(0)
        self._received.clear()
        self._expected.clear()

    def keep_zero_views(self):
        """``zero_grad(set_to_none=False)``, after torch zeroed every ``.grad``: a gradient the step read
        where it was gives way to its zeroed view of the flat buffer, as a landed one is, which the
        next backward accumulates into. Kept, it may be a CUDA graph's output, which the graph's next
        replay overwrites before autograd adds the next gradient to it."""
        indices = [i for i, p in enumerate(self.params) if p.grad is not None and p.grad is not self.grad_views[i]]
        if not indices:
            return
        held = self.gradients_held()
        self.hold_gradients()  # zeros, if the buffer had no storage
        views = [self.grad_views[i] for i in indices]
        if held:
            torch._foreach_zero_(views)
        for index, view in zip(indices, views):
            self.params[index].grad = view

    def land(self, index):
        """Parameter ``index``'s gradient, just accumulated by autograd (its post-accumulate-grad hook),
        made its view of the flat buffer (copied when it is not). The first gradient of a step that
        autograd created also presets the other parameters' views (``_preset_views``). With FP8
        gradients: added to the parameter's FP8 gradient (``_encode_gradient``). Under
        ``land_gradients_at_step``, or for a step that reads the gradients where they are
        (``reads_gradients_in_place``): nothing here, the step lands what it has to
        (``land_gradients``)."""
        checks.check_storage(self._record(), self.params[index])
        if self.fp8_grads is not None:
            self._encode_gradient(index)
            return
        if self._record().gradients_land_at_step or self.reads_gradients_in_place:
            return
        p, view = self.params[index], self.grad_views[index]
        first = not self._received
        self._received.add(index)
        self._expected.discard(index)
        grad = p.grad
        if grad is None or grad is view or grad.is_sparse or grad.dtype != view.dtype or grad.shape != view.shape:
            return  # nothing to do, or a gradient the step refuses (checks.check_grad) before writing
        stale = self.gradients_held()  # kept by model.zero_grad(), which only sets p.grad = None
        self.hold_gradients()
        view.copy_(grad)
        p.grad = view
        if first:
            self._preset_views(stale)

    def _encode_gradient(self, index):
        """Add ``p.grad`` to parameter ``index``'s FP8 gradient and set ``p.grad = None``: encode it
        (amax -> power-of-two scale -> codes), or, when the parameter already has one this step,
        decode that, add in fp32 and encode the sum. Refuses (before writing) a gradient the step
        could not use, and a plain parameter in a multi-process run (DDP would reduce ``p.grad``,
        which is gone)."""
        p = self.params[index]
        if p.grad is None:
            return
        record = self._record()
        checks.check_grad(record, p)
        if sharded.data_parallel(p):
            raise RuntimeError(
                f"prepare(..., gradient_format={record.gradient_format!r}): parameter '{record.param_names.get(p, '?')}' "
                "is a plain tensor in a multi-process run: its gradient is taken from .grad in backward, before "
                "DistributedDataParallel could all-reduce it; use gradient_format=None with data parallelism"
            )
        self.hold_gradients()
        stored = self._fp8_gradient(p)
        _compiled_add_gradient()(p.grad, stored.codes, stored.scales, index in self._received)
        self._received.add(index)
        p.grad = None

    def _fp8_gradient(self, p):
        """``p``'s FP8 gradient: a one-segment TensorScaledState of views of ``fp8_grads``."""
        segment = self.segments[p]
        return self.fp8_grads.segment(segment.index, segment.groups, segment.shape)

    def fp8_gradients(self):
        """{parameter: its FP8 gradient} of the parameters that have one now (gradient clipping)."""
        return {self.params[i]: self._fp8_gradient(self.params[i]) for i in sorted(self._received)}

    def _preset_views(self, stale):
        """Give the parameters that had a gradient in the last step their zero view as ``.grad`` now,
        before autograd reaches them: it then accumulates into it in place, where a gradient it
        creates would cost a copy and a Python hook per parameter (on HF GPT-2, 148 of them made the
        train step wait on the CPU). Views no gradient reaches are set back to None before the step
        (``collect_gradients``): a parameter without a gradient stays untouched, as in torch. A
        ``stale`` buffer (held through ``model.zero_grad()``, as Hugging Face's Trainer calls it)
        has the views zeroed first."""
        indices = [i for i in self._last_received - self._received if self.params[i].grad is None]
        views = [self.grad_views[i] for i in indices]
        if stale and views:
            torch._foreach_zero_(views)
        for index, view in zip(indices, views):
            self.params[index].grad = view
            self._expected.add(index)

    def collect_gradients(self, optimizer, record):
        """Before the step: every gradient checked (``checks.check_grad``: a step it refuses raises
        before anything is written) and, with FP8 gradients, encoded; ``active`` set to the groups of
        the parameters that have one. False when none has: the bucket is not stepped at all. The
        gradients that are not their views yet move into the flat buffer at ``land_gradients``."""
        flags = self._fp8_gradient_flags() if self.fp8_grads is not None else self._flat_gradient_flags(record)
        if not any(flags):
            return False
        if flags != self._active_flags:
            if not self.per_group:
                self._go_per_group(optimizer)
            rows = torch.tensor([self.segments[p].rows.stop - self.segments[p].rows.start for p in self.params])
            mask = torch.repeat_interleave(torch.tensor(flags), rows)
            self.active.copy_(mask.view(-1, 1))
            self._active_flags = flags
        return True

    def _flat_gradient_flags(self, record):
        for index in self._expected:  # preset, and no gradient came
            if self.params[index].grad is self.grad_views[index]:
                self.params[index].grad = None
        self._expected.clear()
        self._last_received, self._received = self._received, set()
        flags, self._unlanded = [], []
        for index, (p, view) in enumerate(zip(self.params, self.grad_views)):
            checks.check_storage(record, p)
            grad = p.grad
            flags.append(grad is not None)
            if grad is not None and grad is not view:
                checks.check_grad(record, p)
                self._unlanded.append(index)
        return flags

    def land_gradients(self, unreadable=None):
        """Copy the collected gradients that are not their views yet into their views, in one foreach
        copy, and make the views their ``.grad``. For a step that reads gradients where they are,
        ``unreadable(grad, view)`` says why it cannot read one (``triton_adam.unreadable_gradient``):
        only those are copied, the others stay as they are; ``copied_gradients`` keeps {parameter
        index: why} of this step (the inspection report shows it)."""
        indices, self._unlanded = self._unlanded, []
        if unreadable is not None:
            reasons = {i: unreadable(self.params[i].grad, self.grad_views[i]) for i in indices}
            indices = [i for i, reason in reasons.items() if reason is not None]
            self.copied_gradients = {i: reasons[i] for i in indices}
        if not indices:
            return
        self.hold_gradients(filled_by=set(indices))
        views = [self.grad_views[i] for i in indices]
        torch._foreach_copy_(views, [self.params[i].grad for i in indices])
        for index, view in zip(indices, views):
            self.params[index].grad = view

    def _fp8_gradient_flags(self):
        """Which parameters have an FP8 gradient (a ``.grad`` set by hand is added first); the step
        consumes them."""
        record = self._record()
        for index, p in enumerate(self.params):
            checks.check_storage(record, p)
            if p.grad is not None:
                self._encode_gradient(index)
        flags = [index in self._received for index in range(len(self.params))]
        self._received = set()
        return flags

    def stepped_params(self):
        """The parameters the step after ``collect_gradients`` updates."""
        return [p for p, active in zip(self.params, self._active_flags) if active]

    def sync_hyperparameters(self, optimizer):
        """The user's current hyperparameters (the same ``lr`` tensor) on the bucket optimizer.
        Schedulers change betas and momentum every step (OneCycleLR), and a float is a constant of
        the compiled step (a recompile each): float betas that change become fp32 tensors the bucket
        keeps and refills, and the bound hyperparameter (SGD's momentum) fills its tensor."""
        group = self.optimizer.param_groups[0]
        for key, value in optimizer.param_groups[self.group_index].items():
            if key in ("params", *_BUCKET_SETTINGS):
                continue
            if key in _TENSOR_HYPERPARAMETERS and _floats(value):
                value = self._betas_as_tensors_once_changed(key, value)
            elif key == registry.bound_hyperparameter(type(optimizer)):
                value = self._bound_value(optimizer, key, value)
            group[key] = value

    def _betas_as_tensors_once_changed(self, key, value):
        """Floats while they keep their first value (stock numerics: torch computes ``1 - beta``
        in double); from their first change on, fp32 tensors refilled each step (one recompile)."""
        held = self._tensor_hyperparameters.get(key)
        if held is None:
            first = self._first_hyperparameters.setdefault(key, value)
            if value == first:
                return value
            held = self._tensor_hyperparameters[key] = tuple(torch.tensor(v, dtype=torch.float32) for v in value)
        for t, v in zip(held, value):
            if float(t) != v:
                t.fill_(v)
        return held

    def _bound_value(self, optimizer, key, value):
        """What the bucket optimizer's group holds for the bound hyperparameter: the bucket's NaN,
        its tensor refilled with ``value``; or ``value`` itself where it is not bound (0 at prepare:
        no momentum buffers). It may not move to or from 0: the update then skips its buffer, which
        the traced step does not (and prepare gave no buffers to a group whose momentum was 0)."""
        if isinstance(value, (int, float)) and bool(value) != (self.bound is not None):
            where = f"param_groups[{self.group_index}]['{key}']"
            was = "nonzero" if self.bound is not None else 0
            raise ValueError(
                f"flash_inductor: {type(optimizer).__name__}'s {where} became {value!r}, and it was {was} when the optimizer "
                f"was prepared: a prepared step keeps {key} buffers exactly where {key} was nonzero then. A scheduler may "
                f"change {key} but not to or from 0; prepare the optimizer with the {key} the schedule starts from"
            )
        if self.bound is None:
            return value
        self.bound.tensor.fill_(value)
        return self.bound.traced_as


@dataclasses.dataclass(frozen=True, eq=False)
class BoundHyperparameter:
    """A float hyperparameter the flat step reads from ``tensor`` (registry.bound_hyperparameter):
    Dynamo traces the bucket's own NaN object ``traced_as`` in its place (a NaN passes the update's
    ``!= 0`` branch and guards as NaN whatever the value), and passes/bound_hyperparameters.py
    replaces that NaN by ``tensor``."""

    key: str
    tensor: torch.Tensor  # fp32, 0-dim, filled with the group's value before every step
    traced_as: float = dataclasses.field(default_factory=lambda: float("nan"))


def _bind_hyperparameter(optimizer, group_index):
    """The bucket's BoundHyperparameter, or None (its optimizer has none, or its value is 0 or no number)."""
    key = registry.bound_hyperparameter(type(optimizer))
    value = optimizer.param_groups[group_index].get(key)
    if key is None or not isinstance(value, (int, float)) or value == 0:
        return None
    return BoundHyperparameter(key, torch.tensor(float(value), dtype=torch.float32))


# What a bucket optimizer's group sets itself, whatever the user's group says: the single-tensor
# update (the one Inductor fuses), and for Adam the capturable form, whose bias corrections are
# tensor ops and so broadcast the per-group step count.
_BUCKET_SETTINGS = {"foreach": False, "capturable": True}

# Float hyperparameters the stock updates take as tensors too (Adam's and Lion's betas); SGD's
# momentum decides branches, and is bound instead (BoundHyperparameter); others stay constants of
# the compiled step.
_TENSOR_HYPERPARAMETERS = {"betas"}


def _floats(value):
    return isinstance(value, tuple) and all(isinstance(v, float) for v in value)


def _bytes(t):
    return t.numel() * t.element_size()


def _kind(state):
    return {"kind": state.kind} if isinstance(state, QUANTIZED) else {}


def _same_storage(a, b):
    return all(getattr(a, k).data_ptr() == getattr(b, k).data_ptr() for k in type(a)._inner)


def _flat_state(example, num_groups, starts):
    """The all-zero flat state of ``num_groups`` groups, in the format of the per-parameter ``example``
    (``starts``: each parameter's first row, for one scale per parameter)."""
    shape = (num_groups, GROUP)
    like = torch.empty((), dtype=example.dtype, device=example.device).expand(shape)  # its shape, not its bytes
    if isinstance(example, CompandedState):
        return CompandedState.zeros(like, example.kind)
    if isinstance(example, TensorScaledState):
        segments = torch.tensor(starts, dtype=torch.int64, device=example.device)
        return TensorScaledState.zeros_segments(num_groups, segments, example.kind, example.dtype, example.codes.dtype)
    if isinstance(example, Fp32State):
        return Fp32State(torch.zeros(shape, dtype=torch.float32, device=example.device), shape=shape, dtype=example.dtype)
    raise TypeError(f"a flat bucket keeps StateTensor states, got {type(example).__name__}")


def _bucket_optimizer(optimizer, record, bucket):
    """An optimizer of ``optimizer``'s class over the bucket's flat storage, prepared (registered
    in ``roles.PREPARED``) so the passes find its tensors' roles."""
    flat = bucket.weights.view(bucket.num_groups, GROUP)
    if bucket.fp8_grads is None:
        flat.grad = bucket.grads.view(bucket.num_groups, GROUP)
    else:  # a stand-in of one element: passes/fp8_gradients.py makes the step read the FP8 gradients
        # not a view (an expanded 0-dim tensor was): torch 2.11's Dynamo fails to fake a view of a 0-dim base
        flat.grad = torch.empty_strided(flat.shape, (0, 0), dtype=flat.dtype, device=flat.device).zero_()
    group = {k: v for k, v in optimizer.param_groups[bucket.group_index].items() if k != "params"}
    group.update((k, v) for k, v in _BUCKET_SETTINGS.items() if k in group)
    if bucket.bound is not None:
        group[bucket.bound.key] = bucket.bound.traced_as
    state = dict(bucket.states)
    if bucket.step is not None:
        state["step"] = bucket.step
    proxy = type(optimizer).__new__(type(optimizer))
    proxy.__setstate__({
        "defaults": optimizer.defaults,
        "state": collections.defaultdict(dict, {flat: state}),
        "param_groups": [dict(group, params=[flat])],
    })
    proxy._warned_capturable_if_run_uncaptured = True
    roles.PREPARED[proxy] = dataclasses.replace(
        record,
        optimizer_ref=weakref.ref(proxy),
        error_terms={} if bucket.errors is None else {flat: bucket.errors.view(bucket.num_groups, GROUP)},
        param_names={flat: bucket.name},
        gradient_release=None,
        buckets=[],
        active_groups=bucket.active,
        bound_hyperparameter=bucket.bound,
        fp8_gradients=bucket.fp8_grads,
        internal=True,
    )
    return proxy


def lay_out(optimizer, record, group_index, flat_step=True):
    """The buckets of param group ``group_index``, its parameters' values, error terms and states
    moved into them (``prepare``, ``add_param_group``, ``copy.deepcopy``); with ``flat_step=False``
    (gradient release) only the storage, without bucket optimizers or step counts. Parameters of one
    key go to buckets of at most ``record.bucket_numel`` elements each (``split_by_numel``)."""
    by_key = {}
    for p in optimizer.param_groups[group_index]["params"]:
        by_key.setdefault(bucket_key(record, p), []).append(p)
    buckets = []
    for params in by_key.values():
        parts = split_by_numel(params, record.bucket_numel)
        for index, part in enumerate(parts):
            buckets.append(Bucket(optimizer, record, group_index, part, flat_step, part=index if len(parts) > 1 else None))
    return buckets


def split_by_numel(params, bucket_numel):
    """``params`` in order, cut into runs whose segments take at most ``bucket_numel`` elements (a
    larger parameter alone); one run when ``bucket_numel`` is None.

    Why smaller buckets: a backward compiled as one graph returns every gradient at once, and the
    step copies them into the flat gradient buffers bucket by bucket, freeing each bucket's own
    gradients as it goes (``land_gradients_at_step``): the step holds the gradients once plus one
    bucket's buffer, where one bucket holds them twice."""
    if bucket_numel is None:
        return [list(params)]
    parts, size = [[]], 0
    for p in params:
        length = segment_length(p.numel())
        if parts[-1] and size + length > bucket_numel:
            parts.append([])
            size = 0
        parts[-1].append(p)
        size += length
    return parts


def install_gradient_hooks(optimizer, buckets):
    """Each gradient autograd computes lands in its parameter's view of the flat buffer.

    A gradient accumulated into ``p.grad`` that is already the view needs nothing; one that autograd
    created (``p.grad`` was None) is copied in. The hooks live on the parameters, which may
    outlive the optimizer."""
    handles = []
    for bucket in buckets:
        for index, p in enumerate(bucket.params):
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(_lander(weakref.ref(bucket), index)))
    weakref.finalize(optimizer, lambda: [h.remove() for h in handles])


def _lander(bucket_ref, index):
    @torch.compiler.disable
    def land(param):
        bucket = bucket_ref()
        if bucket is not None:
            bucket.land(index)

    return land


def land_gradients_at_step(record):
    """Leave each gradient autograd's own tensor until the step copies them all into the flat
    buffers (one foreach copy per bucket). For a backward compiled as one graph, whose gradients
    all exist when its first hook runs: landing each there costs a fill of the buffer and an add
    per parameter (the zero views given as ``.grad``, ``_preset_views``), twice the memory traffic.
    An eager backward keeps landing each gradient as it comes, which frees it at once."""
    record.gradients_land_at_step = True


@torch.compiler.disable
def collect_gradients(record, gradient_reader=None):
    """The buckets to step now (``Bucket.collect_gradients``), their hyperparameters synced and their
    gradients landed (``Bucket.land_gradients``), but those that the bucket's step reads where they
    are: ``gradient_reader(bucket)`` is its ``unreadable(grad, view)`` (None: it reads the flat buffer).
    Eager, also inside a compiled train step (it reads Python-side state of every parameter)."""
    optimizer = record.optimizer
    stepping = []
    for bucket in record.buckets:
        if bucket.collect_gradients(optimizer, record):
            bucket.sync_hyperparameters(optimizer)
            unreadable = None if gradient_reader is None else gradient_reader(bucket)
            if bucket.fp8_grads is None:
                bucket.land_gradients(unreadable)
            stepping.append(bucket)
    return stepping


def step_buckets(optimizers):
    """The stock step of each bucket optimizer: what Dynamo compiles (flash_inductor/steps.py; also
    gradient release's per-parameter steps and FSDP2's local optimizer, one optimizer each).

    The class's own update, without the wrappers ``torch.optim`` puts around ``step`` (hooks,
    profiling, grad mode): a bucket optimizer has no hooks, and the wrappers end in graph breaks
    that would give every bucket a graph of its own; one graph holds them all."""
    with torch.no_grad():
        for optimizer in optimizers:
            inspect.unwrap(type(optimizer).step)(optimizer)


def release_gradients(record, set_to_none=True):
    """``zero_grad``: free the flat gradient buffers no ``.grad`` views (``set_to_none``), and
    discard FP8 gradients (either way: no zero FP8 gradients are kept to step with). Zeroed gradients
    kept (``set_to_none=False``) are the parameters' views of the flat buffer (``keep_zero_views``)."""
    for bucket in record.buckets:
        if bucket.fp8_grads is not None or (set_to_none and all(p.grad is None for p in bucket.params)):
            bucket.release_gradients()
        elif not set_to_none:
            bucket.keep_zero_views()

