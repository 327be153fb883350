"""The James–Stein shrinkage baseline (Zeng, Zhou, Arora, Zanette 2025, arXiv 2511.03710).

The baseline of a response mixes its prompt's mean reward with the mean over the batch's prompts,

    b_i = (1 - λ) μ̂_g + λ μ̄,     λ = v² / (v² + s²),

with the data-driven shrinkage factor λ (Stein's paradox: with several prompts, pulling each
per-prompt mean toward their common mean lowers the total squared error of the estimates, most in
the few-samples-per-prompt regime of RLVR):

    μ̂_g = mean of group g's rewards,  μ̄ = mean over the prompts of μ̂_g,
    v²  = mean over the prompts of σ̂_g² / N_g   (σ̂_g² with N_g - 1: the noise of each μ̂_g),
    s²  = mean over the prompts of (μ̂_g - μ̄)²   (the spread of the μ̂_g around μ̄).

``leave_one_out=True`` is the paper's construction, a two-level leave-one-out as the authors' code
computes it (JSPO-Official ``core_algos.compute_jspo_outcome_advantage``): μ̂_g becomes the mean of
the *other* members of i's group (RLOO's baseline), and μ̄, v², s², λ come from the *other* prompts
only, so b_i does not depend on R_i and the policy gradient stays unbiased; with no other prompt λ = 0
(RLOO). The default leave-in form uses every prompt and i's own group mean, the drop-in analogue of
``dr_grpo``'s leave-in mean (with one prompt in the batch λ = 1 and b = μ̂_g: it is ``dr_grpo``).

Prompts are the groups of 2 or more responses; singletons get advantage 0 and stay out of the
statistics. Every prompt weighs the same in μ̄, v² and s² (the authors' code assumes equal group
sizes, where the mean over all responses of other prompts is the same number). λ = 0 where
v² + s² = 0 (every prompt's rewards equal and the same). All in float64.
"""
from __future__ import annotations

import torch
from torch import Tensor

from creditrl.core.estimators.baselines import LeaveOneOut, drop_singletons
from creditrl.core.estimators.registry import AdvantageBatch, register_estimator
from creditrl.core.groups import GroupIndex


def prompt_statistics(r: Tensor, groups: GroupIndex) -> tuple[Tensor, Tensor, Tensor]:
    """Per group [G] float64: μ̂_g, σ̂_g² / N_g (sample variance, N_g - 1), and whether the group is a
    prompt of the statistics (N_g >= 2)."""
    sizes = groups.sizes.to(torch.float64)
    means = groups.sum(r) / sizes
    dev = groups.subtract(r, means)
    noise = groups.sum(dev * dev) / (sizes - 1).clamp(min=1) / sizes
    return means, noise, groups.sizes >= 2


def shrinkage_factor(noise: Tensor, spread: Tensor) -> Tensor:
    """λ = v² / (v² + s²), 0 where both are 0."""
    total = noise + spread
    return torch.where(total > 0, noise / torch.where(total > 0, total, 1.0), 0.0)


def leave_in_baseline(r: Tensor, groups: GroupIndex) -> Tensor:
    """b_i = (1 - λ) μ̂_g + λ μ̄ from every prompt, [B] float64."""
    means, noise, prompt = prompt_statistics(r, groups)
    count = prompt.sum().clamp(min=1)
    grand = (means * prompt).sum() / count
    lam = shrinkage_factor((noise * prompt).sum() / count, ((means - grand).square() * prompt).sum() / count)
    return groups.gather((1 - lam) * means + lam * grand)


def leave_one_out_baseline(r: Tensor, groups: GroupIndex) -> Tensor:
    """b_i = (1 - λ_-g) RLOO_i + λ_-g μ̄_-g, the statistics from the prompts other than i's, [B] float64.

    Σ_{h≠g} (μ̂_h - μ̄_-g)² = D - K/(K-1) (μ̂_g - M)² with M, D the mean and the centred sum of squares of
    all K prompts' means: one pass, no loop over prompts."""
    means, noise, prompt = prompt_statistics(r, groups)
    p = prompt.to(torch.float64)
    k = p.sum()
    others = (k - p).clamp(min=1)                          # other prompts of each group
    grand = (means * p).sum() / k.clamp(min=1)
    centred_sq = ((means - grand).square() * p).sum()
    other_grand = ((means * p).sum() - means * p) / others
    other_noise = ((noise * p).sum() - noise * p) / others
    other_spread = (centred_sq - p * k / others * (means - grand).square()).clamp(min=0) / others
    lam = torch.where(k - p > 0, shrinkage_factor(other_noise, other_spread), 0.0)
    sizes = groups.member_sizes().to(torch.float64)
    rloo = groups.exclusive_sum(r) / (sizes - 1).clamp(min=1)
    return (1 - groups.gather(lam)) * rloo + groups.gather(lam * other_grand)


@register_estimator("shrinkage", batch_level=True)
def shrinkage(batch: AdvantageBatch, *, leave_one_out: LeaveOneOut = False) -> Tensor:
    """James–Stein shrinkage baseline (arXiv 2511.03710): A = R - [(1 - λ) μ̂_g + λ μ̄], [B].

    ``leave_one_out``: the paper's two-level leave-one-out form (RLOO mean of the other members,
    λ and μ̄ from the other prompts: unbiased); the default leave-in form uses i's group mean and
    every prompt (module docstring)."""
    r = batch.rewards.to(torch.float64)
    baseline = (leave_one_out_baseline if leave_one_out else leave_in_baseline)(r, batch.groups)
    return drop_singletons(r - baseline, batch.groups)
