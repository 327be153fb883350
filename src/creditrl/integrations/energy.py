"""Per-token energy from a framework's actor statistics, with their range check, in one fused pass.

Frameworks give log pi(y_t) and sum_v pi_t(v)^2 per token (verl's ``old_log_probs`` and
``sum_pi_squared``; TRL's through creditrl's hook). The energy (OTB eq. 7) is a pointwise function
of both, and the check that they are what their names say (log-probs <= 0, a sum of squared
probabilities in (0, 1]) is a reduction over the same values: ``torch.compile`` turns both into one
loop that reads each input once (``creditrl.utils.fused``; where compiling fails, in-place eager
twins give the same results up to the exp's last bit, several passes slower).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from creditrl.utils.fused import flat, fused
from creditrl.utils.validate import LOGP_TOLERANCE, mask_rule

# what each statistic must be on the response tokens (float32 bounds, as the check compares float32 values)
EXPECTED = {"old_log_probs": "<= 0 (log-probabilities)",
            "sum_pi_squared": "in (0, 1] (a sum of squared probabilities)"}
LOGP_HIGH = float(torch.tensor(LOGP_TOLERANCE, dtype=torch.float32))
SUM_P2_HIGH = float(torch.tensor(1.0 + LOGP_TOLERANCE, dtype=torch.float32))


def _energy(logp: Tensor, sum_p2: Tensor) -> Tensor:
    """w_t = ||e_y - pi_t||^2 = 1 - 2 pi_t(y_t) + sum_v pi_t(v)^2 (OTB eq. 7) [N], clamped >= 0
    (it is (1 - pi)^2 + sum_{v != y} pi^2 >= 0 in exact arithmetic; rounding may dip below)."""
    return torch.clamp(sum_p2 - 2.0 * torch.exp(logp) + 1.0, min=0.0)


def _energy_in_place(logp: Tensor, sum_p2: Tensor) -> Tensor:
    """``_energy`` eagerly, in place on exp's output (one [N] allocation; the same roundings)."""
    return torch.exp(logp).mul_(-2.0).add_(sum_p2).add_(1.0).clamp_(min=0.0)


def _energy_and_ranges(logp: Tensor, sum_p2: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """The energy [N], 0 where ``valid`` == 0 (whatever the values there), and [3] = [max logp,
    min sum_p2, max sum_p2] over the tokens where ``valid`` != 0, others read as logp 0 and sum_p2 1,
    inside both ranges (NaN where a valid value is NaN). The same rule, token by token, is
    ``check_actor_stat_range``'s: once it passes, every energy is finite and >= 0."""
    on = valid != 0
    # three reductions over three where()s: inductor fuses them into the energy's loop, while one
    # shared where() feeding amin and amax compiled 1.5x slower
    return torch.where(on, _energy(logp, sum_p2), 0.0), torch.stack([
        torch.where(on, logp, 0.0).amax(), torch.where(on, sum_p2, 1.0).amin(), torch.where(on, sum_p2, 1.0).amax()])


def _energy_and_ranges_in_place(logp: Tensor, sum_p2: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """``_energy_and_ranges`` eagerly: one [N] buffer for both masked reads, one pass for min and max."""
    on = valid != 0
    held = torch.where(on, sum_p2, 1.0)
    low, high = torch.aminmax(held)
    top = torch.where(on, logp, held.new_zeros(()), out=held).amax()
    return _energy_in_place(logp, sum_p2).masked_fill_(~on, 0.0), torch.stack([top, low, high])


def _energy_ranges_and_rule(logp: Tensor, sum_p2: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``_energy_and_ranges`` with ``valid`` = ``mask``, a float32 mask not yet checked, and its 0/1
    rule as a fourth statistic, max |m - m*m| (0 iff every m is +-0.0 or 1; ``mask_verdict``)."""
    energy, ranges = _energy_and_ranges(logp, sum_p2, mask)
    return energy, torch.cat([ranges, mask_rule(mask)])


def _energy_ranges_and_rule_in_place(logp: Tensor, sum_p2: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    energy, ranges = _energy_and_ranges_in_place(logp, sum_p2, mask)
    return energy, torch.cat([ranges, torch.addcmul(mask, mask, mask, value=-1).abs_().amax().reshape(1)])


_energy_fused = fused(_energy, eager=_energy_in_place)
_energy_and_ranges_fused = fused(_energy_and_ranges, eager=_energy_and_ranges_in_place)
_energy_ranges_and_rule_fused = fused(_energy_ranges_and_rule, eager=_energy_ranges_and_rule_in_place)


def _check_shapes(logp: Tensor, sum_p2: Tensor) -> None:
    for name, x in (("logp", logp), ("sum_p2", sum_p2)):
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got "
                             f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    if sum_p2.shape != logp.shape:
        raise ValueError(f"sum_p2: expected logp's shape {list(logp.shape)}, got {list(sum_p2.shape)}")


def energy_from_logp(logp: Tensor, sum_p2: Tensor) -> Tensor:
    """Per-token energy w_t = 1 - 2 pi_t(y_t) + sum_v pi_t(v)^2 (OTB eq. 7) [B,T] float32, clamped
    >= 0 like ``creditrl.token_stats``, from log pi(y_t) [B,T] and sum_v pi_t(v)^2 [B,T]."""
    _check_shapes(logp, sum_p2)
    if logp.numel() == 0:
        return torch.zeros(logp.shape, dtype=torch.float32, device=logp.device)
    return _energy_fused(flat(logp, torch.float32), flat(sum_p2, torch.float32)).view(logp.shape)


def checked_energy_from_logp(logp: Tensor, sum_p2: Tensor, valid: Tensor,
                             mask_rule: Callable[[Tensor], None] | None = None) -> Tensor:
    """``energy_from_logp``, after checking on the tokens where ``valid`` [B,T] != 0 that ``logp`` <= 0
    and ``sum_p2`` in (0, 1], each within ``LOGP_TOLERANCE`` and as float32 values (the energy's
    precision); raises ValueError naming the argument (as verl names it) otherwise (e.g.
    probabilities passed as log-probs would give wrong energies silently). The range comes from the
    energy's own pass: one host read, no extra pass. ``mask_rule``: ``valid`` is a float32 mask not
    yet checked; the same pass computes its 0/1 statistics, handed to ``mask_rule`` (which raises on
    a bad mask) before the ranges are read (``AdvantageBatch.accept_mask_stats``).

    The energies it returns are 0 where ``valid`` == 0, so all of them are finite and >= 0
    (``with_energy(..., checked=True)`` need not test them again)."""
    _check_shapes(logp, sum_p2)
    if valid.shape != logp.shape:
        raise ValueError(f"valid: expected logp's shape {list(logp.shape)}, got {list(valid.shape)}")
    if logp.numel() == 0:
        if mask_rule is not None:
            mask_rule(torch.zeros(1))
        return energy_from_logp(logp, sum_p2)
    inputs = flat(logp, torch.float32), flat(sum_p2, torch.float32), flat(valid)
    if mask_rule is None:
        energy, ranges = _energy_and_ranges_fused(*inputs)
    else:
        energy, ranges = _energy_ranges_and_rule_fused(*inputs)
        mask_rule(ranges[3:])
    logp_max, p2_min, p2_max = ranges[:3].tolist()
    # comparisons false for NaN: a NaN on a valid token fails
    if not logp_max <= LOGP_HIGH:
        check_actor_stat_range("old_log_probs", logp, valid)
    if not (p2_min > 0.0 and p2_max <= SUM_P2_HIGH):
        check_actor_stat_range("sum_pi_squared", sum_p2, valid)
    return energy.view(logp.shape)


def check_actor_stat_range(name: str, x: Tensor, valid: Tensor) -> None:
    """``x``'s range test (``EXPECTED[name]``, on float32 values) token by token on the valid tokens,
    with the caller's values as examples in the error (the slow path: to word the error once the fused
    test has failed, or for a lone tensor). The fused rule is ``_energy_and_ranges``."""
    held, on = x.detach().to(torch.float32), valid.detach() != 0
    inside = (held <= LOGP_HIGH) if name == "old_log_probs" else (held > 0.0) & (held <= SUM_P2_HIGH)
    bad = on & ~inside
    if bool(bad.any()):
        raise ValueError(f"{name}: expected values {EXPECTED[name]} on the response tokens, got "
                         f"{int(bad.sum())} outside, e.g. {x.detach()[bad][:4].tolist()}")
