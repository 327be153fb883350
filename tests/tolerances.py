"""Tolerances derived from the arithmetic, shared by the tests.

A sum (or dot product) of n floating-point terms, in any order, is within (n − 1)·u·Σ|terms| of
the exact sum, u = eps/2 the unit roundoff (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., §4.2). The bound holds for every summation order, so for every SIMD width
(``ATEN_CPU_CAPABILITY``) and thread split: a tolerance of ``n·eps`` relative to the terms'
magnitudes is portable, where one fitted to this machine's rounding is not. A chain of such sums
(a backward pass: tokens, vocabulary, hidden and MLP widths) adds their lengths.
"""
from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps   # 2^-23 ≈ 1.19e-7
EPS64 = torch.finfo(torch.float64).eps   # 2^-52 ≈ 2.22e-16
# Below float32's normal range (1.2e-38) rounding is absolute, one subnormal spacing 2^-149 ≈ 1.4e-45 at most
# per operation; values below it become 0 (e.g. the energy of a token with π = 1 − 1e-25)
SUBNORMAL32 = 2.0 ** -149


def sum_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The rounding of a sum of ``n`` terms in ``dtype``, relative to the sum of their magnitudes."""
    return max(n, 1) * torch.finfo(dtype).eps


def assert_close_normwise(got: torch.Tensor, want: torch.Tensor, rtol: float, msg: str = "") -> None:
    """||got − want||₂ <= rtol·||want||₂ (in float64): the normwise form of an n·eps bound, for
    vectors whose elements cancel (a gradient element near 0 has a large relative error of its
    own, though the vector is as accurate as its largest elements)."""
    err = float((got.double() - want.double()).norm())
    scale = float(want.double().norm())
    assert err <= rtol * scale, f"{msg}: ||got − want|| = {err:.3g} > {rtol:.3g} × ||want|| = {rtol * scale:.3g}"


def forward_chain(model, positions: int) -> int:
    """The longest chain of float32 sums behind a logit of ``model`` (a Llama): per layer the hidden width
    (projections, norms), the MLP width and the attended positions, then the hidden width of the head."""
    c = model.config
    return c.num_hidden_layers * (2 * c.hidden_size + c.intermediate_size + positions) + c.hidden_size


def logp_atol(model, positions: int, logit_scale: float) -> float:
    """Two float32 forwards of the same model on the same tokens (with or without a KV cache, batched
    differently, a prompt shared or not) differ by their rounding: every logit within
    ``forward_chain``·eps32 of the activations' magnitude (``logit_scale``: the largest |logit| of the
    reference, itself a sum over the hidden width of such activations), and a log-prob z_y − log Σ e^z
    (one more sum over the vocabulary) moves by at most twice the largest logit change."""
    return 2 * (sum_rtol(forward_chain(model, positions)) + sum_rtol(model.config.vocab_size)) * logit_scale
