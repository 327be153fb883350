"""Linear layers with pre-packed weights while sampling on a CPU.

A decoding step multiplies a few rows (the live responses) by every weight matrix. At so few
rows a CPU GEMM spends much of its time reordering the weight into its blocked layout, on every
call: on the 2-core dev CPU a [16, 576] x [576, 1536] float32 product over distinct weights ran at
49 GFLOP/s through ``F.linear`` and 82 GFLOP/s through oneDNN with the weight reordered once
(``mkldnn._reorder_linear_weight``), which is what vLLM's and IPEX's CPU paths do. ``packed_linears``
reorders each ``nn.Linear``'s weight once per sampling call (the weights change every optimizer
step) and routes the layer through oneDNN until the call ends.

It applies only where the result is the same product up to float32 rounding: a CPU model,
float32 weights, ``torch.nn.Linear`` itself (not a subclass, nor a module whose ``forward`` is
already replaced, e.g. by accelerate's hooks), and no autocast when the layer runs (a bf16 product
is autocast's, so those calls take the plain path). Only weights of more than ``PACK_MIN_ELEMENTS``
are packed: oneDNN's call costs ~30 µs more than ``F.linear``'s, which small products do not
earn back. While a call lasts it holds a second copy of the packed weights; in ``creditrl train``
the update's peak (weights, gradients and Adam's two moments) is larger than sampling's with it,
except under LoRA, where the frozen base's copy adds its size.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn


# plain / packed at 16 and 64 rows on the 2-core dev CPU: 64 x 64 0.31-0.35, 128 x 512 (2^16 elements)
# 0.96-1.12, 576 x 192 1.09-1.19, 576 x 576 1.03-1.39, 576 x 1536 1.30-1.68
PACK_MIN_ELEMENTS = 1 << 16


def can_pack(model: nn.Module) -> bool:
    """True where ``packed_linears`` packs anything: a float32 model on the CPU with oneDNN's packed
    linear available in this torch build."""
    first = next(model.parameters(), None)
    return (first is not None and first.device.type == "cpu" and first.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _packable(module: nn.Module, min_elements: int) -> bool:
    if type(module) is not nn.Linear or "forward" in module.__dict__:
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() > max(min_elements, 0)


def _packed_forward(plain, weight: Tensor, bias: Tensor | None):
    def forward(x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_autocast_enabled("cpu"):
            return plain(x)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return forward


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int, enabled: bool = True,
                   min_elements: int = PACK_MIN_ELEMENTS) -> Iterator[int]:
    """Within the block, every packable ``nn.Linear`` of ``model`` (module docstring) whose weight has
    more than ``min_elements`` elements multiplies by that weight reordered for products of about
    ``rows`` rows; yields how many layers it packed (0 where ``enabled`` is False or nothing qualifies). Weights must not change inside the block: the
    packed copies are taken on entry. Gradients do not flow through the packed path (sampling runs
    without them)."""
    if not enabled or not can_pack(model):
        yield 0
        return
    patched = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if _packable(module, min_elements):
                    weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), max(int(rows), 1))
                    bias = None if module.bias is None else module.bias.detach()
                    module.forward = _packed_forward(module.forward, weight, bias)
                    patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
