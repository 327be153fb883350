"""Simulated `creditrl diagnose` runs: the real rounds, stopping rule, statistics and verdicts
(``creditrl.tools.diagnose``) fed by sources whose truth is known exactly, on a simulated clock
(one second per prompt), so hundreds of runs take seconds.

- ``GaussianSource``: every row's gradient is c_e (μ + a_prompt + ε): efficiency exactly 1 for every
  row (equal signal-to-noise; different noise, partly shared), cosine exactly 1.
- ``EnumerableSource``: groups of 3 from the enumerable policy (tests/enumerable_policy.py), a
  prompt being one of several parameter vectors θ; exact values from every outcome of a group.
"""
from __future__ import annotations

import itertools
import math

import torch

from creditrl.core.estimators.labels import label_options
from creditrl.core.gradients import exact_quality
from creditrl.core.losses import PolicyLoss
from creditrl.runtime.group_gradients import GroupDraws
from creditrl.tools.diagnose.measure import Accumulator, measure
from creditrl.tools.diagnose.plan import REF, LossChoice, Plan
from creditrl.tools.diagnose.run import summarize
from creditrl.utils.threads import torch_threads
from enumerable_policy import GROUP, enumerate_policy, outcome_gradients, reward

PLAIN = LossChoice("configured", PolicyLoss(), "the plain policy gradient")


def sim_plan(labels: list[str], configured: str, *, prompts: int = 24, groups_per_prompt: int = 2, folds: int = 16,
             budget_prompts: int = 240, target_width: float = 0.1) -> Plan:
    """A plan over ``labels`` (``REF`` added) with diagnose's defaults; the budget counts prompts."""
    specs = {label: label_options(label, 2) for label in labels}
    return Plan(prompts=prompts, groups_per_prompt=groups_per_prompt, group_size=GROUP, folds=folds,
                estimators=specs, losses=(PLAIN,), configured=configured, batch=8, seed=0,
                target_width=target_width, budget_s=float(budget_prompts), adam=False)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class GaussianSource:
    """Rows ``names`` (REF first) with gradient c_e (μ + a_p + ρ z_k + sqrt(1 − ρ²) w_ek) (module
    docstring): a_p ~ N(0, σ_A²) per prompt, z_k and w_ek ~ N(0, σ_W²) per group."""

    def __init__(self, names, scales, clock: Clock, seed: int, *, dim: int = 16, signal: float = 0.25,
                 sigma_a: float = 0.6, sigma_w: float = 1.0, rho: float = 0.5, groups: int = 2):
        self.names, self.clock, self.groups = tuple(names), clock, groups
        self.scales = torch.tensor(scales, dtype=torch.float64)
        self.gen = torch.Generator().manual_seed(seed)
        self.mu = torch.full((dim,), signal, dtype=torch.float64)
        self.sigma_a, self.sigma_w, self.rho = sigma_a, sigma_w, rho

    def prompts(self, count: int) -> list:
        return list(range(count))

    def sample(self, problems):
        return problems

    def draws(self, sampled, index: int) -> GroupDraws:
        self.clock.now += 1.0
        m, e, d = self.groups, len(self.names), self.mu.numel()
        a = torch.randn(d, generator=self.gen, dtype=torch.float64) * self.sigma_a
        z = torch.randn(m, 1, d, generator=self.gen, dtype=torch.float64) * self.sigma_w
        w = torch.randn(m, e, d, generator=self.gen, dtype=torch.float64) * self.sigma_w
        grads = self.scales[None, :, None] * (self.mu + a + self.rho * z + math.sqrt(1 - self.rho ** 2) * w)
        rewards = torch.tensor([0.0, 1.0, 1.0] * m)
        return GroupDraws(self.names, grads.float(), torch.zeros(3 * m), rewards, torch.full((3 * m,), 3))


class EnumerableSource:
    """Prompts drawn uniformly from ``thetas``; each group one outcome of the enumerable policy."""

    def __init__(self, plan: Plan, thetas, eos: bool, clock: Clock, seed: int):
        self.plan, self.clock, self.gen = plan, clock, torch.Generator().manual_seed(seed)
        self.outcomes, self.rewards = enumerated(tuple(plan.rows.items()), tuple(tuple(t.tolist()) for t in thetas), eos)
        self.names = tuple(plan.rows)

    def prompts(self, count: int) -> list:
        return torch.randint(len(self.outcomes), (count,), generator=self.gen).tolist()

    def sample(self, problems):
        return problems

    def draws(self, sampled, index: int) -> GroupDraws:
        self.clock.now += 1.0
        which = sampled[index]
        grads, probs = self.outcomes[which]
        picked = torch.multinomial(probs, self.plan.groups_per_prompt, replacement=True, generator=self.gen)
        n = picked.numel() * GROUP
        return GroupDraws(self.names, grads[picked].float(), torch.zeros(n),
                          self.rewards[which][picked].flatten().float(), torch.full((n,), 3))

    def exact(self, baseline: str):
        """exact_quality of the rows over the mixture of the θs (each prompt equally likely)."""
        grads = torch.cat([g for g, _ in self.outcomes])
        probs = torch.cat([p / len(self.outcomes) for _, p in self.outcomes])
        return exact_quality(self.names, grads, probs, reference=REF, baseline=baseline)


_ENUMERATED: dict = {}


def enumerated(rows: tuple, thetas: tuple, eos: bool):
    """(outcome gradients and probabilities per θ, rewards [O, N] per θ), cached across runs."""
    key = (tuple((k, v[0], tuple(sorted(v[1].items()))) for k, v in rows), thetas, eos)
    if key not in _ENUMERATED:
        specs = [spec for _, spec in rows]
        vectors = [torch.tensor(t, dtype=torch.float64) for t in thetas]
        outcomes = [outcome_gradients(t, eos, specs) for t in vectors]
        rewards = [torch.tensor([reward(r[0]) for r in enumerate_policy(t, eos)]) for t in vectors]
        combos = torch.tensor(list(itertools.product(range(rewards[0].numel()), repeat=GROUP)))
        _ENUMERATED[key] = (outcomes, [r[combos] for r in rewards])
    return _ENUMERATED[key]


def simulate(plan: Plan, source, clock: Clock) -> dict:
    """One diagnose run on ``source``: the rounds until the stopping rule or the budget, then the verdicts."""
    with torch_threads(1):        # tiny tensors: a second thread only adds contention
        acc = Accumulator(plan, source_dim(source), adam=False)
        meas = measure(source, plan, acc, clock=clock, deadline=plan.budget_s)
        return {"measurement": meas, **summarize(meas, plan)}


def source_dim(source) -> int:
    return source.mu.numel() if hasattr(source, "mu") else source.outcomes[0][0].shape[-1]
