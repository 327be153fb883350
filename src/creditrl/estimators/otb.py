"""The Optimal Token Baseline (Li et al., OTB paper eq. 8/42) and its isolated-energy variant (eq. 52).

    A_t^(i) = G_t^(i) - B_t,   B_t = sum_i G_t^(i) W_t^(i) / sum_i W_t^(i)   over the group's live members

with W_t = sum_{j<=t} w_j the cumulative energy (``otb``) or W_t = w_t (``otb_isolated``),
w_t = ||e_{y_t} - pi_t||^2 (eq. 7; rho_bar_t^2 w_t off-policy, App. D eq. 58-60).
Step t is the t-th *valid* token of each response; a member whose response has fewer valid
tokens drops out of the baseline at later steps. Where the live energies sum to 0 the plain
mean of the live members' returns is used. A step with a single live member (and every step
of a singleton group) gets advantage 0. Work is O(B·T) memory, no loop over steps or groups.
"""
from __future__ import annotations

import torch
from torch import Tensor

from creditrl.estimators.baselines import drop_singletons, weighted_baseline
from creditrl.estimators.registry import AdvantageBatch, register_estimator
from creditrl.estimators.steps import StepIndex


def token_baseline_advantage(batch: AdvantageBatch, *, cumulative: bool) -> Tensor:
    """G_t - B_t in the valid-step view, scattered back to [B, T] float32."""
    steps = StepIndex.from_mask(batch.mask)
    returns = steps.compact(batch.returns)
    weights = steps.compact(batch.energy)
    if cumulative:
        weights = weights.cumsum(1)
    live = steps.live()
    adv = returns - weighted_baseline(returns, weights, batch.groups, live)
    lone = batch.groups.gather(batch.groups.sum(live.to(torch.int32))) <= 1
    adv = torch.where(live & ~lone, adv, torch.zeros_like(adv))
    return drop_singletons(steps.expand(adv), batch.groups)


@register_estimator("otb", needs_energy=True)
def otb(batch: AdvantageBatch) -> Tensor:
    """OTB (eq. 8/42): baseline weighted by the cumulative energy W_t = sum_{j<=t} w_j, [B,T]."""
    return token_baseline_advantage(batch, cumulative=True)


@register_estimator("otb_isolated", needs_energy=True)
def otb_isolated(batch: AdvantageBatch) -> Tensor:
    """OTB with isolated energies (eq. 52): baseline weighted by w_t alone, [B,T]."""
    return token_baseline_advantage(batch, cumulative=False)
