"""Plug-ins that run creditrl's estimators and losses inside other trainers.

- ``creditrl.integrations.trl``:  ``CreditGRPOConfig`` / ``CreditGRPOTrainer`` for TRL's GRPO (docs/trl.md)
- ``creditrl.integrations.verl``: ``creditrl_<name>`` advantage estimators and the ``creditrl`` /
  ``creditrl_stapo`` / ``creditrl_grpo_lambda`` policy losses, loaded by verl's ``verl.plugins``
  entry point (docs/verl.md)

Neither is imported by ``import creditrl``; each imports its framework. Both generate their loss
options from the loss-term registry here (``loss_term_fields``) and read them with
``creditrl.core.losses.compose(Fields(...))``, the one way every front end composes a loss.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Collection, Mapping

from creditrl.core.estimators.registry import get_estimator
from creditrl.core.losses import get_loss_term, list_loss_terms

LOSS_TERMS_HELP = ("Further loss terms: a list of {\"path\": \"package.module:function\" (or a registered name), "
                   "<option>: value, ...} (or its JSON), e.g. [{\"path\": \"my_terms:length_penalty\", \"coef\": 0.01}]")


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
