"""The pieces of the clipped policy loss, and their plain autograd composition.

Each piece is a small function over [B,T] tensors that autograd differentiates:
``clipped_surrogate`` (PPO clip, DAPO clip-higher, dual clip),
``rollout_correction_terms`` (TIS weight / MIS drop, token or sequence level), ``kl_penalty``
(k1/k2/k3 to a reference), the STAPO keep-mask (``stapo.silence_keep_mask``) and the GRPO-λ
trace (``traces.apply_trace``). ``policy_loss_reference`` composes them with ordinary autograd:
it *is* the definition of the loss. ``creditrl.policy_loss`` computes the same value with a
closed-form gradient (the fast path) and is tested against this reference for every option and
every pair of options.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from creditrl.utils.validate import as_mask, token_advantages
from creditrl.core.losses.aggregation import agg_loss
from creditrl.core.losses.diagnostics import MAX_LOG_RATIO, kl_estimate
from creditrl.core.losses.traces import TraceOptions, apply_trace

__all__ = ["clipped_surrogate", "rollout_correction_terms", "kl_penalty",
           "policy_loss_reference"]


def clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float,
                      clip_c: float | None = None) -> Tensor:
    """ℓ_t = max(−A r, −A clip(r, 1−ε_low, 1+ε_high)) (PPO eq. 7; DAPO clip-higher), and
    min(ℓ_t, −A c) where A < 0 (dual clip). ratio, adv: [B,T]; returns [B,T]."""
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * clip_c), loss)
    return loss


def rollout_correction_terms(old_logp: Tensor, rollout_logp: Tensor, valid: Tensor, mode: str,
                             cap: float) -> tuple[Tensor | None, Tensor]:
    """Off-policy correction against the sampler, ρ = π_old/π_rollout (detached data).

    Returns (TIS weight min(ρ, cap) [B,T] or [B,1], or None; kept [B,T] bool). ``tis``/``mis``
    use per-token ρ; ``seq-tis``/``seq-mis`` the row's geometric mean exp(mean_t log ρ_t).
    ``mis``/``seq-mis`` drop tokens with |log ρ| > log cap. Log-ratios are clamped to ±20."""
    log_rho = torch.where(valid, old_logp - rollout_logp, 0.0)
    if mode.startswith("seq-"):
        log_rho = (log_rho.sum(1) / valid.sum(1).clamp(min=1)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)[:, None]
    else:
        log_rho = log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if mode in ("tis", "seq-tis"):
        return log_rho.exp().clamp(max=cap).detach(), valid
    return None, valid & ~(log_rho.abs() > math.log(cap))


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) at samples of π_θ: ``kl_estimate`` of log π_ref − log π."""
    return kl_estimate(ref_logp - logp, estimator)


def policy_loss_reference(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                          clip_low: float = 0.2, clip_high: float | None = None, clip_c: float | None = None,
                          agg: str = "token-mean", max_len: int | None = None,
                          ref_logp: Tensor | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
                          rollout_logp: Tensor | None = None, rollout_correction: str | None = None,
                          rollout_cap: float = 2.0, stapo=None, entropy: Tensor | None = None,
                          trace: TraceOptions | None = None) -> Tensor:
    """``policy_loss``'s value as a plain autograd composition of the pieces (module docstring).

    Same arguments and meaning as ``creditrl.policy_loss`` (see its module docstring for the
    equations); returns the scalar loss only. Tokens dropped from the loss (STAPO, MIS) keep
    their value in the trace but pass no gradient; only ``logp`` is differentiated."""
    from creditrl.core.losses.stapo import StapoOptions, silence_keep_mask

    valid = as_mask("mask", mask, logp.shape)
    clip_high = clip_low if clip_high is None else clip_high
    old_logp = old_logp.detach()
    adv = torch.where(valid, token_advantages(advantages, logp).detach(), 0.0)
    keep = valid
    if stapo:
        opts = stapo if isinstance(stapo, StapoOptions) else StapoOptions()
        keep = silence_keep_mask(logp.detach(), entropy, adv, valid, opts)
    weight = None
    if rollout_correction is not None:
        weight, kept = rollout_correction_terms(old_logp, rollout_logp.detach(), valid, rollout_correction,
                                                rollout_cap)
        keep = keep & kept
    if trace is not None:
        adv = adv.clamp(min=trace.adv_clamp)
    kept_logp = torch.where(keep, logp, logp.detach())          # dropped tokens pass no gradient
    log_ratio = torch.where(valid, kept_logp - old_logp, 0.0)
    if trace is not None and trace.update == "trace":           # ε-trace: r_t = exp(M·log-ratio)
        log_ratio = apply_trace(log_ratio, valid, lam=trace.lam, gamma=trace.gamma, style=trace.style,
                                floor=trace.floor)
    ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    token_loss = clipped_surrogate(ratio, adv, clip_low, clip_high, clip_c)
    if weight is not None:
        token_loss = token_loss * weight
    if trace is not None and trace.update == "weight":          # ε-weight: ℓ · M(1 + σ(log π − 1))
        sigma = torch.where(valid, torch.sigmoid(kept_logp - 1.0), 0.0)
        token_loss = token_loss * apply_trace(1.0 + sigma, valid, lam=trace.lam, gamma=trace.gamma,
                                              style=trace.style, floor=trace.floor)
    if ref_logp is not None and kl_coef > 0:
        token_loss = token_loss + kl_coef * kl_penalty(kept_logp, ref_logp.detach(), kl_estimator)
    return agg_loss(torch.where(keep, token_loss, 0.0), keep, agg, max_len=max_len)
