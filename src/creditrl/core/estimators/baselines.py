"""Sequence-level group baselines: REINFORCE, GRPO, Dr.GRPO, RLOO, OPO and OGB.

Per group g of size N, with R the response's sequence reward. Each function returns [B]
(``compute_advantages`` broadcasts it to the response's valid tokens), except ``reinforce``,
which returns the returns-to-go [B,T]. A singleton group carries no baseline information:
every estimator here gives it 0, except ``reinforce``. Group statistics run in float64.

Leave-in and leave-one-out. A weighted group baseline sum_j u_j R_j / sum_j u_j counts response
i in its own baseline. With omega_i = u_i / sum_j u_j its own share of the weights, exactly

    R_i - sum_j u_j R_j / sum_j u_j = (1 - omega_i) (R_i - sum_{j!=i} u_j R_j / sum_{j!=i} u_j),

i.e. A = (1 - omega) A^LOO. A^LOO's baseline does not depend on response i, so its policy gradient
is unbiased; the leave-in form (the papers') shrinks it toward zero by a factor that depends on the
response itself (for energy weights: on its own tokens), which changes the gradient's scale and,
unless omega is constant, its direction. ``leave_one_out=True`` gives A^LOO.
"""
from __future__ import annotations

import math
from typing import Annotated, Literal


import torch
from torch import Tensor

from creditrl.utils.validate import check_positive_float32
from creditrl.core.estimators.registry import AdvantageBatch, register_estimator
from creditrl.core.groups import GroupIndex


def weighted_mean_or_plain(weighted_sum: Tensor, weight_sum: Tensor, plain_sum: Tensor, count: Tensor) -> Tensor:
    """sum w v / sum w, or the plain mean sum v / count where the weights sum to 0.

    Where the energies are all 0 (every token certain) the plain mean is the right baseline;
    dividing by a tiny eps there would set it to 0 and bias the gradient (verl does this).
    A weight sum that overflowed to inf gives NaN, not the 0 that finite / inf would silently make
    of the baseline: the output check then names the overflow.
    """
    safe = torch.where(weight_sum > 0, weight_sum, torch.ones_like(weight_sum))
    mean = torch.where(weight_sum > 0, weighted_sum / safe, plain_sum / count.clamp(min=1))
    return mean.masked_fill_(torch.isinf(weight_sum), math.nan)


def weighted_baseline(values: Tensor, weights: Tensor, groups: GroupIndex) -> Tensor:
    """Per-member group baseline sum_i w_i v_i / sum_i w_i, [B] (plain mean where sum w = 0)."""
    count = groups.sizes.to(values.dtype)
    return groups.gather(weighted_mean_or_plain(groups.sum(weights * values), groups.sum(weights),
                                                groups.sum(values), count))


# The one declaration of the option (its help is the annotation the front ends read).
LeaveOneOut = Annotated[bool, "leave each response out of its own baseline (unbiased, A^LOO); False keeps the "
                        "paper's leave-in form A = (1 - omega) A^LOO, biased toward zero by the response's own "
                        "weight share omega"]


def loo_weighted_baseline(values: Tensor, weights: Tensor, groups: GroupIndex) -> Tensor:
    """Per-member baseline from the *other* members, sum_{j!=i} u_j v_j / sum_{j!=i} u_j, [B] float64.

    Where the others' weights sum to 0, the plain mean of the others' values. Sums come from the
    others alone (``GroupIndex.exclusive_sum``), so nothing is divided by a cancellation residue.
    Singletons get 0 (no other member; ``drop_singletons`` zeroes their advantage)."""
    values, weights = values.to(torch.float64), weights.to(torch.float64)
    others = groups.exclusive_sum(torch.stack([weights * values, weights, values], -1))
    weighted, weight_sum, plain = others.unbind(-1)
    count = (groups.member_sizes() - 1).clamp(min=1).to(torch.float64)
    return weighted_mean_or_plain(weighted, weight_sum, plain, count)


def group_weighted_baseline(values: Tensor, weights: Tensor, groups: GroupIndex, leave_one_out: bool) -> Tensor:
    """``loo_weighted_baseline`` or the leave-in ``weighted_baseline``."""
    return (loo_weighted_baseline if leave_one_out else weighted_baseline)(values, weights, groups)


def drop_singletons(adv: Tensor, groups: GroupIndex) -> Tensor:
    """Advantage 0 for members of size-1 groups (no baseline information)."""
    if groups.without_singletons:
        return adv
    single = (groups.member_sizes() == 1).reshape((-1,) + (1,) * (adv.dim() - 1))
    return torch.where(single, torch.zeros_like(adv), adv)


def group_std(values: Tensor, groups: GroupIndex, dev: Tensor | None = None) -> Tensor:
    """Per-member sample std (N-1) of ``values`` [B] within its group; 0 for singletons. ``dev``:
    the deviations ``values - mean_g values`` where the caller has them."""
    dev = groups.subtract(values, groups.group_mean(values)) if dev is None else dev
    return groups.gather((groups.sum(dev * dev) / (groups.sizes - 1).clamp(min=1)).sqrt())


def centred(batch: AdvantageBatch) -> Tensor:
    """R - mean_g R in float64, [B]."""
    r = batch.rewards.to(torch.float64)
    return batch.groups.subtract(r, batch.groups.group_mean(r))


@register_estimator("reinforce", token_level=True, masked_output=True)
def reinforce(batch: AdvantageBatch) -> Tensor:
    """REINFORCE (Williams 1992): A_t = G_t, the return-to-go. No baseline, singletons kept.

    [B], each row's R, where every valid token's G_t is R (``constant_returns``; the output contract
    broadcasts it), else [B,T]."""
    # a copy: the result must not alias the rewards (the caller's own tensor where it was float32)
    return batch.rewards.clone() if batch.constant_returns else batch.returns


@register_estimator("dr_grpo")
def dr_grpo(batch: AdvantageBatch) -> Tensor:
    """Dr.GRPO (Liu et al. 2025): A = R - mean_g R, [B]."""
    return drop_singletons(centred(batch), batch.groups)


GrpoScale = Annotated[Literal["group", "batch", "none"], "what the centred reward R - mean_g R is divided by: "
                      "`group` its group's std (GRPO), `batch` the std of every reward in the batch (TRL's "
                      "scale_rewards='batch', LitePPO), `none` nothing (Dr.GRPO)"]


@register_estimator("grpo", batch_level_when={"scale": "batch"})
def grpo(batch: AdvantageBatch, *, eps: Annotated[float, "added to the std before dividing (> 0)"] = 1e-6,
         scale: GrpoScale = "group") -> Tensor:
    """GRPO (Shao et al. 2024): A = (R - mean_g R) / (std + eps), std with N-1, [B].

    ``scale`` picks the std (TRL's ``scale_rewards``): ``group`` the group's std_g R; ``batch``
    the std of all B rewards of the batch (TRL's ``scale_rewards="batch"``: the group mean
    stays the baseline, one scale for the batch; LitePPO, Liu et al. 2025); ``none`` no division
    (= ``dr_grpo``; ``eps`` unused). All-equal rewards give 0 (0 / eps); singletons give 0 and
    count in the batch std. ``eps`` must be > 0.
    """
    r = batch.rewards.to(torch.float64)
    check_positive_float32("grpo.eps", eps)
    dev = centred(batch)
    if scale == "none":
        return drop_singletons(dev, batch.groups)
    # a batch of one response has no spread (std 0; torch would warn and give NaN); it is a singleton: A = 0
    if scale == "group":
        std = group_std(r, batch.groups, dev)
    else:
        std = r.std(unbiased=True) if r.numel() > 1 else r.new_zeros(())
    return drop_singletons(dev / (std + eps), batch.groups)


@register_estimator("rloo")
def rloo(batch: AdvantageBatch) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A = R - mean of the other N-1 rewards = N/(N-1) (R - mean_g R)."""
    sizes = batch.groups.member_sizes().to(torch.float64)
    return drop_singletons(centred(batch) * sizes / (sizes - 1).clamp(min=1), batch.groups)


@register_estimator("opo")
def opo(batch: AdvantageBatch, *, leave_one_out: LeaveOneOut = False) -> Tensor:
    """OPO (Hao et al. 2025): A = R - sum_i L_i R_i / sum_i L_i, L = number of valid tokens, [B].

    A group of empty responses (sum L = 0) uses the plain mean. ``leave_one_out``: the baseline
    sums over j != i only (the others' plain mean where their lengths sum to 0). The leave-in form
    is A = (1 - L_i / sum_j L_j) A^LOO (module docstring): biased toward zero, more for longer responses.
    """
    r = batch.rewards.to(torch.float64)
    lengths = batch.lengths.to(torch.float64)
    return drop_singletons(r - group_weighted_baseline(r, lengths, batch.groups, leave_one_out), batch.groups)


@register_estimator("ogb", needs_energy=True)
def ogb(batch: AdvantageBatch, *, leave_one_out: LeaveOneOut = False) -> Tensor:
    """OGB, the sequence-level optimal baseline (OTB paper App. A.2, eq. 21), [B]:

        A = R - sum_i W_i R_i / sum_i W_i,   W_i = sum_t w_t of response i (w = rho_bar^2 w off-policy).

    Groups whose energies sum to 0 use the plain mean of R. ``leave_one_out``: the baseline sums over
    j != i only (the others' plain mean where their energies sum to 0). The leave-in form is
    A = (1 - W_i / sum_j W_j) A^LOO (module docstring): biased toward zero by a factor that depends on
    the response's own energy, so high-energy responses lose most of their credit.
    """
    r = batch.rewards.to(torch.float64)
    # sum over valid tokens as a batched dot product: no masked [B,T] copy
    total_energy = torch.bmm(batch.raw_energy.unsqueeze(1), batch.valid.unsqueeze(2)).view(-1).to(torch.float64)
    return drop_singletons(r - group_weighted_baseline(r, total_energy, batch.groups, leave_one_out), batch.groups)
