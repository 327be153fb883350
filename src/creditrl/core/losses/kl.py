"""KL penalty to a frozen reference policy (a loss term).

ℓ_t ← ℓ_t + β·k(x_t) with x_t = log π_ref(y_t) − log π_θ(y_t) at samples of π_θ, an estimate of
KL(π_θ‖π_ref) (Schulman's k1/k2/k3, ``diagnostics.kl_estimate``; k3 clamps x to ±20, and its value
is not capped: verl's ``kl_penalty`` caps k3 at 10, where its gradient is then 0).

The gradient of k1 or k3 is not an estimate of ∇KL (E_π[∇k3] = E_π[(1 − e^x)∇log π] is the
gradient of the forward KL); two corrections make it one:
    "k1+", "k3+" (verl's straight-through estimator): the value of k1/k3, the gradient of
               k2 = ½x², (log π_θ − log π_ref)·∇log π_θ, unbiased for ∇KL(π_θ‖π_ref) on-policy;
    kl_bias_correction (TRL's ``use_bias_correction_kl``, DeepSeek-V3.2): the penalty times the
               token ratio r_t = π_θ/π_old, with its gradient: ∇(r·k) = r·(∇k + k·∇log π_θ), whose
               expectation under π_old is E_π[∇k + k·∇log π_θ] = ∇E_π[k]: ∇KL for k1 and k3, whose
               values are unbiased for KL, off-policy too (samples from π_old); not for k2, whose
               value E_π[½x²] is not KL (k2 with the correction is the gradient of that, biased).
Both together ("k1+"/"k3+" with kl_bias_correction): the value r·k, the gradient of the
straight-through term weighted by r without its gradient, r·(log π_θ − log π_ref)·∇log π_θ, the
importance-weighted ∇KL. Multiplying the straight-through term by r with its gradient would add
r·k·∇log π_θ, whose expectation E_π[k·∇log π_θ] is not 0: biased even on-policy. The ratio is
always the token's, also under ``gspo`` (TRL's sequence level broadcasts the sequence ratio onto the
per-token KL, which its docs say is not unbiased).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from creditrl.core.losses.diagnostics import clamp_log_ratio, kl_estimate
from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_choice, check_range

KL_PENALTIES = ("k1", "k2", "k3", "k1+", "k3+")


@dataclass(frozen=True)
class KLOptions:
    """Coefficient β, estimator and bias correction of the KL penalty."""

    kl_coef: float = field(default=0.0, metadata={
        "help": "β of the KL penalty to the reference policy (> 0 needs ref_logp: a frozen reference model)"})
    kl_estimator: Literal[KL_PENALTIES] = field(default="k3", metadata={
        "help": "KL estimator: k1, k2, k3, or k1+/k3+ (their value, k2's gradient: verl's unbiased KL gradient)"})
    kl_bias_correction: bool = field(default=False, metadata={
        "help": "multiply the penalty by the ratio π_θ/π_old (TRL's use_bias_correction_kl): with its gradient for "
                "k1/k3, the unbiased KL gradient off-policy too; for k1+/k3+ its value weighs k2's gradient, unbiased "
                "too; k2 stays biased"})

    def __post_init__(self):
        check_range("kl_coef", self.kl_coef, 0.0)
        check_choice("kl_estimator", self.kl_estimator, KL_PENALTIES)
        if not isinstance(self.kl_bias_correction, bool):
            raise TypeError(f"kl_bias_correction: expected a bool, got {type(self.kl_bias_correction).__name__} "
                            f"{self.kl_bias_correction!r}")


def kl_penalty(state: LossState, options: KLOptions) -> torch.Tensor:
    """β-free per-token penalty [B,T] (module docstring), on the graph of ``state.logp``."""
    x = state.ref_logp - state.logp
    value = kl_estimate(x, options.kl_estimator.rstrip("+"))
    ratio = clamp_log_ratio(state.logp - state.old_logp).exp() if options.kl_bias_correction else None
    if not options.kl_estimator.endswith("+"):
        return value if ratio is None else value * ratio
    k2 = 0.5 * x.square()
    straight_through = k2 - k2.detach()                          # 0 in value, k2's gradient
    if ratio is None:
        return straight_through + value.detach()
    # the weight without its gradient: r's own gradient would add the biased r·k·∇log π (docstring)
    return ratio.detach() * straight_through + (ratio * value).detach()


@register_loss_term("kl", options=KLOptions, stage="penalty", flat=True, needs=("ref_logp",),
                    when=lambda options: options.kl_coef > 0)
def kl(state: LossState, options: KLOptions) -> LossState:
    """KL penalty ℓ_t += β·k(log π_ref − log π_θ), k1/k2/k3, k1+/k3+, optionally times r (Schulman; verl; TRL).

    Metric ``ref_kl``: the penalty's mean over valid tokens (its value: the estimate, times the
    ratio under ``kl_bias_correction``), whenever ``ref_logp`` is given."""
    if state.ref_logp is None:
        return state
    if options.kl_coef > 0:
        penalty = kl_penalty(state, options)
        ref_kl = penalty.detach().sum(), state.n_tokens
        state = state.add_token_loss(options.kl_coef * penalty)
    else:
        with torch.no_grad():
            ref_kl = kl_penalty(state, options).sum(), state.n_tokens
    return state.with_metrics(ref_kl=ref_kl)
