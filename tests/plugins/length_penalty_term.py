"""A user's loss term, as it would live in the user's own module: one dataclass and one function.

Chosen by import path, ``"length_penalty_term:length_penalty"``, from ``creditrl.policy_loss(...,
terms=[...])``, TRL's ``CreditGRPOConfig(loss_terms=[...])``, verl's ``actor.policy_loss.loss_terms``
and ``creditrl train loss.terms=[...]``; creditrl itself is not edited.
"""
from dataclasses import dataclass, field

import torch

from creditrl import LossState, register_loss_term


@dataclass(frozen=True)
class LengthPenaltyOptions:
    coef: float = field(default=0.01, metadata={"help": "penalty per unit of response length / T"})


@register_loss_term("length_penalty", options=LengthPenaltyOptions, stage="penalty")
def length_penalty(state: LossState, options: LengthPenaltyOptions) -> LossState:
    """Toy length penalty: ℓ_t += coef·(n_b/T)·r_t, REINFORCE with reward −coef·n_b/T (shorter answers)."""
    share = state.row_tokens[:, None] / state.valid.shape[1]                     # n_b / T, [B,1]
    ratio = torch.exp(state.logp - state.old_logp)                               # r_t = 1 at θ_old
    return state.add_token_loss(options.coef * share * ratio).with_metrics(length_penalty=options.coef * share.mean())
