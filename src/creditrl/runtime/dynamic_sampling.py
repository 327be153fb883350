"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2; verl's ``algorithm.filter_groups``).

A group whose responses all score the same gives every group-relative estimator advantage 0: it adds
nothing to the gradient but still counts in the loss's denominators, which shrinks the step. Dynamic
sampling drops those groups and samples new prompts in their place:

    round 1:   sample P prompts × G responses; keep the groups whose signal varies
    round r:   sample as many new prompts as groups are missing (verl v1's one-for-one refill)
    stop when P groups are kept or after ``max_rounds`` rounds; train on the kept groups only

The signal is chosen (``RolloutBatch.reward_signal``): the task's reward before any shaping, accuracy,
or one reward component. Filtering on a shaped score (the reward plus a length penalty) keeps groups
whose responses differ only in length, so the policy learns the shaping alone: verl-recipe #125.

Logged per step: ``filtered_frac`` (groups dropped / groups sampled), ``refill_rounds`` (rounds after
the first), ``refill_tokens`` (tokens sampled in them), ``kept_groups``. A step whose every round comes
back uniform keeps nothing: ``sample_varying_groups`` returns no batch and the trainer makes no
update and says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from creditrl.core.groups import uniform_groups
from creditrl.runtime.rollout import RolloutBatch, concat_rollouts, select_groups


@dataclass
class FilteredSample:
    """The kept groups as one batch (None when every round was uniform), every round's batch as
    sampled, and the step's dynamic-sampling metrics."""
    batch: RolloutBatch | None
    sampled: list[RolloutBatch]
    metrics: dict[str, float] = field(default_factory=dict)


def signal_values(batch: RolloutBatch, signal: str):
    """``batch.reward_signal(signal)``; an unknown signal is an error naming the config key and the
    signals this task has."""
    try:
        return batch.reward_signal(signal)
    except KeyError as err:
        raise ValueError(f"rollout.dynamic_sampling.signal: unknown signal {err.args[0]}") from None


def sample_varying_groups(sample: Callable[[int], RolloutBatch], groups: int, signal: str, max_rounds: int,
                          pad_id: int) -> FilteredSample:
    """Up to ``max_rounds`` calls of ``sample(n)`` (a batch of n new prompts' groups) until ``groups``
    groups whose ``signal`` varies are kept (module docstring)."""
    kept, sampled, missing = [], [], groups
    for _ in range(max_rounds):
        batch = sample(missing)
        sampled.append(batch)
        keep = ~uniform_groups(signal_values(batch, signal), batch.group)
        if bool(keep.any()):
            kept.append(select_groups(batch, keep))
        missing -= int(keep.sum())
        if missing == 0:
            break
    drawn = sum(b.num_groups for b in sampled)
    metrics = {"filtered_frac": 1.0 - (groups - missing) / drawn, "refill_rounds": len(sampled) - 1,
               "refill_tokens": sum(b.num_tokens for b in sampled[1:]), "kept_groups": groups - missing}
    return FilteredSample(concat_rollouts(kept, pad_id) if kept else None, sampled, metrics)
