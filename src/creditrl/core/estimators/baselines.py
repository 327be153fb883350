"""Sequence-level group baselines: REINFORCE, GRPO, Dr.GRPO, RLOO, OPO and OGB.

Per group g of size N, with R the response's sequence reward. Each function returns [B]
(``compute_advantages`` broadcasts it to the response's valid tokens), except ``reinforce``,
which returns the returns-to-go [B,T]. A singleton group carries no baseline information:
every estimator here gives it 0, except ``reinforce``. Group statistics run in float64.
"""
from __future__ import annotations


from typing import Annotated

import torch
from torch import Tensor

from creditrl.utils.validate import check_range
from creditrl.core.estimators.registry import AdvantageBatch, register_estimator
from creditrl.core.groups import GroupIndex


def weighted_mean_or_plain(weighted_sum: Tensor, weight_sum: Tensor, plain_sum: Tensor, count: Tensor) -> Tensor:
    """sum w v / sum w, or the plain mean sum v / count where the weights sum to 0.

    Where the energies are all 0 (every token certain) the plain mean is the right baseline;
    dividing by a tiny eps there would set it to 0 and bias the gradient (verl does this).
    """
    safe = torch.where(weight_sum > 0, weight_sum, torch.ones_like(weight_sum))
    return torch.where(weight_sum > 0, weighted_sum / safe, plain_sum / count.clamp(min=1))


def weighted_baseline(values: Tensor, weights: Tensor, groups: GroupIndex) -> Tensor:
    """Per-member group baseline sum_i w_i v_i / sum_i w_i, [B] (plain mean where sum w = 0)."""
    count = groups.sizes.to(values.dtype)
    return groups.gather(weighted_mean_or_plain(groups.sum(weights * values), groups.sum(weights),
                                                groups.sum(values), count))


def drop_singletons(adv: Tensor, groups: GroupIndex) -> Tensor:
    """Advantage 0 for members of size-1 groups (no baseline information)."""
    single = (groups.member_sizes() == 1).reshape((-1,) + (1,) * (adv.dim() - 1))
    return torch.where(single, torch.zeros_like(adv), adv)


def group_std(values: Tensor, groups: GroupIndex) -> Tensor:
    """Per-member sample std (N-1) of ``values`` [B] within its group; 0 for singletons."""
    dev = values - groups.mean(values)
    var = groups.gather(groups.sum(dev * dev)) / (groups.member_sizes() - 1).clamp(min=1)
    return var.sqrt()


def centred(batch: AdvantageBatch) -> Tensor:
    """R - mean_g R in float64, [B]."""
    r = batch.rewards.to(torch.float64)
    return r - batch.groups.mean(r)


@register_estimator("reinforce", masked_output=True)
def reinforce(batch: AdvantageBatch) -> Tensor:
    """REINFORCE (Williams 1992): A_t = G_t, the return-to-go, [B,T]. No baseline, singletons kept."""
    return batch.returns


@register_estimator("dr_grpo")
def dr_grpo(batch: AdvantageBatch) -> Tensor:
    """Dr.GRPO (Liu et al. 2025): A = R - mean_g R, [B]."""
    return drop_singletons(centred(batch), batch.groups)


@register_estimator("grpo")
def grpo(batch: AdvantageBatch, *, eps: Annotated[float, "added to the group std before dividing (> 0)"] = 1e-6
         ) -> Tensor:
    """GRPO (Shao et al. 2024): A = (R - mean_g R) / (std_g R + eps), std with N-1, [B].

    All-equal rewards give 0 (0 / eps); singletons give 0. ``eps`` must be > 0.
    """
    r = batch.rewards.to(torch.float64)
    check_range("eps", eps, 0.0, low_inclusive=False)
    return drop_singletons(centred(batch) / (group_std(r, batch.groups) + eps), batch.groups)


@register_estimator("rloo")
def rloo(batch: AdvantageBatch) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A = R - mean of the other N-1 rewards = N/(N-1) (R - mean_g R)."""
    sizes = batch.groups.member_sizes().to(torch.float64)
    return drop_singletons(centred(batch) * sizes / (sizes - 1).clamp(min=1), batch.groups)


@register_estimator("opo")
def opo(batch: AdvantageBatch) -> Tensor:
    """OPO (Hao et al. 2025): A = R - sum_i L_i R_i / sum_i L_i, L = number of valid tokens, [B].

    A group of empty responses (sum L = 0) uses the plain mean.
    """
    r = batch.rewards.to(torch.float64)
    lengths = batch.lengths.to(torch.float64)
    return drop_singletons(r - weighted_baseline(r, lengths, batch.groups), batch.groups)


@register_estimator("ogb", needs_energy=True)
def ogb(batch: AdvantageBatch) -> Tensor:
    """OGB, the sequence-level optimal baseline (OTB paper App. A.2, eq. 21), [B]:

        A = R - sum_i W_i R_i / sum_i W_i,   W_i = sum_t w_t of response i (w = rho_bar^2 w off-policy).

    Groups whose energies sum to 0 use the plain mean of R.
    """
    r = batch.rewards.to(torch.float64)
    # sum over valid tokens as a batched dot product: no masked [B,T] copy
    total_energy = torch.bmm(batch.raw_energy.unsqueeze(1), batch.valid.unsqueeze(2)).view(-1).to(torch.float64)
    return drop_singletons(r - weighted_baseline(r, total_energy, batch.groups), batch.groups)
