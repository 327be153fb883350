"""The simple gradient noise scale B_simple = tr(Sigma) / ||G||^2 (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training", App. A), from two independent half-batches of one step.

Sigma is the per-draw (per-group) gradient covariance and G the true gradient. With g_A, g_B the mean
gradients of two independent halves of n_A and n_B draws:

    ||G||^2    ~  <g_A, g_B>                                   (unbiased: the halves are independent)
    tr(Sigma)  ~  ||g_A - g_B||^2 / (1/n_A + 1/n_B)             (unbiased: E||g_A - g_B||^2 = tr Sigma (1/n_A + 1/n_B))

(for n_A = n_B = b/2: (b/4) ||g_A - g_B||^2). B_simple is the batch size (in draws) at which the
batch gradient's noise equals its signal; a step's ratio is noisy, so ``NoiseScale`` smooths the
numerator and the denominator separately with exponential moving averages before dividing, as
McCandlish et al. do. Both averages start at 0 with the same decay, so their start-up bias is the
same factor (1 - beta^t) and cancels in the ratio.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from creditrl.core.gradients.moments import GradientStats
from creditrl.core.gradients.quality import Interval, _interval, _replicates
from creditrl.utils.validate import check_range

Vector = Tensor | Sequence[Tensor]   # a flat gradient, or one tensor per parameter


def _products(a: Vector, b: Vector) -> tuple[float, float]:
    """(<a, b>, ||a - b||^2) in float64 over matching tensors (the difference taken directly: no
    cancellation when a ~ b)."""
    a, b = ([a], [b]) if isinstance(a, Tensor) else (list(a), list(b))
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise ValueError(f"g_a, g_b: expected gradients of the same shapes, got {[tuple(x.shape) for x in a]} "
                         f"and {[tuple(y.shape) for y in b]}")
    dot = diff = 0.0
    for x, y in zip(a, b):
        x, y = x.detach().reshape(-1).double(), y.detach().reshape(-1).double()
        dot += float(torch.dot(x, y))
        diff += float((x - y).square().sum())
    return dot, diff


def noise_scale_terms(g_a: Vector, g_b: Vector, n_a: float, n_b: float) -> tuple[float, float]:
    """(tr Sigma, ||G||^2) estimated without bias from the mean gradients of two independent halves
    of ``n_a`` and ``n_b`` draws (module docstring). ||G||^2 may come out negative when noise dominates."""
    check_range("n_a", n_a, 0.0, low_inclusive=False)
    check_range("n_b", n_b, 0.0, low_inclusive=False)
    dot, diff = _products(g_a, g_b)
    return diff / (1 / n_a + 1 / n_b), dot


class NoiseScale:
    """Exponential moving averages of tr Sigma and ||G||^2 and their ratio B_simple (module docstring).

    ``update`` returns the smoothed B_simple, NaN while the averaged ||G||^2 is not positive. A step
    whose estimates are not finite (an fp16 overflow, which the scaler then skips) leaves the averages
    as they were and is counted in ``skipped``: folded in, it would make B_simple NaN for good."""

    def __init__(self, decay: float = 0.9):
        check_range("decay", decay, 0.0, 1.0, high_inclusive=False)
        self.decay = float(decay)
        self.trace = 0.0
        self.grad_sq = 0.0
        self.steps = 0
        self.skipped = 0
        self.last = (math.nan, math.nan)      # this step's unsmoothed (tr Sigma, ||G||^2)

    def update(self, g_a: Vector, g_b: Vector, n_a: float, n_b: float) -> float:
        return self.add(*noise_scale_terms(g_a, g_b, n_a, n_b))

    def add(self, trace: float, grad_sq: float) -> float:
        """Fold one step's unbiased (tr Sigma, ||G||^2) into the averages; returns B_simple."""
        self.last = (trace, grad_sq)
        if not (math.isfinite(trace) and math.isfinite(grad_sq)):
            self.skipped += 1
            return self.value
        self.trace = self.decay * self.trace + (1 - self.decay) * trace
        self.grad_sq = self.decay * self.grad_sq + (1 - self.decay) * grad_sq
        self.steps += 1
        return self.value

    def metrics(self) -> dict[str, float]:
        """The smoothed B_simple and this step's raw estimates, for a trainer's log."""
        return {"noise_scale": self.value, "noise_trace_sigma": self.last[0], "noise_grad_sq": self.last[1],
                "noise_skipped_steps": float(self.skipped)}

    @property
    def value(self) -> float:
        return self.trace / self.grad_sq if self.grad_sq > 0 else math.nan

    def state_dict(self) -> dict:
        return {"decay": self.decay, "trace": self.trace, "grad_sq": self.grad_sq, "steps": self.steps,
                "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.trace, self.grad_sq, self.steps = (float(state["decay"]), float(state["trace"]),
                                                            float(state["grad_sq"]), int(state["steps"]))
        self.skipped = int(state.get("skipped", 0))     # checkpoints written before the count


def prompt_noise_scale(stats: GradientStats, name: str, batch: float) -> dict[str, Interval]:
    """B_simple in groups, its split into variance within and across prompts, and what doubling the
    group size would do, from ``GradientStats`` whose units are prompts with several groups each.

    Per draw (one group of N on a random prompt), tr Σ = V = W + A: A = E‖E[g|prompt] − G‖² (across
    prompts) = E<g_a, g_b> over two groups of one prompt − ‖G‖², W = V − A (within a prompt). A group
    of 2N behaves as two groups of N on one prompt (exact for the responses' own noise; it ignores the
    slightly better baseline of a larger group), so its per-group variance is W/2 + A and:

        snr_gain   = V / (W/2 + A)                          signal-to-noise per step, 2N against N (1..2)
        progress   = (1 + B/batch) / (1 + B'/batch)          McCandlish et al. (2018): a step's best
                                                             expected gain ∝ 1/(1 + B_noise/batch)
        B = V/‖G‖², B' = (W/2 + A)/‖G‖²                      in groups; ``batch``: groups per step

    Intervals: delete-one-fold jackknife as in ``quality`` (log scale for the ratios)."""
    e = stats.index(name)
    stats = stats.nonempty()
    K = stats.draws.numel()
    keep = torch.cat([torch.ones(1, K, dtype=torch.float64), 1 - torch.eye(K, dtype=torch.float64)])
    second, signal = _replicates(stats)
    pairs = keep @ (stats.same_unit - stats.draws)
    same = (keep @ (stats.within[:, e, e] - stats.second[:, e, e])) / pairs
    grad_sq, variance = signal[:, e, e], second[:, e, e] - signal[:, e, e]
    across = same - grad_sq
    within = variance - across
    doubled = within / 2 + across
    nan = torch.full_like(variance, math.nan)
    ok = (grad_sq > 0) & (doubled > 0) & (pairs > 0)
    values = {"noise_scale": torch.where(ok, variance / grad_sq, nan),
              "within_share": torch.where(pairs > 0, within / variance, nan),
              "snr_gain": torch.where(ok, variance / doubled, nan),
              "progress_gain": torch.where(ok, (1 + variance / grad_sq / batch) / (1 + doubled / grad_sq / batch), nan)}
    return {key: _interval(float(v[0]), v[1:], key != "within_share") for key, v in values.items()}
