"""Plug-ins that run creditrl's estimators and losses inside other trainers.

- ``creditrl.integrations.trl``:  ``CreditGRPOConfig`` / ``CreditGRPOTrainer`` for TRL's GRPO (docs/trl.md)
- ``creditrl.integrations.verl``: ``creditrl_<name>`` advantage estimators and the ``creditrl`` /
  ``creditrl_stapo`` / ``creditrl_grpo_lambda`` policy losses, loaded by verl's ``verl.plugins``
  entry point (docs/verl.md)

Neither is imported by ``import creditrl``; each imports its framework. Both generate their loss
options from the loss-term registry here (``loss_term_fields``, ``loss_terms_from``).
"""
from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Callable, Collection, Mapping

import torch
from torch import Tensor

from creditrl.core.estimators.registry import get_estimator
from creditrl.core.losses import get_loss_term, list_loss_terms, resolve_loss_terms

LOSS_TERMS_HELP = ("Further loss terms: a list of {\"path\": \"package.module:function\" (or a registered name), "
                   "<option>: value, ...} (or its JSON), e.g. [{\"path\": \"my_terms:length_penalty\", \"coef\": 0.01}]")


def energy_from_logp(logp: Tensor, sum_p2: Tensor) -> Tensor:
    """Per-token energy w_t = ||e_y - pi_t||^2 = 1 - 2 pi_t(y_t) + sum_v pi_t(v)^2 (OTB eq. 7), float32,
    clamped >= 0 like ``creditrl.token_stats``; from frameworks that give log pi(y_t) and sum pi^2."""
    # one allocation, then in place: large [B,T] allocations dominate the cost on a CPU
    energy = logp.detach().float().exp()
    return torch.add(sum_p2.detach().float(), energy, alpha=-2.0, out=energy).add_(1.0).clamp_(min=0.0)


def check_estimator_options(name: str, options: Mapping[str, Any], where: str) -> dict:
    """``options`` resolved against what estimator ``name`` declares (typed, defaults filled);
    errors name ``where``, the host framework's key."""
    return get_estimator(name).resolve_options(dict(options), where)


def loss_term_fields(native: Collection[str] = (), *, native_terms: Collection[str] = (),
                     native_options: Collection[str] = (), typed: bool = True) -> list[tuple[str, Any, Any]]:
    """``dataclasses.make_dataclass`` field specs for creditrl's loss terms, from their options dataclasses:

    - each flat term's fields, except ``native`` (options the host framework has under its own name),
      with the term's default and help;
    - for each other term, except ``native_terms`` (terms the framework switches by its own fields),
      ``<name>: bool | None`` (None: on when one of its fields is set) and, unless the framework
      holds its options under their own names (``native_options``),
      ``<name>_<field>: T | None = None`` (None: the term's default);
    - ``loss_terms``: further terms by import path (``resolve_loss_terms``'s list form).
    ``typed=False`` declares every field ``Any`` (for configs that do not parse types)."""
    specs = []
    for name in list_loss_terms():
        term = get_loss_term(name)
        hints = typing.get_type_hints(term.options)
        if name in native_terms:
            continue
        if name in native_options:
            specs.append((name, bool | None if typed else Any, dataclasses.field(default=None, metadata={
                "help": f"{term.doc} On when true; its options are the framework's own fields."})))
            continue
        if term.flat:
            specs += [(f.name, hints[f.name] if typed else Any, dataclasses.field(default=f.default, metadata=f.metadata))
                      for f in dataclasses.fields(term.options) if f.name not in native]
            continue
        specs.append((name, bool | None if typed else Any, dataclasses.field(default=None, metadata={
            "help": f"{term.doc} On when true, or when one of {name}_* is set."})))
        specs += [(f"{name}_{f.name}", (hints[f.name] | None) if typed else Any, dataclasses.field(
            default=None, metadata={"help": f"{f.metadata.get('help', '')} (None: {f.default!r})"}))
                  for f in dataclasses.fields(term.options)]
    specs.append(("loss_terms", list | str | None if typed else Any,
                  dataclasses.field(default=None, metadata={"help": LOSS_TERMS_HELP})))
    return specs


def loss_terms_from(get: Callable[[str], Any], native: Mapping[str, Any] | None = None, *,
                    switched_on: Collection[str] = (), native_terms: Mapping[str, Any] | None = None,
                    native_options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """``PolicyLoss`` terms from a config with ``loss_term_fields``: ``get(key)`` reads a field
    (None when unset or absent: the term's default; a term registered after the config class was
    made has no fields and is off), ``native`` gives the flat options the framework holds
    under its own names, ``native_terms`` the options (None: off) of the terms it switches by its
    own fields, ``native_options`` the options of the terms whose fields it holds under their own
    names (also for such a term in ``loss_terms``, under the entry's own values), ``switched_on``
    names terms a loss mode turns on. A term's field set while the term is switched off raises: it
    would do nothing."""
    native, native_terms, native_options = native or {}, native_terms or {}, native_options or {}
    terms: dict[str, Any] = {}
    for name in list_loss_terms():
        term = get_loss_term(name)
        names = [f.name for f in dataclasses.fields(term.options)]
        if name in native_terms:
            if native_terms[name] is not None:
                terms[name] = term.make_options(native_terms[name])
            continue
        if name in native_options:
            if name in switched_on or get(name):
                terms[name] = term.make_options(native_options[name])
            continue
        if term.flat:
            values = {k: native[k] if k in native else get(k) for k in names}
            terms[name] = term.make_options({k: v for k, v in values.items() if v is not None})
            continue
        values = {k: get(f"{name}_{k}") for k in names}
        values = {k: v for k, v in values.items() if v is not None}
        switch = True if name in switched_on else get(name)
        if switch is not None and not isinstance(switch, bool):   # "false" would be truthy
            raise TypeError(f"{name}: expected True, False or None (on when one of {name}_* is set), got "
                            f"{type(switch).__name__} {switch!r}")
        if switch is False and values:
            raise ValueError(f"{name}_{next(iter(values))}: set while {name}=False, where it does nothing; "
                             f"drop it or set {name}=True")
        if switch or (switch is None and values):
            terms[name] = term.make_options(values)
    user = get("loss_terms")
    if isinstance(user, str):
        user = json.loads(user)
    for entry in user or []:
        terms = _add_user_term(terms, entry, native_options)
    return terms


def _add_user_term(terms: dict[str, Any], entry: Any,
                   native_options: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    (name, options), = resolve_loss_terms([dict(entry)]).items()
    if name in native_options:           # the framework's own fields, under what the entry sets itself
        (name, options), = resolve_loss_terms([{**native_options[name], **dict(entry)}]).items()
    if name in terms:
        raise ValueError(f"loss_terms: loss term {name!r} is also set by its own fields; set it one way")
    return {**terms, name: options}
