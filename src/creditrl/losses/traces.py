"""GRPO-λ eligibility traces in O(T): y_t = Σ_{j≤t} M[t,j] x_j without the T×T matrix.

Trace matrix (GRPO-λ App. A.3 eq. 17–18; c = γλ, f = floor, j ≤ t, M[t,t] = 1):
    recent: M[t,j] = max(f, c^{t−j})
    both:   M[t,j] = max(f, c^{t−j}, c^{j})
Positions count valid tokens only (masked tool outputs are not steps), so each response is
first compacted to the left, traced, and scattered back; masked positions return 0.

How the O(T) evaluation works (D = largest d with c^d ≥ f, i.e. where the floor stops winning):
    E_t = Σ_{j≤t} c^{t−j} x_j        exponential recursion, chunked closed form (``_exp_scan``)
    P_t = Σ_{j≤t} x_j,  Q_t = Σ_{j≤t} c^{j} x_j   prefix sums
    recent: y_t = [E_t − c^{D+1} E_{t−D−1}] + f·P_{t−D−1}          (window + floor prefix)
    both:   c^{t−j} wins for j ≥ ⌈t/2⌉, c^{j} for j < ⌈t/2⌉, f only where D < j < t−D:
            y_t = [E_t − c^{w+1} E_{t−w−1}] + Q_m + f·(P_{t−D−1} − P_D),
            w = min(⌊t/2⌋, D), m = min(D, ⌈t/2⌉−1)
All powers are ≤ 1, so nothing overflows for any T; the window subtraction loses at most
eps·max|E| ≤ eps·max|x|/(1−c) in absolute terms.

Note: with ``style="both"`` the first token has weight c^0 = 1 in every row, also for λ = 0
(that is eq. 17 as written), so only ``recent`` reduces to the identity at λ = 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from creditrl._validate import check_choice, check_range, check_tensor
from creditrl._validate import as_mask

TRACE_STYLES = ("recent", "both")
TRACE_UPDATES = ("trace", "weight")
_CHUNK = 64  # block size of the chunked scan: O(T·_CHUNK) flops, exact powers ≤ 1 only


@dataclass(frozen=True)
class TraceOptions:
    """GRPO-λ options: trace decay ``lam``/``gamma``, ``style`` (eq. 17–18), ``floor`` (ε in
    eq. 17–18), ``update`` ("trace" = ε-trace, Algorithm 1; "weight" = ε-weight, Algorithm 2)
    and the negative-advantage clamp ``adv_clamp`` (§4.2, −0.1 in the paper)."""

    lam: float
    gamma: float = 1.0
    style: str = "recent"
    floor: float = 0.0
    update: str = "trace"
    adv_clamp: float = -0.1

    def __post_init__(self):
        check_trace_args(self.lam, self.gamma, self.style, self.floor)
        check_choice("trace.update", self.update, TRACE_UPDATES)
        if isinstance(self.adv_clamp, bool) or not isinstance(self.adv_clamp, (int, float)) \
                or math.isnan(self.adv_clamp):
            raise ValueError(f"trace.adv_clamp: expected a float, got {self.adv_clamp!r}")


def check_trace_args(lam: float, gamma: float, style: str, floor: float) -> None:
    check_range("lam", lam, 0.0, 1.0)
    check_range("gamma", gamma, 0.0, 1.0)
    check_range("floor", floor, 0.0, 1.0)
    check_choice("style", style, TRACE_STYLES)


def _decay_matrix(n: int, c: float, like: Tensor) -> Tensor:
    """[n,n] lower-triangular Toeplitz matrix c^{t−j} (j ≤ t), computed in float64."""
    d = torch.arange(n, device=like.device)
    d = d[:, None] - d[None, :]
    powers = torch.pow(torch.tensor(c, dtype=torch.float64, device=like.device),
                       d.clamp(min=0).to(torch.float64))
    return torch.where(d >= 0, powers, 0.0).to(like.dtype)


def _powers(c: float, exponents: Tensor, like: Tensor) -> Tensor:
    base = torch.tensor(c, dtype=torch.float64, device=like.device)
    return torch.pow(base, exponents.to(torch.float64)).to(like.dtype)


def _exp_scan(x: Tensor, c: float) -> Tensor:
    """E_t = x_t + c·E_{t−1} along dim 1 of x [N,L], in O(L·_CHUNK) work, no loop over tokens.

    Each block of _CHUNK steps is one small matmul with the exact decay matrix; the carries
    between blocks are the same recursion on the block ends with factor c^_CHUNK (recursion
    depth log_CHUNK(L))."""
    n, length = x.shape
    if length <= _CHUNK:
        return x @ _decay_matrix(length, c, x).T
    blocks = -(-length // _CHUNK)
    xb = F.pad(x, (0, blocks * _CHUNK - length)).view(n, blocks, _CHUNK)
    local = xb @ _decay_matrix(_CHUNK, c, x).T                      # [N,K,C]
    ends = _exp_scan(local[..., -1], c ** _CHUNK)                    # E at each block end
    carry = F.pad(ends[:, :-1], (1, 0))                              # E at previous block end
    steps = _powers(c, torch.arange(1, _CHUNK + 1, device=x.device), x)
    out = local + carry[..., None] * steps
    return out.reshape(n, blocks * _CHUNK)[:, :length]


def _at(z: Tensor, index: Tensor) -> Tensor:
    """z[:, index] for an index [L] in [−1, L): −1 (before position 0) reads 0."""
    padded = F.pad(z, (1, 0))
    return padded.gather(1, (index.clamp(-1, z.shape[1] - 1) + 1).expand(z.shape[0], -1))


def _shift(z: Tensor, k: int) -> Tensor:
    """z[:, t−k] with zeros for t < k (a constant-offset ``_at`` without the gather)."""
    return F.pad(z, (k, 0))[:, : z.shape[1]]


def _floor_window(c: float, floor: float, length: int) -> int:
    """D = max{d : c^d ≥ floor}, capped at ``length`` (no floor region)."""
    if floor <= 0.0 or c >= 1.0:
        return length
    if c <= 0.0:
        return 0
    return min(length, math.floor(math.log(floor) / math.log(c)))


def _trace_dense_rows(x: Tensor, c: float, style: str, floor: float) -> Tensor:
    """Trace of left-aligned (compacted) rows x [N,L]: the formulas of the module docstring."""
    length = x.shape[1]
    t = torch.arange(length, device=x.device)
    window = _floor_window(c, floor, length)
    e = _exp_scan(x, c)
    prefix = torch.cumsum(x, dim=1) if floor > 0.0 else None
    if style == "recent":
        if window >= length - 1:
            return e
        return e - (c ** (window + 1)) * _shift(e, window + 1) + floor * _shift(prefix, window + 1)
    w = torch.minimum(t // 2, torch.tensor(window, device=x.device))
    m = torch.minimum((t + 1) // 2 - 1, torch.tensor(window, device=x.device))
    y = e - _powers(c, w + 1, x) * _at(e, t - w - 1)
    y = y + _at(torch.cumsum(x * _powers(c, t, x), dim=1), m)
    if prefix is not None and window < length:
        floor_part = _shift(prefix, window + 1) - prefix[:, window: window + 1]
        y = y + floor * torch.where(t - window - 1 > window, floor_part, 0.0)
    return y


def apply_trace(values: Tensor, mask: Tensor, *, lam: float, gamma: float = 1.0,
                style: str = "recent", floor: float = 0.0) -> Tensor:
    """Eligibility trace y_t = Σ_{j≤t} M[t,j] x_j over each response's valid tokens.

    values: [B,T] float; mask: [B,T] bool/0-1 (valid tokens; the rest are skipped, not steps).
    M is GRPO-λ App. A.3 eq. 17 (``both``) / eq. 18 (``recent``) with c = γλ, ε = ``floor``.
    Returns [B,T] (0 at masked positions), float32 for half-precision input. O(T) memory,
    O(T·64) time per response; linear in ``values`` so autograd gives Mᵀ·grad.
    """
    values = check_tensor("values", values, ndim=2, floating=True)
    valid = as_mask("mask", mask, values.shape)
    check_trace_args(lam, gamma, style, floor)
    dtype = torch.promote_types(values.dtype, torch.float32)
    x = torch.where(valid, values.to(dtype), 0.0)
    rows, length = x.shape
    if rows == 0 or length == 0:
        return x
    if not bool((valid[:, 1:] & ~valid[:, :-1]).any()):              # rows are prefixes: no gaps
        return torch.where(valid, _trace_dense_rows(x, gamma * lam, style, floor), 0.0)
    pos = torch.cumsum(valid, dim=1) - 1                              # compacted position
    dest = torch.where(valid, pos, length)                            # invalid → spare column
    compact = x.new_zeros(rows, length + 1).scatter(1, dest, x)[:, :length]
    y = _trace_dense_rows(compact, gamma * lam, style, floor)
    return torch.where(valid, y.gather(1, pos.clamp(min=0)), 0.0)
