"""Elementwise chains and the reductions over them as one compiled loop, where compiling works.

Eager PyTorch makes one pass over memory per op, so a chain of pointwise ops and reductions over
[B,T] tensors is bound by memory traffic; inductor fuses it into one loop that reads each input
once. A fused function must be pure tensor code without autograd, correct eagerly too, called on
flat (1-D, ``flat``) or contiguous tensors: then its compiled graphs are few (dynamic sizes; size 1
and each input dtype compile once more). Where compiling fails (no C++ compiler on a CPU, no Triton
on a GPU) it runs as it is, with one warning per process naming the reason.

On a CPU a graph is traced once per ``signature`` and compiled without dynamo
(``torch._inductor.standalone_compile``, as vLLM compiles its graphs); the size conditions the
trace and inductor assumed are checked by a compiled expression, once per argument shapes
(``exact_key``). On the 2-core dev CPU a call on 2 x 8 values took 43-51 us this way and 88-92
through ``torch.compile`` (the eager product 5 us); at B = 1,024, T = 4,096, 0.90-1.13 ms against
0.93-1.23. Skipping the guards for shapes served before saved 8 us more a call (40 against 49 us).
Other devices, and calls with compiling switched off (``_compiling_off``), go through
``torch.compile``; under an outer ``torch.compile`` the function joins the caller's graph.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

_EAGER_REASON: list[str] = []   # why compiling was given up, once per process
_log = logging.getLogger(__name__)
# dynamic_threads: a CPU kernel's loops are parallel whatever the sizes it was first compiled for.
# Without it inductor sizes the parallelism from the first call's shapes, and its graph cache hands
# that kernel to every later call and process: one compiled on a 3 x 5 test batch ran
# single-threaded, 2x slower, on B = 1,024, T = 4,096
_OPTIONS = {"cpp.dynamic_threads": True}
MAX_GRAPHS_PER_SIGNATURE = 8   # as dynamo's recompile limit; past it the function goes through torch.compile


def _reason(error: Exception) -> str:
    # inductor's first line is often only "backend='inductor' raised:": the cause is on the next
    lines = [line.strip() for line in str(error).splitlines() if line.strip()][:2]
    return f"{type(error).__name__}: {' '.join(lines)}"


def flat(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x flat (as ``dtype``) and detached, the form fused functions take: one graph per dtype whatever
    the shape; the last ``detach`` keeps dynamo from guarding on the shape of the tensor a flat view
    was taken of."""
    return x.detach().to(dtype or x.dtype).reshape(-1).detach()


def exact_key(args: tuple) -> tuple | None:
    """Each argument's dtype, sizes and strides; None where an argument is not a contiguous CPU
    tensor without grad (those calls go through ``torch.compile``, whose guards check the rest). A
    standalone graph's guards (``holds``) read nothing else, so the graph that served one call serves
    every call with its key: a dict lookup on it skips ``signature`` and ``holds`` (3.5 us for two
    tensors on the 2-core dev CPU, where those two took 10-14 us)."""
    key = []
    for x in args:
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided or not x.is_cpu or x.requires_grad \
                or not x.is_contiguous():
            return None
        key.append((x.dtype, x.shape, x.stride()))
    return tuple(key)


def signature(args: tuple) -> tuple | None:
    """The key under which one traced graph serves every call: each argument's dtype and rank, its
    sizes as 0, 1 or the number of the first equal size >= 2 (a symbolic trace specialises sizes 0
    and 1, and takes equal sizes for one symbol). None where ``exact_key`` is."""
    exact = exact_key(args)
    if exact is None:
        return None
    numbers: dict[int, int] = {}
    return tuple((dtype, tuple(size if size < 2 else 2 + numbers.setdefault(size, len(numbers)) for size in shape))
                 for dtype, shape, _ in exact)


def _standalone(fn: Callable, args: tuple) -> tuple[Callable[[tuple], bool], Callable]:
    """``fn`` traced symbolically on ``args`` and compiled by inductor without dynamo: (``holds(args)``,
    whether the graph serves a call, ``run(*args)``, a tuple where ``fn`` returns one). The caller
    keys graphs by ``signature``; ``holds`` checks the rest, the size conditions the trace and the
    compile assumed: a branch of ``fn`` on a size, or inductor's own choices (a float32 sum over more
    than 4,096 values takes cascade summation, which a graph compiled on fewer lacks)."""
    graph = make_fx(lambda *xs: fn(*xs), tracing_mode="symbolic")(*args)   # a lambda: no annotation globals
    inputs = [node for node in graph.graph.nodes if node.op == "placeholder"]
    placeholders = [node.meta["val"] for node in inputs]
    # each size symbol becomes a graph input, as dynamo lifts them: inductor's graph cache then keys
    # its kernels by the size conditions they were compiled under and, on a hit, restores them
    symbols: dict = {}
    for i, x in enumerate(placeholders):
        for d, size in enumerate(x.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
                symbols.setdefault(size.node.expr, (i, d, size))
    with graph.graph.inserting_before(inputs[0]):
        for k, (_, _, size) in enumerate(symbols.values()):
            graph.graph.placeholder(f"size{k}").meta["val"] = size
    graph.recompile()
    # "from_graph" compiles in the fake mode it finds on the outputs' example values: the trace's, so
    # inductor's size conditions become guards in the trace's shape environment
    for node in pytree.tree_leaves(graph.graph.output_node().args[0]):
        node.meta["example_value"] = node.meta["val"]
    where = [(i, d) for i, d, _ in symbols.values()]

    def sizes(xs: tuple) -> list[int]:
        return [xs[i].shape[d] for i, d in where]
    compiled = torch._inductor.standalone_compile(graph, sizes(args) + list(args), dynamic_shapes="from_graph",
                                                  options={"config_patches": _OPTIONS})
    shape_env = placeholders[0].fake_mode.shape_env
    # compiled once: the shape environment's own evaluation then costs microseconds (it evals the text)
    code = compile(shape_env.produce_guards_expression(placeholders) or "True", "<fused guards>", "eval")

    def holds(xs: tuple) -> bool:
        return bool(shape_env.evaluate_guards_expression(code, xs))

    def run(*xs):
        out = compiled(*sizes(xs), *xs)
        return out if isinstance(out, torch.Tensor) else tuple(out)
    return holds, run


def _serving(served: list, args: tuple) -> Callable | None:
    return next((run for holds, run in served if holds(args)), None)


MAX_EXACT_KEYS = 256   # calls of that many distinct shapes keep their lookup; past it the table starts over


def _graph_for(graphs: dict[tuple, list], fn: Callable, args: tuple, hits: dict[tuple, Callable]) -> Callable | None:
    """The standalone graph of ``fn`` that serves ``args`` (compiled now where none in ``graphs``
    does), or None where ``args`` go through ``torch.compile`` (``signature``). ``hits`` maps each
    ``exact_key`` served before to its graph. Compiles under dynamo's lock: tracing and inductor
    share process-wide state with any other thread's compile."""
    exact = exact_key(args)
    run = hits.get(exact)
    if run is not None:
        return run
    key = signature(args)                  # None wherever exact is (a test may force it for any call)
    if key is None:
        return None
    run = _serving(graphs.get(key, []), args)
    if run is not None:
        if len(hits) >= MAX_EXACT_KEYS:
            hits.clear()
        hits[exact] = run
        return run
    with torch._dynamo.convert_frame.compile_lock:
        served = graphs.get(key, [])
        run = _serving(served, args)              # another thread may have compiled it meanwhile
        if run is None:
            if len(served) == MAX_GRAPHS_PER_SIGNATURE:
                raise RuntimeError(f"more than {MAX_GRAPHS_PER_SIGNATURE} graphs for one signature")
            # traced and compiled without autograd and autocast, as the other paths run fn (a context
            # entered inside the traced function does not undo a caller's autocast in the trace)
            with _quiet_without_cache(), torch.no_grad(), torch.autocast("cpu", enabled=False):
                holds, run = _standalone(fn, args)
            graphs.setdefault(key, []).append((holds, run))
    return run


class _NoSaveNotice(logging.Filter):
    # standalone_compile logs a warning per graph when inductor's caches are off (nothing to save)
    def filter(self, record: logging.LogRecord) -> bool:
        return "cannot save" not in record.getMessage()


@contextlib.contextmanager
def _quiet_without_cache():
    logger, quiet = logging.getLogger("torch._inductor.standalone_compile"), _NoSaveNotice()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _compiling_off() -> bool:
    """The user's switches under which ``torch.compile`` runs functions as they are: dynamo's
    ``config.disable`` (TORCH_COMPILE_DISABLE=1), TORCHDYNAMO_DISABLE=1, or a stance other than
    "default" (``torch.compiler.set_stance("force_eager")`` ...): those calls go to ``torch.compile``."""
    return (torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE", "") == "1"
            or torch._dynamo.eval_frame._stance.stance != "default")


def _off_the_tape(call: Callable) -> Callable:
    """``call`` without autograd and autocast, for what dispatches op by op (torch.compile's graphs,
    the eager twin). A standalone graph's inputs require no grad (``signature``), and only its extern
    kernels (a matmul) dispatch through autocast: its call enters autocast-off only where autocast is on."""
    def guarded(*args):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.no_grad(), torch.autocast(device, enabled=False) if device in ("cpu", "cuda") \
                else contextlib.nullcontext():
            return call(*args)
    return guarded


def fused(fn: Callable, *, eager: Callable | None = None) -> Callable:
    """``fn`` compiled on first use, or ``eager`` (default ``fn`` itself: the same function, written for
    the compiler; an eager twin may work in place to save passes and must give the same values up to
    rounding) once compiling has failed in this process. A failure of the compiled call counts as the
    compiler's only when the eager function then succeeds on the same arguments; a caller's error (a
    bad shape or device, out of memory) raises as itself and leaves compiling on. On a CPU the graphs
    compile without dynamo (module docstring); where that fails for ``fn`` (its trace or its compile),
    ``fn`` goes through ``torch.compile`` from then on. Runs without autograd and autocast (fewer
    graphs, and nothing to record); inputs as ``flat`` gives them. ``fn`` reads only its tensor
    arguments and constants: a standalone graph keeps what a global held when it was traced."""
    eager = eager or fn
    compiled = functools.cache(lambda: torch.compile(fn, dynamic=True, options=_OPTIONS))
    graphs: dict[tuple, list[tuple[Callable, Callable]]] = {}
    hits: dict[tuple, Callable] = {}
    standalone_failed: list[str] = []

    def standalone_graph(args: tuple) -> Callable | None:
        return None if standalone_failed or _compiling_off() else _graph_for(graphs, fn, args, hits)

    @functools.wraps(fn)
    def run(*args):
        if _EAGER_REASON:
            return _off_the_tape(eager)(*args)
        if torch.compiler.is_compiling():   # a user's compiled step: fn joins its graph
            return _off_the_tape(fn)(*args)
        standalone_error = None
        try:
            graph = standalone_graph(args)
            if graph is not None:
                if torch.is_autocast_enabled("cpu"):
                    with torch.autocast("cpu", enabled=False):
                        return graph(*args)
                return graph(*args)
        except Exception as error:   # noqa: BLE001 (traced or compiled: torch.compile is the judge below)
            standalone_error = error
        try:
            result = _off_the_tape(compiled())(*args)
        except Exception as error:   # noqa: BLE001 (the compiler stack's failures vary by backend)
            failure = error
        else:
            if standalone_error is not None:   # torch.compile ran it: the standalone graph's own failure
                standalone_failed.append(_reason(standalone_error))
                _log.info("creditrl: %s compiles through torch.compile from now on (%s)", fn.__name__,
                          standalone_failed[0])
            return result
        result = _off_the_tape(eager)(*args)   # outside the except: a caller's own error raises here, unchained
        warnings.warn(f"creditrl: torch.compile failed ({_reason(failure)}); fused tensor code runs eagerly "
                      "(the same results up to rounding, slower)", RuntimeWarning, stacklevel=2)
        _EAGER_REASON.append(_reason(failure))
        return result
    run.graphs, run.hits, run.standalone_failed = graphs, hits, standalone_failed   # for tests and diagnostics
    return run
