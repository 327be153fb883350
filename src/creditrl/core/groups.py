"""Segment (per-group) reductions over a batch, with no Python loop over groups.

A batch of B responses carries integer group ids [B] (any values, any order, any sizes).
``GroupIndex`` maps them once to dense ids 0..G-1 so every reduction is one scatter-add.
The usual layout — G groups of N rows each, stored one group after another — is detected once
and reduced through a [G, N, ...] view instead (no scatter, no gather copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupIndex:
    """Dense view of group ids: ``dense[b]`` in 0..G-1, ``sizes[g]`` members of group g."""

    dense: Tensor  # [B] int64
    sizes: Tensor  # [G] int64
    ids: Tensor    # [G] original id of each dense group
    block: int | None = None  # N when rows are G contiguous blocks of N (dense id = block index)

    @classmethod
    def from_ids(cls, group: Tensor) -> "GroupIndex":
        """Dense ids for any layout; G contiguous blocks of N rows (the usual layout, whatever the
        ids' values or order) are numbered by block, so reductions use a [G, N, ...] view. The
        layout is read on the host (B ids: numpy's ops cost ~1 us where torch's cost ~5-10 us each)."""
        size = block_size(group.detach().cpu().numpy())
        if size is None:
            ids, dense, sizes = torch.unique(group, return_inverse=True, return_counts=True)
            return cls(dense=dense, sizes=sizes, ids=ids)
        rows = group.numel()
        dense = torch.from_numpy(np.arange(rows, dtype=np.int64) // size).to(group.device)
        sizes = torch.from_numpy(np.full(rows // size, size, dtype=np.int64)).to(group.device)
        return cls(dense=dense, sizes=sizes, ids=group[::size], block=size)

    @property
    def num_groups(self) -> int:
        return int(self.sizes.numel())

    def sum(self, x: Tensor) -> Tensor:
        """Per-group sum of ``x`` [B, ...] -> [G, ...]."""
        if self.block is not None:
            return x.reshape(self.num_groups, self.block, *x.shape[1:]).sum(1)
        out = x.new_zeros((self.num_groups,) + tuple(x.shape[1:]))
        return out.index_add_(0, self.dense, x)

    def weighted_sums(self, weights: Tensor, x: Tensor) -> Tensor:
        """out[g, j] = sum_{i in g} weights[i, j] * x[i] for weights [B, K], x [B, L] -> [G, K, L]:
        K weighted group sums in one pass over ``x`` (a batched matmul when groups are blocks)."""
        if self.block is not None:
            return torch.bmm(weights.reshape(self.num_groups, self.block, -1).transpose(1, 2).to(x.dtype),
                             x.unflatten(0, (self.num_groups, self.block)))
        return torch.stack([self.sum(weights[:, j: j + 1].to(x.dtype) * x) for j in range(weights.shape[1])], 1)

    def gather(self, per_group: Tensor) -> Tensor:
        """Broadcast a per-group value [G, ...] back to members [B, ...]."""
        return per_group.index_select(0, self.dense)

    def subtract(self, x: Tensor, per_group: Tensor, out: Tensor | None = None) -> Tensor:
        """``x - gather(per_group)`` for x [B, ...], per_group [G, ...], without the gathered copy;
        written into ``out`` (a contiguous tensor of the result's shape and dtype) where given."""
        if self.block is not None:
            grouped, per = x.reshape(self.num_groups, self.block, *x.shape[1:]), per_group.unsqueeze(1)
            target = None if out is None else out.view(torch.broadcast_shapes(grouped.shape, per.shape))
            return torch.sub(grouped, per, out=target).flatten(0, 1)
        return torch.sub(x, self.gather(per_group), out=out)

    def member_sizes(self) -> Tensor:
        """Size of each member's group, [B] int64 (one tensor per index: do not write to it)."""
        return self._member_sizes

    @cached_property
    def _member_sizes(self) -> Tensor:
        return self.sizes.index_select(0, self.dense)

    @property
    def without_singletons(self) -> bool:
        """True when no group has one member, known without reading the sizes (blocks of N >= 2);
        False means there may be some."""
        return self.block is not None and self.block > 1

    def group_mean(self, x: Tensor) -> Tensor:
        """Per-group mean of ``x`` [B, ...] -> [G, ...]."""
        return self.sum(x) / self.sizes.to(x.dtype).reshape((-1,) + (1,) * (x.dim() - 1))

    def mean(self, x: Tensor) -> Tensor:
        """Group mean broadcast to members, [B, ...]."""
        return self.gather(self.group_mean(x))

    def exclusive_sum(self, x: Tensor) -> Tensor:
        """out[i] = sum of ``x`` [B, ...] over the *other* members of i's group, [B, ...] (0 for singletons).

        Summed from the others' values alone (an exclusive prefix plus an exclusive suffix sum
        within each group), never as ``group total − x[i]``: the result does not depend on x[i]
        even in rounding, and a member holding almost all of a non-negative total leaves the
        others' small sum exact instead of a cancellation residue."""
        if self.block is not None:
            return _exclusive_sums(x.reshape(self.num_groups, self.block, *x.shape[1:])).reshape(x.shape)
        rank = self._rank_in_group()
        padded = x.new_zeros((self.num_groups, int(self.sizes.max())) + tuple(x.shape[1:]))
        padded[self.dense, rank] = x
        return _exclusive_sums(padded)[self.dense, rank]

    def _rank_in_group(self) -> Tensor:
        """[B] int64: each member's position among its group's members (in row order)."""
        order = torch.sort(self.dense, stable=True).indices
        starts = torch.cumsum(self.sizes, 0) - self.sizes
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device) - starts[self.dense[order]]
        return rank


def block_size(ids: np.ndarray) -> int | None:
    """N when ``ids`` [B] are G runs of N equal ids whose values never repeat across runs (the
    [G, N] block layout), else None (also for B = 0)."""
    rows = ids.size
    if not rows:
        return None
    starts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    size = int(starts[0]) if starts.size else rows
    if rows % size or starts.size != rows // size - 1 or not (starts == np.arange(size, rows, size)).all():
        return None
    heads = ids[::size]                        # increasing ids (the usual numbering) need no sort
    return size if (heads[1:] > heads[:-1]).all() or np.unique(heads).size == heads.size else None


def uniform_groups(values: Tensor, group: Tensor) -> Tensor:
    """[G] bool, per dense group of ``group`` [B] (``GroupIndex.from_ids``): whether ``values`` [B] are
    the same for all its members. NaN (a value a response lacks) is left out; fewer than 2 values never
    vary. One max and one min scatter, no loop over groups."""
    index = GroupIndex.from_ids(group)
    missing = torch.isnan(values)
    high = torch.full((index.num_groups,), -torch.inf, dtype=values.dtype, device=values.device).scatter_reduce(
        0, index.dense, values.masked_fill(missing, -torch.inf), "amax")
    low = torch.full((index.num_groups,), torch.inf, dtype=values.dtype, device=values.device).scatter_reduce(
        0, index.dense, values.masked_fill(missing, torch.inf), "amin")
    return ~(high > low)


def _exclusive_sums(grouped: Tensor) -> Tensor:
    """[G, N, ...] -> [G, N, ...]: for each member the sum over the other N − 1 along dim 1, as its
    exclusive prefix sum plus its exclusive suffix sum (neither ever holds the member itself)."""
    out = torch.empty_like(grouped)
    out[:, 0] = 0
    torch.cumsum(grouped[:, :-1], 1, out=out[:, 1:])
    out[:, :-1] += grouped[:, 1:].flip(1).cumsum(1).flip(1)
    return out
