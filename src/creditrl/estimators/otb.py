"""The Optimal Token Baseline (Li et al., OTB paper eq. 8/42) and its isolated-energy variant (eq. 52).

    A_t^(i) = G_t^(i) - B_t,   B_t = sum_i G_t^(i) W_t^(i) / sum_i W_t^(i)   over the group's live members

with W_t = sum_{j<=t} w_j the cumulative energy (``otb``) or W_t = w_t (``otb_isolated``),
w_t = ||e_{y_t} - pi_t||^2 (eq. 7; rho_bar_t^2 w_t off-policy, App. D eq. 58-60).
Step t is the t-th *valid* token of each response; a member whose response has fewer valid
tokens drops out of the baseline at later steps. Where the live energies sum to 0 the plain
mean of the live members' returns is used. A step with a single live member (and so every
step of a singleton group) gets advantage 0.

Rows are reordered so each group is contiguous, valid tokens are compacted to the left
([B,T] -> [B,L]), and per-group sums are segment reductions: O(B·T) time and memory, no
loop over steps or groups.
"""
from __future__ import annotations

import torch
from torch import Tensor

from creditrl.estimators.baselines import weighted_mean_or_plain
from creditrl.estimators.registry import AdvantageBatch, register_estimator
from creditrl.estimators.steps import StepIndex


def token_baseline_advantage(batch: AdvantageBatch, *, cumulative: bool) -> Tensor:
    """G_t - B_t for every valid token, [B, T] float32 (see module docstring)."""
    sizes = batch.groups.sizes
    order = torch.sort(batch.groups.dense, stable=True).indices      # group-contiguous rows

    def group_sum(x: Tensor) -> Tensor:                              # [B, L] -> [G, L]
        return torch.segment_reduce(x, "sum", lengths=sizes, axis=0)

    steps = StepIndex.from_mask(batch.mask.index_select(0, order))
    live = steps.live()
    weights = steps.compact(batch.energy.index_select(0, order))
    if cumulative:
        weights = weights.cumsum(1).mul_(live)                       # members drop out past their end
    if batch.token_level:
        returns = steps.compact(batch.returns.index_select(0, order))   # 0 past each length
        plain_sum = group_sum(returns)
    else:
        returns = batch.rewards.index_select(0, order)[:, None]
        plain_sum = group_sum(live * returns)
    count = group_sum(live.to(returns.dtype))
    baseline = weighted_mean_or_plain(group_sum(weights * returns), group_sum(weights), plain_sum, count)
    keep = live & (count > 1).repeat_interleave(sizes, dim=0)
    adv = steps.expand(torch.sub(returns, baseline.repeat_interleave(sizes, dim=0)).mul_(keep))
    return torch.empty_like(adv).index_copy_(0, order, adv)


@register_estimator("otb", needs_energy=True)
def otb(batch: AdvantageBatch) -> Tensor:
    """OTB (eq. 8/42): baseline weighted by the cumulative energy W_t = sum_{j<=t} w_j, [B,T]."""
    return token_baseline_advantage(batch, cumulative=True)


@register_estimator("otb_isolated", needs_energy=True)
def otb_isolated(batch: AdvantageBatch) -> Tensor:
    """OTB with isolated energies (eq. 52): baseline weighted by w_t alone, [B,T]."""
    return token_baseline_advantage(batch, cumulative=False)
