"""Timing helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``)."""
from __future__ import annotations

import platform
import statistics
import time


def interleaved_samples(fns: dict, repeats: int, *, settle: int = 0) -> dict[str, list[float]]:
    """Seconds of each of ``repeats`` timed calls per callable, calling them in turn (after a
    warm-up). ``settle`` untimed calls precede each timed one, so a callable is not charged for
    the allocator state (freed and trimmed memory) that the previous one left behind."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            for _ in range(settle):
                fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved(fns: dict, repeats: int, *, settle: int = 0) -> dict:
    """Median seconds per callable of ``interleaved_samples``."""
    return {name: statistics.median(t) for name, t in interleaved_samples(fns, repeats, settle=settle).items()}


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), with bf16/AMX support as the kernel reports it."""
    try:
        with open("/proc/cpuinfo") as fh:
            info = fh.read()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    units = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(units) or 'no AVX-512'})"
