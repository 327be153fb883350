"""A fixed policy measured without training, shared by the measurement experiments (grad-variance,
proxy-fidelity, stapo-census, real-model): load a warm-started ``builtin:tiny`` or a configured model,
and sample groups of fresh prompts from it."""
from __future__ import annotations

import random

import torch

from creditrl.config import load_config
from creditrl.runtime.models import WarmStartConfig, load_policy
from creditrl.runtime.rollout import RolloutBatch, generate_rollouts
from creditrl.recipe.build import build_task, default_max_new_tokens, load_configured_policy
from creditrl_research.trainer_runs import WARM_START_THREADS
from creditrl.tasks import get_task


def load_tiny_checkpoint(task_name: str, digits: int, accuracy: float, seed: int = 0, max_steps: int = 2000):
    """(task, model, tokenizer, params): ``builtin:tiny`` warm-started on ``task_name`` at ``digits`` to
    sampled accuracy ``accuracy`` with ``seed`` (cached by ``load_policy``: once per machine), in eval
    mode (a fixed checkpoint: no dropout, never updated)."""
    task = get_task(task_name, digits=digits)
    model, tokenizer = load_policy("builtin:tiny", task, seed=seed, progress=False,
                                   warm_start=WarmStartConfig(target_accuracy=accuracy, max_steps=max_steps,
                                                              num_threads=WARM_START_THREADS))
    model.eval()
    return task, model, tokenizer, [p for p in model.parameters() if p.requires_grad]


def load_configured(overrides: list[str]):
    """(task, model, tokenizer, params, max_new_tokens) configured exactly as ``creditrl train`` with
    these overrides would (chat template, warm start, dtype), in eval mode."""
    train_cfg = load_config(None, overrides)
    task = build_task(train_cfg)
    model, tokenizer = load_configured_policy(train_cfg, task, "cpu", progress=False)
    model.eval()
    return (task, model, tokenizer, [p for p in model.parameters() if p.requires_grad],
            default_max_new_tokens(task, tokenizer))


def sample_groups(task, model, tokenizer, count: int, group_size: int, *, temperature: float, max_new_tokens: int,
                  rng: random.Random, generator: torch.Generator) -> RolloutBatch:
    """One rollout batch of ``count`` fresh prompts × ``group_size`` responses."""
    problems = [task.sample(rng) for _ in range(count)]
    return generate_rollouts(model, tokenizer, task, problems, group_size=group_size, temperature=temperature,
                             max_new_tokens=max_new_tokens, generator=generator)
