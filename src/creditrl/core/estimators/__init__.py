"""``compute_advantages``: validate once, build an ``AdvantageBatch``, run a registered estimator.

Output contract for every estimator (built-in or registered by a third party): float32 [B,T]
on the input device, exactly 0 where ``mask == 0``; a sequence-level [B] result is broadcast
to the response's valid tokens.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from creditrl.utils.imports import PluginError, is_builtin, plugin_name
from creditrl.utils.validate import bad_rows, check_finite, check_mask, check_range, check_tensor
from creditrl.core.estimators.registry import (AdvantageBatch, EstimatorSpec, KRange, get_estimator, list_estimators,
                                               register_estimator)
from creditrl.core.estimators.steps import returns_to_go
from creditrl.core.groups import GroupIndex

__all__ = ["compute_advantages", "list_estimators", "register_estimator", "AdvantageBatch", "EstimatorSpec", "KRange",
           "build_batch", "prepare", "estimate", "returns_to_go", "check_group_size"]

# Energies are clamped at 0; anything below -ENERGY_TOLERANCE * eps(dtype) is not rounding.
ENERGY_TOLERANCE = 8.0


def _real(name: str, x: Tensor) -> Tensor:
    if x.is_complex():
        raise TypeError(f"{name}: expected a real (float, int or bool) tensor, got dtype {x.dtype}")
    return x


def _token_tensor(name: str, x: object, mask: Tensor) -> Tensor:
    """A [B,T] non-negative float input (energy, is_weights) as float32, finite and >= 0 on valid
    tokens (masked tokens keep whatever finite value >= 0 they held; estimators mask them).

    Values below -ENERGY_TOLERANCE * eps(dtype) on valid tokens raise (they are not rounding)
    and the rest are clamped at 0. One min/max pass over the input checks the common good case
    without allocating; only a failing input is copied.
    """
    check_tensor(name, x, shape=list(mask.shape), floating=True)
    tolerance = ENERGY_TOLERANCE * torch.finfo(x.dtype).eps
    x = x.to(torch.float32)
    if x.numel() == 0:
        return x
    low, high = (float(v) for v in torch.aminmax(x))
    if math.isfinite(low) and math.isfinite(high) and low >= 0:
        return x
    x = torch.where(mask.bool(), x, 0.0)                        # only valid tokens are checked
    check_finite(name, x)
    low = float(x.min())
    if low < -tolerance:
        raise ValueError(f"{name}: expected values >= 0, got {low:.3g} in rows {bad_rows(x < -tolerance)}")
    return x.clamp_(min=0)


def _row_totals(rewards: Tensor) -> Tensor:
    """[B,T] token rewards -> [B] float32 row sums; every value must be finite.

    A non-finite value makes its row's sum non-finite, so the common case costs one sum; a
    float32 overflow of finite values is summed again in float64."""
    totals = rewards.sum(1)
    if not bool(torch.isfinite(totals).all()):
        check_finite("rewards", rewards)
        totals = rewards.to(torch.float64).sum(1)
        if not bool(torch.isfinite(totals.float()).all()):
            raise ValueError("rewards: row sums exceed the float32 range in rows "
                             f"{bad_rows(~torch.isfinite(totals.float()))}")
        totals = totals.float()
    return totals


def _check_device(device: torch.device, **tensors: Tensor | None) -> None:
    for name, x in tensors.items():
        if x is not None and check_tensor(name, x).device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the mask's device), got {x.device}")


def build_batch(*, rewards: Tensor, mask: Tensor, group: Tensor, energy: Tensor | None = None,
                is_weights: Tensor | None = None, gamma: float = 1.0) -> AdvantageBatch:
    """Validate raw inputs and build the ``AdvantageBatch`` every estimator consumes.

    rewards [B] (outcome) or [B,T] (per token; a reward on a masked token counts at the row's
    nearest preceding valid token, and in the row total R); mask [B,T]; group [B] int ids;
    energy, is_weights [B,T] floats (is_weights multiply energies by rho_bar^2, OTB App. D
    eq. 58-60). Returns-to-go (computed only if an estimator reads them) use ``gamma`` over
    valid tokens. Every check is one cheap pass over its input.
    """
    mask = check_mask("mask", mask)
    num, steps_t = mask.shape
    check_tensor("rewards", rewards, ndim=(1, 2))
    _real("rewards", rewards)
    check_tensor("group", group, shape=[num], integer=True)
    _check_device(mask.device, rewards=rewards, group=group, energy=energy, is_weights=is_weights)
    check_range("gamma", gamma, 0.0, 1.0)
    token_rewards = None
    if rewards.dim() == 2:
        check_tensor("rewards", rewards, shape=[num, steps_t])
        token_rewards = rewards.to(torch.float32)
        seq_rewards = _row_totals(token_rewards)
    else:
        check_tensor("rewards", rewards, shape=[num])
        seq_rewards = rewards.to(torch.float32)
        check_finite("rewards", seq_rewards)

    if energy is not None:  # checked on valid tokens; masked ones are zeroed where an estimator reads them
        energy = _token_tensor("energy", energy, mask)
        if is_weights is not None:
            energy = energy * _token_tensor("is_weights", is_weights, mask).square()
    elif is_weights is not None:
        _token_tensor("is_weights", is_weights, mask)  # validated; unused without energy
    return AdvantageBatch(rewards=seq_rewards, given_mask=mask, groups=GroupIndex.from_ids(group),
                          raw_energy=energy, token_rewards=token_rewards, gamma=float(gamma))


def compute_advantages(name: str, *, rewards: Tensor, mask: Tensor, group: Tensor,
                       energy: Tensor | None = None, is_weights: Tensor | None = None,
                       **options) -> Tensor:
    """Advantages [B,T] float32 from the estimator ``name`` (see ``list_estimators()``).

    rewards: [B] outcome reward, or [B,T] token rewards (returns-to-go with option ``gamma``,
    default 1). Sequence-level estimators use each row's total R = sum_t r_t; for token-level
    returns a reward on a masked token counts at the row's nearest preceding valid token.
    mask: [B,T] bool/0-1. group: [B] int ids (any order, any sizes). energy: [B,T] w_t from
    ``token_stats`` (needed by ``ogb``, ``otb``, ``otb_isolated``); is_weights: [B,T] truncated
    IS weights rho_bar_t. Estimator options (``k``, ``eps``, ``normalize``) are keywords.
    Output: float32 [B,T] on the mask's device, exactly 0 where mask == 0.
    An empty batch (B = 0 or T = 0) gives float32 zeros [B,T].
    """
    spec = get_estimator(name)
    options = spec.resolve_options(options)          # before any work: unknown or mistyped options
    return estimate(name, prepare(name, rewards=rewards, mask=mask, group=group, energy=energy,
                                  is_weights=is_weights, gamma=options.pop("gamma", 1.0)), **options)


def prepare(name: str, *, rewards: Tensor, mask: Tensor, group: Tensor, energy: Tensor | None = None,
            is_weights: Tensor | None = None, gamma: float = 1.0) -> AdvantageBatch:
    """``build_batch`` after checking that estimator ``name`` gets the energies it needs."""
    if get_estimator(name).needs_energy and energy is None:
        raise ValueError(f"energy: estimator {name!r} needs per-token energies [B,T] "
                         "(creditrl.token_stats(...).energy), got None")
    return build_batch(rewards=rewards, mask=mask, group=group, energy=energy, is_weights=is_weights,
                       gamma=gamma)


def estimate(name: str, batch: AdvantageBatch, **options) -> Tensor:
    """Run estimator ``name`` on a built batch and apply the output contract (``compute_advantages``)."""
    spec = get_estimator(name)
    options = spec.resolve_options(options)
    options.pop("gamma", None)                    # already in the batch
    shape = batch.given_mask.shape
    if batch.given_mask.numel() == 0:             # B = 0 or T = 0: no token has an advantage
        return torch.zeros(shape, dtype=torch.float32, device=batch.given_mask.device)
    if spec.k_range is not None:
        spec.k_range.check(spec.name, batch.groups, options["k"])
    try:
        out = spec.fn(batch, **options)
    except ValueError:                            # bad input, named by the estimator (the library's contract)
        raise
    except Exception as err:
        if is_builtin(spec.fn):
            raise
        raise PluginError(f"estimator {name!r} ({plugin_name(spec.fn)}) raised {type(err).__name__}: {err}") from err
    if not isinstance(out, Tensor) or tuple(out.shape) not in {tuple(shape[:1]), tuple(shape)}:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"estimator {name!r} returned {got}; expected shape [B] or [B,T] = "
                         f"{list(shape)}")
    out = out.to(device=batch.given_mask.device, dtype=torch.float32)
    if out.dim() == 2 and spec.masked_output:
        return out
    if not bool(torch.isfinite(out.sum(-1)).all()) and not bool(torch.isfinite(out).all()):
        raise ValueError(f"estimator {name!r} returned non-finite advantages in rows "
                         f"{bad_rows(~torch.isfinite(out.reshape(out.shape[0], -1)))}")
    return batch.broadcast(out) if out.dim() == 1 else out * batch.valid  # exactly 0 on masked tokens


def check_group_size(name: str, options: dict, group_size: int, key: str = "group_size") -> bool:
    """Raise ValueError (naming ``key``) unless estimator ``name`` with ``options`` accepts groups of
    ``group_size`` responses: its declared K range first, then one dummy group of that size, so any
    option/size combination it rejects fails before training instead of at the first batch. Returns
    whether a group of one gets a nonzero advantage (False: such groups learn nothing)."""
    spec = get_estimator(name)
    k = options.get("k")
    if spec.k_range is not None and isinstance(k, int) and not isinstance(k, bool) and \
            not spec.k_range.allows(k, group_size):
        raise ValueError(f"k: {spec.name} needs {spec.k_range.text(key)} (={group_size}), got k={k}")
    try:
        compute_advantages(name, rewards=(torch.arange(group_size) % 2).float(), mask=torch.ones(group_size, 2),
                           group=torch.zeros(group_size, dtype=torch.long), energy=torch.ones(group_size, 2),
                           **options)
        alone = compute_advantages(name, rewards=torch.ones(1), mask=torch.ones(1, 2),
                                   group=torch.zeros(1, dtype=torch.long), energy=torch.ones(1, 2), **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{key}={group_size} with estimator {name!r} and options {options}: {err}") from None
    return bool(alone.abs().sum() > 0)
