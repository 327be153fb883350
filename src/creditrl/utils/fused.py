"""Elementwise chains and the reductions over them as one compiled loop, where compiling works.

Eager PyTorch makes one pass over memory per op, so a chain of pointwise ops and reductions over
[B,T] tensors is bound by memory traffic; inductor fuses it into one loop that reads each input
once. A fused function must be pure tensor code without autograd, correct eagerly too, called on
flat (1-D, ``flat``) or contiguous tensors: then its compiled graphs are few (dynamic sizes; size 1
and each input dtype compile once more). Where compiling fails (no C++ compiler on a CPU, no Triton
on a GPU) it runs as it is, with one warning per process naming the reason.

On a CPU a graph is traced once per ``signature`` and compiled without dynamo
(``torch._inductor.standalone_compile``, as vLLM compiles its graphs): a call then costs ~25 us
over its kernel, where ``torch.compile``'s guards cost ~100 us, a third of the 0/1 rule's whole
cost at B = 1,024, T = 4,096. Other devices, and calls with dynamo disabled, go through
``torch.compile``; under an outer ``torch.compile`` the function joins the caller's graph.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

_EAGER_REASON: list[str] = []   # why compiling was given up, once per process
_log = logging.getLogger(__name__)
# dynamic_threads: a CPU kernel's loops are parallel whatever the sizes it was first compiled for.
# Without it inductor sizes the parallelism from the first call's shapes, and its graph cache hands
# that kernel to every later call and process: one compiled on a 3 x 5 test batch ran
# single-threaded, 2x slower, on B = 1,024, T = 4,096
_OPTIONS = {"cpp.dynamic_threads": True}


def _reason(error: Exception) -> str:
    # inductor's first line is often only "backend='inductor' raised:": the cause is on the next
    lines = [line.strip() for line in str(error).splitlines() if line.strip()][:2]
    return f"{type(error).__name__}: {' '.join(lines)}"


def flat(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x flat (as ``dtype``) and detached, the form fused functions take: one graph per dtype whatever
    the shape; the last ``detach`` keeps dynamo from guarding on the shape of the tensor a flat view
    was taken of."""
    return x.detach().to(dtype or x.dtype).reshape(-1).detach()


def signature(args: tuple) -> tuple | None:
    """The key under which one traced graph serves every call: each argument's dtype and rank, its
    sizes as 0, 1 or the number of the first equal size >= 2 (a symbolic trace specialises sizes 0
    and 1, and takes equal sizes for one symbol). None where an argument is not a contiguous CPU
    tensor without grad (those calls go through ``torch.compile``, whose guards check the rest)."""
    numbers: dict[int, int] = {}
    key = []
    for x in args:
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.requires_grad or not x.is_contiguous() \
                or x.layout != torch.strided:
            return None
        key.append((x.dtype, tuple(size if size < 2 else 2 + numbers.setdefault(size, len(numbers))
                                   for size in x.shape)))
    return tuple(key)


def _standalone(fn: Callable, args: tuple) -> Callable:
    """``fn`` traced symbolically on ``args`` and compiled by inductor, without dynamo's guards (the
    caller keys it by ``signature``). Returns a tuple where ``fn`` does, as the eager call."""
    graph = make_fx(lambda *xs: fn(*xs), tracing_mode="symbolic")(*args)   # a lambda: no annotation globals
    compiled = torch._inductor.standalone_compile(graph, list(args), dynamic_shapes="from_graph",
                                                  options={"config_patches": _OPTIONS})
    return lambda *xs: (out if isinstance(out := compiled(*xs), torch.Tensor) else tuple(out))


def fused(fn: Callable, *, eager: Callable | None = None) -> Callable:
    """``fn`` compiled on first use, or ``eager`` (default ``fn`` itself: the same function, written for
    the compiler; an eager twin may work in place to save passes and must give the same values up to
    rounding) once compiling has failed in this process. A failure of the compiled call counts as the
    compiler's only when the eager function then succeeds on the same arguments; a caller's error (a
    bad shape or device, out of memory) raises as itself and leaves compiling on. On a CPU the graphs
    compile without dynamo (module docstring); where that fails for ``fn`` (its trace or its compile),
    ``fn`` goes through ``torch.compile`` from then on. Runs without autograd and autocast (fewer
    graphs, and nothing to record); inputs as ``flat`` gives them."""
    eager = eager or fn
    compiled = functools.cache(lambda: torch.compile(fn, dynamic=True, options=_OPTIONS))
    graphs: dict[tuple, Callable] = {}
    standalone_failed: list[str] = []

    def standalone_graph(args: tuple) -> Callable | None:
        if standalone_failed or torch._dynamo.config.disable:
            return None
        key = signature(args)
        if key is None:
            return None
        if key not in graphs:
            graphs[key] = _standalone(fn, args)
        return graphs[key]

    @functools.wraps(fn)
    def run(*args):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.no_grad(), torch.autocast(device, enabled=False) if device in ("cpu", "cuda") \
                else contextlib.nullcontext():
            if _EAGER_REASON:
                return eager(*args)
            if torch.compiler.is_compiling():   # a user's compiled step: fn joins its graph
                return fn(*args)
            standalone_error = None
            try:
                graph = standalone_graph(args)
                if graph is not None:
                    return graph(*args)
            except Exception as error:   # noqa: BLE001 (traced or compiled: torch.compile is the judge below)
                standalone_error = error
            try:
                result = compiled()(*args)
            except Exception as error:   # noqa: BLE001 (the compiler stack's failures vary by backend)
                failure = error
            else:
                if standalone_error is not None:   # torch.compile ran it: the standalone graph's own failure
                    standalone_failed.append(_reason(standalone_error))
                    _log.info("creditrl: %s compiles through torch.compile from now on (%s)", fn.__name__,
                              standalone_failed[0])
                return result
            result = eager(*args)        # outside the except: a caller's own error raises here, unchained
            warnings.warn(f"creditrl: torch.compile failed ({_reason(failure)}); fused tensor code runs eagerly "
                          "(the same results up to rounding, slower)", RuntimeWarning, stacklevel=2)
            _EAGER_REASON.append(_reason(failure))
            return result
    run.graphs, run.standalone_failed = graphs, standalone_failed   # for tests and diagnostics
    return run
