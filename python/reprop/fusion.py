"""Optimizer fusion: update parameters inside backward, or lazily before their next use.

Implements Jiang et al., "Optimizer Fusion" (Algorithms 2 and 3) with hooks on
an unmodified ``nn.Module``; the training loop keeps calling
``loss.backward(); optimizer.step(); optimizer.zero_grad()``.

* ``mode="backward"`` (backward-fusion, Algorithm 3): each parameter is updated
  inside ``backward()`` as soon as its gradient is complete (PyTorch's
  post-accumulate-grad hooks fire once per backward, after every use of a
  parameter has contributed, so tied weights are safe; a reentrant
  checkpoint's nested backward counts as one), the parameters of one
  module together in one fused call when their gradients complete together.
  Gradients are freed right after the update unless ``keep_grads=True``, so
  the peak memory of a step drops by up to the size of all gradients. On CUDA
  the updates run on a side stream (at the default stream's priority, CUDA's
  lowest), overlapping the rest of backward, and are joined to the main
  stream when backward ends.
  ``optimizer.step()`` applies only gradients no backward applied (a window
  shorter than ``accumulation_steps``, gradients set by hand), and
  ``zero_grad()`` clears only those, without a warning (this is the loop
  README recommends). A backward that raises
  has updated every layer it reached; what it left unapplied is eager's.
  Global information (gradient clipping, GradScaler) is not known before the
  updates in this mode: use ``mode="forward"`` for those; nor can the
  gradients of several backward() calls per step be summed before the
  update: a second gradient for a parameter before step() or the next
  forward raises. Hyper-parameters changed between ``backward()`` and
  ``step()`` apply from the next step.
* ``mode="forward"`` (forward-fusion, Algorithm 2): ``optimizer.step()`` only
  marks the updates pending (those of parameters without optimizer state
  yet it applies at once, so that ``optimizer.state`` has their entries),
  each holding the gradient its parameter has
  then (the tensor, not a copy), so ``.grad`` is the user's again at once:
  ``zero_grad()``, ``p.grad = None`` and a gradient set by hand act as after
  an eager step(). Each pending update is applied right before its module's
  next forward, in training or evaluation, once (those the next forward did
  not use, at its end); a module with parameters of its own and submodules
  applies its submodules' too, as its forward may read them directly. A
  held gradient changed in place before then (``p.grad.zero_()`` after
  step()) cannot give eager's update: applying it raises, and drops that
  update. Clipping (``clip_grad_norm=`` or
  ``torch.nn.utils.clip_grad_norm_`` before ``step()``) and
  ``torch.amp.GradScaler`` work as in eager training. ``state_dict()``,
  ``load_state_dict()``, ``to()`` (any ``Module._apply``) and copying
  (``copy.deepcopy``, ``torch.save``) of the model or of any submodule
  holding fused parameters (``ddp.module``, a backbone), and
  ``optimizer.state_dict()``, ``optimizer.load_state_dict()`` and copying
  the optimizer (``torch.save(optimizer)``, ``copy.deepcopy(optimizer)``)
  apply pending updates first, so checkpoints and copies are exact, the
  model and the optimizer copied together in either order. Code that reads
  or writes a parameter directly between ``step()`` and the next forward
  (``p.clamp_()``, an EMA of the weights, a copy of the parameters
  themselves), or the optimizer's state tensors, sees the value before the
  update and must call ``handle.flush()`` first; a reset of the optimizer's
  state (``opt.state.clear()``) is seen. So must registering a
  parametrization with a right_inverse (weight_norm, spectral_norm), which
  reads the weight: the next forward refuses one registered on a weight
  whose update is pending, and drops that update. ``step()`` refuses what eager ``step()``
  refuses, before marking anything pending.

Optimizer step hooks run at ``step()`` in torch's order. Forward mode: pre-hooks
before the updates are marked pending; a registered post-hook makes step()
apply them at once, then run, as it sees the parameters after an eager step.
Backward mode: post-hooks run at step(); a pre-hook cannot run before the
updates backward() made, so step() raises while one is registered.

Other threads may apply the updates while one trains (state_dict() in an
asynchronous checkpoint, flush(), remove()): a lock per handle makes each
update happen once, and a forward waits for those of its parameters being
applied elsewhere. In backward mode, flush(), step() and remove() on another
thread leave a running backward's gradients to it.

A copy of the fused model (copy.deepcopy, or torch.save and torch.load) is a
plain model with the updated values: the hooks it copies belong to an inert
copy of the handle.

The fusion lives as long as the model or the optimizer (their hooks and patched
step() hold the handle; the parameters' hooks, which torch keeps out of the
garbage collector's sight, only weakly): the handle need not be kept, and all
three dropped without remove() are freed. The handle holds the optimizer, so
a model kept alone keeps both: with the optimizer and the handle dropped,
backward mode still updates the model in every backward() (a loop that never
calls step() keeps only the model too), until remove(); fusion_of(model)
finds the handle. A removed handle refers to the model and the optimizer
weakly, so one kept (a notebook variable) keeps neither alive.

Every parameter of the optimizer's groups is fused, frozen ones included (they
are updated once unfrozen), and groups added after ``fuse()`` are picked up at
the next forward of the root module or ``optimizer.step()``. A lazy module's
parameters are fused from the forward that materializes them (their gradient
hooks wait for it: torch refuses them on an UninitializedParameter).

Each update is the same fused kernel as ``reprop.optim``'s ``step()``, with
the hyper-parameters of the moment it was decided, so fused training computes
exactly what the eager loop computes.
"""
from __future__ import annotations

import collections
import copy
import functools
import inspect
import itertools
import operator
import sys
import threading
import types
import weakref
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.optim import optimizer as torch_optimizer
from torch.utils import _pytree

from . import _tensors, optim

__all__ = ["fuse", "fusion_of", "FusionHandle"]

# torch.optim classes converted to their reprop counterparts (exact types:
# a subclass may change what step() means).
_CONVERTIBLE = {
    torch.optim.SGD: optim.SGD,
    torch.optim.Adam: optim.Adam,
    torch.optim.AdamW: optim.AdamW,
    torch.optim.Adagrad: optim.Adagrad,
    torch.optim.RMSprop: optim.RMSprop,
    torch.optim.Adadelta: optim.Adadelta,
}
_MODES = ("backward", "forward")


def _kept(name: str, value):
    """`value` as first imported (_tensors.kept_across_reloads): fusions made
    before a reload hold the sentinel, registries and methods below, which
    the reloaded functions must share."""
    return _tensors.kept_across_reloads(__name__, name, value)


# The optimizer's attributes fusion sets on the instance (forward mode also
# __getstate__), restored by remove().
_OVERRIDDEN = ("step", "zero_grad", "_step_supports_amp_scaling", "__getstate__")
_MISSING = _kept("_MISSING", object())
_NOT_PASSING = object()  # (_after_removal: a name remove() put back, as usual)
# A handle's references that remove() makes weak (FusionHandle._let_go).
_HELD_UNTIL_REMOVED = ("model", "optimizer", "_user_optimizer")
# Module -> (its own instance methods of _FLUSHING's names, or _MISSING, a
# WeakSet of the forward-mode fusions of parameters at or below it: one per
# optimizer), for _flushing. Weak: a value referring to its key would never
# be freed, and the root's forward hooks keep each fusion alive while it is
# installed.
_FLUSH_BEFORE: "weakref.WeakKeyDictionary" = _kept("_FLUSH_BEFORE", weakref.WeakKeyDictionary())
_NONE_SAVED = ({}, ())  # (what _FLUSH_BEFORE.get gives a module it does not hold)
# Optimizer (the user's, and the reprop engine of a converted torch one) ->
# weak reference to the live handle fusing it: a second fusion of it would
# stack hooks and update twice. Weak both ways: the optimizer's patched step()
# keeps its handle alive while it is fused.
_FUSED_BY: "weakref.WeakKeyDictionary" = _kept("_FUSED_BY", weakref.WeakKeyDictionary())
# id(optimizer) -> (weak reference to it, ident of the thread) of each fuse()
# call building a fusion of it: two threads fusing one optimizer at once both
# passed _check_not_fused, the handle being registered in _FUSED_BY only at
# the end, and stacked two fusions. One dict.setdefault claims it (atomic,
# where a lock left held by a KeyboardInterrupt, a notebook's stop button,
# would have refused every later fuse() of it for good: see _claim_fusing).
_FUSING: dict = _kept("_FUSING", {})
# id(param) -> weak reference to the live handle whose optimizer holds it, so
# that fuse() checks each parameter in O(1), however many fusions are live.
# Keyed by id, not weakly by the parameter: torch.utils.swap_tensors (what
# .to()/.half() and load_state_dict use under torch.__future__'s swap flag)
# refuses a tensor with a weak reference. A hit counts only if that handle is
# alive, not removed and holds that very parameter (an id is reused once its
# tensor is freed); entries are dropped by remove(), by _sync when the
# optimizer lets a parameter go, and when the handle is freed.
_FUSION_OF_PARAM: dict = _kept("_FUSION_OF_PARAM", {})
# Forward-mode fusions' parameter registration hooks (handle id -> hook), all
# called by one hook in torch's global registry (_on_param_registered), put
# there at import and left for good: torch iterates that registry at each
# register_parameter (nn.Linear() makes two), so a fuse() or remove() adding
# or removing its own hook there, in one thread, broke a model being built in
# another ("OrderedDict mutated during iteration"). At import, not at the
# first fusion: that would need a lock, which a stop button at the end of a
# `with` block leaves held. An OrderedDict: torch's RemovableHandle refers to
# it weakly.
_PARAM_REGISTERED: "collections.OrderedDict" = _kept("_PARAM_REGISTERED", collections.OrderedDict())


def _on_param_registered(module: nn.Module, name: str, param) -> None:
    # a snapshot (one C call, no thread switch): other threads' fusions add and remove theirs
    for hook in tuple(_PARAM_REGISTERED.values()):
        hook(module, name, param)


# (kept: a reload must not add another to torch's registry)
_ON_PARAM_REGISTERED = _kept("_ON_PARAM_REGISTERED", _on_param_registered)
if _ON_PARAM_REGISTERED is _on_param_registered:  # the first import
    nn.modules.module.register_module_parameter_registration_hook(_ON_PARAM_REGISTERED)


def _register_param_registration_hook(hook: Callable, hooks: list) -> None:
    """register_module_parameter_registration_hook(hook) for a forward
    fusion, in _PARAM_REGISTERED: torch's global registry stays as it is.
    Its removable handle joins `hooks` before the hook is stored: a stop
    button after the store, before a returned handle was appended, left the
    hook there with nothing to remove it."""
    hooks.append(torch.utils.hooks.RemovableHandle(_PARAM_REGISTERED))
    _PARAM_REGISTERED[hooks[-1].id] = hook


def _flushing(name: str):
    """Module.`name` that first applies the pending forward-mode updates of
    the module's fusions, installed as an instance method on each module
    holding fused parameters (a copy of the module has no fusion): _apply
    (what .to(), .half(), .cuda() call: the values converted must be the
    updated ones) and zero_grad (model.zero_grad() in place of the
    optimizer's, between step() and the next forward: with
    set_to_none=False it zeroes in place the gradients the pending updates
    hold). A nested call finds nothing pending. Then what it replaced:
    the module's own method of that name (an override set on the instance
    before fuse(): calling the class's skipped it while fused), else the
    class's; so too once no fusion covers the module, where a wrapper set
    on the module after fuse() still calls it (_uninstall_flushing)."""
    def method(module: nn.Module, *args, **kwargs):
        saved, handles = _FLUSH_BEFORE.get(module, _NONE_SAVED)  # (one look-up: per call)
        for handle in list(handles):  # (_flush_pending)
            handle.flush()
        own = saved.get(name, _MISSING)
        if own is _MISSING:
            return getattr(type(module), name)(module, *args, **kwargs)
        return _rebound(own, module)(*args, **kwargs)

    # Pickling the bound method stores getattr(module, __name__): the class's.
    method.__name__ = name
    return method


def _flushing_getstate(module: nn.Module):
    """__getstate__, which copy.deepcopy, copy.copy and pickling (torch.save)
    look up on the instance: a copy holds the updated values an eager copy
    holds, also when copied before the optimizer, whose copy applies them
    too (the module's parameters would be copied first, one update behind
    the copied optimizer state); and not the methods installed here."""
    _flush_pending(module)
    state = type(module).__getstate__(module)
    return _without_flushing(module, state) if isinstance(state, dict) else state


def _flushing_deepcopy(module: nn.Module, memo: dict):
    """__deepcopy__ where the class has one (a parametrized module's, which
    copies its own parameters before its parametrizations), as
    _flushing_getstate; once the class has none again (remove_parametrizations
    restored the class), the module is copied as others are."""
    _flush_pending(module)
    if not hasattr(type(module), "__deepcopy__"):
        # (a wrapper of ours set since goes too: left, it would call this again)
        _uninstall_flushing(module, "__deepcopy__", even_under_a_wrapper=True)
        return copy.deepcopy(module, memo)
    replica = type(module).__deepcopy__(module, memo)
    replica.__dict__ = _without_flushing(module, replica.__dict__, memo)
    return replica


def _flush_pending(module: nn.Module) -> None:
    for handle in list(_FLUSH_BEFORE.get(module, (None, ()))[1]):
        handle.flush()


def _without_flushing(module: nn.Module, state: dict, memo: dict | None = None) -> dict:
    """`state`, the __dict__ a copy of `module` gets, without the methods
    _FLUSHING installed on `module` (bound to it, or rebound to the copy by
    a deepcopy), and with what they replaced: a copy has no fusion, and
    such a method bound to the original would copy, convert or flush the
    original in the copy's place. With a deepcopy's `memo` (state copied
    already), what they replaced is deep-copied too, as the copy of
    `module`'s own state would have it (a method of its own bound to it
    rebound to the copy); without, the caller copies `state` next."""
    saved = _FLUSH_BEFORE.get(module, _NONE_SAVED)[0]
    ours = {k for k, v in state.items()
            if isinstance(v, types.MethodType) and v.__func__ is _FLUSHING.get(k)}
    state = {k: v for k, v in state.items() if k not in ours}
    # (only in place of one of ours: a wrapper set on the module after fuse()
    # is what the copy holds, as eager's copy holds it)
    state.update((name, own if memo is None else copy.deepcopy(own, memo))
                 for name, own in ((n, _rebound(saved[n], module)) for n in ours if n in saved)
                 if own is not _MISSING)
    return state


# (kept: _without_flushing knows the methods installed on a module by their functions)
_FLUSHING = _kept("_FLUSHING", {"_apply": _flushing("_apply"), "zero_grad": _flushing("zero_grad"),
                                "__getstate__": _flushing_getstate,
                                "__deepcopy__": _flushing_deepcopy})


def _first(hooks: dict, handle: "torch.utils.hooks.RemovableHandle") -> None:
    """Moves `handle`'s hook to the front of `hooks`, the module's ordered dict
    of that kind of hook, whose register method takes no prepend=: a
    state_dict or load_state_dict pre-hook registered before fuse() (one
    reading a weight) must find the pending updates applied, as after an
    eager step()."""
    hooks.move_to_end(handle.id, last=False)


def _flush_before_module_calls(module: nn.Module, handle: "_ForwardFusion") -> None:
    """Installs _FLUSHING's methods that `module`'s class has and that are
    not installed yet: __deepcopy__ only where the class defines one (a
    parametrized module's, whose class register_parametrization replaces,
    maybe after fuse()); other modules are deep-copied through __getstate__."""
    saved, handles = _FLUSH_BEFORE.setdefault(module, ({}, weakref.WeakSet()))
    for name, method in _FLUSHING.items():
        if name not in saved and hasattr(type(module), name):
            saved[name] = module.__dict__.get(name, _MISSING)
            setattr(module, name, types.MethodType(method, module))
    handles.add(handle)


def _stop_flushing_before_module_calls(module: nn.Module, handle: "_ForwardFusion") -> None:
    saved, handles = _FLUSH_BEFORE.get(module, ({}, weakref.WeakSet()))
    handles.discard(handle)
    if handles or module not in _FLUSH_BEFORE:
        return
    for name in list(saved):
        _uninstall_flushing(module, name)
    if not saved:  # (else the pass-throughs a wrapper still calls read it)
        del _FLUSH_BEFORE[module]


def _uninstall_flushing(module: nn.Module, name: str, even_under_a_wrapper: bool = False) -> None:
    """Puts back what _flush_before_module_calls replaced of module.`name`
    if that is still the method installed there. One set on the module
    since (a user's wrapper, a library's such as accelerate's, calling ours)
    stays: putting back what ours replaced dropped it, silently. Ours stays
    in that chain as a pass-through to what it replaced (nothing to flush
    once no fusion covers the module), which a later fuse() uses again;
    kept without a strong reference to the module (_held_weakly): the
    registry would keep it alive."""
    saved = _FLUSH_BEFORE[module][0]
    if not (even_under_a_wrapper or _installed_on(module, name)):
        saved[name] = _held_weakly(saved[name], module)
        return
    own = _rebound(saved.pop(name), module)
    if own is _MISSING:
        module.__dict__.pop(name, None)
    else:
        setattr(module, name, own)


def _installed_on(module: nn.Module, name: str) -> bool:
    """Whether module.`name`, set on the instance, is _FLUSHING's method of
    that name bound to `module` (not one a copy carries, nor a wrapper)."""
    method = module.__dict__.get(name)
    return (isinstance(method, types.MethodType) and method.__func__ is _FLUSHING.get(name)
            and method.__self__ is module)


class _BoundToModule:
    """A method of a module's own (bound to it) that _FLUSH_BEFORE keeps for
    a pass-through after remove(): its function only (_rebound binds it)."""
    __slots__ = ("function",)

    def __init__(self, function: Callable) -> None:
        self.function = function


# (kept: a pass-through made before a reload holds one)
_BoundToModule = _kept("_BoundToModule", _BoundToModule)


def _held_weakly(own, module: nn.Module):
    if isinstance(own, types.MethodType) and own.__self__ is module:
        return _BoundToModule(own.__func__)
    return own


def _rebound(own, module: nn.Module):
    return types.MethodType(own.function, module) if isinstance(own, _BoundToModule) else own


def fuse(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str = "backward", *,
         accumulation_steps: int = 1, clip_grad_norm: float | None = None,
         keep_grads: bool = False, comm_hook: Callable | None = None,
         comm_state: object = None) -> "FusionHandle":
    """Fuses `optimizer`'s updates into `model`'s backward or next forward.

    Args:
        model: the root module whose forward runs each training step (a
            DistributedDataParallel wrapper is fine).
        optimizer: a ``reprop.optim`` optimizer, or a ``torch.optim`` SGD, Adam,
            AdamW, Adagrad, RMSprop or Adadelta, whose param_groups and state
            the fused updates then share (LR schedulers and its state_dict()
            keep working on it). Not one fused by a handle not yet removed.
        mode: "backward" or "forward" (see the module docstring).
        accumulation_steps: backward mode: update in the backward of every
            n-th micro-batch, as an eager loop stepping every n micro-batches
            (a step() before the n-th applies the window's gradients then, and
            the next micro-batch starts a window).
            A micro-batch is the forwards in grad mode (of any module that owns
            fused parameters, however often) up to the next backward; forwards
            under no_grad, and those checkpointing recomputes inside backward,
            do not count. A count (an int or a NumPy int, not a bool). In
            forward mode the user loop decides when to call step(): refused
            there unless 1.
        clip_grad_norm: forward mode: clip the norm of `optimizer`'s
            gradients to this value when step() is called, as
            clip_grad_norm_ of its parameters before step() (but after the
            optimizer's step pre-hooks, inside step()): the model's global
            norm only when `optimizer` holds all its parameters (with
            several fused optimizers, call clip_grad_norm_ of the model's
            parameters before their first step() instead). A real
            number > 0 (inf: no clipping), not a bool; a NumPy scalar or a
            one-element tensor is read once, here, as a float.
        keep_grads: backward mode: keep gradients after their update until the
            next training forward, instead of freeing them at once (remove()
            does to them what a zero_grad() since did, and frees them if no
            step() was called since). True or False (a NumPy bool too).
            Refused in forward mode, which frees no gradient itself.
        comm_hook, comm_state: backward mode under DistributedDataParallel:
            a DDP communication hook (``fp16_compress_hook``, PowerSGD's
            ``powerSGD_hook``, ...) and its state, as
            ``register_comm_hook(comm_state, comm_hook)`` takes them, run in
            place of DDP's all-reduce; each bucket is updated from what it
            returns. DDP takes one hook, which backward fusion registers: pass
            yours here, not to DDP (one registered there is refused). In
            forward mode register it with DDP as usual.

    Returns a handle with ``mode``, ``optimizer``, ``flush()`` and ``remove()``,
    also usable as a context manager that removes the fusion on exit. The
    handle owns `optimizer`, and `model`'s hooks own the handle: dropping
    the optimizer, the handle or both does not end the fusion (backward mode
    goes on updating `model` in every backward()); only remove() does
    (``reprop.fusion.fusion_of(model)`` returns a handle not kept).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if mode not in _MODES:
        raise ValueError(f"mode: expected 'backward' or 'forward', got {mode!r}")
    accumulation_steps = _tensors.check_count(accumulation_steps, "accumulation_steps", 1)
    keep_grads = _tensors.check_flag(keep_grads, "keep_grads")
    if clip_grad_norm is not None:
        if mode == "backward":
            raise ValueError("clip_grad_norm: the global gradient norm is not known before "
                             "backward-fusion updates a parameter; use mode='forward'")
        # (a float: what torch's clip_grad_norm_ makes of its max_norm, read once here)
        clip_grad_norm = _tensors.check_positive_real(clip_grad_norm, "clip_grad_norm")
    if mode == "forward" and accumulation_steps != 1:
        raise ValueError("accumulation_steps: in forward mode the training loop decides when "
                         "to call optimizer.step(); leave accumulation_steps at 1")
    if mode == "forward" and keep_grads:
        raise ValueError("keep_grads: forward mode frees no gradient (zero_grad() and the "
                         "training loop do, as in eager training); leave keep_grads False")
    if comm_hook is not None:
        _check_comm_hook(comm_hook, model, mode)
    elif comm_state is not None:
        raise ValueError(f"comm_state: the state of a comm_hook, given without one (got "
                         f"{type(comm_state).__name__}); pass comm_hook too, or leave it None")
    engine = _engine_for(optimizer)  # first: it names an `optimizer` of another type
    _claim_fusing(optimizer)
    handle = None
    try:
        _check_not_fused(optimizer)
        _check_no_instance_override(optimizer)
        if mode == "backward":
            _check_not_data_parallel(engine)
            _check_not_micro_batch_pipelined(engine)
            handle = _BackwardFusion(model, optimizer, engine, accumulation_steps, keep_grads,
                                     comm_hook, comm_state)
        else:
            handle = _ForwardFusion(model, optimizer, engine, clip_grad_norm)
        # hooks only once the handle is here to take them out: a constructor
        # stopped midway (a notebook's stop button) left those it had
        # installed on the model, calling a handle nobody could remove
        handle._install()
        # the optimizer changes last: a handle that failed to build leaves it as it was
        handle._take_over_optimizer()
    except BaseException:
        # stopped between the build and the end of the take-over: its hooks
        # stayed on the model, and fusion_of() could not find the handle to
        # remove them. Removed first: DDP cannot unregister its comm hook,
        # which must then only reduce, not update, while the handle lives on
        # (in the traceback a notebook keeps)
        if handle is not None:
            handle._removed = True
            handle._unhook()
        raise
    finally:  # (the claim is still this call's: no other call replaces a live one)
        _FUSING.pop(id(optimizer), None)
    return handle


def _claim_fusing(optimizer) -> None:
    """Claims `optimizer` for this fuse() call in _FUSING, refusing it while
    another thread's fuse() builds a fusion of it (that one's handle is not
    registered yet: _check_not_fused cannot see it). A claim left by a
    KeyboardInterrupt in this thread (fuse() stopped before it let go of
    it), or made for an optimizer since freed whose id this one reuses, is
    no other call's: replaced. (One left by the stop button, which stops the
    main thread, is seen as live by other threads, which are refused until
    the main thread fuses that optimizer again.)"""
    claim = (weakref.ref(optimizer), threading.get_ident())
    held = _FUSING.setdefault(id(optimizer), claim)
    if held is not claim:
        if held[0]() is optimizer and held[1] != claim[1]:
            raise ValueError(
                "optimizer: another thread is fusing it at this moment (reprop.fuse of the same "
                "optimizer on two threads at once); a second fusion would stack its hooks on "
                "the first. Fuse it once, on one thread")
        _FUSING[id(optimizer)] = claim


def _fusions_holding(model: nn.Module) -> list:
    """The live fusions whose optimizers hold `model`'s parameters."""
    return list({id(h): h for h in map(_fusion_holding, model.parameters()) if h is not None}.values())


def flush_fusions_of(model: nn.Module) -> None:
    """Applies the pending updates of every live fusion holding `model`'s
    parameters (reprop.ooo's Join hooks: the model they broadcast, and the
    one they leave, must be the updated one, as after an eager step())."""
    for handle in _fusions_holding(model):
        handle.flush()


def fusion_of(model: nn.Module) -> "FusionHandle | None":
    """The live fusion whose optimizer holds `model`'s parameters, or None.

    A fusion lives as long as its model or its optimizer: this is the way
    back to a handle not kept (its optimizer dropped too, say), to remove()
    it or to fuse the model with another optimizer. Raises ValueError if
    several fusions hold them (one optimizer per sub-module): ask each
    sub-module then."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    found = _fusions_holding(model)
    if len(found) > 1:
        raise ValueError(f"model: its parameters are held by {len(found)} live fusions (one "
                         "optimizer each); call fusion_of() on the sub-module of each")
    return next(iter(found), None)


def _check_not_fused(optimizer) -> None:
    """Refuses a second fusion of `optimizer` (a notebook cell run twice, or one
    fuse() per sub-module) while the first one's handle is live."""
    ref = _FUSED_BY.get(optimizer)
    handle = ref() if ref is not None else None
    if handle is not None:
        raise ValueError(
            f"optimizer: already fused by a live reprop.fuse handle (mode={handle.mode!r}); "
            "a second fusion would stack its hooks on the first. Call remove() on that handle "
            "first (reprop.fusion.fusion_of(model) finds it), or fuse once the module that "
            "holds all its parameters")


def _check_no_instance_override(optimizer) -> None:
    """Refuses a step() or zero_grad() set on the optimizer instance (a
    wrapper such as accelerate's patch_optimizer_step), as a subclass's
    override is refused (see _engine_for): fusion installs its own there, so
    the wrapper would never run. Calling through it is no way out: it calls
    the optimizer's own step(), not the fusion's. Torch's LR-scheduler
    wrapper is the exception: fusion's step() records the calls it would."""
    for name in ("step", "zero_grad"):
        own = optimizer.__dict__.get(name)
        if own is None or (name == "step" and (_is_lr_scheduler_wrapper(own, optimizer)
                                               or _is_fusions_step(own))):
            continue
        # (a wrapper set on a fused optimizer stays through remove(): a fuse()
        # after finds it, marked as the scheduler's where functools.wraps
        # copied the mark of fusion's step)
        copied = (" (it carries torch's LR-scheduler mark _wrapped_by_lr_sched, as "
                  "functools.wraps copies it, but is not the scheduler's wrapper of the "
                  "optimizer's step())" if getattr(own, "_wrapped_by_lr_sched", False) else "")
        raise TypeError(f"optimizer: its {name}() is replaced on the instance by {own!r}"
                        f"{copied}, which fusion replaces, so it would never run; fuse first and "
                        f"wrap the optimizer's {name}() after, or drop the wrapper (one set while "
                        "an earlier fusion of it was live stays through that fusion's remove(): "
                        f"put back the {name}() it wraps, or `del optimizer.{name}`, before "
                        "fusing again, and wrap again after)")


def _is_lr_scheduler_wrapper(step: Callable, optimizer) -> bool:
    """Whether `step`, set on the optimizer instance, is the wrapper an LR
    scheduler set there (LRScheduler.__init__) around the optimizer's own
    step() or a removed fusion's, which fusion's step() may replace (it
    records the calls as the wrapper would). Told by its code, not by its
    `_wrapped_by_lr_sched` mark: functools.wraps copies that onto any wrapper
    of a marked step (fusion's, where a scheduler came before fuse()), and a
    user's wrapper so marked was taken for the scheduler's, replaced, and
    silently skipped while fused. Nor around a method set on the instance
    before the scheduler was made: that one would be skipped too."""
    if getattr(step, "__code__", None) is not _lr_scheduler_wrapper_code():
        return False
    wrapped = getattr(step, "__wrapped__", None)  # (the function it calls: functools.wraps)
    return wrapped is getattr(type(optimizer), "step", None) or _is_fusions_step(wrapped)


def _is_fusions_step(step: Callable) -> bool:
    """Whether `step` is the step() a fusion set on the optimizer (bound or
    not): a removed fusion's, left under a wrapper by remove() and passing
    through to what it replaced, which a later fusion may replace."""
    return getattr(step, "__code__", None) is _fused_step_code()


@functools.lru_cache(maxsize=None)
def _lr_scheduler_wrapper_code() -> types.CodeType:
    """The code of the step() wrapper torch's LR schedulers set on their
    optimizer, read off one made (once) on a throwaway optimizer."""
    throwaway = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(throwaway, lambda epoch: 1.0)
    return throwaway.step.__code__


@functools.lru_cache(maxsize=None)
def _fused_step_code() -> types.CodeType:
    """The code of the step() function fusion sets on the optimizer
    (FusionHandle._take_over_optimizer), which a scheduler made while fused wraps."""
    return next(c for c in FusionHandle._take_over_optimizer.__code__.co_consts
                if isinstance(c, types.CodeType) and c.co_name == "step")


def _check_params_not_fused(params: Iterable[torch.Tensor], handle: "FusionHandle") -> None:
    """Refuses a parameter that another live fusion's optimizer holds too:
    each would free or apply its gradient before the other sees it (eager
    applies both optimizers' updates; one was lost)."""
    for p in params:
        other = _fusion_holding(p)
        if other is not None and other is not handle:
            raise ValueError(
                f"optimizer: {optim._described_param(p)} is also in the optimizer of "
                f"a live reprop.fuse handle (mode={other.mode!r}); two fused optimizers cannot "
                "share a parameter. Call remove() on that handle first (reprop.fusion.fusion_of("
                "model) finds it), or fuse optimizers with disjoint parameters")


def _check_not_optimized_in_backward(params: Iterable[torch.Tensor], model: nn.Module) -> None:
    """Backward mode: refuses a parameter given an optimizer of its own by
    torch.distributed.optim._apply_optimizer_in_backward (torch's optimizer
    in backward, which marks it with `_in_backward_optimizers`) where that
    optimizer runs: in eager training it steps when the gradient is
    accumulated and frees it, so the eager optimizer's step() skips the
    parameter; the fusion's post-accumulate-grad hook runs before torch's,
    so it would update the parameter with the fused optimizer's settings and
    leave torch's optimizer no gradient: silently another update (another
    lr, other state). Forward mode updates at step(), where, as eager's, it
    finds no gradient there. A look per parameter when the fusion picks
    parameters up (fuse(), a group added), none per step: one marked later
    is not seen.
    torch leaves the mark where its optimizer never runs (register_hook=False,
    or its hooks removed through param_to_optim_hook_handle_map): there eager
    step() trains the parameter, and so does the fusion (refused on the mark
    alone, such a parameter was refused falsely). A DDP (the model) or an
    FSDP (in it) runs the marked parameters' optimizers itself, from its
    comm hook or its post-backward, hooks or not: refused there still."""
    marked = [p for p in params if getattr(p, "_in_backward_optimizers", None)]
    if not marked:  # (the common case: one getattr per parameter, as before)
        return
    for p in marked:
        if _in_backward_hook_live(p) or _runs_in_backward_optimizers(model, p):
            raise ValueError(
                f"optimizer: {optim._described_param(p)} has an optimizer of its own from "
                "torch.distributed.optim._apply_optimizer_in_backward, which steps it inside "
                "backward; mode='backward' would update it first with this optimizer instead. "
                "Leave it out of the fused optimizer, or use mode='forward' (whose step(), as "
                "eager's, finds no gradient left there)")


def _in_backward_hook_live(p: torch.Tensor) -> bool:
    """Whether a hook of torch's _apply_optimizer_in_backward that steps
    `p`'s optimizers is still registered on its AccumulateGrad node (torch
    keeps their handles in param_to_optim_hook_handle_map, weakly keyed by
    the parameter; a handle's removal deletes its id from the node's dict).
    A mark without torch's module imported was set by other code: taken as
    live."""
    torchs = sys.modules.get("torch.distributed.optim.apply_optimizer_in_backward")
    if torchs is None:
        return True
    return any(h.id in (h.hooks_dict_ref() or ())
               for h in torchs.param_to_optim_hook_handle_map.get(p, ()))


def _runs_in_backward_optimizers(model: nn.Module, p: torch.Tensor) -> bool:
    """Whether a wrapper of `model` steps `p`'s in-backward optimizers
    without torch's hook: DDP removes those hooks of the parameters it
    manages (at its first forward) and steps their optimizers from its comm
    hook; FSDP steps them in its post-backward."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        if any(q is p for q in getattr(model, "_module_parameters", ())):
            return True
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    return fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel)
                                    for m in model.modules())


def _fusion_holding(p: torch.Tensor) -> "FusionHandle | None":
    """The live fusion whose optimizer holds `p`, if any (see _FUSION_OF_PARAM)."""
    ref = _FUSION_OF_PARAM.get(id(p))
    handle = ref() if ref is not None else None
    if handle is None or handle._removed or handle._params.get(id(p)) is not p:
        return None
    return handle


def _unclaim(ids: Iterable[int], claimed: set, ref: weakref.ref) -> None:
    """Drops the _FUSION_OF_PARAM entries of `ids` that are still the handle's
    (behind `ref`, alive or not), and forgets them in its `claimed` set."""
    for i in list(ids):
        if _FUSION_OF_PARAM.get(i) is ref:
            del _FUSION_OF_PARAM[i]
        claimed.discard(i)


def _check_comm_hook(comm_hook, model: nn.Module, mode: str) -> None:
    """fuse()'s comm_hook: a function, for backward mode under DDP."""
    if not callable(comm_hook):
        raise TypeError(f"comm_hook: expected a DDP communication hook, a function "
                        f"(state, bucket) -> Future, got {type(comm_hook).__name__}")
    if mode != "backward":
        raise ValueError("comm_hook: forward mode registers no hook of its own; register "
                         "yours with model.register_comm_hook(state, hook)")
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(f"comm_hook: a DDP communication hook needs a DistributedDataParallel "
                         f"model, got {type(model).__name__}")
    try:  # what register_comm_hook checks, which sees the fusion's hook, not this one
        model._check_comm_hook(comm_hook)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"comm_hook: DDP refuses it ({type(exc).__name__}: {exc}); expected "
                         "a function (state, bucket: dist.GradBucket) -> "
                         "torch.futures.Future[torch.Tensor]") from None


def _register_bucket_hook(model: nn.parallel.DistributedDataParallel, hook: Callable,
                          state: object, otherwise: Callable) -> None:
    """model.register_comm_hook(state, hook), refused with a ValueError naming
    `model` when DDP has a hook already (DDP takes one: the user's own, a
    Python one or a built-in, which backward fusion cannot run inside its
    own); a refusal leaves DDP as it was."""
    def refuse(what: str):
        return ValueError(f"model: DDP has a communication hook already ({what}); backward "
                          "fusion registers its own, DDP takes one: pass yours as "
                          "reprop.fuse(..., comm_hook=hook, comm_state=state) instead, or use "
                          "mode='forward'")

    if model._comm_hooks:
        there = model._comm_hooks[0][0]
        if hasattr(there, "owner"):  # a weak_hook: an earlier fusion's, removed or not
            raise ValueError("model: DDP holds the communication hook of an earlier "
                             "reprop.fuse(mode='backward') of it, which DDP cannot unregister "
                             "(after remove() it is the plain all-reduce, or that fusion's "
                             "comm_hook): wrap the module in a new DistributedDataParallel to "
                             "fuse it in backward mode again, or use mode='forward'")
        raise refuse(getattr(there, "__qualname__", "a function"))
    try:
        model.register_comm_hook(state, _tensors.weak_hook(hook, otherwise=otherwise))
    except RuntimeError as exc:
        if not model._comm_hooks:  # refused before DDP took it: not for a hook there
            raise
        # a built-in one, of which DDP keeps no record in Python; it appended ours first
        model._comm_hooks.clear()
        raise refuse("a built-in one") from exc


def _into_bucket(reduced, buffer: torch.Tensor) -> None:
    """What a comm hook's future holds (a tensor, or a list of one) written
    into the bucket's buffer, which its gradients view, where the hook left
    it elsewhere (torch's all-reduce and fp16 hooks reduce into the buffer;
    a hook may return a new tensor, which DDP copies there only once backward
    ends, after the update)."""
    tensor = reduced[0] if isinstance(reduced, list) else reduced
    if tensor.data_ptr() != buffer.data_ptr():
        buffer.copy_(tensor)


def _check_not_data_parallel(engine: optim._FusedOptimizer) -> None:
    """Backward mode updates each parameter from its local gradient as soon as
    autograd has it; reprop.ooo.DataParallel averages the gradients over the
    ranks later (those of the layers it holds, after backward), so each
    replica would step on its own gradient."""
    from .ooo import _averaged_by_data_parallel  # ooo imports this module
    if _averaged_by_data_parallel(p for g in engine.param_groups for p in g["params"]):
        raise ValueError("mode: 'backward' updates parameters from local gradients before "
                         "reprop.ooo.data_parallel averages them over the ranks (the replicas "
                         "would drift apart); use mode='forward', which steps on the averages")


def _stepped_by_zero_redundancy(optimizer) -> bool:
    """Whether this step() of `optimizer` runs inside the step() of a
    torch.distributed.optim.ZeroRedundancyOptimizer whose local optimizer
    (its `optim`) it is: a frame of that step() or of its _local_step() (the
    one calling `self.optim.step`, which a subclass reimplementing step()
    calls, then `self._sync_params()`: matched on step() alone, such a
    subclass was missed) on the stack, looked for only where its module was
    imported (else no such optimizer exists)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is None:
        return False
    # (torch's Optimizer wraps step() per class: the frame runs the function wrapped)
    step = inspect.unwrap(zero.ZeroRedundancyOptimizer.step).__code__
    local_step = inspect.unwrap(zero.ZeroRedundancyOptimizer._local_step).__code__
    frame = sys._getframe(1)
    while frame is not None:
        if ((frame.f_code is step or frame.f_code is local_step)
                and getattr(frame.f_locals.get("self"), "optim", None) is optimizer):
            return True
        frame = frame.f_back
    return False


def _check_not_micro_batch_pipelined(engine: optim._FusedOptimizer) -> None:
    """reprop.ooo.Pipeline's step() runs the forwards and backwards of its
    micro-batches interleaved: backward mode would update a parameter in each
    micro-batch's backward, under the forwards of the others."""
    from .ooo import _pipelined_in_micro_batches  # ooo imports this module
    if _pipelined_in_micro_batches(p for g in engine.param_groups for p in g["params"]):
        raise ValueError("mode: 'backward' updates parameters inside each micro-batch's "
                         "backward, but reprop.ooo.Pipeline(micro_batches > 1) interleaves the "
                         "forwards and backwards of its micro-batches in one step() (later "
                         "forwards would see the update, and each micro-batch's gradient would "
                         "be applied on its own); use mode='forward', which steps once on their "
                         "sum")


def _engine_for(optimizer) -> optim._FusedOptimizer:
    """The reprop optimizer that applies the updates: `optimizer` itself, or a
    reprop counterpart sharing a torch optimizer's param_groups and state."""
    # by name too: a reprop optimizer made before importlib.reload(reprop.optim)
    # (by hand, or IPython's %autoreload, whose update of the old classes
    # fails on torch's wrapped step) is not an instance of the reloaded class,
    # and was refused as "not supported; use a reprop.optim optimizer"
    if isinstance(optimizer, optim._FusedOptimizer) \
            or _tensors.is_instance_by_name(optimizer, optim._FusedOptimizer):
        _refuse_differentiable(optimizer, "reprop.optim")
        # Fusion replaces step() and zero_grad() (updates go through
        # step_params), so a subclass's own would never run: refused, as a
        # torch.optim subclass is. inspect.unwrap: torch wraps step per class.
        ours = next(c for c in type(optimizer).__mro__ if c.__module__ == optim.__name__)
        for name in ("step", "zero_grad"):
            if inspect.unwrap(getattr(type(optimizer), name)) is not inspect.unwrap(
                    getattr(ours, name)):
                raise TypeError(f"optimizer: {type(optimizer).__name__} overrides {name}(), "
                                f"which fusion replaces, so it would never run; use "
                                f"reprop.optim.{ours.__name__} (a step pre-hook with "
                                f"mode='forward' can change the gradients first)")
        return optimizer
    ours = _CONVERTIBLE.get(type(optimizer))
    if ours is None:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in _CONVERTIBLE)
        raise TypeError(f"optimizer: {type(optimizer).__name__} is not supported; use a "
                        f"reprop.optim optimizer or one of {names}")
    _refuse_differentiable(optimizer, "torch.optim")
    accepted = inspect.signature(ours._torch_class.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    for flag in ("foreach", "fused"):  # torch's own fast paths play no part
        if flag in accepted:  # RMSprop and Adadelta have no `fused`
            defaults[flag] = None
    # Built without parameters, its groups and state then bound to the
    # optimizer's: torch's constructor would only make state that the binding
    # drops (Adagrad's `sum` of each parameter), and raise for a lazy module's
    # parameter not yet materialized, which torch's add_param_group takes.
    engine = ours([{"params": []}], **defaults)
    # Share, not copy: schedulers change the user's groups, checkpoints read the user's state.
    engine.param_groups = optimizer.param_groups
    engine.state = optimizer.state
    for group in engine.param_groups:
        engine._check_group(group)
    return engine


def _refuse_differentiable(optimizer: torch.optim.Optimizer, module: str) -> None:
    """differentiable=True (in any group) asks for steps autograd can go
    through, which no fused update is (a reprop optimizer's step() gives
    such a group torch's own update, which fusion's per-parameter updates
    from inside backward would not). Refused here, naming the argument and
    the optimizer's class, of `module`."""
    if any(group.get("differentiable", False) for group in optimizer.param_groups):
        raise ValueError(
            f"optimizer: {module}.{type(optimizer).__name__} with differentiable=True cannot "
            "be fused: its steps must be differentiable, and reprop's fused updates are not; "
            "train it unfused, without reprop.fuse")


def _direct_params(module: nn.Module, wanted: dict) -> list:
    """The parameters `module` owns itself (not its children's) among `wanted`."""
    return [p for p in module.parameters(recurse=False) if id(p) in wanted]


def _params_read_by(module: nn.Module, own_of: dict) -> Iterable[torch.Tensor]:
    """The parameters whose pending updates the forward of `module`, an owner
    of fused parameters, needs first: its own, and when it has submodules
    too, theirs. Such a module combines its parameters with its submodules'
    and may read theirs without calling them, or before it does
    (MultiheadAttention reads its out_proj's, whose forward never runs; a QAT
    ConvBn2d divides bn.weight before calling bn). Modules without parameters
    of their own (containers, transformer layers, most models) have no
    forward hooks: each submodule announces its own next use, so the updates
    still wait for the layer that uses them."""
    if not module._modules:  # (modules() builds a generator, at every forward)
        return _params_of_one(module, own_of)
    return [p for m in module.modules() for p in _params_of_one(m, own_of)]


def _params_of_one(module: nn.Module, own_of: dict) -> tuple:
    """The fused parameters `module` registers (own_of: id(owner) -> them)
    and what its parameter slots hold now (None for an empty one). The
    registered ones because torch.func.functional_call (and
    nn.utils.stateless) swap the tensors it is given into the slots for the
    call, under a torch.func transform the transform's wrappers, where the
    updates were not found and waited for the forward's end (it read every
    weight one update behind eager); the slots because a parameter put
    straight into one (module._parameters[name] = p) fires no registration
    hook, so own_of does not know it yet."""
    return (*own_of.get(id(module), ()), *module._parameters.values())


def _outside_torch_func(fn: Callable, *args) -> None:
    """fn(*args), with torch.func's transforms switched off while one is
    active: a forward under grad or vmap (of a functional_call) applies
    pending updates, and the transform would wrap the tensors an update
    makes (a plan's stand-in, new state), which have no memory for the
    kernels ("Cannot access data pointer"). The look costs about 0.05 us,
    the switch 1 us."""
    if not _tensors.transform_active():
        fn(*args)
        return
    with torch._C._DisableFuncTorch():
        fn(*args)


def _places_of(owners: list, wanted: dict) -> dict:
    """id(param) -> the (weak reference to the module, name) pairs under
    which each of `wanted` (id -> param) is registered in the modules of
    `owners` ((module, its own parameters) pairs): a tied one has several.
    Weakly: a layer dropped from the model must not live on here."""
    places = collections.defaultdict(list)
    for module, _ in owners:
        for name, p in module._parameters.items():
            if p is not None and id(p) in wanted:
                places[id(p)].append((weakref.ref(module), name))
    return places


def _through_right_inverse(module: nn.Module) -> bool:
    """Whether `module` is a ParametrizationList holding a parametrization
    with a right_inverse: register_parametrization called it on the tensor
    it replaces (assumed the identity otherwise)."""
    return isinstance(module, parametrize.ParametrizationList) and any(
        hasattr(q, "right_inverse") for q in module)


def _parametrized_with_inverse(place: tuple) -> bool:
    """Whether module.name (`place`, a (module, name) pair) is parametrized
    through a right_inverse (_through_right_inverse)."""
    module, name = place
    return (parametrize.is_parametrized(module, name)
            and _through_right_inverse(module.parametrizations[name]))


def _place_name(model: nn.Module, place: tuple) -> str:
    """module.name (`place`) as `model` names it ("2.weight")."""
    module, name = place
    prefix = next((n for n, m in model.named_modules(remove_duplicate=False) if m is module), "")
    return f"{prefix}.{name}" if prefix else name


def _as_if_updated_in_place(params: list) -> None:
    """What eager step()'s in-place update does to the graphs that saved
    `params` before it, done when step() marks their updates pending: such a
    graph's backward raises autograd's in-place error (inside
    allow_mutation_on_saved_tensors() it gets a copy of their values of now,
    the values before the update: the update may run where that mode is
    off, in another thread's state_dict()), instead of going through the old
    values unnoticed while the updates wait. The update itself bumps the versions
    again, harmlessly: it comes before the next forward that reads them
    saves anything."""
    if _tensors.dispatch_mode_active():
        with torch.no_grad():
            _tensors.show_coming_writes(params)
    _tensors.bump_versions(params)


def _as_if_not_updated(params: list) -> None:
    """Takes back the version bump _as_if_updated_in_place gave `params` at
    step(), for updates dropped unapplied where eager's step() refused them
    (left, a graph saved before step() raised autograd's in-place error at
    backward, where eager's, its params untouched, backpropagates). One
    down, not back to a number read at step(): an in-place write since (the
    user's) bumped eager's version too."""
    versions = _tensors.versions_of(params)
    _tensors.set_versions(params, [v if v is None else v - 1 for v in versions])


def _zero_grad_of(p: torch.Tensor, set_to_none: bool) -> None:
    """What torch.optim.Optimizer.zero_grad does to one parameter."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:
        if p.grad.grad_fn is not None:
            p.grad.detach_()
        else:
            p.grad.requires_grad_(False)
        p.grad.zero_()


def _zero_grad_for(p: torch.Tensor) -> torch.Tensor:
    """The zero .grad eager holds for p after zero_grad(set_to_none=False),
    where this fusion freed the gradient autograd made: zero_grad() zeroes
    that one in place, keeping autograd's layout (its gradient layout
    contract: p's strides where p is dense, else contiguous; zeros_like
    alone would follow a channels_last-like p with gaps)."""
    dense = _tensors.is_dense(p)
    return torch.zeros_like(p, memory_format=torch.preserve_format if dense
                            else torch.contiguous_format)


def _complete(batch: tuple, ready: dict) -> list:
    """The params of `batch` (one module's) with a gradient this backward
    (their ids in `ready`) once every one of them that requires grad has
    one; otherwise an empty list."""
    done = []
    for q in batch:
        if id(q) in ready:
            done.append(q)
        elif q.requires_grad:
            return []
    return done


def _param_name(model: nn.Module, p: torch.Tensor) -> str:
    """p as an error message names it: by its name in `model` if it has one."""
    name = next((n for n, q in model.named_parameters(remove_duplicate=False) if q is p), None)
    shape = f"of shape {tuple(p.shape)}"
    return f"parameter {name!r} ({shape})" if name else f"a parameter {shape}"


def _params_named(model: nn.Module, params: list, most: int = 3) -> str:
    """The first `most` of `params` as _param_name names them, and how many
    more."""
    names = ", ".join(_param_name(model, p) for p in params[:most])
    return names + (f" and {len(params) - most} more" if len(params) > most else "")


def _grad_mark(t: torch.Tensor) -> tuple:
    """What tells a held gradient edited since step(): its version counter,
    which in-place ops bump (None for an inference tensor, which has none:
    torch refuses its in-place edits outside inference_mode), and its data
    pointer, which `t.data = ...` changes (a sparse one has none: step()
    refuses it). Edits through `t.data` or NumPy change neither."""
    try:
        return t._version, t.data_ptr()
    except RuntimeError:  # the rare kinds, asked only once the common case failed
        return (None if t.is_inference() else t._version,
                t.data_ptr() if t.layout is torch.strided else None)


_VERSION = operator.attrgetter("_version")
_GRAD = operator.attrgetter("grad")
_HELD_GRAD = operator.itemgetter(0)


def _held_marks(grads: list, params: list, rare: Callable[[], None] | None = None) -> list:
    """(gradient, its _grad_mark's two parts, its param's _tensors.swap_mark)
    for each of `grads` and their `params`: what forward mode holds for a
    pending update (_ForwardFusion._grads' values), and what tells it edited
    or swapped since. In C-level maps where every gradient is of the common
    kinds (a Python call per gradient cost about as much as the rest of
    forward mode's per-parameter bookkeeping); the tuples compare with ==,
    the gradients by identity (the same objects: never Tensor.__eq__).
    `rare`: called first where a gradient is not of the common kinds
    (step()'s check of such gradients: see _hold)."""
    try:
        return list(zip(grads, map(_VERSION, grads), map(torch.Tensor.data_ptr, grads),
                        map(_tensors.swap_mark, params)))
    except RuntimeError:  # an inference or sparse gradient: each on its own
        if rare is not None:
            rare()
        return [(g, *_grad_mark(g), _tensors.swap_mark(p)) for g, p in zip(grads, params)]


def _frozen(value):
    """`value` as it is now: tensors (a tensor lr, betas) and NumPy arrays are
    copied, since schedulers (or the user) change them in place."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (tuple, list)):
        return type(value)(_frozen(v) for v in value)
    return value


def _only_reads_since(state: dict, entries: dict) -> bool:
    """Whether the optimizer `state` holds the `entries` it held at step()
    and, besides, only empty ones: what reading opt.state[p] of a parameter
    without state inserts (the state is a defaultdict), which is no reset."""
    return len(state) > len(entries) and all(
        state.get(p) is st for p, st in entries.items()) and not any(
        st for p, st in state.items() if p not in entries)


def _settings_snapshot(engine: optim._FusedOptimizer) -> dict:
    """Every group's hyper-parameters as they are now, for a deferred update."""
    return {id(g): {k: _frozen(v) for k, v in g.items() if k != "params"}
            for g in engine.param_groups}


def _membership(engine: optim._FusedOptimizer) -> tuple:
    """Which groups the optimizer has and which parameters each holds, to
    notice that add_param_group, load_state_dict or an edit of a group's
    list (a parameter replaced, or moved to another group) changed them."""
    return (id(engine.param_groups),) + tuple(
        (id(g), tuple(map(id, g["params"]))) for g in engine.param_groups)


def _all_params(engine: optim._FusedOptimizer) -> dict:
    """id -> parameter, for every parameter of the optimizer's groups, frozen
    ones included: unfrozen later, they are trained as in eager training."""
    return {id(p): p for g in engine.param_groups for p in g["params"]}


def _split_by_local_use(pairs: Iterable[tuple]) -> tuple[list, list]:
    """(parameter, all-reduced gradient) pairs of a DDP bucket: those this rank
    gave a gradient to since the last all-reduce, and the parameters it gave
    none. DDP's own test (its local_used_map under find_unused_parameters=True):
    its reducer marks a parameter used when its .grad is defined, and backward
    fusion leaves .grad None after each update. The bucket holds zeros for an
    unused one, which only the end of backward tells apart from the gradient of
    a parameter no rank used."""
    used, unused = [], []
    for p, g in pairs:
        if p.grad is None:
            unused.append(p)
        else:
            used.append((p, g))
    return used, unused


def _leaves_reached(roots: list, wanted: dict) -> set:
    """The ids of the `wanted` parameters (id -> param) whose gradient
    accumulators the autograd graph of `roots` (grad_fns, or leaf tensors
    themselves) reaches: those its forward read with grad. All of them
    where it meets a reentrant checkpoint: its node links only to the
    segment's tensor inputs, not to the weights read inside it. Known by
    its class's name: torch's CheckpointFunction, and the copies DeepSpeed,
    fairscale and Megatron carry under that name."""
    found, seen, todo = set(), set(), list(roots)
    while todo:
        node = todo.pop()
        if type(node).__name__ == "CheckpointFunctionBackward":
            return set(wanted)
        if isinstance(node, (torch.Tensor, torch._C._functions.AccumulateGrad)):
            leaf = node if isinstance(node, torch.Tensor) else node.variable
            if id(leaf) in wanted:
                found.add(id(leaf))
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return found


def _register_grad_ready(p: torch.Tensor, method) -> "torch.utils.hooks.RemovableHandle":
    """p.register_post_accumulate_grad_hook for the handle's bound `method`,
    also for a frozen p (torch refuses to register on a tensor that does not
    require grad; the hook then fires once p is unfrozen). Torch keeps these
    hooks out of the garbage collector's sight, so they hold the handle only
    weakly (the model's forward hooks and the optimizer's patched step()
    keep it alive while either is): a model, optimizer and handle dropped
    without remove() are freed."""
    return _registered_even_if_frozen(p, p.register_post_accumulate_grad_hook,
                                      _tensors.weak_hook(method))


def _register_grad_coming(p: torch.Tensor, method) -> "torch.utils.hooks.RemovableHandle":
    """p.register_hook for the handle's bound `method`, called with id(p) and
    the gradient before it reaches p.grad (a leaf's tensor hooks run before
    its AccumulateGrad), so a hook that raises leaves .grad as it was. Weak
    and also for a frozen p, as _register_grad_ready; torch.save(model)
    leaves it out without warning, as torch.save leaves out all tensor hooks."""
    hook = functools.partial(_tensors.weak_hook(method), id(p))
    hook.__torch_unserializable__ = True  # what torch.utils.hooks.unserializable_hook sets
    return _registered_even_if_frozen(p, p.register_hook, hook)


def _registered_even_if_frozen(p: torch.Tensor, register, hook):
    """register(hook) for one of p's hook registries, also when p is frozen:
    torch refuses to register on a tensor that does not require grad, and
    the hook then fires once p is unfrozen. The unfreezing inside the try:
    a KeyboardInterrupt lands where the interpreter checks for one, as
    right after that call returns, which before the try left p unfrozen."""
    if p.requires_grad:
        return register(hook)
    try:
        p.requires_grad_(True)
        return register(hook)
    finally:
        p.requires_grad_(False)


def _inert_handle(cls: type):
    """What a copy of a handle whose hooks are on a model is: removed, its
    hooks do nothing (see FusionHandle.__reduce__, ooo.DataParallel.__reduce__)."""
    handle = object.__new__(cls)
    handle._removed = True
    return handle


def _nothing() -> None:
    """A handle's _unclaim_all until its take-over claims the parameters."""


def _low_precision_state_as_torch_keeps_it(optimizer: torch.optim.Optimizer) -> None:
    """A torch optimizer keeps its state in the parameter's dtype (its
    load_state_dict casts it so): the reprop engine's float32 state of
    float16/bfloat16 parameters, cast back for torch's own step()."""
    for p, st in optimizer.state.items():
        if not isinstance(p, torch.Tensor) or p.dtype == torch.float32:
            continue
        for key, value in st.items():
            if (key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()
                    and value.dtype != p.dtype):
                st[key] = value.to(dtype=p.dtype)


class FusionHandle:
    """What ``reprop.fuse`` returns: remove() undoes everything it installed."""

    mode: str

    def __init__(self, model: nn.Module, optimizer, engine: optim._FusedOptimizer):
        self.model = model
        self.optimizer = engine
        self._user_optimizer = optimizer
        self._hooks: list = []
        # what _take_over_optimizer claims, for _unhook (nothing before it:
        # fuse() unhooks a handle stopped before its take-over)
        self._unclaim_all: Callable[[], None] = _nothing
        self._removed = False
        self._params = _all_params(engine)
        # id -> fused parameter of a lazy module not yet materialized, whose
        # gradient hook waits for its first forward (_hook_materialized)
        self._lazy: dict = {}
        # ids of the modules owning a parameter of _lazy (_find_lazy_owners)
        self._lazy_owners: frozenset = frozenset()
        # the hooked parameters, whose tensor hooks a swapping conversion drops
        # (see _tensors.SwapWatch): checked once per step by the modes
        self._swap_watch = _tensors.SwapWatch()
        self._check_new(self._params.values())
        self._membership = _membership(engine)
        # the groups followed (_check_added_groups): held, not noted by id, which
        # a group popped and freed would leave to the next dict, a group added
        self._groups = tuple(engine.param_groups)
        # id -> module given this fusion's forward hooks (weakly: the id of one
        # freed may be a new owner's, the next ParametrizationList's)
        self._hooked_modules: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        self._saved: dict = {}  # the optimizer's instance attributes fusion overrides
        self._installed: dict = {}  # what it sets there of those (_take_over_optimizer)
        # what remove() left ours of under a wrapper passes through to (_after_removal)
        self._passing_through: dict = {}
        # Held while the fusion's bookkeeping changes and while it updates:
        # other threads call in too (an async checkpoint's state_dict()
        # flushing forward mode's pending updates while training runs a
        # forward, remove() from a controlling thread, DDP's comm-hook
        # callbacks on the process group's threads), and each must find an
        # update not yet started or over, never half done (applied twice, or
        # a plan's table refilled mid-update). Reentrant: flush() runs
        # inside step(), remove() and the hooks. Every `with self._lock:`
        # holds one call, on its own line: CPython gives the release of a
        # block whose body has lines of its own a line event of its own,
        # where a KeyboardInterrupt (a notebook's stop button lands at the
        # start of any line) skipped the release and left the lock held for
        # good: the thread that stopped re-entered it unnoticed, and any other
        # (a CUDA backward's hooks run on autograd's device thread, remove()
        # or a checkpoint's flush() from another thread) waited on it forever.
        self._lock = threading.RLock()

    def _install(self) -> None:
        """Installs the mode's hooks on the model (fuse() calls it once the
        constructor, which sets state only, has returned the handle)."""
        raise NotImplementedError

    def _take_over_optimizer(self) -> None:
        """Routes the optimizer's step(), zero_grad() and load_state_dict() to
        this fusion, saving what it overrides for remove()."""
        optimizer, engine = self._user_optimizer, self.optimizer
        self._saved = {name: optimizer.__dict__.get(name, _MISSING) for name in _OVERRIDDEN}
        ref = weakref.ref(self)
        _FUSED_BY[optimizer] = _FUSED_BY[engine] = ref
        engine._in_fusion = True  # (its groups: differentiable=True refused from now on)
        # (the set, not the handle: a handle freed without remove() drops its entries)
        self._claimed: set = set()
        self._unclaim_all = weakref.finalize(self, _unclaim, self._claimed, self._claimed, ref)
        self._claim(self._params.values())

        # The optimizer's step() while fused: bound to it, as its own is, so
        # that an LR scheduler made while fused wraps it as it wraps eager's
        # (its wrapper calls step.__func__ bound to the optimizer) and keeps
        # wrapping it after remove(). One made before fuse() wrapped the
        # optimizer's own, which this one replaces: only then does this one
        # carry the scheduler's mark and record its calls as that wrapper
        # would, so the scheduler neither warns that step() was overridden
        # nor that it was not called. (Marked always, a scheduler made while
        # fused did not wrap it: after remove() its first step() warned that
        # optimizer.step() had been overridden, where eager warns nothing.)
        scheduled = getattr(self._saved["step"], "_wrapped_by_lr_sched", False)

        def step(optimizer, *args, **kwargs):
            if scheduled and not self._removed:
                optimizer._opt_called = True  # what the replaced scheduler's wrapper records
            return self._hooked_step(args, kwargs)

        if scheduled:
            step._wrapped_by_lr_sched = True
        self._installed = {}  # name -> what is set, for _unhook (which may find a wrapper of it)
        for name, value in (("step", types.MethodType(step, optimizer)),
                            ("zero_grad", self._zero_grad)):
            setattr(optimizer, name, value)
            self._installed[name] = value
        optimizer._step_supports_amp_scaling = self._step_sees_grad_scaler
        # optimizer.load_state_dict: pending updates first, prepended so that
        # pre-hooks registered before fuse() see them applied, as after an eager
        # step() (appended, such a hook saw forward mode's parameters and state
        # of before step(); one registered after fuse() with prepend=True still
        # runs before it); the loaded groups are checked after the pre-hooks
        # registered before fuse(), as they leave the dict, and again in the
        # post-hook, for those registered after. Then torch's replaces
        # param_groups and state with new objects, which the engine must share.
        self._loaded_over = None  # (see _before_optimizer_load)
        self._hooks.append(optimizer.register_load_state_dict_pre_hook(
            self._before_load, prepend=True))
        self._hooks.append(optimizer.register_load_state_dict_pre_hook(
            self._before_optimizer_load))
        self._hooks.append(optimizer.register_load_state_dict_post_hook(self._after_load))

    def flush(self) -> None:
        """Applies every pending update now."""

    def _before_load(self, *args) -> None:
        self.flush()

    def _before_optimizer_load(self, optimizer, state_dict: dict) -> None:
        """A loaded group the engine would refuse (differentiable=True,
        capturable=True on the CPU) is refused now, before torch replaces
        the groups and state (a refusal in _sync would leave the optimizer
        holding it); the pending updates were applied by _before_load, the
        first pre-hook. The saved groups name their parameters by index, in
        the order of the optimizer's groups. A pre-hook registered after
        fuse() runs after this one and may return another dict: the groups
        and state the optimizer holds now are noted for _after_load, which
        checks what torch installed and puts these back if it refuses."""
        for saved, group in zip(state_dict.get("param_groups", ()), optimizer.param_groups):
            self.optimizer._check_group({**saved, "params": group["params"]})
        self._loaded_over = optimizer.param_groups, optimizer.state

    def _after_load(self, optimizer) -> None:
        over, self._loaded_over = self._loaded_over, None
        with self._lock: self._after_load_locked(optimizer, over)  # noqa: E701 (see _lock)

    def _after_load_locked(self, optimizer, over: tuple | None) -> None:
        if self._removed:
            return
        if over is not None and optimizer.param_groups is not over[0]:
            self._refuse_loaded_groups(optimizer, over)
        self._sync()

    def _refuse_loaded_groups(self, optimizer, over: tuple) -> None:
        """The groups torch's load_state_dict installed, checked as
        _before_optimizer_load checks the dict: a pre-hook registered after
        fuse() (run after that check) may have returned groups the engine
        refuses (differentiable=True). The refusal then came from _sync,
        after torch installed them: the optimizer kept them and every later
        step() raised. It is raised here, with the optimizer's groups and
        state of before the load put back, as when the check refuses first
        (a torch optimizer's only: reprop's refuse in __setstate__, before
        installing anything)."""
        try:
            for group in optimizer.param_groups:
                self.optimizer._check_group(group)
        except BaseException:
            optimizer.param_groups, optimizer.state = over
            raise

    def _sync(self) -> list:
        """Follows the optimizer's groups: a torch optimizer's param_groups and
        state rebound by its load_state_dict, and groups or parameters added
        since fuse() (add_param_group), whose parameters are then fused too.
        Returns those new parameters."""
        opt, engine = self._user_optimizer, self.optimizer
        rebound = opt is not engine and (engine.param_groups is not opt.param_groups
                                         or engine.state is not opt.state)
        if not rebound and _membership(engine) == self._membership:
            return []
        self._before_regroup()
        if rebound:
            engine.param_groups = opt.param_groups
            engine.state = opt.state
        self._check_added_groups()
        engine._forget_plans()
        params = _all_params(engine)
        new = [p for i, p in params.items() if i not in self._params]
        self._check_new(new)  # (before it counts as followed: raised again)
        _unclaim(self._params.keys() - params.keys(), self._claimed, weakref.ref(self))
        self._forget_dropped_lazy(params)
        followed, self._params = self._params, params
        self._swap_watch.retain(params)
        try:
            self._claim(new)
            self._track(new)
        except BaseException:  # (a KeyboardInterrupt): the next call follows again, `new` too
            self._params = followed
            raise
        # last: a sync stopped half-way (a KeyboardInterrupt, a notebook's stop
        # button) must not count as followed, or `new` would never be tracked
        self._membership, self._groups = _membership(engine), tuple(engine.param_groups)
        return new

    def _check_added_groups(self) -> None:
        """Checks the groups of a torch optimizer that the fusion does not
        follow yet (added by torch's add_param_group, which the engine does
        not see, or installed by a load) as the engine's own add_param_group
        checks the group it adds (differentiable=True, capturable=True on the
        CPU, a parameter reprop cannot update); a reprop optimizer's own
        add_param_group and load_state_dict checked its groups already. Only
        those, as eager's add_param_group checks only the group it adds: a
        parameter of an older group whose .data has since become one the
        optimizer cannot take (complex), with no gradient, is no concern of
        eager training, whose step() refuses it only with a gradient, as the
        engine's update does (_check_step). Checked here with every group, it
        made every forward, step() and zero_grad() raise after any
        add_param_group, for good."""
        engine = self.optimizer
        if engine is self._user_optimizer:
            return
        followed = set(map(id, self._groups))
        for group in engine.param_groups:
            if id(group) not in followed:
                engine._check_group(group)

    def _check_new(self, params: Iterable[torch.Tensor]) -> None:
        """Refuses what the mode cannot fuse among `params`, the parameters it
        picks up (at fuse(), before any hook is installed, and in _sync)."""
        _check_params_not_fused(params, self)

    def _claim(self, params: Iterable[torch.Tensor]) -> None:
        """Records this fusion in _FUSION_OF_PARAM as the holder of `params`."""
        ids = dict.fromkeys(map(id, params), weakref.ref(self))
        _FUSION_OF_PARAM.update(ids)
        self._claimed.update(ids)

    def _before_regroup(self) -> None:
        """What the mode must do while the fusion still follows the optimizer's
        old groups, which _sync is about to leave."""

    def _track(self, new: list) -> None:
        """Installs what the mode needs for parameters added to the optimizer."""

    def _hook_params(self, params: Iterable[torch.Tensor]) -> None:
        """Registers the mode's gradient hook on each of `params`, but on a
        lazy module's parameter not yet materialized, which torch refuses to
        hook (an UninitializedParameter): that one waits in _lazy until its
        module's first forward materializes it, in place (_hook_materialized)."""
        for p in params:
            if torch.nn.parameter.is_lazy(p):
                self._lazy[id(p)] = p
            else:
                self._lazy.pop(id(p), None)
                self._hook_param(p)
        self._find_lazy_owners()

    def _forget_dropped_lazy(self, params: dict) -> None:
        """Drops from _lazy the parameters not among `params`, the ones the
        optimizer holds now: one it let go before its materialization would
        otherwise stay there for good, its owner's forwards looking for it."""
        self._lazy = {i: p for i, p in self._lazy.items() if params.get(i) is p}
        self._find_lazy_owners()

    def _find_lazy_owners(self) -> None:
        """Records which modules own a parameter of _lazy: only their
        forwards materialize one (in a lazy module's own pre-hook), so only
        theirs need look for it (_on_training_forward), not every forward
        of the model while an optional lazy head is never called."""
        self._lazy_owners = frozenset(
            id(m) for m in self.model.modules() if _direct_params(m, self._lazy)
        ) if self._lazy else frozenset()

    def _hook_param(self, p: torch.Tensor) -> None:
        """Registers the mode's gradient hook on `p`."""
        raise NotImplementedError

    def _hook_materialized(self) -> None:
        """Registers the gradient hook of each parameter of _lazy materialized
        since and still fused. The modes call it where no gradient can have
        reached one yet: backward mode at each forward of a module owning
        one (its first materializes it), forward mode at step(), before it
        has an update pending."""
        done = [p for p in self._lazy.values() if not torch.nn.parameter.is_lazy(p)]
        for p in done:
            if self._params.get(id(p)) is p:  # (not one the optimizer has let go since)
                self._hook_param(p)
            # hooked first: a KeyboardInterrupt (a notebook's stop button) in
            # between leaves it to the next call, not unhooked for good
            del self._lazy[id(p)]
        if done:
            self._find_lazy_owners()

    def _owners_to_hook(self) -> Iterator[nn.Module]:
        """Modules of the model that own fused parameters and have no forward
        hooks of this fusion yet. Each counts as hooked once the caller's
        loop has hooked it: a KeyboardInterrupt (a notebook's stop button)
        in between leaves it to the next call, where counting it first would
        leave it unhooked for good (hooked twice, the second run of its hooks
        finds nothing to do)."""
        fresh = [m for m in self.model.modules()
                 if not self._hooks_on(m) and _direct_params(m, self._params)]
        for m in fresh:
            yield m
            self._hooked_modules[id(m)] = m

    def _hooks_on(self, module: nn.Module) -> bool:
        """Whether `module` has this fusion's forward hooks."""
        return self._hooked_modules.get(id(module)) is module

    def remove(self) -> None:
        """Applies pending updates, removes every hook and restores the
        optimizer's own step() and zero_grad(): plain eager training again.
        Safe to call from another thread than training's. The handle then
        holds the model and the optimizer weakly: ``handle.model`` and
        ``handle.optimizer`` are None once nothing else holds them (the
        reprop counterpart of a torch optimizer, which only the fusion held,
        at once); flush() and remove() do nothing, as on a copy's inert
        handle (_inert_handle, which has no lock)."""
        if self._removed:
            return
        with self._lock: self._remove_locked()  # noqa: E701 (see _lock)

    def _remove_locked(self) -> None:
        if not self._removed:  # (another thread's remove() since)
            try:
                self._undo()
            finally:
                self._removed = True
                self._let_go()

    def _let_go(self) -> None:
        """Once removed: a handle the user keeps (a notebook variable, a
        `with` target) must not keep the model, the optimizer or their
        parameters alive, as it did for as long as it lived. What runs on a
        removed handle (the hooks torch cannot unregister, a step() or
        zero_grad() that another thread's remove() overtook) reads the
        model and the optimizers through weak references (__getattr__), and
        the records of the parameters are emptied. The weak references come
        first: a KeyboardInterrupt in between leaves each name readable."""
        self._weakly = {name: weakref.ref(getattr(self, name)) for name in _HELD_UNTIL_REMOVED}
        for name in _HELD_UNTIL_REMOVED:
            del self.__dict__[name]
        self._params, self._lazy, self._groups = {}, {}, ()

    def __getattr__(self, name: str):
        """model, optimizer and _user_optimizer of a removed handle
        (_let_go): the object, or None once freed. Called only for names
        not found as usual, so a live handle's reads cost nothing more."""
        weakly = self.__dict__.get("_weakly", {})  # (none on a live or an inert handle)
        if name not in weakly:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return weakly[name]()

    def _undo(self) -> None:
        """What remove() does, under the lock, while the fusion is still on.
        A refused update (a gradient made sparse after step()) still raises,
        after the fusion is gone: left installed, it could never be removed."""
        try:
            self.flush()
        finally:
            self._unhook()

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        opt = self._user_optimizer
        for name, value in self._saved.items():
            installed = self._installed.get(name, _MISSING)
            if installed is not _MISSING and opt.__dict__.get(name) is not installed:
                # A wrapper set on the optimizer since (a user's, accelerate's,
                # an LR scheduler's made while fused), calling ours: putting
                # back what ours replaced dropped it, silently. It stays, and
                # ours passes through to what it replaced (_after_removal);
                # held without a reference to the optimizer (_held_weakly).
                self._passing_through[name] = _held_weakly(value, opt)
            elif value is _MISSING:
                opt.__dict__.pop(name, None)
            else:
                setattr(opt, name, value)
        self._installed = {}
        if opt is not self.optimizer:
            _low_precision_state_as_torch_keeps_it(opt)
        _FUSED_BY.pop(opt, None)
        _FUSED_BY.pop(self.optimizer, None)
        self.optimizer.__dict__.pop("_in_fusion", None)
        self._unclaim_all()
        self._swap_watch = _tensors.SwapWatch()  # (lets go of the parameters)

    def _after_removal(self, opt, name: str) -> Callable:
        """What a call of this fusion's `name` (step, zero_grad,
        __getstate__) made after remove() runs: the optimizer's method of
        now (its own, or a later fusion's: a method captured while fused),
        but where remove() left ours under a wrapper set since, which calls
        ours: there what ours replaced (the optimizer's of now is that
        wrapper, which would call ours again, without end)."""
        own = self._passing_through.get(name, _NOT_PASSING)
        if own is _NOT_PASSING:
            return getattr(opt, name)
        own = _rebound(own, opt)
        return getattr(type(opt), name).__get__(opt) if own is _MISSING else own

    def _step_after_removal(self) -> None:
        """A step() that another thread's remove() overtook (after its
        pre-hooks and closure, before its update): it is eager training's
        step() after remove(), so it updates every parameter with a gradient
        now, with the kernel fusion uses (the optimizer's own step() would
        run the step pre-hooks again). remove() let go of the engine, which
        only the fusion held for a torch optimizer: the same one is made again."""
        engine = self.optimizer
        if engine is None:
            engine = _engine_for(self._user_optimizer)
        optim._FusedOptimizer.step(engine)
        if self._user_optimizer is not self.optimizer:
            _low_precision_state_as_torch_keeps_it(self._user_optimizer)

    def __reduce__(self):
        """copy.deepcopy(model) and torch.save(model) copy the hooks this
        handle installed on the model's modules (bound methods), and with
        them the handle: the copy (a teacher, an EMA, a fine-tuned clone) is
        a plain model of its own, so what it gets is an inert, removed handle
        whose hooks do nothing, not a clone of the optimizer that would
        update it. (Parameters' own hooks are not copied by torch.) Its class
        is the one its module names now: a handle made before a reload of
        the module has the class the reload replaced, which pickle refuses
        as not the same object."""
        return _inert_handle, (_tensors.current_class(type(self)),)

    def __enter__(self) -> "FusionHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # Under torch.compile, dynamo must neither trace what torch calls of a
    # fusion (its module and gradient hooks, the step() and zero_grad() it
    # installs) nor compile the functions they call, which it otherwise does
    # at each graph break in them (locks, C calls): it raised inside them
    # (forward mode: InternalTorchDynamoError at the first compiled forward
    # or step(); backward mode under compiled autograd: its queue_callback
    # AssertionError) and guarded compiled code on the bookkeeping. Each such
    # method runs eagerly there: one graph break (_tensors.eager_under_compile).
    @_tensors.eager_under_compile
    def _hooked_step(self, args: tuple, kwargs: dict):
        """The mode's step() inside the optimizer's step hooks, in the order of
        torch's Optimizer.profile_hook_step, which the step() fusion installs
        on the instance bypasses: global pre-hooks, own pre-hooks (either may
        return new (args, kwargs)), step, own post-hooks, global post-hooks,
        each read from the live hook dicts as torch reads them: a hook that
        registers or removes one of its kind (a one-shot hook removing
        itself) gets torch's 'mutated during iteration' error, and a
        pre-hook's skips the step, as in eager training. Post-hooks see the
        step finished, as after an eager step(): pending updates applied,
        side streams joined. A step() captured while fused and called after
        remove() is the optimizer's step() of now (its own, or a later
        fusion's)."""
        opt = self._user_optimizer
        if self._removed:
            return self._after_removal(opt, "step")(*args, **kwargs)
        args = (opt, *args)  # torch's hooks get the optimizer as args[0]
        own_pre, global_pre = opt._optimizer_step_pre_hooks, torch_optimizer._global_optimizer_pre_hooks
        if self.mode == "backward" and (own_pre or global_pre):
            kind = ("a step pre-hook (optimizer.register_step_pre_hook)" if own_pre else
                    "a global optimizer step pre-hook (register_optimizer_step_pre_hook)")
            raise RuntimeError(f"reprop.fuse(mode='backward'): the optimizer has {kind}, but "
                               "backward mode applied the updates inside backward(), before step() "
                               "could run it; use mode='forward', or remove the hook")
        if (own_pre or global_pre) and self._pending:
            # forward mode, a second step() before any forward: eager's pre-hooks
            # see the first step's updates made (and may change the gradients)
            self.flush()
        for hook in itertools.chain(global_pre.values(), own_pre.values()):
            result = hook(opt, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"optimizer step pre-hook {hook!r}: expected None or a "
                                       f"tuple (new_args, new_kwargs), got {result!r}")
                args, kwargs = result
        out = self._step(*args[1:], **kwargs)
        own_post, global_post = (opt._optimizer_step_post_hooks,
                                 torch_optimizer._global_optimizer_post_hooks)
        if own_post or global_post:
            self.flush()
            for hook in itertools.chain(own_post.values(), global_post.values()):
                hook(opt, args, kwargs)
        return out

    def _step(self, closure=None):
        loss = None
        if closure is not None:  # outside the lock: it runs forward and backward
            with torch.enable_grad():
                loss = closure()
        with self._lock: self._step_locked()  # noqa: E701 (see _lock)
        return loss

    def _step_locked(self) -> None:
        if self._removed:
            self._step_after_removal()
        else:
            self._fused_step()

    def _fused_step(self) -> None:
        """What the mode's step() does once the closure has run (under the lock)."""
        raise NotImplementedError

    # Whether GradScaler.step() sets grad_scale and found_inf on the optimizer
    # and calls step() as is (torch's protocol for optimizers that unscale
    # themselves), instead of unscaling the gradients and calling step() only
    # if they are finite.
    _step_sees_grad_scaler = False

    @_tensors.eager_under_compile
    def _zero_grad(self, set_to_none: bool = True) -> None:
        with self._lock: self._zero_grad_locked(set_to_none)  # noqa: E701 (see _lock)

    def _zero_grad_locked(self, set_to_none: bool) -> None:
        if self._removed:  # by another thread since this call began: eager's
            opt = self._user_optimizer  # (None: freed after remove(), nothing left to zero)
            if opt is not None:
                self._after_removal(opt, "zero_grad")(set_to_none)
        else:
            self._fused_zero_grad(set_to_none)

    def _fused_zero_grad(self, set_to_none: bool) -> None:
        raise NotImplementedError


class _BackwardFusion(FusionHandle):
    """Algorithm 3: update each parameter as soon as its gradient is complete."""

    mode = "backward"

    def __init__(self, model, optimizer, engine, accumulation_steps: int, keep_grads: bool,
                 comm_hook: Callable | None = None, comm_state: object = None):
        super().__init__(model, optimizer, engine)
        self._every = accumulation_steps
        self._keep_grads = keep_grads
        # Micro-batches of this window so far (a window ends at its updating
        # backward or at a step()): the training forwards between two backward
        # passes (a model called twice per micro-batch, or a forward recomputed by
        # checkpointing inside backward, is one micro-batch, as in the eager loop).
        self._micro_batches = 0
        self._backward_since_forward = True
        # A SwapWatch check is due at the next grad-mode training forward that
        # starts no micro-batch (see _on_training_forward): set by each forward
        # of the model, step() and zero_grad(), cleared by each check
        self._swap_check_due = True
        # _backward_pass() of the backward that set it (None: set outside one)
        self._marked_in: Callable | None = None
        self._pass: Callable | None = None  # see _backward_pass
        self._groups_followed_in: int | None = None  # see _follow_groups
        # id(param) -> (param, _grad_mark of its .grad, weakly that .grad) whose
        # .grad (keep_grads=True) holds a gradient applied already, kept for the
        # user until the next micro-batch. Every other .grad of a fused param (one
        # set by hand since too) is one not applied yet: what step() applies and
        # zero_grad() clears, as in eager training.
        self._kept: dict = {}
        # id -> the ParametrizationLists owning fused parameters (see _hook_parametrized;
        # weakly, as _hooked_modules: an id seen is a freed one's that another reuses)
        self._reads: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        # set_to_none of a zero_grad() called since the kept gradients were applied
        # (deferred: they are still there), None when none was: remove() does to
        # them what that call did in eager training.
        self._kept_zeroed: bool | None = None
        # No step() called since the kept gradients were applied: eager's .grad
        # holds them unapplied, so an eager step() after remove() would apply them
        # again; remove() frees them.
        self._kept_unstepped = False
        # The kept gradients were refused as changed in place since their update
        # (_refuse_kept_grads_edited), and stay refused until a zero_grad() after it.
        self._kept_edit_refused = False
        self._ready: dict = {}  # id(param) -> param with a complete gradient, not yet updated
        # _on_backward_end is queued for a backward that has not ended: when its
        # entry is gone unrun too, that backward raised (see _drop_failed_pass).
        self._pass_open = False
        self._updated: set = set()  # ids of the params updated since the window's last step
        # ids of the params a window's step moved before its step() was called
        # (finished at a forward or flush() after the updating backward, which
        # lets the next gradients in: _updated is empty again). That step() is
        # eager's step of the window, which moves each param once, so it moves
        # these no more. Cleared by that step() and by the next gradient,
        # which belongs to the next window.
        self._moved_before_step: set = set()
        # ids of the params moved since the last step() or zero_grad(): eager's
        # step() moves each once, from the gradients since the last zero_grad();
        # and one of them given a gradient since by an accumulating micro-batch
        # (see _refuse_late_gradients).
        self._moved_in_step: set = set()
        self._late: torch.Tensor | None = None
        # The hyper-parameters of the window's updating backward, while the
        # updates its step() makes without a gradient there are still due.
        self._step_settings: dict | None = None
        # After zero_grad(set_to_none=False) eager keeps a zero .grad for every param
        # that had one since its last zero_grad(set_to_none=True), and step() moves
        # it (momentum, weight decay): those params (id -> param), updated by this
        # fusion, which freed their gradients then (unless keep_grads).
        self._zeroed_not_freed = False
        self._updated_since_freed: dict = {}
        self._ddp_updated: list = []  # params updated from all-reduced DDP buckets this backward
        # params of this backward's DDP buckets this rank gave no gradient: updated
        # at its end if another rank did
        self._ddp_unused_here: list = []
        # weakly, the end-of-backward callbacks queued (dead when done, or
        # dropped by a backward that raised: then queued again)
        self._end_ref = self._join_ref = _tensors.not_queued
        self._side_streams: dict = {}  # CUDA device -> the stream updates run on
        self._batch_of: dict = {}
        # id(param) -> the handle of this fusion's post-accumulate-grad hook on it
        self._grad_hooks: dict = {}
        # id(param) -> param whose update waited for the end of backward because
        # hooks registered after this fusion's ran after it: its hook is
        # registered again there, to be last (see _hooks_after_ours)
        self._hooked_behind: dict = {}
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        if self._ddp:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            # Local gradients are not final under DDP: update after each bucket's
            # all-reduce (or the user's hook). DDP's C++ Reducer keeps the hook out
            # of the garbage collector's sight (see _register_grad_ready); DDP cannot
            # unregister it, so once the handle is gone (removed and dropped) it is
            # the user's hook, or DDP's own all-reduce.
            self._comm_hook = comm_hook or allreduce_hook
            # allreduce_hook's state is its group: DDP's own (None would be WORLD's)
            self._comm_state = comm_state if comm_hook is not None else model.process_group

    def _install(self) -> None:
        if self._ddp:
            _register_bucket_hook(self.model, self._ddp_bucket_hook, self._comm_state,
                                  self._comm_hook)
        self._track(list(self._params.values()))
        self._hooks.append(self.model.register_forward_pre_hook(self._on_root_forward))
        if self._ddp and self._every > 1:  # (see _on_root_forward_end)
            self._hooks.append(self.model.register_forward_hook(self._on_root_forward_end))

    def _check_new(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        super()._check_new(params)
        _check_not_optimized_in_backward(params, self.model)

    def _track(self, new: list) -> None:
        # Parameters of one module complete together (one backward node): one call for
        # them. A parameter shared by several modules goes with the first that owns it.
        self._batch_of = {}
        for module in self.model.modules():
            batch = tuple(p for p in _direct_params(module, self._params)
                          if id(p) not in self._batch_of)
            for p in batch:
                self._batch_of[id(p)] = batch
        for p in self._params.values():
            self._batch_of.setdefault(id(p), (p,))
        # parameters removed from the optimizer are not held any more
        self._updated_since_freed = {i: p for i, p in self._updated_since_freed.items()
                                     if i in self._params}
        self._hook_params(new)
        # a micro-batch starts, and the last step ends (what a gradient then reaching
        # an updated parameter is not a second one of), at the first forward of any
        # module with fused parameters: the root's may not run (layers called one by one)
        for module in self._owners_to_hook():
            self._hooks.append(module.register_forward_pre_hook(self._on_training_forward))
        self._hook_parametrized()

    def _hook_parametrized(self) -> None:
        """A ParametrizationList owning fused parameters (torch.nn.utils.parametrize's,
        weight_norm's) runs at every read of its tensor, `layer.weight` logged after
        step() too, not only in its module's forward: that read is no training
        forward (counted one, it freed the kept gradients, keep_grads=True, where
        eager's .grad holds them). Its module's forward is: hooked here, whether or
        not it owns fused parameters of its own (a Linear without bias called alone)."""
        for module in self.model.modules():
            if not parametrize.is_parametrized(module):
                continue
            lists = [plist for plist in module.parametrizations.values() if self._hooks_on(plist)]
            self._reads.update((id(plist), plist) for plist in lists)
            if lists and not self._hooks_on(module):
                self._hooks.append(module.register_forward_pre_hook(self._on_training_forward))
                self._hooked_modules[id(module)] = module

    def _hook_param(self, p: torch.Tensor) -> None:
        # under DDP the bucket hook updates; a no_sync() backward calls no bucket
        # hook, yet ends a micro-batch
        on_grad = self._on_grad_ready if not self._ddp else self._on_ddp_grad_ready
        # (a param removed from the optimizer and added again has the hook already)
        old = self._grad_hooks.pop(id(p), None)
        if old is not None:
            old.remove()
        self._grad_hooks[id(p)] = _register_grad_ready(p, on_grad)
        self._swap_watch.add(p)

    def flush(self) -> None:
        """Updates are applied inside backward, and what the last step() makes
        without a gradient there; on CUDA, makes the current streams wait for
        those still running on the side streams."""
        if self._removed:  # also a copy's inert handle
            return
        # (locked: the hooks of a backward on another thread add side streams)
        with self._lock: self._flush_locked()  # noqa: E701 (see _lock)

    def _flush_locked(self) -> None:
        if _tensors.outside_backward():
            self._finish_step()
        self._join_side_streams()

    def _unhook(self) -> None:
        super()._unhook()
        for hook in self._grad_hooks.values():
            hook.remove()
        self._grad_hooks.clear()
        self._hooked_behind.clear()

    def _undo(self) -> None:
        super()._undo()
        # No training forward will free the kept gradients now: the next eager
        # backward would accumulate onto those of a step already applied, and
        # an eager step() before it (none called since their update) would
        # apply them a second time; so would it move them from the zeros of a
        # zero_grad(set_to_none=False) since: freed then too (0.048 off eager)
        if self._kept_zeroed is not None or self._kept_unstepped:
            self._discard_kept(True if self._kept_zeroed is None or self._kept_unstepped
                               else self._kept_zeroed)
        self._give_back_zeroed_grads()

    def _let_go(self) -> None:
        super()._let_go()
        self._batch_of, self._updated_since_freed, self._kept = {}, {}, {}

    def _give_back_zeroed_grads(self) -> None:
        """After zero_grad(set_to_none=False) eager holds a zero .grad for
        every param updated since the last zero_grad(set_to_none=True), and
        each later eager step() moves it from those zeros when no backward
        reaches it (momentum, weight decay, Adam's step); this fusion freed
        them after their update, and only its own steps gave the zeros back
        (_apply_unapplied): remove() gives them back for the steps after it.
        So it does after a step() that no zero_grad() followed yet: eager
        holds the applied gradients there, which the loop's next
        zero_grad(set_to_none=False) makes those zeros (left None, the eager
        steps after it did not move the params: 0.12 off eager's with SGD's
        momentum); its zero_grad(set_to_none=True) frees them as eager's.
        Not to the params the window's step moved before its step() was
        called (remove() between backward() and step()): that eager step()
        would move them a second time."""
        moved = self._moved_by_window_step()
        for i, p in self._updated_since_freed.items():
            # (nor to those moved by a window not stepped: see _apply_unapplied)
            if p.grad is None and i not in moved and i not in self._moved_in_step:
                p.grad = _zero_grad_for(p)

    @_tensors.eager_under_compile
    def _on_root_forward(self, module, args) -> None:
        if self._removed:  # the hook of a copy of the model (see __reduce__)
            return
        with self._lock: removed = self._sync_unless_removed()  # noqa: E701 (see _lock)
        if removed:  # by another thread since
            return
        self._swap_check_due = True  # (each forward of the model checks: see there)
        self._on_training_forward(module, args)

    def _sync_unless_removed(self) -> bool:
        """_sync() unless removed (under the lock); whether removed."""
        if self._removed:
            return True
        self._sync()
        return False

    @_tensors.eager_under_compile
    def _on_training_forward(self, module, args) -> None:
        """A forward of the model or of a module owning fused parameters: the
        step of a window whose last backward is over is finished first (eval
        forwards must see it, and a gradient after it is not a second one of
        the updated parameters); in grad mode,
        the first forward after a backward starts a micro-batch."""
        if self._removed:  # the hook of a copy of the model (see __reduce__)
            return
        if self._reads and self._reads.get(id(module)) is module:  # a parametrized tensor read (_hook_parametrized)
            if _tensors.outside_backward():
                self._finish_step()
            return
        if id(module) in self._lazy_owners:
            # a lazy module's own pre-hook, registered at its construction and so
            # run before this one, has materialized its parameters by now: hooked
            # before its backward (one missed, materialized without a forward of
            # its module, has its gradient applied by step(), as one set by hand)
            with self._lock: self._hook_materialized()  # noqa: E701 (see _lock)
        if not _tensors.outside_backward():  # a forward that checkpointing recomputes
            # counts only when it is the micro-batch's first grad-mode forward (a
            # reentrant checkpoint of the whole model runs the first under no_grad),
            # not when a gradient of this backward pass came before it (a nested
            # checkpoint's recompute, in a nested backward of a reentrant one)
            this_pass = self._backward_pass()
            if torch.is_grad_enabled() and self._backward_since_forward \
                    and self._marked_in is not this_pass:
                self._start_micro_batch()
            return
        self._finish_step()
        if not torch.is_grad_enabled():
            return
        if self._backward_since_forward:
            self._start_micro_batch()
            return
        if self._kept:
            # kept by a step() after this micro-batch's first forward (a training
            # accuracy taken before stepping): freed at this training forward, as
            # at a micro-batch's first; kept, its backward added to the applied
            # gradients, and the window's update applied them again
            with self._lock: self._discard_kept(set_to_none=True)  # noqa: E701 (see _lock)
        if self._swap_check_due:
            # A grad-mode forward with no backward seen since the last one (an
            # evaluation forward left in grad mode, a model called twice per
            # micro-batch): a swapping conversion since dropped the hooks that
            # would see the next backward, so no micro-batch would ever start
            # again to check (every update was left to step(), for good).
            # Once per forward of the model, or after step() or zero_grad() where
            # its layers are called one by one (not once per owner module).
            with self._lock: self._check_swaps()  # noqa: E701 (see _lock)

    @_tensors.eager_under_compile
    def _on_root_forward_end(self, module, args, output) -> None:
        """Accumulating under DDP: hooks the outputs of a training forward
        that no backward followed yet, so that a no_sync() backward is seen
        where it gives no fused parameter of this rank a gradient (a branch
        this rank's micro-batch did not take; DDP calls no bucket hook
        there). Unseen, this rank counted one micro-batch less than the
        others and left its update to step(); in a loop not calling step()
        it updated at other backward passes than the other ranks, its
        gradients, never freed, all-reduced again into their updates (rank
        1 0.027 from rank 0 after 4 windows, rank 0 0.0054 from eager DDP).
        The hook costs about 10 us a micro-batch (a Python hook fired inside
        backward), next to DDP's own per-forward Python; without DDP such a
        micro-batch only delays a window's update to step() (README: not
        seen). Outputs with a grad_fn only: a hook on a leaf (a parameter
        returned) would stay there for good."""
        if (self._removed or self._backward_since_forward or not torch.is_grad_enabled()
                or not _tensors.outside_backward() or _tensors.transform_active()):
            return
        seen = _tensors.weak_hook(self._on_output_grad)
        for t in _pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.register_hook(seen)

    @_tensors.eager_under_compile
    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if _tensors.fake_mode_active():
            return  # (see _on_grad_ready)
        with self._lock: self._note_backward_unless_removed()  # noqa: E701 (see _lock)

    def _note_backward_unless_removed(self) -> None:
        if not self._removed:
            self._note_backward()

    def _check_swaps(self) -> None:
        """The SwapWatch check a forward is due (under the lock)."""
        self._swap_check_due = False
        self._swap_watch.check()

    def _start_micro_batch(self) -> None:
        """Counts a micro-batch, and frees the gradients kept since the last
        update (eager's zero_grad() cleared them before it): also when it
        starts inside backward, at a recompute that no gradient of this pass
        came before (so none of its gradients is among them)."""
        # (locked: remove() on another thread zeroes the kept gradients too)
        with self._lock: self._start_micro_batch_locked()  # noqa: E701 (see _lock)

    def _start_micro_batch_locked(self) -> None:
        # before its backward: a conversion since that swapped the parameters
        # (torch.__future__.set_swap_module_params_on_conversion) dropped the
        # update hooks, and every backward after it left its gradients to step()
        self._swap_check_due = False
        self._swap_watch.check()
        if self._kept_unstepped:  # (step() checked them; later edits change no step)
            # before anything changes: refused, no micro-batch has started, so a
            # retry is checked (and refused) again; counted, it would skip the
            # check, and its backward would add to the kept gradients and apply them
            self._refuse_kept_grads_edited()
        self._backward_since_forward = False
        self._micro_batches += 1
        self._groups_followed_in = None  # (gradients run outside backward: see there)
        self._discard_kept(set_to_none=True)

    def _discard_kept(self, set_to_none: bool) -> None:
        """Does to the kept gradients what eager's zero_grad() did to them
        (not to one set by hand since: see _forget_kept_replaced)."""
        for p, _, kept in self._kept.values():
            if p.grad is not None and p.grad is kept():
                _zero_grad_of(p, set_to_none)
        self._kept.clear()
        self._kept_edit_refused = False

    def _forget_kept_replaced(self) -> None:
        """Drops the params whose kept gradient (keep_grads=True), applied
        already, was replaced since: one set by hand (p.grad = g) is eager's,
        as on any other param, which step() applies and zero_grad() discards
        (taken for the kept one, the next training forward freed it: 0.002
        off eager's; and step() refused it as changed in place)."""
        replaced = [i for i, (p, _, kept) in self._kept.items() if p.grad is not kept()]
        for i in replaced:
            del self._kept[i]

    def _mark_backward(self, p: torch.Tensor) -> None:
        self._moved_before_step.clear()  # (a gradient opens the next window)
        self._note_backward()

    def _note_backward(self) -> None:
        """A backward of this micro-batch is running (or ran, outside
        backward): the next training forward starts another."""
        if not self._backward_since_forward:
            self._backward_since_forward = True
            self._marked_in = None if _tensors.outside_backward() else self._backward_pass()

    def _backward_pass(self) -> Callable:
        """A token of the backward pass running now, the same in the nested
        backward passes of its reentrant checkpoints (whose graph task ids
        are new ones): queue_end_of_backward's function, which gives its
        entry until the end of the pass in which this fusion first saw a
        gradient or a forward, the outermost one unless every fused module
        runs inside a nested reentrant checkpoint, and None once that pass
        is over or raised (which drops the pass's callbacks)."""
        if self._pass is None or self._pass() is None:
            self._pass = _tensors.queue_end_of_backward(lambda: None)
        return self._pass

    def _updating(self) -> bool:
        # Without accumulation every backward updates, even one after a forward
        # that bypassed every hook (model.forward(x) on a model owning the params).
        return self._every == 1 or (self._micro_batches > 0
                                    and self._micro_batches % self._every == 0)

    @_tensors.eager_under_compile
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if _tensors.fake_mode_active():
            return  # a dry run's backward (fake gradients): eager's updates nothing either
        with self._lock: self._on_grad_ready_locked(p)  # noqa: E701 (see _lock)

    def _on_grad_ready_locked(self, p: torch.Tensor) -> None:
        if self._removed:  # by another thread during this backward: p.grad is eager's now
            return
        self._mark_backward(p)
        if not self._updating():  # accumulating: eager would not step now
            self._note_if_late(p)
            return
        self._note_if_moved_again(p)
        first_of_pass = self._end_ref() is None  # (no update of this pass yet)
        if first_of_pass:
            self._follow_groups()
        if id(p) not in self._params:
            return  # no longer in the optimizer
        if id(p) in self._updated:
            self._refuse_second_gradient(p)
        # Parameters whose module-mates got no gradient this time are updated at the
        # end of backward; outside one (reprop.ooo's run() of held weight gradients
        # fires the hook), what is left waits for _finish_step.
        if first_of_pass and not _tensors.outside_backward():
            self._drop_failed_pass()  # (a retry of a backward that raised)
            self._end_ref = _tensors.queue_end_of_backward(self._on_backward_end)
            self._pass_open = True
        if self._step_settings is None:
            self._step_settings = _settings_snapshot(self.optimizer)
        self._ready[id(p)] = p
        batch = _complete(self._batch_of[id(p)], self._ready)
        if batch:
            if self._hooks_after_ours(p):  # they see .grad first: at the end of backward
                self._hooked_behind[id(p)] = p
            else:
                self._update(batch)

    def _follow_groups(self) -> None:
        """Follows the optimizer's groups as they are at this backward, whose
        updates are eager's step() after it: a group removed, or a parameter
        moved to another group, between the forward (_sync followed them
        there) and the backward. One comparison of the groups per backward
        pass (its graph task), at its first update; outside backward
        (reprop.ooo's run() of held gradients, whose task id is always -1)
        one per micro-batch (each one's forward forgets the last)."""
        task = torch._C._current_graph_task_id()
        if task != self._groups_followed_in:
            self._sync()
            self._groups_followed_in = task

    def _hooks_after_ours(self, p: torch.Tensor) -> bool:
        """Whether p has post-accumulate-grad hooks registered after this
        fusion's (after fuse()): torch runs them in registration order, so
        they would find the gradient freed and their edits of it lost, where
        in eager training every hook sees the gradient before step(). A look
        at the last key of p's ordered hook dict."""
        return next(reversed(p._post_accumulate_grad_hooks)) != self._grad_hooks[id(p)].id

    def _put_hooks_last(self) -> None:
        """Registers this fusion's hook again on the parameters whose update
        waited for hooks registered after it, so that from the next backward
        on those hooks run first and the update is fused again. At the end of
        backward: while it runs a parameter's hooks, torch iterates their dict."""
        for i, p in self._hooked_behind.items():
            self._grad_hooks.pop(i).remove()
            self._grad_hooks[i] = _register_grad_ready(p, self._on_grad_ready)
        self._hooked_behind.clear()

    @_tensors.eager_under_compile
    def _on_ddp_grad_ready(self, p: torch.Tensor) -> None:
        # (a second backward of one forward: DDP's reducer ignores it, and the
        # local gradient would stay in .grad for the next step's all-reduce)
        if _tensors.fake_mode_active():
            return  # (see _on_grad_ready)
        with self._lock: self._on_ddp_grad_ready_locked(p)  # noqa: E701 (see _lock)

    def _on_ddp_grad_ready_locked(self, p: torch.Tensor) -> None:
        if self._removed:
            return
        self._mark_backward(p)
        if id(p) in self._updated:
            self._refuse_second_gradient(p)
        if not self._updating():
            self._note_if_late(p)
        else:
            self._note_if_moved_again(p)

    def _note_if_late(self, p: torch.Tensor) -> None:
        """Notes p if this accumulating micro-batch's gradient reached it after
        an update since the last step() or zero_grad() (see
        _refuse_late_gradients). A lookup per gradient of an accumulating
        micro-batch only; step() then checks nothing per parameter."""
        if id(p) in self._moved_in_step:
            self._late = p

    def _note_if_moved_again(self, p: torch.Tensor) -> None:
        """Notes p if an updating backward's gradient reached it after an
        update of an earlier window since the last step() or zero_grad(): a
        loop that accumulates over more backward passes than
        accumulation_steps (the default 1 included), where eager's step()
        makes one update from their sum. backward() must update now (a loop
        that never calls step() is served by it), so step() refuses it (see
        _refuse_late_gradients). A lookup per updated gradient."""
        if id(p) in self._moved_in_step and id(p) not in self._updated:
            self._late = p

    def _refuse_second_gradient(self, p: torch.Tensor) -> None:
        """A gradient for a parameter already updated since the last step() or
        forward of a module owning fused parameters: a second backward() of
        the same forward (two losses, retain_graph=True), or a second nested
        backward of reentrant checkpoints (a weight used in two segments, or
        inside and outside one). Eager's step() applies the sum of the
        gradients once; here the first one is applied already, and applying
        the next one too is silently wrong where autograd does not catch the
        in-place change (a weight it did not save for backward: an
        Embedding's, a bias). Raised before any parameter is updated twice."""
        # the exception ends this backward, and autograd drops its end callbacks
        self._join_side_streams()
        raise RuntimeError(
            f"reprop.fuse(mode='backward'): a parameter of shape {tuple(p.shape)} got a second "
            "gradient after its update, before optimizer.step() or the next forward of the "
            "model or of a module owning fused parameters: several backward() calls per step "
            "(e.g. two losses, retain_graph=True) each update it, where eager step() applies "
            "their sum once. Add the losses and call backward() once, or use mode='forward'. "
            "(A weight used in two reentrant checkpoint segments, or both inside and outside "
            "one, gets one gradient per nested backward: use use_reentrant=False there.)")

    def _on_backward_end(self) -> None:
        # (under reentrant checkpointing this may be a nested backward's end:
        # what it updates is complete, and the rest waits for _finish_step)
        with self._lock: self._on_backward_end_locked()  # noqa: E701 (see _lock)

    def _on_backward_end_locked(self) -> None:
        self._pass_open = False
        if self._removed:  # (eager's step() applies what is ready)
            return
        if self._ready:
            self._update(list(self._ready.values()))
        if self._hooked_behind:
            self._put_hooks_last()

    def _drop_failed_pass(self) -> None:
        """Forgets a backward that reached this fusion and raised (an error in
        a hook, an update refused, a KeyboardInterrupt), which dropped its
        end-of-backward callback. The parameters it updated stay updated
        (inherent: each was updated when backward reached it); the gradients
        it gave the others stay in .grad unapplied, as eager leaves them
        after a backward that raised, for zero_grad() to discard or step()
        to apply. Eager steps nothing there, so its step is not finished for
        the rest (no update from zeros, no leftovers of its window)."""
        if self._pass_open and self._end_ref() is None:
            self._pass_open = False
            self._ready.clear()
            self._step_settings = None
            self._join_side_streams()  # its end would have joined them

    def _finish_step(self, stepping: bool = False) -> None:
        """At step(), flush() or the next forward, once the updating backward
        of a window is over: what eager's step() updates although that
        backward gave it no gradient (_apply_unapplied), with that backward's
        hyper-parameters. At step() (`stepping`) also when no updating
        backward ended the window (a shorter last window of an epoch,
        gradients set by hand): what eager's step() updates, with the
        hyper-parameters of now; the next micro-batch then starts a window.
        Called outside backward; a backward that reached this fusion and
        still runs on another thread (its end callback is queued) is not
        over, so its step is finished after it, at the next step(), flush()
        or forward."""
        if not stepping and self._step_settings is None and not self._updated:
            return  # nothing to finish, as at most forwards: no lock taken
        with self._lock: self._finish_step_locked(stepping)  # noqa: E701 (see _lock)

    def _finish_step_locked(self, stepping: bool) -> None:
        if self._removed or self._end_ref() is not None:
            return
        self._drop_failed_pass()
        # (None after DDP's bucket hooks, which update without step settings)
        settings, self._step_settings = self._step_settings, None
        if stepping and self._kept_zeroed is False:
            # keep_grads: a zero_grad(set_to_none=False) since the kept gradients'
            # update left eager zeros there, which this step() moves the params
            # from (momentum, weight decay); deferred, the kept ones were skipped
            # as applied, and the params not moved (0.027 off eager)
            self._discard_kept(False)
        if settings is not None or stepping:
            self._apply_unapplied(settings)
        # the window's step is finished: a gradient from now on is not a second
        # one, and until one comes, the window's step() (if this is not it)
        # moves none of the params this finish found moved
        self._moved_before_step = set() if stepping else self._updated
        self._updated = set()
        if stepping:
            self._restart_window()
            self._kept_unstepped = False

    def _restart_window(self) -> None:
        """A step() or zero_grad() ends the window, its gradients applied or
        discarded: eager's next step() applies only what comes after, so the
        micro-batches are counted from here (a micro-batch whose forward ran
        already belongs to the next window)."""
        self._micro_batches = 0 if self._backward_since_forward else 1
        self._moved_in_step = set()
        self._late = None

    def _apply_unapplied(self, settings: dict | None) -> None:
        """Updates, with `settings` (None: the groups' own), what eager step()
        would from the gradients no update of this fusion applied yet: every
        fused param with an unapplied .grad (from earlier micro-batches of
        the window, set by hand, from before fuse()), and after
        zero_grad(set_to_none=False) every param that had a gradient since
        the last zero_grad(set_to_none=True), from the zeros eager would
        hold. Not those this window's step moved already: eager's step()
        moves each once."""
        moved = self._moved_by_window_step()
        self._forget_kept_replaced()
        left = [p for i, p in self._params.items()
                if i not in moved and i not in self._kept and p.grad is not None]
        if self._zeroed_not_freed:
            # (nor from zeros those moved since the last step() or zero_grad() by
            # a window the loop did not step, two backward passes per step()
            # reaching different layers: eager's one step() moves each once;
            # moved again, they were 0.12 off eager's. Looked up last: the
            # steady state's params are all in `moved`)
            zeroed = [p for i, p in self._updated_since_freed.items()
                      if i not in moved and p.grad is None and i in self._params
                      and i not in self._moved_in_step]
            for p in zeroed:
                p.grad = _zero_grad_for(p)
            left += zeroed
        if left:
            self._update(left, settings)

    def _moved_by_window_step(self) -> set:
        """Ids of the params the window's step moved already (updated since
        its last step(), or before a forward or flush() that finished it),
        which its step(), eager's too, must not move again."""
        return self._updated | self._moved_before_step

    def _after_ddp_backward(self) -> None:
        # DDP's own end-of-backward callback, queued after our first one, waits
        # for every bucket (so for our updates) and writes the all-reduced
        # gradients into .grad: release them in a callback queued after it.
        torch.autograd.Variable._execution_engine.queue_callback(self._release_ddp_grads)

    def _release_ddp_grads(self) -> None:
        # DDP's end of backward wrote the all-reduced gradient into .grad of the
        # parameters a rank used, and left .grad None where none did, as eager
        # step() then sees it (find_unused_parameters=True).
        with self._lock: self._release_ddp_grads_locked()  # noqa: E701 (see _lock)

    def _release_ddp_grads_locked(self) -> None:
        used_elsewhere = [p for p in self._ddp_unused_here if p.grad is not None]
        self._ddp_unused_here = []
        if used_elsewhere and not self._removed:  # (removed: eager's step() applies them)
            self.optimizer.step_params(used_elsewhere)
            self._record_updated(used_elsewhere)
            self._ddp_updated.extend(used_elsewhere)
        self._release_grads(self._ddp_updated)
        self._ddp_updated = []

    def _update(self, params: Iterable[torch.Tensor], settings: dict | None = None) -> None:
        params = self._with_grad(params)
        if not params:
            return
        # outside backward (what step() finishes) nothing is left to overlap with,
        # and no end-of-backward callback could join a side stream
        if params[0].is_cuda and not _tensors.outside_backward():
            self._update_on_side_stream(params, settings)
        else:
            self._step_params(params, settings)
        # Only now: an update that raised (a setting the optimizer refuses) leaves
        # its gradients unapplied in .grad, as a refused eager step() does.
        for p in params:
            self._ready.pop(id(p), None)
        self._record_updated(params)
        self._release_grads(params)

    def _with_grad(self, params: Iterable[torch.Tensor]) -> list:
        """Those of `params` with a gradient; the others are dropped from
        _ready, done with: a post-accumulate-grad hook of the user's set their
        .grad to None after it accumulated, and eager's step() skips such a
        parameter. So it is not updated, nor released (its .grad is not kept,
        nor recorded on a side stream), nor noted as updated: a later
        gradient is not a second one, and after zero_grad(set_to_none=False)
        eager's step() has no zeros to move it with."""
        with_grad = []
        for p in params:
            if p.grad is not None:
                with_grad.append(p)
            else:
                self._ready.pop(id(p), None)
        return with_grad

    def _record_updated(self, params: Iterable[torch.Tensor]) -> None:
        """Notes `params` as updated in this window (a second gradient for one
        is refused, step() does not move it again), in this step (see
        _note_if_late) and as having had a gradient (after
        zero_grad(set_to_none=False), eager's step() moves it from zeros in
        every later step that gives it none, until a
        zero_grad(set_to_none=True)). Every path that updates notes here:
        _update, and under DDP the bucket hook and the end of backward."""
        for p in params:
            self._updated.add(id(p))
            self._moved_in_step.add(id(p))
            self._updated_since_freed[id(p)] = p

    def _update_on_side_stream(self, params: list, settings: dict | None) -> None:
        """CUDA: the update runs on a side stream, ordered after the gradients
        by the stream wait, so it overlaps the rest of backward; the end of
        backward makes the main stream wait for it again. The stream has
        priority 0, CUDA's lowest and the default stream's own: the updates
        share the GPU with backward's kernels rather than yield to them."""
        device = params[0].device
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = torch.cuda.Stream(device, priority=0)
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._step_params(params, settings)
        for p in params:
            p.grad.record_stream(side)  # freed grads are not reused before the update ran
        if self._join_ref() is None:
            self._join_ref = _tensors.queue_end_of_backward(self._join_side_streams)

    def _step_params(self, params: list, settings: dict | None) -> None:
        """optimizer.step_params(params, settings), less what costs as much
        as a small layer's update there: the checks of its arguments, which
        fusion's own lists pass (distinct fused params, settings from
        _settings_snapshot holding every hyper-parameter), and its two
        no_grad wrappers (inside backward grad mode is off already)."""
        engine = self.optimizer
        for group, ps in optim._by_group(params, engine._group_map()):
            _tensors.without_grad(engine._update, group, ps,
                                  settings.get(id(group)) if settings else None)

    def _join_side_streams(self) -> None:
        for device, side in self._side_streams.items():
            torch.cuda.current_stream(device).wait_stream(side)

    def _release_grads(self, params: list) -> None:
        if self._keep_grads:
            if self._kept_zeroed is not None:
                # gradients kept before a zero_grad() that these come after (a
                # step() applying ones no backward did: of a group added, set by
                # hand): that call's clearing, deferred, is done to them now,
                # not forgotten; taken for the new ones', a later
                # zero_grad(set_to_none=False) made them zeros, which the next
                # step() moved their params from (0.025 off eager's)
                self._discard_kept(self._kept_zeroed)
            self._kept.update((id(p), (p, _grad_mark(g), weakref.ref(g)))
                              for p, g in zip(params, map(_GRAD, params)))
            self._kept_zeroed = None
            self._kept_unstepped = True
        else:
            for p in params:
                p.grad = None

    # GradScaler's step() then tells this fusion it is there (see _refuse_grad_scaler).
    _step_sees_grad_scaler = True

    def _refuse_grad_scaler(self) -> None:
        """backward() applied the updates from the scaled gradients before
        GradScaler could unscale them or skip a step with infs. Its unscale_()
        leaves no trace on the gradients (torch's kernel bumps no version), so
        this fusion asks GradScaler.step() for its found_inf (see
        _step_sees_grad_scaler)."""
        opt = self._user_optimizer
        if "found_inf" in opt.__dict__:
            # what GradScaler.step() set for this step() goes, as it would have
            # deleted it after a step() that returned: a later step() is no
            # scaler's
            opt.__dict__.pop("grad_scale", None)
            del opt.found_inf
            raise RuntimeError(
                "reprop.fuse(mode='backward'): optimizer.step() called by torch.amp.GradScaler, "
                "but backward() applied the updates from the scaled gradients already, before "
                "the scaler could unscale them or skip a step with infs; use mode='forward', "
                "whose step() sees the gradients the scaler unscaled")

    def _refuse_kept_grads_edited(self) -> None:
        """Refuses kept gradients changed in place since their update (a
        GradScaler's unscale_(), clip_grad_norm_()): eager's step() would
        apply them as changed, but they were applied already, as backward
        gave them (scaled, unclipped), and the change would be silently
        lost. Checked at step() and at the next micro-batch (a loop that
        calls no step() in backward mode, maybe zeroing first: a zero_grad()
        before the refusal does not excuse it). Refused at every check until
        a zero_grad() after the refusal discards them, as eager's does."""
        for p, mark, kept in self._kept.values():
            # (the kept tensor edited, its .data replaced too; one set by hand is eager's)
            if p.grad is not None and _grad_mark(p.grad) != mark and p.grad is kept():
                self._kept_edit_refused = True
                raise RuntimeError(
                    f"reprop.fuse(mode='backward', keep_grads=True): the gradient of "
                    f"{_param_name(self.model, p)} was changed in place after backward() had "
                    "applied it (clip_grad_norm_ or clip_grad_value_ after backward()?): the "
                    "update used it as backward gave it. Use mode='forward', whose step() sees "
                    "every gradient as the loop left it (or fuse(clip_grad_norm=...) there), or "
                    "leave the gradients as they are; optimizer.zero_grad() now discards them")

    def _ddp_bucket_hook(self, state, bucket):
        """DDP communication hook: DDP's own all-reduce (mean) or the user's
        comm_hook with its `state`, then the update of the bucket's parameters
        from the reduced gradients. DDP offers no way to unregister a hook, so
        after remove() it is the user's hook, or the plain all-reduce."""
        reduced = self._comm_hook(state, bucket)
        if _tensors.outside_backward():
            # DDP's join hook (Join([ddp]) with uneven inputs) running it on a joined
            # rank to match another rank's all-reduce, of zeros: no backward, no update
            return reduced
        with self._lock: pairs = self._bucket_pairs(bucket)  # noqa: E701 (see _lock)
        if pairs is None:
            return reduced

        # weakly: the callback may be released later, by gloo's or NCCL's thread
        # (a strong one kept the dropped model alive until then)
        handle = weakref.ref(self)

        buffer = bucket.buffer()

        def update(fut):
            # on the process group's threads, maybe several buckets at once:
            # under the lock, as every update of the optimizer's plans
            fusion = handle()
            if pairs and fusion is not None:
                _into_bucket(fut.value(), buffer)
                with fusion._lock: fusion._update_bucket(pairs)  # noqa: E701 (see _lock)
            return fut.value()

        return reduced.then(update)

    def _bucket_pairs(self, bucket) -> list | None:
        """(param, all-reduced gradient) of the bucket's fused params this
        rank gave a gradient, noted as updated (under the lock); None when
        this backward updates nothing (removed, or accumulating)."""
        self._backward_since_forward = True
        self._moved_before_step.clear()  # (as _mark_backward: a rank may have no gradient)
        if self._removed or not self._updating():
            return None
        self._follow_groups()
        pairs, unused_here = _split_by_local_use(
            (p, g) for p, g in zip(bucket.parameters(), bucket.gradients())
            if id(p) in self._params)
        self._ddp_unused_here.extend(unused_here)
        self._record_updated(p for p, _ in pairs)
        if self._end_ref() is None:
            self._end_ref = _tensors.queue_end_of_backward(self._after_ddp_backward)
        return pairs

    def _update_bucket(self, pairs: list) -> None:
        """The update of a bucket's params from its reduced gradients (under the lock)."""
        self.optimizer.step_params([p for p, _ in pairs], grads=[g for _, g in pairs])
        self._ddp_updated.extend(p for p, _ in pairs)

    def _fused_step(self) -> None:
        # (called by _step, _hooked_step and the step() fusion installs).
        # No warning that it applies only what no backward did: step() is
        # README's loop, and a note there made suites run with warnings as
        # errors fail on correct code.
        self._swap_check_due = True  # (layers called one by one: see _on_training_forward)
        self._refuse_grad_scaler()
        self._refuse_kept_grads_edited()
        self._sync()  # parameters added since the last forward: their gradients too
        self._refuse_late_gradients()
        self._finish_step(stepping=True)

    def _refuse_late_gradients(self) -> None:
        """Refuses a step() after a micro-batch (accumulating, or updating
        again) gave a gradient to a parameter backward moved since the last
        step() or zero_grad(): eager's step() makes one update from the
        gradients since zero_grad(), where backward made one already. The
        loop steps later than the fusion counted: micro-batches left over
        and neither stepped nor zeroed (an epoch's shorter last window, with
        the loop counting again from each epoch's start) made the next
        window's update come early, which no count could foresee, since it
        depends on when the loop will step; or the loop's windows are longer
        than accumulation_steps; or another loss's backward reached the
        parameters after step() (a GAN's generator loss through the
        discriminator) and a module's zero_grad(), which this fusion does
        not see, cleared them."""
        if self._late is not None:
            raise RuntimeError(
                f"reprop.fuse(mode='backward', accumulation_steps={self._every}): "
                "optimizer.step() after a micro-batch gave a gradient to "
                f"{_param_name(self.model, self._late)}, which backward() updated since the last "
                "step() or zero_grad(): "
                "eager's step() makes a single update where backward() made one already. The "
                f"loop steps later than every {self._every} micro-batches: call step() or "
                "zero_grad() after an epoch's shorter last window too (micro-batches left over "
                "make the next window's update come early), or give fuse() the loop's "
                "accumulation_steps, counted in forward-backward pairs (two a micro-batch: "
                "2n). Or another loss's backward reached it after step() (a GAN's generator "
                "loss through the discriminator), which backward() applied too, and a "
                "module's zero_grad() cleared it unseen: keep that backward off these "
                "parameters (requires_grad_(False) during it, or detach). "
                "optimizer.zero_grad() discards the late gradients")

    def _fused_zero_grad(self, set_to_none: bool) -> None:
        self._swap_check_due = True  # (layers called one by one: see _on_training_forward)
        self._zeroed_not_freed = not set_to_none
        if set_to_none:  # eager holds no .grad now: no later zero_grad() leaves zeros
            self._updated_since_freed.clear()
        if self._kept_edit_refused:  # (the user was told: eager's zero_grad() discards them)
            self._discard_kept(set_to_none)
        elif self._kept:  # applied already: freed by the next micro-batch or remove()
            # (a set_to_none=True since stays: eager's .grad is None from then on,
            # which a later zero_grad(set_to_none=False) leaves None, not zeros)
            self._kept_zeroed = set_to_none or self._kept_zeroed is True
        self._drop_failed_pass()
        # What eager zero_grad() discards: gradients not applied yet (of earlier
        # micro-batches of a window, of a backward that raised, set by hand), of
        # the groups as they are now; no update waits for them any more.
        self._sync()
        self._forget_kept_replaced()
        for p in self._params.values():
            if p.grad is not None and id(p) not in self._kept:
                _zero_grad_of(p, set_to_none)
                self._ready.pop(id(p), None)
        self._restart_window()


class _ForwardFusion(FusionHandle):
    """Algorithm 2: step() marks updates pending; each is applied right before
    its parameter's module next runs forward."""

    mode = "forward"

    def __init__(self, model, optimizer, engine, clip_grad_norm: float | None):
        super().__init__(model, optimizer, engine)
        self._clip = clip_grad_norm
        # whether the first step() was found not to be a ZeroRedundancyOptimizer's
        # local step (_refuse_zero_redundancy_caller)
        self._caller_checked = False
        # set by remove(), whose refused updates are dropped (see _keeps_refused's note)
        self._removing = False
        self._pending: dict = {}  # id(param) -> param whose update is decided but not applied
        # id(param) -> (the gradient its pending update applies: its .grad at
        # step(), held, not copied; then that tensor's _grad_mark, in two parts,
        # and the param's _tensors.swap_mark, which a swap by hand changes)
        self._grads: dict = {}
        self._settings: dict = {}  # id(group) -> hyper-parameters when step() was called
        # whether the last step() ran inside torch.inference_mode(): its updates
        # run in that mode, wherever they are applied (see _apply)
        self._step_inference = False
        # id(group) -> (state slots, capturable, ids of the params with a gradient)
        # of the last step() whose update of the group passed the optimizer's full check
        self._checked: dict = {}
        # (optimizer.state, a shallow copy of it) at step(), until the first update checks it
        self._step_state: tuple | None = None
        # (id, len) of optimizer.state after the last step(), when every update it
        # decided had state (_checked holds only checks made against that state);
        # and whether this step() ran a group's full check (its params with a
        # gradient or state slots changed, or the state): see _may_lack_state
        self._state_seen: tuple = (None, 0)
        self._rechecked = False
        # id(module) -> the stamp of the root forward it last ran in or after
        # (the keys: the modules seen running forward); a new stamp per root forward
        self._ran: dict = {}
        self._stamp = object()
        # (id(module), its own parameters) for each owner: by id, so that a layer
        # dropped from the model (a head replaced, its parameters left in the
        # optimizer) is not kept alive until the owners are next followed. No
        # other module takes a dropped owner's id in _ran meanwhile: only
        # modules hooked here write there, and hooking one follows the owners.
        self._owners: list = []
        self._own_of: dict = {}  # the same, as id(module) -> its own parameters
        # id(param) -> the (weakref(module), name) places of each in the owners,
        # as of the last look (see _refuse_parametrized_while_pending)
        self._places: dict = {}
        # (id(module), its own parameters) for the owners not seen running
        # forward since the owners were last followed: empty once all have run
        self._unseen: list = []
        # What a gradient may not reach (_on_grad_coming): the pending updates;
        # from the end of a forward that applied some late until the next
        # forward or step(), those late ones (see _on_root_forward_end)
        self._guarded: dict = self._pending
        self._late_roots: list = []  # that forward's graph: its outputs' grad_fns
        self._read_stale: set | None = None  # ids of the late ones that graph reaches
        # modules given the checkpoint hooks: those holding fused parameters (see _track)
        self._covered: "weakref.WeakSet" = weakref.WeakSet()
        # Set when a fused parameter is registered in a module without this
        # fusion's forward hooks (torch.nn.utils.parametrize moves the Parameter
        # into a ParametrizationList and back; a weight tied after fuse()): the
        # owners change, which the global registration hook tells at no cost
        # per forward. Weakly held: it is global. A handle dropped without
        # remove() has it removed when freed.
        self._owners_moved = False
        self._own_join_hook = _MISSING
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        if self._ddp:
            self._own_join_hook = model.__dict__.get("join_hook", _MISSING)

    def _install(self) -> None:
        _register_param_registration_hook(_tensors.weak_hook(self._on_param_registered),
                                          self._hooks)
        weakref.finalize(self, self._hooks[-1].remove)
        self._track(list(self._params.values()))
        # prepended: pre-hooks registered before fuse() that compute a weight from
        # the parameters (nn.utils.prune, the old weight_norm/spectral_norm)
        # must see them updated
        model = self.model
        self._hooks.append(model.register_forward_pre_hook(self._on_root_forward, prepend=True))
        self._hooks.append(model.register_forward_hook(self._on_root_forward_end))
        # prepended: the optimizer's state-dict pre-hooks registered before fuse()
        # must see the state updated, as after an eager step() (one registered
        # after fuse() with prepend=True runs before it: README says so)
        self._hooks.append(self._user_optimizer.register_state_dict_pre_hook(
            self._on_state_dict, prepend=True))
        if self._ddp:
            model.join_hook = self._ddp_join_hook

    def _ddp_join_hook(self, **kwargs):
        """DDP's join hook (what Join([ddp]) asks the model for), applying the
        pending updates first: its post-hook broadcasts the last joiner's
        parameters to every rank, which must be the updated ones (eager step()
        applied them), and on the others nothing may be left pending to be
        applied on top of them."""
        hook = type(self.model).join_hook(self.model, **kwargs)
        main_hook, post_hook = hook.main_hook, hook.post_hook

        def flushed_main_hook():
            self.flush()
            main_hook()

        def flushed_post_hook(is_last_joiner: bool):
            self.flush()
            post_hook(is_last_joiner)

        hook.main_hook, hook.post_hook = flushed_main_hook, flushed_post_hook
        return hook

    def _track(self, new: list) -> None:
        self._hook_owners()
        self._hook_params(new)
        # Each param's group as of this sync, which every step() makes: the group
        # its pending update was decided in (_before_regroup keeps it so).
        self._group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}

    def _hook_param(self, p: torch.Tensor) -> None:
        # Safety net: a gradient arriving for a still-pending parameter means its
        # stale value was used in forward (read outside its module's forward).
        # Refused before it reaches .grad: the gradient the pending update holds
        # may still be .grad, and flush() then the forward again trains as eager.
        # Needed once an update may be pending: a lazy parameter's is hooked at
        # the first step() after its materialization (_fused_step).
        self._hooks.append(_register_grad_coming(p, self._on_grad_coming))
        self._swap_watch.add(p)

    def _hook_owners(self) -> None:
        """Follows which modules own the fused parameters: a pending update is
        applied before its owner's forward, so each owner needs the hooks."""
        owners = [(m, own) for m in self.model.modules()
                  if (own := _direct_params(m, self._params))]
        self._owners = self._unseen = [(id(m), own) for m, own in owners]
        self._own_of = dict(self._owners)
        owned = {id(p) for _, own in owners for p in own}
        self._places = _places_of(owners, self._params)
        for module in self._owners_to_hook():
            self._hooks.append(module.register_forward_pre_hook(self._on_module_forward,
                                                                prepend=True))
            # not run since its hooks: an id seen running is a freed module's
            # that this one's memory reuses
            self._ran.pop(id(module), None)
        # state_dict() of any module holding fused parameters (the root, ddp.module,
        # a backbone), its load_state_dict(), its .to()/.half()/.cuda()
        # (Module._apply), its zero_grad() and a copy of it: pending updates
        # first, as eager applied them at step(), so that they are saved or
        # copied, not loaded or converted values updated after, and made from
        # the gradients. Each hook of a nested call finds nothing pending: a
        # check per module.
        for module in self._covering_to_hook():
            # (each appended in the statement registering it: an interrupt
            # between the two would leave a hook that remove() misses)
            self._hooks.append(module.register_state_dict_pre_hook(self._on_state_dict))
            _first(module._state_dict_pre_hooks, self._hooks[-1])
            self._hooks.append(module._register_load_state_dict_pre_hook(self._before_load))
            _first(module._load_state_dict_pre_hooks, self._hooks[-1])
        for module in list(self._covered):  # (all: a class parametrized since has a __deepcopy__)
            _flush_before_module_calls(module, self)
        # Parameters of the optimizer that no module of the model owns (a learned
        # prompt or temperature used before or outside the model): no forward
        # announces their next use, so step() applies them at once, as eager.
        self._foreign = {i for i in self._params if i not in owned}
        # last: owners followed only in part (a KeyboardInterrupt) are followed again
        self._owners_moved = False

    def _on_param_registered(self, module: nn.Module, name: str, param) -> None:
        if param is None:
            return
        if id(param) in self._params and not self._hooks_on(module):
            self._owners_moved = True
            if id(param) in self._pending and not _through_right_inverse(module):
                self._apply_moved(param)
        elif isinstance(module, parametrize.ParametrizationList):
            # the new tensors a parametrization's right_inverse made (weight_norm's)
            # replace a fused parameter, which leaves its module unseen (see
            # _refuse_parametrized_while_pending), and its module's class
            # changed (see _flush_before_module_calls)
            self._owners_moved = True

    def _apply_moved(self, p: torch.Tensor) -> None:
        """Applies the pending update of `p`, registered in a module without
        this fusion's hooks (a weight tied, a parametrization without a
        right_inverse, which takes the parameter as it is): eager step() had
        applied it, and until the owners are followed nothing applies it
        before a read through its new module (remove_parametrizations reads
        the weight through its parametrizations)."""
        with self._lock: self._apply_moved_locked(p)  # noqa: E701 (see _lock)

    def _apply_moved_locked(self, p: torch.Tensor) -> None:
        if id(p) in self._pending and not self._removed:
            self._apply([p])

    def _follow_owners(self) -> None:
        """Hooks the new owners of fused parameters registered in other modules
        since the last look (under the lock). Without their hooks a pending
        update waited for a module that no longer owns the parameter, and the
        forward used it one update behind, in every step from then on. What
        a parametrization read one update behind is refused first (and the
        owners followed at the next call)."""
        if self._owners_moved:
            self._refuse_parametrized_while_pending()
            self._hook_owners()

    def _refuse_parametrized_while_pending(self) -> None:
        """Raises if a parametrization with a right_inverse (weight_norm,
        spectral_norm, orthogonal) took the place of a parameter whose update
        is pending, since the owners were last followed (a parametrization
        registers parameters, which marks them moved): register_parametrization
        read the value through right_inverse (and spectral_norm's setup read
        it too) one update behind eager, whose step() had applied it, and a
        tensor it made may share the parameter's memory (weight_norm's), which
        the update would then change under a forward that saved it. Those
        updates are dropped first (each would be refused again), the others
        stay pending. Without a right_inverse the parameter itself moves,
        unread: its update is applied before its new module's forward."""
        hit = {id(p): (p, place) for i, p in self._pending.items()
               for place in self._live_places(i) if _parametrized_with_inverse(place)}
        if not hit:
            return
        self._settle([p for p, _ in hit.values()])
        self._forget_step_if_over()
        names = ", ".join(repr(_place_name(self.model, place)) for _, place in hit.values())
        raise RuntimeError(
            f"reprop.fuse(mode='forward'): a parametrization with a right_inverse (weight_norm, "
            f"spectral_norm, orthogonal, ...) was registered on {names} while its update was "
            "pending since optimizer.step(): it read the value before that update, which eager "
            "step() had applied; that update is dropped. Call handle.flush() before registering "
            "a parametrization between optimizer.step() and the next forward")

    def _live_places(self, i: int) -> list:
        """The (module, name) places of the parameter of id `i` in the owners
        as of the last look (_places), but in modules freed since."""
        return [(m, name) for ref, name in self._places.get(i, ()) if (m := ref()) is not None]

    def _sync(self) -> list:
        new = super()._sync()
        self._follow_owners()
        return new

    def _covering_to_hook(self) -> Iterator[nn.Module]:
        """Modules of the model with a fused parameter at or below them (the
        owners and all their ancestors) that have no checkpoint hooks of this
        fusion yet, each counted as hooked once the caller's loop has hooked
        it (as _owners_to_hook)."""
        fresh = [m for m in self.model.modules() if m not in self._covered
                 and any(id(p) in self._params for p in m.parameters())]
        for m in fresh:
            yield m
            self._covered.add(m)

    def _take_over_optimizer(self) -> None:
        super()._take_over_optimizer()
        # torch.save(optimizer) and copy.deepcopy(optimizer) keep what torch's
        # Optimizer.__getstate__ returns, not the pending gradients; pickle looks
        # __getstate__ up on the instance, so this one optimizer's applies the
        # pending updates first, as its state_dict() does (a copy gets torch's).
        self._user_optimizer.__getstate__ = getstate = self._optimizer_getstate
        self._installed["__getstate__"] = getstate

    def _optimizer_getstate(self) -> dict:
        opt = self._user_optimizer
        if self._removed:  # (captured, or left under a wrapper by remove())
            return self._after_removal(opt, "__getstate__")()
        self.flush()
        return type(opt).__getstate__(opt)

    def _undo(self) -> None:
        self._removing = True  # (never unset: the fusion is removed even if this raises)
        super()._undo()

    def _unhook(self) -> None:
        super()._unhook()
        for module in list(self._covered):
            _stop_flushing_before_module_calls(module, self)
        if self._own_join_hook is not _MISSING:
            self.model.join_hook = self._own_join_hook
        elif isinstance(self.model, nn.parallel.DistributedDataParallel):
            self.model.__dict__.pop("join_hook", None)

    def _let_go(self) -> None:
        super()._let_go()
        # (what a refused update left pending, and the graph of a late forward, hold parameters)
        self._pending.clear()
        self._grads.clear()
        self._forget_late()
        self._owners, self._unseen, self._own_of = [], [], {}
        self._group_of, self._step_state = {}, None

    def flush(self) -> None:
        if self._removed:  # also what a copy's hooks call (see __reduce__)
            return
        with self._lock: self._flush_locked()  # noqa: E701 (see _lock)

    def _flush_locked(self) -> None:
        if self._pending:
            try:
                if self._owners_moved:  # (a parametrization since step() is refused, not applied)
                    self._refuse_parametrized_while_pending()
            finally:
                # the others apply before the refusal is raised: remove() lets go of
                # what is still pending once flush() returns, so they were lost there
                if self._pending:
                    self._apply(list(self._pending.values()))

    def _before_regroup(self) -> None:
        # Eager step() applied its updates before the groups changed (a group
        # popped, a param moved): apply the pending ones in their groups of then.
        self.flush()

    def _apply(self, params: list, in_step: bool = False) -> None:
        """Applies these pending updates (under the lock), from the gradients
        step() held for them; `in_step`: by the step() that decided them
        (_decided), which drops what the optimizer refuses (_keeps_refused)."""
        engine = self.optimizer
        of_step = self._state_if_edited_since_step()
        if of_step is not None:  # eager step() applied every update before the edit
            params = list(self._pending.values())
        refusal = None
        try:
            grads, edited, swapped = self._held_grads(params)
            users = engine.state
            try:
                # (inside the try: an interrupt right after the swap must undo it)
                if of_step is not None:
                    engine.state = of_step
                if edited or swapped:
                    # Refused updates are dropped first, and the others applied before
                    # the refusal is raised: raised at once, it left them pending, and
                    # remove() (which lets go of what is pending) lost them
                    params, refusal = self._drop_refused(params, grads, edited, swapped)
                if torch.is_inference_mode_enabled() != self._step_inference:
                    # The updates run in the mode of the step() that decided them, as
                    # eager's: applied by a forward under the user's inference_mode,
                    # the state they create is normal tensors, as eager step()'s,
                    # which the next eager update can change in place; decided by a
                    # step() inside inference_mode, they write inference params and
                    # make inference state, as eager's, where outside it the
                    # optimizer refused them (torch's rule for in-place updates)
                    with torch.inference_mode(self._step_inference):
                        self._apply_by_group(params, grads, in_step)
                else:
                    self._apply_by_group(params, grads, in_step)
            except BaseException as e:
                if refusal is not None:  # (the others' own error wins; the refusal is told too)
                    e.add_note(str(refusal))
                raise
            finally:
                if of_step is not None:
                    engine.state = users
                    self._keep_state_created(of_step)
        finally:
            self._forget_step_if_over()
        if refusal is not None:
            raise refusal

    def _forget_step_if_over(self) -> None:
        if not self._pending:  # (every update of the last step() applied or dropped)
            self._settings = {}
            self._step_state = None

    def _apply_by_group(self, params: list, grads: dict, in_step: bool = False) -> None:
        """The updates of `params`, group by group (each group's in one call,
        which the optimizer refuses or runs whole). Each group's leave
        _pending once applied, so a module pre-hook finding nothing of its
        own there knows its parameters are current, without taking the lock.
        One the optimizer refuses stays pending or is dropped as
        _keeps_refused says. The groups applied before a refused one are not
        pending any more: each is updated once.

        A KeyboardInterrupt (a notebook's stop button) at any line leaves
        pending exactly the updates not applied, which the next forward (or
        step()) applies once: those the kernels ran are noted by their call
        (`ran`, see optim._Plan.run), and the settling is done after the
        update and, where a stop lands, again (idempotent) in the finally.
        Settled in the finally only, whatever the update did, a stop before
        the kernels lost the update (SGD with momentum: 0.2 off after three
        more steps), and one partway through settling left updates pending
        that had run, which the next forward applied again."""
        # (each in the group its update was decided in)
        for group, group_params in optim._by_group(params, self._group_of):
            ran, whole = {}, False  # whole: every update of the group applied or dropped
            update = (_tensors.without_grad, self.optimizer._update, group, group_params,
                      self._settings.get(id(group)), grads, None, ran)
            try:
                _outside_torch_func(*update); whole = True  # noqa: E702 (see optim._Plan.run)
                self._settle(group_params); ran = None  # noqa: E702
            except Exception as e:
                # refused: those the kernels ran (a call of another device
                # refused after them) are settled, the others kept or dropped
                whole = not self._keeps_refused(e, group, group_params, grads, in_step, ran)
                raise
            finally:
                if ran is not None:  # (stopped, or refused)
                    self._settle(group_params if whole else
                                 [p for ps in ran.values() for p in ps])

    def _keeps_refused(self, error: Exception, group: dict, params: list, grads: dict,
                       in_step: bool, ran: dict) -> bool:
        """Whether the updates of `params` (one group's) that the optimizer
        refused with `error` stay pending, as eager training has them: the
        cause came after step() (the parameter's .data or its optimizer state
        changed, a forward under a CUDA graph capture: eager's step() had
        applied the update before), so the user undoes it and the next
        forward (or flush()) applies them once; dropped, they were lost (0.011
        off eager's). Dropped where a held gradient is itself refused (a
        tensor subclass with __torch_dispatch__, which step() cannot tell
        without a look at each gradient): it would be refused by every
        forward for good, and eager's step() refused it (its whole group,
        where here the group's other modules may have applied theirs); and
        where step() itself applies them (_decided): the error is step()'s,
        which stops at the refused group as eager's does, so every update
        this step() decided for that group and the groups after it is
        dropped (_drop_step_from), and a step() again after the fix holds
        the gradients again, applying each once as eager's retry does (the
        others of the group stayed pending, and a retry applied them twice).
        The error tells which, in a note. `ran`: the params the kernels ran
        for in that call (optim._Plan.run), by plan."""
        if in_step:
            self._drop_step_from(group)
            error.add_note("reprop.fuse(mode='forward'): this step()'s updates of that group and "
                           "of the groups after it are dropped, as eager's step() stops there; "
                           "step() again after the fix applies them")
            return False
        unfit = [p for p in params if (g := grads.get(id(p))) is not None
                 and self._held_grad_refused(p, g, params)]
        n = len(params)
        it = "it" if n == 1 else "them"
        if unfit:
            # eager's step() refused the group, writing none of them: the
            # in-place mark step() gave those not written here goes too
            written = {id(p) for ps in ran.values() for p in ps}
            _as_if_not_updated([p for p in params if id(p) not in written])
            dropped = ("its pending update is" if n == 1
                       else f"the {n} pending updates of that call are")
            error.add_note(
                f"reprop.fuse(mode='forward'): the gradient optimizer.step() held for "
                f"{_params_named(self.model, unfit)} is refused itself, so {dropped} dropped, "
                f"as eager's step() refused {it} (eager's refused the whole group; here the "
                "group's others apply as usual); set a gradient of a plain tensor with memory of "
                "its own before step()")
            return False
        # The note names the updates refused, not the first ones of the call (a
        # flush() applies a whole group in one call: it named the group's first
        # three parameters, whatever was refused)
        alone = self._refused_alone(group, params, grads)
        refused = alone or params
        one, others = len(refused) == 1, n - len(refused)
        names = _params_named(self.model, refused)
        if self._removing:
            # (remove() lets go of what is pending: a note saying it stays
            # pending, to apply at the next forward, told the user wrong)
            error.add_note(
                f"reprop.fuse(mode='forward'): the pending update{'' if one else 's'} of {names} "
                f"{'is' if one else 'are'} refused, and remove() dropped "
                f"{'it' if one else 'them'} with every other update that optimizer.step() "
                "decided and left pending (eager's step() applied them before what changed "
                "since): that step is lost for them; undo the change and call handle.flush() "
                "before remove() to apply them")
            return True
        gone = self._drop_outside_model(alone, error, n)
        if gone:
            refused = [p for p in refused if id(p) not in gone]
            if not refused:
                return True
            one, others = len(refused) == 1, n - len(refused) - len(gone)
            names = _params_named(self.model, refused)
        also = ("" if not others else ", as does the other update of its group in that call"
                if others == 1 else f", as do the {others} other updates of its group in that call")
        # (a .data replaced before step(), which step() does not look for: eager's
        # refused it there, and its retry after the fix applies it once, as here)
        error.add_note(
            f"reprop.fuse(mode='forward'): the update{'' if one else 's'} of {names} that "
            f"optimizer.step() left pending {'is' if one else 'are'} refused and "
            f"{'stays' if one else 'stay'} pending{also}: undo the change and run the forward "
            f"again, or call handle.flush(), to apply {'it' if n == 1 else 'each'} once, as "
            f"eager's step() applied {it} (before a change made after it; one made before it "
            f"eager's step() refused, and its retry after the fix applied {it} once); "
            f"handle.remove() drops {it}")
        return True

    def _drop_outside_model(self, refused: list, error: Exception, n: int) -> dict:
        """Drops the refused updates (`refused`, of a call of `n`) of params
        no module of the model holds any more (their module removed or
        replaced since step(), the optimizer still holding them), noting it
        on `error`; returns them by id. Kept pending, such an update was
        refused by every later forward for good, training stuck until the
        user repaired the state or .data of a parameter no longer used,
        where eager's step() had applied it before the change and trains on
        (no later eager step() touches it: it gets no gradient). Dropped,
        its values stay one update behind eager's. A walk of the model's
        parameters, on a refusal only."""
        if not refused:
            return {}
        held = set(map(id, self.model.parameters()))
        gone = {id(p): p for p in refused if id(p) not in held}
        if not gone:
            return gone
        self._settle(list(gone.values()))
        one, rest = len(gone) == 1, n - len(gone)
        it = "it" if one else "them"
        error.add_note(
            f"reprop.fuse(mode='forward'): {_params_named(self.model, list(gone.values()))} "
            f"{'is' if one else 'are'} in no module of the model any more (removed or replaced "
            f"since optimizer.step()): no forward would apply the update refused, which is "
            f"dropped; {'its' if one else 'their'} values stay one update behind eager's "
            f"step(), which applied {it} before the change"
            + ("" if not rest else "; the other updates of that call stay pending, to apply "
               "at the next forward or handle.flush()"))
        return gone

    def _refused_alone(self, group: dict, params: list, grads: dict) -> list:
        """Those of `params` (one group's, whose update the optimizer refused
        in one call, from the gradients `grads`) whose update alone its check
        refuses (their .data or optimizer state replaced): what the refusal's
        note names. Empty where none is (the call refused as a
        whole: a CUDA graph capture). Called on a refusal only: a check per
        parameter."""
        engine = self.optimizer
        settings = self._settings.get(id(group)) or group  # (what the update ran with)
        refused = []
        try:
            slots = engine._state_slots(settings)
        except Exception:  # (the hyper-parameters themselves: every update)
            return refused
        for p in params:
            try:
                engine._check_step(settings, [p], grads, slots)
            except Exception:
                refused.append(p)
        return refused

    def _held_grad_refused(self, p: torch.Tensor, g: torch.Tensor, params: list) -> bool:
        """Whether the gradient `g` held for `p`, in a refused update of
        `params`, is itself what the optimizer refuses, which no change made
        since step() puts right (the user's .grad fixed since is not the one
        held): not a plain strided tensor, or sharing memory with the state
        of a param of the update or with another param of it, which the
        update writes while it reads g (p.grad = opt.state[p]["momentum_buffer"]
        before step(), whose check does not look at memory, as eager's
        update does). Kept pending, such an update was refused by every
        forward for good (every later step() too, until remove()). Its own
        param's memory is read through a copy, not refused. Called on a
        refusal only."""
        if g.layout is not torch.strided or optim._dispatches(g):
            return True
        state = self.optimizer.state  # (the state the refused update ran on: see _apply)
        written = [q for q in params if q is not p]
        written += [t for q in params for t in state.get(q, {}).values()
                    if isinstance(t, torch.Tensor) and t.layout is torch.strided
                    and not optim._dispatches(t)]
        # (addresses compare on one device only)
        return any(t.device == g.device and _tensors.shares_elements(g, t) for t in written)

    def _drop_step_from(self, group: dict) -> None:
        """Drops the pending updates of `group` and of the groups after it in
        param_groups (only `group` where it has left them)."""
        groups = self.optimizer.param_groups
        at = next((i for i, g in enumerate(groups) if g is group), len(groups))
        dropped = {id(group)} | {id(g) for g in groups[at:]}
        group_of = self._group_of
        self._settle([p for i, p in list(self._pending.items())
                      if id(group_of.get(i)) in dropped])

    def _held_grads(self, params: list) -> tuple[dict, list, list]:
        """(id(param) -> the gradient step() held for each pending update of
        `params`, those of `params` whose update is refused: edited, swapped).
        A held gradient changed in place since (p.grad.zero_() or mul_() after
        step(), where eager's step() had applied it already) can neither give
        eager's update nor be applied edited; nor can the update of a param
        swapped since (torch.utils.swap_tensors(p, new) by hand, which a
        conversion's flush does not precede): eager's step() updated the
        contents the swap moved into `new`, and p holds `new`'s values as
        they were, which applying it changed, silently. The caller drops
        those (_drop_refused). The checks are C-level passes over `params`
        (_held_marks), the steady state's only cost."""
        held = list(map(self._grads.__getitem__, ids := list(map(id, params))))
        grads = list(map(_HELD_GRAD, held))
        now = _held_marks(grads, params)
        if now == held:  # (the steady state: one comparison in C)
            return dict(zip(ids, grads)), [], []
        edited, swapped = [], []
        for p, (_, *grad_mark, swap), (_, *grad_mark_then, swap_then) in zip(params, now, held):
            if grad_mark != grad_mark_then:
                edited.append(p)
            elif swap != swap_then:
                swapped.append(p)
        return dict(zip(ids, grads)), edited, swapped

    def _drop_refused(self, params: list, grads: dict, edited: list,
                      swapped: list) -> tuple[list, RuntimeError]:
        """Drops the refused updates of `params` (_held_grads), advancing the
        optimizer state of the swapped ones as eager's step() advanced it
        (_step_state_of_swapped); returns the others, to apply as usual, and
        the error to raise once they are."""
        self._settle(edited + swapped)
        state_error = self._step_state_of_swapped(swapped, grads) if swapped else None
        refused = set(map(id, edited + swapped))
        return [p for p in params if id(p) not in refused], RuntimeError(". ".join(
            ([self._edited_message(edited)] if edited else [])
            + ([self._swapped_message(swapped, state_error)] if swapped else [])))

    def _step_state_of_swapped(self, swapped: list, grads: dict) -> Exception | None:
        """The optimizer state part of the dropped updates of params swapped
        by hand since step(): eager's step() advanced their state (step,
        exp_avg, ...) with the update, before the swap; left as it was, it
        stayed a step behind eager's for good (Adam: 0.0145 off after six
        steps). The update runs with each param's .data a copy of the values
        swapped in, which are eager's as they are and are put back after
        (not written, even for a moment). Exact but for a weight decay that is not
        decoupled, which reads the param: eager's read the values swapped
        out, no longer held here; this one reads those swapped in (see
        _swapped_message). Returns the error of an update refused (a tensor
        of another shape swapped in, which the state no longer fits): the
        state of its group is then as it was."""
        engine, error = self.optimizer, None
        with torch.inference_mode(False):
            for group, group_params in optim._by_group(swapped, self._group_of):
                values = []
                # The update bumps each param's version, as for a write: this
                # one writes only the copies, so a graph that saved a param
                # (the swapped-in values, eager's) raised autograd's in-place
                # error at backward, where eager's trains. Put back as well.
                versions = _tensors.versions_of(group_params)
                try:
                    for p in group_params:
                        values.append(p.data)
                        p.data = values[-1].clone()
                    _outside_torch_func(_tensors.without_grad, engine._update, group,
                                        group_params, self._settings.get(id(group)), grads)
                except Exception as e:  # (TypeError, ValueError, RuntimeError: a refusal)
                    error = e
                finally:
                    for p, value in zip(group_params, values):
                        p.data = value
                    _tensors.set_versions(group_params, versions)
        return error

    def _edited_message(self, edited: list) -> str:
        names = ", ".join(_param_name(self.model, p) for p in edited)
        return (f"reprop.fuse(mode='forward'): the gradient of {names} was changed in place "
                "after optimizer.step() (p.grad.zero_(), p.grad.data = ..., or the zero_grad() "
                "of a module that contains the fused model, which zeroes .grad in place), "
                "before its pending update was applied; that update is dropped (the other "
                "pending updates apply as usual). Set "
                "p.grad = None or call optimizer.zero_grad() or the fused model's zero_grad() "
                "instead, or call handle.flush() before editing .grad")

    def _swapped_message(self, swapped: list, state_error: Exception | None) -> str:
        names = ", ".join(_param_name(self.model, p) for p in swapped)
        if state_error is not None:
            state = (f"its optimizer state stays as it was before that step(), one step behind "
                     f"eager's (advancing it was refused: {state_error})")
        else:
            state = ("its optimizer state (step count, moments, ...) is advanced by that update "
                     "as eager's step() advanced it")
            # (the optimizer knows its options: SGD without momentum has no state)
            if any(self.optimizer._reads_param_into_state(self._settings.get(id(group)) or group)
                   for group, _ in optim._by_group(swapped, self._group_of)):
                state += (", but for the weight decay term, which eager's step() took from the "
                          "values swapped out and this from the values swapped in")
        return (f"reprop.fuse(mode='forward'): {names} was swapped (torch.utils.swap_tensors) "
                "after optimizer.step(), before its pending update was applied: eager's step() "
                "had updated the contents the swap moved out, and the update cannot apply to "
                "the ones swapped in; that update is dropped (the other pending updates apply "
                f"as usual): the parameter keeps the values swapped in, as eager's, and {state}. "
                "Call handle.flush() before "
                "swapping a fused parameter between optimizer.step() and the next forward "
                "(a module's .to() or load_state_dict() under "
                "torch.__future__.set_swap_module_params_on_conversion does so itself)")

    def _settle(self, params: list) -> None:
        """These updates are no longer pending (applied, or dropped).
        Idempotent (_apply_by_group settles again after a stop button)."""
        for p in params:
            self._pending.pop(id(p), None)
            self._grads.pop(id(p), None)

    def _state_if_edited_since_step(self) -> dict | None:
        """At the first update since step(): None when the optimizer's state
        holds what it held at step() (one pass of identity checks per step;
        later updates of the step skip it). Otherwise the user cleared or
        rebound it, or deleted or replaced a parameter's entry (a warm
        restart): eager step() updated those entries before, so the updates
        run on them (a state of the entries of step()), and the state stays
        as the user made it."""
        if self._step_state is None:
            return None
        then, entries = self._step_state
        now = self.optimizer.state
        if now is then and (len(now) == len(entries) and all(
                map(operator.is_, now.values(), entries.values()))
                or _only_reads_since(now, entries)):
            self._step_state = None
            return None
        return collections.defaultdict(dict, entries)

    def _keep_state_created(self, of_step: dict) -> None:
        """The entries that updates on `of_step` created (a parameter's first
        step): eager step() created them in the state before the user's edit,
        which kept them unless it emptied or rebound the whole state."""
        then, entries = self._step_state
        now = self.optimizer.state
        if now is then and now:
            for p, st in of_step.items():
                if p not in entries and not now.get(p):  # (an empty entry: a read's)
                    now[p] = st

    @_tensors.eager_under_compile
    def _on_module_forward(self, module, args) -> None:
        # (a dry run under a FakeTensorMode: see _on_root_forward)
        if self._removed or _tensors.fake_mode_active():  # (removed: a copy's hook, see __reduce__)
            return
        self._ran[id(module)] = self._stamp
        if self._pending:  # the common case, nothing pending, takes no lock
            # (locked: another thread may be applying these very updates)
            with self._lock: self._apply_for(module)  # noqa: E701 (see _lock)

    def _apply_for(self, module: nn.Module) -> None:
        """Applies the pending updates of what `module` reads (under the lock)."""
        self._follow_owners()  # (layers called one by one: no root forward)
        pending = self._pending
        # (a parameter registered under two names is applied once)
        mine = {id(p): p for p in _params_read_by(module, self._own_of) if id(p) in pending}
        if mine:
            self._apply(list(mine.values()))

    @_tensors.eager_under_compile
    def _on_root_forward(self, module, args) -> None:
        # A dry run under a FakeTensorMode (a memory estimate) is not seen:
        # eager's updates nothing there, and the pending updates, which the
        # optimizer refuses in that mode, wait for the next real forward (an
        # update tried there was refused and dropped: the step lost, 0.12 off)
        if self._removed or _tensors.fake_mode_active():  # (removed: a copy's hook, see __reduce__)
            return
        with self._lock: self._on_root_forward_locked()  # noqa: E701 (see _lock)

    def _on_root_forward_locked(self) -> None:
        if self._removed:  # by another thread since
            return
        self._sync()
        self._forget_late()
        previous, self._stamp = self._stamp, object()
        # Parameters of modules never seen running are read some other way: now.
        # (a module seen leaves _unseen for good, so the steady state looks at
        # no module here)
        self._unseen = [(i, own) for i, own in self._unseen if i not in self._ran]
        orphans = [p for _, own in self._unseen for p in own if id(p) in self._pending]
        if self._pending:
            orphans += self._of_idle_owners(previous)
        if orphans:
            # (a weight tied between owners is among each one's: applied once)
            self._apply(list({id(p): p for p in orphans}.values()))

    def _of_idle_owners(self, previous: object) -> list:
        """The pending parameters of the owners seen running before but not
        in the previous root forward (stamped `previous`): one skipped in a
        step, or called in one step or an eval pass only, whose parameters
        its parent reads without calling it. They are applied now, as the
        orphans: this forward may read them so, and an update waiting for a
        call that may not come would be read one update behind (refused
        then: see _on_root_forward_end). The steady state, every owner seen
        having run, counts the stamps in C instead of looking at each owner."""
        if operator.countOf(self._ran.values(), previous) >= len(self._owners) - len(self._unseen):
            return []
        pending, ran = self._pending, self._ran
        return [p for i, own in self._owners if ran.get(i, previous) is not previous
                for p in own if id(p) in pending]

    @_tensors.eager_under_compile
    def _on_root_forward_end(self, module, args, output) -> None:
        # What is still pending was not used by this forward through its module,
        # so gets no gradient from its backward unless the forward read it some
        # other way, one update behind (its module ran in the forward before,
        # not in this one): eager training has applied it long ago, and the
        # gradients it still holds must not meet unscale_() or clipping.
        if self._removed or not self._pending or _tensors.fake_mode_active():
            return  # (pending empty: the steady state, every owner ran; fake: see _on_root_forward)
        with self._lock: self._flush_watching_late(output)  # noqa: E701 (see _lock)

    def _flush_watching_late(self, output) -> None:
        """flush(), then watch what it applied (under the lock)."""
        late = dict(self._pending)
        self.flush()
        self._watch_late(late, output)

    def _watch_late(self, late: dict, output) -> None:
        """Has a gradient reaching a parameter of `late` (applied after this
        forward may have read it) through this forward's graph refused,
        until the next root forward or step(). Nothing to watch when the
        forward built no graph (no_grad, an evaluation)."""
        roots = [t.grad_fn or t for t in _pytree.tree_leaves(output)
                 if isinstance(t, torch.Tensor) and t.requires_grad]
        if roots:
            self._guarded, self._late_roots, self._read_stale = late, roots, None

    def _forget_late(self) -> None:
        if self._late_roots:
            self._guarded, self._late_roots, self._read_stale = self._pending, [], None

    def _on_state_dict(self, *args) -> None:
        self.flush()

    @_tensors.eager_under_compile
    def _on_grad_coming(self, pid: int, grad: torch.Tensor) -> None:
        p = self._guarded.get(pid)  # (the steady state: the pending updates' dict)
        if p is None:
            return
        if pid in self._pending:
            raise RuntimeError(
                f"reprop.fuse(mode='forward'): a parameter of shape {tuple(p.shape)} was used in "
                "forward while its update was still pending: its old value was read after "
                "optimizer.step() outside the forward of the module that owns it, or before "
                "step() by a graph backpropagated after it; call handle.flush() before such a "
                "use, or use mode='backward'")
        if self._read_stale is None:  # (once per forward: a walk of its graph)
            self._read_stale = _leaves_reached(self._late_roots, self._guarded)
        if pid in self._read_stale:
            raise RuntimeError(
                f"reprop.fuse(mode='forward'): {_param_name(self.model, p)} was read in forward "
                "without calling the module that owns it, in a step where that module did not "
                "run but did in the forward before: its update, pending since optimizer.step(), "
                "was applied after the read, so the forward used its old value. Call the "
                "module, or handle.flush() before such a forward, or use mode='backward'")

    def _refuse_zero_redundancy_caller(self) -> None:
        """A ZeroRedundancyOptimizer's step() steps its local optimizer (the
        one fused here, `zero.optim`: fuse() refuses the ZeroRedundancyOptimizer
        itself) and then broadcasts each parameter from the rank that owns
        it. Forward mode's updates were still pending then: each rank got
        the owners' values of before the step, and the owner alone applied
        its update at its next forward, so the ranks drifted apart, silently
        (0.05 off eager after 6 Adam steps on 2 ranks). Backward mode
        applies them inside backward, before that broadcast."""
        if _stepped_by_zero_redundancy(self._user_optimizer):
            raise RuntimeError(
                "reprop.fuse(mode='forward'): step() was called by the ZeroRedundancyOptimizer "
                "whose local optimizer this is, which broadcasts each parameter from its owner "
                "rank right after it, while forward mode leaves the updates pending until the "
                "next forward (the ranks would train different parameters); use "
                "mode='backward', or remove() the fusion")

    def _fused_step(self) -> None:
        if not self._caller_checked:  # (one look, at the first step(): a flag per step)
            self._refuse_zero_redundancy_caller()
            self._caller_checked = True
        if self._pending:  # a second step() before any forward: eager applied the first
            self.flush()
        # nothing is pending: drop the gradients an interrupted _hold or _settle
        # left held (they would be kept alive until their param's next update)
        self._grads.clear()
        self._forget_late()
        self._sync()
        self._hook_materialized()
        # before updates are pending: a conversion since that swapped the
        # parameters (see _tensors.SwapWatch) dropped the safety net's hooks
        self._swap_watch.check()
        by_group = [(g, [p for p in g["params"] if p.grad is not None])
                    for g in self.optimizer.param_groups]
        with_grad = [p for _, params in by_group for p in params]
        if self._clip is not None and with_grad:
            torch.nn.utils.clip_grad_norm_(with_grad, self._clip)
        self._settings = _settings_snapshot(self.optimizer)
        self._step_inference = torch.is_inference_mode_enabled()
        self._rechecked = False
        self._forget_checks_if_state_changed()
        try:
            for group, params in by_group:
                if params:
                    self._check_update(group, params)
                    self._hold(params, group)
        finally:  # a refused group: eager step() has updated the groups before it
            # (what is pending now, not a list kept beside it, which an interrupt
            # between the two would leave short: nothing was pending before the loop)
            self._decided(list(self._pending.values()))
        if self._ddp and self.model._join_config.enable:
            # under a Join made before fuse() (it took DDP's own join hook, not
            # _ddp_join_hook) nothing may wait: this rank may have run out
            self.flush()

    def _hold(self, params: list, group: dict) -> None:
        """Marks these updates (of `group`) pending, each to apply the gradient its param
        has now (the tensor, not a copy), as eager's step() applies it now,
        whatever .grad becomes meanwhile (zero_grad(), p.grad = None, a
        gradient set by hand); its _grad_mark tells an edit in place, and the
        param's swap mark a torch.utils.swap_tensors of it (_held_grads). A
        KeyboardInterrupt (a notebook's stop button) may arrive between any
        two statements, so each prefix is consistent:
        the entries are made whole first, and a pending update always finds
        its held gradient, so _grads is filled before _pending (one held
        but not pending is ignored: see _fused_zero_grad, _fused_step).
        A gradient of a rare kind (sparse, or another kind without storage),
        which _held_marks tells at no cost to the others, gets the group's full
        check first (_check_rare_grads)."""
        ids = list(map(id, params))
        grads = [p.grad for p in params]
        # (map and zip: a Python loop here cost a microsecond per param)
        self._grads.update(zip(ids, _held_marks(grads, params,
                                                lambda: self._check_rare_grads(group, params))))
        self._pending.update(zip(ids, params))

    def _decided(self, held: list) -> None:
        """Once step() has marked its updates pending: those of parameters no
        module owns are applied now, and so are those of parameters without
        optimizer state (a first step, a parameter unfrozen, the state reset):
        while such an update waited, opt.state lacked the entry eager step()
        created (a read of opt.state[p], a defaultdict, inserted an empty one,
        taken for a reset; torch's distributed checkpoint found the state
        empty and ran a step of its own). Then the optimizer state the others
        will update is noted (_state_if_edited_since_step): a shallow copy, in C.
        What waits gets eager's in-place update done to it now
        (_as_if_updated_in_place), once those applied now ran: one refused drops
        what waits in its group and the groups after it, which eager's refused
        step() leaves untouched; what is applied now gets it from its update."""
        state = self.optimizer.state
        stateless = self._may_lack_state()
        now = []
        if self._foreign or stateless:  # (the steady state of most models: neither)
            now = [p for p in held if id(p) in self._foreign or stateless and p not in state]
        if now:
            applied = set(map(id, now))
            waiting = [p for p in held if id(p) not in applied]
        else:
            waiting = held
        try:
            if now:
                self._apply(now, in_step=True)
        except BaseException:
            # refused: this step's updates of that group and the groups after it
            # are dropped (_drop_step_from), whose params eager's refused step()
            # left untouched; bumped before, a graph saved before step() raised
            # autograd's in-place error at its backward, where eager's ran
            pending = self._pending
            waiting = [p for p in waiting if id(p) in pending]
            raise
        finally:  # (after the update: it does not read the waiting params)
            if waiting:
                _as_if_updated_in_place(waiting)
        self._state_seen = (id(state), len(state))
        if self._pending:
            self._step_state = (state, dict(state))

    def _forget_checks_if_state_changed(self) -> None:
        """Drops every group's cached check when the optimizer's state changed
        since the last step(): another dict, or entries added or removed (by
        id: holding the old dict would keep a state the user dropped alive).
        The full check reads the state; and a group's cache also vouches that
        its params have state, which holds for the state it was made against
        only: a group that held no update in the step that noticed the change
        (a step() without gradients after opt.state.clear(), a frozen group)
        would otherwise pass its next update, with no state, as checked. Two
        looks per step in the steady state."""
        state = self.optimizer.state
        if self._state_seen != (id(state), len(state)):
            self._checked.clear()

    def _may_lack_state(self) -> bool:
        """Whether a parameter whose update this step() decided may have no
        entry in the optimizer's state: only when _check_update ran a full
        check (the step's params with a gradient or state slots changed since
        the group's last check, or the state did:
        _forget_checks_if_state_changed). Otherwise each of them was updated by
        a step since which the state has not changed. One look per step in the
        steady state, instead of a lookup per parameter."""
        return self._rechecked

    def _check_update(self, group: dict, params: list) -> None:
        """Raises what eager step() raises for the update of these params of one
        group (a bad lr, an option switched on after the first step whose state
        that step did not create, a sparse gradient), before it is marked
        pending: refused at the next forward instead, it would stay pending,
        refused again by every forward and flush. The optimizer's full check
        costs as much as the update, so it runs, as the optimizer's own does,
        when the group's state slots, capturable setting or parameters with a
        gradient differ from the last step checked; otherwise only the
        hyper-parameters are (and a group with a gradient of a rare kind: _hold)."""
        engine = self.optimizer
        settings = self._settings[id(group)]
        # the core's checks too, not _hparams' conversion alone: a value they
        # refuse (lr=1e300, Adam's beta1 = 1) passed step() and was refused at
        # the next forward, once per module, also after the user undid it
        engine._check_hparams(group, settings, params)
        slots = engine._state_slots(settings)
        # capturable too, which the optimizer's plans are rebuilt for (its check
        # refuses CPU params there): switched on by editing the group, it passed
        # step() and was refused by the next forward, and again after it was undone
        checked = (slots, bool(settings.get("capturable", False)), tuple(map(id, params)))
        if self._checked.get(id(group)) != checked:
            self._check_fully(group, params, settings, slots)
            # (in this order: a check cached must have set _rechecked, even if
            # a KeyboardInterrupt stops the step between the two)
            self._rechecked = True
            self._checked[id(group)] = checked

    def _check_fully(self, group: dict, params: list, settings: dict, slots: tuple) -> None:
        """The optimizer's full check of the update of `params` of `group`."""
        engine = self.optimizer
        try:
            engine._check_step(settings, params, None, slots)
        except (TypeError, ValueError, OverflowError) as e:  # named as eager step() names them
            raise engine._refusal(group, e) from None

    def _check_rare_grads(self, group: dict, params: list) -> None:
        """step()'s full check of a group one of whose gradients is of a rare
        kind (_hold), also where its check is cached (the group's params with
        a gradient as at the last step checked): a gradient made sparse since
        (an nn.Embedding switched to sparse=True) passed step() and was
        refused when its update was applied, at the next forward, where it
        was dropped (0.011 off eager's after a retry); eager's step() refuses
        it, and a step() again after the user's fix applies it once."""
        settings = self._settings[id(group)]
        self._check_fully(group, params, settings, self.optimizer._state_slots(settings))

    def _fused_zero_grad(self, set_to_none: bool) -> None:
        """What eager's zero_grad() does, now (the pending updates hold their
        gradients), except to a gradient a pending update holds:
        set_to_none=False gives its param a new zero gradient instead of
        zeroing it in place."""
        self._sync()  # eager zeroes the params of the groups as they are now
        if set_to_none:
            for p in self._params.values():
                p.grad = None
            return
        pending = self._pending
        for p in self._params.values():
            # (a gradient held with no update pending, after an interrupted step(), is eager's)
            held = self._grads.get(id(p)) if id(p) in pending else None
            if held is not None and p.grad is held[0]:
                try:
                    p.grad = torch.zeros_like(held[0])
                except RuntimeError:  # torch refuses it: p's .data replaced since step()
                    self._hold_a_copy(p, held)
                    _zero_grad_of(p, False)
            else:
                _zero_grad_of(p, False)

    def _hold_a_copy(self, p: torch.Tensor, held: tuple) -> None:
        """Has the pending update of `p` hold a copy of its held gradient
        (`held`, its _grads entry), which zero_grad(set_to_none=False) then
        zeroes in place as eager's does: a new zero gradient is refused by
        torch where p's .data was replaced since step() by one of another
        dtype or shape (whose update is refused until the user puts it back:
        _keeps_refused), and zero_grad() raised torch's error halfway through
        the parameters, where eager's zeroes them all. The swap mark stays
        step()'s (a swap since is still told)."""
        copy = held[0].detach().clone()
        self._grads[id(p)] = (copy, *_grad_mark(copy), held[3])
