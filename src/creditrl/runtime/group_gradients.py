"""Exact policy gradients of one group under several advantage estimators, and exact per-token
gradient norms: the model side of ``creditrl.core.gradients``.

For a group of N responses to one prompt and an estimator e with advantages A_e [N, R], the group's
gradient estimate is

    g_e = (1/N) sum_i sum_t A_e,t^(i) grad_theta log pi(y_t^(i))        (sum over tokens, mean over responses)

the gradient of E[R] per group: unbiased for ``rloo`` and every ``leave_one_out`` form. (The trainer's
token-mean normaliser divides by the group's token count, a random quantity when lengths vary, which
would bias even ``rloo``.) Each group costs one forward (its prompt once, shared by its rows:
``shared_prompt_stats``) and one backward per estimator through that forward; the advantages come
from the same forward's energies, so no separate scoring pass is needed. Gradients are taken over
``params`` (default: every trainable parameter; ``select_parameters`` names a subset) and returned
flat, or as a ``CountSketch`` of them when the flat vectors would not fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from creditrl.core.estimators import compute_advantages
from creditrl.core.gradients import GradientStats
from creditrl.core.gradients.sketch import CountSketch
from creditrl.core.token_stats import TokenStats
from creditrl.runtime.rollout import RolloutBatch
from creditrl.runtime.scoring import response_stats

Estimators = Mapping[str, tuple[str, dict]]   # label -> (registered estimator name, its options)


@dataclass(frozen=True)
class GroupDraws:
    """grads [G, E, D] (flat or sketched) in the order of the estimators' labels; response_energy [B]
    Σ_t ŵ_t of each response; rewards [B]; lengths [B] valid tokens."""
    labels: tuple[str, ...]
    grads: Tensor
    response_energy: Tensor
    rewards: Tensor
    lengths: Tensor


def select_parameters(model, prefixes: Sequence[str] | None = None) -> list[Tensor]:
    """The trainable parameters whose names start with one of ``prefixes`` (None: all of them)."""
    chosen = [p for n, p in model.named_parameters() if p.requires_grad
              and (prefixes is None or any(n.startswith(x) for x in prefixes))]
    if not chosen:
        names = [n for n, p in model.named_parameters() if p.requires_grad][:8]
        raise ValueError(f"prefixes: expected a prefix of at least one trainable parameter name (e.g. {names}), "
                         f"got {list(prefixes or [])}")
    return chosen


def rollout_token_stats(model, batch: RolloutBatch, rows: Tensor | slice, temperature: float,
                        shared_prompts: bool = False) -> TokenStats:
    """TokenStats [n, R] of the response tokens of ``rows``, differentiable in the parameters; with
    ``shared_prompts`` each group's prompt runs once (same values, fewer FLOPs)."""
    return response_stats(model, batch.input_ids[rows], batch.attention_mask[rows], batch.position_ids[rows],
                          batch.response_mask[rows], batch.prompt_len, temperature=temperature,
                          group=batch.group[rows] if shared_prompts else None)


def group_advantages(batch: RolloutBatch, rows: slice, energy: Tensor, estimators: Estimators) -> Tensor:
    """[E, n, R] advantages of every estimator on the same responses (rows of one or more groups)."""
    mask = batch.response_mask[rows, batch.prompt_len:] > 0
    return torch.stack([compute_advantages(name, rewards=batch.rewards[rows], mask=mask, group=batch.group[rows],
                                           energy=energy, **options) for name, options in estimators.values()])


def _flat(grads: Sequence[Tensor | None], params: Sequence[Tensor], sketch: CountSketch | None) -> Tensor:
    if sketch is not None:
        return sketch(grads)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])


def group_gradients(model, batch: RolloutBatch, estimators: Estimators, *, temperature: float,
                    params: Sequence[Tensor] | None = None, sketch: CountSketch | None = None,
                    shared_prompts: bool = True) -> GroupDraws:
    """Every group's gradient under every estimator (module docstring). Groups are the batch's
    contiguous blocks of rows (as ``generate_rollouts`` lays them out). ``shared_prompts=False``
    scores a group's rows in one plain forward (faster for tiny models, where a forward's fixed cost
    outweighs the prompt's FLOPs)."""
    params = list(params) if params is not None else select_parameters(model)
    sizes = torch.unique_consecutive(batch.group, return_counts=True)[1].tolist()
    if len(sizes) != len(torch.unique(batch.group)):
        raise ValueError("batch: expected each group's rows to be contiguous, got interleaved group ids")
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    draws, energies, start = [], [], 0
    for size in sizes:                       # one Monte-Carlo draw per group: a forward, E backwards
        rows = slice(start, start + size)
        stats = rollout_token_stats(model, batch, rows, temperature, shared_prompts=shared_prompts)
        energy = stats.energy.detach()
        energies.append(torch.where(mask[rows], energy.double(), 0.0).sum(1))
        cotangents = group_advantages(batch, rows, energy, estimators) / size
        last = cotangents.shape[0] - 1
        draws.append(torch.stack([
            _flat(torch.autograd.grad(stats.logp, params, grad_outputs=c, retain_graph=e < last, allow_unused=True),
                  params, sketch) for e, c in enumerate(cotangents)]))
        start += size
    return GroupDraws(tuple(estimators), torch.stack(draws), torch.cat(energies), batch.rewards.clone(),
                      mask.sum(1))


def per_token_grad_sq_norms(model, params: Sequence[Tensor], batch: RolloutBatch, row: int,
                            temperature: float) -> tuple[Tensor, Tensor]:
    """Exact ||grad_theta log pi(y_t)||^2 [R] for every response token of ``row``, and
    ||sum_t grad_theta log pi(y_t)||^2.

    One forward of the row, then one vmapped backward over one-hot cotangents (one per token).
    The log-probs come from a plain log-softmax: token_stats' fused backward has no vmap rule,
    so this is for small vocabularies (the [1, R, V] tensor is kept)."""
    p = batch.prompt_len
    rows = slice(row, row + 1)
    logits = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
                   position_ids=batch.position_ids[rows], use_cache=False).logits[:, p - 1:-1]
    tokens = batch.input_ids[rows, p:]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[..., None])[..., 0]  # [1, R]
    valid = torch.nonzero(batch.response_mask[row, p:] > 0).flatten()
    if valid.numel() == 0:
        return torch.zeros(logp.shape[1], dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    onehot = torch.zeros(valid.numel(), *logp.shape)
    onehot[torch.arange(valid.numel()), 0, valid] = 1.0
    grads = torch.autograd.grad(logp, list(params), grad_outputs=onehot, is_grads_batched=True)
    flat = torch.cat([g.reshape(valid.numel(), -1) for g in grads], dim=1).double()  # [T_valid, P]
    full = torch.zeros(logp.shape[1], dtype=torch.float64).index_put((valid,), flat.pow(2).sum(-1))
    return full, flat.sum(0).pow(2).sum()


def with_derived(stats: GradientStats, group_size: int) -> GradientStats:
    """Add ``dr_grpo`` = (N−1)/N · ``rloo`` exactly (its advantage is; tested), when rloo was measured."""
    if "rloo" not in stats.names or "dr_grpo" in stats.names:
        return stats
    return stats.with_multiple("dr_grpo", "rloo", (group_size - 1) / group_size)
