"""Nested forward-AD activations: save only f'(x) for backward.

Guo et al., "Nesting Forward Automatic Differentiation for Memory-Efficient
Deep Neural Network Training" (../shared/papers/nested-forward-ad.md). An
element-wise activation y = f(x) computes its derivative d = f'(x) in the
forward pass, in the same pass over memory as y, and saves only d; backward is
grad_x = grad_y * d. Three ways in:

* functions and modules with torch's signatures: ``reprop.fad.gelu(x)``,
  ``reprop.fad.Mish()``, ... each with a keyword ``saved_dtype``;
* ``reprop.fad.patch(model)`` swaps the activation modules of an unmodified
  model in place; ``reprop.fad.unpatch(model)`` restores them;
* ``with reprop.fad.enabled(compose=True):`` reroutes functional activation
  calls and finds chains of element-wise ops written out in user code
  (``x * torch.sigmoid(x)``, ``x * torch.tanh(F.softplus(x))``, the tanh-GELU
  formula), carrying their forward derivative along so that a whole chain saves
  one tensor (the paper's run-time state machine, Section IV).

``saved_dtype`` chooses how d is stored: ``None`` (x's dtype; gradients equal
torch's within rounding), ``torch.float32``, ``torch.bfloat16``,
``torch.float16``, or ``torch.uint8``: one 8-bit code per element, a
per-activation lookup quantization of f'(x) (``codebook``), whose decoded
derivative is off by at most half a grid step (``codebook(...).max_error``).

Native torch activations (F.gelu, F.silu, F.mish, F.softplus, F.elu, ...)
already save one input-sized tensor, so for them the default storage saves the
same bytes; the gains are in fewer bits and in composed activations, which
save 2 to 4 tensors under plain autograd. Those that save their output (Sigmoid,
Tanh, and in place ELU, CELU, SELU and LeakyReLU), which the next layer
saves anyway, patch() and enabled() leave to torch.

Double backward (``create_graph=True`` through an activation) needs f''(x),
which is not kept: it raises a RuntimeError (but for LeakyReLU and
Hardsigmoid, whose f' is piecewise constant: f'' is 0 wherever it exists),
and so does a composed chain unless its backward is autograd's own graph
(one relu of its root, or additions and products with constants: _Chain).
"""
from __future__ import annotations

import collections.abc
import functools
import inspect
import itertools
import math
import numbers
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from . import _tensors
from ._native import _C, _cuda, cuda_missing

__all__ = [
    "gelu", "silu", "mish", "softplus", "sigmoid", "tanh", "elu", "celu", "selu", "leaky_relu",
    "hardswish", "hardsigmoid", "logsigmoid", "softsign", "tanhshrink",
    "GELU", "SiLU", "Mish", "Softplus", "Sigmoid", "Tanh", "ELU", "CELU", "SELU", "LeakyReLU",
    "Hardswish", "Hardsigmoid", "LogSigmoid", "Softsign", "Tanhshrink",
    "patch", "unpatch", "enabled", "codebook", "Codebook",
]

# rp_fad_kind of csrc/reprop.h
_KINDS = ("gelu", "gelu_tanh", "silu", "mish", "softplus", "sigmoid", "tanh", "elu", "celu", "selu",
          "leaky_relu", "hardswish", "hardsigmoid", "logsigmoid", "softsign", "tanhshrink")
_KIND = {name: code for code, name in enumerate(_KINDS)}
_CODE8 = 3  # RP_FAD_CODE8
_NONE = -1  # RP_FAD_NONE
_SAVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
# Inputs the functions hand to torch's own op: the kernels compute in float32,
# and float64 input asks for float64 gradients (enabled() does the same).
_TORCH_DTYPES = (torch.float64,)


def _kept_across_reloads(cls: type) -> type:
    """cls as first imported (_tensors.kept_across_reloads): the records
    patch() leaves on a model and a live enabled()'s chain records made
    before a reload are its instances, which isinstance must still tell.
    For classes of records only: their own methods are not reloaded."""
    return _tensors.kept_across_reloads(__name__, cls.__qualname__, cls)


class _Act(NamedTuple):
    """One activation with its parameters, as the kernels take it."""

    kind: str
    p0: float = 0.0
    p1: float = 0.0

    @property
    def code(self) -> int:
        return _KIND[self.kind]


# ---------------------------------------------------------------------------
# Argument checks and the kernel calls
# ---------------------------------------------------------------------------


def _check_input(x, fname: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fname}: input must be a torch.Tensor, got {type(x).__name__}")
    _tensors.dtype_code(x, f"{fname}: input")
    if x.is_cuda:  # (is_cuda, is_cpu: a fifth of a microsecond less than device.type)
        if _cuda is None:
            raise RuntimeError(f"{fname}: input is on {x.device}, but {cuda_missing()}")
    elif not x.is_cpu:
        raise ValueError(f"{fname}: input must be on cpu or cuda, got {x.device}")


def _check_saved_dtype(saved_dtype, fname: str) -> None:
    if saved_dtype is not None and saved_dtype not in _SAVED_DTYPES:
        raise ValueError(f"{fname}: saved_dtype must be None, torch.float32, torch.bfloat16, "
                         f"torch.float16 or torch.uint8 (8-bit codes), got {saved_dtype!r}")


def _check_codable(act: _Act, saved_dtype, fname: str) -> None:
    """8-bit codes are a grid over f's derivative range, so that range must be
    bounded; clamping an unbounded f' to a grid would be silently wrong. Of the
    kinds, only CELU with alpha < 0 has one: f'(x) = exp(x / alpha) for x <= 0.
    (ELU's alpha e^x, Softplus's sigmoid(beta x) and LeakyReLU's two values stay
    bounded for any sign of their parameter.)"""
    if saved_dtype is torch.uint8 and act.kind == "celu" and act.p0 < 0:
        raise ValueError(f"{fname}: saved_dtype=torch.uint8 (8-bit codes) needs a bounded "
                         f"derivative, but CELU's f'(x) = exp(x / alpha) is unbounded for "
                         f"alpha < 0 (got alpha={act.p0}); use saved_dtype None, torch.float32, "
                         "torch.bfloat16 or torch.float16")


def _store_code(saved: torch.dtype) -> int:
    return _CODE8 if saved is torch.uint8 else _tensors.DTYPE_CODES[saved]


def _launch_forward(act: _Act, x: torch.Tensor, y: torch.Tensor, d: torch.Tensor | None) -> None:
    """y = f(x) and, when d is given, d = f'(x) in one pass; x, y, d dense in one layout."""
    n = x.numel()
    if n == 0:
        return
    dtype = _tensors.DTYPE_CODES[x.dtype]
    d_store, d_ptr = (_NONE, 0) if d is None else (_store_code(d.dtype), d.data_ptr())
    if x.is_cpu:
        _C.fad_forward(act.code, act.p0, act.p1, dtype, x.data_ptr(), y.data_ptr(), d_store, d_ptr,
                       n, torch.get_num_threads())
    else:
        with _tensors.on_device(x.device):
            _cuda.fad_forward(act.code, act.p0, act.p1, dtype, x.data_ptr(), y.data_ptr(), d_store,
                              d_ptr, n, _tensors.current_stream_handle(x.device))


def _run_forward(act: _Act, x: torch.Tensor, saved: torch.dtype | None, inplace: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, d) with d stored as `saved` (None: d is not computed). In place, y is x."""
    src = x if _tensors.is_dense(x) else x.contiguous()
    # under a dispatch mode (allow_mutation_on_saved_tensors(): a tensor saved
    # for backward is cloned before an aten op mutates it) the kernels write a
    # new tensor and x.copy_ takes it, so the mode sees the write
    raw = inplace and src is x and not _tensors.dispatch_mode_active()
    y = src if raw else torch.empty_like(src)  # empty_like keeps a dense layout
    d = None if saved is None else torch.empty_like(src, dtype=saved)
    _launch_forward(act, src, y, d)
    if raw:
        _tensors.bump_versions([x])  # written through a raw pointer, unseen by autograd
    elif inplace:
        x.copy_(y)
        y = x
    return y, d


def _run_forward_repeated(act: _Act, x: torch.Tensor, saved: torch.dtype, repeated: list[int]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """_run_forward of an x with repeated_dims `repeated`: f and f' of each
    distinct element once, y as full as torch's output, d an expanded view of the
    distinct f'(x), so that backward keeps the bytes of x's own memory, as
    torch's op (which saves x) does, not one f' per element: a GELU of a
    bias expanded over a batch of 64 saved 64 times torch's bytes."""
    distinct = x[tuple(slice(0, 1) if i in repeated else slice(None) for i in range(x.dim()))]
    y, d = _run_forward(act, distinct, saved, False)
    return y.expand(x.shape).contiguous(), d.expand(x.shape)


# Bounded: a parameter annealed every step (a leaky_relu slope) makes a new
# _Act each time, and each entry holds ~1.3 KB (the decode tables, tensors).
@functools.lru_cache(maxsize=256)
def _codebook_bytes(act: _Act) -> bytes:
    return _C.fad_codebook(act.code, act.p0, act.p1)


@functools.lru_cache(maxsize=256)
def _zero_code(act: _Act) -> int:
    """The 8-bit code of a derivative of exactly 0 (rp_fad_codebook's zero_code)."""
    return int(np.frombuffer(_codebook_bytes(act), dtype=np.int32, count=1, offset=1028)[0])


@functools.lru_cache(maxsize=256)
def _decode_table(act: _Act, device: torch.device) -> torch.Tensor:
    """The 256 float32 derivatives the 8-bit codes stand for (rp_fad_codebook's first table)."""
    table = np.frombuffer(_codebook_bytes(act), dtype=np.float32, count=256)
    return torch.from_numpy(table.copy()).to(device)


def _backward_code8(act: _Act, grad: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """grad * decode(codes), in grad's dtype, through the 8-bit kernels."""
    # batched by vmap (is_grads_batched, jacobian(vectorize=True)), or any while a transform is
    # active; and under create_graph=True (_TWO_VALUED kinds), where autograd must see the product
    if _torch_runs(grad) or torch.is_grad_enabled():
        decoded = _decode_table(act, grad.device)[codes.long()]
        return (grad.float() * decoded).to(grad.dtype)
    if not _tensors.same_layout(grad, codes) or not _tensors.is_dense(grad):
        grad, codes = grad.contiguous(), codes.contiguous()
    out = torch.empty_like(grad)
    n = grad.numel()
    if n == 0:
        return out
    dtype = _tensors.DTYPE_CODES[grad.dtype]
    cb = _codebook_bytes(act)
    if grad.is_cpu:
        _C.fad_backward_code8(dtype, grad.data_ptr(), codes.data_ptr(), cb, out.data_ptr(), n,
                              torch.get_num_threads())
    else:
        with _tensors.on_device(grad.device):
            _cuda.fad_backward_code8(dtype, grad.data_ptr(), codes.data_ptr(), cb, out.data_ptr(),
                                     n, _tensors.current_stream_handle(grad.device))
    return out


# The 16-bit dtype whose saved f' a 16-bit gradient meets in _times_saved's kernel.
_OTHER_16BIT = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}


def _times_saved(grad: torch.Tensor, d, dtype: torch.dtype):
    """grad * d, the backward of _Activation and _Chain, whose result the
    caller casts to `dtype`. torch promotes a bfloat16 grad with a float16 d
    (or the reverse) to float32, where the product of an 8- and an 11-bit
    significand is exact, and the cast rounds it once: a float32 temporary
    of the full size, and 3.5 times as long as a bfloat16 d's backward on
    the CPU (1M elements). The CPU kernel gives those bits in `dtype` in one
    pass, where `dtype` is grad's (else the cast would round the rounded
    product again) and grad and d have one dense layout; torch's product
    elsewhere, and where autograd must see it (create_graph=True) or a
    transform or lazy view needs torch's op (_torch_runs)."""
    if (isinstance(d, torch.Tensor) and d.dtype is _OTHER_16BIT.get(grad.dtype)
            and grad.dtype is dtype and grad.is_cpu and d.is_cpu
            and _tensors.same_layout(grad, d) and _tensors.is_dense(grad)
            and not (torch.is_grad_enabled() or _torch_runs(grad) or _torch_runs(d))):
        out = torch.empty_like(grad)
        _C.fad_backward_mixed16(_tensors.DTYPE_CODES[dtype], grad.data_ptr(), d.data_ptr(),
                                out.data_ptr(), out.numel(), torch.get_num_threads())
        return out
    return grad * d


def _refuse_double_backward(what: str, instead: str) -> None:
    # create_graph=True runs backward with grad mode on; grad * d would then
    # silently miss the d(f'(x))/dx term, as f''(x) is not kept.
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what} saves only its first derivative for backward, so it cannot "
                           f"be differentiated twice (create_graph=True; "
                           f"{_tensors.DOUBLE_BACKWARD_CALLERS}): {instead}")


# reprop.fad's functions and modules, patched modules and enabled()'s rerouting
_ACTIVATION_INSTEAD = ("where higher-order gradients are needed, use torch's own activation "
                       "(torch.nn.functional's, or torch.nn's module: reprop.fad.unpatch() the "
                       "model, or run it outside reprop.fad.enabled())")


class _Activation(torch.autograd.Function):
    """y = f(x), saving only d = f'(x) (in `saved` dtype) for backward. For
    the _TWO_VALUED kinds, (y, anchor): see _twice_differentiable."""

    @staticmethod
    def forward(ctx, x, act, saved, inplace, link=None):
        repeated = _tensors.repeated_dims(x) if not inplace and 0 in x.stride() else None
        if repeated:
            y, d = _run_forward_repeated(act, x, saved, repeated)
        else:
            y, d = _run_forward(act, x, saved, inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.act = act
        # an undefined incoming gradient (a node pre-hook's (None,), a next
        # node's None) stays None, as torch's node leaves it: materialized,
        # it gave x.grad zeros where torch leaves None (an optimizer then
        # stepped momentum and weight decay where eager skips the parameter)
        ctx.materialize_grads = False
        if act.kind not in _TWO_VALUED:
            ctx.save_for_backward(d)
            return y
        anchor = y.new_empty(0)
        ctx.save_for_backward(d, anchor if link is None else link)
        return y, anchor

    @staticmethod
    def backward(ctx, grad, *anchor_grad):
        if grad is None:  # (materialize_grads off)
            if anchor_grad and anchor_grad[0] is not None:
                # the anchor's alone, in double backward: torch's double backward
                # gives x zeros there (_twice_differentiable), from its dtype and device
                d, anchor = ctx.saved_tensors
                return anchor.new_zeros(d.shape), None, None, None, None
            return None, None, None, None, None
        if ctx.act.kind not in _TWO_VALUED:
            _refuse_double_backward(f"reprop.fad.{ctx.act.kind}", _ACTIVATION_INSTEAD)
        d, *anchor = ctx.saved_tensors
        coded = d.dtype == torch.uint8
        grad_x = (_backward_code8(ctx.act, grad, d) if coded
                  else _in_dtype(_times_saved(grad, d, grad.dtype), grad.dtype))
        if ctx.act.kind in _SELECTS:  # torch's backward selects 0 there, even from an inf or NaN grad
            grad_x = grad_x.masked_fill_(_selected(ctx.act, d, coded), 0)
        if anchor and torch.is_grad_enabled():
            grad_x = _twice_differentiable(grad_x, anchor[0])
        return grad_x, None, None, None, None


def _hook_of_one_output(hook: Callable, pre: bool) -> Callable:
    """`hook`, a pre-hook (pre) or post-hook on the node of a _TWO_VALUED
    kind, as it runs on torch's node, which has one output and one input: it
    sees grad_outputs without the anchor's (None), and grad_inputs without
    the None of _anchor_link's input, and its replacement of the one
    gradient gets those appended, its count checked as torch checks it
    (the node's two would take two). Not called where the node runs for
    the anchor's gradient alone (double backward, _twice_differentiable):
    torch's node does not run there."""

    def of_one_output(*args):
        grad_outputs = args[-1] if pre else args[1]
        if grad_outputs[0] is None and grad_outputs[1] is not None:
            # the anchor's alone: torch's node, which has no anchor, does not
            # run in that backward, so its hooks do not fire; a pre-hook
            # (g * 3,) got (None,) and raised TypeError where torch trains
            return None
        if pre:
            return _one_replaced(hook, hook(grad_outputs[:1]), grad_outputs)
        grad_inputs = args[0]
        return _one_replaced(hook, hook(grad_inputs[:1], grad_outputs[:1]), grad_inputs)

    if hasattr(hook, "__name__"):
        return functools.wraps(hook)(of_one_output)
    # torch names a hook by its __name__, and one without (a functools.partial,
    # a callable object) '<unknown>' in its errors: so does a partial
    return functools.partial(of_one_output)


def _one_replaced(hook: Callable, replaced, grads: tuple):
    """A hook's replacement `replaced` of the first of the node's `grads`,
    the rest (the anchor's, _anchor_link's) appended, its count checked
    with torch's message. Anything but a tuple (None, a list) goes to torch
    as it is: torch takes None, and refuses the rest with its own error
    ("expected tuple, but hook returned 'list'"), as on its own node."""
    if not isinstance(replaced, tuple):
        return replaced
    if len(replaced) != 1:
        raise RuntimeError(f"hook '{getattr(hook, '__name__', '<unknown>')}' has returned an "
                           f"incorrect number of values (got {len(replaced)}, but expected 1)")
    return (*replaced, *grads[1:])


def _registering_one_output(register: Callable, pre: bool) -> Callable:
    """_Activation's node's register_prehook / register_hook: a _TWO_VALUED
    kind's node has a second, empty output (the anchor), so without this a
    hook on y.grad_fn saw two grad_outputs where torch's LeakyReLU node has
    one, and a pre-hook returning its replacement as torch's takes it,
    `(g * 3,)`, raised "incorrect number of values (got 1, but expected 2)"."""

    @functools.wraps(register)
    def registered(node, hook):
        if node.act.kind in _TWO_VALUED:
            hook = _hook_of_one_output(hook, pre)
        return register(node, hook)

    return registered


for _name, _pre in (("register_prehook", True), ("register_hook", False)):
    setattr(_Activation._backward_cls, _name,
            _registering_one_output(getattr(_Activation._backward_cls, _name), _pre))
del _name, _pre


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t.to(dtype), without the call where t has that dtype: .to returns t
    itself then, after about 1.3 us of argument parsing."""
    return t if t.dtype is dtype else t.to(dtype)


def _twice_differentiable(grad_x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """grad_x under create_graph=True for a kind whose f' is piecewise
    constant (_TWO_VALUED): grad * f'(x) is then the whole backward, and its
    derivative with respect to x is 0. torch's leaky_relu double backward
    links that 0 to x, so a parameter reached only through the activation's
    mask (the bias before it, in a gradient penalty) gets a zero gradient,
    not None (.grad left None: an optimizer then skips its momentum and
    weight decay). The anchor, an empty output of the activation's node
    saved for backward, makes that link without keeping x: subtracting its
    sum (+0, which leaves every value and zero sign as it is) leads the
    second backward through the node to x. Under a saved-tensor hook the
    anchor is _anchor_link's instead."""
    return grad_x - anchor.sum()


def _anchor_link(x: torch.Tensor) -> torch.Tensor | None:
    """What an _Activation of a _TWO_VALUED kind saves in place of its anchor
    under a saved-tensor hook (_saved_tensor_hooks_active): an empty tensor
    computed from x, whose graph (a clone of an empty view: neither node
    keeps x's data) links the second backward to x as the anchor does. The
    anchor, the node's own output, packed by a hook that returns it as it
    is (save_on_cpu's on the CPU), held the node: a cycle through
    autograd's C++ that gc cannot see, broken only by the node's backward,
    so a graph dropped without one kept its derivative (x's size) for
    good. (Not _unlinked's detached alias: that loses the link, and a
    parameter reached only through the mask got None in a gradient
    penalty, where torch gives zeros.) None without a hook: the anchor
    costs nothing there."""
    if not _saved_tensor_hooks_active():
        return None
    return x.as_strided((0,), (1,)).clone()


def _selected(act: _Act, d: torch.Tensor, coded: bool) -> torch.Tensor:
    """Where torch's backward of a select kind gives 0 whatever the incoming
    gradient: where f' is 0, except Hardswish's x = -1.5, whose +0 the kernel
    tells from the -0 it stores below -3 (8-bit codes have one zero)."""
    if coded:
        return d == _zero_code(act)
    if act.kind == "hardswish":
        return (d == 0) & torch.signbit(d)
    return d == 0


# ---------------------------------------------------------------------------
# Autocast: run at the dtype torch's own op would
# ---------------------------------------------------------------------------


def _autocast_target(native: Callable, x: torch.Tensor) -> torch.dtype:
    """The dtype native(x) computes in under the current autocast state (some
    activations, e.g. softplus on CUDA, are on autocast's float32 list), found
    by running native on an empty tensor (past every torch function mode:
    an enabled() around this one would hand it to reprop)."""
    with torch._C.DisableTorchFunction():
        return native(torch.empty(0, dtype=x.dtype, device=x.device)).dtype


def _activation(act: _Act | None, native: Callable, x: torch.Tensor, saved_dtype, inplace: bool,
                fname: str) -> torch.Tensor:
    """y = f(x) through the kernels, or through torch's `native` for what they
    cannot take: act None (parameters, _kernel_act), and x _for_torch picks.
    While _capture is on: (y, f'(x)), or None where torch's op would run."""
    if saved_dtype is not None:  # (None, the default, passes both checks)
        _check_saved_dtype(saved_dtype, fname)
        if act is not None:
            _check_codable(act, saved_dtype, fname)
    if act is None or _for_torch(x):
        if _capture.on:
            return None
        return native(x, inplace=True) if inplace else native(x)
    _check_input(x, fname)
    if _any_autocast() and _tensors.autocast_enabled(x.device.type):
        target = _autocast_target(native, x)
        if target != x.dtype:
            x, inplace = x.to(target), False
    if inplace:
        _tensors.check_writable(x, fname)
    if _capture.on:
        return _run_forward(act, x, _default_saved(act, x.dtype), False)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _run_forward(act, x, None, inplace)[0]  # nothing to save: no derivative at all
    if inplace and _may_be_refused_in_place(x):
        return native(x, inplace=True)  # torch refuses before writing, or runs it
    saved = saved_dtype or _default_saved(act, x.dtype)
    if act.kind not in _TWO_VALUED:
        return _Activation.apply(x, act, saved, inplace)
    return _Activation.apply(x, act, saved, inplace, _anchor_link(x))[0]  # (y, its anchor)


# Whether autocast is on for any device: one call, where x.device (for one
# device's check) costs 0.3 us
_any_autocast = torch._C._is_any_autocast_enabled


def _for_torch(x) -> bool:
    """Whether an activation hands x to torch's op: any x in code that
    torch.compile traces (dynamo cannot trace the kernels, and broke the
    graph at each activation, as enabled() runs torch's ops there), float64, complex,
    integer or bool x (torch's result, promoted, or torch's own refusal),
    a non-strided layout (sparse, mkldnn: torch has kernels for some, ours
    walk dense memory; torch's refusal for the rest), what _torch_runs
    gives torch (batched x, ...), and a tensor-like that is no tensor (an
    FX Proxy: torch.fx.symbolic_trace traces into the patched modules,
    whose class is not torch's, so torch's op records itself in the
    graph). Anything else must be a tensor the kernels take (_check_input)."""
    if _compiling():
        return True
    if not isinstance(x, torch.Tensor):
        return torch.overrides.is_tensor_like(x)
    dtype = x.dtype  # (one read for both: each costs 50 ns on the tensor)
    return (dtype in _TORCH_DTYPES or not dtype.is_floating_point
            or x.layout is not torch.strided or _torch_runs(x))


# Bound once: _for_torch and _torch_runs run at every activation call and chain step
_compiling = _tensors.compiling
_transform_active = _tensors.transform_active
_torch_only = _tensors.torch_only


def _default_saved(act: _Act, dtype: torch.dtype) -> torch.dtype:
    """How d is stored for saved_dtype=None: in x's dtype, but in float32 for
    float16 x where f' can pass float16's largest number, 65504 (CELU with
    alpha < 0: exp(x / alpha), unbounded; ELU's |alpha| e^x and LeakyReLU's
    slope above it): d would be inf, and grad * d inf or NaN where torch's
    backward, which multiplies in float32 and rounds once, is finite. The
    other kinds' |f'| stays below 1.76. Decided from the parameters alone.
    A small f' stays float16: below 6.1e-5 (float16's normal numbers) with
    fewer bits, below 3e-8 as 0, so the gradient there is 0 (NaN from an
    inf one) where torch's, from an f' in float32, is not. Every kind but
    Hardswish, Hardsigmoid and LeakyReLU has such tails, and float32 for
    them would double the bytes, bfloat16 drop 3 bits everywhere (README)."""
    if dtype is not torch.float16:
        return dtype
    unbounded = act.kind == "celu" and act.p0 < 0
    large = act.kind in ("elu", "leaky_relu") and abs(act.p0) > _FLOAT16_MAX
    return torch.float32 if unbounded or large else dtype


_FLOAT16_MAX = torch.finfo(torch.float16).max
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _kernel_act(kind: str, *params) -> _Act | None:
    """The kernels' _Act for `kind` with `params`, or None where they cannot
    take them and torch's op runs instead, as the user called it: it computes
    with an inf or NaN parameter (Softplus's threshold=inf: never linear) and
    raises its own errors, which name the argument: a TypeError for what is
    not a number, a RuntimeError for a number float32 cannot hold (CELU's
    alpha = 0 included, whose 1 / alpha its kernel multiplies by)."""
    for p in params:  # (a float skips the ABC check; NaN fails the range test)
        if not (type(p) is float or isinstance(p, numbers.Real)) \
                or not -_FLOAT32_MAX <= p <= _FLOAT32_MAX:
            return None
    act = _Act(kind, *map(float, params))
    if kind == "celu" and not (act.p0 and abs(1 / act.p0) <= _FLOAT32_MAX):
        return None
    return act


def _may_be_refused_in_place(x: torch.Tensor) -> bool:
    """Whether autograd may refuse an in-place write to x, which requires grad:
    a leaf (a Parameter, or a view made under no_grad) or a view (of a leaf,
    one of unbind's outputs, ...). torch checks before it writes; the kernels
    would write first, as autograd checks a Function's mark_dirty only after
    its forward returned. torch's op runs every view, rather than this
    reading each view's creation record: a view of a non-leaf, which
    autograd allows, then saves what torch's op saves."""
    return x.is_leaf or x._is_view()


# ---------------------------------------------------------------------------
# Functions, with torch.nn.functional's signatures
# ---------------------------------------------------------------------------

_SAVES = """Saves only f'(x) for backward, in ``saved_dtype`` (None: x's dtype, or
    float32 for float16 x where the parameters let f' pass 65504; or
    torch.float32, torch.bfloat16, torch.float16, or torch.uint8 for 8-bit codes).
    x: float32, float16 or bfloat16, on cpu or cuda, any shape and layout; the
    result has x's dtype, shape and (dense) layout. float64 x (the kernels
    compute in float32) and sparse or mkldnn x run torch's own op, saving
    what it saves."""


def _doc(fn):
    fn.__doc__ = fn.__doc__.replace("{saves}", _SAVES)
    return fn


def _plain(kind: str, native: Callable, inplace: bool, summary: str) -> Callable:
    """The reprop.fad function `kind` of an activation without parameters, with
    the signature of torch's `native`: (input, inplace=False, *, saved_dtype=None)
    where that takes `inplace`, else (input, *, saved_dtype=None)."""
    act = _Act(kind)
    if inplace:
        def fn(input: torch.Tensor, inplace: bool = False, *, saved_dtype=None) -> torch.Tensor:
            return _activation(act, native, input, saved_dtype, inplace, kind)
    else:
        def fn(input: torch.Tensor, *, saved_dtype=None) -> torch.Tensor:
            return _activation(act, native, input, saved_dtype, False, kind)
    # Named as a module-level def: pickling (patch()'s partials) finds reprop.fad.<kind>.
    fn.__name__ = fn.__qualname__ = kind
    fn.__doc__ = f"{summary}\n\n    {_SAVES}"
    return fn


# gelu's approximate -> its kernel; torch's gelu refuses any other
_GELU_ACTS = {"none": _Act("gelu"), "tanh": _Act("gelu_tanh")}


@_doc
def gelu(input: torch.Tensor, approximate: str = "none", *, saved_dtype=None) -> torch.Tensor:
    """GELU as torch.nn.functional.gelu (approximate "none": erf form, or "tanh").

    {saves}"""
    act = _GELU_ACTS.get(approximate) if isinstance(approximate, str) else None
    return _activation(act, functools.partial(F.gelu, approximate=approximate), input, saved_dtype,
                       False, "gelu")


@_doc
def softplus(input: torch.Tensor, beta: float = 1.0, threshold: float = 20.0, *,
             saved_dtype=None) -> torch.Tensor:
    """Softplus, log1p(exp(beta x)) / beta (x where beta x > threshold), as
    torch.nn.functional.softplus.

    {saves}"""
    return _activation(_kernel_act("softplus", beta, threshold),
                       functools.partial(F.softplus, beta=beta, threshold=threshold),
                       input, saved_dtype, False, "softplus")


@_doc
def elu(input: torch.Tensor, alpha: float = 1.0, inplace: bool = False, *,
        saved_dtype=None) -> torch.Tensor:
    """ELU, as torch.nn.functional.elu.

    {saves}"""
    return _activation(_kernel_act("elu", alpha), functools.partial(F.elu, alpha=alpha), input,
                       saved_dtype, inplace, "elu")


@_doc
def celu(input: torch.Tensor, alpha: float = 1.0, inplace: bool = False, *,
         saved_dtype=None) -> torch.Tensor:
    """CELU, as torch.nn.functional.celu.

    {saves}"""
    return _activation(_kernel_act("celu", alpha), functools.partial(F.celu, alpha=alpha), input,
                       saved_dtype, inplace, "celu")


@_doc
def leaky_relu(input: torch.Tensor, negative_slope: float = 0.01, inplace: bool = False, *,
               saved_dtype=None) -> torch.Tensor:
    """LeakyReLU, as torch.nn.functional.leaky_relu.

    {saves}"""
    return _activation(_kernel_act("leaky_relu", negative_slope),
                       functools.partial(F.leaky_relu, negative_slope=negative_slope), input,
                       saved_dtype, inplace, "leaky_relu")


# Activations without parameters: their functions differ only in name and torch op.
silu = _plain("silu", F.silu, inplace=True,
              summary="SiLU / Swish, x * sigmoid(x), as torch.nn.functional.silu.")
mish = _plain("mish", F.mish, inplace=True,
              summary="Mish, x * tanh(softplus(x)), as torch.nn.functional.mish.")
sigmoid = _plain("sigmoid", torch.sigmoid, inplace=False, summary="Sigmoid, as torch.sigmoid.")
tanh = _plain("tanh", torch.tanh, inplace=False, summary="Tanh, as torch.tanh.")
selu = _plain("selu", F.selu, inplace=True, summary="SELU, as torch.nn.functional.selu.")
hardswish = _plain("hardswish", F.hardswish, inplace=True,
                   summary="Hardswish, as torch.nn.functional.hardswish.")
hardsigmoid = _plain("hardsigmoid", F.hardsigmoid, inplace=True,
                     summary="Hardsigmoid, as torch.nn.functional.hardsigmoid.")
logsigmoid = _plain("logsigmoid", F.logsigmoid, inplace=False,
                    summary="LogSigmoid, as torch.nn.functional.logsigmoid.")
softsign = _plain("softsign", F.softsign, inplace=False,
                  summary="Softsign, x / (1 + |x|), as torch.nn.functional.softsign.")
tanhshrink = _plain("tanhshrink", F.tanhshrink, inplace=False,
                    summary="Tanhshrink, x - tanh(x), as torch.nn.functional.tanhshrink.")


# ---------------------------------------------------------------------------
# Modules: torch's, with forward through reprop (isinstance and state_dict unchanged)
# ---------------------------------------------------------------------------


class _SavedDtypeMixin:
    """saved_dtype as a module attribute, shown in repr when set."""

    saved_dtype = None

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first; without it, it fails compiling our
        # forward with "Expected a single top-level function". Swapping in
        # torch's class here would unpatch the caller's model in place.
        name = type(self).__name__
        # unpatch() restores only the modules patch() swapped (their record)
        instead = ("call reprop.fad.unpatch(model) first" if _PATCHED in self.__dict__
                   else f"use torch.nn.{name} in its place")
        raise RuntimeError(f"torch.jit.script: reprop.fad.{name} runs reprop's kernels from "
                           f"Python and cannot be scripted; {instead}, or use torch.jit.trace "
                           "(which records torch's own ops)")

    def extra_repr(self) -> str:
        base = super().extra_repr()
        if self.saved_dtype is None:
            return base
        return f"{base}, saved_dtype={self.saved_dtype}" if base else f"saved_dtype={self.saved_dtype}"


# Like torch's Sigmoid and Tanh (_OUTPUT_SAVED below), torch's in-place ELU,
# CELU, SELU and LeakyReLU (elu_, leaky_relu_) save only their output, the
# storage the next layer saves: f'(x) would add a tensor (16.9 MiB against 32.9
# for a Conv-ELU-Conv), so patch() and enabled()'s rerouting hand such calls
# to torch. Not with a negative alpha or slope, whose in-place backward torch
# refuses (it recovers f' from the output, ambiguous then): FAD's, from x,
# trains there. Each with the parameter that decides it and its position, and
# inplace's position (the parameter None: SELU's, fixed and positive). Keyed
# by the function's name: one from before importlib.reload (IPython's
# %autoreload 2), which a swapped module's class or the partial on a function
# attribute still calls, must find its entry.
_OUTPUT_SAVED_IN_PLACE = {"elu": ("alpha", 1, 2), "celu": ("alpha", 1, 2), "selu": (None, None, 1),
                          "leaky_relu": ("negative_slope", 1, 2)}


def _attribute_tuple(names: tuple[str, ...]) -> Callable:
    """obj -> the tuple of obj's attributes `names` (no activation module
    has more than two), without the generator of getattr that cost each
    call of a patched module 0.4 us; plain getattr, which dynamo traces
    (it breaks the graph at operator.attrgetter's)."""
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        (first,) = names
        return lambda obj: (getattr(obj, first),)
    first, second = names
    return lambda obj: (getattr(obj, first), getattr(obj, second))


def _module(torch_cls, fn: Callable, params: tuple[str, ...]):
    """reprop's version of torch_cls: same constructor (plus a keyword saved_dtype),
    same attributes, forward through fn(input, *those attributes named in params),
    or, on a module patch() swapped, torch_cls's forward where _left_to_torch
    or where a library has replaced that forward since (_forward_replaced)."""
    torchs = torch_cls.forward if _tensors.forward_is_torchs(torch_cls) else None
    attributes = _attribute_tuple(params)
    # whether _left_to_torch can hand a call to torch: fn is keyed there (by its name, fixed)
    may_be_left = fn.__name__ in _OUTPUT_SAVED_IN_PLACE

    def __init__(self, *args, saved_dtype=None, **kwargs):
        torch_cls.__init__(self, *args, **kwargs)
        _check_saved_dtype(saved_dtype, torch_cls.__name__)
        self.saved_dtype = saved_dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        args = (input, *attributes(self))
        if _PATCHED in self.__dict__ and (_forward_replaced(torch_cls, torchs) or (
                may_be_left and _left_to_torch(fn, args, {}))):
            return torch_cls.forward(self, input)
        return fn(*args, saved_dtype=self.saved_dtype)

    name = torch_cls.__name__
    return type(name, (_SavedDtypeMixin, torch_cls),
                {"__init__": __init__, "forward": forward, "__module__": __name__,
                 "__doc__": f"{name} (torch.nn.{name} saving only f'(x); see reprop.fad)"})


def _forward_replaced(torch_cls: type, torchs) -> bool:
    """Whether a library has replaced torch_cls.forward (nn.GELU.forward =
    ...) since `torchs`, torch's own as reprop's class for it was made (None:
    it was not torch's then). Every torch module of the class then computes
    what the new forward says, so a module patch() swapped before it must
    too: reprop's forward computed torch's activation in its place (patch()
    leaves the modules of a class already replaced: _kept_forward). The
    identity check first: this runs at every call of a patched module."""
    return torch_cls.forward is not torchs and not _tensors.forward_is_torchs(torch_cls)


GELU = _module(nn.GELU, gelu, ("approximate",))
SiLU = _module(nn.SiLU, silu, ("inplace",))
Mish = _module(nn.Mish, mish, ("inplace",))
Softplus = _module(nn.Softplus, softplus, ("beta", "threshold"))
Sigmoid = _module(nn.Sigmoid, sigmoid, ())
Tanh = _module(nn.Tanh, tanh, ())
ELU = _module(nn.ELU, elu, ("alpha", "inplace"))
CELU = _module(nn.CELU, celu, ("alpha", "inplace"))
SELU = _module(nn.SELU, selu, ("inplace",))
LeakyReLU = _module(nn.LeakyReLU, leaky_relu, ("negative_slope", "inplace"))
Hardswish = _module(nn.Hardswish, hardswish, ("inplace",))
Hardsigmoid = _module(nn.Hardsigmoid, hardsigmoid, ("inplace",))
LogSigmoid = _module(nn.LogSigmoid, logsigmoid, ())
Softsign = _module(nn.Softsign, softsign, ())
Tanhshrink = _module(nn.Tanhshrink, tanhshrink, ())

_MODULES = {cls.__mro__[2]: cls for cls in (GELU, SiLU, Mish, Softplus, Sigmoid, Tanh, ELU, CELU,
                                             SELU, LeakyReLU, Hardswish, Hardsigmoid, LogSigmoid,
                                             Softsign, Tanhshrink)}

# torch's functional activations -> reprop's (function attributes such as
# nn.TransformerEncoderLayer.activation, and enabled()'s rerouting)
_FUNCTIONS = {
    F.gelu: gelu, F.silu: silu, F.mish: mish, F.softplus: softplus, torch.sigmoid: sigmoid,
    torch.Tensor.sigmoid: sigmoid, F.sigmoid: sigmoid, torch.special.expit: sigmoid,
    torch.tanh: tanh, torch.Tensor.tanh: tanh, F.tanh: tanh, F.elu: elu, F.celu: celu,
    torch.celu: celu, F.selu: selu, torch.selu: selu, F.leaky_relu: leaky_relu,
    F.hardswish: hardswish, F.hardsigmoid: hardsigmoid, F.logsigmoid: logsigmoid,
    F.softsign: softsign, F.tanhshrink: tanhshrink,
}
# torch's Sigmoid and Tanh save their output, which the next layer usually
# saves anyway (as its input), so f'(x) would be one tensor more, not one less:
# patch() and enabled()'s rerouting leave them to torch. reprop.fad.sigmoid /
# tanh, their modules and the chains of compose=True still take them.
_OUTPUT_SAVED = (sigmoid, tanh)
_REROUTED = {f: ours for f, ours in _FUNCTIONS.items() if ours not in _OUTPUT_SAVED}
_PATCHED_MODULES = {native: ours for native, ours in _MODULES.items()
                    if native not in (nn.Sigmoid, nn.Tanh)}


def _left_to_torch(ours, args, kwargs) -> bool:
    """Whether a rerouted call ours(*args, **kwargs) (a patched module or
    function attribute, enabled()) runs torch's op instead: an in-place one
    of _OUTPUT_SAVED_IN_PLACE with a parameter torch takes in place. Read
    off the arguments' positions, not a bound signature: this runs at every
    call of these activations (binding one cost 10 us)."""
    spec = _OUTPUT_SAVED_IN_PLACE.get(ours.__name__)
    if spec is None:
        return False
    param, at, inplace_at = spec
    if not _argument(ours, args, kwargs, "inplace", inplace_at):
        return False
    if param is None:
        return True
    value = _argument(ours, args, kwargs, param, at)
    return isinstance(value, numbers.Real) and value >= 0


def _argument(fn, args, kwargs, name: str, at: int):
    """The argument `name` (at position `at`) of the call fn(*args, **kwargs),
    or its default."""
    if len(args) > at:
        return args[at]
    return kwargs[name] if name in kwargs else _default(fn, name)


@functools.cache
def _default(fn, name: str):
    return _signature(fn).parameters[name].default


def _reroute(ours, native, /, *args, saved_dtype=None, **kwargs):
    """A call of torch's activation `native` rerouted to `ours` (patch()'s
    function attributes, enabled()): ours, saving f'(x) as saved_dtype, or
    native where _left_to_torch."""
    if _left_to_torch(ours, args, kwargs):
        return native(*args, **kwargs)
    return ours(*args, **kwargs, saved_dtype=saved_dtype)


# ---------------------------------------------------------------------------
# patch / unpatch
# ---------------------------------------------------------------------------

_PATCHED = "_reprop_fad_patched"  # on a swapped module: its original class
_PATCHED_FNS = "_reprop_fad_functions"  # on a module: {attribute: _Rerouted} (before: the original)


@_kept_across_reloads
class _Rerouted(NamedTuple):
    """A function attribute patch() rerouted: the function it found there
    and the partial it put in its place. The attribute is still patch()'s
    only while it holds that very partial; anything else is the user's,
    set since."""

    original: Callable
    installed: functools.partial


def patch(model: nn.Module, saved_dtype=None) -> dict[str, str]:
    """Swap, in place, every torch activation module of `model` for reprop's.

    Modules of exactly the torch classes nn.GELU, nn.SiLU, nn.Mish,
    nn.Softplus, nn.ELU, nn.CELU, nn.SELU, nn.LeakyReLU, nn.Hardswish,
    nn.Hardsigmoid, nn.LogSigmoid, nn.Softsign, nn.Tanhshrink change class
    (their attributes, hooks and state stay; they remain instances of the
    torch class), and attributes holding a torch functional activation (e.g.
    nn.TransformerEncoderLayer.activation = F.gelu) are rerouted. Each then
    saves only f'(x) for backward, stored as `saved_dtype`. nn.Sigmoid and
    nn.Tanh stay torch's: they save their output, which the next layer
    usually saves too, so f'(x) would add a tensor; so do in-place calls of
    ELU, CELU, SELU and LeakyReLU (their in-place ops save only the output)
    unless a negative alpha or slope makes torch refuse them (_left_to_torch). Subclasses of those
    classes are left alone: their forward may do more. Calling patch again
    updates saved_dtype (and moves a model patched before
    importlib.reload(reprop.fad) to the reloaded classes and functions,
    which pickling finds by name); a function attribute the user set since
    the last patch is theirs: rerouted if it is a torch activation, else
    left (and unpatch leaves it too). A torch activation module whose forward is
    set on the instance (accelerate's hooks), or whose class's forward a
    library replaced (nn.GELU.forward = ...), is left, with a warning: that
    forward runs in place of torch's (and a module patched before the
    library replaced it runs the replacement: _forward_replaced). Returns
    {qualified name: what changed}.
    """
    _check_model(model, "patch")
    _check_saved_dtype(saved_dtype, "patch")
    changed, left = {}, {}
    for name, module in model.named_modules():
        original = getattr(module, _PATCHED, type(module))
        kept = _kept_forward(module, original) if original in _PATCHED_MODULES else None
        if kept is not None:
            left.setdefault(kept, []).append(name)
        elif original in _PATCHED_MODULES:
            ours = _PATCHED_MODULES[original]
            if type(module) is original or _made_before_a_reload(type(module), ours):
                # recorded before the swap: a re-run after an interrupt between
                # the two finds the class to restore (swapped first, it saw a
                # reprop class it does not patch, and unpatch had no record)
                module.__dict__[_PATCHED] = original
                module.__class__ = ours
            module.saved_dtype = saved_dtype
            changed[name] = f"torch.nn.{original.__name__} -> reprop.fad.{original.__name__}"
        changed.update(_patch_function_attributes(name, module, saved_dtype))
    for why, names in left.items():
        _tensors.warn_at_users_line(f"reprop.fad.patch left these activation modules as torch's: "
                                    f"{', '.join(map(repr, names))}: {why}")
    return changed


def _made_before_a_reload(cls: type, current: type) -> bool:
    """Whether cls is reprop's class `current` as a run of this module before
    importlib.reload (IPython's %autoreload 2) made it: the same module and
    name, another object. patch() moves a module of it to the current one:
    pickling finds a class by its name, so torch.save(model) refused it."""
    return cls is not current and _tensors.class_key(cls) == _tensors.class_key(current)


def _check_model(model, fname: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fname}: model must be a torch.nn.Module, got {type(model).__name__} "
                        "(for a function, call reprop.fad's, e.g. fad.gelu, or use fad.enabled())")


_FORWARD_ON_INSTANCE = ("each has a forward set on the instance (as accelerate's "
                        "add_hook_to_module sets one, calling torch's forward), which runs in "
                        "place of the class's, so swapping the class would change nothing")
_FORWARD_ON_CLASS = ("the forward of their class is no longer torch.nn's (a library set "
                     "another on the class), and reprop's, computing torch's activation, "
                     "would silently run in its place")


def _kept_forward(module: nn.Module, original: type) -> str | None:
    """Why a torch activation module, not swapped yet, keeps the forward it
    runs (patch()'s warning), or None. A forward set on the instance: calls
    find it before the class's, so a swap would change nothing (and patch()
    would report a swap that did nothing). A forward a library set on the
    torch class: the swap would replace what it computes (2 * gelu) with
    torch's activation."""
    if type(module) is not original:
        return None
    return {"instance": _FORWARD_ON_INSTANCE, "class": _FORWARD_ON_CLASS}.get(
        _tensors.replaced_forward(module, original))


def _patch_function_attributes(name: str, module: nn.Module, saved_dtype) -> dict[str, str]:
    changed = {}
    earlier = module.__dict__.get(_PATCHED_FNS, {})
    rerouted = {}
    for attr, value in list(vars(module).items()):
        original = _function_in(_record(earlier.get(attr), value), value)
        ours = _REROUTED.get(original) if _hashable(original) else None
        if ours is None:
            continue
        installed = functools.partial(_reroute, ours, original, saved_dtype=saved_dtype)
        rerouted[attr] = _Rerouted(original, installed)
        # the partial and its record in one dict update, which no interrupt
        # splits: an attribute holding a partial its record does not name is
        # the user's to patch() and unpatch(), so either one alone left it
        # unrestorable (a new partial, or the earlier one over a new record)
        module.__dict__.update({attr: installed, _PATCHED_FNS: {**earlier, **rerouted}})
        changed[f"{name}.{attr}" if name else attr] = (
            f"{getattr(original, '__name__', original)} -> reprop.fad.{ours.__name__}")
    if rerouted:  # earlier entries not rerouted again are stale: dropped
        module.__dict__[_PATCHED_FNS] = rerouted
    else:
        module.__dict__.pop(_PATCHED_FNS, None)
    return changed


def _record(entry, value) -> _Rerouted | None:
    """An earlier patch()'s record of an attribute now holding `value`. A
    model patched (and saved) by reprop before _Rerouted kept the bare
    original function: its partial is the one that wraps that function's
    reroute (None: the record is stale)."""
    if entry is None or isinstance(entry, _Rerouted):
        return entry
    ours = _REROUTED.get(entry) if _hashable(entry) else None
    if ours is not None and isinstance(value, functools.partial) and value.func is ours:
        return _Rerouted(entry, value)
    return None


def _function_in(earlier: _Rerouted | None, value):
    """The function an attribute holding `value` stands for: the one an
    earlier patch() rerouted, while the attribute still holds its partial;
    else value itself, which the user set since (a torch activation is
    rerouted afresh, anything else left as it is)."""
    return earlier.original if earlier is not None and value is earlier.installed else value


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def unpatch(model: nn.Module) -> list[str]:
    """Undo patch(model): restore the torch classes, and the functions of
    attributes that still hold patch()'s partial (one the user set since is
    left). Returns the names restored."""
    _check_model(model, "unpatch")
    restored = []
    for name, module in model.named_modules():
        original = module.__dict__.get(_PATCHED)
        if original is not None:
            module.__class__ = original
            module.__dict__.pop("saved_dtype", None)
            # the record goes last: a re-run after an interrupt finds what is left to restore
            del module.__dict__[_PATCHED]
            restored.append(name)
        for attr, entry in module.__dict__.get(_PATCHED_FNS, {}).items():
            rerouted = _record(entry, module.__dict__.get(attr))
            if rerouted is not None and module.__dict__.get(attr) is rerouted.installed:  # else the user's
                module.__dict__[attr] = rerouted.original
                restored.append(f"{name}.{attr}" if name else attr)
        # the records go last: a re-run after an interrupt restores the rest
        module.__dict__.pop(_PATCHED_FNS, None)
    return restored


# ---------------------------------------------------------------------------
# 8-bit codebooks
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Codebook:
    """The 8-bit storage of one activation's derivative (csrc/reprop.h, rp_fad_codebook).

    values: float32 (256,), the derivative each code decodes to (grid codes,
    then the exact-slope code, then NaN); lo, hi: the derivative range the grid
    covers; step: grid spacing; max_error: the largest error of a decoded
    derivative (half a step; 0 on the exact pieces, and 0 for LeakyReLU and
    Hardsigmoid, whose two values sit on their grid, unless LeakyReLU's
    slope is subnormal, below 2^-126, float32's smallest normal number: it
    decodes to 0 or 2^-126)."""

    values: np.ndarray
    lo: float
    hi: float
    step: float
    max_error: float


# The parameters of reprop.fad's functions, in signature order, at their defaults.
# Kinds whose derivative takes two values, 0 and v (csrc/fad.c, rp_fad_two_valued);
# being piecewise constant, they can be differentiated twice (_Activation).
_TWO_VALUED = ("leaky_relu", "hardsigmoid")
_DEFAULT_PARAMS = {"softplus": (1.0, 20.0), "elu": (1.0,), "celu": (1.0,), "leaky_relu": (0.01,)}
_PARAM_NAMES = {"softplus": ("beta", "threshold"), "elu": ("alpha",), "celu": ("alpha",),
                "leaky_relu": ("negative_slope",)}


def codebook(activation: str, *params: float) -> Codebook:
    """The codebook torch.uint8 storage uses for `activation` (a name of
    reprop.fad's functions; "gelu_tanh" for approximate GELU) with its
    parameters in signature order (softplus: beta, threshold; elu, celu: alpha;
    leaky_relu: negative_slope); those left out take the functions' defaults."""
    if activation not in _KIND:
        raise ValueError(f"codebook: unknown activation {activation!r}; known: {', '.join(_KINDS)}")
    defaults = _DEFAULT_PARAMS.get(activation, ())
    if len(params) > len(defaults):
        raise ValueError(f"codebook: {activation} takes at most {len(defaults)} parameters, got {len(params)}")
    act = _codebook_act(activation, params + defaults[len(params):])
    _check_codable(act, torch.uint8, "codebook")
    raw = _codebook_bytes(act)
    values = np.frombuffer(raw, dtype=np.float32, count=256).copy()
    zero = _zero_code(act)
    lo, hi = np.frombuffer(raw, dtype=np.float32, count=2, offset=1032)
    # values[c] = (c - zero) * step exactly; the grid may end at 0 (ELU with
    # alpha < 0), so step is read from its first two codes, not from above 0
    step = values[1] - values[0]
    max_error = step / 2
    if activation in _TWO_VALUED:
        # f' on the grid is 0 or v, the range's other end (LeakyReLU's 1 has
        # the exact code); the grid's step is |v| unless v is subnormal
        # (its step is then FLT_MIN), so v decodes to its nearest grid value.
        v = lo if lo < 0 else hi
        max_error = abs(values[zero + int(np.rint(v / step))] - v)
    return Codebook(values, float(lo), float(hi), float(step), float(max_error))


def _codebook_act(activation: str, params: tuple) -> _Act:
    """The _Act of `activation` with `params`, refusing, by the parameter's
    name and value as given, those the functions hand to torch's op
    (_kernel_act): they have no codebook (the kernels' own check saw the
    float32-rounded value, without the name)."""
    for name, p in zip(_PARAM_NAMES.get(activation, ()), params):
        if not isinstance(p, numbers.Real):  # a TypeError, as torch's ops raise for one
            raise _tensors.NotANumberError(f"codebook: {activation}'s {name} must be a number, "
                                           f"got {p!r}")
        if _kernel_act(activation, p) is None:
            extra = ", with 1 / alpha in it too (so not 0)" if activation == "celu" else ""
            raise ValueError(f"codebook: {activation}'s {name} must be a finite number in "
                             f"float32's range{extra}, got {p!r}")
    return _kernel_act(activation, *params)


# ---------------------------------------------------------------------------
# enabled(): rerouting, and the run-time state machine over element-wise chains
# ---------------------------------------------------------------------------
#
# The paper's forward states over tensor-operator pairs (Section IV-A), here:
#   NN  an op outside the tables below, or on inputs that are not one chain:
#       plain torch, plain autograd;
#   NY  an element-wise op on a root (a tensor that requires grad and is not a
#       chain tensor): its output becomes a chain tensor rooted there;
#   YY  an element-wise op whose tensor operands all belong to one root (chain
#       tensors of it, or the root itself) and constants: the output's
#       derivative with respect to the root is carried forward (FAD);
#   YN  a chain tensor consumed by anything else: it already has its own
#       autograd node, which saves only its derivative and points straight at
#       the root, so nothing has to be rebuilt (the post-process of Fig. 6 only
#       drops a derivative carried at higher precision than its node saved:
#       above saved_dtype, or float32 for a float16 chain).
# Every chain tensor's node holds one derivative (and, past a select that
# blocks its path, the bool mask of _Record, which the derivative cannot stand
# in for: a 0 there is +0 blocked, the gradient times 0 unblocked);
# intermediates die with the Python temporaries that held them, so a finished
# chain keeps one tensor (or that and its mask), plus a small _Passed per step
# (what each step's node led past, for the hook refusals).


# What _Chain refuses double backward for, as the README's fad section states
# it: a lone abs or leaky_relu has a derivative that does not vary, and is
# refused all the same (autograd links a select's mask to the root)
_VARYING_CHAIN = ("a reprop.fad chain of element-wise ops (enabled(compose=True)) other than one "
                  "relu of its root (nn.ReLU between two layers) or a chain of additions, "
                  "subtractions, negations and products with or divisions by constants, "
                  "such as one through exp, sigmoid, GELU, a power, a product of two chain "
                  "tensors, or a select (abs, leaky_relu, hardsigmoid, hardswish, or relu with "
                  "another step: autograd links a select's mask to the root, the chain does not),")
_CHAIN_INSTEAD = ("where higher-order gradients are needed, run that forward with compose=False "
                  "(which still reroutes F.gelu, F.silu, ... to reprop's, refusing it too, but "
                  "for leaky_relu and hardsigmoid) or outside reprop.fad.enabled()")


class _Chain(torch.autograd.Function):
    """A chain tensor: value v of an element-wise function of `source`, whose
    backward is grad * dv/dsource (a saved tensor, or a number), except
    where a select blocks the path (_Record), where dv/dsource is the
    gradient itself; relu of the root runs torch's relu backward on its
    saved output. Under create_graph=True, relu of the root (torch's own
    backward) and a chain whose dv/dsource is a constant (step.constant:
    grad * dv/dsource is then autograd's graph) are differentiated as
    autograd's; any other refuses it, having kept no second derivative.
    That takes in a select past the first step (torch.relu(h) * 2): its
    second derivative is 0, but autograd links its mask to the source,
    so torch's gradient of a parameter reached only through it is zeros
    where the chain's would be None."""

    @staticmethod
    def forward(ctx, source, step):
        value, deriv, blocked = step.compute()
        ctx.source_dtype = source.dtype
        ctx.materialize_grads = False  # None stays None, as on torch's nodes (_Activation.forward)
        ctx.hooked = False  # (_tensors.note_node_hooks)
        ctx.led_past = False  # (_lead_past)
        ctx.passed = step.passed
        ctx.constant = step.constant
        ctx.relu = deriv is _RELU_OF_SELF
        if ctx.relu:  # torch's relu node: saves the output, which the next op usually saves too
            ctx.save_for_backward(value)
            # (None: no record, so a next step takes value for a root, _chain_step)
            step.result = (None if _saved_tensor_hooks_active() else deriv, deriv, blocked)
            return value
        kept = step.mode._stored(deriv, value.dtype)
        # a _WhereZero mask is found again from kept in backward, not saved
        ctx.where_zero = blocked if isinstance(blocked, _WhereZero) else None
        mask = None if ctx.where_zero is not None else blocked
        if isinstance(kept, torch.Tensor):
            ctx.save_for_backward(_unlinked(kept, value), mask)
            ctx.number = None
        else:
            ctx.save_for_backward(mask)
            ctx.number = kept
        step.result = (deriv, kept, blocked)
        return value

    @staticmethod
    def backward(ctx, grad):
        if grad is None:  # (materialize_grads off): torch's nodes give None
            return None, None
        if not (ctx.relu or ctx.constant):
            _refuse_double_backward(_VARYING_CHAIN, _CHAIN_INSTEAD)
        _refuse_retained_past(ctx.passed)
        if ctx.relu:
            (out,) = ctx.saved_tensors
            return torch.ops.aten.threshold_backward(grad, out, 0).to(ctx.source_dtype), None
        *kept, blocked = ctx.saved_tensors
        d = kept[0] if ctx.number is None else ctx.number
        grad_source = _times_saved(grad, d, ctx.source_dtype)
        if blocked is not None:  # a select on the way: d is the gradient there, whatever grad holds
            grad_source = torch.where(blocked, d, grad_source)
        if ctx.where_zero is not None:  # the root's select: +0, where d has a 0 of either sign
            grad_source.masked_fill_(ctx.where_zero.of(d), 0)
        return _in_dtype(grad_source, ctx.source_dtype), None


def _saved_tensor_hooks_active() -> bool:
    """Whether a saved_tensors_hooks context (save_on_cpu among them) packs
    what a node saves now. What its pack returns may hold the tensor itself
    (save_on_cpu's pack on a CPU tensor: (device, tensor.cpu()), the same
    tensor), and for a node's own output that holds the node (the output's
    grad_fn): a cycle through autograd's C++ that gc cannot see, broken only
    when the node's backward releases what it saved. A chain node a next
    step leads past never runs backward, so it kept its output alive for
    good: one relu output per training step (torch.relu(h) * 2)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _unlinked(kept: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The tensor a chain node saves for its derivative `kept`: where that
    is the node's output `value` (exp of the root) under a saved-tensor hook,
    a detached alias of it, which holds no node (_saved_tensor_hooks_active);
    its double backward is refused anyway, so no link to the node is lost."""
    if kept is value and _saved_tensor_hooks_active():
        return value.detach()
    return kept


def _refuse_led_past(node, register: str) -> None:
    """A hook on a chain node that a next step already led past is refused
    (_led_past_error)."""
    if node.led_past:
        raise _led_past_error(f"grad_fn.{register}()")


def _refusing_led_past(register_dict):
    """A chain node's _register_hook_dict, which Tensor.register_hook calls
    (once, when it makes the tensor's hook dict), refused on a node a next
    step already led past (_led_past_error)."""

    @functools.wraps(register_dict)
    def checked(node, tensor):
        if node.led_past:
            # Tensor.register_hook made the dict before asking: left there, its
            # next call would add the hook to it without asking again
            tensor._backward_hooks = None
            raise _led_past_error("register_hook()")
        return register_dict(node, tensor)

    return checked


def _refusing_led_past_multi(register_multi):
    """torch.autograd.graph.register_multi_grad_hook, refused before it
    registers anything when one of its tensors is a chain tensor a next step
    led past (_led_past_error): torch registers on each tensor in turn
    (Tensor.register_hook), so the refusal of one left the hooks already made
    on the tensors before it, live (mode="any" ran the function)."""

    @functools.wraps(register_multi)
    def checked(tensors, *args, **kwargs):
        if isinstance(tensors, collections.abc.Iterator):
            # a one-shot iterator (mode="any" takes one): torch gets a copy of what the check read
            tensors, seen = itertools.tee(tensors)
        else:
            seen = tensors
        for i, t in enumerate(seen):
            if _on_a_led_past_node(t):
                raise _led_past_error(f"register_multi_grad_hook() (tensors[{i}])")
        return register_multi(tensors, *args, **kwargs)

    return checked


def _inputs_at(run, torchs_at: int) -> int:
    """Where a call of run, torch's autograd function or another library's
    wrapper of it, takes `inputs` positionally: as run's signature names it,
    or else at torchs_at, torch's own position, which a wrapper passing its
    arguments through (*args, **kwargs, without functools.wraps) keeps.
    Never raises: it is read inside the user's forward (_lead_past)."""
    try:
        params = inspect.signature(run).parameters.values()
    except (TypeError, ValueError):  # a callable with no signature to read
        return torchs_at
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index("inputs") if "inputs" in positional else torchs_at


def _refusing_led_past_inputs(run, name: str, torchs_at: int):
    """run, torch.autograd's function `name` (grad or backward, and so
    Tensor.backward, which calls the latter) or a wrapper of it, torch's
    taking `inputs` at position torchs_at (_inputs_at), refused when its
    `inputs` holds a chain tensor a next step led past (_led_past_error):
    that step's node leads straight to the root, so the tensor's node gets
    none of the gradient through it, and torch gave None (allow_unused),
    zeros (materialize_grads) or left .grad None (backward(inputs=)). A call
    without inputs (a plain backward()) goes straight to torch's, one Python
    call later."""
    at = _inputs_at(run, torchs_at)

    @functools.wraps(run)
    def checked(*args, **kwargs):
        positional = len(args) > at
        inputs = args[at] if positional else kwargs.get("inputs")
        if inputs is None:
            return run(*args, **kwargs)
        if isinstance(inputs, collections.abc.Iterator):
            # a one-shot iterator: torch gets the tuple it makes of it, which the check read
            inputs = tuple(inputs)
            if positional:
                args = (*args[:at], inputs, *args[at + 1:])
            else:
                kwargs = {**kwargs, "inputs": inputs}
        for label, t in _inputs_labelled(inputs):
            if _on_a_led_past_node(t):
                raise _led_past_error(f"{name}() ({label})")
        return run(*args, **kwargs)

    return checked


# torch's functions that take hooks or inputs= on any tensor, each with the
# check it gets once a node is led past (_install_led_past_refusals)
_LED_PAST_REFUSALS = ((torch.autograd.graph, "register_multi_grad_hook", _refusing_led_past_multi),
                      (torch.autograd, "grad",
                       functools.partial(_refusing_led_past_inputs, name="grad", torchs_at=1)),
                      (torch.autograd, "backward",
                       functools.partial(_refusing_led_past_inputs, name="backward", torchs_at=5)))
_refusals_installed = False
_REFUSES_LED_PAST = "_reprop_fad_refuses_led_past"  # marks a check (_install_led_past_refusals)


def _install_led_past_refusals() -> None:
    """Replaces torch's functions of _LED_PAST_REFUSALS with their checks, for
    good, not only while a mode is on (a node stays led past after the mode
    exits); calls on other tensors, in any thread, pass straight through to
    torch's (as do autograd calls without inputs=). Done when the first node
    is led past (_lead_past), not at import: until a composed chain exists
    there is nothing to refuse, and importing reprop for its optimizers
    must leave torch's autograd functions as they are."""
    global _refusals_installed
    for owner, name, refusing in _LED_PAST_REFUSALS:
        current = getattr(owner, name)
        # importlib.reload (IPython's %autoreload 2) runs this module again,
        # _refusals_installed False, over torch's functions checked already:
        # the mark (which functools.wraps copies to a wrapper around a check)
        # keeps them from being wrapped once more at each reload
        if not getattr(current, _REFUSES_LED_PAST, False):
            checked = refusing(current)
            setattr(checked, _REFUSES_LED_PAST, True)
            setattr(owner, name, checked)
    _refusals_installed = True


def _on_a_led_past_node(t) -> bool:
    """Whether t, a tensor or a GradientEdge, stands for the output of a chain
    node a next step led past (_lead_past); False for anything else."""
    node = t.node if isinstance(t, GradientEdge) else getattr(t, "grad_fn", None)
    return getattr(node, "led_past", False)


def _inputs_labelled(inputs) -> list:
    """(label, element) of an autograd call's `inputs`, as torch reads them (a
    tensor or GradientEdge, a dict's values, or a sequence); none for what
    torch refuses with its own error (another Mapping, what is no iterable)."""
    if isinstance(inputs, (torch.Tensor, GradientEdge)):
        return [("inputs", inputs)]
    if type(inputs) is dict:
        return [(f"inputs[{key!r}]", t) for key, t in inputs.items()]
    if isinstance(inputs, collections.abc.Iterable) and not isinstance(inputs, collections.abc.Mapping):
        return [(f"inputs[{i}]", t) for i, t in enumerate(inputs)]
    return []


# a hook or pre-hook on a chain node must run: a next step must then reach the
# node through autograd (_root_of), not lead past it to the root
_tensors.note_node_hooks(_Chain, check=_refuse_led_past)
_Chain._backward_cls._register_hook_dict = _refusing_led_past(_Chain._backward_cls._register_hook_dict)
_AUTOGRAD_APPLY = super(torch.autograd.Function, _Chain).apply  # (_chain_step)


def _led_past_error(what: str) -> RuntimeError:
    """A hook, retain_grad() or autograd's inputs= on a chain tensor that a
    next step led past: that step's node goes straight to the root, so the
    gradient through it never reaches the tensor's node (a hook would not
    fire, .grad would stay None and a gradient asked for would be None or
    zeros, or all would see only the gradient of the tensor's other uses)."""
    return RuntimeError(
        f"reprop.fad: {what} on a chain tensor of enabled(compose=True) after a later "
        "element-wise op chained past it: that op's node leads straight to the chain's root, "
        "so this tensor's node does not get the gradient that flows through it (a hook would "
        "not fire, .grad would stay None or partial, its gradient would be None, zeros or "
        "partial). Register the hook or call retain_grad() before the tensor's next op (it then "
        "starts a new chain, which autograd reaches, inputs= too), or leave compose off")


def _refuse_retained_past(passed: _Passed) -> None:
    """retain_grad() on a chain tensor a node led past, called after the mode
    exited: no Python code sees that call (torch's C++ method registers it
    on the tensor's node), so the node that leads past it refuses it when
    it runs. Each level once per backward (_Passed.checked)."""
    task, todo = torch._C._current_graph_task_id(), [passed]
    while todo:
        level = todo.pop()
        if level.checked == task:
            continue
        level.checked = task
        for ref, earlier in level.entries:
            t = ref()
            if t is not None and t.retains_grad:
                raise _led_past_error("retain_grad() (called after the mode exited, found in backward)")
            todo.append(earlier)


class _Step:
    """One element-wise op on a chain: compute() gives (value, d value / d root,
    blocked: see _Record); passed: what its node leads past (_passed);
    constant: whether d value / d root is a constant (_CONSTANT_UNARY)."""

    __slots__ = ("mode", "compute", "passed", "constant", "result")

    def __init__(self, mode, compute, passed, constant):
        self.mode, self.compute, self.passed, self.constant = mode, compute, passed, constant
        self.result = None


class _Record:
    """What the mode knows of a chain tensor: its root (weakly: the chain must
    not keep it alive) and the versions it was made from, dv/droot for the next
    step of the chain, and the copy its node saved; `blocked`, where a
    select-style backward on the way (relu, hardsigmoid, ...) gives +0
    whatever comes from later steps (inf or NaN included), as autograd's
    does (None: nowhere). There the root's gradient is that +0 times the
    steps before the select, which the derivative holds in place of one:
    NaN after an infinite step (sqrt at 0), else a 0 with their sign. The
    mode keeps records in a dictionary weakly keyed by the chain tensor; a
    derivative that is the tensor itself (exp of the root), or is found
    from it (relu of the root: _ReluOutput), is kept as an alias made at
    record time (_as_recorded). A derivative may be a constant operand
    itself (x * c): its version too, so that c changed in place ends the
    chain there, and autograd's version check on the node's saved c raises
    as it would. `blocked` may be a _WhereZero, found from the derivative
    when needed. `constant`: the derivative is a constant (_Step)."""

    __slots__ = ("source", "source_version", "version", "deriv", "deriv_version", "kept",
                 "blocked", "constant")

    def __init__(self, source, out, deriv, kept, blocked, constant):
        self.source = weakref.ref(source)
        self.source_version = source._version
        self.version = out._version
        self.deriv_version = deriv._version if isinstance(deriv, torch.Tensor) else None
        self.deriv = _as_recorded(deriv, out)
        self.kept = self.deriv if kept is deriv else kept
        self.blocked, self.constant = blocked, constant


# The derivative of relu of the root: the node saves relu's output, as torch's
# does (a derivative would be one tensor more than plain autograd when the
# next op saves that output, as a Linear does), and a next step finds the
# derivative from it (_relu_local).
_RELU_OF_SELF = object()


@_kept_across_reloads
class _ReluOutput(NamedTuple):
    """A record's derivative of relu of the root: its output as recorded
    (_as_recorded), from which a next step finds the derivative and the
    blocked positions (_relu_local)."""

    out: torch.Tensor


def _as_recorded(deriv, out: torch.Tensor):
    """The derivative a record keeps for the chain tensor `out`: one that is
    out itself, or found from it, as out.detach(), an alias of the data out
    has now. Not out: the record is the value of a dictionary weakly keyed
    by out, which would never let it go. Not out's data when a next step
    comes: `out.data = ...` swaps that without bumping out's version, while
    the node keeps the output it saved, as torch's exp and relu nodes do."""
    if deriv is out:
        return out.detach()
    if deriv is _RELU_OF_SELF:
        return _ReluOutput(out.detach())
    return deriv


def _relu_local(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(derivative, blocked) of relu from its output, as torch's
    threshold_backward(grad, out, 0) selects: 0 where out <= 0 (a NaN passes)."""
    blocked = out <= 0
    return (~blocked).to(out.dtype), blocked


@_kept_across_reloads
class _WhereZero(NamedTuple):
    """Blocked positions found from a derivative when needed: those of
    Hardsigmoid or Hardswish on the root itself, where its derivative is
    exactly 0 (_selected, as _Activation finds them). A one-step chain then
    saves its derivative alone: a mask beside it made it save more than
    plain autograd (a Linear-Hardswish-Linear: 4.75 MiB against 4.50)."""

    act: _Act

    def of(self, deriv: torch.Tensor) -> torch.Tensor:
        return _selected(self.act, deriv, coded=False)

    def carried(self, deriv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(derivative, blocked) for a next step, the derivative holding the
        root's gradient where blocked (_Record): +0, where Hardswish's
        kernel marks its select with -0 (_plus_zero)."""
        return _plus_zero(deriv) if self.act.kind == "hardswish" else deriv, self.of(deriv)


def _plus_zero(d: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """d with its -0s made +0 and every other value kept, as x + 0 does (a
    twentieth of the time of a masked write, on the CPU)."""
    return d.add_(0.0) if inplace else d + 0.0


class _Operand(NamedTuple):
    """An operand as the chain sees it: its value (tensors detached), its
    derivative with respect to the chain's root (None for the root itself, 0
    for a constant), where that is blocked (_Record), for a chain
    tensor, the tensor itself (not detached), which the step leads past,
    and whether that derivative is a constant (_Step)."""

    value: object
    deriv: object
    blocked: torch.Tensor | None = None
    chain: torch.Tensor | None = None
    constant: bool = True


def _is_zero(d) -> bool:
    return _number(d) and d == 0


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _total(local, operand: _Operand):
    """d(out)/d(operand) * d(operand)/d(root); None stands for the identity.
    Where the operand's path is blocked, d(operand)/d(root) as it is: the
    root's gradient there, which no later step changes (_Record; a product
    would make inf * 0 = NaN)."""
    if _is_zero(operand.deriv):
        return 0
    if operand.deriv is None:
        return local
    total = _product(local, operand.deriv)
    return total if operand.blocked is None else torch.where(operand.blocked, operand.deriv, total)


def _product(local, deriv):
    """local * deriv, at float32 where torch would give float16: a float16 chain
    carries its derivative in float32. torch's backward multiplies the
    gradient by one local derivative at a time (each product computed in
    float32, rounded to float16); their product, carried forward, can leave
    float16's range where the gradient does not (x * 1000, then a square:
    2e6 x, above 65504 for |x| > 0.033; x * 1e-5, then a fourth power: below
    float16's normal numbers). Only the copy a node saves is rounded
    (enabled._stored). bfloat16 has float32's range: its chains carry
    bfloat16, rounding once a step as torch's backward does (in float32 a
    chain's forward took 1.3 to 2.7 times as long on the CPU, and its
    gradient's relative error went from 3.0e-3 to 2.9e-3 only)."""
    if _sets_dtype(local) or _sets_dtype(deriv):
        return local * deriv  # torch promotes a float16 operand on the fly
    return _widened(local) * _widened(deriv)


def _sets_dtype(x) -> bool:
    """A floating tensor with dimensions, not float16: a product has its dtype
    or a wider one (a 0-d tensor's dtype does not count, by torch's promotion)."""
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point \
        and x.dtype is not torch.float16 and x.dim() > 0


def _widened(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype is torch.float16 else x


def _unary_step(name: str, local, a: _Operand):
    """(d out / d root, blocked) of the op `name` on its one operand a, whose
    local derivative is `local`."""
    select = _SELECTS.get(name)
    if select is None:
        return _total(local, a), _blocked([a])
    if a.deriv is None:  # the root: d = local derivative, 0 exactly where it selects
        return local, _WhereZero(_Act(name))
    own = select(a.value)
    # where the op selects, local is +0, and +0 * d(a)/d(root) is the root's
    # gradient (_Record); Hardswish's kernel marks its select with -0 (in
    # its fresh output, rewritten in place)
    if name == "hardswish":
        _plus_zero(local, inplace=True)
    return _total(local, a), _blocked([a], own)


def _blocked(operands, own=None):
    """The output's blocked positions: where every operand on the chain is
    blocked, or where the op's own backward selects 0 (`own`)."""
    on_chain = [o.blocked for o in operands if not _is_zero(o.deriv)]
    common = None if None in on_chain or not on_chain else functools.reduce(torch.logical_and, on_chain)
    if own is None:
        return common
    return own if common is None else common | own


def _reciprocal(b, dtype: torch.dtype):
    """1 / b, the local derivative of x / b, for a tensor or a number (±inf at
    ±0, as torch divides). A tensor divisor is first rounded to `dtype`, the
    result's, as torch's div promotes it (a lower-precision constant is
    promoted before it is inverted; a 0-d CPU tensor, which torch's kernels
    read as a scalar, to at least float32: a float32 70000 stays finite for a
    float16 chain), then inverted as _inverse does."""
    if isinstance(b, torch.Tensor):
        if b.dim() == 0 and b.device.type == "cpu":
            dtype = torch.promote_types(dtype, torch.float32)
        return _inverse(b.to(dtype))
    with np.errstate(divide="ignore"):
        return float(np.reciprocal(np.float64(b)))


def _inverse(t: torch.Tensor) -> torch.Tensor:
    """1 / t, in float32 for float16 t, as a float16 chain carries its
    derivative (_product): 1 / t overflows float16 for |t| < 1.53e-5, where
    torch's backward, dividing the gradient by t in float32 (grad / t of div,
    log, log1p), stays finite. bfloat16, with float32's range, stays bfloat16."""
    return torch.reciprocal(_widened(t))


def _add(a, b):
    return b if _is_zero(a) else a if _is_zero(b) else a + b


# Local derivative rules of unary ops: (input value, output value) -> d out / d input.
_UNARY = {
    "neg": lambda a, v: -1.0,
    "exp": lambda a, v: v,
    "expm1": lambda a, v: v + 1,
    "log": lambda a, v: _inverse(a),
    "log1p": lambda a, v: _inverse(a + 1),
    "sqrt": lambda a, v: 0.5 / v,
    "rsqrt": lambda a, v: -0.5 * v * v * v,
    "reciprocal": lambda a, v: -(v * v),
    "sin": lambda a, v: torch.cos(a),
    "cos": lambda a, v: -torch.sin(a),
    "erf": lambda a, v: (2.0 / math.sqrt(math.pi)) * torch.exp(-(a * a)),
    "square": lambda a, v: 2.0 * a,
    "abs": lambda a, v: torch.sgn(a),
    "relu": lambda a, v: _relu_local(v)[0],
}
# Ops whose backward is a select (threshold_backward, hardsigmoid_backward,
# hardswish_backward): input value -> where they give exactly 0, whatever the
# incoming gradient; f'(x) is 0 exactly there, and elsewhere only at
# hardswish's x = -1.5.
_SELECTS = {
    "relu": lambda a: a <= 0,  # threshold_backward's (a NaN passes)
    "hardsigmoid": lambda a: ~((a > -3) & (a < 3)),
    "hardswish": lambda a: a <= -3,  # torch 2.13 (as csrc/fad_math.h)
}
# Unary ops whose local derivative is a constant: chains of these and
# _constant_binary's ops carry a derivative that holds no function of the
# root (_Chain). Not the selects (relu, abs, leaky_relu, ...), whose
# derivative, 0 wherever it has one, autograd still links to their input.
_CONSTANT_UNARY = ("neg",)
_UNARY_FUNCS = {getattr(owner, name): name for name in _UNARY for owner in (torch, torch.Tensor)
                if hasattr(owner, name)}
_UNARY_FUNCS.update({F.relu: "relu", torch.special.erf: "erf", torch.special.expm1: "expm1"})


# Binary ops: (a, b, value, alpha) -> d out / d root, a and b _Operands.
def _d_add(a, b, v, alpha):
    return _add(_total(1.0, a), _total(alpha, b))


def _d_sub(a, b, v, alpha):
    return _add(_total(1.0, a), _total(-alpha, b))


def _d_rsub(a, b, v, alpha):  # b - alpha * a
    return _add(_total(-alpha, a), _total(1.0, b))


def _d_mul(a, b, v, alpha):
    return _add(_total(b.value, a), _total(a.value, b))


def _d_div(a, b, v, alpha):  # a / b
    inv_b = _reciprocal(b.value, v.dtype)
    return _add(_total(inv_b, a), _total(-v * inv_b, b))


def _d_rdiv(a, b, v, alpha):  # b / a, which torch computes as a.reciprocal() * b
    # b's term: torch's gradient through b is grad * a.reciprocal(), in a's dtype
    d_b = 0 if _is_zero(b.deriv) else _total(torch.reciprocal(a.value), b)
    return _add(_total(-v / a.value, a), d_b)


def _d_pow(a, b, v, alpha):  # a ** b, where only one of them depends on the root
    if not _is_zero(b.deriv):  # a constant base: d/db a^b = a^b ln a, 0 for base 0 and b >= 0 (torch's)
        if _number(a.value) and a.value > 0:
            return _total(v * math.log(a.value), b)
        base = torch.as_tensor(a.value, dtype=v.dtype, device=v.device)
        return _total((v * torch.log(base)).masked_fill((base == 0) & (b.value >= 0), 0), b)
    p = b.value
    if _number(p):  # (not 0: _parse_binary)
        return _total(p * a.value ** (p - 1), a)
    return _total((p * a.value ** (p - 1)).masked_fill(p == 0, 0), a)  # +0 where p == 0: selected


def _pow_selected(rule, b: _Operand, device: torch.device):
    """Where the backward of a ** b through a gives +0 whatever the gradient,
    for a constant tensor exponent b: where b == 0, as torch's pow_backward
    selects (_blocked's `own`); None for every other pow."""
    if rule is _d_pow and _is_zero(b.deriv) and isinstance(b.value, torch.Tensor):
        return (b.value == 0).to(device)  # (a 0-d CPU exponent may meet a CUDA chain)
    return None


def _d_rpow(a, b, v, alpha):  # b ** a, b a number
    return _d_pow(b, a, v, alpha)


def _constant_binary(rule, a: _Operand, b: _Operand) -> bool:
    """Whether a binary op's local derivative is a constant: a sum or
    difference, a product with a constant, a quotient by one (not a power,
    nor a product or quotient of two chain tensors)."""
    if rule in (_d_add, _d_sub, _d_rsub):
        return True
    if rule is _d_mul:
        return _is_zero(a.deriv) or _is_zero(b.deriv)
    if rule is _d_div:  # a / b
        return _is_zero(b.deriv)
    return rule is _d_rdiv and _is_zero(a.deriv)  # b / a


_BINARY = {"add": _d_add, "sub": _d_sub, "rsub": _d_rsub, "mul": _d_mul, "div": _d_div,
           "rdiv": _d_rdiv, "pow": _d_pow, "rpow": _d_rpow}
_BINARY_FUNCS = {
    torch.add: "add", torch.Tensor.add: "add", torch.sub: "sub", torch.Tensor.sub: "sub",
    torch.subtract: "sub", torch.mul: "mul", torch.Tensor.mul: "mul", torch.multiply: "mul",
    torch.div: "div", torch.Tensor.div: "div", torch.true_divide: "div", torch.divide: "div",
    torch.rsub: "rsub", torch.Tensor.__rsub__: "rsub", torch.Tensor.__rdiv__: "rdiv",
    torch.Tensor.__rtruediv__: "rdiv", torch.Tensor.__rpow__: "rpow", torch.pow: "pow",
    torch.Tensor.__pow__: "pow",
    torch.Tensor.pow: "pow",
}

# The functions enabled() does anything for (a matmul, conv, view, ... runs as
# torch's op, unless chain tensors must drop a carried derivative: _copies).
_SEEN_BY_MODE = {*_FUNCTIONS, *_UNARY_FUNCS, *_BINARY_FUNCS, torch.Tensor.retain_grad}

_PLAIN_TORCH_FUNCTION = {torch.Tensor.__torch_function__.__func__,
                         torch._C._disabled_torch_function_impl}


def _plain_type(t) -> bool:
    """torch.Tensor and nn.Parameter, not subclasses with their own __torch_function__."""
    impl = t.__torch_function__
    return getattr(impl, "__func__", impl) in _PLAIN_TORCH_FUNCTION


def _torch_runs(x: torch.Tensor) -> bool:
    """Whether torch's own op must run on x, not the kernels or a reprop
    autograd.Function (the entry of every activation, patched module and
    chain step): _tensors.torch_only, a lazily negated view (is_neg: its
    memory holds -x, which a kernel reading the pointer would take for x),
    or any x while a torch.func transform is active: one it does not wrap
    (a closure's tensor that requires grad) would meet its refusal of an
    autograd.Function without setup_context, where torch's ops work."""
    return _transform_active() or _torch_only(x) or x.is_neg()


def _kernel_input(x) -> bool:
    """Whether reprop's activation kernels can take x (else torch's op runs)."""
    return (isinstance(x, torch.Tensor) and x.layout is torch.strided
            and x.dtype in _tensors.DTYPE_CODES
            and (x.is_cpu or (x.is_cuda and _cuda is not None))
            and not _torch_runs(x))


# While on (per thread), reprop's activation functions return (y, f'(x)) in
# x's dtype instead of building their own node: enabled(compose=True) puts the
# derivative into a chain's node, reusing each function's argument handling.
# They return None where torch's op would run (parameters the kernels cannot
# take): the call is then no chain step.
class _Capture(threading.local):
    """_capture's per-thread state. `on` defaults on the class, False in
    every thread: getattr(local, "on", False) in a thread that never set
    it raises and catches an AttributeError, about 0.4 us at every
    activation call."""

    on = False


_capture = _Capture()


def _captured(ours, args, kwargs):
    """ours(*args, **kwargs) with _capture on. A try/finally rather than a
    generator context manager, which cost a chain step about a microsecond.
    Switched on inside the try: a KeyboardInterrupt (a notebook's stop
    button) between the switch and the try left it on for the thread, and
    every later reprop.fad activation (a patched module's, fad.gelu, the
    rerouting of compose=False) returned a tuple (y, f'(x)). One landing
    in the finally before it switches off is caught by enabled.__exit__."""
    try:
        _capture.on = True
        return ours(*args, **kwargs)
    finally:
        _capture.on = False


@functools.lru_cache(maxsize=None)
def _signature(fn):
    """fn's signature; None for a builtin, which has none (torch.exp)."""
    try:
        return inspect.signature(fn)
    except ValueError:
        return None


def _inplace_call(fn, args, kwargs) -> bool:
    """Whether fn(*args, **kwargs) writes its input, or is a call torch must
    judge: one that does not bind, or a builtin given `inplace`."""
    sig = _signature(fn)
    if sig is None:
        return "inplace" in kwargs
    if "inplace" not in sig.parameters:
        return False
    try:
        return bool(sig.bind(*args, **kwargs).arguments.get("inplace", False))
    except TypeError:
        return True


class _ThreadChains(threading.local):
    """One thread's chains in an enabled() instance: the record of each chain
    tensor, and whether a chain's node saved a lower-precision copy of the
    derivative its record carries (then chain tensors leaving, YN, drop the
    carried one). A thread's first use makes its own (an autograd worker's
    too, which runs no chain step)."""

    def __init__(self):
        self.records = WeakTensorKeyDictionary()
        self.copies = False


def _on_function_stack(mode) -> bool:
    """Whether `mode` is on this thread's stack of torch function modes
    (it is per thread): a block of it is open here."""
    return any(torch._C._get_function_stack_at(i) is mode
               for i in range(torch._C._len_torch_function_stack()))


class enabled(TorchFunctionMode):
    """Context manager: inside it, torch's functional activations run through
    reprop (saving only f'(x)), and with compose=True chains of element-wise ops
    written out in user code save one derivative tensor per chain (and a
    bool mask past a select).

    compose=True runs the paper's run-time state machine over tensor-operator
    pairs. A tensor that requires grad and is not a chain tensor is a root.
    NY: an element-wise op on a root starts a chain; YY: an element-wise op
    whose tensor operands all belong to one root (chain tensors of it, or the
    root itself) and constants continues it: the output's value and its
    derivative with respect to the root are computed in the forward pass, and
    its autograd node saves only that derivative (and a bool mask once a
    select, relu, Hardsigmoid or Hardswish, blocks the path and another step
    follows) and leads straight to the root; YN: a chain tensor consumed by
    anything else is an ordinary autograd tensor (its node is already right),
    so nothing is rebuilt, and only a derivative kept for the next step at
    higher precision than the node saved (saved_dtype, or float16 for a
    float16 chain) is dropped. Intermediates die with the Python temporaries
    that hold them, so a finished chain keeps one tensor (and that mask).
    NN: anything else (two roots, in-place ops, views, broadcasting past the
    root's shape, a root that repeats its elements, as an expanded bias does,
    reductions, matmuls, no_grad, float64 results) runs as
    plain torch and plain autograd, which stays correct because every chain
    tensor's node is.

    Element-wise ops: every reprop.fad activation (through torch.sigmoid,
    torch.tanh, F.gelu, F.softplus, ... ), exp, expm1, log, log1p, sqrt, rsqrt,
    reciprocal, sin, cos, erf, square, abs, neg, relu, and add, sub, mul, div,
    pow (one side constant), with the output shaped like the root.

    saved_dtype: how derivatives are saved; None (the chain's dtype),
    torch.float32, bfloat16 or float16; with compose=False also torch.uint8
    (8-bit codes; a composed chain has no known derivative range to code).
    A float16 chain carries its derivative in float32 from step to step and
    rounds only the copy each node saves; bfloat16 chains carry bfloat16.
    For chains bfloat16 is the safer 16-bit choice: a saved derivative above
    65504 overflows float16 to inf, and a later zero gradient makes that NaN.

    A step whose derivative cancels exactly (x - x, x * 0) carries the number
    0, so a later infinite local derivative gives 0 where autograd's
    inf * 0 gives NaN (sqrt(x - x), log(x * 0)); a derivative carried past
    float32's range (log or 1 / x at subnormal x) is inf where autograd,
    multiplying the gradient one step at a time, can stay finite.

    create_graph=True goes through a chain of one relu of its root and
    through chains of additions and products with constants (their backward
    is autograd's graph); any other chain refuses it (RuntimeError).

    A chain tensor given a hook (its own or its grad_fn's) or retain_grad()
    before its next op starts a new chain, which reaches it through autograd;
    after a next op chained past it they are refused (RuntimeError): that
    op's node leads straight to the root, so the tensor's node never gets
    the gradient through it (retain_grad() after the mode exited is refused
    in backward, by a node that leads past it: torch runs no Python for it).
    """

    # Made inside compiled code, eagerly: one graph break. Dynamo traced this,
    # broke the graph twice at its per-thread state (_ThreadChains, a
    # threading.local), and under fullgraph=True raised that it does not know
    # how to trace that class, not that enabled() cannot be made there.
    @_tensors.eager_under_compile
    def __init__(self, compose: bool = False, saved_dtype=None):
        super().__init__()
        compose = _tensors.check_flag(compose, "compose")  # "False" would turn chains on
        _check_saved_dtype(saved_dtype, "enabled")
        if compose and saved_dtype is torch.uint8:
            raise ValueError("enabled: saved_dtype=torch.uint8 (8-bit codes) needs an activation "
                             "with a known derivative range; use it with compose=False, "
                             "reprop.fad's functions or patch()")
        self.compose = compose
        self.saved_dtype = saved_dtype
        # Each thread's chains are its own, and end when its outermost block of
        # this instance exits: one instance shared by threads (or nested in
        # one) dropped every record at any exit, ending the chains of a block
        # still running elsewhere, and a count of open blocks over all threads
        # instead let one thread's chains run on across its consecutive blocks
        # while another thread held one open; either way a step's gradients
        # changed in the last bits with the other thread's timing.
        self._chains = _ThreadChains()

    def __enter__(self):
        depth = torch._C._len_torch_function_stack()
        if not _on_function_stack(self):
            # outermost here: nothing of an earlier block carries on (one whose
            # exit an interrupt cut short kept its records)
            self._chains.__init__()
        try:
            return super().__enter__()
        except BaseException:
            # an interrupt delivered as the push returned: `with` runs no
            # __exit__ for an __enter__ that raised, so the mode would stay on
            # the stack for the session
            if torch._C._len_torch_function_stack() > depth:
                super().__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        # the mode leaves the stack first, however the rest ends: an interrupt
        # in a reset before it (a notebook's stop button) left the mode there
        # for the session, chaining every later expression
        super().__exit__(*exc)
        # only _captured switches it on, inside a block, for a call that runs
        # no user code: off here, whatever an interrupt cut short (_captured)
        _capture.on = False
        if not _on_function_stack(self):  # chain tensors leave as plain autograd tensors
            self._chains.__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SEEN_BY_MODE and not self._chains.copies:
            return func(*args, **kwargs)  # what every path below ends in for it, checks skipped
        # Code dynamo traces runs torch's ops, before anything it cannot trace:
        # it would bake the chain's bookkeeping (the weak record table, the
        # derivative carried from op to op) into its graphs, and a graph break
        # in here (at the checkpoint hook query) made it drop a number on
        # the left of the op that broke: 1.0 + (2.0 * (t + 1.0)) gave 4.0.
        if _tensors.compiling():
            return func(*args, **kwargs)
        if func is torch.Tensor.retain_grad and getattr(args[0].grad_fn, "led_past", False):
            raise _led_past_error("retain_grad()")
        if not all(_plain_type(t) for t in types) or kwargs.get("out") is not None \
                or _tensors.non_reentrant_checkpointing():
            # out=: torch's op writes it (and refuses autograd). A checkpoint's
            # recompute runs outside enabled(), saving what torch's ops save,
            # so the recorded forward must be torch's ops too
            return func(*args, **kwargs)
        args, kwargs = _input_first(args, kwargs)
        if self.compose and torch.is_grad_enabled():
            out = self._chain_step(func, args, kwargs)
            if out is not None:
                return out
            if self._chains.copies:
                self._leave_chains(args, kwargs)
        ours = _REROUTED.get(func)
        if ours is not None and args and _kernel_input(args[0]):
            return _reroute(ours, func, *args, saved_dtype=self.saved_dtype, **kwargs)
        return func(*args, **kwargs)

    # ---- YN -----------------------------------------------------------------

    def _leave_chains(self, args, kwargs) -> None:
        """Chain tensors consumed outside their chain (YN): a next step now uses
        the saved copy, and the full-precision derivative is freed."""
        for t in _tensors_in(args, kwargs):
            rec = self._chains.records.get(t)
            if rec is not None and rec.kept is not rec.deriv:
                # the node's own low-precision copy: no one else writes it
                rec.deriv, rec.deriv_version = rec.kept, None

    def _stored(self, deriv, dtype: torch.dtype):
        """The copy of a step's derivative its node saves: in saved_dtype, or
        in the chain's dtype `dtype`, to which a float16 chain's float32
        derivative (_product) is rounded. A 0-d derivative (a constant's own
        scalar tensor, which torch's kernels read at its own precision) is
        kept as it is."""
        if not isinstance(deriv, torch.Tensor):
            return deriv
        if self.saved_dtype is not None:
            return deriv.to(self.saved_dtype)
        return deriv.to(dtype) if deriv.dim() > 0 else deriv

    # ---- NY and YY ----------------------------------------------------------

    def _chain_step(self, func, args, kwargs):
        """The op's output as a chain tensor, or None when the op is not a chain step
        (none is on a tensor _torch_runs gives to torch: _operands)."""
        parsed = self._parse(func, args, kwargs)
        if parsed is None:
            return None
        root, operands, compute, constant = parsed
        if not root.is_floating_point() or _result_dtype(operands) in _TORCH_DTYPES:
            return None  # float64 results keep torch's float64 backward formulas
        if 0 in root.stride() and _tensors.repeated_dims(root):
            # A root that repeats its elements (a bias expanded over a batch):
            # a chain carries one derivative per element, where torch's ops
            # save the root's few bytes (gelu of a 256-element bias over 64
            # rows saved 64 KiB against 1 KiB). Torch's op, or an activation
            # that saves the distinct elements' f' (_run_forward_repeated).
            return None
        tensors = [o.value for o in operands if isinstance(o.value, torch.Tensor)]
        if any(t.is_complex() for t in tensors):
            return None  # autograd conjugates what a complex op's backward multiplies by
        if not _root_shaped(tensors, root.shape):
            return None
        constant = constant and all([o.constant for o in operands])  # (a list: 1 or 2, faster)
        step = _Step(self, compute, _passed(operands), constant)
        # autograd's own apply: Function.apply's Python steps have nothing to
        # do here (_Chain has no setup_context, and no functorch transform is
        # active); they cost a chain step about a microsecond
        out = _AUTOGRAD_APPLY(root, step)
        _lead_past(operands)
        deriv, kept, blocked = step.result
        if deriv is not None:
            chains = self._chains
            chains.records[out] = _Record(root, out, deriv, kept, blocked, constant)
            chains.copies = chains.copies or kept is not deriv
        # else relu of the root saved its own output under a saved-tensor hook
        # (_saved_tensor_hooks_active): unrecorded, out is a root to a next
        # step, which reaches its node through autograd, so that the node's
        # backward runs and releases the output; its double backward, as
        # torch's relu, needs the output's link to the node, not a detached alias
        return out

    def _operands(self, values) -> tuple[torch.Tensor, list[_Operand]] | None:
        """(root, operands) when every tensor among values belongs to one root
        or is a constant and at least one belongs to it; else None."""
        root, operands = None, []
        for x in values:
            if _number(x):
                operands.append(_Operand(x, 0))
                continue
            if not isinstance(x, torch.Tensor) or _torch_runs(x):
                return None
            src, deriv, blocked, constant = self._root_of(x)
            if src is None:
                operands.append(_Operand(x, 0))
                continue
            if root is not None and src is not root:
                return None
            root = src
            operands.append(_Operand(x.detach(), deriv, blocked, None if src is x else x, constant))
        return (root, operands) if root is not None else None

    def _root_of(self, t: torch.Tensor):
        """(root, d t / d root, blocked, constant: see _Record) of t; (t, None,
        None, True) for a root, and (None, None, None, True) for a constant.
        A chain tensor with hooks (its own or its node's) or retain_grad() is
        a root: a next step must reach it through autograd (a hook dict left
        empty by a removed hook counts: Tensor.register_hook adds a next hook
        to it without asking the node, which refuses hooks once led past).
        Its node must still be a chain node: detach_(), and requires_grad_()
        after it, leave the version as it was, and make the tensor a constant
        or a leaf (a root)."""
        rec = self._chains.records.get(t)
        if rec is not None and rec.version == t._version \
                and getattr(t.grad_fn, "hooked", True) is False \
                and t._backward_hooks is None and not t.retains_grad \
                and (rec.deriv_version is None or rec.deriv._version == rec.deriv_version):
            src = rec.source()
            if src is not None and src._version == rec.source_version:
                return (src, *_carried(rec), rec.constant)
        return (t, None, None, True) if t.requires_grad else (None, None, None, True)

    def _parse(self, func, args, kwargs):
        """(root, operands, compute, constant) for an element-wise op of the
        tables, else None; constant: whether the op's local derivative is a
        constant (_CONSTANT_UNARY, _constant_binary; no activation's is)."""
        ours = _FUNCTIONS.get(func)
        if ours is not None:
            return self._parse_activation(ours, args, kwargs)
        name = _UNARY_FUNCS.get(func)
        # F.relu (and so nn.ReLU) hands on its inplace=False as a keyword
        if name is not None and len(args) == 1 and set(kwargs) <= {"inplace"} \
                and not _inplace_call(func, args, kwargs):
            return self._parse_unary(func, name, args, kwargs)
        name = _BINARY_FUNCS.get(func)
        if name is not None and len(args) == 2 and set(kwargs) <= {"alpha"}:
            return self._parse_binary(func, _BINARY[name], args, kwargs)
        return None

    def _parse_activation(self, ours, args, kwargs):
        if not args or not _kernel_input(args[0]) or _inplace_call(ours, args, kwargs):
            return None
        found = self._operands(args[:1])
        if found is None:
            return None
        root, (a,) = found
        captured = _captured(ours, (a.value, *args[1:]), kwargs)
        if captured is None:
            return None  # parameters only torch's op takes (_kernel_act): it runs, NN
        v, local = captured
        return root, [a], lambda: (v, *_unary_step(ours.__name__, local, a)), False

    def _parse_unary(self, func, name, args, kwargs):
        found = self._operands(args)
        if found is None:
            return None
        root, (a,) = found
        rule = _UNARY[name]

        def compute():
            v = func(a.value, **kwargs)
            if name == "relu" and a.deriv is None:
                return v, _RELU_OF_SELF, None
            return (v, *_unary_step(name, rule(a.value, v), a))

        return root, [a], compute, name in _CONSTANT_UNARY

    def _parse_binary(self, func, rule, args, kwargs):
        found = self._operands(args)
        if found is None:
            return None
        root, (a, b) = found
        if rule in (_d_pow, _d_rpow) and not (_is_zero(a.deriv) or _is_zero(b.deriv)):
            return None  # x ** x: both sides on the chain, not handled
        if rule is _d_rpow and not _number(b.value):
            return None
        if rule is _d_pow and _is_zero(b.value):
            # a ** 0 is constant: torch's backward gives zeros whatever the
            # gradient (an inf too), and no carried derivative holds that
            return None
        alpha = kwargs.get("alpha", 1)

        def compute():
            v = func(a.value, b.value, **kwargs)
            return v, rule(a, b, v, alpha), _blocked([a, b], _pow_selected(rule, b, v.device))

        return root, [a, b], compute, _constant_binary(rule, a, b)


def _root_shaped(tensors, shape: torch.Size) -> bool:
    """Whether the op's output, broadcast from `tensors`, has the root's shape.
    Operands of that shape already (most chain steps) skip torch.broadcast_shapes,
    whose Python took about a fifth of a chain step. Shapes that do not
    broadcast make no chain step: torch's op runs and raises its own error."""
    if all(t.shape == shape for t in tensors):
        return True
    try:
        return torch.broadcast_shapes(*(t.shape for t in tensors)) == shape
    except RuntimeError:
        return False


class _Passed:
    """What a step's node leads past: for each chain operand, a weak
    reference to it and what its own node led past, linked rather than
    copied (a chain of n steps whose tensors the user keeps holds n entries,
    not n^2). `checked`: the graph task (backward) whose retain_grad check
    walked this level and those it links, so that each is walked once per
    backward however many of the chain's nodes run in it."""

    __slots__ = ("entries", "checked")

    def __init__(self, entries: tuple):
        self.entries, self.checked = entries, None  # (never a graph task id)


def _passed(operands) -> _Passed:
    return _Passed(tuple((weakref.ref(o.chain), o.chain.grad_fn.passed)
                         for o in operands if o.chain is not None))


def _lead_past(operands) -> None:
    """Marks the nodes of a step's chain operands as led past: the step's
    node goes straight to the root, so a hook given to them now would never
    run (_led_past_error)."""
    for o in operands:
        if o.chain is not None:
            if not _refusals_installed:
                _install_led_past_refusals()
            o.chain.grad_fn.led_past = True


def _carried(rec: _Record) -> tuple[object, torch.Tensor | None]:
    """(d t / d root, blocked) of a chain tensor t from its record."""
    if isinstance(rec.deriv, _ReluOutput):
        return _relu_local(rec.deriv.out)
    if isinstance(rec.blocked, _WhereZero):
        return rec.blocked.carried(rec.deriv)
    return rec.deriv, rec.blocked


def _result_dtype(operands) -> torch.dtype:
    """The dtype of the op's output, by torch's promotion (one operand: its own)."""
    values = [o.value for o in operands]
    return values[0].dtype if len(values) == 1 else torch.result_type(*values)


def _input_first(args, kwargs):
    """(args, kwargs) of a call with its input passed as a keyword
    (F.gelu(input=h), torch.selu(input=h)) made its first argument, where
    the rerouting and the chains look for it: the same call to torch."""
    if args or "input" not in kwargs:
        return args, kwargs
    kwargs = dict(kwargs)
    return (kwargs.pop("input"),), kwargs


def _tensors_in(args, kwargs):
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from (t for t in x if isinstance(t, torch.Tensor))
