"""SAPO: a smooth, temperature-controlled gate in place of the hard clip (a surrogate term).

SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347) replaces clip(r) by the sigmoid gate

    f_τ(r) = (4/τ)·σ(τ(r − 1)),   ℓ_t = −f_{τ_t}(r_t)·A_t,   τ_t = τ_pos if A_t > 0 else τ_neg

whose slope is exactly 1 at r = 1 (the on-policy gradient is the policy gradient) and decays
smoothly away from it, faster for negative advantages (τ_neg > τ_pos). As verl's
``compute_policy_loss_sapo`` (its config fields ``tau_pos`` / ``tau_neg``; TRL:
``sapo_temperature_pos`` / ``_neg``), with the log-ratio clamped to ±20. verl aggregates SAPO
with ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says; here the aggregation is the
loss's own (choose ``agg="seq-mean-token-mean"`` for verl's).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from creditrl.core.losses.clip import weighted
from creditrl.core.losses.diagnostics import clamp_log_ratio
from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_range


@dataclass(frozen=True)
class SapoOptions:
    """The gate temperatures for positive and non-positive advantages (verl's names and defaults)."""

    tau_pos: float = field(default=1.0, metadata={
        "help": "τ of the gate for tokens with A > 0 (> 0; larger = sharper trust region)"})
    tau_neg: float = field(default=1.05, metadata={
        "help": "τ of the gate for tokens with A <= 0 (> 0; SAPO takes it above tau_pos)"})

    def __post_init__(self):
        check_range("tau_pos", self.tau_pos, 0.0, low_inclusive=False)
        check_range("tau_neg", self.tau_neg, 0.0, low_inclusive=False)


@register_loss_term("sapo", options=SapoOptions, stage="surrogate")
def sapo(state: LossState, options: SapoOptions) -> LossState:
    """SAPO: ℓ_t = −(4/τ_t)·σ(τ_t(r_t − 1))·A_t × weight, τ_t = τ_pos if A_t > 0 else τ_neg (SAPO).

    Metric ``gate_mean``: mean over kept tokens of the gate's slope 4σ(1 − σ) (1 on-policy, → 0
    far from it: how much gradient the gate lets through)."""
    adv = state.advantages
    tau = torch.where(adv > 0, adv.new_tensor(options.tau_pos), options.tau_neg)
    gate = torch.sigmoid(tau * (clamp_log_ratio(state.log_ratio).exp() - 1.0))
    token_loss = (gate * (4.0 / tau)).mul(adv).neg()
    with torch.no_grad():
        slope = (4.0 * gate * (1.0 - gate) * state.keep_f).sum(), state.keep.sum()
    return dataclasses.replace(state, token_loss=weighted(state, token_loss)).with_metrics(gate_mean=slope)
