"""token_stats against a float64 reference, gradients, bf16, chunked memory and errors."""
from __future__ import annotations

import pytest
import torch

from creditrl import token_stats
from creditrl.utils.memory import PeakMemory
from tolerances import SUBNORMAL32, assert_close_normwise, sum_rtol


def reference(logits, tokens, mask, temperature=1.0):
    """Float64 full-softmax reference; also returns the differentiable logp/entropy."""
    logp_all = torch.log_softmax(logits.double() / temperature, -1)
    p = logp_all.exp()
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(p * logp_all).sum(-1)
    sum_p2 = (p * p).sum(-1)
    # ||e_y − π||² = (1 − π_y)² + Σ_{v≠y} π_v², with 1 − π_y summed over the other tokens: written as
    # Σ (e_y − π)², 1 − π_y would cancel to float64's eps (2% of a near-certain token's 1e-29 energy)
    others = p * (1 - torch.nn.functional.one_hot(tokens, logits.shape[-1]))
    energy = others.sum(-1).square() + others.square().sum(-1)
    m = mask.double()
    return logp * m, entropy * m, sum_p2 * m, energy * m


def sample(seed, shape=(3, 7, 50), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=g) * scale
    logits[0, 0, 5] = 40.0                                   # a near-certain token
    tokens = torch.randint(0, shape[-1], shape[:2], generator=g)
    tokens[0, 0] = 5
    mask = torch.rand(shape[:2], generator=g) < 0.7
    tokens[~mask] = -100                                     # ignored label at masked positions
    return logits, tokens, mask


def magnitudes(logits, tokens, mask, temperature=1.0):
    """What each statistic's float32 rounding scales with (float64): logp = z_y − m − log s and the entropy
    add terms up to |z − m| and log s; Σπ² and the energy are sums of positive terms (the energy written
    without cancellation), so their own size."""
    logp_all = torch.log_softmax(logits.double() / temperature, -1)
    p = logp_all.exp()
    log_v = torch.log(torch.tensor(float(logits.shape[-1]), dtype=torch.float64))
    logp, _, sum_p2, energy = reference(logits, tokens, mask, temperature)
    spread = -(p * logp_all).sum(-1) + (p * logp_all.abs()).sum(-1)      # Σ p |log p| (>= the entropy)
    return logp.abs() + 2 * log_v, spread + log_v, sum_p2, energy


def close(got, want, scale, vocab):
    """|got − want| <= (V + 8)·eps32·scale elementwise: every statistic is a float32 sum over the V
    logits of terms of a few operations each (exp, log, products), in any order, plus as many subnormal
    spacings where a result falls below float32's range (tests/tolerances.py)."""
    tol = sum_rtol(vocab + 8) * scale + (vocab + 8) * SUBNORMAL32
    return bool(((got.double() - want).abs() <= tol).all())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_matches_float64_reference(temperature, chunk_size):
    logits, tokens, mask = sample(0)
    stats = token_stats(logits, tokens, mask, temperature=temperature, chunk_size=chunk_size)
    ref = reference(logits, tokens.clamp(min=0), mask, temperature)
    scales = magnitudes(logits, tokens.clamp(min=0), mask, temperature)
    for name, want, scale in zip(("logp", "entropy", "sum_p2", "energy"), ref, scales):
        got = getattr(stats, name)
        assert got.dtype == torch.float32 and got.shape == mask.shape
        assert close(got, want, scale, logits.shape[-1]), name
        assert torch.equal(got[~mask], torch.zeros(int((~mask).sum())))
    assert (stats.energy >= 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradients_match_reference(temperature):
    logits, tokens, mask = sample(1)
    g = torch.Generator().manual_seed(2)
    w_logp, w_ent = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    x = logits.clone().requires_grad_()
    stats = token_stats(x, tokens, mask, temperature=temperature, chunk_size=3)
    (stats.logp * w_logp + stats.entropy * w_ent).sum().backward()
    x64 = logits.double().requires_grad_()
    logp, entropy, _, _ = reference(x64, tokens.clamp(min=0), mask, temperature)
    (logp * w_logp + entropy * w_ent).sum().backward()
    # each logit's gradient: a few products with π, log π and H (themselves V-term sums): normwise (V + 8)·eps32
    assert_close_normwise(x.grad, x64.grad, sum_rtol(logits.shape[-1] + 8), "logits' gradient")
    assert not stats.sum_p2.requires_grad and not stats.energy.requires_grad
    # only logp used: the entropy gradient slot arrives as None
    x.grad = None
    token_stats(x, tokens, mask).logp.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))


def test_bf16_input():
    logits, tokens, mask = sample(4)
    low = logits.bfloat16()
    stats = token_stats(low, tokens, mask, chunk_size=5)
    ref = reference(low.float(), tokens.clamp(min=0), mask)  # same (rounded) logits in float64
    scales = magnitudes(low.float(), tokens.clamp(min=0), mask)
    for name, want, scale in zip(("logp", "entropy", "sum_p2", "energy"), ref, scales):
        assert getattr(stats, name).dtype == torch.float32
        assert close(getattr(stats, name), want, scale, logits.shape[-1]), name
    x = low.clone().requires_grad_()
    token_stats(x, tokens, mask).entropy.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


def test_default_mask_and_noncontiguous_logits():
    logits, tokens, _ = sample(5)
    tokens = tokens.clamp(min=0)
    strided = logits.transpose(0, 1).contiguous().transpose(0, 1)
    full = token_stats(strided, tokens)
    every = torch.ones_like(tokens, dtype=torch.bool)
    ref, scales = reference(logits, tokens, every), magnitudes(logits, tokens, every)
    assert close(full.entropy, ref[1], scales[1], 50) and close(full.logp, ref[0], scales[0], 50)


def test_chunking_bounds_peak_memory():
    num, steps, vocab = 4, 64, 512
    logits = torch.randn(num, steps, vocab)
    tokens = torch.randint(0, vocab, (num, steps))
    chunk = 16
    full_bytes = logits.numel() * 4
    with PeakMemory() as tracker:
        token_stats(logits, tokens, chunk_size=chunk)
    assert tracker.peak < 4 * chunk * vocab * 4 + 64 * num * steps      # a few chunk buffers + [B,T] outputs
    with PeakMemory() as naive:
        logp = torch.log_softmax(logits.float(), -1)
        (logp.exp() * logp).sum(-1)
    assert naive.peak >= 2 * full_bytes and tracker.peak < naive.peak / 8
    # backward: the logits' gradient itself plus a few chunk buffers, no float32 [B,T,V] scratch
    x = logits.clone().requires_grad_()
    stats = token_stats(x, tokens, chunk_size=chunk)
    with PeakMemory() as backward:
        (stats.logp + stats.entropy).sum().backward()
    assert backward.peak < full_bytes + 4 * chunk * vocab * 4 + 64 * num * steps


def test_errors():
    logits, tokens, mask = sample(6)
    with pytest.raises(ValueError, match=r"logits: expected a 3-D tensor, got shape \(3, 7\)"):
        token_stats(logits[..., 0], tokens, mask)
    with pytest.raises(TypeError, match="logits: expected a floating-point tensor"):
        token_stats(logits.long(), tokens, mask)
    with pytest.raises(ValueError, match=r"tokens: expected shape \[3, 7\], got \[3, 6\]"):
        token_stats(logits, tokens[:, :6], mask)
    with pytest.raises(TypeError, match="tokens: expected an integer tensor"):
        token_stats(logits, tokens.float(), mask)
    with pytest.raises(ValueError, match=r"mask: expected shape \[3, 7\], got \[3, 6\]"):
        token_stats(logits, tokens, mask[:, :6])
    bad = tokens.clone()
    bad[1, mask[1].nonzero()[0]] = 50
    with pytest.raises(ValueError, match=r"tokens: expected ids in \[0, 50\) on valid positions, got 50 in rows \[1\]"):
        token_stats(logits, bad, mask)
    with pytest.raises(ValueError, match="temperature: expected a value in"):
        token_stats(logits, tokens, mask, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size: expected an int >= 1"):
        token_stats(logits, tokens, mask, chunk_size=0)


def test_public_name_is_the_function_even_after_importing_the_module():
    # The module is creditrl.core.token_stats, so importing it never shadows the exported function.
    import importlib

    import creditrl

    importlib.import_module("creditrl.core.token_stats")
    from creditrl import TokenStats, token_stats as fn

    assert callable(fn) and fn.__name__ == "token_stats" and creditrl.token_stats is fn
    assert TokenStats.__name__ == "TokenStats"


def test_energy_is_accurate_for_near_certain_tokens():
    # ŵ = ||e_y - π||² for π(y) ≈ 1: the naive 1 - 2π + Σπ² cancels to ~1e-7 in float32; the
    # direct float64 norm is the reference, and ranking near-certain tokens needs relative accuracy.
    vocab = 50
    margins = torch.tensor([4.0, 8.0, 12.0, 16.0, 20.0])
    logits = torch.zeros(1, len(margins), vocab)
    logits[0, torch.arange(len(margins)), 3] = margins
    tokens = torch.full((1, len(margins)), 3)
    got = token_stats(logits, tokens).energy[0].double()
    pi = torch.softmax(logits.double(), -1)[0]
    want = ((torch.nn.functional.one_hot(tokens[0], vocab).double() - pi) ** 2).sum(-1)
    torch.testing.assert_close(got, want, rtol=sum_rtol(vocab + 8), atol=0)   # positive sums: relative accuracy
    assert bool((got[1:] < got[:-1]).all())  # strictly ordered by certainty, down to ~1e-15


def test_meta_tensors_are_refused_naming_the_argument():
    """A tensor on the meta device has a shape and no values: an error naming it, not torch's
    'Tensor.item() cannot be called on meta tensors'."""
    logits, tokens = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    for name, args in (("logits", (logits.to("meta"), tokens)), ("tokens", (logits, tokens.to("meta"))),
                       ("mask", (logits, tokens, torch.ones(2, 3, device="meta")))):
        with pytest.raises(ValueError, match=rf"^{name}: expected a tensor with values \(on the CPU or a GPU\), got a "
                                             r"tensor on the 'meta' device \(shape \[2, 3(, 5)?\] only"):
            token_stats(*args)


def test_default_chunk_is_small_on_a_cpu_and_large_on_an_accelerator():
    """4M float32 elements of scratch per temporary on a CPU (cache-sized); 64M elsewhere, where a
    16 MiB chunk left an H200 3.3-3.5x slower than verl (docs/performance.md, the GPU chunk sweep)."""
    from creditrl.core.token_stats import default_chunk_size
    assert default_chunk_size(151936, torch.device("cpu")) == (1 << 22) // 151936 == 27
    assert default_chunk_size(151936, torch.device("cuda")) == (1 << 26) // 151936 == 441
    assert default_chunk_size(1 << 30, torch.device("cpu")) == 1          # never 0 rows
