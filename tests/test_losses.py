"""agg_loss, policy_loss (clip, dual clip, KL, rollout correction, metrics, option grid), the variance proxies."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import creditrl
from creditrl import StapoOptions, TraceOptions, agg_loss, policy_loss, power_proxy, variance_proxy
from creditrl.core.losses import (METRIC_KEYS, ClipCovOptions, DeltaLNormOptions, EntropyBonusOptions, KLCovOptions,
                                  SapoOptions, TopEntropyOptions)
from tolerances import SUBNORMAL32, sum_rtol

F64 = torch.float64

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def loop_agg(loss, mask, mode, max_len=None):
    rows, length = loss.shape
    per_row = [[loss[b, t].item() for t in range(length) if mask[b, t]] for b in range(rows)]
    nonempty = [r for r in per_row if r]
    if mode == "token-mean":
        n = sum(len(r) for r in per_row)
        return sum(sum(r) for r in per_row) / n if n else 0.0
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty) if nonempty else 0.0
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty) if nonempty else 0.0
    return sum(sum(r) for r in per_row) / (rows * (max_len or length))


def f32_tol(token: torch.Tensor, mask: torch.Tensor, mode: str, max_len=None, ops: int = 8) -> float:
    """Float32 rounding bound of an aggregated loss against its float64 loop (tests/tolerances.py): every mode
    is a positive-weighted sum of the per-token terms ``token`` over the mask's n tokens, each term a few
    (``ops``) float32 operations (exp, clamp, products): within (n + ops)·eps32 of agg(|terms|), plus (n + ops)
    half-spacings of float32's subnormals (2^-149), where rounding errors are absolute."""
    n = int(mask.sum()) + ops
    return sum_rtol(n) * loop_agg(token.abs(), mask, mode, max_len) + n * SUBNORMAL32


def make_batch(seed=0, rows=5, length=7, token_adv=False, spread=0.4):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, length, generator=gen) * 4
    old = (logp + spread * torch.randn(rows, length, generator=gen)).clamp(max=0)   # log-probs: <= 0
    adv = torch.randn((rows, length) if token_adv else (rows,), generator=gen)
    mask = torch.rand(rows, length, generator=gen) > 0.3
    mask[0] = False                     # an empty response
    mask[1, :] = True
    return logp, old, adv, mask


# ---- aggregation ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_loop(mode):
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(6, 9, generator=gen)
    mask = torch.rand(6, 9, generator=gen) > 0.4
    mask[2] = False
    loss[~mask] = float("nan")                  # masked garbage must not leak
    for max_len in (None, 16):
        got = agg_loss(loss, mask, mode, max_len=max_len)
        tol = f32_tol(torch.where(mask, loss, 0.0), mask, mode, max_len, ops=1)
        assert got.item() == pytest.approx(loop_agg(loss, mask, mode, max_len), abs=tol)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_empty_mask_is_zero_with_grad(mode):
    loss = torch.randn(3, 4, requires_grad=True)
    out = agg_loss(loss, torch.zeros(3, 4, dtype=torch.bool), mode)
    out.backward()
    assert out.item() == 0.0 and torch.equal(loss.grad, torch.zeros(3, 4))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), value=st.floats(-5, 5), mode=st.sampled_from(MODES[:2]))
def test_agg_loss_of_constant_is_constant(seed, value, mode):
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(seed)) > 0.5
    mask[0, 0] = True
    # a mean of n equal float32 values (the value rounded to float32 first): within n·eps32 of it
    x = torch.full((4, 6), value)
    assert agg_loss(x, mask, mode).item() == pytest.approx(x[0, 0].item(), abs=f32_tol(x, mask, mode, ops=1))


def test_agg_loss_bad_input():
    with pytest.raises(ValueError, match=r"mode: unknown value 'sum'; valid values are \['token-mean'"):
        agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "sum")
    with pytest.raises(ValueError, match=r"mask: expected shape \[2, 3\], got \[3, 2\]"):
        agg_loss(torch.zeros(2, 3), torch.ones(3, 2), "token-mean")
    with pytest.raises(ValueError, match=r"max_len: expected a value in \[1, inf\], got 0"):
        agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean-token-sum-norm", max_len=0)


# ---- plain clipped loss -----------------------------------------------------------------------

def loop_policy_loss(logp, old, adv, mask, clip_low, clip_high, clip_c, mode, kl=None):
    """Per-token PPO/DAPO/dual-clip written out with Python floats, aggregated by ``mode``."""
    return loop_agg(loop_policy_tokens(logp, old, adv, clip_low, clip_high, clip_c, kl), mask, mode)


def loop_policy_tokens(logp, old, adv, clip_low, clip_high, clip_c, kl=None):
    """The per-token terms of ``loop_policy_loss`` [B,T] float64."""
    token = torch.zeros(logp.shape, dtype=torch.float64)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            a = adv[b].item() if adv.dim() == 1 else adv[b, t].item()
            r = math.exp(logp[b, t].item() - old[b, t].item())
            loss = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
            if clip_c is not None and a < 0:
                loss = min(loss, -a * clip_c)
            if kl is not None:
                coef, est, ref = kl
                x = ref[b, t].item() - logp[b, t].item()
                loss += coef * {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[est]
            token[b, t] = loss
    return token


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip_high,clip_c,token_adv", [(None, None, False), (0.28, None, True), (0.28, 3.0, False)])
def test_plain_loss_matches_loop(mode, clip_high, clip_c, token_adv):
    logp, old, adv, mask = make_batch(2, token_adv=token_adv)
    loss, metrics = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=clip_high, clip_c=clip_c, agg=mode)
    ch = 0.2 if clip_high is None else clip_high
    token = loop_policy_tokens(logp, old, adv, 0.2, ch, clip_c)
    assert loss.item() == pytest.approx(loop_agg(token, mask, mode), abs=f32_tol(token, mask, mode))
    # clip fractions by loop
    ratio = torch.exp(logp - old)
    a = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    n = mask.sum().item()
    assert metrics["clip_frac_low"] == pytest.approx((((ratio < 0.8) & (a < 0) & mask).sum() / n).item())
    assert metrics["clip_frac_high"] == pytest.approx((((ratio > 1 + ch) & (a > 0) & mask).sum() / n).item())
    assert metrics["clip_frac_low"] + metrics["clip_frac_high"] > 0
    if clip_c is None:
        assert "clip_frac_dual" not in metrics                   # not measured, not a stand-in 0.0
    else:
        assert metrics["clip_frac_dual"] == pytest.approx((((ratio > clip_c) & (a < 0) & mask).sum() / n).item())


@pytest.mark.parametrize("term", [{}, {"clip_cov": ClipCovOptions(clip_cov_ratio=0.01)}])
def test_dual_clip_fraction_counts_the_tokens_the_dual_clip_cuts(term):
    """A < 0 with r > c: the dual clip caps the loss at −A·c and the token passes no gradient; its share
    of the kept tokens is ``clip_frac_dual`` (verl's pg_clipfrac_lower), apart from the low/high clips'."""
    logp, old, adv, mask = make_batch(4)
    logp = (old + torch.linspace(-1.0, 2.5, logp.shape[1])).clamp(max=0).requires_grad_()   # r up to e^2.5
    loss, metrics = policy_loss(logp, old, -adv.abs() - 0.1, mask, clip_c=3.0, **term)
    ratio = torch.exp(logp - old).detach()
    cut = (ratio > 3.0) & mask
    assert cut.any() and metrics["clip_frac_dual"] == pytest.approx((cut.sum() / mask.sum()).item())
    assert not torch.autograd.grad(loss, logp)[0][cut].any()


def test_everything_off_is_exactly_the_plain_loss():
    logp, old, adv, mask = make_batch(3)
    plain, m_plain = policy_loss(logp, old, adv, mask)
    off, m_off = policy_loss(logp, old, adv, mask, clip_high=None, clip_c=None, ref_logp=old, kl_coef=0.0,
                             rollout_logp=None, rollout_correction=None, stapo=False, trace=None)
    assert torch.equal(plain, off)
    token = loop_policy_tokens(logp, old, adv, 0.2, 0.2, None)
    assert plain.item() == pytest.approx(loop_agg(token, mask, "token-mean"), abs=f32_tol(token, mask, "token-mean"))
    # what nothing measured is absent, not a stand-in 0.0 (no reference, no rollout log-probs, no STAPO)
    assert set(m_plain) == {*METRIC_KEYS, "clip_frac_low", "clip_frac_high"}
    assert all(type(v) is float for v in m_plain.values())
    assert set(m_off) == set(m_plain) | {"ref_kl"} and m_off["ref_kl"] > 0     # measured (ref_logp given), not added
    assert m_plain["kept_frac"] == 1.0
    assert m_plain["adv_abs_mean"] == pytest.approx((adv.abs()[:, None].expand_as(mask)[mask]).mean().item())
    k3 = torch.where(mask, torch.exp(logp - old).double() - 1 - (logp - old), 0.0)
    assert m_plain["approx_kl"] == pytest.approx(loop_agg(k3, mask, "token-mean"), abs=f32_tol(k3, mask, "token-mean"))


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_penalty_matches_loop(est):
    logp, old, adv, mask = make_batch(4)
    ref = (logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(9))).clamp(max=0)
    loss, metrics = policy_loss(logp, old, adv, mask, agg="seq-mean-token-mean", ref_logp=ref,
                                kl_coef=0.05, kl_estimator=est)
    token = loop_policy_tokens(logp, old, adv, 0.2, 0.2, None, (0.05, est, ref))
    mode = "seq-mean-token-mean"
    assert loss.item() == pytest.approx(loop_agg(token, mask, mode), abs=f32_tol(token, mask, mode))
    assert metrics["ref_kl"] != 0.0


# ---- rollout correction -----------------------------------------------------------------------

def loop_rollout(old, rollout, mask, mode, cap):
    """Per-token weight and keep of a rollout correction, by loop over rows and tokens: a token's
    own ratio, the row's product of ratios (seq-tis, seq-mis) or their geometric mean (geo-rs); a
    weight min(ρ, cap) (tis, mis, seq-tis, seq-mis), a drop outside [1/cap, cap] (mis, seq-mis, rs, geo-rs)."""
    weight = torch.ones(old.shape, dtype=torch.float64)
    keep = mask.clone()
    for b in range(old.shape[0]):
        idx = [t for t in range(old.shape[1]) if mask[b, t]]
        row_log = sum(old[b, t].item() - rollout[b, t].item() for t in idx)
        for t in idx:
            log_rho = {"seq-tis": row_log, "seq-mis": row_log, "geo-rs": row_log / len(idx)}.get(
                mode, old[b, t].item() - rollout[b, t].item())
            rho = math.exp(min(max(log_rho, -20.0), 20.0))
            if mode in ("tis", "mis", "seq-tis", "seq-mis"):
                weight[b, t] = min(rho, cap)
            if mode in ("mis", "seq-mis", "rs", "geo-rs") and not (1 / cap <= rho <= cap):
                keep[b, t] = False
    return weight, keep


@pytest.mark.parametrize("mode", ["tis", "mis", "seq-tis", "seq-mis", "rs", "geo-rs"])
def test_rollout_correction_matches_loop(mode):
    logp, old, adv, mask = make_batch(5)
    noise = 0.2 if mode.startswith("seq") else 0.8     # a product of ratios spreads √T times more
    rollout = old + noise * torch.randn(old.shape, generator=torch.Generator().manual_seed(11))
    shift = rollout.max().clamp(min=0)       # log-probs <= 0, every difference between them kept
    logp, old, rollout = logp - shift, old - shift, rollout - shift
    cap = 1.5
    loss, metrics = policy_loss(logp, old, adv, mask, rollout_logp=rollout, rollout_correction=mode,
                                rollout_cap=cap, agg="token-mean")
    weight, keep = loop_rollout(old, rollout, mask, mode, cap)
    ratio = torch.exp(logp - old).double()
    a = adv[:, None].double()
    token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * weight
    expected = token[keep].sum() / keep.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=f32_tol(torch.where(keep, token, 0.0), keep, "token-mean"))
    if mode.endswith("tis"):                         # drops nothing: no drop fraction to report
        assert "is_masked_frac" not in metrics
    else:
        assert metrics["is_masked_frac"] == pytest.approx(((mask & ~keep).sum() / mask.sum()).item())
        assert 0 < metrics["is_masked_frac"] < 1
    rho = (old - rollout).double()
    k3 = torch.where(mask, torch.exp(rho) - 1 - rho, 0.0)
    assert metrics["mismatch_kl"] == pytest.approx(loop_agg(k3, mask, "token-mean"), abs=f32_tol(k3, mask, "token-mean"))
    gaps = [abs((old[b] - rollout[b])[mask[b]].mean().item()) for b in range(mask.shape[0]) if mask[b].any()]
    tol = f32_tol(torch.where(mask, rho, 0.0), mask, "seq-mean-token-mean")   # a mean of per-row |means|
    assert metrics["ppl_gap"] == pytest.approx(sum(gaps) / len(gaps), abs=tol)


@pytest.mark.parametrize("mode", ["seq-tis", "seq-mis", "tis"])
def test_sequence_correction_is_unbiased_by_exact_enumeration(mode):
    """Every 2-token response of a 3-token vocabulary, sampled by π_rollout ≠ π_old, weighted by its
    probability: with a cap nothing reaches, E_rollout[∇ loss] = −∇_θ E_{π_old}[R] exactly for the
    sequence modes, whose weight is the product of the token ratios; the token-level weight (tis) is
    not an importance weight of the response, and misses it."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(1 + 3, 3, generator=gen, dtype=F64, requires_grad=True)   # logits: step 1; step 2 | y_1
    roll_logits = theta.detach() + 0.7 * torch.randn(4, 3, generator=gen, dtype=F64)
    reward = torch.rand(3, 3, generator=gen, dtype=F64)
    ys = torch.tensor(list(itertools.product(range(3), range(3))))              # [9, 2]

    def token_logp(logits):                      # [9, 2]: log π(y_1), log π(y_2 | y_1)
        lp = logits.log_softmax(-1)
        return torch.stack([lp[0, ys[:, 0]], lp[1 + ys[:, 0], ys[:, 1]]], 1)

    old, rollout = token_logp(theta).detach(), token_logp(roll_logits)
    r = reward[ys[:, 0], ys[:, 1]]
    j = (token_logp(theta).sum(1).exp() * r).sum()                                 # E_{π_θ}[R] at θ = θ_old
    true_grad = torch.autograd.grad(j, theta)[0]
    p_roll = rollout.sum(1).exp()
    mask = torch.ones(9, 2, dtype=torch.bool)
    # seq-mean-token-sum: (1/9) Σ_y Σ_t ℓ_yt, so advantages 9·π_rollout(y)·R(y) weigh each response by its probability
    loss, _ = policy_loss(token_logp(theta), old, 9 * p_roll * r, mask, rollout_logp=rollout, rollout_correction=mode,
                          rollout_cap=1e6, agg="seq-mean-token-sum")
    got = -torch.autograd.grad(loss, theta)[0]
    if mode == "tis":
        assert (got - true_grad).abs().max() > 1e-3
    else:
        torch.testing.assert_close(got, true_grad, rtol=1e-12, atol=1e-14)


def test_tis_weight_is_detached():
    logp, old, adv, mask = make_batch(6)
    rollout = (old - 0.5).requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask, rollout_logp=rollout, rollout_correction="tis")
    assert not loss.requires_grad  # only logp may carry gradient; here it has none


# ---- option grid ------------------------------------------------------------------------------

OPTIONS = {
    "clip_high": dict(clip_high=0.28),
    "dual_clip": dict(clip_c=3.0),
    "kl": dict(kl_coef=0.1, kl_estimator="k2"),
    "k3+": dict(kl_coef=0.1, kl_estimator="k3+", kl_bias_correction=True),
    "tis": dict(rollout_correction="tis"),
    "mis": dict(rollout_correction="mis"),
    "seq_mis": dict(rollout_correction="seq-mis", rollout_cap=8.0),    # a product of ratios: a wider cap keeps rows
    "stapo": dict(stapo=StapoOptions(tau_p=0.1, high_entropy_fraction=0.5)),
    "trace": dict(trace=TraceOptions(lam=0.95, style="both", floor=0.01)),
    "weight": dict(trace=TraceOptions(lam=0.9, update="weight")),
    "seq_agg": dict(agg="seq-mean-token-sum-norm", max_len=10),
    "gspo": dict(gspo=True),
    "cispo": dict(cispo=True),
    "sapo": dict(sapo=SapoOptions()),
    "geo_mean": dict(geo_mean=True),
    "dppo_tv": dict(dppo_tv=True),
    "dppo_kl": dict(dppo_kl=True),
    "clip_cov": dict(clip_cov=ClipCovOptions(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=0.3)),
    "kl_cov": dict(kl_cov=KLCovOptions(kl_cov_ratio=0.2, ppo_kl_coef=0.5)),
    "entropy_bonus": dict(entropy_bonus=EntropyBonusOptions(coef=0.05)),
    "top_entropy": dict(top_entropy=TopEntropyOptions(quantile=0.5)),
    "mask_truncated": dict(mask_truncated=True),
    "delta_l_norm": dict(delta_l_norm=DeltaLNormOptions(alpha=1.0)),
}
# options that cannot be combined: one of each group at most
GROUPS = {"kl": "kl", "k3+": "kl", "tis": "rollout", "mis": "rollout", "seq_mis": "rollout", "trace": "trace",
          "weight": "trace", "seq_agg": "aggregate", "delta_l_norm": "aggregate",
          **{name: "surrogate" for name in ("cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov")}}
COMBOS = [(a,) for a in OPTIONS] + [(a, b) for a, b in itertools.combinations(OPTIONS, 2)
                                     if GROUPS.get(a, a) != GROUPS.get(b, b)]


def option_kwargs(combo, old, gen):
    """policy_loss keywords for the options in ``combo`` with the inputs they need."""
    kwargs = dict(ref_logp=(old - 0.2 + 0.3 * torch.randn(old.shape, generator=gen)).clamp(max=0),   # log-probs <= 0
                  rollout_logp=(old + 0.5 * torch.randn(old.shape, generator=gen)).clamp(max=0),
                  entropy=torch.rand(old.shape, generator=gen), truncated=torch.arange(old.shape[0]) == old.shape[0] - 1)
    for name in combo:
        kwargs.update(OPTIONS[name])
    return kwargs


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "+".join(c))
def test_option_grid_is_finite(combo):
    logp, old, adv, mask = make_batch(7, spread=1.0)
    logp = logp.clone().requires_grad_()
    loss, metrics = policy_loss(logp, old, adv, mask, **option_kwargs(combo, old, torch.Generator().manual_seed(12)))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad.abs().sum() > 0
    assert set(METRIC_KEYS) <= set(metrics) and all(math.isfinite(v) for v in metrics.values())


def test_all_options_bf16_and_extreme_ratios():
    logp, old, adv, mask = make_batch(8)
    old = old.clone()
    old[1, 0] = logp[1, 0] - 60.0                     # exp would overflow without the clamp
    lp = logp.bfloat16().requires_grad_()
    loss, metrics = policy_loss(lp, old.bfloat16(), adv.bfloat16(), mask, clip_high=0.28, clip_c=3.0,
                                ref_logp=old, kl_coef=0.1, rollout_logp=old - 0.3, rollout_correction="seq-tis",
                                stapo=True, entropy=torch.rand(mask.shape), trace=TraceOptions(lam=0.99))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and torch.isfinite(lp.grad.float()).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_degenerate_batches():
    # all-empty masks, singleton response, zero advantages: finite, zero loss where nothing counts
    logp = torch.zeros(1, 4, requires_grad=True)
    loss, metrics = policy_loss(logp, logp.detach(), torch.zeros(1), torch.zeros(1, 4), trace=TraceOptions(lam=0.5))
    loss.backward()
    assert loss.item() == 0.0 and metrics["kept_frac"] == 0.0
    loss, _ = policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1))
    assert loss.item() == -1.0


# ---- bad input --------------------------------------------------------------------------------

def test_policy_loss_bad_input():
    logp, old, adv, mask = make_batch(9)
    with pytest.raises(ValueError, match=r"old_logp: expected the shape of logp \[5, 7\], got \[5, 6\]"):
        policy_loss(logp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match=r"advantages: expected shape \[5\] or \[5, 7\], got \[4\]"):
        policy_loss(logp, old, adv[:-1], mask)
    bad = adv.clone()
    bad[[2, 4]] = float("nan")
    with pytest.raises(ValueError, match=r"advantages: 2 row\(s\) contain NaN or inf, e.g. rows \[2, 4\]"):
        policy_loss(logp, old, bad, mask)
    with pytest.raises(ValueError, match=r"agg: unknown value 'mean'; valid values are"):
        policy_loss(logp, old, adv, mask, agg="mean")
    with pytest.raises(ValueError, match=r"kl_estimator: unknown value 'k4'; valid values are \['k1', 'k2', 'k3', 'k1\+',"):
        policy_loss(logp, old, adv, mask, ref_logp=old, kl_coef=0.1, kl_estimator="k4")
    with pytest.raises(ValueError, match=r"rollout_correction: unknown value 'is'; valid values are \[None, 'tis'"):
        policy_loss(logp, old, adv, mask, rollout_logp=old, rollout_correction="is")
    with pytest.raises(ValueError, match="rollout_logp: expected a \\[B,T\\] tensor when loss term 'rollout_correction' is on "
                                         "\\(rollout_correction='tis'"):
        policy_loss(logp, old, adv, mask, rollout_correction="tis")
    with pytest.raises(ValueError, match="ref_logp: expected a \\[B,T\\] tensor when loss term 'kl' is on \\(kl_coef=0.1"):
        policy_loss(logp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"clip_c: expected a value in \(1, inf\], got 0.5"):
        policy_loss(logp, old, adv, mask, clip_c=0.5)
    with pytest.raises(ValueError, match=r"rollout_cap: expected a value in \[1, inf\], got 0.5"):
        policy_loss(logp, old, adv, mask, rollout_logp=old, rollout_correction="mis", rollout_cap=0.5)
    with pytest.raises(TypeError, match="trace: expected None, a bool or TraceOptions, got dict"):
        policy_loss(logp, old, adv, mask, trace={"lam": 0.5})


# ---- variance proxy ---------------------------------------------------------------------------

def positionwise_policy(seed, rows=5, steps=6, vocab=4):
    """A policy whose parameters are one logit vector per position, shared by all responses:
    ∇θ log π(y_t) = e_{y_t} − π_t on block t, so the logit-gradient proxy ŵ_t = ‖e_{y_t} − π_t‖²
    is exact and per-sample gradients can be brute-forced with autograd."""
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(steps, vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, steps), generator=gen)
    mask = torch.rand(rows, steps, generator=gen) > 0.25
    adv = torch.randn(rows, steps, generator=gen, dtype=torch.float64)
    return theta, tokens, mask, adv


def brute_force_sample_grads(theta, tokens, mask, adv):
    """ĝ(τ_i) = Σ_t A_t ∇θ log π(y_t), one autograd call per response (OTB eq. 63)."""
    grads = []
    for i in range(tokens.shape[0]):
        logp = torch.log_softmax(theta, dim=-1)[torch.arange(tokens.shape[1]), tokens[i]]
        (g,) = torch.autograd.grad((adv[i] * logp * mask[i]).sum(), theta)
        grads.append(g.reshape(-1))
    return torch.stack(grads)


@pytest.mark.parametrize("seed", range(3))
def test_variance_proxies_match_brute_force_per_sample_gradients(seed):
    theta, tokens, mask, adv = positionwise_policy(seed)
    grads = brute_force_sample_grads(theta, tokens, mask, adv)
    n = grads.shape[0]
    stats = variance_proxy(grads)
    # eq. 65-67 against the unbiased variance of the mean, computed from deviations
    mean = grads.mean(0)
    # float64 sums over the n x D = 5 x 24 gradient entries (sums of squares: no cancellation)
    assert stats["total_power"] == pytest.approx(float(grads.square().sum(1).mean()), rel=sum_rtol(grads.numel(), F64))
    assert stats["signal"] == pytest.approx(float(mean.square().sum()), rel=sum_rtol(grads.numel(), F64))
    # variance = (total power − n·signal)/(n − 1) against the deviations' sum: cancels to within the
    # rounding of the larger terms, power/variance x (n·D)·eps64
    cancel = stats["total_power"] * n / max(stats["variance"] * n * (n - 1), 1e-300)
    assert stats["variance"] == pytest.approx(float((grads - mean).square().sum() / (n * (n - 1))),
                                              rel=sum_rtol(grads.numel(), F64) * cancel)
    # the logit-gradient proxy of eq. 63-65 is exact for this policy, token-level advantages included
    stats_t = creditrl.token_stats(theta.detach().expand(n, -1, -1), tokens, mask)
    # token_stats' energies are float32 (the library's accuracy: ~1e-6 relative of float64 for float32 logits,
    # tests/test_token_stats.py), summed over <= T = 6 tokens per response with float64 advantages
    energy_rtol = 1e-6 + sum_rtol(6)
    assert power_proxy(adv, stats_t.energy, mask) == pytest.approx(stats["total_power"], rel=energy_rtol)
    seq_adv = adv[:, 0]
    seq_grads = brute_force_sample_grads(theta, tokens, mask, seq_adv[:, None].expand_as(adv))
    assert power_proxy(seq_adv, stats_t.energy, mask) == pytest.approx(variance_proxy(seq_grads)["total_power"],
                                                                        rel=energy_rtol)


def test_variance_proxy_inputs():
    with pytest.raises(ValueError, match="sample_grads: expected N >= 2"):
        variance_proxy(torch.ones(1, 3))
    with pytest.raises(ValueError, match="sample_grads: .*NaN"):
        variance_proxy(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"energy: expected the shape of mask \[4, 5\], got \[4, 6\]"):
        power_proxy(torch.ones(4), torch.ones(4, 6), torch.ones(4, 5, dtype=torch.bool))
    assert power_proxy(torch.ones(0), torch.ones(0, 3), torch.ones(0, 3, dtype=torch.bool)) == 0.0


def test_public_names_exported():
    for name in ("agg_loss", "policy_loss", "spurious_token_mask", "apply_trace", "variance_proxy",
                 "StapoOptions", "TraceOptions"):
        assert getattr(creditrl, name) is getattr(creditrl.core.losses, name)


def test_policy_loss_names_non_finite_inputs():
    logp, old, adv, mask = make_batch(10)
    mask[3, 0] = True
    bad = logp.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"logp: 1 row\(s\) contain NaN or inf, e.g. rows \[3\]"):
        policy_loss(bad, old, adv, mask)
    with pytest.raises(ValueError, match=r"rollout_logp: 1 row\(s\) contain NaN or inf, e.g. rows \[3\]"):
        policy_loss(logp, old, adv, mask, rollout_logp=bad, rollout_correction="tis")
    with pytest.raises(ValueError, match=r"entropy: 1 row\(s\) contain NaN or inf, e.g. rows \[3\]"):
        policy_loss(logp, old, adv, mask, stapo=True, entropy=bad.exp())
    garbage = logp.clone()
    garbage[~mask] = float("nan")               # padding may hold anything
    loss, metrics = policy_loss(garbage, old, adv, mask, ref_logp=garbage, kl_coef=0.1)
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["logp", "old_logp", "ref_logp", "rollout_logp"])
def test_log_probs_above_zero_are_refused_naming_the_argument(name, device):
    """Logits or probabilities passed as log-probs give an error naming the argument, on the CPU
    before any work and on a GPU with the metrics' one copy; rounding up to LOGP_TOLERANCE above 0
    and any value off the mask (padding) pass."""
    from creditrl.utils.validate import LOGP_TOLERANCE

    logp, old, adv, mask = make_batch(2)
    inputs = {"logp": logp, "old_logp": old, "ref_logp": old - 0.1, "rollout_logp": old - 0.2}

    def call(x):
        x = {k: v.to(device) for k, v in x.items()}
        return policy_loss(x["logp"].detach().clone().requires_grad_(), x["old_logp"], adv.to(device), mask.to(device),
                           ref_logp=x["ref_logp"], kl_coef=0.1, rollout_logp=x["rollout_logp"],
                           rollout_correction="tis")

    bad = dict(inputs, **{name: inputs[name].clone()})
    bad[name][0] = 7.0                              # row 0 is all off the mask: padding may hold anything
    bad[name][1, 2] = LOGP_TOLERANCE / 2            # rounding just above 0
    loss, _ = call(bad)
    assert torch.isfinite(loss)
    bad[name][1, 2] = 0.5                           # row 1 is all valid
    with pytest.raises(ValueError, match=rf"^{name}: expected log-probabilities <= 0 \(up to 0.001 of rounding\) "
                                         r"on the mask's tokens, got values up to 0\.5 \(logits or probabilities"):
        call(bad)
