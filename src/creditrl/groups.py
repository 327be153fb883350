"""Segment (per-group) reductions over a batch, with no Python loop over groups.

A batch of B responses carries integer group ids [B] (any values, any order, any sizes).
``GroupIndex`` maps them once to dense ids 0..G-1 so every reduction is one scatter-add.
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

    @classmethod
    def from_ids(cls, group: Tensor) -> "GroupIndex":
        ids, dense, sizes = torch.unique(group, return_inverse=True, return_counts=True)
        return cls(dense=dense, sizes=sizes, ids=ids)

    @property
    def num_groups(self) -> int:
        return int(self.sizes.numel())

    def sum(self, x: Tensor) -> Tensor:
        """Per-group sum of ``x`` [B, ...] -> [G, ...]."""
        out = x.new_zeros((self.num_groups,) + tuple(x.shape[1:]))
        return out.index_add_(0, self.dense, x)

    def gather(self, per_group: Tensor) -> Tensor:
        """Broadcast a per-group value [G, ...] back to members [B, ...]."""
        return per_group.index_select(0, self.dense)

    def member_sizes(self) -> Tensor:
        """Size of each member's group, [B] int64."""
        return self.sizes.index_select(0, self.dense)

    def mean(self, x: Tensor) -> Tensor:
        """Group mean broadcast to members, [B, ...]."""
        sizes = self.sizes.to(x.dtype).reshape((-1,) + (1,) * (x.dim() - 1))
        return self.gather(self.sum(x) / sizes)
