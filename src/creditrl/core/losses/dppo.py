"""DPPO: a trust region on the divergence of the sampled token's probability (surrogate terms).

DPPO (Divergence Proximal Policy Optimization, arXiv 2602.04879) replaces the ratio clip, which
over-constrains rare tokens and under-constrains likely ones, by a mask on an estimate of the
policy divergence at the token, with p = π_θ(y_t), q = π_old(y_t) (Binary approximations):

    dppo_tv:  inside_t = p − q ≤ δ_high  if A_t > 0,   p − q ≥ −δ_low  otherwise
    dppo_kl:  D_t = q (log q − log p) + (1 − q) log((1 − q + 1e-8)/(1 − p + 1e-8))
              inside_t = D_t ≤ δ_high ∨ p ≤ q  if A_t > 0,   D_t ≤ δ_low ∨ p ≥ q  otherwise
    ℓ_t = −A_t · sg(min(r_t, C)) · inside_t · log π_θ(y_t)

As verl's ``compute_policy_loss_dppo_tv`` / ``_kl``: the thresholds δ are the flat ``clip_low`` /
``clip_high`` (verl reads its ``clip_ratio_low`` / ``clip_ratio_high`` as δ; the paper uses 0.15)
and the truncation C of the stop-gradient ratio is the flat ``clip_c`` (verl's ``clip_ratio_c``),
20 when unset (verl's code default; its ActorConfig sets 3.0). A token outside the region passes
no gradient but stays in the loss's denominators (verl's ``valid_mask`` multiplies the loss).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from creditrl.core.losses.clip import ClipOptions, weighted
from creditrl.core.losses.diagnostics import clamp_log_ratio
from creditrl.core.losses.terms import LossState, register_loss_term

DPPO_DEFAULT_CAP = 20.0          # verl's config.get("clip_ratio_c", 20.0); the paper advises a large cap
BINARY_KL_EPS = 1e-8             # verl's guard of log(1 − p)


@dataclass(frozen=True)
class DppoOptions:
    """DPPO has no options of its own: δ_low, δ_high = ``clip_low``, ``clip_high``; C = ``clip_c`` (None: 20)."""


def tv_region(logp: Tensor, old_logp: Tensor, advantages: Tensor, bounds: ClipOptions) -> Tensor:
    """DPPO-Binary-TV trust region [B,T] bool: p − q ≤ δ_high (A > 0), p − q ≥ −δ_low (A ≤ 0)."""
    diff = logp.exp() - old_logp.exp()
    return torch.where(advantages > 0, diff <= bounds.high, diff >= -bounds.clip_low)


def kl_region(logp: Tensor, old_logp: Tensor, advantages: Tensor, bounds: ClipOptions) -> Tensor:
    """DPPO-Binary-KL trust region [B,T] bool: the Bernoulli KL(q‖p) of the sampled token within δ,
    or the probability moving against the advantage's direction. Log-probs are read at most 0: the
    rounding above 0 that the loss accepts (``LOGP_TOLERANCE``) would make 1 - p < 0 and the KL NaN,
    putting the token outside the region."""
    logp, old_logp = logp.clamp(max=0.0), old_logp.clamp(max=0.0)
    p, q = logp.exp(), old_logp.exp()
    binary_kl = q * (old_logp - logp) + (1 - q) * torch.log((1 - q + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS))
    return torch.where(advantages > 0, (binary_kl <= bounds.high) | (p <= q), (binary_kl <= bounds.clip_low) | (p >= q))


def dppo_loss(state: LossState, region: Callable[..., Tensor]) -> LossState:
    """ℓ_t = −A_t·sg(min(r_t, C))·inside_t·log π_θ(y_t) × weight, ``inside`` from ``region``.

    Metrics: ``clip_frac_high`` / ``clip_frac_low``, the kept tokens with A > 0 / A < 0 outside
    the trust region (they pass no gradient)."""
    bounds = state.flat["clip"]
    cap = DPPO_DEFAULT_CAP if bounds.clip_c is None else bounds.clip_c
    adv = state.advantages
    with torch.no_grad():
        inside = region(state.logp.detach(), state.old_logp, adv, bounds)
        coef = clamp_log_ratio(state.log_ratio).exp().clamp_(max=cap).mul_(inside).mul_(adv)
        outside = (~inside).logical_and_(state.keep)
        n_keep = state.keep.sum()
        metrics = {"clip_frac_high": (outside.logical_and(adv > 0).sum(), n_keep),
                   "clip_frac_low": (outside.logical_and_(adv < 0).sum(), n_keep)}
    token_loss = coef.neg_() * state.score_logp()
    return dataclasses.replace(state, token_loss=weighted(state, token_loss)).with_metrics(**metrics)


@register_loss_term("dppo_tv", options=DppoOptions, stage="surrogate")
def dppo_tv(state: LossState, options: DppoOptions) -> LossState:
    """DPPO-Binary-TV: −A_t·sg(min(r_t, C))·1[p − q within δ]·log π_θ(y_t) (DPPO)."""
    return dppo_loss(state, tv_region)


@register_loss_term("dppo_kl", options=DppoOptions, stage="surrogate")
def dppo_kl(state: LossState, options: DppoOptions) -> LossState:
    """DPPO-Binary-KL: −A_t·sg(min(r_t, C))·1[Bernoulli KL within δ]·log π_θ(y_t) (DPPO)."""
    return dppo_loss(state, kl_region)
