"""policy_loss (the composition of the loss terms) against the loss written out the obvious way.

The reference below is written without creditrl's terms — torch.maximum/minimum for the clips, a
loop for rollout correction, a dense trace matrix per response, a where-based keep-gradient mask,
autograd for everything — and the test compares loss and ∂loss/∂logp in float32 (the trainer's
dtype) for every option alone and every pair of options (float64 to 1e-9:
test_policy_loss_reference.py).
"""

import pytest
import torch

from creditrl import StapoOptions, TraceOptions, policy_loss, spurious_token_mask
from test_losses import COMBOS, loop_rollout, make_batch, option_kwargs
from test_traces import dense_trace_matrix
from tolerances import assert_close_normwise, sum_rtol

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def reference_agg(tok, keep, mode, max_len=None):
    rows = tok.shape[0]
    counts = keep.sum(dim=1)
    kept = torch.where(keep, tok, 0.0)
    if mode == "token-mean":
        return kept.sum() / counts.sum().clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        return kept.sum() / (rows * (max_len or tok.shape[1]))
    per_row = kept.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / counts.clamp(min=1)
    return per_row.sum() / (counts > 0).sum().clamp(min=1)


def per_row_trace(values, mask, opts):
    """y[b, valid] = M @ values[b, valid] with the dense eq. 17–18 matrix (autograd flows)."""
    rows = []
    for b in range(values.shape[0]):
        idx = torch.nonzero(mask[b]).flatten()
        m = dense_trace_matrix(len(idx), opts.gamma * opts.lam, opts.style, opts.floor)
        row = torch.zeros(values.shape[1], dtype=torch.float64)
        rows.append(row.index_put((idx,), m @ values[b, idx]))
    return torch.stack(rows)


def reference_loss(logp, old, adv, mask, *, clip_low=0.2, clip_high=None, clip_c=None, agg="token-mean",
                   max_len=None, ref_logp=None, kl_coef=0.0, kl_estimator="k3", kl_bias_correction=False,
                   rollout_logp=None, rollout_correction=None, rollout_cap=2.0, stapo=None, entropy=None,
                   truncated=None, trace=None, magnitude=False, **terms):
    """The loss written out densely in float64; ``terms``: the other terms by name -> options (None =
    off); ``magnitude``: the same aggregate of the per-token terms' absolute values (the scale of the
    loss's rounding, ``loss_atol``)."""
    terms = {name: options for name, options in terms.items() if options is not None}
    unknown = set(terms) - set(SURROGATES) - {"gspo", "entropy_bonus", "top_entropy", "mask_truncated",
                                               "delta_l_norm"}
    assert not unknown, unknown
    clip_high = clip_low if clip_high is None else clip_high
    a = (adv[:, None].expand_as(logp) if adv.dim() == 1 else adv).double()
    keep = mask.clone()
    if stapo is not None:
        keep &= spurious_token_mask(logp, entropy, adv, mask, tau_p=stapo.tau_p,
                                    high_entropy_fraction=stapo.high_entropy_fraction, pool=stapo.pool)
    weight = torch.ones(logp.shape, dtype=torch.float64)
    if rollout_correction is not None:
        weight, in_range = loop_rollout(old, rollout_logp, mask, rollout_correction, rollout_cap)
        keep &= in_range
    if "mask_truncated" in terms:
        keep &= ~truncated[:, None]
    if "top_entropy" in terms:          # TRL's get_high_entropy_mask over the tokens still in the loss
        threshold = torch.quantile(entropy.detach().double()[keep], 1 - terms["top_entropy"].quantile)
        weight = weight * ((entropy.detach() >= threshold) & keep)
    log_ratio = logp.double() - old.double()
    tau = torch.ones_like(weight)
    if trace is not None:
        a = a.clamp(min=trace.adv_clamp)
        if trace.update == "trace":          # only kept tokens pass gradient into the trace
            log_ratio = per_row_trace(torch.where(keep, log_ratio, log_ratio.detach()), mask, trace)
        else:
            soft = 1 + torch.sigmoid(logp.double() - 1)
            tau = per_row_trace(torch.where(keep, soft, soft.detach()), mask, trace)
    if "gspo" in terms:                  # verl's GSPO-token ratio
        seq = torch.stack([log_ratio[b][keep[b]].detach().mean() if keep[b].any() else log_ratio.new_zeros(())
                           for b in range(logp.shape[0])])
        log_ratio = torch.clamp(log_ratio - log_ratio.detach() + seq[:, None], max=10.0)
    bounds = dict(low=clip_low, high=clip_high, c=clip_c)
    surrogate = next((name for name in SURROGATES if name in terms), None)
    tok = SURROGATES[surrogate](logp, old, a, keep, log_ratio, bounds, tau * weight, terms.get(surrogate))
    if kl_coef > 0:
        tok = tok + kl_coef * reference_kl(logp, old, ref_logp, kl_estimator, kl_bias_correction)
    if "entropy_bonus" in terms:
        tok = tok - terms["entropy_bonus"].coef * entropy
    tok = tok.abs() if magnitude else tok
    if "delta_l_norm" in terms:
        return reference_delta_l(tok, keep, terms["delta_l_norm"].alpha, max_len)
    return reference_agg(tok, keep, agg, max_len)


OPS = 12   # float32/64 operations per token term: ratio, exp, clamps, products, trace or KL, weights


def loss_atol(logp, old, adv, mask, dtype=torch.float32, **kwargs) -> float:
    """Rounding bound of the loss (tests/tolerances.py): a positive-weighted sum over the mask's n tokens of
    terms of a few operations each: (n + OPS)·eps of the aggregated magnitudes (``reference_loss``), in the
    computation's dtype (float32 unless every input is float64)."""
    with torch.no_grad():
        scale = float(reference_loss(logp.detach(), old, adv, mask, magnitude=True, **kwargs))
    return sum_rtol(int(mask.sum()) + OPS, dtype) * scale


def grad_rtol(mask, dtype=torch.float32) -> float:
    """Normwise rounding bound of the gradient: each element is one token's derivative times its weight, or
    (traces) a sum of at most T of them, each of a few operations."""
    return sum_rtol(mask.shape[1] + OPS, dtype)


def reference_kl(logp, old, ref_logp, estimator, bias_correction):
    x = (ref_logp.double() - logp.double()).clamp(-20, 20)
    value = {"k1": -x, "k2": 0.5 * x * x, "k3": torch.expm1(x) - x}[estimator.rstrip("+")]
    ratio = torch.exp((logp.double() - old.double()).clamp(-20, 20))   # TRL's coef_1
    if not estimator.endswith("+"):
        return value * ratio if bias_correction else value       # TRL's use_bias_correction_kl
    # straight-through (verl's "k3+"): k2's gradient, weighted by the ratio's value under the correction
    weight = ratio.detach() if bias_correction else 1.0
    return weight * (0.5 * x * x - (0.5 * x * x).detach()) + (weight * value).detach()


def reference_delta_l(tok, keep, alpha, max_len):
    rows = []
    for b in range(tok.shape[0]):
        n = int(keep[b].sum())
        if n:
            rows.append((n ** -alpha, tok[b][keep[b]].sum()))
    total = sum(x for x, _ in rows)
    return sum(x * s for x, s in rows) / (total * (max_len or tok.shape[1])) if rows else tok.sum() * 0


def ppo_clip(logp, old, a, keep, log_ratio, bounds, weight, options):
    r = torch.exp(log_ratio.clamp(-20, 20))
    tok = torch.maximum(-a * r, -a * r.clamp(1 - bounds["low"], 1 + bounds["high"]))
    if bounds["c"] is not None:
        tok = torch.where(a < 0, torch.minimum(tok, -a * bounds["c"]), tok)
    return tok * weight


def score(logp, log_ratio):
    """log π's value with the log-ratio's gradient (what a ratio-stage term routes)."""
    return log_ratio - log_ratio.detach() + logp.double().detach()


def cispo_reference(logp, old, a, keep, log_ratio, bounds, weight, options):
    r = torch.exp(log_ratio.clamp(-20, 20)).detach()
    return -r.clamp(1 - bounds["low"], 1 + bounds["high"]) * a * score(logp, log_ratio) * weight


def sapo_reference(logp, old, a, keep, log_ratio, bounds, weight, options):
    tau = torch.where(a > 0, torch.full_like(a, options.tau_pos), torch.full_like(a, options.tau_neg))
    r = torch.exp(log_ratio.clamp(-20, 20))
    return -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a * weight


def dppo_reference(region):
    def surrogate(logp, old, a, keep, log_ratio, bounds, weight, options):
        p, q = logp.double().detach().exp(), old.double().exp()
        if region == "tv":
            inside = torch.where(a > 0, p - q <= bounds["high"], p - q >= -bounds["low"])
        else:
            kl = q * (old.double() - logp.double().detach()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
            inside = torch.where(a > 0, (kl <= bounds["high"]) | (p <= q), (kl <= bounds["low"]) | (p >= q))
        cap = 20.0 if bounds["c"] is None else bounds["c"]
        r = torch.exp(log_ratio.clamp(-20, 20)).detach().clamp(max=cap)
        return -a * r * inside * score(logp, log_ratio) * weight
    return surrogate


def covariance(logp, a, keep):
    cov = (a - a[keep].mean()) * (logp.double().detach() - logp.double().detach()[keep].mean())
    return torch.where(keep, cov, 0.0)


def clip_cov_reference(logp, old, a, keep, log_ratio, bounds, weight, options):
    """Only where verl's random choice is forced: at most k candidates, all of them detached."""
    tok = ppo_clip(logp, old, a, keep, log_ratio, bounds, torch.ones_like(weight), None)
    r = torch.exp(log_ratio.clamp(-20, 20)).detach()
    clipped = ((a > 0) & (r > 1 + bounds["high"])) | ((a < 0) & (r < 1 - bounds["low"]))
    if bounds["c"] is not None:
        clipped |= (a < 0) & (r > bounds["c"])
    cov = covariance(logp, a, keep)
    candidates = keep & ~clipped & (cov > options.clip_cov_lb) & (cov < options.clip_cov_ub)
    k = max(int(options.clip_cov_ratio * int(keep.sum())), 1)
    assert int(candidates.sum()) <= k, "the random choice is not forced"
    return torch.where(candidates, 0.0, tok) * weight


def kl_cov_reference(logp, old, a, keep, log_ratio, bounds, weight, options):
    cov = covariance(logp, a, keep)
    k = max(int(options.kl_cov_ratio * int(keep.sum())), 1)
    ranked = sorted(((cov[b, t].item(), b, t) for b, t in keep.nonzero().tolist()), reverse=True)
    chosen = torch.zeros_like(keep)
    for _, b, t in ranked[:k]:
        chosen[b, t] = True
    r = torch.exp(log_ratio.clamp(-20, 20))
    return (-a * r + options.ppo_kl_coef * log_ratio.abs() * chosen) * weight


def geo_mean_reference(logp, old, a, keep, log_ratio, bounds, weight, options):
    """GMPO per response, a loop over rows: tokens of weight 0 are left out of the means."""
    tok = []
    for b in range(logp.shape[0]):
        idx = keep[b] & (weight[b] > 0)
        if not idx.any():
            tok.append(logp.new_zeros((), dtype=torch.float64))
            continue
        z, ab = log_ratio[b][idx].clamp(-20, 20), a[b][idx]
        m = torch.where(ab > 0, z.clamp(max=bounds["high"]), torch.where(ab < 0, z.clamp(min=-bounds["low"]), 0.0))
        tok.append(-ab.mean() * torch.exp(m.mean() + weight[b][idx].log().mean()))
    return torch.stack(tok)[:, None].expand_as(logp)


SURROGATES = {None: ppo_clip, "cispo": cispo_reference, "sapo": sapo_reference, "geo_mean": geo_mean_reference,
              "dppo_tv": dppo_reference("tv"), "dppo_kl": dppo_reference("kl"), "clip_cov": clip_cov_reference,
              "kl_cov": kl_cov_reference}


def assert_same_loss_and_grad(logp, old, adv, mask, **kwargs):
    lp_fast = logp.clone().requires_grad_()
    lp_ref = logp.clone().requires_grad_()
    loss, _ = policy_loss(lp_fast, old, adv, mask, **kwargs)
    ref = reference_loss(lp_ref, old, adv, mask, **kwargs)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.double(), atol=loss_atol(logp, old, adv, mask, **kwargs), rtol=0)
    assert_close_normwise(lp_fast.grad, lp_ref.grad, grad_rtol(mask), "gradient")
    return lp_fast.grad


PAIRS = COMBOS


def option_batch(combo, token_adv: bool, length: int = 24):
    """(logp, old, adv, mask, policy_loss keywords) for the options in ``combo``."""
    logp, old, adv, mask = make_batch(7, rows=6, length=length, token_adv=token_adv, spread=1.0)
    kwargs = option_kwargs(combo, old, torch.Generator().manual_seed(12))
    if not {"kl", "k3+"} & set(combo):
        kwargs.pop("ref_logp")
    if not {"tis", "mis", "seq_mis"} & set(combo):
        kwargs.pop("rollout_logp")
    return logp, old, adv, mask, kwargs


@pytest.mark.parametrize("token_adv", [False, True], ids=["adv[B]", "adv[B,T]"])
@pytest.mark.parametrize("combo", PAIRS, ids=lambda c: "+".join(c))
def test_gradient_matches_autograd_reference(combo, token_adv):
    logp, old, adv, mask, kwargs = option_batch(combo, token_adv)
    grad = assert_same_loss_and_grad(logp, old, adv, mask, **kwargs)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_gradient_every_aggregation_and_kl_estimator(mode, est):
    logp, old, adv, mask = make_batch(3, rows=5, length=40, spread=0.6)
    ref = (old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2))).clamp(max=0)
    assert_same_loss_and_grad(logp, old, adv, mask, agg=mode, max_len=50, ref_logp=ref, kl_coef=0.2,
                              kl_estimator=est, clip_high=0.28, clip_c=2.5)


def test_gradient_all_options_together_long_rows():
    """Every option at once, rows long enough for multi-block scans, ε-trace and ε-weight."""
    logp, old, adv, mask = make_batch(9, rows=4, length=120, token_adv=True, spread=0.5)
    gen = torch.Generator().manual_seed(4)
    common = dict(clip_high=0.28, clip_c=3.0, ref_logp=old - 0.1, kl_coef=0.05, agg="seq-mean-token-mean",
                  rollout_logp=(old + 0.3 * torch.randn(old.shape, generator=gen)).clamp(max=0), rollout_correction="mis",
                  stapo=StapoOptions(tau_p=0.05, high_entropy_fraction=0.5),
                  entropy=torch.rand(old.shape, generator=gen))
    for opts in (TraceOptions(lam=0.97, style="both", floor=0.01), TraceOptions(lam=0.9, update="weight"),
                 TraceOptions(lam=0.95, style="recent", floor=0.05, update="weight")):
        assert_same_loss_and_grad(logp, old, adv, mask, trace=opts, **common)


def test_gradient_is_zero_where_the_log_ratio_clamp_binds():
    """|log π − log π_old| > 20: the ratio is clamped and, as with autograd, passes no gradient."""
    logp, old, adv, mask = make_batch(5, rows=4, length=10)
    logp, old = logp.clone(), old.clone()
    logp[1, :5] -= 30.0                      # log-probs stay <= 0
    old[1, :5] = logp[1, :5] + 30.0          # r = e^−30 → clamped to e^−20
    old[1, 5:] = logp[1, 5:] - 30.0          # r = e^30 → clamped to e^20
    for sign in (1.0, -1.0):
        a = adv.abs() * sign
        grad = assert_same_loss_and_grad(logp, old, a, mask)
        assert torch.all(grad[1] == 0)
        low, old_low = logp - 26.0, old - 26.0   # every log-prob, the reference's too, stays <= 0
        assert_same_loss_and_grad(low, old_low, a, mask, ref_logp=low + 25.0, kl_coef=0.1)


def test_bf16_logp_gets_a_bf16_gradient():
    logp, old, adv, mask = make_batch(6)
    lp = logp.bfloat16().requires_grad_()
    loss, _ = policy_loss(lp, old, adv, mask, trace=TraceOptions(lam=0.9))
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad.float()).all()


def test_gradient_reaches_logp_only():
    logp, old, adv, mask = make_batch(8)
    lp, old_g, adv_g = logp.clone().requires_grad_(), old.clone().requires_grad_(), adv.clone().requires_grad_()
    loss, _ = policy_loss(lp, old_g, adv_g, mask)
    loss.backward()
    assert lp.grad is not None and old_g.grad is None and adv_g.grad is None
