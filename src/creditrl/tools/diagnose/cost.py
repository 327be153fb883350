"""The cost of a diagnose run, estimated up front from a one-group probe: sample one group of N for
a probe prompt (not part of the measurement), take its exact gradient under every estimator and
fold it into gradient statistics;
the run costs about (groups) × (the probe's seconds per group). The probe also warms the model up."""
from __future__ import annotations

import random
import time

import torch

from creditrl.core.gradients import CountSketch, GradientMoments
from creditrl.runtime.group_gradients import group_gradients
from creditrl.runtime.rollout import generate_rollouts
from creditrl.tools.diagnose.measure import SHARED_PROMPT_MIN_PARAMS
from creditrl.tools.diagnose.plan import GradientSpace, Plan


def probe_seconds(model, tokenizer, task, plan: Plan, space: GradientSpace, rollout: dict,
                  sketch: CountSketch | None) -> float:
    """Wall seconds of one group: its sampling and its gradients under every estimator."""
    problem = task.sample(random.Random(f"diagnose-probe-{plan.seed}"))
    start = time.perf_counter()
    batch = generate_rollouts(model, tokenizer, task, [problem], group_size=plan.group_size,
                              generator=torch.Generator().manual_seed(plan.seed + 1), **rollout)
    draws = group_gradients(model, batch, plan.specs, temperature=rollout["temperature"], params=list(space.params),
                            sketch=sketch, shared_prompts=space.covered >= SHARED_PROMPT_MIN_PARAMS)
    GradientMoments(tuple(plan.specs), space.dim).add_many(draws.grads.cpu())     # the statistics' share
    return time.perf_counter() - start


def estimate_text(plan: Plan, seconds: float, shrink: str) -> str:
    """"cost estimate: ..." with the setting (``shrink``, e.g. ``diagnose.prompts``) that reduces it."""
    total = seconds * plan.groups
    half = max(2, plan.prompts // 2)
    return (f"cost estimate: {plan.prompts} prompts × {plan.groups_per_prompt} groups × {seconds:.2f} s per group "
            f"(one-group probe) ≈ {total / 60:.1f} min; {shrink}={half} would take about "
            f"{seconds * half * plan.groups_per_prompt / 60:.1f} min (wider intervals)")
