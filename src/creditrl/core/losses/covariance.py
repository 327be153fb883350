"""Clip-Cov and KL-Cov: act on the few tokens whose log-prob co-varies most with the advantage
(surrogate terms).

"The Entropy Mechanism of RL for Reasoning LMs" (Cui et al., arXiv 2505.22617) finds entropy
falls at the tokens with a large centred covariance of log-prob and advantage,

    cov_t = (A_t − mean_κ A) · (log π_θ(y_t) − mean_κ log π_θ)        (means over the kept tokens)

and restrains just those, as verl's ``compute_policy_loss_clip_cov`` / ``_kl_cov``:

    clip_cov:  the clip surrogate, with the gradient of k = max(1, ⌊clip_cov_ratio·n⌋) tokens
               drawn at random among those with clip_cov_lb < cov_t < clip_cov_ub that the clip
               does not already bind, set to 0 (all of them when there are at most k);
    kl_cov:    ℓ_t = −A_t·r_t (no clip) + ppo_kl_coef·|z_t| on the k = max(1, ⌊kl_cov_ratio·n⌋)
               tokens of largest cov_t.

n is the number of kept tokens. The clip bounds are the flat ``clip_low`` / ``clip_high`` (and
``clip_c``'s dual clip, which verl's ``clip_cov`` does not have: leave it unset for verl's loss).
clip_cov draws with torch's default generator on the tensors' device (seed it for a repeatable
run; the trainer does). Ties in cov (kl_cov) are broken by ``torch.topk``. The log-ratio of the
ratio is clamped to ±20 (verl's two losses do not clamp).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from creditrl.core.losses.clip import clip_fractions, clipped_surrogate, weighted
from creditrl.core.losses.diagnostics import clamp_log_ratio
from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_range


@dataclass(frozen=True)
class ClipCovOptions:
    """Which tokens Clip-Cov detaches (verl's ``policy_loss`` field names and defaults)."""

    clip_cov_ratio: float = field(default=0.0002, metadata={
        "help": "fraction in (0, 1] of the kept tokens whose gradient is cut (at least 1 token)"})
    clip_cov_lb: float = field(default=1.0, metadata={"help": "only tokens with covariance above this are drawn"})
    clip_cov_ub: float = field(default=5.0, metadata={"help": "only tokens with covariance below this are drawn"})

    def __post_init__(self):
        check_range("clip_cov_ratio", self.clip_cov_ratio, 0.0, 1.0, low_inclusive=False)
        check_range("clip_cov_lb", self.clip_cov_lb)
        check_range("clip_cov_ub", self.clip_cov_ub, self.clip_cov_lb, low_inclusive=False)


@dataclass(frozen=True)
class KLCovOptions:
    """Which tokens KL-Cov penalises and how much (verl's ``policy_loss`` field names and defaults)."""

    kl_cov_ratio: float = field(default=0.0002, metadata={
        "help": "fraction in (0, 1] of the kept tokens, those of largest covariance, that get the penalty "
                "(at least 1 token)"})
    ppo_kl_coef: float = field(default=0.1, metadata={"help": "coefficient >= 0 of the penalty |log r| on them"})

    def __post_init__(self):
        check_range("kl_cov_ratio", self.kl_cov_ratio, 0.0, 1.0, low_inclusive=False)
        check_range("ppo_kl_coef", self.ppo_kl_coef, 0.0)


@torch.no_grad()
def token_covariance(state: LossState) -> Tensor:
    """cov_t [B,T] (module docstring) over the kept tokens, 0 elsewhere."""
    keep_f, n = state.keep_f, state.keep.sum().clamp(min=1)
    adv = state.advantages.expand_as(keep_f)
    logp = state.logp.detach()
    centred_adv = adv - (adv * keep_f).sum() / n
    centred_logp = logp - (logp * keep_f).sum() / n
    return centred_adv * centred_logp * keep_f


def selected_count(ratio: float, n_keep: int) -> int:
    """k = max(1, ⌊ratio·n⌋) tokens, 0 when nothing is kept (verl's count)."""
    return 0 if n_keep == 0 else max(int(ratio * n_keep), 1)


@torch.no_grad()
def random_subset(candidates: Tensor, k: int) -> Tensor:
    """``candidates`` [B,T] bool itself when it has at most k entries, else k of them drawn
    uniformly without replacement (the k smallest of uniform keys: one ``topk``, no loop)."""
    if int(candidates.sum()) <= k:
        return candidates.clone()
    keys = torch.rand(candidates.shape, device=candidates.device).masked_fill_(~candidates, math.inf)
    chosen = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    chosen[keys.view(-1).topk(k, largest=False).indices] = True
    return chosen.view_as(candidates)


@torch.no_grad()
def largest(values: Tensor, keep: Tensor, k: int) -> Tensor:
    """The k kept entries of largest ``values`` as a [B,T] bool mask (none for k = 0)."""
    chosen = torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    if k > 0:
        chosen[values.masked_fill(~keep, -math.inf).view(-1).topk(k).indices] = True
    return chosen.view_as(values)


@register_loss_term("clip_cov", options=ClipCovOptions, stage="surrogate", batch_wide=True)
def clip_cov(state: LossState, options: ClipCovOptions) -> LossState:
    """Clip-Cov: the clip surrogate with k random tokens of covariance in (lb, ub) detached (Cui et al.).

    Metrics: the clip fractions and ``cov_selected_frac``, detached tokens / kept tokens."""
    token_loss, ratio, lo, hi = clipped_surrogate(state, state.flat["clip"])
    with torch.no_grad():
        cov = token_covariance(state)
        unclipped = (ratio >= lo) & (ratio <= hi)
        candidates = state.keep & unclipped & (cov > options.clip_cov_lb) & (cov < options.clip_cov_ub)
        n_keep = int(state.keep.sum())
        chosen = random_subset(candidates, selected_count(options.clip_cov_ratio, n_keep))
        metrics = {**clip_fractions(state, ratio, lo, hi, dual=state.flat["clip"].clip_c is not None),
                   "cov_selected_frac": (chosen.sum(), n_keep)}
    token_loss = token_loss * (~chosen).to(token_loss.dtype)
    return dataclasses.replace(state, token_loss=weighted(state, token_loss)).with_metrics(**metrics)


@register_loss_term("kl_cov", options=KLCovOptions, stage="surrogate", batch_wide=True)
def kl_cov(state: LossState, options: KLCovOptions) -> LossState:
    """KL-Cov: ℓ_t = −A_t·r_t + ppo_kl_coef·|z_t| on the k tokens of largest covariance (Cui et al.).

    Metric ``cov_selected_frac``: penalised tokens / kept tokens."""
    n_keep = int(state.keep.sum())
    chosen = largest(token_covariance(state), state.keep, selected_count(options.kl_cov_ratio, n_keep))
    ratio = clamp_log_ratio(state.log_ratio).exp()
    token_loss = -state.advantages * ratio + options.ppo_kl_coef * state.log_ratio.abs() * chosen
    metrics = {"cov_selected_frac": (chosen.sum(), n_keep)}
    return dataclasses.replace(state, token_loss=weighted(state, token_loss)).with_metrics(**metrics)
