"""ΔL normalisation: the paper's minimum-variance unbiased aggregation over response lengths (an
"aggregate" loss term, in place of ``aggregation``).

ΔL Normalization (He et al., arXiv 2509.07558): each response's summed token loss gives an
unbiased sample g_b = Σ_t ∇ℓ_bt of the policy gradient whose variance grows with its length n_b
(Var g_b ∝ n_b: the paper's model, which holds where the lengths carry no information about the
reward; creditrl's `grad-variance` verdict on it is inconclusive, docs/results.md). Of the
combinations Σ_b x_b g_b with Σ_b x_b = 1 (unbiased), the variance Σ_b x_b² n_b is smallest for
x_b ∝ 1/n_b; ΔL takes x_b ∝ n_b^{−α}:

    L = (1/M) · Σ_b x_b Σ_t ℓ_bt,     x_b = n_b^{−α} / Σ_{b'∈S} n_{b'}^{−α}

over the responses S with a kept token (n_b counts kept tokens), with M the constant
``max_len`` of the flat aggregation options (None: the padded length T), as Dr. GRPO, so the
scale does not depend on the lengths either. α ∈ [0, 1]: α = 1 is the minimum-variance choice, α = 0 gives
Dr. GRPO's equal weights (over S); the paper uses 1 and 0.75. The weights sum to 1 whatever the
lengths: GRPO's per-response 1/n_b and DAPO's 1/Σn do not (their expected gradient moves with
the lengths). ``agg_count`` = Σ_{b∈S} n_b^{−α}, so micro-batches accumulate to the batch's loss
exactly. The authors' code (zerolllin/Delta-L-Normalization, ``core_algos.py``) scales the
advantages by x_b·B and divides Σ ℓ by B·T: the same loss.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_range


@dataclass(frozen=True)
class DeltaLNormOptions:
    """α, the exponent of the length weights n_b^{−α}."""

    alpha: float = field(default=1.0, metadata={
        "help": "α in [0, 1] of the weights n_b^-α (1: the paper's minimum-variance choice, not reproduced here: "
                "grad-variance inconclusive; 0: Dr. GRPO's equal weights)"})

    def __post_init__(self):
        check_range("alpha", self.alpha, 0.0, 1.0)


@register_loss_term("delta_l_norm", options=DeltaLNormOptions, stage="aggregate")
def delta_l_norm(state: LossState, options: DeltaLNormOptions) -> LossState:
    """ΔL normalisation (1/M)·Σ_b n_b^{−α}·Σ_t ℓ_bt / Σ_b' n_b'^{−α} (the paper's α = 1: least variance in
    its analysis; not reproduced here).

    Unbiased and least-variance where the lengths carry no information about the reward (module
    docstring). Metric ``agg_count``: Σ_b n_b^{−α} over responses with a kept token."""
    keep_f = state.keep_f
    rows = keep_f.sum(dim=1)
    inverse = rows.clamp(min=1).pow(-options.alpha) * (rows > 0)
    total = inverse.sum()
    max_len = state.flat["aggregation"].max_len or keep_f.shape[1]
    denominator = torch.where(total > 0, total, 1.0) * max_len              # no kept token: loss 0
    loss = ((state.token_loss * keep_f).sum(dim=1) * inverse).sum() / denominator
    return dataclasses.replace(state, loss=loss).with_metrics(agg_count=total.detach())
