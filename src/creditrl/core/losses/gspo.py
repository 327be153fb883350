"""GSPO: the sequence-level importance ratio, with a per-token gradient (a "ratio" loss term).

GSPO (Zheng et al. 2025, arXiv 2507.18071) replaces the token ratio by the response's
length-normalised ratio s_b = (π_θ(y_b)/π_old(y_b))^{1/|y_b|} = exp(mean_t z_bt) and clips s_b
instead of r_t. Its GSPO-token form writes it per token so that each token keeps its own
gradient path:

    log s_bt = sg(mean_{t∈κ_b} z_bt) + z_bt − sg(z_bt),   clamped above at 10

(value log s_b on every token, gradient ∇z_bt; the clamp is verl's, for stability, and passes no
gradient where it binds to the ratio surrogates; the REINFORCE-form ones, CISPO and DPPO, detach
the ratio's value and keep ∇z_bt there: ``LossState.score_route``). The term rewrites the state's
log-ratio, so whatever surrogate follows sees s_b: the PPO clip by default (verl's and TRL's
``gspo`` / ``importance_sampling_level="sequence"``), or CISPO, SAPO, ... (TRL composes the
sequence ratio with every ``loss_type`` the same way; its KL bias correction then weighs the KL by
the sequence ratio, creditrl's by the token ratio, ``kl.py``). The mean runs over the kept tokens (verl:
``response_mask``). GSPO's paper aggregates with ``seq-mean-token-mean``; verl and TRL let the
aggregation be chosen, as here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from creditrl.core.losses.terms import LossState, register_loss_term

GSPO_MAX_LOG_RATIO = 10.0   # verl's clamp of log s (core_algos.compute_policy_loss_gspo)


@dataclass(frozen=True)
class GspoOptions:
    """GSPO has no options of its own: the surrogate's clip bounds apply to s_b."""


@register_loss_term("gspo", options=GspoOptions, stage="ratio")
def gspo(state: LossState, options: GspoOptions) -> LossState:
    """GSPO's sequence ratio: log s_bt = sg(mean_t z_bt) + z_bt − sg(z_bt), ≤ 10 (GSPO-token).

    Metric ``seq_log_ratio_abs``: mean over responses with a kept token of |log s_b|."""
    keep_f = state.keep_f
    rows = keep_f.sum(dim=1, keepdim=True)
    z = state.log_ratio
    seq = (z.detach() * keep_f).sum(dim=1, keepdim=True) / rows.clamp(min=1)
    route = z - z.detach() + seq                     # off valid its value is seq, finite: only its gradient is read
    log_ratio = route.clamp(max=GSPO_MAX_LOG_RATIO) * state.valid_f
    has = (rows > 0).to(seq.dtype)
    metric = (seq.abs() * has).sum(), has.sum()
    return dataclasses.replace(state, log_ratio=log_ratio, score_route=(log_ratio, route)).with_metrics(
        seq_log_ratio_abs=metric)
