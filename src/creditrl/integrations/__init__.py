"""Plug-ins that run creditrl's estimators and losses inside other trainers.

- ``creditrl.integrations.trl``:  ``CreditGRPOConfig`` / ``CreditGRPOTrainer`` for TRL's GRPO (docs/trl.md)
- ``creditrl.integrations.verl``: ``creditrl_<name>`` advantage estimators and the ``creditrl_stapo`` /
  ``creditrl_grpo_lambda`` policy losses, loaded by verl's ``verl.plugins`` entry point (docs/verl.md)

Neither is imported by ``import creditrl``; each imports its framework.
"""
from __future__ import annotations

import torch
from torch import Tensor


def energy_from_logp(logp: Tensor, sum_p2: Tensor) -> Tensor:
    """Per-token energy w_t = ||e_y - pi_t||^2 = 1 - 2 pi_t(y_t) + sum_v pi_t(v)^2 (OTB eq. 7), float32,
    clamped >= 0 like ``creditrl.token_stats``; from frameworks that give log pi(y_t) and sum pi^2."""
    # one allocation, then in place: large [B,T] allocations dominate the cost on a CPU
    energy = logp.detach().float().exp()
    return torch.add(sum_p2.detach().float(), energy, alpha=-2.0, out=energy).add_(1.0).clamp_(min=0.0)
