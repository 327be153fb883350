"""The valid-step view of a batch: step t of a response is its t-th *valid* token.

Multi-turn responses interleave generated tokens with masked tool output; OTB (OTB paper
§4, "baselines only over valid tokens") and returns-to-go are defined over the generated
tokens alone. ``StepIndex`` compacts each row's valid tokens to the left ([B,T] -> [B,L],
L = longest response) with one cumsum, and scatters results back; O(B·T), no loops.
Right-padded masks (valid tokens already first) take a fast path with no scatter/gather.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Largest discount power the blocked returns-to-go lets a block span (see returns_to_go).
_MIN_BLOCK_DISCOUNT = 1e-150


@dataclass(frozen=True)
class StepIndex:
    """pos[b,t]: compacted column of token t (L for masked tokens); lengths[b]: valid tokens."""

    pos: Tensor | None  # [B, T] int64; None on the prefix fast path
    lengths: Tensor     # [B] int64
    num_steps: int      # L = max(lengths)
    num_tokens: int     # T

    @classmethod
    def from_mask(cls, mask: Tensor) -> "StepIndex":
        mask = mask.bool()
        lengths = mask.sum(1)
        num_steps = int(lengths.max()) if mask.numel() else 0
        steps = torch.arange(mask.shape[1], device=mask.device)
        if torch.equal(mask, steps[None, :] < lengths[:, None]):
            return cls(pos=None, lengths=lengths, num_steps=num_steps, num_tokens=mask.shape[1])  # already compact (right padding)
        pos = torch.where(mask, mask.cumsum(1) - 1, torch.full_like(lengths[:, None], num_steps))
        return cls(pos=pos, lengths=lengths, num_steps=num_steps, num_tokens=mask.shape[1])

    def live(self) -> Tensor:
        """[B, L] bool: step t exists for response b (t < its length)."""
        steps = torch.arange(self.num_steps, device=self.lengths.device)
        return steps[None, :] < self.lengths[:, None]

    def compact(self, x: Tensor) -> Tensor:
        """[B, T] -> [B, L]: valid tokens moved left in order, 0 past each row's length."""
        if self.pos is None:
            return torch.where(self.live(), x[:, : self.num_steps], torch.zeros((), dtype=x.dtype, device=x.device))
        out = x.new_zeros(x.shape[0], self.num_steps + 1)
        return out.scatter_(1, self.pos, x)[:, : self.num_steps]

    def expand(self, xc: Tensor) -> Tensor:
        """[B, L] -> [B, T]: inverse of ``compact``; 0 at masked tokens (``xc`` is 0 past lengths)."""
        if self.pos is None:
            return torch.nn.functional.pad(xc, (0, self.num_tokens - self.num_steps))
        padded = torch.cat([xc, xc.new_zeros(xc.shape[0], 1)], dim=1)
        return padded.gather(1, self.pos)


def discounted_suffix_sum(x: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k>=t} gamma^{k-t} x_k along the last dim, float64, O(T), no overflow.

    The scaling trick G_t = gamma^{-t} sum_{k>=t} gamma^k x_k overflows for long T, so the
    sequence is cut into blocks of length D with gamma^D >= 1e-150: inside a block the trick is
    safe in float64, and each block adds the next block's start value discounted by
    gamma^{D-o}. Terms two or more blocks away are dropped; they are below 1e-150 relative,
    far beneath float32 resolution of the result.
    """
    x = x.to(torch.float64)
    n = x.shape[-1]
    if gamma == 1.0 or n == 0:
        return x.flip(-1).cumsum(-1).flip(-1)
    if gamma == 0.0:
        return x.clone()
    block = n if gamma ** n >= _MIN_BLOCK_DISCOUNT else max(1, int(math.log(_MIN_BLOCK_DISCOUNT) / math.log(gamma)))
    num_blocks = -(-n // block)
    xb = torch.nn.functional.pad(x, (0, num_blocks * block - n)).reshape(*x.shape[:-1], num_blocks, block)
    offsets = torch.arange(block, dtype=torch.float64, device=x.device)
    up, down = gamma ** offsets, gamma ** -offsets
    local = (xb * up).flip(-1).cumsum(-1).flip(-1) * down
    next_start = torch.nn.functional.pad(local[..., 1:, 0], (0, 1))  # G at the next block's start
    local = local + next_start[..., None] * gamma ** (block - offsets)
    return local.reshape(*x.shape[:-1], num_blocks * block)[..., :n]


def returns_to_go(rewards: Tensor, steps: StepIndex, gamma: float = 1.0) -> Tensor:
    """Returns-to-go over valid tokens: G_t = sum_{k>=t} gamma^{k-t} r_k, k over valid steps.

    rewards: [B, T] token rewards (masked tokens ignored). Returns float32 [B, T], 0 where masked.
    """
    return steps.expand(discounted_suffix_sum(steps.compact(rewards.to(torch.float64)), gamma)).float()
