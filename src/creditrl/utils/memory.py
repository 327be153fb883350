"""Peak-memory accounting for CPU code paths (used by tests and benchmarks).

CUDA has ``torch.cuda.max_memory_allocated``; the CPU allocator has no such counter, so
``PeakMemory`` counts the storages that ops create under a dispatch mode while they stay alive.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class PeakMemory(TorchDispatchMode):
    """Tracks the peak bytes of tensors allocated by ops run under the mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def _release(self, key, size):
        self.live -= size
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key not in self.seen and key not in inputs:  # views/in-place results are not new
                    size = t.untyped_storage().nbytes()
                    self.seen.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._release, key, size)
        return out
