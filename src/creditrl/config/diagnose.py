"""`creditrl diagnose`'s own section (``diagnose.*``), apart from the training config: it is read
with the train config by ``load_diagnose_config`` and never saved in a run's config.yaml."""
from __future__ import annotations

from dataclasses import dataclass

from creditrl.config.checks import _check_labels, _positive, check_run_name
from creditrl.config.schema import ConfigError
from creditrl.utils.options import opt


@dataclass
class DiagnoseConfig:
    """`creditrl diagnose`: which estimator (and loss) gives the best gradient on this model and task,
    and whether a larger group pays. Read by `creditrl diagnose` only, from the `diagnose` section of
    the same config file as `train` (or `diagnose.*` overrides); a training run's config.yaml does
    not hold it."""
    prompts: int = opt(24, "P distinct prompts sampled per round (one batched generate call); rounds go on until "
                           "the reference's mean gradient is resolved and the configured estimator's efficiency "
                           "interval is within ±diagnose.target_width, or diagnose.budget_min runs out. The "
                           "intervals are over prompts (the resampling unit).")
    groups_per_prompt: int = opt(2, "Independent groups of rollout.group_size responses per prompt (>= 2: two groups "
                                    "of one prompt separate the variance within a prompt from that across prompts).")
    target_width: float = opt(0.1, "Stop once the configured estimator's efficiency interval (against rloo; "
                                   "against grpo when the configured one is rloo or an exact multiple of it, e.g. "
                                   "dr_grpo) lies within ×(1 ± target_width) of its value (0.1: ±10%; below 1) and "
                                   "the reference is resolved.")
    budget_min: float | None = opt(None, "Wall-time budget in minutes after the model has loaded (warm-up, rounds, "
                                         "report); the run stops at the end of the prompt in progress. null = 2.5 for "
                                         "builtin:tiny, 12 for other models.")
    estimators: list[str] | None = opt(None, "Estimators compared: registered names, `NAME+loo` for the "
                                             "`leave_one_out=true` form. null = every registered estimator and "
                                             "every leave_one_out form, at algorithm.options where they apply "
                                             "(the max@K ones only when diagnose.k or algorithm.options.k is set).")
    losses: list[dict] | None = opt(None, "Further losses to compare, as (estimator × loss) rows: each a mapping of "
                                          "`loss` keys over the configured loss (e.g. `[{agg: seq-mean-token-mean}, "
                                          "{stapo: {enabled: true}}]`; an optional `name` labels it; labels must "
                                          "differ from each other and from `configured`); one that composes the "
                                          "configured loss, or sets a term's options without its switch, is refused. "
                                          "null = the configured loss only.")
    k: int | None = opt(None, "K of the max@K estimators (maxpo, ei, pkpo, passk_chen, maxk_bon); null = "
                              "algorithm.options.k when set.")
    params: list[str] | None = opt(None, "Parameter-name prefixes whose gradient is measured (`[all]`: every trainable "
                                         "parameter). null = all trainable parameters of a model up to 20M of them; "
                                         "of a larger one the last block and the final norm (one backward per row "
                                         "through that block only). LoRA: the adapters are the trainable ones.")
    max_memory_gb: float = opt(2.0, "Memory allowed for the gradient statistics: the measured parameters flat when "
                                    "they fit, else a count sketch of dimension diagnose.sketch_dim (printed).")
    sketch_dim: int = opt(65536, "Dimension d of the count sketch (inner products unbiased; a squared norm's "
                                 "relative error about sqrt(2/d)).")
    optimizer_state: str | None = opt(None, "A training run directory whose newest checkpoint's AdamW state gives v̂ "
                                            "for the Adam column (ĝ/√v̂); it must have trained the same model. null = "
                                            "v̂ from diagnose.adam_warmup groups of the configured estimator.")
    adam_warmup: int = opt(64, "Groups sampled before the rounds to estimate Adam's v̂ = E[ĝ_step²] per parameter "
                               "when diagnose.optimizer_state is null; 0 = no Adam column.")
    folds: int | None = opt(None, "Jackknife folds of prompts behind the 95% intervals (2 <= folds <= "
                                  "diagnose.prompts); null = min(16, diagnose.prompts).")
    seed: int | None = opt(None, "Seed of the prompts and the sampling; null = train.seed.")
    run_name: str | None = opt(None, "Run directory under train.output_dir; null = "
                                     "`diagnose-<task>-<model>-s<seed>-<time>`.")


def validate_diagnose(d: DiagnoseConfig) -> None:
    """The ``diagnose`` section's own values (the estimators, losses and the memory are checked
    against the registries and the model by ``creditrl diagnose`` before it samples)."""
    check_run_name("diagnose.run_name", d.run_name)
    for key, value in (("diagnose.target_width", d.target_width), ("diagnose.budget_min", d.budget_min),
                       ("diagnose.max_memory_gb", d.max_memory_gb)):
        _positive(key, value)
    if d.target_width >= 1:   # ×(1 − w) would reach 0: the width condition would hold for any interval
        raise ConfigError(f"diagnose.target_width: expected a number below 1 (0.1 = ±10%), got {d.target_width!r}")
    if d.adam_warmup < 0:
        raise ConfigError(f"diagnose.adam_warmup: expected an integer >= 0, got {d.adam_warmup}")
    if d.losses is not None and (not d.losses or not all(isinstance(x, dict) for x in d.losses)):
        raise ConfigError(f"diagnose.losses: expected a non-empty list of mappings of loss keys (e.g. "
                          f"[{{agg: seq-mean-token-mean}}]) or null, got {d.losses!r}")
    for key, value, low in (("diagnose.prompts", d.prompts, 2), ("diagnose.groups_per_prompt", d.groups_per_prompt, 2),
                            ("diagnose.sketch_dim", d.sketch_dim, 1), ("diagnose.folds", d.folds, 2),
                            ("diagnose.k", d.k, 1)):
        if value is not None and value < low:
            raise ConfigError(f"diagnose.{key.split('.')[1]}: expected an integer >= {low}, got {value}")
    if d.folds is not None and d.folds > d.prompts:
        raise ConfigError(f"diagnose.folds: expected at most diagnose.prompts={d.prompts} (folds of prompts), "
                          f"got {d.folds}")
    if d.seed is not None and not 0 <= d.seed < 2**32:
        raise ConfigError(f"diagnose.seed: expected an integer in [0, 2**32 - 1], got {d.seed}")
    _check_labels("diagnose.estimators", d.estimators)
    if d.params is not None and (not d.params or not all(d.params)):
        raise ConfigError(f"diagnose.params: expected a non-empty list of parameter-name prefixes or null, "
                          f"got {d.params}")
