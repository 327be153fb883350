"""STAPO S2T mask vs a loop with a hand-computed quantile, properties, and the loss renormalisation."""
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from creditrl import StapoOptions, policy_loss, spurious_token_mask


def loop_quantile(values, q):
    """numpy-style linear-interpolation quantile by hand."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def loop_mask(logp, entropy, adv, mask, tau_p, frac, pool):
    rows, length = logp.shape
    adv_at = (lambda b, t: adv[b].item()) if adv.dim() == 1 else (lambda b, t: adv[b, t].item())
    cand = {(b, t) for b in range(rows) for t in range(length)
            if mask[b, t] and adv_at(b, t) > 0 and math.exp(logp[b, t].item()) < tau_p}
    pool_idx = [(b, t) for b in range(rows) for t in range(length) if mask[b, t]] if pool == "valid" \
        else sorted(cand)
    keep = mask.clone().bool()
    if not pool_idx:
        return keep
    thr = loop_quantile([entropy[b, t].item() for b, t in pool_idx], 1 - frac)
    for b, t in cand:
        if entropy[b, t].item() < thr:
            keep[b, t] = False
    return keep


def batch(seed, rows=6, length=12, token_adv=False):
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log(torch.rand(rows, length, generator=gen) ** 4)  # many rare tokens
    entropy = torch.rand(rows, length, generator=gen) * 3
    shape = (rows, length) if token_adv else (rows,)
    adv = torch.randn(shape, generator=gen)
    mask = torch.rand(rows, length, generator=gen) > 0.2
    return logp, entropy, adv, mask


@pytest.mark.parametrize("pool", ["valid", "candidates"])
@pytest.mark.parametrize("token_adv", [False, True])
@pytest.mark.parametrize("tau_p,frac", [(2e-3, 0.2), (0.05, 0.5), (0.3, 1.0), (0.9, 0.05)])
def test_mask_matches_loop(pool, token_adv, tau_p, frac):
    logp, entropy, adv, mask = batch(int(tau_p * 1000) + int(token_adv), token_adv=token_adv)
    got = spurious_token_mask(logp, entropy, adv, mask, tau_p=tau_p, high_entropy_fraction=frac, pool=pool)
    assert got.dtype == torch.bool
    assert torch.equal(got, loop_mask(logp, entropy, adv, mask, tau_p, frac, pool))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=64),
       q=st.one_of(st.floats(0.0, 1.0), st.floats(1 - 1e-6, 1.0), st.floats(0.0, 1e-6)))
@example(values=[0.22549442946910858, -1.9013172388076782], q=1 - 1e-9)   # a + w·(b − a) rounded above b
def test_pool_quantile_stays_between_its_order_statistics(values, q):
    """The interpolated quantile lies between the two order statistics around its position (so never
    above the pool's maximum: a top-ρ mask keeps at least the largest value), within float32 rounding
    of numpy's linear quantile."""
    from creditrl.core.losses.stapo import pool_quantile
    x = torch.tensor(values, dtype=torch.float32)
    got = pool_quantile(x, torch.ones_like(x, dtype=torch.bool), q).item()
    s = sorted(x.tolist())
    pos = q * (len(s) - 1)
    low = s[math.floor(pos)]
    high = s[min(math.floor(pos) + 1, len(s) - 1)]
    assert low <= got <= high
    want = float(np.quantile(np.array(s, dtype=np.float64), q))
    assert abs(got - want) <= 4 * np.finfo(np.float32).eps * max(abs(low), abs(high))


def test_hand_computed_quantile():
    # one response, positive advantage; entropies 0..9 on 10 valid tokens; q = 0.8 →
    # position 7.2 → threshold 7.2; rare tokens (p < 0.01) at entropies 1, 7 and 8
    entropy = torch.arange(10.0)[None]
    logp = torch.full((1, 10), math.log(0.5))
    logp[0, [1, 7, 8]] = math.log(1e-3)
    keep = spurious_token_mask(logp, entropy, torch.tensor([1.0]), torch.ones(1, 10), tau_p=0.01)
    assert keep.tolist() == [[True, False, True, True, True, True, True, False, True, True]]
    # candidates pool: entropies {1, 7, 8}, q = 0.8 → 7 + 0.6·1 = 7.6 → silences 1 and 7
    keep = spurious_token_mask(logp, entropy, torch.tensor([1.0]), torch.ones(1, 10), tau_p=0.01,
                               pool="candidates")
    assert (~keep).nonzero()[:, 1].tolist() == [1, 7]
    # negative advantage: nothing silenced
    keep = spurious_token_mask(logp, entropy, torch.tensor([-1.0]), torch.ones(1, 10), tau_p=0.01)
    assert keep.all()


def test_empty_pool_and_invalid_tokens():
    logp, entropy, adv, mask = batch(3)
    keep = spurious_token_mask(logp, entropy, -adv.abs(), mask, pool="candidates")
    assert torch.equal(keep, mask)                          # no candidates: nothing silenced
    keep = spurious_token_mask(logp, entropy, adv, torch.zeros_like(mask))
    assert not keep.any()                                   # no valid token: nothing kept
    entropy[~mask] = float("nan")                           # garbage at padding is ignored
    keep = spurious_token_mask(logp, entropy, adv, mask)
    assert not (keep & ~mask).any()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), tau_lo=st.floats(1e-4, 0.5), tau_hi=st.floats(0.5, 0.99),
       frac=st.floats(0.01, 1.0))
def test_properties(seed, tau_lo, tau_hi, frac):
    logp, entropy, adv, mask = batch(seed)
    lo = spurious_token_mask(logp, entropy, adv, mask, tau_p=tau_lo, high_entropy_fraction=frac)
    hi = spurious_token_mask(logp, entropy, adv, mask, tau_p=tau_hi, high_entropy_fraction=frac)
    silenced_lo, silenced_hi = mask & ~lo, mask & ~hi
    # every silenced token is valid, rare and in a positive-advantage response
    assert (adv[:, None].expand_as(mask)[silenced_hi] > 0).all()
    assert (logp[silenced_hi] < math.log(tau_hi)).all()
    # with the "valid" pool the entropy threshold does not depend on tau_p: monotone in tau_p
    assert not (silenced_lo & ~silenced_hi).any()
    # the entropy threshold is the (1 − frac) quantile: at most ~ (1 − frac) of valid tokens are below it
    below = (entropy[mask] < torch.quantile(entropy[mask], 1 - frac)).float().mean().item()
    assert below <= 1 - frac + 1.0 / mask.sum().item() + 1e-6


@pytest.mark.parametrize("kwargs,match", [
    (dict(tau_p=0.0), r"tau_p: expected a value in \(0, 1\), got 0.0"),
    (dict(tau_p=1.0), r"tau_p: expected a value in \(0, 1\)"),
    (dict(high_entropy_fraction=0.0), r"high_entropy_fraction: expected a value in \(0, 1\]"),
    (dict(high_entropy_fraction=1.5), r"high_entropy_fraction: expected a value in \(0, 1\]"),
    (dict(pool="all"), r"pool: unknown value 'all'; valid values are \['valid', 'candidates'\]"),
])
def test_bad_arguments(kwargs, match):
    logp, entropy, adv, mask = batch(0)
    with pytest.raises(ValueError, match=match):
        spurious_token_mask(logp, entropy, adv, mask, **kwargs)
    with pytest.raises(ValueError, match=match):
        StapoOptions(**kwargs)


def test_bad_shapes():
    logp, entropy, adv, mask = batch(0)
    with pytest.raises(ValueError, match=r"entropy: expected the shape of logp \[6, 12\], got \[6, 11\]"):
        spurious_token_mask(logp, entropy[:, :-1], adv, mask)
    with pytest.raises(ValueError, match=r"advantages: expected shape \[6\] or \[6, 12\], got \[5\]"):
        spurious_token_mask(logp, entropy, adv[:-1], mask)


def test_policy_loss_renormalises_over_kept_tokens():
    """STAPO eq. 1: loss = Σ_kept ℓ / #kept; spurious_ratio = silenced / valid."""
    logp, entropy, adv, mask = batch(7)
    opts = StapoOptions(tau_p=0.05, high_entropy_fraction=0.5)
    keep = spurious_token_mask(logp, entropy, adv, mask, tau_p=0.05, high_entropy_fraction=0.5)
    assert (mask & ~keep).any()
    loss, metrics = policy_loss(logp, logp - 0.1, adv, mask, stapo=opts, entropy=entropy)
    token = -adv[:, None] * torch.exp(torch.tensor(0.1)).clamp(0.8, 1.2)
    expected = token.expand_as(mask)[keep].sum() / keep.sum()
    torch.testing.assert_close(loss, expected)
    # fractions of token counts: one float division each side (pytest.approx's default 1e-6 holds it)
    assert metrics["spurious_ratio"] == pytest.approx(((mask & ~keep).sum() / mask.sum()).item())
    assert metrics["kept_frac"] == pytest.approx((keep.sum() / mask.sum()).item())
    with pytest.raises(ValueError, match="entropy: expected a \\[B,T\\] tensor when loss term 'stapo' is on"):
        policy_loss(logp, logp, adv, mask, stapo=True)
    with pytest.raises(TypeError, match="stapo: expected None, a bool or StapoOptions, got str"):
        policy_loss(logp, logp, adv, mask, stapo="on", entropy=entropy)


def test_order_statistics_numpy_and_torch_paths_agree():
    """The CPU selection (numpy) and the device path (torch.kthvalue) give the same values."""
    from creditrl.core.losses.stapo import pooled_order_statistics
    x = torch.randn(1001, generator=torch.Generator().manual_seed(2)).round(decimals=1)   # with ties
    pool = torch.rand(1001, generator=torch.Generator().manual_seed(3)) > 0.2
    x[~pool] = float("nan")                                      # off-pool garbage is never read
    ranks = (0, 437, 438, int(pool.sum()) - 1)
    expected = torch.sort(x[pool]).values[list(ranks)]
    for use_numpy in (True, False):
        got = torch.stack(pooled_order_statistics(x, pool, ranks, use_numpy=use_numpy))
        assert torch.equal(got, expected) and got.dtype == x.dtype


@pytest.mark.parametrize("margin", [96, 2, 0])
@pytest.mark.parametrize("seed", range(6))
def test_bracket_select_is_exact_on_large_pools(seed, margin):
    """Large pools take the sampled bracket (a tiny margin forces misses, hence the fallback);
    every path is exact, with ties, skewed values and any ranks."""
    from creditrl.core.losses.stapo import bracket_select
    gen = np.random.default_rng(seed)
    x = np.concatenate([gen.exponential(size=60_000), np.zeros(20_000), gen.random(10_000).round(2)])
    x = x.astype(np.float32)[gen.permutation(90_000)]
    pool = gen.random(90_000) < 0.7
    x[~pool] = np.nan
    pooled = np.sort(x[pool])
    for q in (0.0, 0.2, 0.8, 0.9999, 1.0):
        low = int(q * (pooled.size - 1))
        ranks = (low, min(low + 1, pooled.size - 1))
        assert bracket_select(x, pool, ranks, margin=margin) == [pooled[r] for r in ranks]
