"""Linear layers with pre-packed weights while sampling on a CPU.

A decoding step multiplies a few rows (the live responses) by every weight matrix. At so few
rows a CPU GEMM spends much of its time reordering the weight into its blocked layout, on every
call: on the 2-core dev CPU a [16, 576] x [576, 1536] float32 product over distinct weights ran at
49 GFLOP/s through ``F.linear`` and 82 GFLOP/s through oneDNN with the weight reordered once
(``mkldnn._reorder_linear_weight``), which is what vLLM's and IPEX's CPU paths do. ``packed_linears``
reorders each ``nn.Linear``'s weight once per sampling call (the weights change every optimizer
step) and routes the layer through oneDNN until the call ends.

It applies only where the result is the plain product up to float32 rounding, and the layer
is what it seems; anything else keeps the plain path:
- a CPU model with float32 weights and float32 matmuls at their default precision ("highest": a
  lower one lets oneDNN use bf16 where the CPU has it, and a packed layout there is untested);
- ``torch.nn.Linear`` itself whose ``weight`` is its own registered 2-D Parameter of plain tensor
  type (not a subclass such as DTensor, nor a weight a pre-hook recomputes: ``weight_norm``,
  ``prune``), with a forward not already replaced (accelerate's hooks) and not the base layer of a
  peft adapter that is merged (peft unmerges it in place inside a forward);
- no autocast on entry (the products would be autocast's bf16 ones: nothing is packed) nor when
  the layer runs, no gradient needed, no ``torch.compile`` tracing, and the weight unchanged since
  it was packed (the same tensor at the same version).
Only weights of more than ``PACK_MIN_ELEMENTS`` are packed: oneDNN's call costs ~30 µs more than
``F.linear``'s, which small products do not earn back. While a call lasts it holds a second copy of
the packed weights; in ``creditrl train`` the update's peak (weights, gradients and Adam's two
moments) is larger than sampling's with it, except under LoRA, where the frozen base's copy adds
its size.
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
    """True where ``packed_linears`` may pack: a float32 model on the CPU, float32 matmuls at their
    default precision, no autocast, and oneDNN's packed linear in this torch build."""
    first = next(model.parameters(), None)
    return (first is not None and first.device.type == "cpu" and first.dtype == torch.float32
            and torch.get_float32_matmul_precision() == "highest" and not torch.is_autocast_enabled("cpu")
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _merged_adapter_bases(model: nn.Module) -> set[int]:
    """ids of the base layers of peft adapter layers holding merged adapters."""
    return {id(m.get_base_layer()) for m in model.modules()
            if getattr(m, "merged_adapters", None) and hasattr(m, "get_base_layer")}


def _plain_parameter(x: object) -> bool:
    return type(x) in (torch.Tensor, nn.Parameter) and x.device.type == "cpu" and x.dtype == torch.float32


def _packable(module: nn.Module, min_elements: int) -> bool:
    if type(module) is not nn.Linear or "forward" in module.__dict__:
        return False
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    return (weight is not None and weight is module.weight and _plain_parameter(weight) and weight.dim() == 2
            and weight.numel() > max(min_elements, 0)
            and (bias is None if module.bias is None else bias is module.bias and _plain_parameter(bias)))


def _packed_forward(module: nn.Linear, plain, weight: Tensor, bias: Tensor | None):
    source, version = module.weight, module.weight._version

    def forward(x: Tensor) -> Tensor:
        if (type(x) is not torch.Tensor or x.dtype != torch.float32 or x.device.type != "cpu"
                or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling()
                or module.weight is not source or source._version != version
                or torch.is_grad_enabled() and (x.requires_grad or source.requires_grad)):
            return plain(x)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return forward


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int, enabled: bool = True,
                   min_elements: int = PACK_MIN_ELEMENTS) -> Iterator[int]:
    """Within the block, every packable ``nn.Linear`` of ``model`` (module docstring) whose weight has
    more than ``min_elements`` elements multiplies by that weight reordered for products of about
    ``rows`` rows; yields how many layers it packed (0 where ``enabled`` is False or nothing qualifies).
    The packed copies are taken on entry; a layer whose weight changes inside the block falls back to
    the plain product. On exit each layer gets back its own forward (only the one this block set)."""
    if not enabled or not can_pack(model):
        yield 0
        return
    patched = []
    try:
        with torch.no_grad():
            merged = _merged_adapter_bases(model)
            for module in model.modules():
                if id(module) not in merged and _packable(module, min_elements):
                    weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), max(int(rows), 1))
                    # oneDNN reads the bias as contiguous whatever its strides
                    bias = None if module.bias is None else module.bias.detach().contiguous()
                    module.forward = _packed_forward(module, module.forward, weight, bias)
                    patched.append((module, module.forward))
        yield len(patched)
    finally:
        for module, forward in patched:
            if module.__dict__.get("forward") is forward:
                del module.forward
