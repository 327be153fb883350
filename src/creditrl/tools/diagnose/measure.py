"""Sampling and measuring for `creditrl diagnose`: P prompts, M independent groups of N responses per
prompt from the configured policy, each group's exact gradient under every estimator
(``creditrl.runtime.group_gradients``: one forward, one backward per estimator), streamed into
``GradientStats`` whose independent units are the prompts (``creditrl.core.gradients``).

Besides the gradients, per group: whether its rewards vary (an informative group), and per
estimator whether its gradient is non-zero; timings of sampling, of the gradient pass and of each
estimator's advantage computation (its own extra cost: the energies ŵ_t come from the same fused
forward as the log-probs, ``creditrl.core.token_stats``).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from creditrl.core.estimators import compute_advantages
from creditrl.core.gradients import CountSketch, GradientMoments, GradientStats
from creditrl.runtime.group_gradients import GroupDraws, group_gradients
from creditrl.runtime.rollout import RolloutBatch, generate_rollouts
from creditrl.tools.diagnose.plan import GradientSpace, Plan
from creditrl.runtime.group_gradients import with_derived

SHARED_PROMPT_MIN_PARAMS = 20_000_000   # below this a forward's fixed cost outweighs the prompt's FLOPs


@dataclass
class Measurement:
    """``stats`` over prompts (``dr_grpo`` derived); ``groups`` one row per group; ``nonzero``
    label -> groups with a non-zero gradient; ``seconds``: sampling, gradients, per estimator
    advantages (totals); ``tokens`` sampled response tokens."""
    stats: GradientStats
    groups: list[dict] = field(default_factory=list)
    nonzero: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: int = 0


def sample_prompt(model, tokenizer, task, problem, plan: Plan, rollout: dict, generator) -> RolloutBatch:
    """M groups of N responses to one problem (rows of group g: g·N .. g·N + N − 1)."""
    return generate_rollouts(model, tokenizer, task, [problem] * plan.groups_per_prompt,
                             group_size=plan.group_size, generator=generator, **rollout)


def advantage_seconds(batch: RolloutBatch, specs: dict) -> dict[str, float]:
    """Wall time of each estimator's advantages on this batch (energies given)."""
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    energy = mask.float()
    out = {}
    for label, (name, options) in specs.items():
        start = time.perf_counter()
        compute_advantages(name, rewards=batch.rewards, mask=mask, group=batch.group, energy=energy, **options)
        out[label] = time.perf_counter() - start
    return out


def gradients(model, batch: RolloutBatch, plan: Plan, space: GradientSpace, sketch: CountSketch | None,
              temperature: float):
    return group_gradients(model, batch, plan.specs, temperature=temperature, params=list(space.params),
                           sketch=sketch, shared_prompts=space.covered >= SHARED_PROMPT_MIN_PARAMS)


def progress_bar(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]diagnose[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), disable=not enabled, transient=False)


def make_sketch(space: GradientSpace, seed: int) -> CountSketch | None:
    """The count sketch of a ``sketch`` space (None for flat spaces)."""
    return CountSketch([p.shape for p in space.params], space.dim, seed=seed) if space.kind == "sketch" else None


def start(plan: Plan, dim: int) -> tuple[GradientMoments, Measurement]:
    """Empty statistics over a D = ``dim`` space, folds of prompts, and an empty record."""
    moments = GradientMoments(tuple(plan.specs), dim, folds=plan.folds)
    return moments, Measurement(stats=None, nonzero=dict.fromkeys(plan.specs, 0),
                                seconds={"sampling": 0.0, "gradients": 0.0, "statistics": 0.0,
                                         **{f"advantages/{k}": 0.0 for k in plan.timed}})


def add_prompt(moments: GradientMoments, out: Measurement, prompt: int, draws: GroupDraws, plan: Plan) -> None:
    """One prompt's M groups (``draws``: its groups' gradients [M, E, D]); the prompt is the unit."""
    moments.add_many(draws.grads.cpu(), [prompt] * draws.grads.shape[0])
    record(out, prompt, draws, plan)


def finish(moments: GradientMoments, out: Measurement, plan: Plan) -> Measurement:
    """The statistics, ``dr_grpo`` added exactly from rloo's."""
    out.stats = with_derived(moments.stats(), plan.group_size)
    return out


def measure(model, tokenizer, task, plan: Plan, space: GradientSpace, rollout: dict, *,
            sketch: CountSketch | None = None, progress: bool = False) -> Measurement:
    """Sample the plan's groups and measure every estimator's gradients (module docstring)."""
    moments, out = start(plan, space.dim)
    rng, generator = random.Random(f"diagnose-{plan.seed}"), torch.Generator().manual_seed(plan.seed)
    torch.manual_seed(plan.seed)
    with progress_bar(progress) as bar:
        job = bar.add_task("groups", total=plan.groups)
        for prompt in range(plan.prompts):
            problem = task.sample(rng)
            begin = time.perf_counter()
            batch = sample_prompt(model, tokenizer, task, problem, plan, rollout, generator)
            middle = time.perf_counter()
            draws = gradients(model, batch, plan, space, sketch, rollout["temperature"])
            out.seconds["sampling"] += middle - begin
            out.seconds["gradients"] += time.perf_counter() - middle
            for label, seconds in advantage_seconds(batch, plan.timed).items():
                out.seconds[f"advantages/{label}"] += seconds
            middle = time.perf_counter()
            add_prompt(moments, out, prompt, draws, plan)
            out.seconds["statistics"] += time.perf_counter() - middle
            bar.advance(job, plan.groups_per_prompt)
    return finish(moments, out, plan)


def record(out: Measurement, prompt: int, draws, plan: Plan) -> None:
    """Per group: reward mean and spread, mean length; per estimator: non-zero gradients."""
    N = plan.group_size
    rewards = draws.rewards.double().view(-1, N)
    lengths = draws.lengths.double().view(-1, N)
    nonzero = draws.grads.abs().amax(-1) > 0                                   # [G, E]
    for label, count in zip(draws.labels, nonzero.sum(0).tolist()):
        out.nonzero[label] += int(count)
    out.tokens += int(draws.lengths.sum())
    spread = (rewards.amax(1) - rewards.amin(1)).tolist()
    for g, (mean, width, length) in enumerate(zip(rewards.mean(1).tolist(), spread, lengths.mean(1).tolist())):
        out.groups.append({"prompt": prompt, "group": g, "reward_mean": mean, "informative": width > 0,
                           "response_len": length})
