"""Durations as people read them: a 1.3 s run is not "0.0 min", a 3-hour one not "180.0 min"."""
from __future__ import annotations

import math
from numbers import Real


def format_duration(seconds: float) -> str:
    """``seconds`` (finite, >= 0) in the largest unit that keeps it >= 1: "1.3 s" below a minute,
    "4.2 min" below an hour, "1.5 h" from there, each to one decimal. Rounding never yields
    "60.0 s" or "60.0 min": a value that would round to the next unit's 1.0 is shown in it."""
    if not isinstance(seconds, Real) or isinstance(seconds, bool) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"seconds: expected a finite number >= 0, got {seconds!r}")
    if round(seconds, 1) < 60:
        return f"{seconds:.1f} s"
    if round(seconds / 60, 1) < 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
