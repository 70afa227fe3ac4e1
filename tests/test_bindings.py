"""The private C bindings (reprop._native._C, and _cuda where built) called
directly, as a user could: they must never crash the interpreter (a crash
is run in a subprocess, so that it fails the test instead of killing
pytest), hold what they read while Python code or another thread runs,
release the GIL around long work, and raise an exception naming a bad
argument."""
from __future__ import annotations

import collections
import gc
import itertools
import math
import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
import tracemalloc
import types
import warnings

import numpy as np
import pytest
import torch

import reprop
import reprop.optim as ro
from reprop import _tensors
from reprop._native import _C


def _run_isolated(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter with this reprop, so that a crash
    fails the test instead of killing pytest."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(reprop.__file__)), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_csr_plan_holds_the_leaves_while_python_code_empties_the_list():
    """csr_plan borrowed the leaf tuples (and their arrays) from the caller's
    list: a `shared` whose __bool__ emptied the list freed them mid-parse
    (SystemError or a plan of freed memory), and another thread emptying it
    while the plan was built without the GIL, a segfault."""
    proc = _run_isolated("""
        import threading
        import numpy as np
        from reprop._native import _C

        def leaf(i, o, shared=False):
            ip, ix, wm = _C.jacobian("linear", (i, o))
            return (i, o, ip, ix, shared, wm, i * o)

        def plan_info(leaves):
            return _C.csr_plan_info(_C.csr_plan(leaves, 1, 0, 1.0, 1.0, 1.0))

        want = plan_info([leaf(300, 400), leaf(400, 300)])

        class EmptiesTheList:
            def __bool__(self):
                leaves.clear()
                [np.full(300 * 400, 7, np.int32) for _ in range(4)]  # reuse the freed memory
                return False

        leaves = [leaf(300, 400), leaf(400, 300, EmptiesTheList())]
        assert plan_info(leaves) == want

        class StartsAThreadEmptyingTheList:
            def __bool__(self):  # the thread runs once csr_plan releases the GIL
                emptier.start()
                return False

        leaves = [leaf(1500, 1500), leaf(1500, 1500, StartsAThreadEmptyingTheList())]
        emptier = threading.Thread(target=leaves.clear)
        assert plan_info(leaves) == plan_info([leaf(1500, 1500), leaf(1500, 1500)])
        emptier.join()
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-2000:]


def test_optim_grad_pointers_holds_each_row_while_python_code_changes_the_lists():
    """The optimizer's fast path read row i of its lists with the length it
    found on entry, and borrowed the items across the Python code a row runs
    (.grad, data_ptr(), __torch_function__): a .grad property emptying the
    params list made it read past the list's end, one dropping the param from
    it made the param's data_ptr() run on freed memory (segfaults). A list
    that changes under the call leaves the step to the Python path (None)."""
    proc = _run_isolated("""
        import numpy as np
        import torch
        from reprop._native import _C

        class EmptiesTheList:
            @property
            def grad(self):
                params.clear()
                return None  # this row sits the step out: on to row 1

        class DropsItself:
            @property
            def grad(self):
                params[0] = None  # the list held the only reference to this param
                [DropsItself() for _ in range(100)]  # reuse its memory
                return torch.zeros(1)

            def data_ptr(self):
                return 1  # not the key's 0: a stale row

        for cls in (EmptiesTheList, DropsItself):
            params = [cls(), cls()]
            table = np.zeros((2, 8), np.int64)
            assert _C.optim_grad_pointers(
                params, [(0, None, None, True, -1)] * 2, {}, [None] * 2, [()] * 2, [True] * 2,
                torch.strided, table, None, table, None, torch.Tensor, np.zeros(0, np.int64),
                None) is None
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-2000:]


def test_optim_hparams_holds_each_value_while_python_code_changes_the_group():
    """optim_hparams reads a group's values with dict lookups, which run a
    key's __eq__ where its hash collides with the key looked up: one that
    takes lr out of the group (which held the only reference to its value)
    must not leave the tuple pointing at freed memory. The values read are
    held until the tuple holds them: it has the lr read, as Python's
    group["lr"] would."""
    proc = _run_isolated("""
        from reprop._native import _C

        class Collides:
            def __hash__(self):
                return hash("weight_decay")

            def __eq__(self, other):
                group.pop("lr", None)  # the group held the only reference to the lr
                [float(i) + 0.5 for i in range(1000)]  # reuse its memory
                return False

        lr = float("0.1") * 3
        group = {"lr": lr, Collides(): 1.0}
        del lr
        made = _C.optim_hparams(group)
        assert made is not None and made[0] == float("0.1") * 3, made
        assert made[1:] == (0.0,) * 9 + (False,) * 5 + (0,), made  # kinds 0: numbers
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-2000:]


def test_cost_model_arguments_are_converted_one_at_a_time():
    """The machine (workers, level_cost, step_cost) was converted all three
    before the error check: a bad one followed by an object with __float__
    raised SystemError ("returned a result with an exception set")."""

    class Float:
        def __float__(self):
            return 1.0

    with pytest.raises(TypeError, match="^workers: must be real number, not str$"):
        _C.scan_plan(64, 2, 4, 0, "bad", Float(), 1.0)
    with pytest.raises(TypeError, match="^level_cost: must be real number, not str$"):
        _C.scan_cost(64, 2, 4, 0, 2, Float(), "bad", Float())
    with pytest.raises(TypeError, match="^step_cost: must be real number, not NoneType$"):
        _C.csr_plan([], 1, 0, Float(), Float(), None)
    assert _C.scan_plan(64, 2, 4, 0, Float(), Float(), Float()) == _C.scan_plan(64, 2, 4, 0, 1.0, 1.0, 1.0)


def test_sched_graph_and_simulate_hold_each_entry_while_its_python_code_runs():
    """The spec and graph entries were borrowed from the dict while their own
    Python code ran (NumPy's __len__, __float__, __index__, __bool__): an
    entry deleting itself from the dict, which held its only reference, was
    read after it was freed (segfaults)."""
    proc = _run_isolated("""
        import numpy as np
        from reprop._native import _C

        spec = dict(layers=2, micro=1, stages=1, iterations=1, transfer=0.5, order=0, k=0,
                    sync_by_layer=False, sub_stream=True, input_grad=False, fwd=[1.0, 1.0],
                    out_grad=[1.0, 1.0], weight_grad=[1.0, 1.0], sync=None, stage=None)
        want = _C.sched_graph(spec)

        def drops(d, key, method, result):  # an entry whose `method` deletes it from d
            def run(self):
                d.pop(key, None)  # NumPy may call it more than once
                [object() for _ in range(100)]  # reuse its memory
                return result
            return type("Drops", (), {"__slots__": (), method: run, "__getitem__": seq_item})()

        def seq_item(self, i):
            if i < 2:
                return 1.0
            raise IndexError

        for key, method, result in [("fwd", "__len__", 2), ("transfer", "__float__", 0.5),
                                    ("k", "__index__", 0)]:
            s = dict(spec)
            s[key] = drops(s, key, method, result)
            got = _C.sched_graph(s)
            assert all(np.array_equal(got[f], want[f]) for f in want), key

        class TrueInt(int):  # a flag whose truth deletes it
            def __bool__(self):
                s.pop("sub_stream", None)
                return True
        s = dict(spec, sub_stream=TrueInt(1))
        got = _C.sched_graph(s)
        assert all(np.array_equal(got[f], want[f]) for f in want)

        graph = dict(want)
        makespan = _C.simulate(graph, 1.0)[3]
        cost = graph["cost"].tolist()
        n = len(cost)

        class Cost:
            __slots__ = ()
            def __len__(self):
                graph.pop("cost", None)
                [object() for _ in range(100)]
                return n
            def __getitem__(self, i):
                if i < n:
                    return cost[i]
                raise IndexError
        graph["cost"] = Cost()
        assert _C.simulate(graph, 1.0)[3] == makespan
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-2000:]


def _unaligned(values, dtype) -> np.ndarray:
    """A C-contiguous array of `values` one byte off its dtype's alignment."""
    raw = np.zeros(len(values) * np.dtype(dtype).itemsize + 1, np.uint8)
    arr = raw[1:].view(dtype)
    arr[:] = values
    assert not arr.flags.aligned
    return arr


def test_arrays_the_core_reads_in_place_must_be_native_and_aligned():
    """PyArray_TYPE is NPY_INT64 for a big-endian '>i8' array too: optim_step
    read its bytes swapped as pointers and sizes (numel 4 << 56 here),
    optim_grad_pointers swapped step rows, csr_plan swapped indptr and
    indices, which it also took unaligned. The arrays the scheduling bindings
    convert are cast to native order instead."""
    p, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    table = np.zeros((1, 8), np.int64)
    table[0, 0], table[0, 1], table[0, 6] = p.ctypes.data, g.ctypes.data, 4  # param, grad, numel
    hparams = (0.1,) + (0.0,) * 9 + (False,) * 5  # SGD, lr 0.1
    native_order = "^table: expected a C-contiguous, aligned, writeable array in native byte order$"
    with pytest.raises(ValueError, match=native_order):
        _C.optim_step(0, 0, table.astype(">i8"), hparams, 1)
    with pytest.raises(ValueError, match=native_order):
        _C.optim_check(0, 0, table.astype(">i8"), hparams, False)
    assert (p == 1).all()
    _C.optim_step(0, 0, table, hparams, 1)
    np.testing.assert_allclose(p, 0.95, rtol=1e-7)
    # np.longlong is another type number for the same int64 (LP64): taken
    _C.optim_step(0, 0, table.astype(np.longlong), hparams, 1)
    np.testing.assert_allclose(p, 0.9, rtol=1e-7)

    no_grad = [types.SimpleNamespace(grad=None)]
    for step_rows in (np.zeros(1, ">i8"), _unaligned([0], np.int64)):
        with pytest.raises(ValueError, match="step_rows must be None .* in native byte order$"):
            _C.optim_grad_pointers(no_grad, [None], {}, [None], [None], [True], torch.strided, table,
                                   None, table.copy(), step_rows, torch.Tensor,
                                   np.zeros(0, np.int64), None)

    indptr, indices = np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32)
    for bad in (indptr.astype(">i4"), _unaligned(indptr, np.int32)):
        with pytest.raises(ValueError, match=r"^leaves\[0\]: indptr: expected a C-contiguous, aligned int32 "
                                             "array of 3 elements in native byte order$"):
            _C.csr_plan([(2, 2, bad, indices, False, None, 2)], 0, 0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"^leaves\[0\]: indices: expected a C-contiguous, aligned 1-D int32 "
                                         "array in native byte order$"):
        _C.csr_plan([(2, 2, indptr, indices.astype(">i4"), False, None, 2)], 0, 0, 1.0, 1.0, 1.0)

    want = _C.reverse_first_k(8, 3, np.arange(8), np.arange(8), 5, 100)
    got = _C.reverse_first_k(8, 3, np.arange(8).astype(">i8"), _unaligned(range(8), np.int64), 5, 100)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_csr_plan_refuses_layers_past_what_a_program_addresses():
    """rows = 2**63 - 1 wrapped rows + 1, the length indptr must have, to a
    negative one, which meant "any length": the core read indptr far past
    its two elements (ASan: heap-buffer-overflow). Rows and cols are refused
    past 2^31, which no program can address, naming the leaf, as are the
    arrays of a leaf."""
    indptr, indices = np.array([0, 1], np.int32), np.array([0], np.int32)
    leaf = (1, 1, indptr, indices, False, None, 1)
    past = "rows and cols must be in \\[1, 2\\^31\\), the floats a program addresses"
    for rows, cols in [(2**63 - 1, 1), (2**31, 1), (0, 1), (1, 2**63 - 1), (1, 2**31), (1, 0)]:
        with pytest.raises(ValueError, match=rf"^leaves\[0\]: {past} \(got {rows}, {cols}\)$"):
            _C.csr_plan([(rows, cols, indptr, indices, False, None, 1)], 0, 0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"^leaves\[1\]: indptr: expected .* int32 array of 3 elements"):
        _C.csr_plan([leaf, (2, 1, indptr, indices, False, None, 1)], 0, 0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"^leaves\[1\]: value_map: expected .* int32 array of 1 elements"):
        _C.csr_plan([leaf, (1, 1, indptr, indices, False, indptr, 1)], 0, 0, 1.0, 1.0, 1.0)
    assert _C.csr_plan_info(_C.csr_plan([leaf, leaf], 0, 0, 1.0, 1.0, 1.0))["levels"] == 0


def _lets_another_thread_run(call, armed_by_call: bool = False) -> bool:
    """Whether call() releases the GIL: with a switch interval far longer than
    the test, a thread waiting for the GIL alone gets it only while the caller
    has released it. A few tries, should the thread be slow to wake.
    armed_by_call: call(arm) calls arm() itself, from Python code the binding
    runs, so that the thread waits for the GIL only from then on."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        for _ in range(10):
            go, ran = threading.Event(), []
            waiter = threading.Thread(target=lambda: (go.wait(), ran.append(True)))
            waiter.start()
            if armed_by_call:
                call(go.set)
            else:
                go.set()  # the waiter now waits for the GIL
                call()
            during = bool(ran)
            waiter.join()
            if during:
                return True
        return False
    finally:
        sys.setswitchinterval(interval)


def test_scheduling_bindings_release_the_gil_around_their_work():
    """sched_stages and reverse_first_k held the GIL for O(layers) work (1.1 s
    at 1e8 layers) while module.c says each binding releases it."""
    assert _lets_another_thread_run(lambda: _C.sched_stages(2 * 10**7, 4, 0))
    assert _lets_another_thread_run(lambda: _C.reverse_first_k(5 * 10**6, 10**6, None, None, 0, 0))


def test_fad_and_jacobian_bindings_release_the_gil_around_their_work():
    """Mutation audit (session 38): fad_forward, fad_backward_code8 and
    jacobian's fill run without the GIL too (each kept it unnoticed). Each
    binding runs several times per try, so that the waiter (only it) has
    time to wake on a loaded machine."""
    x = torch.randn(1 << 22)
    y, d = torch.empty_like(x), torch.empty_like(x)
    codes = torch.zeros(x.numel(), dtype=torch.uint8)
    codebook = _C.fad_codebook(0, 0.0, 0.0)  # GELU
    calls = {
        "fad_forward": lambda: _C.fad_forward(0, 0.0, 0.0, 0, x.data_ptr(), y.data_ptr(), 0, d.data_ptr(),
                                              x.numel(), 1),
        "fad_backward_code8": lambda: _C.fad_backward_code8(0, x.data_ptr(), codes.data_ptr(), codebook,
                                                            y.data_ptr(), x.numel(), 1),
        "jacobian": lambda: _C.jacobian("linear", (2000, 2000)),
    }
    for name, call in calls.items():
        assert _lets_another_thread_run(lambda: [call() for _ in range(8)]), name


def test_fad_backward_code8_refuses_a_codebook_of_another_size():
    """Mutation audit (session 38): the codebook is read as the C struct, so
    bytes of any other length (one short read past its end, unnoticed) are
    refused before the call."""
    grad, out = torch.ones(4), torch.empty(4)
    codes = torch.zeros(4, dtype=torch.uint8)
    codebook = _C.fad_codebook(0, 0.0, 0.0)
    for bad in (codebook[:-1], codebook + b"\0", b"", bytearray(codebook)):
        with pytest.raises(TypeError, match="^codebook: expected the bytes fad_codebook"):
            _C.fad_backward_code8(0, grad.data_ptr(), codes.data_ptr(), bad, out.data_ptr(), 4, 1)
    _C.fad_backward_code8(0, grad.data_ptr(), codes.data_ptr(), codebook, out.data_ptr(), 4, 1)
    assert torch.equal(out, torch.full((4,), np.frombuffer(codebook, np.float32)[0]))


# The child's helper for the tests below: the caller's array written by
# another thread while the binding runs.
_CHANGED_WHILE_RUNNING = """
    import threading, time
    import numpy as np
    from reprop._native import _C

    def changed_while_running(call, arr, i, bad, seconds=0.75):
        \"\"\"Calls call() for `seconds`, another thread setting arr[i] = bad,
        which the binding refuses, once a call, 0.2 ms after the binding has
        released the GIL (which lands it in the middle of the core's work more
        often than writing at once): each call must return what it returns
        with arr[i] as it was, or raise ValueError, whichever value its check
        saw.\"\"\"
        good, want = arr[i], call()
        armed, written, stop = threading.Event(), threading.Event(), []
        def writer():
            while armed.wait() and not stop:
                armed.clear()
                begin = time.perf_counter()
                while time.perf_counter() - begin < 2e-4:
                    pass
                arr[i] = bad
                written.set()
        thread = threading.Thread(target=writer)
        thread.start()
        start = time.monotonic()
        try:
            while time.monotonic() - start < seconds:
                arr[i] = good
                written.clear()
                armed.set()  # the writer now waits for the GIL
                try:
                    got = call()
                except ValueError:
                    continue
                finally:
                    written.wait()
                assert all(np.array_equal(a, b) for a, b in zip(got, want)), (got, want)
        finally:
            stop.append(True)
            armed.set()
            thread.join()
"""


def test_scheduling_bindings_use_the_values_they_checked_while_another_thread_writes():
    """simulate, sched_regions, sched_graph and reverse_first_k handed the core
    the caller's own arrays (NumPy returns an array that already fits), which
    the core checked and then used without the GIL: another thread writing
    one in between had it use a value it refuses. A dependency past the last
    task and a deadline past the last region were indices (segfaults within a
    second), a stage a resource id past the graph's resources, a negative
    memory size a silently different k. They now own a copy of each array the
    core checks and then uses as indices, sizes or sums."""
    proc = _run_isolated(_CHANGED_WHILE_RUNNING + """
    def spec(layers, micro, iterations, stage=None):
        return dict(layers=layers, micro=micro, stages=2, iterations=iterations, order=0, k=1,
                    transfer=0.1, sync_by_layer=False, sub_stream=False, input_grad=False,
                    fwd=[1.0] * layers, out_grad=[1.0] * layers, weight_grad=[1.0] * layers,
                    sync=None, stage=stage)

    graph = _C.sched_graph(spec(500, 4, 2))
    dep_idx = graph["dep_idx"]
    changed_while_running(lambda: _C.simulate(graph, 1.0), dep_idx, 0, 1 << 40)

    ready = np.zeros(400)
    ready[0] = 200  # past every region's reach: task 0 falls back to region deadline[0] - 1
    deadline = np.full(400, 200, np.int64)
    regions = lambda: _C.sched_regions(np.ones(200), ready, deadline, np.ones((400, 200)),
                                       np.ones((400, 200)), np.ones(400, np.int64), 2,
                                       None, None, None)
    changed_while_running(regions, deadline, 0, 1 << 40)

    stage = np.zeros(100, np.int32)  # read for each of the 48000 tasks the builder writes
    changed_while_running(lambda: _C.sched_graph(spec(100, 8, 20, stage)).values(), stage, 99, 1 << 20)

    sizes = np.ones(10**6, np.int64)  # k = 500000 under the cap
    changed_while_running(lambda: _C.reverse_first_k(10**6, 10**6, sizes, sizes, 0, 1), sizes, 0, -(1 << 62))
    print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout == "ok\n", (proc.returncode, proc.stderr[-2000:])


def test_csr_plan_uses_the_patterns_it_checked_while_another_thread_writes():
    """csr_plan's core checked the caller's index arrays and then copied them,
    both without the GIL: another thread writing one in between had the plan
    built from a column index past its layer's (here a read 4 GiB past a row
    pointer array: segfaults within a second or two). The core now checks
    its own copy."""
    proc = _run_isolated(_CHANGED_WHILE_RUNNING + """
    n = 10**5
    leaves = [(n, n, *_C.jacobian("diagonal", (n, 0)), False, None, n) for _ in range(9)]
    # leaf 0: checked first, copied last, then the left operand of a level-0 product
    indices = leaves[0][3]
    plan = lambda: _C.csr_program(_C.csr_plan(leaves, 1, 0, 1.0, 1.0, 1.0)).values()
    changed_while_running(plan, indices, n - 1, 1 << 30)
    print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout == "ok\n", (proc.returncode, proc.stderr[-2000:])


def test_optim_check_refuses_an_unknown_kind_as_optim_step_does():
    """optim_check(99, ...) returned None (the pre-update check never looked
    at the kind) where optim_step refuses it."""
    table = np.zeros((1, 8), np.int64)
    hparams = (0.1,) + (0.0,) * 9 + (False,) * 5
    with pytest.raises(ValueError, match="^unknown optimizer kind 99$"):
        _C.optim_step(99, 0, table, hparams, 1)
    for capturable in (False, True):
        with pytest.raises(ValueError, match="^unknown optimizer kind 99$"):
            _C.optim_check(99, 0, table, hparams, capturable)
    assert _C.optim_check(0, 0, table, hparams, False) is None


_SPEC = dict(layers=4, micro=2, stages=2, iterations=2, order=0, k=1, transfer=0.1, sync_by_layer=False,
             sub_stream=False, input_grad=False, fwd=[1.0] * 4, out_grad=[1.0] * 4, weight_grad=[1.0] * 4,
             sync=None, stage=None)


def test_binding_argument_errors_name_the_argument():
    """Size, pointer and float arguments never named themselves (an int past
    int64 gave a bare "int too big to convert", a str a bare TypeError), nor
    did an OverflowError of a spec entry, each pointer of csr_gradients' out,
    a wrong plan or the TypeError of an int argument; sched_graph called
    order 2**40 "order -1"."""
    leaf = (2, 2, np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), False, None, 2)
    plan = _C.csr_plan([leaf, leaf], 0, 0, 1.0, 1.0, 1.0)
    too_big = "int too big to convert$"
    cases = [
        (OverflowError, "^sched_graph: micro: " + too_big, lambda: _C.sched_graph({**_SPEC, "micro": 2**70})),
        (ValueError, "^sched_graph: order 1099511627776 is not an rp_order$",
         lambda: _C.sched_graph({**_SPEC, "order": 2**40})),
        (OverflowError, "^layers: " + too_big, lambda: _C.sched_stages(2**70, 1, 1)),
        (OverflowError, "^layers: " + too_big, lambda: _C.reverse_first_k(2**70, 1, None, None, 0, 0)),
        (TypeError, "^layers: 'str' object cannot be interpreted as an integer$",
         lambda: _C.ksearch_next("4", [0.0] * 5)),
        (OverflowError, "^mem_cap: " + too_big,
         lambda: _C.sched_regions([1.0], [0.0], [1], [[1.0]], [[1.0]], None, 2**64, None, None,
                                  None)),
        (TypeError, r"^out\[1\]: an integer is required$", lambda: _C.csr_gradients(plan, 1, 0, [0, "x"], 1)),
        (OverflowError, "^seq: can't convert negative int to unsigned$",
         lambda: _C.csr_run(plan, 1, -1, 0, 0, 0, 0, 0, 1)),
        (TypeError, r"^plan: expected the capsule csr_plan\(\) returns, got int$", lambda: _C.csr_plan_info(5)),
        (OverflowError, r"^geometry\[14\]: " + too_big, lambda: _C.jacobian("conv2d", (1,) * 14 + (2**64,))),
        (OverflowError, "^max_pairs: " + too_big, lambda: _C.csr_plan([leaf], 0, 2**64, 1.0, 1.0, 1.0)),
        (TypeError, "^p1: must be real number, not str$", lambda: _C.fad_codebook(0, 0.0, "x")),
        (TypeError, "^n: 'NoneType' object cannot be interpreted as an integer$",
         lambda: _C.scan_workspace(None, 1, 1, 0)),
        (TypeError, "^kind: 'str' object cannot be interpreted as an integer$",
         lambda: _C.optim_step("0", 0, np.zeros((0, 8), np.int64), (0.1,) + (0.0,) * 9 + (False,) * 5, 1)),
    ]
    for exc, message, call in cases:
        with pytest.raises(exc, match=message):
            call()


def test_cuda_binding_argument_errors_name_the_argument():
    """_cuda's own bindings converted some arguments with the bare C API:
    optim_step's lr_ptr ("can't convert negative int to unsigned"),
    cusparse_create's library ("bad argument type for built-in operation")
    and ints, and cusparse_run's chain (the capsule API's ValueError), none
    naming the argument. Runs wherever _cuda is built (CI builds it without a
    device): each error comes before anything is launched."""
    cuda = reprop._native._cuda
    if cuda is None:
        pytest.skip("reprop._cuda not built")
    hparams = (0.1,) + (0.0,) * 9 + (False,) * 5
    table, mats, ops = np.zeros((0, 8), np.int64), np.zeros((0, 10), np.int64), np.zeros((0, 5), np.int64)
    plan = _C.csr_plan([(1, 1, np.array([0, 1], np.int32), np.array([0], np.int32), False, None, 1)],
                       0, 0, 1.0, 1.0, 1.0)

    def create(library="", vectors=0, batch=1, nvectors=1, stride=1):
        return cuda.cusparse_create(library, mats, ops, vectors, batch, nvectors, stride, 0)

    unsigned = "can't convert negative int to unsigned$"
    cases = [
        (OverflowError, "^lr_ptr: " + unsigned, lambda: cuda.optim_step(0, 0, table, hparams, False, 0, -1)),
        (TypeError, "^lr_ptr: an integer is required$", lambda: cuda.optim_step(0, 0, table, hparams, False, 0, "x")),
        (TypeError, "^library: expected a str, got int$", lambda: create(library=5)),
        (ValueError, "^library: embedded null character$", lambda: create(library="libcusparse.so\0x")),
        (ValueError, "^library: 'utf-8' codec can't encode", lambda: create(library="\ud800")),
        (OverflowError, "^vectors: " + unsigned, lambda: create(vectors=-1)),
        (OverflowError, "^batch: int too big to convert$", lambda: create(batch=2**70)),
        (TypeError, "^nvectors: 'str' object cannot be interpreted as an integer$", lambda: create(nvectors="1")),
        (OverflowError, "^stride: int too big to convert$", lambda: create(stride=10**5000)),
        (TypeError, r"^chain: expected the capsule cusparse_create\(\) returns, got int$",
         lambda: cuda.cusparse_run(5, 0)),
        (TypeError, r"^chain: expected the capsule cusparse_create\(\) returns, got PyCapsule$",
         lambda: cuda.cusparse_run(plan, 0)),
        (OverflowError, "^kind: expected an int in .*, got an int >= 2\\^63$",
         lambda: cuda.fad_forward(10**5000, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0)),
    ]
    for exc, message, call in cases:
        with pytest.raises(exc, match=message):
            call()


def test_cuda_scan_shared_bytes():
    """The shared memory the CUDA scan's smallest blocks need, which decides
    whether scan="auto" scans a hidden size on a device (README: about
    29,000 on an H100/H200's 227 KiB, a thousand fewer with levels). Runs
    wherever _cuda is built; the device's own room needs a device."""
    cuda = reprop._native._cuda
    if cuda is None:
        pytest.skip("reprop._cuda not built")
    need = cuda.scan_shared_bytes
    assert need(20, 0) == 2 * 20 * 4 + 16  # the linear scan: two vectors, padded to float4s
    assert need(21, 0) == need(24, 0) == 2 * 24 * 4 + 16
    # levels: one up-sweep task (an H x H product for H <= 64), whatever their number
    assert need(20, 1) == need(20, 9) == 16 + (2 * 20 * 20 + 2 * 20) * 4
    room = 227 * 1024
    assert need(28000, 0) < need(28000, 1) <= room < need(28100, 1)
    assert need(29052, 0) <= room < need(29053, 0)
    assert need(2**40, 0) == need(2**62, 3) == 2**64 - 1  # past any device
    for exc, message, call in [(ValueError, "expected dim >= 1 and levels >= 0, got 0 and 0", lambda: need(0, 0)),
                               (ValueError, "got 5 and -1", lambda: need(5, -1)),
                               (TypeError, "^dim: ", lambda: need("5", 0)),
                               (OverflowError, "^levels: ", lambda: need(5, 2**40))]:
        with pytest.raises(exc, match=message):
            call()
    if not reprop._native.cuda_available():
        with pytest.raises(RuntimeError, match="rp_cuda_shared_memory_per_block"):
            cuda.shared_memory_per_block(0)


def test_cuda_archs_and_availability_leave_the_driver_alone_unless_torch_sees_a_gpu(monkeypatch):
    """_cuda.build_info() counted the devices (cudaGetDeviceCount, which
    initializes the driver: a child forked after it cannot use CUDA), so
    reprop.cuda_archs() did, and cuda_available() did even where torch's own
    check leaves the driver alone (a CPU build of torch; NVML's check)."""
    native = reprop._native
    if native._cuda is not None:
        assert set(native._cuda.build_info()) == {"archs", "cusparse"}

    class Cuda:  # a CUDA build whose device count must not be asked
        def build_info(self):
            return {"archs": "sm_90", "cusparse": True}

        def device_count(self):
            raise AssertionError("the driver was initialized")

    monkeypatch.setattr(native, "_cuda", Cuda())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    native._cuda_device_count.cache_clear()
    try:
        assert native.cuda_archs() == "sm_90"
        assert native.cuda_available() is False
    finally:
        native._cuda_device_count.cache_clear()


def test_cuda_archs_is_public_as_readme_calls_it():
    """README's Quick start names reprop.cuda_archs() beside cuda_built(),
    cuda_available() and cuda_error(), but only reprop._native had it:
    reprop.cuda_archs() raised AttributeError. The architectures the kernels
    were built for, or None in a build without CUDA (python -m reprop info's
    cuda_archs)."""
    assert "cuda_archs" in reprop.__all__
    assert reprop.cuda_archs is reprop._native.cuda_archs
    expected = None if reprop._native._cuda is None else reprop._native._cuda.build_info()["archs"]
    assert reprop.cuda_archs() == expected


def test_an_int_too_long_to_write_as_text_is_an_overflow_naming_the_argument():
    """The int arguments' OverflowError wrote the value with %R, which Python
    refuses for an int of over 4300 digits: its ValueError "Exceeds the limit
    (4300 digits) for integer string conversion" replaced the error naming
    the argument. Each kind of int argument, with such an int."""
    huge = 10**5000
    leaf = (2, 2, np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), False, None, 2)
    plan = _C.csr_plan([leaf, leaf], 0, 0, 1.0, 1.0, 1.0)
    hparams = (0.1,) + (0.0,) * 9 + (False,) * 5
    int_range = r"expected an int in \[-2147483648, 2147483647\], got "
    cases = [
        ("^kind: " + int_range + r"an int >= 2\^63$", lambda: _C.fad_codebook(huge, 0.0, 0.0)),
        ("^num_threads: " + int_range + r"an int < -2\^63$",
         lambda: _C.optim_step(0, 0, np.zeros((0, 8), np.int64), hparams, -huge)),
        ("^levels: " + int_range + "1099511627776$", lambda: _C.scan_workspace(1, 1, 1, 2**40)),
        ("^n: int too big to convert$", lambda: _C.scan_workspace(huge, 1, 1, 0)),
        ("^seq: int too big to convert$", lambda: _C.csr_run(plan, 1, huge, 0, 0, 0, 0, 0, 1)),
        ("^sched_graph: micro: int too big to convert$", lambda: _C.sched_graph({**_SPEC, "micro": huge})),
    ]
    for message, call in cases:
        with pytest.raises(OverflowError, match=message):
            call()


def test_jacobian_kind_is_the_whole_str():
    """The kind was compared with C's strcmp, which stops at an embedded NUL:
    "linear\\0x" was taken for "linear"; a non-str gave Python's bare "bad
    argument type for built-in operation". A diagonal's geometry is (size,
    0): the second entry was ignored, so (3, 7) gave the pattern of (3, 0)."""
    for kind in ("linear\0x", "linear\0", "lin"):
        with pytest.raises(ValueError, match=f"^jacobian: unknown layer kind {re.escape(repr(kind))}$"):
            _C.jacobian(kind, (3, 4))
    with pytest.raises(TypeError, match="^kind: expected a str, got bytes$"):
        _C.jacobian(b"linear", (3, 4))
    for b in (7, -1):
        with pytest.raises(ValueError, match=rf"^geometry: expected \(size, 0\) for a diagonal, got \(3, {b}\)$"):
            _C.jacobian("diagonal", (3, b))
    indptr, indices, wmap = _C.jacobian("linear", (3, 4))
    assert indptr.tolist() == [0, 4, 8, 12] and wmap.tolist() == [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]
    assert [len(_C.jacobian(kind, geometry)) for kind, geometry in [
        ("diagonal", (3, 0)), ("conv2d", (1, 4, 4, 2, 4, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1)),
        ("maxpool2d", (1, 4, 4, 1, 2, 2, 2, 2, 2, 2, 0, 0, 1, 1, 1))]] == [2, 3, 4]


@pytest.mark.parametrize("module", ["_C", "_cuda"])
@pytest.mark.parametrize("dtype", [7, 0])
def test_a_refused_update_leaves_step_counters_and_fresh_flags(module, dtype):
    """_cuda.optim_step advanced Adam's host step counter and cleared SGD's
    fresh-buffer flag before the update was refused (an unknown dtype code)
    or failed to launch (float32 with no device here): a retried step counted
    twice, and SGD accumulated into a momentum buffer it never initialised.
    The CPU binding refuses first; its float32 update runs and changes both."""
    ext = getattr(reprop._native, module)
    if ext is None or (module == "_cuda" and dtype == 0 and reprop._native.cuda_available()):
        pytest.skip(f"reprop.{module} not built, or a device would run the update")
    p, g, m, v, step = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4), torch.zeros(())
    rows = {"adam": (1, [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0, step.data_ptr(), 4, 0],
                     (0.1, 0.0, 1e-8, 0.9, 0.999) + (0.0,) * 5 + (False,) * 5),
            "sgd": (0, [p.data_ptr(), g.data_ptr(), m.data_ptr(), 0, 0, 0, 4, 1],  # flags: fresh buffer
                    (0.1, 0.0, 0.0, 0.0, 0.0, 0.9, 0.5, 0.0, 0.0, 0.0) + (False,) * 5)}
    tables = {}
    for name, (kind, row, hparams) in rows.items():
        tables[name] = np.array([row], np.int64)
        args = (kind, dtype, tables[name], hparams) + ((1,) if module == "_C" else (False, 0, 0))
        if module == "_C" and dtype == 0:
            ext.optim_step(*args)
        else:
            with pytest.raises((ValueError, RuntimeError)):
                ext.optim_step(*args)
    ran = module == "_C" and dtype == 0
    assert step.item() == (1 if ran else 0)
    assert tables["sgd"][0, 7] == (0 if ran else 1)
    assert (p != 1).all() if ran else (p == 1).all()


@pytest.mark.parametrize("module", ["_C", "_cuda"])
def test_binding_docstrings_list_the_arguments_the_binding_takes(module):
    """scan's docstring (both extensions) listed 13 parameters where the
    binding takes 16, _cuda.optim_step's 6 where it takes 7 (lr_ptr)."""
    ext = getattr(reprop._native, module)
    if ext is None:
        pytest.skip(f"reprop.{module} not built")
    checked = 0
    for name in dir(ext):
        func = getattr(ext, name)
        # a "name(...)\n--" docstring becomes __text_signature__, else it starts with name(...)
        listed = re.match(r"\(([^)]*)\)", getattr(func, "__text_signature__", None) or "") or \
            re.match(rf"{name}\(([^)]*)\)", getattr(func, "__doc__", None) or "")
        if listed is None:  # build_info and the module's own attributes
            continue
        params = [p.strip() for p in listed.group(1).split(",")]
        with pytest.raises(TypeError, match=rf"^{name}\(\) takes {len(params)} arguments "):
            func(*[None] * (len(params) + 1))
        checked += 1
    assert checked >= (24 if module == "_C" else 7)


def test_kernels_run_in_a_child_forked_after_a_parallel_region():
    """GNU libgomp keeps the pool of worker threads a parallel region started,
    and a forked child (os.fork, multiprocessing's fork start method) inherits
    it without its threads: every kernel of the core that opened a parallel
    region in such a child (fad, the CPU optimizer step, the scan, the
    Jacobian patterns) waited forever for them. The child now runs them on one
    thread, with the parent's results bit for bit. The child calls only
    reprop's kernels on tensors made before the fork: torch's own parallel
    kernels hang there too (DataLoader's workers call torch.set_num_threads(1))."""
    proc = _run_isolated("""
        import os, signal, time
        import numpy as np
        import torch
        import reprop.fad as fad, reprop.optim as ro, reprop.bppsa as bppsa
        from reprop._native import _C

        torch.set_num_threads(2)  # a pool of two threads even on one core
        torch.manual_seed(0)
        x = torch.randn(1 << 18)
        p = torch.nn.Parameter(torch.randn(1 << 18))
        p.grad = torch.randn(1 << 18)
        opt = ro.AdamW([p], lr=1e-2)
        opt.step()  # the state, made here: torch's zeros_like of it would hang in the child
        T, B, H = 64, 8, 32
        c, w, v = torch.randn(T, B, H), torch.randn(H, H) / H, torch.rand(T, B, H)

        def kernels():
            opt.step()
            return [fad.gelu(x).numpy(), fad.mish(x, saved_dtype=torch.uint8).numpy(),
                    p.detach().numpy().copy(), _C.jacobian("diagonal", (1 << 17, 0))[0],
                    bppsa.scan(c, w=w, v=v, levels="auto").numpy()]

        saved = [p.detach().clone(), {k: t.clone() for k, t in opt.state[p].items()}]
        want = kernels()  # parallel regions in this, the forking, thread
        with torch.no_grad():
            p.copy_(saved[0])
            for k, t in saved[1].items():
                opt.state[p][k].copy_(t)
        pid = os.fork()
        if pid == 0:
            got = kernels()
            os._exit(0 if all(np.array_equal(a, b) for a, b in zip(got, want)) else 3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child exit", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print("child hung")
    """)
    assert proc.returncode == 0 and proc.stdout == "child exit 0\n", (proc.stdout, proc.stderr[-2000:])


# ---- Checks a mutation audit of the bindings and _tensors found untested: each test ----
# ---- below fails on a plausible wrong version of the check it names.              ----

def test_fast_path_reads_a_negative_bit_gradient_as_its_values():
    """A gradient with torch's lazy negative bit (x.conj().imag) holds -g in
    memory. The C fast path of a cached plan (all rows contiguous, so none
    sends the step to the Python path) must not hand that memory to the
    kernels: the update is torch's, from g, at the steps that read the plan
    from the cache as at the one that built it."""
    torch.manual_seed(0)
    init = [torch.randn(4, 3), torch.randn(5)]
    grads = [[torch.randn(4, 3), torch.randn(5)] for _ in range(4)]
    for mine, theirs, kw in [(ro.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                             (ro.Adam, torch.optim.Adam, dict(lr=0.1))]:
        results = []
        for cls in (mine, theirs):
            params = [torch.nn.Parameter(t.clone()) for t in init]
            opt = cls(params, **kw)
            for k, step_grads in enumerate(grads):
                for p, g in zip(params, step_grads):
                    p.grad = (-g)._neg_view() if k >= 2 else g.clone()  # cached from step 1 on
                    assert torch.equal(p.grad, g)
                opt.step()
            results.append([p.detach() for p in params])
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_optim_step_refuses_a_read_only_table():
    """The core writes the table (a new SGD buffer's flag is cleared once
    filled): a read-only array is refused, not written behind NumPy's back."""
    p, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    table = np.zeros((1, 8), np.int64)
    table[0, 0], table[0, 1], table[0, 6] = p.ctypes.data, g.ctypes.data, 4
    table.setflags(write=False)
    hparams = (0.1,) + (0.0,) * 9 + (False,) * 5  # SGD, lr 0.1
    for call in (lambda: _C.optim_step(0, 0, table, hparams, 1),
                 lambda: _C.optim_check(0, 0, table, hparams, False)):
        with pytest.raises(ValueError, match="^table: expected a C-contiguous, aligned, writeable"):
            call()
    assert (p == 1).all()


def test_optim_grad_pointers_refuses_tables_and_step_rows_of_another_length():
    """A table with fewer rows than the lists (the fast path writes one row
    a param), or step_rows of another length than step_table (it reads
    step_rows[k] for each of step_table's rows), is refused."""
    no_grad = [types.SimpleNamespace(grad=None)] * 2
    lists = ([None] * 2, {}, [None] * 2, [None] * 2, [True] * 2, torch.strided)
    table, memory = np.zeros((2, 8), np.int64), np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="^optim_grad_pointers: lists and table differ in length$"):
        _C.optim_grad_pointers(no_grad, *lists, table[:1], None, table[:1], None, torch.Tensor,
                               memory, None)
    for step_rows in (np.zeros(1, np.int64), np.zeros(3, np.int64)):
        with pytest.raises(ValueError, match="^optim_grad_pointers: step_rows must be None"):
            _C.optim_grad_pointers(no_grad, *lists, table, None, table.copy(), step_rows,
                                   torch.Tensor, memory, None)
    # the right lengths: no row has a gradient, none takes part
    assert _C.optim_grad_pointers(no_grad, *lists, table, None, table.copy(),
                                  np.zeros(2, np.int64), torch.Tensor, memory,
                                  None) == ([], [], None)


@pytest.mark.parametrize("value", [2**31, -2**31 - 1, -2**32 + 1])
def test_int32_fields_of_a_task_graph_out_of_int32_are_refused_not_wrapped(value):
    """The int32 fields of sched_graph's spec and simulate's graph are read
    through int64 with a range check on both sides: -2**32 + 1 wrapped
    to 1, a valid stage or task kind, silently."""
    spec = dict(layers=2, micro=1, stages=2, iterations=1, transfer=0.5, order=0, k=0,
                sync_by_layer=False, sub_stream=True, input_grad=False, fwd=[1.0, 1.0],
                out_grad=[1.0, 1.0], weight_grad=[1.0, 1.0], sync=None, stage=[0, 1])
    graph = _C.sched_graph(spec)
    _C.simulate(graph, 1.0)  # (taken as it is)
    with pytest.raises(ValueError, match=rf"^sched_graph: stage\[1\] = {value} does not fit in int32$"):
        _C.sched_graph(dict(spec, stage=np.array([0, value], np.int64)))
    kind = graph["kind"].astype(np.int64)
    kind[0] = value
    with pytest.raises(ValueError, match=rf"^simulate: kind\[0\] = {value} does not fit in int32$"):
        _C.simulate(dict(graph, kind=kind), 1.0)


def test_dtype_code_names_complex_and_other_dtypes():
    assert [_tensors.dtype_code(torch.zeros(1, dtype=d), "x")
            for d in (torch.float32, torch.float16, torch.bfloat16)] == [0, 1, 2]
    with pytest.raises(TypeError, match=r"^x: complex tensors are not supported \(got torch.complex64\)$"):
        _tensors.dtype_code(torch.zeros(1, dtype=torch.complex64), "x")
    with pytest.raises(TypeError, match=r"^x: expected float32, float16 or bfloat16, got torch.float64$"):
        _tensors.dtype_code(torch.zeros(1, dtype=torch.float64), "x")


def test_stored_parts_are_every_tensor_holding_a_sparse_layouts_data():
    """ooo charges a task the storages of stored_parts: a CSR tensor's
    crow_indices, col_indices and values (each compressed layout's three
    arrays, COO's indices and values); None where there is no storage."""
    dense = torch.tensor([[0.0, 1.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's beta warning on sparse tensors)
        coo = dense.to_sparse().coalesce()
        csr, csc = dense.to_sparse_csr(), dense.to_sparse_csc()
        bsr, bsc = dense.to_sparse_bsr((1, 2)), dense.to_sparse_bsc((1, 2))
    want = {torch.strided: [dense], torch.sparse_coo: [coo._indices(), coo._values()],
            torch.sparse_csr: [csr.crow_indices(), csr.col_indices(), csr.values()],
            torch.sparse_csc: [csc.ccol_indices(), csc.row_indices(), csc.values()],
            torch.sparse_bsr: [bsr.crow_indices(), bsr.col_indices(), bsr.values()],
            torch.sparse_bsc: [bsc.ccol_indices(), bsc.row_indices(), bsc.values()]}
    for t in (dense, coo, csr, csc, bsr, bsc):
        got = _tensors.stored_parts(t)
        assert [(x.data_ptr(), x.shape) for x in got] == [(x.data_ptr(), x.shape) for x in want[t.layout]]
    if torch.backends.mkldnn.is_available():
        assert _tensors.stored_parts(dense.to_mkldnn()) is None


def _element_bytes(t: torch.Tensor) -> set:
    """Every byte address an element of t covers, by enumerating its indices."""
    size = t.element_size()
    offsets = {sum(i * s for i, s in zip(index, t.stride()))
               for index in itertools.product(*map(range, t.shape))}
    return {t.data_ptr() + o * size + b for o in offsets for b in range(size)}


def test_dense_span_and_shared_elements_agree_with_the_element_addresses():
    """is_dense, byte_span and shares_elements against each element's
    addresses: a dim of size 1 has no say in density whatever its stride (a
    broadcast's new leading dim has stride 0), a span ends after the last
    element's last byte, tensors side by side share nothing, and the
    transposed column slices of one matrix interleave without sharing (their
    element addresses are not in order)."""
    base = torch.arange(48.0)
    m = base[:24].view(4, 6)
    cases = [m, m.t(), m[:, :3], m[:, 3:], m[:, ::2], m[:, 1::2], m.t()[::2], m.t()[1::2],
             torch.broadcast_to(m.t(), (1, 6, 4)), base.as_strided((4, 1, 3), (1, 100, 4)),
             base.as_strided((2, 3), (3, 1), 24), base[:24].view(1, 2, 3, 4).permute(0, 2, 3, 1),
             base.as_strided((2, 2), (1, 1)), base[:0], m[:, 2:4]]
    for t in cases:
        addresses = _element_bytes(t)
        offsets = sorted({a - t.data_ptr() for a in addresses})
        assert _tensors.is_dense(t) == (offsets == list(range(t.numel() * t.element_size()))), \
            (t.shape, t.stride())
        if t.numel():
            assert _tensors.byte_span(t) == (min(addresses), max(addresses) + 1), (t.shape, t.stride())
    for a, b in itertools.combinations(cases, 2):
        assert _tensors.shares_elements(a, b) == bool(_element_bytes(a) & _element_bytes(b)), \
            (a.shape, a.stride(), b.shape, b.stride())


def test_repeated_dims_are_the_dims_of_size_over_one_with_stride_zero():
    """A stride-0 dim of size 1 (a broadcast's new leading dim) repeats no
    element: optim refuses state that repeats elements, as torch's in-place
    update does, and must not refuse that one, which torch takes."""
    x = torch.zeros(3)
    assert _tensors.repeated_dims(torch.broadcast_to(x, (1, 3))) == []
    assert _tensors.repeated_dims(x.expand(4, 3)) == [0]
    assert _tensors.repeated_dims(torch.broadcast_to(x, (1, 2, 3))) == [1]


def test_without_autocast_turns_it_back_on_when_fn_raises():
    """A backward run by without_autocast inside an autocast region that
    raises (caught by the user's loop) leaves autocast on for the rest of
    the region, as torch.autocast(enabled=False) would."""

    def fails():
        assert not torch.is_autocast_enabled("cpu")
        raise KeyError("inside")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(KeyError, match="inside"):
            _tensors.without_autocast("cpu", fails)
        assert torch.is_autocast_enabled("cpu")
        assert _tensors.without_autocast("cpu", torch.is_autocast_enabled, "cpu") is False
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_suggest_memory_format_is_torchs():
    """suggest_memory_format is c10's, which torch's Python port
    (torch._prims_common) reproduces: every permutation of contiguous and
    channels_last tensors with dims of size 1, and the ambiguous N111
    tensors c10 takes as contiguous."""
    from torch._prims_common import suggest_memory_format as torchs
    cases = [torch.empty(2, 1, 1, 1).as_strided((2, 1, 1, 1), (1, 1, 1, 1)),
             torch.empty(2, 1, 1, 3)[..., :1],
             torch.empty(2, 3, 4, 5).as_strided((2, 3, 4, 5), (60, 0, 15, 3)),
             torch.empty(2, 3, 4, 5, 6).contiguous(memory_format=torch.channels_last_3d)]
    for shape in itertools.product((1, 2), (1, 3), (1, 2), (1, 4)):
        for fmt in (torch.contiguous_format, torch.channels_last):
            base = torch.empty(shape).contiguous(memory_format=fmt)
            cases += [base.permute(perm) for perm in itertools.permutations(range(4))]
    for x in cases:
        assert _tensors.suggest_memory_format(x) == torchs(x), (x.shape, x.stride())


def test_a_c_extension_that_is_there_but_fails_to_load_raises_its_own_error(monkeypatch):
    """_load_core's "not built for this Python" is for a reprop._C that is
    not there; one that is there but fails to load (a missing symbol,
    another NumPy's ABI) raises the loader's own error, which says why."""
    native = reprop._native

    def import_module(name):
        raise ImportError("undefined symbol: rp_optim_step_cpu", name=name)

    monkeypatch.setattr(native, "importlib", types.SimpleNamespace(import_module=import_module))
    with pytest.raises(ImportError, match="^undefined symbol: rp_optim_step_cpu$"):
        native._load_core()

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(native, "importlib", types.SimpleNamespace(import_module=missing))
    with pytest.raises(ImportError, match="^reprop's C extension reprop._C is not built for this Python"):
        native._load_core()


# ---- mutation audit of the scheduler bindings, csrc/pyutil.c (session 38):
# what no other test checked

def _leaked_bytes(call, times: int = 20) -> int:
    """What `times` calls of call() leave allocated, as tracemalloc sees it
    (NumPy reports its data buffers to it): 0 when nothing is kept."""
    call()  # caches, first-use allocations
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(times):
            call()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_scheduling_bindings_keep_no_reference_to_what_they_return():
    """Each array a scheduling binding returns is the caller's alone: a
    reference kept back would leak it once the caller lets it go."""
    graph = _C.sched_graph(_SPEC)
    assert [sys.getrefcount(graph[key]) for key in graph] == [2] * len(graph)  # the dict's, the call's
    start, finish, busy, _ = _C.simulate(graph, 1.0)
    assert (sys.getrefcount(start), sys.getrefcount(finish), sys.getrefcount(busy)) == (2, 2, 2)
    kind, layer, _ = _C.reverse_first_k(4, 2, [1] * 4, [1] * 4, 0, 100)
    assert (sys.getrefcount(kind), sys.getrefcount(layer)) == (2, 2)
    region, order, _, _, held = _C.sched_regions([1.0], [0.0], [1], [[1.0]], [[1.0]], [1], 5, None,
                                                 None, None)
    assert (sys.getrefcount(region), sys.getrefcount(order), sys.getrefcount(held)) == (2, 2, 2)
    stage = _C.sched_stages(4, 2, 1)
    assert sys.getrefcount(stage) == 2


def test_scheduling_bindings_free_the_copies_they_make():
    """sched_regions copies mem and sched_graph copies stage (the core checks
    them, then uses them without the GIL): each copy must go with the call.
    100000 int64 sizes copied 20 times would keep 16 MB."""
    k = 10**5
    mem, t = np.ones(k, np.int64), np.ones((k, 1))
    assert _leaked_bytes(lambda: _C.sched_regions(np.ones(1), np.zeros(k), np.ones(k, np.int64),
                                                  t, t, mem, -1, None, None, None)) < 10**6
    spec = dict(_SPEC, layers=k, stages=1, micro=1, fwd=np.ones(k), out_grad=np.ones(k),
                weight_grad=np.ones(k), stage=np.zeros(k, np.int64))
    assert _leaked_bytes(lambda: _C.sched_graph(spec)) < 10**6


def test_sched_regions_holds_a_storage_several_tasks_read_once():
    """The storages several tasks read (shared_size, shared_start,
    shared_task: all three arrays or all None) are held once, at a region end where
    every reader is ready and one runs later: tasks A, B, C of 100 B each
    read one 300 B storage, A alone moves to region 1 and holds 400 B there
    (its 100 B without the storage). A last start that is not the length of
    shared_task is refused before the core reads the readers up to it, the
    arrays the binding copies go with the call, and 8 arguments are refused
    (it takes 10, as every binding a fixed number)."""
    args = ([2.0, 2.0], [0.0] * 3, [2] * 3, np.full((3, 2), 0.1),
            [[0.1, 0.9], [0.9, 0.1], [0.9, 0.1]], [100] * 3, -1)
    region, _, pre, peak, held = _C.sched_regions(*args, [300], [0, 3], [0, 1, 2])
    assert region.tolist() == [1, 0, 0] and (pre, peak) == (0, 400) and held.tolist() == [400, 0]
    assert _C.sched_regions(*args, None, None, None)[3] == 100
    with pytest.raises(ValueError, match=r"^sched_regions\(\): shared_start\[-1\] = 4 must be "
                                         r"len\(shared_task\) = 3$"):
        _C.sched_regions(*args, [300], [0, 4], [0, 1, 2])
    with pytest.raises(ValueError, match=r"shared task\[2\] = 3 is outside \[0, 3\)"):
        _C.sched_regions(*args, [300], [0, 3], [0, 1, 3])
    with pytest.raises(TypeError, match=r"takes 10 arguments \(8 given\)"):
        _C.sched_regions(*args, [300])
    k = 10**5
    assert _leaked_bytes(lambda: _C.sched_regions(*args, np.ones(k, np.int64),
                                                  np.arange(k + 1, dtype=np.int64),
                                                  np.zeros(k, np.int64))) < 10**6


def test_simulate_refuses_a_dep_ptr_of_another_length():
    """dep_ptr has one entry per task and one more: the core reads exactly
    n_tasks + 1 of it, so a longer one was silently cut (a shorter one read
    past its end)."""
    graph = _C.sched_graph(_SPEC)
    n = len(graph["kind"])
    longer = np.append(graph["dep_ptr"], graph["dep_ptr"][-1])
    with pytest.raises(ValueError, match=rf"^simulate: dep_ptr must have {n + 1} elements along axis 0 "
                                         rf"\(got {n + 2}\)$"):
        _C.simulate(dict(graph, dep_ptr=longer), 1.0)


def test_simulate_names_a_corun_rate_that_is_not_a_number():
    """A corun_rate Python cannot make a float of raises its TypeError named,
    not whatever the core's check of the -1.0 it was read as would say."""
    graph = _C.sched_graph(_SPEC)
    with pytest.raises(TypeError, match="^simulate: corun_rate: must be real number, not str$"):
        _C.simulate(graph, "0.5")


def test_simulate_and_sched_regions_release_the_gil_around_their_work():
    """module.c says each scheduling binding releases the GIL around the
    core's work; simulate and sched_regions were not tested for it. NumPy
    releases it too while it copies an array of over 500 elements, as
    simulate does with each of a graph's int arrays: the waiter is armed by
    the graph's last entry, read after those copies (sched_regions' copy of
    400 deadlines stays under NumPy's threshold)."""
    layers = 2000
    graph = _C.sched_graph(dict(_SPEC, layers=layers, micro=8, stages=4, iterations=2, order=1,
                                fwd=np.ones(layers), out_grad=np.ones(layers),
                                weight_grad=np.ones(layers),
                                stage=np.arange(layers, dtype=np.int32) % 4))
    group = graph["group"].tolist()

    class ArmingGroup:  # the waiter starts waiting for the GIL as simulate reads "group"
        __slots__ = ("arm",)

        def __init__(self, arm):
            self.arm = arm

        def __len__(self):
            self.arm()
            return len(group)

        def __getitem__(self, i):
            return group[i]

    assert _lets_another_thread_run(lambda arm: _C.simulate(dict(graph, group=ArmingGroup(arm)), 1.0),
                                    armed_by_call=True)
    n, k = 2000, 400  # made before the call: NumPy releases the GIL filling them too
    args = (np.ones(n), np.zeros(k), np.full(k, n, np.int64), np.full((k, n), 0.01),
            np.random.default_rng(0).random((k, n)), None, -1, None, None, None)
    assert _lets_another_thread_run(lambda: _C.sched_regions(*args))


def test_scheduling_bindings_refuse_keyword_arguments():
    """The bindings take their arguments by position only (METH_FASTCALL): a
    keyword one reads as nothing, so it must be refused, not silently
    dropped after the positional ones."""
    graph = _C.sched_graph(_SPEC)
    calls = [lambda: _C.sched_stages(4, 2, 1, group=2), lambda: _C.simulate(graph, 1.0, corun_rate=0.5),
             lambda: _C.sched_graph(_SPEC, spec=_SPEC), lambda: _C.ksearch_next(4, [0.0] * 5, layers=4),
             lambda: _C.reverse_first_k(4, 2, None, None, 0, 0, k=1),
             lambda: _C.sched_regions([1.0], [0.0], [1], [[1.0]], [[1.0]], None, -1, None, None,
                                      None, mem_cap=5)]
    for call in calls:
        with pytest.raises(TypeError, match="takes no keyword arguments$"):
            call()


# ---- C mutation audit of the optimizer core (optim_step, optim_check and the ----
# ---- fast path's argument checks): each test below fails on a plausible     ----
# ---- wrong version of the line it names.                                     ----

_SGD_HPARAMS = (0.1,) + (0.0,) * 9 + (False,) * 5  # SGD, lr 0.1


def _sgd_table(p: np.ndarray, g: np.ndarray) -> np.ndarray:
    """One row updating float32 p from g (param, grad, numel)."""
    table = np.zeros((1, 8), np.int64)
    table[0, 0], table[0, 1], table[0, 6] = p.ctypes.data, g.ctypes.data, p.size
    return table


def test_optim_step_releases_the_gil_around_the_update():
    """module.c's optim_step runs the update without the GIL (the fused
    backward steps a module while other threads run Python): a version that
    kept it stalled every other thread for the whole update. Eight updates
    a try: under a load of 15 on 2 cores, one 10 ms update a try left the
    waiting thread unscheduled in all ten tries about one run in four."""
    p, g = np.ones(1 << 23, np.float32), np.full(1 << 23, 0.5, np.float32)
    table = _sgd_table(p, g)
    assert _lets_another_thread_run(lambda: [_C.optim_step(0, 0, table, _SGD_HPARAMS, 1) for _ in range(8)])
    assert p[0] < 1 and p[-1] < 1


def test_optim_step_and_check_release_the_table_they_hold():
    """Both bindings hold the table while they read it and release it after,
    whether the update runs or is refused: a missing Py_DECREF leaked every
    table (one a step) for good."""
    p, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    table = _sgd_table(p, g)
    refused = (1e300,) + _SGD_HPARAMS[1:]  # lr beyond float32: ValueError
    before = sys.getrefcount(table)
    for _ in range(3):
        _C.optim_step(0, 0, table, _SGD_HPARAMS, 1)
        _C.optim_check(0, 0, table, _SGD_HPARAMS, False)
        for call in (_C.optim_step, _C.optim_check):
            with pytest.raises(ValueError, match="^lr: -lr = -1e\\+300"):
                call(0, 0, table, refused, 1)
    assert sys.getrefcount(table) == before
    np.testing.assert_allclose(p, 1 - 3 * 0.05, rtol=1e-6)


def test_optim_check_raises_the_error_of_bool_capturable():
    """optim_check takes bool(capturable) first: an object whose __bool__
    raises has that error raised, not a SystemError for a result returned
    with an exception set (the core went on, taking -1 as True)."""
    class Refused(Exception):
        pass

    class NoTruth:
        def __bool__(self):
            raise Refused("no truth value")

    table = np.zeros((0, 8), np.int64)
    with pytest.raises(Refused, match="^no truth value$"):
        _C.optim_check(0, 0, table, _SGD_HPARAMS, NoTruth())


@pytest.mark.parametrize("shape", [(1, 7), (0, 9), (2, 16)])
def test_a_table_whose_rows_are_not_8_int64_is_refused(shape):
    """The core reads each row as an rp_optim_entry of 8 int64: a table of
    another width is refused by every binding that reads one, not read with
    the wrong row stride (past the end of a 7-wide one)."""
    table = np.zeros(shape, np.int64)
    width = "^table: expected an int64 array of shape \\(n, 8\\)$"
    with pytest.raises(ValueError, match=width):
        _C.optim_step(0, 0, table, _SGD_HPARAMS, 1)
    with pytest.raises(ValueError, match=width):
        _C.optim_check(0, 0, table, _SGD_HPARAMS, False)
    n = shape[0]
    with pytest.raises(ValueError, match=width):
        _C.optim_grad_pointers([types.SimpleNamespace(grad=None)] * n, [None] * n, {}, [None] * n,
                               [None] * n, [True] * n, torch.strided, table, None, table, None,
                               torch.Tensor, np.zeros(0, np.int64), None)


def test_optim_grad_pointers_refuses_odd_memory_and_step_tables_longer_than_the_table():
    """memory holds [start, end) pairs: an odd length is refused, not read
    as one pair fewer. A step table with more rows than the table (and
    step_rows as long as it) is refused: the rows of the last step are some
    of this table's."""
    no_grad = [types.SimpleNamespace(grad=None)] * 2
    lists = ([None] * 2, {}, [None] * 2, [None] * 2, [True] * 2, torch.strided)
    table, memory = np.zeros((2, 8), np.int64), np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="^optim_grad_pointers: memory must be a C-contiguous 1-D "
                                         "int64 array of \\[start, end\\) pairs"):
        _C.optim_grad_pointers(no_grad, *lists, table, None, table, None, torch.Tensor, memory[:1],
                               None)
    with pytest.raises(ValueError, match="^optim_grad_pointers: step_rows must be None"):
        _C.optim_grad_pointers(no_grad, *lists, table, None, np.zeros((3, 8), np.int64),
                               np.arange(3, dtype=np.int64), torch.Tensor, memory, None)
    assert _C.optim_grad_pointers(no_grad, *lists, table, None, table, None, torch.Tensor,
                                  memory, None) == ([], [], None)


def test_more_rows_taking_part_than_last_step_leave_memory_past_the_step_table_alone():
    """Both rows have a gradient where only row 0 took part last step (a
    step table of one row, step_rows [0]): row 1 is listed for a new step
    table, and nothing past the one-row step table or its step_rows is read
    or written. A version that looked up step_rows[1] found the 1 lying
    past it here and wrote row 1's gradient past the step table."""
    params = [torch.zeros(2), torch.zeros(2)]
    for p in params:
        p.grad = torch.ones(2)
    table = np.zeros((2, 8), np.int64)
    for i, p in enumerate(params):
        table[i, 0], table[i, 6] = p.data_ptr(), p.numel()
    keys = [ro._layout_key(p) for p in params]
    beyond = np.zeros((2, 8), np.int64)  # the step table is its first row
    step_rows = np.arange(2, dtype=np.int64)  # [0], with a 1 past its end
    held, rows, _ = _C.optim_grad_pointers(
        params, keys, {}, [None] * 2, [()] * 2, [True] * 2, torch.strided, table, None,
        beyond[:1], step_rows[:1], torch.Tensor, np.zeros(0, np.int64), None)
    assert rows == [0, 1] and [g is p.grad for g, p in zip(held, params)] == [True, True]
    assert list(table[:, 1]) == [p.grad.data_ptr() for p in params]
    assert beyond[0, 1] == params[0].grad.data_ptr()
    assert not beyond[1].any()


# ---------------------------------------------------------------------------
# Mutation audit (mut_scan): binding checks of the scan and the sparse chain
# that no other test reached
# ---------------------------------------------------------------------------

def test_scan_plan_checks_sizes_as_the_other_scan_entry_points():
    """scan_plan refuses sizes the scan refuses (n < 1, dim < 1, gates < 0)
    with the core's message; without its check it answered (0, 0) for n = 0."""
    for args, what in [((0, 1, 1, 1), "need n >= 1"), ((8, 1, 0, 1), "need n >= 1"),
                       ((8, 1, 1, -1), "gates must be >= 0")]:
        with pytest.raises(ValueError, match=what):
            _C.scan_plan(*args, 1.0, 0.0, 0.0)
    assert _C.scan_plan(8, 1, 1, 1, 1.0, 0.0, 0.0)[1] == 3


def test_csr_gradients_takes_exactly_one_pointer_per_layer():
    """csr_gradients' out must hold one pointer per layer: one more is
    refused as one fewer is (a check for too few only let a stray extra
    pointer pass unnoticed), and the right count copies each layer's
    gradient out of seq (batch-minor) batch-major."""
    leaf = (2, 2, np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), False, None, 2)
    plan = _C.csr_plan([leaf, leaf], 0, 0, 1.0, 1.0, 1.0)
    g_addr = _C.csr_program(plan)["g_addr"]
    batch = 3
    seq = np.arange(_C.csr_plan_info(plan)["seq_floats"] * batch, dtype=np.float32)
    out = [np.zeros((batch, 2), np.float32) for _ in range(2)]
    ptrs = [o.ctypes.data for o in out]
    for wrong in (ptrs[:1], ptrs + [ptrs[0]]):
        with pytest.raises(ValueError, match=rf"^out: expected 2 data pointers \(one per layer\), got {len(wrong)}$"):
            _C.csr_gradients(plan, batch, seq.ctypes.data, wrong, 1)
    assert _C.csr_gradients(plan, batch, seq.ctypes.data, ptrs, 1) is True
    for i, o in enumerate(out):
        want = seq.reshape(-1, batch)[g_addr[i]:g_addr[i] + 2].T
        np.testing.assert_array_equal(o, want)


# ---- mutation audit of the binding layer, csrc/pyutil.c and module.c (session 41):   ----
# ---- the references and memory each call takes it must give back, on every path.    ----

def test_a_bad_argument_error_leaks_nothing_of_the_error_it_replaces():
    """rp_py_prefix_error re-raises a bad argument's error with the
    argument's name in front and releases the original exception: keeping
    its value leaked an exception object (about 200 bytes) on every refused
    call."""
    def refused():
        try:
            _C.scan_workspace(None, 1, 1, 0)
        except TypeError as exc:
            assert str(exc).startswith("n: ")
    assert _leaked_bytes(refused, times=10**4) < 10**5


def test_optim_hparams_and_call_key_give_back_the_references_they_take():
    """optim_hparams hands back True/False for each flag in its tuple and
    releases the betas it read; optim_call_key releases the sequence it read
    the ids from. A missing Py_INCREF of a flag took a reference from True on
    every call (until the interpreter frees True), a missing Py_DECREF kept
    the betas or the params list alive for good."""
    betas, params = (0.9, 0.999), [torch.zeros(1), torch.zeros(1)]
    group = {"lr": 0.1, "betas": betas, "eps": 1e-8, "weight_decay": 0.0, "nesterov": True,
             "maximize": False, "amsgrad": 1, "decoupled_weight_decay": None, "centered": 0.0}
    want = (0.1, 0.0, 1e-8, 0.9, 0.999, 0.0, 0.0, 0.0, 0.0, 0.0, True, False, True, False, False, 0)
    assert _C.optim_hparams(group) == want
    before = [sys.getrefcount(x) for x in (True, False, betas, params)]
    for _ in range(1000):
        _C.optim_hparams(group)
        _C.optim_call_key(params)
    after = [sys.getrefcount(x) for x in (True, False, betas, params)]
    assert [abs(a - b) < 100 for a, b in zip(after, before)] == [True] * 4, (before, after)


def _fast_path_args(params):
    """optim_grad_pointers' arguments for params with gradients and no state."""
    table = np.zeros((len(params), 8), np.int64)
    for i, p in enumerate(params):
        table[i, 0], table[i, 6] = p.data_ptr(), p.numel()
    n = len(params)
    return (params, [ro._layout_key(p) for p in params], {}, [None] * n, [()] * n, [True] * n,
            torch.strided, table, None, table, None, torch.Tensor, np.zeros(0, np.int64), None)


def test_optim_grad_pointers_gives_back_the_attributes_it_reads():
    """The fast path compares each param's and gradient's dtype, shape,
    layout... with the key: every attribute it reads must be released (a
    missing Py_DECREF kept torch.float32 one reference more per row and
    step, and a torch.Size per row and step for good)."""
    params = [torch.zeros(3), torch.zeros(3)]
    for p in params:
        p.grad = torch.ones(3)
    args = _fast_path_args(params)
    held, rows, _ = _C.optim_grad_pointers(*args)
    assert rows is None and [g is p.grad for g, p in zip(held, params)] == [True, True]
    before = sys.getrefcount(torch.float32), sys.getrefcount(torch.strided)
    for _ in range(1000):
        _C.optim_grad_pointers(*args)
    after = sys.getrefcount(torch.float32), sys.getrefcount(torch.strided)
    assert after == before


def test_the_error_paths_of_the_bppsa_and_scheduling_bindings_free_what_they_took():
    """csr_plan copies the leaves into a tuple and an array of patterns,
    csr_gradients reads its pointers through a sequence, sched_graph makes a
    str per key it looks up, ksearch_next converts the scores: each must go
    with the call, refused or not (a missing free or Py_DECREF kept them all
    for good: 10000 refused csr_plan calls would keep a few MB)."""
    leaf = (2, 2, np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), False, None, 2)
    bad = (2, 2, np.array([0, 1], np.int32), np.array([0, 1], np.int32), False, None, 2)

    def refused_plan():
        with pytest.raises(ValueError, match=r"^leaves\[1\]: indptr: "):
            _C.csr_plan([leaf, bad], 0, 0, 1.0, 1.0, 1.0)
    assert _leaked_bytes(refused_plan, times=2000) < 10**5
    assert _leaked_bytes(lambda: _C.sched_graph(_SPEC), times=500) < 10**5
    assert _leaked_bytes(lambda: _C.ksearch_next(1000, [math.nan] * 1001), times=200) < 10**5
    plan = _C.csr_plan([leaf, leaf], 0, 0, 1.0, 1.0, 1.0)
    seq = np.zeros(_C.csr_plan_info(plan)["seq_floats"], np.float32)
    outs = [np.zeros(2, np.float32), np.zeros(2, np.float32)]
    ptrs = [o.ctypes.data for o in outs]
    before = sys.getrefcount(ptrs)
    for _ in range(100):
        assert _C.csr_gradients(plan, 1, seq.ctypes.data, ptrs, 1) is True
    assert sys.getrefcount(ptrs) == before


def test_optim_hparams_leaves_to_python_what_it_cannot_pass_on_as_it_is():
    """The C hparams tuple takes exact dicts, betas of exactly two items and
    ints of 64 bits; anything else is left to Python's _hparams_of (None),
    which refuses or converts it as torch does, rather than read a dict
    subclass's items past its own lookup, cut betas (0.9, 0.99, 0.5) to two,
    or hand PyArg_ParseTuple an int that overflows a double's exact range."""
    group = {"lr": 0.1, "betas": (0.9, 0.99)}
    assert _C.optim_hparams(group)[:5] == (0.1, 0.0, 0.0, 0.9, 0.99)
    assert _C.optim_hparams(collections.OrderedDict(group)) is None
    assert _C.optim_hparams(dict(group, betas=(0.9, 0.99, 0.5))) is None
    assert _C.optim_hparams(dict(group, lr=2**63)) is None
    assert _C.optim_hparams(dict(group, lr=2**63 - 1))[0] == 2**63 - 1


def test_int_arguments_take_the_whole_int_range_and_exactly_their_count():
    """An int argument takes every C int, INT_MAX too (here an unknown
    activation kind, which the core refuses with its own ValueError), and
    2**31 is an OverflowError naming it; a binding given one argument too
    many refuses the call rather than ignore the extra one. fad_codebook
    raises the core's refusal instead of returning an uninitialised
    codebook."""
    with pytest.raises(ValueError):
        _C.fad_codebook(2**31 - 1, 0.0, 0.0)
    with pytest.raises(OverflowError, match=r"^kind: expected an int in \[-2147483648, 2147483647\], "
                                            r"got 2147483648$"):
        _C.fad_codebook(2**31, 0.0, 0.0)
    with pytest.raises(TypeError, match=r"^fad_codebook\(\) takes 3 arguments \(4 given\)$"):
        _C.fad_codebook(0, 0.0, 0.0, 0)


def test_optim_grad_pointers_raises_the_errors_of_its_lookups():
    """A param missing from `given` raises KeyError as given[id(p)] does
    (not a SystemError for an error return with no exception set), and an
    error raised while the state dict is searched (a key's __eq__) is
    raised, not taken for a param without state."""
    p = torch.zeros(2)
    p.grad = torch.ones(2)
    args = list(_fast_path_args([p]))
    args[8] = {}  # given: no gradient for p
    with pytest.raises(KeyError):
        _C.optim_grad_pointers(*args)

    class Clash:
        def __hash__(self):
            return hash(p)

        def __eq__(self, other):
            raise LookupError("no comparing")

    args = list(_fast_path_args([p]))
    args[2] = {Clash(): {}}
    with pytest.raises(LookupError, match="^no comparing$"):
        _C.optim_grad_pointers(*args)


def test_optim_grad_pointers_sends_a_moved_param_or_a_gradient_on_another_device_to_python():
    """A row is current only for the param memory and device its key
    recorded: a param whose .data now lies elsewhere (same dtype and shape)
    or a gradient on another device than the key's (a CPU gradient for a
    cuda:0 param) leaves the step to the Python path (None), where a version
    without the address check updated the old memory, one without the
    device check handed the kernels a host pointer."""
    p = torch.zeros(2)
    p.grad = torch.ones(2)
    args = _fast_path_args([p])
    assert _C.optim_grad_pointers(*args) is not None
    p.data = torch.zeros(2)
    assert _C.optim_grad_pointers(*args) is None
    args = list(_fast_path_args([p]))
    key = args[1][0]
    args[1] = [key[:4] + (0,) + key[5:]]  # as if p were on cuda:0
    assert _C.optim_grad_pointers(*args) is None


def test_optim_grad_pointers_sends_a_moved_or_reshaped_state_tensor_to_python():
    """A watched state tensor must still lie at the address in its column
    and be of the param's shape: one whose memory moved (.data replaced) or
    that was reshaped in place at the same address (as_strided_ to fewer
    elements) leaves the step to the Python path (None), where a version
    without either check had the kernels write the param's numel floats at
    the old address or past the tensor's elements."""
    p = torch.zeros(4)
    p.grad = torch.ones(4)
    exp_avg = torch.zeros(4)
    args = list(_fast_path_args([p]))
    st = {"exp_avg": exp_avg}
    args[2], args[3], args[4] = {p: st}, [st], [(("exp_avg", exp_avg, 2),)]
    table = args[7]
    table[0, 2] = exp_avg.data_ptr()
    assert _C.optim_grad_pointers(*args) is not None
    table[0, 2] += 4  # the row points one float past the tensor
    assert _C.optim_grad_pointers(*args) is None
    table[0, 2] -= 4
    exp_avg.as_strided_((2,), (1,))  # same address, two elements
    assert _C.optim_grad_pointers(*args) is None


def test_a_gradient_of_a_param_with_gaps_meets_the_call_memory_over_all_its_bytes():
    """For a param with gaps (a column slice) the gradient's extent is numel
    times the dtype's itemsize: call memory starting at its second float
    overlaps it and sends the step to the Python path (None), where a version
    counting numel bytes saw no overlap and let the kernels read a gradient
    they write."""
    p = torch.zeros(2, 2)[:, 0]
    g = torch.ones(2)
    args = list(_fast_path_args([p]))
    args[8] = {id(p): g}
    assert _C.optim_grad_pointers(*args) is not None
    args[12] = np.array([g.data_ptr() + 4, g.data_ptr() + 8], np.int64)
    assert _C.optim_grad_pointers(*args) is None


def test_fad_backward_mixed16_releases_the_gil_and_multiplies_as_torch():
    """fad_backward_mixed16 (reprop._C alone) runs without the GIL as
    module.c says, which the GIL test of the other fad bindings left out;
    its product is torch's grad * d (float32) rounded to grad's dtype."""
    n = 1 << 22
    grad = torch.randn(n).to(torch.float16)
    d = torch.rand(n).to(torch.bfloat16)
    out = torch.empty_like(grad)
    code = _tensors.DTYPE_CODES[torch.float16]
    call = lambda: _C.fad_backward_mixed16(code, grad.data_ptr(), d.data_ptr(), out.data_ptr(), n, 1)  # noqa: E731
    assert _lets_another_thread_run(lambda: [call() for _ in range(8)])
    torch.testing.assert_close(out, (grad * d).to(torch.float16), rtol=1e-3, atol=0)


def test_optim_grad_pointers_sends_a_param_relaid_at_its_address_to_python():
    """A param's layout is part of its row: one whose .data became its own
    transpose (same address, dtype and shape, no longer contiguous) leaves
    the step to the Python path (None), where a version without the layout
    check had the kernels pair its elements with the gradient's in the old
    order."""
    p = torch.arange(4.0).reshape(2, 2)
    p.grad = torch.ones(2, 2)
    args = _fast_path_args([p])
    assert _C.optim_grad_pointers(*args) is not None
    p.data = p.data.t()
    assert _C.optim_grad_pointers(*args) is None


@pytest.mark.parametrize("shape", [(1, 8, 1), (8,)])
def test_a_table_of_another_ndim_is_refused(shape):
    """The table is 2-D: a (1, 8, 1) one has 8 columns too, and a 1-D one
    has no second dimension to read, so only the ndim check refuses them
    before the core reads rows at the wrong stride."""
    table = np.zeros(shape, np.int64)
    with pytest.raises(ValueError, match="^table: expected an int64 array of shape \\(n, 8\\)$"):
        _C.optim_step(0, 0, table, _SGD_HPARAMS, 1)


def test_optim_grad_pointers_checks_every_list_length_and_watched_column():
    """grad_contiguous is one of the lists with an item per row: a shorter
    one is refused as the others are. A watched column is one of the row's 8:
    column 8 is refused as stale (None), where a version bounding it by the
    row's 64 bytes read row 8 past the row, here the next row's param
    pointer, which the watched tensor (that param) matched."""
    params = [torch.zeros(2), torch.zeros(2)]
    for p in params:
        p.grad = torch.ones(2)
    args = list(_fast_path_args(params))
    args[5] = [True]
    with pytest.raises(ValueError, match="^optim_grad_pointers: lists and table differ in length$"):
        _C.optim_grad_pointers(*args)
    args = list(_fast_path_args(params))
    st = {"exp_avg": params[1]}
    args[2], args[3], args[4] = {params[0]: st}, [st, None], [(("exp_avg", params[1], 8),), ()]
    assert _C.optim_grad_pointers(*args) is None


def test_bindings_refuse_arguments_of_the_wrong_kind_with_a_named_error():
    """A list geometry is a TypeError naming it (PyArg_ParseTuple alone
    raised SystemError); a float spec int is refused, not truncated; a float
    flag is refused, not taken for its truth; a 2-D fwd is refused, not read
    as its first row."""
    with pytest.raises(TypeError, match="^geometry: expected a tuple, got list$"):
        _C.jacobian("linear", [2, 3])
    with pytest.raises(TypeError, match="^sched_graph: micro: "):
        _C.sched_graph({**_SPEC, "micro": 2.5})
    with pytest.raises(TypeError, match="^sched_graph: sub_stream must be a bool \\(got float\\)$"):
        _C.sched_graph({**_SPEC, "sub_stream": 1.0})
    with pytest.raises(ValueError, match="^sched_graph: fwd must be 1-D \\(got 2-D\\)$"):
        _C.sched_graph({**_SPEC, "fwd": [[1.0] * 4] * 2})


# ---- mutation audit of the binding layer, csrc/pyutil.c and module.c (session 42): ----
# ---- each test below fails on a plausible wrong version of the line it names.       ----

def test_a_core_failure_that_is_no_bad_argument_is_a_runtime_error():
    """rp_py_raise maps the core's RP_EINVAL to ValueError and any other
    status to RuntimeError: here the core's out-of-memory refusal (2**62
    elements are 2**47 chunks of 24 bytes, 3 PB, more than any address space
    or RAM holds, so malloc fails before the update reads anything). A version
    raising ValueError for every status would pass a failure of the machine
    off as the caller's bad argument."""
    p, g = np.ones(1, np.float32), np.full(1, 0.5, np.float32)
    table = _sgd_table(p, g)
    table[0, 6] = 2**62
    with pytest.raises(RuntimeError, match=r"^out of memory for 140737488355328 chunks$"):
        _C.optim_step(0, 0, table, _SGD_HPARAMS, 1)
    assert p[0] == 1.0


def test_a_task_graph_array_of_floats_is_refused_not_truncated():
    """rp_py_array casts by NumPy's safe rule (only an empty array, which
    reads as float64, is cast freely): a stage of 1.5 is a TypeError naming
    the entry, where a forced cast made it device 1."""
    with pytest.raises(TypeError, match=r"^sched_graph: stage: Cannot cast array data from "
                                        r"dtype\('float64'\) to dtype\('int64'\)"):
        _C.sched_graph({**_SPEC, "stage": [0.0, 0.0, 1.5, 1.0]})


def test_a_refused_task_graph_array_is_released():
    """An array rp_py_array refuses for its shape is released: NumPy hands a
    float64 fwd back as it is, so a missing Py_DECREF kept one reference to
    the caller's array per refused call, and it was never freed."""
    fwd = np.ones(5)
    before = sys.getrefcount(fwd)
    for _ in range(100):
        with pytest.raises(ValueError, match=r"^sched_graph: fwd must have 4 elements along axis 0 "
                                             r"\(got 5\)$"):
            _C.sched_graph({**_SPEC, "fwd": fwd})
    assert sys.getrefcount(fwd) == before


def test_build_info_says_the_core_was_built_with_openmp():
    """setup.py compiles and links the core with -fopenmp on every platform,
    so build_info()["openmp"] is True and the default thread count OpenMP's
    (at least 1). An inverted flag told `python -m reprop` that the OpenMP
    build ran single-threaded."""
    info = _C.build_info()
    assert info["openmp"] is True and info["omp_max_threads"] >= 1


def test_an_arguments_own_value_error_is_named_too():
    """rp_py_prefix_error names the argument in front of a TypeError, an
    OverflowError and a ValueError alike: NumPy's ValueError for a ragged
    fwd was raised bare."""
    with pytest.raises(ValueError, match=r"^sched_graph: fwd: setting an array element with a sequence"):
        _C.sched_graph({**_SPEC, "fwd": [[1.0], [1.0, 2.0], [1.0], [1.0]]})


def test_a_named_error_raised_by_python_code_releases_its_traceback():
    """An argument's error raised in Python code (__index__) carries a
    traceback, which holds the frame and so the argument: the named error
    replacing it must release it, or each refused call kept the argument."""
    class NoIndex:
        def __index__(self):
            raise TypeError("no index")
    bad = NoIndex()
    before = sys.getrefcount(bad)
    for _ in range(100):
        with pytest.raises(TypeError, match="^layers: no index$"):
            _C.sched_stages(bad, 1, 1)
    assert sys.getrefcount(bad) == before


def test_optim_step_refuses_an_int32_table_and_hparams_of_another_type():
    """The table is int64: an int32 one of 8 columns holds half a row per
    row, which the core read as pointers. The hparams are a tuple: a list
    is a TypeError naming it (PyArg_ParseTuple alone raised SystemError)."""
    with pytest.raises(ValueError, match=r"^table: expected an int64 array of shape \(n, 8\)$"):
        _C.optim_step(0, 0, np.zeros((1, 8), np.int32), _SGD_HPARAMS, 1)
    with pytest.raises(TypeError, match="^hparams: expected a tuple$"):
        _C.optim_step(0, 0, np.zeros((0, 8), np.int64), list(_SGD_HPARAMS), 1)


def test_optim_grad_pointers_finds_tensors_for_a_layout_guard_and_leaves_rows_to_it():
    """Asked for them (guard True), the fast path reports the tensors it found
    right, each row's param, state tensors but step counts and gradient; given
    a guard, it reads the same gradients leaving the layouts to it, the
    guard called once with those tensors; where the guard refuses or raises,
    it looks at each row itself and reports False, and a stale row stays
    stale. No reference is kept."""
    params = [torch.zeros(3), torch.zeros(2)]
    for p in params:
        p.grad = torch.ones_like(p)
    args = list(_fast_path_args(params))
    args[-1] = True
    held, rows, checked = _C.optim_grad_pointers(*args)
    assert rows is None and checked == (params[0], params[0].grad, params[1], params[1].grad)
    calls = []
    for vouches in (True, False):
        args[-1] = lambda *tensors, vouches=vouches: calls.append(tensors == checked) or vouches
        before = [sys.getrefcount(x) for x in params + held]
        reads = [_C.optim_grad_pointers(*args) for _ in range(100)]
        assert reads == [(held, None, None if vouches else False)] * 100
        del reads
        assert [sys.getrefcount(x) for x in params + held] == before
    assert calls == [True] * 200
    # a gradient the light look cannot read (sparse: no data pointer) is left
    # to the full look, which refuses its layout first: stale, not an error;
    # as is a guard that raises
    params[1].grad = params[1].grad.to_sparse()
    assert _C.optim_grad_pointers(*args) is None and len(calls) == 200
    params[1].grad = held[1]
    args[-1] = lambda *tensors: 1 / 0
    assert _C.optim_grad_pointers(*args) == (held, None, False)
    args[1] = [(1,) + args[1][0][1:], args[1][1]]  # row 0's param elsewhere: stale
    assert _C.optim_grad_pointers(*args) is None

def _one_param_fast_path():
    """A param with a gradient and optim_grad_pointers' arguments for it."""
    p = torch.zeros(2)
    p.grad = torch.ones(2)
    return p, list(_fast_path_args([p]))


def test_optim_grad_pointers_raises_the_error_of_a_malformed_key_or_column():
    """A key address or a watched column Python cannot read as an int raises
    its own error, not a SystemError for a result (None, the row taken for
    stale) returned with the exception set."""
    p, args = _one_param_fast_path()
    args[1] = [(-1,) + args[1][0][1:]]
    with pytest.raises(OverflowError, match="^can't convert negative int to unsigned$"):
        _C.optim_grad_pointers(*args)
    p, args = _one_param_fast_path()
    exp_avg = torch.zeros(2)
    st = {"exp_avg": exp_avg}
    args[2], args[3], args[4] = {p: st}, [st], [(("exp_avg", exp_avg, "2"),)]
    with pytest.raises(TypeError, match="^'str' object cannot be interpreted as an integer$"):
        _C.optim_grad_pointers(*args)


def test_optim_grad_pointers_skips_a_param_without_gradient_and_leaves_a_non_contiguous_row():
    """A param without a gradient sits the step out (its row is not listed),
    as torch skips it; the others still take the fast path. A row whose
    grad_contiguous is False goes to the Python path (None)."""
    params = [torch.zeros(2), torch.zeros(2)]
    params[1].grad = torch.ones(2)
    held, rows, _ = _C.optim_grad_pointers(*_fast_path_args(params))
    assert held == [params[1].grad] and rows == [1]
    p, args = _one_param_fast_path()
    args[5] = [False]
    assert _C.optim_grad_pointers(*args) is None


def test_optim_grad_pointers_refuses_given_of_another_type_and_a_step_table_without_rows():
    """given is None or a dict (a list reached PyDict_GetItemWithError, a
    SystemError); a step table other than the table comes with its
    step_rows, else the rows it holds are unknown."""
    p, args = _one_param_fast_path()
    args[8] = []
    with pytest.raises(TypeError, match="^optim_grad_pointers: expected lists"):
        _C.optim_grad_pointers(*args)
    p, args = _one_param_fast_path()
    args[9] = args[7].copy()
    with pytest.raises(ValueError, match="^optim_grad_pointers: step_rows must be None"):
        _C.optim_grad_pointers(*args)


def test_optim_call_key_is_the_ids_of_the_params():
    """The plan cache's key holds every param's id in full: a buffer of n
    bytes for n pointers kept a part of the first id (and wrote past it)."""
    a, b = object(), object()
    assert _C.optim_call_key([a, b]) == struct.pack("@2P", id(a), id(b))


def test_optim_hparams_raises_a_lookup_error_and_reads_betas_of_a_list():
    """An error raised while group is searched (a key's __eq__) is raised,
    not taken for an absent lr; betas given as a list of two are read as
    the tuple's are (torch unpacks either)."""
    class Clash:
        def __hash__(self):
            return hash("lr")

        def __eq__(self, other):
            raise LookupError("no comparing")
    with pytest.raises(LookupError, match="^no comparing$"):
        _C.optim_hparams({Clash(): 0.1})
    assert _C.optim_hparams({"lr": 0.1, "betas": [0.9, 0.99]})[:5] == (0.1, 0.0, 0.0, 0.9, 0.99)


def test_an_int_below_int64_is_named_as_such():
    """int_arg's OverflowError says on which side of int64 the value lies."""
    with pytest.raises(OverflowError, match=r"^kind: expected an int in \[-2147483648, 2147483647\], "
                                            r"got an int < -2\^63$"):
        _C.fad_codebook(-2**70, 0.0, 0.0)


def test_scheduling_and_bppsa_bindings_give_back_what_they_read():
    """Each spec entry sched_graph reads (an int, a float, an array, a flag
    it refuses), the pointer list csr_gradients refuses, the leaves csr_plan
    copies and the sizes reverse_first_k copies go with the call: a missing
    Py_DECREF kept each for good (100000 sizes: 800 kB a call)."""
    micro, transfer, fwd, flag = np.int64(2), np.float64(0.1), [1.0] * 4, 1.0
    spec = {**_SPEC, "micro": micro, "transfer": transfer, "fwd": fwd}
    leaf = (2, 2, np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), False, None, 2)
    plan, ptrs = _C.csr_plan([leaf, leaf], 0, 0, 1.0, 1.0, 1.0), [0]
    held = (micro, transfer, fwd, flag, leaf, ptrs)
    before = [sys.getrefcount(x) for x in held]
    for _ in range(100):
        _C.sched_graph(spec)
        with pytest.raises(TypeError, match=r"^sched_graph: sub_stream must be a bool \(got float\)$"):
            _C.sched_graph({**spec, "sub_stream": flag})
        _C.csr_plan([leaf, leaf], 0, 0, 1.0, 1.0, 1.0)
        with pytest.raises(ValueError, match=r"^out: expected 2 data pointers \(one per layer\), got 1$"):
            _C.csr_gradients(plan, 1, 0, ptrs, 1)
    assert [sys.getrefcount(x) for x in held] == before
    k = 10**5
    mem = np.ones(k, np.int64)
    assert _leaked_bytes(lambda: _C.reverse_first_k(k, 1, mem, mem, 0, 10**12)) < 10**6


def test_csr_program_copies_every_phase_pointer():
    """phase_ptr has one entry per phase and one more, the last the rows."""
    leaf = (2, 2, np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32), False, None, 2)
    plan = _C.csr_plan([leaf, leaf], 0, 0, 1.0, 1.0, 1.0)
    program, info = _C.csr_program(plan), _C.csr_plan_info(plan)
    assert len(program["phase_ptr"]) == info["phases"] + 1 and program["phase_ptr"][-1] == info["rows"]


def test_sched_graph_refuses_a_spec_that_is_no_dict():
    with pytest.raises(TypeError, match=r"^sched_graph: spec must be a dict \(got list\)$"):
        _C.sched_graph([])


def test_csr_plan_refuses_a_leaf_without_columns():
    """cols is at least 1, as rows is: a layer of no outputs has no Jacobian."""
    leaf = (1, 0, np.array([0, 0], np.int32), np.array([], np.int32), False, None, 0)
    with pytest.raises(ValueError, match=r"^leaves\[0\]: rows and cols must be in \[1, 2\^31\)"):
        _C.csr_plan([leaf], 0, 0, 1.0, 1.0, 1.0)


def test_optim_grad_pointers_sends_a_gradient_of_another_layout_to_python():
    """A gradient that is not strided (sparse CSR: is_contiguous() raises)
    leaves the step to the Python path (None) before anything else of it
    is read."""
    p = torch.zeros(2, 2)
    args = list(_fast_path_args([p]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR is in beta
        args[8] = {id(p): torch.ones(2, 2).to_sparse_csr()}
    assert _C.optim_grad_pointers(*args) is None


def test_optim_grad_pointers_raises_the_error_of_a_data_ptr_it_cannot_read():
    """A param whose data_ptr() gives no address (-1) raises the conversion's
    OverflowError, not a SystemError for a stale row returned with it set."""
    p = types.SimpleNamespace(grad=torch.ones(2), data_ptr=lambda: -1)
    args = list(_fast_path_args([torch.zeros(2)]))
    args[0] = [p]
    with pytest.raises(OverflowError, match="^can't convert negative int to unsigned$"):
        _C.optim_grad_pointers(*args)


def test_optim_grad_pointers_sends_a_gradient_of_a_tensor_subclass_to_python():
    """Only a plain torch.Tensor gradient is read in place: a subclass's
    (whose __torch_dispatch__ may hold no memory of its own) leaves the step
    to the Python path (None)."""
    class Sub(torch.Tensor):
        pass
    p, args = _one_param_fast_path()
    args[8] = {id(p): torch.ones(2).as_subclass(Sub)}
    assert _C.optim_grad_pointers(*args) is None


def test_optim_grad_pointers_sends_a_param_with_another_state_dict_to_python():
    """A row holds for the state dict its table was built with: a param that
    has a state dict now, where it had none (or another one, after
    load_state_dict), leaves the step to the Python path (None)."""
    p, args = _one_param_fast_path()
    assert _C.optim_grad_pointers(*args) is not None
    args[2] = {p: {}}
    assert _C.optim_grad_pointers(*args) is None


# ---- mutation audit of the binding layer, csrc/pyutil.c and module.c (session 43): ----
# ---- the mutants the two audits above planned and never ran.                        ----


def _dense_chain(layers: int, n: int) -> list:
    """csr_plan's leaves of `layers` dense n x n Linear Jacobians."""
    indptr, indices, _ = _C.jacobian("linear", (n, n))
    return [(n, n, indptr, indices, False, None, 0)] * layers


def test_scan_and_the_csr_bindings_release_the_gil_around_their_work():
    """module.c says each binding releases the GIL around the core's work;
    scan, csr_plan, csr_run, csr_gradients and sched_graph were not tested
    for it: each kept it unnoticed. Their arguments are made before the
    call (NumPy releases the GIL filling large arrays); sched_graph's arrays
    are lists, which NumPy converts holding it."""
    T, B, H = 64, 8, 64
    c, g = torch.randn(T, B, H), torch.empty(T, B, H)
    jt = torch.randn(T, B, H, H) / H
    leaves = _dense_chain(16, 128)
    plan = _C.csr_plan(leaves, 0, 0, 1.0, 1.0, 1.0)
    info, batch = _C.csr_plan_info(plan), 64
    seq, shared = np.ones(info["seq_floats"] * batch, np.float32), np.ones(batch, np.float32)
    out = [np.zeros((batch, 128), np.float32) for _ in leaves]
    ptrs = [o.ctypes.data for o in out]
    layers = 20000
    spec = dict(_SPEC, layers=layers, micro=8, stages=4, order=1, fwd=[1.0] * layers,
                out_grad=[1.0] * layers, weight_grad=[1.0] * layers)
    calls = {  # name: (call, times a try: csr_gradients' copy takes about 0.3 ms)
        "scan": (lambda: _C.scan(T, B, H, 0, 0, 0, 0, jt.data_ptr(), 0, 0, 0, c.data_ptr(), g.data_ptr(),
                                 0, 0, 1), 8),
        "csr_plan": (lambda: _C.csr_plan(leaves, 0, 0, 1.0, 1.0, 1.0), 8),
        "csr_run": (lambda: _C.csr_run(plan, batch, seq.ctypes.data, shared.ctypes.data, 0, 0, 0, 0, 1), 8),
        "csr_gradients": (lambda: _C.csr_gradients(plan, batch, seq.ctypes.data, ptrs, 1), 400),
        "sched_graph": (lambda: _C.sched_graph(spec), 8),
    }
    for name, (call, times) in calls.items():
        assert _lets_another_thread_run(lambda: [call() for _ in range(times)]), name


def test_a_conv2d_geometry_of_another_length_is_refused():
    """geometry is the 15 fields of rp_conv2d_geom: a tuple of 16 (a field
    too many, or the fields of another layer) is refused as one of 14 is,
    not read as its first 15."""
    geometry = (1, 4, 4, 2, 4, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1)
    for kind in ("conv2d", "maxpool2d"):
        for wrong in (geometry[:-1], geometry + (1,)):
            with pytest.raises(TypeError, match=r"^geometry: expected a tuple \(c_in, h_in, w_in, c_out, h_out, "
                                                r"w_out, kh, kw, sh, sw, ph, pw, dh, dw, groups\)$"):
                _C.jacobian(kind, wrong)


def test_csr_plan_refuses_index_arrays_of_another_dtype():
    """A leaf's indptr, indices and value_map are read in place as int32: an
    int64, uint32 or float32 array (the last two of the same size) is
    refused, not read as int32 bits."""
    indptr, indices = np.array([0, 1, 2], np.int32), np.array([0, 1], np.int32)
    for dtype in (np.int64, np.uint32, np.float32):
        with pytest.raises(ValueError, match=r"^leaves\[0\]: indptr: expected a C-contiguous, aligned int32 "
                                             "array of 3 elements in native byte order$"):
            _C.csr_plan([(2, 2, indptr.astype(dtype), indices, False, None, 2)], 0, 0, 1.0, 1.0, 1.0)
        with pytest.raises(ValueError, match=r"^leaves\[0\]: indices: expected a C-contiguous, aligned 1-D "
                                             "int32 array in native byte order$"):
            _C.csr_plan([(2, 2, indptr, indices.astype(dtype), False, None, 2)], 0, 0, 1.0, 1.0, 1.0)
        with pytest.raises(ValueError, match=r"^leaves\[0\]: value_map: expected a C-contiguous, aligned "
                                             "int32 array of 2 elements in native byte order$"):
            _C.csr_plan([(2, 2, indptr, indices, True, indices.astype(dtype), 2)], 0, 0, 1.0, 1.0, 1.0)
    assert _C.csr_plan_info(_C.csr_plan([(2, 2, indptr, indices, True, indices, 2)], 0, 0, 1.0, 1.0,
                                        1.0))["levels"] == 0


def test_scan_workspace_and_jacobian_refuse_sizes_with_the_cores_message():
    """scan_workspace checks its sizes as the scan does (unchecked, it
    answered 0 for n = 0, 12 floats for 4 levels of n = 8 and -1 for a
    workspace past INT64_MAX); jacobian raises the core's refusal of a
    geometry before it makes arrays of the sizes the core gave (ignored,
    NumPy's MemoryError for 2^40 features, its "negative dimensions" for a
    diagonal of -2)."""
    for args, message in [((0, 1, 1, 0), r"need n >= 1, batch >= 0, dim >= 1 \(got 0, 1, 1\)"),
                          ((8, -1, 1, 1), r"need n >= 1, batch >= 0, dim >= 1 \(got 8, -1, 1\)"),
                          ((8, 1, 1, 4), r"levels must be in \[0, 3\] for n = 8 \(got 4\)"),
                          ((2**61, 1, 1, 1), r"the workspace of n = 2305843009213693952, batch = 1, dim = 1 ")]:
        with pytest.raises(ValueError, match=f"^scan: {message}"):
            _C.scan_workspace(*args)
    for kind, geometry, message in [
            ("diagonal", (-2, 0), r"diagonal: size must be >= 1 \(got -2\)$"),
            ("linear", (2**40, 2**40), r"linear: in_features = 1099511627776 does not fit in int32")]:
        with pytest.raises(ValueError, match=f"^{message}"):
            _C.jacobian(kind, geometry)


def test_sched_graph_refuses_layers_past_int32_before_reading_the_arrays():
    """layers past 2^31 - 1 (the core's int32 ids) is refused as such: without
    the bound the refusal was about fwd's length, which no caller could meet."""
    for layers in (2**31, 2**32 + 4):
        with pytest.raises(ValueError, match=rf"^sched_graph: layers must be in \[1, 2\^31\) \(got {layers}\)$"):
            _C.sched_graph({**_SPEC, "layers": layers})


# ---- mutation audit of python/reprop/_tensors.py (session 43) ----

@pytest.mark.filterwarnings("ignore:Sparse (CSR|CSC|BSR|BSC) tensor support is in beta")
def test_check_strided_calls_each_sparse_layout_sparse():
    """_SPARSE_LAYOUTS lacking one of torch's five sparse layouts (BSC) named
    a BSC gradient or operand a "non-strided" tensor, as mkldnn's is."""
    x = torch.randn(4, 4)
    for sparse in (x.to_sparse(), x.to_sparse_csr(), x.to_sparse_csc(), x.to_sparse_bsr((2, 2)),
                   x.to_sparse_bsc((2, 2))):
        with pytest.raises(RuntimeError, match=rf"^x: sparse tensors are not supported "
                                               rf"\(got layout {sparse.layout}\)$"):
            _tensors.check_strided(sparse, "x")


def test_check_count_takes_both_ends_of_its_range_as_python_ints():
    """check_count's range is closed, and what it gives back is a Python int
    (a NumPy count too): a bound taken as exclusive refused bppsa's largest
    sequence, 2^31 - 1 steps (the core's sizes are int32s)."""
    assert reprop.bppsa.scan_levels(2**31 - 1, 1, 1, 1) > 0
    for value in (1, 5, np.int64(5), np.int32(1), np.uint8(3)):
        got = _tensors.check_count(value, "n", 1, 5)
        assert got == value and type(got) is int
    for value in (0, 6, np.int64(-1)):
        with pytest.raises(ValueError, match=rf"^n: expected an int in \[1, 5\], got {re.escape(repr(value))}$"):
            _tensors.check_count(value, "n", 1, 5)
    assert _tensors.check_count(2**70, "n", 0) == 2**70


# ---- the audit's last binding mutants (session 43, run after the merge) ----

def test_int_arguments_below_int_min_are_refused_not_wrapped():
    """An int argument takes INT_MIN (here an unknown activation kind, which
    the core refuses with its own ValueError), and one below it is an
    OverflowError naming it: unchecked, -2**32 wrapped to kind 0, a valid
    activation, silently."""
    with pytest.raises(ValueError, match="^unknown activation kind -2147483648$"):
        _C.fad_codebook(-2**31, 0.0, 0.0)
    for below in (-2**31 - 1, -2**32):
        with pytest.raises(OverflowError, match=rf"^kind: expected an int in \[-2147483648, 2147483647\], "
                                                rf"got {below}$"):
            _C.fad_codebook(below, 0.0, 0.0)


def test_ksearch_next_refuses_layers_past_its_bound_before_reading_score():
    """layers past 2^40 is refused with the core's message, before score is
    read as an array of layers + 1 elements (which no caller could give)."""
    with pytest.raises(ValueError, match=r"^k search: layers must be in \[1, 2\^40\] \(got 1099511627777\)$"):
        _C.ksearch_next(2**40 + 1, [0.0] * 5)


def test_optim_hparams_leaves_every_numeric_hyper_parameter_not_a_plain_number_to_python():
    """A tensor, a NumPy scalar or a bool in any numeric slot, lr_decay (the
    last) too, and a capturable that is no plain bool are left to Python's
    _hparams_of (None), which converts or refuses them as torch does; a
    plain number goes to its slot."""
    group = {"lr": 0.1, "betas": (0.9, 0.99)}
    for key in ("lr", "weight_decay", "eps", "momentum", "dampening", "alpha", "rho", "lr_decay"):
        for value in (torch.tensor(0.5), np.float64(0.5), True):
            assert _C.optim_hparams(dict(group, **{key: value})) is None, (key, value)
    assert _C.optim_hparams(dict(group, lr_decay=0.5))[9] == 0.5
    for capturable in (np.bool_(True), torch.tensor(True)):  # Python takes its bool()
        assert _C.optim_hparams(dict(group, capturable=capturable)) is None, capturable
    assert _C.optim_hparams(dict(group, capturable=True)) == _C.optim_hparams(group)


def test_optim_check_leaves_a_capturable_updates_step_scalars_to_the_device():
    """A capturable update's step count lives on the device, so the check
    makes no step scalars: Adam with beta1 = 1 is refused at step 1 on the
    host (1 - beta1 ** step is 0) and passes the capturable check (torch's
    capturable Adam divides on the device without raising); neither call
    writes anything."""
    p, g = np.ones(4, np.float32), np.full(4, 0.5, np.float32)
    m, v, step = np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(1, np.float32)
    table = np.zeros((1, 8), np.int64)
    table[0, :4] = [a.ctypes.data for a in (p, g, m, v)]
    table[0, 5], table[0, 6] = step.ctypes.data, p.size
    hparams = (0.1, 0.0, 1e-8, 1.0, 0.999) + (0.0,) * 5 + (False,) * 5  # Adam, beta1 = 1
    with pytest.raises(ValueError, match=r"^betas: 1 - beta1 \*\* step is 0 at step 1 \(beta1 = 1\)"):
        _C.optim_check(1, 0, table, hparams, False)
    assert _C.optim_check(1, 0, table, hparams, True) is None
    assert (p == 1).all() and (m == 0).all() and (v == 0).all() and step[0] == 0


def test_stage_and_first_k_bindings_refuse_layers_past_their_bound_before_allocating():
    """reverse_first_k and sched_stages raise the core's refusal of too many
    layers before they make their arrays of layers elements: unchecked, the
    same refusal came after NumPy had allocated 4 and 8 GiB (or raised its
    MemoryError where that much could not be had)."""
    calls = [(lambda: _C.reverse_first_k(2**30 + 1, 1, None, None, 0, 0),
              r"^reverse first-k: layers must be in \[1, 2\^30\) \(got 1073741825\)$"),
             (lambda: _C.sched_stages(2**31, 4, 0),
              r"^stages: need layers and stages in \[1, 2\^31\) \(got 2147483648, 4\)$")]
    tracemalloc.start()
    try:
        for call, message in calls:
            with pytest.raises(ValueError, match=message):
                call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak


# ---- the binding mutants session 43's audits left alive (session 44) ----

def test_optim_grad_pointers_sends_a_list_shrunk_by_one_under_the_call_to_python():
    """A .grad property popping the last param leaves the list exactly as
    long as the row the fast path reads next: that row is gone (None, the
    Python path), not read past the list's end. A bound check taking the
    list's length as a valid row read the popped param's stale slot (here
    still alive) and made it a row of the step ([grad], [1])."""
    popped = []

    class PopsTheLastParam:
        @property
        def grad(self):
            popped.append(params.pop())
            return None  # this row sits the step out: on to row 1

    last = torch.zeros(3)
    last.grad = torch.ones(3)
    args = list(_fast_path_args([last, last]))
    params = args[0] = [PopsTheLastParam(), last]
    args[1][0] = (0, None, None, True, -1)
    assert _C.optim_grad_pointers(*args) is None
    assert popped == [last] and len(params) == 1
