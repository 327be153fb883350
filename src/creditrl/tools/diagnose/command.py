"""`creditrl diagnose [--config F] [--overwrite] [key=value ...]`: the `train` config (model, LoRA,
task, rollout, estimator, loss) plus its own ``diagnose`` section (``creditrl.config.DiagnoseConfig``,
``diagnose.*`` overrides), so the measurement runs on exactly the setting a user is about to train.
Everything the configs name is checked before the model loads (estimators, losses, an optimizer
state's run); the memory and the optimizer state's parameters once the model is loaded, before any
sampling."""
from __future__ import annotations

import dataclasses
import time
from datetime import datetime
from pathlib import Path

from creditrl.core.losses import PolicyLoss
from creditrl.config import Config, ConfigError, DiagnoseConfig, check_overlong, load_diagnose_config, run_inputs
from creditrl.core.estimators.labels import LOO, takes_k
from creditrl.core.estimators.registry import get_estimator, list_estimators
from creditrl.recipe import reference
from creditrl.recipe.resolve import overlong_refusal, precision_of, resolve_config, resolve_device, resolve_loss
from creditrl.recipe.build import (build_task, default_max_new_tokens, load_configured_policy,
                                   policy_loss_from_config, rollout_kwargs)
from creditrl.runtime.gradient_space import choose_space
from creditrl.tools.diagnose.optimizer_state import check_run, from_checkpoint
from creditrl.tools.diagnose.plan import (Plan, budget_seconds, estimator_specs, loss_choice, loss_label)
from creditrl.tools.diagnose.run import diagnose_policy
from creditrl.trainer.precision import resolve_precision
from creditrl.utils import cli
from creditrl.utils.durations import format_duration
from creditrl.utils.options import deep_update
from creditrl.utils.rundir import check_new_run
from creditrl.utils.threads import torch_threads


HELP = "measure which estimator (and loss) gives the best gradient on this model/task"


def main(argv: list[str]) -> int:
    parser = cli.config_parser(
        "diagnose", HELP, "Sample rounds of diagnose.prompts prompts x diagnose.groups_per_prompt groups with the "
        "configured policy and compare every estimator's exact gradient of the configured loss at matched signal "
        "until the reference is resolved and the configured estimator's interval is within "
        "±diagnose.target_width, or diagnose.budget_min runs out; writes diagnose.md/.json/.png to a run "
        "directory. Same config as `train` plus its diagnose section (diagnose.* keys).",
        reference.epilog() + "\n" + reference.diagnose_help())
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory of the same "
                        "diagnose.run_name once the new report is complete (without it an existing one is refused)")
    args = cli.parse(parser, argv)

    def run() -> int:
        cfg, settings = load_diagnose_config(args.config, args.overrides)
        run_dir = run_command(cfg, settings, overwrite=args.overwrite, progress=not args.no_progress)
        print((run_dir / "diagnose.md").read_text())
        return 0
    return cli.run("diagnose", run)


def run_dir_of(cfg: Config, d: DiagnoseConfig, plan: Plan) -> Path:
    name = d.run_name or (f"diagnose-{Path(cfg.task.name).name.replace(':', '-')}-"
                          f"{Path(cfg.model.name).name.replace(':', '-')}-s{plan.seed}-{datetime.now():%Y%m%d-%H%M%S}")
    return Path(cfg.train.output_dir).expanduser() / name


def further_loss(cfg: Config, index: int, values: dict, configured: PolicyLoss):
    """A ``diagnose.losses`` entry: its keys over the configured ``loss`` section, resolved (errors
    name ``diagnose.losses[i]``) and composed; refused where it would do nothing (a term's options
    without its switch, or the ``configured`` loss itself)."""
    where = f"diagnose.losses[{index}]"
    data = {k: v for k, v in values.items() if k != "name"}
    for key, section in data.items():      # the configured loss gives every switch: check the entry's own
        if isinstance(section, dict) and "enabled" not in section and section \
                and not (cfg.loss.get(key) or {}).get("enabled", False):
            raise ConfigError(f"{where}.{key}.{next(iter(section))}: given, but {key} is off in the configured loss "
                              f"and this entry does not switch it on, so it would do nothing; add "
                              f"{key}: {{enabled: true}} to the entry, or drop it")
    try:
        loss = resolve_loss(deep_update(cfg.loss, data))
        composed = policy_loss_from_config(dataclasses.replace(cfg, loss=loss)).loss
    except (ConfigError, ValueError, TypeError) as err:
        message = str(err).replace("loss.", f"{where}.", 1)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None
    if composed == configured:
        raise ConfigError(f"{where}: {values!r} composes the configured loss itself, so its rows would repeat the "
                          f"configured rows; expected a loss that differs from it")
    return loss_choice(loss_label(index, values), composed)


def check_loss_labels(labels: list[str]) -> None:
    """Each further loss's label (its ``name``, else its keys) names its rows, so it must be unique
    and not the configured loss's: a repeated one would overwrite the other's rows."""
    for i, label in enumerate(labels[1:]):
        if label in labels[:i + 1]:
            first = labels.index(label)
            taken = "the configured loss" if first == 0 else f"diagnose.losses[{first - 1}]"
            raise ConfigError(f"diagnose.losses[{i}]: its label {label!r} is already {taken}'s; expected a unique "
                              f"label per loss (give each a distinct `name`)")


def without_refusals(cfg: Config, d: DiagnoseConfig, specs: dict) -> dict:
    """``specs`` less the estimators that refuse the rewards the overlong penalty gives (maxrl, passk_chen):
    left out of the default rows, refused where ``diagnose.estimators`` lists them."""
    out = {}
    for label, (name, options) in specs.items():
        refusal = overlong_refusal(cfg, name, options)
        if refusal and d.estimators is not None and label in d.estimators:
            raise ConfigError(f"diagnose.estimators: {refusal}; leave {label!r} out")
        if not refusal:
            out[label] = (name, options)
    return out


def make_plan(cfg: Config, d: DiagnoseConfig) -> Plan:
    """The plan of a resolved config and its diagnose section (estimators and losses checked)."""
    options = dict(cfg.algorithm.options)
    name = get_estimator(cfg.algorithm.estimator).name
    configured = name + (LOO if options.get("leave_one_out") else "")
    k = d.k if d.k is not None else options.get("k")
    specs = without_refusals(cfg, d, estimator_specs(d.estimators, configured, options, k, cfg.rollout.group_size))
    if d.k is not None and not any(takes_k(name) for name, _ in specs.values()):
        raise ConfigError(f"diagnose.k: K of the max@K estimators, but none is measured (diagnose.estimators: "
                          f"{d.estimators}); leave diagnose.k unset or list a max@K estimator "
                          f"({', '.join(n for n in list_estimators() if takes_k(n))})")
    configured_loss = policy_loss_from_config(cfg).loss
    losses = (loss_choice("configured", configured_loss),
              *(further_loss(cfg, i, values, configured_loss) for i, values in enumerate(d.losses or [])))
    check_loss_labels([loss.name for loss in losses])
    return Plan(prompts=d.prompts, groups_per_prompt=d.groups_per_prompt, group_size=cfg.rollout.group_size,
                folds=d.folds or min(16, d.prompts), estimators=specs, losses=losses, configured=configured,
                batch=cfg.rollout.prompts_per_step, seed=cfg.train.seed if d.seed is None else d.seed,
                target_width=d.target_width, budget_s=budget_seconds(d.budget_min, cfg.model.name),
                adam=d.adam_warmup > 0 or d.optimizer_state is not None, adam_decides=d.optimizer_state is not None)


def rollout_settings(cfg: Config, task, tokenizer) -> dict:
    """``generate_rollouts``' keywords as training samples (``rollout_kwargs``), the automatic
    ``rollout.max_new_tokens`` resolved and the overlong buffer checked against it."""
    max_new = cfg.rollout.max_new_tokens or default_max_new_tokens(task, tokenizer)
    check_overlong(cfg.rollout.overlong, max_new)
    return rollout_kwargs(cfg, max_new)


def setting_notes(cfg: Config) -> list[str]:
    """What the measurement does not reproduce of the training setting, said in the report."""
    if not cfg.rollout.dynamic_sampling.enabled:
        return []
    return ["rollout.dynamic_sampling is on: training drops groups without a reward spread and refills the "
            "step; diagnose measures every sampled group, those included (their gradient is 0 for the group "
            "baselines, not for reinforce, reinforce_plus_plus or a batch-scaled estimator), so rows that "
            "differ only there read closer together than in training"]


def run_command(cfg: Config, d: DiagnoseConfig | None = None, *, overwrite: bool = False,
                progress: bool = True) -> Path:
    """The whole command; returns the run directory."""
    start = time.perf_counter()
    d = d or DiagnoseConfig()
    cfg = resolve_config(cfg)
    plan = make_plan(cfg, d)
    run_dir = run_dir_of(cfg, d, plan)
    # an existing report is deleted only once the new one is written (``publish``)
    check_new_run(run_dir, overwrite=overwrite, key="diagnose.run_name", resume_hint=False, kind="diagnose",
                  inputs={**run_inputs(cfg), "diagnose.optimizer_state": d.optimizer_state})
    state_dir = check_run(d.optimizer_state, cfg) if d.optimizer_state else None
    task = build_task(cfg)
    threads = cfg.train.threads or (1 if cfg.model.name == "builtin:tiny" else None)
    with torch_threads(threads):
        model, tokenizer = load_configured_policy(cfg, task, resolve_device(cfg.train.device), progress)
        rows = len(plan.rows) * (2 if plan.adam else 1)
        space = choose_space(model, d.params, rows, plan.folds, plan.groups_per_prompt, d.max_memory_gb, d.sketch_dim)
        vhat = from_checkpoint(state_dir, model, space) if state_dir is not None else None
        rollout = rollout_settings(cfg, task, tokenizer)
        cfg, choice = resolve_precision(cfg, model, tokenizer, task)     # auto: timed on this model, as train
        setting = {"model": cfg.model.name, "task": cfg.task.name + (f" {dict(cfg.task.options)}" if cfg.task.options
                                                                     else ""), "adam_warmup": d.adam_warmup,
                   "precision": cfg.train.precision + (f" ({choice.text()})" if choice is not None else ""),
                   "notes": setting_notes(cfg)}
        with precision_of(cfg).autocast(model):      # sampling, forward and backward as training runs them
            diagnose_policy(model, tokenizer, task, plan, space, rollout, setting=setting, vhat=vhat,
                            adam_source=f"the AdamW state of {state_dir}" if state_dir is not None else "",
                            run_dir=run_dir, overwrite=overwrite, progress=progress)
    print(f"run directory: {run_dir}  (total wall time incl. model load: {format_duration(time.perf_counter() - start)})")
    return run_dir
