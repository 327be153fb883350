"""``compute_advantages``: validate once, build an ``AdvantageBatch``, run a registered estimator.

Output contract for every estimator (built-in or registered by a third party): float32 [B,T]
on the input device, exactly 0 where ``mask == 0``; a sequence-level [B] result is broadcast
to the response's valid tokens.
"""
from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor

from creditrl._validate import as_mask, bad_rows, check_finite, check_range, check_tensor
from creditrl.estimators.registry import (AdvantageBatch, EstimatorSpec, get_estimator, list_estimators,
                                          register_estimator)
from creditrl.estimators.steps import StepIndex, returns_to_go
from creditrl.groups import GroupIndex
from creditrl.estimators import baselines, maxk, otb  # noqa: F401,E402  (register the built-ins)

__all__ = ["compute_advantages", "list_estimators", "register_estimator", "AdvantageBatch",
           "build_batch", "returns_to_go"]

# Energies are clamped at 0; anything below -ENERGY_TOLERANCE * eps(dtype) is not rounding.
ENERGY_TOLERANCE = 8.0


def _real(name: str, x: Tensor) -> Tensor:
    if x.is_complex():
        raise TypeError(f"{name}: expected a real (float, int or bool) tensor, got dtype {x.dtype}")
    return x


def _token_tensor(name: str, x: object, mask: Tensor, *, non_negative: bool = False) -> Tensor:
    """A [B,T] float input (energy, is_weights): float32, 0 on masked tokens, finite on valid ones.

    With ``non_negative``, values below -ENERGY_TOLERANCE * eps(dtype) raise (they are not
    rounding) and the rest are clamped at 0. One min/max pass checks the common good case.
    """
    check_tensor(name, x, shape=list(mask.shape), floating=True)
    tolerance = ENERGY_TOLERANCE * torch.finfo(x.dtype).eps
    x = torch.where(mask, x.to(torch.float32), torch.zeros((), device=x.device))
    if x.numel() == 0:
        return x
    low, high = (float(v) for v in torch.aminmax(x))
    if not (math.isfinite(low) and math.isfinite(high)):
        check_finite(name, x)
    if non_negative and low < -tolerance:
        raise ValueError(f"{name}: expected values >= 0, got {low:.3g} in rows {bad_rows(x < -tolerance)}")
    return x.clamp(min=0) if non_negative and low < 0 else x


def _check_device(device: torch.device, **tensors: Tensor | None) -> None:
    for name, x in tensors.items():
        if x is not None and x.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the mask's device), got {x.device}")


def build_batch(*, rewards: Tensor, mask: Tensor, group: Tensor, energy: Tensor | None = None,
                is_weights: Tensor | None = None, gamma: float = 1.0) -> AdvantageBatch:
    """Validate raw inputs and build the ``AdvantageBatch`` every estimator consumes.

    rewards [B] (outcome) or [B,T] (per token; must be 0 on masked tokens); mask [B,T];
    group [B] int ids; energy, is_weights [B,T] floats (is_weights multiply energies by
    rho_bar^2, OTB App. D eq. 58-60). Returns-to-go use ``gamma`` over valid tokens.
    """
    mask = as_mask("mask", mask)
    num, steps_t = mask.shape
    check_tensor("rewards", rewards, ndim=(1, 2))
    _real("rewards", rewards)
    check_tensor("group", group, shape=[num], integer=True)
    _check_device(mask.device, rewards=rewards, group=group, energy=energy, is_weights=is_weights)
    check_range("gamma", gamma, 0.0, 1.0)
    token_level = rewards.dim() == 2
    if token_level:
        check_tensor("rewards", rewards, shape=[num, steps_t])
        check_finite("rewards", torch.where(mask, rewards.to(torch.float32), 0.0))
        stray = (~mask) & (rewards != 0)
        if bool(stray.any()):
            raise ValueError("rewards: token rewards must be 0 where mask == 0, got non-zero values "
                             f"on masked tokens in rows {bad_rows(stray)}")
        steps = StepIndex.from_mask(mask)
        returns = returns_to_go(rewards, steps, float(gamma))
        seq_rewards = rewards.to(torch.float64).sum(1).float()
    else:
        check_tensor("rewards", rewards, shape=[num])
        seq_rewards = rewards.to(torch.float32)
        check_finite("rewards", seq_rewards)
        returns = torch.where(mask, seq_rewards[:, None], 0.0)

    if energy is not None:
        energy = _token_tensor("energy", energy, mask, non_negative=True)
        if is_weights is not None:
            energy = energy * _token_tensor("is_weights", is_weights, mask, non_negative=True).square()
    elif is_weights is not None:
        _token_tensor("is_weights", is_weights, mask, non_negative=True)  # validated; unused without energy
    return AdvantageBatch(rewards=seq_rewards, returns=returns, mask=mask,
                          groups=GroupIndex.from_ids(group), energy=energy, token_level=token_level)


def _check_options(spec: EstimatorSpec, options: dict) -> None:
    declared = spec.options
    if declared is None:
        return
    valid = sorted(declared)
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise ValueError(f"{spec.name}: unknown option(s) {unknown}; valid options are {valid}")
    missing = [k for k, default in declared.items() if default is inspect.Parameter.empty and k not in options]
    if missing:
        raise ValueError(f"{spec.name}: missing required option(s) {missing}; valid options are {valid}")


def compute_advantages(name: str, *, rewards: Tensor, mask: Tensor, group: Tensor,
                       energy: Tensor | None = None, is_weights: Tensor | None = None,
                       **options) -> Tensor:
    """Advantages [B,T] float32 from the estimator ``name`` (see ``list_estimators()``).

    rewards: [B] outcome reward, or [B,T] token rewards (returns-to-go with option ``gamma``,
    default 1; sequence-level estimators use R = sum_t r_t). mask: [B,T] bool/0-1. group: [B]
    int ids (any order, any sizes). energy: [B,T] w_t from ``token_stats`` (needed by ``ogb``,
    ``otb``, ``otb_isolated``); is_weights: [B,T] truncated IS weights rho_bar_t.
    Estimator options (``k``, ``eps``, ``normalize``) are passed as keywords.
    Output: float32 [B,T] on the mask's device, exactly 0 where mask == 0.
    An empty batch (B = 0 or T = 0) gives float32 zeros [B,T].
    """
    spec = get_estimator(name)
    gamma = options.pop("gamma", 1.0)
    _check_options(spec, options)
    if spec.needs_energy and energy is None:
        raise ValueError(f"energy: estimator {name!r} needs per-token energies [B,T] "
                         "(creditrl.token_stats(...).energy), got None")
    batch = build_batch(rewards=rewards, mask=mask, group=group, energy=energy, is_weights=is_weights,
                        gamma=gamma)
    if batch.mask.numel() == 0:                  # B = 0 or T = 0: no token has an advantage
        return torch.zeros(batch.mask.shape, dtype=torch.float32, device=batch.mask.device)
    out = spec.fn(batch, **options)
    if not isinstance(out, Tensor) or tuple(out.shape) not in {tuple(batch.mask.shape[:1]), tuple(batch.mask.shape)}:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"estimator {name!r} returned {got}; expected shape [B] or [B,T] = "
                         f"{list(batch.mask.shape)}")
    out = out.to(device=batch.mask.device, dtype=torch.float32)
    if out.dim() == 1:
        out = out[:, None]
    return torch.where(batch.mask, out, torch.zeros((), device=out.device)).contiguous()
