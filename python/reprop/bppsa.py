"""BPPSA: backprop through recurrences as a parallel scan (Wang et al., MLSys 2020).

Backprop through time solves g[t] = c[t] + J[t+1]^T g[t+1] step after step.
BPPSA computes the same gradients as an exclusive scan of the transposed
Jacobians with the modified Blelloch algorithm: Theta(log T) dependent steps
instead of T, at the price of H x H matrix products in the up-sweep. The
arithmetic is reordered, nothing is approximated.

- :class:`RNN` and :class:`GRU` are drop-in ``torch.nn.RNN``/``torch.nn.GRU``
  (same arguments, parameters and state_dict) whose backward runs the scan
  inside an ordinary ``autograd.Function``: ``loss.backward()`` is unchanged.
  The forward is PyTorch's own (cuDNN on the GPU), one layer at a time with
  the kernel call nn's makes for it (both directions, packed rows), so on
  the CPU its outputs are nn's, bit for bit. The transposed Jacobians are
  never materialized: W_hh is shared by every step and sequence and the
  activation derivatives stay vectors.
- :func:`convert` swaps the RNNs and GRUs of an unmodified model in place.
- :func:`scan` is the recurrence itself, for custom recurrences.
- :class:`ChainPlan` and :func:`chain_backward`: the sparse side, for chains
  of Conv2d/ReLU/MaxPool2d/Linear/element-wise layers (the paper's pruned
  networks): CSR transposed Jacobians generated analytically, the patterns
  of every up-sweep product planned once, only values refreshed per step.
- ``scan="auto"`` lets a cost model choose how many Blelloch levels to run
  (``"linear"``: none, the plain linear scan; ``"blelloch"``: all of them;
  an int: that many, the hybrid of the paper's Section 5.3).
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import weakref
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.modules.module import (_global_forward_hooks, _global_forward_hooks_always_called,
                                     _global_forward_hooks_with_kwargs, _global_forward_pre_hooks)
from torch.nn.utils import parametrize
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ._native import _C, _cuda, cuda_missing
from ._tensors import (autocast_enabled, bump_versions, check_count, check_flag, check_strided,
                       check_writable, class_key, compiling, current_stream_handle, dispatch_mode_active,
                       eager_under_compile, hook_owner, is_count, is_instance_by_name, on_device,
                       profiler_range,
                       replaced_forward, show_coming_writes, torch_only, torch_only_weight,
                       transform_active, warn_at_users_line, without_autocast, without_grad,
                       DOUBLE_BACKWARD_CALLERS, byte_span)
from . import fusion

__all__ = ["RNN", "GRU", "convert", "scan", "scan_levels", "max_levels", "bitstream",
           "ChainPlan", "chain_backward", "transposed_jacobian"]

_SCAN_NAMES = ("auto", "linear", "blelloch")
# the hook Dynamo's torch.compile sets to compile each frame called (None outside a compiled region)
_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


# ---------------------------------------------------------------------------
# The scan
# ---------------------------------------------------------------------------

def max_levels(n: int) -> int:
    """Up-sweep levels of the full Blelloch scan over n steps: ceil(log2(n + 1)) - 1."""
    return _max_levels(_check_count(n, "n", 1))


def _max_levels(n: int) -> int:
    return _C.scan_plan(n, 1, 1, 1, 1.0, 0.0, 0.0)[1]


def _machine(device: torch.device) -> tuple[float, float, float]:
    """The cost model's view of a device: (parallel products, cost of a level,
    cost of a dependent linear-scan step), costs in multiply-adds of one worker.
    CPU: one product per OpenMP thread (as many as torch uses now), a level
    costs a fork/join."""
    if device.type == "cuda":
        return _cuda_machine(device)
    return float(torch.get_num_threads()), 4.0e3, 20.0


@functools.lru_cache(maxsize=None)
def _cuda_machine(device: torch.device) -> tuple[float, float, float]:
    """CUDA: about 16 small products per SM at once, a level costs a kernel
    launch (~4 us), a linear step a block barrier and a dependent trip to L2."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return float(16 * sms), 2.0e4, 3.0e3


def _device_key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def scan_levels(n: int, batch: int, hidden: int, gates: int, device: torch.device | str = "cpu") -> int:
    """The number of Blelloch levels the cost model picks for this problem on
    `device`, the CPU or one of this machine's GPUs (0 is the linear scan,
    max_levels(n) the full Blelloch scan): n steps, batch sequences, hidden
    size, gates diagonal Jacobians per step (1 for an RNN, 3 for a GRU, 0 for
    dense ones)."""
    n, batch, hidden, gates = (_check_count(value, name, least) for name, value, least in (
        ("n", n, 1), ("batch", batch, 0), ("hidden", hidden, 1), ("gates", gates, 0)))
    return _planned_levels(n, batch, hidden, gates, _check_plan_device(device))


def _check_plan_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device the cost model can ask about: the CPU, or
    a CUDA device this machine has (the model reads its properties, which
    for an index past the last GPU raise torch's "Invalid device id")."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected a CPU or CUDA device, got {device}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device: CUDA is not available")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device: expected a CUDA device index below {count} (the GPUs "
                             f"this machine has), got {device}")
    return device


def _planned_levels(n: int, batch: int, hidden: int, gates: int, device: torch.device) -> int:
    """scan_levels for sizes taken from checked tensors (every backward asks):
    the cost model's pick, or the linear scan where the blocks of Blelloch
    levels would not fit in the device's shared memory."""
    levels = _C.scan_plan(n, batch, hidden, gates, *_machine(_device_key(device)))[0]
    return levels if levels == 0 or _scan_fits(device, hidden, levels) else 0


def _scan_fits(device: torch.device, hidden: int, levels: int) -> bool:
    """Whether a scan with `levels` over `hidden` can run on `device`: the
    CUDA scan keeps vectors of the hidden size in shared memory (past about
    29,000 they do not fit, about 28,000 with levels); the CPU scan has no
    such bound. Without the CUDA extension, scan() says so itself."""
    if device.type != "cuda" or _cuda is None:
        return True
    return _cuda.scan_shared_bytes(hidden, levels) <= _shared_memory_per_block(_device_key(device))


@functools.lru_cache(maxsize=None)
def _shared_memory_per_block(device: torch.device) -> int:
    return _cuda.shared_memory_per_block(device.index)


def _check_count(value, name: str, least: int) -> int:
    """value as a Python int, if it is one in [least, 2^31) (the core's sizes are int32s)."""
    return check_count(value, name, least, 2 ** 31 - 1)


def _resolve_levels(choice, n: int, batch: int, hidden: int, gates: int, device: torch.device) -> int:
    top = _max_levels(n)
    if choice == "auto":
        return _planned_levels(n, batch, hidden, gates, device)
    if choice == "linear":
        return 0
    if choice == "blelloch":
        return top
    return min(int(choice), top)


def _check_scan_choice(scan, name: str = "scan") -> object:
    """scan, a name or a number of levels as a Python int (numpy's ints too)."""
    if isinstance(scan, str) and scan in _SCAN_NAMES:
        return scan
    if not is_count(scan):
        raise ValueError(f"{name}: expected one of {_SCAN_NAMES} or a number of levels, got {scan!r}")
    return check_count(scan, name, 0)


def _check_tensor(t, name: str) -> None:
    """A tensor, before anything reads its shape (an ndarray has none of
    Tensor's methods)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")


def _check_real_dense(t, name: str, dtype_error: type = TypeError) -> None:
    """A strided real floating-point tensor on the CPU or a CUDA device
    (another dtype raises `dtype_error`)."""
    _check_tensor(t, name)
    check_strided(t, name)
    if t.is_complex() or not t.is_floating_point():
        raise dtype_error(f"{name}: expected a real floating-point tensor, got {t.dtype}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: expected a CPU or CUDA tensor, got device {t.device}")


def _check_operand(t: torch.Tensor | None, name: str, shape: tuple, device: torch.device,
                   optional: bool = False) -> None:
    if t is None:
        if optional:
            return
        raise ValueError(f"{name}: required")
    _check_tensor(t, name)
    check_strided(t, name)
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: expected float32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def _type_name(value) -> str:
    """value's type as errors name it: qualified outside the builtins, so that
    numpy.bool does not read as bool."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    return a0 < b1 and b0 < a1


def _check_out(out: torch.Tensor, c: torch.Tensor, jacobians: dict) -> None:
    """out must be a contiguous (T, B, H) float32 tensor on c's device, c itself or
    disjoint from it, and disjoint from the Jacobians the scan reads throughout."""
    _check_operand(out, "out", tuple(c.shape), c.device)
    if not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor")
    if out.is_neg():
        raise ValueError("out: a lazily negated view (is_neg) holds -out in memory, which the "
                         "scan would write as out; pass a tensor of its own")
    if _overlaps(out, c) and not (out.data_ptr() == c.data_ptr() and c.is_contiguous()):
        raise ValueError("out: must be c itself or not overlap it")
    for name, t in jacobians.items():
        if t is not None and _overlaps(out, t):
            raise ValueError(f"out: overlaps {name}")


def _check_no_graph(operands: dict, out: torch.Tensor | None) -> None:
    """scan records no autograd graph (its kernels write through raw
    pointers): under grad mode an operand that requires grad is refused, as
    torch refuses out= then, rather than its gradient silently lost; under
    no_grad or inference_mode there is nothing to record. out is written in
    place, so an inference tensor is refused outside inference_mode, as torch
    refuses it."""
    if out is not None:
        check_writable(out, "out")
    if not torch.is_grad_enabled():
        return
    name = next((name for name, t in operands.items() if t is not None and t.requires_grad), None)
    if name is None:
        return
    if out is not None:
        raise RuntimeError(f"scan(): functions with out=... arguments don't support automatic "
                           f"differentiation, but one of the arguments requires grad ({name})")
    raise RuntimeError(f"{name}: requires grad, but scan is not differentiable (it records no "
                       f"graph); call it under torch.no_grad() or pass {name}.detach()")


_ACTIVATIONS = {"tanh": 1, "relu": 2}  # rp_scan_act


def _check_activation(activation, y, v, jt) -> int:
    """The rp_scan_act code of `activation`, 0 for none; y comes with it, in place of v."""
    if activation is None:
        if y is not None:
            raise ValueError("y: only with activation='tanh' or 'relu' (v = f'(y)); else give v")
        return 0
    if not isinstance(activation, str) or activation not in _ACTIVATIONS:  # a list is unhashable
        raise ValueError(f"activation: expected 'tanh' or 'relu', got {activation!r}")
    if jt is not None:
        raise ValueError("activation: structured leaves only, not with dense jt")
    if v is not None:
        raise ValueError("activation: give v, or activation with y (v = f'(y)), not both")
    if y is None:
        raise ValueError(f"y: required with activation={activation!r}")
    return _ACTIVATIONS[activation]


# Under torch.compile, the entry points that call the C core (scan, the
# RNN/GRU backward, chain_backward, ChainPlan.forward_inputs and backward; the
# RNN/GRU forward: _forward_under_dynamo) run eagerly, one graph break each:
# dynamo traced into them, warned at each C call
# (to wrap reprop._C as a custom operator) and at torch's functorch checks,
# compiled the Python between them in a dozen or more frames, and under
# fullgraph=True raised an error about torch._C._is_tracing that did not name
# reprop. The scan still runs; its gate costs about 0.06 us a call.
@eager_under_compile
def scan(c: torch.Tensor, *, w: torch.Tensor | None = None, u: torch.Tensor | None = None,
         v: torch.Tensor | None = None, jt: torch.Tensor | None = None, activation: str | None = None,
         y: torch.Tensor | None = None, pre_activation: bool = False, levels="auto",
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Solves g[T-1] = c[T-1], g[t] = c[t] + J[t+1]^T g[t+1] for every t.

    c: (T, B, H) float32, the gradient reaching each h_t from outside the
    recurrence. The transposed Jacobians J[t]^T are either dense, jt (T, B, H, H),
    or structured, diag(u[t]) + sum_k W_k^T diag(v[t, :, kH:(k+1)H]) with
    w (G*H, H) shared by all steps (W_k its row blocks), u (T, B, H) or None, and
    v (T, B, G*H). Instead of v, ``activation="tanh"`` or ``"relu"`` with
    y (T, B, G*H), the activation's output: v = f'(y) is computed where the
    scan reads it, without its buffer: 1 - y * y, bit for bit what passing
    that v gives; relu's v x as torch's threshold_backward forms it, 0 where
    y <= 0 (an inf or NaN x too, where a product would give NaN), else x (a
    NaN y included): for finite x the values of v = (y > 0) passed in, zeros
    always +0. Entry t = 0 of the Jacobians is not used.

    Returns g (T, B, H), or with ``pre_activation=True`` (one gate, w (H, H))
    d = v * g, the gradient of the pre-activation, the same bits as scaling g
    afterwards (relu: selecting; and then v[0] is used); written into `out`
    when given: a contiguous (T, B, H) float32 tensor on c's device, c itself
    (in place) or disjoint from c, and disjoint from w, u, v, y, jt. Runs on
    c's device (CPU or CUDA, on the current stream); float32 only. Not
    differentiable: under grad mode, an operand (or out) that requires grad
    raises RuntimeError, as torch's out= functions do; call it under
    torch.no_grad(). An inference tensor as out raises outside
    torch.inference_mode, as torch's in-place writes do. What only torch's
    ops carry (a torch.func transform's tensor, a forward-AD dual, a nested
    tensor, a subclass, any under jit.trace) raises RuntimeError naming the
    operand: the kernels read raw memory. The linear
    scan (levels 0) needs no memory beyond g; with Blelloch levels it takes a
    workspace of (T + 1) B H + (T // 2 - 1) B H H floats (T >= 2; one more on
    CUDA, and there a copy of c to scan in place), and a result that is not
    finite (overflowing products of Jacobians) is redone by the linear scan,
    on CUDA decided on the device: no call waits for the GPU.
    """
    _check_raw_readable({"c": c, "w": w, "u": u, "v": v, "y": y, "jt": jt, "out": out})
    return _scan(c, w=w, u=u, v=v, jt=jt, activation=activation, y=y, pre_activation=pre_activation,
                 levels=levels, out=out)


def _scan(c: torch.Tensor, *, w: torch.Tensor | None = None, u: torch.Tensor | None = None,
          v: torch.Tensor | None = None, jt: torch.Tensor | None = None, activation: str | None = None,
          y: torch.Tensor | None = None, pre_activation: bool = False, levels="auto",
          out: torch.Tensor | None = None) -> torch.Tensor:
    """scan() of operands known to be tensors its kernels can read: the RNN
    and GRU backward's own, which their forward ran the scan for only when
    no tensor of the call was torch_only (and backward refuses a torch_only
    gradient), so scan's torch_only check of each operand, a cost on every
    layer and direction, is left to the public entry point."""
    operands = {"c": c, "w": w, "u": u, "v": v, "y": y, "jt": jt, "out": out}
    if c.dim() != 3:
        raise ValueError("c: expected a (T, B, H) tensor")
    T, B, H = c.shape
    device = c.device
    _check_operand(c, "c", (T, B, H), device)
    if T < 1:
        raise ValueError("c: need at least one step")
    if H < 1:
        raise ValueError("c: expected a hidden size H of at least 1, got 0")
    act = _check_activation(activation, y, v, jt)
    pre_activation = check_flag(pre_activation, "pre_activation")
    if jt is not None:
        if w is not None or u is not None or v is not None:
            raise ValueError("jt: give either dense jt or the structured w, u, v, not both")
        _check_operand(jt, "jt", (T, B, H, H), device)
        gates = 0
    else:
        gates = _gates(w, H)
        _check_operand(w, "w", (gates * H, H), device)
        _check_operand(u, "u", (T, B, H), device, optional=True)
        _check_operand(y if act else v, "y" if act else "v", (T, B, gates * H), device)
    if pre_activation and gates != 1:
        raise ValueError(f"pre_activation: needs one gate, w of shape ({H}, {H}); got {gates} gates")
    if out is not None:
        _check_out(out, c, {"w": w, "u": u, "v": v, "y": y, "jt": jt})
    _check_no_graph(operands, out)
    levels = _check_scan_choice(levels, "levels")
    L = _resolve_levels(levels, T, B, H, gates, device)
    # the kernels read memory: a lazily negated view holds -t there
    c = c.contiguous().resolve_neg()
    w, u, v, jt, y = [None if t is None else t.contiguous().resolve_neg() for t in (w, u, v, jt, y)]
    g = torch.empty_like(c) if out is None else out
    if B == 0:
        return g
    if out is not None and dispatch_mode_active():
        show_coming_writes([out])  # allow_mutation_on_saved_tensors() clones what it saved
    leaves = (T, B, H, gates, *map(_pointer, (w, u, v, jt)), act, _pointer(y), int(pre_activation))
    if device.type == "cpu":
        _run_scan(leaves, c, g, L)
    elif device.type == "cuda":
        if _cuda is None:
            raise RuntimeError(f"scan: CUDA tensors, but {cuda_missing()}")
        # with levels the kernels redo a result that is not finite from c (as
        # the CPU scan does, reprop.h): in place, from a copy of it
        _run_scan(leaves, c.clone() if L and c.data_ptr() == g.data_ptr() else c, g, L)
    else:
        raise ValueError(f"c: expected a CPU or CUDA tensor, got device {device}")
    if out is not None:  # written through a raw pointer: autograd must see the change
        bump_versions([out])
    return g


def _check_raw_readable(operands: dict) -> None:
    """Each given operand of scan a tensor its kernels can read: not one only
    torch's ops carry (torch_only: a forward-AD dual's tangent would be
    dropped, a functorch wrapper has no storage, a nested tensor no sizes),
    refused by name before anything reads its shape."""
    for name, t in operands.items():
        if t is not None:
            _check_tensor(t, name)
            if torch_only(t):
                _refuse_torch_only(name, "scan")


def _gates(w: torch.Tensor | None, H: int) -> int:
    """The number G >= 1 of row blocks of w, a (G*H, H) tensor (none: the
    leaves would be dense, which only jt gives); w checked a tensor already."""
    if w is None or w.dim() != 2 or w.shape[1] != H or w.shape[0] % H or w.shape[0] < H:
        raise ValueError(f"w: expected a (G*{H}, {H}) tensor, G >= 1")
    return w.shape[0] // H


def _run_scan(leaves: tuple, c: torch.Tensor, g: torch.Tensor, levels: int) -> None:
    """One scan of checked operands on c's device, with its workspace (on
    CUDA with levels one float more: the flag of the linear redo, reprop.h)."""
    T, B, H = c.shape
    floats = _C.scan_workspace(T, B, H, levels)
    flag = 1 if floats and c.device.type == "cuda" else 0
    work = torch.empty(floats + flag, device=c.device) if floats else None
    args = (*leaves, c.data_ptr(), g.data_ptr(), levels, _pointer(work))
    with profiler_range("reprop.bppsa.scan"):
        if c.device.type == "cuda":
            with on_device(c.device):
                _cuda.scan(*args, current_stream_handle(c.device))
        else:
            _C.scan(*args, torch.get_num_threads())


# ---------------------------------------------------------------------------
# One layer, both directions, as an autograd Function
# ---------------------------------------------------------------------------

_KERNELS = {"RNN_TANH": torch._VF.rnn_tanh, "RNN_RELU": torch._VF.rnn_relu, "GRU": torch._VF.gru}


def _forward_layer(mode: str, x: torch.Tensor, hx: torch.Tensor, weights: Sequence[torch.Tensor | None],
                   batch_sizes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's own forward of one layer, both directions where hx (dirs, B, H)
    has two (cuDNN on the GPU): the call nn.RNN's forward makes, for this
    layer, so that out and h_n are its bits (a bidirectional CPU kernel runs
    its reverse direction otherwise than a unidirectional one over flipped
    input; a packed one each step over its own batch). x (T, B, I), or a
    PackedSequence's rows with their batch_sizes; weights (w_ih, w_hh, b_ih,
    b_hh) for each direction, the biases None without bias. Returns out
    ((T, B, dirs*H) or the packed rows) and h_n (dirs, B, H)."""
    given = [w for w in weights if w is not None]
    bias, bidirectional = weights[2] is not None, hx.shape[0] == 2
    if batch_sizes is None:
        return _KERNELS[mode](x, hx, given, bias, 1, 0.0, False, bidirectional, False)
    return _KERNELS[mode](x, batch_sizes, hx, given, bias, 1, 0.0, False, bidirectional)


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


def _matmul_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over steps and batch of a^T b: (T, B, M) or (T*B, M), same for b -> (M, N), one GEMM."""
    return a.reshape(-1, a.shape[-1]).t() @ b.reshape(-1, b.shape[-1])


def _matmul_tn_prev(d: torch.Tensor, h0: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """sum over t and batch of d[t]^T h[t-1], h[-1] = h0: d (T, B, M), h0 (B, N),
    out (T, B, N) -> (M, N), without building the shifted sequence of states."""
    grad = d[0].t() @ h0
    if d.shape[0] > 1:
        grad.addmm_(d[1:].reshape(-1, d.shape[-1]).t(), out[:-1].reshape(-1, out.shape[-1]))
    return grad


def _linear_into(dst: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """dst = x w^T + b as one GEMM written into dst ((..., O), viewable as rows)."""
    x2, d2 = x.reshape(-1, x.shape[-1]), dst.view(-1, dst.shape[-1])
    if b is None:
        torch.mm(x2, w.t(), out=d2)
    else:
        torch.addmm(b, x2, w.t(), out=d2)
    return dst


def _blocks_matmul(blocks: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """a @ w for a (T, B, K) given as its column blocks (views), w (K, N) -> (T, B, N)."""
    T, B = blocks[0].shape[:2]
    acc, row = None, 0
    for block in blocks:
        flat, part = block.reshape(-1, block.shape[-1]), w[row:row + block.shape[-1]]
        acc = flat @ part if acc is None else acc.addmm_(flat, part)
        row += block.shape[-1]
    return acc.view(T, B, -1)


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' rows one after another (no copy for a single part)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _hold(t: torch.Tensor, held: torch.dtype | None) -> torch.Tensor:
    """t rounded in place through `held`, the dtype torch's own backward keeps
    this value in (None: t as it is). A value past float16's range becomes
    inf, as torch's does, and its products inf or NaN, as torch's are."""
    return t if held is None else t.copy_(t.to(held))


def _rnn_backward(mode: str, c: torch.Tensor, w_hh: torch.Tensor, out: torch.Tensor, choice,
                  held: torch.dtype | None) -> tuple:
    """The RNN's pre-activation gradients d = f'(out) * g (T, B, H), written by
    the scan itself, which reads f'(out) off out (1 - out^2, relu's select) and
    keeps g to itself: d is backward's one (T, B, H) buffer. With `held`
    (float16 autocast, see _Layer) g is taken out of the scan and rounded
    through it first, as torch's recurrence holds g (its output's gradient)
    in float16: an overflowing g is inf there even where f'(out) g is not.
    Returns ([d], d, grad h0): d_gi's blocks, d_gh."""
    T, B, H = out.shape
    activation = "tanh" if mode == "RNN_TANH" else "relu"
    levels = _resolve_levels(choice, T, B, H, 1, c.device)
    if held is None:
        d = _scan(c, w=w_hh, activation=activation, y=out, pre_activation=True, levels=levels)
    else:
        g = _hold(_scan(c, w=w_hh, activation=activation, y=out, levels=levels), held)
        d = _hold(_activation_backward(activation, g, out), held)
    return [d], d, _hold(d[0] @ w_hh, held)


def _activation_backward(activation: str, g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """f'(y) * g as the scan's pre_activation forms it (torch's own kernels)."""
    if activation == "tanh":
        return torch.ops.aten.tanh_backward(g, y)
    return torch.ops.aten.threshold_backward(g, y, 0)


def _gate_planes(x2: torch.Tensor, w_ih: torch.Tensor, b_ih: torch.Tensor | None, shape: tuple) -> torch.Tensor:
    """x W_ih^T + b_ih for x2 (T*B, I), each gate's block in its own contiguous
    plane: (3, T, B, H), so that z can be the scan's u as it is."""
    planes = x2.new_empty(3, *shape)
    H = shape[-1]
    for k, plane in enumerate(planes):
        rows = slice(k * H, (k + 1) * H)
        _linear_into(plane, x2, w_ih[rows], None if b_ih is None else b_ih[rows])
    return planes


def _hidden_gates(h0: torch.Tensor, out: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor | None) -> torch.Tensor:
    """h[t-1] W_hh^T + b_hh (T, B, 3H), h[-1] = h0, in two GEMMs straight from h0 and out."""
    gh = out.new_empty(*out.shape[:2], w_hh.shape[0])
    _linear_into(gh[0], h0, w_hh, b_hh)
    _linear_into(gh[1:], out[:-1], w_hh, b_hh)
    return gh


def _one_minus_into(dst: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """dst = 1 - t (as -t + 1: the same bits)."""
    return torch.neg(t, out=dst).add_(1)


def _previous_states_into(dst: torch.Tensor, h0: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """dst[t] = h[t-1]: h0, then out[:-1]."""
    dst[0].copy_(h0)
    dst[1:].copy_(out[:-1])
    return dst


def _gru_backward(c, x2, h0, w_ih, w_hh, b_ih, b_hh, out, choice, held) -> tuple:
    """The GRU's pre-activation gradients in two buffers: the input gates' planes
    gi (3, T, B, H) and the hidden gates gh (T, B, 3H). The gates r, z, n are
    recomputed into gi; the scan's v = [dn M r (1 - r), (h_prev - n) z (1 - z), dn r]
    (dn = (1 - z)(1 - n^2)) replaces gh = [h_r, h_z, M], dn replaces n, blocks
    already consumed serve as scratch; the scan writes g over r, then
    d_gh = v * g replaces v and dn * g replaces dn. Every element gets the
    operations of the plain expressions, in their order. With `held` (float16
    autocast, see _Layer) g is rounded through it where it enters the gates
    (torch's float16 gate ops cast it), and d_gh, dn and h0's W_hh product
    are rounded as torch's float16 ops leave them. Returns (d_gi as column
    blocks, d_gh, grad h0)."""
    T, B, H = out.shape
    gi = _gate_planes(x2, w_ih, b_ih, (T, B, H))
    gh = _hidden_gates(h0, out, w_hh, b_hh)
    r, z, n = gi.unbind(0)
    h_r, h_z, M = gh.split(H, -1)
    r.add_(h_r).sigmoid_()
    z.add_(h_z).sigmoid_()
    n.add_(torch.mul(r, M, out=h_r)).tanh_()  # h_r and h_z are spent: scratch from here
    one_minus_z = _one_minus_into(h_r, z)
    _previous_states_into(h_z, h0, out).sub_(n).mul_(z).mul_(one_minus_z)  # v_z
    dn = n.mul_(n).neg_().add_(1).mul_(one_minus_z)
    torch.mul(dn, M, out=h_r).mul_(r)  # dn M r; M is spent
    h_r.mul_(_one_minus_into(M, r))  # v_r = dn M r (1 - r)
    torch.mul(dn, r, out=M)  # v_n
    levels = _resolve_levels(choice, T, B, H, 3, c.device)
    g = _hold(_scan(c, w=w_hh, u=z, v=gh, levels=levels, out=r), held)  # r is spent
    _hold(gh.view(T, B, 3, H).mul_(g.unsqueeze(2)), held)  # d_gh = v * [g, g, g]
    _hold(dn.mul_(g), held)  # W_in sees n's input before r: its gradient is dn * g
    return [gh[..., :2 * H], dn], gh, z[0] * g[0] + _hold(gh[0] @ w_hh, held)


def _step_gradients(grad_out: torch.Tensor | None, grad_h: torch.Tensor | None, out: torch.Tensor,
                    steps: _Steps, direction: int) -> torch.Tensor:
    """The scan's c (T, B, H) float32 for one direction, whose output is out
    (in the scan's layout): the output's gradient (the direction's part of
    the layer's) plus the final states' at each sample's last step (None:
    that output got no gradient). grad_out is copied only to add grad_h, or
    to lay it out for the scan."""
    if grad_out is None:
        c = out.new_zeros(out.shape, dtype=torch.float32)
    else:
        c = steps.padded(grad_out.float(), direction, copy=grad_h is not None)
    if grad_h is None:
        return c
    if steps.last is None:
        c[-1].add_(grad_h)
    else:
        c.index_put_(steps.last, grad_h.float(), accumulate=True)
    return c


def _autocast_float16(device_type: str) -> torch.dtype | None:
    """torch.float16 while float16 autocast is on for the device (torch's
    recurrence then computes its gates, and their gradients, in float16),
    else None."""
    on = autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16
    return torch.float16 if on else None


def _biases_for_backward(mode: str, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None) -> tuple:
    """What backward reads of the biases, as torch's backward reads none of
    them: the RNN's Jacobians and gradients do not depend on them (None, None);
    the GRU recomputes its gates from them (torch saves the gates), so it
    keeps copies (3H values each) of the biases this forward read. A bias
    changed in place before backward (an optimizer or EMA step under no_grad)
    is then no version error, and the gradients are the forward's, as torch's."""
    if mode != "GRU" or b_ih is None:
        return None, None
    return b_ih.clone(), b_hh.clone()


class _Steps:
    """Where a layer's steps lie, and the layout its scans run in. A layer's
    tensors (its input, output and their gradients) are (T, B, F), or a
    PackedSequence's rows (N, F), as torch's kernels take and give them;
    each direction's scan takes (T, B, F) with every sample's steps in the
    order that direction runs them, the padding 0 (so that padded steps get
    no gradient: each sequence's gradients are those of its own length)."""

    def __init__(self, batch_sizes: torch.Tensor | None = None, device: torch.device | None = None):
        self.batch_sizes = batch_sizes
        # None: (T, B, F) tensors, every step valid, the reverse direction's the flipped steps
        self.last = self._places = None
        if batch_sizes is None:
            return
        self.T, self.B = len(batch_sizes), int(batch_sizes[0])
        lengths = (batch_sizes.unsqueeze(1) > torch.arange(self.B)).sum(0)
        steps = torch.repeat_interleave(torch.arange(self.T), batch_sizes)
        rows = torch.arange(len(steps)) - torch.repeat_interleave(torch.cumsum(batch_sizes, 0) - batch_sizes,
                                                                  batch_sizes)
        # each packed row's (step, sample) place for the forward direction and
        # for the reverse one, which reads a sample backwards from its own last step
        places = [(steps, rows), (lengths[rows] - 1 - steps, rows)]
        self._places = [tuple(index.to(device) for index in place) for place in places]
        self.last = ((lengths - 1).to(device), torch.arange(self.B, device=device))

    def padded(self, t: torch.Tensor, direction: int, copy: bool = False) -> torch.Tensor:
        """t, in the layer's layout, in `direction`'s scan layout, contiguous:
        t itself where it already is, unless `copy`."""
        if self._places is None and direction == 0:
            return t.clone(memory_format=torch.contiguous_format) if copy else t.contiguous()
        if self._places is None:
            return t.flip(0).contiguous()
        return t.new_zeros(self.T, self.B, t.shape[-1]).index_put_(self._places[direction], t)

    def unpadded(self, t: torch.Tensor, direction: int) -> torch.Tensor:
        """padded's inverse (padded steps left out)."""
        if self._places is None:
            return t if direction == 0 else t.flip(0)
        return t[self._places[direction]]


def _layer_weights_for_backward(mode: str, weights: Sequence[torch.Tensor | None]) -> list:
    """weights (w_ih, w_hh, b_ih, b_hh for each direction) as backward keeps them."""
    kept = []
    for w_ih, w_hh, b_ih, b_hh in zip(*[iter(weights)] * 4):
        kept += [w_ih, w_hh, *_biases_for_backward(mode, b_ih, b_hh)]
    return kept


class _Layer(torch.autograd.Function):
    """(out, h_n) = one layer (both directions where hx has two) of x with
    PyTorch's forward (_forward_layer); backward through one scan per
    direction. h_n (dirs, B, H), each sample's last states, is an output of
    its own, as nn.RNN's is: hooks on the output see only the output's
    gradient. x, out and their gradients are in `steps`' layout (_Steps).

    Saves x, hx, W_ih, W_hh and out (what nn.RNN's own backward keeps), and
    for the GRU copies of its biases (_biases_for_backward): its gates are
    recomputed in backward in one parallel pass. Beyond grad_out and the
    gradients it returns, backward holds per direction (T, B, H) float32
    buffers: one for the RNN (d, out of the scan), six for the GRU (its
    gates' pre-activations, everything later in place over them), plus c
    when both outputs get a gradient (grad_out with grad_h added: the sum
    autograd made when h was a view of out). A direction whose steps lie
    otherwise in the layer's tensors (the reverse one, a bidirectional
    layer's halves, packed rows) takes its x, out and grad_out in copies.

    Under float16 autocast torch's backward holds the gates' gradients, the
    state gradient where it enters them and the weights' gradients in
    float16, so past 65504 they are inf and a GradScaler skips the step. The
    scan still runs in float32, but those values are rounded through
    float16 (ctx.held) so that they overflow where torch's do; the RNN then
    keeps g in a buffer of its own. bfloat16 has float32's range: nothing
    to overflow, and its rounding is left out (README)."""

    @staticmethod
    def forward(ctx, mode, levels, steps, x, hx, *weights):
        out, h_n = _forward_layer(mode, x, hx, weights, steps.batch_sizes)
        ctx.mode, ctx.levels, ctx.steps, ctx.device_type = mode, levels, steps, x.device.type
        ctx.held = _autocast_float16(ctx.device_type)
        ctx.dtypes = [t if t is None else t.dtype for t in (x, hx, *weights)]
        ctx.save_for_backward(x, hx, *_layer_weights_for_backward(mode, weights), out)
        # an unused output's gradient stays None, not a (T, B, H) of zeros
        ctx.set_materialize_grads(False)
        return out, h_n

    @staticmethod
    @eager_under_compile  # (see scan: a backward run from a compiled step was traced too)
    def backward(ctx, grad_out, grad_h):
        if torch.is_grad_enabled():
            # once_differentiable would only refuse a grad_out that needs grad:
            # a loss linear in the output (a critic's score) would silently
            # lose the penalty's second-order terms
            raise RuntimeError("reprop.bppsa: double backward (create_graph=True, as a gradient "
                               "penalty through the recurrence needs) is not supported; use "
                               f"torch.nn.RNN/GRU for it ({DOUBLE_BACKWARD_CALLERS})")
        if any(g is not None and torch_only(g) for g in (grad_out, grad_h)):
            raise RuntimeError("reprop.bppsa: batched gradients (autograd.grad(is_grads_batched="
                               "True), jacobian(vectorize=True), gradcheck's batched check) have "
                               "no storage for the scan; use vectorize=False / "
                               "check_batched_grad=False, or torch.nn.RNN/GRU")
        if autocast_enabled(ctx.device_type):
            # backward called inside the autocast region, as torch's own backward
            # may be: its GEMMs must stay float32 (autocast made h0's product
            # bf16/fp16, which then met float32 in addmm_: a RuntimeError)
            # (not torch.autocast(enabled=False): without_autocast)
            return without_autocast(ctx.device_type, _Layer._backward, ctx, grad_out, grad_h)
        return _Layer._backward(ctx, grad_out, grad_h)

    @staticmethod
    def _backward(ctx, grad_out, grad_h):
        """backward's scans and products, outside autocast."""
        x, hx, *weights, out = [t.float() if t is not None else None for t in ctx.saved_tensors]
        # the scan reads c's memory: a lazily negated gradient holds -g there
        grad_out, grad_h = (g if g is None else g.resolve_neg() for g in (grad_out, grad_h))
        need_x, _, *need_weights = ctx.needs_input_grad[3:]
        grad_x, grad_hx, grad_weights = None, [], []
        for d in range(len(hx)):
            own = slice(4 * d, 4 * d + 4)
            products, grad_h0 = _direction_backward(ctx, d, x, hx[d], weights[own], out, grad_out, grad_h,
                                                    [need_x, *need_weights[own]])
            grad_x = products[0] if grad_x is None else grad_x.add_(products[0])
            grad_hx.append(grad_h0)
            grad_weights += products[1:]
        grads = [grad_x, torch.stack(grad_hx), *grad_weights]
        grads = [gr.to(dtype) if gr is not None else None for gr, dtype in zip(grads, ctx.dtypes)]
        return (None, None, None, *grads)


def _direction_backward(ctx, d: int, x: torch.Tensor, h0: torch.Tensor, weights: list, out: torch.Tensor,
                        grad_out: torch.Tensor | None, grad_h: torch.Tensor | None, needs: list) -> tuple:
    """_Layer.backward's scan and products for direction d, whose h0 is (B, H)
    and weights (w_ih, w_hh, b_ih, b_hh) (float32; the biases None without
    bias, or for the RNN, which does not read them); `needs` tells which of
    x and the four weights need a gradient. Returns ([grad x in the layer's
    layout, grads of the weights], grad h0), None where not needed."""
    steps, H = ctx.steps, h0.shape[-1]
    own = slice(d * H, (d + 1) * H)
    x_d, out_d = steps.padded(x, d), steps.padded(out[..., own], d)
    x2 = x_d.reshape(-1, x_d.shape[-1])
    c = _step_gradients(None if grad_out is None else grad_out[..., own], None if grad_h is None else grad_h[d],
                        out_d, steps, d)
    w_ih, w_hh, b_ih, b_hh = weights
    if ctx.mode == "GRU":
        d_gi, d_gh, grad_h0 = _gru_backward(c, x2, h0, w_ih, w_hh, b_ih, b_hh, out_d, ctx.levels, ctx.held)
    else:
        d_gi, d_gh, grad_h0 = _rnn_backward(ctx.mode, c, w_hh, out_d, ctx.levels, ctx.held)
    need_x, need_w_ih, need_w_hh, need_b_ih, need_b_hh = needs
    # torch's products for x and the weights are float16 GEMMs (and sums)
    # under float16 autocast: rounded as they leave them (h0's was, above)
    products = [_blocks_matmul(d_gi, w_ih) if need_x else None,
                _stacked([_matmul_tn(block, x2) for block in d_gi]) if need_w_ih else None,
                _matmul_tn_prev(d_gh, h0, out_d) if need_w_hh else None,
                _stacked([_sum_rows(block) for block in d_gi]) if need_b_ih else None,
                _sum_rows(d_gh) if need_b_hh else None]
    products = [None if gr is None else _hold(gr, ctx.held) for gr in products]
    if need_x:
        products[0] = steps.unpadded(products[0], d)
    return products, grad_h0


# ---------------------------------------------------------------------------
# The modules
# ---------------------------------------------------------------------------

# nn.RNN/nn.GRU raise RuntimeError for a bad hx or input size (ValueError for
# an input dtype other than the weights'), where the modules' clearer checks
# raised ValueError and TypeError: each error below is an instance of both,
# so that code written against either catches it.
class _ArgError(ValueError, RuntimeError):
    """A wrong shape or size of hx or input."""


class _HxTypeError(TypeError, RuntimeError):
    """hx of a dtype or device other than input's."""


class _InputTypeError(TypeError, ValueError):
    """input of a dtype the module does not run: not real floating-point,
    or not the weights' outside autocast (nn raises ValueError for that)."""


def _check_input_dtype(input: torch.Tensor, weight_ih_l0: torch.Tensor) -> None:
    """input of the weights' dtype, or any under autocast (which casts both),
    as nn.RNN's check_input has it."""
    if weight_ih_l0.dtype != input.dtype and not autocast_enabled(input.device.type):
        # nn's class (ValueError) and TypeError, as README gives a dtype's
        # error: a plain ValueError escaped an `except TypeError`
        raise _InputTypeError(f"input: expected {weight_ih_l0.dtype} like the weights (weight_ih_l0), "
                              f"got {input.dtype}; convert the input or the module")


def _data(input) -> torch.Tensor:
    """The tensor of input's steps: a PackedSequence's rows, or input itself."""
    return input.data if isinstance(input, nn.utils.rnn.PackedSequence) else input


class _ScanRNNBase:
    """forward() of nn.RNN / nn.GRU, layer by layer (both directions at once),
    each through _Layer; mixed into subclasses of the torch modules so that
    parameters, state_dict, flatten_parameters and repr stay theirs."""

    @property
    def scan(self):
        """"auto", "linear", "blelloch" or a number of up-sweep levels."""
        # a module saved before scan was checked when set keeps it as "scan"
        return self.__dict__.get("_scan", self.__dict__.get("scan", "auto"))

    @scan.setter
    def scan(self, choice) -> None:  # checked when set, not in backward
        self.__dict__["_scan"] = _check_scan_choice(choice)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", scan={self.scan!r}"

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first; without it, it fails on the scan
        # property with "has no attribute '__dict__'"
        raise RuntimeError(f"torch.jit.script: reprop.bppsa.{type(self).__name__} runs the scan "
                           "from Python and cannot be scripted; script a torch.nn."
                           f"{type(self).__name__} with the same state_dict, or use "
                           "torch.jit.trace (which records torch's own recurrence)")

    def _weights_now(self) -> list:
        """Every weight in _flat_weights_names' order (layer by layer, direction
        by direction), as this forward reads it: getattr, which finds what
        weight_norm's hook set and what functional_call swapped in. A
        parametrized weight is computed at each read, so a parametrized
        module reads them as nn's forward does, by its _update_flat_weights
        (hasattr and getattr of each weight until one changed, then of every
        one, into _flat_weights): computed as often as under nn
        (spectral_norm's power iteration advances at each), the last
        computation used, as there. Any other read changes nothing: one each,
        half the cost."""
        if "parametrizations" not in self._modules:
            return [getattr(self, name) for name in self._flat_weights_names]
        self._update_flat_weights()
        return self._flat_weights

    def _direction_weights(self, weights: list, index: int) -> list:
        """(w_ih, w_hh, b_ih, b_hh) of layer * dirs + direction `index` out of
        _weights_now(); the biases None without bias."""
        per = 4 if self.bias else 2
        own = weights[index * per:(index + 1) * per]
        return own if self.bias else own + [None, None]

    def _check_input(self, input, hx, weight_ih_l0: torch.Tensor):
        if getattr(self, "proj_size", 0):
            raise ValueError(f"{type(self).__name__}: proj_size is not supported")
        _check_real_dense(input, "input", _InputTypeError)
        if input.dim() not in (2, 3):
            raise ValueError(f"input: expected a 2-D (unbatched) or 3-D tensor, got {input.dim()}-D")
        _check_input_dtype(input, weight_ih_l0)
        if input.shape[-1] != self.input_size:
            raise _ArgError(f"input: expected {self.input_size} features (input_size) in the last "
                            f"dimension, got {input.shape[-1]}")
        if hx is not None:
            _check_real_dense(hx, "hx", _HxTypeError)
            # Under autocast torch's kernels cast both (h_n of an autocast step is
            # bf16/fp16 and goes back in as hx with float32 input), as nn.RNN does.
            same_dtype = hx.dtype == input.dtype or autocast_enabled(input.device.type)
            if not same_dtype or hx.device != input.device:
                raise _HxTypeError(f"hx: expected {input.dtype} on {input.device} like input, got "
                                   f"{hx.dtype} on {hx.device}")

    def _initial_states(self, input: torch.Tensor, hx, B: int, batched: bool = True) -> torch.Tensor:
        """hx checked, or zeros; (layers * dirs, B, H). `batched` False: input
        and hx were unbatched, and unsqueezed to a batch of one."""
        shape = (self.num_layers * (2 if self.bidirectional else 1), B, self.hidden_size)
        if hx is None:
            return input.new_zeros(shape)
        if hx.shape != shape:
            if not batched:  # the shapes the caller gives: a 3-D hx is refused with unbatched input
                raise _ArgError(f"hx: expected shape {(shape[0], shape[2])} with unbatched input, got "
                                f"{(hx.shape[0], hx.shape[2])}")
            raise _ArgError(f"hx: expected shape {shape}, got {tuple(hx.shape)}")
        return hx

    def _torch_runs(self, input, hx) -> bool:
        """Whether torch's own recurrence runs this call, decided before
        _weights_now reads the weights: torch's forward reads them itself, and
        a parametrized weight read twice as often would be computed twice as
        often. A weight that is itself one the scan cannot carry (one
        functional_call swapped in, one weight_norm's hook set) is found by
        forward after the read, and reading it again in torch's forward
        computes nothing. The one exception: a parametrization that produces
        a torch_only weight from plain originals is computed twice on that
        call (once by the read, once by torch's forward)."""
        return (self._needs_torch_own(input, hx) or self._in_float64(input) or self._no_scan_fits(input)
                or self._no_sequence(input))

    def _needs_torch_own(self, input, hx) -> bool:
        """Whether a tensor of the call is one the scan cannot carry (functorch
        transforms, forward-AD duals, meta, subclasses such as FakeTensor,
        jit.trace), or any while a torch.func transform is active (a module
        or input it closes over, which it does not wrap): torch's own
        recurrence, which differentiates them all. A parametrized weight is
        one when a tensor it is computed from is (an original functional_call
        swapped in, a parametrization's parameter or buffer), which is seen
        without computing it."""
        if transform_active():
            return True
        if any(isinstance(t, torch.Tensor) and torch_only(t) for t in (_data(input), hx)):
            return True
        parametrizations = self._modules.get("parametrizations")
        return parametrizations is not None and any(
            map(torch_only_weight, itertools.chain(parametrizations.parameters(), parametrizations.buffers())))

    def _in_float64(self, input) -> bool:
        """Whether input is float64, which the float32 scan would round:
        torch's own recurrence then, with nn's float64 results and gradients
        (model.double(), gradcheck). Weights of another dtype raise as in
        the scan's path, outside autocast; they are seen as nn's check sees
        them, in _flat_weights (which setattr, functional_call and _apply
        keep current), so that no parametrization is computed an extra time."""
        data = _data(input)
        if not (isinstance(data, torch.Tensor) and data.dtype == torch.float64):
            return False
        _check_input_dtype(data, self._flat_weights[0])
        return True

    def _no_scan_fits(self, input) -> bool:
        """Whether scan="auto" finds no scan that runs over this hidden size on
        input's device (the CUDA scan's shared memory): torch's recurrence
        then, with the same gradients. A forced choice is refused at backward."""
        data = _data(input)
        return (self.scan == "auto" and isinstance(data, torch.Tensor)
                and not _scan_fits(data.device, self.hidden_size, 0))

    def _no_sequence(self, input) -> bool:
        """Whether input is a batch of no sequence: nothing to scan, torch's
        own empty result."""
        return isinstance(input, torch.Tensor) and input.dim() == 3 and \
            input.shape[0 if self.batch_first else 1] == 0

    def forward(self, input, hx=None):
        # Under torch.compile Dynamo does not trace nn.RNN/nn.GRU (allow_rnn is
        # off): it breaks the graph at the module's call and runs it with its
        # frame hook still on, so it compiled this module's Python frames one
        # by one (two UserWarnings about the C checks, inductor's bits for
        # the forward, not nn's). They run eagerly instead, as nn's do.
        if compiling() or _eval_frame_callback() is not None:
            return self._forward_under_dynamo(input, hx)
        return self._forward(input, hx)

    def _forward_under_dynamo(self, input, hx):
        """forward() where Dynamo is on: traced with allow_rnn (strict
        torch.export sets it, or the user), torch's own recurrence, which
        Dynamo traces as it traces nn's (the scan's backward cannot be in a
        graph); else this module eagerly, its frames not compiled."""
        if torch.compiler.is_dynamo_compiling() and torch._dynamo.config.allow_rnn:
            return super().forward(input, hx)
        return self._forward_eagerly(input, hx)

    def _forward(self, input, hx=None):
        if self._torch_runs(input, hx):
            return super().forward(input, hx)
        weights = self._weights_now()
        if any(map(torch_only_weight, weights)):  # one swapped in, or one a weight_norm hook set
            return super().forward(input, hx)
        if isinstance(input, nn.utils.rnn.PackedSequence):
            return self._forward_packed(input, hx, weights)
        self._check_input(input, hx, weights[0])
        batched = input.dim() == 3
        if hx is not None and hx.dim() != input.dim():
            raise _ArgError(f"hx: expected a {input.dim()}-D tensor with "
                            f"{'batched' if batched else 'unbatched'} {input.dim()}-D input, "
                            f"got {hx.dim()}-D")
        if not batched:
            # at nn's batch dim, then transposed like a batch: torch's input
            # projection (a matmul without bias) folds a (T, 1, I) of other
            # strides otherwise where a weight does not require grad (other bits)
            input = input.unsqueeze(0 if self.batch_first else 1)
            hx = hx.unsqueeze(1) if hx is not None else None
        if self.batch_first:
            input = input.transpose(0, 1)
        if input.shape[0] == 0:
            raise _ArgError("input: expected a sequence of at least one step")
        output, h_n = self._layers(input, self._initial_states(input, hx, input.shape[1], batched), weights,
                                   _Steps())
        if not batched:
            return output.squeeze(1), h_n.squeeze(1)
        return (output.transpose(0, 1) if self.batch_first else output), h_n

    _forward_eagerly = torch.compiler.disable(_forward, reason=(
        "reprop.bppsa's RNN/GRU run eagerly under torch.compile, as nn.RNN/nn.GRU do (one graph "
        "break); compile without fullgraph=True, or set torch._dynamo.config.allow_rnn=True to trace "
        "torch's own recurrence"))

    def _forward_packed(self, input: nn.utils.rnn.PackedSequence, hx, weights: list):
        """A PackedSequence as torch's modules take it (batch_first has no say,
        hx and h_n in the caller's batch order), each layer's forward over its
        rows as torch's; scanned as a padded batch sorted by length (_Steps)."""
        data, batch_sizes, sorted_indices, unsorted_indices = input
        if hx is not None and hx.dim() != 3:
            raise _ArgError(f"hx: expected a 3-D tensor with a PackedSequence, got {hx.dim()}-D")
        self._check_input(data, hx, weights[0])
        hx = self._initial_states(data, hx, int(batch_sizes[0]))
        if sorted_indices is not None:
            hx = hx.index_select(1, sorted_indices.to(hx.device))
        output, h_n = self._layers(data, hx, weights, _Steps(batch_sizes, data.device))
        if unsorted_indices is not None:
            h_n = h_n.index_select(1, unsorted_indices.to(h_n.device))
        return type(input)(output, batch_sizes, sorted_indices, unsorted_indices), h_n

    def _layers(self, input: torch.Tensor, hx: torch.Tensor, weights: list, steps: _Steps):
        """All layers over input, (T, B, I) or a PackedSequence's rows as
        `steps` says, with `weights` (_weights_now()); each layer, both
        directions, is one _Layer. Dropout between layers is drawn as torch
        draws it, over the layer's output as it lies (a PackedSequence's
        rows, in their order), so that a seed gives nn's masks and leaves
        the generator where nn does. Returns the output, laid out as input,
        and h_n."""
        dirs = 2 if self.bidirectional else 1
        layer_in, h_n = input, []
        for layer in range(self.num_layers):
            first = layer * dirs
            own = [w for index in range(first, first + dirs) for w in self._direction_weights(weights, index)]
            layer_in, h = _Layer.apply(self.mode, self.scan, steps, layer_in, hx[first:first + dirs], *own)
            h_n.append(h)
            if self.dropout and self.training and layer + 1 < self.num_layers:
                layer_in = nn.functional.dropout(layer_in, self.dropout, True)
        return layer_in, _stacked(h_n)


class RNN(_ScanRNNBase, nn.RNN):
    """torch.nn.RNN (tanh or relu) whose backward is a BPPSA scan.

    Same arguments, parameters and state_dict as nn.RNN, plus keyword ``scan``
    ("auto", "linear", "blelloch" or a number of up-sweep levels). Input
    (T, B, I), (B, T, I) with batch_first, or unbatched (T, I); float32, or
    lower precision under autocast (the scan itself runs in float32); a
    float64 module runs torch's own recurrence, with nn's float64 results."""

    def __init__(self, *args, scan="auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.scan = scan


class GRU(_ScanRNNBase, nn.GRU):
    """torch.nn.GRU whose backward is a BPPSA scan; see :class:`RNN`.

    The scan's Jacobians need the gates r, z, n, which PyTorch's fused GRU
    does not expose: backward recomputes them for all steps at once (two
    GEMMs and element-wise work), instead of saving them in forward."""

    def __init__(self, *args, scan="auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.scan = scan


_CONVERSIONS = {nn.RNN: RNN, nn.GRU: GRU}
# BPPSA classes by name, not identity: a module converted before an
# importlib.reload of this module (IPython's autoreload) has the old class
_CONVERTED = {class_key(cls) for cls in _CONVERSIONS.values()}


def _own_class(module: nn.Module) -> type:
    """module's class, seen through the subclass torch.nn.utils.parametrize
    swaps in (it only computes the parametrized tensors when they are read)."""
    cls = type(module)
    return cls.__bases__[0] if parametrize.is_parametrized(module) else cls


def _parametrized_over(cls: type, target: type) -> type:
    """The subclass parametrize made for one module, `cls` (its dict holds the
    properties that compute the parametrized tensors), over target instead
    of its base: the module's parametrizations, originals and all, stay as
    they are, and removing the last one leaves a `target`."""
    return type(cls.__name__, (target,), dict(vars(cls)))


def convert(model: nn.Module, scan="auto") -> list[str]:
    """Turns every torch.nn.RNN and torch.nn.GRU in `model` (the model itself
    included) into its BPPSA version in place, keeping parameters, buffers,
    hooks and parametrizations; returns the qualified names of the modules
    converted. BPPSA modules already there are not listed but take `scan`.
    Exact classes only: subclasses may override forward and are left alone.
    An LSTM is left as it is, with a UserWarning naming it (not supported),
    and so is an RNN or GRU whose forward is not torch's, set on the
    instance (accelerate's hooks) or on its class (nn.GRU.forward = ...),
    which BPPSA's would silently drop."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    _check_scan_choice(scan)
    changed, left = [], []
    for name, module in model.named_modules():
        own = _own_class(module)
        target = _CONVERSIONS.get(own)
        replaced = None if target is None else _replaced_forward(module, own)
        if replaced is not None:
            left.append((name, module, f"{replaced}, and BPPSA's forward would drop what it computes"))
        elif target is not None:
            module.__class__ = target if type(module) is own else _parametrized_over(type(module), target)
            module.scan = scan
            changed.append(name)
        elif any(class_key(cls) in _CONVERTED for cls in own.__mro__):
            # converted before, or made as a BPPSA module (a subclass of one too,
            # which kept its own scan): the scan asked for now
            module.scan = scan
        elif isinstance(module, nn.LSTM):
            left.append((name, module, "LSTM is not supported (only nn.RNN and nn.GRU)"))
    # after the loop: a warning raised as an error (-W error) stopped it half-way
    for name, module, why in left:
        _warn_left(name, module, why)
    return changed


def _replaced_forward(module: nn.Module, cls: type) -> str | None:
    """For messages, how `module`, of torch class `cls`, runs a forward other
    than torch's own (_tensors.replaced_forward), or None: neither BPPSA's
    class nor the chain's torch Jacobians would see what it computes."""
    where = replaced_forward(module, cls)
    if where == "instance":
        return "its forward was set on the instance"
    if where == "class":
        return f"torch.nn.{cls.__name__}.forward is not torch's own (it was replaced on the class)"
    return None


def _warn_left(name: str, module: nn.Module, why: str) -> None:
    """convert's ReproPWarning (a UserWarning) for a module (qualified `name`)
    it leaves as it is, pointing at convert's caller."""
    where = repr(name) if name else "the model itself"
    warn_at_users_line(f"reprop.bppsa.convert: left {where} ({type(module).__name__}) as it is: {why}")


# ---------------------------------------------------------------------------
# The paper's synthetic task
# ---------------------------------------------------------------------------

def bitstream(num_samples: int, seq_len: int, *, generator: torch.Generator | None = None,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The bitstream classification task of the paper's Eq. 8: labels c in 0..9
    and bits x_t ~ Bernoulli(0.05 + 0.1 c). Returns x (seq_len, num_samples, 1)
    float32 and labels (num_samples,) int64, generated on the CPU from
    `generator` and moved to `device`."""
    labels = torch.randint(0, 10, (num_samples,), generator=generator)
    p = (0.05 + 0.1 * labels.float()).expand(seq_len, num_samples)
    x = torch.bernoulli(p, generator=generator).unsqueeze(-1)
    return x.to(device), labels.to(device)


# ---------------------------------------------------------------------------
# The sparse chain (Section 4.3): CSR transposed Jacobians, planned products
# ---------------------------------------------------------------------------

_SHARED = 0x80000000  # RP_CSR_SHARED: an address in the shared buffer (csrc/reprop.h)

# Element-wise layers whose transposed Jacobian is diag(f'(x)).
_ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.GELU, nn.SiLU, nn.Mish,
                nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
                nn.LogSigmoid, nn.Softsign, nn.Tanhshrink)


# The chain's layer classes. Exact classes only, as convert() takes them: the
# Jacobians are those of these classes' own forward, which a subclass (a
# weight-standardizing Conv2d, torch.ao.nn.qat's fake-quantizing Conv2d and
# Linear) may override.
_CHAIN_CLASSES = (nn.Conv2d, nn.MaxPool2d, nn.Linear, nn.Flatten, *_ELEMENTWISE)

# The chain classes with a weight, whose Jacobian values it is.
_WEIGHTED = (nn.Conv2d, nn.Linear)

# Forward pre-hooks of torch's weight reparametrizations (pruning masks, the
# hook-based weight_norm and spectral_norm): they only set `weight` before
# forward, and the Jacobian reads the weight they set.
_WEIGHT_PRE_HOOKS = (BasePruningMethod, WeightNorm, SpectralNorm)


def _chain_class(layer: nn.Module) -> type:
    """layer's class, seen through the subclass torch.nn.utils.parametrize
    swaps in (_own_class)."""
    cls = type(layer)
    return cls if cls in _CHAIN_CLASSES else _own_class(layer)  # the first test is the cheap one


def _fusion_hook(hook) -> bool:
    """reprop.fuse's module hooks only apply pending updates to the weights
    (which the chain reads) and count micro-batches."""
    return is_instance_by_name(hook_owner(hook), fusion.FusionHandle)


# torch's module trackers, whose global hooks record which module runs and
# return None: (module, class), looked up in sys.modules, not imported (no
# tracker exists before its module is imported)
_TRACKERS = (("torch.utils.module_tracker", "ModuleTracker"),  # FlopCounterMode's
             ("torch.distributed._tools.mod_tracker", "ModTracker"))


def _tracker_hook(hook) -> bool:
    """Whether `hook` is a method of one of torch's module trackers."""
    owner = getattr(hook, "__self__", None)
    return owner is not None and any(
        isinstance(owner, getattr(sys.modules.get(module), name, ()))
        for module, name in _TRACKERS)


def _may_change_output(hooks) -> bool:
    """Whether one of these forward hooks or pre-hooks may change what a layer
    computes: all but the weight reparametrizations', reprop.fuse's and
    torch's module trackers' (FlopCounterMode's)."""
    return any(not isinstance(hook, _WEIGHT_PRE_HOOKS) and not _fusion_hook(hook)
               and not _tracker_hook(hook) for hook in hooks)


def _check_hooks(layer: nn.Module, name: str) -> None:
    """Hooks the chain would silently skip: forward hooks and pre-hooks may
    change the layer's input or output, backward hooks its gradients, and
    the scan runs neither through autograd."""
    kind = type(layer).__name__
    if _may_change_output((*layer._forward_pre_hooks.values(), *layer._forward_hooks.values())):
        raise ValueError(f"{name}: {kind} has forward hooks or pre-hooks, which may change what it "
                         "computes; chain Jacobians are those of the plain layer (remove the hooks "
                         "or use autograd)")
    if layer._backward_hooks or layer._backward_pre_hooks:
        raise ValueError(f"{name}: {kind} has backward hooks, which the chain's scan never calls "
                         "(remove them or use autograd)")


# torch's global module hooks, which every module's call runs (the chain's
# layers' too): (the function registering them, their dict in
# torch.nn.modules.module, which torch fills and empties in place)
_GLOBAL_FORWARD_HOOKS = (("register_module_forward_pre_hook", nn.modules.module._global_forward_pre_hooks),
                         ("register_module_forward_hook", nn.modules.module._global_forward_hooks))
_GLOBAL_BACKWARD_HOOKS = (("register_module_full_backward_pre_hook", nn.modules.module._global_backward_pre_hooks),
                          ("register_module_full_backward_hook (or register_module_backward_hook)",
                           nn.modules.module._global_backward_hooks))
_GLOBAL_HOOKS = tuple(hooks for _, hooks in (*_GLOBAL_FORWARD_HOOKS, *_GLOBAL_BACKWARD_HOOKS))


def _check_global_hooks(name: str) -> None:
    """torch's global module hooks, refused as _check_hooks refuses a
    layer's own (with its exemptions); `name` is the layers' argument."""
    if not any(_GLOBAL_HOOKS):  # the usual case, once per backward: one cheap test
        return
    for register, hooks in _GLOBAL_FORWARD_HOOKS:
        if _may_change_output(hooks.values()):
            raise ValueError(f"{name}: a global module hook (torch.nn.modules.module.{register}) is "
                             "registered, which may change what the layers compute; chain Jacobians "
                             "are those of the plain layers (remove it or use autograd)")
    for register, hooks in _GLOBAL_BACKWARD_HOOKS:
        if hooks:
            raise ValueError(f"{name}: a global module backward hook (torch.nn.modules.module."
                             f"{register}) is registered, which the chain's scan never calls "
                             "(remove it or use autograd)")


def _pair(value, name: str) -> tuple[int, int]:
    """A pooling argument as torch expands it: an int or one int for both
    dimensions, or two ints."""
    pair = (value,) if isinstance(value, int) else tuple(value)
    if len(pair) not in (1, 2):
        raise ValueError(f"{name}: expected an int or a sequence of 1 or 2 ints, got {value!r}")
    return (pair[0], pair[0]) if len(pair) == 1 else pair


def _conv_geometry(layer: nn.Conv2d, shape: tuple, name: str) -> tuple[tuple, tuple]:
    if layer.padding_mode != "zeros":
        raise ValueError(f"{name}: Conv2d padding_mode={layer.padding_mode!r} is not supported "
                         "(only 'zeros')")
    if len(shape) != 3 or shape[0] != layer.in_channels:
        raise ValueError(f"{name}: Conv2d: expected an input of shape ({layer.in_channels}, H, W) per "
                         f"sample (in_channels={layer.in_channels}), got {shape}")
    c, h, w = shape
    kh, kw = layer.kernel_size
    sh, sw = layer.stride
    dh, dw = layer.dilation
    (ph, th), (pw, tw) = _conv_padding(layer, name)
    ho = (h + th - dh * (kh - 1) - 1) // sh + 1
    wo = (w + tw - dw * (kw - 1) - 1) // sw + 1
    if ho < 1 or wo < 1:  # as torch's conv2d refuses it (csrc/jacobian.c would, unnamed)
        raise ValueError(f"{name}: Conv2d: an input of (H, W) = ({h}, {w}) per sample, padded, is "
                         f"smaller than the dilated kernel; the output would be ({ho}, {wo})")
    # the Jacobian's pattern takes the padding before; the output size says what is after
    geom = (c, h, w, layer.out_channels, ho, wo, kh, kw, sh, sw, ph, pw, dh, dw, layer.groups)
    return geom, (layer.out_channels, ho, wo)


def _conv_padding(layer: nn.Conv2d, name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(before, total) padding of each spatial axis of a Conv2d as torch
    applies it: "same" (stride 1) pads the dilated kernel's reach d (k - 1)
    in all, half of it before, so an odd total puts the extra one after."""
    if layer.padding == "valid":
        return (0, 0), (0, 0)
    if layer.padding == "same":
        return tuple((d * (k - 1) // 2, d * (k - 1)) for k, d in zip(layer.kernel_size, layer.dilation))
    return tuple((p, 2 * p) for p in _pair(layer.padding, f"{name}.padding"))


def _pool_args(layer: nn.MaxPool2d, name: str) -> tuple:
    """(kernel, stride, padding, dilation) pairs as torch expands them: an
    empty or None stride is the kernel size."""
    kernel, stride = _pair(layer.kernel_size, f"{name}.kernel_size"), layer.stride
    if stride is None or (not isinstance(stride, int) and len(stride) == 0):
        stride = kernel
    return (kernel, _pair(stride, f"{name}.stride"), _pair(layer.padding, f"{name}.padding"),
            _pair(layer.dilation, f"{name}.dilation"))


def _pool_geometry(layer: nn.MaxPool2d, shape: tuple, name: str) -> tuple[tuple, tuple]:
    if len(shape) != 3:
        raise ValueError(f"{name}: MaxPool2d: expected an input of shape (C, H, W) per sample, got {shape}")
    c, h, w = shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _pool_args(layer, name)
    try:  # torch's own checks of the arguments and output size, on no data
        out = torch.nn.functional.max_pool2d(torch.empty(1, c, h, w, device="meta"), (kh, kw), (sh, sw),
                                             (ph, pw), (dh, dw), layer.ceil_mode)
    except RuntimeError as e:
        raise ValueError(f"{name}: MaxPool2d: {e}") from None
    ho, wo = out.shape[-2:]
    return (c, h, w, c, ho, wo, kh, kw, sh, sw, ph, pw, dh, dw, 1), (c, ho, wo)


def _window_starts(out: int, s: int, p: int, d: int) -> list[int]:
    """Where torch's max_pool2d starts each of the `out` windows along one
    axis (its CPU and CUDA kernels alike): at the window's first tap at or
    past 0, stepping by the dilation from o * s - p (Python's % takes that
    step from a negative start). torch refuses a padding past half the
    dilated kernel, so the start is always one of the window's taps."""
    return [o * s - p if o * s >= p else (o * s - p) % d for o in range(out)]


def _pool_starts(geom: tuple) -> tuple[tuple[int, list[int]], tuple[int, list[int]]]:
    """(input size, window starts) of the rows and of the columns of a
    pooling geometry (_pool_geometry's)."""
    _, h, w, _, ho, wo, _, _, sh, sw, ph, pw, dh, dw, _ = geom
    return (h, _window_starts(ho, sh, ph, dh)), (w, _window_starts(wo, sw, pw, dw))


def _padding_windows(geom: tuple) -> bool:
    """Whether a pooling window of the geometry lies entirely in the padding
    (possible with dilation > 1), its start past the input along an axis:
    torch outputs -inf there and records the index of its start (start_h * W
    + start_w), outside the window, where its backward sends the window's
    gradient and no Jacobian pattern of the window has an entry."""
    return any(max(starts) >= size for size, starts in _pool_starts(geom))


def _check_pool_indices(geom: tuple, name: str) -> None:
    """ValueError if torch's max_pool2d records, for a window lying in the
    padding, an index past the input plane (start_h * W + start_w; a window
    with an input records its maximum's, in the plane): torch's own CPU
    backward adds the window's gradient there, into another channel's input
    or past the tensor's memory (heap corruption), so no backward of the
    chain, torch's layer by layer included, can take the layer."""
    (h, rows), (w, cols) = _pool_starts(geom)
    index = max(rows) * w + max(cols)  # the largest index any window records
    if index >= h * w:
        raise ValueError(f"{name}: MaxPool2d has a window lying entirely in the padding, for which "
                         f"torch's max_pool2d records input index {index}, past the {h}x{w} input "
                         "plane: torch's own backward (on the CPU) adds that window's gradient "
                         "there, into another channel's input or past the tensor's memory. Change "
                         "the padding, dilation or input size")


def _listed(items, name: str, what: str) -> list:
    """The argument `name`, any iterable (a generator too), as a list; a
    TypeError naming it if it is not iterable (a bare module, None), saying
    it expected a sequence of `what`: its elements are checked as name[i]."""
    try:
        return list(items)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of {what}, got {_type_name(items)}") from None


def _check_sample_shape(shape, name: str) -> tuple[int, ...]:
    """One sample's shape as a tuple of Python ints >= 1 (numpy's ints too):
    a float or a bare int reached the layers' geometry as Python's own error."""
    dims = tuple(shape) if isinstance(shape, Sequence) and not isinstance(shape, str) else None
    if dims is None or not all(is_count(d) for d in dims):
        raise TypeError(f"{name}: expected one sample's shape, a sequence of ints, got {shape!r}")
    return tuple(check_count(d, name, 1, 2 ** 31 - 1) for d in dims)


def _check_chain_tensor(t, name: str, call: str) -> None:
    """What a chain's float32 Jacobian values can take: float64 would come
    back float32-accurate, so it is refused (the RNN modules hand float64
    to torch's recurrence; a chain has no such fallback of its own).
    `call`: the public function checking it, for _refuse_torch_only."""
    _check_real_dense(t, name)
    if t.dtype == torch.float64:
        raise TypeError(f"{name}: chain Jacobians are float32; got float64 (use autograd for "
                        "double precision)")
    if torch_only(t):
        _refuse_torch_only(name, call)


def _refuse_torch_only(name: str, call: str) -> None:
    """The chain and scan (`call`, the public function the user called, to
    call outside the transform) have no torch fallback, unlike the RNN modules: what only
    torch's ops can carry (torch_only) is refused, not silently stripped."""
    raise RuntimeError(f"{name}: a tensor of a torch.func transform (vmap, grad, jacrev, ...), a "
                       "forward-AD dual, a nested tensor, a tensor subclass or one under "
                       f"torch.jit.trace or a FakeTensorMode; {call} reads raw memory and records "
                       f"no graph for them. Call {call} outside the transform or mode, or use "
                       "autograd")


def _check_chain_layer(layer: nn.Module, name: str, call: str,
                       weight: torch.Tensor | None = None) -> torch.Tensor | None:
    """Refuses a layer the chain cannot take; returns its weight as its
    forward reads it now (None for a layer without one), for the caller to
    use rather than read it again: a parametrization computes it at each
    read (spectral_norm's in training mode runs a power iteration, which
    advances its state). `weight`: the one the layer's forward read, kept
    by ChainPlan.forward_inputs, checked instead of reading it again.
    `call`: the public function checking it, for _refuse_torch_only."""
    return _chain_weight(layer, _check_chain_module(layer, name), name, call, weight)


def _check_chain_module(layer: nn.Module, name: str) -> type:
    """_check_chain_layer's checks but the weight's, which read nothing a
    forward computes; returns the layer's chain class."""
    kind = _chain_class(layer)
    if kind not in _CHAIN_CLASSES:
        base = next((base for base in _CHAIN_CLASSES if issubclass(kind, base)), None)
        what = kind.__name__ if base is None else \
            f"{kind.__module__}.{kind.__qualname__} (a subclass of nn.{base.__name__})"
        raise TypeError(f"{name}: {what} is not supported; expected Conv2d, MaxPool2d, Linear, "
                        "Flatten, ReLU or an element-wise activation of torch.nn (those classes "
                        "themselves: a subclass may override forward)")
    replaced = _replaced_forward(layer, kind)
    if replaced is not None:
        raise TypeError(f"{name}: {replaced}; the chain's Jacobians are those of torch's layer and "
                        "would skip what it computes")
    _check_hooks(layer, name)
    if kind is nn.MaxPool2d and layer.return_indices:
        raise ValueError(f"{name}: MaxPool2d(return_indices=True) is not supported in a chain")
    if kind is nn.Flatten and (layer.start_dim, layer.end_dim) != (1, -1):
        raise ValueError(f"{name}: only Flatten(start_dim=1, end_dim=-1) is supported (each "
                         f"sample to one vector); got start_dim={layer.start_dim}, "
                         f"end_dim={layer.end_dim}")
    return kind


def _chain_weight(layer: nn.Module, kind: type, name: str, call: str,
                  weight: torch.Tensor | None = None) -> torch.Tensor | None:
    """The weight of a layer of chain class `kind` as _check_chain_layer
    returns it (`weight` if given, else read now), refused if the chain
    cannot take it."""
    # the weight as read, not _parameters' entry: a parametrized one (none
    # there) computed from what functional_call swapped in is a transform's
    # tensor or a dual as well
    if kind in _WEIGHTED and weight is None:
        weight = layer.weight
    if torch_only_weight(weight):
        _refuse_torch_only(f"{name}.weight", call)
    return weight


def _settings(layer: nn.Module, kind: type, name: str) -> tuple:
    """What a layer's Jacobian pattern is built from, besides its input shape
    and weight shape: its attributes changed in place would leave a plan the
    pattern and weight placement of the old layer (a silently wrong
    gradient). Element-wise layers' attributes are read at each backward."""
    if kind is nn.Conv2d:  # (an int written in place of a pair is the same setting)
        padding = layer.padding if isinstance(layer.padding, str) else _pair(layer.padding, f"{name}.padding")
        return (_pair(layer.kernel_size, f"{name}.kernel_size"), _pair(layer.stride, f"{name}.stride"),
                padding, _pair(layer.dilation, f"{name}.dilation"), layer.groups, layer.padding_mode)
    if kind is nn.MaxPool2d:
        return (*_pool_args(layer, name), layer.ceil_mode)
    return ()


def _unless_overwritten(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x, or a copy of it for an in-place layer (ReLU(inplace=True), ...),
    which would overwrite what the Jacobian is taken at."""
    return x.clone() if getattr(layer, "inplace", False) else x


def _input_grad(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor | None,
                dtype: torch.dtype, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of layer's input x (taken as `dtype`) for the gradient
    `grad` of its output (any shape of the output's size; None: ones), by
    the layer's own torch backward, selects included (ReLU's and MaxPool2d's
    0 for an inf gradient, where a product by 0 gives NaN). Taken outside
    inference mode, where autograd records nothing, on a copy of an inference
    tensor (one made in that mode), which autograd cannot take, and through
    forward(), not the module call: its hooks (reprop.fuse's count
    micro-batches) ran when the chain ran forward. A Conv2d or Linear takes
    `weight`, the one the chain's forward read (_forward_with)."""
    with torch.inference_mode(False), torch.enable_grad():
        xr = x.detach().to(dtype, copy=x.is_inference()).requires_grad_()
        out = _forward_with(layer, weight)(_unless_overwritten(layer, xr))
        grad = torch.ones_like(out) if grad is None else grad.reshape(out.shape).to(out.dtype)
        (d,) = torch.autograd.grad(out, xr, grad)
    return d


def _forward_with(layer: nn.Module, weight: torch.Tensor | None):
    """layer's forward; a Conv2d's or Linear's with `weight` rather than
    reading layer.weight again (a parametrization would compute it again).
    Without the bias, which no input gradient depends on."""
    if weight is None:
        return layer.forward
    return functools.partial(_functional(layer), weight=weight, bias=None)


def _functional(layer: nn.Module):
    """A Conv2d's or Linear's forward as a function of (input, weight, bias)."""
    return torch.nn.functional.linear if _chain_class(layer) is nn.Linear else layer._conv_forward


def _elementwise_derivative(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """f'(x) of an element-wise layer, exactly as autograd has it, in float32."""
    return _input_grad(layer, x, None, torch.float32)


def _index_on(cache: dict, name: str, index: np.ndarray, device: torch.device) -> torch.Tensor:
    """index as an int64 tensor on device, made once per (name, device) in cache."""
    key = (name, device)
    if key not in cache:
        cache[key] = torch.from_numpy(index).long().to(device)
    return cache[key]


class _Leaf:
    """One layer's CSR transposed Jacobian: its pattern (int32) and how to
    gather its values for a step. With `pruned`, a Conv2d's or Linear's
    entries whose weight is zero now are left out of the pattern. `name`
    says which layer it is in errors; the layer passed _check_chain_layer.
    `pruned` may also be the flat indices of the weights to take as zero:
    the mask of the plan being copied (ChainPlan.__reduce__). `weight` is
    the layer's as _check_chain_layer read it (None without one)."""

    def __init__(self, layer: nn.Module, in_shape: tuple, name: str, weight: torch.Tensor | None,
                 pruned: bool | np.ndarray = False):
        self.layer, self.in_shape, self.name = layer, in_shape, name
        self.kind = kind = _chain_class(layer)
        self.settings = _settings(layer, kind, name)
        self.torch_only = False  # whether only its torch backward gives torch's gradient
        size = math.prod(in_shape)
        if kind is nn.Conv2d:
            geom, self.out_shape = _conv_geometry(layer, in_shape, name)
            self.indptr, self.indices, self.wmap = _C.jacobian("conv2d", geom)
        elif kind is nn.MaxPool2d:
            geom, self.out_shape = _pool_geometry(layer, in_shape, name)
            _check_pool_indices(geom, name)  # before any backward can run torch's
            self.indptr, self.indices, self.omap, self.pmap = _C.jacobian("maxpool2d", geom)
            self.torch_only = _padding_windows(geom)
        elif kind is nn.Linear:
            if in_shape != (layer.in_features,):
                raise ValueError(f"{name}: Linear: expected an input of shape ({layer.in_features},) per "
                                 f"sample, got {in_shape}")
            self.out_shape = (layer.out_features,)
            self.indptr, self.indices, self.wmap = _C.jacobian("linear", (layer.in_features,
                                                                          layer.out_features))
        else:  # element-wise
            self.out_shape = in_shape
            self.indptr, self.indices = _C.jacobian("diagonal", (size, 0))
        self.rows, self.cols = size, math.prod(self.out_shape)
        self.shared = kind in _WEIGHTED  # weights: one set for the batch
        self.zero_weights = None  # flat indices of the weights the pattern assumes are zero
        self.weight_shape = weight.shape if self.shared else None
        self.weight_numel = weight.numel() if self.shared else 0
        if pruned is not False and hasattr(self, "wmap"):
            self._drop_zero_weights(_zero_weights(weight) if pruned is True else pruned)
        self._maps = {}

    def check_unchanged(self) -> None:
        """ValueError if the layer's settings, or the shape of a weight read
        as it lies (not computed at its forward, which reading now would
        run again: _SharedWeights.write checks that one), changed since the
        plan."""
        now = _settings(self.layer, self.kind, self.name)
        if now != self.settings:
            raise ValueError(f"{self.name}: {self.kind.__name__}'s settings changed since the "
                             f"ChainPlan was built (was {self.settings}, now {now}); build a new "
                             "ChainPlan")
        if self.shared and not _computed_weight(self.layer, self.kind):
            self.check_weight_shape(self.layer.weight)

    def check_weight_shape(self, weight: torch.Tensor) -> None:
        """ValueError if `weight` (this shared leaf's) is not of the plan's shape."""
        if weight.shape != self.weight_shape:
            raise ValueError(f"{self.name}: {self.kind.__name__}'s weight has shape "
                             f"{tuple(weight.shape)}, the ChainPlan was built for "
                             f"{tuple(self.weight_shape)}; build a new ChainPlan")

    def _drop_zero_weights(self, zero_weights: np.ndarray) -> None:
        """The pattern without the entries of the zero weights (flat indices):
        a fixed pruning mask's guaranteed zeros, which would otherwise fill
        in the products."""
        zero = np.zeros(self.weight_numel, dtype=bool)
        zero[zero_weights] = True
        keep = ~zero[self.wmap]
        rows = np.repeat(np.arange(self.rows), np.diff(self.indptr))
        counts = np.bincount(rows[keep], minlength=self.rows)
        self.indptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
        self.indices = np.ascontiguousarray(self.indices[keep])
        self.wmap = np.ascontiguousarray(self.wmap[keep])
        self.zero_weights = zero_weights

    def regrown(self, weight: torch.Tensor) -> bool:
        """Whether a weight the pattern dropped as zero is non-zero in
        `weight` (this layer's, flat)."""
        return self.zero_weights is not None and \
            bool(weight.index_select(0, self._map("zero_weights", weight.device)).any())

    def _map(self, name: str, device: torch.device) -> torch.Tensor:
        return _index_on(self._maps, name, getattr(self, name), device)

    def pattern(self) -> tuple:
        """csr_plan's leaf: a shared leaf's values are its layer's weights as
        they are, placed by the plan through wmap (never gathered per step)."""
        if self.shared:
            return (self.rows, self.cols, self.indptr, self.indices, True, self.wmap, self.weight_numel)
        return (self.rows, self.cols, self.indptr, self.indices, False, None, 0)

    def entry_values(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """(B, nnz): the value of every stored entry for the batch of inputs x,
        for inspection; a shared leaf's are its `weight` (the layer's, as
        _check_chain_layer read it) gathered through wmap, which the scan
        never does (the plan places the weights, _SharedWeights)."""
        if self.shared:
            flat = weight.detach().reshape(-1).to(torch.float32)
            return flat[self._map("wmap", x.device)].expand(x.shape[0], -1)
        dst = torch.empty(x.shape[0], self.indices.size, dtype=torch.float32, device=x.device)
        without_grad(self.write_values, x, dst)
        return dst

    def write_values(self, x: torch.Tensor, dst: torch.Tensor) -> None:
        """The (B, nnz) values of a leaf that is not shared, for the batch of
        inputs x, written straight into dst (float32, any strides: the
        scan's batch-minor buffer seen as (B, nnz)), with no temporary copy.
        Under torch.no_grad, the caller's (once per backward, not per
        layer): x may require grad, which out= refuses."""
        layer, B = self.layer, x.shape[0]
        if self.kind is nn.ReLU:  # autograd's threshold_backward: 0 where x <= 0, else 1
            torch.logical_not(x.reshape(B, -1) <= 0, out=dst)
        elif self.kind is nn.MaxPool2d:
            _, idx = torch.nn.functional.max_pool2d(
                x, layer.kernel_size, layer.stride, layer.padding, layer.dilation, layer.ceil_mode,
                return_indices=True)
            # gather, not indexing: 3x faster on the CPU
            picked = idx.reshape(B, -1).gather(1, self._map("omap", x.device).expand(B, -1))
            torch.eq(picked, self._map("pmap", x.device), out=dst)
        else:
            dst.copy_(_elementwise_derivative(layer, x).reshape(B, -1))


def _computed_weight(layer: nn.Module, kind: type) -> bool:
    """Whether layer's weight is computed at each forward: parametrize swaps
    in a subclass (the exact class is a plain layer, whose weight reads the
    same at backward and costs no cache), a weight pre-hook sets it."""
    return type(layer) is not kind or any(isinstance(hook, _WEIGHT_PRE_HOOKS)
                                          for hook in layer._forward_pre_hooks.values())


def _run_computed(leaf: _Leaf, x: torch.Tensor, weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """leaf's layer (a Conv2d or Linear whose weight is computed at each
    forward: _computed_weight) on x as its module call runs it, and the
    weight it computed with, kept for the backward: its forward pre-hooks
    (a weight pre-hook sets the weight: spectral_norm's), its forward with
    the weight and bias read once (or with `weight`, a parametrized weight
    read for this forward already: chain_backward's plan build), its
    forward hooks. Not the module call under torch's parametrize.cached(),
    which would make its read and a second one keeping it the same: that
    cache is process-wide, and another thread's forward of the model took
    the chain's weights (computed under no_grad: no gradient reached the
    originals) or one whose graph was freed. The hooks run here are only
    those the chain takes (the others refused first, as backward refuses
    them), which change no input or output."""
    layer = leaf.layer
    _check_hooks(layer, leaf.name)
    args = (x,)
    post = (*_global_forward_hooks.items(), *layer._forward_hooks.items())
    with_kwargs = layer._forward_hooks_with_kwargs.keys() | _global_forward_hooks_with_kwargs.keys()
    try:
        _call_hooks(layer, (*_global_forward_pre_hooks.items(), *layer._forward_pre_hooks.items()),
                    layer._forward_pre_hooks_with_kwargs, args)
        if weight is None:
            weight = layer.weight
        out = _functional(layer)(x, weight, layer.bias)
    except Exception:  # as torch, the hooks registered with always_call=True still run
        always = layer._forward_hooks_always_called.keys() | _global_forward_hooks_always_called.keys()
        _call_hooks(layer, [(key, hook) for key, hook in post if key in always], with_kwargs, args, None)
        raise
    _call_hooks(layer, post, with_kwargs, args, out)
    return out, weight


def _call_hooks(layer: nn.Module, hooks, with_kwargs, args: tuple, *out) -> None:
    """Calls each (key, hook) of `hooks` as torch's Module.__call__ does
    (with the keyword arguments too where its key is in `with_kwargs`; `out`:
    a forward hook's output argument). What they return is not used: the
    hooks the chain takes change no input or output (_may_change_output)."""
    for key, hook in hooks:
        if key in with_kwargs:
            hook(layer, args, {}, *out)
        else:
            hook(layer, args, *out)


def _zero_weights(weight: torch.Tensor) -> np.ndarray:
    """Flat indices of the weights that are zero in `weight`."""
    return np.flatnonzero((weight.detach().reshape(-1).cpu() == 0).numpy())


class _SharedWeights:
    """A plan's Conv2d and Linear weights (its shared leaves): copied into the
    shared buffer by one call and their pruned zeros checked by one gather per
    backward, for all layers at once (per layer, 4 to 6 torch calls each were
    most of a small pruned chain's backward). The plan's layout puts the
    shared leaves back to back after shared[0], in its own order (rp_csr_layout
    in csrc/scan.c)."""

    def __init__(self, leaves: Sequence[_Leaf], addrs: Sequence[int]):
        placed = sorted(((addr & ~_SHARED, leaf) for leaf, addr in zip(leaves, addrs) if addr & _SHARED),
                        key=lambda p: p[0])
        self.order = [leaf for _, leaf in placed]
        self.start = self.stop = placed[0][0] if placed else 1
        spans = {}  # leaf: [start, stop) of its weights in the concatenated ones
        for addr, leaf in placed:
            if addr != self.stop:  # what write() relies on: checked under python -O too
                raise RuntimeError("ChainPlan: the plan's shared leaves are not back to back "
                                   "(rp_csr_layout changed); this is a bug in reprop")
            self.stop += leaf.weight_numel
            spans[leaf] = (addr - self.start, self.stop - self.start)
        self.spans = [(leaf, *spans[leaf]) for leaf in leaves if leaf in spans]  # the chain's order
        self.sizes = [leaf.weight_numel for leaf in self.order]
        zeros = [leaf.zero_weights + spans[leaf][0] for leaf in self.order if leaf.zero_weights is not None]
        self.zero_weights = np.concatenate(zeros) if zeros else np.empty(0, np.int64)
        self._maps = {}

    def write(self, shared: torch.Tensor, now: dict) -> None:
        """The weights as they are now, `now` (each leaf's, as
        ChainPlan._checked_weights read it), into shared; ValueError if one the
        patterns dropped as zero is not zero any more. Under torch.no_grad,
        as _Leaf.write_values."""
        if not self.order:
            return
        weights = [now[leaf] for leaf in self.order]
        for leaf, w in zip(self.order, weights):
            leaf.check_weight_shape(w)
        weights = [w.reshape(-1) for w in weights]
        flat = shared[self.start:self.stop]
        if all(w.dtype == flat.dtype for w in weights):
            # straight into their spans: a concatenation first doubled the
            # bytes a backward allocates and freed (with large weights, the
            # pages went back to the OS and faulted in again every backward)
            torch._foreach_copy_(list(flat.split(self.sizes)), weights)
        else:  # as the layers hold them, so a float64 weight is checked in float64
            whole = torch.cat(weights)
            flat.copy_(whole)
            flat = whole
        if self.zero_weights.size and bool(flat.index_select(0, self._zeros_on(flat.device)).any()):
            self._raise_regrown(flat)

    def _zeros_on(self, device: torch.device) -> torch.Tensor:
        return _index_on(self._maps, "zero_weights", self.zero_weights, device)

    def _raise_regrown(self, flat: torch.Tensor) -> None:
        leaf = next(leaf for leaf, start, stop in self.spans if leaf.regrown(flat[start:stop]))
        raise ValueError(f"{leaf.name}: {type(leaf.layer).__name__}: weights that were zero when "
                         "the plan was built (pruned=True) are non-zero now; keep the pruning "
                         "mask applied or build a new ChainPlan")


_PRODUCTS = ("reprop", "cusparse")

def _check_product(product) -> str:
    if not isinstance(product, str) or product not in _PRODUCTS:
        raise ValueError(f"product: expected one of {_PRODUCTS}, got {product!r}")
    if product == "cusparse" and (reason := _cusparse_missing()) is not None:
        raise RuntimeError(f"product: 'cusparse' is not available: {reason}")
    return product


def _cusparse_missing() -> str | None:
    """Why this build cannot run the cuSPARSE peer, or None."""
    if _cuda is None:
        return cuda_missing()
    if not _cuda.build_info()["cusparse"]:
        return ("reprop's CUDA kernels were built without cuSPARSE's header, cusparse.h; "
                "pip install nvidia-cusparse (or set REPROP_CUSPARSE_INCLUDE to the folder "
                "holding cusparse.h) and rebuild reprop")
    return None


@functools.lru_cache(maxsize=None)
def _cusparse_library() -> str:
    """The nvidia-cusparse wheel's libcusparse.so.12, for when it is not loaded
    already (a CUDA build of torch loads it) nor on the library path; "" if none."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        for layout in ("cu13", "cu12", "cusparse"):
            path = os.path.join(root, layout, "lib", "libcusparse.so.12")
            if os.path.exists(path):
                return path
    return ""


def _aligned(n: int) -> int:
    """n rounded up to whole 16-byte (4-float) blocks, at least one: where
    cuSPARSE reads an array, it starts 16-byte aligned."""
    return max(4, -(-n // 4) * 4)


class _CusparsePeer:
    """The cuSPARSE peer's buffers and chain for one (plan, batch, device):
    every leaf's device pattern and values in CSR, a per-sequence leaf's as
    one 16-byte aligned row per sequence, the shared leaves' back to back in
    one buffer gathered through their wmaps (a step the program never
    takes), the vectors (slot, sequence, width), and the chain, which owns
    the products (kernels/scan.cu). cuSPARSE's own planning (the reuse
    stages) runs once, here; a backward refreshes values and computes."""

    def __init__(self, plan: "ChainPlan", B: int, device: torch.device):
        # the plan's own schedule over whole matrices (csrc/scan.c, rp_csr_plan_schedule):
        # matrix k - 1 is slot k's leaf, products (a, b, rows, cols, shared) follow
        sched, n = plan._peer_schedule, len(plan.leaves)
        strides = [_aligned(leaf.indices.size) for leaf in plan.leaves]
        starts = dict(zip(plan.leaves, plan._program["leaf_addr"].tolist()))
        shared = [i for i, leaf in enumerate(plan.leaves) if leaf.shared]
        self.raw = torch.zeros(plan._weights.stop, dtype=torch.float32, device=device)
        self.shared_values = torch.zeros(sum(strides[i] for i in shared), dtype=torch.float32, device=device)
        gather = np.zeros(self.shared_values.numel(), dtype=np.int64)
        values, offset = {}, 0
        for i in shared:  # value q of leaf i is raw[its start + wmap[q]]
            leaf = plan.leaves[i]
            gather[offset:offset + leaf.indices.size] = leaf.wmap + (starts[leaf] & ~_SHARED)
            values[i] = self.shared_values[offset:offset + strides[i]]
            offset += strides[i]
        self.gather = torch.from_numpy(gather).to(device)
        self.per_sequence = []  # (i, leaf, its (B, nnz) values)
        for i, leaf in enumerate(plan.leaves):
            if not leaf.shared:
                values[i] = torch.zeros(B, strides[i], dtype=torch.float32, device=device)
                self.per_sequence.append((i, leaf, values[i][:, :leaf.indices.size]))
        self.patterns = [(torch.from_numpy(leaf.indptr).to(device),
                          torch.from_numpy(np.append(leaf.indices, np.int32(0))).to(device))
                         for leaf in plan.leaves]  # one spare index: never an empty array
        self.width = _aligned(sched["width"])
        self.vectors = torch.zeros(sched["vectors"], B, self.width, dtype=torch.float32, device=device)
        self.g_out = self.vectors[0, :, :plan.leaves[-1].cols]
        # g_i, the gradient of layer i's input, ends in slot n - i + 1
        self.grads = [self.vectors[n - i + 1, :, :leaf.rows] for i, leaf in enumerate(plan.leaves)]
        mats = []
        for k in range(1, n + 1):  # matrix k - 1: slot k's leaf, layer n - k
            i = n - k
            leaf, (indptr, indices) = plan.leaves[i], self.patterns[i]
            mats.append((leaf.rows, leaf.cols, leaf.indices.size, -1, -1, int(leaf.shared), indptr.data_ptr(),
                         indices.data_ptr(), values[i].data_ptr(), strides[i]))
        mats += [(rows, cols, 0, a, b, shared, 0, 0, 0, 0)
                 for a, b, rows, cols, shared in sched["products"].tolist()]
        with on_device(device):
            self.chain = _cuda.cusparse_create(_cusparse_library(), np.array(mats, dtype=np.int64),
                                               sched["steps"], self.vectors.data_ptr(), B, sched["vectors"],
                                               self.width, current_stream_handle(device))

    def load(self, plan: "ChainPlan", inputs: Sequence[torch.Tensor], grad_output: torch.Tensor,
             weights: dict) -> None:
        """This step's values (`weights` as _SharedWeights.write takes them)
        and g_n into the buffers the chain reads. Under torch.no_grad, as
        _Leaf.write_values."""
        plan._weights.write(self.raw, weights)  # and the check that pruned weights stayed zero
        torch.index_select(self.raw, 0, self.gather, out=self.shared_values)
        for i, leaf, dst in self.per_sequence:
            leaf.write_values(inputs[i], dst)
        # zeroed first: cuSPARSE's documentation does not promise that beta = 0
        # leaves an output unread, and a NaN left by a non-finite step would stay
        self.vectors.zero_()
        self.g_out.copy_(grad_output.detach().reshape(grad_output.shape[0], -1))

    def run(self, device: torch.device) -> None:
        with on_device(device):
            _cuda.cusparse_run(self.chain, current_stream_handle(device))


class ChainPlan:
    """The planned sparse BPPSA of a chain of layers for one input shape.

    Builds every layer's CSR transposed Jacobian pattern (csrc/jacobian.c)
    and, once, the patterns and pair lists of every up-sweep product the
    chosen schedule needs; :meth:`backward` then only gathers values.
    `input_shape` is one sample's (C, H, W) or (features,). `levels`: "auto"
    (the cost model, from the exact product sizes), "linear", "blelloch" or
    an int; `max_pairs` caps a level's planned products (0: no cap).
    `pruned` (a bool): the Conv2d and Linear weights that are zero now are a fixed
    pruning mask (Section 4.3): their entries are left out of the patterns,
    so the products stay as sparse as the pruned network; backward raises
    ValueError if any of them has become non-zero.
    `product`: "reprop" (the plan's own pattern-reusing program, CPU or
    CUDA) or "cusparse", the peer: the same schedule with every CSR x CSR
    product by cuSPARSE's structure-reusing SpGEMM and every mat-vec by
    cusparseSpMM, CUDA tensors only (needs reprop built with cusparse.h and
    libcusparse.so.12 at run time; RuntimeError here if the build lacks it).
    The peer plans its products (work estimation, nnz, copy) once per batch
    size and device, at that first backward.
    copy.deepcopy and pickle (torch.save) rebuild the plan: see __reduce__."""

    def __init__(self, layers: Sequence[nn.Module], input_shape: Sequence[int], *, levels="auto",
                 max_pairs: int = 0, pruned: bool = False, product: str = "reprop"):
        self._checked_build("ChainPlan", layers, input_shape, levels, max_pairs, pruned, product)

    def _checked_build(self, call: str, layers, input_shape, levels="auto", max_pairs=0, pruned=False,
                       product="reprop") -> dict:
        """__init__ (the same defaults) for the public `call` (ChainPlan or
        chain_backward, named in a refusal); returns its build's reads of the
        parametrized weights (_build)."""
        product = _check_product(product)
        pruned = check_flag(pruned, "pruned")
        levels = _check_scan_choice(levels, "levels")
        max_pairs = _check_count(max_pairs, "max_pairs", 0)
        input_shape = _check_sample_shape(input_shape, "input_shape")
        layers = _listed(layers, "layers", "modules")
        if not layers:
            raise ValueError("layers: expected at least one layer")
        # an int past the chain's depth is the full scan, as in scan()
        want = {"auto": -1, "linear": 0, "blelloch": 64}[levels] if isinstance(levels, str) \
            else min(levels, 64)
        return self._build(layers, input_shape, want, max_pairs, [pruned] * len(layers), product, call)

    def _build(self, layers: list[nn.Module], input_shape: tuple[int, ...], want: int, max_pairs: int,
               pruned: list, product: str, call: str) -> dict:
        """The plan of checked arguments: `want` is csr_plan's levels (-1:
        the cost model's choice), pruned[i] layer i's mask as _Leaf takes it.
        Returns its reads of the parametrized weights ({leaf: weight}), each
        one computation of the weight, which chain_backward's forward takes
        rather than computing it again."""
        self.product, self._max_pairs = product, max_pairs
        shape, self.leaves, self.steps, reads = input_shape, [], [], {}
        _check_global_hooks("layers")
        for i, layer in enumerate(layers):
            weight = _check_chain_layer(layer, f"layers[{i}]", call)  # the build's one read of it
            if _chain_class(layer) is nn.Flatten:  # already flat here: no Jacobian
                self.steps.append((layer, None))
                shape = (math.prod(shape),)
                continue
            leaf = _Leaf(layer, shape, f"layers[{i}]", weight, pruned[i])
            if parametrize.is_parametrized(layer, "weight"):  # not one a pre-hook sets at the forward
                reads[leaf] = weight
            self.leaves.append(leaf)
            self.steps.append((layer, leaf))
            shape = leaf.out_shape
        if not self.leaves:
            raise ValueError("layers: expected a layer other than Flatten, which has no Jacobian (the "
                             "chain's gradients are those of its other layers' inputs)")
        self.input_shape, self.output_shape = input_shape, shape
        self._plan = _C.csr_plan([leaf.pattern() for leaf in self.leaves], want, max_pairs,
                                 *_machine(torch.device("cpu")))
        self.info = _C.csr_plan_info(self._plan)
        self._program = _C.csr_program(self._plan)
        self._device_rows = {}
        addrs = self._program["leaf_addr"].tolist()
        self._weights = _SharedWeights(self.leaves, addrs)
        # (input index, leaf, [start, stop) in the per-sequence buffer) of the other leaves
        self._sequence_leaves = [(i, leaf, addr, addr + leaf.indices.size)
                                 for i, (leaf, addr) in enumerate(zip(self.leaves, addrs)) if not addr & _SHARED]
        self._peer_schedule = _C.csr_schedule(self._plan) if product == "cusparse" else None
        # a pool window in the padding: every backward is torch's, layer by layer
        self._torch_only = any(leaf.torch_only for leaf in self.leaves)
        self._peers = {}  # (B, device): _CusparsePeer
        # ids of a forward_inputs' inputs -> ([weakrefs to them], {leaf: weight}), while they live
        self._forwards: dict = {}
        return reads

    def __reduce__(self):
        """copy.deepcopy and pickle rebuild the plan from its layers (the C
        plan is a capsule, which neither can copy): a deepcopy of a model
        holding the plan gets a plan over the copied model's layers, through
        deepcopy's memo. The copy keeps the schedule, with the levels chosen
        (the cost model's choice depends on the thread count at the build),
        and the pruning mask, with the weights that were zero at the build
        (not those zero at the copy); its device copies and cuSPARSE peers
        are made again at its first backward."""
        masks = [False if leaf is None or leaf.zero_weights is None else leaf.zero_weights
                 for _, leaf in self.steps]
        return _rebuilt_plan, ([layer for layer, _ in self.steps], self.input_shape, self.info["levels"],
                               self._max_pairs, masks, self.product)

    @eager_under_compile  # (see scan)
    def forward_inputs(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Runs the chain, keeping each Jacobian layer's input; returns them and
        the output. A Conv2d or Linear weight computed at each forward (a
        parametrization's, or set by a weight pre-hook: spectral_norm) is
        kept for the backward of these inputs while they live, as autograd
        saves it: read again, it would be computed again, or be a later
        forward's. Such a layer's forward reads it once and computes with
        that read (_run_computed)."""
        return self._forward_inputs(x, {})

    def _forward_inputs(self, x: torch.Tensor, weights: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
        """forward_inputs, computing with `weights` ({leaf: weight}), the
        parametrized weights read for this forward already (chain_backward's
        plan build), rather than reading them again."""
        computed = [leaf for leaf in self._weights.order if _computed_weight(leaf.layer, leaf.kind)]
        if not computed:
            return self._run_layers(x)
        _check_global_hooks("layers")  # their layers' hooks are run by the chain (_run_computed)
        inputs, out = self._run_layers(x, computed, weights)
        self._keep_weights(inputs, weights)
        return inputs, out

    def _keep_weights(self, inputs: list, weights: dict) -> None:
        """Keeps a forward's `weights` for the backward of its `inputs`, dropped
        when one of them is freed (the callback holds the dict, not the plan)."""
        key, forwards = tuple(map(id, inputs)), self._forwards

        def drop(_ref):
            forwards.pop(key, None)
        forwards[key] = ([weakref.ref(t, drop) for t in inputs], weights)

    def _run_layers(self, x: torch.Tensor, computed: Sequence[_Leaf] = (),
                    weights: dict | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """forward_inputs' run of the layers; those of the `computed` leaves
        with their weights read once (_run_computed) into `weights`, or taken
        from there (read for this forward already)."""
        inputs = []
        for layer, leaf in self.steps:
            if leaf is not None:
                inputs.append(x)
                x = _unless_overwritten(layer, x)
            if leaf in computed:
                x, weights[leaf] = _run_computed(leaf, x, weights.get(leaf))
            else:
                x = layer(x)
        return inputs, x

    def _forward_weights(self, inputs: Sequence[torch.Tensor]) -> dict:
        """The weights forward_inputs kept for these `inputs`; none for inputs
        it did not return (backward reads them)."""
        kept = self._forwards.get(tuple(map(id, inputs)))
        if kept is None:
            return {}
        refs, weights = kept
        return weights if all(r() is t for r, t in zip(refs, inputs)) else {}

    def _rows_on(self, device: torch.device) -> tuple[int, int, int, int]:
        """Pointers to the program's rows copied to `device` once (CUDA)."""
        if device not in self._device_rows:  # uint32 addresses travel as int32 bits
            arrays = [self._program[k] for k in ("dst", "term_ptr", "tx", "ty")]
            self._device_rows[device] = [torch.from_numpy(a.view(np.int32) if a.dtype == np.uint32 else a)
                                         .to(device) for a in arrays]
        return tuple(t.data_ptr() for t in self._device_rows[device])

    def _run(self, B: int, seq: torch.Tensor, shared: torch.Tensor) -> None:
        device = seq.device
        if device.type == "cuda":
            if _cuda is None:
                raise RuntimeError(f"grad_output: CUDA tensors, but {cuda_missing()}")
            with on_device(device):
                _cuda.csr_run(self._plan, B, seq.data_ptr(), shared.data_ptr(), *self._rows_on(device),
                              current_stream_handle(device))
        else:
            _C.csr_run(self._plan, B, seq.data_ptr(), shared.data_ptr(), 0, 0, 0, 0, torch.get_num_threads())

    @eager_under_compile  # (see scan)
    def backward(self, inputs: Iterable[torch.Tensor], grad_output: torch.Tensor) -> list[torch.Tensor]:
        """Gradients of every Jacobian layer's input, shaped like it, from the
        layer inputs of forward_inputs() (any iterable of them, as autograd.grad
        takes its inputs) and the gradient of the chain's output.
        Where one is not finite, all are those of each layer's own torch
        backward (autograd's infs and NaNs, see README), as they always are
        with a MaxPool2d window in the padding (_padding_windows)."""
        self._check_modules()
        return self._backward(_listed(inputs, "inputs", "tensors"), grad_output, "ChainPlan.backward")

    def _backward(self, inputs: Sequence[torch.Tensor], grad_output: torch.Tensor,
                  call: str) -> list[torch.Tensor]:
        """backward of layers checked already: by backward, or by
        chain_backward before its forward (the plan's build or
        _check_modules), so once a call; `call`, which of the two, is
        named in a refusal."""
        if len(inputs) != len(self.leaves):
            raise ValueError(f"inputs: expected {len(self.leaves)} layer inputs, got {len(inputs)}")
        _check_chain_tensor(grad_output, "grad_output", call)
        for i, x in enumerate(inputs):
            _check_chain_tensor(x, f"inputs[{i}]", call)
        B, device = inputs[0].shape[0] if inputs[0].dim() else 0, grad_output.device
        if grad_output.shape != (B, *self.output_shape):  # as autograd: no reshaping
            raise ValueError(f"grad_output: expected shape {(B, *self.output_shape)} (the chain's "
                             f"output), got {tuple(grad_output.shape)}")
        for i, (leaf, x) in enumerate(zip(self.leaves, inputs)):
            if x.device != device or x.shape != (B, *leaf.in_shape):
                raise ValueError(f"inputs[{i}]: expected shape {(B, *leaf.in_shape)} on {device}, "
                                 f"got {tuple(x.shape)} on {x.device}")
        weights = self._checked_weights(self._forward_weights(inputs), call)
        if self.product == "cusparse" and device.type != "cuda":
            raise ValueError(f"grad_output: product='cusparse' runs on CUDA tensors only, got {device}; "
                             "use product='reprop' there")
        if B == 0:
            return [torch.zeros_like(x) for x in inputs]
        if self._torch_only:
            return self._torch_backward(inputs, grad_output, weights)
        if self.product == "cusparse":
            grads = self._peer_gradients(B, inputs, grad_output, weights)
            return self._torch_backward(inputs, grad_output, weights) if grads is None else grads
        prog = self._program
        # batch-minor buffers (reprop.h): per-sequence offset o of sample b at o * B + b
        # float32 whatever the default dtype: the program reads them as float32
        seq = torch.empty(self.info["seq_floats"], B, dtype=torch.float32, device=device)
        shared = torch.empty(self.info["shared_floats"], dtype=torch.float32, device=device)
        shared[0] = 1.0
        # (not `with torch.no_grad()`, whose Python __exit__ an interrupt as
        # the block ended skipped, leaving grad mode off: without_grad)
        without_grad(self._write_values, seq, shared, inputs, weights)
        out = prog["g_out_addr"]
        seq[out:out + self.leaves[-1].cols].copy_(grad_output.detach().reshape(B, -1).T)
        with profiler_range("reprop.bppsa.ChainPlan.scan"):
            self._run(B, seq, shared)
            grads = self._gradients(B, seq, inputs)
        # A result that is not finite is redone layer by layer as torch does
        # it: the program's up-sweep products may overflow (inf * 0 = NaN),
        # and at any levels it multiplies by ReLU's and MaxPool2d's 0/1 values
        # where torch selects (0 * inf = NaN, torch's 0).
        return self._torch_backward(inputs, grad_output, weights) if grads is None else grads

    def _write_values(self, seq: torch.Tensor, shared: torch.Tensor, inputs: Sequence[torch.Tensor],
                      weights: dict) -> None:
        """_backward's values: the shared leaves' `weights` into shared, the
        others' Jacobian values at `inputs` into seq. Under torch.no_grad."""
        self._weights.write(shared, weights)
        for i, leaf, start, stop in self._sequence_leaves:
            leaf.write_values(inputs[i], seq[start:stop].T)

    def _check_modules(self) -> None:
        """Every layer checked again but for its weight (hooks, torch's global
        ones too, or a subclass swapped in since the plan, settings changed),
        before anything runs them: a forward of a changed layer gives
        torch's errors or a wrong shape, not the reason."""
        _check_global_hooks("layers")
        for i, (layer, leaf) in enumerate(self.steps):
            _check_chain_module(layer, f"layers[{i}]")
            if leaf is not None:
                leaf.check_unchanged()

    def _checked_weights(self, kept: dict, call: str) -> dict:
        """Each leaf's weight, the forward's (`kept`, see _forward_weights) or
        else read now, checked (for the public `call`), for _SharedWeights.write."""
        return {leaf: _chain_weight(leaf.layer, leaf.kind, leaf.name, call, kept.get(leaf))
                for leaf in self.leaves}

    def _gradients(self, B: int, seq: torch.Tensor, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Every layer input's gradient out of the scan's buffer, each
        contiguous and owning its memory, as autograd's are (views of the
        batch-minor buffer would be strided, B fastest, and keep all of it
        alive), in the input's dtype; None if one is not finite."""
        if seq.device.type == "cpu":  # one C pass copies and checks them all
            grads = [torch.empty(x.shape, dtype=torch.float32, device=seq.device) for x in inputs]
            if not _C.csr_gradients(self._plan, B, seq.data_ptr(), [g.data_ptr() for g in grads],
                                    torch.get_num_threads()):
                return None
            return [g if x.dtype == torch.float32 else g.to(x.dtype) for g, x in zip(grads, inputs)]
        return _owned_gradients([seq[a:a + leaf.rows].T for leaf, a in
                                 zip(self.leaves, self._program["g_addr"].tolist())], inputs)

    def _peer_gradients(self, B: int, inputs: Sequence[torch.Tensor], grad_output: torch.Tensor,
                        weights: dict) -> list[torch.Tensor] | None:
        """backward()'s gradients by the cuSPARSE peer (CUDA), with the
        weights _checked_weights read, None if one is not finite. Its buffers
        and cuSPARSE's plans are made at the first backward of each batch
        size on each device, then reused."""
        device = grad_output.device
        if (B, device) not in self._peers:
            self._peers[B, device] = _CusparsePeer(self, B, device)
        peer = self._peers[B, device]
        without_grad(peer.load, self, inputs, grad_output, weights)
        peer.run(device)
        return _owned_gradients(peer.grads, inputs)

    def _torch_backward(self, inputs: Sequence[torch.Tensor], grad_output: torch.Tensor,
                        weights: dict) -> list[torch.Tensor]:
        """backward()'s result by each Jacobian layer's own torch backward at
        its input, with the weights _checked_weights gave, last layer first (the
        linear scan, as autograd runs it)."""
        grads, grad = [], grad_output.detach()
        for leaf, x in zip(reversed(self.leaves), reversed(inputs)):
            grad = _input_grad(leaf.layer, x, grad, x.dtype, weights.get(leaf))
            grads.append(grad)
        return grads[::-1]


def _rebuilt_plan(layers: list[nn.Module], input_shape: tuple[int, ...], levels: int, max_pairs: int,
                  pruned: list, product: str) -> ChainPlan:
    """ChainPlan.__reduce__'s copy, planned again; product is checked again:
    a checkpoint loaded where the cuSPARSE peer is missing raises as the
    constructor does there."""
    plan = ChainPlan.__new__(ChainPlan)
    plan._build(layers, input_shape, levels, max_pairs, pruned, _check_product(product), "ChainPlan")
    return plan


def _owned_gradients(views: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each (B, rows) view of a scan's buffer as a contiguous tensor of its
    input's shape and dtype that owns its memory, as autograd's gradients
    are; None if one is not finite."""
    if not _sums_finite(views):
        return None
    return [x.new_empty(x.shape).copy_(v.reshape(x.shape)) for v, x in zip(views, inputs)]


def _sums_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """False if an element of the tensors is not finite (or a tensor's sum
    overflows float32, past 3e38, which only costs the exact slower path).
    One sum per tensor: torch's inf-norm reduction was 13x slower (680
    against 53 us over 200k floats on the CPU). bool() waits for the GPU
    (see README)."""
    return bool(torch.stack([t.sum() for t in tensors]).isfinite().all())


def _same_modules(a: Sequence[nn.Module], b: Sequence[nn.Module]) -> bool:
    a = _listed(a, "layers", "modules")
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@eager_under_compile  # (see scan)
def chain_backward(layers: Sequence[nn.Module], x: torch.Tensor, grad_output: torch.Tensor | None = None,
                   *, plan: ChainPlan | None = None, levels="auto") -> list[torch.Tensor]:
    """BPPSA over a chain: the gradient of the input of every Jacobian layer
    of `layers` (Flatten layers have none) for inputs x (B, ...) and the
    gradient of the chain's output (ones when None), through the CSR
    transposed Jacobians. Pass a :class:`ChainPlan` to reuse its planned
    patterns across steps; else one is built for x's sample shape, with
    `levels` as ChainPlan takes it. A plan has its levels: `levels` then
    stays "auto" (another value is refused, not silently ignored)."""
    levels = _check_scan_choice(levels, "levels")
    if plan is not None and not (isinstance(levels, str) and levels == "auto"):
        raise ValueError(f"levels: a plan scans with the levels it was built with; got "
                         f"levels={levels!r} with plan: leave levels='auto', or build a "
                         "ChainPlan with these levels")
    _check_chain_tensor(x, "x", "chain_backward")
    if x.dim() < 2 or 0 in x.shape[1:]:
        raise ValueError(f"x: expected a batch (B, ...) of non-empty samples, got shape {tuple(x.shape)}")
    # by name too: a plan built before importlib.reload(reprop.bppsa) is no
    # instance of the reloaded class ("expected a ChainPlan, got reprop.bppsa.ChainPlan")
    if plan is not None and not (isinstance(plan, ChainPlan) or is_instance_by_name(plan, ChainPlan)):
        raise TypeError(f"plan: expected a ChainPlan or None, got {_type_name(plan)}")
    if plan is None:
        # the build's read of each parametrized weight is the forward's (a
        # parametrization's state advances once per step, as in torch)
        plan = ChainPlan.__new__(ChainPlan)
        reads = plan._checked_build("chain_backward", layers, x.shape[1:], levels)
        return _forward_backward(plan, x, grad_output, reads)
    if not _same_modules(layers, [layer for layer, _ in plan.steps]):
        raise ValueError("layers: not the layers `plan` was built for; pass the plan's own "
                         "layers or build a ChainPlan for these")
    elif tuple(x.shape[1:]) != plan.input_shape:
        raise ValueError(f"x: expected samples of shape {plan.input_shape} (the plan's), "
                         f"got {tuple(x.shape[1:])}")
    plan._check_modules()  # what changed since the plan, before the forward runs it
    return _forward_backward(plan, x, grad_output, {})


def _forward_backward(plan: ChainPlan, x: torch.Tensor, grad_output: torch.Tensor | None,
                      reads: dict) -> list[torch.Tensor]:
    """chain_backward's run of its checked plan over x, whose layers passed
    its build or _check_modules; `reads`: the parametrized weights read for
    this forward already (see _build)."""
    inputs, out = without_grad(plan._forward_inputs, x, reads)  # (not `with torch.no_grad()`: _backward)
    if grad_output is None:
        grad_output = torch.ones_like(out)
    elif isinstance(grad_output, torch.Tensor) and grad_output.shape[:1] != x.shape[:1]:
        raise ValueError(f"grad_output: expected {x.shape[0]} samples like x, got shape "
                         f"{tuple(grad_output.shape)}")
    return plan._backward(inputs, grad_output, "chain_backward")


def transposed_jacobian(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The CSR transposed Jacobian of `layer` at one sample x (no batch dim),
    as a torch sparse CSR tensor (rows: inputs, columns: outputs)."""
    _check_global_hooks("layer")
    weight = _check_chain_layer(layer, "layer", "transposed_jacobian")
    _check_chain_tensor(x, "x", "transposed_jacobian")
    # before the layer's geometry reads it: an empty dim is no sample
    shape = _check_sample_shape(x.shape, "x.shape")
    leaf = _Leaf(layer, shape, "layer", weight)
    if leaf.torch_only:
        raise ValueError("layer: MaxPool2d has a window lying entirely in the padding, whose gradient "
                         "torch sends outside the window: it has no CSR transposed Jacobian here")
    vals = leaf.entry_values(x.unsqueeze(0), weight)[0]
    return torch.sparse_csr_tensor(torch.from_numpy(leaf.indptr).long(), torch.from_numpy(leaf.indices).long(),
                                   vals, (leaf.rows, leaf.cols), check_invariants=True)
