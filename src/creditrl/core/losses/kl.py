"""KL penalty to a frozen reference policy (a loss term).

ℓ_t ← ℓ_t + β·k(x_t) with x_t = log π_ref(y_t) − log π_θ(y_t) at samples of π_θ, an estimate of
KL(π_θ‖π_ref) (Schulman's k1/k2/k3, ``diagnostics.kl_estimate``; k3 clamps x to ±20).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from creditrl.core.losses.diagnostics import KL_ESTIMATORS, kl_estimate
from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_choice, check_range


@dataclass(frozen=True)
class KLOptions:
    """Coefficient β and estimator of the KL penalty."""

    kl_coef: float = field(default=0.0, metadata={
        "help": "β of the KL penalty to the reference policy (> 0 needs ref_logp: a frozen reference model)"})
    kl_estimator: Literal[KL_ESTIMATORS] = field(default="k3", metadata={"help": "KL estimator: k1, k2 or k3"})

    def __post_init__(self):
        check_range("kl_coef", self.kl_coef, 0.0)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)


@register_loss_term("kl", options=KLOptions, stage="penalty", flat=True, needs=("ref_logp",),
                    when=lambda options: options.kl_coef > 0)
def kl(state: LossState, options: KLOptions) -> LossState:
    """KL penalty ℓ_t += β·k(log π_ref − log π_θ), k1/k2/k3 (Schulman's estimators of KL(π_θ‖π_ref)).

    Metric ``ref_kl``: the estimate's mean over valid tokens, whenever ``ref_logp`` is given."""
    if state.ref_logp is None:
        return state
    if options.kl_coef > 0:
        penalty = kl_estimate(state.ref_logp - state.logp, options.kl_estimator)
        ref_kl = penalty.detach().sum() / state.n_valid
        state = state.add_token_loss(options.kl_coef * penalty)
    else:
        with torch.no_grad():
            ref_kl = kl_estimate(state.ref_logp - state.logp, options.kl_estimator).sum() / state.n_valid
    return state.with_metrics(ref_kl=ref_kl)
