"""What `creditrl diagnose` will measure, checked before any model loads or any rollout is sampled:
the estimators (labels ``NAME`` and ``NAME+loo``), the sampling plan (P prompts × M groups of N)
and the gradient space that fits the memory allowed.

Gradient space (``choose_space``): the statistics hold K·E·D float32 fold sums plus, per prompt, its M
draws [M, E, D] (float32 and a float64 copy) and their float64 sum, about D·E·(4K + 12M + 16) bytes.
All trainable parameters when that fits in ``max_memory_gb``; else the parameters named by the
``params`` prefixes; else a count sketch of dimension d of all trainable parameters (plus its
hash tables, 5 bytes per parameter); else refused, naming the memory the sketch needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from creditrl.config import Config
from creditrl.core.estimators import compute_advantages, list_estimators
from creditrl.core.estimators.registry import get_estimator
from creditrl.core.estimators.labels import LOO, all_labels

REFERENCE, GRPO = "rloo", "grpo"
DERIVED = "dr_grpo"          # exactly (N−1)/N × rloo: added from rloo's statistics, no backward
GB = 1 << 30


@dataclass(frozen=True)
class Plan:
    """The sampling plan and the estimators: ``specs`` label -> (registered name, options) of the
    estimators that get a backward; ``labels`` every estimator reported (``dr_grpo`` derived)."""
    prompts: int
    groups_per_prompt: int
    group_size: int
    folds: int
    specs: dict[str, tuple[str, dict]]
    labels: tuple[str, ...]
    configured: str                   # the label of the configured estimator (its B_simple is headlined)
    batch: int                        # groups per training step (rollout.prompts_per_step)
    seed: int

    @property
    def groups(self) -> int:
        return self.prompts * self.groups_per_prompt

    @property
    def timed(self) -> dict[str, tuple[str, dict]]:
        """Every reported estimator's (name, options), the derived ones included (for their cost)."""
        return {**self.specs, **{label: (label, {}) for label in self.labels if label not in self.specs}}


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


def estimator_specs(labels: Sequence[str] | None, configured: dict, k: int | None,
                    group_size: int, arg: str = "diagnose.estimators") -> dict[str, tuple[str, dict]]:
    """label -> (name, options) for every label (None: ``all_labels``), with rloo and grpo always
    measured; each checked by running it on a dummy group of ``group_size`` (errors name ``arg``)."""
    if group_size < 2:
        raise ValueError(f"rollout.group_size: expected at least 2 responses per group (the estimators compare "
                         f"responses within a group; a group of 1 has no baseline), got {group_size}")
    chosen = list(dict.fromkeys([REFERENCE, GRPO, *(all_labels(k) if labels is None else labels)]))
    known = list_estimators()
    specs = {}
    for label in chosen:
        name, loo = label.removesuffix(LOO), label.endswith(LOO)
        if name not in known or (loo and not get_estimator(name).leave_one_out):
            loos = [n + LOO for n in known if get_estimator(n).leave_one_out]
            raise ValueError(f"{arg}: unknown estimator {label!r}; expected one of {known + loos}")
        options = options_for(name, configured, k, loo)
        if options.get("k", 0) is None:
            raise ValueError(f"diagnose.k: estimator {label!r} needs K (max@K); set diagnose.k or "
                             f"algorithm.options.k, or leave {label!r} out of {arg}")
        _try(label, name, options, group_size, arg)
        specs[label] = (name, options)
    return specs


def _try(label: str, name: str, options: dict, group_size: int, arg: str) -> None:
    g = group_size
    try:
        compute_advantages(name, rewards=(torch.arange(g) % 2).float(), mask=torch.ones(g, 2, dtype=torch.bool),
                           group=torch.zeros(g, dtype=torch.long), energy=torch.ones(g, 2), **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{arg}: estimator {label!r} with options {options} at rollout.group_size={g}: {err}") from None


def statistics_bytes(dim: int, estimators: int, folds: int, groups_per_prompt: int) -> int:
    """Bytes of the gradient statistics over a D = ``dim`` space (module docstring)."""
    return dim * estimators * (4 * folds + 12 * groups_per_prompt + 16)


@dataclass(frozen=True)
class GradientSpace:
    """``kind``: all / subset / sketch; ``params`` the parameters differentiated; ``dim`` D of a draw;
    ``covered`` the parameters the draws see; ``bytes`` the estimated memory."""
    kind: str
    names: tuple[str, ...]
    params: tuple[torch.Tensor, ...]
    dim: int
    covered: int
    bytes: int

    def describe(self) -> str:
        size = f"{self.bytes / GB:.2f} GB"
        if self.kind == "all":
            return f"all {self.covered:,} trainable parameters, flat ({size})"
        if self.kind == "subset":
            return f"the subset {list(self.names)[:4]}{'...' if len(self.names) > 4 else ''} ({self.covered:,} " \
                   f"parameters, flat; {size})"
        return f"a count sketch of dimension {self.dim:,} of all {self.covered:,} trainable parameters ({size})"


def choose_space(model, prefixes: Sequence[str] | None, estimators: int, folds: int, groups_per_prompt: int,
                 max_memory_gb: float, sketch_dim: int) -> GradientSpace:
    """All trainable parameters, else the ``prefixes`` subset, else a count sketch (module docstring)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("model: expected trainable parameters (requires_grad), got none")
    limit = max_memory_gb * GB

    def need(dim: int) -> int:
        return statistics_bytes(dim, estimators, folds, groups_per_prompt)

    total = sum(p.numel() for _, p in named)
    if need(total) <= limit:
        return GradientSpace("all", tuple(n for n, _ in named), tuple(p for _, p in named), total, total, need(total))
    if prefixes:
        subset = [(n, p) for n, p in named if any(n.startswith(x) for x in prefixes)]
        if not subset:
            raise ValueError(f"diagnose.params: expected prefixes of trainable parameter names (e.g. "
                             f"{[n for n, _ in named[-3:]]}), got {list(prefixes)}")
        size = sum(p.numel() for _, p in subset)
        if need(size) <= limit:
            return GradientSpace("subset", tuple(n for n, _ in subset), tuple(p for _, p in subset), size, size,
                                 need(size))
    sketch = need(sketch_dim) + 5 * total
    if sketch > limit:
        raise ValueError(f"diagnose.max_memory_gb: expected at least {sketch / GB:.2f} GB (a count sketch of "
                         f"dimension diagnose.sketch_dim={sketch_dim} of the {total:,} trainable parameters under "
                         f"{estimators} estimators needs that; all parameters flat need {need(total) / GB:.2f} GB), "
                         f"got {max_memory_gb}")
    return GradientSpace("sketch", tuple(n for n, _ in named), tuple(p for _, p in named), sketch_dim, total, sketch)


def make_plan(cfg: Config) -> Plan:
    """The plan of a resolved config (refuses unknown estimators and groups of 1)."""
    d, options = cfg.diagnose, dict(cfg.algorithm.options)
    k = d.k if d.k is not None else options.get("k")
    specs = estimator_specs(d.estimators, options, k, cfg.rollout.group_size)
    labels = (*specs, "dr_grpo") if "dr_grpo" not in specs else tuple(specs)
    specs = {label: spec for label, spec in specs.items() if label != "dr_grpo"}   # derived from rloo
    configured = cfg.algorithm.estimator + (LOO if options.get("leave_one_out") else "")
    return Plan(prompts=d.prompts, groups_per_prompt=d.groups_per_prompt, group_size=cfg.rollout.group_size,
                folds=d.folds or min(8, d.prompts), specs=specs, labels=labels, configured=configured,
                batch=cfg.rollout.prompts_per_step, seed=cfg.train.seed if d.seed is None else d.seed)
