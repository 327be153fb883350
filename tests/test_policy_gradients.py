"""policy_loss (the composition of the loss terms) against the loss written out the obvious way.

The reference below is written without creditrl's terms — torch.maximum/minimum for the clips, a
loop for rollout correction, a dense trace matrix per response, a where-based keep-gradient mask,
autograd for everything — and the test compares loss and ∂loss/∂logp in float32 (the trainer's
dtype) for every option alone and every pair of options (float64 to 1e-9:
test_policy_loss_reference.py).
"""
import itertools

import pytest
import torch

from creditrl import StapoOptions, TraceOptions, policy_loss, spurious_token_mask
from test_losses import OPTIONS, loop_rollout, make_batch
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
                   max_len=None, ref_logp=None, kl_coef=0.0, kl_estimator="k3", rollout_logp=None,
                   rollout_correction=None, rollout_cap=2.0, stapo=None, entropy=None, trace=None, magnitude=False):
    """The loss written out densely in float64; ``magnitude``: the same aggregate of the per-token terms'
    absolute values (the scale of the loss's rounding, ``loss_atol``)."""
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
    log_ratio = logp.double() - old.double()
    tau = torch.ones_like(weight)
    if trace is not None:
        a = a.clamp(min=trace.adv_clamp)
        if trace.update == "trace":          # only kept tokens pass gradient into the trace
            log_ratio = per_row_trace(torch.where(keep, log_ratio, log_ratio.detach()), mask, trace)
        else:
            soft = 1 + torch.sigmoid(logp.double() - 1)
            tau = per_row_trace(torch.where(keep, soft, soft.detach()), mask, trace)
    r = torch.exp(log_ratio.clamp(-20, 20))
    tok = torch.maximum(-a * r, -a * r.clamp(1 - clip_low, 1 + clip_high))
    if clip_c is not None:
        tok = torch.where(a < 0, torch.minimum(tok, -a * clip_c), tok)
    tok = tok * tau * weight
    if kl_coef > 0:
        x = (ref_logp.double() - logp.double()).clamp(-20, 20)
        tok = tok + kl_coef * {"k1": -x, "k2": 0.5 * x * x, "k3": torch.expm1(x) - x}[kl_estimator]
    return reference_agg(tok.abs() if magnitude else tok, keep, agg, max_len)


OPS = 12   # float32/64 operations per token term: ratio, exp, clamps, products, trace or KL, weights


def loss_atol(logp, old, adv, mask, dtype=torch.float32, **kwargs) -> float:
    """Rounding bound of the loss (tests/tolerances.py): a positive-weighted sum over the mask's n tokens of
    terms of a few operations each: (n + OPS)·eps of the aggregated magnitudes (``reference_loss``), in the
    computation's dtype (float32 unless every input is float64)."""
    scale = float(reference_loss(logp.detach(), old, adv, mask, magnitude=True, **kwargs))
    return sum_rtol(int(mask.sum()) + OPS, dtype) * scale


def grad_rtol(mask, dtype=torch.float32) -> float:
    """Normwise rounding bound of the gradient: each element is one token's derivative times its weight, or
    (traces) a sum of at most T of them, each of a few operations."""
    return sum_rtol(mask.shape[1] + OPS, dtype)


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


PAIRS = [(a,) for a in OPTIONS] + [(a, b) for a, b in itertools.combinations(OPTIONS, 2)
                                   if not ({a, b} <= {"tis", "mis", "seq_mis"} or {a, b} == {"trace", "weight"})]


def option_batch(combo, token_adv: bool, length: int = 24):
    """(logp, old, adv, mask, policy_loss keywords) for the options in ``combo``."""
    logp, old, adv, mask = make_batch(7, rows=6, length=length, token_adv=token_adv, spread=1.0)
    gen = torch.Generator().manual_seed(12)
    kwargs = dict(ref_logp=(old - 0.2 + 0.3 * torch.randn(old.shape, generator=gen)).clamp(max=0),
                  rollout_logp=(old + 0.5 * torch.randn(old.shape, generator=gen)).clamp(max=0),
                  entropy=torch.rand(old.shape, generator=gen))
    for name in combo:
        kwargs.update(OPTIONS[name])
    if "kl" not in combo:
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
