"""Segment (per-group) reductions over a batch, with no Python loop over groups.

A batch of B responses carries integer group ids [B] (any values, any order, any sizes).
``GroupIndex`` maps them once to dense ids 0..G-1 so every reduction is one scatter-add.
The usual layout — G groups of N rows each, stored one group after another — is detected once
and reduced through a [G, N, ...] view instead (no scatter, no gather copy).
"""
from __future__ import annotations

from dataclasses import dataclass

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
        ids' values or order) are numbered by block, so reductions use a [G, N, ...] view."""
        rows = group.numel()
        if rows:
            starts = torch.nonzero(group[1:] != group[:-1]).flatten() + 1
            size = int(starts[0]) if starts.numel() else rows
            if (rows % size == 0 and torch.equal(starts, torch.arange(size, rows, size, device=group.device))
                    and torch.unique(group[::size]).numel() == rows // size):
                dense = torch.arange(rows, device=group.device) // size
                sizes = torch.full((rows // size,), size, dtype=torch.int64, device=group.device)
                return cls(dense=dense, sizes=sizes, ids=group[::size], block=size)
        ids, dense, sizes = torch.unique(group, return_inverse=True, return_counts=True)
        return cls(dense=dense, sizes=sizes, ids=ids)

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

    def subtract(self, x: Tensor, per_group: Tensor) -> Tensor:
        """``x - gather(per_group)`` for x [B, ...], per_group [G, ...], without the gathered copy."""
        if self.block is not None:
            grouped = x.reshape(self.num_groups, self.block, *x.shape[1:])
            out = grouped - per_group.unsqueeze(1)
            return out.reshape(-1, *out.shape[2:])
        return x - self.gather(per_group)

    def member_sizes(self) -> Tensor:
        """Size of each member's group, [B] int64."""
        return self.sizes.index_select(0, self.dense)

    def mean(self, x: Tensor) -> Tensor:
        """Group mean broadcast to members, [B, ...]."""
        sizes = self.sizes.to(x.dtype).reshape((-1,) + (1,) * (x.dim() - 1))
        return self.gather(self.sum(x) / sizes)
