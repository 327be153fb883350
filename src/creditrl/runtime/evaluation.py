"""Held-out evaluation: greedy accuracy, unbiased pass@k and avg@k from n samples per prompt.

pass@k = 1 - C(n-c, k) / C(n, k) per prompt, averaged (Chen et al. 2021, eq. 1), with c the
correct samples out of n: the unbiased estimate from all n samples (pass@1 = c/n averaged = the
sampled accuracy). avg@k is the mean accuracy of the first k samples of each prompt (avg@n is the
sampled accuracy), so avg@1 reads one sample per prompt and differs from pass@1 by that sampling
noise: two estimates of the same number, pass@1 the one with n times the samples. Values are
rounded to ``DIGITS`` decimals, which drops float noise (0.1250000000000001) and nothing an
accuracy over fewer than 10^12 samples can resolve. Sampling draws from its own generator, so
evaluating never moves the training RNG (periodic eval keeps resume exact).
"""
from __future__ import annotations

import numbers

import math

import torch

from creditrl.core.estimators.maxk import pass_at_k
from creditrl.tasks.base import Problem, Task
from creditrl.runtime.rollout import dataset_names, generate_rollouts, per_dataset

LOGGED_META = ("dataset", "difficulty")   # Problem.meta keys copied into completions.jsonl
DIGITS = 12                                # decimals kept of an accuracy (module docstring)


def sample_correctness(model, tokenizer, task, problems, *, n: int, temperature: float, top_p: float, max_new_tokens: int,
                       max_tool_tokens: int, generator, batch_size: int, stop_strings=()):
    """([P, n] bool correctness of n responses per problem, the first RolloutBatch), decoded in
    batches of <= batch_size rows."""
    per_chunk = max(1, batch_size // n)
    rows, first = [], None
    for start in range(0, len(problems), per_chunk):  # bounded memory: chunks, not sequences
        batch = generate_rollouts(model, tokenizer, task, problems[start:start + per_chunk], group_size=n,
                                  temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                  generator=generator, max_tool_tokens=max_tool_tokens, stop_strings=stop_strings)
        rows.append(batch.correct.view(-1, n))
        first = first or batch
    return torch.cat(rows), first


def evaluate(model, tokenizer, task: Task, problems: list[Problem] | None = None, *, n: int = 8,
             ks: list[int] = (1, 4, 8), temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 16,
             max_tool_tokens: int = 24, seed: int = 0, batch_size: int = 512, stop_strings=(),
             keep_samples: int = 0) -> dict:
    """Greedy accuracy + pass@k/avg@k (k in ``ks``) + sampled accuracy on ``problems``
    (default: the task's held-out test set), and ``greedy_acc/<dataset>`` for each dataset of a
    mix. With ``keep_samples`` the result's ``"samples"`` holds that many greedy completions
    (``completion_records``)."""

    problems = task.test_set() if problems is None else problems
    if not problems:
        raise ValueError("problems: expected at least one held-out problem, got none")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n: expected the number of samples per problem, an int >= 1, got {n!r}")
    n = int(n)
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"ks: every k must be in [1, n={n}], got {bad}")
    common = dict(top_p=top_p, max_new_tokens=max_new_tokens, max_tool_tokens=max_tool_tokens,
                  batch_size=batch_size, stop_strings=stop_strings)
    greedy, first = sample_correctness(model, tokenizer, task, problems, n=1, temperature=0.0, generator=None, **common)
    generator = torch.Generator().manual_seed(seed)
    sampled, _ = sample_correctness(model, tokenizer, task, problems, n=n, temperature=temperature,
                                    generator=generator, **common)
    c = sampled.sum(-1)
    result = {"greedy_acc": float(greedy.double().mean()), "sampled_acc": float(sampled.double().mean())}
    for name, value in per_dataset(problems, greedy[:, 0], dataset_names(task)).items():
        result[f"greedy_acc/{name}"] = value
    for k in ks:
        result[f"pass@{k}"] = float(pass_at_k(n, c, k).mean())
        result[f"avg@{k}"] = float(sampled[:, :k].double().mean())
    result = {key: round(value, DIGITS) for key, value in result.items()}
    result["n_problems"], result["n_samples"] = len(problems), n
    if keep_samples:
        result["samples"] = completion_records(first, keep_samples)
    return result


def completion_records(batch, count: int, advantages=None) -> list[dict]:
    """The first ``count`` responses of a RolloutBatch as dicts: prompt (as rendered), completion,
    reward, advantage (mean over its trained tokens of ``advantages`` [B,R]; None without them),
    length, stopped, the problem's dataset and difficulty when it has them (reasoning-gym, verl's
    ``data_source``) and the values its checker logged besides the reward. One device-to-host copy of
    the advantages' row means."""
    p, n = batch.prompt_len, min(count, len(batch.response_texts))
    mask = batch.response_mask[:n, p:]
    lengths = mask.sum(-1)
    means = [None] * n
    if advantages is not None and n:
        means = ((advantages[:n].float() * mask.to(advantages.device)).sum(-1)
                 / lengths.to(advantages.device).clamp(min=1)).tolist()
    extras = {k: v[:n].tolist() for k, v in (batch.reward_extras or {}).items()}
    out = []
    for b in range(n):
        meta = batch.problems[b].meta
        logged = {k: x[b] if math.isfinite(x[b]) else None for k, x in extras.items()}
        out.append({"prompt": batch.prompt_texts[int(batch.group[b])], "completion": batch.response_texts[b],
                    "reward": float(batch.rewards[b]), "advantage": means[b], "length": int(lengths[b]),
                    "stopped": bool(batch.stopped[b]), **{k: meta[k] for k in LOGGED_META if k in meta},
                    **({"reward_extras": logged} if logged else {})})
    return out
