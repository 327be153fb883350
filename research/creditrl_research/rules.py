"""The verdict half of the research reports: intervals, bootstrap, paired and clustered ratios, the
pre-registered outcome rules, ``Verdict`` and the environment line of docs/results.md."""
from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass
from typing import Callable, Sequence

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


@dataclass(frozen=True)
class Estimate:
    """A number with its 95% interval and the smallest effect the sample can detect."""
    value: float
    low: float
    high: float
    detectable: float            # POWER_FACTOR × SE: the effect found with 80% power at α = 0.05
    n: int                       # independent units (seeds, blocks, instances)
    unit: str = "seeds"

    def __str__(self) -> str:
        if math.isnan(self.value):
            return "undefined"
        return f"{fmt(self.value)} [{fmt(self.low)}, {fmt(self.high)}]"


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
    return Estimate(mean, mean - half, mean + half, POWER_FACTOR * se, len(d), unit)


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
    return Estimate(float(a.sum() / b.sum()), float(low), float(high), math.nan, a.numel(), unit)


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
        return Estimate(math.exp(value), 0.0, math.inf, math.inf, n, unit)
    terms = [w * w * float(x.var(unbiased=True)) / x.numel() for w, x in zip(weights, logs)]
    se2 = sum(terms)
    df = se2 * se2 / sum(t * t / (x.numel() - 1) for t, x in zip(terms, logs)) if se2 > 0 else math.inf
    # df rounded down (conservative); the 1e-9 keeps an exact integer df (equal spreads) from rounding error
    half = t_quantile(max(1, math.floor(df + 1e-9)) if math.isfinite(df) else 10**6) * math.sqrt(se2)
    return Estimate(math.exp(value), math.exp(value - half), math.exp(value + half), math.nan, n, unit)


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


@dataclass(frozen=True)
class Verdict:
    """One pre-registered claim: its paper source, the paper's number, ours with its interval,
    the rule fixed in code before the run, the outcome, and the sample's power."""
    claim: str
    source: str                  # paper and section, e.g. "OTB §5.3"
    paper: str                   # the paper's own number or statement
    ours: str                    # our number with its 95% interval
    rule: str
    outcome: str
    power: str                   # smallest effect this sample size detects
    note: str = ""               # what the reader must know (why inconclusive, contrary evidence)

    def __post_init__(self):
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome: expected one of {OUTCOMES}, got {self.outcome!r}")

    def markdown(self) -> str:
        """The section's verdict paragraph: bold head, our number, rule, power, note."""
        note = f" {self.note}" if self.note else ""
        return (f"**{self.claim} ({self.source}): {self.outcome}.** Ours: {self.ours}; paper: {self.paper}. "
                f"Rule: {self.rule}. Power: {self.power}.{note}\n")


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
