"""Loads the native extensions: reprop._C always, reprop._cuda when it was built."""
from __future__ import annotations

import functools

from . import _C

try:
    from . import _cuda
except ImportError:  # built without nvcc, or REPROP_CUDA=0
    _cuda = None

__all__ = ["_C", "_cuda", "cuda_built", "cuda_available", "cuda_archs"]


def cuda_built() -> bool:
    """Whether reprop was compiled with its CUDA kernels."""
    return _cuda is not None


@functools.lru_cache(maxsize=None)
def _cuda_device_count() -> int:
    return _cuda.build_info()["device_count"] if _cuda is not None else 0


def cuda_available() -> bool:
    """Whether reprop's CUDA kernels can run here: built with CUDA and a device present."""
    return _cuda_device_count() > 0


def cuda_archs() -> str | None:
    """The GPU architectures the kernels were compiled for, or None without CUDA."""
    return _cuda.build_info()["archs"] if _cuda is not None else None
