"""Rollouts: render each problem's prompt (chat template), decode G responses per prompt with
the one sampler (``creditrl.runtime.sampling.generate``) and score them with the task's reward.

Layout (see ``creditrl.runtime.sampling``): prompts left-padded to a common length P, responses from
column P, right-padded. A response cut by a stop string is scored on its text up to and
including the stop string; the token that completed it is the last one trained on.

The reward trained on is the task's reward plus DAPO's soft overlong penalty when
``overlong=(buffer, factor)`` is given (``tasks.rewards.overlong_penalty`` on the sampled token
counts); the reward's validity is the task's reward's, before the penalty, and correctness the
answer checker's own verdict (``tasks.rewards.verdict``), whatever the other reward terms add.
``select_groups`` and ``concat_rollouts`` keep whole groups and join batches (dynamic sampling).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from creditrl.core.groups import uniform_groups
from creditrl.runtime.sampling import decode_responses, generate, position_ids_from_mask
from creditrl.tasks.base import Problem, Task
from creditrl.tasks.chat import render_task_prompts
from creditrl.tasks.rewards import Scores, overlong_penalty, score_responses

OVERLONG = "overlong"      # the penalty's name as a reward component and as reward/overlong


@dataclass
class RolloutBatch:
    """B = len(problems) * group_size responses; L = prompt_len + response columns.

    input_ids:      [B,L] long, left-padded prompt then right-padded response
    attention_mask: [B,L] long
    position_ids:   [B,L] long, cumsum(attention_mask) - 1 (0 on left padding)
    response_mask:  [B,L] float, 1 on sampled response tokens (trained on), 0 on prompt,
                    padding and tool-output tokens
    rollout_logp:   [B,L] float32, behaviour log-prob of each sampled token (0 elsewhere)
    rewards:        [B] float32, the reward trained on (the task's reward, plus the overlong penalty)
    correct:        [B] bool, the answer checker's verdict (``Scores.correct``: its reward >= 1, or verl's
                    ``acc``; other reward terms and the overlong penalty do not count)
    group:          [B] long, index of the prompt each response answers (0..G-1, in row order)
    stopped:        [B] bool, ended at a stop token/string (False: clipped at max_new_tokens)
    prompt_texts:   [len(problems)] the rendered prompts (chat template included)
    reward_invalid: [B] bool, the task's reward was NaN/inf or beyond float32's range (counted as 0)
    reward_timeouts: [B] bool, a checker call ran past its time limit (also counted invalid)
    reward_extras:  name -> [B] float64, values a checker logged besides its reward (NaN where none),
                    each reward term's own reward when there are several, and ``overlong``
    task_rewards:   [B] float32, the task's reward (invalid counted as 0) when a penalty was added; None
                    when ``rewards`` is the task's reward
    components:     [B,K] float64, each reward term's values (NaN where a term gave none), the
                    ``component_names`` and ``component_weights``, when there are several terms
                    (``task.options.rewards``, or the task's reward and ``overlong``); None for one
    tool_calls:     [B] long, the tool calls the task answered with an output, for a task with a tool
                    (``max_tool_calls`` > 0); None otherwise
    tool_calls_unanswered: [B] long, times the response wrote ``task.tool_stop`` without an output (past
                    ``max_tool_calls``, a call the task could not read, one closed inside a token that
                    opens the next tag, '</calc><', or at the ``max_new_tokens`` cap); None without a tool
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
    task_rewards: Tensor | None = None
    components: Tensor | None = None
    tool_calls: Tensor | None = None
    tool_calls_unanswered: Tensor | None = None
    component_names: list[str] | None = None
    component_weights: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        """Sampled (trained-on) tokens in the batch."""
        return int(self.response_mask.sum())

    @property
    def num_groups(self) -> int:
        return len(self.prompt_texts)

    def reward_signal(self, name: str) -> Tensor:
        """[B] float64 values of a signal: ``reward`` (the task's reward, before any penalty),
        ``accuracy`` (``correct``) or ``reward/<name>`` (a reward term, ``overlong`` or a value the
        checker logged; NaN where a response has none). KeyError listing the names otherwise."""
        if name == "reward":
            return (self.rewards if self.task_rewards is None else self.task_rewards).double()
        if name == "accuracy":
            return self.correct.double()
        extras = self.reward_extras or {}
        key = name.removeprefix("reward/")
        if not name.startswith("reward/") or key not in extras:
            raise KeyError(f"{name!r}; this task's signals are {signal_names(self)}")
        return extras[key].double()


def signal_names(batch: RolloutBatch) -> list[str]:
    """The signals ``RolloutBatch.reward_signal`` knows for this batch."""
    return ["reward", "accuracy", *(f"reward/{k}" for k in batch.reward_extras or {})]


def reward_tensor(values) -> tuple[Tensor, Tensor]:
    """([B] float32 rewards, [B] bool invalid) from the scored floats: NaN/inf, or a number float32
    cannot hold (1e39 would become inf), counts as 0 and is flagged (logged as reward_invalid_frac)."""
    raw = torch.tensor(values, dtype=torch.float64)
    invalid = ~torch.isfinite(raw) | (raw.abs() > torch.finfo(torch.float32).max)
    return torch.where(invalid, 0.0, raw).float(), invalid


def score_rollouts(scores: Scores, lengths: Tensor, max_new_tokens: int,
                   overlong: tuple[int, float] | None) -> dict:
    """The RolloutBatch reward fields from the task's ``Scores`` and the sampled token counts
    ``lengths`` [B]: rewards (+ the overlong penalty), invalid, correct, extras, components."""
    task_rewards, invalid = reward_tensor(scores.rewards)
    correct = task_rewards >= 1.0 if scores.correct is None else torch.tensor(scores.correct, dtype=torch.bool)
    extras = {k: torch.tensor(v, dtype=torch.float64) for k, v in scores.extras.items()}
    components = [(c.name, c.weight, torch.tensor(c.values, dtype=torch.float64)) for c in scores.components]
    rewards = task_rewards
    if overlong is not None:
        penalty = torch.tensor(overlong_penalty(lengths.tolist(), max_new_tokens, *overlong), dtype=torch.float64)
        extras[OVERLONG] = penalty
        given = torch.where(invalid, torch.nan, task_rewards.double())
        components = (components or [("task", 1.0, given)]) + [(OVERLONG, 1.0, penalty)]
        rewards = (task_rewards.double() + penalty).float()
    return dict(rewards=rewards, reward_invalid=invalid, correct=correct, reward_extras=extras,
                task_rewards=None if overlong is None else task_rewards,
                components=torch.stack([v for _, _, v in components], 1) if components else None,
                component_names=[n for n, _, _ in components] or None,
                component_weights=[w for _, w, _ in components] or None)


def generate_rollouts(model, tokenizer, task: Task, problems: list[Problem], *, group_size: int,
                      temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 16,
                      generator: torch.Generator | None = None, max_tool_tokens: int = 24,
                      stop_strings: tuple[str, ...] | list[str] = (),
                      overlong: tuple[int, float] | None = None) -> RolloutBatch:
    """Sample ``group_size`` responses for each problem and score them with ``task.reward``
    (plus DAPO's soft overlong penalty for ``overlong=(buffer, factor)``).

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
    lengths = out.response_mask[:, p:].sum(1).long()
    tools = {}
    if out.tool_calls is not None:
        written = torch.tensor([text.count(task.tool_stop) for text in texts], dtype=torch.long)
        tools = dict(tool_calls=out.tool_calls, tool_calls_unanswered=(written - out.tool_calls).clamp(min=0))
    return RolloutBatch(
        input_ids=out.input_ids, attention_mask=out.attention_mask,
        position_ids=position_ids_from_mask(out.attention_mask), response_mask=out.response_mask,
        rollout_logp=out.rollout_logp, group=torch.arange(len(problems)).repeat_interleave(group_size),
        response_texts=texts, problems=flat, prompt_len=p, stopped=out.stopped,
        prompt_texts=tokenizer.batch_decode(prompt_ids), reward_timeouts=torch.tensor(scores.timed_out, dtype=torch.bool),
        **tools, **score_rollouts(scores, lengths, max_new_tokens, overlong))


ROW_TENSORS = ("rewards", "group", "correct", "stopped", "reward_invalid", "reward_timeouts", "task_rewards",
               "components", "tool_calls", "tool_calls_unanswered")
TOKEN_TENSORS = ("input_ids", "attention_mask", "response_mask", "rollout_logp")


def select_groups(batch: RolloutBatch, keep: Tensor) -> RolloutBatch:
    """The rows of the groups where ``keep`` [G] (bool) is True, groups renumbered 0..G'-1 in order."""
    rows = keep[batch.group]
    index = torch.nonzero(rows).flatten()
    fields = {k: getattr(batch, k)[index] for k in ROW_TENSORS + TOKEN_TENSORS + ("position_ids",)
              if getattr(batch, k) is not None}
    fields["group"] = torch.cumsum(keep.long(), 0)[batch.group[index]] - 1
    picked = index.tolist()
    return dataclasses.replace(
        batch, **fields, response_texts=[batch.response_texts[i] for i in picked],
        problems=[batch.problems[i] for i in picked],
        prompt_texts=[t for t, k in zip(batch.prompt_texts, keep.tolist()) if k],
        reward_extras={k: v[index] for k, v in (batch.reward_extras or {}).items()})


def concat_rollouts(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One RolloutBatch of ``batches`` (same task and sampling settings) in order: prompts left-padded
    to the longest prompt, responses right-padded (``pad_id``, attention and masks 0), group ids
    offset, extras a checker logged in some batches only NaN elsewhere."""
    if len(batches) == 1:
        return batches[0]
    p = max(b.prompt_len for b in batches)
    width = max(b.input_ids.shape[1] - b.prompt_len for b in batches)

    def pad(b: RolloutBatch, name: str) -> Tensor:
        x = getattr(b, name)
        value = pad_id if name == "input_ids" else 0
        return torch.nn.functional.pad(x, (p - b.prompt_len, width - (x.shape[1] - b.prompt_len)), value=value)

    tokens = {k: torch.cat([pad(b, k) for b in batches]) for k in TOKEN_TENSORS}
    offsets = torch.tensor([0] + [b.num_groups for b in batches[:-1]]).cumsum(0)
    rows = {k: torch.cat([getattr(b, k) for b in batches]) for k in ROW_TENSORS if getattr(batches[0], k) is not None}
    rows["group"] = torch.cat([b.group + int(o) for b, o in zip(batches, offsets)])
    keys = list(dict.fromkeys(k for b in batches for k in b.reward_extras or {}))
    extras = {k: torch.cat([(b.reward_extras or {}).get(k, torch.full((b.rewards.numel(),), torch.nan,
                                                                       dtype=torch.float64)) for b in batches])
              for k in keys}
    first = batches[0]
    return dataclasses.replace(
        first, **tokens, **rows, position_ids=position_ids_from_mask(tokens["attention_mask"]), prompt_len=p,
        response_texts=[t for b in batches for t in b.response_texts], problems=[q for b in batches for q in b.problems],
        prompt_texts=[t for b in batches for t in b.prompt_texts], reward_extras=extras)


def zero_spread_frac(rewards: Tensor, group: Tensor) -> float:
    """Fraction of the groups whose rewards [B] are all equal (group ids [B]): no difference
    between responses for a group-relative estimator to learn from."""
    return float(uniform_groups(rewards, group).float().mean())


def sample_metrics(batch: RolloutBatch) -> dict[str, float]:
    """What a batch sampled: the rewards trained on (mean, std, the share of invalid ones and of groups
    whose rewards are all equal), accuracy, sampled tokens per response, the share clipped at the cap;
    for a task with a tool, the tool calls per response answered and written without an answer."""
    invalid = batch.reward_invalid
    p = batch.prompt_len
    tools = {} if batch.tool_calls is None else dict(
        tool_calls=float(batch.tool_calls.float().mean()),
        tool_calls_unanswered=float(batch.tool_calls_unanswered.float().mean()))
    return dict(reward_mean=float(batch.rewards.mean()), reward_std=float(batch.rewards.std(unbiased=False)),
                zero_spread_frac=zero_spread_frac(batch.rewards, batch.group),
                accuracy=float(batch.correct.float().mean()),
                response_len=float(batch.response_mask[:, p:].sum(-1).float().mean()),
                clipped_frac=float(1.0 - batch.stopped.float().mean()),
                reward_invalid_frac=0.0 if invalid is None else float(invalid.float().mean()), **tools)


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
            out[name] = float(correct[rows].double().mean())
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
