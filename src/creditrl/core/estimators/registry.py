"""The estimator registry and ``compute_advantages``, the one entry point to all estimators.

An estimator is a pure function ``fn(batch: AdvantageBatch, **options) -> Tensor`` returning
either a sequence-level advantage [B] (broadcast to the response's valid tokens) or a
token-level advantage [B, T]. ``compute_advantages`` validates the raw inputs once, builds
the ``AdvantageBatch`` and applies the output contract (float32, exactly 0 where mask == 0),
so estimators contain only their formula. Third parties add one with ``@register_estimator``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol

import torch
from torch import Tensor

from creditrl.core.estimators.steps import StepIndex, returns_to_go
from creditrl.core.groups import GroupIndex
from creditrl.utils.imports import plugin_name, registered_entry
from creditrl.utils.options import OptionSpec, options_of


@dataclass(frozen=True)
class AdvantageBatch:
    """Validated estimator inputs on the input device. Derived views are computed on first use,
    so a sequence-level estimator never pays for returns-to-go or the compacted step view.

    rewards:       [B]    float32 sequence reward R (Σ_t r_t over every token for token rewards)
    given_mask:    [B,T]  the mask as the caller gave it (bool, or checked 0/1 of any real dtype)
    groups:        GroupIndex of the group ids
    raw_energy:    [B,T]  float32 ŵ_t (×ρ̄_t² when is_weights were given, OTB App. D eq. 58-60),
                          finite and >= 0, but not necessarily 0 on masked tokens (no copy of
                          the caller's tensor); None when not given
    token_rewards: [B,T]  float32 per-token rewards as given; None for [B] rewards
    gamma:         discount of the returns-to-go
    Derived: ``valid`` [B,T] float32 1/0; ``lengths`` [B] int64 valid tokens per response;
    ``mask`` [B,T] bool; ``energy`` [B,T] the energies with 0 where mask == 0;
    ``steps`` (StepIndex); ``returns`` [B,T] float32 returns-to-go
    G_t over valid steps (R on every valid token for [B] rewards), 0 where mask == 0; a reward on
    a masked token counts at the row's nearest preceding valid token.
    """

    rewards: Tensor
    given_mask: Tensor
    groups: GroupIndex
    raw_energy: Tensor | None
    token_rewards: Tensor | None
    gamma: float = 1.0

    @property
    def token_level(self) -> bool:
        return self.token_rewards is not None

    @cached_property
    def valid(self) -> Tensor:
        return self.given_mask.to(torch.float32)

    @cached_property
    def lengths(self) -> Tensor:
        mask = self.given_mask
        if mask.dtype == torch.bool:
            return mask.view(torch.uint8).sum(1, dtype=torch.int64)
        return mask.sum(1).long()  # in the mask's own dtype: exact for 0/1 rows, no converted copy

    @cached_property
    def mask(self) -> Tensor:
        return self.given_mask.bool()

    @cached_property
    def energy(self) -> Tensor | None:
        return None if self.raw_energy is None else self.raw_energy * self.valid

    @cached_property
    def steps(self) -> StepIndex:
        return StepIndex.from_mask(self.given_mask, self.valid, self.lengths)

    def broadcast(self, per_row: Tensor) -> Tensor:
        """[B] float32 -> [B,T] float32: the value on each row's valid tokens, exactly 0 elsewhere
        (finite values times the mask as given: one pass, no converted copy of the mask)."""
        mask = self.given_mask
        if mask.is_floating_point() and mask.dtype != torch.float32:
            mask = self.valid
        return per_row[:, None] * mask

    @cached_property
    def constant_returns(self) -> bool:
        """True when every valid token's return-to-go is its row's R: [B] rewards, or token
        rewards that sit only on each row's last valid token with gamma = 1 (the usual outcome
        reward as verl passes it). Estimators then skip the returns-to-go (one nonzero count)."""
        if self.token_rewards is None:
            return True
        if self.gamma != 1.0:
            return False
        at_last = self.token_rewards.gather(1, self.steps.last_token[:, None])
        return int(torch.count_nonzero(self.token_rewards)) == int(torch.count_nonzero(at_last))

    @cached_property
    def returns(self) -> Tensor:
        if self.constant_returns:
            return self.broadcast(self.rewards)
        return returns_to_go(self.token_rewards, self.steps, self.gamma, self.rewards)


class Estimator(Protocol):
    def __call__(self, batch: AdvantageBatch, **options) -> Tensor: ...


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Callable[..., Tensor]
    needs_energy: bool = False
    doc: str = ""
    masked_output: bool = False  # a [B,T] result is already finite and exactly 0 where mask == 0

    @property
    def option_specs(self) -> list[OptionSpec] | None:
        """The options this estimator takes, declared once by ``fn``'s keyword parameters after
        the batch (help from ``Annotated[type, "help"]``), plus ``gamma`` (the returns-to-go
        discount every estimator accepts). None when ``fn`` takes ``**options``."""
        specs = options_of(self.fn, skip=1)
        return None if specs is None else [GAMMA, *specs]

    @property
    def options(self) -> dict[str, object] | None:
        """``option_specs`` as name -> default (``inspect.Parameter.empty`` = required)."""
        specs = self.option_specs
        return None if specs is None else {s.name: s.default for s in specs}


GAMMA = OptionSpec("gamma", float, 1.0, "Discount of the returns-to-go over valid tokens (token-level rewards).")

_REGISTRY: dict[str, EstimatorSpec] = {}


def register_estimator(name: str, *, needs_energy: bool = False, overwrite: bool = False,
                       masked_output: bool = False):
    """Decorator: register ``fn(batch: AdvantageBatch, **options) -> [B] | [B,T]`` under ``name``.

    ``needs_energy`` makes ``compute_advantages`` require the ``energy`` argument.
    ``masked_output`` promises that a [B,T] result is finite and exactly 0 where mask == 0, so
    ``compute_advantages`` skips its checking pass (the built-in token-level estimators; tested).
    Re-registering a name raises unless ``overwrite=True`` (or it is the same function).
    """

    def decorator(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        try:
            inspect.signature(fn).bind_partial(None)
        except (TypeError, ValueError):
            raise TypeError(f"estimator {name!r}: {plugin_name(fn)} must take the batch as its first argument, "
                            f"fn(batch, **options)") from None
        old = _REGISTRY.get(name)
        if old is not None and not overwrite and old.fn is not fn and (
                getattr(old.fn, "__qualname__", None), getattr(old.fn, "__module__", None)) != (
                getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)):
            raise ValueError(f"estimator {name!r} is already registered to {old.fn!r}; pass overwrite=True")
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = EstimatorSpec(name, fn, needs_energy, doc[0] if doc else "", masked_output)
        return fn

    return decorator


def list_estimators() -> list[str]:
    """Names of all registered estimators, sorted."""
    return sorted(_REGISTRY)


def get_estimator(name: str) -> EstimatorSpec:
    """The spec of a registered estimator, by name or by the import path ``"pkg.module:function"``
    of a function registered with ``register_estimator`` (importing the module registers it)."""
    return registered_entry(
        _REGISTRY, name, what="estimator",
        unknown=f"name: unknown estimator {name!r}; valid estimators are {list_estimators()} or an import path "
                "'package.module:function'",
        unregistered="decorate it with @creditrl.register_estimator('my_name') so its options and needs are declared")
