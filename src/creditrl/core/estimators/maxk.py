"""Max@K quantities and the max@K advantage estimators (MaxPO, PKPO, Chen pass@K, BoN mean).

All formulas: ``../shared/notes/maxk.md`` (the MaxPO paper's text lost its math symbols).
For one group of N rewards sorted ascending, a_1 <= ... <= a_N (1-based positions p):

    mu_p  = [C(p-1,K-1) a_p + sum_{j>p} C(j-2,K-2) a_j] / C(N-1,K-1)      mean max of K-subsets with p
    nu_p  = [sum_{q<p} C(q-1,K-1) a_q + sum_{q>p} C(q-2,K-1) a_q] / C(N-1,K)  mean max of K-subsets without p
    EI_p  = sum_{q<p} C(q-1,K-2) (a_p - a_q) / C(N-1,K-1)                  (K >= 2; EI = r for K = 1)
    rho_K = sum_j C(j-1,K-1) a_j / C(N,K)                                  unbiased max@K of the group

The sums over j > p and q < p are segmented suffix/prefix sums, so the whole batch costs one
sort plus O(B): every group is handled at once, with no Python loop over groups. Binomial
ratios are exp(lgamma differences) in float64 with an explicit zero mask where C(n, k) = 0.
Rewards are centred by their group mean first (mu, nu, rho are translation-equivariant, EI is
invariant), so the global prefix sums never cancel large offsets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import Tensor

from creditrl.utils.validate import check_choice, check_finite, check_int, check_positive_float32, check_tensor
from creditrl.core.estimators.baselines import drop_singletons, group_std
from creditrl.core.estimators.registry import AdvantageBatch, KRange, register_estimator
from creditrl.core.groups import GroupIndex

__all__ = ["MaxKStats", "maxk_quantities", "pass_at_k", "max_at_k", "binom_ratio"]


# Option declarations (name, type, help) shared by the max@K estimators' signatures
K = Annotated[int, "K of max@K / pass@K: attempts scored by their best (its range in N, the group size, is the "
                   "estimator's k_range)"]
Normalize = Annotated[Literal["none", "std"], "std: divide by the group's reward std (N-1) + eps"]
Eps = Annotated[float, "added to the group std before dividing (> 0)"]


def _log_binom(n: Tensor, k: Tensor) -> Tensor:
    """log C(n, k) for float64 tensors with 0 <= k <= n (callers mask the rest)."""
    n, k = n.clamp(min=0), k.clamp(min=0)
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma((n - k).clamp(min=0) + 1)


def binom_ratio(n, k, n_den, k_den) -> Tensor:
    """C(n, k) / C(n_den, k_den) in float64, broadcast; exactly 0 where C(n, k) = 0 and, so that
    segmented sums never pick up nan, also where the denominator is 0 (callers mask those).
    Computed as exp(lgamma differences), so n in the thousands stays exact to ~1e-12."""
    n, k, n_den, k_den = (torch.as_tensor(v, dtype=torch.float64) for v in (n, k, n_den, k_den))
    num_ok = (k >= 0) & (k <= n)
    den_ok = (k_den >= 0) & (k_den <= n_den)
    ratio = torch.exp(_log_binom(n, k) - _log_binom(n_den, k_den))
    return torch.where(num_ok & den_ok, ratio, torch.zeros_like(ratio))


@dataclass(frozen=True)
class MaxKStats:
    """Per-member max@K quantities, float64 [B] in the input order (see module docstring).

    mu:  mean max over K-subsets containing the member          (nan where K > N)
    nu:  mean max over K-subsets of the group without it        (nan where K > N-1)
    ei:  expected improvement over K-1 other members, MaxPO eq. 4 (nan where K > N)
    rho: the member's group max@K estimate rho_K                (nan where K > N)
    sizes: [B] int64 group size N of each member
    MaxPO advantage = mu - nu; PKPO s_i = (K/N) mu_i; PKPO sloo_minus_one = (K/N) EI_i.
    """

    mu: Tensor
    nu: Tensor
    ei: Tensor
    rho: Tensor
    sizes: Tensor
    k: int

    @property
    def advantage(self) -> Tensor:
        """MaxPO's canonical advantage mu - nu (= EI - L2O baseline), exactly centred per group."""
        return self.mu - self.nu


def _segment_order(values: Tensor, groups: GroupIndex) -> tuple[Tensor, Tensor, Tensor]:
    """Permutation sorting by (group, value), both stable; 1-based position of each sorted
    element within its group; and the start offset [G] of each group in sorted order."""
    by_value = torch.sort(values, stable=True).indices
    by_group = torch.sort(groups.dense[by_value], stable=True).indices
    order = by_value[by_group]
    starts = torch.cumsum(groups.sizes, 0) - groups.sizes
    dense_sorted = groups.dense[order]
    pos = torch.arange(values.numel(), device=values.device) - starts[dense_sorted] + 1
    return order, pos, dense_sorted


def _maxk_stats(rewards: Tensor, groups: GroupIndex, k: int) -> MaxKStats:
    """Closed forms for every group at once; no range checks (see ``maxk_quantities``)."""
    r = rewards.to(torch.float64)
    mean = groups.mean(r)
    order, pos, dense_sorted = _segment_order(r, groups)
    a = (r - mean)[order]                                      # centred, sorted within groups
    p = pos.to(torch.float64)
    n = groups.sizes.to(torch.float64)[dense_sorted]           # N of each sorted element

    group_starts = torch.cumsum(groups.sizes, 0) - groups.sizes

    def within_group_cumsum(x: Tensor) -> tuple[Tensor, Tensor]:
        """Inclusive cumsum restarted at every group, and each element's group total. The
        running sum is reset by subtracting the previous group's total at each group start,
        so rounding never scales with the batch-wide running sum."""
        totals = x.new_zeros(groups.num_groups).index_add_(0, dense_sorted, x)
        reset = x.clone()
        reset[group_starts[1:]] -= totals[:-1]
        running = torch.cumsum(reset, 0)
        carry = running[group_starts] - x[group_starts]
        return running - carry[dense_sorted], totals[dense_sorted]

    def prefix(x: Tensor) -> Tensor:   # sum_{q<p} x_q within the group
        return within_group_cumsum(x)[0] - x

    def suffix(x: Tensor) -> Tensor:   # sum_{j>p} x_j within the group
        inclusive, total = within_group_cumsum(x)
        return total - inclusive

    mu = binom_ratio(p - 1, k - 1, n - 1, k - 1) * a + suffix(binom_ratio(p - 2, k - 2, n - 1, k - 1) * a)
    nu = prefix(binom_ratio(p - 1, k - 1, n - 1, k) * a) + suffix(binom_ratio(p - 2, k - 1, n - 1, k) * a)
    if k == 1:
        ei = r[order]
    else:
        w = binom_ratio(p - 1, k - 2, n - 1, k - 1)
        ei = a * prefix(w) - prefix(w * a)

    def unsort(x: Tensor) -> Tensor:
        return torch.empty_like(x).index_copy_(0, order, x)

    rho = groups.gather(groups.sum(unsort(binom_ratio(p - 1, k - 1, n, k) * a)))

    sizes = groups.member_sizes()
    too_big = sizes < k
    nan = torch.full_like(r, float("nan"))
    mu = torch.where(too_big, nan, unsort(mu) + mean)
    nu = torch.where(sizes <= k, nan, unsort(nu) + mean)
    ei = torch.where(too_big, nan, unsort(ei))
    rho = torch.where(too_big, nan, rho + mean)
    return MaxKStats(mu=mu, nu=nu, ei=ei, rho=rho, sizes=sizes, k=k)


def _check_k(name: str, k: object) -> int:
    return check_int(name, k)


def check_k_range(estimator: str, groups: GroupIndex, k: int, low: int, high_offset: int,
                  *, skip_singletons: bool = True) -> None:
    """Raise ValueError naming the first group whose size N violates low <= K <= N + high_offset.

    Singleton groups are skipped when ``skip_singletons`` (they get advantage 0 regardless).
    """
    sizes = groups.sizes
    bad = (k < low) | (k > sizes + high_offset)
    if skip_singletons:
        bad &= sizes > 1
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0, 0])
        hi = "N" if high_offset == 0 else f"N{high_offset:+d}"
        raise ValueError(
            f"{estimator}: k={k} is out of range for group id {groups.ids[first].item()} "
            f"(N={int(sizes[first])}, K={k}); expected {low} <= K <= {hi} "
            f"({int(bad.sum())} group(s) affected)")


def maxk_quantities(rewards: Tensor, group: Tensor, k: int) -> MaxKStats:
    """mu, nu, EI and rho_K (module docstring, MaxPO §3 / App. E) for every member of every group.

    rewards: [B] float, group: [B] int ids (any order/sizes), k: 1 <= k <= N for every group
    (ValueError naming the group id, N and K otherwise). Returns float64 [B] tensors; O(B log B).
    """
    check_tensor("rewards", rewards, ndim=1)
    check_tensor("group", group, shape=[rewards.shape[0]], integer=True)
    check_finite("rewards", rewards)
    k = _check_k("k", k)
    groups = GroupIndex.from_ids(group)
    check_k_range("maxk_quantities", groups, k, 1, 0, skip_singletons=False)
    return _maxk_stats(rewards, groups, k)


def pass_at_k(n, c, k) -> Tensor:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c,k)/C(n,k).

    n, c, k: ints or broadcastable tensors with 0 <= c <= n and 1 <= k <= n. Returns float64.
    """
    values = {}
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not (torch.is_tensor(v) or isinstance(v, (int, float, list, tuple))):
            raise TypeError(f"{name}: expected an int or a tensor of counts, got {v!r}")
        t = torch.as_tensor(v, dtype=torch.float64)
        if not bool((torch.isfinite(t) & (t == t.round())).all()):
            raise ValueError(f"{name}: expected whole numbers (counts), got {t.tolist()}")
        values[name] = t
    n, c, k = values["n"], values["c"], values["k"]
    if bool(((c < 0) | (c > n)).any()):
        raise ValueError(f"c: expected 0 <= c <= n, got c={c.tolist()} n={n.tolist()}")
    if bool(((k < 1) | (k > n)).any()):
        raise ValueError(f"k: expected 1 <= k <= n, got k={k.tolist()} n={n.tolist()}")
    return 1.0 - binom_ratio(n - c, k, n, k)


def max_at_k(scores: Tensor, k: int) -> Tensor:
    """Unbiased max@k rho_k = sum_j C(j-1,k-1) a_j / C(n,k) of n scores [..., n] (sorted a_j).

    Returns float64 [...]; 1 <= k <= n.
    """
    check_tensor("scores", scores, floating=True)
    check_finite("scores", scores.reshape(1, -1))
    n = scores.shape[-1]
    k = _check_k("k", k)
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1 <= k <= n={n}, got {k}")
    a = torch.sort(scores.to(torch.float64), dim=-1).values
    j = torch.arange(1, n + 1, dtype=torch.float64, device=scores.device)
    return (binom_ratio(j - 1, k - 1, n, k) * a).sum(-1)


# ----------------------------------------------------------------------------- estimators


def _finish(name: str, adv: Tensor, batch: AdvantageBatch, normalize: str = "none", eps: float = 1e-6) -> Tensor:
    """Shared tail of estimator ``name``: optional division by the group reward std (+ ``eps`` > 0),
    singletons -> 0, float32."""
    check_choice(f"{name}.normalize", normalize, ("none", "std"))
    check_positive_float32(f"{name}.eps", eps)  # checked even when unused: a typo never passes silently
    if normalize == "std":
        adv = adv / (group_std(batch.rewards.to(torch.float64), batch.groups) + eps)
    return drop_singletons(adv, batch.groups).to(torch.float32)


@register_estimator("maxpo", k_range=KRange(1, below=1))
def maxpo(batch: AdvantageBatch, *, k: K, normalize: Normalize = "none", eps: Eps = 1e-6) -> Tensor:
    """MaxPO: A_i = EI_i - b_i^{L2O} = mu_i - nu_i, exactly centred per group, [B].

    1 <= K <= N-1 per group. ``normalize="std"`` divides by the group's reward std (N-1) + eps
    (GRPO-style heuristic; keeps the centring). Singleton groups: 0.
    """
    return _finish("maxpo", _maxk_stats(batch.rewards, batch.groups, k).advantage, batch, normalize, eps)


@register_estimator("ei", k_range=KRange(2))
def ei(batch: AdvantageBatch, *, k: K, normalize: Normalize = "none", eps: Eps = 1e-6) -> Tensor:
    """MaxPO's "EI-only" estimator (MaxPO §3.2, App. C): A_i = EI_i, raw, [B].

    Unbiased for the max@K gradient at the same scale as ``maxpo`` (which subtracts the L2O
    baseline, MaxPO eq. 6/11); ``pkpo`` is (K/N)·EI. Non-negative, not centred. 2 <= K <= N.
    ``normalize="std"`` as in ``maxpo``. Singletons: 0.
    """
    return _finish("ei", _maxk_stats(batch.rewards, batch.groups, k).ei, batch, normalize, eps)


@register_estimator("pkpo", k_range=KRange(2))
def pkpo(batch: AdvantageBatch, *, k: K, normalize: Normalize = "none", eps: Eps = 1e-6) -> Tensor:
    """PKPO ``sloo_minus_one`` (Walder & Karkhanis 2025): (K/N) EI_i = max@K - max@(K-1), [B].

    Non-negative (not centred). 2 <= K <= N. ``normalize="std"`` as in ``maxpo``. Singletons: 0.
    """
    stats = _maxk_stats(batch.rewards, batch.groups, k)
    return _finish("pkpo", k / stats.sizes.to(torch.float64) * stats.ei, batch, normalize, eps)


@register_estimator("maxk_bon", k_range=KRange(1, below=1))   # K = N: every s_i equal, A = 0
def maxk_bon(batch: AdvantageBatch, *, k: K, eps: Eps = 1e-6) -> Tensor:
    """Bagirov et al. 2025 "BoN mean": z-score within the group of PKPO's s_i = (K/N) mu_i,
    std with N-1 plus eps as in ``grpo`` (MaxPO App. F.6 eq. 103). 1 <= K < N (at K = N every s_i is
    equal). Singletons: 0."""
    stats = _maxk_stats(batch.rewards, batch.groups, k)
    s = k / stats.sizes.to(torch.float64) * stats.mu
    s = torch.where(stats.sizes == 1, torch.zeros_like(s), s)  # mu is nan when K > N = 1
    check_positive_float32("maxk_bon.eps", eps)
    return _finish("maxk_bon", (s - batch.groups.mean(s)) / (group_std(s, batch.groups) + eps), batch)


@register_estimator("passk_chen", k_range=KRange(1, below=1))   # K = N: σ = 0, A = 0
def passk_chen(batch: AdvantageBatch, *, k: K, eps: Eps = 1e-6) -> Tensor:
    """Chen et al. 2025 analytic pass@K advantage for binary rewards (MaxPO App. F.5 eq. 97):

        rho = 1 - C(N-c,K)/C(N,K),  sigma = sqrt(rho (1 - rho))
        A_correct = (1 - rho) / (sigma + eps)
        A_wrong   = (1 - rho - C(N-c-1,K-1)/C(N-1,K-1)) / (sigma + eps)

    Rewards must be 0/1 per group; 1 <= K < N (at K = N, σ = 0). All-correct / all-wrong groups give 0.
    Singletons: 0.
    """
    check_positive_float32("passk_chen.eps", eps)
    groups = batch.groups
    r = batch.rewards.to(torch.float64)
    nonbinary = groups.sum(((r != 0) & (r != 1)).to(torch.int64)) > 0
    if bool(nonbinary.any()):
        g = int(torch.nonzero(nonbinary)[0, 0])
        raise ValueError(f"passk_chen: rewards must be 0/1, but group id {groups.ids[g].item()} "
                         f"(N={int(groups.sizes[g])}, K={k}) has non-binary rewards")
    n = groups.member_sizes().to(torch.float64)
    c = groups.gather(groups.sum(r))
    fail_all = binom_ratio(n - c, k, n, k)
    rho = 1.0 - fail_all
    sigma = (rho * (1.0 - rho)).clamp(min=0).sqrt()
    adv = torch.where(r > 0, 1.0 - rho, 1.0 - rho - binom_ratio(n - c - 1, k - 1, n - 1, k - 1))
    return _finish("passk_chen", adv / (sigma + eps), batch)
