"""Timing helper shared by the benchmark scripts (run as ``python benchmarks/<script>.py``)."""
from __future__ import annotations

import statistics
import time


def interleaved(fns: dict, repeats: int, *, settle: int = 0) -> dict:
    """Median seconds per callable, calling them in turn for ``repeats`` rounds (after a warm-up).
    ``settle`` untimed calls precede each timed one, so a callable is not charged for the
    allocator state (freed and trimmed memory) that the previous one left behind."""
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
    return {name: statistics.median(t) for name, t in times.items()}
