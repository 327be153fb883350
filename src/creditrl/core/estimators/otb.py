"""The Optimal Token Baseline (Li et al., OTB paper eq. 8/42) and its isolated-energy variant (eq. 52).

    A_t^(i) = G_t^(i) - B_t,   B_t = sum_i G_t^(i) W_t^(i) / sum_i W_t^(i)   over the group's live members

with W_t = sum_{j<=t} w_j the cumulative energy (``otb``) or W_t = w_t (``otb_isolated``),
w_t = ||e_{y_t} - pi_t||^2 (eq. 7; rho_bar_t^2 w_t off-policy, App. D eq. 58-60).
Step t is the t-th *valid* token of each response; a member whose response has fewer valid
tokens drops out of the baseline at later steps. Where the live energies sum to 0 the plain
mean of the live members' returns is used. A step with a single live member (and so every
step of a singleton group) gets advantage 0.

Valid tokens are compacted to the left ([B,T] -> [B,L]; right-padded batches are their own
compacted view) and per-group sums are one reduction each (a [G,N,L] view when groups are
contiguous blocks, else a scatter-add): O(B·T) time and memory, no loop over steps or groups.
"""
from __future__ import annotations

import torch
from torch import Tensor

from creditrl.core.estimators.baselines import weighted_mean_or_plain
from creditrl.core.estimators.registry import AdvantageBatch, register_estimator


def token_baseline_advantage(batch: AdvantageBatch, *, cumulative: bool) -> Tensor:
    """G_t - B_t for every valid token, [B, T] float32 (see module docstring)."""
    steps, groups = batch.steps, batch.groups
    valid = steps.valid                                              # [B, L] 1/0
    if cumulative:  # masked energies never enter: right padding puts them after the last valid
        # step, and compaction drops them; the product with valid ends each member at its length
        weights = steps.compact(batch.raw_energy, masked=True).cumsum(1).mul_(valid)
    else:
        weights = steps.compact(batch.raw_energy)                    # 0 past each length
    if batch.constant_returns:                                       # G_t = R: sums in one pass each
        returns = batch.rewards[:, None]                             # [B, 1]
        by_reward = torch.stack([batch.rewards, torch.ones_like(batch.rewards)], 1)  # [B, 2]: R, 1
        weighted, weight_sum = groups.weighted_sums(by_reward, weights).unbind(1)    # Σ W R, Σ W
        plain, count = groups.weighted_sums(by_reward, valid).unbind(1)              # Σ R, live members
    else:
        returns = steps.compact(batch.returns, masked=True)          # [B, L], 0 past each length
        weighted, weight_sum = groups.sum(weights * returns), groups.sum(weights)
        plain, count = groups.sum(valid * returns), groups.sum(valid)
    # the plain mean where the energies sum to 0, and at steps with one live member, whose
    # baseline is then exactly its own return (advantage exactly 0: no baseline information)
    baseline = weighted_mean_or_plain(weighted, torch.where(count > 1, weight_sum, 0.0), plain, count)
    return steps.expand(groups.subtract(returns, baseline).mul_(valid))


@register_estimator("otb", needs_energy=True, masked_output=True)
def otb(batch: AdvantageBatch) -> Tensor:
    """OTB (eq. 8/42): baseline weighted by the cumulative energy W_t = sum_{j<=t} w_j, [B,T]."""
    return token_baseline_advantage(batch, cumulative=True)


@register_estimator("otb_isolated", needs_energy=True, masked_output=True)
def otb_isolated(batch: AdvantageBatch) -> Tensor:
    """OTB with isolated energies (eq. 52): baseline weighted by w_t alone, [B,T]."""
    return token_baseline_advantage(batch, cumulative=False)
