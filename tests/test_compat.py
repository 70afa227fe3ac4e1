"""What `import reprop` needs, and what it says without it: the supported
PyTorch floor (refused at import below it, declared the same in
pyproject.toml), and the native extensions (_C not built for this Python,
a built _cuda that does not load); and how the techniques meet
torch.compile."""
import copy
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import warnings

import pytest
import torch
import torch._dynamo.testing

import reprop
import reprop.optim
from reprop import _tensors

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", ["2.7.1", "2.1.0+cu121", "2.3.1", "1.13.1"])
def test_require_torch_refuses_older(version):
    with pytest.raises(ImportError, match=rf"PyTorch 2\.8 or newer, found {re.escape(version)}"):
        _tensors.require_torch(version)


@pytest.mark.parametrize("version", ["2.8.0", "2.8.0+cu128", "2.10.0a0+git1234abc", "2.13.0+cpu", "3.0.0"])
def test_require_torch_accepts_floor_and_newer(version):
    _tensors.require_torch(version)


def test_import_reprop_on_older_torch_raises_import_error():
    # torch < 2.8 lacks what fad needs under a non-reentrant checkpoint; before
    # the floor, import succeeded there and fad gave wrong gradients silently
    code = "import torch; torch.__version__ = '2.7.1'; import reprop"
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(reprop.__file__).parent.parent))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert "ImportError: reprop needs PyTorch 2.8 or newer, found 2.7.1" in run.stderr


def test_pyproject_declares_the_floor():
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert declared and tuple(map(int, declared.groups())) == _tensors.MIN_TORCH


@pytest.fixture
def fresh_dynamo():
    """Compiled frames and their guards neither come from nor outlive the test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _small_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _train_step(model: torch.nn.Module, opt, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["backward", "forward"])
@pytest.mark.parametrize("compiled", ["model", "training step", "compiled autograd"])
def test_fused_training_under_torch_compile_equals_eager(fresh_dynamo, mode, compiled):
    """Dynamo traced the fusion's hooks and the step() it installs, and
    compiled the functions they call at each graph break in them: a
    forward-fused model compiled after fuse() raised InternalTorchDynamoError
    (tracing _settle) at its second forward, a compiled training step of
    either one raised it too, or an AssertionError (tracing _decided), and
    backward mode under compiled autograd raised its queue_callback
    AssertionError. They now run eagerly, a graph break each."""
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    ref = _small_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model = _small_mlp()
    opt = reprop.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with reprop.fuse(model, opt, mode=mode), \
            torch._dynamo.config.patch(compiled_autograd=compiled == "compiled autograd"):
        if compiled == "model":
            net = torch.compile(model, backend="eager")
            step = _train_step
        else:
            net = model
            step = torch.compile(_train_step, backend="eager")
        for x in xs:
            torch.testing.assert_close(step(net, opt, x), _train_step(ref, ref_opt, x))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("compiled", ["training step", "opt.step"])
def test_compiled_step_runs_the_fused_optimizer_eagerly(fresh_dynamo, compiled):
    """Dynamo traced reprop's step(): each C call broke the graph, with its
    warning to wrap reprop._C.optim_call_key as a custom operator or file a
    PyTorch issue, and the Python in between was compiled and recompiled
    per parameter until dynamo's recompile limit. step() is now one graph
    break, run eagerly, and trains as torch.optim's."""
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref = _small_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model = _small_mlp()
    opt = reprop.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch._dynamo.utils.counters.clear()
    if compiled == "opt.step":
        opt.step = torch.compile(opt.step, backend="eager")
        step = _train_step
    else:
        step = torch.compile(_train_step, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in xs:
            torch.testing.assert_close(step(model, opt, x), _train_step(ref, ref_opt, x))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    breaks = list(torch._dynamo.utils.counters["graph_break"])
    assert not [w for w in caught if "reprop._C" in str(w.message)]
    assert not [reason for reason in breaks if "reprop._C" in reason], breaks


def _step_and_zero(model, opt):
    model(torch.ones(1, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_step_warns_nothing_compiled_or_not(fresh_dynamo, compiled):
    """The step() and zero_grad() backward fusion installs run inside a
    wrapper (_tensors.eager_under_compile; under torch.compile, also
    dynamo's). They warned, once, that they apply or clear only what no
    backward did: on README's own loop, an error under -W error. Compiled or
    not, reprop warns nothing there now. (Recorded, not raised: under -W
    error torch 2.13's dynamo fails on its own warnings while tracing, the
    plain torch.optim loop too.)"""
    model = _small_mlp()
    opt = reprop.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(_step_and_zero, backend="eager") if compiled else _step_and_zero
    with reprop.fuse(model, opt), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, opt)
    assert not [str(w.message) for w in caught if "reprop" in str(w.message)]


def test_fullgraph_names_reprop_eager_step(fresh_dynamo):
    """fullgraph=True refuses the graph break of a fused optimizer's step()
    (run eagerly): dynamo's error said only "reason: None" and hinted to
    remove a torch.compiler.disable the user cannot see."""
    model = _small_mlp()
    opt = reprop.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 8)).sum().backward()
    with pytest.raises(Exception, match="compile without fullgraph=True"):
        torch.compile(opt.step, backend="eager", fullgraph=True)()


def _bppsa_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out, h = model(x)
    loss = out.pow(2).sum() + h.sum()
    loss.backward()
    return loss


def _scans_counted(monkeypatch) -> list:
    import reprop.bppsa as bppsa
    scans, run_scan = [], bppsa._run_scan
    monkeypatch.setattr(bppsa, "_run_scan", lambda *args: scans.append(1) or run_scan(*args))
    return scans


@pytest.mark.parametrize("compiled", ["training step", "compiled autograd"])
def test_bppsa_backward_in_compiled_code_runs_the_scan_eagerly(fresh_dynamo, monkeypatch, compiled):
    """A compiled step calling loss.backward() (or compiled autograd) of a
    reprop.bppsa GRU: the module runs eagerly (test_bppsa), but the engine
    ran its backward in the compiled frame, so dynamo traced it, warned at
    each C call (reprop._C.scan, scan_plan, scan_workspace) to wrap it as a
    custom operator, and compiled its bookkeeping. The backward runs
    eagerly now, one graph break: the scan runs once per layer and step,
    the gradients are eager's bit for bit."""
    from reprop import bppsa
    torch.manual_seed(0)
    model = bppsa.GRU(4, 8, num_layers=2)
    ref = copy.deepcopy(model)
    x = torch.randn(6, 3, 4)
    scans = _scans_counted(monkeypatch)
    torch._dynamo.utils.counters.clear()
    net, step = model, torch.compile(_bppsa_step, backend="eager")
    with torch._dynamo.config.patch(compiled_autograd=compiled == "compiled autograd"), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.equal(step(net, x), _bppsa_step(ref, x))
    assert len(scans) == 2 * 2 * 2  # two layers, two steps, the compiled step and the eager one
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert not [str(w.message) for w in caught if "Dynamo" in str(w.message)]
    breaks = list(torch._dynamo.utils.counters["graph_break"])
    assert not [reason for reason in breaks if "reprop._C" in reason or "_functorch" in reason], breaks


@pytest.mark.parametrize("planned", [False, True])
def test_chain_backward_under_torch_compile_runs_eagerly(fresh_dynamo, planned):
    """chain_backward (with a ChainPlan, or building one) inside a compiled
    function: dynamo warned at each reprop._C call and compiled 18 to 24
    frames of its bookkeeping. It runs eagerly now, one graph break."""
    from reprop import bppsa
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
              torch.nn.Flatten(), torch.nn.Linear(48, 5), torch.nn.Tanh()]
    x, g = torch.randn(2, 2, 8, 8), torch.randn(2, 5)
    plan = bppsa.ChainPlan(layers, (2, 8, 8)) if planned else None

    def grads(x, g):
        return bppsa.chain_backward(layers, x + 0.0, g, plan=plan)

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(grads, backend=counter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for a, b in zip(compiled(x, g), grads(x, g)):
                assert torch.equal(a, b)
    assert counter.frame_count == 1
    assert not [str(w.message) for w in caught if "reprop._C" in str(w.message)]


def test_fullgraph_names_bppsa_eager_call(fresh_dynamo):
    """fullgraph=True over chain_backward raised "torch.* op returned
    non-Tensor" about torch._C._is_tracing, naming nothing of reprop's. It
    names reprop's eager call now."""
    from reprop import bppsa
    layers = [torch.nn.Linear(4, 3), torch.nn.ReLU()]
    with pytest.raises(Exception, match="reprop's chain_backward runs eagerly under torch.compile.*"
                                        "compile without fullgraph=True"):
        torch.compile(lambda x: bppsa.chain_backward(layers, x), backend="eager",
                      fullgraph=True)(torch.randn(2, 4))


def _fad_block(x: torch.Tensor) -> torch.Tensor:
    from reprop import fad
    with fad.enabled(compose=True):
        y = torch.nn.functional.gelu(x)
        return y * torch.sigmoid(y)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_fad_enabled_made_in_compiled_code_is_one_named_graph_break(fresh_dynamo, fullgraph):
    """An enabled() made inside compiled code: dynamo traced its constructor,
    broke the graph twice there (at its per-thread state; before that was
    a threading.local, at torch's WeakIdKeyDictionary and a lock, with a
    warning), and fullgraph=True raised that it cannot trace the class of
    that state, not what reprop's call was. It is made eagerly now: one
    graph break, and fullgraph=True's error names it. The compiled block
    runs torch's ops, as README says."""
    x = torch.randn(5, 7, requires_grad=True)
    compiled = torch.compile(_fad_block, backend="eager", fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(Exception, match="reprop's enabled.__init__ runs eagerly under "
                                            "torch.compile.*compile without fullgraph=True"):
            compiled(x)
        return
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
    y = torch.nn.functional.gelu(x)
    ref = y * torch.sigmoid(y)
    assert torch.equal(out, ref)
    assert torch.equal(*(torch.autograd.grad(t.sum(), x)[0] for t in (out, ref)))
    assert not [str(w.message) for w in caught if "Dynamo" in str(w.message)]
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_gate_is_torchs_is_compiling(fresh_dynamo, monkeypatch, backend):
    """_tensors.compiling(), reprop's cheaper torch.compiler.is_compiling()
    on its hooks and activations: True in code dynamo traces, in one graph
    compiled once (the flag it reads eager, if read there, is guarded as a
    constant that is False when the graph runs: a recompile every call),
    and eager the flag that torch.export (and torch 2.13's compile session)
    sets, as is_compiling()."""
    def plus_one_if_compiling(x):
        return x + 1 if _tensors.compiling() else x - 1

    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(plus_one_if_compiling, backend=counter, fullgraph=True)
    for _ in range(3):
        assert torch.equal(compiled(torch.zeros(2)), torch.ones(2))
    assert counter.frame_count == 1
    assert torch.equal(plus_one_if_compiling(torch.zeros(2)), -torch.ones(2))
    for flag in (True, False):
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", flag)
        assert _tensors.compiling() is torch.compiler.is_compiling() is flag


def test_compile_gate_falls_back_to_torchs_call_without_the_private_flag():
    """The cheaper gate on this torch, and torch.compiler.is_compiling
    itself where torch.compiler has no _is_compiling_flag (a private name:
    read at every hook, its absence would raise in each)."""
    assert _tensors.compiling is _tensors._compiling
    code = ("import torch.compiler\n"
            "del torch.compiler._is_compiling_flag\n"
            "from reprop import _tensors\n"
            "assert _tensors.compiling is torch.compiler.is_compiling\n")
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(reprop.__file__).parents[1]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr


class _Gated:
    """An object with a method under eager_under_compile that notes, per call,
    whether dynamo was tracing it."""

    def __init__(self) -> None:
        self.traced: list = []

    @_tensors.eager_under_compile
    def double(self, x: torch.Tensor) -> torch.Tensor:
        self.traced.append(torch.compiler.is_compiling())
        return x * 2


def test_weak_hook_of_a_gated_method_keeps_its_gate(fresh_dynamo):
    """weak_hook of an eager_under_compile method keeps its gate: eager, the
    method runs; in code dynamo traces, it runs eagerly too, at a graph break
    (traced, its bookkeeping was compiled); its object gone, the hook does
    nothing.
    The hook keeps the method's signature, bound."""
    import gc
    import inspect
    import weakref

    gated = _Gated()
    hook = _tensors.weak_hook(gated.double)
    assert list(inspect.signature(hook).parameters) == ["x"]
    assert torch.equal(hook(torch.ones(2)), torch.full((2,), 2.0))
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda x: hook(x) + 1, backend="eager")
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 3.0))
    assert gated.traced == [False, False]
    assert torch._dynamo.utils.counters["graph_break"]
    del gated
    gc.collect()
    assert hook(torch.ones(2)) is None
    # nothing but its holder (torch's hook dict) keeps a hook alive
    made = weakref.ref(_tensors.weak_hook(_Gated().double))
    gc.collect()
    assert made() is None


def _scratch_reprop(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of this reprop's package under tmp_path without its CUDA
    extension, for breaking its native files."""
    pkg = tmp_path / "reprop"
    shutil.copytree(pathlib.Path(reprop.__file__).parent, pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "_cuda.*"))
    return pkg


def _run_scratch(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONWARNINGS="default")
    return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_a_cuda_extension_that_does_not_load_is_named(tmp_path):
    """A reprop._cuda that is there but does not load (a corrupt file here;
    another NumPy's ABI, a missing symbol) passed for "built without CUDA":
    info said cuda_built False, and CUDA errors advised reinstalling with
    nvcc. Now import warns naming the error, info and the errors of CUDA
    work print it, and the CPU paths still work."""
    pkg = _scratch_reprop(tmp_path)
    (pkg / f"_cuda{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"not a shared object")
    run = _run_scratch(tmp_path, "-m", "reprop", "info")
    assert run.returncode == 0, run.stderr
    assert re.search(r"^cuda_built +False$", run.stdout, re.M)
    assert re.search(r"^cuda_error +ImportError: .*_cuda", run.stdout, re.M), run.stdout
    assert "RuntimeWarning: reprop: its CUDA extension reprop._cuda is built but does not load " \
           "(ImportError: " in run.stderr
    # what CUDA work meets says so too, not "built without" (bppsa's cuSPARSE peer: no device needed)
    run = _run_scratch(tmp_path, "-W", "ignore", "-c", "import torch, reprop.bppsa as b\ntry:\n"
                       "    b.ChainPlan([torch.nn.ReLU()], (4,), product='cusparse')\n"
                       "except RuntimeError as e:\n    print(e)")
    assert run.stdout.startswith("product: 'cusparse' is not available: reprop's CUDA extension is "
                                 "built but does not load (ImportError: "), run.stdout + run.stderr


@pytest.mark.parametrize("statement", ["import reprop", "importlib.import_module('reprop')"])
def test_the_cuda_load_warning_is_a_reprop_warning_at_the_users_import(tmp_path, statement):
    """The warning of a reprop._cuda that does not load pointed into
    reprop/_native.py, and was a bare RuntimeWarning. It points at the
    user's `import reprop` (past importlib's frames, a lazy or plugin
    loader's importlib.import_module's too) and is a reprop.ReproPWarning
    that is still a RuntimeWarning."""
    pkg = _scratch_reprop(tmp_path)
    (pkg / f"_cuda{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"not a shared object")
    script = tmp_path / "train.py"
    script.write_text(f"import importlib\n{statement}\n")
    run = _run_scratch(tmp_path, str(script))
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith(f"{script}:2: ReproPRuntimeWarning: reprop: its CUDA extension"), run.stderr
    assert issubclass(_tensors.ReproPRuntimeWarning, reprop.ReproPWarning)
    assert issubclass(_tensors.ReproPRuntimeWarning, RuntimeWarning)


def test_a_missing_c_extension_says_how_to_build_it(tmp_path):
    """Without a _C for this Python (a checkout never built, or one built for
    another Python) import said "cannot import name '_C' from partially
    initialized module 'reprop' (most likely due to a circular import)"."""
    pkg = _scratch_reprop(tmp_path)
    for built in pkg.glob("_C.*"):
        built.unlink()
    (pkg / "_C.cpython-39-x86_64-linux-gnu.so").write_bytes(b"")  # another Python's build
    run = _run_scratch(tmp_path, "-c", "import reprop")
    assert run.returncode != 0
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert (f"ImportError: reprop's C extension reprop._C is not built for this Python "
            f"({platform.python_implementation()} {platform.python_version()}, which loads "
            f"_C{suffix}) in {pkg}; found only _C.cpython-39-x86_64-linux-gnu.so, built for "
            f"another Python; build it with: pip install .") in run.stderr, run.stderr
