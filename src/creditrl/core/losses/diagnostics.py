"""Divergence estimators and batch diagnostics: KL k1/k2/k3, log-PPL gap, gradient-variance proxies.

KL estimators (Schulman, "Approximating KL divergence"): for samples y ~ q and
log_ratio = log p(y) − log q(y) estimating KL(q‖p),
    k1 = −log_ratio,   k2 = ½·log_ratio²,   k3 = (e^{log_ratio} − 1) − log_ratio.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from creditrl.utils.validate import check_choice, check_finite, check_same_shape, check_tensor
from creditrl.utils.validate import ENERGY_TOLERANCE, as_mask, token_advantages

KL_ESTIMATORS = ("k1", "k2", "k3")
MAX_LOG_RATIO = 20.0  # e^20 ≈ 5e8: beyond it exp overflows in grads (0·inf) while nothing is lost


def kl_estimate(log_ratio: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(q‖p) estimate from log_ratio = log p − log q at samples of q, same shape."""
    check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    log_ratio = clamp_log_ratio(log_ratio)
    return torch.expm1(log_ratio) - log_ratio


def clamp_log_ratio(x: Tensor) -> Tensor:
    """x clamped to ±MAX_LOG_RATIO (zero gradient where it binds). On CPU x itself when nothing is
    out of range (one min/max pass instead of a clamp and its backward; on a GPU the check would
    wait for the device)."""
    if x.numel() == 0 or x.device.type != "cpu":
        return x.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    low, high = torch.aminmax(x.detach())
    if bool(low < -MAX_LOG_RATIO) or bool(high > MAX_LOG_RATIO):
        return x.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return x


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over True entries of mask (0 where there are none); masked NaNs are ignored."""
    total = torch.where(mask, x, 0.0)
    if dim is None:
        return total.sum() / mask.sum().clamp(min=1)
    return total.sum(dim) / mask.sum(dim).clamp(min=1)


def ppl_gap(logp: Tensor, other_logp: Tensor, mask: Tensor) -> Tensor:
    """OTB eq. 68: mean over responses (with a valid token) of |mean_t logp − mean_t other_logp|."""
    total, responses = ppl_gap_of_rows(masked_mean(logp - other_logp, mask, dim=1), mask.any(dim=1))
    return total / responses.clamp(min=1)


def ppl_gap_of_rows(row_mean_log_ratio: Tensor, has_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """OTB eq. 68 from each response's mean log-ratio [B] (``policy_loss`` has it at hand), as the
    sum over the responses with tokens and their count (ppl_gap = sum / count, 0 without any)."""
    return torch.where(has_tokens, row_mean_log_ratio.abs(), 0.0).sum(), has_tokens.sum()


def power_proxy(advantages: Tensor, energy: Tensor, mask: Tensor) -> float:
    """P_total (OTB App. E eq. 65) with the logit-gradient proxy: (1/N) Σ_i Σ_t A_t² ŵ_t.

    The proxy of ‖ĝ(τ)‖² = ‖Σ_t A_t ∇θ log π(y_t)‖² (eq. 63) keeps each token's own energy
    ŵ_t = ‖e_{y_t} − π_t‖² (eq. 7) and drops cross-token terms, as Ŵ(τ) = Σ_t ŵ_t does; for a
    sequence-level advantage it is A(τ)²·Ŵ(τ), eq. 64. Token-level advantages (OTB) enter
    token by token, not as their mean. advantages: [B] or [B,T]; energy: [B,T]; mask: [B,T].
    N = B. Returns a Python float (0.0 for an empty batch). Products and row sums run in the
    inputs' precision (~1e-7 relative in float32); a non-finite valid input, or a negative valid
    energy, raises naming it.
    """
    mask = check_tensor("mask", mask, ndim=2)
    valid = as_mask("mask", mask, mask.shape)
    adv = token_advantages(advantages, valid, "mask")
    energy = check_tensor("energy", energy, ndim=2, floating=True)
    check_same_shape("mask", valid, "energy", energy)
    if valid.numel() == 0:                 # B = 0 or T = 0
        return 0.0
    energy = torch.where(valid, energy, 0.0)   # 0 off the mask: what the range check and the sums read
    adv = advantages if advantages.dim() == 1 else torch.where(valid, adv, 0.0)
    lowest = float(energy.amin())                                   # NaN propagates: the finiteness check below
    if lowest < -ENERGY_TOLERANCE * torch.finfo(energy.dtype).eps:  # below rounding
        raise ValueError(f"energy: expected ŵ_t = ‖e_y − π‖² >= 0 on valid tokens, got a minimum of {lowest:.3g}")
    total = _mean_power(adv, energy)
    if not math.isfinite(total):           # name the input, else an overflow
        check_finite("advantages", adv)
        check_finite("energy", energy)
        total = _mean_power(adv.double(), energy.double())
    return total


def _mean_power(adv: Tensor, energy: Tensor) -> float:
    """(1/N) Σ_i Σ_t A_t² ŵ_t for adv [B] (A(τ)² Ŵ(τ), eq. 64; energy 0 off the mask) or [B,T] (0 off the mask)."""
    per_response = adv.square() * energy.sum(1) if adv.dim() == 1 else (adv.square() * energy).sum(1)
    return float(per_response.to(torch.float64).mean())


def variance_proxy(sample_grads: Tensor) -> dict[str, float]:
    """OTB App. E eq. 65–67 from per-response gradient estimates ĝ(τ_i) = Σ_t A_t ∇θ log π(y_t),
    [N, P] (exact per-sample gradients, e.g. from ``torch.func``):

        P_total = (1/N) Σ_i ‖ĝ(τ_i)‖²        (eq. 65, total power)
        S       = ‖(1/N) Σ_i ĝ(τ_i)‖²        (eq. 66, signal strength)
        V̂[ḡ]    = (P_total − S) / (N − 1)    (eq. 67, variance of the batch mean)

    V̂ equals the unbiased (1/(N(N−1))) Σ_i ‖ĝ_i − ḡ‖². Computed in float64. N >= 2.
    Returns {"total_power", "signal", "variance"} as Python floats.
    """
    grads = check_tensor("sample_grads", sample_grads, ndim=2, floating=True)
    if grads.shape[0] < 2:
        raise ValueError(f"sample_grads: expected N >= 2 gradient estimates (eq. 67 divides by N - 1), "
                         f"got N = {grads.shape[0]}")
    check_finite("sample_grads", grads)
    grads = grads.double()
    total = grads.square().sum(dim=1).mean()
    signal = grads.mean(dim=0).square().sum()
    return {"total_power": float(total), "signal": float(signal),
            "variance": float((total - signal) / (grads.shape[0] - 1))}


def adam_moment_variance(optimizer: torch.optim.Optimizer) -> float:
    """The MaxPO paper's gradient-variance proxy Σ_θ (v̂ − m̂²) from Adam's moments (MaxPO §5.2.3).

    m̂ = m / (1 − β1^t) and v̂ = v / (1 − β2^t) are the bias-corrected running first and second
    moments of each coordinate's gradient, so v̂ − m̂² estimates its variance over recent steps;
    the sum runs over every parameter with Adam state. 0.0 before the first step. Not a variance:
    m̂ and v̂ average over different horizons (β1 < β2), so where the gradient's mean moved in the
    last few steps m̂² can exceed v̂ and the proxy is negative (gradients 0 for 100 steps, then 1 for
    10, with β = (0.9, 0.999): v̂ − m̂² = −0.33 per coordinate); it is logged as it is.

    Logged every step, so it runs as two reductions per tensor, Σv / c₂ − ‖m‖² / c₁² with
    c = 1 − β^t, on the moments' device: one host read per device in all (not three per tensor:
    on CUDA each is a sync). The reductions run in float32 (a float64 one converts the whole
    tensor first, ~10x slower on a CPU): Σv by torch's cascade sum, ‖m‖² over rows of
    ``SQUARES_ROW`` (``sum_of_squares``), each within ~1e-7 relative; tensors combine in float64."""
    terms: dict[torch.device, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "exp_avg" not in state:
                continue
            t = torch.as_tensor(state["step"], dtype=torch.float64)   # a CPU or device (fused) tensor
            v_sum = state["exp_avg_sq"].sum().to(torch.float64)
            m_sq = sum_of_squares(state["exp_avg"])
            terms.setdefault(v_sum.device, []).append(v_sum / (1.0 - beta2 ** t) - m_sq / (1.0 - beta1 ** t).square())
    return sum((float(torch.stack(parts).sum()) for parts in terms.values()), 0.0)


SQUARES_ROW = 1024


def sum_of_squares(x: Tensor) -> Tensor:
    """Σ x² as a float64 0-d tensor, without a copy of ``x``: the norms of rows of ``SQUARES_ROW``
    values (one float32 norm over a whole large tensor drifts by ~1e-3), squared and summed in
    float64, plus the remainder's."""
    flat = x.detach().reshape(-1)
    cut = flat.numel() - flat.numel() % SQUARES_ROW
    rows = torch.linalg.vector_norm(flat[:cut].view(-1, SQUARES_ROW), dim=1).to(torch.float64).square().sum()
    return rows + flat[cut:].to(torch.float64).square().sum()
