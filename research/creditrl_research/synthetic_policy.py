"""A synthetic autoregressive policy with exact scores and an exact gradient of its success rate, for
the horizon experiment: thousands of tokens on a CPU.

A response has at most T tokens from the vocabulary {0, 1, EOS}. Its first ceil(T/2) positions are
the *pre* region, holding F *forks* spread evenly over it; the rest is the *tail*. Every position's
logits are a row of the parameter table theta [rows, 3], chosen by the position's kind (``shared``:
3 rows, pre / fork / tail, shared across positions as in a language model) or by the position itself
(not shared: T rows, each position its own parameters). Impossible tokens have logit -inf.

- a fork is a decision: token 0 (right) with probability p, else 1 (wrong);
- a pre or tail position is near-certain: token 1 is an error with probability eps = errors / T
  (``errors`` expected per response at any T), else 0;
- with ``eos``, a tail position ends the response with probability h = stop / (T - ceil(T/2))
  (the EOS token is the response's last, trained-on token); without, every response has T tokens.

Reward: 1 if the response holds no error and at least ``need`` right forks, else 0 (a terminal,
sequence-level reward of moderate success rate). Its success probability J(theta) has a closed form
(a Poisson-binomial over the forks times the error-free probabilities of the pre region and of the
tail, whose length is geometric), so grad J is exact by autograd, in float64. Scores are exact too:
d log pi(y_t) / d theta = e_y - pi on the position's row (softmax logits are the parameters).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from creditrl.core.estimators import compute_advantages
from creditrl.utils.validate import check_int, check_range

VOCAB, EOS = 3, 2
PRE, FORK, TAIL = 0, 1, 2


@dataclass(frozen=True)
class SyntheticPolicy:
    """theta [rows, 3] float64 logits (-inf where impossible); kind [T] PRE/FORK/TAIL per position;
    row [T] the parameter row of each position; need: right forks required; eos: EOS-ended lengths."""
    theta: Tensor
    kind: Tensor
    row: Tensor
    need: int
    eos: bool

    @property
    def horizon(self) -> int:
        return self.kind.numel()

    @property
    def probs(self) -> Tensor:
        return torch.softmax(self.theta, -1)

    def energy_table(self) -> Tensor:
        """[rows, 3] ŵ = ||e_y − π_row||² (OTB eq. 7) of token y at a position of each row."""
        p = self.probs
        return (torch.eye(VOCAB, dtype=p.dtype)[None] - p[:, None]).square().sum(-1)


def make_policy(horizon: int, *, forks: int = 4, need: int = 3, fork_prob: float = 0.6, errors: float = 0.4,
                stop: float = 1.0, eos: bool = False, shared: bool = True) -> SyntheticPolicy:
    """The policy of the module docstring (``forks`` and ``need`` shrink to fit a short pre region)."""
    horizon, forks = check_int("horizon", horizon, 1), check_int("forks", forks, 1)
    check_range("fork_prob", fork_prob, 0.0, 1.0, low_inclusive=False, high_inclusive=False)
    check_range("errors", errors, 0.0, horizon, low_inclusive=False, high_inclusive=False)
    pre = -(-horizon // 2)
    forks = min(forks, pre)
    need = min(check_int("need", need, 1), forks)
    kind = torch.full((horizon,), PRE, dtype=torch.int64)
    kind[((torch.arange(forks, dtype=torch.float64) + 0.5) * pre / forks).long()] = FORK
    kind[pre:] = TAIL
    eps, tail = errors / horizon, horizon - pre
    hazard = stop / tail if eos and tail else 0.0
    check_range("stop", hazard, 0.0, 1.0 - eps, high_inclusive=False)
    ninf = -math.inf
    rows = torch.tensor([[math.log1p(-eps), math.log(eps), ninf],
                         [math.log(fork_prob), math.log1p(-fork_prob), ninf],
                         [math.log1p(-eps - hazard), math.log(eps), math.log(hazard) if hazard else ninf]],
                        dtype=torch.float64)
    if shared:
        return SyntheticPolicy(rows, kind, kind.clone(), need, bool(hazard))
    return SyntheticPolicy(rows[kind].clone(), kind, torch.arange(horizon), need, bool(hazard))


def random_policy(horizon: int, generator: torch.Generator, *, eos: bool, shared: bool = True,
                  forks: int = 4, need: int = 3) -> SyntheticPolicy:
    """An instance of the family: fork probability ~ U(0.5, 0.75), expected errors per response
    ~ U(0.2, 0.6), expected EOS events over the tail ~ U(0.5, 1.5). The same generator state gives
    the same draws at every horizon (instances pair up across T)."""
    fork_prob, errors, stop = (float(v) for v in torch.rand(3, generator=generator, dtype=torch.float64))
    return make_policy(horizon, forks=forks, need=need, fork_prob=0.5 + 0.25 * fork_prob, errors=0.2 + 0.4 * errors,
                       stop=0.5 + stop, eos=eos, shared=shared)


def success_probability(policy: SyntheticPolicy, theta: Tensor | None = None) -> Tensor:
    """J = P(no error, at least ``need`` right forks) in closed form, differentiable in ``theta``."""
    p = torch.softmax(policy.theta if theta is None else theta, -1)[policy.row]          # [T, 3] per position
    pre_ok = torch.where(policy.kind == PRE, p[:, 0], 1.0).prod()
    right = p[policy.kind == FORK, 0]
    counts = torch.zeros(right.numel() + 1, dtype=p.dtype)
    counts[0] = 1.0
    for q in right:                                   # Poisson-binomial over the F forks (F <= 4)
        counts = torch.cat([counts[:1] * (1 - q), counts[1:] * (1 - q) + counts[:-1] * q])
    tail = p[policy.kind == TAIL]
    survive = torch.cumprod(torch.cat([tail.new_ones(1), tail[:, 0]]), 0)              # no error, no EOS yet
    tail_ok = (survive[:-1] * tail[:, EOS]).sum() + survive[-1]
    return pre_ok * counts[policy.need:].sum() * tail_ok


def true_gradient(policy: SyntheticPolicy) -> Tensor:
    """grad_theta J flattened [rows · 3] (0 on impossible tokens), float64."""
    theta = policy.theta.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(success_probability(policy, theta), theta)
    return grad.reshape(-1)


def sample(policy: SyntheticPolicy, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens [count, T] int64, mask [count, T] bool, rewards [count] float32). Tokens are independent
    given their position's row, so all positions are drawn at once; the mask ends at the first EOS."""
    probs = policy.probs[policy.row]                                                    # [T, 3]
    cdf = probs.cumsum(-1)
    cdf[:, 1] = torch.where(probs[:, EOS] > 0, cdf[:, 1], 2.0)   # no rounding residue can draw an impossible EOS
    u = torch.rand(count, policy.horizon, generator=generator, dtype=torch.float64)
    tokens = (u[..., None] > cdf[None, :, :-1]).sum(-1)
    ended = torch.cumsum((tokens == EOS).long(), 1)
    mask = (ended - (tokens == EOS).long()) == 0                                         # up to the first EOS
    tokens = tokens * mask
    errors = ((tokens == 1) & (policy.kind != FORK) & mask).any(1)
    right = ((tokens == 0) & (policy.kind == FORK) & mask).sum(1)
    return tokens, mask, ((~errors) & (right >= policy.need)).float()


def group_gradients(policy: SyntheticPolicy, tokens: Tensor, mask: Tensor, rewards: Tensor, group_size: int,
                    estimators: dict[str, tuple[str, dict]]) -> Tensor:
    """[G, E, rows · 3]: each group's gradient (1/N) Σ_i Σ_t A_t^(i) (e_{y_t} − π_{row(t)}) under every
    estimator (label -> (name, options)); rows are consecutive groups of ``group_size``."""
    B, T = tokens.shape
    rows, probs = policy.theta.shape[0], policy.probs
    energy = policy.energy_table()[policy.row[None, :], tokens].float() * mask
    group = torch.arange(B) // group_size
    adv = torch.stack([compute_advantages(name, rewards=rewards, mask=mask, group=group, energy=energy, **opts)
                       for name, opts in estimators.values()]).double()               # [E, B, T]
    E = adv.shape[0]
    key = (policy.row[None, :] * VOCAB + tokens).expand(E, B, T)
    chosen = adv.new_zeros(E, B, rows * VOCAB).scatter_add_(2, key, adv)               # Σ_t A [row, y]
    per_row = adv.new_zeros(E, B, rows).scatter_add_(2, policy.row.expand(E, B, T), adv)  # Σ_t A per row
    grads = chosen.view(E, B, rows, VOCAB) - per_row[..., None] * probs
    grads = torch.where(torch.isfinite(policy.theta), grads, 0.0)                     # impossible tokens: 0
    return grads.view(E, B // group_size, group_size, -1).sum(2).div_(group_size).transpose(0, 1)
