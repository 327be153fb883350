"""MaxRL (Tajwar et al. 2026, arXiv 2602.02710): the group-centred reward divided by the group mean.

    A_i = (R_i - mean_g R) / mean_g R

as prime-rl (``orchestrator/algo/max_rl.py``, ``MaxRLAlgorithm.score_group``) and SkyRL
(``ppo_utils.compute_maxrl_advantage``, there with ``+ 1e-6`` in the denominator) define it. For
binary rewards with K successes among N, mean_g R = p̂ = K/N and A_i = R_i / p̂ - 1: the policy
gradient Σ_i A_i ∇log π(y_i) is the average ∇log π over the successes minus the average over all
responses, the unbiased gradient of the order-N truncation of the maximum-likelihood objective
log p (a success on a hard prompt weighs 1/p̂). Rewards are assumed non-negative (canonically
binary).

Defined everywhere, finite: a group whose mean reward is <= 0 (for non-negative rewards: every
reward 0, nothing to learn) gets A = 0, prime-rl's rule, where SkyRL's (R - 0)/(0 + 1e-6) gives 0 for
all-zero rewards and up to 1e6·R for signed rewards that average to 0; a singleton gets 0 (no
baseline information; SkyRL keeps its R). No epsilon: for positive means the advantage is
exactly (R - mean)/mean, in float64.
"""
from __future__ import annotations

import torch
from torch import Tensor

from creditrl.core.estimators.baselines import drop_singletons
from creditrl.core.estimators.registry import AdvantageBatch, register_estimator


@register_estimator("maxrl")
def maxrl(batch: AdvantageBatch) -> Tensor:
    """MaxRL (Tajwar et al. 2026): A = (R - mean_g R) / mean_g R; 0 where mean_g R <= 0, [B]."""
    r = batch.rewards.to(torch.float64)
    mean = batch.groups.mean(r)
    positive = mean > 0
    adv = torch.where(positive, (r - mean) / torch.where(positive, mean, 1.0), 0.0)
    return drop_singletons(adv, batch.groups)
