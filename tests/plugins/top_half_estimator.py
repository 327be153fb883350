"""A user's estimator in one file: its facts are declared in the decorator and every front end reads
them (tests/test_architecture.py::test_a_new_estimator_is_one_local_change)."""
from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from creditrl import register_estimator
from creditrl.core.estimators import AdvantageBatch, KRange


@register_estimator("top_half_test_only", needs_energy=True, k_range=KRange(2, below=1), token_level=True)
def top_half(batch: AdvantageBatch, *, k: Annotated[int, "responses counted as the top"],
             leave_one_out: Annotated[bool, "leave the response out of its own baseline"] = False) -> Tensor:
    """Toy: G_t minus the group's mean return, for checking that facts reach every front end."""
    returns = batch.returns
    mean = batch.groups.gather(batch.groups.mean(batch.rewards.to(torch.float64))).to(torch.float32)
    return (returns - mean[:, None]) * batch.valid
