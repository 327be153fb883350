"""CISPO: clip the stop-gradient importance weight, keep every token's gradient (a surrogate term).

CISPO (MiniMax-M1, arXiv 2506.13585) drops the PPO clip's zero gradient outside the trust region:
the ratio becomes a clipped, stop-gradient weight of the REINFORCE term,

    ℓ_t = −sg(clip(r_t, 1 − ε_low, 1 + ε_high)) · A_t · log π_θ(y_t)

so a token whose ratio left the range still passes A_t·∇log π, scaled by the bound. The bounds are
the flat ``clip_low`` / ``clip_high`` (verl: ``clip_ratio_low`` / ``clip_ratio_high``); as in
verl's ``compute_policy_loss_cispo`` the log-ratio is clamped to ±20 first. TRL's
``loss_type="cispo"`` truncates from above only, at ``epsilon_high`` itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from creditrl.core.losses.clip import weighted
from creditrl.core.losses.diagnostics import clamp_log_ratio
from creditrl.core.losses.terms import LossState, register_loss_term


@dataclass(frozen=True)
class CispoOptions:
    """CISPO has no options of its own: the weight's bounds are ``clip_low`` / ``clip_high``."""


@register_loss_term("cispo", options=CispoOptions, stage="surrogate")
def cispo(state: LossState, options: CispoOptions) -> LossState:
    """CISPO: ℓ_t = −sg(clip(r_t, 1 − ε_low, 1 + ε_high))·A_t·log π_θ(y_t) × weight (MiniMax-M1).

    Metrics: ``clip_frac_low`` / ``clip_frac_high``, the kept tokens whose weight is truncated
    below / above (whatever the sign of A: the weight is truncated, the gradient stays)."""
    bounds = state.flat["clip"]
    with torch.no_grad():
        ratio = clamp_log_ratio(state.log_ratio).exp()
        weight = ratio.clamp(1.0 - bounds.clip_low, 1.0 + bounds.high)
        n_keep = state.keep.sum()
        metrics = {"clip_frac_low": ((ratio < 1.0 - bounds.clip_low).logical_and_(state.keep).sum(), n_keep),
                   "clip_frac_high": ((ratio > 1.0 + bounds.high).logical_and_(state.keep).sum(), n_keep)}
    token_loss = (weight * state.advantages).neg_() * state.score_logp()
    return dataclasses.replace(state, token_loss=weighted(state, token_loss)).with_metrics(**metrics)
