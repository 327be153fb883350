"""Input checks shared by every public function.

Each check raises with the argument's name, what was expected and what was given, so a
user never has to read a stack trace to find the bad input.
"""
from __future__ import annotations

import math
import numbers

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from creditrl.utils.blocks import row_blocks
from creditrl.utils.fused import fused

MAX_ROWS_REPORTED = 10

# Log-probabilities above 0 by more than this are refused. A log-softmax evaluated in one pass,
# z_y - m - log Σ exp(z - m), is <= 0 exactly (creditrl's token_stats, torch.log_softmax); pipelines
# that take z_y and log Σ exp(z) from different kernels or precisions (a sampler's logprobs, a fused
# cross-entropy) land a few float32 ulps of |log Σ exp z| above 0: ~2e-5 at |log Σ exp z| = 100. Logits
# passed by mistake as log-probs are O(1) and above 0 for many tokens, far beyond 1e-3.
LOGP_TOLERANCE = 1e-3
# Energies ŵ = 1 − 2π_y + Σπ² round to just below 0 as π_y → 1; below -ENERGY_TOLERANCE * eps(dtype) is not rounding.
ENERGY_TOLERANCE = 8.0


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


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_positive_float32(name: str, value: float) -> None:
    """``check_range(name, value, 0, FLOAT32_MAX, low exclusive)``: a positive number that stays
    finite in float32 (1e300 passes a finite check in Python, yet is inf once it meets a float32
    tensor, and an advantage divided by it is 0 in float32)."""
    check_range(name, value, 0.0, FLOAT32_MAX, low_inclusive=False)


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
    """Check a mask (bool, or numeric holding only 0/1): [B,T], or ``shape`` when given (e.g. [B]); return bool."""
    mask = check_mask(name, mask, shape)
    return mask if mask.dtype == torch.bool else mask != 0


def _raise_not_0_1(name: str, mask: Tensor) -> None:
    """The one error of the mask rule, naming the rows that break it."""
    outside = (mask != 0) & (mask != 1)
    raise ValueError(f"{name}: expected a bool or 0/1 mask, got values outside {{0, 1}} "
                     f"(dtype {mask.dtype}) in rows {bad_rows(outside)}")


ONE_FLOAT32_BITS = 0x3F800000       # the bit pattern of 1.0f
INF_FLOAT32_BITS = 0x7F800000       # the bit pattern of +inf


def float32_bits(x: Tensor) -> Tensor:
    """The int32 view of a float32 tensor (no copy). Non-negative floats order like their bit
    patterns, so one integer ``aminmax`` over it (twice as fast as the float one, which must
    propagate NaN) bounds the values: ``0 <= low`` and ``high < INF_FLOAT32_BITS`` mean every value
    is finite and >= +0.0 (-0.0, negatives and NaNs of either sign fall outside)."""
    return x.view(torch.int32)


class FusedChecks:
    """Several checks' statistics, reduced where the tensors live and read back in one transfer.

    ``add(stats, verdict)`` queues a check: ``stats`` a tensor of a few statistics (reductions,
    computed now, not read), ``verdict(values)`` their values as Python floats, called in the
    order added once all are read; it raises on a failure (after an exact, slower pass that
    names the rows, where needed) and may return anything. ``run()`` does the one host read
    (one device sync on a GPU, however many checks) and returns the verdicts' results.
    """

    def __init__(self):
        self._pending: list[tuple[Tensor, Callable[[list[float]], Any]]] = []

    def add(self, stats: Tensor, verdict: Callable[[list[float]], Any]) -> int:
        """Queue a check; returns its index in ``run()``'s results."""
        self._pending.append((stats.reshape(-1), verdict))
        return len(self._pending) - 1

    def run(self) -> list[Any]:
        if not self._pending:
            return []
        values = torch.cat([stats.to(torch.float64) for stats, _ in self._pending]).tolist()
        results, start = [], 0
        for stats, verdict in self._pending:
            results.append(verdict(values[start:start + stats.numel()]))
            start += stats.numel()
        self._pending = []
        return results


def _bit_view(x: Tensor) -> Tensor:
    """The same-width integer view of a floating tensor (no copy)."""
    return x.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])


MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
               torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_mask_dtype(name: str, mask: Tensor) -> None:
    """A TypeError unless ``mask``'s dtype is one the mask rule reads (``MASK_DTYPES``: not complex,
    float8 or the 16- to 64-bit unsigned integers, which torch's reductions do not all support)."""
    if mask.dtype not in MASK_DTYPES:
        raise TypeError(f"{name}: expected a bool or 0/1 mask of dtype bool, an integer of at most 64 bits "
                        f"(unsigned: uint8 only) or float16/bfloat16/float32/float64, got dtype {mask.dtype}")


def mask_stats(mask: Tensor) -> Tensor | None:
    """The statistics of the 0/1 rule for a numeric mask, float64 [2] (None for bool or empty:
    nothing to check), reduced on the mask's device and not read.

    Integers: min, max. Floats: min and max of the bit patterns of f = m - m*m (``addcmul``;
    16-bit floats are computed in float32 and rounded once), which is +0.0 exactly where m is +0.0
    or 1 and nonzero or NaN for every other value: positive on (0, 1) (it is m itself for the
    smallest subnormals, >= m/2 below 1/2, and at least half an ulp of m above it, so it never
    rounds to 0), negative below 0 and above 1, NaN for NaN and +inf, and -0.0 for m = -0.0 (a
    legal 0, accepted by ``mask_verdict``'s exact pass). Both are 0 iff every value is +0.0 or 1:
    exact, with no tolerance (under ``torch.set_flush_denormal(True)`` a subnormal reads as 0, and
    counts as 0 everywhere downstream too). Over blocks of rows (``row_blocks``), so f stays in
    cache on a CPU."""
    if mask.dtype == torch.bool or mask.numel() == 0:
        return None
    if not mask.is_floating_point():
        return torch.stack(torch.aminmax(mask)).to(torch.float64)
    mask = (mask.reshape(1) if mask.dim() == 0 else mask).detach()
    blocks = row_blocks(mask)
    # one block-sized buffer for f and a row of stats per block, written in place: each op
    # costs microseconds of overhead, a fresh tensor per block more than its arithmetic
    buffer = torch.empty(mask[blocks[0]].shape, dtype=mask.dtype, device=mask.device)
    stats = torch.empty(len(blocks), 2, dtype=_bit_view(buffer).dtype, device=mask.device)
    for i, rows in enumerate(blocks):
        x = mask[rows]
        f = torch.addcmul(x, x, x, value=-1, out=buffer[: x.shape[0]])
        torch.aminmax(_bit_view(f), out=(stats[i, 0], stats[i, 1]))
    return torch.stack([stats[:, 0].min(), stats[:, 1].max()]).to(torch.float64)


def mask_rule(mask: Tensor) -> Tensor:
    """The 0/1 rule of a float mask [N] or [B,T] as fused passes compute it, [1]: max |m - m*m|, 0 iff
    every m is +-0.0 or 1 (``mask_verdict`` reads it)."""
    # each row's max first: inductor vectorises a reduction along the contiguous axis, and the [B]
    # partials cost nothing; one whole-tensor reduction fused with the product ran 1.5x slower. The
    # floats, not their bits (inductor casts bits element by element): abs and amax propagate NaN,
    # so a 0 means every f is +-0.0
    return (mask - mask * mask).abs().amax(-1).amax().reshape(1)


def _times_mask_with_rule(per_row: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return per_row[:, None] * mask, mask_rule(mask)


def _row_sums_with_rule(mask: Tensor) -> tuple[Tensor, Tensor]:
    return mask.sum(1), mask_rule(mask)


_times_mask_with_rule_fused = fused(_times_mask_with_rule,
                                    eager=lambda per_row, mask: (per_row[:, None] * mask, mask_stats(mask)))
_row_sums_with_rule_fused = fused(_row_sums_with_rule, eager=lambda mask: (mask.sum(1), mask_stats(mask)))


def _non_negative_range_and_rule(values: Tensor, mask: Tensor) -> Tensor:
    # per-row reductions first, as ``mask_rule``: three whole-tensor reductions of the flat tensors ran 1.4x slower
    return torch.stack([values.amin(1).amin(), values.amax(1).amax(), mask_rule(mask)[0]])


_non_negative_range_and_rule_fused = fused(_non_negative_range_and_rule, eager=lambda values, mask: torch.cat(
    [torch.stack(torch.aminmax(values)), mask_rule(mask)]))


def non_negative_range_and_rule(values: Tensor, mask: Tensor) -> Tensor:
    """float32 ``values`` [B,T] and a float32 ``mask`` [B,T] -> [3]: values' min and max (NaN where one
    is NaN: every value finite and >= 0 iff min >= 0 and max < inf) and the mask's 0/1 rule
    (``times_mask_with_rule``'s: 0 iff every m is +-0.0 or 1), from one read of both, compiled
    where compiling works (2-D, contiguous, as ``times_mask_with_rule``). An energy's check and the
    mask's in one pass: on the 2-core dev CPU at B = 1,024, T = 4,096, 2.2 ms, where the two alone
    take 1.0 ms (an integer min/max) and 2.8 ms (``mask_stats``). Not read back."""
    return _non_negative_range_and_rule_fused(values.detach().contiguous(), mask.detach().contiguous())


def times_mask_with_rule(per_row: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """per_row [B] float32 times a float32 mask [B,T] -> (the product [B,T] float32, the mask's 0/1
    statistics for ``mask_verdict``: all 0 where every value is 0 or 1).

    The product and ``mask_stats``' rule from one read of the mask, compiled where compiling works
    (2-D, contiguous, dynamic sizes: one graph, one more where B or T is 1; an odd layout is copied). Compiled, the statistics are
    [max |f|] of f = m - m*m (0 only where every m is +-0.0 or 1; NaN for NaN and inf, which fails
    the verdict's == 0); eager, ``mask_stats``' two bit patterns. Where the mask is a product's only
    [B,T] input this makes its check nearly free: on the 2-core dev CPU at B = 1,024, T = 4,096,
    0.45 ms over the product alone, where the rule alone takes 1.9 ms. Not read back."""
    return _times_mask_with_rule_fused(per_row.detach().contiguous(), mask.detach().contiguous())


def row_sums_with_rule(mask: Tensor) -> tuple[Tensor, Tensor]:
    """A float32 mask [B,T] -> (its row sums [B] float32, exact for rows under 2^24 tokens, and its
    0/1 statistics for ``mask_verdict``), from one read of the mask, as ``times_mask_with_rule``."""
    return _row_sums_with_rule_fused(mask.detach().contiguous())


def float_mask(mask: Tensor) -> Tensor:
    """A 0/1 mask (bool, or checked numbers) as float32 0/1. A bool goes through its uint8 view,
    clamped at 1 (a bool tensor made by viewing other bytes may hold 2..255, which ``bool``
    operations read as True): 2.6x faster on a CPU than converting the bool itself."""
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8).clamp(max=1).to(torch.float32)
    return mask.to(torch.float32)


# int64 words summed per byte lane: a lane's sum of up to 255 bytes of 0/1 cannot carry into the next
WORDS_PER_LANE_SUM = 128


def bool_row_counts(mask: Tensor) -> Tensor:
    """True values per row of a bool mask [B,T] whose bytes are 0 or 1 (every bool torch's own ops
    make: ``.bool()``, comparisons, ``&``; not one viewed from other bytes), [B] int64.

    SWAR: each row's bytes are read as int64 words and summed in chunks of ``WORDS_PER_LANE_SUM``
    words, so each byte lane holds the count of its byte position (<= 128, no carry); the lanes'
    bytes then sum to the count, into int32 (41 us for those [B, T/128] bytes where the default int64
    sum took 64). One integer pass over the B·T bytes: at B = 1,024, T = 4,096 on the 2-core dev CPU
    0.10 ms, where the float32 copy's row sums take 0.24 (and a bool or uint8 sum 1.2-1.4). Rows that
    are not whole words (T % 8, odd strides or offsets) sum a float32 copy."""
    rows, steps = mask.shape
    if steps % 8 or mask.stride(1) != 1 or mask.stride(0) != steps or mask.storage_offset() % 8:
        return float_mask(mask).sum(1).long()
    words = mask.view(torch.int64)                                   # [B, T/8]
    chunks, rest = divmod(words.shape[1], WORDS_PER_LANE_SUM)
    if not chunks and not rest:                                      # T = 0
        return torch.zeros(rows, dtype=torch.int64, device=mask.device)
    # [B, chunks (+ 1 for the rest)] words of 8 byte lanes each; each op costs microseconds at small sizes
    parts = [words[:, :chunks * WORDS_PER_LANE_SUM].reshape(rows, chunks, WORDS_PER_LANE_SUM).sum(-1)] if chunks else []
    if rest:
        parts.append(words[:, chunks * WORDS_PER_LANE_SUM:].sum(-1, keepdim=True))
    lanes = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return lanes.view(torch.uint8).sum(-1, dtype=torch.int32).long()


def integer_mask_copy(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """An integer mask's float32 copy (what estimators multiply by) and the statistics of its 0/1
    rule, [2] or None when empty: min and max of the copy's bit patterns, one integer pass. An
    integer converts to 0.0 or 1.0 only from 0 or 1 and to a value outside [0, 1] otherwise, so the
    copy lies in [+0.0, 1.0] iff the mask is 0/1 (``integer_mask_verdict``)."""
    copy = mask.to(torch.float32)
    return copy, torch.stack(torch.aminmax(float32_bits(copy))) if copy.numel() else None


def integer_mask_verdict(name: str, mask: Tensor, values: list[float]) -> None:
    """Raise unless ``values`` (``integer_mask_copy``'s statistics of ``mask``) show a 0/1 mask."""
    if not (values[0] >= 0 and values[1] <= ONE_FLOAT32_BITS):
        _raise_not_0_1(name, mask)


def mask_verdict(name: str, mask: Tensor, values: list[float]) -> None:
    """Raise unless ``values`` (``mask_stats`` or ``times_mask_with_rule`` of ``mask``) show a 0/1
    mask. Where the float test fails, an exact pass decides (it accepts -0.0, the one legal value
    the bit test rejects)."""
    if not mask.is_floating_point():
        if not (values[0] >= 0 and values[1] <= 1):
            _raise_not_0_1(name, mask)
        return
    if all(value == 0 for value in values):
        return
    if bool(((mask != 0) & (mask != 1)).any()):
        _raise_not_0_1(name, mask)


def check_mask(name: str, mask: object, shape: Sequence[int] | None = None) -> Tensor:
    """The one mask rule (bool, or numeric holding only 0/1) from one read pass reduced on the
    mask's device (a float mask's with one block-sized temporary) and one host read; returns
    ``mask`` itself.

    Bool masks: nothing to check. Integer masks: one min/max pass. Float masks: one pass over
    m - m*m (``mask_stats``), exact: 0.99999994 is not 1.
    """
    mask = check_tensor(name, mask, ndim=2) if shape is None else check_tensor(name, mask, shape=list(shape))
    check_mask_dtype(name, mask)
    stats = mask_stats(mask)
    if stats is not None:
        mask_verdict(name, mask, stats.tolist())
    return mask


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
