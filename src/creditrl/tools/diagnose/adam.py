"""Adam's second moment v̂ for `creditrl diagnose`'s Adam column (efficiency of ĝ/√v̂), per measured
parameter, from a warm-up at the current policy (a run's checkpoint instead:
``creditrl.tools.diagnose.optimizer_state``).

The warm-up samples ``diagnose.adam_warmup`` groups (distinct prompts, one batched generate call)
and takes each one's gradient g under the configured estimator and loss. A training step's gradient
is the mean of B = rollout.prompts_per_step such groups, so the value Adam's v̂ settles to at this
policy (β₂ → 1) is E[ĝ_step²] = μ² + σ²/B per coordinate, estimated without bias from n groups as
(1 − 1/B)·μ̂² + mean(g²)/B, with μ̂² = (n·ḡ² − mean(g²))/(n − 1) (ḡ² alone is μ² + σ²/n).
Adam's ε is left out (the draws' scale is not the trainer's); v̂ is floored at ``FLOOR`` × its mean so
that a coordinate the warm-up never saw does not take over the preconditioned gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

from creditrl.runtime.gradient_space import GradientSpace
from creditrl.runtime.group_gradients import group_gradients
from creditrl.runtime.rollout import generate_rollouts
from creditrl.tools.diagnose.measure import PromptDraws, rows_of
from creditrl.tools.diagnose.plan import Plan

FLOOR = 1e-4


def from_warmup(model, tokenizer, task, plan: Plan, space: GradientSpace, rollout: dict, groups: int) -> list[Tensor]:
    """v̂ of each measured parameter from ``groups`` warm-up groups (module docstring)."""
    problems = PromptDraws(task, f"warmup-{plan.seed}").take(groups)
    batch = generate_rollouts(model, tokenizer, task, problems, group_size=plan.group_size,
                              generator=torch.Generator().manual_seed(plan.seed + 7919), **rollout)
    row = {plan.configured: plan.rows[plan.configured]}
    loss = {plan.configured: plan.row_losses[plan.configured]}
    dtype = torch.float64 if sum(p.numel() for p in space.params) <= 50_000_000 else torch.float32
    first = [torch.zeros_like(p, dtype=dtype) for p in space.params]
    second = [torch.zeros_like(p, dtype=dtype) for p in space.params]
    n = plan.group_size
    for g in range(len(problems)):
        sub = rows_of(batch, slice(g * n, (g + 1) * n), g)
        flat = group_gradients(model, sub, row, temperature=rollout["temperature"], params=list(space.params),
                               losses=loss).grads[0, 0]
        for i, piece in enumerate(flat.split([p.numel() for p in space.params])):
            x = piece.view(space.params[i].shape).to(dtype)
            first[i] += x
            second[i] += x * x
    return from_sums(first, second, len(problems), plan.batch)


def from_sums(first: list[Tensor], second: list[Tensor], n: int, batch: int) -> list[Tensor]:
    """v̂ = (1 − 1/B)·μ̂² + mean(g²)/B from Σg and Σg² of n draws (module docstring), unbiased; μ̂²
    is ḡ² where n = 1. A coordinate's v̂ can come out ≤ 0 where n < B: ``factors`` floors it, as it
    does a coordinate the warm-up never saw (a clamp here would bias v̂ up where μ² ≪ σ²/n)."""
    out = []
    for s1, s2 in zip(first, second):
        mean, mean_sq = s1 / max(n, 1), s2 / max(n, 1)
        mu_sq = (n * mean.square() - mean_sq) / (n - 1) if n > 1 else mean.square()
        out.append((1 - 1 / batch) * mu_sq + mean_sq / batch)
    return out


def factors(vhat: list[Tensor]) -> list[Tensor]:
    """1/√v̂ per parameter, v̂ floored at ``FLOOR`` × its mean over every coordinate."""
    total = sum(float(v.sum()) for v in vhat)
    count = sum(v.numel() for v in vhat)
    floor = FLOOR * total / max(count, 1) if total > 0 else 1.0
    return [v.clamp(min=floor).rsqrt().to(torch.float32) for v in vhat]
