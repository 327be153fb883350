"""Shared by the gradient-quality experiments (grad-variance, horizon, real-model): estimator labels,
the exact multiples added without a gradient, per-estimator quality rows from ``GradientStats``, and
the matched-signal rule every cross-estimator verdict uses.

Labels: a registered estimator name, ``+loo`` for its ``leave_one_out=True`` form (``otb+loo``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from creditrl.core.estimators.labels import LOO, label_options, takes_k
from creditrl.core.gradients import GradientStats, gradient_quality
from creditrl.runtime.group_gradients import with_derived
from creditrl.tools import tables
from creditrl_research import rules

__all__ = ["LOO", "estimator_specs", "takes_k", "with_derived"]
# statistic -> column name in the quality tables (the raw ratio is labelled as raw everywhere)
COLUMNS = {"efficiency": "efficiency", "scale": "scale c", "cosine": "cosine", "raw_ratio": "raw tr Cov ratio",
           "variance": "tr Cov"}
EFFICIENCY_RULE = ("relative efficiency at matched signal (V_b/c_b²)/(V_e/c_e²), c against {reference}; per "
                   "comparison at each setting and its geometric mean over the settings (95% t-intervals over "
                   "{units}, log scale): a CI below 1{paper} anywhere is a loss, else the geometric mean's CI above "
                   "1 a win, else a tie")


def estimator_specs(labels: Sequence[str], k: int | None = None) -> dict[str, tuple[str, dict]]:
    """label -> (registered name, options): ``+loo`` sets leave_one_out; max@K estimators get ``k``."""
    return {label: label_options(label, k) for label in labels}


def quality_rows(stats: GradientStats, reference: str, baseline: str | None = None, *, per_unit: bool = False,
                 **meta) -> list[tables.Row]:
    """One row per estimator: every statistic of ``gradient_quality`` with its interval over the folds
    (``per_unit``: variances of a unit's sum, for draws that share statistics within a unit)."""
    rows = []
    for name, q in gradient_quality(stats, reference, baseline, per_unit=per_unit).items():
        row = {**meta, "estimator": name, "reference": reference, "baseline": baseline or reference,
               "signal": q.signal}
        for key in COLUMNS:
            iv = getattr(q, key)
            row.update({key: iv.value, f"{key}_low": iv.low, f"{key}_high": iv.high})
        rows.append(row)
    return rows


def cluster_efficiency(values: Sequence[float], unit: str) -> rules.Estimate:
    """Geometric mean of per-cluster efficiencies with its t-interval over the clusters (log scale)."""
    return rules.cluster_ratio_contrast([list(values)], [1.0], unit=unit)


def pooled_efficiency(per_setting: dict[object, Sequence[float]], unit: str) -> tuple[dict, rules.Estimate]:
    """Per setting and pooled (geometric mean over the settings) efficiency with t-intervals over the
    clusters of each setting (Welch df)."""
    settings = list(per_setting)
    each = {s: cluster_efficiency(per_setting[s], unit) for s in settings}
    pooled = rules.cluster_ratio_contrast([list(per_setting[s]) for s in settings],
                                              [1 / len(settings)] * len(settings), unit=unit)
    return each, pooled


def efficiency_text(label: str, each: dict, pooled: rules.Estimate, names: dict) -> str:
    """"label: <setting> eff [CI], ..., geometric mean eff [CI]" (``names``: setting -> its label)."""
    text = ", ".join(f"{names[s]} {e}" for s, e in each.items())
    return f"{label}: {text}" + (f", geometric mean {pooled}" if len(each) > 1 else "")


def finite_or_nan(values: Sequence[float]) -> list[float]:
    return [v if isinstance(v, (int, float)) and math.isfinite(v) else math.nan for v in values]


def load_stats(out_dir: Path) -> list[dict]:
    """An experiment's saved per-setting records (``stats.json``), each with its ``GradientStats`` rebuilt."""
    records = tables.read_json(Path(out_dir) / "stats.json")
    return [{**r, "stats": GradientStats.from_dict(r["stats"])} for r in records]
