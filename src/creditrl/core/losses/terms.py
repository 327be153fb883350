"""Loss terms: the pieces the policy loss is composed of, their registry, and the state they pass on.

A term is one function and one options dataclass::

    @dataclass(frozen=True)
    class LengthPenaltyOptions:
        coef: float = field(default=0.01, metadata={"help": "penalty per token of response length"})

    @register_loss_term("length_penalty", options=LengthPenaltyOptions, stage="penalty")
    def length_penalty(state: LossState, options: LengthPenaltyOptions) -> LossState:
        # the first line of the function's docstring documents the term (``LossTerm.doc``)
        share = state.row_tokens[:, None] / state.valid.shape[1]          # n_b / T
        return state.add_token_loss(options.coef * share * torch.exp(state.logp - state.old_logp))

``fn(state, options) -> state`` is plain autograd over [B,T] tensors; ``PolicyLoss`` runs the
terms in the fixed order of ``STAGES`` and differentiates the result. From the one options
dataclass come ``creditrl train``'s config keys, TRL's ``CreditGRPOConfig`` fields and verl's
``CreditPolicyLossConfig`` fields (each field's default and ``metadata["help"]``).

``flat`` terms (clip, aggregation, kl, rollout_correction) are always part of the loss and put
their fields directly under ``loss.`` in a config, so their field names are unique across flat
terms; the others are off unless chosen and get a section ``loss.<name>`` of their own.

Two stages make one thing each (``EXCLUSIVE_STAGES``): "surrogate" the token loss, "aggregate"
the scalar. Their flat term (``clip``, ``aggregation``) is the default; a chosen term of that stage
(``cispo``, ``sapo``, ``delta_l_norm``, ...) replaces it, and two chosen terms of one such stage
are refused, naming both. The replaced term's options stay in ``LossState.flat``, where the
replacement reads what it shares with it (a surrogate's clip bounds ``flat["clip"].clip_low``).
Within a stage, terms run in registration order (creditrl's own in ``policy.py``'s import order).
A user's term is chosen by import path, ``"package.module:function"``: importing the module runs
its decorator.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from creditrl.utils.imports import PluginError, is_builtin, plugin_name, registered_entry
from creditrl.utils.options import coerce, doc_summary

STAGES = ("keep", "ratio", "surrogate", "penalty", "aggregate")
STAGE_DOCS = {
    "keep": "which tokens count (``keep``) and data weights of the surrogate (``weight``)",
    "ratio": "the surrogate's log-ratio ``log_ratio`` and advantages (dropped tokens are detached in ``logp``)",
    "surrogate": "the per-token loss ``token_loss`` from log_ratio, advantages and weight (one term: ``clip`` "
                 "unless another is chosen)",
    "penalty": "per-token terms added to ``token_loss``",
    "aggregate": "``token_loss`` over the kept tokens -> the scalar ``loss`` (one term: ``aggregation`` unless "
                 "another is chosen)",
}
EXCLUSIVE_STAGES = ("surrogate", "aggregate")
INPUTS = ("ref_logp", "rollout_logp", "entropy", "truncated")


@dataclass(frozen=True)
class LossState:
    """What the terms read and replace (``dataclasses.replace``), shapes [B,T] unless noted.

    Every [B,T] tensor is in the compute dtype (float32 or wider), finite off ``valid`` and 0 there
    (so masking is a multiply by ``valid_f``: a ``torch.where`` costs ~7x more on CPU).
    logp:        log π_θ(y_t), on the caller's graph (the only tensor with gradient); from the
                 "ratio" stage on, detached where ``keep`` is False (dropped tokens pass no gradient)
    old_logp, ref_logp, rollout_logp: detached data (None when not given / not needed)
    entropy:     H_t of π_θ, detached data, or on the caller's graph while a term differentiates it
                 (``differentiates=("entropy",)``: the entropy bonus)
    truncated:   [B] bool, responses cut at the token cap (None when not given / not needed)
    advantages:  [B,1] (sequence-level) or [B,T], detached
    valid:       bool, the response tokens (``valid_f``: the same as 0/1 in the compute dtype)
    keep:        bool ⊆ valid, the tokens the loss counts
    row_tokens:  [B] valid tokens per row;  n_valid: 0-d, Σ row_tokens (at least 1)
    log_ratio:   z = log π_θ − log π_old (set before the "ratio" stage)
    score_route: (log_ratio, uncapped) from a ratio term that caps log_ratio's value and with it
                 its gradient (GSPO's log s ≤ 10, as verl): while log_ratio is still that tensor,
                 ``score_logp`` takes uncapped's gradient instead (None: log_ratio's own)
    weight:      per-token factor of the surrogate, [B,T] or [B,1] (None = 1)
    token_loss:  ℓ [B,T] (set by the "surrogate" stage);  loss: the scalar (set by "aggregate")
    flat:        flat term name -> its options (also of a term a chosen one replaces: ``flat["clip"]``)
    metrics:     name -> 0-d tensor (all copied to the host at once, at the end: no ``.item()``)
    metric_counts: name -> 0-d tensor, how many items (tokens, responses) a metric is the mean over
                 (``with_metrics``' pairs): what micro-batches weight it by
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    valid: Tensor
    valid_f: Tensor
    keep: Tensor
    row_tokens: Tensor
    n_valid: Tensor
    ref_logp: Tensor | None = None
    rollout_logp: Tensor | None = None
    entropy: Tensor | None = None
    truncated: Tensor | None = None
    log_ratio: Tensor | None = None
    score_route: tuple[Tensor, Tensor] | None = None
    weight: Tensor | None = None
    token_loss: Tensor | None = None
    loss: Tensor | None = None
    flat: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, Tensor] = field(default_factory=dict)
    metric_counts: Mapping[str, Tensor] = field(default_factory=dict)

    def with_metrics(self, **values: Tensor | tuple[Tensor, Tensor]) -> LossState:
        """Metrics as 0-d tensors, or as (total, count) pairs: the mean total / count over ``count``
        items (tokens, responses; 0 where there are none), which gradient accumulation weights by
        that count, so micro-batches average to the batch's mean. A plain value is weighted by the
        aggregation's denominator (``agg_count``)."""
        metrics, counts = dict(self.metrics), dict(self.metric_counts)
        for name, value in values.items():
            counts.pop(name, None)
            if isinstance(value, tuple):
                if len(value) != 2:
                    raise TypeError(f"with_metrics: {name}: expected a 0-d tensor or a (total, count) pair, "
                                    f"got a tuple of {len(value)}")
                total = torch.as_tensor(value[0], device=self.valid.device)
                counts[name] = torch.as_tensor(value[1], device=total.device)
                value = torch.where(counts[name] > 0, total / counts[name].clamp(min=1), 0.0)
            metrics[name] = value
        return dataclasses.replace(self, metrics=metrics, metric_counts=counts)

    def scaled(self, factor: Tensor) -> LossState:
        """Multiply the surrogate's per-token ``weight`` by ``factor`` ([B,T] or [B,1])."""
        return dataclasses.replace(self, weight=factor if self.weight is None else self.weight * factor)

    def add_token_loss(self, extra: Tensor) -> LossState:
        """ℓ ← ℓ + extra (a per-token penalty, [B,T] or [B,1])."""
        return dataclasses.replace(self, token_loss=self.token_loss + extra)

    @property
    def n_tokens(self) -> Tensor:
        """0-d, the valid tokens (Σ row_tokens, 0 when none): the count of a metric over them
        (``with_metrics``), from the [B] row counts rather than a pass over ``valid``."""
        return self.row_tokens.sum()

    @property
    def keep_f(self) -> Tensor:
        """``keep`` as 0/1 in the compute dtype (``valid_f`` itself while nothing is dropped)."""
        return self.valid_f if self.keep is self.valid else self.keep.to(self.valid_f.dtype)

    def score_logp(self) -> Tensor:
        """log π_θ(y_t) for the REINFORCE-form surrogates ℓ = −sg(w)·A·log π (CISPO, DPPO): the value
        of ``logp`` with the gradient of ``log_ratio``, so a ratio-stage term (GSPO's sequence
        ratio, a GRPO-λ trace) routes it as it routes the ratio (with none, exactly ``logp``). A cap on
        the ratio's value (``score_route``) does not cut it: these surrogates detach the ratio's
        value, so the cap has no overflow to prevent, and CISPO keeps A·clip(r)·∇log π on every token."""
        route = self.log_ratio
        if self.score_route is not None and self.score_route[0] is route:
            route = self.score_route[1]
        return route - route.detach() + self.logp.detach()


@dataclass(frozen=True)
class LossTerm:
    """A registered term: ``fn(state, options) -> state`` run at ``stage``; ``options`` is its
    frozen options dataclass; ``needs`` names the inputs (``ref_logp``, ``rollout_logp``,
    ``entropy``, ``truncated``) it requires while ``active`` (the entropy reaches the state only
    when a term of the loss needs it); ``differentiates``: inputs it takes on the caller's graph
    (the entropy of an entropy bonus); ``doc`` is fn's first docstring line; ``batch_wide``: its
    selection reads every token of the batch (``register_loss_term``)."""

    name: str
    fn: Callable[[LossState, Any], LossState]
    options: type
    stage: str
    flat: bool = False
    doc: str = ""
    needs: tuple[str, ...] = ()
    when: Callable[[Any], bool] | None = None
    differentiates: tuple[str, ...] = ()
    batch_wide: bool = False

    def active(self, options: Any) -> bool:
        """Whether ``options`` make the term change the loss (a flat term may only log metrics)."""
        return True if self.when is None else bool(self.when(options))

    def make_options(self, values: Any = None) -> Any:
        """An instance of ``options`` from an instance, a mapping of fields, or None (defaults);
        errors name the term, the unknown fields and the valid ones."""
        if isinstance(values, self.options):
            return values
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise TypeError(f"loss term {self.name!r}: expected {self.options.__name__} or a mapping of its "
                            f"fields, got {type(values).__name__}")
        names = [f.name for f in dataclasses.fields(self.options)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"loss term {self.name!r}: unknown option(s) {unknown}; valid options are {names}")
        if not self.fn.__module__.startswith("creditrl."):   # a user's options class may not check its types
            hints = typing.get_type_hints(self.options)
            values = {k: coerce(f"{self.name}.{k}", v, hints.get(k, Any), strict=True) for k, v in values.items()}
        return self.options(**values)


_REGISTRY: dict[str, LossTerm] = {}


def _check_options_class(name: str, options: type, flat: bool) -> None:
    if not (dataclasses.is_dataclass(options) and isinstance(options, type)
            and options.__dataclass_params__.frozen):
        raise TypeError(f"loss term {name!r}: options must be a frozen dataclass type, got {options!r}")
    required = [f.name for f in dataclasses.fields(options)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        raise ValueError(f"loss term {name!r}: every option needs a default, {options.__name__} has none for "
                         f"{required}")
    if flat:
        mine = {f.name for f in dataclasses.fields(options)}
        for other in _REGISTRY.values():
            clash = mine & {f.name for f in dataclasses.fields(other.options)} if other.flat and other.name != name else ()
            if clash:
                raise ValueError(f"loss term {name!r}: flat option name(s) {sorted(clash)} already belong to "
                                 f"flat term {other.name!r}")


def register_loss_term(name: str, *, options: type, stage: str, flat: bool = False,
                       needs: Sequence[str] = (), when: Callable[[Any], bool] | None = None,
                       differentiates: Sequence[str] = (), batch_wide: bool = False, overwrite: bool = False):
    """Decorator: register ``fn(state: LossState, options) -> LossState`` as loss term ``name``.

    ``options``: a frozen dataclass, every field with a default (``metadata["help"]`` documents
    it); ``stage``: one of ``STAGES`` (a non-flat term of an ``EXCLUSIVE_STAGES`` stage replaces
    the flat one there when chosen); ``flat``: its fields sit directly under ``loss.`` (and the
    term is always on); ``needs``: inputs required while ``when(options)`` is true (default:
    always); ``differentiates``: needed inputs it takes with their gradient (only ``entropy``);
    ``batch_wide``: which tokens it keeps or penalises depends on every token it is given (a
    quantile, a top-k), so micro-batches would change the gradient (a trainer refuses them).
    Re-registering a name raises unless ``overwrite=True`` or it is the same function.
    """
    if stage not in STAGES:
        raise ValueError(f"stage: unknown value {stage!r}; valid values are {list(STAGES)}")
    unknown = sorted(set(needs) - set(INPUTS))
    if unknown:
        raise ValueError(f"needs: unknown input(s) {unknown}; valid inputs are {list(INPUTS)}")
    if not set(differentiates) <= set(needs) & {"entropy"}:
        raise ValueError(f"differentiates: expected needed inputs among ['entropy'], got {list(differentiates)} "
                         f"(needs {list(needs)})")
    if not name.isidentifier():
        raise ValueError(f"name: expected a Python identifier (it names config keys), got {name!r}")
    _check_options_class(name, options, flat)

    def decorator(fn: Callable[[LossState, Any], LossState]) -> Callable[[LossState, Any], LossState]:
        try:
            inspect.signature(fn).bind(None, None)
        except (TypeError, ValueError):
            raise TypeError(f"loss term {name!r}: {plugin_name(fn)} must take (state, options), its signature is "
                            f"{_signature(fn)}") from None
        old = _REGISTRY.get(name)
        if old is not None and not overwrite and old.fn is not fn and (old.fn.__qualname__, old.fn.__module__) != (
                getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)):
            raise ValueError(f"loss term {name!r} is already registered to {old.fn!r}; pass overwrite=True")
        _REGISTRY[name] = LossTerm(name, fn, options, stage, flat, doc_summary(fn.__doc__), tuple(needs), when,
                                   tuple(differentiates), batch_wide)
        return fn

    return decorator


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(unknown)"


BT_FIELDS = ("logp", "old_logp", "ref_logp", "rollout_logp", "entropy", "log_ratio", "token_loss", "valid", "valid_f",
             "keep")


def apply_term(term: LossTerm, options: Any, state: LossState) -> LossState:
    """``term.fn(state, options)``, checked: a user's term that raises (but for a ValueError, the library's
    bad-input type) or returns anything but a ``LossState`` whose [B,T] fields keep their shape is a
    ``PluginError`` naming it. The checks are Python attribute and shape reads (no device work)."""
    try:
        out = term.fn(state, options)
    except ValueError:
        raise
    except Exception as err:
        if is_builtin(term.fn):
            raise
        raise PluginError(f"loss term {term.name!r} ({plugin_name(term.fn)}) raised {type(err).__name__}: {err}"
                          ) from err
    if not isinstance(out, LossState):
        raise PluginError(f"loss term {term.name!r} ({plugin_name(term.fn)}): expected fn(state, options) to return "
                          f"a LossState (e.g. state.add_token_loss(...)), got {type(out).__name__}")
    shape = state.valid.shape
    for name in BT_FIELDS:
        x = getattr(out, name)
        if x is not None and x.shape != shape:
            raise PluginError(f"loss term {term.name!r} ({plugin_name(term.fn)}): expected state.{name} of shape "
                              f"{list(shape)} ([B,T]), got {list(x.shape)}")
    for name in ("advantages", "weight"):
        x = getattr(out, name)
        if x is not None and x.shape not in (shape, shape[:1] + (1,)):
            raise PluginError(f"loss term {term.name!r} ({plugin_name(term.fn)}): expected state.{name} of shape "
                              f"{list(shape)} or [{shape[0]}, 1], got {list(x.shape)}")
    if out.loss is not None and out.loss.dim() != 0:
        raise PluginError(f"loss term {term.name!r} ({plugin_name(term.fn)}): expected state.loss to be a scalar "
                          f"(0-d), got shape {list(out.loss.shape)}")
    return out


def list_loss_terms() -> list[str]:
    """Names of the registered terms, in the order they apply (stage, then registration)."""
    return [t.name for t in sorted(_REGISTRY.values(), key=lambda t: STAGES.index(t.stage))]


def get_loss_term(name: str) -> LossTerm:
    """The term registered as ``name``, or the one whose function ``"package.module:function"``
    names (importing the module registers it)."""
    if not isinstance(name, str):
        raise TypeError(f"loss term: expected a registered name or 'package.module:function', got "
                        f"{type(name).__name__}")
    if name in _REGISTRY:                       # the common case, without building the error text
        return _REGISTRY[name]
    return registered_entry(
        _REGISTRY, name, what="loss term",
        unknown=f"loss term: unknown name {name!r}; registered terms are {list_loss_terms()}, or give an import "
                "path 'package.module:function'",
        unregistered="decorate it with @creditrl.register_loss_term(name, options=..., stage=...)")


def builtin_loss_terms() -> list[LossTerm]:
    """creditrl's own loss terms (a user's term, even once imported, is configured in the nested
    spelling under ``terms`` by its import path, so a saved config never depends on import order)."""
    terms = [get_loss_term(name) for name in list_loss_terms()]
    return [t for t in terms if t.fn.__module__.startswith("creditrl.")]


def resolve_loss_terms(spec: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """Term name -> options instance from either form a user writes:

    - a mapping ``{name or "pkg.mod:fn": options instance | mapping of fields | None}``;
    - a list of mappings, each with ``path`` (an import path or a registered name) or ``name``
      and the term's option fields: ``[{"path": "my_mod:length_penalty", "coef": 0.01}]``
      (the form of ``creditrl train loss.terms=[...]`` and TRL's ``loss_terms``).

    Each term at most once. Errors name the entry and the valid options."""
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        items = [_list_entry(i, entry) for i, entry in enumerate(spec)]
    else:
        raise TypeError(f"terms: expected a mapping or a list of mappings, got {type(spec).__name__}")
    resolved: dict[str, Any] = {}
    for key, values in items:
        term = get_loss_term(key)
        if term.name in resolved:
            raise ValueError(f"terms: loss term {term.name!r} is given twice")
        resolved[term.name] = term.make_options(values)
    return resolved


def _list_entry(index: int, entry: Any) -> tuple[str, dict]:
    if not isinstance(entry, Mapping):
        raise TypeError(f"terms[{index}]: expected a mapping with 'path' (or 'name') and options, got "
                        f"{type(entry).__name__}")
    keys = [k for k in ("path", "name") if k in entry]
    if len(keys) != 1:
        raise ValueError(f"terms[{index}]: expected exactly one of 'path' or 'name', got keys {sorted(entry)}")
    return entry[keys[0]], {k: v for k, v in entry.items() if k != keys[0]}
