"""The unbiased KL gradient (verl's "k3+", TRL's use_bias_correction_kl): equal to verl's
``kl_penalty`` and TRL's formula, and, by exact enumeration of a categorical policy, an unbiased
estimate of ∇KL(π_θ‖π_ref) where plain k3 is not. Masking of truncated completions against a loop."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl import policy_loss
from creditrl.core.losses import KLOptions

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")


def kl_batch(seed, rows=5, length=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=g) < 0.8
    old = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.3 * torch.randn(rows, length, generator=g, dtype=torch.float64)).clamp(max=0)   # log-probs: <= 0
    ref = (logp + 0.6 * torch.randn(rows, length, generator=g, dtype=torch.float64)).clamp(max=0)   # k3 < verl's cap 10
    return logp, old, ref, mask


def penalty_only(logp, old, ref, mask, **kl):
    """The KL part of the loss: the loss with it minus the loss without (token-mean)."""
    zero_adv = torch.zeros(logp.shape[0], dtype=logp.dtype)
    loss, metrics = policy_loss(logp, old, zero_adv, mask, ref_logp=ref, kl_coef=1.0, **kl)
    return loss, metrics


@pytest.mark.parametrize("estimator", ["k1+", "k3+", "k1", "k3", "k2"])
def test_straight_through_estimators_equal_verls_kl_penalty(estimator):
    logp, old, ref, mask = kl_batch(0)
    lp, lp_verl = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours, metrics = penalty_only(lp, old, ref, mask, kl_estimator=estimator)
    theirs = core_algos.agg_loss(core_algos.kl_penalty(lp_verl, ref, estimator), mask.double(), "token-mean")
    (grad,), (want,) = torch.autograd.grad(ours, lp), torch.autograd.grad(theirs, lp_verl)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-14)
    assert metrics["ref_kl"] == pytest.approx(theirs.item(), rel=1e-12)


def test_bias_correction_equals_trls_ratio_weighted_k3():
    """TRL 1.16: per_token_kl = (exp(ref − logp) − (ref − logp) − 1) · exp(logp − old), coef_1 with its gradient."""
    logp, old, ref, mask = kl_batch(1)
    lp, lp_trl = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ours, _ = penalty_only(lp, old, ref, mask, kl_bias_correction=True)
    x = ref - lp_trl
    per_token_kl = (torch.exp(x) - x - 1) * torch.exp(lp_trl - old)
    theirs = (per_token_kl * mask).sum() / mask.sum()
    (grad,), (want,) = torch.autograd.grad(ours, lp), torch.autograd.grad(theirs, lp_trl)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-14)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 7), off_policy=st.booleans())
def test_corrected_kl_gradients_are_unbiased_by_exact_enumeration(seed, vocab, off_policy):
    """With y ~ π_old (π_old = π_θ on-policy), Σ_y π_old(y)·∇penalty(y) against ∇KL(π_θ‖π_ref):
    equal for k3 with the ratio weight and k3+/k1+ with it (on and off policy), for k3+/k1+ on-policy; plain k3's
    expected gradient is not ∇KL: it is the forward KL's, ∇KL(π_ref‖π_θ), which it equals (a check that
    holds everywhere, where "differs from ∇KL" fails near the points where the two KLs' gradients cross)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(vocab, generator=g, dtype=torch.float64).requires_grad_()
    ref_logits = torch.randn(vocab, generator=g, dtype=torch.float64)
    pi = torch.softmax(theta, 0)
    behaviour = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64), 0) if off_policy else pi.detach()
    kl = (pi * (torch.log(pi) - torch.log_softmax(ref_logits, 0))).sum()
    (true_grad,) = torch.autograd.grad(kl, theta)
    ref_pi = torch.softmax(ref_logits, 0)
    (forward_grad,) = torch.autograd.grad((ref_pi * (ref_pi.log() - torch.log_softmax(theta, 0))).sum(), theta)

    def expected(**options):
        total = torch.zeros(vocab, dtype=torch.float64)
        for y in range(vocab):             # one sampled token at a time: the estimator as a trainer uses it
            logp = torch.log_softmax(theta, 0)[y].reshape(1, 1)
            loss, _ = policy_loss(logp, torch.log(behaviour[y]).reshape(1, 1), torch.zeros(1, dtype=torch.float64),
                                  torch.ones(1, 1, dtype=torch.bool),
                                  ref_logp=torch.log_softmax(ref_logits, 0)[y].reshape(1, 1), kl_coef=1.0, **options)
            total += behaviour[y] * torch.autograd.grad(loss, theta)[0]
        return total

    torch.testing.assert_close(expected(kl_bias_correction=True), true_grad, rtol=1e-10, atol=1e-12)
    for straight_through in ("k3+", "k1+"):     # both corrections: the ratio weights k2's gradient
        torch.testing.assert_close(expected(kl_estimator=straight_through, kl_bias_correction=True), true_grad,
                                   rtol=1e-10, atol=1e-12)
    if not off_policy:
        torch.testing.assert_close(expected(kl_estimator="k3+"), true_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(expected(kl_estimator="k1+"), true_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(expected(kl_estimator="k3"), forward_grad, rtol=1e-10, atol=1e-12)


def test_kl_bad_options():
    with pytest.raises(ValueError, match=r"kl_estimator: unknown value 'k3\+\+'"):
        KLOptions(kl_estimator="k3++")
    with pytest.raises(TypeError, match=r"kl_bias_correction: expected a bool, got str 'yes'"):
        KLOptions(kl_bias_correction="yes")


# ---- truncated completions ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_mask_truncated_equals_the_loss_of_the_other_rows(mode):
    """Dropping the truncated rows from the loss = computing it on the other rows alone (their
    log-probs then do not matter; Dr. GRPO's B counts every response, as TRL's mask does)."""
    logp, old, ref, mask = kl_batch(2, rows=6)
    adv = torch.randn(6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    truncated = torch.tensor([False, True, False, True, False, False])
    lp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, adv, mask, agg=mode, max_len=9, mask_truncated=True, truncated=truncated)
    (grad,) = torch.autograd.grad(loss, lp)
    others = policy_loss(logp, old, adv, mask & ~truncated[:, None], agg=mode, max_len=9)[0]
    assert loss.item() == pytest.approx(others.item(), rel=1e-12)
    assert bool((grad[truncated] == 0).all()) and grad[~truncated].abs().sum() > 0
    assert metrics["truncated_masked_frac"] == pytest.approx((mask & truncated[:, None]).sum().item() / mask.sum().item())
    garbage = logp.clone()
    garbage[truncated] = -50.0
    assert policy_loss(garbage, old, adv, mask, agg=mode, max_len=9, mask_truncated=True,
                       truncated=truncated)[0].item() == pytest.approx(loss.item(), rel=1e-12)


def test_mask_truncated_needs_the_rows_and_checks_them():
    logp, old, _, mask = kl_batch(4, rows=3)
    adv = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"truncated: expected a \[B\] tensor when loss term 'mask_truncated' is on"):
        policy_loss(logp, old, adv, mask, mask_truncated=True)
    with pytest.raises(ValueError, match=r"truncated: expected shape \[3\], got \[2\]"):
        policy_loss(logp, old, adv, mask, mask_truncated=True, truncated=torch.zeros(2, dtype=torch.bool))
    every = policy_loss(logp.requires_grad_(), old, adv, mask, mask_truncated=True, truncated=torch.ones(3))
    assert every[0].item() == 0.0 and every[1]["kept_frac"] == 0.0      # all cut: loss 0, said by kept_frac


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), cut=st.lists(st.booleans(), min_size=5, max_size=5), shift=st.floats(-5, 0))
def test_truncated_rows_never_reach_the_loss_or_its_gradient(seed, cut, shift):
    """Whatever the truncated responses' log-probs, advantages and lengths, the loss and the other
    rows' gradient are those of the batch without them (the rows leave every denominator)."""
    logp, old, _, mask = kl_batch(seed, rows=5)
    adv = torch.randn(5, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    truncated = torch.tensor(cut)
    moved, moved_adv = logp.clone(), adv.clone()
    moved[truncated] += shift                 # down only: log-probs stay <= 0
    moved_adv[truncated] *= -3.0
    for lp, a in ((logp, adv), (moved, moved_adv)):
        x = lp.clone().requires_grad_()
        loss, _ = policy_loss(x, old, a, mask, mask_truncated=True, truncated=truncated, agg="seq-mean-token-mean")
        (grad,) = torch.autograd.grad(loss, x)
        y = lp.clone().requires_grad_()
        alone, _ = policy_loss(y, old, a, mask & ~truncated[:, None], agg="seq-mean-token-mean")
        (want,) = torch.autograd.grad(alone, y)
        torch.testing.assert_close(loss, alone, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-14)
