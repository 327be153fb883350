"""Masking of truncated completions (a "keep" loss term).

A response cut at the token cap (``rollout.max_new_tokens``) has no ending: its reward judges a
text the policy did not finish, and the loss would push on its unfinished tokens. TRL's
``mask_truncated_completions`` (DAPO's "overlong filtering") drops such responses from the loss:
every token of a truncated row leaves ``keep``, so the denominators count the other rows only.
Its reward still counts in its group's baseline (the advantages are computed before the loss).
The trainer passes which rows hit the cap (``RolloutBatch.stopped`` is False for them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from creditrl.core.losses.terms import LossState, register_loss_term


@dataclass(frozen=True)
class MaskTruncatedOptions:
    """No options: a response is truncated when it hit the token cap without stopping."""


@register_loss_term("mask_truncated", options=MaskTruncatedOptions, stage="keep", needs=("truncated",))
@torch.no_grad()
def mask_truncated(state: LossState, options: MaskTruncatedOptions) -> LossState:
    """Truncated responses leave the loss and its denominators (TRL mask_truncated_completions, DAPO).

    Metric ``truncated_masked_frac``: tokens of truncated responses / valid tokens."""
    cut = state.truncated[:, None] & state.valid
    frac = cut.sum(), state.n_tokens
    return dataclasses.replace(state, keep=state.keep & ~cut).with_metrics(truncated_masked_frac=frac)
