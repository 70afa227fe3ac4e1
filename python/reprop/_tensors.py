"""Argument checks and pointer tables shared by every reprop technique.

The C core takes raw pointers; everything it is handed is checked here first,
with errors that name the argument and say what was expected.
"""
from __future__ import annotations

import contextlib
import decimal
import functools
import importlib
import inspect
import numbers
import operator
import os
import re
import sys
import warnings
import weakref
from typing import Callable

import numpy as np
import torch
import torch.autograd.forward_ad as fwAD

# The oldest PyTorch reprop runs on: 2.8 is the first with
# torch._C._autograd._top_saved_tensors_default_hooks, the only way to see that
# a non-reentrant torch.utils.checkpoint is recording (non_reentrant_checkpointing);
# without it fad.enabled() under such a checkpoint gives wrong gradients.
MIN_TORCH = (2, 8)


def require_torch(version: str) -> None:
    """ImportError unless `version` (a torch.__version__) is MIN_TORCH or newer;
    a version string not of the form major.minor... is let through."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and tuple(map(int, found.groups())) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"reprop needs PyTorch {need} or newer, found {version}; "
                          f"upgrade with: pip install 'torch>={need}'")


require_torch(torch.__version__)

# Element-type codes of csrc/reprop.h (rp_dtype).
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# Width of one row of a pointer table: sizeof(rp_optim_entry) / 8.
TABLE_COLUMNS = 8


def dtype_code(t: torch.Tensor, name: str) -> int:
    """The core's code for t's dtype; TypeError for what the kernels cannot take."""
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        if t.is_complex():
            raise TypeError(f"{name}: complex tensors are not supported (got {t.dtype})")
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {t.dtype}")
    return code


def check_strided(t: torch.Tensor, name: str) -> None:
    """Rejects sparse and other non-strided layouts (mkldnn) with a clear
    error, which calls the tensor sparse only where it is."""
    if t.layout is not torch.strided:
        what = "sparse tensors" if t.layout in _SPARSE_LAYOUTS else "non-strided tensors"
        raise RuntimeError(f"{name}: {what} are not supported (got layout {t.layout})")


_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                   torch.sparse_bsc)


def stored_parts(t: torch.Tensor) -> tuple | None:
    """The strided tensors that hold t's data: t itself, a sparse tensor's
    indices and values (its numel() and element_size() are the dense
    shape's, its storages those of the parts); None for a layout that has
    no storage to read (mkldnn)."""
    layout = t.layout
    if layout is torch.strided:
        return (t,)
    if layout is torch.sparse_coo:
        return (t._indices(), t._values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return None


def check_writable(x: torch.Tensor, name: str) -> None:
    """torch's refusal of an in-place write that a kernel's raw pointer would
    slip past: an inference tensor outside inference_mode cannot be tracked."""
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{name}: inplace update to inference tensor outside InferenceMode is "
                           "not allowed (as in torch); clone it first to get a normal tensor")


def is_count(value) -> bool:
    """An int or a NumPy int; never a bool (True is not a count of 1) nor a float."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_count(value, name: str, low: int, high: int | None = None) -> int:
    """`value` as a Python int if it is a count (is_count) in [low, high]
    (high None: no bound); else an error naming `name`: NotANumberError (a
    TypeError and a ValueError) for no int (a bool, a float, a string), a
    ValueError for one out of range."""
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    if not is_count(value):
        raise NotANumberError(f"{name}: expected an int {bound}, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}: expected an int {bound}, got {value!r}")
    return int(value)


def is_dense(t: torch.Tensor) -> bool:
    """True when t's elements fill one gap-free block of memory in some order
    of its dims (contiguous, channels_last, any permutation such as a
    transpose): an element-wise kernel then walks it as a flat array, and
    torch.empty_like(t) has the same strides, so a result keeps t's layout as
    torch's ops do."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def shares_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an element of a and one of b share a byte of memory. Dense
    tensors share one where their spans meet; a tensor with gaps (a column
    slice, a strided view) may interleave with the other, its span meeting
    the other's while no element does (the even and odd columns of one
    matrix): its elements' addresses are then compared, O(numel) in memory
    and time, for callers that reach it only where spans meet."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    if not (a0 < b1 and b0 < a1):
        return False
    if is_dense(a) and is_dense(b):
        return True
    starts_a, starts_b = _element_addresses(a), _element_addresses(b)
    # elements of one tensor share a size, so sorted by start they are sorted
    # by end too: the last element of a starting before each of b's ends
    # tells whether any of a's meets it
    last = np.searchsorted(starts_a, starts_b + b.element_size(), side="left") - 1
    hit = last >= 0
    return bool(np.any(starts_a[last[hit]] + a.element_size() > starts_b[hit]))


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses [first, end) that t's elements lie in (torch strides are
    never negative); empty for an empty t, which torch deems contiguous."""
    start = t.data_ptr()
    if t.is_contiguous():  # (no loop over the dims: optim's Python path spans a row's at each step)
        return start, start + t.numel() * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _element_addresses(t: torch.Tensor) -> np.ndarray:
    """The sorted distinct start addresses of t's elements (int64)."""
    offsets = np.zeros((), dtype=np.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = np.add.outer(offsets, np.arange(size, dtype=np.int64) * stride)
    return np.unique(offsets.ravel()) * t.element_size() + t.data_ptr()


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b can be walked in lockstep as flat arrays."""
    return a.shape == b.shape and (a.stride() == b.stride() or a.numel() <= 1)


# Our kernels write through raw pointers, which autograd cannot see: bump the
# version counters ourselves, so that a tensor saved for backward and modified
# since raises PyTorch's in-place-modification error instead of going wrong.
bump_versions = torch.autograd.graph.increment_version  # takes a list of tensors


def versions_of(tensors: list) -> list:
    """The version counters of `tensors` (None for an inference tensor,
    which has none), for set_versions to put back."""
    return [None if t.is_inference() else t._version for t in tensors]


def set_versions(tensors: list, versions: list) -> None:
    """Puts back the version counters versions_of read, after an update
    that bumped them but wrote only copies (the tensors' values are as
    they were, so what autograd saved of them is still good)."""
    kept = [(t, v) for t, v in zip(tensors, versions) if v is not None]
    if kept:
        torch._C._autograd._unsafe_set_version_counter(*zip(*kept))


def dispatch_mode_active() -> bool:
    """Whether a torch dispatch mode is on (allow_mutation_on_saved_tensors()
    runs one): it sees aten ops only, so a kernel's write through raw
    pointers must be shown to it as one (show_coming_writes, or a copy_ of
    the result)."""
    return torch._C._len_torch_dispatch_stack() > 0


def show_coming_writes(tensors: list) -> None:
    """Lets allow_mutation_on_saved_tensors() clone what autograd saved of
    `tensors` before a kernel writes them through raw pointers, which its
    dispatch mode cannot see: the mode clones the saved tensors aliasing
    each argument an aten op writes, before the op runs, so an op that
    writes each tensor onto itself (a no-op) is enough. Call it right before
    the raw write, and bump_versions(tensors) after: the mode tells a tensor
    saved again after the write from the copy saved before by its version."""
    torch._foreach_copy_(tensors, tensors)


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for `device_type` ("cpu", "cuda") right now."""
    return torch.is_autocast_enabled(device_type)


def torch_only(x: torch.Tensor) -> bool:
    """Tensors whose meaning raw kernels and custom autograd Functions would
    lose: functorch's wrappers (vmap, grad, jvp) and the batched gradients
    of autograd.grad(is_grads_batched=True), forward-AD duals (their
    tangent), meta tensors (no data), nested tensors (one strided buffer
    of differently shaped parts, without the sizes and strides a kernel
    walks; the jagged layout's are subclasses), tensor subclasses
    (FakeTensor under torch.export and compile, DTensor, ...), and any
    tensor while torch.jit.trace records (it cannot see a kernel that
    writes through a pointer) or a FakeTensorMode is active (fake_mode_active:
    a real tensor too, whose results would be FakeTensors without data).
    They go through torch's own ops."""
    # is_meta, not device.type: building the device object costs 1 us a call.
    # The type first: the cheapest, and it decides every subclass without
    # asking it for properties that its __torch_function__ may answer.
    if (type(x) not in _PLAIN_TYPES or x.is_meta or x.is_nested or _is_tracing()
            or _is_functorch_wrapped(x) or _is_legacy_batched(x) or fake_mode_active()):
        return True
    return fwAD._current_level >= 0 and fwAD.unpack_dual(x).tangent is not None


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_is_tracing = torch._C._is_tracing  # (bound once: torch_only runs at every activation call)


def repeated_dims(t: torch.Tensor) -> list[int]:
    """The dims along which t repeats its elements without memory of its own
    (stride 0, size > 1: expand, broadcast_to)."""
    return [i for i, (size, stride) in enumerate(zip(t.shape, t.stride()))
            if stride == 0 and size > 1]


def layout_guard(exemplars: tuple) -> Callable | None:
    """A check in one call that tensors, as many and in the same order, still
    have the layouts of `exemplars`: each of the same type, dispatch keys
    (layout, device type, torch's negative and conjugate bits, functorch's
    wrappers) under the dispatch state at the check, dtype, device index,
    requires_grad, shape and strides; False also for a tensor passed twice.
    It is torch's guard of compiled code (dynamo's TensorGuards), a C++ loop
    of about 50 ns a tensor, where reading those facts one by one cost about
    300 ns a gradient. None where this torch has none that passes
    _guard_refuses_other_layouts: the callers then read each fact."""
    guards = _tensor_guards()
    if guards is None:
        return None
    return guards(*exemplars, dynamic_dims_sizes=None, dynamic_dims_strides=None).check


@functools.cache
def _tensor_guards() -> type | None:
    """dynamo's TensorGuards, where it has the constructor layout_guard calls
    (torch 2.1 on) and refuses each change of layout the callers rely on it
    to see; else None. A private API: checked once, not trusted."""
    try:
        from torch._C._dynamo.guards import TensorGuards
        return TensorGuards if _guard_refuses_other_layouts(TensorGuards) else None
    except Exception:  # (an older or newer torch: another constructor, or none)
        return None


def _guard_refuses_other_layouts(guards: type) -> bool:
    """Whether a guard built from a tensor passes a copy of it and refuses the
    same elements in each other layout a caller must see."""
    x = torch.zeros(2, 3)
    check = guards(x, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
    others = (x.double(), x.reshape(3, 2), x.t().contiguous().t(), torch.zeros(2, 6)[:, ::2],
              torch._neg_view(x), x.to_sparse(), x.to("meta"), x.clone().requires_grad_(),
              torch.nn.Parameter(x))
    return check(x.clone()) is True and not any(check(t) for t in others)


def fake_mode_active() -> bool:
    """Whether a FakeTensorMode is active (torch's dry runs that estimate
    memory or shapes; export and compile tracing): every tensor an op makes
    is then a FakeTensor, which has no data, also from real inputs
    (allow_non_fake_inputs=True), so a kernel given such an output would
    get a null pointer, and one writing a real tensor would change what the
    dry run leaves alone. The stack length first: it costs less than the
    look-up when no mode is active."""
    return _dispatch_modes() > 0 and _dispatch_mode(_FAKE_MODE_KEY) is not None


_dispatch_modes = torch._C._len_torch_dispatch_stack
_dispatch_mode = torch._C._get_dispatch_mode
_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE


def profiler_range(name: str):
    """torch.profiler's record_function(name) while a profiler records, so
    that a kernel reprop calls through raw pointers, which no aten op shows,
    has a row of its own (a fusion's update was the self time of autograd's
    AccumulateGrad, a chain's scan no row at all); else a context that does
    nothing: record_function costs about 8 us a call without a profiler,
    this check and the empty context about 0.2 us (a fused update's Python
    alone costs over 10 us)."""
    return torch.autograd.profiler.record_function(name) if _profiling() else _NOT_PROFILED


_profiling = torch._C._autograd._profiler_enabled
_NOT_PROFILED = contextlib.nullcontext()  # (reusable: it holds nothing)


def _compiling() -> bool:
    """torch.compiler.is_compiling(), at less than half its cost on the eager
    path, where reprop asks per hook and activation (about 55 against 120 ns
    a call; fuse's backward mode asks some 76 times a step on 24 layers).
    Eager, is_compiling() is its module's flag (set by torch.export, and in
    torch 2.13 for a whole compile session) behind a torch.jit.is_scripting()
    call that is always False outside TorchScript: two Python calls where
    is_dynamo_compiling() and the flag make one. Traced, dynamo folds
    is_dynamo_compiling() to True, as it folds is_compiling() (the same
    table of tracing-state functions, in torch 2.8 as in 2.13), so the flag,
    which it would read and guard as a constant, is never reached there."""
    return _dynamo_compiling() or _compiler._is_compiling_flag


_dynamo_compiling = torch.compiler.is_dynamo_compiling
_compiler = torch.compiler
# (the flag is a private name of torch.compiler's: a torch without it gets its own call)
compiling = _compiling if hasattr(_compiler, "_is_compiling_flag") else torch.compiler.is_compiling


def eager_under_compile(fn: Callable) -> Callable:
    """fn, which torch calls (a hook, an optimizer's step()), run eagerly
    when dynamo meets it under torch.compile: one graph break, instead of
    dynamo tracing reprop's bookkeeping, locks and C calls (it raised inside
    them, warned about each C call, and compiled the Python between them
    once per parameter). Traced, compiling() is True and the call goes
    to torch.compiler.disable's wrapper; eager, it is False and fn runs
    directly: that wrapper costs about 0.5 us a call over a plain one, this
    gate about 0.06 us, on hooks that run about three times per layer and
    step. Under fullgraph=True dynamo's error gives `reason`."""
    eager = torch.compiler.disable(fn, reason=(
        f"reprop's {fn.__qualname__} runs eagerly under torch.compile, one graph break; compile "
        "without fullgraph=True"))

    @functools.wraps(fn)
    def gated(*args, **kwargs):
        if compiling():
            return eager(*args, **kwargs)
        return fn(*args, **kwargs)
    return gated


class ReproPWarning(UserWarning):
    """The category of every warning reprop gives (reprop.ReproPWarning), so
    that a suite run with warnings as errors can filter reprop's by class.
    One that was of another category is that one too (ReproPRuntimeWarning):
    filters by the old category still apply."""


ReproPWarning.__module__ = "reprop"  # (its public name, in tracebacks and pytest's output)


class ReproPRuntimeWarning(ReproPWarning, RuntimeWarning):
    """reprop's RuntimeWarning: its CUDA extension is built but does not load."""


# reprop's, torch's and importlib's own frames (importlib.import_module, a
# lazy or plugin loader's `import reprop`)
_NOT_USERS = tuple(os.path.dirname(f) + os.sep
                   for f in (__file__, torch.__file__, importlib.__file__))


def _import_machinery(filename: str) -> bool:
    """Whether a frame is importlib's bootstrap, which warnings skips without
    counting it in stacklevel (CPython's _is_internal_frame)."""
    return "importlib" in filename and "_bootstrap" in filename


def warn_at_users_line(message: str, category: type | None = None) -> None:
    """warnings.warn at the first frame outside reprop, torch and importlib:
    the user's call, however many of reprop's and torch's frames lie between
    (an optimizer's step wrappers, autograd's backward, under torch.compile
    dynamo's eval-frame wrappers, and at `import reprop` the import system's,
    which a fixed stacklevel cannot count)."""
    frame, level = sys._getframe(1), 0
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _import_machinery(filename):
            level += 1
            if not filename.startswith(_NOT_USERS):
                break
        frame = frame.f_back
    # (None: ReproPWarning looked up now, the class kept across reloads, not
    # bound as a default when this function was defined)
    warnings.warn(message, ReproPWarning if category is None else category, stacklevel=level + 1)


def torch_only_weight(p) -> bool:
    """torch_only for a module's weight (None: no weight). A registered
    Parameter is plain; only a tensor swapped in (torch.func.functional_call,
    a transform's wrappers, a forward-AD dual) needs torch_only's checks,
    which cost more."""
    return p is not None and type(p) is not torch.nn.Parameter and torch_only(p)


# Whether a torch.func transform (grad, vmap, jvp, ...) is active: then even a
# tensor it does not wrap (a closure's) must not meet a custom autograd.Function
# without setup_context, which functorch refuses where torch's ops run
transform_active = torch._C._are_functorch_transforms_active
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
# the gradients autograd.grad(is_grads_batched=True) hands a backward (no storage)
_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def without_grad(fn: Callable, *args):
    """fn(*args) under torch.no_grad(), returning what it returns: for
    per-module work in hooks, which inside backward finds grad mode off
    already, and where the context manager object costs about a
    microsecond per call. Switched off inside the try: a KeyboardInterrupt
    (a notebook's stop button) arriving as the switch returns would
    otherwise leave grad mode off for the session, and so did one as a
    `with torch.no_grad():` block ended, before its Python __exit__ ran.
    Switched on again on the line of the call when it returns: one landing
    at the start of a line of its own after it (a finally's, which a call
    that returned reaches too) left it off (no later forward recorded a
    graph)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    try:
        torch._C._set_grad_enabled(False)
        result = fn(*args); torch._C._set_grad_enabled(True)  # noqa: E702 (see above)
    except BaseException:
        torch._C._set_grad_enabled(True)
        raise
    return result


def without_autocast(device_type: str, fn: Callable, *args):
    """fn(*args) with autocast off for `device_type`, as inside
    torch.autocast(device_type, enabled=False), returning what it returns;
    switched by torch's C calls inside a try. torch.autocast's __exit__ is
    Python: a KeyboardInterrupt (a notebook's stop button) as such a block
    ended, before it ran, left autocast's nesting count up for the session,
    so no autocast region dropped its cast cache again and a weight updated
    in place was used as its stale lower-precision copy (the forward no
    longer changed with training)."""
    prev = torch.is_autocast_enabled(device_type)
    try:
        torch.set_autocast_enabled(device_type, False)
        result = fn(*args); torch.set_autocast_enabled(device_type, prev)  # noqa: E702 (as without_grad)
    except BaseException:
        torch.set_autocast_enabled(device_type, prev)
        raise
    return result


# Part of each refusal of double backward (fad, bppsa, ooo): the calls
# that run one without the user writing create_graph=True, which the refusal
# alone left unexplained (torch.autograd.functional.jvp raising "create_graph=True
# ... not supported"), and what computes those products here instead
DOUBLE_BACKWARD_CALLERS = ("torch.autograd.functional's jvp, hvp, vhp and hessian backpropagate twice "
                           "too: torch.func.jvp, torch.func.hessian and torch.autograd.forward_ad "
                           "work here")


def outside_backward() -> bool:
    """Whether no backward pass is running on this thread (checkpointing's
    recomputing forwards run inside one): a forward here that finds a
    backward still marked as running knows that backward raised, since its
    end-of-backward callback was dropped with it."""
    return torch._C._current_graph_task_id() == -1


def non_reentrant_checkpointing() -> bool:
    """Whether a non-reentrant torch.utils.checkpoint is recording (or
    recomputing) this forward: it matches the tensors saved by the
    recompute against the recorded ones by position, so a layer must take
    the same path in both, whatever changed in between. (A user's pack
    hook may be any callable: a functools.partial has no __qualname__.)"""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(
        ("_checkpoint_hook.", "_recomputation_hook."))


class _Queued:
    """An end-of-backward callback that records that it ran. On CUDA the
    engine's device thread, which finishes the pass, can still hold the
    pass and so its callbacks a moment after backward() returned to the
    caller: a queued callback alive is not yet one still to run."""

    __slots__ = ("callback", "ran", "__weakref__")

    def __init__(self, callback: Callable[[], None]):
        self.callback, self.ran = callback, False

    def __call__(self) -> None:
        try:
            self.callback()
        finally:
            self.ran = True


def queue_end_of_backward(callback: Callable[[], None]) -> Callable[[], object]:
    """Queues `callback` for the end of the backward pass running now, and
    returns a function giving the queued entry while it is still to run,
    else None: once it ran (whichever thread ran it) or once the pass
    dropped it unrun by raising (the pass holds the only strong reference
    to it, so a weak one dies with it), whatever ran since (a retry of it,
    another forward)."""
    queued = _Queued(callback)
    torch.autograd.Variable._execution_engine.queue_callback(queued)
    ref = weakref.ref(queued)

    def pending() -> "_Queued | None":
        entry = ref()
        return None if entry is None or entry.ran else entry

    return pending


def not_queued() -> None:
    """What queue_end_of_backward's reference gives once its callback has run
    or was dropped: the starting value for one."""
    return None


def weak_hook(method: Callable, otherwise: Callable | None = None) -> Callable:
    """A hook that calls the bound `method` through a weak reference to its
    object, and once that is gone does nothing (or returns ``otherwise(*args)``
    where the hook must keep answering: a DDP communication hook). For hooks
    torch keeps where Python's garbage collector cannot see them (a
    parameter's post-accumulate-grad hooks live in C++ autograd metadata, a
    DDP comm hook in its C++ Reducer): a strong one would keep the handle,
    and through it the model and optimizer, alive for good after the user
    dropped them. It has `method`'s signature (DDP's register_comm_hook
    reads the parameter names); hook_owner(hook) is the object while alive."""
    # the object weakly, its class's function strongly (it refers to no
    # instance): a quarter of the cost of a weakref.WeakMethod call
    owner, function = weakref.ref(method.__self__), method.__func__

    def hook(*args):
        obj = owner()
        if obj is not None:
            return function(obj, *args)
        return otherwise(*args) if otherwise is not None else None

    hook.__signature__ = _bound_signature(function)
    hook.owner = owner
    return hook


class SwapWatch:
    """Keeps the tensor hooks of the tensors added (a parameter's
    post-accumulate-grad and register_hook hooks) firing after
    torch.utils.swap_tensors, which module conversions (.to(), .half(),
    .cpu(), any Module._apply) and load_state_dict use under
    torch.__future__.set_swap_module_params_on_conversion(True): the swap
    keeps the Python object and its dicts of hooks but moves it to another
    TensorImpl, and autograd runs the hooks registered on the impl, so every
    hook on the tensor stopped firing, silently (torch drops the user's
    too). A swap also swaps the object's __dict__, which is what check()
    compares (one identity per tensor, in one C loop: measured about 0.2 us
    a tensor, less than reading each .grad); a tensor swapped since gets its hook dicts
    registered with its new impl, the user's hooks included, as they were
    before the swap. Not swap_mark, the impl's address: a freed impl's
    address is given to the next one, so after two swaps between checks
    (`m.cpu(); m.cpu()` of a one-weight model under the flag: measured) a
    tensor may have the address it had, and a check by it would miss them,
    where the __dict__ held here is never given back; and it costs more (a
    new int per tensor: at 10000 tensors 0.30-0.34 us a tensor against
    0.14-0.17, medians of 31). A __dict__ replaced without a swap only
    registers the hooks again, harmlessly. torch._C._swap_tensor_impl
    called directly (only swap_tensors calls it) leaves the __dict__ and is
    not seen (README)."""

    __slots__ = ("_watched", "_tensors", "_marks")

    def __init__(self) -> None:
        self._watched: dict = {}  # id -> (tensor, its __dict__ when last seen)
        self._tensors: list | None = []  # the lists check() compares (None: to rebuild)
        self._marks: list = []

    def add(self, t: torch.Tensor) -> None:
        """Watches t (held) from now on, as it is now: when its hook is registered."""
        self._watched[id(t)] = (t, t.__dict__)
        self._tensors = None

    def retain(self, keep: dict) -> None:
        """Stops watching (and holding) the tensors whose id is not in `keep`."""
        self._watched = {i: seen for i, seen in self._watched.items() if i in keep}
        self._tensors = None

    def check(self) -> None:
        """Registers the hooks of each tensor swapped since again."""
        if self._tensors is None:
            self._tensors = [t for t, _ in self._watched.values()]
            self._marks = [mark for _, mark in self._watched.values()]
        marks = list(map(_DICT_OF, self._tensors))
        if all(map(operator.is_, marks, self._marks)):  # (not ==: empty dicts are equal)
            return
        for t, old, new in zip(self._tensors, self._marks, marks):
            if old is not new:
                rearm_tensor_hooks(t)
                self._watched[id(t)] = (t, new)
        self._marks = marks


_DICT_OF = operator.attrgetter("__dict__")
# What tells a tensor swapped since (torch.utils.swap_tensors by hand, not
# through a conversion): the address of its TensorImpl, which the swap
# exchanges with the other tensor's (so does torch._C._swap_tensor_impl,
# which leaves the __dict__); compared with ==. Not its __dict__: `p.__dict__
# = dict(p.__dict__)` (no swap) replaces it, and the pending update was
# refused falsely. `.data =`, setattr and in-place ops keep it. One C call a
# tensor. Two swaps may give it back (the allocator reuses a freed impl's
# address): SwapWatch, which must see those, compares the __dict__ instead.
swap_mark = operator.attrgetter("_cdata")


def rearm_tensor_hooks(t: torch.Tensor) -> None:
    """Gives t's dicts of tensor hooks to its TensorImpl again: assigning one
    (what register_hook and register_post_accumulate_grad_hook do at their
    first hook) registers it with the impl, the one autograd looks at."""
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(t, name)
        if hooks is not None:
            setattr(t, name, hooks)


@functools.lru_cache(maxsize=None)
def _bound_signature(function: Callable) -> inspect.Signature:
    """The signature of `function` bound to an object (self dropped); cached,
    as inspect.signature costs tens of microseconds and weak_hook is made once
    per parameter."""
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def forward_is_torchs(cls: type) -> bool:
    """Whether cls.forward is still one torch.nn defines. A library may set
    another on the class itself (nn.Linear.forward = ...): every layer of
    that exact class then computes what it says, which reprop's own forward
    for the class would silently replace. A wrapper made with functools.wraps
    carries torch's names, so its __wrapped__ counts too."""
    forward = getattr(cls, "forward", None)
    return (getattr(forward, "__module__", None) or "").startswith("torch.nn.") \
        and not hasattr(forward, "__wrapped__")


def replaced_forward(module, cls: type) -> str | None:
    """Where `module`, of torch class `cls`, has a forward other than torch's
    own: "instance" (set on it: calls find that one before the class's, as
    accelerate's add_hook_to_module sets one, calling the forward bound
    before), "class" (a library set cls.forward: forward_is_torchs), or None.
    Either way, a forward reprop puts in the class's place would not run, or
    would drop what that one computes."""
    if "forward" in module.__dict__:
        return "instance"
    return None if forward_is_torchs(cls) else "class"


def kept_across_reloads(module: str, name: str, value):
    """`value`, or what `module` (a reprop module's __name__) kept as `name`
    before a reload of it: importlib.reload re-runs a module in its namespace
    and IPython's %autoreload clears that namespace first, while objects made
    before (a live fusion, a patched model's records) still refer to the
    sentinels, registries and classes they were made with. Kept on the C
    extension, which no reload re-runs (%autoreload reloads the package's
    __init__ too when it changes). A kept class keeps its methods as first
    imported."""
    kept = vars(importlib.import_module(f"{__package__}._C")).setdefault("_kept_across_reloads", {})
    return kept.setdefault((module, name), value)


# reprop's warning classes as first imported: a filter by class (README:
# warnings.filterwarnings(category=reprop.ReproPWarning), pytest's -W) holds
# that one, and after importlib.reload of this module (IPython's %autoreload 2
# when its file changes) the warnings of the modules that look the class up
# here (fad.patch's) were of a new class, which such a filter let through.
ReproPWarning = kept_across_reloads(__name__, "ReproPWarning", ReproPWarning)
ReproPRuntimeWarning = kept_across_reloads(__name__, "ReproPRuntimeWarning", ReproPRuntimeWarning)


def current_class(cls: type) -> type:
    """The class cls's module names cls's name now: after a reload of the
    module, a new one, which pickle requires of an object made before it
    (an old class is 'not the same object' as its module's)."""
    return getattr(sys.modules.get(cls.__module__), cls.__qualname__, cls)


def class_key(cls: type) -> tuple[str, str]:
    """cls as a reload of its module leaves it: its module and qualified name
    (the reload makes a new class object of that name)."""
    return cls.__module__, cls.__qualname__


def is_instance_by_name(obj, cls: type) -> bool:
    """isinstance(obj, cls) that holds across an importlib.reload of cls's
    module: an object made before the reload has the old class, and a module
    that imported cls before has the old one too. By class_key along obj's
    class's MRO."""
    key = class_key(cls)
    return any(class_key(c) == key for c in type(obj).__mro__)


def hook_owner(hook: Callable) -> object | None:
    """The object whose method `hook` calls: a bound method's, or a weak_hook's
    while it is alive; None for any other hook."""
    owner = getattr(hook, "owner", None)
    return owner() if owner is not None else getattr(hook, "__self__", None)


def note_node_hooks(function: type, registers: tuple = ("register_hook", "register_prehook"),
                    check: Callable | None = None) -> None:
    """Makes the backward nodes of `function` (an autograd.Function) note
    their hooks: each of the node class's `registers` methods sets
    ``node.hooked = True`` (the node is the Function's ctx) before it
    registers, so that backward can give a hook what it would see under
    plain autograd. torch has no query for a node's hooks. `check(node,
    method name)`, if given, runs first and may refuse the hook by raising."""
    node_class = function._backward_cls
    for name in registers:
        setattr(node_class, name, _noting_hooks(getattr(node_class, name), check))


def _noting_hooks(register: Callable, check: Callable | None) -> Callable:
    @functools.wraps(register)
    def noted(node, hook):
        if check is not None:
            check(node, register.__name__)
        node.hooked = True
        return register(node, hook)

    return noted


def suggest_memory_format(x: torch.Tensor) -> torch.memory_format:
    """Tensor.suggest_memory_format(), which only C++ has (torch's Python port
    goes through symbolic shapes: sympy on first use, microseconds a call):
    c10's is_channels_last_strides_2d/3d on x's sizes and strides."""
    if x.layout != torch.strided or x.dim() not in (4, 5):
        return torch.contiguous_format
    sizes, strides = x.shape, x.stride()
    if strides[1] == 0:  # a trivial channel dimension: NCHW by default
        return torch.contiguous_format
    low = 0
    for d in ((1, 3, 2, 0) if x.dim() == 4 else (1, 4, 3, 2, 0)):
        # ambiguous strides (an N111 tensor) fall back to contiguous, as in c10
        if sizes[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return torch.contiguous_format
        low = strides[d] * max(sizes[d], 1)
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


def new_table(rows: int) -> np.ndarray:
    """An empty pointer table of `rows` rp_optim_entry records."""
    return np.zeros((rows, TABLE_COLUMNS), dtype=np.int64)


def current_stream_handle(device: torch.device) -> int:
    """The cudaStream_t of PyTorch's current stream on `device`, as an integer."""
    return torch.cuda.current_stream(device).cuda_stream


def on_device(device: torch.device):
    """A context in which CUDA `device` is current, for a launch on it: the
    kernels run on the current device, and PyTorch's default stream, handle
    0, carries none for the launchers to switch to (rp_device_guard). No
    switch where `device` is current already (always, on one GPU)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class NotANumberError(TypeError, ValueError):
    """A number argument given something else (a string, a bool, a tensor
    where a Python number is taken): a TypeError, as torch raises for one,
    and a ValueError, which reprop raised before (callers catching that
    still do)."""


def _is_real_scalar(value) -> bool:
    """A real number as torch's float() takes one where it expects a scalar
    (clip_grad_norm_'s max_norm): an int, a float, a NumPy real scalar or 0-d
    array, a one-element real tensor. Not a bool (True is no number 1 there),
    nor a string, which float() would parse."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (int, float, np.integer, np.floating)):
        return True
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and value.dtype.kind in "iuf"
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return False


def check_positive_real(value, name: str) -> float:
    """`value` as a Python float if it is a real scalar (_is_real_scalar, or
    another number float() takes, as clip_grad_norm_'s float(max_norm) does:
    a Fraction, a Decimal) > 0, inf included; else a TypeError (not a real
    scalar) or a ValueError (0, a negative number, NaN) naming `name`."""
    if not (_is_real_scalar(value) or isinstance(value, (numbers.Real, decimal.Decimal))
            and not isinstance(value, bool)):
        what = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor) else f"{value!r} ({type(value).__name__})")
        raise TypeError(f"{name}: expected a real number (an int, a float or a one-element real "
                        f"tensor; not a bool), got {what}")
    as_float = float(value)
    if not as_float > 0:
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")
    return as_float


class NotAFlagError(TypeError, ValueError):
    """A flag argument given something other than True or False: a
    TypeError, as torch raises for a wrong type, and a ValueError, which
    reprop's fad, fusion and ooo raised before (callers catching that still
    do)."""


def check_flag(value, name: str) -> bool:
    """`value` as a Python bool if it is True or False (a NumPy bool too, as
    torch's module flags such as nn.RNN's bias take one); else a
    NotAFlagError naming `name`: a string such as "no", or a number, would
    pass for one by its truth. The flags of fad, fusion, ooo and bppsa come
    here, so that each refuses the same values the same way (reprop.optim's
    take any value by its truth, as torch.optim's do)."""
    if not isinstance(value, (bool, np.bool_)):
        raise NotAFlagError(f"{name}: expected True or False, got {value!r}")
    return bool(value)
