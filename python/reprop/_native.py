"""Loads the native extensions: reprop._C always, reprop._cuda when it was built."""
from __future__ import annotations

import functools
import importlib
import os
import platform
import sysconfig

# README's install command, and the in-place build of a checkout
_BUILD = "pip install . (in a source checkout: python setup.py build_ext --inplace)"


def _not_there(exc: ImportError, module: str) -> bool:
    """Whether `exc` says reprop.`module` has no file this Python would load
    (never built, or built for another Python: its file name has another
    ABI tag), rather than a file that failed to load."""
    return isinstance(exc, ModuleNotFoundError) and exc.name == f"{__package__}.{module}"


def _builds_of(module: str) -> list[str]:
    """The extension files of reprop.`module` beside this one, for any Python."""
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(f for f in os.listdir(here) if f.startswith(f"{module}.") and f.endswith((".so", ".pyd")))


def _load_core():
    """reprop._C, or an ImportError saying it is not built for this Python and
    how to build it (`from . import _C` said "cannot import name '_C' from
    partially initialized module 'reprop' (most likely due to a circular
    import)")."""
    try:
        return importlib.import_module(f"{__package__}._C")
    except ImportError as exc:
        if not _not_there(exc, "_C"):
            raise  # the file is there: its own error (a missing symbol, NumPy's ABI) says why
        others = _builds_of("_C")
        found = f"; found only {', '.join(others)}, built for another Python" if others else ""
        raise ImportError(
            f"reprop's C extension reprop._C is not built for this Python "
            f"({platform.python_implementation()} {platform.python_version()}, which loads "
            f"_C{sysconfig.get_config_var('EXT_SUFFIX')}) in {os.path.dirname(os.path.abspath(__file__))}"
            f"{found}; build it with: {_BUILD}") from None


def _load_cuda():
    """(reprop._cuda, None) when it loads; (None, None) when it was not built
    (no nvcc, or REPROP_CUDA=0); (None, the error) when its file is there but
    does not load (another NumPy's ABI, a missing symbol, a corrupt file).
    That last case warns rather than raises: the CPU paths need nothing of
    _cuda, so `import reprop` keeps working for them, but treating it as
    "not built" would hide the cause behind advice to rebuild with nvcc, so
    the error is named now and by `python -m reprop info` (cuda_error)."""
    try:
        return importlib.import_module(f"{__package__}._cuda"), None
    except ImportError as exc:
        if _not_there(exc, "_cuda"):
            return None, None
        error = f"{type(exc).__name__}: {exc}"
        from ._tensors import ReproPRuntimeWarning, warn_at_users_line  # here: _tensors imports torch
        warn_at_users_line(f"reprop: its CUDA extension reprop._cuda is built but does not load ({error}); "
                           f"reprop runs as if built without CUDA. Rebuild it with: {_BUILD}",
                           ReproPRuntimeWarning)
        return None, error


_C = _load_core()
_cuda, _cuda_error = _load_cuda()

__all__ = ["_C", "_cuda", "cuda_built", "cuda_available", "cuda_archs", "cuda_error", "cuda_missing"]


def cuda_built() -> bool:
    """Whether reprop was compiled with its CUDA kernels and they load
    (cuda_error() says why a compiled reprop._cuda did not)."""
    return _cuda is not None


def cuda_error() -> str | None:
    """Why reprop._cuda, though built, did not load; None when it loaded or
    was not built."""
    return _cuda_error


def cuda_missing() -> str:
    """Why reprop's CUDA kernels cannot run, for the errors of CUDA input
    when _cuda is None: not built, or built but not loading (cuda_error)."""
    if _cuda_error is not None:
        return f"reprop's CUDA extension is built but does not load ({_cuda_error})"
    return "reprop was built without its CUDA kernels (reinstall with nvcc on PATH, or REPROP_CUDA=1)"


@functools.lru_cache(maxsize=None)
def _cuda_device_count() -> int:
    """The devices reprop's kernels can use. torch is asked first: its own
    check decides whether the driver is initialized (not at all in a CPU
    build; by NVML under PYTORCH_NVML_BASED_CUDA_CHECK=1), and reprop's
    runtime is counted only where torch has a device, as it may still refuse
    one (a driver older than the CUDA reprop was built with)."""
    import torch

    if _cuda is None or not torch.cuda.is_available():
        return 0
    return _cuda.device_count()


def cuda_available() -> bool:
    """Whether reprop's CUDA kernels can run here: built with CUDA and a device present."""
    return _cuda_device_count() > 0


def cuda_archs() -> str | None:
    """The GPU architectures the kernels were compiled for, or None without CUDA."""
    return _cuda.build_info()["archs"] if _cuda is not None else None
