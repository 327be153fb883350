"""Gradient quality at matched signal: variance, scale, alignment and relative efficiency of several
estimators measured on the same draws (definitions: ../shared/notes/gradient-quality.md).

With mu_e = E[g_e] the mean gradient of estimator e and r an unbiased *reference* (``rloo``, any
leave-one-out form, or the exact gradient given as a constant pseudo-estimator), per draw:

    V_e      = E||g_e - mu_e||^2 = tr Cov(g_e)                   raw variance
    c_e      = <mu_e, mu_r> / ||mu_r||^2                         scale along the true gradient (c_r = 1)
    cos_e    = <mu_e, mu_r> / (||mu_e|| ||mu_r||)                alignment
    V_e/c_e^2                                                    variance at matched signal
    eff_e    = (V_b / c_b^2) / (V_e / c_e^2)                      relative efficiency against the baseline b

eff_e > 1: e needs eff_e times fewer draws than b for the same signal-to-noise. Adam-type optimizers
are invariant to a constant gradient scale, so this, not the raw ratio V_e / V_b, is what they feel:
a raw ratio below 1 can come entirely from c_e < 1 (a shrunken gradient).

Estimates from ``GradientStats`` (``moments``), all unbiased in their numerators and denominators:
<mu_e, mu_f> from every ordered pair of draws in *different* units (a U-statistic; ||mean||^2 would be
biased upward by V/n), E[g_e g_f^T] from the draws themselves. Ratios are ratios of these. Intervals:
delete-one-fold jackknife over the K folds of units (t with K - 1 df; variance, matched variance,
efficiency and raw ratio on the log scale, scale and cosine on the linear scale), every ratio
recomputed in each replicate from the same folds. NaN where a denominator's estimate is not positive
(too few draws to see the mean gradient above the noise), and V/c² and efficiency NaN where c <= 0
(the mean step points away from the reference's: no rescaling matches that signal).

Exact relations: where every draw of e is a multiple of f's (rloo's row against the reference,
dr_grpo = (N−1)/N · rloo), c, cos, efficiency and raw ratio between them are identities, not
estimates: they are given exactly (se 0) whether or not the mean gradient is resolved.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from creditrl.core.gradients.moments import GradientStats, name_index
from creditrl.utils.stats import t_quantile, t_sf
from creditrl.utils.validate import check_tensor

BIAS_CORRECTED = ("cosine",)
EXACT = 1e-9      # a standard error below this (relative) is float rounding of an exact relation
# 1 − cos² of two estimators' stacked draws below this: one is a multiple of the other up to float32
# rounding (a relative error δ per draw gives δ² ≲ 1e-12); distinct estimators differ by δ ≫ 1e-5
MULTIPLE_SIN2 = 1e-10
LOG_SCALE = ("variance", "matched_variance", "efficiency", "raw_ratio")
STATISTICS = ("variance", "scale", "cosine", "matched_variance", "efficiency", "raw_ratio", "signal")


@dataclass(frozen=True)
class Interval:
    """A point estimate with its 95% interval over ``folds`` resampling units (0: exact, no interval);
    ``se`` its jackknife standard error on the interval's scale (``log``: of log(value)), NaN when
    the interval is undefined. Printed as "undefined" where a value is NaN, never "nan"."""
    value: float
    low: float
    high: float
    folds: int
    se: float = math.nan
    log: bool = False

    def __str__(self) -> str:
        if not math.isfinite(self.value):
            return "undefined"
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            return f"{self.value:.3g} [interval undefined]"
        return f"{self.value:.3g} [{self.low:.3g}, {self.high:.3g}]"

    @property
    def defined(self) -> bool:
        """Point and interval are finite."""
        return all(math.isfinite(x) for x in (self.value, self.low, self.high))

    @property
    def exact(self) -> bool:
        """An identity, not an estimate (se 0: e.g. between exact multiples, ``exact_multiples``)."""
        return self.defined and self.se == 0.0

    def p_value(self, null: float) -> float:
        """Two-sided p-value of ``value`` = ``null`` from the jackknife t (``folds`` − 1 df); NaN when
        undefined. On the log scale for a ``log`` interval."""
        if not self.defined or self.folds < 2 or not self.se >= 0 or (self.log and not null > 0):
            return math.nan
        centre, zero = (math.log(self.value), math.log(null)) if self.log else (self.value, null)
        if self.se <= EXACT * max(1.0, abs(centre)):    # every replicate equal: an exact relation
            return 1.0 if abs(centre - zero) <= EXACT * max(1.0, abs(zero)) else 0.0
        return min(1.0, 2.0 * t_sf(abs(centre - zero) / self.se, self.folds - 1))

    def clamped(self, low: float, high: float) -> "Interval":
        """The same interval with value and bounds clamped to [low, high] (an estimate of a bounded
        quantity, e.g. a share, can fall outside its range)."""
        def clip(x: float) -> float:
            return x if not math.isfinite(x) else min(max(x, low), high)
        return Interval(clip(self.value), clip(self.low), clip(self.high), self.folds, self.se, self.log)


@dataclass(frozen=True)
class EstimatorQuality:
    """One estimator's quality against ``reference`` (scale, cosine) and ``baseline`` (efficiency,
    raw ratio). ``signal`` is ||mu_e||^2 (no interval: ``cosine`` carries it)."""
    name: str
    reference: str
    baseline: str
    variance: Interval
    scale: Interval
    cosine: Interval
    matched_variance: Interval
    efficiency: Interval
    raw_ratio: Interval
    signal: float


def _statistics(second: Tensor, signal: Tensor, r: int, b: int, weight: Tensor | None = None) -> dict[str, Tensor]:
    """Every statistic for R replicates from E[g_e g_f] and <mu_e, mu_f> estimates [R, E, E] -> name -> [R, E];
    ``weight`` [R] (per unit: sum_u n_u^2 / sum_u n_u) multiplies the signal subtracted from ``second``."""
    centre = signal if weight is None else weight[:, None, None] * signal
    variance = torch.diagonal(second - centre, dim1=1, dim2=2)
    own = torch.diagonal(signal, dim1=1, dim2=2)                      # ||mu_e||^2
    ref = signal[:, :, r]                                             # <mu_e, mu_r>
    ref_norm = own[:, r:r + 1]
    nan = torch.full_like(ref, math.nan)
    scale = torch.where(ref_norm > 0, ref / ref_norm, nan)
    defined = (own > 0) & (ref_norm > 0)
    cosine = torch.where(defined, ref / (own * ref_norm).clamp(min=0).sqrt(), nan)
    # V/c² is a matched-signal variance only for c > 0: with c <= 0 the estimator's mean step points
    # away from the reference's (a positive rescaling, which Adam undoes, cannot align it)
    matched = torch.where(scale > 0, variance / scale.square(), nan)
    return {"variance": variance, "scale": scale, "cosine": cosine, "matched_variance": matched,
            "efficiency": matched[:, b:b + 1] / matched, "raw_ratio": variance / variance[:, b:b + 1],
            "signal": own}


def _unit_second(stats: GradientStats) -> tuple[Tensor, Tensor]:
    """(sum_u s_u s_u^T / sum_u n_u [K+1, E, E], sum_u n_u^2 / sum_u n_u [K+1]) for the full sample and each
    delete-one-fold replicate: ``gradient_quality(per_unit=True)``'s second moment and signal weight."""
    K = stats.draws.numel()
    keep = torch.cat([torch.ones(1, K, dtype=torch.float64), 1 - torch.eye(K, dtype=torch.float64)])
    draws, same_unit = keep @ stats.draws, keep @ stats.same_unit
    return torch.einsum("rk,kef->ref", keep, stats.within) / draws[:, None, None], same_unit / draws


def _replicates(stats: GradientStats) -> tuple[Tensor, Tensor]:
    """(E[g g^T], <mu, mu^T>) estimates [K+1, E, E] for the full sample (row 0) and each delete-one-fold
    jackknife replicate (rows 1..K): per-draw second moments, and the cross products of draws in
    different units over their number of ordered pairs n^2 - sum_u n_u^2."""
    K = stats.draws.numel()
    keep = torch.cat([torch.ones(1, K, dtype=torch.float64), 1 - torch.eye(K, dtype=torch.float64)])  # [K+1, K]
    draws, same_unit = keep @ stats.draws, keep @ stats.same_unit
    second = torch.einsum("rk,kef->ref", keep, stats.second) / draws[:, None, None]
    cross = torch.einsum("rk,rh,khef->ref", keep, keep, stats.cross) - torch.einsum("rk,kef->ref", keep, stats.within)
    return second, cross / (draws * draws - same_unit)[:, None, None]


def _interval(full: float, replicates: Tensor, log: bool, bias_correct: bool = False) -> Interval:
    """Jackknife t-interval around ``full`` from the K delete-one-fold values: NaN bounds when K < 2
    or a value is not finite (or, on the log scale, not positive)."""
    K = replicates.numel()
    if log:
        if not full > 0 or not bool((replicates > 0).all()):
            return Interval(full, math.nan, math.nan, K)
        x, centre = replicates.log(), math.log(full)
    else:
        x, centre = replicates, full
    if K < 2 or not math.isfinite(centre) or not bool(torch.isfinite(x).all()):
        return Interval(full, math.nan, math.nan, K)
    if bias_correct:          # Quenouille's jackknife: removes the O(1/n) bias of a nonlinear statistic
        centre = K * centre - (K - 1) * float(x.mean())
        full = math.exp(centre) if log else centre
    se = math.sqrt((K - 1) / K * float((x - x.mean()).square().sum()))
    half = t_quantile(K - 1) * se
    low, high = centre - half, centre + half
    return Interval(full, math.exp(low), math.exp(high), K, se, True) if log else Interval(full, low, high, K, se)


def gradient_quality(stats: GradientStats, reference: str = "rloo", baseline: str | None = None,
                     per_unit: bool = False) -> dict[str, EstimatorQuality]:
    """Per estimator of ``stats``: V, c, cos, V/c², efficiency and raw ratio against ``baseline``
    (default: ``reference``), with jackknife intervals over the folds (module docstring).

    ``per_unit``: V is the variance of a unit's sum per draw, V_u = Σ_u tr Cov(s_u) / Σ_u n_u, estimated
    by tr(Σ_u s_u s_u^T − Σ_u n_u² μμ^T) / Σ_u n_u: for units of B draws, B × tr Cov of their mean. It
    equals the per-draw V when the draws of a unit are independent, and adds their covariance when
    they are not (a batch-level estimator's groups share the batch's statistics: the unit is the
    batch, and V_u is the variance a step of that batch feels, per group)."""
    r = stats.index(reference, "reference")
    b = stats.index(baseline or reference, "baseline")
    pairs = float(stats.draws.sum() ** 2 - stats.same_unit.sum())
    if not pairs > 0:
        raise ValueError("stats: expected draws from at least 2 independent units (the mean gradient is "
                         f"cross-fitted between units), got {float(stats.draws.sum()):.0f} draw(s) in one unit")
    kept = stats.nonempty()
    second, signal = _replicates(kept)
    weight = None
    if per_unit:
        second, weight = _unit_second(kept)
    values = _statistics(second, signal, r, b, weight)
    factor = exact_multiples(stats)
    K = int(kept.draws.numel())
    out = {}
    for e, name in enumerate(stats.names):
        fields = {key: _interval(float(values[key][0, e]), values[key][1:, e], key in LOG_SCALE, key in BIAS_CORRECTED)
                  for key in STATISTICS if key != "signal"}
        if math.isfinite(c := factor[e][r]):
            fields.update(scale=_exact(c, K), cosine=_exact(math.copysign(1.0, c), K))
        if math.isfinite(c := factor[e][b]):
            efficiency = _exact(1.0, K, log=True) if c > 0 else Interval(math.nan, math.nan, math.nan, K)
            fields.update(efficiency=efficiency, raw_ratio=_exact(c * c, K, log=True))
        out[name] = EstimatorQuality(name, reference, baseline or reference, signal=float(values["signal"][0, e]),
                                     **fields)
    return out


def exact_multiples(stats: GradientStats) -> list[list[float]]:
    """[E][E]: c where every draw of estimator e is c × f's (``MULTIPLE_SIN2``), else NaN; read from
    the per-draw second moments Q = Σ_k g_k g_k^T: the draws are multiples iff Q_ef² = Q_ee Q_ff."""
    q = stats.second.sum(0)
    d = torch.diagonal(q)
    outer = d[:, None] * d[None, :]
    multiple = (outer > 0) & (1 - q.square() / outer.clamp(min=torch.finfo(q.dtype).tiny) <= MULTIPLE_SIN2)
    return torch.where(multiple, q / d[None, :].clamp(min=torch.finfo(q.dtype).tiny), math.nan).tolist()


def _exact(value: float, folds: int, log: bool = False) -> Interval:
    """An identity: the value with a zero-width interval (se 0)."""
    return Interval(value, value, value, folds, 0.0, log)


def signal_interval(stats: GradientStats, name: str) -> Interval:
    """The cross-fitted ‖mu_name‖² (pairs of draws in different units, unbiased) with its jackknife
    interval over the folds (linear scale): resolved above the noise when value >= 3 se."""
    e = stats.index(name)
    stats = stats.nonempty()
    if stats.draws.numel() < 1 or not float(stats.draws.sum() ** 2 - stats.same_unit.sum()) > 0:
        return Interval(math.nan, math.nan, math.nan, int(stats.draws.numel()))
    _, signal = _replicates(stats)
    own = signal[:, e, e]
    return _interval(float(own[0]), own[1:], False)


def exact_quality(names: tuple[str, ...] | list[str], grads: Tensor, probs: Tensor, reference: str = "rloo",
                  baseline: str | None = None) -> dict[str, EstimatorQuality]:
    """Population values (no sampling) from every outcome of a draw: grads [M, E, D] with
    probabilities probs [M] (e.g. every outcome of a group on an enumerable policy): non-negative,
    summing to 1 within M rounding steps of their dtype."""
    check_tensor("grads", grads, ndim=3)
    check_tensor("probs", probs, shape=[grads.shape[0]], floating=True)
    names = tuple(names)
    if len(names) != grads.shape[1]:
        raise ValueError(f"names: expected one name per estimator of grads [M, E, D] ({grads.shape[1]}), "
                         f"got {len(names)}: {list(names)}")
    total, tol = float(probs.double().sum()), grads.shape[0] * torch.finfo(probs.dtype).eps
    if not bool((probs >= 0).all()) or not abs(total - 1) <= tol:
        raise ValueError(f"probs: expected non-negative probabilities summing to 1 (within {tol:.1g}), got "
                         f"min {float(probs.min()):.6g} and sum {total:.10g}")
    g, p = grads.to(torch.float64), probs.to(torch.float64)
    mean = torch.einsum("m,med->ed", p, g)
    second = torch.einsum("m,med,mfd->ef", p, g, g)
    r, b = name_index(names, reference, "reference"), name_index(names, baseline or reference, "baseline")
    values = _statistics(second[None], (mean @ mean.T)[None], r, b)
    out = {}
    for e, name in enumerate(names):
        exact = {k: Interval(float(values[k][0, e]), float(values[k][0, e]), float(values[k][0, e]), 0)
                 for k in STATISTICS if k != "signal"}
        out[name] = EstimatorQuality(name, reference, baseline or reference, signal=float(values["signal"][0, e]),
                                     **exact)
    return out
