"""Max@K closed forms and estimators against brute force over all subsets (N <= 8, with ties)."""
from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl import compute_advantages, maxk_quantities, pass_at_k
from creditrl.core.estimators.maxk import max_at_k
from tolerances import EPS32, EPS64, sum_rtol

MAXK = ("maxpo", "ei", "pkpo", "maxk_bon", "passk_chen")
# Tolerances (tests/tolerances.py). The max@K quantities are float64 weighted sums over at most C(8, 4) = 70
# subsets of rewards <= 2, their weights binomial ratios exp(lgamma differences) within 8·lgamma(9)·eps64
# (F64, absolute). compute_advantages casts them to float32 once (CAST: eps32 relative, on top).
F64 = (sum_rtol(70 + 8, torch.float64) + 8 * math.lgamma(9) * EPS64) * 2
CAST = EPS32


# ---------------------------------------------------------------- brute-force references


def mean_max(subsets) -> float:
    subsets = list(subsets)
    return sum(max(s) for s in subsets) / len(subsets)


def brute_ei(r: list[float], i: int, k: int) -> float:
    """EI_i = mean over (K-1)-subsets S of the others of relu(r_i - max S); r_i for K = 1."""
    if k == 1:
        return r[i]
    others = r[:i] + r[i + 1:]
    subs = list(itertools.combinations(others, k - 1))
    return sum(max(r[i] - max(s), 0.0) for s in subs) / len(subs)


def brute_group(r: list[float], k: int) -> dict[str, list[float]]:
    n = len(r)
    mu = [mean_max(s + (r[i],) for s in itertools.combinations(r[:i] + r[i + 1:], k - 1)) for i in range(n)]
    nu = [mean_max(itertools.combinations(r[:i] + r[i + 1:], k)) if k <= n - 1 else math.nan for i in range(n)]
    ei = [brute_ei(r, i, k) for i in range(n)]
    rho = [mean_max(itertools.combinations(r, k))] * n
    out = {"mu": mu, "nu": nu, "ei": ei, "rho": rho}
    if k <= n - 1:  # Leave-Two-Out baseline by its definition (MaxPO §3.2)
        pool = lambda i: r[:i] + r[i + 1:]  # noqa: E731
        out["l2o"] = [sum(brute_ei(pool(i), j, k) for j in range(n - 1)) / (n - 1) for i in range(n)]
    return out


def random_groups(seed: int, num_groups: int = 3, max_size: int = 8, levels: int = 4, min_size: int = 2):
    """Tied integer rewards in unsorted, non-contiguous groups of sizes 2..max_size."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(min_size, max_size + 1, (num_groups,), generator=g)
    ids = torch.randperm(100, generator=g)[:num_groups] * 7 - 50
    group = torch.repeat_interleave(ids, sizes)
    perm = torch.randperm(group.numel(), generator=g)
    rewards = torch.randint(0, levels, (group.numel(),), generator=g).double() / 2
    return rewards[perm], group[perm]


def members(group: torch.Tensor):
    for gid in group.unique():
        yield torch.nonzero(group == gid).flatten()


def advantages(name, rewards, group, **options):
    mask = torch.ones(rewards.numel(), 3, dtype=torch.bool)
    return compute_advantages(name, rewards=rewards, mask=mask, group=group, **options)[:, 0].double()


# ---------------------------------------------------------------- closed forms


@pytest.mark.parametrize("seed", range(4))
def test_quantities_match_brute_force(seed):
    rewards, group = random_groups(seed)
    for k in range(1, int(torch.unique(group, return_counts=True)[1].min()) + 1):
        stats = maxk_quantities(rewards, group, k)
        for idx in members(group):
            ref = brute_group(rewards[idx].tolist(), k)
            for field in ("mu", "nu", "ei", "rho"):
                got = getattr(stats, field)[idx]
                want = torch.tensor(ref[field], dtype=torch.float64)
                assert torch.allclose(got, want, atol=F64, rtol=0, equal_nan=True), (field, k)
            if "l2o" in ref:  # canonical form mu - nu == EI - L2O baseline
                want = torch.tensor(ref["ei"], dtype=torch.float64) - torch.tensor(ref["l2o"], dtype=torch.float64)
                assert torch.allclose(stats.advantage[idx], want.double(), atol=2 * F64, rtol=0)


def test_all_tied_group():
    stats = maxk_quantities(torch.full((6,), 2.5), torch.zeros(6, dtype=torch.long), 3)
    assert torch.allclose(stats.mu, torch.full((6,), 2.5, dtype=torch.float64), atol=F64, rtol=0)
    assert torch.equal(stats.advantage, torch.zeros(6, dtype=torch.float64))
    assert torch.equal(stats.ei, torch.zeros(6, dtype=torch.float64))


def relu_matrix_maxpo(r: torch.Tensor, k: int) -> torch.Tensor:
    """O(N^2) MaxPO (paper App. E): EI = ReLU-difference matrix x hypergeometric weights,
    L2O baseline from the leave-one-out column sums."""
    n = r.numel()
    a, order = torch.sort(r.double())
    q = torch.arange(1, n + 1, dtype=torch.float64)

    def binom(x, y):  # C(x, y) for float64 x >= 0, 0 where y > x
        x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
        log = torch.lgamma(x + 1) - torch.lgamma(y + 1) - torch.lgamma((x - y).clamp(min=0) + 1)
        return torch.where((y >= 0) & (y <= x), log.exp(), torch.zeros_like(log))

    relu = (a[:, None] - a[None, :]).clamp(min=0)
    ei = relu @ (binom(q - 1, k - 2) / binom(n - 1, k - 1))
    rank = q[None, :] - (q[None, :] > q[:, None]).double()       # rank of q in the pool without i
    w2 = binom(rank - 1, k - 2) / binom(n - 2, k - 1)
    w2.fill_diagonal_(0)
    base = (w2 * (relu.sum(0)[None, :] - relu)).sum(1) / (n - 1)
    return torch.empty(n, dtype=torch.float64).index_copy_(0, order, ei - base)


def test_large_group_matches_quadratic_reference():
    r = torch.randn(300, generator=torch.Generator().manual_seed(0)).double()
    group = torch.zeros(300, dtype=torch.long)
    # the quadratic reference's binomials are exp(lgamma differences), lgamma(301) ≈ 1414: each weight within
    # 3·1414·eps64 relative; then float64 sums of 300 terms of relu values <= 8 (N(0,1) rewards), on both sides
    atol = 2 * 8 * (3 * 1414 + 300) * EPS64
    for k in (2, 75, 299):
        got = maxk_quantities(r, group, k).advantage
        assert torch.allclose(got, relu_matrix_maxpo(r, k), atol=atol, rtol=0)


def test_pass_at_k_and_max_at_k():
    for n, c, k in [(10, 3, 1), (10, 3, 5), (10, 0, 4), (10, 10, 2), (5, 2, 5)]:
        # 1 − exp(lgamma differences) against exact integers: 6 lgamma values <= lgamma(n + 1), each a few ulps,
        # move the exponent by ~8·lgamma(n + 1)·eps64 (the same relative error in the ratio <= 1)
        assert pass_at_k(n, c, k).item() == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k),
                                                         abs=8 * math.lgamma(n + 1) * EPS64)
    batched = pass_at_k(torch.tensor([10, 20]), torch.tensor([1, 5]), 3)
    assert batched.dtype == torch.float64 and batched.shape == (2,)
    scores = torch.tensor([0.3, 1.0, -2.0, 1.0, 0.5]).double()
    for k in range(1, 6):
        assert max_at_k(scores, k).item() == pytest.approx(mean_max(itertools.combinations(scores.tolist(), k)),
                                                           abs=F64)
    with pytest.raises(ValueError, match="c:"):
        pass_at_k(5, 6, 2)
    with pytest.raises(ValueError, match="k:"):
        pass_at_k(5, 2, 6)
    with pytest.raises(ValueError, match="k:"):
        max_at_k(scores, 0)


def test_max_at_k_unbiased_monte_carlo():
    """E[rho_K over a group of N draws] = E[max of K i.i.d. draws], exactly computable here."""
    values = torch.tensor([0.0, 1.0, 2.0, 3.0])
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n, k, groups = 6, 3, 20000
    g = torch.Generator().manual_seed(1)
    draws = values[torch.multinomial(probs, n * groups, replacement=True, generator=g)]
    group = torch.arange(groups).repeat_interleave(n)
    stats = maxk_quantities(draws, group, k)
    rho = stats.rho.reshape(groups, n)[:, 0]
    cdf = probs.cumsum(0).double()
    exact = float((values.double() * (cdf ** k - torch.cat([torch.zeros(1).double(), cdf[:-1]]) ** k)).sum())
    stderr = float(rho.std()) / math.sqrt(groups)
    # 5 standard errors (a chance failure ~6e-7 per path); tests/scripts/seed_margins.py (maxk_monte_carlo)
    # over 200 seeds: worst |z| 2.77
    assert abs(float(rho.mean()) - exact) < 5 * stderr
    # the policy-gradient weights are centred: MaxPO advantages sum to 0 in every group
    assert stats.advantage.reshape(groups, n).sum(1).abs().max() < 1e-12


# ---------------------------------------------------------------- estimators


@pytest.mark.parametrize("seed", range(3))
def test_estimators_match_brute_force(seed):
    rewards, group = random_groups(seed + 10)
    n_min = int(torch.unique(group, return_counts=True)[1].min())
    for k in range(1, n_min + 1):
        maxpo = advantages("maxpo", rewards, group, k=k) if k <= n_min - 1 else None
        pkpo = advantages("pkpo", rewards, group, k=k) if k >= 2 else None
        ei = advantages("ei", rewards, group, k=k) if k >= 2 else None
        bon = advantages("maxk_bon", rewards, group, k=k) if k <= n_min - 1 else None
        for idx in members(group):
            r = rewards[idx].tolist()
            n = len(r)
            ref = brute_group(r, k)
            if maxpo is not None:
                want = [e - b for e, b in zip(ref["ei"], ref["l2o"])]
                assert torch.allclose(maxpo[idx], torch.tensor(want, dtype=torch.float64), atol=2 * F64, rtol=CAST)
            if pkpo is not None:
                assert torch.allclose(pkpo[idx], torch.tensor([k / n * e for e in ref["ei"]], dtype=torch.float64), atol=2 * F64, rtol=CAST)
                assert torch.allclose(ei[idx], torch.tensor(ref["ei"], dtype=torch.float64), atol=2 * F64, rtol=CAST)   # raw EI (MaxPO §3.2)
            if bon is None:                      # k = N: refused, every s_i would be equal (A = 0)
                continue
            s = [k / n * m for m in ref["mu"]]
            mean = sum(s) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in s) / (n - 1))
            assert torch.allclose(bon[idx], torch.tensor([(x - mean) / (std + 1e-6) for x in s], dtype=torch.float64), atol=2 * F64, rtol=CAST)


@pytest.mark.parametrize("seed", range(3))
def test_passk_chen_matches_formula_and_maxpo_direction(seed):
    rewards, group = random_groups(seed + 20, levels=2)
    rewards = (rewards > 0).double()
    n_min = int(torch.unique(group, return_counts=True)[1].min())
    for k in range(1, n_min):            # k = N: refused (σ = 0, every advantage 0)
        got = advantages("passk_chen", rewards, group, k=k)
        numerator = torch.zeros_like(got)
        for idx in members(group):
            r = rewards[idx].tolist()
            n, c = len(r), int(sum(r))
            rho = 1 - math.comb(n - c, k) / math.comb(n, k)
            sigma = math.sqrt(rho * (1 - rho))
            neg = 1 - rho - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1) if n - c - 1 >= 0 else 0.0
            want = [((1 - rho) if x else neg) / (sigma + 1e-6) for x in r]
            assert torch.allclose(got[idx], torch.tensor(want, dtype=torch.float64), atol=2 * F64, rtol=CAST)
            numerator[idx] = got[idx] * (sigma + 1e-6)
        if k <= n_min - 1:  # numerator = (N-K)/N * MaxPO advantage (MaxPO App. F.5)
            stats = maxk_quantities(rewards, group, k)
            scale = (stats.sizes - k).double() / stats.sizes
            assert torch.allclose(numerator, scale * stats.advantage, atol=2 * F64, rtol=3 * CAST)   # x (σ + 1e-6)


def test_k_one_maxpo_is_rloo():
    rewards, group = random_groups(3)
    # rloo sums a group's <= 8 rewards <= 2 in float32
    assert torch.allclose(advantages("maxpo", rewards, group, k=1), advantages("rloo", rewards, group),
                          atol=sum_rtol(8 + 2) * 2, rtol=CAST)


def test_normalize_std():
    rewards, group = random_groups(4)
    plain = advantages("maxpo", rewards, group, k=2)
    scaled = advantages("maxpo", rewards, group, k=2, normalize="std")
    for idx in members(group):
        std = rewards[idx].std().item()
        assert torch.allclose(scaled[idx], plain[idx] / (std + 1e-6), atol=2 * F64, rtol=4 * CAST)   # std: float32
    with pytest.raises(ValueError, match="normalize"):
        advantages("pkpo", rewards, group, k=2, normalize="l2")


def test_singletons_are_zero_even_when_k_exceeds_them():
    rewards = torch.tensor([1.0, 0.0, 1.0, 3.0])
    group = torch.tensor([5, 5, 5, 9])
    for name in MAXK:
        out = advantages(name, rewards if name != "passk_chen" else (rewards > 0).double(), group, k=2)
        assert out[3] == 0 and torch.isfinite(out).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 3), shift=st.floats(-50, 50), scale=st.floats(0.1, 10))
def test_maxpo_properties(seed, k, shift, scale):
    rewards, group = random_groups(seed, max_size=7, levels=5, min_size=k + 1)
    rewards = rewards + torch.randn(rewards.shape, generator=torch.Generator().manual_seed(seed)).double() * 0.1
    adv = advantages("maxpo", rewards, group, k=k)
    # rewards <= 2.5 (levels 0..2 halves plus N(0, 0.1²)); compute_advantages holds them in float32
    for idx in members(group):  # exact centering, up to the float32 cast of <= 7 advantages <= 2.5
        assert abs(adv[idx].sum().item()) < 7 * CAST * 2.5 + F64
    # a reward of magnitude |shift| + 2.5 rounded to float32 moves its advantage and its comparators' by
    # eps32/2 of it: 4 roundings in all, plus the cast
    shifted_tol = 4 * EPS32 * (abs(shift) + 2.5) + CAST * 2.5 + F64
    assert torch.allclose(advantages("maxpo", rewards + shift, group, k=k), adv, atol=shifted_tol, rtol=0)
    assert torch.allclose(advantages("maxpo", rewards * scale, group, k=k), adv * scale,
                          atol=(4 * EPS32 * 2.5 + CAST * 2.5 + F64) * scale, rtol=0)
    perm = torch.randperm(rewards.numel(), generator=torch.Generator().manual_seed(seed))
    # the same float64 sums in another order, cast: at most one float32 ulp apart
    assert torch.allclose(advantages("maxpo", rewards[perm], group[perm] * 3 + 1, k=k), adv[perm], atol=2 * F64,
                          rtol=CAST)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("name,k,expect", [
    ("maxpo", 3, "group id 7 (N=3, K=3)"), ("maxpo", 0, "any group; expected 1 <= k"),
    ("pkpo", 1, "any group; expected 2 <= k"), ("ei", 1, "any group; expected 2 <= k"),
    ("pkpo", 4, "group id 7 (N=3, K=4)"), ("maxk_bon", 4, "group id 2 (N=4, K=4)"),
    ("passk_chen", 4, "group id 2 (N=4, K=4)"),
    ("maxk_bon", 3, "group id 7 (N=3, K=3)"), ("passk_chen", 3, "group id 7 (N=3, K=3)")])
def test_k_out_of_range_names_group(name, k, expect):
    """A k too large for some group names the first; one no group size allows is refused on any
    batch, a batch of singletons (which get 0) included."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    group = torch.tensor([2, 2, 2, 2, 7, 7, 7])
    with pytest.raises(ValueError, match=re.escape(f"{name}: k={k} is out of range for {expect}")):
        advantages(name, rewards, group, k=k)
    if "any group" in expect:
        with pytest.raises(ValueError, match=re.escape(f"{name}: k={k} is out of range for {expect}")):
            advantages(name, rewards, torch.arange(7), k=k)


def test_maxk_errors():
    rewards, group = torch.tensor([0.0, 0.5, 1.0]), torch.tensor([1, 1, 1])
    with pytest.raises(ValueError, match=r"passk_chen: rewards must be 0/1, but group id 1 \(N=3, K=2\)"):
        advantages("passk_chen", rewards, group, k=2)
    with pytest.raises(ValueError, match=r"maxpo.k: required"):
        advantages("maxpo", rewards, group)
    with pytest.raises(ValueError, match="maxpo.k: expected int, got 1.5"):
        advantages("maxpo", rewards, group, k=1.5)
    with pytest.raises(ValueError, match=r"group id 1 \(N=3, K=4\)"):
        maxk_quantities(rewards, group, 4)
    with pytest.raises(ValueError, match="rewards: 1 row"):
        maxk_quantities(torch.tensor([0.0, float("nan"), 1.0]), group, 1)
