"""Composable clipped policy loss: PPO/DAPO clip (+ dual clip), KL to a reference, rollout
correction (TIS/MIS, token or sequence), STAPO silencing and GRPO-λ traces — any combination.

Per token (valid tokens; r_t = π_θ/π_old, A_t the advantage):
    ℓ_t = max(−A_t r_t, −A_t clip(r_t, 1−ε_low, 1+ε_high))      PPO clip (DAPO clip-higher)
    ℓ_t = min(ℓ_t, −A_t c)  where A_t < 0                       dual clip (``clip_c``)
    ℓ_t ← ℓ_t · min(ρ, cap)                                     TIS, ρ = π_old/π_rollout (detached)
    ℓ_t ← ℓ_t + β · KL_t(π_θ‖π_ref)                             k1/k2/k3 estimator
and the loss is ``agg_loss(ℓ, keep)`` with keep = valid ∧ ¬STAPO-silenced ∧ ¬MIS-dropped, so
the denominators count kept tokens only (STAPO eq. 1).

GRPO-λ (paper Algorithms 1–2; advantages clamped from below at ``adv_clamp``, §4.2):
    ε-trace:  r_t = exp(apply_trace(log π_θ − log π_old))       Theorem 1, eq. 1–2
    ε-weight: ℓ_t ← ℓ_t · apply_trace(1 + σ(log π_θ − 1))       Algorithm 2
Interpretations where the paper is ambiguous:
  * ε-weight: σ(log π_θ − 1) carries gradient. Algorithm 2 writes no stop-gradient (the paper
    writes sg(·) where it means one) and App. A.3 says multiplying the trace weights with
    log π "provides the traces" — i.e. gradient reaches earlier tokens through the weight.
    Hence λ = 0 gives the ordinary token loss times (1 + σ(log π_t − 1)) ∈ (1, 1.27], not the
    plain loss; only ε-trace with ``style="recent"`` reduces to GRPO exactly at λ = 0.
  * Algorithm 1 writes −min(r, clip(r))·A; we use the standard PPO form above (identical for
    A ≥ 0, the usual pessimistic bound for A < 0), so the clip options apply unchanged.
  * Tokens dropped from the loss (STAPO, MIS) keep their place and value in the trace but
    are detached there, so they pass no gradient through later tokens either.
Log-ratios are clamped to ±20 before exp (as verl does) so ratios and grads stay finite; the
gradient is zero where a clamp binds, as autograd through ``clamp`` would give.
All arithmetic is float32, or the widest float dtype among the inputs (mixed float32/float64
inputs are computed in float64); bf16 inputs are upcast. The gradient has ``logp``'s dtype.

How it is computed. Everything is evaluated without autograd, in closed form, and the scalar
comes back with its exact gradient w.r.t. ``logp`` attached (one autograd node whose backward
is a single multiply): a handful of passes over [B,T] instead of a graph of ~60 ops. With
L = Σ_b w_b Σ_t κ_t ℓ_t (w_b from ``agg_row_weights``, κ the keep-mask, ρ̄ the TIS weight):
  * the clip is one clamp: ψ_t = −A_t·clamp(r_t, lo_t, hi_t), with [lo, hi] =
    [e^−20, 1+ε_high] for A > 0 and [1−ε_low, clip_c or e^20] for A < 0 (equal to the max/min
    form above), so ∂ψ/∂z = ψ·1[r inside its bounds], z the surrogate log-ratio;
  * G_t = ∂L/∂z_t = w_b κ_t ρ̄_t τ_t ψ_t 1[inside]   (τ: the ε-weight trace, else 1);
  * untraced and ε-weight: z = log π − log π_old, so ∂L/∂log π = G;
    ε-trace: z = M(log π − log π_old), so ∂L/∂log π = κ ⊙ MᵀG (the O(T) transposed trace);
    ε-weight adds κ ⊙ σ'(log π − 1) ⊙ Mᵀ(w κ ρ̄ ψ); KL adds w_b κ_t β k'(log π_t) with
    k1' = 1, k2' = −(log π_ref − log π), k3' = 1 − π_ref/π.
Only ``logp`` receives gradient: advantages and the old/reference/rollout log-probs and
entropies are data (detached), as in every RL trainer. No double backward.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from creditrl.utils.validate import check_choice, check_finite, check_int, check_range, check_same_shape, check_tensor
from creditrl.utils.validate import NonFiniteError, as_mask, token_advantages
from creditrl.core.losses.aggregation import AGG_MODES, agg_denominator, agg_row_weights
from creditrl.core.losses.diagnostics import MAX_LOG_RATIO, ppl_gap_of_rows
from creditrl.core.losses.stapo import StapoOptions, silence_keep_mask
from creditrl.core.losses.traces import TraceOperator, TraceOptions

ROLLOUT_CORRECTIONS = (None, "tis", "mis", "seq-tis", "seq-mis")
METRIC_KEYS = ("clip_frac_low", "clip_frac_high", "approx_kl", "ref_kl", "mismatch_kl", "ppl_gap",
               "is_masked_frac", "spurious_ratio", "adv_abs_mean", "kept_frac", "agg_count")
RATIO_MIN, RATIO_MAX = math.exp(-MAX_LOG_RATIO), math.exp(MAX_LOG_RATIO)

__all__ = ["policy_loss", "ratio_bounds", "StapoOptions", "TraceOptions", "ROLLOUT_CORRECTIONS", "METRIC_KEYS"]


def ratio_bounds(advantages: Tensor, clip_low: float, clip_high: float,
                 clip_c: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token bounds (lo, hi), shaped like ``advantages`` ([B,1] or [B,T]), such that
    −A·clamp(r, lo, hi) is the PPO clipped loss max(−A r, −A clip(r, 1−ε_low, 1+ε_high))
    (PPO eq. 7, DAPO clip-higher), dual-clipped by min(·, −A c) where A < 0, with r itself
    clamped to [e^−20, e^20]:  A > 0: [e^−20, 1+ε_high];  A < 0: [1−ε_low, c];  A = 0: anything.
    Also returns the 0/1 indicators of A > 0 and A < 0. Built from exact 0/1 products (an
    additive blend would lose 1+ε against e^20 in float32)."""
    sign = torch.sign(advantages)
    positive, negative = sign.clamp(min=0), sign.neg().clamp_(min=0)
    lo = negative * max(1.0 - clip_low, RATIO_MIN)
    lo.add_(1.0 - negative, alpha=RATIO_MIN)
    hi = (1.0 - positive).mul_(min(clip_c, RATIO_MAX) if clip_c is not None else RATIO_MAX)
    hi.add_(positive, alpha=min(1.0 + clip_high, RATIO_MAX))
    return lo, hi, positive, negative


def _zero_off_mask_(fresh: Tensor, valid: Tensor, valid_f: Tensor) -> Tensor:
    """``fresh`` (a tensor this module owns) with entries off ``valid`` set to 0: one in-place
    multiply when everything is finite (the usual case; a ``where`` is 10x slower on CPU), a
    ``where`` when the padding holds inf/NaN (NaN on valid entries stays, to be reported)."""
    if bool(torch.isfinite(fresh.sum())):
        return fresh.mul_(valid_f)
    return torch.where(valid, fresh, 0.0)


def _k3_sum(expm1_x: Tensor, x: Tensor) -> Tensor:
    """Σ k3 = Σ (e^x − 1) − x at x clamped to ±20, from expm1(x) computed without the clamp."""
    low, high = torch.aminmax(x)
    if bool(low < -MAX_LOG_RATIO) or bool(high > MAX_LOG_RATIO):       # rare: clamp copies
        return expm1_x.clamp(max=RATIO_MAX - 1.0).sum() - x.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).sum()
    return expm1_x.sum() - x.sum()


class _WithGradient(torch.autograd.Function):
    """A scalar ``value`` computed without autograd whose gradient w.r.t. ``logp`` is ``coef``."""

    @staticmethod
    def forward(ctx, logp: Tensor, value: Tensor, coef: Tensor) -> Tensor:
        ctx.save_for_backward(coef)
        ctx.logp_dtype = logp.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (coef,) = ctx.saved_tensors
        return (coef * grad).to(ctx.logp_dtype), None, None


def _stapo_options(stapo: object) -> StapoOptions | None:
    if stapo is None or stapo is False:
        return None
    if stapo is True:
        return StapoOptions()
    if isinstance(stapo, StapoOptions):
        return stapo
    raise TypeError(f"stapo: expected None, a bool or StapoOptions, got {type(stapo).__name__}")


def _check_options(clip_low, clip_high, clip_c, agg, max_len, kl_coef, ref_logp, kl_estimator,
                   rollout_logp, rollout_correction_mode, rollout_cap, trace) -> None:
    check_range("clip_low", clip_low, 0.0, 1.0, high_inclusive=False)
    check_range("clip_high", clip_high, 0.0)
    if clip_c is not None:
        check_range("clip_c", clip_c, 1.0, low_inclusive=False)
    check_choice("agg", agg, AGG_MODES)
    if max_len is not None:
        check_int("max_len", max_len, 1)
    check_range("kl_coef", kl_coef, 0.0)
    check_choice("kl_estimator", kl_estimator, ("k1", "k2", "k3"))
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"ref_logp: expected a [B,T] tensor when kl_coef > 0, got None (kl_coef={kl_coef})")
    check_choice("rollout_correction", rollout_correction_mode, ROLLOUT_CORRECTIONS)
    if rollout_correction_mode is not None and rollout_logp is None:
        raise ValueError(f"rollout_logp: expected a [B,T] tensor when rollout_correction="
                         f"{rollout_correction_mode!r}, got None")
    check_range("rollout_cap", rollout_cap, 1.0)
    if trace is not None and not isinstance(trace, TraceOptions):
        raise TypeError(f"trace: expected None or TraceOptions, got {type(trace).__name__}")


def _as_float(name: str, x: object, like: Tensor, dtype: torch.dtype) -> Tensor:
    """Shape-checked [B,T] input in ``dtype`` (the widest of the inputs, at least float32). NaN
    is checked lazily: see ``_explain_non_finite``."""
    x = check_tensor(name, x, floating=True)
    check_same_shape("logp", like, name, x)
    return x.to(dtype)


def _common_dtype(*tensors) -> torch.dtype:
    """Mixed float dtypes are computed in the widest one (never below float32)."""
    dtype = torch.float32
    for x in tensors:
        if isinstance(x, Tensor) and x.is_floating_point():
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _explain_non_finite(inputs: dict[str, Tensor | None], valid: Tensor, metrics: dict) -> None:
    """Called only when the loss or a metric came out non-finite: name the culprit input."""
    for name, x in inputs.items():
        if x is not None:
            check_finite(name, torch.where(valid, x.detach(), 0.0))
    raise NonFiniteError(f"policy_loss: non-finite result from finite inputs (values too large?): {metrics}")


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                clip_low: float = 0.2, clip_high: float | None = None, clip_c: float | None = None,
                agg: str = "token-mean", max_len: int | None = None,
                ref_logp: Tensor | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                rollout_logp: Tensor | None = None, rollout_correction: str | None = None,
                rollout_cap: float = 2.0, stapo: bool | StapoOptions | None = None,
                entropy: Tensor | None = None, trace: TraceOptions | None = None,
                ) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with composable options (see the module docstring).

    logp: [B,T] current log π_θ(y_t) (with grad); old_logp, ref_logp, rollout_logp: [B,T]
    log-probs of the policy that produced the ratios' denominator, the frozen reference and
    the sampler; advantages: [B] or [B,T]; mask: [B,T] valid response tokens;
    entropy: [B,T] current-policy entropy (required with ``stapo``).
    Returns (scalar loss, metrics); the loss's gradient reaches ``logp`` only (an empty batch,
    B = 0 or T = 0, gives loss 0 with zero gradients and every metric 0.0). Metrics are
    Python floats, 0.0 when not applicable: clip fractions over kept tokens; approx_kl (k3,
    KL(π_old‖π_θ)), ref_kl (chosen estimator), mismatch_kl (k3, KL(π_rollout‖π_old)),
    adv_abs_mean over valid tokens; ppl_gap (OTB eq. 68, old vs rollout); is_masked_frac,
    spurious_ratio, kept_frac as fractions of valid tokens; agg_count, the aggregation's
    denominator (``agg_denominator``: what gradient accumulation weights micro-batches by).
    """
    logp_in = check_tensor("logp", logp, ndim=2, floating=True)
    valid = as_mask("mask", mask, logp_in.shape)
    clip_high = clip_low if clip_high is None else clip_high
    _check_options(clip_low, clip_high, clip_c, agg, max_len, kl_coef, ref_logp, kl_estimator,
                   rollout_logp, rollout_correction, rollout_cap, trace)
    stapo_opts = _stapo_options(stapo)
    if stapo_opts is not None and entropy is None:
        raise ValueError("entropy: expected a [B,T] tensor when stapo is on, got None")
    inputs = {"logp": logp_in, "old_logp": old_logp, "rollout_logp": rollout_logp, "ref_logp": ref_logp,
              "entropy": entropy if stapo_opts is not None else None}
    with torch.no_grad():
        dtype = _common_dtype(*inputs.values(), advantages)
        logp, old_logp, rollout_logp, ref_logp, entropy = [
            None if x is None else _as_float(name, x.detach(), logp_in, dtype) for name, x in inputs.items()]
    if logp_in.numel() == 0:      # B = 0 or T = 0: loss 0, still attached (zero gradients), metrics 0
        token_advantages(advantages, logp)                               # validated all the same
        return logp_in.sum() * 0.0, dict.fromkeys(METRIC_KEYS, 0.0)
    with torch.no_grad():
        # On CPU every fresh [B,T] buffer costs page faults (glibc returns large blocks to the
        # OS), so the passes below work in place wherever a value is not needed again.
        valid_f = valid.view(torch.uint8).to(logp.dtype)
        row_tokens = valid_f.sum(dim=1)
        token_adv = token_advantages(advantages, logp)                   # validated
        if advantages.dim() == 1:                                        # [B,1]: no [B,T] passes
            adv = torch.where(row_tokens > 0, advantages.detach().to(logp.dtype), 0.0)[:, None]
        else:
            adv = _zero_off_mask_(token_adv.detach().to(logp.dtype, copy=True), valid, valid_f)
        n_valid = row_tokens.sum().clamp(min=1)
        zero = logp.new_zeros(())
        adv_abs_mean = _weighted_sum(adv.abs(), row_tokens[:, None] if adv.shape[1] == 1 else valid_f) / n_valid

        # keep-mask κ = valid ∧ ¬STAPO-silenced ∧ ¬MIS-dropped; TIS weight ρ̄ (detached)
        keep, spurious_ratio = valid, zero
        if stapo_opts is not None:
            keep = silence_keep_mask(logp, entropy, adv, valid, stapo_opts)
            spurious_ratio = (n_valid - torch.count_nonzero(keep)) / n_valid
        tis_weight = None
        mismatch_kl = ppl_gap = is_masked_frac = zero
        if rollout_logp is not None:
            log_rho = _zero_off_mask_(old_logp - rollout_logp, valid, valid_f)
            row_log_rho = log_rho.sum(dim=1) / row_tokens.clamp(min=1)
            ppl_gap = ppl_gap_of_rows(row_log_rho, row_tokens > 0)                  # OTB eq. 68
            _clamp_log_ratio_(log_rho)
            rho_m1 = torch.expm1(log_rho)                                # ρ − 1: k3 and the TIS weight
            mismatch_kl = _k3_sum(rho_m1, log_rho) / n_valid
            if rollout_correction in ("seq-tis", "seq-mis"):
                log_rho = row_log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)[:, None]
            if rollout_correction == "tis":
                tis_weight = rho_m1.add_(1.0).clamp_(max=rollout_cap)
            elif rollout_correction == "seq-tis":
                tis_weight = log_rho.exp().clamp_(max=rollout_cap)
            elif rollout_correction in ("mis", "seq-mis"):
                is_masked = log_rho.abs() > math.log(rollout_cap)       # off-mask: log ρ = 0, kept
                is_masked_frac = _weighted_sum(is_masked.view(torch.uint8).to(logp.dtype),
                                               row_tokens[:, None] if is_masked.shape[1] == 1 else valid_f) / n_valid
                keep = keep & ~is_masked
        keep_f = valid_f if keep is valid else keep.view(torch.uint8).to(logp.dtype)
        keep_rows = row_tokens if keep is valid else keep_f.sum(dim=1)
        weights = agg_row_weights(keep_rows, agg, logp.shape[1], max_len=max_len)[:, None]   # w_b

        # surrogate: z, r = e^z, ψ = −A·clamp(r, lo, hi)
        log_ratio = _zero_off_mask_(logp - old_logp, valid, valid_f)
        traced = trace is not None and trace.update == "trace"
        if trace is not None:
            adv = adv.clamp(min=trace.adv_clamp)
            trace_op = TraceOperator(valid, trace.gamma * trace.lam, trace.style, trace.floor)
        ratio = torch.expm1(trace_op(log_ratio) if traced else log_ratio)       # r − 1
        approx_kl = _k3_sum(torch.expm1(log_ratio) if traced else ratio, log_ratio) / n_valid
        ratio.add_(1.0)
        lo, hi, positive, negative = ratio_bounds(adv, clip_low, clip_high, clip_c)
        surrogate = torch.maximum(ratio, lo)                            # a clamp with tensor bounds
        torch.minimum(surrogate, hi, out=surrogate)                     # is 4x slower on CPU
        side = ratio.sub_(surrogate).neg_().sign_().mul_(keep_f)        # +1 raised to lo, −1 cut to hi
        surrogate.mul_(adv).neg_()                                      # ψ
        # clip fractions over kept tokens: relu(±s) = (|s| ± s)/2, sums without temporaries
        n_keep = keep_rows.sum().clamp(min=1)
        signed_low, signed_high = _weighted_sum(side, negative), _weighted_sum(side, positive)
        side.abs_()                                                     # 1 = clipped and kept
        clip_frac_low = (_weighted_sum(side, negative) + signed_low) / (2 * n_keep)
        clip_frac_high = (_weighted_sum(side, positive) - signed_high) / (2 * n_keep)
        inside = side.neg_().add_(keep_f)                               # κ·1[r inside its bounds]

        scale = keep_f if tis_weight is None else keep_f * tis_weight   # κ·ρ̄
        if trace is not None and trace.update == "weight":
            sigma = torch.sigmoid(_zero_off_mask_(logp - 1.0, valid, valid_f))
            trace_weight = trace_op((sigma + 1.0).mul_(valid_f))        # τ = M(1 + σ(log π − 1))
            weight_grad = trace_op.transposed(surrogate * scale * weights)     # Mᵀ ∂L/∂τ
            scale = scale * trace_weight
        token_loss = surrogate.mul_(scale)
        value_rows = token_loss.sum(dim=1)
        grad_z = token_loss.mul_(inside).mul_(weights)                  # G = ∂L/∂z
        coef = trace_op.transposed(grad_z).mul_(keep_f) if traced else grad_z
        if trace is not None and trace.update == "weight":
            weight_grad.mul_(keep_f).mul_(sigma)
            coef.addcmul_(weight_grad, sigma.neg_().add_(1.0))          # σ' = σ(1 − σ)

        ref_kl = zero
        if ref_logp is not None:
            ref_kl, kept_kl_rows = _add_kl_(coef, _zero_off_mask_(ref_logp - logp, valid, valid_f), keep_f,
                                           weights, kl_coef, kl_estimator)
            ref_kl = ref_kl / n_valid
            if kl_coef > 0:
                value_rows = value_rows.add_(kept_kl_rows, alpha=kl_coef)
        value = (value_rows * weights[:, 0]).sum()

        values = [clip_frac_low, clip_frac_high, approx_kl, ref_kl, mismatch_kl, ppl_gap, is_masked_frac,
                  spurious_ratio, adv_abs_mean, keep_rows.sum() / n_valid, agg_denominator(keep_rows, agg), value]
        floats = torch.stack([v.to(torch.float64) for v in values]).tolist()   # one device→host copy
    metrics = dict(zip(METRIC_KEYS, floats[:-1]))
    if not all(math.isfinite(v) for v in floats):
        inputs["advantages"] = token_adv
        _explain_non_finite(inputs, valid, metrics)
    return _WithGradient.apply(logp_in, value, coef), metrics


def _weighted_sum(x: Tensor, weight: Tensor) -> Tensor:
    """Σ x·weight for x [B,T] and weight [B,T] or [B,1], without a [B,T] temporary."""
    if weight.shape == x.shape:
        return torch.dot(x.reshape(-1), weight.reshape(-1))
    return torch.dot(x.sum(dim=1), weight.reshape(-1))


def _clamp_log_ratio_(x: Tensor) -> Tensor | None:
    """Clamp x to ±20 in place; only a min/max check when nothing is out of range. Returns the
    0/1 indicator of the entries the clamp left alone (for a zero gradient where it binds),
    or None when it left all of them alone."""
    low, high = torch.aminmax(x)
    if not (bool(low < -MAX_LOG_RATIO) or bool(high > MAX_LOG_RATIO)):
        return None
    in_range = (x.abs() <= MAX_LOG_RATIO).view(torch.uint8).to(x.dtype)
    x.clamp_(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return in_range


def _add_kl_(coef: Tensor, log_ratio: Tensor, keep_f: Tensor, weights: Tensor, kl_coef: float,
             estimator: str) -> tuple[Tensor, Tensor]:
    """KL to the reference for x = log π_ref − log π (0 off the mask, consumed): adds
    w_b κ β dk/d log π to ``coef`` in place; returns (Σ_valid k, per-row Σ_kept k).
    k1 = −x, k2 = x²/2, k3 = e^x − 1 − x with x clamped to ±20 (zero gradient where it binds)."""
    if estimator == "k1":
        total = -log_ratio.sum()
        kept_rows = -(log_ratio.mul_(keep_f).sum(dim=1))
        if kl_coef > 0:
            coef.addcmul_(keep_f, weights, value=kl_coef)
        return total, kept_rows
    if estimator == "k2":
        total = 0.5 * torch.dot(log_ratio.reshape(-1), log_ratio.reshape(-1))
        log_ratio.mul_(keep_f)
        kept_rows = 0.5 * _row_dot(log_ratio, log_ratio)
        if kl_coef > 0:
            coef.addcmul_(log_ratio, weights, value=-kl_coef)
        return total, kept_rows
    in_range = _clamp_log_ratio_(log_ratio)
    expm1 = torch.expm1(log_ratio)
    total = expm1.sum() - log_ratio.sum()
    kept_rows = _row_dot(expm1, keep_f) - _row_dot(log_ratio, keep_f)
    if kl_coef > 0:
        expm1.mul_(keep_f)
        if in_range is not None:
            expm1.mul_(in_range)
        coef.addcmul_(expm1, weights, value=-kl_coef)
    return total, kept_rows


def _row_dot(x: Tensor, y: Tensor) -> Tensor:
    """Σ_t x·y per row [B], without a [B,T] temporary."""
    return torch.bmm(x[:, None, :], y[:, :, None]).view(-1)
