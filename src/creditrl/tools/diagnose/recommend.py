"""From the measured statistics to the numbers `creditrl diagnose` reports and its recommendation.

Per row (an estimator under a loss), with 95% jackknife intervals over folds of prompts
(``creditrl.core.gradients.gradient_quality``): the relative efficiency at matched signal
(V_b/c_b²)/(V_e/c_e²) against the configured estimator and against the reference (the plain
gradient of ``rloo``, unbiased), the same against the configured one in Adam's geometry (ĝ/√v̂),
the scale c and the cosine of its mean gradient to the reference's (cosine clamped to [-1, 1]), the
raw variance tr Cov(ĝ) (raw: a shrunken gradient lowers it without helping), the fraction of
groups with a non-zero gradient and the estimator's measured cost.

Labels are calibrated for the number of comparisons: "measurably better" / "measurably worse" than
the configured row come from Holm's step-down procedure over the m ranked rows' two-sided jackknife
t-tests of log efficiency = 0 (family-wise error 5%); "biased direction" from Holm over their
one-sided tests of cosine = 1. The recommendation stays the configured estimator unless another row
is measurably better and not biased; among several, the measured cost decides and the report says
that choice is arbitrary in efficiency. The power line: the smallest efficiency ratio each test
detects with 80% probability, ≈ exp((t_{1−α/2m} + t_{0.8}) · se) (Holm's first step, conservative).
Nothing is ranked while the reference's mean gradient is unresolved (below ``RESOLVED_SE`` standard
errors): the efficiencies, scales and cosines are then undefined where its cross-fitted signal is not
positive, and otherwise shown with their (wide) intervals, or undefined where a fold's replicate is.
"""
from __future__ import annotations

import math
import statistics

from creditrl.core.estimators.labels import name_of
from creditrl.core.estimators.registry import get_estimator
from creditrl.core.gradients.quality import EXACT
from creditrl.core.gradients import EstimatorQuality, Interval, gradient_quality, prompt_noise_scale, signal_interval
from creditrl.tools.diagnose.measure import Measurement, RESOLVED_SE
from creditrl.tools.diagnose.plan import ADAM, REF, Plan
from creditrl.utils.stats import holm, t_ppf, t_sf

ALPHA, POWER = 0.05, 0.8


def qualities(stats, plan: Plan, suffix: str = "") -> tuple[dict[str, EstimatorQuality], dict[str, EstimatorQuality]]:
    """(against the reference, against the configured row) for every row of ``stats``."""
    return gradient_quality(stats, REF + suffix), gradient_quality(stats, REF + suffix, plan.configured + suffix)


def row_cost(meas: Measurement, plan: Plan, label: str) -> float:
    """ms per group of the row's estimator's advantages (NaN where not timed)."""
    spent = meas.seconds.get(f"advantages/{plan.row_parts[label][0]}", math.nan)
    return 1e3 * spent / max(len(meas.groups), 1)


def undefined_reason(meas: Measurement, plan: Plan, label: str, q: EstimatorQuality) -> str | None:
    """Why a row's numbers are undefined (None when they are all defined, e.g. an exact relation's)."""
    if all(iv.defined for iv in (q.efficiency, q.scale, q.cosine)):
        return None
    signal = signal_interval(meas.stats, REF)
    if not signal.value > 0:
        return (f"the reference's mean gradient is not resolved above the noise (cross-fitted ‖μ̂‖² = "
                f"{signal.value:.3g} ± {signal.se:.2g}, not positive)")
    if meas.nonzero.get(label, 0) == 0:
        return "its gradient was 0 on every group"
    if not math.isfinite(q.cosine.value):
        return "its own mean gradient is not resolved above the noise (cross-fitted ‖μ̂‖² ≤ 0), so no cosine"
    if q.scale.value <= 0:
        return BACKWARD
    if not all(iv.defined for iv in (q.efficiency, q.scale, q.cosine)):
        z = signal.value / signal.se if signal.se > 0 else math.inf
        unresolved = (f"the reference's mean gradient is not resolved ({z:.1f} standard errors above 0, "
                      f"{RESOLVED_SE:g} needed) and " if z < RESOLVED_SE else "")
        return unresolved + "a delete-one-fold replicate leaves a mean gradient unresolved (interval undefined): more prompts"
    return None


# not a matter of sample size: the report gives this reason without the prompts the trend needs
BACKWARD = ("its mean gradient points away from the reference's (scale c ≤ 0), so no rescaling matches "
            "that signal: no matched-signal variance or efficiency")


def rows(meas: Measurement, plan: Plan) -> list[dict]:
    """One dict per row (module docstring); Intervals stay Intervals."""
    vs_ref, vs_cfg = qualities(meas.stats, plan)
    adam = qualities(meas.adam, plan, ADAM)[1] if meas.adam is not None else None
    out = []
    for label, (estimator, loss) in plan.row_parts.items():
        q = vs_ref[label]
        undefined = undefined_reason(meas, plan, label, q)
        out.append({"row": label, "estimator": estimator, "loss": loss, "ranked": plan.ranked(label),
                    "efficiency_vs_configured": vs_cfg[label].efficiency,
                    "efficiency_vs_rloo": q.efficiency,
                    "adam_vs_configured": adam[label + ADAM].efficiency if adam is not None else None,
                    "scale": q.scale, "cosine": q.cosine.clamped(-1.0, 1.0), "cosine_raw": q.cosine,
                    "raw_variance": q.variance, "raw_ratio_vs_rloo": q.raw_ratio,
                    "nonzero_fraction": meas.nonzero.get(label, 0) / max(len(meas.groups), 1),
                    "needs_energy": get_estimator(name_of(estimator)).needs_energy,
                    "advantage_ms_per_group": row_cost(meas, plan, label),
                    "undefined": undefined,
                    # whether more prompts could define it (the report then gives the trend's count)
                    "undefined_by_sample_size": undefined is not None and undefined != BACKWARD})
    return out


def column_of(table: list[dict], plan: Plan) -> str:
    """The efficiency column the labels and the recommendation use: Adam's when its v̂ comes from a
    training run's optimizer state (the geometry that run's updates feel), else the plain one (a
    short warm-up's v̂ adds its own estimation noise to the Adam column: it informs, not decides)."""
    adam = plan.adam_decides and table and table[0]["adam_vs_configured"] is not None
    return "adam_vs_configured" if adam else "efficiency_vs_configured"


def compared_rows(table: list[dict], plan: Plan, column: str) -> list[dict]:
    """The rows tested against the configured one: ranked, not exact multiples of it (``Interval.exact``:
    rloo itself, dr_grpo = (N−1)/N · rloo, efficiency 1 by construction, so no test: out of Holm's m
    and the power range); none when the configured row is itself not ranked (a max@K objective,
    which the other rows do not estimate)."""
    if not plan.ranked(plan.configured):
        return []
    return [r for r in table if r["ranked"] and r["row"] != plan.configured and not r[column].exact]


def label_rows(table: list[dict], plan: Plan) -> dict:
    """Holm-calibrated labels (module docstring) of the ranked rows against the configured one:
    ``better``, ``worse``, ``biased`` (lists of rows) and the number of comparisons ``m``."""
    column = column_of(table, plan)
    compared = compared_rows(table, plan, column)
    efficiency = holm([r[column].p_value(1.0) for r in compared], ALPHA)
    biased = holm([one_sided_below_one(r["cosine_raw"]) for r in compared], ALPHA)
    out = {"column": column, "m": len(compared), "better": [], "worse": [], "biased": []}
    for r, significant, off in zip(compared, efficiency, biased):
        if significant:
            out["better" if r[column].value > 1 else "worse"].append(r["row"])
        if off:
            out["biased"].append(r["row"])
    configured = next(r for r in table if r["row"] == plan.configured)
    if one_sided_below_one(configured["cosine_raw"]) < ALPHA:
        out["biased"].append(plan.configured)
    return out


def one_sided_below_one(cosine: Interval) -> float:
    """p-value of cosine = 1 against cosine < 1 (jackknife t); 1 when exactly 1, NaN when undefined."""
    if not cosine.defined or cosine.folds < 2:
        return math.nan
    if cosine.se <= EXACT:                # an exact relation (e.g. dr_grpo = (N−1)/N · rloo), up to rounding
        return 1.0 if cosine.value >= 1 - EXACT else 0.0
    return t_sf((1.0 - cosine.value) / cosine.se, cosine.folds - 1)


def power_line(table: list[dict], plan: Plan, labels: dict) -> dict:
    """The smallest efficiency ratio (either way) each comparison detects with 80% probability
    (module docstring): median, smallest and largest over the comparisons whose se is defined."""
    column, m = labels["column"], max(labels["m"], 1)
    ratios = []
    if labels.get("resolved", True):   # no power while nothing can be ranked
        for r in compared_rows(table, plan, column):
            iv = r[column]
            if iv.defined and iv.se > 0 and iv.folds >= 2:
                df = iv.folds - 1
                ratios.append(math.exp((t_ppf(1 - ALPHA / (2 * m), df) + t_ppf(POWER, df)) * iv.se))
    if not ratios:
        return {"median": None, "low": None, "high": None, "comparisons": 0}
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios), "comparisons": len(ratios)}


def cost_key(ms: float) -> float:
    """A measured cost for sorting (unmeasured: last)."""
    return ms if math.isfinite(ms) else math.inf


def recommend(table: list[dict], plan: Plan, meas: Measurement) -> dict:
    """{"choice", "better", "worse", "biased", "column", "m", "text"} (module docstring)."""
    labels = label_rows(table, plan)
    cfg = plan.configured
    signal = signal_interval(meas.stats, REF)
    if not signal.value >= RESOLVED_SE * signal.se or not signal.value > 0:
        text = (f"keep `{cfg}`, the configured estimator: the reference's mean gradient is not resolved "
                f"(cross-fitted ‖μ̂‖² = {signal.value:.3g} ± {signal.se:.2g}, {RESOLVED_SE:.0f} standard errors "
                f"needed), so no estimator can be ranked against it here")
        return {**labels, "better": [], "worse": [], "choice": cfg, "text": text, "resolved": False}
    if not plan.ranked(cfg):
        text = (f"keep `{cfg}`, the configured estimator: it targets the max@K objective, which no other row "
                f"estimates, so none is ranked against it (each row's efficiency against the reference is shown)")
        return {**labels, "choice": cfg, "text": text}
    by_row = {r["row"]: r for r in table}
    candidates = [row for row in labels["better"] if row not in labels["biased"]]
    shunned = [row for row in labels["better"] if row in labels["biased"]]
    family = f"Holm-adjusted over {labels['m']} comparisons, family-wise error 5%"
    if not candidates:
        text = f"keep `{cfg}`, the configured estimator: no other row is measurably more efficient ({family})"
        choice = cfg
    else:
        cheapest = min(candidates, key=lambda row: (cost_key(by_row[row]["advantage_ms_per_group"]), row))
        choice = cheapest
        others = [row for row in candidates if row != cheapest]
        text = (f"use `{cheapest}`: it is measurably more efficient than `{cfg}` at matched signal "
                f"({by_row[cheapest][labels['column']]}, {family})")
        if others:
            text += (f"; so are {', '.join(f'`{o}`' for o in others)}, and among these the measured cost decides "
                     f"(`{cheapest}`: {by_row[cheapest]['advantage_ms_per_group']:.2g} ms per group): the choice "
                     f"among them is arbitrary in efficiency")
    if shunned:
        text += (f". {', '.join(f'`{s}`' for s in shunned)}: measurably more efficient but its mean gradient points "
                 f"measurably away from the reference's (cosine below 1), so not recommended on efficiency alone")
    if labels["worse"]:
        text += f". Measurably less efficient than `{cfg}`: {', '.join(f'`{w}`' for w in labels['worse'])}"
    return {**labels, "choice": choice, "text": text}


BOUNDS = {"within_share": (0.0, 1.0), "snr_gain": (1.0, 2.0), "progress_gain": (1.0, 2.0),
          "noise_scale": (0.0, math.inf)}


def noise(meas: Measurement, plan: Plan) -> dict:
    """B_simple (groups) of the configured row and the effect of doubling the group size, each
    clamped to its possible range (a share to [0, 1], the gains to [1, 2]); ``clamped`` names those
    whose estimate fell outside it."""
    values = prompt_noise_scale(meas.stats, plan.configured, plan.batch)
    clamped = {}
    out = {"estimator": plan.configured, "batch": plan.batch}
    for key, iv in values.items():
        low, high = BOUNDS[key]
        out[key] = iv.clamped(low, high)
        moved = [a != b for a, b in zip((iv.value, iv.low, iv.high), (out[key].value, out[key].low, out[key].high))
                 if math.isfinite(a)]
        if any(moved):
            clamped[key] = iv
    out["clamped"] = clamped
    return out


def informative_fraction(meas: Measurement) -> float:
    return sum(g["informative"] for g in meas.groups) / max(len(meas.groups), 1)
