"""The verdict half of the research reports: intervals, bootstrap, paired and clustered ratios, the
pre-registered outcome rules, ``Verdict`` and the environment line of docs/results.md."""
from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from creditrl.tools.tables import fmt, markdown_table
from creditrl.utils.stats import t_quantile


def mean_se(x: Tensor) -> tuple[float, float]:
    """Mean and standard error over dim 0 of a 1-D sample (SE 0 for a single value)."""
    x = x.double().flatten()
    se = float(x.std(unbiased=True) / math.sqrt(x.numel())) if x.numel() > 1 else 0.0
    return float(x.mean()), se


def bootstrap_ci(statistic: Callable[[Tensor], Tensor], n: int, *, n_boot: int = 1000, level: float = 0.95,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Percentile bootstrap CI of ``statistic(idx)`` over resamples of ``n`` units with replacement.

    ``statistic`` maps a [R, n] index tensor (R resamples of unit indices) to [R, ...];
    returns (low, high) with shape [...]. Vectorised: one call evaluates every resample.
    """
    values = statistic(torch.randint(0, n, (n_boot, n), generator=generator)).double()
    alpha = (1.0 - level) / 2
    q = torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)
    low, high = torch.nanquantile(values, q, dim=0)  # resamples with a 0/0 ratio are dropped
    return low, high


def ranks(x: Tensor) -> Tensor:
    """Ranks 0..n-1 of a 1-D tensor, ties get their average rank."""
    values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    start = counts.cumsum(0) - counts
    return (start.double() + (counts.double() - 1) / 2)[inverse]


def pearson(x: Tensor, y: Tensor) -> float:
    """Pearson correlation of two 1-D samples; NaN when one is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = (x.norm() * y.norm()).item()
    return float((x * y).sum() / denom) if denom > 0 else float("nan")


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman rank correlation (Pearson of the average ranks)."""
    return pearson(ranks(x), ranks(y))


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of log y against log x (e.g. -0.5 for an M^-1/2 decay)."""
    lx = torch.log(torch.tensor(x, dtype=torch.float64))
    ly = torch.log(torch.tensor(y, dtype=torch.float64))
    lx = lx - lx.mean()
    return float((lx * (ly - ly.mean())).sum() / (lx * lx).sum())


OUTCOMES = ("reproduces", "partly", "does not reproduce", "inconclusive")

POWER_FACTOR = 2.8  # z_{0.975} + z_{0.80}: an effect of 2.8 SE is detected with 80% power at α = 0.05


def tail_index(x: Sequence[float] | Tensor, fraction: float = 0.1) -> float:
    """Hill's estimator of the tail index α of positive samples from their largest k = ⌈fraction·n⌉:
    α̂ = k / Σ_{i<k} log(x_(i) / x_(k)) (x sorted descending). For a Pareto tail P(X > x) ∝ x^−α;
    α < 2 means X has no finite variance, so the CLT (and the bootstrap) do not hold for its mean."""
    v = torch.as_tensor(x, dtype=torch.float64).flatten()
    v = v[v > 0].sort(descending=True).values
    k = math.ceil(fraction * v.numel())
    if not 0 < fraction < 1 or k < 2 or k >= v.numel():
        raise ValueError(f"x, fraction: expected more than {k} positive samples with 0 < fraction < 1, got "
                         f"{v.numel()} positive samples and fraction={fraction}")
    return float(k / (v[:k] / v[k]).log().sum())


def t_975(df: float) -> float:
    """t_{0.975, df} for a real df (floored; inf: the normal's 1.96; below 1: inf)."""
    return 1.96 if df == math.inf else t_quantile(math.floor(df + 1e-9)) if math.isfinite(df) else math.nan


@dataclass(frozen=True)
class Estimate:
    """A number with its 95% interval and the smallest effect the sample can detect.

    ``df``: the degrees of freedom of the interval's t quantile (inf: a normal or bootstrap interval; NaN:
    not stated); ``log``: the interval is built on the log scale (a ratio). With them ``se`` is read back
    from the interval, which is what pooling over seed sets (``pool_sets``) needs."""
    value: float
    low: float
    high: float
    detectable: float            # POWER_FACTOR × SE: the effect found with 80% power at α = 0.05
    n: int                       # independent units (seeds, blocks, instances)
    unit: str = "seeds"
    df: float = math.nan
    log: bool = False

    def __str__(self) -> str:
        if math.isnan(self.value):
            return "undefined"
        return f"{fmt(self.value)} [{fmt(self.low)}, {fmt(self.high)}]"

    @property
    def center(self) -> float:
        """The value on the interval's scale (log for a ratio; NaN where a ratio is not positive)."""
        return (math.log(self.value) if self.value > 0 else math.nan) if self.log else self.value

    @property
    def se(self) -> float:
        """Standard error on the interval's scale: half the interval's width over its t quantile (inf for
        an unbounded interval, NaN where the value or df is unknown). For a percentile bootstrap interval
        (df inf) this reads the width as a normal interval's, an approximation where it is skewed."""
        if math.isnan(self.value) or math.isnan(self.df) or math.isnan(self.low) or math.isnan(self.high):
            return math.nan
        if self.log and self.low <= 0 or not (math.isfinite(self.low) and math.isfinite(self.high)):
            return math.inf
        g = math.log if self.log else float
        return (g(self.high) - g(self.low)) / (2 * t_975(self.df))


def paired_difference(a: Sequence[float], b: Sequence[float], unit: str = "seeds") -> Estimate:
    """Mean of the paired differences a_i − b_i with a t-interval (the units pair up: same seed,
    same checkpoint); NaN pairs are dropped. With one pair the interval is infinite."""
    if len(a) != len(b):
        raise ValueError(f"a, b: expected paired samples of equal length, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b) if math.isfinite(x) and math.isfinite(y)]
    if not d:
        return Estimate(math.nan, math.nan, math.nan, math.nan, 0, unit)
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else math.inf
    half = t_quantile(len(d) - 1) * se
    return Estimate(mean, mean - half, mean + half, POWER_FACTOR * se, len(d), unit, df=len(d) - 1)


def mean_estimate(values: Sequence[float], unit: str = "seeds") -> Estimate:
    """Mean of one sample with its t-interval (a gain against 0): ``paired_difference`` against 0."""
    return paired_difference(values, [0.0] * len(values), unit)


def paired_ratio(a: Sequence[float] | Tensor, b: Sequence[float] | Tensor, *, n_boot: int = 2000,
                 unit: str = "seeds", seed: int = 0) -> Estimate:
    """mean(a) / mean(b) over paired units (same seed, block or instance) with a paired percentile
    bootstrap CI: each resample draws units, keeping a_i with b_i. Resamples whose denominator is 0
    are dropped (NaN ratio); an empty or zero-denominator sample gives NaN."""
    a = torch.as_tensor(a, dtype=torch.float64).flatten()
    b = torch.as_tensor(b, dtype=torch.float64).flatten()
    if a.shape != b.shape:
        raise ValueError(f"a, b: expected paired samples of equal length, got {a.numel()} and {b.numel()}")
    if a.numel() == 0 or float(b.sum()) == 0.0:
        return Estimate(math.nan, math.nan, math.nan, math.nan, a.numel(), unit)
    nan = torch.tensor(math.nan, dtype=torch.float64)

    def ratio(idx: Tensor) -> Tensor:
        den = b[idx].sum(-1)
        return a[idx].sum(-1) / den.where(den != 0, nan)

    low, high = bootstrap_ci(ratio, a.numel(), n_boot=n_boot, generator=torch.Generator().manual_seed(seed))
    return Estimate(float(a.sum() / b.sum()), float(low), float(high), math.nan, a.numel(), unit, df=math.inf,
                    log=True)


def cluster_ratio_contrast(ratios: Sequence[Sequence[float]], weights: Sequence[float],
                           unit: str = "checkpoints") -> Estimate:
    """exp(Σ_s w_s · mean_c log r_{s,c}) for positive ratios r_{s,c} measured in independent clusters c
    (e.g. warm-start checkpoints) of settings s, with a Welch t-interval over the clusters:
    SE² = Σ_s w_s² var_c(log r_{s,c}) / C_s, df by Welch–Satterthwaite (rounded down).

    The clusters' spread holds both the sampling noise within a cluster and the variation between
    clusters, so the interval speaks for other clusters (other warm starts); with few clusters it
    is wide (t with C − 1 df), where a percentile bootstrap over 3 clusters is far too narrow.
    ``weights`` (1,): one setting's geometric-mean ratio; (1/S, ...): the geometric mean over S
    settings; (1, −1): one setting's ratio over another's. NaN if a ratio is not positive and
    finite; an infinite interval if a setting has one cluster."""
    if len(ratios) != len(weights) or not ratios:
        raise ValueError(f"ratios, weights: expected one weight per setting (at least one), got {len(ratios)} "
                         f"settings and {len(weights)} weights")
    logs = [torch.as_tensor(r, dtype=torch.float64).flatten() for r in ratios]
    n = sum(x.numel() for x in logs)
    if any(x.numel() == 0 or not bool(((x > 0) & x.isfinite()).all()) for x in logs):
        return Estimate(math.nan, math.nan, math.nan, math.nan, n, unit)
    logs = [x.log() for x in logs]
    value = sum(w * float(x.mean()) for w, x in zip(weights, logs))
    if any(x.numel() < 2 for x in logs):
        return Estimate(math.exp(value), 0.0, math.inf, math.inf, n, unit, df=0, log=True)
    terms = [w * w * float(x.var(unbiased=True)) / x.numel() for w, x in zip(weights, logs)]
    se2 = sum(terms)
    df = se2 * se2 / sum(t * t / (x.numel() - 1) for t, x in zip(terms, logs)) if se2 > 0 else math.inf
    # df rounded down (conservative); the 1e-9 keeps an exact integer df (equal spreads) from rounding error
    df = max(1, math.floor(df + 1e-9)) if math.isfinite(df) else math.inf
    half = t_975(df) * math.sqrt(se2)
    return Estimate(math.exp(value), math.exp(value - half), math.exp(value + half), math.nan, n, unit, df=df,
                    log=True)


def pool_sets(estimates: Sequence[Estimate]) -> Estimate:
    """One statistic measured in independent replicates of a design (seed sets), pooled as the
    pre-registered secondary analysis: the random-effects mean (DerSimonian–Laird) on the estimates'
    interval scale (log for a ratio), y_k with standard errors s_k read from each set's interval
    (``Estimate.se``) and df_k its t quantile's degrees of freedom:

        w_k = 1/s_k², Q = Σ w_k (y_k − ȳ_w)², τ² = max(0, (Q − (K − 1)) / (Σw − Σw²/Σw)),
        w*_k = 1/(s_k² + τ²), ȳ = Σ w*_k y_k / Σ w*_k, V = 1/Σ w*_k,

    interval ȳ ± t_{0.975, df} √V with Satterthwaite's df: V² / (Σ_k (c_k² s_k²)²/df_k + (τ² Σ c_k²)²/(K − 1)),
    c_k = w*_k / Σ w* (τ²'s term only when τ² > 0: its K − 1 df). With τ² = 0 this is the inverse-variance
    mean, and equal sets of df_k each give df Σ df_k; a spread between the sets beyond their own
    intervals widens the interval. Sets where the statistic is undefined (NaN) or unbounded (one cluster)
    carry no weight; an exact statistic (s = 0) in every set pools to the mean. NaN if no set is usable."""
    used = [e for e in estimates if math.isfinite(e.center) and not math.isnan(e.se) and e.se < math.inf]
    if not used:
        return Estimate(math.nan, math.nan, math.nan, math.nan, 0, estimates[0].unit if estimates else "seeds")
    if len({e.log for e in used}) > 1:
        raise ValueError(f"estimates: expected one scale (all ratios or all differences), got log={[e.log for e in used]}")
    log, unit, n, k = used[0].log, used[0].unit, sum(e.n for e in used), len(used)
    back = math.exp if log else float
    if any(e.se == 0 for e in used):   # an exact statistic (e.g. Dr.GRPO ≡ RLOO): no spread to pool
        y = sum(e.center for e in used if e.se == 0) / sum(e.se == 0 for e in used)
        return Estimate(back(y), back(y), back(y), 0.0, n, unit, df=math.inf, log=log)
    y = [e.center for e in used]
    s2 = [e.se ** 2 for e in used]
    w = [1 / v for v in s2]
    fixed = sum(wi * yi for wi, yi in zip(w, y)) / sum(w)
    q = sum(wi * (yi - fixed) ** 2 for wi, yi in zip(w, y))
    tau2 = max(0.0, (q - (k - 1)) / (sum(w) - sum(wi * wi for wi in w) / sum(w))) if k > 1 else 0.0
    ws = [1 / (v + tau2) for v in s2]
    mean = sum(wi * yi for wi, yi in zip(ws, y)) / sum(ws)
    var = 1 / sum(ws)
    c = [wi / sum(ws) for wi in ws]
    parts = sum((ci * ci * v) ** 2 / e.df for ci, v, e in zip(c, s2, used) if e.df < math.inf)
    if tau2 > 0:
        parts += (tau2 * sum(ci * ci for ci in c)) ** 2 / (k - 1)
    df = var * var / parts if parts > 0 else math.inf
    half = t_975(max(1.0, df)) * math.sqrt(var)
    detectable = POWER_FACTOR * math.sqrt(var) if not log else math.nan
    return Estimate(back(mean), back(mean - half), back(mean + half), detectable, n, unit,
                    df=max(1, math.floor(df + 1e-9)) if math.isfinite(df) else df, log=log)


def interval_outcome(est: Estimate, claimed: str = ">", null: float = 0.0, paper: float | None = None) -> str:
    """The fixed rule for one effect claimed to lie on side ``claimed`` of ``null`` ('>' above, '<'
    below; null 0 for a difference, 1 for a ratio): reproduces if the 95% interval lies on the
    claimed side, does not reproduce if on the other, inconclusive if it covers ``null`` (a point
    estimate on the right side alone is not evidence) — unless the paper states the effect's size
    (``paper``, on the claimed side, in our units): an interval that covers ``null`` but stops short
    of ``paper`` excludes the paper's effect, and does not reproduce it at the paper's size.
    Inconclusive thus means what it says: the interval holds both no effect and the paper's."""
    if claimed not in (">", "<"):
        raise ValueError(f"claimed: expected '>' or '<', got {claimed!r}")
    sign = 1.0 if claimed == ">" else -1.0
    if paper is not None and not sign * (paper - null) > 0:
        raise ValueError(f"paper: expected the paper's effect on the claimed side ({claimed}) of {null}, got {paper}")
    if not (math.isfinite(est.low) and math.isfinite(est.high)):
        return "inconclusive"
    low, high = (est.low - null, est.high - null) if claimed == ">" else (null - est.high, null - est.low)
    if low > 0:
        return "reproduces"
    if high < 0 or (paper is not None and high < sign * (paper - null)):
        return "does not reproduce"
    return "inconclusive"


def combined_outcome(outcomes: Sequence[str]) -> str:
    """All sub-claims reproduce: reproduces; some do: partly; none does and one contradicts:
    does not reproduce; otherwise inconclusive."""
    if outcomes and all(o == "reproduces" for o in outcomes):
        return "reproduces"
    if "reproduces" in outcomes:
        return "partly"
    return "does not reproduce" if "does not reproduce" in outcomes else "inconclusive"


def ratios_below_one(estimates: Sequence[Estimate], paper: float | None = None) -> str:
    """The claim "ratio < 1" over several settings (lengths, rivals): each ratio's CI below 1 is a
    win, above 1 (or above the paper's ratio ``paper``, see ``interval_outcome``) a loss; all wins
    reproduces, some partly, none with a loss does not, else inconclusive."""
    return combined_outcome([interval_outcome(e, "<", null=1.0, paper=paper) for e in estimates])


def pooled_ratio_outcome(per_setting: Sequence[Estimate], pooled: Estimate, paper: float | None = None,
                         claimed: str = "<") -> str:
    """One comparison "ratio < 1" (``claimed`` '>': "ratio > 1", e.g. an efficiency) measured in several
    settings (e.g. response lengths) and pooled over them (``pooled``, e.g. ``cluster_ratio_contrast``):
    a loss anywhere (a CI on the wrong side of 1, or one that excludes the paper's ratio ``paper``, see
    ``interval_outcome``) does not reproduce; otherwise the pooled CI decides (on the claimed side of 1
    reproduces, else inconclusive). Pooling gives a small common effect the power that each setting
    alone lacks, while a setting where the effect reverses still counts against it."""
    outcomes = [interval_outcome(e, claimed, null=1.0, paper=paper) for e in (*per_setting, pooled)]
    return "does not reproduce" if "does not reproduce" in outcomes else outcomes[-1]


Decide = Callable[[Mapping[str, Estimate]], str]


@dataclass(frozen=True)
class Verdict:
    """One pre-registered claim: its paper source, the paper's number, ours with its interval,
    the rule fixed in code before the run, the outcome, and the sample's power.

    ``statistics`` (name -> Estimate) and ``decide`` (the rule as a function of them) make the verdict
    poolable over seed sets (``pooled_verdict``); ``condition_met`` False: the rule's precondition on the
    setting failed (the outcome is then inconclusive). Given ``decide``, the outcome must be what it
    gives on ``statistics``: the pooled analysis applies the very rule the verdict was decided by."""
    claim: str
    source: str                  # paper and section, e.g. "OTB §5.3"
    paper: str                   # the paper's own number or statement
    ours: str                    # our number with its 95% interval
    rule: str
    outcome: str
    power: str                   # smallest effect this sample size detects
    note: str = ""               # what the reader must know (why inconclusive, contrary evidence)
    statistics: Mapping[str, Estimate] = field(default_factory=dict, compare=False)
    decide: Decide | None = field(default=None, compare=False)
    condition_met: bool = True

    def __post_init__(self):
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome: expected one of {OUTCOMES}, got {self.outcome!r}")
        if self.decide is not None:
            ruled = self.decide(self.statistics) if self.condition_met else "inconclusive"
            if ruled != self.outcome:
                raise ValueError(f"decide: expected the rule on the verdict's statistics to give its outcome "
                                 f"{self.outcome!r}, got {ruled!r} ({self.claim})")

    def markdown(self) -> str:
        """The section's verdict paragraph: bold head, our number, rule, power, note."""
        note = f" {self.note}" if self.note else ""
        return (f"**{self.claim} ({self.source}): {self.outcome}.** Ours: {self.ours}; paper: {self.paper}. "
                f"Rule: {self.rule}. Power: {self.power}.{note}\n")


POOLING_RULE = ("each statistic of a verdict pooled over the seed sets that ran it (random-effects mean, "
                "DerSimonian–Laird, on the interval's scale; `rules.pool_sets`), then the verdict's own rule applied "
                "to the pooled statistics; a rule's precondition on the setting must hold in every set")


def pooled_verdict(verdicts: Sequence[Verdict]) -> tuple[str, str]:
    """(outcome, text) of the pre-registered secondary analysis over one claim's verdicts in several seed
    sets (``POOLING_RULE``). Not poolable (outcome "—" with the reason): a single set, a verdict without
    ``decide`` (its rule reads no interval), or sets whose statistics differ."""
    if len(verdicts) < 2:
        return "—", "one seed set"
    if any(v.decide is None for v in verdicts):
        return "—", "not pooled: its rule reads no interval"
    names = list(verdicts[0].statistics)
    if any(list(v.statistics) != names for v in verdicts[1:]):
        return "—", "not pooled: the seed sets measured different statistics"
    pooled = {name: pool_sets([v.statistics[name] for v in verdicts]) for name in names}
    text = "; ".join(f"{name} {est}" for name, est in pooled.items())
    failed = sum(not v.condition_met for v in verdicts)
    if failed:
        return "inconclusive", f"{text} (the rule's condition failed in {failed} of {len(verdicts)} sets)"
    return verdicts[0].decide(pooled), text


def summary_table(verdicts: Sequence[Verdict]) -> str:
    """The results' head table: every claim with the paper's number, ours with CI, verdict."""
    rows = [{"claim": f"{v.claim} ({v.source})", "paper": v.paper, "ours (95% CI)": v.ours,
             "verdict": f"**{v.outcome}**"} for v in verdicts]
    return markdown_table(rows)


def environment(threads: int, seeds: Sequence[int]) -> dict:
    """Machine, library versions, threads and seeds of a run (recorded next to its results)."""
    return {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "system": platform.system(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": int(threads), "seeds": [int(s) for s in seeds]}


def environment_line(env: dict) -> str:
    return (f"Ran on {env['cpus']} CPUs ({env['processor']}, {env['system']}), Python {env['python']}, torch "
            f"{env['torch']}, {env['threads']} torch thread(s), seeds {env['seeds']}.")
