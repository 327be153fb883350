"""``creditrl.diagnose(model, tokenizer, dataset, reward_funcs, ...)``: `creditrl diagnose` for a TRL
user, without creditrl's config. ``dataset``: a Hugging Face ``datasets.Dataset`` (or a list of row
dicts) with a ``prompt`` column (a string or chat messages, TRL's conventions); every other column
is passed to the reward functions. ``reward_funcs``: TRL-style reward functions
``f(prompts, completions, **columns) -> list[float | None]`` (one or a list, summed as TRL does with
``reward_weights``), called through ``creditrl.tasks.rewards`` exactly as in training."""
from __future__ import annotations

import math
import random
import typing
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from creditrl.config import AlgorithmConfig, Config, ConfigError, DiagnoseConfig, RolloutConfig, validate
from creditrl.config import validate_diagnose
from creditrl.core.losses import PolicyLoss, compose
from creditrl.runtime.gradient_space import choose_space
from creditrl.tasks.base import Problem
from creditrl.tasks.chat import check_prompt
from creditrl.tasks.rewards import RewardFunction, Scores, score_terms
from creditrl.tools.diagnose.plan import LossChoice, Plan, budget_seconds, check_label, estimator_specs, loss_choice
from creditrl.tools.diagnose.run import diagnose_policy
from creditrl.utils.options import coerce
from creditrl.utils.rundir import check_new_run


class DatasetTask:
    """A task over a dataset's rows (``sample`` draws a row) scored by TRL-style reward functions."""

    name = "dataset"
    max_tool_calls = 0
    tool_stop = None

    def __init__(self, dataset, reward_funcs: Callable | Sequence[Callable], reward_weights: Sequence[float] | None,
                 chat_template: str = "auto", system_prompt: str | None = None):
        rows = [dict(row) for row in dataset]
        if not rows or "prompt" not in rows[0]:
            got = sorted(rows[0]) if rows else "no rows"
            raise ValueError(f"dataset: expected rows with a 'prompt' column (TRL's convention), got {got}")
        self.problems = [Problem(check_prompt(r["prompt"], f"dataset row {i} prompt"), str(r.get("answer", "")),
                                 {"columns": {k: v for k, v in r.items() if k != "prompt"},
                                  "ground_truth": r.get("answer")}) for i, r in enumerate(rows)]
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        weights = [1.0] * len(funcs) if reward_weights is None else [float(w) for w in reward_weights]
        if not funcs or len(weights) != len(funcs):
            raise ValueError(f"reward_weights: expected one weight per reward function ({len(funcs)}), got {weights}")
        columns = sorted({k for p in self.problems for k in p.meta["columns"]})
        self._terms = [(RewardFunction(f, convention="trl", columns=columns, timeout=None, what="reward_funcs"), w)
                       for f, w in zip(funcs, weights)]
        self.chat_template, self.system_prompt = chat_template, system_prompt

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.problems)

    def test_set(self) -> list[Problem]:
        return list(self.problems)

    def score(self, problems: list[Problem], responses: list[str]) -> Scores:
        return score_terms(self._terms, problems, responses)

    def reward(self, problem: Problem, response: str) -> float:
        return self.score([problem], [response]).rewards[0]

    def tool_output(self, response_so_far: str) -> str | None:
        return None


# keyword argument -> (config section, its class, field): checked as `creditrl diagnose` checks that key
ARGUMENTS = {"group_size": ("rollout", RolloutConfig, "group_size"),
             "prompts_per_step": ("rollout", RolloutConfig, "prompts_per_step"),
             "temperature": ("rollout", RolloutConfig, "temperature"), "top_p": ("rollout", RolloutConfig, "top_p"),
             "max_new_tokens": ("rollout", RolloutConfig, "max_new_tokens"),
             "estimator": ("algorithm", AlgorithmConfig, "estimator"),
             **{name: ("diagnose", DiagnoseConfig, name) for name in (
                 "prompts", "groups_per_prompt", "estimators", "k", "params", "max_memory_gb", "sketch_dim", "folds",
                 "seed", "target_width", "budget_min", "adam_warmup")}}


def _renamed(message: str) -> str:
    """A config check's message with each config key replaced by its keyword argument's name."""
    for arg, (section, _, name) in sorted(ARGUMENTS.items(), key=lambda kv: -len(kv[1][2])):
        message = message.replace(f"{section}.{name}", arg)
    return message


def check_arguments(values: dict) -> tuple[Config, DiagnoseConfig]:
    """The keyword arguments typed (strictly: a number is never read from a string) and checked as
    the CLI checks their config keys, every error naming the argument."""
    typed: dict[str, dict] = {"rollout": {}, "algorithm": {}, "diagnose": {}}
    for arg, value in values.items():
        section, cls, name = ARGUMENTS[arg]
        hint = int if arg == "max_new_tokens" else typing.get_type_hints(cls)[name]
        typed[section][name] = coerce(arg, value, hint, strict=True)
    try:
        cfg = Config(rollout=RolloutConfig(**typed["rollout"]), algorithm=AlgorithmConfig(**typed["algorithm"]))
        settings = DiagnoseConfig(**typed["diagnose"])
        validate(cfg)
        validate_diagnose(settings)
    except ConfigError as err:
        raise ConfigError(_renamed(str(err))) from None
    check_label(typed["algorithm"]["estimator"], "estimator")
    return cfg, settings


def check_weights(reward_weights, funcs: int) -> list[float] | None:
    """``reward_weights``: None or one finite number per reward function."""
    if reward_weights is None:
        return None
    weights = list(reward_weights) if isinstance(reward_weights, (list, tuple)) else None
    if weights is None or len(weights) != funcs or any(
            isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) for w in weights):
        raise ValueError(f"reward_weights: expected a list of {funcs} finite number(s), one per reward function, "
                         f"got {reward_weights!r}")
    return [float(w) for w in weights]


def as_loss(name: str, value: PolicyLoss | Mapping | None, arg: str) -> LossChoice:
    """A ``PolicyLoss``, or a mapping of ``creditrl.policy_loss`` keywords (``{"agg": "seq-mean-token-mean"}``),
    or None (the library's default loss)."""
    if value is None or isinstance(value, PolicyLoss):
        return loss_choice(name, value or PolicyLoss())
    if not isinstance(value, Mapping):
        raise TypeError(f"{arg}: expected a PolicyLoss, a mapping of policy_loss options or None, got "
                        f"{type(value).__name__}")
    try:
        return loss_choice(name, compose(**value))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{arg}: {err}") from None


def plan_for(cfg: Config, d: DiagnoseConfig, loss, losses) -> Plan:
    """The same plan (and checks) as the command, from the checked keyword arguments."""
    configured = cfg.algorithm.estimator
    specs = estimator_specs(d.estimators, configured, {}, d.k, cfg.rollout.group_size, arg="estimators")
    further = dict(losses or {})
    if not isinstance(further, dict):
        raise TypeError(f"losses: expected a mapping name -> loss, got {type(losses).__name__}")
    if "configured" in map(str, further):
        raise ValueError("losses: the name 'configured' is the configured loss's (`loss`) label; expected another "
                         "name for a further loss")
    choices = (as_loss("configured", loss, "loss"), *(as_loss(str(n), v, f"losses[{n!r}]") for n, v in further.items()))
    return Plan(prompts=d.prompts, groups_per_prompt=d.groups_per_prompt, group_size=cfg.rollout.group_size,
                folds=d.folds or min(16, d.prompts), estimators=specs, losses=choices, configured=configured,
                batch=cfg.rollout.prompts_per_step, seed=d.seed if d.seed is not None else 0,
                target_width=d.target_width, budget_s=budget_seconds(d.budget_min, ""), adam=d.adam_warmup > 0)


def diagnose(model, tokenizer, dataset, reward_funcs, *, reward_weights: Sequence[float] | None = None,
             group_size: int = 8, prompts: int = 24, groups_per_prompt: int = 2, estimators: Sequence[str] | None = None,
             k: int | None = None, max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
             params: Sequence[str] | None = None, max_memory_gb: float = 2.0, sketch_dim: int = 65536,
             folds: int | None = None, seed: int = 0, estimator: str = "grpo", prompts_per_step: int = 8,
             loss: PolicyLoss | Mapping | None = None, losses: Mapping[str, PolicyLoss | Mapping] | None = None,
             target_width: float = 0.1, budget_min: float | None = None, adam_warmup: int = 64,
             output_dir: str | Path | None = None, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Measure which estimator gives the best gradient on this model and data (see `creditrl diagnose`;
    the arguments are its ``diagnose.*`` and ``rollout.*`` keys, checked the same way, errors naming the
    argument). ``estimator``: the one you train with now; ``loss``: the loss you train with (a
    ``PolicyLoss`` or a mapping of ``creditrl.policy_loss`` keywords, e.g. ``{"agg": "seq-mean-token-mean"}``
    for TRL's ``loss_type="grpo"``; None: token-mean, TRL's default ``dapo``); ``losses``: further losses
    by name. Returns the result (``["recommendation"]["text"]``, ``["rows"]``, ``["noise"]``, ...); with
    ``output_dir`` also writes diagnose.md/json/png there."""
    given = dict(locals())
    arguments = {name: given[name] for name in ARGUMENTS}
    cfg, d = check_arguments(arguments)
    try:
        plan = plan_for(cfg, d, loss, losses)
    except ConfigError as err:
        raise ConfigError(_renamed(str(err))) from None
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    task = DatasetTask(dataset, funcs, check_weights(reward_weights, len(funcs)))
    run_dir = Path(output_dir).expanduser() if output_dir is not None else None
    if run_dir is not None:
        check_new_run(run_dir, overwrite=overwrite, key="output_dir", resume_hint=False,
                      kind="diagnose")   # deleted once done
    rows = len(plan.rows) * (2 if plan.adam else 1)
    space = choose_space(model, d.params, rows, plan.folds, plan.groups_per_prompt, d.max_memory_gb, d.sketch_dim,
                         key="params", memory_key="max_memory_gb")
    rollout = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
               "max_new_tokens": cfg.rollout.max_new_tokens, "max_tool_tokens": cfg.rollout.max_tool_tokens,
               "stop_strings": ()}
    setting = {"model": getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__,
               "task": f"dataset of {len(task.problems)} rows", "adam_warmup": d.adam_warmup}
    return diagnose_policy(model, tokenizer, task, plan, space, rollout, setting=setting, run_dir=run_dir,
                           overwrite=overwrite, key="output_dir", progress=progress)
