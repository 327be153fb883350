"""The pre-registered evidence rules: intervals, outcomes, the collapse rule and the Adam-moment
variance proxy, each against a straightforward computation written here."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from creditrl_research import rules
from creditrl_research import trainer_runs as studies
from creditrl.core.losses.diagnostics import adam_moment_variance
from tolerances import EPS32, sum_rtol

# The reporting statistics are float64 sums over at most 60 values (means, variances, logs of ratios), then a
# few logs, exps and square roots: within (60 + 16)·eps64 relative, times 10 for the log/exp conditioning of
# values in [0.01, 20] (tests/tolerances.py)
STATS = sum_rtol(60 + 16, torch.float64) * 10


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5)), min_size=2, max_size=30))
def test_paired_difference_is_the_t_interval_of_the_differences(pairs):
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    est = rules.paired_difference(a, b)
    d = [x - y for x, y in pairs]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    t = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}.get(n - 1, rules.t_quantile(n - 1))
    assert est.value == pytest.approx(mean, abs=STATS * 10)                       # differences <= 10
    assert est.high - est.value == pytest.approx(t * sd / math.sqrt(n), abs=STATS * 10 * t)
    assert est.detectable == pytest.approx(2.8 * sd / math.sqrt(n), abs=STATS * 10 * 2.8)
    assert est.low <= est.value <= est.high and est.n == n


def test_mean_estimate_is_the_t_interval_of_one_sample():
    x = [0.1, -0.2, 0.4, 0.3]
    est = rules.mean_estimate(x)
    mean = sum(x) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in x) / 3)
    assert est.value == pytest.approx(mean)
    assert est.high - mean == pytest.approx(3.182 * sd / 2)  # t_{0.975, 3} × SE
    assert est.n == 4


def test_paired_difference_edge_cases():
    one = rules.paired_difference([1.0], [0.0])
    assert one.value == 1.0 and one.low == -math.inf and one.high == math.inf
    assert rules.interval_outcome(one) == "inconclusive"  # one seed never decides
    assert math.isnan(rules.paired_difference([math.nan], [0.0]).value)
    with pytest.raises(ValueError, match="a, b: expected paired samples of equal length"):
        rules.paired_difference([1.0, 2.0], [1.0])
    # beyond the table's 30 df: the exact t, as the p-values use (the normal 1.96 made intervals too narrow)
    assert rules.t_quantile(100) == pytest.approx(1.9840, abs=1e-4) and rules.t_quantile(0) == math.inf


def test_interval_and_combined_outcomes():
    est = lambda low, high: rules.Estimate((low + high) / 2, low, high, 0.0, 5)  # noqa: E731
    assert rules.interval_outcome(est(0.1, 0.3)) == "reproduces"
    assert rules.interval_outcome(est(-0.3, -0.1)) == "does not reproduce"
    assert rules.interval_outcome(est(-0.1, 0.3)) == "inconclusive"
    assert rules.interval_outcome(est(-0.3, -0.1), "<") == "reproduces"
    with pytest.raises(ValueError, match="claimed: expected"):
        rules.interval_outcome(est(0, 1), ">=")
    assert rules.interval_outcome(est(0.8, 0.95), "<", null=1.0) == "reproduces"  # a ratio below 1
    assert rules.interval_outcome(est(1.05, 1.3), "<", null=1.0) == "does not reproduce"
    assert rules.interval_outcome(est(0.9, 1.1), "<", null=1.0) == "inconclusive"
    assert rules.interval_outcome(est(1.05, 1.3), ">", null=1.0) == "reproduces"
    assert rules.ratios_below_one([est(0.8, 0.9), est(0.7, 0.95)]) == "reproduces"
    assert rules.ratios_below_one([est(0.8, 0.9), est(0.9, 1.1)]) == "partly"
    assert rules.ratios_below_one([est(0.9, 1.1), est(1.1, 1.2)]) == "does not reproduce"
    assert rules.ratios_below_one([est(0.9, 1.1), est(math.nan, math.nan)]) == "inconclusive"
    assert rules.combined_outcome(["reproduces", "reproduces"]) == "reproduces"
    assert rules.combined_outcome(["reproduces", "inconclusive"]) == "partly"
    assert rules.combined_outcome(["inconclusive", "does not reproduce"]) == "does not reproduce"
    assert rules.combined_outcome(["inconclusive"]) == "inconclusive"
    assert rules.combined_outcome([]) == "inconclusive"


@pytest.mark.parametrize("claimed, null, paper, low, high, outcome", [
    # a difference claimed > 0, the paper's effect +0.05
    (">", 0.0, 0.05, -0.02, 0.04, "does not reproduce"),   # covers 0, stops short of the paper's size
    (">", 0.0, 0.05, -0.02, 0.06, "inconclusive"),         # holds both 0 and the paper's size
    (">", 0.0, 0.05, 0.01, 0.03, "reproduces"),            # above 0, even if below the paper's size
    (">", 0.0, 0.05, -0.04, -0.01, "does not reproduce"),
    # a ratio claimed < 1, the paper's ratio 0.226 (77.4% lower)
    ("<", 1.0, 0.226, 0.90, 1.28, "does not reproduce"),
    ("<", 1.0, 0.226, 0.20, 1.28, "inconclusive"),
    ("<", 1.0, 0.226, 0.50, 0.95, "reproduces"),
    ("<", 1.0, None, 0.90, 1.28, "inconclusive"),          # no stated size: the plain rule
])
def test_interval_outcome_with_the_papers_effect_size(claimed, null, paper, low, high, outcome):
    est = rules.Estimate((low + high) / 2, low, high, 0.0, 5)
    assert rules.interval_outcome(est, claimed, null, paper=paper) == outcome


def test_interval_outcome_rejects_a_paper_effect_on_the_wrong_side():
    est = rules.Estimate(1.0, 0.9, 1.1, 0.0, 5)
    with pytest.raises(ValueError, match=r"paper: expected the paper's effect on the claimed side \(<\) of 1.0, got 1.5"):
        rules.interval_outcome(est, "<", 1.0, paper=1.5)
    assert rules.ratios_below_one([est], paper=0.226) == "does not reproduce"


def test_verdict_validates_its_outcome_and_renders_rule_and_power():
    with pytest.raises(ValueError, match="outcome: expected one of"):
        rules.Verdict("c", "§1", "p", "o", "r", "agrees", "pw")
    v = rules.Verdict("claim", "X §1", "paper 1", "ours 2 [1, 3]", "the rule", "inconclusive", "5 seeds", "why")
    text = v.markdown()
    assert text.startswith("**claim (X §1): inconclusive.**") and "Rule: the rule." in text and "Power: 5 seeds." in text
    table = rules.summary_table([v])
    assert "| claim (X §1) | paper 1 | ours 2 [1, 3] | **inconclusive** |" in table


def evals(accs):
    return [{"step": 10 * i, "sampled_acc": a} for i, a in enumerate(accs)]


def metrics(norms):
    return [{"step": i + 1, "grad_norm": n} for i, n in enumerate(norms)]


@pytest.mark.parametrize("accs, collapsed", [
    ([0.3, 0.35, 0.19, 0.19], True),     # 0.16 below the running max twice
    ([0.3, 0.35, 0.19, 0.30, 0.19], False),  # never twice in a row
    ([0.3, 0.2, 0.16], False),           # 0.14 below: under the threshold
    ([0.4, 0.25, 0.25], True),           # exactly 0.15 below counts
])
def test_collapse_accuracy_rule(accs, collapsed):
    assert studies.collapse(evals(accs), metrics([1.0] * 20))["collapsed"] is collapsed


def test_collapse_gradient_surge_rule():
    norms = [1.0] * 10 + [5.0, 10.5]
    out = studies.collapse(evals([0.3, 0.3]), metrics(norms))
    assert out["collapsed"] and out["step"] == 12 and "gradient norm" in out["reason"]
    assert not studies.collapse(evals([0.3, 0.3]), metrics([1.0] * 10 + [9.9]))["collapsed"]
    assert not studies.collapse(evals([0.3]), metrics([0.0] * 12 + [5.0]))["collapsed"]  # zero median: no rule


def test_second_half_mean_and_pairing():
    ms = [{"accuracy": a} for a in (0.0, 0.0, 1.0, 0.5)]
    assert studies.second_half_mean(ms) == 0.75
    rows = [{"run": "a", "seed": 0, "x": 1.0}, {"run": "a", "seed": 1, "x": 3.0},
            {"run": "b", "seed": 1, "x": 1.0}, {"run": "b", "seed": 0, "x": 0.0}]
    est = studies.paired(rows, "a", "b", "x")
    assert est.value == 1.5 and est.n == 2


def test_adam_moment_variance_matches_a_loop_over_the_moments():
    """Σ(v̂ − m̂²) from torch's Adam state equals the bias-corrected moments recomputed by hand."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4, generator=gen))
    b = torch.nn.Parameter(torch.randn(4, generator=gen))
    opt = torch.optim.AdamW([w, b], lr=1e-2, betas=(0.8, 0.95))
    assert adam_moment_variance(opt) == 0.0
    grads = [(torch.randn(3, 4, generator=gen), torch.randn(4, generator=gen)) for _ in range(5)]
    m = [torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    v = [torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        for i, g in enumerate((gw.double(), gb.double())):
            m[i] = 0.8 * m[i] + 0.2 * g
            v[i] = 0.95 * v[i] + 0.05 * g * g
    t = len(grads)
    expected = sum(float((vi / (1 - 0.95 ** t) - (mi / (1 - 0.8 ** t)) ** 2).sum()) for mi, vi in zip(m, v))
    # the optimizer's float32 moments: 2 roundings per step (5 steps) of each, so the bias-corrected v̂ − m̂² is
    # within 16·eps32 of the terms' magnitudes Σ v̂ + m̂²
    scale = sum(float((vi / (1 - 0.95 ** t) + (mi / (1 - 0.8 ** t)) ** 2).sum()) for mi, vi in zip(m, v))
    assert adam_moment_variance(opt) == pytest.approx(expected, abs=16 * EPS32 * scale)


def test_adam_moment_variance_is_negative_where_the_gradients_mean_moved_recently():
    """v̂ − m̂² is not a variance: β1 < β2 average over different horizons. 100 zero gradients then
    10 ones: by hand m̂ = (1 − 0.9^10)/(1 − 0.9^110), v̂ = (1 − 0.999^10)/(1 − 0.999^110), so the proxy
    is v̂ − m̂² = −0.3287 (as documented), logged as it is."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=0.0, betas=(0.9, 0.999))
    for step in range(110):
        p.grad = torch.full((2,), 0.0 if step < 100 else 1.0)
        opt.step()
    m_hat, v_hat = (1 - 0.9 ** 10) / (1 - 0.9 ** 110), (1 - 0.999 ** 10) / (1 - 0.999 ** 110)
    expected = 2 * (v_hat - m_hat ** 2)
    assert expected < -0.6
    assert adam_moment_variance(opt) == pytest.approx(expected, abs=16 * EPS32 * 2 * (v_hat + m_hat ** 2))


@pytest.mark.parametrize("numel", [7, 1024, 3 * 1024 + 5, 1_000_003])
def test_sum_of_squares_in_float32_rows_matches_float64(numel):
    """adam_moment_variance's float32 reductions stay within 1e-6 of float64 on large tensors
    (a single float32 norm over a million values drifts by ~1e-4 to 1e-3)."""
    from creditrl.core.losses.diagnostics import sum_of_squares
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e-3
    assert float(sum_of_squares(x.view(-1, 1) if numel % 7 else x)) == pytest.approx(float(x.double().square().sum()),
                                                                                    rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 10), st.floats(0.01, 10)), min_size=2, max_size=20))
def test_paired_ratio_resamples_pairs_together(pairs):
    a = [p[0] for p in pairs]
    est = rules.paired_ratio(a, a, n_boot=200)  # a unit paired with itself: every resample gives 1
    assert est.value == pytest.approx(1.0) and est.low == pytest.approx(1.0) and est.high == pytest.approx(1.0)
    b = [p[1] for p in pairs]
    est = rules.paired_ratio(a, b, n_boot=200)
    assert est.value == pytest.approx(sum(a) / sum(b), rel=STATS)
    # the percentile interval lies within the range of per-resample ratios, which is bounded by unit ratios
    ratios = [x / y for x, y in pairs]
    assert min(ratios) - 1e-12 <= est.low <= est.high <= max(ratios) + 1e-12


def test_paired_ratio_degenerate_inputs():
    assert math.isnan(rules.paired_ratio([], []).value)
    assert math.isnan(rules.paired_ratio([1.0, 2.0], [0.0, 0.0]).value)
    with pytest.raises(ValueError, match="a, b: expected paired samples of equal length"):
        rules.paired_ratio([1.0], [1.0, 2.0])


def test_mean_change_is_the_accuracy_kept_after_the_start():
    from creditrl_research.experiments.otb_stability import mean_change

    evals = [{"sampled_acc": a} for a in (0.3, 0.2, 0.1, 0.0)]
    assert mean_change(evals) == pytest.approx(0.1 - 0.3)
    assert mean_change(evals[:1]) != mean_change(evals[:1])  # NaN: no eval after the start


def hill_loop(x: list[float], k: int) -> float:
    top = sorted(x, reverse=True)
    return k / sum(math.log(top[i] / top[k]) for i in range(k))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(1e-3, 1e3), min_size=12, max_size=60), st.sampled_from([0.1, 0.25, 0.5]))
def test_tail_index_matches_loop_and_is_scale_free(x, fraction):
    k = math.ceil(fraction * len(x))
    top = sorted(x, reverse=True)
    if top[0] == top[k]:  # every top value ties: α̂ is infinite, skip
        return
    # Hill's estimator 1/mean(log x_i − log x_k): each log within eps64·|log x| (<= 7.5 for x in [1e-3, 1e3]·7.5),
    # so the inverse within that times the estimate itself (its condition), over k + a few operations
    hill = hill_loop(x, k)
    rel = sum_rtol(k + 16, torch.float64) * (1 + 7.5 * hill)
    assert rules.tail_index(x, fraction) == pytest.approx(hill, rel=rel)
    assert rules.tail_index([7.5 * v for v in x], fraction) == pytest.approx(hill, rel=rel)


@pytest.mark.parametrize("alpha", [1.2, 3.0])
def test_tail_index_recovers_a_pareto_tail(alpha):
    """Hill's estimator on the top k = 20,000 of an exact Pareto sample has relative sd 1/√k = 0.7%: the
    4% bound is ~5.7 sd. tests/scripts/seed_margins.py (tail_index) over 200 seeds: worst 2.0%. (At 20,000
    draws and 8%, ~3.6 sd, a few paths in ten thousand fail.)"""
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sample = u.pow(-1 / alpha)  # P(X > x) = x^-alpha
    assert rules.tail_index(sample, 0.1) == pytest.approx(alpha, rel=0.04)


def test_tail_index_errors_name_the_arguments():
    with pytest.raises(ValueError, match="x, fraction: expected more than"):
        rules.tail_index([1.0, 2.0, 3.0], 0.1)
    with pytest.raises(ValueError, match="fraction=1.5"):
        rules.tail_index(list(range(1, 50)), 1.5)


def contrast_loop(ratios, weights):
    """The Welch t-interval of Σ_s w_s mean_c log r_{s,c}, written out."""
    value, se2, denom = 0.0, 0.0, 0.0
    for r, w in zip(ratios, weights):
        logs = [math.log(x) for x in r]
        mean = sum(logs) / len(logs)
        var = sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)
        value += w * mean
        term = w * w * var / len(logs)
        se2 += term
        denom += term * term / (len(logs) - 1)
    df = math.floor(se2 * se2 / denom + 1e-9)
    half = rules.t_quantile(df) * math.sqrt(se2)
    return math.exp(value), math.exp(value - half), math.exp(value + half)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(0.05, 20), min_size=2, max_size=6), min_size=1, max_size=3),
       st.floats(0.1, 10))
@example([[4.0, 1.25, 2.25, 2.875, 0.5], [1.25, 2.25, 2.875, 4.0, 0.5]], 1.0)  # Welch df exactly 8
@example([[1.0, 1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 2.0, 2.0]], 2.0)
def test_cluster_ratio_contrast_matches_a_loop_and_scales(ratios, scale):
    weights = [(-1.0) ** s / len(ratios) for s in range(len(ratios))]
    spread = any(max(r) > min(r) * (1 + 1e-9) for r in ratios)
    got = rules.cluster_ratio_contrast(ratios, weights)
    if spread:
        assert (got.value, got.low, got.high) == pytest.approx(contrast_loop(ratios, weights), rel=STATS)
    assert got.low <= got.value <= got.high and got.n == sum(len(r) for r in ratios)
    # scaling every ratio of setting 0 by c scales the estimate and its interval by c^w₀
    scaled = rules.cluster_ratio_contrast([[x * scale for x in ratios[0]], *ratios[1:]], weights)
    for a, b in ((scaled.value, got.value), (scaled.low, got.low), (scaled.high, got.high)):
        assert a == pytest.approx(b * scale ** weights[0], rel=STATS)


def test_cluster_ratio_contrast_widens_with_few_clusters_and_handles_degenerate_input():
    # 3 clusters: t with 2 df (4.303), where a normal or a bootstrap over the 3 values is far narrower
    est = rules.cluster_ratio_contrast([[0.8, 1.0, 1.25]], [1.0])
    se = math.sqrt(sum(math.log(x) ** 2 for x in (0.8, 1.0, 1.25)) / 2 / 3)
    assert est.value == pytest.approx(1.0) and est.high == pytest.approx(math.exp(4.303 * se))
    one = rules.cluster_ratio_contrast([[0.9]], [1.0])
    assert one.value == pytest.approx(0.9) and one.high == math.inf
    assert rules.interval_outcome(one, "<", null=1.0) == "inconclusive"
    assert math.isnan(rules.cluster_ratio_contrast([[0.9, 0.0]], [1.0]).value)  # a ratio of 0: not a ratio
    same = rules.cluster_ratio_contrast([[0.5, 0.5]], [1.0])  # no spread: a point
    assert same.low == same.high == pytest.approx(0.5)
    with pytest.raises(ValueError, match="ratios, weights: expected one weight per setting"):
        rules.cluster_ratio_contrast([[1.0, 2.0]], [1.0, 1.0])


@pytest.mark.parametrize("per_setting, pooled, paper, outcome", [
    ([(0.8, 0.95), (0.9, 1.05)], (0.85, 0.98), None, "reproduces"),       # pooled wins, no setting loses
    ([(0.8, 0.95), (1.01, 1.2)], (0.85, 0.98), None, "does not reproduce"),  # a reversal anywhere is a loss
    ([(0.8, 1.05), (0.9, 1.05)], (0.88, 1.01), None, "inconclusive"),     # pooled CI reaches 1: a tie
    ([(0.15, 0.9)], (0.2, 0.9), 0.226, "reproduces"),
    ([(0.8, 1.05), (0.7, 1.1)], (0.75, 1.05), 0.226, "does not reproduce"),  # excludes the paper's ratio
])
def test_pooled_ratio_outcome(per_setting, pooled, paper, outcome):
    est = lambda low, high: rules.Estimate((low + high) / 2, low, high, math.nan, 5)  # noqa: E731
    got = rules.pooled_ratio_outcome([est(*x) for x in per_setting], est(*pooled), paper)
    assert got == outcome


# ---------------------------------------------------------------- pooling over seed sets (issue 35)
def set_estimate(value, se, df, log=False):
    """A seed set's estimate with the t-interval value ± t_df · se (on the log scale for a ratio)."""
    t = rules.t_quantile(df) if math.isfinite(df) else 1.96
    if log:
        return rules.Estimate(value, value * math.exp(-t * se), value * math.exp(t * se), math.nan, 3, df=df, log=True)
    return rules.Estimate(value, value - t * se, value + t * se, math.nan, 3, df=df)


def pool_by_hand(ys, ses, dfs):
    """DerSimonian–Laird written out step by step, with Satterthwaite's df."""
    k = len(ys)
    w = [1 / s ** 2 for s in ses]
    fixed = sum(wi * yi for wi, yi in zip(w, ys)) / sum(w)
    q = sum(wi * (yi - fixed) ** 2 for wi, yi in zip(w, ys))
    tau2 = max(0.0, (q - (k - 1)) / (sum(w) - sum(wi ** 2 for wi in w) / sum(w)))
    star = [1 / (s ** 2 + tau2) for s in ses]
    mean = sum(wi * yi for wi, yi in zip(star, ys)) / sum(star)
    var = 1 / sum(star)
    c = [wi / sum(star) for wi in star]
    denom = sum((ci ** 2 * s ** 2) ** 2 / d for ci, s, d in zip(c, ses, dfs))
    denom += (tau2 * sum(ci ** 2 for ci in c)) ** 2 / (k - 1) if tau2 > 0 else 0.0
    df = math.floor(var ** 2 / denom + 1e-9)
    return mean, mean - rules.t_quantile(df) * math.sqrt(var), mean + rules.t_quantile(df) * math.sqrt(var), df


def test_pool_sets_matches_a_hand_computation():
    # three sets: 1.0 (se 0.5, 4 df), 2.0 (se 0.5, 4 df), 4.0 (se 1, 9 df). By hand: w = 4, 4, 1;
    # ȳ_w = 16/9; Q = 7.5556; τ² = (Q − 2)/(9 − 33/9) = 1.0417; w* = 0.7742, 0.7742, 0.4898;
    # ȳ = 2.1008, V = 0.49063; df = V² / (2·(0.14428·0.25)²/4 + (0.05775)²/9 + (1.0417·0.34631)²/2) = 3.64 -> 3
    got = rules.pool_sets([set_estimate(1.0, 0.5, 4), set_estimate(2.0, 0.5, 4), set_estimate(4.0, 1.0, 9)])
    assert got.value == pytest.approx(2.10077, abs=1e-4) and got.df == 3
    assert got.high - got.value == pytest.approx(3.182 * math.sqrt(0.490633), abs=1e-4)
    mean, low, high, df = pool_by_hand([1.0, 2.0, 4.0], [0.5, 0.5, 1.0], [4, 4, 9])
    assert (got.value, got.low, got.high, got.df) == pytest.approx((mean, low, high, df), rel=1e-12)
    assert got.se == pytest.approx(math.sqrt(0.490633), abs=1e-5)   # read back from the pooled interval


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 3), st.floats(0.05, 2), st.integers(2, 12)), min_size=2, max_size=5),
       st.booleans())
def test_pool_sets_matches_the_loop_on_either_scale(sets, log):
    ests = [set_estimate(math.exp(y) if log else y, s, d, log) for y, s, d in sets]
    for e, (_, s, _) in zip(ests, sets):
        assert e.se == pytest.approx(s, rel=1e-9)      # the SE comes back from the interval
    got = rules.pool_sets(ests)
    mean, low, high, df = pool_by_hand(*zip(*sets))
    back = math.exp if log else float
    assert (got.value, got.low, got.high) == pytest.approx((back(mean), back(low), back(high)), rel=1e-9, abs=1e-12)
    assert got.df == df and got.log is log and got.n == 3 * len(sets)


def test_pool_sets_special_cases():
    one = set_estimate(0.8, 0.1, 5, log=True)
    alone = rules.pool_sets([one])                               # one set: itself, same df
    assert (alone.value, alone.low, alone.high, alone.df) == pytest.approx((one.value, one.low, one.high, 5))
    same = rules.pool_sets([set_estimate(1.0, 0.3, 4)] * 3)      # no spread between sets: τ² = 0, df 3 × 4
    assert same.df == 12 and same.value == pytest.approx(1.0)
    assert same.high - same.value == pytest.approx(rules.t_quantile(12) * 0.3 / math.sqrt(3))
    nan = rules.Estimate(math.nan, math.nan, math.nan, math.nan, 3, df=2, log=True)
    unbounded = rules.cluster_ratio_contrast([[0.9]], [1.0])     # one cluster: no weight
    assert rules.pool_sets([one, nan, unbounded]).value == pytest.approx(one.value)
    assert math.isnan(rules.pool_sets([nan]).value)
    exact = rules.Estimate(1.0, 1.0, 1.0, 0.0, 3, df=math.inf, log=True)   # e.g. Dr.GRPO ≡ RLOO
    assert (rules.pool_sets([exact, exact]).low, rules.pool_sets([exact, exact]).high) == (1.0, 1.0)
    with pytest.raises(ValueError, match="estimates: expected one scale"):
        rules.pool_sets([one, set_estimate(0.8, 0.1, 5)])
    # the estimators say on which scale and with which df their intervals were built
    d = rules.paired_difference([0.1, 0.3, 0.2, 0.4], [0.0] * 4)
    assert d.df == 3 and not d.log and d.se == pytest.approx(d.detectable / rules.POWER_FACTOR)
    r = rules.cluster_ratio_contrast([[0.8, 1.0, 1.25]], [1.0])
    assert r.df == 2 and r.log and r.se == pytest.approx(math.sqrt(sum(math.log(x) ** 2 for x in (0.8, 1, 1.25)) / 6))
    b = rules.paired_ratio([1.0, 2.0, 3.0], [2.0, 2.0, 2.0], n_boot=200)
    assert b.log and b.df == math.inf and b.se > 0


def test_pooled_verdict_applies_the_verdicts_own_rule():
    def decide(statistics):
        return rules.interval_outcome(statistics["d"], ">")

    def verdict(est, met=True):
        return rules.Verdict("c", "§", "p", str(est), "r", decide({"d": est}) if met else "inconclusive", "pw",
                             statistics={"d": est}, decide=decide, condition_met=met)

    weak = [verdict(set_estimate(0.1, 0.06, 4)), verdict(set_estimate(0.12, 0.06, 4)), verdict(set_estimate(0.09, 0.06, 4))]
    assert [v.outcome for v in weak] == ["inconclusive"] * 3           # each set alone: CI covers 0
    outcome, text = rules.pooled_verdict(weak)
    assert outcome == "reproduces" and text.startswith("d 0.103 [")    # together: above 0
    assert rules.pooled_verdict(weak[:1]) == ("—", "one seed set")
    assert rules.pooled_verdict([*weak[:2], verdict(set_estimate(0.1, 0.06, 4), met=False)])[0] == "inconclusive"
    plain = rules.Verdict("c", "§", "p", "o", "r", "reproduces", "pw")
    assert rules.pooled_verdict([weak[0], plain]) == ("—", "not pooled: its rule reads no interval")
    other = rules.Verdict("c", "§", "p", "o", "r", "reproduces", "pw", statistics={"e": set_estimate(1, 0.1, 4)},
                          decide=lambda s: rules.interval_outcome(s["e"], ">"))
    assert rules.pooled_verdict([weak[0], other])[1] == "not pooled: the seed sets measured different statistics"
    with pytest.raises(ValueError, match="decide: expected the rule on the verdict's statistics to give its outcome"):
        rules.Verdict("c", "§", "p", "o", "r", "reproduces", "pw", statistics={"d": weak[0].statistics["d"]},
                      decide=decide)


# ---------------------------------------------------------------- grad-variance's menu verdicts (issue 34 item 5)


def _ratio(value, low, high):
    from creditrl_research.rules import Estimate
    return Estimate(value, low, high, float("nan"), 3, "checkpoints", df=2, log=True)


def _mean(value, low, high):
    from creditrl_research.rules import Estimate
    return Estimate(value, low, high, float("nan"), 3, "checkpoints", df=2)


WIN, TIE, LOSS = (2.0, 1.5, 2.7), (1.1, 0.8, 1.5), (0.5, 0.3, 0.8)


def _comparison(prefix, each, pooled):
    return {**{f"{prefix} | {d} digits": _ratio(*e) for d, e in zip((1, 2), each)}, f"{prefix} | pooled": _ratio(*pooled)}


@pytest.mark.parametrize("loo, leave_in, expected", [
    ((WIN, WIN, WIN), (WIN, WIN, WIN), "reproduces"),
    ((WIN, WIN, WIN), (TIE, TIE, TIE), "partly"),
    ((TIE, LOSS, TIE), (TIE, TIE, TIE), "does not reproduce"),
    ((TIE, TIE, TIE), (TIE, TIE, TIE), "inconclusive")])
def test_shrinkage_rule_forces_each_outcome(loo, leave_in, expected):
    from creditrl_research.experiments import grad_variance as gv
    stats = {**_comparison("shrinkage+loo/rloo", loo[:2], loo[2]), **_comparison("shrinkage/dr_grpo", leave_in[:2],
                                                                                 leave_in[2])}
    assert gv.shrinkage_outcome(stats) == expected


COS_HIGH, COS_LOW, COS_WIDE = (0.99, 0.97, 1.0), (0.6, 0.4, 0.8), (0.9, 0.7, 1.1)


@pytest.mark.parametrize("token, seq, cos, expected", [
    (WIN, WIN, COS_HIGH, "reproduces"),
    (WIN, TIE, COS_HIGH, "partly"),
    (WIN, WIN, COS_LOW, "partly"),
    (TIE, LOSS, COS_WIDE, "does not reproduce"),
    (TIE, TIE, COS_LOW, "does not reproduce"),
    (TIE, TIE, COS_WIDE, "inconclusive")])
def test_delta_l_rule_forces_each_outcome(token, seq, cos, expected):
    from creditrl_research.experiments import grad_variance as gv
    stats = {**_comparison("ΔL/token-mean", (token, token), token), **_comparison("ΔL/seq-mean-token-mean", (seq, seq),
                                                                                  seq),
             "cos(ΔL) | 1 digits": _mean(*cos), "cos(ΔL) | 2 digits": _mean(*cos), "cos(ΔL) | pooled": _mean(*cos)}
    assert gv.delta_l_outcome(stats) == expected


@pytest.mark.parametrize("pooled, expected", [
    ((0.8, 0.7, 0.9), "reproduces"),            # the direction differs
    ((0.998, 0.995, 1.001), "does not reproduce"),   # indistinguishable from ∇J's direction
    ((0.97, 0.9, 1.02), "inconclusive")])
def test_maxrl_rule_forces_each_outcome(pooled, expected):
    from creditrl_research.experiments import grad_variance as gv
    assert gv.maxrl_outcome({"cos(MaxRL) | 1 digits": _mean(*pooled), "cos(MaxRL) | pooled": _mean(*pooled)}) == expected


@pytest.mark.parametrize("efficiencies, clip, outcome", [
    ([1.5, 1.6, 1.55, 1.52], [0.05] * 4, "reproduces"),          # every checkpoint well above 1
    ([0.6, 0.62, 0.58, 0.61], [0.05] * 4, "does not reproduce"),  # every checkpoint well below 1
    ([0.5, 2.0, 0.9, 1.3], [0.05] * 4, "inconclusive"),           # spread over 1
    ([1.5, 1.6, 1.55, 1.52], [0.002] * 4, "inconclusive"),        # the clip bound too rarely: no condition
])
def test_off_policy_cispo_rule(efficiencies, clip, outcome):
    from creditrl_research.experiments import off_policy as op

    v = op.cispo_verdict(efficiencies, clip)
    assert v.outcome == outcome
    assert v.condition_met == (sum(clip) / len(clip) >= op.MIN_CLIP_FRACTION)
    assert "[" in v.ours and "PPO's clip binds on" in v.ours
    if not v.condition_met:
        assert "did not produce the condition" in v.note
    undefined = op.cispo_verdict([1.5, math.nan, 1.6, 1.55], [0.05] * 4)   # a non-finite checkpoint is left out
    assert "undefined at 1 checkpoint(s)" in undefined.ours and undefined.outcome == "reproduces"


def test_moderate_k_needs_an_interior_k():
    """A K sweep with fewer than 3 values of K ≥ 2 has no interior K: the best can only lie at an end, so the
    claim is untested (inconclusive), not refuted; with one, the rule decides."""
    from creditrl_research.experiments.maxk_bandit import best_at_moderate_k
    from creditrl_research.rules import Estimate

    def est(v):
        return Estimate(v, v - 0.01, v + 0.01, 0.005, 8)

    assert best_at_moderate_k({"K=1": est(1.0), "K=3": est(0.8), "K=7": est(0.9)}) == "inconclusive"
    assert best_at_moderate_k({"K=3": est(0.8)}) == "inconclusive"
    assert best_at_moderate_k({"K=2": est(0.9), "K=4": est(0.7), "K=8": est(0.95)}) == "reproduces"
    assert best_at_moderate_k({"K=2": est(0.6), "K=4": est(0.7), "K=8": est(0.95)}) == "does not reproduce"
