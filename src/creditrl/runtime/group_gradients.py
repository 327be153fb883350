"""Exact policy gradients of one group under several advantage estimators (and losses), and exact
per-token gradient norms: the model side of ``creditrl.core.gradients``.

For a group of N responses to one prompt and an estimator e with advantages A_e [N, R], the group's
plain gradient estimate is

    g_e = (1/N) sum_i sum_t A_e,t^(i) grad_theta log pi(y_t^(i))        (sum over tokens, mean over responses)

the gradient of E[R] per group: unbiased for ``rloo`` and every ``leave_one_out`` form. A row may
instead measure a configured policy loss L (``creditrl.core.losses.PolicyLoss``: its aggregation and
terms) at the rollout policy, ratio 1: g = -(1/N) grad_theta (count * L), count the aggregation's
denominator (``loss_cotangent``). Each group costs one forward (its prompt once, shared by its rows:
``packed_prompt_stats``) and one backward per distinct non-zero cotangent through that forward; the
advantages come from the same forward's energies, so no separate scoring pass is needed.

A batch-level estimator (one that reads statistics of the whole batch: ``EstimatorSpec.uses_batch``,
e.g. the James–Stein ``shrinkage`` baseline's across-prompt mean, ``reinforce_plus_plus``'s batch
whitening, ``grpo`` with ``scale="batch"``) has its advantages computed once over every group of the
batch passed in (``batch_advantages``), which is then a training step's batch: computed group by group
it would see one prompt and degenerate (``shrinkage`` into ``dr_grpo``). Its groups' gradients are then
not independent draws: they share the batch's statistics, so a caller that resamples groups must keep
a batch's groups in one unit (``GradientMoments`` units) and read the variance of the batch's sum
(``gradient_quality(per_unit=True)``), not the per-group variance, which leaves out their covariance.
Gradients are taken over ``params`` (default: every trainable parameter; ``select_parameters`` names a subset)
and returned flat, or as a ``CountSketch`` of them when the flat vectors would not fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor

from creditrl.core.estimators import compute_advantages
from creditrl.core.estimators.registry import get_estimator
from creditrl.core.gradients import GradientStats
from creditrl.core.gradients.sketch import CountSketch
from creditrl.core.losses import PolicyLoss
from creditrl.core.token_stats import TokenStats
from creditrl.runtime.rollout import RolloutBatch
from creditrl.runtime.scoring import response_stats
from creditrl.utils.validate import check_finite

Estimators = Mapping[str, tuple[str, dict]]   # label -> (registered estimator name, its options)
Losses = Mapping[str, "PolicyLoss | None"]     # label -> the policy loss whose gradient that row measures
PROPORTIONAL_RTOL = 1e-6    # ``dedupe``: a cotangent within this of α × an earlier one reuses that gradient × α


@dataclass(frozen=True)
class GroupDraws:
    """grads [G, E, D] (flat or sketched) in the order of the estimators' labels; ``preconditioned``
    [G, E, D] the same gradients times the ``precondition`` factors (None without them);
    response_energy [B] Σ_t ŵ_t of each response; rewards [B]; lengths [B] valid tokens; ``backward``
    the backward passes run (zero and, with ``dedupe``, proportional cotangents need none)."""
    labels: tuple[str, ...]
    grads: Tensor
    response_energy: Tensor
    rewards: Tensor
    lengths: Tensor
    preconditioned: Tensor | None = None
    backward: int = 0


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


def batch_level_labels(estimators: Estimators) -> list[str]:
    """The labels whose estimator with its options reads batch statistics (``EstimatorSpec.uses_batch``)."""
    return [label for label, (name, options) in estimators.items() if get_estimator(name).uses_batch(options)]


def batch_advantages(batch: RolloutBatch, estimators: Estimators) -> dict[str, Tensor]:
    """label -> [B, R] advantages over every group of ``batch`` (a training step's batch) of each
    batch-level estimator (``batch_level_labels``). Energies are per-group forward results, so a
    batch-level estimator that also needs them is refused (no built-in one does)."""
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    out = {}
    for label in batch_level_labels(estimators):
        name, options = estimators[label]
        if get_estimator(name).needs_energy:
            raise ValueError(f"estimators: {label!r} is batch-level and needs energies, which group_gradients "
                             f"computes group by group; expected a batch-level estimator without energies or a "
                             f"group-level one with them, got {name!r}")
        out[label] = compute_advantages(name, rewards=batch.rewards, mask=mask, group=batch.group,
                                        **reward_parts(batch, name, slice(None)), **options)
    return out


def reward_parts(batch: RolloutBatch, name: str, rows) -> dict:
    """The reward components of ``rows`` for an estimator that reads them (gdpo), as the trainer
    passes them; {} otherwise. Without them gdpo would score the summed reward, another estimator."""
    if not get_estimator(name).reward_components or batch.components is None:
        return {}
    return dict(components=batch.components[rows], component_weights=batch.component_weights)


def group_advantages(batch: RolloutBatch, rows: slice, energy: Tensor, estimators: Estimators,
                     batch_wide: Mapping[str, Tensor] | None = None) -> Tensor:
    """[E, n, R] advantages of every estimator on the same responses (rows of one or more groups);
    the labels of ``batch_wide`` (``batch_advantages``, [B, R] over the whole batch) are its rows."""
    mask = batch.response_mask[rows, batch.prompt_len:] > 0
    wide = batch_wide or {}
    return torch.stack([wide[label][rows].to(mask.device) if label in wide else
                        compute_advantages(name, rewards=batch.rewards[rows], mask=mask, group=batch.group[rows],
                                           energy=energy, **reward_parts(batch, name, rows), **options)
                        for label, (name, options) in estimators.items()])


def loss_cotangent(loss: PolicyLoss, logp: Tensor, advantages: Tensor, mask: Tensor, rollout_logp: Tensor,
                   entropy: Tensor, truncated: Tensor | None = None, old_logp: Tensor | None = None) -> Tensor:
    """−∂(count · L)/∂log π [n, R] of the policy loss ``L`` (``loss``) at the rollout policy (ratio 1:
    π_old = π_θ; the reference of a KL term is π_θ itself, as at the start of training) or, given
    ``old_logp`` [n, R], at ratios r = π_θ/π_old against it (stale data), ``count``
    its aggregation's denominator (``agg_count``): count · L is the loss's sum over the group's kept
    tokens (or rows) before the batch-wide normaliser, so the gradient of a step of many groups is
    Σ_groups of these over the step's count (token-mean: a constant to first order across groups).
    ``truncated`` [n]: responses cut at the token cap (``mask_truncated``; None: none cut). The
    entropy is data here: a term's gradient through it (the entropy bonus) is not a cotangent on
    log π and is left out (``gradient_outside_logp``)."""
    leaf = logp.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        value, metrics = loss(leaf, logp.detach() if old_logp is None else old_logp.detach(), advantages, mask,
                              ref_logp=logp.detach(),
                              rollout_logp=rollout_logp, entropy=entropy.detach(),
                              truncated=torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
                              if truncated is None else truncated)
        (grad,) = torch.autograd.grad(value * max(metrics["agg_count"], 0.0), leaf, allow_unused=True)
    return torch.zeros_like(leaf) if grad is None else -grad.detach()


_ADDITIVE: dict[int, tuple[PolicyLoss, list[str]]] = {}


def _dummy_batches() -> list[tuple[Tensor, ...]]:
    """Two 6×8 batches of two groups of 3 rows (logp, advantages, mask, entropy), float64: random
    (probabilities from e^-12 to 1, advantages of both signs), and one whose groups differ in every
    batch-level statistic (all improbable tokens, positive advantages, one group's entropies low and
    the other's high: a quantile over the batch differs from each group's own)."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(6, 8, dtype=torch.bool)
    random_batch = (-torch.rand(6, 8, generator=gen, dtype=torch.float64) * 12,
                    torch.randn(6, 8, generator=gen, dtype=torch.float64), mask,
                    torch.rand(6, 8, generator=gen, dtype=torch.float64) * 3)
    entropy = torch.rand(6, 8, generator=gen, dtype=torch.float64)
    entropy[3:] += 3
    skewed = (-7 - torch.rand(6, 8, generator=gen, dtype=torch.float64) * 5,
              torch.rand(6, 8, generator=gen, dtype=torch.float64) + 0.1, mask, entropy)
    return [random_batch, skewed]


_ADDITIVE: dict[int, tuple[PolicyLoss, list[str]]] = {}


def non_additive_terms(loss: PolicyLoss) -> list[str]:
    """The active terms of ``loss`` (the default aggregation aside) whose count · L over two groups at
    once is not the sum of the groups' own on dummy batches (``_dummy_batches``): a term whose value
    for a group depends on the rest of the mini-batch (e.g. STAPO's or top_entropy's quantile over
    it, clip_cov's draw among the batch's covariance outliers). Such a loss cannot be measured group
    by group exactly. Cached per loss object."""
    cached = _ADDITIVE.get(id(loss))
    if cached is not None and cached[0] is loss:
        return cached[1]
    names = []
    for term, options in loss.terms:
        if not term.active(options) or (term.stage == "aggregate" and term.flat):   # delta_l_norm is checked
            continue
        alone = PolicyLoss({term.name: options, "aggregation": {"agg": "seq-mean-token-sum"}})
        for logp, adv, mask, entropy in _dummy_batches():
            cut = torch.arange(6) % 3 == 2                   # one truncated response per group
            joint = loss_cotangent(alone, logp, adv, mask, logp, entropy, cut)
            split = torch.cat([loss_cotangent(alone, logp[r], adv[r], mask[r], logp[r], entropy[r], cut[r])
                               for r in (slice(0, 3), slice(3, 6))])
            if not torch.allclose(joint, split, rtol=1e-9, atol=1e-12):
                names.append(term.name)
                break
    _ADDITIVE[id(loss)] = (loss, names)
    return names


def gradient_outside_logp(loss: PolicyLoss) -> list[str]:
    """The active terms of ``loss`` whose gradient also reaches the model through an input other than
    log π (``differentiates``: the entropy bonus through the entropy): ``loss_cotangent`` leaves that
    part out."""
    return [term.name for term, options in loss.terms if term.differentiates and term.active(options)]


def row_cotangents(batch: RolloutBatch, rows: slice, stats: TokenStats, estimators: Estimators,
                   losses: Losses | None, batch_wide: Mapping[str, Tensor] | None = None,
                   off_policy: bool = False) -> Tensor:
    """[E, n, R] the cotangent on log π of every row: A_e / N (the plain policy gradient) or, for a
    row with a loss, ``loss_cotangent`` / N, at ratio 1 or, with ``off_policy``, at the ratios
    π_θ/π_old against ``batch.rollout_logp`` (the behaviour policy that sampled the batch). The rows of one loss whose terms are all additive over
    groups (``non_additive_terms``) share one call on their stacked copies of the group (count · L
    over the stack is the sum of the copies' own)."""
    size = rows.stop - rows.start
    advantages = group_advantages(batch, rows, stats.energy.detach(), estimators, batch_wide).to(stats.logp.dtype)
    mask = batch.response_mask[rows, batch.prompt_len:] > 0
    truncated = (~batch.stopped[rows].to(mask.device)                 # for mask_truncated
                 if any(loss is not None and loss.needs_truncated for loss in (losses or {}).values()) else None)
    rollout = (stats.logp.detach() if batch.rollout_logp is None     # no sampler log-probs: the policy's own
               else batch.rollout_logp[rows, batch.prompt_len:].to(stats.logp.dtype))
    old = rollout if off_policy else None
    out = advantages.clone()
    labels = list(estimators)
    by_loss: dict[int, list[int]] = {}
    for e, label in enumerate(labels):
        loss = (losses or {}).get(label)
        if loss is not None:
            by_loss.setdefault(id(loss), []).append(e)
    for members in by_loss.values():
        loss = losses[labels[members[0]]]
        if non_additive_terms(loss):
            for e in members:
                out[e] = loss_cotangent(loss, stats.logp, advantages[e], mask, rollout, stats.entropy, truncated, old)
            continue
        k = len(members)
        stacked = loss_cotangent(loss, stats.logp.repeat(k, 1), advantages[members].flatten(0, 1), mask.repeat(k, 1),
                                 rollout.repeat(k, 1), stats.entropy.repeat(k, 1),
                                 None if truncated is None else truncated.repeat(k),
                                 None if old is None else old.repeat(k, 1))
        out[members] = stacked.view(k, *mask.shape).to(out.dtype)
    return out / size


_DRIVEN: dict[int, tuple[PolicyLoss, bool]] = {}


def advantage_driven(loss: PolicyLoss | None) -> bool:
    """Whether ``loss``'s cotangent is 0 wherever every advantage is 0 (on the dummy batches of
    ``_dummy_batches``: true of the clipped surrogate, its aggregations, STAPO and the trace; not of
    a KL term). The plain gradient (None) is. Cached per loss object."""
    if loss is None:
        return True
    cached = _DRIVEN.get(id(loss))
    if cached is None or cached[0] is not loss:
        driven = all(not bool(loss_cotangent(loss, logp, torch.zeros_like(adv), mask, logp, entropy).abs().max() > 0)
                     for logp, adv, mask, entropy in _dummy_batches())
        cached = _DRIVEN[id(loss)] = (loss, driven)
    return cached[1]


def zero_group(batch: RolloutBatch, rows: slice, estimators: Estimators, losses: Losses | None,
               batch_wide: Mapping[str, Tensor] | None = None) -> bool:
    """Whether every row of this group is 0 without a forward: its rewards are all equal, every
    estimator gives exactly 0 advantages under two random positive energies (a baseline that is a
    weighted mean of equal rewards is that reward, whatever the weights; a batch-level one's
    advantages come from ``batch_wide``, and need not be 0: the shrinkage baseline pulls the group's
    mean toward the batch's), and every row's loss is ``advantage_driven``."""
    rewards = batch.rewards[rows]
    if bool((rewards != rewards[0]).any()) or not all(advantage_driven((losses or {}).get(label))
                                                      for label in estimators):
        return False
    mask = batch.response_mask[rows, batch.prompt_len:] > 0
    gen = torch.Generator().manual_seed(rows.start)
    for _ in range(2):
        energy = (torch.rand(mask.shape, generator=gen) + 0.1).to(rewards.device)
        if bool(group_advantages(batch, rows, energy, estimators, batch_wide).abs().max() > 0):
            return False
    return True


def _proportional(c: Tensor, earlier: list[tuple[int, Tensor]]) -> tuple[int, float] | None:
    """(index, α) of an earlier cotangent with c = α × it within ``PROPORTIONAL_RTOL``, or None."""
    for i, d in earlier:
        pivot = int(d.abs().argmax())
        alpha = float(c.flatten()[pivot] / d.flatten()[pivot])
        if torch.allclose(c, alpha * d, rtol=0.0, atol=PROPORTIONAL_RTOL * float(c.abs().max())):
            return i, alpha
    return None


def _flat(grads: Sequence[Tensor | None], params: Sequence[Tensor], sketch: CountSketch | None,
          factors: Sequence[Tensor] | None = None) -> Tensor:
    if factors is not None:
        grads = [None if g is None else g * f for g, f in zip(grads, factors)]
    if sketch is not None:
        return sketch(grads)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])


def _vectors(per_row: list[list[Tensor | None]], params: Sequence[Tensor], sketch: CountSketch | None,
             factors: Sequence[Tensor] | None) -> Tensor:
    """[R, D] flat (or [R, dim] sketched) gradients of R rows given per parameter, times ``factors``."""
    return torch.stack([_flat(grads, params, sketch, factors) for grads in per_row])


def _group_draw(stats: TokenStats, cotangents: Tensor, params: list[Tensor], sketch: CountSketch | None,
                precondition: Sequence[Tensor] | None, dedupe: bool) -> tuple[Tensor, Tensor | None, int]:
    """One group's gradient of every row ([E, D], preconditioned or None) and the backward passes run."""
    plan, earlier = [], []                      # per row: ("zero",) / ("backward", i) / ("scaled", j, α)
    for e, c in enumerate(cotangents):
        check_finite(f"cotangents[{e}]", c)      # a NaN would read as 0 below (NaN > 0 is False)
        if not bool(c.abs().max() > 0):
            plan.append(("zero",))
            continue
        same = _proportional(c, earlier) if dedupe else None
        if same is not None:
            plan.append(("scaled", *same))
        else:
            plan.append(("backward", e))
            earlier.append((e, c))
    computed = [e for e, _ in earlier]
    grads = [torch.autograd.grad(stats.logp, params, grad_outputs=cotangents[e], retain_graph=e != computed[-1],
                                 allow_unused=True) for e in computed]
    dim = sketch.dim if sketch is not None else sum(p.numel() for p in params)
    dtype = torch.float64 if sketch is not None else params[0].dtype
    device = params[0].device if sketch is None else torch.device("cpu")

    def assemble(factors) -> Tensor:
        vectors = dict(zip(computed, _vectors(grads, params, sketch, factors))) if computed else {}
        rows = [vectors[step[1]] * step[2] if step[0] == "scaled" else vectors[e] if step[0] == "backward"
                else torch.zeros(dim, dtype=dtype, device=device) for e, step in enumerate(plan)]
        return torch.stack(rows)

    return assemble(None), assemble(precondition) if precondition is not None else None, len(computed)


def group_gradients(model, batch: RolloutBatch, estimators: Estimators, *, temperature: float,
                    params: Sequence[Tensor] | None = None, sketch: CountSketch | None = None,
                    shared_prompts: bool = True, losses: Losses | None = None,
                    precondition: Sequence[Tensor] | None = None, dedupe: bool = False,
                    skip_zero: bool = False, batch_wide: Mapping[str, Tensor] | None = None,
                    off_policy: bool = False) -> GroupDraws:
    """Every group's gradient under every estimator (module docstring). Groups are the batch's
    contiguous blocks of rows (as ``generate_rollouts`` lays them out). ``shared_prompts=False``
    scores a group's rows in one plain forward (faster for tiny models, where a forward's fixed cost
    outweighs the prompt's FLOPs). ``losses``: label -> the policy loss that row measures
    (``loss_cotangent``; missing or None: the plain policy gradient). ``precondition``: one factor
    tensor per parameter (e.g. 1/√v̂ of Adam) for ``GroupDraws.preconditioned``. A row whose
    cotangent is 0 (e.g. a group whose rewards are all equal) gets 0 without a backward; with
    ``dedupe`` a row whose cotangent is α × an earlier row's (``dr_grpo`` = (N−1)/N · ``rloo``, or
    the same estimator under two losses that agree) gets α × that row's gradient. With ``skip_zero``
    a group whose every row is provably 0 (``zero_group``) skips even its forward (its response
    energies are then reported as 0). Batch-level estimators (module docstring) get their advantages
    over the whole ``batch``, or from ``batch_wide`` (label -> [B, R] rows aligned with ``batch``'s,
    ``batch_advantages`` of a larger step batch that ``batch`` is a slice of: `creditrl diagnose`'s round).
    ``off_policy``: the loss rows see the ratios π_θ/π_old with π_old = ``batch.rollout_logp`` (a batch
    sampled by another policy, ``model`` the current one) instead of ratio 1; the plain rows are
    A·∇log π_θ on those samples either way."""
    params = list(params) if params is not None else select_parameters(model)
    if off_policy and batch.rollout_logp is None:
        raise ValueError("batch: off_policy needs the behaviour log-probs in batch.rollout_logp, got None")
    sizes = torch.unique_consecutive(batch.group, return_counts=True)[1].tolist()
    if len(sizes) != len(torch.unique(batch.group)):
        raise ValueError("batch: expected each group's rows to be contiguous, got interleaved group ids")
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    if batch_wide is None:
        batch_wide = batch_advantages(batch, estimators)
    elif set(batch_wide) != set(batch_level_labels(estimators)):
        raise ValueError(f"batch_wide: expected the batch-level labels {batch_level_labels(estimators)}, got "
                         f"{sorted(batch_wide)}")
    draws, scaled, energies, start, backward = [], [], [], 0, 0
    dim = sketch.dim if sketch is not None else sum(p.numel() for p in params)
    for size in sizes:                       # one Monte-Carlo draw per group: a forward, E backwards
        rows = slice(start, start + size)
        if skip_zero and zero_group(batch, rows, estimators, losses, batch_wide):
            zeros = torch.zeros(len(estimators), dim, dtype=torch.float64 if sketch is not None else params[0].dtype,
                                device="cpu" if sketch is not None else params[0].device)
            draws.append(zeros)
            scaled.append(zeros if precondition is not None else None)
            energies.append(torch.zeros(size, dtype=torch.float64, device=mask.device))
            start += size
            continue
        stats = rollout_token_stats(model, batch, rows, temperature, shared_prompts=shared_prompts)
        energies.append(torch.where(mask[rows], stats.energy.detach().double(), 0.0).sum(1))
        cotangents = row_cotangents(batch, rows, stats, estimators, losses, batch_wide, off_policy)
        plain, pre, runs = _group_draw(stats, cotangents, params, sketch, precondition, dedupe)
        draws.append(plain)
        scaled.append(pre)
        backward += runs
        start += size
    return GroupDraws(tuple(estimators), torch.stack(draws), torch.cat(energies), batch.rewards.clone(),
                      mask.sum(1), torch.stack(scaled) if precondition is not None else None, backward)


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
