"""What `creditrl diagnose` will measure, checked before any model loads or any rollout is sampled:
the rows (every estimator, labels ``NAME`` and ``NAME+loo``, under every loss compared), the
sampling plan (rounds of P prompts × M groups of N) and its stopping rule.

Everything is read from the registries: every registered estimator (``creditrl.core.estimators``)
is a row unless ``diagnose.estimators`` names a subset, and a loss is any composition of
registered loss terms (``creditrl.core.losses``), so an estimator or a term registered anywhere
appears here with no list to edit.

Rows: the plain policy gradient of ``rloo`` (sum over tokens, mean over responses: unbiased, the
*reference* every scale and cosine is measured against, stats name ``REF``), then each estimator
under the configured loss (labelled by the estimator), then each estimator under each further
loss of ``diagnose.losses`` (labelled ``estimator · loss``). A loss is measured at ratio 1 (the
rollout policy, ``creditrl.runtime.group_gradients.loss_cotangent``); a term whose value for one
group depends on the other groups of a mini-batch (e.g. a quantile over it) cannot be measured
group by group: ``loss_notes`` names it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from creditrl.core.estimators import check_group_size, list_estimators
from creditrl.core.estimators.labels import LOO, all_labels, name_of, takes_k
from creditrl.core.estimators.registry import get_estimator
from creditrl.config import ConfigError
from creditrl.core.losses import PolicyLoss
from creditrl.runtime.group_gradients import gradient_outside_logp, non_additive_terms

REFERENCE, GRPO = "rloo", "grpo"
REF = "reference"             # the plain policy gradient of rloo (unbiased)
ADAM = "@adam"                # suffix of a row's Adam-preconditioned statistics


@dataclass(frozen=True)
class LossChoice:
    """A loss compared: ``name`` (the configured one is ``configured``), the composed ``loss``, its
    ``text`` in words and the ``notes`` on terms that cannot be measured group by group."""
    name: str
    loss: PolicyLoss
    text: str
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """The sampling plan, the rows and the stopping rule.

    ``estimators``: label -> (registered name, options); ``losses``: the configured loss first;
    ``configured``: the configured estimator's label; ``batch``: groups per training step;
    ``budget_s``: the wall-time budget; ``adam``: whether an Adam column is measured; ``adam_decides``:
    whether it (not the plain one) decides the labels (v̂ from a real run's optimizer state)."""
    prompts: int
    groups_per_prompt: int
    group_size: int
    folds: int
    estimators: dict[str, tuple[str, dict]]
    losses: tuple[LossChoice, ...]
    configured: str
    batch: int
    seed: int
    target_width: float
    budget_s: float
    adam: bool
    adam_decides: bool = False        # v̂ from a training run's optimizer state: the Adam column decides

    def row_label(self, estimator: str, loss: LossChoice) -> str:
        return estimator if loss is self.losses[0] else f"{estimator} · {loss.name}"

    @property
    def rows(self) -> dict[str, tuple[str, dict]]:
        """Stats name -> (estimator name, options) of every measured row, ``REF`` first."""
        out = {REF: (REFERENCE, {})}
        for loss in self.losses:
            out.update({self.row_label(e, loss): spec for e, spec in self.estimators.items()})
        return out

    @property
    def row_losses(self) -> dict[str, PolicyLoss | None]:
        out: dict[str, PolicyLoss | None] = {REF: None}
        for loss in self.losses:
            out.update({self.row_label(e, loss): loss.loss for e in self.estimators})
        return out

    @property
    def row_parts(self) -> dict[str, tuple[str, str]]:
        """Row label -> (estimator label, loss name)."""
        return {self.row_label(e, loss): (e, loss.name) for loss in self.losses for e in self.estimators}

    @property
    def configured_row(self) -> str:
        return self.configured

    @property
    def groups(self) -> int:
        """Groups per round."""
        return self.prompts * self.groups_per_prompt

    def ranked(self, row: str) -> bool:
        """max@K estimators target another objective (the max@K gradient): reported, not ranked."""
        return not takes_k(self.row_parts[row][0])


def options_for(name: str, configured: dict, k: int | None, loo: bool) -> dict:
    """The configured options that estimator ``name`` declares, ``k`` for max@K ones, the label's
    ``leave_one_out``."""
    spec = get_estimator(name)
    declared = spec.options or {}
    options = {key: v for key, v in configured.items() if key in declared and key not in ("k", "leave_one_out")}
    if spec.k_range is not None:
        options["k"] = k
    if spec.leave_one_out:
        options["leave_one_out"] = loo
    return options


def check_label(label: str, arg: str) -> tuple[str, bool]:
    """(registered name, leave_one_out) of an estimator label, or a ValueError naming ``arg``."""
    known = list_estimators()
    name, loo = name_of(label), label.endswith(LOO)
    if name not in known or (loo and not get_estimator(name).leave_one_out):
        loos = [n + LOO for n in known if get_estimator(n).leave_one_out]
        raise ConfigError(f"{arg}: unknown estimator {label!r}; expected one of {known + loos}")
    return name, loo


def estimator_specs(labels: Sequence[str] | None, configured_label: str, configured: dict, k: int | None,
                    group_size: int, arg: str = "diagnose.estimators") -> dict[str, tuple[str, dict]]:
    """label -> (name, options) for every label (None: ``all_labels``), with rloo, grpo and the
    configured estimator always measured; each checked on a dummy group of ``group_size`` (errors
    name ``arg``)."""
    if group_size < 2:
        raise ConfigError(f"rollout.group_size: expected at least 2 responses per group (the estimators compare "
                         f"responses within a group; a group of 1 has no baseline), got {group_size}")
    chosen = list(dict.fromkeys([REFERENCE, GRPO, configured_label, *(all_labels(k) if labels is None else labels)]))
    specs = {}
    for label in chosen:
        name, loo = check_label(label, arg if label != configured_label else "estimator")
        options = options_for(name, configured, k, loo)
        if options.get("k", 0) is None:
            if label == configured_label:
                raise ValueError(f"algorithm.options.k: the configured estimator {label!r} needs K (max@K)")
            raise ValueError(f"diagnose.k: estimator {label!r} needs K (max@K); set diagnose.k or "
                             f"algorithm.options.k, or leave {label!r} out of {arg}")
        try:
            check_group_size(name, options, group_size, key="rollout.group_size")
        except ValueError as err:
            where = "diagnose.k" if "k" in options and label != configured_label and arg == "diagnose.estimators" \
                else arg                                                # the key the user set
            raise ValueError(f"{where}: estimator {label!r} with options {options}: {err}") from None
        specs[label] = (name, options)
    return specs


def loss_notes(loss: PolicyLoss) -> tuple[str, ...]:
    """Terms of ``loss`` that cannot be measured group by group (``non_additive_terms``: a term whose
    value for a group depends on the rest of the mini-batch, e.g. a quantile over it) or whose gradient
    also flows through the entropy (``gradient_outside_logp``: the entropy bonus), each named, with
    what diagnose measures instead."""
    notes = [f"`{name}` cannot be measured group by group: its value for a group depends on the other groups "
             f"of the training mini-batch (e.g. a quantile over it); measured over each group of N alone"
             for name in non_additive_terms(loss)]
    notes += [f"`{name}` acts through the entropy's gradient, not log π's, which is what diagnose measures: "
              f"measured without it" for name in gradient_outside_logp(loss)]
    kl = loss.options_of("kl")
    if kl is not None and kl.kl_coef > 0:
        notes.append("`kl` pulls toward the reference policy, which is the policy measured here (the first step "
                     "of training): the gradient of k2, k3, k1+ and k3+ is exactly 0 there and k1's averages 0, "
                     "so this row shows no pull")
    return tuple(notes)


def describe_loss(loss: PolicyLoss) -> str:
    """The loss in words: its active terms with the options that differ from their defaults."""
    parts = []
    for term, options in loss.terms:
        if not term.active(options):
            continue
        defaults = term.make_options()
        changed = [f"{f.name}={getattr(options, f.name)!r}" for f in dataclasses.fields(options)
                   if getattr(options, f.name) != getattr(defaults, f.name) or f.name == "agg"]
        parts.append(f"{term.name}({', '.join(changed)})" if changed else term.name)
    return " + ".join(parts)


def loss_choice(name: str, loss: PolicyLoss) -> LossChoice:
    return LossChoice(name, loss, describe_loss(loss), loss_notes(loss))


def loss_label(index: int, values: dict) -> str:
    """A further loss's name: its ``name`` key, else its keys and values (``agg=seq-mean-token-mean``)."""
    if "name" in values:
        return str(values["name"])
    return ", ".join(f"{k}={v}" for k, v in values.items()) or f"loss {index + 1}"


def budget_seconds(budget_min: float | None, model_name: str) -> float:
    """The wall-time budget: ``diagnose.budget_min``, or 2.5 min for builtin:tiny and 12 min otherwise."""
    if budget_min is not None:
        return 60.0 * budget_min
    return 60.0 * (2.5 if model_name == "builtin:tiny" else 12.0)


def check_width(target_width: float, key: str = "diagnose.target_width") -> float:
    if not (isinstance(target_width, (int, float)) and not isinstance(target_width, bool)
            and math.isfinite(target_width) and target_width > 0):
        raise ValueError(f"{key}: expected a number > 0 (0.1 = ±10%), got {target_width!r}")
    return float(target_width)
