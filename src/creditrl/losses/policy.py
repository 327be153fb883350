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
Log-ratios are clamped to ±20 before exp (as verl does) so ratios and grads stay finite.
All arithmetic is float32 (or float64 if given); bf16 inputs are upcast.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from creditrl._validate import check_choice, check_finite, check_range, check_same_shape, check_tensor
from creditrl._validate import as_mask
from creditrl.losses.aggregation import AGG_MODES, reduce_kept
from creditrl.losses.diagnostics import MAX_LOG_RATIO, kl_estimate, masked_mean
from creditrl.losses.stapo import StapoOptions, silence_keep_mask, token_advantages
from creditrl.losses.traces import TraceOptions, masked_trace

ROLLOUT_CORRECTIONS = (None, "tis", "mis", "seq-tis", "seq-mis")
METRIC_KEYS = ("clip_frac_low", "clip_frac_high", "approx_kl", "ref_kl", "mismatch_kl", "ppl_gap",
               "is_masked_frac", "spurious_ratio", "adv_abs_mean", "kept_frac")

__all__ = ["policy_loss", "clipped_surrogate", "mismatch_correction", "StapoOptions", "TraceOptions",
           "ROLLOUT_CORRECTIONS", "METRIC_KEYS"]


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                      clip_c: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped token loss [B,T] (PPO eq. 7, DAPO clip-higher, dual clip for A < 0).

    ``advantages`` broadcasts against ``ratio`` [B,T] ([B,1] per response or [B,T]).
    Returns (loss, clipped_low, clipped_high): the bool masks mark tokens whose ratio left the
    trust region on the side that the clip binds (r < 1−ε_low with A < 0, r > 1+ε_high with A > 0).
    """
    neg_adv = -advantages
    loss = torch.maximum(neg_adv * ratio, neg_adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if clip_c is not None:                       # the bound is +inf where A ≥ 0
        loss = torch.minimum(loss, torch.where(advantages < 0, neg_adv * clip_c, torch.inf))
    with torch.no_grad():
        clipped_low = (ratio < 1.0 - clip_low) & (advantages < 0)
        clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0)
    return loss, clipped_low, clipped_high


def mismatch_correction(log_rho: Tensor, row_tokens: Tensor, mode: str,
                        cap: float) -> tuple[Tensor | None, Tensor | None]:
    """Training–inference mismatch correction from log ρ_t = log π_old − log π_rollout [B,T]
    (0 off the valid tokens; ``row_tokens`` [B] valid tokens per row).

    ``tis``/``seq-tis``: detached weight min(ρ, cap); ``mis``/``seq-mis``: bool mask of tokens
    with ρ ∈ [1/cap, cap]. The ``seq-`` modes use the sequence's geometric-mean ratio
    exp(mean_t log ρ_t), returned as [B,1]. Returns (weight or None, in_range or None).
    """
    log_rho = log_rho.detach()
    if mode.startswith("seq-"):
        log_rho = (log_rho.sum(dim=1) / row_tokens.clamp(min=1))[:, None]
    if mode.endswith("tis"):
        return log_rho.exp().clamp(max=cap), None
    bound = math.log(cap)
    return None, (log_rho >= -bound) & (log_rho <= bound)


def _keep_grad_where(x: Tensor, keep: Tensor) -> Tensor:
    """x with its value unchanged but gradient only where ``keep`` (float 0/1); x finite.
    Three cheap float passes instead of ``torch.where(keep, x, x.detach())``."""
    kept = x * keep
    return kept + (x - kept).detach()


def _stapo_options(stapo: object) -> StapoOptions | None:
    if stapo is None or stapo is False:
        return None
    if stapo is True:
        return StapoOptions()
    if isinstance(stapo, StapoOptions):
        return stapo
    raise TypeError(f"stapo: expected None, a bool or StapoOptions, got {type(stapo).__name__}")


def _check_options(clip_low, clip_high, clip_c, agg, kl_coef, ref_logp, kl_estimator,
                   rollout_logp, rollout_correction_mode, rollout_cap, trace) -> None:
    check_range("clip_low", clip_low, 0.0, 1.0, high_inclusive=False)
    check_range("clip_high", clip_high, 0.0)
    if clip_c is not None:
        check_range("clip_c", clip_c, 1.0, low_inclusive=False)
    check_choice("agg", agg, AGG_MODES)
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


def _as_float(name: str, x: object, like: Tensor) -> Tensor:
    """Shape-checked [B,T] input in float32 (float64 stays). NaN is checked lazily: see
    ``_explain_non_finite``."""
    x = check_tensor(name, x, floating=True)
    check_same_shape("logp", like, name, x)
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _explain_non_finite(inputs: dict[str, Tensor | None], valid: Tensor, metrics: dict) -> None:
    """Called only when the loss or a metric came out non-finite: name the culprit input."""
    for name, x in inputs.items():
        if x is not None:
            check_finite(name, torch.where(valid, x.detach(), 0.0))
    raise ValueError(f"policy_loss: non-finite result from finite inputs (values too large?): {metrics}")


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
    Returns (scalar loss, metrics). Metrics are Python floats, 0.0 when not applicable:
    clip fractions over kept tokens; approx_kl (k3, KL(π_old‖π_θ)), ref_kl (chosen estimator),
    mismatch_kl (k3, KL(π_rollout‖π_old)), adv_abs_mean over valid tokens; ppl_gap (OTB eq. 68,
    old vs rollout); is_masked_frac, spurious_ratio, kept_frac as fractions of valid tokens.
    """
    logp = check_tensor("logp", logp, ndim=2, floating=True)
    valid = as_mask("mask", mask, logp.shape)
    clip_high = clip_low if clip_high is None else clip_high
    _check_options(clip_low, clip_high, clip_c, agg, kl_coef, ref_logp, kl_estimator,
                   rollout_logp, rollout_correction, rollout_cap, trace)
    stapo_opts = _stapo_options(stapo)
    inputs = {"logp": logp, "old_logp": old_logp, "rollout_logp": rollout_logp, "ref_logp": ref_logp,
              "entropy": entropy if stapo_opts is not None else None}
    like = logp
    logp, old_logp, rollout_logp, ref_logp, entropy = [
        None if x is None else _as_float(name, x, like) for name, x in inputs.items()]
    # Every [B,T] input is zeroed off the mask once (one `where` each); after that all tokens
    # hold finite values, so masks apply as cheap float products and sums need no masking.
    valid_f = valid.view(torch.uint8).to(logp.dtype)
    row_tokens = valid_f.sum(dim=1)                                  # float sums: no bool→int pass
    token_adv = token_advantages(advantages, logp)                   # validated
    if advantages.dim() == 1:                                        # [B,1]: no [B,T] passes
        adv = torch.where(row_tokens > 0, advantages.to(logp.dtype), 0.0)[:, None]
    else:
        adv = torch.where(valid, token_adv.to(logp.dtype), 0.0)
    adv_abs = adv.detach().abs()

    keep, silenced = valid, None
    if stapo_opts is not None:
        if entropy is None:
            raise ValueError("entropy: expected a [B,T] tensor when stapo is on, got None")
        keep = silence_keep_mask(logp, entropy, adv, valid, stapo_opts)
        silenced = keep
    is_weight, log_rho, rho_gap, is_masked = None, None, None, None
    if rollout_logp is not None:
        rho_gap = torch.where(valid, old_logp - rollout_logp, 0.0)
        log_rho = rho_gap.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        if rollout_correction is not None:
            is_weight, in_range = mismatch_correction(log_rho, row_tokens, rollout_correction, rollout_cap)
            if in_range is not None:
                is_masked = ~in_range                                # off-mask: log ρ = 0, in range
                keep = keep & in_range
    keep_f = valid_f if keep is valid else keep.view(torch.uint8).to(logp.dtype)

    log_ratio = torch.where(valid, logp - old_logp, 0.0)
    surrogate_log_ratio = log_ratio
    if trace is not None:
        adv = adv.clamp(min=trace.adv_clamp)
        if trace.update == "trace":
            traced_in = log_ratio if keep is valid else _keep_grad_where(log_ratio, keep_f)
            surrogate_log_ratio = masked_trace(traced_in, valid, trace.gamma * trace.lam, trace.style,
                                               trace.floor)
    ratio_m1 = torch.expm1(surrogate_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    token_loss, clipped_low, clipped_high = clipped_surrogate(ratio_m1 + 1.0, adv, clip_low, clip_high, clip_c)
    if trace is not None and trace.update == "weight":
        soft = torch.sigmoid(torch.where(valid, logp, 1.0) - 1.0) * valid_f + valid_f   # 1 + σ(log π − 1)
        token_loss = token_loss * masked_trace(_keep_grad_where(soft, keep_f), valid,
                                               trace.gamma * trace.lam, trace.style, trace.floor)
    if is_weight is not None:
        token_loss = token_loss * is_weight
    ref_kl = None
    if ref_logp is not None:
        ref_kl = kl_estimate(torch.where(valid, ref_logp - logp, 0.0), kl_estimator)
        if kl_coef > 0:
            token_loss = torch.add(token_loss, ref_kl, alpha=kl_coef)
    keep_rows = row_tokens if keep is valid else keep_f.sum(dim=1)
    loss = reduce_kept(token_loss * keep_f, keep_rows, agg, max_len=max_len)

    with torch.no_grad():
        # k3 = (e^x − 1) − x, zero off the mask; the loss's own expm1 serves when untraced
        kl_m1 = ratio_m1 if surrogate_log_ratio is log_ratio else torch.expm1(log_ratio)
        clamped = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        n_valid = row_tokens.sum().clamp(min=1)
        n_keep = keep_rows.sum().clamp(min=1)
        zero = logp.new_zeros(())
        adv_weight = row_tokens[:, None] if adv_abs.shape[1] == 1 else 1   # [B,1]: per response
        values = [
            torch.count_nonzero(clipped_low & keep) / n_keep,
            torch.count_nonzero(clipped_high & keep) / n_keep,
            (kl_m1 - clamped).sum() / n_valid,
            ref_kl.sum() / n_valid if ref_kl is not None else zero,
            kl_estimate(log_rho, "k3").sum() / n_valid if log_rho is not None else zero,
            masked_mean((rho_gap.sum(dim=1) / row_tokens.clamp(min=1)).abs(), row_tokens > 0)
            if rho_gap is not None else zero,                                   # OTB eq. 68
            (is_masked * (row_tokens[:, None] if is_masked.shape[1] == 1 else 1)).sum() / n_valid
            if is_masked is not None else zero,
            (n_valid - torch.count_nonzero(silenced)) / n_valid if silenced is not None else zero,
            (adv_abs * adv_weight).sum() / n_valid,
            keep_rows.sum() / n_valid,
        ]
        floats = torch.stack([v.to(torch.float64) for v in values] + [loss.detach().double()]).tolist()
    metrics = dict(zip(METRIC_KEYS, floats[:-1]))
    if not all(math.isfinite(v) for v in floats):
        inputs["advantages"] = token_adv
        _explain_non_finite(inputs, valid, metrics)
    return loss, metrics
