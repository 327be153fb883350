"""GMPO: the geometric mean of the token ratios, clipped token by token (a surrogate term).

GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673) optimises each response's geometric
mean of ratios instead of their arithmetic mean, which an outlier ratio moves far less:

    m_t = min(z_t, ε_high) if A_t > 0,  max(z_t, −ε_low) if A_t < 0,  0 if A_t = 0   (sgn-clipped z)
    ℓ_b = −Ā_b · exp(mean_{t∈κ_b} m_t) · W_b,     Ā_b = mean_{t∈κ_b} A_t

with ε the flat ``clip_low`` / ``clip_high`` applied to the log-ratio (GMPO clips log r: its
range is wider than PPO's for the same ε) and W_b the geometric mean of the data weight over the
row (verl: of ``rollout_is_weights``); a token of weight 0 (``top_entropy``'s low-entropy
tokens) is left out of the row's means. ℓ_b is put on every kept token of row b, so
``agg="seq-mean-token-mean"`` gives the paper's mean over responses (verl's
``compute_policy_loss_geo_mean`` ignores ``loss_agg_mode`` and divides by the batch size B,
empty rows included; the other aggregations weight ℓ_b by the row's kept tokens). The log-ratio
is clamped to ±20 first (verl: not clamped).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from creditrl.core.losses.diagnostics import clamp_log_ratio
from creditrl.core.losses.terms import LossState, register_loss_term

TINY_WEIGHT = 1e-30   # guards log 0 of a data weight (weight-0 tokens are not counted)


@dataclass(frozen=True)
class GeoMeanOptions:
    """GMPO has no options of its own: its log-ratio range is [−clip_low, clip_high]."""


@register_loss_term("geo_mean", options=GeoMeanOptions, stage="surrogate")
def geo_mean(state: LossState, options: GeoMeanOptions) -> LossState:
    """GMPO: ℓ_b = −Ā_b·exp(mean_t sgn-clip(z_t))·W_b on each kept token of row b (GMPO objective).

    Metrics: ``clip_frac_low`` (A < 0, z < −ε_low) and ``clip_frac_high`` (A > 0, z > ε_high)
    over the kept tokens."""
    bounds, adv = state.flat["clip"], state.advantages
    keep_f = state.keep_f if state.weight is None else state.keep_f * (state.weight > 0)
    z = clamp_log_ratio(state.log_ratio)
    positive, negative = (adv > 0).to(z.dtype), (adv < 0).to(z.dtype)
    clipped = positive * z.clamp(max=bounds.high) + negative * z.clamp(min=-bounds.clip_low)
    rows = keep_f.sum(dim=1)
    n = rows.clamp(min=1)
    log_mean = (clipped * keep_f).sum(dim=1) / n
    if state.weight is not None:
        log_w = state.weight.clamp(min=TINY_WEIGHT).log()
        log_mean = log_mean + (log_w * keep_f).sum(dim=1) / n
    adv_mean = adv.squeeze(1) * (rows > 0) if adv.shape[1] == 1 else (adv * keep_f).sum(dim=1) / n
    row_loss = -adv_mean * log_mean.exp()
    with torch.no_grad():
        n_keep = rows.sum()
        metrics = {"clip_frac_low": (((z < -bounds.clip_low) * negative * keep_f).sum(), n_keep),
                   "clip_frac_high": (((z > bounds.high) * positive * keep_f).sum(), n_keep)}
    return dataclasses.replace(state, token_loss=row_loss[:, None] * state.valid_f).with_metrics(**metrics)
