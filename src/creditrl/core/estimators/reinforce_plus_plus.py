"""REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): advantages whitened over the batch.

    reinforce_plus_plus:           A_t = whiten(G_t),            G_t the return-to-go (``gamma`` over valid tokens)
    reinforce_plus_plus_baseline:  A_t = whiten(R - mean_g R)    (the group-centred reward on each valid token)

    whiten(x) = (x - μ) / sqrt(σ² + eps),   μ = Σ x_t / n,   σ² = Σ (x_t - μ)² / (n - 1)

over the n valid tokens of the whole batch (token-weighted: a response counts once per valid
token), the paper's global advantage normalisation (§3, "global batch normalization") as verl 0.9.1
computes it (``core_algos.compute_reinforce_plus_plus_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` with ``verl_F.masked_whiten``; equal to
them in tests/test_integration_verl.py). The statistics are the batch's, so the advantage of a
response depends on every other response in the batch (not only its group's): these are
batch-level estimators. Statistics in float64.

Where creditrl differs from verl's functions (documented, tested):
- a reward on a masked token (a tool-output token): verl's return skips masked tokens without
  adding their reward; creditrl counts it at the row's nearest preceding valid token
  (``AdvantageBatch``), so the reward is never lost;
- a singleton group (baseline form): verl's group mean of a lone response is 0, so it keeps A = R
  before whitening; creditrl centres it to 0 (no baseline information), as every group-relative
  estimator here;
- fewer than 2 valid tokens in the batch: verl raises (division by n - 1 = 0); here σ² = 0 and A = 0;
- verl's μ divides by n + 1e-8; here by n (a relative difference of 1e-8 / n).
All-equal values give A = 0 exactly (0 / sqrt(eps)).
"""
from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from creditrl.core.estimators.baselines import centred, drop_singletons
from creditrl.core.estimators.registry import AdvantageBatch, register_estimator
from creditrl.utils.validate import check_positive_float32

WhitenEps = Annotated[float, "added to the batch variance before the square root (> 0; verl's 1e-8)"]


def whiten_rows(values: Tensor, counts: Tensor, eps: float) -> Tensor:
    """``whiten`` of a batch whose every valid token of row b holds ``values[b]``: [B] float64,
    from the row values [B] and their valid-token counts [B] (no [B,T] tensor)."""
    values, counts = values.to(torch.float64), counts.to(torch.float64)
    n = counts.sum()
    mean = (counts * values).sum() / n.clamp(min=1)
    dev = values - mean
    var = (counts * dev.square()).sum() / (n - 1).clamp(min=1)
    return dev / torch.sqrt(var + eps)


def whiten_tokens(values: Tensor, valid: Tensor, eps: float) -> Tensor:
    """``whiten`` of token values [B,T] over the valid tokens (``valid`` [B,T] 1/0): [B,T] float64,
    exactly 0 where ``valid`` is 0."""
    values, valid = values.to(torch.float64), valid.to(torch.float64)
    n = valid.sum()
    mean = (values * valid).sum() / n.clamp(min=1)
    dev = (values - mean).mul_(valid)
    var = dev.square().sum() / (n - 1).clamp(min=1)
    return dev.div_(torch.sqrt(var + eps))


@register_estimator("reinforce_plus_plus", token_level=True, batch_level=True, masked_output=True)
def reinforce_plus_plus(batch: AdvantageBatch, *, eps: WhitenEps = 1e-8) -> Tensor:
    """REINFORCE++ (Hu et al. 2025): the returns-to-go G_t whitened over the batch's valid tokens, [B,T]."""
    check_positive_float32("reinforce_plus_plus.eps", eps)
    if batch.constant_returns:                       # G_t = R on every valid token: row statistics
        return whiten_rows(batch.rewards, batch.lengths, eps)
    return whiten_tokens(batch.returns, batch.valid, eps)


@register_estimator("reinforce_plus_plus_baseline", batch_level=True)
def reinforce_plus_plus_baseline(batch: AdvantageBatch, *, eps: WhitenEps = 1e-8) -> Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): R - mean_g R, then whitened over the batch's valid tokens, [B]."""
    check_positive_float32("reinforce_plus_plus_baseline.eps", eps)
    return whiten_rows(drop_singletons(centred(batch), batch.groups), batch.lengths, eps)
