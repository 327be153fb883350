"""The space a gradient measurement works in (`creditrl diagnose`, in-training diagnosis): which
parameters are differentiated and whether their gradients are kept flat or count-sketched.

Parameters (``prefixes``): None = every trainable parameter of a model with at most
``LARGE_MODEL_PARAMS`` of them; of a larger model the last numbered block and the parameters after
it except the output embedding (e.g. ``model.layers.29.`` and ``model.norm.``): every measured row
costs one backward pass, and a backward stops at the lowest parameter it differentiates, so on a
135M model this is one block's backward instead of the whole model's. ``["all"]`` = every
trainable parameter; other prefixes name a subset.

Flat or sketched: the statistics hold about D·rows·(4K + 12M + 16) bytes (K fold sums in float32,
one prompt's M draws in float32 and float64, their sum); flat when that fits in ``max_memory_gb``,
else a count sketch of dimension ``sketch_dim`` (plus its hash tables, 5 bytes per parameter), else
refused, naming the memory the sketch needs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch

GB = 1 << 30
LARGE_MODEL_PARAMS = 20_000_000
ALL = "all"


def statistics_bytes(dim: int, rows: int, folds: int, groups_per_prompt: int) -> int:
    """Bytes of the gradient statistics over a D = ``dim`` space (module docstring)."""
    return dim * rows * (4 * folds + 12 * groups_per_prompt + 16)


@dataclass(frozen=True)
class GradientSpace:
    """``kind``: all / subset / sketch; ``names``, ``params`` the parameters differentiated; ``dim``
    D of a draw; ``covered`` the parameters the draws see; ``bytes`` the estimated memory; ``why``
    how the parameters were chosen."""
    kind: str
    names: tuple[str, ...]
    params: tuple[torch.Tensor, ...]
    dim: int
    covered: int
    bytes: int
    why: str = ""

    def describe(self) -> str:
        size = f"{self.bytes / GB:.2f} GB"
        shown = f"{list(self.names)[:4]}{'...' if len(self.names) > 4 else ''}"
        if self.kind == "all":
            text = f"all {self.covered:,} trainable parameters, flat ({size})"
        elif self.kind == "subset":
            text = f"the parameters {shown} ({self.covered:,} parameters, flat; {size})"
        else:
            text = f"a count sketch of dimension {self.dim:,} of the {self.covered:,} parameters {shown} ({size})"
        return text + (f"; {self.why}" if self.why else "")


def last_block(named: list[tuple[str, torch.Tensor]], output=None) -> list[str]:
    """The names of the last numbered block's parameters and of those after it (the final norm),
    the output embedding ``output`` excepted (its gradient path runs through the whole model when it
    is tied to the input embedding)."""
    numbered = [i for i, (n, _) in enumerate(named) if re.search(r"\.\d+\.", n)]
    if not numbered:
        return [n for n, _ in named]
    block = _block_prefix(named[numbered[-1]][0])
    keep = [n for i, (n, p) in enumerate(named) if n.startswith(block) or i > numbered[-1]]
    return [n for n in keep if output is None or dict(named)[n] is not output] or [n for n, _ in named]


def _block_prefix(name: str) -> str:
    """``model.layers.29.mlp.up.weight`` -> ``model.layers.29.`` (up to the last ``.<int>.``)."""
    match = list(re.finditer(r"\.\d+\.", name))[-1]
    return name[:match.end()]


def parameter_set(model, prefixes: Sequence[str] | None, key: str) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """(name, parameter) pairs to differentiate (module docstring) and why they were chosen."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model: expected trainable parameters (requires_grad), got none")
    total = sum(p.numel() for _, p in named)
    if prefixes is not None and list(prefixes) != [ALL]:
        subset = [(n, p) for n, p in named if any(n.startswith(x) for x in prefixes)]
        if not subset:
            raise ValueError(f"{key}: expected prefixes of trainable parameter names (e.g. "
                             f"{[n for n, _ in named[-3:]]}) or [{ALL}], got {list(prefixes)}")
        return subset, f"{key}={list(prefixes)}"
    if prefixes is not None or total <= LARGE_MODEL_PARAMS:
        return named, ""
    out = getattr(model, "get_output_embeddings", lambda: None)()
    chosen = set(last_block(named, None if out is None else out.weight))
    subset = [(n, p) for n, p in named if n in chosen]
    return subset, (f"the last block of a {total / 1e6:.0f}M-parameter model (one backward per row through it, not "
                    f"the whole model; {key}=[{ALL}] for every parameter)")


def choose_space(model, prefixes: Sequence[str] | None, rows: int, folds: int, groups_per_prompt: int,
                 max_memory_gb: float, sketch_dim: int, key: str = "diagnose.params",
                 memory_key: str = "diagnose.max_memory_gb") -> GradientSpace:
    """The parameters (``parameter_set``), flat when their statistics fit, else sketched (module docstring)."""
    chosen, why = parameter_set(model, prefixes, key)
    every = sum(p.numel() for p in model.parameters() if p.requires_grad)
    size = sum(p.numel() for _, p in chosen)
    need = statistics_bytes(size, rows, folds, groups_per_prompt)
    names, params = tuple(n for n, _ in chosen), tuple(p for _, p in chosen)
    if need <= max_memory_gb * GB:
        return GradientSpace("all" if size == every else "subset", names, params, size, size, need, why)
    sketch = statistics_bytes(sketch_dim, rows, folds, groups_per_prompt) + 5 * size
    if sketch > max_memory_gb * GB:
        raise ValueError(f"{memory_key}: expected at least {sketch / GB:.2f} GB (a count sketch of dimension "
                         f"{sketch_dim} of {size:,} parameters under {rows} measured rows needs that; flat they "
                         f"need {need / GB:.2f} GB), got {max_memory_gb}")
    return GradientSpace("sketch", names, params, sketch_dim, size, sketch, why)
