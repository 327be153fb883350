"""The clipped surrogate: PPO clip with DAPO's clip-higher and the dual clip (a loss term).

Per token, with r_t = exp(z_t) the ratio π_θ/π_old (z clamped to ±20 first, as verl does, so
ratios and gradients stay finite; the gradient is 0 where the clamp binds) and A_t the advantage:

    ℓ_t = max(−A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high))    PPO eq. 7, DAPO clip-higher
    ℓ_t = min(ℓ_t, −A_t c)   where A_t < 0                       dual clip (``clip_c``)

which is one clamp of r with bounds that depend on the sign of A (``ratio_bounds``):
ℓ_t = −A_t·clamp(r_t, lo_t, hi_t). The surrogate is then multiplied by the data weight of the
earlier stages (TIS ρ̄, the GRPO-λ ε-weight).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from creditrl.core.losses.diagnostics import clamp_log_ratio
from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_range


@dataclass(frozen=True)
class ClipOptions:
    """The PPO clip range [1 − clip_low, 1 + clip_high] and the dual-clip bound ``clip_c``."""

    clip_low: float = field(default=0.2, metadata={"help": "ε_low: the ratio is clipped below at 1 − ε_low (A < 0)"})
    clip_high: float | None = field(default=None, metadata={
        "help": "ε_high: clipped above at 1 + ε_high (A > 0); DAPO's clip-higher, e.g. 0.28 (None = clip_low)"})
    clip_c: float | None = field(default=None, metadata={
        "help": "dual-clip bound c > 1: the loss of a token with A < 0 is at most −A·c (None = off)"})

    def __post_init__(self):
        check_range("clip_low", self.clip_low, 0.0, 1.0, high_inclusive=False)
        if self.clip_high is not None:
            check_range("clip_high", self.clip_high, 0.0)
        if self.clip_c is not None:
            check_range("clip_c", self.clip_c, 1.0, low_inclusive=False)

    @property
    def high(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high


def ratio_bounds(advantages: Tensor, options: ClipOptions) -> tuple[Tensor, Tensor]:
    """Bounds (lo, hi), shaped like ``advantages`` ([B,1] or [B,T]), with
    −A·clamp(r, lo, hi) = max(−A r, −A clip(r, 1 − ε_low, 1 + ε_high)), dual-clipped by
    min(·, −A c) where A < 0:   A > 0: [0, 1 + ε_high];  A < 0: [1 − ε_low, c or ∞];
    A = 0: [0, ∞] (the loss is 0 whatever r is)."""
    negative, positive = advantages < 0, advantages > 0
    upper_negative = math.inf if options.clip_c is None else options.clip_c
    lo = torch.where(negative, advantages.new_tensor(1.0 - options.clip_low), 0.0)
    hi = torch.where(positive, advantages.new_tensor(1.0 + options.high), upper_negative)
    return lo, hi


def clipped_surrogate(state: LossState, options: ClipOptions) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(−A_t·clamp(r_t, lo_t, hi_t) [B,T] before the data weight, r_t, lo_t, hi_t): the clip
    surrogate of ``clip`` and of the terms that extend it (``clip_cov``)."""
    ratio = clamp_log_ratio(state.log_ratio).exp()
    lo, hi = ratio_bounds(state.advantages, options)
    return torch.clamp(ratio, lo, hi).mul(state.advantages).neg(), ratio, lo, hi


@torch.no_grad()
def clip_fractions(state: LossState, ratio: Tensor, lo: Tensor, hi: Tensor, dual: bool) -> dict[str, Tensor]:
    """``clip_frac_low`` (A < 0, r < 1 − ε_low), ``clip_frac_high`` (A > 0, r > 1 + ε_high) and, with
    the dual clip on (``dual``), ``clip_frac_dual`` (A < 0, r > c) as fractions of the kept tokens: where
    a bound binds and the token passes no gradient (verl's pg_clipfrac is low + high, its
    pg_clipfrac_lower the dual)."""
    n_keep = state.keep.sum()
    low = torch.lt(ratio, lo).logical_and_(state.keep)
    high = torch.gt(ratio, torch.where(state.advantages > 0, hi, math.inf)).logical_and_(state.keep)
    out = {"clip_frac_low": (low.sum(), n_keep), "clip_frac_high": (high.sum(), n_keep)}
    if dual:
        out["clip_frac_dual"] = (torch.gt(ratio, hi).logical_and_(state.advantages < 0).logical_and_(state.keep).sum(),
                                 n_keep)
    return out


def weighted(state: LossState, token_loss: Tensor) -> Tensor:
    """``token_loss`` times the surrogate's data weight (TIS ρ̄, the GRPO-λ ε-weight), if any."""
    return token_loss if state.weight is None else token_loss * state.weight


@register_loss_term("clip", options=ClipOptions, stage="surrogate", flat=True)
def clip(state: LossState, options: ClipOptions) -> LossState:
    """The clipped surrogate ℓ_t = −A_t·clamp(r_t, lo_t, hi_t) × weight (PPO eq. 7, DAPO, dual clip).

    Metrics: ``clip_frac_low`` (A < 0, r < 1 − ε_low), ``clip_frac_high`` (A > 0, r > 1 + ε_high)
    and, with the dual clip on, ``clip_frac_dual`` (A < 0, r > c), as fractions of the kept tokens."""
    token_loss, ratio, lo, hi = clipped_surrogate(state, options)
    state = dataclasses.replace(state, token_loss=weighted(state, token_loss))
    return state.with_metrics(**clip_fractions(state, ratio, lo, hi, dual=options.clip_c is not None))
