"""Rollout correction against the sampler's log-probs: TIS weight or MIS drop, token or sequence level.

The sampler (e.g. vLLM) and the trainer's π_old differ slightly; with ρ_t = π_old(y_t)/π_rollout(y_t)
(detached data, log ρ clamped to ±20):
    tis:     ℓ_t ← ℓ_t·min(ρ_t, cap)            truncated importance sampling
    mis:     drop tokens with |log ρ_t| > log cap  (masked importance sampling)
    seq-tis, seq-mis: the same with the row's geometric mean ρ = exp(mean_t log ρ_t).
Metrics (whenever ``rollout_logp`` is given): ``mismatch_kl`` (k3 estimate of KL(π_rollout‖π_old)),
``ppl_gap`` (OTB eq. 68: mean over responses of |mean_t log π_old − mean_t log π_rollout|) and
``is_masked_frac`` (dropped / valid tokens).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from creditrl.core.losses.diagnostics import MAX_LOG_RATIO, kl_estimate, ppl_gap_of_rows
from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_choice, check_range

ROLLOUT_CORRECTIONS = (None, "tis", "mis", "seq-tis", "seq-mis")


@dataclass(frozen=True)
class RolloutCorrectionOptions:
    """The correction mode and its cap."""

    rollout_correction: Literal[ROLLOUT_CORRECTIONS[1:]] | None = field(default=None, metadata={
        "help": "tis, mis, seq-tis or seq-mis against the sampler's log-probs (None = off; needs rollout_logp)"})
    rollout_cap: float = field(default=2.0, metadata={
        "help": "TIS weight cap / MIS threshold: drop tokens with ρ outside [1/cap, cap]"})

    def __post_init__(self):
        check_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        check_range("rollout_cap", self.rollout_cap, 1.0)


@register_loss_term("rollout_correction", options=RolloutCorrectionOptions, stage="keep", flat=True,
                    needs=("rollout_logp",), when=lambda options: options.rollout_correction is not None)
def rollout_correction(state: LossState, options: RolloutCorrectionOptions) -> LossState:
    """Rollout correction ρ = π_old/π_rollout: TIS weight min(ρ, cap) or MIS drop, per token or sequence."""
    if state.rollout_logp is None:
        return state
    with torch.no_grad():                                         # ρ is data
        log_rho = state.old_logp - state.rollout_logp             # 0 off the mask
        row_log_rho = log_rho.sum(dim=1) / state.row_tokens.clamp(min=1)
        metrics = {"ppl_gap": ppl_gap_of_rows(row_log_rho, state.row_tokens > 0),           # OTB eq. 68
                   "mismatch_kl": (kl_estimate(log_rho, "k3").sum(), state.n_tokens)}
        mode = options.rollout_correction
        if mode in ("seq-tis", "seq-mis"):
            log_rho = row_log_rho[:, None]
        log_rho = log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        if mode in ("mis", "seq-mis"):
            dropped = log_rho.abs() > math.log(options.rollout_cap)
            weight = state.valid if dropped.shape[1] > 1 else state.row_tokens[:, None]
            metrics["is_masked_frac"] = (dropped * weight).sum(), state.n_tokens
    if mode in ("tis", "seq-tis"):
        state = state.scaled(log_rho.exp().clamp_(max=options.rollout_cap))
    elif mode in ("mis", "seq-mis"):
        state = dataclasses.replace(state, keep=state.keep & ~dropped)
    return state.with_metrics(**metrics)
