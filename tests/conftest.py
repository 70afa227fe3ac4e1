"""Shared pytest configuration for the reprop test suite.

Markers:
  gpu: needs a CUDA device *and* a reprop build with its CUDA extension. Such
       tests are skipped automatically otherwise, so `pytest tests/` passes on
       CPU-only machines and `pytest -m gpu tests/` runs just the GPU cases.
"""
from __future__ import annotations

import functools

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # One torch (and so reprop) thread unless a test asks for more
    # (_threads.torch_threads): the tests' tensors are tiny, and each op that
    # forks a pool of two waits for a second vCPU; on a shared 2-core machine
    # test_ooo's line-stop sweeps took 379 s with the default count, 59 s
    # with one. The tests of a thread split set their counts themselves.
    import torch

    torch.set_num_threads(1)
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA device and a reprop build with CUDA kernels "
        "(skipped automatically otherwise)",
    )


@functools.lru_cache(maxsize=None)
def _gpu_skip_reason() -> str | None:
    """Why gpu-marked tests cannot run here, or None when they can.

    reprop is imported lazily (only when a gpu-marked test was collected), and
    any import failure becomes a skip reason rather than a collection error.
    """
    import torch

    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import reprop
    except Exception as exc:  # a broken build should not break collection
        return f"reprop could not be imported: {exc!r}"
    try:
        if not reprop.cuda_available():
            return "reprop was built without CUDA (reprop.cuda_available() is False)"
    except Exception as exc:
        return f"reprop.cuda_available() failed: {exc!r}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)
