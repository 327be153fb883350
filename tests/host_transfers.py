"""Test helper: record every device-to-host copy and every scalar read of a tensor.

``HostTransfers`` is a dispatch mode, so it sees what the code asks of ATen, whatever Python
spelling it used: ``.cpu()``, ``.to("cpu")``, ``.tolist()`` and ``.numpy()`` of a device tensor
are device-to-host copies (``_to_copy`` / ``copy_`` into a CPU tensor); ``.item()``, ``bool(t)``,
``int(t)`` and ``float(t)`` are scalar reads (``_local_scalar_dense``), each one a host sync on
CUDA. Each record names the innermost Python frame outside torch, so a report says whose code
(creditrl's, transformers', ...) asked for it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIRS = ("/torch/", "/host_transfers.py")


@dataclass(frozen=True)
class Transfer:
    kind: str            # "copy" (device -> host) or "scalar" (a scalar read of a tensor)
    device: str          # the source tensor's device type
    shape: tuple[int, ...]
    where: str           # innermost non-torch frame, "path:line"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def creditrl(self) -> bool:
        return self.where.startswith("creditrl/")


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and any(d in frame.f_code.co_filename for d in _TORCH_DIRS):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    cut = max(path.rfind("/creditrl/"), path.rfind("/site-packages/"), path.rfind("/tests/"))
    return f"{path[cut + 1:] if cut >= 0 else path}:{frame.f_lineno}"


class HostTransfers(TorchDispatchMode):
    """``with HostTransfers() as rec: ...`` then ``rec.records`` (list of ``Transfer``)."""

    def __init__(self):
        super().__init__()
        self.records: list[Transfer] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.records.append(Transfer("scalar", args[0].device.type, tuple(args[0].shape), _caller()))
        elif name in ("_to_copy", "copy", "_copy_from_and_resize", "_copy_from"):
            src = args[0]
            if isinstance(out, torch.Tensor) and src.device.type != "cpu" and out.device.type == "cpu":
                self.records.append(Transfer("copy", src.device.type, tuple(src.shape), _caller()))
        elif name == "copy_":
            dst, src = args[0], args[1]
            if src.device.type != "cpu" and dst.device.type == "cpu":
                self.records.append(Transfer("copy", src.device.type, tuple(src.shape), _caller()))
        return out

    def on(self, device: torch.device | str, kind: str | None = None) -> list[Transfer]:
        """Records whose source tensor lives on ``device``'s type (and of ``kind``)."""
        dev = torch.device(device).type
        return [r for r in self.records if r.device == dev and (kind is None or r.kind == kind)]

    def summary(self) -> dict[str, int]:
        """{"kind device shape @ where": count}, for failure messages and reports."""
        out: dict[str, int] = {}
        for r in self.records:
            key = f"{r.kind} {r.device} {list(r.shape)} @ {r.where}"
            out[key] = out.get(key, 0) + 1
        return out
