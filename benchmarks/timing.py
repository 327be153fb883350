"""Timing helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``)."""
from __future__ import annotations

import ctypes
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


def steady_allocator() -> str:
    """Keep freed memory mapped for the rest of the process (glibc: blocks under 1 GiB come from
    the heap, not fresh mmaps, and the heap is not trimmed below 2 GiB), so a timed call does not
    pay page faults for pages that the call before it handed back to the kernel. On the 2-core dev
    VM a fresh 16 MB buffer costs 1-2 ms of faults, and which callable paid them depended on the
    order of the calls: ratios of 2-5 ms calls moved by up to 2x between runs. Every callable then
    runs on the same allocator; returns what was set, for the benchmark's header."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):     # no glibc (macOS, Windows)
        return "default allocator (no glibc mallopt here)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    mmap_set = mallopt(m_mmap_threshold, 1 << 30) == 1
    trim_set = mallopt(m_trim_threshold, 2**31 - 1) == 1
    if mmap_set and trim_set:
        return "steady allocator (glibc mmap threshold 1 GiB, trim threshold 2 GiB)"
    return (f"partly steady allocator (glibc took: mmap threshold {'yes' if mmap_set else 'no'}, "
            f"trim threshold {'yes' if trim_set else 'no'})")


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
