"""Entropy terms: the entropy bonus (static or adaptive) and the high-entropy token mask.

entropy_bonus (a "penalty" term): ℓ_t ← ℓ_t − β·H_t on the kept tokens, aggregated with the
policy loss (verl's ``entropy_coeff``: ``pg_loss − β·agg_loss(H)``; TRL's ``entropy_coef`` takes
a plain token mean, the same for ``agg="token-mean"``). The entropy carries its gradient here:
∂H/∂logits = −π(log π + H), which ``creditrl.token_stats`` computes chunk by chunk (never a
[B,T,V] float32 copy). Adaptive control (Skywork-OR1, arXiv 2505.22312, as TRL's
``use_adaptive_entropy``): after each optimizer step the coefficient c moves by ``coef_delta``
toward more entropy while the step's mean entropy is at or below ``target`` and back otherwise,
within [coef_min, coef_max], and the next step applies c only if that entropy was ≤ target (0
before the first step). ``EntropyControl`` holds (c, last entropy); the trainer gives the loss
``coef = applied`` each step, so the term itself is a pure function of its options.

top_entropy (a "keep" term): only the top-ρ fraction of tokens by entropy keep the surrogate's
gradient ("Beyond the 80/20 rule", arXiv 2506.01939; TRL's ``top_entropy_quantile``): the token
surrogate is multiplied by 1[H_t ≥ quantile_{1−ρ}(H over the kept tokens)] (linear interpolation,
as ``torch.quantile``). As in TRL the other tokens stay in the loss's denominators; unlike TRL 1.16,
whose entropy bonus then averages over the high-entropy tokens alone, the penalties (an entropy
bonus included) still act on every kept token.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from creditrl.core.losses.stapo import check_finite_where, pool_quantile
from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_range


@dataclass(frozen=True)
class EntropyBonusOptions:
    """The bonus coefficient, and the adaptive controller's settings (TRL's defaults)."""

    coef: float = field(default=0.0, metadata={
        "help": "β: the loss gets −β·H_t per kept token (verl entropy_coeff, TRL entropy_coef); the starting "
                "coefficient when adaptive"})
    adaptive: bool = field(default=False, metadata={
        "help": "adapt β after each optimizer step toward target (Skywork-OR1, TRL use_adaptive_entropy)"})
    target: float = field(default=0.2, metadata={
        "help": "adaptive: the mean entropy (nats) at or below which β grows and is applied"})
    coef_min: float = field(default=0.0, metadata={"help": "adaptive: the smallest β"})
    coef_max: float = field(default=1.0, metadata={"help": "adaptive: the largest β"})
    coef_delta: float = field(default=0.005, metadata={"help": "adaptive: the step of β per optimizer step"})

    def __post_init__(self):
        check_range("coef", self.coef)
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"adaptive: expected a bool, got {type(self.adaptive).__name__} {self.adaptive!r}")
        check_range("target", self.target, 0.0)
        check_range("coef_min", self.coef_min, 0.0)
        check_range("coef_max", self.coef_max, self.coef_min)
        check_range("coef_delta", self.coef_delta, 0.0, low_inclusive=False)
        if self.adaptive:
            check_range("coef", self.coef, self.coef_min, self.coef_max)


@dataclass(frozen=True)
class EntropyControl:
    """The adaptive controller's state: the coefficient c and the last step's mean entropy."""

    coef: float
    last_entropy: float = math.inf

    def applied(self, options: EntropyBonusOptions) -> float:
        """β of the next step: c while the last step's entropy was ≤ target, else 0."""
        return self.coef if self.last_entropy <= options.target else 0.0

    def loss_options(self, options: EntropyBonusOptions) -> EntropyBonusOptions:
        """The term's options for the next step: the applied β as a static coefficient (it may be
        0, below ``coef_min``: the controller's bounds hold for c, not for what it applies)."""
        return dataclasses.replace(options, coef=self.applied(options), adaptive=False)

    def update(self, entropy: float, options: EntropyBonusOptions) -> EntropyControl:
        """After an optimizer step whose mean entropy over the bonus's tokens was ``entropy``."""
        if not math.isfinite(entropy):           # a skipped step measured nothing
            return self
        step = options.coef_delta if entropy <= options.target else -options.coef_delta
        return EntropyControl(min(max(self.coef + step, options.coef_min), options.coef_max), float(entropy))


@register_loss_term("entropy_bonus", options=EntropyBonusOptions, stage="penalty", needs=("entropy",),
                    differentiates=("entropy",))
def entropy_bonus(state: LossState, options: EntropyBonusOptions) -> LossState:
    """Entropy bonus ℓ_t −= β·H_t (with ∂H/∂θ), aggregated like the policy loss (verl entropy_coeff).

    Metrics: ``entropy_bonus_coef`` (β applied) and ``bonus_entropy``, the mean H over the kept
    tokens (what the adaptive controller reads)."""
    keep_f = state.keep_f
    with torch.no_grad():
        check_finite_where("entropy", state.entropy.detach(), state.valid)
        total, kept = (state.entropy.detach() * keep_f).sum(), state.keep.sum()
    if options.coef != 0:
        state = state.add_token_loss(-options.coef * state.entropy)
    return state.with_metrics(entropy_bonus_coef=total.new_tensor(options.coef), bonus_entropy=(total, kept))


@dataclass(frozen=True)
class TopEntropyOptions:
    """ρ, the fraction of tokens (by entropy) that keep the surrogate's gradient."""

    quantile: float = field(default=0.2, metadata={
        "help": "ρ in (0, 1]: keep the surrogate of the top-ρ tokens by entropy (TRL top_entropy_quantile; "
                "the paper: 0.2)"})

    def __post_init__(self):
        check_range("quantile", self.quantile, 0.0, 1.0, low_inclusive=False)


@register_loss_term("top_entropy", options=TopEntropyOptions, stage="keep", needs=("entropy",),
                    batch_wide=True)
@torch.no_grad()
def top_entropy(state: LossState, options: TopEntropyOptions) -> LossState:
    """High-entropy token mask: the surrogate counts only where H_t ≥ quantile_{1−ρ}(H) (Beyond 80/20).

    Metric ``high_entropy_frac``: selected / valid tokens."""
    entropy = state.entropy.detach()
    check_finite_where("entropy", entropy, state.valid)
    threshold = pool_quantile(entropy, state.keep, 1.0 - options.quantile)
    high = state.keep.clone() if threshold is None else torch.ge(entropy, threshold).logical_and_(state.keep)
    state = state.scaled(high.to(state.valid_f.dtype))
    return state.with_metrics(high_entropy_frac=(high.sum(), state.n_tokens))
