"""BPPSA (reprop.bppsa): backprop through time as a parallel scan.

Golden references are plain PyTorch: nn.RNN / nn.GRU autograd for the
modules, the recurrence evaluated step by step in float64 for the scan.

Tolerance: BPPSA reorders the float32 arithmetic of backprop (products of
Jacobians first, then matrix-vector products), so results differ from
autograd's by rounding only. Errors are measured as max |ours - torch| /
max |torch| per tensor; measured below 1e-6 for T up to 1000 (tanh, relu,
GRU, every scan choice), asserted at 3e-6. A wrong Jacobian, operand order
or level schedule gives errors of order 1e-1.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import random
import re
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import reprop
import reprop.optim
from reprop import bppsa
from reprop._native import _C

from _interrupts import LineStop
from _scripts import script_output
from _threads import torch_threads

TOL = 3e-6
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


# the step kinds of _C.csr_schedule's rows (RP_CSR_GEMM, RP_CSR_MV, RP_CSR_COPY in csrc/reprop.h)
_GEMM, _MV, _COPY = 0, 1, 2


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    return (ours.double() - ref.double()).abs().max().item() / (scale if scale > 0 else 1.0)


def make_pair(kind: str, *args, scan="auto", **kwargs):
    """A torch module and its BPPSA twin with the same weights."""
    if kind == "gru":
        ref = nn.GRU(*args, **kwargs)
        ours = bppsa.GRU(*args, scan=scan, **kwargs)
    else:
        ref = nn.RNN(*args, nonlinearity=kind, **kwargs)
        ours = bppsa.RNN(*args, nonlinearity=kind, scan=scan, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def run(module, x, h0, weight_out):
    """Outputs and the gradients of x, h0 and every parameter for a loss that
    reaches every step's output and the final hidden states."""
    x = x.detach().clone().requires_grad_()
    h0 = None if h0 is None else h0.detach().clone().requires_grad_()
    out, h_n = module(x, h0)
    loss = (out * weight_out).sum() + h_n.sin().sum()
    loss.backward()
    grads = [x.grad] + ([h0.grad] if h0 is not None else []) + [p.grad for p in module.parameters()]
    module.zero_grad()
    return [out.detach(), h_n.detach()] + grads


def assert_close_lists(ours, ref, tol=TOL):
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape, i
        assert rel_err(a, b) <= tol, (i, rel_err(a, b))


# ---------------------------------------------------------------------------
# The scan itself
# ---------------------------------------------------------------------------

def reference_scan(c, jt):
    """g[t] = c[t] + jt[t+1] g[t+1], step by step in float64."""
    c, jt = c.double(), jt.double()
    g = torch.empty_like(c)
    g[-1] = c[-1]
    for t in range(c.shape[0] - 2, -1, -1):
        g[t] = c[t] + torch.einsum("bij,bj->bi", jt[t + 1], g[t + 1])
    return g


def structured_dense(w, u, v):
    """The dense J^T = diag(u) + sum_k W_k^T diag(v_k) of the structured form."""
    T, B, GH = v.shape
    H = w.shape[1]
    wk = w.reshape(GH // H, H, H)  # (G, H(m), H(i)): W_k[m, i]
    dense = torch.einsum("kmi,tbkm->tbim", wk, v.reshape(T, B, GH // H, H))
    if u is not None:
        dense = dense + torch.diag_embed(u)
    return dense


@pytest.mark.parametrize("n", range(1, 71))
def test_blelloch_equals_linear_scan_dense(n):
    gen = torch.Generator().manual_seed(n)
    B, H = 2, 3
    jt = torch.randn(n, B, H, H, generator=gen) * 0.5
    c = torch.randn(n, B, H, generator=gen)
    want = reference_scan(c, jt)
    results = [bppsa.scan(c, jt=jt, levels=L) for L in range(bppsa.max_levels(n) + 1)]
    for L, g in enumerate(results):
        assert rel_err(g, want) <= 1e-5, (n, L)
    assert rel_err(results[-1], results[0]) <= 1e-5


@pytest.mark.parametrize("gates", [1, 3])
@pytest.mark.parametrize("with_u", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 300])
def test_structured_scan_equals_dense(gates, with_u, n):
    gen = torch.Generator().manual_seed(7 * n + gates)
    B, H = 3, 6
    w = torch.randn(gates * H, H, generator=gen) / (gates * H) ** 0.5
    u = torch.rand(n, B, H, generator=gen) * 0.5 if with_u else None
    v = torch.rand(n, B, gates * H, generator=gen)
    c = torch.randn(n, B, H, generator=gen)
    want = reference_scan(c, structured_dense(w, u, v))
    for levels in ("linear", "blelloch", "auto", 2):
        assert rel_err(bppsa.scan(c, w=w, u=u, v=v, levels=levels), want) <= 1e-5, levels


@pytest.mark.parametrize("levels", ["linear", "blelloch"])
def test_scan_into_out(levels):
    gen = torch.Generator().manual_seed(11)
    n, B, H = 40, 3, 5
    w, v = torch.randn(H, H, generator=gen) / H, torch.rand(n, B, H, generator=gen)
    c = torch.randn(n, B, H, generator=gen)
    want = bppsa.scan(c, w=w, v=v, levels=levels)
    planes = torch.full((2, n, B, H), float("nan"))
    second = planes[1]
    assert bppsa.scan(c, w=w, v=v, levels=levels, out=second) is second
    assert torch.equal(second, want) and planes[0].isnan().all()
    inplace = c.clone()
    bppsa.scan(inplace, w=w, v=v, levels=levels, out=inplace)
    assert torch.equal(inplace, want)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def pre_activation_reference(activation: str, v: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The bits pre_activation should write for v = f'(y): v * g, but for relu
    torch's threshold_backward (autograd's ReLU backward), a select: +0 where
    y <= 0, where v * g is -0 for a negative g."""
    return torch.ops.aten.threshold_backward(g, y, 0) if activation == "relu" else v * g


def activation_case(activation: str, n: int, B: int, H: int, gates: int, seed: int):
    """w, y with zeros of both signs (and NaNs for relu), and v = f'(y) as
    _rnn_backward formed it before the scan could: 1 - y * y, or torch's relu
    slope, 0 where y <= 0, else 1 (a NaN y included)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(gates * H, H, generator=gen) / (gates * H) ** 0.5
    y = torch.randn(n, B, gates * H, generator=gen)
    if activation == "tanh":
        y = y.tanh()
    flat = y.view(-1)
    flat[3::7], flat[5::7] = 0.0, -0.0
    if activation == "relu":
        flat[9::11] = float("nan")
    v = 1 - y * y if activation == "tanh" else torch.logical_not(y <= 0).float()
    return w, y, v, torch.randn(n, B, H, generator=gen)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("levels", ["linear", 1, 2, "blelloch"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("gates", [1, 3])
def test_scan_activation_equals_given_v(activation, levels, inplace, gates):
    """v = f'(y) read off y gives the bits of v passed in, and pre_activation
    the bits of v * g (relu: of torch's threshold_backward, a select, +0
    where y <= 0), linear and Blelloch, into c itself and not."""
    n, B, H = 37, 3, 5
    w, y, v, c = activation_case(activation, n, B, H, gates, seed=len(activation) + gates)
    u = torch.rand(n, B, H) * 0.5 if gates == 3 else None
    want = bppsa.scan(c, w=w, u=u, v=v, levels=levels)

    def implied(**kw):
        dst = c.clone() if inplace else torch.full_like(c, float("nan"))
        return bppsa.scan(dst if inplace else c, w=w, u=u, activation=activation, y=y, levels=levels,
                          out=dst, **kw)

    assert torch.equal(bits(implied()), bits(want))
    if gates == 1:
        selected = pre_activation_reference(activation, v, y, want)
        assert torch.equal(bits(implied(pre_activation=True)), bits(selected))
        assert torch.equal(bits(bppsa.scan(c, w=w, v=v, levels=levels, pre_activation=True)), bits(v * want))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("levels", [5, "blelloch"])
@pytest.mark.parametrize("in_place", [False, True])
def test_scan_overflowing_products_fall_back_to_linear(levels, in_place, device):
    """J^T = diag(100, 0.5) and a gradient only in the second component at
    the end: g stays finite, but the up-sweep's products over 2^d steps
    overflow to inf in the first, and the down-sweep's inf * 0 gave NaN. A
    result that is not finite is the linear scan's, bit for bit; on CUDA
    decided on the device, so the host never waits for the GPU (torch's
    sync debug mode raises at any wait)."""
    T = 64
    jt = torch.diag(torch.tensor([100.0, 0.5])).expand(T, 1, 2, 2).contiguous().to(device)
    c = torch.zeros(T, 1, 2, device=device)
    c[-1, 0, 1] = 1.0
    linear = bppsa.scan(c, jt=jt, levels="linear")
    with _no_host_sync(device):
        ours = bppsa.scan(c.clone(), jt=jt, levels=levels) if not in_place else \
            bppsa.scan(c_ := c.clone(), jt=jt, levels=levels, out=c_)
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, linear)
    assert torch.equal(ours.double().cpu(), reference_scan(c.cpu(), jt.cpu()))


@contextlib.contextmanager
def _no_host_sync(device):
    """On CUDA, any wait of the host for the GPU raises inside the block."""
    if torch.device(device).type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("levels", [0, 3, "blelloch"])
def test_cuda_scan_is_captured_in_a_cuda_graph(levels):
    """The scan never waits for the GPU, so a CUDA graph captures it: replays
    with new values of c (finite, and overflowing products redone by the
    linear scan inside the graph) give the eager scan's bits."""
    torch.manual_seed(0)
    T, B, H = 64, 3, 2
    w = torch.diag(torch.tensor([100.0, 0.5])).cuda()  # J^T = diag(100, 0.5): see the test above
    v = torch.ones(T, B, H, device="cuda")
    c = torch.zeros(T, B, H, device="cuda")
    bppsa.scan(c, w=w, v=v, levels=levels)  # warm-up: lazy CUDA state outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g = bppsa.scan(c, w=w, v=v, levels=levels)
    for _ in range(3):
        c[..., 1].normal_()  # the first component stays 0: g is finite, the products overflow
        graph.replay()
        want = bppsa.scan(c, w=w, v=v, levels=levels)
        assert torch.isfinite(g).all() and torch.equal(bits(g), bits(want))
        if levels != 3:  # 0, and the levels whose products overflow (redone): the linear scan's bits
            assert torch.equal(want, bppsa.scan(c, w=w, v=v, levels="linear"))


def test_chaotic_rnn_gradients_stay_finite():
    """A chaotic tanh RNN (recurrent gain 4) whose loss reads only its first
    steps: torch's gradients are finite, the Blelloch scan's products of
    Jacobians overflow float32; the result is the linear scan's, bit for
    bit (and torch's within 1e-5: the gain amplifies rounding)."""
    torch.manual_seed(0)
    T, H = 2048, 32
    ref, ours = make_pair("tanh", 2, H, scan="blelloch")
    with torch.no_grad():
        for m in (ref, ours):
            m.weight_hh_l0.copy_(torch.randn(H, H, generator=torch.Generator().manual_seed(0)) * 4 / H ** 0.5)
    x = torch.randn(T, 1, 2)
    results = []
    for m, scan in [(ref, None), (ours, "blelloch"), (ours, "linear")]:
        if scan is not None:
            m.scan = scan
        xr = x.clone().requires_grad_()
        m(xr)[0][:8].sum().backward()
        results.append([xr.grad] + [p.grad.clone() for p in m.parameters()])
        m.zero_grad()
    torch_res, blelloch, linear = results
    assert all(torch.isfinite(t).all() for t in blelloch)
    assert all(torch.equal(a, b) for a, b in zip(blelloch, linear))
    assert_close_lists(blelloch, torch_res, tol=1e-5)


@pytest.mark.parametrize("scan", ["linear", "blelloch"])
@pytest.mark.parametrize("case", ["inf_gradient", "inf_weight"])
def test_relu_rnn_non_finite_gradients_match_torch(case, scan):
    """relu's derivative is applied as torch's threshold_backward applies it,
    a select: 0 where the output is <= 0 even for an inf gradient (the scan
    multiplied by 0 and made NaN of it), and the gradient itself where the
    output is NaN (the scan's y > 0 gave 0 there)."""
    torch.manual_seed(0)
    ref, ours = make_pair("relu", 2, 4, scan=scan)
    x, g = torch.randn(9, 3, 2), torch.randn(9, 3, 4)
    if case == "inf_gradient":
        g[-1, :, :2], g[3, 1, 2] = float("inf"), float("-inf")
    else:
        with torch.no_grad():
            for m in (ref, ours):
                m.weight_hh_l0[0, 1] = float("inf")
    results = []
    for m in (ours, ref):
        xr = x.clone().requires_grad_()
        m(xr)[0].backward(g)
        results.append([xr.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*results):
        assert not b.isfinite().all()  # the case is one of non-finite gradients
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_scan_activation_rejects_bad_arguments():
    w, y, v, c = activation_case("tanh", 6, 2, 3, 1, seed=0)
    with pytest.raises(ValueError, match="activation: expected 'tanh' or 'relu'"):
        bppsa.scan(c, w=w, activation="sigmoid", y=y)
    with pytest.raises(ValueError, match="activation: give v, or activation with y"):
        bppsa.scan(c, w=w, v=v, activation="tanh", y=y)
    with pytest.raises(ValueError, match="y: required with activation='relu'"):
        bppsa.scan(c, w=w, activation="relu")
    with pytest.raises(ValueError, match="y: only with activation"):
        bppsa.scan(c, w=w, v=v, y=y)
    with pytest.raises(ValueError, match="activation: structured leaves only"):
        bppsa.scan(c, jt=torch.randn(6, 2, 3, 3), activation="tanh", y=y)
    with pytest.raises(ValueError, match=r"y: expected shape \(6, 2, 3\)"):
        bppsa.scan(c, w=w, activation="tanh", y=y[:5])
    with pytest.raises(TypeError, match="y: expected float32"):
        bppsa.scan(c, w=w, activation="tanh", y=y.double())
    with pytest.raises(ValueError, match="out: overlaps y"):
        bppsa.scan(c, w=w, activation="tanh", y=y, out=y)
    with pytest.raises(TypeError, match="^pre_activation: expected True or False, got 1$"):
        bppsa.scan(c, w=w, v=v, pre_activation=1)
    with pytest.raises(ValueError, match="pre_activation: needs one gate"):
        bppsa.scan(c, w=torch.randn(9, 3), v=torch.rand(6, 2, 9), pre_activation=True)
    with pytest.raises(ValueError, match="pre_activation: needs one gate"):
        bppsa.scan(c, jt=torch.randn(6, 2, 3, 3), pre_activation=True)


def test_scan_checks_types_before_reading_them():
    """A NumPy operand or a list activation gets an error naming it, as jt
    always did; before: an AttributeError ('numpy.ndarray' object has no
    attribute 'dim') for w and c, a TypeError (unhashable type: 'list') for
    the activation. A w without a row block took the dense path and got the
    core's "scan: dense leaves need jt"."""
    w, y, v, c = activation_case("tanh", 6, 2, 3, 1, seed=0)
    for name, kwargs in [("w", dict(c=c, w=w.numpy(), v=v)), ("c", dict(c=c.numpy(), w=w, v=v)),
                         ("jt", dict(c=c, jt=torch.randn(6, 2, 3, 3).numpy()))]:
        with pytest.raises(TypeError, match=f"^{name}: expected a tensor, got ndarray$"):
            bppsa.scan(kwargs.pop("c"), **kwargs)
    with pytest.raises(ValueError, match=r"^activation: expected 'tanh' or 'relu', got \['tanh'\]$"):
        bppsa.scan(c, w=w, activation=["tanh"], y=y)
    with pytest.raises(ValueError, match=r"^w: expected a \(G\*3, 3\) tensor, G >= 1$"):
        bppsa.scan(c, w=torch.randn(0, 3), v=torch.randn(6, 2, 0))


def test_scan_levels_refuses_a_gpu_the_machine_lacks(monkeypatch):
    """cuda:7 on a machine with one GPU: an error naming device, before the
    cost model reads the device's properties (torch's "Invalid device id")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device in ("cuda:7", torch.device("cuda", 1)):
        with pytest.raises(ValueError, match=r"^device: expected a CUDA device index below 1 .*, got cuda:"):
            bppsa.scan_levels(10, 4, 3, 1, device)


def test_scan_out_rejects_overlap_and_bad_layout():
    c, w, v = torch.randn(6, 2, 3), torch.randn(3, 3), torch.rand(6, 2, 3)
    with pytest.raises(ValueError, match="out: overlaps v"):
        bppsa.scan(c, w=w, v=v, out=v)
    both = torch.randn(7, 2, 3)
    with pytest.raises(ValueError, match="c itself or not overlap"):
        bppsa.scan(both[:6], w=w, v=v, out=both[1:])
    with pytest.raises(ValueError, match="out: expected a contiguous"):
        bppsa.scan(c, w=w, v=v, out=torch.empty(2, 6, 3).transpose(0, 1))
    with pytest.raises(ValueError, match=r"out: expected shape \(6, 2, 3\)"):
        bppsa.scan(c, w=w, v=v, out=torch.empty(5, 2, 3))


def test_scan_out_is_a_write_autograd_sees():
    """scan(out=) writes through a raw pointer: a tensor saved for backward
    and overwritten so raises autograd's in-place error, as torch's out=
    ops do, and allow_mutation_on_saved_tensors() keeps the saved value."""
    c, w, v = torch.randn(6, 2, 3), torch.randn(3, 3), torch.rand(6, 2, 3)
    leaf = torch.randn(6, 2, 3, requires_grad=True)
    out = leaf * 1.0
    loss = (out * out).sum()  # saves out
    with torch.no_grad():  # out requires grad: refused under grad mode, as by torch's out=
        bppsa.scan(c, w=w, v=v, out=out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        out = leaf * 1.0
        loss = (out * out).sum()
        with torch.no_grad():
            bppsa.scan(c, w=w, v=v, out=out)
        loss.backward()
    torch.testing.assert_close(leaf.grad, 2 * leaf.detach(), rtol=0, atol=0)


def test_scan_follows_autograd_and_inference_mode_rules():
    """scan records no graph: an operand requiring grad lost its gradient
    silently (the result did not require grad), and out= wrote a leaf that
    requires grad and an inference tensor outside inference mode, where
    torch's out= functions and in-place writes refuse both."""
    T, B, H = 4, 2, 3
    c, w, v, y = torch.randn(T, B, H), torch.randn(H, H), torch.rand(T, B, H), torch.rand(T, B, H)
    want = bppsa.scan(c, w=w, v=v)
    for name in ("c", "w", "v"):
        args = {"c": c, "w": w, "v": v}
        args[name] = args[name].clone().requires_grad_()
        with pytest.raises(RuntimeError, match=f"^{name}: requires grad, but scan is not differentiable"):
            bppsa.scan(**args)
        with pytest.raises(RuntimeError, match=r"^scan\(\): functions with out=\.\.\. arguments don't "
                                               rf"support automatic differentiation.*\({name}\)"):
            bppsa.scan(**args, out=torch.empty(T, B, H))
        with torch.no_grad():  # nothing to record: torch's ops run too
            assert torch.equal(bppsa.scan(**args), want)
    yg = y.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="^y: requires grad"):
        bppsa.scan(c, w=w, activation="tanh", y=yg)
    leaf = torch.zeros(T, B, H, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"automatic differentiation.*\(out\)"):
        bppsa.scan(c, w=w, v=v, out=leaf)
    assert torch.count_nonzero(leaf) == 0
    with torch.no_grad():
        bppsa.scan(c, w=w, v=v, out=leaf)
    assert torch.equal(leaf, want)
    with torch.inference_mode():
        inference = torch.zeros(T, B, H)
    with pytest.raises(RuntimeError, match="^out: inplace update to inference tensor outside InferenceMode"):
        bppsa.scan(c, w=w, v=v, out=inference)
    assert torch.count_nonzero(inference) == 0
    with torch.inference_mode():
        assert bppsa.scan(c, w=w, v=v, out=inference) is inference
    assert torch.equal(inference, want)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_scan_refuses_what_only_torch_carries():
    """scan's kernels read raw memory and record no graph: a forward-AD dual
    operand lost its tangent without a word (the result had none), a
    functorch-wrapped one raised torch's 'Cannot access data pointer' and a
    nested c torch's internal 'NestedTensorImpl doesn't support sizes',
    naming no operand. Now each is refused by name, as the chain refuses
    them; a plain call under a dual level is unchanged."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    T, B, H = 4, 2, 3
    c, w = torch.randn(T, B, H), torch.randn(H, H)
    calls = [({"c": c, "w": w, "u": torch.rand(T, B, H), "v": torch.rand(T, B, H), "out": torch.empty(T, B, H)}, {}),
             ({"c": c, "w": w, "y": torch.rand(T, B, H)}, {"activation": "tanh"}),
             ({"c": c, "jt": torch.randn(T, B, H, H)}, {})]
    refused = "a tensor of a torch.func transform .*Call scan outside the transform or mode, or use autograd"
    for operands, options in calls:
        want = bppsa.scan(**operands, **options).clone()
        with fwAD.dual_level():
            assert torch.equal(bppsa.scan(**operands, **options), want)
            for name, t in operands.items():
                dual = dict(operands, **{name: fwAD.make_dual(t, torch.ones_like(t))})
                with pytest.raises(RuntimeError, match=f"^{name}: {refused}"):
                    bppsa.scan(**dual, **options)
    v = torch.rand(T, B, H)
    with pytest.raises(RuntimeError, match=f"^c: {refused}"):
        torch.vmap(lambda c: bppsa.scan(c, w=w, v=v))(torch.randn(3, T, B, H))
    with pytest.raises(RuntimeError, match=f"^w: {refused}"):
        torch.vmap(lambda w: bppsa.scan(c, w=w, v=v))(torch.randn(3, H, H))
    with pytest.raises(RuntimeError, match=f"^v: {refused}"):
        torch.func.grad(lambda v: bppsa.scan(c, w=w, v=v).sum())(v)
    nested = torch.nested.nested_tensor([torch.randn(B, H), torch.randn(B + 1, H)])
    with pytest.raises(RuntimeError, match=f"^c: {refused}"):
        bppsa.scan(nested, w=w, v=v)
    # real operands under a FakeTensorMode (a dry run): its output was fake, and
    # the C core refused its null pointer ('scan: NULL jacobians, c or g')
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match=f"^c: {refused}"):
        bppsa.scan(c, w=w, v=v)


def test_linear_scan_needs_no_workspace():
    assert _C.scan_workspace(1000, 16, 20, 0) == 0
    # products for the odd slots 3, 5, ..., 999 only: slot 1's pair is on the
    # spine (a mat-vec), and its B H H floats were held but never touched
    assert _C.scan_workspace(1000, 16, 20, 1) == 1001 * 16 * 20 + 499 * 16 * 20 * 20
    assert [_C.scan_workspace(n, 2, 3, 1) for n in (2, 3, 4, 5)] == [18, 24, 30 + 18, 36 + 18]


def test_scan_entry_points_check_sizes_at_int64_ends():
    # the C core checks its own ranges: levels >= 64 shifted 1 << levels and
    # divided by zero (SIGFPE), a workspace count wrapped to 0, n >= 2**62
    # never left the level count's loop; levels past int were truncated
    machine = (1.0, 1.0, 1.0)
    for levels in (-1, 4, 64, 2**31 - 1):
        with pytest.raises(ValueError, match=r"levels must be in \[0, 3\] for n = 10"):
            _C.scan_cost(10, 1, 1, 1, levels, *machine)
    for levels in (2**32, 2**33 + 1):
        int_range = r"\[-2147483648, 2147483647\]"
        with pytest.raises(OverflowError, match=rf"^levels: expected an int in {int_range}, got {levels}"):
            _C.scan_cost(10, 1, 1, 1, levels, *machine)
    assert _C.scan_cost(10, 1, 1, 1, 3, *machine) > 0
    with pytest.raises(ValueError, match="workspace of n = 4611686018427387904.* passes INT64_MAX bytes"):
        _C.scan_workspace(2**62, 2**62, 2**62, 60)
    with pytest.raises(ValueError, match="workspace of n = 2305843009213693952, batch = 1, dim = 1"):
        _C.scan_workspace(2**61, 1, 1, 1)
    assert _C.scan_workspace(2**62, 2**62, 2**62, 0) == 0  # the linear scan needs none
    assert [_C.scan_plan(n, 1, 1, 1, 1.0, 0.0, 0.0)[1] for n in (2**62 - 1, 2**62, 2**63 - 1)] == [61, 62, 62]


def test_csr_entry_points_reject_non_tuples():
    # PyArg_ParseTuple on a non-tuple raised SystemError
    with pytest.raises(TypeError, match="^geometry: expected a tuple, got int"):
        _C.jacobian("linear", 5)
    with pytest.raises(TypeError, match=r"^geometry: expected \(in_features, out_features\), 2 ints"):
        _C.jacobian("linear", (5, 3, 1))
    with pytest.raises(TypeError, match=r"^geometry: expected \(size, 0\), 2 ints"):
        _C.jacobian("diagonal", (5,))
    leaf = (2, 2, np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), False, None, 2)
    with pytest.raises(TypeError, match=r"^leaves\[1\]: expected a tuple, got int"):
        _C.csr_plan([leaf, 5], 0, 0, 1.0, 1.0, 1.0)
    with pytest.raises(TypeError, match=r"^leaves: expected tuples \(rows, cols, indptr"):
        _C.csr_plan([leaf, leaf[:3]], 0, 0, 1.0, 1.0, 1.0)
    assert _C.csr_plan_info(_C.csr_plan([leaf, leaf], 0, 0, 1.0, 1.0, 1.0))["levels"] == 0


def test_csr_plan_refuses_a_decreasing_indptr():
    """indptr [0, 3, 2] ends at nnz = 2 but row 0 claims 3 entries: the plan
    read indices[2], past a view of the first two (it planned on garbage)."""
    indices = np.array([0, 1, 2, 3], np.int32)[:2]
    leaf = (2, 4, np.array([0, 3, 2], np.int32), indices, False, None, 0)
    nxt = (4, 4, np.arange(5, dtype=np.int32), np.arange(4, dtype=np.int32), False, None, 0)
    with pytest.raises(ValueError, match="layer 0: indptr must run from 0 to nnz without decreasing"):
        _C.csr_plan([leaf, nxt], -1, 0, 1.0, 4e3, 20.0)


def test_max_levels_and_cost_model():
    assert [bppsa.max_levels(n) for n in (1, 2, 3, 4, 7, 8, 1000)] == [0, 1, 1, 2, 2, 3, 9]
    # two CPU threads: the linear scan's matrix-vector steps win over H x H products
    with torch_threads(2):
        assert bppsa.scan_levels(1000, 16, 20, 1, "cpu") == 0


def test_scan_rejects_bad_input():
    c = torch.randn(5, 2, 3)
    jt = torch.randn(5, 2, 3, 3)
    with pytest.raises(TypeError, match="c: expected float32"):
        bppsa.scan(c.double(), jt=jt.double())
    with pytest.raises(ValueError, match=r"jt: expected shape \(5, 2, 3, 3\)"):
        bppsa.scan(c, jt=jt[:4])
    with pytest.raises(ValueError, match="w: expected"):
        bppsa.scan(c, w=torch.randn(4, 3), v=torch.randn(5, 2, 3))
    with pytest.raises(ValueError, match="either dense jt or the structured"):
        bppsa.scan(c, jt=jt, w=torch.randn(3, 3))
    with pytest.raises(ValueError, match="^levels: expected one of"):
        bppsa.scan(c, jt=jt, levels="fast")
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="^levels: "):
            bppsa.scan(c, jt=jt, levels=bad)
    for args, name in [((0, 4, 3, 1), "n"), ((10, -1, 3, 1), "batch"), ((10, 4, 0, 1), "hidden"),
                       ((10, 4, 3, -3), "gates"), ((10, 4, 3, True), "gates")]:
        with pytest.raises(ValueError, match=f"^{name}: expected an int"):
            bppsa.scan_levels(*args)
    with pytest.raises(ValueError, match="^n: expected an int"):
        bppsa.max_levels(0)
    assert bppsa.scan_levels(np.int64(10), np.int32(2), 4, 1) == bppsa.scan_levels(10, 2, 4, 1)
    assert bppsa.max_levels(np.int64(10)) == 3
    with pytest.raises(ValueError, match="^device: expected a CPU or CUDA device"):
        bppsa.scan_levels(10, 4, 3, 1, "meta")
    with pytest.raises(RuntimeError, match="sparse"):
        bppsa.scan(c.to_sparse(), jt=jt)
    with pytest.raises(ValueError, match="c: expected a hidden size H of at least 1"):
        bppsa.scan(torch.randn(5, 2, 0), w=torch.randn(0, 0), v=torch.randn(5, 2, 0))
    for levels in ("linear", "blelloch"):  # an empty batch has an empty result
        g = bppsa.scan(torch.randn(5, 0, 3), w=torch.randn(3, 3), v=torch.randn(5, 0, 3), levels=levels)
        assert g.shape == (5, 0, 3)


def test_scan_refuses_operands_of_the_right_size_but_another_shape():
    """The kernels read each operand's memory in its (T, B, ...) layout: one
    with as many elements in another shape (a batch-first u, a transposed
    jt) would be read as the wrong steps and samples, a silently wrong g."""
    c, w = torch.randn(5, 2, 3), torch.randn(3, 3)
    for name, kwargs in [("u", dict(w=w, u=torch.randn(5, 3, 2), v=torch.randn(5, 2, 3))),
                         ("v", dict(w=w, v=torch.randn(2, 5, 3))),
                         ("y", dict(w=w, y=torch.randn(2, 5, 3), activation="tanh")),
                         ("jt", dict(jt=torch.randn(2, 5, 3, 3))),
                         ("out", dict(jt=torch.randn(5, 2, 3, 3), out=torch.empty(2, 5, 3)))]:
        with pytest.raises(ValueError, match=f"^{name}: expected shape"):
            bppsa.scan(c, **kwargs)


def test_scan_refuses_a_w_of_no_gate():
    """w (0, H) is no gate: refused naming w, as any w not (G*H, H) with
    G >= 1, rather than run as G = 0, which the core took for dense leaves
    and refused for a jt never given."""
    with pytest.raises(ValueError, match=r"^w: expected a \(G\*3, 3\) tensor, G >= 1"):
        bppsa.scan(torch.randn(5, 2, 3), w=torch.randn(0, 3), v=torch.randn(5, 2, 0))


# ---------------------------------------------------------------------------
# The modules against nn.RNN / nn.GRU
# ---------------------------------------------------------------------------

KINDS = ["tanh", "relu", "gru"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("scan", ["auto", "linear", "blelloch", 2])
def test_gradients_equal_torch(kind, T, scan):
    torch.manual_seed(T)
    ref, ours = make_pair(kind, 4, 6, num_layers=2, scan=scan)
    x, h0 = torch.randn(T, 3, 4), torch.randn(2, 3, 6)
    w_out = torch.randn(T, 3, 6)
    assert_close_lists(run(ours, x, h0, w_out), run(ref, x, h0, w_out))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scan", ["linear", "blelloch"])
def test_gradients_long_sequence(kind, scan):
    torch.manual_seed(1)
    ref, ours = make_pair(kind, 1, 8, scan=scan)
    x = torch.randn(1000, 2, 1)
    w_out = torch.randn(1000, 2, 8) * 0.1
    assert_close_lists(run(ours, x, None, w_out), run(ref, x, None, w_out))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_layouts_and_options(kind, batch_first, with_h0, bidirectional):
    torch.manual_seed(3)
    ref, ours = make_pair(kind, 5, 7, num_layers=2, batch_first=batch_first,
                          bidirectional=bidirectional)
    T, B, dirs = 9, 4, 2 if bidirectional else 1
    x = torch.randn(B, T, 5) if batch_first else torch.randn(T, B, 5)
    h0 = torch.randn(2 * dirs, B, 7) if with_h0 else None
    w_out = torch.randn(*x.shape[:2], 7 * dirs)
    assert_close_lists(run(ours, x, h0, w_out), run(ref, x, h0, w_out))


@pytest.mark.parametrize("kind", KINDS)
def test_without_bias_and_unbatched(kind):
    torch.manual_seed(4)
    ref, ours = make_pair(kind, 3, 5, bias=False)
    x, h0, w_out = torch.randn(11, 3), torch.randn(1, 5), torch.randn(11, 5)
    assert_close_lists(run(ours, x, h0, w_out), run(ref, x, h0, w_out))


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_batch_first_output_is_nns_bits_with_a_frozen_input_weight(kind):
    """Found by the differential fuzzer: nn.RNN/GRU give unbatched input a
    batch dim at batch_first's place and transpose it, and torch's bias-less
    input projection (a matmul) computes that (T, 1, I) view otherwise than a
    contiguous one where its weight does not require grad: the forward
    unsqueezed at dim 1 was up to 1.2e-7 off nn's output."""
    torch.manual_seed(6)
    for _ in range(5):
        ref, ours = make_pair(kind, 10, 2, bias=False, batch_first=True, bidirectional=True)
        for module in (ref, ours):
            module.weight_ih_l0.requires_grad_(False)
        x, h0 = torch.randn(3, 10), torch.randn(2, 2)
        for want, got in zip(ref(x, h0), ours(x, h0)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_sizes_and_batches(kind):
    for H, B in [(1, 1), (20, 16), (33, 5)]:
        torch.manual_seed(H)
        ref, ours = make_pair(kind, 2, H, scan="blelloch")
        x, w_out = torch.randn(50, B, 2), torch.randn(50, B, H)
        assert_close_lists(run(ours, x, None, w_out), run(ref, x, None, w_out))


def test_dropout_between_layers_matches_with_same_masks():
    torch.manual_seed(5)
    ref, ours = make_pair("tanh", 3, 4, num_layers=2, dropout=0.5)
    ours.eval(), ref.eval()  # eval: no dropout, identical results
    x, w_out = torch.randn(6, 2, 3), torch.randn(6, 2, 4)
    assert_close_lists(run(ours, x, None, w_out), run(ref, x, None, w_out))
    ours.train()
    out, _ = ours(x)
    assert out.shape == (6, 2, 4)


@pytest.mark.parametrize("kind", ["tanh", "gru"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_dropout_between_layers_draws_torch_masks(kind, packed, bidirectional):
    """In train mode the same seed draws nn's dropout masks: over the (T, B, F)
    output, or for a PackedSequence over its packed rows, as torch does: the
    outputs and gradients equal torch's, and the generator is left where nn
    leaves it."""
    torch.manual_seed(11)
    ref, ours = make_pair(kind, 3, 5, num_layers=3, dropout=0.5, bidirectional=bidirectional)
    x = torch.randn(7, 3, 3)
    results = []
    for module in (ref, ours):
        torch.manual_seed(5)
        if packed:
            res, _ = run_packed(module, x, [7, 1, 4], None, False)
        else:
            res = run(module, x, None, torch.randn(7, 3, 5 * (1 + bidirectional),
                                                   generator=torch.Generator().manual_seed(1)))
        results.append((res, torch.rand(4)))
    (ref_res, ref_next), (our_res, our_next) = results
    assert_close_lists(our_res, ref_res)
    assert torch.equal(our_next, ref_next)


def run_packed(module, x, lengths, h0, sort):
    """run() for a PackedSequence of x's first `lengths` steps, returning the
    packed output's fields as well."""
    x = x.detach().clone().requires_grad_()
    h0 = None if h0 is None else h0.detach().clone().requires_grad_()
    out, h_n = module(nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=sort), h0)
    # drawn on the CPU (the same values on every device), then moved to out's
    weight_out = torch.randn(out.data.shape, generator=torch.Generator().manual_seed(1)).to(out.data.device)
    ((out.data * weight_out).sum() + h_n.sin().sum()).backward()
    grads = [x.grad] + ([h0.grad] if h0 is not None else []) + [p.grad for p in module.parameters()]
    return [out.data.detach(), h_n.detach()] + grads, out


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind", ["tanh", "relu", "gru"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_packed_sequences_match_torch(kind, bidirectional, device):
    """PackedSequence input, sorted or not, with and without h0, over two
    layers: the packed output (same layout), h_n and every gradient equal
    torch's, which runs each sequence for its own length only; bidirectional
    layers read each sequence backwards from its own last step. On CUDA
    cuDNN runs in float32 (cudnn_fp32: its TF32 backward is about 1e-3 off
    the scan's float32)."""
    torch.manual_seed(6)
    ref, ours = make_pair(kind, 3, 5, num_layers=2, bidirectional=bidirectional)
    ref, ours = ref.to(device), ours.to(device)
    x = torch.randn(9, 5, 3, device=device)
    for sort, lengths, h0 in [(False, [7, 3, 9, 1, 5], None),
                              (True, [9, 9, 4, 2, 1], torch.randn(2 * (1 + bidirectional), 5, 5))]:
        h0 = None if h0 is None else h0.to(device)
        with cudnn_fp32():
            (ref_res, ref_out), (our_res, our_out) = (run_packed(m, x, lengths, h0, sort) for m in (ref, ours))
        assert torch.equal(our_out.batch_sizes, ref_out.batch_sizes)
        for a, b in [(our_out.sorted_indices, ref_out.sorted_indices),
                     (our_out.unsorted_indices, ref_out.unsorted_indices)]:
            assert (a is None and b is None) or torch.equal(a, b)
        assert_close_lists(our_res, ref_res)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["seq_first", "batch_first", "unbatched", "bidirectional",
                                    "packed", "packed_bidirectional"])
@pytest.mark.parametrize("train", [False, True])
def test_outputs_are_torchs_bit_for_bit(kind, layout, train):
    """Each layer's forward is the kernel call nn's makes for it (both
    directions in one call, a PackedSequence's rows with their batch
    sizes), so the output and h_n are nn's bit for bit, over two layers,
    with dropout between them in training (before: each direction ran a
    unidirectional kernel, the reverse one over flipped input, and packed
    input ran as a zero-padded batch, up to about 1e-7 off; H = 7 and a
    batch of 3 are sizes where both differed)."""
    torch.manual_seed(13)
    bidirectional, packed = "bidirectional" in layout, layout.startswith("packed")
    ref, ours = make_pair(kind, 5, 7, num_layers=2, dropout=0.3, bidirectional=bidirectional,
                          batch_first=layout == "batch_first")
    ref.train(train), ours.train(train)
    batch = () if layout == "unbatched" else (3,)
    x = torch.randn(3, 9, 5) if layout == "batch_first" else torch.randn(9, *batch, 5)
    h0 = torch.randn(2 * (1 + bidirectional), *batch, 7)
    results = []
    for module in (ref, ours):
        torch.manual_seed(2)
        out, h_n = module(nn.utils.rnn.pack_padded_sequence(x, [6, 9, 2], enforce_sorted=False)
                          if packed else x, h0)
        results.append((out.data if packed else out, h_n))
    (ref_out, ref_h_n), (out, h_n) = results
    assert torch.equal(out, ref_out), (out - ref_out).abs().max()
    assert torch.equal(h_n, ref_h_n), (h_n - ref_h_n).abs().max()


def test_packed_padding_that_overflows_leaves_gradients_finite():
    """The recurrence of a short sequence's padding can overflow (ReLU, a
    growing W_hh): what it computed there must not reach any gradient as
    inf * 0 = NaN, since torch never computes those steps."""
    ref, ours = make_pair("relu", 1, 2)
    with torch.no_grad():
        for m in (ref, ours):
            m.weight_ih_l0.fill_(1.0)
            m.weight_hh_l0.copy_(3 * torch.eye(2))
            m.bias_hh_l0.fill_(1.0)
    x = torch.zeros(200, 2, 1)
    x[:, 0] = -1e3  # sample 0 stays at 0 for 200 steps; sample 1 is 1 step, then padding growing 3x a step
    ref_res, _ = run_packed(ref, x, [200, 1], None, True)
    our_res, _ = run_packed(ours, x, [200, 1], None, True)
    assert all(torch.isfinite(g).all() for g in our_res)
    assert_close_lists(our_res, ref_res)


@pytest.mark.parametrize("kind", ["tanh", "gru"])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("layout", ["seq_first", "batch_first", "bidirectional", "unbatched", "packed"])
@pytest.mark.parametrize("with_h0", [False, True])
def test_h_n_is_not_part_of_the_output(kind, num_layers, layout, with_h0):
    """h_n is an output of its own, as nn's: autograd.grad(h_n, output) is
    None, and a hook or retain_grad on the output sees the output's gradient
    only (before: a unidirectional sequence-first output also got h_n's at
    its last step, and the hook scaled it into every gradient)."""
    torch.manual_seed(7)
    ref, ours = make_pair(kind, 3, 5, num_layers=num_layers, batch_first=layout == "batch_first",
                          bidirectional=layout == "bidirectional")
    dirs, batch = 2 if layout == "bidirectional" else 1, () if layout == "unbatched" else (2,)
    x = torch.randn(2, 6, 3) if layout == "batch_first" else torch.randn(6, *batch, 3)
    h0 = torch.randn(num_layers * dirs, *batch, 5) if with_h0 else None

    def forward(module, x):
        x = nn.utils.rnn.pack_padded_sequence(x, [6, 4]) if layout == "packed" else x
        out, h_n = module(x, h0)
        return (out.data if layout == "packed" else out), h_n

    results = []
    for module in (ref, ours):
        out, h_n = forward(module, x)
        assert torch.autograd.grad(h_n.sum(), out, allow_unused=True) == (None,)
        leaf = x.clone().requires_grad_()  # h_n's gradient alone reaches the layers
        (grad_x_from_h_n,) = torch.autograd.grad(forward(module, leaf)[1].sin().sum(), leaf)
        out, h_n = forward(module, x)
        out.retain_grad()
        out.register_hook(lambda g: g * 3)
        (out.pow(2).sum() + h_n.sin().sum()).backward()
        results.append([out.grad, grad_x_from_h_n] + [p.grad for p in module.parameters()])
    assert_close_lists(results[1], results[0])


@pytest.mark.parametrize("kind", ["tanh", "gru"])
def test_backward_leaves_the_outputs_gradient_as_it_got_it(kind):
    """The scan's c is the output's gradient plus h_n's at the last step:
    backward builds it in a copy. Written into the gradient autograd passed
    (a copy dropped), a hook that kept the output's gradient (gradient
    statistics, logging) saw h_n's gradient added to its last step."""
    torch.manual_seed(5)
    ref, ours = make_pair(kind, 3, 4)
    x = torch.randn(5, 2, 3)
    weight = torch.randn(5, 2, 4)
    kept = []
    for module in (ref, ours):
        out, h_n = module(x)
        seen = []
        out.register_hook(seen.append)
        ((out * weight).sum() + h_n.sum()).backward()
        kept.append(seen[0])
    assert torch.equal(kept[0], weight) and torch.equal(kept[1], weight)


@pytest.mark.parametrize("kind", KINDS)
def test_bias_changed_in_place_before_backward(kind):
    """A step on the biases between forward and backward (an optimizer or EMA
    step under no_grad) is no error, as in nn.RNN/nn.GRU, whose backward
    reads no bias (the GRU's keeps its gates): the gradients are those of
    the forward's biases, torch's after the same change (before, the layers
    saved the biases and backward raised autograd's in-place version error).
    A change that reached the GRU's gate recomputation would move every
    gradient by far more than the tolerance."""
    torch.manual_seed(12)
    ref, ours = make_pair(kind, 4, 6, num_layers=2, bidirectional=True)
    x, h0, w_out = torch.randn(7, 3, 4), torch.randn(4, 3, 6), torch.randn(7, 3, 12)
    results = []
    for module in (ref, ours):
        leaf = x.clone().requires_grad_()
        out, h_n = module(leaf, h0)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.startswith("bias"):
                    p.add_(0.5)
        ((out * w_out).sum() + h_n.sin().sum()).backward()
        results.append([leaf.grad] + [p.grad for p in module.parameters()])
    assert_close_lists(results[1], results[0])


def test_saves_only_what_torch_saves():
    """The scan recomputes the Jacobians in backward: the layer keeps x, h0,
    the weights and the output sequence, nothing of size T*B*H*H."""
    ours = bppsa.RNN(3, 8, scan="blelloch")
    x = torch.randn(50, 4, 3, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        ours(x)[0].sum().backward()
    assert max(saved) <= 50 * 4 * 8
    assert sum(saved) <= 50 * 4 * (3 + 8) + 4 * 8 + 2 * 64 + 2 * 8 + 8 * 3


def backward_peak_bytes(out: torch.Tensor, grad: torch.Tensor) -> int:
    """Peak bytes torch's CPU allocator holds during out.backward(grad) beyond
    what it held before: the running sum of the profiler's allocation events
    (sizes and order of allocations, nothing timed)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out.backward(grad)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("kind, buffers", [("tanh", 1), ("relu", 1), ("gru", 6)])
def test_backward_temporaries(kind, buffers):
    """Backward's (T, B, H) float32 buffers, beyond the gradients it returns:
    the RNN's d, which the scan writes, reading f'(out) off out; the GRU's six
    gate blocks, all else in place over them (before: 4, then 2 for the RNN;
    19 for the GRU)."""
    T, B, H, I = 300, 8, 16, 4
    torch.manual_seed(0)
    module = bppsa.GRU(I, H, scan="linear") if kind == "gru" else bppsa.RNN(I, H, nonlinearity=kind, scan="linear")
    x = torch.randn(T, B, I, requires_grad=True)
    out, _ = module(x)
    peak = backward_peak_bytes(out, torch.randn(T, B, H))
    unit = T * B * H * 4
    # the slack: x's gradient (T B I) and the (B, H) and weight-sized ones
    assert peak <= buffers * unit + unit // 3, peak / unit


@pytest.mark.parametrize("kind, buffers", [("tanh", 1), ("gru", 6)])
def test_backward_temporaries_bidirectional(kind, buffers):
    """What README gives for a bidirectional layer: the directions run one
    after the other, and the reverse one takes x, out and grad_out in
    flipped copies (the forward one its halves of out and grad_out, which
    are strided) beside its own buffers and x's gradient from the first."""
    T, B, H, I = 300, 8, 16, 4
    torch.manual_seed(0)
    module = (bppsa.GRU(I, H, bidirectional=True, scan="linear") if kind == "gru"
              else bppsa.RNN(I, H, bidirectional=True, scan="linear"))
    x = torch.randn(T, B, I, requires_grad=True)
    out, _ = module(x)
    peak = backward_peak_bytes(out, torch.randn(T, B, 2 * H))
    unit = T * B * H * 4
    # copies of out and grad_out, the buffers, x's copy and two of its gradients
    want = (2 + buffers) * unit + 3 * unit * I // H
    assert want - unit // 3 <= peak <= want + unit // 3, peak / unit


@pytest.mark.parametrize("loss", ["square", "linear"])
def test_double_backward_is_refused(loss):
    """create_graph=True through the scan raises, also for a loss linear in the
    output (a critic's score), whose grad_output needs no grad: there the
    penalty's second-order terms would silently be lost."""
    ours = bppsa.GRU(2, 3)
    x = torch.randn(4, 1, 2, requires_grad=True)
    out = ours(x)[0]
    score = out.pow(2).sum() if loss == "square" else out.sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(score, x, create_graph=True)


@pytest.mark.parametrize("call", ["jvp", "hessian"])
def test_old_functional_api_refusal_names_it_and_what_works(call):
    """torch.autograd.functional's jvp, hvp, vhp and hessian backpropagate
    twice (create_graph=True) without the user writing it: the refusal said
    only "double backward (create_graph=True ...)". It names them now and
    what works here, torch.func's and forward AD, which do give nn's values."""
    torch.manual_seed(0)
    ours, ref = bppsa.GRU(2, 3), nn.GRU(2, 3)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 1, 2)
    if call == "jvp":
        run = lambda: torch.autograd.functional.jvp(lambda t: ours(t)[0], x, torch.ones_like(x))
    else:
        run = lambda: torch.autograd.functional.hessian(lambda t: ours(t)[0].sum(), x)
    with pytest.raises(RuntimeError, match=r"double backward .*torch\.autograd\.functional's jvp, hvp, "
                                           r"vhp and hessian .*torch\.func\.jvp"):
        run()
    got = torch.func.jvp(lambda t: ours(t)[0], (x,), (torch.ones_like(x),))[1]
    want = torch.func.jvp(lambda t: ref(t)[0], (x,), (torch.ones_like(x),))[1]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("make", [lambda: bppsa.GRU(2, 3), lambda: bppsa.RNN(2, 3)],
                         ids=["gru", "rnn"])
def test_batched_gradients_are_refused_clearly(make):
    """autograd.grad(is_grads_batched=True) hands backward gradients without
    storage: a clear error, not the scan's 'Cannot access data pointer'."""
    x = torch.randn(4, 1, 2, requires_grad=True)
    out = make()(x)[0]
    with pytest.raises(RuntimeError, match="batched gradients .*torch.nn.RNN/GRU"):
        torch.autograd.grad(out, x, torch.randn(3, *out.shape), is_grads_batched=True)


@pytest.mark.parametrize("make", [lambda: bppsa.GRU(2, 3), lambda: bppsa.RNN(2, 3)],
                         ids=["gru", "rnn"])
def test_jit_script_is_refused_clearly(make):
    """torch.jit.script names the module and what to do instead (before:
    "Module 'GRU' has no attribute '__dict__'", then "Can't redefine method")."""
    module = make()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"torch.jit.script: reprop.bppsa.(GRU|RNN) .*"
                                               "torch.jit.trace"):
            torch.jit.script(nn.Sequential(module))


class _RecurrentModel(nn.Module):
    """A model calling an RNN/GRU, as torch.compile meets one."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(4, 2)

    def forward(self, x):
        out, h_n = self.rnn(x)
        return self.head(out).relu().sum() + h_n.sum()


@pytest.mark.parametrize("kind", ["gru", "tanh"])
def test_torch_compile_runs_the_module_eagerly_as_nns(kind):
    """Dynamo does not trace nn.RNN/nn.GRU: a graph break at the call, the
    module eager. It compiled the BPPSA modules' Python frames one by one
    instead (inductor: out and h_n off nn's bits by about 1e-7, and two
    UserWarnings about C checks it cannot trace). Now the module runs
    eagerly as nn's (its bits, the scan's gradients), no graph holds any of
    its ops, and nothing warns; strict torch.export (allow_rnn) traces
    torch's recurrence, as for nn's modules (before: an Unsupported error)."""
    torch.manual_seed(0)
    ref, ours = make_pair(kind, 3, 4)
    models = _RecurrentModel(ref), _RecurrentModel(ours)
    models[1].head.load_state_dict(models[0].head.state_dict())
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(5, 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = torch.compile(models[1], backend=backend)(x)
    loss.backward()
    loss_ref = models[0](x)
    loss_ref.backward()
    assert torch.equal(loss, loss_ref)
    recurrences = [node for gm in graphs for node in gm.graph.nodes
                   if any(name in str(node.target) for name in ("rnn_", "gru", "_VF"))]
    assert recurrences == [], recurrences
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert rel_err(b.grad, a.grad) <= TOL, name
    torch._dynamo.reset()
    exported = torch.export.export(ours, (x,), strict=True).module()
    for got, want in zip(exported(x), ref(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _tangent(module, x, t):
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        return fwAD.unpack_dual(module(fwAD.make_dual(x, t))[0]).tangent


@pytest.mark.parametrize("kind", ["gru", "tanh"])
def test_what_the_scan_cannot_carry_runs_torch_own(kind):
    """Forward-mode AD, torch.func transforms, jit.trace and meta tensors run
    nn.RNN/GRU's own recurrence, with nn's results."""
    torch.manual_seed(0)
    ref, ours = make_pair(kind, 3, 4)
    x, t = torch.randn(5, 2, 3), torch.randn(5, 2, 3)
    torch.testing.assert_close(_tangent(ours, x, t), _tangent(ref, x, t), rtol=0, atol=0)
    grads = [torch.func.grad(lambda x: m(x)[0].sum())(x) for m in (ours, ref)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    # weights swapped in by functional_call are functorch's wrappers too
    params = {k: v.detach() for k, v in ours.named_parameters()}
    grads = [torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,))[0].sum())(params)
             for m in (ours, ref)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    torch.testing.assert_close(torch.jit.trace(ours, (x,))(x)[0], ref(x)[0], rtol=0, atol=0)
    meta = copy.deepcopy(ours).to("meta")
    out, h_n = meta(torch.empty(5, 2, 3, device="meta"))
    assert out.is_meta and out.shape == (5, 2, 4) and h_n.shape == (1, 2, 4)


@pytest.mark.parametrize("kind", ["gru", "tanh"])
def test_fake_tensor_mode_over_a_real_module_runs_torch_own(kind):
    """A memory dry run of a real model (FakeTensorMode with
    allow_non_fake_inputs=True) on a real batch: the scan's Function took
    the real input and its backward got fake gradients (GRU: a RuntimeError
    about batched gradients). Now nn's recurrence runs, as for a FakeTensor:
    its shapes, and FakeTensor gradients in the real weights' .grad, as nn's."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    torch.manual_seed(0)
    ref, ours = make_pair(kind, 3, 4)
    x = torch.randn(5, 2, 3)
    for m in (ref, ours):
        with FakeTensorMode(allow_non_fake_inputs=True):
            out, h_n = m(x)
            (out.sum() + h_n.sum()).backward()
        assert isinstance(out, FakeTensor) and out.shape == (5, 2, 4) and h_n.shape == (1, 2, 4)
        assert all(isinstance(p.grad, FakeTensor) for p in m.parameters())


@pytest.mark.parametrize("kind", ["gru", "tanh"])
def test_modules_a_transform_closes_over_run_torch_own(kind):
    """torch.func.grad or vmap of a function calling a module (and input) it
    closes over, so wraps none of its tensors: torch's recurrence runs, as
    nn's module gives (before: the scan's autograd.Function met functorch's
    refusal, no setup_context)."""
    torch.manual_seed(0)
    ref = nn.GRU(3, 4) if kind == "gru" else nn.RNN(3, 4)
    ours = (bppsa.GRU if kind == "gru" else bppsa.RNN)(3, 4)
    ours.load_state_dict(ref.state_dict())
    x, v, r = torch.randn(5, 2, 3), torch.randn(5, 2, 4), torch.randn(3)
    for transform in (lambda m: torch.func.grad(lambda v: (m(x)[0] * v).sum())(v),
                      lambda m: torch.vmap(lambda r: m(x)[0].sum() * r)(r)):
        torch.testing.assert_close(transform(ours), transform(ref), rtol=0, atol=0)


class _Doubled(nn.Module):
    """A parametrization: the weight read is twice the stored original."""

    def forward(self, w):
        return w * 2


def _reparametrize(module, how: str):
    """module with weight_hh_l0 computed on read: a parametrization, or the
    hook-based weight_norm (a pre-hook sets it before forward)."""
    if how == "parametrize":
        nn.utils.parametrize.register_parametrization(module, "weight_hh_l0", _Doubled())
    else:
        nn.utils.weight_norm(module, "weight_hh_l0")
    return module


@pytest.mark.filterwarnings("ignore:.*weight_norm. is deprecated")
@pytest.mark.parametrize("how", ["parametrize", "weight_norm"])
@pytest.mark.parametrize("kind", ["gru", "tanh"])
def test_reparametrized_weights_under_torch_func_run_torch_own(kind, how):
    """A weight computed on read (no entry in _parameters) from what
    functional_call swapped in is a transform's tensor: the check looked at
    _parameters, called it plain, and the scan's Function raised (functorch
    needs setup_context). Now torch's own recurrence, with nn's results;
    outside a transform the scan, as before."""
    torch.manual_seed(0)
    ref, ours = (_reparametrize(m, how) for m in make_pair(kind, 3, 4))
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 2, 3)
    # only what weight_hh_l0 is computed from: every other weight stays the module's own
    params = {k: v.detach() for k, v in ref.named_parameters() if k.startswith(("param", "weight_hh"))}
    assert len(params) == (1 if how == "parametrize" else 2)
    grads = [torch.func.grad(lambda p: (torch.func.functional_call(m, p, (x,))[0] ** 2).sum())(params)
             for m in (ours, ref)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    weight_out = torch.randn(5, 2, 4)
    assert_close_lists(run(ours, x, None, weight_out), run(ref, x, None, weight_out))


@pytest.mark.parametrize("kind", ["gru", "tanh"])
def test_parametrized_weight_of_a_dual_runs_torch_own(kind):
    """Forward AD through a parametrized weight whose original is a dual
    (torch's hook-based weight_norm has no forward AD of its own): the scan's
    Function raised for want of a jvp; now torch's own recurrence, with nn's
    tangent."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    ref, ours = (_reparametrize(m, "parametrize") for m in make_pair(kind, 3, 4))
    ours.load_state_dict(ref.state_dict())
    x, key = torch.randn(5, 2, 3), "parametrizations.weight_hh_l0.original"
    original = ref.get_parameter(key).detach()
    tangents = []
    for m in (ours, ref):
        with fwAD.dual_level():
            dual = {key: fwAD.make_dual(original, torch.ones_like(original))}
            tangents.append(fwAD.unpack_dual(torch.func.functional_call(m, dual, (x,))[0]).tangent)
    torch.testing.assert_close(tangents[0], tangents[1], rtol=0, atol=0)


def test_scan_choice_is_checked_when_set():
    """module.scan set after construction is checked there (a bad one failed
    only in backward, with int()'s error), as the constructor checks it."""
    rnn = bppsa.RNN(2, 3)
    for bad in ("Blelloch", None, 2.7, True, -1):
        with pytest.raises(ValueError, match="^scan: "):
            rnn.scan = bad
    rnn.scan = np.int64(2)
    assert rnn.scan == 2 and "scan=2" in repr(rnn)
    assert copy.deepcopy(rnn).scan == 2
    del rnn.__dict__["_scan"]
    rnn.__dict__["scan"] = "linear"  # a module saved before scan was a checked property
    assert rnn.scan == "linear"


def test_scan_auto_picks_the_linear_scan_where_levels_do_not_fit(monkeypatch):
    """Where the blocks of Blelloch levels would not fit in the device's
    shared memory (the CUDA scan, hidden sizes near 28,000), the cost model
    picks the linear scan. _scan_fits plays such a device here."""
    with torch_threads(64):  # Blelloch levels pay (test above)
        assert bppsa.scan_levels(5000, 512, 1, 1) > 0
        monkeypatch.setattr(bppsa, "_scan_fits", lambda device, hidden, levels: levels == 0)
        assert bppsa.scan_levels(5000, 512, 1, 1) == 0


@pytest.mark.parametrize("kind", ["tanh", "gru"])
def test_no_scan_fits_runs_torch_recurrence(monkeypatch, kind):
    """Where no scan fits the hidden size (the CUDA scan's shared memory past
    about 29,000), scan="auto" runs torch's own recurrence instead of
    raising at backward: torch's results bit for bit, packed input too. A
    forced choice still scans. _scan_fits plays such a device here."""
    scans = []
    layer_apply = bppsa._Layer.apply
    monkeypatch.setattr(bppsa._Layer, "apply", lambda *args: scans.append(1) or layer_apply(*args))
    monkeypatch.setattr(bppsa, "_scan_fits", lambda device, hidden, levels: hidden < 16)
    torch.manual_seed(3)
    ref, ours = make_pair(kind, 3, 20, num_layers=2)
    x, h0, w_out = torch.randn(9, 4, 3), torch.randn(2, 4, 20), torch.randn(9, 4, 20)
    for a, b in zip(run(ours, x, h0, w_out), run(ref, x, h0, w_out)):
        assert torch.equal(a, b)
    packed = nn.utils.rnn.pack_padded_sequence(x, [9, 7, 7, 2], enforce_sorted=False)
    assert torch.equal(ours(packed)[0].data, ref(packed)[0].data)
    assert scans == []
    ours.scan = "linear"
    ours(x)
    _, small = make_pair(kind, 3, 8)
    small(x)
    assert len(scans) == 2 + 1


def test_scan_auto_follows_the_thread_count():
    """The CPU cost model counts the threads torch uses now (it kept the
    count of its first call)."""
    with torch_threads(1):
        one = bppsa.scan_levels(5000, 512, 1, 1)
    with torch_threads(64):
        assert bppsa.scan_levels(5000, 512, 1, 1) > one == 0


def _at_thread_counts(fn, counts=(1, 2, 3)) -> list:
    """fn() at each of torch's thread counts in turn."""
    out = []
    for count in counts:
        with torch_threads(count):
            out.append(fn())
    return out


@pytest.mark.parametrize("levels", ["linear", 2, "blelloch"])
def test_forced_levels_give_the_same_bits_at_every_thread_count(levels):
    """README (Reproducibility): with the levels forced, the scan and a
    chain plan's backward give the same bits at 1, 2 and 3 threads: the
    threads take whole sequences, products and rows, each summed alone in a
    fixed order (only "auto", whose pick counts the threads, can change with
    them). The RNN modules' GEMMs are torch's, whose bits follow the thread
    count for nn.GRU too."""
    gen = torch.Generator().manual_seed(21)
    n, B, H = 45, 5, 6
    w, v = torch.randn(3 * H, H, generator=gen) / H, torch.rand(n, B, 3 * H, generator=gen)
    u, c = torch.rand(n, B, H, generator=gen) * 0.5, torch.randn(n, B, H, generator=gen)
    scans = _at_thread_counts(lambda: [bppsa.scan(c, w=w, u=u, v=v, levels=levels)])
    torch.manual_seed(1)
    plan = bppsa.ChainPlan(small_cnn(), (2, 6, 6), levels=levels)
    inputs, _ = plan.forward_inputs(torch.randn(7, 2, 6, 6, generator=gen))
    g = torch.randn(7, 4, generator=gen)
    for runs in (scans, _at_thread_counts(lambda: plan.backward(inputs, g))):
        for run in runs[1:]:
            assert len(run) == len(runs[0])
            for a, b in zip(run, runs[0]):
                assert torch.equal(bits(a), bits(b))


def test_module_rejects_bad_input():
    rnn = bppsa.RNN(2, 3)
    with pytest.raises(ValueError, match="hx: expected a 3-D tensor with a PackedSequence"):
        rnn(nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, 2), [4, 3]), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"hx: expected shape \(1, 2, 3\)"):
        rnn(nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, 2), [4, 3]), torch.randn(1, 3, 3))
    with pytest.raises(ValueError, match=r"hx: expected shape \(1, 2, 3\)"):
        rnn(torch.randn(4, 2, 2), torch.randn(1, 3, 3))
    with pytest.raises(TypeError, match="real floating-point"):
        rnn(torch.ones(4, 2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="scan: expected one of"):
        bppsa.GRU(2, 3, scan="fastest")
    with pytest.raises(ValueError, match=r"^scan: expected an int >= 0, got -1"):
        bppsa.GRU(2, 3, scan=-1)
    with pytest.raises(ValueError, match=r"input: expected 2 features \(input_size\)"):
        rnn(torch.randn(4, 2, 3))
    with pytest.raises(RuntimeError, match="input: sparse tensors are not supported"):
        rnn(torch.randn(4, 2, 2).to_sparse())
    with pytest.raises(TypeError, match="hx: expected torch.float32 on cpu like input"):
        rnn(torch.randn(4, 2, 2), torch.randn(1, 2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"input: expected torch.float32 like the weights \(weight_ih_l0\), "
                                         "got torch.bfloat16"):
        rnn(torch.randn(4, 2, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="input: expected torch.bfloat16 like the weights"):
        bppsa.GRU(2, 3).bfloat16()(torch.randn(4, 2, 2))
    # README: a dtype's error is also a TypeError (nn's class, ValueError, too);
    # the input of another dtype than the weights' was a plain ValueError
    for module, x in ((rnn, torch.randn(4, 2, 2, dtype=torch.bfloat16)),
                      (bppsa.RNN(2, 3).half(), torch.randn(4, 2, 2))):
        with pytest.raises(TypeError, match="like the weights") as raised:
            module(x)
        assert isinstance(raised.value, ValueError)
    with pytest.raises(ValueError, match="hx: expected a 2-D tensor with unbatched 2-D input, got 3-D"):
        rnn(torch.randn(4, 2), torch.randn(1, 1, 3))
    with pytest.raises(ValueError, match="hx: expected a 3-D tensor with batched 3-D input, got 2-D"):
        rnn(torch.randn(4, 1, 2), torch.randn(1, 3))
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        bppsa.convert("rnn")


def _packed(data: torch.Tensor) -> nn.utils.rnn.PackedSequence:
    return nn.utils.rnn.pack_padded_sequence(data, [5, 4, 2])


# (the call's arguments for a module RNN(4, 6) / GRU(4, 6), the class the
# modules raised before, the start of their message)
BAD_MODULE_CALLS = {
    "hx batch size": (lambda: (torch.randn(5, 3, 4), torch.randn(1, 2, 6)), ValueError, "hx: expected shape"),
    "hx hidden size": (lambda: (torch.randn(5, 3, 4), torch.randn(1, 3, 7)), ValueError, "hx: expected shape"),
    "2-D hx, 3-D input": (lambda: (torch.randn(5, 3, 4), torch.randn(1, 6)), ValueError, "hx: expected a 3-D"),
    # unbatched: the shape asked for is hx's as given, 2-D (before: "(1, 1, 6)", which then raised
    # "hx: expected a 2-D tensor with unbatched 2-D input")
    "hx hidden size, unbatched": (lambda: (torch.randn(5, 4), torch.randn(1, 7)), ValueError,
                                  "hx: expected shape (1, 6) with unbatched input, got (1, 7)"),
    "hx layers, unbatched": (lambda: (torch.randn(5, 4), torch.randn(2, 6)), ValueError,
                             "hx: expected shape (1, 6) with unbatched input, got (2, 6)"),
    "3-D hx, 2-D input": (lambda: (torch.randn(5, 4), torch.randn(1, 1, 6)), ValueError, "hx: expected a 2-D"),
    "2-D hx, packed": (lambda: (_packed(torch.randn(5, 3, 4)), torch.randn(1, 6)), ValueError, "hx: expected a 3-D"),
    "hx batch size, packed": (lambda: (_packed(torch.randn(5, 3, 4)), torch.randn(1, 2, 6)), ValueError,
                              "hx: expected shape"),
    "input size": (lambda: (torch.randn(5, 3, 5),), ValueError, "input: expected 4 features"),
    "no step": (lambda: (torch.randn(0, 3, 4),), ValueError, "input: expected a sequence"),
    "no step, unbatched": (lambda: (torch.randn(0, 4),), ValueError, "input: expected a sequence"),
    "float64 hx": (lambda: (torch.randn(5, 3, 4), torch.randn(1, 3, 6, dtype=torch.float64)), TypeError,
                   "hx: expected torch.float32"),
    "integer hx": (lambda: (torch.randn(5, 3, 4), torch.zeros(1, 3, 6, dtype=torch.int64)), TypeError,
                   "hx: expected a real"),
    "integer input": (lambda: (torch.zeros(5, 3, 4, dtype=torch.int64),), TypeError, "input: expected a real"),
    # (before: "input: the scan runs in float32; got float64", for float64 weights too)
    "float64 input": (lambda: (torch.randn(5, 3, 4, dtype=torch.float64),), TypeError,
                      "input: expected torch.float32 like the weights (weight_ih_l0), got torch.float64"),
    "float64 packed": (lambda: (_packed(torch.randn(5, 3, 4, dtype=torch.float64)),), TypeError,
                       "input: expected torch.float32 like the weights (weight_ih_l0), got torch.float64"),
    "complex input": (lambda: (torch.randn(5, 3, 4, dtype=torch.complex64),), TypeError, "input: expected a real"),
    "integer packed": (lambda: (_packed(torch.zeros(5, 3, 4, dtype=torch.int64)),), TypeError,
                       "input: expected a real"),
}


@pytest.mark.parametrize("kind", ["tanh", "gru"])
@pytest.mark.parametrize("case", list(BAD_MODULE_CALLS))
def test_module_errors_are_instances_of_torchs(kind, case):
    """Each argument error is an instance of the class nn.RNN/nn.GRU raise for
    the same call (RuntimeError for hx and sizes, ValueError for an input
    dtype), so that code written against nn catches it after convert(), and
    still of the class the modules raised before, with their message (before:
    ValueError or TypeError alone)."""
    make_args, before, message = BAD_MODULE_CALLS[case]
    ref, ours = make_pair(kind, 4, 6)
    with pytest.raises(Exception) as torchs:
        ref(*make_args())
    with pytest.raises(before, match=f"^{re.escape(message)}") as raised:
        ours(*make_args())
    assert isinstance(raised.value, torchs.type), (torchs.type, type(raised.value).__mro__)


@pytest.mark.parametrize("batch_first", [False, True])
def test_module_empty_batch_is_torch_own(batch_first):
    """No sequence to scan: outputs and gradients (zeros) as nn.RNN gives them."""
    torch.manual_seed(0)
    ref = nn.RNN(2, 3, batch_first=batch_first)
    ours = bppsa.RNN(2, 3, batch_first=batch_first)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(0, 4, 2) if batch_first else torch.randn(4, 0, 2)
    (out_ref, h_ref), (out, h) = ref(x), ours(x)
    assert out.shape == out_ref.shape and h.shape == h_ref.shape
    (out.sum() + h.sum()).backward()
    (out_ref.sum() + h_ref.sum()).backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


# (kind, keyword arguments, input form): README's float64 cases
FLOAT64_CASES = [(kind, dict(num_layers=layers, bidirectional=bidirectional, batch_first=batch_first), form)
                 for kind in KINDS for layers, bidirectional, batch_first, form in
                 ((1, False, False, "batched"), (2, True, False, "batched"), (2, False, True, "batched"),
                  (2, True, True, "unbatched"), (2, True, False, "packed"))]


@pytest.mark.parametrize("kind, kwargs, form", FLOAT64_CASES)
@pytest.mark.parametrize("h0", [False, True])
def test_module_float64_is_nns_bitwise(kind, kwargs, form, h0):
    """A float64 module (model.double(), or convert() of one) runs torch's own
    recurrence: output, h_n and every gradient nn's bit for bit, the
    state_dict nn's (before: a TypeError, "the scan runs in float32")."""
    torch.manual_seed(len(FLOAT64_CASES) * h0 + FLOAT64_CASES.index((kind, kwargs, form)))
    ref = (nn.GRU(3, 5, **kwargs) if kind == "gru" else nn.RNN(3, 5, nonlinearity=kind, **kwargs)).double()
    ours = copy.deepcopy(ref)
    assert bppsa.convert(ours) == [""]
    D = 2 if kwargs["bidirectional"] else 1
    x = torch.randn((6, 3) if form == "unbatched" else (4, 6, 3) if kwargs["batch_first"] else (6, 4, 3),
                    dtype=torch.float64)
    hx = torch.randn((kwargs["num_layers"] * D,) + ((5,) if form == "unbatched" else (4, 5)), dtype=torch.float64)
    results = []
    for module in (ref, ours):
        given, state = x.clone().requires_grad_(), hx.clone().requires_grad_() if h0 else None
        call = nn.utils.rnn.pack_padded_sequence(given, [6, 5, 3, 1], batch_first=kwargs["batch_first"]) \
            if form == "packed" else given
        out, h_n = module(call, state)
        out = out.data if form == "packed" else out
        (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)).sum().add(
            h_n.sin().sum()).backward()
        results.append([out, h_n, given.grad] + ([state.grad] if h0 else []) + [p.grad for p in module.parameters()])
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        assert a.dtype == torch.float64 and torch.equal(a, b)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize("kind", KINDS)
def test_module_float64_gradcheck(kind):
    """torch.autograd.gradcheck (and gradgradcheck: torch's recurrence takes
    double backward) of a converted float64 module, two layers both ways,
    in the input, h0 and every weight (before: float64 raised)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.GRU(2, 3, num_layers=2, bidirectional=True) if kind == "gru" else
                          nn.RNN(2, 3, num_layers=2, bidirectional=True, nonlinearity=kind)).double()
    assert bppsa.convert(model) == ["0"]
    rnn = model[0]
    names = [name for name, _ in rnn.named_parameters()]

    def f(x, h0, *weights):
        return torch.func.functional_call(rnn, dict(zip(names, weights)), (x, h0))

    # relu: inputs away from its kink, where finite differences hold
    x = torch.randn(4, 2, 2, dtype=torch.float64) + (0.5 if kind == "relu" else 0.0)
    args = (x, torch.randn(4, 2, 3, dtype=torch.float64),
            *(p.detach().clone() for p in rnn.parameters()))
    args = tuple(a.requires_grad_() for a in args)
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradcheck(lambda x, h0: rnn(x, h0), args[:2])
    assert torch.autograd.gradgradcheck(lambda x, h0: rnn(x, h0), args[:2])


def test_module_float64_mixed_dtypes_raise_as_nn():
    """Only a float64 module takes float64: float64 input to float32 weights
    (BAD_MODULE_CALLS) and float32 input to float64 weights raise the
    modules' TypeError, also nn's ValueError; a float32 hx with float64
    input, and float64 input under autocast to float32 weights, raise
    nn's own error, as torch's recurrence runs them."""
    for dtype, other in ((torch.float64, torch.float32), (torch.float32, torch.float64)):
        ref, ours = make_pair("gru", 2, 3)
        ref.to(other), ours.to(other)
        with pytest.raises(ValueError, match="does not match weight dtype"):
            ref(torch.randn(4, 1, 2, dtype=dtype))
        with pytest.raises(TypeError, match=f"^input: expected {other} like the weights") as raised:
            ours(torch.randn(4, 1, 2, dtype=dtype))
        assert isinstance(raised.value, ValueError)
    ref, ours = make_pair("tanh", 2, 3)
    for module in (ref.double(), ours.double()):
        with pytest.raises(RuntimeError, match="same dtype"):
            module(torch.randn(4, 1, 2, dtype=torch.float64), torch.randn(1, 1, 3))
    for module in (ref.float(), ours.float()):
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="same dtype"):
            module(torch.randn(4, 1, 2, dtype=torch.float64))


# ---------------------------------------------------------------------------
# convert()
# ---------------------------------------------------------------------------

class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(4, 6, batch_first=True)
        self.gru = nn.GRU(6, 5, num_layers=2)
        self.lstm = nn.LSTM(5, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        y, _ = self.rnn(x)
        y, _ = self.gru(y.transpose(0, 1))
        y, _ = self.lstm(y)
        return self.head(y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layers, bidirectional", [(1, False), (2, True)])
@pytest.mark.parametrize("kind", ["gru", "tanh"])
def test_stateful_parametrizations_advance_as_under_nn(kind, layers, bidirectional, dtype):
    """spectral_norm's power iteration runs at each read of its weight. nn's
    forward reads the weights several times (_update_flat_weights: four
    computations of the first parametrized weight, two of the others), the
    BPPSA modules read each once: their _u and _v drifted from nn's and
    their gradients differed (1.5e-4 relative). Now they read them as nn
    does: the same computations, states and outputs bit for bit, gradients
    within rounding; for an empty batch (torch's own recurrence) and a
    PackedSequence too. float64 (torch's own recurrence, its dtype seen
    without computing a weight): gradients bit for bit too."""
    from torch.nn.utils.parametrizations import spectral_norm
    torch.manual_seed(0)
    names = ["weight_hh_l0", f"weight_ih_l{layers - 1}" + ("_reverse" if bidirectional else "")]
    models, calls = make_pair(kind, 3, 4, num_layers=layers, bidirectional=bidirectional), ([], [])
    for m, called in zip(models, calls):
        m.to(dtype)
        for name in names:
            torch.manual_seed(1)  # the same first u and v for both
            spectral_norm(m, name)
            m.parametrizations[name][0].register_forward_hook(lambda *_, name=name, called=called: called.append(name))
    x = torch.randn(5, 2, 3, dtype=dtype)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 3, dtype=dtype), [5, 3])
    for inputs in (x, torch.randn(5, 0, 3, dtype=dtype), packed, x):
        (out_ref, h_ref), (out, h_n) = (m(inputs) for m in models)
        if isinstance(out, nn.utils.rnn.PackedSequence):
            out_ref, out = out_ref.data, out.data
        torch.testing.assert_close((out, h_n), (out_ref, h_ref), rtol=0, atol=0)
        for y, h in ((out_ref, h_ref), (out, h_n)):
            (y.pow(2).sum() + h.pow(2).sum()).backward()
    assert calls[1] == calls[0] and len(calls[0]) == 4 * (4 + 2)  # four forwards
    for a, b in zip(models[0].buffers(), models[1].buffers(), strict=True):  # each _u and _v
        assert torch.equal(b, a)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert rel_err(b.grad, a.grad) <= (TOL if dtype == torch.float32 else 0.0), name


# (asserted, not filtered: a filter that stops matching the text lets it through unseen)
LSTM_LEFT = r"^reprop\.bppsa\.convert: left 'lstm' \(LSTM\) as it is: LSTM is not supported"


def test_convert_swaps_in_place_and_keeps_training_identical():
    torch.manual_seed(6)
    ref = Tagger()
    ours = Tagger()
    ours.load_state_dict(ref.state_dict())
    hook_calls = []
    ours.gru.register_forward_hook(lambda *a: hook_calls.append(1))
    with pytest.warns(reprop.ReproPWarning, match=LSTM_LEFT):
        changed = bppsa.convert(ours, scan="blelloch")
    assert changed == ["rnn", "gru"]
    assert type(ours.rnn) is bppsa.RNN and type(ours.gru) is bppsa.GRU
    assert type(ours.lstm) is nn.LSTM
    assert isinstance(ours.rnn, nn.RNN) and ours.gru.scan == "blelloch"
    assert ours.state_dict().keys() == ref.state_dict().keys()
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_ours = torch.optim.Adam(ours.parameters(), lr=1e-2)
    for step in range(20):
        x = torch.randn(3, 12, 4)
        for model, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert hook_calls
    for (name, a), b in zip(ref.state_dict().items(), ours.state_dict().values()):
        assert rel_err(b, a) <= 1e-5, name
    with pytest.warns(reprop.ReproPWarning, match=LSTM_LEFT):
        assert bppsa.convert(ours) == []  # nothing left to convert, but the scan asked for is taken
        assert ours.gru.scan == "auto"
        assert bppsa.convert(ours, scan="linear") == [] and ours.gru.scan == "linear"


def _parametrized_rnn_and_gru():
    torch.manual_seed(7)
    model = nn.Sequential(nn.RNN(3, 4), nn.GRU(4, 4, num_layers=2))
    nn.utils.parametrizations.orthogonal(model[0], "weight_hh_l0")
    nn.utils.parametrizations.weight_norm(model[1], "weight_hh_l1")
    nn.utils.parametrizations.weight_norm(model[1], "weight_ih_l0")
    return model


def test_convert_takes_parametrized_modules():
    """parametrize swaps in a subclass (ParametrizedRNN), which convert's
    exact-class lookup skipped without a word. Now converted with its
    parametrizations as they are (originals, state_dict), training as nn's;
    removing the last parametrization leaves the BPPSA class."""
    ref, ours = _parametrized_rnn_and_gru(), _parametrized_rnn_and_gru()
    originals = list(ours.parameters())
    assert bppsa.convert(ours, scan="blelloch") == ["0", "1"]
    assert isinstance(ours[0], bppsa.RNN) and isinstance(ours[1], bppsa.GRU) and ours[1].scan == "blelloch"
    assert list(ours.parameters()) == originals and ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(5, 2, 3)
    for model in (ref, ours):
        (model[1](model[0](x)[0])[0] ** 2).sum().backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert rel_err(b.grad, a.grad) <= TOL, name
    assert bppsa.convert(ours, scan="linear") == [] and ours[0].scan == "linear"
    nn.utils.parametrize.remove_parametrizations(ours[0], "weight_hh_l0")
    assert type(ours[0]) is bppsa.RNN


_RELOADED_CONVERT = """
import importlib, torch
import reprop.bppsa as bppsa
rnn, gru = torch.nn.RNN(3, 4), torch.nn.GRU(3, 4)
bppsa.convert(rnn, scan="blelloch"), bppsa.convert(gru, scan="blelloch")
bppsa = importlib.reload(bppsa)
print(bppsa.convert(torch.nn.Sequential(rnn, gru), scan="linear"), rnn.scan, gru.scan)
"""


def test_convert_takes_modules_converted_before_a_reload():
    """importlib.reload(reprop.bppsa) (IPython's autoreload) makes new BPPSA
    classes: convert() told a module converted before it apart by identity,
    so scan= was silently not applied to it ([] blelloch blelloch)."""
    assert script_output(_RELOADED_CONVERT) == ["[]", "linear", "linear"]


_PLAN_ACROSS_A_RELOAD = """
import importlib, sys, torch
import reprop.bppsa as bppsa
torch.manual_seed(0)
layers = [torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)]
x, g = torch.randn(5, 8), torch.randn(5, 3)
plan = bppsa.ChainPlan(layers, (8,))
before = bppsa.chain_backward(layers, x, g, plan=plan)
if sys.argv[1] == "cleared":  # as IPython's %autoreload: the namespace cleared first
    kept = {k: vars(bppsa)[k] for k in ("__name__", "__loader__")}
    vars(bppsa).clear()
    vars(bppsa).update(kept)
bppsa = importlib.reload(bppsa)
after = bppsa.chain_backward(layers, x, g, plan=plan)
print(len(before) == len(after) == 3 and all(map(torch.equal, before, after)))
"""


@pytest.mark.parametrize("namespace", ["kept", "cleared"], ids=["importlib", "autoreload"])
def test_chain_backward_takes_a_plan_built_before_a_reload(namespace):
    """A ChainPlan built before importlib.reload(reprop.bppsa) (IPython's
    autoreload) is taken by chain_backward after it, with the same results.
    It is no instance of the reloaded class, and was refused: 'plan:
    expected a ChainPlan or None, got reprop.bppsa.ChainPlan'."""
    assert script_output(_PLAN_ACROSS_A_RELOAD, namespace) == ["True"]


class _OwnGRU(bppsa.GRU):
    """A user's subclass of a BPPSA module."""


def test_convert_gives_subclasses_of_bppsa_modules_the_scan_asked_for():
    """convert(model, scan=...) sets the scan of the BPPSA modules already
    there; a subclass of one kept its own ("auto" for convert(scan="linear"),
    whose pick then changed with the thread count) while an exact one took it."""
    model = nn.ModuleDict({"own": _OwnGRU(3, 4), "exact": bppsa.GRU(3, 4), "torch": nn.GRU(3, 4)})
    assert bppsa.convert(model, scan="linear") == ["torch"]
    assert [m.scan for m in model.values()] == ["linear"] * 3
    assert type(model["own"]) is _OwnGRU


def test_convert_warns_for_what_it_leaves():
    """An LSTM (README: not supported) was left silently; now a UserWarning
    names it, parametrized or the model itself too."""
    model = Tagger()
    with pytest.warns(UserWarning, match=r"^reprop.bppsa.convert: left 'lstm' \(LSTM\) as it is: LSTM is not supported"):
        assert bppsa.convert(model) == ["rnn", "gru"]
    lstm = nn.LSTM(3, 4)
    nn.utils.parametrizations.orthogonal(lstm, "weight_hh_l0")
    with pytest.warns(UserWarning, match=r"left the model itself \(ParametrizedLSTM\) as it is"):
        assert bppsa.convert(lstm) == []


def _convert_in_users_helper(model: nn.Module) -> list:
    return bppsa.convert(model)


def test_convert_warning_is_a_reprop_warning_at_the_users_line():
    """convert's warning was a bare UserWarning: a suite run with warnings as
    errors could filter it only by its text. It is a reprop.ReproPWarning
    (still a UserWarning), pointing at the user's call."""
    with pytest.warns(reprop.ReproPWarning, match="LSTM is not supported") as caught:
        _convert_in_users_helper(nn.LSTM(3, 4))
    assert [(w.category, w.filename) for w in caught] == [(reprop.ReproPWarning, __file__)]
    assert issubclass(reprop.ReproPWarning, UserWarning)


def test_convert_under_warnings_as_errors_converts_before_it_warns():
    """Under warnings as errors an LSTM met before a GRU raised its warning
    inside the loop: the GRU stayed nn's and the list of converted modules
    was lost, where in the other order it was converted. Every module is
    converted first; the warnings come after, each message beginning with
    "reprop" (a `-W ignore:reprop` filter needs no import)."""
    model = nn.ModuleDict({"a": nn.LSTM(3, 4), "b": nn.GRU(3, 4)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(reprop.ReproPWarning, match="^reprop.bppsa.convert: left 'a'"):
            bppsa.convert(model)
    assert isinstance(model["b"], bppsa.GRU)


@pytest.mark.parametrize("kind", ["gru", "tanh"])
def test_convert_leaves_a_class_whose_forward_was_replaced(kind, monkeypatch):
    """A library that set its own forward on nn.GRU (or nn.RNN) itself:
    convert swapped in BPPSA's forward, silently dropping what the
    replacement computed (here an output twice torch's). Now the module is
    left as it is with a UserWarning naming it, parametrized or not, and
    whether the replacement is a plain function or a functools.wraps
    wrapper; with torch's forward back, converted as before."""
    import functools
    cls = nn.GRU if kind == "gru" else nn.RNN
    torchs = cls.forward

    def doubled(self, input, hx=None):
        out, h_n = torchs(self, input, hx)
        return 2 * out, h_n

    torch.manual_seed(0)
    model = nn.ModuleList([cls(3, 4), cls(3, 2)])
    nn.utils.parametrizations.orthogonal(model[1], "weight_hh_l0")
    x = torch.randn(5, 2, 3)
    for replacement in (doubled, functools.wraps(torchs)(doubled)):
        monkeypatch.setattr(cls, "forward", replacement)
        want = [m(x) for m in model]
        with pytest.warns(UserWarning) as caught:
            assert bppsa.convert(model) == []
        assert [str(w.message) for w in caught] == [
            f"reprop.bppsa.convert: left {name!r} ({kind_name}) as it is: torch.nn.{cls.__name__}.forward is "
            "not torch's own (it was replaced on the class), and BPPSA's forward would drop what it "
            "computes" for name, kind_name in (("0", cls.__name__), ("1", f"Parametrized{cls.__name__}"))]
        assert caught[0].filename == __file__  # convert's caller
        assert type(model[0]) is cls and isinstance(model[1], cls) and not isinstance(model[1], bppsa.RNN | bppsa.GRU)
        torch.testing.assert_close([m(x) for m in model], want, rtol=0, atol=0)
    monkeypatch.undo()
    assert bppsa.convert(model) == ["0", "1"]


@pytest.mark.parametrize("kind", ["rnn", "gru"])
def test_convert_leaves_a_module_whose_forward_was_set_on_the_instance(kind):
    """A forward set on the instance (accelerate's hooks: one calling the
    forward bound before) is found before the class's: convert reported the
    module converted while torch's recurrence still ran. Now it is left as
    it is with a UserWarning naming it; without it, converted as before."""
    cls = nn.GRU if kind == "gru" else nn.RNN
    torch.manual_seed(0)
    model = nn.Sequential(cls(3, 4))
    torchs = model[0].forward
    model[0].forward = lambda input, hx=None: torchs(input, hx)
    with pytest.warns(UserWarning) as caught:
        assert bppsa.convert(model) == []
    assert [str(w.message) for w in caught] == [
        f"reprop.bppsa.convert: left '0' ({cls.__name__}) as it is: its forward was set on the instance, and "
        "BPPSA's forward would drop what it computes"]
    assert caught[0].filename == __file__  # convert's caller
    assert type(model[0]) is cls
    del model[0].forward
    assert bppsa.convert(model) == ["0"]


def _autocast_nesting() -> int:
    """How many torch.autocast blocks (entered, not yet exited) this thread is in."""
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def _sgd_steps(model, x, steps):
    """`steps` SGD steps of model (an RNN or GRU) on packed x; each step's
    output and gradients, as float64."""
    runs = []
    for _ in range(steps):
        out, h_n = model(x)
        loss = out.data.square().mean() + h_n.sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            torch._foreach_add_(list(model.parameters()), grads, alpha=-0.05)
        runs.append([out.data.detach(), *grads])
    return runs


@pytest.mark.parametrize("phase", ["convert", "forward", "backward"])
@pytest.mark.parametrize("kind", ["tanh", "gru"])
def test_an_interrupt_at_any_line_leaves_the_module_training_as_nn(kind, phase):
    """A KeyboardInterrupt (a notebook's stop button) before any line bppsa.py
    runs in convert(), or in a forward or backward of a converted module
    (bidirectional, a PackedSequence; two layers for the RNN, one for the
    GRU, whose backward runs more lines), leaves a module that
    convert() (run again) and the step run again train as nn's does, to the
    scan's float32 rounding, with grad mode and autocast as they were."""
    torch.manual_seed(0)
    cls = nn.GRU if kind == "gru" else nn.RNN
    ref = cls(3, 4, num_layers=1 if kind == "gru" else 2, bidirectional=True)
    x = nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, 3), torch.tensor([4, 3]))
    want = _sgd_steps(copy.deepcopy(ref), x, 2)
    for k in itertools.count(1):
        model = nn.Sequential(copy.deepcopy(ref))
        if phase != "convert":
            bppsa.convert(model)
        try:
            with LineStop(bppsa.__file__, k):
                if phase == "convert":
                    bppsa.convert(model)
                else:
                    out, h_n = model[0](x)
                    if phase == "backward":
                        torch.autograd.grad(out.data.square().mean() + h_n.sum(), list(model.parameters()))
        except KeyboardInterrupt:
            assert torch.is_grad_enabled() and _autocast_nesting() == 0
        else:
            break
        if phase == "convert":
            bppsa.convert(model)
        assert type(model[0]) is getattr(bppsa, cls.__name__)
        for got, expected in zip(_sgd_steps(model[0], x, 2), want):
            assert max(map(rel_err, got, expected)) < TOL, k
    assert k > {"convert": 10, "forward": 50, "backward": 300}[phase]  # it did stop them midway


def test_an_interrupt_in_a_backward_under_autocast_leaves_autocast_as_it_was():
    """A KeyboardInterrupt at any line of a backward run inside an autocast
    region: the scan's backward left autocast through
    torch.autocast(enabled=False), whose Python __exit__ a stop as that
    block ended skipped, leaving autocast's nesting count at 1 for the
    session. No autocast region then dropped its cast cache again: a
    Linear whose weight an optimizer updated in place computed with its
    stale bfloat16 copy, its output unchanged by training."""
    torch.manual_seed(0)
    rnn, lin = bppsa.GRU(3, 4), nn.Linear(4, 2)
    x = torch.randn(5, 2, 3)
    for k in itertools.count(1):
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, _ = rnn(x)
                loss = lin(out).float().square().sum()
                with LineStop(bppsa.__file__, k):
                    loss.backward()
        except KeyboardInterrupt:
            assert _autocast_nesting() == 0 and not torch.is_autocast_enabled("cpu"), k
        else:
            break
    assert k > 100
    z = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = lin(z)
    with torch.no_grad():
        lin.weight.add_(1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(lin(z), before)  # the updated weight, cast again


def test_autocast_hidden_state_fed_back_as_hx():
    """Under autocast h_n is bf16; fed back as hx with float32 input (truncated
    BPTT), nn.RNN casts both, and so must the BPPSA modules."""
    torch.manual_seed(0)
    for cls in ("RNN", "GRU"):
        ref = getattr(nn, cls)(3, 4)
        ours = getattr(bppsa, cls)(3, 4)
        ours.load_state_dict(ref.state_dict())
        x1, x2 = torch.randn(5, 2, 3), torch.randn(5, 2, 3)
        results = []
        for model in (ref, ours):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, h = model(x1)
                out, h = model(x2, h.detach())
            out.float().sum().backward()
            results.append((out, h, model.weight_hh_l0.grad))
        for a, b in zip(*results):
            assert a.dtype == b.dtype and rel_err(b.float(), a.float()) <= 1e-2, cls



@pytest.mark.parametrize("kind", ["tanh", "gru"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
def test_backward_inside_the_autocast_region(kind, dtype, packed):
    """loss.backward() inside `with torch.autocast(...)` works for nn's
    modules; the scan's backward raised "self and mat2 must have the same
    dtype" (autocast made h0's W_hh product bf16/fp16, which met float32 in
    addmm_). Now it runs outside autocast: the gradients of a backward
    outside the region, bit for bit, and torch's within the README's
    autocast tolerances."""
    ref, ours = make_pair(kind, 3, 4, num_layers=2)
    torch.manual_seed(0)
    data, h0 = torch.randn(5, 3, 3), torch.randn(2, 3, 4)
    lengths = torch.tensor([5, 2, 4])

    def grads(model, inside: bool):
        x, h = data.clone().requires_grad_(), h0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            inp = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False) if packed else x
            out, h_n = model(inp, h)
            out = out.data if packed else out
            loss = (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum() + h_n.float().sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        result = [x.grad, h.grad] + [p.grad for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return result

    inside, outside, want = grads(ours, True), grads(ours, False), grads(ref, True)
    for got, same, expected in zip(inside, outside, want):
        assert torch.equal(got, same)
        assert rel_err(got.float(), expected.float()) <= (1e-2 if dtype == torch.float16 else 6e-2)

# float16 autocast: torch's backward runs its gates in float16, so its
# gradients differ from float32's by float16 rounding (measured below 7e-3
# relative between torch's and BPPSA's, README)
FP16_TOL = 1e-2
FP16_MODELS = [("tanh", {}), ("relu", {}), ("gru", {}), ("gru", {"num_layers": 2}),
               ("tanh", {"bidirectional": True}), ("gru", {"bidirectional": True, "batch_first": True})]


def float16_pair(kind: str, kw: dict, seed: int):
    """A torch module and its BPPSA twin, W_hh scaled by 1 + seed (a larger
    one, larger gradients), input (T = 20) and the output's weights."""
    torch.manual_seed(seed)
    ref, ours = make_pair(kind, 5, 16, **kw)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.startswith("weight_hh"):
                p.mul_(1 + seed)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 20, 5) if kw.get("batch_first") else torch.randn(20, 3, 5)
    return ref, ours, 2 * x, torch.randn(*x.shape[:2], 1)


def float16_autocast_loss(module, x, weight_out):
    """A loss of every step and h_n, a quarter of it: float16_pair's models
    overflow between loss scales 2^11 and 2^16 (the first at 2^12 to 2^15)."""
    with torch.autocast("cpu", dtype=torch.float16):
        out, h_n = module(x)
    return ((out.float() * weight_out).sum() + h_n.float().sum()) / 4


@pytest.mark.parametrize("kind,kw", FP16_MODELS)
def test_float16_autocast_gradients_overflow_where_torch_does(kind, kw):
    """Under float16 autocast torch's backward holds the gate gradients (and
    the state gradient entering them, and the weights' sums) in float16:
    past 65504 they are inf. BPPSA's float32 scan gave finite gradients
    there, so a GradScaler stepped where torch skips. At every loss scale
    the gradients are all finite exactly when torch's are, and then within
    float16 rounding of torch's."""
    finite_seen = set()
    for seed in range(2):
        ref, ours, x, weight_out = float16_pair(kind, kw, seed)
        for e in range(11, 17):
            grads = []
            for model in (ref, ours):
                model.zero_grad()
                (2.0 ** e * float16_autocast_loss(model, x, weight_out)).backward()
                grads.append([p.grad for p in model.parameters()])
            finite = [all(torch.isfinite(g).all() for g in gs) for gs in grads]
            assert finite[1] == finite[0], (seed, e, finite)
            finite_seen.add(finite[0])
            if finite[0]:
                for a, b in zip(*grads):
                    assert rel_err(b, a) <= FP16_TOL, (seed, e, rel_err(b, a))
    assert finite_seen == {True, False}  # the scales cross the overflow


@pytest.mark.parametrize("kind", ["tanh", "gru"])
def test_float16_autocast_grad_scaler_skips_torchs_steps(kind):
    """A GradScaler training loop (the scale doubling every other step, so
    that it overflows again and again) skips the steps torch skips: the
    same scale sequence, and updates within float16 rounding of torch's."""
    ref, ours, x, weight_out = float16_pair(kind, {}, 1)
    start = [p.detach().clone() for p in ref.parameters()]
    scales = []
    for model in (ref, ours):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
        sequence = []
        for _ in range(10):
            opt.zero_grad()
            scaler.scale(float16_autocast_loss(model, x, weight_out)).backward()
            scaler.step(opt)
            scaler.update()
            sequence.append(scaler.get_scale())
        scales.append(sequence)
    assert scales[1] == scales[0]
    assert len(set(scales[0])) > 2 and any(b < a for a, b in zip(scales[0], scales[0][1:]))
    for a, b, p in zip(ref.parameters(), ours.parameters(), start):
        assert rel_err(b - p, a - p) <= FP16_TOL


@pytest.mark.parametrize("kind", ["tanh", "gru"])
def test_bfloat16_autocast_gradients_past_float16s_range_stay_finite(kind):
    """Only float16 autocast rounds the scan's values through float16
    (_autocast_float16): bfloat16 has float32's range, so gradients past
    65504 stay finite there, as torch's do; rounded through float16 they
    were inf."""
    ref, ours, x, weight_out = float16_pair(kind, {}, 0)
    grads = []
    for model in (ref, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, h_n = model(x)
        (2.0 ** 24 * ((out.float() * weight_out).sum() + h_n.float().sum())).backward()
        grads.append([p.grad for p in model.parameters()])
    assert max(g.abs().max().item() for g in grads[0]) > 65504  # past float16's range
    for a, b in zip(*grads):
        assert torch.isfinite(b).all() and rel_err(b, a) <= 6e-2

# ---------------------------------------------------------------------------
# Convergence on the paper's bitstream task (Eq. 8)
# ---------------------------------------------------------------------------

def test_bitstream_dataset():
    gen = torch.Generator().manual_seed(0)
    x, labels = bppsa.bitstream(4000, 200, generator=gen)
    assert x.shape == (200, 4000, 1) and labels.shape == (4000,)
    assert set(x.unique().tolist()) <= {0.0, 1.0} and labels.min() >= 0 and labels.max() <= 9
    rate = x.squeeze(-1).mean(0)
    for c in range(10):
        assert abs(rate[labels == c].mean().item() - (0.05 + 0.1 * c)) < 0.01


class BitstreamRNN(nn.Module):
    def __init__(self, hidden=20):
        super().__init__()
        self.rnn = nn.RNN(1, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[1][-1])


def train_curve(model, steps, seed):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    for _ in range(steps):
        x, y = bppsa.bitstream(16, 100, generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return torch.tensor(curve, dtype=torch.float64)


def test_training_follows_the_same_loss_curve():
    """300 Adam steps on the bitstream task (T = 100, B = 16). This training
    is chaotic: a one-ulp change of the initial weights of nn.RNN itself
    makes its loss curve wander by ~1e-1 from step ~170 on. So BPPSA (whose
    gradients on equal weights match to ~4e-7) must match nn.RNN's curve
    closely before the chaos sets in, and afterwards stay within a few times
    the spread of that ulp-perturbed nn.RNN run."""
    torch.manual_seed(0)
    ref = BitstreamRNN()
    ours, nudged = BitstreamRNN(), BitstreamRNN()
    ours.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for p, q in zip(nudged.parameters(), ref.parameters()):
            p.copy_(torch.nextafter(q, torch.full_like(q, float("inf"))))
    bppsa.convert(ours, scan="blelloch")
    steps = 300
    ref_curve, our_curve, nudged_curve = (train_curve(m, steps, seed=1) for m in (ref, ours, nudged))
    assert ref_curve[-50:].mean() < ref_curve[:50].mean() - 0.1  # it learns
    ours_dev = (our_curve - ref_curve).abs() / ref_curve
    natural_dev = (nudged_curve - ref_curve).abs() / ref_curve
    assert ours_dev[:100].max() <= 1e-5
    assert ours_dev.max() <= max(4 * natural_dev.max().item(), 1e-5)


# ---------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------

def cudnn_fp32():
    """cuDNN in float32: its RNNs and convolutions run in TF32 by default on
    Ampere and later GPUs (torch.backends.cudnn.allow_tf32 is True, and
    torch.backends.cudnn.rnn/conv.fp32_precision 'tf32'), about 1e-3 off
    float32, where the scan and a chain's program compute in float32: a
    comparison within float32 rounding, or of ReLU masks and MaxPool2d
    choices taken from a forward, needs TF32 off."""
    return torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False,
                                      allow_tf32=False)


@pytest.mark.gpu
@pytest.mark.parametrize("gates", [0, 1, 3])
@pytest.mark.parametrize("H", [1, 20, 64, 130])
def test_cuda_scan_equals_cpu(gates, H):
    gen = torch.Generator().manual_seed(H + gates)
    n, B = 77, 3
    c = torch.randn(n, B, H, generator=gen)
    if gates:
        kw = dict(w=torch.randn(gates * H, H, generator=gen) / (gates * H) ** 0.5,
                  u=torch.rand(n, B, H, generator=gen) * 0.5,
                  v=torch.rand(n, B, gates * H, generator=gen))
    else:
        kw = dict(jt=torch.randn(n, B, H, H, generator=gen) / H ** 0.5)
    for L in range(bppsa.max_levels(n) + 1):
        cpu = bppsa.scan(c, levels=L, **kw)
        gpu = bppsa.scan(c.cuda(), levels=L, **{k: t.cuda() for k, t in kw.items()})
        assert rel_err(gpu.cpu(), cpu) <= 1e-5, L


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("H", [20, 130])
def test_cuda_scan_activation_equals_given_v(activation, H):
    """test_scan_activation_equals_given_v's bits on CUDA: relu's
    pre_activation is threshold_backward's select (+0 where y <= 0), as the
    C scan's, not v * g (-0 there for a negative g)."""
    n, B = 77, 3
    w, y, v, c = (t.cuda() for t in activation_case(activation, n, B, H, 1, seed=H))
    for L in range(bppsa.max_levels(n) + 1):
        want = bppsa.scan(c, w=w, v=v, levels=L)
        implied = bppsa.scan(c, w=w, activation=activation, y=y, levels=L)
        d = bppsa.scan(c, w=w, activation=activation, y=y, levels=L, pre_activation=True)
        scaled = bppsa.scan(c, w=w, v=v, levels=L, pre_activation=True)
        assert torch.equal(bits(implied), bits(want)), L
        assert torch.equal(bits(d), bits(pre_activation_reference(activation, v, y, want))), L
        assert torch.equal(bits(scaled), bits(v * want)), L


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 7, 1000])
def test_cuda_gradients_equal_cudnn(kind, T):
    torch.manual_seed(T)
    ref, ours = make_pair(kind, 3, 20, num_layers=2, batch_first=True)
    ref.cuda(), ours.cuda()
    x, w_out = torch.randn(16, T, 3, device="cuda"), torch.randn(16, T, 20, device="cuda")
    # cuDNN's RNNs run in TF32 by default (nn's backward and both forwards),
    # the scan in float32: with TF32 off, cuDNN's float32 math differs from
    # the CPU's by rounding, and the same bound holds
    with cudnn_fp32():
        ref_res = run(ref, x, None, w_out)
        assert_close_lists(run(ours, x, None, w_out), ref_res, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_training_step_never_waits_for_the_gpu(kind):
    """Forward and backward of a layer with Blelloch levels queue their work
    and return: no wait for the GPU (torch's sync debug mode raises at any),
    so the step can overlap the host's next work and be captured in a CUDA
    graph. The finiteness check of the scan's result waited once per layer
    and direction."""
    torch.manual_seed(0)
    _, ours = make_pair(kind, 4, 20, num_layers=2, scan="blelloch")
    ours.cuda()
    x = torch.randn(300, 8, 4, device="cuda", requires_grad=True)
    with _no_host_sync("cuda"):
        out, h = ours(x)
        (out.square().sum() + h.sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())


@pytest.mark.gpu
def test_cuda_hidden_size_past_shared_memory():
    """Past the shared memory of a block no CUDA scan fits: scan="auto" runs
    cuDNN's recurrence, a forced scan is refused at backward."""
    cuda = reprop._native._cuda
    room = cuda.shared_memory_per_block(torch.cuda.current_device())
    H = room // 8 + 4  # the linear scan's two vectors alone pass it
    assert cuda.scan_shared_bytes(H, 0) > room >= cuda.scan_shared_bytes(20, 5)
    torch.manual_seed(4)
    ref, ours = make_pair("tanh", 2, H)
    ref.cuda(), ours.cuda()
    x, w_out = torch.randn(3, 2, 2, device="cuda"), torch.randn(3, 2, H, device="cuda")
    assert_close_lists(run(ours, x, None, w_out), run(ref, x, None, w_out), tol=1e-6)
    ours.scan = "linear"
    with pytest.raises(ValueError, match="shared memory"):
        ours(x)[0].sum().backward()


@pytest.mark.gpu
def test_cuda_runs_on_current_stream():
    ours = bppsa.GRU(3, 20).cuda()
    x = torch.randn(300, 8, 3, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x and the parameters are made on the default stream
    with torch.cuda.stream(s):
        out, _ = ours(x)
        out.sum().backward()
        grads = [p.grad.clone() for p in ours.parameters()]
    s.synchronize()
    ours.zero_grad()
    ours(x)[0].sum().backward()
    for a, p in zip(grads, ours.parameters()):
        assert torch.equal(a, p.grad)


@pytest.mark.gpu
def test_cuda_autocast_float16():
    torch.manual_seed(9)
    ref, ours = make_pair("gru", 4, 16)
    ref.cuda(), ours.cuda()
    x = torch.randn(50, 4, 4, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out_ref, _ = ref(x)
        out_ours, _ = ours(x)
    assert out_ours.dtype == out_ref.dtype
    out_ref.float().sum().backward()
    out_ours.float().sum().backward()
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert a.grad.dtype == torch.float32
        assert rel_err(a.grad, b.grad) <= 2e-2  # float16 forward activations


# ---------------------------------------------------------------------------
# The sparse chain: analytic CSR Jacobians and chain_backward
# ---------------------------------------------------------------------------

def dense_transposed_jacobian(layer, x):
    J = torch.autograd.functional.jacobian(lambda t: layer(t.unsqueeze(0))[0], x)
    return J.reshape(-1, x.numel()).t()


CHAIN_LAYERS = [
    nn.Conv2d(3, 4, 3, padding=1),
    nn.Conv2d(3, 4, 1),
    nn.Conv2d(3, 6, (2, 3), stride=(2, 1), padding=(1, 2), dilation=(2, 1), groups=3),
    nn.Conv2d(3, 2, 5, stride=3, padding=2, bias=False),
    nn.Conv2d(3, 4, 3, padding="same"),
    nn.Conv2d(3, 4, 2, padding="same"),  # odd totals: torch puts the extra padding after
    nn.Conv2d(3, 2, (4, 3), padding="same", dilation=(1, 2)),
    nn.MaxPool2d(2),
    nn.MaxPool2d(3, stride=2, padding=1),
    nn.MaxPool2d(2, ceil_mode=True),
    nn.MaxPool2d((2, 3), stride=1, dilation=(1, 2)),
    nn.ReLU(), nn.GELU(), nn.Tanh(), nn.LeakyReLU(0.2), nn.Softplus(),
]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("layer", CHAIN_LAYERS, ids=lambda m: repr(m))
def test_csr_jacobian_equals_autograd(layer):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 6)
    ours = bppsa.transposed_jacobian(layer, x)
    assert ours.layout == torch.sparse_csr
    assert not ours.requires_grad  # the weights (which require grad) read under no_grad: no graph
    assert torch.equal(ours.to_dense(), dense_transposed_jacobian(layer, x))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_csr_jacobian_linear_and_patterns_are_input_independent():
    lin = nn.Linear(5, 3)
    x = torch.randn(5)
    assert torch.equal(bppsa.transposed_jacobian(lin, x).to_dense(), dense_transposed_jacobian(lin, x))
    pool = nn.MaxPool2d(2)
    torch.manual_seed(3)
    a, b = (bppsa.transposed_jacobian(pool, torch.randn(2, 4, 4)) for _ in range(2))
    assert torch.equal(a.crow_indices(), b.crow_indices()) and torch.equal(a.col_indices(), b.col_indices())
    assert not torch.equal(a.values(), b.values())  # only the values follow the argmax


def small_cnn():
    return [nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 3, 3, stride=2),
            nn.Tanh(), nn.Flatten(), nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4)]


def autograd_layer_input_grads(layers, x, grad_output):
    inputs, h = [], x.detach().requires_grad_()
    for layer in layers:
        if not isinstance(layer, nn.Flatten):
            h.retain_grad()
            inputs.append(h)
        h = layer(h)
    h.backward(grad_output)
    return [t.grad for t in inputs]


@pytest.mark.parametrize("levels", ["auto", "linear", "blelloch", 1, 2])
def test_chain_backward_equals_autograd(levels):
    torch.manual_seed(1)
    layers = small_cnn()
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    ours = bppsa.chain_backward(layers, x, g, levels=levels)
    want = autograd_layer_input_grads(layers, x, g)
    assert len(ours) == len(want) == 8
    for a, b in zip(ours, want):
        assert a.shape == b.shape
        assert rel_err(a, b) <= 1e-5


def test_chain_relu_at_zero_selects_like_autograd():
    """ReLU's Jacobian is autograd's threshold_backward: 0 where its input is
    <= 0, exactly 0 included (the second ReLU's input is 0 wherever the
    first cut), not 1 there."""
    torch.manual_seed(3)
    layers = [nn.Linear(6, 8), nn.ReLU(), nn.ReLU(), nn.Linear(8, 3)]
    x, g = torch.randn(4, 6), torch.randn(4, 3)
    want = autograd_layer_input_grads(layers, x, g)
    assert (want[2] == 0).any() and ((layers[1](layers[0](x)) == 0).sum() > 0)
    for levels in ("linear", "blelloch"):
        for a, b in zip(bppsa.chain_backward(layers, x, g, levels=levels), want):
            assert rel_err(a, b) <= 1e-6, levels


def test_chain_elementwise_jacobian_is_autograds_derivative_times_the_gradient():
    """Found by the differential fuzzer, documented (README): an element-wise
    layer's Jacobian is f'(x) as autograd has it (its backward of ones),
    multiplied into the gradient, where Tanhshrink's own backward, g - g (1 -
    tanh^2 x), cancels near 0: the two differ by 1e-4 and more here, each
    of the order of the other's distance to float64, not a wrong Jacobian."""
    torch.manual_seed(0)
    x, g = torch.randn(2, 40) * 3e-3, torch.randn(2, 40)
    ours = bppsa.chain_backward([nn.Tanhshrink()], x, g)[0]
    xr, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    (derivative,) = torch.autograd.grad(nn.Tanhshrink()(xr), xr, torch.ones_like(x))
    (want,) = torch.autograd.grad(nn.Tanhshrink()(xr), xr, g)
    (exact,) = torch.autograd.grad(nn.Tanhshrink()(x64), x64, g.double())
    assert torch.equal(ours, derivative * g)
    assert rel_err(ours, want) > 1e-4
    assert rel_err(ours, exact) <= 2 * rel_err(want, exact)


def test_chain_gradients_are_contiguous_and_own_their_memory():
    """They were transposed views of the scan's batch-minor buffer (the batch
    the fastest dim), which kept the whole buffer alive; autograd's are
    contiguous tensors of their own."""
    torch.manual_seed(1)
    layers = small_cnn()
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    ours = bppsa.chain_backward(layers, x, g)
    for a, b in zip(ours, autograd_layer_input_grads(layers, x, g)):
        assert a.is_contiguous() and a.stride() == b.stride()
        assert a.untyped_storage().nbytes() == a.numel() * a.element_size()


def test_chain_plan_reuse_equals_fresh_plans():
    """Patterns are planned once; new weights and inputs only change values."""
    torch.manual_seed(2)
    layers = small_cnn()
    plan = bppsa.ChainPlan(layers, (2, 6, 6), levels="blelloch")
    assert plan.info["levels"] == bppsa.max_levels(len(plan.leaves) + 1)
    assert plan.info["products"] > 0 and plan.info["pairs"] > 0
    for step in range(3):
        with torch.no_grad():
            for p in layers[0].parameters():
                p.add_(torch.randn_like(p) * 0.1)
        x, g = torch.randn(2, 2, 6, 6), torch.randn(2, 4)
        reused = bppsa.chain_backward(layers, x, g, plan=plan)
        fresh = bppsa.chain_backward(layers, x, g, levels="blelloch")
        for a, b in zip(reused, fresh):
            assert torch.equal(a, b)


@pytest.mark.parametrize("call", ["ChainPlan", "ChainPlan.backward", "chain_backward",
                                  "chain_backward_plan"])
def test_an_interrupt_at_any_line_of_a_chain_leaves_it_working(call):
    """A KeyboardInterrupt (a notebook's stop button) before any line bppsa.py
    runs in building a ChainPlan (pruned), its backward, or chain_backward
    (with or without a plan) leaves grad mode on and the plan (built again
    where its build was stopped) giving autograd's gradients. Both ran the
    layers and wrote the Jacobians' values under `with torch.no_grad()`:
    a stop as that block ended, before its Python __exit__ ran, left grad
    mode off for the session (the next training step's loss had no graph)."""
    torch.manual_seed(2)
    layers = small_cnn()
    with torch.no_grad():
        layers[6].weight[0, :2] = 0  # (pruned: the pattern leaves them out)
    x, g = torch.randn(2, 2, 6, 6), torch.randn(2, 4)
    want = autograd_layer_input_grads(layers, x, g)
    for k in itertools.count(1):
        plan = None if call == "ChainPlan" else bppsa.ChainPlan(layers, (2, 6, 6), pruned=True)
        try:
            with LineStop(bppsa.__file__, k):
                if call == "ChainPlan":
                    plan = bppsa.ChainPlan(layers, (2, 6, 6), pruned=True)
                elif call == "ChainPlan.backward":
                    plan.backward(plan.forward_inputs(x)[0], g)
                else:
                    bppsa.chain_backward(layers, x, g, plan=plan if call == "chain_backward_plan" else None)
        except KeyboardInterrupt:
            assert torch.is_grad_enabled(), k
        else:
            break
        if call == "ChainPlan" and not isinstance(plan, bppsa.ChainPlan):
            plan = bppsa.ChainPlan(layers, (2, 6, 6), pruned=True)
        for _ in range(2):
            got = plan.backward(plan.forward_inputs(x)[0], g)
            assert all(rel_err(a, b) < TOL for a, b in zip(got, want)), k
    assert k > 300  # it did stop them midway


@pytest.mark.parametrize("change", ["conv dilation", "conv dilation alone", "conv stride", "pool ceil_mode",
                                    "pool stride", "conv weight shape"])
def test_chain_plan_refuses_layers_changed_since_the_plan(change):
    """The plan's patterns and weight placement are those of the layers as
    they were: a setting or a weight shape changed in place since (one that
    keeps every shape the plan checks) is refused, not a wrong gradient."""
    torch.manual_seed(3)
    layers = nn.Sequential(nn.Conv2d(2, 3, (1, 3), padding=(0, 1)), nn.ReLU(),
                           nn.MaxPool2d(2, stride=2), nn.Flatten(), nn.Linear(12, 4))
    x, g = torch.randn(2, 2, 4, 4), torch.randn(2, 4)
    plan = bppsa.ChainPlan(layers, (2, 4, 4))
    inputs, _ = plan.forward_inputs(x)
    conv, pool = layers[0], layers[2]
    if change == "conv dilation":  # same output shape
        conv.dilation, conv.padding = (1, 2), (0, 2)
    elif change == "conv dilation alone":  # the plan's inputs and gradient keep their shapes
        conv.dilation = (1, 2)
    elif change == "conv stride":
        conv.stride = (2, 1)
    elif change == "pool ceil_mode":
        pool.ceil_mode = True
    elif change == "pool stride":
        pool.stride = 1
    else:  # as many weights, another kernel shape than kernel_size says
        conv.weight = nn.Parameter(conv.weight.detach().reshape(3, 2, 3, 1))
    with pytest.raises(ValueError, match="layers\\[0\\]: Conv2d|layers\\[2\\]: MaxPool2d") as info:
        plan.backward(inputs, g)
    assert "build a new ChainPlan" in str(info.value)


@pytest.mark.parametrize("change", ["pool return_indices", "pool return_indices, Linear after",
                                    "conv padding", "linear weight", "conv weight"])
def test_chain_backward_checks_layers_changed_since_the_plan_before_its_forward(change):
    """chain_backward with a plan checks the layers, and the shape of a
    weight read as it lies, before its forward runs them, raising what the
    plan's check says: the old code ran the changed layers first, into
    torch's errors (ones_like or Flatten of MaxPool2d's (output, indices)
    tuple, a conv weight of another kernel shape: mat1 and mat2 shapes) or
    grad_output's shape, an argument never passed."""
    torch.manual_seed(3)
    pool, conv, lin = nn.MaxPool2d(2), nn.Conv2d(2, 2, 3, padding=1), nn.Linear(32, 6)
    layers = {"pool return_indices": [pool],
              "pool return_indices, Linear after": [pool, nn.Flatten(), nn.Linear(8, 3)],
              "conv padding": [conv], "conv weight": [conv],
              "linear weight": [nn.Flatten(), lin, nn.Tanh()]}[change]
    plan = bppsa.ChainPlan(layers, (2, 4, 4))
    if change == "conv padding":
        conv.padding = (0, 0)
        message = r"^layers\[0\]: Conv2d's settings changed since the ChainPlan was built"
    elif change == "conv weight":  # as many weights, another kernel shape
        conv.weight = nn.Parameter(conv.weight.detach().reshape(2, 2, 9, 1))
        message = r"^layers\[0\]: Conv2d's weight has shape \(2, 2, 9, 1\), the ChainPlan"
    elif change == "linear weight":
        lin.weight, lin.bias = nn.Parameter(torch.randn(3, 32)), nn.Parameter(torch.randn(3))
        message = r"^layers\[1\]: Linear's weight has shape \(3, 32\), the ChainPlan"
    else:
        pool.return_indices = True
        message = r"^layers\[0\]: MaxPool2d\(return_indices=True\) is not supported in a chain"
    with pytest.raises(ValueError, match=message):
        bppsa.chain_backward(layers, torch.randn(2, 2, 4, 4), plan=plan)


def test_chain_plan_takes_settings_rewritten_in_an_equivalent_form():
    """An int written where the plan saw a pair (or a pair for an int, an
    empty pooling stride for the kernel size) is the same setting: the
    gradients stay autograd's."""
    torch.manual_seed(3)
    layers = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                           nn.Flatten(), nn.Linear(12, 4))
    x, g = torch.randn(2, 2, 4, 4), torch.randn(2, 4)
    plan = bppsa.ChainPlan(layers, (2, 4, 4))
    conv, pool = layers[0], layers[2]
    conv.padding, conv.stride, conv.kernel_size = 1, [1, 1], 3
    pool.kernel_size, pool.stride = (2, 2), 2
    ours = bppsa.chain_backward(layers, x, g, plan=plan)
    for a, b in zip(ours, autograd_layer_input_grads(layers, x, g)):
        assert rel_err(a, b) <= 1e-6


def test_pruned_chain_drops_zero_weights_and_keeps_gradients():
    """pruned=True leaves the zero weights' entries out of the patterns, so the
    planned products are sparser, and gradients still equal autograd's; a
    pruned weight that becomes non-zero is refused, not silently ignored."""
    torch.manual_seed(4)
    layers = small_cnn()
    with torch.no_grad():
        for layer in (layers[0], layers[3], layers[6], layers[8]):
            w = layer.weight
            w.mul_(w.abs() > w.abs().flatten().quantile(0.7))  # 70% pruned by magnitude
    dense = bppsa.ChainPlan(layers, (2, 6, 6), levels="blelloch")
    pruned = bppsa.ChainPlan(layers, (2, 6, 6), levels="blelloch", pruned=True)
    for a, b in zip(dense.leaves, pruned.leaves):
        if isinstance(a.layer, (nn.Conv2d, nn.Linear)):
            zeros = int((a.layer.weight.reshape(-1)[torch.from_numpy(a.wmap).long()] == 0).sum())
            assert zeros > 0 and b.indices.shape[0] == a.indices.shape[0] - zeros
    assert pruned.info["madds"] < dense.info["madds"]
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    ours = bppsa.chain_backward(layers, x, g, plan=pruned)
    for a, b in zip(ours, autograd_layer_input_grads(layers, x, g)):
        assert rel_err(a, b) <= 1e-5
    kept = layers[3].weight.detach().clone()
    with torch.no_grad():
        layers[3].weight.add_(0.01)
    with pytest.raises(ValueError, match="Conv2d: weights that were zero .* non-zero now"):
        bppsa.chain_backward(layers, x, g, plan=pruned)
    with torch.no_grad():  # the mask applied again, then one pruned weight of the last layer regrown
        layers[3].weight.copy_(kept)
        layers[8].weight.view(-1)[int(pruned.leaves[-1].zero_weights[-1])] = 1e-30
    with pytest.raises(ValueError, match="Linear: weights that were zero .* non-zero now"):
        bppsa.chain_backward(layers, x, g, plan=pruned)


def pruned_small_cnn():
    """small_cnn with half of every weight layer's weights zero."""
    torch.manual_seed(5)
    layers = small_cnn()
    with torch.no_grad():
        for layer in layers:
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                layer.weight.view(-1)[::2] = 0
    return layers


@pytest.mark.parametrize("levels", ["linear", "blelloch"])
def test_pruned_chain_checks_every_weight_layer_and_names_the_first(levels):
    """The plan writes and checks all its weights at once: each layer's
    pruned weights are checked where that layer's weights are (a regrown
    one, tiny or NaN, is refused in every layer), the error names the first
    regrown layer of the chain, a float64 weight is checked in float64
    (1e-300 is 0 in float32, but not zero), and the kept weights, changed,
    reach the scan each in its own place."""
    layers = pruned_small_cnn()
    weighted = [i for i, layer in enumerate(layers) if isinstance(layer, (nn.Conv2d, nn.Linear))]
    plan = bppsa.ChainPlan(layers, (2, 6, 6), levels=levels, pruned=True)
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    inputs, _ = plan.forward_inputs(x)
    for i in weighted:
        flat = layers[i].weight.view(-1)
        last = (flat.numel() - 1) // 2 * 2  # the last pruned weight: the layer's span is not cut short
        for value in (1e-30, float("nan")):
            with torch.no_grad():
                flat[last] = value
            with pytest.raises(ValueError, match=rf"^layers\[{i}\]: {type(layers[i]).__name__}: weights "
                                                 "that were zero"):
                plan.backward(inputs, g)
            with torch.no_grad():
                flat[last] = 0
    with torch.no_grad():
        layers[weighted[-1]].weight.view(-1)[0] = 1.0
        layers[weighted[1]].weight.view(-1)[0] = 1.0
    with pytest.raises(ValueError, match=rf"^layers\[{weighted[1]}\]: "):
        plan.backward(inputs, g)
    with torch.no_grad():
        layers[weighted[-1]].weight.view(-1)[0] = layers[weighted[1]].weight.view(-1)[0] = 0
        for i in weighted:  # the kept weights changed, the pattern kept
            kept = layers[i].weight.view(-1)[1::2]
            kept += torch.randn(kept.numel())
    fresh = bppsa.ChainPlan(layers, (2, 6, 6), levels=levels, pruned=True)
    inputs, _ = plan.forward_inputs(x)
    for a, b in zip(plan.backward(inputs, g), fresh.backward(inputs, g)):
        assert torch.equal(a, b)
    for a, b in zip(plan.backward(inputs, g), autograd_layer_input_grads(layers, x, g)):
        assert rel_err(a, b) <= 1e-5
    last = layers[weighted[-1]]
    last.weight = nn.Parameter(last.weight.detach().double())
    last.weight.data.view(-1)[-2] = 1e-300
    with pytest.raises(ValueError, match=rf"^layers\[{weighted[-1]}\]: Linear: weights that were zero"):
        plan.backward(inputs, g)


class PlannedChain(nn.Module):
    """A model holding its own ChainPlan, as a model copied for an EMA or
    saved in a checkpoint does."""

    def __init__(self, layers, input_shape, **plan_args):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.plan = bppsa.ChainPlan(self.layers, input_shape, **plan_args)

    def input_grads(self, x, g):
        return bppsa.chain_backward(list(self.layers), x, g, plan=self.plan)


@pytest.mark.parametrize("levels", ["auto", "blelloch"])
def test_chain_plan_deepcopy_reads_the_copied_layers(levels):
    """The plan held a C capsule, so deepcopy of it or of a model holding it
    raised TypeError. A deepcopy of the model gets a plan over the copy's
    own layers (deepcopy's memo): the original's weights changed after the
    copy leave the copy's gradients those of the copy; copy.copy plans over
    the same layers."""
    torch.manual_seed(9)
    model = PlannedChain(small_cnn(), (2, 6, 6), levels=levels)
    twin = copy.deepcopy(model)
    assert [layer for layer, _ in twin.plan.steps] == list(twin.layers)
    assert [layer for layer, _ in copy.copy(model.plan).steps] == list(model.layers)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0)
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    for m in (twin, model):
        for a, b in zip(m.input_grads(x, g), autograd_layer_input_grads(list(m.layers), x, g)):
            assert rel_err(a, b) <= 1e-5


def test_chain_plan_pickles_with_its_schedule(tmp_path):
    """torch.save(weights_only=False) round-trips a model holding a plan; the
    copy keeps the levels chosen, not "auto" again: the cost model's choice
    depends on the thread count (64 Tanh of 256: a level with 64 threads,
    none with 1), and the copy's gradients are the original's bits."""
    layers = [nn.Tanh() for _ in range(64)]
    with torch_threads(64):
        model = PlannedChain(layers, (256,))
    with torch_threads(1):
        assert model.plan.info["levels"] == 1 and bppsa.ChainPlan(layers, (256,)).info["levels"] == 0
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded.plan.info["levels"] == 1
    assert [layer for layer, _ in loaded.plan.steps] == list(loaded.layers)
    x, g = torch.randn(3, 256), torch.randn(3, 256)
    for a, b in zip(loaded.input_grads(x, g), model.input_grads(x, g)):
        assert torch.equal(a, b)


def test_chain_plan_copy_keeps_its_pruning_mask():
    """A pruned plan's copy keeps the mask it was built with (the weights
    zero then), not the weights zero at the copy: a regrown weight is
    refused by the copy as by the original, and with the mask applied the
    copy's patterns and gradients are the original's."""
    model = PlannedChain(pruned_small_cnn(), (2, 6, 6), levels="blelloch", pruned=True)
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    with torch.no_grad():
        model.layers[3].weight.view(-1)[0] = 0.5  # pruned: [::2] are zero
    twin = copy.deepcopy(model)
    for m in (model, twin):
        with pytest.raises(ValueError, match=r"^layers\[3\]: Conv2d: weights that were zero"):
            m.input_grads(x, g)
    with torch.no_grad():
        twin.layers[3].weight.view(-1)[0] = model.layers[3].weight.view(-1)[0] = 0
    for a, b in zip(model.plan.leaves, twin.plan.leaves):
        assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
    for a, b in zip(twin.input_grads(x, g), model.input_grads(x, g)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("levels", [2, "blelloch"])
def test_chain_overflowing_products_fall_back_to_linear(levels):
    """Eight Linear layers diag(1e10, 0.5) and a gradient only in the second
    output: autograd's input gradients are finite, the up-sweep's products of
    four layers overflow (1e40), and inf * 0 gave NaN. A result that is not
    finite is redone layer by layer: the linear scan's bits (and autograd's)."""
    layers = [nn.Linear(2, 2, bias=False) for _ in range(8)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.diag(torch.tensor([1e10, 0.5])))
    x, g = torch.randn(3, 2), torch.tensor([[0.0, 1.0]]).repeat(3, 1)
    plan = bppsa.ChainPlan(layers, (2,), levels=levels)
    assert plan.info["levels"] > 1
    ours = bppsa.chain_backward(layers, x, g, plan=plan)
    for a, b, c in zip(ours, bppsa.chain_backward(layers, x, g, levels="linear"),
                       autograd_layer_input_grads(layers, x, g)):
        assert torch.isfinite(a).all() and torch.equal(a, b) and torch.equal(a, c)


def test_chain_overflow_to_inf_alone_falls_back():
    """Six Linear(1, 1) with weights 1e-20, 1e-20, 1, 1e20, 1e20, 1: the
    up-sweep's product of the two 1e20 overflows to inf, with no 0 to turn it
    into NaN, and only the first four layers' gradients are inf; autograd's
    are finite (1e35 at most). Infinities are caught as NaNs are, in every
    layer's gradient: the linear scan's bits (and autograd's)."""
    layers = [nn.Linear(1, 1, bias=False) for _ in range(6)]
    with torch.no_grad():
        for layer, w in zip(layers, (1e-20, 1e-20, 1.0, 1e20, 1e20, 1.0)):
            layer.weight.fill_(w)
    x, g = torch.ones(2, 1), torch.full((2, 1), 1e-5)
    ours = bppsa.chain_backward(layers, x, g, levels="blelloch")
    for a, b, c in zip(ours, bppsa.chain_backward(layers, x, g, levels="linear"),
                       autograd_layer_input_grads(layers, x, g)):
        assert torch.isfinite(a).all() and torch.equal(a, b) and torch.equal(a, c)


def test_chain_non_finite_past_the_first_layer_falls_back():
    """Linear (weights pruned to nothing, bias -1, 1), ReLU, Linear (inf):
    the scan's first gradient is finite (no entries: 0) and only the later
    ones are not; torch's first is 0 * inf = NaN and its ReLU selects 0. The
    check covers every layer's gradient, not the first's alone."""
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1, bias=False)]
    with torch.no_grad():
        layers[0].weight.zero_()
        layers[0].bias.copy_(torch.tensor([-1.0, 1.0]))
        layers[2].weight.fill_(float("inf"))
    x, g = torch.randn(3, 2), torch.ones(3, 1)
    plan = bppsa.ChainPlan(layers, (2,), levels="linear", pruned=True)
    assert plan.leaves[0].indices.size == 0
    for a, b in zip(bppsa.chain_backward(layers, x, g, plan=plan), autograd_layer_input_grads(layers, x, g)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chain_gradients_take_the_inputs_dtype(dtype):
    """Layer inputs of a half dtype (as autocast makes them) give gradients
    of that dtype: the float32 results rounded once, as copying them into
    tensors like the inputs did."""
    torch.manual_seed(8)
    layers = small_cnn()
    plan = bppsa.ChainPlan(layers, (2, 6, 6))
    inputs, out = plan.forward_inputs(torch.randn(3, 2, 6, 6))
    inputs = [x.detach().to(dtype) for x in inputs]
    g = torch.randn(out.shape)
    want = plan.backward([x.float() for x in inputs], g)
    for a, b, x in zip(plan.backward(inputs, g), want, inputs):
        assert a.dtype == dtype and a.is_contiguous() and a.shape == x.shape
        assert torch.equal(a, b.to(dtype))


def test_chain_under_a_meta_default_device():
    """The gradients are allocated where the scan ran, not on torch's default
    device: the C pass that copies them out writes through their pointers."""
    torch.manual_seed(9)
    layers = small_cnn()
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    plan = bppsa.ChainPlan(layers, (2, 6, 6))
    want = bppsa.chain_backward(layers, x, g, plan=plan)
    torch.set_default_device("meta")
    try:
        got = bppsa.chain_backward(layers, x, g, plan=plan)
    finally:
        torch.set_default_device(None)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_chain_under_a_float64_default_dtype():
    """The scan's buffers are float32 whatever torch's default dtype: under
    set_default_dtype(float64) they were float64, which the program read as
    float32 (gradients off by 30% of their scale), and transposed_jacobian's
    values were float64."""
    torch.manual_seed(7)
    layers = small_cnn()
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    h = torch.randn(4, 6, 6)  # the ReLU's input
    want = bppsa.chain_backward(layers, x, g, levels="blelloch")
    want_jt = bppsa.transposed_jacobian(layers[1], h)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = bppsa.chain_backward(layers, x, g, levels="blelloch")
        jt = bppsa.transposed_jacobian(layers[1], h)
    finally:
        torch.set_default_dtype(default)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert jt.dtype == torch.float32 and torch.equal(jt.values(), want_jt.values())


@pytest.mark.parametrize("levels", ["linear", "blelloch"])
@pytest.mark.parametrize("case", ["inf_weight", "inf_gradient"])
def test_chain_non_finite_gradients_select_like_torch(case, levels):
    """torch's ReLU and MaxPool2d backward select: an inf gradient reaches
    only active units and each window's maximum, the rest get 0. The program
    multiplies by their 0/1 Jacobian values (0 * inf = NaN), so a result that
    is not finite is redone by each layer's own torch backward, at any levels:
    autograd's bits, its infs and NaNs included (before: NaN for the 0s)."""
    layers = [nn.Conv2d(1, 2, 1, bias=False), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2, 1)]
    with torch.no_grad():
        layers[0].weight.copy_(torch.tensor([1.0, -1.0]).view(2, 1, 1, 1))
    x, g = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]]).repeat(2, 1, 1, 1), torch.ones(2, 1)
    if case == "inf_weight":
        with torch.no_grad():
            layers[4].weight.fill_(float("inf"))
    else:
        g[1] = float("-inf")
    ours = bppsa.chain_backward(layers, x, g, levels=levels)
    want = autograd_layer_input_grads(layers, x, g)
    assert not want[0].isfinite().all() and (want[0] == 0).any()  # infs beside torch's zeros
    for a, b in zip(ours, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_max_pairs_cap_drops_a_whole_level():
    """A cap that a level passes after its first product drops that level,
    whose products were already planned (this crashed when d >= 1); the
    levels below stay, and gradients equal autograd's."""
    torch.manual_seed(5)
    channels = [1] * 5 + [4] * 5 + [1] * 7
    layers = [nn.Conv2d(channels[i], channels[i + 1], 3, padding=1) for i in range(16)]
    full = bppsa.ChainPlan(layers, (1, 8, 8), levels=2)
    capped = bppsa.ChainPlan(layers, (1, 8, 8), levels=2, max_pairs=400000)
    assert full.info["levels"] == 2 and capped.info["levels"] == 1
    assert 0 < capped.info["products"] < full.info["products"]
    x, g = torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8)
    for a, b in zip(bppsa.chain_backward(layers, x, g, plan=capped),
                    autograd_layer_input_grads(layers, x, g)):
        assert rel_err(a, b) <= 1e-5


def test_chain_shared_products_run_once_for_the_batch():
    """Conv2d and Linear values are their weights as they are, one set for
    the batch (no gather, no per-sample copy), and a product of two of them
    lives in the shared buffer, computed once; gradients still equal
    autograd's, for one sample and several."""
    torch.manual_seed(6)
    layers = [nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(),
              nn.Conv2d(3, 2, 3, stride=2), nn.Conv2d(2, 2, 1), nn.Flatten(), nn.Linear(8, 6), nn.Linear(6, 3)]
    plan = bppsa.ChainPlan(layers, (2, 6, 6), levels="blelloch")
    weights = sum(leaf.layer.weight.numel() for leaf in plan.leaves if leaf.shared)
    assert plan.info["shared_floats"] > 1 + weights  # the 1, the weights as they are, shared products
    for B in (1, 5):
        x, g = torch.randn(B, 2, 6, 6), torch.randn(B, 3)
        for a, b in zip(bppsa.chain_backward(layers, x, g, plan=plan),
                        autograd_layer_input_grads(layers, x, g)):
            assert rel_err(a, b) <= 1e-5, B


def test_chain_auto_levels_are_the_cheapest():
    """levels="auto" stops planning at the first level that cannot win; its
    choice must still be the cheapest of every levels the cost model sees."""
    layers = small_cnn()
    auto = bppsa.ChainPlan(layers, (2, 6, 6))
    costs = [bppsa.ChainPlan(layers, (2, 6, 6), levels=L).info["cost"]
             for L in range(bppsa.max_levels(len(auto.leaves) + 1) + 1)]
    assert auto.info["cost"] == min(costs)
    assert auto.info["levels"] == costs.index(min(costs))


def test_chain_plan_linear_is_the_linear_scan_where_auto_picks_levels():
    """levels="linear" is no level at all, whatever the cost model would
    pick: 64 Tanh of 256 with 16 threads, where "auto" picks one level, and
    its gradients are autograd's."""
    layers = [nn.Tanh() for _ in range(64)]
    with torch_threads(16):
        auto, linear = (bppsa.ChainPlan(layers, (256,), levels=levels) for levels in ("auto", "linear"))
    assert auto.info["levels"] == 1 and linear.info["levels"] == 0 and linear.info["products"] == 0
    x, g = torch.randn(2, 256), torch.randn(2, 256)
    for a, b in zip(linear.backward(linear.forward_inputs(x)[0], g), autograd_layer_input_grads(layers, x, g)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("levels", [1, "blelloch"])
def test_chain_products_of_overlapping_patterns_equal_autograd(levels):
    """Up-sweep products whose rows reach one column through several inner
    indices (Conv2d after Conv2d, Linear after Linear), the symbolic
    product's merge of repeated columns, against autograd."""
    torch.manual_seed(4)
    layers = [nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1), nn.Conv2d(2, 2, 2),
              nn.Flatten(), nn.Linear(18, 7), nn.Linear(7, 5), nn.Linear(5, 3)]
    x, g = torch.randn(2, 2, 4, 4), torch.randn(2, 3)
    plan = bppsa.ChainPlan(layers, (2, 4, 4), levels=levels)
    assert plan.info["products"] > 0
    for a, b in zip(bppsa.chain_backward(layers, x, g, plan=plan), autograd_layer_input_grads(layers, x, g)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("levels", ["linear", 1, "blelloch"])
def test_cuda_chain_equals_cpu_bitwise(levels):
    """The GPU runs the plan's program row for row in the CPU's order of
    float32 operations: the same bits."""
    torch.manual_seed(7)
    layers = small_cnn()
    layers[4] = nn.ReLU()  # Tanh's derivative may round differently on the GPU
    plan = bppsa.ChainPlan(layers, (2, 6, 6), levels=levels)
    x, g = torch.randn(4, 2, 6, 6), torch.randn(4, 4)
    cpu = bppsa.chain_backward(layers, x, g, plan=plan)
    for layer in layers:
        layer.cuda()
    with cudnn_fp32():  # a TF32 forward could flip a ReLU mask or MaxPool2d choice
        gpu = bppsa.chain_backward(layers, x.cuda(), g.cuda(), plan=plan)
    for a, b in zip(gpu, cpu):
        assert a.is_cuda and torch.equal(a.cpu(), b)


# ---- the cuSPARSE peer (ChainPlan(product="cusparse")) ----

def run_peer_schedule(plan, sched, inputs, grad_output):
    """The peer's steps (_C.csr_schedule) evaluated in float64 with dense
    per-sample matrices: what the cuSPARSE calls compute, step for step
    (kernels/scan.cu)."""
    n, B, width = len(plan.leaves), grad_output.shape[0], sched["width"]
    mats = []
    for k in range(1, n + 1):  # matrix k - 1: slot k's leaf, layer n - k
        leaf = plan.leaves[n - k]
        dense = torch.zeros(B, leaf.rows, leaf.cols, dtype=torch.float64)
        rows = torch.from_numpy(np.repeat(np.arange(leaf.rows), np.diff(leaf.indptr)))
        weight = leaf.layer.weight if leaf.shared else None
        dense[:, rows, torch.from_numpy(leaf.indices).long()] = leaf.entry_values(inputs[n - k], weight).double()
        mats.append(dense)
    products = sched["products"].tolist()
    mats += [None] * len(products)
    vec = torch.zeros(sched["vectors"], B, width, dtype=torch.float64)
    vec[0, :, :plan.leaves[-1].cols] = grad_output.reshape(B, -1).double()
    for kind, m, x, y, length in sched["steps"].tolist():
        if kind == _GEMM:
            a, b, rows, cols, shared = products[m - n]
            assert mats[m] is None and mats[a] is not None and mats[b] is not None
            mats[m] = mats[a] @ mats[b]
            assert mats[m].shape[1:] == (rows, cols)
        elif kind == _MV:
            rows, cols = mats[m].shape[1:]
            assert max(rows, cols) <= width and x != y
            vec[y, :, :rows] = (mats[m] @ vec[x, :, :cols, None])[..., 0]
        else:
            assert kind == _COPY and m == -1 and 0 < length <= width
            vec[y, :, :length] = vec[x, :, :length]
    return [vec[n - i + 1, :, :leaf.rows].reshape(inputs[i].shape) for i, leaf in enumerate(plan.leaves)]


@pytest.mark.parametrize("make", [small_cnn, pruned_small_cnn])
def test_peer_schedule_computes_the_plans_scan(make):
    """The steps the cuSPARSE peer runs (the plan's own schedule, from the
    traversal that emits its program: _C.csr_schedule), at every level
    count, give autograd's gradients, with one GEMM step per product of the
    plan and each product shared exactly when both its operands are."""
    layers = make()
    pruned = make is pruned_small_cnn
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    want = autograd_layer_input_grads(layers, x, g)
    top = bppsa.max_levels(len([l for l in layers if not isinstance(l, nn.Flatten)]) + 1)
    for levels in range(top + 1):
        plan = bppsa.ChainPlan(layers, (2, 6, 6), levels=levels, pruned=pruned)
        sched = bppsa._C.csr_schedule(plan._plan)
        products, steps = sched["products"], sched["steps"]
        assert products.dtype == steps.dtype == np.int64 and steps.shape[1] == products.shape[1] == 5
        assert plan.info["levels"] == levels and len(products) == plan.info["products"]
        assert list(steps[:, 0]).count(_GEMM) == len(products)
        n = len(plan.leaves)
        shared = [leaf.shared for leaf in reversed(plan.leaves)]  # matrix k - 1: leaves[n - k]
        for a, b, _, _, both in products.tolist():
            shared.append(shared[a] and shared[b])
            assert both == shared[-1]
        assert sched["vectors"] == n + 4
        inputs, _ = plan.forward_inputs(x)
        for got, ref in zip(run_peer_schedule(plan, sched, inputs, g), want):
            assert rel_err(got.float(), ref) <= 1e-5, levels


def test_chain_product_is_checked():
    layers = [nn.Linear(4, 3), nn.ReLU()]
    for bad in ("CUSPARSE", "torch", None, 1):
        with pytest.raises(ValueError, match=r"^product: expected one of \('reprop', 'cusparse'\), got"):
            bppsa.ChainPlan(layers, (4,), product=bad)
    assert bppsa.ChainPlan(layers, (4,)).product == "reprop"


class _BuildInfo:
    """A stand-in for reprop._cuda saying whether cusparse.h was there."""

    def __init__(self, cusparse):
        self.cusparse = cusparse

    def build_info(self):
        return {"archs": "sm_90", "cusparse": self.cusparse}


def test_cusparse_peer_missing_from_the_build_is_named(monkeypatch):
    layers = [nn.Linear(4, 3), nn.ReLU()]
    monkeypatch.setattr(bppsa, "_cuda", None)
    with pytest.raises(RuntimeError, match="^product: 'cusparse' is not available: reprop was built without "
                                           "its CUDA kernels"):
        bppsa.ChainPlan(layers, (4,), product="cusparse")
    monkeypatch.setattr(bppsa, "_cuda", _BuildInfo(False))
    with pytest.raises(RuntimeError, match=r"without cuSPARSE's header, cusparse.h; pip install "
                                           r"nvidia-cusparse \(or set REPROP_CUSPARSE_INCLUDE"):
        bppsa.ChainPlan(layers, (4,), product="cusparse")
    monkeypatch.setattr(bppsa, "_cuda", _BuildInfo(True))
    assert bppsa.ChainPlan(layers, (4,), product="cusparse").product == "cusparse"


def test_cusparse_peer_refuses_cpu_tensors(monkeypatch):
    monkeypatch.setattr(bppsa, "_cuda", _BuildInfo(True))
    layers = small_cnn()
    plan = bppsa.ChainPlan(layers, (2, 6, 6), product="cusparse")
    x, g = torch.randn(2, 2, 6, 6), torch.randn(2, 4)
    for call in (lambda: bppsa.chain_backward(layers, x, g, plan=plan),
                 lambda: plan.backward(plan.forward_inputs(x)[0], g),
                 lambda: bppsa.chain_backward(layers, x[:0], g[:0], plan=plan)):
        with pytest.raises(ValueError, match="^grad_output: product='cusparse' runs on CUDA tensors only, "
                                             "got cpu; use product='reprop' there"):
            call()
    assert not plan._peers


def test_cusparse_peer_tables_pass_the_chains_checks(monkeypatch):
    """The matrix and step tables _CusparsePeer hands to cusparse_create pass
    the chain's checks (kernels/scan.cu: operands before products, every
    product computed before it is read, vectors and lengths in range), which
    run before the library is loaded or a device is touched: without a GPU
    the call gets as far as loading cuSPARSE or finding no driver. A table
    broken on purpose is refused by those checks, naming the row."""
    if bppsa._cusparse_missing() is not None or torch.cuda.is_available():
        pytest.skip("needs reprop's CUDA kernels built with cusparse.h, and no GPU")
    import contextlib
    import types
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=0))
    for make, levels in [(small_cnn, "linear"), (small_cnn, 1), (pruned_small_cnn, "blelloch")]:
        plan = bppsa.ChainPlan(make(), (2, 6, 6), levels=levels, pruned=make is pruned_small_cnn,
                               product="cusparse")
        with pytest.raises(RuntimeError, match="cuSPARSE: cannot load|CUDA error in the cuSPARSE peer"):
            bppsa._CusparsePeer(plan, 3, torch.device("cpu"))
    sched = plan._peer_schedule
    nmats = len(plan.leaves) + len(sched["products"])
    steps = sched["steps"].copy()
    steps[0, 1] = nmats  # no such matrix
    mats = np.ones((nmats, 10), dtype=np.int64)
    mats[:, 3] = -1
    with pytest.raises(ValueError, match="^cuSPARSE peer: step 0 is not a valid GEMM, MV or COPY"):
        bppsa._cuda.cusparse_create("", mats, steps, 1 << 20, 3, sched["vectors"], 16, 0)
    with pytest.raises(ValueError, match=r"^mats: expected a C-contiguous int64 array of shape \(n, 10\)"):
        bppsa._cuda.cusparse_create("", mats[:, :9], steps, 1 << 20, 3, 8, 16, 0)


def cusparse_or_skip():
    reason = bppsa._cusparse_missing()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [small_cnn, pruned_small_cnn])
@pytest.mark.parametrize("levels", ["linear", 1, "blelloch"])
@pytest.mark.parametrize("B", [1, 3])
def test_cuda_cusparse_peer_equals_ours_and_autograd(make, levels, B):
    """The peer's products and mat-vecs (cuSPARSE's own order of sums) give
    the gradients of our program and of autograd within fp32 rounding, on
    the first backward (which plans cuSPARSE's products) and on later ones
    with new values (which only compute)."""
    cusparse_or_skip()
    layers = [layer.cuda() for layer in make()]
    pruned = make is pruned_small_cnn
    ours = bppsa.ChainPlan(layers, (2, 6, 6), levels=levels, pruned=pruned)
    peer = bppsa.ChainPlan(layers, (2, 6, 6), levels=levels, pruned=pruned, product="cusparse")
    assert peer.info == ours.info
    for step in range(3):
        x, g = torch.randn(B, 2, 6, 6, device="cuda"), torch.randn(B, 4, device="cuda")
        with cudnn_fp32():  # autograd's convolution backward in float32, as the programs
            want = autograd_layer_input_grads(layers, x, g)
            got = bppsa.chain_backward(layers, x, g, plan=peer)
            by_ours = bppsa.chain_backward(layers, x, g, plan=ours)
        for a, b, w in zip(got, by_ours, want):
            assert a.is_cuda and a.is_contiguous() and a.shape == w.shape
            assert rel_err(a, b) <= 1e-5 and rel_err(a, w) <= 1e-5, step
        with torch.no_grad():  # new weights, the pruned ones still zero
            for layer in layers:
                if isinstance(layer, (nn.Conv2d, nn.Linear)):
                    layer.weight.mul_(1.25)
    assert list(peer._peers) == [(B, torch.device("cuda", torch.cuda.current_device()))]


@pytest.mark.gpu
def test_cuda_cusparse_peer_runs_on_the_current_stream():
    cusparse_or_skip()
    torch.manual_seed(8)
    layers = [layer.cuda() for layer in small_cnn()]
    plan = bppsa.ChainPlan(layers, (2, 6, 6), levels="blelloch", product="cusparse")
    x, g = torch.randn(3, 2, 6, 6, device="cuda"), torch.randn(3, 4, device="cuda")
    want = bppsa.chain_backward(layers, x, g, plan=plan)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = bppsa.chain_backward(layers, x, g, plan=plan)
    side.synchronize()
    for a, b in zip(got, want):  # a stream mix-up would read stale or unwritten values
        assert rel_err(a, b) <= 1e-6


@pytest.mark.gpu
def test_cuda_cusparse_peer_refuses_regrown_pruned_weights():
    cusparse_or_skip()
    layers = [layer.cuda() for layer in pruned_small_cnn()]
    plan = bppsa.ChainPlan(layers, (2, 6, 6), pruned=True, product="cusparse")
    x, g = torch.randn(2, 2, 6, 6, device="cuda"), torch.randn(2, 4, device="cuda")
    bppsa.chain_backward(layers, x, g, plan=plan)
    with torch.no_grad():
        layers[0].weight.add_(0.01)
    with pytest.raises(ValueError, match="Conv2d: weights that were zero .* non-zero now"):
        bppsa.chain_backward(layers, x, g, plan=plan)


def test_chain_refuses_a_layer_class_whose_forward_was_replaced(monkeypatch):
    """nn.Linear.forward replaced on the class: the chain used torch's
    Linear Jacobian, silently skipping what the replacement computes."""
    layers = [nn.Linear(4, 3), nn.Tanh()]
    plan = bppsa.ChainPlan(layers, (4,))
    linear = torch.nn.functional.linear
    monkeypatch.setattr(nn.Linear, "forward",
                        lambda self, input: 2.0 * linear(input, self.weight, self.bias))
    for call in (lambda: bppsa.ChainPlan(layers, (4,)),
                 lambda: bppsa.chain_backward(layers, torch.randn(2, 4)),
                 lambda: bppsa.chain_backward(layers, torch.randn(2, 4), plan=plan)):
        with pytest.raises(TypeError, match=r"^layers\[0\]: torch.nn.Linear.forward is not "
                                            "torch's own"):
            call()


def test_chain_refuses_a_layer_whose_forward_was_set_on_the_instance():
    """A forward set on the instance (as accelerate's hooks set one) runs in
    the chain's forward, but the chain's Jacobians are torch's layer's: the
    gradients were silently those of the layer without it (0.15 off)."""
    layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]
    plan = bppsa.ChainPlan(layers, (4,))
    torchs = layers[0].forward
    layers[0].forward = lambda x: 2 * torchs(x)
    for call in (lambda: bppsa.ChainPlan(layers, (4,)),
                 lambda: bppsa.chain_backward(layers, torch.randn(3, 4)),
                 lambda: bppsa.chain_backward(layers, torch.randn(3, 4), plan=plan),
                 lambda: bppsa.transposed_jacobian(layers[0], torch.randn(4))):
        with pytest.raises(TypeError, match=r"^layers?(\[0\])?: its forward was set on the instance; "
                                            "the chain's Jacobians are those of torch's layer"):
            call()


def test_chain_rejects_bad_layers_and_shapes():
    with pytest.raises(TypeError, match=r"layers\[1\]: BatchNorm2d is not supported"):
        bppsa.ChainPlan([nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)], (1, 5, 5))
    with pytest.raises(ValueError, match="padding_mode"):
        bppsa.ChainPlan([nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect")], (1, 5, 5))
    with pytest.raises(ValueError, match=r"layers\[1\]: only Flatten\(start_dim=1, end_dim=-1\) .*start_dim=2"):
        bppsa.ChainPlan([nn.Conv2d(4, 4, 1), nn.Flatten(2), nn.Linear(16, 2)], (4, 4, 4))
    for bad in (-1, True, 2 ** 31):
        with pytest.raises(ValueError, match="^max_pairs: expected an int"):
            bppsa.ChainPlan([nn.Linear(4, 2)], (4,), max_pairs=bad)
    with pytest.raises(ValueError, match="^levels: expected an int >= 0, got -1"):
        bppsa.ChainPlan([nn.Linear(4, 2)], (4,), levels=-1)
    # float64 came back float32-accurate: refused
    chain = [nn.Linear(4, 3).double(), nn.Tanh()]
    with pytest.raises(TypeError, match="^x: chain Jacobians are float32; got float64"):
        bppsa.chain_backward(chain, torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="^x: chain Jacobians are float32; got float64"):
        bppsa.transposed_jacobian(nn.Tanh(), torch.randn(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"Linear: expected an input of shape \(4,\)"):
        bppsa.ChainPlan([nn.Linear(4, 2)], (5,))
    plan = bppsa.ChainPlan([nn.Linear(4, 2)], (4,))
    with pytest.raises(ValueError, match=r"grad_output: expected shape \(1, 2\)"):
        plan.backward([torch.randn(1, 4)], torch.randn(1, 3))
    with pytest.raises(ValueError, match=r"grad_output: expected shape \(1, 2\)"):
        plan.backward([torch.randn(1, 4)], torch.randn(2, 2))
    with pytest.raises(ValueError, match=r"grad_output: expected shape \(2, 2\)"):
        plan.backward([torch.randn(2, 4)], torch.randn(4))  # flattened: named by the batch of inputs
    with pytest.raises(ValueError, match=r"inputs\[0\]: expected shape \(2, 4\)"):
        plan.backward([torch.randn(2, 2, 2)], torch.randn(2, 2))
    with pytest.raises(TypeError, match="grad_output: expected a real floating-point"):
        plan.backward([torch.randn(1, 4)], torch.randn(1, 2, dtype=torch.complex64))
    with pytest.raises(RuntimeError, match="grad_output: sparse tensors are not supported"):
        plan.backward([torch.randn(1, 4)], torch.randn(1, 2).to_sparse())
    own = [layer for layer, _ in plan.steps]
    with pytest.raises(ValueError, match="grad_output: expected 3 samples like x"):
        bppsa.chain_backward(own, torch.randn(3, 4), torch.randn(2, 2), plan=plan)
    with pytest.raises(ValueError, match=r"x: expected samples of shape \(4,\)"):
        bppsa.chain_backward(own, torch.randn(3, 5), plan=plan)
    with pytest.raises(ValueError, match="x: expected a CPU or CUDA tensor, got device meta"):
        bppsa.chain_backward(own, torch.randn(3, 4, device="meta"), plan=plan)
    with pytest.raises(ValueError, match="layers: not the layers `plan` was built for"):
        bppsa.chain_backward([nn.Linear(4, 2)], torch.randn(3, 4), plan=plan)
    # levels with a plan were ignored, a bad value too: the plan's levels apply
    for levels, match in (("bogus", "^levels: expected one of"), (-3, "^levels: expected an int"),
                          ("blelloch", "^levels: a plan scans with the levels it was built with")):
        with pytest.raises(ValueError, match=match):
            bppsa.chain_backward(own, torch.randn(3, 4), plan=plan, levels=levels)
    # the plan's layers and more, or none: not its chain either (the extra
    # layer was left out of the gradients without a word)
    for layers in (own + [nn.ReLU()], []):
        with pytest.raises(ValueError, match="layers: not the layers `plan` was built for"):
            bppsa.chain_backward(layers, torch.randn(3, 4), plan=plan)
    # an empty batch has empty gradients
    (gx,) = bppsa.chain_backward(own, torch.randn(0, 4), torch.randn(0, 2), plan=plan)
    assert gx.shape == (0, 4)
    # same number of elements, another shape: autograd refuses it, so must we
    conv = nn.Conv2d(3, 2, 3)
    with pytest.raises(ValueError, match=r"grad_output: expected shape \(4, 2, 7, 7\)"):
        bppsa.chain_backward([conv], torch.randn(4, 3, 9, 9), torch.randn(4, 7, 7, 2))
    with pytest.raises(ValueError, match=r"Conv2d: expected an input of shape \(3, H, W\)"):
        bppsa.chain_backward([conv], torch.randn(4, 5, 9, 9))
    with pytest.raises(ValueError, match=r"Conv2d: expected an input of shape \(3, H, W\)"):
        bppsa.ChainPlan([conv], (3, 9))
    with pytest.raises(ValueError, match=r"MaxPool2d: expected an input of shape \(C, H, W\)"):
        bppsa.ChainPlan([nn.MaxPool2d(2)], (9, 9))


def test_argument_errors_name_the_argument():
    """A plan that is not a ChainPlan raised AttributeError, a float or bare
    int input_shape Python's own TypeError from the layers' geometry, and a
    numpy bool for pre_activation "expected a bool, got bool"."""
    layers = [nn.Linear(4, 2)]
    with pytest.raises(TypeError, match="^plan: expected a ChainPlan or None, got str"):
        bppsa.chain_backward(layers, torch.randn(2, 4), plan="x")
    for kind in (nn.Linear(4, 2), nn.ReLU()):
        for bad in ((4.0,), 4, "4", (4, None)):
            with pytest.raises(TypeError, match=r"^input_shape: expected one sample's shape, a sequence of ints"):
                bppsa.ChainPlan([kind], bad)
    with pytest.raises(ValueError, match=r"^input_shape: expected an int in \[1, 2147483647\], got 0"):
        bppsa.ChainPlan([nn.ReLU()], (0,))
    with pytest.raises(ValueError, match=r"^x: expected a batch \(B, \.\.\.\) of non-empty samples"):
        bppsa.chain_backward([nn.ReLU()], torch.randn(2, 0))
    plan = bppsa.ChainPlan([nn.Flatten(), nn.Linear(12, 2)], [np.int64(3), 4])  # numpy ints as torch takes them
    assert plan.input_shape == (3, 4) and all(type(d) is int for d in plan.input_shape)
    c, w, v = torch.randn(6, 2, 3), torch.randn(3, 3), torch.rand(6, 2, 3)
    with pytest.raises(TypeError, match="^pre_activation: expected True or False, got 'True'$"):
        bppsa.scan(c, w=w, v=v, pre_activation="True")


def test_chain_plan_pruned_takes_a_bool_only():
    """pruned="False" (or 1) was taken by its truth: the string turned
    pruning on. Now a TypeError naming pruned, as every flag of reprop
    raises (_tensors.check_flag); True and False as before, and NumPy's
    bools as those, as the other flags and torch's module flags take them
    (a numpy.bool was refused here alone)."""
    layer = nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight[0, 0] = 0
    for bad in ("False", 1, None):
        with pytest.raises(TypeError, match=f"^pruned: expected True or False, got {bad!r}$"):
            bppsa.ChainPlan([layer], (3,), pruned=bad)
    for off, on in ((False, True), (np.bool_(False), np.bool_(True))):
        assert bppsa.ChainPlan([layer], (3,), pruned=off).leaves[0].zero_weights is None
        assert bppsa.ChainPlan([layer], (3,), pruned=on).leaves[0].zero_weights.tolist() == [0]


@pytest.mark.parametrize("call", ["fad.enabled(compose=)", "fuse(keep_grads=)", "ooo.simulate(sub_stream=)",
                                  "scan(pre_activation=)"])
def test_every_flag_refuses_a_non_bool_alike(call):
    """One library, one answer: fad, fusion and ooo refused a flag such as
    "no" with a ValueError while bppsa raised TypeError for it. Now each
    raises _tensors.NotAFlagError, a TypeError (as torch raises for a wrong
    type) that is still a ValueError for callers that caught one."""
    from reprop import fad, fuse, ooo
    c, w, v = torch.randn(6, 2, 3), torch.randn(3, 3), torch.rand(6, 2, 3)
    model = nn.Linear(3, 2)
    calls = {"fad.enabled(compose=)": (lambda: fad.enabled(compose="no"), "compose"),
             "fuse(keep_grads=)": (lambda: fuse(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                 keep_grads="no"), "keep_grads"),
             "ooo.simulate(sub_stream=)": (lambda: ooo.simulate(2, sub_stream="no"), "sub_stream"),
             "scan(pre_activation=)": (lambda: bppsa.scan(c, w=w, v=v, pre_activation="no"),
                                       "pre_activation")}
    run, name = calls[call]
    with pytest.raises(TypeError, match=f"^{name}: expected True or False, got 'no'$") as caught:
        run()
    assert isinstance(caught.value, ValueError)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_chain_arguments_named_for_an_empty_sample_and_iterable_inputs():
    """transposed_jacobian of an empty sample raised the C core's 'diagonal:
    size must be >= 1', naming an internal: now x's shape is checked first,
    as a plan's input_shape is. ChainPlan.backward given its inputs as a
    generator raised "object of type 'generator' has no len()": it takes
    any iterable, as autograd.grad takes its inputs, and names `inputs`
    when it is none."""
    for layer, x in ((nn.Tanh(), torch.randn(0)), (nn.Linear(3, 2), torch.randn(0)),
                     (nn.Conv2d(1, 1, 1), torch.randn(1, 0, 2))):
        with pytest.raises(ValueError, match=r"^x\.shape: expected an int in \[1, 2147483647\], got 0"):
            bppsa.transposed_jacobian(layer, x)
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)]
    plan, x = bppsa.ChainPlan(layers, (3,)), torch.randn(5, 3)
    inputs, out = plan.forward_inputs(x)
    g = torch.randn_like(out)
    want = plan.backward(inputs, g)
    for got in (plan.backward((t for t in inputs), g), plan.backward(tuple(inputs), g)):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(TypeError, match="^inputs: expected a sequence of tensors, got NoneType"):
        plan.backward(None, g)


class _StandardizedConv2d(nn.Conv2d):
    """A Conv2d whose forward standardizes its weight (timm's StdConv2d)."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / w.std((1, 2, 3), keepdim=True)
        return nn.functional.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


def test_chain_refuses_subclasses_and_hooks():
    """A subclass may override forward (weight standardization, torch's QAT
    fake-quantizing layers), a forward hook or pre-hook may change the
    output or input, a backward hook the gradients: the chain's Jacobians
    would be the plain layer's, silently wrong, so all are refused."""
    x = torch.randn(2, 2, 5, 5)
    with pytest.raises(TypeError, match=r"layers\[0\]: .*_StandardizedConv2d \(a subclass of nn.Conv2d\) "
                                        r"is not supported"):
        bppsa.chain_backward([_StandardizedConv2d(2, 3, 3)], x)
    qat = torch.ao.nn.qat.Linear(4, 3, qconfig=torch.ao.quantization.get_default_qat_qconfig("x86"))
    with pytest.raises(TypeError, match=r"layers\[1\]: torch\.ao\..*Linear \(a subclass of nn.Linear\)"):
        bppsa.ChainPlan([nn.ReLU(), qat], (4,))
    with pytest.raises(TypeError, match=r"^layer: .*_StandardizedConv2d \(a subclass of nn.Conv2d\)"):
        bppsa.transposed_jacobian(_StandardizedConv2d(2, 3, 3), x[0])
    hooked = [nn.Linear(4, 3) for _ in range(3)]
    hooked[0].register_forward_hook(lambda module, args, out: out * 3)
    hooked[1].register_forward_pre_hook(lambda module, args: (args[0] * 3,))
    hooked[2].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    for layer, what in zip(hooked, ["forward hooks", "forward hooks or pre-hooks", "backward hooks"]):
        with pytest.raises(ValueError, match=rf"layers\[1\]: Linear has {what}"):
            bppsa.chain_backward([nn.Tanh(), layer], torch.randn(2, 4))
    lin = nn.Linear(4, 3)
    plan = bppsa.ChainPlan([lin], (4,))
    lin.register_forward_hook(lambda module, args, out: out * 3)  # after the plan was built
    with pytest.raises(ValueError, match=r"layers\[0\]: Linear has forward hooks"):
        bppsa.chain_backward([lin], torch.randn(2, 4), plan=plan)


@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_chain_takes_layers_under_optimizer_fusion(mode):
    """reprop.fuse's module hooks only apply pending updates to the weights:
    a fused model's layers give the same chain gradients (the hook check
    refused them)."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(27, 4))
    x = torch.randn(2, 2, 5, 5)
    want = bppsa.chain_backward(list(layers), x)
    handle = reprop.fuse(layers, reprop.optim.SGD(layers.parameters(), lr=0.1), mode=mode)
    for got, w in zip(bppsa.chain_backward(list(layers), x), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    handle.remove()


@pytest.mark.filterwarnings("ignore:.*weight_norm. is deprecated")
@pytest.mark.parametrize("reparametrize", ["prune", "weight_norm", "spectral_norm", "parametrizations"])
def test_chain_takes_weight_reparametrizations(reparametrize):
    """torch's own weight reparametrizations only change the weight the layer
    reads, which is what the chain's Jacobians read too: the pre-hooks of
    pruning, the hook-based weight_norm and spectral_norm, and the subclass
    torch.nn.utils.parametrize swaps in."""
    torch.manual_seed(9)
    layers = small_cnn()
    for i in (0, 6):
        if reparametrize == "prune":
            prune.l1_unstructured(layers[i], "weight", 0.5)
        elif reparametrize == "weight_norm":
            nn.utils.weight_norm(layers[i])
        elif reparametrize == "spectral_norm":
            nn.utils.spectral_norm(layers[i]).eval()  # eval: no power iteration in forward
        else:
            nn.utils.parametrizations.weight_norm(layers[i])
    if reparametrize == "parametrizations":
        nn.utils.parametrizations.orthogonal(layers[8])
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    for a, b in zip(bppsa.chain_backward(layers, x, g, levels="blelloch"),
                    autograd_layer_input_grads(layers, x, g)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("pool", [nn.MaxPool2d((2,)), nn.MaxPool2d(2, stride=(2,)), nn.MaxPool2d(2, stride=[]),
                                  nn.MaxPool2d(3, stride=1, padding=(1,)), nn.MaxPool2d(2, dilation=(2,)),
                                  nn.MaxPool2d([2, 3], stride=[1], padding=[1, 0])], ids=repr)
def test_chain_pool_arguments_expand_like_torch(pool):
    """One int in a tuple stands for both dimensions and an empty stride is
    the kernel size, as in torch's max_pool2d."""
    torch.manual_seed(10)
    layers = [nn.Conv2d(2, 2, 3, padding=1), nn.ReLU(), pool]
    x = torch.randn(2, 2, 7, 6)
    g = torch.randn_like(torch.nn.Sequential(*layers)(x))
    for a, b in zip(bppsa.chain_backward(layers, x, g), autograd_layer_input_grads(layers, x, g)):
        assert rel_err(a, b) <= 1e-5
    assert torch.equal(bppsa.transposed_jacobian(pool, x[0]).to_dense(), dense_transposed_jacobian(pool, x[0]))


def test_chain_layer_errors_name_the_layer():
    x = torch.randn(2, 2, 6, 6)
    for mode in ("reflect", "circular", "replicate"):
        with pytest.raises(ValueError, match=rf"layers\[1\]: Conv2d padding_mode='{mode}' is not supported"):
            bppsa.chain_backward([nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1, padding_mode=mode)], x)
    with pytest.raises(ValueError, match=r"layers\[0\]\.stride: expected an int or a sequence of 1 or 2 ints"):
        bppsa.ChainPlan([nn.MaxPool2d(2, stride=(1, 1, 1))], (2, 6, 6))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("kernel, dilation", [(2, 1), (4, 1), (2, 2), (4, 2), ((2, 3), 1), ((2, 3), (1, 2)),
                                              ((4, 1), (3, 2))])
def test_chain_takes_same_padding_with_an_odd_total(kernel, dilation):
    """padding='same' whose total d (k - 1) is odd on an axis: torch pads
    half before and the extra one after, and the output keeps the input's
    size; it was refused. The plan checks the setting as it does any other."""
    torch.manual_seed(12)
    conv = nn.Conv2d(2, 3, kernel, padding="same", dilation=dilation)
    layers = [conv, nn.ReLU(), nn.Conv2d(3, 2, 2, padding="same"), nn.MaxPool2d(2), nn.Flatten(),
              nn.Linear(2 * 3 * 3, 4)]
    x, g = torch.randn(2, 2, 7, 6), torch.randn(2, 4)
    assert torch.equal(bppsa.transposed_jacobian(conv, x[0]).to_dense(), dense_transposed_jacobian(conv, x[0]))
    plan = bppsa.ChainPlan(layers, (2, 7, 6))
    want = autograd_layer_input_grads(layers, x, g)
    for ours in (bppsa.chain_backward(layers, x, g), bppsa.chain_backward(layers, x, g, plan=plan)):
        for a, b in zip(ours, want, strict=True):
            assert a.shape == b.shape and rel_err(a, b) <= 1e-6
    conv.dilation = tuple(d + 1 for d in conv.dilation)  # still 'same' and the same shapes
    with pytest.raises(ValueError, match=r"layers\[0\]: Conv2d's settings changed since the ChainPlan"):
        bppsa.chain_backward(layers, x, g, plan=plan)


@pytest.mark.parametrize("act", [nn.ReLU(inplace=True), nn.ELU(inplace=True), nn.LeakyReLU(0.1, inplace=True),
                                 nn.Hardtanh(inplace=True), nn.SiLU(inplace=True), nn.Hardswish(inplace=True)],
                         ids=lambda m: type(m).__name__)
def test_chain_inplace_activations(act):
    """An in-place activation must not overwrite the input its Jacobian is
    taken at (nor fail on autograd's leaf check)."""
    torch.manual_seed(8)
    layers = [nn.Conv2d(2, 3, 3), act, nn.Conv2d(3, 2, 3)]
    x, g = torch.randn(3, 2, 7, 7), torch.randn(3, 2, 3, 3)
    kept = x.clone()
    ours = bppsa.chain_backward(layers, x, g)
    twin = copy.deepcopy(act)  # the reference keeps each layer's input: not in place
    twin.inplace = False
    for a, b in zip(ours, autograd_layer_input_grads([layers[0], twin, layers[2]], x, g)):
        assert rel_err(a, b) <= 1e-5
    assert torch.equal(x, kept)
    y = torch.randn(6)
    want = torch.autograd.functional.jacobian(lambda t: act(t.clone()), y).T
    assert torch.equal(bppsa.transposed_jacobian(act, y).to_dense(), want)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_chain_backward_under_inference_mode():
    """Element-wise layers' f'(x) is taken by autograd, which records nothing
    in inference mode and refuses its tensors: it runs outside the mode, so
    chain_backward, transposed_jacobian and a plan's backward there (or on
    inputs made there) give the bits they give under no_grad (before: 'element
    0 of tensors does not require grad')."""
    torch.manual_seed(9)
    layers = small_cnn() + [nn.SiLU(inplace=True)]
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    plan = bppsa.ChainPlan(layers, (2, 6, 6))
    with torch.no_grad():
        want = bppsa.chain_backward(layers, x, g, plan=plan)
        want_jacobian = bppsa.transposed_jacobian(layers[4], x[0]).to_dense()
    with torch.inference_mode():
        got = bppsa.chain_backward(layers, x, g, plan=plan)
        got_jacobian = bppsa.transposed_jacobian(layers[4], x[0]).to_dense()
        inputs, _ = plan.forward_inputs(x)
    got_outside = plan.backward(inputs, g)
    assert all(torch.equal(a, b) and torch.equal(c, b) for a, b, c in zip(got, want, got_outside))
    assert torch.equal(got_jacobian, want_jacobian)


class _ChainModule(nn.Module):
    """chain_backward (or with build_only, the ChainPlan it builds) inside a
    module's forward, as functional_call runs it."""

    def __init__(self, layers, build_only=False):
        super().__init__()
        self.layers, self.build_only = nn.ModuleList(layers), build_only

    def forward(self, x):
        if self.build_only:
            return bppsa.ChainPlan(self.layers, x.shape[1:])
        return bppsa.chain_backward(self.layers, x)[0]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_chain_refuses_what_only_torch_carries():
    """The chain reads raw memory and records no graph: torch.func transforms'
    tensors and forward-AD duals (inputs or weights swapped in by
    functional_call) get an error naming them (before: 'Cannot access data
    pointer', 'Batching rule not implemented', or a silently dropped tangent).
    The error names the call made, to make outside the transform (before:
    chain_backward for ChainPlan, its backward and transposed_jacobian too)."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(10)
    layers = small_cnn()
    x, g = torch.randn(3, 2, 6, 6), torch.randn(3, 4)
    refused = "a tensor of a torch.func transform .*Call chain_backward outside the transform"
    with pytest.raises(RuntimeError, match="x: " + refused):
        torch.func.vmap(lambda xi, gi: bppsa.chain_backward(layers, xi[None], gi[None])[0])(x, g)
    with pytest.raises(RuntimeError, match="x: " + refused):
        torch.func.grad(lambda x: bppsa.chain_backward(layers, x, g)[0].sum())(x)
    with pytest.raises(RuntimeError, match="x: " + refused.replace("chain_backward", "transposed_jacobian")):
        torch.func.vmap(lambda xi: bppsa.transposed_jacobian(nn.Tanh(), xi).values())(x)
    plan = bppsa.ChainPlan(layers, (2, 6, 6))
    inputs, _ = plan.forward_inputs(x)
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match="x: " + refused):
            bppsa.chain_backward(layers, fwAD.make_dual(x, torch.ones_like(x)))
        with pytest.raises(RuntimeError, match=r"inputs\[1\]: " + refused.replace("chain_backward",
                                                                                "ChainPlan.backward")):
            plan.backward([inputs[0], fwAD.make_dual(inputs[1], inputs[1]), *inputs[2:]], g)
        weights = {name: fwAD.make_dual(p.detach(), torch.ones_like(p))
                   for name, p in _ChainModule(layers).named_parameters()}
        with pytest.raises(RuntimeError, match=r"layers\[0\]\.weight: " + refused):
            torch.func.functional_call(_ChainModule(layers), weights, (x,))
        with pytest.raises(RuntimeError, match=r"layers\[0\]\.weight: " + refused.replace("chain_backward",
                                                                                         "ChainPlan")):
            torch.func.functional_call(_ChainModule(layers, build_only=True), weights, (x,))


def test_nested_tensors_get_torchs_behaviour_or_a_refusal_naming_them():
    """A nested tensor (torch_only) makes RNN/GRU run torch's recurrence,
    which raises torch's own error for it, and the chain refuse it by name
    (before: torch's internal 'NestedTensorImpl doesn't support sizes')."""
    x = torch.nested.nested_tensor([torch.randn(4, 3), torch.randn(2, 3)])
    for kind in ("tanh", "gru"):
        ref, ours = make_pair(kind, 3, 5)
        with pytest.raises(RuntimeError) as theirs:
            ref(x)
        with pytest.raises(RuntimeError, match=f"^{re.escape(str(theirs.value))}$"):
            ours(x)
    with pytest.raises(RuntimeError, match="^x: .*a nested tensor"):
        bppsa.chain_backward([nn.ReLU()], torch.nested.nested_tensor([torch.randn(4), torch.randn(4)]))


def test_chain_refuses_a_parametrized_weight_only_torch_carries():
    """A parametrized weight (no entry in _parameters) computed from an
    original that functional_call swapped in is a dual or a transform's
    tensor: refused by name, as a plain weight is (before: forward AD's
    'not implemented' for _foreach_copy_, or a refusal naming grad_output)."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(10)
    layers = [nn.Tanh(), nn.Linear(4, 3, bias=False)]
    nn.utils.parametrize.register_parametrization(layers[1], "weight", _Doubled())
    model, x = _ChainModule(layers), torch.randn(2, 4)
    key = "layers.1.parametrizations.weight.original"
    original = model.get_parameter(key).detach()
    refused = r"layers\[1\]\.weight: a tensor of a torch.func transform"
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match=refused):
            torch.func.functional_call(model, {key: fwAD.make_dual(original, torch.ones_like(original))}, (x,))
    with pytest.raises(RuntimeError, match=refused):
        torch.func.grad(lambda w: torch.func.functional_call(model, {key: w}, (x,)).sum())(original)
    for a, b in zip(bppsa.chain_backward(layers, x), autograd_layer_input_grads(layers, x, torch.ones(2, 3))):
        assert rel_err(a, b) <= 1e-6


def test_negative_bit_operands_and_gradients_match_resolved_ones():
    """A lazily negated view (is_neg) holds -t in memory, which the scan read
    as t: scan operands and RNN/GRU output gradients gave other numbers than
    the same values materialized; an out of that kind is refused."""
    torch.manual_seed(0)
    T, B, H = 4, 2, 3
    c, w, v = torch.randn(T, B, H), torch.randn(H, H), torch.rand(T, B, H)
    want = bppsa.scan(c, w=w, v=v)
    for got in (bppsa.scan((-c)._neg_view(), w=w, v=v),
                bppsa.scan(c, w=(-w)._neg_view(), v=v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(bppsa.scan(c, w=w, v=(-v)._neg_view()), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="out: a lazily negated view"):
        bppsa.scan(c, w=w, v=v, out=torch.zeros(T, B, H)._neg_view())
    for cls in (bppsa.RNN, bppsa.GRU):
        layer = cls(3, 4)
        x = torch.randn(5, 2, 3, requires_grad=True)
        out, h = layer(x)
        g_out, g_h = torch.randn_like(out), torch.randn_like(h)
        (got,) = torch.autograd.grad((out, h), x, ((-g_out)._neg_view(), (-g_h)._neg_view()),
                                     retain_graph=True)
        (want_x,) = torch.autograd.grad((out, h), x, (g_out, g_h))
        torch.testing.assert_close(got, want_x, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Mutation-testing survivors (see the commit message): each test below fails
# on one mutant of bppsa.py that the rest of this file let pass.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tanh", "gru"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_unsorted_packed_sequences_with_h0_match_torch(kind, bidirectional):
    """An unsorted PackedSequence (enforce_sorted=False) with an h0: h0 is in
    the caller's batch order, which torch permutes into the sorted order
    (and h_n back): each sample must start from its own h0. Kills dropping
    the sorted_indices permutation of hx in _forward_packed."""
    torch.manual_seed(8)
    ref, ours = make_pair(kind, 3, 5, num_layers=2, bidirectional=bidirectional)
    x = torch.randn(9, 5, 3)
    h0 = torch.randn(2 * (1 + bidirectional), 5, 5)
    (ref_res, ref_out), (our_res, our_out) = (run_packed(m, x, [7, 3, 9, 1, 5], h0, False)
                                              for m in (ref, ours))
    assert torch.equal(our_out.sorted_indices, ref_out.sorted_indices)
    assert_close_lists(our_res, ref_res)


def test_packed_padding_right_after_the_last_step_that_overflows_is_masked():
    """The first padded step of a short sequence (t = its length) must be
    zeroed like the later ones: there a ReLU recurrence from a large last
    state overflows to inf, which a longer sequence's next step would meet
    as inf * 0 = NaN in W_hh's gradient; torch never computes that step.
    Kills `steps > lengths` for the padding mask in _layers."""
    ref, ours = make_pair("relu", 1, 1)
    with torch.no_grad():
        for m in (ref, ours):
            m.weight_ih_l0.fill_(1.0)
            m.weight_hh_l0.fill_(2.0)
            m.bias_ih_l0.zero_()
            m.bias_hh_l0.zero_()
    x = torch.full((3, 2, 1), 0.5)
    x[0, 1] = 3e38  # sample 1 (one step) ends at 3e38; its padded step 1 would be 6e38 = inf
    ref_res, _ = run_packed(ref, x, [3, 1], None, True)
    our_res, _ = run_packed(ours, x, [3, 1], None, True)
    assert all(torch.isfinite(g).all() for g in ref_res[2:])
    assert all(torch.isfinite(g).all() for g in our_res[2:])
    assert_close_lists(our_res, ref_res)


def _spectral_chain():
    from torch.nn.utils.parametrizations import spectral_norm
    torch.manual_seed(0)
    return nn.Sequential(spectral_norm(nn.Conv2d(2, 3, 3, padding=1)), nn.ReLU(), nn.Flatten(),
                         spectral_norm(nn.Linear(48, 5)))


@pytest.mark.parametrize("how", ["no plan", "plan", "forward_inputs"])
def test_chain_reads_a_parametrized_weight_once_per_step(how):
    """spectral_norm (parametrizations, training mode) runs a power iteration
    at each read of the weight: the chain's backward uses the weight its
    forward read, and the state advances once per step, as in torch."""
    layers = _spectral_chain()
    plan = bppsa.ChainPlan(layers, (2, 4, 4)) if how != "no plan" else None
    ref = copy.deepcopy(layers)  # after the plan, whose build reads each weight once
    u = lambda m: [m[i].parametrizations.weight[0]._u for i in (0, 3)]
    for _ in range(3):
        x, g = torch.randn(2, 2, 4, 4), torch.randn(2, 5)
        xr = x.clone().requires_grad_()
        ref(xr).backward(g)
        if how == "forward_inputs":
            inputs, _ = plan.forward_inputs(x)
            got = plan.backward(inputs, g)[0]
        else:
            got = bppsa.chain_backward(list(layers), x, g, plan=plan)[0]
        assert rel_err(got, xr.grad) <= 1e-6
        assert all(torch.equal(a, b) for a, b in zip(u(layers), u(ref)))


@pytest.mark.parametrize("with_plan", [False, True])
def test_chain_torch_backward_uses_the_forwards_parametrized_weights(with_plan):
    """Where the chain runs each layer's own torch backward (here always: a
    MaxPool2d window lies in the padding; else where the scan's result is
    not finite), it takes the weights its forward read: read again, a
    spectral_norm weight ran another power iteration, a gradient of another
    weight than the forward's and the state a step ahead of torch's."""
    from torch.nn.utils.parametrizations import spectral_norm
    torch.manual_seed(0)
    layers = nn.Sequential(spectral_norm(nn.Conv2d(1, 2, 1)), nn.ReLU(),
                           nn.MaxPool2d(2, stride=3, padding=1, dilation=2), nn.Flatten(),
                           spectral_norm(nn.Linear(4, 3)))
    plan = bppsa.ChainPlan(layers, (1, 5, 1)) if with_plan else None
    ref = copy.deepcopy(layers)
    u = lambda m: [m[i].parametrizations.weight[0]._u for i in (0, 4)]
    for _ in range(2):
        x, g = torch.randn(2, 1, 5, 1), torch.randn(2, 3)
        xr = x.clone().requires_grad_()
        ref(xr).backward(g)
        got = bppsa.chain_backward(list(layers), x, g, plan=plan)[0]
        assert rel_err(got, xr.grad) <= 1e-6
        assert all(torch.equal(a, b) for a, b in zip(u(layers), u(ref)))


@pytest.mark.parametrize("register", ["register_module_forward_pre_hook", "register_module_forward_hook",
                                      "register_module_full_backward_pre_hook",
                                      "register_module_full_backward_hook"])
def test_chain_refuses_global_module_hooks(register, monkeypatch):
    """torch's global module hooks run at the chain's layers' calls (a forward
    hook may change their output, a backward hook is never called by the
    scan): refused as a layer's own, naming the hook's kind; without them the
    chain is autograd's again."""
    # a full backward hook marks the global hooks as full for the session
    monkeypatch.setattr(nn.modules.module, "_global_is_full_backward_hook", None)
    torch.manual_seed(0)
    layers = [nn.Linear(4, 3), nn.ReLU()]
    x, g = torch.randn(2, 4), torch.randn(2, 3)
    plan = bppsa.ChainPlan(layers, (4,))
    handle = getattr(nn.modules.module, register)(lambda *args: None)
    try:
        for call in (lambda: bppsa.ChainPlan(layers, (4,)), lambda: bppsa.chain_backward(layers, x, g),
                     lambda: bppsa.chain_backward(layers, x, g, plan=plan)):
            with pytest.raises(ValueError, match=f"^layers: a global module .*{register}"):
                call()
        with pytest.raises(ValueError, match=f"^layer: a global module .*{register}"):
            bppsa.transposed_jacobian(layers[0], x[0])
    finally:
        handle.remove()
    got = bppsa.chain_backward(layers, x, g, plan=plan)[0]
    assert rel_err(got, autograd_layer_input_grads(nn.Sequential(*layers), x, g)[0]) <= 1e-6


class _CountingScale(nn.Module):
    """A stateful parametrization: the weight times the number of reads in
    training mode (as spectral_norm's state advances at each read)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("reads", torch.zeros(()))

    def forward(self, w):
        if self.training:
            self.reads += 1
        return w * self.reads.clone()


@pytest.mark.parametrize("kind", ["parametrization", "hook_spectral_norm"])
def test_chain_backward_of_an_earlier_forward_uses_its_weights(kind):
    """Two forward_inputs, then the backward of the first's inputs: only the
    last forward's weights were kept, so the first's backward read the
    weight again (another weight, one more read of the state), or, with the
    hook-based nn.utils.spectral_norm, whose weight its pre-hook sets, took
    the second forward's (0.16 off autograd). Each forward's are kept while
    its inputs live, as autograd's graph keeps them."""
    def make():
        torch.manual_seed(0)
        first = nn.Linear(8, 6)
        if kind == "parametrization":
            nn.utils.parametrize.register_parametrization(first, "weight", _CountingScale())
        else:
            first = nn.utils.spectral_norm(first)
        return [first, nn.Tanh(), nn.Linear(6, 4)]

    def run(layers, x):
        for layer in layers:
            x = layer(x)
        return x

    torch.manual_seed(1)
    x1, x2, g = torch.randn(3, 8) * 3, torch.randn(3, 8), torch.randn(3, 4)
    layers, ref = make(), make()
    plan = bppsa.ChainPlan(layers, (8,))
    if kind == "parametrization":
        _ = ref[0].weight  # the plan's build read it once
    with torch.no_grad():
        first, _ = plan.forward_inputs(x1)
        plan.forward_inputs(x2)
    got = plan.backward(first, g)[0]
    xr = x1.clone().requires_grad_()
    out = run(ref, xr)
    run(ref, x2)
    out.backward(g)
    assert rel_err(got, xr.grad) <= 1e-6
    if kind == "parametrization":
        assert layers[0].parametrizations.weight[0].reads.item() == ref[0].parametrizations.weight[0].reads.item()


class _PauseOnce(nn.Module):
    """An identity parametrization that pauses the read of the weight in
    `thread` (once) until `release` is set, having set `inside`."""

    def __init__(self):
        super().__init__()
        self.thread, self.inside, self.release = None, threading.Event(), threading.Event()

    def forward(self, w):
        if threading.current_thread() is self.thread:
            self.thread = None
            self.inside.set()
            self.release.wait(timeout=60)
        return w


def test_chain_forward_leaves_another_threads_parametrized_weights_alone():
    """The chain ran its forward under torch's parametrize.cached(), whose
    cache is process-wide: a plain training step of the same model in
    another thread meanwhile took the chain's weights, computed under
    no_grad, and gave the originals no gradient (or backward raised on a
    graph already freed). The chain's thread is held inside its forward
    while the main thread trains."""
    from torch.nn.utils.parametrizations import orthogonal

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(orthogonal(nn.Linear(16, 16)), nn.Tanh(), nn.Linear(16, 8))
        nn.utils.parametrize.register_parametrization(model[2], "weight", _PauseOnce())
        return model

    model, ref = make(), make()
    plan = bppsa.ChainPlan(list(model), (16,))
    xa, xb = torch.randn(4, 16), torch.randn(4, 16)
    got = []
    chain = threading.Thread(target=lambda: got.append(bppsa.chain_backward(list(model), xa, plan=plan)))
    pause = model[2].parametrizations.weight[0]
    pause.thread = chain
    chain.start()
    try:
        assert pause.inside.wait(timeout=60)
        model(xb).sum().backward()
    finally:
        pause.release.set()
        chain.join(timeout=60)
    assert not chain.is_alive() and got
    ref(xb).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
    for a, b in zip(got[0], autograd_layer_input_grads(ref, xa, torch.ones(4, 8))):
        assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("how", ["no plan", "plan"])
def test_chain_reads_a_parametrized_layer_used_twice_at_each_use(how):
    """A parametrized layer used twice in a chain: torch's forward reads
    (computes) its weight at each use; under parametrize.cached() the chain
    read it once, so with a stateful parametrization the second use took
    the first's weight (0.2 to 0.33 off autograd) and the state advanced once less."""
    def make():
        torch.manual_seed(0)
        layer = nn.Linear(5, 5)
        nn.utils.parametrize.register_parametrization(layer, "weight", _CountingScale())
        return [layer, nn.Tanh(), layer]

    layers, ref = make(), make()
    plan = bppsa.ChainPlan(layers, (5,)) if how == "plan" else None
    if how == "plan":
        _ = ref[0].weight, ref[2].weight  # the plan's build read it at each use
    x, g = torch.randn(3, 5), torch.randn(3, 5)
    got = bppsa.chain_backward(layers, x, g, plan=plan)
    for a, b in zip(got, autograd_layer_input_grads(ref, x, g)):
        assert rel_err(a, b) <= 1e-6
    assert layers[0].parametrizations.weight[0].reads.item() == ref[0].parametrizations.weight[0].reads.item()


def test_chain_takes_torch_module_trackers_global_hooks():
    """FlopCounterMode (torch's ModuleTracker) registers global forward hooks
    that only record which module runs: refused since the global hooks were,
    where the chain ran before with autograd's gradients."""
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils.module_tracker import ModuleTracker

    torch.manual_seed(0)
    layers = [nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)]
    x, g = torch.randn(2, 4), torch.randn(2, 2)
    plan = bppsa.ChainPlan(layers, (4,))
    want = bppsa.chain_backward(layers, x, g, plan=plan)[0]
    with FlopCounterMode(display=False):
        assert torch.equal(bppsa.chain_backward(layers, x, g, plan=plan)[0], want)
    with ModuleTracker():
        assert torch.equal(bppsa.chain_backward(layers, x, g)[0], want)


def test_scans_have_a_profiler_range():
    """The C scans read raw pointers, which no aten op shows: in
    torch.profiler an RNN's scan was the self time of its backward node, and
    a chain's scan, called outside autograd, had no row at all. Each now
    shows as a range of its own (entered only while a profiler runs)."""
    torch.manual_seed(0)
    rnn, x = bppsa.RNN(3, 4), torch.randn(5, 2, 3)
    layers = [nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)]
    plan = bppsa.ChainPlan(layers, (4,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rnn(x)[0].sum().backward()
        bppsa.chain_backward(layers, torch.randn(2, 4), torch.randn(2, 2), plan=plan)
    names = [e.name for e in prof.events()]
    assert names.count("reprop.bppsa.scan") == 1 and names.count("reprop.bppsa.ChainPlan.scan") == 1


def test_chain_pool_window_in_the_padding_is_torch_backward():
    """MaxPool2d(2, stride=3, padding=1, dilation=2) over W = 1: both W taps
    of every window are padding. torch outputs -inf there and sends the
    gradient to an input outside the window; the chain runs torch's own
    backward for such a plan (transposed_jacobian has no pattern for it)."""
    torch.manual_seed(0)
    pool = nn.MaxPool2d(2, stride=3, padding=1, dilation=2)
    layers = nn.Sequential(nn.Conv2d(1, 2, 1), nn.ReLU(), pool, nn.Flatten(), nn.Linear(4, 3))
    x, g = torch.randn(2, 1, 5, 1), torch.randn(2, 3)
    for plan in (None, bppsa.ChainPlan(layers, (1, 5, 1), levels="blelloch")):
        got = bppsa.chain_backward(list(layers), x, g, plan=plan)
        for a, b in zip(got, autograd_layer_input_grads(layers, x, g)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="^layer: MaxPool2d has a window lying entirely in the padding"):
        bppsa.transposed_jacobian(pool, torch.randn(2, 5, 1))


@pytest.mark.parametrize("pool, shape, index", [
    (nn.MaxPool2d(2, stride=1, padding=1, dilation=3), (1, 2, 2), 6),  # its one window: start (2, 2)
    # rows in the plane, columns all padding: the last row's window records 2 * 2 + 2
    (nn.MaxPool2d((1, 2), stride=1, padding=(0, 1), dilation=(1, 3)), (3, 3, 2), 6),
], ids=["both axes", "columns"])
def test_chain_refuses_pool_whose_padding_window_index_leaves_the_plane(pool, shape, index):
    """A MaxPool2d window lying entirely in the padding for which torch's
    max_pool2d records an index past the input plane (its start, start_h * W
    + start_w): torch's own CPU backward writes that window's gradient
    outside the input (heap corruption), so the chain's torch backward for
    padding windows cannot take it. Refused when the plan is built, before
    any backward runs, naming the layer; the old code built the plan and
    its chain_backward aborted the process."""
    torch.manual_seed(0)
    x = torch.randn(2, *shape)
    _, idx = nn.functional.max_pool2d(x, pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                                      return_indices=True)
    assert idx.max().item() == index  # the index the error reports: torch's own
    message = rf"^layers\[1\]: MaxPool2d has a window lying entirely in the padding, for which " \
              rf"torch's max_pool2d records input index {index}, past the {shape[1]}x{shape[2]} input plane"
    layers = [nn.Tanh(), pool]
    with pytest.raises(ValueError, match=message):
        bppsa.ChainPlan(layers, shape)
    with pytest.raises(ValueError, match=message):
        bppsa.chain_backward(layers, x)
    with pytest.raises(ValueError, match="^layer: MaxPool2d has a window lying entirely in the padding"):
        bppsa.transposed_jacobian(pool, x[0])


@pytest.mark.parametrize("layers, shape, error, message", [
    ([nn.Conv2d(1, 1, 5)], (1, 3, 3), ValueError, r"^layers\[0\]: Conv2d: an input of \(H, W\) = \(3, 3\)"),
    ([nn.ReLU(), nn.MaxPool2d(4)], (1, 3, 3), ValueError, r"^layers\[1\]: MaxPool2d: .*Output size is too small"),
    ([nn.MaxPool2d(2, padding=2)], (1, 3, 3), ValueError, r"^layers\[0\]: MaxPool2d: pad should be"),
    ([nn.Flatten()], (3,), ValueError, r"^layers: expected a layer other than Flatten"),
    (None, (3,), TypeError, r"^layers: expected a sequence of modules, got NoneType"),
    (nn.Linear(3, 3), (3,), TypeError, r"^layers: expected a sequence of modules, got torch.nn.modules.linear.Linear"),
])
def test_chain_plan_errors_name_the_argument(layers, shape, error, message):
    """Shapes a layer cannot take and a `layers` that is no chain raise
    naming layers[i] or layers, not the C core's or torch's bare message."""
    with pytest.raises(error, match=message):
        bppsa.ChainPlan(layers, shape)
    with pytest.raises(error, match=message):
        bppsa.chain_backward(layers, torch.randn(2, *shape))


# ---------------------------------------------------------------------------
# Seeded differential fuzzing against torch (a compact version of the fuzzer
# that found test_unbatched_batch_first_output_is_nns_bits_with_a_frozen_input_weight)
# ---------------------------------------------------------------------------

def _fuzz_rnn_config(seed: int) -> dict:
    """A random nn.RNN/nn.GRU configuration and call of the kinds README says
    follow torch; kind, input form and operation cycle with the seed so that
    a few dozen seeds cover every combination of them."""
    rng = random.Random(seed)
    layers = rng.choice([1, 2, 3])
    return dict(
        kind=KINDS[seed % 3], form=("batched", "unbatched", "packed")[seed // 3 % 3],
        op=("train", "retain", "eval_grad", "no_grad", "inference")[seed % 5],
        I=rng.choice([1, 2, rng.randint(1, 12)]), H=rng.choice([1, 2, rng.randint(1, 12)]), L=layers,
        bias=rng.random() < 0.7, batch_first=rng.random() < 0.5, bidirectional=rng.random() < 0.5,
        dropout=rng.choice([0.0, 0.5]) if layers > 1 else 0.0, sorted=rng.random() < 0.5,
        T=rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(40, 150)]), B=rng.randint(1, 5),
        h0=rng.choice(["none", "given", "grad"]), x_grad=rng.random() < 0.7, frozen=rng.random() < 0.3,
        scan=rng.choice(["auto", "linear", "blelloch", rng.randint(1, 3)]),
        loss=rng.choice(["both", "out", "h_n", "sum"]), strided=rng.random() < 0.3,
        state=rng.choice(["nn_to_ours", "ours_to_nn", "convert"]), seed=seed)


def _fuzz_rnn_pair(c: dict) -> tuple[nn.Module, nn.Module]:
    """(nn module, BPPSA module) with the same parameters, by a state_dict
    either way or by convert(); the same parameters frozen in both."""
    args = dict(num_layers=c["L"], bias=c["bias"], batch_first=c["batch_first"],
                bidirectional=c["bidirectional"], dropout=c["dropout"])
    if c["kind"] != "gru":
        args["nonlinearity"] = c["kind"]
    nn_cls, ours_cls = (nn.GRU, bppsa.GRU) if c["kind"] == "gru" else (nn.RNN, bppsa.RNN)
    torch.manual_seed(c["seed"])
    if c["state"] == "convert":
        ref = nn_cls(c["I"], c["H"], **args)
        model = nn.ModuleDict({"rnn": copy.deepcopy(ref)})
        assert bppsa.convert(model, scan=c["scan"]) == ["rnn"]
        ours = model["rnn"]
    else:
        ref, ours = nn_cls(c["I"], c["H"], **args), ours_cls(c["I"], c["H"], scan=c["scan"], **args)
        source, target = (ref, ours) if c["state"] == "nn_to_ours" else (ours, ref)
        target.load_state_dict(source.state_dict())
    assert type(ours) is ours_cls
    if c["frozen"]:
        pick = random.Random(c["seed"])
        for p, q in zip(ref.parameters(), ours.parameters()):
            if pick.random() < 0.5:
                p.requires_grad_(False), q.requires_grad_(False)
    return ref, ours


def _fuzz_rnn_inputs(c: dict, dtype: torch.dtype = torch.float32) -> tuple:
    g = torch.Generator().manual_seed(c["seed"])
    D, T, B = 2 if c["bidirectional"] else 1, c["T"], c["B"]
    unbatched = c["form"] == "unbatched"
    # drawn in float32 and converted: randn draws other values for float64
    x = torch.randn((T, c["I"]) if unbatched else (B, T, c["I"]) if c["batch_first"] else (T, B, c["I"]),
                    generator=g).to(dtype)
    h0 = torch.randn((c["L"] * D, c["H"]) if unbatched else (c["L"] * D, B, c["H"]), generator=g).to(dtype)
    if c["strided"]:  # every other feature of a wider tensor
        x = torch.cat([x, x], -1)[..., ::2]
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    if c["sorted"]:
        lengths = lengths.sort(descending=True).values
    return x, None if c["h0"] == "none" else h0, lengths


def _fuzz_rnn_run(module: nn.Module, c: dict, x, h0, lengths) -> dict:
    """The outputs and every gradient (None where autograd gives None) of
    one call as `c` describes it."""
    graph = c["op"] not in ("no_grad", "inference")
    x = x.detach().requires_grad_(c["x_grad"] and graph)  # (a clone would be contiguous)
    h0 = None if h0 is None else h0.detach().requires_grad_(c["h0"] == "grad" and graph)
    module.train(c["op"] in ("train", "retain"))
    given = x if c["form"] != "packed" else nn.utils.rnn.pack_padded_sequence(
        x, lengths, batch_first=c["batch_first"], enforce_sorted=c["sorted"])
    torch.manual_seed(c["seed"] + 1)  # the dropout masks
    mode = {"no_grad": torch.no_grad, "inference": torch.inference_mode}.get(c["op"], torch.enable_grad)
    with mode():
        out, h_n = module(given, h0)
    out = out.data if c["form"] == "packed" else out
    got = {"out": out.detach().clone(), "h_n": h_n.detach().clone(), "graph": out.requires_grad}
    if out.requires_grad or h_n.requires_grad:
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(c["seed"])).to(out.dtype)
        loss = {"both": lambda: (out * w).sum() + h_n.sin().sum(), "out": lambda: (out * w).sum(),
                "h_n": lambda: h_n.sin().sum(), "sum": lambda: out.sum()}[c["loss"]]()  # sum: an expanded gradient
        for _ in range(2 if c["op"] == "retain" else 1):
            loss.backward(retain_graph=c["op"] == "retain")
        got.update({"x": x.grad, "h0": None if h0 is None else h0.grad},
                   **{name: p.grad for name, p in module.named_parameters()})
    return got


def _fuzz_rnn_check(c: dict) -> None:
    """Outputs nn's bits; gradients nn's within TOL of their scale, or, where
    rounding is amplified (a bias summed to near 0 from large terms, a
    recurrence whose gradients explode), no farther from a float64
    reference than 4 times nn's own distance to it; the same None pattern."""
    ref, ours = _fuzz_rnn_pair(c)
    x, h0, lengths = _fuzz_rnn_inputs(c)
    want, got = _fuzz_rnn_run(ref, c, x, h0, lengths), _fuzz_rnn_run(ours, c, x, h0, lengths)
    assert want.keys() == got.keys()
    assert got.pop("graph") == want.pop("graph")
    for name in ("out", "h_n"):
        assert torch.equal(got.pop(name), want.pop(name)), (name, c)
    exact = None
    for name, b in want.items():
        a = got[name]
        assert (a is None) == (b is None), (name, c)
        if a is None or rel_err(a, b) <= TOL:
            continue
        if exact is None:
            exact = _fuzz_rnn_run(copy.deepcopy(ref).double(), c, *_fuzz_rnn_inputs(c, torch.float64))
        assert rel_err(a, exact[name]) <= 4 * rel_err(b, exact[name]), (name, rel_err(a, b), c)


def _fuzz_chain(seed: int) -> tuple[list, tuple]:
    """A random chain of the layers README lists (Conv2d of any geometry,
    MaxPool2d, element-wise activations, Flatten then Linear), and its sample shape."""
    rng = random.Random(seed)
    while True:
        shape = (rng.randint(1, 4), rng.randint(1, 8), rng.randint(1, 8))
        layers, out = [], torch.zeros(1, *shape)
        for _ in range(rng.randint(1, 8)):
            if out.dim() == 4 and rng.random() < 0.4:
                groups = rng.choice([g for g in range(1, out.shape[1] + 1) if out.shape[1] % g == 0])
                k, d = (rng.randint(1, 3), rng.randint(1, 3)), (rng.randint(1, 2), rng.randint(1, 2))
                s, p = (rng.randint(1, 3), rng.randint(1, 3)), (rng.randint(0, 1), rng.randint(0, 2))
                layer = nn.Conv2d(out.shape[1], groups * rng.randint(1, 2), k, groups=groups, dilation=d,
                                  **(dict(padding="same") if rng.random() < 0.2 else dict(stride=s, padding=p)))
            elif out.dim() == 4 and rng.random() < 0.4:
                k = (rng.randint(1, 3), rng.randint(1, 3))
                layer = nn.MaxPool2d(k, stride=rng.choice([None, (rng.randint(1, 3), rng.randint(1, 3))]),
                                     padding=(rng.randint(0, k[0] // 2), rng.randint(0, k[1] // 2)),
                                     dilation=(rng.randint(1, 2), rng.randint(1, 2)), ceil_mode=rng.random() < 0.3)
            elif rng.random() < 0.6:
                layer = rng.choice([nn.ReLU, nn.Tanh, nn.GELU, nn.Softplus, nn.Hardtanh, nn.ELU])()
            elif out.dim() == 4:
                layer = nn.Flatten()
            else:
                layer = nn.Linear(out.shape[1], rng.randint(1, 8), bias=rng.random() < 0.7)
            try:
                out = layer(out)
            except RuntimeError:  # a geometry the shape cannot take: draw again
                break
            layers.append(layer)
        else:
            if any(not isinstance(layer, nn.Flatten) for layer in layers):
                return layers, shape


FUZZ_SEEDS = range(45)


def test_fuzzed_rnn_and_gru_equal_nn():
    configs = [_fuzz_rnn_config(seed) for seed in FUZZ_SEEDS]
    for key in ("kind", "form", "op", "bias", "batch_first", "bidirectional", "dropout", "sorted", "h0",
                "x_grad", "frozen", "loss", "strided", "state", "L"):
        assert len({c[key] for c in configs}) > 1, key  # the seeds cover every choice of each feature
    assert {(c["kind"], c["form"]) for c in configs} == set(itertools.product(KINDS, ("batched", "unbatched", "packed")))
    for c in configs:
        _fuzz_rnn_check(c)


def test_fuzzed_float64_rnn_and_gru_are_nns_bitwise():
    """float64 runs torch's own recurrence: outputs and every gradient nn's
    bit for bit, over every input form, operation and dropout (before: a
    TypeError, "the scan runs in float32")."""
    for seed in range(0, 45, 2):
        c = _fuzz_rnn_config(seed)
        ref, ours = _fuzz_rnn_pair(c)
        want = _fuzz_rnn_run(ref.double(), c, *_fuzz_rnn_inputs(c, torch.float64))
        got = _fuzz_rnn_run(ours.double(), c, *_fuzz_rnn_inputs(c, torch.float64))
        assert want.keys() == got.keys()
        for name, b in want.items():
            a = got[name]
            assert a == b if isinstance(b, bool) or b is None else a.dtype == torch.float64 and torch.equal(a, b), \
                (name, c)


def test_fuzzed_rnn_refusals_are_documented_ones():
    """proj_size raises nn's own error, double backward a RuntimeError
    (README's "Not supported")."""
    for seed in range(6):
        c = _fuzz_rnn_config(seed)
        ref, ours = _fuzz_rnn_pair(dict(c, form="batched", dropout=0.0, frozen=False))
        x, h0, _ = _fuzz_rnn_inputs(dict(c, form="batched"))
        x = x.requires_grad_()
        out, _ = ours(x, h0)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(out.sum(), x, create_graph=True)
        nn_cls, ours_cls = (nn.GRU, bppsa.GRU) if c["kind"] == "gru" else (nn.RNN, bppsa.RNN)
        with pytest.raises(ValueError, match="proj_size") as nn_error:
            nn_cls(3, 4, proj_size=2)
        with pytest.raises(nn_error.type, match="proj_size"):
            ours_cls(3, 4, proj_size=2)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
def test_fuzzed_chains_equal_autograd():
    """chain_backward (every level choice) within 1e-5 of autograd's layer
    input gradients, and every layer's CSR transposed Jacobian autograd's
    dense one bit for bit (a pool whose padding window index leaves the
    plane is refused, as README says)."""
    for seed in FUZZ_SEEDS:
        layers, shape = _fuzz_chain(seed)
        torch.manual_seed(seed)
        x = torch.randn(random.Random(seed).randint(1, 3), *shape)
        g = torch.randn(nn.Sequential(*layers)(x).shape)
        levels = ["auto", "linear", "blelloch", 1, 2][seed % 5]
        try:
            ours = bppsa.chain_backward(layers, x, g, levels=levels)
        except ValueError as error:
            assert "past the" in str(error) and "input plane" in str(error), error
            continue
        want = autograd_layer_input_grads(layers, x, g)
        assert len(ours) == len(want)
        for a, b in zip(ours, want):
            assert a.shape == b.shape and rel_err(a, b) <= 1e-5, (seed, levels, layers)
        sample = x[0]
        for layer in layers if seed % 2 else ():  # (autograd's Jacobian: one backward per output)
            if not isinstance(layer, nn.Flatten):
                jacobian = bppsa.transposed_jacobian(layer, sample).to_dense()
                assert torch.equal(jacobian, dense_transposed_jacobian(layer, sample)), (seed, layer)
            sample = layer(sample.unsqueeze(0))[0].detach()


# ---------------------------------------------------------------------------
# Mutation audit of python/reprop/bppsa.py's Python layer (session 43): each test below
# kills a plausible bug no other test noticed
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_without_bias_every_layer_reads_its_own_weights(kind, bidirectional):
    """bias=False has two weights per layer and direction in
    _flat_weights_names, not four: a second layer (or reverse direction)
    read at the biased stride took another's weights, or ran out of them.
    One layer without bias (the test above) cannot tell."""
    torch.manual_seed(7)
    ref, ours = make_pair(kind, 3, 5, num_layers=3, bias=False, bidirectional=bidirectional)
    dirs = 2 if bidirectional else 1
    x, h0, w_out = torch.randn(6, 2, 3), torch.randn(3 * dirs, 2, 5), torch.randn(6, 2, 5 * dirs)
    assert_close_lists(run(ours, x, h0, w_out), run(ref, x, h0, w_out))


@pytest.mark.parametrize("batch_first", [False, True])
def test_input_of_no_step_is_refused_naming_it(batch_first):
    """A sequence of no step (T = 0, B > 0) raises the module's own error
    (a ValueError that is also nn's RuntimeError); only an empty batch
    (B = 0) is torch's own empty result (test_module_empty_batch_is_torch_own)."""
    ours = bppsa.GRU(2, 3, batch_first=batch_first)
    x = torch.randn(4, 0, 2) if batch_first else torch.randn(0, 4, 2)
    with pytest.raises(ValueError, match=r"^input: expected a sequence of at least one step$"):
        ours(x)


@pytest.mark.parametrize("kind", ["tanh", "gru"])
def test_low_precision_input_under_bfloat16_amp_runs_as_nn(kind):
    """Under autocast the input may be of another dtype than the weights
    (bf16 activations into a float32 module), as nn.RNN's check allows:
    the same outputs and gradients as nn, not a dtype refusal."""
    torch.manual_seed(2)
    ref, ours = make_pair(kind, 3, 4, num_layers=2)
    x = torch.randn(5, 2, 3).bfloat16()
    results = []
    for module in (ref, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, h = module(x)
        (out.float().sum() + h.float().sum()).backward()
        results.append([out, h, *(p.grad for p in module.parameters())])
    for a, b in zip(*results):
        assert a.dtype == b.dtype and rel_err(b.float(), a.float()) <= 1e-2


@pytest.mark.parametrize("choice", ["linear", "blelloch", 2])
def test_a_forced_choice_is_the_one_the_backward_runs(choice):
    """scan="linear", "blelloch" or a number of levels is what backward
    runs, each with its own rounding: a one-layer tanh RNN's h0 gradient is
    d[0] W_hh, d the scan's pre-activation gradient at those levels (public
    bppsa.scan), bit for bit, and the three choices round apart here (so a
    choice silently replaced by another is seen)."""
    torch.manual_seed(0)
    ours = bppsa.RNN(4, 6)
    x, h0, w_out = torch.randn(40, 3, 4), torch.randn(1, 3, 6), torch.randn(40, 3, 6)

    def h0_grads(scan):
        ours.scan = scan
        h = h0.clone().requires_grad_()
        out, _ = ours(x, h)
        (out * w_out).sum().backward()
        with torch.no_grad():
            d = bppsa.scan(w_out, w=ours.weight_hh_l0, activation="tanh", y=out, pre_activation=True,
                           levels=scan)
        return h.grad[0], d[0] @ ours.weight_hh_l0

    got, want = h0_grads(choice)
    assert torch.equal(got, want)
    others = [h0_grads(other)[0] for other in ("linear", "blelloch", 2) if other != choice]
    assert not any(torch.equal(got, other) for other in others)


@pytest.mark.parametrize("kind", KINDS)
def test_saved_tensors_are_exactly_x_hx_weights_out_and_the_grus_bias_copies(kind):
    """What a layer saves, tensor by tensor (the bound above allows slack):
    x, hx, W_ih, W_hh and out, as nn's backward keeps; the GRU also copies
    of b_ih and b_hh (it recomputes its gates), the RNN no bias (its
    Jacobians and gradients read none)."""
    _, ours = make_pair(kind, 3, 8)
    x = torch.randn(50, 4, 3, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        ours(x)
    biases = [(24,), (24,)] if kind == "gru" else []
    want = [(50, 4, 3), (1, 4, 8), ((24 if kind == "gru" else 8), 3), ((24 if kind == "gru" else 8), 8),
            *biases, (50, 4, 8)]
    assert saved == want


def test_max_levels_and_scan_levels_take_sizes_up_to_int32s_end():
    """The core's sizes are int32s: 2**31 - 1 is taken, 2**31 refused by
    name (one past the bound was let through to the C plan)."""
    assert bppsa.max_levels(2**31 - 1) == 30
    with pytest.raises(ValueError, match=r"^n: expected an int in \[1, 2147483647\], got 2147483648$"):
        bppsa.max_levels(2**31)
    with pytest.raises(ValueError, match=r"^batch: expected an int in \[0, 2147483647\], got 2147483648$"):
        bppsa.scan_levels(5, 2**31, 1, 1)


@pytest.mark.parametrize("shape, out", [((2, 5, 1), (3, -1)), ((2, 1, 5), (-1, 3))])
def test_chain_conv_smaller_than_its_kernel_along_one_axis_is_refused_by_name(shape, out):
    """A Conv2d input narrower than the kernel along either axis alone (the
    other one fits) is refused naming the layer, before the C pattern builder."""
    message = (rf"^layers\[0\]: Conv2d: an input of \(H, W\) = \({shape[1]}, {shape[2]}\) per sample, padded, "
               rf"is smaller than the dilated kernel; the output would be \({out[0]}, {out[1]}\)$")
    with pytest.raises(ValueError, match=message):
        bppsa.ChainPlan([nn.Conv2d(2, 3, 3)], shape)


def test_chain_flatten_refuses_an_end_dim_other_than_the_last():
    """Flatten(1, 2) of a (C, H, W) sample keeps W apart: not one vector per
    sample, refused naming end_dim (start_dim alone was checked)."""
    layers = [nn.Conv2d(1, 2, 3), nn.Flatten(1, 2), nn.ReLU()]
    with pytest.raises(ValueError, match=r"^layers\[1\]: only Flatten\(start_dim=1, end_dim=-1\) is supported "
                                         r".*got start_dim=1, end_dim=2$"):
        bppsa.ChainPlan(layers, (1, 6, 6))
