"""The verl-named policy losses (gspo, geo_mean, cispo, sapo, dppo_tv, dppo_kl, clip_cov, kl_cov):
equal to verl 0.9.1's own functions in value and in gradient with respect to log_prob (float64,
relative difference <= 1e-5, masked inputs where the clips bind, every aggregation verl supports
for the loss, sequence- and token-level advantages, with and without rollout IS weights), the
replacement of the default surrogate, and hypothesis properties of what each paper guarantees."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl import policy_loss
from creditrl.core.losses import ON_POLICY_AS_CLIP, ClipCovOptions, KLCovOptions, SapoOptions, PolicyLoss
from creditrl.core.losses.dppo import DPPO_DEFAULT_CAP

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

VERL_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
TOLERANCE = 1e-5         # verl's agg_loss adds 1e-8 to its seq-mean denominators: ~1e-9 relative


def verl_config(**policy_loss_fields):
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, clip_ratio=CLIP_LOW,
                       clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C,
                       policy_loss=PolicyLossConfig(**policy_loss_fields))


def inputs(seed, token_adv=False, rows=8, length=12, spread=0.5, empty_row=True):
    """float64 log-probs with ratios far enough from 1 that the clips bind, a ragged mask (an empty
    row when ``empty_row``), advantages per sequence (broadcast, as verl stores them) or per token."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=g) < 0.75
    mask[:, 0] = True
    if empty_row:
        mask[2] = False
    old = torch.log(torch.rand(rows, length, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    shift = 0.4 * torch.randn(rows, 1, generator=g, dtype=torch.float64)     # so sequence ratios leave the range
    logp = old + shift + spread * torch.randn(rows, length, generator=g, dtype=torch.float64)
    below_one = -1e-3 - 0.1 * torch.rand(rows, length, generator=g, dtype=torch.float64)
    logp = torch.where(logp > -1e-3, below_one, logp)        # a probability below 1, and no ties
    adv = torch.randn((rows, length) if token_adv else (rows, 1), generator=g, dtype=torch.float64)
    adv = adv.expand(rows, length) * mask
    weights = torch.rand(rows, length, generator=g, dtype=torch.float64) * 1.5 + 0.25
    return old, logp, adv, mask, weights


def relative(ours, theirs):
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-300))


def compare(name, ours_kwargs, config, mode, seed, token_adv, weights=False, empty_row=True, verl_mode=None):
    """policy_loss (ours) against verl's ``name`` (theirs) on the same inputs: value and ∂/∂log_prob."""
    old, logp, adv, mask, w = inputs(seed, token_adv, empty_row=empty_row)
    lp_ours, lp_theirs = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    theirs, _ = core_algos.get_policy_loss_fn(name)(
        old_log_prob=old, log_prob=lp_theirs, advantages=adv, response_mask=mask.double(),
        loss_agg_mode=verl_mode or mode, config=config, rollout_is_weights=w if weights else None)
    ours, metrics = policy_loss(lp_ours, old, adv, mask, agg=mode, clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                                weights=w if weights else None, **ours_kwargs)
    (grad_ours,) = torch.autograd.grad(ours, lp_ours)
    (grad_theirs,) = torch.autograd.grad(theirs, lp_theirs)
    value, gradient = relative(ours.detach(), theirs.detach()), relative(grad_ours, grad_theirs)
    assert value <= TOLERANCE and gradient <= TOLERANCE, (value, gradient)
    assert grad_theirs.abs().sum() > 0
    return metrics


CASES = {  # verl name -> (creditrl keywords, verl config fields, the aggregations verl supports for it)
    "cispo": ({"cispo": True}, {}, VERL_MODES),
    "gspo": ({"gspo": True}, {}, VERL_MODES),
    "dppo_tv": ({"dppo_tv": True, "clip_c": CLIP_C}, {}, VERL_MODES),
    "dppo_kl": ({"dppo_kl": True, "clip_c": CLIP_C}, {}, VERL_MODES),
    "kl_cov": ({"kl_cov": KLCovOptions(kl_cov_ratio=0.1, ppo_kl_coef=0.7)}, {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.7},
               VERL_MODES),
    # clip_cov draws its tokens at random: forced here (clip_cov_ratio = 1 keeps every candidate)
    "clip_cov": ({"clip_cov": ClipCovOptions(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=0.6)},
                 {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.05, "clip_cov_ub": 0.6}, VERL_MODES),
    # verl aggregates SAPO by seq-mean-token-mean whatever loss_agg_mode says
    "sapo": ({"sapo": SapoOptions(tau_pos=1.0, tau_neg=1.05)}, {}, ["seq-mean-token-mean"]),
}


@pytest.mark.parametrize("weights", [False, True], ids=["", "is_weights"])
@pytest.mark.parametrize("token_adv", [False, True], ids=["adv[B]", "adv[B,T]"])
@pytest.mark.parametrize("name,mode", [(n, m) for n, (_, _, modes) in CASES.items() for m in modes])
def test_equals_verl_value_and_gradient(name, mode, token_adv, weights):
    ours_kwargs, fields, _ = CASES[name]
    # seq-mean-token-sum-norm: Dr. GRPO divides by all B responses, verl's agg_loss by the non-empty ones
    # (unless given global_batch_size): equal when every row has a token
    empty_row = mode != "seq-mean-token-sum-norm"
    for seed in range(3):
        metrics = compare(name, ours_kwargs, verl_config(**fields), mode, seed, token_adv, weights, empty_row)
    if name in ("cispo", "gspo", "dppo_tv", "dppo_kl", "clip_cov"):       # the clip / trust region binds
        assert metrics["clip_frac_low"] + metrics["clip_frac_high"] > 0.05
    if name in ("clip_cov", "kl_cov"):
        assert metrics["cov_selected_frac"] > 0


@pytest.mark.parametrize("weights", [False, True], ids=["", "is_weights"])
@pytest.mark.parametrize("token_adv", [False, True], ids=["adv[B]", "adv[B,T]"])
def test_geo_mean_equals_verl(token_adv, weights):
    """verl's geo_mean is a mean over the B rows (its only aggregation): creditrl's
    seq-mean-token-mean on rows that all have a token, and B/|S| times it with an empty row."""
    for seed in range(3):
        metrics = compare("geo_mean", {"geo_mean": True}, verl_config(), "seq-mean-token-mean", seed, token_adv,
                          weights, empty_row=False)
        assert metrics["clip_frac_low"] + metrics["clip_frac_high"] > 0.05
    old, logp, adv, mask, _ = inputs(5, token_adv)
    theirs, _ = core_algos.compute_policy_loss_geo_mean(old, logp, adv, mask.double(), config=verl_config())
    ours, _ = policy_loss(logp, old, adv, mask, geo_mean=True, agg="seq-mean-token-mean", clip_low=CLIP_LOW,
                          clip_high=CLIP_HIGH)
    rows = int(mask.any(1).sum())
    assert relative(ours * rows / mask.shape[0], theirs) <= TOLERANCE


def test_clip_cov_draws_k_of_its_candidates_at_random():
    """Where verl's choice is not forced: exactly k tokens, all among the candidates, a different
    draw per generator state, the loss equal to the clip surrogate with just those detached."""
    old, logp, adv, mask, _ = inputs(7, rows=16, length=32)
    options = ClipCovOptions(clip_cov_ratio=0.02, clip_cov_lb=0.0, clip_cov_ub=10.0)
    draws = set()
    for seed in range(6):
        torch.manual_seed(seed)
        lp = logp.clone().requires_grad_()
        loss, metrics = policy_loss(lp, old, adv, mask, clip_cov=options, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
        (grad,) = torch.autograd.grad(loss, lp)
        plain = logp.clone().requires_grad_()
        (plain_grad,) = torch.autograd.grad(policy_loss(plain, old, adv, mask, clip_low=CLIP_LOW,
                                                        clip_high=CLIP_HIGH)[0], plain)
        cut = (grad == 0) & (plain_grad != 0)
        k = max(int(0.02 * int(mask.sum())), 1)
        assert int(cut.sum()) == k == round(metrics["cov_selected_frac"] * int(mask.sum()))
        cov = (adv - adv[mask].mean()) * (logp - logp[mask].mean())
        assert bool((cov[cut] > 0).all())
        draws.add(tuple(cut.nonzero().flatten().tolist()))
        torch.testing.assert_close(grad[~cut], plain_grad[~cut])
    assert len(draws) > 1


def test_a_chosen_surrogate_replaces_clip_and_two_are_refused():
    loss = PolicyLoss({"cispo": None})
    assert [t.name for t, _ in loss.terms if t.stage == "surrogate"] == ["cispo"]
    assert loss.flat["clip"].clip_low == 0.2                    # the replaced term's options stay readable
    with pytest.raises(ValueError, match="loss terms 'cispo' and 'sapo' are both surrogate terms and cannot combine"):
        PolicyLoss([{"path": "cispo"}, {"path": "sapo"}])
    with pytest.raises(ValueError, match="'geo_mean' and 'kl_cov' are both surrogate terms"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3), geo_mean=True, kl_cov=True)
    with pytest.raises(ValueError, match="'delta_l_norm' and 'my_agg'|'my_agg' and 'delta_l_norm'"):
        from dataclasses import dataclass

        from creditrl import register_loss_term
        from creditrl.core.losses.terms import _REGISTRY

        @dataclass(frozen=True)
        class NoOptions:
            pass
        try:
            register_loss_term("my_agg", options=NoOptions, stage="aggregate")(lambda state, options: state)
            PolicyLoss({"my_agg": None, "delta_l_norm": None})
        finally:
            _REGISTRY.pop("my_agg", None)


@pytest.mark.parametrize("bad,match", [
    (lambda: SapoOptions(tau_pos=0.0), r"tau_pos: expected a value in \(0, inf\], got 0.0"),
    (lambda: SapoOptions(tau_neg=-1.0), r"tau_neg: expected a value in \(0, inf\], got -1.0"),
    (lambda: ClipCovOptions(clip_cov_ratio=0.0), r"clip_cov_ratio: expected a value in \(0, 1\], got 0.0"),
    (lambda: ClipCovOptions(clip_cov_ratio=1.5), r"clip_cov_ratio: expected a value in \(0, 1\], got 1.5"),
    (lambda: ClipCovOptions(clip_cov_lb=5.0, clip_cov_ub=1.0), r"clip_cov_ub: expected a value in \(5, inf\]"),
    (lambda: KLCovOptions(kl_cov_ratio=2.0), r"kl_cov_ratio: expected a value in \(0, 1\], got 2.0"),
    (lambda: KLCovOptions(ppo_kl_coef=-0.1), r"ppo_kl_coef: expected a value in \[0, inf\], got -0.1"),
    (lambda: PolicyLoss([{"path": "sapo", "tau": 1.0}]), r"loss term 'sapo': unknown option\(s\) \['tau'\]"),
    (lambda: policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3), cispo=True,
                         weights=-torch.ones(2, 3)), r"weights: expected data weights >= 0"),
])
def test_bad_options_are_refused_naming_the_key(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        bad()


# ---- what each paper guarantees ----------------------------------------------------------------

def on_policy_grad(seed, token_adv, mode, **kwargs):
    """∂loss/∂log π at π_θ = π_old, and the policy gradient written out: −Σ w_bt A_bt ∇log π."""
    old, _, adv, mask, _ = inputs(seed, token_adv)
    lp = old.clone().requires_grad_()
    loss, _ = policy_loss(lp, old, adv, mask, agg=mode, **kwargs)
    (grad,) = torch.autograd.grad(loss, lp)
    m = mask.double()
    n = m.sum(1, keepdim=True).clamp(min=1)
    rows = mask.any(1).sum()
    per_token = {"token-mean": m / m.sum(), "seq-mean-token-mean": m / n / rows}[mode]
    return grad, -adv * per_token


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), token_adv=st.booleans(), mode=st.sampled_from(["token-mean", "seq-mean-token-mean"]),
       term=st.sampled_from(ON_POLICY_AS_CLIP + ("clip_cov",)))
def test_on_policy_every_surrogate_gives_the_policy_gradient(seed, token_adv, mode, term):
    """At r = 1 each surrogate's gradient is the policy gradient A·∇log π (SAPO's gate has slope 1
    there, DPPO's region holds every token, KL-Cov's |z| has a kink with subgradient 0 chosen by
    autograd at 0): ``ON_POLICY_AS_CLIP``, on which creditrl train's on-policy note rests. Clip-Cov
    detaches its tokens even there, so its candidates are made empty here."""
    options = {"clip_cov": ClipCovOptions(clip_cov_lb=1e6, clip_cov_ub=1e7)}.get(term, True)
    grad, expected = on_policy_grad(seed, token_adv, mode, **{term: options})
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), spread=st.floats(0.05, 2.0))
def test_cispo_keeps_every_tokens_gradient(seed, spread):
    """CISPO: every kept token with A ≠ 0 has a non-zero gradient, the clipped weight times A;
    PPO's clip zeroes those whose ratio left the range in the advantage's direction."""
    old, logp, adv, mask, _ = inputs(seed, spread=spread)
    lp = logp.clone().requires_grad_()
    (grad,) = torch.autograd.grad(policy_loss(lp, old, adv, mask, cispo=True)[0], lp)
    r = (logp - old).exp()
    expected = -r.clamp(0.8, 1.2) * adv * mask.double() / mask.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-14)
    assert bool((grad[mask & (adv != 0)] != 0).all())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), tau_pos=st.floats(0.2, 5.0), tau_neg=st.floats(0.2, 5.0))
def test_sapo_gate_slope_is_at_most_one_and_one_on_policy(seed, tau_pos, tau_neg):
    """SAPO: ∂ℓ/∂r = −A·4σ(1 − σ) with σ = σ(τ(r − 1)), so |∂ℓ/∂z| ≤ |A|·r, equal at r = 1."""
    old, logp, adv, mask, _ = inputs(seed)
    lp = logp.clone().requires_grad_()
    options = SapoOptions(tau_pos=tau_pos, tau_neg=tau_neg)
    loss, _ = policy_loss(lp, old, adv, mask, sapo=options, agg="seq-mean-token-sum-norm", max_len=1)
    (grad,) = torch.autograd.grad(loss, lp)
    r = (logp - old).exp()
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    sig = torch.sigmoid(tau * (r - 1))
    rows = mask.shape[0]
    torch.testing.assert_close(grad * rows, -adv * 4 * sig * (1 - sig) * r * mask, rtol=1e-9, atol=1e-14)
    assert bool(((grad * rows).abs() <= (adv * r).abs() * (1 + 1e-12)).all())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), perm_seed=st.integers(0, 2**16))
def test_gspo_and_geo_mean_depend_on_a_response_only_through_its_mean_log_ratio(seed, perm_seed):
    """GSPO's and GMPO's ratios are functions of the response as a whole: permuting the tokens
    inside each response leaves the loss unchanged (a token-level PPO ratio would too, but not
    under clipping of a product: here the clip acts on the mean)."""
    old, logp, adv, mask, _ = inputs(seed, empty_row=False)
    mask = torch.ones_like(mask)
    perm = torch.randperm(mask.shape[1], generator=torch.Generator().manual_seed(perm_seed))
    for term in ("gspo", "geo_mean"):
        a, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean", **{term: True})
        b, _ = policy_loss(logp[:, perm], old[:, perm], adv[:, perm], mask, agg="seq-mean-token-mean", **{term: True})
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), low=st.floats(0.05, 0.95), high=st.floats(0.05, 5.0))
def test_geo_mean_is_the_geometric_mean_of_the_sign_clipped_ratios(seed, low, high):
    """GMPO: ℓ_b = −A_b·(Π_t r̃_t)^{1/n_b}, r̃ the ratio clipped on the advantage's side only (A > 0:
    at most e^{ε_high}; A < 0: at least e^{−ε_low}), checked by a loop over rows and tokens; for
    A_b > 0 and the clip out of reach, the geometric mean is at most GRPO's arithmetic mean (AM-GM)."""
    old, logp, adv, mask, _ = inputs(seed, empty_row=False)
    loss, _ = policy_loss(logp, old, adv, mask, geo_mean=True, agg="seq-mean-token-sum-norm", max_len=1,
                          clip_low=low, clip_high=high)
    total = 0.0
    for b in range(mask.shape[0]):
        z = [(logp[b, t] - old[b, t]).item() for t in range(mask.shape[1]) if mask[b, t]]
        a = adv[b, 0].item()
        clipped = [min(x, high) if a > 0 else max(x, -low) if a < 0 else 0.0 for x in z]
        geometric = math.exp(sum(clipped) / len(z))
        total += -a * geometric * len(z)             # ℓ_b on each of the row's n_b tokens
        if a > 0 and max(z) <= high:
            assert geometric <= sum(math.exp(x) for x in z) / len(z) * (1 + 1e-12)
    assert loss.item() * mask.shape[0] == pytest.approx(total, rel=1e-10)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), delta=st.floats(0.02, 0.5))
def test_dppo_passes_no_gradient_outside_its_trust_region_and_the_cispo_like_one_inside(seed, delta):
    """DPPO-TV: a token gets −A·min(r, C)·∇log π iff its probability moved by at most δ against
    (or any amount toward) the bound its advantage pushes it to, and 0 otherwise."""
    old, logp, adv, mask, _ = inputs(seed, spread=1.0)
    lp = logp.clone().requires_grad_()
    loss, _ = policy_loss(lp, old, adv, mask, dppo_tv=True, clip_low=delta, clip_high=delta)
    (grad,) = torch.autograd.grad(loss, lp)
    moved = logp.exp() - old.exp()
    inside = torch.where(adv > 0, moved <= delta, moved >= -delta)
    r = (logp - old).exp().clamp(max=20.0)
    torch.testing.assert_close(grad, -adv * r * inside * mask.double() / mask.sum(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("logp, old", [(5e-4, -1e-3), (-1e-3, 5e-4), (5e-4, 2e-4), (0.0, -1e-3)])
def test_dppo_kl_reads_log_probs_rounded_above_0_as_0(logp, old):
    """A log-prob within the accepted rounding above 0 (LOGP_TOLERANCE) is a probability of 1 to the
    Bernoulli KL: the token stays inside a trust region it is 1e-3 from (it fell outside on a NaN KL)."""
    x = torch.tensor([[logp, -0.5]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(x, torch.tensor([[old, -0.5]], dtype=torch.float64), torch.ones(1, dtype=torch.float64),
                                torch.ones(1, 2, dtype=torch.bool), dppo_kl=True, clip_low=0.05, clip_high=0.05)
    (grad,) = torch.autograd.grad(loss, x)
    ratio = math.exp(logp - old)                               # the ratio itself is the loss's, unclamped
    assert metrics["clip_frac_high"] == 0 and grad[0, 0].item() == pytest.approx(-min(ratio, DPPO_DEFAULT_CAP) / 2)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), ratio=st.floats(0.01, 1.0), coef=st.floats(0.0, 2.0))
def test_kl_cov_penalises_exactly_the_top_k_covariance_tokens(seed, ratio, coef):
    """KL-Cov = the unclipped surrogate plus coef·|log r| on the k = max(1, ⌊ratio·n⌋) kept tokens
    of largest (A − Ā)(log π − mean log π), checked by sorting in Python."""
    old, logp, adv, mask, _ = inputs(seed)
    loss, metrics = policy_loss(logp, old, adv, mask, kl_cov=KLCovOptions(kl_cov_ratio=ratio, ppo_kl_coef=coef))
    cov = (adv - adv[mask].mean()) * (logp - logp[mask].mean())
    cells = sorted(((cov[b, t].item(), b, t) for b, t in mask.nonzero().tolist()), reverse=True)
    k = max(int(ratio * len(cells)), 1)
    z = logp - old
    total = sum(-adv[b, t].item() * math.exp(z[b, t].item()) for _, b, t in cells)
    total += coef * sum(abs(z[b, t].item()) for _, b, t in cells[:k])
    assert loss.item() == pytest.approx(total / len(cells), rel=1e-10, abs=1e-14)
    assert metrics["cov_selected_frac"] == pytest.approx(k / len(cells))


def test_gspo_composes_with_cispo_as_a_sequence_level_weight():
    """The ratio stage feeds any surrogate: GSPO + CISPO weighs each token's A·∇log π by
    sg(clip(s_b)), s_b the sequence ratio."""
    old, logp, adv, mask, _ = inputs(3)
    lp = logp.clone().requires_grad_()
    (grad,) = torch.autograd.grad(policy_loss(lp, old, adv, mask, gspo=True, cispo=True)[0], lp)
    n = mask.sum(1, keepdim=True).clamp(min=1)
    s = (((logp - old) * mask).sum(1, keepdim=True) / n).exp()
    torch.testing.assert_close(grad, -s.clamp(0.8, 1.2) * adv * mask.double() / mask.sum(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("gap", [0.0, 10.5, 30.0])
def test_gspo_cap_cuts_the_ratio_surrogates_gradient_not_the_reinforce_forms(gap):
    """GSPO caps log s_b at 10 (verl), which passes no gradient to the clipped ratio where it binds;
    CISPO (ℓ = −sg(clip(s_b))·A·log π, TRL's cispo at the sequence level) and DPPO detach the
    ratio's value, so they keep their ∇log π on every token whatever s_b."""
    old, logp, adv, mask, _ = inputs(3)
    old = old - gap                                           # every z up by ``gap``: log s_b too
    n = mask.sum(1, keepdim=True).clamp(min=1)
    log_s = ((logp - old) * mask).sum(1, keepdim=True) / n
    s = log_s.clamp(max=10.0).exp()
    lp = logp.clone().requires_grad_()
    (grad,) = torch.autograd.grad(policy_loss(lp, old, adv, mask, gspo=True, cispo=True)[0], lp)
    torch.testing.assert_close(grad, -s.clamp(0.8, 1.2) * adv * mask.double() / mask.sum(), rtol=1e-10, atol=1e-14)
    # DPPO's coefficient min(s_b, C)·inside·A (C = 20 while clip_c is unset): every token inside passes it
    (grad,) = torch.autograd.grad(policy_loss(lp, old, adv, mask, gspo=True, dppo_tv=True)[0], lp)
    inside = grad != 0
    assert bool(inside.any()) or gap == 0.0
    torch.testing.assert_close(grad[inside], (-s.clamp(max=DPPO_DEFAULT_CAP) * adv / mask.sum()).expand_as(grad)[inside],
                               rtol=1e-10, atol=1e-14)
    (grad,) = torch.autograd.grad(policy_loss(lp, old, adv, mask, gspo=True)[0], lp)
    capped = (log_s > 10.0).expand_as(grad)
    assert bool(capped.any()) == (gap > 0)
    assert bool((grad[capped] == 0).all())                   # verl: no gradient where the cap binds
