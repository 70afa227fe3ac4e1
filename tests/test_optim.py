"""Tests for reprop.optim, the fused multi-tensor optimizers.

Golden reference: torch.optim in the same process. On CPU torch's default
(foreach=None) is the single-tensor for-loop implementation; on CUDA it is the
foreach implementation. Two kinds of runs are compared:

* closed loop (`train_model`): a small Conv/Linear/LayerNorm model trained on
  identical synthetic batches, so the gradients depend on the parameters and
  any difference feeds back into later steps;
* open loop (`run_open_loop`): parameters of chosen shapes fed a fixed
  sequence of gradients, for edge shapes, dtypes, NaN/inf, layouts and the
  per-parameter API, where the result must not depend on the model.

Both return a `Run` (parameters + optimizer) and are compared with
`assert_runs_close`, which checks every parameter, the state keys of every
parameter (exactly torch's), the dtype/shape/device of every state tensor, the
step counters (exactly) and the state values.
"""
from __future__ import annotations

import copy
import gc
import inspect
import io
import itertools
import os
import platform
import re
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

import reprop.optim as rp
from reprop._native import _C

from _interrupts import KernelsThenStop, LineStop
from _optim_options import RICH
from _scripts import script_output
from _threads import torch_threads

NAMES = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta")
CAPTURABLE_NAMES = ("Adam", "AdamW", "RMSprop", "Adadelta")  # torch classes with `capturable`
FUSED_KWARG_NAMES = ("SGD", "Adam", "AdamW", "Adagrad")  # torch classes with `fused`


def torch_cls(name: str) -> type[torch.optim.Optimizer]:
    return getattr(torch.optim, name)


def reprop_cls(name: str) -> type[torch.optim.Optimizer]:
    return getattr(rp, name)


# ---------------------------------------------------------------------------
# Tolerances
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Tol:
    """|actual - expected| <= atol * scale + rtol * |expected|, elementwise.

    `scale` is the largest finite magnitude of the quantity compared: over all
    parameters for parameters, over all parameters' state[key] for a state
    key. So one tolerance serves parameters (~1e-1), Adam's second moments
    (~1e-6) and Adagrad's sums (~1e1) alike, and an element that came out of a
    cancellation (0.9 * buf - g ~ 0) is judged by the size of its operands.
    Non-finite values must match exactly.
    """

    rtol: float
    atol: float


# Bitwise equality with torch is impossible: torch's CPU sqrt is not correctly
# rounded (one ulp off in about one element in six), and reprop's is. Every
# other op rounds as torch's does, fused multiply-adds included (see
# test_mul_addcmul_state_is_torchs_bitwise and its neighbours), so what no
# square root reaches is torch's bit for bit. One step from identical
# inputs therefore differs by a few fp32 ulp, which STEP_TOL (the starting
# tolerance) covers. The numbers below are worst cases over every test that
# uses a tolerance, as multiples of STEP_TOL, measured on CPU with the reprop
# build and with an independent implementation that does its math in float64
# (so it rounds differently from torch everywhere). Single steps: 0.5x.
STEP_TOL = Tol(rtol=1e-6, atol=1e-7)

# Open loop (fixed gradients, up to 50 steps): rounding differences accumulate
# in the state (momentum buffers, moments) but are not amplified. Observed:
# 1.3x (reprop, Adadelta over the 50-step grid), 1.8x (float64 implementation,
# RMSprop momentum_buffer). Tolerance 5x.
OPEN_LOOP_TOL = Tol(rtol=5e-6, atol=5e-7)

# Closed loop (training SmallNet for 50 steps): a difference of one ulp in a
# parameter changes the next gradients, and optimizers that normalize each
# element (Adagrad, RMSprop, Adadelta, Adam) turn a tiny absolute change of a
# near-zero gradient element into a relative change of its update, so
# differences grow with the number of steps. Worst observed over the option
# grid (reprop / float64 implementation): SGD 11 / 11, Adam 3.2 / 1.9,
# AdamW 3.2 / 4.5, Adagrad 1.8 / 8.7, RMSprop 5.1 / 6.3, Adadelta 21 / 13.
# Tolerances are ~3x the larger. A wrong formula (a sign, the bias
# correction, a missing term) is off by 1e-3 or more after a few steps.
TRAIN_TOL = {
    "SGD": Tol(rtol=3e-5, atol=3e-6),
    "Adam": Tol(rtol=1.5e-5, atol=1.5e-6),
    "AdamW": Tol(rtol=1.5e-5, atol=1.5e-6),
    "Adagrad": Tol(rtol=3e-5, atol=3e-6),
    "RMSprop": Tol(rtol=2e-5, atol=2e-6),
    "Adadelta": Tol(rtol=6e-5, atol=6e-6),
}


def _torch_fuses_multiply_adds() -> bool:
    """Whether this torch's CPU kernels round addcmul (like add(alpha=) and
    lerp) once, with FMA, as its AVX2 and AVX-512 kernels do and reprop does:
    inf - 1e28 * 1e28 is then inf, where the product rounded on its own
    overflows and gives NaN, as in torch's baseline x86 kernels
    (ATEN_CPU_CAPABILITY=default), which reprop does not follow."""
    big = torch.tensor([1e28])
    return torch.tensor([float("inf")]).addcmul(big, big, value=-1).item() == float("inf")


TORCH_FUSES_MULTIPLY_ADDS = _torch_fuses_multiply_adds()
NO_TORCH_FMA = "this torch's CPU kernels round the product of a multiply-add on its own"


def _finite_scale(expected: torch.Tensor) -> float:
    finite = expected[torch.isfinite(expected)]
    return finite.abs().max().item() if finite.numel() else 0.0


def assert_tensor_close(
    actual: torch.Tensor, expected: torch.Tensor, tol: Tol, what: str, *, scale: float | None = None
) -> None:
    """Same shape and dtype; same NaN and +-inf positions; finite values within
    `tol`, with atol relative to `scale` (default: max|expected|)."""
    assert isinstance(actual, torch.Tensor), f"{what}: expected a tensor, got {type(actual)}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    nan_a, nan_e = a.isnan(), e.isnan()
    assert torch.equal(nan_a, nan_e), (
        f"{what}: NaN positions differ: actual {nan_a.nonzero().flatten().tolist()[:20]} "
        f"expected {nan_e.nonzero().flatten().tolist()[:20]}"
    )
    inf_a, inf_e = a.isinf(), e.isinf()
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), f"{what}: infinities differ"
    finite = torch.isfinite(e)
    if not finite.any():
        return
    a, e = a[finite], e[finite]
    scale = _finite_scale(e) if scale is None else scale
    err = (a - e).abs()
    allowed = tol.atol * scale + tol.rtol * e.abs()
    bad = err > allowed
    if bad.any():
        i = (err - allowed).argmax().item()
        pytest.fail(
            f"{what}: {int(bad.sum())}/{e.numel()} elements outside {tol}; worst at flat index {i}: "
            f"actual {a[i].item()!r} expected {e[i].item()!r} (max error / scale = "
            f"{(err.max() / scale).item() if scale else err.max().item():.3g})"
        )


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place between two 16-bit float tensors."""
    assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.detach().cpu().contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)  # sign-magnitude -> ordered ints

    return (ordered(a) - ordered(b)).abs()


# ---------------------------------------------------------------------------
# Runs: closed loop (a model) and open loop (fixed gradient sequences)
# ---------------------------------------------------------------------------

OptFactory = Callable[[list], torch.optim.Optimizer]


@dataclass
class Run:
    params: list[torch.Tensor]
    opt: torch.optim.Optimizer
    model: nn.Module | None = None
    lrs: list[list[float]] = field(default_factory=list)  # per step, per group (schedulers)


def factory(cls: type[torch.optim.Optimizer], **options) -> OptFactory:
    return lambda groups: cls(groups, **options)


def split_groups(params: Sequence[torch.Tensor], group1: dict | None) -> list:
    """Two parameter groups: the first half with the optimizer's defaults and the
    second half with the overrides in `group1`; one plain list when it is None."""
    params = list(params)
    if group1 is None:
        return params
    half = (len(params) + 1) // 2
    return [{"params": params[:half]}, {"params": params[half:], **group1}]


def group1_overrides(name: str, options: dict) -> dict:
    """Hyper-parameters of the second group: a different lr and weight decay
    (and betas for Adam), so that using group 0's values everywhere fails."""
    out = {"lr": options["lr"] * 0.5, "weight_decay": 2 * options.get("weight_decay", 0)}
    if name in ("Adam", "AdamW"):
        out["betas"] = (0.8, 0.99)
    return out


class SmallNet(nn.Module):
    """Conv2d -> tanh -> Linear -> LayerNorm -> tanh -> Linear, ~2.5K parameters.

    x is (B, 3, 6, 6), the output (B, 3). Parameter sizes 108, 4, 2304, 16, 16,
    16, 48, 3 exercise vector bodies and tails; three parameters share the
    shape (16,) so that state shared between parameters shows up.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 6 * 6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def make_model(*, seed: int = 0, device: str = "cpu", channels_last: bool = False) -> SmallNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SmallNet()
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def make_batches(steps: int, *, seed: int = 1, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 3, 6, 6, generator=gen).to(device), torch.randn(4, 3, generator=gen).to(device))
        for _ in range(steps)
    ]


def train_model(
    make_opt: OptFactory,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    group1: dict | None = None,
    model: nn.Module | None = None,
    opt: torch.optim.Optimizer | None = None,
    maximize: bool = False,
    use_closure: bool = False,
    scheduler: Callable[[torch.optim.Optimizer], object] | None = None,
    channels_last: bool = False,
) -> Run:
    """Train a SmallNet (a fresh one unless `model`/`opt` continue a run) on `batches`.

    With `maximize` the loss is negated, so gradient *ascent* still minimizes
    the MSE and the dynamics stay tame (a wrong sign still diverges at once).
    """
    if model is None:
        model = make_model(channels_last=channels_last, device=batches[0][0].device.type)
    if opt is None:
        opt = make_opt(split_groups(list(model.parameters()), group1))
    sched = scheduler(opt) if scheduler is not None else None
    sign = -1.0 if maximize else 1.0
    run = Run(list(model.parameters()), opt, model)
    for x, y in batches:
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = sign * F.mse_loss(model(x), y)
            loss.backward()
            return loss

        if use_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()
        if sched is not None:
            sched.step()
        run.lrs.append([g["lr"] for g in opt.param_groups])
    return run


def make_params(
    shapes: Sequence[tuple[int, ...]], *, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[torch.Tensor]:
    """Initial parameter values, uniform in [-1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(s, generator=gen) * 2 - 1).to(device=device, dtype=dtype) for s in shapes]


def grad_sequence(
    shapes: Sequence[tuple[int, ...]],
    steps: int,
    *,
    seed: int = 7,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> list[list[torch.Tensor]]:
    """`steps` lists of gradients for `shapes`: random signs, magnitudes uniform
    in [0.05, 0.5].

    Bounded away from zero on purpose: with parameters in [-1, 1] and weight
    decay <= 0.02, g + weight_decay * p cannot cancel. Where it nearly cancels,
    the eps-normalized updates (Adam, RMSprop: G / (|G| + eps)) turn the
    last-bit difference of computing that sum (with FMA or without) into a
    relative difference of 1e-4 or more in a handful of elements of a large
    tensor, which says nothing about the implementation. Natural gradients are
    covered by the training tests, tiny and zero ones by tests of their own.
    """
    out = []
    for k in range(steps):
        gen = torch.Generator().manual_seed(seed + 1000 * k)
        step = []
        for s in shapes:
            magnitude = 0.05 + 0.45 * torch.rand(s, generator=gen)
            sign = torch.where(torch.rand(s, generator=gen) < 0.5, -1.0, 1.0)
            step.append((sign * magnitude).to(device=device, dtype=dtype))
        out.append(step)
    return out


def run_open_loop(
    make_opt: OptFactory,
    init: Sequence[torch.Tensor],
    grads: Sequence[Sequence[torch.Tensor | None]],
    *,
    group1: dict | None = None,
    make_param: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> Run:
    """Copies of `init` (passed through `make_param`, e.g. to change the
    layout) as parameters, stepped once per entry of `grads` with p.grad set to
    (a copy of) the given gradient, or None."""
    params = [nn.Parameter(make_param(t.clone())) for t in init]
    opt = make_opt(split_groups(params, group1))
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else clone_exact(g)
        opt.step()
    return Run(params, opt)


def clone_exact(t: torch.Tensor) -> torch.Tensor:
    """A copy with exactly t's strides, also where they have gaps (which
    Tensor.clone() would make contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def assert_runs_close(got: Run, ref: Run, tol: Tol, *, state_tol: Tol | None = None) -> None:
    """Parameters close; per parameter exactly torch's state keys, in its
    order; state tensors float32 with the reference's shape and device and
    close values; step counters exactly equal float32 0-dim tensors on the
    reference's device."""
    state_tol = state_tol or tol
    assert len(got.params) == len(ref.params)
    ref_states = [ref.opt.state.get(p, {}) for p in ref.params]
    scales = {None: params_scale(ref)}
    for st in ref_states:
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and key != "step":
                scales[key] = max(scales.get(key, 0.0), _finite_scale(v.detach().float()))
    for i, (pg, pr, sr) in enumerate(zip(got.params, ref.params, ref_states)):
        assert pg.dtype == pr.dtype and pg.device == pr.device, f"param {i}: dtype/device changed"
        assert_tensor_close(pg, pr, tol, f"param {i} {tuple(pr.shape)}", scale=scales[None])
        sg = got.opt.state.get(pg, {})
        assert list(sg) == list(sr), f"param {i}: state keys {list(sg)} != torch's {list(sr)}"
        for key, vr in sr.items():
            vg, what = sg[key], f"param {i} {tuple(pr.shape)} state[{key!r}]"
            if vr is None:
                assert vg is None, f"{what}: torch stores None"
            elif key == "step":
                assert isinstance(vg, torch.Tensor) and vg.dtype == torch.float32 and vg.dim() == 0, (
                    f"{what}: expected a float32 0-dim tensor, got {vg!r}"
                )
                assert vg.device == vr.device, f"{what}: on {vg.device}, torch keeps it on {vr.device}"
                assert vg.item() == vr.item(), f"{what}: {vg.item()} != torch's {vr.item()}"
            else:
                assert vg.dtype == torch.float32, f"{what}: state must be float32, is {vg.dtype}"
                assert vg.device == pg.device, f"{what}: on {vg.device}, param on {pg.device}"
                assert_tensor_close(vg, vr.float(), state_tol, what, scale=scales[key])


def params_scale(run: Run) -> float:
    """The `scale` of assert_runs_close's parameter comparisons with `run`
    as the reference: its largest finite parameter magnitude."""
    return max((_finite_scale(p.detach().float()) for p in run.params), default=0.0)


def assert_runs_equal(a: Run, b: Run) -> None:
    """Bitwise-identical parameters and state (same implementation, same inputs)."""
    assert_runs_close(a, b, Tol(0.0, 0.0))


# ---------------------------------------------------------------------------
# Option grids
# ---------------------------------------------------------------------------

BASE = {
    "SGD": {"lr": 0.05},
    "Adam": {"lr": 1e-2},
    "AdamW": {"lr": 1e-2},
    "Adagrad": {"lr": 0.05},
    "RMSprop": {"lr": 1e-3},
    "Adadelta": {"lr": 1.0},
}

AXES = {
    "SGD": {
        "momentum": [0, 0.9],
        "dampening": [0, 0.1],
        "nesterov": [False, True],
        "weight_decay": [0, 0.01],
        "maximize": [False, True],
    },
    "Adam": {"amsgrad": [False, True], "maximize": [False, True], "weight_decay": [0, 0.01]},
    "AdamW": {"amsgrad": [False, True], "maximize": [False, True], "weight_decay": [0, 0.01]},
    "Adagrad": {
        "lr_decay": [0, 0.01],
        "weight_decay": [0, 0.01],
        "initial_accumulator_value": [0, 0.1],
        "eps": [1e-10, 1e-3],
    },
    "RMSprop": {"momentum": [0, 0.9], "centered": [False, True], "weight_decay": [0, 0.01], "alpha": [0.99, 0.9]},
    "Adadelta": {"rho": [0.9, 0.5], "eps": [1e-6, 1e-3], "weight_decay": [0, 0.01], "maximize": [False, True]},
}

def _valid(name: str, options: dict) -> bool:
    # torch: "Nesterov momentum requires a momentum and zero dampening"
    return not (name == "SGD" and options.get("nesterov") and (options["momentum"] <= 0 or options["dampening"] != 0))


def _grid() -> Iterable:
    for name in NAMES:
        keys = list(AXES[name])
        for values in itertools.product(*(AXES[name][k] for k in keys)):
            options = {**BASE[name], **dict(zip(keys, values))}
            if _valid(name, options):
                ident = "-".join(f"{k}={v}" for k, v in zip(keys, values))
                yield pytest.param(name, options, id=f"{name}-{ident}")


GRID = list(_grid())
TRAIN_STEPS = 50


@pytest.fixture(scope="module", autouse=True)
def single_intra_op_thread():
    """Run this module's torch ops on one thread. The tensors are tiny, so
    intra-op threads are pure overhead, and on a loaded 2-core machine OpenMP
    barriers made a 50-step run 80x slower (6 s instead of 0.08 s). The thread
    count reprop is given is exercised by test_thread_count_does_not_change_results."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_batches(TRAIN_STEPS)


def train_pair(name: str, options: dict, batches, **kw) -> tuple[Run, Run]:
    """The same training with reprop and with torch; returns (reprop, torch)."""
    group1 = kw.pop("group1", group1_overrides(name, options))
    maximize = options.get("maximize", False)
    got = train_model(factory(reprop_cls(name), **options), batches, group1=group1, maximize=maximize, **kw)
    ref = train_model(factory(torch_cls(name), **options), batches, group1=group1, maximize=maximize, **kw)
    return got, ref


# ---------------------------------------------------------------------------
# 1. Parity with torch over the option grid
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, options", GRID)
def test_training_matches_torch(name: str, options: dict, batches) -> None:
    got, ref = train_pair(name, options, batches)
    assert_runs_close(got, ref, TRAIN_TOL[name])


@pytest.mark.parametrize("name, options", GRID)
def test_option_grid_open_loop_matches_torch(name: str, options: dict) -> None:
    """The SmallNet parameter shapes fed 50 fixed gradients: no feedback through
    the model, so a much tighter tolerance than training."""
    shapes = [tuple(p.shape) for p in make_model().parameters()]
    init, grads = make_params(shapes, seed=2), grad_sequence(shapes, TRAIN_STEPS)
    group1 = group1_overrides(name, options)
    got = run_open_loop(factory(reprop_cls(name), **options), init, grads, group1=group1)
    ref = run_open_loop(factory(torch_cls(name), **options), init, grads, group1=group1)
    assert_runs_close(got, ref, OPEN_LOOP_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_single_steps_match_torch_tightly(name: str) -> None:
    """Two steps from identical inputs, two groups: the starting tolerance holds."""
    shapes = [(5, 7), (33,), (16,), (16,), (9,)]
    init, grads = make_params(shapes, seed=3), grad_sequence(shapes, 2)
    group1 = group1_overrides(name, RICH[name])
    got = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads, group1=group1)
    ref = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads, group1=group1)
    assert_runs_close(got, ref, STEP_TOL)


# State that torch computes from the gradients alone with mul and addcmul (no
# weight decay, no square root: torch's CPU sqrt is not correctly rounded), over
# sizes that fill vector bodies and scalar tails in both libraries.
MUL_ADDCMUL_STATE = {
    "Adam": ({"lr": 1e-2}, ["exp_avg_sq"]),
    "Adagrad": ({"lr": 0.05, "initial_accumulator_value": 0.1}, ["sum"]),
    "RMSprop": ({"lr": 1e-3, "alpha": 0.9}, ["square_avg"]),
    "Adadelta": ({"lr": 1.0, "rho": 0.9}, ["square_avg"]),
}


@pytest.mark.skipif(not TORCH_FUSES_MULTIPLY_ADDS, reason=NO_TORCH_FMA)
@pytest.mark.parametrize("name", list(MUL_ADDCMUL_STATE))
def test_mul_addcmul_state_is_torchs_bitwise(name: str) -> None:
    """The same ops on the same inputs give the same bits: addcmul rounds once."""
    options, keys = MUL_ADDCMUL_STATE[name]
    assert_keys_are_torchs_bitwise(name, options, keys, seed=4)


def assert_keys_are_torchs_bitwise(name: str, options: dict, keys: list, seed: int) -> None:
    """3 steps of reprop's and torch's `name` over sizes 1 to 40: each of
    `keys` (a state key, or "param") equal bit for bit."""
    shapes = [(n,) for n in range(1, 41)]
    init, grads = make_params(shapes, seed=seed), grad_sequence(shapes, 3)
    got = run_open_loop(factory(reprop_cls(name), **options), init, grads)
    ref = run_open_loop(factory(torch_cls(name), **options), init, grads)
    for pg, pr in zip(got.params, ref.params):
        for key in keys:
            a, e = (pg, pr) if key == "param" else (got.opt.state[pg][key], ref.opt.state[pr][key])
            assert torch.equal(a, e), f"{name} {key} of {tuple(pr.shape)} differs from torch's"


# What torch computes with add(alpha=), lerp, mul and addcmul alone: SGD's
# parameters and momentum buffer, Adam's exp_avg (lerp weight 1 - beta1 below
# and above 0.5) and centered RMSprop's grad_avg; no weight decay where a
# square root reaches the key through the parameters.
ADD_LERP_RESULTS = [
    ("SGD", RICH["SGD"], ["param", "momentum_buffer"]),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01, "maximize": True},
     ["param", "momentum_buffer"]),
    # 1 - dampening in double, then rounded to float32: 0.1f, where
    # 1f - 0.9f is 0.100000024 (one rounding more than torch's Python float)
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.9}, ["param", "momentum_buffer"]),
    ("Adam", {"lr": 1e-2}, ["exp_avg"]),
    ("Adam", {"lr": 1e-2, "betas": (0.3, 0.999)}, ["exp_avg"]),
    # lerp weight 0.9f: torch's 1 - weight is 1f - 0.9f = 0.100000024, not
    # 0.1 (beta1) rounded to float32
    ("Adam", {"lr": 1e-2, "betas": (0.1, 0.999)}, ["exp_avg"]),
    # lerp weight exactly 0.5: torch's lerp takes the self + w * (end - self)
    # form only for |w| < 0.5
    ("Adam", {"lr": 1e-2, "betas": (0.5, 0.999)}, ["exp_avg"]),
    ("RMSprop", {"lr": 1e-3, "centered": True}, ["grad_avg"]),
]


@pytest.mark.skipif(not TORCH_FUSES_MULTIPLY_ADDS, reason=NO_TORCH_FMA)
@pytest.mark.parametrize("name, options, keys", ADD_LERP_RESULTS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(ADD_LERP_RESULTS)])
def test_add_alpha_and_lerp_results_are_torchs_bitwise(name: str, options: dict, keys: list) -> None:
    """The same ops on the same inputs give the same bits: add(alpha=) and
    lerp round once."""
    assert_keys_are_torchs_bitwise(name, options, keys, seed=5)


@pytest.mark.parametrize("name, options", [
    ("AdamW", {"lr": 0.3, "weight_decay": 0.3}),
    ("Adam", {"lr": 0.3, "weight_decay": 0.3, "decoupled_weight_decay": True}),
])
def test_decoupled_decay_factor_is_torchs_bitwise(name: str, options: dict) -> None:
    """Decoupled weight decay multiplies the param by 1 - lr * weight_decay,
    which torch computes as a Python float and rounds to float32 once (0.91f
    here; 1f - 0.3f * 0.3f, rounded in float32, is one ulp below). With zero
    gradients the rest of Adam's update adds -0.0, so the params after 3
    steps are param * factor**3, torch's bit for bit."""
    shapes = [(n,) for n in range(1, 41)]
    init = make_params(shapes, seed=6)
    zeros = [[torch.zeros(s) for s in shapes]] * 3
    got = run_open_loop(factory(reprop_cls(name), **options), init, zeros)
    ref = run_open_loop(factory(torch_cls(name), **options), init, zeros)
    for pg, pr in zip(got.params, ref.params):
        assert torch.equal(pg, pr), f"{name}: the decayed param of {tuple(pr.shape)} is not torch's"
    assert not all(torch.equal(p, q) for p, q in zip(got.params, init)), "nothing was decayed"


def test_adam_denominator_is_torchs_bitwise_where_the_square_root_is_exact() -> None:
    """Adam's denominator is exp_avg_sq.sqrt() / sqrt(1 - beta2 ** step) +
    eps, a division as torch's (not a multiplication by the reciprocal,
    which rounds once more). With beta2 = 0.25, zero gradients and
    exp_avg_sq = 4 k^2, the second moment is k^2 and its square root k
    exact, so torch's inexact CPU sqrt plays no part and the params are
    torch's bit for bit (for 59 of these k, k / b and k * (1 / b) differ)."""
    k = torch.arange(1, 257, dtype=torch.float32)
    gen = torch.Generator().manual_seed(8)
    exp_avg = torch.rand(256, generator=gen) - 0.5
    results = []
    for cls in (rp.Adam, torch.optim.Adam):
        p = nn.Parameter(torch.zeros(256))  # (a param of 0 takes the update's bits as they are)
        opt = cls([p], lr=0.1, betas=(0.9, 0.25))
        p.grad = torch.zeros(256)
        opt.step()
        st = opt.state[p]
        st["exp_avg_sq"].copy_(4 * k * k)
        st["exp_avg"].copy_(exp_avg)
        opt.step()  # step 2: bias correction sqrt(0.9375)
        results.append(p.detach().clone())
    assert torch.equal(*results), f"{(results[0] != results[1]).sum()} params differ from torch's"


def test_adadelta_delta_is_torchs_bitwise_where_the_square_roots_are_exact() -> None:
    """Adadelta's delta is sqrt(acc_delta + eps).div_(std).mul_(grad), as
    torch's: divided, then multiplied (delta * grad / std rounds apart).
    With eps = 0, rho = 0.25, grad 3 and square_avg = 4 k^2 - 27 before the
    step, square_avg is k^2 after it, and acc_delta = j^2: both square roots
    are exact, so torch's inexact CPU sqrt plays no part; with lr = 1 and
    params of 0 the params are -delta, torch's bit for bit."""
    n = 256
    k = torch.arange(3, 3 + n, dtype=torch.float32)
    j = torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(9)).float()
    results = []
    for cls in (rp.Adadelta, torch.optim.Adadelta):
        p = nn.Parameter(torch.zeros(n))
        opt = cls([p], lr=1.0, rho=0.25, eps=0.0)
        p.grad = torch.zeros(n)
        opt.step()
        with torch.no_grad():
            p.zero_()  # (0 / 0 at that first step, with eps = 0)
        opt.state[p]["square_avg"].copy_(4 * k * k - 27)
        opt.state[p]["acc_delta"].copy_(j * j)
        p.grad = torch.full((n,), 3.0)
        opt.step()
        results.append(p.detach().clone())
    assert torch.equal(*results), f"{(results[0] != results[1]).sum()} params differ from torch's"


def test_adam_beta2_of_one_set_after_construction_runs_as_torch() -> None:
    """beta2 = 1 (which the constructor refuses, set on the group after it):
    1 - beta2 ** step is 0, not negative, so torch divides by its square
    root 0.0 and goes on (NaN where 0 / 0) rather than raising; reprop too."""
    results = []
    for cls in (rp.Adam, torch.optim.Adam):
        p = nn.Parameter(torch.ones(5))
        opt = cls([p], lr=0.1)
        opt.param_groups[0]["betas"] = (0.9, 1.0)
        p.grad = torch.full((5,), 0.5)
        opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0].isnan(), results[1].isnan())
    assert torch.allclose(*results, equal_nan=True)


def test_adam_bias_correction2_is_rounded_once() -> None:
    """sqrt(1 - beta2 ** step) is a Python float in torch, rounded to float32
    once: at beta2 = 0.999, step 1 that is 0.031622775, where the square root
    of 0.001 rounded to float32 first is 0.03162278. Made exact as in the
    test above: zero gradients and exp_avg_sq values whose product with
    0.999f is k^2, so the denominators are k / b + eps and the params of 0
    take the update's bits; the step count is put back to 0 for step 1."""
    k = torch.arange(1, 1025, dtype=torch.float32)
    v0 = k * k / 0.999
    k, v0 = k[v0 * 0.999 == k * k], v0[v0 * 0.999 == k * k]
    assert len(k) > 100
    exp_avg = torch.rand(len(k), generator=torch.Generator().manual_seed(10)) - 0.5
    results = []
    for cls in (rp.Adam, torch.optim.Adam):
        p = nn.Parameter(torch.zeros(len(k)))
        opt = cls([p], lr=0.1)
        p.grad = torch.zeros(len(k))
        opt.step()
        st = opt.state[p]
        st["step"].zero_()
        st["exp_avg_sq"].copy_(v0)
        st["exp_avg"].copy_(exp_avg)
        opt.step()
        results.append(p.detach().clone())
    assert torch.equal(*results), f"{(results[0] != results[1]).sum()} params differ from torch's"


SIGNED_ZEROS = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("Adam", {"lr": 0.1}),
    ("AdamW", {"lr": 0.1}),
    ("Adagrad", {"lr": 0.1}),
    ("RMSprop", {"lr": 0.1, "momentum": 0.9, "centered": True}),
    ("Adadelta", {"lr": 0.1}),
]


@pytest.mark.parametrize("name, options", SIGNED_ZEROS,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(SIGNED_ZEROS)])
def test_signed_zeros_are_torchs(name: str, options: dict) -> None:
    """A -0.0 param with a -0.0 gradient ends as torch's zero, sign included,
    state too: the terms an option leaves out (weight decay, nesterov's
    momentum term) must add -0.0, the one float that changes no sum; +0.0
    would turn -0.0 + -0.0 into +0.0. Products of zeros round alike fused or
    not, and the square roots of zeros are exact."""
    init = [torch.full((3,), -0.0)]
    grads = [[torch.full((3,), -0.0)]] * 2
    got = run_open_loop(factory(reprop_cls(name), **options), init, grads)
    ref = run_open_loop(factory(torch_cls(name), **options), init, grads)
    bits = lambda t: t.detach().view(torch.int32)
    assert torch.equal(bits(got.params[0]), bits(ref.params[0])), (
        f"{name}: param {got.params[0].tolist()}, torch's {ref.params[0].tolist()}")
    for key, e in ref.opt.state[ref.params[0]].items():
        if key != "step":
            a = got.opt.state[got.params[0]][key]
            assert torch.equal(bits(a), bits(e)), f"{name}: {key} {a.tolist()}, torch's {e.tolist()}"


LONE_PRODUCTS = ["SGD 0 - 0.1 * 1e-45", "SGD 3e38 - 1.5 * 3e38", "Adam exp_avg"]


def lone_product_results(classes: dict[str, type[torch.optim.Optimizer]]) -> list[torch.Tensor]:
    """LONE_PRODUCTS: one step of each whose product underflows or overflows
    on its own."""
    sgd = [nn.Parameter(torch.tensor([0.0])), nn.Parameter(torch.tensor([3e38]))]
    sgd[0].grad, sgd[1].grad = torch.tensor([1e-45]), torch.tensor([3e38])
    classes["SGD"]([{"params": sgd[:1], "lr": 0.1}, {"params": sgd[1:], "lr": 1.5}]).step()
    adam = nn.Parameter(torch.tensor([0.0]))
    adam.grad = torch.tensor([-1e-45])
    opt = classes["Adam"]([adam])
    opt.step()
    return [*sgd, opt.state[adam]["exp_avg"]]


def assert_lone_products_are_torchs(ref: list[torch.Tensor]) -> None:
    got = lone_product_results({"SGD": rp.SGD, "Adam": rp.Adam})
    for what, a, e in zip(LONE_PRODUCTS, got, ref):
        assert torch.equal(a.detach().view(torch.int32), e.detach().view(torch.int32)), (
            f"{what}: {a.item()!r} (bits {a.detach().view(torch.int32).item():#x}), torch's {e.item()!r}")


@pytest.mark.skipif(not TORCH_FUSES_MULTIPLY_ADDS, reason=NO_TORCH_FMA)
def test_a_product_rounded_once_keeps_torchs_sign_and_range() -> None:
    """add(alpha=) and lerp round the product once, as torch's do: one that
    underflows keeps its sign in the sum (0 - 0.1 * 1e-45 is -0.0, not +0.0;
    so is Adam's exp_avg lerped from 0 towards -1e-45), and one that overflows
    on its own does not make the sum inf (3e38 - 1.5 * 3e38 is -1.5e38)."""
    ref = lone_product_results({"SGD": torch.optim.SGD, "Adam": torch.optim.Adam})
    assert ref[0].signbit().item() and ref[1].isfinite().item() and ref[2].signbit().item(), (
        f"torch's results {[r.item() for r in ref]} are not the -0.0, finite, -0.0 this test is about")
    assert_lone_products_are_torchs(ref)


# On x86 CPUs without AVX2 and FMA, torch's baseline kernels round the product
# of add(alpha=), addcmul and lerp on its own, and so does reprop there, where
# a fused multiply-add would be a software fmaf call per element. torch's are
# forced by ATEN_CPU_CAPABILITY=default, reprop's by its test hook
# REPROP_TEST_UNFUSED_MADD=1; both are read once, so the checks run in a fresh
# interpreter, through this module's functions.
PLAIN_ROUNDING_ENV = {"ATEN_CPU_CAPABILITY": "default", "REPROP_TEST_UNFUSED_MADD": "1"}
X86_ONLY = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                              reason="torch's baseline kernels fuse multiply-adds off x86")


def run_with_plain_rounding(statements: str) -> None:
    script = "\n".join([
        "import sys, torch",
        "assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'",
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})",
        "import test_optim as t",
        statements,
    ])
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, **PLAIN_ROUNDING_ENV},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


@X86_ONLY
def test_plain_rounding_is_torchs_baseline_bitwise() -> None:
    """With the products rounded apart, what torch computes with add(alpha=),
    lerp, mul and addcmul alone is its baseline kernels' bit for bit, as the
    fused rounding is its AVX2 kernels' (the tests above, in this process)."""
    run_with_plain_rounding("\n".join([
        "for name in t.MUL_ADDCMUL_STATE:",
        "    t.test_mul_addcmul_state_is_torchs_bitwise(name)",
        "for case in t.ADD_LERP_RESULTS:",
        "    t.test_add_alpha_and_lerp_results_are_torchs_bitwise(*case)",
        "t.assert_lone_products_are_torchs(",
        "    t.lone_product_results({'SGD': torch.optim.SGD, 'Adam': torch.optim.Adam}))",
    ]))


@pytest.mark.parametrize("name", NAMES)
def test_tiny_gradients_match_torch(name: str) -> None:
    """Gradients of 1e-8 .. 1e-6, where eps (1e-10 .. 1e-6) is not negligible,
    so eps in the wrong place (e.g. inside the square root) shows. Default
    options: no weight decay, so the gradient reaches the update exactly."""
    shapes = [(5, 7), (33,)]
    init = make_params(shapes, seed=3)
    grads = [[g * 2e-6 for g in step] for step in grad_sequence(shapes, 3)]
    got = run_open_loop(factory(reprop_cls(name), **BASE[name]), init, grads)
    ref = run_open_loop(factory(torch_cls(name), **BASE[name]), init, grads)
    assert_runs_close(got, ref, STEP_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_is_a_drop_in_subclass(name: str) -> None:
    params = [nn.Parameter(torch.randn(3))]
    got, ref = reprop_cls(name)(params), torch_cls(name)(params)
    assert isinstance(got, torch_cls(name))
    assert got.defaults == ref.defaults
    assert got.param_groups[0].keys() == ref.param_groups[0].keys()
    assert {k: v for k, v in got.param_groups[0].items() if k != "params"} == {
        k: v for k, v in ref.param_groups[0].items() if k != "params"
    }


@pytest.mark.parametrize("name", NAMES)
def test_user_subclass_runs_its_own_init(name: str) -> None:
    """A user's subclass with an __init__ of its own (its own defaults, an extra
    argument) runs it, as a torch.optim subclass does; reprop used to replace
    it with torch's constructor. One without an __init__ takes its base's."""

    class Scaled(reprop_cls(name)):
        def __init__(self, params, scale: float) -> None:
            super().__init__(params, lr=0.25 * scale)
            self.scale = scale

    class Plain(reprop_cls(name)):
        pass

    p, q = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    ref = torch_cls(name)([q], lr=0.5)
    got = Scaled([p], scale=2.0)
    assert got.scale == 2.0 and got.param_groups[0]["lr"] == 0.5
    assert list(inspect.signature(Scaled).parameters) == ["params", "scale"]
    assert Plain([p]).defaults == torch_cls(name)([p]).defaults
    with torch.no_grad():
        q.copy_(p)
    for opt, param in ((got, p), (ref, q)):
        param.grad = torch.ones(3)
        opt.step()
    assert_runs_close(Run([p], got), Run([q], ref), STEP_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_state_is_not_shared_between_params(name: str, batches) -> None:
    got, _ = train_pair(name, RICH[name], batches[:3])
    ptrs = [
        v.data_ptr() for p in got.params for k, v in got.opt.state[p].items()
        if isinstance(v, torch.Tensor) and k != "step" and v.numel()
    ]
    assert len(ptrs) == len(set(ptrs)), "two state slots share memory"


@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_foreach_and_fused_are_accepted_and_ignored(name: str, flag: str) -> None:
    shapes = [(4, 5), (9,)]
    init, grads = make_params(shapes, seed=4), grad_sequence(shapes, 3)
    plain = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads)
    flagged = run_open_loop(factory(reprop_cls(name), **RICH[name], **{flag: True}), init, grads)
    assert_runs_equal(flagged, plain)


# torch's fused optimizers' AMP protocol: step() divides the gradients in place
# by optimizer.grad_scale and, where optimizer.found_inf is non-zero, updates
# nothing. The scales 3 and 7 make the division round.
AMP_SCALES = (65536.0, 3.0, 1024.0, 0.5, 7.0, 65536.0, 3.0)
AMP_FOUND_INF = (0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0)
AMP_SHAPES = [(3, 4), (17,), (1,)]


def _transposed_layout(g: torch.Tensor) -> torch.Tensor:
    """g with its matrix dims' strides swapped (not contiguous), which the
    update reads through a contiguous copy: one made before the gradient was
    divided would be read scaled."""
    return g.t().contiguous().t() if g.dim() == 2 else g


def run_amp_protocol(make_opt: OptFactory, init, grads, *, amp: bool,
                     dtype: torch.dtype = torch.float32,
                     layout: Callable[[torch.Tensor], torch.Tensor] = lambda g: g
                     ) -> tuple[Run, list]:
    """Open loop over AMP_SCALES and AMP_FOUND_INF. With `amp`, each step's
    gradients are the given ones times the scale (laid out by `layout`), with
    optimizer.grad_scale and found_inf set; without, they are those products
    divided by the scale (what torch's fused kernels update from) and a step
    with found_inf is not taken. Returns the run and every parameter's .grad
    after each step."""
    params = [nn.Parameter(t.clone().to(dtype)) for t in init]
    opt = make_opt(params)
    grads_after = []
    for step_grads, scale, found_inf in zip(grads, AMP_SCALES, AMP_FOUND_INF):
        scale_t = torch.tensor(scale)
        for p, g in zip(params, step_grads):
            scaled = layout(g.to(dtype) * scale)
            p.grad = scaled if amp else scaled / scale_t
        if amp:
            opt.grad_scale, opt.found_inf = scale_t, torch.tensor(found_inf)
            opt.step()
        elif not found_inf:
            opt.step()
        grads_after.append([clone_exact(p.grad) for p in params])
    return Run(params, opt), grads_after


def assert_grads_equal(got: list, ref: list) -> None:
    for k, (step_got, step_ref) in enumerate(zip(got, ref)):
        for i, (g, r) in enumerate(zip(step_got, step_ref)):
            assert g.dtype == r.dtype and torch.equal(g, r), f"step {k}: the .grad of param {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_amp_protocol_divides_gradients_and_skips_as_torchs_fused_step(name: str,
                                                                       dtype: torch.dtype) -> None:
    """The gradients after each step are torch fused's bit for bit (divided,
    or left scaled where found_inf skips); the update is reprop's own from
    them (bitwise), and for float32 close to torch fused's, whose state has
    the same step counts. (torch keeps a bf16 parameter's state in bf16.)"""
    init, grads = make_params(AMP_SHAPES, seed=5), grad_sequence(AMP_SHAPES, len(AMP_SCALES))
    got, got_grads = run_amp_protocol(factory(reprop_cls(name), **RICH[name]), init, grads,
                                      amp=True, dtype=dtype)
    plain, _ = run_amp_protocol(factory(reprop_cls(name), **RICH[name]), init, grads,
                                amp=False, dtype=dtype)
    ref, ref_grads = run_amp_protocol(factory(torch_cls(name), **RICH[name], fused=True), init,
                                      grads, amp=True, dtype=dtype)
    assert_grads_equal(got_grads, ref_grads)
    assert_runs_equal(got, plain)
    if dtype == torch.float32:
        assert_runs_close(got, ref, OPEN_LOOP_TOL)


@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_amp_protocol_divides_gradients_read_through_a_copy(name: str) -> None:
    """A gradient laid out unlike its param is read through a copy, made
    from the divided gradient. (torch's CPU fused kernels update such a
    parameter wrongly, as if the gradient were laid out like it: not a
    reference here.)"""
    init, grads = make_params(AMP_SHAPES, seed=5), grad_sequence(AMP_SHAPES, len(AMP_SCALES))
    make = factory(reprop_cls(name), **RICH[name])
    got, got_grads = run_amp_protocol(make, init, grads, amp=True, layout=_transposed_layout)
    plain, plain_grads = run_amp_protocol(make, init, grads, amp=False, layout=_transposed_layout)
    assert_runs_equal(got, plain)
    taken = [k for k, found_inf in enumerate(AMP_FOUND_INF) if not found_inf]
    assert_grads_equal([got_grads[k] for k in taken], [plain_grads[k] for k in taken])


def _amp_step_under(name: str, stop: LineStop, groups: int = 1) -> tuple[Run, bool]:
    """A second step of the AMP protocol (grad_scale 1024, no inf) under
    `stop`, retried with the same grad_scale when it was stopped before it
    moved a parameter of the last of `groups` param groups, as
    GradScaler.step() is retried (its stage still READY); returns the run
    and whether it was retried."""
    init, grads = make_params(AMP_SHAPES, seed=5), grad_sequence(AMP_SHAPES, 2)
    params = [nn.Parameter(t.clone()) for t in init]
    opt = reprop_cls(name)([{"params": params[i::groups]} for i in range(groups)], **RICH[name])
    set_grads(params, grads[0])
    opt.step()
    before = [p.detach().clone() for p in params]
    set_grads(params, [g * 1024 for g in grads[1]])
    opt.grad_scale = torch.tensor(1024.0)
    try:
        with stop:
            opt.step()
    except KeyboardInterrupt:
        pass
    last = slice(groups - 1, None, groups)
    retried = stop.stopped and all(torch.equal(p, b) for p, b in zip(params[last], before[last]))
    if retried:
        opt.step()
    return Run(params, opt), retried


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_amp_step_stopped_before_its_update_divides_the_gradients_once(name: str, groups: int) -> None:
    """The stop button at each line of the update: step() divided the
    gradients by grad_scale in place before the update ran, so a step
    stopped in between left them divided with the params as they were, and
    the retried step divided them again (SGD's params off by 0.07 from a
    gradient 1024 times too small). Now the retried step does not divide
    them again: a step stopped before its update, retried, gives the step
    uninterrupted (params, state and .grad, bitwise); one stopped after it
    has moved the params as that step. With two groups, the retried step
    had divided the second group's again once the first group's update
    forgot every group's notes; the first group, updated before the stop,
    is updated again by a retry, so only the last group is compared."""
    whole, _ = _amp_step_under(name, LineStop(rp._FusedOptimizer._update, 0), groups)
    lines = LineStop(rp._FusedOptimizer._update, 0)
    _amp_step_under(name, lines, groups)
    last = slice(groups - 1, None, groups)
    retries = 0
    for n in range(1, lines.count + 1):
        got, retried = _amp_step_under(name, LineStop(rp._FusedOptimizer._update, n), groups)
        pairs = list(zip(got.params[last], whole.params[last]))
        assert all(torch.equal(p, w) for p, w in pairs), f"line {n}"
        for p, w in pairs:
            assert got.opt.state[p].keys() == whole.opt.state[w].keys()
            assert all(torch.equal(got.opt.state[p][k], whole.opt.state[w][k])
                       for k in got.opt.state[p]), f"line {n}"
        if retried:
            assert all(torch.equal(p.grad, w.grad) for p, w in pairs), f"line {n}"
            retries += 1
    assert lines.count > 10 and 0 < retries < lines.count


def _stop_after_division(opt: torch.optim.Optimizer) -> None:
    """opt.step() (one group, one plan) stopped between its division of the
    gradients by grad_scale and its update."""
    with pytest.raises(KeyboardInterrupt):
        with LineStop(rp._FusedOptimizer._update, 1, starting="for plan in running"):
            opt.step()


@pytest.mark.parametrize("by", ["itself", "another optimizer"])
@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_amp_step_after_a_stopped_one_and_an_unscaled_update_divides_again(name: str,
                                                                          by: str) -> None:
    """A step stopped after dividing the gradients notes them as divided,
    for its retry not to divide them again; the note outlived an update that
    stepped on them (one without grad_scale), and a later step with
    grad_scale and the same gradients skipped the division torch's fused
    step makes (SGD: the params moved by 2x the gradient). That update
    drops the note: the later step divides, as torch's. The same with the
    update made by another reprop optimizer over the same params: the note
    was kept on the stopped step's optimizer, which only its own updates
    dropped (SGD, p 1, grad 8, scale 2: p 0.2 and grad 4 where torch's
    fused SGD gives 0.4 and 2); every reprop optimizer's update drops them."""
    init, grads = make_params(AMP_SHAPES, seed=7), grad_sequence(AMP_SHAPES, 2)
    runs = []
    for cls in (reprop_cls(name), lambda ps, **kw: torch_cls(name)(ps, fused=True, **kw)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **RICH[name])
        other = opt if by == "itself" else cls(params, **RICH[name])
        set_grads(params, grads[0])
        opt.step()
        if cls is reprop_cls(name):
            set_grads(params, [g * 1024 for g in grads[1]])
            opt.grad_scale = torch.tensor(1024.0)
            _stop_after_division(opt)
        else:
            set_grads(params, grads[1])  # (as the stopped step left them)
        opt.grad_scale = None
        other.step()
        opt.grad_scale = torch.tensor(2.0)
        opt.step()
        runs.append((Run(params, opt), other))
    assert_runs_close(runs[0][0], runs[1][0], OPEN_LOOP_TOL)
    assert_runs_close(Run(runs[0][0].params, runs[0][1]), Run(runs[1][0].params, runs[1][1]),
                      OPEN_LOOP_TOL)
    for p, r in zip(runs[0][0].params, runs[1][0].params):
        assert torch.equal(p.grad, r.grad)
    assert not rp._NOTING  # (the notes dropped, the registry with them)


_NOTES_ACROSS_A_RELOAD = """
import importlib, sys, torch
sys.path.insert(0, sys.argv[1])  # (the tests' folder)
from _interrupts import LineStop
import reprop.optim as rp

params = [torch.nn.Parameter(torch.ones(3))]
opt, other = rp.SGD(params, lr=0.1), rp.SGD(params, lr=0.1)
params[0].grad = torch.full((3,), 8.0)
opt.grad_scale = torch.tensor(2.0)
try:  # stopped between the division of the gradients and the update
    with LineStop(rp._FusedOptimizer._update, 1, starting="for plan in running"):
        opt.step()
except KeyboardInterrupt:
    pass
print(bool(opt._divided_not_stepped))
importlib.reload(rp)
other.step()  # steps on the divided gradients: the notes are stale
print(bool(opt._divided_not_stepped))
"""


def test_notes_of_a_stopped_amp_step_are_dropped_across_a_reload_of_optim() -> None:
    """The registry of the optimizers holding notes of a stopped scaled
    step (_NOTING) is kept across importlib.reload(reprop.optim) (IPython's
    %autoreload 2): a new, empty one after the reload left the notes of an
    optimizer made before it, which the update of another optimizer over
    the same params no longer dropped, and a later scaled step of it
    skipped the division."""
    assert script_output(_NOTES_ACROSS_A_RELOAD, os.path.dirname(__file__)) == ["True", "False"]


@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_amp_step_retried_after_its_gradients_were_written_in_place_divides_them(name: str) -> None:
    """A step stopped after dividing the gradients notes them as divided; a
    gradient written in place since (the same tensor and memory: a new
    backward accumulated into it, copy_) is new, and the retried step must
    divide it, as torch's fused step does: the note's version tells. (A note
    kept by identity and address alone would step on it 1024 times too big.)"""
    init, grads = make_params(AMP_SHAPES, seed=7), grad_sequence(AMP_SHAPES, 3)
    runs = []
    for cls in (reprop_cls(name), lambda ps, **kw: torch_cls(name)(ps, fused=True, **kw)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **RICH[name])
        set_grads(params, grads[0])
        opt.step()
        opt.grad_scale = torch.tensor(1024.0)
        if cls is reprop_cls(name):
            set_grads(params, [g * 1024 for g in grads[1]])
            _stop_after_division(opt)
            for p, g in zip(params, grads[2]):
                p.grad.copy_(g * 1024)
        else:
            set_grads(params, [g * 1024 for g in grads[2]])
        opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(runs[0], runs[1], OPEN_LOOP_TOL)
    for p, r in zip(runs[0].params, runs[1].params):
        assert torch.equal(p.grad, r.grad)


class _NotesPausedForAPop(dict):
    """An optimizer's notes (call key -> notes) whose first read by the
    thread named `reader` waits until another thread has popped a key: the
    interleaving forced, not left to luck."""

    def __init__(self, notes: dict, reader: str):
        super().__init__(notes)
        self.reader, self.reading, self.popped = reader, threading.Event(), threading.Event()

    def _pause(self) -> None:
        if threading.current_thread().name == self.reader:
            self.reading.set()
            assert self.popped.wait(60)

    def __getitem__(self, key):
        self._pause()
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._pause()
        return super().get(key, default)

    def pop(self, *args):
        out = super().pop(*args)
        if threading.current_thread().name != self.reader:
            self.popped.set()
        return out


@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_update_in_another_thread_while_a_stopped_step_is_retried(name: str) -> None:
    """Every reprop update walks the notes of every optimizer holding some
    (those of a scaled step stopped after its division, _forget_read): an
    update of another optimizer, over other params, in another thread, that
    walked them while the stopped step's retry popped its notes raised
    KeyError from the other thread's step() (after its update had run).
    The walk now takes a note another thread took since as gone."""
    init, grads = make_params(AMP_SHAPES, seed=7), grad_sequence(AMP_SHAPES, 2)
    stopped_params = [nn.Parameter(t.clone()) for t in init]
    stopped = reprop_cls(name)(stopped_params, **RICH[name])
    set_grads(stopped_params, grads[0])
    stopped.step()
    set_grads(stopped_params, [g * 1024 for g in grads[1]])
    stopped.grad_scale = torch.tensor(1024.0)
    _stop_after_division(stopped)
    notes = stopped._divided_not_stepped = _NotesPausedForAPop(stopped._divided_not_stepped, "other")

    def other_run() -> list:
        params = [nn.Parameter(t.clone()) for t in init]
        set_grads(params, grads[1])
        reprop_cls(name)(params, **RICH[name]).step()
        return params

    want = other_run()  # (its walk of the notes pauses only in the thread named "other")
    got, errors = [], []

    def other() -> None:
        try:
            got.extend(other_run())
        except BaseException as e:
            errors.append(e)

    other_thread = threading.Thread(target=other, name="other")
    try:
        other_thread.start()
        assert notes.reading.wait(60)
        stopped.step()  # the retry: pops the notes the other thread is walking
    finally:
        notes.popped.set()
        other_thread.join(60)
    assert not other_thread.is_alive() and not errors, errors
    assert all(torch.equal(p, q) for p, q in zip(got, want))
    assert not notes and not rp._NOTING


@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_amp_step_retried_divides_gradients_sharing_one_buffer_once(name: str) -> None:
    """Gradients that are views of one flat buffer share its version
    counter, which dividing them bumped once per view: the notes of a step
    stopped after the division forecast one bump each, so the retry took
    them for gradients written since and divided them again (SGD's params
    moved by half their step). The versions are noted as read after the
    division: the retry gives torch's fused step, uninterrupted."""
    init, grads = make_params(AMP_SHAPES, seed=8), grad_sequence(AMP_SHAPES, 1)[0]
    runs = []
    for cls in (reprop_cls(name), lambda ps, **kw: torch_cls(name)(ps, fused=True, **kw)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **RICH[name])
        flat = torch.cat([g.flatten() for g in grads]) * 1024
        views = flat.split([g.numel() for g in grads])
        for p, v in zip(params, views):
            p.grad = v.view(p.shape)
        opt.grad_scale = torch.tensor(1024.0)
        if cls is reprop_cls(name):
            _stop_after_division(opt)
            assert all(torch.equal(p, t) for p, t in zip(params, init))
        opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(runs[0], runs[1], OPEN_LOOP_TOL)
    for p, r in zip(runs[0].params, runs[1].params):
        assert torch.equal(p.grad, r.grad)


@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_amp_step_of_inference_tensors_as_torchs_fused(name: str) -> None:
    """Inference tensors keep no version counter, which the notes of a
    stopped AMP step read (it raised where torch's fused step updates)."""
    runs = []
    for make in (reprop_cls(name), lambda ps, **kw: torch_cls(name)(ps, fused=True, **kw)):
        with torch.inference_mode():
            params = make_params(AMP_SHAPES, seed=6)
            opt = make(params, **RICH[name])
            for p, g in zip(params, grad_sequence(AMP_SHAPES, 1)[0]):
                p.grad = g * 1024
            opt.grad_scale = torch.tensor(1024.0)
            opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(runs[0], runs[1], Tol(0.0, 0.0))
    for p, r in zip(runs[0].params, runs[1].params):
        assert torch.equal(p.grad, r.grad)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adagrad"])
def test_a_skipped_first_step_leaves_torchs_initial_state(name: str) -> None:
    """torch's fused step makes a param's state before its kernel skips:
    zero moments (Adagrad's sum from the constructor), at step 0."""
    runs = []
    for make in (reprop_cls(name), lambda ps, **kw: torch_cls(name)(ps, fused=True, **kw)):
        params = [nn.Parameter(t) for t in make_params(AMP_SHAPES, seed=6)]
        opt = make(params, **RICH[name])
        for p, g in zip(params, grad_sequence(AMP_SHAPES, 1)[0]):
            p.grad = g * 1024
        opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
        opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(runs[0], runs[1], Tol(0.0, 0.0))
    for p, r in zip(runs[0].params, runs[1].params):
        assert torch.equal(p.grad, r.grad)  # left scaled


def test_sgd_skipped_first_step_leaves_no_momentum_buffer() -> None:
    """torch's fused SGD stores the momentum buffer it made with empty_like
    for its skipped kernel to fill (uninitialized memory, which its next
    step reads); reprop stores none, so its next step is a first step."""
    init, grads = make_params(AMP_SHAPES, seed=6), grad_sequence(AMP_SHAPES, 1)[0]
    params = [nn.Parameter(t.clone()) for t in init]
    opt = rp.SGD(params, **RICH["SGD"])
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert not any(opt.state[p] for p in params)
    assert all(torch.equal(p, t) for p, t in zip(params, init))
    del opt.found_inf
    opt.step()
    assert_runs_equal(Run(params, opt), run_open_loop(factory(rp.SGD, **RICH["SGD"]), init, [grads]))


@pytest.mark.parametrize("name", ["SGD", "Adam", "Adagrad"])
def test_a_cpu_step_with_found_inf_leaves_cuda_uninitialized(name: str, monkeypatch) -> None:
    """A CPU step with found_inf set asked torch.cuda.is_available() whether
    to check for a CUDA graph capture: on a CUDA build of torch that
    initializes the CUDA driver (cudaGetDeviceCount), after which the process
    can no longer fork children that use CUDA. A capture needs CUDA
    initialized, so the step asks torch.cuda.is_initialized(), which does not."""
    def initializes_cuda():
        raise AssertionError("torch.cuda.is_available() initializes the CUDA driver")
    monkeypatch.setattr(torch.cuda, "is_available", initializes_cuda)
    init, grads = make_params(AMP_SHAPES, seed=8), grad_sequence(AMP_SHAPES, 1)
    params = [nn.Parameter(t.clone()) for t in init]
    opt = reprop_cls(name)(params, **RICH[name])
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert_runs_equal(Run(params, opt), run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads))


@pytest.mark.parametrize("found_inf", [2.0, 0.5, float("nan")])
@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_any_non_zero_found_inf_skips(name: str, found_inf: float) -> None:
    """As GradScaler skips where its devices' found_inf sum to non-zero (2.0:
    infs on two); torch's kernels skip only at 1.0 and take found_inf off
    the step count (a count of -1, 0.5 or NaN)."""
    init, grads = make_params(AMP_SHAPES, seed=8), grad_sequence(AMP_SHAPES, 2)
    params = [nn.Parameter(t.clone()) for t in init]
    opt = reprop_cls(name)(params, **RICH[name])
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    opt.step()
    before = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads[:1])
    for p, g in zip(params, grads[1]):
        p.grad = g.clone()
    opt.found_inf = torch.tensor(found_inf)
    opt.step()
    assert_runs_equal(Run(params, opt), before)


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_amp_attributes_of_one_element_any_shape(name: str, shape: tuple) -> None:
    """A grad_scale and found_inf of one element in any shape, as torch's
    fused kernels take them: grad_scale of shape (1,) raised torch's
    "scalar tensor expected to be 0 dim" from _foreach_div_."""
    init, grads = make_params(AMP_SHAPES, seed=10), grad_sequence(AMP_SHAPES, 1)[0]
    runs = []
    for scale in (torch.tensor(4.0).reshape(shape), torch.tensor(4.0)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = reprop_cls(name)(params, **RICH[name])
        for p, g in zip(params, grads):
            p.grad = g * 4
        opt.grad_scale, opt.found_inf = scale, torch.zeros(shape)
        opt.step()
        runs.append(Run(params, opt))
    assert_runs_equal(runs[0], runs[1])
    for p, r in zip(runs[0].params, runs[1].params):
        assert torch.equal(p.grad, r.grad)


@pytest.mark.parametrize("attr", ["grad_scale", "found_inf"])
@pytest.mark.parametrize("value, error", [
    (2.0, TypeError),  # torch: AttributeError, a float has no .device
    (torch.tensor(2.0, dtype=torch.float64), TypeError),  # torch: "expected scalar type Float"
    (torch.tensor(1), TypeError),
    (torch.tensor(True), TypeError),
    (torch.tensor([2.0, 4.0]), ValueError),  # torch's grad_scale: the first element, silently
    (torch.tensor([]), ValueError),  # torch's grad_scale: none, silently
], ids=["float", "float64", "int", "bool", "two-elements", "empty"])
@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_bad_amp_attributes_are_refused_naming_them(name: str, attr: str, value,
                                                     error: type) -> None:
    init, grads = make_params(AMP_SHAPES, seed=9), grad_sequence(AMP_SHAPES, 1)[0]
    params = [nn.Parameter(t.clone()) for t in init]
    opt = reprop_cls(name)(params, **RICH[name])
    initial_state = copy.deepcopy(opt.state_dict()["state"])  # (Adagrad's sum exists already)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    setattr(opt, attr, value)
    with pytest.raises(error, match=rf"^{name}: {attr}: "):
        opt.step()
    assert all(torch.equal(p, t) and torch.equal(p.grad, g)
               for p, t, g in zip(params, init, grads))
    assert_state_dict_equal(opt.state_dict()["state"], initial_state)


def assert_state_dict_equal(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for i, st in ref.items():
        assert list(got[i]) == list(st) and all(torch.equal(got[i][k], v) for k, v in st.items())


@pytest.mark.parametrize("name", ["RMSprop", "Adadelta"])
def test_amp_attributes_are_ignored_where_torch_has_no_fused_step(name: str) -> None:
    """torch's RMSprop and Adadelta, which have no fused implementation, do
    not read grad_scale and found_inf: they step on the gradients as given."""
    init, grads = make_params(AMP_SHAPES, seed=10), grad_sequence(AMP_SHAPES, 3)
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **RICH[name])
        opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(1.0)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(runs[0], runs[1], OPEN_LOOP_TOL)


@pytest.mark.parametrize("name", FUSED_KWARG_NAMES)
def test_grad_scaler_unscales_and_skips_for_step(name: str) -> None:
    """GradScaler treats reprop's optimizers as torch's non-fused ones
    (_step_supports_amp_scaling is false): it unscales the gradients itself
    and calls step() only without infs, setting no grad_scale for it."""
    init, grads = make_params(AMP_SHAPES, seed=12), grad_sequence(AMP_SHAPES, 4)
    grads[1][1][3] = float("inf")  # the second step is skipped
    runs, grads_after = [], []
    for cls in (reprop_cls(name), torch_cls(name)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **RICH[name])
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step_grads in grads:
            opt.zero_grad()
            # the scaled loss's gradients: each g times the scale
            scaler.scale(sum((p * g).sum() for p, g in zip(params, step_grads))).backward()
            scaler.step(opt)
            scaler.update()
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            grads_after.append([clone_exact(p.grad) for p in params])
        runs.append(Run(params, opt))
    half = len(grads_after) // 2
    assert_grads_equal(grads_after[:half], grads_after[half:])
    assert_runs_close(runs[0], runs[1], OPEN_LOOP_TOL)


# ---------------------------------------------------------------------------
# 2. state_dict interchange with torch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_layout_matches_torch(name: str, batches) -> None:
    got, ref = train_pair(name, RICH[name], batches[:5])
    sg, sr = got.opt.state_dict(), ref.opt.state_dict()
    assert sg["param_groups"] == sr["param_groups"]
    assert sg["state"].keys() == sr["state"].keys()  # e.g. no entries at all for SGD without momentum
    for i, s in sr["state"].items():
        assert list(sg["state"][i]) == list(s), i  # in torch's order too, "step" first
        for k, v in s.items():
            assert type(sg["state"][i][k]) is type(v)
            if isinstance(v, torch.Tensor):
                assert (sg["state"][i][k].dtype, sg["state"][i][k].shape) == (v.dtype, v.shape), (i, k)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("direction", ["reprop_to_torch", "torch_to_reprop"])
def test_state_dict_round_trip(name: str, direction: str, batches) -> None:
    """Train N steps with one implementation, load its state_dict into the other,
    then train M more steps with both from that point: they must agree."""
    n, m = 10, 10
    src_cls, dst_cls = (
        (reprop_cls(name), torch_cls(name)) if direction == "reprop_to_torch" else (torch_cls(name), reprop_cls(name))
    )
    options, group1 = RICH[name], group1_overrides(name, RICH[name])
    src = train_model(factory(src_cls, **options), batches[:n], group1=group1)

    dst_model = copy.deepcopy(src.model)
    dst_opt = dst_cls(split_groups(list(dst_model.parameters()), group1), **options)
    dst_opt.load_state_dict(copy.deepcopy(src.opt.state_dict()))

    cont_src = train_model(None, batches[n:n + m], model=src.model, opt=src.opt)
    cont_dst = train_model(None, batches[n:n + m], model=dst_model, opt=dst_opt)
    assert_runs_close(cont_dst, cont_src, TRAIN_TOL[name])


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_resume_is_exact(name: str, batches) -> None:
    """reprop -> reprop: saving and loading mid-training changes nothing."""
    options, group1 = RICH[name], group1_overrides(name, RICH[name])
    straight = train_model(factory(reprop_cls(name), **options), batches[:12], group1=group1)
    first = train_model(factory(reprop_cls(name), **options), batches[:6], group1=group1)
    model = copy.deepcopy(first.model)
    opt = reprop_cls(name)(split_groups(list(model.parameters()), group1), **options)
    opt.load_state_dict(copy.deepcopy(first.opt.state_dict()))
    resumed = train_model(None, batches[6:12], model=model, opt=opt)
    assert_runs_equal(resumed, straight)


# ---------------------------------------------------------------------------
# 3. LR schedulers (OneCycleLR also cycles Adam's betas / SGD's momentum)
# ---------------------------------------------------------------------------

SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[g["lr"] * 2 for g in opt.param_groups], total_steps=30
    ),
}


@pytest.mark.parametrize(
    "name, sched",
    [
        ("SGD", "OneCycleLR"),
        ("Adam", "OneCycleLR"),
        ("AdamW", "StepLR"),
        ("Adagrad", "StepLR"),
        ("RMSprop", "OneCycleLR"),
        ("Adadelta", "StepLR"),
    ],
)
def test_lr_scheduler_matches_torch(name: str, sched: str, batches) -> None:
    got, ref = train_pair(name, RICH[name], batches[:30], scheduler=SCHEDULERS[sched])
    assert got.lrs == ref.lrs
    assert_runs_close(got, ref, TRAIN_TOL[name])


# ---------------------------------------------------------------------------
# 4. Edge shapes: empty, scalar, one element, hundreds of tensors, large
# ---------------------------------------------------------------------------


def _many_small_shapes(n: int = 300, seed: int = 11) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = []
    for _ in range(n):
        ndim = int(torch.randint(0, 4, (), generator=gen))
        shapes.append(tuple(int(d) for d in torch.randint(1, 6, (ndim,), generator=gen)))
    return shapes


SHAPE_SETS = {
    "empty_and_tiny": [(0,), (5,), (3, 0), (), (1,), (0, 4, 2), (1, 1)],
    "many_small": _many_small_shapes(),
    "large": [(70_003,), (3, 257), (65_536,)],
}


@pytest.mark.parametrize("shape_set", list(SHAPE_SETS))
@pytest.mark.parametrize("name", NAMES)
def test_edge_shapes_match_torch(name: str, shape_set: str) -> None:
    shapes = SHAPE_SETS[shape_set]
    init, grads = make_params(shapes, seed=5), grad_sequence(shapes, 3)
    got = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads)
    ref = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads)
    assert_runs_close(got, ref, OPEN_LOOP_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_thread_count_does_not_change_results(name: str) -> None:
    """reprop splits its work over torch.get_num_threads() threads: the split
    must not change a single bit (e.g. by moving vector/scalar-tail boundaries)."""
    shapes = SHAPE_SETS["large"] + [(37,), (16,)]
    init, grads = make_params(shapes, seed=6), grad_sequence(shapes, 2)
    runs = []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            runs.append(run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads))
    assert_runs_equal(runs[1], runs[0])
    assert_runs_equal(runs[2], runs[0])


# ---------------------------------------------------------------------------
# 5. bfloat16 / float16 parameters: fp32 state and math, one rounding per step
# ---------------------------------------------------------------------------

LOW_PRECISION_LR = {"SGD": 0.1, "Adam": 0.05, "AdamW": 0.05, "Adagrad": 0.1, "RMSprop": 0.01, "Adadelta": 1.0}


def run_low_precision(name: str, dtype: torch.dtype, device: str = "cpu", steps: int = 20) -> None:
    """Reference: torch.optim on an fp32 copy of the parameters, with g.float(),
    rounded to `dtype` after each step (round to nearest even, as Tensor.to).

    The fp32 copy is re-synchronized to reprop's rounded parameter before every
    step (instead of to the reference's own rounded value). Both carry the same
    fp32 state, so each step must then agree to within one rounding, i.e. one
    ulp, without the two rounded trajectories drifting apart over many steps.
    """
    options = {**RICH[name], "lr": LOW_PRECISION_LR[name]}
    shapes = [(37,), (8, 9), (1,), (16,)]
    init = make_params(shapes, seed=21, dtype=dtype, device=device)
    grads = grad_sequence(shapes, steps, dtype=dtype, device=device)
    params = [nn.Parameter(t.clone()) for t in init]
    masters = [nn.Parameter(t.float()) for t in init]
    opt = reprop_cls(name)(params, **options)
    ref = torch_cls(name)(masters, **options)
    exact = total = 0
    for k, step_grads in enumerate(grads):
        for p, m, g in zip(params, masters, step_grads):
            with torch.no_grad():
                m.copy_(p.float())
            p.grad, m.grad = g.clone(), g.float()
        opt.step()
        ref.step()
        for i, (p, m) in enumerate(zip(params, masters)):
            assert p.dtype == dtype
            ulps = ulp_distance(p, m.detach().to(dtype))
            assert ulps.max() <= 1, f"step {k} param {i}: {int(ulps.max())} ulp from the fp32 reference"
            exact += int((ulps == 0).sum())
            total += ulps.numel()
    # A one-ulp difference needs an fp32 result within a few fp32 ulp of a
    # rounding midpoint; anything but rare means the rounding is not RNE.
    assert exact >= 0.97 * total, f"only {exact}/{total} parameter values equal the reference"
    for i, (p, m) in enumerate(zip(params, masters)):
        sg, sr = opt.state[p], ref.state[m]
        assert sorted(sg) == sorted(sr)
        for key, vr in sr.items():
            if key == "step":
                assert sg[key].dtype == torch.float32 and sg[key].item() == vr.item()
            elif vr is not None:
                assert sg[key].dtype == torch.float32, f"state[{key!r}] of a {dtype} param must be float32"
                assert_tensor_close(sg[key], vr, Tol(1e-5, 1e-6), f"param {i} state[{key!r}]")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_low_precision_params(name: str, dtype: torch.dtype) -> None:
    run_low_precision(name, dtype)


def _ties(dtype: torch.dtype, n: int = 64, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Values x of `dtype` and h = half an ulp of x, so that x + h lies exactly
    halfway between x and the next representable value away from zero."""
    x = (torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 3 + 0.5).to(dtype)
    x = torch.where(torch.arange(n) % 2 == 0, x, -x)
    bits = x.view(torch.int16)
    nxt = (bits + 1).view(dtype)  # next magnitude up, same sign
    return x, (nxt.float() - x.float()) / 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_rounds_to_nearest_even(dtype: torch.dtype) -> None:
    x, h = _ties(dtype)
    p = nn.Parameter(x.clone())
    p.grad = (-h).to(dtype)  # exactly representable: a power of two
    assert torch.equal(p.grad.float(), -h)
    rp.SGD([p], lr=1.0).step()  # fp32: x + h exactly, a tie
    expected = (x.float() + h).to(dtype)  # torch rounds to nearest even
    assert torch.equal(p.detach(), expected)
    assert not torch.equal(expected, x) and not torch.equal(expected, (x.view(torch.int16) + 1).view(dtype))


@pytest.mark.parametrize("name", NAMES)
def test_low_precision_state_dict_keeps_fp32_state(name: str) -> None:
    """torch's load_state_dict casts floating state to the param dtype; reprop's
    state must stay float32 after a load, and training must continue exactly."""
    shapes = [(6, 5), (7,)]
    init = make_params(shapes, seed=8, dtype=torch.bfloat16)
    grads = grad_sequence(shapes, 6, dtype=torch.bfloat16)
    straight = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads)
    first = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads[:3])
    params = [nn.Parameter(p.detach().clone()) for p in first.params]
    opt = reprop_cls(name)(params, **RICH[name])
    opt.load_state_dict(copy.deepcopy(first.opt.state_dict()))
    for p in params:
        for key, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == torch.float32, f"state[{key!r}] became {v.dtype} after load_state_dict"
    for step_grads in grads[3:]:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    assert_runs_equal(Run(params, opt), straight)


def _floating_state(st: dict) -> dict:
    """The state tensors torch casts to the param's dtype on load (all but "step")."""
    return {k: v for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", NAMES)
def test_low_precision_load_state_dict_keeps_what_its_hooks_do(name: str) -> None:
    """torch's load_state_dict loads the dict its pre-hooks return, and its
    post-hooks see and may change the loaded state. For low-precision params
    reprop re-read their state from the dict it was given after the
    post-hooks: a pre-hook's change was dropped, a post-hook's undone, and
    Adagrad's post-hooks saw `sum` reset to its initial value."""
    shapes = [(6, 5), (7,)]
    init = make_params(shapes, seed=8, dtype=torch.bfloat16)
    first = run_open_loop(factory(reprop_cls(name), **RICH[name]), init,
                          grad_sequence(shapes, 2, dtype=torch.bfloat16))
    saved = first.opt.state_dict()
    params = [nn.Parameter(t.clone()) for t in init]
    opt = reprop_cls(name)(params, **RICH[name])

    def doubled(_, state_dict: dict) -> dict:
        state = {i: {**st, **{k: 2 * v for k, v in _floating_state(st).items()}}
                 for i, st in state_dict["state"].items()}
        return {**state_dict, "state": state}

    seen = []

    def record_then_zero_first_key(o: torch.optim.Optimizer) -> None:
        seen.extend({k: v.clone() for k, v in _floating_state(o.state[p]).items()} for p in params)
        for p in params:
            next(iter(_floating_state(o.state[p]).values())).zero_()

    opt.register_load_state_dict_pre_hook(doubled)
    opt.register_load_state_dict_post_hook(record_then_zero_first_key)
    opt.load_state_dict(saved)
    for i, p in enumerate(params):
        expected = {k: 2 * v for k, v in _floating_state(saved["state"][i]).items()}
        assert all(v.dtype == torch.float32 for v in expected.values())
        torch.testing.assert_close(seen[i], expected, rtol=0, atol=0)
        first_key = next(iter(expected))
        expected[first_key] = torch.zeros_like(expected[first_key])
        torch.testing.assert_close(_floating_state(opt.state[p]), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_mixed_dtypes_in_one_group(name: str) -> None:
    """A group holding fp32, bf16 and fp16 params updates each exactly as when
    each dtype has an optimizer of its own."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
    init = [make_params([(5, 3)], seed=30 + i, dtype=d)[0] for i, d in enumerate(dtypes)]
    grads = [[g.to(d) for g, d in zip(step, dtypes)] for step in grad_sequence([(5, 3)] * len(dtypes), 4)]
    mixed = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads)
    for i in range(len(dtypes)):
        alone = run_open_loop(factory(reprop_cls(name), **RICH[name]), [init[i]], [[g[i]] for g in grads])
        assert_runs_equal(Run([mixed.params[i]], mixed.opt), alone)


# ---------------------------------------------------------------------------
# 6. The Optimizer API: closures, zero_grad, groups, hooks, None grads, step_params
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_closure(name: str, batches) -> None:
    calls = []
    got, ref = train_pair(name, RICH[name], batches[:10], use_closure=True)
    assert_runs_close(got, ref, TRAIN_TOL[name])

    model = make_model()
    opt = reprop_cls(name)(model.parameters(), **RICH[name])
    x, y = batches[0]

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert len(calls) == 1 and isinstance(loss, torch.Tensor)
    assert loss.item() == pytest.approx(F.mse_loss(make_model()(x), y).item())
    assert opt.step() is None


@pytest.mark.parametrize("name", NAMES)
def test_zero_grad_set_to_none(name: str, batches) -> None:
    run = train_model(factory(reprop_cls(name), **RICH[name]), batches[:3])
    run.opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in run.params)
    before = copy.deepcopy(run.opt.state_dict()), [p.detach().clone() for p in run.params]
    run.opt.step()  # nothing has a gradient: nothing changes, no step counted
    after = run.opt.state_dict(), run.params
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
    for i, s in before[0]["state"].items():
        for k, v in s.items():
            assert torch.equal(after[0]["state"][i][k], v), (i, k)


@pytest.mark.parametrize("name", NAMES)
def test_zero_grad_keep_zeros(name: str) -> None:
    """Zero gradients are gradients: steps count, weight decay and momentum act."""
    shapes = [(4, 4), (7,)]
    init = make_params(shapes, seed=9)
    zeros = [torch.zeros(s) for s in shapes]
    grads = grad_sequence(shapes, 3) + [zeros] * 3
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        run = run_open_loop(factory(cls, **RICH[name]), init, grads[:3])
        for _ in range(3):
            run.opt.zero_grad(set_to_none=False)
            assert all(p.grad is not None and not p.grad.any() for p in run.params)
            run.opt.step()
        runs.append(run)
    assert_runs_close(*runs, OPEN_LOOP_TOL)


def _torch_adagrad_steps_added_groups() -> bool:
    """Whether torch's own Adagrad steps a group added after construction, the
    reference these tests need: older torch (2.8 to 2.11) makes `sum` in __init__ only,
    and its step() raises KeyError: 'sum' for such a group."""
    opt = torch.optim.Adagrad([nn.Parameter(torch.zeros(1))])
    added = nn.Parameter(torch.zeros(1))
    added.grad = torch.zeros(1)
    opt.add_param_group({"params": [added]})
    try:
        opt.step()
    except KeyError:
        return False
    return True


TORCH_ADAGRAD_STEPS_ADDED_GROUPS = _torch_adagrad_steps_added_groups()

NO_TORCH_ADAGRAD_ADDED_GROUPS = "this torch's Adagrad cannot step a group added later (KeyError: 'sum')"


def torch_steps_added_groups(name: str) -> bool:
    """Whether torch's `name` steps a group added after construction (all but
    Adagrad up to torch 2.11)."""
    return name != "Adagrad" or TORCH_ADAGRAD_STEPS_ADDED_GROUPS


@pytest.mark.parametrize("name", NAMES)
def test_add_param_group(name: str) -> None:
    if not torch_steps_added_groups(name):
        pytest.skip(NO_TORCH_ADAGRAD_ADDED_GROUPS)
    shapes = [(4, 3), (6,), (5, 2), (3,)]
    init, grads = make_params(shapes, seed=12), grad_sequence(shapes, 6)
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params[:2], **RICH[name])
        for k, step_grads in enumerate(grads):
            if k == 3:
                opt.add_param_group({"params": params[2:], "lr": RICH[name]["lr"] * 0.3, "weight_decay": 0.05})
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(*runs, OPEN_LOOP_TOL)


@pytest.mark.skipif("decoupled_weight_decay" not in inspect.signature(torch.optim.Adam).parameters,
                    reason="torch < 2.6: AdamW always decouples, its groups have no such key")
def test_adamw_group_with_coupled_weight_decay_matches_torch() -> None:
    """torch's AdamW reads decoupled_weight_decay per group: a group that
    sets it False gets Adam's L2 weight decay. reprop decoupled the decay of
    every AdamW group (0.3 off after 3 steps)."""
    shapes = [(4, 3), (6,), (5, 2)]
    init, grads = make_params(shapes, seed=13), grad_sequence(shapes, 4)
    group1 = {"weight_decay": 0.5, "decoupled_weight_decay": False}
    runs = [run_open_loop(factory(cls, **RICH["AdamW"]), init, grads, group1=group1)
            for cls in (rp.AdamW, torch.optim.AdamW)]
    assert not runs[0].opt.param_groups[1]["decoupled_weight_decay"]
    assert_runs_close(*runs, OPEN_LOOP_TOL)


@pytest.mark.skipif(not TORCH_ADAGRAD_STEPS_ADDED_GROUPS, reason=NO_TORCH_ADAGRAD_ADDED_GROUPS)
def test_adagrad_sum_of_an_added_group_starts_at_the_constructor_value() -> None:
    """torch's Adagrad creates the `sum` of a group added later at its first
    step from defaults["initial_accumulator_value"]; the group's own value
    plays no part."""
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=15), grad_sequence(shapes, 3)
    runs = []
    for cls in (rp.Adagrad, torch.optim.Adagrad):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params[:1], lr=0.1, initial_accumulator_value=0.5)
        opt.add_param_group({"params": params[1:], "initial_accumulator_value": 2.0})
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(*runs, OPEN_LOOP_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_adagrad_low_precision_sum_starts_at_the_constructor_value(dtype: torch.dtype) -> None:
    """torch's __init__ fills `sum` from the constructor's
    initial_accumulator_value also for a group given its own; reprop remakes
    the sum of low-precision params in float32 with that same value."""
    def groups():
        return [{"params": [nn.Parameter(torch.ones(3, dtype=dtype))]},
                {"params": [nn.Parameter(torch.ones(3, dtype=dtype))], "initial_accumulator_value": 2.0}]

    got = rp.Adagrad(groups(), lr=0.1, initial_accumulator_value=0.5)
    ref = torch.optim.Adagrad(groups(), lr=0.1, initial_accumulator_value=0.5)
    for g, r in zip(got.param_groups, ref.param_groups):
        s, expected = got.state[g["params"][0]]["sum"], ref.state[r["params"][0]]["sum"].float()
        assert s.dtype == torch.float32 and torch.equal(s, expected), f"sum {s} != torch's {expected}"


@pytest.mark.parametrize("name", NAMES)
def test_step_hooks_fire(name: str) -> None:
    p = nn.Parameter(torch.ones(3))
    opt = reprop_cls(name)([p], **RICH[name])
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o, p.detach().clone())))
    handle = opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o, p.detach().clone())))
    p.grad = torch.full((3,), 0.5)
    opt.step()
    assert [s[0] for s in seen] == ["pre", "post"] and all(s[1] is opt for s in seen)
    assert torch.equal(seen[0][2], torch.ones(3)) and not torch.equal(seen[1][2], torch.ones(3))
    handle.remove()
    opt.step()
    assert [s[0] for s in seen] == ["pre", "post", "pre"]


@pytest.mark.parametrize("name", NAMES)
def test_params_without_grad_are_skipped(name: str) -> None:
    """Param 1 gets a gradient every other step, param 2 never: their step
    counts, state (or its absence) and values must be torch's."""
    shapes = [(3, 4), (5,), (6,), (2, 2)]
    init, full = make_params(shapes, seed=13), grad_sequence(shapes, 6)
    grads = [[g[0], g[1] if k % 2 == 0 else None, None, g[3]] for k, g in enumerate(full)]
    got = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads)
    ref = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads)
    assert_runs_close(got, ref, OPEN_LOOP_TOL)
    assert torch.equal(got.params[2], init[2])


@pytest.mark.parametrize("name", NAMES)
def test_a_step_without_gradients_reads_no_hyper_parameter(name: str) -> None:
    """A step in which no param has a gradient changes nothing and, as
    torch's, reads no hyper-parameter (a str lr, which both refuse once a
    param has a gradient), also with the plan cached by an earlier step,
    whose gradients the C fast path reads before any setting is looked at."""
    for cls in (torch_cls(name), reprop_cls(name)):
        params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]
        opt = cls(params, **RICH[name])
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()
        before = [p.tolist() for p in params], _state_snapshot(opt, params)
        opt.param_groups[0]["lr"] = "0.1"
        opt.step()
        assert before == ([p.tolist() for p in params], _state_snapshot(opt, params))
        params[1].grad = torch.ones_like(params[1])
        with pytest.raises(TypeError):
            opt.step()


class _PlanSpy:
    """Counts the pointer tables (_Plan) built from now on, and the table rows
    of those still alive (held by an optimizer's cache)."""

    def __init__(self, monkeypatch):
        self.builds, self._built = 0, []
        init = rp._Plan.__init__

        def counting_init(plan, *args):
            self.builds += 1
            self._built.append(weakref.ref(plan))
            init(plan, *args)

        monkeypatch.setattr(rp._Plan, "__init__", counting_init)

    def rows_held(self) -> int:
        gc.collect()
        return sum(len(plan.params) for plan in (ref() for ref in self._built) if plan is not None)


@pytest.mark.parametrize("name", NAMES)
def test_a_different_subset_with_gradients_each_step_reuses_one_plan(name: str,
                                                                    monkeypatch) -> None:
    """LayerDrop, experts without tokens: a different subset of the params has
    a gradient at each step. The group's plan serves every subset (a row whose
    param has no gradient sits the step out), so once each param has had its
    first gradient (steps 0 and 1) no plan is built and the cache holds the
    group's rows once: a plan per subset, built in O(params) and kept, grew
    memory with every new subset (+125 MiB over 300 steps of a 1000-param
    model). Results stay torch's, and a param that sits a step out is not
    written (its version stays), as torch leaves it."""
    shapes = [(3,), (2, 2), (5,), (1,), (4,), (3, 2)]
    init, full = make_params(shapes, seed=21), grad_sequence(shapes, 14)
    gen = torch.Generator().manual_seed(5)
    masks = [[i % 2 == 0 for i in range(6)], [i % 2 == 1 for i in range(6)]]
    masks += [(torch.rand(6, generator=gen) < 0.6).tolist() for _ in range(12)]
    assert len({tuple(m) for m in masks}) > 8
    grads = [[g if m else None for g, m in zip(step, mask)] for step, mask in zip(full, masks)]
    spy = _PlanSpy(monkeypatch)
    got = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads)
    ref = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads)
    assert_runs_close(got, ref, OPEN_LOOP_TOL)
    assert spy.builds <= 2 and spy.rows_held() == len(shapes)
    versions = [p._version for p in got.params]
    for p, g in zip(got.params, full[0]):
        p.grad = g.clone() if p is not got.params[2] else None
    got.opt.step()
    assert [p._version > v for p, v in zip(got.params, versions)] == [i != 2 for i in range(6)]
    assert spy.builds <= 2


# Which of 4 params have a gradient at each step, for the step table of the
# rows taking part: kept while they stay the same (steps 1, 7, 9), the C fast
# path writing the new gradients' pointers into it; rebuilt when they change
# to as many other rows (4, 11), to a prefix of them (5), to more (3, 6, 12),
# to fewer (10, from all). Steps 2 and 8 build a plan (a first gradient), in
# which param 2 (then 3) starts a new SGD buffer while others sit out: the
# core clears its fresh flag in the step table's copy of its row only.
FROZEN_MASKS = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [1, 0, 1, 0], [0, 1, 1, 0],
                [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1],
                [1, 1, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize("name", NAMES)
def test_rows_taking_part_keep_their_step_table_while_unchanged(name: str,
                                                                 monkeypatch) -> None:
    """The step table of the rows with a gradient is reused while the same
    rows have one and rebuilt when they change (FROZEN_MASKS): results are
    torch's, a param without a gradient and its state are untouched bitwise,
    and a table is built only at a change."""
    shapes = [(3,), (2, 2), (5,), (4,)]
    init, full = make_params(shapes, seed=23), grad_sequence(shapes, len(FROZEN_MASKS))
    runs, built_at, step = [], set(), 0
    take_part = rp._Plan._take_part

    def noting_take_part(plan, rows):
        built_at.add(step)
        take_part(plan, rows)

    monkeypatch.setattr(rp._Plan, "_take_part", noting_take_part)
    for cls in (reprop_cls(name), torch_cls(name)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **RICH[name])
        for step, (mask, grads) in enumerate(zip(FROZEN_MASKS, full)):
            frozen = [p for p, m in zip(params, mask) if not m]
            values, state = [p.detach().clone() for p in frozen], _state_snapshot(opt, frozen)
            for p, g, m in zip(params, grads, mask):
                p.grad = g.clone() if m else None
            opt.step()
            assert all(torch.equal(p, v) for p, v in zip(frozen, values)), f"step {step}"
            assert _state_snapshot(opt, frozen) == state, f"step {step}"
        runs.append(Run(params, opt))
    assert_runs_close(runs[0], runs[1], OPEN_LOOP_TOL)
    assert sorted(built_at) == [0, 2, 3, 4, 5, 6, 8, 10, 11, 12]


def test_plans_of_thousands_of_modules_are_not_rebuilt(monkeypatch) -> None:
    """Backward fusion updates each module's params in a call of their own,
    one plan per (module, group). The cache was cleared when it held 4096
    plans, so with more the cyclic access of a step missed always and every
    plan was rebuilt at every step (4200 Linears: 4200 rebuilds a step, 533
    ms instead of 368). Bounded by the rows held, which grows with the
    parameter count, it keeps them all: a second round builds none."""
    modules = 4100
    params = [nn.Parameter(torch.zeros(1)) for _ in range(modules)]
    opt = rp.SGD(params, lr=0.5)
    for p in params:
        p.grad = torch.ones(1)
    spy = _PlanSpy(monkeypatch)
    for _ in range(2):
        for p in params:
            opt.step_params([p])
    assert spy.builds == modules
    assert all(torch.equal(p.detach(), torch.full((1,), -1.0)) for p in params)


def test_plan_cache_key_is_the_ids_of_the_call_params() -> None:
    """The plan cache's key of a call's params (_C.optim_call_key) is their
    ids in order, packed as bytes (a tuple of ids cost an int object per
    param each step); anything but a sequence is refused, naming params."""
    params = [nn.Parameter(torch.zeros(1)) for _ in range(3)]
    key = _C.optim_call_key(params)
    assert key == np.array([id(p) for p in params], dtype=np.uintp).tobytes()
    assert _C.optim_call_key(tuple(params)) == key != _C.optim_call_key(params[::-1])
    assert _C.optim_call_key([]) == b""
    with pytest.raises(TypeError, match="params must be a sequence"):
        _C.optim_call_key(params[0].grad)


def test_plans_of_ever_new_param_lists_stay_bounded(monkeypatch) -> None:
    """step_params on a new list of params at each call (every 7 of 14):
    the plans held stay within the cache's row budget (4096 rows here, a
    floor), the least recently used going first, so that the plan of step(),
    used between any two of them, is never rebuilt."""
    params = [nn.Parameter(torch.zeros(2)) for _ in range(14)]
    opt = rp.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones(2)
    opt.step()
    spy = _PlanSpy(monkeypatch)
    subsets = list(itertools.combinations(params, 7))
    for subset in subsets:
        opt.step_params(subset)
        opt.step()
    assert spy.builds == len(subsets)
    assert spy.rows_held() <= 4096 < 7 * len(subsets)


def test_calls_of_float64_params_only_stay_bounded() -> None:
    """step_params on ever new lists of float64 params, which torch's step()
    updates (no table rows): each cached call counts its params as rows, so
    the calls held stay within the row budget (4096), as other calls do;
    counted as no rows, they were never evicted (3432 held here)."""
    params = [nn.Parameter(torch.zeros(2, dtype=torch.float64)) for _ in range(14)]
    opt = rp.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones(2, dtype=torch.float64)
    for subset in itertools.combinations(params, 7):
        opt.step_params(subset)
    assert opt._plans.rows <= 4096 and len(opt._plans) <= 4096 // 7


@pytest.mark.parametrize("name", NAMES)
def test_state_tensors_replaced_by_the_user_are_used(name: str) -> None:
    """Replacing a state tensor (or the step) between steps, as some training
    code does to reset an optimizer, must act on the new tensor: the cached
    pointer table may not keep writing into the old one."""
    def zero_each_tensor(opt, p: nn.Parameter) -> None:
        st = opt.state[p]
        for key, value in list(st.items()):
            st[key] = torch.zeros_like(value) if torch.is_tensor(value) else value

    _trains_as_torch_with_state_reset_by_hand(name, zero_each_tensor)


def _trains_as_torch_with_state_reset_by_hand(name: str, reset) -> None:
    """Four steps of reprop's and torch's `name`, reset(opt, p) after the
    second: the params and state end as torch's."""
    a = nn.Parameter(torch.linspace(-1.0, 1.0, 7))
    b = nn.Parameter(a.detach().clone())
    ours = reprop_cls(name)([a], **RICH[name])
    ref = torch_cls(name)([b], **RICH[name])
    for k in range(4):
        for p, opt in ((a, ours), (b, ref)):
            p.grad = torch.full_like(p, 0.1 * (k + 1))
            opt.step()
            if k == 1:
                reset(opt, p)
    assert_tensor_close(a.detach(), b.detach(), OPEN_LOOP_TOL, "param")
    for key, value in ref.state[b].items():
        assert_tensor_close(ours.state[a][key], value.float(), OPEN_LOOP_TOL, f"state[{key!r}]")


@pytest.mark.parametrize("name", NAMES)
def test_step_marks_params_modified_in_place(name: str) -> None:
    """The kernels write through raw pointers; autograd must still learn of it,
    so that backward through a graph saved before the step fails loudly, as
    with torch.optim, instead of using the new values."""
    w = nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3, requires_grad=True)
    loss = (x @ w).square().sum()
    w.grad = torch.ones_like(w)
    opt = reprop_cls(name)([w], **RICH[name])
    version = w._version
    opt.step()
    assert w._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("name", NAMES)
def test_step_under_allow_mutation_on_saved_tensors_matches_torch(name: str) -> None:
    """Inside torch.autograd.graph.allow_mutation_on_saved_tensors(), torch
    clones a saved parameter before torch.optim's in-place update, so a
    backward after step() uses the weight of the forward; the fused kernels,
    which write through raw pointers, must have it cloned too."""
    grads = {}
    for make in (torch_cls, reprop_cls):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        x = torch.randn(5, 4, requires_grad=True)
        for p in model.parameters():
            p.grad = torch.ones_like(p)  # the gradients of an earlier backward
        opt = make(name)(model.parameters(), **RICH[name])
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            loss = model(x).square().sum()  # saves the weight
            opt.step()
            loss.backward(inputs=[x])
        grads[make] = (x.grad, model.weight.detach().clone())
    (got, weight), (expected, ref_weight) = grads[reprop_cls], grads[torch_cls]
    assert torch.equal(got, expected)  # the same weight and input: the same bits
    assert_tensor_close(weight, ref_weight, STEP_TOL, "weight")


STATE_SAVED = {"SGD": "momentum_buffer", "Adam": "exp_avg", "AdamW": "exp_avg_sq",
               "Adagrad": "sum", "RMSprop": "grad_avg", "Adadelta": "acc_delta"}


@pytest.mark.parametrize("make", [torch_cls, reprop_cls], ids=["torch", "reprop"])
@pytest.mark.parametrize("name", NAMES)
def test_state_saved_by_autograd_is_cloned_before_a_step(name: str, make) -> None:
    """What allow_mutation_on_saved_tensors() does for state tensors that a
    graph saved (torch.optim updates them in place too): a backward after
    each of two steps sees the state of its own forward, so the state's
    version must change with each fused update."""
    w = nn.Parameter(torch.randn(3, 4))
    opt = make(name)([w], **RICH[name])
    w.grad = torch.randn(3, 4)
    opt.step()  # creates the state
    state = opt.state[w][STATE_SAVED[name]]
    x = torch.randn(3, 4, requires_grad=True)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        for _ in range(2):
            before = state.clone()
            loss = (x * state).sum()  # saves the state tensor
            opt.step()
            assert not torch.equal(state, before)
            (got,) = torch.autograd.grad(loss, x)
            assert torch.equal(got, before)


def _fresh_open_loop(name: str, shapes, *, seed: int = 14) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
    params = [nn.Parameter(t) for t in make_params(shapes, seed=seed)]
    opt = reprop_cls(name)(split_groups(params, group1_overrides(name, RICH[name])), **RICH[name])
    return opt, params


@pytest.mark.parametrize("name", NAMES)
def test_step_params_equals_step(name: str) -> None:
    """step_params on every parameter once (in any order, one at a time or in
    batches) is one step(), bitwise."""
    shapes = [(3, 4), (5,), (16,), (16,), (2, 3, 2)]
    grads = grad_sequence(shapes, 4)
    whole, params_a = _fresh_open_loop(name, shapes)
    parts, params_b = _fresh_open_loop(name, shapes)
    for k, step_grads in enumerate(grads):
        for pa, pb, g in zip(params_a, params_b, step_grads):
            pa.grad, pb.grad = g.clone(), g.clone()
        whole.step()
        if k % 2 == 0:
            for p in reversed(params_b):
                parts.step_params([p])
        else:
            parts.step_params(params_b[3:])
            parts.step_params(params_b[:3])
    assert_runs_equal(Run(params_b, parts), Run(params_a, whole))


def test_updates_have_a_profiler_range_only_while_profiling(monkeypatch) -> None:
    """The kernels' update shows in torch.profiler as a range of its own,
    from step() and from step_params() (what reprop.fuse calls: its updates
    were the self time of autograd's AccumulateGrad, or no row at all); with
    no profiler running no record_function is entered (about 8 us a call;
    step_params, which torch's step() wrapper, entering its own, does not wrap)."""
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
    opt = reprop_cls("AdamW")(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    for update in (opt.step, lambda: opt.step_params(params[1:])):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            update()
        assert [e.name for e in prof.events()].count("reprop.optim.update") == 1

    def refused(name):
        raise AssertionError(f"record_function({name!r}) entered without a profiler")
    monkeypatch.setattr(torch.autograd.profiler, "record_function", refused)
    opt.step_params(params)


class _FastPathSpy:
    """reprop._C, noting whether each call of the per-step fast path
    (optim_grad_pointers) could read every gradient (True) or left the step
    to the Python path (False)."""

    def __init__(self):
        self.read = []

    def __getattr__(self, name: str):
        return getattr(_C, name)

    def optim_grad_pointers(self, *args):
        read = _C.optim_grad_pointers(*args)
        self.read.append(read is not None)
        return read


@pytest.mark.parametrize("name", NAMES)
def test_given_gradients_take_the_fast_path_with_the_checks_of_grad(name: str,
                                                                   monkeypatch) -> None:
    """Forward fusion applies the gradients step() held through
    _update(given=), as step_params(grads=) does: the C fast path reads them as
    it reads .grad (the Python path cost 2.5 us more a param), with the same
    checks. One it cannot read as it is (with torch's negative bit at step 2,
    transposed at step 3) goes to the Python path, which resolves or copies
    it; a param given None sits the step out (step 4); one of another dtype or
    shape is refused. The updates equal step()'s from the same gradients in
    .grad, bit for bit."""
    shapes = [(4, 3), (5,), (1,)]
    init, grads = make_params(shapes, seed=43), grad_sequence(shapes, 6)
    grads[2][0] = _negative_bit(grads[2][0])
    grads[3][0] = grads[3][0].t().contiguous().t()
    grads[4][1] = None
    spy = _FastPathSpy()
    monkeypatch.setattr(rp, "_C", spy)
    given = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, [])
    for step_grads in grads:
        given.opt.step_params(given.params, grads=step_grads)
    assert spy.read == [True, True, False, False, True, True]
    ref = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads)
    assert_runs_close(given, ref, Tol(rtol=0.0, atol=0.0))
    snapshot = lambda: [(p.detach().clone(), copy.deepcopy(given.opt.state[p])) for p in given.params]
    before = snapshot()
    for bad in (grads[0][0].double(), grads[0][0].reshape(3, 4)):
        with pytest.raises(ValueError, match=r"grads: a gradient of shape \(\d, \d\), torch\.float"):
            given.opt.step_params(given.params, grads=[bad, *grads[0][1:]])
    for (p, st), (p0, st0) in zip(snapshot(), before):
        assert torch.equal(p, p0) and st.keys() == st0.keys()
        assert all(torch.equal(st[key], st0[key]) for key in st)


@pytest.mark.parametrize("name", NAMES)
def test_step_params_touches_only_its_params(name: str) -> None:
    shapes = [(3, 4), (5,), (6,)]
    opt, params = _fresh_open_loop(name, shapes)
    before = [p.detach().clone() for p in params]
    state_before = copy.deepcopy(opt.state_dict()["state"])
    for p, g in zip(params, grad_sequence(shapes, 1)[0]):
        p.grad = g
    opt.step_params([params[2]])  # in the second group: its hyper-parameters apply
    assert torch.equal(params[0], before[0]) and torch.equal(params[1], before[1])
    assert not torch.equal(params[2], before[2])
    state = opt.state_dict()["state"]
    for i in (0, 1):
        assert {k: v.tolist() for k, v in state.get(i, {}).items()} == {
            k: v.tolist() for k, v in state_before.get(i, {}).items()
        }
    if name != "SGD":
        assert state[2]["step"].item() == 1.0

    ref_params = [nn.Parameter(t) for t in make_params(shapes, seed=14)]
    ref = torch_cls(name)(split_groups(ref_params, group1_overrides(name, RICH[name])), **RICH[name])
    ref_params[2].grad = params[2].grad.clone()
    ref.step()
    assert_tensor_close(params[2], ref_params[2], STEP_TOL, "param 2")


def test_native_step_rejects_codes_past_int() -> None:
    # kind 2**32 was truncated to 0 and ran SGD
    table, hparams = np.zeros((1, 8), np.int64), (0.1,) * 10 + (False,) * 5
    with pytest.raises(OverflowError, match=r"^kind: expected an int in \[-2147483648, 2147483647\], got 4294967296"):
        _C.optim_step(2**32, 0, table, hparams, 1)
    with pytest.raises(OverflowError, match=r"^dtype: expected an int in .*, got -4294967296"):
        _C.optim_step(0, -2**32, table, hparams, 1)
    with pytest.raises(OverflowError, match=r"^num_threads: expected an int in .*, got 4294967297"):
        _C.optim_step(0, 0, table, hparams, 2**32 + 1)


@pytest.mark.parametrize("name", NAMES)
def test_step_params_rejects_foreign_param(name: str) -> None:
    opt, params = _fresh_open_loop(name, [(3,), (4,)])
    stranger = nn.Parameter(torch.randn(7, 2))
    stranger.grad = torch.randn(7, 2)
    params[0].grad = torch.randn(3)
    before = params[0].detach().clone()
    with pytest.raises(ValueError):
        opt.step_params([params[0], stranger])
    assert torch.equal(params[0], before), "a rejected call must not update anything"


def _bad_step_params_calls(opt: torch.optim.Optimizer, p: nn.Parameter) -> dict:
    """step_params arguments that are not what it takes: (kwargs, exception
    type, the start of its message after any 'Class: param_groups[i]: ')."""
    group = opt.param_groups[0]
    partial = {k: v for k, v in group.items() if k not in ("params", "lr")}
    return {
        "grads-list": ({"grads": [[1.0] * p.numel()]}, TypeError, r"grads\[0\]: expected a tensor"),
        "grads-ndarray": ({"grads": [np.ones(p.shape, np.float32)]}, TypeError,
                          r"grads\[0\]: expected a tensor"),
        "params-int": ({"params": [1]}, TypeError, r"params\[0\]: expected a parameter"),
        "settings-list": ({"settings": [1]}, TypeError, r"settings: expected a dict"),
        "settings-int": ({"settings": {id(group): 1}}, TypeError, r"settings: expected a dict"),
        "settings-empty": ({"settings": {id(group): {}}}, ValueError,
                           r"settings: the hyper-parameters given for param_groups\[0\] lack .*'lr'"),
        "settings-no-lr": ({"settings": {id(group): partial}}, ValueError,
                           r"settings: the hyper-parameters given for param_groups\[0\] lack 'lr'$"),
    }


@pytest.mark.parametrize("name", NAMES)
def test_step_params_bad_arguments_name_the_argument(name: str) -> None:
    """Arguments of the wrong kind raise TypeError or ValueError naming
    params, grads or settings, before anything changes. They gave
    AttributeError ('list' object has no attribute 'shape'/'get'), KeyError
    'lr', or for a NumPy gradient 'float32 ... does not match torch.float32'."""
    opt, params = _fresh_open_loop(name, [(3,), (4,)])
    p = params[0]
    p.grad = torch.randn(3)
    for case, (kwargs, error, message) in _bad_step_params_calls(opt, p).items():
        before, state = p.detach().clone(), _state_snapshot(opt, [p])
        with pytest.raises(error, match=message):
            opt.step_params(kwargs.pop("params", [p]), **kwargs)
        assert torch.equal(p.detach(), before), case
        assert _state_snapshot(opt, [p]) == state, case
    opt.step_params([p], settings={id(opt.param_groups[0]): dict(opt.param_groups[0])})
    assert not torch.equal(p.detach(), before)


@pytest.mark.parametrize("name", NAMES)
def test_a_cached_plan_refuses_a_meta_gradient_as_the_first_call_does(name: str) -> None:
    """A meta gradient for a CPU param: the first call names the mismatch,
    but once the plan was cached the C fast path took it (get_device() is -1
    for both) and the core refused its null pointer ("entry 0: null param or
    grad pointer"). It now leaves the row to the Python path, whose message
    is the first call's; nothing changes."""
    opt, params = _fresh_open_loop(name, [(4,)])
    p = params[0]
    opt.step_params([p], grads=[torch.randn(4)])  # builds the plan
    before, state = p.detach().clone(), _state_snapshot(opt, [p])
    with pytest.raises(ValueError, match=r"grads: a gradient of shape \(4,\), torch.float32 on meta does "
                                         r"not match its parameter"):
        opt.step_params([p], grads=[torch.empty(4, device="meta")])
    assert torch.equal(p.detach(), before) and _state_snapshot(opt, [p]) == state


def _assert_untouched(opt: torch.optim.Optimizer, p: torch.Tensor, state: dict,
                      param: torch.Tensor) -> None:
    """p and its state are as `state` and `param` (copies taken before a
    refused step) hold them: the same keys, in order, and values."""
    assert torch.equal(p.detach(), param)
    assert list(opt.state[p]) == list(state)
    for k, v in state.items():
        assert torch.equal(opt.state[p][k], v), k


def _state_snapshot(opt: torch.optim.Optimizer, params: list) -> list:
    """Each param's state as comparable values: {key: list of floats}."""
    return [{k: torch.as_tensor(v).tolist() for k, v in opt.state.get(p, {}).items()}
            for p in params]


@pytest.mark.parametrize("name", NAMES)
def test_step_params_rejects_repeated_param(name: str) -> None:
    """A parameter listed twice in one call is refused, naming params, before
    anything changes (one fused call would update it twice, or fail after
    creating state), whether its group or another group's param comes first."""
    opt, params = _fresh_open_loop(name, [(3,), (4,)])
    for p in params:
        p.grad = torch.randn(p.shape)
    before = [p.detach().clone() for p in params]
    state_before = _state_snapshot(opt, params)
    for call in ([params[0], params[0]], [params[1], params[0], params[1]]):
        with pytest.raises(ValueError, match=r"params\[\d\]: the same parameter as params\[\d\]"):
            opt.step_params(call)
    for p, b in zip(params, before):
        assert torch.equal(p, b), "a refused call must not update anything"
    assert _state_snapshot(opt, params) == state_before, "a refused call must create no state"
    opt.step_params(params)  # and the optimizer steps on
    assert not torch.equal(params[0], before[0])



# ---- mutation audit (mut_optim): what no test above would catch ----


@pytest.mark.parametrize("name", NAMES)
def test_step_params_settings_are_the_hyper_parameters_used(name: str) -> None:
    """settings[id(group)] replaces the group's hyper-parameters for that call
    (a deferred update applies the lr of the moment it was decided): the
    update equals torch's with the settings' values, not the group's, and
    the group keeps its own. An update that read the group instead passed
    every test (they gave a copy of the group as settings)."""
    shapes = [(5,), (3, 2)]
    params = [nn.Parameter(t) for t in make_params(shapes, seed=5)]
    opt = reprop_cls(name)(params, **RICH[name])
    own = dict(opt.param_groups[0])
    settings = dict(own, lr=own["lr"] * 3, weight_decay=0.25)
    refs = [nn.Parameter(p.detach().clone()) for p in params]
    ref = torch_cls(name)(refs, **RICH[name])
    ref.param_groups[0].update((k, v) for k, v in settings.items() if k != "params")
    for step_grads in grad_sequence(shapes, 3):
        for p, r, g in zip(params, refs, step_grads):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step_params(params, settings={id(opt.param_groups[0]): settings})
        ref.step()
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]) == (
        own["lr"], own["weight_decay"])
    for p, r in zip(params, refs):
        assert_tensor_close(p.detach(), r.detach(), OPEN_LOOP_TOL, "param")


@pytest.mark.parametrize("name", NAMES)
def test_step_params_checks_every_groups_settings_before_updating_any(name: str) -> None:
    """A call over params of two groups whose second group's settings are
    refused changes nothing: neither group's params nor state (the checks of
    all groups run before the first group is updated)."""
    opt, params = _fresh_open_loop(name, [(3,), (4,)])
    groups = opt.param_groups
    assert len(groups) == 2 and all(len(g["params"]) == 1 for g in groups)
    for p in params:
        p.grad = torch.randn(p.shape)
    before, state = [p.detach().clone() for p in params], _state_snapshot(opt, params)
    settings = {id(groups[0]): dict(groups[0]), id(groups[1]): {"lr": 0.1}}
    with pytest.raises(ValueError, match=r"settings: the hyper-parameters given for param_groups\[1\] lack"):
        opt.step_params(params, settings=settings)
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b), "the first group must not be updated"
    assert _state_snapshot(opt, params) == state


@pytest.mark.parametrize("name, options", [
    ("SGD", {"momentum": 0.9, "weight_decay": 0.1}), ("SGD", {"momentum": 0.9}),
    ("SGD", {"weight_decay": 0.1}), ("Adam", {"weight_decay": 0.1}), ("Adam", {}),
    ("Adam", {"weight_decay": 0.1, "decoupled_weight_decay": True}), ("AdamW", {"weight_decay": 0.1}),
    ("Adagrad", {"weight_decay": 0.1}), ("RMSprop", {"weight_decay": 0.1}),
    ("Adadelta", {"weight_decay": 0.1}), ("Adadelta", {})])
def test_reads_param_into_state_says_whether_torchs_state_depends_on_the_param(
        name: str, options: dict) -> None:
    """_reads_param_into_state (which fusion's message for a swapped param
    relies on) is true exactly where torch's optimizer state after a step
    depends on the param's values: two runs from different params with the
    same gradients end with different state."""
    states = []
    for start in (torch.linspace(-1.0, 1.0, 5), torch.linspace(2.0, 3.0, 5)):
        p = nn.Parameter(start)
        opt = torch_cls(name)([p], lr=0.1, **options)
        for k in range(2):
            p.grad = torch.full_like(p, 0.5 * (k + 1))
            opt.step()
        states.append({k: v for k, v in opt.state[p].items() if k != "step"})
    depends = any(not torch.equal(states[0][k], states[1][k]) for k in states[0])
    ours = reprop_cls(name)([nn.Parameter(torch.zeros(5))], lr=0.1, **options)
    assert ours._reads_param_into_state(ours.param_groups[0]) is depends


def test_a_stale_plan_rebuilt_under_its_key_keeps_the_count_of_rows() -> None:
    """A plan gone stale (a param's .data replaced) is rebuilt and cached
    under the same key, replacing the old entry: the cache's count of rows
    stays that of the plans it holds. Counted without taking the old
    entry's rows off, it grew by the call's rows at every rebuild, and the
    cache evicted live plans long before its budget."""
    params = [nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = rp.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(4):
        params[0].data = torch.randn(4)  # the plan of the group's call goes stale
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    assert len(opt._plans) == 1
    assert opt._plans.rows == 3


def test_sgd_without_momentum_keeps_no_state_entries_as_torch() -> None:
    """torch's SGD without momentum puts no entry into `state` (not even an
    empty dict), so its state_dict()["state"] is {}; reprop's, by step() and
    step_params() alike, matches (empty entries would show up in the saved
    dict as {0: {}, 1: {}})."""
    params = [nn.Parameter(t) for t in make_params([(3,), (2, 2)], seed=3)]
    refs = [nn.Parameter(p.detach().clone()) for p in params]
    opt = rp.SGD(params, lr=0.1, weight_decay=0.01)
    ref = torch.optim.SGD(refs, lr=0.1, weight_decay=0.01)
    for step in (opt.step, lambda: opt.step_params(params[:1])):
        for p, r in zip(params, refs):
            p.grad = torch.ones_like(p)
            r.grad = torch.ones_like(r)
        step()
        ref.step()
        assert len(opt.state) == len(ref.state) == 0
        assert opt.state_dict()["state"] == ref.state_dict()["state"] == {}


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_of_a_param_replaced_by_the_user_is_used(name: str) -> None:
    """opt.state[p] replaced by a new dict between steps (a reset by hand)
    is what the next update reads and writes, as torch's is: the cached
    plan's rows pointed at the old dict's tensors, which must not pass for
    the new dict's (they are the same keys, in another dict)."""
    def new_dict(opt, p: nn.Parameter) -> None:
        opt.state[p] = {key: torch.zeros_like(v) if torch.is_tensor(v) and key != "step" else v
                        for key, v in opt.state[p].items()}

    _trains_as_torch_with_state_reset_by_hand(name, new_dict)

def make_lazy_model() -> nn.Module:
    """(B, 3, 6, 6) -> (B, 3) through a LazyConv2d and a LazyLinear, whose
    parameters are uninitialized until the first forward materializes them
    (from the global random stream: each test fixes it before)."""
    return nn.Sequential(nn.LazyConv2d(4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))


def make_lazy_optimizer(cls: type[torch.optim.Optimizer], name: str,
                        params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """cls over `params`, which may be uninitialized. Adagrad's constructor
    fills its `sum` state from each parameter, and torch's refuses lazy ones
    there (reprop's as torch's); add_param_group takes them, its state is
    made at the first step."""
    if name != "Adagrad":
        return cls(params, **RICH[name])
    opt = cls([{"params": []}], **RICH[name])
    opt.add_param_group({"params": list(params)})
    return opt


def _lazy_run(cls: type[torch.optim.Optimizer], name: str, batches, *,
              optimizer_first: bool) -> Run:
    """A lazy model materialized by a no-grad dry run, its optimizer built
    before the dry run or after it, then trained on `batches`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = make_lazy_model()
        opt = make_lazy_optimizer(cls, name, model.parameters()) if optimizer_first else None
        with torch.no_grad():
            model(batches[0][0])
    if opt is None:
        opt = make_lazy_optimizer(cls, name, model.parameters())
    return train_model(None, batches, model=model, opt=opt)


@pytest.mark.parametrize("name", NAMES)
def test_lazy_parameters_train_as_once_materialized(name: str, batches) -> None:
    """An optimizer built over a lazy model's parameters before the dry run
    that materializes them (in place: the same Parameter objects), as
    torch.optim takes them, trains as one built after it, bitwise, and as
    torch.optim built before it (TRAIN_TOL). Before, the constructor read the
    shape of an UninitializedParameter and raised RuntimeError."""
    got = _lazy_run(reprop_cls(name), name, batches[:10], optimizer_first=True)
    assert_runs_equal(got, _lazy_run(reprop_cls(name), name, batches[:10], optimizer_first=False))
    if torch_steps_added_groups(name):
        assert_runs_close(got, _lazy_run(torch_cls(name), name, batches[:10], optimizer_first=True),
                          TRAIN_TOL[name])


@pytest.mark.parametrize("name", NAMES)
def test_lazy_parameters_state_dict_round_trips(name: str, batches) -> None:
    """state_dict() of an optimizer of uninitialized parameters loads into
    another such optimizer, which then trains as the first (bitwise); and a
    trained optimizer's state (through torch.save) loads into the optimizer of
    a fresh lazy model, materialized by the model's load_state_dict, which
    then steps on as the trained one."""
    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = make_lazy_model()
        return model, make_lazy_optimizer(reprop_cls(name), name, model.parameters())

    with torch.random.fork_rng(devices=[]):
        model, opt = fresh()
        twin, twin_opt = fresh()
        twin_opt.load_state_dict(opt.state_dict())
        torch.manual_seed(1)  # the same materialization for both
        trained = train_model(None, batches[:3], model=model, opt=opt)
        torch.manual_seed(1)
        assert_runs_equal(train_model(None, batches[:3], model=twin, opt=twin_opt), trained)
        saved = io.BytesIO()
        torch.save(opt.state_dict(), saved)
        resumed, resumed_opt = fresh()
    saved.seek(0)
    resumed_opt.load_state_dict(torch.load(saved))
    resumed.load_state_dict(model.state_dict())
    assert_runs_equal(train_model(None, batches[3:5], model=resumed, opt=resumed_opt),
                      train_model(None, batches[3:5], model=model, opt=opt))


@pytest.mark.parametrize("name", NAMES)
def test_uninitialized_parameter_is_skipped_or_refused_as_torch_does(name: str) -> None:
    """A lazy module's parameter never materialized sits steps out while it
    has no gradient, as in torch; given one by hand (of its size, 0), it is
    refused with a ValueError naming params before anything of its group
    changes, where torch's update raises ValueError. step_params() of one not
    in the optimizer names it without reading its shape."""
    for cls in (reprop_cls(name), torch_cls(name))[:2 if torch_steps_added_groups(name) else 1]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(3))
        opt = make_lazy_optimizer(cls, name, model.parameters())
        model[0](torch.ones(1, 2)).sum().backward()
        before = model[0].weight.detach().clone()
        opt.step()
        assert not torch.equal(model[0].weight, before)
        model[1].weight.grad = torch.empty(0)
        before = model[0].weight.detach().clone()
        with pytest.raises(ValueError, match=None if cls is torch_cls(name) else
                           r"params: an uninitialized parameter of a lazy module has a gradient"):
            opt.step()
        if cls is reprop_cls(name):
            assert torch.equal(model[0].weight, before), "a refused step changes nothing"
            with pytest.raises(ValueError, match=r"params\[0\]: not a parameter of this "
                                                 r"optimizer \(an uninitialized parameter"):
                opt.step_params([nn.LazyLinear(1).weight])


# ---------------------------------------------------------------------------
# 7. NaN and inf in gradients propagate as in torch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("options", ["default", "rich"])
@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_gradients_propagate_like_torch(name: str, options: str) -> None:
    opts = RICH[name] if options == "rich" else BASE[name]
    shapes = [(37,), (4, 9)]
    init, grads = make_params(shapes, seed=15), grad_sequence(shapes, 4)
    # NaN, +inf and -inf in vector bodies and scalar tails, on the second step;
    # later steps have finite gradients (state must stay poisoned as in torch).
    g = grads[1]
    g[0][[0, 5, 17, 36]] = torch.tensor([float("nan"), float("inf"), float("-inf"), float("nan")])
    g[1][0, 1], g[1][3, 8], g[1][2, 2] = float("inf"), float("-inf"), float("nan")
    got = run_open_loop(factory(reprop_cls(name), **opts), init, grads)
    ref = run_open_loop(factory(torch_cls(name), **opts), init, grads)
    assert any(p.isnan().any() for p in ref.params), "test is meant to produce NaN parameters"
    assert_runs_close(got, ref, OPEN_LOOP_TOL)


RMSPROP_OVERFLOW_OPTIONS = {"plain": {}, "momentum": {"momentum": 0.9}, "eps0": {"eps": 0.0}}


def rmsprop_centered_overflow_runs(options: dict, torch_foreach: bool) -> tuple[Run, Run]:
    """reprop's and torch's centered RMSprop where gradients beyond ~1.8e21
    overflow square_avg to inf (vector body and scalar tail)."""
    shapes = [(37,)]
    init, grads = make_params(shapes, seed=16), grad_sequence(shapes, 3)
    for step in grads[:2]:  # finite gradients after
        step[0][[0, 20, 33, 36]] = torch.tensor([1e22, -1e22, 3e21, -1e30])
    opts = {"lr": 1e-2, "centered": True, **options}
    got = run_open_loop(factory(rp.RMSprop, **opts), init, grads)
    ref = run_open_loop(factory(torch.optim.RMSprop, foreach=torch_foreach, **opts), init, grads)
    return got, ref


@pytest.mark.skipif(not TORCH_FUSES_MULTIPLY_ADDS, reason=NO_TORCH_FMA)
@pytest.mark.parametrize("torch_foreach", [False, True], ids=["torch_for_loop", "torch_foreach"])
@pytest.mark.parametrize("options", list(RMSPROP_OVERFLOW_OPTIONS))
def test_rmsprop_centered_stays_finite_where_square_avg_overflows(options: str,
                                                                   torch_foreach: bool) -> None:
    """Once square_avg is inf, torch's square_avg - grad_avg^2 (one addcmul)
    is inf, its square root inf and the update 0; grad_avg^2 rounded on its
    own overflows too, and inf - inf would make the parameter and the momentum
    buffer NaN."""
    got, ref = rmsprop_centered_overflow_runs(RMSPROP_OVERFLOW_OPTIONS[options], torch_foreach)
    assert ref.params[0].isfinite().all(), "torch keeps these parameters finite"
    assert_runs_close(got, ref, STEP_TOL)


def assert_rmsprop_centered_overflow_is_nan_as_torchs() -> None:
    for options, torch_foreach in itertools.product(RMSPROP_OVERFLOW_OPTIONS.values(), [False, True]):
        got, ref = rmsprop_centered_overflow_runs(options, torch_foreach)
        assert ref.params[0].isnan().any(), f"torch's baseline kernels give no NaN with {options}"
        assert_runs_close(got, ref, STEP_TOL)


@X86_ONLY
def test_plain_rounding_gives_centered_rmsprop_torchs_baseline_nan() -> None:
    """With the products rounded apart, as in torch's baseline kernels,
    grad_avg^2 overflows on its own once square_avg is inf: inf - inf makes
    the parameters NaN in both."""
    run_with_plain_rounding("t.assert_rmsprop_centered_overflow_is_nan_as_torchs()")


# ---------------------------------------------------------------------------
# 8. Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_sparse_gradient_raises(name: str) -> None:
    emb = nn.Embedding(10, 3, sparse=True)
    opt = reprop_cls(name)(emb.parameters(), **BASE[name])
    emb(torch.tensor([1, 2, 2])).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match="(?i)sparse"):
        opt.step()


@pytest.mark.parametrize("name", [n for n in NAMES if n != "Adagrad"])  # (its constructor
def test_sparse_param_without_a_gradient_sits_out(name: str) -> None:  # refuses one, as torch's)
    """A sparse parameter in a group, without a gradient, sits the step out
    as in torch: the plan of all the call's params read its data pointer
    (torch's 'no storage' error); its gradient is still refused."""
    dense = nn.Parameter(torch.ones(3))
    sparse = nn.Parameter(torch.eye(3).to_sparse())
    ref = nn.Parameter(torch.ones(3))
    opt, torch_opt = reprop_cls(name)([dense, sparse], **BASE[name]), torch_cls(name)([ref], **BASE[name])
    for _ in range(2):
        dense.grad, ref.grad = torch.ones(3), torch.ones(3)
        opt.step()
        torch_opt.step()
    torch.testing.assert_close(dense.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    sparse.grad = torch.eye(3).to_sparse()
    with pytest.raises(RuntimeError, match="(?i)sparse"):
        opt.step()


@pytest.mark.parametrize("how", ["sparse_grad", "sparse_grad_step_params", "complex_param"])
@pytest.mark.parametrize("name", NAMES)
def test_refused_step_leaves_the_state_as_it_was(name: str, how: str) -> None:
    """A step refused for one parameter (a sparse gradient, or a complex
    parameter put into a group by hand, past add_param_group's check) must
    leave the state of the others as it was: SGD's momentum buffer is created
    empty and filled by its first update, so one left behind by the refused
    step was read as a buffer (uninitialised memory) by the next step over
    a different set of parameters. Later steps match torch's without the
    refused one."""
    shapes = [(1000,), (7, 3)]
    init, grads = make_params(shapes, seed=30), grad_sequence(shapes, 3)
    params = [nn.Parameter(t.clone()) for t in init]
    if how == "complex_param":
        bad = nn.Parameter(torch.ones(3, dtype=torch.cfloat))
        bad.grad = torch.ones_like(bad)
    else:
        emb = nn.Embedding(4, 3, sparse=True)
        emb(torch.tensor([1])).sum().backward()
        bad = emb.weight
    opt = reprop_cls(name)(params, **RICH[name])
    opt.param_groups[0]["params"].append(bad)
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    before = copy.deepcopy(opt.state_dict()["state"])  # Adagrad's is made by __init__
    with pytest.raises((RuntimeError, TypeError), match="(?i)sparse|complex"):
        if how == "sparse_grad_step_params":
            opt.step_params([*params, bad], grads=[*grads[0], bad.grad])
        else:
            opt.step()
    torch.testing.assert_close(opt.state_dict()["state"], before, rtol=0, atol=0)
    bad.grad = None  # go on without it
    for step_grads in grads[1:]:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    ref = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads[1:])
    assert_runs_close(Run(params, opt), ref, OPEN_LOOP_TOL)


def two_tensor(t: torch.Tensor) -> torch.Tensor:
    """A TwoTensor of copies of t: torch's test wrapper subclass, which, like
    DTensor and FSDP2's sharded parameters, has __torch_dispatch__ and no
    memory of its own."""
    two = pytest.importorskip("torch.testing._internal.two_tensor")
    return two.TwoTensor(t.clone(), t.clone())


DISPATCH_SUBCLASS = r"is a TwoTensor, a tensor subclass with __torch_dispatch__"


@pytest.mark.parametrize("name", NAMES)
def test_dispatch_subclass_param_is_refused_before_any_state(name: str) -> None:
    """A parameter that is a tensor subclass with __torch_dispatch__ has no
    memory for the kernels to update: step() created its state (of the
    subclass) and then failed in the core with "null param or grad pointer".
    Refused with a TypeError by the constructor, by add_param_group (which
    then adds nothing) and, put into a group by hand, by step(), before any
    state is created."""
    wrapped = nn.Parameter(two_tensor(torch.randn(4, 3)))
    with pytest.raises(TypeError, match=rf"^{name}: params: a parameter of shape \(4, 3\) "
                                        rf"{DISPATCH_SUBCLASS}.*torch.optim"):
        reprop_cls(name)([wrapped], **RICH[name])
    p = nn.Parameter(torch.randn(3))
    opt = reprop_cls(name)([p], **RICH[name])
    with pytest.raises(TypeError, match=DISPATCH_SUBCLASS):
        opt.add_param_group({"params": [wrapped]})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["params"].append(wrapped)
    p.grad, wrapped.grad = torch.ones(3), two_tensor(torch.ones(4, 3))
    before = copy.deepcopy(opt.state_dict()["state"])  # Adagrad's is made by __init__
    with pytest.raises(TypeError, match=rf"param_groups\[0\]: params: .*{DISPATCH_SUBCLASS}"):
        opt.step()
    assert wrapped not in opt.state
    torch.testing.assert_close(opt.state_dict()["state"], before, rtol=0, atol=0)


def _refused_leaves_all_and_trains_on(name: str, cached: bool, seed: int, refuse: Callable) -> None:
    """Two parameters of optimizer `name` (after one plain step if `cached`:
    a cached plan, whose C fast path reads pointers without looking at
    types); refuse(params, opt, first_grads) makes calls that must be
    refused. Parameters and state are then as they were, and the steps
    after, with plain gradients, match torch's."""
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=seed), grad_sequence(shapes, 3)
    params = [nn.Parameter(t.clone()) for t in init]
    opt = reprop_cls(name)(params, **RICH[name])
    steps = grads
    if cached:
        for p, g in zip(params, grads[0]):
            p.grad = g.clone()
        opt.step()
        steps = grads[1:]
    before = copy.deepcopy(opt.state_dict()["state"])
    values = [p.detach().clone() for p in params]
    refuse(params, opt, steps[0])
    torch.testing.assert_close(opt.state_dict()["state"], before, rtol=0, atol=0)
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)
    for step_grads in steps:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    ref = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads)
    assert_runs_close(Run(params, opt), ref, OPEN_LOOP_TOL)


@pytest.mark.parametrize("cached", [False, True], ids=["first_step", "cached_plan"])
@pytest.mark.parametrize("name", NAMES)
def test_dispatch_subclass_grad_is_refused_before_any_state(name: str, cached: bool) -> None:
    """A gradient that is a tensor subclass with __torch_dispatch__ (of a
    plain parameter) was read as a null pointer, which the core refused with
    a ValueError that does not say why, and at a first step only after the
    step had created the state (SGD's momentum buffer uninitialised memory,
    Adam's moments of the subclass). Refused with a TypeError naming the
    gradient, by step() and step_params(grads=...), leaving parameters and
    state as they were: at a first step, and through a cached plan, whose
    fast path in C reads the gradient's pointer without looking at its type.
    Later steps with plain gradients match torch's."""
    def refuse(params, opt, first):
        refused = rf"^{name}: param_groups\[0\]: grads: the gradient of a parameter of shape " \
                  rf"\(5,\) {DISPATCH_SUBCLASS}"
        params[0].grad, params[1].grad = first[0].clone(), two_tensor(first[1])
        with pytest.raises(TypeError, match=refused):
            opt.step()
        with pytest.raises(TypeError, match=refused):
            opt.step_params(params, grads=[first[0], two_tensor(first[1])])

    _refused_leaves_all_and_trains_on(name, cached, 31, refuse)


@pytest.mark.parametrize("cached", [False, True], ids=["first_step", "cached_plan"])
@pytest.mark.parametrize("name", NAMES)
def test_step_under_fake_tensor_mode_is_refused_before_any_state(name: str, cached: bool) -> None:
    """step() of real parameters under a FakeTensorMode (a memory dry run,
    allow_non_fake_inputs=True): at a first step the state was created as
    FakeTensors, whose null pointers the core refused ("state slot 0 is
    required"), and kept, so every later real step raised; with state in
    place (Adagrad's from __init__, a cached plan) the kernels updated the
    real parameters and state, which torch's step() there leaves as they
    are. Refused with a RuntimeError, by step() and step_params(), leaving
    parameters and state as they were; later real steps match torch's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def refuse(params, opt, first):
        for p, g in zip(params, first):
            p.grad = g.clone()
        refused = rf"^{name}: an update under a FakeTensorMode: .*torch.optim.{name}$"
        with FakeTensorMode(allow_non_fake_inputs=True):
            with pytest.raises(RuntimeError, match=refused):
                opt.step()
            with pytest.raises(RuntimeError, match=refused):
                opt.step_params(params)

    _refused_leaves_all_and_trains_on(name, cached, 37, refuse)


@pytest.mark.parametrize("name", NAMES)
def test_dispatch_subclass_state_is_refused_naming_its_key(name: str) -> None:
    """State that is a tensor subclass with __torch_dispatch__ (a DTensor
    from a sharded model's state dict) met the core as a null pointer: "entry
    0: state slot 0 is required", naming neither the key nor the type. Each
    key now raises the RuntimeError other unreadable state raises, naming
    it, and leaves parameters and state as they were."""
    for key in _state_keys(name):
        p = nn.Parameter(torch.linspace(-1, 1, 6).reshape(2, 3))
        opt = reprop_cls(name)([p], **RICH[name])
        p.grad = torch.ones(2, 3)
        opt.step()
        opt.state[p][key] = two_tensor(opt.state[p][key])
        before = copy.deepcopy(opt.state_dict()["state"])
        value = p.detach().clone()
        with pytest.raises(RuntimeError, match=rf"^{key}: the state of a parameter of shape "
                                               rf"\(2, 3\) .*not a TwoTensor"):
            opt.step()
        assert torch.equal(p.detach(), value)
        torch.testing.assert_close(opt.state_dict()["state"], before, rtol=0, atol=0)


def _state_keys(name: str) -> list[str]:
    """The tensor state keys `name` with RICH's options makes at a first step."""
    p = nn.Parameter(torch.ones(2))
    opt = reprop_cls(name)([p], **RICH[name])
    p.grad = torch.ones(2)
    opt.step()
    return sorted(k for k, v in opt.state[p].items() if isinstance(v, torch.Tensor))


class _DispatchWithMemory(torch.Tensor):
    """A __torch_dispatch__ subclass that keeps its own memory (unlike
    TwoTensor or DTensor): a data pointer the C fast path could read."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.as_subclass(torch.Tensor) if isinstance(t, cls) else t
        return func(*torch.utils._pytree.tree_map(unwrap, args),
                    **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


@pytest.mark.parametrize("name", NAMES)
def test_dispatch_subclass_grad_with_memory_is_refused_by_a_cached_plan(name: str) -> None:
    """The fast path in C took a gradient by its layout, dtype and shape, not
    its type: a dispatch subclass with memory of its own was refused at a
    first step but stepped on from a cached plan."""
    p = nn.Parameter(torch.ones(4))
    opt = reprop_cls(name)([p], **RICH[name])
    p.grad = torch.ones(4)
    opt.step()
    before = copy.deepcopy(opt.state_dict()["state"])
    value = p.detach().clone()
    p.grad = torch.Tensor._make_subclass(_DispatchWithMemory, torch.ones(4))
    with pytest.raises(TypeError, match="is a _DispatchWithMemory, a tensor subclass with "
                                        "__torch_dispatch__"):
        opt.step()
    assert torch.equal(p.detach(), value)
    torch.testing.assert_close(opt.state_dict()["state"], before, rtol=0, atol=0)


def test_dtensor_param_and_grad_are_refused() -> None:
    """DTensor, on a one-rank gloo mesh, is refused as a parameter and as the
    gradient of a plain parameter, before any state is created."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo, not yet initialized")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        with pytest.raises(TypeError, match="params: .* is a DTensor, a tensor subclass with "
                                            "__torch_dispatch__"):
            rp.Adam([sharded], lr=0.1)
        p = nn.Parameter(torch.randn(4, 3))
        opt = rp.Adam([p], lr=0.1)
        p.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        with pytest.raises(TypeError, match="grads: .* is a DTensor, a tensor subclass with "
                                            "__torch_dispatch__"):
            opt.step()
        assert p not in opt.state
    finally:
        dist.destroy_process_group()


class _FunctionTensor(torch.Tensor):
    """A subclass with __torch_function__ only: plain memory, as nn.Parameter's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class _MyParameter(nn.Parameter):
    pass


@pytest.mark.parametrize("name", NAMES)
def test_parameter_and_torch_function_subclasses_step_as_torch(name: str) -> None:
    """The refusal of __torch_dispatch__ subclasses leaves those of
    nn.Parameter and __torch_function__-only subclasses (params and grads),
    whose memory is a plain tensor's, stepping as torch's."""
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=32), grad_sequence(shapes, 3)
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        params = [_MyParameter(init[0].clone()), nn.Parameter(init[1].clone().as_subclass(_FunctionTensor))]
        opt = cls(params, **RICH[name])
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone().as_subclass(_FunctionTensor)
            opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(*runs, OPEN_LOOP_TOL)


INFERENCE_ERROR = "(?i)inplace update to inference tensor outside InferenceMode is not allowed"


def _inference_step_raises(opt: torch.optim.Optimizer) -> bool:
    """Whether opt.step() raises torch's refusal to update inference tensors."""
    try:
        opt.step()
    except RuntimeError as e:
        assert re.search(INFERENCE_ERROR, str(e)), e
        return True
    return False


@pytest.mark.parametrize("name", NAMES)
def test_inference_params_are_refused_outside_inference_mode(name: str) -> None:
    """torch's in-place update of a param made inside inference_mode raises
    outside it (after writing the first param: the check follows the op),
    and steps inside it; reprop's kernels wrote every param through its raw
    pointer. Refused before anything changes, no state created."""
    raised = []
    for cls in (torch_cls(name), reprop_cls(name)):
        with torch.inference_mode():
            params = [torch.ones(3), torch.ones(2, 2)]
        opt = cls(params, **RICH[name])
        for p in params:
            p.grad = torch.ones_like(p)
        before = _state_snapshot(opt, params)  # Adagrad's is made by __init__
        raised.append(_inference_step_raises(opt))
    assert raised == [True, True]
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)
    assert _state_snapshot(opt, params) == before
    with torch.inference_mode():
        opt.step()
    assert all((p != 1).all() for p in params)


@pytest.mark.parametrize("name", NAMES)
def test_state_made_inside_inference_mode_is_refused_outside_as_torch(name: str) -> None:
    """A first step inside inference_mode makes the state inference tensors
    (but Adagrad's, made by __init__); torch's next step outside it raises,
    where reprop's cached plan wrote into them. Refused before anything
    changes; inside inference_mode the update goes on."""
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=33), grad_sequence(shapes, 3)
    runs, raised = [], []
    for cls in (torch_cls(name), reprop_cls(name)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **RICH[name])
        for k, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            if k != 1:
                with torch.inference_mode():
                    opt.step()
                continue
            before = [p.tolist() for p in params], _state_snapshot(opt, params)
            raised.append(_inference_step_raises(opt))
            kept = before == ([p.tolist() for p in params], _state_snapshot(opt, params))
        runs.append(Run(params, opt))
    if name == "Adagrad":
        assert raised == [False, False]
        assert_runs_close(*runs, OPEN_LOOP_TOL)
    else:
        assert raised == [True, True]
        assert kept  # (reprop's; torch's raising step wrote its first state tensor)


def test_param_with_gaps_first_stepped_inside_inference_mode_steps_outside() -> None:
    """The contiguous copy that a param with gaps is updated through is made
    when its plan is built: inside inference_mode, an inference tensor, which
    the next step outside it could not write, where torch's steps."""
    for cls in (torch.optim.SGD, rp.SGD):
        p = nn.Parameter(torch.ones(4, 4)[:, :2])
        opt = cls([p], lr=0.5)
        p.grad = torch.ones_like(p)
        with torch.inference_mode():
            opt.step()
        opt.step()
        assert torch.equal(p.detach(), torch.zeros(4, 2))


# State that torch's update cannot read as its (7, 3) parameter's, as loaded
# from another model or set by hand: (optimizer, key, the state).
BAD_STATE = {
    "SGD-transposed": ("SGD", "momentum_buffer", lambda: torch.zeros(3, 7)),
    "SGD-broadcast": ("SGD", "momentum_buffer", lambda: torch.zeros(1)),
    "Adam-broadcast": ("Adam", "exp_avg_sq", lambda: torch.zeros(7, 1)),
    "Adam-step": ("Adam", "step", lambda: torch.tensor([1.0, 2.0])),
    "RMSprop-integer": ("RMSprop", "square_avg", lambda: torch.zeros(7, 3, dtype=torch.int64)),
    "Adagrad-device": ("Adagrad", "sum", lambda: torch.zeros(7, 3, device="meta")),
    "Adam-sparse": ("Adam", "exp_avg", lambda: torch.zeros(7, 3).to_sparse()),
}


@pytest.mark.parametrize("case", list(BAD_STATE))
def test_state_torch_cannot_read_is_refused_before_any_state_is_created(case: str) -> None:
    """State of another shape (also one that broadcasts), device or a
    non-floating dtype, or a step count of several elements, is refused with
    a RuntimeError naming the key and the shapes, as torch's update raises
    RuntimeError, and before any state is created or changed. reprop's copy_
    raised torch's message for the second parameter after giving the first
    an uninitialised SGD momentum buffer (NaN parameters at the next step),
    or broadcast the state silently."""
    name, key, bad = BAD_STATE[case]
    shapes = [(1000,), (7, 3)]
    init, grads = make_params(shapes, seed=31), grad_sequence(shapes, 2)
    for cls in (torch_cls(name), reprop_cls(name)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **RICH[name])
        params[1].grad = grads[0][1].clone()
        opt.step()  # the second parameter's state
        opt.state[params[1]][key] = bad()
        for p, g in zip(params, grads[1]):
            p.grad = g.clone()
        first = copy.deepcopy(opt.state.get(params[0], {}))  # Adagrad's is made by __init__
        with pytest.raises(RuntimeError) as raised:
            opt.step()
    assert re.match(rf"{key}: the state of a parameter of shape \(7, 3\) on cpu is a tensor of "
                    rf"shape {re.escape(str(tuple(bad().shape)))}", str(raised.value)), raised.value
    assert torch.equal(params[0].detach(), init[0])
    torch.testing.assert_close(opt.state.get(params[0], {}), first, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["Adam", "Adagrad", "RMSprop", "Adadelta"])
def test_state_without_a_step_count_raises_torchs_key_error(name: str) -> None:
    """torch reads state["step"] of any state it finds: state set or loaded
    without it raises KeyError there; reprop counted from 0 again (the bias
    correction of a first step on the moments of later ones)."""
    for cls in (torch_cls(name), reprop_cls(name)):
        p = nn.Parameter(torch.ones(3))
        opt = cls([p], **RICH[name])
        p.grad = torch.ones(3)
        opt.step()
        del opt.state[p]["step"]
        before = p.detach().clone()
        with pytest.raises(KeyError, match="step"):
            opt.step()
        assert torch.equal(p.detach(), before)


def _step_editing_state_after_the_first(cls: type, name: str, init: list, grads: list,
                                        edit: Callable) -> tuple[list, object]:
    """Steps once, calls edit(opt, params) (state made by hand), steps on;
    returns the params and the optimizer."""
    params = [nn.Parameter(t.clone()) for t in init]
    opt = cls(params, **RICH[name])
    for k, gs in enumerate(grads):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        if k == 0:
            edit(opt, params)
    return params, opt


def _step_with_a_shared_step_tensor(cls: type, name: str, init: list, grads: list,
                                    step: torch.Tensor) -> list:
    """Steps once, puts `step` into every param's state, steps on; returns the params."""
    def share(opt, params):
        for p in params:
            opt.state[p]["step"] = step
    params, opt = _step_editing_state_after_the_first(cls, name, init, grads, share)
    assert all(opt.state[p]["step"] is opt.state[params[0]]["step"] for p in params)
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", ["Adam", "Adagrad"])
def test_step_tensor_shared_by_params_counts_once_per_param_in_turn(name: str,
                                                                    dtype: torch.dtype) -> None:
    """One step tensor in several params' state (made by hand) is advanced by
    torch's loop once per param, each update's bias correction (lr decay) at
    its own count: 11, 12, 13 at the first step, 14, 15, 16 at the next.
    reprop computed every row's from the count before any increment (11 for
    all). A float64 one, which reprop converts to float32, stays shared."""
    shapes = [(5,), (3, 2), (4,)]
    init, grads = make_params(shapes, seed=41), grad_sequence(shapes, 3)
    got, ref = (_step_with_a_shared_step_tensor(cls, name, init, grads, torch.tensor(10.0, dtype=dtype))
                for cls in (reprop_cls(name), torch_cls(name)))
    for i, (a, e) in enumerate(zip(got, ref)):
        assert_tensor_close(a, e, STEP_TOL, f"params[{i}]", scale=1.0)


def test_step_tensor_shared_across_dtypes_is_refused_before_any_change() -> None:
    """Params of two dtypes in one group are updated by two calls, each
    counting its own rows, so a step tensor they share cannot be counted in
    torch's order: refused, naming the key, with nothing changed."""
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]
    opt = rp.Adam(params, lr=0.1)
    step = torch.tensor(10.0)
    for p in params:
        opt.state[p] = {"step": step, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"^Adam: param_groups\[0\]: step: several parameters "
                                         r"share one step tensor"):
        opt.step()
    assert step.item() == 10.0
    assert all(torch.equal(p.detach(), torch.ones_like(p)) for p in params)
    assert all(not opt.state[p]["exp_avg"].any() for p in params)


# Hyper-parameters set after construction (the constructors refuse them) for
# which torch's update raises, at step `at` of three: (optimizer, group 1's
# values, at, reprop's message), and ones for which it steps on (at None).
REFUSED_AT_A_STEP = {
    "Adam-beta1-one": ("Adam", {"betas": (1.0, 0.999)}, 0,
                       r"betas: 1 - beta1 \*\* step is 0 at step 1 \(beta1 = 1\), a division by zero"),
    "Adam-beta1-minus-one": ("Adam", {"betas": (-1.0, 0.999)}, 1, r"betas: 1 - beta1 \*\* step is 0 at step 2"),
    "Adam-beta2-complex": ("Adam", {"betas": (0.9, 1.5)}, 0, r"betas: 1 - beta2 \*\* step = -0.5 at step 1"),
    "Adam-lr": ("Adam", {"lr": 1e300}, 0, r"lr: the step size lr / \(1 - beta1 \*\* step\) = 1e\+301"),
    "AdamW-beta1": ("AdamW", {"betas": (1e300, 0.999)}, 0, r"betas: 1 - beta1 = -1e\+300 is beyond float32"),
    "Adagrad-lr_decay": ("Adagrad", {"lr_decay": -1.0}, 1,
                         r"lr_decay: 1 \+ \(step - 1\) \* lr_decay is 0 at step 2"),
    "Adagrad-lr": ("Adagrad", {"lr": 1e300}, 0, r"lr: lr / \(1 \+ \(step - 1\) \* lr_decay\) = 1e\+300"),
    "SGD-lr": ("SGD", {"lr": 1e300}, 0, r"lr: -lr = -1e\+300 is beyond float32's range"),
    "SGD-momentum": ("SGD", {"momentum": 1e39}, 0, r"momentum: momentum = 1e\+39"),
    "SGD-dampening": ("SGD", {"dampening": -1e39, "nesterov": False}, 1, r"dampening: 1 - dampening = 1e\+39"),
    "RMSprop-alpha": ("RMSprop", {"alpha": -1e39}, 0, r"alpha: 1 - alpha = 1e\+39"),
    "Adadelta-rho": ("Adadelta", {"rho": 1e39}, 0, r"rho: 1 - rho = -1e\+39"),
    "Adadelta-weight_decay": ("Adadelta", {"weight_decay": 1e39}, 0, r"weight_decay: weight_decay = 1e\+39"),
    # torch's update unpacks betas into two values (its constructor reads [0] and [1])
    "Adam-betas-of-three": ("Adam", {"betas": (0.9, 0.999, 0.5)}, 0,
                            r"betas: too many values to unpack \(expected 2"),
    "AdamW-betas-list-of-three": ("AdamW", {"betas": [0.9, 0.999, 0.5]}, 0,
                                  r"betas: too many values to unpack \(expected 2"),
    "Adam-betas-of-one": ("Adam", {"betas": (0.9,)}, 0,
                          r"betas: not enough values to unpack \(expected 2, got 1\)"),
    "AdamW-betas-list-of-one": ("AdamW", {"betas": [0.9]}, 0,
                                r"betas: not enough values to unpack \(expected 2, got 1\)"),
    "AdamW-weight_decay": ("AdamW", {"weight_decay": 1e30}, None, None),  # 1 - lr * wd: not checked
    "Adam-beta2-one": ("Adam", {"betas": (0.9, 1.0)}, None, None),  # a tensor divided by 0
    "RMSprop-lr-inf": ("RMSprop", {"lr": float("inf")}, None, None),
    # (fuzzer) torch decays decoupled only for a non-zero weight_decay; reprop multiplied
    # the params by 1 - inf * 0 = NaN, where torch's are +-inf
    "AdamW-lr-inf-without-weight_decay": ("AdamW", {"lr": float("inf"), "weight_decay": 0.0}, None, None),
    "Adam-decoupled-lr-inf-without-weight_decay": (
        "Adam", {"lr": float("inf"), "weight_decay": 0.0, "decoupled_weight_decay": True}, None, None),
    # (C mutation audit) torch's mul_(momentum) takes any float, its add(alpha=) float32's
    # largest: refusing either where torch steps on passed every test
    "SGD-momentum-without-nesterov": ("SGD", {"momentum": 1e39, "nesterov": False}, None, None),
    "SGD-weight_decay-float32-max": ("SGD", {"weight_decay": float(np.finfo(np.float32).max)},
                                     None, None),
    # 1 - inf ** step is -inf, whose ** 0.5 is inf in Python (not complex): NaN params in both
    "Adam-beta2-inf": ("Adam", {"betas": (0.9, float("inf"))}, None, None),
    # (fuzzer) a tensor lr is divided by the step-count denominators as a tensor op, in its
    # dtype: a zero one gives inf or NaN, and so does an overflow of float32, where torch
    # steps on; reprop refused them as for a number lr
    "Adam-beta1-one-tensor-lr": ("Adam", {"lr": torch.tensor(0.01), "betas": (1.0, 0.999)}, None, None),
    "Adam-beta1-minus-one-bf16-tensor-lr": (
        "Adam", {"lr": torch.tensor(0.01, dtype=torch.bfloat16), "betas": (-1.0, 0.999)}, None, None),
    "Adagrad-lr_decay-tensor-lr": ("Adagrad", {"lr": torch.tensor(0.05), "lr_decay": -1.0}, None, None),
    "Adam-lr-float32-tensor-overflow": ("Adam", {"lr": torch.tensor(3e38)}, None, None),
    "Adagrad-lr-float32-tensor-overflow": ("Adagrad", {"lr": torch.tensor(3e38), "lr_decay": -0.5},
                                           None, None),
    # the bias corrections of tensor betas and the lr decay of a tensor lr_decay are tensor
    # ops too: lr over a zero one is inf, a negative one's square root NaN, where torch steps
    # on; reprop refused them as for numbers
    "Adam-beta1-one-bf16-tensor-betas": (
        "Adam", {"betas": (torch.tensor(1.0, dtype=torch.bfloat16),
                           torch.tensor(0.999, dtype=torch.bfloat16))}, None, None),
    "Adam-beta2-two-float64-tensor-betas": (
        "Adam", {"betas": (torch.tensor(0.9, dtype=torch.float64),
                           torch.tensor(2.0, dtype=torch.float64))}, None, None),
    "Adagrad-lr_decay-tensor": ("Adagrad", {"lr_decay": torch.tensor(-1.0)}, None, None),
    # a float64 one divides in double, and its step size goes to the float32 op as a number
    "Adam-lr-float64-tensor": ("Adam", {"lr": torch.tensor(1e300, dtype=torch.float64)}, 0,
                               r"lr: the step size lr / \(1 - beta1 \*\* step\) = 1e\+301"),
}


@pytest.mark.parametrize("case", list(REFUSED_AT_A_STEP))
def test_hyperparameters_torch_refuses_at_a_step_are_refused_first(case: str) -> None:
    """Where torch raises (ZeroDivisionError, a complex bias correction, a
    constant beyond float32 passed to a tensor op, betas that do not unpack
    into two values), reprop raises ValueError naming the group and
    hyper-parameter at the same step, before anything of that group changes
    (torch has updated part of it by then); where torch steps on, so does
    reprop. reprop stepped on with NaN or inf, and with the first two of
    three betas, and raised a bare IndexError for one."""
    name, change, at, message = REFUSED_AT_A_STEP[case]
    shapes = [(4, 3), (5,), (6,)]
    init, grads = make_params(shapes, seed=32), grad_sequence(shapes, 3)
    runs, refusals = [], []
    for cls in (torch_cls(name), reprop_cls(name)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(split_groups(params, {}), **RICH[name])
        opt.param_groups[1].update(change)
        refusal = None
        for k, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            group1 = copy.deepcopy([(p.detach(), opt.state.get(p, {})) for p in params[2:]])
            try:
                opt.step()
            except Exception as e:
                refusal = (k, e)
                break
        runs.append(Run(params, opt))
        refusals.append(refusal)
    assert [r and r[0] for r in refusals] == [at, at], refusals
    if at is None:
        assert_runs_close(*runs, OPEN_LOOP_TOL)
        return
    error = refusals[1][1]
    assert isinstance(error, ValueError), error
    assert re.match(rf"{name}: param_groups\[1\]: {message}", str(error)), error
    torch.testing.assert_close([(p.detach(), opt.state.get(p, {})) for p in params[2:]], group1,
                               rtol=0, atol=0)
    # group 0 was updated, as torch updates it before it gets to group 1
    assert_runs_close(Run(runs[1].params[:2], runs[1].opt), Run(runs[0].params[:2], runs[0].opt),
                      OPEN_LOOP_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64],
                         ids=str)
@pytest.mark.parametrize("name, options", [("Adam", {"betas": (0.9, 0.999)}), ("Adagrad", {"lr_decay": 0.3}),
                                           ("AdamW", {"weight_decay": 0.3})],
                         ids=["Adam", "Adagrad", "AdamW"])
def test_a_tensor_lr_is_computed_with_in_its_dtype(name: str, options: dict, dtype: torch.dtype) -> None:
    """torch divides a tensor lr by Adam's 1 - beta1 ** step and Adagrad's
    1 + (step - 1) * lr_decay, and computes AdamW's 1 - lr * weight_decay,
    in tensor ops, in torch.result_type(lr, 1.0): with a 16-bit lr they are
    rounded to its dtype (a bfloat16 step size 0.3% from the quotient in
    double, which reprop used whatever the lr, and a decay factor of
    0.99609 for 0.99631)."""
    lr = torch.tensor(7 if dtype == torch.int64 else 0.0123, dtype=dtype)
    shapes = [(4, 3), (5,)]
    init = make_params(shapes, seed=33)
    ref = run_open_loop(factory(torch_cls(name), lr=lr.clone(), **options), init, grad_sequence(shapes, 4))
    got = run_open_loop(factory(reprop_cls(name), lr=lr.clone(), **options), init, grad_sequence(shapes, 4))
    assert_runs_close(got, ref, OPEN_LOOP_TOL)


def _tensor_hparams(dtype: torch.dtype, **values) -> dict:
    """Options with these values as 0-d tensors of `dtype` (betas: a pair)."""
    def tensor(v):
        return torch.tensor(v, dtype=dtype)
    return {k: tuple(map(tensor, v)) if k == "betas" else tensor(v) for k, v in values.items()}


TENSOR_HPARAM_CASES = {
    "Adam": ("Adam", {"betas": (0.9, 0.99)}, {}),
    "Adam-amsgrad": ("Adam", {"betas": (0.8, 0.95)}, {"amsgrad": True}),
    "Adam-float32-lr": ("Adam", {"betas": (0.9, 0.99)}, {"lr": torch.tensor(0.0123)}),
    "AdamW": ("AdamW", {"betas": (0.9, 0.99), "weight_decay": 0.3}, {}),
    "SGD": ("SGD", {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}, {}),
    "RMSprop": ("RMSprop", {"alpha": 0.1, "momentum": 0.5}, {"centered": True}),
    "Adadelta": ("Adadelta", {"rho": 0.1, "weight_decay": 0.1}, {}),
    "Adagrad": ("Adagrad", {"lr_decay": 0.013}, {}),
    "Adagrad-float32-lr": ("Adagrad", {"lr_decay": 0.013}, {"lr": torch.tensor(0.0123)}),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(TENSOR_HPARAM_CASES))
def test_tensor_hparams_are_computed_with_in_their_dtype(case: str, dtype: torch.dtype) -> None:
    """torch computes with a tensor hyper-parameter in tensor ops in its
    dtype: Adam's bias corrections 1 - beta ** step (the power with the step
    converted to that dtype, 2 and 3 as products), lr divided by the first
    (a number lr: the tensor's reciprocal times lr), the square root of the
    second, AdamW's 1 - lr * weight_decay, Adagrad's 1 + (step - 1) *
    lr_decay, the weights 1 - beta2, 1 - alpha, 1 - rho and 1 - dampening,
    each rounded to the dtype (two tensors: the dtype both promote to).
    reprop took their values as Python floats: a bfloat16 beta1 = 0.9's bias
    correction 0.7% off at step 2, bfloat16 1 - dampening 0.8999 where
    torch's is 0.8984."""
    name, values, options = TENSOR_HPARAM_CASES[case]
    options = {**options, **_tensor_hparams(dtype, **values)}
    shapes = [(4, 3), (37,)]
    init = make_params(shapes, seed=35)
    grads = grad_sequence(shapes, 6)
    ref = run_open_loop(factory(torch_cls(name), **options), init, grads)
    got = run_open_loop(factory(reprop_cls(name), **options), init, grads)
    assert_runs_close(got, ref, OPEN_LOOP_TOL)


def test_float16_tensor_beta_past_step_65504_is_refused() -> None:
    """torch's beta1 ** step converts the step to a float16 beta's dtype and
    raises RuntimeError past 65504; reprop raises ValueError naming the group
    and the beta, before the step changes anything."""
    p = nn.Parameter(torch.ones(3))
    opt = rp.Adam([p], betas=tuple(_tensor_hparams(torch.float16, betas=(0.9, 0.99))["betas"]))
    p.grad = torch.ones(3)
    opt.step()
    opt.state[p]["step"].fill_(65503.0)
    opt.step()  # step 65504: still a float16
    before = copy.deepcopy((p.detach(), opt.state_dict()["state"]))
    with pytest.raises(ValueError, match=r"Adam: param_groups\[0\]: betas: the step 65505 is "
                                         r"beyond float16, the dtype of beta1"):
        opt.step()
    torch.testing.assert_close((p.detach(), opt.state_dict()["state"]), before, rtol=0, atol=0)


# Tensor hyper-parameters of the ops that no square root reaches (see
# ADD_LERP_RESULTS), whose results are torch's bit for bit: a float64 beta1,
# which torch casts to float32 before 1 - beta1 (0.100000024 for 0.9, where
# the float64 difference rounds to 0.1), and the 16-bit weights below 0.5,
# whose 1 - weight torch rounds to their dtype.
TENSOR_HPARAM_BITWISE = [
    ("Adam", {"lr": 1e-2, **_tensor_hparams(torch.float64, betas=(0.9, 0.999))}, ["exp_avg"]),
    ("Adam", {"lr": 1e-2, **_tensor_hparams(torch.bfloat16, betas=(0.9, 0.1))}, ["exp_avg_sq"]),
    ("SGD", {"lr": 0.05, **_tensor_hparams(torch.float16, momentum=0.9, dampening=0.1)},
     ["param", "momentum_buffer"]),
    ("RMSprop", {"lr": 1e-3, "centered": True, **_tensor_hparams(torch.bfloat16, alpha=0.1)},
     ["square_avg", "grad_avg"]),
    ("Adadelta", {"lr": 1.0, **_tensor_hparams(torch.float16, rho=0.1)}, ["square_avg"]),
]


@pytest.mark.skipif(not TORCH_FUSES_MULTIPLY_ADDS, reason=NO_TORCH_FMA)
@pytest.mark.parametrize("name, options, keys", TENSOR_HPARAM_BITWISE,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(TENSOR_HPARAM_BITWISE)])
def test_tensor_hparam_weights_are_torchs_bitwise(name: str, options: dict, keys: list) -> None:
    """1 - beta1, 1 - beta2, 1 - dampening, 1 - alpha and 1 - rho of tensor
    hyper-parameters as torch computes them (see
    test_tensor_hparams_are_computed_with_in_their_dtype): reprop's were the
    values' differences in double, rounded to float32 once."""
    assert_keys_are_torchs_bitwise(name, options, keys, seed=36)


def test_group_updated_in_several_calls_is_refused_before_any() -> None:
    """A group whose parameters take several calls (two dtypes) is checked
    as a whole before the first: at lr=1e38 Adam's step size is within
    float32 for the float32 parameter at step 12 but not for the bfloat16 one
    at step 2. reprop updated the float32 one, then stepped the other to
    inf."""
    p32, p16 = nn.Parameter(torch.ones(5)), nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = rp.Adam([p32, p16], lr=1e-3)
    for k in range(11):
        p32.grad = torch.ones(5)
        p16.grad = torch.ones(3, dtype=torch.bfloat16) if k == 10 else None
        opt.step()
    opt.param_groups[0]["lr"] = 1e38
    p32.grad, p16.grad = torch.ones(5), torch.ones(3, dtype=torch.bfloat16)
    before = copy.deepcopy(([p32.detach(), p16.detach()], opt.state_dict()["state"]))
    with pytest.raises(ValueError, match=r"Adam: param_groups\[0\]: lr: the step size .* at step 2 "):
        opt.step()
    torch.testing.assert_close(([p32.detach(), p16.detach()], opt.state_dict()["state"]), before,
                               rtol=0, atol=0)


# The hyper-parameters each optimizer's update reads as numbers.
NUMERIC_HPARAMS = {
    "SGD": ("lr", "weight_decay", "momentum", "dampening"),
    "Adam": ("lr", "weight_decay", "eps", "betas[0]", "betas[1]"),
    "AdamW": ("lr", "weight_decay", "eps", "betas[0]", "betas[1]"),
    "Adagrad": ("lr", "lr_decay", "weight_decay", "eps"),
    "RMSprop": ("lr", "alpha", "eps", "weight_decay", "momentum"),
    "Adadelta": ("lr", "rho", "eps", "weight_decay"),
}
NUMERIC_HPARAM_CASES = [(n, k) for n, keys in NUMERIC_HPARAMS.items() for k in keys]


def _set_hparam(group: dict, key: str, make: Callable) -> None:
    """group[key] = make(its current value); key "betas[i]" sets one beta."""
    if key.startswith("betas["):
        betas = list(group["betas"])
        i = int(key[6])
        betas[i] = make(betas[i])
        group["betas"] = tuple(betas)
    else:
        group[key] = make(group[key])


# Values of a numeric hyper-parameter that are no real number: (make from
# the key's value, whether torch's update raises TypeError for it at every key;
# the others vary: at some keys torch steps on, at others it raises another
# error, such as RuntimeError for a bool tensor it negates).
NOT_REAL = {
    "str": (str, True),
    "None": (lambda v: None, True),
    "complex": (complex, False),
    "tensor2": (lambda v: torch.tensor([v, v]), False),
    "bool_tensor": (lambda v: torch.tensor(True), False),
    "array1": (lambda v: np.array([v]), True),
    "fraction": (Fraction, False),
    "decimal": (Decimal, False),
}


@pytest.mark.parametrize("name, key", NUMERIC_HPARAM_CASES)
def test_non_numeric_hyperparameter_raises_type_error(name: str, key: str) -> None:
    """A string, None, a complex number, a tensor of several elements, a bool
    tensor, a one-element NumPy array of one dimension, a Fraction or a
    Decimal set into a group raises TypeError naming the group and the key,
    as torch's update raises for it (at every key for a string, None and
    such an array), before anything changes. float() parsed a string and
    stepped with it; None and a 2-element tensor gave float()'s message; a
    bool tensor and a Fraction trained (as 1 and as the fraction's value),
    also where torch raises (SGD's lr), and np.array([0.05]) gave NumPy's
    message without the key."""
    for what, (make, torch_refuses) in NOT_REAL.items():
        p = nn.Parameter(torch.ones(3))
        torch_opt = torch_cls(name)([nn.Parameter(torch.ones(3))], **RICH[name])
        _set_hparam(torch_opt.param_groups[0], key, make)
        opt = reprop_cls(name)([p], **RICH[name])
        _set_hparam(opt.param_groups[0], key, make)
        p.grad = torch_opt.param_groups[0]["params"][0].grad = torch.ones(3)
        if torch_refuses:
            with pytest.raises(TypeError):  # (SGD reads momentum from its second step)
                torch_opt.step()
                torch_opt.step()
        state = _state_snapshot(opt, [p])
        with pytest.raises(TypeError, match=rf"{name}: param_groups\[0\]: {re.escape(key)}: "
                                            r"expected a real number or a one-element real tensor"):
            opt.step()
        assert torch.equal(p.detach(), torch.ones(3)), what
        assert _state_snapshot(opt, [p]) == state, what


# Ints past 64 bits, with an optimizer whose update torch refuses them at:
# torch passes the int (SGD's weight_decay), or -int (SGD's lr), to a tensor op
# as a signed or unsigned 64-bit integer, and raises OverflowError.
BEYOND_64_BITS = {"2**64": (2**64, "SGD", "weight_decay"), "-2**64": (-2**64, "SGD", "lr"),
                  "2**63+1": (2**63 + 1, "RMSprop", "lr"),
                  "np.uint64": (np.uint64(2**64 - 1), "Adadelta", "weight_decay"),
                  # torch takes a NumPy int as an int64: 2**63 fits a Python int only
                  "np.uint64(2**63)": (np.uint64(2**63), "SGD", "weight_decay")}


@pytest.mark.parametrize("value", list(BEYOND_64_BITS))
@pytest.mark.parametrize("name, key", NUMERIC_HPARAM_CASES)
def test_int_hyperparameter_beyond_64_bits_raises_overflow_error(name: str, key: str,
                                                                 value: str) -> None:
    """An int hyper-parameter beyond +-2**63 (a NumPy int at 2**63 too) raises torch's OverflowError,
    naming the group and the key, before anything changes (at every key:
    where torch's own arithmetic first makes a float of it, as Adam's lr, it
    steps on). reprop took it as a double and trained with it (a
    np.uint64 that torch's SGD negates to 1, too); +-2**63 steps as torch."""
    v, torch_name, torch_key = BEYOND_64_BITS[value]
    if (name, key) == (torch_name, torch_key):
        torch_opt = torch_cls(name)([nn.Parameter(torch.ones(3))], **RICH[name])
        _set_hparam(torch_opt.param_groups[0], key, lambda _: v)
        torch_opt.param_groups[0]["params"][0].grad = torch.ones(3)
        with pytest.raises((OverflowError, TypeError)):  # (TypeError for a NumPy int)
            torch_opt.step()
    p = nn.Parameter(torch.ones(3))
    opt = reprop_cls(name)([p], **RICH[name])
    _set_hparam(opt.param_groups[0], key, lambda _: v)
    p.grad = torch.ones(3)
    state = _state_snapshot(opt, [p])
    with pytest.raises(OverflowError, match=rf"^{name}: param_groups\[0\]: {re.escape(key)}: "
                                            rf"the int {v} is beyond the 64-bit ints"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))
    assert _state_snapshot(opt, [p]) == state


@pytest.mark.parametrize("name, key", NUMERIC_HPARAM_CASES)
def test_int_hyperparameters_of_64_bits_step_like_torch(name: str, key: str) -> None:
    """+-2**63, the ints torch takes at every key, step as torch (to inf and
    NaN, or raising the same way)."""
    for v in (2**63, -2**63):
        outcomes = []
        for cls in (torch_cls(name), reprop_cls(name)):
            p = nn.Parameter(torch.linspace(-1, 1, 5))
            opt = cls([p], **RICH[name])
            _set_hparam(opt.param_groups[0], key, lambda _: v)
            try:
                for k in range(2):
                    p.grad = torch.linspace(0.5, -0.3, 5) * (k + 1)
                    opt.step()
                outcomes.append(p.detach())
            except (RuntimeError, ValueError):  # reprop: ValueError for torch's RuntimeError
                outcomes.append(k)
        if isinstance(outcomes[0], int):
            assert outcomes[1] == outcomes[0], (v, outcomes)
        else:
            torch.testing.assert_close(outcomes[1], outcomes[0], rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("make", [np.float32, np.array], ids=["float32", "array"])
@pytest.mark.parametrize("name, key", NUMERIC_HPARAM_CASES)
def test_numeric_hyperparameter_kinds_step_like_torch(name: str, key: str, make) -> None:
    """A NumPy float32 (no float subclass) and a 0-d NumPy array (refused
    before; torch takes one as lr, and refuses it where an op wants a
    tensor or a Number) step as their float value steps torch."""
    runs = []
    for cls, kind in ((torch_cls(name), lambda v: float(make(v))), (reprop_cls(name), make)):
        p = nn.Parameter(torch.linspace(-1, 1, 5))
        opt = cls([p], **RICH[name])
        _set_hparam(opt.param_groups[0], key, kind)
        for k in range(2):
            p.grad = torch.linspace(0.5, -0.3, 5) * (k + 1)
            opt.step()
        runs.append(p.detach())
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-6, atol=1e-7)


def _hparam_groups() -> dict:
    """Groups (and settings dicts) that optim_hparams builds the tuple of in
    C: each optimizer's torch-made group, and plain values of every kind it
    takes where a torch group may hold them."""
    p = nn.Parameter(torch.ones(2))
    groups = {name: reprop_cls(name)([p], **RICH[name]).param_groups[0] for name in NAMES}
    groups.update({f"{name}-defaults": reprop_cls(name)([p]).param_groups[0]
                   for name in ("Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta")})
    adam = groups["Adam"]
    groups.update({
        "int-lr-and-decay": {**adam, "lr": 1, "weight_decay": 0},
        "betas-list": {**adam, "betas": [0.5, 0.75]},
        "betas-of-ints": {**adam, "betas": (0, 1)},
        "capturable-float-lr": {**adam, "capturable": True},
        "capturable-none": {**adam, "capturable": None},
        "flags-as-ints": {**groups["SGD"], "nesterov": 1, "maximize": 0},
        "flags-as-floats-and-none": {**groups["RMSprop"], "centered": 2.5, "maximize": None},
        "flags-all-set": {**adam, "nesterov": True, "maximize": True, "amsgrad": True,
                          "decoupled_weight_decay": True, "centered": True},
        "lr-only": {"lr": 0.25},
        "int-lr-of-64-bits": {"lr": -2**63, "eps": 2**63 - 1},
        "float-extremes": {"lr": float("inf"), "eps": float("nan"), "momentum": -0.0},
    })
    return groups


def _any_optimizer() -> torch.optim.Optimizer:
    return rp.SGD([nn.Parameter(torch.ones(1))], lr=0.1)


@pytest.mark.parametrize("key", list(_hparam_groups()))
def test_hparams_tuple_built_in_c_is_pythons(key: str) -> None:
    """_C.optim_hparams builds _update's hparams tuple in C for a group of
    plain values: the same entries, of the same types (an int stays an int,
    a flag is a bool), in the same order, as _hparams_of, the Python code
    that built every tuple before; _hparams returns it."""
    group = _hparam_groups()[key]
    made = _C.optim_hparams(group)
    assert made is not None
    want = [(type(v), repr(v)) for v in rp._hparams_of(group)]  # repr: nan, -0.0
    assert [(type(v), repr(v)) for v in made] == want
    assert [(type(v), repr(v)) for v in _any_optimizer()._hparams(group)] == want


class _GroupDict(dict):
    """A param group kept in a dict subclass, whose lookups run its own code."""

    def get(self, key, default=None):
        return super().get(key, 0.5 if key == "momentum" else default)


class _Real(float):
    """A float subclass: Python's _scalar takes its float() (__float__)."""

    def __float__(self):
        return 0.125


def _python_hparam_groups() -> dict:
    """Groups optim_hparams leaves to Python (None): a value it would have
    to convert, one to refuse, or a lookup that runs Python code."""
    p = nn.Parameter(torch.ones(2))
    adam = reprop_cls("Adam")([p], **RICH["Adam"]).param_groups[0]
    return {
        "tensor-lr": {**adam, "lr": torch.tensor(0.5)},
        "capturable-tensor-lr": {**adam, "lr": torch.tensor(0.5), "capturable": True},
        "numpy-lr": {**adam, "lr": np.float32(0.1)},
        "numpy-f64-lr": {**adam, "lr": np.float64(0.1)},  # a float subclass
        "array-eps": {**adam, "eps": np.array(1e-3)},
        "float-subclass": {**adam, "weight_decay": _Real(0.5)},
        "bool-lr": {**adam, "lr": True},
        "bool-beta": {**adam, "betas": (True, 0.5)},
        "str-lr": {**adam, "lr": "0.1"},
        "none-momentum": {**adam, "momentum": None},
        "tensor-betas": {**adam, "betas": torch.tensor([0.5, 0.75])},
        "short-betas": {**adam, "betas": (0.5,)},
        "betas-of-three": {**adam, "betas": (0.5, 0.75, 2)},
        "betas-list-of-three": {**adam, "betas": [0.5, 0.75, 2]},
        "float-betas": {**adam, "betas": 0.5},
        "tuple-subclass-betas": {**adam, "betas": torch.Size([0, 1])},
        "no-lr": {k: v for k, v in adam.items() if k != "lr"},
        "tensor-flag": {**adam, "amsgrad": torch.tensor([True, False])},
        "numpy-flag": {**adam, "maximize": np.bool_(True)},
        "tensor-capturable": {**adam, "capturable": torch.tensor([True, True])},
        "dict-subclass": _GroupDict(adam),
        "int-beyond-64-bits": {**adam, "lr": 2**63},  # taken, as torch takes it
        "huge-int-lr": {"lr": 10**400},  # _scalar's OverflowError
    }


@pytest.mark.parametrize("key", list(_python_hparam_groups()))
def test_hparams_tuple_left_to_python_converts_or_refuses_as_before(key: str) -> None:
    """A group with a value optim_hparams does not take as it is gets None
    from it, and _hparams (and so _update) then returns or raises what
    _hparams_of, the Python code, does: its conversion (a tensor lr, NumPy
    scalars, bools, a float subclass's __float__), its refusal, with its
    message, or the lookups of a dict subclass."""
    group = _python_hparam_groups()[key]
    assert _C.optim_hparams(group) is None

    def outcome(build):
        try:
            return repr(build(group))
        except Exception as e:  # noqa: BLE001 (compared, type and message)
            return f"{type(e).__name__}: {e}"

    want = outcome(rp._hparams_of)
    assert outcome(_any_optimizer()._hparams) == want
    expected = {"short-betas": "ValueError: betas: not enough values to unpack",
                "betas-of-three": "ValueError: betas: too many values to unpack",
                "betas-list-of-three": "ValueError: betas: too many values to unpack",
                "float-betas": "TypeError: betas: cannot unpack",
                "str-lr": "TypeError", "none-momentum": "TypeError", "no-lr": "KeyError",
                "tensor-flag": "RuntimeError", "tensor-capturable": "RuntimeError",
                "huge-int-lr": "OverflowError"}
    assert want.startswith(expected.get(key, "(")), want


@pytest.mark.parametrize("name", ["SGD", "Adam", "RMSprop"])
def test_hyperparameters_edited_in_place_between_steps_take_effect(name: str) -> None:
    """Each update reads the group's values as they are now, also those
    edited without replacing them: a betas (or any) list changed in place, a
    flag switched, an lr written by a scheduler. Against the same run with
    each value replaced by a new object, bitwise; and against a run without
    the edits, which must differ (the edits matter)."""
    options = {"SGD": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
               "Adam": {"lr": 1e-2, "weight_decay": 0.01},
               "RMSprop": {"lr": 1e-3, "momentum": 0.9, "weight_decay": 0.01}}[name]
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=5), grad_sequence(shapes, 6)

    def run(edit: str) -> list:
        params = [nn.Parameter(t.clone()) for t in init]
        opt = reprop_cls(name)(params, **options)
        group = opt.param_groups[0]
        if "betas" in group:  # (torch makes a tuple of the constructor's)
            group["betas"] = list(group["betas"])
        for k, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
            if edit == "none":
                continue
            # one edit at a time: nothing else changes in the group meanwhile
            if k == 0:  # a scheduler's write
                group["lr"] = group["lr"] * 0.5 if edit == "in_place" else float(
                    repr(group["lr"] * 0.5))
            elif k == 1:
                group["maximize"] = not group["maximize"]
            elif k == 2 and "betas" in group:
                if edit == "in_place":
                    group["betas"][0] -= 0.25
                else:
                    group["betas"] = [group["betas"][0] - 0.25, group["betas"][1]]
        return [p.detach() for p in params]

    edited, replaced, unedited = run("in_place"), run("replaced"), run("none")
    for a, b, c in zip(edited, replaced, unedited):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)


@pytest.mark.parametrize("name", NAMES)
def test_complex_param_raises(name: str) -> None:
    p = nn.Parameter(torch.randn(3, dtype=torch.cfloat))
    with pytest.raises((TypeError, ValueError), match="(?i)complex"):
        opt = reprop_cls(name)([p], **BASE[name])
        p.grad = torch.randn(3, dtype=torch.cfloat)
        opt.step()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_duplicate_params_in_a_group_raise(name: str) -> None:
    """torch warns that this will be an error; its loop updates such a param
    twice in a row, one fused call would do it twice at once (SGD momentum
    diverged from torch's silently)."""
    p, q = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="params: a parameter appears more than once"):
        reprop_cls(name)([p, q, p], **BASE[name])
    opt = reprop_cls(name)([q], **BASE[name])
    with pytest.raises(ValueError, match="params: a parameter appears more than once"):
        opt.add_param_group({"params": [p, p]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("key", ["lr", "weight_decay", "eps", "betas[0]", "betas[1]"])
def test_tensor_hyperparameter_off_the_cpu_is_refused_saying_what_is_taken(key: str,
                                                                           capturable: bool) -> None:
    """The kernels take every hyper-parameter as a host float but the lr of a
    capturable group, which they read on the device: a tensor one on another
    device (meta standing in for CUDA) is refused with a ValueError saying
    so. With capturable=True the message said "expected a float or a CPU
    tensor for a non-capturable update", which does not say why (or what
    would do) for betas; such an lr is not refused here, but by the step
    (_cuda_lr_pointer: it must be float32 on the params' device)."""
    opt = rp.Adam([nn.Parameter(torch.ones(3))], lr=0.1)
    group = dict(opt.param_groups[0], capturable=capturable)
    _set_hparam(group, key, lambda v: torch.tensor(float(v), device="meta"))
    if key == "lr" and capturable:
        assert opt._hparams(group)[0] == 0.0
        return
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}: only lr may be a tensor off the "
                                         r"CPU, a CUDA one with capturable=True; got a tensor on "
                                         r"meta$"):
        opt._hparams(group)


@pytest.mark.parametrize("name", CAPTURABLE_NAMES)
def test_capturable_with_cpu_params_raises(name: str) -> None:
    p = nn.Parameter(torch.randn(3))
    with pytest.raises((ValueError, RuntimeError), match="(?i)capturable"):
        opt = reprop_cls(name)([p], capturable=True)
        p.grad = torch.randn(3)
        opt.step()


@pytest.mark.parametrize("switched", ["before_the_first_step", "after_two_steps"])
@pytest.mark.parametrize("lr", [0.01, torch.tensor(0.01)], ids=["float_lr", "tensor_lr"])
@pytest.mark.parametrize("name", CAPTURABLE_NAMES)
def test_capturable_switched_on_for_cpu_params_is_refused_at_step(name: str, lr,
                                                                    switched: str) -> None:
    """capturable=True set by editing param_groups, on a group of CPU params:
    torch's update asserts at each step that capturable params are on a
    supported device. reprop checked that only at construction, so its
    params stepped on as before, or, with a tensor lr (which the capturable
    kernels read on the device), silently stopped moving with lr zeroed.
    Refused with a ValueError naming the group and capturable, leaving
    params and state as they were; switched off again, it steps on as torch."""
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=33), grad_sequence(shapes, 4)
    params = [nn.Parameter(t.clone()) for t in init]
    options = {**BASE[name], "lr": lr.clone() if isinstance(lr, torch.Tensor) else lr}
    opt = reprop_cls(name)(params, **options)
    done = 0 if switched == "before_the_first_step" else 2
    for step_grads in grads[:done]:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    opt.param_groups[0]["capturable"] = True
    for p, g in zip(params, grads[done]):
        p.grad = g.clone()
    before = copy.deepcopy(opt.state_dict()["state"])
    values = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"^\w+: param_groups\[0\]: capturable=True needs CUDA "
                                         r"parameters, got a parameter on cpu"):
        opt.step()
    torch.testing.assert_close(opt.state_dict()["state"], before, rtol=0, atol=0)
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)
    opt.param_groups[0]["capturable"] = False
    for step_grads in grads[done:]:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    ref = run_open_loop(factory(torch_cls(name), **options), init, grads)
    assert_runs_close(Run(params, opt), ref, OPEN_LOOP_TOL)


INVALID = [
    ("SGD", {"lr": -0.1}),
    ("SGD", {"momentum": -0.5}),
    ("SGD", {"weight_decay": -1.0}),
    ("SGD", {"nesterov": True}),
    ("SGD", {"momentum": 0.9, "dampening": 0.1, "nesterov": True}),
    ("Adam", {"lr": -1e-3}),
    ("Adam", {"eps": -1.0}),
    ("Adam", {"betas": (1.0, 0.999)}),
    ("Adam", {"betas": (0.9, -0.1)}),
    ("Adam", {"weight_decay": -0.1}),
    ("AdamW", {"betas": (0.9, 1.5)}),
    ("AdamW", {"weight_decay": -0.1}),
    ("Adagrad", {"lr_decay": -1.0}),
    ("Adagrad", {"initial_accumulator_value": -0.1}),
    ("Adagrad", {"eps": -1.0}),
    ("RMSprop", {"alpha": -0.1}),
    ("RMSprop", {"momentum": -0.1}),
    ("RMSprop", {"eps": -1.0}),
    ("Adadelta", {"rho": 1.5}),
    ("Adadelta", {"lr": -1.0}),
    ("Adadelta", {"eps": -1.0}),
]


@pytest.mark.parametrize("name, options", INVALID, ids=[f"{n}-{o}" for n, o in INVALID])
def test_invalid_hyperparameters_raise_like_torch(name: str, options: dict) -> None:
    with pytest.raises(Exception) as expected:
        torch_cls(name)([nn.Parameter(torch.randn(3))], **options)
    with pytest.raises(expected.type, match=re.escape(str(expected.value))):
        reprop_cls(name)([nn.Parameter(torch.randn(3))], **options)


@pytest.mark.parametrize("name", NAMES)
def test_empty_parameter_list_raises_like_torch(name: str) -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        reprop_cls(name)([])


# ---------------------------------------------------------------------------
# 9. Memory layouts: channels_last and non-contiguous parameters and grads
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_channels_last_model_matches_torch(name: str, batches) -> None:
    got, ref = train_pair(name, RICH[name], batches[:20], channels_last=True)
    assert got.model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not got.model.conv.weight.is_contiguous()
    assert_runs_close(got, ref, TRAIN_TOL[name])


LAYOUTS = {
    # parameter made from the tensor, gradient made from the gradient
    "transposed": (lambda t: t.t(), lambda g: g.t()),
    "strided": (lambda t: torch.stack([t, t], -1)[..., 0], lambda g: torch.stack([g, g], -1)[..., 0]),
    "grad_layout_differs": (lambda t: t.t(), lambda g: g.t().contiguous()),
    "channels_last_4d": (
        lambda t: t.reshape(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        lambda g: g.reshape(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_params_match_torch(name: str, layout: str) -> None:
    make_param, make_grad = LAYOUTS[layout]
    shapes = [(12, 10), (10, 12)]
    init, grads = make_params(shapes, seed=16), grad_sequence(shapes, 4)
    grads = [[make_grad(g) for g in step] for step in grads]
    got = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads, make_param=make_param)
    ref = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads, make_param=make_param)
    if layout != "channels_last_4d":
        assert not got.params[0].is_contiguous()
    assert [p.stride() for p in got.params] == [p.stride() for p in ref.params]
    assert [p.grad.stride() for p in got.params] == [g.stride() for g in grads[-1]]
    assert_runs_close(got, ref, OPEN_LOOP_TOL)


# Parameters made from one (6, 8) tensor, sharing its memory (tied weights),
# with an unrelated (5,) parameter between them.
OVERLAPPING = {
    "transposed": lambda base, other: [base, other, base.t()],
    "same": lambda base, other: [base, other, base],
    "column_of": lambda base, other: [base, other, base[:, 3]],
    "column_first": lambda base, other: [base[:, 3], other, base, base[:, 4]],
}


@pytest.mark.parametrize("case", list(OVERLAPPING))
@pytest.mark.parametrize("name", NAMES)
def test_params_overlapping_in_memory_are_updated_in_turn(name: str, case: str) -> None:
    """torch updates a group's parameters one after another, so with tied
    weights the later update starts from the earlier one's result. reprop
    updated them in one call and wrote the staged copy of a non-contiguous
    one back over the other's update."""
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        base, other = make_params([(6, 8), (5,)], seed=31)
        params = [nn.Parameter(t) for t in OVERLAPPING[case](base, other)]
        opt = cls(params, **RICH[name])
        for step_grads in grad_sequence([p.shape for p in params], 4):
            for p, g in zip(params, step_grads):
                p.grad = g
            opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(*runs, OPEN_LOOP_TOL)


# The first state slot of each optimizer.
FIRST_SLOT = {"SGD": "momentum_buffer", "Adam": "exp_avg", "AdamW": "exp_avg", "Adagrad": "sum",
              "RMSprop": "square_avg", "Adadelta": "square_avg"}


def _one_tensor_for_all(base: torch.Tensor) -> tuple[list, Callable]:
    """Params of one core chunk each, updated in parallel on two threads
    (CUDA: blocks at once), given one state tensor for all."""
    def share(opt, params, key):
        for p in params[1:]:
            opt.state[p][key] = opt.state[params[0]][key]
    return [base[:32768].clone() for _ in range(8)], share


def _state_over_a_params_memory_with_gaps(base: torch.Tensor) -> tuple[list, Callable]:
    """The state of param 1 is contiguous memory that param 0, a view with
    gaps (updated through a copy taken before the call, written back after
    it), has every other element of."""
    def share(opt, params, key):
        opt.state[params[1]][key] = base[:16].detach()
    return [base[:32:2], base[32:48].clone()], share


# State made by hand after the first step, from a tensor of values in [0.5, 1.5)
# (the first slot of Adagrad, RMSprop and Adadelta, what is shared, stays positive):
# (params, share(opt, params, key)).
SHARED_STATE = {
    "one_tensor_for_all": _one_tensor_for_all,
    "over_a_params_memory_with_gaps": _state_over_a_params_memory_with_gaps,
}


@pytest.mark.parametrize("case", list(SHARED_STATE))
@pytest.mark.parametrize("name", NAMES)
def test_state_shared_by_params_is_updated_in_turn(name: str, case: str) -> None:
    """State tensors that share memory with other params or their state
    (made by hand: one momentum buffer put in for all) are read and written
    by torch's update of each param in turn. reprop updated all in one
    call: its threads raced on a shared tensor, and a param with gaps was
    written back over the state of a later one."""
    runs = []
    with torch_threads(2):
        for cls in (reprop_cls(name), torch_cls(name)):
            base = make_params([(32768,)], seed=32)[0].abs() + 0.5
            init, share = SHARED_STATE[case](base)
            params = [nn.Parameter(t) for t in init]
            opt = cls(params, **RICH[name])
            for k, step_grads in enumerate(grad_sequence([p.shape for p in params], 4)):
                for p, g in zip(params, step_grads):
                    p.grad = g
                opt.step()
                if k == 0:
                    share(opt, params, FIRST_SLOT[name])
            runs.append(Run(params, opt))
    assert_runs_close(*runs, OPEN_LOOP_TOL)


# (optimizer, the key set to its param's memory or to its first state tensor)
OWN_SHARED_STATE = ([(name, "param") for name in NAMES]
                    + [(name, "state") for name in ("Adam", "AdamW", "RMSprop", "Adadelta")])


@pytest.mark.parametrize("name, other", OWN_SHARED_STATE)
def test_state_sharing_its_params_or_its_other_states_memory_is_refused(name: str,
                                                                       other: str) -> None:
    """A param's state tensor that is the param's memory or another of its
    state tensors (made by hand) is written by torch's ops one after another;
    the kernels read all of an element's values at once, through pointers
    they take to be apart (C's restrict): Adam gave NaN. Refused naming the
    key, with nothing changed."""
    p = nn.Parameter(torch.rand(6, 4, generator=torch.Generator().manual_seed(3)) + 0.5)
    opt = reprop_cls(name)([p], **RICH[name])
    p.grad = torch.full_like(p, 0.1)
    opt.step()
    first = FIRST_SLOT[name]
    key = first if other == "param" else next(k for k in opt.state[p] if k not in ("step", first))
    opt.state[p][key] = p.detach() if other == "param" else opt.state[p][first]
    before = copy.deepcopy(opt.state[p]), p.detach().clone()
    shared = "the parameter" if other == "param" else f"its {first}"
    with pytest.raises(ValueError, match=rf"^{name}: param_groups\[0\]: {key}: the state of a "
                                         rf"parameter of shape \(6, 4\) shares memory with "
                                         rf"{shared} \(state made by hand\)"):
        opt.step()
    _assert_untouched(opt, p, *before[:2])


# A parameter and a gradient sharing its memory, made from one (96,) tensor:
# views of it with some of its other elements around them.
SHARED_GRADS = {
    "same": lambda t: (t[8:75], t[8:75]),  # p.grad = p.data
    "grad_before": lambda t: (t[8:75], t[4:71]),
    "grad_after": lambda t: (t[8:75], t[12:79]),
    "transposed": lambda t: (t[:80].view(8, 10), t[:80].view(10, 8).t()),
    "param_with_gaps": lambda t: (t[:80].view(8, 10)[:, :7], t[:80].view(8, 10)[:, 2:9]),
    "negative": lambda t: (t[8:75], t[8:75]._neg_view()),
}
# Options under which torch takes no inexact square root (its CPU sqrt is not
# correctly rounded): beta2 = 0 and alpha = 0 make the second moment g * g,
# whose square root is |g| in both libraries.
SHARED_GRAD_OPTIONS = [
    ("AdamW", {"lr": 0.1, "betas": (0.9, 0.0), "weight_decay": 0.5}),
    ("AdamW", {"lr": 0.1, "betas": (0.9, 0.0), "weight_decay": 0.5, "amsgrad": True,
               "maximize": True}),
    ("Adam", {"lr": 0.1, "betas": (0.9, 0.0), "weight_decay": 0.5, "decoupled_weight_decay": True}),
    ("Adam", {"lr": 0.1, "betas": (0.9, 0.0), "weight_decay": 0.5}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    ("RMSprop", {"lr": 0.1, "alpha": 0.0, "momentum": 0.5}),
]


@pytest.mark.parametrize("case", list(SHARED_GRADS))
@pytest.mark.parametrize("name, options", SHARED_GRAD_OPTIONS,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(SHARED_GRAD_OPTIONS)])
def test_gradient_sharing_its_params_memory_is_read_as_torchs_update_reads_it(
        name: str, options: dict, case: str) -> None:
    """A gradient that shares its parameter's memory (p.grad = p.data, a view
    overlapping it) is read as torch's update reads it: AdamW's decoupled
    decay multiplies the param in place first, so it reads the decayed values
    there (the kernels read the undecayed ones: exp_avg twice torch's for
    p.grad = p.data with lr * weight_decay = 0.5), and every other element is
    read before the update writes any (the kernels read an element after
    writing the one it overlaps when the gradient starts below the param).
    Five steps, the first building the plan and the others through the cached
    one: the whole tensor and the state are torch's bit for bit, its
    single-tensor update's and its foreach one's."""
    runs = []
    for cls, extra in ((reprop_cls(name), {}), (torch_cls(name), {"foreach": False}),
                       (torch_cls(name), {"foreach": True})):
        (t,) = make_params([(96,)], seed=47)
        param, grad = SHARED_GRADS[case](t)
        p = nn.Parameter(param)
        opt = cls([p], **options, **extra)
        for _ in range(5):
            p.grad = grad
            opt.step()
        runs.append((t, Run([p], opt)))
    (got_t, got), *refs = runs
    for ref_t, ref in refs:
        assert torch.equal(got_t, ref_t), f"{(got_t != ref_t).sum()} elements differ from torch's"
        assert_runs_equal(got, ref)


# Every tensor of each optimizer's state under RICH's options.
STATE_KEYS = {
    "SGD": ("momentum_buffer",),
    "Adam": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "Adagrad": ("step", "sum"),
    "RMSprop": ("step", "square_avg", "momentum_buffer", "grad_avg"),
    "Adadelta": ("step", "square_avg", "acc_delta"),
}


@pytest.mark.parametrize("when", ["cached", "new_plan"])
@pytest.mark.parametrize("name, key", [(n, k) for n in NAMES for k in STATE_KEYS[n]])
def test_gradient_sharing_its_own_states_memory_is_refused(name: str, key: str, when: str) -> None:
    """A gradient that is one of its param's state tensors (p.grad =
    opt.state[p]["momentum_buffer"]) is read by torch's update after its
    in-place ops have written that tensor, each of its implementations at
    another point (SGD with nesterov: for-loop, foreach and fused give three
    results), while the kernels, whose pointers C's restrict takes to be
    apart, read it once: SGD and Adagrad were silently off against torch's
    for-loop (0.2 and 6.9 after three steps). Refused naming grads and the
    key, with the param and state as they were and no state made for the
    other param, whether the plan is cached or built by this step (the
    other param's first gradient: a one-element param for the step count,
    which is the only one a step tensor can be the gradient of)."""
    shape = () if key == "step" else (6, 4)
    p = nn.Parameter(torch.rand(shape, generator=torch.Generator().manual_seed(5)) + 0.5)
    q = nn.Parameter(torch.rand(3))
    opt = reprop_cls(name)([p, q], **RICH[name])
    for _ in range(2):
        p.grad = torch.full_like(p, 0.1)
        opt.step()
    if when == "new_plan":
        q.grad = torch.full_like(q, 0.1)
    p.grad = opt.state[p][key]
    before = copy.deepcopy(opt.state[p]), p.detach().clone(), _state_snapshot(opt, [q])
    with pytest.raises(ValueError, match=rf"^{name}: param_groups\[0\]: grads: the gradient of a "
                                         rf"parameter of shape {re.escape(str(shape))} shares "
                                         rf"memory with its {key}; "):
        opt.step()
    _assert_untouched(opt, p, *before[:2])
    assert _state_snapshot(opt, [q]) == before[2]  # (Adagrad's constructor makes its state)


@pytest.mark.parametrize("when", ["cached", "new_plan"])
@pytest.mark.parametrize("other", ["param", "state"])
@pytest.mark.parametrize("name", NAMES)
def test_gradient_sharing_another_updated_params_memory_is_refused(name: str, other: str,
                                                                  when: str) -> None:
    """A gradient that is another param's memory, or one of its state
    tensors, while that param is updated in the same step: torch's for-loop
    reads it after or before that param's update by their order in the
    group, its foreach update before (SGD: 0.2 apart after three steps), and
    the fused update's threads (CUDA's blocks) raced on it. Refused naming
    grads and what it shares; with that param sitting the step out (no
    gradient), nothing writes the memory, and the update is torch's, its
    for-loop's and its foreach one's."""
    key = FIRST_SLOT[name]
    shapes = [(6, 4), (6, 4), (3,)]
    init, grads = make_params(shapes, seed=52), grad_sequence(shapes, 4)
    runs = []
    for cls, extra in ((reprop_cls(name), {}), (torch_cls(name), {"foreach": False}),
                       (torch_cls(name), {"foreach": True})):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **RICH[name], **extra)
        for k, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            if k < 2 or when == "cached":
                params[2].grad = None  # its first gradient at step 2 makes a new plan
            if k >= 2:
                shared = params[0].detach() if other == "param" else opt.state[params[0]][key]
                params[1].grad = shared
            if k == 2 and cls is reprop_cls(name):
                before = _state_snapshot(opt, params), [p.detach().clone() for p in params]
                what = "another parameter" if other == "param" else f"the {key} of another parameter"
                with pytest.raises(ValueError, match=rf"^{name}: param_groups\[0\]: grads: the "
                                                     rf"gradient of a parameter of shape \(6, 4\) "
                                                     rf"shares memory with {what} of shape "
                                                     rf"\(6, 4\) that this step updates; "):
                    opt.step()
                assert _state_snapshot(opt, params) == before[0]
                assert all(torch.equal(p.detach(), b) for p, b in zip(params, before[1]))
            if k >= 2:
                params[0].grad = None  # sits the step out: its memory is read as it is
            opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(runs[0], runs[1], OPEN_LOOP_TOL)
    assert_runs_close(runs[0], runs[2], OPEN_LOOP_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_gradient_of_its_own_params_memory_beside_an_interleaved_param_is_read(name: str) -> None:
    """Two params that are columns of one matrix (their spans meet, their
    elements do not), one given its own memory as gradient (p.grad =
    p.detach()) while the other is updated too: the refusal of a gradient
    meeting another updated param's span refused it, comparing spans, where
    main read it through a copy as its own memory, as torch's update reads
    it. Read so again."""
    init = torch.rand(6, 2, generator=torch.Generator().manual_seed(54)) + 0.5
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        w = init.clone()
        params = [nn.Parameter(w[:, 0]), nn.Parameter(w[:, 1])]
        opt = cls(params, **RICH[name])
        for k in range(3):
            params[0].grad = params[0].detach()
            params[1].grad = torch.full((6,), 0.1 * (k + 1))
            opt.step()
        runs.append(w)
    torch.testing.assert_close(runs[0], runs[1], rtol=OPEN_LOOP_TOL.rtol, atol=OPEN_LOOP_TOL.atol)


@pytest.mark.parametrize("case", ["other_columns", "own_transposed"])
@pytest.mark.parametrize("name", NAMES)
def test_gradient_interleaved_with_another_updated_param_is_read(name: str, case: str) -> None:
    """A gradient whose span meets another updated param's while it shares no
    element with it: q the even columns of a matrix B, and p's gradient B's
    odd columns (p of its own memory), or p the odd columns and its gradient
    p's own elements transposed. Spans were compared, and both refused as
    sharing q's memory, where torch's update (and main) steps. Read, as
    torch reads them; the second through a copy, as its own memory."""
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        b = torch.rand(4, 8, generator=torch.Generator().manual_seed(57)) + 0.5
        own = torch.rand(4, 4, generator=torch.Generator().manual_seed(58)) + 0.5
        q = nn.Parameter(b[:, 0::2])
        p = nn.Parameter(own if case == "other_columns" else b[:, 1::2])
        opt = cls([p, q], **RICH[name])
        for k in range(3):
            q.grad = torch.full((4, 4), 0.1 * (k + 1))
            if case == "other_columns":
                b[:, 1::2] = 0.05 * (k + 1)
                p.grad = b[:, 1::2]
            else:
                p.grad = p.detach().t()
            opt.step()
        runs.append(Run([p, q], opt))
    assert_runs_close(*runs, OPEN_LOOP_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_gradient_of_a_param_with_gaps_beside_another_param_takes_the_fast_path(
        name: str, monkeypatch) -> None:
    """A param with gaps in memory (two columns of a 64x64 matrix: 128
    elements over 16 kB) and its contiguous gradient (512 bytes), followed in
    memory by another param: the C fast path took the param's span as the
    gradient's, met the other param, and sent every step to the Python path
    (Adam with 200 params of 1000 beside such a param: 819 -> 1824 us a
    step). The fast path reads it, and the update is torch's."""
    init = [torch.rand(64, 64, generator=torch.Generator().manual_seed(55)) + 0.5,
            torch.rand(32, generator=torch.Generator().manual_seed(56)) + 0.5]
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        spy = _FastPathSpy()
        monkeypatch.setattr(rp, "_C", spy)
        buf = torch.zeros(128 + 32)  # the gradient, then the other param, back to back
        buf[128:] = init[1]
        params = [nn.Parameter(init[0].clone()[:, :2]), nn.Parameter(buf[128:])]
        opt = cls(params, **RICH[name])
        for k in range(4):
            buf[:128] = 0.1 * (k + 1)
            params[0].grad = buf[:128].view(64, 2)
            params[1].grad = torch.full((32,), 0.05 * (k + 1))
            opt.step()
        runs.append(Run(params, opt))
        if cls is reprop_cls(name):
            assert spy.read == [True] * 4
    assert_runs_close(*runs, OPEN_LOOP_TOL)


# A tensor's layout changed in place, keeping the object and its address: a
# transpose of a square tensor's memory, as torch's ops then read it.
RELAID = {
    "t_": lambda t: t.t_(),
    "as_strided_": lambda t: t.as_strided_(t.shape, t.stride()[::-1]),
    "set_": lambda t: t.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride()[::-1]),
    "data_view": lambda t: setattr(t, "data", t.data.t()),
}


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("change", list(RELAID))
@pytest.mark.parametrize("what", ["state", "param", "grad"])
@pytest.mark.parametrize("name", NAMES)
def test_tensor_relaid_in_place_between_steps_is_read_in_its_new_layout(
        name: str, what: str, change: str, layout: str) -> None:
    """A state tensor whose layout changes in place after the plan was built
    (exp_avg.t_(), as_strided_, set_ with other strides, .data swapped for a
    transposed view of itself) keeps its identity and address, all that the
    cached plan checked of state: the kernels went on reading it in its old
    layout, the transpose of what torch's update reads (SGD 0.2, Adam 0.5
    off after three steps). The plan is rebuilt, and the state read in its
    new layout, as torch reads it; so are a param and a gradient changed so
    (their layouts were checked at every step already). A contiguous param
    (the C fast path) and a transposed one (the Python path), square so that
    a transpose keeps the shape torch's update needs."""
    shapes = [(8, 8), (5,)]
    init, grads = make_params(shapes, seed=53), grad_sequence(shapes, 4)
    if layout == "transposed":
        init[0] = init[0].t().contiguous().t()
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        params = [nn.Parameter(clone_exact(t)) for t in init]
        opt = cls(params, **RICH[name])
        for k, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = clone_exact(g) if layout == "contiguous" else g.t().contiguous().t()
            if k == 2 and what == "grad":
                params[0].grad = params[0].grad.t().contiguous()  # its values, transposed below
                RELAID[change](params[0].grad)
            opt.step()
            if k == 0 and what == "state":
                RELAID[change](opt.state[params[0]][FIRST_SLOT[name]])
            if k == 0 and what == "param":
                RELAID[change](params[0].data if change != "data_view" else params[0])
        runs.append(Run(params, opt))
    assert_runs_close(*runs, OPEN_LOOP_TOL)


class _GuardSpy(_FastPathSpy):
    """_FastPathSpy noting too the layout guard each call of the fast path
    was given (optim_grad_pointers' last argument): None, True (find the
    rows' tensors for one) or a guard."""

    def __init__(self):
        super().__init__()
        self.guards = []

    def optim_grad_pointers(self, *args):
        self.guards.append(args[-1])
        return super().optim_grad_pointers(*args)


# A change of layout made where the fast path reads the rows with a layout
# guard: a square param or its state tensor transposed, a gradient transposed
# in memory or given torch's negative bit.
GUARDED = {
    "param": lambda p, st: setattr(p, "data", p.data.t()),
    "state": lambda p, st: st.t_(),
    "grad_transposed": lambda p, st: setattr(p, "grad", p.grad.t().contiguous().t()),
    "grad_negative": lambda p, st: setattr(p, "grad", _negative_bit(p.grad)),
}


@pytest.mark.parametrize("change", list(GUARDED))
@pytest.mark.parametrize("name", NAMES)
def test_each_change_of_layout_is_seen_under_the_fast_paths_layout_guard(
        name: str, change: str, monkeypatch) -> None:
    """From its second or third step a plan's fast path looks at identities
    and addresses only, and leaves the rows' layouts to one call of a guard
    built from tensors it found right (_Plan._keep_guard), of the rows
    taking part (the last param has no gradient from the second step on).
    Each change of layout it looked for itself is still seen there, and read
    as torch reads it: results as torch's."""
    shapes = [(8, 8), (5,), (3,)]
    init, grads = make_params(shapes, seed=61), grad_sequence(shapes, 6)
    for step_grads in grads[1:]:
        step_grads[2] = None
    spy = _GuardSpy()
    monkeypatch.setattr(rp, "_C", spy)
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        params = [nn.Parameter(clone_exact(t)) for t in init]
        opt = cls(params, **RICH[name])
        for k, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = None if g is None else clone_exact(g)
            if k == 4:
                GUARDED[change](params[0], opt.state[params[0]][FIRST_SLOT[name]])
            opt.step()
        runs.append(Run(params, opt))
    assert callable(spy.guards[3]) and callable(spy.guards[4])
    assert_runs_close(*runs, OPEN_LOOP_TOL)


# A (4, 6) param's state tensor given another shape in place, keeping the
# object and its address: as many elements in another shape, or fewer (the
# last, onto a storage that ends before the param's numel floats do).
STATE_RESHAPED = {
    "as_strided_": lambda t: t.as_strided_((6, 4), (4, 1)),
    "as_strided_fewer": lambda t: t.as_strided_((3, 6), (6, 1)),
    "resize_": lambda t: t.resize_(3, 6),
    "set_": lambda t: t.set_(t.untyped_storage()[:72], 0, (3, 6), (6, 1)),
}


@pytest.mark.parametrize("path", ["fast", "python"])
@pytest.mark.parametrize("change", list(STATE_RESHAPED))
@pytest.mark.parametrize("name", NAMES)
def test_state_reshaped_in_place_between_steps_is_refused_as_torch_refuses_it(
        name: str, change: str, path: str) -> None:
    """A state tensor reshaped in place after the plan was built keeps its
    identity and address, and the C fast path looked only at its contiguity:
    the kernels stepped on (6, 4) or (3, 6) state of a (4, 6) param, reading
    and writing 24 floats from its address, past its 18 elements (set_ onto a
    72-byte storage: past the storage's end); the Python path (a gradient
    transposed in memory) compared strides, the same for (3, 6). torch's
    update refuses such state (its for-loop and foreach ops: the sizes must
    match). Refused on both paths with the RuntimeError a state tensor of
    another shape set by hand gets, naming the key and both shapes, the
    param and state as they were."""
    key = FIRST_SLOT[name]
    shape = (6, 4) if change == "as_strided_" else (3, 6)
    for cls in (torch_cls(name), reprop_cls(name)):
        p = nn.Parameter(torch.rand(4, 6, generator=torch.Generator().manual_seed(60)) + 0.5)
        opt = cls([p], **RICH[name])
        for k in range(3):
            p.grad = (torch.full((4, 6), 0.1 * (k + 1)) if path == "fast"
                      else torch.full((6, 4), 0.1 * (k + 1)).t())
            if k < 2:
                opt.step()
        t = opt.state[p][key]
        storage = t.untyped_storage()  # (set_: the memory the smaller storage is part of)
        STATE_RESHAPED[change](t)
        assert tuple(t.shape) == shape and t.untyped_storage().data_ptr() == storage.data_ptr()
        before = p.detach().clone(), _state_snapshot(opt, [p])
        with pytest.raises(RuntimeError, match="must match the size of tensor|"
                                               + re.escape(f"{key}: the state of a parameter "
                                                           f"of shape (4, 6) on cpu is a tensor "
                                                           f"of shape {shape}, torch.float32")):
            opt.step()
    assert torch.equal(p.detach(), before[0])  # (reprop's: torch's ops wrote some before)
    assert _state_snapshot(opt, [p]) == before[1]
    with pytest.raises(RuntimeError, match=rf"^{key}: .* expected a dense floating-point tensor "
                                           rf"of the parameter's shape on its device$"):
        opt.step()  # (the plan stays stale: refused again)


@pytest.mark.parametrize("how", ["expand", "as_strided_"])
@pytest.mark.parametrize("name", NAMES)
def test_expanded_state_is_refused_as_torch_refuses_it(name: str, how: str) -> None:
    """A state tensor that repeats its elements along a dim (stride 0: set
    to an expanded tensor, or made so in place by as_strided_), which torch's
    in-place update refuses ("more than one element of the written-to tensor
    refers to a single memory location"): reprop trained on a contiguous copy
    that it put in the state in its place, silently. Refused naming the key
    with torch's RuntimeError, the param and state as they were."""
    key = FIRST_SLOT[name]
    for cls in (torch_cls(name), reprop_cls(name)):
        p = nn.Parameter(torch.rand(8, 8, generator=torch.Generator().manual_seed(6)) + 0.5)
        opt = cls([p], **RICH[name])
        for _ in range(2):
            p.grad = torch.full_like(p, 0.1)
            opt.step()
        t = opt.state[p][key]
        if how == "expand":
            opt.state[p][key] = t[:1].expand(8, 8)
        else:
            t.as_strided_((8, 8), (0, 1))
        p.grad = torch.full_like(p, 0.1)
        before = p.detach().clone(), _state_snapshot(opt, [p])
        with pytest.raises(RuntimeError, match="more than one element of the written-to tensor "
                                               "refers to a single memory location"):
            opt.step()
    assert torch.equal(p.detach(), before[0])
    assert _state_snapshot(opt, [p]) == before[1]
    with pytest.raises(RuntimeError, match=rf"^{key}: the state of a parameter of shape \(8, 8\) "
                                           rf"on cpu is expanded \(stride 0 along dims \[0\]\)"):
        opt.step()


@pytest.mark.parametrize("name", NAMES)
def test_zero_element_state_with_stride_0_steps_as_torch(name: str) -> None:
    """A zero-element param expanded from (1, 0) (strides (0, 1)): its state,
    made by zeros_like or clone, keeps stride 0 without repeating anything,
    and was refused as expanded after load_state_dict(state_dict()) (reprop's
    own exp_avg), where torch steps. Stepped, as torch."""
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        p = nn.Parameter(torch.zeros(1, 0).expand(3, 0))
        w = nn.Parameter(torch.rand(4, generator=torch.Generator().manual_seed(59)) + 0.5)
        opt = cls([p, w], **RICH[name])
        for k in range(3):
            p.grad, w.grad = torch.zeros(3, 0), torch.full((4,), 0.1 * (k + 1))
            opt.step()
            opt.load_state_dict(opt.state_dict())
        runs.append(Run([p, w], opt))
    assert_runs_close(*runs, OPEN_LOOP_TOL)


# ---------------------------------------------------------------------------
# 10. What the cached pointer tables assume, changed between steps
# ---------------------------------------------------------------------------

# Options switched on after the first step: (name, options, step -> group update).
LATE_OPTIONS = {
    "SGD-momentum": ("SGD", {"lr": 0.1}, {1: {"momentum": 0.9}, 3: {"momentum": 0.0}, 4: {"momentum": 0.5}}),
    "SGD-nesterov": ("SGD", {"lr": 0.1}, {2: {"momentum": 0.9, "nesterov": True}}),
    "Adam-amsgrad": ("Adam", {"lr": 0.1}, {1: {"amsgrad": True}}),
    "AdamW-amsgrad": ("AdamW", {"lr": 0.1}, {1: {"amsgrad": True}}),
    "RMSprop-momentum": ("RMSprop", {"lr": 0.01}, {1: {"momentum": 0.9}}),
    "RMSprop-centered": ("RMSprop", {"lr": 0.01}, {1: {"centered": True}}),
    "Adam-amsgrad-off": ("Adam", {"lr": 0.1, "amsgrad": True}, {2: {"amsgrad": False}}),
    "RMSprop-off": ("RMSprop", {"lr": 0.01, "momentum": 0.9, "centered": True}, {2: {"momentum": 0.0, "centered": False}}),
    # torch's RMSprop keeps and uses a momentum buffer only while momentum > 0
    "RMSprop-negative": ("RMSprop", {"lr": 0.01, "momentum": 0.9}, {0: {"momentum": -0.5}}),
    "RMSprop-nan": ("RMSprop", {"lr": 0.01, "momentum": 0.9},
                    {2: {"momentum": float("nan")}, 4: {"momentum": 0.9}}),
}


@pytest.mark.parametrize("case", list(LATE_OPTIONS))
def test_options_that_need_state_changed_after_first_step_act_like_torch(case: str) -> None:
    """The state an update needs depends on the hyper-parameters: SGD creates
    its momentum buffer whenever momentum is first non-zero (also after
    steps without it), while torch's Adam (amsgrad) and RMSprop (momentum,
    centered) create all state at the first step and raise KeyError when an
    option that needs more is switched on later. reprop must do the same, not
    reuse a pointer table built for the old options."""
    name, options, changes = LATE_OPTIONS[case]
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=21), grad_sequence(shapes, 6)
    runs, errors = [], []
    for cls in (reprop_cls(name), torch_cls(name)):
        params = [nn.Parameter(t.clone()) for t in init]
        opt = cls(params, **options)
        error = None
        for k, step_grads in enumerate(grads):
            opt.param_groups[0].update(changes.get(k, {}))
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            try:
                opt.step()
            except KeyError as e:
                error = e
                break
        runs.append(Run(params, opt))
        errors.append(error)
    got_error, ref_error = errors
    assert (got_error is None) == (ref_error is None), f"reprop: {got_error!r}, torch: {ref_error!r}"
    if ref_error is not None:
        assert str(got_error).startswith(repr(ref_error.args[0])[:-1]), got_error
    assert_runs_close(*runs, OPEN_LOOP_TOL)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("name", NAMES)
def test_copied_optimizer_steps_like_the_original(name: str, how: str) -> None:
    """copy.deepcopy(opt) and torch.save/torch.load(opt) keep only torch's
    state (defaults, state, param_groups): the copy must set up its fused
    step again and continue exactly as the original does."""
    shapes = [(4, 3), (5,), (6,)]
    init, grads = make_params(shapes, seed=22), grad_sequence(shapes, 6)
    params = [nn.Parameter(t.clone()) for t in init]
    opt = reprop_cls(name)(split_groups(params, group1_overrides(name, RICH[name])), **RICH[name])
    for step_grads in grads[:3]:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
    else:
        buf = io.BytesIO()
        torch.save(opt, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert all(a is not b for a, b in zip(twin_params, params))
    for step_grads in grads[3:]:
        for pa, pb, g in zip(params, twin_params, step_grads):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt.step()
        twin.step()
    assert_runs_equal(Run(twin_params, twin), Run(params, opt))
    # The copy still forgets its tables on load_state_dict, once.
    hooks = list(twin._optimizer_load_state_dict_post_hooks.values())
    assert hooks.count(rp._FusedOptimizer._forget_plans) == 1
    twin.load_state_dict(opt.state_dict())


SAME_ADDRESS = {
    # the parameter's new .data, made from the float32 storage `base` it starts
    # at, which has twice its elements: same data_ptr, another size, dtype or layout
    "narrowed": lambda base, n: base[:10],
    "reinterpreted_bf16": lambda base, n: base.view(torch.bfloat16)[:n],
    "strided": lambda base, n: base[::2],
}


@pytest.mark.parametrize("change", list(SAME_ADDRESS))
def test_param_data_replaced_at_the_same_address(change: str) -> None:
    """p.data replaced by a view of its own storage starting at the same
    address: the cached table (numel, dtype and layout of the old tensor) must
    not be reused, or the kernel reads the gradient and writes the parameter
    out of bounds. SGD without momentum is stateless, so torch accepts this."""
    n = 4096
    results = []
    for cls in (rp.SGD, torch.optim.SGD):
        p = nn.Parameter(torch.zeros(2 * n)[:n])
        opt = cls([p], lr=1.0)
        p.grad = torch.ones_like(p)
        opt.step()
        storage = p.untyped_storage()
        base = torch.empty(0).set_(storage, 0, (2 * n,))
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        p.data = SAME_ADDRESS[change](base, n)
        assert p.data_ptr() == base.data_ptr()
        with torch.no_grad():
            raw.fill_(0x55)
            p.zero_()
        outside = raw == 0x55  # every byte the new parameter does not cover
        p.grad = torch.ones_like(p)
        opt.step()
        assert (raw[outside] == 0x55).all(), f"{cls.__module__}: wrote outside the parameter"
        results.append(p.detach().clone())
    assert torch.equal(*results)


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_param_reinterpreted_keeping_its_gradient_is_refused(name: str) -> None:
    """p.data replaced by its own memory read as another dtype of the same
    size (float16 as bfloat16: same address, shape and layout), its float16
    gradient kept: the cached row (float16 loops) must not be reused, which
    would update bfloat16 bits as float16 ones; the gradient no longer
    matches the param, which reprop refuses naming it, leaving p as it was."""
    p = nn.Parameter(torch.ones(4, dtype=torch.float16))
    p.grad = torch.full((4,), 0.5, dtype=torch.float16)
    opt = reprop_cls(name)([p], lr=0.1)
    opt.step()
    p.data = p.data.view(torch.bfloat16)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"grads: .*torch\.float16.* does not match its parameter"):
        opt.step()
    assert torch.equal(p.detach(), before)


RESHAPED = {
    # a gradient or parameter of the same numel and address, another shape
    "grad": lambda p: setattr(p.grad, "data", p.grad.data.reshape(3, 2)),
    "param": lambda p: setattr(p, "data", p.data.reshape(3, 2)),
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("change", list(RESHAPED))
def test_reshaped_param_or_grad_is_refused_at_every_step(name: str, change: str) -> None:
    """A gradient that stops matching its parameter's shape (same numel)
    after the cached table was built is refused, as torch's update refuses
    it, with the parameter and state as they were (torch has counted the
    step by then). The cached step compared numel, not shape, and applied it."""
    for cls in (torch_cls(name), reprop_cls(name)):
        p = nn.Parameter(torch.randn(2, 3))
        opt = cls([p], **BASE[name])
        for _ in range(2):  # the second step is the cached one
            p.grad = torch.randn(2, 3)
            opt.step()
        p.grad = torch.randn(2, 3)
        RESHAPED[change](p)
        before, state = p.detach().clone(), _state_snapshot(opt, [p])
        with pytest.raises((RuntimeError, ValueError), match="size|shape"):
            opt.step()
    assert torch.equal(p.detach(), before)
    assert _state_snapshot(opt, [p]) == state


def _negative_bit(t: torch.Tensor) -> torch.Tensor:
    """A tensor equal to t that carries torch's lazy negative bit: its memory
    holds -t (as x.conj().imag's does), in t's layout."""
    out = (-t)._neg_view()
    assert out.is_neg() and torch.equal(out, t) and out.stride() == t.stride()
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("where", ["grad", "given_grad", "param", "state"])
def test_negative_bit_tensors_update_as_torch(name: str, where: str) -> None:
    """Gradients (.grad or step_params(grads=)), parameters and state tensors
    with torch's negative bit update as torch updates them: their values, not
    their memory (the negated values), which reprop's kernels were handed.
    Gradients: with the bit at the first step (plan built) and the third
    (cached), plain at the second; a contiguous param, a transposed one
    (updated in its layout) and one of a single element."""
    shapes = [(4, 3), (3, 4), (1,)]
    init, grads = make_params(shapes, seed=41), grad_sequence(shapes, 3)
    init[1] = init[1].t().contiguous().t()  # dense, not contiguous
    runs = []
    for cls in (torch_cls(name), reprop_cls(name)):
        params = [nn.Parameter(_negative_bit(t) if where == "param" else t.clone()) for t in init]
        opt = cls(params, **RICH[name])
        for k, step_grads in enumerate(grads):
            negative = where in ("grad", "given_grad") and k != 1
            step_grads = [_negative_bit(g) if negative else g.clone() for g in step_grads]
            if where == "state" and k == 1:
                for st in opt.state.values():
                    st.update({key: _negative_bit(v) for key, v in st.items()})
            if where == "given_grad" and cls is reprop_cls(name):
                opt.step_params(params, grads=step_grads)
                continue
            for p, g in zip(params, step_grads):
                p.grad = g
            opt.step()
        runs.append(Run(params, opt))
    assert_runs_close(runs[1], runs[0], OPEN_LOOP_TOL)
    if where == "param":
        assert all(p.is_neg() for p in runs[1].params)


@pytest.mark.parametrize("name", NAMES)
def test_state_data_replaced_is_followed(name: str) -> None:
    """A state tensor whose .data is replaced (state moved by hand, as an
    offloading loop does) keeps its identity but not its memory: the cached
    table must follow it, not write to the freed old memory. Results equal
    torch's through the same replacements."""
    runs = []
    for cls in (reprop_cls(name), torch_cls(name)):
        p = nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(99)))
        opt = cls([p], **RICH[name])
        for step in range(4):
            p.grad = torch.randn(64, generator=torch.Generator().manual_seed(step))
            opt.step()
            for value in opt.state[p].values():  # the step count too
                if isinstance(value, torch.Tensor):
                    old = value.data
                    value.data = old.clone()  # new memory, same tensor object
                    old.fill_(float("nan"))   # what the freed memory may then hold
        runs.append(p.detach().clone())
    assert runs[0].isfinite().all()
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


def test_grad_of_another_size_is_refused() -> None:
    """A gradient whose size no longer matches its parameter (its .data
    replaced behind the .grad setter's check) must be refused, not read out
    of bounds; torch refuses it too."""
    for cls in (rp.SGD, torch.optim.SGD):
        p = nn.Parameter(torch.zeros(1000))
        opt = cls([p], lr=1.0, momentum=0.9)
        p.grad = torch.ones_like(p)
        opt.step()
        p.grad.data = torch.ones(10)
        before = p.detach().clone()
        with pytest.raises((ValueError, RuntimeError)):
            opt.step()
        assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("dtype", [torch.cfloat, torch.int64])
@pytest.mark.parametrize("name", NAMES)
def test_refused_param_group_is_not_added(name: str, dtype: torch.dtype) -> None:
    p = nn.Parameter(torch.randn(3))
    opt = reprop_cls(name)([p], **RICH[name])
    bad = nn.Parameter(torch.ones(3, dtype=dtype), requires_grad=dtype.is_complex)
    with pytest.raises((TypeError, ValueError)):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1
    p.grad = torch.ones(3)
    opt.step()


# A saved group reprop refuses (a checkpoint of torch's capturable=True) and
# what the refusal says.
REFUSED_ON_LOAD = [(name, "capturable", "capturable=True needs CUDA parameters")
                   for name in CAPTURABLE_NAMES]


@pytest.mark.parametrize("name,flag,message", REFUSED_ON_LOAD)
def test_refused_load_state_dict_leaves_the_optimizer_as_it_was(name: str, flag: str,
                                                                message: str) -> None:
    """load_state_dict of a state dict with a group reprop refuses raises
    before anything is replaced, as add_param_group adds nothing: the
    optimizer keeps its own groups and state (not the loaded lr and step
    counts of one step earlier) and steps on exactly as one that never tried
    the load."""
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=23), grad_sequence(shapes, 5)
    runs = []
    for _ in range(2):
        params = [nn.Parameter(t.clone()) for t in init]
        runs.append(Run(params, reprop_cls(name)(split_groups(params, group1_overrides(name, RICH[name])),
                                                 **RICH[name])))
    tried, ref = runs
    saved = None
    for i, step_grads in enumerate(grads):
        for run in runs:
            for p, g in zip(run.params, step_grads):
                p.grad = g.clone()
            run.opt.step()
        if i == 0:
            saved = copy.deepcopy(tried.opt.state_dict())
            saved["param_groups"][1][flag] = True
            saved["param_groups"][1]["lr"] *= 3
        if i == 1:
            groups, before = tried.opt.param_groups, copy.deepcopy(tried.opt.state_dict())
            with pytest.raises(ValueError, match=message):
                tried.opt.load_state_dict(saved)
            assert tried.opt.param_groups is groups
            after = tried.opt.state_dict()
            assert after["param_groups"] == before["param_groups"]
            torch.testing.assert_close(after["state"], before["state"], rtol=0, atol=0)
    assert_runs_equal(tried, ref)


# Adagrad is left out: torch's creates state only in __init__ and add_param_group,
# so a parameter put into a group by hand raises KeyError at its step.
@pytest.mark.parametrize("how", ["new_list", "in_place"])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "Adagrad"])
def test_replaced_params_are_freed(name: str, how: str) -> None:
    """A group whose params are replaced each round (a re-initialised head)
    must not keep the old ones, and their .grad, alive in reprop's cached
    pointer tables; with their state popped, torch frees them."""
    alive = []
    for cls in (reprop_cls(name), torch_cls(name)):
        opt = cls([nn.Parameter(torch.zeros(1))], **RICH[name])
        heads = []
        for _ in range(3):
            old = opt.param_groups[0]["params"][0]
            head = nn.Parameter(torch.randn(4, 3))
            if how == "new_list":
                opt.param_groups[0]["params"] = [head]
            else:
                opt.param_groups[0]["params"][0] = head
            opt.state.pop(old, None)
            head.grad = torch.ones(4, 3)
            opt.step()
            heads.append(weakref.ref(head))
        del old, head
        gc.collect()
        alive.append(sum(h() is not None for h in heads))
    assert alive == [1, 1]


@pytest.mark.parametrize("how", ["removed", "emptied"])
@pytest.mark.parametrize("name", NAMES)
def test_params_of_a_removed_or_emptied_group_are_freed(name: str, how: str) -> None:
    """A group removed from param_groups (or its params list emptied), with
    its params' state popped, must not stay alive with its .grad and state
    in reprop's cached pointer tables while the other groups step on: no
    plan is rebuilt then (theirs are cached, an empty group builds none), so
    the departed ones were only dropped at some later rebuild. (Torch's
    own, the reference, where it steps the added group.)"""
    classes = (reprop_cls(name), torch_cls(name)) if torch_steps_added_groups(name) else (reprop_cls(name),)
    alive = []
    for cls in classes:
        keep, head = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4, 3))
        opt = cls([keep], **RICH[name])
        opt.add_param_group({"params": [head]})
        keep.grad, head.grad = torch.ones(3), torch.ones(4, 3)
        opt.step()
        if how == "removed":
            opt.param_groups.pop()
        else:
            opt.param_groups[1]["params"] = []
        state = weakref.ref(next(t for t in opt.state.pop(head).values() if t.dim()))
        refs = (weakref.ref(head), weakref.ref(head.grad), state)
        del head
        for _ in range(2):
            keep.grad = torch.ones(3)
            opt.step()
        gc.collect()
        alive.append([r() is not None for r in refs])
    assert alive == [[False] * 3] * len(classes)


def test_step_params_follows_removed_and_replaced_groups() -> None:
    """step_params looks params up in the groups as they are now: a param
    whose group was replaced by a new dict steps with the new dict's lr, and
    one whose group was removed is refused, as torch's step() leaves it
    alone; both were updated in the old group."""
    keep, head = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    opt = rp.SGD([{"params": [keep]}, {"params": [head]}], lr=0.1)
    opt.step_params([head])  # (the lookup is built)
    opt.param_groups[1] = {**opt.param_groups[1], "lr": 1.0}
    head.grad = torch.ones(2)
    opt.step_params([head])
    assert torch.equal(head.detach(), torch.full((2,), -1.0))
    opt.param_groups.pop()
    with pytest.raises(ValueError, match=r"params\[0\]: not a parameter of this optimizer"):
        opt.step_params([head])
    assert torch.equal(head.detach(), torch.full((2,), -1.0))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_step_holds_the_gradients_it_reads(layout: str, monkeypatch) -> None:
    """The update runs without the GIL, so another thread may drop a .grad
    (zero_grad(set_to_none=True)) while it reads it: the step must hold the
    gradients its table points at. Dropped here just before the update, with
    a same-sized tensor of other values allocated at once (the allocator then
    hands out the freed memory), the update must still use the gradient
    step() was called with. A transposed parameter and gradient take the
    Python path, which reads the gradient in place (no copy to hold)."""
    shape = (256, 1024)
    p = nn.Parameter(torch.zeros(shape[::-1]).t() if layout == "transposed" else torch.zeros(shape))
    p.grad = torch.ones_like(p)
    opt = rp.SGD([p], lr=1.0)
    run, scribbles = rp._Plan.run, []

    def drop_grad_then_run(plan, *args):
        p.grad = None
        gc.collect()
        scribbles.append(torch.full(shape[::-1], 7.0).t())
        run(plan, *args)

    monkeypatch.setattr(rp._Plan, "run", drop_grad_then_run)
    opt.step()
    assert torch.equal(p.detach(), torch.full(shape, -1.0))


# ---------------------------------------------------------------------------
# 11. A step interrupted (a notebook's stop button: KeyboardInterrupt)
# ---------------------------------------------------------------------------

def interrupt_call(monkeypatch, owner, name: str, n: int) -> list:
    """Patches owner.name to raise KeyboardInterrupt as its n-th call starts,
    deterministically where a stop button lands at random; returns the
    count of calls, for the test to see that it was reached."""
    original, calls = getattr(owner, name), [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    return calls


def set_grads(params: list, grads: list) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def assert_resumes_as_torch(name: str, options: dict, got: Run, grads: list, tol: Tol) -> None:
    """Training on from the state an interrupted step left gives what
    torch.optim gives from that state (its params and state_dict()): the
    optimizer keeps nothing of the interrupted step that its state lacks."""
    params = [nn.Parameter(p.detach().clone()) for p in got.params]
    ref = Run(params, torch_cls(name)(params, **options))
    ref.opt.load_state_dict(copy.deepcopy(got.opt.state_dict()))
    for step_grads in grads:
        for run in (got, ref):
            set_grads(run.params, step_grads)
            run.opt.step()
    assert_runs_close(got, ref, tol)


SGD_MOMENTA = [{"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
               {"lr": 0.1, "momentum": 0.9, "nesterov": True}]
# Where a first step is stopped: as the n-th call of a helper it makes starts,
# (owner, name, n): once its plan is built, before the kernels run, and after
# them, as its plan is cached.
FIRST_STEP_STOPS = [(rp, "_prepare_grads", 2), (rp._Plan, "run", 1), (rp._PlanCache, "put", 1)]


@pytest.mark.parametrize("options", SGD_MOMENTA, ids=["dampening", "nesterov"])
@pytest.mark.parametrize("stop", FIRST_STEP_STOPS, ids=["prepare_grads", "run", "put"])
def test_an_interrupted_first_sgd_step_leaves_no_unfilled_momentum_buffer(
        options: dict, stop: tuple, monkeypatch) -> None:
    """SGD makes a param's momentum buffer empty, for its first update to
    fill from the gradient. It was put into the state before that update
    ran, so a first step stopped in between left uninitialized memory as
    the buffer: saved by state_dict(), and read as a buffer by the next
    step once the plan was rebuilt from the state (stopped as the plan was
    cached: params off by 1e19, silently). A buffer goes into the state once
    filled, as torch stores the one its first update makes: each param is
    left as before the step or as after it, and training on is torch's."""
    shapes = [(3, 4), (3,), (2, 3)]
    init, grads = make_params(shapes, seed=31), grad_sequence(shapes, 5)
    got = run_open_loop(factory(rp.SGD, **options), init, [])
    after = run_open_loop(factory(torch.optim.SGD, **options), init, grads[:1])
    calls = interrupt_call(monkeypatch, *stop)
    set_grads(got.params, grads[0])
    with pytest.raises(KeyboardInterrupt):
        got.opt.step()
    assert calls[0] == stop[2]
    monkeypatch.undo()
    for p, a, i in zip(got.params, after.params, init):
        assert torch.equal(p, i) or torch.equal(p, a)
        buf = got.opt.state[p].get("momentum_buffer")
        assert buf is None or torch.equal(buf, after.opt.state[a]["momentum_buffer"])
    assert_resumes_as_torch("SGD", options, got, grads[1:], Tol(0.0, 0.0))


# Which of 4 params have a gradient at each step: the second step has a
# subset, the rows of the cached plan taking part change at each step after.
SUBSET_MASKS = [[1, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1], [1, 0, 1, 0], [0, 1, 1, 1], [1, 1, 0, 1]]


def subset_grads() -> list:
    shapes = [(3, 4), (3,), (2, 3), (2,)]
    full = grad_sequence(shapes, len(SUBSET_MASKS))
    return [[g if m else None for g, m in zip(step, mask)] for step, mask in zip(full, SUBSET_MASKS)]


def stopped_run(name: str, grads: list, at: int, stop: LineStop) -> tuple[Run, list]:
    """Steps with grads[:at], then with grads[at] under `stop`; returns the
    run and the gradients of the steps to take from there: grads[at] again
    when it was stopped."""
    init = make_params([tuple(g.shape) for g in grads[0]], seed=33)
    run = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads[:at])
    set_grads(run.params, grads[at])
    try:
        with stop:
            run.opt.step()
    except KeyboardInterrupt:
        return run, grads[at:]
    return run, grads[at + 1:]


def assert_every_stop_steps_on(name: str, function, grads: list, at: int,
                               check: Callable[[Run], None] = lambda run: None) -> None:
    """Stops the step with grads[at] at each line of `function` in turn
    (`check` sees what it leaves), then trains on: as training uninterrupted
    (bitwise), and as torch from the state left."""
    straight = LineStop(function.__code__, 0)
    expected, rest = stopped_run(name, grads, at, straight)
    for step_grads in rest:
        set_grads(expected.params, step_grads)
        expected.opt.step()
    assert straight.count > 3
    tol = Tol(0.0, 0.0) if name == "SGD" else OPEN_LOOP_TOL
    for n in range(1, straight.count + 1):
        run, left = stopped_run(name, grads, at, LineStop(function.__code__, n))
        assert len(left) == len(rest) + 1, f"line {n}: not stopped"
        check(run)
        assert_resumes_as_torch(name, RICH[name], run, left, tol)
        assert_runs_equal(run, expected)


@pytest.mark.parametrize("name", NAMES)
def test_a_step_interrupted_as_its_rows_change_steps_on(name: str) -> None:
    """A step whose params with a gradient are another subset than the last
    step's (a frozen layer, LayerDrop) resets the rows of the cached plan
    that take part (_Plan._take_part). Stopped between two of its
    assignments, it left the rows of one subset with the step table of
    another, and every later step raised an internal ValueError (a shape
    mismatch, or "step_rows must be None with the table as step_table")
    until load_state_dict. Stopped at any line there, the step leaves the
    params and state as they were, and training on gives what training
    uninterrupted gives (bitwise), and torch's from that state."""
    assert_every_stop_steps_on(name, rp._Plan._take_part, subset_grads(), 1)


def torch_state_keys(name: str) -> list:
    """The keys of the state torch's first step gives a param, in order."""
    p = nn.Parameter(torch.ones(2))
    opt = torch_cls(name)([p], **RICH[name])
    p.grad = torch.ones(2)
    opt.step()
    return list(opt.state[p])


@pytest.mark.parametrize("name", NAMES)
def test_a_first_step_interrupted_as_it_creates_state_steps_on(name: str) -> None:
    """A first step puts the state it creates into each param's state dict
    (_Plan.commit_state). Stopped between two keys of a param, it left a
    step count without exp_avg (square_avg, ...), which every later step
    refused with a KeyError ("an option that needs it was switched on after
    the first step"). Stopped at any line there, each param has all its
    initial state or none, and training on gives what training
    uninterrupted gives (bitwise), and torch's from that state."""
    keys = torch_state_keys(name)

    def check(run: Run) -> None:
        assert all(list(st) in ([], keys) for st in run.opt.state.values())

    assert_every_stop_steps_on(name, rp._Plan.commit_state, subset_grads(), 0, check)


def test_a_stop_as_adamw_decays_a_param_its_gradient_shares_leaves_it_as_it_was() -> None:
    """A gradient sharing its param's memory is read, with decoupled weight
    decay, as torch reads it: after the decay, which the update applies to
    the param in place and undoes once it has read the gradient. A
    KeyboardInterrupt (a notebook's stop button) as the decay returned left
    the param decayed, with its state as before the step. Now it is put
    back, and training on is torch's from the state left."""
    options = {"lr": 0.1, "weight_decay": 0.1}
    p = nn.Parameter(torch.linspace(-1.0, 1.0, 8))
    opt = rp.AdamW([p], **options)
    decay = p.mul_

    def decay_then_stop(factor):
        decay(factor)
        raise KeyboardInterrupt

    p.mul_ = decay_then_stop  # (an attribute of this tensor: no other is touched)
    p.grad = p.detach()
    before = p.detach().clone()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    del p.mul_
    assert torch.equal(p, before)
    ref = nn.Parameter(p.detach().clone())
    ref_opt = torch.optim.AdamW([ref], **options)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for param, o in ((p, opt), (ref, ref_opt)):
        for _ in range(3):
            param.grad = param.detach()
            o.step()
    assert_runs_close(Run([p], opt), Run([ref], ref_opt), STEP_TOL)


@pytest.mark.parametrize("name", NAMES)
def test_a_stop_as_the_kernels_return_leaves_the_step_done_and_seen(name: str,
                                                                    monkeypatch) -> None:
    """A KeyboardInterrupt (a notebook's stop button) pressed while the
    kernels update is raised as their call returns. That left a param with
    gaps in memory, updated through a contiguous stand-in, without the update
    that its state had had (each later step starting from the stand-in's
    old values), and no param's version bumped: a graph that saved a param
    before the step ran its backward with the updated value. Now the step is
    done, torch's, and a backward through such a graph raises torch's
    in-place-modification error, as after torch's step."""
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=35), grad_sequence(shapes, 3)
    with_gaps = lambda t: torch.zeros(t.shape[0], 2 * t.shape[1])[:, ::2].copy_(t) if t.dim() == 2 else t
    got = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, [], make_param=with_gaps)
    after = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads[:1], make_param=with_gaps)
    assert not got.params[0].is_contiguous()
    x = torch.ones(5, requires_grad=True)
    saved = (got.params[1] * x).sum()  # saves the param for x's gradient
    set_grads(got.params, grads[0])
    monkeypatch.setattr(rp, "_C", KernelsThenStop(_C))
    with pytest.raises(KeyboardInterrupt):
        got.opt.step()
    monkeypatch.undo()
    assert_runs_close(got, after, STEP_TOL if name != "SGD" else Tol(0.0, 0.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()
    assert_resumes_as_torch(name, RICH[name], got, grads[1:],
                            OPEN_LOOP_TOL if name != "SGD" else Tol(0.0, 0.0))


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_a_stop_at_any_line_of_a_plan_run_leaves_the_step_whole_and_seen(name: str) -> None:
    """The stop button before any line a first step runs under _Plan.run
    (its kernels, the copy back into a param with gaps, publishing new SGD
    buffers, the version bump): the step is left undone (params as before)
    or done (params and state as an uninterrupted step's, bitwise), and
    then a backward through a graph that saved the params before the step
    raises torch's in-place error, as after torch's step. Training on (the
    step again where undone) is torch's. These followed the kernels in a
    finally, where a stop at one of its lines skipped the rest: the version
    bump (26 lines of an SGD first step: the graph backpropagated through
    the new values, silently), or the copy back (the param kept its old
    values while its state had the update). Undone, the versions are as
    before and the graph backpropagates: run's finally bumped them (and
    copied the stand-in back, an in-place write too) where the kernels had
    not run, so the graph raised torch's in-place error spuriously."""
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=36), grad_sequence(shapes, 3)
    with_gaps = lambda t: torch.zeros(t.shape[0], 2 * t.shape[1])[:, ::2].copy_(t) if t.dim() == 2 else t
    done = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, grads[:1],
                         make_param=with_gaps)
    tol = Tol(0.0, 0.0) if name == "SGD" else OPEN_LOOP_TOL
    n, undone, done_ = 0, 0, 0
    while True:
        n += 1
        got = run_open_loop(factory(reprop_cls(name), **RICH[name]), init, [], make_param=with_gaps)
        assert not got.params[0].is_contiguous()
        x, y = torch.ones(4, 3, requires_grad=True), torch.ones(5, requires_grad=True)
        saved = (got.params[0] * x).sum() + (got.params[1] * y).sum()  # saves both params
        versions = [p._version for p in got.params]
        set_grads(got.params, grads[0])
        stop = LineStop((rp.__file__, rp._tensors.__file__), n, under=rp._Plan.run)
        try:
            with stop:
                got.opt.step()
        except KeyboardInterrupt:
            pass
        if not stop.stopped:
            break
        if all(torch.equal(p, i) for p, i in zip(got.params, init)):
            undone += 1
            assert [p._version for p in got.params] == versions, f"line {n}"
            gx, gy = torch.autograd.grad(saved, (x, y))
            assert torch.equal(gx, got.params[0].detach()) and torch.equal(gy, got.params[1].detach())
            left = grads[0:]
        else:
            done_ += 1
            assert_runs_equal(got, done)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                saved.backward()
            left = grads[1:]
        assert_resumes_as_torch(name, RICH[name], got, left, tol)
    assert undone > 5 and done_ > 5, (undone, done_)


def test_a_stop_as_a_removed_group_is_followed_still_frees_its_params() -> None:
    """The first step after a group left param_groups drops the plans of its
    params (_follow_param_groups), which torch then frees. It noted the
    groups as seen first: stopped (a notebook's stop button) before the
    plans were dropped, it never dropped them, and the params, their .grad
    and state stayed alive for good. Stopped at any line there, the next
    step drops them."""
    code, n = rp._FusedOptimizer._follow_param_groups.__code__, 0
    while True:
        n += 1
        keep, head = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4, 3))
        opt = rp.Adam([keep], lr=0.1)
        opt.add_param_group({"params": [head]})
        keep.grad, head.grad = torch.ones(3), torch.ones(4, 3)
        opt.step()
        opt.param_groups.pop()
        opt.state.pop(head)
        head = weakref.ref(head)
        keep.grad = torch.ones(3)
        try:
            with LineStop(code, n):
                opt.step()
        except KeyboardInterrupt:
            opt.step()
        else:
            break  # (past the last line)
        assert head() is None, f"line {n}"
    assert n > 4


@pytest.mark.parametrize("method", ["put", "_evict"])
def test_a_stop_as_plans_are_cached_or_evicted_keeps_the_count_of_rows(method: str,
                                                                       monkeypatch) -> None:
    """The plan cache counts the table rows it holds, which bound it
    (_PlanCache.rows). A step stopped (a notebook's stop button) between an
    entry's change and the count's left the count off for good: too low,
    the cache outgrew its budget; too high, it evicted plans early. Stopped
    at any line of put or _evict, over step_params calls on changing subsets
    (a budget of 16 rows, so that some evict), the count is right after the
    stop and after the calls that follow."""
    monkeypatch.setattr(rp, "_MIN_PLAN_ROWS", 4)
    subsets = [*itertools.combinations(range(4), 2), *itertools.combinations(range(4), 3)]
    code, n, stopped = getattr(rp._PlanCache, method).__code__, 0, True
    while stopped:
        n += 1
        params = [nn.Parameter(torch.zeros(1)) for _ in range(4)]
        opt, stopped = rp.SGD(params, lr=0.1), False
        cache = opt._plans
        with LineStop(code, n):
            for subset in subsets:
                for p in params:
                    p.grad = torch.ones(1)
                try:
                    opt.step_params([params[i] for i in subset])
                except KeyboardInterrupt:
                    stopped = True
                    held = sum(len(plan.params) for entry in cache._entries.values()
                               for plan in entry[0])
                    assert cache.rows == held, f"line {n}"
        held = sum(len(plan.params) for entry in cache._entries.values() for plan in entry[0])
        assert cache.rows == held, f"line {n}"
    assert n > 4


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_a_stop_as_torch_adds_a_param_group_keeps_no_unchecked_group(monkeypatch) -> None:
    """add_param_group checks the group after torch's has added it (as torch
    normalized it), and takes a refused one out again. A KeyboardInterrupt
    (a notebook's stop button) as torch's returned kept the group unchecked:
    one listing a parameter twice, which reprop refuses (one fused call
    would update it twice at once), then stepped it silently. Now such a
    group is not kept, as a refused one, and steps are torch's."""
    add = torch.optim.Optimizer.add_param_group

    def add_then_stop(opt, group) -> None:
        add(opt, group)
        raise KeyboardInterrupt

    got, ref = (nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))), nn.Parameter(torch.ones(3))
    opt, torch_opt = rp.SGD([got[0]], lr=0.1), torch.optim.SGD([ref], lr=0.1)
    monkeypatch.setattr(torch.optim.Optimizer, "add_param_group", add_then_stop)
    with pytest.raises(KeyboardInterrupt):
        opt.add_param_group({"params": [got[1], got[1]]})
    monkeypatch.undo()
    assert [g["params"] for g in opt.param_groups] == [[got[0]]]
    for p in (*got, ref):
        p.grad = torch.ones_like(p)
    opt.step()
    torch_opt.step()
    assert torch.equal(got[0], ref) and torch.equal(got[1], torch.ones(2))


# ---------------------------------------------------------------------------
# C mutation audit of the optimizer core (csrc/optim.c, optim_math.h): what no
# test above caught. Each test fails on a plausible wrong version of the line
# its docstring names.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_amsgrad_max_made_nan_by_hand_stays_nan_as_torchs(name: str) -> None:
    """torch.maximum keeps a NaN of either operand: a max_exp_avg_sq element
    made NaN by hand (state reset but for it, a checkpoint's) stays NaN
    beside a finite exp_avg_sq, and so does its param element. A maximum
    that dropped its first operand's NaN (rp_maximum) passed every test: a
    NaN gradient makes both moments NaN at once."""
    shapes = [(4, 3), (5,)]
    init, grads = make_params(shapes, seed=61), grad_sequence(shapes, 3)
    def nan_in_max(opt, params):
        opt.state[params[0]]["max_exp_avg_sq"][1, 2] = float("nan")
    runs = [Run(*_step_editing_state_after_the_first(cls, name, init, grads, nan_in_max))
            for cls in (reprop_cls(name), torch_cls(name))]
    assert runs[1].params[0].isnan().sum().item() == 1 and runs[1].params[0][1, 2].isnan()
    assert_runs_close(*runs, OPEN_LOOP_TOL)


def test_adagrad_lr_decay_reads_the_float32_step_count() -> None:
    """torch counts steps in a float32 tensor, where 2**24 + 1 is 2**24, and
    decays the lr by the count it reads back: at a count of 2**24 (state
    made by hand) the lr is 1 / (1 + (2**24 - 1) * 1), bitwise. A count
    advanced in double (2**24 + 1) gave the next float below."""
    results = []
    for cls in (rp.Adagrad, torch.optim.Adagrad):
        p = nn.Parameter(torch.zeros(5))
        opt = cls([p], lr=1.0, lr_decay=1.0, eps=0.0)
        p.grad = torch.ones(5)
        opt.step()
        with torch.no_grad():
            p.zero_()
            opt.state[p]["sum"].zero_()
            opt.state[p]["step"].fill_(2.0 ** 24)
        opt.step()  # sum 1, so the param is -lr exactly
        results.append((p.detach().clone(), opt.state[p]["step"].item()))
    assert torch.equal(results[0][0], torch.full((5,), -2.0 ** -24))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1] == 2.0 ** 24


@pytest.mark.parametrize("betas", [(1.5, 0.999), (0.9, 1.5), (-1.5, 0.999)])
def test_adam_at_an_infinite_step_count_steps_as_torch(betas: tuple) -> None:
    """An infinite step count (state made by hand) with a beta above 1 in
    size (set after construction): Python's beta ** inf is inf, no
    OverflowError, and torch steps on: 1 - beta1 ** step = -inf makes a
    step size of -0.0 (the param stays), 1 - beta2 ** step = -inf a square
    root of inf (Python's (-inf) ** 0.5), the NaN of beta2 > 1's negative
    exp_avg_sq aside. reprop refused both: beta1's as a power beyond
    double's range (a check that ignored the infinite exponent), beta2's as
    a complex square root."""
    runs = []
    for cls in (rp.Adam, torch.optim.Adam):
        params = [nn.Parameter(t.clone()) for t in make_params([(3, 2), (4,)], seed=62)]
        opt = cls(params, lr=0.1)
        for k, step_grads in enumerate(grad_sequence([(3, 2), (4,)], 3)):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
            if k == 0:
                opt.param_groups[0]["betas"] = betas
                for p in params:
                    opt.state[p]["step"].fill_(float("inf"))
        runs.append(Run(params, opt))
    assert_runs_close(*runs, OPEN_LOOP_TOL)


@X86_ONLY
def test_plain_rounding_hook_is_read_at_the_first_step_only() -> None:
    """REPROP_TEST_UNFUSED_MADD=1 at the first step rounds the products
    apart for the life of the process, as torch reads ATEN_CPU_CAPABILITY
    once: a cache that asked again whenever it held 0 (unfused) fused from
    the step after the hook was gone."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("torch's add(alpha=) fuses only with AVX2 or AVX-512")
    script = "\n".join([
        "import os, torch, reprop.optim as rp",
        "gen = torch.Generator().manual_seed(63)",
        "p = torch.nn.Parameter(torch.rand(4096, generator=gen) + 0.5)",
        "opt = rp.SGD([p], lr=0.1)",
        "for k in range(2):",
        "    before, p.grad = p.detach().clone(), torch.randn(4096, generator=gen)",
        "    opt.step()",
        "    plain, fused = before + p.grad * -0.1, before.add(p.grad, alpha=-0.1)",
        "    print(torch.equal(p.detach(), plain), torch.equal(p.detach(), fused))",
        "    if k == 0:",
        "        del os.environ['REPROP_TEST_UNFUSED_MADD']",
    ])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "REPROP_TEST_UNFUSED_MADD": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout == "True False\n" * 2, proc.stdout


def test_gradient_right_after_its_params_memory_takes_the_fast_path(monkeypatch) -> None:
    """A gradient starting where its param's memory ends (one buffer, the
    param its first half) shares no memory with it: the C fast path reads
    it (a span ending at the gradient's start counted as meeting it sent
    every step to the Python path), and the update is torch's."""
    init, runs = make_params([(16,)], seed=64)[0], []
    for cls in (rp.Adam, torch.optim.Adam):
        spy = _FastPathSpy()
        monkeypatch.setattr(rp, "_C", spy)
        buf = torch.zeros(32)
        buf[:16] = init
        params = [nn.Parameter(buf[:16])]
        opt = cls(params, **RICH["Adam"])
        for k in range(3):
            buf[16:] = 0.1 * (k + 1) - init
            params[0].grad = buf[16:]
            opt.step()
        runs.append(Run(params, opt))
        if cls is rp.Adam:
            assert spy.read == [True] * 3
    assert_runs_close(*runs, OPEN_LOOP_TOL)


# ---------------------------------------------------------------------------
# 12. CUDA
# ---------------------------------------------------------------------------

class _FakeCuda:
    """Stands in for reprop._cuda on a CPU-only machine: records the
    arguments of each optim_step call (a copy of the table as it came) and
    launches nothing, then clears the table's fresh-buffer flags, as the real
    binding does once it has launched (a new SGD buffer is filled once)."""

    def __init__(self) -> None:
        self.calls: list = []

    def optim_step(self, kind, dtype, table, hparams, capturable, stream, lr_ptr) -> None:
        self.calls.append((kind, dtype, table.copy(), hparams, capturable, stream, lr_ptr))
        table[:, rp._COL_FLAGS] &= ~rp._FRESH_BUFFER


@pytest.mark.parametrize("name", NAMES)
def test_non_capturable_update_in_a_cuda_graph_capture_is_refused_but_sgds(name: str,
                                                                            monkeypatch) -> None:
    """Plans taking their CUDA branch (on CPU params, with _cuda faked) while
    a capture seems under way: SGD, which has no step count to go stale at
    replay and no capturable option (torch's SGD is captured with its floats
    baked in), issues the very call a step outside the capture issues, from
    its first step (a new momentum buffer filled from the gradient, as
    torch's first step clones it), where reprop raised "capturable=False but
    a CUDA graph is being captured", advising an option SGD does not have;
    the others still raise that: their host step counts would not advance
    at replay."""
    fake, capturing = _FakeCuda(), [False]
    monkeypatch.setattr(rp, "_cuda", fake)
    monkeypatch.setattr(rp._tensors, "current_stream_handle", lambda device: 1234)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    init = rp._Plan.__init__

    def on_cuda(plan, *args) -> None:
        init(plan, *args)
        plan.on_cpu = False

    monkeypatch.setattr(rp._Plan, "__init__", on_cuda)
    for first_step_captured in (False, True):
        params = [nn.Parameter(torch.ones(4, 3)), nn.Parameter(torch.ones(5))]
        opt = reprop_cls(name)(params, **RICH[name])
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        calls = []
        for capturing[0] in (first_step_captured, True, False):
            if name != "SGD" and capturing[0]:
                with pytest.raises(RuntimeError, match=rf"^{name}: capturable=False but a CUDA "
                                                       r"graph is being captured"):
                    opt.step()
                continue
            opt.step()
            calls.append(fake.calls.pop())
        assert not fake.calls
        if name != "SGD":
            continue
        # the first call fills the new momentum buffers, the later ones add to them
        assert calls[0][2][:, rp._COL_FLAGS].tolist() == [rp._FRESH_BUFFER] * 2
        filled = calls[0][2].copy()
        filled[:, rp._COL_FLAGS] = 0
        for call in calls[1:]:
            assert call[:2] + call[3:] == calls[0][:2] + calls[0][3:]
            assert np.array_equal(call[2], filled)
        assert calls[0][4:] == (False, 1234, 0)


class _FakeCurrentDevice:
    """Stands in for torch.cuda's current device on a CPU-only machine:
    torch.cuda.device(d) as a context that makes d current (counting how
    often one is entered) and torch.cuda.current_device()."""

    def __init__(self, monkeypatch, index: int) -> None:
        self.index, self.switches = index, 0
        fake = self

        class Device:
            def __init__(self, device) -> None:
                self.target = torch.device(device).index

            def __enter__(self) -> None:
                fake.switches += 1
                self.previous, fake.index = fake.index, self.target

            def __exit__(self, *exc) -> None:
                fake.index = self.previous

        monkeypatch.setattr(torch.cuda, "device", Device)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.index)


@pytest.mark.parametrize("current", [0, 1])
def test_cuda_update_launches_with_the_params_device_current(current: int, monkeypatch) -> None:
    """The device contract of the CUDA launch, checked on the host (nothing
    runs on a GPU here): plans of params on cuda:1 taking their CUDA branch
    (CPU params, _cuda faked) call the binding with cuda:1 current, also
    where cuda:0 is, and on PyTorch's default stream (handle 0), which tells
    the launcher no device: its kernels run on the current device, so
    launched with cuda:0 current they updated cuda:1's memory from cuda:0
    (an illegal address, or, with peer access, racing cuda:1's stream).
    Afterwards the caller's device is current again; no switch where cuda:1
    was current already."""
    fake, launched_on = _FakeCuda(), []
    devices = _FakeCurrentDevice(monkeypatch, current)

    def optim_step(*args) -> None:
        launched_on.append(devices.index)
        _FakeCuda.optim_step(fake, *args)

    monkeypatch.setattr(rp, "_cuda", SimpleNamespace(optim_step=optim_step))
    monkeypatch.setattr(rp._tensors, "current_stream_handle", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    init = rp._Plan.__init__

    def on_cuda1(plan, *args) -> None:
        init(plan, *args)
        plan.on_cpu, plan.device = False, torch.device("cuda", 1)

    monkeypatch.setattr(rp._Plan, "__init__", on_cuda1)
    params = [nn.Parameter(torch.ones(4, 3)), nn.Parameter(torch.ones(5))]
    opt = rp.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    opt.step()
    assert launched_on == [1, 1]
    assert [call[5] for call in fake.calls] == [0, 0]
    assert devices.index == current
    assert devices.switches == (2 if current == 0 else 0)


GPU_SHAPES = [(300, 1000), (70_003,), (16,), (16,), (), (0,)] + _many_small_shapes(400, seed=17)


def _gpu_open_loop(cls_of: Callable[[str], type], name: str, device: str, options: dict | None = None,
                   steps: int = 8) -> Run:
    options = options or RICH[name]
    init = make_params(GPU_SHAPES, seed=18, device=device)
    grads = grad_sequence(GPU_SHAPES, steps, device=device)
    return run_open_loop(factory(cls_of(name), **options), init, grads, group1=group1_overrides(name, options))


def _to_cpu(run: Run) -> Run:
    """A CPU copy of a run's parameters and state, to compare with a CPU run."""
    params = [p.detach().cpu() for p in run.params]
    state = {
        q: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in run.opt.state.get(p, {}).items()}
        for p, q in zip(run.params, params)
    }
    return Run(params, SimpleNamespace(state=state))


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_matches_torch_cuda(name: str) -> None:
    got = _gpu_open_loop(reprop_cls, name, "cuda")
    ref = _gpu_open_loop(torch_cls, name, "cuda")  # foreach by default on CUDA
    assert_runs_close(got, ref, OPEN_LOOP_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name, options", GRID)
def test_gpu_option_grid_matches_torch_cuda(name: str, options: dict) -> None:
    # Open loop: a closed loop on CUDA would also measure cuDNN's algorithm
    # choices (TF32, non-deterministic reductions), not the optimizer.
    got = _gpu_open_loop(reprop_cls, name, "cuda", options)
    ref = _gpu_open_loop(torch_cls, name, "cuda", options)
    assert_runs_close(got, ref, OPEN_LOOP_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_matches_reprop_cpu(name: str) -> None:
    gpu = _to_cpu(_gpu_open_loop(reprop_cls, name, "cuda"))
    cpu = _gpu_open_loop(reprop_cls, name, "cpu")
    assert_runs_close(gpu, cpu, OPEN_LOOP_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_low_precision_params(name: str, dtype: torch.dtype) -> None:
    run_low_precision(name, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_low_precision_rounds_to_nearest_even(dtype: torch.dtype) -> None:
    x, h = _ties(dtype)
    p = nn.Parameter(x.cuda())
    p.grad = (-h).to(dtype).cuda()
    rp.SGD([p], lr=1.0).step()
    assert torch.equal(p.detach().cpu(), (x.float() + h).to(dtype))


# Capturable Adam's bias corrections: reprop derives them on the device in
# double, as its host path and torch's non-capturable one do (README: a
# captured step then replays an eager one); torch's capturable update in
# float32 tensor ops (foreach: beta ** step by powf from beta rounded to
# float32, the step size as the reciprocal of (beta1 ** step - 1) / lr, the
# square root of 1 - beta2 ** step). 1 - beta2 ** t cancels: beta2 = 0.999
# rounded to float32 is 1.3e-8 off, 1.3e-5 of 1 - beta2 at step 1, half that
# in the update through the square root. Each step's update, up to
# lr * adam_ratio_bound, is off by such a relative error, and over the open
# loop they add up past OPEN_LOOP_TOL: on the H200 7.8e-7 of the scale at
# worst, 14 of 300000 elements past its 5e-7, and torch's own capturable
# update on the CPU is as far from its non-capturable one (the same 14
# elements; test_torch_capturable_adam_drifts_within_the_bound). The bound
# below (adam_f32_drift, CUDA's 4-ulp powf counted in full) is 7.2e-6
# there. So reprop's capturable Adam is held to OPEN_LOOP_TOL against
# torch's non-capturable update, whose arithmetic it has, and to
# OPEN_LOOP_TOL plus that bound against torch's capturable one.
F32_UNIT = 2.0 ** -24  # float32's unit roundoff: a correctly rounded op's relative error
POWF_ULPS = 4  # the maximum error of CUDA's powf (CUDA C++ Programming Guide, math functions)


def adam_ratio_bound(t: int, beta1: float, beta2: float) -> float:
    """The most |m^_t| / sqrt(v^_t) can be at step t (bias-corrected
    moments, v^ its maximum with amsgrad) whatever the gradients: by
    Cauchy-Schwarz, |sum_k beta1^(t-k) g_k| <= sqrt(sum_j r^j) *
    sqrt(sum_k beta2^(t-k) g_k^2) with r = beta1^2 / beta2, j < t."""
    r = beta1 * beta1 / beta2
    geometric = t if r == 1 else (1 - r ** t) / (1 - r)
    return ((1 - beta1) / (1 - beta2) ** 0.5 * geometric ** 0.5 * (1 - beta2 ** t) ** 0.5
            / (1 - beta1 ** t))


def f32_bias_correction_error(beta: float, t: int) -> float:
    """A bound on the relative error of torch's capturable 1 - beta ** t:
    beta rounded to float32 (error to first order in it), raised to t by
    powf (POWF_ULPS ulp, one ulp <= 2 units of the value), subtracted from 1
    (rounded)."""
    power = beta ** t
    rounding = abs(float(np.float32(beta)) - beta)
    return (t * rounding * beta ** (t - 1) + POWF_ULPS * 2 * F32_UNIT * power) / (1 - power) + F32_UNIT


def adam_f32_drift(lr: float, betas: tuple, steps: int) -> float:
    """The most torch's float32 bias corrections can move a parameter from
    reprop's in `steps` steps (see above): each step's update, at most
    lr * adam_ratio_bound, off by the relative errors of the step size
    (1 - beta1 ** t's) and of sqrt(1 - beta2 ** t) (half of 1 - beta2 ** t's),
    plus 8 roundings: torch's float32 lr, division, reciprocal, square root
    and the division by the step size its elementwise ops add; reprop's two
    step scalars rounded from double."""
    beta1, beta2 = betas
    return sum(lr * adam_ratio_bound(t, beta1, beta2)
               * (f32_bias_correction_error(beta1, t) + f32_bias_correction_error(beta2, t) / 2
                  + 8 * F32_UNIT)
               for t in range(1, steps + 1))


def torch_capturable_tol(name: str, options: dict, steps: int, ref: Run) -> Tol:
    """The tolerance of a run of reprop's `name` with `options` (capturable)
    and group1_overrides against torch's capturable `ref` of `steps` steps:
    OPEN_LOOP_TOL, for Adam and AdamW plus adam_f32_drift for the group
    that drifts most, relative to the parameters' scale (the other
    capturable optimizers have no step-dependent scalars). For the
    parameters only: the moments never read the bias corrections (their
    state_tol stays OPEN_LOOP_TOL; L2 weight decay hands them the drift
    times weight_decay * (1 - beta))."""
    if name not in ("Adam", "AdamW"):
        return OPEN_LOOP_TOL
    defaults = {"betas": inspect.signature(torch_cls(name)).parameters["betas"].default}
    groups = ({**defaults, **options}, {**defaults, **options, **group1_overrides(name, options)})
    drift = max(adam_f32_drift(g["lr"], g["betas"], steps) for g in groups)
    return Tol(OPEN_LOOP_TOL.rtol, OPEN_LOOP_TOL.atol + drift / params_scale(ref))


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_torch_capturable_adam_drifts_within_the_bound(name: str, monkeypatch) -> None:
    """torch_capturable_tol's model checked against torch itself, on the CPU:
    torch's capturable update (let onto the CPU; its float32 scalar ops are
    the device's but for powf) stays within that tolerance of its
    non-capturable one, whose arithmetic reprop's capturable update has."""
    # (AdamW's update is adam.py's too; torch.optim does not keep the module as an attribute)
    monkeypatch.setattr(sys.modules["torch.optim.adam"], "_get_capturable_supported_devices",
                        lambda *_, **__: ["cpu"])
    options, steps = RICH[name], 8
    init, grads = make_params([(300, 1000)], seed=18), grad_sequence([(300, 1000)], steps)
    group1 = group1_overrides(name, options)
    captured = run_open_loop(factory(torch_cls(name), **options, capturable=True), init, grads, group1=group1)
    plain = run_open_loop(factory(torch_cls(name), **options), init, grads, group1=group1)
    tol = torch_capturable_tol(name, {**options, "capturable": True}, steps, plain)
    assert_runs_close(captured, plain, tol, state_tol=OPEN_LOOP_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CAPTURABLE_NAMES)
def test_gpu_capturable_eager_matches_torch(name: str) -> None:
    """reprop's capturable update (device step counters) gives torch's
    non-capturable one's arithmetic and torch's capturable one's results
    (see torch_capturable_tol)."""
    options, steps = {**RICH[name], "capturable": True}, 8
    got = _gpu_open_loop(reprop_cls, name, "cuda", options, steps)
    ref = _gpu_open_loop(torch_cls, name, "cuda", options, steps)
    for p in got.params:
        step = got.opt.state[p]["step"]
        assert step.device.type == "cuda" and step.dtype == torch.float32
    assert_runs_close(got, ref, torch_capturable_tol(name, options, steps, ref), state_tol=OPEN_LOOP_TOL)
    # both copied to the CPU: torch's non-capturable step counters are CPU tensors
    plain = _gpu_open_loop(torch_cls, name, "cuda", RICH[name], steps)
    assert_runs_close(_to_cpu(got), _to_cpu(plain), OPEN_LOOP_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CAPTURABLE_NAMES)
def test_gpu_capturable_in_cuda_graph(name: str) -> None:
    """Warm up on a side stream, capture opt.step() in a CUDAGraph, replay it with
    new gradients copied into the static .grad tensors; compare with eager steps.
    Capture must not advance anything; each replay must advance the device-side
    step counters and use the new gradients."""
    warmup, replays = 3, 5
    shapes = [(64, 33), (1000,), (16,), (16,), (1,)]
    init = make_params(shapes, seed=19, device="cuda")
    grads = grad_sequence(shapes, warmup + replays, device="cuda")
    options = {**RICH[name], "capturable": True}

    captured = _graph_replays(factory(reprop_cls(name), **options), init, grads, warmup,
                              group1=group1_overrides(name, options))
    eager = run_open_loop(factory(reprop_cls(name), **options), init, grads, group1=group1_overrides(name, options))
    assert_runs_equal(captured, eager)
    ref = run_open_loop(factory(torch_cls(name), **options), init, grads, group1=group1_overrides(name, options))
    assert_runs_close(captured, ref, torch_capturable_tol(name, options, len(grads), ref),
                      state_tol=OPEN_LOOP_TOL)
    assert captured.opt.state[captured.params[0]]["step"].item() == warmup + replays


def _graph_replays(make_opt: OptFactory, init: list, grads: list, warmup: int, *,
                   group1: dict | None = None) -> Run:
    """As run_open_loop, but stepped eagerly on a side stream for the first
    `warmup` gradients only, then one step() captured in a CUDAGraph and
    replayed for each other gradient, copied into the static .grad tensors."""
    params = [nn.Parameter(t.clone()) for t in init]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = make_opt(split_groups(params, group1))

    def load(k: int) -> None:
        for p, g in zip(params, grads[k]):
            p.grad.copy_(g)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(warmup):
            load(k)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for k in range(warmup, len(grads)):
        load(k)
        graph.replay()
    torch.cuda.synchronize()
    return Run(params, opt)


@pytest.mark.gpu
@pytest.mark.parametrize("warmup", [3, 0], ids=["after_warmup", "at_the_first_step"])
def test_gpu_sgd_in_cuda_graph_replays_as_torchs(warmup: int) -> None:
    """reprop's SGD, which has no capturable option (as torch's), captured
    in a CUDAGraph and replayed gives torch's SGD captured the same way (was
    refused: "capturable=False but a CUDA graph is being captured"); after a
    warm-up, eager training too (reprop's bitwise). Captured at the first
    step, both fill the momentum buffer from the gradient at every replay."""
    shapes = [(64, 33), (1000,), (16,), (1,)]
    init = make_params(shapes, seed=20, device="cuda")
    grads = grad_sequence(shapes, warmup + 5, device="cuda")
    captured = _graph_replays(factory(rp.SGD, **RICH["SGD"]), init, grads, warmup)
    theirs = _graph_replays(factory(torch.optim.SGD, **RICH["SGD"]), init, grads, warmup)
    assert_runs_close(captured, theirs, OPEN_LOOP_TOL)
    if warmup:
        assert_runs_equal(captured, run_open_loop(factory(rp.SGD, **RICH["SGD"]), init, grads))
        assert_runs_close(captured, run_open_loop(factory(torch.optim.SGD, **RICH["SGD"]), init,
                                                  grads), OPEN_LOOP_TOL)


@pytest.mark.gpu
def test_gpu_capturable_step_tensor_shared_by_params_is_refused() -> None:
    """A capturable update increments its device step counters in one launch,
    which cannot count a shared one once per param in turn, as torch does:
    refused before anything changes."""
    params = [nn.Parameter(torch.ones(3, device="cuda")) for _ in range(2)]
    opt = rp.Adam(params, lr=0.1, capturable=True)
    step = torch.tensor(10.0, device="cuda")
    for p in params:
        opt.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"step: several parameters share one step tensor"):
        opt.step()
    assert step.item() == 10.0
    assert all(torch.equal(p.detach(), torch.ones_like(p)) for p in params)


# ---------------------------------------------------------------------------
# Differential fuzzing: random options, params and loops against torch.optim
# ---------------------------------------------------------------------------
# A compact, seeded form of the fuzzer of session 39: every constructor
# argument (edge values included: lr 0 or a tensor, betas 0, eps 0, huge
# weight decay), several groups, params of edge shapes, dtypes and layouts,
# gradients with NaN/inf/huge/denormal elements or none, and a loop of
# steps, closures, zero_grad, hyper-parameter changes (to inf, NaN, 1, ...),
# add_param_group, state edited by hand and state dicts swapped between
# torch and reprop. Each step is compared with torch's single-tensor update
# (on float32 twins of 16-bit params: README's float32 math): SGD and Adam's
# moments bitwise where README says so, the rest within one step's rounding
# of the operands' scale, NaN and inf positions exactly; then torch's copy is
# re-synchronized to reprop's, so that every step is judged on its own.

FUZZ_SEEDS = range(48)  # 8 per optimizer: NAMES[seed % 6]
FUZZ_SHAPES = [(), (0,), (1,), (7,), (17, 3), (33,), (131,), (2, 0, 3), (5, 1, 9)]
FUZZ_SPECIALS = [float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e-40, -1e-44, 0.0, -0.0, 7e4]
FUZZ_EDGES = [0.0, -0.0, 1.0, 0.5, 2.0, -1.0, 1e-45, 3e38, 1e300, float("inf"), float("nan")]


def _fuzz_options(rng: np.random.Generator, name: str) -> dict:
    """Random constructor options of optimizer `name` (each argument or its default)."""
    pick = lambda *xs: xs[rng.integers(len(xs))]  # noqa: E731
    o = {"lr": pick(0.0, 1e-3, 0.1, 1.0, 1e-30, torch.tensor(0.01)),
         "weight_decay": pick(0.0, 0.0, 0.01, 1e3), "maximize": bool(rng.integers(2))}
    if name == "SGD":
        o["momentum"] = pick(0.0, 0.9, 1.0)
        o["dampening"] = pick(0.0, 0.0, 0.5) if o["momentum"] else 0.0
        o["nesterov"] = bool(o["momentum"] and not o["dampening"] and rng.integers(2))
    elif name in ("Adam", "AdamW"):
        o |= {"betas": pick((0.9, 0.999), (0.0, 0.0), (0.9, 0.0), (0.5, 1 - 2**-24)),
              "eps": pick(1e-8, 0.0, 1e-45, 1.0), "amsgrad": bool(rng.integers(2))}
        if name == "Adam":
            o["decoupled_weight_decay"] = bool(rng.integers(2))
    elif name == "Adagrad":
        o |= {"lr_decay": pick(0.0, 0.01, 1.0), "initial_accumulator_value": pick(0.0, 0.1, 1e-45),
              "eps": pick(1e-10, 0.0)}
    elif name == "RMSprop":
        o |= {"alpha": pick(0.99, 0.0, 1.0), "eps": pick(1e-8, 0.0), "momentum": pick(0.0, 0.9),
              "centered": bool(rng.integers(2))}
    else:
        o |= {"rho": pick(0.9, 0.0, 1.0), "eps": pick(1e-6, 0.0, 1e-40)}
    return o


def _copied(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _fuzz_tensor(gen: torch.Generator, shape: tuple, dtype: torch.dtype, layout: int) -> torch.Tensor:
    """Random values of `shape`: contiguous (layout 0), transposed (1) or a strided view (2)."""
    if layout == 1 and len(shape) == 2:
        return torch.randn(shape[::-1], generator=gen).to(dtype).t()
    if layout == 2 and shape:
        return torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)[..., ::2]
    return torch.randn(shape, generator=gen).to(dtype)


def _twin(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of t in `dtype` with t's strides, in memory of its own."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=dtype) if t.is_contiguous() or t.dim() == 2 \
        else torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=dtype)[..., ::2]
    return out.copy_(t.detach())


def _fuzz_params(rng: np.random.Generator, gen: torch.Generator, dtypes: list) -> list[tuple]:
    """(reprop's param, torch's float32 twin) pairs of random shapes, dtypes and layouts."""
    pairs = []
    for _ in range(rng.integers(1, 4)):
        shape = FUZZ_SHAPES[rng.integers(len(FUZZ_SHAPES))]
        x = _fuzz_tensor(gen, shape, dtypes[rng.integers(len(dtypes))], int(rng.integers(3)))
        pairs.append((nn.Parameter(x), nn.Parameter(_twin(x, torch.float32))))
    return pairs


def _fuzz_grads(rng: np.random.Generator, gen: torch.Generator, pairs: list) -> None:
    """Each pair gets no gradient, keeps its own, or a new random one (some with special values)."""
    for p, twin in pairs:
        c = rng.random()
        if c < 0.15 or (c < 0.25 and p.grad is None):
            p.grad = twin.grad = None
            continue
        if c >= 0.25:
            g = _fuzz_tensor(gen, tuple(p.shape), torch.float32, int(rng.integers(3)))
            g = g * [1.0, 1e-3, 1e20, 1e-20][rng.integers(4)]
            if g.is_contiguous() and g.numel() and rng.random() < 0.4:
                g.view(-1)[rng.integers(g.numel())] = FUZZ_SPECIALS[rng.integers(len(FUZZ_SPECIALS))]
            p.grad = g.to(p.dtype)
        twin.grad = _twin(p.grad, torch.float32)


def _finite_max(*tensors) -> float:
    return max((_finite_scale(t.detach().double()) for t in tensors if t is not None), default=0.0)


def _assert_fuzzed_close(actual: torch.Tensor, expected: torch.Tensor, before, what: str,
                         *, bitwise: bool, zero_sign: bool = True) -> None:
    """actual (reprop's, any dtype) against torch's float32 `expected`: NaN and
    inf positions exactly; bitwise (the sign of zero too, unless not
    zero_sign), or within STEP_TOL of the larger of the values before and
    after the step (an update may cancel a param to near zero), or, for a
    16-bit actual, one ulp of its dtype from torch's rounded."""
    rounded = expected.detach().to(actual.dtype)
    a, r = actual.detach().double(), rounded.double()
    assert torch.equal(a.isnan(), r.isnan()), f"{what}: NaN at {(a.isnan() != r.isnan()).nonzero()[:3].tolist()}"
    assert torch.equal(a.isinf(), r.isinf()) and torch.equal(a[a.isinf()], r[r.isinf()]), f"{what}: infinities"
    fin = torch.isfinite(r)
    a, e = a[fin], expected.detach().double()[fin]
    if bitwise:
        bad = (a != e) | (zero_sign & (a.signbit() != e.signbit()))
        assert not bad.any(), f"{what}: {a[bad][:3].tolist()} where torch has {e[bad][:3].tolist()}"
        return
    allowed = STEP_TOL.atol * _finite_max(expected, before) + STEP_TOL.rtol * e.abs() + 4 * 2.0**-149
    bad = (a - e).abs() > allowed
    if actual.dtype != torch.float32:
        bad &= ulp_distance(actual, rounded)[fin] > 1
    assert not bad.any(), f"{what}: {a[bad][:3].tolist()} where torch has {e[bad][:3].tolist()}"


def _weight_is_one(key: str, group: dict) -> bool:
    """A lerp at weight 1 into this state key, whose zeros have the sign of
    torch's scalar loop, not its vectorized one (README)."""
    beta = group["betas"][0] if key == "exp_avg" else group.get("alpha") if key == "grad_avg" else None
    with np.errstate(over="ignore"):
        return beta is not None and np.float32(1 - float(beta)) == 1


def _assert_fuzzed_step(name: str, ropt, topt, pairs: list, before: dict, step: int) -> None:
    for i, (p, twin) in enumerate(pairs):
        group = next((g for g in ropt.param_groups if any(q is p for q in g["params"])), None)
        if group is None:
            continue
        what = f"step {step} param {i} {tuple(p.shape)} {p.dtype}"
        _assert_fuzzed_close(p, twin, before.get(id(twin)), what,
                             bitwise=name == "SGD" and p.dtype == torch.float32)
        mine, theirs = ropt.state.get(p, {}), topt.state.get(twin, {})
        assert sorted(mine) == sorted(theirs), f"{what}: state keys {sorted(mine)} != {sorted(theirs)}"
        moments_exact = name == "SGD" or (name in ("Adam", "AdamW") and (
            float(group["weight_decay"]) == 0 or name == "AdamW" or group["decoupled_weight_decay"]))
        for key, e in theirs.items():
            if key == "step":
                assert float(mine[key]) == float(e), f"{what}: step {float(mine[key])} != {float(e)}"
            elif e is not None:
                assert mine[key].dtype == torch.float32, f"{what}: state[{key!r}] {mine[key].dtype}"
                _assert_fuzzed_close(mine[key], e, before.get((id(twin), key)), f"{what} state[{key!r}]",
                                     bitwise=moments_exact and key != "momentum_buffer" or name == "SGD",
                                     zero_sign=not _weight_is_one(key, group))


def _fuzz_before(topt, pairs: list) -> dict:
    """torch's params and state tensors before a step, for the scale of its rounding."""
    before = {}
    for _, twin in pairs:
        before[id(twin)] = twin.detach().clone()
        for key, v in topt.state.get(twin, {}).items():
            if isinstance(v, torch.Tensor) and key != "step":
                before[(id(twin), key)] = v.clone()
    return before


def _resync(ropt, topt, pairs: list) -> None:
    with torch.no_grad():
        for p, twin in pairs:
            twin.copy_(p)
            for key, v in ropt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    topt.state[twin][key].copy_(v)


def _swap_state_dicts(name: str, ropt, topt) -> tuple:
    """Fresh optimizers over the same groups, reprop's loading torch's state
    dict and torch's loading reprop's (its foreach and fused kept off)."""
    theirs, mine = copy.deepcopy(topt.state_dict()), copy.deepcopy(ropt.state_dict())
    for g in mine["param_groups"]:
        g.update(foreach=False, fused=None) if "fused" in g else g.update(foreach=False)
    new_r = reprop_cls(name)([{"params": g["params"]} for g in ropt.param_groups])
    new_t = torch_cls(name)([{"params": g["params"]} for g in topt.param_groups], foreach=False)
    new_r.load_state_dict(theirs)
    new_t.load_state_dict(mine)
    return new_r, new_t


def _fuzz_edit(rng: np.random.Generator, name: str, ropt, topt, pairs: list) -> None:
    """A random change to both optimizers: a hyper-parameter (edge values
    too), a new param group (where torch's steps one: torch_steps_added_groups),
    state edited by hand, or swapped state dicts."""
    kind = rng.integers(4)
    if kind == 1 and not torch_steps_added_groups(name):
        return
    if kind == 0:
        gi = int(rng.integers(len(ropt.param_groups)))
        keys = [key for key in ("lr", "weight_decay", "eps", "betas") if key in ropt.defaults]
        key = keys[rng.integers(len(keys))]
        value = FUZZ_EDGES[rng.integers(len(FUZZ_EDGES))]
        value = (0.9, value) if key == "betas" else value
        for g in (ropt.param_groups[gi], topt.param_groups[gi]):
            if isinstance(g[key], torch.Tensor):
                g[key] = torch.tensor(min(value, 3e38))  # a float32 tensor lr stays one
            else:
                g[key] = value
    elif kind == 1:
        dtypes = sorted({p.dtype for g in ropt.param_groups for p in g["params"]}, key=str)
        new, options = _fuzz_params(rng, torch.Generator().manual_seed(int(rng.integers(99))), dtypes), \
            _fuzz_options(rng, name)
        ropt.add_param_group({"params": [p for p, _ in new], **{k: _copied(v) for k, v in options.items()}})
        topt.add_param_group({"params": [t for _, t in new], **{k: _copied(v) for k, v in options.items()}})
        pairs += new
    elif kind == 2:
        p, twin = pairs[rng.integers(len(pairs))]
        for key in list(topt.state.get(twin, {})):
            scale = [0.5, 0.0, -1.0][rng.integers(3)]
            ropt.state[p][key] = ropt.state[p][key] * scale if key != "step" else torch.tensor(7.0)
            topt.state[twin][key] = topt.state[twin][key] * scale if key != "step" else torch.tensor(7.0)


@pytest.mark.parametrize("seed", FUZZ_SEEDS)
def test_fuzzed_loops_match_torch(seed: int) -> None:
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    name = NAMES[seed % len(NAMES)]
    dtypes = [[torch.float32], [torch.bfloat16, torch.float16], [torch.float32, torch.bfloat16]][seed % 3]
    groups = [_fuzz_params(rng, gen, dtypes) for _ in range(rng.integers(1, 3))]
    options = [_fuzz_options(rng, name) for _ in groups]
    pairs = [pair for group in groups for pair in group]
    flags = {"foreach": [None, True, False][rng.integers(3)]}
    if name in FUSED_KWARG_NAMES and not flags["foreach"]:
        flags["fused"] = [None, True, False][rng.integers(3)]
    ropt = reprop_cls(name)([{"params": [p for p, _ in g], **{k: _copied(v) for k, v in o.items()}}
                             for g, o in zip(groups, options)], **flags)
    topt = torch_cls(name)([{"params": [t for _, t in g], **{k: _copied(v) for k, v in o.items()}}
                            for g, o in zip(groups, options)], foreach=False)
    hooks = {"reprop": 0, "torch": 0}
    for key, opt in (("reprop", ropt), ("torch", topt)):
        opt.register_step_post_hook(lambda *_, key=key: hooks.__setitem__(key, hooks[key] + 1))
    for step in range(6):
        if rng.random() < 0.15:
            set_to_none = bool(rng.integers(2))
            ropt.zero_grad(set_to_none=set_to_none)
            topt.zero_grad(set_to_none=set_to_none)
        elif rng.random() < 0.3:
            _fuzz_edit(rng, name, ropt, topt, pairs)
        elif rng.random() < 0.1:
            ropt, topt = _swap_state_dicts(name, ropt, topt)
            hooks = {"reprop": 0, "torch": 0}
        _fuzz_grads(rng, gen, pairs)
        before, closure = _fuzz_before(topt, pairs), (lambda: 2.5) if rng.random() < 0.3 else None
        errors = []
        for opt in (topt, ropt):
            try:
                errors.append(None if opt.step(closure) == (closure and 2.5) else "closure result")
            except (ValueError, TypeError, RuntimeError, ZeroDivisionError, OverflowError) as e:
                errors.append(e)
        assert (errors[0] is None) == (errors[1] is None), f"step {step}: torch {errors[0]!r}, reprop {errors[1]!r}"
        if errors[0] is not None:  # torch has updated part of the group by now: stop
            return
        _assert_fuzzed_step(name, ropt, topt, pairs, before, step)
        assert hooks["reprop"] == hooks["torch"]
        _resync(ropt, topt, pairs)


# float64 parameters: torch's own step() updates them (its for-loop, foreach or
# fused implementation as the group's flags choose), with torch's state, so
# they train to torch's bits; before, they were refused with a TypeError.
FLOAT64_OPTIONS = [
    ("SGD", RICH["SGD"]),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "maximize": True}),
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.5, "foreach": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.5, "fused": True}),
    ("Adam", RICH["Adam"]),
    ("Adam", {"lr": torch.tensor(0.01), "maximize": True, "decoupled_weight_decay": True,
              "weight_decay": 0.1}),
    ("Adam", {"lr": 0.01, "fused": True}),
    ("Adam", {"lr": 0.01, "amsgrad": True, "foreach": True}),
    ("AdamW", RICH["AdamW"]),
    ("AdamW", {"lr": 0.01, "fused": True, "amsgrad": True}),
    ("Adagrad", RICH["Adagrad"]),
    ("Adagrad", {"lr": 0.1, "maximize": True, "fused": True}),
    ("RMSprop", RICH["RMSprop"]),
    ("RMSprop", {"lr": 0.01, "maximize": True, "alpha": 0.9}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "foreach": True}),
    ("Adadelta", RICH["Adadelta"]),
    ("Adadelta", {"lr": 0.5, "maximize": True, "foreach": True}),
]
FLOAT64_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(FLOAT64_OPTIONS)]
FLOAT64_SHAPES = [(7, 3), (5,), (33,)]


def float64_grads(steps: int) -> list[list[torch.Tensor | None]]:
    """float64 gradients for FLOAT64_SHAPES, the last param without one at step 1."""
    grads = grad_sequence(FLOAT64_SHAPES, steps, dtype=torch.float64)
    grads[1][-1] = None
    return grads


def assert_same_bits(got: torch.optim.Optimizer, got_params: list, ref: torch.optim.Optimizer,
                     ref_params: list) -> None:
    """The params, and the state of each (keys, dtypes, values), bit for bit."""
    for p, q in zip(got_params, ref_params):
        assert p.dtype == q.dtype and torch.equal(p.detach(), q.detach())
        st, rt = got.state.get(p, {}), ref.state.get(q, {})
        assert list(st) == list(rt)
        torch.testing.assert_close(st, rt, rtol=0, atol=0)


@pytest.mark.parametrize("name, options", FLOAT64_OPTIONS, ids=FLOAT64_IDS)
def test_float64_params_train_as_torch(name: str, options: dict) -> None:
    """Every reprop optimizer trains float64 parameters (two groups, a param
    without a gradient at one step) to torch.optim's bits, state included."""
    init = make_params(FLOAT64_SHAPES, seed=41, dtype=torch.float64)
    grads = float64_grads(6)
    group1 = group1_overrides(name, options)
    ref = run_open_loop(factory(torch_cls(name), **copy.deepcopy(options)), init, grads, group1=group1)
    got = run_open_loop(factory(reprop_cls(name), **copy.deepcopy(options)), init, grads, group1=group1)
    assert_same_bits(got.opt, got.params, ref.opt, ref.params)


@pytest.mark.parametrize("name", NAMES)
def test_float64_and_float32_params_in_one_group(name: str) -> None:
    """float64 params in a group with float32 ones: the float64 ones get
    torch's bits and state, the float32 ones exactly the fused update they
    get without float64 params beside them (float32 state)."""
    shapes32 = [(6, 5), (9,)]
    init64 = make_params(FLOAT64_SHAPES, seed=42, dtype=torch.float64)
    init32 = make_params(shapes32, seed=43)
    g64 = float64_grads(5)
    g32 = grad_sequence(shapes32, 5, seed=9)
    mixed = [nn.Parameter(t.clone()) for t in init32[:1] + init64 + init32[1:]]
    opt = reprop_cls(name)(mixed, **RICH[name])
    for a, b in zip(g64, g32):
        for p, g in zip(mixed, b[:1] + a + b[1:]):
            p.grad = None if g is None else g.clone()
        opt.step()
    ref64 = run_open_loop(factory(torch_cls(name), **RICH[name]), init64, g64)
    ref32 = run_open_loop(factory(reprop_cls(name), **RICH[name]), init32, g32)
    assert_same_bits(opt, mixed[1:-1], ref64.opt, ref64.params)
    assert_same_bits(opt, mixed[:1] + mixed[-1:], ref32.opt, ref32.params)


@pytest.mark.parametrize("first", ["torch", "reprop"])
@pytest.mark.parametrize("name", NAMES)
def test_float64_state_dict_round_trips_with_torch(name: str, first: str) -> None:
    """Three steps by one of torch and reprop, its state_dict loaded into the
    other, three more: torch's six steps, bit for bit, the state float64."""
    init = make_params(FLOAT64_SHAPES, seed=44, dtype=torch.float64)
    grads = float64_grads(6)
    ref = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads)
    classes = [torch_cls(name), reprop_cls(name)]
    if first == "reprop":
        classes.reverse()
    before = run_open_loop(factory(classes[0], **RICH[name]), init, grads[:3])
    params = [nn.Parameter(p.detach().clone()) for p in before.params]
    opt = classes[1](params, **RICH[name])
    opt.load_state_dict(before.opt.state_dict())
    for step_grads in grads[3:]:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()
        opt.step()
    assert_same_bits(opt, params, ref.opt, ref.params)
    assert all(t.dtype == torch.float64 for st in opt.state.values()
               for k, t in st.items() if k != "step")


@pytest.mark.parametrize("name", NAMES)
def test_float64_step_params_with_given_grads(name: str) -> None:
    """step_params(grads=...) updates a float64 param from the given gradient
    (torch's step() reads .grad: set for the update, the param's own put
    back after), as torch's step() with that gradient."""
    init = make_params(FLOAT64_SHAPES, seed=45, dtype=torch.float64)
    grads = grad_sequence(FLOAT64_SHAPES, 3, dtype=torch.float64)
    ref = run_open_loop(factory(torch_cls(name), **RICH[name]), init, grads)
    params = [nn.Parameter(t.clone()) for t in init]
    opt = reprop_cls(name)(params, **RICH[name])
    own = torch.full((5,), 7.0, dtype=torch.float64)
    params[1].grad = own
    for step_grads in grads:
        opt.step_params(params, grads=[g.clone() for g in step_grads])
    assert params[1].grad is own and params[0].grad is None
    assert_same_bits(opt, params, ref.opt, ref.params)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad"])
def test_float64_grad_scale_and_found_inf_as_torch_fused(name: str) -> None:
    """grad_scale and found_inf on the optimizer (torch's fused AMP protocol,
    which reprop follows whatever the `fused` flag): a float64 param's
    gradient is divided in place and a step with found_inf skipped, as by
    torch's fused optimizer, to its bits."""
    runs = []
    for cls in (torch_cls(name), reprop_cls(name)):
        params = [nn.Parameter(t.clone()) for t in
                  make_params(FLOAT64_SHAPES, seed=46, dtype=torch.float64)]
        opt = cls(params, **RICH[name], fused=True)
        for i, step_grads in enumerate(grad_sequence(FLOAT64_SHAPES, 4, dtype=torch.float64)):
            for p, g in zip(params, step_grads):
                p.grad = g * 1024
            opt.grad_scale = torch.tensor(1024.0)
            opt.found_inf = torch.tensor(1.0 if i == 2 else 0.0)
            opt.step()
        runs.append((opt, params))
    assert_same_bits(*runs[1], *runs[0])
    assert torch.equal(runs[1][1][0].grad, runs[0][1][0].grad)


def test_param_whose_data_changes_dtype_switches_update() -> None:
    """A param whose .data becomes float64 is updated by torch's step() from
    then on (its float32 momentum buffer, which torch's SGD updates in place,
    kept), and one becoming float32 again by the kernels (a cached call must
    notice, though no row of it changed), whose state is float32."""
    init = make_params([(5, 4)], seed=47)
    grads = grad_sequence([(5, 4)], 6)
    ps = []
    for cls in (torch.optim.SGD, rp.SGD):
        p = nn.Parameter(init[0].clone())
        opt = cls([p], **RICH["SGD"])
        for i, (g,) in enumerate(grads[:4]):
            if i == 2:
                p.data = p.data.double()
            p.grad = g.to(p.dtype)
            opt.step()
        ps.append((opt, p))
    assert_same_bits(*ps[1], *ps[0])
    # a float64 param's torch-made float64 buffer is taken as float32 state
    # (as set by hand) by the kernels once the param is float32
    p = nn.Parameter(init[0].double())
    opt = rp.SGD([p], **RICH["SGD"])
    p.grad = grads[4][0].double()
    opt.step()
    assert opt.state[p]["momentum_buffer"].dtype == torch.float64
    p.data = p.data.float()
    p.grad = grads[5][0].clone()
    before = p.detach().clone()
    opt.step()
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    assert not torch.equal(p.detach(), before)


@pytest.mark.parametrize("name", NAMES)
def test_float64_params_train_a_model_as_torch(name: str) -> None:
    """Closed loop: SmallNet in float64 trained 8 steps, as torch.optim trains it, bit for bit."""
    batches = [(x.double(), y.double()) for x, y in make_batches(8)]
    runs = [train_model(factory(cls, **RICH[name]), batches, model=make_model().double(),
                        group1=group1_overrides(name, RICH[name]))
            for cls in (torch_cls(name), reprop_cls(name))]
    assert_same_bits(runs[1].opt, runs[1].params, runs[0].opt, runs[0].params)


def test_float64_capturable_on_cpu_still_refused() -> None:
    """capturable=True with CPU float64 params is refused at construction, as
    for any CPU param (torch's update asserts it at step())."""
    with pytest.raises(ValueError, match="capturable=True needs CUDA"):
        rp.Adam([nn.Parameter(torch.ones(3, dtype=torch.float64))], capturable=True)


# A first step skipped by found_inf: torch's fused step() makes the state of
# its _init_group before its kernels skip (Adam's zero moments at step 0,
# Adagrad's `sum` of a group added after the constructor), which the float64
# params got none of (a state dict without them) before torch's step() body
# updated them. SGD: torch's fused stores an uninitialized momentum buffer,
# reprop none, for float64 params as for the others (README).
@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adagrad"])
def test_float64_first_step_skipped_by_found_inf_makes_torchs_fused_state(name: str) -> None:
    if not torch_steps_added_groups(name):
        pytest.skip(NO_TORCH_ADAGRAD_ADDED_GROUPS)
    runs = []
    for cls in (torch_cls(name), reprop_cls(name)):
        params = [nn.Parameter(t.clone()) for t in
                  make_params(FLOAT64_SHAPES, seed=48, dtype=torch.float64)]
        opt = cls(params[:1], **RICH[name], fused=True)
        opt.add_param_group({"params": params[1:]})  # (Adagrad: no state until a step)
        for i, step_grads in enumerate(grad_sequence(FLOAT64_SHAPES, 3, dtype=torch.float64)):
            for p, g in zip(params, step_grads):
                p.grad = g * 8
            opt.grad_scale = torch.tensor(8.0)
            opt.found_inf = torch.tensor(1.0 if i == 0 else 0.0)
            opt.step()
            if i == 0:
                runs.append(copy.deepcopy(opt.state_dict()))
        runs.append((opt, params))
    torch_first, (torch_opt, torch_params), first, (opt, params) = runs
    assert sorted(first["state"]) == sorted(torch_first["state"]) == [0, 1, 2]
    torch.testing.assert_close(first["state"], torch_first["state"], rtol=0, atol=0)
    assert all(float(st["step"]) == 0 for st in first["state"].values())
    assert_same_bits(opt, params, torch_opt, torch_params)


def test_float64_sgd_first_step_skipped_by_found_inf_makes_no_buffer() -> None:
    """SGD with momentum: a skipped first step leaves a float64 param no
    momentum buffer, as it leaves a float32 one (torch's fused stores an
    uninitialized one), and the next step starts one from its gradient: the
    step of torch's that was not skipped."""
    init = make_params(FLOAT64_SHAPES, seed=49, dtype=torch.float64)
    grads = grad_sequence(FLOAT64_SHAPES, 3, dtype=torch.float64)
    ref = run_open_loop(factory(torch.optim.SGD, **RICH["SGD"], fused=True), init, grads[1:])
    params = [nn.Parameter(t.clone()) for t in init]
    opt = rp.SGD(params, **RICH["SGD"], fused=True)
    for i, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.found_inf = torch.tensor(1.0 if i == 0 else 0.0)
        opt.step()
        if i == 0:
            assert not any(opt.state_dict()["state"].values())  # (empty entries, as float32's)
    assert_same_bits(opt, params, ref.opt, ref.params)


# differentiable=True: a group that torch's own step() body updates, all its
# params (float32 and float64 here), so that autograd goes through the update
# (hyper-gradients, meta-learning); refused before. Options that torch's
# differentiable update supports (amsgrad, centered RMSprop, SGD with momentum
# and a tensor lr write in place what its graph saved), a tensor lr requiring
# grad where it takes one.
DIFFERENTIABLE_OPTIONS = [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "nesterov": False,
             "weight_decay": 0.01, "maximize": True}, False),
    ("SGD", {"lr": 0.1}, True),
    ("Adam", {"lr": 0.01, "weight_decay": 0.1}, True),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1, "maximize": True}, True),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1}, False),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "alpha": 0.9}, False),
    ("Adadelta", {"lr": 0.5, "weight_decay": 0.1}, False),
]
DIFFERENTIABLE_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(DIFFERENTIABLE_OPTIONS)]


def differentiable_run(cls: type, options: dict, lr_tensor: bool, steps: int = 3) -> tuple:
    """Meta-learning as torch's tests do it: params that are non-leaf clones
    of w (float32, float64, bfloat16), stepped `steps` times by a differentiable
    optimizer on gradients taken with create_graph, then the hyper-gradient
    of the loss after the steps with respect to w (and the lr, a tensor
    requiring grad, when lr_tensor). Returns (optimizer, params, hyper-gradients)."""
    gen = torch.Generator().manual_seed(50)
    ws = [torch.randn(5, 3, generator=gen, dtype=dtype).requires_grad_()
          for dtype in (torch.float32, torch.float64, torch.bfloat16)]
    x = torch.randn(8, 5, generator=gen)
    lr = torch.tensor(options["lr"], requires_grad=True) if lr_tensor else options["lr"]
    params = [w.clone() for w in ws]

    def loss() -> torch.Tensor:
        return sum((x.to(p.dtype) @ p).tanh().pow(2).sum() for p in params)

    opt = cls(params, **{**options, "lr": lr}, differentiable=True)
    for _ in range(steps):
        for p, g in zip(params, torch.autograd.grad(loss(), params, create_graph=True)):
            p.grad = g
        opt.step()
    inputs = [*ws, lr] if lr_tensor else ws
    return opt, params, torch.autograd.grad(loss(), inputs)


def assert_differentiable_runs_equal(got: tuple, ref: tuple) -> None:
    """Params, state (values and whether autograd records them) and
    hyper-gradients bit for bit."""
    (opt, params, hyper), (ref_opt, ref_params, ref_hyper) = got, ref
    assert_same_bits(opt, params, ref_opt, ref_params)
    for p, q in zip(params, ref_params):
        assert [t.requires_grad for t in opt.state[p].values() if isinstance(t, torch.Tensor)] \
            == [t.requires_grad for t in ref_opt.state[q].values() if isinstance(t, torch.Tensor)]
    assert len(hyper) == len(ref_hyper)
    for h, r in zip(hyper, ref_hyper):
        assert torch.equal(h, r)


@pytest.mark.parametrize("name, options, lr_tensor", DIFFERENTIABLE_OPTIONS, ids=DIFFERENTIABLE_IDS)
def test_differentiable_steps_and_hypergradients_are_torchs(name: str, options: dict,
                                                           lr_tensor: bool) -> None:
    """differentiable=True: three steps give torch's params and state, and
    the gradient of the loss after them with respect to the initial weights
    (and the lr) is torch's, bit for bit (refused with a ValueError before)."""
    ref = differentiable_run(torch_cls(name), options, lr_tensor)
    got = differentiable_run(reprop_cls(name), options, lr_tensor)
    assert any(h.abs().sum() > 0 for h in ref[2])
    assert_differentiable_runs_equal(got, ref)


@pytest.mark.parametrize("name", NAMES)
def test_differentiable_group_takes_complex_params_as_torch(name: str) -> None:
    """A differentiable group's complex params (refused in other groups)
    train as torch's, whose update views them as real pairs."""
    runs = []
    for cls in (torch_cls(name), reprop_cls(name)):
        w = torch.randn(4, dtype=torch.cfloat, generator=torch.Generator().manual_seed(55))
        p = w.requires_grad_().clone()
        opt = cls([p], **BASE[name], differentiable=True)
        for _ in range(2):
            p.grad = torch.autograd.grad((p * p).real.sum(), p, create_graph=True)[0]
            opt.step()
        runs.append((opt, [p], torch.autograd.grad(p.abs().sum(), w)))
    assert_differentiable_runs_equal(runs[1], runs[0])


@pytest.mark.parametrize("name", NAMES)
def test_differentiable_state_dict_loads_both_ways(name: str) -> None:
    """A differentiable optimizer's state dict (refused by load_state_dict
    before) loads into either of torch and reprop, whose steps then go on as
    torch's: state (in the params' dtypes) and params bit for bit, the state
    dicts equal."""
    init = make_params(FLOAT64_SHAPES, seed=51)
    grads = grad_sequence(FLOAT64_SHAPES, 4)
    # a bfloat16 param keeps its bfloat16 state (torch's), not reprop's float32
    init[-1] = init[-1].bfloat16()
    for step_grads in grads:
        step_grads[-1] = step_grads[-1].bfloat16()

    def run(cls: type, step_grads: list, loaded: dict | None = None) -> Run:
        # plain tensors: torch's differentiable update writes in place under
        # grad mode, which it refuses for a leaf that requires grad
        params = [t.clone() for t in init] if loaded is None else loaded["params"]
        opt = cls(params, **RICH[name], differentiable=True)
        if loaded is not None:
            opt.load_state_dict(loaded["state"])
        for gs in step_grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        return Run(params, opt)

    ref = run(torch_cls(name), grads)
    for first, second in ((torch_cls(name), reprop_cls(name)), (reprop_cls(name), torch_cls(name))):
        before = run(first, grads[:2])
        after = run(second, grads[2:], {"params": before.params, "state": before.opt.state_dict()})
        assert_same_bits(after.opt, after.params, ref.opt, ref.params)
        torch.testing.assert_close(after.opt.state_dict(), ref.opt.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adagrad"])
def test_differentiable_first_step_skipped_by_found_inf(name: str) -> None:
    """step() of a differentiable group follows found_inf as the other
    groups do (torch's non-fused update raises for it): a skipped first
    step leaves the state torch's _init_group makes (zero moments, `sum`,
    at step 0) and the params as they were; the steps after are torch's
    from there, hyper-gradient included."""
    options = {"lr": 0.01, "weight_decay": 0.1}
    ref = differentiable_run(torch_cls(name), options, False, steps=2)

    class Skipping(reprop_cls(name)):
        skips = 1

        def step(self, closure=None):
            self.found_inf = torch.tensor(float(self.skips > 0))
            if self.skips:
                before = [p.detach().clone() for g in self.param_groups for p in g["params"]]
            super().step(closure)
            if self.skips:
                self.skips -= 1
                params = [p for g in self.param_groups for p in g["params"]]
                assert all(torch.equal(p, b) for p, b in zip(params, before))
                for p in params:
                    assert float(self.state[p]["step"]) == 0
                    assert all(not t.any() for k, t in self.state[p].items() if k != "step")

    got = differentiable_run(Skipping, options, False, steps=3)
    assert_differentiable_runs_equal(got, ref)


@pytest.mark.parametrize("name", NAMES)
def test_differentiable_group_added_beside_a_plain_one(name: str) -> None:
    """A differentiable group and a plain one in one optimizer (added by
    add_param_group, refused before): the differentiable one's params
    (float32 and float64) are updated by torch's step() body, through which
    the hyper-gradient goes as torch's, the plain one's by the kernels as
    without it."""
    if not torch_steps_added_groups(name):
        pytest.skip(NO_TORCH_ADAGRAD_ADDED_GROUPS)
    options = {"lr": 0.01, "weight_decay": 0.1} if name != "SGD" else {"lr": 0.1}
    init32 = make_params([(6, 5), (9,)], seed=52)
    g32 = grad_sequence([(6, 5), (9,)], 3, seed=9)
    runs = []
    for cls in (torch_cls(name), reprop_cls(name)):
        plain = [nn.Parameter(t.clone()) for t in init32]
        # differentiable=True in the defaults: torch's step() sets grad mode from them
        opt = cls([{"params": plain, "differentiable": False}], **options, differentiable=True)
        w = torch.randn(5, 3, generator=torch.Generator().manual_seed(53), requires_grad=True)
        diff = [w.clone(), w.double().clone()]
        opt.add_param_group({"params": diff})
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(54))
        loss = lambda: sum((x.to(p.dtype) @ p).sin().sum() for p in diff)  # noqa: E731
        for step_grads in g32:
            for p, g in zip(plain, step_grads):
                p.grad = g.clone()
            for p, g in zip(diff, torch.autograd.grad(loss(), diff, create_graph=True)):
                p.grad = g
            with torch.no_grad():  # plain params: torch's would raise as leaves needing grad
                for p in plain:
                    p.requires_grad_(False)
                opt.step()
                for p in plain:
                    p.requires_grad_(True)
        runs.append((opt, plain, diff, torch.autograd.grad(loss(), w)))
    (ref, ref_plain, ref_diff, ref_hyper), (opt, plain, diff, hyper) = runs
    assert_same_bits(opt, diff, ref, ref_diff)
    assert torch.equal(hyper[0], ref_hyper[0])
    kernels = run_open_loop(factory(reprop_cls(name), **options), init32, g32)
    assert_same_bits(opt, plain, kernels.opt, kernels.params)


def test_float64_step_runs_the_step_hooks_once() -> None:
    """torch's step() body runs for the float64 params without the hook
    wrapper torch puts on torch.optim.Adam.step at its first instance: the
    global and the optimizer's step hooks run once per step(), as torch's."""
    torch.optim.Adam([nn.Parameter(torch.zeros(1))])  # (torch wraps Adam.step now)
    calls = []
    handles = [register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: calls.append("global pre"))]
    try:
        p = nn.Parameter(torch.ones(3, dtype=torch.float64))
        opt = rp.Adam([p], lr=0.1)
        opt.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
        p.grad = torch.ones_like(p)
        opt.step()
    finally:
        for h in handles:
            h.remove()
    assert calls == ["global pre", "post"]
    assert opt.state[p]["step"] == 1


# --- Mutation audit of python/reprop/optim.py (session 42): tests that kill
# mutants of the Python layer that no other test noticed.


@pytest.mark.parametrize("name, key", [("AdamW", "lr"), ("Adagrad", "weight_decay"),
                                       ("RMSprop", "alpha"), ("Adadelta", "rho")])
@pytest.mark.filterwarnings("ignore:overflow encountered in scalar subtract:RuntimeWarning")
def test_numpy_int64_hyperparameter_at_its_minimum_steps_like_torch(name: str, key: str) -> None:
    """np.int64(-2**63), the least int64, is a hyper-parameter torch takes
    (as an int64) and steps with: not refused as beyond 64 bits (a bound
    checked with < instead of <= refused it with OverflowError)."""
    v = np.int64(-2**63)
    runs = []
    for cls in (torch_cls(name), reprop_cls(name)):
        p = nn.Parameter(torch.linspace(-1, 1, 5))
        opt = cls([p], **RICH[name])
        _set_hparam(opt.param_groups[0], key, lambda _: v)
        for k in range(2):
            p.grad = torch.linspace(0.5, -0.3, 5) * (k + 1)
            opt.step()
        runs.append(p.detach())
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-6, atol=1e-7, equal_nan=True)


def test_step_params_refuses_fewer_gradients_than_params() -> None:
    """grads shorter than params is refused naming both counts, as a longer
    one is (a check of > only left a missing gradient to a bare KeyError)."""
    ps = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    opt = reprop_cls("SGD")(ps, lr=0.1)
    with pytest.raises(ValueError, match=r"grads: expected 2 gradients, got 1"):
        opt.step_params(ps, grads=[torch.ones(3)])
    assert all(torch.equal(p, torch.ones_like(p)) for p in ps)


@pytest.mark.parametrize("name", ["SGD", "Adam", "Adagrad"])
def test_differentiable_group_gradients_are_divided_by_grad_scale(name: str) -> None:
    """step() of a differentiable group with grad_scale set (found_inf not)
    divides the gradients by it before torch's update, as the other groups
    (and torch's fused step) do, and writes them back into .grad: it steps
    as torch from the unscaled gradients."""
    g = torch.linspace(0.5, -0.3, 5)
    # (tensors not requiring grad: torch's differentiable update of a leaf
    # that requires grad raises)
    ref, got = torch.linspace(-1, 1, 5), torch.linspace(-1, 1, 5)
    topt = torch_cls(name)([ref], lr=0.1, differentiable=True)
    ropt = reprop_cls(name)([got], lr=0.1, differentiable=True)
    ropt.grad_scale = torch.tensor(4.0)
    for _ in range(2):
        ref.grad, got.grad = g.clone(), g * 4
        topt.step()
        ropt.step()
        torch.testing.assert_close(got.grad, g, rtol=0, atol=0)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["Adam", "Adagrad", "RMSprop"])
def test_state_without_a_step_count_is_refused_saying_so(name: str) -> None:
    """The KeyError for state without "step" says what is missing and why
    (not a bare KeyError('step') from reading it)."""
    p = nn.Parameter(torch.ones(3))
    opt = reprop_cls(name)([p], **RICH[name])
    p.grad = torch.ones(3)
    opt.step()
    del opt.state[p]["step"]
    with pytest.raises(KeyError, match=r"step: the state of a parameter of shape \(3,\) has no "
                                        r"step count"):
        opt.step()


def test_adam_complex_step_count_is_refused_as_torch_refuses_it() -> None:
    """A complex state["step"] makes torch's Adam raise RuntimeError: reprop
    refuses it naming the key, the param left as it was (not read as its
    real part and stepped on)."""
    for cls in (torch_cls("Adam"), reprop_cls("Adam")):
        p = nn.Parameter(torch.ones(3))
        opt = cls([p], lr=0.1)
        p.grad = torch.ones(3)
        opt.step()
        opt.state[p]["step"] = torch.tensor(1 + 0j)
        before = p.detach().clone()
        with pytest.raises(RuntimeError, match="step" if cls is reprop_cls("Adam") else "Complex"):
            opt.step()
        assert torch.equal(p.detach(), before)


def test_low_precision_load_keeps_a_float64_step_count_as_torch() -> None:
    """load_state_dict keeps the float32 copies of a bfloat16 param's moments
    but not of its "step": a float64 step count stays float64, as torch's
    load keeps it."""
    loaded = []
    for cls in (torch_cls("Adam"), reprop_cls("Adam")):
        p = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        opt = cls([p], lr=0.1)
        p.grad = torch.ones(3, dtype=torch.bfloat16)
        opt.step()
        sd = opt.state_dict()
        sd["state"][0]["step"] = torch.tensor(5.0, dtype=torch.float64)
        opt.load_state_dict(sd)
        loaded.append(opt.state[p]["step"])
    assert loaded[1].dtype == loaded[0].dtype == torch.float64
    assert float(loaded[1]) == 5.0


def test_loaded_state_dict_is_not_held_after_load_state_dict() -> None:
    """load_state_dict notes the dict it loads only while loading: once it
    returns, the tensors of that dict that the optimizer did not keep (a
    bfloat16 param's float32 moments, kept as copies) are freed with it."""
    p = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = reprop_cls("Adam")([p], lr=0.1)
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    saved = weakref.ref(sd["state"][0]["exp_avg"])
    opt.load_state_dict(sd)
    assert opt.state[p]["exp_avg"] is not saved()
    del sd
    gc.collect()
    assert saved() is None


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_given_gradient_is_checked_not_the_params_grad(name: str) -> None:
    """step_params(grads=) checks the gradients given, also where the param
    has a .grad of its own that would pass (the given one, read instead, is
    refused before any state exists)."""
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = reprop_cls(name)([p], **RICH[name])
    with pytest.raises(ValueError, match=r"grads: a gradient of shape \(4,\)"):
        opt.step_params([p], grads=[torch.ones(4)])
    assert torch.equal(p.detach(), torch.ones(3)) and not opt.state[p]


def test_load_state_dict_leaves_no_hook_behind() -> None:
    """The pre-hook load_state_dict registers to note the dict it loads is
    removed when it returns: loads do not pile up hooks (each run at every
    later load)."""
    p = nn.Parameter(torch.ones(3))
    opt = reprop_cls("Adam")([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    hooks = (dict(opt._optimizer_load_state_dict_pre_hooks),
             dict(opt._optimizer_load_state_dict_post_hooks))
    for _ in range(3):
        opt.load_state_dict(opt.state_dict())
    assert (opt._optimizer_load_state_dict_pre_hooks,
            opt._optimizer_load_state_dict_post_hooks) == hooks


def _amp_step_of_two_plans(stop: LineStop) -> tuple[list, torch.optim.Optimizer]:
    """Adam on a float32 and a bfloat16 param (one group, two kernel calls):
    a scaled step (grad_scale 1024) under `stop`, retried once stopped."""
    params = [nn.Parameter(torch.linspace(-1, 1, 5, dtype=dt)) for dt in (torch.float32, torch.bfloat16)]
    opt = reprop_cls("Adam")(params, lr=0.1)
    for p in params:
        p.grad = torch.linspace(0.5, -0.3, 5, dtype=p.dtype) * 1024
    opt.grad_scale = torch.tensor(1024.0)
    try:
        with stop:
            opt.step()
    except KeyboardInterrupt:
        opt.step()
    return params, opt


def test_amp_step_stopped_amid_the_divisions_of_its_calls_divides_each_once() -> None:
    """A stop between the divisions of two kernel calls' gradients by
    grad_scale (the first call's divided, its versions not yet read back)
    leaves notes that the retry takes as "divided": each gradient is divided
    once, and the params step as an uninterrupted step (a forecast of the
    versions read before the division took the first call's for written
    since, and divided them again)."""
    lines = LineStop(rp._unscale_grads, 0)
    whole, _ = _amp_step_of_two_plans(lines)
    for n in range(1, lines.count + 1):
        got, _ = _amp_step_of_two_plans(LineStop(rp._unscale_grads, n))
        for p, w in zip(got, whole):
            assert torch.equal(p.grad, w.grad) and torch.equal(p, w), f"line {n}"


def test_low_precision_load_does_not_step_the_loaded_dicts_moments() -> None:
    """The float32 moments loaded for a bfloat16 param are the optimizer's
    own copies: stepping on leaves those of the dict loaded as they were, as
    torch's load, which casts them to bfloat16, leaves them (both step the
    dict's "step" tensor, which both keep as it is)."""
    p = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = reprop_cls("Adam")([p], lr=0.1)
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    for cls in (torch_cls("Adam"), reprop_cls("Adam")):
        loaded = copy.deepcopy(sd)
        saved = {k: loaded["state"][0][k].clone() for k in ("exp_avg", "exp_avg_sq")}
        q = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        other = cls([q], lr=0.1)
        other.load_state_dict(loaded)
        q.grad = torch.ones(3, dtype=torch.bfloat16)
        other.step()
        assert all(torch.equal(loaded["state"][0][k], v) for k, v in saved.items()), cls


def test_complex_param_is_refused_saying_complex_is_not_supported() -> None:
    """A complex param (outside a differentiable group) is refused as
    complex, with its dtype and shape, at construction: not as one more
    unsupported dtype."""
    p = nn.Parameter(torch.randn(3, dtype=torch.cfloat))
    with pytest.raises(TypeError, match=r"^Adam: complex parameters are not supported \(got a "
                                        r"torch\.complex64 parameter of shape \(3,\)\)$"):
        reprop_cls("Adam")([p], lr=0.1)
