"""Rollouts: render each problem's prompt (chat template), decode G responses per prompt with
the one sampler (``creditrl.runtime.sampling.generate``) and score them with the task's reward.

Layout (see ``creditrl.runtime.sampling``): prompts left-padded to a common length P, responses from
column P, right-padded. A response cut by a stop string is scored on its text up to and
including the stop string; the token that completed it is the last one trained on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from creditrl.runtime.sampling import decode_responses, generate, position_ids_from_mask
from creditrl.tasks.base import Problem, Task
from creditrl.tasks.chat import render_task_prompts
from creditrl.tasks.rewards import score_responses


@dataclass
class RolloutBatch:
    """B = len(problems) * group_size responses; L = prompt_len + response columns.

    input_ids:      [B,L] long, left-padded prompt then right-padded response
    attention_mask: [B,L] long
    position_ids:   [B,L] long, cumsum(attention_mask) - 1 (0 on left padding)
    response_mask:  [B,L] float, 1 on sampled response tokens (trained on), 0 on prompt,
                    padding and tool-output tokens
    rollout_logp:   [B,L] float32, behaviour log-prob of each sampled token (0 elsewhere)
    rewards:        [B] float32;  correct: [B] bool (reward >= 1)
    group:          [B] long, index of the prompt each response answers
    stopped:        [B] bool, ended at a stop token/string (False: clipped at max_new_tokens)
    prompt_texts:   [len(problems)] the rendered prompts (chat template included)
    reward_invalid: [B] bool, the task's reward was NaN/inf or beyond float32's range (counted as 0)
    reward_timeouts: [B] bool, a checker call ran past its time limit (also counted invalid)
    reward_extras:  name -> [B] float64, values a checker logged besides its reward (NaN where none)
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_mask: Tensor
    rollout_logp: Tensor
    rewards: Tensor
    group: Tensor
    correct: Tensor
    response_texts: list[str]
    problems: list[Problem]
    prompt_len: int
    stopped: Tensor
    prompt_texts: list[str]
    reward_invalid: Tensor | None = None
    reward_timeouts: Tensor | None = None
    reward_extras: dict[str, Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        """Sampled (trained-on) tokens in the batch."""
        return int(self.response_mask.sum())


def reward_tensor(values) -> tuple[Tensor, Tensor]:
    """([B] float32 rewards, [B] bool invalid) from the scored floats: NaN/inf, or a number float32
    cannot hold (1e39 would become inf), counts as 0 and is flagged (logged as reward_invalid_frac)."""
    raw = torch.tensor(values, dtype=torch.float64)
    invalid = ~torch.isfinite(raw) | (raw.abs() > torch.finfo(torch.float32).max)
    return torch.where(invalid, 0.0, raw).float(), invalid


def generate_rollouts(model, tokenizer, task: Task, problems: list[Problem], *, group_size: int,
                      temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 16,
                      generator: torch.Generator | None = None, max_tool_tokens: int = 16,
                      stop_strings: tuple[str, ...] | list[str] = ()) -> RolloutBatch:
    """Sample ``group_size`` responses for each problem and score them with ``task.reward``.

    Responses of problem i are rows i*G .. i*G+G-1 (``group[b] = b // G``)."""
    if group_size < 1:
        raise ValueError(f"group_size: expected a positive int, got {group_size!r}")
    if not problems:
        raise ValueError("problems: expected at least one problem, got an empty list")
    prompt_ids = render_task_prompts(tokenizer, task, [p.prompt for p in problems])
    was_training = model.training
    model.eval()
    try:
        out = generate(model, tokenizer, prompt_ids, group_size=group_size, temperature=temperature, top_p=top_p,
                       max_new_tokens=max_new_tokens, generator=generator, task=task,
                       max_tool_tokens=max_tool_tokens, stop_strings=stop_strings)
    finally:
        model.train(was_training)
    p = out.prompt_len
    texts = decode_responses(tokenizer, out.input_ids[:, p:], out.attention_mask[:, p:], stop_strings)
    flat = [q for q in problems for _ in range(group_size)]
    scores = score_responses(task, flat, texts)
    rewards, invalid = reward_tensor(scores.rewards)
    return RolloutBatch(
        input_ids=out.input_ids, attention_mask=out.attention_mask,
        position_ids=position_ids_from_mask(out.attention_mask), response_mask=out.response_mask,
        rollout_logp=out.rollout_logp, rewards=rewards, group=torch.arange(len(problems)).repeat_interleave(group_size),
        correct=rewards >= 1.0, response_texts=texts, problems=flat, prompt_len=p, stopped=out.stopped,
        prompt_texts=tokenizer.batch_decode(prompt_ids), reward_invalid=invalid,
        reward_timeouts=torch.tensor(scores.timed_out, dtype=torch.bool),
        reward_extras={k: torch.tensor(v, dtype=torch.float64) for k, v in scores.extras.items()})


def dataset_names(task) -> list[str]:
    """The datasets a task mixes (``task.dataset_names``; [] for a single-source task)."""
    return list(getattr(task, "dataset_names", []) or [])


def per_dataset(problems: list[Problem], correct: Tensor, names: list[str]) -> dict[str, float]:
    """Accuracy of each dataset of a mix (``Problem.meta["dataset"]``) present in ``problems``;
    ``correct`` is [len(problems)] bool. Empty for a single dataset."""
    if len(names) < 2:
        return {}
    which = [p.meta.get("dataset") for p in problems]
    out = {}
    for name in names:
        rows = torch.tensor([w == name for w in which])
        if bool(rows.any()):
            out[name] = float(correct[rows].float().mean())
    return out


def rollout_metrics(batch: RolloutBatch, task) -> dict[str, float]:
    """A step's reward bookkeeping besides the learner's: ``reward_timeouts`` (count), the mean
    of each value a checker logged (``reward/<name>``) and ``accuracy/<dataset>`` for a mix."""
    out = {"reward_timeouts": int(batch.reward_timeouts.sum()) if batch.reward_timeouts is not None else 0}
    for key, values in (batch.reward_extras or {}).items():
        finite = values[torch.isfinite(values)]
        out[f"reward/{key}"] = float(finite.mean()) if finite.numel() else None
    for name, value in per_dataset(batch.problems, batch.correct, dataset_names(task)).items():
        out[f"accuracy/{name}"] = value
    return out
