"""Tests for the data- and pipeline-parallel schedules of reprop.ooo (draft).

Multi-rank cases run in processes started with torch.multiprocessing (spawn),
gloo over a file:// rendezvous in a temporary directory (no network ports),
every case of one world size in one group of processes to keep start-up cost
down. Golden references, computed in the same processes:

* data parallelism: torch's DistributedDataParallel on a copy of the model,
  same data, same optimizer: gradients and parameters must be bitwise equal;
* pipeline parallelism: single-process training of the whole list of layers
  (every rank builds it from the same seed) on the whole batch: gradients
  bitwise equal with one micro-batch, equal to float rounding with several
  (the micro-batches' weight gradients are summed in another order).

Errors in a rank surface as the exception of mp.spawn, with its traceback.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import gc
import io
import itertools
import math
import random
import sys
import tempfile
import threading
import types
import warnings
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from reprop import _C, fuse, ooo
from reprop.ooo import (DataParallel, Pipeline, _Layout, _averaged_by_data_parallel,
                        _check_costs, _inbox, _pipelined_in_micro_batches, _stage_programs,
                        allreduce_time, data_parallel, enable, reverse_first_k, search_k,
                        simulate)
from _interrupts import LineStop, interrupted_at_line
from _scripts import script_output
from _threads import torch_threads
from test_ooo import assert_as_built

WIDTH, BATCH, DEPTH = 16, 8, 8


# ---------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------


def _worker(rank: int, world: int, tmp: str, fn, args, timeout: float) -> None:
    torch.set_num_threads(1)  # ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    try:
        fn(rank, world, *args)
        # Models, their hooks and the data-parallel handle form reference
        # cycles; left to interpreter exit they are freed after the process
        # group, and gloo then aborts the rank now and then (SIGABRT,
        # "terminate called without an active exception": about 1 run of the
        # order test in 10 without this collection, none in 90 with it).
        gc.collect()
        # no rank tears its connections down while a peer still uses them
        # (gloo aborts the process then)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, *args, timeout: float = 60) -> None:
    """Runs fn(rank, world, *args) on `world` gloo ranks; raises what a rank
    raised. A collective waits at most `timeout` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, tmp, fn, args, timeout), nprocs=world, join=True)


@pytest.fixture
def solo_group(tmp_path):
    """A one-rank gloo group in this process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Data parallelism against DistributedDataParallel
# ---------------------------------------------------------------------------


class _Net(nn.Module):
    """8 Linear + tanh layers, then a plain parameter (not a split layer);
    `shared`: the last Linear uses the first one's weight."""

    def __init__(self, shared: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        if shared:
            self.layers[-1].weight = self.layers[0].weight

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x * self.scale


def _batch(rank: int, step: int, generator_seed: int = 1000):
    g = torch.Generator().manual_seed(generator_seed + 97 * rank + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _train_step(model, opt, x, t) -> None:
    opt.zero_grad()
    F.mse_loss(model(x), t).backward()


def _assert_same(ours: nn.Module, ref: nn.Module, what: str, exact: bool = True) -> None:
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        x, y = (a.grad, b.grad) if what == "grad" else (a, b)
        if x is None or y is None:
            assert x is None and y is None, f"{what} of {name}: ours {x}, reference {y}"
        elif exact:
            assert torch.equal(x, y), f"{what} of {name}: max diff {(x - y).abs().max().item()}"
        else:
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-8, msg=f"{what} of {name}")


def _compare_with_ddp(rank: int, world: int, k, shared: bool, steps: int,
                      search_iters: int = 3, bucket_cap_mb: float | None = None) -> DataParallel:
    """Trains a model with DDP and a copy with data_parallel side by side.

    Bitwise equal on 2 ranks. On more, gloo's ring all-reduce adds the ranks'
    terms in an order that depends on where an element sits in its bucket,
    and the buckets differ from DDP's: equal to rounding then."""
    exact = world == 2
    torch.manual_seed(rank)  # replicas differ until both broadcast rank 0's
    model = _Net(shared)
    ref = DistributedDataParallel(copy.deepcopy(model))
    dp = data_parallel(model, k=k, search_iters=search_iters, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _assert_same(model, ref.module, "parameter")
    for step in range(steps):
        x, t = _batch(rank, step)
        _train_step(ref, ref_opt, x, t)
        _train_step(model, opt, x, t)
        _assert_same(model, ref.module, "grad", exact)
        ref_opt.step()
        opt.step()
        _assert_same(model, ref.module, "parameter", exact)
        if dp.scores is not None and not dp.searching:  # a search for k ended
            break
    return dp


def _compare_accumulation(rank: int, world: int, as_view: bool, micro: int = 3, k: int = 2,
                          shared: bool = False) -> None:
    """Gradient accumulation under no_sync(), DDP's way: `micro` - 1 local
    backward passes inside, the last outside; with gradient_as_bucket_view
    on both sides, and zero_grad(set_to_none=False) so the views persist."""
    exact = world == 2
    torch.manual_seed(rank)
    model = _Net(shared)
    ref = DistributedDataParallel(copy.deepcopy(model), gradient_as_bucket_view=as_view)
    dp = data_parallel(model, k=k, gradient_as_bucket_view=as_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for net, handle, o in ((ref, ref, ref_opt), (model, dp, opt)):
            o.zero_grad(set_to_none=False)
            with handle.no_sync():
                for m in range(micro - 1):
                    F.mse_loss(net(_batch(rank, 10 * step + m)[0]),
                               _batch(rank, 10 * step + m)[1]).backward()
            x, t = _batch(rank, 10 * step + micro - 1)
            F.mse_loss(net(x), t).backward()
        _assert_same(model, ref.module, "grad", exact)
        if as_view:
            flats = {b.flat.data_ptr() for b in dp._buckets}
            assert all(p.grad.untyped_storage().data_ptr() in flats for p in model.parameters())
        ref_opt.step()
        opt.step()
        _assert_same(model, ref.module, "parameter", exact)
    dp.remove()


def _compare_no_grad_forward_inside_accumulation(rank: int, world: int) -> None:
    """A no_grad forward (a target or logging pass), on rank 0 alone, between
    a no_sync() forward and its backward: that backward stays local, as
    DDP's, whose reducer only a grad-mode forward arms. It was averaged: one
    all-reduce more on rank 0, so the collectives paired up wrongly (wrong
    gradients on the other ranks, a timeout on rank 0)."""
    torch.manual_seed(0)
    model = _Net()
    ref = DistributedDataParallel(copy.deepcopy(model))
    dp = data_parallel(model, k=2)
    local = {}
    for net, handle in ((ref, ref), (model, dp)):
        with handle.no_sync():
            out = net(_batch(rank, 0)[0])
        if rank == 0:
            with torch.no_grad():
                net(_batch(rank, 1)[0])
        F.mse_loss(out, _batch(rank, 0)[1]).backward()
        local[handle] = [p.grad.clone() for p in net.parameters()]
        F.mse_loss(net(_batch(rank, 2)[0]), _batch(rank, 2)[1]).backward()
    assert all(torch.equal(a, b) for a, b in zip(local[dp], local[ref])), "not local"
    _assert_same(model, ref.module, "grad", world == 2)
    dp.remove()


def _compare_buffers(rank: int, world: int, steps: int = 3) -> None:
    """A BatchNorm's running statistics and step count (float and int64
    buffers, coalesced into one broadcast) start as rank 0's and are rank
    0's again before every forward, as DDP's: bitwise equal to DDP's on
    every rank after every step, and different from what a rank's own
    data alone would have left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                          nn.Linear(WIDTH, WIDTH))
    with torch.no_grad():  # replicas' buffers differ until both broadcast rank 0's
        model[1].running_mean.fill_(float(rank))
        model[1].num_batches_tracked.fill_(rank)
    local = copy.deepcopy(model)
    ref = DistributedDataParallel(copy.deepcopy(model))
    dp = data_parallel(model, k=1)
    for step in range(steps):
        x, t = _batch(rank, step)
        for net in (ref, model, local):
            F.mse_loss(net(x), t).backward()
        for (name, a), b in zip(model.named_buffers(), ref.module.buffers()):
            assert torch.equal(a, b), f"buffer {name} after step {step}: {a} != DDP's {b}"
    assert rank == 0 or not torch.equal(local[1].running_mean, model[1].running_mean)
    dp.remove()


class _NoSplit(nn.Module):
    """No layer enable() splits: a GRU and a plain parameter."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x):
        return self.gru(x.unsqueeze(0))[0][0] * self.scale


def _compare_unsplit(rank: int, world: int, steps: int = 3) -> None:
    """A model with no split layer (L = 0): DDP's buckets alone, DDP's gradients."""
    torch.manual_seed(rank)
    model = _NoSplit()
    ref = DistributedDataParallel(copy.deepcopy(model))
    dp = data_parallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        x, t = _batch(rank, step)
        _train_step(ref, ref_opt, x, t)
        _train_step(model, opt, x, t)
        _assert_same(model, ref.module, "grad", world == 2)
        ref_opt.step()
        opt.step()
    assert dp.layers == 0 and dp.k == 0 and not dp.searching
    dp.remove()


def _join_net() -> nn.Module:
    """Three Linear layers and a BatchNorm (4 split layers; buffers to broadcast)."""
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _train_uneven(rank: int, net: nn.Module, handle, join, steps: int,
                  accumulate: bool, fused: bool = False) -> None:
    """`steps` SGD steps of this rank's own data inside `join()`, a Join of
    `handle`; with `accumulate`, each step's backward follows a local one
    under no_sync(); with `fused`, the optimizer under reprop.fuse(mode="forward")
    (made before the Join, which takes its joinables' hooks when made;
    removed after it, which applies what is pending)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    fusion = fuse(net, opt, mode="forward") if fused else None
    with join():
        for step in range(steps):
            opt.zero_grad()
            if accumulate:
                x, t = _batch(rank, 50 + step)
                with handle.no_sync():
                    F.mse_loss(net(x), t).backward()
            x, t = _batch(rank, step)
            F.mse_loss(net(x), t).backward()
            opt.step()
    if fusion is not None:
        fusion.remove()


def _compare_uneven(rank: int, world: int, k, steps: list, accumulate: bool = False,
                    fused: bool = False, **join) -> DataParallel:
    """DDP under Join and data_parallel under Join, trained one after the
    other on the same data, rank r for steps[r] steps: every parameter and
    buffer after the Join equals DDP's, bitwise on 2 ranks (a rank that ran
    out adds exact zeros), to rounding on 3 (see _compare_with_ddp)."""
    torch.manual_seed(rank)  # replicas differ until both broadcast rank 0's
    model = _join_net()
    ref = DistributedDataParallel(copy.deepcopy(model))
    dp = data_parallel(model, k=k, search_iters=1)
    _train_uneven(rank, ref, ref, lambda: ref.join(**join), steps[rank], accumulate, fused)
    _train_uneven(rank, model, dp, lambda: dp.join(**join), steps[rank], accumulate, fused)
    ours = itertools.chain(model.named_parameters(), model.named_buffers())
    for (name, a), b in zip(ours, itertools.chain(ref.module.parameters(),
                                                  ref.module.buffers())):
        if world == 2:
            assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=name)
    return dp


def _check_join_throws(rank: int, world: int) -> None:
    """throw_on_early_termination: every rank raises once one runs out (DDP's
    errors), and the group and the handle still work after."""
    model = _join_net()
    dp = data_parallel(model, k=2)
    with pytest.raises(RuntimeError, match="exhausted"):
        _train_uneven(rank, model, dp, lambda: Join([dp], throw_on_early_termination=True),
                      1 + rank, False)
    F.mse_loss(model(_batch(rank, 0)[0]), _batch(rank, 0)[1]).backward()
    dp.remove()


def _check_training_after_join(rank: int, world: int) -> None:
    """The ranks still training end their Join with a no_grad forward (an
    evaluation, all in the same iteration); rank 0, which ran out first,
    ended with a training step.
    After the Join every rank must agree whether the next forward
    broadcasts buffers: the ranks that ran out take it from the others'
    iterations (the one that ran out first broadcast, as its own last step
    said, in a collective the others never joined). Training goes on, the
    replicas alike (parameters and averaged gradients; each rank's forward
    leaves its own statistics in the buffers)."""
    torch.manual_seed(rank)
    model = _join_net()
    dp = data_parallel(model, k=2)
    x, t = _batch(rank, 0)
    with dp.join():
        for step in range(1 if rank == 0 else 2):
            F.mse_loss(model(x), t).backward()
        if rank > 0:
            with torch.no_grad():
                model(x)
    F.mse_loss(model(x), t).backward()
    mine = torch.cat([v.detach().flatten() for p in model.parameters() for v in (p, p.grad)])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    assert all(torch.equal(v, every[0]) for v in every), "the replicas differ"
    dp.remove()


def _dp_uneven(rank: int, world: int) -> None:
    first = [2, 4, 3][:world]  # rank 0 runs out first, with stale buffers
    for k in (0, 2, 4):
        _compare_uneven(rank, world, k, first).remove()
    _compare_uneven(rank, world, 2, first[::-1], accumulate=True).remove()
    _compare_uneven(rank, world, 4, first, divide_by_initial_world_size=False).remove()
    # a forward fusion's pending updates are applied before the Join's hooks
    # (they broadcast the last rank's model: the updated one, as eager's)
    _compare_uneven(rank, world, 2, first, fused=True).remove()
    # rank 0 runs out during the search for k (L + 2 = 6 steps at least)
    dp = _compare_uneven(rank, world, "auto", [3] + [12] * (world - 1))
    assert dp.scores is not None and not dp.searching, "the search for k did not end"
    ks = [None] * world
    dist.all_gather_object(ks, dp.k)
    assert len(set(ks)) == 1, f"ranks chose different k: {ks}"
    dp.remove()
    _check_join_throws(rank, world)
    _check_training_after_join(rank, world)


def _dp_cases(rank: int, world: int) -> None:
    _compare_buffers(rank, world)
    _compare_unsplit(rank, world)
    for k, shared in itertools.product((0, 2, DEPTH), (False, True)):
        dp = _compare_with_ddp(rank, world, k, shared, steps=3)
        assert dp.k == k and dp.layers == DEPTH
        dp.remove()
    for as_view in (False, True):
        _compare_accumulation(rank, world, as_view)
    _compare_no_grad_forward_inside_accumulation(rank, world)
    dp = _compare_with_ddp(rank, world, "auto", False, steps=100, search_iters=1)
    assert not dp.searching, "the search for k did not end in 100 iterations"
    assert 0 <= dp.k <= DEPTH
    ks = [None] * world
    dist.all_gather_object(ks, dp.k)
    assert len(set(ks)) == 1, f"ranks chose different k: {ks}"
    dp.remove()
    _dp_uneven(rank, world)


def _dp_deterministic_tied_accumulation(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for k in (0, 2, DEPTH):
        _compare_accumulation(rank, world, False, k=k, shared=True)


def _recorded(dp: DataParallel, dw_event: Callable, sync_event: Callable | None = None) -> list:
    """A list that records, in order, dw_event(task) for each dW task of dp
    as it is issued (every one, held or not, runs through handle._run_each;
    None: not recorded) and, with sync_event, sync_event(bucket) for each
    bucket all-reduce dp launches."""
    events = []
    run, launch = dp.handle._run_each, dp._launch

    def run_recording(tasks):
        events.extend(e for e in map(dw_event, tasks) if e is not None)
        return run(tasks)

    def launch_recording(bucket):
        events.append(sync_event(bucket))
        return launch(bucket)

    dp.handle._run_each = run_recording
    if sync_event is not None:
        dp._launch = launch_recording
    return events


def _dp_order(rank: int, world: int) -> None:
    """Reverse first-k, k = 2: layers 7 .. 2's dW in backward (split in the
    first iteration, plain autograd from the second), each bucket launched
    during backward; then dW 0, dW 1 after it, each layer's all-reduce right
    after its dW."""
    model = _Net()
    dp = DataParallel(model, k=2, bucket_cap_mb=1e-6)  # one bucket per parameter
    name = {p: n for n, p in model.named_parameters()}
    events = _recorded(dp, lambda t: ("dW", t.site.index),
                       lambda b: ("sync", [name[p] for p in b.params], dp._held is None))
    for step in range(2):
        events.clear()
        _train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batch(rank, step))
        during = []
        for l in range(DEPTH - 1, 1, -1):
            if step == 0:  # the first forward splits every layer; later only those below k
                during.append(("dW", l))
            during += [("sync", [f"layers.{l}.weight"], False),
                       ("sync", [f"layers.{l}.bias"], False)]
        after = [("dW", 0), ("sync", ["layers.0.weight", "layers.0.bias"], True),
                 ("dW", 1), ("sync", ["layers.1.weight", "layers.1.bias"], True)]
        # "scale" is no split layer: autograd accumulates it whenever its node
        # runs, so its bucket's place among the others is the engine's choice
        scale = ("sync", ["scale"], False)
        assert events.count(scale) == 1, events
        assert [e for e in events if e != scale] == during + after, events
        assert [s.split for s in sorted(dp.handle.sites, key=lambda s: s.index)] == \
            [True] * 2 + [False] * (DEPTH - 2), "layers past k must run plain autograd"
    dp.remove()


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_matches_ddp(world):
    """k in {0, 2, all} with and without a weight shared by layers 0 and 7,
    accumulation under no_sync() with and without gradient_as_bucket_view,
    then k = "auto" until its search ends: DDP's gradients and parameters at
    every step, bitwise on 2 ranks, to 1e-6 on 3 (where 1/3 is inexact and
    the gradient must be pre-divided as DDP does to come that close).
    Then uneven inputs under torch's Join (_dp_uneven; in this group of
    processes to save starting another): ranks train different numbers of
    steps, those that ran out repeat the others' collectives (the first k
    layers' all-reduces after backward, the buckets, the buffers' broadcast
    from the highest rank still training, the plan's agreement, the search
    for k's broadcasts), with k = 0, 2, all and "auto", with no_sync()
    accumulation and divide_by_initial_world_size=False: DDP-with-Join's
    parameters and buffers; then throw_on_early_termination. DataParallel
    was no Joinable: Join([dp]) raised, and without it the ranks still
    training waited until the timeout."""
    _spawn(_dp_cases, world)


def test_data_parallel_deterministic_tied_weight_accumulates_as_ddp():
    """Under torch.use_deterministic_algorithms, a weight tied between layers
    0 and 7, accumulated under no_sync(): DDP's parameters bitwise for every
    k, so k="auto" (picked from measured times) gives the same bits each
    run. The held layers' dW were added to .grad one by one after the
    others' ((g + s7) + s0, DDP's g + (s7 + s0)): 3e-8 off DDP, other bits
    for each k."""
    _spawn(_dp_deterministic_tied_accumulation, 2)


def _dp_deterministic_tied_autocast(rank: int, world: int, steps: int = 3) -> None:
    """_Net(shared=True) (layers 0 and 7 tied) under bf16 autocast and
    deterministic algorithms, k = 1 and 4: DDP's gradients, bitwise."""
    torch.use_deterministic_algorithms(True)
    for k in (1, 4):
        torch.manual_seed(rank)
        model = _Net(shared=True)
        ref = DistributedDataParallel(copy.deepcopy(model))
        dp = data_parallel(model, k=k)
        for step in range(steps):
            x, t = _batch(rank, step)
            for net in (ref, model):
                net.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.mse_loss(net(x).float(), t)
                loss.backward()
            _assert_same(model, ref.module, "grad")
        dp.remove()


def test_data_parallel_deterministic_tied_weight_under_autocast_matches_ddp():
    """Under deterministic algorithms a tied weight's dW go to autograd, as
    DDP's: under bf16 autocast its sites must read one cast copy, whose node
    sums their dW in bfloat16. They read two (the split's, inside the split
    Function, and, for the layers past k run plain from the second step,
    torch's cached one), summed apart in float32: 0.2% off DDP's in the first
    step, 0.15% in the next, for every k."""
    _spawn(_dp_deterministic_tied_autocast, 2)


class _ReadOutside(_Net):
    """_Net whose output is projected again by F.linear with layer 0's
    weight: a held layer's weight (k >= 1) also used outside split layers."""

    def forward(self, x):
        return F.linear(super().forward(x), self.layers[0].weight)


def _dp_weight_read_outside(rank: int, world: int, steps: int = 3) -> None:
    """_ReadOutside, k = 1 and 3, accumulated under no_sync() in float32 and
    under bf16 autocast, SGD with momentum: DDP's gradients and parameters,
    bitwise, after the backward that sees the use outside."""
    for k, dtype in itertools.product((1, 3), (torch.float32, torch.bfloat16)):
        torch.manual_seed(rank)
        model = _ReadOutside()
        ref = DistributedDataParallel(copy.deepcopy(model))
        dp = data_parallel(model, k=k)
        opts = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) for net in (ref, model)]

        def backward(net, batch):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
                out = net(_batch(rank, batch)[0])
            F.mse_loss(out.float(), _batch(rank, batch)[1]).backward()

        for net in (ref, model):  # the backward that sees the use outside
            backward(net, 99)
        for step in range(steps):
            for (net, handle), o in zip(((ref, ref), (model, dp)), opts):
                o.zero_grad()
                with handle.no_sync():
                    backward(net, 10 * step)
                backward(net, 10 * step + 1)
            _assert_same(model, ref.module, "grad")
            for o in opts:
                o.step()
            _assert_same(model, ref.module, "parameter")
        assert [s.outside for s in sorted(dp.handle.sites, key=lambda s: s.index)] == \
            [True] + [False] * (DEPTH - 1)
        dp.remove()


def test_data_parallel_weight_read_outside_split_layers_matches_ddp():
    """A held layer's weight also read outside split layers (F.linear of
    the output with layer 0's weight): its held dW was added to .grad after
    autograd's sum of the rest, where DDP's autograd sums every use at once
    (6e-8 of the largest element off DDP's under no_sync() accumulation in
    float32), and under bf16 autocast the split read a cast copy of its own
    (2.3e-3 off). Seen in the first backward, the layer runs plain from
    then on, inside the hold too: DDP's bits."""
    _spawn(_dp_weight_read_outside, 2)


class _Reused(nn.Module):
    """A Conv1d called twice per forward (one site, two calls), between two
    layers called once."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Conv1d(4, 4, 3, padding=1)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.out = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.conv(torch.tanh(self.conv(h))))
        return self.out(h)


def _train_like_ddp(rank: int, make_model, k: int, steps: int, accum: int, batch,
                    loss) -> DataParallel:
    """make_model() under data_parallel(k=k) and under DDP, from one seed:
    each step zeroes both, then runs `accum` backward passes of
    loss(net, batch(g)) (inputs drawn per rank), all but the last under
    no_sync(); DDP's gradients, bitwise, after every step. Returns the
    handle, still enabled."""
    torch.manual_seed(0)
    model = make_model()
    ref = DistributedDataParallel(copy.deepcopy(model))
    dp = data_parallel(model, k=k)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        for net in (ref, model):
            net.zero_grad()
        for a in range(accum):
            inputs = batch(g)
            for net, h in ((ref, ref), (model, dp)):
                with h.no_sync() if a < accum - 1 else contextlib.nullcontext():
                    loss(net, inputs).backward()
        _assert_same(model, ref.module, "grad")
    return dp


def _squared_mean_loss(amp: bool):
    """net(x)'s mean square, its forward under bf16 autocast where amp."""
    def loss(net, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            return net(x).float().pow(2).mean()
    return loss


def _dp_deterministic_reused_layer(rank: int, world: int, steps: int = 3) -> None:
    """_Reused under deterministic algorithms, k = 2 and 3 (the reused layer
    held), float32 accumulated under no_sync() and bf16 autocast: DDP's
    gradients, bitwise, at every step."""
    torch.use_deterministic_algorithms(True)
    for k, amp, accum in itertools.product((2, 3), (False, True), (1, 2)):
        dp = _train_like_ddp(rank, _Reused, k, steps, accum,
                             lambda g: torch.randn(4, 4, 16, generator=g), _squared_mean_loss(amp))
        dp.remove()


def test_data_parallel_deterministic_reused_layer_matches_ddp():
    """Under deterministic algorithms a module called twice per forward has
    its dW summed by autograd, as a weight shared by several layers: held,
    its two calls' dW were added to .grad one by one, apart from autograd's
    sum (a Conv1d called twice, k past it: 0.2% off DDP's in bfloat16,
    1.3e-7 in float32 under no_sync() accumulation)."""
    _spawn(_dp_deterministic_reused_layer, 2)


class _Encoder(nn.Module):
    """3 Conv1d + tanh: the encoder of a siamese net, called once per view."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv1d(4, 4, 3, padding=1)
        self.b = nn.Conv1d(4, 4, 3, padding=1)
        self.c = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _views_loss(zs: list) -> torch.Tensor:
    """A contrastive-like loss joining every view's output to the first's."""
    z = [t.float() for t in zs]
    return z[0].pow(2).mean() + sum((z[0] * t).mean() for t in z[1:])


def _encoded(net: nn.Module, xs: list, amp: str) -> list:
    """net called once per view: in float32, in one bfloat16 autocast
    context ("one") or in one context per view ("each", as a loop that
    enters autocast around each call)."""
    if amp == "each":
        outs = []
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(net(x))
        return outs
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "one"):
        return [net(x) for x in xs]


def _dp_deterministic_siamese(rank: int, world: int, steps: int = 2) -> None:
    """_Encoder called 2 and 3 times (views) before one backward, under
    deterministic algorithms, k = 1 and 3, float32 accumulated under
    no_sync() and bfloat16 autocast (one context, or one per view): DDP's
    gradients, bitwise, at every step. Called once per backward, no layer
    is reused (held, not summed by autograd), under no_sync() too."""
    torch.use_deterministic_algorithms(True)
    cases = [("none", 2), ("one", 1), ("each", 1), ("each", 2)]
    for k, (amp, accum), views in itertools.product((1, 3), cases, (1, 2, 3)):
        dp = _train_like_ddp(rank, _Encoder, k, steps, accum,
                             lambda g: [torch.randn(2, 4, 8, generator=g) for _ in range(views)],
                             lambda net, xs: _views_loss(_encoded(net, xs, amp)))
        assert [s.reused for s in dp.handle.sites] == [views > 1] * 3
        dp.remove()


def test_data_parallel_deterministic_siamese_matches_ddp():
    """The model called once per view before one backward (siamese nets,
    two-view contrastive training): under deterministic algorithms each
    layer is seen as reused across the model's calls, its dW summed by
    autograd as DDP's (which takes several forwards before one backward).
    Seen per forward, the calls' dW were added apart: 2.4e-3 of the largest
    element off DDP's in bfloat16, 1.7e-7 in float32 under no_sync(); and
    autocast's copy of a weight was shared across two autocast contexts,
    where torch makes one per context (2.4e-3 off)."""
    _spawn(_dp_deterministic_siamese, 2)


def test_data_parallel_order():
    _spawn(_dp_order, 2)


def _dp_rank_dependent_arguments(rank: int, world: int) -> None:
    one_layer = (WIDTH * WIDTH + WIDTH) * 4 / 2 ** 20  # MiB: one Linear per bucket
    dp = _compare_with_ddp(rank, world, 2 * rank, False, steps=3,
                           bucket_cap_mb=one_layer if rank == 0 else None)
    assert dp.k == 0 and dp._cap == one_layer * 2 ** 20 == dp._first_cap
    dp.remove()
    dp = _compare_with_ddp(rank, world, "auto" if rank == 0 else 1, False, steps=100,
                           search_iters=1 + rank)
    assert dp.search_iters == 1 and dp.scores is not None and not dp.searching
    ks = [None] * world
    dist.all_gather_object(ks, dp.k)
    assert len(set(ks)) == 1, f"ranks chose different k: {ks}"
    dp.remove()


def test_data_parallel_uses_rank_0s_arguments():
    """k, bucket_cap_mb and search_iters given differently on each rank (a
    per-rank configuration; k="auto" on one rank only): every rank uses rank
    0's, as DDP uses rank 0's buckets, so gradients and parameters are DDP's
    and the search for k runs on every rank. Each rank planned its buckets
    from its own: with one layer per bucket the ranks summed different
    layers' gradients (5e-2 off DDP's), otherwise gloo aborted on tensors of
    different sizes."""
    _spawn(_dp_rank_dependent_arguments, 2)


class _Branchy(nn.Module):
    """A layer that a rank calls or skips by rank and step (DDP's
    find_unused_parameters case: the ranks' first-call orders differ, and
    in some steps no rank calls it), and a layer no rank ever calls."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.branch = nn.Linear(WIDTH, WIDTH)  # registered last, called second

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.a(x))
        if use_branch:
            h = torch.tanh(self.branch(h))
        return self.head(torch.tanh(self.b(h)))


def _compare_branchy(rank: int, world: int, k: int, steps: int = 4) -> None:
    """Against DDP(find_unused_parameters=True), with weight decay and
    momentum, which move a parameter whose .grad is zeros and not one whose
    .grad is None: the branch's gradient is averaged with zeros from the
    ranks that skipped it, and left None in a step where every rank did."""
    torch.manual_seed(rank)
    model = _Branchy()
    ref = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    dp = data_parallel(model, k=k)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
                    for m in (model, ref))
    for step in range(steps):
        x, t = _batch(rank, step)
        use_branch = (rank + step) % 3 == 0  # on 2 ranks: rank 0, none, rank 1, rank 0
        for net, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            F.mse_loss(net(x, use_branch), t).backward()
        _assert_same(model, ref.module, "grad", world == 2)
        ref_opt.step()
        opt.step()
        _assert_same(model, ref.module, "parameter", world == 2)
    assert model.unused.weight.grad is None and dp.layers == 4
    dp.remove()


def _dp_branchy(rank: int, world: int) -> None:
    for k in (0, 2, 5):
        _compare_branchy(rank, world, k)
    _compare_used_only_under_no_sync(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_rank_dependent_branch(world):
    """Buckets are the same on every rank although the ranks call different
    layers in different orders (they were planned from each rank's own
    calls: other parameters summed together, or a gloo abort for k = 5);
    unused parameters get DDP's gradients, None where no rank used them;
    a use in a no_sync() backward counts (_compare_used_only_under_no_sync)."""
    _spawn(_dp_branchy, world)


def _average(model: nn.Module, world: int) -> None:
    """DDP's average, parameter by parameter: each .grad times 1/world, summed."""
    for p in model.parameters():
        p.grad.mul_(1.0 / world)
        dist.all_reduce(p.grad)


def _backward_retried(net: nn.Module, x: torch.Tensor, t: torch.Tensor) -> None:
    """A backward that a hook at layers[1]'s output makes raise once, run
    again on the same graph (retain_graph) after zero_grad(), with no
    forward between."""
    armed = [True]

    def flaky(grad):
        if armed:
            armed.pop()
            raise ValueError("transient")

    def add_flaky(module, args, out):
        out.register_hook(flaky)

    check = net.layers[1].register_forward_hook(add_flaky)
    loss = F.mse_loss(net(x), t)
    check.remove()
    with pytest.raises(ValueError, match="transient"):
        loss.backward(retain_graph=True)
    net.zero_grad()
    loss.backward()


def _dp_after_failed_backward(rank: int, world: int) -> None:
    """A check in a tensor hook raises in one backward on every rank, after
    the last layers' buckets went (one per parameter) and while layers 0
    and 1 were held (k = 2): the next steps are averaged as before. So is a
    retry of a backward that raised, with no forward between (before, the
    handle took it for the failed pass still running, and nothing of it
    was averaged)."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2, bucket_cap_mb=1e-6)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def failing_check(grad):
        raise ValueError("gradient check failed")

    def add_check(module, args, out):
        out.register_hook(failing_check)

    x, t = _batch(rank, 0)
    check = model.layers[1].register_forward_hook(add_check)
    with pytest.raises(ValueError, match="gradient check failed"):
        F.mse_loss(model(x), t).backward()
    check.remove()
    for step in range(1, 3):
        x, t = _batch(rank, step)
        for net, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            F.mse_loss(net(x), t).backward()
        _average(ref, world)
        _assert_same(model, ref, "grad")
        ref_opt.step()
        opt.step()
        _assert_same(model, ref, "parameter")
    x, t = _batch(rank, 3)
    for net in (ref, model):
        _backward_retried(net, x, t)
    _average(ref, world)
    _assert_same(model, ref, "grad")
    dp.remove()


def _dp_after_failed_held_dw(rank: int, world: int, steps: int = 3) -> None:
    """A check on a held layer's parameter (a post-accumulate-grad hook on
    layers[0].weight, k = 2) raises on every rank after autograd finished,
    when the other layers' buckets (one per parameter) have been launched:
    the next backward is averaged, step after step. The buckets were not
    waited for: their all-reduces still wrote into the flat buffers while
    the next backward filled them (wrong averages, the same on every rank;
    with this many buckets, 5 runs in 5)."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2, bucket_cap_mb=1e-6)
    armed = [False]

    def failing_check(p):
        if armed[0]:
            raise ValueError("gradient check failed")

    model.layers[0].weight.register_post_accumulate_grad_hook(failing_check)
    for step in range(steps):
        x, t = _batch(rank, step)
        armed[0] = True
        with pytest.raises(ValueError, match="gradient check failed"):
            F.mse_loss(model(x), t).backward()
        armed[0] = False
        for net in (ref, model):
            net.zero_grad()
            F.mse_loss(net(x), t).backward()
        _average(ref, world)
        _assert_same(model, ref, "grad")
    dp.remove()


def _dp_failed_backwards(rank: int, world: int) -> None:
    _dp_after_failed_backward(rank, world)
    _dp_after_failed_held_dw(rank, world)


def test_data_parallel_after_failed_backward():
    """The failed backward's end never ran; it left the handle in backward,
    and later gradients were not averaged at all. A backward whose end
    raised left its buckets' all-reduces running into the next one's."""
    _spawn(_dp_failed_backwards, 2)


class _Policy(nn.Module):
    """An RL policy's head: a mean, and a learned log-std returned as it is
    (a leaf among the outputs)."""

    def __init__(self):
        super().__init__()
        self.mean = nn.Linear(WIDTH, WIDTH)
        self.log_std = nn.Parameter(torch.linspace(-0.5, 0.5, WIDTH))

    def forward(self, x):
        return self.mean(x), self.log_std


def _policy_loss(out, t):
    mean, log_std = out
    return ((mean - t).square() * torch.exp(-log_std)).mean() + log_std.sum()


def _check_output_parameter(rank: int, world: int, steps: int = 3) -> None:
    """A model that returns one of its Parameters: DDP's gradients, and no
    hook left on that Parameter (it got one per forward, never removed: 3000
    after 3000 steps). After remove(), a backward of a loss made before it
    runs on rank 0 alone, with no collective (it hung in an all-reduce)."""
    torch.manual_seed(0)
    model = _Policy()
    ref = DistributedDataParallel(copy.deepcopy(model))
    dp = data_parallel(model, k=1)
    held, release = [], dp._release_held

    def record_held():
        tasks = release()
        held.extend(tasks)
        return tasks

    dp._release_held = record_held
    for step in range(steps):
        x, t = _batch(rank, step)
        for net in (ref, model):
            net.zero_grad()
            _policy_loss(net(x), t).backward()
        _assert_same(model, ref.module, "grad", world == 2)
        assert not model.log_std._backward_hooks, "hooks piled up on the returned Parameter"
    # backward starts at the returned leaf's AccumulateGrad: the first layer is still held
    assert [t.site.module for t in held] == [model.mean] * steps
    dp._release_held = release
    pending = _policy_loss(model(x), t)
    dp.remove()
    if rank == 0:
        model.zero_grad()
        pending.backward()
        local = torch.autograd.grad(_policy_loss(model(x), t), list(model.parameters()))
        for p, g in zip(model.parameters(), local):
            torch.testing.assert_close(p.grad, g, msg="not this rank's own gradient")


def _check_different_models(rank: int, world: int) -> None:
    """Ranks that build models of other widths or depths (a configuration
    bug): DDP's clear error, on every rank (the broadcast crashed gloo or
    hung), and the group still works."""
    wider = nn.Sequential(nn.Linear(WIDTH, WIDTH + rank), nn.Linear(WIDTH + rank, 1))
    deeper = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(2 + rank)))
    with_buffer = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH + rank))
    for model in (wider, deeper, with_buffer):
        with pytest.raises(ValueError, match="^model: .*every rank must build the same model"):
            data_parallel(model, k=0)
        assert all("forward" not in m.__dict__ for m in model.modules()), "split left behind"
    data_parallel(nn.Linear(WIDTH, WIDTH), k=0).remove()


def _check_broadcast_buffers_agree(rank: int, world: int) -> None:
    """broadcast_buffers given differently on the ranks of a model with
    buffers: a ValueError naming it and the ranks' values on every rank (one
    rank then broadcast buffers before each forward, in a collective the
    others never joined: a hang until the timeout). Without buffers it
    changes nothing, and is not checked."""
    bn = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH))
    with pytest.raises(ValueError, match=r"^broadcast_buffers: differs between the ranks "
                                         r"\(ranks 0, 2: True; rank 1: False\)"):
        data_parallel(bn, k=0, broadcast_buffers=rank != 1)
    assert all("forward" not in m.__dict__ for m in bn.modules()), "split left behind"
    data_parallel(nn.Linear(WIDTH, WIDTH), k=0, broadcast_buffers=rank != 1).remove()
    data_parallel(bn, k=0, broadcast_buffers=False).remove()


def _check_requires_grad_agrees(rank: int, world: int) -> None:
    """A parameter frozen on one rank only when data_parallel is built: a
    ValueError naming it on every rank, as DDP's (the ranks bucketed other
    parameters, and gloo aborted every rank at the first backward's
    all-reduce of buckets of other sizes)."""
    net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    net[0].bias.requires_grad_(rank != 1)
    with pytest.raises(ValueError, match=r"^model\.0\.bias\.requires_grad: differs between the "
                                         r"ranks \(ranks 0, 2: True; rank 1: False\)"):
        data_parallel(net, k=0)
    assert all("forward" not in m.__dict__ for m in net.modules()), "split left behind"
    net[0].bias.requires_grad_(False)  # frozen on every rank: fine
    data_parallel(net, k=0).remove()


class _Expanded(nn.Module):
    """A Linear plus a (3, WIDTH) Parameter and buffer made by expand()
    (stride 0 along dim 0) or by clone() of that."""

    def __init__(self, expanded: bool):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        made = (lambda t: t) if expanded else torch.clone
        self.shift = nn.Parameter(made(torch.zeros(WIDTH).expand(3, WIDTH)))
        self.register_buffer("offset", made(torch.ones(WIDTH).expand(3, WIDTH)))

    def forward(self, x):
        return self.lin(x) + self.shift.sum(0) + self.offset.sum(0)


def _check_repeated_tensors_refused(rank: int, world: int) -> None:
    """A Parameter made by expand(): the broadcast from rank 0 failed inside
    torch ("more than one element of the written-to tensor refers to a
    single memory location", naming no tensor), as DDP's does. Now a
    ValueError naming it on every rank, before anything is installed; so is
    such a buffer where buffers are broadcast; without broadcast_buffers
    (rank-local buffers) that buffer is fine, and so are clones, a stride-0
    dim of size 1 and an empty expanded Parameter (nothing repeats)."""
    with pytest.raises(RuntimeError, match="single memory location"):
        DistributedDataParallel(_Expanded(True))  # DDP refuses it too
    model = _Expanded(True)
    with pytest.raises(ValueError, match=r"^model\.shift: a parameter that repeats its "
                                         r"elements \(stride 0 along dim\(s\) \[0\]"):
        data_parallel(model, k=1)
    assert all("forward" not in m.__dict__ for m in model.modules()), "split left behind"
    model.shift = nn.Parameter(model.shift.clone())
    with pytest.raises(ValueError, match=r"^model\.offset: a buffer broadcast "
                                         r"\(broadcast_buffers=True\) that repeats"):
        data_parallel(model, k=1)
    data_parallel(model, k=1, broadcast_buffers=False).remove()
    model = _Expanded(False)
    model.row = nn.Parameter(torch.zeros(WIDTH).as_strided((1, WIDTH), (0, 1)))
    model.empty = nn.Parameter(torch.zeros(0).expand(3, 0))
    DistributedDataParallel(copy.deepcopy(model))  # as DDP accepts them
    data_parallel(model, k=1).remove()


def _check_non_member(rank: int, world: int) -> None:
    """A group of ranks 0 and 1: its members average over it as DDP does;
    the rank left out gets a ValueError naming process_group from both
    classes (DataParallel failed in torch's shape check with a TypeError,
    Pipeline with "stages: ... got -1")."""
    group = dist.new_group([0, 1])
    if rank > 1:
        for make in (lambda: data_parallel(_Net(), process_group=group, k=1),
                     lambda: Pipeline(_blocks(), micro_batches=2, process_group=group)):
            with pytest.raises(ValueError, match="^process_group: .*not a member"):
                make()
        return
    torch.manual_seed(rank)
    model = _Net()
    ref = DistributedDataParallel(copy.deepcopy(model), process_group=group)
    dp = data_parallel(model, process_group=group, k=1)
    x, t = _batch(rank, 0)
    for net in (ref, model):
        F.mse_loss(net(x), t).backward()
    _assert_same(model, ref.module, "grad")
    dp.remove()


def _compare_buffers_skipping_broadcasts(rank: int, world: int) -> None:
    """DDP broadcasts buffers before a forward only when the forward before
    it ran in grad mode outside no_sync() (or there was none): after two
    no_sync() steps, a synced one, a no_grad forward (BatchNorm in training
    mode still updates its statistics) and two more steps, the buffers equal
    DDP's on every rank. DataParallel broadcast before every forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                          nn.Linear(WIDTH, WIDTH))
    ref = DistributedDataParallel(copy.deepcopy(model))
    dp = data_parallel(model, k=1)
    steps = [("no_sync", 0), ("no_sync", 1), ("sync", 2), ("no_grad", 3), ("sync", 4), ("sync", 5)]
    for how, step in steps:
        x, t = _batch(rank, step)
        for net, handle in ((ref, ref), (model, dp)):
            with handle.no_sync() if how == "no_sync" else contextlib.nullcontext():
                with torch.no_grad() if how == "no_grad" else contextlib.nullcontext():
                    loss = F.mse_loss(net(x), t)
                if loss.requires_grad:
                    loss.backward()
        for (name, a), b in zip(model.named_buffers(), ref.module.buffers()):
            assert torch.equal(a, b), f"rank {rank}, {how} step {step}: {name} differs from DDP's"
    dp.remove()


def _compare_local_buffers(rank: int, world: int, steps: int = 3) -> None:
    """broadcast_buffers=False: each rank's buffers are its own from the
    start, as DDP's (whose init broadcast then skips them too), the
    parameters rank 0's: a BatchNorm's running statistics equal DDP's on
    every rank after every step, and so do the gradients. Construction
    overwrote them with rank 0's."""
    torch.manual_seed(rank)  # replicas differ until both broadcast rank 0's parameters
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                          nn.Linear(WIDTH, WIDTH))
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank))
        model[1].num_batches_tracked.fill_(rank)
    with warnings.catch_warnings():  # torch 2.13 deprecates the name, not what it does
        warnings.simplefilter("ignore", FutureWarning)
        ref = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=False)
    dp = data_parallel(model, k=1, broadcast_buffers=False)
    assert model[1].running_mean.eq(rank).all(), "a rank's own buffers were overwritten"
    _assert_same(model, ref.module, "parameter")
    for step in range(steps):
        x, t = _batch(rank, step)
        for net in (ref, model):
            net.zero_grad()
            F.mse_loss(net(x), t).backward()
        for (name, a), b in zip(model.named_buffers(), ref.module.buffers()):
            assert torch.equal(a, b), f"rank {rank}, step {step}: {name} differs from DDP's"
        _assert_same(model, ref.module, "grad", world == 2)
    dp.remove()


def _dp_edge_cases(rank: int, world: int) -> None:
    _compare_buffers_skipping_broadcasts(rank, world)
    _compare_local_buffers(rank, world)
    _check_output_parameter(rank, world)
    _check_different_models(rank, world)
    _check_different_buffers(rank, world)
    _check_broadcast_buffers_agree(rank, world)
    _check_requires_grad_agrees(rank, world)
    _check_repeated_tensors_refused(rank, world)
    _check_non_member(rank, world)


@pytest.mark.parametrize("reentrant", [False, True])
def test_data_parallel_checkpointed_model(solo_group, reentrant):
    """The whole model under activation checkpointing: its forward runs
    again inside backward, which must not be taken for a new step that
    finds an unfinished backward (dropping the held layers' dW)."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2)
    for step in range(2):
        x, t = _batch(0, step)
        x.requires_grad_(reentrant)  # reentrant checkpointing needs an input that does
        for net in (model, ref):
            net.zero_grad()
            F.mse_loss(checkpoint(net, x, use_reentrant=reentrant), t).backward()
        _assert_same(model, ref, "grad")
    dp.remove()


def test_data_parallel_solo(solo_group):
    """One rank: the gradients of plain autograd, for any k."""
    for k in (0, 3, DEPTH):
        torch.manual_seed(0)
        model = _Net(shared=True)
        ref = copy.deepcopy(model)
        dp = DataParallel(model, k=k)
        x, t = _batch(0, 0)
        F.mse_loss(model(x), t).backward()
        F.mse_loss(ref(x), t).backward()
        _assert_same(model, ref, "grad")
        dp.remove()


class _CalledBackwards(nn.Module):
    """4 Linear + tanh layers that forward calls last-registered first: the
    forward order is the reverse of the module order."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        for lin in reversed(self.layers):
            x = torch.tanh(lin(x))
        return x


def test_data_parallel_numbers_layers_in_forward_order_not_module_order(solo_group):
    """Reverse first-k holds the k layers forward calls first, whatever the
    module order: with k = 1 and layers called in reverse of their
    registration, the layer held (its dW after backward, the only one still
    split from the second forward on) is layers[3], the first called;
    gradients those of plain autograd."""
    torch.manual_seed(0)
    model = _CalledBackwards()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=1)
    first = model.layers[3]
    after_backward = _recorded(dp, lambda t: t.site.module if dp._held is None else None)
    for step in range(2):
        after_backward.clear()
        x, t = _batch(0, step)
        for net in (model, ref):
            net.zero_grad()
            F.mse_loss(net(x), t).backward()
        _assert_same(model, ref, "grad")
        index = {m: f"layers[{i}]" for i, m in enumerate(model.layers)}
        assert dp._held_modules == {first}, \
            f"step {step}: held {sorted(map(index.get, dp._held_modules))}, not layers[3]"
        assert after_backward == [first], \
            f"step {step}: dW after backward of {list(map(index.get, after_backward))}"
        split = [index[s.module] for s in dp.handle.sites if s.split]
        assert split == ["layers[3]"], f"step {step}: split {split}"
    dp.remove()


@pytest.mark.parametrize("search_iters", [1, 2])
def test_data_parallel_search_times_each_k_search_iters_times(solo_group, search_iters):
    """k = "auto" times `search_iters` iterations at each k it measures
    (backward end to backward end: the first backward starts the clock), so
    the search ends after 1 + search_iters * (the k measured) iterations,
    with plain autograd's gradients throughout."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k="auto", search_iters=search_iters)
    iterations = 0
    while dp.searching:
        assert iterations < 200, "the search for k did not end"
        x, t = _batch(0, iterations)
        for net in (model, ref):
            net.zero_grad()
            F.mse_loss(net(x), t).backward()
        _assert_same(model, ref, "grad")
        iterations += 1
    measured = int(np.isfinite(dp.scores).sum())
    assert measured >= 2 and iterations == 1 + search_iters * measured, (iterations, measured)
    dp.remove()


class _OptionalHead(nn.Module):
    """3 Linear + tanh layers, then a Linear `extra` only where forward is told to."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.extra = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, extra: bool):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return self.extra(x) if extra else x


def test_data_parallel_backward_that_raised_leaves_no_parameter_used(solo_group):
    """A backward that raises (a check at layers[0]'s output) after `extra`
    got its gradient; zero_grad(); then a step that does not use `extra`:
    its .grad stays None, as plain autograd (and DDP with
    find_unused_parameters) leave it. The failed pass's uses were kept,
    and `extra` got an averaged zero gradient (momentum and weight decay
    then move it)."""
    torch.manual_seed(0)
    model = _OptionalHead()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=0)

    def failing_check(grad):
        raise ValueError("gradient check failed")

    def add_check(module, args, out):
        out.register_hook(failing_check)

    x, t = _batch(0, 0)
    for net in (model, ref):
        check = net.layers[0].register_forward_hook(add_check)
        out = net(x, extra=True)
        check.remove()
        with pytest.raises(ValueError, match="gradient check failed"):
            F.mse_loss(out, t).backward()
        assert net.extra.weight.grad is not None, "extra got no gradient before the raise"
        net.zero_grad()
        F.mse_loss(net(x, extra=False), t).backward()
    assert model.extra.weight.grad is None and model.extra.bias.grad is None, \
        "a parameter used only by the backward that raised got a gradient"
    _assert_same(model, ref, "grad")
    dp.remove()


def test_data_parallel_held_layers_reduce_right_after_their_dw_with_an_unused_parameter(solo_group):
    """Reverse first-k with k = 2 in a step that leaves `extra` unused (its
    buckets never complete in autograd): each held layer's all-reduce is
    still launched right after its dW (layer 0's before layer 1's dW), not
    all after the last dW; gradients those of plain autograd."""
    torch.manual_seed(0)
    model = _OptionalHead()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2, bucket_cap_mb=1e-6)  # one bucket per parameter
    name = {p: n for n, p in model.named_parameters()}
    layer = {m: f"layers.{i}" for i, m in enumerate(model.layers)}
    events = _recorded(dp, lambda t: ("dW", layer[t.site.module]) if dp._held is None else None,
                       lambda b: ("sync", name[b.params[0]]))
    for step in range(2):
        events.clear()
        x, t = _batch(0, step)
        for net in (model, ref):
            net.zero_grad()
            F.mse_loss(net(x, extra=False), t).backward()
        _assert_same(model, ref, "grad")
        dw = [i for i, e in enumerate(events) if e[0] == "dW"]
        assert [events[i] for i in dw] == [("dW", "layers.0"), ("dW", "layers.1")], events
        assert events[dw[0] + 1:dw[1]] == [("sync", "layers.0.weight")], events
        assert events[dw[1] + 1:] == [("sync", "layers.1.weight")], events
    dp.remove()


def test_data_parallel_backward_not_from_the_outputs_holds_no_layer(solo_group):
    """An auxiliary loss on a hidden activation (layer 3's output), backward
    on its own: autograd never reaches the model's outputs, so the backward
    begins at a parameter's gradient, when layers' backward already ran, and
    reverse first-k (k = 2) holds nothing in it: every split layer's dW runs
    inside autograd, before the buckets (all launched at its end: layers 4 ..
    7 get no gradient) are reduced. Gradients those of plain autograd."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2, bucket_cap_mb=1e-6)  # one bucket per parameter
    name = {p: n for n, p in model.named_parameters()}
    events = _recorded(dp, lambda t: ("dW", t.site.index, dp._held is not None),
                       lambda b: ("sync", name[b.params[0]]))
    for step in range(2):
        events.clear()
        x, _ = _batch(0, step)
        for net in (model, ref):
            net.zero_grad()
            hidden = []
            hook = net.layers[3].register_forward_hook(lambda m, args, out: hidden.append(out))
            net(x)
            hook.remove()
            hidden[0].pow(2).mean().backward()
        _assert_same(model, ref, "grad")
        dw = [e for e in events if e[0] == "dW"]
        # (the first forward splits every layer; later only those below k)
        assert dw == [("dW", l, False) for l in (range(3, -1, -1) if step == 0 else (1, 0))], events
        assert events[:len(dw)] == dw, events
    dp.remove()


class _NoGradientFor(torch.autograd.Function):
    """x * s, whose backward gives s no gradient (None)."""

    @staticmethod
    def forward(ctx, x, s):
        return x * s.detach()

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScaledWithoutGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x):
        return _NoGradientFor.apply(torch.tanh(self.lin(x)), self.s)


def test_data_parallel_parameter_whose_node_gives_no_gradient_keeps_none(solo_group):
    """A parameter in the graph whose node returns no gradient for it: its
    AccumulateGrad still runs, with none; it counts as unused, and its
    .grad stays None, as under DDP(find_unused_parameters=True) (and plain
    autograd); it got zeros."""
    torch.manual_seed(0)
    model = _ScaledWithoutGradient()
    ref = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    dp = DataParallel(model, k=1)
    for step in range(2):
        x, t = _batch(0, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DDP: "did not find any unused parameters"
            for net in (model, ref):
                net.zero_grad()
                F.mse_loss(net(x), t).backward()
        assert ref.module.s.grad is None
        assert model.s.grad is None, f"step {step}: {model.s.grad}"
        _assert_same(model, ref.module, "grad")
    dp.remove()


def test_data_parallel_model_converted_after_planning(solo_group):
    """model.double() after the buckets were planned in float32: the float64
    gradients were averaged in the float32 buckets (3.6e-8 off on one rank).
    The buckets are planned again for the new dtype."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2)
    x, t = _batch(0, 0)
    F.mse_loss(model(x), t).backward()
    for net in (model, ref):
        net.double()
        net.zero_grad()
        F.mse_loss(net(x.double()), t.double()).backward()
    _assert_same(model, ref, "grad")
    dp.remove()


class _CastingNet(_Net):
    """_Net whose layers may have different dtypes: each casts its input to its own."""

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x.to(lin.weight.dtype)))
        return x.to(self.scale.dtype) * self.scale


@pytest.mark.parametrize("model_dtype,layer_dtype", [
    (torch.float32, torch.float64),   # old: 2.7e-9 off (float32 rounding)
    (torch.bfloat16, torch.float32),  # old: 1e-4 off (bfloat16 rounding)
    (torch.float16, torch.float32),
])
def test_data_parallel_one_layer_converted_after_planning(solo_group, model_dtype, layer_dtype):
    """One layer converted after the buckets were planned (a layer kept in
    float32 in a bfloat16 model, one .double()): its parameters sat in a
    bucket of the model's dtype, not first in it, and the staleness check
    looked only at each bucket's first parameter: their gradients were
    averaged in the bucket's lower precision and written back rounded. Every
    parameter's dtype is checked; the buckets are planned again."""
    torch.manual_seed(0)
    model = _CastingNet().to(model_dtype)
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2)
    x, t = _batch(0, 0)
    F.mse_loss(model(x).float(), t).backward()
    for net in (model, ref):
        net.layers[DEPTH // 2].to(layer_dtype)
        net.zero_grad()
        F.mse_loss(net(x).float(), t).backward()
    assert model.layers[DEPTH // 2].weight.grad.dtype == layer_dtype
    _assert_same(model, ref, "grad")
    dp.remove()


class _TwoLinear(nn.Module):
    """Two Linear(2, 2), each casting its input to its own dtype: one bucket
    of 12 elements and 4 flags, 64 bytes in float32, as many as the planning
    agreement's 8 float64 slots."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.to(self.a.weight.dtype))).to(self.b.weight.dtype))


def _dp_one_rank_converts(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _TwoLinear()
    DataParallel(model, k=0)
    x = torch.full((4, 2), 1.0 + rank)
    model(x).sum().backward()
    if rank == 1:
        model.a.double()
    model.zero_grad()
    if rank == 0:
        model(x).sum().backward()  # (its gradients are garbage: the message says so)
        return
    with pytest.raises(RuntimeError, match="collectives are out of step.*on every rank"):
        model(x).sum().backward()


def test_data_parallel_model_converted_on_one_rank_only_raises_clearly():
    """A layer converted on one rank only: that rank planned its buckets
    again alone, and its agreement's all-reduce met its peer's bucket: of
    the same size (64 bytes here), it read the sum as k (ValueError: cannot
    convert float NaN to integer), else gloo aborted the process. Of the same
    size, it raises a RuntimeError naming the cause."""
    _spawn(_dp_one_rank_converts, 2)


def _dp_swap_converted(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _Net()
    # the reference: plain autograd, its gradients averaged by hand (DDP's
    # Reducer refuses the swap, and after an in-place .half().float() its own
    # gradients are off the average)
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2)
    for step in range(4):
        if step == 2:
            ref.half().float()  # (in place: the same values)
            was = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                model.half().float()
            finally:
                torch.__future__.set_swap_module_params_on_conversion(was)
        x, t = _batch(rank, step)
        for net in (model, ref):
            net.zero_grad()
            F.mse_loss(net(x), t).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        _assert_same(model, ref, "grad")
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                p.sub_(0.1 * p.grad)
                r.sub_(0.1 * r.grad)
    dp.remove()


def test_data_parallel_averages_after_a_swapping_conversion():
    """model.half().float() (any .to(), .cpu(), load_state_dict) under
    torch.__future__.set_swap_module_params_on_conversion(True) keeps each
    Parameter object but moves it to a new TensorImpl, and autograd runs the
    hooks of the old one: DataParallel's post-accumulate-grad hooks stopped
    firing, no parameter counted as used, and every bucket kept each rank's
    own gradients, unaveraged: the replicas drifted apart, silently (DDP's
    Reducer refuses the swap). The average of the ranks' gradients, bitwise
    on 2 ranks."""
    _spawn(_dp_swap_converted, 2)


def _averaged_by_hand(model: nn.Module, world: int) -> None:
    """DDP's average of the gradients there are (each times 1/world, summed)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(1.0 / world)
            dist.all_reduce(p.grad)


def _sgd_both(model: nn.Module, ref: nn.Module) -> None:
    """One SGD step (lr 0.1) of both models on the gradients they have, then
    their parameters compared bitwise."""
    with torch.no_grad():
        for net in (model, ref):
            for p in net.parameters():
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
    _assert_same(model, ref, "parameter")


def _compare_unfrozen(rank: int, world: int, k: int, as_view: bool, steps: int = 6) -> None:
    """Layers 0-2 of _Net frozen whole (split, run plain while frozen) and
    layers 3 and 4's weights (split on their biases; held at k = 2) frozen
    when DataParallel is built, unfrozen at steps 2 and 3 (layers 0-2 then
    the first of the plan's 8 layers: held at k = 2; layer 1's weight first,
    its bias a step later), layer 2 frozen again at step 5, and
    layers[5].weight frozen at step 1 and unfrozen at step 4 between the
    forward and its backward: every gradient is the average of the ranks'
    (None where no rank has one), bitwise, and the replicas step alike; a
    step that accumulates a no_sync() backward first averages the sum."""
    torch.manual_seed(0)
    model = _Net()
    for lin in model.layers[:3]:
        lin.requires_grad_(False)
    for lin in model.layers[3:5]:
        lin.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=k, gradient_as_bucket_view=as_view)
    for step in range(steps):
        for net in (model, ref):
            if step == 1:
                net.layers[5].weight.requires_grad_(False)
            if step == 2:
                for p in (net.layers[0], net.layers[1].weight, net.layers[2], net.layers[3].weight):
                    p.requires_grad_(True)
            if step == 3:
                net.layers[1].bias.requires_grad_(True)
                net.layers[4].weight.requires_grad_(True)
            if step == 5:
                net.layers[2].requires_grad_(False)
        x, t = _batch(rank, step)
        for net in (model, ref):
            net.zero_grad()
            if step == 2:  # the first unfrozen step begins under no_sync(): hooked at its forward
                with dp.no_sync() if net is model else contextlib.nullcontext():
                    F.mse_loss(net(t), x).backward()
            loss = F.mse_loss(net(x), t)
            if step == 4:
                net.layers[5].weight.requires_grad_(True)  # in no graph yet: no gradient
            loss.backward()
        _averaged_by_hand(ref, world)
        _assert_same(model, ref, "grad")
        _sgd_both(model, ref)
    assert model.layers[0].weight.grad is not None and model.layers[5].weight.grad is not None
    assert dp.layers == DEPTH  # (layers 0-2 planned too)
    dp.remove()


def _dp_unfrozen_order(rank: int, world: int) -> None:
    """Layers 0-2 of _Net frozen whole when DataParallel is built: not
    layers of the plan while frozen (k = 2 holds layers 3 and 4), yet in
    the forward order; unfrozen at step 1 (layer 1's weight alone), they
    join the plan at its backward in their place: from step 2 on layers 0
    and 1 are the held ones, split, their dW after backward, each bucket
    right after its dW (layer 1's frozen bias in none), the others plain,
    bucketed in reverse forward order. Before, a layer frozen whole was
    never split: unfrozen, it ran plain autograd, out of reverse first-k."""
    torch.manual_seed(0)
    model = _Net()
    model.layers[:3].requires_grad_(False)
    dp = DataParallel(model, k=2, bucket_cap_mb=1e-6)  # one bucket per parameter
    name = {p: n for n, p in model.named_parameters()}
    events = _recorded(dp, lambda t: ("dW", t.site.index),
                       lambda b: ("sync", [name[p] for p in b.params], dp._held is None))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        if step == 1:
            for lin in (model.layers[0], model.layers[2], model.layers[1].weight):
                lin.requires_grad_(True)
        events.clear()
        _train_step(model, opt, *_batch(rank, step))
        assert dp.layers == (DEPTH - 3 if step == 0 else DEPTH), step
        held = [s.module for s in dp.handle.sites if dp._position.get(s, dp.k) < dp.k]
        assert held == list(model.layers[3:5] if step == 0 else model.layers[:2]), step
    during = [("sync", [f"layers.{l}.{p}"], False) for l in range(DEPTH - 1, 1, -1)
              for p in ("weight", "bias")]
    after = [("dW", 0), ("sync", ["layers.0.weight", "layers.0.bias"], True),
             ("dW", 1), ("sync", ["layers.1.weight"], True)]
    scale = ("sync", ["scale"], False)
    assert events.count(scale) == 1, events
    assert [e for e in events if e != scale] == during + after, events
    assert [s.index for s in dp.handle.sites] == list(range(DEPTH))
    assert [s.split for s in dp.handle.sites] == [True] * 2 + [False] * (DEPTH - 2)
    dp.remove()


def _check_unfrozen_apart(rank: int, world: int) -> None:
    """Each rank unfreezes another weight frozen at construction: a
    ValueError naming the first on every rank at the backward that plans
    with them; unfrozen alike, the next step is averaged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    model[0].weight.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=0)
    x, t = _batch(rank, 0)
    F.mse_loss(model(x), t).backward()
    model[2 * (rank % 2)].weight.requires_grad_(True)
    model.zero_grad()
    with pytest.raises(ValueError, match=r"^model\.0\.weight\.requires_grad: True on some ranks, "
                                         r"False on others.*on every rank"):
        F.mse_loss(model(x), t).backward()
    for net in (model, ref):
        net.requires_grad_(True)
        net.zero_grad()
        F.mse_loss(net(x), t).backward()
    _averaged_by_hand(ref, world)
    _assert_same(model, ref, "grad")
    dp.remove()


def _compare_unfrozen_uneven(rank: int, world: int, steps=((2, 1), (3, 0))) -> None:
    """Under Join, a first layer frozen at construction and unfrozen on
    every rank between two Joins, in the second of which rank 1 has no data:
    its shadow of rank 0's steps plans with the unfrozen layer too (its
    first forward since never comes). The model equals that of DDP under
    Join, built again after the unfreeze (DDP's own parameters are fixed
    when it is built)."""
    torch.manual_seed(rank)  # replicas differ until both broadcast rank 0's
    model = _join_net()
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model)
    dp = data_parallel(model, k=2, search_iters=1)
    for epoch, counts in enumerate(steps):
        if epoch:
            model[0].requires_grad_(True)
            ref[0].requires_grad_(True)
        ddp = DistributedDataParallel(ref)
        _train_uneven(rank, ddp, ddp, ddp.join, counts[rank], accumulate=False)
        _train_uneven(rank, model, dp, dp.join, counts[rank], accumulate=False)
    ours = itertools.chain(model.named_parameters(), model.named_buffers())
    for (name, a), b in zip(ours, itertools.chain(ref.parameters(), ref.buffers())):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"
    dp.remove()


def _dp_unfrozen(rank: int, world: int) -> None:
    _dp_unfrozen_order(rank, world)
    _compare_unfrozen_uneven(rank, world)
    _compare_unfrozen(rank, world, k=0, as_view=False)
    _compare_unfrozen(rank, world, k=2, as_view=True)
    _compare_unfrozen(rank, world, k=DEPTH, as_view=False)
    _check_unfrozen_apart(rank, world)


def _search_unfrozen(rank: int, world: int, unfreeze_at: int, steps: int) -> None:
    """k="auto" on _Net with layers 0-2 frozen whole at construction (a
    plan of 5 layers), unfrozen at step `unfreeze_at`: the plan of that
    step's backward has 8 layers, and the search for k starts again over
    [0, 8] (at k = 0, whether it had ended or not), measuring each k of its
    coarse sweep up to 8; every rank has the same k at every step, and the
    gradients are the average of the ranks' (DDP's), bitwise, throughout."""
    torch.manual_seed(0)
    model = _Net()
    model.layers[:3].requires_grad_(False)
    ref = copy.deepcopy(model)
    dp = data_parallel(model, k="auto", search_iters=1)
    tried = set()  # the k each step's backward planned with, once the layers joined
    for step in range(steps):
        if step == unfreeze_at:
            for net in (model, ref):
                net.layers[:3].requires_grad_(True)
        x, t = _batch(rank, step)
        for net in (model, ref):
            net.zero_grad()
            F.mse_loss(net(x), t).backward()
        _averaged_by_hand(ref, world)
        _assert_same(model, ref, "grad")
        _sgd_both(model, ref)
        assert dp.layers == (DEPTH - 3 if step < unfreeze_at else DEPTH), step
        if step == unfreeze_at - 1 and unfreeze_at > DEPTH - 3:
            assert not dp.searching  # its sweep of [0, 5], one iteration a k, ended
        if step >= unfreeze_at:
            tried.add(len(dp._order))  # the k held in it
        seen = [None] * world
        dist.all_gather_object(seen, (dp.k, dp.searching))
        assert len(set(seen)) == 1, f"step {step}: the ranks' k and search differ: {seen}"
    assert not dp.searching and len(dp.scores) == DEPTH + 1, dp.scores
    assert not np.isnan(dp.scores).any(), dp.scores  # every k of [0, 8] measured (steps of 1)
    assert tried == set(range(DEPTH + 1)), tried
    dp.remove()


def _dp_search_unfrozen(rank: int, world: int) -> None:
    _search_unfrozen(rank, world, unfreeze_at=8, steps=20)  # the search over 5 layers had ended
    _search_unfrozen(rank, world, unfreeze_at=3, steps=15)  # midway through it


def test_data_parallel_auto_k_searches_over_layers_unfrozen_later():
    """Under k="auto", layers frozen whole at construction and unfrozen
    later join the plan; the search for k kept the layer count of its
    first plan (scores for k in [0, 5] of 8 layers): it never tried holding
    the joined layers (k = 6 to 8), and one that had ended kept its k. It
    starts again over the plan's layers, on every rank alike, the
    gradients still DDP's."""
    _spawn(_dp_search_unfrozen, 2)


def test_data_parallel_averages_parameters_unfrozen_after_construction():
    """Parameters frozen when DataParallel was built and unfrozen later
    (gradual unfreezing of a frozen backbone) were never averaged: they had
    no hook and no bucket, so each rank stepped on its own gradient,
    silently (rank 1's 0.01121 against the mean 0.00100), as under DDP. They
    join the buckets at the next backward, hooked at the forward before it.
    Parameters frozen after construction keep no gradient on any rank, their
    buckets averaged around them."""
    _spawn(_dp_unfrozen, 2)


def test_data_parallel_bucket_views_outlive_what_the_caller_does_to_grad(solo_group):
    """gradient_as_bucket_view: after each backward every .grad is a view
    into a bucket (zero_grad() drops them between steps), and a .grad the
    caller pointed elsewhere in place (set_) takes none of the bucket with
    it: the slices each launch writes into are made once per plan, and
    the .grad handed out are views of their own."""
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2, gradient_as_bucket_view=True)
    for step in range(3):
        x, t = _batch(0, step)
        for net in (model, ref):
            net.zero_grad(set_to_none=step < 2)
            F.mse_loss(net(x), t).backward()
        _assert_same(model, ref, "grad")
        flats = {b.flat.untyped_storage().data_ptr() for b in dp._buckets}
        assert all(p.grad.untyped_storage().data_ptr() in flats for p in model.parameters())
        for p in model.parameters():
            p.grad.set_(torch.zeros_like(p))
    dp.remove()


@pytest.mark.parametrize("as_view", [True, False])
def test_data_parallel_gradients_keep_a_channels_last_parameters_layout(solo_group, as_view):
    """A channels_last Conv's .grad has the parameter's strides, as DDP's
    (its bucket views follow each parameter's layout), where
    gradient_as_bucket_view handed out contiguous views of the bucket; a
    1x1 Conv's too, whose size-1 dims keep channels_last's strides; the
    values stay autograd's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3), nn.Conv2d(2, 2, 1)).to(
        memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), gradient_as_bucket_view=as_view)
    dp = DataParallel(model, k=1, gradient_as_bucket_view=as_view)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    for step in range(2):
        for net in (model, ref, ddp):
            net.zero_grad()
            net(x).square().mean().backward()
        _assert_same(model, ref, "grad")
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            assert p.grad.stride() == q.grad.stride() == p.stride(), name
    dp.remove()


def test_a_data_parallel_model_dropped_without_remove_is_freed(solo_group):
    """Dropping model, optimizer and handle without remove() frees them, as
    with DDP: the parameters' post-accumulate-grad hooks, which torch keeps
    where the garbage collector cannot see them, held the handle and so
    the model for good."""
    torch.manual_seed(0)
    model = _Net()
    alive = weakref.ref(model)
    dp = DataParallel(model, k=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, t = _batch(0, 0)
    F.mse_loss(model(x), t).backward()
    opt.step()
    del model, dp, opt
    gc.collect()
    assert alive() is None


def test_data_parallel_first_bucket_is_small_by_default(solo_group):
    """DDP's rule: with the default cap the first bucket (the last layers'
    gradients, ready first) holds at most 1 MiB; a cap the user gives holds
    for every bucket."""
    def bucket_bytes(**kwargs):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))  # 257 KiB a layer
        ref = copy.deepcopy(model)
        dp = DataParallel(model, k=0, **kwargs)
        x = torch.randn(4, 256)
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        _assert_same(model, ref, "grad")
        sizes = [sum(p.numel() for p in b.params) * 4 for b in dp._buckets]
        dp.remove()
        return sizes

    assert bucket_bytes() == [3 * 257 * 1024, 5 * 257 * 1024]
    assert bucket_bytes(bucket_cap_mb=25) == [8 * 257 * 1024]


def test_data_parallel_plan_reads_the_parameters_a_fixed_number_of_times(solo_group):
    """The plan went over every parameter once per held layer (k x params:
    17.6 s for 3000 Linear layers with k=3000, at each k the search tries).
    Counted as passes over the parameter list, which must not grow with k;
    each held layer's bucket keeps its parameters in the model's order."""
    class Counted(list):
        passes = 0

        def __iter__(self):
            Counted.passes += 1
            return super().__iter__()

    passes = {}
    for depth in (2, 12):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(depth)))
        dp = DataParallel(model, k=depth)
        model(torch.randn(2, 3)).sum().backward()
        dp._params = Counted(dp._params)
        Counted.passes = 0
        dp._plan()
        passes[depth] = Counted.passes
        assert {layer: [p for b in bs for p in b.params] for layer, bs in dp._layer_buckets.items()} \
            == {l: [model[l].weight, model[l].bias] for l in range(depth)}
        dp.remove()
    assert passes[12] == passes[2]


class _MulCalls(TorchDispatchMode):
    """Counts the multiplications torch runs while active."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.mul_):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_data_parallel_backward_host_work_is_per_bucket_not_per_parameter(solo_group,
                                                                         monkeypatch):
    """The host work of a DataParallel backward on many small layers (3000
    Linear(8): 9% over DDP's step at k = 0, 7x at k = all): each gradient
    was scaled into its bucket by a torch.mul of its own (7 us each),
    looked up five times in sets keyed by the tensor (a Python __hash__
    each), and a held layer's parameters had their only hook, DataParallel's
    own, held back by the handle (a state per parameter per backward, whose
    garbage filled a third of the step with full collections). Now one
    multiplication per bucket, no tensor hashed, no state for a parameter
    whose hooks are DataParallel's alone; a user's hook on a held weight is
    still held back until its dW ran, and the gradients stay the plain ones."""
    states = []

    class CountedState(ooo._HookState):
        def __init__(self, param, *args):
            super().__init__(param, *args)
            states.append(param)

    monkeypatch.setattr(ooo, "_HookState", CountedState)
    hashed = []  # by DataParallel's own code (the handle's, for its held tasks, are not counted)

    def counted_hash(t):
        if sys._getframe(1).f_code.co_qualname.startswith("DataParallel."):
            hashed.append(t)
        return id(t)

    monkeypatch.setattr(torch.Tensor, "__hash__", counted_hash)
    depth = 6
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(depth)))
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=3, bucket_cap_mb=1e-6)  # autograd's part: one bucket per parameter
    x = torch.randn(BATCH, WIDTH)
    seen = []
    for step in range(3):
        if step == 2:  # a user's hook on a held weight sees its dW in .grad
            model[0].weight.register_post_accumulate_grad_hook(
                lambda p: seen.append(p.grad.clone()))
        for net in (model, ref):
            net.zero_grad()
        ref(x).sum().backward()
        hashed[:], states[:] = [], []
        model(x).sum().backward()
        _assert_same(model, ref, "grad")
        assert not hashed or step == 0, f"step {step}: {len(hashed)} tensors hashed"  # (0: plan)
        assert states == ([model[0].weight] if step == 2 else []), step
    assert len(seen) == 1 and torch.equal(seen[0], ref[0].weight.grad)
    model.zero_grad()
    with _MulCalls() as mode:
        model(x).sum().backward()
    assert mode.calls == len(dp._buckets) > 2 * depth - 6, mode.calls  # not one per parameter
    dp.remove()


def test_data_parallel_bad_arguments(solo_group):
    model = _Net()
    # no int is a TypeError as well, as torch raises for a count given a float
    for k, error in ((-1, ValueError), (DEPTH + 1, ValueError), ("best", TypeError),
                     (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"^k: ") as raised:
            DataParallel(model, k=k)
        assert isinstance(raised.value, ValueError)
        assert all("forward" not in lin.__dict__ for lin in model.layers), "split left behind"
    for cap in (0, -1.0, "25"):
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            DataParallel(model, bucket_cap_mb=cap)
    with pytest.raises(ValueError, match="search_iters"):
        DataParallel(model, search_iters=0)
    with pytest.raises(TypeError, match="^process_group: .*got str"):
        DataParallel(model, process_group="world")
    # README: reprop's flags take True or False only; these two were taken
    # by their truth (broadcast_buffers="False" broadcast the buffers)
    for flag in ("broadcast_buffers", "gradient_as_bucket_view"):
        for bad in ("False", 1, None):
            with pytest.raises(TypeError, match=f"^{flag}: expected True or False, got {bad!r}$") as raised:
                DataParallel(model, **{flag: bad})
            assert isinstance(raised.value, ValueError)
            assert all("forward" not in lin.__dict__ for lin in model.layers), "split left behind"


_SAVED_AFTER_A_RELOAD = """
import importlib, io, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
import reprop.ooo as ooo
model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
dp = ooo.DataParallel(model, k=1)
importlib.reload(ooo)
buf = io.BytesIO()
torch.save(model, buf)
buf.seek(0)
print(type(torch.load(buf, weights_only=False)).__name__)
dist.destroy_process_group()
"""


def test_a_data_parallel_model_saves_after_a_reload_of_ooo(tmp_path):
    """torch.save(model) pickles DataParallel's hooks as an inert copy by its
    class: after importlib.reload(reprop.ooo) (IPython's autoreload) pickle
    refused the class the reload replaced ('not the same object')."""
    assert script_output(_SAVED_AFTER_A_RELOAD, str(tmp_path / "rdzv")) == ["Sequential"]


_FUSION_AFTER_A_RELOAD = """
import importlib, sys, torch, torch.distributed as dist
import torch.nn as nn
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
import reprop
import reprop.ooo as ooo
model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
dp = ooo.DataParallel(model, k=1)
layers = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)]
pipe = ooo.Pipeline(layers, micro_batches=2)
if sys.argv[2] == "cleared":  # as IPython's %autoreload: the namespace cleared first
    kept = {k: vars(ooo)[k] for k in ("__name__", "__loader__")}
    vars(ooo).clear()
    vars(ooo).update(kept)
importlib.reload(ooo)
for root in (model, nn.Sequential(*layers)):
    try:
        reprop.fuse(root, torch.optim.SGD(root.parameters(), lr=0.1), mode="backward")
        print("fused")
    except ValueError as exc:
        print("refused" if "mode='forward'" in str(exc) else exc)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("namespace", ["kept", "cleared"], ids=["importlib", "autoreload"])
def test_backward_fusion_is_refused_after_a_reload_of_ooo(tmp_path, namespace):
    """A DataParallel and a Pipeline of several micro-batches made before
    importlib.reload(reprop.ooo) (IPython's autoreload) still refuse backward
    fusion of their parameters. The reload made new, empty registries of
    them, so fuse() took both: the replicas' updates from local gradients,
    and a micro-batched step() that raised its second-gradient error only
    after the first micro-batch's backward had updated the parameters."""
    assert script_output(_FUSION_AFTER_A_RELOAD, str(tmp_path / "rdzv"), namespace) == \
        ["refused", "refused"]


def test_a_deepcopy_of_a_data_parallel_model_is_a_model_of_its_own(solo_group, monkeypatch):
    """copy.deepcopy of the model (an EMA, a teacher) copied DataParallel's
    forward hooks with a working DataParallel behind them: the copy's
    backward all-reduced, and on one rank alone waited for peers that never
    came. The copy runs no collective and gets plain autograd's gradients."""
    model = _Net()
    dp = DataParallel(model, k=2)
    ema, plain = copy.deepcopy(model), copy.deepcopy(model)
    x, t = _batch(0, 0)
    F.mse_loss(model(x), t).backward()
    # torch.save(model) as with DDP's module (it failed on DataParallel's weak references)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    loaded.zero_grad()

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective from the copy of the model")

    for name in ("all_reduce", "broadcast", "_broadcast_coalesced"):
        monkeypatch.setattr(dist, name, no_collective)
    for net in (ema, plain):
        F.mse_loss(net(x), t).backward()
    F.mse_loss(loaded(x), t).backward()
    for (name, a), b, c in zip(ema.named_parameters(), plain.parameters(), loaded.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(c.grad, b.grad, rtol=0, atol=0, msg=name)
    monkeypatch.undo()
    dp.remove()


def test_split_layers_refuse_to_run_under_ddp(solo_group):
    """DDP's reducer copies each .grad into its bucket when autograd
    accumulates it; a deferred weight gradient was added after that, so the
    all-reduced gradients lost it (zeros from the first co-run pass on).
    Refused whichever is made first; after remove() DDP trains as usual."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="^model: is or holds a torch.nn.parallel.Distributed"):
        enable(DistributedDataParallel(model))
    handle = enable(model)
    ddp = DistributedDataParallel(model)
    with pytest.raises(ValueError, match="inside torch.nn.parallel.DistributedDataParallel.*data_parallel"):
        ddp(torch.randn(3, 4))
    handle.remove()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    ddp(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def _fsdp_blocks() -> nn.Sequential:
    """Two Linear-tanh-Linear blocks and a Linear head (seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
                           for _ in range(2)], nn.Linear(4, 2))


def test_split_layers_refuse_to_run_under_fsdp(solo_group):
    """FSDP2 reduce-scatters a module's gradients when its backward ends; the
    deferred weight gradients came after: lost from the backward that moved
    them, and added into the next one's (0.6 off in the head's weight).
    Refused whichever is made first, the blocks or only the root sharded."""
    from torch.distributed.fsdp import fully_shard
    for shard_blocks in (True, False):
        model = _fsdp_blocks()
        if shard_blocks:
            for block in model[:2]:
                fully_shard(block)
        fully_shard(model)
        with pytest.raises(ValueError, match="^model: is or holds a module of torch.distributed.fsdp"):
            enable(model)
        with pytest.raises(ValueError, match="^model: is or holds a module of torch.distributed.fsdp"):
            enable(model[0] if shard_blocks else model)
        with pytest.raises(ValueError, match="^model: holds DTensor parameters"):
            enable(model[-1])  # the root shards it: its forward sees gathered ones
    # sharded after enable(): the root (its class changes), or the root of a part enabled
    model = _fsdp_blocks()
    handle = enable(model)
    fully_shard(model)
    with pytest.raises(ValueError, match=r"^reprop.ooo.enable: the model \(sharded after enable"):
        model(torch.randn(3, 4))
    handle.remove()
    model(torch.randn(3, 4)).sum().backward()  # FSDP's own training, unsplit
    model = _fsdp_blocks()
    handle = enable(model[-1])
    fully_shard(model)
    with pytest.raises(ValueError, match=r"^reprop.ooo.enable: the model \(sharded after enable"):
        model(torch.randn(3, 4)).sum().backward()  # the first pass moves no dW: complete
    handle.remove()


def test_data_parallel_refuses_models_torch_reduces(solo_group):
    """DataParallel over a DDP model reduced the gradients in DDP's reducer
    too, before the deferred ones existed; over an FSDP model it failed
    inside torch's DTensor dispatch (broadcast_ has no sharding strategy).
    Refused as enable() refuses them, before any collective or split: the
    model inside DDP is free for DataParallel afterwards."""
    from torch.distributed.fsdp import fully_shard
    ddp = DistributedDataParallel(_fsdp_blocks())
    with pytest.raises(ValueError, match="^model: is or holds a torch.nn.parallel.Distributed"):
        DataParallel(ddp)
    DataParallel(ddp.module).remove()
    for whole in (True, False):
        model = _fsdp_blocks()
        fully_shard(model if whole else model[0])
        with pytest.raises(ValueError, match="^model: is or holds a module of torch.distributed.fsdp"):
            DataParallel(model)


class _WithAux(nn.Module):
    """A model whose forward calls another model DDP does not hold."""

    def __init__(self, aux: nn.Module):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.__dict__["aux"] = aux  # not a submodule

    def forward(self, x):
        return self.aux(self.lin(x))


def test_a_model_ddp_does_not_hold_splits_inside_ddp_forward(solo_group):
    """Only layers whose parameters DDP all-reduces are refused: an enabled
    model of its own called from DDP's forward (a teacher, an auxiliary net)
    trains as under plain autograd."""
    torch.manual_seed(0)
    aux = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref_aux = copy.deepcopy(aux)
    handle = enable(aux, speedup=None, profile_iters=2)
    ddp = DistributedDataParallel(_WithAux(aux))
    ref = _WithAux(ref_aux)
    ref.lin = copy.deepcopy(ddp.module.lin)
    for step in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        ddp(x).sum().backward()
        ref(x).sum().backward()
    for a, b in zip(aux.parameters(), ref_aux.parameters()):
        assert torch.equal(a.grad, b.grad)
    handle.remove()


def test_data_parallel_refuses_backward_fusion(solo_group):
    """Backward-mode fusion updated each parameter from its local gradient
    (a held layer's: from none) before DataParallel averaged it, so the
    replicas drifted apart silently. Refused in either order, whichever
    module each was given (the model, a wrapper of it, one of its layers);
    forward mode steps on the averages and is fine, each works again once the
    other is removed, and a deepcopy of the model (an EMA) is a model of its
    own."""
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = DataParallel(model, k=2)
    for root in (model, nn.Sequential(model)):
        with pytest.raises(ValueError, match="^mode: .*mode='forward'"):
            fuse(root, opt, mode="backward")
    fuse(model, opt, mode="forward").remove()
    ema = copy.deepcopy(model)
    fuse(ema, torch.optim.SGD(ema.parameters(), lr=0.1), mode="backward").remove()
    dp.remove()
    fused = fuse(nn.Sequential(model), opt, mode="backward")
    for root in (model, model.layers[0]):
        with pytest.raises(ValueError, match="^model: .*mode='forward'"):
            DataParallel(root, k=1)
    assert all("forward" not in lin.__dict__ for lin in model.layers), "split left behind"
    fused.remove()
    DataParallel(model, k=2).remove()
    with pytest.raises(ValueError, match="^model: has no parameters"):
        DataParallel(nn.ReLU())


def test_backward_fusion_while_another_thread_makes_a_data_parallel(solo_group, monkeypatch):
    """fuse(mode="backward") reads the live DataParallels' parameters (to
    refuse one of them) while another thread makes a DataParallel of its own
    model (a search over models in threads): the registry changed as fuse()
    iterated it, which raised "Set changed size during iteration". Forced:
    the other thread makes its DataParallel, start to end, while fuse() reads
    a live one's parameters."""
    live, theirs, model = _Net(), _Net(), _Net()
    dp = DataParallel(live, k=1)
    made = []

    def another_thread_makes_one(params: list):
        thread = threading.Thread(target=lambda: made.append(DataParallel(theirs, k=1)))
        thread.start()
        thread.join()
        yield from params

    monkeypatch.setattr(dp, "_all_params", another_thread_makes_one(dp._all_params))
    fuse(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="backward").remove()
    assert len(made) == 1, "the other thread's DataParallel failed"
    made[0].remove()
    dp.remove()


# ---------------------------------------------------------------------------
# Pipeline parallelism against single-process training
# ---------------------------------------------------------------------------


def _blocks(seed: int = 0) -> list:
    """8 layers, each Linear then tanh."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)]


def _alternating(seed: int = 0) -> list:
    """8 layers: Linear, tanh, Linear, ...: some stages hold no split layer."""
    torch.manual_seed(seed)
    return [nn.Linear(WIDTH, WIDTH) if l % 2 == 0 else nn.Tanh() for l in range(DEPTH)]


def _in_place(seed: int = 0) -> list:
    """8 layers: Linear, ReLU(inplace=True), ...: a layer that changes its
    input in place, the previous layer's output (on its stage or received)."""
    torch.manual_seed(seed)
    return [nn.Linear(WIDTH, WIDTH) if l % 2 == 0 else nn.ReLU(inplace=True)
            for l in range(DEPTH)]


def _in_place_first(seed: int = 0) -> list:
    """8 layers: ReLU(inplace=True), Linear, ...: layer 0 changes the input
    in place, each micro-batch of it (views of one tensor, sharing its
    version counter: each made the one before void in backward)."""
    torch.manual_seed(seed)
    return [nn.ReLU(inplace=True) if l % 2 == 0 else nn.Linear(WIDTH, WIDTH)
            for l in range(DEPTH)]


_ALLOCATIONS = [("contiguous", 1), ("modulo", 1), ("modulo", 2)]


def _pipeline_cases(world: int) -> list[dict]:
    cases = [dict(schedule=s, allocation=a, group=g, micro_batches=m, layers=_blocks,
                  input_grad=False)
             for s, (a, g), m in itertools.product(("gpipe", "fast_forward"), _ALLOCATIONS,
                                                   (1, 4))]
    cases += [dict(schedule=s, allocation="modulo", group=1, micro_batches=m, layers=_alternating,
                   input_grad=True) for s, m in (("gpipe", 2), ("fast_forward", 4))]
    cases += [dict(schedule=s, allocation=a, group=1, micro_batches=2, layers=_in_place,
                   input_grad=True) for s, a in (("gpipe", "contiguous"), ("fast_forward", "modulo"))]
    # (a leaf input that needs a gradient may not change in place, as in one process)
    cases += [dict(schedule="gpipe", allocation="contiguous", group=1, micro_batches=2,
                   layers=_in_place_first, input_grad=False)]
    # measured-looking times: another order of the same tasks
    costs = dict(fwd=[1.0 + 0.1 * l for l in range(DEPTH)], out_grad=2.0,
                 weight_grad=[0.5 + 0.2 * (l % 3) for l in range(DEPTH)], transfer=0.3)
    cases += [dict(schedule="fast_forward", allocation="modulo", group=1, micro_batches=4,
                   layers=_blocks, input_grad=False, costs=costs)]
    return cases


def _check_pipeline(rank: int, case: dict, steps: int = 3) -> None:
    """`steps` training steps against single-process training; the last one
    on half the batch, a new input shape whose headers are sent anew. Only
    a new input shape's first step sends headers."""
    make = case["layers"]
    ref_layers = make()
    ref = nn.Sequential(*ref_layers)
    pipe_layers = make()
    pipe = Pipeline(pipe_layers, micro_batches=case["micro_batches"], schedule=case["schedule"],
                    allocation=case["allocation"], group=case["group"], costs=case.get("costs"))
    _assert_allocated(pipe, pipe_layers, case, rank)
    local = list(pipe.parameters())  # none on a stage of tanh layers only
    opt = torch.optim.SGD(local, lr=0.1) if local else None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    exact = case["micro_batches"] == 1
    messages = []
    for step in range(steps):
        x, t = _batch(0, step)  # the same batch on every rank
        if step == steps - 1:
            x, t = x[:BATCH // 2], t[:BATCH // 2]
        x_ref = x.clone().requires_grad_(case["input_grad"])
        x = x.clone().requires_grad_(case["input_grad"])
        ref_opt.zero_grad()
        loss_ref = F.mse_loss(ref(x_ref), t)
        loss_ref.backward()
        for p in local:
            p.grad = None
        loss = pipe.step(x, t, F.mse_loss)
        where = f"{case} step {step} rank {rank}"
        assert (loss is not None) == (pipe.stage_of[-1] == rank), where
        if loss is not None:
            torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-6, atol=0, msg=where)
        pairs = [(f"layer {l} {n}", p.grad, dict(ref_layers[l].named_parameters())[n].grad)
                 for l, layer in pipe.layers.items() for n, p in layer.named_parameters()]
        if case["input_grad"] and pipe.stage_of[0] == rank:
            pairs.append(("input", x.grad, x_ref.grad))
        for what, got, want in pairs:
            assert got is not None, f"{where}: no gradient for {what}"
            if exact:
                assert torch.equal(got, want), f"{where}: {what} differs"
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{where}: {what}")
        if opt is not None:
            opt.step()
        ref_opt.step()
        messages.append(pipe.messages)
    stage = pipe.stage_of
    activations = case["micro_batches"] * sum(stage[l] == rank != stage[l + 1] for l in range(DEPTH - 1))
    # at most one per activation received (none where it needs no gradient)
    gradients = case["micro_batches"] * sum(stage[l] == rank != stage[l - 1] for l in range(1, DEPTH))
    # per step: its activations and gradients, plus a header per activation
    # and per gradient sent in a shape's first step
    headers = messages[0] - messages[1]
    assert activations <= headers <= activations + gradients and messages[2] == messages[0], \
        (case, rank, messages)
    if make is _blocks:
        # every activation gets its gradient back, one message each: its flag
        # (whether it has one) travels in it, not in a message of its own
        assert messages[1] == activations + gradients == headers, (case, rank, messages)
    pipe.remove()


def _pipeline_worker(rank: int, world: int) -> None:
    for case in _pipeline_cases(world):
        _check_pipeline(rank, case)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pipeline_matches_single_process(world):
    """Every (schedule, allocation) with 1 and 4 micro-batches, modulo groups
    of 1 and 2, two SGD steps; stages without split layers, with an input
    that needs a gradient; layers that work on their input in place; and
    non-unit task times."""
    _spawn(_pipeline_worker, world)


def test_pipeline_solo(solo_group):
    """One stage: every task local, still single-process training's gradients."""
    for schedule, layers in itertools.product(("gpipe", "fast_forward"), (_blocks, _in_place)):
        _check_pipeline(0, dict(schedule=schedule, allocation="contiguous", group=1,
                                micro_batches=4, layers=layers, input_grad=True))
    for schedule, m in itertools.product(("gpipe", "fast_forward"), (1, 4)):
        _check_pipeline(0, dict(schedule=schedule, allocation="contiguous", group=1,
                                micro_batches=m, layers=_in_place_first, input_grad=False))


@pytest.mark.parametrize("first", [nn.ReLU, lambda inplace: nn.Sequential(
    nn.Identity(), nn.ReLU(inplace=inplace))], ids=["relu", "identity_relu"])
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_pipeline_in_place_first_layer_on_a_computed_input(solo_group, first, micro_batches):
    """Layer 0 working in place on an input computed upstream (a non-leaf
    that needs a gradient): one process computes it; the Pipeline raised
    that a view made in no-grad mode was changed in place, and with several
    micro-batches that one's change voided another's saved output."""
    torch.manual_seed(0)
    enc = nn.Linear(WIDTH, WIDTH)
    layers = [first(inplace=True), nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    x, t = _batch(0, 0)
    F.mse_loss(nn.Sequential(*layers)(enc(x)), t).backward()
    want = [p.grad.clone() for p in itertools.chain(enc.parameters(), layers[1].parameters())]
    for p in itertools.chain(enc.parameters(), layers[1].parameters()):
        p.grad = None
    pipe = Pipeline(layers, micro_batches=micro_batches)
    pipe.step(enc(x), t, F.mse_loss)
    got = [p.grad for p in itertools.chain(enc.parameters(), layers[1].parameters())]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    pipe.remove()


class _DetachAbove(nn.Module):
    """Detaches its input in a micro-batch whose first feature's mean is
    above `threshold`: no gradient reaches the layers before it there."""

    def __init__(self, threshold: float):
        super().__init__()
        self.threshold = threshold

    def forward(self, x):
        return x.detach() if x[:, 0].mean() > self.threshold else x


def _stopping(threshold: float) -> list:
    """Linear, tanh, _DetachAbove(threshold), Linear (seed 0)."""
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH), nn.Tanh(), _DetachAbove(threshold), nn.Linear(WIDTH, WIDTH)]


def _check_pipeline_stopped_gradients(rank: int, micro: int = 4) -> None:
    """A layer that detaches its input in every micro-batch, then in all but
    one: the layers before it (on its stage and on the stage before) and the
    input get what plain autograd accumulates over the micro-batches, None
    where no micro-batch gave a gradient. They got zeros, which weight decay
    and momentum then apply."""
    x, t = _batch(0, 0)
    size = BATCH // micro
    with torch.no_grad():
        head = nn.Sequential(*_stopping(0.0)[:2])
        lowest = min(head(xm)[:, 0].mean().item() for xm in x.split(size))
    for threshold in (-math.inf, lowest):  # every micro-batch detaches; all but one
        ref_layers = _stopping(threshold)
        ref = nn.Sequential(*ref_layers)
        x_ref = x.clone().requires_grad_()
        for xm, tm in zip(x_ref.split(size), t.split(size)):
            (F.mse_loss(ref(xm), tm) / micro).backward()
        assert (ref_layers[0].weight.grad is None) == (threshold == -math.inf)
        pipe = Pipeline(_stopping(threshold), micro_batches=micro)
        x_pipe = x.clone().requires_grad_()
        pipe.step(x_pipe, t, F.mse_loss)
        pairs = [(f"layer {l} {n}", p.grad, dict(ref_layers[l].named_parameters())[n].grad)
                 for l, layer in pipe.layers.items() for n, p in layer.named_parameters()]
        if pipe.stage_of[0] == rank:
            pairs.append(("input", x_pipe.grad, x_ref.grad))
        for what, got, want in pairs:
            where = f"threshold {threshold} rank {rank}: {what}"
            if want is None:
                assert got is None, f"{where}: a gradient where plain autograd has none"
            else:
                assert got is not None, f"{where}: no gradient"
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=where)
        pipe.remove()


def _assert_pipeline_grads(pipe: Pipeline, ref_layers: list, where: str,
                           exact: bool = False) -> None:
    """Every parameter of this rank's layers has the gradient of its layer
    in `ref_layers` (single-process training): bitwise with `exact`."""
    for l, layer in pipe.layers.items():
        for (name, p), ref_p in zip(layer.named_parameters(), ref_layers[l].parameters()):
            if exact:
                assert torch.equal(p.grad, ref_p.grad), f"{where}: layer {l} {name}"
            else:
                torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{where}: layer {l} {name}")


def _tied(seed: int = 0) -> list:
    """4 layers; the first and the last are one Linear."""
    torch.manual_seed(seed)
    shared = nn.Linear(WIDTH, WIDTH)
    return [shared, nn.Tanh(), nn.Linear(WIDTH, WIDTH), shared]


def _check_pipeline_tied_layers(rank: int, world: int) -> None:
    """Layers 0 and 3 share a Linear. On different stages (contiguous): a
    ValueError naming them (each stage trained its own copy from part of the
    gradient); on one stage (modulo over 3 stages): single-process gradients."""
    assert world == 3
    with pytest.raises(ValueError, match=r"^layers: layers\[0\]\.weight is layers\[3\]\.weight"):
        Pipeline(_tied(), micro_batches=2)
    frozen = _tied()
    frozen[0].requires_grad_(False)  # no gradient changes it: each stage may hold it
    pipe = Pipeline(frozen, micro_batches=2)
    x, t = _batch(0, 0)
    pipe.step(x, t, F.mse_loss)
    frozen[0].requires_grad_(True)  # now each stage would train its own copy
    with pytest.raises(ValueError, match=r"^layers: layers\[0\]\.weight is layers\[3\]\.weight.*"
                                         r"fixed when the Pipeline was built"):
        pipe.step(x, t, F.mse_loss)
    pipe.remove()
    norm = nn.BatchNorm1d(WIDTH, affine=False)  # no parameter, but forward updates its statistics
    with pytest.raises(ValueError, match=r"^layers: layers\[0\]\.running_mean is layers\[3\]"):
        Pipeline([norm, nn.Linear(WIDTH, WIDTH), nn.Tanh(), norm], micro_batches=2)
    ref_layers = _tied()
    x, t = _batch(0, 0)
    F.mse_loss(nn.Sequential(*ref_layers)(x), t).backward()
    pipe = Pipeline(_tied(), micro_batches=2, allocation="modulo")
    pipe.step(x, t, F.mse_loss)
    _assert_pipeline_grads(pipe, ref_layers, f"rank {rank}")
    pipe.remove()


def _check_pipeline_evaluation(rank: int, world: int) -> None:
    """evaluate() runs the forwards alone, in any grad mode: single-process's
    loss, and the predictions a loss_fn keeps, with no .grad touched and
    activations alone sent. step() with grad mode off raises on every rank
    before any message: the next training step's messages still pair up,
    and its gradients are the training batch's alone."""
    ref_layers = _blocks()
    ref = nn.Sequential(*ref_layers)
    pipe = Pipeline(_blocks(), micro_batches=2)
    x, t = _batch(0, 0)
    x.requires_grad_()  # as in torch: no gradient under no_grad either
    with torch.no_grad():
        want = ref(x)
    for i, mode in enumerate((torch.enable_grad, torch.inference_mode)):
        outputs = []

        def keeping(out, target):
            outputs.append(out)
            return F.mse_loss(out, target)

        with mode():
            loss = pipe.evaluate(x, t, keeping)
        where = f"rank {rank} {mode.__name__}"
        assert all(p.grad is None for p in pipe.parameters()) and x.grad is None, where
        if pipe.stage_of[-1] == rank:
            torch.testing.assert_close(loss, F.mse_loss(want, t), rtol=1e-6, atol=0, msg=where)
            torch.testing.assert_close(torch.cat(outputs), want, rtol=1e-6, atol=1e-7, msg=where)
        # past the first evaluation's headers: one message per activation sent
        sent = sum(pipe.stage_of[l] == rank != pipe.stage_of[l + 1] for l in range(DEPTH - 1))
        assert i == 0 or pipe.messages == 2 * sent, (where, pipe.messages)
    for mode in (torch.no_grad, torch.inference_mode):
        with pytest.raises(RuntimeError, match=r"^Pipeline\.step\(\) trains, and grad mode is "
                                               r"off .*call Pipeline\.evaluate\(\)"):
            with mode():
                pipe.step(x, t, F.mse_loss)
    F.mse_loss(ref(x), t).backward()
    pipe.step(x, t, F.mse_loss)
    _assert_pipeline_grads(pipe, ref_layers, f"rank {rank}")
    pipe.remove()


def _check_pipeline_autocast_toggle(rank: int, world: int) -> None:
    """Autocast turned on, off and on again between steps of one input
    shape: single-process training's gradients under the same autocast
    state (bitwise, one micro-batch). The sender refused the second step
    (its output's dtype changed for the kept header) and the receiver
    waited until the timeout."""
    ref_layers = _blocks()
    ref = nn.Sequential(*ref_layers)
    layers = _blocks()
    pipe = Pipeline(layers, micro_batches=1)
    x, t = _batch(0, 0)
    for enabled in (True, False, True):
        for some in (ref_layers, layers):
            for layer in some:
                layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            F.mse_loss(ref(x).float(), t).backward()
            pipe.step(x, t, lambda out, target: F.mse_loss(out.float(), target))
        _assert_pipeline_grads(pipe, ref_layers, f"rank {rank} autocast {enabled}", exact=True)
    pipe.remove()


def _pipeline_edge_cases(rank: int, world: int) -> None:
    _check_pipeline_stopped_gradients(rank)
    _check_pipeline_tied_layers(rank, world)
    _check_pipeline_evaluation(rank, world)
    _check_pipeline_autocast_toggle(rank, world)


def _edge_cases(rank: int, world: int) -> None:
    _dp_edge_cases(rank, world)
    _pipeline_edge_cases(rank, world)


def test_parallel_edge_cases():
    """On 3 ranks, in one group of processes. Data parallelism: buffers after
    no_sync() and no_grad forwards; a model that returns one of its
    Parameters; models that differ between the ranks; broadcast_buffers
    that differs between the ranks, and False (rank-local buffers); a parameter frozen on one
    rank only; a parameter or broadcast buffer made by expand(); a group of two
    and the rank it leaves out. Pipeline: gradients that stop
    at a layer in some or all micro-batches (a one-byte flag tells the stage
    before); a layer shared by two stages, and by layers of one stage;
    evaluate() in any grad mode, and step() refusing grad mode off;
    autocast turned on and off between steps."""
    _spawn(_edge_cases, 3)


def _check_pipeline_arguments_agree(rank: int, world: int) -> None:
    assert world == 3
    mismatches = [
        (dict(schedule="gpipe" if rank == 0 else "fast_forward"),
         r"^schedule: differs between the ranks \(rank 0: 'gpipe'; ranks 1, 2: 'fast_forward'\)"),
        # times measured on each rank: its own layers slower
        (dict(costs=dict(fwd=[1.0 + 4.0 * (l % world == rank) for l in range(DEPTH)])),
         r"^costs: differs between the ranks \(rank 0 vs rank 1 vs rank 2\)"),
        (dict(micro_batches=4 if rank == 2 else 2), r"^micro_batches: .*\(ranks 0, 1: 2; rank 2: 4\)"),
        (dict(allocation="contiguous" if rank == 1 else "modulo"),
         r"^allocation: .*\(ranks 0, 2: 'modulo'; rank 1: 'contiguous'\)"),
        (dict(allocation="modulo", group=1 + rank % 2), r"^group: .*\(ranks 0, 2: 1; rank 1: 2\)"),
        (dict(layers=DEPTH - (rank == 0)), r"^layers: .*\(rank 0: 7 layers; ranks 1, 2: 8 layers\)"),
    ]
    for kwargs, match in mismatches:
        layers = _blocks()[:kwargs.pop("layers", DEPTH)]
        with pytest.raises(ValueError, match=match):
            Pipeline(layers, **{"micro_batches": 2, "allocation": "modulo", **kwargs})
        assert all("forward" not in m.__dict__ for layer in layers for m in layer.modules()), \
            "split left behind"
    x, t = _batch(0, 0)  # the group still works
    Pipeline(_blocks(), micro_batches=2).step(x, t, F.mse_loss)


def test_pipeline_arguments_must_agree():
    """Each rank derives every stage's program from its own arguments, and
    messages are matched in the order of those programs: a schedule, costs
    (times measured on each rank), micro_batches, allocation, group or
    number of layers that differs between ranks gets a ValueError naming it
    on every rank. Schedules and costs gave gradients 4e-2 off single-process
    training without an error; micro_batches raised on one rank, the
    allocation waited in recv until the timeout."""
    _spawn(_check_pipeline_arguments_agree, 3, timeout=20)


def _check_pipeline_freezing(rank: int, world: int) -> None:
    assert world == 3  # stages hold layers 0-2, 3-5, 6-7
    for frozen_by_step in ([range(6), (), range(4), (1,)], [(), range(4), range(6), (1,)]):
        ref_layers = _blocks()
        ref = nn.Sequential(*ref_layers)
        layers = _blocks()
        for l in frozen_by_step[0]:  # when the Pipeline is built
            layers[l].requires_grad_(False)
        pipe = Pipeline(layers, micro_batches=2)
        messages = []
        for step, frozen in enumerate(frozen_by_step):
            for some in (ref_layers, layers):
                for l, layer in enumerate(some):
                    layer.requires_grad_(l not in frozen)
                    layer.zero_grad()
            x, t = _batch(0, step)
            F.mse_loss(ref(x), t).backward()
            pipe.step(x, t, F.mse_loss)
            messages.append(pipe.messages)
            for l, layer in pipe.layers.items():
                for (name, p), want in zip(layer.named_parameters(), ref_layers[l].parameters()):
                    where = f"rank {rank} step {step}, layers {list(frozen)} frozen: layer {l} {name}"
                    if want.grad is None:
                        assert p.grad is None, f"{where}: a gradient where plain autograd has none"
                    else:
                        torch.testing.assert_close(p.grad, want.grad, rtol=1e-5, atol=1e-6,
                                                   msg=where)
        if not frozen_by_step[0]:  # after the headers, frozen or not: the same messages
            assert len(set(messages[1:])) == 1, messages
        pipe.remove()


def test_pipeline_freezing_and_unfreezing_between_steps():
    """Two stages' layers frozen when the Pipeline is built, then unfrozen,
    then frozen again in part; and the same from trainable layers: single-
    process gradients in every step, None for frozen layers, and no message
    more in steps after a trainable first one (its gradients go back, and
    the stage before drops those it needs none of). Whether an activation
    required grad went to the next stage in its first step only: the stage
    before an (un)frozen layer raised, the next one waited in recv until the
    timeout."""
    _spawn(_check_pipeline_freezing, 3, timeout=20)


def _random_layers(seed: int) -> list:
    """A seeded random chain for the differential test: a Conv1d block on
    (B, 2, 5) inputs, Flatten, then Linear layers with and without bias,
    frozen or wrapped with tanh, changing the width or not, activations
    (ReLU(inplace=True) right after a Linear, which saves no output),
    LayerNorm, BatchNorm1d; the last maps to 2 outputs."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layers = [nn.Conv1d(2, 3, 3, padding=1, bias=rng.random() < 0.5), nn.GELU(), nn.Flatten()]
    width = 15
    for _ in range(rng.randint(3, 6)):
        kind = rng.choice(["linear", "block", "frozen", "norm", "batchnorm", "act"])
        if kind in ("linear", "block", "frozen"):
            out = rng.choice([width, 6, 9])
            lin = nn.Linear(width, out, bias=rng.random() < 0.7)
            layers.append(nn.Sequential(lin, nn.Tanh()) if kind == "block" else
                          lin.requires_grad_(kind != "frozen"))
            width = out
        elif kind == "norm":
            layers.append(nn.LayerNorm(width))
        elif kind == "batchnorm":
            layers.append(nn.BatchNorm1d(width))
        else:
            linear_before = type(layers[-1]) is nn.Linear
            layers.append(nn.ReLU(inplace=True) if linear_before else nn.Sigmoid())
    return layers + [nn.Linear(width, 2)]


# (seed, schedule, allocation, group, micro_batches, optimizer, input_grad):
# every schedule and allocation, plain and fused optimizers (backward fusion
# needs one micro-batch), an input that needs a gradient; seeds whose layers
# hold BatchNorm1d, ReLU(inplace=True) and frozen Linears
_RANDOM_PIPELINE_CASES = [
    (39, "gpipe", "contiguous", 1, 3, "sgd", False),
    (9, "fast_forward", "modulo", 1, 4, "adam", True),
    (8, "fast_forward", "modulo", 2, 2, "forward", False),
    (16, "gpipe", "modulo", 1, 1, "backward", True),
    (0, "fast_forward", "contiguous", 1, 2, "sgd", True),
]


def _check_random_pipelines(rank: int, world: int, steps: int = 3) -> None:
    """Random layer lists against single-process training that runs the same
    micro-batches one after the other (see _check_micro_batched)."""
    for seed, schedule, allocation, group, micro, kind, input_grad in _RANDOM_PIPELINE_CASES:
        _check_micro_batched(rank, functools.partial(_random_layers, seed), seed, (2, 5), 2,
                             dict(micro_batches=micro, schedule=schedule, allocation=allocation,
                                  group=group), kind, input_grad, steps)


def _check_micro_batched(rank: int, make: Callable, seed: int, sample: tuple, outputs: int,
                         arguments: dict, kind: str = "sgd", input_grad: bool = False,
                         steps: int = 3) -> None:
    """A Pipeline of `make()`'s layers against single-process training of
    another `make()` that runs the same micro-batches one after the other,
    each on a copy of its rows as the Pipeline's first layer gets (a view
    of the batch starts elsewhere in memory, and the CPU's matrix products
    then round otherwise), on inputs (batch, *sample) and targets (batch,
    outputs) drawn from `seed`: the loss, every gradient, the input's,
    the buffers (BatchNorm's statistics) and the parameters after each
    optimizer step ("sgd", "adam", or "forward"/"backward" fused SGD) are
    bitwise equal. Steps zero the gradients both ways, and the last one
    takes another batch size."""
    micro = arguments["micro_batches"]
    ref_layers, layers = make(), make()
    ref = nn.Sequential(*ref_layers)
    pipe = Pipeline(layers, **arguments)
    # a stage of activations alone has no optimizer
    models = [m for m in (nn.ModuleList(pipe.layers.values()), ref) if list(m.parameters())]
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) if kind == "adam" else
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    fusions = [fuse(m, o, mode=kind) for m, o in zip(models, opts)] \
        if kind in ("forward", "backward") else []
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = micro * (2 if step < steps - 1 else 3)  # BatchNorm: 2 rows or more
        x, t = torch.randn(batch, *sample, generator=g), torch.randn(batch, outputs, generator=g)
        x_ref = x.clone().requires_grad_(input_grad)
        losses = []
        for xm, tm in zip(x_ref.split(batch // micro), t.split(batch // micro)):
            losses.append(F.mse_loss(ref(xm.clone()), tm) / micro)
            losses[-1].backward()
        x = x.clone().requires_grad_(input_grad)
        loss = pipe.step(x, t, F.mse_loss)
        where = f"{make} {arguments} step {step} rank {rank}"
        if loss is not None:
            assert torch.equal(loss, torch.stack(losses).detach().sum()), where
        if input_grad and pipe.stage_of[0] == rank:
            assert torch.equal(x.grad, x_ref.grad), f"{where}: input gradient"
        for l, layer in pipe.layers.items():
            for (name, p), want in itertools.chain(
                    zip(layer.named_parameters(), ref_layers[l].parameters()),
                    zip(layer.named_buffers(), ref_layers[l].buffers())):
                got, want = (p.grad, want.grad) if isinstance(p, nn.Parameter) else (p, want)
                assert (got is None) == (want is None), f"{where}: layer {l} {name}"
                assert got is None or torch.equal(got, want), \
                    f"{where}: layer {l} {name}: {(got - want).abs().max().item():.2g} off"
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)
    for f in fusions:
        f.remove()  # applies forward fusion's pending updates
    for l, layer in pipe.layers.items():
        for (name, p), want in zip(layer.named_parameters(), ref_layers[l].parameters()):
            assert torch.equal(p, want), f"{make} {arguments} rank {rank}: layer {l} {name}"
    pipe.remove()


def test_pipeline_random_layers_match_micro_batched_training():
    """A compact, seeded form of a differential fuzzer: random layer lists
    on 3 ranks, each schedule and allocation, 1 to 4 micro-batches,
    SGD, Adam and fused optimizers, against single-process training of the
    same micro-batches: bitwise equal (see _check_random_pipelines)."""
    _spawn(_check_random_pipelines, 3)


def test_pipeline_stopped_gradients_solo(solo_group):
    """Gradients that stop at a layer, within one stage."""
    _check_pipeline_stopped_gradients(0)


class _Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)


def test_pipeline_hands_on_input_gradients_as_made(solo_group):
    """A Conv1d before a layer that transposes (README: the layout of each
    layer's input gradient): one process gives the Conv1d a transposed output
    gradient, and on one CPU thread torch sums the bias gradient in memory
    order. The Pipeline gave a contiguous one (the .grad of the leaf that
    stood for its output): 1.2e-7 off, found by the random differential
    test; it hands on the gradient as the transpose's backward made it now,
    for plain torch's bits."""
    with torch_threads(1):
        g = torch.Generator().manual_seed(1)
        x, t = torch.randn(4, 4, 5, generator=g), torch.randn(4, 2, generator=g)

        def layers():
            torch.manual_seed(0)
            return [nn.Conv1d(4, 3, 1), _Transpose(), nn.Flatten(), nn.Linear(15, 2)]

        plain, contiguous, piped = layers(), layers(), layers()
        F.mse_loss(nn.Sequential(*plain)(x), t).backward()
        y = contiguous[0](x)
        leaf = y.detach().requires_grad_()
        F.mse_loss(nn.Sequential(*contiguous[1:])(leaf), t).backward()
        y.backward(leaf.grad.contiguous())
        # the layout matters here: a contiguous output gradient rounds otherwise
        assert not torch.equal(contiguous[0].bias.grad, plain[0].bias.grad)
        pipe = Pipeline(piped, micro_batches=1, schedule="fast_forward")
        pipe.step(x, t, F.mse_loss)
        pipe.remove()
        for name in ("weight", "bias"):
            assert torch.equal(getattr(piped[0], name).grad, getattr(plain[0], name).grad), name


class _Expand(nn.Module):
    """(B, n) -> (B, n, 3), each value thrice: an expanded output (stride 0)."""

    def forward(self, x):
        return x.unsqueeze(-1).expand(-1, -1, 3)


class _SumLast(nn.Module):
    """(B, n, k) -> (B, n): its input gradient is expanded (stride 0)."""

    def forward(self, x):
        return x.sum(-1)


def _transposing(seed: int = 0) -> list:
    """On (B, 4, 5): transposed activations, a Linear on one, a BatchNorm1d
    on another (its running mean sums in memory order), and transposed
    input gradients at Conv1d layers (their bias gradient too)."""
    torch.manual_seed(seed)
    return [nn.Conv1d(4, 6, 1), _Transpose(), nn.Linear(6, 6), _Transpose(), nn.BatchNorm1d(6),
            nn.Conv1d(6, 2, 1), nn.Flatten(), nn.Linear(10, 2)]


def _channels_last(seed: int = 0) -> list:
    """On (B, 3, 4, 4): channels_last Conv2d outputs and BatchNorm2d, then
    an expanded activation and the expanded input gradient of a sum."""
    torch.manual_seed(seed)
    return [nn.Conv2d(3, 4, 3, padding=1).to(memory_format=torch.channels_last),
            nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 4, 1).to(memory_format=torch.channels_last), nn.Flatten(),
            nn.Linear(64, 5), _Expand(), nn.Linear(3, 3), _SumLast(), nn.Linear(5, 2)]


# (layers, input sample shape), each with every (schedule, allocation, group,
# micro_batches, input_grad) below
_LAYOUT_MODELS = [(_transposing, (4, 5)), (_channels_last, (3, 4, 4))]
_LAYOUT_CASES = [("gpipe", "contiguous", 1, 2, False), ("fast_forward", "modulo", 1, 2, True),
                 ("fast_forward", "contiguous", 1, 1, True), ("gpipe", "modulo", 2, 3, False)]


class _Relaid(nn.Module):
    """The identity, on a copy transposed and back in odd calls: an output
    whose strides change between steps, its shape not."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x.transpose(1, 2).contiguous().transpose(1, 2) if self.calls % 2 else x + 0


def _relaid(seed: int = 0) -> list:
    torch.manual_seed(seed)
    return [nn.Conv1d(4, 6, 1), _Relaid(), nn.BatchNorm1d(6), nn.Conv1d(6, 2, 1), nn.Flatten(),
            nn.Linear(10, 2)]


def _check_pipeline_relaid(rank: int) -> None:
    """A layer whose output's strides change between steps for one input
    shape: sent in the kept header's layout (a copy), which rounds
    otherwise downstream, not a hang or an error."""
    ref_layers, layers = _relaid(), _relaid()
    pipe = Pipeline(layers, micro_batches=1, allocation="modulo")
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x, t = torch.randn(4, 4, 5, generator=g), torch.randn(4, 2, generator=g)
        for some in (ref_layers, layers):
            for layer in some:
                layer.zero_grad()
        F.mse_loss(nn.Sequential(*ref_layers)(x), t).backward()
        pipe.step(x, t, F.mse_loss)
        _assert_pipeline_grads(pipe, ref_layers, f"rank {rank} step {step}")
    pipe.remove()


def _check_pipeline_kept_headers(rank: int) -> None:
    """Headers are kept for the last _KEPT_INPUTS input descriptions, every
    rank dropping the same: they grew by one per input shape, for good. A
    dropped shape seen again sends its headers anew, a kept one does not,
    for single-process training's gradients (bitwise, one micro-batch)."""
    ref_layers, layers = _blocks(), _blocks()
    pipe = Pipeline(layers, micro_batches=1, allocation="modulo")
    x = torch.cat([_batch(0, 0)[0], _batch(0, 1)[0]])
    t = torch.cat([_batch(0, 0)[1], _batch(0, 1)[1]])
    first = {}
    shapes = list(range(1, ooo._KEPT_INPUTS + 3))
    for rows in shapes + [shapes[0], shapes[-1]]:
        for some in (ref_layers, layers):
            for layer in some:
                layer.zero_grad()
        F.mse_loss(nn.Sequential(*ref_layers)(x[:rows]), t[:rows]).backward()
        pipe.step(x[:rows], t[:rows], F.mse_loss)
        _assert_pipeline_grads(pipe, ref_layers, f"rank {rank} rows {rows}", exact=True)
        first.setdefault(rows, pipe.messages)
        assert len(pipe._headers) <= ooo._KEPT_INPUTS, (rank, rows, len(pipe._headers))
    if dist.get_world_size() > 1:  # every rank sends: both kinds of header
        assert pipe.messages < first[shapes[-1]], (rank, pipe.messages, first)
        # dropped (the least recently used), then back: its headers again
        assert pipe.messages < first[shapes[0]] == first[shapes[-1]], (rank, first)
    pipe.remove()


def _check_pipeline_layouts(rank: int, world: int) -> None:
    """Activations and input gradients in the layout their layer made them,
    between stages and on one: single-process training's bits (see
    _check_micro_batched); layouts that change between steps; headers kept
    for a bounded number of input shapes."""
    for (make, sample), (schedule, allocation, group, micro, input_grad) in itertools.product(
            _LAYOUT_MODELS, _LAYOUT_CASES):
        _check_micro_batched(rank, make, 5, sample, 2,
                             dict(micro_batches=micro, schedule=schedule, allocation=allocation,
                                  group=group), input_grad=input_grad)
    _check_pipeline_relaid(rank)
    _check_pipeline_kept_headers(rank)


def test_pipeline_layouts_on_the_wire():
    """What travels for a layout, and what the receiver rebuilds from it: a
    transposed tensor's storage itself (no copy), an expanded one's
    distinct elements, a slice with gaps its distinct elements alone (a
    copy), rebuilt with its strides (it travelled contiguous), windows
    that overlap with gaps the elements they reach alone (a copy; they
    travelled contiguous), contiguous where their cover's holes outnumber
    the overlaps, an empty one nothing (the receiver of an empty one with
    an expanded dim, (0, 3) strides (0, 1), awaited 3 elements, never
    sent); a tensor whose strides changed since the header is
    copied into the header's layout, and raises where that layout is
    expanded or overlaps (no copy can make one)."""
    x = torch.randn(4, 6, 5)
    windows = torch.randn(300).as_strided((2, 3, 3), (100, 1, 1))  # overlap, and gaps
    unfolded = torch.randn(2, 6, 20)[..., :6].unfold(-1, 3, 1)  # (2, 6, 4, 3): the same
    holey = torch.randn(3000).as_strided((2, 2, 2), (1, 1000, 999))  # 8 elements, cover 2001
    # (tensor, elements sent, storage spanned, contiguous, sent without a copy)
    cases = [(x.transpose(1, 2), 120, 120, False, True),
             (x.permute(2, 0, 1), 120, 120, False, True),
             (torch.randn(4, 1).expand(4, 3), 4, 4, False, True), (x, 120, 120, True, True),
             (x[:, ::2], 60, 115, False, False), (x.transpose(0, 2)[:, :3], 60, 105, False, False),
             (x[:, ::2].unsqueeze(-1).expand(-1, -1, -1, 3), 60, 115, False, False),
             (torch.randn(10).unfold(0, 3, 1), 10, 10, False, True),
             (windows, 10, 105, False, False), (unfolded, 72, 226, False, False),
             (holey, 8, 8, True, False), (x[:0].transpose(1, 2), 0, 0, False, True),
             (torch.zeros(3)[None].expand(0, 3), 0, 0, False, True)]
    for t, sent, span, contiguous, in_place in cases:
        layout = _Layout.of_tensor(t)
        assert (layout.sent, layout.span, layout.contiguous) == (sent, span, contiguous), t.stride()
        assert _Layout.read(layout.header(True, t.device)) == (layout, True)
        wire = layout.wire(t).reshape(-1)
        assert wire.shape == (sent,)
        assert (wire.data_ptr() == t.data_ptr() or not sent) == in_place, t.stride()
        assert layout.strides == t.stride() or contiguous
        for extra in (0, 1):  # an activation; a gradient and its flag
            buffer = layout.empty(extra, t.device)
            buffer.view(-1)[:sent] = wire
            received = layout.rebuilt(buffer)
            assert torch.equal(received, t) and received.stride() == layout.strides
    for t in (x.transpose(1, 2), x[:, ::2]):
        layout = _Layout.of_tensor(t)
        relaid = layout.rebuilt(layout.wire(t.contiguous()).reshape(-1))
        assert torch.equal(relaid, t) and relaid.stride() == layout.strides
    for expanded in (torch.randn(4, 1).expand(4, 3),
                     x[:, ::2].unsqueeze(-1).expand(-1, -1, -1, 3), windows, unfolded):
        with pytest.raises(RuntimeError,
                           match=r"changed its strides .*\(expanded or overlapping\)"):
            _Layout.of_tensor(expanded).wire(expanded.contiguous())


def _offsets_reached(t: torch.Tensor) -> set:
    """The storage offsets (from t's) that t's elements lie at, counted one by one."""
    return {sum(i * s for i, s in zip(index, t.stride()))
            for index in itertools.product(*map(range, t.shape))}


def _received(layout: _Layout, t: torch.Tensor) -> torch.Tensor:
    """What the receiver of `t` rebuilds, in a gradient's message (the data
    and a flag) and checked to have the layout's strides."""
    buffer = layout.empty(1, t.device)
    buffer[:layout.sent] = layout.wire(t).reshape(-1)
    received = layout.rebuilt(buffer)
    assert received.stride() == layout.strides, (t.shape, t.stride())
    return received


def test_pipeline_layouts_of_random_strides_round_trip():
    """Random layouts (as_strided: overlapping, expanded, with gaps, empty)
    are rebuilt equal, with the strides their header keeps, from what
    travels, which holds every element they reach (one a layout reaches
    more than once: unsent where none was). And windows that overlap with
    gaps, unfold over a slice of a random tensor along a random dim (step
    at most the size), keep their strides and send exactly the elements
    they reach (or their span, no copy, where it holds at most their
    elements): they travelled contiguous, all their elements."""
    rng = random.Random(0)
    for _ in range(1500):
        shape = [rng.choice([1, 2, 3, 4] * 8 + [0]) for _ in range(rng.randint(0, 4))]
        strides = [rng.choice([0, 1, 1, 2, 3, 5, 10, 20, 60]) for _ in shape]
        t = torch.randn(400).as_strided(shape, strides, rng.randint(0, 3))
        layout = _Layout.of_tensor(t)
        assert layout.sent >= len(_offsets_reached(t)) or layout.strides != t.stride(), shape
        assert torch.equal(_received(layout, t), t), (shape, strides)
    for _ in range(200):
        x = torch.randn([rng.randint(4, 9) for _ in range(3)])
        d, size = rng.randrange(3), rng.randint(2, 4)
        kept = rng.randint(size, x.shape[d] + 2)
        windows = x.narrow(d, 0, min(kept, x.shape[d])).unfold(d, size, rng.randint(1, size))
        layout = _Layout.of_tensor(windows)
        assert layout.strides == windows.stride(), (x.shape, d, size, windows.stride())
        reached = len(_offsets_reached(windows))
        assert layout.sent in (reached, min(layout.span, windows.numel())), (x.shape, d, size)
        assert torch.equal(_received(layout, windows), windows), (x.shape, d, size)


@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_hands_on_activations_and_gradients_in_their_layout(world):
    """README: a layer's output travels to the next stage with its strides
    (transposed, channels_last, expanded), and so does its input gradient
    to the stage before; on a stage, a layer gets its output gradient as
    the next layer's backward made it. They arrived contiguous: the next
    kernels summed in another order (BatchNorm1d's running mean 2.2e-7 off,
    a Conv1d's bias gradient 1.2e-7)."""
    _spawn(_check_pipeline_layouts, world)


def test_pipeline_hands_on_gradients_in_their_layout_on_one_stage(solo_group):
    """One stage: each layer's input gradient as its backward made it, not
    the .grad of the leaf standing for its input (laid out as the input).
    On one torch thread, as the ranks run: sums in memory order."""
    with torch_threads(1):
        _check_pipeline_layouts(0, 1)


class _EveryOther(nn.Module):
    """(B, C, L) -> (B, C / 2, L): every other channel, a view whose span has gaps."""

    def forward(self, x):
        return x[:, ::2]


class _PadLast(nn.Module):
    """(B, C, L) -> (B, C, 2L), zeros after: cat's backward gives it a slice
    of its output gradient as input gradient, a view with gaps."""

    def forward(self, x):
        return torch.cat([x, torch.zeros_like(x)], -1)


def _gapped(seed: int = 0) -> list:
    """On (B, 4, 5): a slice of a Conv1d's output (gaps) into a
    BatchNorm1d, which sums it in memory order, and a slice of a gradient
    (gaps) back to another one, whose backward sums that too (on a
    contiguous input: with one with gaps it sums in one order either way)."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Conv1d(4, 12, 1), _EveryOther()), nn.BatchNorm1d(6),
            nn.BatchNorm1d(6), _PadLast(),
            nn.Sequential(nn.Conv1d(6, 2, 1), nn.Flatten(), nn.Linear(20, 2))]


def _check_pipeline_gaps(rank: int, world: int) -> None:
    """Activations and gradients whose span has gaps, between the stages of
    either allocation (contiguous: the gradient; modulo: both), either
    schedule, 1 to 3 micro-batches: single-process training's bits (see
    _check_micro_batched)."""
    for allocation, schedule, micro in itertools.product(
            ("contiguous", "modulo"), ("gpipe", "fast_forward"), (1, 2, 3)):
        _check_micro_batched(rank, _gapped, 7, (4, 5), 2,
                             dict(micro_batches=micro, schedule=schedule, allocation=allocation),
                             input_grad=micro == 2)


def test_pipeline_hands_on_a_slice_with_gaps_in_its_layout():
    """README: an activation or a gradient whose span has gaps (a slice of
    every other channel, the slice cat's backward makes) travels as its
    distinct elements alone and is rebuilt with its strides. It travelled
    contiguous, and the BatchNorm1d that got it summed it in another order,
    forward or backward: the first Conv1d's weight gradient was 3e-8 to
    1.5e-7 off, a BatchNorm1d's 1e-8 to 2.6e-8 (every case, both
    allocations: contiguous has the gradient between the stages)."""
    _spawn(_check_pipeline_gaps, 2)


def test_pipeline_hands_on_a_slice_with_gaps_on_one_stage(solo_group):
    """The same on one stage, where nothing travels: each layer gets the
    slice as the layer before or after made it (one thread, as above)."""
    with torch_threads(1):
        _check_pipeline_gaps(0, 1)


class _Windows(nn.Module):
    """(B, C, L) -> (B, C, 4, 3): windows of 3 over the first 6 positions,
    a view whose windows overlap and whose span has gaps (the rest of each
    row): neither apart nor spanning at most its elements."""

    def forward(self, x):
        return x[..., :6].unfold(-1, 3, 1)


def _windowed(seed: int = 0) -> list:
    """On (B, 4, 20): overlapping windows with gaps out of a Conv1d's output
    into a BatchNorm2d, which sums them in memory order."""
    torch.manual_seed(seed)
    return [nn.Conv1d(4, 6, 1), _Windows(), nn.BatchNorm2d(6),
            nn.Sequential(nn.Flatten(), nn.Linear(72, 2))]


def _check_pipeline_windows(rank: int, world: int) -> None:
    """Overlapping windows with gaps between the stages of either allocation
    (the windows layer's output crosses to the BatchNorm2d's stage in
    both), either schedule, 1 to 2 micro-batches: single-process training's
    bits (see _check_micro_batched)."""
    for allocation, schedule, micro in itertools.product(
            ("contiguous", "modulo"), ("gpipe", "fast_forward"), (1, 2)):
        pipe = Pipeline(_windowed(), micro_batches=micro, allocation=allocation)
        assert pipe.stage_of[1] != pipe.stage_of[2], (allocation, pipe.stage_of)
        pipe.remove()
        _check_micro_batched(rank, _windowed, 7, (4, 20), 2,
                             dict(micro_batches=micro, schedule=schedule, allocation=allocation),
                             input_grad=micro == 2)


def test_pipeline_hands_on_overlapping_windows_with_gaps_in_their_layout():
    """README: windows that overlap with gaps (unfold over a slice) travel as
    the elements they reach alone and are rebuilt with their strides. They
    travelled contiguous, and the BatchNorm2d that got them summed them in
    another order: its weight gradient and running variance were up to
    1.2e-7 and 1.8e-7 off, the Linear's weight gradient after it 9.5e-7
    (every case, both allocations)."""
    _spawn(_check_pipeline_windows, 2)


class _CalledTwice(nn.Module):
    """Holds one Linear and calls it twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("bf16", [False, True])
def test_pipeline_module_called_twice_by_a_layer(solo_group, bf16):
    """README: under "gpipe" the layer runs plain, with micro-batched torch's
    bits; split under "fast_forward", its calls' weight gradients are summed
    as autograd sums them: torch's bits too (added one by one, they were
    1.3e-7 off in float32 and 0.3% under bfloat16 autocast)."""
    x, t = _batch(0, 0)

    def loss_fn(y, t):
        return F.mse_loss(y.float(), t)

    for schedule in ("gpipe", "fast_forward"):
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(WIDTH, WIDTH), _CalledTwice(), nn.Linear(WIDTH, WIDTH))
        layers = list(copy.deepcopy(ref))
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            for xm, tm in zip(x.split(BATCH // 2), t.split(BATCH // 2)):
                (loss_fn(ref(xm.clone()), tm) / 2).backward()
            pipe = Pipeline(layers, micro_batches=2, schedule=schedule)
            pipe.step(x, t, loss_fn)
        pipe.remove()
        for (name, p), want in zip(nn.Sequential(*layers).named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, want.grad), (schedule, name)


def test_pipeline_in_place_layer_after_a_saved_output(solo_group):
    """ReLU(inplace=True) after tanh, which saves its output for backward:
    the single process's error, not a wrong gradient."""
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.ReLU(inplace=True), nn.Linear(WIDTH, WIDTH)]
    x, t = _batch(0, 0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        F.mse_loss(nn.Sequential(*layers)(x), t).backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        Pipeline(layers, micro_batches=2).step(x, t, F.mse_loss)


def test_pipeline_plan(solo_group):
    """The orders the simulator gives one stage of 2 layers, 2 micro-batches."""
    def plan(schedule):
        return Pipeline(_blocks()[:2], micro_batches=2, schedule=schedule).plan()

    forwards = [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    assert plan("gpipe") == forwards + [("dW", 1, 0), ("dO", 1, 0), ("dW", 0, 0),
                                        ("dW", 1, 1), ("dO", 1, 1), ("dW", 0, 1)]
    assert plan("fast_forward") == forwards + [("dO", 1, 0), ("dO", 1, 1), ("dW", 1, 0),
                                               ("dW", 0, 0), ("dW", 1, 1), ("dW", 0, 1)]


@pytest.mark.parametrize("input_grad", [False, True])
def test_pipeline_splits_only_layers_whose_dw_moves(solo_group, input_grad):
    """GPipe runs every dW(l, m) right before dO(l, m), autograd's own order,
    yet every split layer ran split: a Python backward, a held task and a
    pass of the handle per layer and micro-batch, for nothing (a GPipe step
    took 1.3x the CPU time of torch's ScheduleGPipe on the same stages).
    Those layers run plain autograd now, with the same gradients, bit for
    bit, as fast-forwarding's split ones (each weight's micro-batches
    accumulate in the same order); fast-forwarding keeps the split where
    it moves dW, and switches between the two as the input's requires_grad
    changes the plan (layer 0 has no dO without an input gradient)."""
    x, t = _batch(0, 0)
    grads, split = {}, {}
    for schedule in ("gpipe", "fast_forward", "gpipe"):
        layers = _blocks()
        pipe = Pipeline(layers, micro_batches=4, schedule=schedule)
        pipe.step(x.clone().requires_grad_(input_grad), t, F.mse_loss)
        split[schedule] = {l: [s.split for s in pipe.handle.sites
                               if any(s.module is m for m in layers[l].modules())]
                           for l in range(DEPTH)}
        got = [p.grad for p in pipe.parameters()]
        if schedule in grads:
            for g, want in zip(got, grads[schedule]):
                assert torch.equal(g, want)
        grads[schedule] = got
        pipe.remove()
    assert all(s == [False] for s in split["gpipe"].values()), split["gpipe"]
    # fast-forwarding, one stage: every dO before any dW; layer 0 alone
    # without dO when the input needs no gradient
    assert split["fast_forward"] == {l: [input_grad or l > 0] for l in range(DEPTH)}
    for g, want in zip(grads["gpipe"], grads["fast_forward"]):
        assert torch.equal(g, want)
    layers = _blocks()
    pipe = Pipeline(layers, micro_batches=4, schedule="fast_forward")
    first = [s for s in pipe.handle.sites if s.module is layers[0][0]]
    for needs in (input_grad, not input_grad, input_grad):
        pipe.step(x.clone().requires_grad_(needs), t, F.mse_loss)
        assert [s.split for s in first] == [needs]
    pipe.remove()
    # a Linear twice in one layer stays split: plain autograd would sum its
    # two dW before adding them to .grad (other bits than one by one)
    twice, once = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    pipe = Pipeline([nn.Sequential(twice, nn.Tanh(), twice), once], micro_batches=2,
                    schedule="gpipe")
    pipe.step(x.clone().requires_grad_(input_grad), t, F.mse_loss)
    assert {s.module: s.split for s in pipe.handle.sites} == {twice: True, once: False}
    pipe.remove()


def _sharing_layers(sharing: str, bias: bool, depth: int = 4) -> list:
    """Linear, a, tanh, b, then Linears up to `depth` layers: b is a (one
    module reused by two layers), a Linear whose weight is a's (tied), or
    ("none") one of its own (the same values as tied, but its weight)."""
    torch.manual_seed(0)
    a, b = nn.Linear(WIDTH, WIDTH, bias=bias), nn.Linear(WIDTH, WIDTH, bias=bias)
    if sharing == "tied":
        b.weight = a.weight
    elif sharing == "reused":
        b = a
    return [nn.Linear(WIDTH, WIDTH), a, nn.Tanh(), b] + [
        nn.Linear(WIDTH, WIDTH) for _ in range(depth - 4)]


def _fused_training(layers: list, optimizer: type, mode: str, train_step: Callable) -> nn.Module:
    """Three steps of train_step(model, x, t) on `layers` with `optimizer`
    fused in `mode` (forward mode: the step() and zero_grad() of its loop);
    returns the model."""
    model = nn.Sequential(*layers)
    opt = optimizer(model.parameters(), lr=0.1)
    fusion = fuse(model, opt, mode=mode)
    for step in range(3):
        train_step(model, *_batch(0, step))
        opt.step()
        opt.zero_grad()
    fusion.remove()
    return model


@pytest.mark.parametrize("schedule", ["gpipe", "fast_forward"])
@pytest.mark.parametrize("sharing, bias", [("tied", True), ("tied", False), ("reused", True)])
@pytest.mark.parametrize("mode", ["backward", "forward"])
def test_pipeline_keeps_split_a_weight_of_several_local_layers_under_fusion(
        solo_group, sharing, bias, schedule, mode):
    """A weight in two layers of one stage (tied, or one module reused) ran
    plain under GPipe, a backward call per layer: the first call completed
    its gradient, reprop.fuse(mode="backward") updated it in place, and the
    second call, which still needed the value its forward saved, raised
    autograd's in-place error, where single-process fused training trains.
    Such a weight's layers stay split. Split, GPipe's order still ran the
    dW of the layer nearer the loss before the other layer's backward,
    which fired the weight's hooks: the fusion updated it there, and the
    other layer's backward raised autograd's error about a view made in
    no_grad mode (the saved W^T), for a reused module and a tied weight
    without bias (a's bias, completed by the second layer alone, held the
    tied weight's update of a back). Its dW now wait for every use's
    backward: the same parameters as one process, bit for bit (one
    micro-batch), either fusion mode, either schedule."""
    ref = _fused_training(_sharing_layers(sharing, bias), torch.optim.SGD, mode,
                          lambda model, x, t: F.mse_loss(model(x), t).backward())
    local = _sharing_layers(sharing, bias)
    pipe = Pipeline(local, micro_batches=1, schedule=schedule)
    model = _fused_training(local, torch.optim.SGD, mode,
                            lambda model, x, t: pipe.step(x, t, F.mse_loss))
    pipe.remove()
    for got, want in zip(model.parameters(), ref.parameters()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("sharing", ["tied", "reused"])
def test_pipeline_fires_a_shared_weights_hooks_once_after_every_use(solo_group, sharing):
    """A weight in three layers of a stage under GPipe: its post-accumulate-grad
    hooks fired after each layer's dW (3 times a step, the first two on a
    partial gradient), where one process fires them once, on the whole
    gradient. Now once per step, with one process's gradient, bit for bit."""
    def layers():
        local = _sharing_layers(sharing, False)
        third = local[1] if sharing == "reused" else nn.Linear(WIDTH, WIDTH, bias=False)
        third.weight = local[1].weight
        return local + [nn.Tanh(), third]

    def seen_by_hooks(local, train_step) -> list:
        seen: list = []
        local[1].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        train_step(*_batch(0, 0))
        return seen

    ref = nn.Sequential(*layers())
    want = seen_by_hooks(ref, lambda x, t: F.mse_loss(ref(x), t).backward())
    local = layers()
    pipe = Pipeline(local, micro_batches=1, schedule="gpipe")
    got = seen_by_hooks(local, lambda x, t: pipe.step(x, t, F.mse_loss))
    pipe.remove()
    assert len(want) == len(got) == 1 and torch.equal(got[0], want[0])


@pytest.mark.parametrize("schedule", ["gpipe", "fast_forward"])
@pytest.mark.parametrize("mode", ["backward", "forward"])
def test_pipeline_sees_a_weight_tied_after_it_was_built(solo_group, schedule, mode):
    """A weight tied between two layers of a stage after Pipeline() (the
    sharing was learned at construction): unseen, its dW ran as soon as
    held and its layers ran plain under GPipe, so reprop.fuse(mode="backward")
    updated it between the layers' backward calls (autograd's in-place
    error). The next step sees it: one process's fused training with the
    weight tied from the start, bit for bit, either mode and schedule; the
    tied layers stay split, and run plain again once untied."""
    ref = _fused_training(_sharing_layers("tied", False), torch.optim.SGD, mode,
                          lambda model, x, t: F.mse_loss(model(x), t).backward())
    local = _sharing_layers("none", False)
    pipe = Pipeline(local, micro_batches=1, schedule=schedule)
    local[3].weight = local[1].weight
    model = _fused_training(local, torch.optim.SGD, mode,
                            lambda model, x, t: pipe.step(x, t, F.mse_loss))
    for got, want in zip(model.parameters(), ref.parameters()):
        assert torch.equal(got, want)
    split = {s.module: s.split for s in pipe.handle.sites}
    assert split[local[1]] and split[local[3]] and not split[local[0]]  # (its dW alone)
    local[3].weight = nn.Parameter(local[1].weight.detach().clone())
    pipe.step(*_batch(0, 3), F.mse_loss)
    assert {s.module: s.split for s in pipe.handle.sites}[local[3]] == (schedule != "gpipe")
    pipe.remove()


def _check_tied_across_stages_after_it_was_built(rank: int, world: int) -> None:
    """See the test below: layers 0, 1 on rank 0, 2, 3 on rank 1."""
    layers = _blocks()[:4]
    pipe = Pipeline(layers, micro_batches=2)
    x, t = _batch(0, 0)
    pipe.step(x, t, F.mse_loss)
    layers[3][0].weight = layers[0][0].weight
    if rank == 1:  # rank 0's layers did not change: it would wait for rank 1's messages
        with pytest.raises(ValueError, match=r"^layers: layers\[0\]\.0\.weight is "
                                             r"layers\[3\]\.0\.weight.*stages 0 and 1.*"
                                             r"fixed when the Pipeline was built"):
            pipe.step(x, t, F.mse_loss)
    pipe.remove()


def test_pipeline_refuses_a_weight_tied_across_stages_after_it_was_built():
    """README: a weight tied between layers of two stages after Pipeline()
    trained a copy on each stage, unseen; the step of the stage whose layer
    now holds the other's weight raises the ValueError of construction."""
    _spawn(_check_tied_across_stages_after_it_was_built, 2)


def _sharing_pipeline_worker(rank: int, world: int) -> None:
    """Each rank's layers after fused training under GPipe against one
    process's (see the test below)."""
    import reprop.optim
    for sharing, optimizer, mode in itertools.product(
            ("tied", "reused", "tied later"), (torch.optim.SGD, reprop.optim.SGD),
            ("backward", "forward")):
        later = sharing == "tied later"  # after Pipeline() (see the test after the next)
        ref = _fused_training(_sharing_layers("tied" if later else sharing, False, DEPTH),
                              optimizer, mode,
                              lambda model, x, t: F.mse_loss(model(x), t).backward())
        layers = _sharing_layers("none" if later else sharing, False, DEPTH)
        pipe = Pipeline(layers, micro_batches=1, schedule="gpipe")
        if later:
            layers[3].weight = layers[1].weight
        _fused_training(list(pipe.layers.values()), optimizer, mode,
                        lambda model, x, t: pipe.step(x, t, F.mse_loss))
        pipe.remove()
        for l, layer in pipe.layers.items():
            for got, want in zip(layer.parameters(), ref[l].parameters()):
                assert torch.equal(got, want), (sharing, optimizer, mode, rank, l)


def test_pipeline_of_ranks_keeps_a_weight_of_several_local_layers_under_fusion():
    """The test above on 2 ranks, layers 1 and 3 (one module, or a tied
    weight without bias) on rank 0: GPipe with reprop.fuse(mode="backward")
    raised autograd's view error there; each rank's layers now end as one
    process's fused training leaves them, bit for bit, with torch's SGD and
    reprop's, in either fusion mode; so do they with the weight tied after
    Pipeline() (autograd's in-place error before the next step saw it)."""
    _spawn(_sharing_pipeline_worker, 2)


def test_pipeline_backward_once_per_run_of_local_layers(solo_group, monkeypatch):
    """GPipe on one stage ran a backward call per layer and micro-batch,
    each layer's input a leaf detached from the previous layer's output and
    aliased by an identity Function: the engine's setup and a Python
    backward per layer, where torch's GPipe runs one backward per stage and
    micro-batch. Consecutive layers of a stage whose backward runs in one
    piece, one after the other, now make one graph: one backward per
    micro-batch, the same gradients as single-process training (bit for
    bit with one micro-batch). Layers sharing a parameter stay split, each
    its own backward (see the test above), and fast-forwarding, which moves
    dW, keeps a backward per layer."""
    calls = []
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: (calls.append(1),
                                                                     backward(*a, **k))[1])
    x, t = _batch(0, 0)
    for schedule, make, micro, runs in (("gpipe", _blocks, 4, 1), ("gpipe", _blocks, 1, 1),
                                        ("gpipe", _tied, 1, 3), ("fast_forward", _blocks, 4, DEPTH)):
        ref_layers, layers = make(), make()
        ref = nn.Sequential(*ref_layers)
        F.mse_loss(ref(x), t).backward()
        pipe = Pipeline(layers, micro_batches=micro, schedule=schedule)
        calls.clear()
        pipe.step(x, t, F.mse_loss)
        assert len(calls) == runs * micro, (schedule, make.__name__, micro, len(calls))
        _assert_pipeline_grads(pipe, ref_layers, f"{schedule} {make.__name__}", exact=micro == 1)
        pipe.remove()


def _needed(program: list, stage_of, rank: int) -> dict:
    """The messages `rank` receives, per sender, in the order its program needs them."""
    need, seen = {}, set()
    for kind, l, m in program:
        if kind == 0 and l > 0 and stage_of[l - 1] != rank:
            need.setdefault(int(stage_of[l - 1]), []).append((0, l - 1, m))
        elif kind != 0 and (l, m) not in seen and l + 1 < len(stage_of) \
                and stage_of[l + 1] != rank:
            need.setdefault(int(stage_of[l + 1]), []).append((1, l, m))
        seen.add((l, m)) if kind != 0 else None
    return need


def test_pipeline_receives_in_sender_order():
    """With fast-forwarding and modulo allocation over 2 stages, 4
    micro-batches (a case of test_pipeline_matches_single_process), a stage
    needs its messages in another order than its peer sends them; the
    multi-rank tests use one tag throughout, so gloo matches in issue order
    as NCCL does, and pass only because messages are received in the
    sender's order."""
    stage_of = _C.sched_stages(DEPTH, 2, 1)
    programs = _stage_programs(stage_of, 4, 2, _check_costs(None, DEPTH), 1, False)
    differs = False
    for rank in range(2):
        inbox, need = _inbox(programs, stage_of, rank), _needed(programs[rank], stage_of, rank)
        assert {s: sorted(v) for s, v in inbox.items()} == {s: sorted(v) for s, v in need.items()}
        differs |= inbox != need
    assert differs


def test_pipeline_bad_arguments(solo_group):
    layers = _blocks()
    for kwargs, name in [(dict(micro_batches=0), "micro_batches"),
                         (dict(micro_batches=2.0), "micro_batches"),
                         (dict(schedule="1f1b"), "schedule"),
                         (dict(allocation="round_robin"), "allocation"),
                         (dict(allocation="modulo", group=0), "group"),
                         (dict(group=2), "group"),
                         (dict(costs={"fwd": [1.0] * 3}), r"costs\['fwd'\]"),
                         (dict(costs={"backward": 1.0}), "costs"),
                         (dict(costs={"fwd": "a"}), r"costs\['fwd'\]"),
                         (dict(costs={"fwd": True}), r"costs\['fwd'\]"),
                         (dict(costs={"transfer": "1"}), r"costs\['transfer'\]")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            Pipeline(layers, **kwargs)
    with pytest.raises(TypeError, match="^process_group: .*got str"):
        Pipeline(layers, process_group="world")
    pipe = Pipeline(layers, micro_batches=3)
    x, t = _batch(0, 0)
    with pytest.raises(ValueError, match="^micro_batches: 3 must divide"):
        pipe.step(x, t, F.mse_loss)
    with pytest.raises(ValueError, match=r"^inputs: expected a batch of at least 3 .*\(0, 16\)"):
        pipe.step(x[:0], t[:0], F.mse_loss)
    pipe.remove()  # (the layers are split by it: a second live Pipeline refuses them)
    pipe = Pipeline(layers, micro_batches=2)
    with pytest.raises(ValueError, match="^targets: "):
        pipe.step(x, t[:4], F.mse_loss)
    # a 0-d dummy for a loss that reads no targets: it raised len()'s TypeError
    with pytest.raises(ValueError, match=r"^targets: expected 8 targets .*got shape \(\)"):
        pipe.step(x, torch.tensor(0.0), lambda o, t: o.pow(2).mean())
    with pytest.raises(TypeError, match="^inputs: expected a tensor, got list"):
        pipe.step(x.tolist(), t, F.mse_loss)
    with pytest.raises(TypeError, match="^targets: expected a tensor, got list"):
        pipe.step(x, t.tolist(), F.mse_loss)
    # plan(input_grad=) took any value by its truth: "False" planned the input's gradient
    with pytest.raises(TypeError, match="^input_grad: expected True or False, got 'False'$"):
        pipe.plan("False")
    assert pipe.plan(np.bool_(True)) == pipe.plan(True) != pipe.plan(False)


def test_pipeline_takes_numpy_ints(solo_group):
    """Pipeline checked group as a count, NumPy's ints too, then passed it to
    stages(), which refused them."""
    pipe = Pipeline(_blocks(), micro_batches=np.int64(2), allocation="modulo", group=np.int64(2))
    assert pipe.micro_batches == 2 and pipe.stage_of.tolist() == [0] * DEPTH
    x, t = _batch(0, 0)
    pipe.step(x, t, F.mse_loss)


# ---------------------------------------------------------------------------
# Planning helpers for data parallelism: the search for k, all-reduce times
# ---------------------------------------------------------------------------


def test_search_k_measures_k_equal_to_layers():
    """k = L (every layer's dW held) is a candidate: the coarse sweep of L/10
    steps stopped short of it."""
    best, seen = search_k(10, lambda k: float(k))
    assert best == 10 and 10 in seen
    best, seen = search_k(100, lambda k: float(k))
    assert best == 100 and len(seen) < 25


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_search_k_refuses_a_bad_measurement(bad):
    """A NaN reads as "not measured" to the core, which asked for the same k
    forever. (A negative score is fine: a negated time, say.)"""
    calls = []

    def measure(k):
        calls.append(k)
        assert len(calls) < 100, "search_k keeps asking"
        return bad if len(calls) == 3 else 1.0

    with pytest.raises(ValueError, match=r"^measure: .*k=\d+"):
        search_k(10, measure)
    with pytest.raises(TypeError, match="^measure: "):
        search_k(10, lambda k: "fast")


@pytest.mark.parametrize("layers", [0, -3, 2 ** 20 + 1, 10 ** 9, 2.0, True, None])
def test_search_k_refuses_bad_layers(layers):
    """10**9 layers allocated a score per k (8 GB) before measuring anything."""
    with pytest.raises(ValueError, match="^layers: "):
        search_k(layers, lambda k: 1.0)


def test_allreduce_time_refuses_bad_arguments():
    for kwargs, name in [(dict(bandwidth=0.0), "bandwidth"), (dict(bandwidth=-1e9), "bandwidth"),
                         (dict(bandwidth=float("nan")), "bandwidth"),
                         (dict(nbytes=-1.0), "nbytes"), (dict(nbytes=float("inf")), "nbytes"),
                         (dict(latency=-1e-6), "latency"), (dict(workers=0), "workers"),
                         (dict(workers=2.5), "workers")]:
        args = dict(nbytes=1e6, workers=4, bandwidth=1e9, latency=0.0) | kwargs
        with pytest.raises(ValueError, match=f"^{name}: "):
            allreduce_time(**args)
    # infinite bandwidth: the latencies alone (how benchmarks/ooo.py separates them)
    assert math.isclose(allreduce_time(1e6, 4, float("inf"), 1e-5), 6e-5)


def test_simulate_refuses_a_k_it_cannot_use():
    """k = 99 with 4 layers was clamped to 4 without a word (simulate returns
    no k_used), and a k with another order was ignored."""
    for kwargs in (dict(order="reverse_first_k", k=99), dict(order="reverse_first_k", k=-1),
                   dict(order="reverse_first_k", k=1.5), dict(order="fast_forward", k=2)):
        with pytest.raises(ValueError, match="^k: "):
            simulate(4, **kwargs)
    assert simulate(4, order="reverse_first_k", k=4).makespan > 0


def test_reverse_first_k_refuses_bad_memory_sizes():
    """A negative mem_cap read as "no cap" and fractional sizes were
    truncated, both silently. Whole floats are sizes too; a k past the
    layers holds every layer, as k_used says."""
    sizes = dict(mem_out_grad=[1] * 4, mem_weight_grad=[10] * 4, mem_forward=5, mem_cap=13)
    for kwargs, name in [(dict(mem_cap=-5), "mem_cap"), (dict(mem_cap=13.5), "mem_cap"),
                         (dict(mem_forward=-1), "mem_forward"),
                         (dict(mem_out_grad=[1.5] * 4), "mem_out_grad"),
                         (dict(mem_out_grad=[1, 2]), "mem_out_grad"),
                         (dict(mem_weight_grad=[10, 10, 10, -10]), "mem_weight_grad")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            reverse_first_k(4, 3, **(sizes | kwargs))
    for k in (-1, 1.5):
        with pytest.raises(ValueError, match="^k: "):
            reverse_first_k(4, k)
    whole = dict(mem_out_grad=[1.0] * 4, mem_weight_grad=[10.0] * 4, mem_forward=5.0, mem_cap=13.0)
    assert reverse_first_k(4, 3, **whole) == reverse_first_k(4, 3, **sizes)
    assert reverse_first_k(4, 99)[1] == 4


def test_pipeline_of_micro_batches_refuses_backward_fusion(solo_group):
    """A step() of several micro-batches interleaves their forwards and
    backwards: backward fusion updated the parameters in each micro-batch's
    backward (later forwards saw the update, each gradient was applied on its
    own), training silently wrong. Refused in either order; one micro-batch,
    forward mode, and either after the other's remove(), work."""
    layers = _blocks()
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    pipe = Pipeline(layers, micro_batches=2)
    for root in (nn.Sequential(*layers), layers[3]):
        with pytest.raises(ValueError, match="^mode: .*Pipeline.*mode='forward'"):
            fuse(root, opt, mode="backward")
    pipe.remove()
    fused = fuse(nn.Sequential(*layers), opt, mode="backward")
    with pytest.raises(ValueError, match="^micro_batches: .*mode='forward'"):
        Pipeline(layers, micro_batches=2)
    Pipeline(layers, micro_batches=1).remove()
    fused.remove()
    # forward mode: single-process training of the whole batch, step by step
    ref = nn.Sequential(*_blocks())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pipe = Pipeline(layers, micro_batches=2)
    fused = fuse(nn.Sequential(*layers), opt, mode="forward")
    for step in range(3):
        x, t = _batch(0, step)
        F.mse_loss(ref(x), t).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        pipe.step(x, t, F.mse_loss)
        opt.step()
        opt.zero_grad()
    fused.remove()
    pipe.remove()
    for got, want in zip(nn.Sequential(*layers).parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_data_parallel_first_backward_stopped_before_its_end_is_queued(solo_group, monkeypatch):
    """A KeyboardInterrupt (a notebook's stop button) in the first backward,
    after it is marked as running and before its end-of-backward callback
    is queued: that backward is dropped at the next, which trains as
    autograd does (every later forward raised a TypeError)."""
    import reprop.ooo as ooo_module
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, k=2)
    queue = ooo_module.queue_end_of_backward

    def stopped_once(fn):
        if getattr(fn, "__self__", None) is dp:
            monkeypatch.setattr(ooo_module, "queue_end_of_backward", queue)
            raise KeyboardInterrupt
        return queue(fn)

    monkeypatch.setattr(ooo_module, "queue_end_of_backward", stopped_once)
    x, t = _batch(0, 0)
    with pytest.raises(KeyboardInterrupt):
        F.mse_loss(model(x), t).backward()
    for step in range(2):
        x, t = _batch(0, step + 1)
        for net in (model, ref):
            net.zero_grad()
            F.mse_loss(net(x), t).backward()
        _assert_same(model, ref, "grad")
    dp.remove()


# ---------------------------------------------------------------------------
# A KeyboardInterrupt (a notebook's stop button) midway through a constructor:
# injected before each line of ooo.py it runs (see test_ooo.py), then the cell
# runs again
# ---------------------------------------------------------------------------


def _assert_interrupted_anywhere_runs_again(built: nn.Module, construct: Callable,
                                            counted: Callable, train: Callable) -> None:
    """construct(model) (DataParallel or Pipeline) stopped before each line
    of reprop/ooo.py it runs, in turn, on a copy of `built`: the model is as
    built and `counted(its params)` false; construct(model) again then
    trains as `train(model, ref, handle)` checks (ref: another copy), and
    remove() leaves the model as built."""
    for k in itertools.count(1):
        model, ref = copy.deepcopy(built), copy.deepcopy(built)
        if not interrupted_at_line(k, lambda: construct(model), ooo.__file__):
            break
        assert_as_built(model, built)
        assert not counted(model.parameters())
        handle = construct(model)
        train(model, ref, handle)
        handle.remove()
        assert_as_built(model, built)
    assert k > 100  # it did stop the constructor midway


def test_data_parallel_interrupted_anywhere_in_construction_runs_again(solo_group):
    """DataParallel(model) split the layers first, then broadcast, hooked the
    model and counted itself live: interrupted after the split it left
    layers split by a handle the caller never got (DataParallel(model)
    again refused them), and after a hook, a model hooked by an object
    nobody held; interrupted as the broadcast's `with torch.no_grad()`
    body ended, grad mode off for the session. Now all of it goes in last,
    all or none, and grad mode is restored in a finally: the model is as
    it was, and DataParallel again gives autograd's gradients (one rank)
    until remove() leaves it as it was."""
    torch.manual_seed(0)
    built = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))

    def train(model: nn.Module, ref: nn.Module, dp: DataParallel) -> None:
        for step in range(2):
            x, t = _batch(0, step)
            for net in (model, ref):
                net.zero_grad()
                F.mse_loss(net(x), t).backward()
            _assert_same(model, ref, "grad")

    _assert_interrupted_anywhere_runs_again(
        built, lambda model: DataParallel(model, k=1), _averaged_by_data_parallel, train)


def test_pipeline_interrupted_anywhere_in_construction_runs_again(solo_group):
    """Pipeline(layers, micro_batches=2) counted itself among the pipelines
    that refuse backward fusion, then split its layers, then set up its
    messages: interrupted after the split it left layers split by a handle
    nobody got (a new Pipeline refused them). Now the count and the split
    go in last, all or none: the layers are as they were, counted nowhere,
    and a new Pipeline trains as the whole batch at once (up to the
    rounding of the micro-batches' sums) until remove()."""
    def train(layers: nn.Module, ref: nn.Module, pipe: Pipeline) -> None:
        x, t = _batch(0, 0)
        pipe.step(x, t, F.mse_loss)
        F.mse_loss(ref(x), t).backward()
        _assert_same(layers, ref, "grad", exact=False)

    _assert_interrupted_anywhere_runs_again(
        nn.Sequential(*_blocks()[:3]), lambda layers: Pipeline(layers, micro_batches=2),
        _pipelined_in_micro_batches, train)


def test_pipeline_whose_layer_enable_refuses_counts_nowhere(solo_group):
    """A Pipeline of micro-batches counted itself among those refusing
    backward fusion before enable() refused one of its layers (a sparse
    Embedding): while the traceback kept the half-built object (a
    notebook's last error keeps it), backward fusion of the other layer was
    refused, naming a Pipeline that never was. The count now comes with
    the split, which is undone, count included, on any exception."""
    layers = [nn.Linear(WIDTH, WIDTH), nn.Embedding(10, WIDTH, sparse=True)]
    with pytest.raises(ValueError, match="^model: 1: Embedding\\(sparse=True\\)") as refused:
        Pipeline(layers, micro_batches=2)
    assert refused.traceback  # (its frames hold the half-built pipeline)
    fuse(layers[0], torch.optim.SGD(layers[0].parameters(), lr=0.1), mode="backward").remove()


def test_pipeline_refuses_layers_split_by_a_live_handle(solo_group):
    """A Pipeline over layers that a live enable() or another Pipeline had
    split found nothing of its own to split and ran without a handle: its
    dW tasks ran inside dO, so fast_forward was planned but not done.
    Refused as enable() refuses them; once the other handle is removed the
    layers pipeline again."""
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    handle = enable(nn.Sequential(*layers))
    with pytest.raises(ValueError, match="is split by another reprop.ooo.enable"):
        Pipeline(layers, micro_batches=2)
    handle.remove()
    first = Pipeline(layers, micro_batches=2)
    with pytest.raises(ValueError, match="is split by another reprop.ooo.enable"):
        Pipeline(layers, micro_batches=2)
    first.remove()
    assert Pipeline(layers, micro_batches=2).handle is not None


def _check_pipeline_refused_on_one_rank(rank: int, world: int) -> None:
    layers = [nn.Linear(WIDTH, WIDTH), nn.Embedding(10, WIDTH, sparse=True)]
    match = "^model: 0: Embedding\\(sparse=True\\)" if rank == 1 else "^layers: rank 1 could not"
    with pytest.raises(ValueError, match=match):
        Pipeline(layers)
    assert all("forward" not in m.__dict__ for m in layers), "split left behind"


def test_pipeline_refused_on_one_rank_raises_on_every_rank():
    """enable() refusing one rank's layers (a sparse Embedding) raised on
    that rank alone, after the arguments were agreed: the others built
    their Pipeline and waited in the first step() for its messages until
    the timeout. Every rank raises now, the others naming the rank."""
    _spawn(_check_pipeline_refused_on_one_rank, 2, timeout=20)


def test_data_parallel_removed_ignores_its_gradient_hooks(solo_group, monkeypatch) -> None:
    """A post-accumulate-grad hook of a removed DataParallel that is still
    registered (a KeyboardInterrupt inside torch's registration, after the
    hook went into the dict and before its handle came back, leaves one that
    remove() cannot see) does nothing: it launched buckets, an all-reduce on
    this rank alone."""
    model = _Net()
    dp = DataParallel(model, k=2)
    p = next(model.parameters())
    hook = next(iter(p._post_accumulate_grad_hooks.values()))
    dp.remove()
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: reduced.append(a))
    p.grad = torch.ones_like(p)
    hook(p)
    assert not dp._used and not reduced


# ---------------------------------------------------------------------------
# The stop button on every rank at once: the same line of DataParallel's
# hooks stopped on each rank (LineStop), then training goes on
# ---------------------------------------------------------------------------


class _SweptNet(nn.Module):
    """Split Linear layers around a BatchNorm (buffers broadcast before each
    forward), then a plain parameter: at k = 2 (Linear and BatchNorm held)
    and _SWEPT_CAP, two buckets of autograd's and one per held layer."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                                    nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x):
        return self.layers(x) * self.scale


_SWEPT_CAP = 1.6e-3  # MiB: a Linear's weight and bias (1088 bytes) and no more


def _dp_code(*names: str) -> tuple:
    """DataParallel's functions of these names (all: none given), but
    _agree, whose rank 0 skips a line the others run: a count of lines
    would stop the ranks at different lines after it."""
    return tuple(f for name, f in vars(DataParallel).items() if isinstance(f, types.FunctionType)
                 and name != "_agree" and (not names or name in names))


def _dp_stopped_step(rank: int, dp: DataParallel, twin, step: int, where, k: int,
                     case: str, raising: list) -> bool:
    """Step `step` of dp's model stopped before its k-th line in `where`
    (LineStop), the same line on every rank: the same collectives issued.
    Then grad mode is on, and `twin` (a DistributedDataParallel) takes the
    parameters and buffers left behind: two more steps give its gradients
    and parameters bitwise, and leave no hold of the first layers' dW open
    (one the stop left is closed by the next forward). Whether it stopped."""
    model = dp.model
    x, t = _batch(rank, step)
    if case == "unfrozen":
        model.scale.requires_grad_(True)
    stop = LineStop(where, k)
    kept = []  # the stop's traceback, kept as a notebook keeps the last error's
    try:
        with stop:
            _train_step(model, torch.optim.SGD(model.parameters()), x, t)
    except (KeyboardInterrupt, ValueError) as e:  # ValueError: "raises", not stopped before
        kept.append(e)
    raising[0] = False  # (armed by the caller for this step)
    assert torch.is_grad_enabled()
    with torch.no_grad():
        for a, b in itertools.chain(zip(twin.module.parameters(), model.parameters()),
                                    zip(twin.module.buffers(), model.buffers())):
            a.copy_(b)
    for step in range(step + 1, step + 3):
        x, t = _batch(rank, step)
        for net in (model, twin):
            net.zero_grad()
            F.mse_loss(net(x), t).backward()
        assert dp.handle._holding == ()
        _assert_same(model, twin.module, "grad")
        for net in (model, twin.module):
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad
        _assert_same(model, twin.module, "parameter")
    return stop.stopped


def _dp_stopped_at_every_line(rank: int, built: nn.Module, twin, case: str, where) -> int:
    """A DataParallel of a copy of `built` (k = 2) trains, one step stopped
    (_dp_stopped_step) before its first line in `where`, then before its
    second, and so on, until a step runs fewer lines; remove() then leaves
    the model as built. `case`: "first" (the first step stopped, each time
    on a new DataParallel and model), "unfrozen" (likewise, `scale` frozen
    at construction and unfrozen before the stopped step, its join and
    plan), "raised" (one DataParallel, with gradient_as_bucket_view, each
    stopped step after one whose check on a held layer's weight raised on
    every rank: the step drops that backward) or "raises" (it raises in
    the stopped step, after autograd: a stop as that backward is dropped).
    Returns how many lines the step ran."""
    dp = None
    raising = [False]

    def check(p):
        if raising[0]:
            raise ValueError("gradient check failed")

    for k in itertools.count(1):
        if dp is None:
            model = copy.deepcopy(built)
            if case == "unfrozen":
                model.scale.requires_grad_(False)
            dp = DataParallel(model, k=2, bucket_cap_mb=_SWEPT_CAP,
                              gradient_as_bucket_view=case == "raised")
            checked = model.layers[0].weight.register_post_accumulate_grad_hook(check)
            if case != "first":  # (planned: "unfrozen" without scale)
                _train_step(model, torch.optim.SGD(model.parameters()), *_batch(rank, 0))
        if case == "raised":
            raising[0] = True
            with pytest.raises(ValueError, match="gradient check failed"):
                _train_step(model, torch.optim.SGD(model.parameters()), *_batch(rank, 1))
        raising[0] = case == "raises"
        try:
            stopped = _dp_stopped_step(rank, dp, twin, 2, where, k, case, raising)
        except AssertionError as e:
            raise AssertionError(f"case {case!r}, stopped before line {k}: {e}") from e
        if case in ("first", "unfrozen") or not stopped:
            checked.remove()
            dp.remove()
            assert_as_built(model, built)
            dp = None
        if not stopped:
            return k - 1


def _dp_stopped_at_any_line(rank: int, world: int) -> None:
    torch.manual_seed(0)
    built = _SweptNet()
    twin = DistributedDataParallel(copy.deepcopy(built))
    # the first backward's plan, and a join's: the lines a later step runs
    # alike are swept in "raised"
    planning = _dp_code("_before_forward", "_join_unfrozen", "_begin_backward", "_plan",
                        "_after_reduction")
    assert _dp_stopped_at_every_line(rank, built, twin, "first", planning) > 120  # 147
    assert _dp_stopped_at_every_line(rank, built, twin, "unfrozen", planning) > 150  # 174
    assert _dp_stopped_at_every_line(rank, built, twin, "raised", _dp_code()) > 280  # 312
    ending = _dp_code("_reduce", "_end_backward", "_abandon_backward", "_release_held")
    assert _dp_stopped_at_every_line(rank, built, twin, "raises", ending) > 50  # 57


@pytest.mark.parametrize("line", ["self._bucketed =", "self._bucketed_dtypes =",
                                  "self._buckets = buckets"])
def test_data_parallel_replan_stopped_at_its_end_plans_again(solo_group, line):
    """A re-plan after model.double() stopped at one of its last lines: the
    next backward plans again, and the gradients are float64 autograd's. A
    stop at the plan's last statement kept the float32 buckets in use with
    the new plan's lists (not seen as stale), and every later backward
    averaged float64 gradients in float32 (3.4e-9 off, silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    ref = copy.deepcopy(model)
    handle = DataParallel(model, k=0)
    x, t = torch.randn(8, 16), torch.randn(8, 16)
    F.mse_loss(model(x), t).backward()
    model.zero_grad()
    model.double(), ref.double()
    x, t = x.double(), t.double()
    assert interrupted_at_line(1, lambda: F.mse_loss(model(x), t).backward(), DataParallel._plan,
                               starting=line)
    model.zero_grad()
    for _ in range(2):
        F.mse_loss(model(x), t).backward()
        F.mse_loss(ref(x), t).backward()
        assert {b.flat.dtype for b in handle._buckets} == {torch.float64}
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        model.zero_grad(), ref.zero_grad()
    handle.remove()


def test_data_parallel_stopped_at_any_line_on_every_rank_trains_on():
    """A KeyboardInterrupt (a notebook's stop button) before any line of
    DataParallel's hooks (the forward's pre-hook and output watch, the
    gradients' hooks, a plan, the buckets' launch, the end of backward and
    the dropping of one that raised), the same line on every rank: after
    it grad mode is on, and training goes on as DistributedDataParallel's
    from the state left behind, bitwise, until remove() leaves the model
    as built. A stop as the buffers' broadcast ended (its `with
    torch.no_grad()` exit skipped) left grad mode off for the session; one
    in the first plan, after the buckets were stored and before the lists
    _buckets_stale reads, made every later backward raise AttributeError;
    one as a parameter unfrozen after construction joined, right before
    the old plan was dropped, left that plan in use: the parameter was
    never averaged (0.025 off DDP's gradient)."""
    _spawn(_dp_stopped_at_any_line, 2)


# Pipeline's own code (its static methods' functions too)
_PIPELINE_LINES = tuple(getattr(f, "__func__", f) for f in vars(Pipeline).values()
                        if isinstance(getattr(f, "__func__", f), types.FunctionType))


@pytest.mark.parametrize("method", ["step", "evaluate"])
def test_pipeline_stopped_at_any_line_trains_on(solo_group, method):
    """A KeyboardInterrupt (a notebook's stop button) before any line of a
    one-stage Pipeline's step() or evaluate() (4 layers, 2 micro-batches,
    fast_forward: held dW; inputs needing a gradient), its traceback kept
    as a notebook keeps the last error's: grad mode is on after it, and
    the next steps give single-process training's gradients until
    remove() leaves the layers as built."""
    built = nn.Sequential(*_blocks()[:3])
    for k in itertools.count(1):
        layers, ref = copy.deepcopy(built), copy.deepcopy(built)
        pipe = Pipeline(list(layers), micro_batches=2)
        x, t = _batch(0, 0)
        stop = LineStop(_PIPELINE_LINES, k)
        kept = []
        try:
            with stop:
                getattr(pipe, method)(x.requires_grad_(), t, F.mse_loss)
        except KeyboardInterrupt as e:
            kept.append(e)
        assert torch.is_grad_enabled(), k
        ref.load_state_dict(layers.state_dict())
        for step in range(1, 3):
            x, t = _batch(0, step)
            for net in (layers, ref):
                net.zero_grad()
            pipe.step(x, t, F.mse_loss)
            F.mse_loss(ref(x), t).backward()
            _assert_same(layers, ref, "grad", exact=False)
        pipe.remove()
        assert_as_built(layers, built)
        if not stop.stopped:
            break
    assert k > {"step": 350, "evaluate": 140}[method], k  # 387, 157



class _GradOnItsDevice(torch.autograd.Function):
    """x + 0 * w in value; w's gradient ones on w's device, whichever it is."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.shape, ctx.device = w.shape, w.device
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g, torch.ones(ctx.shape, device=ctx.device)


class _OnItsDevice(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x):
        return _GradOnItsDevice.apply(x, self.weight)


def test_data_parallel_parameter_moved_to_another_device_is_named(solo_group):
    """A parameter moved to another device after the plan, not the first of
    its bucket (whose device alone each backward checks): torch raised
    'Attempting to copy from device meta to device cpu' as the bucket
    launched, naming no parameter, at every later backward. Now the error
    names it, and the next backward plans the buckets by device again. (The
    meta device stands for a second GPU: swapped in under torch's swap
    flag, the parameter object stays the one DataParallel hooked.)"""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), _OnItsDevice())
    dp = DataParallel(model, k=0)
    x, t = _batch(0, 0)
    F.mse_loss(model(x), t).backward()
    assert dp._bucket_of[id(model[1].weight)] is dp._bucket_of[id(model[0].weight)]  # one bucket
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model[1].to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    with pytest.raises(RuntimeError, match=r"^model\.1\.weight: its gradient is on meta, its "
                                           r"bucket \(planned at an earlier backward\) on cpu"):
        F.mse_loss(model(x), t).backward()
    assert dp._buckets_stale()
    dp.remove()


class _SideOnItsDevice(nn.Module):
    """A Linear, then an _OnItsDevice used only while `use_side`."""

    def __init__(self):
        super().__init__()
        self.lin, self.side, self.use_side = nn.Linear(WIDTH, WIDTH), _OnItsDevice(), True

    def forward(self, x):
        y = self.lin(x)
        return self.side(y) if self.use_side else y


def test_data_parallel_parameter_moved_and_unused_is_named_too(solo_group):
    """The moved parameter unused in this backward (no gradient on this
    rank): it is named as where it has one, so every rank raises at the same
    bucket. It was zeroed in silence and its bucket launched: a rank that
    used it raised before launching, and the all-reduces were out of step
    (gloo aborted the process at the next collective, on 2 ranks)."""
    model = _SideOnItsDevice()
    dp = DataParallel(model, k=0)
    x, t = _batch(0, 0)
    F.mse_loss(model(x), t).backward()
    assert dp._bucket_of[id(model.side.weight)] is dp._bucket_of[id(model.lin.weight)]  # one bucket
    model.zero_grad()
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.side.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    model.use_side = False
    with pytest.raises(RuntimeError, match=r"^model\.side\.weight: it is on meta, its bucket "
                                           r"\(planned at an earlier backward\) on cpu"):
        F.mse_loss(model(x), t).backward()
    assert dp._buckets_stale()
    dp.remove()


# ---------------------------------------------------------------------------
# Mutation audit of DataParallel and Pipeline: what no test above caught
# ---------------------------------------------------------------------------


def _compare_used_only_under_no_sync(rank: int, world: int, steps: int = 3) -> None:
    """Accumulation where one rank uses the branch in its no_sync() backward
    only, and no rank in the synced backward that ends it: a use under
    no_sync() counts (DDP(find_unused_parameters=True) counts it too, since
    torch 2.4), so the branch's accumulated gradient is averaged with the
    other ranks' zeros, DDP's gradients on every rank. (Uses recorded only
    in synced backward passes left it unaveraged: that rank's own gradient,
    None on the others.) Called from _dp_branchy, in its processes."""
    torch.manual_seed(rank)
    model = _Branchy()
    ref = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    dp = data_parallel(model, k=2)
    for step in range(steps):
        for net, handle in ((ref, ref), (model, dp)):
            net.zero_grad()
            with handle.no_sync():
                x, t = _batch(rank, 10 * step)
                F.mse_loss(net(x, (rank + step) % world == 0), t).backward()
            x, t = _batch(rank, 10 * step + 1)
            F.mse_loss(net(x, False), t).backward()
        assert model.branch.weight.grad is not None, f"step {step}: branch left unaveraged"
        _assert_same(model, ref.module, "grad", world == 2)
    dp.remove()


def test_data_parallel_search_runs_the_schedule_of_each_k_it_times(solo_group):
    """k="auto": each iteration of the search runs reverse first-k for the
    k in force at its forward (the dW of layers 0 .. k-1 after backward, in
    that order), and so does the k it ends on; the search times each k's
    own schedule. A plan kept when the search moved k held the old k's
    layers (none: the first k is 0), and every k was timed running
    another's schedule, gradients unchanged."""
    torch.manual_seed(0)
    model = _Net()
    dp = DataParallel(model, k="auto", search_iters=1)
    released, release = [], dp._release_held

    def marking():
        released.append(True)
        return release()

    dp._release_held = marking
    after_backward = _recorded(dp, lambda t: t.site.index if released else None)
    seen = set()
    for step in itertools.count():
        assert step < 200, "the search for k did not end"
        searching, k = dp.searching, dp.k
        released.clear(), after_backward.clear()
        x, t = _batch(0, step)
        model.zero_grad()
        F.mse_loss(model(x), t).backward()
        assert after_backward == list(range(k)), (step, k, after_backward)
        seen.add(k)
        if not searching:
            break
    assert len(seen) > 2, seen
    dp.remove()


def _assert_allocated(pipe: Pipeline, layers: list, case: dict, rank: int) -> None:
    """The layers this rank keeps are those the paper's allocation gives its
    stage: contiguous blocks (floor(l S / L)), or modulo allocation of
    groups of `group` layers ((l // group) mod S), computed here on their
    own. (A Pipeline that dropped `group` still matched single-process
    training: every rank agreed on the wrong allocation.)"""
    n, stages = len(layers), pipe.stages
    want = [(l // case["group"]) % stages if case["allocation"] == "modulo" else l * stages // n
            for l in range(n)]
    assert list(pipe.stage_of) == want, (case, list(pipe.stage_of))
    assert pipe.layers == {l: layers[l] for l in range(n) if want[l] == rank}, (case, rank)


def test_search_k_breaks_ties_towards_the_smaller_k():
    """Equal scores pick the smaller k (fewer dW held, less memory): a flat
    score, as timings too coarse to tell the ks apart give, keeps k = 0,
    and a plateau its first k. The core's tie-break had no test: taking the
    larger k instead held every layer on a flat score."""
    assert ooo.search_k(20, lambda k: 1.0)[0] == 0
    assert ooo.search_k(20, lambda k: float(min(k, 6)))[0] == 6


def _check_different_buffers(rank: int, world: int) -> None:
    """The same parameters on every rank, but a norm layer without affine
    parameters of another width on rank 1 (its buffers alone differ): the
    ValueError on every rank that models differing in their parameters get,
    before any buffer is broadcast (_check_different_models' models all
    differ in a parameter too, so a check of the parameters alone passed
    them). Called from _dp_edge_cases, in its processes."""
    norm = nn.BatchNorm1d(WIDTH + (rank == 1), affine=False)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), norm)
    with pytest.raises(ValueError, match="^model: .*every rank must build the same model"):
        data_parallel(model, k=0)
    assert all("forward" not in m.__dict__ for m in model.modules()), "split left behind"


def test_pipeline_steps_and_evaluations_of_one_input_keep_their_programs(solo_group):
    """step(), evaluate(), step() on the same batch (an input that needs no
    gradient, so both ask for the same input_grad): each runs its own
    program, cached apart: single-process gradients in each step (accumulated
    over both), the forwards' loss in the evaluation, which leaves .grad as
    it was. A program cached by input_grad alone gave the evaluation the
    training program (a backward under no_grad), or the step the forwards
    alone (no gradient)."""
    ref_layers = _blocks()
    ref = nn.Sequential(*ref_layers)
    pipe = Pipeline(_blocks(), micro_batches=2)
    x, t = _batch(0, 0)
    for i in range(2):
        F.mse_loss(ref(x), t).backward()
        pipe.step(x, t, F.mse_loss)
        _assert_pipeline_grads(pipe, ref_layers, f"step {i}")
        if i == 0:
            before = [p.grad.clone() for p in pipe.parameters()]
            with torch.no_grad():
                want = F.mse_loss(ref(x), t)
            torch.testing.assert_close(pipe.evaluate(x, t, F.mse_loss), want, rtol=1e-6, atol=0)
            assert all(torch.equal(p.grad, b) for p, b in zip(pipe.parameters(), before))
    pipe.remove()


# ---------------------------------------------------------------------------
# Mutation audit of the distributed half of ooo.py (session 43): each test
# below kills mutants of DataParallel / Pipeline that the tests above let live
# ---------------------------------------------------------------------------


def _check_group_without_rank_0(rank: int, world: int) -> None:
    """A group of global ranks 1 and 2 (its rank 0 is global rank 1): the
    search for k broadcasts its decision from the group's rank 0, which
    collectives name by its global rank, and a Pipeline sends to its
    stages' global ranks. Gradients and parameters are DDP's on the same
    group (bitwise, 2 ranks), every step of the search, and the pipeline's
    single-process training's. Global rank 0 takes no part."""
    assert world == 3
    group = dist.new_group([1, 2])
    if rank == 0:
        return
    torch.manual_seed(rank)
    model = _Net()
    ref = DistributedDataParallel(copy.deepcopy(model), process_group=group)
    dp = data_parallel(model, process_group=group, k="auto", search_iters=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(100):
        x, t = _batch(rank, step)
        _train_step(ref, ref_opt, x, t)
        _train_step(model, opt, x, t)
        _assert_same(model, ref.module, "grad")
        ref_opt.step()
        opt.step()
        _assert_same(model, ref.module, "parameter")
        if not dp.searching:
            break
    assert not dp.searching, "the search for k did not end in 100 iterations"
    ks = [None] * 2
    dist.all_gather_object(ks, dp.k, group=group)
    assert ks[0] == ks[1], f"ranks chose different k: {ks}"
    dp.remove()
    ref_layers = _blocks()
    pipe = Pipeline(_blocks(), micro_batches=2, process_group=group)
    assert list(pipe.stage_of) == [0] * 4 + [1] * 4
    x, t = _batch(0, 0)
    F.mse_loss(nn.Sequential(*ref_layers)(x), t).backward()
    loss = pipe.step(x, t, F.mse_loss)
    assert (loss is not None) == (rank == 2)
    _assert_pipeline_grads(pipe, ref_layers, f"rank {rank}")
    pipe.remove()


def test_data_parallel_and_pipeline_on_a_group_without_global_rank_0():
    """Mutants killed: the search's broadcast naming the group's rank 0 as
    global rank 0 (_global_rank ignoring the group), a Pipeline sending to
    group ranks as if global ones. The group of ranks 0 and 1 that
    test_parallel_edge_cases uses maps each rank to itself, so neither showed."""
    _spawn(_check_group_without_rank_0, 3, timeout=30)


def _compare_nested_no_sync(rank: int, world: int) -> None:
    """no_sync() inside no_sync(): leaving the inner one keeps the outer's
    local accumulation, as DDP's (which restores the flag it found): a
    backward between the two exits stays local, the one after both averages
    the sum. The inner exit set the flag to True, and that backward was
    averaged (the sum then averaged twice: gradients off DDP's)."""
    torch.manual_seed(rank)
    model = _Net()
    ref = DistributedDataParallel(copy.deepcopy(model))
    dp = data_parallel(model, k=2)
    for net, handle in ((ref, ref), (model, dp)):
        with handle.no_sync():
            with handle.no_sync():
                F.mse_loss(net(_batch(rank, 0)[0]), _batch(rank, 0)[1]).backward()
            F.mse_loss(net(_batch(rank, 1)[0]), _batch(rank, 1)[1]).backward()
        F.mse_loss(net(_batch(rank, 2)[0]), _batch(rank, 2)[1]).backward()
    _assert_same(model, ref.module, "grad")
    dp.remove()


def test_data_parallel_nested_no_sync_stays_local_as_ddp():
    """Mutant killed: no_sync() restoring True instead of the state it found."""
    _spawn(_compare_nested_no_sync, 2)


def test_data_parallel_bucket_holds_a_run_of_exactly_its_cap(solo_group):
    """A run of parameters exactly `bucket_cap_mb` in size fills one bucket
    (the cap is "at most"): with a cap of one Linear's weight and bias, each
    bucket is one layer's, in reverse forward order. Mutant killed: the
    cap compared with >= (each layer's weight and bias in buckets apart)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(3)))
    ref = copy.deepcopy(model)
    one_layer = (WIDTH * WIDTH + WIDTH) * 4 / 2 ** 20
    dp = DataParallel(model, k=0, bucket_cap_mb=one_layer)
    x, t = _batch(0, 0)
    for net in (model, ref):
        F.mse_loss(net(x), t).backward()
    _assert_same(model, ref, "grad")
    assert [list(map(id, b.params)) for b in dp._buckets] == \
        [[id(m.weight), id(m.bias)] for m in reversed(model)]
    dp.remove()


def test_pipeline_sends_a_slice_with_gaps_in_memory_order():
    """The distinct elements of a span with gaps travel in memory order
    (largest stride first), as the note on messages says: reads and writes
    then run forward through memory on both ends. Mutant killed: the dims
    sorted smallest stride first (the same values arrive, both ends agreeing,
    read and written backwards through memory)."""
    x = torch.randn(4, 6, 5)
    for t in (x[:, ::2], x.transpose(0, 2)[:, :3]):
        layout = _Layout.of_tensor(t)
        assert layout.sent < layout.span, t.stride()
        by_address = t.permute(sorted(range(t.dim()), key=t.stride().__getitem__, reverse=True))
        assert torch.equal(layout.wire(t).reshape(-1), by_address.reshape(-1)), t.stride()


class _Writes(TorchDispatchMode):
    """Counts the elements that the torch ops run under it write: an in-place
    op's (copy_) first argument, another op's outputs (cat, clone), views
    and fresh empty tensors aside."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable:
            self.elements += args[0].numel()
        elif not func.is_view and func.overloadpacket not in (torch.ops.aten.empty,
                                                              torch.ops.aten.empty_strided):
            self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def test_pipeline_writes_a_gradient_into_its_message_in_one_copy(solo_group):
    """A gradient's message, its data in memory order then the flag 1, is
    written in one copy of the data: where its layout has gaps (a slice of
    every other column) the distinct elements go straight into the message.
    They were copied twice, first into a buffer of their own (2 * 16384 + 1
    elements written, not 16384 + 1: another 64 KiB allocated, read and
    written per send of this 64 KiB gradient). Contiguous and transposed
    ones were one copy already."""
    pipe = Pipeline([nn.Linear(4, 4), nn.Linear(4, 4)], micro_batches=1)
    messages = []
    pipe._send = lambda st, t, stage: messages.append(t)
    for g in (torch.randn(64, 512)[:, ::2], torch.randn(64, 256), torch.randn(256, 64).t()):
        layout = _Layout.of_tensor(g)
        st = types.SimpleNamespace(headers={(ooo._ACTIVATION, 0, 0): (layout, True)})
        pipe._send_gradient(st, g, 0, 0, 1)  # the gradient's header, then its message
        assert st.headers[(ooo._GRADIENT, 0, 0)] == layout and len(messages) == 2
        with _Writes() as writes:
            pipe._send_gradient(st, g, 0, 0, 1)
        by_address = g.permute(sorted(range(g.dim()), key=g.stride().__getitem__, reverse=True))
        assert torch.equal(messages[-1], torch.cat((by_address.reshape(-1), torch.ones(1))))
        assert writes.elements == g.numel() + 1, (g.stride(), writes.elements)
        messages.clear()
    pipe.remove()


def _check_pipeline_agreement_and_kept_headers(rank: int, world: int) -> None:
    """costs that differ in their transfer time alone are refused as any
    other cost (it orders the tasks too); and the headers kept are those of
    the last _KEPT_INPUTS input shapes used: shape 1 seen again after
    _KEPT_INPUTS others sends its headers anew (as many messages as its
    first step), the shape used last does not."""
    with pytest.raises(ValueError, match=r"^costs: differs between the ranks \(rank 0 vs rank 1\)"):
        Pipeline(_blocks(), micro_batches=2, costs=dict(transfer=0.1 * (1 + rank)))
    pipe = Pipeline(_blocks(), micro_batches=1, allocation="modulo")
    x, t = torch.randn(ooo._KEPT_INPUTS + 1, WIDTH), torch.randn(ooo._KEPT_INPUTS + 1, WIDTH)
    messages = {}
    shapes = list(range(1, ooo._KEPT_INPUTS + 2))
    for rows in shapes + [shapes[0], shapes[0]]:
        pipe.step(x[:rows], t[:rows], F.mse_loss)
        messages.setdefault(rows, []).append(pipe.messages)
    first, again, kept = messages[shapes[0]]
    assert again == first > kept, (rank, messages)
    pipe.remove()


def test_pipeline_costs_and_kept_headers_agree_on_every_rank():
    """Mutants killed: the costs' digest without the transfer time (ranks
    with different transfer times ran different programs unrefused); the
    most recently used headers dropped in place of the least (a shape seen
    again after _KEPT_INPUTS others was sent without headers: no error, the
    two ends agree, but not the documented least-recently-used rule)."""
    _spawn(_check_pipeline_agreement_and_kept_headers, 2, timeout=30)


def _check_first_call_ties_in_module_order(rank: int, world: int) -> None:
    """Rank 0 calls `branch` second, rank 1 calls `b` second: both have
    first-call index 1 over the ranks, a tie broken in the model's module
    order (b is registered before branch), so k = 2 holds a and b on every
    rank; the gradients are DDP(find_unused_parameters=True)'s."""
    torch.manual_seed(rank)
    model = _Branchy()
    ref = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    dp = data_parallel(model, k=2)
    x, t = _batch(rank, 0)
    for net in (ref, model):
        F.mse_loss(net(x, rank == 0), t).backward()
    _assert_same(model, ref.module, "grad")
    assert dp._held_modules == {model.a, model.b}, rank
    dp.remove()


def test_data_parallel_breaks_first_call_ties_in_module_order():
    """Mutant killed: ties of the first-call order broken against the module
    order (the same on every rank, so the gradients stayed DDP's: only the
    layers held differed from the documented rule)."""
    _spawn(_check_first_call_ties_in_module_order, 2)


def test_pipeline_keeps_the_strides_of_overlapping_windows_spanning_their_element_count():
    """Windows that overlap (not apart) and span exactly as many elements as
    they hold travel as their span, with their strides (the note on
    messages: "where their span holds at most the elements"), and are
    rebuilt with them. Mutant killed: span < numel in place of <=, which
    sent them contiguous (strides (4, 2, 1))."""
    t = torch.randn(20).as_strided((2, 2, 2), (5, 1, 1))
    layout = _Layout.of_tensor(t)
    assert (layout.span, layout.sent, layout.strides, layout.contiguous) == (8, 8, (5, 1, 1), False)
    received = layout.rebuilt(layout.wire(t).reshape(-1).clone())
    assert torch.equal(received, t) and received.stride() == t.stride()


# ---------------------------------------------------------------------------
# Session-44 leftovers of the ooo.py mutation audits: each test below fails on
# a mutant of ooo.py that the session-43 audits left alive.
# ---------------------------------------------------------------------------


def _dp_one_rank_converts_beside_zero_gradients(rank: int, world: int, converting: int) -> None:
    torch.manual_seed(0)
    model = _TwoLinear()
    DataParallel(model, k=0)
    model(torch.ones(4, 2)).sum().backward()
    if rank == converting:
        model.a.double()
    model.zero_grad()
    if rank != converting:  # its bucket: zero gradients, then the flags (1.0)
        (0.0 * model(torch.zeros(4, 2)).sum()).backward()
        return
    with pytest.raises(RuntimeError, match="collectives are out of step.*on every rank"):
        model(torch.ones(4, 2)).sum().backward()


@pytest.mark.parametrize("converting", [0, 1])
def test_data_parallel_model_converted_on_one_rank_beside_zero_gradients_raises_clearly(converting):
    """As test_data_parallel_model_converted_on_one_rank_only_raises_clearly,
    the peer's bucket zero gradients and its flags (1.0). Rank 0 converted:
    paired with them, its agreement's first-call indices and settings stay
    valid numbers; only the last slot, which every rank sends as -0.5,
    comes back other (the flags added to it). Without that check rank 0
    went on with the garbage and its next collective met the peer's
    barrier. Rank 1 converted: its +inf for rank 0's settings came back
    (zeros added), its indices and mark intact, and it raised
    OverflowError: cannot convert float infinity to integer (a bug until
    session 44: _check_agreed now checks that rank 0's counts came)."""
    _spawn(_dp_one_rank_converts_beside_zero_gradients, 2, converting, timeout=30)



def _check_shared_weight_hooks_see_whole_micro_batches(rank: int, world: int) -> None:
    """See the test below: layers 1 and 3 (a weight tied) on rank 1."""
    def seen_by_hooks(layers, train_step) -> list:
        seen: list = []
        layers[1].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        train_step()
        return seen

    x, t = _batch(0, 0)
    ref = nn.Sequential(*_sharing_layers("tied", False))
    after_each = seen_by_hooks(ref, lambda: [  # micro-batched torch: one call per micro-batch
        (F.mse_loss(ref(xm), tm) / 2).backward() for xm, tm in zip(x.chunk(2), t.chunk(2))])
    local = _sharing_layers("tied", False)
    pipe = Pipeline(local, micro_batches=2, schedule="fast_forward", allocation="modulo",
                    costs=dict(out_grad=[1.0, 1.0, 2.0, 1.0], transfer=2.0))
    got = seen_by_hooks(local, lambda: pipe.step(x, t, F.mse_loss))
    pipe.remove()
    if rank == 1:
        program = [task[:3] for task in pipe._schedule(False)[0] if task[0] != ooo._FORWARD]
        assert program.index((ooo._WEIGHT_GRAD, 3, 1)) < program.index((ooo._WEIGHT_GRAD, 1, 0)) \
            < program.index((ooo._OUTPUT_GRAD, 1, 1))
        assert len(got) == 1, [g.sum().item() for g in got]
        torch.testing.assert_close(got[0], after_each[-1], rtol=1e-6, atol=1e-7)


def test_pipeline_runs_a_shared_weights_dw_after_every_use_in_its_own_micro_batch():
    """A weight tied between layers 1 and 3 of rank 1, 2 micro-batches,
    "fast_forward" with costs under which rank 1 runs dW(3, 0), dW(3, 1),
    dO(1, 0), dW(1, 0), then dO(1, 1): dW(3, 1) waits for layer 1's
    backward of micro-batch 1, not 0. Released at dW(1, 0), every dW made
    so far had run and the weight's hooks fired there on a gradient
    missing layer 1's part of micro-batch 1 (no sum of whole micro-batches),
    then again at the end; now once, on the step's gradient."""
    _spawn(_check_shared_weight_hooks_see_whole_micro_batches, 2)


class _ExpandedMean(nn.Module):
    """A Linear whose output is its mean over the batch, expanded back to
    the batch (strides (0, 1): one row of memory)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = self.lin(x)
        return y.mean(0, keepdim=True).expand_as(y)


class _DetachedWhile(nn.Module):
    """A Linear that detaches its input while `stop` is set."""

    def __init__(self):
        super().__init__()
        self.lin, self.stop = nn.Linear(WIDTH, WIDTH), True

    def forward(self, x):
        return self.lin(x.detach() if self.stop else x)


def _check_gradient_header_of_an_expanded_activation(rank: int, world: int) -> None:
    """See the test below: layer 0 on rank 0, layer 1 on rank 1."""
    x, t = _batch(0, 0)
    torch.manual_seed(0)
    ref = nn.Sequential(_ExpandedMean(), _DetachedWhile())
    layers = list(copy.deepcopy(ref))
    pipe = Pipeline(layers, micro_batches=1)
    for stop in (True, False):  # no gradient to send back, then one: the same headers
        ref[1].stop = layers[1].stop = stop
        ref.zero_grad()
        F.mse_loss(ref(x), t).backward()
        for layer in layers:
            layer.zero_grad()
        pipe.step(x, t, F.mse_loss)
    for (name, got), want in zip(layers[rank].named_parameters(), ref[rank].parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7, msg=name)
    pipe.remove()


def test_pipeline_sends_no_gradient_of_an_expanded_activation_in_a_contiguous_header():
    """An activation expanded over the batch (stride 0) whose gradient the
    next stage first has none of (its layer detaches it): the gradient's
    header, kept for the later steps, describes it contiguous, since a real
    gradient of it later has memory of its own. Made with the activation's
    strides, the next step's gradient met an expanded kept layout and the
    sender raised ("changed its strides ... (expanded)"), its peer waiting."""
    _spawn(_check_gradient_header_of_an_expanded_activation, 2, timeout=30)
