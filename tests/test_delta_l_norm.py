"""ΔL normalisation (arXiv 2509.07558): against a loop, its unbiasedness (the per-response weights
sum to 1/M whatever the lengths, where GRPO's and DAPO's normalisations move with them), minimum
variance at α = 1 under Var(g_b) ∝ n_b, and exact accumulation over micro-batches."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl import policy_loss
from creditrl.core.losses import DeltaLNormOptions


def ragged(lengths, width=None, seed=0):
    """On-policy inputs with rows of the given lengths (0 = an empty row) and advantages −1, so
    that ∂loss/∂log π_bt = the aggregation's weight on token t of row b."""
    width = width or max(max(lengths), 1)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    old = -torch.rand(len(lengths), width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return old, mask


def token_weights(lengths, width=None, **agg):
    """The aggregation's weight of each token: ∂L/∂ℓ_bt, read off ∂loss/∂log π at r = 1 with A = −1."""
    old, mask = ragged(lengths, width)
    lp = old.clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, -torch.ones(len(lengths), dtype=torch.float64), mask, **agg)
    return torch.autograd.grad(loss, lp)[0], mask, metrics


def test_delta_l_norm_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    lengths = [5, 0, 12, 3, 8]
    old, mask = ragged(lengths, width=14)
    logp = (old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)).clamp(max=0)   # log-probs: <= 0
    adv = torch.randn(5, generator=g, dtype=torch.float64)
    for alpha in (0.0, 0.5, 0.75, 1.0):
        loss, metrics = policy_loss(logp, old, adv, mask, delta_l_norm=DeltaLNormOptions(alpha), max_len=20)
        total, weights = 0.0, 0.0
        for b, n in enumerate(lengths):
            if n == 0:
                continue
            row = 0.0
            for t in range(n):
                a, r = adv[b].item(), (logp[b, t] - old[b, t]).exp().item()
                row += max(-a * r, -a * min(max(r, 0.8), 1.2))
            total += n ** -alpha * row
            weights += n ** -alpha
        assert loss.item() == pytest.approx(total / (weights * 20), rel=1e-12)
        assert metrics["agg_count"] == pytest.approx(weights, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=2, max_size=12).filter(lambda x: sum(x) > 0),
       alpha=st.floats(0.0, 1.0), max_len=st.integers(40, 64))
def test_weights_sum_to_one_over_m_whatever_the_lengths(lengths, alpha, max_len):
    """Unbiasedness: with E[g_b | n_b] = μ for every response (each summed token loss estimates the
    same gradient), E[L] = μ·Σ_b x_b / M = μ/M for any lengths, since the weights x_b sum to 1."""
    grad, mask, _ = token_weights(lengths, max_len, delta_l_norm=DeltaLNormOptions(alpha), max_len=max_len)
    rows = [grad[b, 0].item() for b, n in enumerate(lengths) if n]
    assert sum(rows) * max_len == pytest.approx(1.0, rel=1e-12)
    for b, n in enumerate(lengths):       # one weight per response, on each of its tokens, ∝ n^-α
        assert torch.all(grad[b, :n] == grad[b, 0]) and torch.all(grad[b, n:] == 0)
        if n:
            assert grad[b, 0].item() * n ** alpha == pytest.approx(rows[0] * next(x for x in lengths if x) ** alpha,
                                                                   rel=1e-10)


def test_grpo_and_dapo_normalisations_move_with_the_lengths():
    """The contrast the paper draws: per-response sums weigh Σ_b 1/(|S| n_b) (GRPO) or |S|/Σn (DAPO)
    in total, so the same per-response gradient μ is scaled by the length draw; ΔL's total is 1/M."""
    totals = {}
    for lengths in ([4, 4, 4, 4], [1, 2, 20, 40]):
        for name, agg in (("grpo", {"agg": "seq-mean-token-mean"}), ("dapo", {"agg": "token-mean"}),
                          ("delta_l", {"delta_l_norm": DeltaLNormOptions(1.0), "max_len": 40})):
            grad, _, _ = token_weights(lengths, 40, **agg)
            totals.setdefault(name, []).append(sum(grad[b, 0].item() for b in range(len(lengths))))
    assert totals["delta_l"][0] == pytest.approx(totals["delta_l"][1], rel=1e-12) == pytest.approx(1 / 40)
    assert totals["grpo"][0] != pytest.approx(totals["grpo"][1], rel=0.1)
    assert totals["dapo"][0] != pytest.approx(totals["dapo"][1], rel=0.1)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=2, max_size=10), seed=st.integers(0, 2**16),
       alpha=st.floats(0.0, 1.0))
def test_alpha_one_has_the_least_variance_of_the_unbiased_weightings(lengths, seed, alpha):
    """Var(Σ_b x_b g_b) = σ²·Σ_b x_b² n_b when Var(g_b) = σ² n_b (independent responses): among
    weights with Σ x_b = 1, α = 1 (x ∝ 1/n) minimises it: below any other α and random weights."""
    def variance(x):
        return sum(w * w * n for w, n in zip(x, lengths))

    def weights(a):
        grad, _, _ = token_weights(lengths, 50, delta_l_norm=DeltaLNormOptions(a), max_len=1)
        return [grad[b, 0].item() for b in range(len(lengths))]

    best = variance(weights(1.0))
    assert best == pytest.approx(1.0 / sum(1.0 / n for n in lengths), rel=1e-10)    # the Lagrange optimum
    assert best <= variance(weights(alpha)) * (1 + 1e-12)
    draws = -torch.log(torch.rand(len(lengths), generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    other = (draws / draws.sum()).tolist()                            # uniform on the simplex
    assert best <= variance(other) * (1 + 1e-12)


@pytest.mark.parametrize("alpha", [0.0, 0.75, 1.0])
def test_micro_batches_weighted_by_agg_count_give_the_batch_loss(alpha):
    g = torch.Generator().manual_seed(5)
    old, mask = ragged([3, 9, 0, 6, 1, 12, 7], width=12)
    logp = (old + 0.4 * torch.randn(old.shape, generator=g, dtype=torch.float64)).clamp(max=0)   # log-probs: <= 0
    adv = torch.randn(7, generator=g, dtype=torch.float64)
    options = dict(delta_l_norm=DeltaLNormOptions(alpha), max_len=16)
    whole, _ = policy_loss(logp, old, adv, mask, **options)
    parts = [policy_loss(logp[rows], old[rows], adv[rows], mask[rows], **options) for rows in (slice(0, 3), slice(3, 7))]
    counts = [metrics["agg_count"] for _, metrics in parts]
    combined = sum(loss.item() * c for (loss, _), c in zip(parts, counts)) / sum(counts)
    assert combined == pytest.approx(whole.item(), rel=1e-12)


def test_alpha_zero_is_dr_grpo_over_the_responses_with_tokens():
    lengths = [5, 7, 2, 9]
    grad_zero, _, _ = token_weights(lengths, 12, delta_l_norm=DeltaLNormOptions(0.0), max_len=12)
    grad_dr, _, _ = token_weights(lengths, 12, agg="seq-mean-token-sum-norm", max_len=12)
    torch.testing.assert_close(grad_zero, grad_dr, rtol=1e-12, atol=1e-15)


def test_no_kept_token_gives_zero_and_bad_alpha_is_refused():
    old, mask = ragged([0, 0])
    lp = old.clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, torch.ones(2, dtype=torch.float64), mask, delta_l_norm=DeltaLNormOptions())
    assert loss.item() == 0.0 and metrics["agg_count"] == 0.0
    loss.backward()
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"alpha: expected a value in \[0, 1\], got {bad}"):
            DeltaLNormOptions(bad)
