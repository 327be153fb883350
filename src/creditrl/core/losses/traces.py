"""GRPO-λ eligibility traces in O(T): y_t = Σ_{j≤t} M[t,j] x_j without the T×T matrix.

Trace matrix (GRPO-λ App. A.3 eq. 17–18; c = γλ, f = floor, j ≤ t, M[t,t] = 1):
    recent: M[t,j] = max(f, c^{t−j})
    both:   M[t,j] = max(f, c^{t−j}, c^{j})
Positions count valid tokens only (masked tool outputs are not steps), so each response is
first compacted to the left, traced, and scattered back; masked positions return 0.

How the O(T) evaluation works (S = D + 1, D = largest d with c^d ≥ f: the lag from which the
floor wins; no floor region when f = 0 or S ≥ T):
    E_t = Σ_{j≤t} c^{t−j} x_j   exponential recursion, blocked (``_exp_scan``)
    P_t = Σ_{j≤t} x_j,  Q_m = Σ_{j≤m} c^{j} x_j   the same scan with c = 1
    recent: y_t = E_t                                        t < S
            y_t = E_t + f·P_{t−S} − c^S·E_{t−S}               t ≥ S   (window + floor prefix)
    both:   for j ≤ t, max(c^{t−j}, c^j) = c^{min(t−j, j)} ≥ f while t ≤ 2S − 1, so
            y_{2m+1} = E_{2m+1} + Q_m − c^{m+1}·E_m,  y_{2m+2} = E_{2m+2} + Q_m − c^{m+2}·E_m
                                                             (pairs of steps share m: no gather)
            y_t = E_t + f·P_{t−S} − c^S·E_{t−S} + Q_D − f·P_D  t ≥ 2S
Every pass is a contiguous slice or a broadcast: no gathers, no T×T matrix. All powers are
≤ 1 (cached per (c, dtype, device), subnormals flushed to 0), so nothing overflows for any
T; the window subtraction loses at most eps·max|E| ≤ eps·max|x|/(1−c) in absolute terms.

The backward pass is autograd through these same scans (matmuls, slices and in-place adds
that autograd can differentiate), O(T) memory like the forward.

Note: with ``style="both"`` the first token has weight c^0 = 1 in every row, also for λ = 0
(that is eq. 17 as written), so only ``recent`` reduces to the identity at λ = 0.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from creditrl.core.losses.terms import LossState, register_loss_term
from creditrl.utils.validate import check_choice, check_finite, check_range, check_tensor
from creditrl.utils.validate import as_mask

TRACE_STYLES = ("recent", "both")
TRACE_UPDATES = ("trace", "weight")
# Scan block size. The [N·K,C]@[C,C] block matmul is memory-bound, so small blocks are fastest
# (measured on CPU: C = 16 beats 32 and 64 by 1.7x and 3x); the block ends recurse with c^C.
_BLOCK = 16


@dataclass(frozen=True)
class TraceOptions:
    """GRPO-λ options: trace decay ``lam``/``gamma``, ``style`` (eq. 17–18), ``floor`` (ε in
    eq. 17–18), ``update`` ("trace" = ε-trace, Algorithm 1; "weight" = ε-weight, Algorithm 2)
    and the negative-advantage clamp ``adv_clamp`` (§4.2, −0.1 in the paper)."""

    lam: float = field(default=0.99, metadata={"help": "trace decay λ in [0, 1] (c = γλ)"})
    gamma: float = field(default=1.0, metadata={"help": "discount γ in [0, 1] (c = γλ)"})
    style: Literal[TRACE_STYLES] = field(default="recent", metadata={
        "help": "trace matrix: recent (eq. 18) or both (eq. 17, also weights the first tokens)"})
    floor: float = field(default=0.0, metadata={"help": "ε of eq. 17-18: the smallest weight of a past token"})
    update: Literal[TRACE_UPDATES] = field(default="trace", metadata={
        "help": "trace: the ε-trace of the log-ratio (Algorithm 1); weight: the ε-weight (Algorithm 2)"})
    adv_clamp: float = field(default=-0.1, metadata={
        "help": "negative advantages are clamped from below here (§4.2); finite, <= 0 (e.g. -1e30: no clamp in effect)"})

    def __post_init__(self):
        check_trace_args(self.lam, self.gamma, self.style, self.floor)
        check_choice("trace.update", self.update, TRACE_UPDATES)
        if isinstance(self.adv_clamp, bool) or not isinstance(self.adv_clamp, (int, float)) \
                or not math.isfinite(self.adv_clamp) or self.adv_clamp > 0:
            # a clamp above 0 would lift every negative advantage to +clamp and flip its token's sign.
            # Finite, as every front end's float option (config, TRL and verl fields) reads it: -inf
            # would not survive the run's config.yaml
            raise ValueError(f"trace.adv_clamp: expected a finite float <= 0 (the floor of the negative advantages; "
                             f"-1e30: no clamp in effect), got {self.adv_clamp!r}")


def check_trace_args(lam: float, gamma: float, style: str, floor: float) -> None:
    check_range("lam", lam, 0.0, 1.0)
    check_range("gamma", gamma, 0.0, 1.0)
    check_range("floor", floor, 0.0, 1.0)
    check_choice("style", style, TRACE_STYLES)


@functools.lru_cache(maxsize=64)
def _cached_powers(c: float, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    p = torch.pow(torch.tensor(c, dtype=torch.float64), torch.arange(n, dtype=torch.float64))
    p = torch.where(p < torch.finfo(dtype).tiny, 0.0, p)   # subnormals: < 1e-38, ~100x slower math
    return p.to(dtype=dtype, device=device)


def _powers(c: float, n: int, like: Tensor) -> Tensor:
    """[c^0, …, c^{n−1}] in ``like``'s dtype/device (float64 powers; cached, do not modify)."""
    size = 1 << max(6, (n - 1).bit_length())                # power-of-two lengths bound the cache
    return _cached_powers(float(c), size, like.dtype, like.device)[:n]


@functools.lru_cache(maxsize=64)
def _decay_matrix_t(c: float, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Dᵀ of the [n,n] lower-triangular Toeplitz decay D[t,j] = c^{t−j} (j ≤ t), cached."""
    lag = torch.arange(n, device=device)
    lag = lag[:, None] - lag[None, :]
    pw = _cached_powers(float(c), 1 << max(6, (n - 1).bit_length()), dtype, device)
    return torch.where(lag >= 0, pw[lag.clamp(min=0)], 0.0).T.contiguous()


def _exp_scan(x: Tensor, c: float) -> Tensor:
    """E_t = x_t + c·E_{t−1} along dim 1 of x [N,L] (c = 1: prefix sums), no loop over tokens.

    Each block of _BLOCK steps is one small matmul with the exact decay matrix; block k then adds
    c^{i+1}·E(end of block k−1), and those block ends are the same recursion with factor c^_BLOCK
    (recursion depth log_BLOCK(L)). O(L·_BLOCK) flops, O(L) memory. In x's dtype: an autocast
    region (a trainer's bf16 forward) would run the matmuls in bf16, 8e-3 off at T = 1,024."""
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return _exp_scan(x, c)
    rows, length = x.shape
    size = _BLOCK
    if length <= size:
        return x @ _decay_matrix_t(float(c), length, x.dtype, x.device)
    blocks = -(-length // size)
    if blocks * size != length:
        x = F.pad(x, (0, blocks * size - length))
    local = x.reshape(rows * blocks, size) @ _decay_matrix_t(float(c), size, x.dtype, x.device)
    ends = local[:, -1].reshape(rows, blocks).clone()       # a copy: ``local`` is updated in place
    before = _exp_scan(ends, c ** size)[:, :-1, None]         # E at the end of blocks 0..K−2
    local = local.view(rows, blocks, size)
    local[:, 1:].addcmul_(before, _powers(c, size + 1, x)[1:])
    return local.view(rows, blocks * size)[:, :length]


def _floor_window(c: float, floor: float, length: int) -> int:
    """D = max{d : c^d ≥ floor}, capped at ``length`` (no floor region)."""
    if floor <= 0.0 or c >= 1.0:
        return length
    if c <= 0.0:
        return 0
    return min(length, math.floor(math.log(floor) / math.log(c)))


def _trace_rows(x: Tensor, c: float, style: str, floor: float) -> Tensor:
    """Trace of left-aligned (compacted) rows x [N,L]: the formulas of the module docstring."""
    rows, length = x.shape
    span = _floor_window(c, floor, length) + 1                # S: lags ≥ S get the floor
    y = _exp_scan(x, c)                                       # E; updated in place at the end,
    pair_part = floor_part = None                             # after every read of E
    if style == "both":
        n_early = min(2 * span - 1, length - 1)               # t = 1..n_early use the pairs
        pairs = (n_early + 1) // 2
        head = _exp_scan(x[:, :pairs] * _powers(c, pairs, x), 1.0)           # Q_m, m < pairs
        decay = _powers(c, pairs + 2, x).unfold(0, 2, 1)[1:]                # [c^{m+1}, c^{m+2}]
        pair_part = torch.addcmul(head[:, :, None], y[:, :pairs, None], decay, value=-1.0)
        pair_part = pair_part.view(rows, 2 * pairs)
    floor_start = span if style == "recent" else 2 * span     # first t with floor terms
    if floor > 0.0 and floor_start < length:
        prefix = _exp_scan(x, 1.0)                            # P
        if style == "both":                                   # here pairs = S: Q_D − f·P_D
            offset = (head[:, span - 1] - floor * prefix[:, span - 1])[:, None]
        # (P − (c^S/f)·E)_{t−S}, in place in P (fresh [N,L] buffers cost page faults on CPU);
        # c^S < f, so the ratio is < 1 and nothing is amplified
        floor_part = prefix[:, floor_start - span: length - span]
        floor_part.add_(y[:, floor_start - span: length - span], alpha=-(c ** span) / floor)
    if pair_part is not None:
        y[:, 1:1 + n_early].add_(pair_part[:, :n_early])
    if floor_part is not None:
        tail = y[:, floor_start:].add_(floor_part, alpha=floor)
        if style == "both":
            tail.add_(offset)
    return y


def trace_rows_masked(x: Tensor, valid: Tensor, c: float, style: str, floor: float) -> Tensor:
    """M·x over each row's valid tokens, unchecked: x [B,T] float, exactly 0 off ``valid`` [B,T]
    bool (B, T ≥ 1); the output is 0 off ``valid``. Rows that are prefixes (right padding only)
    are traced in place; others are compacted to the left (valid tokens are the steps), traced
    and scattered back. Differentiable by autograd."""
    rows, length = x.shape
    flags = valid.view(torch.uint8)                                   # uint8 reductions are vectorised
    if bool(flags.amin()):                                            # nothing masked
        return _trace_rows(x, c, style, floor)
    prefix_rows = length <= 1 or not bool(torch.gt(flags[:, 1:], flags[:, :-1]).view(torch.uint8).amax())
    if prefix_rows:
        out = _trace_rows(x, c, style, floor)
    else:
        # the valid token with k valid tokens up to it goes to column k − 1; a masked token gets its
        # predecessor's column (its 0 adds nothing to the scatter), clamped into range
        index = torch.cumsum(valid, dim=1).sub_(1).clamp_(min=0)
        compact = x.new_zeros(rows, length).scatter_add(1, index, x)
        out = _trace_rows(compact, c, style, floor).gather(1, index)
    return out * valid.to(out.dtype)


def apply_trace(values: Tensor, mask: Tensor, *, lam: float, gamma: float = 1.0,
                style: str = "recent", floor: float = 0.0) -> Tensor:
    """Eligibility trace y_t = Σ_{j≤t} M[t,j] x_j over each response's valid tokens.

    values: [B,T] float; mask: [B,T] bool/0-1 (valid tokens; the rest are skipped, not steps).
    M is GRPO-λ App. A.3 eq. 17 (``both``) / eq. 18 (``recent``) with c = γλ, ε = ``floor``.
    Non-finite valid values raise naming their rows (off-mask garbage is ignored).
    Returns [B,T] (0 at masked positions), float32 for half-precision input. O(T) memory,
    O(T·16) time per response; differentiable (autograd through the scans: Mᵀ·grad, also O(T)).
    """
    values = check_tensor("values", values, ndim=2, floating=True)
    valid = as_mask("mask", mask, values.shape)
    check_trace_args(lam, gamma, style, floor)
    dtype = torch.promote_types(values.dtype, torch.float32)
    if values.numel() == 0:                                           # B = 0 or T = 0: nothing to trace
        return values.to(dtype) * 0.0
    x = torch.where(valid, values.to(dtype), 0.0)
    if not bool(torch.isfinite(x.detach().sum())):   # one inf would spread to every later output: refuse it
        check_finite("values", x.detach())
    return trace_rows_masked(x, valid, gamma * lam, style, floor)


@register_loss_term("trace", options=TraceOptions, stage="ratio")
def trace(state: LossState, options: TraceOptions) -> LossState:
    """GRPO-λ eligibility traces: ε-trace of the log-ratio (Algorithm 1) or ε-weight (Algorithm 2).

    Advantages are clamped from below at ``adv_clamp`` (§4.2; metric ``adv_clamped_frac``, the kept
    tokens whose advantage it raised: the logged adv_* are the estimator's). With c = γλ and M = eq. 17/18:
      ε-trace:  z ← M·z, so r_t = exp(Σ_{j≤t} M[t,j] (log π_θ − log π_old)_j)   (Theorem 1, eq. 1-2)
      ε-weight: weight ← weight · M(1 + σ(log π_θ − 1))                         (Algorithm 2)
    Interpretations where the paper is ambiguous:
      * ε-weight: σ(log π_θ − 1) carries gradient. Algorithm 2 writes no stop-gradient (the paper
        writes sg(·) where it means one) and App. A.3 says multiplying the trace weights with log π
        "provides the traces": gradient reaches earlier tokens through the weight. So λ = 0 gives
        the token loss times (1 + σ(log π_t − 1)) ∈ (1, 1.27], not the plain loss; only ε-trace
        with ``style="recent"`` reduces to GRPO exactly at λ = 0.
      * Algorithm 1 writes −min(r, clip(r))·A; the clip term uses the standard PPO form (identical
        for A ≥ 0, the usual pessimistic bound for A < 0), so the clip options apply unchanged.
      * Tokens dropped from the loss (STAPO, MIS) keep their place and value in the trace but are
        detached there (``state.logp``), so they pass no gradient through later tokens either.
    """
    c = options.gamma * options.lam
    with torch.no_grad():   # the logged adv_* are the estimator's; this says how many the clamp changed
        raised = (state.advantages < options.adv_clamp).expand_as(state.keep).logical_and(state.keep).sum()
    state = dataclasses.replace(state, advantages=state.advantages.clamp(min=options.adv_clamp)).with_metrics(
        adv_clamped_frac=(raised, state.keep.sum()))
    if options.update == "trace":
        traced = trace_rows_masked(state.log_ratio, state.valid, c, options.style, options.floor)
        return dataclasses.replace(state, log_ratio=traced)
    soft = (torch.sigmoid(state.logp - 1.0) + 1.0) * state.valid_f
    return state.scaled(trace_rows_masked(soft, state.valid, c, options.style, options.floor))
