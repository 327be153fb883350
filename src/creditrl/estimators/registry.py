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
from typing import Callable, Protocol

from torch import Tensor

from creditrl.groups import GroupIndex


@dataclass(frozen=True)
class AdvantageBatch:
    """Validated estimator inputs, all float32 on the input device.

    rewards:  [B]    sequence reward R (Σ_t r_t for token-level rewards)
    returns:  [B,T]  returns-to-go G_t over valid tokens (R on every valid token for outcome
                     rewards), 0 where mask == 0
    mask:     [B,T]  bool, True where the token is trained on
    groups:   GroupIndex of the group ids
    energy:   [B,T]  ŵ_t (×ρ̄_t² when is_weights were given, OTB App. D eq. 58-60), 0 where
                     mask == 0; None when not given
    token_level: whether rewards were given per token
    """

    rewards: Tensor
    returns: Tensor
    mask: Tensor
    groups: GroupIndex
    energy: Tensor | None
    token_level: bool


class Estimator(Protocol):
    def __call__(self, batch: AdvantageBatch, **options) -> Tensor: ...


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Callable[..., Tensor]
    needs_energy: bool = False
    doc: str = ""

    @property
    def options(self) -> dict[str, object] | None:
        """The options this estimator takes, declared once by ``fn``'s parameters after the
        batch: name -> default (``inspect.Parameter.empty`` = required), plus ``gamma`` (the
        returns-to-go discount every estimator accepts). None when ``fn`` takes ``**options``."""
        params = list(inspect.signature(self.fn).parameters.values())[1:]
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None
        named = {p.name: p.default for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        return {"gamma": 1.0, **named}


_REGISTRY: dict[str, EstimatorSpec] = {}


def register_estimator(name: str, *, needs_energy: bool = False, overwrite: bool = False):
    """Decorator: register ``fn(batch: AdvantageBatch, **options) -> [B] | [B,T]`` under ``name``.

    ``needs_energy`` makes ``compute_advantages`` require the ``energy`` argument.
    Re-registering a name raises unless ``overwrite=True`` (or it is the same function).
    """

    def decorator(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        old = _REGISTRY.get(name)
        if old is not None and not overwrite and old.fn is not fn and (
                getattr(old.fn, "__qualname__", None), getattr(old.fn, "__module__", None)) != (
                getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)):
            raise ValueError(f"estimator {name!r} is already registered to {old.fn!r}; pass overwrite=True")
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = EstimatorSpec(name, fn, needs_energy, doc[0] if doc else "")
        return fn

    return decorator


def list_estimators() -> list[str]:
    """Names of all registered estimators, sorted."""
    return sorted(_REGISTRY)


def get_estimator(name: str) -> EstimatorSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"name: unknown advantage estimator {name!r}; valid names are {list_estimators()}") from None
