"""Rollout correction against the sampler's log-probs: importance weights, masks and rejection.

The sampler (e.g. vLLM) and the trainer's π_old differ slightly. With ρ_t = π_old(y_t)/π_rollout(y_t)
(detached data) and the sequence's ratio ρ(y) = Π_t ρ_t = exp(Σ_t log ρ_t) (log-ratios clamped to ±20):
    tis:     ℓ_t ← ℓ_t·min(ρ_t, cap)                               truncated importance sampling
    mis:     ℓ_t ← ℓ_t·ρ_t, tokens with ρ_t outside [1/cap, cap] dropped   masked importance sampling
    seq-tis: ℓ_t ← ℓ_t·min(ρ(y), cap)
    seq-mis: ℓ_t ← ℓ_t·ρ(y), rows with ρ(y) outside [1/cap, cap] dropped
    rs:      tokens with ρ_t outside [1/cap, cap] dropped, no weight           token rejection sampling
    geo-rs:  rows whose geometric mean exp(mean_t log ρ_t) is outside [1/cap, cap] dropped, no weight
The weights and masks are verl's (``rollout_corr_helper.compute_rollout_correction_and_rejection_mask``):
tis/seq-tis are ``rollout_is`` token/sequence, the *-mis modes add ``rollout_rs`` token_k1/seq_sum_k1
with thresholds 1/cap and cap (verl's Seq-MIS preset ``decoupled_seq_is_rs``), rs and geo-rs are
``rollout_rs`` token_k1 and seq_mean_k1 alone (Geo-RS). A dropped token leaves the loss and its
denominators, as verl's rejection does (TRL's ``*_mask`` modes zero its weight and keep it counted, and
bound ρ from above only unless ``vllm_importance_sampling_clip_min`` is set). Only the weighted modes
correct the gradient's expectation (up to truncation); rs and geo-rs filter outliers.
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
from torch import Tensor

from creditrl.core.losses.diagnostics import MAX_LOG_RATIO, kl_estimate, ppl_gap_of_rows
from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_choice, check_range

ROLLOUT_CORRECTIONS = (None, "tis", "mis", "seq-tis", "seq-mis", "rs", "geo-rs")


@dataclass(frozen=True)
class RolloutCorrectionOptions:
    """The correction mode and its cap."""

    rollout_correction: Literal[ROLLOUT_CORRECTIONS[1:]] | None = field(default=None, metadata={
        "help": "against the sampler's log-probs (needs rollout_logp; None = off): tis / seq-tis weight by the "
                "token's / sequence's ratio capped at rollout_cap, mis / seq-mis weight by it and drop what "
                "lies outside [1/cap, cap], rs / geo-rs only drop (token ratio / the sequence's geometric mean)"})
    rollout_cap: float = field(default=2.0, metadata={
        "help": "the cap C: TIS weights are at most C; the masks drop ratios outside [1/C, C]"})

    def __post_init__(self):
        check_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        check_range("rollout_cap", self.rollout_cap, 1.0)


def correction(log_rho: Tensor, row_sums: Tensor, row_tokens: Tensor, mode: str,
               cap: float) -> tuple[Tensor | None, Tensor | None]:
    """A mode's (weight, dropped) from the token log-ratios ``log_rho`` [B,T] (0 off the mask), their row
    sums [B] and the rows' valid-token counts [B]: each [B,T] for the token modes, [B,1] for the sequence
    modes; ``weight`` None for rs/geo-rs (1), ``dropped`` None for tis/seq-tis (nothing)."""
    if mode in ("seq-tis", "seq-mis"):
        log_rho = row_sums[:, None]                                                 # log Π_t ρ_t
    elif mode == "geo-rs":
        log_rho = (row_sums / row_tokens.clamp(min=1))[:, None]                     # log of the geometric mean
    log_rho = log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    weight = None if mode.endswith("rs") else log_rho.exp().clamp_(max=cap)   # kept *-mis ratios are <= cap
    dropped = None if mode.endswith("tis") else log_rho.abs() > math.log(cap)
    return weight, dropped


def correction_weights(log_rho: Tensor, mask: Tensor, mode: str, cap: float) -> Tensor:
    """[B,T] in ``log_rho``'s dtype: the factor a mode puts on each token's gradient (its weight; 0 where
    it drops the token and off the 0/1 or bool ``mask`` [B,T], whatever ``log_rho`` holds there): the
    ρ̄_t of OTB's off-policy energies (App. D, eq. 58-60)."""
    valid = mask.bool()
    log_rho = log_rho.masked_fill(~valid, 0.0)
    weight, dropped = correction(log_rho, log_rho.sum(1), valid.sum(1), mode, cap)
    out = valid.to(log_rho.dtype) if weight is None else weight * valid
    return out if dropped is None else out.masked_fill(dropped, 0.0)


@register_loss_term("rollout_correction", options=RolloutCorrectionOptions, stage="keep", flat=True,
                    needs=("rollout_logp",), when=lambda options: options.rollout_correction is not None)
def rollout_correction(state: LossState, options: RolloutCorrectionOptions) -> LossState:
    """Rollout correction ρ = π_old/π_rollout: a weight, a drop or both, per token or per sequence."""
    if state.rollout_logp is None:
        return state
    with torch.no_grad():                                         # ρ is data
        log_rho = state.old_logp - state.rollout_logp             # 0 off the mask
        row_sums = log_rho.sum(dim=1)
        row_log_rho = row_sums / state.row_tokens.clamp(min=1)
        metrics = {"ppl_gap": ppl_gap_of_rows(row_log_rho, state.row_tokens > 0),           # OTB eq. 68
                   "mismatch_kl": (kl_estimate(log_rho, "k3").sum(), state.n_tokens)}
        mode = options.rollout_correction                         # None: the metrics alone
        weight, dropped = (None, None) if mode is None else correction(log_rho, row_sums, state.row_tokens, mode,
                                                                       options.rollout_cap)
        if dropped is not None:
            count = state.valid if dropped.shape[1] > 1 else state.row_tokens[:, None]
            metrics["is_masked_frac"] = (dropped * count).sum(), state.n_tokens
    if weight is not None:
        state = state.scaled(weight)
    if dropped is not None:
        state = dataclasses.replace(state, keep=state.keep & ~dropped)
    return state.with_metrics(**metrics)
