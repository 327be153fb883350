"""The Optimal Token Baseline (Li et al., OTB paper eq. 8/42) and its isolated-energy variant (eq. 52).

    A_t^(i) = G_t^(i) - B_t,   B_t = sum_i G_t^(i) W_t^(i) / sum_i W_t^(i)   over the group's live members

with W_t = sum_{j<=t} w_j the cumulative energy (``otb``) or W_t = w_t (``otb_isolated``),
w_t = ||e_{y_t} - pi_t||^2 (eq. 7; rho_bar_t^2 w_t off-policy, App. D eq. 58-60).
Step t is the t-th *valid* token of each response; a member whose response has fewer valid
tokens drops out of the baseline at later steps. Where the live energies sum to 0 the plain
mean of the live members' returns is used. A step with a single live member (and so every
step of a singleton group) gets advantage 0.

``leave_one_out=True`` (both estimators): response i's baseline uses only the other members,

    B_t^(-i) = sum_{j!=i} G_t^(j) W_t^(j) / sum_{j!=i} W_t^(j)   over the other members alive at step t,

unbiased because it does not depend on response i. The paper's leave-in form is exactly
A_t = (1 - omega_t) A_t^LOO with omega_t = W_t^(i) / sum_j W_t^(j), response i's own share of the
step's weights (``baselines`` module docstring): biased toward zero by a factor that depends on the
response's own tokens. At a fork (a high-energy token) the forking response holds most of the
isolated weight w_t, so ``otb_isolated`` drops most of the credit exactly at the decisions. Where
the other live members' weights sum to 0: the plain mean of their returns. At steps no other member
reaches (i is the longest): the plain mean of the other members' final returns G^(j) at their last
valid step (their R for outcome rewards) — a baseline from the others alone, so the estimator stays
unbiased with variable lengths (advantage 0 there, as in the leave-in form, would drop those
tokens' credit and bias it). With no other non-empty member (a singleton group) the advantage is 0.

Valid tokens are compacted to the left ([B,T] -> [B,L]; right-padded batches are their own
compacted view) and per-group sums are one reduction each (a [G,N,L] view when groups are
contiguous blocks, else a scatter-add): O(B·T) time and memory, no loop over steps or groups.
"""
from __future__ import annotations

import torch
from torch import Tensor

from creditrl.core.estimators.baselines import LeaveOneOut, weighted_mean_or_plain
from creditrl.core.estimators.registry import AdvantageBatch, register_estimator


def step_weights(batch: AdvantageBatch, cumulative: bool) -> Tensor:
    """[B, L] float32 weights per valid step: W_t = sum_{j<=t} w_j (``cumulative``) or w_t; 0 past each length."""
    steps = batch.steps
    if cumulative:  # masked energies never enter: right padding puts them after the last valid
        # step, and compaction drops them; the product with valid ends each member at its length
        return steps.compact(batch.raw_energy, masked=True).cumsum(1).mul_(steps.valid)
    return steps.compact(batch.raw_energy)                           # 0 past each length


def token_baseline_advantage(batch: AdvantageBatch, *, cumulative: bool) -> Tensor:
    """G_t - B_t for every valid token, [B, T] float32 (see module docstring)."""
    steps, groups = batch.steps, batch.groups
    valid = steps.valid                                              # [B, L] 1/0
    weights = step_weights(batch, cumulative)
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
    # into the weights' buffer, dead now: a fresh [B, L] result costs its page faults on a CPU
    return steps.expand(groups.subtract(returns, baseline, out=weights).mul_(valid))


def token_loo_advantage(batch: AdvantageBatch, *, cumulative: bool) -> Tensor:
    """G_t - B_t^(-i) for every valid token, [B, T] float64 (see module docstring).

    B^(-i) comes from the others' sums alone (``GroupIndex.exclusive_sum``: no cancellation residue
    is ever divided by, and its float32 rounding depends on the others only); G_t - B^(-i) is taken
    in float64, so rounding adds no term that correlates with response i's own return."""
    steps, groups = batch.steps, batch.groups
    valid = steps.valid                                              # [B, L] 1/0
    weights = step_weights(batch, cumulative)
    if batch.constant_returns:
        returns = batch.rewards[:, None].expand_as(valid)
    else:
        returns = steps.compact(batch.returns, masked=True)
    weighted, weight_sum, plain, count = groups.exclusive_sum(
        torch.stack([weights * returns, weights, valid * returns, valid], -1)).unbind(-1)
    alive = batch.lengths > 0                                        # members with a final return
    last = (batch.lengths - 1).clamp(min=0)[:, None]
    final = torch.stack([returns.gather(1, last)[:, 0] * alive, alive.to(returns.dtype)], -1)
    final_sum, others = groups.exclusive_sum(final).unbind(-1)      # the others' final returns, count
    ended = (final_sum / others.clamp(min=1))[:, None].expand_as(valid)
    baseline = torch.where(count > 0, weighted_mean_or_plain(weighted, weight_sum, plain, count), ended)
    informed = (others > 0).to(torch.float64)[:, None]               # no other non-empty member: 0
    advantage = (returns.to(torch.float64) - baseline).mul_(valid).mul_(informed)
    return steps.expand(advantage)


@register_estimator("otb", needs_energy=True, token_level=True, masked_output=True)
def otb(batch: AdvantageBatch, *, leave_one_out: LeaveOneOut = False) -> Tensor:
    """OTB (eq. 8/42): baseline weighted by the cumulative energy W_t = sum_{j<=t} w_j, [B,T].

    ``leave_one_out``: B_t^(-i) from the other members only (unbiased); the leave-in form is
    A_t = (1 - omega_t) A_t^LOO, omega_t = W_t^(i) / sum_j W_t^(j), biased toward zero (module docstring)."""
    if leave_one_out:
        return token_loo_advantage(batch, cumulative=True)
    return token_baseline_advantage(batch, cumulative=True)


@register_estimator("otb_isolated", needs_energy=True, token_level=True, masked_output=True)
def otb_isolated(batch: AdvantageBatch, *, leave_one_out: LeaveOneOut = False) -> Tensor:
    """OTB with isolated energies (eq. 52): baseline weighted by w_t alone, [B,T].

    ``leave_one_out``: B_t^(-i) from the other members only (unbiased); the leave-in form is
    A_t = (1 - omega_t) A_t^LOO, omega_t = w_t^(i) / sum_j w_t^(j), biased toward zero: most at the
    forks, where the forking response holds most of the step's weight (module docstring)."""
    if leave_one_out:
        return token_loo_advantage(batch, cumulative=False)
    return token_baseline_advantage(batch, cumulative=False)
