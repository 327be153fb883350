"""The simple gradient noise scale B_simple = tr(Σ) / ‖G‖² (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training", §2.2 and App. A).

Σ is the per-example gradient covariance and G the true gradient; here an example is a group
(one prompt's N responses). B_simple is the batch size, in groups, at which the batch gradient's
noise equals its signal: doubling the batch raises the signal-to-noise ‖G‖²/E‖g − G‖² by about
2× while it is below B_simple and by little beyond.

From one step's two independent half-batches of b/2 groups, with mean gradients g_A and g_B:
    ‖G‖²  ≈ ⟨g_A, g_B⟩                    (unbiased: E⟨g_A, g_B⟩ = ⟨G, G⟩)
    tr Σ  ≈ (b/4) · ‖g_A − g_B‖²          (unbiased: E‖g_A − g_B‖² = 2 tr Σ / (b/2))
Both estimates are unbiased but their ratio is noisy step to step, so (as McCandlish et al. do)
numerator and denominator are smoothed separately by exponential moving averages before dividing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def half_batch_moments(grads_a: list[Tensor | None], grads_b: list[Tensor | None]) -> tuple[float, float]:
    """(⟨g_A, g_B⟩, ‖g_A − g_B‖²) of two gradients given as per-parameter tensors (None = zero),
    accumulated in float64 without a flattened copy."""
    dot = diff = 0.0
    for a, b in zip(grads_a, grads_b):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        dot += float(torch.dot(a.reshape(-1).double(), b.reshape(-1).double()))
        diff += float(torch.linalg.vector_norm((a - b).reshape(-1), dtype=torch.float64)) ** 2
    return dot, diff


def simple_noise_scale(dot_ab: float, diff_sq: float, groups: int) -> tuple[float, float]:
    """Unbiased (tr Σ, ‖G‖²) from two half-batches of ``groups``/2 groups each (module docstring):
    tr Σ = (groups/4)·‖g_A − g_B‖², ‖G‖² = ⟨g_A, g_B⟩. ``groups`` >= 2."""
    if groups < 2:
        raise ValueError(f"groups: expected >= 2 groups (two halves), got {groups}")
    return groups / 4.0 * diff_sq, dot_ab


@dataclass
class NoiseScale:
    """Exponential moving averages of tr Σ and ‖G‖² over steps, and B_simple = their ratio.

    ``beta`` is the EMA decay; the averages are bias-corrected as Adam's are, so the first step
    reports its own estimates. B_simple is NaN until the smoothed ‖G‖² is positive (the true
    gradient is then too small to separate from noise: no batch size is "enough")."""
    beta: float = 0.9
    trace: float = 0.0
    grad_sq: float = 0.0
    steps: int = 0
    last: dict = field(default_factory=dict)

    def update(self, trace_sigma: float, grad_sq: float) -> None:
        self.steps += 1
        self.trace = self.beta * self.trace + (1 - self.beta) * trace_sigma
        self.grad_sq = self.beta * self.grad_sq + (1 - self.beta) * grad_sq
        self.last = {"trace_sigma": trace_sigma, "grad_sq": grad_sq}

    @property
    def value(self) -> float:
        correction = 1 - self.beta ** self.steps
        if self.steps == 0 or self.grad_sq / correction <= 0:
            return math.nan
        return self.trace / self.grad_sq

    def metrics(self) -> dict[str, float]:
        """This step's raw estimates and the smoothed B_simple, for the trainer's log."""
        return {"noise_scale": self.value, "noise_trace_sigma": self.last.get("trace_sigma", math.nan),
                "noise_grad_sq": self.last.get("grad_sq", math.nan)}
