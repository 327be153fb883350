"""Held-out evaluation: greedy accuracy, unbiased pass@k and avg@k from n samples per prompt.

pass@k = 1 - C(n-c, k) / C(n, k) per prompt, averaged (Chen et al. 2021, eq. 1), with c the
correct samples out of n. avg@k is the mean accuracy of the first k samples of each prompt
(avg@n is the sampled accuracy). Sampling draws from its own generator, so evaluating never
moves the training RNG (periodic eval keeps resume exact).
"""
from __future__ import annotations

import torch

from creditrl.tasks.base import Problem, Task
from creditrl.trainer.rollout import generate_rollouts


def sample_correctness(model, tokenizer, task, problems, *, n: int, temperature: float, top_p: float, max_new_tokens: int,
             max_tool_tokens: int, generator, batch_size: int) -> torch.Tensor:
    """[P, n] bool correctness of n responses per problem, decoded in batches of <= batch_size rows."""
    per_chunk = max(1, batch_size // n)
    rows = []
    for start in range(0, len(problems), per_chunk):  # bounded memory: chunks, not sequences
        batch = generate_rollouts(model, tokenizer, task, problems[start:start + per_chunk], group_size=n,
                                  temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                  generator=generator, max_tool_tokens=max_tool_tokens)
        rows.append(batch.correct.view(-1, n))
    return torch.cat(rows)


def evaluate(model, tokenizer, task: Task, problems: list[Problem] | None = None, *, n: int = 8,
             ks: list[int] = (1, 4, 8), temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 16,
             max_tool_tokens: int = 16, seed: int = 0, batch_size: int = 512) -> dict:
    """Greedy accuracy + pass@k/avg@k (k in ``ks``) + sampled accuracy on ``problems``
    (default: the task's held-out test set)."""
    from creditrl.estimators.maxk import pass_at_k

    problems = task.test_set() if problems is None else problems
    if not problems:
        raise ValueError("problems: expected at least one held-out problem, got none")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"ks: every k must be in [1, n={n}], got {bad}")
    common = dict(top_p=top_p, max_new_tokens=max_new_tokens, max_tool_tokens=max_tool_tokens,
                  batch_size=batch_size)
    greedy = sample_correctness(model, tokenizer, task, problems, n=1, temperature=0.0, generator=None, **common)
    generator = torch.Generator().manual_seed(seed)
    sampled = sample_correctness(model, tokenizer, task, problems, n=n, temperature=temperature, generator=generator, **common)
    c = sampled.sum(-1)
    result = {"greedy_acc": float(greedy.float().mean()), "sampled_acc": float(sampled.float().mean())}
    for k in ks:
        result[f"pass@{k}"] = float(pass_at_k(n, c, k).mean())
        result[f"avg@{k}"] = float(sampled[:, :k].float().mean())
    result["n_problems"], result["n_samples"] = len(problems), n
    return result
