"""GRPO-λ traces: O(T) apply_trace vs the dense trace matrix (values and, through autograd, Mᵀ·grad),
gradient identity, λ = 0."""
import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditrl import TraceOptions, apply_trace, policy_loss
from tolerances import sum_rtol


def dense_trace_matrix(length, c, style, floor):
    """GRPO-λ eq. 17–18 written out: M[t,j] = max(floor, c^{t−j}[, c^j]) for j < t, M[t,t] = 1."""
    t = torch.arange(length, dtype=torch.float64)[:, None]
    j = torch.arange(length, dtype=torch.float64)[None, :]
    c = torch.tensor(c, dtype=torch.float64)
    m = torch.maximum(torch.tensor(floor, dtype=torch.float64), c ** (t - j).clamp(min=0))
    if style == "both":
        m = torch.maximum(m, c ** j.expand(length, length))
    return torch.where(t > j, m, (t == j).double())


def dense_apply(values, mask, c, style, floor):
    """Reference: compact each row's valid tokens, multiply by the dense matrix, scatter back."""
    out = torch.zeros(values.shape, dtype=torch.float64)
    cache = {}
    for b in range(values.shape[0]):
        idx = torch.nonzero(mask[b]).flatten()
        n = len(idx)
        if n not in cache:
            cache[n] = dense_trace_matrix(n, c, style, floor)
        out[b, idx] = cache[n] @ values[b, idx].double()
    return out


def scan_tol(magnitudes: torch.Tensor, length: int) -> torch.Tensor:
    """Elementwise rounding bound of a float32 trace against the dense float64 product: y_t = Σ_j M[t,j] x_j
    with M >= 0 is a sum of at most T terms (the chunked scan adds a few operations per term), so within
    (T + 8)·eps32·Σ_j M[t,j]|x_j| (``magnitudes``, the dense product of |x|) in any order (tests/tolerances.py)."""
    return sum_rtol(length + 8) * magnitudes


def assert_matches_dense(values, mask, lam, gamma, style, floor):
    got = apply_trace(values, mask, lam=lam, gamma=gamma, style=style, floor=floor)
    ref = dense_apply(values, mask, gamma * lam, style, floor)
    assert got.dtype == torch.float32 and got.shape == values.shape
    tol = scan_tol(dense_apply(values.abs(), mask, gamma * lam, style, floor), values.shape[1])
    assert bool(((got.double() - ref).abs() <= tol).all()), float(((got.double() - ref).abs() - tol).max())


def assert_transpose_matches_dense(grad, mask, c, style, floor):
    """Mᵀ·grad (the backward pass of apply_trace, by autograd through the O(T) scans) against
    the dense matrix, row by row; masked entries get no gradient."""
    ref, magnitudes = torch.zeros(grad.shape, dtype=torch.float64), torch.zeros(grad.shape, dtype=torch.float64)
    for b in range(grad.shape[0]):
        idx = torch.nonzero(mask[b]).flatten()
        m = dense_trace_matrix(len(idx), c, style, floor).T
        ref[b, idx] = m @ grad[b, idx].double()
        magnitudes[b, idx] = m @ grad[b, idx].double().abs()
    x = torch.randn(grad.shape, generator=torch.Generator().manual_seed(0)).requires_grad_()
    (got,) = torch.autograd.grad(apply_trace(x, mask, lam=c, style=style, floor=floor), x, grad)
    tol = scan_tol(magnitudes, grad.shape[1])
    assert bool(((got.double() - ref).abs() <= tol).all()), float(((got.double() - ref).abs() - tol).max())


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 150), c=st.sampled_from([0.0, 0.3, 0.9, 0.99, 1.0]),
       floor=st.sampled_from([0.0, 1e-3, 0.2, 1.0]), style=st.sampled_from(["recent", "both"]),
       seed=st.integers(0, 2**16), keep=st.floats(0.0, 1.0), gaps=st.booleans())
def test_transposed_trace_matches_dense_property(length, c, floor, style, seed, keep, gaps):
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(3, length, generator=gen)
    if gaps:
        mask = torch.rand(3, length, generator=gen) < keep
    else:                                           # prefixes: the flip path without compaction
        mask = torch.arange(length)[None] < torch.randint(0, length + 1, (3, 1), generator=gen)
    assert_transpose_matches_dense(grad, mask, c, style, floor)


@pytest.mark.parametrize("style,floor", [("recent", 0.0), ("recent", 0.05), ("both", 0.0), ("both", 0.05)])
def test_transposed_trace_matches_dense_long_rows(style, floor):
    gen = torch.Generator().manual_seed(8)
    grad = torch.randn(3, 700, generator=gen)
    mask = torch.rand(3, 700, generator=gen) > 0.2
    mask[2, 500:] = False
    assert_transpose_matches_dense(grad, mask, 0.99, style, floor)


@pytest.mark.parametrize("style,floor,lam", itertools.product(
    ["recent", "both"], [0.0, 0.05, 0.6], [0.0, 0.5, 0.99, 1.0]))
def test_apply_trace_matches_dense_matrix_t512_with_gaps(style, floor, lam):
    gen = torch.Generator().manual_seed(hash((style, floor, lam)) % 2**31)
    values = torch.randn(2, 512, generator=gen)
    mask = torch.rand(2, 512, generator=gen) > 0.25  # masked tool-output gaps
    mask[1, 300:] = False                          # right padding
    mask[1, :40] = False                           # left gap
    assert_matches_dense(values, mask, lam, 1.0, style, floor)


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 150), lam=st.floats(0.0, 1.0), gamma=st.floats(0.5, 1.0),
       floor=st.sampled_from([0.0, 1e-3, 0.2, 1.0]), style=st.sampled_from(["recent", "both"]),
       seed=st.integers(0, 2**16), keep=st.floats(0.0, 1.0))
def test_apply_trace_matches_dense_property(length, lam, gamma, floor, style, seed, keep):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(3, length, generator=gen)
    mask = torch.rand(3, length, generator=gen) < keep
    assert_matches_dense(values, mask, lam, gamma, style, floor)


def test_apply_trace_basic_cases():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    full = torch.ones(1, 4, dtype=torch.bool)
    # λ = 0, recent: identity; λ = 1: prefix sums; a masked step is skipped, not decayed
    assert torch.equal(apply_trace(x, full, lam=0.0), x)
    assert torch.equal(apply_trace(x, full, lam=1.0), torch.cumsum(x, 1))
    gap = torch.tensor([[True, False, True, True]])
    y = apply_trace(x, gap, lam=0.5)
    assert torch.equal(y, torch.tensor([[1.0, 0.0, 3.5, 5.75]]))       # sums of halves: exact in binary
    # λ = 0, both: the first valid token keeps weight c^0 = 1 in every row (eq. 17)
    assert torch.equal(apply_trace(x, full, lam=0.0, style="both"), torch.tensor([[1.0, 3.0, 4.0, 5.0]]))   # exact
    # empty rows / empty sequences
    assert apply_trace(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), lam=0.5).shape == (2, 0)
    assert torch.equal(apply_trace(x, torch.zeros(1, 4), lam=0.5), torch.zeros(1, 4))


def test_apply_trace_long_sequence_is_finite_and_linear():
    # (γλ)^{-t} would overflow float32 here; the chunked scan only uses powers ≤ 1
    values = torch.randn(2, 20000)
    mask = torch.ones(2, 20000, dtype=torch.bool)
    for lam, style, floor in [(0.999, "recent", 0.0), (0.9, "both", 1e-4), (0.3, "recent", 0.01)]:
        y = apply_trace(values, mask, lam=lam, style=style, floor=floor)
        assert torch.isfinite(y).all()
        y2 = apply_trace(2 * values, mask, lam=lam, style=style, floor=floor)
        assert torch.equal(y2, 2 * y)     # scaling by a power of two commutes with every rounding: exact
    # windowed tail against the plain recursion over the last 100 steps
    y = apply_trace(values[:1], mask[:1], lam=0.9)
    rec = mag = torch.zeros((), dtype=torch.float64)
    for v in values[0].double():
        rec, mag = v + 0.9 * rec, v.abs() + 0.9 * mag
    assert abs(y[0, -1].item() - rec.item()) <= scan_tol(mag, values.shape[1]).item()


@pytest.mark.parametrize("style,floor,lam", [("recent", 1e-3, 0.99), ("both", 1e-3, 0.99),
                                              ("both", 0.0, 0.995), ("recent", 0.2, 0.9)])
def test_apply_trace_matches_dense_multilevel_scan(style, floor, lam):
    """Lengths that need three levels of the blocked scan, a ragged last block, padded rows."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(3, 1501, generator=gen)
    mask = torch.ones(3, 1501, dtype=torch.bool)
    mask[1, 1200:] = False                          # right padding: the compaction-free path
    mask[2, 700:] = False
    assert_matches_dense(values, mask, lam, 1.0, style, floor)
    mask[2, 100:140] = False                        # a gap: the compaction path
    assert_matches_dense(values, mask, lam, 1.0, style, floor)


@pytest.mark.parametrize("style,floor", [("recent", 0.0), ("recent", 0.3), ("both", 0.0), ("both", 0.2)])
@pytest.mark.parametrize("layout", ["full", "padded", "gaps"])
def test_apply_trace_gradcheck_across_blocks(style, floor, layout):
    """The in-place updates of the blocked scan keep autograd exact (Mᵀ·grad), also past a block."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(2, 37, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 37, dtype=torch.bool)
    if layout != "full":
        mask[1, 30:] = False
    if layout == "gaps":
        mask[0, 5:9] = False
    torch.autograd.gradcheck(lambda v: apply_trace(v, mask, lam=0.8, style=style, floor=floor), (values,))


@pytest.mark.parametrize("style,floor", [("recent", 0.01), ("both", 0.01), ("both", 0.0)])
def test_apply_trace_all_valid_fast_path_equals_masked_path(style, floor):
    """An all-True mask skips the masking passes; results equal those of the masked path."""
    values = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    full = torch.ones(3, 300, dtype=torch.bool)
    padded = full.clone()
    padded[0, -1] = False                       # forces the masked path; row 0 is checked apart
    fast = apply_trace(values, full, lam=0.97, style=style, floor=floor)
    slow = apply_trace(values, padded, lam=0.97, style=style, floor=floor)
    assert torch.equal(fast[1:], slow[1:]) and torch.equal(fast[0, :-1], slow[0, :-1])
    assert not values.requires_grad and fast.data_ptr() != values.data_ptr()
    assert_matches_dense(values, full, 0.97, 1.0, style, floor)


def test_apply_trace_masked_garbage_does_not_leak():
    """NaN/inf at masked positions never reach valid outputs (the block matmul would spread them)."""
    values = torch.randn(2, 40)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, 20:] = False
    mask[1, 3:6] = False
    dirty = torch.where(mask, values, torch.tensor([float("nan"), float("inf")]).repeat(20).expand(2, 40))
    for style in ("recent", "both"):
        y = apply_trace(dirty, mask, lam=0.9, style=style, floor=0.1)
        assert torch.equal(y, apply_trace(values, mask, lam=0.9, style=style, floor=0.1))
        assert torch.equal(y[~mask], torch.zeros(int((~mask).sum())))


def test_apply_trace_bf16_input():
    values = torch.randn(2, 100).bfloat16()
    y = apply_trace(values, torch.ones(2, 100), lam=0.9, style="both", floor=0.01)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()


@pytest.mark.parametrize("style", ["recent", "both"])
def test_apply_trace_under_autocast_computes_in_float32(style):
    """A bf16 autocast region (the trainer's forward) leaves the trace's scan in float32: the same
    values as outside it (bf16 matmuls were 8e-3 off at T = 1,024)."""
    values = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0))
    mask = torch.rand(3, 1024, generator=torch.Generator().manual_seed(1)) < 0.9
    plain = apply_trace(values, mask, lam=0.99, style=style)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        traced = apply_trace(values, mask, lam=0.99, style=style)
    assert traced.dtype == torch.float32
    torch.testing.assert_close(traced, plain, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lam=1.5), r"lam: expected a value in \[0, 1\], got 1.5"),
    (dict(lam=-0.1), r"lam: expected a value in \[0, 1\]"),
    (dict(lam=0.5, gamma=2.0), r"gamma: expected"),
    (dict(lam=0.5, floor=-1.0), r"floor: expected"),
    (dict(lam=0.5, style="forward"), r"style: unknown value 'forward'; valid values are \['recent', 'both'\]"),
])
def test_apply_trace_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_trace(torch.zeros(2, 3), torch.ones(2, 3), **kwargs)


def test_apply_trace_bad_shapes():
    with pytest.raises(ValueError, match=r"mask: expected shape \[2, 3\], got \[2, 4\]"):
        apply_trace(torch.zeros(2, 3), torch.ones(2, 4), lam=0.5)
    with pytest.raises(ValueError, match="values: expected a 2-D tensor"):
        apply_trace(torch.zeros(3), torch.ones(3), lam=0.5)
    with pytest.raises(ValueError, match="mask: expected a bool or 0/1 mask"):
        apply_trace(torch.zeros(2, 3), torch.full((2, 3), 0.5), lam=0.5)


def test_trace_options_validate():
    with pytest.raises(ValueError, match=r"trace.update: unknown value 'both'; valid values are \['trace', 'weight'\]"):
        TraceOptions(lam=0.5, update="both")
    with pytest.raises(ValueError, match="lam: expected"):
        TraceOptions(lam=2.0)


# ---- GRPO-λ updates inside policy_loss ------------------------------------------------------

# tiny_policy is float64 throughout: a loss or gradient is a sum over <= 3 x 9 tokens of trace sums over <= 9
# steps (and P = 4 parameters), each term a few (~12) operations: within (3·9·9 + 12)·eps64 of the terms'
# magnitudes (<= 10: ratios near 1, N(0,1) advantages, features of a softplus) (tests/tolerances.py)
F64_REL = sum_rtol(3 * 9 * 9 + 12, torch.float64)
F64_ABS = F64_REL * 10


def tiny_policy(seed=0, rows=3, length=9, params=4):
    """log π as a smooth function of a tiny parameter vector θ, plus a mask with gaps."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, length, params, generator=gen, dtype=torch.float64)
    theta = torch.randn(params, generator=gen, dtype=torch.float64)
    mask = torch.rand(rows, length, generator=gen) > 0.3
    mask[:, 0] = True
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)

    def logp_fn(th):
        return -torch.nn.functional.softplus(features @ th)
    return theta, logp_fn, mask, adv


@pytest.mark.parametrize("style,floor", [("recent", 0.0), ("recent", 0.3), ("both", 0.0), ("both", 0.1)])
def test_eps_trace_gradient_identity(style, floor):
    """Theorem 1: ∇ of the ε-trace objective at θ_old = θ is Σ_t Â_t Σ_{j≤t} M[t,j] ∇log π(y_j)."""
    theta, logp_fn, mask, adv = tiny_policy()
    opts = TraceOptions(lam=0.8, gamma=0.95, style=style, floor=floor, adv_clamp=-0.1)
    th = theta.clone().requires_grad_()
    logp = logp_fn(th)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, agg="seq-mean-token-sum", trace=opts)
    (grad,) = torch.autograd.grad(loss, th)

    jac = torch.autograd.functional.jacobian(logp_fn, theta)  # [B,T,P]
    expected = torch.zeros_like(theta)
    clamped = adv.clamp(min=-0.1)
    for b in range(mask.shape[0]):
        idx = torch.nonzero(mask[b]).flatten()
        m = dense_trace_matrix(len(idx), 0.8 * 0.95, style, floor)
        for ti in range(len(idx)):
            for ji in range(ti + 1):
                expected += clamped[b] * m[ti, ji] * jac[b, idx[ji]]
    expected = -expected / mask.shape[0]
    torch.testing.assert_close(grad.double(), expected, rtol=F64_REL, atol=F64_ABS)


def test_eps_trace_lambda_zero_is_plain_loss_with_clamp():
    theta, logp_fn, mask, adv = tiny_policy(seed=1)
    gen = torch.Generator().manual_seed(5)
    th1, th2 = theta.clone().requires_grad_(), theta.clone().requires_grad_()
    old = (logp_fn(theta) + 0.3 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)).clamp(max=0)
    traced, _ = policy_loss(logp_fn(th1), old, adv, mask, trace=TraceOptions(lam=0.0, adv_clamp=-0.1))
    plain, _ = policy_loss(logp_fn(th2), old, adv.clamp(min=-0.1), mask)
    assert torch.equal(traced, plain)
    traced.backward(), plain.backward()
    assert torch.equal(th1.grad, th2.grad)


def test_eps_weight_matches_reference_and_sigma_carries_gradient():
    """ε-weight (Algorithm 2): ℓ_t · Σ_j M[t,j](1 + σ(log π_j − 1)), σ with gradient."""
    theta, logp_fn, mask, adv = tiny_policy(seed=2)
    gen = torch.Generator().manual_seed(6)
    old = (logp_fn(theta) + 0.2 * torch.randn(mask.shape, generator=gen, dtype=torch.float64)).clamp(max=0)
    opts = TraceOptions(lam=0.9, style="both", floor=0.05, update="weight", adv_clamp=-0.1)
    th = theta.clone().requires_grad_()
    loss, _ = policy_loss(logp_fn(th), old, adv, mask, clip_low=0.2, agg="token-mean", trace=opts)
    (grad,) = torch.autograd.grad(loss, th)

    def reference(th_):
        logp = logp_fn(th_)
        total = 0.0
        a = adv.clamp(min=-0.1)
        for b in range(mask.shape[0]):
            idx = torch.nonzero(mask[b]).flatten()
            m = dense_trace_matrix(len(idx), 0.9, "both", 0.05)
            soft = 1 + torch.sigmoid(logp[b, idx] - 1)
            weight = m @ soft
            for ti, t in enumerate(idx):
                r = torch.exp(logp[b, t] - old[b, t])
                tok = torch.maximum(-a[b] * r, -a[b] * r.clamp(0.8, 1.2))
                total = total + weight[ti] * tok
        return total / mask.sum()
    th_ref = theta.clone().requires_grad_()
    ref = reference(th_ref)
    (ref_grad,) = torch.autograd.grad(ref, th_ref)
    torch.testing.assert_close(loss.double(), ref.double(), rtol=F64_REL, atol=F64_ABS)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=F64_REL, atol=F64_ABS)


def test_eps_weight_lambda_zero_is_plain_loss_times_soft_clamp():
    theta, logp_fn, mask, adv = tiny_policy(seed=3)
    logp = logp_fn(theta)
    old = logp - 0.1
    weighted, _ = policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum",
                              trace=TraceOptions(lam=0.0, update="weight"))
    ratio = torch.exp(logp - old)
    a = adv.clamp(min=-0.1)[:, None]
    tok = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * (1 + torch.sigmoid(logp - 1))
    expected = torch.where(mask, tok, 0.0).sum() / mask.shape[0]
    torch.testing.assert_close(weighted.double(), expected, rtol=F64_REL, atol=F64_ABS)


@pytest.mark.parametrize("style,floor", [("recent", 0.0), ("recent", 0.01), ("both", 0.0), ("both", 0.2)])
def test_apply_trace_right_padding_fast_path(style, floor):
    """Rows that are prefixes (right padding only) skip compaction; still equal to dense."""
    values = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([300, 170, 0])
    mask = torch.arange(300)[None] < lengths[:, None]
    assert_matches_dense(values, mask, 0.97, 0.99, style, floor)


def test_the_trace_reports_the_share_of_advantages_its_clamp_raised():
    """The logged adv_* are the estimator's; ``adv_clamped_frac`` says on how many kept tokens the trace's
    clamp (adv_clamp, −0.1 by default) raised the advantage the loss used."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 9, generator=gen) < 0.8
    old = -torch.rand(6, 9, generator=gen) * 2
    adv = torch.tensor([-1.0, -0.05, 0.3, -0.5, 2.0, -0.2])
    _, metrics = policy_loss(old.clone().requires_grad_(), old, adv, mask, trace=TraceOptions(lam=0.5))
    raised = sum(int(mask[b].sum()) for b in range(6) if adv[b] < -0.1)
    assert raised > 0 and metrics["adv_clamped_frac"] == pytest.approx(raised / int(mask.sum()))
