"""Fused multi-tensor optimizers: drop-in replacements for torch.optim.

``reprop.optim.SGD``, ``Adam``, ``AdamW``, ``Adagrad``, ``RMSprop`` and
``Adadelta`` subclass their torch counterparts, so constructor arguments,
defaults, ``param_groups`` keys, validation errors, hooks, LR schedulers and
``state_dict`` layout are torch's own. Only ``step`` differs: each (group,
device, dtype) is updated by one call into the C core (one OpenMP parallel
region on the CPU, one kernel launch per table of tensors on CUDA), with the
math of torch's single-tensor implementation term by term.

Differences from torch, all deliberate:

* State tensors are always float32 (but float64 parameters', see below),
  also for float16/bfloat16 parameters, whose update is computed in float32
  and rounded once to the parameter's dtype. torch's ``load_state_dict``
  casts them back to the parameter dtype, so state dicts stay
  interchangeable.
* ``foreach`` and ``fused`` are accepted for compatibility and ignored: reprop
  always fuses (torch's update of float64 parameters follows them).
* A group with ``differentiable=True`` is updated by torch's own step()
  body, all its params (see float64 below), so autograd goes through the
  update as through torch's; ``reprop.fuse`` refuses it.
* ``step()`` of SGD, Adam, AdamW and Adagrad follows torch's fused
  optimizers' AMP protocol whatever their ``fused`` flag: ``grad_scale`` set
  on the optimizer divides the gradients in place, ``found_inf`` non-zero
  skips the update (torch's non-fused paths raise for them; RMSprop and
  Adadelta, fused nowhere in torch, ignore them as torch's do).
* ``step_params(params)`` updates just the given parameters now; the optimizer
  fusion hooks call it from inside backward.
* float64 parameters are updated by torch's own step() of the group (its
  for-loop, foreach or fused implementation as the group's flags choose it),
  with state as torch keeps it: torch's bits. Other dtypes (complex, integer)
  are refused at construction with a TypeError naming ``params`` (but in a
  differentiable group, where torch's checks apply).
* ``capturable=True`` with CPU parameters is refused at construction with a
  ValueError, where torch raises an AssertionError at ``step()``.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import inspect
import weakref
from typing import Callable, Iterable, NamedTuple

import numpy as np
import torch

from . import _tensors
from ._native import _C, _cuda, cuda_missing

__all__ = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta"]

# Optimizer codes of csrc/reprop.h (rp_optim_kind).
_SGD, _ADAM, _ADAGRAD, _RMSPROP, _ADADELTA = range(5)
# rp_optim_entry columns and flags.
_COL_PARAM, _COL_GRAD, _COL_STATE, _COL_STEP, _COL_NUMEL, _COL_FLAGS = 0, 1, 2, 5, 6, 7
_FRESH_BUFFER = 1
# Plans are cached per list of params updated together (a group for step(),
# a module's params for backward fusion), bounded by the rows they hold: this
# many per parameter of the optimizer, and at least _MIN_PLAN_ROWS.
_PLAN_ROWS_PER_PARAM = 4
_MIN_PLAN_ROWS = 4096


def _layout_key(p: torch.Tensor) -> tuple:
    """What a table row assumes of a param beyond its identity: the kernels
    walk its elements of this dtype from this address with this layout
    (True: contiguous, else the strides), so a param whose .data was replaced
    (by a view of its own storage at the same address, or by a tensor that
    reuses a freed allocation) must not match; nor one reshaped (the same
    numel), whose gradient no longer matches it, which torch refuses. Last
    the bytes its elements span from that address, which follow from the
    rest, kept for the check of gradients sharing its memory (_CallMemory).
    The fast path in C (optim_grad_pointers) checks the same tuple. None for
    a param with no strided memory (a sparse one, or
    a lazy module's not yet materialized): its row stays dormant."""
    layout = _layout(p)
    if layout is None:
        return None
    start, end = _tensors.byte_span(p)
    return (*layout, end - start)


def _layout(p: torch.Tensor) -> tuple | None:
    """p's _layout_key but the span, which follows from the rest: what the
    Python path compares at each step (the span of a param with gaps, a
    channels_last one, is a loop over its dimensions)."""
    if not _has_memory(p):
        return None
    return (p.data_ptr(), p.dtype, p.shape, True if p.is_contiguous() else p.stride(), p.get_device())


def _has_memory(p: torch.Tensor) -> bool:
    """Whether p has strided memory that a row can point at: not sparse, nor
    a lazy module's parameter not yet materialized (an UninitializedParameter
    has no shape or memory until the module's first forward; torch.optim
    takes one and updates it from then on, its materialization keeping the
    object, so the row of a plan built before stays dormant and the
    parameter's first gradient makes the plan stale)."""
    return p.layout is torch.strided and not torch.nn.parameter.is_lazy(p)


class _CallMemory:
    """The memory an update call writes, for the check of the gradients it
    reads (check_grad): each row's param and the state tensors (step counts
    included) that its row points at, in all the plans of the call. The
    kernels read a gradient while they write that memory, one that shares
    some of it (made by hand: p.grad = p.data, or = a state tensor) at
    another point than torch's update reads it. `bounds`, the union of those
    spans as disjoint [start, end) pairs by address in a flat int64 array,
    is what the C fast path searches at each step (a bisection a gradient):
    a gradient meeting none is read as it is (autograd's never meet live
    tensors), any other goes to the Python path, which tells them apart.
    Built with the plans, from their tables: no tensor is asked."""

    def __init__(self, plans: list):
        entries = []  # (start, end, param, state key or None for the param itself)
        for plan in plans:
            fresh: dict = {}
            for row, entry in plan.fresh:
                fresh.setdefault(row, []).append(entry)
            for row, (p, key, watched, columns) in enumerate(zip(
                    plan.params, plan.param_keys, plan.watched, plan.table.tolist())):
                if key is None:
                    continue
                if key[5]:
                    entries.append((key[0], key[0] + key[5], p, None, p))
                for name, t, col in (watched or ()) + tuple(fresh.get(row, ())):
                    # the state a row points at is float32 in its work tensor's dense layout
                    size = 4 if col == _COL_STEP else 4 * columns[_COL_NUMEL]
                    if size:
                        entries.append((columns[col], columns[col] + size, p, name, t))
        entries.sort(key=_first)
        self.entries = entries
        self.starts = [e[0] for e in entries]
        self.longest = max((e[1] - e[0] for e in entries), default=0)
        # the union: disjoint spans, each with the param whose memory alone it is
        # (None: state, or more than one tensor)
        self.union_starts, self.union_ends, self.union_owners = [], [], []
        for start, end, p, name, _ in entries:
            if self.union_ends and start < self.union_ends[-1]:
                self.union_ends[-1] = max(self.union_ends[-1], end)
                self.union_owners[-1] = None
            else:
                self.union_starts.append(start)
                self.union_ends.append(end)
                self.union_owners.append(p if name is None else None)
        self.bounds = np.array([x for span in zip(self.union_starts, self.union_ends)
                                for x in span], dtype=np.int64)

    def check_grad(self, p: torch.Tensor, g: torch.Tensor, grad_of: Callable,
                   layout: tuple | None = None) -> bool:
        """Refuses gradient g of param p where it shares memory (an element:
        spans that meet are tested element by element where one has gaps)
        with p's state, or with another param of the call (or its state) that has a gradient
        (grad_of(param), None without) and so is written this step; returns
        whether g shares memory with p itself, which the row then reads
        through a copy that Plan.run fills as torch reads it (g as it is: a
        negative view reads p's memory too; spans are compared, so a view
        interleaved with p's elements counts, harmlessly). A param without a
        gradient this step is not written: its memory is read as torch reads
        it. `layout`: p's _layout_key, given at each step by the Python path,
        where a gradient in p's layout (autograd's) spans as many bytes as p:
        its span then costs one look at its strides, not byte_span's loop over
        its dims (about 1 us a param)."""
        if layout is not None and (g.is_contiguous() if layout[3] is True
                                   else g.stride() == layout[3]):
            start = g.data_ptr()
            end = start + layout[5]
        else:
            start, end = _tensors.byte_span(g)
        if start == end:
            return False
        i = bisect.bisect_left(self.union_starts, end) - 1
        if i < 0 or self.union_ends[i] <= start:  # (the common case: it meets nothing)
            return False
        owners = []
        while i >= 0 and self.union_ends[i] > start:
            owners.append(self.union_owners[i])
            i -= 1
        if all(owner is p for owner in owners):  # (none, or p's own memory alone)
            return bool(owners)
        own = False
        # g laid out as p from p's address holds p's elements only: another
        # param whose span it meets interleaves with p (columns of one matrix),
        # spans being compared, and g is read through a copy as p's own memory
        mine = start == p.data_ptr() and g.stride() == p.stride()
        low = bisect.bisect_left(self.starts, start - self.longest)
        for other_start, other_end, q, name, t in self.entries[
                low:bisect.bisect_left(self.starts, end)]:
            if other_end <= start:
                continue
            if q is p and name is None:
                own = True
            elif q is p and _tensors.shares_elements(g, t):
                raise ValueError(
                    f"grads: the gradient of {_described_param(p)} shares memory with its "
                    f"{name}; torch's update writes its {name} in place before it has read all "
                    f"of the gradient (its for-loop, foreach and fused implementations each "
                    f"at another point), where the fused update reads the gradient once: give "
                    f"the gradient memory of its own (.clone())")
            elif (q is not p and grad_of(q) is not None and not (name is None and mine)
                  and _meets(t, start, end) and _tensors.shares_elements(g, t)):
                # (spans meeting without an element in common: one of them has gaps,
                # interleaving with the other, e.g. the odd and even columns of one
                # matrix; torch's update reads such a gradient as any other)
                # (the spans are the plans' as built: another row's param or state
                # moved since (.to(), .data replaced) makes its plan stale, and its
                # old memory, freed, may hold this gradient now)
                what = "another parameter" if name is None else f"the {name} of another parameter"
                raise ValueError(
                    f"grads: the gradient of {_described_param(p)} shares memory with {what} "
                    f"of shape {tuple(q.shape)} that this step updates; torch's for-loop update "
                    f"reads it before or after that update by their order in the group, its "
                    f"foreach update before, and the fused update's threads would race on it: "
                    f"give the gradient memory of its own (.clone())")
        return own


def _meets(t: torch.Tensor, start: int, end: int) -> bool:
    """Whether t's memory now meets the addresses [start, end)."""
    t_start, t_end = _tensors.byte_span(t)
    return t_start < end and start < t_end


def _first(entry: tuple):
    return entry[0]


# The numeric entries of the hparams tuple, in its order. Floats and ints
# within _INT_BOUND go into it as they are (the core parses them as doubles;
# see _numbers); any other value is converted or refused by _scalar.
_NUMERIC_HPARAMS = ("lr", "weight_decay", "eps", "betas[0]", "betas[1]", "momentum", "dampening",
                    "alpha", "rho", "lr_decay")
# The flags that follow them, as bools.
_FLAG_HPARAMS = ("nesterov", "maximize", "amsgrad", "decoupled_weight_decay", "centered")
# The entries of the tuple that Plan.run reads.
_HP_LR, _HP_WEIGHT_DECAY = _NUMERIC_HPARAMS.index("lr"), _NUMERIC_HPARAMS.index("weight_decay")
# The entries _FusedOptimizer._check_hparams reads.
_HP_BETA1, _HP_BETA2 = _NUMERIC_HPARAMS.index("betas[0]"), _NUMERIC_HPARAMS.index("betas[1]")
_HP_MOMENTUM, _HP_LR_DECAY = _NUMERIC_HPARAMS.index("momentum"), _NUMERIC_HPARAMS.index("lr_decay")
_HP_MAXIMIZE = len(_NUMERIC_HPARAMS) + _FLAG_HPARAMS.index("maximize")
_HP_DECOUPLED = len(_NUMERIC_HPARAMS) + _FLAG_HPARAMS.index("decoupled_weight_decay")
# torch passes an int hyper-parameter (or -int, 1 - int) to its tensor ops as a
# 64-bit integer, signed or unsigned, and raises OverflowError for one that
# does not fit (SGD's lr=2**64); every form of an int within +-2**63 fits.
_INT_BOUND = 2**63


def _scalar(value, name: str) -> float:
    """A hyper-parameter as a Python float: a real number as torch's ops take
    one (_tensors._is_real_scalar: a Python or NumPy number, a 0-d NumPy
    array, a one-element real tensor, which must be on the CPU: the kernels
    cannot read a CUDA one, and float() of it would sync), or a Python or
    NumPy bool, which torch's arithmetic takes as 0 or 1. Anything else
    raises TypeError naming `name`, as torch's update raises for it: a
    string (float() alone would parse "0.1" and step), None, a complex
    number, a bool tensor (torch refuses its negation and subtraction), a
    NumPy array of one or more dimensions (NumPy 2 refuses float() of one,
    torch's ops refuse it as a Number) or a Fraction (not a Number to
    torch's ops). An int beyond _INT_BOUND raises OverflowError."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if not _tensors._is_real_scalar(value):
        raise TypeError(f"{name}: expected a real number or a one-element real tensor (not a "
                        f"bool one; a NumPy array only 0-d), got {_described(value)}")
    # torch passes a NumPy int to its ops as an int64: 2**63 fits only a Python int (as uint64)
    top = _INT_BOUND if isinstance(value, int) else _INT_BOUND - 1
    if isinstance(value, (int, np.integer)) and not -_INT_BOUND <= value <= top:
        raise OverflowError(f"{name}: the int {value} is beyond the 64-bit ints torch's update "
                            "can pass to its tensor ops (it raises); use a float")
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        # the kernels take every hyper-parameter as a host float, but a capturable
        # group's lr, which they read on the device (_hparams does not come here)
        raise ValueError(f"{name}: only lr may be a tensor off the CPU, a CUDA one with "
                         f"capturable=True; got a tensor on {value.device}")
    return float(value)


def _numbers(numeric: tuple) -> tuple:
    """The numeric hyper-parameters as the core takes them: floats and ints
    within +-2**63 as they are (what _C.optim_hparams passes too), each
    other one through _scalar."""
    return tuple(v if type(v) is float or (type(v) is int and -_INT_BOUND <= v <= _INT_BOUND)
                 else _scalar(v, name) for v, name in zip(numeric, _NUMERIC_HPARAMS))


def _described(value) -> str:
    """`value` for an error message: the dtype and shape of a tensor or
    array (its repr could be long), else the repr and type."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} NumPy array of shape {value.shape}"
    return f"{value!r} ({type(value).__name__})"


def _hparams_of(group: dict) -> tuple:
    """The hparams tuple of csrc/pyutil.h of a param group (or settings
    dict), with the kinds of its tensor values (_kind): what
    _C.optim_hparams builds (whose values are numbers), for the groups it
    leaves to Python (it returns None): a tensor hyper-parameter, NumPy
    scalars, bools and values to refuse
    (with _scalar's error), betas of another type, a dict subclass, no "lr"
    (KeyError)."""
    lr = group["lr"]
    if group.get("capturable", False) and isinstance(lr, torch.Tensor):
        lr = 0.0  # the kernels read it on the device (as float32: its kind there)
    beta1, beta2 = _betas(group)
    numeric = (lr, group.get("weight_decay", 0.0), group.get("eps", 0.0), beta1, beta2,
               group.get("momentum", 0.0), group.get("dampening", 0.0),
               group.get("alpha", 0.0), group.get("rho", 0.0), group.get("lr_decay", 0.0))
    numbers = _numbers(numeric)  # refuses what has no kind first
    kinds = sum(_kind(numeric[i]) << _KIND_BITS * k for k, i in enumerate(_KIND_HPARAMS))
    return numbers + tuple(bool(group.get(key, False)) for key in _FLAG_HPARAMS) + (kinds,)


# csrc/reprop.h's rp_lr_kind of a tensor hyper-parameter, by the dtype torch
# computes with it in
_KINDS = {torch.float64: 1, torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}
# The numeric hyper-parameters whose kinds the hparams tuple's last int packs,
# _KIND_BITS each from the lowest (csrc/pyutil.h).
_KIND_BITS = 3
_KIND_HPARAMS = tuple(_NUMERIC_HPARAMS.index(name) for name in (
    "lr", "weight_decay", "betas[0]", "betas[1]", "dampening", "alpha", "rho", "lr_decay"))


def _kind(value) -> int:
    """How torch's update computes with a hyper-parameter (rp_lr_kind): a
    number in Python (0: a zero denominator raises ZeroDivisionError), a
    tensor in tensor ops in torch.result_type(value, 1.0), where a zero
    denominator or an overflow gives inf or NaN and it steps on, each result
    rounded to that dtype (a bfloat16 beta1's 1 - beta1 ** step too)."""
    if not isinstance(value, torch.Tensor):
        return 0
    return _KINDS[torch.result_type(value, 1.0)]


def _betas(group: dict) -> tuple:
    """group["betas"] (absent: (0.0, 0.0)) unpacked into two values, as
    torch's update unpacks it: another number of values raises ValueError
    (one that is not iterable TypeError) naming the key, where indexing
    would step on three betas and raise a bare IndexError for one."""
    try:
        beta1, beta2 = group.get("betas", (0.0, 0.0))
    except (TypeError, ValueError) as e:
        raise type(e)(f"betas: {e}") from None
    return beta1, beta2


class _Scaling(NamedTuple):
    """What torch's fused-optimizer AMP protocol asks of one step()
    (_FusedOptimizer._grad_scaling): skip the update, or else divide the
    gradients by `scale` (None: as they are)."""

    skip: bool
    scale: torch.Tensor | None


def _amp_tensor(value, name: str) -> torch.Tensor | None:
    """An AMP attribute (grad_scale, found_inf; `name` says which, of which
    optimizer) as torch's fused kernels take it: None, or a one-element
    float32 tensor on any device (they move it to the params'); anything else
    raises naming it, where torch's kernels raise for another dtype, read the
    first of several elements (grad_scale) or fail on a float's missing
    .device."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        raise TypeError(f"{name}: expected a float32 tensor (as torch.amp.GradScaler sets), got "
                        f"{_described(value)}")
    if value.numel() != 1:
        raise ValueError(f"{name}: expected a one-element tensor, got one of shape "
                         f"{tuple(value.shape)}")
    return value.reshape(())  # (torch's fused kernels take shape (1,) too; _foreach_div_ 0-d only)


def _unscale_grads(running: list, scale: torch.Tensor, stopped: dict, divided: list) -> None:
    """Divides the gradients of the rows taking part by `scale` in place,
    as torch's fused kernels do: they update from g / scale and write it back
    into .grad. Torch does both in one call; here a step stopped in between
    (a notebook's stop button) leaves them divided, and its retry
    (GradScaler's, its stage unchanged) must not divide them again: `stopped`
    holds the notes such a step left (_stopped_notes), and `divided` gets
    (gradients, their versions once divided) of each plan before its
    division, for the caller to note if the step does not finish."""
    for plan in running:
        grads = [p.grad for p in plan.step_params]
        if stopped:
            grads = [g for g in grads if not _divided_by_stopped_step(stopped, g)]
        try:
            versions = [g._version + 1 for g in grads]  # (one in-place call bumps it once)
        except RuntimeError:  # inference tensors keep no version: theirs go unnoted
            versions = None
        divided.append((grads, versions))
        if grads:
            torch._foreach_div_(grads, scale.to(plan.device))
    # The versions as read once all are divided: gradients sharing a version
    # counter (views of one flat buffer) are bumped once per view, beyond the
    # forecast, which the retry then took for a write since and divided them
    # again. Each list is replaced in one store; a stop landing before it
    # leaves the forecast, right but for such views.
    for grads, versions in divided:
        if versions is not None:
            versions[:] = [g._version for g in grads]


def _unscale_wide(params: list, scale: torch.Tensor, given: dict | None) -> None:
    """Divides the gradients of the params torch's step() updates
    (_by_torch_in: float64 ones, a differentiable group's) in place by
    `scale`, as torch's fused kernels divide them (in the gradient's dtype)
    and write them back into .grad."""
    grad_of = _grad_getter(given)
    for p in params:
        grad_of(p).div_(scale.to(device=p.device))


def _stopped_notes(stopped: dict, divided: list) -> dict:
    """id(gradient) -> (a weak reference to it, its version and data pointer
    once divided), for the gradients a stopped step may have divided; with
    the notes of the stopped step it retried. Made only when a step did not
    finish, so a finished step pays for one version read a gradient."""
    notes = dict(stopped)
    for grads, versions in divided:
        if versions is not None:
            notes.update((id(g), (weakref.ref(g), v, g.data_ptr())) for g, v in zip(grads, versions))
    return notes


# The reprop optimizers that may hold notes of a stopped scaled step
# (_divided_not_stepped): id -> a weak reference. Every update of any of them
# drops the notes of the gradients it read from all (_forget_read): a note kept
# on its own optimizer outlived the update of another optimizer sharing the
# param. One truth test per update call while none holds notes. Kept across
# importlib.reload of this module (IPython's %autoreload 2): a new, empty one
# left the notes of an optimizer made before the reload to outlive the updates
# that made them stale.
_NOTING: dict = _tensors.kept_across_reloads(__name__, "_NOTING", {})


def _note_noting(opt: "_FusedOptimizer") -> None:
    """Registers `opt` as holding notes (before it writes them: a stop landing
    in between leaves it registered with none, which the next update drops)."""
    _NOTING[id(opt)] = weakref.ref(opt)


def _forget_read(running: list, given: dict | None) -> None:
    """Drops from the notes (call key -> _stopped_notes) of every optimizer
    in _NOTING the gradients that the rows of `running` have just updated
    from: a note says a gradient is divided but not yet stepped on, which an
    update without grad_scale, or one of another call or another optimizer
    over the same param, makes stale, and a later scaled step of the noted
    call skipped its division (stepping on g where torch's fused step steps
    on g / scale). An optimizer left with no notes (or freed) leaves _NOTING."""
    grad_of = _grad_getter(given)
    read = {id(grad_of(p)) for plan in running for p in plan.step_params}
    for i, ref in list(_NOTING.items()):
        opt = ref()
        notes = None if opt is None else opt.__dict__.get("_divided_not_stepped")
        for key in list(notes or ()):
            # .get and .pop(key, None): the retry of opt's stopped step in
            # another thread, or that thread's own pass, may take the notes
            # between the list and here (a KeyError out of this update)
            noted = notes.get(key)
            if noted is None:
                continue
            kept = {j: note for j, note in noted.items() if j not in read}
            if notes.get(key) is not noted:
                continue  # taken or replaced meanwhile: not put back as it was
            if kept:
                notes[key] = kept
            else:
                notes.pop(key, None)
        if not notes and _NOTING.get(i) is ref:
            _NOTING.pop(i, None)  # (not del: another thread's pass may have dropped it since)


def _divided_by_stopped_step(stopped: dict, g: torch.Tensor) -> bool:
    """Whether gradient `g` is still as a stopped step left it after its
    division: the same tensor (not another since given its id), neither
    written in place since nor given other memory through .data."""
    ref, version, ptr = stopped.get(id(g), (None, None, None))
    return ref is not None and ref() is g and g._version == version and g.data_ptr() == ptr


class _Plan:
    """The pointer table of one call: one group's parameters of one device and
    dtype, with their state, one row each. Built once and reused while the
    same parameters, storages, layouts and state dicts take part; only the
    gradient pointers are refreshed each step, and a row whose param has no
    gradient sits the step out (prepare_grads), so that a different subset
    with gradients each step (LayerDrop, experts without tokens) reuses the
    plan instead of building one per subset. A param without a gradient when
    the plan is built gets a row only if its state exists as the row needs it
    (torch creates state at a param's first update, not before); otherwise
    its row is dormant, and its first gradient makes the plan stale. `slots`
    are the state keys the group's hyper-parameters need
    (opt._state_slots(group)), `active` the ids of the params with a gradient.
    The state tensors a new plan creates (or converts to float32) go into
    opt.state only at commit_state(), once check() has passed: a refused step
    leaves no state behind. A new SGD momentum buffer, created empty for its
    first update to fill (`fresh`), goes in only once that update has run
    (publish_fresh), as torch stores the buffer its first update makes: one
    in the state before, left by a step interrupted in between (a notebook's
    stop button), would be read as a buffer by the next plan, or saved."""

    def __init__(self, opt: "_FusedOptimizer", group: dict, params: list, slots: tuple,
                 active: set):
        first = params[0]
        self.device = first.device
        self.on_cpu = self.device.type == "cpu"  # read once: .type makes a new str each time
        self.slots = slots
        # None for a dtype the kernels cannot take, of a param put into a group
        # by hand: its rows stay dormant (_check_step refuses it with a gradient)
        self.dtype_code = _tensors.DTYPE_CODES.get(first.dtype)
        self.params = params
        self.param_keys = [_layout_key(p) for p in params]
        # SGD without momentum keeps no state, as in torch: do not create entries;
        # nor for a param without a gradient
        stateless = opt._kind == _SGD and slots[0] is None
        self.state_dicts = [opt.state[p] if id(p) in active and not stateless else opt.state.get(p)
                            for p in params]
        # Gradients are read through contiguous memory for contiguous params and
        # for params updated through a contiguous stand-in; else with p's strides.
        self.grad_contiguous = [key is not None and (p.is_contiguous() or not _tensors.is_dense(p))
                                for p, key in zip(params, self.param_keys)]
        self.staged = []  # (row, param, contiguous stand-in) for params with gaps in memory
        # The strides of each row's state tensors (those of what the kernels update
        # in the param's place), which the Python path checks at each step
        self.state_strides = [None] * len(params)
        self.memory = None  # the _CallMemory of the call, set by _make_plans
        self.table = _tensors.new_table(len(params))
        self.capturable = bool(group.get("capturable", False))
        # The state tensors each row points at, with their column: held, so that
        # the table never points at freed memory, and checked each step (identity
        # and address), so that a tensor the user put in their place, or one whose
        # .data was replaced (state offloaded by hand), is picked up.
        self.watched = []
        # (row, watched entry) of the new SGD buffers, watched once published
        self.fresh = []
        converted_steps: dict = {}  # shared by _step_tensor's calls: see there
        for row, (p, st, key) in enumerate(zip(params, self.state_dicts, self.param_keys)):
            watched = []
            if key is None:  # no memory to point at: its gradient takes the Python path,
                self.watched.append(None)  # whose check refuses it
                continue
            work = _stand_in(p)
            if id(p) not in active and not (self.dtype_code is not None
                                            and opt._has_state(st, work, slots, self.capturable)):
                self.watched.append(None)  # dormant
                continue
            if work is not p:
                self.staged.append((row, p, work))
            self.state_strides[row] = work.stride()
            self.table[row, _COL_PARAM] = work.data_ptr()
            self.table[row, _COL_NUMEL] = p.numel()
            # step first: commit_state adds new state to the dict in this
            # order, which is torch's (its state dicts list "step" first)
            if opt._kind != _SGD:
                step = _step_tensor(st, p, self.capturable, converted_steps)
                self.table[row, _COL_STEP] = step.data_ptr()
                watched.append(("step", step, _COL_STEP))
            row_state = []
            for slot, key in enumerate(slots):
                if key is not None:
                    t = opt._state_tensor(st, key, work, group, self.table[row])
                    row_state.append((key, t))
                    self.table[row, _COL_STATE + slot] = t.data_ptr()
                    entry = (key, t, _COL_STATE + slot)
                    if self.table[row, _COL_FLAGS] & _FRESH_BUFFER:  # (SGD: its only slot)
                        self.fresh.append((row, entry))
                    else:
                        watched.append(entry)
            _refuse_shared_state(p, row_state)
            self.watched.append(tuple(watched))
        # Whether a row writes an inference tensor (a param, state made inside
        # inference_mode), which torch's in-place update refuses outside
        # inference_mode: then check() looks at the mode each step.
        self.inference = (any(t.is_inference() for _, (_, t, _) in self.fresh)
                          or any(p.is_inference() or any(t.is_inference() for _, t, _ in watched)
                                 for p, watched in zip(params, self.watched)
                                 if watched is not None))
        self.rows = None
        self._take_part([row for row, p in enumerate(params) if id(p) in active])
        self.aliased = ()  # set by each prepare_grads

    def _take_part(self, rows: list | None) -> None:
        """Sets the rows of this step's update (None: all): `step_table`, the
        table the core is called with (a copy of those rows when some sit the
        step out), `step_rows` their indices for the C fast path (None: all),
        `step_params` their params and `step_staged` their staged entries.
        Kept while the same rows take part: the fast path writes the gradient
        pointers into the copy, so that the steady state of a model with
        frozen params copies no rows and builds no lists of them. `rows`,
        these four and `guard` are set in one statement: the plan stays
        cached when a KeyboardInterrupt (a notebook's stop button) lands
        here, and every later step raised for the rows of one subset with the
        step table of another."""
        if rows is not None and len(rows) == len(self.params):
            rows = None
        self._sync_flags()
        if rows is None:
            step_rows, step_table = None, self.table
            step_params, step_staged = self.params, self.staged
        else:
            step_rows = np.array(rows, dtype=np.int64)
            step_table = self.table[step_rows]
            step_params = [self.params[r] for r in rows]
            taking_part = set(rows)
            step_staged = [s for s in self.staged if s[0] in taking_part]
        # `guard`, the fast path's layout guard (_keep_guard), knows the rows
        # it was built from: None until the fast path has found these right
        # at a step (False once dropped), set with them, as a guard of other
        # rows would vouch for one row's tensors by another's layouts
        (self.rows, self.step_rows, self.step_table, self.step_params, self.step_staged,
         self.guard) = rows, step_rows, step_table, step_params, step_staged, None

    def _sync_flags(self) -> None:
        """Copies the flags the core cleared in the step table, where it is a
        copy of the rows taking part (a new SGD buffer is filled once), back
        to the table, which the next copy is taken from."""
        if self.rows is not None:
            self.table[self.rows, _COL_FLAGS] = self.step_table[:, _COL_FLAGS]

    @property
    def idle(self) -> bool:
        """Whether no row takes part this step."""
        return not self.step_params

    def check(self, opt: "_FusedOptimizer", hp: tuple) -> None:
        """Raises what torch's update would raise for this update, changing
        nothing: the ValueError with which run() would refuse it
        (hyper-parameters torch refuses at this step), or _check_writable's
        RuntimeError."""
        self._check_writable()
        _C.optim_check(opt._kind, self.dtype_code, self.step_table, hp, self.capturable)

    def _check_writable(self) -> None:
        """Refuses, as torch's in-place ops do, to write an inference tensor of
        a row taking part outside inference_mode: the kernels' raw pointers
        would slip past torch's own check."""
        if not self.inference or torch.is_inference_mode_enabled():
            return
        for row in range(len(self.params)) if self.rows is None else self.rows:
            shape = tuple(self.params[row].shape)
            _tensors.check_writable(self.params[row], f"params: a parameter of shape {shape}")
            for key, t, _ in self.watched[row]:
                _tensors.check_writable(t, f"state[{key!r}] of a parameter of shape {shape}")

    def commit_state(self) -> None:
        """Puts the state tensors the rows of this step point at into the
        state dicts (the other rows' are there already), but new SGD buffers
        (publish_fresh). A param's go in with one dict.update, which a
        KeyboardInterrupt (a notebook's stop button) cannot split: stopped
        between two keys, a first step left a step count without exp_avg,
        state that every later step refused with a KeyError."""
        for row in range(len(self.params)) if self.rows is None else self.rows:
            if self.watched[row]:  # (none for SGD without momentum, which keeps no state)
                self.state_dicts[row].update([(key, t) for key, t, _ in self.watched[row]])

    def publish_fresh(self) -> None:
        """Puts the new SGD buffers that the kernels have filled (they clear
        the row's fresh flag) into the state dicts, watched from now on; the
        others (a row that sat the step out, a step stopped before the
        kernels ran) stay fresh. Idempotent (run's finally does it again after
        a stop button partway through): a row is watched with its buffer once."""
        self._sync_flags()
        unfilled = []
        for row, entry in self.fresh:
            if self.table[row, _COL_FLAGS] & _FRESH_BUFFER:
                unfilled.append((row, entry))
                continue
            key, t, _ = entry
            self.state_dicts[row][key] = t
            if not any(w is entry for w in self.watched[row]):
                self.guard = None  # first: a guard knows the tensors watched before
                self.watched[row] += (entry,)
        self.fresh = unfilled

    def prepare_grads(self, state, given: dict | None = None) -> list | None:
        """Writes this step's gradient pointers into the table: each param's
        .grad, or given[id(param)]; a row without one sits the step out.
        Returns the gradients the table points at (copies included), which the
        caller holds until the update has run: the update releases the GIL,
        and another thread may drop a .grad meanwhile. None when the plan is
        stale (a dormant row has a gradient). The common case (same storages
        and state, contiguous strided gradients, given or not) is checked in
        C, which also writes the pointers into the step table and says
        whether other rows than last step's take part; anything else comes
        here, also a gradient sharing memory that the call writes: its param's,
        which the row reads through a copy that run() fills (`aliased`:
        (param, gradient, copy)), or other memory, refused (_CallMemory)."""
        self.aliased = ()
        read = _C.optim_grad_pointers(
            self.params, self.param_keys, state, self.state_dicts, self.watched,
            self.grad_contiguous, torch.strided, self.table, given, self.step_table,
            self.step_rows, torch.Tensor, self.memory.bounds,
            True if self.guard is None else self.guard or None)
        if read is not None:
            held, rows, checked = read
            if rows is not None:  # other rows than last step's
                self._take_part(rows)
            if checked is not None:
                self._keep_guard(checked)
            return held
        rows, ptrs, keep, aliased = [], [], [], []
        grad_of = _grad_getter(given)
        for row, (p, st, layout, contig, watched, strides) in enumerate(zip(
                self.params, self.state_dicts, self.param_keys, self.grad_contiguous, self.watched,
                self.state_strides)):
            g = p.grad if given is None else given[id(p)]
            if g is None:
                continue
            if watched is None or _layout(p) != layout[:5] or state.get(p) is not st:
                return None
            for key, t, col in watched:
                if st.get(key) is not t or t.data_ptr() != self.table[row, col]:
                    return None
                # a state tensor relaid in place (t_(), as_strided_(), set_(), .data
                # swapped for a view of itself) keeps its identity and address: its
                # elements are no longer where the row reads them (one element has
                # no layout to speak of); nor where it is reshaped or given fewer
                # elements (as_strided_, resize_, set_() onto less memory: the
                # kernels read and wrote numel floats past them), which the new
                # plan's checks refuse as torch's update refuses it
                if col != _COL_STEP and (t.shape != layout[2]
                                         or t.stride() != strides and t.numel() > 1):
                    return None
            _check_grad(p, g)
            if self.memory.check_grad(p, g, grad_of, layout):
                read = _grad_buffer(p, contig)
                aliased.append((p, g, read))
                g = read
            else:
                g = g.resolve_neg()  # (a copy where torch's negative bit is set: memory holds -g)
                if not (g.is_contiguous() if contig else _tensors.same_layout(g, p)):
                    g = g.contiguous() if contig else torch.empty_like(p).copy_(g)
            keep.append(g)
            ptrs.append(g.data_ptr())
            rows.append(row)
        self.table[rows, _COL_GRAD] = ptrs
        self._take_part(rows)
        self.aliased = aliased
        return keep

    def _keep_guard(self, checked: tuple | bool) -> None:
        """Keeps the layout guard the fast path reads rows with, built from
        the tensors it has just found right (`checked`: the param, state
        tensors but step counts, and gradient of each row taking part), or
        drops the one it was given (False: it refused or raised, and a full
        look found the rows right). With it, the fast path looks at each
        row's identities and addresses only, and the guard at all their
        layouts in one call: 2.2x less time for the fast path on 158 small
        params. Dropped until the rows taking part or the state tensors
        watched change: one refusing at each step would cost a second look
        each time."""
        self.guard = checked and _tensors.layout_guard(checked) or False

    def run(self, opt: "_FusedOptimizer", group: dict, hp: tuple, ran: dict | None = None) -> None:
        """Issues the update of this step's rows with `group`'s hyper-parameters
        (hp: their opt._hparams tuple); prepare_grads() must have succeeded
        this step. Under a dispatch mode (allow_mutation_on_saved_tensors())
        what autograd saved of the params and state is cloned first, as
        torch.optim's in-place ops have it cloned, and their versions bumped
        after; otherwise only the params' versions are bumped (a graph rarely
        saves optimizer state, and bumping it too would cost microseconds a
        step). A param that sits the step out is neither written nor bumped,
        as torch leaves it.

        `ran` (fusion's forward mode, which must know whether a stopped
        update was applied): ran[self] = this step's params, stored on the
        kernels' own line, right before their call. A KeyboardInterrupt (a
        notebook's stop button) lands before a line, so never between the
        two; one pressed while the kernels run (most of an update's time)
        is raised as their call returns, after the update, and no check for
        it comes between a dict store and the call (a flag set after the
        call, or by a call before it, would be wrong there)."""
        ran = {} if ran is None else ran  # a caller that does not track it: a throwaway
        if self.aliased:
            self._fill_aliased(opt, group, hp)
        staged = self.step_staged
        for _, p, work in staged:
            work.copy_(p)
        written = self.step_params
        if _tensors.dispatch_mode_active():
            written = self._written()
            _tensors.show_coming_writes(written)
        try:
            with _tensors.profiler_range("reprop.optim.update"):
                if self.on_cpu:
                    args = (opt._kind, self.dtype_code, self.step_table, hp,
                            torch.get_num_threads())
                    ran[self] = self.step_params; _C.optim_step(*args)  # noqa: E702 (see above)
                else:
                    self._run_cuda(opt, group, hp, ran)
            # The rest of the update (the staged params get the update their
            # state has had, new SGD buffers filled go into the state, autograd
            # sees the write: a graph saved before then raises at backward, not
            # reads the new values), done here and, where a KeyboardInterrupt (a
            # notebook's stop button) lands at any line from the kernels' on,
            # again in full in the finally: done there only, a stop at one of
            # its own lines skipped the rest (the version bump: a graph saved
            # before the step then backpropagated through the new values
            # without torch's in-place error). _finish is idempotent.
            self._finish(staged, written); staged = None  # noqa: E702
        except Exception:
            staged = written = ()  # refused (a hyper-parameter) before the kernels wrote
            raise
        finally:
            # (None: finished above; a stop pressed while the kernels run is
            # raised as their call returns, with the update done.) Only once
            # the kernels ran (`ran` notes it on their own line): a stop before
            # them leaves the params as they were, and the version bump then
            # made a graph saved before the step, never applied, raise torch's
            # in-place error at backward.
            if staged is not None and self in ran:
                self._finish(staged, written)

    def _finish(self, staged: list, written: list) -> None:
        """What follows the kernels (see run): idempotent, so that run's
        finally can do it again after a stop partway through."""
        for _, p, work in staged:
            p.copy_(work)
        if self.fresh:
            self.publish_fresh()
        _tensors.bump_versions(written)

    def _fill_aliased(self, opt: "_FusedOptimizer", group: dict, hp: tuple) -> None:
        """Fills the copies through which rows read gradients that share their
        param's memory with what torch's update reads: the gradient as it is
        now (after the updates of earlier calls, as torch's loop reads it), or
        where the update first multiplies the param in place by its decoupled
        weight decay, as it is after that; the param is then put back, for the
        kernels to decay it themselves, also when a KeyboardInterrupt (a
        notebook's stop button) lands in between: the step stopped there left
        it decayed, with its state as before."""
        factor = _decoupled_decay_factor(opt, group, hp)
        for p, g, read in self.aliased:
            if factor is None:
                read.copy_(g)
                continue
            undecayed = p.clone()
            try:
                p.mul_(factor)
                read.copy_(g)
            finally:
                p.copy_(undecayed)
        self.aliased = ()

    def _written(self) -> list:
        """Everything the kernels write this step: the params (a staged one is
        written by run()'s copy_, but listing it costs nothing) and their state."""
        rows = range(len(self.params)) if self.rows is None else self.rows
        return self.step_params + [t for row in rows for _, t, _ in self.watched[row]]

    def _run_cuda(self, opt, group, hp, ran: dict) -> None:
        lr_ptr = _cuda_lr_pointer(opt, group, self.device)
        stream = _tensors.current_stream_handle(self.device)
        with _tensors.on_device(self.device):
            args = (opt._kind, self.dtype_code, self.step_table, hp, self.capturable, stream,
                    lr_ptr)
            ran[self] = self.step_params; _cuda.optim_step(*args)  # noqa: E702 (see run)


def _cuda_lr_pointer(opt, group: dict, device: torch.device) -> int:
    """The address of a capturable group's tensor lr on `device` (0: the lr
    is in the hparams tuple); refuses a tensor lr the kernels cannot read and
    a non-capturable update inside a CUDA graph capture, but SGD's: it has
    no step count to go stale on the host at replay, and its hyper-parameters
    are host floats baked into the launch, as torch's SGD (which has no
    capturable option) bakes its Python floats into the ops it captures. A
    momentum buffer new at the captured step is filled from the gradient at
    every replay (the launch's fresh-buffer flag), as torch's SGD captured at
    its first step clones the gradient into its buffer at every replay."""
    capturable = bool(group.get("capturable", False))
    if capturable and isinstance(group["lr"], torch.Tensor):
        lr = group["lr"]
        if lr.device != device or lr.dtype != torch.float32:
            raise ValueError(f"lr: a tensor lr with capturable=True must be float32 on "
                             f"{device}, got {lr.dtype} on {lr.device}")
        return lr.data_ptr()
    if not capturable and opt._kind != _SGD and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{type(opt).__name__}: capturable=False but a CUDA graph is "
                           "being captured; construct the optimizer with capturable=True")
    return 0


def _decoupled_decay_factor(opt, group: dict, hp: tuple):
    """The factor by which the update multiplies the params in place before
    it reads their gradients (AdamW, Adam with decoupled_weight_decay), as
    the kernels compute it: 1 - lr * weight_decay in double, rounded to
    float32 once (as mul_ rounds a Python float for a float32 tensor), from
    a capturable group's tensor lr as they read it on the device; from
    another tensor lr torch's own tensor ops, in its dtype. None where
    the update reads the gradients first: without decoupled decay, and with
    maximize, for which torch negates them into new tensors first."""
    if (opt._kind != _ADAM or not hp[_HP_DECOUPLED] or hp[_HP_MAXIMIZE]
            or hp[_HP_WEIGHT_DECAY] == 0):
        return None
    weight_decay = float(hp[_HP_WEIGHT_DECAY])
    lr = group["lr"]
    if group.get("capturable", False) and isinstance(lr, torch.Tensor):
        return (1.0 - lr.double() * weight_decay).float()
    if isinstance(lr, torch.Tensor):
        return 1 - lr * weight_decay
    return 1.0 - float(hp[_HP_LR]) * weight_decay


def _grad_buffer(p: torch.Tensor, contiguous: bool) -> torch.Tensor:
    """Memory for a gradient of p laid out as p's row reads one: contiguous,
    or (contiguous False) in p's layout, which is then dense."""
    return torch.empty_like(p, memory_format=torch.contiguous_format if contiguous
                            else torch.preserve_format)


def _stand_in(p: torch.Tensor) -> torch.Tensor:
    """What the kernels update in p's place: p itself when its memory holds
    its values as one gap-free block, else a copy that Plan.run fills from p
    and writes back (copy_ both ways): contiguous for a param with gaps,
    resolved in p's layout for one with torch's lazy negative bit (x.conj().imag,
    whose memory holds -p). The bit is looked at when the plan is built: a
    param only gains it by a .data swap to a negative view of its own memory.
    A copy is a normal tensor also when the plan is built inside
    inference_mode: Plan.run writes it at every step, in any mode."""
    with torch.inference_mode(False):
        if not _tensors.is_dense(p):
            return p.contiguous()  # a copy, which resolves the bit
        return p.resolve_neg()  # p itself where the bit is not set


def _described_param(p: torch.Tensor) -> str:
    """Parameter p for an error message: by its shape, which a lazy module's
    parameter not yet materialized has none of (reading it raises)."""
    if torch.nn.parameter.is_lazy(p):
        return "an uninitialized parameter of a lazy module"
    return f"a parameter of shape {tuple(p.shape)}"


def _by_torch(p: torch.Tensor) -> bool:
    """Whether p is updated by torch's own step() (_FusedOptimizer._torch_update),
    not by the kernels: a float64 parameter, whose update and state the
    kernels would compute in float32 (and every param of a differentiable
    group: _by_torch_in)."""
    return p.dtype == torch.float64


def _by_torch_in(p: torch.Tensor, group: dict) -> bool:
    """Whether p, a param of `group`, is updated by torch's own step() with
    torch's state: _by_torch, or any param of a differentiable=True group,
    whose update autograd must go through as it goes through torch's."""
    return _by_torch(p) or group.get("differentiable", False)


class _Plans(list):
    """The plans of one call (a list of _Plan), and `wide`: the params of the
    call that torch's own step() updates (_by_torch), in their order, which
    have no row in any plan. `slots` and `capturable`: the settings they were
    built for."""

    def __init__(self, plans: list, wide: list, slots: tuple, capturable: bool):
        super().__init__(plans)
        self.wide = wide
        self.slots = slots
        self.capturable = capturable


class _OneGroup:
    """The optimizer `opt` as torch's step() body sees it, with `group` as its
    only param group, and without grad_scale or found_inf (torch's
    non-fused bodies raise for them; reprop's step() has applied them)."""

    grad_scale = found_inf = None

    def __init__(self, opt: torch.optim.Optimizer, group: dict):
        self._opt = opt
        self.param_groups = [group]

    def __getattr__(self, name: str):
        return getattr(self._opt, name)


@functools.cache
def _init_group_lists(torch_class: type) -> int:
    """How many lists torch_class._init_group fills (its arguments after
    self and the group: params, grads, then the state of each kind)."""
    return len(inspect.signature(torch_class._init_group).parameters) - 2


@functools.cache
def _torch_step_body(torch_class: type) -> Callable:
    """torch_class.step without the wrapper torch adds per class at its first
    instance (Optimizer._patch_step_function), which runs the step hooks:
    reprop's own step() has run them."""
    step = torch_class.step
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


@contextlib.contextmanager
def _grads_given(params: list, given: dict | None):
    """Sets each param's .grad to given[id(param)] for the block, where torch's
    step() reads it, and puts the params' own back after."""
    if given is None:
        yield
        return
    own = [p.grad for p in params]
    try:
        for p in params:
            p.grad = given[id(p)]
        yield
    finally:
        for p, g in zip(params, own):
            p.grad = g


def _check_param(p: torch.Tensor, capturable: bool) -> None:
    """Refuses a parameter the fused update cannot take, in a group with this
    `capturable` setting; the caller names the optimizer and group."""
    if torch.nn.parameter.is_lazy(p):
        # only a gradient set by hand gets here (_check_group skips lazy
        # params); torch's update raises ValueError for it too
        raise ValueError("params: an uninitialized parameter of a lazy module has a gradient; "
                         "run a forward pass to materialize it before updating it")
    _check_plain(p, "params", _described_param(p))
    if p.is_complex():
        raise TypeError(f"complex parameters are not supported "
                        f"(got a {p.dtype} parameter of shape {tuple(p.shape)})")
    if not _by_torch(p) and p.dtype not in _tensors.DTYPE_CODES:
        raise TypeError(f"params: expected float32, float16, bfloat16 or float64, got {p.dtype}")
    if capturable and p.device.type != "cuda":
        # torch's update asserts this at each step, so a group switched to
        # capturable by editing param_groups is refused too (by _check_step)
        raise ValueError(f"capturable=True needs CUDA parameters, got a parameter on {p.device}")
    if p.device.type == "cuda" and _cuda is None:
        raise RuntimeError(f"cannot update CUDA parameters: {cuda_missing()}")
    if p.device.type not in ("cpu", "cuda"):
        raise ValueError(f"parameters must be on cpu or cuda, got {p.device}")


def _dispatches(t: torch.Tensor) -> bool:
    """Whether t is a tensor subclass with __torch_dispatch__ (DTensor, FSDP2's
    sharded parameters, TwoTensor): its ops run in Python on the tensors it
    wraps, mostly with no memory of its own (a null data pointer) for the
    kernels to read or update, and writing whatever memory it has would
    bypass it. torch routes a tensor's ops to Python by this same test of its
    type; subclasses with __torch_function__ only (nn.Parameter's) keep plain
    tensors' memory and pass."""
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _check_plain(t: torch.Tensor, name: str, what: str) -> None:
    """Refuses a parameter or gradient that _dispatches."""
    if _dispatches(t):
        raise TypeError(f"{name}: {what} is a {type(t).__name__}, a tensor subclass with "
                        f"__torch_dispatch__; reprop's fused kernels need plain strided tensors "
                        f"(for DTensor and FSDP2 use torch.optim)")


def _check_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """Refuses a gradient the kernels cannot read as p's."""
    _check_plain(g, "grads", f"the gradient of a parameter of shape {tuple(p.shape)}")
    if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
        raise ValueError(f"grads: a gradient of shape {tuple(g.shape)}, {g.dtype} on "
                         f"{g.device} does not match its parameter ({tuple(p.shape)}, "
                         f"{p.dtype} on {p.device})")
    _tensors.check_strided(g, f"gradient of a parameter of shape {tuple(p.shape)}")


def _refuse_state(key: str, value, p: torch.Tensor, expected: str) -> None:
    """Raises RuntimeError, torch's type for state its update cannot read."""
    if isinstance(value, torch.Tensor):
        value = f"a tensor of shape {tuple(value.shape)}, {value.dtype} on {value.device}"
    else:
        value = f"a {type(value).__name__}"
    raise RuntimeError(f"{key}: the state of a parameter of shape {tuple(p.shape)} on {p.device} "
                       f"is {value}; expected {expected}")


def _check_state_tensor(key: str, t, p: torch.Tensor) -> None:
    """Refuses a state tensor that torch's update of p refuses too (its
    in-place ops raise RuntimeError): one of another shape, also one that
    broadcasts, on another device, not floating-point, or sparse. One of
    another floating-point dtype (float64) is converted to float32
    (_state_tensor) and stepped on: torch's update takes one that it
    updates with mul_, add_ or addcmul_, in that dtype, and raises for one it
    lerps into (Adam's exp_avg, centered RMSprop's grad_avg)."""
    if (not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape != p.shape
            or t.device != p.device or t.layout is not torch.strided):
        _refuse_state(key, t, p, "a dense floating-point tensor of the parameter's shape on "
                                 "its device")
    _refuse_dispatching_state(key, t, p)
    # (with one element or none nothing is repeated: zeros_like or clone of a
    # zero-element expanded param keeps its stride 0, as torch's own state
    # does, and torch steps it)
    if 0 in t.stride() and t.numel() > 1:
        _refuse_expanded_state(key, t, p)


def _refuse_expanded_state(key: str, t: torch.Tensor, p: torch.Tensor) -> None:
    """Refuses a state tensor that repeats its elements along a dim (stride
    0: expanded, broadcast_to, or as_strided_ in place), which torch's
    in-place update refuses with this RuntimeError; reprop would train a
    copy in the param's layout that it put in the state in place of the
    user's tensor."""
    dims = _tensors.repeated_dims(t)
    if dims:
        raise RuntimeError(f"{key}: the state of a parameter of shape {tuple(p.shape)} on "
                           f"{p.device} is expanded (stride 0 along dims {dims}): more than one "
                           f"element of the written-to tensor refers to a single memory location, "
                           f"which torch's in-place update refuses with this RuntimeError; give "
                           f"it memory of its own (.clone())")


def _refuse_dispatching_state(key: str, t: torch.Tensor, p: torch.Tensor) -> None:
    """State the kernels cannot point at (_dispatches: a DTensor loaded from a
    sharded model's state dict), refused naming the key as other state is,
    not met as a null pointer by the core."""
    if _dispatches(t):
        _refuse_state(key, t, p, f"a plain tensor, not a {type(t).__name__} (a tensor subclass "
                                 "with __torch_dispatch__: reprop's fused kernels need plain "
                                 "strided tensors; convert it, .full_tensor() for a DTensor, or "
                                 "use torch.optim)")


def _check_step_count(step, p: torch.Tensor) -> None:
    """Refuses a state["step"] that is not one real number (torch's Adam and
    Adagrad read it with .item(), which raises for any other tensor)."""
    if isinstance(step, torch.Tensor):
        if step.numel() == 1 and not step.is_complex():
            _refuse_dispatching_state("step", step, p)
            return
    elif isinstance(step, (int, float)):
        return
    _refuse_state("step", step, p, "a number or a one-element tensor")


def _ordered_runs(params: list, state, slots: tuple) -> list[list]:
    """`params` (of one device and dtype) as runs to update one after another.
    torch updates a group's params in turn, so where two overlap in memory
    (tied weights, one a transposed or column view of the other) the later
    one's update starts from the earlier one's result. One fused call updates
    all its params at once, and its staging copies of params with gaps
    (Plan.run) would write back stale values over another's update, so each
    param goes into the run after the latest run of an earlier param it
    overlaps; params that overlap nothing all stay in the first, which is the
    common case: one run, no cost per step. Spans are compared, so
    interleaved views that share no element are ordered too, harmlessly.
    A param's memory includes its state tensors of `slots` in `state`: one
    tensor put in as several params' state (made by hand: one momentum
    buffer for all) is read and written by each update in turn in torch,
    while one call's rows raced on it (its threads, CUDA's blocks)."""
    overlapped_by = [[] for _ in params]  # the earlier params each one overlaps
    open_spans: list = []  # (end, index) of the spans the next one may overlap
    for (start, end), i in sorted(_memory_spans(params, state, slots)):
        open_spans = [(e, j) for e, j in open_spans if e > start]
        for _, j in open_spans:
            if j != i:  # (a param's own state: _refuse_shared_state)
                overlapped_by[max(i, j)].append(min(i, j))
        open_spans.append((end, i))
    run_of: list = []
    for earlier in overlapped_by:
        run_of.append(max((run_of[j] + 1 for j in earlier), default=0))
    runs: list = [[] for _ in range(max(run_of) + 1)]
    for p, r in zip(params, run_of):
        runs[r].append(p)
    return runs


def _memory_spans(params: list, state, slots: tuple) -> Iterable[tuple]:
    """(span, i) for the memory of params[i] and of each of its state tensors
    of `slots` that has some on its device: what its update writes."""
    for i, p in enumerate(params):
        if not _has_memory(p):
            continue
        st = state.get(p) or {}
        for t in (p, *(st.get(key) for key in slots if key is not None)):
            if (isinstance(t, torch.Tensor) and t.layout is torch.strided and t.numel()
                    and t.device == p.device and not _dispatches(t)):
                yield _tensors.byte_span(t), i


def _refuse_shared_state(p: torch.Tensor, row_state: list) -> None:
    """Refuses a row whose state tensors (key, tensor) share memory with each
    other or with param p (state made by hand: exp_avg_sq = exp_avg, or
    p.detach()): torch's ops write them one after another, each reading what
    the one before wrote, where the kernels read all of an element's values
    before writing any (Adam gave NaN). Other params' state: _ordered_runs."""
    spans = [(_tensors.byte_span(t), key) for key, t in [(None, p), *row_state] if t.numel()]
    for k, ((start, end), key) in enumerate(spans):
        for (other_start, other_end), other in spans[:k]:  # (key is a state's: p is first)
            if start < other_end and other_start < end:
                other = "the parameter" if other is None else f"its {other}"
                raise ValueError(f"{key}: the state of a parameter of shape {tuple(p.shape)} "
                                 f"shares memory with {other} (state made by hand); the fused "
                                 f"update reads an element's state all at once where torch's "
                                 f"ops write one tensor after another: give each state tensor "
                                 f"memory of its own")


def _keep_float32_state(state: dict, loaded: dict) -> None:
    """Puts the floating state (but "step") of low-precision params, which
    torch's load_state_dict cast to their dtype, into `state` (what it hands
    to __setstate__) as float32 copies of their values in `loaded`, the
    state dict it loaded: reprop keeps their state in float32 (float64
    params and differentiable groups' keep torch's, which torch's step()
    updates: _by_torch_in)."""
    saved_ids = (i for g in loaded["param_groups"] for i in g["params"])
    params = ((p, g) for g in state["param_groups"] for p in g["params"])
    for pid, (p, group) in zip(saved_ids, params):
        saved = loaded["state"].get(pid)
        if not saved or p.dtype == torch.float32 or _by_torch_in(p, group):
            continue
        st = state["state"][p]
        for key, value in saved.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                st[key] = value.detach().to(device=p.device, dtype=torch.float32, copy=True)


def _check_grad_types(grads: list) -> None:
    """Refuses a given gradient that is not a tensor (or None: skip its param)."""
    for i, g in enumerate(grads):
        if g is not None and not isinstance(g, torch.Tensor):
            raise TypeError(f"grads[{i}]: expected a tensor or None, got {type(g).__name__}")


def _check_distinct(params: list) -> None:
    """Refuses a parameter listed twice in one step_params call, as groups
    refuse one listed twice: one fused call would give it two table rows,
    updating it twice, each row with state of its own."""
    if len(set(map(id, params))) == len(params):
        return
    first: dict = {}
    for i, p in enumerate(params):
        j = first.setdefault(id(p), i)
        if j != i:
            raise ValueError(f"params[{i}]: the same parameter as params[{j}]; each parameter "
                             "may be updated once per call")


def _prepare_grads(plans: list | None, state, given: dict | None) -> list | None:
    """Prepares each plan's gradients for this step; returns the gradients to
    hold until the update has run, or None when there is no plan yet or one
    of them is stale (also where a param torch's step() updates no longer
    is one, its .data replaced)."""
    if plans is None or plans.wide and not all(map(_by_torch, plans.wide)):
        return None
    keep = []
    for plan in plans:
        held = plan.prepare_grads(state, given)
        if held is None:
            return None
        keep.append(held)
    return keep


def _running(plans: list) -> list:
    """The plans with rows taking part this step (prepare_grads has run)."""
    return [plan for plan in plans if not plan.idle]


def _by_group(params: list, group_of: dict) -> Iterable[tuple]:
    """(group, its params) for `params`, each in its group per `group_of`
    (id(param) -> group), the groups in the order of their first param; a
    param without a group is refused, naming it."""
    one = _one_group(params, group_of)
    if one is not None:  # (the common case: fused updates call one module's params)
        return ((one, list(params)),)
    groups: dict = {}
    for i, p in enumerate(params):
        group = group_of.get(id(p))
        if group is None:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}]: expected a parameter of this optimizer, "
                                f"got {type(p).__name__}")
            raise ValueError(f"params[{i}]: not a parameter of this optimizer "
                             f"({_described_param(p)})")
        groups.setdefault(id(group), (group, []))[1].append(p)
    return groups.values()


def _one_group(params: list, group_of: dict) -> dict | None:
    """The group of every one of `params` where they share one, else None:
    _by_group's answer without building a dict and a list per param (half
    its time on a module's two params)."""
    group = group_of.get(id(params[0])) if params else None
    for p in params:
        if group_of.get(id(p)) is not group:
            return None
    return group


def _grad_getter(given: dict | None) -> Callable:
    """param -> its gradient this step: .grad, or given[id(param)] (None
    for a param given none)."""
    if given is None:
        return lambda p: p.grad
    return lambda p: given.get(id(p))


def _with_grad(params: list, given: dict | None) -> list:
    """The params with a gradient: .grad, or given[id(param)]."""
    if given is None:
        return [p for p in params if p.grad is not None]
    return [p for p in params if given[id(p)] is not None]


def _step_device(p: torch.Tensor, capturable: bool) -> torch.device:
    """Where the core counts p's steps: on its device when capturable, else
    on the CPU (as torch places them)."""
    return p.device if capturable else torch.device("cpu")


def _usable_step(step, p: torch.Tensor, capturable: bool) -> bool:
    """Whether state["step"] is the float32 0-dim tensor the core counts in."""
    return (isinstance(step, torch.Tensor) and step.dtype == torch.float32
            and step.device == _step_device(p, capturable) and step.dim() == 0
            and not step.is_neg())


def _step_tensor(st: dict, p: torch.Tensor, capturable: bool, converted: dict) -> torch.Tensor:
    """state["step"] as the float32 0-dim tensor the core counts in; a new
    tensor when st has none or one of another kind. A tensor of another kind
    that several params share (state made by hand) stays shared: it is
    converted once, into converted[id(tensor)], which the params of one plan
    share (so torch's count of it once per param, in turn, holds)."""
    device = _step_device(p, capturable)
    step = st.get("step")
    if not isinstance(step, torch.Tensor):
        return torch.tensor(float(step or 0.0), dtype=torch.float32, device=device)
    if _usable_step(step, p, capturable):
        return step
    if id(step) not in converted:
        converted[id(step)] = step.detach().to(device=device, dtype=torch.float32).reshape(()).clone()
    return converted[id(step)]


def _check_shared_steps(state, runs: list, capturable: bool) -> None:
    """Refuses a step tensor shared by several params (only state made by
    hand shares one) where the update cannot count it once per param in
    turn, each update seeing its own count, as torch's loop does (the core
    does so within one run's call): across runs, whose calls each count
    their own params, in another order than the group's; nor in a capturable
    run, whose device counters one launch increments at once."""
    owner: dict = {}  # id(step tensor) -> the index of the run of its first param
    for i, run in enumerate(runs):
        for p in run:
            step = state.get(p, {}).get("step")
            if not isinstance(step, torch.Tensor):
                continue
            if id(step) in owner and (owner[id(step)] != i or capturable):
                raise ValueError(
                    "step: several parameters share one step tensor (state made by hand); "
                    "torch counts it once per parameter in turn, which the fused update "
                    "matches only for parameters of one device and dtype whose memory and "
                    "other state do not overlap, and without capturable=True: give each "
                    "parameter a step tensor of its own")
            owner[id(step)] = i


def _usable_state(t, work: torch.Tensor) -> bool:
    """Whether state tensor t is one a row can point at as it is: float32,
    laid out like `work` (what the kernels update in the param's place) on
    its device, and without torch's negative bit."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t.is_neg()
            and t.device == work.device and _tensors.same_layout(t, work))


# The one-row tables of _FusedOptimizer._check_hparams, made once (optim_check
# reads a table and changes nothing in it): a row without a step count, one
# of a new SGD buffer, and one pointing at a count of 0 (the first), which
# the core advances and puts back, under the GIL (optim_check keeps it).
_NO_COUNT_ROW = _tensors.new_table(1)
_FRESH_BUFFER_ROW = _tensors.new_table(1)
_FRESH_BUFFER_ROW[0, _COL_FLAGS] = _FRESH_BUFFER
_FIRST_COUNT = np.zeros(1, dtype=np.float32)
_FIRST_COUNT_ROW = _tensors.new_table(1)
_FIRST_COUNT_ROW[0, _COL_STEP] = _FIRST_COUNT.ctypes.data


def _first_count_is_worst(kind: int, hparams: tuple) -> bool:
    """Whether these values, which torch's constructor takes (Adam: betas in
    [0, 1) but beta2 = 1 too, Adagrad: lr_decay >= 0), pass the core's
    per-step checks at every count >= 1 if they pass at the first: Adam's
    step size lr / (1 - beta1 ** t) is largest at t = 1 and 1 - beta2 ** t
    never negative, Adagrad's 1 + (t - 1) * lr_decay is at least 1. (A count
    below 0, set by hand, may still be refused by the update itself.)"""
    if kind == _ADAM:
        return 0 <= hparams[_HP_BETA1] < 1 and 0 <= hparams[_HP_BETA2] <= 1
    return hparams[_HP_LR_DECAY] >= 0


def _count_table(state, params: list) -> tuple:
    """(float32 step counts, a table of one row per param pointing at its
    count there) for the core's per-step checks: each param's count as its
    next update reads it (0 without state), one slot per step tensor, which
    state made by hand may share (the core counts a shared one once per row,
    as the update does). A count that is not one number is left to the
    update's own check (_check_step_count): its row points at none."""
    slots: dict = {}
    values: list = []
    rows: list = []
    for p in params:
        step = (state.get(p) or {}).get("step", 0)
        if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex():
            key = id(step)
        elif isinstance(step, (int, float)) and not isinstance(step, bool):
            key = None  # a number: its own count
        else:
            continue
        if key is None or key not in slots:
            values.append(float(step))
            if key is not None:
                slots[key] = len(values) - 1
        rows.append(len(values) - 1 if key is None else slots[key])
    counts = np.array(values, dtype=np.float32)
    table = _tensors.new_table(max(len(rows), 1))
    if rows:
        table[:len(rows), _COL_STEP] = counts.ctypes.data + 4 * np.array(rows, dtype=np.int64)
    return counts, table


class _PlanCache:
    """The plans of update calls, by key (id(group), ids of the call's
    params packed as bytes by _C.optim_call_key, which hash and compare in
    bulk: a tuple of ids cost 30 ns a param each step, most of what a frozen
    param left in the optimizer cost), bounded by the table rows they hold
    rather than by their number, and evicting the least recently used. A
    stable working set is never evicted however large the model (one plan
    per module of a fused model of thousands: a cache cleared when full
    rebuilt every plan every step), as long as it fits the budget, which
    grows with the optimizer's parameter count (set_budget); calls with ever
    new lists of params (step_params on changing subsets) cannot grow memory
    beyond it."""

    def __init__(self):
        self._entries: dict = {}  # key -> [plans, rows, last use]
        # The rows of all the entries (see rows); None while they change: a
        # KeyboardInterrupt (a notebook's stop button) between an entry's
        # change and the count's left the count off for good (too low, the
        # cache outgrew its budget; too high, it evicted early)
        self._rows = 0
        self._clock = 0
        self._budget = _MIN_PLAN_ROWS

    def get(self, key: tuple) -> list | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        # a use count, not a move to the end of the dict: hashing the key again
        # would cost O(params) a call
        self._clock += 1
        entry[2] = self._clock
        return entry[0]

    def put(self, key: tuple, plans: list) -> None:
        """Caches `plans` (replacing a stale entry of the key), then evicts
        others while over budget."""
        self._clock += 1
        # a param torch's step() updates (plans.wide) counts as a row: the
        # entry holds it, and entries of such params only must be bounded too
        rows = sum(len(plan.params) for plan in plans) + len(plans.wide)
        old = self._entries.get(key)
        total = self.rows + rows - (0 if old is None else old[1])
        self._rows = None
        self._entries[key] = [plans, rows, self._clock]
        self._rows = total
        if total > self._budget:
            self._evict(keep=key)

    def _evict(self, keep: tuple) -> None:
        """Drops the least recently used entries, never `keep`, down to 3/4 of
        the budget: in batches, so that a stream of new keys costs one sort
        per batch, not one scan per key."""
        target = self._budget * 3 // 4
        total = self.rows
        self._rows = None
        for key, entry in sorted(self._entries.items(), key=lambda item: item[1][2]):
            if total <= target:
                break
            if key is not keep:
                del self._entries[key]
                total -= entry[1]
        self._rows = total

    def set_budget(self, params: int) -> None:
        """Bounds the rows held for an optimizer of `params` parameters."""
        self._budget = max(_MIN_PLAN_ROWS, _PLAN_ROWS_PER_PARAM * params)

    def retain(self, keep: Callable[[list], bool]) -> None:
        """Drops the entries whose plans fail `keep` (counted again at the next use)."""
        self._rows = None
        for key in [k for k, entry in self._entries.items() if not keep(entry[0])]:
            del self._entries[key]

    def clear(self) -> None:
        self._rows = None
        self._entries.clear()
        self._rows = 0

    @property
    def rows(self) -> int:
        """The table rows of all the plans held (a param torch's step()
        updates counting as one)."""
        if self._rows is None:
            self._rows = sum(entry[1] for entry in self._entries.values())
        return self._rows

    def __len__(self) -> int:
        return len(self._entries)


class _FusedOptimizer:
    """The fused step shared by all reprop optimizers; mixed in before the torch class."""

    _kind: int
    _torch_class: type
    # Whether step() follows torch's fused-optimizer AMP protocol (see
    # _grad_scaling): torch's classes with a fused implementation do.
    _reads_grad_scale = False
    # True while reprop.fuse fuses this optimizer (set and cleared by
    # fusion.py): no fused update is differentiable, so a differentiable
    # group is then refused (add_param_group, load_state_dict).
    _in_fusion = False

    def __init_subclass__(cls, **kwargs):
        """Gives each reprop class (one that names its _torch_class) torch's
        constructor, signature and docstring, followed by the fused setup. A
        user's subclass inherits that constructor, or defines its own that
        calls it through super(), as with torch.optim subclasses."""
        super().__init_subclass__(**kwargs)
        if "_torch_class" not in cls.__dict__ or "__init__" in cls.__dict__:
            return
        base_init = cls._torch_class.__init__

        @functools.wraps(base_init)
        def __init__(self, *args, **kw):
            base_init(self, *args, **kw)
            self._check_groups(self.param_groups)
            self._setup_fused()

        cls.__init__ = __init__

    def _setup_fused(self) -> None:
        # GradScaler unscales the gradients and skips step() itself, as for
        # torch's non-fused optimizers (the flow reprop.fuse builds on), rather
        # than hand step() its grad_scale and found_inf (_grad_scaling)
        self._step_supports_amp_scaling = False
        self._plans = _PlanCache()
        self._divided_not_stepped: dict = {}  # call key -> _stopped_notes
        # What _follow_param_groups last saw: (ids of the group and
        # its params list, len of the list) of each group, and the ids of all
        # params in groups.
        self._groups_seen: list | None = None
        self._members: set = set()
        self._group_of: dict | None = None
        if _FusedOptimizer._forget_plans not in self._optimizer_load_state_dict_post_hooks.values():
            self.register_load_state_dict_post_hook(_FusedOptimizer._forget_plans)

    def __setstate__(self, state: dict) -> None:
        """copy.deepcopy and unpickling (torch.save of the optimizer): torch
        keeps only defaults, state and param_groups; set up the rest again.
        torch's load_state_dict ends here too, with the loaded groups and
        state: a group we refuse is refused before either replaces ours, so
        the optimizer stays as it was; the state of low-precision params is
        taken in float32 from the dict loaded (see load_state_dict), before
        Adagrad's setup would reset a `sum` in their dtype and before the
        post-hooks see it."""
        self._check_groups(state["param_groups"])
        loading = self.__dict__.get("_loading")
        if loading is not None:
            _keep_float32_state(state, loading)
        super().__setstate__(state)
        self._setup_fused()

    def _check_groups(self, groups: list) -> None:
        for group in groups:
            self._check_group(group)

    def _check_group(self, group: dict) -> None:
        if group.get("differentiable", False):
            if self._in_fusion:
                raise ValueError(f"{type(self).__name__}: differentiable=True is not supported "
                                 f"while fused by reprop.fuse: no fused update is "
                                 f"differentiable; remove() the fusion first")
            return  # torch's step() body updates it (_update_differentiable), with its checks
        if len({id(p) for p in group["params"]}) != len(group["params"]):
            # torch warns that this will be an error; one fused call would update
            # the parameter twice at once, not twice in a row as torch's loop does
            raise ValueError(f"{type(self).__name__}: params: a parameter appears more than once "
                             "in a group")
        capturable = bool(group.get("capturable", False))
        try:
            # a lazy module's parameter, as torch.optim takes it before the first
            # forward, is checked once materialized, at its first update (_check_step)
            for p in group["params"]:
                if not torch.nn.parameter.is_lazy(p):
                    _check_param(p, capturable)
        except (TypeError, ValueError, RuntimeError) as e:
            raise type(e)(f"{type(self).__name__}: {e}") from None

    def add_param_group(self, param_group: dict) -> None:
        if not hasattr(self, "_plans"):  # torch's __init__ calls this before _setup_fused
            super().add_param_group(param_group)
            return
        groups = len(self.param_groups)
        try:
            super().add_param_group(param_group)
            self._check_group(self.param_groups[-1])  # as torch normalized it
        except BaseException:
            # a refused group is not kept, nor one torch added unchecked when a
            # KeyboardInterrupt (a notebook's stop button) landed in between
            del self.param_groups[groups:]
            raise
        self._forget_plans()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, keeping state float32 for low-precision
        params (torch casts it to the param's dtype, which would lose bits).
        A pre-hook that runs after the user's notes the dict they leave (the
        one torch loads), from which __setstate__, where torch's load ends
        before its post-hooks, takes that state in float32: the pre-hooks'
        changes are kept, and the post-hooks see, and may change, the state
        the optimizer keeps, as with torch."""
        handle = self.register_load_state_dict_pre_hook(_FusedOptimizer._note_loading)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()
            self.__dict__.pop("_loading", None)

    def _note_loading(self, state_dict: dict) -> None:
        self._loading = state_dict

    def _forget_plans(self) -> None:
        self._plans.clear()
        self._group_of = None

    # Under torch.compile, one graph break that runs the step eagerly: traced,
    # each C call broke the graph with dynamo's warning to wrap reprop._C as a
    # custom operator or file a PyTorch issue, and the Python between them
    # was compiled and recompiled per parameter up to dynamo's recompile limit.
    @_tensors.eager_under_compile
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One fused update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_param_groups()
        scaling = self._grad_scaling()
        for group in self.param_groups:
            self._update(group, group["params"], scaling=scaling)
        return loss

    def _grad_scaling(self) -> _Scaling | None:
        """What the `grad_scale` and `found_inf` attributes ask of this step(),
        as torch's fused step() reads them: GradScaler.step() sets them on an
        optimizer whose _step_supports_amp_scaling is true (ours is not:
        GradScaler unscales and skips for it), a user may set them by hand.
        None when neither is set: the gradients are taken as they are.
        found_inf is read on the host (a sync where it is on a GPU), so the
        step cannot be captured in a CUDA graph, whose replays would all
        repeat the capture's decision."""
        if not self._reads_grad_scale:
            return None
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if grad_scale is None and found_inf is None:
            return None
        name = type(self).__name__
        grad_scale = _amp_tensor(grad_scale, f"{name}: grad_scale")
        found_inf = _amp_tensor(found_inf, f"{name}: found_inf")
        if found_inf is None:
            return _Scaling(False, grad_scale)
        # is_initialized, not is_available: a capture needs CUDA initialized, and
        # is_available() initializes the driver (cudaGetDeviceCount) on a CUDA
        # build, so a CPU step would leave the process unable to fork CUDA users
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{name}: found_inf is set, but reprop reads it on the host, which "
                               "a CUDA graph capture cannot: use torch.optim's fused optimizer")
        # Any non-zero value skips, as GradScaler skips a step where the found_inf
        # of its devices sum to non-zero; torch's kernels skip only at 1.0
        return _Scaling(found_inf.item() != 0, grad_scale)

    @torch.no_grad()
    def step_params(self, params: Iterable[torch.Tensor], settings: dict | None = None,
                    grads: Iterable[torch.Tensor] | None = None) -> None:
        """Updates just these parameters now, each with its group's settings.

        Each parameter must belong to this optimizer; those without a gradient
        are skipped. Updating every parameter once this way equals one step().
        `settings` optionally maps id(group) to the hyper-parameters to use
        instead of the group's current ones (a dict with all of them, such as
        a copy of the group): a deferred update applies the lr etc. of the
        moment it was decided, not what a scheduler set since.
        `grads`, when given, are the gradients to apply instead of each
        parameter's .grad (e.g. a DDP bucket's all-reduced gradients)."""
        params = list(params)
        _check_distinct(params)
        self._follow_param_groups(params)
        given = None
        if grads is not None:
            grads = list(grads)
            if len(grads) != len(params):
                raise ValueError(f"grads: expected {len(params)} gradients, got {len(grads)}")
            _check_grad_types(grads)
            given = {id(p): g for p, g in zip(params, grads)}
        if settings is not None and not isinstance(settings, dict):
            raise TypeError(f"settings: expected a dict mapping id(group) to that group's "
                            f"hyper-parameters, got {type(settings).__name__}")
        self._step_in_groups(params, self._group_map(), settings, given)

    def _group_map(self) -> dict:
        """id(param) -> its group, as step_params looks groups up (built at
        the first call after the groups changed)."""
        if self._group_of is None:
            self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        return self._group_of

    @torch.no_grad()
    def _step_in_groups(self, params: list, group_of: dict, settings: dict | None = None,
                        given: dict | None = None) -> None:
        """step_params with each parameter's group looked up in `group_of`
        (id(param) -> group) rather than in the current param_groups: a
        deferred update runs in the group it was decided in, also when that
        group has left the optimizer since."""
        # every group's settings are checked before any group is updated
        updates = [(group, ps, self._settings_of(settings, group))
                   for group, ps in _by_group(params, group_of)]
        for group, ps, hp in updates:
            self._update(group, ps, hp, given)

    def _settings_of(self, settings: dict | None, group: dict) -> dict | None:
        """settings[id(group)] (None: use the group's own), refused unless it
        is a dict with every hyper-parameter the group has: a key left out
        would raise KeyError in the update (lr) or silently take its default
        (weight_decay 0) instead of the group's value."""
        hp = settings.get(id(group)) if settings else None
        if hp is None:
            return None
        if not isinstance(hp, dict):
            raise TypeError(f"settings: expected a dict of hyper-parameters for "
                            f"{self._group_name(group)}, got {type(hp).__name__}")
        missing = (self.defaults.keys() & group.keys()) - hp.keys()
        if missing:
            raise ValueError(f"settings: the hyper-parameters given for {self._group_name(group)} "
                             f"lack {', '.join(map(repr, sorted(missing)))}")
        return hp

    def _update(self, group: dict, params: list, settings: dict | None = None,
                given: dict | None = None, scaling: _Scaling | None = None,
                ran: dict | None = None) -> None:
        """Updates `params` of `group` with its hyper-parameters (or those in
        `settings`), from their gradients (or those `given`), as `scaling`
        says (step(): torch's fused AMP protocol). `ran`: a dict in which
        each call of the kernels notes the params it updates (_Plan.run), so
        that a caller stopped (a notebook's stop button) knows which were."""
        if _tensors.fake_mode_active():
            self._refuse_fake_mode()
        hp = group if settings is None else settings
        if group.get("differentiable", False):
            self._update_differentiable(hp, params, given, scaling, ran)
            return
        # Keyed by all the params of the call, not those with a gradient: a plan
        # per subset would be built (O(params)) and kept for every new subset
        # with gradients; its rows without one sit the step out. A cached plan
        # reads each gradient once, in C, also to find that none has one.
        key = (id(group), _C.optim_call_key(params))
        stopped, divided = {}, []  # see _unscale_grads
        try:
            plans = self._plans.get(key)
            keep = _prepare_grads(plans, self.state, given)
            running = None if keep is None else _running(plans)
            wide = None if keep is None else plans.wide and _with_grad(plans.wide, given)
            if not (_with_grad(params, given) if keep is None else running or wide):
                return  # no param of the call has a gradient
            # a bad lr refuses the step before any state exists (self._hparams, inlined)
            hparams = _C.optim_hparams(hp) or _hparams_of(hp)
            # Hyper-parameters decide which state exists (SGD momentum, amsgrad, ...)
            slots = self._state_slots(hp)
            # first use, a first gradient, a storage or state tensor replaced, other
            # state, capturable switched (step counts on another device; a CPU group
            # is refused, as torch's update refuses it)
            new_plans = (keep is None or plans.slots != slots
                         or plans.capturable != bool(hp.get("capturable", False)))
            if new_plans:
                active = _with_grad(params, given)
                self._check_step(hp, active, given, slots)
                plans = self._make_plans(hp, params, active, slots, hparams, given)
                keep = _prepare_grads(plans, self.state, given)
                running = _running(plans)
                wide = _with_grad(plans.wide, given)
            # each call checks its own: let none run if one refuses (one that may
            # write inference tensors is checked alone too: run() does not)
            if len(running) > 1 or (running and running[0].inference):
                for plan in running:
                    plan.check(self, hparams)
            scale = None
            if scaling is not None:
                if scaling.skip:
                    # as torch's fused kernels skip: state a new plan made (Adam's
                    # zeros, at step 0) stays, as torch's _init_group made it; a new
                    # SGD buffer, never filled, is not published
                    if wide:
                        self._init_torch_state(hp, wide, given)
                    running = wide = []
                elif scaling.scale is not None:
                    stopped = self._divided_not_stepped.pop(key, {})
                    _unscale_grads(running, scaling.scale, stopped, divided)
                    scale = scaling.scale
                    # again: gradient copies (another layout, memory shared with the
                    # param) were made from the scaled ones
                    keep = _prepare_grads(plans, self.state, given)
            for plan in running:
                plan.run(self, hp, hparams, ran)
            if wide:
                self._torch_update(hp, wide, given, ran, scale)
            divided = []
            if _NOTING and running:  # (only after a stopped scaled step, of any optimizer)
                _forget_read(running, given)
            if new_plans:
                self._cache_plans(key, plans)
        except BaseException as e:
            if divided or stopped:  # gradients divided, the update not finished (see _unscale_grads)
                _note_noting(self)
                self._divided_not_stepped[key] = _stopped_notes(stopped, divided)
            if not isinstance(e, (TypeError, ValueError, OverflowError)):
                raise
            raise self._refusal(group, e) from None
        del keep  # the gradients read (and copies): only now may they be freed

    def _refusal(self, group: dict, e: Exception) -> Exception:
        """Refusal `e` (a TypeError, OverflowError or ValueError) of an update
        of `group`, again with the optimizer and the group named."""
        refusal = next(t for t in (TypeError, OverflowError, ValueError) if isinstance(e, t))
        return refusal(f"{type(self).__name__}: {self._group_name(group)}: {e}")

    def _torch_update(self, hp: dict, params: list, given: dict | None,
                      ran: dict | None, scale: torch.Tensor | None) -> None:
        """Updates `params` (each with a gradient: float64 ones, _by_torch, or
        a differentiable group's, _update_differentiable) by torch's own
        step() body on a group of just them with the hyper-parameters
        `hp`: torch's bits (its for-loop, foreach or fused implementation, as
        the group's flags and the params' device choose it, as torch's step()
        chooses), its state created and kept as torch keeps it. Their
        gradients are first divided by `scale` (step()'s grad_scale), right
        before the update: one refused before then is not divided twice by a
        step() again. `ran` notes them (see _Plan.run)."""
        if scale is not None:
            _unscale_wide(params, scale, given)
        view = _OneGroup(self, {**hp, "params": params})
        with _grads_given(params, given):
            if ran is not None:
                ran[_OneGroup] = params
            _torch_step_body(self._torch_class)(view)

    def _init_torch_state(self, hp: dict, params: list, given: dict | None) -> None:
        """Makes the state that torch's fused step() makes for `params` (as
        _torch_update takes them) before its kernels skip the step for
        found_inf: its _init_group's, for the group's flags (Adam's zero
        moments at step 0, Adagrad's `sum` for a group added since the
        constructor; SGD's makes none, as the kernels' groups publish no
        buffer never filled), so that a skipped first step leaves torch's
        state dict and the next step starts from it."""
        view = _OneGroup(self, {**hp, "params": params})
        lists = ([] for _ in range(_init_group_lists(self._torch_class)))
        with _grads_given(params, given):
            self._torch_class._init_group(view, view.param_groups[0], *lists)

    def _update_differentiable(self, hp: dict, params: list, given: dict | None,
                               scaling: _Scaling | None, ran: dict | None) -> None:
        """_update of a differentiable=True group: all its params with a
        gradient, of any dtype, by torch's own step() body (_torch_update),
        which records the update for autograd as torch's does (grad mode as
        torch's step() sets it, from the optimizer's defaults), with torch's
        state; grad_scale and found_inf as the other groups follow them."""
        active = _with_grad(params, given)
        if not active:
            return
        if scaling is not None and scaling.skip:
            self._init_torch_state(hp, active, given)
            return
        self._torch_update(hp, active, given, ran, None if scaling is None else scaling.scale)

    def _check_hparams(self, group: dict, settings: dict, params: list) -> None:
        """Raises what an update of `params` (of `group`, each with a
        gradient) with `settings` (the group's hyper-parameters, or a copy of
        them) would raise for the hyper-parameters, changing nothing, named as
        that update names it: _hparams' conversion (a string lr), then the
        core's checks (_check_kernel_hparams), without a plan: for an update
        decided now and run later (fusion's forward mode, whose step() must
        refuse what eager's step() refuses). The core's checks are those of
        the kernels' calls: one refused where float64 params take part is
        looked at again without them (torch's step() updates them, in
        float64, as _update has it: lr = 1e39 trains them, as torch's does),
        so the common case scans no param's dtype."""
        try:
            try:
                self._check_kernel_hparams(settings, params)
            except (TypeError, ValueError, OverflowError):
                kernel = [p for p in params if not _by_torch(p)]
                if len(kernel) == len(params):
                    raise
                self._hparams(settings)  # (_update converts them for any call)
                if kernel:
                    self._check_kernel_hparams(settings, kernel)
        except (TypeError, ValueError, OverflowError) as e:
            raise self._refusal(group, e) from None

    def _check_kernel_hparams(self, settings: dict, params: list) -> None:
        """_check_hparams for `params` that the kernels update: _hparams'
        conversion, then the core's checks (optim_check: a constant beyond
        float32, Adam's bias correction of zero or complex at each param's
        next step count, Adagrad's 1 + (step - 1) * lr_decay of zero). The
        core checks the step counts one row each; where the values leave no
        count to fail but the first (_first_count_is_worst), one row at the
        first count tells, so the common case reads no param's state."""
        kind = self._kind
        hparams = self._hparams(settings)
        capturable = bool(settings.get("capturable", False))
        table = _NO_COUNT_ROW
        if kind == _SGD:
            # 1 - dampening is read only by an update into an existing buffer
            # (a loop, not any() of a generator: a microsecond less a step)
            if hparams[_HP_MOMENTUM] != 0:
                state = self.state
                for p in params:
                    st = state.get(p)
                    if st and "momentum_buffer" in st:
                        break
                else:
                    table = _FRESH_BUFFER_ROW
        elif (kind == _ADAM or kind == _ADAGRAD) and not capturable:
            # (the core counts a capturable group's steps on the device, unchecked)
            if _first_count_is_worst(kind, hparams):
                try:
                    _C.optim_check(kind, 0, _FIRST_COUNT_ROW, hparams, False)
                    return
                except ValueError:
                    pass  # refused at the first count: the params' own counts tell
            counts, table = _count_table(self.state, params)
            # (counts: the memory the rows point at, held over the check)
        _C.optim_check(kind, 0, table, hparams, capturable)

    def _refuse_fake_mode(self) -> None:
        """Under a FakeTensorMode (a memory or shape dry run over real
        parameters) the state a first update creates would be FakeTensors,
        whose null pointers the kernels refuse (and every later step then
        refused the state), and a later update would write the real
        parameters and state, which torch's step() under the mode leaves as
        they are: refused before anything is created or written."""
        name = type(self).__name__
        peer = self._torch_class.__name__
        raise RuntimeError(f"{name}: an update under a FakeTensorMode: reprop's kernels write the "
                           "real parameters and state in place, which torch.optim leaves unchanged "
                           f"there; step outside the mode, or dry-run with torch.optim.{peer}")

    def _group_name(self, group: dict) -> str:
        index = next((i for i, g in enumerate(self.param_groups) if g is group), None)
        return "a group no longer in param_groups" if index is None else f"param_groups[{index}]"

    def _check_step(self, group: dict, active: list, given: dict | None, slots: tuple) -> None:
        """Raises for the params, gradients and existing state of this step,
        before a plan is built: a refused step must leave the state as it was
        (the hyper-parameters are checked by _make_plans, in C)."""
        capturable = bool(group.get("capturable", False))
        for p in active:
            # a param put into a group by hand, or a group's options edited since
            _check_param(p, capturable)
            _check_grad(p, p.grad if given is None else given[id(p)])
            st = self.state.get(p)
            if st:
                self._check_state(p, st, slots)
        # (a device of float64 params only: torch's step() reads the lr there)
        for device in {p.device for p in active if p.device.type == "cuda" and not _by_torch(p)}:
            _cuda_lr_pointer(self, group, device)

    def _check_state(self, p: torch.Tensor, st: dict, slots: tuple) -> None:
        """Refuses p's state where torch's update would: a tensor the update
        reads that it cannot read as p's (one loaded for another model), a
        step count that is not one number, or a key it needs that is missing."""
        for key in filter(None, slots):
            t = st.get(key)
            if t is not None:
                _check_state_tensor(key, t, p)
            elif self._kind != _SGD:  # SGD creates its buffer when first needed
                # torch creates all other state at a param's first step: a slot
                # switched on later has no state
                raise KeyError(f"{key}: the state of a parameter of shape {tuple(p.shape)} "
                               f"was created without it (an option that needs it was switched "
                               f"on after the first step); torch.optim."
                               f"{self._torch_class.__name__} raises this KeyError too")
        if self._kind != _SGD:
            if "step" not in st:  # torch reads state["step"] of any state it finds
                raise KeyError(f"step: the state of a parameter of shape {tuple(p.shape)} has no "
                               f"step count (state set or loaded without it); torch.optim."
                               f"{self._torch_class.__name__} raises this KeyError too")
            _check_step_count(st["step"], p)

    def _make_plans(self, group: dict, params: list, active: list, slots: tuple,
                    hparams: tuple, given: dict | None) -> list:
        self._follow_param_groups(params)
        buckets: dict = {}
        wide = []
        for p in params:
            if _by_torch(p):
                wide.append(p)
            else:
                buckets.setdefault((p.device, p.dtype), []).append(p)
        runs = [run for ps in buckets.values() for run in _ordered_runs(ps, self.state, slots)]
        if self._kind != _SGD:
            _check_shared_steps(self.state, runs, bool(group.get("capturable", False)))
        active_ids = set(map(id, active))
        plans = [_Plan(self, group, run, slots, active_ids) for run in runs]
        memory = _CallMemory(plans)
        grad_of = _grad_getter(given)
        for plan in plans:
            plan.memory = memory
        for p in active:  # refused here, before the state the plans made is committed
            memory.check_grad(p, grad_of(p), grad_of)
        for plan in plans:
            if not plan.idle:
                plan.check(self, hparams)
        for plan in plans:
            plan.commit_state()
        return _Plans(plans, wide, slots, bool(group.get("capturable", False)))

    def _cache_plans(self, key: tuple, plans: list) -> None:
        """Caches the plans just built for the call of `key` once their first
        update has run and the new SGD buffers it filled are in the state
        (publish_fresh): a cached plan holds no state that the state dicts
        lack, so a step interrupted before (a notebook's stop button) leaves
        no plan cached, and the next step builds one from the state, as
        torch's next step starts from its state. Plans with a buffer left
        fresh (a gradient dropped since they were built) are not cached:
        the next step builds them again."""
        if not any(plan.fresh for plan in plans):
            self._plans.put(key, plans)

    def _follow_param_groups(self, params: Iterable = ()) -> None:
        """Plans hold their params (the cache is keyed by their ids, which must
        not be reused), so when params have left the param_groups (a group's
        params replaced, a group removed or emptied), the plans of those that
        left every group are dropped: they, their .grad and the state the
        plans point at are freed as torch frees them. A change shows as a
        group (or its params list) replaced, resized, added or removed, which
        step() and step_params() check (O(groups): the other groups' plans
        stay cached, so no plan is built to notice that one left), or as a
        plan built, or step_params called, for a param not seen in any group
        (a list edited in place), so the full scan runs only on a change. The
        groups that step_params looks params up in follow too. The groups
        are noted as seen last: a KeyboardInterrupt (a notebook's stop
        button) before then leaves the change to be followed at the next
        call, where the plans of a removed group stayed cached for good."""
        groups = [(id(g), id(g["params"]), len(g["params"])) for g in self.param_groups]
        if groups == self._groups_seen and self._members.issuperset(map(id, params)):
            return
        self._group_of = None
        self._members = {id(p) for g in self.param_groups for p in g["params"]}
        self._plans.retain(lambda plans: self._members.issuperset(
            id(p) for ps in [plans.wide, *(plan.params for plan in plans)] for p in ps))
        self._plans.set_budget(len(self._members))
        self._groups_seen = groups

    def _state_tensor(self, st: dict, key: str, p: torch.Tensor, group: dict,
                      row) -> torch.Tensor:
        """State st[key] as a float32 tensor laid out like p: itself, or a new
        one when absent or of another dtype or layout (_check_step has refused
        a key absent from state torch initialized, and state of another shape
        or device); the plan commits it to st."""
        t = st.get(key)
        if t is None:
            t = self._initial_state(key, p, group)
            if self._kind == _SGD:
                row[_COL_FLAGS] |= _FRESH_BUFFER
        elif not _usable_state(t, p):
            t = torch.empty_like(p, dtype=torch.float32).copy_(t)  # (copy_ resolves the bit)
        return t

    def _has_state(self, st: dict | None, work: torch.Tensor, slots: tuple,
                   capturable: bool) -> bool:
        """Whether a param (updated through `work`) has the state its row
        points at as it is, so that a plan may give it a row while it has no
        gradient: creating or converting state is for its next update."""
        if self._kind != _SGD and not (st and _usable_step(st.get("step"), work, capturable)):
            return False
        return all(st and _usable_state(st.get(key), work) for key in filter(None, slots))

    def _initial_state(self, key: str, p: torch.Tensor, group: dict) -> torch.Tensor:
        return torch.zeros_like(p, dtype=torch.float32)

    def _hparams(self, group: dict) -> tuple:
        """The hparams tuple of csrc/pyutil.h: built in C when the group's
        values go into it as they are (floats, ints, bool flags), else by
        _hparams_of, which converts or refuses them."""
        return _C.optim_hparams(group) or _hparams_of(group)

    def _state_slots(self, group: dict) -> tuple:
        """Names of the state tensors in the core's slots 0..2 (None: unused)."""
        raise NotImplementedError

    def _reads_param_into_state(self, group: dict) -> bool:
        """Whether the update of `group` (or settings dict) feeds the param's
        values into its optimizer state: a weight decay that is not
        decoupled adds weight_decay * p to the gradient the state takes in
        (no other option of these optimizers reads the param; maximize only
        negates the gradient; fusion takes no other torch optimizer, such as
        ASGD, whose average reads it). Fusion's refusal of a param swapped by hand
        says the state's weight decay term differs from eager's where it
        does (fusion.py: _swapped_message)."""
        return bool(group.get("weight_decay", 0))


class SGD(_FusedOptimizer, torch.optim.SGD):
    """Fused SGD with momentum, dampening, nesterov, weight_decay and maximize.
    State: ``momentum_buffer`` (float32, torch's float64 for float64 params; no
    state at all without momentum, as torch)."""

    _kind = _SGD
    _torch_class = torch.optim.SGD
    _reads_grad_scale = True

    def _state_slots(self, group):
        return ("momentum_buffer" if group["momentum"] != 0 else None, None, None)

    def _reads_param_into_state(self, group):
        # without momentum SGD has no state for the weight decay to feed
        return super()._reads_param_into_state(group) and group.get("momentum", 0) != 0

    def _initial_state(self, key, p, group):
        # filled from the first gradient by the first update, and only then
        # put into the state (_Plan.publish_fresh)
        return torch.empty_like(p, dtype=torch.float32)


class Adam(_FusedOptimizer, torch.optim.Adam):
    """Fused Adam (amsgrad, maximize, weight_decay, decoupled_weight_decay). State: ``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``."""

    _kind = _ADAM
    _torch_class = torch.optim.Adam
    _reads_grad_scale = True

    def _state_slots(self, group):
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq" if group["amsgrad"] else None)

    def _reads_param_into_state(self, group):
        # AdamW's (decoupled_weight_decay) multiplies the param instead
        return super()._reads_param_into_state(group) and not group.get(
            "decoupled_weight_decay", False)


class AdamW(Adam, torch.optim.AdamW):
    """Fused AdamW: Adam with decoupled weight decay."""

    _torch_class = torch.optim.AdamW


class Adagrad(_FusedOptimizer, torch.optim.Adagrad):
    """Fused Adagrad (lr_decay, weight_decay, initial_accumulator_value, eps).
    State: ``step``, ``sum``, which starts at the constructor's
    initial_accumulator_value in every group, as torch's."""

    _kind = _ADAGRAD
    _torch_class = torch.optim.Adagrad
    _reads_grad_scale = True

    def _state_slots(self, group):
        return ("sum", None, None)

    def _setup_fused(self) -> None:
        super()._setup_fused()
        # torch's __init__ fills `sum` in the param's dtype; keep the exact value in
        # float32 (torch's step() updates a float64 param's, as it made it)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and st["sum"].dtype != torch.float32 and not _by_torch_in(p, group):
                    st["sum"] = self._initial_state("sum", p, group)

    def _initial_state(self, key, p, group):
        # torch fills every `sum` from the constructor's value (its __init__ and
        # _init_group read defaults): a group's own initial_accumulator_value,
        # given at construction or by add_param_group, plays no part
        return torch.full_like(p, self.defaults["initial_accumulator_value"], dtype=torch.float32)


class RMSprop(_FusedOptimizer, torch.optim.RMSprop):
    """Fused RMSprop (alpha, eps, weight_decay, momentum, centered).
    State: ``step``, ``square_avg``, ``momentum_buffer``, ``grad_avg``."""

    _kind = _RMSPROP
    _torch_class = torch.optim.RMSprop

    def _state_slots(self, group):
        return ("square_avg", "momentum_buffer" if group["momentum"] > 0 else None,
                "grad_avg" if group["centered"] else None)


class Adadelta(_FusedOptimizer, torch.optim.Adadelta):
    """Fused Adadelta (rho, eps, weight_decay). State: ``step``, ``square_avg``, ``acc_delta``."""

    _kind = _ADADELTA
    _torch_class = torch.optim.Adadelta

    def _state_slots(self, group):
        return ("square_avg", "acc_delta", None)
