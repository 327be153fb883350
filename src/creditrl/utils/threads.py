"""Process-wide torch settings, scoped."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run with ``n`` torch CPU threads (unchanged when ``n`` is falsy), then restore. On a shared
    2-core machine one thread was ~10-100x faster per small matmul than two (OpenMP threads spin
    against other processes), which is why builtin:tiny work defaults to one thread."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
