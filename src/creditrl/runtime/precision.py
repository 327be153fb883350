"""``train.precision`` resolved once: what runs under autocast and in which dtype, what is stored in
bf16, and whether the loss is scaled. Trainable weights always stay float32 (unless ``model.dtype``
asks otherwise); only the forward/backward compute and frozen copies go low-precision."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """``name``: ``fp32`` (no autocast), ``bf16`` (bf16 autocast; CPUs with bf16 units and GPUs) or
    ``fp16`` (fp16 autocast with loss scaling; CUDA only)."""
    name: str = "fp32"

    def __post_init__(self):
        if self.name not in ("fp32", *AUTOCAST_DTYPES):
            raise ValueError(f"train.precision: expected one of ['fp32', 'bf16', 'fp16'], got {self.name!r}")

    def check_device(self, device: torch.device) -> None:
        if self.name == "fp16" and torch.device(device).type != "cuda":
            raise ValueError("train.precision: fp16 needs CUDA (its loss scaling); on a CPU use bf16 (same speed-up "
                             "where the CPU has bf16 units, no overflow) or fp32")

    @property
    def low(self) -> bool:
        """Whether compute runs in a 16-bit dtype."""
        return self.name != "fp32"

    @property
    def frozen_dtype(self) -> torch.dtype | None:
        """The dtype of frozen weights (a LoRA base, the KL reference copy): bf16 under autocast,
        which computes in 16 bits anyway; None (keep the model's) for fp32."""
        return torch.bfloat16 if self.low else None

    @property
    def scales_loss(self) -> bool:
        return self.name == "fp16"

    @contextmanager
    def autocast(self, model):
        """Autocast on the model's device for bf16/fp16; nothing for fp32."""
        if not self.low:
            yield
            return
        with torch.autocast(next(model.parameters()).device.type, dtype=AUTOCAST_DTYPES[self.name]):
            yield
