"""creditrl_research.synthetic_policy: the closed-form success rate and its gradient against an enumeration
of every response, sampling against it, group gradients against a per-response loop, and the horizon
experiment's sanity checks (T = 1: cumulative = isolated; no shared parameters: the isolated-energy
baseline is the population per-token optimum, OTB eq. 51 = eq. 30)."""
from __future__ import annotations

import math

import pytest
import torch

from creditrl import compute_advantages
from creditrl_research import synthetic_policy as sp
from tolerances import sum_rtol

# float64 sums over every response of a policy of <= 8 positions (<= 4^8 sequences, probabilities and rewards
# <= 1, scores <= 2): within that many eps64 (tests/tolerances.py)
ENUM = sum_rtol(4 ** 8 + 16, torch.float64) * 2

SPECS = {"rloo": ("rloo", {}), "otb": ("otb", {}), "otb+loo": ("otb", {"leave_one_out": True}),
         "otb_isolated": ("otb_isolated", {})}


def responses(policy: sp.SyntheticPolicy):
    """Every possible response: (tokens, probability as a differentiable function of theta)."""
    out = []

    def walk(prefix):
        t = len(prefix)
        if t == policy.horizon or (prefix and prefix[-1] == sp.EOS):
            out.append(prefix)
            return
        for y in range(sp.VOCAB):
            if math.isfinite(float(policy.theta[policy.row[t], y])):
                walk(prefix + (y,))

    walk(())
    return out


def reward_of(policy, seq) -> float:
    if policy.budget is not None:     # fork-density family: at most `budget` mistakes (token 1 anywhere)
        return float(sum(y == 1 for y in seq) <= policy.budget)
    errors = any(y == 1 and int(policy.kind[t]) != sp.FORK for t, y in enumerate(seq))
    right = sum(1 for t, y in enumerate(seq) if y == 0 and int(policy.kind[t]) == sp.FORK)
    return float(not errors and right >= policy.need)


def log_prob(policy, theta, seq):
    logp = torch.log_softmax(theta, -1)
    return sum(logp[policy.row[t], y] for t, y in enumerate(seq))


POLICIES = [dict(horizon=6, eos=eos, shared=shared, errors=0.9, stop=1.2, forks=2, need=1)
            for eos in (False, True) for shared in (True, False)]


DENSITY = [dict(horizon=6, spacing=2, eos=eos, shared=shared, error_rate=0.15, stop=0.6, budget=budget)
           for eos in (False, True) for shared in (True, False) for budget in (None, 1)]


@pytest.mark.parametrize("kwargs", POLICIES + DENSITY, ids=lambda k: "-".join(f"{a}={k[a]}" for a in (
    "eos", "shared", "spacing", "budget") if a in k))
def test_success_probability_and_gradient_match_an_enumeration(kwargs):
    policy = (sp.make_density_policy if "spacing" in kwargs else sp.make_policy)(**kwargs)
    theta = policy.theta.clone().requires_grad_(True)
    seqs = responses(policy)
    total = sum(log_prob(policy, theta, s).exp() for s in seqs)
    J = sum(log_prob(policy, theta, s).exp() * reward_of(policy, s) for s in seqs)
    assert float(total.detach()) == pytest.approx(1.0, abs=ENUM)
    assert float(sp.success_probability(policy)) == pytest.approx(float(J.detach()), abs=ENUM)
    (grad,) = torch.autograd.grad(J, theta)
    grad = torch.where(torch.isfinite(policy.theta), grad, 0.0).reshape(-1)
    torch.testing.assert_close(sp.true_gradient(policy), grad, atol=ENUM, rtol=0)


def test_sampling_matches_the_exact_probabilities():
    policy = sp.make_policy(6, eos=True, errors=0.9, stop=1.2, forks=2, need=1)
    tokens, mask, rewards = sp.sample(policy, 200_000, torch.Generator().manual_seed(0))
    J = float(sp.success_probability(policy))
    # 5 standard errors on each of 7 frequencies: a chance failure has probability ~4e-6 per path;
    # tests/scripts/seed_margins.py (synthetic_sampling) over 100 seeds: worst |z| 3.40 (4 sd left ~1 of margin)
    assert abs(float(rewards.mean()) - J) < 5 * math.sqrt(J * (1 - J) / 200_000)
    for seq in responses(policy)[:6]:
        want = float(log_prob(policy, policy.theta, seq).exp())
        row = torch.tensor(list(seq) + [0] * (6 - len(seq)))
        hit = ((tokens == row).all(1) & (mask.sum(1) == len(seq))).double().mean()
        assert abs(float(hit) - want) < 5 * math.sqrt(want * (1 - want) / 200_000) + 1e-9
    assert bool(((tokens == sp.EOS).sum(1) <= 1).all())            # at most one EOS, the last valid token
    assert not bool(((tokens == sp.EOS) & (policy.kind != sp.TAIL)).any())


def test_group_gradients_match_a_per_response_loop():
    policy = sp.make_policy(8, eos=True, errors=1.5, stop=1.5)
    tokens, mask, rewards = sp.sample(policy, 12, torch.Generator().manual_seed(1))
    got = sp.group_gradients(policy, tokens, mask, rewards, 4, SPECS)                 # [3, E, 9]
    energy = policy.energy_table()[policy.row[None], tokens].float() * mask
    for e, (name, options) in enumerate(SPECS.values()):
        adv = compute_advantages(name, rewards=rewards, mask=mask, group=torch.arange(12) // 4, energy=energy,
                                 **options).double()
        for g in range(3):
            total = torch.zeros_like(policy.theta)
            for b in range(4 * g, 4 * g + 4):
                theta = policy.theta.clone().requires_grad_(True)
                logp = torch.log_softmax(theta, -1)
                obj = sum(adv[b, t] * logp[policy.row[t], tokens[b, t]] for t in range(8) if mask[b, t])
                if torch.is_tensor(obj):
                    total = total + torch.nan_to_num(torch.autograd.grad(obj, theta)[0])
            # the same float32 advantages (|A| <= 2) on both sides, float64 sums over 4 x 8 tokens of scores <= 2
            torch.testing.assert_close(got[g, e], total.reshape(-1) / 4, atol=sum_rtol(32 + 8, torch.float64) * 4,
                                       rtol=0)


def test_one_token_cumulative_equals_isolated():
    """T = 1: W_1 = w_1, so otb and otb_isolated give the same advantages exactly (OTB §4)."""
    policy = sp.make_policy(1, fork_prob=0.6, errors=0.5)
    tokens, mask, rewards = sp.sample(policy, 64, torch.Generator().manual_seed(2))
    energy = policy.energy_table()[policy.row[None], tokens].float() * mask
    group = torch.arange(64) // 8
    for loo in (False, True):
        a = compute_advantages("otb", rewards=rewards, mask=mask, group=group, energy=energy, leave_one_out=loo)
        b = compute_advantages("otb_isolated", rewards=rewards, mask=mask, group=group, energy=energy,
                               leave_one_out=loo)
        assert torch.equal(a, b)
    assert bool((rewards > 0).any() and (rewards == 0).any())


def population_baselines(policy: sp.SyntheticPolicy):
    """By enumerating every response: the variance-optimal per-token constant baseline (OTB eq. 29–30,
    solving the normal equations of E||Σ_t (G_t − b_t) s_t||² over b), the isolated-energy baseline
    E[G ||s_t||²] / E[||s_t||²] (eq. 51) and the cumulative one E[G W_t] / E[W_t] (OTB's population form)."""
    T, P = policy.horizon, policy.theta.numel()
    M = torch.zeros(T, T, dtype=torch.float64)
    rhs = torch.zeros(T, dtype=torch.float64)
    iso_num, iso_den, cum_num, cum_den = (torch.zeros(T, dtype=torch.float64) for _ in range(4))
    for seq in responses(policy):
        prob = float(log_prob(policy, policy.theta, seq).exp())
        G = reward_of(policy, seq)
        scores = torch.zeros(T, P, dtype=torch.float64)
        for t, y in enumerate(seq):
            theta = policy.theta.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(torch.log_softmax(theta, -1)[policy.row[t], y], theta)
            scores[t] = torch.nan_to_num(g).reshape(-1)
        gram = scores @ scores.T
        M += prob * gram                                                 # E<s_k, s_t>
        rhs += prob * G * gram.sum(1)                                    # Σ_k E[G_k <s_k, s_t>]
        w = gram.diagonal()
        iso_num += prob * G * w
        iso_den += prob * w
        cum_num += prob * G * w.cumsum(0)
        cum_den += prob * w.cumsum(0)
    return torch.linalg.solve(M, rhs), iso_num / iso_den, cum_num / cum_den


@pytest.mark.parametrize("eos", [False, True], ids=["fixed-length", "eos-ended"])
def test_without_shared_parameters_the_isolated_baseline_is_the_per_token_optimum(eos):
    """Positions with their own parameters: <s_k, s_t> = 0 for k != t, so eq. 30 reduces to eq. 51 and
    ||s_t||² is exactly the energy ŵ_t. With shared parameters the optimum differs from both."""
    private = sp.make_policy(4, forks=2, need=1, errors=1.0, stop=1.2, eos=eos, shared=False)
    optimum, isolated, cumulative = population_baselines(private)
    torch.testing.assert_close(optimum, isolated, atol=ENUM, rtol=0)
    assert float((cumulative - optimum).abs().max()) > 1e-3
    shared = sp.make_policy(4, forks=2, need=1, errors=1.0, stop=1.2, eos=eos, shared=True)
    optimum, isolated, _ = population_baselines(shared)
    assert float((optimum - isolated).abs().max()) > 1e-3
    for policy in (private, shared):   # ||s_t||² of a softmax row is the logit-gradient energy
        tokens, mask, _ = sp.sample(policy, 3, torch.Generator().manual_seed(0))
        w = policy.energy_table()[policy.row[None], tokens]
        p = policy.probs[policy.row]
        onehot = torch.nn.functional.one_hot(tokens, sp.VOCAB).double()
        torch.testing.assert_close(w, (onehot - p[None]).square().sum(-1))


def test_bad_policy_arguments_are_refused():
    with pytest.raises(ValueError, match=r"fork_prob: expected a value in \(0, 1\)"):
        sp.make_policy(8, fork_prob=1.0)
    with pytest.raises(ValueError, match="horizon: expected"):
        sp.make_policy(0)
    with pytest.raises(ValueError, match=r"stop: expected a value in \[0, "):
        sp.make_policy(4, eos=True, stop=5.0)


# ---------------------------------------------------------------- the fork-density family (issue 35)
def test_density_family_decisions_grow_with_the_horizon():
    """Forks at a constant density over the whole response, a constant error rate per position: the
    expected forks and mistakes grow ∝ T (exactly, for fixed lengths and T a multiple of the spacing)."""
    p, eps = 0.6, 0.01
    expected = {}
    for horizon in (32, 64, 128, 512, 2048):
        policy = sp.make_density_policy(horizon, spacing=8, fork_prob=p, error_rate=eps)
        forks = (policy.kind == sp.FORK).nonzero().flatten()
        assert forks.numel() == horizon // 8
        assert set(forks.diff().tolist()) == {8} and int(forks[0]) == 4           # evenly, over the whole response
        assert bool((policy.kind[horizon // 2:] == sp.FORK).any())                 # the second half holds forks too
        dist = sp.mistake_distribution(policy)
        assert float(dist.sum()) == pytest.approx(1.0, abs=1e-10)
        mean = float((torch.arange(horizon + 1, dtype=torch.float64) * dist).sum())
        assert mean == pytest.approx(forks.numel() * (1 - p) + (horizon - forks.numel()) * eps, rel=1e-10)
        expected[horizon] = mean
    assert expected[2048] / expected[32] == pytest.approx(64.0, rel=1e-10)
    assert (sp.make_density_policy(8).kind == sp.FORK).sum() == 1 and (sp.make_density_policy(3).kind == sp.FORK).sum() == 1


@pytest.mark.parametrize("eos", [False, True])
def test_density_budget_puts_the_success_rate_nearest_one_half(eos):
    for horizon in (8, 32, 256):
        policy = sp.random_density_policy(horizon, torch.Generator().manual_seed(horizon), eos=eos)
        cdf = sp.mistake_distribution(policy).cumsum(0)
        J = float(sp.success_probability(policy))
        assert J == pytest.approx(float(cdf[policy.budget]), abs=1e-12)
        assert abs(J - 0.5) == pytest.approx(float((cdf - 0.5).abs().min()), abs=1e-12)


def test_density_instance_matches_its_constant_twin_at_the_reference_horizon():
    """Instance i draws the same fork probability and stop rate in both families; at T = 32 the density
    family holds the constant family's 4 forks and the same expected errors per response."""
    T = sp.DENSITY_REFERENCE
    for i in range(3):
        const = sp.random_policy(T, torch.Generator().manual_seed(i), eos=False)
        dense = sp.random_density_policy(T, torch.Generator().manual_seed(i), eos=False)
        torch.testing.assert_close(const.probs[sp.FORK], dense.probs[sp.FORK], rtol=0, atol=0)
        assert int((const.kind == sp.FORK).sum()) == int((dense.kind == sp.FORK).sum()) == 4
        def errors(policy):
            return float((policy.probs[policy.row][policy.kind != sp.FORK, 1]).sum())
        assert errors(const) == pytest.approx(errors(dense), rel=1e-12)


def test_density_sampling_matches_the_exact_mistake_distribution():
    policy = sp.make_density_policy(12, spacing=3, eos=True, error_rate=0.08, stop=1.5)
    n = 200_000
    tokens, mask, rewards = sp.sample(policy, n, torch.Generator().manual_seed(4))
    dist = sp.mistake_distribution(policy)
    counts = torch.bincount((tokens == 1).sum(1), minlength=13).double() / n
    for k in range(13):
        q = float(dist[k])
        assert abs(float(counts[k]) - q) < 4.5 * math.sqrt(q * (1 - q) / n) + 1e-9
    J = float(sp.success_probability(policy))
    assert abs(float(rewards.mean()) - J) < 4.5 * math.sqrt(J * (1 - J) / n)
    assert not bool(((tokens == sp.EOS) & (policy.kind == sp.FORK)).any())    # a fork never ends the response


def test_bad_density_arguments_are_refused():
    with pytest.raises(ValueError, match="spacing: expected"):
        sp.make_density_policy(8, spacing=0)
    with pytest.raises(ValueError, match=r"error_rate: expected a value in \(0, 1\)"):
        sp.make_density_policy(8, error_rate=1.0)
    with pytest.raises(ValueError, match="budget: expected"):
        sp.make_density_policy(8, budget=-1)
