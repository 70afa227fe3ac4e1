"""reprop.fad against plain PyTorch: values, gradients, saved bytes, training.

Golden references are torch's own activations (native ops, or the composed
definitions autograd differentiates) on the same inputs, in the same test.

Tolerances (check_accuracy). reprop's exp/log1p/tanh/erf are its own
about-one-ulp implementations (vectorizable, identical on CPU and CUDA), where
torch uses SLEEF on the CPU; both compute in float32 and round differently, so
each result is held to twice torch's own error against float64 plus two
roundings of its dtype (at its subnormals, their spacing; 16-bit gradients
round twice: d stored in x's dtype, then grad * d). There is no other absolute
slack but where the formulas subtract nearly equal terms (CANCELLING_VALUE,
CANCELLING_DERIVATIVE: GELU's 1 + erf(x/sqrt 2) at negative x, Tanh's
1 - t^2): a last-bit difference of the terms is magnified there, and one
float32 rounding of the terms' size is allowed on top.
"""
from __future__ import annotations

import contextlib
import functools
import copy
import io
import gc
import inspect
import itertools
import math
import os
import random
import subprocess
import sys
import textwrap
import threading
import traceback
import weakref

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from reprop import _tensors, fad

from _interrupts import LineStop, interrupted_at_line
from _threads import torch_threads

CUDA = [pytest.param("cuda", marks=pytest.mark.gpu)]
DEVICES = ["cpu", *CUDA]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# name -> (reprop function, torch reference, kwargs); the torch reference is
# what a user would otherwise call.
ACTIVATIONS = {
    "gelu": (fad.gelu, F.gelu, {}),
    "gelu_tanh": (fad.gelu, F.gelu, {"approximate": "tanh"}),
    "silu": (fad.silu, F.silu, {}),
    "mish": (fad.mish, F.mish, {}),
    "softplus": (fad.softplus, F.softplus, {}),
    "softplus_beta": (fad.softplus, F.softplus, {"beta": 2.0, "threshold": 5.0}),
    "sigmoid": (fad.sigmoid, torch.sigmoid, {}),
    "tanh": (fad.tanh, torch.tanh, {}),
    "elu": (fad.elu, F.elu, {}),
    "elu_alpha": (fad.elu, F.elu, {"alpha": 0.5}),
    "celu": (fad.celu, F.celu, {"alpha": 1.5}),
    "selu": (fad.selu, F.selu, {}),
    "leaky_relu": (fad.leaky_relu, F.leaky_relu, {"negative_slope": 0.2}),
    "hardswish": (fad.hardswish, F.hardswish, {}),
    "hardsigmoid": (fad.hardsigmoid, F.hardsigmoid, {}),
    "logsigmoid": (fad.logsigmoid, F.logsigmoid, {}),
    "softsign": (fad.softsign, F.softsign, {}),
    "tanhshrink": (fad.tanhshrink, F.tanhshrink, {}),
}
# codebook() names and parameters of each case
CODEBOOK_ARGS = {
    "gelu": ("gelu",), "gelu_tanh": ("gelu_tanh",), "silu": ("silu",), "mish": ("mish",),
    "softplus": ("softplus", 1.0, 20.0), "softplus_beta": ("softplus", 2.0, 5.0),
    "sigmoid": ("sigmoid",), "tanh": ("tanh",), "elu": ("elu", 1.0), "elu_alpha": ("elu", 0.5),
    "celu": ("celu", 1.5), "selu": ("selu",), "leaky_relu": ("leaky_relu", 0.2),
    "hardswish": ("hardswish",), "hardsigmoid": ("hardsigmoid",), "logsigmoid": ("logsigmoid",),
    "softsign": ("softsign",), "tanhshrink": ("tanhshrink",),
}

SPECIALS = [0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 0.5, -0.5, 1.0, -1.0, 2.9, -2.9, 3.0, -3.0,
            3.1, -3.1, 5.0, -5.0, 10.0, -10.0, 20.0, -20.0, 30.0, -30.0, 88.0, -88.0, 100.0,
            -100.0, math.inf, -math.inf, math.nan]


def sample(device, dtype, n=4096, seed=0):
    """The special points first (so torch's vectorized loops, not its scalar
    tails, give the reference there), then normal and wide-range values."""
    g = torch.Generator().manual_seed(seed)
    body = torch.cat([torch.tensor(SPECIALS), torch.randn(n, generator=g) * 3,
                      torch.linspace(-12, 12, 1001)])
    return body.to(dtype).to(device)


F32_EPS = torch.finfo(torch.float32).eps


def _below_zero(x):
    return (x < 0).double()


def _std_normal_pdf(x):
    return torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _gelu_tanh_derivative_terms(x):
    """(1 + t) / 2 + x / 2 * (1 - t^2) * inner': 1 + t cancels at x < 0,
    1 - t^2 wherever |t| nears 1, and the sum of the two at x < 0."""
    c = math.sqrt(2 / math.pi)
    t = torch.tanh(c * (x + 0.044715 * x**3))
    inner_d = c * (1 + 3 * 0.044715 * x * x)
    return (1 + t.abs()) / 2 * _below_zero(x) + (x / 2 * inner_d).abs() * (1 + t * t)


def _silu_derivative_terms(x):
    """s (1 + x (1 - s)): 1 - s cancels as s nears 1, 1 + x (1 - s) at x < 0."""
    s = torch.sigmoid(x)
    return s * (1 + x.abs() * (1 + s))


def _mish_derivative_terms(x):
    """tsp + x s (1 - tsp^2), tsp = tanh(softplus(x)): 1 - tsp^2 cancels as
    tsp nears 1, the sum at x < 0."""
    tsp, s = torch.tanh(F.softplus(x)), torch.sigmoid(x)
    return tsp + x.abs() * s * (1 + tsp * tsp)


def _sigmoid_derivative_terms(x):
    """(1 - s) s: 1 - s cancels as s nears 1 (x > 0), where an ulp of s is
    many of 1 - s. torch's vectorized CPU loop rounds s as reprop does (its
    bits there), its CUDA kernel with its own exp: at x = 3.19 (sample())
    two ulps above reprop's s (0.6 ulp from float64 against 1.4, found from
    its gradient), which puts its f' 2e-6 (relative) nearer float64."""
    s = torch.sigmoid(x)
    return (1 + s) * s * (x > 0)


def _softsign_derivative_terms(x):
    """1/a - |x|/a^2, a = 1 + |x|: autograd's sum from div and abs."""
    a = 1 + x.abs()
    return 1 / a + x.abs() / a**2


# The size (float64, from x) of the terms that reprop's and torch's float32
# formulas subtract where they nearly cancel, for y and for f'. An activation
# not listed cancels nowhere. One float32 rounding of these is allowed
# (measured need: at most 0.44 of one, Mish's f' near its zero at x = -1.19).
CANCELLING_VALUE = {
    "gelu": lambda x: x.abs() * _below_zero(x),       # x (1 + erf(x / sqrt 2)) / 2
    "gelu_tanh": lambda x: x.abs() * _below_zero(x),  # x (1 + tanh(inner)) / 2
    "tanhshrink": lambda x: x.abs() + torch.tanh(x).abs(),
}
CANCELLING_DERIVATIVE = {
    # Phi(x) + x phi(x), Phi = (1 + erf(x / sqrt 2)) / 2: both sums at x < 0
    "gelu": lambda x: (1 + x.abs() * _std_normal_pdf(x)) * _below_zero(x),
    "gelu_tanh": _gelu_tanh_derivative_terms,
    "silu": _silu_derivative_terms,
    "mish": _mish_derivative_terms,
    "sigmoid": _sigmoid_derivative_terms,
    "tanh": lambda x: 1 + torch.tanh(x) ** 2,                # 1 - t^2
    "tanhshrink": lambda x: torch.full_like(x, 2.0),         # 1 + (-1) (1 - t^2)
    "softsign": _softsign_derivative_terms,
}


def cancelling_terms(table, name, x):
    """table's terms for activation `name` at x (float64), zero if it has none."""
    terms = table.get(name)
    x = x.double()
    return torch.zeros_like(x) if terms is None else terms(x)


def check_accuracy(got, ref, exact, cancelling=None, units=2):
    """got is as accurate as torch's own result `ref`, measured against the
    float64 `exact` value: within twice torch's error plus `units` roundings of
    got's dtype (its subnormals' spacing below the normal range), plus one
    float32 rounding of `cancelling`, the size of the terms that the float32
    formulas subtract where they nearly cancel (None: nowhere). NaNs and
    infinities must be where torch has them."""
    info = torch.finfo(got.dtype)
    got, ref = got.double().cpu(), ref.double().cpu()
    exact = exact.cpu()
    # torch's float32 GELU gives NaN at +inf (but for a one-element tensor),
    # where float64 gives inf: there the float64 result is the reference
    ref = torch.where(ref.isnan() & ~exact.isnan(), exact, ref)
    assert torch.equal(got.isnan(), ref.isnan()), "NaN positions differ"
    special = ref.isinf()
    assert torch.equal(got[special], ref[special]), "infinities differ"
    finite = ref.isfinite() & exact.isfinite()
    err, err_ref = (got - exact).abs(), (ref - exact).abs()
    rounding = (info.eps * exact.abs()).clamp(min=info.tiny * info.eps)
    tol = 2 * err_ref + units * rounding
    if cancelling is not None:
        tol = tol + F32_EPS * cancelling.cpu()
    bad = finite & (err > tol)
    assert not bad.any(), (f"{bad.sum().item()} elements off: got {got[bad][:4].tolist()}, "
                           f"torch {ref[bad][:4].tolist()}, exact {exact[bad][:4].tolist()}")


# torch composes these of several ops (F.softsign is x / (|x| + 1),
# F.tanhshrink x - tanh(x)), each rounding to a 16-bit input's dtype, where
# reprop rounds its float32 result once: their 16-bit values differ by design.
TORCH_COMPOSITE = {"softsign", "tanhshrink"}


def _ulp_ordered(t):
    """A 16-bit float's bits as an integer counting ulps through zero (+-0: 0)."""
    bits = t.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def check_rounded_like_torch(got, ref, where):
    """16-bit values: torch and reprop round float32 results a few float32 ulps
    apart once, so where no terms cancel (`where`) got has torch's bits except
    where the two straddle a rounding boundary, and is one unit away there.
    Measured on sample(): all equal but one of Mish's 5126 in float16, so 99%
    is required; a result truncated rather than rounded matches 40 to 80%."""
    got, ref, where = got.cpu(), ref.cpu(), where.cpu()
    keep = where & ~(got.isnan() | ref.isnan())  # NaN positions: check_accuracy
    got, ref = got[keep], ref[keep]
    same = got.view(torch.int16) == ref.view(torch.int16)
    assert same.double().mean() >= 0.99, f"{same.double().mean().item():.4f} of values are torch's"
    apart = (_ulp_ordered(got) - _ulp_ordered(ref)).abs()
    assert (apart <= 1).all(), f"values {apart.max().item()} units from torch's"


def _same_bits(a, b):
    """Equal bit for bit (the sign of zero included), NaN wherever the other
    is NaN, whatever the two NaNs' signs and payloads."""
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    both_nan = a.isnan() & b.isnan()
    return torch.where(both_nan, True, a.view(as_int) == b.view(as_int))


def values_and_grads(fn, x, grad, **kwargs):
    x = x.detach().clone().requires_grad_()
    y = fn(x, **kwargs)
    (gx,) = torch.autograd.grad(y, x, grad)
    return y.detach(), gx


# README: f' of these at a NaN input is NaN, as torch's vectorized CPU loop
# gives; its scalar CPU loop and its CUDA kernels (float64 too) take the
# x > 0 piece there (1; SELU: its scale), a finite gradient from a NaN.
NAN_DERIVATIVE_AT_NAN = {"elu", "elu_alpha", "celu", "selu", "hardswish"}


def nan_derivative_at_nan(name, x, d):
    """d, torch's input gradient (or f') of activation `name` at x, with the
    NaN that reprop documents where x is NaN."""
    return torch.where(x.isnan(), math.nan, d) if name in NAN_DERIVATIVE_AT_NAN else d


def check_against_torch(name, x, grad, units=2):
    """Values and input gradients of reprop's activation `name` against
    torch's (same dtype) and float64."""
    ours, _, kw = ACTIVATIONS[name]
    y, gx = values_and_grads(lambda t: ours(t, **kw), x, grad)
    check_results_against_torch(name, x, grad, y, gx, units)


def check_results_against_torch(name, x, grad, y, gx, units=2):
    """reprop's values y and input gradients gx of activation `name` at x
    (for upstream gradient grad) against torch's (same dtype) and float64."""
    _, ref, kw = ACTIVATIONS[name]
    y_ref, gx_ref = values_and_grads(lambda t: ref(t, **kw), x, grad)
    y_64, d_64 = values_and_grads(lambda t: ref(t, **kw), x.double(), torch.ones_like(x, dtype=torch.float64))
    gx_ref, d_64 = nan_derivative_at_nan(name, x, gx_ref), nan_derivative_at_nan(name, x, d_64)
    assert y.dtype == x.dtype and gx.dtype == x.dtype and y.shape == x.shape == gx.shape
    value_terms = cancelling_terms(CANCELLING_VALUE, name, x)
    check_accuracy(y, y_ref, y_64, value_terms, units)
    if x.element_size() == 2 and name not in TORCH_COMPOSITE:
        check_rounded_like_torch(y, y_ref, value_terms == 0)
    g64 = grad.double()
    check_accuracy(gx, gx_ref, g64 * d_64,
                   g64.abs() * cancelling_terms(CANCELLING_DERIVATIVE, name, x), units)


# ---------------------------------------------------------------------------
# Values and gradients against torch
# ---------------------------------------------------------------------------


def test_matches_torch_past_a_chunk():
    """Past csrc/fad.c's chunks of 16384 elements (a full one and a tail of
    37): every element against torch's. The
    other value tests stay within one chunk, and test_thread_count_does_not_change_a_bit
    compares thread counts only: a chunk's last element left unwritten
    showed there only as uninitialized memory that happened to differ."""
    x = sample("cpu", torch.float32, n=(1 << 14) + 37)
    check_against_torch("gelu", x, torch.randn(x.shape, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_matches_torch(name, dtype, device):
    x = sample(device, dtype)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    check_against_torch(name, x, grad)


# x in [-80, -13], where these activations' f' (and, but for ELU and SELU, f)
# are 2e-6 down to 1e-35 and no float32 formula cancels or underflows: relative
# accuracy to float64, whatever torch's. (GELU and Tanh's f' cancel to 0 there
# in float32, in torch's formulas too; LogSigmoid's tiny terms are added to
# numbers near x and 1, below their last bit.)
TAIL_ACTIVATIONS = ["sigmoid", "silu", "mish", "softplus", "elu", "selu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", TAIL_ACTIVATIONS)
def test_negative_tail_to_float64(name, device):
    """Values and derivatives as small as 1e-35 keep float32's relative
    accuracy (measured within 1.7e-7, a few ulp): 1e-6 relative, no absolute
    slack, so a result flushed to 0 or off by a few percent fails."""
    ours, ref, kw = ACTIVATIONS[name]
    x = torch.linspace(-80, -13, 269, device=device)
    x_64 = x.double()
    y, d = values_and_grads(lambda t: ours(t, **kw), x, torch.ones_like(x))
    y_64, d_64 = values_and_grads(lambda t: ref(t, **kw), x_64, torch.ones_like(x_64))
    torch.testing.assert_close(y.double(), y_64, rtol=1e-6, atol=0)
    torch.testing.assert_close(d.double(), d_64, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gelu", "silu", "elu", "hardswish"])
def test_layouts_and_empty(name, device):
    ours, ref, kw = ACTIVATIONS[name]
    base = torch.randn(4, 6, 5, 3, device=device)
    cases = {
        "transposed": base.transpose(1, 3),                           # dense, not contiguous
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "strided": base[:, ::2, 1:, :],                               # not dense
        "expanded": torch.randn(5, 1, device=device).expand(5, 7),
        "empty": torch.empty(0, 3, device=device),
        "scalar": torch.tensor(0.7, device=device),
    }
    for x in cases.values():
        check_against_torch(name, x, torch.randn(x.shape, device=device))
    # a dense input keeps its layout (strides), like torch's own activations
    for x in (cases["channels_last"], cases["transposed"], base.permute(2, 0, 3, 1),
              torch.randn(5, 7, device=device).t()):
        leaf = x.detach().requires_grad_()
        y = ours(leaf, saved_dtype=torch.uint8, **kw)
        assert y.stride() == ref(x, **kw).stride()
        (gx,) = torch.autograd.grad(y, leaf, torch.ones_like(y))
        assert gx.stride() == leaf.stride()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["silu", "mish", "elu", "celu", "selu", "leaky_relu", "hardswish",
                                  "hardsigmoid"])
def test_inplace(name, device):
    ours, ref, kw = ACTIVATIONS[name]
    x0 = torch.randn(64, 33, device=device)
    grad = torch.randn_like(x0)
    leaf = x0.clone().requires_grad_()
    h = leaf * 1.0
    version = h._version
    y = ours(h, inplace=True, **kw)
    assert y is h and h._version > version
    (gx,) = torch.autograd.grad(y, leaf, grad)
    y_out, gx_out = values_and_grads(lambda t: ours(t, **kw), x0, grad)
    assert torch.equal(y.detach(), y_out) and torch.equal(gx, gx_out)  # same as out of place
    # non-dense in place: written back through a copy
    z = torch.randn(8, 10, device=device)
    want = ours(z.clone(), **kw)[:, ::2]
    ours(z[:, ::2], inplace=True, **kw)
    assert torch.equal(z[:, ::2], want)


# ---------------------------------------------------------------------------
# What is saved for backward
# ---------------------------------------------------------------------------


class LiveSaved:
    """Tensors packed for backward that are still alive: each pack is recorded
    by weak reference, so a node that has been freed no longer counts."""

    def __init__(self):
        self.refs = []

    def pack(self, t):
        if t.numel():  # (LeakyReLU's and Hardsigmoid's empty anchor: fad._twice_differentiable)
            self.refs.append(weakref.ref(t))
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def live(self):
        return [t for t in (r() for r in self.refs) if t is not None]

    def live_bytes(self):
        seen, total = set(), 0
        for t in self.live():
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total


@pytest.mark.parametrize("saved_dtype", [None, torch.bfloat16, torch.float16, torch.uint8], ids=str)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_saves_only_the_derivative(name, saved_dtype):
    ours, ref, kw = ACTIVATIONS[name]
    x = torch.randn(32, 16, requires_grad=True)
    h = x * 1.0
    with LiveSaved() as saved:
        y = ours(h, saved_dtype=saved_dtype, **kw)
    assert [t.shape for t in saved.live()] == [h.shape]
    assert saved.live()[0].dtype == (saved_dtype or torch.float32)
    assert saved.live()[0].data_ptr() not in (h.data_ptr(), y.data_ptr())
    # the input is free to go: nothing of reprop's holds it
    probe = weakref.ref(h)
    del h
    assert probe() is None
    y.sum().backward()


def test_native_baseline_saves_input():
    """The baseline the issue states: torch's native activations save one input-sized tensor."""
    x = torch.randn(32, 16, requires_grad=True)
    for fn in (F.gelu, F.silu, F.mish, F.softplus, F.elu, F.hardswish):
        with LiveSaved() as saved:
            y = fn(x * 1.0)
        assert saved.live_bytes() == x.numel() * 4, fn
        del y


@pytest.mark.parametrize("saved_dtype", [None, torch.uint8], ids=str)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_an_expanded_input_saves_no_more_than_torch(name, saved_dtype):
    """An input that repeats its elements without memory of its own (a bias
    expanded over batch and positions) is what torch's op saves, its few
    bytes; FAD saved one f' per element (32 times torch's bytes here). It
    saves the distinct elements' f', expanded: the output and gradients of
    the same input made dense."""
    ours, _, kw = ACTIVATIONS[name]
    bias = torch.randn(16, 1, requires_grad=True)
    with LiveSaved() as saved:
        y = ours(bias.expand(4, 16, 8), saved_dtype=saved_dtype, **kw)
    assert saved.live_bytes() <= bias.numel() * bias.element_size(), saved.live_bytes()
    dense = ours(bias.expand(4, 16, 8).contiguous(), saved_dtype=saved_dtype, **kw)
    assert torch.equal(y, dense) and y.stride() == dense.stride()
    g = torch.randn(4, 16, 8)
    (grad,), (grad_dense,) = torch.autograd.grad(y, bias, g), torch.autograd.grad(dense, bias, g)
    torch.testing.assert_close(grad, grad_dense, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Derivative storage
# ---------------------------------------------------------------------------


def exact_derivative(name, x):
    """f'(x) from torch's autograd in float64."""
    _, ref, kw = ACTIVATIONS[name]
    x = x.double().detach().requires_grad_()
    (d,) = torch.autograd.grad(ref(x, **kw).sum(), x)
    return d


@pytest.mark.parametrize("saved_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_16bit_storage_error(name, saved_dtype):
    ours, _, kw = ACTIVATIONS[name]
    x = torch.randn(8192) * 4
    grad = torch.ones_like(x)
    _, gx = values_and_grads(lambda t: ours(t, saved_dtype=saved_dtype, **kw), x, grad)
    want = exact_derivative(name, x)
    # one rounding of f'(x) to saved_dtype, plus the float32 noise
    tol = torch.finfo(saved_dtype).eps / 2 * want.abs() + 1e-6 * (1 + x.double().abs())
    assert ((gx.double() - want).abs() <= tol).all()


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_bfloat16_input_with_float16_derivative_rounds_the_product_once(name):
    """bfloat16 x, saved_dtype=torch.float16: backward's grad * d promotes
    the pair to float32 (torch.promote_types), where the product of an 8-
    and an 11-bit significand is exact, and rounds it once to bfloat16. No
    rounding of d to bfloat16 on the way: that second rounding would move
    some elements by an ulp (asserted below, so this test can tell them
    apart). Sizes around the kernels' vector widths and block, for tails."""
    ours, _, kw = ACTIVATIONS[name]
    torch.manual_seed(0)
    for n in (1, 7, 17, 33, 511, 513, 4097):
        x = (torch.randn(n) * 3).bfloat16().requires_grad_()
        g = torch.randn(n).bfloat16()
        with LiveSaved() as saved:
            y = ours(x, **kw, saved_dtype=torch.float16)
        (d,) = saved.live()
        (gx,) = torch.autograd.grad(y, x, g)
        assert d.dtype == torch.float16 and gx.dtype == torch.bfloat16
        assert torch.equal(gx, (g.float() * d.float()).bfloat16()), (name, n)
        if n == 4097 and name not in ("leaky_relu", "hardsigmoid"):  # (f' exact in bfloat16)
            assert not torch.equal(gx, (g.float() * d.bfloat16().float()).bfloat16())


def _mixed16_operands(n, grad_dtype, seed=0):
    """n gradients of grad_dtype and n derivatives of the other 16-bit dtype:
    random values across both formats' exponent ranges, then (cycled) the
    special ones: NaN, +-inf, +-0, the smallest subnormals and normals of
    both formats, products that overflow grad_dtype (and float32), that
    underflow float32, and ties of grad_dtype's rounding both ways."""
    d_dtype = torch.float16 if grad_dtype is torch.bfloat16 else torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen))).to(grad_dtype)
    d = (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 15, (n,), generator=gen))).to(d_dtype)
    nan, inf = float("nan"), float("inf")
    tie = 1 + 2.0 ** -8 if grad_dtype is torch.bfloat16 else 1 + 2.0 ** -11  # halfway: to even 1
    tie_up = 1 + 3 * 2.0 ** -8 if grad_dtype is torch.bfloat16 else 1 + 3 * 2.0 ** -11  # to even, up
    pairs = [(nan, 1.0), (1.0, nan), (-nan, -2.0), (inf, 0.0), (inf, -1.0), (-inf, 3.0), (inf, inf),
             (-0.0, 5.0), (0.0, -5.0), (-0.0, -0.0), (2.0 ** -24, 1.0), (1.0, 2.0 ** -24),
             (2.0 ** -133, 1.0), (1.0, 2.0 ** -133), (2.0 ** -126, 0.5), (2.0 ** -14, 0.5),
             (2.0 ** -133, 2.0 ** -24), (3e38, 60000.0), (60000.0, 3e38), (65504.0, 2.0), (300.0, 300.0),
             (-3e38, 2.0), (tie, 1.0), (1.0, tie), (tie_up, 1.0), (1.0, tie_up), (1.5, 1 + 2.0 ** -7),
             (1 + 2.0 ** -7, 1 + 2.0 ** -10)]
    special_g = torch.tensor([a for a, _ in pairs]).to(grad_dtype)
    special_d = torch.tensor([b for _, b in pairs]).to(d_dtype)
    k = min(n, len(pairs))
    g[:k], d[:k] = special_g[:k], special_d[:k]
    if n > 2 * len(pairs):  # the specials again past the first vector blocks, at an odd offset
        g[-len(pairs) - 3:-3], d[-len(pairs) - 3:-3] = special_g, special_d
    return g, d


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 4097, 100003])
def test_mixed_16bit_backward_kernel_gives_torchs_bits(grad_dtype, n):
    """fad._times_saved's kernel for a 16-bit gradient times a derivative of
    the other 16-bit dtype: the bits of torch's float32 product cast to the
    gradient's dtype, across vector tails and the special values, on one
    and two threads (OpenMP over chunks past 32768 elements). A bfloat16
    NaN too: torch's CPU cast gives 0xffff for every NaN. A float16 NaN is
    a NaN only: torch's float16 -> float32 conversion gives NaN a payload
    of all ones in its scalar tail (a float16 NaN times 1 then casts to
    0x7fff) and none in its vector body (0x7e00), by position."""
    g, d = _mixed16_operands(n, grad_dtype)
    want = (g.float() * d.float()).to(grad_dtype)
    for threads in (1, 2):
        with torch_threads(threads), torch.no_grad():
            got = fad._times_saved(g, d, grad_dtype)
        assert got.dtype == grad_dtype and got.shape == g.shape
        assert torch.equal(got.isnan(), want.isnan())
        nan_free = (lambda t: t.nan_to_num(0.0)) if grad_dtype is torch.float16 else (lambda t: t)
        assert torch.equal(nan_free(got).view(torch.int16), nan_free(want).view(torch.int16)), (n, threads)


def _backward_ops(fn):
    """The names of the aten ops fn() runs (the profiler's CPU events)."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.function_events}


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("how", ["function", "compose"])
def test_mixed_16bit_saved_derivative_backward_is_one_pass(x_dtype, how):
    """A bfloat16 x with saved_dtype=torch.float16 (or the reverse), through
    an activation's backward and a compose chain's: the product runs in
    the kernel, no torch multiply and cast (which made a float32 temporary
    of x's size and took 3.5 times the bfloat16-saved backward), with the
    bits of torch's product on contiguous, channels_last and transposed
    gradients and those of the torch path a strided gradient takes."""
    other = torch.float16 if x_dtype is torch.bfloat16 else torch.bfloat16
    torch.manual_seed(1)
    x0 = (torch.randn(2, 3, 17, 9) * 3).to(x_dtype)
    g, _ = _mixed16_operands(x0.numel(), x_dtype, seed=2)
    g = g.view(x0.shape)
    if how == "function":
        def run(x):
            return fad.silu(x, saved_dtype=other)
    else:
        def run(x):
            with fad.enabled(compose=True, saved_dtype=other):
                return x * torch.sigmoid(x)

    def grad_for(grad):
        x = x0.clone().requires_grad_()
        with LiveSaved() as saved:
            y = run(x)
        assert other in {t.dtype for t in saved.live()}
        return torch.autograd.grad(y, x, grad)[0]

    x = x0.clone().requires_grad_()
    with LiveSaved() as saved:
        y = run(x)
    d = next(t for t in saved.live() if t.dtype is other)
    ops = _backward_ops(lambda: torch.autograd.grad(y, x, g, retain_graph=True))
    assert not ops & {"aten::mul", "aten::to", "aten::_to_copy"}, ops
    got = torch.autograd.grad(y, x, g)[0]
    assert got.dtype == x_dtype
    if how == "function":
        assert torch.equal(got.view(torch.int16), (g.float() * d.float()).to(x_dtype).view(torch.int16))
    strided = torch.empty(g.shape + (2,), dtype=x_dtype)[..., 0].copy_(g)  # the torch path
    for grad in (g.contiguous(memory_format=torch.channels_last), g.transpose(2, 3).contiguous().transpose(2, 3),
                 strided):
        assert torch.equal(grad_for(grad).view(torch.int16), got.view(torch.int16))


# f' beyond float16's 65504: (function, torch's, parameter, x)
FLOAT16_WIDE = {
    "celu_negative_alpha": (fad.celu, F.celu, -0.5, [-6.0, -5.8, -1.0, 2.0]),
    "elu_large_alpha": (fad.elu, F.elu, 1e5, [-1e-3, -2e-3, -20.0, 2.0]),
    "leaky_relu_large_slope": (fad.leaky_relu, F.leaky_relu, 1e5, [-1e-3, -2e-3, -1.0, 2.0]),
    # |f'| past 65504 with a negative parameter: d = -99900 is -inf in float16
    "elu_large_negative_alpha": (fad.elu, F.elu, -1e5, [-1e-3, -2e-3, -20.0, 2.0]),
    "leaky_relu_large_negative_slope": (fad.leaky_relu, F.leaky_relu, -1e5, [-1e-3, -2e-3, -1.0, 2.0]),
}


@pytest.mark.parametrize("how", ["function", "enabled"])
@pytest.mark.parametrize("name", sorted(FLOAT16_WIDE))
def test_float16_default_storage_of_a_derivative_beyond_its_range(name, how):
    """float16 input, saved_dtype None: where the parameters let f' pass
    65504, d is saved in float32, so the gradient is torch's (finite, not
    inf, and not NaN from a zero gradient times inf); others stay float16."""
    ours, ref, param, values = FLOAT16_WIDE[name]
    x = torch.tensor(values, dtype=torch.float16)
    grad = torch.tensor([1e-3, 0.0, 1e-3, 1.0], dtype=torch.float16)
    call = {"function": lambda t: ours(t, param), "enabled": lambda t: ref(t, param)}[how]
    mode = fad.enabled() if how == "enabled" else contextlib.nullcontext()

    def saved_dtypes_and_grad(fn):
        leaf = x.clone().requires_grad_()
        with LiveSaved() as saved, mode:
            y = fn(leaf)
        return [t.dtype for t in saved.live()], torch.autograd.grad(y, leaf, grad)[0]

    saved, gx = saved_dtypes_and_grad(call)
    _, gx_ref = values_and_grads(lambda t: ref(t, param), x, grad)
    assert saved == [torch.float32] and gx.isfinite().all()
    torch.testing.assert_close(gx, gx_ref, rtol=2 * torch.finfo(torch.float16).eps, atol=0)
    assert saved_dtypes_and_grad(lambda t: ours(t, 1.5))[0] == [torch.float16]  # f' in range


# Tails where f' is below float16's normal numbers (README, saved_dtype).
FLOAT16_TAILS = {"gelu": [-5.0, -5.5], "silu": [-13.0, -17.0], "mish": [-13.0, -17.0],
                 "elu": [-11.0, -17.0], "softplus": [-11.0, -17.0]}


@pytest.mark.parametrize("name", sorted(FLOAT16_TAILS))
def test_float16_tails_under_loss_scaling(name):
    """float16 x, gradient 4096: an f' saved in float16 keeps few bits
    below 6.1e-5 (None: up to 100% off, as the README says), bfloat16 storage
    float32's range (within its 2^-8 rounding plus torch's own error)."""
    ours, ref, kw = ACTIVATIONS[name]
    x = torch.tensor(FLOAT16_TAILS[name], dtype=torch.float16)
    grad = torch.full_like(x, 4096.0)
    _, exact = values_and_grads(lambda t: ref(t, **kw), x.double(), grad.double())

    def error(fn):
        _, gx = values_and_grads(fn, x, grad)
        return ((gx.double() - exact) / exact).abs().max().item()

    torch_error = error(lambda t: ref(t, **kw))
    assert error(lambda t: ours(t, **kw, saved_dtype=torch.bfloat16)) < torch_error + 2 ** -8
    # float16 subnormals: documented, bfloat16 advised
    assert error(lambda t: ours(t, **kw)) > torch_error + 2 ** -8


# The largest float16 x at which a float16 f' is 0 (below 3e-8, half its
# smallest subnormal; README, saved_dtype), and torch's float32 f' is not.
FLOAT16_ZERO_TAILS = {"gelu": -6.03515625, "elu": -17.34375,
                      "softplus": -17.34375, "selu": -17.90625, "silu": -20.296875,
                      "mish": -20.296875}


@pytest.mark.parametrize("name", sorted(FLOAT16_ZERO_TAILS))
def test_float16_derivative_is_zero_in_the_tails(name):
    """float16 x, saved_dtype None: from the README's x on, f' is 0, so the
    gradient is 0 where torch's is not and NaN from an infinite gradient
    where torch's is inf; one float16 step closer to 0, f' is not 0 yet.
    bfloat16 storage gives torch's infinities there."""
    ours, ref, kw = ACTIVATIONS[name]
    zero = torch.tensor(FLOAT16_ZERO_TAILS[name], dtype=torch.float16)
    x = torch.stack([torch.nextafter(zero, torch.zeros_like(zero)), zero])

    def grads(grad):
        return [values_and_grads(fn, x, torch.full_like(x, grad))[1]
                for fn in (lambda t: ref(t, **kw), lambda t: ours(t, **kw),
                           lambda t: ours(t, **kw, saved_dtype=torch.bfloat16))]

    torch_grad, grad, _ = grads(4096.0)
    assert (torch_grad != 0).all() and grad[0] != 0 and grad[1] == 0
    torch_grad, grad, bf16_grad = grads(math.inf)
    assert torch_grad.isinf().all() and torch.equal(bf16_grad, torch_grad)
    assert grad[0] == torch_grad[0] and grad[1].isnan()


# float16 x and upstream gradient whose exact input gradient lies within a
# rounding of float16's overflow (65520): (x, gradient, float64's, torch's)
FLOAT16_OVERFLOW_EDGE = {"gelu": (1.859375, 59552.0, 65519.04, 65504.0),
                         "mish": (1.005859375, 62400.0, 65526.83, math.inf)}


@pytest.mark.parametrize("name", sorted(FLOAT16_OVERFLOW_EDGE))
def test_float16_gradient_at_the_overflow_edge_rounds_once_more(name):
    """What README says of GradScaler's decisions under float16 with None:
    torch rounds g * f'(x) once, FAD f'(x) first, so at the overflow edge
    one input gradient is inf where torch's is 65504 (GELU) or 65504 where
    torch's is inf (Mish): a scaler's skip there can differ. float32 storage
    rounds once, as torch does."""
    ours, ref, kw = ACTIVATIONS[name]
    at, g, exact, want = FLOAT16_OVERFLOW_EDGE[name]
    x, grad = torch.tensor([at], dtype=torch.float16), torch.tensor([g], dtype=torch.float16)
    _, gx64 = values_and_grads(lambda t: ref(t, **kw), x.double(), grad.double())
    assert gx64.item() == pytest.approx(exact, abs=0.01)
    _, torch_grad = values_and_grads(lambda t: ref(t, **kw), x, grad)
    assert torch_grad.item() == want
    _, grad_none = values_and_grads(lambda t: ours(t, **kw), x, grad)
    assert grad_none.isinf().item() != math.isinf(want)
    _, grad_f32 = values_and_grads(lambda t: ours(t, **kw, saved_dtype=torch.float32), x, grad)
    assert torch.equal(grad_f32, torch_grad)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_8bit_storage_error_is_bounded(name):
    ours, _, kw = ACTIVATIONS[name]
    cb = fad.codebook(*CODEBOOK_ARGS[name])
    x = torch.cat([torch.randn(16384) * 4, torch.linspace(-30, 30, 6001), torch.tensor([0.0, -0.0])])
    grad = torch.randn_like(x)
    _, gx = values_and_grads(lambda t: ours(t, saved_dtype=torch.uint8, **kw), x, grad)
    want = exact_derivative(name, x)
    err = (gx.double() - grad.double() * want).abs()
    bound = grad.double().abs() * (cb.max_error * (1 + 1e-3)) + 1e-6 * grad.double().abs() * (1 + want.abs())
    assert (err <= bound).all(), f"max error {err.max().item()} > bound, step {cb.step}"
    assert 0.0 in cb.values  # flat regions decode to exactly zero


@pytest.mark.parametrize("name,slope_at", [("elu", 2.0), ("selu", 2.0), ("leaky_relu", 2.0),
                                           ("leaky_relu", -2.0), ("hardswish", 4.0),
                                           ("hardsigmoid", 0.5), ("hardsigmoid", 4.0),
                                           ("softplus_beta", 10.0)])
def test_8bit_exact_pieces(name, slope_at):
    """On an activation's constant-slope pieces the 8-bit gradient is exact."""
    ours, ref, kw = ACTIVATIONS[name]
    x = torch.full((16,), slope_at)
    grad = torch.randn(16)
    _, gx = values_and_grads(lambda t: ours(t, saved_dtype=torch.uint8, **kw), x, grad)
    _, gx_ref = values_and_grads(lambda t: ref(t, **kw), x, grad)
    assert torch.equal(gx, gx_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_backward_of_batched_gradients(dtype):
    """Gradients batched by vmap (autograd.grad(is_grads_batched=True),
    jacobian(vectorize=True), gradcheck's batched check) have no storage for
    the 8-bit kernel: they are decoded with torch's ops, with the kernel's
    values (before: 'Cannot access data pointer')."""
    ours, _, kw = ACTIVATIONS["gelu"]
    x = (torch.randn(64) * 3).to(dtype).requires_grad_()
    y = ours(x, saved_dtype=torch.uint8, **kw)
    grads = torch.randn(3, 64).to(dtype)
    (batched,) = torch.autograd.grad(y, x, grads, retain_graph=True, is_grads_batched=True)
    for row, g in zip(batched, grads):
        (one,) = torch.autograd.grad(y, x, g, retain_graph=True)
        torch.testing.assert_close(row, one, rtol=0, atol=0)


def test_8bit_nan_propagates():
    x = torch.tensor([math.nan, 1.0])
    _, gx = values_and_grads(lambda t: fad.gelu(t, saved_dtype=torch.uint8), x, torch.ones(2))
    assert gx[0].isnan() and gx[1].isfinite()


def test_codebook_rejects_unknown():
    with pytest.raises(ValueError, match="unknown activation"):
        fad.codebook("relu6")
    with pytest.raises(ValueError, match="at most 1 parameters"):
        fad.codebook("elu", 1.0, 2.0)


@pytest.mark.parametrize("name,params,message", [
    ("leaky_relu", (1e300,), "leaky_relu's negative_slope .* got 1e\\+300"),
    ("elu", (float("nan"),), "elu's alpha .* got nan"),
    ("softplus", (1.0, float("inf")), "softplus's threshold .* got inf"),
    ("celu", (1e-45,), "celu's alpha .*1 / alpha.* got 1e-45"),
    ("celu", (0.0,), "celu's alpha .*1 / alpha.* got 0.0"),
])
def test_codebook_refuses_parameters_the_functions_give_torch(name, params, message):
    """Parameters reprop.fad's functions hand to torch's op (_kernel_act) have
    no codebook: refused with the parameter's name and value as given. A
    leaky_relu slope of 1e300 said "got inf" (float32's rounding), a NaN
    alpha lacked "codebook:" and the name, and CELU's alpha 1e-45 (whose
    1 / alpha float32 cannot hold) gave a codebook fad.celu never uses."""
    with pytest.raises(ValueError, match="codebook: " + message):
        fad.codebook(name, *params)
    assert fad._kernel_act(name, *params) is None  # the functions run torch's op for them


@pytest.mark.parametrize("param", ["0.1", torch.tensor(0.1), None], ids=["str", "tensor", "none"])
def test_codebook_refuses_what_is_no_number_as_torch_does(param):
    """A parameter that is no number raises a TypeError, as torch's ops do
    (F.leaky_relu(x, "0.1")), and still the ValueError it raised before."""
    with pytest.raises(TypeError, match="^codebook: leaky_relu's negative_slope must be a number"):
        fad.codebook("leaky_relu", param)
    with pytest.raises(ValueError):
        fad.codebook("leaky_relu", param)


def test_codebook_defaults_are_the_functions():
    """codebook(name) describes what fad.<name>(x, saved_dtype=torch.uint8)
    stores at its default parameters (not at parameters of 0), and its
    max_error bounds the error seen."""
    x = torch.linspace(-6, 6, 20001)
    for name, params in [("elu", (1.0,)), ("celu", (1.0,)), ("softplus", (1.0, 20.0))]:
        default, explicit = fad.codebook(name), fad.codebook(name, *params)
        assert (default.lo, default.hi, default.step) == (explicit.lo, explicit.hi, explicit.step)
        assert np.array_equal(default.values, explicit.values, equal_nan=True)
        leaf = x.clone().requires_grad_()
        getattr(fad, name)(leaf, saved_dtype=torch.uint8).sum().backward()
        ref = x.clone().requires_grad_()
        getattr(F, name)(ref).sum().backward()
        assert (leaf.grad - ref.grad).abs().max() <= fad.codebook(name).max_error * (1 + 1e-6)


@pytest.mark.parametrize("name,params", [("leaky_relu", ()), ("leaky_relu", (-0.3,)),
                                         ("leaky_relu", (1e-31,)), ("leaky_relu", (-1e-35,)),
                                         ("leaky_relu", (1e-40,)), ("leaky_relu", (-1e-40,)),
                                         ("hardsigmoid", ())])
def test_codebook_two_valued_max_error(name, params):
    """LeakyReLU and Hardsigmoid store their two derivative values exactly
    (max_error 0) unless the slope is subnormal, and max_error is then the
    error the gradients show. A slope below 2^-102 (1e-31, 1e-35) decoded
    to 2^-102 or 0."""
    x = torch.cat([torch.linspace(-6, 6, 2001), torch.tensor([0.0, -0.0, 3.0, -3.0])])
    cb = fad.codebook(name, *params)
    leaf, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    getattr(fad, name)(leaf, *params, saved_dtype=torch.uint8).sum().backward()
    getattr(F, name)(ref, *params).sum().backward()
    err = (leaf.grad.double() - ref.grad.double()).abs().max().item()
    assert err == pytest.approx(cb.max_error, rel=1e-6, abs=0)
    assert cb.max_error == (0.0 if not params or abs(params[0]) > 1e-38 else pytest.approx(1e-40))


@pytest.mark.parametrize("alpha", [3.4e38, -3.4e38, 3.4028234e38])
def test_codebook_of_an_alpha_near_float_max(alpha):
    """ELU's derivative reaches alpha at x = -0: with |alpha| near FLT_MAX the
    widened, rounded-up grid ended past it and decoded inf (torch: alpha).
    The grid now stays finite, and the gradients within max_error."""
    cb = fad.codebook("elu", alpha)
    assert np.isfinite(cb.values[:254]).all() and np.isfinite(cb.step)
    assert cb.max_error == cb.step / 2
    x = torch.tensor([-0.0, -1e-7, -1.0, -30.0])
    leaf, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    fad.elu(leaf, alpha, saved_dtype=torch.uint8).sum().backward()
    F.elu(ref, alpha).sum().backward()
    assert (leaf.grad.double() - ref.grad.double()).abs().max() <= cb.max_error


@pytest.mark.parametrize("alpha", [-0.5, -2.0])
def test_codebook_of_a_grid_ending_at_zero(alpha):
    """ELU with alpha < 0 has f' in [alpha, 0]: its grid ends at 0, and
    codebook() reports that grid's step and half of it as max_error (the
    error the gradients show), not a step read past its last code."""
    cb = fad.codebook("elu", alpha)
    grid = np.unique(cb.values[:254])
    assert cb.step == pytest.approx(np.diff(grid).max(), rel=1e-6)
    assert cb.step == pytest.approx(abs(alpha) / 253, rel=0.01)
    assert cb.max_error == cb.step / 2
    x = torch.linspace(-10, 3, 100001)
    leaf = x.clone().requires_grad_()
    fad.elu(leaf, alpha, saved_dtype=torch.uint8).sum().backward()
    ref = x.double().requires_grad_()
    F.elu(ref, alpha).sum().backward()
    err = (leaf.grad.double() - ref.grad).abs().max().item()
    assert cb.max_error * 0.9 <= err <= cb.max_error * (1 + 1e-3)


def test_8bit_refuses_unbounded_derivative():
    """CELU with alpha < 0 has f'(x) = exp(x / alpha), unbounded as x -> -inf:
    no grid covers it, so 8-bit storage is refused (not clipped) by the
    function, a patched module, enabled()'s rerouting and codebook()."""
    x = torch.tensor([-1.0, -20.0], requires_grad=True)
    match = "saved_dtype=torch.uint8.*alpha < 0.*alpha=-5.0"
    with pytest.raises(ValueError, match=match):
        fad.celu(x, alpha=-5.0, saved_dtype=torch.uint8)
    model = nn.Sequential(nn.CELU(alpha=-5.0))
    fad.patch(model, saved_dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        model(x)
    with pytest.raises(ValueError, match=match), fad.enabled(saved_dtype=torch.uint8):
        F.celu(x, alpha=-5.0)
    with pytest.raises(ValueError, match="codebook: .*alpha < 0"):
        fad.codebook("celu", -0.5)
    # 16-bit storage rounds instead: relative error, no range
    y = fad.celu(x, alpha=-5.0, saved_dtype=torch.bfloat16)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.allclose(g, torch.exp(x.detach() / -5.0), rtol=2 ** -8)


@pytest.mark.parametrize("name,params", [("elu", (-0.5,)), ("elu", (-2.0,)),
                                         ("softplus", (-1.0, 20.0)), ("leaky_relu", (-3.0,))])
def test_8bit_negative_parameters_stay_bounded(name, params):
    """ELU (alpha e^x), Softplus (sigmoid(beta x)) and LeakyReLU keep a bounded
    f' for negative parameters: 8-bit storage is accepted, within max_error."""
    x = torch.cat([torch.linspace(-40, 40, 8001), torch.tensor([0.0, -0.0])])
    cb = fad.codebook(name, *params)
    leaf = x.clone().requires_grad_()
    getattr(fad, name)(leaf, *params, saved_dtype=torch.uint8).sum().backward()
    ref = x.double().requires_grad_()
    getattr(F, name)(ref, *params).sum().backward()
    err = (leaf.grad.double() - ref.grad).abs().max().item()
    assert err <= cb.max_error * (1 + 1e-3) + 1e-6


# ---------------------------------------------------------------------------
# Autograd modes, autocast, double backward
# ---------------------------------------------------------------------------


def _spy_on_d_stores(monkeypatch) -> list:
    """The d_store argument of every fad_forward call from now on (-1: no derivative asked for)."""
    calls = []
    real = fad._C

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def fad_forward(self, *args):
            calls.append(args[6])
            return real.fad_forward(*args)

    monkeypatch.setattr(fad, "_C", Spy())
    return calls


def test_no_grad_computes_no_derivative(monkeypatch):
    calls = _spy_on_d_stores(monkeypatch)
    x = torch.randn(100, requires_grad=True)
    with torch.no_grad():
        y = fad.gelu(x)
    assert y.grad_fn is None and calls == [-1]
    with torch.inference_mode():
        fad.silu(x)
    fad.mish(torch.randn(10))  # no input requires grad
    assert calls == [-1, -1, -1]
    fad.mish(x)
    assert calls[-1] == 0


@pytest.mark.parametrize("name", ["gelu", "silu", "softplus", "tanh"])
def test_autocast_follows_torch(name):
    ours, ref, kw = ACTIVATIONS[name]
    x = torch.randn(256, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w
        y, y_ref = ours(h, **kw), ref(h, **kw)
    assert y.dtype == y_ref.dtype
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 * torch.finfo(y.dtype).eps, atol=1e-3)
    (g,) = torch.autograd.grad(y.float().sum(), w, retain_graph=True)
    (g_ref,) = torch.autograd.grad(y_ref.float().sum(), w)
    assert (g - g_ref).norm() <= 0.01 * g_ref.norm()  # bf16 roundings in different places


# bfloat16/float16 autocast: where reprop's gradients part from torch's, and by how much.
# torch's CPU backward of an activation upcasts the 16-bit x and gradient,
# computes g * f'(x) in float32 and rounds once; FAD rounds f'(x) to its
# saved_dtype in the forward and rounds g * d once more in backward.


def _autocast_input_grad(act, h0: torch.Tensor, g: torch.Tensor, dtype: torch.dtype):
    """The gradient of a Linear's output h through act under CPU autocast
    (act(h) then a second Linear, as in a model), h0 the Linear's input."""
    torch.manual_seed(1)
    w1, w2 = torch.randn(h0.shape[1], 96) / 8, torch.randn(96, g.shape[1]) / 8
    if dtype is torch.float64:
        h = (h0.double() @ w1.double()).requires_grad_()
        (act(h) @ w2.double()).backward(g.double())
        return h.grad
    with torch.autocast("cpu", dtype=dtype):
        h = (h0 @ w1).detach().requires_grad_()
        out = act(h) @ w2
    out.backward(g.to(out.dtype))
    return h.grad


# one multiply rounded once from float32, as torch's kernel: bitwise where
# f'(x) is computed as torch computes it (GELU's erf differs from torch's by
# an ulp of float32 on a few elements, Softsign and Tanhshrink are several
# ops in torch, Sigmoid and Tanh use their output)
_BITWISE_IN_FLOAT32 = ["silu", "mish", "softplus", "elu", "celu", "selu", "leaky_relu", "hardswish",
                       "hardsigmoid"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", _BITWISE_IN_FLOAT32)
def test_autocast_gradient_with_float32_derivative_is_torchs_bit_for_bit(name, dtype):
    """With saved_dtype=torch.float32 the backward is torch's arithmetic:
    the 16-bit gradient times a float32 f'(x), rounded once (bfloat16: to
    the bit; float16: but for an element in a thousand, one ulp, where
    torch's float32 f'(x) differs from the kernels' in its last bit). So the only
    difference of the default (f' saved in x's dtype) is that rounding of
    f'(x), which the statistical test below bounds."""
    ours, ref, kw = ACTIVATIONS[name]
    torch.manual_seed(0)
    h0, g = torch.randn(64, 48) * 2, torch.randn(64, 32)
    ours32 = functools.partial(ours, **kw, saved_dtype=torch.float32)
    got = _autocast_input_grad(ours32, h0, g, dtype)
    want = _autocast_input_grad(functools.partial(ref, **kw), h0, g, dtype)
    assert got.dtype == want.dtype == dtype
    if dtype is torch.bfloat16:
        assert torch.equal(got, want)
    else:  # float16's finer grid meets the last float32 bit of f'(x) on a few elements
        torch.testing.assert_close(got, want, rtol=torch.finfo(dtype).eps, atol=0)
        assert (got != want).sum() <= got.numel() // 1000


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["gelu", "silu", "mish", "softplus", "elu", "hardswish"])
def test_autocast_gradient_error_against_float64_is_torchs_within_a_bound(name, dtype):
    """The default saved_dtype (x's dtype) rounds f'(x) before the multiply:
    against float64, the input gradient's relative L2 error is a little
    above torch's, never far: two roundings of the same relative size where
    torch has one (measured here, both dtypes: GELU, SiLU, Mish 1.11 to
    1.12 times torch's, Softplus 1.08, ELU, SELU, Hardswish 1.00 to 1.02).
    README (saved_dtype) has the figures."""
    ours, ref, kw = ACTIVATIONS[name]
    errors = {"ours": [], "torch": []}
    for seed in range(4):
        torch.manual_seed(seed)
        h0, g = torch.randn(128, 48) * 2, torch.randn(128, 64)
        exact = _autocast_input_grad(functools.partial(ref, **kw), h0, g, torch.float64)
        for who, fn in (("ours", ours), ("torch", ref)):
            got = _autocast_input_grad(functools.partial(fn, **kw), h0, g, dtype)
            errors[who].append(((got.double() - exact).norm() / exact.norm()).item())
    ratio = sum(errors["ours"]) / sum(errors["torch"])
    assert 0.95 < ratio < 1.15, (ratio, errors)


@pytest.mark.parametrize("how", ["function", "enabled"])
def test_double_backward_is_refused(how):
    """f''(x) is not kept. The advice names torch's own activation (and where
    it runs): under enabled() the code already calls torch.nn.functional's,
    which the old advice told the user to call."""
    x = torch.randn(10, requires_grad=True)
    if how == "function":
        y = fad.gelu(x)
    else:
        with fad.enabled():
            y = F.gelu(x)
    with pytest.raises(RuntimeError, match="differentiated twice") as refused:
        torch.autograd.grad(y.sum(), x, create_graph=True)
    assert "use torch's own activation" in str(refused.value)
    assert "outside reprop.fad.enabled()" in str(refused.value)


@pytest.mark.parametrize("call", ["jvp", "hessian"])
@pytest.mark.parametrize("how", ["patch", "compose"])
def test_old_functional_api_refusal_names_it_and_what_works(how, call):
    """torch.autograd.functional's jvp, hvp, vhp and hessian backpropagate
    twice (create_graph=True) without the user writing it, so the refusal's
    "(create_graph=True)" left them unexplained. It names them now and what
    works here, torch.func's and forward AD, which give torch's values."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 2))
    model = copy.deepcopy(ref)
    mode = contextlib.nullcontext()
    if how == "patch":
        assert fad.patch(model)
    else:
        mode = fad.enabled(compose=True)
    x = torch.randn(3, 4)
    f = (lambda t: model(t)) if call == "jvp" else (lambda t: model(t)[:, 0].exp().sum())
    with mode, pytest.raises(RuntimeError, match=r"differentiated twice .*torch\.autograd\.functional's "
                                                 r"jvp, hvp, vhp and hessian .*torch\.func\.jvp"):
        if call == "jvp":
            torch.autograd.functional.jvp(f, x, torch.ones_like(x))
        else:
            torch.autograd.functional.hessian(f, x[:1])
    with mode:
        got = torch.func.jvp(model, (x,), (torch.ones_like(x),))[1]
    torch.testing.assert_close(got, torch.func.jvp(ref, (x,), (torch.ones_like(x),))[1])


# Kinds whose f' is piecewise constant, with a torch reference that autograd
# differentiates twice (torch's hardsigmoid refuses it: relu6 is its formula).
_PIECEWISE_CONSTANT = {
    "leaky_relu": (lambda: nn.LeakyReLU(0.2), lambda: nn.LeakyReLU(0.2)),
    "leaky_relu_negative": (lambda: nn.LeakyReLU(-0.3), lambda: nn.LeakyReLU(-0.3)),
    "hardsigmoid": (nn.Hardsigmoid, lambda: _Relu6Hardsigmoid()),
}


class _Relu6Hardsigmoid(nn.Module):
    def forward(self, x):
        return F.relu6(x + 3) / 6


def _critic(act):
    """A WGAN-GP critic with activation `act`, seeded: the same weights per act."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 16), act(), nn.Linear(16, 16), act(), nn.Linear(16, 1))


def _assert_same_penalty_grads(got, want):
    """fad's penalty gradients against torch's, the first bias's zeros (reached
    only through the activations' masks: linked as torch's are, not None)."""
    assert not got[1].any()
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _penalty_grads_of(model, x, params, mode=contextlib.nullcontext()):
    """The gradients of a WGAN-GP penalty of model at x, for params and x."""
    with mode:
        out = model(x).sum()
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    penalty = ((g.norm(dim=1) - 1) ** 2).mean()
    return torch.autograd.grad(penalty, [*params, x], allow_unused=True)


@pytest.mark.parametrize("saved_dtype", [None, torch.uint8], ids=str)
@pytest.mark.parametrize("how", ["patch", "enabled"])
@pytest.mark.parametrize("name", sorted(_PIECEWISE_CONSTANT))
def test_double_backward_through_a_piecewise_constant_derivative(name, how, saved_dtype):
    """LeakyReLU and Hardsigmoid (f' piecewise constant, f'' 0) refused
    create_graph=True, so a WGAN-GP critic with LeakyReLU failed once
    patched. Now torch's gradients, the first layer's bias (reached only
    through the activations' masks) getting zeros, as in torch, not None."""
    ours_cls, ref_cls = _PIECEWISE_CONSTANT[name]

    model, ref = _critic(ours_cls), _critic(ref_cls)
    mode = contextlib.nullcontext()
    if how == "patch":
        assert fad.patch(model, saved_dtype=saved_dtype)
    else:
        mode = fad.enabled(saved_dtype=saved_dtype)
    x = torch.randn(64, 5) * 4
    got = _penalty_grads_of(model, x.clone().requires_grad_(), list(model.parameters()), mode)
    want = _penalty_grads_of(ref, x.clone().requires_grad_(), list(ref.parameters()))
    _assert_same_penalty_grads(got, want)


@pytest.mark.parametrize("how", ["function", "patch", "enabled"])
@pytest.mark.parametrize("name", sorted(_PIECEWISE_CONSTANT))
def test_double_backward_through_a_piecewise_constant_derivative_under_a_pack_hook(name, how):
    """As above under save_on_cpu (on the CPU its pack returns the tensor as
    it is), where the anchor is not the activation's output
    (fad._anchor_link): torch's gradients, the first bias's zeros."""
    ours_cls, ref_cls = _PIECEWISE_CONSTANT[name]

    model, ref = _critic(ours_cls), _critic(ref_cls)
    mode = contextlib.nullcontext()
    if how == "function":
        kw = {"negative_slope": model[1].negative_slope} if name.startswith("leaky") else {}
        function = getattr(fad, name.removesuffix("_negative"))
        model = nn.Sequential(model[0], _Lambda(lambda h: function(h, **kw)), model[2],
                              _Lambda(lambda h: function(h, **kw)), model[4])
    elif how == "patch":
        assert fad.patch(model)
    else:
        mode = fad.enabled()
    x = torch.randn(64, 5) * 4
    with torch.autograd.graph.save_on_cpu():
        got = _penalty_grads_of(model, x.clone().requires_grad_(), list(model.parameters()), mode)
        want = _penalty_grads_of(ref, x.clone().requires_grad_(), list(ref.parameters()))
    _assert_same_penalty_grads(got, want)


class _Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("pack", ["as_is", "handle", "copy"])
@pytest.mark.parametrize("how", ["function", "module", "enabled", "in place"])
@pytest.mark.parametrize("name", ["leaky_relu", "hardsigmoid"])
def test_piecewise_constant_graph_dropped_under_a_pack_hook_keeps_nothing(name, how, pack):
    """fad.leaky_relu and fad.hardsigmoid under a pack hook whose result
    holds what it packs (save_on_cpu's on the CPU), the graph dropped
    without backward (an evaluation in grad mode): before, the empty anchor
    saved for double backward was the node's own output, which held the
    node, a cycle gc cannot see, and each step kept the derivative (x's
    size) for good (4 of 4 after gc.collect()). Now freed with the graph."""
    pack_hook, unpack_hook = _PACKS[pack]
    lin = nn.Linear(16, 16)
    function = getattr(fad, name)
    call = {"function": function,
            "module": fad.LeakyReLU(0.1) if name == "leaky_relu" else fad.Hardsigmoid(),
            "enabled": getattr(F, name),
            "in place": lambda h: function(h, inplace=True)}[how]
    packed = []

    def keep(t):
        p = pack_hook(t)
        packed.append(weakref.ref(unpack_hook(p)))
        return p

    for _ in range(4):
        with torch.autograd.graph.saved_tensors_hooks(keep, unpack_hook), \
                (fad.enabled() if how == "enabled" else contextlib.nullcontext()):
            loss = call(lin(torch.linspace(-2, 2, 128).reshape(8, 16)) * 1).sum()
        del loss
    assert len(packed) >= 8
    gc.collect()
    assert [tuple(r().shape) for r in packed if r() is not None] == []


@pytest.mark.parametrize("how", ["patch", "enabled"])
@pytest.mark.parametrize("name", sorted(_PIECEWISE_CONSTANT))
def test_node_hooks_of_a_piecewise_constant_kind_see_one_output_as_torchs(name, how):
    """The node of LeakyReLU and Hardsigmoid has a second, empty output (the
    anchor of _twice_differentiable), so hooks on y.grad_fn got two
    grad_outputs where torch's node gives one: a pre-hook returning its
    replacement as torch's takes it, (g * 3,), raised "incorrect number of
    values (got 1, but expected 2)", and a post-hook saw (g, None). They see
    and return torch's one gradient now, and a wrong count is refused as
    torch refuses it."""
    torch_cls = _PIECEWISE_CONSTANT[name][0]  # torch's module, patched or rerouted below
    x = torch.randn(64) * 4

    def run(act, mode=contextlib.nullcontext()):
        t = x.clone().requires_grad_()
        with mode:
            y = act(t)
        seen = []
        y.grad_fn.register_prehook(lambda go: seen.append(len(go)) or (go[0] * 3,))
        y.grad_fn.register_hook(lambda gi, go: seen.append((len(gi), len(go), torch.equal(go[0], 3 * x.sign()))))
        y.backward(x.sign())
        return t.grad, seen

    model = nn.Sequential(torch_cls())
    mode = contextlib.nullcontext()
    if how == "patch":
        assert fad.patch(model)
    else:
        mode = fad.enabled()
    got, seen = run(model, mode)
    want, want_seen = run(torch_cls())
    assert seen == want_seen == [1, (1, 1, True)]
    torch.testing.assert_close(got, want)
    t = x.clone().requires_grad_()
    with mode:
        y = model(t)
    assert type(y.grad_fn).__name__ == "_ActivationBackward"
    y.grad_fn.register_prehook(lambda go: (go[0], go[0]))
    with pytest.raises(RuntimeError, match=r"incorrect number of values \(got 2, but expected 1\)"):
        y.sum().backward()


@pytest.mark.parametrize("how", ["patch", "enabled"])
@pytest.mark.parametrize("name", sorted(_PIECEWISE_CONSTANT))
def test_node_hooks_of_a_piecewise_constant_kind_do_not_fire_for_the_anchor(name, how):
    """In double backward (a WGAN-GP penalty) the node of LeakyReLU and
    Hardsigmoid runs again for its anchor's gradient alone, where torch's
    node does not run: the hooks on y.grad_fn were called once more with
    (None,), and a pre-hook (g * 3,) raised TypeError (NoneType * int)
    where torch trains. They fire once, as torch's, and the penalty's
    gradients are torch's (the first bias's zeros)."""
    ours_cls, ref_cls = _PIECEWISE_CONSTANT[name]
    x = torch.randn(16, 4) * 4

    def penalty_grads(act, fused):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 6), act(), nn.Linear(6, 1))
        mode = contextlib.nullcontext()
        if fused and how == "patch":
            assert fad.patch(model)
        elif fused:
            mode = fad.enabled()
        t = x.clone().requires_grad_()
        with mode:
            y = model[1](model[0](t))
            out = model[2](y).sum()
        seen = []
        y.grad_fn.register_prehook(lambda go: seen.append(("pre", go[0] is None)) or (go[0] * 3,))
        y.grad_fn.register_hook(lambda gi, go: seen.append(("post", gi[0] is None, go[0] is None)))
        (g,) = torch.autograd.grad(out, t, create_graph=True)
        penalty = ((g.norm(dim=1) - 1) ** 2).mean()
        return seen, torch.autograd.grad(penalty, [*model.parameters(), t], allow_unused=True)

    seen, got = penalty_grads(ours_cls, True)
    want_seen, want = penalty_grads(ref_cls, False)
    assert seen == want_seen == [("pre", False), ("post", False, False)]
    _assert_same_penalty_grads(got, want)


def _unknown_named_hook(go, count):
    return (go[0],) * count


@pytest.mark.parametrize("how", ["patch", "enabled"])
@pytest.mark.parametrize("name", sorted(_PIECEWISE_CONSTANT))
def test_node_hooks_of_a_piecewise_constant_kind_are_refused_as_torchs(name, how):
    """What torch refuses of a hook on its node is refused alike on the node
    of LeakyReLU and Hardsigmoid: a pre-hook returning a list (torch: "expected
    tuple, but hook returned 'list'") trained with the list's value, and a
    wrong count from a hook with no __name__ (a functools.partial) named it
    by its repr where torch says '<unknown>'."""
    torch_cls = _PIECEWISE_CONSTANT[name][0]  # torch's module, patched or rerouted below
    hooks = {
        "list": lambda go: [go[0] * 3],
        "partial_count": functools.partial(_unknown_named_hook, count=2),
        "size": lambda go: (go[0][:1],),
        "size_unknown": functools.partial(lambda go: (go[0][:1],)),
        "post_list": lambda gi, go: [gi[0] * 3],
        "post_count_unknown": functools.partial(lambda gi, go: (gi[0], gi[0])),
    }

    def error_of(act, fused, key):
        model = nn.Sequential(act())
        mode = contextlib.nullcontext()
        if fused and how == "patch":
            assert fad.patch(model)
        elif fused:
            mode = fad.enabled()
        t = torch.randn(8, requires_grad=True)
        with mode:
            y = model(t)
        if key.startswith("post"):
            y.grad_fn.register_hook(hooks[key])
        else:
            y.grad_fn.register_prehook(hooks[key])
        try:
            y.sum().backward()
        except (TypeError, RuntimeError) as e:
            return type(e), str(e)
        return None

    for key in hooks:
        want = error_of(torch_cls, False, key)
        assert want is not None, key
        assert error_of(torch_cls, True, key) == want, key
    assert error_of(torch_cls, True, "list") == (TypeError, "expected tuple, but hook returned 'list'")
    assert "'<unknown>'" in error_of(torch_cls, True, "partial_count")[1]


@pytest.mark.parametrize("how", ["function", "patch", "enabled"])
@pytest.mark.parametrize("name", sorted(_PIECEWISE_CONSTANT))
def test_post_hook_of_a_piecewise_constant_kind_under_a_pack_hook_sees_one_input(name, how):
    """Under a saved-tensor hook the node of LeakyReLU and Hardsigmoid takes
    a second input (fad._anchor_link's), so a post-hook on y.grad_fn saw two
    grad_inputs, (g, None), and returning its replacement as on torch's node,
    (g * 3,), raised "incorrect number of values (got 1, but expected 2)". It
    sees and returns torch's one, and x's gradient is torch's."""
    torch_cls = _PIECEWISE_CONSTANT[name][0]  # torch's module, patched or rerouted below
    x = torch.randn(64) * 4

    def run(act, fused):
        mode = contextlib.nullcontext()
        if fused and how == "function":
            act = {"leaky_relu": functools.partial(fad.leaky_relu, negative_slope=0.2),
                   "leaky_relu_negative": functools.partial(fad.leaky_relu, negative_slope=-0.3),
                   "hardsigmoid": fad.hardsigmoid}[name]
        else:
            act = nn.Sequential(act())
            if fused and how == "patch":
                assert fad.patch(act)
            elif fused:
                mode = fad.enabled()
        t = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda p: p, lambda p: p), mode:
            y = act(t)
        seen = []
        y.grad_fn.register_hook(lambda gi, go: seen.append((len(gi), len(go))) or (gi[0] * 3,))
        y.backward(x.sign())
        return t.grad, seen

    got, seen = run(torch_cls, True)
    want, want_seen = run(torch_cls, False)
    assert seen == want_seen == [(1, 1)]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("how", ["function", "enabled", "compose"])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_a_none_gradient_from_a_node_pre_hook_stays_none(name, how):
    """A pre-hook on the activation's node returning (None,) left torch's
    parameters before it with .grad None, but fad's node materialized the
    gradient as zeros, so they got zeros (and an optimizer stepped their
    momentum and weight decay where eager skips them). None now, as in
    torch, for the activations' node and a composed chain's."""
    ours, ref, kwargs = ACTIVATIONS[name]

    def grads(act, mode=contextlib.nullcontext()):
        torch.manual_seed(0)
        lin = nn.Linear(4, 8)
        with mode:
            y = act(lin(torch.randn(3, 4)), **kwargs)
        y.grad_fn.register_prehook(lambda go: (None,))
        y.sum().backward()
        return type(y.grad_fn).__name__, lin.weight.grad, lin.bias.grad

    if how == "function":
        node, *got = grads(ours)
    else:
        node, *got = grads(ref, fad.enabled(compose=how == "compose"))
    want = grads(ref)[1:]
    assert list(want) == [None, None]
    assert got == [None, None], node
    if how != "enabled" or ours not in (fad.sigmoid, fad.tanh):  # (enabled() leaves these to torch)
        assert node in ("_ActivationBackward", "_ChainBackward")


@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double")
def test_gradcheck_in_float32():
    """Finite differences as an independent check of f' (float32: loose tolerances)."""
    for name, (ours, _, kw) in ACTIVATIONS.items():
        x = torch.linspace(-3.95, 4.05, 17).requires_grad_()  # off the kinks at 0, +-3, 2.5
        assert torch.autograd.gradcheck(lambda t: ours(t, **kw), (x,), eps=1e-3, atol=2e-3,
                                        rtol=2e-2), name


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def test_float64_runs_torch_ops():
    """float64 input runs torch's own op in the functions and patched
    modules, as under enabled(): float64 gradients, and gradcheck passes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 5), nn.ELU(alpha=0.7),
                          nn.Linear(5, 3), nn.Mish()).double()
    plain = copy.deepcopy(model)
    fad.patch(model, saved_dtype=torch.uint8)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(model, (x,))
    out, ref = model(x), plain(x)
    assert out.dtype == torch.float64 and torch.equal(out, ref)
    grads = torch.autograd.grad(out.sum(), [x, *model.parameters()])
    refs = torch.autograd.grad(ref.sum(), [x, *plain.parameters()])
    assert all(torch.equal(g, r) for g, r in zip(grads, refs))
    t = torch.randn(5, dtype=torch.float64)
    assert torch.equal(fad.silu(t.clone(), inplace=True), F.silu(t))
    assert torch.equal(fad.softplus(t, -2.0, 3.0), F.softplus(t, -2.0, 3.0))


# Non-strided input: torch computes mkldnn GELU and sparse Tanhshrink, and
# refuses the others with its own errors.
NON_STRIDED = {
    "gelu_mkldnn": (F.gelu, nn.GELU, torch.Tensor.to_mkldnn),
    "tanhshrink_sparse": (F.tanhshrink, nn.Tanhshrink, torch.Tensor.to_sparse),
    "silu_sparse": (F.silu, nn.SiLU, torch.Tensor.to_sparse),
    "softplus_mkldnn": (F.softplus, nn.Softplus, torch.Tensor.to_mkldnn),
    "elu_csr": (F.elu, nn.ELU, torch.Tensor.to_sparse_csr),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("how", ["function", "patched", "enabled"])
@pytest.mark.parametrize("case", sorted(NON_STRIDED))
def test_non_strided_layouts_run_torch(case, how):
    """Sparse and mkldnn input, which torch's op takes or refuses itself (and
    enabled() hands it on), was refused by the functions and patched
    modules as "sparse tensors are not supported" (mkldnn included): they
    run torch's op, as for float64."""
    native, module, convert = NON_STRIDED[case]
    act = native if how == "enabled" else getattr(fad, native.__name__)
    if how == "patched":
        act = nn.Sequential(module())
        fad.patch(act)
        assert type(act[0]).__module__ == "reprop.fad"
    mode = fad.enabled() if how == "enabled" else contextlib.nullcontext()

    def outcome(act, mode):
        """(layout, dense value) of act(x), or (exception type, message)."""
        x = convert(torch.linspace(-3.0, 3.0, 32).reshape(4, 8))
        try:
            with mode:
                y = act(x)
        except Exception as e:  # noqa: BLE001 - compared with torch's
            return type(e), str(e)
        return y.layout, y.to_dense()

    got, ref = outcome(act, mode), outcome(native, contextlib.nullcontext())
    assert got[0] == ref[0]
    assert got[1] == ref[1] if isinstance(ref[0], type) else torch.equal(got[1], ref[1])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_refusal_of_a_non_strided_layout_calls_only_sparse_ones_sparse():
    """_tensors.check_strided (what refused fad's mkldnn input, and still
    refuses one in bppsa and the optimizers) called mkldnn tensors sparse."""
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match=r"^x: non-strided tensors are not supported "
                                           r"\(got layout torch._mkldnn\)$"):
        _tensors.check_strided(x.to_mkldnn(), "x")
    for sparse in (x.to_sparse(), x.to_sparse_csr()):
        with pytest.raises(RuntimeError, match=r"^x: sparse tensors are not supported "
                                               rf"\(got layout {sparse.layout}\)$"):
            _tensors.check_strided(sparse, "x")


def test_inplace_on_inference_tensor_is_refused_as_torch():
    with torch.inference_mode():
        t = torch.randn(3)
    before = t.clone()
    with pytest.raises(RuntimeError, match="elu: inplace update to inference tensor"):
        fad.elu(t, inplace=True)
    assert torch.equal(t, before)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        F.elu(t, inplace=True)  # (torch 2.13 has written t by then)
    with torch.inference_mode():  # inside inference_mode both write it
        assert torch.equal(fad.elu(t.clone(), inplace=True), F.elu(t))


def leaf_parameter():
    p = nn.Parameter(torch.randn(2, 4))
    return p, p


def view_of_leaf():
    p = nn.Parameter(torch.randn(2, 4))
    return p[0], p


def unbind_output():
    base = torch.randn(2, 4, requires_grad=True) * 1.0
    return base.unbind(0)[0], base


def view_made_under_no_grad():
    base = torch.randn(2, 4, requires_grad=True) * 1.0
    with torch.no_grad():
        view = base[0]
    return view, base


def silu_inplace_in_enabled(t):
    with fad.enabled():
        return F.silu(t, inplace=True)


REFUSED_IN_PLACE = {"leaf": leaf_parameter, "view_of_leaf": view_of_leaf,
                    "unbind_output": unbind_output, "no_grad_view": view_made_under_no_grad}
IN_PLACE_CALLS = {
    "silu": (lambda t: fad.silu(t, inplace=True), lambda t: F.silu(t, inplace=True)),
    "SiLU": (fad.SiLU(inplace=True), nn.SiLU(inplace=True)),
    "leaky_relu": (lambda t: fad.leaky_relu(t, 0.1, inplace=True),
                   lambda t: F.leaky_relu(t, 0.1, inplace=True)),
    "enabled": (silu_inplace_in_enabled, lambda t: F.silu(t, inplace=True)),
}


@pytest.mark.parametrize("call", sorted(IN_PLACE_CALLS))
@pytest.mark.parametrize("case", sorted(REFUSED_IN_PLACE))
def test_inplace_refused_by_autograd_leaves_data_unchanged(case, call):
    """In-place writes autograd refuses (a leaf that requires grad, views of
    it, unbind's outputs, views made under no_grad): torch's error, raised
    before anything is written. The kernels wrote first, and autograd's
    check came after (with a wrong message for the no_grad view)."""
    ours, ref = IN_PLACE_CALLS[call]
    messages = []
    for fn in (ref, ours):
        torch.manual_seed(0)
        target, owner = REFUSED_IN_PLACE[case]()
        before = owner.detach().clone()
        with pytest.raises(RuntimeError) as raised:
            fn(target)
        assert torch.equal(owner.detach(), before)
        messages.append(str(raised.value))
    assert messages[1] == messages[0]


def test_inplace_on_a_view_of_a_non_leaf_runs_torch():
    """An in-place activation on a view of a tensor that requires grad (which
    autograd allows) runs torch's op: the same values and gradients."""
    def run(act):
        leaf = torch.linspace(-3, 3, 8).reshape(2, 4).requires_grad_()
        h = leaf * 2.0
        act(h[1])
        (g,) = torch.autograd.grad((h * h).sum(), leaf)
        return h.detach(), g

    for got, want in zip(run(lambda t: fad.elu(t, inplace=True)), run(lambda t: F.elu(t, inplace=True))):
        assert torch.equal(got, want)


NEGATIVE_SLOPE_MODULES = {"leaky_relu": lambda: nn.LeakyReLU(-0.2, inplace=True),
                          "elu": lambda: nn.ELU(-0.5, inplace=True),
                          "celu": lambda: nn.CELU(-0.5, inplace=True)}


@pytest.mark.parametrize("name", sorted(NEGATIVE_SLOPE_MODULES))
def test_inplace_negative_slope_trains_where_torch_refuses(name):
    """torch refuses the backward of an in-place LeakyReLU, ELU or CELU with
    a negative slope or alpha (it recovers f' from the output); a patched
    one saves f' from x and gives the out-of-place gradient (README). On a
    view it runs torch's op, whose error comes in backward."""
    make = NEGATIVE_SLOPE_MODULES[name]
    x = torch.linspace(-3, 3, 64)

    def grad_of(module, view=False):
        leaf = x.clone().requires_grad_()
        h = leaf * 1.0
        out = module(h[:] if view else h)
        return torch.autograd.grad(out, leaf, torch.ones_like(x))[0]

    native = make()
    with pytest.raises(RuntimeError, match="negative slope"):
        grad_of(native)
    out_of_place = make()
    out_of_place.inplace = False
    patched = make()
    fad.patch(patched)
    torch.testing.assert_close(grad_of(patched), grad_of(out_of_place), rtol=4e-6, atol=0)
    with pytest.raises(RuntimeError, match="negative slope"):
        grad_of(patched, view=True)


@pytest.mark.parametrize("how", ["function", "patched", "enabled"])
@pytest.mark.parametrize("name", ["elu", "leaky_relu", "silu", "hardswish"])
def test_inplace_under_allow_mutation_on_saved_tensors(name, how):
    """A tensor saved by another op, then activated in place, under
    allow_mutation_on_saved_tensors(): the mode must see the write to clone
    the saved values first. The raw write slipped past it (gradients off by
    13 to 17)."""
    native = {"elu": nn.ELU, "leaky_relu": nn.LeakyReLU, "silu": nn.SiLU,
              "hardswish": nn.Hardswish}[name](inplace=True)
    patched = nn.Sequential(copy.deepcopy(native))
    fad.patch(patched)
    ours = {"function": lambda t: ACTIVATIONS[name][0](t, inplace=True), "patched": patched,
            "enabled": native}[how]
    x0 = torch.randn(6)

    def run(act, mode=contextlib.nullcontext()):
        x = x0.clone().requires_grad_()
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            with mode:
                z = x * 2
                p = z * z  # saves z
                act(z)
                out = (p + z).sum()
            out.backward()
        return x.grad

    mode = fad.enabled() if how == "enabled" else contextlib.nullcontext()
    torch.testing.assert_close(run(ours, mode), run(native), rtol=1e-6, atol=1e-6)


def test_bad_input_raises_clearly():
    with pytest.raises(NotImplementedError, match="Long"):  # torch's own refusal
        fad.silu(torch.arange(3))
    with pytest.raises(NotImplementedError, match="ComplexFloat"):  # torch's own refusal
        fad.mish(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        fad.sigmoid([1.0, 2.0])
    with pytest.raises(ValueError, match="saved_dtype"):
        fad.gelu(torch.randn(3), saved_dtype=torch.int8)
    with pytest.raises(ValueError, match="saved_dtype"):  # a float dtype, but not one d is stored in
        fad.gelu(torch.randn(3), saved_dtype=torch.float64)
    with pytest.raises(ValueError, match="saved_dtype"):
        fad.GELU(saved_dtype="8bit")
    with pytest.raises(ValueError, match="uint8"):
        fad.enabled(compose=True, saved_dtype=torch.uint8)
    for compose in ("False", 2, None):  # by their truth "False" and 2 turned chains on
        with pytest.raises(ValueError, match="^compose: expected True or False"):
            fad.enabled(compose=compose)
    assert fad.enabled(compose=np.bool_(True)).compose is True


# Parameters the kernels cannot take: torch computes with inf and NaN, and
# raises its own errors (which name the argument) for the others.
TORCH_PARAMS = {
    "softplus_threshold_inf": (F.softplus, {"threshold": math.inf}),
    "softplus_threshold_minus_inf": (F.softplus, {"threshold": -math.inf}),
    "softplus_beta_inf": (F.softplus, {"beta": math.inf}),
    "softplus_beta_nan": (F.softplus, {"beta": math.nan}),
    "elu_alpha_nan": (F.elu, {"alpha": math.nan}),
    "elu_alpha_inf": (F.elu, {"alpha": math.inf}),
    "celu_alpha_minus_inf": (F.celu, {"alpha": -math.inf}),
    "leaky_relu_slope_inf": (F.leaky_relu, {"negative_slope": math.inf}),
    "gelu_approximate_bogus": (F.gelu, {"approximate": "bogus"}),
    "celu_alpha_zero": (F.celu, {"alpha": 0.0}),
    "celu_alpha_beyond_float32": (F.celu, {"alpha": 1e-40}),  # 1 / alpha overflows
    "elu_alpha_beyond_float32": (F.elu, {"alpha": 1e39}),
    "leaky_relu_slope_none": (F.leaky_relu, {"negative_slope": None}),
}


PARAM_MODULES = {F.softplus: nn.Softplus, F.elu: nn.ELU, F.celu: nn.CELU,
                 F.leaky_relu: nn.LeakyReLU, F.gelu: nn.GELU}


@pytest.mark.parametrize("how", ["function", "patched", "enabled", "compose"])
@pytest.mark.parametrize("case", sorted(TORCH_PARAMS))
def test_parameters_the_kernels_cannot_take_run_torch(case, how):
    """fad refused inf and NaN parameters that torch takes (ValueError
    "threshold must be finite" from a patched Softplus(threshold=inf)), and
    raised ValueError where torch raises RuntimeError (approximate="bogus",
    celu alpha=0) or a TypeError without the argument's name (slope None)."""
    native, kw = TORCH_PARAMS[case]
    act = lambda t: native(t, **kw)  # noqa: E731
    if how == "function":
        act = lambda t: getattr(fad, native.__name__)(t, **kw)  # noqa: E731
    elif how == "patched":
        act = nn.Sequential(PARAM_MODULES[native](**kw))
        fad.patch(act)
        assert type(act[0]).__module__ == "reprop.fad"
    mode = fad.enabled(compose=how == "compose") if how in ("enabled", "compose") \
        else contextlib.nullcontext()

    def outcome(act, mode):
        """(value, gradient) of tanh(act(x)) * 2, or (exception type, message)."""
        x = torch.tensor([-30.0, -2.0, 0.0, 0.5, 30.0, math.inf]).requires_grad_()
        try:
            with mode:
                y = torch.tanh(act(x * 1.0)) * 2.0
        except Exception as e:  # noqa: BLE001 - compared with torch's
            return type(e), str(e)
        return y.detach(), torch.autograd.grad(y.sum(), x)[0]

    got, ref = outcome(act, mode), outcome(lambda t: native(t, **kw), contextlib.nullcontext())
    if isinstance(ref[0], type):
        assert got == ref
    else:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------
# Modules, patch and unpatch
# ---------------------------------------------------------------------------

MODULE_CASES = [
    (nn.GELU(approximate="tanh"), fad.GELU), (nn.SiLU(), fad.SiLU), (nn.Mish(), fad.Mish),
    (nn.Softplus(beta=2.0, threshold=4.0), fad.Softplus),
    (nn.ELU(alpha=0.7), fad.ELU), (nn.CELU(alpha=1.3), fad.CELU),
    (nn.SELU(), fad.SELU), (nn.LeakyReLU(0.1), fad.LeakyReLU), (nn.Hardswish(), fad.Hardswish),
    (nn.Hardsigmoid(), fad.Hardsigmoid), (nn.LogSigmoid(), fad.LogSigmoid),
    (nn.Softsign(), fad.Softsign), (nn.Tanhshrink(), fad.Tanhshrink),
]


@pytest.mark.parametrize("native,ours_cls", MODULE_CASES, ids=lambda v: type(v).__name__)
def test_modules_are_drop_in(native, ours_cls):
    assert isinstance(ours_cls(), type(native))
    model = nn.Sequential(nn.Linear(8, 8), native, nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(8, 8), type(native)(), nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    ref[1].__dict__.update({k: v for k, v in native.__dict__.items() if not k.startswith("_")})
    x = torch.randn(5, 8)
    changed = fad.patch(model)
    assert list(changed) == ["1"] and type(model[1]) is ours_cls
    assert isinstance(model[1], type(native))
    out, out_ref = model(x), ref(x)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    out_ref.sum().backward()
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad, rtol=1e-5, atol=1e-6)
    assert fad.unpatch(model) == ["1"] and type(model[1]) is type(native)
    assert not hasattr(model[1], "saved_dtype") or model[1].saved_dtype is None


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd holds for backward after fn()."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("native,ours_cls", [(nn.Sigmoid(), fad.Sigmoid), (nn.Tanh(), fad.Tanh)],
                         ids=["Sigmoid", "Tanh"])
def test_output_saving_activations_stay_torch_under_patch_and_enabled(native, ours_cls):
    """torch's Sigmoid and Tanh save their output, which the next Linear saves
    as its input anyway: f'(x) would add a tensor. patch() and enabled()'s
    rerouting leave them to torch (no more saved than plain autograd); the
    reprop class used directly is still a drop-in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), native, nn.Linear(64, 8))
    x = torch.randn(32, 64, requires_grad=True)
    plain = _saved_bytes(lambda: model(x))
    assert fad.patch(model) == {} and type(model[1]) is type(native)
    with fad.enabled():
        assert _saved_bytes(lambda: model(x)) == plain
    direct = nn.Sequential(model[0], ours_cls(), model[2])
    assert isinstance(direct[1], type(native))
    out, ref = direct(x), model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(out.sum(), x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


class _ActInputReadTwice(nn.Module):
    """h = Linear(x) into a GELU and into a second Linear: h is saved anyway."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.f1, self.act = nn.Linear(256, 1024), nn.GELU()
        self.f2, self.f3 = nn.Linear(1024, 256), nn.Linear(1024, 256)

    def forward(self, x):
        h = self.f1(x)
        return self.f2(self.act(h)) + self.f3(h)


@pytest.mark.parametrize("saved_dtype, extra", [(None, 4), (torch.bfloat16, 2), (torch.uint8, 1)],
                         ids=str)
def test_derivative_is_held_beside_an_input_kept_anyway(saved_dtype, extra):
    """What README says: where the activation's input is saved by another
    layer too, torch's saved x costs nothing more and FAD holds f'(x) beside
    it (one tensor of h's size in saved_dtype: 3.90 MB against 3.65 MB for
    float32); unpatching that module gives torch's bytes back, and
    compose=True folds a use in the same chain (gelu(h) * h) into one
    derivative where torch saves two tensors."""
    model = _ActInputReadTwice()
    x = torch.randn(64, 256, requires_grad=True)
    plain = _saved_bytes(lambda: model(x))
    assert plain == 3648 * 1024
    fad.patch(model, saved_dtype=saved_dtype)
    assert _saved_bytes(lambda: model(x)) == plain + 64 * 1024 * extra
    fad.unpatch(model.act)
    assert _saved_bytes(lambda: model(x)) == plain
    if saved_dtype is torch.uint8:  # (compose takes no 8-bit codes)
        return
    h = model.f1(x).detach().requires_grad_()
    with LiveSaved() as saved:
        y = F.gelu(h) * h
    assert saved.live_bytes() == 2 * 64 * 1024 * 4
    del y
    with fad.enabled(compose=True, saved_dtype=saved_dtype), LiveSaved() as saved:
        y = F.gelu(h) * h
    assert saved.live_bytes() == 64 * 1024 * extra


class _ConvActConv(nn.Module):
    """Conv, an in-place activation (a module, or a function attribute called
    as fn(h, *params, inplace=True)), Conv."""

    def __init__(self, act, *params):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.act, self.params = act, params

    def forward(self, x):
        h = self.conv1(x)
        h = self.act(h) if isinstance(self.act, nn.Module) else self.act(h, *self.params, inplace=True)
        return self.conv2(h)


OUTPUT_SAVED_IN_PLACE = {
    "ELU": (lambda: nn.ELU(0.5, inplace=True), (F.elu, 0.5)),
    "CELU": (lambda: nn.CELU(0.5, inplace=True), (F.celu, 0.5)),
    "SELU": (lambda: nn.SELU(inplace=True), (F.selu,)),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.2, inplace=True), (F.leaky_relu, 0.2)),
    # the boundary: torch takes a zero slope or alpha in place (only a negative one it refuses)
    "LeakyReLU_zero_slope": (lambda: nn.LeakyReLU(0.0, inplace=True), (F.leaky_relu, 0.0)),
    "ELU_zero_alpha": (lambda: nn.ELU(0.0, inplace=True), (F.elu, 0.0)),
}


def test_in_place_decision_reads_the_signatures_positions():
    """_left_to_torch reads inplace and the parameter off their positions (a
    bound signature cost 10 us a call): they are those of the functions."""
    for name, (param, at, inplace_at) in fad._OUTPUT_SAVED_IN_PLACE.items():
        names = list(inspect.signature(getattr(fad, name)).parameters)
        assert names.index("inplace") == inplace_at and (param is None or names.index(param) == at)
    x = torch.randn(4)
    assert fad._left_to_torch(fad.elu, (x,), {"inplace": True})
    assert not fad._left_to_torch(fad.elu, (x, -1.0, True), {})
    assert not fad._left_to_torch(fad.leaky_relu, (x,), {"negative_slope": -0.5, "inplace": True})
    assert fad._left_to_torch(fad.selu, (x, True), {}) and not fad._left_to_torch(fad.selu, (x,), {})


@pytest.mark.parametrize("how", ["patched", "attribute", "enabled"])
@pytest.mark.parametrize("saved_dtype", [None, torch.uint8], ids=["default", "uint8"])
@pytest.mark.parametrize("name", sorted(OUTPUT_SAVED_IN_PLACE))
def test_in_place_output_saving_activations_save_no_more_than_torch(name, saved_dtype, how):
    """torch's in-place ELU, CELU, SELU and LeakyReLU save only their output,
    the storage the next Conv saves anyway; FAD's f'(x) was a tensor more
    (a Conv-ELU-Conv saved twice torch's bytes by default, 1.25 times as 8-bit
    codes). patch() and enabled() leave those calls to torch: the same bytes,
    the same gradients."""
    make_module, (fn, *params) = OUTPUT_SAVED_IN_PLACE[name]
    if how == "attribute":
        ref, model = _ConvActConv(fn, *params), _ConvActConv(fn, *params)
    else:
        ref, model = _ConvActConv(make_module()), _ConvActConv(make_module())
    mode = fad.enabled(saved_dtype=saved_dtype) if how == "enabled" else contextlib.nullcontext()
    if how != "enabled":
        assert fad.patch(model, saved_dtype=saved_dtype)
    x = torch.randn(2, 3, 8, 8)

    def run(m, mode=contextlib.nullcontext()):
        with mode:
            out = m(x)
        return out, torch.autograd.grad(out.square().sum(), list(m.parameters()))

    assert _saved_bytes(lambda: run(model, mode)) <= _saved_bytes(lambda: run(ref))
    (out, grads), (out_ref, grads_ref) = run(model, mode), run(ref)
    assert torch.equal(out, out_ref)
    assert all(torch.equal(g, g_ref) for g, g_ref in zip(grads, grads_ref, strict=True))


def _forward_set_on_instance(module: nn.Module) -> nn.Module:
    """module with a forward set on the instance, as accelerate's
    add_hook_to_module sets one (device_map="auto", offloading)."""
    module._old_forward = module.forward
    module.forward = functools.update_wrapper(
        functools.partial(lambda mod, *a, **k: mod._old_forward(*a, **k), module), module._old_forward)
    return module


def test_patch_leaves_a_module_whose_forward_is_set_on_the_instance():
    """A forward set on the instance runs in place of the class's, so a swap
    of the class changes nothing: patch() reported 'torch.nn.GELU ->
    reprop.fad.GELU' while torch's GELU ran. It leaves such modules (one
    warning naming them) and swaps the others."""
    model = nn.Sequential(nn.Linear(4, 4), _forward_set_on_instance(nn.GELU()), nn.Linear(4, 4),
                          _forward_set_on_instance(nn.SiLU()), nn.GELU())
    with pytest.warns(UserWarning, match="forward set on the instance") as caught:
        assert fad.patch(model, saved_dtype=torch.uint8) == {"4": "torch.nn.GELU -> reprop.fad.GELU"}
    assert len(caught) == 1 and "'1', '3'" in str(caught[0].message)
    assert type(model[1]) is nn.GELU and type(model[3]) is nn.SiLU and type(model[4]) is fad.GELU
    assert fad.unpatch(model) == ["4"] and type(model[4]) is nn.GELU


def test_patch_warning_is_a_reprop_warning_at_the_users_line():
    """patch()'s warning was a bare UserWarning: a suite run with warnings as
    errors could filter it only by its text. It is a reprop.ReproPWarning
    (still a UserWarning), at the user's call."""
    model = nn.Sequential(_forward_set_on_instance(nn.GELU()))
    with pytest.warns(_tensors.ReproPWarning, match="forward set on the instance") as caught:
        fad.patch(model)
    assert [(w.category, w.filename) for w in caught] == [(_tensors.ReproPWarning, __file__)]


def test_patch_leaves_a_module_whose_class_forward_a_library_replaced(monkeypatch):
    """A forward a library set on a torch activation class (nn.GELU.forward
    = ...) is what every module of the class computes: patch() swapped in
    reprop's forward, computing torch's GELU, so the model's output changed
    silently (half of 2 * gelu). It leaves such modules, with a warning
    naming them, and swaps those of untouched classes."""
    monkeypatch.setattr(nn.GELU, "forward", lambda self, input: 2.0 * F.gelu(input))
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.SiLU())
    x = torch.randn(3, 4)
    want = model(x)
    with pytest.warns(UserWarning, match="forward of their class is no longer torch.nn's") as caught:
        assert fad.patch(model) == {"3": "torch.nn.SiLU -> reprop.fad.SiLU"}
    assert len(caught) == 1 and "'1':" in str(caught[0].message)
    assert type(model[1]) is nn.GELU and type(model[3]) is fad.SiLU
    torch.testing.assert_close(model(x), want, rtol=1e-6, atol=1e-7)


def test_a_patched_module_runs_the_forward_a_library_set_on_its_class_since(monkeypatch):
    """A forward a library sets on a torch activation class after patch()
    (nn.GELU.forward = ...) is what torch's modules of the class compute
    from then on: a patched one kept running reprop's forward, torch's GELU
    where the library's doubled it. It runs the library's now, and FAD
    again once torch's forward is back; modules of other classes keep FAD."""
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.SiLU())
    assert len(fad.patch(model)) == 2
    h = torch.randn(3, 4, requires_grad=True)
    monkeypatch.setattr(nn.GELU, "forward", lambda self, input: 2.0 * F.gelu(input))
    assert torch.equal(model[1](h), 2.0 * F.gelu(h))
    assert type(model[3](h).grad_fn).__name__ == "_ActivationBackward"
    monkeypatch.undo()
    assert type(model[1](h).grad_fn).__name__ == "_ActivationBackward"
    assert fad.unpatch(model) == ["1", "3"]


@pytest.mark.parametrize("fn", [fad.patch, fad.unpatch], ids=["patch", "unpatch"])
def test_patch_of_what_is_no_module_raises_a_type_error_naming_model(fn):
    """fad.patch(F.gelu) raised AttributeError: 'function' object has no attribute 'named_modules'."""
    with pytest.raises(TypeError, match=rf"{fn.__name__}: model must be a torch.nn.Module, got builtin"):
        fn(F.gelu)


def test_patch_keeps_hooks_and_updates_saved_dtype():
    act = nn.GELU()
    seen = []
    act.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model = nn.Sequential(nn.Linear(4, 4), act)
    fad.patch(model, saved_dtype=torch.bfloat16)
    assert model[1].saved_dtype is torch.bfloat16 and "saved_dtype" in repr(model[1])
    fad.patch(model, saved_dtype=torch.uint8)  # again: updates, does not stack
    assert model[1].saved_dtype is torch.uint8
    x = torch.randn(3, 4)
    with LiveSaved() as saved:
        out = model(x)
    assert out.requires_grad and seen == [torch.Size([3, 4])]
    assert torch.uint8 in [t.dtype for t in saved.live()]
    fad.unpatch(model)
    assert type(model[1]) is nn.GELU and fad.unpatch(model) == []


def test_patch_leaves_subclasses_and_reroutes_function_attributes():
    class MyGELU(nn.GELU):
        pass

    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu", batch_first=True)
    model = nn.Sequential(layer, MyGELU())
    ref = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu",
                                                   batch_first=True), MyGELU())
    ref.load_state_dict(model.state_dict())
    changed = fad.patch(model)
    assert list(changed) == ["0.activation"] and type(model[1]) is MyGELU
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)
    fad.unpatch(model)
    assert model[0].activation is F.gelu


def test_patch_and_unpatch_leave_a_function_attribute_the_user_set_since():
    """patch() again and unpatch() took the function an earlier patch()
    rerouted over what the attribute held now: a ReLU the user set after
    patch() became FAD GELU again (outputs 0.125 apart), or torch's GELU
    after unpatch(). The user's own value is theirs: rerouted afresh if it
    is a torch activation (and unpatch() then restores that one), else
    left alone by both."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True)
    ref = copy.deepcopy(layer)
    ref.activation = F.relu
    x = torch.randn(2, 3, 8)
    fad.patch(layer)
    layer.activation = F.relu
    assert fad.patch(layer, saved_dtype=torch.bfloat16) == {} and layer.activation is F.relu
    assert torch.equal(layer(x), ref(x))
    assert fad.unpatch(layer) == [] and layer.activation is F.relu
    layer.activation = F.gelu  # (patched again from torch's GELU, so that unpatch has a record)
    fad.patch(layer)
    layer.activation = F.relu
    assert fad.unpatch(layer) == [] and layer.activation is F.relu
    fad.patch(layer)
    layer.activation = F.silu
    assert fad.patch(layer) == {"activation": "silu -> reprop.fad.silu"}
    assert layer.activation.args == (fad.silu, F.silu)
    assert fad.unpatch(layer) == ["activation"] and layer.activation is F.silu


@pytest.mark.parametrize("namespace_cleared", [False, True], ids=["importlib", "autoreload"])
def test_patch_and_unpatch_take_function_attributes_patched_before_a_reload(namespace_cleared: bool):
    """After importlib.reload(reprop.fad) (IPython's %autoreload 2), patch()
    and unpatch() took the record an earlier patch() left on a function
    attribute for the user's own value (it was an instance of the class the
    reload replaced): patch() silently left the old partial, its saved_dtype
    unapplied, and unpatch() never restored torch's function."""
    out = _run_fresh(_reloading(namespace_cleared) + """
    import torch, torch.nn.functional as F
    import reprop.fad as fad
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, activation=F.gelu)
    fad.patch(layer)
    fad = reload(fad)
    print("patched", list(fad.patch(layer, saved_dtype=torch.bfloat16)),
          layer.activation.keywords["saved_dtype"])
    print("restored", fad.unpatch(layer), layer.activation is F.gelu)
    """)
    assert out == ["patched", "['activation']", "torch.bfloat16",
                   "restored", "['activation']", "True"]


@pytest.mark.parametrize("namespace_cleared", [False, True], ids=["importlib", "autoreload"])
def test_in_place_calls_patched_before_a_reload_stay_torchs(namespace_cleared: bool):
    """In-place ELU, CELU, SELU and LeakyReLU with a non-negative parameter
    are left to torch (they save only their output). A module swapped, or a
    function attribute rerouted, before importlib.reload(reprop.fad) calls
    the functions of before it, which the reload's table did not know: they
    ran reprop's kernels, saving f'(x) besides (_ActivationBackward)."""
    out = _run_fresh(_reloading(namespace_cleared) + """
    import torch, torch.nn.functional as F
    torch.set_num_threads(1)
    import reprop.fad as fad
    lin, elu, holder = torch.nn.Linear(4, 4), torch.nn.ELU(inplace=True), torch.nn.Module()
    holder.act = F.leaky_relu
    fad.patch(torch.nn.ModuleList([elu, holder]))
    x = torch.randn(2, 4)

    def report(stage):
        print(stage, type(elu(lin(x)).grad_fn).__name__,
              type(holder.act(lin(x), 0.1, True).grad_fn).__name__)

    report("patched")
    fad = reload(fad)
    report("reloaded")
    """)
    assert out == ["patched", "EluBackward1", "LeakyReluBackward1",
                   "reloaded", "EluBackward1", "LeakyReluBackward1"]


@pytest.mark.parametrize("namespace_cleared", [False, True], ids=["importlib", "autoreload"])
def test_patch_again_after_a_reload_makes_the_model_picklable(namespace_cleared: bool):
    """A model patched before importlib.reload(reprop.fad) holds classes and
    functions of before it, which pickling, going by name, refuses
    (torch.save(model): "not the same object as reprop.fad.GELU"), and patch()
    again left its swapped modules in their old class. It now moves them to
    the reloaded classes, as it reroutes the function attributes afresh, so
    the model saves and loads, computing what it did."""
    out = _run_fresh(_reloading(namespace_cleared) + """
    import io, torch, torch.nn.functional as F
    torch.set_num_threads(1)
    import reprop.fad as fad
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Module())
    model[2].act = F.silu
    fad.patch(model)
    fad = reload(fad)
    fad.patch(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 4)
    print(type(loaded[1]) is fad.GELU, torch.equal(loaded[1](x), model[1](x)),
          torch.equal(loaded[2].act(x), model[2].act(x)))
    """)
    assert out == ["True", "True", "True"]


def test_a_model_patched_before_reroutes_were_recorded_unpatches():
    """A model patched and saved by reprop before patch() recorded the
    partial it installed (its record held the bare original function) met
    AttributeError in unpatch() and patch(), which had already dropped the
    record: the FAD partial stayed for good. Its partial is recognised by
    the reroute it wraps."""
    def saved_by_the_old_code():
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu")
        # what the old code installed: its partial, and the bare original as the record
        layer.activation = functools.partial(fad.gelu, saved_dtype=None)
        layer.__dict__["_reprop_fad_functions"] = {"activation": F.gelu}
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    layer = saved_by_the_old_code()
    assert fad.unpatch(layer) == ["activation"] and layer.activation is F.gelu
    layer = saved_by_the_old_code()
    assert fad.patch(layer, saved_dtype=torch.bfloat16) == {"activation": "gelu -> reprop.fad.gelu"}
    assert layer.activation.keywords == {"saved_dtype": torch.bfloat16}
    assert fad.unpatch(layer) == ["activation"] and layer.activation is F.gelu
    layer = saved_by_the_old_code()
    layer.activation = F.relu  # the user's since: left by both
    assert fad.patch(layer) == {} and fad.unpatch(layer) == [] and layer.activation is F.relu


# ---------------------------------------------------------------------------
# enabled(): rerouting and composed chains
# ---------------------------------------------------------------------------


def swish(x):
    return x * torch.sigmoid(x)


def mish_composed(x):
    return x * torch.tanh(F.softplus(x))


def gelu_hf(x):
    """The tanh GELU as HuggingFace-style code writes it out."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def custom_chain(x):
    return torch.exp(-x * x / 2) * x + 1.5 * torch.log1p(x * x) - x / (1 + x.abs()) + 2 ** x


COMPOSED = {"swish": swish, "mish": mish_composed, "gelu_hf": gelu_hf, "custom": custom_chain}


def run_chain(fn, x, grad, **mode):
    leaf = x.clone().requires_grad_()
    h = leaf * 1.0  # the chain's root: a non-leaf, as an activation's input is
    saved = LiveSaved()
    with saved, fad.enabled(**mode):
        y = fn(h)
    nbytes = saved.live_bytes()
    (g,) = torch.autograd.grad(y, leaf, grad)
    return y.detach(), g, nbytes


@pytest.mark.parametrize("name", sorted(COMPOSED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compose_saves_one_tensor(name, dtype):
    fn = COMPOSED[name]
    x = (torch.randn(64, 128) * 2).to(dtype)
    grad = torch.randn_like(x)
    y_ref, g_ref, bytes_ref = run_chain(fn, x, grad, compose=False)
    y, g, nbytes = run_chain(fn, x, grad, compose=True)
    assert nbytes == x.numel() * x.element_size(), f"{nbytes} bytes saved"
    assert bytes_ref >= 2 * nbytes  # plain autograd keeps 2 to 4 tensors for these
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_ref, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
    else:  # the order of the bf16 roundings differs between forward and reverse mode
        torch.testing.assert_close(y, y_ref, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(g, g_ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("saved_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_compose_saved_dtype(saved_dtype):
    x = torch.randn(64, 128) * 2
    grad = torch.randn_like(x)
    _, g_ref, _ = run_chain(mish_composed, x, grad)
    saved = LiveSaved()
    leaf = x.clone().requires_grad_()
    with saved, fad.enabled(compose=True, saved_dtype=saved_dtype):
        y = mish_composed(leaf * 1.0)
        z = y @ torch.eye(128)  # the chain's end: consumed by a matmul (YN)
    live = [t for t in saved.live() if t.shape == x.shape]
    assert [t.dtype for t in live] == [saved_dtype]
    (g,) = torch.autograd.grad(z, leaf, grad)
    torch.testing.assert_close(g, g_ref, rtol=torch.finfo(saved_dtype).eps, atol=1e-3)


def test_compose_reroutes_native_activations_and_modules():
    x = torch.randn(32, 32)
    grad = torch.randn_like(x)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.Mish())
    for compose in (False, True):
        leaf = x.clone().requires_grad_()
        with LiveSaved() as saved, fad.enabled(compose=compose, saved_dtype=torch.bfloat16):
            y = model(leaf)
        assert sum(t.dtype == torch.bfloat16 for t in saved.live()) == 2
        (g,) = torch.autograd.grad(y, leaf, grad)
        leaf_ref = x.clone().requires_grad_()
        (g_ref,) = torch.autograd.grad(model(leaf_ref), leaf_ref, grad)
        torch.testing.assert_close(g, g_ref, rtol=2e-2, atol=2e-3)


KEYWORD_INPUT_CALLS = {
    "gelu": (lambda h: F.gelu(input=h), lambda h: F.gelu(h)),
    "softplus": (lambda h: F.softplus(input=h, beta=2.0), lambda h: F.softplus(h, beta=2.0)),
    "logsigmoid": (lambda h: F.logsigmoid(input=h), lambda h: F.logsigmoid(h)),
    "selu": (lambda h: torch.selu(input=h), lambda h: torch.selu(h)),
    "celu": (lambda h: torch.celu(input=h, alpha=0.5), lambda h: torch.celu(h, alpha=0.5)),
}


@pytest.mark.parametrize("compose", [False, True], ids=["reroute", "compose"])
@pytest.mark.parametrize("name", sorted(KEYWORD_INPUT_CALLS))
def test_enabled_takes_an_input_passed_as_a_keyword(name, compose):
    """F.gelu(input=h) is F.gelu(h): enabled() reroutes it (and compose=True
    chains it) as it does the positional call. It ran torch's op, saving
    h at float32, as neither looked for a keyword input."""
    keyword, positional = KEYWORD_INPUT_CALLS[name]
    x = torch.linspace(-4, 4, 60).reshape(6, 10)
    grad = torch.linspace(-1, 1, 60).reshape(6, 10)

    def run(call):
        leaf = x.clone().requires_grad_()
        h = leaf * 1.5
        saved = []

        def pack(t):
            saved.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                fad.enabled(compose=compose, saved_dtype=torch.bfloat16):
            y = call(h)
        return y, torch.autograd.grad(y, leaf, grad)[0], saved

    y, g, saved = run(keyword)
    y_ref, g_ref, saved_ref = run(positional)
    assert saved == saved_ref and (torch.bfloat16, (6, 10)) in saved
    assert torch.equal(y, y_ref) and torch.equal(g, g_ref)


BROKEN = {
    # two different sources
    "two_sources": lambda x, w: x * torch.sigmoid(w),
    # an in-place op in the middle of a chain
    "inplace": lambda x, w: F.silu(x).mul_(2) * x,
    # a view in the middle
    "view": lambda x, w: torch.tanh(x).view(-1).view(x.shape) * x,
    # an intermediate also consumed outside the chain
    "shared_intermediate": lambda x, w: (lambda s: s * x + (s @ w))(torch.sigmoid(x)),
    # a non-element-wise op
    "reduction": lambda x, w: torch.sigmoid(x) * x.sum(dim=1, keepdim=True),
    # broadcasting past the root's shape
    "broadcast": lambda x, w: torch.sigmoid(x)[None] * torch.ones(3, 1, 1),
    # x ** x
    "self_power": lambda x, w: (x.abs() + 1) ** (x.abs() + 1),
    # the root modified in place after the chain started
    "root_inplace": lambda x, w: (lambda s: (x.mul_(2), s * x)[1])(torch.sigmoid(x)),
    # a chain tensor detached in place: a constant from then on
    "detached_in_place": lambda x, w: (lambda s: (s.detach_(), s * x)[1])(torch.exp(x)),
    # ... and made a leaf again (requires_grad_()): a root of its own
    "detached_then_leaf": lambda x, w: (lambda s: (s.detach_(), s.requires_grad_(),
                                                   torch.tanh(s) * 3 * x)[2])(torch.exp(x) * 2),
    # an op the tables do not know, then back into a chain
    "unknown_op": lambda x, w: torch.atan(torch.sigmoid(x)) * x,
    # no_grad inside the mode
    "no_grad": lambda x, w: torch.sigmoid(x) * x.detach() + torch.no_grad()(torch.tanh)(x),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_compose_falls_back_correctly(name):
    fn = BROKEN[name]
    x = torch.randn(16, 16)
    w = torch.randn(16, 16, requires_grad=True)

    def run(compose):
        leaf = x.clone().requires_grad_()
        w_ = w.detach().clone().requires_grad_()
        with fad.enabled(compose=compose):
            y = fn(leaf * 1.0, w_)
        grads = torch.autograd.grad(y, (leaf, w_), torch.ones_like(y), allow_unused=True)
        return y.detach(), grads

    y, grads = run(True)
    y_ref, grads_ref = run(False)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        if g_ref is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


# Chains at special points, where the order of the products matters: autograd
# multiplies from the loss inwards and its selects (relu, hardsigmoid, the
# masks of pow) give an exact 0; a forward product would give 0 * inf = NaN.
SPECIAL = {
    "sqrt_relu": lambda x: torch.sqrt(torch.relu(x)),
    "log_relu": lambda x: torch.log(x.relu()),
    "relu_pow_half": lambda x: torch.relu(x) ** 0.5,
    "reciprocal_relu": lambda x: 1 / torch.relu(x),
    "sqrt_hardsigmoid": lambda x: torch.sqrt(F.hardsigmoid(x)),
    "sqrt_hardswish": lambda x: torch.sqrt(F.hardswish(x - 4.0) + 0),
    # f'(-1.5) = 0 meets an inf: torch multiplies there (NaN), it selects only below -3
    "sqrt_hardswish_kink": lambda x: torch.sqrt(F.hardswish(x - 0.5) + 0.375),
    "relu_pow_tensor": lambda x: torch.relu(x) ** torch.tensor([0.0, 0.0, 2.0, 0.0, 1.0]),
    "pow_tensor_zero_base": lambda x: (x - x.detach()) ** torch.tensor([0.0, 0.5, 2.0, 0.0, 1.0]),
    "zero_base_pow": lambda x: 0.0 ** x,
    "negative_base_pow": lambda x: (-2.0) ** x,
    "tensor_zero_base_pow": lambda x: torch.pow(torch.zeros(5), x),
    "divide_by_zero": lambda x: torch.exp(x) / 0,
    "divide_by_negative_zero": lambda x: x / -0.0,
    "relu_then_plain_op": lambda x: torch.atan(torch.relu(x) ** 0.5),  # the chain's node meets inf
    "select_both_sides": lambda x: torch.sqrt(torch.relu(x) + torch.relu(-x) * 2),
}


@pytest.mark.parametrize("compose", [False, True])
@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_enabled_matches_autograd_at_zeros_and_infinities(name, compose):
    """The same values and gradients as plain autograd, down to where they
    are 0, inf or NaN, at inputs on kinks, zeros and sign changes."""
    fn = SPECIAL[name]
    x = torch.tensor([-4.0, 0.0, 4.0, -1.0, 2.0])

    def run(mode):
        leaf = x.clone().requires_grad_()
        with mode:
            y = fn(leaf)
        (g,) = torch.autograd.grad(y.sum(), leaf)
        return y.detach(), g

    for ours, ref in zip(run(fad.enabled(compose=compose)), run(contextlib.nullcontext())):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0, equal_nan=True)


# pow by an exponent of 0, where torch's backward gives +0 (zeros for a
# number, a select where a tensor exponent is 0) whatever the gradient.
ZERO_EXPONENT = {
    "number": lambda x: torch.pow(x, 0),
    "float_number_operator": lambda x: torch.exp(x) ** 0.0,
    "number_then_a_step": lambda x: torch.pow(x * 2.0, 0) * 3.0,
    "tensor": lambda x: torch.pow(x, torch.tensor([0.0, 2.0, 0.0, 3.0, 0.0, 1.0])),
    "zero_d_tensor": lambda x: torch.exp(x) ** torch.tensor(0.0),
    "tensor_then_a_step": lambda x: torch.pow(x, torch.tensor([0.0, 2.0, 0.0, 3.0, 0.0, 1.0])) * 2.0,
    "tensor_after_an_infinite_derivative":
        lambda x: torch.sqrt(x.abs()) ** torch.tensor([0.0, 2.0, 0.0, 3.0, 0.0, 1.0]),
}


@pytest.mark.parametrize("name", sorted(ZERO_EXPONENT))
def test_compose_pow_by_zero_exponent_with_infinite_gradient(name):
    """An exponent of 0 turned an infinite gradient from later steps into NaN
    (grad * 0) where torch gives 0: a number 0 is no chain step, a tensor's
    zeros select as relu's do."""
    fn = ZERO_EXPONENT[name]
    x = torch.tensor([0.0, 0.25, -4.0, 9.0, -1.0, 1.0])
    for grad in (torch.ones(6), torch.tensor([math.inf, -math.inf, 2.0, -1.0, math.inf, 1.0])):
        def run(mode):
            leaf = x.clone().requires_grad_()
            with mode:
                y = fn(leaf)
            (g,) = torch.autograd.grad(y, leaf, grad)
            return y.detach(), g

        for ours, ref in zip(run(fad.enabled(compose=True)), run(contextlib.nullcontext())):
            torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


# A select after steps whose derivative is infinite or negative: autograd's
# select gives +0, which the steps before it multiply (inf * 0 = NaN, and a
# negative derivative's sign), whatever the gradient from later steps.
SELECT_AFTER = {
    "relu_after_sqrt": lambda x: torch.relu(torch.sqrt(x) - 1.0),
    "relu_after_log": lambda x: torch.relu(torch.log(x) + 1.0) * 2.0,
    "hardsigmoid_after_reciprocal": lambda x: F.hardsigmoid(1.0 / x) * 2.0,
    "hardswish_after_negative": lambda x: F.hardswish(torch.sqrt(x) * -3.0),
    "hardswish_of_the_root_then_a_step": lambda x: F.hardswish(x) * 2.0,
    "two_selects": lambda x: F.hardsigmoid(torch.relu(torch.sqrt(x) - 1.0) * -4.0),
    "blocked_on_one_side": lambda x: torch.relu(torch.sqrt(x) - 1.0) + torch.sqrt(x),
    "blocked_on_both_sides": lambda x: torch.relu(torch.sqrt(x) - 1.0) - torch.relu(torch.log(x)),
}


@pytest.mark.parametrize("name", sorted(SELECT_AFTER))
def test_compose_select_after_an_infinite_or_negative_derivative(name):
    """Chains gave a plain 0 where a select blocks the path (from the NaN of
    relu(sqrt(x) - 1) at 0, the -0 of hardsigmoid(1 / x) at 0.25): NaNs and
    signs of zero as autograd's, with an inf gradient from later steps too."""
    fn = SELECT_AFTER[name]
    x = torch.tensor([0.0, 0.25, 4.0, 9.0, -4.0, 1.0])
    for grad in (torch.ones(6), torch.tensor([1.0, -math.inf, 2.0, -1.0, math.inf, 1.0])):
        def run(mode):
            leaf = x.clone().requires_grad_()
            with mode:
                y = fn(leaf)
            return torch.autograd.grad(y, leaf, grad)[0]

        ours, ref = run(fad.enabled(compose=True)), run(contextlib.nullcontext())
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0, equal_nan=True)
        zeros = ref == 0
        assert torch.equal(ours[zeros].signbit(), ref[zeros].signbit()), (ours, ref)


def _softplus_of_a_quotient_by_zero_plus_it(x):
    a = x / 0
    return F.softplus(a) + a


# Where paths join, autograd sums per-path gradients and a chain multiplies
# the gradient by one summed derivative (README, compose): inf and NaN trade
# places and zeros their sign. (function, composed, x, gradient, torch's
# gradient, ours)
JOINS = {
    "sigmoid_gate_inf": (lambda x: x * torch.sigmoid(x), True, [-2.0, 0.5], math.inf,
                         [math.nan, math.inf], [-math.inf, math.inf]),
    "inf_derivative_meets_a_saturated_path": (_softplus_of_a_quotient_by_zero_plus_it, True,
                                              [2.0, -2.0], 1.0, [math.inf, math.inf],
                                              [math.inf, math.nan]),
    "relu_skip_negative_zero": (lambda x: torch.relu(x) + x, True, [-2.0, 0.5], -0.0,
                                [0.0, -0.0], [-0.0, -0.0]),
    "softsign_inf": (F.softsign, False, [-2.0, 0.5, -0.0], math.inf,
                     [math.nan] * 3, [math.inf] * 3),
    "softsign_negative_zero": (F.softsign, False, [-2.0], -0.0, [0.0], [-0.0]),
    "tanhshrink_inf": (F.tanhshrink, False, [-2.0, 0.5, -0.0], math.inf,
                       [math.nan] * 3, [math.inf, math.inf, math.nan]),
    "tanhshrink_negative_zero": (F.tanhshrink, False, [-0.0], -1.0, [0.0], [-0.0]),
}


@pytest.mark.parametrize("name", sorted(JOINS))
def test_joined_paths_differ_from_autograd_only_in_non_finite_and_zero_signs(name):
    """The documented difference, pinned on both sides: torch's composite
    Softsign and Tanhshrink and the joins of a composed chain give NaN where
    ours gives inf (and the reverse), +0 where ours gives -0."""
    fn, composed, values, grad, torch_grad, our_grad = JOINS[name]
    mode = fad.enabled(compose=composed) if composed else fad.enabled()

    def run(context):
        leaf = torch.tensor(values, requires_grad=True)
        with context:
            y = fn(leaf)
        return torch.autograd.grad(y, leaf, torch.full_like(leaf, grad))[0]

    for got, want in ((run(contextlib.nullcontext()), torch_grad), (run(mode), our_grad)):
        assert repr(got.tolist()) == repr(want), (got, want)


SELECT_STEPS = {"relu": torch.relu, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
                "Hardswish": nn.Hardswish()}


@pytest.mark.parametrize("name", sorted(SELECT_STEPS))
def test_compose_select_saves_no_more_than_plain(name):
    """A select op between two matmuls: compose saved a bool mask next to
    the derivative (a one-step chain's mask is where its derivative is 0),
    and relu a derivative where torch's saves its output, which the next
    matmul saves anyway: up to 1.36 times plain autograd's bytes. The
    gradients stay plain autograd's, down to the zeros a select gives from
    an inf gradient (Hardswish selects at -3 too) and the gradient relu
    passes at a NaN, after a first chain step too."""
    act = SELECT_STEPS[name]
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(64, 16), torch.randn(16, 128), torch.randn(128, 8)

    def run(mode):
        w = w1.clone().requires_grad_()
        with mode:
            y = act(x @ w) @ w2
        return torch.autograd.grad(y, w, torch.ones_like(y))[0]

    plain = _saved_bytes(lambda: run(contextlib.nullcontext()))
    assert _saved_bytes(lambda: run(fad.enabled(compose=True))) <= plain
    torch.testing.assert_close(run(fad.enabled(compose=True)), run(contextlib.nullcontext()),
                               rtol=1e-5, atol=1e-5)
    # (reprop's Hardswish keeps a NaN input's NaN derivative: csrc/fad_math.h)
    xs = torch.tensor([math.nan if name == "relu" else 1.0, -4.0, -3.0, -1.5, 0.0, 3.0, 4.0])
    grad = torch.tensor([1.0, math.inf, math.inf, 1.0, math.inf, 1.0, 1.0])
    for first in (lambda t: t, lambda t: t * 1.0):
        def grads(mode):
            leaf = xs.clone().requires_grad_()
            with mode:
                y = act(first(leaf))
            return torch.autograd.grad(y, leaf, grad)[0]

        torch.testing.assert_close(grads(fad.enabled(compose=True)), grads(contextlib.nullcontext()),
                                   rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("expr", ["gelu", "gelu*2", "silu", "exp+1", "tanh*x", "relu"])
def test_compose_over_an_expanded_root_saves_no_more_than_plain(expr):
    """A root that repeats its elements (a bias expanded over batch and
    positions): a chain carried one derivative per element, 64 times the
    bytes of the bias plain autograd saves for GELU. Such a root starts no
    chain: the activation saves its distinct elements' f' and torch's ops
    what they save; the gradients stay plain autograd's."""
    exprs = {"gelu": F.gelu, "gelu*2": lambda r: F.gelu(r) * 2, "silu": F.silu,
             "exp+1": lambda r: torch.exp(r) + 1, "tanh*x": lambda r: torch.tanh(r) * r,
             "relu": torch.relu}
    torch.manual_seed(0)
    bias = torch.randn(256)
    g = torch.randn(64, 256)

    def run(mode):
        b = bias.clone().requires_grad_()
        with mode:
            y = exprs[expr](b.expand(64, 256))
        return torch.autograd.grad(y, b, g)[0]

    plain = _saved_bytes(lambda: run(contextlib.nullcontext()))
    assert _saved_bytes(lambda: run(fad.enabled(compose=True))) <= plain
    torch.testing.assert_close(run(fad.enabled(compose=True)), run(contextlib.nullcontext()),
                               rtol=1e-5, atol=1e-5)


RELU_SPELLINGS = {"torch.relu": torch.relu, "Tensor.relu": torch.Tensor.relu, "F.relu": F.relu,
                  "nn.ReLU": nn.ReLU()}


@pytest.mark.parametrize("name", sorted(RELU_SPELLINGS))
def test_compose_relu_joins_a_chain_however_spelled(name):
    """F.relu hands on its inplace=False as a keyword, so F.relu and nn.ReLU
    never joined a chain: relu(h) ** 2 saved relu's output and the square's
    derivative, 512 KiB for a float32 128 x 512 h, where torch.relu saves
    the chain's derivative and its mask, 320 KiB (README)."""
    relu = RELU_SPELLINGS[name]
    torch.manual_seed(0)
    x = torch.randn(128, 512)

    def run(mode):
        leaf = x.clone().requires_grad_()
        h = leaf * 1.0
        with mode:
            y = relu(h) ** 2
        return y, h.grad_fn, torch.autograd.grad(y.sum(), leaf, retain_graph=True)[0]

    # y itself kept: up to torch 2.11 a custom Function's grad_fn object does
    # not keep its node alive, whose next_functions then raise
    y, root_node, g = run(fad.enabled(compose=True))
    node = y.grad_fn
    assert node.next_functions[0][0] is root_node  # no relu node in between
    assert sum(t.nbytes for t in node.saved_tensors) == 320 * 1024
    assert torch.equal(g, run(contextlib.nullcontext())[2])


# A select on the root, then a step, at positions 0 and 1 not blocked but with a
# derivative of 0 (a 0 in a constant, Hardswish's f'(-1.5), an underflow), at
# 2 and 3 blocked: the chain's node saves +0 at all four.
SELECT_THEN_A_ZERO = {
    "relu_times_zeros": (lambda x: torch.relu(x) * torch.tensor([0.0, 0.0, 1.0, 1.0]), [2.0, 2.0, -1.0, -1.0]),
    "hardswish_at_its_zero": (lambda x: F.hardswish(x) * 2.0, [-1.5, -1.5, -4.0, -4.0]),
    "hardsigmoid_times_zeros": (lambda x: F.hardsigmoid(x) * torch.tensor([0.0, 0.0, 1.0, 1.0]),
                                [1.0, 1.0, 5.0, 5.0]),
    "relu_cubed_underflow": (lambda x: torch.relu(x) ** 3, [1e-30, 1e-30, -1.0, -1.0]),
}


@pytest.mark.parametrize("name", sorted(SELECT_THEN_A_ZERO))
def test_compose_select_then_a_step_keeps_its_mask(name):
    """A chain that goes on past a select saves a bool mask beside its
    derivative (one byte an element more than plain autograd; README): the
    saved derivative cannot stand in for it. Where it is 0 unblocked,
    autograd's gradient is the gradient times 0 (-0, NaN from inf); where
    blocked, +0. The same saved +0 and the same gradient must give both."""
    fn, values = SELECT_THEN_A_ZERO[name]
    x = torch.tensor(values)
    grad = torch.tensor([-1.0, math.inf, -1.0, math.inf])

    def run(mode, saved=lambda node: None):
        leaf = x.clone().requires_grad_()
        with mode:
            y = fn(leaf)
        kept = saved(y.grad_fn)  # before backward frees it
        return torch.autograd.grad(y, leaf, grad)[0], kept

    ours, (derivative, mask) = run(fad.enabled(compose=True), lambda node: node.saved_tensors)
    ref, _ = run(contextlib.nullcontext())
    assert derivative.dtype == torch.float32 and mask.dtype == torch.bool
    assert torch.equal(derivative.view(torch.int32), torch.zeros(4, dtype=torch.int32))  # +0
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ours.signbit(), ref.signbit()), (ours, ref)  # [-0, NaN, +0, +0]


@pytest.mark.parametrize("compose", [False, True])
@pytest.mark.parametrize("reentrant", [False, True])
def test_enabled_under_activation_checkpointing(compose, reentrant):
    """torch.utils.checkpoint inside enabled(): the non-reentrant one matches
    saved tensors by position with a recompute that runs without the mode,
    so the recorded forward must save what torch's ops save."""
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    x = torch.randn(4, 8)

    def block(t, weight):
        h = t @ weight
        return h * torch.tanh(F.softplus(h)) + F.gelu(h)

    def run(mode):
        w_ = w.clone().requires_grad_()
        with mode:
            y = torch.utils.checkpoint.checkpoint(block, x, w_, use_reentrant=reentrant).sum()
        y.backward()
        return w_.grad

    ours, ref = run(fad.enabled(compose=compose)), run(contextlib.nullcontext())
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


class _PackAsIs:
    def __call__(self, t):
        return t


@pytest.mark.parametrize("compose", [False, True])
@pytest.mark.parametrize("pack", [functools.partial(lambda tag, t: t, "offload"), _PackAsIs()],
                         ids=["partial", "callable_object"])
def test_enabled_under_a_pack_hook_of_any_callable(compose, pack):
    """A saved-tensor pack hook may be any callable (the mode asks whether
    it is a checkpoint's: a functools.partial has no __qualname__)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)

    def grad(mode):
        w = torch.linspace(-1, 1, 64).reshape(8, 8).requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            h = x @ w
            y = (F.gelu(h) + h * torch.sigmoid(h)).sum()
        y.backward()
        return w.grad

    torch.testing.assert_close(grad(fad.enabled(compose=compose)), grad(contextlib.nullcontext()),
                               rtol=1e-5, atol=1e-6)


_OWN_OUTPUT_FIRST_CHAINS = {
    "relu * 2": lambda h: torch.relu(h) * 2,
    "relu ** 2": lambda h: torch.relu(h) ** 2,
    "relu + h": lambda h: torch.relu(h) + h,
    "exp * 2": lambda h: torch.exp(h) * 2,
    "log1p(exp)": lambda h: torch.log1p(torch.exp(h)),
}
_PACKS = {  # (pack, unpack), each with the tensor it keeps
    "as_is": (lambda t: t, lambda p: p),
    "handle": (lambda t: (t.device, t), lambda p: p[1]),  # save_on_cpu's, for a CPU tensor
    "copy": (lambda t: t.clone(), lambda p: p),
}


@pytest.mark.parametrize("pack", sorted(_PACKS))
@pytest.mark.parametrize("name", sorted(_OWN_OUTPUT_FIRST_CHAINS))
def test_compose_under_a_pack_hook_keeps_nothing_after_backward(name, pack):
    """A chain whose first node saves its own output (relu or exp of the
    root), under a pack hook whose result holds that output
    (torch.autograd.graph.save_on_cpu() on the CPU returns it as it is):
    the output held its node, a cycle gc cannot see, and the next step,
    leading past the node, kept it from the backward that breaks it: one
    output leaked per training step. Gradients stay torch's."""
    chain = _OWN_OUTPUT_FIRST_CHAINS[name]
    pack_hook, unpack_hook = _PACKS[pack]
    lin = nn.Linear(16, 16)
    packed = []

    def keep(t):
        p = pack_hook(t)
        packed.append(weakref.ref(unpack_hook(p)))
        return p

    def grads(mode):
        lin.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(keep, unpack_hook), mode:
            y = chain(lin(torch.linspace(-2, 2, 128).reshape(8, 16)))
        y.sum().backward()
        return [p.grad.clone() for p in lin.parameters()]

    for _ in range(3):
        got = grads(fad.enabled(compose=True))
    gc.collect()
    assert [r for r in packed if r() is not None] == []
    for g, w in zip(got, grads(contextlib.nullcontext()), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("chain, per_step", [(lambda h: torch.sigmoid(h) * 2, 1),
                                              (lambda h: F.gelu(h) * 2 + 1, 2)])
def test_compose_under_a_pack_hook_keyed_until_unpack_keeps_the_led_past_nodes(chain, per_step):
    """What the README states of a pack hook that keeps tensors by key until
    unpack pops them: the nodes a next step leads past are freed without an
    unpack (as torch's of a graph dropped without backward), one entry per
    such node and step; compose=False leaves none. Gradients stay torch's."""
    lin = nn.Linear(16, 16)

    def run(mode, steps=3):
        store, keys = {}, itertools.count()

        def pack(t):
            key = next(keys)
            store[key] = t
            return key

        for _ in range(steps):
            lin.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(pack, store.pop), mode:
                y = chain(lin(torch.linspace(-2, 2, 128).reshape(8, 16)))
            y.sum().backward()
        return len(store), [p.grad.clone() for p in lin.parameters()]

    left, got = run(fad.enabled(compose=True))
    assert left == 3 * per_step
    assert run(fad.enabled(compose=False))[0] == 0
    left, want = run(contextlib.nullcontext())
    assert left == 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_codebook_caches_are_bounded():
    """A parameter annealed every step makes a new codebook each time: the
    caches keep the recent ones only."""
    x = torch.randn(64, requires_grad=True)
    for i in range(300):
        fad.leaky_relu(x, 0.01 + i * 1e-4, saved_dtype=torch.uint8).sum().backward()
    assert fad._codebook_bytes.cache_info().currsize <= 256


@pytest.mark.parametrize("saved_dtype", [None, torch.bfloat16])
def test_compose_inside_torch_compile_runs_torch_ops(saved_dtype):
    """Code torch.compile traces runs torch's ops under compose: dynamo
    traced the chain's bookkeeping into its graphs, and the gradient came
    out wrong (relative error 1 with saved_dtype=bfloat16) or dynamo
    crashed. (aot_eager: the eager backend's graph calls torch's functions
    again at run time, which the mode then takes as in eager code.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    w = torch.randn(6, requires_grad=True)
    x = torch.randn(4, 6)

    def f(x):
        h = x * w
        return torch.exp(h) / (1 + h)

    g = torch.randn(4, 6)
    want = torch.autograd.grad(f(x), w, g)[0]
    compiled = torch.compile(f, backend="aot_eager")
    with fad.enabled(compose=True, saved_dtype=saved_dtype):
        got = torch.autograd.grad(compiled(x), w, g)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class NewGELU(nn.Module):
    """The tanh GELU written out, as GPT-2-style code has it."""

    def forward(self, x):
        return gelu_hf(x)


def plus_one_doubled_plus_one(t):
    return 1.0 + (2.0 * (t + 1.0))


def plus_one_doubled_plus_one_inside_enabled(t):
    with fad.enabled(compose=True):
        return plus_one_doubled_plus_one(t)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("compose", [False, True])
def test_compiled_code_inside_enabled_equals_eager(compose, backend):
    """Compiled code inside enabled() (or entering it) gives eager's values
    and gradients. A graph break inside the mode's __torch_function__ made
    dynamo drop the number on the left of a binary op: 1 + (2 * (1 + 1))
    came out 4, and a GELU written out was off by 1.15. Traced code runs
    torch's ops: the aot_eager graph (aten ops) is bitwise plain torch
    running that graph (whose backward may differ from eager's by an ulp, as
    on torch 2.8); the eager backend's graph calls torch's functions, which
    the mode then takes as in eager code (FAD's rounding)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), NewGELU(), nn.Linear(32, 8), nn.SiLU())
    x = torch.randn(4, 8)
    ref = (torch.compile(mlp, backend=backend) if backend == "aot_eager" else mlp)(x)
    ref_grads = torch.autograd.grad(ref.sum(), list(mlp.parameters()))
    torch._dynamo.reset()
    with fad.enabled(compose=compose):
        out = torch.compile(mlp, backend=backend)(x)
        small = torch.compile(plus_one_doubled_plus_one, backend=backend)(torch.ones(3))
    grads = torch.autograd.grad(out.sum(), list(mlp.parameters()))
    tol = {"rtol": 0, "atol": 0} if backend == "aot_eager" else {"rtol": 1e-5, "atol": 1e-6}
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got, want, **tol)
    assert small.tolist() == [5.0] * 3
    torch._dynamo.reset()
    inner = torch.compile(plus_one_doubled_plus_one_inside_enabled, backend=backend)
    assert inner(torch.ones(3)).tolist() == [5.0] * 3


def test_compiled_patched_model_is_one_graph_of_torch_ops():
    """Code torch.compile traces runs torch's ops in a patched model too, as
    in enabled(): one graph, as for the unpatched model, computing torch's
    values and gradients. Dynamo broke the graph in every activation (7
    graphs, 6 breaks for Linear-GELU-Linear-SiLU-Linear), at the kernels'
    checks and calls."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.SiLU(),
                        nn.Linear(16, 2))
    model = copy.deepcopy(ref)
    assert fad.patch(model, saved_dtype=torch.uint8)
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    out = torch.compile(model, backend="eager")(x)
    out_ref = ref(x)
    grads = torch.autograd.grad(out.sum(), list(model.parameters()))
    grads_ref = torch.autograd.grad(out_ref.sum(), list(ref.parameters()))
    assert torch.equal(out, out_ref)
    assert all(torch.equal(g, g_ref) for g, g_ref in zip(grads, grads_ref, strict=True))
    torch._dynamo.reset()


# Operands broadcast up to the root's shape continue a chain; an output
# broadcast past it ends the chain (both ways _root_shaped decides).
ROOT_SHAPED = {
    "same_shape": (lambda x: torch.tanh(x) * torch.full((4, 3), 0.5), True),
    "row": (lambda x: torch.tanh(x) * torch.tensor([0.5, 2.0, -1.0]), True),
    "column": (lambda x: torch.tanh(x) + torch.ones(4, 1), True),
    "zero_dim": (lambda x: torch.tanh(x) * torch.tensor(3.0), True),
    "past_the_root": (lambda x: torch.tanh(x) * torch.ones(2, 4, 3), False),
    "past_a_size_one_root_dim": (lambda x: torch.tanh(x[:, :1] * 1.0) * torch.ones(4, 3), False),
}


def _gradient_penalty_grads(chain, compose):
    """The gradients of a WGAN-GP penalty, ((|d D(x) / dx| - 1)^2).mean(),
    with D = Linear, chain, Linear, through torch.autograd.grad(create_graph=True)
    (torch's alone if compose is None); None for a parameter it does not reach.
    Under compose, the chain is checked to be one: autograd's graph in its
    place would give torch's gradients too."""
    torch.manual_seed(0)
    first, last = nn.Linear(5, 16), nn.Linear(16, 1)
    x = torch.randn(8, 5, requires_grad=True)
    with fad.enabled(compose=True) if compose else contextlib.nullcontext():
        hidden = chain(first(x))
        out = last(hidden).sum()
    if compose:
        assert type(hidden.grad_fn).__name__ == "_ChainBackward"
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    penalty = ((g.norm(dim=1) - 1) ** 2).mean()
    return torch.autograd.grad(penalty, [first.weight, first.bias, last.weight], allow_unused=True)


_C16 = torch.linspace(0.5, 2.0, 16)
_TWICE_DIFFERENTIABLE_CHAINS = {
    "relu": torch.relu,
    "nn.ReLU": nn.ReLU(),
    "affine": lambda h: -(h / _C16) * 3 + h - 1,
    "1 - h": lambda h: 1 - h,
}


@pytest.mark.parametrize("name", sorted(_TWICE_DIFFERENTIABLE_CHAINS))
def test_compose_gradient_penalty_through_a_chain_whose_backward_is_autograds(name):
    """create_graph=True through a chain whose backward is autograd's own
    graph: relu of the root (torch's relu backward on the saved output: the
    same gradients bit for bit, a zero one linked to the parameter as
    torch's is) and chains of constant derivative. Every chain refused it,
    so a WGAN-GP critic with nn.ReLU failed under compose=True."""
    chain = _TWICE_DIFFERENTIABLE_CHAINS[name]
    got, want = _gradient_penalty_grads(chain, True), _gradient_penalty_grads(chain, None)
    for g, w in zip(got, want, strict=True):
        if w is None or g is None:  # (the bias's, under affine chains: unlinked in torch too)
            assert g is w
        elif name in ("relu", "nn.ReLU"):
            assert torch.equal(g, w)
        else:  # (grad * -3 / c + grad: one rounding apart from the chain's d)
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_compose_relu_under_a_pack_hook_is_twice_differentiable_as_torchs():
    """Under a saved-tensor hook a step after relu of the root starts a new
    chain at relu's output (so relu's node runs in backward, releasing what
    it saved): torch.relu(h) * 2 is then relu's node and a chain of
    constant derivative, whose gradient penalty is torch's bit for bit."""
    def penalty_grads(mode):
        with torch.autograd.graph.save_on_cpu():
            return _gradient_penalty_grads(lambda h: torch.relu(h) * 2, mode)

    for g, w in zip(penalty_grads(True), penalty_grads(None), strict=True):
        assert torch.equal(g, w)


_ONCE_DIFFERENTIABLE_CHAINS = {
    "exp": torch.exp,
    "x * x": lambda h: h * h,
    "relu, then a step": lambda h: torch.relu(h) * 2,
    "abs": torch.abs,
    "leaky_relu": lambda h: F.leaky_relu(h, 0.2),
    "F.gelu": F.gelu,
}


@pytest.mark.parametrize("name", sorted(_ONCE_DIFFERENTIABLE_CHAINS))
def test_compose_double_backward_through_another_chain_says_what_to_do(name):
    """Any other chain keeps no second derivative (a select past the first
    step has a 0 one, but autograd links its mask to the parameters: torch
    gives zeros where the chain would give None), and refuses create_graph
    with advice that fits: the old one said to use the torch.nn.functional
    activation, which the code already called (torch.relu, torch.exp)."""
    with pytest.raises(RuntimeError, match="differentiated twice") as refused:
        _gradient_penalty_grads(_ONCE_DIFFERENTIABLE_CHAINS[name], True)
    message = str(refused.value)
    assert "chain of element-wise ops (enabled(compose=True)) other than one relu of its root" \
        in message
    assert "outside reprop.fad.enabled()" in message and "compose=False" in message


@pytest.mark.parametrize("chain", [torch.abs, F.leaky_relu], ids=["abs", "leaky_relu"])
def test_compose_double_backward_refusal_of_a_lone_select_says_what_is_refused(chain):
    """The refusal said a chain "whose derivative varies with its root ...
    or a select ... past the chain's first step", neither true of a lone
    abs or leaky_relu of the root, and ended in the middle of a sentence
    ("... can be"). It names what is refused, as the README states it:
    every chain but one relu of its root or one of constant derivative."""
    with pytest.raises(RuntimeError) as refused:
        _gradient_penalty_grads(chain, True)
    message = str(refused.value)
    assert "varies with its root" not in message and "past the chain's first step" not in message
    assert "other than one relu of its root (nn.ReLU between two layers) or a chain of " \
           "additions, subtractions, negations and products with or divisions by constants" \
           in message
    assert "a select (abs, leaky_relu, hardsigmoid, hardswish, or relu with another step" in message
    assert message.endswith("run that forward with compose=False (which still reroutes F.gelu, "
                            "F.silu, ... to reprop's, refusing it too, but for leaky_relu and "
                            "hardsigmoid) or outside reprop.fad.enabled()")


@pytest.mark.parametrize("name", sorted(ROOT_SHAPED))
def test_compose_chains_only_root_shaped_outputs(name):
    fn, chained = ROOT_SHAPED[name]
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    with fad.enabled(compose=True):
        y = fn(x)
    assert (type(y.grad_fn).__name__ == "_ChainBackward") == chained
    (got,) = torch.autograd.grad(y.sum(), x)
    (want,) = torch.autograd.grad(fn(x).sum(), x)
    torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-7)


@pytest.mark.parametrize("op", [lambda h, c: torch.exp(h) * c, lambda h, c: h + c,
                                lambda h, c: c / torch.sigmoid(h)], ids=["mul", "add", "div"])
def test_compose_shapes_that_do_not_broadcast_raise_torchs_error(op):
    """A step whose operands do not broadcast raised torch.broadcast_shapes'
    "Attempting to broadcast a dimension of length 3 at -1!" (from the check
    of its output's shape) before the op ran, where torch's op raises its
    own ("The size of tensor a (5) must match the size of tensor b (3) ...")."""
    h, c = torch.randn(4, 5, requires_grad=True), torch.randn(3)

    def error(mode):
        with pytest.raises(RuntimeError) as caught, mode:
            op(h, c)
        return str(caught.value)

    assert error(fad.enabled(compose=True)) == error(contextlib.nullcontext())


def test_compose_float64_runs_plain_autograd():
    """float64 results run plain torch (as documented), so their gradients
    are torch's float64 ones, even through a float32 constant divisor."""
    torch.manual_seed(0)
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    k32 = torch.rand(1000) + 0.5
    for fn in (lambda t: (t + 1) / k32, lambda t: torch.exp(t) * F.silu(t),
               lambda t: t.float() / k32.double()):
        with fad.enabled(compose=True):
            y = fn(x)
        assert type(y.grad_fn).__name__ != "_ChainBackward"
        (got,) = torch.autograd.grad(y.sum(), x)
        (want,) = torch.autograd.grad(fn(x).sum(), x)
        assert torch.equal(got, want)


def test_compose_low_precision_constant_divisor():
    """A bfloat16 constant divides a float32 chain in float32 (torch's
    promotion): its reciprocal is taken after promotion, not in bfloat16."""
    torch.manual_seed(0)
    x = torch.randn(1000, requires_grad=True)
    k = torch.rand(1000, dtype=torch.bfloat16) + 0.5
    with fad.enabled(compose=True):
        y = (x + 1) / k
    (got,) = torch.autograd.grad(y.sum(), x)
    (want,) = torch.autograd.grad(((x + 1) / k).sum(), x)
    torch.testing.assert_close(got, want, rtol=2e-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compose_zero_dim_float32_divisor_of_a_half_chain(dtype):
    """A 0-d CPU float32 divisor is a scalar to torch's kernels, read at
    float32: its reciprocal too (70000 overflowed float16, and the gradient
    came out 0)."""
    x = torch.ones(4, dtype=dtype, requires_grad=True)
    for k in (torch.tensor(70000.0), torch.tensor(3e-6), torch.tensor(1 / 3)):
        with fad.enabled(compose=True):
            y = (x + 1) / k
        (got,) = torch.autograd.grad(y.sum(), x)
        (want,) = torch.autograd.grad(((x + 1) / k).sum(), x)
        assert torch.equal(got, want), (k, got, want)


# b / a written as torch.Tensor.__rtruediv__(a, b) (what b / a calls when b
# is not a tensor): torch computes a.reciprocal() * b, so b may be on the chain too.
RDIV = {
    "both_on_the_chain": lambda x: torch.Tensor.__rtruediv__(x, x.exp()),
    "numerator_on_the_chain": lambda x: torch.Tensor.__rtruediv__(torch.full_like(x, 4.0), x.exp()),
    "number_numerator": lambda x: torch.Tensor.__rdiv__(x * 2.0, 3.0),
}


@pytest.mark.parametrize("name", sorted(RDIV))
def test_compose_rdiv_differentiates_its_numerator(name):
    """The gradient through a chain tensor b in b / a was dropped (the
    chain took only a's term): exp(x) / x gave [-6.59, -2.72] at [0.5, 1]
    for torch's [-3.30, 0]."""
    fn = RDIV[name]
    x = torch.tensor([0.5, 1.0, -2.0, 3.0], requires_grad=True)
    with fad.enabled(compose=True):
        y = fn(x)
    assert type(y.grad_fn).__name__ == "_ChainBackward"
    (got,) = torch.autograd.grad(y.sum(), x)
    (want,) = torch.autograd.grad(fn(x).sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


# One chain per op of the chain tables (fad._UNARY, fad._BINARY), each op on a
# chain tensor (YY) between two other steps, so that its local derivative
# rule is what the gradient depends on: a rule without a test here (rsqrt,
# expm1, sin, cos, erf, alpha of sub and rsub) could be wrong unnoticed.
def _positive(h):
    return h * h + 0.5  # (a chain tensor > 0, for log, sqrt, rsqrt, pow)


CHAIN_OPS = {
    "neg": lambda h: -(h * 2.0),
    "exp": lambda h: torch.exp(h * 0.5),
    "expm1": lambda h: torch.expm1(h * 0.5),
    "special_expm1": lambda h: torch.special.expm1(h * 0.5),
    "log": lambda h: torch.log(_positive(h)),
    "log1p": lambda h: torch.log1p(_positive(h)),
    "sqrt": lambda h: torch.sqrt(_positive(h)),
    "rsqrt": lambda h: torch.rsqrt(_positive(h)),
    "reciprocal": lambda h: torch.reciprocal(_positive(h)),
    "sin": lambda h: torch.sin(h * 2.0),
    "cos": lambda h: torch.cos(h * 2.0),
    "erf": lambda h: torch.erf(h * 0.7),
    "special_erf": lambda h: torch.special.erf(h * 0.7),
    "square": lambda h: torch.square(h - 0.5),
    "abs": lambda h: torch.abs(h - 0.5),
    "relu": lambda h: torch.relu(h - 0.5),
    "add_alpha": lambda h: torch.add(h.exp(), h * h, alpha=-1.5),
    "sub_alpha": lambda h: torch.sub(h.exp(), h * h, alpha=2.5),
    "rsub": lambda h: 3.0 - h.exp(),
    "rsub_alpha": lambda h: torch.rsub(h * h, h.exp(), alpha=3.0),
    "mul": lambda h: h.sin() * h.cos(),
    "div": lambda h: h.sin() / _positive(h),
    "rdiv": lambda h: 2.0 / _positive(h),
    "pow_number": lambda h: _positive(h) ** 1.7,
    "pow_tensor": lambda h: _positive(h) ** torch.linspace(-1.0, 2.0, 24).reshape(4, 6),
    "rpow": lambda h: 3.0 ** (h * 0.5),
    "pow_of_a_constant_tensor": lambda h: torch.pow(torch.full((4, 6), 2.5), h * 0.5),
}


@pytest.mark.parametrize("name", sorted(CHAIN_OPS))
def test_compose_each_element_wise_op_matches_autograd(name):
    """Every op of the chain tables, met inside a chain, gives autograd's
    values and gradients (and is a chain step, not plain autograd)."""
    fn = CHAIN_OPS[name]
    x = torch.linspace(-2.0, 2.5, 24).reshape(4, 6)
    grad = torch.linspace(1.0, -0.5, 24).reshape(4, 6)

    def run(compose):
        leaf = x.clone().requires_grad_()
        with fad.enabled(compose=compose):
            y = fn(leaf * 1.25) * 0.75  # the root, a non-leaf, and a step after the op
        return y, torch.autograd.grad(y, leaf, grad)[0]

    y, g = run(True)
    y_ref, g_ref = run(False)
    assert type(y.grad_fn).__name__ == "_ChainBackward"
    torch.testing.assert_close(y.detach(), y_ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


def square_of_thousand_x(x):
    y = x * 1000.0
    return y * y * 1e-3  # d/dx of y * y is 2e6 x: above 65504 for |x| > 0.033


def fourth_power_of_small_x(x):
    y = x * 1e-5
    return y ** 4 * 1e4  # d/dx of y ** 4 is 4e-20 x^3: below 6e-5, float16's normal numbers


def log_of_subnormal_x(x):
    return torch.log(x) * 1e-3  # 1 / x: above 65504 for x < 1.53e-5, float16's subnormals


def divided_by_subnormal(x):
    return x / torch.full_like(x, 1e-5) * 1e-3  # 1 / 1e-5: 1e5


# Chains whose values and gradients fit float16, but whose derivative with
# respect to the root, a product of local derivatives, leaves float16's
# range in between; autograd multiplies the gradient by one at a time.
HALF_RANGE = {
    "overflow": (square_of_thousand_x, torch.linspace(-0.07, 0.07, 15)),
    "underflow": (fourth_power_of_small_x, torch.linspace(1e4, 3e4, 15)),
    "log_of_subnormal": (log_of_subnormal_x, torch.linspace(1e-6, 1.5e-5, 15)),
    "divided_by_subnormal": (divided_by_subnormal, torch.linspace(-1.0, 1.0, 15)),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(HALF_RANGE))
def test_compose_carries_half_chains_in_float32(name, dtype):
    """A float16 chain carries its derivative in float32 and rounds only the
    one its node saves, in the chain's dtype: the gradient is as accurate as
    torch's (it was inf, or lost digits to float16's subnormals), and a chain
    tensor consumed outside its chain drops the float32 one. The local
    derivative 1 / x of log and of a division by a tensor is taken in
    float32 too (it was inf at float16's subnormals). bfloat16, with
    float32's range, carries bfloat16 as accurately."""
    fn, x = HALF_RANGE[name]
    x = x.to(dtype)
    grad = torch.ones_like(x)
    y_ref, g_ref, _ = run_chain(fn, x, grad, compose=False)
    y, g, nbytes = run_chain(fn, x, grad, compose=True)
    _, g_64, _ = run_chain(fn, x.double(), grad.double(), compose=False)
    assert torch.equal(y, y_ref)
    assert nbytes == x.numel() * x.element_size(), f"{nbytes} bytes saved"
    assert g.dtype == dtype
    check_accuracy(g, g_ref, g_64)
    mode = fad.enabled(compose=True)
    with mode:
        y = fn(x.clone().requires_grad_())
        y.sum()  # y leaves its chain (YN)
        assert mode._chains.records[y].deriv.dtype == dtype


# Steps of the random bfloat16 chains below: unary (t -> ...) and joins with the root x
_BF16_CHAIN_UNARY = [torch.sigmoid, torch.tanh, F.softplus, F.gelu, F.silu, lambda t: t * t,
                     lambda t: t ** 3, lambda t: torch.exp(t * 0.5), lambda t: torch.log1p(torch.abs(t)),
                     lambda t: t * 1.7 + 0.3, lambda t: torch.where(t > 0, t, 0.1 * t),
                     lambda t: 1 / (1 + t * t)]
_BF16_CHAIN_JOIN = [lambda t, x: t * x, lambda t, x: t + x, lambda t, x: t - x / 2]


def _random_chain(rng: random.Random):
    steps = [rng.choice(_BF16_CHAIN_UNARY) if rng.random() < 0.7
             else functools.partial(lambda join, t, x: join(t, x), rng.choice(_BF16_CHAIN_JOIN))
             for _ in range(rng.randint(2, 5))]

    def chain(x):
        t = x
        for step in steps:
            t = step(t, x) if isinstance(step, functools.partial) else step(t)
        return t
    return chain


@pytest.mark.parametrize("saved_dtype", [None, torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_compose_bfloat16_chains_error_against_float64_is_torchs(saved_dtype):
    """Random bfloat16 chains (2 to 5 steps: activations, powers, exp,
    log1p, where, reciprocals, joins with the root), x ~ N(0, 2^2): the
    input gradient's relative L2 error against float64 autograd, summed
    over the chains, is below torch's plain bfloat16 autograd's (these 60:
    0.92 of it, the worst chain 1.9 times; over 389 chains: 0.83, the
    median chain 0.98, one in five above 1.2, the worst 2.8): the chain rounds its
    bfloat16 derivative once a step where torch's backward rounds the
    gradient. The saved dtype barely matters, as the derivative is carried
    in bfloat16 (float16 is kept finite only: its overflow is README's)."""
    ours, theirs, worst = [], [], 0.0
    for seed in range(60):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        chain = _random_chain(rng)
        x = (torch.randn(rng.choice([33, 513, 4097])) * 2).bfloat16()
        g = torch.randn(x.shape).bfloat16()
        _, exact = values_and_grads(chain, x.double(), g.double())
        _, plain = values_and_grads(chain, x, g)
        _, got = values_and_grads(functools.partial(_in_mode, fad.enabled(compose=True, saved_dtype=saved_dtype),
                                                    chain), x, g)
        if not (exact.isfinite().all() and plain.isfinite().all() and got.isfinite().all()) \
                or not exact.any():
            continue  # (a carried derivative past float32's or float16's range: README)
        assert got.dtype == torch.bfloat16
        ours.append(((got.double() - exact).norm() / exact.norm()).item())
        theirs.append(((plain.double() - exact).norm() / exact.norm()).item())
        worst = max(worst, ours[-1] / theirs[-1])
    assert len(ours) >= 50
    assert sum(ours) < sum(theirs), (sum(ours) / sum(theirs))
    assert worst < 4, worst

@pytest.mark.parametrize("how", ["function", "compose"])
@pytest.mark.parametrize("name", ["sigmoid", "tanh"])
def test_output_changed_in_place_trains_where_torchs_refuses(name, how):
    """torch's Sigmoid and Tanh save their output, so changing it in place
    (y.mul_(2)) makes torch's backward raise; reprop's save f'(x), not y, and
    train with the gradient of the out-of-place program (found by the
    random differential test; README)."""
    ours, theirs, _ = ACTIVATIONS[name]
    x0 = torch.randn(64)

    def grad_of(act, inplace, mode=contextlib.nullcontext()):
        x = x0.clone().requires_grad_()
        with mode:
            y = act(x * 1.0)
            y = y.mul_(2) if inplace else y * 2
            (y * 3).sum().backward()
        return x.grad

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grad_of(theirs, True)
    got = (grad_of(ours, True) if how == "function"
           else grad_of(theirs, True, fad.enabled(compose=True)))
    torch.testing.assert_close(got, grad_of(theirs, False))


def test_compose_constant_changed_in_place_between_steps():
    """x * c carries c itself as the derivative; c changed in place before the
    next step must not change the gradient silently: autograd raises, and
    so must the chain (its node saved c)."""
    x = torch.randn(5, requires_grad=True)
    c = torch.full((5,), 3.0)
    with fad.enabled(compose=True):
        y = x * c
        c.mul_(10)
        z = torch.exp(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_compose_chain_tensors_with_hooks_stay_in_the_graph():
    """A chain tensor given a hook or retain_grad() before the next op is a
    root of what follows, so autograd reaches it: its hooks run (one that
    clips changes the input's gradient, as under plain autograd) and .grad
    is kept."""
    x = torch.randn(6)

    def run(compose):
        leaf, seen = x.clone().requires_grad_(), []
        with fad.enabled(compose=compose):
            s = torch.sigmoid(leaf)
            s.retain_grad()
            s.register_hook(lambda g: seen.append(g) or g.clamp(max=0.5))
            y = torch.exp(s) * leaf * 3
        y.sum().backward()
        return leaf.grad, s.grad, len(seen)

    (g, sg, calls), (g_ref, sg_ref, calls_ref) = run(True), run(False)
    assert calls == calls_ref == 1
    torch.testing.assert_close(sg, sg_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("register", ["register_prehook", "register_hook"])
def test_compose_hooks_on_a_chain_node_run(register):
    """A hook on a chain tensor's node (e.grad_fn.register_prehook or
    register_hook) given before the next op runs, as under plain autograd:
    the next step's node led past it straight to the root, so it never ran.
    A pre-hook that clips changes the input's gradient as under plain
    autograd; both see autograd's gradient of e."""
    x = torch.randn(6)

    def run(compose):
        leaf, seen = x.clone().requires_grad_(), []
        with fad.enabled(compose=compose):
            e = torch.exp(torch.sigmoid(leaf))
            if register == "register_prehook":
                e.grad_fn.register_prehook(lambda go: seen.append(go[0]) or (go[0].clamp(max=2.0),))
            else:
                e.grad_fn.register_hook(lambda gi, go: seen.append(go[0]))
            y = torch.exp(e) * leaf * 3
        y.sum().backward()
        return leaf.grad, seen

    (g, seen), (g_ref, seen_ref) = run(True), run(False)
    assert len(seen) == len(seen_ref) == 1
    torch.testing.assert_close(seen[0], seen_ref[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-7)


_LATE_HOOKS = {
    "register_hook": lambda a: a.register_hook(lambda g: None),
    "grad_fn.register_hook": lambda a: a.grad_fn.register_hook(lambda gi, go: None),
    "grad_fn.register_prehook": lambda a: a.grad_fn.register_prehook(lambda go: None),
    "register_multi_grad_hook": lambda a: torch.autograd.graph.register_multi_grad_hook(
        [a], lambda gs: None),
    "retain_grad": lambda a: a.retain_grad(),
}


@pytest.mark.parametrize("late", sorted(_LATE_HOOKS))
@pytest.mark.parametrize("inside", [True, False])
def test_compose_hook_after_the_next_op_is_refused(late, inside):
    """A hook or retain_grad() given to a chain tensor after its next op
    chained past it: that op's node leads straight to the root, so the
    tensor's node never ran, and the hook silently never fired (.grad stayed
    None; register_multi_grad_hook passed None). It is refused, inside the
    mode and after it (the tensor outlives it); retain_grad() after the mode,
    which runs no Python, by the node that leads past the tensor, in
    backward. A refused register_hook leaves no hook dict behind, so asking
    again is refused again."""
    x = torch.randn(4, 6, requires_grad=True)
    with fad.enabled(compose=True):
        a = F.softplus(x * 2)
        b = torch.tanh(a)
        if inside:
            with pytest.raises(RuntimeError, match="chained past it"):
                _LATE_HOOKS[late](a)
        out = torch.exp(b * 0.5)
    if inside:
        return
    if late == "retain_grad":
        a.retain_grad()
        with pytest.raises(RuntimeError, match="chained past it"):
            out.sum().backward()
        return
    for _ in range(2):
        with pytest.raises(RuntimeError, match="chained past it"):
            _LATE_HOOKS[late](a)


@pytest.mark.parametrize("mode", ["all", "any"])
@pytest.mark.parametrize("inside", [True, False])
def test_compose_refused_multi_grad_hook_leaves_no_hook(mode, inside):
    """register_multi_grad_hook on tensors of which one a next step led past
    is refused before anything is registered, naming what was called: torch
    registers on each tensor in turn, so the refusal of the led-past one left
    a live hook on the tensors before it (mode="any" ran the function in
    backward), under a message naming register_hook()."""
    x = torch.randn(4, 6, requires_grad=True)
    fired = []

    def register(tensors):
        with pytest.raises(RuntimeError) as refused:
            torch.autograd.graph.register_multi_grad_hook(tensors, fired.append, mode=mode)
        return tensors, str(refused.value)

    with fad.enabled(compose=True):
        a = x * 1.5
        b = torch.tanh(F.softplus(a))  # led past a, not b
        if inside:
            tensors, message = register((b, a))
        out = a * b  # led past b too
    if not inside:
        tensors, message = register((out, a))
    assert [t._backward_hooks for t in tensors] == [None, None]
    out.sum().backward()
    assert fired == []
    assert "register_multi_grad_hook() (tensors[1]) on a chain tensor" in message


_LED_PAST_INPUTS = {
    "grad, materialize_grads": lambda y, x, h: torch.autograd.grad(
        y, [x, h], materialize_grads=True),
    "grad, allow_unused": lambda y, x, h: torch.autograd.grad(y, [x, h], allow_unused=True),
    "grad, a dict": lambda y, x, h: torch.autograd.grad(y, {"x": x, "h": h}, allow_unused=True),
    "grad, a GradientEdge": lambda y, x, h: torch.autograd.grad(
        y, torch.autograd.graph.get_gradient_edge(h), allow_unused=True),
    "Tensor.backward": lambda y, x, h: y.backward(inputs=[h]),
    "autograd.backward, an iterator in place": lambda y, x, h: torch.autograd.backward(
        [y], None, None, False, None, iter([x, h])),
}


@pytest.mark.parametrize("call", sorted(_LED_PAST_INPUTS))
@pytest.mark.parametrize("inside", [True, False])
def test_compose_gradient_of_a_tensor_a_step_chained_past_is_refused(call, inside):
    """Asking autograd for the gradient of a chain tensor that a next step
    led past (inputs= of torch.autograd.grad, torch.autograd.backward,
    Tensor.backward): that step's node leads straight to the root, so the
    tensor's node gets nothing through it, and torch gave zeros
    (materialize_grads), None (allow_unused) or left .grad None, where its
    gradient is exp(3x). Refused before backward runs, inside the mode and
    after it, naming the input."""
    x = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    with fad.enabled(compose=True):
        h = x * 3
        y = torch.exp(h).sum()
        if inside:
            with pytest.raises(RuntimeError, match="chained past it") as refused:
                _LED_PAST_INPUTS[call](y, x, h)
    if not inside:
        with pytest.raises(RuntimeError, match="chained past it") as refused:
            _LED_PAST_INPUTS[call](y, x, h)
    label = {"grad, a dict": "inputs['h']", "grad, a GradientEdge": "inputs",
             "Tensor.backward": "inputs[0]"}.get(call, "inputs[1]")
    assert f"() ({label}) on a chain tensor" in str(refused.value)
    assert x.grad is None  # refused before backward ran


def test_compose_gradient_of_a_root_or_the_chain_is_torchs():
    """What no step led past stays torch's to answer: the root, and a chain
    tensor given retain_grad() before its next op (a root of what follows);
    inputs given as a one-shot iterator reach torch whole after the check."""
    x = torch.tensor([0.5, -1.0, 2.0])

    def run(compose):
        leaf = x.clone().requires_grad_()
        with fad.enabled(compose=compose):
            h = leaf * 3
            h.retain_grad()
            y = torch.exp(h * 0.5).sum()
        grads = torch.autograd.grad(y, iter([leaf, h]), retain_graph=True)
        torch.autograd.backward([y], None, None, False, None, iter([leaf]))
        return (*grads, leaf.grad)

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["all", "any"])
def test_compose_multi_grad_hook_takes_an_iterator_as_torch(mode):
    """The refusal's look at register_multi_grad_hook's tensors leaves a
    one-shot iterator to torch whole: mode="any" registers on each (the
    function fires once), mode="all" raises torch's TypeError (no len)."""
    x = torch.randn(4, 6)

    def run(compose):
        leaf, fired = x.clone().requires_grad_(), []
        with fad.enabled(compose=compose):
            a = torch.sigmoid(leaf)
            b = torch.exp(leaf)
            try:
                torch.autograd.graph.register_multi_grad_hook(
                    (t for t in (a, b)), lambda g: fired.append(g.clone()), mode=mode)
            except TypeError as e:
                return str(e)
            out = a * b
        out.sum().backward()
        return fired, leaf.grad

    got, want = run(True), run(False)
    if mode == "all":
        assert got == want
        return
    assert len(got[0]) == len(want[0]) == 1
    for g, w in zip((got[0][0], got[1]), (want[0][0], want[1])):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0)


def _run_fresh(code: str) -> list[str]:
    """The lines `code` prints in a fresh interpreter importing this reprop:
    what it does to torch's autograd functions, or to reprop.fad itself (a
    reload), stays out of this test process."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(fad.__file__))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def _reloading(namespace_cleared: bool) -> str:
    """Code for _run_fresh defining reload(module): importlib.reload, which
    re-runs the module in its namespace, or, namespace_cleared, as IPython's
    %autoreload does, which clears that namespace (but __name__ and
    __loader__) first, so nothing is found in the module's globals."""
    return f"""
    import importlib

    def reload(module):
        if {namespace_cleared}:
            kept = {{k: vars(module)[k] for k in ("__name__", "__loader__")}}
            vars(module).clear()
            vars(module).update(kept)
        return importlib.reload(module)
    """


_TORCHS_AUTOGRAD = """
    import torch
    torch.set_num_threads(1)
    AUTOGRAD = [(torch.autograd, "grad"), (torch.autograd, "backward"),
                (torch.autograd.graph, "register_multi_grad_hook")]
    TORCHS = [getattr(owner, name) for owner, name in AUTOGRAD]

    def report(stage):  # which functions are torch's own, and how deep each wrapper is
        def depth(f):
            return 0 if not hasattr(f, "__wrapped__") else 1 + depth(f.__wrapped__)
        now = [getattr(owner, name) for owner, name in AUTOGRAD]
        print(stage, *(f"{n}:{'torchs' if f is t else depth(f)}"
                       for (_, n), f, t in zip(AUTOGRAD, now, TORCHS)))
"""
# what _TORCHS_AUTOGRAD's report prints: each function torch's own, or wrapped once
_UNTOUCHED = ["grad:torchs", "backward:torchs", "register_multi_grad_hook:torchs"]
_WRAPPED_ONCE = ["grad:1", "backward:1", "register_multi_grad_hook:1"]


def test_importing_reprop_leaves_torchs_autograd_functions():
    """Importing reprop replaced torch.autograd.grad, torch.autograd.backward
    and register_multi_grad_hook for the whole process, for a user of its
    optimizers as much as of composed chains. They stay torch's own through
    the optimizers, fusion, patch() and enabled() (compose=True with a chain
    of one step too: nothing is led past), and are checked from the first
    step that leads past a chain tensor on, for good, as the refusals need."""
    out = _run_fresh(_TORCHS_AUTOGRAD + """
    import reprop
    from reprop import fad
    report("import")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    reprop.fuse(model, reprop.optim.AdamW(model.parameters()))
    fad.patch(model)
    x = torch.randn(2, 4, requires_grad=True)
    with fad.enabled():
        model(x).sum().backward()
    with fad.enabled(compose=True):
        h = torch.exp(x)
    report("one-step")
    with fad.enabled(compose=True):
        h2 = h * 2
        y = torch.exp(h2)
    report("led-past")
    try:
        torch.autograd.grad(y.sum(), [h2])
    except RuntimeError as e:
        print("refused" if "chained past it" in str(e) else e)
    """)
    assert out == ["import", *_UNTOUCHED, "one-step", *_UNTOUCHED, "led-past", *_WRAPPED_ONCE,
                   "refused"]


def test_led_past_refusals_over_another_librarys_plain_wrappers():
    """torch.autograd.grad and backward wrapped by another library before
    reprop is imported, as def wrapper(*args, **kwargs) with no
    functools.wraps: the first step that led past a chain tensor raised
    ValueError ('inputs' is not in list) out of the user's forward, reading
    where the wrapper takes `inputs`. The forward runs, and inputs= of a
    led-past tensor is still refused, by keyword or at torch's positions."""
    out = _run_fresh("""
    import torch
    torch.set_num_threads(1)

    def plain(run):
        def wrapper(*args, **kwargs):
            return run(*args, **kwargs)
        return wrapper

    torch.autograd.grad = plain(torch.autograd.grad)
    torch.autograd.backward = plain(torch.autograd.backward)
    import reprop.fad as fad
    x = torch.randn(3, requires_grad=True)
    with fad.enabled(compose=True):
        h = x * 2
        y = torch.exp(h)  # leads past h
    print("forward")
    for call in (lambda: torch.autograd.grad(y.sum(), inputs=[h]),
                 lambda: torch.autograd.grad(y.sum(), [h]),
                 lambda: y.sum().backward(inputs=[h]),
                 lambda: torch.autograd.backward(y.sum(), None, None, False, None, [h])):
        try:
            call()
        except RuntimeError as e:
            print("refused" if "chained past it" in str(e) else e)
    """)
    assert out == ["forward", "refused", "refused", "refused", "refused"]


@pytest.mark.parametrize("namespace_cleared", [False, True], ids=["importlib", "autoreload"])
def test_reloading_fad_wraps_torchs_autograd_functions_once(namespace_cleared: bool):
    """importlib.reload(reprop.fad) (what IPython's %autoreload 2 does) wrapped
    torch's autograd functions once more at each reload (register_multi_grad_hook
    four deep after three). They are wrapped once, before a reload or after
    it, and the refusal still holds."""
    out = _run_fresh(_TORCHS_AUTOGRAD + _reloading(namespace_cleared) + """
    import reprop.fad as fad

    def chained():
        x = torch.randn(3, requires_grad=True)
        with fad.enabled(compose=True):
            h = x * 2
            y = torch.exp(h)  # leads past h
        return y, h

    fad = reload(fad)
    report("reloaded")
    chained()
    report("chained")
    for _ in range(3):
        fad = reload(fad)
        y, h = chained()
    report("reloaded-thrice")
    try:
        torch.autograd.grad(y.sum(), [h])
    except RuntimeError as e:
        print("refused" if "chained past it" in str(e) else e)
    """)
    assert out == ["reloaded", *_UNTOUCHED, "chained", *_WRAPPED_ONCE, "reloaded-thrice",
                   *_WRAPPED_ONCE, "refused"]


@pytest.mark.parametrize("namespace_cleared", [False, True], ids=["importlib", "autoreload"])
def test_compose_chain_continues_across_a_reload(namespace_cleared: bool):
    """A mode entered before importlib.reload(reprop.fad) (by hand, in one
    notebook cell, with %autoreload 2 before the next) keeps its chain
    records: a record of relu or Hardswish of the root holds an instance of a
    class the reload replaced, which the next step took for a derivative
    tensor (a TypeError). The chain now goes on as without the reload."""
    out = _run_fresh(_reloading(namespace_cleared) + """
    import torch, torch.nn.functional as F
    torch.set_num_threads(1)
    import reprop.fad as fad
    x = torch.randn(6)

    def grad(first, reloaded):
        global fad
        leaf = x.clone().requires_grad_()
        mode = fad.enabled(compose=True)
        mode.__enter__()
        try:
            a = first(leaf)
            if reloaded:
                fad = reload(fad)
            y = torch.exp(a * 2)
        finally:
            mode.__exit__(None, None, None)
        y.sum().backward()
        return leaf.grad

    for first in (torch.relu, F.hardswish):
        print(first.__name__, torch.equal(grad(first, True), grad(first, False)))
    """)
    assert out == ["relu", "True", "hardswish", "True"]


@pytest.mark.parametrize("namespace_cleared", [False, True], ids=["importlib", "autoreload"])
def test_warnings_stay_reprops_class_across_a_reload_of_tensors(namespace_cleared: bool):
    """A filter by reprop.ReproPWarning (README's way to let reprop's
    warnings through a warnings-as-errors run) still holds after
    importlib.reload(reprop._tensors) (IPython's %autoreload 2 when reprop's
    files change): fad.patch's warning about an activation with a forward on
    the instance was of the reloaded module's new class, which the filter
    let through (raised here as an error)."""
    out = _run_fresh(_reloading(namespace_cleared) + """
    import warnings
    import torch
    import reprop, reprop._tensors
    from reprop import fad

    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=reprop.ReproPWarning)
    reload(reprop._tensors)
    act = torch.nn.GELU()
    act.forward = act.forward  # as accelerate's add_hook_to_module: fad.patch warns, leaves it
    try:
        print(fad.patch(torch.nn.Sequential(act)))
    except Warning as w:
        print(type(w).__name__, "let through")
    """)
    assert out == ["{}"]


def test_compose_retain_grad_after_the_mode_is_kept_where_nothing_led_past_it_runs():
    """retain_grad() after the mode on a chain tensor that a next step led
    past is refused only if that step's node runs: where only the tensor's
    own uses reach the loss, its node runs and .grad is torch's."""
    x = torch.randn(4, 6)

    def run(compose):
        leaf = x.clone().requires_grad_()
        with fad.enabled(compose=compose):
            a = F.softplus(leaf * 2)
            torch.tanh(a)  # led past a, never used
        a.retain_grad()
        (a * a).sum().backward()
        return a.grad, leaf.grad

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_compose_hook_after_a_removed_one_runs():
    """A chain tensor whose hook was removed before its next op keeps the
    (empty) hook dict Tensor.register_hook adds later hooks to without asking
    the node: it stays a root, so a hook given after the next op fires with
    torch's gradient (it silently never fired)."""
    x = torch.randn(4, 6)

    def run(compose):
        leaf, seen = x.clone().requires_grad_(), []
        with fad.enabled(compose=compose):
            a = F.softplus(leaf * 2)
            a.register_hook(lambda g: None).remove()
            b = torch.tanh(a)
            a.register_hook(seen.append)
            out = torch.exp(b * 0.5)
        out.sum().backward()
        return seen, leaf.grad

    (seen, g), (seen_ref, g_ref) = run(True), run(False)
    assert len(seen) == len(seen_ref) == 1
    # (where tanh saturates, 1 - tanh^2 is small and both lose digits to cancellation)
    torch.testing.assert_close(seen[0], seen_ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["tanh", "sigmoid", "softsign", "tanhshrink"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
def test_integer_input_is_promoted_as_torch_does(name, dtype):
    """torch promotes integer and bool input of these to float; the fad
    functions and patched modules refused it, so fad.patch broke a model
    that ran."""
    x = torch.arange(4).to(dtype)
    native = getattr(torch.nn.functional, name, None) or getattr(torch, name)
    module = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "softsign": nn.Softsign,
              "tanhshrink": nn.Tanhshrink}[name]
    model = nn.Sequential(module())
    fad.patch(model)
    try:
        want = native(x)
    except (NotImplementedError, RuntimeError) as refusal:  # bool: torch refuses some, so must we
        for ours in (getattr(fad, name), model):
            with pytest.raises(type(refusal)):
                ours(x)
        return
    torch.testing.assert_close(getattr(fad, name)(x), want, rtol=0, atol=0)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_negative_bit_tensors_match_torch():
    """A lazily negated view (is_neg: its memory holds -x) read through its
    pointer gave f(-x): fad.silu of (0.5+2j).conj().imag, -2.0, gave 1.76
    where torch gives -0.24; a negated gradient into the 8-bit backward gave
    grad * -f'(x)."""
    one = torch.tensor([0.5 + 2.0j]).conj().imag
    many = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))._neg_view()
    for x in (one, many):
        assert x.is_neg()
        for name in ("silu", "gelu", "tanh", "elu"):
            native = getattr(torch.nn.functional, name, None) or getattr(torch, name)
            torch.testing.assert_close(getattr(fad, name)(x), native(x), rtol=0, atol=0)
        with fad.enabled(compose=True):
            z = torch.tanh(x) * 2.0 + x
        torch.testing.assert_close(z, torch.tanh(x.resolve_neg()) * 2.0 + x.resolve_neg())
    leaf = torch.randn(4, 3, requires_grad=True)
    (got,) = torch.autograd.grad(fad.silu(leaf, saved_dtype=torch.uint8), leaf, many)
    (want,) = torch.autograd.grad(fad.silu(leaf, saved_dtype=torch.uint8), leaf, many.resolve_neg())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tanh", "sigmoid", "silu", "softsign", "tanhshrink"])
def test_complex_input_runs_torch(name):
    """torch computes these on complex input, so a patched complex model must
    still run: the functions and patched modules hand it to torch's op."""
    torch.manual_seed(0)
    z = torch.randn(5, dtype=torch.complex64)
    native = getattr(torch.nn.functional, name, None) or getattr(torch, name)
    torch.testing.assert_close(getattr(fad, name)(z), native(z), rtol=0, atol=0)
    if name != "silu":  # torch's silu has no complex backward
        zg = z.clone().requires_grad_()
        (g,) = torch.autograd.grad(getattr(fad, name)(zg).abs().sum(), zg)
        (ref,) = torch.autograd.grad(native(zg).abs().sum(), zg)
        torch.testing.assert_close(g, ref, rtol=0, atol=0)
    module = {"silu": nn.SiLU, "softsign": nn.Softsign, "tanhshrink": nn.Tanhshrink,
              "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}[name]
    model = nn.Sequential(module())
    fad.patch(model)
    torch.testing.assert_close(model(z), native(z), rtol=0, atol=0)


def test_compose_complex_constants_run_plain_autograd():
    """A complex constant makes a complex result, whose backward autograd
    conjugates: such ops are not chain steps (the chain's grad * d was the
    conjugate's sign off)."""
    x = torch.randn(3)
    w = torch.randn(3, dtype=torch.complex64)

    def run(compose):
        leaf = x.clone().requires_grad_()
        with fad.enabled(compose=compose):
            y = torch.exp(leaf) * w
        (g,) = torch.autograd.grad(y.imag.sum(), leaf)
        return g

    torch.testing.assert_close(run(True), run(False), rtol=1e-6, atol=0)


def test_compose_does_not_keep_finished_chains_alive():
    """The mode's records are weakly keyed by the chain tensor: one whose
    derivative is the tensor itself (exp of the root) must still die with
    its last reference, not at the end of the with block."""
    mode = fad.enabled(compose=True)
    x = torch.randn(64, requires_grad=True)
    with mode:
        refs = []
        for _ in range(5):
            y = torch.exp(x * 1.0)
            z = torch.exp(x)
            refs += [weakref.ref(y), weakref.ref(z)]
            del y, z
        gc.collect()
        assert all(r() is None for r in refs) and len(mode._chains.records) == 0


class _PauseInForward(torch.autograd.Function):
    """Identity whose forward, in the thread named `pausing`, lets `paused`
    know and waits for `resume` (an interleaving forced, not left to luck)."""

    pausing, paused, resume = None, None, None

    @staticmethod
    def forward(ctx, x):
        if threading.current_thread().name == _PauseInForward.pausing:
            _PauseInForward.paused.set()
            assert _PauseInForward.resume.wait(60)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _graph_nodes(t: torch.Tensor) -> list[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [f for f, _ in node.next_functions]
    return sorted(type(n).__name__ for n in seen)


@pytest.mark.parametrize("meanwhile", ["another thread's eval forward", "another thread's training",
                                       "a nested block"])
def test_compose_block_of_one_instance_keeps_the_chains_of_another_still_open(meanwhile):
    """One enabled(compose=True) instance entered by two threads at once (a
    module-level mode each worker enters), or nested in one: the exit of the
    other block dropped every record, so the chain of the block still
    running, paused mid-chain, went on as a new chain: a second node saving
    one tensor more, and a weight gradient 7e-9 off the same run alone. The
    records now go when the last block of the instance exits."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 128), torch.randn(128, 128).mul(0.05).requires_grad_()
    mode = fad.enabled(compose=True)

    def chained(other=None):
        root = x @ w
        h = F.gelu(root) * 2.0 + 1.0
        h = h.exp() * 0.5
        if other is not None:
            other()
        _PauseInForward.apply(x)  # mid-chain: h stays a chain tensor
        h = torch.tanh(h * 0.1) * 3.0
        return root, F.silu(h) - 0.25

    with mode:
        _, want = chained()
    (want_grad,) = torch.autograd.grad(want.square().sum(), w)

    def other_block():
        with mode:
            if meanwhile == "another thread's training":
                torch.autograd.grad((torch.exp(w * 2.0) + 1.0).sum(), w)
            else:
                with torch.no_grad():
                    torch.exp(w * 2.0) + 1.0

    got = {}

    def train():
        with mode:
            got["root"], got["out"] = chained(other_block if meanwhile == "a nested block" else None)
        got["left"] = len(mode._chains.records)  # (this thread's)

    _PauseInForward.paused, _PauseInForward.resume = threading.Event(), threading.Event()
    _PauseInForward.pausing = "trainer" if meanwhile != "a nested block" else None
    trainer = threading.Thread(target=train, name="trainer")
    try:
        trainer.start()
        if meanwhile != "a nested block":
            assert _PauseInForward.paused.wait(60)
            other = threading.Thread(target=other_block)
            other.start()
            other.join(60)
        _PauseInForward.resume.set()
        trainer.join(60)
    finally:
        _PauseInForward.pausing = None
        _PauseInForward.resume.set()
    assert not trainer.is_alive()
    assert _graph_nodes(got["out"]) == ["AccumulateGrad", "MmBackward0", "_ChainBackward"]
    (grad,) = torch.autograd.grad(got["out"].square().sum(), w)
    assert torch.equal(got["out"], want) and torch.equal(grad, want_grad)
    assert got["left"] == 0  # the thread's outermost exit dropped them


def test_consecutive_compose_blocks_of_a_thread_end_their_chains_while_another_holds_one_open(monkeypatch):
    """Counting one instance's open blocks over all threads, one thread's two
    consecutive blocks chained across the exit between them while another
    thread held a block open (one node fewer, a weight gradient 7e-7 off the
    run alone); an interrupt in __exit__ left the count up, and every later
    block of the instance chained on. Each thread's chains now end at its
    own outermost exit, and an entry finds nothing of a block cut short."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 128), torch.randn(128, 128).mul(0.05).requires_grad_()
    mode = fad.enabled(compose=True)

    def two_blocks():
        with mode:
            root = x @ w  # (bound: a temporary root's chain restarts at every step)
            h = F.gelu(root) * 2.0 + 1.0
        with mode:
            out = F.silu(torch.tanh(h * 0.1) * 3.0) - 0.25
        return out, torch.autograd.grad(out.square().sum(), w)[0]

    want, want_grad = two_blocks()
    opened, release, got = threading.Event(), threading.Event(), {}

    def holder():
        with mode:
            opened.set()
            release.wait(60)

    held = threading.Thread(target=holder)
    held.start()
    try:
        assert opened.wait(60)
        worker = threading.Thread(target=lambda: got.setdefault("run", two_blocks()))
        worker.start()
        worker.join(60)
    finally:
        release.set()
        held.join(60)
    out, grad = got["run"]
    assert _graph_nodes(out) == _graph_nodes(want)
    assert torch.equal(out, want) and torch.equal(grad, want_grad)

    mode.__enter__()  # a block whose exit an interrupt cuts short after the pop
    F.gelu(x @ w) * 2.0
    mode._chains.copies = True  # (what a bfloat16 saved copy sets: every op then looks at chains)

    def interrupted(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(fad, "_on_function_stack", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mode.__exit__(None, None, None)
    monkeypatch.undo()
    assert torch._C._len_torch_function_stack() == 0 and mode._chains.copies
    out, grad = two_blocks()
    assert _graph_nodes(out) == _graph_nodes(want) and torch.equal(grad, want_grad)


@pytest.mark.parametrize("compose", [False, True])
def test_enabled_passes_out_and_nested_autocast(compose):
    """out= goes to torch's op as written; an enabled() nested in another
    under autocast gives autocast's dtype and torch's gradient."""
    x = torch.randn(4, 8)
    buf = torch.empty(4, 8)
    with fad.enabled(compose=compose):
        y = torch.tanh(x, out=buf)
    assert y is buf and torch.equal(buf, torch.tanh(x))
    leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16), fad.enabled(compose=True), fad.enabled(compose=compose):
        y = F.gelu(leaf @ torch.eye(8)) * leaf
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_leaf = x.clone().requires_grad_()
        ref = F.gelu(ref_leaf @ torch.eye(8)) * ref_leaf
    assert y.dtype == ref.dtype
    y.float().sum().backward()
    ref.float().sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-2, atol=1e-2)


def test_forward_ad_functorch_and_meta_run_torch_ops():
    """Dual tensors keep their tangent, functorch transforms work, and meta
    tensors get torch's shapes: such inputs run torch's own activation (the
    raw kernels would drop the tangent or fail on a wrapper without data)."""
    x, t = torch.randn(5), torch.randn(5)
    _, ref_tangent = torch.func.jvp(F.gelu, (x,), (t,))
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, t)
        assert torch.equal(fwAD.unpack_dual(fad.gelu(dual)).tangent, ref_tangent)
        with fad.enabled(compose=True):
            assert torch.equal(fwAD.unpack_dual(F.gelu(dual)).tangent, ref_tangent)
    assert torch.equal(torch.func.jvp(fad.gelu, (x,), (t,))[1], ref_tangent)
    batch = torch.randn(3, 5)
    torch.testing.assert_close(torch.func.vmap(fad.silu)(batch), F.silu(batch), rtol=0, atol=0)
    torch.testing.assert_close(torch.func.grad(lambda v: fad.mish(v).sum())(x),
                               torch.func.grad(lambda v: F.mish(v).sum())(x), rtol=1e-6, atol=1e-7)
    meta = fad.elu(torch.empty(2, 3, device="meta"), 0.5)
    assert meta.device.type == "meta" and meta.shape == (2, 3)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("how", ["function", "patched", "enabled", "compose"])
def test_nested_tensors_run_torch_ops(how):
    """A nested tensor (strided layout, so no layout check caught it) reached
    the kernels and raised torch's "Internal error: NestedTensorImpl doesn't
    support sizes" where torch's ops compute and backpropagate."""
    act, mode = F.gelu, contextlib.nullcontext()
    if how == "function":
        act = fad.gelu
    elif how == "patched":
        act = nn.Sequential(nn.GELU())
        fad.patch(act)
    elif how == "enabled":
        mode = fad.enabled()
    else:
        act, mode = (lambda t: F.gelu(t * 2.0 + t)), fad.enabled(compose=True)

    def run(act, mode):
        x = torch.nested.nested_tensor([torch.linspace(-2.0, 2.0, 3), torch.linspace(-1.0, 3.0, 5)],
                                       requires_grad=True)
        with mode:
            y = act(x)
        y.backward(torch.nested.nested_tensor([torch.full((3,), 0.5), torch.full((5,), -2.0)]))
        return [*y.detach().unbind(), *x.grad.unbind()]

    ref = run(lambda t: F.gelu(t * 2.0 + t) if how == "compose" else F.gelu(t),
              contextlib.nullcontext())
    got = run(act, mode)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_compose_under_functorch_transforms_runs_torch_ops():
    """Under torch.func's transforms no op is a chain step: one on a root
    they do not wrap (a closure's tensor that requires grad) raised their
    refusal of an autograd.Function without setup_context, where torch's
    ops give the gradient."""
    w, v = torch.randn(3, requires_grad=True), torch.randn(3)

    def loss(v, compose):
        with fad.enabled(compose=True) if compose else contextlib.nullcontext():
            return (torch.exp(w) * 2 * torch.tanh(v)).sum()

    want = torch.func.grad(loss)(v, False)
    assert torch.equal(torch.func.grad(loss)(v, True), want)
    assert torch.equal(torch.vmap(lambda r: torch.func.grad(loss)(r, True))(v.expand(2, 3)),
                       want.expand(2, 3))


def test_activations_under_functorch_transforms_run_torch_ops():
    """An activation on a tensor a torch.func transform does not wrap (a
    closure's tensor that requires grad) raised the transforms' refusal of
    an autograd.Function without setup_context: rerouted by enabled(), the
    fad functions and a patched module run torch's ops there, as chain
    steps do."""
    w, v = torch.randn(3, requires_grad=True), torch.randn(3)

    def loss(v, mode):
        with mode:
            return (F.gelu(w) * torch.tanh(v)).sum()

    want = torch.func.grad(loss)(v, contextlib.nullcontext())
    for compose in (False, True):
        assert torch.equal(torch.func.grad(loss)(v, fad.enabled(compose=compose)), want)
    assert torch.equal(torch.func.grad(lambda v: (fad.gelu(w) * torch.tanh(v)).sum())(v), want)
    rows = torch.randn(2, 3)
    want_rows = torch.vmap(lambda r: F.silu(w) * r)(rows)
    assert torch.equal(torch.vmap(lambda r: fad.SiLU()(w) * r)(rows), want_rows)
    patched = nn.Sequential(nn.SiLU())
    fad.patch(patched)
    assert torch.equal(torch.vmap(lambda r: patched(w) * r)(rows), want_rows)


@pytest.mark.filterwarnings("ignore")
def test_tracing_and_export_run_torch_ops():
    """torch.jit.trace cannot see a kernel writing through a pointer (under
    no_grad it recorded an empty_like: the traced model returned garbage),
    and torch.export's FakeTensors have no data: both must get torch's ops."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 3), nn.SiLU())
    model = copy.deepcopy(ref)
    fad.patch(model)
    x, x2 = torch.randn(2, 4), torch.randn(5, 4)
    with torch.no_grad():
        traced = torch.jit.trace(model.eval(), x)
    torch.testing.assert_close(traced(x2), ref(x2), rtol=1e-6, atol=1e-7)
    exported = torch.export.export(model, (x,))
    torch.testing.assert_close(exported.module()(x), ref(x), rtol=1e-6, atol=1e-7)


def test_fake_tensor_mode_over_real_tensors_runs_torch_ops():
    """A memory dry run of a real model (FakeTensorMode with
    allow_non_fake_inputs=True) hands an activation a real tensor whose
    output torch makes fake: the kernels got its null pointer (ValueError
    'NULL data pointer'), in the functions, patched modules and chains.
    Now torch's ops run, as for a FakeTensor, with torch's shapes."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    x = torch.randn(3, 4, requires_grad=True)
    patched = nn.Sequential(nn.GELU(), nn.Linear(4, 2))
    fad.patch(patched, saved_dtype=torch.uint8)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for y, shape in ((fad.gelu(x), (3, 4)), (fad.silu(x, saved_dtype=torch.uint8), (3, 4)),
                         (fad.elu(x * 1, inplace=True), (3, 4)), (patched(x), (3, 2))):
            assert isinstance(y, FakeTensor) and y.shape == shape
            y.sum().backward()
        with fad.enabled(compose=True):
            chain = x * torch.tanh(F.softplus(x))
        assert isinstance(chain, FakeTensor) and chain.shape == x.shape
        chain.sum().backward()


class _ActivationAttribute(nn.Module):
    """A layer calling a function attribute, as nn.TransformerEncoderLayer
    does (which torch.fx.symbolic_trace cannot trace itself)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.activation = F.gelu

    def forward(self, x):
        return self.activation(self.linear(x))


def test_fx_symbolic_trace_of_a_patched_model_records_torch_ops():
    """symbolic_trace traces into a patched module (its class is reprop's, so
    no leaf) and a rerouted function attribute with an FX Proxy, which the
    functions refused (TypeError: input must be a torch.Tensor): torch's
    op records itself, and the GraphModule computes torch's activations."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.SiLU(inplace=True),
                        _ActivationAttribute())
    model = copy.deepcopy(ref)
    assert sorted(fad.patch(model)) == ["1", "3", "4.activation"]
    traced = torch.fx.symbolic_trace(model)
    called = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert called == {F.gelu, F.silu}
    x = torch.randn(5, 4)
    assert torch.equal(traced(x), ref(x))


def test_script_of_a_patched_model_says_what_to_do():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    fad.patch(model)
    with pytest.raises(RuntimeError, match="reprop.fad.GELU .*cannot be scripted.*unpatch"):
        torch.jit.script(model)
    assert type(model[1]) is fad.GELU  # still patched
    fad.unpatch(model)
    torch.jit.script(model)


def test_script_of_a_model_built_with_reprop_modules_says_what_to_do():
    """A model built with reprop.fad.GELU (not patched): unpatch() does
    nothing for it, so the error says to use torch's module, not to unpatch."""
    model = nn.Sequential(nn.Linear(4, 4), fad.GELU())
    with pytest.raises(RuntimeError, match="reprop.fad.GELU .*cannot be scripted; use "
                                           r"torch.nn.GELU in its place") as raised:
        torch.jit.script(model)
    assert "unpatch" not in str(raised.value)
    assert fad.unpatch(model) == []


def test_compose_leaves_tensor_subclasses_alone():
    p = nn.Parameter(torch.randn(8))
    with fad.enabled(compose=True):
        y = p * torch.sigmoid(p)
    y.sum().backward()
    torch.testing.assert_close(p.grad, torch.sigmoid(p) * (1 + p * (1 - torch.sigmoid(p))),
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Training equivalence over 100 steps
# ---------------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), act(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x):
        return self.body(x)


class SmallTransformer(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.ffn = nn.Sequential(nn.Linear(32, 64), act(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        h = self.embed(ids)
        h = self.norm1(h + self.attn(h, h, h, need_weights=False)[0])
        h = self.norm2(h + self.ffn(h))
        return self.head(h)


def train(model, batches, steps=100):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        out = model(x)
        loss = F.cross_entropy(out.flatten(0, -2), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def cnn_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 3, 12, 12, generator=g), torch.randint(10, (8,), generator=g))
            for _ in range(4)]


def transformer_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(50, (4, 12), generator=g), torch.randint(50, (4, 12), generator=g))
            for _ in range(4)]


@pytest.mark.parametrize("saved_dtype", [None, torch.uint8], ids=["default", "8bit"])
@pytest.mark.parametrize("net", ["cnn_mish", "transformer_gelu"])
def test_training_equivalence(net, saved_dtype):
    """Default storage follows native PyTorch's loss curve to float32 rounding:
    reprop's math differs from torch's by ulps, which 100 steps of SGD with
    momentum amplify only mildly (measured: max relative loss difference 4e-7
    for the CNN, 1.1e-5 for the transformer). 8-bit storage stays within 0.5%
    of it (measured 7e-4 and 1.5e-4; each element's derivative is off by at
    most half a codebook step)."""
    make, act, batches = ((SmallCNN, nn.Mish, cnn_batches()) if net == "cnn_mish"
                          else (SmallTransformer, nn.GELU, transformer_batches()))
    torch.manual_seed(0)
    ref = make(act)
    ours = make(act)
    ours.load_state_dict(ref.state_dict())
    fad.patch(ours, saved_dtype=saved_dtype)
    losses_ref, losses = train(ref, batches), train(ours, batches)
    assert losses_ref[-1] < 0.7 * losses_ref[0]  # it does learn
    if saved_dtype is None:
        torch.testing.assert_close(losses, losses_ref, rtol=5e-5, atol=0)
    else:
        torch.testing.assert_close(losses, losses_ref, rtol=5e-3, atol=0)
        assert not torch.equal(losses, losses_ref)  # the 8-bit codes were really used


def test_training_equivalence_composed():
    """A CNN written with composed Mish trains the same under enabled(compose=True)."""

    class ComposedMish(nn.Module):
        def forward(self, x):
            return mish_composed(x)

    torch.manual_seed(0)
    ref = SmallCNN(ComposedMish)
    ours = SmallCNN(ComposedMish)
    ours.load_state_dict(ref.state_dict())
    batches = cnn_batches()
    losses_ref = train(ref, batches)
    with fad.enabled(compose=True):
        losses = train(ours, batches)
    torch.testing.assert_close(losses, losses_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("saved_dtype", [None, torch.uint8], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_thread_count_does_not_change_a_bit(dtype, saved_dtype):
    """README (Reproducibility): the CPU kernels split their work over
    torch.get_num_threads() threads in fixed chunks, each element computed
    alone, so 1, 2 and 3 threads give the same bits, forward and backward,
    past the size where they go parallel (an odd size: a scalar tail)."""
    x = sample("cpu", dtype, n=(1 << 15) + 37)  # past RP_FAD_PARALLEL_MIN (csrc/fad.c)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    runs = []
    for count in (1, 2, 3):
        with torch_threads(count):
            runs.append([values_and_grads(lambda t: ours(t, saved_dtype=saved_dtype, **kw), x, grad)
                         for ours, _, kw in ACTIVATIONS.values()])
    for run in runs[1:]:
        for name, (y, gx), (y1, gx1) in zip(ACTIVATIONS, run, runs[0]):
            assert torch.equal(y.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               y1.view(torch.int16 if dtype != torch.float32 else torch.int32)), name
            torch.testing.assert_close(gx, gx1, rtol=0, atol=0, equal_nan=True, msg=name)


# ---------------------------------------------------------------------------
# CUDA: the same kernels' math as the CPU, bit for bit
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("saved_dtype", [None, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_cuda_equals_cpu_bitwise(name, dtype, saved_dtype):
    """Values and gradients bit for bit, the sign of zero included, and NaN
    where the CPU has NaN, but not the NaN's bits: x86 gives an invalid
    operation's default NaN 0xffc00000 and passes an input NaN's payload
    on, CUDA gives its canonical 0x7fffffff."""
    ours, _, kw = ACTIVATIONS[name]
    x = sample("cpu", dtype, n=1 << 16)
    grad = torch.randn(x.shape).to(dtype)
    y, gx = values_and_grads(lambda t: ours(t, saved_dtype=saved_dtype, **kw), x, grad)
    y_c, gx_c = values_and_grads(lambda t: ours(t, saved_dtype=saved_dtype, **kw), x.cuda(),
                                 grad.cuda())
    assert y_c.dtype == dtype and gx_c.dtype == dtype
    assert _same_bits(y_c.cpu(), y).all(), x[~_same_bits(y_c.cpu(), y)][:4]
    assert _same_bits(gx_c.cpu(), gx).all(), x[~_same_bits(gx_c.cpu(), gx)][:4]


@pytest.mark.gpu
def test_cuda_runs_on_current_stream_and_misaligned():
    """Forward and backward on a side stream over a misaligned view: every
    element as accurate as test_matches_torch requires, not close to torch's
    CUDA values: where GELU's terms cancel (1 + erf(x / sqrt 2) near
    x = -4.5, f' near -0.75) each of the two loses its own 0.5% (reprop's
    values being its CPU's bits)."""
    base = torch.randn((1 << 20) + 1, device="cuda", requires_grad=True)
    x = base[1:]  # misaligned for vector loads
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # base is written on the default stream
    with torch.cuda.stream(s):
        y = fad.gelu(x)
        y.sum().backward()
    s.synchronize()
    check_results_against_torch("gelu", x.detach(), torch.ones_like(x), y.detach(), base.grad[1:])


# ---------------------------------------------------------------------------
# Mutation-testing survivors (see the commit message): each test below fails
# on one mutant of fad.py that the rest of this file let pass.
# ---------------------------------------------------------------------------


def test_unpatch_leaves_the_torch_modules_attributes_as_before_patch():
    """unpatch() restores a torch module exactly: its class and its instance
    attributes, with no saved_dtype left behind (a plain nn.GELU has none,
    and a copy or pickle of the unpatched model must not carry reprop's).
    Kills dropping the pop of saved_dtype in unpatch."""
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.ELU(alpha=0.5))
    before = [set(vars(m)) for m in model]
    fad.patch(model, saved_dtype=torch.bfloat16)
    assert all(m.saved_dtype is torch.bfloat16 for m in model[1:])
    assert sorted(fad.unpatch(model)) == ["1", "2"]
    assert [set(vars(m)) for m in model] == before
    assert not any(hasattr(m, "saved_dtype") for m in model)
    assert type(model[1]) is nn.GELU and type(model[2]) is nn.ELU and model[2].alpha == 0.5


def _compose_grad(compose: bool, edit, op: str = "exp"):
    """d/dx of 3 * op(h) with h = x.clone(), `edit` run after the op."""
    x = torch.linspace(-1.0, 1.0, 7, requires_grad=True)
    with fad.enabled(compose=True) if compose else contextlib.nullcontext():
        h = x.clone()
        y = getattr(torch, op)(h)
        edit(h, y)
        z = y * 3.0
    z.sum().backward()
    return x.grad


def test_compose_root_changed_in_place_after_a_step_ends_the_chain():
    """The chain's root changed in place (with grad: autograd records the op
    on it) after a step: a next step must not lead past that step straight to
    the root, whose node is now the in-place op's (its gradient would be
    doubled here). Equal to plain autograd. Kills dropping the root's version
    check in enabled._root_of."""
    def edit(h, y):
        h.mul_(2.0)
    assert torch.equal(_compose_grad(True, edit), _compose_grad(False, edit))


@pytest.mark.parametrize("op", ["exp", "relu"])
def test_compose_chain_tensor_changed_in_place_under_no_grad_raises_as_autograd(op):
    """A chain tensor changed in place under no_grad (its node unchanged, its
    version bumped) and used by a next step: autograd's check of the output
    exp or relu saved raises, as in plain autograd; chaining past it would
    use the new value as the derivative, silently wrong. relu kills dropping
    the chain tensor's version check in enabled._root_of (relu of the root
    keeps no derivative of its own, whose version would catch it: it gave
    a gradient of 3s, no error); exp is caught by either check."""
    def edit(h, y):
        with torch.no_grad():
            y.add_(1.0)
    for compose in (False, True):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _compose_grad(compose, edit, op)


@pytest.mark.parametrize("op", ["exp", "relu"])
def test_compose_data_swapped_on_a_chain_tensor_keeps_its_recorded_derivative(op):
    """`y.data = ...` on a chain tensor whose derivative is its own value (exp
    of the root) or is found from it (relu of the root) swaps its data
    without bumping its version. The next step y * y must take the new data
    as its value and the derivative from the data y had, as autograd does
    (exp's and relu's nodes keep the output they saved): reading y's data
    when the step comes gave 2 * 100 * 100 for exp, and the new data's signs
    for relu, silently. Kills taking the derivative from the tensor's
    current data in _carried."""
    grads = []
    for compose in (False, True):
        x = torch.linspace(-1.0, 1.0, 7, requires_grad=True)
        with fad.enabled(compose=True) if compose else contextlib.nullcontext():
            y = getattr(torch, op)(x)
            y.data = torch.linspace(100.0, -100.0, 7)  # the opposite signs of x
            z = y * y
        z.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[1], grads[0])


def test_compose_zero_dim_float32_factor_of_a_half_chain_keeps_its_precision():
    """x * c for a float16 chain and a 0-d float32 CPU constant c: torch's
    kernels read c as a scalar at its own precision, in the forward and in
    MulBackward (2047 * 1.0003 rounds to 2048 in float16, 2047 * half(c) =
    2047 does not), so the chain node keeps c as it is. Kills rounding a 0-d
    derivative to the chain's dtype in enabled._stored."""
    c = torch.tensor(1.0003)
    grads = []
    for compose in (False, True):
        x = torch.full((4,), 3.0, dtype=torch.float16, requires_grad=True)
        with fad.enabled(compose=compose):
            y = x * c
        y.backward(torch.full_like(y, 2047.0))
        grads.append(x.grad)
    assert grads[0].dtype is torch.float16 and torch.equal(grads[0], torch.full_like(grads[0], 2048.0))
    assert torch.equal(grads[1], grads[0])


# ---------------------------------------------------------------------------
# A KeyboardInterrupt (a notebook's stop button) midway through reprop's own
# bookkeeping: injected deterministically, then the state must be torch's
# ---------------------------------------------------------------------------


@pytest.fixture
def function_mode_stack():
    """Pops what a failing test left on torch's function-mode stack, so that
    the rest of the session does not run under a stray enabled()."""
    depth = torch._C._len_torch_function_stack()
    yield
    while torch._C._len_torch_function_stack() > depth:
        torch._C._pop_torch_function_stack()


def _assert_no_mode_and_enabled_trains_as_torch():
    """The stack is empty (later code runs plain torch), and enabled() still
    enters, exits and gives autograd's gradients."""
    assert torch._C._len_torch_function_stack() == 0
    z = torch.randn(5, requires_grad=True)
    assert type((z * torch.tanh(F.softplus(z))).grad_fn).__name__ == "MulBackward0"
    _, g, _ = run_chain(mish_composed, z.detach(), torch.ones(5), compose=True)
    assert torch._C._len_torch_function_stack() == 0
    (g_ref,) = torch.autograd.grad(mish_composed(z).sum(), z)
    torch.testing.assert_close(g, g_ref, rtol=4e-6, atol=1e-7)


def test_enabled_interrupted_in_its_exit_leaves_the_stack(monkeypatch, function_mode_stack):
    """An interrupt in __exit__'s reset of the chain records (a Python-level
    constructor), before the pop, left the mode on torch's function-mode
    stack for the session: every later expression was chained, and each new
    enabled() left the stack at one. The pop now runs in a finally."""

    class Stop:
        def __init__(self):
            monkeypatch.undo()
            raise KeyboardInterrupt

    x = torch.randn(5, requires_grad=True)
    with pytest.raises(KeyboardInterrupt):
        with fad.enabled(compose=True):
            y = mish_composed(x)
            monkeypatch.setattr(fad, "WeakTensorKeyDictionary", Stop)
    (g,) = torch.autograd.grad(y.sum(), x)
    (g_ref,) = torch.autograd.grad(mish_composed(x).sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=4e-6, atol=1e-7)
    _assert_no_mode_and_enabled_trains_as_torch()


def test_enabled_interrupted_as_it_enters_leaves_the_stack(monkeypatch, function_mode_stack):
    """An interrupt delivered as torch's push of the mode returned (a signal
    arriving during a C call is raised in its caller as the call returns)
    left the mode on the stack: `with` runs no __exit__ for an __enter__
    that raised. __enter__ now pops what it pushed before re-raising."""

    def push_then_stop(mode):
        monkeypatch.undo()
        torch._C._push_on_torch_function_stack(mode)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.overrides, "_push_mode", push_then_stop)
    body_ran = False
    with pytest.raises(KeyboardInterrupt):
        with fad.enabled(compose=True):
            body_ran = True
    assert not body_ran
    _assert_no_mode_and_enabled_trains_as_torch()


def _assert_as_torchs(model: nn.Module, ref: nn.Module, x: torch.Tensor):
    """model is torch's again: its modules' classes and attributes (the very
    functions) as ref's, an untouched copy, and its forward and gradient
    bitwise ref's."""
    for m, r in zip(model.modules(), ref.modules(), strict=True):
        assert type(m) is type(r) and set(vars(m)) == set(vars(r))
        for attr, value in vars(r).items():
            if callable(value) and not isinstance(value, nn.Module):
                assert vars(m)[attr] is value, attr
    out, out_ref = model(x), ref(x)
    assert torch.equal(out, out_ref)
    grads = torch.autograd.grad(out.sum(), list(model.parameters()))
    grads_ref = torch.autograd.grad(out_ref.sum(), list(ref.parameters()))
    assert all(torch.equal(g, g_ref) for g, g_ref in zip(grads, grads_ref, strict=True))


def _assert_patched(model: nn.Module, ref: nn.Module, saved_dtype):
    """Every activation patch() takes is reprop's, saving saved_dtype."""
    for m, r in zip(model.modules(), ref.modules(), strict=True):
        if type(r) in (nn.GELU, nn.ELU):
            assert type(m) is getattr(fad, type(r).__name__) and m.saved_dtype is saved_dtype
        for attr, value in vars(r).items():
            if value is F.silu or value is torch.celu:
                assert vars(m)[attr].args == (getattr(fad, value.__name__), value), attr
                assert vars(m)[attr].keywords == {"saved_dtype": saved_dtype}, attr


class _Activations(nn.Module):
    """A weight, torch's GELU and ELU modules, and (attributes) torch's
    functional activations held as attributes: torch.celu, as F.celu,
    goes to reprop.fad.celu, so the partial alone does not say which."""

    def __init__(self, attributes: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-2.0, 2.0, 4))
        self.gelu, self.elu = nn.GELU(), nn.ELU(alpha=0.5)
        if attributes:
            self.fn, self.g, self.other = F.silu, torch.celu, F.relu

    def forward(self, x):
        x = self.elu(self.gelu(x * self.weight))
        return self.other(self.g(self.fn(x))) if hasattr(self, "fn") else x


# what patch() and unpatch() run that changes a model: the rest of fad.py they
# call reads it, so an interrupt there is one before the line calling it
_WRITING_THE_MODEL = (fad.patch, fad.unpatch, fad._patch_function_attributes)


@pytest.mark.parametrize("attributes", [False, True], ids=["modules", "function_attributes"])
@pytest.mark.parametrize("interrupted", ["patch", "patch_again", "unpatch"])
def test_patch_and_unpatch_interrupted_anywhere_run_again(interrupted, attributes):
    """A KeyboardInterrupt before any line patch() or unpatch() runs leaves a
    model that patch() and unpatch() run again complete: saved_dtype as
    asked, then torch's classes, attributes and training. patch() swapped a
    module's class before recording it (a re-run saw a reprop class it does
    not patch: saved_dtype stayed, and unpatch had no record to restore),
    and unpatch() dropped the record before restoring the class (for good).
    Function attributes: patch() dropped the earlier records before
    rerouting and stored the new ones after, and unpatch() dropped them
    before restoring: an attribute left holding reprop's partial without
    its record was the user's to both, and stayed reprop's (with the old
    saved_dtype when the interrupted call changed it)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    ref = _Activations(attributes)
    for k in itertools.count(1):
        model = _Activations(attributes)
        if interrupted != "patch":
            fad.patch(model, saved_dtype=None if interrupted == "patch_again" else torch.float16)
        call = (functools.partial(fad.unpatch, model) if interrupted == "unpatch"
                else functools.partial(fad.patch, model, saved_dtype=torch.bfloat16))
        if not interrupted_at_line(k, call, _WRITING_THE_MODEL):
            break
        if interrupted == "unpatch":
            fad.unpatch(model)
            _assert_as_torchs(model, ref, x)
        fad.patch(model, saved_dtype=torch.bfloat16)
        _assert_patched(model, ref, torch.bfloat16)
        fad.unpatch(model)
        _assert_as_torchs(model, ref, x)
    assert k > 20  # it did stop them midway


class _Chains(nn.Module):
    """Element-wise chains of enabled(compose=True) between two Linears: a
    reprop activation in a chain (_captured) and a select (relu) continued
    by a power, the two chains of one root joined, leaving into a Linear (YN)."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.lin1(x)
        return self.lin2(F.silu(h) * 2.0 + torch.relu(h) ** 2)


class _Patched(nn.Module):
    """fad.patch's activations (reprop's autograd Function) between Linears:
    an 8-bit-coded GELU, a LeakyReLU (two outputs: its anchor) and a
    Hardswish (a select)."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.acts = nn.Sequential(nn.GELU(), nn.LeakyReLU(0.2), nn.Hardswish())

    def forward(self, x):
        return self.lin2(self.acts(self.lin1(x)))


def _sgd_steps(model, mode, x, steps):
    """`steps` SGD steps of model, its forward inside `mode`; each step's
    output and gradients."""
    runs = []
    for _ in range(steps):
        with mode:
            out = model(x)
        grads = torch.autograd.grad(out.square().mean(), list(model.parameters()))
        with torch.no_grad():
            torch._foreach_add_(list(model.parameters()), grads, alpha=-0.05)
        runs.append((out.detach(), grads))
    return runs


def _stopped_before_exit_ran(stop: KeyboardInterrupt) -> bool:
    """Whether LineStop raised `stop` before the first statement of
    enabled.__exit__: the one stop the mode cannot survive (README)."""
    *_, (frame, line), _ = traceback.walk_tb(stop.__traceback__)  # (the last: the trace function)
    code = fad.enabled.__exit__.__code__
    first = min(n for *_, n in code.co_lines() if n is not None and n > code.co_firstlineno)
    return frame.f_code is code and line == first


def _assert_left_clean(stop: KeyboardInterrupt):
    """After a stop in enabled(): no mode left on torch's function-mode stack
    (but where __exit__ ran none of its statements: popped, as README
    says to), grad mode on, and reprop's activations return their output,
    not the (y, f'(x)) a chain step captures."""
    if _stopped_before_exit_ran(stop):
        assert torch._C._len_torch_function_stack() == 1
        torch._C._pop_torch_function_stack()
    assert torch._C._len_torch_function_stack() == 0 and torch.is_grad_enabled()
    assert isinstance(fad.silu(torch.ones(3, requires_grad=True)), torch.Tensor)
    assert not fad._capture.on


@pytest.mark.parametrize("phase, saved_dtype", [("first_forward", None),
                                                ("later_forward", torch.bfloat16),
                                                ("backward", None)], ids=["first_forward",
                                                                          "later_forward_bf16",
                                                                          "backward"])
def test_enabled_interrupted_at_any_line_trains_on(phase, saved_dtype, function_mode_stack):
    """A KeyboardInterrupt before any line fad.py runs in a forward of a model
    under enabled(compose=True) (its first block, or a later one), or in the
    backward of its chains, leaves the thread as it was: the step run again
    and the next give the uninterrupted run's outputs and gradients bit for
    bit (within float32 rounding of torch's, bfloat16's with saved_dtype).
    A stop between _captured's switch and its try left the switch on for
    the thread: every later reprop activation outside a chain (fad.silu,
    a patched module, compose=False's rerouting) returned (y, f'(x))."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model0 = _Chains()
    pre = 1 if phase == "later_forward" else 0
    want = _sgd_steps(copy.deepcopy(model0), fad.enabled(compose=True, saved_dtype=saved_dtype), x, pre + 2)
    torch_run = _sgd_steps(copy.deepcopy(model0), contextlib.nullcontext(), x, pre + 2)
    tol = {"rtol": 2e-2, "atol": 1e-3} if saved_dtype else {"rtol": 1e-5, "atol": 1e-6}
    for (out, grads), (out_t, grads_t) in zip(want, torch_run):
        torch.testing.assert_close(out, out_t, **tol)
        torch.testing.assert_close(grads, grads_t, **tol)
    for k in itertools.count(1):
        model, mode = copy.deepcopy(model0), fad.enabled(compose=True, saved_dtype=saved_dtype)
        _sgd_steps(model, mode, x, pre)
        try:
            if phase == "backward":
                with mode:
                    out = model(x)
                with LineStop(fad.__file__, k):
                    torch.autograd.grad(out.square().mean(), list(model.parameters()))
            else:
                with LineStop(fad.__file__, k):
                    with mode:
                        model(x)
        except KeyboardInterrupt as stop:
            _assert_left_clean(stop)
        else:
            break
        got = _sgd_steps(model, mode, x, 2)  # the cell run again, then the next step
        for (out, grads), (out_w, grads_w) in zip(got, want[pre:]):
            assert torch.equal(out, out_w) and all(map(torch.equal, grads, grads_w)), k
    assert k > (60 if phase == "backward" else 500)  # it did stop them midway


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_patched_activations_interrupted_at_any_line_train_on(phase):
    """The same for fad.patch's activations (reprop's autograd Function, its
    forward and backward, 8-bit codes): the model trains on as uninterrupted."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model0 = _Patched()
    fad.patch(model0, saved_dtype=torch.uint8)
    want = _sgd_steps(copy.deepcopy(model0), contextlib.nullcontext(), x, 2)
    for k in itertools.count(1):
        model = copy.deepcopy(model0)
        try:
            if phase == "backward":
                out = model(x)
                with LineStop(fad.__file__, k):
                    torch.autograd.grad(out.square().mean(), list(model.parameters()))
            else:
                with LineStop(fad.__file__, k):
                    model(x)
        except KeyboardInterrupt:
            assert torch.is_grad_enabled() and not fad._capture.on
        else:
            break
        got = _sgd_steps(model, contextlib.nullcontext(), x, 2)
        for (out, grads), (out_w, grads_w) in zip(got, want):
            assert torch.equal(out, out_w) and all(map(torch.equal, grads, grads_w)), k
    assert k > (50 if phase == "backward" else 100)


# ---------------------------------------------------------------------------
# Mutation audit of csrc/fad_math.h and csrc/fad.c (session 38): what the
# tolerance of check_against_torch lets through. Where f or f' is torch's
# formula with no elementary function of reprop's own, or is computed from
# reprop's own output as torch computes it from its output, the bits are
# torch's; a reordered formula is an ulp off on many elements, far inside
# check_accuracy's tolerance.
# ---------------------------------------------------------------------------


def _audit_sweep():
    """sample() (its special points first, where torch's vectorized loop
    runs) and dense sweeps across the pieces' edges -3, 0 and 3, and
    subnormal inputs."""
    edges = [torch.linspace(e - 1e-3, e + 1e-3, 2001) for e in (-3.0, 0.0, 3.0)]
    tiny = torch.tensor([1e-45, -1e-45, 1e-40, -1e-40, 1.1e-38, -1.1e-38])
    return torch.cat([sample("cpu", torch.float32), *edges, tiny])


@pytest.mark.parametrize("name", ["hardswish", "hardsigmoid", "leaky_relu", "softsign"])
def test_algebraic_activations_are_torchs_bits(name):
    """No elementary function, the same terms in the same order as torch: f
    and f' are torch's bits (Hardswish's x * m / 6 written x * (m / 6) was
    off by an ulp on 24% of the values). Softsign's f' is autograd's sum for
    grad_y = 1, so the gradient is compared at 1 there."""
    ours, ref, kw = ACTIVATIONS[name]
    x = _audit_sweep()
    grad = torch.ones_like(x) if name in TORCH_COMPOSITE else torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    y, gx = values_and_grads(lambda t: ours(t, **kw), x, grad)
    y_ref, gx_ref = values_and_grads(lambda t: ref(t, **kw), x, grad)
    assert _same_bits(y, y_ref).all(), x[~_same_bits(y, y_ref)][:4]
    assert _same_bits(gx, gx_ref).all(), x[~_same_bits(gx, gx_ref)][:4]


@pytest.mark.parametrize("name,backward", [
    ("tanh", lambda g, y: g * (1 - y * y)),  # torch's kernel fuses 1 - y * y on FMA CPUs
    ("sigmoid", lambda g, y: g * ((1 - y) * y))])  # torch's kernel: (g (1 - y)) y
def test_output_saving_gradients_are_torchs_formula_of_the_output(name, backward):
    """Tanh's and Sigmoid's f' is torch's tanh_backward / sigmoid_backward
    formula of reprop's own output, grad_y (1 - y^2) and grad_y (1 - y) y,
    f' rounded term by term, then grad_y times it ((1 - y)(1 + y) for Tanh
    was an ulp off on a third of the values). torch's tanh_backward
    itself rounds 1 - y * y once where the CPU has FMA (this one: all of
    _audit_sweep()'s values), where reprop, bound to CUDA's bits without
    fused multiply-adds, rounds twice: within check_accuracy's tolerance."""
    ours, _, kw = ACTIVATIONS[name]
    x = _audit_sweep()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    y, gx = values_and_grads(lambda t: ours(t, **kw), x, grad)
    want = backward(grad, y)
    assert _same_bits(gx, want).all(), x[~_same_bits(gx, want)][:4]


def test_tanhshrink_is_x_minus_reprops_tanh_bit_for_bit():
    """F.tanhshrink is x - tanh(x): reprop's value and f' are what autograd
    gives for x - fad.tanh(x), 1 + (-1)(1 - t^2), bit for bit (t^2 was an
    ulp off on a tenth of the values near 0)."""
    x = _audit_sweep()
    ones = torch.ones_like(x)
    y, gx = values_and_grads(fad.tanhshrink, x, ones)
    y_ref, gx_ref = values_and_grads(lambda t: t - fad.tanh(t), x, ones)
    assert _same_bits(y, y_ref).all() and _same_bits(gx, gx_ref).all()


@pytest.mark.parametrize("name", ["sigmoid", "silu", "elu", "elu_alpha", "celu", "selu", "softplus",
                                  "softplus_beta", "logsigmoid"])
def test_values_of_exp_only_activations_are_mostly_torchs_bits(name):
    """f is torch's formula around one exp (or expm1 / log1p), so its bits
    are torch's but where the two exps differ by an ulp: measured 95% to
    99% of sample()'s values; SiLU's x / (1 + exp(-x)) written x * (1 / (1 +
    exp(-x))) matched 77%."""
    ours, ref, kw = ACTIVATIONS[name]
    x = sample("cpu", torch.float32)
    same = _same_bits(ours(x, **kw), ref(x, **kw))
    assert same.double().mean() >= 0.9, same.double().mean().item()


@pytest.mark.parametrize("name,kw", [("elu", {"alpha": -0.5}), ("elu", {"alpha": 0.5}),
                                     ("celu", {"alpha": -0.5}), ("selu", {})])
def test_elu_family_keeps_torchs_sign_of_zero(name, kw):
    """x >= 0 selects ELU's x * scale side as torch's vectorized loop does:
    +0 stays +0 with a negative alpha (the other side, expm1(+0) alpha,
    gives -0)."""
    ours, ref = getattr(fad, name), getattr(F, name)
    x = torch.zeros(64)
    x[1::2] = -0.0
    y, gx = values_and_grads(lambda t: ours(t, **kw), x, torch.ones_like(x))
    y_ref, gx_ref = values_and_grads(lambda t: ref(t, **kw), x, torch.ones_like(x))
    assert _same_bits(y, y_ref).all() and _same_bits(gx, gx_ref).all()


@pytest.mark.parametrize("name,at", [("hardswish", 3.0), ("elu", 1e-45), ("leaky_relu", 1e-45),
                                     ("softplus_beta", 2.5000002)])
def test_8bit_exact_at_the_edge_of_a_constant_piece(name, at):
    """A constant piece's first point (Hardswish's x = 3, ELU's and
    LeakyReLU's smallest x > 0, Softplus's first x * beta > threshold) has
    the exact slope, not its nearest grid value."""
    ours, ref, kw = ACTIVATIONS[name]
    x = torch.full((16,), at)
    grad = torch.randn(16, generator=torch.Generator().manual_seed(1))
    _, gx = values_and_grads(lambda t: ours(t, saved_dtype=torch.uint8, **kw), x, grad)
    _, gx_ref = values_and_grads(lambda t: ref(t, **kw), x, grad)
    assert torch.equal(gx, gx_ref)


# README's table of the 8-bit grids (saved_dtype): codebook(*args) -> its
# [lo, hi], step and max error as README prints them
_README_GRIDS = [
    (("gelu",), "-0.129", "1.129", "0.0051", "0.0025"),
    (("gelu_tanh",), "-0.129", "1.129", "0.0051", "0.0025"),
    (("silu",), "-0.0998", "1.100", "0.0049", "0.0024"),
    (("mish",), "-0.113", "1.088", "0.0048", "0.0024"),
    *[((name,), "0", "1", "0.0040", "0.0020")
      for name in ("softplus", "logsigmoid", "tanhshrink", "tanh", "softsign")],
    (("sigmoid",), "0", "0.25", "0.00099", "0.00050"),
    (("elu", 1.0), "0", "1", "0.0040", "0.0020"), (("celu", 1.0), "0", "1", "0.0040", "0.0020"),
    (("selu",), "0", "1.758", "0.0070", "0.0035"),
    (("hardswish",), "-0.5", "1.5", "0.0080", "0.0040"),
]


def _rounds_to(value, printed):
    """value rounded to printed's decimals is printed (a string)."""
    decimals = len(printed.partition(".")[2])
    return abs(value - float(printed)) <= 0.5 * 10.0**-decimals * (1 + 1e-9)


@pytest.mark.parametrize("args,lo,hi,step,max_error", _README_GRIDS, ids=str)
def test_codebook_grids_are_the_readmes(args, lo, hi, step, max_error):
    """The grids README's table prints: the step follows from [lo, hi]
    widened by 1/512 of its span on its open sides (the float32 f' may pass
    an exact extreme by an ulp); without that margin on the negative side
    GELU's step was 0.0050 and SiLU's 0.0048."""
    cb = fad.codebook(*args)
    assert _rounds_to(cb.lo, lo) and _rounds_to(cb.hi, hi), (cb.lo, cb.hi)
    assert _rounds_to(cb.step, step) and _rounds_to(cb.max_error, max_error), (cb.step, cb.max_error)


@pytest.mark.parametrize("alpha", [1e-40, -1e-40, 1e-38, -1e-38])
def test_8bit_of_a_tiny_alpha_stays_within_max_error(alpha):
    """ELU's f' range [0, alpha] with alpha below float32's normal numbers:
    the grid step is at least 2^-102, so inv_step stays finite and every f'
    decodes within max_error (without that floor the step was alpha / 253,
    its inverse inf, and f' near 0 decoded as alpha: 505 times max_error
    off)."""
    cb = fad.codebook("elu", alpha)
    x = torch.cat([torch.linspace(-30, 0, 3001), torch.tensor([-0.0, -1e-3, 2.0])])
    _, gx = values_and_grads(lambda t: fad.elu(t, alpha=alpha, saved_dtype=torch.uint8), x, torch.ones_like(x))
    _, want = values_and_grads(lambda t: F.elu(t, alpha=alpha), x.double(), torch.ones_like(x, dtype=torch.float64))
    assert np.isfinite(cb.step) and cb.step > 0
    assert (gx.double() - want).abs().max() <= cb.max_error


# ---------------------------------------------------------------------------
# Randomized differential test against torch: random models and element-wise
# programs of every activation and option, every way reprop takes them
# (patch, the fad.* functions, enabled() with and without compose), on odd
# layouts, dtypes and autograd features; reprop's outputs and gradients
# against torch's on the same weights and inputs, with float64 torch as the
# judge of rounding (bitwise where README says bitwise). A larger driver of
# the same generator ran 30,000 cases (README-documented differences left out).
# ---------------------------------------------------------------------------

def _fuzz_activation(rng, inplace):
    """(name, torch module, torch function) of a random activation with random
    parameters; `inplace` lets it take inplace=True. Negative slopes and alphas
    only out of place (torch refuses their in-place backward; FAD trains)."""
    name = rng.choice([*ACTIVATIONS, "relu"])
    kw = dict(ACTIVATIONS[name][2]) if name in ACTIVATIONS else {}
    if name in ("softplus", "softplus_beta"):
        kw = {"beta": rng.choice([1.0, 2.0, -1.0]), "threshold": rng.choice([20.0, 5.0, 1.0])}
    elif name in ("elu", "elu_alpha", "celu"):
        kw = {"alpha": rng.choice([1.0, 0.5, 2.0] + ([] if inplace else [-0.7]))}
    elif name == "leaky_relu":
        kw = {"negative_slope": rng.choice([0.01, 0.2, 1.5] + ([] if inplace else [-0.3]))}
    base = name.split("_")[0] if name in ("softplus_beta", "elu_alpha") else name
    base = "gelu" if base == "gelu_tanh" else base
    if inplace and base in ("silu", "mish", "elu", "celu", "selu", "leaky_relu", "hardswish",
                            "hardsigmoid", "relu"):
        kw["inplace"] = True
    torch_fn = ACTIVATIONS[name][1] if name in ACTIVATIONS else F.relu
    module_cls = {"gelu": nn.GELU, "silu": nn.SiLU, "mish": nn.Mish, "softplus": nn.Softplus,
                  "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "elu": nn.ELU, "celu": nn.CELU,
                  "selu": nn.SELU, "leaky_relu": nn.LeakyReLU, "hardswish": nn.Hardswish,
                  "hardsigmoid": nn.Hardsigmoid, "logsigmoid": nn.LogSigmoid, "softsign": nn.Softsign,
                  "tanhshrink": nn.Tanhshrink, "relu": nn.ReLU}[base]
    return base, module_cls(**kw), functools.partial(torch_fn, **kw)


# element-wise chains that compose=True folds: paths that join, a select, a
# chain output used twice, pow, div, ... (name, function)
_FUZZ_CHAINS = [
    ("mish_formula", lambda h: h * torch.tanh(F.softplus(h))),
    ("swish_formula", lambda h: h * torch.sigmoid(h)),
    ("softplus_formula", lambda h: torch.log1p(torch.exp(h * 0.5))),
    ("poly", lambda h: (h * 2 + 1) ** 2 * 0.25 - h),
    ("relu_squared", lambda h: torch.relu(h) ** 2),
    ("relu_plus_root", lambda h: torch.relu(h) + h),
    ("hardswish_scaled", lambda h: F.hardswish(h) * 2),
    ("gelu_tanh_formula", lambda h: 0.5 * h * (1 + torch.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))),
    ("softsign_formula", lambda h: h / (1 + h.abs())),
    ("sin_cos", lambda h: torch.sin(h) * torch.cos(h * 0.5)),
    ("sqrt_of_select", lambda h: torch.sqrt(torch.relu(h) + 1)),
    ("output_used_twice", lambda h: (lambda a: a * 0.5 + a.sum(-1, keepdim=True) * 0.1)(F.silu(h))),
    ("rsqrt_square", lambda h: torch.rsqrt(torch.square(h) + 1)),
    ("expm1_leaky", lambda h: torch.expm1(F.leaky_relu(h, 0.1) * 0.3)),
]


class _FuzzNet(nn.Module):
    """Linear layers with a random activation use between each two: a module,
    its torch function, reprop's function, a chain, a residual add, the
    activation's input also read by a Linear, a transposed (non-contiguous)
    input, a broadcast parameter, a tensor hook, or a node pre-hook that
    gives None (x and the layers before get None, as torch's nodes give)."""

    USES = ("module", "function", "fad_function", "chain", "residual", "input_read_twice",
            "transposed", "broadcast", "tensor_hook", "prehook_none")

    def __init__(self, rng, width, depth, features):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(depth + 1))
        self.scale = nn.Parameter(torch.randn(width) * 0.5 + 1)
        self.acts, self.uses = nn.ModuleList(), []
        for _ in range(depth):
            use = rng.choice(self.USES)
            name, module, fn = _fuzz_activation(rng, use in ("module", "function"))
            chain = rng.choice(_FUZZ_CHAINS)
            self.acts.append(module)
            self.uses.append((use, name, fn, chain[1]))
            features |= {use, name, chain[0]} | ({"inplace"} if "inplace" in fn.keywords else set())

    def forward(self, x, saved_dtype=None):
        h = self.lins[0](x)
        for i, (use, name, fn, chain) in enumerate(self.uses):
            act = self.acts[i]
            if use == "module":
                h = act(h)
            elif use == "function":
                h = fn(h)
            elif use == "fad_function" and name != "relu":
                kw = {k: v for k, v in fn.keywords.items() if k != "inplace"}
                h = getattr(fad, name)(h, **kw, saved_dtype=saved_dtype)
            elif use == "residual":
                h = h + act(h)
            elif use == "input_read_twice":
                h = act(h) + self.lins[i + 1](h) * 0.5
            elif use == "transposed":
                h = act(h.transpose(-1, -2)).transpose(-1, -2) if h.dim() == 2 else act(h)
            elif use == "broadcast":
                h = act(h * self.scale) + self.scale
            elif use in ("tensor_hook", "prehook_none") and h.requires_grad:
                h = act(h)
                if use == "tensor_hook":  # a later pre-hook's None reaches it as None
                    h.register_hook(lambda g: None if g is None else g * 2)
                else:
                    h.grad_fn.register_prehook(lambda grads: (None,))
            else:
                h = chain(h)
            h = self.lins[i + 1](h)
        return h


_FUZZ_EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _assert_fuzz_close(what, got, ref, exact, dtype, units, overflowed=None, case_scale=0.0,
                       case_error=0.0):
    """got (reprop) against ref (torch, same dtype), exact (float64): None
    where torch's is None; NaNs and infinities where torch's are, but where
    the exact value is beyond dtype's range or the forward overflowed
    (`overflowed`), where README lets joined paths trade inf and NaN; within
    twice torch's error, plus four times its largest in the tensor (a model's
    sums cancel) or than `case_error`, plus `units` roundings of dtype at the
    tensor's scale, or at `case_scale` where that is larger (a 16-bit
    model's sums cancel the roundings of gradients that large: a one-element
    gradient of bfloat16 autocast was 54% off float64 in torch, 0.0042 of a
    largest gradient of 0.077)."""
    assert (got is None) == (ref is None), f"{what}: None where torch's is {ref}"
    if got is None:
        return
    assert got.shape == ref.shape and got.dtype == ref.dtype, what
    got, ref, exact = got.double(), ref.double(), exact.double()
    traded = ~exact.isfinite() | (exact.abs() > torch.finfo(dtype).max)
    if overflowed is not None:
        traded = traded | overflowed.expand(got.shape)
    keep = ~traded | (got.isfinite() & ref.isfinite())
    got, ref, exact = got[keep], ref[keep], exact[keep]
    assert torch.equal(got.isnan(), ref.isnan()), f"{what}: NaN positions differ"
    special = ref.isinf()
    assert torch.equal(got[special], ref[special]), f"{what}: infinities differ"
    finite = ref.isfinite() & exact.isfinite()
    err_ref = (ref - exact).abs().where(finite, 0.0)
    scale = max(_finite_max(exact), case_scale)
    tol = 2 * err_ref + 4 * max(err_ref.max().item() if err_ref.numel() else 0.0, case_error) \
        + units * _FUZZ_EPS[dtype] * scale
    bad = finite & ((got - exact).abs() > tol)
    assert not bad.any(), (f"{what}: {bad.sum().item()} of {got.numel()} off: got {got[bad][:3].tolist()}, "
                           f"torch {ref[bad][:3].tolist()}, float64 {exact[bad][:3].tolist()}")


def _finite_max(t):
    """The largest finite magnitude in t (0 for none)."""
    t = t.double().abs()
    return t[t.isfinite()].max().item() if t.isfinite().any() else 0.0


def _assert_fuzz_bitwise(what, got, ref):
    assert (got is None) == (ref is None), f"{what}: None where torch's is {ref}"
    if got is not None:
        assert got.dtype == ref.dtype and torch.equal(got.nan_to_num(), ref.nan_to_num()), what


def _chain_saved_dtype(dtype, how, saved_dtype, activations):
    """README: a float16 chain saves its derivative in float16 by default,
    where a CELU with alpha < 0 (f' = exp(x / alpha)) overflows to inf, and a
    select's 0 gradient then gives NaN where torch's is 0 (it recomputes f'
    in float32); README advises another saved_dtype there: float32."""
    steep = any(name == "celu" and fn.keywords["alpha"] < 0 for name, fn in activations)
    if dtype == torch.float16 and "compose" in how and saved_dtype is None and steep:
        return torch.float32
    return saved_dtype


def _fuzz_model_run(net, x, g_out, ctx, grad_mode, twice, saved_dtype=None):
    """net's output and the gradients of x and every parameter (None for a
    forward under no_grad or inference_mode)."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    with ctx(), grad_mode():
        y = net(x, saved_dtype)
    if not y.requires_grad:
        return y.detach(), None
    loss = (y * g_out.to(y.dtype)).sum()
    loss.backward(retain_graph=twice)
    if twice:  # the graph's second backward accumulates
        loss.backward()
    return y.detach(), [x.grad] + [p.grad for p in net.parameters()]


def _fuzz_model_case(seed, run=True):
    """One random model and forward; returns the features it drew."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    features = set()
    dtype = rng.choice([torch.float32] * 4 + [torch.float64, torch.bfloat16, torch.float16])
    how = rng.choice(["patch", "enabled", "compose", "patch+compose", "functions", "patch_unpatch"])
    autocast = dtype == torch.float32 and rng.random() < 0.2
    saved_dtype = rng.choice([None, None, torch.float32])
    grad_mode = rng.choice([contextlib.nullcontext] * 6 + [torch.no_grad, torch.inference_mode])
    twice, x_requires_grad = rng.random() < 0.2, rng.random() < 0.6
    width, batch = rng.choice([1, 3, 8]), rng.choice([0, 1, 4, None])  # None: one sample, 1-D
    net = _FuzzNet(rng, width, rng.randint(1, 3), features)
    saved_dtype = _chain_saved_dtype(dtype, how, saved_dtype, [(u[1], u[2]) for u in net.uses])
    for p in net.parameters():
        p.requires_grad_(rng.random() > 0.15)
    shape = (width,) if batch is None else (batch, width)
    x = torch.randn(shape) * rng.choice([1.0, 3.0])
    if batch and rng.random() < 0.2:
        x, features = torch.randn(width, batch).t() * 2, features | {"non-contiguous input"}
    x.requires_grad_(x_requires_grad)
    g_out = torch.randn(shape)
    features |= {how, str(dtype), grad_mode.__name__, str(saved_dtype)}
    features |= {f for f, on in (("autocast", autocast), ("retain_graph", twice),
                                 ("input without grad", not x_requires_grad),
                                 ("frozen", not all(p.requires_grad for p in net.parameters())),
                                 ("empty", batch == 0), ("1-D", batch is None)) if on}
    if not run:
        return features
    ours, theirs, exact = (copy.deepcopy(net).to(dt) for dt in (dtype, dtype, torch.float64))
    if how in ("patch", "patch+compose", "patch_unpatch"):
        fad.patch(ours, saved_dtype=saved_dtype)
    if how == "patch_unpatch":
        fad.unpatch(ours)
    autocast_ctx = functools.partial(torch.autocast, "cpu", torch.bfloat16, autocast)

    def reprop_ctx():
        stack = contextlib.ExitStack()
        stack.enter_context(autocast_ctx())
        if how != "enabled" and "compose" not in how:
            return stack
        stack.enter_context(fad.enabled(compose="compose" in how, saved_dtype=saved_dtype))
        return stack

    y_ref, g_ref = _fuzz_model_run(theirs, x.to(dtype), g_out, autocast_ctx, grad_mode, twice)
    y_64, g_64 = _fuzz_model_run(exact, x.double(), g_out, contextlib.nullcontext, grad_mode, twice)
    y, g = _fuzz_model_run(ours, x.to(dtype), g_out, reprop_ctx, grad_mode, twice, saved_dtype)
    assert (g is None) == (g_ref is None)
    pairs = [("output", y, y_ref, y_64)] + [(f"gradient {i}", *t) for i, t in enumerate(zip(g or [], g_ref or [], g_64 or []))]
    torchs_own = dtype == torch.float64 or (how == "patch_unpatch" and "fad_function" not in features)
    sixteen_bit = autocast or dtype != torch.float32
    case_scale = max((_finite_max(t) for t in g_64 or [] if t is not None), default=0.0)
    case_error = max((_finite_max(a.double() - b) for a, b in zip(g_ref or [], g_64 or []) if a is not None),
                     default=0.0)
    for what, got, ref, ex in pairs:
        if torchs_own:  # torch's own ops: its bits
            _assert_fuzz_bitwise(what, got, ref)
        elif sixteen_bit:
            _assert_fuzz_close(what, got, ref, ex, torch.bfloat16 if autocast else dtype, 16,
                               case_scale=case_scale, case_error=case_error)
        else:
            _assert_fuzz_close(what, got, ref, ex, dtype, 64)
    return features


_FUZZ_LAYOUTS = {  # name: (base shape, the view of the leaf the program runs on)
    "0-d": ((), None), "1-D": ((5,), None), "long 1-D": ((33,), None), "2-D": ((3, 7), None),
    "transposed": ((7, 3), torch.t), "sliced": ((6, 8), lambda b: b[::2, 1::3]),
    "channels_last": ((2, 3, 4, 5), lambda b: b.contiguous(memory_format=torch.channels_last)),
    "empty": ((0, 4), None), "expanded": ((1, 5), lambda b: b.expand(4, 5)),
}


def _fuzz_input(rng, dtype):
    """(layout name, x's contiguous base, the view of it the program runs on:
    transposed, sliced, channels_last, expanded or none), at times with a
    large or signed-zero element."""
    layout = rng.choice(list(_FUZZ_LAYOUTS))
    shape, view = _FUZZ_LAYOUTS[layout]
    x = torch.randn(shape) * rng.choice([1.0, 3.0, 8.0])
    if x.numel() and rng.random() < 0.2:
        x.view(-1)[rng.randrange(x.numel())] = rng.choice([30.0, -30.0, 100.0, -100.0, -0.0, 3.0, -3.0])
    return layout, x.to(dtype), view or (lambda b: b)


# in-place ops on a chain tensor (a fresh one: an earlier op may save h)
_FUZZ_IN_PLACE = [
    ("mul_", lambda h: h.mul_(2.5)), ("relu_", torch.Tensor.relu_), ("sigmoid_", torch.Tensor.sigmoid_),
    ("exp_", lambda h: h.mul_(0.2).exp_()), ("clamp_", lambda h: h.clamp_(-1, 1)),
    ("silu inplace", lambda h: F.silu(h, inplace=True)), ("elu inplace", lambda h: F.elu(h, 0.5, True)),
    ("leaky_relu inplace", lambda h: F.leaky_relu(h, 0.2, True)),
]
_FUZZ_UNARY = [("exp", lambda h: torch.exp(h * 0.3)), ("tanh method", torch.Tensor.tanh),
               ("sigmoid method", torch.Tensor.sigmoid), ("neg", torch.neg), ("pow3", lambda h: h ** 3),
               ("rdiv", lambda h: 1 / (h.abs() + 1)), ("abs", torch.abs), ("erf", torch.erf),
               ("torch.selu", torch.selu), ("where", lambda h: torch.where(h > 0, h, h * 0.1)),
               ("no_grad factor", lambda h: h * torch.sigmoid(h.detach()))]


def _fuzz_program_steps(rng, features):
    steps = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choices(["activation", "chain", "unary", "join", "fork", "in-place", "in-place slice"],
                           [8, 5, 3, 2, 1, 1, 1])[0]
        if kind == "activation":
            name, module, fn = _fuzz_activation(rng, False)
            step = (name, module, fn)
        elif kind == "in-place slice":
            name, module, fn = _fuzz_activation(rng, True)
            while "inplace" not in fn.keywords:  # a result dropped would be an op chained past h
                name, module, fn = _fuzz_activation(rng, True)
            step = (name + " on a slice", None, fn)
        elif kind == "chain":
            step = rng.choice(_FUZZ_CHAINS)
        elif kind == "unary":
            step = rng.choice(_FUZZ_UNARY)
        elif kind == "in-place":
            step = rng.choice(_FUZZ_IN_PLACE)
        else:
            step = (kind,)
        steps.append((kind, *step))
        features |= {kind, step[0]}
    return steps


def _run_program(steps, x, w, reprop, how, saved_dtype, hook):
    """The program on x * w (w broadcast), or x: reprop's side, for `how`
    "functions", calls reprop's functions; a hook on the first step's output."""
    h = root = x * w if w.requires_grad or w.dim() else x
    for i, (kind, name, *fns) in enumerate(steps):
        if kind == "activation" and reprop and how == "functions" and name != "relu":
            h = getattr(fad, name)(h, **fns[1].keywords, saved_dtype=saved_dtype)
        elif kind == "activation":
            h = fns[0](h) if how == "patch" else fns[1](h)
        elif kind == "in-place slice":  # of a fresh tensor (an earlier op may save h)
            h = h * 1.0
            fns[1](h[..., :1] if h.dim() and h.shape[-1] > 1 else h)
        elif kind == "in-place":  # of a fresh tensor, not the root, which a join reads
            h = fns[0](h * 1.0)
        elif kind in ("chain", "unary"):
            h = fns[0](h)
        elif kind == "join":
            h = h * 0.5 + root
        else:  # fork: two paths from one chain tensor, joined
            h = torch.exp(h * 0.1) + torch.sigmoid(h) * 0.5
        if i == 0 and hook and h.requires_grad:
            {"tensor hook": lambda: h.register_hook(lambda g: None if g is None else g * 3),
             "node pre-hook": lambda: h.grad_fn.register_prehook(lambda gs: (gs[0] * 3,)),
             "pre-hook giving None": lambda: h.grad_fn.register_prehook(lambda gs: (None,))}[hook]()
    return h


def _fuzz_program_case(seed, run=True):
    """One random element-wise program; returns the features it drew."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    features = set()
    dtype = rng.choice([torch.float32] * 4 + [torch.float64, torch.bfloat16, torch.float16])
    how = rng.choice(["functions", "compose", "compose", "enabled", "patch"])
    saved_dtype = rng.choice([None, None, torch.float32]) if dtype != torch.float64 else None
    layout, x0, view = _fuzz_input(rng, dtype)
    shape = view(x0).shape
    use_w = rng.random() < 0.4
    w0 = torch.randn(shape[-1:]).to(dtype) if use_w else torch.ones((), dtype=dtype)
    steps = _fuzz_program_steps(rng, features)
    saved_dtype = _chain_saved_dtype(dtype, how, saved_dtype,
                                     [(s[1], s[-1]) for s in steps if s[0] == "activation"])
    twice, x_requires_grad = rng.random() < 0.2, rng.random() < 0.85
    w_requires_grad = use_w and rng.random() < 0.7
    hook = rng.choice([None, None, "tensor hook", "node pre-hook", "pre-hook giving None"])
    features |= {how, layout, str(dtype), str(saved_dtype), str(hook)}
    features |= {f for f, on in (("broadcast", use_w), ("retain_graph", twice)) if on}
    if not run:
        return features
    ours = copy.deepcopy(steps)
    if how == "patch":
        fad.patch(nn.ModuleList(s[2] for s in ours if s[0] == "activation"), saved_dtype=saved_dtype)
    g_out = torch.randn(shape).to(dtype)

    def run_it(steps, to, reprop, ctx=contextlib.nullcontext):
        x = x0.to(to, copy=True).requires_grad_(x_requires_grad)
        w = w0.to(to, copy=True).requires_grad_(w_requires_grad)
        with ctx():
            y = _run_program(steps, view(x), w, reprop, how, saved_dtype, hook)
        if y.requires_grad:
            loss = (y * g_out.to(to)).sum()
            loss.backward(retain_graph=twice)
            if twice:
                loss.backward()
        return y.detach(), [x.grad, w.grad]

    mode = {"compose": lambda: fad.enabled(compose=True, saved_dtype=saved_dtype),
            "enabled": lambda: fad.enabled(saved_dtype=saved_dtype)}.get(how, contextlib.nullcontext)
    y_ref, g_ref = run_it(steps, dtype, False)
    y_64, g_64 = run_it(steps, torch.float64, False)
    y, g = run_it(ours, dtype, True, mode)
    pairs = [("output", y, y_ref, y_64, None)]
    pairs += [(f"gradient {i}", a, b, c, ~y_ref.isfinite() if a is not None and a.shape == y.shape else None)
              for i, (a, b, c) in enumerate(zip(g, g_ref, g_64))]
    for what, got, ref, ex, overflowed in pairs:
        if dtype == torch.float64:  # torch's own ops
            _assert_fuzz_bitwise(what, got, ref)
        else:
            _assert_fuzz_close(what, got, ref, ex, dtype, 64 if dtype == torch.float32 else 16, overflowed)
    return features


def _fuzz_storage_case(seed, run=True):
    """One activation with a random 16- or 8-bit saved_dtype (a function, a
    patched module, enabled()): its input gradient within README's bound of
    the float64 one (8-bit: codebook().max_error; bfloat16, float16: half an
    ulp of f', float16 down to its subnormals' spacing). And bfloat16 x with
    saved_dtype=torch.float32 where README says torch's gradient bit for bit."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    name = rng.choice(list(ACTIVATIONS))
    ours, theirs, kw = ACTIVATIONS[name]
    saved_dtype = rng.choice([torch.uint8, torch.bfloat16, torch.float16, torch.float32])
    how = rng.choice(["function", "enabled"] + (["patched module"] if name not in ("sigmoid", "tanh") else []))
    bitwise = saved_dtype == torch.float32 and name in _BITWISE_IN_FLOAT32
    features = {name, str(saved_dtype), how}
    if not run:
        return features
    x0 = torch.randn(rng.choice([7, 64, 300])) * rng.choice([1.0, 3.0, 10.0])
    x0, g = (x0.bfloat16(), torch.randn(x0.shape).bfloat16()) if bitwise else (x0, torch.randn(x0.shape))
    if how == "function":
        act = functools.partial(ours, **kw, saved_dtype=saved_dtype)
    elif how == "enabled":
        act = functools.partial(_in_mode, fad.enabled(saved_dtype=saved_dtype), functools.partial(theirs, **kw))
    else:
        act = _patched_module_of(theirs, kw, saved_dtype)
    _, got = values_and_grads(act, x0, g)
    _, want = values_and_grads(functools.partial(theirs, **kw), x0, g)
    if bitwise:
        assert torch.equal(got, want), name
        return features
    _, d64 = values_and_grads(functools.partial(theirs, **kw), x0.double(), torch.ones_like(x0, dtype=torch.float64))
    if saved_dtype == torch.uint8:
        per_unit = fad.codebook(*CODEBOOK_ARGS[name]).max_error + 2 * F32_EPS * d64.abs()
    elif saved_dtype == torch.float32:
        per_unit = 64 * F32_EPS * d64.abs().max()
    else:
        info = torch.finfo(saved_dtype)
        per_unit = info.eps / 2 * d64.abs() + info.tiny * info.eps + 2 * F32_EPS * d64.abs()
    # on top of the storage's rounding, the float32 f' is as accurate as torch's (check_accuracy)
    exact = g.double() * d64
    tol = 2 * (want.double() - exact).abs() + g.double().abs() * (
        per_unit * 1.001 + F32_EPS * cancelling_terms(CANCELLING_DERIVATIVE, name, x0))
    bad = (got.double() - exact).abs() > tol + 2 * F32_EPS * exact.abs()
    assert not bad.any(), (name, saved_dtype, x0[bad][:3].tolist(), got[bad][:3].tolist())
    return features


def _in_mode(mode, fn, x):
    with mode:
        return fn(x)


def _patched_module_of(fn, kw, saved_dtype):
    cls = {F.gelu: nn.GELU, F.silu: nn.SiLU, F.mish: nn.Mish, F.softplus: nn.Softplus, F.elu: nn.ELU,
           F.celu: nn.CELU, F.selu: nn.SELU, F.leaky_relu: nn.LeakyReLU, F.hardswish: nn.Hardswish,
           F.hardsigmoid: nn.Hardsigmoid, F.logsigmoid: nn.LogSigmoid, F.softsign: nn.Softsign,
           F.tanhshrink: nn.Tanhshrink}[fn]
    module = nn.Sequential(cls(**kw))
    fad.patch(module, saved_dtype=saved_dtype)
    return module


_FUZZ_CASES = {"model": _fuzz_model_case, "program": _fuzz_program_case, "storage": _fuzz_storage_case}
_FUZZ_SEEDS = {"model": [*range(36), 33, 66, 95, 462, 496, 774, 1141],
               "program": [*range(40), 260, 739, 1163, 1880, 2824],
               "storage": [*range(30), 31, 38]}
_FUZZ_SEEDS = {kind: sorted(set(seeds)) for kind, seeds in _FUZZ_SEEDS.items()}


def _fuzz_features(kind):
    """Every feature a case of `kind` can draw (what the seeds must cover)."""
    activations = {"gelu", "silu", "mish", "softplus", "sigmoid", "tanh", "elu", "celu", "selu",
                   "leaky_relu", "hardswish", "hardsigmoid", "logsigmoid", "softsign", "tanhshrink", "relu"}
    dtypes = {str(d) for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}
    if kind == "model":
        return (activations | set(_FuzzNet.USES) | {c[0] for c in _FUZZ_CHAINS} | dtypes
                | {"patch", "enabled", "compose", "patch+compose", "functions", "patch_unpatch"}
                | {"nullcontext", "no_grad", "inference_mode", "None", "torch.float32", "inplace"}
                | {"autocast", "retain_graph", "input without grad", "frozen", "empty", "1-D",
                   "non-contiguous input"})
    if kind == "program":
        return (activations | {c[0] for c in _FUZZ_CHAINS} | {u[0] for u in _FUZZ_UNARY}
                | {u[0] for u in _FUZZ_IN_PLACE} | dtypes | {"None", "torch.float32"}
                | {"activation", "chain", "unary", "join", "fork", "in-place", "in-place slice"}
                | {"functions", "compose", "enabled", "patch", "broadcast", "retain_graph"}
                | set(_FUZZ_LAYOUTS)
                | {"tensor hook", "node pre-hook", "pre-hook giving None"})
    return (set(ACTIVATIONS) | {"function", "enabled", "patched module"}
            | {str(d) for d in (torch.uint8, torch.bfloat16, torch.float16, torch.float32)})


@pytest.mark.parametrize("kind", _FUZZ_CASES)
def test_random_against_torch_covers_every_feature(kind):
    drawn = set().union(*(_FUZZ_CASES[kind](seed, run=False) for seed in _FUZZ_SEEDS[kind]))
    assert not _fuzz_features(kind) - drawn


@pytest.mark.parametrize("kind,seed", [(k, s) for k, seeds in _FUZZ_SEEDS.items() for s in seeds])
def test_random_against_torch(kind, seed):
    """reprop against torch on one random case (README's fad section: what
    equals torch, bitwise or within rounding, and its documented differences
    left out by the generator)."""
    _FUZZ_CASES[kind](seed)


# ---------------------------------------------------------------------------
# Mutation audit of python/reprop/fad.py (session 43): behaviour no earlier
# test pinned down, each checked against plain autograd or by weakref
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    pytest.param(lambda h: torch.div(h, 0.75, rounding_mode="floor"), id="div_floor"),
    pytest.param(lambda h: torch.div(h, 0.75, rounding_mode="trunc"), id="div_trunc"),
])
def test_audit_a_binary_op_with_other_keywords_is_no_chain_step(call):
    """A binary op of the chain tables given a keyword other than alpha
    (div's rounding_mode) is no chain step: its derivative is not the
    table's (torch's backward of a rounded quotient is zeros)."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3

    def grad_of(mode):
        xr = x.clone().requires_grad_(True)
        with mode:
            y = call(torch.exp(xr))
        (y * torch.linspace(-1, 1, 64)).sum().backward()
        return y.detach(), xr.grad

    y_ref, g_ref = grad_of(contextlib.nullcontext())
    y, g = grad_of(fad.enabled(compose=True))
    assert torch.equal(y, y_ref) and torch.equal(g, g_ref)
    assert not g.any()


def test_audit_a_chain_does_not_keep_its_root_alive():
    """The record of a chain tensor holds its root weakly (README: an
    unnamed root ends the chain): a root nothing else holds dies while the
    chain tensor lives, as under plain autograd (exp's node saves its
    output, the Linear's its input and weight, neither the root)."""
    lin = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with fad.enabled(compose=True):
        h = lin(x)
        root = weakref.ref(h)
        y = torch.exp(h)
        del h
        gc.collect()
        assert root() is None
    y.sum().backward()
    assert lin.weight.grad is not None


def test_audit_compose_under_no_grad_computes_no_derivative(monkeypatch):
    """Under no_grad inside enabled(compose=True) an element-wise op is no
    chain step: no derivative is computed (the activation kernels are asked
    for none) and the mode records nothing, where a record would hold f'
    as long as the output lives."""
    calls = _spy_on_d_stores(monkeypatch)
    x = torch.randn(64, requires_grad=True)
    mode = fad.enabled(compose=True)
    with mode:
        with torch.no_grad():
            y = F.gelu(x) * torch.exp(x) + torch.sigmoid(x)
        assert calls == [-1] and len(mode._chains.records) == 0
    with torch.no_grad():  # (F.gelu rerouted to reprop's)
        assert torch.equal(y, fad.gelu(x) * torch.exp(x) + torch.sigmoid(x))


def test_audit_autocast_runs_an_activation_at_the_dtype_torchs_would(monkeypatch):
    """Where torch's op runs in float32 under autocast (softplus on CUDA's
    float32 list: none of the activations is on the CPU's), reprop's casts
    its 16-bit input up and computes there, as that op would. Simulated on
    the CPU by having torch's op report float32 (_autocast_target)."""
    monkeypatch.setattr(fad, "_autocast_target", lambda native, x: torch.float32)
    x = torch.randn(32, 16)
    w = torch.randn(16, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w
        y = fad.softplus(h)
    assert h.dtype is torch.bfloat16 and y.dtype is torch.float32
    h32 = h.detach().float().requires_grad_()
    y_ref = fad.softplus(h32)
    assert torch.equal(y, y_ref)
    g = torch.linspace(-1, 1, y.numel()).view_as(y)
    (gh,) = torch.autograd.grad(y, h, g)
    (gh_ref,) = torch.autograd.grad(y_ref, h32, g)
    assert gh.dtype is torch.bfloat16 and torch.equal(gh, gh_ref.bfloat16())


def test_audit_patch_again_drops_the_record_of_a_function_attribute_the_user_replaced():
    """patch() again over a function attribute the user replaced with what
    is no torch activation reroutes nothing there, and drops the earlier
    record with it: the module's attributes are again those it had before
    any patch() (a stale record, holding the old partial, went along in
    every pickle and deepcopy of the model)."""
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True)
    before = set(vars(layer))
    fad.patch(layer)
    assert set(vars(layer)) > before
    layer.activation = F.relu
    assert fad.patch(layer) == {}
    assert set(vars(layer)) == before and layer.activation is F.relu


@pytest.mark.parametrize("name", ["silu", "mish", "hardswish", "elu"])
def test_audit_in_place_write_bumps_the_version_as_torchs(name):
    """An in-place activation writes x through the kernels' raw pointer,
    which autograd does not see: reprop bumps x's version as torch's
    in-place op does, so a node that saved x raises in backward, as under
    torch, rather than use the overwritten values. x that needs no gradient
    (saved by a product with a weight: no node of the activation's own,
    whose mark_dirty would bump it too) included."""
    ours, ref = getattr(fad, name), getattr(F, name)
    x = torch.randn(64, requires_grad=True)
    for fn in (ref, ours):
        for h in (torch.exp(x), torch.randn(64)):
            out = h if h.requires_grad else x * h  # exp saves its output, the product h
            version = h._version
            assert fn(h, inplace=True) is h and h._version > version
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()


def test_audit_double_backward_through_a_quotient_by_a_chain_tensor_is_refused():
    """x / (x * 2 + 1): a quotient by a chain tensor has a derivative that
    varies with the root, though its divisor's is a constant: create_graph
    is refused (the chain keeps no second derivative), not answered with
    the first derivative taken for a constant (torch's second derivative
    -4 / (2x + 1)^3 would be missing)."""
    x = (torch.rand(8) + 0.5).requires_grad_()
    with fad.enabled(compose=True):
        y = x / (x * 2 + 1)
    (g,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    torch.testing.assert_close(g, 1 / (2 * x.detach() + 1) ** 2)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
