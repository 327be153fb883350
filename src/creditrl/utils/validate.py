"""Input checks shared by every public function.

Each check raises with the argument's name, what was expected and what was given, so a
user never has to read a stack trace to find the bad input.
"""
from __future__ import annotations

import math
import numbers

from typing import Iterable, Sequence

import torch
from torch import Tensor

MAX_ROWS_REPORTED = 10

# Log-probabilities above 0 by more than this are refused. A log-softmax evaluated in one pass,
# z_y - m - log Σ exp(z - m), is <= 0 exactly (creditrl's token_stats, torch.log_softmax); pipelines
# that take z_y and log Σ exp(z) from different kernels or precisions (a sampler's logprobs, a fused
# cross-entropy) land a few float32 ulps of |log Σ exp z| above 0: ~2e-5 at |log Σ exp z| = 100. Logits
# passed by mistake as log-probs are O(1) and above 0 for many tokens, far beyond 1e-3.
LOGP_TOLERANCE = 1e-3


def check_tensor(name: str, x: object, *, ndim: int | Sequence[int] | None = None,
                 shape: Sequence[int | None] | None = None, floating: bool | None = None,
                 integer: bool | None = None) -> Tensor:
    """Check that ``x`` is a tensor of the given rank/shape/dtype kind; return it."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.is_meta:
        raise ValueError(f"{name}: expected a tensor with values (on the CPU or a GPU), got a tensor on the 'meta' "
                         f"device (shape {list(x.shape)} only, no data to compute with)")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(x.shape)}")
    if shape is not None:
        if x.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, x.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if integer and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise TypeError(f"{name}: expected an integer tensor, got dtype {x.dtype}")
    return x


def bad_rows(bad: Tensor) -> list[int]:
    """Row indices (dim 0) where ``bad`` has any True, at most MAX_ROWS_REPORTED of them."""
    rows = bad.reshape(bad.shape[0], -1).any(dim=1) if bad.dim() > 1 else bad
    return torch.nonzero(rows).flatten()[:MAX_ROWS_REPORTED].tolist()


class NonFiniteError(ValueError):
    """A tensor holds NaN/inf where finite values are required (or a result overflowed). A
    trainer can catch it to skip the step instead of stopping."""


def check_finite(name: str, x: Tensor) -> None:
    """Raise NonFiniteError (a ValueError) naming up to 10 rows that hold NaN or inf."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        n = int(bad.reshape(bad.shape[0], -1).any(dim=1).sum()) if x.dim() > 0 else 1
        raise NonFiniteError(f"{name}: {n} row(s) contain NaN or inf, e.g. rows {bad_rows(bad)}")


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name}: unknown value {value!r}; valid values are {choices}")


def check_range(name: str, value: float, low: float | None = None, high: float | None = None, *,
                low_inclusive: bool = True, high_inclusive: bool = True) -> None:
    """Check that ``value`` is a finite real number (bool excluded; a one-element tensor counts)
    with ``low <(=) value <(=) high``; the message names the argument, the interval and the value."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    ok = True
    if low is not None:
        ok &= value >= low if low_inclusive else value > low
    if high is not None:
        ok &= value <= high if high_inclusive else value < high
    if not ok:
        lo = ("[" if low_inclusive else "(") + ("-inf" if low is None else f"{low:g}")
        hi = ("inf" if high is None else f"{high:g}") + ("]" if high_inclusive else ")")
        raise ValueError(f"{name}: expected a value in {lo}, {hi}, got {value!r}")


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """Check that ``value`` is a Python int (bool excluded) in [low, high]; return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    check_range(name, value, low, high)
    return value


def check_same_shape(a_name: str, a: Tensor, b_name: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{b_name}: expected the shape of {a_name} {list(a.shape)}, got {list(b.shape)}")


def as_mask(name: str, mask: object, shape: Sequence[int] | None = None) -> Tensor:
    """Check a [B,T] mask (bool, or numeric holding only 0/1), against ``shape`` when given; return bool."""
    mask = check_tensor(name, mask, ndim=2) if shape is None else check_tensor(name, mask, shape=list(shape))
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name}: expected a bool or 0/1 mask, got dtype {mask.dtype}")
    if bool(((mask != 0) & (mask != 1)).any()):
        _raise_not_0_1(name, mask)
    return mask != 0


def _raise_not_0_1(name: str, mask: Tensor) -> None:
    """The one error of the mask rule, naming the rows that break it."""
    outside = (mask != 0) & (mask != 1)
    raise ValueError(f"{name}: expected a bool or 0/1 mask, got values outside {{0, 1}} "
                     f"(dtype {mask.dtype}) in rows {bad_rows(outside)}")


ONE_FLOAT32_BITS = 0x3F800000  # the bit pattern of 1.0f


def _check_ones(name: str, mask: Tensor, nonzero: int) -> Tensor:
    """``mask`` (float, values known to lie in [0, 1]) holds only 0 and 1: its sum equals its
    number of nonzeros (row sums of 0/1 values are exact integers, totalled in float64)."""
    if float(mask.sum(1, dtype=torch.float32).double().sum()) != nonzero:
        _raise_not_0_1(name, mask)
    return mask


def check_mask(name: str, mask: object, shape: Sequence[int] | None = None) -> Tensor:
    """The one mask rule (bool, or numeric holding only 0/1) checked in a few cheap read passes,
    without a copy; returns ``mask`` itself.

    Bool masks: nothing to check. Integer masks: one min/max pass. Float masks: min/max in
    [0, 1] and sum == number of nonzeros (inside [0, 1] equality means every nonzero is 1; row
    sums are exact integers, totalled in float64). A value within float32 rounding of 1
    (0.99999994) is not told apart from 1 by these sums and counts as 1.
    """
    mask = check_tensor(name, mask, ndim=2) if shape is None else check_tensor(name, mask, shape=list(shape))
    if mask.is_complex():
        raise TypeError(f"{name}: expected a bool or 0/1 mask, got dtype {mask.dtype}")
    if mask.dtype == torch.bool or mask.numel() == 0:
        return mask
    if mask.dtype == torch.float32:
        # Non-negative float32 values order like their int32 bit patterns: one integer min/max
        # pass puts every value in [+0, 1] (no -0.0, NaN or negatives), and integer nonzero
        # counting is twice as fast as float's. Anything else takes the float path below.
        bits = mask.view(torch.int32)
        low, high = (int(v) for v in torch.aminmax(bits))
        if low >= 0 and high <= ONE_FLOAT32_BITS:
            return _check_ones(name, mask, int(torch.count_nonzero(bits)))
    low, high = (float(v) for v in torch.aminmax(mask))
    if not (low >= 0 and high <= 1):
        _raise_not_0_1(name, mask)
    return _check_ones(name, mask, int(torch.count_nonzero(mask))) if mask.is_floating_point() else mask


def token_advantages(advantages: Tensor, like: Tensor, like_name: str = "logp") -> Tensor:
    """Broadcast advantages [B] or [B,T] to the [B,T] shape of ``like`` (validated)."""
    advantages = check_tensor("advantages", advantages, ndim=(1, 2), floating=True)
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(f"advantages: expected shape [{like.shape[0]}] or {list(like.shape)}, "
                             f"got {list(advantages.shape)}")
        return advantages[:, None].expand_as(like)
    check_same_shape(like_name, like, "advantages", advantages)
    return advantages
