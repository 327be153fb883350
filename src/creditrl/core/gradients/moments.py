"""Streaming sufficient statistics of several gradient estimators measured on the same draws.

A *draw* is one group's gradient under each of E estimators, ``grads`` [E, D] (D: all parameters,
a subset, or a sketch of them). Draws come in *units*, the independent sampling units: draws of
one unit (e.g. several groups of one prompt) may be dependent, draws of different units are
independent with a common mean mu_e = E[g_e]. Units are dealt round-robin into K *folds*, the
resampling units of the intervals (``quality``). Per fold f the accumulator keeps

    n_f        draws;                 m_f = sum_{u in f} n_u^2  (same-unit ordered pairs, self included)
    Q_f [E,E]  sum_k g_k g_k^T        (per-draw second moments, over the fold's draws)
    S_f [E,E]  sum_u s_u s_u^T        (s_u = sum of unit u's draws)
    F_f [E,D]  sum of the fold's draws (kept until ``stats``; memory K·E·D, float32 by default)

and ``stats`` returns them with the folds' cross Gram C[f,h] = F_f F_h^T [K,K,E,E] (float64).
Every estimate is a function of (n, m, Q, S, C); the vectors are not needed after ``stats``.
Only the current unit's sum [E, D] is held besides the folds, so a 135M-parameter model fits when
K·E·D floats do (else pass a parameter subset or a sketch, ``sketch.CountSketch``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
from torch import Tensor

from creditrl.utils.validate import check_finite, check_int, check_tensor


@dataclass(frozen=True)
class GradientStats:
    """Sufficient statistics of E estimators' gradients over K folds (module docstring), float64.

    names: the E estimators; draws [K]; same_unit [K] = sum_u n_u^2; second [K,E,E] = Q_f;
    within [K,E,E] = S_f; cross [K,K,E,E] = F_f F_h^T."""

    names: tuple[str, ...]
    draws: Tensor
    same_unit: Tensor
    second: Tensor
    within: Tensor
    cross: Tensor

    def to_dict(self) -> dict:
        """JSON-ready (lists of floats)."""
        return {"names": list(self.names), **{k: getattr(self, k).tolist()
                                             for k in ("draws", "same_unit", "second", "within", "cross")}}

    @classmethod
    def from_dict(cls, data: dict) -> "GradientStats":
        tensors = {k: torch.tensor(data[k], dtype=torch.float64)
                   for k in ("draws", "same_unit", "second", "within", "cross")}
        return cls(names=tuple(data["names"]), **tensors)

    def nonempty(self) -> "GradientStats":
        """The folds that hold draws (fewer units than folds leave some empty)."""
        keep = torch.nonzero(self.draws > 0).flatten()
        return GradientStats(self.names, self.draws[keep], self.same_unit[keep], self.second[keep],
                             self.within[keep], self.cross[keep][:, keep])

    def with_multiple(self, name: str, source: str, factor: float) -> "GradientStats":
        """These statistics plus an estimator ``name`` whose every draw is exactly ``factor`` × ``source``'s
        (e.g. ``dr_grpo`` = (N−1)/N · ``rloo``): its rows and columns of Q, S and C follow without a gradient."""
        e = self.index(source)
        scale = torch.ones(len(self.names) + 1, dtype=torch.float64)
        scale[-1] = factor
        pick = torch.tensor([*range(len(self.names)), e])

        def grow(x: Tensor) -> Tensor:                    # [..., E, E] -> [..., E+1, E+1]
            return x[..., pick, :][..., :, pick] * scale[:, None] * scale[None, :]

        return GradientStats((*self.names, name), self.draws, self.same_unit, grow(self.second), grow(self.within),
                             grow(self.cross))

    def index(self, name: str, argument: str = "name") -> int:
        return name_index(self.names, name, argument)


def name_index(names: Sequence[str], name: str, argument: str = "name") -> int:
    """The position of ``name`` in ``names``; a ValueError naming ``argument`` when it is not there."""
    if name not in names:
        raise ValueError(f"{argument}: expected one of the measured estimators {list(names)}, got {name!r}")
    return list(names).index(name)


class GradientMoments:
    """Accumulate ``GradientStats`` one draw at a time (module docstring).

    ``add(grads, unit)``: grads [E, D] of one draw; ``unit`` a hashable id of its independent unit
    (None: the draw is a unit of its own). A unit's draws must arrive one after another: a new id
    closes the previous unit, and an id seen before is refused. ``folds`` K >= 1 (K = 1: point
    estimates only; intervals need K >= 2 folds, ``quality``)."""

    def __init__(self, names: Sequence[str], dim: int, *, folds: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.names = tuple(names)
        if not self.names or len(set(self.names)) != len(self.names):
            raise ValueError(f"names: expected distinct estimator names, got {list(self.names)}")
        self.dim = check_int("dim", dim, 1)
        self.folds = check_int("folds", folds, 1)
        E = len(self.names)
        self._sums = torch.zeros(self.folds, E, self.dim, dtype=dtype, device=device)
        self._draws = torch.zeros(self.folds, dtype=torch.float64)
        self._same_unit = torch.zeros(self.folds, dtype=torch.float64)
        self._second = torch.zeros(self.folds, E, E, dtype=torch.float64)
        self._within = torch.zeros(self.folds, E, E, dtype=torch.float64)
        self._open: tuple[Hashable, Tensor, int] | None = None   # (unit id, its running sum, its draws)
        self._seen: set = set()
        self._units = 0

    def add(self, grads: Tensor, unit: Hashable | None = None) -> None:
        check_tensor("grads", grads, shape=[len(self.names), self.dim], floating=True)
        check_finite("grads", grads)
        g = grads.detach().to(torch.float64)
        if self._open is None or unit is None or unit != self._open[0]:
            self._close()
            if unit is not None:
                if unit in self._seen:
                    raise ValueError(f"unit: expected each unit's draws one after another, got unit {unit!r} "
                                     "again after other units")
                self._seen.add(unit)
            self._open = (unit, torch.zeros_like(g), 0)
        key, total, count = self._open
        f = self._units % self.folds
        self._second[f] += _gram(g, g)
        self._draws[f] += 1
        self._open = (key, total.add_(g), count + 1)

    def add_many(self, grads: Tensor, units: Sequence[Hashable] | None = None) -> None:
        """Add whole units at once, vectorised: grads [n, E, D] with ``units`` [n] contiguous ids not
        seen before (None: one unit per draw). Equal to ``add`` draw by draw."""
        check_tensor("grads", grads, shape=[None, len(self.names), self.dim], floating=True)
        check_finite("grads", grads)
        self._close()
        if grads.shape[0] == 0:
            if units is not None and len(units) != 0:
                raise ValueError(f"units: expected one id per draw (0), got {len(units)}")
            return
        ids = list(range(grads.shape[0])) if units is None else list(units)
        if len(ids) != grads.shape[0]:
            raise ValueError(f"units: expected one id per draw ({grads.shape[0]}), got {len(ids)}")
        starts = [k for k in range(len(ids)) if k == 0 or ids[k] != ids[k - 1]]
        named = [ids[k] for k in starts]
        repeated = set(named) & self._seen if units is not None else set()
        if len(set(named)) != len(named) or repeated:
            raise ValueError("units: expected each unit's draws one after another, got ids "
                             f"{sorted(map(str, repeated)) or named}")
        if units is not None:
            self._seen.update(named)
        first = torch.zeros(len(ids), dtype=torch.int64)
        first[torch.tensor(starts, dtype=torch.int64)] = 1
        unit = torch.cumsum(first, 0) - 1                                          # [n] 0..U-1
        fold = (unit + self._units) % self.folds
        g = grads.detach().to(torch.float64)
        sums = torch.zeros(len(starts), *g.shape[1:], dtype=torch.float64).index_add_(0, unit, g)
        unit_fold, counts = fold[torch.tensor(starts)], torch.bincount(unit).to(torch.float64)
        self._draws.index_add_(0, fold, torch.ones(len(ids), dtype=torch.float64))
        self._same_unit.index_add_(0, unit_fold, counts.square())
        self._second.index_add_(0, fold, torch.einsum("ned,nfd->nef", g, g))
        self._within.index_add_(0, unit_fold, torch.einsum("ued,ufd->uef", sums, sums))
        self._sums.index_add_(0, unit_fold, sums.to(self._sums.dtype))
        self._units += len(starts)

    def _close(self) -> None:
        if self._open is None:
            return
        _, total, count = self._open
        f = self._units % self.folds
        self._within[f] += _gram(total, total)
        self._same_unit[f] += count * count
        self._sums[f] += total.to(self._sums.dtype)
        self._units += 1
        self._open = None

    def stats(self, names: Sequence[str] | None = None) -> GradientStats:
        """The statistics so far (closes the open unit; more draws may follow in new units), of the
        estimators ``names`` only when given (their cross Gram alone is computed: K·E' vectors)."""
        self._close()
        pick = list(range(len(self.names))) if names is None else [name_index(self.names, n, "names") for n in names]
        index = torch.tensor(pick)
        flat = self._sums[:, index].reshape(-1, self.dim)
        K, E = self.folds, len(pick)
        cross = _gram(flat, flat).reshape(K, E, K, E).permute(0, 2, 1, 3).contiguous()
        return GradientStats(tuple(self.names[i] for i in pick), self._draws.clone(), self._same_unit.clone(),
                             self._second[:, index][:, :, index].clone(), self._within[:, index][:, :, index].clone(),
                             cross)


def _gram(a: Tensor, b: Tensor, chunk: int = 1 << 22) -> Tensor:
    """a b^T in float64 for a [R, D], b [S, D], over column chunks (no float64 copy of a whole 135M-wide
    matrix at once)."""
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[1], chunk):
        out += a[:, start:start + chunk].double() @ b[:, start:start + chunk].double().T
    return out


def moments_from_draws(names: Sequence[str], grads: Tensor, units: Sequence[Hashable] | None = None,
                       folds: int = 1) -> GradientStats:
    """``GradientStats`` of draws grads [n, E, D] (units [n]: contiguous ids; None: one unit per draw)."""
    check_tensor("grads", grads, ndim=3, floating=True)
    moments = GradientMoments(names, grads.shape[2], folds=folds, dtype=torch.float64)
    moments.add_many(grads, units)
    return moments.stats()
