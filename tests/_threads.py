"""torch's intra-op thread count for a block, for the test modules (not a
test module).

    torch_threads(n)
        A context in which torch (and so reprop, which follows torch's count)
        runs on n threads; the count from before is set again on leaving, as
        a test that leaves another count changes how later tests split, and
        so sum, their work.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
