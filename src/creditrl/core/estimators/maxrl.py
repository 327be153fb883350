"""MaxRL (Tajwar et al. 2026, arXiv 2602.02710): the group-centred reward divided by the group mean.

    A_i = (R_i - mean_g R) / mean_g R

as prime-rl (``orchestrator/algo/max_rl.py``, ``MaxRLAlgorithm.score_group``) and SkyRL
(``ppo_utils.compute_maxrl_advantage``, there with ``+ 1e-6`` in the denominator) define it. For
binary rewards with K successes among N, mean_g R = p̂ = K/N and A_i = R_i / p̂ - 1: the policy
gradient Σ_i A_i ∇log π(y_i) is N times the average ∇log π over the successes minus the sum over all
responses where K >= 1, and 0 where K = 0 (a success on a hard prompt weighs 1/p̂). Its expectation,
divided by N, is the gradient of the order-(N-1) truncation of the maximum-likelihood objective
log p, J_{N-1} = -Σ_{k<=N-1} (1-p)^k / k (not J_N: the all-fail groups' A = 0 drops the mean score's
share there; checked by exact enumeration in the tests), as in prime-rl and SkyRL.

Rewards must be >= 0 (canonically 1 = success, 0 = failure): mean_g R stands for the success rate
p̂, so a negative reward (±1 rewards, a length penalty) is refused, naming its row. Under ±1
rewards every group with p̂ <= 1/2 would have a mean <= 0, and nothing to learn from the very
prompts MaxRL up-weights; a mean just above 0 would divide by nearly 0.

Defined on every batch of rewards >= 0, finite: a group whose rewards are all 0 gets A = 0 (nothing to
learn), prime-rl's rule, where SkyRL's (R - 0)/(0 + 1e-6) gives 0 there too; a singleton gets 0
(no baseline information; SkyRL keeps its R). No epsilon: for positive means the advantage is
exactly (R - mean)/mean, in float64.
"""
from __future__ import annotations

import torch
from torch import Tensor

from creditrl.core.estimators.baselines import drop_singletons
from creditrl.core.estimators.registry import AdvantageBatch, register_estimator


@register_estimator("maxrl")
def maxrl(batch: AdvantageBatch) -> Tensor:
    """MaxRL (Tajwar et al. 2026): A = (R - mean_g R) / mean_g R; 0 where every reward is 0, [B].
    Rewards must be >= 0 (ValueError naming the first negative one's row)."""
    r = batch.rewards.to(torch.float64)
    negative = r < 0
    if bool(negative.any()):
        row = int(torch.nonzero(negative)[0, 0])
        raise ValueError(f"rewards: maxrl needs rewards >= 0 (1 = success, 0 = failure: it divides by the group's "
                         f"mean reward as its success rate), got {float(r[row]):.6g} in row {row} "
                         f"({int(negative.sum())} negative in all); map them to [0, 1] first")
    mean = batch.groups.mean(r)
    positive = mean > 0
    adv = torch.where(positive, (r - mean) / torch.where(positive, mean, 1.0), 0.0)
    return drop_singletons(adv, batch.groups)
