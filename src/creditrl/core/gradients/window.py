"""Gradient quality over a sliding window of training steps (in-training diagnosis).

Each diagnosed step contributes its n groups' gradients under E estimators, grads [n, E, D], each
group its own independent unit. Per step s the window keeps only E×E sums:

    n_s                          groups
    Q_s = sum_k g_k g_k^T        per-draw second moments
    P_s = F F^T - Q_s            F = sum_k g_k: products of pairs of *different* groups of the step
    pairs_s = n_s^2 - n_s

Per step, Q_s / n_s and P_s / pairs_s estimate E[g g^T] and <mu_e, mu_f> under that step's policy
without bias; the window averages both with the same weights n_s / sum n:

    E[g g^T] ~ sum_s Q_s / sum n,   <mu_e, mu_f> ~ sum_s P_s / (n_s - 1) / sum n

so V = E[g g^T] - <mu, mu> estimates the n-weighted average of the steps' own variances even where
the mean gradient moves between steps of different sizes (pooling P over sum pairs weighted the
signal by n_s(n_s - 1) instead, which biased V by sum_s (n_s/N - n_s(n_s-1)/sum pairs) ||mu_s||^2,
2x in a window of 2- and 12-group steps). Every quality statistic of ``quality`` follows; its
intervals are delete-one-step jackknife t-intervals (the steps are the resampling units), so they
need at least 2 steps in the window. Cross products between different steps are not used: the
policy moves between them.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from creditrl.core.gradients.moments import name_index
from creditrl.core.gradients.quality import STATISTICS, LOG_SCALE, EstimatorQuality, Interval, _interval, _statistics
from creditrl.utils.validate import check_finite, check_int, check_tensor


@dataclass(frozen=True)
class StepMoments:
    """One step's sums (module docstring), float64."""
    groups: int
    second: Tensor
    pairs: Tensor


def step_moments(grads: Tensor) -> StepMoments:
    """``StepMoments`` of one step's group gradients grads [n, E, D] (n >= 2)."""
    check_tensor("grads", grads, ndim=3, floating=True)
    check_finite("grads", grads)
    if grads.shape[0] < 2:
        raise ValueError(f"grads: expected at least 2 groups in a step (pairs of different groups estimate the "
                         f"mean gradient), got {grads.shape[0]}")
    g = grads.detach().to(torch.float64)
    second = torch.bmm(g, g.transpose(1, 2)).sum(0)         # (an einsum to [E, E] directly is ~10x slower on CPU)
    total = g.sum(0)
    return StepMoments(grads.shape[0], second.cpu(), (total @ total.T - second).cpu())


class StepWindow:
    """The last ``size`` steps' ``StepMoments`` of the estimators ``names`` (module docstring)."""

    def __init__(self, names: Sequence[str], size: int):
        self.names = tuple(names)
        self.size = check_int("size", size, 1)
        self.steps: deque[StepMoments] = deque(maxlen=self.size)

    def add(self, grads: Tensor) -> None:
        check_tensor("grads", grads, shape=[None, len(self.names), None])
        self.steps.append(step_moments(grads))

    def state_dict(self) -> dict:
        return {"names": list(self.names), "steps": [(s.groups, s.second, s.pairs) for s in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        if list(state["names"]) != list(self.names):
            raise ValueError(f"state: expected a window of the estimators {list(self.names)}, got {state['names']}")
        self.steps.clear()
        self.steps.extend(StepMoments(int(n), second, pairs) for n, second, pairs in state["steps"])

    def _replicates(self) -> tuple[Tensor, Tensor]:
        """(E[g g^T], <mu, mu^T>) [K+1, E, E]: the whole window (row 0) and each delete-one-step replicate."""
        K = len(self.steps)
        keep = torch.cat([torch.ones(1, K, dtype=torch.float64), 1 - torch.eye(K, dtype=torch.float64)])
        groups = torch.tensor([float(s.groups) for s in self.steps], dtype=torch.float64)
        n = keep @ groups
        second = torch.einsum("rk,kef->ref", keep, torch.stack([s.second for s in self.steps]))
        signal = torch.einsum("rk,kef->ref", keep / (groups - 1), torch.stack([s.pairs for s in self.steps]))
        return second / n[:, None, None].clamp(min=1), signal / n[:, None, None].clamp(min=1)

    def quality(self, reference: str, baseline: str | None = None) -> dict[str, EstimatorQuality]:
        """Every estimator's quality against ``reference`` (scale, cosine) and ``baseline`` (efficiency),
        as ``quality.gradient_quality`` but over the window's steps."""
        if not self.steps:
            raise ValueError("window: expected at least one diagnosed step, got none")
        r, b = name_index(self.names, reference, "reference"), name_index(self.names, baseline or reference, "baseline")
        values = _statistics(*self._replicates(), r, b)
        out = {}
        for e, name in enumerate(self.names):
            fields = {key: _interval(float(values[key][0, e]), values[key][1:, e], key in LOG_SCALE)
                      for key in STATISTICS if key != "signal"}
            out[name] = EstimatorQuality(name, reference, baseline or reference,
                                         signal=float(values["signal"][0, e]), **fields)
        return out

    def noise_scale(self, name: str) -> Interval:
        """B_simple = tr Σ / ‖G‖² (in groups) of ``name`` over the window (NaN while ‖G‖² is not
        resolved above 0), with its delete-one-step jackknife interval on the log scale."""
        if not self.steps:
            return Interval(math.nan, math.nan, math.nan, 0)
        e = name_index(self.names, name)
        second, signal = self._replicates()
        grad_sq = signal[:, e, e]
        ratio = torch.where(grad_sq > 0, (second[:, e, e] - grad_sq) / grad_sq, torch.full_like(grad_sq, math.nan))
        return _interval(float(ratio[0]), ratio[1:], True)
