"""GDPO (arXiv 2601.05242): normalise each reward component within its group, then sum, then scale over the batch.

With reward components c_k (each reward term, e.g. each of ``task.options.rewards``) and weights w_k,

    z_k,i = (c_k,i - mean_g c_k) / (std_g c_k + eps)          per component, within the group (std N-1)
    S_i   = Σ_k w_k z_k,i
    A_i   = S_i / (std_B S + eps)                               one scale for the batch (std N-1)

TRL's ``multi_objective_aggregation="normalize_then_sum"`` (``GRPOTrainer._generate_and_score_completions``,
TRL 1.16; it uses eps = 1e-4) and verl's ``gdpo`` (``core_algos.compute_gdpo_outcome_advantage``). GRPO
sums the terms first, so the term with the largest spread decides every group's ranking; here each
term's spread is normalised first, so a weak term (a format reward beside a correctness reward) keeps
its share of the signal.

Missing values (NaN: the term gave no reward for that response, TRL's None) stay out of that
component's group statistics and add 0 to S, as TRL's nanmean/nansum; a response with no value in any
component gets A = 0 and stays out of the batch scale. A component with fewer than 2 values in a group
(a singleton group) adds 0 there. Without ``components`` the total reward is the one component
(verl's fallback): GRPO's z-score rescaled over the batch.

The batch step: TRL subtracts the batch mean of S before dividing. Σ_i z_k,i = 0 within every group, so
that mean is 0 in exact arithmetic and only its rounding residue (~1e-17) would be subtracted; it is
not, so a group whose components are all equal keeps A = 0 exactly. verl whitens S over tokens
instead (token-weighted mean and variance, ``masked_whiten``), which weighs long responses more; this
is TRL's per-response form (the paper's).

A batch without signal: when the weighted z-scores cancel in every response (components that mirror
each other, S = 0 in exact arithmetic), what is left of S is the ``eps`` terms' residue, or the
components' own float32 rounding (a mirrored term scaled by 1.523 in float32 leaves S ~ 1e-7), and
dividing it by its own batch spread turns it into advantages of order 1 (TRL and verl do). Here the
sum is checked on the z-scores without ``eps``: if for every response it is 0 up to what a float32
rounding of each component value could make of it (``cancels``; rewards are read as float32 too), A = 0.
"""
from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from creditrl.core.estimators.registry import AdvantageBatch, register_estimator
from creditrl.core.groups import GroupIndex
from creditrl.utils.validate import check_positive_float32


CANCELLED = 1e-10     # |S| below this times Σ|w| (1 + max|z|) is float64 rounding of a sum that is 0
ROUNDING32 = 2.0 ** -24                # float32's unit roundoff: a value read as float32 is within it, relatively


def _group_moments(components: Tensor, groups: GroupIndex) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each component's statistics within its group over the values present (NaN absent), float64:
    (present [B,K], count [G,K], deviation from the group mean [B,K] (0 where absent), std [G,K] (N-1))."""
    present = ~torch.isnan(components)
    values = torch.where(present, components, 0.0)
    count = groups.sum(present.to(torch.float64))                       # [G,K]
    mean = groups.sum(values) / count.clamp(min=1)
    dev = torch.where(present, groups.subtract(values, mean), 0.0)
    return present, count, dev, (groups.sum(dev * dev) / (count - 1).clamp(min=1)).sqrt()


def component_scores(components: Tensor, groups: GroupIndex, eps: float) -> Tensor:
    """z [B,K] float64: each component's z-score within its group over the values present (NaN
    absent), std + ``eps`` in the denominator (``eps = 0``: the exact z, 0 where the std is 0); 0
    where the value is absent or its group has fewer than 2 values of that component."""
    present, count, dev, std = _group_moments(components, groups)
    informed = groups.gather((count >= 2) & (std + eps > 0)) & present
    return torch.where(informed, dev / (groups.gather(std) + eps).clamp(min=torch.finfo(torch.float64).tiny), 0.0)


def cancels(components: Tensor, weights: Tensor, groups: GroupIndex) -> bool:
    """Whether S = Σ_k w_k z_k with the exact z-scores is 0 for every response, up to float64 rounding and
    to what a float32 rounding of each component value (relative u = 2^-24) could make of it.

    That rounding moves c_i by u|c_i|, the group mean by at most u·r (r the group's rms |c|) and the std σ
    by at most 2√2·u·r (n >= 2), so z_i by at most u (|c_i| + r + 2√2 |z_i| r) / σ to first order; the
    bound on S takes twice that, weighted by |w_k|. With one component of non-zero weight nothing can
    cancel: S is 0 only where every z is (equal values give exactly 0), however large the values are
    against their spread (rewards 1e6 + {0, 0.25, 0.5, 0.75}, exact in float32, are a signal). With two
    or more the bound holds whatever the data's origin, so components offset by more than ~1e6 times
    their spread that cancel to within their float32 rounding also read as no signal."""
    present, count, dev, std = _group_moments(components, groups)
    informed = groups.gather((count >= 2) & (std > 0)) & present
    spread = groups.gather(std).clamp(min=torch.finfo(torch.float64).tiny)
    exact = torch.where(informed, dev / spread, 0.0)
    total = exact @ weights
    if int((weights != 0).sum()) <= 1:
        return bool((total == 0).all())
    values = torch.where(present, components, 0.0)
    rms = groups.gather((groups.sum(values * values) / count.clamp(min=1)).sqrt())
    moved = torch.where(informed, ROUNDING32 * (values.abs() + rms * (1 + 2 * 2 ** 0.5 * exact.abs())) / spread, 0.0)
    bound = 2 * moved @ weights.abs() + CANCELLED * weights.abs().sum() * (1 + exact.abs().max())
    return bool((total.abs() <= bound).all())


@register_estimator("gdpo", reward_components=True, batch_level=True)
def gdpo(batch: AdvantageBatch, *, eps: Annotated[float, "added to each std before dividing (> 0; TRL uses "
                                                         "1e-4)"] = 1e-6) -> Tensor:
    """GDPO (arXiv 2601.05242): A = Σ_k w_k z_k / (std_B + eps), z_k each reward component's group z-score, [B]."""
    check_positive_float32("gdpo.eps", eps)
    components, weights = batch.components, batch.component_weights
    if components is None:
        components = batch.rewards.to(torch.float64)[:, None]
        weights = torch.ones(1, dtype=torch.float64, device=components.device)
    scored = ~torch.isnan(components).all(1)
    if cancels(components, weights, batch.groups):          # no signal: not an amplified eps residue
        return torch.zeros_like(batch.rewards, dtype=torch.float64)
    total = component_scores(components, batch.groups, eps) @ weights
    n = scored.sum()
    mean = (total * scored).sum() / n.clamp(min=1)
    std = (((total - mean) * scored).square().sum() / (n - 1).clamp(min=1)).sqrt()
    return total * scored / (std + eps)
