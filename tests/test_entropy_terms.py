"""The entropy terms: the entropy bonus (its value against a loop, its gradient through
``token_stats`` against a brute-force softmax, the adaptive controller against TRL's rule) and the
high-entropy token mask (against a loop and TRL's ``get_high_entropy_mask``), with properties."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl import policy_loss, token_stats
from creditrl.core.losses import EntropyBonusOptions, EntropyControl, PolicyLoss, TopEntropyOptions
from test_stapo import loop_quantile


def batch(seed, rows=6, length=10, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=g) < 0.7
    mask[0] = False
    mask[:, 0] |= torch.arange(rows) > 0
    old = -torch.rand(rows, length, generator=g, dtype=dtype) * 3
    logp = (old + 0.4 * torch.randn(rows, length, generator=g, dtype=dtype)).clamp(max=0)   # log-probs: <= 0
    adv = torch.randn(rows, generator=g, dtype=dtype)
    entropy = torch.rand(rows, length, generator=g, dtype=dtype) * 2.5
    return logp, old, adv, mask, entropy


def loop_mean(values, mask, mode):
    """token-mean or seq-mean-token-mean of values over mask, by loops."""
    rows = [[values[b, t].item() for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    return sum(sum(r) / len(r) for r in rows) / len(rows)


# ---- entropy bonus ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_entropy_bonus_is_the_loss_minus_coef_times_the_aggregated_entropy(mode):
    logp, old, adv, mask, entropy = batch(0)
    plain, _ = policy_loss(logp, old, adv, mask, agg=mode)
    ent = entropy.clone().requires_grad_()
    loss, metrics = policy_loss(logp, old, adv, mask, agg=mode, entropy=ent,
                                entropy_bonus=EntropyBonusOptions(coef=0.3))
    assert loss.item() == pytest.approx(plain.item() - 0.3 * loop_mean(entropy, mask, mode), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, ent)
    m = mask.double()
    per_token = m / m.sum() if mode == "token-mean" else m / m.sum(1, keepdim=True).clamp(min=1) / mask.any(1).sum()
    torch.testing.assert_close(grad, -0.3 * per_token, rtol=1e-12, atol=1e-15)
    assert metrics["bonus_entropy"] == pytest.approx(loop_mean(entropy, mask, "token-mean"), rel=1e-12)
    assert metrics["entropy_bonus_coef"] == 0.3


def test_entropy_bonus_needs_the_entropy_and_takes_its_gradient_only_when_on():
    logp, old, adv, mask, entropy = batch(1)
    with pytest.raises(ValueError, match=r"entropy: expected a \[B,T\] tensor when loss term 'entropy_bonus' is on"):
        policy_loss(logp, old, adv, mask, entropy_bonus=EntropyBonusOptions(coef=0.1))
    ent = entropy.clone().requires_grad_()
    loss, _ = policy_loss(logp.requires_grad_(), old, adv, mask, entropy=ent, stapo=True)   # STAPO reads it as data
    assert torch.autograd.grad(loss, ent, allow_unused=True) == (None,)


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_bonus_gradient_through_token_stats_equals_brute_force_softmax(chunk_size, temperature):
    """∂loss/∂logits through creditrl.token_stats (chunked, recomputing backward) equals the same
    loss written with a full float64 softmax: log π(y) = log_softmax(x/T)[y], H = −Σ p log p."""
    g = torch.Generator().manual_seed(3)
    rows, steps, vocab = 4, 6, 23
    logits = torch.randn(rows, steps, vocab, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, vocab, (rows, steps), generator=g)
    mask = torch.rand(rows, steps, generator=g) < 0.8
    old = torch.log_softmax(logits / temperature + 0.3 * torch.randn(logits.shape, generator=g, dtype=torch.float64),
                            -1).gather(-1, tokens[..., None]).squeeze(-1)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    options = dict(entropy_bonus=EntropyBonusOptions(coef=0.2), agg="seq-mean-token-mean", clip_high=0.28)

    x = logits.clone().requires_grad_()
    stats = token_stats(x, tokens, mask, temperature=temperature, chunk_size=chunk_size)
    loss, _ = policy_loss(stats.logp.double(), old, adv, mask, entropy=stats.entropy.double(), **options)
    (grad,) = torch.autograd.grad(loss, x)

    y = logits.clone().requires_grad_()
    log_probs = torch.log_softmax(y / temperature, -1)
    logp = log_probs.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    ref, _ = policy_loss(logp, old, adv, mask, entropy=entropy, **options)
    (want,) = torch.autograd.grad(ref, y)
    # token_stats computes in float32 (~1e-6 relative of the float64 softmax)
    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)
    assert want[mask].abs().sum() > 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), coef=st.floats(0.01, 1.0), scale=st.floats(0.1, 5.0))
def test_a_small_step_against_the_bonus_gradient_raises_the_entropy(seed, coef, scale):
    """What the bonus is for: with the policy terms silent (A = 0), a small gradient step on the
    logits raises the mean entropy of the kept tokens, to first order by lr·coef·‖∂H̄/∂x‖² > 0."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * scale).requires_grad_()
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.rand(3, 5, generator=g) < 0.8
    mask[0, 0] = True

    def mean_entropy(x):
        log_p = torch.log_softmax(x, -1)
        return (-(log_p.exp() * log_p).sum(-1) * mask).sum() / mask.sum()
    stats = token_stats(logits, tokens, mask)
    loss, _ = policy_loss(stats.logp.double(), stats.logp.double().detach(), torch.zeros(3, dtype=torch.float64),
                          mask, entropy=stats.entropy.double(), entropy_bonus=EntropyBonusOptions(coef=coef))
    (grad,) = torch.autograd.grad(loss, logits)
    lr = 1e-4 / max(float(grad.norm()), 1e-12)
    with torch.no_grad():
        before, after = mean_entropy(logits), mean_entropy(logits - lr * grad)
    assert after > before or float(grad.norm()) < 1e-9


def trl_adaptive_loop(coef, entropies, target, low, high, delta):
    """TRL 1.16 GRPOTrainer._compute_loss's controller, written out: (applied, coef) per step."""
    last, out = float("inf"), []
    for world_entropy in entropies:
        apply_coef = coef if last <= target else 0.0
        if world_entropy <= target:
            coef = min(coef + delta, high)
        else:
            coef = max(coef - delta, low)
        last = world_entropy
        out.append((apply_coef, coef))
    return out


@settings(max_examples=50, deadline=None)
@given(entropies=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40), coef=st.floats(0.0, 0.2),
       target=st.floats(0.05, 0.8), delta=st.floats(1e-4, 0.05))
def test_entropy_control_follows_trls_adaptive_rule(entropies, coef, target, delta):
    options = EntropyBonusOptions(coef=coef, adaptive=True, target=target, coef_min=0.0, coef_max=0.3,
                                  coef_delta=delta)
    control, got = EntropyControl(options.coef), []
    for h in entropies:
        applied = control.applied(options)
        control = control.update(h, options)
        got.append((applied, control.coef))
        assert 0.0 <= control.coef <= 0.3                                    # within [coef_min, coef_max]
        assert applied == 0.0 or got[-1][0] <= 0.3
    want = trl_adaptive_loop(coef, entropies, target, 0.0, 0.3, delta)
    assert [a for a, _ in got] == pytest.approx([a for a, _ in want], abs=1e-15)
    assert [c for _, c in got] == pytest.approx([c for _, c in want], abs=1e-12)
    if all(h <= target for h in entropies):           # collapsed throughout: β only grows
        assert all(later >= earlier for (_, earlier), (_, later) in zip(got, got[1:]))


def test_entropy_control_gives_the_loss_the_applied_coefficient_even_below_coef_min():
    options = EntropyBonusOptions(coef=0.05, adaptive=True, coef_min=0.01, target=0.3)
    first = EntropyControl(0.05).loss_options(options)            # no step measured yet: β applied = 0
    assert first.coef == 0.0 and not first.adaptive
    assert EntropyControl(0.05, 0.1).loss_options(options).coef == 0.05


def test_entropy_control_ignores_a_step_that_measured_nothing():
    options = EntropyBonusOptions(coef=0.1, adaptive=True)
    control = EntropyControl(0.1, 0.1)
    assert control.update(math.nan, options) == control


@pytest.mark.parametrize("kwargs,match", [
    ({"coef": math.nan}, r"coef: expected a finite number, got nan"),
    ({"adaptive": 1}, r"adaptive: expected a bool, got int 1"),
    ({"target": -0.1}, r"target: expected a value in \[0, inf\], got -0.1"),
    ({"coef_min": 0.5, "coef_max": 0.1}, r"coef_max: expected a value in \[0.5, inf\], got 0.1"),
    ({"coef_delta": 0.0}, r"coef_delta: expected a value in \(0, inf\], got 0.0"),
    ({"adaptive": True, "coef": 2.0}, r"coef: expected a value in \[0, 1\], got 2.0"),
])
def test_entropy_bonus_bad_options(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EntropyBonusOptions(**kwargs)


def test_with_options_replaces_one_terms_options():
    loss = PolicyLoss([{"path": "entropy_bonus", "coef": 0.0, "adaptive": True}])
    later = loss.with_options("entropy_bonus", {"coef": 0.05, "adaptive": True})
    assert later.options_of("entropy_bonus").coef == 0.05 and loss.options_of("entropy_bonus").coef == 0.0
    with pytest.raises(ValueError, match="loss term 'stapo' is not part of this loss"):
        loss.with_options("stapo", None)


# ---- top-ρ entropy mask -------------------------------------------------------------------------

def trl_high_entropy_mask(entropies, mask, threshold):
    """TRL 1.16's GRPOTrainer.get_high_entropy_mask on one process (its gather is the identity)."""
    from trl import GRPOTrainer
    accelerator = SimpleNamespace(pad_across_processes=lambda x, dim, pad_index: x, gather=lambda x: x)
    return GRPOTrainer.get_high_entropy_mask(SimpleNamespace(accelerator=accelerator), entropies, mask, threshold)


@pytest.mark.parametrize("quantile", [0.2, 0.5, 1.0])
def test_top_entropy_matches_a_loop_and_trls_mask(quantile):
    logp, old, adv, mask, entropy = batch(4)
    entropy = entropy.float()                  # TRL takes its quantile in float32: the same threshold
    loss, metrics = policy_loss(logp, old, adv, mask, entropy=entropy, top_entropy=TopEntropyOptions(quantile))
    cells = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    threshold = loop_quantile([entropy[b, t].item() for b, t in cells], 1 - quantile)
    high = {(b, t) for b, t in cells if entropy[b, t].item() >= threshold}
    ratio = (logp - old).exp()
    total = 0.0
    for b, t in cells:
        a, r = adv[b].item(), ratio[b, t].item()
        surrogate = max(-a * r, -a * min(max(r, 0.8), 1.2))
        total += surrogate if (b, t) in high else 0.0
    assert loss.item() == pytest.approx(total / len(cells), rel=1e-12)          # denominators: every token
    assert metrics["high_entropy_frac"] == pytest.approx(len(high) / len(cells))
    trl = trl_high_entropy_mask(entropy, mask, 1 - quantile)
    assert {tuple(x) for x in trl.nonzero().tolist()} == high


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), quantile=st.one_of(st.floats(0.01, 1.0), st.floats(1e-12, 1e-3)))
def test_top_entropy_keeps_the_top_rho_fraction(seed, quantile):
    """With distinct entropies, n − ⌈(1 − ρ)(n − 1)⌉ tokens keep their surrogate (those at or above
    the linear-interpolation quantile; one more when the interpolated threshold rounds onto the value
    below it), and each moving token's entropy is at least every dropped one's."""
    logp, old, adv, mask, entropy = batch(seed)
    lp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, adv, mask, entropy=entropy, top_entropy=TopEntropyOptions(quantile))
    (grad,) = torch.autograd.grad(loss, lp)
    n = int(mask.sum())
    kept = round(metrics["high_entropy_frac"] * n)
    position = (1.0 - quantile) * (n - 1)       # the quantile's; the threshold may round onto its lower value
    assert kept in (n - math.ceil(position), n - math.floor(position))
    moving = (grad != 0) & mask                        # a kept token moves unless its clip binds
    assert moving.sum() <= kept
    if moving.any() and kept < n:
        threshold = entropy[mask].sort().values[n - kept]
        assert bool((entropy[moving] >= threshold).all())
    assert not (grad[~mask] != 0).any()


def test_top_entropy_bad_quantile():
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match=rf"quantile: expected a value in \(0, 1\], got {bad}"):
            TopEntropyOptions(bad)
