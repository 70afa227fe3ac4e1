"""Out-of-order backprop: weight gradients off the critical path.

Implements Oh et al., "Out-Of-Order BackProp" (EuroSys '22) in PyTorch eager,
on unmodified models. The backward of a layer has two parts: the output
gradient dO (the gradient of the layer's input, which the rest of backward
waits for) and the weight gradient dW (which only the update waits for).
``enable(model)`` splits them for every Linear, Conv1d/2d/3d, Embedding,
BatchNorm, LayerNorm and GroupNorm: backward computes dO at once and turns dW
into a deferred task, which the handle runs in the order its schedule says:

* on CUDA on a low-priority sub-stream, ordered after the main stream by
  events, so dW kernels co-run with the main stream's dO kernels;
* on the CPU in the same order, inline, so every schedule is testable.

The schedule is the paper's multi-region joint scheduling (Algorithm 1, in
csrc/schedule.c): the first iterations profile the time of each layer's
backward and of each dW task (and, on CUDA, how much each region speeds up
with each region's dW running beside it); then the backward timeline is cut
into regions and each dW is placed in the region where it helps most,
subject to a cap on the extra memory deferred tasks hold (the paper's
pre-scheduling). Every deferred task has run when backward returns, so
``optimizer.step()`` (any optimizer) and gradient hooks see complete
gradients, equal to plain autograd's: the formulas are autograd's own kernels
called with the dO and dW halves of their output masks.

``simulate()``, ``stages()``, ``reverse_first_k()`` and ``search_k()`` expose
the scheduler core for planning runs on machines one does not have.
"""
from __future__ import annotations

import contextlib
import math
import time
import types
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._native import _C

__all__ = ["enable", "OOOHandle", "simulate", "SimResult", "stages", "reverse_first_k",
           "search_k", "ORDERS"]

_aten = torch.ops.aten

# ---------------------------------------------------------------------------
# The split layers: forward, dO and dW of each kind with autograd's kernels
# ---------------------------------------------------------------------------


class _Kind:
    """How one layer type computes its forward and the two halves of its backward.

    ``forward`` returns the output and what backward needs (tensors first,
    saved for backward so in-place changes are caught; then plain values).
    """

    tensors_saved = 2

    def params(self, m: nn.Module) -> list:
        return [p for p in (getattr(m, "weight", None), getattr(m, "bias", None)) if p is not None]

    def check(self, m: nn.Module) -> None:
        """ValueError for a configuration the split cannot reproduce exactly."""

    def prepare(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What happens to the input outside the split (padding modes, renorm)."""
        return x


def _fold(t: torch.Tensor, last: int) -> torch.Tensor:
    return t.reshape(-1, last)


class _LinearKind(_Kind):
    # y = x W^T + b over any leading dims, folded to 2-D as at::linear does
    def forward(self, m, x):
        return F.linear(x, m.weight, m.bias), (x, m.weight)

    def input_grad(self, m, saved, g):
        x, w = saved
        return _fold(g, w.shape[0]).mm(w).view(x.shape)

    def weight_grads(self, m, saved, g):
        x, w = saved
        g2 = _fold(g, w.shape[0])
        out = [(m.weight, g2.t().mm(_fold(x, w.shape[1])))]
        if m.bias is not None:
            out.append((m.bias, g2.sum(0)))
        return out


class _ConvKind(_Kind):
    def check(self, m):
        if isinstance(m.padding, str) and m.padding == "same":
            for d, k in zip(m.dilation, m.kernel_size):
                if d * (k - 1) % 2:
                    raise ValueError(f"{type(m).__name__}: padding='same' with an even total "
                                     f"padding per side is supported; kernel {m.kernel_size} "
                                     f"dilation {m.dilation} pads asymmetrically")

    def _padding(self, m) -> list:
        if m.padding_mode != "zeros" or m.padding == "valid":
            return [0] * len(m.kernel_size)
        if m.padding == "same":
            return [d * (k - 1) // 2 for d, k in zip(m.dilation, m.kernel_size)]
        return list(m.padding)

    def prepare(self, m, x):
        if m.padding_mode != "zeros":  # what Conv._conv_forward does before the conv
            return F.pad(x, m._reversed_padding_repeated_twice, mode=m.padding_mode)
        return x

    def forward(self, m, x):
        y = _aten.convolution(x, m.weight, m.bias, list(m.stride), self._padding(m),
                              list(m.dilation), False, [0] * len(m.stride), m.groups)
        return y, (x, m.weight)

    def _backward(self, m, saved, g, mask):
        x, w = saved
        bias = [w.shape[0]] if m.bias is not None else None
        return _aten.convolution_backward(g, x, w, bias, list(m.stride), self._padding(m),
                                          list(m.dilation), False, [0] * len(m.stride),
                                          m.groups, mask)

    def input_grad(self, m, saved, g):
        return self._backward(m, saved, g, [True, False, False])[0]

    def weight_grads(self, m, saved, g):
        _, dw, db = self._backward(m, saved, g, [False, True, m.bias is not None])
        return [(m.weight, dw)] + ([(m.bias, db)] if m.bias is not None else [])


class _EmbeddingKind(_Kind):
    tensors_saved = 1

    def check(self, m):
        if m.sparse:
            raise ValueError("Embedding(sparse=True): sparse gradients are not supported by "
                             "reprop.ooo; use sparse=False")

    def prepare(self, m, x):
        if m.max_norm is not None:  # as F.embedding: renormalise rows in place first
            with torch.no_grad():
                torch.embedding_renorm_(m.weight, x, m.max_norm, m.norm_type)
        return x

    def forward(self, m, x):
        pad = -1 if m.padding_idx is None else m.padding_idx
        return torch.embedding(m.weight, x, pad, m.scale_grad_by_freq, False), (x,)

    def input_grad(self, m, saved, g):
        return None  # indices have no gradient

    def weight_grads(self, m, saved, g):
        (idx,) = saved
        pad = -1 if m.padding_idx is None else m.padding_idx
        return [(m.weight, _aten.embedding_dense_backward(g, idx, m.num_embeddings, pad,
                                                          m.scale_grad_by_freq))]


class _BatchNormKind(_Kind):
    tensors_saved = 4  # x, weight, save_mean, save_invstd

    def _state(self, m):
        # torch.nn.modules.batchnorm._BatchNorm.forward, step for step
        eaf = 0.0 if m.momentum is None else m.momentum
        if m.training and m.track_running_stats and m.num_batches_tracked is not None:
            m.num_batches_tracked.add_(1)
            eaf = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
        training = m.training or (m.running_mean is None and m.running_var is None)
        keep = not m.training or m.track_running_stats
        return training, eaf, (m.running_mean if keep else None), (m.running_var if keep else None)

    def prepare(self, m, x):
        m._check_input_dim(x)
        return x

    def forward(self, m, x):
        training, eaf, rm, rv = self._state(m)
        y, mean, invstd = _aten.native_batch_norm(x, m.weight, m.bias, rm, rv, training, eaf, m.eps)
        return y, (x, m.weight, mean, invstd, rm, rv, training)

    def _backward(self, m, saved, g, mask):
        x, w, mean, invstd, rm, rv, training = saved
        return _aten.native_batch_norm_backward(g, x, w, rm, rv, mean, invstd, training, m.eps, mask)

    def input_grad(self, m, saved, g):
        return self._backward(m, saved, g, [True, False, False])[0]

    def weight_grads(self, m, saved, g):
        _, dw, db = self._backward(m, saved, g, [False, m.weight is not None, m.bias is not None])
        return [(p, d) for p, d in ((m.weight, dw), (m.bias, db)) if p is not None]


class _LayerNormKind(_Kind):
    tensors_saved = 4  # x, weight, mean, rstd

    def forward(self, m, x):
        shape = list(m.normalized_shape)
        y, mean, rstd = _aten.native_layer_norm(x, shape, m.weight, m.bias, m.eps)
        return y, (x, m.weight, mean, rstd)

    def _backward(self, m, saved, g, mask):
        x, w, mean, rstd = saved
        return _aten.native_layer_norm_backward(g, x, list(m.normalized_shape), mean, rstd, w,
                                                m.bias, mask)

    def input_grad(self, m, saved, g):
        return self._backward(m, saved, g, [True, False, False])[0]

    def weight_grads(self, m, saved, g):
        _, dw, db = self._backward(m, saved, g, [False, m.weight is not None, m.bias is not None])
        return [(p, d) for p, d in ((m.weight, dw), (m.bias, db)) if p is not None]


class _GroupNormKind(_Kind):
    tensors_saved = 4

    def _sizes(self, x):
        n, c = x.shape[0], x.shape[1]
        return n, c, x.numel() // max(1, n * c)

    def forward(self, m, x):
        x = x.contiguous()  # as at::group_norm
        n, c, hw = self._sizes(x)
        y, mean, rstd = _aten.native_group_norm(x, m.weight, m.bias, n, c, hw, m.num_groups, m.eps)
        return y, (x, m.weight, mean, rstd)

    def _backward(self, m, saved, g, mask):
        x, w, mean, rstd = saved
        n, c, hw = self._sizes(x)
        # the kernel reads both as contiguous; autograd's formula makes them so
        return _aten.native_group_norm_backward(g.contiguous(), x.contiguous(), mean, rstd, w,
                                                n, c, hw, m.num_groups, mask)

    def input_grad(self, m, saved, g):
        return self._backward(m, saved, g, [True, False, False])[0]

    def weight_grads(self, m, saved, g):
        _, dw, db = self._backward(m, saved, g, [False, m.weight is not None, m.bias is not None])
        return [(p, d) for p, d in ((m.weight, dw), (m.bias, db)) if p is not None]


_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_KINDS: list[tuple[tuple, _Kind]] = [
    ((nn.Linear,), _LinearKind()),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d), _ConvKind()),
    ((nn.Embedding,), _EmbeddingKind()),
    (_BN_TYPES, _BatchNormKind()),
    ((nn.LayerNorm,), _LayerNormKind()),
    ((nn.GroupNorm,), _GroupNormKind()),
]


def _kind_of(m: nn.Module) -> _Kind | None:
    """The split of `m`'s exact type (subclasses may compute something else)."""
    for types_, kind in _KINDS:
        if type(m) in types_:
            return kind
    return None


class _Split(torch.autograd.Function):
    """One call of a split layer: backward returns dO and hands dW to the handle."""

    @staticmethod
    def forward(ctx, site: "_Site", x: torch.Tensor, *params: torch.Tensor):
        y, saved = site.kind.forward(site.module, x)
        n = site.kind.tensors_saved
        ctx.save_for_backward(*saved[:n])
        ctx.extra = saved[n:]
        ctx.site = site
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("reprop.ooo: backward with create_graph=True through a split "
                               f"{type(ctx.site.module).__name__} is not supported; call "
                               "remove() on the handle of reprop.ooo.enable() first")
        site = ctx.site
        saved = tuple(ctx.saved_tensors) + tuple(ctx.extra)
        handle = site.handle
        task = handle._weight_grad_ready(site, saved, g)
        dx = site.kind.input_grad(site.module, saved, g) if ctx.needs_input_grad[1] else None
        handle._after_input_grad(task)
        return (None, dx) + (None,) * (len(ctx.needs_input_grad) - 2)


@dataclass(eq=False)
class _Site:
    """A split module: its kind and its place in the forward order."""

    module: nn.Module
    kind: _Kind
    handle: "OOOHandle"
    name: str
    index: int = -1  # order of first forward call in the iteration being profiled
    params: list = field(default_factory=list)


def _accumulate(p: torch.Tensor, d: torch.Tensor) -> None:
    """What AccumulateGrad does with a new gradient outside grad mode."""
    if p.grad is None:
        p.grad = d if d.stride() == p.stride() else torch.empty_like(p).copy_(d)
    else:
        p.grad.add_(d)


class _Task:
    """A deferred weight gradient: one call's saved tensors and output gradient."""

    __slots__ = ("site", "saved", "grad", "key", "event", "nbytes")

    def __init__(self, site: _Site, saved: tuple, grad: torch.Tensor, key: tuple):
        self.site, self.saved, self.grad, self.key = site, saved, grad, key
        self.event = None
        self.nbytes = sum(t.numel() * t.element_size() for t in (grad,) + saved
                          if isinstance(t, torch.Tensor))

    def run(self) -> None:
        for p, d in self.site.kind.weight_grads(self.site.module, self.saved, self.grad):
            _accumulate(p, d)
        self.saved = self.grad = None  # the memory a deferred task holds goes now


# ---------------------------------------------------------------------------
# The handle: profiling, the region schedule, issue of the deferred tasks
# ---------------------------------------------------------------------------

ORDERS = ("ooo", "conventional")


@dataclass
class _Profile:
    """What the profiling iterations measured, per task key (site index, call)."""

    main: dict = field(default_factory=dict)   # key -> [main-stream time from its dO on (s)]
    sub: dict = field(default_factory=dict)    # key -> [dW time (s), or CUDA event pairs]
    nbytes: dict = field(default_factory=dict)  # key -> bytes the deferred task holds
    order: list = field(default_factory=list)  # keys in backward order


class OOOHandle:
    """What ``enable`` returns; ``remove()`` restores the modules' own forward."""

    def __init__(self, model: nn.Module, order: str, regions: int, max_extra_memory: float,
                 profile_iters: int, speedup: Callable[[int, int], float] | None):
        self.model = model
        self.order = order
        self.regions = regions
        self.max_extra_memory = max_extra_memory
        self.profile_iters = profile_iters
        self._speedup = speedup
        self.sites: list[_Site] = []
        self._pending: list[_Task] = []
        self._iteration = 0          # backward passes seen
        self._calls: dict = {}       # site -> calls this iteration (tasks are keyed by call)
        self._region_of: dict = {}   # task key -> region of the fixed schedule
        self._region_of_main: dict = {}  # task key -> region its dO runs in
        self._current_region = -1
        self._in_backward = False
        self._profile = _Profile()
        self._marks: list = []       # (task key, main-stream stamp) of this pass, profiling
        self._task_time = 0.0        # seconds spent in inline dW tasks (CPU clock)
        self._next_index = 0
        self._held: list | None = None  # hold(): tasks collected instead of run
        self._keep = None
        # Called with a task's parameters right after their gradients were
        # accumulated by run() (data parallelism starts its all-reduce there).
        self.after_task: Callable[[list], None] | None = None
        self._sub_streams: dict = {}
        self.schedule: dict | None = None  # facts about the fixed schedule, once made
        self._removed = False
        for name, m in model.named_modules():
            kind = _kind_of(m)
            if kind is None or "forward" in m.__dict__:
                continue
            params = [p for p in kind.params(m) if p.requires_grad]
            if not params:
                continue
            kind.check(m)
            site = _Site(m, kind, self, name or type(m).__name__, params=params)
            m.forward = types.MethodType(_make_forward(site), m)
            self.sites.append(site)
        if not self.sites:
            raise ValueError("model: no Linear, Conv1d/2d/3d, Embedding, BatchNorm, LayerNorm "
                             "or GroupNorm with trainable parameters to split")

    # -- public ----------------------------------------------------------------

    @contextlib.contextmanager
    def hold(self, keep: Callable[[nn.Module], bool] | None = None):
        """Within the block, deferred tasks of modules `keep` accepts (all by
        default) are collected into the yielded list instead of being run;
        run them later with ``run(tasks)``. The building block of the data-
        and pipeline-parallel schedules, which order dW explicitly."""
        held: list = []
        saved = self._held, self._keep
        self._held, self._keep = held, keep
        try:
            yield held
        finally:
            self._held, self._keep = saved

    def run(self, tasks: Iterable[_Task]) -> None:
        """Runs held tasks now, in the given order, on the current stream."""
        for t in tasks:
            t.run()
            if self.after_task is not None:
                self.after_task(t.site.params)

    def pending(self) -> int:
        """Deferred weight-gradient tasks not run yet (0 outside backward)."""
        return len(self._pending)

    def flush(self) -> None:
        """Runs every deferred task now and joins the sub-streams."""
        tasks, self._pending = self._pending, []
        for t in tasks:
            self._issue(t)
        for device, sub in self._sub_streams.items():
            torch.cuda.current_stream(device).wait_stream(sub)

    def remove(self) -> None:
        """Flushes and restores every module's own forward: plain autograd again."""
        if self._removed:
            return
        self.flush()
        for site in self.sites:
            site.module.__dict__.pop("forward", None)
        self._removed = True

    def __enter__(self) -> "OOOHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- called from backward --------------------------------------------------

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._calls = {}
        self._current_region = -1
        self._marks = []
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        profiling = self._profiling()
        if profiling and self._marks:
            self._marks.append((None, self._stamp(self._marks[-1][1])))
        self.flush()
        self._in_backward = False
        if profiling:
            self._record_profile()
        self._iteration += 1
        if self.order == "ooo" and self.schedule is None and self._iteration >= self.profile_iters:
            self._make_schedule()

    def _profiling(self) -> bool:
        """Backward passes after the warm-up and before the schedule is fixed."""
        return self.order == "ooo" and self.schedule is None and self._iteration >= 1

    def _stamp(self, like):
        """A main-stream time stamp: a timing event on CUDA, a clock that
        excludes inline dW time on the CPU."""
        if isinstance(like, torch.Tensor) and like.is_cuda or isinstance(like, torch.cuda.Event):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter() - self._task_time

    def _weight_grad_ready(self, site: _Site, saved: tuple, g: torch.Tensor) -> _Task:
        if not self._in_backward:
            self._begin_backward()
        call = self._calls.get(site, 0)
        self._calls[site] = call + 1
        task = _Task(site, saved, g, (site.index, call))
        if self._profiling():
            self._marks.append((task.key, self._stamp(g)))
        if g.is_cuda and self.order == "ooo":
            task.event = torch.cuda.current_stream(g.device).record_event()
        return task

    def _after_input_grad(self, task: _Task) -> None:
        if self._held is not None and (self._keep is None or self._keep(task.site.module)):
            task.event = None
            self._held.append(task)
            return
        if self.order == "conventional" or self._held is not None:
            self.run([task])
            return
        main_region = self._region_of_main.get(task.key)
        if main_region is not None:
            self._enter_region(main_region)
        region = self._region_of.get(task.key)
        if region is None or region <= self._current_region:
            self._issue(task)
        else:
            self._pending.append(task)

    def _enter_region(self, region: int) -> None:
        """The main stream reached `region`: issue the tasks placed there."""
        if region <= self._current_region:
            return
        self._current_region = region
        due = [t for t in self._pending if self._region_of[t.key] <= region]
        if due:
            self._pending = [t for t in self._pending if self._region_of[t.key] > region]
            for t in due:
                self._issue(t)

    def _issue(self, task: _Task) -> None:
        profiling = self._profiling()
        if profiling:
            self._profile.nbytes[task.key] = task.nbytes
        if task.event is None:
            start = time.perf_counter()
            task.run()
            spent = time.perf_counter() - start
            self._task_time += spent
            if profiling:
                self._profile.sub.setdefault(task.key, []).append(spent)
            return
        sub = self._sub_stream(task.grad.device)
        sub.wait_event(task.event)
        for t in (task.grad,) + task.saved:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(sub)  # the main stream's allocator reuses it only after sub
        with torch.cuda.stream(sub):
            if profiling:
                begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                begin.record(sub)
            task.run()
            if profiling:
                end.record(sub)
                self._profile.sub.setdefault(task.key, []).append((begin, end))
        main = torch.cuda.current_stream(task.site.params[0].device)
        for p in task.site.params:
            if p.grad is not None:
                p.grad.record_stream(main)

    def _record_profile(self) -> None:
        """Turns this pass's stamps into per-call main-stream times."""
        prof = self._profile
        for (key, a), (_, b) in zip(self._marks, self._marks[1:]):
            prof.main.setdefault(key, []).append(_elapsed(a, b))
            if key not in prof.order:
                prof.order.append(key)
        self._marks = []

    def _sub_stream(self, device: torch.device) -> "torch.cuda.Stream":
        sub = self._sub_streams.get(device)
        if sub is None:
            low = torch.cuda.Stream.priority_range()[0] if hasattr(torch.cuda.Stream, "priority_range") else 0
            sub = self._sub_streams[device] = torch.cuda.Stream(device, priority=max(low, 0))
        return sub

    # -- the schedule ------------------------------------------------------------

    def _make_schedule(self) -> None:
        """Algorithm 1 over the profiled backward: regions, placement, memory cap."""
        prof = self._profile
        keys = prof.order
        if not keys:
            return
        sub = {k: float(np.median([_elapsed(*v) if isinstance(v, tuple) else v for v in vs]))
               for k, vs in prof.sub.items()}
        main = np.array([np.median(prof.main[k]) for k in keys], dtype=np.float64)
        n = max(1, min(self.regions, len(keys)))
        bounds = _balanced_cuts(main, n)              # region r: keys[bounds[r]:bounds[r+1]]
        region_main = {}
        for r in range(n):
            for k in keys[bounds[r]:bounds[r + 1]]:
                region_main[k] = r
        t_main = np.array([main[bounds[r]:bounds[r + 1]].sum() for r in range(n)])
        starts = np.concatenate([[0.0], np.cumsum(t_main)[:-1]])
        pos = {k: i for i, k in enumerate(keys)}
        tasks = [k for k in keys if k in sub]
        # a dW is ready within its call's interval (once the call's dO ran): stamp it at
        # the interval's start, which keeps it in the region of its dO
        ready = np.array([starts[region_main[k]] + main[bounds[region_main[k]]:pos[k]].sum()
                          for k in tasks])
        deadline = np.full(len(tasks), n, dtype=np.int64)
        t_sub = np.repeat(np.array([[sub[k]] for k in tasks]), n, axis=1)
        speedup = np.ones((len(tasks), n))
        if self._speedup is not None:
            for j, k in enumerate(tasks):
                for i in range(n):
                    speedup[j, i] = float(self._speedup(region_main[k], i))
        mem = np.array([prof.nbytes.get(k, 0) for k in tasks], dtype=np.int64)
        cap = int(self.max_extra_memory * max(1, int(mem.sum())))
        region, order, pre, peak = _C.sched_regions(t_main, ready, deadline, t_sub, speedup, mem, cap)
        self._region_of = {k: int(region[j]) for j, k in enumerate(tasks)}
        self._region_of_main = region_main
        self.schedule = {"regions": n, "region_time": t_main.tolist(), "prescheduled": int(pre),
                         "peak_extra_bytes": int(peak), "moved": int(sum(
                             1 for k in tasks if self._region_of[k] != region_main[k]))}


def _elapsed(a, b) -> float:
    """Seconds between two stamps of OOOHandle._stamp."""
    if isinstance(a, torch.cuda.Event):
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    return b - a


def _balanced_cuts(times: np.ndarray, n: int) -> list[int]:
    """Cuts a sequence into n contiguous non-empty parts of near-equal sums."""
    total = float(times.sum())
    cum = np.cumsum(times)
    cuts = [0]
    for r in range(1, n):
        target = total * r / n
        i = int(np.searchsorted(cum, target)) + 1
        cuts.append(min(max(i, cuts[-1] + 1), len(times) - (n - r)))
    cuts.append(len(times))
    return cuts


def _make_forward(site: _Site):
    kind, module = site.kind, site.module
    own = type(module).forward

    def forward(self, x, *args, **kwargs):
        if args or kwargs or not isinstance(x, torch.Tensor) or not torch.is_grad_enabled() \
                or site.handle._removed:
            return own(self, x, *args, **kwargs)
        if site.index < 0:
            site.index = site.handle._next_index
            site.handle._next_index += 1
        x = kind.prepare(module, x)
        return _Split.apply(site, x, *site.params)

    return forward


def enable(model: nn.Module, *, order: str = "ooo", regions: int = 8,
           max_extra_memory: float = 0.1, profile_iters: int = 3,
           speedup: Callable[[int, int], float] | None = None) -> OOOHandle:
    """Splits the backward of `model`'s layers into dO now and dW deferred.

    Args:
        model: any nn.Module; its Linear, Conv1d/2d/3d, Embedding,
            BatchNorm1d/2d/3d, LayerNorm and GroupNorm with trainable
            parameters are split (exact types; others run as before).
        order: "ooo" (deferred dW placed by Algorithm 1 after `profile_iters`
            backward passes; on CUDA on a low-priority sub-stream) or
            "conventional" (dW right after dO on the main stream: the split
            alone, for comparison).
        regions: how many regions the backward timeline is cut into.
        max_extra_memory: cap on the bytes held by deferred tasks at a region
            end, as a fraction of what all of them hold together.
        profile_iters: backward passes before the schedule is fixed (the
            first is a warm-up, the others are timed).
        speedup: speedup(region of the dW, region it runs in) from a co-run
            profile; None: 1 everywhere (the CPU has no co-run).

    Returns an ``OOOHandle`` (also a context manager). Gradients after each
    backward equal plain autograd's; create_graph=True is not supported.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    if not isinstance(regions, int) or regions < 1:
        raise ValueError(f"regions: expected an int >= 1, got {regions!r}")
    if not (isinstance(max_extra_memory, (int, float)) and max_extra_memory >= 0):
        raise ValueError(f"max_extra_memory: expected a fraction >= 0, got {max_extra_memory!r}")
    if not isinstance(profile_iters, int) or profile_iters < 2:
        raise ValueError(f"profile_iters: expected an int >= 2 (a warm-up and a timed pass), "
                         f"got {profile_iters!r}")
    return OOOHandle(model, order, regions, float(max_extra_memory), profile_iters, speedup)


# ---------------------------------------------------------------------------
# Planning: the scheduler core for machines one does not have
# ---------------------------------------------------------------------------

_ORDER_CODES = {"conventional": 0, "fast_forward": 1, "reverse_first_k": 2}
_TASK_NAMES = ("F", "dO", "dW", "S")


def _per_layer(value, layers: int, name: str) -> np.ndarray:
    """A per-layer float64 array from a scalar or a sequence of `layers` values."""
    arr = np.full(layers, value, dtype=np.float64) if np.ndim(value) == 0 \
        else np.asarray(value, dtype=np.float64)
    if arr.shape != (layers,):
        raise ValueError(f"{name}: expected a number or {layers} per-layer values, "
                         f"got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name}: expected finite times >= 0")
    return arr


def stages(layers: int, num_stages: int, allocation: str = "contiguous", group: int = 1) -> list[int]:
    """The device of each layer: contiguous blocks, or the paper's modulo
    allocation of groups of `group` consecutive layers (layer l on
    (l // group) mod num_stages)."""
    if allocation not in ("contiguous", "modulo"):
        raise ValueError(f"allocation: expected 'contiguous' or 'modulo', got {allocation!r}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group: expected an int >= 1, got {group!r}")
    return _C.sched_stages(layers, num_stages, group if allocation == "modulo" else 0).tolist()


def reverse_first_k(layers: int, k: int, mem_out_grad: Sequence[int] | None = None,
                    mem_weight_grad: Sequence[int] | None = None, mem_forward: int = 0,
                    mem_cap: int = 0) -> tuple[list[tuple[str, int]], int]:
    """Algorithm 2: the backward order [("dW" | "dO", layer), ...] with the
    weight gradients of layers 0 .. k-1 last, first to last, and the k the
    memory cap allowed (mem_cap 0: no cap)."""
    og = None if mem_out_grad is None else np.asarray(mem_out_grad, dtype=np.int64)
    wg = None if mem_weight_grad is None else np.asarray(mem_weight_grad, dtype=np.int64)
    kinds, lays, k_used = _C.reverse_first_k(layers, k, og, wg, mem_forward, mem_cap)
    return [(_TASK_NAMES[c], int(l)) for c, l in zip(kinds, lays)], int(k_used)


def search_k(layers: int, measure: Callable[[int], float]) -> tuple[int, dict]:
    """The paper's coarse-to-fine search for reverse first-k's k: steps of
    L/10, then halving around the best. `measure(k)` returns a throughput
    (higher is better). Returns the best k and every measurement."""
    score = np.full(layers + 1, np.nan)
    while True:
        nxt, best = _C.ksearch_next(layers, score)
        if nxt < 0:
            return int(best), {k: float(v) for k, v in enumerate(score) if not np.isnan(v)}
        score[nxt] = float(measure(int(nxt)))


def allreduce_time(nbytes: float, workers: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds a ring all-reduce of `nbytes` takes over `workers` at
    `bandwidth` bytes/s per link and `latency` s per message:
    2 (N-1)/N bytes/bandwidth + 2 (N-1) latency."""
    if workers <= 1:
        return 0.0
    return 2.0 * (workers - 1) / workers * nbytes / bandwidth + 2.0 * (workers - 1) * latency


@dataclass
class SimResult:
    """What ``simulate`` found. ``order[d]`` lists device d's tasks as run:
    (kind, layer, micro-batch, iteration) with kind in F, dO, dW, S."""

    makespan: float
    period: float | None  # time per iteration in steady state (iterations >= 2)
    busy: list[float]     # per device: time its main stream computed
    idle: list[float]     # per device: makespan - busy
    order: list[list[tuple[str, int, int, int]]]
    graph: dict = field(repr=False)
    start: np.ndarray = field(repr=False)
    finish: np.ndarray = field(repr=False)


def simulate(layers: int, *, fwd=1.0, out_grad=1.0, weight_grad=1.0, micro_batches: int = 1,
             num_stages: int = 1, allocation: str = "contiguous", group: int = 1,
             order: str = "conventional", k: int = 0, sync=None, sync_by_layer: bool = True,
             transfer: float = 0.0, iterations: int = 1, sub_stream: bool = False,
             corun_rate: float = 1.0, input_grad: bool = False) -> SimResult:
    """Plays `iterations` training iterations of a layered model on the
    scheduler core's discrete-event simulator.

    Times are per layer and micro-batch (a number for all layers or a
    sequence of `layers`), in any unit: 1 reproduces the paper's unit-time
    figures, profiled seconds plan a real run. ``sync`` is each layer's
    all-reduce time (data parallelism; see ``allreduce_time``), None for
    none; ``transfer`` the delay of an activation between devices. Orders:
    "conventional" (autograd's; GPipe with micro-batches), "fast_forward"
    (gradient fast-forwarding), "reverse_first_k" (Algorithm 2 with `k`).
    ``sub_stream`` runs dW on a second stream of its device, both streams
    advancing at `corun_rate` while they overlap.
    """
    if order not in _ORDER_CODES:
        raise ValueError(f"order: expected one of {tuple(_ORDER_CODES)}, got {order!r}")
    spec = {
        "layers": layers, "micro": micro_batches, "stages": num_stages, "iterations": iterations,
        "fwd": _per_layer(fwd, layers, "fwd"), "out_grad": _per_layer(out_grad, layers, "out_grad"),
        "weight_grad": _per_layer(weight_grad, layers, "weight_grad"),
        "sync": None if sync is None else _per_layer(sync, layers, "sync"),
        "stage": np.asarray(stages(layers, num_stages, allocation, group), dtype=np.int32),
        "transfer": float(transfer), "order": _ORDER_CODES[order], "k": k,
        "sync_by_layer": bool(sync_by_layer), "sub_stream": bool(sub_stream),
        "input_grad": bool(input_grad),
    }
    graph = _C.sched_graph(spec)
    start, finish, busy, makespan = _C.simulate(graph, float(corun_rate))
    kinds, res = graph["kind"], graph["resource"]
    forward_ends = [finish[(kinds == 0) & (graph["iteration"] == it)].max() for it in range(iterations)]
    period = (forward_ends[-1] - forward_ends[0]) / (iterations - 1) if iterations > 1 else None
    order_of = []
    for d in range(num_stages):
        on_d = np.flatnonzero((res == d) | (sub_stream and res == num_stages + d))
        on_d = on_d[np.argsort(start[on_d], kind="stable")]
        order_of.append([(_TASK_NAMES[kinds[t]], int(graph["layer"][t]), int(graph["micro"][t]),
                          int(graph["iteration"][t])) for t in on_d])
    busy_main = [float(busy[d]) for d in range(num_stages)]
    return SimResult(float(makespan), None if period is None else float(period), busy_main,
                     [float(makespan) - b for b in busy_main], order_of, graph, start, finish)
