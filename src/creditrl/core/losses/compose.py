"""``compose``: the one way to build a ``PolicyLoss``, whichever spelling the loss was written in.

Three front ends spell the same terms three ways; each spelling is read here into the canonical
form (term name -> its options instance) that ``PolicyLoss`` takes:

- **nested** (``creditrl train``'s ``loss:`` section, a mapping): the flat terms' fields at the top
  (``clip_low``, ``agg``, ``kl_coef``, ...), each other built-in term as a section with
  ``enabled`` (``stapo: {enabled: true, tau_p: 0.002}``), a user's terms by import path in
  ``terms: [{path: "pkg.mod:fn", <option>: value}]``; errors name the dotted key (``loss.stapo.tau_p``);
- **keywords** (``policy_loss``, the library): the flat terms' fields, a term by name (None/False
  off, True its defaults, or its options instance), ``terms=`` by name or import path;
- **fields** (a framework's config class made by ``creditrl.integrations.loss_term_fields``: TRL's
  ``CreditGRPOConfig``, verl's ``CreditPolicyLossConfig``): ``stapo=True``, ``stapo_tau_p=...``,
  ``loss_terms=[...]``, with the options the framework holds under its own names (``Fields``).

``policy_loss(logp, old_logp, advantages, mask, **keywords)`` is the keyword spelling applied in one
call. ``PolicyLoss.to_config()`` writes a loss back in the nested spelling (a run's config.yaml), so
``compose(loss.to_config())`` rebuilds the same loss.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Sequence

from torch import Tensor

from creditrl.core.losses.policy import PolicyLoss
from creditrl.core.losses.terms import LossTerm, builtin_loss_terms, get_loss_term, list_loss_terms, resolve_loss_terms
from creditrl.utils.options import OptionError, coerce, instantiate, parse_json_field

__all__ = ["Fields", "compose", "policy_loss"]


@dataclass(frozen=True)
class Fields:
    """A framework config's flat loss fields (``loss_term_fields``): ``get(key)`` reads one (None
    when unset: the term's default); ``native`` the flat options the framework holds under its own
    names (TRL's ``epsilon`` is ``clip_low``); ``native_terms`` the options (None: off) of terms it
    switches by its own fields; ``native_options`` the options of terms whose fields it holds under
    their own names (also under a ``loss_terms`` entry's own values); ``switched_on`` the terms a
    loss mode turns on. A term's field set while the term is switched off raises: it would do nothing."""
    get: Callable[[str], Any]
    native: Mapping[str, Any] = field(default_factory=dict)
    switched_on: Collection[str] = ()
    native_terms: Mapping[str, Any] = field(default_factory=dict)
    native_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def compose(spec: Mapping[str, Any] | Fields | None = None, /, *, max_len: int | None = None,
            where: str = "loss", **keywords: Any) -> PolicyLoss:
    """The ``PolicyLoss`` of ``spec`` (a nested mapping or ``Fields``) or of ``keywords``, one
    spelling at a time (module docstring). ``max_len``: the aggregation's ``max_len`` when the loss
    leaves it unset (a trainer's ``rollout.max_new_tokens``). ``where``: the nested spelling's key
    in errors (``loss``)."""
    if spec is not None and keywords:
        raise TypeError(f"compose: expected one spelling of the loss, got a {type(spec).__name__} and the keywords "
                        f"{sorted(keywords)}")
    if isinstance(spec, Fields):
        chosen = _from_fields(spec)
    elif keywords or spec is None:
        chosen = _from_keywords(keywords)
    elif isinstance(spec, Mapping):
        chosen = _from_nested(spec, where)
    else:
        raise TypeError(f"{where}: expected a mapping of loss keys, a Fields or keywords, got {type(spec).__name__}")
    loss = PolicyLoss(chosen)
    aggregation = loss.options_of("aggregation")
    if max_len is not None and aggregation is not None and aggregation.max_len is None:
        loss = loss.with_options("aggregation", dataclasses.replace(aggregation, max_len=max_len))
    return loss


# ----------------------------------------------------------------------------- nested (the config)

def _from_nested(loss: Mapping[str, Any], where: str) -> dict[str, Any]:
    terms = builtin_loss_terms()
    flat = {f.name: term for term in terms if term.flat for f in dataclasses.fields(term.options)}
    sections = {term.name: term for term in terms if not term.flat}
    unknown = sorted(set(loss) - set(flat) - set(sections) - {"terms"})
    if unknown:
        raise OptionError(f"{where}.{unknown[0]}: unknown key; valid keys of {where} are "
                          f"{sorted(flat) + sorted(sections) + ['terms']}")
    chosen: dict[str, Any] = {}
    for term in (t for t in terms if t.flat):
        names = [f.name for f in dataclasses.fields(term.options)]
        chosen[term.name] = instantiate(where, term.options, {k: loss[k] for k in names if k in loss})
    for name, term in sections.items():
        section = loss.get(name)
        if section is not None and not isinstance(section, Mapping):   # loss.stapo=true
            raise OptionError(f"{where}.{name}: expected a mapping of the term's options (switch it on with "
                              f"{where}.{name}.enabled=true), got {section!r}")
        section = dict(section or {})
        switched = "enabled" in section
        enabled = coerce(f"{where}.{name}.enabled", section.pop("enabled", False), bool)
        options = instantiate(f"{where}.{name}", term.options, section)   # checked even while off
        if enabled:
            chosen[name] = options
        elif section and not switched:
            # options with no switch would do nothing (verl's entropy_coeff > 0, TRL's entropy_coef turn the
            # term on, so a user may expect that); an explicit enabled: false over them is an ablation
            raise OptionError(f"{where}.{name}.{next(iter(section))}: given, but the {name} term is off "
                              f"({where}.{name}.enabled is not set), so it would do nothing; switch it on with "
                              f"{where}.{name}.enabled=true, or drop {where}.{name}.{next(iter(section))}")
    given: dict[str, int] = {}
    for i, entry in enumerate(loss.get("terms") or []):
        term, options = _listed_term(f"{where}.terms[{i}]", entry, terms)
        if term.name in given:   # a second entry would silently replace the first's options
            raise OptionError(f"{where}.terms[{i}]: loss term {term.name!r} is already given in "
                              f"{where}.terms[{given[term.name]}]; each term is applied once, with one set of "
                              f"options: merge the two entries")
        if term.name in chosen:  # a built-in term on by its section too
            raise OptionError(f"{where}.terms[{i}]: loss term {term.name!r} is also on as {where}.{term.name}.enabled"
                              f"=true; each term is applied once, with one set of options: set it one way")
        given[term.name] = i
        chosen[term.name] = options
    return chosen


def _listed_term(where: str, entry: object, builtin: list[LossTerm]) -> tuple[LossTerm, Any]:
    """An entry of ``terms``: a user's term by import path, or one of creditrl's optional terms by
    name (``{path: cispo}``, as verl's and TRL's ``loss_terms`` take it; written back as its section).
    creditrl's flat terms (clip, aggregation, KL, rollout correction) are always part of the loss and
    set by their keys."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("path"), str):
        raise OptionError(f"{where}: expected a mapping with 'path' (a registered loss term or "
                          f"'package.module:function') and the term's options, got {entry!r}")
    try:
        term = get_loss_term(entry["path"])
    except ValueError as err:       # unknown, unregistered, or its module failed to import
        raise OptionError(f"{where}.path: {str(err).removeprefix('loss term: ')}") from err
    if term in builtin and term.flat:
        root = where.split(".terms[")[0]
        keys = [f"{root}.{f.name}" for f in dataclasses.fields(term.options)]
        raise OptionError(f"{where}: {entry['path']!r} is creditrl's own loss term {term.name!r}, always part of the "
                          f"loss and set by its keys {', '.join(keys)} (so the run builds what it needs, e.g. the "
                          f"reference model of {root}.kl_coef)")
    return term, instantiate(where, term.options, {k: v for k, v in entry.items() if k != "path"})


# ----------------------------------------------------------------------------- keywords (the library)

def _from_keywords(keywords: dict[str, Any]) -> dict[str, Any]:
    chosen = resolve_loss_terms(keywords.pop("terms", None))
    flat_fields = {f.name: term for term in map(get_loss_term, list_loss_terms()) if term.flat
                   for f in dataclasses.fields(term.options)}
    flat_values: dict[str, dict] = {}
    for key, value in keywords.items():
        if key in flat_fields:
            flat_values.setdefault(flat_fields[key].name, {})[key] = value
        elif key in list_loss_terms() and not get_loss_term(key).flat:
            switched = _switched_term(get_loss_term(key), value)
            if switched is not None:
                chosen[key] = _not_twice(chosen, key, switched)
        else:
            raise TypeError(f"policy_loss: unknown option {key!r}; valid options are "
                            f"{sorted(flat_fields) + [n for n in list_loss_terms() if not get_loss_term(n).flat]}")
    for name, values in flat_values.items():
        chosen[name] = _not_twice(chosen, name, get_loss_term(name).make_options(values))
    return chosen


def _switched_term(term: LossTerm, value: Any) -> Any:
    """A non-flat term given by keyword: None/False = off, True = defaults, or its options."""
    if value is None or value is False:
        return None
    if value is True:
        return term.make_options()
    if isinstance(value, term.options):
        return value
    raise TypeError(f"{term.name}: expected None, a bool or {term.options.__name__}, got {type(value).__name__}")


def _not_twice(chosen: dict, name: str, options: Any) -> Any:
    if name in chosen:
        raise ValueError(f"terms: loss term {name!r} is given twice (in terms and by keyword)")
    return options


# ----------------------------------------------------------------------------- fields (TRL, verl)

def _from_fields(spec: Fields) -> dict[str, Any]:
    get, native = spec.get, spec.native
    terms: dict[str, Any] = {}
    for name in list_loss_terms():
        term = get_loss_term(name)
        names = [f.name for f in dataclasses.fields(term.options)]
        if name in spec.native_terms:
            if spec.native_terms[name] is not None:
                terms[name] = term.make_options(spec.native_terms[name])
            continue
        if name in spec.native_options:
            if name in spec.switched_on or get(name):
                terms[name] = term.make_options(spec.native_options[name])
            continue
        if term.flat:
            values = {k: native[k] if k in native else get(k) for k in names}
            terms[name] = term.make_options({k: v for k, v in values.items() if v is not None})
            continue
        values = {k: get(f"{name}_{k}") for k in names}
        values = {k: v for k, v in values.items() if v is not None}
        switch = True if name in spec.switched_on else get(name)
        if switch is not None and not isinstance(switch, bool):   # "false" would be truthy
            raise TypeError(f"{name}: expected True, False or None (on when one of {name}_* is set), got "
                            f"{type(switch).__name__} {switch!r}")
        if switch is False and values:
            raise ValueError(f"{name}_{next(iter(values))}: set while {name}=False, where it does nothing; "
                             f"drop it or set {name}=True")
        if switch or (switch is None and values):
            terms[name] = _field_options(term, values, f"{name}_")
    user = parse_json_field("loss_terms", get("loss_terms"), list)
    for entry in user or []:
        (name, options), = resolve_loss_terms([dict(entry)]).items()
        if name in spec.native_options:   # the framework's own fields, under what the entry sets itself
            (name, options), = resolve_loss_terms([{**spec.native_options[name], **dict(entry)}]).items()
        if name in terms:
            raise ValueError(f"loss_terms: loss term {name!r} is also set by its own fields; set it one way")
        terms[name] = options
    return terms


def _field_options(term: LossTerm, values: dict[str, Any], prefix: str) -> Any:
    """``term.make_options(values)`` whose error names the front end's field (``trace_lam``), not the
    options class's (``lam``)."""
    try:
        return term.make_options(values)
    except (TypeError, ValueError) as err:
        field_name, _, rest = str(err).partition(": ")
        if field_name in values:
            raise type(err)(f"{prefix}{field_name}: {rest}") from None
        raise


# ----------------------------------------------------------------------------- the one-call form

def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                ref_logp: Tensor | None = None, rollout_logp: Tensor | None = None, entropy: Tensor | None = None,
                truncated: Tensor | None = None, weights: Tensor | None = None,
                terms: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                **options: Any) -> tuple[Tensor, dict[str, float]]:
    """The clipped policy-gradient loss with composable options:
    ``compose(terms=terms, **options)(logp, old_logp, advantages, mask, ...)``.

    Options (see the signature): the fields of the flat terms — ``clip_low, clip_high, clip_c``
    (``ClipOptions``), ``agg, max_len`` (``AggregationOptions``), ``kl_coef, kl_estimator,
    kl_bias_correction`` (``KLOptions``), ``rollout_correction, rollout_cap``
    (``RolloutCorrectionOptions``) — and each other term by name (None, a bool or its options:
    ``stapo``, ``trace``, ``cispo``, ``entropy_bonus``, ...); ``terms`` adds terms by name or
    import path, e.g. ``[{"path": "cispo"}, {"path": "my_module:length_penalty", "coef": 0.01}]``.
    Tensors and returns: ``PolicyLoss.__call__``.
    """
    loss_fn = compose(terms=terms, **options)
    return loss_fn(logp, old_logp, advantages, mask, ref_logp=ref_logp, rollout_logp=rollout_logp, entropy=entropy,
                   truncated=truncated, weights=weights)


def _keyword_signature() -> inspect.Signature:
    """policy_loss's signature with every built-in option spelled out (declared by the terms' dataclasses)."""
    params = list(inspect.signature(policy_loss).parameters.values())[:-1]
    keyword = inspect.Parameter.KEYWORD_ONLY
    for name in list_loss_terms():
        term = get_loss_term(name)
        if term.flat:
            params += [inspect.Parameter(f.name, keyword, default=f.default, annotation=f.type)
                       for f in dataclasses.fields(term.options)]
        else:
            params.append(inspect.Parameter(name, keyword, default=None, annotation=f"{term.options.__name__} | None"))
    return inspect.signature(policy_loss).replace(parameters=params)


policy_loss.__signature__ = _keyword_signature()
