"""Elementwise chains and the reductions over them as one ``torch.compile``d loop, where compiling works.

Eager PyTorch makes one pass over memory per op, so a chain of pointwise ops and reductions over
[B,T] tensors is bound by memory traffic; inductor fuses it into one loop that reads each input
once. A fused function must be plain tensor code that is also correct eagerly: where compiling
fails (no C++ compiler on a CPU, no Triton on a GPU) it runs as it is, with one warning per process
naming the reason.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

_EAGER_REASON: list[str] = []   # why compiling was given up, once per process


def fused(fn: Callable) -> Callable:
    """``fn`` compiled on first use (shapes dynamic: one compilation covers every B and T), or ``fn``
    itself once compiling has failed in this process."""
    compiled = functools.cache(lambda: torch.compile(fn, dynamic=True))

    @functools.wraps(fn)
    def run(*args):
        if not _EAGER_REASON:
            try:
                return compiled()(*args)
            except Exception as error:   # noqa: BLE001 (the compiler stack's failures vary by backend; eager is exact)
                # inductor's first line is often only "backend='inductor' raised:": the cause is on the next
                lines = [line.strip() for line in str(error).splitlines() if line.strip()][:2]
                _EAGER_REASON.append(f"{type(error).__name__}: {' '.join(lines)}")
                warnings.warn(f"creditrl: torch.compile failed ({_EAGER_REASON[0]}); fused tensor code runs eagerly "
                              "(same results, slower)", RuntimeWarning, stacklevel=2)
        return fn(*args)
    return run
