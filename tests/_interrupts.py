"""The stop button at a chosen line, for the test modules (not a test module).

A notebook's stop button raises KeyboardInterrupt between any two statements
of whatever runs. The tests raise it deterministically with sys.settrace: a
trace function that raises does so in the traced frame, right before the
line the event is for, and CPython then stops tracing (as after any error in
a trace function).

    LineStop(where, n, under=None, starting=None)
        A context in which the n-th 'line' event in the frames `where` names
        raises KeyboardInterrupt (n=0: none; a sweep's first run, to count
        them); `count` is the number of line events seen there, `stopped`
        whether it raised. The trace function that was set before (a
        coverage tool's) is set again on leaving.

    interrupted_at_line(n, call, where, **options) -> bool
        Runs call() inside LineStop(where, n, **options); whether it was
        interrupted (False: call() ran fewer than n lines there).

    KernelsThenStop(c_module)
        Stands in for reprop's C module: its optim_step runs the real one,
        then raises KeyboardInterrupt, as Python raises one pressed while the
        kernels run (they release the GIL) as their call returns. Every other
        name is the real module's.
"""

from __future__ import annotations

import inspect
import linecache
import sys
import types
from collections.abc import Callable


def _code(function) -> types.CodeType:
    # unwrapped: a function reprop wraps (_tensors.eager_under_compile) has the
    # wrapper's code, one code object shared by every function so wrapped
    return function if isinstance(function, types.CodeType) else inspect.unwrap(function).__code__


class LineStop:
    """Raises KeyboardInterrupt before the n-th line run in the frames of
    `where`: a source file's path (module.__file__: every frame of its
    code), or a function or code object, or a tuple, list or set of them
    (each file's frames, each function's own). `under` (a function or
    code object) keeps only frames called, at any depth, from a frame of
    it (or its own); `starting` counts only the lines whose source text,
    stripped, starts with it."""

    def __init__(self, where, n: int = 0, *, under=None, starting: str | None = None) -> None:
        many = isinstance(where, (tuple, list, set, frozenset))
        where = where if many else (where,)
        self._files = {w for w in where if isinstance(w, str)}
        self._codes = {_code(f) for f in where if not isinstance(f, str)}
        self._under = None if under is None else _code(under)
        self.n, self.starting, self.count = n, starting, 0

    @property
    def stopped(self) -> bool:
        return 0 < self.n == self.count

    def __enter__(self) -> LineStop:
        self._saved = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._saved)

    def _traced(self, frame) -> bool:
        code = frame.f_code
        if code.co_filename not in self._files and code not in self._codes:
            return False
        if self._under is None:
            return True
        while frame is not None:
            if frame.f_code is self._under:
                return True
            frame = frame.f_back
        return False

    def _call(self, frame, event: str, arg) -> Callable | None:
        return self._line if self._traced(frame) else None

    def _line(self, frame, event: str, arg) -> Callable:
        if event == "line" and (self.starting is None or linecache.getline(
                frame.f_code.co_filename, frame.f_lineno).strip().startswith(self.starting)):
            self.count += 1
            if self.count == self.n:
                raise KeyboardInterrupt  # CPython then stops tracing
        return self._line


def interrupted_at_line(n: int, call: Callable[[], object], where, **options) -> bool:
    """Runs call() with a KeyboardInterrupt raised before the n-th line it
    runs in `where` (LineStop's arguments); whether it was raised (False:
    call() ran fewer lines there)."""
    try:
        with LineStop(where, n, **options):
            call()
    except KeyboardInterrupt:
        return True
    return False


class KernelsThenStop:
    def __init__(self, c_module) -> None:
        self._real = c_module

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def optim_step(self, *args) -> None:
        self._real.optim_step(*args)
        raise KeyboardInterrupt
