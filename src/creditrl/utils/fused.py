"""Elementwise chains and the reductions over them as one ``torch.compile``d loop, where compiling works.

Eager PyTorch makes one pass over memory per op, so a chain of pointwise ops and reductions over
[B,T] tensors is bound by memory traffic; inductor fuses it into one loop that reads each input
once. A fused function must be pure tensor code without autograd, correct eagerly too, called on
flat (1-D) tensors (``flat``): then its compiled graphs are few (dynamic sizes; size 1 and each input dtype
compile once more). Where compiling fails (no C++ compiler on a CPU, no Triton on a GPU) it runs as
it is, with one warning per process naming the reason.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

import torch

_EAGER_REASON: list[str] = []   # why compiling was given up, once per process


def _reason(error: Exception) -> str:
    # inductor's first line is often only "backend='inductor' raised:": the cause is on the next
    lines = [line.strip() for line in str(error).splitlines() if line.strip()][:2]
    return f"{type(error).__name__}: {' '.join(lines)}"


def flat(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x flat (as ``dtype``) and detached, the form fused functions take: one graph per dtype whatever
    the shape; the last ``detach`` keeps dynamo from guarding on the shape of the tensor a flat view
    was taken of."""
    return x.detach().to(dtype or x.dtype).reshape(-1).detach()


def fused(fn: Callable, *, eager: Callable | None = None) -> Callable:
    """``fn`` compiled on first use, or ``eager`` (default ``fn`` itself: the same function, written for
    the compiler; an eager twin may work in place to save passes and must give the same values up to
    rounding) once compiling has failed in this process. A failure of the compiled call counts as the
    compiler's only when the eager function then succeeds on the same arguments; a caller's error (a
    bad shape or device, out of memory) raises as itself and leaves compiling on. Runs without
    autograd and autocast (fewer graphs, and nothing to record); inputs as ``flat`` gives them."""
    eager = eager or fn
    # dynamic_threads: a CPU kernel's loops are parallel whatever the sizes it was first compiled
    # for. Without it inductor sizes the parallelism from the first call's shapes, and its graph cache
    # hands that kernel to every later call and process: one compiled on a 3 x 5 test batch ran
    # single-threaded, 2x slower, on B = 1,024, T = 4,096
    compiled = functools.cache(lambda: torch.compile(fn, dynamic=True, options={"cpp.dynamic_threads": True}))

    @functools.wraps(fn)
    def run(*args):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.no_grad(), torch.autocast(device, enabled=False) if device in ("cpu", "cuda") \
                else contextlib.nullcontext():
            if _EAGER_REASON:
                return eager(*args)
            try:
                return compiled()(*args)
            except Exception as error:   # noqa: BLE001 (the compiler stack's failures vary by backend)
                failure = error
            result = eager(*args)        # outside the except: a caller's own error raises here, unchained
            warnings.warn(f"creditrl: torch.compile failed ({_reason(failure)}); fused tensor code runs eagerly "
                          "(the same results up to rounding, slower)", RuntimeWarning, stacklevel=2)
            _EAGER_REASON.append(_reason(failure))
            return result
    return run
