"""Student-t quantiles for 95% intervals (no scipy dependency for one table)."""
from __future__ import annotations

import math

# two-sided 95% Student-t quantiles t_{0.975, df}, df = 1..30 (beyond: the normal 1.96)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t_quantile(df: int) -> float:
    """t_{0.975, df} (two-sided 95%); inf for df < 1 (no interval from one sample)."""
    return math.inf if df < 1 else _T975[df - 1] if df <= len(_T975) else 1.96
