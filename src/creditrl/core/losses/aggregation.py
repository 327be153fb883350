"""Loss aggregation: reduce a per-token loss matrix [B,T] to a scalar over kept tokens.

The keep-mask may be any subset of the valid tokens (e.g. valid ∧ not silenced): every
denominator counts kept tokens only, which is STAPO's renormalisation (STAPO eq. 1).
The ``aggregation`` loss term is the last stage of the policy loss.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import NonFiniteError, as_mask, check_choice, check_finite, check_int, check_tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class AggregationOptions:
    """How the per-token loss becomes a scalar (``agg_loss``)."""

    agg: Literal[AGG_MODES] = field(default="token-mean", metadata={
        "help": "token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum or seq-mean-token-sum-norm "
                "(Dr. GRPO)"})
    max_len: int | None = field(default=None, metadata={
        "help": "the constant M of seq-mean-token-sum-norm and of delta_l_norm (None = the padded length T); "
                "a constant, not checked against the responses (one longer than M keeps 1/(B·M) per token)"})

    def __post_init__(self):
        check_choice("agg", self.agg, AGG_MODES)
        if self.max_len is not None:
            check_int("max_len", self.max_len, 1)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, *, max_len: int | None = None) -> Tensor:
    """Aggregate a per-token loss ``loss_mat`` [B,T] over the kept tokens of ``mask`` [B,T].

    Modes (n_b = kept tokens of response b, S = responses with n_b > 0):

    - ``token-mean``:              Σ_{b,t} ℓ / Σ_b n_b                     (DAPO; STAPO eq. 1)
    - ``seq-mean-token-mean``:     (1/|S|) Σ_{b∈S} (1/n_b) Σ_t ℓ          (GRPO)
    - ``seq-mean-token-sum``:      (1/|S|) Σ_{b∈S} Σ_t ℓ
    - ``seq-mean-token-sum-norm``: Σ_{b,t} ℓ / (B · max_len), max_len = T by default (Dr.GRPO)

    Masked entries never reach the result, even when they hold NaN/inf; a NaN/inf on a kept token
    raises ``NonFiniteError`` naming its rows (one host read per call). With no kept token
    the result is 0 (still attached to the graph, so ``backward`` works and gives zero grads).
    """
    loss_mat = check_tensor("loss_mat", loss_mat, ndim=2, floating=True)
    keep = as_mask("mask", mask, loss_mat.shape)
    check_choice("mode", mode, AGG_MODES)
    if max_len is not None:
        check_int("max_len", max_len, 1)
    kept_loss = torch.where(keep, loss_mat, loss_mat.new_zeros(()))
    out = reduce_kept(kept_loss, keep.sum(dim=-1), mode, max_len=max_len)
    if not math.isfinite(float(out.detach())):      # name the rows, else a sum beyond the dtype's range
        check_finite("loss_mat", kept_loss.detach())
        raise NonFiniteError(f"loss_mat: finite on the kept tokens, but its {mode} sum overflows {loss_mat.dtype}")
    return out


def agg_denominator(row_tokens: Tensor, mode: str) -> Tensor:
    """The count an aggregation divides by (row_tokens [B]: kept tokens per row): kept tokens
    (token-mean), responses with a kept token (seq-mean-token-mean/-sum) or responses
    (seq-mean-token-sum-norm, whose max_len factor is fixed). Σ over micro-batches of
    loss_i · count_i, divided by Σ count_i, is the loss of the whole batch: that is how
    gradient accumulation stays exact."""
    if mode == "token-mean":
        return row_tokens.sum()
    if mode == "seq-mean-token-sum-norm":
        return row_tokens.new_tensor(float(row_tokens.shape[0]))
    return (row_tokens > 0).sum().to(row_tokens.dtype)


def agg_row_weights(row_tokens: Tensor, mode: str, length: int, *, max_len: int | None = None) -> Tensor:
    """Weights w [B] with ``agg_loss`` = Σ_b w_b Σ_t ℓ_bt over kept tokens (row_tokens [B]: kept
    tokens per row, float; ``length`` = T). Also the gradient's per-row scale."""
    rows = row_tokens.shape[0]
    if mode == "seq-mean-token-sum-norm":
        weight = row_tokens.new_full((), 1.0 / (max(rows, 1) * (max_len if max_len is not None else length)))
    else:
        weight = 1.0 / agg_denominator(row_tokens, mode).clamp(min=1)
        if mode == "seq-mean-token-mean":
            return weight / row_tokens.clamp(min=1)
    return weight.expand(rows)


def reduce_kept(kept_loss: Tensor, row_tokens: Tensor, mode: str, *, max_len: int | None = None) -> Tensor:
    """The reduction of ``agg_loss`` for a loss [B,T] that is already 0 off the keep-mask, with
    ``row_tokens`` [B] the kept tokens per row (unchecked: callers that hold both use this)."""
    weights = agg_row_weights(row_tokens.to(kept_loss.dtype), mode, kept_loss.shape[1], max_len=max_len)
    return (kept_loss.sum(dim=1) * weights).sum()


@register_loss_term("aggregation", options=AggregationOptions, stage="aggregate", flat=True)
def aggregation(state: LossState, options: AggregationOptions) -> LossState:
    """The loss over the kept tokens: ``agg_loss(ℓ, keep, agg)`` (STAPO eq. 1 renormalisation).

    Also the metric ``agg_count``, the aggregation's denominator (``agg_denominator``): what
    gradient accumulation weights micro-batches by."""
    keep_f = state.keep_f
    keep_rows = keep_f.sum(dim=1)
    loss = reduce_kept(state.token_loss * keep_f, keep_rows, options.agg, max_len=options.max_len)
    state = dataclasses.replace(state, loss=loss)
    return state.with_metrics(agg_count=agg_denominator(keep_rows.detach(), options.agg))
