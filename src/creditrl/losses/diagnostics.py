"""Divergence estimators and batch diagnostics: KL k1/k2/k3, log-PPL gap, variance proxy.

KL estimators (Schulman, "Approximating KL divergence"): for samples y ~ q and
log_ratio = log p(y) − log q(y) estimating KL(q‖p),
    k1 = −log_ratio,   k2 = ½·log_ratio²,   k3 = (e^{log_ratio} − 1) − log_ratio.
"""
from __future__ import annotations

import torch
from torch import Tensor

from creditrl._validate import check_choice, check_finite, check_same_shape, check_tensor
from creditrl._validate import as_mask, token_advantages

KL_ESTIMATORS = ("k1", "k2", "k3")
MAX_LOG_RATIO = 20.0  # e^20 ≈ 5e8: beyond it exp overflows in grads (0·inf) while nothing is lost


def kl_estimate(log_ratio: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(q‖p) estimate from log_ratio = log p − log q at samples of q, same shape."""
    check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.expm1(log_ratio) - log_ratio


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over True entries of mask (0 where there are none); masked NaNs are ignored."""
    total = torch.where(mask, x, 0.0)
    if dim is None:
        return total.sum() / mask.sum().clamp(min=1)
    return total.sum(dim) / mask.sum(dim).clamp(min=1)


def ppl_gap(logp: Tensor, other_logp: Tensor, mask: Tensor) -> Tensor:
    """OTB eq. 68: mean over responses (with a valid token) of |mean_t logp − mean_t other_logp|."""
    per_row = masked_mean(logp - other_logp, mask, dim=1).abs()
    return masked_mean(per_row, mask.any(dim=1))


def variance_proxy(advantages: Tensor, energy: Tensor, mask: Tensor) -> float:
    """Gradient "total power" P_total = (1/N) Σ_i Ŵ(τ_i)·A(τ_i)² (OTB App. E, eq. 64–65).

    advantages: [B] or [B,T] (A(τ) is the mean over the response's valid tokens);
    energy: [B,T] per-token logit-gradient energy ŵ_t (summed over valid tokens into Ŵ(τ))
    or [B] per-response Ŵ(τ); mask: [B,T] valid tokens. N = B. Returns a Python float.
    """
    mask = check_tensor("mask", mask, ndim=2)
    valid = as_mask("mask", mask, mask.shape)
    adv = token_advantages(advantages, valid, "mask")
    check_finite("advantages", torch.where(valid, adv, 0.0))
    energy = check_tensor("energy", energy, ndim=(1, 2), floating=True)
    if energy.dim() == 2:
        check_same_shape("mask", valid, "energy", energy)
        total_energy = torch.where(valid, energy.double(), 0.0).sum(dim=1)
    else:
        check_tensor("energy", energy, shape=[valid.shape[0]])
        total_energy = energy.double()
    check_finite("energy", total_energy)
    seq_adv = masked_mean(adv.double(), valid, dim=1)
    if total_energy.numel() == 0:
        return 0.0
    return float((total_energy * seq_adv.square()).mean())
