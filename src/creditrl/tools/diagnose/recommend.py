"""From the measured statistics to the numbers `creditrl diagnose` reports and its recommendation.

Per estimator, against the unbiased reference ``rloo`` (95% jackknife intervals over folds of
prompts, ``creditrl.core.gradients.gradient_quality``): relative efficiency at matched signal
(V_b/c_b²)/(V_e/c_e²) against ``rloo`` and against ``grpo``, scale c and cosine of its mean gradient
to rloo's, the raw variance tr Cov(ĝ) (raw: a shrunken gradient lowers it without helping), the
fraction of groups where it gives a non-zero gradient, its cost. Plus B_simple and the effect of
doubling the group size (``creditrl.core.gradients.prompt_noise_scale``).

The recommendation never goes beyond the intervals: the estimator with the highest efficiency is
recommended only when its efficiency against *every* other estimator (paired, on the same groups)
has an interval above 1; otherwise no estimator is measurably better, and the cheapest of those not
measurably worse than the best is named: one that needs no energy, the highest point efficiency among
those (the advantage computations themselves differ by microseconds). Estimators whose mean gradient
does not point along rloo's (c ≤ 0) are not ranked, nor is anything while rloo's mean gradient is not
resolved above the noise (undefined intervals). max@K estimators target another objective (the max@K
gradient) and are reported but not ranked.
"""
from __future__ import annotations

import math

from creditrl.core.estimators.registry import get_estimator
from creditrl.core.gradients import Interval, gradient_quality, prompt_noise_scale
from creditrl.tools.diagnose.measure import Measurement
from creditrl.tools.diagnose.plan import GRPO, REFERENCE, Plan
from creditrl.core.estimators.labels import name_of, takes_k


def rows(meas: Measurement, plan: Plan) -> list[dict]:
    """One dict per estimator (module docstring); Intervals stay Intervals."""
    stats = meas.stats
    vs_rloo, vs_grpo = gradient_quality(stats, REFERENCE), gradient_quality(stats, REFERENCE, GRPO)
    out = []
    for label in stats.names:
        q = vs_rloo[label]
        spent = meas.seconds.get(f"advantages/{label}", math.nan)
        out.append({"estimator": label, "efficiency_vs_rloo": q.efficiency, "efficiency_vs_grpo":
                    vs_grpo[label].efficiency, "scale": q.scale, "cosine": q.cosine, "raw_variance": q.variance,
                    "raw_ratio_vs_rloo": q.raw_ratio,
                    "nonzero_fraction": meas.nonzero.get(label, meas.nonzero.get(REFERENCE, 0)) / plan.groups,
                    "needs_energy": get_estimator(name_of(label)).needs_energy,
                    "advantage_ms_per_group": 1e3 * spent / plan.groups,
                    "ranked": not takes_k(label)})
    return out


def separated(iv: Interval) -> bool:
    """An efficiency interval wholly above 1."""
    return math.isfinite(iv.low) and iv.low > 1


def recommend(meas: Measurement, table: list[dict]) -> dict:
    """{"best", "separated", "tied", "worse", "choice", "text"} (module docstring)."""
    ranked = [r for r in table if r["ranked"] and math.isfinite(r["efficiency_vs_rloo"].value)
              and r["scale"].value > 0]
    best = max(ranked, key=lambda r: r["efficiency_vs_rloo"].value, default=None)
    if best is None or not math.isfinite(best["efficiency_vs_rloo"].low):
        return {"best": None, "separated": False, "tied": [], "worse": [], "choice": None,
                "text": "no estimator can be ranked: the mean gradient is not resolved above the noise with this many "
                        "groups (intervals undefined); raise diagnose.prompts"}
    paired = {r["estimator"]: gradient_quality(meas.stats, REFERENCE, r["estimator"])[best["estimator"]].efficiency
              for r in table if r["ranked"] and r is not best}
    worse = sorted(e for e, iv in paired.items() if separated(iv))
    tied = sorted(e for e in paired if e not in worse)
    if not tied and paired:
        closest = min(paired.items(), key=lambda kv: kv[1].low)
        text = (f"use `{best['estimator']}`: it is measurably more efficient at matched signal than every other "
                f"estimator here (its efficiency against the closest, `{closest[0]}`, is {closest[1]}; 95% interval "
                f"over prompts), so it needs that many times fewer groups for the same signal-to-noise")
        return {"best": best["estimator"], "separated": True, "tied": [], "worse": worse, "choice": best["estimator"],
                "text": text}
    pool = [r for r in ranked if r["estimator"] in {best["estimator"], *tied}]
    cheapest = min(pool, key=lambda r: (r["needs_energy"], -r["efficiency_vs_rloo"].value))
    why = "needs no energy; the highest point efficiency of those" if not cheapest["needs_energy"] else "all need energy"
    text = (f"no estimator is measurably better here; use the cheapest: `{cheapest['estimator']}` ({why}). The "
            f"highest point efficiency, `{best['estimator']}` ({best['efficiency_vs_rloo']} against rloo), is not separated from {', '.join(f'`{t}`' for t in tied)} by its paired 95% intervals"
            + (f"; measurably worse than it: {', '.join(f'`{w}`' for w in worse)}" if worse else ""))
    return {"best": best["estimator"], "separated": False, "tied": tied, "worse": worse,
            "choice": cheapest["estimator"], "text": text}


def noise(meas: Measurement, plan: Plan) -> dict:
    """B_simple (groups) of the configured estimator and the effect of doubling the group size."""
    label = plan.configured if plan.configured in meas.stats.names else REFERENCE
    return {"estimator": label, "batch": plan.batch, **prompt_noise_scale(meas.stats, label, plan.batch)}


def informative_fraction(meas: Measurement) -> float:
    return sum(g["informative"] for g in meas.groups) / max(len(meas.groups), 1)


def check_informative(meas: Measurement) -> None:
    """Refuse to rank when no group's rewards vary (no estimator has any signal)."""
    if not any(g["informative"] for g in meas.groups):
        raise ValueError(f"task: every group is uninformative ({len(meas.groups)} groups, all with identical "
                         f"rewards within the group): no estimator can be ranked; raise the temperature "
                         f"(rollout.temperature) or pick easier prompts")
