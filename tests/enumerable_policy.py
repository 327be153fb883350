"""An autoregressive policy small enough to enumerate every outcome of a group (shared by the tests of
the leave-one-out estimators and of the gradient-quality module): 3 positions, parameters shared
across positions (a bigram table plus a position slope), vocabulary 2 (fixed length) or 3 with EOS
(EOS-ended lengths), groups of 3, exact scores by autograd, all in float64."""
from __future__ import annotations

import itertools
import math

import torch

from creditrl.core.estimators import build_batch
from creditrl.core.estimators.registry import get_estimator

STEPS, VOCAB, EOS, GROUP = 3, 3, 2, 3


def policy_logits(theta: torch.Tensor, prev: int, t: int, eos: bool) -> torch.Tensor:
    """Parameters shared across positions: a bigram table row (by the previous token; 3 = start)
    plus a position slope; EOS masked out in the fixed-length policy."""
    table, slope = theta[:12].view(4, VOCAB), theta[12:]
    logits = table[prev] + t * slope
    return logits if eos else logits.masked_fill(torch.arange(VOCAB) == EOS, -math.inf)


def reward(seq: tuple[int, ...]) -> float:
    """Exactly representable in float32: 0.5 per token 1, + 1 if the response ends with EOS."""
    return 0.5 * seq.count(1) + (1.0 if seq and seq[-1] == EOS else 0.0)


def enumerate_policy(theta: torch.Tensor, eos: bool):
    """Every response: (tokens, probability, per-token scores [T, P], energies [T]) in float64."""
    out = []

    def walk(prefix: tuple[int, ...]):
        if len(prefix) == STEPS or (prefix and prefix[-1] == EOS):
            out.append(prefix)
            return
        for y in range(VOCAB if eos else VOCAB - 1):
            walk(prefix + (y,))

    walk(())
    rows = []
    for seq in out:
        logp, scores, energy = theta.new_zeros(()), theta.new_zeros(STEPS, theta.numel()), theta.new_zeros(STEPS)
        for t, y in enumerate(seq):
            th = theta.detach().requires_grad_(True)
            lp = torch.log_softmax(policy_logits(th, seq[t - 1] if t else 3, t, eos), -1)
            (scores[t],) = torch.autograd.grad(lp[y], th)
            pi = lp.detach().exp()
            energy[t] = ((torch.arange(VOCAB) == y).double() - pi).pow(2).sum()
            logp = logp + lp.detach()[y]
        rows.append((seq, logp.exp(), scores, energy))
    return rows


def true_gradient(theta: torch.Tensor, eos: bool) -> torch.Tensor:
    th = theta.detach().requires_grad_(True)
    total = th.new_zeros(())
    for seq, *_ in enumerate_policy(theta, eos):
        logp = sum(torch.log_softmax(policy_logits(th, seq[t - 1] if t else 3, t, eos), -1)[y]
                   for t, y in enumerate(seq))
        total = total + logp.exp() * reward(seq)
    return torch.autograd.grad(total, th)[0]


THETA = torch.linspace(-1.0, 1.2, 15, dtype=torch.float64).sin() * 1.5


def estimator_output(name: str, batch: dict, **options) -> torch.Tensor:
    """The registered function's own output (float64 for the leave-one-out forms), on valid tokens."""
    built = build_batch(**batch)
    out = get_estimator(name).fn(built, **options).double()
    return out[:, None] * built.valid if out.dim() == 1 else out


def outcome_gradients(theta: torch.Tensor, eos: bool, estimators: list[tuple[str, dict]]):
    """(grads [O, E, P], probs [O]): the group gradient ĝ = (1/N) Σ_i Σ_t A_t^(i) s_t^(i) of every
    estimator (name, options) for every one of the O outcomes of a group of 3, with its probability."""
    rows = enumerate_policy(theta, eos)
    tuples = torch.tensor(list(itertools.product(range(len(rows)), repeat=GROUP))).flatten()   # [O·N]
    lengths = torch.tensor([len(r[0]) for r in rows])[tuples]
    batch = dict(rewards=torch.tensor([reward(r[0]) for r in rows])[tuples].float(),
                 mask=torch.arange(STEPS)[None, :] < lengths[:, None],
                 group=torch.arange(tuples.numel() // GROUP).repeat_interleave(GROUP),
                 energy=torch.stack([r[3] for r in rows])[tuples].float())
    scores = torch.stack([r[2] for r in rows])[tuples]                                         # [O·N, T, P]
    grads = []
    for name, options in estimators:
        adv = estimator_output(name, batch, **options)
        grads.append(torch.einsum("bt,btp->bp", adv, scores).view(-1, GROUP, theta.numel()).sum(1) / GROUP)
    prob = torch.stack([r[1] for r in rows])[tuples].view(-1, GROUP).prod(1)
    return torch.stack(grads, 1), prob
